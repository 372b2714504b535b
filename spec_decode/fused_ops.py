"""The ``fused`` op families: this project's kernels behind :class:`spec_decode.step_model.Ops`.

Per op family (activations bf16 on the GPU; weights prepared once here, for the target's layers
and the draft's stages):

* mHC: :func:`mhc_stats` with DeepSeek-V4's ``hc_eps`` in two parts -- ``H_pre`` on the main
  stream, ``H_post`` / ``H_res`` (Sinkhorn, five sixths of phi) on a side stream beside the
  sublayer's attention or MoE, joined at the post-mix; bit-equal to one launch --
  :func:`mhc_pre_mix`, :func:`mhc_post_mix` (bit-exact rounding sequences); V4's final
  ``hc_head`` collapse computes ``H_pre`` only;
* RMSNorm (the sublayer, q, kv, per-head, compressor-entry and final norms): one launch of
  :func:`rms_norm` each, with the RoPE that follows the per-head q, KV and entry norms fused in;
* indexer: :func:`indexer_topk` over the layer's compressed indexer entries
  (``compress_ratio = m``: scores + the visible-entry mask + radix top-k, ties to the lower
  entry -- the reference's rule);
* attention (decode / verify / draft steps): :func:`sink_attention` -- the window's rows and the
  compressed entries by row index into the layer's K = V buffer, the sink softmax and the
  inverse RoPE in one launch;
* WO-A: :func:`wo_a` writing token-major (V4's groups of 4096);
* MoE: :class:`MoeRouter` (one launch: sqrt-softplus top-k + bias, or hash-routed from the
  layer's ``tid2eid``), :func:`mxfp8_quantize_routed`, the expert GEMMs (gate/up with the
  SwiGLU clamp, SiLU * up and MXFP8 requantisation fused) and :func:`moe_finalize` fused with
  the shared-expert add (the shared expert on a side stream);
* compressors (decode / verify steps): the kv | gate product with the two weights side by side,
  then :func:`compressor_pool` -- the windows' softmax pooling, norm, RoPE, pool and ring writes.

The row-index arithmetic stays PyTorch ops (:class:`spec_decode.step_model.V4Layer`); prefill
chunks gather their keys (any width). In the draft each stage's context write also runs beside
the stage's mHC statistics (:meth:`spec_decode.engine.Engine._draft_step`).

Draft: :class:`MxDraftHead`, the draft's LM head on an MXFP8 copy (heads of 64 MiB or more,
up to 16 rows; by default per-tensor e4m3 scores above).

Status: CPU-checked glue (``tests/test_fused_ops_plumbing.py``); GPU tests in
``tests/test_spec_decode.py`` and ``tests/test_tensor_parallel.py`` (``-m gpu``).
"""

from __future__ import annotations

import contextlib

import torch

from cute_kernels.compressor_pool import compressor_pool
from cute_kernels.draft_head_fp8 import draft_head_scores, quantize_head
from cute_kernels.indexer_topk import IndexerWorkspace, indexer_topk
from cute_kernels.mhc_post_mix import mhc_post_mix
from cute_kernels.mhc_pre_mix import mhc_pre_mix
from cute_kernels.mhc_stats import MhcStatsWorkspace, mhc_split_phi, mhc_stats
from cute_kernels.rms_norm import rms_norm
from cute_kernels.sink_attention import SinkAttentionWorkspace, sink_attention
from cute_kernels.wo_a import DECODE_MAX_T as WO_A_DECODE_MAX_T
from cute_kernels.wo_a import wo_a
from cute_kernels.wo_a_decode import WoADecodeWorkspace
from moe.experts import (expert_kernel_args, interleave_gate_up, moe_expert_gate_up, moe_expert_gemm,
                         quantize_expert_weights)
from moe.finalize import moe_finalize
from moe.quant import mxfp8_gather_routed, mxfp8_quantize, mxfp8_quantize_routed, scale_buffer_size
from moe.router import MoeRouter, RouterConfig, RouterOutput, align_torch, capacity, topk_torch
from moe.streams import dedicated_stream

from .model import EXPERT_OPERANDS, forward_memo, rope_table, swiglu
from .step_model import Ops, family


def quantize_layer_experts(L: dict) -> dict:
    """Replace layer ``L``'s bf16 routed experts (``ffn.experts.w1 / w3 / w2``) by the MXFP8
    operands :class:`FusedOps` reads (:data:`EXPERT_OPERANDS`: gate and up rows interleaved,
    e4m3 with swizzled UE8M0 block scales; the down projection likewise), in place; returns
    ``L``. Passed as a model's ``on_layer``, each layer is converted as it is made, so the
    model never holds every layer's bf16 experts (V4-Flash's four-layer slice and three draft
    stages: 90 GB of them, against 47 GB as MXFP8). The torch-bf16 and reference backends
    need the bf16 experts: a model converted this way serves only the kernel backends."""
    if EXPERT_OPERANDS[0] in L:
        return L
    # each bf16 tensor dropped as soon as its copy exists: the peak holds one layer's experts
    # once plus the interleaved gate | up, not two copies of everything
    gu = interleave_gate_up(L.pop("ffn.experts.w1"), L.pop("ffn.experts.w3")).contiguous()
    L[EXPERT_OPERANDS[0]], L[EXPERT_OPERANDS[1]] = quantize_expert_weights(gu)
    del gu
    L[EXPERT_OPERANDS[2]], L[EXPERT_OPERANDS[3]] = quantize_expert_weights(L.pop("ffn.experts.w2").contiguous())
    return L


class FusedOps(Ops):
    """Kernels for a bf16 :class:`TargetModel` (and its draft) on a CUDA device."""

    #: the mHC mappings in two parts: H_pre on the main stream (the sublayer's input needs it
    #: now), H_post and H_res -- the Sinkhorn chain and most of phi -- on a side stream beside
    #: the sublayer's body, joined before the post-mix reads them (False: one launch on the
    #: main stream)
    split_mhc = True
    #: the routed experts' input: the step's tokens MXFP8-quantized on the side stream while the
    #: gate product and the router run, then gathered into the router's packing (the same bytes
    #: as quantizing the gathered rows); False: the gathered rows quantized after the router,
    #: on the main stream
    prequantize_routed_input = True

    def __init__(self, target, max_tokens: int, max_len: int, moe_row_tile: int | None = 16,
                 indexer_token_group: int = 3, draft=None, release_bf16_experts: bool = False,
                 wo_a_pdl: bool = False, router_pdl: bool = False, _cpu_for_tests: bool = False):
        """``release_bf16_experts``: delete each layer's bf16 routed-expert weights once their
        MXFP8 copies exist -- the fused MoE never reads them. For an engine that owns its
        model; leave it off where the same model also runs the torch-bf16 ops. ``wo_a_pdl``,
        ``router_pdl``: :attr:`spec_decode.config.EngineConfig.wo_a_pdl`, ``.router_pdl``."""
        cfg = target.cfg
        on_cuda = torch.device(target.device).type == "cuda"
        if target.dtype != torch.bfloat16 or not (on_cuda or _cpu_for_tests):
            raise ValueError("FusedOps needs a bfloat16 TargetModel on a CUDA device")
        if moe_row_tile not in (None, 16, 32, 64):
            raise ValueError(f"moe_row_tile must be None, 16, 32 or 64, got {moe_row_tile!r}")
        if indexer_token_group not in (1, 2, 3, 4):
            raise ValueError(f"indexer_token_group must be 1, 2, 3 or 4, got {indexer_token_group!r}")
        dev = target.device
        self.cfg, self.max_tokens, self.max_len = cfg, max_tokens, max_len
        self.moe_row_tile, self.indexer_token_group = moe_row_tile, indexer_token_group
        for name, flag in (("wo_a_pdl", wo_a_pdl), ("router_pdl", router_pdl)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        self.wo_a_pdl, self.router_pdl = wo_a_pdl, router_pdl
        self.mhc_ws = MhcStatsWorkspace(cfg.mhc_n, max_tokens, device=dev)
        if self.split_mhc:  # H_post / H_res's stream and workspace (split_mhc)
            self.mhc_side = dedicated_stream(dev) if on_cuda else None
            self.mhc_side_ws = MhcStatsWorkspace(cfg.mhc_n, max_tokens, device=dev)
        # what the side stream's launches read and write, held until post_mix joins them (the
        # caching allocator must not hand their memory to the main stream before then)
        self._mhc_pending = []
        self.idx_ws = IndexerWorkspace(max_tokens, max_len // cfg.csa_ratio, device=dev)
        rc = RouterConfig(num_experts=cfg.experts, n_group=1, topk_group=1, top_k=cfg.top_k,
                          routed_scaling_factor=cfg.routed_scaling_factor, score="sqrtsoftplus")
        self.router = MoeRouter(rc, max_tokens=max_tokens, device=dev, pdl=router_pdl)
        self._rc_hash = RouterConfig(num_experts=cfg.experts, n_group=1, topk_group=1, top_k=cfg.top_k,
                                     routed_scaling_factor=cfg.routed_scaling_factor, score="sqrtsoftplus",
                                     hash_routed=True)
        # The shared expert needs only h: it runs on this side stream, forked and joined with
        # events (captured into the step graphs as parallel branches), beside the routed path
        # (after the tokens' MXFP8 quantization, prequantize_routed_input).
        self.side = dedicated_stream(dev) if on_cuda else None
        if self.prequantize_routed_input:  # one buffer for any step: the graphs hold its address
            self._xq = torch.empty(max_tokens, cfg.hidden, dtype=torch.float8_e4m3fn, device=dev)
            self._xs = torch.empty(max_tokens, cfg.hidden // 32, dtype=torch.uint8, device=dev)
        self._layer = {}  # id(layer dict) -> its prepared kernel weights
        self._wo_ws = {}  # WO-A groups -> this object's split-K workspace
        self._attn_ws = {}  # (heads, head dim) -> this object's sink-attention workspace
        heads = target.layers[0]["attn.attn_sink"].numel()  # a rank's heads
        # the attention kernel's shapes (V4: 64 / 128 heads, 16 or 32 per TP4 rank, head dim 512);
        # the CPU glue tests run the row path with a stand-in at any shape
        self.row_attention = _cpu_for_tests or (heads % 16 == 0 and cfg.head_dim % 64 == 0
                                                and 64 <= cfg.head_dim <= 512)
        # the compressor kernel's widths (V4: entries of 512, indexer entries of 128)
        dims_ok = all(d % 64 == 0 and 64 <= d <= 1024 for d in (cfg.head_dim, cfg.indexer_dim))
        if not (_cpu_for_tests or dims_ok):
            self.compress_step = None
        # V4's final stream collapse (target and draft): the mappings kernel with hc_head's
        # weights as the H_pre rows (the other rows zero, never read), then the pre-mix
        self._head = {}
        n, C = cfg.mhc_n, cfg.hidden
        for W in [target.w] + ([draft.w] if draft is not None else []):
            phi = torch.zeros((2 + n) * n, n * C, device=dev)
            phi[:n] = W["hc_head_fn"].float()
            bias = torch.zeros((2 + n) * n, device=dev)
            bias[:n] = W["hc_head_base"].float()
            alpha = torch.zeros(3, device=dev)
            alpha[0] = W["hc_head_scale"].float()[0]
            self._head[id(W)] = (mhc_split_phi(phi, "pre"), alpha, bias)  # H_pre: all the collapse reads
        layers = list(target.layers) + (list(draft.stages) if draft is not None else [])
        for L in layers:
            P = {}
            for site in ("attn", "ffn"):
                phi = L[f"hc_{site}_fn"].float().contiguous()
                for part in ("pre", "post_res") if self.split_mhc else ("all",):
                    P[f"{site}_planes_{part}"] = mhc_split_phi(phi, part)
                P[f"{site}_alpha"] = L[f"hc_{site}_scale"].float().contiguous()
                P[f"{site}_bias"] = L[f"hc_{site}_base"].float().contiguous()
            if "ffn.gate.tid2eid" in L:  # a hash-routed layer: its own router holds its table
                P["router"] = MoeRouter(self._rc_hash, max_tokens=max_tokens, device=dev, pdl=self.router_pdl)
                P["router"].set_hash_table(L["ffn.gate.tid2eid"])
            else:
                P["router"], P["router_bias"] = self.router, L["ffn.gate.bias"].float().contiguous()
            # converted as the model was made, or here from the bf16 experts (the layer keeps them)
            mx = L if EXPERT_OPERANDS[0] in L else quantize_layer_experts(
                {f"ffn.experts.{w}": L[f"ffn.experts.{w}"] for w in ("w1", "w3", "w2")})
            P["gu_q"], P["gu_s"], P["d_q"], P["d_s"] = (mx[k] for k in EXPERT_OPERANDS)
            P["sink"] = L["attn.attn_sink"].float().contiguous()
            sp = "ffn.shared_experts."  # gate and up rows in one product
            P["shared_w13"] = torch.cat([L[sp + "w1.weight"], L[sp + "w3.weight"]]).contiguous()
            for c in ("attn.compressor.", "attn.indexer.compressor."):  # kv and gate rows in one product
                if c + "wkv.weight" in L:
                    P[c + "wkv_gate"] = torch.cat([L[c + "wkv.weight"], L[c + "wgate.weight"]]).contiguous()
            if release_bf16_experts:  # per layer: the peak holds one layer's two copies, not all
                for name in ("w1", "w3", "w2"):
                    L.pop(f"ffn.experts.{name}", None)
            self._layer[id(L)] = P

    # ------------------------------------------------------------------ mHC --------------
    def mhc_mappings(self, X, L, site, cfg):
        """-> the packed fp32 [T, 2n + n*n] mappings the mix kernels read: one launch, or (with
        ``split_mhc``) H_pre on this stream and H_post / H_res forked onto ``mhc_side``,
        joined by :meth:`post_mix` -- bit-equal either way."""
        P = self._layer[id(L)]
        alpha, bias = P[f"{site}_alpha"], P[f"{site}_bias"]
        if not self.split_mhc:
            return self._mappings(X, P[f"{site}_planes_all"], alpha, bias, cfg)
        x, H = self._mappings_out(X, cfg)
        side = self.mhc_side
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())  # fork: X is ready
        # both parts on the default grid: the one-launch kernel's splits, so its summation order
        # (a smaller side grid would leave SMs to the main stream but change the FP32 sums)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            self._stats(x, H, P[f"{site}_planes_post_res"], alpha, bias, cfg, "post_res", self.mhc_side_ws)
        if side is not None:
            self._mhc_pending.append((x, H))
        return self._stats(x, H, P[f"{site}_planes_pre"], alpha, bias, cfg, "pre", self.mhc_ws)

    def _mappings_out(self, X, cfg):
        n = cfg.mhc_n
        B, S = X.shape[:2]
        return X.reshape(B * S, n, cfg.hidden).contiguous(), torch.empty(B * S, 2 * n + n * n, device=X.device)

    def _mappings(self, X, planes, alpha, bias, cfg, maps="all"):
        return self._stats(*self._mappings_out(X, cfg), planes, alpha, bias, cfg, maps, self.mhc_ws)

    @staticmethod
    def _stats(x, H, planes, alpha, bias, cfg, maps, workspace):
        """``maps``' columns of ``H`` from ``x`` (:func:`mhc_stats` with the model's constants)."""
        return mhc_stats(x, planes, alpha, bias, eps=cfg.eps, hc_eps=cfg.hc_eps, sinkhorn_iters=cfg.mhc_sinkhorn_iters,
                         maps=maps, workspace=workspace, out=H)

    @staticmethod
    def _norm_kernel_takes(x, weight) -> bool:
        """Whether :func:`rms_norm` serves this norm (bf16 rows, a weight of their dtype)."""
        return x.dtype == torch.bfloat16 and x.numel() > 0 and (weight is None or weight.dtype == x.dtype)

    def rmsnorm(self, x, eps, weight=None):
        """:meth:`Ops.rmsnorm` in one launch (:func:`rms_norm`: the statistic, its rounding and
        both bf16 multiplies, in place of eight): equal to the composite up to the order of the
        statistic's FP32 sum."""
        if not self._norm_kernel_takes(x, weight):
            return Ops.rmsnorm(self, x, eps, weight)
        return rms_norm(x.contiguous(), eps, weight)

    def rmsnorm_rope(self, x, eps, weight, pos, inv_freq):
        """:meth:`Ops.rmsnorm_rope` in one launch (:func:`rms_norm` with ``rotate``: the
        forward's (cos, sin) table of ``pos``)."""
        if not self._norm_kernel_takes(x, weight):
            return Ops.rmsnorm_rope(self, x, eps, weight, pos, inv_freq)
        table = torch.view_as_real(rope_table(pos, inv_freq)).reshape(-1, inv_freq.shape[0], 2)
        return rms_norm(x.contiguous(), eps, weight, rotate=table)

    def hc_head(self, X, W, cfg):
        """:meth:`Ops.hc_head` in two launches: :func:`mhc_stats` (its ``H_pre`` is hc_head's
        ``sigmoid(s P + b) + hc_eps``) and :func:`mhc_pre_mix` (FP32 sum, one bf16 rounding --
        the definition's), in place of thirteen."""
        head = self._head.get(id(W))
        if head is None:
            return Ops.hc_head(self, X, W, cfg)
        return self.pre_mix(X, self._mappings(X, *head, cfg, maps="pre"))

    def pre_mix(self, X, maps):
        B, S, n, C = X.shape
        return mhc_pre_mix(X.reshape(B * S, n, C).contiguous(), maps).view(B, S, C)

    def post_mix(self, X, maps, f):
        if self._mhc_pending:  # join: the side stream's H_post / H_res
            torch.cuda.current_stream().wait_stream(self.mhc_side)
            self._mhc_pending.clear()
        B, S, n, C = X.shape
        x = X.reshape(B * S, n, C).contiguous()
        return mhc_post_mix(x, maps, f.reshape(B * S, C).to(torch.bfloat16).contiguous()).view(B, S, n, C)

    # -------------------------------------------------------------- indexer --------------
    def indexer_topk(self, q_idx, w_idx, ipool, slots, pos, topk, ratio):
        B, S, Hi, D = q_idx.shape
        N = ipool.shape[1] - 1  # entries a request may hold (the last row is the discarded one)
        rows = ipool.reshape(-1, D)  # request b's entries start at row slot * (N + 1)
        # the step's per-token cache offsets, positions and visible-entry counts: once per forward
        p, slot = self._token_ints(pos, slots)
        off, n_vis = forward_memo(("indexer_args", N, ratio), (p, slot), lambda: (
            slot * (N + 1), torch.div(p + 1, ratio, rounding_mode="floor").clamp_min(0).int()))
        k = min(topk, N)  # the torch-bf16 ops' width
        # a request's tokens are consecutive (t = b * S + s): a group within one request shares
        # its key tiles (a group spanning two requests would score them in per-token passes)
        g = self.indexer_token_group if S % self.indexer_token_group == 0 else 1
        group = dict(token_group=g) if g > 1 else {}
        idx = indexer_topk(q_idx.reshape(B * S, Hi, D).contiguous(), w_idx.reshape(B * S, Hi).float().contiguous(),
                           rows, off, n_vis, p, topk=k, max_keys=N, workspace=self.idx_ws, compress_ratio=ratio,
                           **group)
        idx = idx.view(B, S, k).long()
        return idx.clamp_min(0), idx >= 0

    @staticmethod
    def _token_ints(pos, slots):
        """Each token's position and slot as contiguous int32 ``[B * S]`` (the kernels' per-token
        metadata), once per forward."""
        B, S = pos.shape
        return forward_memo(("token_ints",), (pos, slots), lambda: (
            pos.reshape(-1).int().contiguous(), slots[:, None].expand(B, S).reshape(-1).int().contiguous()))

    # ----------------------------------------------------------- compressor --------------
    def compress_step(self, L, prefix, h, pos, slots, ring, pool, m, csa, inv_freq, eps):
        """:meth:`spec_decode.step_model.V4Layer._close_windows` in two launches: the kv | gate
        rows of the step in one product, then :func:`compressor_pool` (the windows' softmax
        pooling, the norm and RoPE, the pool and ring writes)."""
        B, S, C = h.shape
        fresh = h.reshape(B * S, C) @ self._layer[id(L)][prefix + "wkv_gate"].T
        # each token's entry's first position ((p + 1) // m - 1) m: its RoPE (tokens closing no
        # window get some rotation they never use); once per forward and ratio
        start = forward_memo(("entry_start", m), (pos,), lambda: torch.div(pos + 1, m, rounding_mode="floor") * m - m)
        rot = torch.view_as_real(rope_table(start, inv_freq)).reshape(B * S, -1, 2)
        pos_i, slot_i = self._token_ints(pos, slots)
        compressor_pool(fresh, ring, pool, L[prefix + "ape"], L[prefix + "norm.weight"], rot, pos_i, slot_i, ratio=m,
                        overlap=csa, eps=eps, tokens_per_request=S)

    # ------------------------------------------------------------ attention --------------
    def sink_attention(self, q, kv, rows, L, scale, rotate):
        """:meth:`Ops.sink_attention` in one launch (:func:`sink_attention`: the window and the
        compressed entries, the sink softmax and the inverse RoPE; its split workspace is this
        object's own, created on the first, eager call)."""
        T, H, hd = q.shape
        ws = self._attn_ws.get((H, hd))
        if ws is None:
            ws = self._attn_ws[(H, hd)] = SinkAttentionWorkspace(self.max_tokens, H, hd, device=q.device)
        return sink_attention(q.contiguous(), kv, rows.contiguous(), self._layer[id(L)]["sink"], scale,
                              rotate=rotate.contiguous(), workspace=ws)

    # ------------------------------------------------------------------ WO-A -------------
    def wo_a(self, o, w, cfg):
        B, S, H, hd = o.shape
        R = cfg.wo_rank
        G = w.shape[0] // R
        # this ops object's own split-K workspace: simulated ranks run WO-A concurrently on
        # their own streams, and a workspace serves one call in flight (created on the first,
        # eager call, before any capture)
        ws = self._wo_ws.get(G)
        if ws is None:
            ws = self._wo_ws[G] = WoADecodeWorkspace(G, R, device=o.device)
        # (wo_a_pdl: the decode kernels' programmatic dependent launch, at their T only -- above,
        # the route's cuBLAS ranges and engine tiles were measured without it)
        pdl = dict(pdl=True) if self.wo_a_pdl and B * S <= WO_A_DECODE_MAX_T else {}
        return wo_a(o.reshape(B * S, H, hd).contiguous(), w.view(G, R, -1), workspace=ws, **pdl).view(B, S, -1)


    # ------------------------------------------------------------------ MoE --------------
    def moe(self, h, L, cfg, tokens, first_expert: int = 0, reduce: bool = False):
        """Routed + shared experts of ``h``; an expert shard (``first_expert``, its ``E / tp``
        experts and shared-expert slice) returns its partial, or with ``reduce`` the sum over
        the ranks -- on the custom push backend in the same launch as the finalize and the
        shared add (:meth:`comm.buffers.PushAllReduceGroup.finalize_shared_allreduce`)."""
        P = self._layer[id(L)]
        x = h.contiguous()
        main = torch.cuda.current_stream() if self.side is not None else None
        xq = q_ready = None
        if main is not None:
            self.side.wait_stream(main)  # fork: x is ready
            with torch.cuda.stream(self.side):
                if self.prequantize_routed_input:
                    xq = self.quantize_tokens(x)
                    q_ready = self.side.record_event()
                sh = self.shared_expert(x, L, P)
        elif self.prequantize_routed_input:
            xq = self.quantize_tokens(x)
        # bf16 logits straight into the router, which widens them itself (exactly): no cast kernel
        logits = x @ L["ffn.gate.weight"].T
        r = self.route(logits, L, P, cfg, tokens)
        # padding rows left unwritten (a padding row's GEMM output is never read back), the
        # routed rows walked through routed_row_pos: work proportional to the T k live rows
        if xq is None:
            aq, asc = mxfp8_quantize_routed(x, r.sorted_token_ids, r.total_rows, cfg.top_k, zero_padding=False,
                                            routed_row_pos=r.routed_row_pos)
        else:
            if q_ready is not None:
                main.wait_event(q_ready)  # the tokens' quantization, not the shared expert behind it
            aq, asc = mxfp8_gather_routed(*xq, r.sorted_token_ids, r.total_rows, cfg.top_k, zero_padding=False,
                                          routed_row_pos=r.routed_row_pos)
        n = x.shape[0] * cfg.top_k  # routed rows: bounds the expert grids to the live tiles
        rows = expert_kernel_args(x.shape[0], self.moe_row_tile)
        offsets, counts, tiles, weights = r.expert_offsets, r.expert_counts, r.tile_expert, r.topk_weights
        row_pos, y_full = r.routed_row_pos, None
        y_out = {}
        n_local = P["gu_q"].shape[0]
        if n_local != cfg.experts:
            # Expert parallel: the router packed every expert's rows; this rank's kernels see
            # its experts' offsets / counts and a tile map with other ranks' tiles at -1 (the
            # router's "no expert"), and bound their grids by the router's expert count (its
            # tiles sit among every expert's). Other ranks' rows of y are never written this
            # step: they hold whatever an earlier step left there -- a padding row's output
            # of unwritten (garbage, possibly NaN) input bytes included -- so the finalize
            # reads a routed row of another rank's expert from the buffer's last row instead,
            # never written and zero, with weight 0 (0 x 0: the partial sum is exact).
            e0, e1 = first_expert, first_expert + n_local
            offsets, counts = offsets[e0:e1 + 1], counts[e0:e1]
            tiles = torch.where((tiles >= e0) & (tiles < e1), tiles - e0, torch.full_like(tiles, -1))
            ids = r.topk_ids
            local = (ids >= e0) & (ids < e1)
            weights = torch.where(local, weights, torch.zeros_like(weights))
            y_full = self._y_buffer(aq.shape[0], cfg.hidden, x.device)
            zero_row = y_full.shape[0] - 1
            row_pos = torch.where(local.flatten(), row_pos, torch.full_like(row_pos, zero_row))
            y_out["out"] = y_full[:aq.shape[0]]
            rows["router_experts"] = cfg.experts
        hq, hs = moe_expert_gate_up(aq, asc, P["gu_q"], P["gu_s"], offsets, counts, tiles,
                                    routed_rows=n, swiglu_limit=cfg.swiglu_limit, **rows)
        y = moe_expert_gemm(hq, hs, P["d_q"], P["d_s"], offsets, counts, tiles, routed_rows=n, **rows, **y_out)
        if y_full is not None:
            y = y_full  # the finalize reads the zero row too
        if main is not None:
            main.wait_stream(self.side)  # join before the add reads sh
        else:
            sh = self.shared_expert(x, L, P)
        return self.finish(y, weights, row_pos, sh, reduce)

    def quantize_tokens(self, x):
        """The step's tokens ``x [T, hidden]`` as MXFP8 (plain scales) in this object's buffers."""
        T = x.shape[0]
        return mxfp8_quantize(x, layout="plain", q=self._xq[:T], scales=self._xs[:T])

    @staticmethod
    def shared_expert(x, L, P):
        """:func:`spec_decode.model.shared_expert` with the gate and up rows in one product (the
        same dot products; bf16 outputs as the two separate products')."""
        g, u = (x @ P["shared_w13"].T).chunk(2, -1)
        return swiglu(g, u, None) @ L["ffn.shared_experts.w2.weight"].T

    def route(self, logits, L, P, cfg, tokens):
        """The router's padded, packed outputs (:class:`moe.router.RouterOutput`) in one launch:
        top-k (or the layer's hash table), padding and ID packing."""
        with family("router top-k / padding"):
            if "ffn.gate.tid2eid" in L:
                return P["router"](logits, token_ids=tokens.int().contiguous())
            return P["router"](logits, P["router_bias"])

    def finish(self, y, weights, pos, sh, reduce):
        """Deferred finalize fused with the shared add (and, on the custom push backend inside
        a captured graph, the all-reduce: one launch; eagerly the all-reduce follows)."""
        if reduce and self.pushes(y):
            with family("fused finalize (+ shared add)"):  # + the all-reduce, one launch
                return self.push.finalize_shared_allreduce(self.push_rank, y, weights, pos, sh)
        with family("fused finalize (+ shared add)"):
            out = moe_finalize(y, weights, pos, sh)
        return self.all_reduce(out) if reduce else out

    def _y_buffer(self, rows, hidden, device):
        """The expert-parallel down-projection output (see :meth:`moe`): ``[slots + 1, hidden]``
        bf16, the router's slots for the largest step then one zero row that no GEMM writes
        (other ranks' routed rows read it). One buffer, zeroed once and never replaced --
        captured graphs hold its address, so a buffer regrown for a later, larger step (a
        prefill chunk after the decode graphs' capture) would leave them writing freed memory."""
        buf = getattr(self, "_y", None)
        if buf is None:
            most = capacity(self.router.cfg, self.max_tokens)[0]  # any step's router slots
            buf = self._y = torch.zeros(max(most, rows) + 1, hidden, dtype=torch.bfloat16, device=device)
        if buf.shape[0] <= rows or buf.shape[1] != hidden:
            raise RuntimeError(f"FusedOps: the expert-parallel output holds {tuple(buf.shape)}; a step needs "
                               f"({rows}, {hidden}) (more tokens than max_tokens={self.max_tokens}?)")
        return buf


class BaseOps(FusedOps):
    """The ``base`` arm: the same number formats and expert kernels as :class:`FusedOps` (MXFP8
    routed experts through :func:`moe_expert_gate_up` / :func:`moe_expert_gemm`, the same
    mHC statistics kernel and draft head), with the reference PR's changes undone -- what its
    "before" column measured:

    * router: top-k, then separate padding / ID-packing kernels (torch ops, sync-free)
      instead of the one-launch router;
    * routed input: the gathered rows MXFP8-quantized after the router, on the main stream,
      instead of the tokens quantized on the side stream beside the router and their bytes
      gathered (the same bytes);
    * shared expert on the main stream after the routed experts, a standalone finalize, then
      a separate shared-expert add (then the all-reduce when TP > 1) instead of the deferred
      finalize fused with the add (and the all-reduce);
    * WO-A group-major (batched GEMM) plus a transpose copy instead of the token-major
      epilogue;
    * indexer candidate masking as a separate pass over the scores before the top-k, instead
      of fused into the select;
    * the mHC mappings in one launch on the main stream instead of H_pre there and H_post /
      H_res on a side stream (bit-equal).

    Every rounding point of these composites equals :class:`FusedOps`' except WO-A (cuBLAS's
    accumulation order), the indexer scores (FP32 einsum vs the kernel's MMA) and the router's
    weights (torch's ``exp`` / ``log1p`` vs the kernel's: each within 4e-6 relative of the
    FP64 definition; the picks agree but at near-ties): both arms run the same experts, so
    ``base`` vs ``fused`` measures the fusions, not the formats.
    """

    split_mhc = False
    prequantize_routed_input = False

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.side = None  # everything on the main stream

    def route(self, logits, L, P, cfg, tokens):
        rc = self._rc_hash if "ffn.gate.tid2eid" in L else self.router.cfg
        with family("router top-k / padding"):
            ids, w = topk_torch(logits, P.get("router_bias"), rc, L.get("ffn.gate.tid2eid"), tokens)
        with family("ID packing (sort / scatter)"):
            packed = align_torch(ids, cfg.experts, rc.tile_m, *capacity(rc, logits.shape[0]))
        return RouterOutput(ids.int(), w, *packed)

    def finish(self, y, weights, pos, sh, reduce):
        with family("standalone finalize"):
            out = moe_finalize(y, weights, pos)
        with family("shared-expert add"):
            out = (out.float() + sh.float()).to(torch.bfloat16)  # the fused kernel's second rounding
        return self.all_reduce(out) if reduce else out

    def wo_a(self, o, w, cfg):
        B, S, H, hd = o.shape
        R = cfg.wo_rank
        G = w.shape[0] // R
        y = torch.bmm(o.reshape(B * S, G, -1).transpose(0, 1), w.view(G, R, -1).transpose(1, 2))  # [G, T, R]
        return y.transpose(0, 1).contiguous().view(B, S, G * R)  # the transpose copy

    def indexer_topk(self, q_idx, w_idx, ipool, slots, pos, topk, ratio):
        return Ops.indexer_topk(self, q_idx, w_idx, ipool, slots, pos, topk, ratio)


class MxDraftHead:
    """The draft's LM head ``logits = h @ lm_head^T`` on this project's MXFP8 expert GEMM: the
    whole head is one "expert" (``[1, vocab, hidden]`` e4m3 + swizzled block scales, made
    once), the draft's rows (requests x block positions, up to 16) one router tile of 128 (rows
    past them stay whatever an earlier, larger batch left: computed, never read).

    Why: at small batches the draft step is bound by reading the LM head (vocab 129280 x
    hidden 4096 at V4-Flash: 1.06 GB in bf16) and MXFP8 halves those bytes (timings:
    ``bench/bench_draft_head.py``, bench/RESULTS.md). The draft only proposes -- the target
    verifies every token with its bf16 head -- so the rounding can change the acceptance
    length, never the output tokens.

    Per call (up to :attr:`MX_MAX_BATCH` rows): one copy into the padded input,
    :func:`mxfp8_quantize` (swizzled scales), the Hopper decode kernel (weights as wgmma's M)
    in one pass of 16 token columns; larger batches use the bf16 head. Graph capturable;
    allocates nothing per call.
    """

    TILE = 128  # one router tile: the expert GEMM's row granularity
    #: Most rows the MXFP8 head serves (one 16-column pass of the decode kernel); above it the
    #: bf16 head (or FP8 scores): with more live columns the kernel's per-block FP32 promotion,
    #: not the weight bytes, bounds it (measured: bench/RESULTS.md, Draft LM head).
    MX_MAX_BATCH = 16
    #: Smallest bf16 head worth an MXFP8 copy: below it the three launches per call (copy,
    #: quantise, GEMM) cost more than the halved bytes save (a 1 MB head ran slower this way).
    MIN_HEAD_BYTES = 64 << 20

    @classmethod
    def pays_off(cls, lm_head: torch.Tensor) -> bool:
        """Whether ``lm_head`` is large enough for the MXFP8 copy (:attr:`MIN_HEAD_BYTES`)."""
        return lm_head.numel() * lm_head.element_size() >= cls.MIN_HEAD_BYTES

    def __init__(self, lm_head: torch.Tensor, max_batch: int, fp8_above: bool = False):
        """``fp8_above``: above :attr:`MX_MAX_BATCH` rows, per-tensor e4m3 scores that keep each
        row's argmax (:func:`cute_kernels.draft_head_fp8.draft_head_scores`) instead of the
        bf16 head."""
        V, C = lm_head.shape
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"MxDraftHead: max_batch must be a positive int, got {max_batch!r}")
        dev = lm_head.device
        self.max_batch, self.lm_head = max_batch, lm_head
        self.fp8 = None
        if fp8_above and max_batch > self.MX_MAX_BATCH:
            w_q, _ = quantize_head(lm_head)  # its scale only multiplies every score: not kept
            self.fp8 = (w_q, torch.empty(max_batch, C, dtype=torch.float8_e4m3fn, device=dev),
                        torch.empty(max_batch, V, dtype=torch.bfloat16, device=dev))
        self.w_q, self.w_s = quantize_expert_weights(lm_head[None].contiguous())
        self.x = torch.zeros(self.TILE, C, dtype=torch.bfloat16, device=dev)
        self.q = torch.empty(self.TILE, C, dtype=torch.float8_e4m3fn, device=dev)
        self.s = torch.empty(scale_buffer_size(self.TILE, C, "swizzled"), dtype=torch.uint8, device=dev)
        self.offsets = torch.tensor([0, self.TILE], dtype=torch.int32, device=dev)
        self.tile_expert = torch.zeros(1, dtype=torch.int32, device=dev)
        # expert count B is the view _counts[B:B + 1]: a constant address per captured batch size
        self._counts = torch.arange(min(max_batch, 64) + 1, dtype=torch.int32, device=dev)
        self.out = torch.empty(self.TILE, V, dtype=torch.bfloat16, device=dev)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """h [B, hidden] bf16 -> logits [B, vocab] bf16 (a view of this head's buffer; above
        :attr:`MX_MAX_BATCH` rows, the bf16 head's product, or with ``fp8_above`` scores with
        the logits' per-row argmax)."""
        B = h.shape[0]
        if not 1 <= B <= self.max_batch:
            raise ValueError(f"MxDraftHead: batch {B} outside [1, {self.max_batch}]")
        if B > self.MX_MAX_BATCH:
            if self.fp8 is not None:
                w_q, h_q, out = self.fp8
                return draft_head_scores(h.contiguous(), w_q, h_q=h_q, out=out)
            return h @ self.lm_head.T
        return self.mx_logits(h)

    def mx_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The MXFP8 path at any batch up to ``min(max_batch, 64)`` (one decode-kernel pass of
        16, 32 or 64 columns; :meth:`__call__` takes it up to :attr:`MX_MAX_BATCH` rows)."""
        B = h.shape[0]
        if not 1 <= B < self._counts.numel():
            raise ValueError(f"MxDraftHead.mx_logits: batch {B} outside [1, {self._counts.numel() - 1}]")
        self.x[:B].copy_(h)
        mxfp8_quantize(self.x, layout="swizzled", q=self.q, scales=self.s)
        # one pass (passes re-stream the weights: see MX_MAX_BATCH)
        moe_expert_gemm(self.q, self.s, self.w_q, self.w_s, self.offsets, self._counts[B:B + 1], self.tile_expert,
                        out=self.out, routed_rows=B, max_expert_rows=B)
        return self.out[:B]
