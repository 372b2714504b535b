"""MXFP8 routed-expert GEMM, Hopper path: ``out[r] = A[r] @ W[expert(r)]^T`` (bf16 out).

Hopper has no block-scaled MMA. Scheme: FP8 ``mma.sync m16n8k32`` -- its K step is exactly
one MX block -- into a zeroed FP32 fragment per 32-wide block, then
``acc += frag * 2^(sa[m] - 127) * 2^(sb[n] - 127)`` on the FP32 pipes ("promotion" per
block, as DeepSeek's FP8 GEMMs promote per 128). The product of two e4m3 values is exact in
FP32 and a 32-term block sum is within the MMA's accumulator precision, so the result is the
block-scaled dot product up to FP32 summation order -- the same numbers the Blackwell path
computes. Why not wgmma (first choice): its FP8 form accumulates across instructions in the
same registers, so per-block scales need one wgmma per 32-wide block with a register round
trip each; the warp MMA keeps the fragment in the thread that applies the scale. The cost of
that choice: ptxas lowers e4m3 ``mma.sync`` on sm_90 to ``F2FP.F16.E4M3.UNPACK_B`` conversions
+ ``HMMA.16816`` (192 unpacks per 128-wide K slice), so at prefill sizes this kernel is slower
than a bf16 grouped GEMM; decode steps take :mod:`moe.experts_swap_ab_sm90`.

Tiling: one CTA per (router tile of 128 rows, 64 output columns); only 16-row blocks holding
live rows are multiplied (decode: one of eight) and only live rows written. A cp.async
pipeline (``tile_k`` 128 or 256 bytes of K per stage, 2-4 stages, ``TILE_K``) brings K slices
of A (128 rows) and W (64 rows) into padded shared rows (conflict-free ldmatrix) plus the
512-byte scale atoms that cover them (the swizzled layout stores a 128-row x 4-block atom
contiguously). 4 x 2 warps, each 32 x 32. ``ctas_per_sm = 2`` is a launch bound (registers
capped at 128, some spill). The SiLU epilogue stages its tile in the A stages' memory.
The grid's tile count is bounded by ``routed_rows`` when the caller passes it.

Status: GPU-tested on the H200 (block-scaled CPU emulation, five tile configurations; the
fused SiLU * up + MXFP8 requantisation against the spec).

Inputs beyond the Blackwell path's: the router's ``expert_counts`` (live rows per expert)
and ``tile_expert`` (expert of each 128-row tile, -1 past the total). Rows of ``out`` that
are padding are not written (the finalize never reads them).

Constraints: ``K % 128 == 0``, ``N % 64 == 0``, router tile 128 (``RouterConfig.tile_m``).
"""

from __future__ import annotations

import os

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from cute_kernels import jit, mx_scales, warp_mma
from cute_kernels.mx_scales import e8m0_to_f32, swizzled_scale_byte, u32_as_f32
from cute_kernels.warp_mma import ldmatrix_operands

BM, BN = 128, 64
#: K tiles and their default stage counts: 128 x 4, or 256 x 3 (256-byte row segments per
#: stage: better DRAM locality, half the barriers per K). Fewer stages fit 2 CTAs per SM
#: (128 x 3: 86 KB, 256 x 2: 108 KB). The bench sweeps them.
TILE_K = {128: 4, 256: 3}
STAGE_RANGE = (2, 3, 4)
MX = 32


@cute.jit
def silu_mul_mx_block(rG: cute.Tensor, rU: cute.Tensor, rQ: cute.Tensor, limit: cutlass.Constexpr = None) -> Int32:
    """32 features of one row: ``h = bf16(bf16(silu(g)) * u)`` from the bf16-rounded gate and
    up GEMM outputs (fp32 registers; the unfused path's rounding points), then one MXFP8
    block -> e4m3 ``rQ`` and the UE8M0 scale byte (returned). ``limit`` (DeepSeek-V4's
    ``swiglu_limit``): ``g = min(g, limit)``, ``u = clamp(u, -limit, limit)`` first -- exact on
    the bf16 values, as the model clamps its bf16 linear outputs. Used by every fused epilogue."""
    one = Float32(1.0)
    rH = cute.make_rmem_tensor(cute.make_layout((MX,)), cutlass.BFloat16)
    for j in cutlass.range_constexpr(MX):
        g = rG[j]
        u = rU[j]
        if cutlass.const_expr(limit is not None):
            g = cutlass.min(g, Float32(limit))
            u = cutlass.max(cutlass.min(u, Float32(limit)), Float32(-limit))
        sg = (g / (one + cute.math.exp(-g))).to(cutlass.BFloat16)
        rH[j] = (Float32(sg) * u).to(cutlass.BFloat16)
    return mx_quantize_block(rH, rQ)


@cute.jit
def store_silu_mul_mx_row(sH: cute.Tensor, srow: Int32, mQ: cute.Tensor, mSQ: cute.Tensor, row: Int32, n0: Int32,
                          ncb: cutlass.Constexpr, limit: cutlass.Constexpr = None):
    """The fused gate/up epilogue for one token: staging row ``srow`` of ``sH`` holds the bf16-
    rounded GEMM outputs of weight rows n0 .. n0 + 63 (gate features in columns 0..31, up in
    32..63, :func:`moe.experts.interleave_gate_up`); h = bf16(bf16(silu(g)) * u) becomes one
    MXFP8 block of output row ``row`` in ``mQ`` and its scale byte in ``mSQ`` (swizzled, ``ncb``
    column atoms)."""
    rG = cute.make_rmem_tensor(cute.make_layout((MX,)), Float32)
    rU = cute.make_rmem_tensor(cute.make_layout((MX,)), Float32)
    for j in cutlass.range_constexpr(MX):
        rG[j] = sH[srow, j]
        rU[j] = sH[srow, MX + j]
    rQ = cute.make_rmem_tensor(cute.make_layout((MX,)), cutlass.Float8E4M3FN)
    scale = silu_mul_mx_block(rG, rU, rQ, limit)
    fb = n0 // (2 * MX)  # output scale block = feature block
    cute.autovec_copy(rQ, cute.zipped_divide(mQ, (1, MX))[(0, None), (row, fb)])
    mSQ[swizzled_scale_byte(row, fb, ncb)] = cutlass.Uint8(scale)


def check_swiglu_limit(op: str, swiglu_limit, silu_quant: bool) -> None:
    """A clamp needs the fused SiLU * up epilogue and a finite positive float."""
    if swiglu_limit is None:
        return
    if not silu_quant:
        raise ValueError(f"{op}: swiglu_limit={swiglu_limit!r} applies to the fused SiLU * up epilogue only")
    if not isinstance(swiglu_limit, (int, float)) or not (0 < float(swiglu_limit) < float("inf")):
        raise ValueError(f"{op}: swiglu_limit must be a finite float > 0 or None, got {swiglu_limit!r}")


@cute.jit
def mx_quantize_block(rX: cute.Tensor, rQ: cute.Tensor) -> Int32:
    """One 32-element bf16 block -> e4m3 ``rQ`` and its UE8M0 scale byte: the rule of
    :mod:`moe.quant` (amax from the bf16 magnitude bits; NaN/Inf -> 0xFF and 0x7F elements)."""
    bits = cute.recast_tensor(rX, cutlass.Uint16)
    amax = Int32(0)
    for i in cutlass.range_constexpr(MX):
        amax = cutlass.max(amax, Int32(bits[i]) & 0x7FFF)
    e_biased = (amax >> 7) - 8 + cutlass.select_(Int32(amax & 0x7F) > 0x60, Int32(1), Int32(0))
    scale = cutlass.max(cutlass.min(e_biased, Int32(254)), Int32(0))
    mult = u32_as_f32(Uint32(254 - scale) << 23)
    rQ.store((rX.load().to(Float32) * mult).to(rQ.element_type))
    if amax >= 0x7F80:
        scale = Int32(0xFF)
        cute.recast_tensor(rQ, cutlass.Uint8).fill(0x7F)
    return scale


@cute.jit
def _unit_modes(t: cute.Tensor, rank: cutlass.Constexpr[int]) -> cute.Tensor:
    """The same registers with trailing size-1 modes: one MMA block as cute.gemm's (V, M[, N])."""
    return cute.make_tensor(t.iterator, cute.append(t.layout, cute.make_layout(1), up_to_rank=rank))


def routed_gemm_tensors(k, sfa_ptr: cute.Pointer, sfw_ptr: cute.Pointer, out_ptr: cute.Pointer,
                        q_ptr: cute.Pointer, sq_ptr: cute.Pointer, offs_ptr: cute.Pointer, cnt_ptr: cute.Pointer,
                        tile_ptr: cute.Pointer, rows: Int32, tiles: Int32):
    """The global tensors both Hopper expert kernels (this one and :mod:`moe.experts_swap_ab_sm90`,
    which take the same arguments) view alike, for kernel configuration ``k`` (``E``, ``N``,
    ``kb_pad``, ``n_pad``, ``I``, ``ncb_i``): the swizzled A and W scales, the bf16 output,
    the fused path's requantised output and its scales, and the router's offsets, counts and
    tile -> expert map. Called while tracing a ``@cute.jit`` function."""
    E, N = k.E, k.N
    sfa_bytes = (rows + 127) // 128 * 128 * k.kb_pad
    mSA = cute.make_tensor(sfa_ptr, cute.make_layout((sfa_bytes,)))
    mSW = cute.make_tensor(sfw_ptr, cute.make_layout((E * k.n_pad * k.kb_pad,)))
    mOut = cute.make_tensor(out_ptr, cute.make_layout((rows, N), stride=(N, 1)))
    mQ = cute.make_tensor(q_ptr, cute.make_layout((rows, k.I), stride=(k.I, 1)))
    mSQ = cute.make_tensor(sq_ptr, cute.make_layout(((rows + 127) // 128 * 128 * k.ncb_i * 4,)))
    mOffs = cute.make_tensor(offs_ptr, cute.make_layout((E + 1,)))
    mCnt = cute.make_tensor(cnt_ptr, cute.make_layout((E,)))
    mTile = cute.make_tensor(tile_ptr, cute.make_layout((tiles,)))
    return mSA, mSW, mOut, mQ, mSQ, mOffs, mCnt, mTile


class RoutedGemmTensorEntry:
    """The tensor entry both Hopper expert kernels share (``jit.get_tensor_kernel``): their
    pointer arguments as torch tensors (:func:`routed_gemm_tensor_args` declares them)."""

    @cute.jit
    def tensor_call(self, mA: cute.Tensor, mW: cute.Tensor, mSA: cute.Tensor, mSW: cute.Tensor, mOut: cute.Tensor,
                    mQ: cute.Tensor, mSQ: cute.Tensor, mOffs: cute.Tensor, mCnt: cute.Tensor, mTile: cute.Tensor,
                    tiles: Int32, stream: cuda.CUstream):
        self.__call__(mA.iterator, mW.iterator, mSA.iterator, mSW.iterator,
                      cute.recast_ptr(mOut.iterator, dtype=cutlass.BFloat16), mQ.iterator, mSQ.iterator,
                      mOffs.iterator, mCnt.iterator, mTile.iterator, mA.shape[0], tiles, stream)


def routed_gemm_tensor_args(k, silu_quant: bool) -> tuple:
    """The tensor entry's arguments for kernel configuration ``k``: ``mA [rows, K]`` e4m3,
    ``mW [E, N, K]`` e4m3, ``mSA`` (its size for ``rows`` checked by the caller), ``mSW``
    ``[E, n_pad x kb_pad]`` bytes, then the plain GEMM's ``mOut [rows, N]`` bf16 (``mQ`` / ``mSQ``
    stand-ins, not read: the caller passes ``a_q`` / ``a_scales``) or the fused epilogue's
    ``mQ [rows, N / 2]`` e4m3 and ``mSQ`` (size checked by the caller; ``mOut`` a stand-in),
    the router's ``mOffs [E + 1]``, ``mCnt [E]`` and ``mTile``, the grid's tile count."""
    sym, T, f8, u8 = {}, jit.fake_tensor, cutlass.Float8E4M3FN, cutlass.Uint8
    E, N, K = k.E, k.N, k.K
    a, w = T(f8, ("R", K), 16, sym), T(f8, (E, N, K), 16, sym)
    sa, sw = T(u8, ("SA",), 16, sym), T(u8, (E, k.n_pad * k.kb_pad), 16, sym)
    if silu_quant:
        out, q, sq = T(f8, ("X0", "X1"), 16, sym), T(f8, ("R", N // 2), 16, sym), T(u8, ("SQ",), 1, sym)
    else:
        out, q, sq = T(cutlass.BFloat16, ("R", N), 16, sym), T(f8, ("X0", "X1"), 16, sym), T(u8, ("X2",), 1, sym)
    router = (T(Int32, (E + 1,), 4, sym), T(Int32, (E,), 4, sym), T(Int32, ("NT",), 4, sym))
    return (a, w, sa, sw, out, q, sq) + router + (Int32(1), jit.fake_env_stream())


class MoeExpertGemmTiledSm90(RoutedGemmTensorEntry):
    def __init__(self, E: int, N: int, K: int, silu_quant: bool = False, tile_k: int = 128,
                 stages: int | None = None, ctas_per_sm: int = 1, swiglu_limit: float | None = None):
        self.E, self.N, self.K, self.silu_quant = E, N, K, silu_quant
        self.swiglu_limit = swiglu_limit  # the fused epilogue's clamp of gate / up (None: none)
        self.bk, self.stages = tile_k, stages or TILE_K[tile_k]
        self.pitch = tile_k + 16  # bytes per shared row: ldmatrix rows land in distinct 16-byte bank groups
        self.apk = tile_k // 128  # 512-byte scale atoms (128 rows x 4 blocks) per operand per stage
        # ctas_per_sm = 2 is a launch bound: registers capped at 128 per thread (the kernel uses
        # ~144 uncapped, so some spill) so that two CTAs' registers fit beside their shared memory.
        self.ctas_per_sm = ctas_per_sm
        self.I = N // 2  # silu_quant: output features (gate / up interleaved by 32)
        self.ncb_i = -(-(self.I // MX) // 4)  # scale-column atoms of the requantised output
        self.kb_pad = -(-(K // MX) // 4) * 4
        self.n_pad = -(-N // 128) * 128
        self.threads = 256

    @cute.jit
    def __call__(self, a_ptr: cute.Pointer, w_ptr: cute.Pointer, sfa_ptr: cute.Pointer, sfw_ptr: cute.Pointer,
                 out_ptr: cute.Pointer, q_ptr: cute.Pointer, sq_ptr: cute.Pointer, offs_ptr: cute.Pointer,
                 cnt_ptr: cute.Pointer, tile_ptr: cute.Pointer, rows: Int32, tiles: Int32, stream: cuda.CUstream):
        E, N, K = self.E, self.N, self.K
        mA = cute.make_tensor(a_ptr, cute.make_layout((rows, K), stride=(K, 1)))
        mW = cute.make_tensor(w_ptr, cute.make_layout((E * N, K), stride=(K, 1)))
        mSA, mSW, mOut, mQ, mSQ, mOffs, mCnt, mTile = routed_gemm_tensors(
            self, sfa_ptr, sfw_ptr, out_ptr, q_ptr, sq_ptr, offs_ptr, cnt_ptr, tile_ptr, rows, tiles)
        tiled_mma = cute.make_tiled_mma(cute.nvgpu.warp.MmaFP8Op(cutlass.Float8E4M3FN, Float32, (16, 8, 32)),
                                        cute.make_layout((4, 2, 1)))
        self.kernel(mA, mW, mSA, mSW, mOut, mQ, mSQ, mOffs, mCnt, mTile, tiled_mma).launch(
            grid=[N // BN, tiles, 1], block=[self.threads, 1, 1], stream=stream,
            min_blocks_per_mp=self.ctas_per_sm, preferred_smem_carveout=100)  # carveout given: no device query

    @cute.kernel
    def kernel(self, mA: cute.Tensor, mW: cute.Tensor, mSA: cute.Tensor, mSW: cute.Tensor, mOut: cute.Tensor,
               mQ: cute.Tensor, mSQ: cute.Tensor, mOffs: cute.Tensor, mCnt: cute.Tensor, mTile: cute.Tensor,
               tiled_mma: cute.TiledMma):
        tidx, _, _ = cute.arch.thread_idx()
        nt, mt, _ = cute.arch.block_idx()
        e = mTile[mt]
        row0 = mt * BM
        live = Int32(0)
        if e >= 0:
            live = cutlass.min(mOffs[e] + mCnt[e] - row0, BM)  # live rows of this router tile
        if live > 0:
            # Expert e's [N, K] weights, offset in 64 bits: E * N * K bytes exceed 2^31 at the
            # model's sizes (256 x 4096 x 7168 = 7.5 GB), and an Int32 row index times K
            # wrapped for e >= 74 (an illegal address, or a silent read of a neighbouring
            # allocation). Within one expert, (n0 + r) * K stays below 2^31.
            w_off = cute.assume(Int64(e) * (self.N * self.K), divby=16)  # N % 64, K % 128: 16-byte rows
            mWe = cute.make_tensor(mW.iterator + w_off,
                                   cute.make_layout((self.N, self.K), stride=(self.K, 1)))
            self.mainloop(mA, mWe, mSA, mSW, mOut, mQ, mSQ, tiled_mma, e, row0, nt * BN, live)

    @cute.jit
    def mainloop(self, mA: cute.Tensor, mW: cute.Tensor, mSA: cute.Tensor, mSW: cute.Tensor, mOut: cute.Tensor,
                 mQ: cute.Tensor, mSQ: cute.Tensor, tiled_mma: cute.TiledMma, e: Int32, row0: Int32, n0: Int32,
                 live: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        f8 = cutlass.Float8E4M3FN
        BK, STAGES, PITCH, SB = self.bk, self.stages, self.pitch, 512 * self.apk
        KT = self.K // BK
        smem = cutlass.memory.SmemAllocator()
        sA = smem.allocate_tensor(f8, cute.make_layout((BM, BK, STAGES), stride=(PITCH, 1, BM * PITCH)), 16)
        sW = smem.allocate_tensor(f8, cute.make_layout((BN, BK, STAGES), stride=(PITCH, 1, BN * PITCH)), 16)
        sSA = smem.allocate_tensor(cutlass.Uint8, cute.make_layout((SB, STAGES), stride=(1, SB)), 16)
        sSW = smem.allocate_tensor(cutlass.Uint8, cute.make_layout((SB, STAGES), stride=(1, SB)), 16)
        # The SiLU epilogue's staging tile reuses the A stages (free once the mainloop is done):
        # 33 KB less shared memory per CTA.
        sH = cute.make_tensor(cute.recast_ptr(sA.iterator, dtype=Float32),
                              cute.make_layout((BM, BN + 1), stride=(BN + 1, 1)))

        atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), cutlass.Uint8, num_bits_per_copy=128)
        gA16 = cute.zipped_divide(cute.recast_tensor(mA, cutlass.Uint8), (1, 16))
        gW16 = cute.zipped_divide(cute.recast_tensor(mW, cutlass.Uint8), (1, 16))
        sA16 = cute.zipped_divide(cute.recast_tensor(sA, cutlass.Uint8), (1, 16, 1))
        sW16 = cute.zipped_divide(cute.recast_tensor(sW, cutlass.Uint8), (1, 16, 1))
        gSA16 = cute.zipped_divide(mSA, (16,))
        gSW16 = cute.zipped_divide(mSW, (16,))
        sSA16 = cute.zipped_divide(sSA, (16, 1))
        sSW16 = cute.zipped_divide(sSW, (16, 1))
        wrow0 = n0  # mW is expert e's [N, K] view
        # Scale atoms: rows [row0, +128) x blocks [4 kt, +4) is one contiguous 512-byte atom;
        # W's 64 rows sit inside the atom of rows [n0 - n0 % 128, +128).
        cb = self.kb_pad // 4
        sa_base = (row0 // 128) * cb * 512
        sw_base = (e * self.n_pad + n0 // 128 * 128) // 128 * cb * 512

        for s0 in cutlass.range_constexpr(STAGES - 1):
            if s0 < KT:
                self.issue(gA16, gW16, gSA16, gSW16, sA16, sW16, sSA16, sSW16, atom, s0, s0, row0, wrow0, live,
                           sa_base, sw_base)
            cute.arch.cp_async_commit_group()

        thr_mma = tiled_mma.get_slice(tidx)
        tCsA = thr_mma.partition_A(sA)
        tCsB = thr_mma.partition_B(sW)
        tCrA = tiled_mma.make_fragment_A(tCsA[None, None, None, 0])
        tCrB = tiled_mma.make_fragment_B(tCsB[None, None, None, 0])
        cC = cute.make_identity_tensor((BM, BN))
        tCcC = thr_mma.partition_C(cC)
        frag = tiled_mma.make_fragment_C(tiled_mma.partition_shape_C((BM, BN)))
        acc = cute.make_rmem_tensor(frag.layout, Float32)
        acc.fill(0.0)
        MR, NR = cute.size(frag, mode=[1]), cute.size(frag, mode=[2])
        rSa = cute.make_rmem_tensor(cute.make_layout((2 * MR,)), Float32)
        rSb = cute.make_rmem_tensor(cute.make_layout((2 * NR,)), Float32)
        s2r_A, tAsA, tArA, s2r_B, tBsB, tBrB = ldmatrix_operands(tiled_mma, f8, tidx, sA, sW, tCrA, tCrB)

        for kt in cutlass.range(0, KT, 1):
            slot = kt % STAGES
            cute.arch.cp_async_wait_group(STAGES - 2)
            # K slice kt has landed for all threads' copies; every warp is done with kt-1.
            cute.arch.barrier()
            if kt + STAGES - 1 < KT:
                self.issue(gA16, gW16, gSA16, gSW16, sA16, sW16, sSA16, sSW16, atom, kt + STAGES - 1,
                           (kt + STAGES - 1) % STAGES, row0, wrow0, live, sa_base, sw_base)
            cute.arch.cp_async_commit_group()
            for kb in cutlass.range_constexpr(BK // MX):
                cute.copy(s2r_B, tBsB[None, None, kb, slot], tBrB[None, None, kb])
                for ni in cutlass.range_constexpr(NR):
                    for c in cutlass.range_constexpr(2):
                        nr = n0 % 128 + tCcC[((c, 0), 0, ni)][1]
                        rSb[ni * 2 + c] = e8m0_to_f32(Uint32(sSW[(kb // 4) * 512 + (nr % 32) * 16 + (nr // 32) * 4
                                                                 + kb % 4, slot]))
                # Only 16-row MMA blocks that hold live rows do work: at decode a router tile
                # holds a few rows of its 128, and multiplying the padding made the kernel
                # compute-bound (the first H200 run: 14% of the copy bandwidth at T = 1).
                # The test must be uniform per warp (ldmatrix and mma.sync are warp-collective):
                # it uses the m-block's first row, not the thread's own row (lane // 4 + ...).
                for mi in cutlass.range_constexpr(MR):
                    if tCcC[((0, 0), mi, 0)][0] // 16 * 16 < live:
                        cute.copy(s2r_A, tAsA[None, mi, kb, slot], tArA[None, mi, kb])
                        for r8 in cutlass.range_constexpr(2):
                            m = tCcC[((0, r8), mi, 0)][0]
                            rSa[mi * 2 + r8] = e8m0_to_f32(Uint32(sSA[(kb // 4) * 512 + (m % 32) * 16
                                                                      + (m // 32) * 4 + kb % 4, slot]))
                        for ni in cutlass.range_constexpr(NR):
                            frag[None, mi, ni].fill(0.0)
                            c1 = _unit_modes(frag[None, mi, ni], 3)
                            cute.gemm(tiled_mma, c1, _unit_modes(tCrA[None, mi, kb], 2),
                                      _unit_modes(tCrB[None, ni, kb], 2), c1)
                            # Promotion: this block's FP32 partial times its two power-of-two
                            # scales (fragment ((col pair, row +8), m, n): 2 rows x 2 columns).
                            for r8 in cutlass.range_constexpr(2):
                                for c in cutlass.range_constexpr(2):
                                    crd = ((c, r8), mi, ni)
                                    acc[crd] = acc[crd] + frag[crd] * (rSa[mi * 2 + r8] * rSb[ni * 2 + c])

        if cutlass.const_expr(not self.silu_quant):
            for i in cutlass.range_constexpr(cute.size(acc)):
                m, n = tCcC[i]
                if m < live:
                    mOut[row0 + m, n0 + n] = acc[i].to(mOut.element_type)
        else:
            self.silu_quant_epilogue(acc, tCcC, sH, mQ, mSQ, row0, n0, live)

    @cute.jit
    def silu_quant_epilogue(self, acc: cute.Tensor, tCcC: cute.Tensor, sH: cute.Tensor, mQ: cute.Tensor,
                            mSQ: cute.Tensor, row0: Int32, n0: Int32, live: Int32):
        """Columns [n0, n0+32) are gate and [n0+32, n0+64) up of features f0 = n0/2 .. f0+31:
        h = bf16(bf16(silu(g)) * u) from the bf16-rounded GEMM outputs (the unfused rounding
        points), then one MXFP8 block per row (the rule of moe.quant), written in the
        swizzled scale layout the down projection reads."""
        tidx, _, _ = cute.arch.thread_idx()
        bf16 = cutlass.BFloat16
        cute.arch.barrier()  # sH aliases the A stages: every warp is done reading them
        for i in cutlass.range_constexpr(cute.size(acc)):
            m, n = tCcC[i]
            sH[m, n] = Float32(acc[i].to(bf16))  # the gate/up GEMM's bf16 output rounding
        # Every warp's accumulators are in shared memory before a row's thread reads them.
        cute.arch.barrier()
        if tidx < live:
            store_silu_mul_mx_row(sH, tidx, mQ, mSQ, row0 + tidx, n0, self.ncb_i, self.swiglu_limit)

    @cute.jit
    def issue(self, gA16: cute.Tensor, gW16: cute.Tensor, gSA16: cute.Tensor, gSW16: cute.Tensor, sA16: cute.Tensor,
              sW16: cute.Tensor, sSA16: cute.Tensor, sSW16: cute.Tensor, atom: cute.CopyAtom, kt: Int32, slot: Int32,
              row0: Int32, wrow0: Int32, live: Int32, sa_base: Int32, sw_base: Int32):
        """cp.async K slice kt: A rows (live ones), W rows, and the two scale atoms."""
        tidx, _, _ = cute.arch.thread_idx()
        VPR = self.bk // 16
        A32 = 32 * self.apk  # 16-byte scale vectors per operand per stage
        for i in cutlass.range_constexpr(BM * VPR // self.threads):
            idx = tidx + i * self.threads
            r, v = idx // VPR, idx % VPR
            if r < live:
                cute.copy(atom, gA16[(0, None), (row0 + r, kt * VPR + v)], sA16[(0, None, 0), (r, v, slot)])
        for i in cutlass.range_constexpr(BN * VPR // self.threads):
            idx = tidx + i * self.threads
            r, v = idx // VPR, idx % VPR
            cute.copy(atom, gW16[(0, None), (wrow0 + r, kt * VPR + v)], sW16[(0, None, 0), (r, v, slot)])
        # A tile's scale atoms for consecutive K blocks of one 128-row block are contiguous.
        if tidx < A32:
            cute.copy(atom, gSA16[None, sa_base // 16 + kt * A32 + tidx], sSA16[(None, 0), (tidx, slot)])
        elif tidx < 2 * A32:
            cute.copy(atom, gSW16[None, sw_base // 16 + kt * A32 + tidx - A32], sSW16[(None, 0), (tidx - A32, slot)])

    @staticmethod
    def can_implement(E: int, N: int, K: int, tile_k: int = 128, stages: int | None = None,
                      ctas_per_sm: int = 1) -> bool:
        st = stages or TILE_K.get(tile_k, 0)
        smem = (BM + BN) * (tile_k + 16) * st + 2 * 512 * (tile_k // 128) * st
        return (1 <= E <= 1024 and tile_k in TILE_K and K % tile_k == 0 and K > 0 and N % BN == 0 and N > 0
                and st in STAGE_RANGE and ctas_per_sm in (1, 2) and ctas_per_sm * (smem + 1024) <= 227 * 1024)


def _build(arch: str, *, E: int, N: int, K: int, silu_quant: bool = False, tile_k: int = 128,
           stages: int | None = None, ctas_per_sm: int = 1, swiglu_limit: float | None = None):
    check_swiglu_limit("moe_expert_gemm_tiled_sm90", swiglu_limit, silu_quant)
    if not MoeExpertGemmTiledSm90.can_implement(E, N, K, tile_k, stages, ctas_per_sm):
        raise ValueError(f"moe_expert_gemm_tiled_sm90: unsupported E={E}, N={N}, K={K}, tile_k={tile_k}, stages={stages}, "
                         f"ctas_per_sm={ctas_per_sm} (K % tile_k, N % 64, tile_k in {sorted(TILE_K)}, stages in "
                         f"{STAGE_RANGE}, shared memory of ctas_per_sm CTAs within 227 KB)")
    P = jit.fake_gmem_ptr
    f8 = cutlass.Float8E4M3FN
    args = (P(f8, 16), P(f8, 16), P(cutlass.Uint8, 16), P(cutlass.Uint8, 16), P(cutlass.BFloat16, 16), P(f8, 16),
            P(cutlass.Uint8, 1), P(Int32, 4), P(Int32, 4), P(Int32, 4), Int32(128), Int32(1), jit.fake_stream())
    return MoeExpertGemmTiledSm90(E, N, K, silu_quant, tile_k, stages, ctas_per_sm, swiglu_limit), args


KERNEL = jit.register(jit.KernelDef(
    name="moe_expert_gemm_tiled_sm90",
    build=_build,
    sources=(os.path.abspath(__file__), os.path.abspath(warp_mma.__file__), os.path.abspath(mx_scales.__file__)),
    archs=("sm_90a",),
    # the configs moe.experts launches by default (moe.experts.default_tile) at the model's sizes
    aot_configs=({"E": 256, "N": 4096, "K": 7168, "silu_quant": True, "tile_k": 128, "stages": None, "ctas_per_sm": 1},
                 {"E": 256, "N": 4096, "K": 7168, "silu_quant": False, "tile_k": 256, "stages": 2, "ctas_per_sm": 2},
                 {"E": 256, "N": 7168, "K": 2048, "silu_quant": False, "tile_k": 256, "stages": 2, "ctas_per_sm": 2}),
    description="MXFP8 routed-expert grouped GEMM, Hopper: FP8 mma.sync per 32-block + scale promotion",
))


def _build_tensors(arch: str, **config):
    op, _ = _build(arch, **config)
    return op.tensor_call, routed_gemm_tensor_args(op, op.silu_quant)


jit.register_tensor_entry(KERNEL, _build_tensors, aot_configs=KERNEL.aot_configs)
