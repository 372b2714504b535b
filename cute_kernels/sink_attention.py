"""Decode attention over gathered key rows with a learned sink, inverse RoPE in the epilogue:
DeepSeek-V4's sliding-window + compressed-entry MQA for every query token of a decode or
verify step in one launch.

For query token ``t`` (heads ``h``; one row set serves as keys and values)::

    s[t, h, k] = scale * q[t, h, :] . kv[rows[t, k], :]                        (FP32)
    p[t, h, :] = softmax([s[t, h, k] for the valid k] ++ [sink[h]])[:-1]       (the sink takes
                                                                                mass, adds no value)
    o[t, h, :] = sum_k p[t, h, k] * kv[rows[t, k], :]
    out[t, h]  = o[t, h] with its last r features rotated in adjacent pairs (a, b) by the token's
                 (cos, sin): (a cos - b sin, a sin + b cos) -- the inverse RoPE of the output when
                 ``rotate`` holds the conjugate rotation -- rounded once to bf16

Key ``k`` is valid when ``0 <= rows[t, k] < kv.shape[0]`` (-1 marks a window position before
0, an entry not yet visible, an unused top-k slot); no row outside ``kv`` is ever read. With no
valid key a head's output is 0 (the sink takes all the mass); with no valid key and a ``-inf``
sink it is NaN, as the softmax of nothing is.

The runtime's ``rows``: a window of the last ``W`` positions' rows of the request's raw-KV
ring, then its compressed entries (HCA: every visible one; CSA: the indexer's top-k), all
rows of one ``kv`` buffer (the layer's ring and pool side by side). The PyTorch composite this
replaces gathered ``[T, K, D]`` key rows, converted them to FP32, and ran two einsums, a
masked softmax with the sink concatenated and the inverse RoPE: about twenty launches and
``T K D`` FP32 intermediates per layer.

Algorithm (flash-decoding; tensor cores ``mma.sync m16n8k16``, bf16 in, FP32 accumulate). A
CTA owns one token ``t``, a group of ``HT`` heads (16, 32 or 64) and a contiguous range of
64-key tiles (a split of the token's keys). 8 warps. ``q[t, heads]`` arrives by cp.async into
padded shared rows once; per key tile, the 64 rows ``kv[rows[t, k]]`` arrive by cp.async
(gathered: one index per row; an invalid row is zero-filled, never read) into one of two
buffers while the previous tile computes:

1. ``S = q K^T`` (``HT x 64``, K = D in 16-steps), scaled by ``scale * log2 e``, to shared memory;
2. online softmax per head in FP32 (``256 / HT`` consecutive threads per head, shuffles):
   running max ``m`` (initialised with the sink logit in the first split), correction
   ``exp2(m_old - m_new)``, ``P = exp2(S - m_new)`` rounded to bf16 into shared memory, the
   running denominator ``l`` of the FP32 probabilities;
3. ``O = O * corr + P V`` with ``V`` the same tile read through a transposed view (ldmatrix.trans).

Epilogue: ``O`` (FP32 registers: up to ``64 x 512`` per CTA) goes through shared memory (over the
key buffers). One split: ``O / l``, the rotation of the last ``r`` features in FP32, one bf16
rounding, coalesced stores. Several: each CTA writes its unnormalised ``O`` and ``(m, l)`` to
the workspace and the last CTA of the token's head group to arrive (acq_rel counter,
:mod:`cute_kernels.grid_sync`, reset by that CTA: graph replays need no host reset) merges
the splits in a fixed order -- deterministic -- ``sum_i O_i 2^(m_i - M) / sum_i l_i 2^(m_i - M)``,
then rotates and stores as above: every split's ``(m, l)`` loaded at once, then split by split
each thread's eight 16-byte partial vectors at once (a memory round trip per split). The token's
(cos, sin) arrive in shared memory with ``q``. :func:`plan` picks the head group and the splits so a
step's CTAs fill the SMs: 64 heads per CTA when tokens alone fill them (each key tile read
once per token), else 16 heads and key splits (a small verify step).

Numerics: the scores, the softmax statistics, the accumulation and the rotation are FP32;
``exp2`` is the approximate ``ex2`` (relative error ~2^-22). The one rounding the FP32
definition does not have: ``P`` is rounded to bf16 (relative 2^-9) as the ``P V`` product's
operand, as FlashAttention does -- the denominator sums the unrounded FP32 probabilities. So
``|out - o| <= 2^-9 |o| + ~2^-8 sum_k p_k |v_k|`` per element (the tests' bound adds the
FP32 score error of the reduction over D). The PyTorch composite instead rounds ``o`` to bf16
before its inverse RoPE and rounds again after it.

Constraints: ``q`` bf16 ``[T, H, D]``, ``H % 16 == 0``; ``D % 64 == 0``, ``64 <= D <= 512``;
``kv`` bf16 ``[R, D]``; ``rows`` int32 ``[T, K]``, ``K >= 1``; ``sink`` FP32 ``[H]``;
``rotate`` None or FP32 ``[T, r / 2, 2]`` with ``r`` even, ``r <= D`` (static: one compile per
``(HT, D, r)``); all contiguous; ``T <= 65535``. Architecture-portable warp MMA (sm_90a,
sm_100a): the same kernel serves Hopper and Blackwell.

    pytest tests/test_sink_attention.py
    python bench/bench_sink_attention.py
"""

from __future__ import annotations

import math
import os

import torch

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from . import jit
from .arch import current_arch, dispatch, num_sms
from .grid_sync import last_arrival
from .validate import check_cuda, check_int32_indexable, check_rotation, check_tensor
from .warp_mma import ldmatrix_operands

LOG2E = math.log2(math.e)
KEY_TILE = 64
THREADS = 256
VEC = 8  # bf16 elements per 16-byte copy
HEAD_TILES = (64, 32, 16)
MAX_SPLITS = 16
MAX_TOKENS = 65535  # grid.y


class SinkAttention:
    """Compile-time configuration: heads per CTA ``HT``, head dim ``D``, rotated features ``r``
    (0: none). Tokens, heads, keys, rows and splits are runtime values."""

    def __init__(self, heads_per_cta: int, dim: int, rope_dim: int):
        if heads_per_cta not in HEAD_TILES or dim % 64 or not 64 <= dim <= 512 or rope_dim % 2 or not 0 <= rope_dim <= dim:
            raise ValueError(f"sink_attention: unsupported heads_per_cta={heads_per_cta}, dim={dim}, "
                             f"rope_dim={rope_dim}")
        self.HT, self.D, self.r = heads_per_cta, dim, rope_dim
        self.pitch = dim + VEC  # bf16 q / key rows: +16 B, so ldmatrix rows land in distinct banks
        self.s_pitch = KEY_TILE + 4  # FP32 scores
        self.p_pitch = KEY_TILE + VEC  # bf16 probabilities
        self.o_pitch = dim + 4  # FP32 output tile, over the key buffers
        # 8 warps: 16-head tiles side by side along N (1 x 8), 64 heads as 2 x 4 (32 x 32 per
        # step); either way one tiled MMA serves S = q K^T (HT x 64) and O = P V (HT x D)
        self.warp_layout = (2, 4, 1) if heads_per_cta == 64 else (1, 8, 1)
        self.row_threads = THREADS // heads_per_cta  # consecutive threads sharing a head's softmax row
        self.cols_per_thread = KEY_TILE // self.row_threads

    def smem_bytes(self) -> int:
        """Shared memory of one CTA (the allocator's order; the output tile reuses the key buffers)."""
        return (self.HT * self.pitch * 2 + 2 * KEY_TILE * self.pitch * 2 + self.HT * self.s_pitch * 4
                + self.HT * self.p_pitch * 2 + 2 * KEY_TILE * 4 + 3 * self.HT * 4 + 64)

    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, kv_ptr: cute.Pointer, rows_ptr: cute.Pointer, sink_ptr: cute.Pointer,
                 cs_ptr: cute.Pointer, out_ptr: cute.Pointer, part_ptr: cute.Pointer, ml_ptr: cute.Pointer,
                 count_ptr: cute.Pointer, num_tokens: Int32, heads: Int32, num_rows: Int32, num_keys: Int32,
                 splits: Int32, scale_log2: Float32, stream: cuda.CUstream):
        HT, D = self.HT, self.D
        groups = heads // HT
        units = num_tokens * groups * splits
        # q / out as (token x head) rows: a static row stride keeps the 16-byte copies provably aligned
        mQ = cute.make_tensor(q_ptr, cute.make_layout((num_tokens * heads, D), stride=(D, 1)))
        mKV = cute.make_tensor(kv_ptr, cute.make_layout((num_rows, D), stride=(D, 1)))
        mRows = cute.make_tensor(rows_ptr, cute.make_layout((num_tokens, num_keys), stride=(num_keys, 1)))
        mSink = cute.make_tensor(sink_ptr, cute.make_layout((heads,)))
        mCS = cute.make_tensor(cs_ptr, cute.make_layout((num_tokens, max(self.r, 2)), stride=(max(self.r, 2), 1)))
        mOut = cute.make_tensor(out_ptr, cute.make_layout((num_tokens * heads, D), stride=(D, 1)))
        mPart = cute.make_tensor(part_ptr, cute.make_layout((units, HT, D), stride=(HT * D, D, 1)))
        mML = cute.make_tensor(ml_ptr, cute.make_layout((units, HT, 2), stride=(HT * 2, 2, 1)))
        mCount = cute.make_tensor(count_ptr, cute.make_layout((num_tokens * groups,)))
        tiled_mma = cute.make_tiled_mma(cute.nvgpu.warp.MmaF16BF16Op(cutlass.BFloat16, Float32, (16, 8, 16)),
                                        cute.make_layout(self.warp_layout))
        self.kernel(mQ, mKV, mRows, mSink, mCS, mOut, mPart, mML, mCount, tiled_mma, heads, num_rows, num_keys,
                    splits, scale_log2).launch(grid=[splits, num_tokens, groups], block=[THREADS, 1, 1],
                                               stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mKV: cute.Tensor, mRows: cute.Tensor, mSink: cute.Tensor, mCS: cute.Tensor,
               mOut: cute.Tensor, mPart: cute.Tensor, mML: cute.Tensor, mCount: cute.Tensor,
               tiled_mma: cute.TiledMma, heads: Int32, num_rows: Int32, num_keys: Int32, splits: Int32,
               scale_log2: Float32):
        HT, D, bf16 = self.HT, self.D, cutlass.BFloat16
        tidx, _, _ = cute.arch.thread_idx()
        split, t, g = cute.arch.block_idx()
        neg_inf = Float32(float("-inf"))

        smem = cutlass.memory.SmemAllocator()
        sQ = smem.allocate_tensor(bf16, cute.make_layout((HT, D), stride=(self.pitch, 1)), 16)
        sK = smem.allocate_tensor(bf16, cute.make_layout((KEY_TILE, D, 2), stride=(self.pitch, 1, KEY_TILE * self.pitch)),
                                  16)
        sS = smem.allocate_tensor(Float32, cute.make_layout((HT, KEY_TILE), stride=(self.s_pitch, 1)), 16)
        sP = smem.allocate_tensor(bf16, cute.make_layout((HT, KEY_TILE), stride=(self.p_pitch, 1)), 16)
        sRow = smem.allocate_tensor(Int32, cute.make_layout((KEY_TILE, 2), stride=(1, KEY_TILE)), 16)
        sMax = smem.allocate_tensor(Float32, cute.make_layout((HT,)), 16)
        sSum = smem.allocate_tensor(Float32, cute.make_layout((HT,)), 16)
        sCorr = smem.allocate_tensor(Float32, cute.make_layout((HT,)), 16)
        sFlag = smem.allocate_tensor(Int32, cute.make_layout((1,)), 4)
        sCS = smem.allocate_tensor(Float32, cute.make_layout((max(self.r, 2),)), 16)  # the token's (cos, sin)
        # V^T: the key tile read as (D, keys) -- the P V product's B operand, N-contiguous
        sVt = cute.make_tensor(sK.iterator, cute.make_layout((D, KEY_TILE, 2), stride=(1, self.pitch,
                                                                                        KEY_TILE * self.pitch)))

        # this CTA's key tiles [j0, j1)
        tiles = (num_keys + KEY_TILE - 1) // KEY_TILE
        per_split = (tiles + splits - 1) // splits
        j0 = split * per_split
        j1 = cutlass.min(j0 + per_split, tiles)

        atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), bf16, num_bits_per_copy=128)
        row0 = t * heads + g * HT  # q / out row of this CTA's first head
        self.issue_q(mQ, sQ, atom, row0)
        if const_expr(self.r > 0):
            # the token's (cos, sin) with q: read by the epilogue from shared memory (as global
            # loads there, they were issued after the output's sums -- one more round trip)
            atom_cs = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), Float32, num_bits_per_copy=64)
            if tidx < self.r // 2:
                cute.copy(atom_cs, cute.zipped_divide(mCS, (1, 2))[(0, None), (t, tidx)],
                          cute.zipped_divide(sCS, (2,))[(None, tidx)])
        if j0 < j1:
            self.issue_keys(mKV, mRows, sK, sRow, atom, t, j0, 0, num_rows, num_keys)
        cute.arch.cp_async_commit_group()

        # softmax state: the sink is the first split's starting maximum (one term exp2(0) = 1)
        for h in cutlass.range(tidx, HT, THREADS):
            sink = mSink[g * HT + h] * Float32(LOG2E)
            first = split == 0
            sMax[h] = cutlass.select_(first, sink, neg_inf)
            sSum[h] = cutlass.select_(first and sink > neg_inf, Float32(1.0), Float32(0.0))

        thr_mma = tiled_mma.get_slice(tidx)
        tSrQ = tiled_mma.make_fragment_A(thr_mma.partition_A(sQ))
        tSrK = tiled_mma.make_fragment_B(thr_mma.partition_B(sK)[None, None, None, 0])
        tOrP = tiled_mma.make_fragment_A(thr_mma.partition_A(sP))
        tOrV = tiled_mma.make_fragment_B(thr_mma.partition_B(sVt)[None, None, None, 0])
        tScS = thr_mma.partition_C(cute.make_identity_tensor((HT, KEY_TILE)))
        tOcO = thr_mma.partition_C(cute.make_identity_tensor((HT, D)))
        acc_s = tiled_mma.make_fragment_C(tiled_mma.partition_shape_C((HT, KEY_TILE)))
        acc_o = tiled_mma.make_fragment_C(tiled_mma.partition_shape_C((HT, D)))
        acc_o.fill(0.0)
        s2r_Q, tQsQ, tQrQ, s2r_K, tKsK, tKrK = ldmatrix_operands(tiled_mma, bf16, tidx, sQ, sK, tSrQ, tSrK)
        s2r_P, tPsP, tPrP, _, _, _ = ldmatrix_operands(tiled_mma, bf16, tidx, sP, sK, tOrP, tSrK)
        s2r_V = cute.make_tiled_copy_B(cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(True, 2), bf16),
                                       tiled_mma)
        thr_V = s2r_V.get_slice(tidx)
        tVsV, tVrV = thr_V.partition_S(sVt), thr_V.retile(tOrV)

        for j in cutlass.range(j0, j1, 1):
            buf = (j - j0) % 2
            cute.arch.cp_async_wait_group(0)
            # tile j (and q) landed for every thread's copies; every warp is done with tile j - 1
            cute.arch.barrier()
            if j + 1 < j1:
                self.issue_keys(mKV, mRows, sK, sRow, atom, t, j + 1, 1 - buf, num_rows, num_keys)
            cute.arch.cp_async_commit_group()

            # 1. S = q K^T, in log2 units
            acc_s.fill(0.0)
            for kb in cutlass.range_constexpr(D // 16):
                cute.copy(s2r_Q, tQsQ[None, None, kb], tQrQ[None, None, kb])
                cute.copy(s2r_K, tKsK[None, None, kb, buf], tKrK[None, None, kb])
                cute.gemm(tiled_mma, acc_s, tSrQ[None, None, kb], tSrK[None, None, kb], acc_s)
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                m, n = tScS[i]
                sS[m, n] = acc_s[i] * scale_log2
            cute.arch.barrier()

            # 2. online softmax, one head row per `row_threads` consecutive threads
            self.softmax_tile(sS, sP, sRow, sMax, sSum, sCorr, buf)
            cute.arch.barrier()

            # 3. O = O * corr + P V
            for i in cutlass.range_constexpr(cute.size(acc_o)):
                m, _ = tOcO[i]
                acc_o[i] = acc_o[i] * sCorr[m]
            for kb in cutlass.range_constexpr(KEY_TILE // 16):
                cute.copy(s2r_P, tPsP[None, None, kb], tPrP[None, None, kb])
                cute.copy(s2r_V, tVsV[None, None, kb, buf], tVrV[None, None, kb])
                cute.gemm(tiled_mma, acc_o, tOrP[None, None, kb], tOrV[None, None, kb], acc_o)

        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()  # every warp is done with the key buffers: the output tile goes over them
        sO = cute.make_tensor(cute.recast_ptr(sK.iterator, dtype=Float32),
                              cute.make_layout((HT, D), stride=(self.o_pitch, 1)))
        for i in cutlass.range_constexpr(cute.size(acc_o)):
            m, n = tOcO[i]
            sO[m, n] = acc_o[i]
        cute.arch.barrier()

        if splits == 1:
            for h in cutlass.range(tidx, HT, THREADS):
                sCorr[h] = Float32(1.0) / sSum[h]
            cute.arch.barrier()
            self.store_out(sO, None, sCorr, sCS, mOut, t, row0, Int32(0), Int32(1))
        else:
            _, _, groups = cute.arch.grid_dim()
            tile = t * groups + g  # this token's head group: its counter, its splits' workspace rows
            unit0 = tile * splits
            for idx in cutlass.range(tidx, HT * D, THREADS):
                h = idx // D
                d = idx - h * D
                mPart[unit0 + split, h, d] = sO[h, d]
            for h in cutlass.range(tidx, HT, THREADS):
                mML[unit0 + split, h, 0] = sMax[h]
                mML[unit0 + split, h, 1] = sSum[h]
            if last_arrival(mCount.iterator + tile, sFlag, splits):
                # the splits' weights 2^(m_i - M) / L per head, over the scores' buffer
                sW = cute.make_tensor(sS.iterator, cute.make_layout((MAX_SPLITS, HT), stride=(HT, 1)))
                # (every split's (m, l) loaded at once -- a split past the count reads the last
                # one's and is masked: no branch between the loads)
                gML = cute.zipped_divide(mML, (1, 1, 2))
                rML = cute.make_rmem_tensor(cute.make_layout((2, MAX_SPLITS)), Float32)
                for h in cutlass.range(tidx, HT, THREADS):
                    for i in cutlass.range_constexpr(MAX_SPLITS):
                        cute.autovec_copy(gML[(0, 0, None), (unit0 + cutlass.min(Int32(i), splits - 1), h, 0)],
                                          rML[None, i])
                    mx = neg_inf
                    for i in cutlass.range_constexpr(MAX_SPLITS):
                        mx = cutlass.select_(i < splits, cutlass.max(mx, rML[0, i]), mx)
                    mx = cutlass.select_(mx == neg_inf, Float32(0.0), mx)
                    total = Float32(0.0)
                    for i in cutlass.range_constexpr(MAX_SPLITS):
                        w = cute.math.exp2(rML[0, i] - mx, fastmath=True)
                        if i < splits:
                            sW[i, h] = w
                        total = cutlass.select_(i < splits, total + rML[1, i] * w, total)
                    inv = Float32(1.0) / total
                    for i in cutlass.range(splits):
                        sW[i, h] = sW[i, h] * inv
                cute.arch.barrier()
                self.store_out(None, mPart, sW, sCS, mOut, t, row0, unit0, splits)
                if tidx == 0:
                    mCount[tile] = 0  # ready for the next launch

    @cute.jit
    def issue_q(self, mQ: cute.Tensor, sQ: cute.Tensor, atom: cute.CopyAtom, row0: Int32):
        """cp.async the ``HT`` query rows ``row0 ..`` (token t's head group) into the padded rows of ``sQ``."""
        tidx, _, _ = cute.arch.thread_idx()
        VPR = self.D // VEC
        gQv = cute.zipped_divide(mQ, (1, VEC))
        sQv = cute.zipped_divide(sQ, (1, VEC))
        n = self.HT * VPR
        for i in cutlass.range_constexpr(-(-n // THREADS)):
            idx = tidx + i * THREADS
            if const_expr(n % THREADS == 0):
                cute.copy(atom, gQv[(0, None), (row0 + idx // VPR, idx % VPR)],
                          sQv[(0, None), (idx // VPR, idx % VPR)])
            else:
                if idx < n:
                    cute.copy(atom, gQv[(0, None), (row0 + idx // VPR, idx % VPR)],
                              sQv[(0, None), (idx // VPR, idx % VPR)])

    @cute.jit
    def issue_keys(self, mKV: cute.Tensor, mRows: cute.Tensor, sK: cute.Tensor, sRow: cute.Tensor,
                   atom: cute.CopyAtom, t: Int32, j: Int32, buf: Int32, num_rows: Int32, num_keys: Int32):
        """cp.async key tile ``j`` of token ``t`` -- rows ``kv[rows[t, 64 j + r]]`` -- into buffer
        ``buf``; a key past ``num_keys`` or with a row outside ``kv`` is zero-filled (its score
        is masked; zeros keep ``0 * v`` finite in ``P V``) and recorded as row -1 in ``sRow``."""
        tidx, _, _ = cute.arch.thread_idx()
        VPR = self.D // VEC
        gKv = cute.zipped_divide(mKV, (1, VEC))
        sKv = cute.zipped_divide(sK, (1, VEC, 1))
        for i in cutlass.range_constexpr(KEY_TILE * VPR // THREADS):
            idx = tidx + i * THREADS
            r = idx // VPR
            v = idx - r * VPR
            key = j * KEY_TILE + r
            row = Int32(-1)
            if key < num_keys:
                row = mRows[t, key]
            ok = row >= 0 and row < num_rows
            if ok:
                cute.copy(atom, gKv[(0, None), (row, v)], sKv[(0, None, 0), (r, v, buf)])
            else:
                sKv[(0, None, 0), (r, v, buf)].fill(0.0)
            if v == 0:
                sRow[r, buf] = cutlass.select_(ok, row, Int32(-1))

    @cute.jit
    def softmax_tile(self, sS: cute.Tensor, sP: cute.Tensor, sRow: cute.Tensor, sMax: cute.Tensor,
                     sSum: cute.Tensor, sCorr: cute.Tensor, buf: Int32):
        """Head ``h = tidx / row_threads``: fold the tile's scores into the running max and sum,
        write ``P`` (bf16) and the O correction ``exp2(m_old - m_new)``. A thread takes the
        columns ``lane + row_threads * i`` (conflict-free shared reads)."""
        tidx, _, _ = cute.arch.thread_idx()
        G, C = self.row_threads, self.cols_per_thread
        neg_inf = Float32(float("-inf"))
        h = tidx // G
        lane = tidx - h * G
        vals = cute.make_rmem_tensor(cute.make_layout((C,)), Float32)
        tmax = neg_inf
        for i in cutlass.range_constexpr(C):
            c = lane + G * i
            x = cutlass.select_(sRow[c, buf] >= 0, sS[h, c], neg_inf)
            vals[i] = x
            tmax = cutlass.max(tmax, x)
        for k in cutlass.range_constexpr(int(math.log2(G))):
            tmax = cutlass.max(tmax, cute.arch.shuffle_sync_bfly(tmax, offset=1 << k))
        m_old = sMax[h]
        m_new = cutlass.max(m_old, tmax)
        m_use = cutlass.select_(m_new == neg_inf, Float32(0.0), m_new)  # nothing yet: exp2(-inf) = 0, no NaN
        corr = cute.math.exp2(m_old - m_use, fastmath=True)
        rsum = Float32(0.0)
        for i in cutlass.range_constexpr(C):
            p = cute.math.exp2(vals[i] - m_use, fastmath=True)
            sP[h, lane + G * i] = p.to(cutlass.BFloat16)
            rsum = rsum + p
        for k in cutlass.range_constexpr(int(math.log2(G))):
            rsum = rsum + cute.arch.shuffle_sync_bfly(rsum, offset=1 << k)
        # every lane of the row read sMax[h] above; a shuffle does not order shared memory
        cute.arch.sync_warp()
        if lane == 0:
            sMax[h] = m_new
            sSum[h] = sSum[h] * corr + rsum
            sCorr[h] = corr

    @cute.jit
    def store_out(self, sO, mPart, sW: cute.Tensor, sCS: cute.Tensor, mOut: cute.Tensor, t: Int32,
                  row0: Int32, unit0: Int32, splits: Int32):
        """``out[row0 + h, d]`` (token t, head ``g * HT + h``) `` = bf16(rotate(sum_i w[i, h] O_i[h, d]))`` over adjacent pairs
        ``d, d + 1``: one split's tile in shared memory (``sO``, weight ``1 / l``), or the splits'
        partials in the workspace (``mPart`` rows ``unit0 ..``, weights ``w``), in split order;
        ``sCS``: the token's (cos, sin), in shared memory."""
        tidx, _, _ = cute.arch.thread_idx()
        HT, D = self.HT, self.D
        if const_expr(sO is not None):
            half = D // 2
            for idx in cutlass.range(tidx, HT * half, THREADS):
                h = idx // half
                d = 2 * (idx - h * half)
                w = sW[h]
                self.store_pair(sO[h, d] * w, sO[h, d + 1] * w, sCS, mOut, row0 + h, d)
        else:
            # A thread per 4 consecutive columns, G of them (unrolled): a split's G vectors are
            # all loaded before any is summed, one memory round trip per split. (Pair by pair in
            # a loop, every split's two scalar loads waited behind the sums of the one before:
            # a round trip per split and pair.) Summed per column over the splits in split order.
            # (in chunks of at most 8 vectors: 64 registers; the merge runs with 16 heads, one chunk)
            nv = D // 4
            G = HT * nv // THREADS
            GC = min(G, 8)
            gP = cute.zipped_divide(mPart, (1, 1, 4))
            acc = cute.make_rmem_tensor(cute.make_layout((4, GC)), Float32)
            rP = cute.make_rmem_tensor(cute.make_layout((4, GC)), Float32)
            for k0 in cutlass.range_constexpr(0, G, GC):
                acc.fill(0.0)
                for i in cutlass.range(splits):
                    for k in cutlass.range_constexpr(GC):
                        q = tidx + (k0 + k) * THREADS
                        h = q // nv
                        cute.autovec_copy(gP[(0, 0, None), (unit0 + i, h, q - h * nv)], rP[None, k])
                    for k in cutlass.range_constexpr(GC):
                        w = sW[i, (tidx + (k0 + k) * THREADS) // nv]
                        for e in cutlass.range_constexpr(4):
                            acc[e, k] = acc[e, k] + rP[e, k] * w
                for k in cutlass.range_constexpr(GC):
                    q = tidx + (k0 + k) * THREADS
                    h = q // nv
                    d = (q - h * nv) * 4
                    for p in cutlass.range_constexpr(2):
                        self.store_pair(acc[2 * p, k], acc[2 * p + 1, k], sCS, mOut, row0 + h, d + 2 * p)

    @cute.jit
    def store_pair(self, a: Float32, b: Float32, sCS: cute.Tensor, mOut: cute.Tensor, row, d):
        """Columns ``d, d + 1`` of output row ``row``: rotated by the token's (cos, sin) of their
        pair when among the last ``r``, rounded once to bf16."""
        D, r = self.D, self.r
        if const_expr(r > 0):
            if d >= D - r:
                j = d - (D - r)  # (cos, sin) of pair j / 2 at columns j, j + 1
                c = sCS[j]
                s = sCS[j + 1]
                a, b = a * c - b * s, a * s + b * c
        mOut[row, d] = a.to(cutlass.BFloat16)
        mOut[row, d + 1] = b.to(cutlass.BFloat16)


def plan(tokens: int, heads: int, keys: int, sms: int = 132) -> tuple[int, int]:
    """``(heads_per_cta, splits)`` of a call. Every CTA reads its key tiles whatever its head
    count, so the widest head group whose CTAs (tokens x groups) fill the SMs wins -- each
    tile read once per token and head group; short of that, 16 heads per CTA and key splits
    up to about one CTA per SM (the splits' partials are merged by the last CTA)."""
    for ht in HEAD_TILES:
        if heads % ht == 0 and tokens * (heads // ht) >= sms:
            return ht, 1
    ht = 16
    tiles = -(-keys // KEY_TILE)
    ctas = tokens * (heads // ht)
    return ht, max(1, min(tiles, MAX_SPLITS, sms // ctas))


class SinkAttentionWorkspace:
    """The splits' FP32 partials ``O`` and ``(m, l)`` and one self-resetting counter per (token,
    head group), for up to ``max_tokens`` tokens of ``heads`` heads of dim ``dim``. One call in
    flight at a time: concurrent calls on different streams need their own."""

    def __init__(self, max_tokens: int, heads: int, dim: int, device="cuda", sms: int | None = None):
        self.max_tokens, self.heads, self.dim = max_tokens, heads, dim
        sms = sms if sms is not None else (num_sms(torch.device(device)) if torch.device(device).type == "cuda"
                                           else 132)
        self.sms = sms
        # plan() splits only while tokens x groups < sms, so units = ctas x splits <= sms + ctas
        units = sms + max_tokens * max(1, heads // 16)
        units = min(units, max_tokens * max(1, heads // 16) * MAX_SPLITS)
        self.partials = torch.empty(units * 16 * dim, dtype=torch.float32, device=device)
        self.ml = torch.empty(units * 16 * 2, dtype=torch.float32, device=device)
        self.counters = torch.zeros(max_tokens * max(1, heads // 16), dtype=torch.int32, device=device)

    def fits(self, tokens: int, heads: int, dim: int, heads_per_cta: int, splits: int) -> bool:
        units = tokens * (heads // heads_per_cta) * splits
        return (tokens <= self.max_tokens and heads == self.heads and dim == self.dim
                and (splits == 1 or (units * heads_per_cta * dim <= self.partials.numel()
                                     and units * heads_per_cta * 2 <= self.ml.numel())))


def _build(arch: str, *, heads_per_cta: int, dim: int, rope_dim: int = 0):
    k = SinkAttention(heads_per_cta, dim, rope_dim)
    P = jit.fake_gmem_ptr
    bf16 = cutlass.BFloat16
    return k, (P(bf16, 16), P(bf16, 16), P(Int32, 4), P(Float32, 4), P(Float32, 8), P(bf16, 4), P(Float32, 16),
               P(Float32, 8), P(Int32, 4), Int32(1), Int32(16), Int32(1), Int32(1), Int32(1), Float32(1.0),
               jit.fake_stream())


KERNEL = jit.register(jit.KernelDef(
    name="sink_attention",
    build=_build,
    sources=tuple(os.path.join(os.path.dirname(os.path.abspath(__file__)), f)
                  for f in ("sink_attention.py", "grid_sync.py", "warp_mma.py")),
    archs=("sm_90a", "sm_100a", "sm_103a"),
    # DeepSeek-V4: head dim 512, RoPE on the last 64; 64 heads per CTA for full batches, 16
    # for small verify steps (and a TP rank's 16 / 32 heads)
    aot_configs=tuple({"heads_per_cta": ht, "dim": 512, "rope_dim": 64} for ht in HEAD_TILES),
    description="decode MQA over gathered key rows with a learned sink, inverse RoPE epilogue (warp MMA)",
))


def sink_attention_torch(q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, sink: torch.Tensor, scale: float,
                         rotate: torch.Tensor | None = None) -> torch.Tensor:
    """The op in PyTorch, FP32 throughout with one bf16 rounding (P unrounded): the fallback for
    devices without a CuTe path (not the test reference: tests/references.py)."""
    valid = (rows >= 0) & (rows < kv.shape[0])
    keys = kv[rows.clamp(0, kv.shape[0] - 1).long()].float()  # [T, K, D]
    s = torch.einsum("thd,tkd->thk", q.float(), keys) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    s = torch.cat([s, sink.float()[None, :, None].expand(s.shape[0], -1, 1)], -1)
    o = torch.einsum("thk,tkd->thd", s.softmax(-1)[..., :-1], keys)
    if rotate is not None:
        r = 2 * rotate.shape[1]
        a, b = o[..., -r::2], o[..., -r + 1::2]
        c, sn = rotate[:, None, :, 0], rotate[:, None, :, 1]
        o = torch.cat([o[..., :-r], torch.stack([a * c - b * sn, a * sn + b * c], -1).flatten(-2)], -1)
    return o.to(q.dtype)


def sink_attention(q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, sink: torch.Tensor, scale: float, *,
                   rotate: torch.Tensor | None = None, out: torch.Tensor | None = None,
                   workspace: SinkAttentionWorkspace | None = None, stream=None,
                   arch: str | None = None) -> torch.Tensor:
    """Attention of bf16 queries ``q [T, H, D]`` over the key / value rows ``kv[rows[t]]``
    (``kv [R, D]`` bf16, ``rows [T, K]`` int32, -1 or out of range: masked) with a learned
    FP32 ``sink [H]`` logit per head, softmax scale ``scale``; ``rotate`` (FP32 ``[T, r / 2,
    2]``, each token's (cos, sin) per pair, contiguous) rotates the last ``r`` output features
    -- pass the conjugate rotation for the inverse RoPE. -> bf16 ``[T, H, D]`` (module
    docstring). ``out`` and ``workspace`` (:class:`SinkAttentionWorkspace`) make the call
    allocation-free and capturable in a CUDA graph; ``stream`` defaults to torch's current
    stream."""
    op = "sink_attention"
    check_tensor(op, "q", q, dtype=torch.bfloat16, ndim=3, contiguous=True)
    T, H, D = q.shape
    if H % 16 or H < 16:
        raise ValueError(f"{op}: q's heads ({H}) must be a positive multiple of 16")
    if D % 64 or not 64 <= D <= 512:
        raise ValueError(f"{op}: q's head dim ({D}) must be a multiple of 64 in [64, 512]")
    if not 1 <= T <= MAX_TOKENS:
        raise ValueError(f"{op}: q must hold 1 .. {MAX_TOKENS} tokens, got {T}")
    check_int32_indexable(op, "q", q.numel())
    check_tensor(op, "kv", kv, dtype=torch.bfloat16, ndim=2, contiguous=True)
    if kv.shape[1] != D or kv.shape[0] < 1:
        raise ValueError(f"{op}: kv must be [rows >= 1, {D}] (q's head dim), got {list(kv.shape)}")
    check_int32_indexable(op, "kv", kv.numel())
    check_tensor(op, "rows", rows, dtype=torch.int32, ndim=2, contiguous=True, align_bytes=4)
    if rows.shape[0] != T or rows.shape[1] < 1:
        raise ValueError(f"{op}: rows must be [{T} (q's tokens), keys >= 1], got {list(rows.shape)}")
    check_int32_indexable(op, "rows", rows.numel())
    check_tensor(op, "sink", sink, dtype=torch.float32, shape=(H,), contiguous=True, align_bytes=4)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"{op}: scale must be a finite float, got {scale!r}")
    r = 0 if rotate is None else check_rotation(op, rotate, T, D)
    if out is None:
        out = torch.empty_like(q)
    else:
        check_tensor(op, "out", out, dtype=torch.bfloat16, shape=(T, H, D), contiguous=True, align_bytes=4)
    named = [("q", q), ("kv", kv), ("rows", rows), ("sink", sink), ("out", out)]
    if rotate is not None:
        named.append(("rotate", rotate))
    dev = check_cuda(op, *named)
    a = arch if arch is not None else current_arch(dev)
    if dispatch(op, ("portable", "reference"), arch=a) == "reference":
        out.copy_(sink_attention_torch(q, kv, rows, sink, scale, rotate))
        return out
    ht, splits = plan(T, H, rows.shape[1], num_sms(dev))
    if workspace is None:
        workspace = SinkAttentionWorkspace(T, H, D, device=dev)
    elif not isinstance(workspace, SinkAttentionWorkspace):
        raise TypeError(f"{op}: workspace must be a SinkAttentionWorkspace, got {type(workspace).__name__}")
    elif not workspace.fits(T, H, D, ht, splits):
        raise ValueError(f"{op}: workspace (max_tokens={workspace.max_tokens}, heads={workspace.heads}, "
                         f"dim={workspace.dim}) does not fit T={T}, H={H}, D={D}")
    check_cuda(op, ("q", q), ("workspace", workspace.partials))
    fn = jit.get_kernel(op, a, heads_per_cta=ht, dim=D, rope_dim=r)
    P = jit.gmem_ptr
    bf16 = cutlass.BFloat16
    fn(P(bf16, q, 16), P(bf16, kv, 16), P(Int32, rows, 4), P(Float32, sink, 4),
       P(Float32, rotate if rotate is not None else sink, 8 if rotate is not None else 4), P(bf16, out, 4),
       P(Float32, workspace.partials, 16), P(Float32, workspace.ml, 8), P(Int32, workspace.counters, 4),
       jit.i32(T), jit.i32(H), jit.i32(kv.shape[0]), jit.i32(rows.shape[1]), jit.i32(splits),
       jit.f32(scale * LOG2E), jit.cu_stream(stream))
    return out
