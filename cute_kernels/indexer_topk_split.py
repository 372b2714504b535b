"""Indexer top-k with the row split over a thread-block cluster and held in registers.

The same select as :mod:`cute_kernels.indexer_topk` (same output: the ``topk`` best key
positions of each token in ascending order, ``-1`` padded, ties at the k-th score to the lower
index) for rows short enough to sit in registers: the row of token ``t`` is cut into ``cluster``
slices of ``threads * items`` scores, one per CTA of the token's cluster, and each thread loads
its ``items`` consecutive scores once (16-byte loads) and keeps their order keys in registers
through every pass -- the streaming kernel reads the row from global memory four times, one CTA
per token. At decode T (6 tokens a sequence, a few sequences) that kernel runs on a handful of
SMs, each waiting on its row's loads; here a token has up to 8 SMs and one round trip.

Algorithm (per token; the CTAs of its cluster run the same steps on their slices):

1. Zero the three round histograms, arrive at the cluster barrier (release), load the slice.
2. Three counting rounds (11 + 11 + 10 bits of the order key, as the streaming kernel): each
   CTA counts its keys that match the digits found so far into a local histogram, then adds
   every non-zero bin into the round's histogram of every CTA of the cluster
   (``red.shared::cluster``, :func:`cute_kernels.cluster_smem.add_to_cta`); a cluster barrier
   (release / acquire) publishes the sums. Each CTA's warp 0 then finds the digit holding the
   k-th largest key in its copy (:func:`cute_kernels.radix_select.find_digit`) -- the same
   numbers in every CTA, so the CTAs take the same branches and no result is sent. Rounds 1-2 run only when the
   row has more than ``topk`` candidates (as in the streaming kernel).
3. Compaction: each CTA counts its keys above the k-th (``> K*``) and equal to it, a block scan
   gives each thread its offsets inside the CTA, and the CTA adds its totals into every CTA's
   counters (into the "before" counters of the higher ranks): slices are in index order, so a
   CTA's output starts after the keys of the lower ranks, and the ties taken are the lowest
   indices of the row. Each CTA writes its selected indices at their ranks; the CTAs share the
   ``-1`` padding.

``async_counts`` (with a cluster; what :func:`split_plan` picks): the counts travel by
``red.async`` crediting each receiving CTA's mbarrier of the round (:func:`cute_kernels.cluster_smem.add_async_to_cta`; every warp
announces its bytes to every CTA with a remote ``mbarrier.arrive.expect_tx``) and each CTA waits
on its own mbarrier: one cluster barrier (entry) instead of five, whose release half is a
GPU-scope ``MEMBAR`` on sm_90.

With ``cluster = 1`` it is the streaming kernel's select on a row held in registers (no cluster
barriers). :func:`split_plan` picks ``(cluster, items, async_counts)`` from the token count and
the key bound (``None``: the streaming kernel serves -- rows past 8 CTAs, or grids of many
clusters, where it is faster).

Constraints: ``max_keys <= cluster * threads * items`` (the host checks), ``cluster`` in
{1, 2, 4, 8} (a portable cluster), ``items`` in {4, 8, 16, 32}; the score row pitch is a multiple of
4. Numerics: integer counts of exact order keys -- no rounding. sm_90a and sm_100a (clusters and
``red.shared::cluster`` are sm_90+).

Tests / bench::

    pytest tests/test_indexer.py -k "split or plans"
    python bench/bench_indexer.py --select
    python bench/bench_peers.py --families topk
"""

from __future__ import annotations

import functools
import os

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32

from . import jit
from .cluster_smem import add_async_to_cta, add_to_cta, arrive_expect_bytes_at_cta
from .indexer_scores import check_compress_ratio, visible_entries
from .radix_select import BINS_PADDED, NEG_INF_KEY, block_exclusive_scan, find_digit, order_key, padded

#: the cluster sizes and per-thread key counts built (``split_plan`` picks among them)
CLUSTERS = (1, 2, 4, 8)
ITEMS = (4, 8, 16, 32)
THREADS = 512
#: keys a thread in a plan of up to MAX_SPLIT_CTAS CTAs; 32 (127 registers, the most a thread of a
#: 512-thread CTA may hold) halves a grid that would pass it
BASE_ITEMS = 16
#: whether split_plan takes the 32-key plans (for grids the 16-key ones would take past
#: MAX_SPLIT_CTAS): off until their GPU tests and ``bench/bench_indexer.py --select`` have run;
#: ``plan=(cluster, 32[, True])`` runs them meanwhile
WIDE_PLANS_BY_DEFAULT = False
#: rows up to this many keys take one CTA, no cluster (``bench/bench_indexer.py --select`` times
#: the alternatives; bench/RESULTS.md)
ONE_CTA_KEYS = THREADS * BASE_ITEMS
#: a longer row's cluster is doubled while the grid stays within this many CTAs ...
SPREAD_CTAS = 66
#: ... and its slices at this many keys or more
MIN_SLICE = 2048
#: above this many CTAs (1.5 waves of 132 SMs, one CTA an SM) a plan takes 32 keys a thread on
#: half the CTAs (WIDE_PLANS_BY_DEFAULT), and past that too the streaming kernel serves: a
#: cluster's CTAs wait on each other, and the grid's later waves on the first
MAX_SPLIT_CTAS = 198


@functools.lru_cache(maxsize=1024)  # (on indexer_select's eager hot path)
def split_plan(num_tokens: int, max_keys: int) -> tuple[int, int, bool] | None:
    """``(cluster, items, async_counts)`` for ``num_tokens`` rows of at most ``max_keys`` keys, or
    None for the streaming kernel: one CTA a row up to :data:`ONE_CTA_KEYS` keys; beyond, the
    smallest cluster that holds the row at :data:`BASE_ITEMS` keys a thread, doubled while the
    grid stays within :data:`SPREAD_CTAS` and the slices within :data:`MIN_SLICE`, and the
    fewest items a thread that cover the slice; where that grid would pass
    :data:`MAX_SPLIT_CTAS` (or the row 8 CTAs), the smallest cluster that holds it at 32 keys a
    thread (with :data:`WIDE_PLANS_BY_DEFAULT`), unless that grid too passes it (then None); the
    counts by ``red.async`` with a cluster (one fence instead of five; the thresholds and the
    exchange from ``bench/bench_indexer.py --select``)."""
    if max_keys <= ONE_CTA_KEYS:
        return 1, next(i for i in ITEMS if max_keys <= THREADS * i), False
    cluster = next((c for c in CLUSTERS if max_keys <= c * THREADS * BASE_ITEMS), None)
    if cluster is None or num_tokens * cluster > MAX_SPLIT_CTAS:
        if not WIDE_PLANS_BY_DEFAULT:
            return None
        cluster = next((c for c in CLUSTERS if max_keys <= c * THREADS * ITEMS[-1]), None)
        if cluster is None or num_tokens * cluster > MAX_SPLIT_CTAS:
            return None
        return cluster, ITEMS[-1], cluster > 1
    while cluster < CLUSTERS[-1] and num_tokens * cluster * 2 <= SPREAD_CTAS and max_keys >= 2 * cluster * MIN_SLICE:
        cluster *= 2
    items = next(i for i in ITEMS if max_keys <= cluster * THREADS * i)
    return cluster, items, True


class IndexerTopkSplit:
    def __init__(self, topk: int, compress_ratio: int = 1, cluster: int = 1, items: int = 16,
                 async_counts: bool = False):
        self.k, self.ratio, self.threads, self.warps = topk, compress_ratio, THREADS, THREADS // 32
        # with a cluster: the counts sent by red.async, each CTA waiting on its own mbarrier,
        # instead of a cluster barrier per round (whose release half is a GPU-scope MEMBAR)
        self.async_counts = async_counts and cluster > 1
        self.row_words = topk
        if cluster not in CLUSTERS or items not in ITEMS:
            raise ValueError(f"indexer_topk_split: cluster must be one of {CLUSTERS} and items one of {ITEMS}, "
                             f"got {cluster!r}, {items!r}")
        self.cluster, self.items = cluster, items
        self.slice = THREADS * items

    @cute.jit
    def __call__(self, score_ptr: cute.Pointer, len_ptr: cute.Pointer, pos_ptr: cute.Pointer, idx_ptr: cute.Pointer,
                 num_tokens: Int32, s_pitch: Int32, s_max: Int32, stream: cuda.CUstream):
        pitch = cute.assume(s_pitch, divby=4)
        mScore = cute.make_tensor(score_ptr, cute.make_layout((num_tokens, pitch), stride=(pitch, 1)))
        mLen = cute.make_tensor(len_ptr, cute.make_layout((num_tokens,)))
        mPos = cute.make_tensor(pos_ptr, cute.make_layout((num_tokens,)))
        mIdx = cute.make_tensor(idx_ptr, cute.make_layout((num_tokens, self.row_words), stride=(self.row_words, 1)))
        kernel = self.kernel(mScore, mLen, mPos, mIdx, s_max)
        if cutlass.const_expr(self.cluster > 1):
            kernel.launch(grid=[num_tokens * self.cluster, 1, 1], block=[self.threads, 1, 1],
                          cluster=(self.cluster, 1, 1), stream=stream)
        else:
            kernel.launch(grid=[num_tokens, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.jit
    def tensor_call(self, mScore: cute.Tensor, mLen: cute.Tensor, mPos: cute.Tensor, mIdx: cute.Tensor, s_max: Int32,
                    stream: cuda.CUstream):
        """The tensor entry (as the streaming kernel's: :func:`cute_kernels.indexer_topk.indexer_select`;
        ``s_max`` within the plan's row)."""
        self.__call__(mScore.iterator, mLen.iterator, mPos.iterator, mIdx.iterator, mLen.shape[0], mScore.shape[1],
                      s_max, stream)

    @cute.kernel
    def kernel(self, mScore: cute.Tensor, mLen: cute.Tensor, mPos: cute.Tensor, mIdx: cute.Tensor, s_max: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()
        C, I = self.cluster, self.items
        t = bidx // C
        rank = bidx - t * C  # the CTA's rank in its (1-D) cluster
        limit = cutlass.min(cutlass.min(visible_entries(mPos[t], self.ratio), mLen[t]), s_max)

        smem = cutlass.memory.SmemAllocator()
        # the rounds' histograms (each CTA's copy of the cluster's sums), and with a cluster the
        # local counts added into them
        sSum = smem.allocate_tensor(Int32, cute.make_layout((3, BINS_PADDED), stride=(BINS_PADDED, 1)), 16)
        sHist = smem.allocate_tensor(Int32, cute.make_layout((BINS_PADDED if C > 1 else 4,)), 16)
        sWarp = smem.allocate_tensor(Int32, cute.make_layout((self.warps,)), 16)
        sState = smem.allocate_tensor(Int32, cute.make_layout((4,)), 16)
        sCnt = smem.allocate_tensor(Int32, cute.make_layout((4,)), 16)  # gt / eq before this CTA, gt / eq total
        sMbar = smem.allocate_tensor(cutlass.Int64, cute.make_layout((4,)), 8)  # async_counts: rounds, compaction
        if cutlass.const_expr(self.async_counts):
            if tidx == 0:  # every warp of every CTA announces its bytes once a round; one thread the offsets
                for r in cutlass.range_constexpr(3):
                    cute.arch.mbarrier_init(sMbar.iterator + r, C * self.warps)
                cute.arch.mbarrier_init(sMbar.iterator + 3, C)
                cute.arch.mbarrier_init_fence()

        for b in cutlass.range(tidx, BINS_PADDED, self.threads):
            for r in cutlass.range_constexpr(3):
                sSum[r, b] = 0
            if cutlass.const_expr(C > 1):
                sHist[b] = 0
        if tidx < 4:
            sCnt[tidx] = 0
        if cutlass.const_expr(C > 1):
            cute.arch.cluster_arrive()  # (release: the zeroed sums before any CTA's adds)

        # ---- the slice, once: order keys in registers (0 past the row: below every key) ------
        first = rank * self.slice + tidx * I
        gRow = cute.zipped_divide(cute.recast_tensor(mScore, Uint32)[t, None], (4,))
        rB = cute.make_rmem_tensor(cute.make_layout((I,)), Uint32)
        for v in cutlass.range_constexpr(I // 4):
            if first + v * 4 < limit:
                cute.autovec_copy(gRow[None, first // 4 + v], cute.zipped_divide(rB, (4,))[None, v])
        rK = cute.make_rmem_tensor(cute.make_layout((I,)), Uint32)
        for j in cutlass.range_constexpr(I):
            rK[j] = Uint32(cutlass.select_(first + j < limit, order_key(rB[j]), Uint32(0)))
        cute.arch.barrier()  # the CTA's zeroed counts
        if cutlass.const_expr(C > 1):
            cute.arch.cluster_wait()  # every CTA's zeroed sums

        # ---- round 0: top 11 bits; also counts the candidates (keys above -inf's) ------------
        self.count(rK, sHist, sSum, sMbar, 0, Uint32(0), 21, 11)
        if warp == 0:
            find_digit(sSum[0, None], sState, Int32(self.k), 11, True)
        cute.arch.barrier()
        thr = Uint32(NEG_INF_KEY)  # K*: the k-th largest key (or -inf's when all are taken)
        take_eq = Int32(0)
        if sState[2] > self.k:  # the same in every CTA of the cluster (the same sums)
            d0 = Uint32(sState[0])
            self.count(rK, sHist, sSum, sMbar, 1, d0, 10, 11)
            if warp == 0:
                find_digit(sSum[1, None], sState, sState[1], 11, False)
            cute.arch.barrier()
            d1 = (d0 << 11) | Uint32(sState[0])
            self.count(rK, sHist, sSum, sMbar, 2, d1, 0, 10)
            if warp == 0:
                find_digit(sSum[2, None], sState, sState[1], 10, False)
            cute.arch.barrier()
            thr = (d1 << 10) | Uint32(sState[0])
            take_eq = sState[1]
        self.compact_slice(rK, first, thr, take_eq, sWarp, sCnt, sMbar, mIdx, t, rank)

    @cute.jit
    def count(self, rK: cute.Tensor, sHist: cute.Tensor, sSum: cute.Tensor, sMbar: cute.Tensor, rnd: cutlass.Constexpr,
              prefix: Uint32, shift: cutlass.Constexpr, bits: cutlass.Constexpr):
        """Round ``rnd``: the ``bits``-wide digit at ``shift`` of the keys whose higher bits equal
        ``prefix`` (all keys when there are none), summed over the cluster into ``sSum[rnd]`` of
        every CTA (bin ``d`` at :func:`~cute_kernels.radix_select.padded` ``d``)."""
        tidx, _, _ = cute.arch.thread_idx()
        C, pshift = self.cluster, shift + bits
        sCount = sHist if cutlass.const_expr(C > 1) else sSum[rnd, None]
        for j in cutlass.range_constexpr(self.items):
            key = rK[j]
            match = True
            if cutlass.const_expr(pshift < 32):
                match = (key >> pshift) == prefix
            if match:
                d = Int32((key >> shift) & Uint32((1 << bits) - 1))
                cute.arch.atomic_add((sCount.iterator + padded(d, bits)).llvm_ptr, Int32(1))
        cute.arch.barrier()
        if cutlass.const_expr(self.async_counts):
            # as below, by red.async crediting each CTA's mbarrier of the round; each warp
            # announces its non-zero bins' bytes to every CTA, which waits for all of them
            lane = cute.arch.lane_idx()
            n_nz = Int32(0)
            for it in cutlass.range_constexpr((1 << bits) // self.threads):
                p = padded(tidx + it * self.threads, bits)
                h = sHist[p]
                n_nz = n_nz + Int32(cute.arch.popc(cute.arch.vote_ballot_sync(h != 0)))
                if h != 0:
                    for dst in cutlass.range_constexpr(C):
                        add_async_to_cta(sSum.iterator + rnd * BINS_PADDED + p, Int32(dst), h, sMbar.iterator + rnd)
                    sHist[p] = 0
            if lane == 0:
                for dst in cutlass.range_constexpr(C):
                    arrive_expect_bytes_at_cta(sMbar.iterator + rnd, Int32(dst), n_nz * 4)
            cute.arch.mbarrier_wait(sMbar.iterator + rnd, 0)
        elif cutlass.const_expr(C > 1):
            # the non-zero bins into every CTA's sums (few: the keys match a prefix), the local
            # counts zeroed for the next round; then the cluster barrier publishes the sums
            for b in cutlass.range(tidx, 1 << bits, self.threads):
                p = padded(b, bits)
                h = sHist[p]
                if h != 0:
                    for dst in cutlass.range_constexpr(C):
                        add_to_cta(sSum.iterator + rnd * BINS_PADDED + p, Int32(dst), h)
                    sHist[p] = 0
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    @cute.jit
    def compact_slice(self, rK: cute.Tensor, first: Int32, thr: Uint32, take_eq: Int32, sWarp: cute.Tensor,
                      sCnt: cute.Tensor, sMbar: cute.Tensor, mIdx: cute.Tensor, t: Int32, rank: Int32):
        """Write, in index order, the row's keys > thr and its first take_eq keys == thr that lie
        in this CTA's slice, after those of the lower ranks; the CTAs share the -1 padding."""
        tidx, _, _ = cute.arch.thread_idx()
        C = self.cluster
        n_gt, n_eq = Int32(0), Int32(0)
        for j in cutlass.range_constexpr(self.items):
            n_gt = n_gt + cutlass.select_(rK[j] > thr, Int32(1), Int32(0))
            n_eq = n_eq + cutlass.select_(rK[j] == thr, Int32(1), Int32(0))
        # Block exclusive scan of the packed (eq << 16 | gt) counts: a slice holds < 2^16 keys.
        excl, total = block_exclusive_scan((n_eq << 16) | n_gt, sWarp, self.warps)
        gt_base, eq_base = Int32(0), Int32(0)
        gt_all, eq_all = total & 0xFFFF, total >> 16
        if cutlass.const_expr(self.async_counts):
            if tidx == 0:
                for dst in cutlass.range_constexpr(C):
                    add_async_to_cta(sCnt.iterator + 2, Int32(dst), total & 0xFFFF, sMbar.iterator + 3)
                    add_async_to_cta(sCnt.iterator + 3, Int32(dst), total >> 16, sMbar.iterator + 3)
                    if rank < dst:
                        add_async_to_cta(sCnt.iterator, Int32(dst), total & 0xFFFF, sMbar.iterator + 3)
                        add_async_to_cta(sCnt.iterator + 1, Int32(dst), total >> 16, sMbar.iterator + 3)
                    arrive_expect_bytes_at_cta(sMbar.iterator + 3, Int32(dst),
                                               cutlass.select_(rank < dst, Int32(16), Int32(8)))
            cute.arch.mbarrier_wait(sMbar.iterator + 3, 0)  # every CTA's totals are here
            gt_base, eq_base, gt_all, eq_all = sCnt[0], sCnt[1], sCnt[2], sCnt[3]
        elif cutlass.const_expr(C > 1):
            if tidx == 0:
                for dst in cutlass.range_constexpr(C):
                    add_to_cta(sCnt.iterator + 2, Int32(dst), total & 0xFFFF)
                    add_to_cta(sCnt.iterator + 3, Int32(dst), total >> 16)
                    if rank < dst:
                        add_to_cta(sCnt.iterator, Int32(dst), total & 0xFFFF)
                        add_to_cta(sCnt.iterator + 1, Int32(dst), total >> 16)
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()  # (after it no CTA touches another's shared memory)
            gt_base, eq_base, gt_all, eq_all = sCnt[0], sCnt[1], sCnt[2], sCnt[3]
        gt_before = gt_base + (excl & 0xFFFF)
        eq_before = eq_base + (excl >> 16)
        for j in cutlass.range_constexpr(self.items):
            is_gt = rK[j] > thr
            is_eq = rK[j] == thr
            if is_gt or (is_eq and eq_before < take_eq):
                mIdx[t, gt_before + cutlass.min(eq_before, take_eq)] = first + j
            gt_before = gt_before + cutlass.select_(is_gt, Int32(1), Int32(0))
            eq_before = eq_before + cutlass.select_(is_eq, Int32(1), Int32(0))
        n_sel = gt_all + cutlass.min(eq_all, take_eq)
        for p in cutlass.range(n_sel + rank * self.threads + tidx, self.k, C * self.threads):
            mIdx[t, p] = -1


def _build(arch: str, *, topk: int, cluster: int, items: int, compress_ratio: int = 1, async_counts: bool = False):
    if not 1 <= topk <= 65535:
        raise ValueError(f"indexer_topk_split: unsupported topk={topk}")
    check_compress_ratio("indexer_topk_split", compress_ratio)
    P = jit.fake_gmem_ptr
    args = (P(Float32, 16), P(Int32, 4), P(Int32, 4), P(Int32, 4), Int32(1), Int32(4), Int32(4), jit.fake_stream())
    return IndexerTopkSplit(topk, compress_ratio, cluster, items, async_counts), args


_HERE = os.path.dirname(os.path.abspath(__file__))
#: V4's CSA top-k (512 / 1024 of the compressed entries) at every plan, with a cluster also with
#: its counts by red.async (the two exchanges are compared by ``bench/bench_indexer.py --select``)
_AOT = tuple({"topk": k, "compress_ratio": 4, "cluster": c, "items": i, **({"async_counts": True} if a else {})}
             for k in (512, 1024) for c in CLUSTERS for i in ITEMS for a in ((False, True) if c > 1 else (False,)))
KERNEL = jit.register(jit.KernelDef(
    name="indexer_topk_split",
    build=_build,
    sources=tuple(os.path.join(_HERE, f) for f in ("indexer_topk_split.py", "radix_select.py", "cluster_smem.py")),
    archs=("sm_90a", "sm_100a", "sm_103a"),
    aot_configs=_AOT,
    description="the indexer's top-k with the row in registers, split over a thread-block cluster",
))


def _build_tensors(arch: str, *, topk: int, cluster: int, items: int, compress_ratio: int = 1,
                   async_counts: bool = False):
    op, _ = _build(arch, topk=topk, cluster=cluster, items=items, compress_ratio=compress_ratio,
                   async_counts=async_counts)
    sym, T = {}, jit.fake_tensor
    return op.tensor_call, (T(Float32, ("N", "P"), 16, sym), T(Int32, ("T",), 4, sym), T(Int32, ("T",), 4, sym),
                            T(Int32, ("T", topk), 4, sym), Int32(1), jit.fake_env_stream())


jit.register_tensor_entry(KERNEL, _build_tensors, aot_configs=_AOT)
