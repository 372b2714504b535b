"""WO-A with FP8 weights and FP8 activations at decode T (<= 64), Hopper: TMA + e4m3 wgmma, the
weight rows as M.

    y[t, g*R + r] = bf16( sum_kb  ws[g, r // 128, kb // 4] * sa[t, g*Dg/32 + kb]
                                  * sum_{k in 32-block kb} q[t, g, k] * w[g, r, k] )

over the activations in MXFP8 (``q [T, H, Dv]`` e4m3 and ``q_scales [T, H*Dv/32]`` UE8M0: one
power-of-two scale per token and 32 consecutive columns of ``o``, the plain layout of
:func:`moe.quant.mxfp8_quantize` on ``o.view(T, H*Dv)``) and the checkpoint's weights
(``w [G, R, Dg]`` e4m3, ``w_scale [G, R/128, Dg/128]`` FP32 per 128 x 128 block, as
:mod:`.wo_a_decode_fp8` takes them). :func:`wo_a_fp8_act_reference` is the spec.

Why a second FP8 WO-A kernel: :mod:`.wo_a_decode_fp8` keeps the activations in bf16, so it
widens every e4m3 weight to bf16 in registers before a bf16 MMA, and that instruction stream
bounds it at about half the copy bandwidth (``docs/wo_a.md``). Here both operands go to the
FP8 tensor cores as stored, and the activations round to e4m3 -- as DeepSeek's own inference
quantises the inputs of its FP8 linears, there with a scale per 128 columns, here per 32 (MX)
-- so it is a numerically different op, chosen by the caller, not a faster schedule of the
same one.

Schedule (:mod:`.wo_a_decode_swap_ab`'s, on e4m3 operands): a CTA owns 64 weight rows of one
group (wgmma **M**; inside one 128-row weight-scale block) and the group's ``tok_n`` token
rows (**N**, 16 / 32 / 64; rows past T are zero-filled by TMA and never stored). Both tiles
arrive by TMA in 128-byte K slices (128B swizzle) through a ``stages``-deep mbarrier pipeline,
one elected thread issuing. A slice is four MX blocks and one weight-scale block: per 32-wide
block an ``m64n{tok_n}k32`` e4m3 wgmma writes a zeroed FP32 fragment, promoted into the
accumulator as ``acc += frag * (ws * sa[t])`` (the promotion of
:mod:`moe.experts_swap_ab_sm90`: two fragments alternate, so block kb's wgmma runs while
block kb - 1 is promoted). The products ``ws * sa[t]`` of the CTA's weight scales and its
tokens' block scales are decoded once into shared memory (FP32 per token and 32-wide block),
behind the prologue's loads: a promotion is one shared load per token column and one FFMA per
accumulator element. The
epilogue transposes the tile through shared memory -- the weight stages', free once the main
loop is done (a CTA barrier) -- into token-major ``y [T, G*R]``.

K groups (``kgroups`` = 2, the plan's for the 32- and 64-token tiles): the chain above -- a
block's wgmma, its wait, its promotion (tok_n / 2 FFMAs per thread) -- is serial within a
warpgroup, 128 blocks per CTA. With two warpgroups the K slices go to them by turns (slice
``kt`` to warpgroup ``kt % 2``, into stage ``kt % stages`` of the one pipeline: each stage has
one producer and one consuming warpgroup, whose first warp issues its own slices' loads), two
independent chains share the SM's tensor cores, and the epilogue adds the second warpgroup's
accumulator to the first's in shared memory before the store.

``pdl`` (a programmatic dependent launch, e.g. behind the activations' quantization): the
prologue's weight slices go out before ``griddepcontrol.wait``, the token slices and the scale
loads after it (:func:`.wo_a_decode_swap_ab.load_prologue`), so the weights stream while the
kernel before this one finishes.

Numerics: the activations' e4m3 rounding (relative 2^-4 per element, before this kernel);
products of e4m3 values are exact, the tensor core sums a block's 32 of them keeping about 14
mantissa bits, ``ws * sa`` is exact (a power of two times an FP32), the promotion rounds in
FP32 (with K groups, each group's sum over its slices, then the two added), and ``y`` is
rounded once to bf16. A NaN activation block (scale byte 0xFF) makes its
token's outputs NaN.

Constraints: T <= ``tok_n`` (the host picks it from T), R % 128 == 0, Dg % 128 == 0, shared
memory (:func:`smem_bytes`) <= 227 KB; Hopper only (Blackwell's block-scaled tcgen05 MMA takes
MXFP8 operands directly: not built, ``docs/wo_a.md``)::

    pytest tests/test_wo_a_fp8_act.py
    python bench/bench_wo_a_v4.py --tokens 1,5,16,32,64
"""

import os

import torch

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, Uint32

from . import jit
from .arch import current_arch, num_sms
from .gemm.sm90_gemm import SMEM_PER_SM
from .mx_scales import e8m0_to_f32
from .validate import check_arch_supported, check_bool, check_cuda, check_tensor
from .warp_mma import fp8_wgmma_blocks, wgmma_fragments
from .wo_a_decode import SMEM_PER_CTA
from .wo_a_decode_fp8 import SCALE_BLOCK  # the weights' scale block (rows and K): the checkpoint format's
# BM weight rows (output columns) per CTA -- wgmma M -- and THREADS: the shared schedule's
from .tma_pipeline import swap_ab_operands, swap_ab_shared_storage
from .wo_a_decode_swap_ab import (BM, THREADS, group_operand_tiles, load_k_slice, load_prologue, store_tile_rows,
                                  store_token_major)
from .wo_a_sm90 import wo_a_layouts

BK = 128  # K elements (bytes) per pipeline stage: four MX blocks, one weight-scale block
MX = 32  # the activations' scale block: one e4m3 wgmma's K
TOK_N = (16, 32, 64)
MAX_T = TOK_N[-1]


def smem_bytes(tok_n: int, stages: int, Dg: int = 4096) -> int:
    """Shared memory of one CTA: the swizzled weight and token stages (1 KB aligned; the
    transposed FP32 output tile reuses the weight stages after the main loop), the stage
    mbarriers and the CTA's scale products (FP32 per token and 32-wide K block)."""
    kt = Dg // BK
    return 1024 + stages * (BM + tok_n) * BK + 2 * stages * 8 + 4 * tok_n * (kt * (BK // MX) + 1) + 16


def out_fits_stages(tok_n: int, stages: int) -> bool:
    """The FP32 output tile ``(tok_n, BM + 1)`` fits in the weight stages it reuses."""
    return tok_n * (BM + 1) * 4 <= stages * BM * BK


KGROUPS = (1, 2)  # warpgroups splitting K by turns


class WoAFp8ActSm90:
    def __init__(self, G: int, R: int, Dg: int, tok_n: int, stages: int = 8, pdl: bool = False, kgroups: int = 1):
        self.G, self.R, self.Dg, self.tok_n, self.stages, self.pdl = G, R, Dg, tok_n, stages, pdl
        self.tile = (BM, tok_n, BK)
        self.k_tiles = Dg // BK
        self.kgroups = kgroups
        self.threads = THREADS * kgroups

    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, qs_ptr: cute.Pointer, w_ptr: cute.Pointer, ws_ptr: cute.Pointer,
                 y_ptr: cute.Pointer, num_tokens: Int32, stream: cuda.CUstream):
        G, R, Dg = self.G, self.R, self.Dg
        f8 = cutlass.Float8E4M3FN
        (sw, dw), (so, do), _ = wo_a_layouts(num_tokens, G, R, Dg, swap_ab=True)
        mW = cute.make_tensor(w_ptr, cute.make_layout(sw, stride=dw))  # (R, Dg, G)
        mQ = cute.make_tensor(q_ptr, cute.make_layout(so, stride=do))  # (T, Dg, G)
        # the activations' scale bytes [T, G * Dg / 32], read as words (a K slice's four blocks)
        mQs = cute.make_tensor(qs_ptr, cute.make_layout((num_tokens * (G * Dg // MX),)))
        mWs = cute.make_tensor(ws_ptr, cute.make_layout((G * (R // SCALE_BLOCK) * (Dg // SCALE_BLOCK),)))
        mY = cute.make_tensor(y_ptr, cute.make_layout((num_tokens, G * R), stride=(G * R, 1)))

        tiled_mma, w_smem, q_smem, tma_w, tma_tensor_w, tma_q, tma_tensor_q = swap_ab_operands(
            f8, mW, mQ, self.tile, self.stages)
        self.kernel(tiled_mma, tma_w, tma_tensor_w, tma_q, tma_tensor_q, w_smem, q_smem, mQs, mWs, mY,
                    num_tokens).launch(grid=[G * R // BM, 1, 1], block=[self.threads, 1, 1], stream=stream,
                                       use_pdl=self.pdl)

    @cute.jit
    def tensor_call(self, mQ: cute.Tensor, mQs: cute.Tensor, mW: cute.Tensor, mWs: cute.Tensor, mY: cute.Tensor,
                    stream: cuda.CUstream):
        """The tensor entry (``jit.get_tensor_kernel``): ``mQ [T, H, Dv]`` e4m3, ``mQs [T, G*Dg/32]``
        uint8, ``mW [G, R, Dg]`` e4m3, ``mWs [G, R/128, Dg/128]`` FP32, ``mY [T, G*R]`` bf16
        (``H * Dv = G * Dg`` and ``T <= tok_n``: the validated first call of these shapes)."""
        self.__call__(mQ.iterator, mQs.iterator, mW.iterator, mWs.iterator, mY.iterator, mQ.shape[0], stream)

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tma_w: cute.CopyAtom, mW: cute.Tensor, tma_q: cute.CopyAtom,
               mQ: cute.Tensor, w_smem: cute.ComposedLayout, q_smem: cute.ComposedLayout, mQs: cute.Tensor,
               mWs: cute.Tensor, mY: cute.Tensor, num_tokens: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        nt, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        f8 = cutlass.Float8E4M3FN
        STAGES, TN, KT, KG = self.stages, self.tok_n, self.k_tiles, self.kgroups
        wg = warp_idx // (THREADS // 32)  # this warpgroup: its K slices are wg, wg + KG, ...
        wg_tidx = tidx - wg * THREADS
        tiles_per_group = self.R // BM
        g = nt // tiles_per_group
        rt = nt - g * tiles_per_group

        # the CTA's block scales, staged once as FP32 products ws * sa[t]: (token, 32-wide K block)
        # at a row pitch of 4 KT + 1 floats (the columns a warp reads for one block fall in
        # distinct banks)
        KB = KT * (BK // MX)
        sW, sQ, sOut, pipe, sS = swap_ab_shared_storage(
            f8, w_smem, q_smem, STAGES, self.tile, THREADS // 32,
            extra=((Float32, cute.make_layout((TN, KB), stride=(KB + 1, 1))),), out_in_stages=True)

        # This CTA's 64 weight rows of group g and the group's token rows, in 128-byte K slices.
        tWsW, tWgW, tQsQ, tQgQ = group_operand_tiles(tma_w, mW, sW, tma_q, mQ, sQ, (BM, BK), (TN, BK), rt, g)
        if cutlass.const_expr(KG == 1):
            prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES)
            cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
        else:  # this warpgroup's first slice and stage, every KG-th on from there
            prod = pipeline.PipelineState(STAGES, wg, wg, Int32(1))
            cons = pipeline.PipelineState(STAGES, wg, wg, Int32(0))
        prod = load_prologue(pipe, prod, tma_w, tWgW, tWsW, tma_q, tQgQ, tQsQ, min(STAGES, KT) // KG, STAGES,
                             self.pdl, warp_idx - wg * (THREADS // 32), KG)

        # The scales, behind the prologue's loads (with pdl: after its grid-dependency wait -- the
        # token scales are the previous kernel's output), decoded once: read from global memory inside
        # the slice loop, each slice would wait on a dependent load (wo_a_decode_fp8 stages its
        # scales too), and decoded there, each block of each column would cost its bit
        # operations again in every CTA. A thread takes one word (four block scale bytes) of a
        # token and K slice; token rows past T get 0 (their tile rows are zero, never stored).
        mQs32 = cute.recast_tensor(mQs, Uint32)
        row_words = self.G * self.Dg // BK  # scale words per token row (one per K slice of a group)
        q_word0 = g * (self.Dg // BK)  # group g's first word in a token's row
        ws_row = (g * (self.R // SCALE_BLOCK) + rt * BM // SCALE_BLOCK) * (self.Dg // SCALE_BLOCK)
        for i in cutlass.range_constexpr((TN * KT + self.threads - 1) // self.threads):
            idx = tidx + i * self.threads
            if idx < TN * KT:
                t = idx // KT
                kt = idx - t * KT
                word = Uint32(0)
                if t < num_tokens:
                    word = mQs32[t * row_words + q_word0 + kt]
                ws = mWs[ws_row + kt]
                for b in cutlass.range_constexpr(BK // MX):
                    sS[t, kt * (BK // MX) + b] = ws * e8m0_to_f32((word >> (8 * b)) & Uint32(0xFF))
        cute.arch.barrier()

        tCrW, tCrQ, tCcC, acc = wgmma_fragments(tiled_mma, wg_tidx, sW, sQ, (BM, TN))
        acc.fill(0.0)
        # Two block partials in flight: the wgmma of block kb runs while block kb - 1 is promoted.
        frags = [cute.make_rmem_tensor(tCcC.shape, Float32) for _ in range(2)]
        NV = cute.size(acc)  # (column pair, row + 8, TN / 8 column blocks) per thread
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)  # every block's wgmma: a fresh partial
        for _ in cutlass.range(KT // KG, unroll=1):
            self.k_slice(pipe, cons, tiled_mma, tCrW, tCrQ, tCcC, acc, frags, sS, cons.count, NV)
            cons.advance(KG)
            if warp_idx == wg * (THREADS // 32) and prod.count < KT:
                load_k_slice(pipe, prod, tma_w, tWgW, tWsW, tma_q, tQgQ, tQsQ)
                prod.advance(KG)

        # the output tile reuses the weight stages: every warp's last wgmma has read them (and no
        # load is in flight: the producers issue none past slice KT - 1)
        cute.arch.barrier()
        if cutlass.const_expr(KG == 1):
            store_token_major(acc, tCcC, sOut, mY, nt * BM, num_tokens, tidx)  # nt * BM = g * R + rt * 64
        else:
            self.store_k_groups(acc, tCcC, sOut, mY, nt * BM, num_tokens, tidx, wg)

    @cute.jit
    def k_slice(self, pipe: pipeline.PipelineTmaAsync, cons: pipeline.PipelineState, tiled_mma: cute.TiledMma,
                tCrW: cute.Tensor, tCrQ: cute.Tensor, tCcC: cute.Tensor, acc: cute.Tensor, frags: list,
                sS: cute.Tensor, kt: Int32, NV: cutlass.Constexpr):
        """acc += K slice ``kt`` (stage ``cons.index``): 4 MX blocks, each an e4m3 wgmma promoted
        with its staged scale products."""
        pipe.consumer_wait(cons)
        fp8_wgmma_blocks(tiled_mma, tCrW, tCrQ, cons.index, frags, BK // MX,
                         lambda frag, kb: self.promote(acc, frag, tCcC, sS, kt * (BK // MX) + kb, NV))
        pipe.consumer_release(cons)

    @cute.jit
    def store_k_groups(self, acc: cute.Tensor, tCcC: cute.Tensor, sOut: cute.Tensor, mY: cute.Tensor, col0: Int32,
                       num_tokens: Int32, tidx: Int32, wg: Int32):
        """The epilogue with two K groups: the second warpgroup's accumulator into ``sOut``
        (token-major, transposed), the first's added to it, then the sum rounded once to bf16
        into columns ``col0 ..`` of ``mY`` by every thread (:func:`.wo_a_decode_swap_ab.store_token_major`'s
        layout)."""
        if wg == 1:
            for i in cutlass.range_constexpr(cute.size(acc)):
                r, c = tCcC[i]
                sOut[c, r] = acc[i]
        cute.arch.barrier()
        if wg == 0:
            for i in cutlass.range_constexpr(cute.size(acc)):
                r, c = tCcC[i]
                sOut[c, r] = sOut[c, r] + acc[i]
        cute.arch.barrier()
        store_tile_rows(sOut, mY, col0, num_tokens, tidx, self.threads)

    @cute.jit
    def promote(self, acc: cute.Tensor, frag: cute.Tensor, tCcC: cute.Tensor, sS: cute.Tensor, kb: Int32,
                NV: cutlass.Constexpr):
        """acc += one 32-wide K block's FP32 partial times its token's ``ws * sa``: one FFMA
        per element, one shared load per token column (elements of one column share it)."""
        for i in cutlass.range_constexpr(NV):
            acc[i] = acc[i] + frag[i] * sS[tCcC[i][1], kb]

    @staticmethod
    def can_implement(T: int, G: int, R: int, Dg: int, tok_n: int, stages: int = 8, kgroups: int = 1) -> bool:
        return (1 <= T <= tok_n and tok_n in TOK_N and G >= 1 and R % SCALE_BLOCK == 0 and R > 0
                and Dg % BK == 0 and Dg > 0 and 2 <= stages and smem_bytes(tok_n, stages, Dg) <= SMEM_PER_CTA
                and out_fits_stages(tok_n, stages)
                and kgroups in KGROUPS and stages % kgroups == 0 and (Dg // BK) % kgroups == 0)


def plan(T: int, G: int, R: int, Dg: int, num_sms: int = 132) -> dict:
    """The compile configuration ``{tok_n, stages, kgroups}`` of a call with ``T`` tokens: the
    narrowest token tile, 8 stages (6 for the 64-token tile) -- the bf16 swap-AB kernel's depth
    for 128-wide slices, here 8 KB of weights per stage -- and two K groups for the 32- and
    64-token tiles, whose promotions (tok_n / 2 FFMAs per thread and block) make the chain
    the longer one; the 16-token tile keeps one (``bench/bench_wo_a_v4.py --kgroups``). Where
    the grid (``G * R / 64`` CTAs) is more than one wave at one CTA per SM (V4-Pro: 256), the
    depth drops until two CTAs share an SM -- one wave at 6 stages for the 32-token tile and 4
    for the 64-token one, where the deeper single-CTA pipeline ran two waves
    (``bench_wo_a_v4.py --stages``)."""
    for tok_n in TOK_N:
        if T <= tok_n:
            kgroups = 1 if tok_n == 16 else 2
            stages = 8 if tok_n <= 32 else 6
            if G * R // BM > num_sms:
                depth = stages
                while depth - kgroups >= 4 and not two_ctas_fit(tok_n, depth, Dg):
                    depth -= kgroups
                if two_ctas_fit(tok_n, depth, Dg):
                    stages = depth
            return {"tok_n": tok_n, "stages": stages, "kgroups": kgroups}
    raise ValueError(f"wo_a_fp8_act: T={T} > {MAX_T} (a decode kernel; prefill takes wo_a_fp8)")


def two_ctas_fit(tok_n: int, stages: int, Dg: int) -> bool:
    """Two CTAs' shared memory (each with the 1 KB the runtime reserves) fit one SM's 228 KB."""
    return 2 * (smem_bytes(tok_n, stages, Dg) + 1024) <= SMEM_PER_SM


def _build(arch: str, *, G: int, R: int, Dg: int, tok_n: int, stages: int = 8, pdl: bool = False,
           kgroups: int = 1):
    """``tok_n``: the token tile (wgmma N; T <= tok_n). ``stages``: TMA pipeline depth. ``pdl``:
    a programmatic dependent launch (the first stages' weight slices go out before the wait
    for the previous kernel, whose output the activations and their scales are). ``kgroups``:
    warpgroups splitting K by turns (module docstring)."""
    if not WoAFp8ActSm90.can_implement(1, G, R, Dg, tok_n, stages, kgroups):
        raise ValueError(f"wo_a_fp8_act: unsupported G={G}, R={R}, Dg={Dg}, tok_n={tok_n}, stages={stages}, "
                         f"kgroups={kgroups} (R % 128, Dg % 128, tok_n in {TOK_N}, stages >= 2 within "
                         f"{SMEM_PER_CTA} B of shared memory: {smem_bytes(tok_n, stages, Dg)} B, kgroups in "
                         f"{KGROUPS} dividing the stages and the K slices)")
    P = jit.fake_gmem_ptr
    f8 = cutlass.Float8E4M3FN
    args = (P(f8, 16), P(cutlass.Uint8, 4), P(f8, 16), P(Float32, 4), P(cutlass.BFloat16, 4), Int32(1),
            jit.fake_stream())
    return WoAFp8ActSm90(G, R, Dg, tok_n, stages, pdl, kgroups), args


def _build_tensors(arch: str, *, G: int, R: int, Dg: int, tok_n: int, stages: int = 8, kgroups: int = 1):
    op, _ = _build(arch, G=G, R=R, Dg=Dg, tok_n=tok_n, stages=stages, kgroups=kgroups)
    sym, T, f8 = {}, jit.fake_tensor, cutlass.Float8E4M3FN
    args = (T(f8, ("T", "H", "Dv"), 16, sym), T(cutlass.Uint8, ("T", G * Dg // MX), 4, sym), T(f8, (G, R, Dg), 16, sym),
            T(Float32, (G, R // SCALE_BLOCK, Dg // SCALE_BLOCK), 4, sym), T(cutlass.BFloat16, ("T", G * R), 4, sym),
            jit.fake_env_stream())
    return op.tensor_call, args


KERNEL = jit.register(jit.KernelDef(
    name="wo_a_fp8_act_sm90",
    build=_build,
    sources=tuple(os.path.join(os.path.dirname(os.path.abspath(__file__)), f)
                  for f in ("wo_a_fp8_act_sm90.py", "wo_a_decode_swap_ab.py", "wo_a_sm90.py", "tma_pipeline.py",
                            "warp_mma.py", "mx_scales.py")),
    archs=("sm_90a",),
    # DeepSeek-V4-Flash / -Pro at every decode token tile
    aot_configs=tuple({"G": G, "R": 1024, "Dg": 4096, **plan(T, G, 1024, 4096)} for G in (8, 16)
                      for T in (16, 32, 64)),
    description="WO-A decode (T <= 64), Hopper: FP8 weights and MXFP8 activations, e4m3 wgmma, token-major bf16 out",
))
jit.register_tensor_entry(KERNEL, _build_tensors, aot_configs=KERNEL.aot_configs)

#: (q.shape, w.shape, device index) -> the tensor entry (jit.launch_tensor_entry), filled by a
#: first validated call with TVM-FFI on
_TENSOR_FNS: dict = {}


def wo_a_fp8_act(q: torch.Tensor, q_scales: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, *,
                 out: torch.Tensor | None = None, stream=None, arch: str | None = None,
                 pdl: bool = False, kgroups: int | None = None, stages: int | None = None) -> torch.Tensor:
    """``y [T, G*R]`` (bf16, token-major) from MXFP8 activations ``q [T, H, Dv]`` (e4m3) with
    ``q_scales [T, H*Dv/32]`` (uint8 UE8M0, :func:`moe.quant.mxfp8_quantize`'s plain layout of
    ``o.view(T, H*Dv)``), e4m3 ``w [G, R, (H/G)*Dv]`` and FP32 ``w_scale [G, R/128, Dg/128]``;
    T <= 64. ``out``: a preallocated ``y`` (nothing allocated). Launched on ``stream`` (default:
    torch's current stream). ``pdl``: launched as a programmatic dependent of the kernel before
    it on the stream -- the weights start streaming while that kernel (e.g. the activations'
    quantization) finishes; a separate compile, the same results. ``kgroups`` (1 or 2; None: the
    plan's): warpgroups splitting K, a compile choice (module docstring) -- sums in another order.
    ``stages`` (None: the plan's): the TMA pipeline's depth, a multiple of the K groups within
    shared memory (:func:`smem_bytes`) -- the same results."""
    default_call = stream is None and arch is None and pdl is False and kgroups is None and stages is None
    if (out is not None and default_call and jit.TVM_FFI and isinstance(q, torch.Tensor)
            and isinstance(w, torch.Tensor)):  # the eager hot path (the C checks: dtypes, extents, strides, alignment)
        if jit.launch_tensor_entry(_TENSOR_FNS, (q.shape, w.shape, q.get_device()), q, q_scales, w, w_scale, out):
            return out
    op = "wo_a_fp8_act"
    check_bool(op, "pdl", pdl)
    if kgroups is not None and kgroups not in KGROUPS:
        raise ValueError(f"{op}: kgroups={kgroups!r} must be None or one of {KGROUPS}")
    if stages is not None and (not isinstance(stages, int) or isinstance(stages, bool)):
        raise TypeError(f"{op}: stages must be None or an int, got {stages!r}")
    check_tensor(op, "q", q, dtype=torch.float8_e4m3fn, ndim=3, contiguous=True, align_bytes=16)
    check_tensor(op, "w", w, dtype=torch.float8_e4m3fn, ndim=3, contiguous=True, align_bytes=16)
    T, H, Dv = q.shape
    G, R, Dg = w.shape
    if H * Dv != G * Dg:
        raise ValueError(f"{op}: q has H*Dv = {H * Dv} columns but w's {G} groups take {G * Dg}")
    if not 1 <= T <= MAX_T:
        raise ValueError(f"{op}: T={T} tokens; this decode kernel takes 1..{MAX_T}")
    if R % SCALE_BLOCK or Dg % BK:
        raise ValueError(f"{op}: w of shape {list(w.shape)} needs R % {SCALE_BLOCK} == 0 and Dg % {BK} == 0")
    # (a CPU tensor is planned for plan's default part, then refused below, by name)
    planned = plan(T, G, R, Dg, num_sms(q.device)) if q.is_cuda else plan(T, G, R, Dg)
    cfg = dict(planned, **({} if kgroups is None else {"kgroups": kgroups}),
               **({} if stages is None else {"stages": stages}))
    if not WoAFp8ActSm90.can_implement(T, G, R, Dg, **cfg):
        raise ValueError(f"{op}: stages={cfg['stages']} with kgroups={cfg['kgroups']} at T={T}: the depth must be "
                         f">= 2, a multiple of the K groups and fit {SMEM_PER_CTA} B of shared memory "
                         f"({smem_bytes(cfg['tok_n'], cfg['stages'], Dg)} B)")
    check_tensor(op, "q_scales", q_scales, dtype=torch.uint8, shape=(T, H * Dv // MX), contiguous=True,
                 align_bytes=4)
    check_tensor(op, "w_scale", w_scale, dtype=torch.float32, shape=(G, R // SCALE_BLOCK, Dg // SCALE_BLOCK),
                 contiguous=True, align_bytes=4)
    if out is None:
        out = torch.empty(T, G * R, dtype=torch.bfloat16, device=q.device)
    check_tensor(op, "out", out, dtype=torch.bfloat16, shape=(T, G * R), contiguous=True, align_bytes=4)
    check_cuda(op, ("q", q), ("q_scales", q_scales), ("w", w), ("w_scale", w_scale), ("out", out))
    a = check_arch_supported(op, arch or current_arch(q.device), ("sm_90a",))
    fn = jit.get_kernel("wo_a_fp8_act_sm90", a, G=G, R=R, Dg=Dg, **cfg, **({"pdl": True} if pdl else {}))
    P = jit.gmem_ptr
    fn(P(cutlass.Float8E4M3FN, q, 16), P(cutlass.Uint8, q_scales, 4), P(cutlass.Float8E4M3FN, w, 16),
       P(Float32, w_scale, 4), P(cutlass.BFloat16, out, 4), jit.i32(T), jit.cu_stream(stream))
    if default_call:  # its tensor entry for the next calls of these shapes (cfg: the plan's, no overrides)
        jit.remember_tensor_entry(_TENSOR_FNS, (q.shape, w.shape, q.get_device()), "wo_a_fp8_act_sm90_tensors", a,
                                  G=G, R=R, Dg=Dg, **cfg)
    return out


def wo_a_fp8_act_reference(q: torch.Tensor, q_scales: torch.Tensor, w: torch.Tensor,
                           w_scale: torch.Tensor) -> torch.Tensor:
    """The spec in plain PyTorch (float64): the dequantised operands' product, each 32-block of
    an activation row scaled by its power of two, each 128 x 128 weight block by its FP32
    scale; bf16 out."""
    T, H, Dv = q.shape
    G, R, Dg = w.shape
    a = q.double().reshape(T, H * Dv // MX, MX) * torch.exp2(q_scales.double() - 127)[..., None]
    a = torch.where((q_scales == 0xFF)[..., None], torch.full_like(a, float("nan")), a).reshape(T, G, Dg)
    ws = w_scale.double().repeat_interleave(SCALE_BLOCK, 1).repeat_interleave(SCALE_BLOCK, 2)
    y = torch.einsum("tgd,grd->tgr", a, w.double() * ws)
    return y.reshape(T, G * R).to(torch.bfloat16)
