"""DeepSeek-V4's KV compressor for a decode / verify step in one launch: every token that closes
a window pools its window's raw rows into a compressed entry (softmax gate per channel, RMSNorm,
RoPE) written to the pool, and every token's raw row goes into the compressor's ring.

For token ``t`` of request ``b`` at position ``p`` (slot ``slot[t]``), ratio ``m``, window span
``W`` (``m``; CSA's overlapping windows: ``2m``), this step's rows ``fresh [T, 2 ch]`` (kv then
gate, ``ch = coff d``: ``coff`` 2 for CSA, 1 for HCA)::

    ring[slot, p % ring_rows] = fresh[t]
    if (p + 1) % m == 0 and e = (p + 1) / m - 1 < pool_rows - 1:
        row q = p - W + 1 + i (i < W): fresh[t'] when q >= p0 (this step's first position, the
                                      row of its token t'), ring[slot, q % ring_rows] when 0 <= q < p0,
                                      none when q < 0 (its weight is 0)
        channel c of row i: half = d if CSA and i >= m else 0 (the previous window's rows use the
                            first d channels, this window's the second)
            kv = row[half + c], g = bf16(row[ch + half + c] + ape[i % m, half + c])
        w_i   = bf16(softmax_i(g))                        (FP32 softmax over the rows)
        x_c   = bf16(sum_i bf16(kv_i * w_i))              (FP32 sum)
        y     = bf16(bf16(x * bf16(rsqrt(mean(x^2) + eps))) * norm_w)
        pool[slot, e] = y with its last r features rotated in pairs by rotate[t] (the RoPE of the
                        entry's first position e m), rounded once

-- the rounding points of ``spec_decode.model.compress_entries`` followed by
:func:`cute_kernels.rms_norm.rms_norm` with ``rotate``, so the entries equal the composite's up to
``exp``'s and the FP32 sums' evaluation order (the tests bound it per element). It replaces the
composite's gather of the windows from ring and step (``[B, S, W, 2 ch]``), the masking, the
gate bias, the channel halves' concatenations, the softmax and its conversions, the weighted
sum, the norm, the pool scatter and the ring scatter: about fifteen launches per compressor.

Why the ring write cannot race the reads: a step of ``S <= ring_rows - W + 1`` tokens writes the
rows of positions ``>= p0``, which clobber positions ``< p0 + S - ring_rows <= p0 - W + 1``,
older than any row a window of the step reads from the ring (the ``DecodeState`` sizing).

Kernel: a cluster of ``split = min(8, d / 64)`` CTAs per token (fewer where that does not divide
``d / 64``), each owning ``d / split`` channels of the entry. Every CTA stores its share of the
token's 16-byte ring vectors; in a cluster whose token closes a window:

1. Thread ``(g, v)`` (row group ``g``, channel vector ``v``: 8 adjacent channels) loads, for
   its rows ``i = g, g + G, ...`` of the window (at most 8), the gate, ``ape`` and kv vectors
   (16 bytes each; a row before position 0, or past the window, loads the token's own row and
   is masked) and the norm weight and rotation -- every load issued before the first use.
2. Per channel: the window maximum of ``bf16(gate + ape)`` (a reduction over the row groups
   through shared memory), then the exponentials' sum, then the weighted sum of
   ``bf16(kv w)`` -- three such reductions, FP32, the rows' own order within a thread.
3. The entry's sum of squares: each CTA's share, stored into every CTA of the cluster
   (``st.async``, counted by the receiving CTA's transaction mbarrier:
   :mod:`cute_kernels.cluster_smem` -- no release barrier, whose memory fence would wait for
   the ring stores), summed in rank order (the same FP32 value in every CTA); then the norm,
   the weight, RoPE and one 16-byte store per 8 channels.

The window's rows are read once, every thread's requests in flight together: the step costs a
few memory round trips, not one per row and channel.

Constraints: ``d % 64 == 0``, ``64 <= d <= 1024``; ``r`` even, ``r <= d``; ``m >= 1``,
``W = 2m`` (CSA) or ``m``, ``W <= 8 G`` (``G = min(W, 512 / (d / 8 split))`` row groups:
``W <= 512`` at ``d = 512``); bf16 rows, ``ape`` and norm weight (16-byte aligned); FP32
``rotate [T, r/2, 2]``; int32 ``pos`` / ``slot`` ``[T]`` (a request's tokens consecutive,
``tokens_per_request`` each); ``tokens_per_request <= ring_rows - W + 1``. CUDA-core kernel
with thread-block clusters (sm_90a, sm_100a).

    pytest tests/test_compressor_pool.py
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
from .arch import current_arch, dispatch
from .cluster_smem import f32_bits, store_async_to_cta
from .validate import check_cuda, check_int32_indexable, check_rotation, check_tensor

VEC = 8  # channels per 16-byte vector
MAX_THREADS = 512
MAX_ROWS = 8  # window rows per thread


class CompressorPool:
    """Compile-time configuration: entry width ``d``, ratio ``m``, CSA overlap, rotated features."""

    def __init__(self, dim: int, ratio: int, overlap: bool, rope_dim: int):
        if dim % 64 or not 64 <= dim <= 1024 or ratio < 1 or rope_dim % 2 or not 0 <= rope_dim <= dim:
            raise ValueError(f"compressor_pool: unsupported dim={dim}, ratio={ratio}, rope_dim={rope_dim}")
        self.d, self.m, self.overlap, self.r = dim, ratio, overlap, rope_dim
        self.span = 2 * ratio if overlap else ratio
        self.ch = (2 if overlap else 1) * dim
        self.split = max(s for s in range(1, 9) if (dim // 64) % s == 0)  # CTAs of a token's cluster
        self.dslice = dim // self.split  # channels per CTA
        self.cvs = self.dslice // VEC  # channel vectors per CTA
        self.groups = max(min(MAX_THREADS // self.cvs, self.span), max(1, 32 // self.cvs))  # row groups
        self.rows = math.ceil(self.span / self.groups)  # window rows per thread
        if self.rows > MAX_ROWS:
            raise ValueError(f"compressor_pool: a window of {self.span} rows exceeds {MAX_ROWS * self.groups} "
                             f"at dim={dim} ({self.groups} row groups of {MAX_ROWS} rows)")
        self.threads = self.cvs * self.groups

    @cute.jit
    def __call__(self, fresh_ptr: cute.Pointer, ring_ptr: cute.Pointer, pool_ptr: cute.Pointer,
                 ape_ptr: cute.Pointer, w_ptr: cute.Pointer, cs_ptr: cute.Pointer, pos_ptr: cute.Pointer,
                 slot_ptr: cute.Pointer, num_tokens: Int32, per_request: Int32, num_slots: Int32, ring_rows: Int32,
                 pool_rows: Int32, eps: Float32, stream: cuda.CUstream):
        d, ch = self.d, self.ch
        mFresh = cute.make_tensor(fresh_ptr, cute.make_layout((num_tokens, 2 * ch), stride=(2 * ch, 1)))
        mRing = cute.make_tensor(ring_ptr, cute.make_layout((num_slots * ring_rows, 2 * ch), stride=(2 * ch, 1)))
        mPool = cute.make_tensor(pool_ptr, cute.make_layout((num_slots * pool_rows, d), stride=(d, 1)))
        mApe = cute.make_tensor(ape_ptr, cute.make_layout((self.m, ch), stride=(ch, 1)))
        mW = cute.make_tensor(w_ptr, cute.make_layout((1, d), stride=(d, 1)))
        mCS = cute.make_tensor(cs_ptr, cute.make_layout((num_tokens, max(self.r, 2)), stride=(max(self.r, 2), 1)))
        mPos = cute.make_tensor(pos_ptr, cute.make_layout((num_tokens,)))
        mSlot = cute.make_tensor(slot_ptr, cute.make_layout((num_tokens,)))
        kernel = self.kernel(mFresh, mRing, mPool, mApe, mW, mCS, mPos, mSlot, per_request, num_slots, ring_rows,
                             pool_rows, eps)
        if const_expr(self.split > 1):
            kernel.launch(grid=[num_tokens * self.split, 1, 1], block=[self.threads, 1, 1],
                          cluster=(self.split, 1, 1), stream=stream)
        else:
            kernel.launch(grid=[num_tokens, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mFresh: cute.Tensor, mRing: cute.Tensor, mPool: cute.Tensor, mApe: cute.Tensor,
               mW: cute.Tensor, mCS: cute.Tensor, mPos: cute.Tensor, mSlot: cute.Tensor, per_request: Int32,
               num_slots: Int32, ring_rows: Int32, pool_rows: Int32, eps: Float32):
        ch, m = self.ch, self.m
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        t = bidx // self.split
        rank = bidx % self.split  # this CTA's rank in the token's cluster
        p = mPos[t]
        slot = mSlot[t]
        first_t = (t // per_request) * per_request  # this request's first token of the step
        p0 = mPos[first_t]
        # uniform over a cluster: every CTA of it has the same token
        if p >= 0 and slot >= 0 and slot < num_slots:
            # this CTA's share of the token's raw row into the ring (16-byte vectors)
            dst = slot * ring_rows + p % ring_rows
            gF = cute.zipped_divide(mFresh, (1, VEC))
            gR = cute.zipped_divide(mRing, (1, VEC))
            for v in cutlass.range(rank * self.threads + tidx, 2 * ch // VEC, self.split * self.threads):
                cute.autovec_copy(gF[(0, None), (t, v)], gR[(0, None), (dst, v)])
            entry = (p + 1) // m - 1
            if (p + 1) % m == 0 and entry < pool_rows - 1:
                self.pool_entry(mFresh, mRing, mPool, mApe, mW, mCS, t, rank, p, p0, first_t, slot, ring_rows,
                                slot * pool_rows + entry, eps)

    @cute.jit
    def pool_entry(self, mFresh: cute.Tensor, mRing: cute.Tensor, mPool: cute.Tensor, mApe: cute.Tensor,
                   mW: cute.Tensor, mCS: cute.Tensor, t: Int32, rank: Int32, p: Int32, p0: Int32, first_t: Int32,
                   slot: Int32, ring_rows: Int32, row: Int32, eps: Float32):
        """This CTA's channels of the entry closed at position ``p`` into pool row ``row``
        (module docstring, steps 1-3)."""
        d, ch, m, span, bf16 = self.d, self.ch, self.m, self.span, cutlass.BFloat16
        tidx, _, _ = cute.arch.thread_idx()
        v = tidx % self.cvs
        grp = tidx // self.cvs
        c0 = rank * self.dslice + v * VEC  # this thread's first channel of the entry
        smem = cutlass.memory.SmemAllocator()
        sRed = smem.allocate_tensor(Float32, cute.make_layout((self.groups, self.dslice), stride=(self.dslice, 1)), 16)
        sTot = smem.allocate_tensor(Float32, cute.make_layout((self.dslice,)), 16)
        sSS = smem.allocate_tensor(Float32, cute.make_layout((self.split,)), 16)
        if const_expr(self.split > 1):
            mbar = smem.allocate_tensor(cutlass.Int64, cute.make_layout((1,)), 8)  # counts the shares sent here
            if tidx == 0:
                cute.arch.mbarrier_init(mbar.iterator, 1)
                cute.arch.mbarrier_init_fence()
            cute.arch.cluster_arrive_relaxed()  # (its wait, before the first remote store: all CTAs running)

        # 1. every load at once: gate, ape and kv vectors of this thread's rows; weight; rotation
        gF = cute.zipped_divide(mFresh, (1, VEC))
        gR = cute.zipped_divide(mRing, (1, VEC))
        gA = cute.zipped_divide(mApe, (1, VEC))
        rG = cute.make_rmem_tensor(cute.make_layout((VEC, self.rows)), bf16)
        rA = cute.make_rmem_tensor(cute.make_layout((VEC, self.rows)), bf16)
        rK = cute.make_rmem_tensor(cute.make_layout((VEC, self.rows)), bf16)
        for j in cutlass.range_constexpr(self.rows):
            i, ok = self.window_row(grp, j, p)
            q = p - span + 1 + i
            i = cutlass.select_(ok, i, Int32(span - 1))  # masked rows read the token's own row
            q = cutlass.select_(ok, q, p)
            half = self.half(i)
            col = (half + c0) // VEC
            if q >= p0:
                src = first_t + q - p0
                cute.autovec_copy(gF[(0, None), (src, col + ch // VEC)], rG[None, j])
                cute.autovec_copy(gF[(0, None), (src, col)], rK[None, j])
            else:
                src = slot * ring_rows + q % ring_rows
                cute.autovec_copy(gR[(0, None), (src, col + ch // VEC)], rG[None, j])
                cute.autovec_copy(gR[(0, None), (src, col)], rK[None, j])
            cute.autovec_copy(gA[(0, None), (i % m, col)], rA[None, j])
        rW = cute.make_rmem_tensor(cute.make_layout((VEC,)), bf16)
        cute.autovec_copy(cute.zipped_divide(mW, (1, VEC))[(0, None), (0, c0 // VEC)], rW)
        rCS = cute.make_rmem_tensor(cute.make_layout((VEC,)), Float32)
        if const_expr(self.r > 0):
            for e in cutlass.range_constexpr(VEC):
                k = c0 + e - (d - self.r)  # pair (k & ~1, k | 1): (cos, sin)
                if c0 + e >= d - self.r:
                    rCS[e] = mCS[t, k]

        # 2. softmax over the window per channel, then the weighted sum
        neg_inf = Float32(float("-inf"))
        g = cute.make_rmem_tensor(cute.make_layout((VEC, self.rows)), Float32)
        acc = cute.make_rmem_tensor(cute.make_layout((VEC,)), Float32)
        for e in cutlass.range_constexpr(VEC):
            acc[e] = neg_inf
            for j in cutlass.range_constexpr(self.rows):
                _, ok = self.window_row(grp, j, p)
                gv = (rG[e, j].to(Float32) + rA[e, j].to(Float32)).to(bf16).to(Float32)
                g[e, j] = cutlass.select_(ok, gv, neg_inf)
                acc[e] = cutlass.max(acc[e], g[e, j])
        self.reduce_groups(sRed, sTot, acc, grp, v, True)  # acc: the window maximum
        for e in cutlass.range_constexpr(VEC):
            mx = acc[e]
            acc[e] = Float32(0.0)
            for j in cutlass.range_constexpr(self.rows):
                g[e, j] = cute.math.exp(g[e, j] - mx)  # masked rows: exp(-inf) = 0
                acc[e] = acc[e] + g[e, j]
        self.reduce_groups(sRed, sTot, acc, grp, v, False)  # acc: the sum of the exponentials
        for e in cutlass.range_constexpr(VEC):
            total = acc[e]
            acc[e] = Float32(0.0)
            for j in cutlass.range_constexpr(self.rows):
                _, ok = self.window_row(grp, j, p)
                w = (g[e, j] / total).to(bf16).to(Float32)
                term = (rK[e, j].to(Float32) * w).to(bf16).to(Float32)
                acc[e] = acc[e] + cutlass.select_(ok, term, Float32(0.0))
        self.reduce_groups(sRed, sTot, acc, grp, v, False)  # acc: the weighted sum
        for e in cutlass.range_constexpr(VEC):
            acc[e] = acc[e].to(bf16).to(Float32)  # x

        # 3. RMSNorm over the whole entry (the cluster's CTAs), weight, RoPE, store
        if grp == 0:
            ss = Float32(0.0)
            for e in cutlass.range_constexpr(VEC):
                ss = ss + acc[e] * acc[e]
            sRed[0, v] = ss
        cute.arch.barrier()
        if const_expr(self.split > 1):
            cute.arch.cluster_wait()  # every CTA of the cluster is running: its shared memory takes stores
        if tidx == 0:
            ss = Float32(0.0)
            for k in cutlass.range(self.cvs):
                ss = ss + sRed[0, k]
            if const_expr(self.split > 1):
                cute.arch.mbarrier_arrive_and_expect_tx(mbar.iterator, self.split * 4)  # a share from each CTA
                for dst in cutlass.range_constexpr(self.split):
                    store_async_to_cta(sSS.iterator + rank, Int32(dst), f32_bits(ss), mbar.iterator)
            else:
                sSS[0] = ss
        if const_expr(self.split > 1):
            cute.arch.mbarrier_wait(mbar.iterator, 0)  # every CTA's share is here
        else:
            cute.arch.barrier()
        if grp == 0:
            total = Float32(0.0)
            for k in cutlass.range_constexpr(self.split):
                total = total + sSS[k]
            rs = cute.math.rsqrt(total / Float32(d) + eps).to(bf16).to(Float32)
            y = cute.make_rmem_tensor(cute.make_layout((VEC,)), Float32)
            for e in cutlass.range_constexpr(VEC):
                y[e] = ((acc[e] * rs).to(bf16).to(Float32) * rW[e].to(Float32)).to(bf16).to(Float32)
            if const_expr(self.r > 0):
                for e in cutlass.range_constexpr(0, VEC, 2):
                    if c0 + e >= d - self.r:
                        cs, sn = rCS[e], rCS[e + 1]
                        a, b = y[e], y[e + 1]
                        y[e] = a * cs - b * sn
                        y[e + 1] = a * sn + b * cs
            rY = cute.make_rmem_tensor(cute.make_layout((VEC,)), bf16)
            rY.store(y.load().to(bf16))
            cute.autovec_copy(rY, cute.zipped_divide(mPool, (1, VEC))[(0, None), (row, c0 // VEC)])

    @cute.jit
    def window_row(self, grp: Int32, j: int, p: Int32):
        """Thread row group ``grp``'s ``j``-th window row ``i`` for the entry closed at ``p``, and
        whether it is a real row (inside the window and at a position >= 0)."""
        i = grp + j * self.groups
        return i, i < self.span and p - self.span + 1 + i >= 0

    @cute.jit
    def reduce_groups(self, sRed: cute.Tensor, sTot: cute.Tensor, acc: cute.Tensor, grp: Int32, v: Int32,
                      use_max: cutlass.Constexpr):
        """``acc[e]`` <- the max (``use_max``) or the FP32 sum over the row groups of channel
        ``c0 + e``'s values (thread ``(grp, v)``; in row-group order: every thread gets the same
        value)."""
        tidx, _, _ = cute.arch.thread_idx()
        for e in cutlass.range_constexpr(VEC):
            sRed[grp, v * VEC + e] = acc[e]
        cute.arch.barrier()
        for c in cutlass.range(tidx, self.dslice, self.threads):
            tot = sRed[0, c]
            for k in cutlass.range_constexpr(1, self.groups):
                if const_expr(use_max):
                    tot = cutlass.max(tot, sRed[k, c])
                else:
                    tot = tot + sRed[k, c]
            sTot[c] = tot
        cute.arch.barrier()
        for e in cutlass.range_constexpr(VEC):
            acc[e] = sTot[v * VEC + e]

    @cute.jit
    def half(self, i: Int32) -> Int32:
        """Channel offset of window row ``i``: CSA's previous-window rows read the first ``d``
        channels of kv / gate / ape, its own window's the second ``d``; HCA has one half."""
        h = Int32(0)
        if const_expr(self.overlap):
            h = cutlass.select_(i >= self.m, Int32(self.d), Int32(0))
        return h


def _build(arch: str, *, dim: int, ratio: int, overlap: bool, rope_dim: int = 0):
    k = CompressorPool(dim, ratio, overlap, rope_dim)
    P = jit.fake_gmem_ptr
    bf16 = cutlass.BFloat16
    return k, (P(bf16, 16), P(bf16, 16), P(bf16, 16), P(bf16, 16), P(bf16, 16), P(Float32, 8), P(Int32, 4), P(Int32, 4),
               Int32(1), Int32(1), Int32(1), Int32(8), Int32(2), Float32(1e-6), jit.fake_stream())


KERNEL = jit.register(jit.KernelDef(
    name="compressor_pool",
    build=_build,
    sources=(os.path.abspath(__file__), os.path.join(os.path.dirname(os.path.abspath(__file__)), "cluster_smem.py")),
    archs=("sm_90a", "sm_100a", "sm_103a"),
    # DeepSeek-V4: CSA (m = 4, overlapping) main (d 512) and indexer (d 128) compressors, HCA (m' = 128)
    aot_configs=({"dim": 512, "ratio": 4, "overlap": True, "rope_dim": 64},
                 {"dim": 128, "ratio": 4, "overlap": True, "rope_dim": 64},
                 {"dim": 512, "ratio": 128, "overlap": False, "rope_dim": 64}),
    description="V4 KV compressor step: window softmax pooling, RMSNorm, RoPE, pool + ring writes",
))


def compressor_pool_torch(fresh, ring, pool, ape, norm_weight, rotate, pos, slot, *, ratio: int, overlap: bool,
                          eps: float, tokens_per_request: int) -> None:
    """The op in PyTorch with the same rounding points: the fallback for devices without a CuTe
    path (not the test reference: tests/references.py)."""
    d = norm_weight.shape[0]
    ch = fresh.shape[1] // 2
    span = 2 * ratio if overlap else ratio
    ring_rows = ring.shape[1]
    T = fresh.shape[0]
    for t in range(T):
        p, s = int(pos[t]), int(slot[t])
        if p < 0 or not 0 <= s < ring.shape[0]:
            continue
        first = t // tokens_per_request * tokens_per_request
        p0 = int(pos[first])
        e = (p + 1) // ratio - 1
        if (p + 1) % ratio == 0 and e < pool.shape[1] - 1:
            kv, g = [], []
            for i in range(span):
                q = p - span + 1 + i
                if q < 0:
                    continue
                row = fresh[first + q - p0] if q >= p0 else ring[s, q % ring_rows]
                h = d if overlap and i >= ratio else 0
                kv.append(row[h:h + d])
                g.append(row[ch + h:ch + h + d] + ape[i % ratio, h:h + d])
            w = torch.stack(g).float().softmax(0).to(fresh.dtype)
            x = (torch.stack(kv) * w).sum(0)
            y = x * torch.rsqrt(x.float().square().mean() + eps).to(x.dtype)
            y = (y * norm_weight).float()
            if rotate is not None:
                r = 2 * rotate.shape[1]
                a, b = y[d - r::2].clone(), y[d - r + 1::2].clone()
                c, sn = rotate[t, :, 0], rotate[t, :, 1]
                y[d - r::2], y[d - r + 1::2] = a * c - b * sn, a * sn + b * c
            pool[s, e] = y.to(pool.dtype)
    for t in range(T):  # after every window read its rows (the kernel's ordering argument)
        p, s = int(pos[t]), int(slot[t])
        if p >= 0 and 0 <= s < ring.shape[0]:
            ring[s, p % ring_rows] = fresh[t]


def compressor_pool(fresh: torch.Tensor, ring: torch.Tensor, pool: torch.Tensor, ape: torch.Tensor,
                    norm_weight: torch.Tensor, rotate: torch.Tensor | None, pos: torch.Tensor, slot: torch.Tensor, *,
                    ratio: int, overlap: bool, eps: float, tokens_per_request: int, stream=None,
                    arch: str | None = None) -> None:
    """One compressor's step in place (module docstring): ``fresh [T, 2 ch]`` this step's kv |
    gate rows (bf16), ``ring [slots, ring_rows, 2 ch]``, ``pool [slots, pool_rows, d]`` (its
    last row per slot is never written), ``ape [m, ch]``, ``norm_weight [d]``, ``rotate`` FP32
    ``[T, r/2, 2]`` (each token's entry position's (cos, sin)) or None, ``pos`` / ``slot``
    int32 ``[T]``. Capturable in a CUDA graph; allocates nothing."""
    op = "compressor_pool"
    check_tensor(op, "fresh", fresh, dtype=torch.bfloat16, ndim=2, contiguous=True)
    T, two_ch = fresh.shape
    coff = 2 if overlap else 1
    if not isinstance(ratio, int) or isinstance(ratio, bool) or ratio < 1:
        raise ValueError(f"{op}: ratio must be a positive int, got {ratio!r}")
    check_tensor(op, "norm_weight", norm_weight, dtype=torch.bfloat16, ndim=1, contiguous=True, align_bytes=16)
    d = norm_weight.shape[0]
    if d % 64 or not 64 <= d <= 1024:
        raise ValueError(f"{op}: norm_weight's width d={d} must be a multiple of 64 in [64, 1024]")
    if two_ch != 2 * coff * d:
        raise ValueError(f"{op}: fresh must be [T, {2 * coff * d}] (kv and gate, {coff} x d each), got "
                         f"{list(fresh.shape)}")
    check_tensor(op, "ring", ring, dtype=torch.bfloat16, ndim=3, contiguous=True)
    span = 2 * ratio if overlap else ratio
    if ring.shape[2] != two_ch or ring.shape[1] < span:
        raise ValueError(f"{op}: ring must be [slots, >= {span}, {two_ch}], got {list(ring.shape)}")
    check_tensor(op, "pool", pool, dtype=torch.bfloat16, ndim=3, contiguous=True, align_bytes=16)
    if pool.shape[0] != ring.shape[0] or pool.shape[2] != d or pool.shape[1] < 1:
        raise ValueError(f"{op}: pool must be [{ring.shape[0]} (ring's slots), rows >= 1, {d}], got "
                         f"{list(pool.shape)}")
    check_tensor(op, "ape", ape, dtype=torch.bfloat16, shape=(ratio, coff * d), contiguous=True, align_bytes=16)
    for name, t in (("pos", pos), ("slot", slot)):
        check_tensor(op, name, t, dtype=torch.int32, shape=(T,), contiguous=True, align_bytes=4)
    if not isinstance(tokens_per_request, int) or tokens_per_request < 1 or T % tokens_per_request:
        raise ValueError(f"{op}: tokens_per_request must be a positive int dividing T={T}, got "
                         f"{tokens_per_request!r}")
    if tokens_per_request > ring.shape[1] - span + 1:
        raise ValueError(f"{op}: tokens_per_request={tokens_per_request} exceeds ring_rows - span + 1 = "
                         f"{ring.shape[1] - span + 1}: the ring writes would clobber rows a window reads")
    r = 0 if rotate is None else check_rotation(op, rotate, T, d)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps < 0:
        raise TypeError(f"{op}: eps must be a non-negative float, got {eps!r}")
    check_int32_indexable(op, "ring", ring.numel())
    check_int32_indexable(op, "pool", pool.numel())
    named = [("fresh", fresh), ("ring", ring), ("pool", pool), ("ape", ape), ("norm_weight", norm_weight),
             ("pos", pos), ("slot", slot)] + ([("rotate", rotate)] if rotate is not None else [])
    dev = check_cuda(op, *named)
    a = arch if arch is not None else current_arch(dev)
    if dispatch(op, ("portable", "reference"), arch=a) == "reference":
        compressor_pool_torch(fresh, ring, pool, ape, norm_weight, rotate, pos, slot, ratio=ratio, overlap=overlap,
                              eps=eps, tokens_per_request=tokens_per_request)
        return
    if T == 0:
        return
    fn = jit.get_kernel(op, a, dim=d, ratio=ratio, overlap=bool(overlap), rope_dim=r)
    P = jit.gmem_ptr
    bf16 = cutlass.BFloat16
    fn(P(bf16, fresh, 16), P(bf16, ring, 16), P(bf16, pool, 16), P(bf16, ape, 16), P(bf16, norm_weight, 16),
       P(Float32, rotate if rotate is not None else fresh, 8), P(Int32, pos, 4), P(Int32, slot, 4), jit.i32(T),
       jit.i32(tokens_per_request), jit.i32(ring.shape[0]), jit.i32(ring.shape[1]), jit.i32(pool.shape[1]),
       jit.f32(eps), jit.cu_stream(stream))
