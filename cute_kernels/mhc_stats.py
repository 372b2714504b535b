"""mHC statistics and mappings in one launch: ``X [T, n, C]`` -> ``H [T, 2n + n*n]``.

For every token ``t`` (``x = X[t].flatten()``, length ``K = n*C``, ``m = 2n + n*n``)::

    r        = rsqrt(sum(x*x) / K + eps)                    # the RMS statistic
    P[j]     = r * (x . phi[j])          j < m             # phi is [m, K] (rows = outputs)
    H_pre    = sigmoid(a_pre  * P[0:n]   + b[0:n]) + hc_eps
    H_post   = 2 sigmoid(a_post * P[n:2n]  + b[n:2n])
    H_res    = Sinkhorn_iters(exp(a_res * P[2n:].view(n, n) + b[2n:].view(n, n)))
    H[t]     = [H_pre | H_post | H_res (row-major)]        # fp32

``maps`` (static) picks the mappings one launch computes: ``"all"``, ``"pre"`` (``H_pre``: the
rows ``0..n`` of phi -- all a sublayer needs before its input, and all V4's final ``hc_head``
collapse needs) or ``"post_res"`` (``H_post`` and ``H_res``: the rest, read only when the
sublayer's output is mixed back). A decode step launches ``"pre"`` on its main stream and
``"post_res"`` on a side stream beside the sublayer's body, which takes the Sinkhorn chain and
five sixths of phi's bytes off the critical path. Each column is computed exactly as
``"all"`` computes it (the same products, splits and summation order): the two parts are
bit-equal to one ``"all"`` launch. ``H`` keeps its ``[T, 2n + n*n]`` layout; a part writes its
own columns only.

``hc_eps`` (static; DeepSeek-V4's ``hc_eps`` = 1e-6, default 0): the first row normalisation
(a softmax of the logits) is followed by ``+ hc_eps`` and every later normalisation divides
by ``sum + hc_eps`` -- DeepSeek's ``hc_split_sinkhorn``.

``(x * r) @ phi`` is computed as ``r * (x @ phi)``: ``r`` is one scalar per token, so the two
differ only by FP32 rounding (inside the tolerance the tests state). Sinkhorn alternates
row and column normalisation (rows first), like ``spec_decode.model.sinkhorn``.

Algorithm (a split-K skinny GEMM with a last-CTA epilogue). The product is
``[T, K] x [K, m]`` with K = 28672 and m = 24 at the model's size. On FP32 pipes it was
issue-bound (measured: ~3 us per 256-wide chunk of 32 tokens per SM, 42 us at T = 320), so
it runs on the tensor cores with warp-level ``mma.sync m16n8k16`` (bf16 in, FP32 accumulate):
phi is pre-split once into two bf16 planes ``hi = bf16(phi)``, ``lo = bf16(phi - hi)``
(:func:`mhc_split_phi`), both planes are the MMA's N rows (``2 * mp = 48``), and
``P = X hi + X lo`` carries 16 significant bits of every weight (X is bf16, so exact). Each
128-wide chunk accumulates from zero and is added to the running FP32 sum with
round-to-nearest adds: the MMA accumulator truncates, and over 1800 k-steps that bias
reached 5e-5 of H (measured). The
N = 48 shape is too narrow for a wgmma / tcgen05 tile to pay (one 64-row tile of tokens
would be mostly padding at decode T, and the time is the read of X and phi): the same
warp-MMA code is the Hopper and the Blackwell path.

Grid ``(splits, ceil(T / 32))``, 128 threads (2 x 2 warps: 16 tokens x 24 plane rows
each). A CTA owns 32 tokens and a contiguous range of 128-wide K chunks, streamed by a
4-stage cp.async pipeline into shared memory (rows padded to 272 B so ldmatrix is
conflict-free; a K tail is zero-filled); the sum of squares is taken from the same stage on
the FP32 pipes. Each CTA writes FP32 partials ``[t, 0..m, split]`` to a workspace; the last
CTA of a token tile (an acq_rel counter, as in :mod:`moe.router`) loads the tile's partials
a few columns per thread at once, sums them in split order -- so the result is
deterministic -- and evaluates the mappings (sigmoids by (token, i) threads; Sinkhorn by
one thread per token with the matrix in registers and approximate reciprocals), reading
``alpha`` and the bias from shared memory, where every CTA's first chunk group copied them. It
re-zeroes its counter, so a replayed CUDA graph needs no reset. ``splits`` (<= 64) is a
runtime value chosen by the host: about two CTAs per SM at small T, one split when the token
tiles alone fill the GPU.

Constraints: bf16 ``X`` contiguous, ``C % 8 == 0``, ``n`` in 1..4 (static, one compile per
``(n, C)``), phi fp32 ``[m, n*C]`` (split per call, allocating) or pre-split bf16
``[2 mp, n*C]``, ``alpha = (a_pre, a_post, a_res)`` fp32 [3] and ``bias`` fp32 [m] on the
device (weights: no host sync). ``T`` is a runtime value. The same source compiles for
sm_90a and sm_100a.

Tests / benchmark::

    pytest tests/test_mhc.py
    python bench/bench_mhc.py        # on a GPU; includes the side-stream overlap figure
"""

from __future__ import annotations

import os

import torch

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from . import jit
from .arch import current_arch, dispatch, num_sms
from .grid_sync import last_arrival
from .validate import check_cuda, check_int32_indexable, check_tensor
from .warp_mma import ldmatrix_operands, quad_sum

VEC = 8  # bf16 per 16-byte load
CHUNK = 128  # K elements per pipeline stage
PITCH = CHUNK + 8  # shared-memory row pitch (elements): conflict-free ldmatrix
STAGES = 4
TOKEN_TILE = 32
COLS_PER_PASS = 2  # epilogue: (token, column) sums whose partials are loaded at once
MAX_SPLITS = 64  # partials per (token, column): the last CTA reads them all
MAX_STREAMS = 8  # pre/post-mix; the statistics kernel takes n <= 4 (its accumulators)
MAX_STATS_STREAMS = 4
MAPS = ("all", "pre", "post_res")


def num_maps(n: int) -> int:
    return 2 * n + n * n


def map_range(n: int, maps: str = "all") -> tuple[int, int]:
    """``(first, count)``: the columns of ``H`` (rows of phi) that ``maps`` computes."""
    if maps not in MAPS:
        raise ValueError(f"mhc_stats: maps must be one of {MAPS}, got {maps!r}")
    return {"all": (0, num_maps(n)), "pre": (0, n), "post_res": (n, n + n * n)}[maps]


def padded_maps(n: int, maps: str = "all") -> int:
    """Rows per phi plane: the part's map count rounded up to a multiple of 8 (the MMA's N
    granularity)."""
    return -(-map_range(n, maps)[1] // 8) * 8


class MhcStats:
    """Compile-time configuration: streams ``n``, hidden ``C``, Sinkhorn iterations, the
    mappings computed (``maps``: this launch's ``m`` columns of H from column ``first``)."""

    def __init__(self, n: int, hidden: int, sinkhorn_iters: int, stages: int = STAGES, hc_eps: float = 0.0,
                 maps: str = "all"):
        self.hc_eps = float(hc_eps)
        self.n, self.C, self.iters = n, hidden, sinkhorn_iters
        self.K = n * hidden
        self.width = num_maps(n)  # H's row: every mapping
        self.first, self.m = map_range(n, maps)
        self.sigmoids = 2 * n - self.first if maps != "pre" else n  # sigmoid columns (pre / post) of the part
        self.sinkhorn = maps != "pre"  # H_res: the part's columns sigmoids .. m
        self.mp = padded_maps(n, maps)  # rows per phi plane (multiple of 8)
        self.nvec = self.K // VEC
        self.nchunks = -(-self.K // CHUNK)
        self.threads = 128
        self.stages = stages

    @cute.jit
    def __call__(self, x_ptr: cute.Pointer, phi_ptr: cute.Pointer, alpha_ptr: cute.Pointer, bias_ptr: cute.Pointer,
                 h_ptr: cute.Pointer, part_ptr: cute.Pointer, count_ptr: cute.Pointer, num_tokens: Int32,
                 splits: Int32, chunks_per_split: Int32, eps: Float32, stream: cuda.CUstream):
        m1, N2 = self.m + 1, 2 * self.mp
        mX = cute.make_tensor(x_ptr, cute.make_layout((num_tokens, self.K), stride=(self.K, 1)))
        mPhi = cute.make_tensor(phi_ptr, cute.make_layout((N2, self.K), stride=(self.K, 1)))  # [hi; lo] planes
        mAlpha = cute.make_tensor(alpha_ptr, cute.make_layout((3,)))
        mBias = cute.make_tensor(bias_ptr, cute.make_layout((self.width,)))
        mH = cute.make_tensor(h_ptr, cute.make_layout((num_tokens, self.width), stride=(self.width, 1)))
        # [t, j, split] with a fixed MAX_SPLITS pitch: one (t, j) column's splits are
        # contiguous 16-byte vectors for the epilogue
        mPart = cute.make_tensor(part_ptr, cute.make_layout((num_tokens, m1, MAX_SPLITS),
                                                            stride=(m1 * MAX_SPLITS, MAX_SPLITS, 1)))
        tiles = (num_tokens + TOKEN_TILE - 1) // TOKEN_TILE
        mCount = cute.make_tensor(count_ptr, cute.make_layout((tiles,)))
        # 2 x 2 warps of m16n8k16 bf16 MMAs: warps split the 32 tokens and the phi rows.
        tiled_mma = cute.make_tiled_mma(cute.nvgpu.warp.MmaF16BF16Op(cutlass.BFloat16, Float32, (16, 8, 16)),
                                        cute.make_layout((2, 2, 1)))
        self.kernel(mX, mPhi, mAlpha, mBias, mH, mPart, mCount, tiled_mma, num_tokens, splits, chunks_per_split,
                    eps).launch(grid=[splits, tiles, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.jit
    def tensor_call(self, mX: cute.Tensor, mPhi: cute.Tensor, mAlpha: cute.Tensor, mBias: cute.Tensor,
                    mH: cute.Tensor, mPart: cute.Tensor, mCount: cute.Tensor, splits: Int32, chunks_per_split: Int32,
                    eps: Float32, stream: cuda.CUstream):
        """The tensor entry (``jit.get_tensor_kernel``): ``mX [T, n, C]``, the split planes
        ``mPhi [2 mp, n C]``, ``mAlpha [3]``, ``mBias [2n + n n]``, ``mH [T, 2n + n n]``, the
        workspace's ``mPart`` / ``mCount`` (1-D: its capacity, and the split plan, checked by the
        caller)."""
        self.__call__(mX.iterator, mPhi.iterator, mAlpha.iterator, mBias.iterator, mH.iterator, mPart.iterator,
                      mCount.iterator, mX.shape[0], splits, chunks_per_split, eps, stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mPhi: cute.Tensor, mAlpha: cute.Tensor, mBias: cute.Tensor, mH: cute.Tensor,
               mPart: cute.Tensor, mCount: cute.Tensor, tiled_mma: cute.TiledMma, num_tokens: Int32, splits: Int32,
               chunks_per_split: Int32, eps: Float32):
        TT, m, S, N2, MP = TOKEN_TILE, self.m, self.stages, 2 * self.mp, self.mp
        tidx, _, _ = cute.arch.thread_idx()
        split, tile, _ = cute.arch.block_idx()
        tok0 = tile * TT
        live = cutlass.min(num_tokens - tok0, TT)  # tokens of this tile

        smem = cutlass.memory.SmemAllocator()
        # Stage s holds chunk c: X [TT, 128] and both phi planes [N2, 128], bf16, K-contiguous
        # rows padded to PITCH (272 B): the 8 rows an ldmatrix reads hit 8 distinct 16-B
        # bank groups.
        sX = smem.allocate_tensor(cutlass.BFloat16, cute.make_layout((TT, CHUNK, S), stride=(PITCH, 1, TT * PITCH)),
                                  16)
        sB = smem.allocate_tensor(cutlass.BFloat16, cute.make_layout((N2, CHUNK, S), stride=(PITCH, 1, N2 * PITCH)),
                                  16)
        sC = smem.allocate_tensor(Float32, cute.make_layout((TT, N2), stride=(N2, 1)), 16)
        sSsq = smem.allocate_tensor(Float32, cute.make_layout((TT,)), 16)
        sP = smem.allocate_tensor(Float32, cute.make_layout((TT, m + 1), stride=(m + 1, 1)), 16)
        sFlag = smem.allocate_tensor(Int32, cute.make_layout((1,)), 4)
        sAlpha = smem.allocate_tensor(Float32, cute.make_layout((3,)), 16)
        sBias = smem.allocate_tensor(Float32, cute.make_layout((self.width,)), 16)

        # cp.async (16 B per copy), STAGES-1 chunks in flight ahead of the MMAs.
        atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), cutlass.BFloat16, num_bits_per_copy=128)
        gXv = cute.zipped_divide(mX, (1, VEC))
        gBv = cute.zipped_divide(mPhi, (1, VEC))
        sXv = cute.zipped_divide(sX, (1, VEC, 1))
        sBv = cute.zipped_divide(sB, (1, VEC, 1))
        c_begin = split * chunks_per_split
        c_end = cutlass.min(c_begin + chunks_per_split, self.nchunks)
        # The mappings' parameters (alpha, bias) go to shared memory with the first chunk, for the
        # last CTA's epilogue: as global loads there, after the partials', they were one more
        # memory round trip on the critical path (the compiler issues them after the sums).
        atom4 = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), Float32, num_bits_per_copy=32)
        if tidx < self.width:
            cute.copy(atom4, cute.zipped_divide(mBias, (1,))[(None,), (tidx,)],
                      cute.zipped_divide(sBias, (1,))[(None,), (tidx,)])
        elif tidx < self.width + 3:
            cute.copy(atom4, cute.zipped_divide(mAlpha, (1,))[(None,), (tidx - self.width,)],
                      cute.zipped_divide(sAlpha, (1,))[(None,), (tidx - self.width,)])
        for s0 in cutlass.range_constexpr(S - 1):
            if c_begin + s0 < c_end:
                self.issue(gXv, gBv, sXv, sBv, atom, c_begin + s0, s0, tok0, live)
            cute.arch.cp_async_commit_group()

        thr_mma = tiled_mma.get_slice(tidx)
        tCsA = thr_mma.partition_A(sX)
        tCsB = thr_mma.partition_B(sB)
        tCrA = tiled_mma.make_fragment_A(tCsA[None, None, None, 0])
        tCrB = tiled_mma.make_fragment_B(tCsB[None, None, None, 0])
        tCsC = thr_mma.partition_C(sC)
        acc = tiled_mma.make_fragment_C(tCsC)
        # The MMA adds into its FP32 accumulator with truncation; over 1800 k-steps the bias
        # reached 5e-5 of H (measured). Each chunk (8 k-steps) accumulates from zero and is
        # then added to `total` with round-to-nearest FADDs ("promotion", as FP8 GEMMs do).
        total = cute.make_rmem_tensor(acc.layout, Float32)
        total.fill(0.0)
        s2r_A, tAsA, tArA, s2r_B, tBsB, tBrB = ldmatrix_operands(tiled_mma, cutlass.BFloat16, tidx, sX, sB, tCrA, tCrB)

        # Sum of squares on the FP32 pipes from the same stage: thread -> (token tidx / 4,
        # a quarter of the chunk).
        ssq = Float32(0.0)
        rX = cute.make_rmem_tensor(cute.make_layout((VEC,)), cutlass.BFloat16)
        q_tt, q_seg = tidx // 4, tidx % 4
        for c in cutlass.range(c_begin, c_end, 1):
            it = c - c_begin
            slot = it % S
            cute.arch.cp_async_wait_group(S - 2)
            # Chunk c has landed for every thread's copies, and every warp has finished
            # chunk c-1, whose slot the next issue overwrites.
            cute.arch.barrier()
            if c + S - 1 < c_end:
                self.issue(gXv, gBv, sXv, sBv, atom, c + S - 1, (it + S - 1) % S, tok0, live)
            cute.arch.cp_async_commit_group()
            acc.fill(0.0)
            for kb in cutlass.range_constexpr(CHUNK // 16):
                cute.copy(s2r_A, tAsA[None, None, kb, slot], tArA[None, None, kb])
                cute.copy(s2r_B, tBsB[None, None, kb, slot], tBrB[None, None, kb])
                cute.gemm(tiled_mma, acc, tCrA[None, None, kb], tCrB[None, None, kb], acc)
            total.store(total.load() + acc.load())
            if q_tt < live:
                for v in cutlass.range_constexpr(CHUNK // VEC // 4):
                    kv = q_seg * (CHUNK // VEC // 4) + v
                    if c * (CHUNK // VEC) + kv < self.nvec:
                        cute.autovec_copy(sXv[(0, None, 0), (q_tt, kv, slot)], rX)
                        xs = rX.load().to(Float32)
                        for e in cutlass.range_constexpr(VEC):
                            ssq = ssq + xs[e] * xs[e]

        # P partial = hi-plane + lo-plane products; sum of squares over the 4 quarter lanes.
        tCsC.store(total.load())
        ssq = quad_sum(ssq)
        if q_seg == 0:
            sSsq[q_tt] = ssq
        cute.arch.barrier()
        for idx in cutlass.range(tidx, live * (m + 1), self.threads):
            tt = idx // (m + 1)
            j = idx - tt * (m + 1)
            if j < m:
                mPart[tok0 + tt, j, split] = sC[tt, j] + sC[tt, MP + j]
            else:
                mPart[tok0 + tt, m, split] = sSsq[tt]

        # The last CTA of the tile sees every split's partials (cute_kernels.grid_sync).
        if last_arrival(mCount.iterator + tile, sFlag, splits):
            self.epilogue(sAlpha, sBias, mH, mPart, sP, tok0, live, splits, eps)
            if tidx == 0:
                mCount[tile] = 0  # ready for the next launch (graph replay needs no host reset)

    @cute.jit
    def issue(self, gXv: cute.Tensor, gBv: cute.Tensor, sXv: cute.Tensor, sBv: cute.Tensor, atom: cute.CopyAtom,
              c: Int32, slot: Int32, tok0: Int32, live: Int32):
        """cp.async chunk ``c`` (X rows of the live tokens, both phi planes) into stage ``slot``."""
        tidx, _, _ = cute.arch.thread_idx()
        VPR = CHUNK // VEC  # 16-byte vectors per row
        XV, BV = TOKEN_TILE * VPR, 2 * self.mp * VPR
        for i in cutlass.range_constexpr(-(-XV // self.threads)):
            idx = tidx + i * self.threads
            tt = idx // VPR
            v = idx - tt * VPR
            kv = c * VPR + v
            if idx < XV and tt < live:
                if kv < self.nvec:
                    cute.copy(atom, gXv[(0, None), (tok0 + tt, kv)], sXv[(0, None, 0), (tt, v, slot)])
                else:
                    sXv[(0, None, 0), (tt, v, slot)].fill(0.0)  # K tail: zeros, not stale chunks
        for i in cutlass.range_constexpr(-(-BV // self.threads)):
            idx = tidx + i * self.threads
            j = idx // VPR
            v = idx - j * VPR
            kv = c * VPR + v
            if idx < BV:
                if kv < self.nvec:
                    cute.copy(atom, gBv[(0, None), (j, kv)], sBv[(0, None, 0), (j, v, slot)])
                else:
                    sBv[(0, None, 0), (j, v, slot)].fill(0.0)

    @cute.jit
    def epilogue(self, mAlpha: cute.Tensor, mBias: cute.Tensor, mH: cute.Tensor, mPart: cute.Tensor,
                 sP: cute.Tensor, tok0: Int32, live: Int32, splits: Int32, eps: Float32):
        """``mAlpha`` / ``mBias``: the parameters' shared-memory copies (their copies are this
        thread's own cp.async group; the barrier below publishes them to the CTA)."""
        m, n, first = self.m, self.n, self.first
        tidx, _, _ = cute.arch.thread_idx()
        cute.arch.cp_async_wait_group(0)
        # Split partials: thread -> (token, column); all of a thread's loads (up to
        # COLS_PER_THREAD x MAX_SPLITS floats, 16-byte vectors) are issued before the first
        # add, so the tile's partials stream in one latency round; summed in split order.
        CPT = -(-TOKEN_TILE * (m + 1) // self.threads)
        gPart = cute.zipped_divide(mPart, (1, 1, 4))
        rS = cute.make_rmem_tensor(cute.make_layout(((4, MAX_SPLITS // 4), COLS_PER_PASS),
                                                    stride=((1, 4), MAX_SPLITS)), Float32)
        for p0 in cutlass.range_constexpr(0, CPT, COLS_PER_PASS):
            rS.fill(0.0)
            for k in cutlass.range_constexpr(COLS_PER_PASS):
                col = tidx + (p0 + k) * self.threads
                tt = col // (m + 1)
                j = col - tt * (m + 1)
                for v in cutlass.range_constexpr(MAX_SPLITS // 4):
                    if tt < live and v * 4 < splits:
                        cute.autovec_copy(gPart[(0, 0, None), (tok0 + tt, j, v)], rS[(None, v), k])
            for k in cutlass.range_constexpr(COLS_PER_PASS):
                col = tidx + (p0 + k) * self.threads
                tt = col // (m + 1)
                j = col - tt * (m + 1)
                s = Float32(0.0)
                for v in cutlass.range_constexpr(MAX_SPLITS // 4):
                    for e in cutlass.range_constexpr(4):
                        s = s + cutlass.select_(v * 4 + e < splits, rS[(e, v), k], Float32(0.0))
                if tt < live:
                    sP[tt, j] = s
        cute.arch.barrier()
        a_pre, a_post = mAlpha[0], mAlpha[1]
        one = Float32(1.0)
        sig = self.sigmoids
        for idx in cutlass.range(tidx, live * sig, self.threads):
            tt = idx // sig
            i = idx - tt * sig  # the part's column; H's is first + i
            gi = first + i
            r = cute.math.rsqrt(sP[tt, m] / Float32(self.K) + eps)
            z = cutlass.select_(gi < n, a_pre, a_post) * (r * sP[tt, i]) + mBias[gi]
            h = cutlass.select_(gi < n, one, Float32(2.0)) / (one + cute.math.exp(-z))
            if cutlass.const_expr(self.hc_eps != 0.0):
                h = h + cutlass.select_(gi < n, Float32(self.hc_eps), Float32(0.0))
            mH[tok0 + tt, gi] = h
        if cutlass.const_expr(self.sinkhorn):
            self.sinkhorn_maps(mAlpha, mBias, mH, sP, tok0, live, eps)

    @cute.jit
    def sinkhorn_maps(self, mAlpha: cute.Tensor, mBias: cute.Tensor, mH: cute.Tensor, sP: cute.Tensor, tok0: Int32,
                      live: Int32, eps: Float32):
        """``H_res`` of the tile's tokens from their summed products (``sP`` columns
        ``sigmoids ..``, H's columns ``2n ..``). Sinkhorn: one thread per token, the n x n
        matrix in registers. rcp.approx (rel. error <= 2^-23) instead of IEEE division: the
        iterations are a serial latency chain, and an IEEE divide costs ~10x an MUFU.RCP; the
        n row (column) sums and reciprocals of a step are independent, so a step is ~one add
        chain + one RCP."""
        m, n, s0 = self.m, self.n, self.sigmoids
        a_res = mAlpha[2]
        tidx, _, _ = cute.arch.thread_idx()
        if tidx < live:
            r = cute.math.rsqrt(sP[tidx, m] / Float32(self.K) + eps)
            # Flat, row-major: M[i * n + j]. (A 2-D CuTe tensor indexed with one integer
            # walks its coordinates column-major, which would transpose H_res.)
            M = cute.make_rmem_tensor(cute.make_layout((n * n,)), Float32)
            for e in cutlass.range_constexpr(n * n):
                M[e] = cute.math.exp(a_res * (r * sP[tidx, s0 + e]) + mBias[2 * n + e])
            inv = cute.make_rmem_tensor(cute.make_layout((n,)), Float32)
            he = self.hc_eps
            for it in cutlass.range_constexpr(self.iters):
                for i in cutlass.range_constexpr(n):
                    s = M[i * n]
                    for j in cutlass.range_constexpr(1, n):
                        s = s + M[i * n + j]
                    if cutlass.const_expr(he != 0.0 and it > 0):
                        s = s + Float32(he)
                    inv[i] = cute.arch.rcp_approx(s)
                for e in cutlass.range_constexpr(n * n):
                    M[e] = M[e] * inv[e // n]
                    if cutlass.const_expr(he != 0.0 and it == 0):
                        M[e] = M[e] + Float32(he)  # the softmax, then + hc_eps
                for j in cutlass.range_constexpr(n):
                    s = M[j]
                    for i in cutlass.range_constexpr(1, n):
                        s = s + M[i * n + j]
                    if cutlass.const_expr(he != 0.0):
                        s = s + Float32(he)
                    inv[j] = cute.arch.rcp_approx(s)
                for e in cutlass.range_constexpr(n * n):
                    M[e] = M[e] * inv[e % n]
            for e in cutlass.range_constexpr(n * n):
                mH[tok0 + tidx, 2 * n + e] = M[e]

    @staticmethod
    def can_implement(n: int, hidden: int, sinkhorn_iters: int) -> bool:
        return 1 <= n <= MAX_STATS_STREAMS and hidden % VEC == 0 and hidden > 0 and 0 <= sinkhorn_iters <= 100

    @staticmethod
    def compile(arch: str, n: int, hidden: int, sinkhorn_iters: int = 20, hc_eps: float = 0.0, maps: str = "all"):
        return jit.get_kernel("mhc_stats", arch, **MhcStats.config(n, hidden, sinkhorn_iters, hc_eps, maps))

    @staticmethod
    def config(n: int, hidden: int, sinkhorn_iters: int = 20, hc_eps: float = 0.0, maps: str = "all") -> dict:
        """The compile configuration (of the kernel and of its tensor entry); ``hc_eps = 0`` and
        every mapping leave it as it was before they existed, so their compile keys are unchanged."""
        extra = ({"hc_eps": float(hc_eps)} if hc_eps else {}) | ({"maps": maps} if maps != "all" else {})
        return dict(n=n, hidden=hidden, sinkhorn_iters=sinkhorn_iters, **extra)


def _build(arch: str, *, n: int, hidden: int, sinkhorn_iters: int, hc_eps: float = 0.0, maps: str = "all"):
    if not MhcStats.can_implement(n, hidden, sinkhorn_iters):
        raise ValueError(f"mhc_stats: unsupported n={n}, hidden={hidden}, sinkhorn_iters={sinkhorn_iters}")
    map_range(n, maps)
    P = jit.fake_gmem_ptr
    args = (P(cutlass.BFloat16, 16), P(cutlass.BFloat16, 16), P(Float32, 4), P(Float32, 4), P(Float32, 4),
            P(Float32, 16),
            P(Int32, 4), Int32(1), Int32(1), Int32(1), Float32(1e-6), jit.fake_stream())
    return MhcStats(n, hidden, sinkhorn_iters, hc_eps=hc_eps, maps=maps), args


def _build_tensors(arch: str, *, n: int, hidden: int, sinkhorn_iters: int, hc_eps: float = 0.0, maps: str = "all"):
    op, _ = _build(arch, n=n, hidden=hidden, sinkhorn_iters=sinkhorn_iters, hc_eps=hc_eps, maps=maps)
    sym, T, m = {}, jit.fake_tensor, num_maps(n)
    args = (T(cutlass.BFloat16, ("T", n, hidden), 16, sym), T(cutlass.BFloat16, (2 * padded_maps(n, maps), n * hidden),
                                                                16, sym),
            T(Float32, (3,), 4, sym), T(Float32, (m,), 4, sym), T(Float32, ("T", m), 4, sym),
            T(Float32, ("P",), 16, sym), T(Int32, ("C",), 4, sym), Int32(1), Int32(1), Float32(1e-6),
            jit.fake_env_stream())
    return op.tensor_call, args


KERNEL = jit.register(jit.KernelDef(
    name="mhc_stats",
    build=_build,
    sources=tuple(os.path.join(os.path.dirname(os.path.abspath(__file__)), f)
                  for f in ("mhc_stats.py", "grid_sync.py", "warp_mma.py")),
    archs=("sm_90a", "sm_100a", "sm_103a"),
    # DeepSeek-V4-Flash / -Pro: every mapping, and the pre / post_res parts of a decode step
    aot_configs=tuple({"n": 4, "hidden": C, "sinkhorn_iters": 20, "hc_eps": 1e-6} | ({"maps": p} if p != "all" else {})
                      for C in (4096, 7168) for p in MAPS) + ({"n": 4, "hidden": 7168, "sinkhorn_iters": 20},),
    description="mHC r, P = (X r) phi, sigmoid / Sinkhorn mappings; split-K, one launch",
))
jit.register_tensor_entry(KERNEL, _build_tensors, aot_configs=KERNEL.aot_configs)
#: (x.shape, sinkhorn_iters, hc_eps, maps, max_ctas, device index) -> the tensor entry
#: (jit.launch_tensor_entry) and, under the same key, the split plan (splits, chunks per split)
_TENSOR_FNS: dict = {}
_TENSOR_PLANS: dict = {}




def plan_splits(num_tokens: int, K: int, max_ctas: int) -> tuple[int, int]:
    """``(splits, chunks_per_split)``: about ``max_ctas`` CTAs, at most MAX_SPLITS partials.

    The last CTA of a tile reads ``live tokens x (m+1) x splits`` partials: with few tokens
    that is cheap and up to 64 splits spread phi's read over more SMs; with a full tile
    32 splits keep it to two latency rounds per thread.
    """
    nchunks = -(-K // CHUNK)
    tiles = -(-num_tokens // TOKEN_TILE)
    cap = MAX_SPLITS if num_tokens <= 8 else MAX_SPLITS // 2
    want = max(1, min(cap, nchunks, max_ctas // tiles))
    per = -(-nchunks // want)
    return -(-nchunks // per), per


class MhcStatsWorkspace:
    """Split partials + per-tile counters for up to ``max_tokens`` tokens (graph capturable)."""

    def __init__(self, n: int, max_tokens: int, device="cuda"):
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"mhc_stats: max_tokens must be a positive int, got {max_tokens!r}")
        self.n, self.max_tokens = n, max_tokens
        self.partials = torch.empty(MAX_SPLITS * max_tokens * (num_maps(n) + 1), dtype=torch.float32, device=device)
        self.counters = torch.zeros(-(-max_tokens // TOKEN_TILE), dtype=torch.int32, device=device)


_WORKSPACES: dict = {}
_RETIRED: list = []  # outgrown default workspaces: a captured graph may still hold their addresses


def default_workspace(n: int, T: int, device: torch.device, stream) -> MhcStatsWorkspace:
    """A call without a workspace (the custom op's): one per (device, stream, n), reused by
    every such call on that stream (a call's split-K partials and counters serve one launch in
    flight; launches on one stream run in order). A larger T gets a workspace twice as large
    or more; the outgrown one is kept, never freed, since a CUDA graph captured earlier may
    replay it. A new one allocates: warm up outside a graph capture."""
    key = (device, jit.stream_handle(stream), n)
    ws = _WORKSPACES.get(key)
    if ws is None or ws.max_tokens < T:
        if ws is not None:
            _RETIRED.append(ws)
        size = max(T, 64, 2 * ws.max_tokens if ws is not None else 0)
        ws = _WORKSPACES[key] = MhcStatsWorkspace(n, size, device=device)
    return ws


def mhc_split_phi(phi: torch.Tensor, maps: str = "all") -> torch.Tensor:
    """fp32 ``phi [m, K]`` -> the kernel's bf16 ``[2 * mp, K]`` for the mappings ``maps``
    (their rows of phi, :func:`map_range`): a high and a low plane.

    ``hi = bf16(phi)``, ``lo = bf16(phi - hi)`` (rows past the part's count are zero), so
    ``hi + lo`` carries 16 significant bits of every weight (relative error <= 2^-17) and
    one bf16 MMA pass over both planes with FP32 accumulation gives ``x . phi`` to about
    FP32 quality. phi is a weight: split it once at load time, not per call.
    """
    check_tensor("mhc_split_phi", "phi", phi, dtype=torch.float32, ndim=2, contiguous=True, align_bytes=0)
    m, K = phi.shape
    n = next((k for k in range(1, MAX_STATS_STREAMS + 1) if num_maps(k) == m), None)
    if n is None:
        raise ValueError(f"mhc_split_phi: phi.shape[0] = {m} is not 2n + n*n for n in 1..{MAX_STATS_STREAMS}")
    first, count = map_range(n, maps)
    mp = padded_maps(n, maps)
    part = phi[first:first + count]
    out = torch.zeros(2, mp, K, dtype=torch.bfloat16, device=phi.device)
    out[0, :count] = part.bfloat16()
    out[1, :count] = (part - out[0, :count].float()).bfloat16()
    return out.view(2 * mp, K)


def mhc_stats_torch(x, phi, alpha, bias, eps, iters, hc_eps=0.0, out=None, maps="all"):
    """The op in PyTorch (fp32 ``phi`` or the part's split planes): the fallback for devices
    without a CuTe path and the custom op's CPU kernel (not the test reference:
    tests/references.py). Writes the columns of ``maps`` only (``out`` None: the others NaN)."""
    T, n, C = x.shape
    first, count = map_range(n, maps)
    if phi.dtype == torch.bfloat16:
        mp = phi.shape[0] // 2
        phi = (phi[:mp].float() + phi[mp:].float())[:count]
    else:
        phi = phi[first:first + count]
    xf = x.float().reshape(T, n * C)
    P = torch.full((T, num_maps(n)), float("nan"), device=x.device)
    P[:, first:first + count] = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * (xf @ phi.T)
    h_pre = torch.sigmoid(alpha[0] * P[:, :n] + bias[:n]) + hc_eps
    h_post = 2 * torch.sigmoid(alpha[1] * P[:, n:2 * n] + bias[n:2 * n])
    M = torch.exp(alpha[2] * P[:, 2 * n:] + bias[2 * n:]).view(T, n, n)
    for it in range(iters):
        M = M / (M.sum(-1, keepdim=True) + (hc_eps if it else 0.0))
        if it == 0:
            M = M + hc_eps
        M = M / (M.sum(-2, keepdim=True) + hc_eps)
    H = torch.cat([h_pre, h_post, M.reshape(T, n * n)], -1)
    if out is None:
        out = torch.full_like(H, float("nan"))
    out[:, first:first + count] = H[:, first:first + count]
    return out


def mhc_stats(x: torch.Tensor, phi: torch.Tensor, alpha: torch.Tensor, bias: torch.Tensor, *, eps: float = 1e-6,
              sinkhorn_iters: int = 20, hc_eps: float = 0.0, maps: str = "all",
              workspace: MhcStatsWorkspace | None = None, out: torch.Tensor | None = None,
              max_ctas: int | None = None, stream=None, arch: str | None = None) -> torch.Tensor:
    """mHC mappings ``H [T, 2n + n*n]`` (fp32: ``[H_pre | H_post | H_res row-major]``) from ``x [T, n, C]``.

    ``phi`` is fp32 ``[2n + n*n, n*C]`` (one row per mapping coefficient) or, for the hot
    path, its split planes from :func:`mhc_split_phi` for the same ``maps`` (bf16 ``[2 mp,
    n*C]``); ``maps`` (``"all"``, ``"pre"``, ``"post_res"``) the columns computed -- the
    others of ``out`` are left as they were (of a new ``out``: NaN); ``alpha`` fp32
    ``[3]`` = ``(a_pre, a_post, a_res)``, ``bias`` fp32 ``[2n + n*n]``. Pass a
    :class:`MhcStatsWorkspace` and ``out`` to make the call allocation-free (graph capture);
    without one, a cached workspace per (device, stream) serves the call (its first use allocates).
    ``max_ctas`` (default: two per SM, what fits) bounds the split-K grid -- fewer CTAs
    leave SMs to the kernels a side-stream launch should overlap.
    """
    if (out is not None and jit.TVM_FFI and type(workspace) is MhcStatsWorkspace and stream is None
            and arch is None and isinstance(x, torch.Tensor)):  # the eager hot path (the C checks: dtypes,
        # extents, strides, alignment, device)
        key = (x.shape, sinkhorn_iters, hc_eps, maps, max_ctas, x.get_device())
        plan = _TENSOR_PLANS.get(key)
        if (plan is not None and workspace.n == x.shape[1] and workspace.max_tokens >= x.shape[0]
                and isinstance(eps, float) and eps >= 0
                and jit.launch_tensor_entry(_TENSOR_FNS, key, x, phi, alpha, bias, out, workspace.partials,
                                            workspace.counters, plan[0], plan[1], eps)):
            return out
    op = "mhc_stats"
    check_tensor(op, "x", x, dtype=torch.bfloat16, ndim=3, contiguous=True, align_bytes=0)
    T, n, C = x.shape
    if not 1 <= n <= MAX_STATS_STREAMS:
        raise ValueError(f"{op}: x.shape[1] (streams n) = {n} must be in [1, {MAX_STATS_STREAMS}]")
    if C % VEC:
        raise ValueError(f"{op}: x.shape[2] (hidden C) = {C} must be a multiple of {VEC}")
    check_tensor(op, "x", x, align_bytes=16)
    m, K = num_maps(n), n * C
    map_range(n, maps)  # a named ValueError for an unknown part
    check_int32_indexable(op, "x", T * K)
    check_tensor(op, "phi", phi, dtype=(torch.float32, torch.bfloat16), ndim=2, contiguous=True, align_bytes=16)
    if phi.dtype == torch.float32:
        check_tensor(op, "phi", phi, shape=(m, K))
    else:
        check_tensor(op, "phi", phi, shape=(2 * padded_maps(n, maps), K))
    check_tensor(op, "alpha", alpha, dtype=torch.float32, shape=(3,), contiguous=True, align_bytes=4)
    check_tensor(op, "bias", bias, dtype=torch.float32, shape=(m,), contiguous=True, align_bytes=4)
    if not isinstance(sinkhorn_iters, int) or not 0 <= sinkhorn_iters <= 100:
        raise ValueError(f"{op}: sinkhorn_iters must be an int in [0, 100], got {sinkhorn_iters!r}")
    if not isinstance(eps, (int, float)) or eps < 0:
        raise TypeError(f"{op}: eps must be a non-negative float, got {eps!r}")
    if not isinstance(hc_eps, (int, float)) or isinstance(hc_eps, bool) or not 0 <= hc_eps < 1:
        raise TypeError(f"{op}: hc_eps must be a float in [0, 1), got {hc_eps!r}")
    if out is None:
        out = (torch.empty(T, m, dtype=torch.float32, device=x.device) if maps == "all"
               else torch.full((T, m), float("nan"), dtype=torch.float32, device=x.device))
    check_tensor(op, "out", out, dtype=torch.float32, shape=(T, m), contiguous=True, align_bytes=4)
    check_cuda(op, ("x", x), ("phi", phi), ("alpha", alpha), ("bias", bias), ("out", out))
    a = arch if arch is not None else current_arch(x.device)
    if dispatch(op, ("portable", "reference"), arch=a) == "reference":
        return mhc_stats_torch(x, phi, alpha, bias, eps, sinkhorn_iters, hc_eps, out, maps)
    if T == 0:
        return out
    if workspace is None:
        workspace = default_workspace(n, T, x.device, stream)
    if not isinstance(workspace, MhcStatsWorkspace):
        raise TypeError(f"{op}: workspace must be an MhcStatsWorkspace, got {type(workspace).__name__}")
    if workspace.n != n or workspace.max_tokens < T:
        raise ValueError(f"{op}: workspace is for n={workspace.n}, max_tokens={workspace.max_tokens}; "
                         f"x needs n={n}, T={T}")
    check_cuda(op, ("x", x), ("workspace.partials", workspace.partials))
    if max_ctas is not None and (not isinstance(max_ctas, int) or max_ctas < 1):
        raise ValueError(f"{op}: max_ctas must be a positive int, got {max_ctas!r}")
    splits, per = plan_splits(T, K, max_ctas or 2 * num_sms(x.device.index or 0))
    split_planes = phi.dtype == torch.bfloat16
    if not split_planes:
        phi = mhc_split_phi(phi, maps)  # allocates: callers on the hot path pass the split planes
    fn = MhcStats.compile(a, n, C, sinkhorn_iters, hc_eps, maps)
    P = jit.gmem_ptr
    fn(P(cutlass.BFloat16, x, 16), P(cutlass.BFloat16, phi, 16), P(Float32, alpha, 4), P(Float32, bias, 4),
       P(Float32, out, 4), P(Float32, workspace.partials, 16), P(Int32, workspace.counters, 4), jit.i32(T),
       jit.i32(splits), jit.i32(per), jit.f32(eps), jit.cu_stream(stream))
    if split_planes and stream is None and arch is None:
        key = (x.shape, sinkhorn_iters, hc_eps, maps, max_ctas, x.get_device())
        _TENSOR_PLANS[key] = (splits, per)
        jit.remember_tensor_entry(_TENSOR_FNS, key, "mhc_stats_tensors", a,
                                  **MhcStats.config(n, C, sinkhorn_iters, hc_eps, maps))
    return out
