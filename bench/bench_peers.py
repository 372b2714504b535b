"""This project's kernels next to the libraries a serving engineer would pick instead (H200).

    python bench/bench_peers.py [--families mxfp8,router,...] [--peer-jit] [--out FILE]

Per family, on the same inputs in the same process: the peer's result is checked against ours
first (bit-exact where both follow the same rule, else within the stated tolerance -- a peer
that disagrees is reported, not timed), then both are timed (CUDA-graph replay, inputs rotated
past L2; where ours writes rotated ``out`` buffers, a peer that allocates its outputs keeps
them, :func:`kept_outputs`, so neither writes one L2-resident buffer) and the table gives
shape, ours, peer, ratio and % of 4.3 TB/s. A peer that does not
import or run here (wheel missing, another torch, no sm_90 path, a JIT compiler it needs) is a
row saying which and why. FlashInfer's ``top_k`` runs with its JIT off unless ``--peer-jit``
(its nvcc build outlasts a device call): the module ``tools/build-flashinfer-topk.sh``
prebuilds, else a "does not run" row.

Families and peers (wheels: ``.devcache/peers``, ``.devcache/peers-flashinfer`` and, for
DeepGEMM, ``.devcache/peers-dg``: ``bash tools/device.sh deepgemm``; see docs/device.md), in the
table's order:

* MXFP8 quantisation, plain and swizzled scales: FlashInfer ``mxfp8_quantize``, its "cuda" and
  "cute-dsl" backends (the same round-up scale rule: equal scales, e4m3 codes equal or one
  step apart -- the row counts those, :func:`e4m3_agreement`); plain scales: torchao
  ``triton_to_mxfp8_dim0`` ("rceil", the same rule: bit-exact expected);
* RMS statistic: quack ``rmsnorm_fwd(..., store_rstd=True)`` (it also writes the normalised
  rows: its bytes are counted) -- rstd compared to 1e-5 relative;
* RMSNorm with a weight (``rms_norm``): quack ``rmsnorm_fwd`` and Liger's
  ``LigerRMSNormFunction`` (Triton, "llama" casting) -- to 6 bf16 unit roundoffs relative
  (other rounding points; :func:`norm_rows`);
* softmax over bf16 score rows: quack ``softmax_fwd`` against ``masked_softmax`` with every key
  selected -- to 3 bf16 unit roundoffs (:data:`SOFTMAX_REL_BOUND`);
* DeepSeek-V3 router (sigmoid, 8 groups, top-4 groups, top-8, bias): FlashInfer
  ``fused_topk_deepseek`` (top-k and weights only; ours also packs and pads the rows for the
  expert GEMMs: the comparison is stated as such), and FlashInfer's top-k followed by the same
  packing in PyTorch ops (``moe.router.align_torch``: like for like) -- same experts and
  weights to 1e-5, the same packed layout;
* the indexer's top-k select (``indexer_select``): FlashInfer ``top_k`` and ``torch.topk`` --
  the same index sets;
* WO-A (bf16, V4-Flash): ``torch._grouped_mm`` (group-major output; ``bmm`` is in
  ``bench/bench_wo_a_v4.py``);
* routed-expert down projection at V4-Flash's shapes: DeepGEMM's masked grouped FP8 GEMM
  (``sgl-deep-gemm``; per-128 FP32 scales: not the same math, both checked against FP32,
  :func:`deepgemm_rows`).

Not covered yet: torchao's swizzled-scale path, a gate/up comparison (ours fuses SiLU * up and
the requantisation into it), a finalize peer: FlashInfer's finalize runs inside its fused MoE
only; SGLang's standalone ``moe_finalize_fuse_shared`` (a fork of that kernel with the
shared-expert add: ``sglang/kernels/jit/csrc/moe/`` in the sglang 0.5.23 wheel, a TVM-FFI module
compiled on first use) needs its module prebuilt for sm_90a here, as
``tools/build-flashinfer-topk.sh`` does for FlashInfer's top-k -- not built yet.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import H200_COPY_BW, markdown_table, report, rotation_count, time_graph  # noqa: E402

from cute_kernels.indexer_topk import IndexerWorkspace, default_plan, indexer_select  # noqa: E402
from cute_kernels.masked_softmax import masked_softmax  # noqa: E402
from cute_kernels.wo_a import wo_a  # noqa: E402
from cute_kernels.rms_norm import rms_norm  # noqa: E402
from cute_kernels.row_rms import row_rms  # noqa: E402
from moe.experts import expert_kernel_args, moe_expert_gemm, quantize_expert_weights  # noqa: E402
from moe.quant import mxfp8_quantize, mxfp8_quantize_routed, scale_buffer_size  # noqa: E402
from bench_moe import unexplained_picks  # noqa: E402
from moe.router import V4_FLASH_ROUTER, MoeRouter, RouterConfig, align_torch, capacity  # noqa: E402


#: |ours - peer| <= NORM_REL_BOUND * |peer| per element for the weighted RMSNorm (norm_rows)
NORM_REL_BOUND = 6 * 2.0 ** -8


def _peer(name: str):
    """The imported peer module, or the reason it is unavailable (a string)."""
    try:
        if name == "flashinfer":
            import flashinfer
            import flashinfer.fused_moe  # fused_topk_deepseek lives here (0.7)
            return flashinfer
        if name == "quack":  # the package re-exports a function named rmsnorm over its module
            return importlib.import_module("quack.rmsnorm")
        if name == "deepgemm":
            _preload_cuda_libs("nvrtc", "cublasLt", "cublas")  # its _C.so links their CUDA 13 sonames
            return importlib.import_module("deep_gemm")
        if name == "torchao":
            return importlib.import_module("torchao.prototype.mx_formats.kernels")
        if name == "liger":
            import liger_kernel.ops.rms_norm
            return liger_kernel.ops.rms_norm
    except Exception as e:  # noqa: BLE001 -- any failure to load is a table row
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        if e.__cause__ is not None:  # e.g. torch.ops.load_library's OSError: the loader's own message
            why += f" ({str(e.__cause__).splitlines()[0][:160]})"
        return why
    return f"unknown peer {name}"


def _preload_cuda_libs(*names: str) -> None:
    """Load ``lib{name}.so.13`` from the NVIDIA wheels beside torch (``nvidia/cu13/lib``), where
    the dynamic loader does not look, so a peer library linking those sonames resolves them."""
    import ctypes
    import glob

    for name in names:
        for path in glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "**",
                                           f"lib{name}.so.13"), recursive=True):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                break
            except OSError:
                continue


def kept_outputs(call):
    """``call`` (``i -> result``) with every result kept alive while the graph is captured, so
    each call of a peer that allocates its outputs writes fresh memory -- as ours does into its
    rotated ``out`` buffers. (A result dropped inside the capture frees its block to the next
    call's allocation: every replayed call would then write the same, L2-resident buffer.)"""
    kept = []

    def launch(i):
        r = call(i)
        kept.append(r)
        return r

    return launch


def does_not_run(e: Exception) -> str:
    """A table row's note for a peer call that raised (the whole message goes to stderr)."""
    print(f"peer raised {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    return f"does not run: {type(e).__name__}: {str(e)[:80]}"


def row(family, shape, peer, t_ours, t_peer, nbytes, note=""):
    return [family, shape, peer, f"{t_ours * 1e6:.2f}", f"{t_peer * 1e6:.2f}" if t_peer else "-",
            f"{t_peer / t_ours:.2f}x" if t_peer else "-", f"{100 * nbytes / t_ours / H200_COPY_BW:.0f}%", note]


def e4m3_agreement(q: torch.Tensor, peer: torch.Tensor) -> str | None:
    """"bit-exact", or how many e4m3 codes differ by one step (a rounding that differs at a
    tie or below the normal range: each peer element then lies within one e4m3 ulp of ours),
    or None when some code is further away (or its sign differs)."""
    a, b = q.view(torch.uint8).int(), peer.view(torch.uint8).int()
    if torch.equal(a, b):
        return "bit-exact"
    # e4m3 codes of one sign are ordered like their values: one step apart == adjacent values
    zeros = ((a | b) & 0x7F) == 0  # +0 and -0: one value
    sign_same = ((a & 0x80) == (b & 0x80)) | zeros
    near = ((a & 0x7F) - (b & 0x7F)).abs() <= 1
    if not bool((sign_same & near).all()):
        return None
    n = int(((a != b) & ~zeros).sum())
    if n == 0:
        return "equal values (signed zeros differ)"
    return f"{n} of {a.numel()} e4m3 codes one step from ours ({100 * n / a.numel():.3f}%)"


def mxfp8_rows(fi):
    """FlashInfer's ``mxfp8_quantize``, each backend: "cuda" (on sm_90 it returns zeros -- its
    kernel converts with sm_100 instructions -- which the check reports) and "cute-dsl", with
    its default programmatic dependent launch (PDL: in the timed graph of back-to-back calls a
    launch overlaps the previous one's tail) and without -- each against ours launched the same
    way (``pdl=True`` / the default), so "ours us" is the same-launch figure."""
    rows = []
    K = 7168
    for T in (64, 4096, 16384):
        for swz in (False, True):
            layout = "swizzled" if swz else "plain"
            shape = f"{T}x{K} {layout}"
            nbytes = T * K * 2 + T * K + scale_buffer_size(T, K, layout)
            n = rotation_count(nbytes)
            xs = [torch.randn(T, K, device="cuda").bfloat16() for _ in range(n)]
            t_ours = time_graph(lambda i: mxfp8_quantize(xs[i], layout=layout), n, max(n, 20))
            if isinstance(fi, str):
                rows.append(row("MXFP8 quant", shape, "FlashInfer", t_ours, None, nbytes, fi))
                continue
            t_ours_pdl = time_graph(lambda i: mxfp8_quantize(xs[i], layout=layout, pdl=True), n, max(n, 20))
            q, s = mxfp8_quantize(xs[0], layout=layout)
            for backend, pdl in (("cuda", None), ("cute-dsl", None), ("cute-dsl", False)):
                peer = f"FlashInfer ({backend}{', no PDL' if pdl is False else ''})"

                def call(i, swz=swz, backend=backend, pdl=pdl):
                    return fi.mxfp8_quantize(xs[i], is_sf_swizzled_layout=swz, backend=backend, enable_pdl=pdl)

                try:
                    fq, fs = call(0)
                except Exception as e:  # noqa: BLE001
                    rows.append(row("MXFP8 quant", shape, peer, t_ours, None, nbytes,
                                    does_not_run(e)))
                    continue
                fs8 = fs.view(torch.uint8).view(-1)
                same_s = fs8.numel() >= s.numel() and torch.equal(s.view(-1), fs8[:s.numel()])
                agree = e4m3_agreement(q, fq.view(T, K))
                if agree is None:
                    zeros = not bool(fq.view(torch.uint8).any())
                    rows.append(row("MXFP8 quant", shape, peer, t_ours, None, nbytes,
                                    "returns all zeros here: not timed" if zeros else
                                    "e4m3 values more than one code apart from ours: not timed"))
                    continue
                t_fi = time_graph(call, n, max(n, 20))
                with_pdl = pdl is not False  # FlashInfer's default launch is PDL
                rows.append(row("MXFP8 quant", shape, peer + (" vs ours with PDL" if with_pdl else ""),
                                t_ours_pdl if with_pdl else t_ours, t_fi, nbytes,
                                agree + ("; scales equal" if same_s else "; scale buffer differs")))
    return rows


def rms_rows(qk):
    rows = []
    for T, C in ((64, 7168), (4096, 7168), (16384, 7168)):
        nbytes = T * C * 2 + T * 4
        n = rotation_count(nbytes)
        xs = [torch.randn(T, C, device="cuda").bfloat16() for _ in range(n)]
        outs = [torch.empty(T, device="cuda") for _ in range(n)]
        t_ours = time_graph(lambda i: row_rms(xs[i], 1e-6, out=outs[i]), n, max(n, 20))
        if isinstance(qk, str):
            rows.append(row("RMS statistic", f"{T}x{C}", "quack", t_ours, None, nbytes, qk))
            continue
        try:
            _, _, rstd = qk.rmsnorm_fwd(xs[0], None, eps=1e-6, store_rstd=True)
        except Exception as e:  # noqa: BLE001
            rows.append(row("RMS statistic", f"{T}x{C}", "quack", t_ours, None, nbytes,
                            does_not_run(e)))
            continue
        ours = row_rms(xs[0], 1e-6)
        if not ((rstd - ours).abs() <= 1e-5 * ours).all():
            rows.append(row("RMS statistic", f"{T}x{C}", "quack", t_ours, None, nbytes, "rstd differs: not timed"))
            continue
        t_q = time_graph(kept_outputs(lambda i: qk.rmsnorm_fwd(xs[i], None, eps=1e-6, store_rstd=True)), n,
                         max(n, 20))
        rows.append(row("RMS statistic", f"{T}x{C}", "quack (also writes the normalised rows)", t_ours, t_q,
                        nbytes))
    return rows


def norm_rows(qk, lg):
    """RMSNorm with a weight (bf16 in and out) at the decode runtime's norm shapes. The peers
    round once (quack: x * rstd * w in FP32) or twice (Liger's "llama" casting: x * rstd, then
    the product with w); ours rounds three times (the statistic too: the model's rounding
    points). Each rounding moves a value by at most u = 2^-8 relative, so the outputs agree
    per element to :data:`NORM_REL_BOUND` (5 u first order, with slack for the FP32 sums'
    order); the row states the largest difference seen."""
    rows = []
    for T, C in ((6, 4096), (384, 4096), (24576, 512), (4096, 7168)):
        nbytes = 2 * T * C * 2 + C * 2
        n = rotation_count(nbytes)
        xs = [torch.randn(T, C, device="cuda").bfloat16() for _ in range(n)]
        outs = [torch.empty(T, C, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
        w = (torch.randn(C, device="cuda") * 0.1 + 1).bfloat16()
        t_ours = time_graph(lambda i: rms_norm(xs[i], 1e-6, w, out=outs[i]), n, max(n, 20))
        ours = rms_norm(xs[0], 1e-6, w)
        peers = (("quack", qk, lambda x: qk.rmsnorm_fwd(x, w, eps=1e-6)[0]),
                 ("Liger (llama casting)", lg, lambda x: lg.LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama")))
        for name, mod, call in peers:
            if isinstance(mod, str):
                rows.append(row("RMSNorm (weighted)", f"{T}x{C}", name, t_ours, None, nbytes, mod))
                continue
            try:
                theirs = call(xs[0])
            except Exception as e:  # noqa: BLE001
                rows.append(row("RMSNorm (weighted)", f"{T}x{C}", name, t_ours, None, nbytes,
                                does_not_run(e)))
                continue
            diff = (ours.float() - theirs.float()).abs()
            if not (diff <= NORM_REL_BOUND * theirs.float().abs()).all():
                rows.append(row("RMSNorm (weighted)", f"{T}x{C}", name, t_ours, None, nbytes,
                                f"outputs differ by more than {NORM_REL_BOUND / 2.0 ** -8:.0f} bf16 unit roundoffs: "
                                "not timed"))
                continue
            rel = (diff / theirs.float().abs().clamp_min(1e-30)).max().item()
            t_p = time_graph(kept_outputs(lambda i: call(xs[i])), n, max(n, 20))
            rows.append(row("RMSNorm (weighted)", f"{T}x{C}", name, t_ours, t_p, nbytes,
                            f"max relative difference {rel / 2.0 ** -8:.1f} u"))
    return rows


def torchao_rows(tao):
    """torchao's MXFP8 row cast (``triton_to_mxfp8_dim0``, Triton, "rceil": the same round-up
    scale rule as ours, plain e8m0 scales [T, K/32]): bit-exact expected, e4m3 bytes and scales."""
    rows = []
    K = 7168
    for T in (64, 4096, 16384):
        nbytes = T * K * 2 + T * K + scale_buffer_size(T, K, "plain")
        n = rotation_count(nbytes)
        xs = [torch.randn(T, K, device="cuda").bfloat16() for _ in range(n)]
        t_ours = time_graph(lambda i: mxfp8_quantize(xs[i], layout="plain"), n, max(n, 20))
        peer = "torchao (Triton)"
        if isinstance(tao, str):
            rows.append(row("MXFP8 quant", f"{T}x{K} plain", peer, t_ours, None, nbytes, tao))
            continue
        try:
            tq, ts = tao.triton_to_mxfp8_dim0(xs[0], 32, "rceil")
        except Exception as e:  # noqa: BLE001
            rows.append(row("MXFP8 quant", f"{T}x{K} plain", peer, t_ours, None, nbytes,
                            does_not_run(e)))
            continue
        q, s = mxfp8_quantize(xs[0], layout="plain")
        same_q = torch.equal(q.view(torch.uint8), tq.view(torch.uint8).view(T, K))
        same_s = torch.equal(s.view(torch.uint8).view(-1), ts.view(torch.uint8).view(-1))
        if not (same_q and same_s):
            rows.append(row("MXFP8 quant", f"{T}x{K} plain", peer, t_ours, None, nbytes,
                            f"{'e4m3 bytes' if not same_q else 'scales'} differ from ours: not timed"))
            continue
        t_p = time_graph(lambda i: tao.triton_to_mxfp8_dim0(xs[i], 32, "rceil"), n, max(n, 20))
        rows.append(row("MXFP8 quant", f"{T}x{K} plain", peer, t_ours, t_p, nbytes, "bit-exact"))
    return rows


#: e4m3's unit roundoff is 2^-4; a product of two rounded operands is off by up to 2 * 2^-4, and
#: the rms relative error of a K-long dot product of random-signed terms stays near that
#: product's (2 * 2^-4 / sqrt(3) ~ 0.07 for uniform rounding): twice it is the gross-error bound
#: on either FP8 GEMM against the FP32 product of its bf16 inputs
FP8_GEMM_REL_BOUND = 2.0 ** -3


def deepgemm_rows(dg):
    """The routed experts' down projection at V4-Flash's shapes (E = 256, k = 6, N = 4096,
    K = 2048) at decode T: ours (``moe_expert_gemm``, MXFP8 with 32-element UE8M0 block
    scales, the router's packed rows, ``expert_kernel_args``) against DeepGEMM's masked grouped
    FP8 GEMM (``m_grouped_fp8_gemm_nt_masked``: per-token 1x128 and per-block 128x128 FP32
    scales, a ``[E, M, K]`` slab per expert) on the same bf16 weights and tokens. Not the same
    math (other block scales): each is checked against the FP32 product of the bf16 inputs
    (:data:`FP8_GEMM_REL_BOUND`), and the row states both errors. Bytes (for the % column):
    the weights and scales of the experts hit, the routed rows in and out (ours)."""
    E, k, N, K = 256, 6, 4096, 2048
    rows = []
    w = torch.randn(E, N, K, device="cuda").bfloat16() / K ** 0.5
    d_q, d_s = quantize_expert_weights(w)
    cast = None
    if not isinstance(dg, str):
        try:
            from deep_gemm.utils.math import per_block_cast_to_fp8, per_token_cast_to_fp8
            b_q = torch.empty(E, N, K, dtype=torch.float8_e4m3fn, device="cuda")
            b_s = torch.empty(E, N // 128, K // 128, device="cuda")
            for e in range(E):
                b_q[e], b_s[e] = per_block_cast_to_fp8(w[e], use_ue8m0=False)
            cast = per_token_cast_to_fp8
        except Exception as e:  # noqa: BLE001
            dg = does_not_run(e)
    for T in (1, 64, 320):
        shape = f"V4-Flash down, T={T}"
        router = MoeRouter(V4_FLASH_ROUTER, max_tokens=T)
        r = router(torch.randn(T, E, device="cuda"), torch.zeros(E, device="cuda"))
        x = torch.randn(T, K, device="cuda").bfloat16()
        n = T * k
        aq, asc = mxfp8_quantize_routed(x, r.sorted_token_ids, r.total_rows, k)
        kw = expert_kernel_args(T)
        y = moe_expert_gemm(aq, asc, d_q, d_s, r.expert_offsets, r.expert_counts, r.tile_expert, routed_rows=n, **kw)
        t_ours = time_graph(lambda i: moe_expert_gemm(aq, asc, d_q, d_s, r.expert_offsets, r.expert_counts,
                                                      r.tile_expert, out=y, routed_rows=n, **kw), 1, 20)
        ids, counts = r.topk_ids.long().cpu(), r.expert_counts.cpu()
        hit = [e for e in range(E) if counts[e] > 0]
        nbytes = len(hit) * N * K * (1 + 1 / 32) + n * K * (1 + 1 / 32) + n * N * 2
        # the FP32 product of the bf16 inputs, per expert, rows in token order
        tok_of = {e: [t for t in range(T) for i in range(k) if ids[t, i] == e] for e in hit}
        ref = {e: x[tok_of[e]].float() @ w[e].float().T for e in hit}
        slots = r.sorted_token_ids[:int(r.total_rows[0])].cpu()
        got = {e: [] for e in hit}
        for p, rid in enumerate(slots.tolist()):
            if rid < n:
                got[int(ids[rid // k, rid % k])].append(p)  # slots of one expert in increasing row order
        err_ours = rel_norm(torch.cat([y[got[e]].float() for e in hit]), torch.cat([ref[e] for e in hit]))
        if isinstance(dg, str):
            rows.append(row("routed-expert GEMM", shape, "DeepGEMM", t_ours, None, nbytes, dg))
            continue
        m_pad = max(64, -(-int(counts.max()) // 64) * 64)
        a = torch.zeros(E, m_pad, K, dtype=torch.bfloat16, device="cuda")
        for e in hit:
            a[e, :len(tok_of[e])] = x[tok_of[e]]
        a_q, a_s = cast(a.view(-1, K), use_ue8m0=False)
        a_q, a_s = a_q.view(E, m_pad, K), a_s.view(E, m_pad, K // 128)
        d = torch.empty(E, m_pad, N, dtype=torch.bfloat16, device="cuda")
        masked_m = counts.to(torch.int32).cuda()
        expected_m = max(1, -(-n // len(hit)))

        def call(i):
            dg.m_grouped_fp8_gemm_nt_masked((a_q, a_s), (b_q, b_s), d, masked_m, expected_m)

        try:
            call(0)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            rows.append(row("routed-expert GEMM", shape, "DeepGEMM", t_ours, None, nbytes,
                            does_not_run(e)))
            continue
        err_dg = rel_norm(torch.cat([d[e, :len(tok_of[e])].float() for e in hit]), torch.cat([ref[e] for e in hit]))
        note = f"rel. error vs FP32: ours {err_ours:.3f}, DeepGEMM {err_dg:.3f} (other block scales)"
        if not (err_ours <= FP8_GEMM_REL_BOUND and err_dg <= FP8_GEMM_REL_BOUND):
            rows.append(row("routed-expert GEMM", shape, "DeepGEMM", t_ours, None, nbytes, note + ": not timed"))
            continue
        t_dg = time_graph(call, 1, 20)
        rows.append(row("routed-expert GEMM", shape, "DeepGEMM (masked)", t_ours, t_dg, nbytes, note))
    return rows


def rel_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


#: bench_peers --peer-jit: FlashInfer may JIT-build its top-k module (module docstring)
TOPK_PEER_JIT = False


def flashinfer_top_k(fi, scores: torch.Tensor, k: int):
    """FlashInfer's ``top_k`` (unsorted, ties to the lower index, graph-safe), its JIT build
    off unless :data:`TOPK_PEER_JIT` (raises FlashInfer's missing-module error then)."""
    saved = os.environ.get("FLASHINFER_DISABLE_JIT")
    if not TOPK_PEER_JIT:
        os.environ["FLASHINFER_DISABLE_JIT"] = "1"
    try:
        return fi.top_k(scores, k, sorted=False, tie_break=1, dsa_graph_safe=True)
    finally:
        if saved is None:
            os.environ.pop("FLASHINFER_DISABLE_JIT", None)
        else:
            os.environ["FLASHINFER_DISABLE_JIT"] = saved


def topk_rows(fi):
    """The indexer's top-k alone (``indexer_select``: a radix select over score rows, indices
    ascending, ties to the lower index) against FlashInfer's ``top_k`` (unsorted, ties to the
    lower index, its graph-safe path) and ``torch.topk``, at V4's CSA top-512 / top-1024 over
    compressed entries (16K / 128K tokens of context) and the raw-key top-2048, over decode
    rows (T = 6: a block-5 verify step of one sequence). Random FP32 scores have no ties: the
    selected index sets must be equal."""
    rows = []
    for T, N, k in ((6, 4096, 512), (384, 4096, 512), (6, 32768, 512), (6, 32768, 1024), (64, 32768, 1024),
                    (6, 32768, 2048), (384, 32768, 2048)):
        ratio = 4 if k < 2048 else 1  # V4's compressed entries (the AOT configs) / raw keys
        shape = f"T={T} N={N} k={k}"
        nbytes = T * N * 4 + T * k * 4
        n = rotation_count(nbytes)
        wss = [IndexerWorkspace(T, N) for _ in range(n)]
        for w in wss:
            w.scores.copy_(torch.randn(T, N, device="cuda"))  # pitch == N: N % 4 == 0
        kv_len = torch.full((T,), N, dtype=torch.int32, device="cuda")
        pos = torch.full((T,), ratio * N - 1, dtype=torch.int32, device="cuda")  # every entry visible
        outs = [torch.empty(T, k, dtype=torch.int32, device="cuda") for _ in range(n)]
        t_ours = time_graph(lambda i: indexer_select(wss[i], kv_len, pos, topk=k, compress_ratio=ratio, out=outs[i]),
                            n, max(n, 20))
        ours = indexer_select(wss[0], kv_len, pos, topk=k, compress_ratio=ratio).long()
        peers = [("torch.topk", lambda i: torch.topk(wss[i].scores, k, dim=-1, sorted=False))]
        if isinstance(fi, str):
            rows.append(row("top-k select", shape, "FlashInfer", t_ours, None, nbytes, fi))
        else:
            peers.insert(0, ("FlashInfer top_k", lambda i: flashinfer_top_k(fi, wss[i].scores, k)))
        for name, call in peers:
            try:
                theirs = call(0)[1].long().sort(-1).values
            except Exception as e:  # noqa: BLE001
                rows.append(row("top-k select", shape, name, t_ours, None, nbytes,
                                does_not_run(e)))
                continue
            if not torch.equal(ours, theirs):
                rows.append(row("top-k select", shape, name, t_ours, None, nbytes, "other indices: not timed"))
                continue
            rows.append(row("top-k select", shape, name, t_ours, time_graph(kept_outputs(call), n, max(n, 20)), nbytes,
                            f"same indices; ours: {select_plan_name(T, N)}"))
    return rows


def select_plan_name(T: int, N: int) -> str:
    """The kernel ``indexer_select``'s default plan takes for T rows of N keys."""
    plan = default_plan(T, N)
    if plan is None:
        return "streaming select"
    cluster, items, async_counts = plan
    return (f"split select, {cluster} CTA{'s' if cluster > 1 else ''} x {items} items"
            + (", red.async counts" if async_counts else ""))


#: |ours - peer| <= SOFTMAX_REL_BOUND * |peer| per probability: each rounds an FP32 value once to
#: bf16 (u = 2^-8 each) from exponentials and sums whose FP32 errors are far smaller
SOFTMAX_REL_BOUND = 3 * 2.0 ** -8


def softmax_rows(qk):
    """Softmax over rows of bf16 scores: ours (``masked_softmax`` with every key selected: the
    mask costs one 8-byte load per 8 scores) against quack's ``softmax_fwd``."""
    rows = []
    for lead, H, M in (((1, 6), 128, 592), ((64, 6), 128, 592), ((1, 6), 128, 6160)):
        R = lead[0] * lead[1] * H
        shape = f"{R}x{M}"
        nbytes = 2 * R * M * 2 + lead[0] * lead[1] * -(-(M + 1) // 16) * 16
        n = rotation_count(nbytes)
        xs = [(torch.randn(*lead, H, M, device="cuda") * 4).bfloat16() for _ in range(n)]
        W = -(-(M + 1) // 16) * 16  # the mask stride of the AOT configs
        mask = torch.ones(*lead, W, dtype=torch.bool, device="cuda")
        outs = [torch.empty_like(x) for x in xs]
        t_ours = time_graph(lambda i: masked_softmax(xs[i], mask, out=outs[i]), n, max(n, 20))
        if isinstance(qk, str):
            rows.append(row("softmax", shape, "quack", t_ours, None, nbytes, qk))
            continue
        try:
            from quack.softmax import softmax_fwd
            theirs = softmax_fwd(xs[0].view(R, M))
        except Exception as e:  # noqa: BLE001
            rows.append(row("softmax", shape, "quack", t_ours, None, nbytes,
                            does_not_run(e)))
            continue
        ours = masked_softmax(xs[0], mask).view(R, M).float()
        diff = (ours - theirs.float()).abs()
        if not bool((diff <= SOFTMAX_REL_BOUND * theirs.float().abs()).all()):
            rows.append(row("softmax", shape, "quack", t_ours, None, nbytes,
                            f"probabilities differ by more than {SOFTMAX_REL_BOUND / 2.0 ** -8:.0f} u: not timed"))
            continue
        rel = (diff / theirs.float().abs().clamp_min(1e-30)).max().item()
        t_p = time_graph(kept_outputs(lambda i: softmax_fwd(xs[i].view(R, M))), n, max(n, 20))
        rows.append(row("softmax", shape, "quack", t_ours, t_p, nbytes, f"max relative difference {rel / 2.0 ** -8:.1f} u"))
    return rows


def wo_a_rows():
    """bf16 WO-A at V4-Flash's shape (G = 8 groups, Dg = 4096, R = 1024) against PyTorch's
    grouped GEMM (``torch._grouped_mm``, 3-D x 3-D: CUTLASS on sm_90), which writes
    group-major ``[G, T, R]`` (ours token-major ``[T, G * R]``: a transpose copy would come on
    top of the peer's time and is not counted). Both against the FP32 product (relative norm
    error <= 2^-7: bf16 outputs of an FP32-accumulated product)."""
    G, R, Dg = 8, 1024, 4096
    rows = []
    n = rotation_count(G * R * Dg * 2)
    ws = [(torch.randn(G, R, Dg, device="cuda") / Dg ** 0.5).bfloat16() for _ in range(n)]
    gm = getattr(torch, "_grouped_mm", None)
    for T in (1, 5, 16, 64, 320):
        shape = f"V4-Flash T={T}"
        o = torch.randn(T, G * 8, Dg // 8, device="cuda").bfloat16()
        y = torch.empty(T, G * R, device="cuda", dtype=torch.bfloat16)
        nbytes = G * R * Dg * 2 + T * G * Dg * 2 + T * G * R * 2
        t_ours = time_graph(lambda i: wo_a(o, ws[i], out=y), n, max(n, 20))
        ref = torch.einsum("tgd,grd->gtr", o.view(T, G, Dg).float(), ws[0].float())
        err_ours = rel_norm(wo_a(o, ws[0]).view(T, G, R).transpose(0, 1).float(), ref)
        a = o.view(T, G, Dg).transpose(0, 1).contiguous()  # [G, T, Dg], made once: not timed

        def call(i):
            return gm(a, ws[i].transpose(1, 2))

        try:
            if gm is None:
                raise AttributeError("this torch has no torch._grouped_mm")
            err_p = rel_norm(call(0).float(), ref)
        except Exception as e:  # noqa: BLE001
            rows.append(row("WO-A bf16", shape, "torch._grouped_mm", t_ours, None, nbytes,
                            does_not_run(e)))
            continue
        note = f"rel. error vs FP32: ours {err_ours:.1e}, peer {err_p:.1e}; peer writes group-major"
        if not (err_ours <= 2.0 ** -7 and err_p <= 2.0 ** -7):
            rows.append(row("WO-A bf16", shape, "torch._grouped_mm", t_ours, None, nbytes, note + ": not timed"))
            continue
        rows.append(row("WO-A bf16", shape, "torch._grouped_mm", t_ours, time_graph(call, n, max(n, 20)), nbytes, note))
    return rows


def router_rows(fi):
    rows = []
    cfg = RouterConfig(num_experts=256, n_group=8, topk_group=4, top_k=8, routed_scaling_factor=2.5)
    for T in (1, 8, 64, 320):
        n = 16
        logits = [torch.randn(T, 256, device="cuda") * 3 for _ in range(n)]
        bias = torch.randn(256, device="cuda") * 0.1
        routers = [MoeRouter(cfg, max_tokens=T) for _ in range(n)]
        t_ours = time_graph(lambda i: routers[i](logits[i], bias), n, 64)
        nbytes = T * 256 * 4
        if isinstance(fi, str):
            rows.append(row("router (V3)", f"T={T} E=256 k=8", "FlashInfer", t_ours, None, nbytes, fi))
            continue
        vals = torch.empty(T, 8, device="cuda")
        idx = torch.empty(T, 8, dtype=torch.int32, device="cuda")
        try:
            fi.fused_moe.fused_topk_deepseek(logits[0], bias, 8, 4, 8, 2.5, vals, idx)
        except Exception as e:  # noqa: BLE001
            rows.append(row("router (V3)", f"T={T} E=256 k=8", "FlashInfer", t_ours, None, nbytes,
                            does_not_run(e)))
            continue
        r = routers[0](logits[0], bias)
        # experts equal, or different only at a near-tie of the two FP32 evaluations; the
        # weights equal on the tokens whose experts agree
        agree, unexplained = unexplained_picks(r.topk_ids, idx, logits[0], bias, cfg)
        ours = [dict(zip(i, w)) for i, w in zip(r.topk_ids.tolist(), r.topk_weights.tolist())]
        theirs = [dict(zip(i, w)) for i, w in zip(idx.tolist(), vals.tolist())]
        weights_equal = all(abs(a[e] - b[e]) <= 1e-5 for a, b, ok in zip(ours, theirs, agree.tolist()) if ok
                            for e in a)
        if unexplained or not weights_equal:
            rows.append(row("router (V3)", f"T={T} E=256 k=8", "FlashInfer", t_ours, None, nbytes,
                            "different experts or weights: not timed"))
            continue
        ties = f"{int((~agree).sum())} token(s) differ at near-ties" if not bool(agree.all()) else ""
        for pdl in (True, False):
            t_fi = time_graph(lambda i, pdl=pdl: fi.fused_moe.fused_topk_deepseek(logits[i], bias, 8, 4, 8, 2.5, vals,
                                                                                   idx, launch_with_pdl=pdl), n, 64)
            rows.append(row("router (V3)", f"T={T} E=256 k=8", "FlashInfer (top-k only; ours also packs rows"
                            + ("" if pdl else "; no PDL") + ")", t_ours, t_fi, nbytes, ties))
        # like for like: FlashInfer's top-k, then the same packed layout in PyTorch ops
        # (align_torch, sync-free: the packing a user without a fused router would add)
        slots, tiles = capacity(cfg, T)

        def topk_and_pack(i):
            fi.fused_moe.fused_topk_deepseek(logits[i], bias, 8, 4, 8, 2.5, vals, idx, launch_with_pdl=True)
            return align_torch(idx, 256, cfg.tile_m, slots, tiles)

        try:
            packed = topk_and_pack(0)
        except Exception as e:  # noqa: BLE001
            rows.append(row("router (V3)", f"T={T} E=256 k=8", "FlashInfer top-k + packing in PyTorch ops", t_ours,
                            None, nbytes, does_not_run(e)))
            continue
        total = int(r.total_rows[0])  # (ours leaves the slots past the total unwritten)
        theirs_l = (*packed[:2], packed[2][:total], *packed[3:])
        ours_l = (r.expert_counts, r.expert_offsets, r.sorted_token_ids[:total], r.tile_expert[:tiles], r.total_rows,
                  r.routed_row_pos)
        comparable = bool(agree.all())  # (experts that differ at near-ties pack differently)
        same = comparable and all(torch.equal(a, b) for a, b in zip(theirs_l, ours_l))
        note = ("packed layout equal to ours" if same else
                "packed layout differs from ours: not timed" if comparable else
                "packed layout not compared (experts differ at near-ties)")
        rows.append(row("router (V3)", f"T={T} E=256 k=8", "FlashInfer top-k + packing in PyTorch ops", t_ours,
                        time_graph(kept_outputs(topk_and_pack), n, 64) if same or not comparable else None,
                        nbytes, note))
    return rows


#: family name -> (its rows' function, the peers it takes), in the table's order
FAMILIES = {
    "mxfp8": (mxfp8_rows, ("flashinfer",)),
    "torchao": (torchao_rows, ("torchao",)),
    "rms": (rms_rows, ("quack",)),
    "norm": (norm_rows, ("quack", "liger")),
    "softmax": (softmax_rows, ("quack",)),
    "router": (router_rows, ("flashinfer",)),
    "topk": (topk_rows, ("flashinfer",)),
    "wo_a": (wo_a_rows, ()),
    "deepgemm": (deepgemm_rows, ("deepgemm",)),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--families", default=None, metavar="F,...",
                    help=f"only these families (default: all of {', '.join(FAMILIES)})")
    ap.add_argument("--peer-jit", action="store_true",
                    help="let FlashInfer JIT-build its top-k module (nvcc; minutes at first use)")
    args = ap.parse_args(argv)
    global TOPK_PEER_JIT
    TOPK_PEER_JIT = args.peer_jit
    names = list(FAMILIES) if args.families is None else [f.strip() for f in args.families.split(",")]
    unknown = sorted(set(names) - set(FAMILIES))
    if unknown:
        raise SystemExit(f"--families: unknown {unknown}; choose from {list(FAMILIES)}")
    peers = {p: _peer(p) for p in {p for f in names for p in FAMILIES[f][1]}}
    rows = []
    for f in names:  # each family's rows printed as they come: a cut-short run still shows them
        fn, needs = FAMILIES[f]
        new = fn(*(peers[p] for p in needs))
        for r in new:
            print("| " + " | ".join(str(c) for c in r) + " |", flush=True)
        rows += new
    command = "python bench/bench_peers.py" + (f" --families {args.families}" if args.families else "")
    report("Peers", command,
           markdown_table(["family", "shape", "peer", "ours us", "peer us", "peer / ours", "ours of 4.3 TB/s",
                           "note"], rows), out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
