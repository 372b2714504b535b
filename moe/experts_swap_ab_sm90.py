"""MXFP8 routed-expert GEMM at decode, Hopper: TMA + native FP8 wgmma with the weights as M.

Same contract as :mod:`moe.experts_tiled_sm90` (``out[r] = A[r] @ W[expert(r)]^T``, bf16 out, or
the fused SiLU(gate) * up + MXFP8 requantisation), for calls where no expert receives more
than ``tok_n`` (16 / 32 / 64) rows -- every decode / verify step with at most ``tok_n``
tokens, since a token routes to an expert at most once -- or, with ``row_passes``, any number
of rows (a CTA covers its router tile's live rows in passes of ``tok_n`` token columns).

Why: :mod:`moe.experts_tiled_sm90` runs at 14-16% of the copy bandwidth at decode. Two
causes this kernel removes: e4m3 ``mma.sync`` is not native on sm_90 (ptxas unpacks every
fragment to f16 before ``HMMA.16816``), and W streams through per-thread 16-byte cp.async with
a CTA-wide barrier per K slice. Here ("swap AB", as decode GEMV-like MoE kernels do):

* the CTA's 64 weight rows are wgmma's **M** (operand A, from shared memory) and the
  expert's live token rows its **N** (operand B, ``tok_n`` wide): an ``m64n{tok_n}k32``
  e4m3 wgmma is exactly one MX block of K, so there is no padding of M to 64 tokens;
* both tiles arrive by TMA (128-byte K slices, 128B swizzle) through a ``STAGES``-deep
  mbarrier pipeline (one elected thread issues, the warpgroup consumes);
* per 32-wide K block the wgmma writes a zeroed FP32 fragment that is promoted into the
  accumulator with the two power-of-two scales, ``acc += frag * 2^(sw - 127) * 2^(sa - 127)``;
  two fragments alternate so that block kb's wgmma runs while block kb - 1 is promoted. A
  thread holds 2 weight rows x ``tok_n / 4`` token columns, so its scales are 2 + ``tok_n / 4``
  4-byte loads per K slice (the swizzled scale layout keeps a row's 4 blocks of a slice in
  one word), issued one slice ahead so that no promotion waits on a global load.

Epilogue: the accumulator tile (bf16-rounded, the GEMM's output rounding) goes through shared
memory so that a token's 64 output columns are stored contiguously; the fused variant computes
h = bf16(bf16(silu(g)) * u) for the tile's 32 features (gate rows n0..n0+31, up rows
n0+32..n0+63 of :func:`moe.experts.interleave_gate_up`) and one MXFP8 block per token.

Precision: the tensor core sums a block's 32 exact e4m3 products at reduced precision before
the FP32 promotion (on the H200 a few % of bf16 outputs differ from an FP32-exact emulation,
relative norm ~4e-4); the MX requantisation hides it except where g cancels to near zero.

Status: GPU-tested on the H200 (with and without ``row_passes``) and the default at every T
(:func:`moe.experts.expert_kernel_args`, which the decode runtime uses: passes of 32 token
columns above 384 tokens); run ``python bench/bench_moe_experts.py`` for its speed.

Constraints: ``K % 128 == 0``, ``N % 64 == 0``; without ``row_passes``, rows per expert <=
``tok_n`` (the caller's bound; a larger count would drop rows, so the host only selects this
mode from a token count).
"""

import os

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, Uint32

from cute_kernels import jit
from cute_kernels.mx_scales import e8m0_to_f32
from cute_kernels.tma_pipeline import swap_ab_operands, swap_ab_shared_storage, tma_tiles
from cute_kernels.warp_mma import fp8_wgmma_blocks, wgmma_fragments

from .experts_tiled_sm90 import (MX, RoutedGemmTensorEntry, check_swiglu_limit, routed_gemm_tensor_args,
                                 routed_gemm_tensors, store_silu_mul_mx_row)

BM = 64  # weight rows per CTA (wgmma M)
BK = 128  # bytes of K per pipeline stage: 4 MX blocks
TOK_N = (16, 32, 64)
THREADS = 128
#: default pipeline stages per token tile: 3 was the fastest of 3-6 everywhere on the H200 --
#: more CTAs per SM (6 / 5 / 3 at tok_n 16 / 32 / 64) beat deeper pipelines.
STAGES = {16: 3, 32: 3, 64: 3}
SMEM_PER_SM = 228 * 1024


def smem_bytes(tok_n: int, stages: int) -> int:
    """Shared memory of one CTA (+ the 1 KB the hardware reserves per CTA)."""
    return stages * (BM * BK + tok_n * BK) + tok_n * (BM + 1) * 4 + 2 * stages * 8 + 3 * 128 + 1024


class MoeExpertSwapABSm90(RoutedGemmTensorEntry):
    def __init__(self, E: int, N: int, K: int, tok_n: int, silu_quant: bool = False, stages: int = 3,
                 row_passes: bool = False, swiglu_limit: float | None = None):
        self.E, self.N, self.K, self.tok_n, self.silu_quant, self.stages = E, N, K, tok_n, silu_quant, stages
        self.swiglu_limit = swiglu_limit  # the fused epilogue's clamp of gate / up (None: none)
        # row_passes: a CTA covers every live row of its router tile (up to 128) in passes of
        # tok_n token columns, re-streaming its weight tile per pass; otherwise the caller
        # bounds every expert's rows by tok_n and there is one pass
        self.row_passes = row_passes
        self.I = N // 2
        self.ncb_i = -(-(self.I // MX) // 4)
        self.kb_pad = -(-(K // MX) // 4) * 4
        self.n_pad = -(-N // 128) * 128
        self.tile = (BM, tok_n, BK)

    @cute.jit
    def __call__(self, a_ptr: cute.Pointer, w_ptr: cute.Pointer, sfa_ptr: cute.Pointer, sfw_ptr: cute.Pointer,
                 out_ptr: cute.Pointer, q_ptr: cute.Pointer, sq_ptr: cute.Pointer, offs_ptr: cute.Pointer,
                 cnt_ptr: cute.Pointer, tile_ptr: cute.Pointer, rows: Int32, tiles: Int32, stream: cuda.CUstream):
        E, N, K = self.E, self.N, self.K
        f8 = cutlass.Float8E4M3FN
        mA = cute.make_tensor(a_ptr, cute.make_layout((rows, K, 1), stride=(K, 1, rows * K)))
        mW = cute.make_tensor(w_ptr, cute.make_layout((E * N, K, 1), stride=(K, 1, E * N * K)))
        mSA, mSW, mOut, mQ, mSQ, mOffs, mCnt, mTile = routed_gemm_tensors(
            self, sfa_ptr, sfw_ptr, out_ptr, q_ptr, sq_ptr, offs_ptr, cnt_ptr, tile_ptr, rows, tiles)

        tiled_mma, w_smem, a_smem, tma_w, tma_tensor_w, tma_a, tma_tensor_a = swap_ab_operands(
            f8, mW, mA, self.tile, self.stages)
        self.kernel(tiled_mma, tma_w, tma_tensor_w, tma_a, tma_tensor_a, w_smem, a_smem, mSA, mSW, mOut, mQ, mSQ,
                    mOffs, mCnt, mTile).launch(grid=[N // BM, tiles, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tma_w: cute.CopyAtom, mW: cute.Tensor, tma_a: cute.CopyAtom,
               mA: cute.Tensor, w_smem: cute.ComposedLayout, a_smem: cute.ComposedLayout, mSA: cute.Tensor,
               mSW: cute.Tensor, mOut: cute.Tensor, mQ: cute.Tensor, mSQ: cute.Tensor, mOffs: cute.Tensor,
               mCnt: cute.Tensor, mTile: cute.Tensor):
        nt, mt, _ = cute.arch.block_idx()
        e = mTile[mt]
        row0 = mt * 128
        live = Int32(0)
        if e >= 0:
            if cutlass.const_expr(self.row_passes):
                live = cutlass.min(mOffs[e] + mCnt[e] - row0, 128)  # the router tile's live rows
            else:
                live = cutlass.min(mOffs[e] + mCnt[e] - row0, self.tok_n)  # <= tok_n by the host's contract
        if live > 0:
            self.mainloop(tiled_mma, tma_w, mW, tma_a, mA, w_smem, a_smem, mSA, mSW, mOut, mQ, mSQ, e, row0,
                          nt * BM, live)

    @cute.jit
    def mainloop(self, tiled_mma: cute.TiledMma, tma_w: cute.CopyAtom, mW: cute.Tensor, tma_a: cute.CopyAtom,
                 mA: cute.Tensor, w_smem: cute.ComposedLayout, a_smem: cute.ComposedLayout, mSA: cute.Tensor,
                 mSW: cute.Tensor, mOut: cute.Tensor, mQ: cute.Tensor, mSQ: cute.Tensor, e: Int32, row0: Int32,
                 n0: Int32, live: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        f8 = cutlass.Float8E4M3FN
        STAGES, TN = self.stages, self.tok_n
        KT = self.K // BK
        sW, sA, sOut, pipe = swap_ab_shared_storage(f8, w_smem, a_smem, STAGES, self.tile, THREADS // 32, align=128)

        wrow0 = e * self.N + n0
        # All K slices of this CTA's 64 weight rows / of the router tile's first TN token rows
        # (rows past the tensor are zero-filled by TMA; token columns past `live` are never stored).
        gW = cute.local_tile(cute.domain_offset((wrow0, 0, 0), mW), (BM, BK), (None, None, None))[
            (None, None, 0, None, 0)]
        gA = cute.local_tile(cute.domain_offset((row0, 0, 0), mA), (TN, BK), (None, None, None))
        gA = gA[(None, None, None, None, 0)] if cutlass.const_expr(self.row_passes) else gA[(None, None, 0, None, 0)]
        tWsW, tWgW = tma_tiles(tma_w, sW, gW)
        tAsA, tAgA = tma_tiles(tma_a, sA, gA)
        prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES)
        cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
        if warp_idx == 0:
            for _ in cutlass.range_constexpr(min(STAGES, KT)):
                self.load(pipe, prod, tma_w, tWgW, tWsW, tma_a, tAgA, tAsA, KT)
                prod.advance()

        tCrW, tCrA, tCcC, acc = wgmma_fragments(tiled_mma, tidx, sW, sA, (BM, TN))
        acc.fill(0.0)
        # Two block partials in flight: the wgmma of block kb runs while block kb - 1 is promoted.
        frags = [cute.make_rmem_tensor(tCcC.shape, Float32) for _ in range(2)]
        NV = cute.size(acc)  # (column pair, row + 8, TN / 8 column blocks) per thread
        NC = NV // 2  # token columns per thread: 2 per 8-column block
        # Scale words: a row's 4 blocks of one K slice are one aligned 4-byte word of its
        # 512-byte atom (128 rows x 4 blocks: byte (r % 32) * 16 + (r // 32) * 4 + block).
        mSW32 = cute.recast_tensor(mSW, Uint32)
        mSA32 = cute.recast_tensor(mSA, Uint32)
        cb = self.kb_pad // 4
        sw_atom = (e * self.n_pad + n0 // 128 * 128) // 128 * cb  # atom index of K slice 0
        sa_atom = (row0 // 128) * cb
        # (rSw, rSa): the scale words of the slice being computed; (nSw, nSa): the next slice's,
        # loaded one slice ahead -- read where a slice's promotion needs them, each slice would
        # wait out a global load's latency
        rSw = cute.make_rmem_tensor(cute.make_layout((2,)), Uint32)
        rSa = cute.make_rmem_tensor(cute.make_layout((NC,)), Uint32)
        nSw = cute.make_rmem_tensor(cute.make_layout((2,)), Uint32)
        nSa = cute.make_rmem_tensor(cute.make_layout((NC,)), Uint32)
        self.load_scale_words(rSw, rSa, mSW32, mSA32, tCcC, sw_atom, sa_atom, n0, 0, 0, NC)

        if cutlass.const_expr(not self.row_passes):
            for kt in cutlass.range(KT, unroll=1):
                if kt + 1 < KT:
                    self.load_scale_words(nSw, nSa, mSW32, mSA32, tCcC, sw_atom, sa_atom, n0, 0, kt + 1, NC)
                self.k_slice(pipe, cons, tiled_mma, tCrW, tCrA, acc, frags, rSw, rSa, NV)
                self.advance_scale_words(rSw, rSa, nSw, nSa, NC)
                cons.advance()
                if warp_idx == 0 and prod.count < KT:
                    self.load(pipe, prod, tma_w, tWgW, tWsW, tma_a, tAgA, tAsA, KT)
                    prod.advance()
            self.epilogue(acc, tCcC, sOut, mOut, mQ, mSQ, tidx, row0, n0, live, NV)
        else:
            n_pass = (live + TN - 1) // TN
            for p in cutlass.range(n_pass, unroll=1):
                for kt in cutlass.range(KT, unroll=1):
                    if kt + 1 < KT:  # the next slice: this pass's, or the next pass's first
                        self.load_scale_words(nSw, nSa, mSW32, mSA32, tCcC, sw_atom, sa_atom, n0, p * TN, kt + 1, NC)
                    elif p + 1 < n_pass:
                        self.load_scale_words(nSw, nSa, mSW32, mSA32, tCcC, sw_atom, sa_atom, n0, (p + 1) * TN, 0, NC)
                    self.k_slice(pipe, cons, tiled_mma, tCrW, tCrA, acc, frags, rSw, rSa, NV)
                    self.advance_scale_words(rSw, rSa, nSw, nSa, NC)
                    cons.advance()
                    if warp_idx == 0 and prod.count < n_pass * KT:
                        self.load(pipe, prod, tma_w, tWgW, tWsW, tma_a, tAgA, tAsA, KT)
                        prod.advance()
                self.epilogue(acc, tCcC, sOut, mOut, mQ, mSQ, tidx, row0 + p * TN, n0,
                              cutlass.min(live - p * TN, TN), NV)
                acc.fill(0.0)
                cute.arch.barrier()  # every thread has read sOut before the next pass rewrites it

    @cute.jit
    def load_scale_words(self, rSw: cute.Tensor, rSa: cute.Tensor, mSW32: cute.Tensor, mSA32: cute.Tensor,
                         tCcC: cute.Tensor, sw_atom: Int32, sa_atom: Int32, n0: Int32, m0: Int32, kt: Int32,
                         NC: cutlass.Constexpr):
        """K slice ``kt``'s scale words of the thread's 2 weight rows and its token columns m0 +
        (flat fragment index i = (column pair, row + 8, column block): i = 2 r8 (+ 4 nb + cp))."""
        for r8 in cutlass.range_constexpr(2):
            nr = n0 % 128 + tCcC[2 * r8][0]
            rSw[r8] = mSW32[(sw_atom + kt) * 128 + (nr % 32) * 4 + nr // 32]
        for j in cutlass.range_constexpr(NC):
            m = m0 + tCcC[(j // 2) * 4 + j % 2][1]
            rSa[j] = mSA32[(sa_atom + kt) * 128 + (m % 32) * 4 + m // 32]

    @cute.jit
    def advance_scale_words(self, rSw: cute.Tensor, rSa: cute.Tensor, nSw: cute.Tensor, nSa: cute.Tensor,
                            NC: cutlass.Constexpr):
        """The next slice's words become the current ones (register moves)."""
        for r8 in cutlass.range_constexpr(2):
            rSw[r8] = nSw[r8]
        for j in cutlass.range_constexpr(NC):
            rSa[j] = nSa[j]

    @cute.jit
    def k_slice(self, pipe: pipeline.PipelineTmaAsync, cons: pipeline.PipelineState, tiled_mma: cute.TiledMma,
                tCrW: cute.Tensor, tCrA: cute.Tensor, acc: cute.Tensor, frags: list, rSw: cute.Tensor,
                rSa: cute.Tensor, NV: cutlass.Constexpr):
        """acc += one 128-wide K slice (stage cons.index): 4 MX blocks, each an FP8 wgmma promoted
        with its scales (the slice's words, loaded a slice ahead)."""
        pipe.consumer_wait(cons)
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
        fp8_wgmma_blocks(tiled_mma, tCrW, tCrA, cons.index, frags, BK // MX,
                         lambda frag, kb: self.promote(acc, frag, rSw, rSa, kb, NV))
        pipe.consumer_release(cons)

    @cute.jit
    def epilogue(self, acc: cute.Tensor, tCcC: cute.Tensor, sOut: cute.Tensor, mOut: cute.Tensor, mQ: cute.Tensor,
                 mSQ: cute.Tensor, tidx: Int32, rbase: Int32, n0: Int32, live: Int32, NV: cutlass.Constexpr):
        """Token-major rows rbase .. rbase + live of the tile through shared memory, bf16-rounded;
        or (silu_quant) h = bf16(bf16(silu(g)) * u) and one MXFP8 block per token."""
        bf16 = cutlass.BFloat16
        for i in cutlass.range_constexpr(NV):
            r, c = tCcC[i]
            sOut[c, r] = Float32(acc[i].to(bf16))  # the GEMM's bf16 output rounding
        cute.arch.barrier()
        if cutlass.const_expr(not self.silu_quant):
            for idx in cutlass.range(tidx, live * BM, THREADS):
                c = idx // BM
                r = idx - c * BM
                mOut[rbase + c, n0 + r] = sOut[c, r].to(bf16)
        else:
            if tidx < live:
                store_silu_mul_mx_row(sOut, tidx, mQ, mSQ, rbase + tidx, n0, self.ncb_i, self.swiglu_limit)

    @cute.jit
    def promote(self, acc: cute.Tensor, frag: cute.Tensor, rSw: cute.Tensor, rSa: cute.Tensor, kb: cutlass.Constexpr,
                NV: cutlass.Constexpr):
        """acc += one 32-wide K block's FP32 partial times its weight-row and token scales
        (flat fragment index i = (column pair, row + 8, column block))."""
        for i in cutlass.range_constexpr(NV):
            r8 = (i // 2) % 2
            j = (i // 4) * 2 + i % 2
            sw = e8m0_to_f32((rSw[r8] >> (8 * kb)) & Uint32(0xFF))
            sa = e8m0_to_f32((rSa[j] >> (8 * kb)) & Uint32(0xFF))
            acc[i] = acc[i] + frag[i] * (sw * sa)

    @cute.jit
    def load(self, pipe: pipeline.PipelineTmaAsync, prod: pipeline.PipelineState, tma_w: cute.CopyAtom,
             tWgW: cute.Tensor, tWsW: cute.Tensor, tma_a: cute.CopyAtom, tAgA: cute.Tensor, tAsA: cute.Tensor,
             KT: cutlass.Constexpr):
        """One K slice of both tiles into stage prod.index (one thread issues; tx-count barrier):
        slice prod.count of the single pass, or (row_passes) slice count % KT of token tile
        count // KT."""
        pipe.producer_acquire(prod)
        if cutlass.const_expr(self.row_passes):
            kt = prod.count % KT
            a_coord = (None, prod.count // KT, kt)
        else:
            kt = prod.count
            a_coord = (None, prod.count)
        cute.copy(tma_w, tWgW[(None, kt)], tWsW[(None, prod.index)], tma_bar_ptr=pipe.producer_get_barrier(prod))
        cute.copy(tma_a, tAgA[a_coord], tAsA[(None, prod.index)], tma_bar_ptr=pipe.producer_get_barrier(prod))
        pipe.producer_commit(prod)

    @staticmethod
    def can_implement(E: int, N: int, K: int, tok_n: int, stages: int | None = None) -> bool:
        stages = STAGES.get(tok_n, 0) if stages is None else stages
        return (1 <= E <= 1024 and K % BK == 0 and K > 0 and N % BM == 0 and N > 0 and tok_n in TOK_N
                and 2 <= stages <= 12 and smem_bytes(tok_n, stages) <= SMEM_PER_SM)


def tok_n_for(max_expert_rows: int) -> int | None:
    """The token tile for a bound on rows per expert, or None (use moe.experts_tiled_sm90)."""
    for n in TOK_N:
        if max_expert_rows <= n:
            return n
    return None


def _build(arch: str, *, E: int, N: int, K: int, tok_n: int, silu_quant: bool = False, stages: int | None = None,
           row_passes: bool = False, swiglu_limit: float | None = None):
    check_swiglu_limit("moe_expert_swap_ab_sm90", swiglu_limit, silu_quant)
    if not MoeExpertSwapABSm90.can_implement(E, N, K, tok_n, stages):
        raise ValueError(f"moe_expert_swap_ab_sm90: unsupported E={E}, N={N}, K={K}, tok_n={tok_n}, stages={stages} "
                         f"(K % 128, N % 64, tok_n in {TOK_N}, 2 <= stages <= 12 within shared memory)")
    P = jit.fake_gmem_ptr
    f8 = cutlass.Float8E4M3FN
    args = (P(f8, 16), P(f8, 16), P(cutlass.Uint8, 16), P(cutlass.Uint8, 16), P(cutlass.BFloat16, 16), P(f8, 16),
            P(cutlass.Uint8, 1), P(Int32, 4), P(Int32, 4), P(Int32, 4), Int32(128), Int32(1), jit.fake_stream())
    return MoeExpertSwapABSm90(E, N, K, tok_n, silu_quant, STAGES[tok_n] if stages is None else stages,
                               row_passes, swiglu_limit), args


KERNEL = jit.register(jit.KernelDef(
    name="moe_expert_swap_ab_sm90",
    build=_build,
    sources=(os.path.abspath(__file__), os.path.join(os.path.dirname(os.path.abspath(__file__)), "experts_tiled_sm90.py"),
             os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "cute_kernels", "tma_pipeline.py"),
             os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "cute_kernels", "warp_mma.py"),
             os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "cute_kernels", "mx_scales.py")),
    archs=("sm_90a",),
    # the runtime's configs (moe.experts.expert_kernel_args): one pass at T <= 16, row passes above
    aot_configs=({"E": 256, "N": 4096, "K": 7168, "tok_n": 16, "silu_quant": True},
                 {"E": 256, "N": 7168, "K": 2048, "tok_n": 16, "silu_quant": False},
                 {"E": 256, "N": 4096, "K": 7168, "tok_n": 16, "silu_quant": True, "row_passes": True},
                 {"E": 256, "N": 7168, "K": 2048, "tok_n": 16, "silu_quant": False, "row_passes": True},
                 # the decode runtime's MXFP8 draft head (spec_decode.fused_ops.MxDraftHead): the
                 # slice config's LM head as one expert
                 {"E": 1, "N": 129280, "K": 7168, "tok_n": 16, "silu_quant": False}),
    description="MXFP8 routed-expert GEMM at decode, Hopper: TMA + FP8 wgmma, weights as M",
))


def _build_tensors(arch: str, **config):
    op, _ = _build(arch, **config)
    return op.tensor_call, routed_gemm_tensor_args(op, op.silu_quant)


jit.register_tensor_entry(KERNEL, _build_tensors, aot_configs=KERNEL.aot_configs)
