"""Indexer top-k: the ``topk`` best candidate keys per query token, masking fused upstream.

``indexer_topk(q, w, k_cache, kv_offset, kv_len, pos, slot_valid, topk)`` runs two launches:
the scores with the causal / length / slot mask applied in their epilogue (masked keys are
``-inf``; :mod:`cute_kernels.indexer_scores_sm100` on Blackwell -- tcgen05, compiled and
machine-code checked only --, :mod:`cute_kernels.indexer_scores` elsewhere) and the radix
select here. Output: int32
``indices [T, topk]``, the selected key positions of each token **in ascending order**,
then ``-1`` where the token has fewer than ``topk`` candidates. Ties at the k-th score are
broken towards the lower key index, so the result is deterministic.

Radix select (one CTA of 512 threads per token). Scores map to order-preserving uint32 keys
(``-inf`` -> 0x007FFFFF, every finite score above it). Three counting passes over the row
(11 + 11 + 10 bits; shared-memory histograms, each pass counting only keys that match the
digits found so far) find the exact k-th largest key ``K*`` and how many keys equal to it
are taken. A last pass compacts in index order: chunks of 8192 scores (16 per thread,
four 16-byte loads), a block-wide exclusive scan of per-thread counts, and each selected
key written at its rank. With at most ``topk`` candidates the passes are skipped and every
candidate is written. The shared steps (order keys, the padded histogram, the digit search)
are :mod:`cute_kernels.radix_select`'s.

A second select, :mod:`cute_kernels.indexer_topk_split`, holds the row in registers and
splits it over a thread-block cluster (same output); ``plan="auto"`` (the default) takes it
where :func:`~cute_kernels.indexer_topk_split.split_plan` gives a plan (docs/indexer_topk.md).

Compressed entries (DeepSeek-V4's CSA indexer, ``compress_ratio = 4``, ``topk`` 512 / 1024):
the same two launches over the compressed key pool, a query at ``pos`` seeing entries
``[0, (pos + 1) // compress_ratio)`` -- the same static rule in both kernels.

Constraints: ``topk`` static (default 2048), ``topk <= 65535``; the score row pitch is a
multiple of 4 (the host pads it). Same source on sm_90a and sm_100a.

Tests / bench::

    pytest tests/test_indexer.py
    python bench/bench_indexer.py [--select]
"""

from __future__ import annotations

import os

import torch

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32

from . import jit
from .arch import current_arch, dispatch
from .indexer_scores import IndexerScores, check_compress_ratio, visible_entries
from .indexer_scores_fp8 import IndexerScoresFp8
from .indexer_scores_sm90 import IndexerScoresSm90
from .indexer_scores_token_group_sm90 import IndexerScoresTokenGroupSm90
from .indexer_scores_sm100 import IndexerScoresSm100
from . import indexer_topk_split
from .radix_select import BINS_PADDED, NEG_INF_KEY, block_exclusive_scan, find_digit, order_key, padded
from .validate import check_cuda, check_tensor

ITEMS = 16  # scores per thread per compaction chunk


class IndexerTopk:
    def __init__(self, topk: int, compress_ratio: int = 1, threads: int = 512):
        self.k, self.ratio, self.threads = topk, compress_ratio, threads
        self.warps = threads // 32
        self.row_words = topk

    @cute.jit
    def __call__(self, score_ptr: cute.Pointer, len_ptr: cute.Pointer, pos_ptr: cute.Pointer, idx_ptr: cute.Pointer,
                 num_tokens: Int32, s_pitch: Int32, s_max: Int32, stream: cuda.CUstream):
        pitch = cute.assume(s_pitch, divby=4)
        mScore = cute.make_tensor(score_ptr, cute.make_layout((num_tokens, pitch), stride=(pitch, 1)))
        mLen = cute.make_tensor(len_ptr, cute.make_layout((num_tokens,)))
        mPos = cute.make_tensor(pos_ptr, cute.make_layout((num_tokens,)))
        mIdx = cute.make_tensor(idx_ptr, cute.make_layout((num_tokens, self.row_words), stride=(self.row_words, 1)))
        self.kernel(mScore, mLen, mPos, mIdx, s_max).launch(grid=[num_tokens, 1, 1], block=[self.threads, 1, 1],
                                                            stream=stream)

    @cute.jit
    def tensor_call(self, mScore: cute.Tensor, mLen: cute.Tensor, mPos: cute.Tensor, mIdx: cute.Tensor, s_max: Int32,
                    stream: cuda.CUstream):
        """The tensor entry of :func:`indexer_select` (``jit.get_tensor_kernel``): the workspace's
        ``mScore [max_tokens, pitch]`` (pitch a multiple of 4; T <= max_tokens checked by the
        caller), ``mLen`` / ``mPos [T]``, ``mIdx [T, topk]``, the key bound ``s_max``."""
        self.__call__(mScore.iterator, mLen.iterator, mPos.iterator, mIdx.iterator, mLen.shape[0], mScore.shape[1],
                      s_max, stream)

    @cute.kernel
    def kernel(self, mScore: cute.Tensor, mLen: cute.Tensor, mPos: cute.Tensor, mIdx: cute.Tensor, s_max: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        t, _, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()
        limit = cutlass.min(cutlass.min(visible_entries(mPos[t], self.ratio), mLen[t]), s_max)  # -inf past it
        mBits = cute.recast_tensor(mScore, Uint32)
        row = mBits[t, None]

        smem = cutlass.memory.SmemAllocator()
        sHist = smem.allocate_tensor(Int32, cute.make_layout((BINS_PADDED,)), 16)
        sWarp = smem.allocate_tensor(Int32, cute.make_layout((self.warps,)), 16)
        sState = smem.allocate_tensor(Int32, cute.make_layout((4,)), 16)

        # ---- pass 0: top 11 bits; also counts the candidates (keys above -inf's) -------------
        self.histogram(row, limit, sHist, Uint32(0), 21, 11)
        if warp == 0:
            find_digit(sHist, sState, Int32(self.k), 11, True)
        cute.arch.barrier()
        thr = Uint32(NEG_INF_KEY)  # K*: the k-th largest key (or -inf's when all are taken)
        take_eq = Int32(0)
        if sState[2] > self.k:
            d0 = Uint32(sState[0])
            self.histogram(row, limit, sHist, d0, 10, 11)
            if warp == 0:
                find_digit(sHist, sState, sState[1], 11, False)
            cute.arch.barrier()
            d1 = (d0 << 11) | Uint32(sState[0])
            self.histogram(row, limit, sHist, d1, 0, 10)
            if warp == 0:
                find_digit(sHist, sState, sState[1], 10, False)
            cute.arch.barrier()
            thr = (d1 << 10) | Uint32(sState[0])
            take_eq = sState[1]
        self.compact(row, limit, thr, take_eq, sWarp, mIdx, t)

    @cute.jit
    def histogram(self, row: cute.Tensor, limit: Int32, sHist: cute.Tensor, prefix: Uint32, shift: cutlass.Constexpr,
                  bits: cutlass.Constexpr):
        """Count the ``bits``-wide digit at ``shift`` of the keys whose higher bits (``key >> (shift
        + bits)``) equal ``prefix`` -- all keys when there are none (bin ``d`` at
        :func:`~cute_kernels.radix_select.padded` ``d``)."""
        dmask, pshift = (1 << bits) - 1, shift + bits
        tidx, _, _ = cute.arch.thread_idx()
        for b in cutlass.range(tidx, BINS_PADDED, self.threads):
            sHist[b] = 0
        cute.arch.barrier()
        # Same traversal as the compaction: 16 consecutive scores per thread, 16-byte loads,
        # a static inner loop with an explicit bound check (no dynamic-trip unrolling).
        gRow = cute.zipped_divide(row, (4,))
        rB = cute.make_rmem_tensor(cute.make_layout((ITEMS,)), Uint32)
        for base in cutlass.range(0, limit, self.threads * ITEMS):
            first = base + tidx * ITEMS
            for v in cutlass.range_constexpr(ITEMS // 4):
                if first + v * 4 < limit:
                    cute.autovec_copy(gRow[None, first // 4 + v], cute.zipped_divide(rB, (4,))[None, v])
            for j in cutlass.range_constexpr(ITEMS):
                key = order_key(rB[j])
                match = first + j < limit
                if cutlass.const_expr(pshift < 32):
                    match = match and (key >> pshift) == prefix
                if match:
                    d = Int32((key >> shift) & Uint32(dmask))
                    cute.arch.atomic_add((sHist.iterator + padded(d, bits)).llvm_ptr, Int32(1))
        cute.arch.barrier()

    @cute.jit
    def compact(self, row: cute.Tensor, limit: Int32, thr: Uint32, take_eq: Int32, sWarp: cute.Tensor,
                mIdx: cute.Tensor, t: Int32):
        """Write, in index order, keys > thr and the first take_eq keys == thr; pad with -1."""
        tidx, _, _ = cute.arch.thread_idx()
        CH = self.threads * ITEMS
        gRow = cute.zipped_divide(row, (4,))
        rB = cute.make_rmem_tensor(cute.make_layout((ITEMS,)), Uint32)
        gt_run, eq_run = Int32(0), Int32(0)
        for base in cutlass.range(0, limit, CH):
            first = base + tidx * ITEMS
            for v in cutlass.range_constexpr(ITEMS // 4):
                if first + v * 4 < limit:
                    cute.autovec_copy(gRow[None, first // 4 + v], cute.zipped_divide(rB, (4,))[None, v])
            n_gt, n_eq = Int32(0), Int32(0)
            for j in cutlass.range_constexpr(ITEMS):
                key = order_key(rB[j])
                live = first + j < limit
                n_gt = n_gt + cutlass.select_(live and key > thr, Int32(1), Int32(0))
                n_eq = n_eq + cutlass.select_(live and key == thr, Int32(1), Int32(0))
            # Block exclusive scan of the packed (eq << 16 | gt) counts: a chunk holds < 2^16.
            excl, total = block_exclusive_scan((n_eq << 16) | n_gt, sWarp, self.warps)
            cute.arch.barrier()  # sWarp is rewritten by the next chunk
            gt_before = gt_run + (excl & 0xFFFF)
            eq_before = eq_run + (excl >> 16)
            for j in cutlass.range_constexpr(ITEMS):
                key = order_key(rB[j])
                live = first + j < limit
                is_gt = live and key > thr
                is_eq = live and key == thr
                if is_gt or (is_eq and eq_before < take_eq):
                    mIdx[t, gt_before + cutlass.min(eq_before, take_eq)] = first + j
                gt_before = gt_before + cutlass.select_(is_gt, Int32(1), Int32(0))
                eq_before = eq_before + cutlass.select_(is_eq, Int32(1), Int32(0))
            gt_run = gt_run + (total & 0xFFFF)
            eq_run = eq_run + (total >> 16)
        n_sel = gt_run + cutlass.min(eq_run, take_eq)
        for p in cutlass.range(n_sel + tidx, self.k, self.threads):
            mIdx[t, p] = -1

    @staticmethod
    def can_implement(topk: int) -> bool:
        return 1 <= topk <= 65535


def _build(arch: str, *, topk: int, compress_ratio: int = 1):
    if not IndexerTopk.can_implement(topk):
        raise ValueError(f"indexer_topk: unsupported topk={topk}")
    check_compress_ratio("indexer_topk", compress_ratio)
    P = jit.fake_gmem_ptr
    args = (P(Float32, 16), P(Int32, 4), P(Int32, 4), P(Int32, 4), Int32(1), Int32(4), Int32(4), jit.fake_stream())
    return IndexerTopk(topk, compress_ratio), args


KERNEL = jit.register(jit.KernelDef(
    name="indexer_topk",
    build=_build,
    sources=tuple(os.path.join(os.path.dirname(os.path.abspath(__file__)), f) for f in ("indexer_topk.py",
                                                                                        "radix_select.py")),
    archs=("sm_90a", "sm_100a", "sm_103a"),
    aot_configs=({"topk": 2048}, {"topk": 512, "compress_ratio": 4}, {"topk": 1024, "compress_ratio": 4}),
    description="radix-select top-k of masked indexer scores, ascending indices, -1 padded",
))


def _build_tensors(arch: str, *, topk: int, compress_ratio: int = 1):
    op, _ = _build(arch, topk=topk, compress_ratio=compress_ratio)
    sym, T = {}, jit.fake_tensor
    return op.tensor_call, (T(Float32, ("N", "P"), 16, sym), T(Int32, ("T",), 4, sym), T(Int32, ("T",), 4, sym),
                            T(Int32, ("T", topk), 4, sym), Int32(1), jit.fake_env_stream())


jit.register_tensor_entry(KERNEL, _build_tensors, aot_configs=KERNEL.aot_configs)
#: (topk, compress_ratio, device index) -> indexer_select's tensor entry (jit.launch_tensor_entry)
_TENSOR_FNS: dict = {}


class IndexerWorkspace:
    """Score rows for up to ``max_tokens`` tokens and ``max_keys`` keys (graph capturable)."""

    def __init__(self, max_tokens: int, max_keys: int, device="cuda"):
        if not isinstance(max_tokens, int) or max_tokens < 1 or not isinstance(max_keys, int) or max_keys < 1:
            raise ValueError(f"indexer_topk: max_tokens and max_keys must be positive ints, got "
                             f"{max_tokens!r}, {max_keys!r}")
        self.max_tokens, self.max_keys = max_tokens, max_keys
        self.pitch = -(-max_keys // 4) * 4
        self.scores = torch.empty(max_tokens, self.pitch, dtype=torch.float32, device=device)


def indexer_select(workspace: IndexerWorkspace, kv_len: torch.Tensor, pos: torch.Tensor, *, topk: int = 2048,
                   max_keys: int | None = None, compress_ratio: int = 1, out: torch.Tensor | None = None,
                   stream=None, arch: str | None = None, plan="auto") -> torch.Tensor:
    """The radix select alone, on score rows already in ``workspace.scores`` (``-inf`` =
    masked): int32 ``[T, topk]`` ascending, ``-1`` padded, over entries
    ``[0, min((pos + 1) // compress_ratio, kv_len, max_keys))`` of each row. :func:`indexer_topk`
    is the scores kernel followed by this.

    ``plan``: which kernel selects -- ``"auto"`` (default: the split kernel,
    :mod:`cute_kernels.indexer_topk_split`, where :func:`~cute_kernels.indexer_topk_split.split_plan`
    gives a plan -- rows up to 8192 keys, and longer rows at small T --, else the streaming kernel),
    ``None`` (the streaming kernel) or a ``(cluster, items)`` of the split kernel whose rows hold
    ``max_keys`` (``cluster * 512 * items >= max_keys``), optionally ``(cluster, items, True)``:
    its counts exchanged by ``red.async`` and mbarriers instead of cluster barriers."""
    if (plan == "auto" and out is not None and stream is None and arch is None and jit.TVM_FFI
            and isinstance(workspace, IndexerWorkspace) and isinstance(kv_len, torch.Tensor)):  # the eager hot path
        bound = workspace.max_keys if max_keys is None else max_keys
        shape = kv_len.shape
        if (len(shape) == 1 and 0 < shape[0] <= workspace.max_tokens and isinstance(bound, int)
                and 1 <= bound <= workspace.max_keys and jit.launch_tensor_entry(
                    _TENSOR_FNS, (topk, compress_ratio, kv_len.get_device(), default_plan(shape[0], bound)),
                    workspace.scores, kv_len, pos, out, bound)):
            return out
    op = "indexer_select"
    check_compress_ratio(op, compress_ratio)
    if not isinstance(workspace, IndexerWorkspace):
        raise TypeError(f"{op}: workspace must be an IndexerWorkspace, got {type(workspace).__name__}")
    T = kv_len.shape[0] if isinstance(kv_len, torch.Tensor) else 0
    for name, t in (("kv_len", kv_len), ("pos", pos)):
        check_tensor(op, name, t, dtype=torch.int32, shape=(T,), contiguous=True, align_bytes=4)
    if not isinstance(topk, int) or not IndexerTopk.can_implement(topk):
        raise ValueError(f"{op}: topk must be an int in [1, 65535], got {topk!r}")
    max_keys = workspace.max_keys if max_keys is None else max_keys
    if not isinstance(max_keys, int) or not 1 <= max_keys <= workspace.max_keys:
        raise ValueError(f"{op}: max_keys must be an int in [1, {workspace.max_keys}], got {max_keys!r}")
    if T > workspace.max_tokens:
        raise ValueError(f"{op}: {T} tokens but the workspace holds {workspace.max_tokens}")
    if not (plan == "auto" or plan is None or (
            isinstance(plan, tuple) and len(plan) in (2, 3) and plan[0] in indexer_topk_split.CLUSTERS
            and plan[1] in indexer_topk_split.ITEMS and plan[0] * indexer_topk_split.THREADS * plan[1] >= max_keys
            and (len(plan) == 2 or isinstance(plan[2], bool)))):
        raise ValueError(f"{op}: plan must be 'auto', None or (cluster, items[, async_counts]) with cluster in "
                         f"{indexer_topk_split.CLUSTERS}, items in {indexer_topk_split.ITEMS}, cluster * "
                         f"{indexer_topk_split.THREADS} * items >= max_keys = {max_keys} and a bool "
                         f"async_counts, got {plan!r}")
    if out is None:
        out = torch.empty(T, topk, dtype=torch.int32, device=kv_len.device)
    check_tensor(op, "out", out, dtype=torch.int32, shape=(T, topk), contiguous=True, align_bytes=4)
    check_cuda(op, ("kv_len", kv_len), ("pos", pos), ("out", out), ("workspace.scores", workspace.scores))
    a = arch if arch is not None else current_arch(kv_len.device)
    dispatch(op, ("portable",), arch=a)
    if T == 0:
        return out
    auto = plan == "auto"
    plan = _select(workspace, kv_len, pos, out, T, topk, max_keys, compress_ratio, a, jit.cu_stream(stream), plan)
    if auto and stream is None and arch is None:  # its tensor entry for the next calls
        key = (topk, compress_ratio, kv_len.get_device(), plan)
        if plan is None:
            jit.remember_tensor_entry(_TENSOR_FNS, key, "indexer_topk_tensors", a, topk=topk,
                                      **_ratio_cfg(compress_ratio))
        else:
            jit.remember_tensor_entry(_TENSOR_FNS, key, "indexer_topk_split_tensors", a, topk=topk,
                                      cluster=plan[0], items=plan[1], **_ratio_cfg(compress_ratio),
                                      **_async_cfg(plan))
    return out


def _async_cfg(plan: tuple) -> dict:
    """The compile-config entry of a split plan's count exchange: none for cluster barriers."""
    return {"async_counts": True} if len(plan) == 3 and plan[2] and plan[0] > 1 else {}


def _ratio_cfg(compress_ratio: int) -> dict:
    """The compile-config entry of a compress ratio: none for raw keys (the V3-style configs)."""
    return {"compress_ratio": compress_ratio} if compress_ratio != 1 else {}


#: whether ``plan="auto"`` takes the split select where :func:`~cute_kernels.indexer_topk_split.split_plan`
#: gives a plan (False: always the streaming select); ``bench/bench_indexer.py --select`` times both
SPLIT_BY_DEFAULT = True


def default_plan(num_tokens: int, max_keys: int):
    """The plan ``plan="auto"`` takes for ``num_tokens`` rows of at most ``max_keys`` keys: the
    split select's :func:`~cute_kernels.indexer_topk_split.split_plan` with :data:`SPLIT_BY_DEFAULT`,
    else (or where it gives none) None, the streaming select."""
    return indexer_topk_split.split_plan(num_tokens, max_keys) if SPLIT_BY_DEFAULT else None


def _select(workspace, kv_len, pos, out, T, topk, max_keys, compress_ratio, arch, cs, plan="auto"):
    """Launch the select (``plan``: ``"auto"`` -- :func:`~cute_kernels.indexer_topk_split.split_plan`
    --, None for the streaming kernel, or a ``(cluster, items)`` of the split one); returns the
    plan taken."""
    P = jit.gmem_ptr
    if plan == "auto":
        plan = default_plan(T, max_keys)
    if plan is None:
        topk_fn = jit.get_kernel("indexer_topk", arch, topk=topk, **_ratio_cfg(compress_ratio))
    else:
        topk_fn = jit.get_kernel("indexer_topk_split", arch, topk=topk, cluster=plan[0], items=plan[1],
                                 **_ratio_cfg(compress_ratio), **_async_cfg(plan))
    topk_fn(P(Float32, workspace.scores, 16), P(Int32, kv_len, 4), P(Int32, pos, 4), P(Int32, out, 4), jit.i32(T),
            jit.i32(workspace.pitch), jit.i32(max_keys), cs)
    return plan


def indexer_topk(q: torch.Tensor, w: torch.Tensor, k_cache: torch.Tensor, kv_offset: torch.Tensor,
                 kv_len: torch.Tensor, pos: torch.Tensor, *, topk: int = 2048, max_keys: int | None = None,
                 slot_valid: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 workspace: IndexerWorkspace | None = None, stream=None, arch: str | None = None,
                 use_wgmma: bool | None = None, k_scale: torch.Tensor | None = None,
                 token_group: int = 1, compress_ratio: int = 1) -> torch.Tensor:
    """Top-``topk`` candidate keys per token: int32 ``[T, topk]``, ascending, ``-1`` padded.

    ``q [T, H, D]`` bf16, ``w [T, H]`` fp32, ``k_cache [R, D]`` bf16 (all sequences' index
    keys; token t's key s is row ``kv_offset[t] + s``), int32 ``kv_offset``, ``kv_len``,
    ``pos`` of shape ``[T]``, optional ``slot_valid [R]`` (bool / uint8; 0 = padded or
    invalid slot). ``max_keys`` bounds every ``min(pos + 1, kv_len)`` (default: R); it sizes
    the grid, so no host sync reads the lengths. Key s of token t is a candidate iff
    ``s <= pos[t]``, ``s < kv_len[t]``, ``s < max_keys``, its row is inside ``k_cache`` and
    its slot is valid. ``use_wgmma`` picks the Hopper score kernel: ``None`` (default) the
    TMA + wgmma one where it applies (H = 64; faster than the warp-MMA kernel on the H200),
    ``False`` the warp-MMA one (any supported H), ``True`` requires wgmma.

    ``token_group`` (2-4; Hopper, bf16, H = 64): one CTA scores that many consecutive tokens
    from one key tile -- for layouts where consecutive tokens share ``kv_offset`` (a verify
    block's tokens); correct for any layout (:mod:`cute_kernels.indexer_scores_token_group_sm90`;
    GPU-tested). The decode runtime uses 3.

    FP8 variant: ``q`` and ``k_cache`` in ``torch.float8_e4m3fn`` with ``k_scale [R]`` fp32
    (positive, per key row) and ``w`` carrying each query head's scale (DeepSeek's
    formulation, :mod:`cute_kernels.indexer_scores_fp8`; GPU-tested on the H200).

    Compressed entries (DeepSeek-V4's CSA indexer): ``compress_ratio = m`` (4 in V4) makes
    ``k_cache`` rows compressed entries, entry ``i`` pooled from tokens ``[i*m, (i+1)*m)`` (its
    overlap with the previous window lies earlier still), and ``kv_len`` counts a sequence's
    entries. A query at position ``pos`` sees entry ``i`` only once that window is whole:
    ``i < (pos + 1) // m``. With ``topk`` 512 (V4-Flash) or 1024 (V4-Pro). V4 scales the score
    by ``D**-0.5 * H**-0.5``: fold both into ``w`` (positive, so it commutes with the ReLU).
    """
    op = "indexer_topk"
    check_compress_ratio(op, compress_ratio)
    fp8 = isinstance(q, torch.Tensor) and q.dtype == torch.float8_e4m3fn
    qdt = torch.float8_e4m3fn if fp8 else torch.bfloat16
    check_tensor(op, "q", q, dtype=(torch.bfloat16, torch.float8_e4m3fn), ndim=3, contiguous=True, align_bytes=16)
    T, H, D = q.shape
    if not (IndexerScoresFp8.can_implement(H, D) if fp8 else IndexerScores.can_implement(H, D)):
        raise ValueError(f"{op}: q has H={H} heads of D={D}; supported: H % 32 == 0 in [32, 128], "
                         f"D % {32 if fp8 else 16} == 0 in [{32 if fp8 else 16}, 256]")
    check_tensor(op, "w", w, dtype=torch.float32, shape=(T, H), contiguous=True, align_bytes=16)
    check_tensor(op, "k_cache", k_cache, dtype=qdt, ndim=2, contiguous=True, align_bytes=16)
    R = k_cache.shape[0]
    if k_cache.shape[1] != D:
        raise ValueError(f"{op}: k_cache must have shape [R, {D}] (q's head dim), got {list(k_cache.shape)}")
    if fp8:
        if k_scale is None:
            raise ValueError(f"{op}: FP8 q / k_cache need k_scale [R] (fp32 per key row)")
        check_tensor(op, "k_scale", k_scale, dtype=torch.float32, shape=(R,), contiguous=True, align_bytes=4)
    elif k_scale is not None:
        raise ValueError(f"{op}: k_scale is only for FP8 q / k_cache (got bf16 q)")
    for name, t in (("kv_offset", kv_offset), ("kv_len", kv_len), ("pos", pos)):
        check_tensor(op, name, t, dtype=torch.int32, shape=(T,), contiguous=True, align_bytes=4)
    if slot_valid is not None:
        check_tensor(op, "slot_valid", slot_valid, dtype=(torch.bool, torch.uint8), shape=(R,), contiguous=True,
                     align_bytes=0)
    if not isinstance(topk, int) or not IndexerTopk.can_implement(topk):
        raise ValueError(f"{op}: topk must be an int in [1, 65535], got {topk!r}")
    max_keys = R if max_keys is None else max_keys
    if not isinstance(max_keys, int) or max_keys < 1:
        raise ValueError(f"{op}: max_keys must be a positive int, got {max_keys!r}")
    if T * max(H * D, max_keys) >= 2**31 or R * D >= 2**31:
        raise ValueError(f"{op}: problem too large for 32-bit indexing")
    if out is None:
        out = torch.empty(T, topk, dtype=torch.int32, device=q.device)
    check_tensor(op, "out", out, dtype=torch.int32, shape=(T, topk), contiguous=True, align_bytes=4)
    named = [("q", q), ("w", w), ("k_cache", k_cache), ("kv_offset", kv_offset), ("kv_len", kv_len), ("pos", pos),
             ("out", out)] + ([("slot_valid", slot_valid)] if slot_valid is not None else []) \
        + ([("k_scale", k_scale)] if fp8 else [])
    if not (use_wgmma is None or isinstance(use_wgmma, bool)):
        raise TypeError(f"{op}: use_wgmma must be None, False or True, got {use_wgmma!r}")
    if not isinstance(token_group, int) or isinstance(token_group, bool) or not 1 <= token_group <= 4:
        raise ValueError(f"{op}: token_group must be an int in [1, 4], got {token_group!r}")
    if token_group > 1 and (fp8 or use_wgmma is False or not IndexerScoresTokenGroupSm90.can_implement(H, D, token_group)):
        raise ValueError(f"{op}: token_group > 1 needs the wgmma score kernel: bf16 q / k_cache, H = 64 heads "
                         f"(got {q.dtype}, H={H}, use_wgmma={use_wgmma})")
    if use_wgmma and not (not fp8 and IndexerScoresSm90.can_implement(H, D)):
        raise ValueError(f"{op}: use_wgmma=True needs bf16 q / k_cache with H = 64 heads (got "
                         f"{q.dtype}, H={H}); pass use_wgmma=None to pick the kernel")
    check_cuda(op, *named)
    a = arch if arch is not None else current_arch(q.device)
    dispatch(op, ("portable",), arch=a)
    if T == 0:
        return out
    if workspace is None:
        workspace = IndexerWorkspace(T, max_keys, device=q.device)
    if not isinstance(workspace, IndexerWorkspace):
        raise TypeError(f"{op}: workspace must be an IndexerWorkspace, got {type(workspace).__name__}")
    if workspace.max_tokens < T or workspace.max_keys < max_keys:
        raise ValueError(f"{op}: workspace holds {workspace.max_tokens} tokens x {workspace.max_keys} keys; "
                         f"need {T} x {max_keys}")
    check_cuda(op, ("q", q), ("workspace.scores", workspace.scores))
    P, cs = jit.gmem_ptr, jit.cu_stream(stream)
    has_mask = slot_valid is not None
    # Blackwell: tcgen05 with keys as the MMA's M (needs H = 64); elsewhere the warp-MMA kernel.
    path = dispatch(op, ("sm100", "sm90", "portable"), arch=a)
    mask = slot_valid.view(torch.uint8) if has_mask else kv_len  # any valid pointer when unused
    pitch = workspace.pitch
    cfg = dict(heads=H, dim=D, has_slot_mask=has_mask, **_ratio_cfg(compress_ratio))  # every score kernel's
    if fp8:
        f8 = cutlass.Float8E4M3FN
        scores_fn = jit.get_kernel("indexer_scores_fp8", a, **cfg)
        scores_fn(P(f8, q, 16), P(Float32, w, 16), P(f8, k_cache, 16), P(Float32, k_scale, 4), P(Int32, kv_offset, 4),
                  P(Int32, kv_len, 4), P(Int32, pos, 4), P(cutlass.Uint8, mask, 1), P(Float32, workspace.scores, 16),
                  jit.i32(T), jit.i32(R), jit.i32(pitch), cs)
        _select(workspace, kv_len, pos, out, T, topk, max_keys, compress_ratio, a, cs)
        return out
    if path == "sm100" and IndexerScoresSm100.can_implement(H, D):
        scores_fn = jit.get_kernel("indexer_scores_sm100", a, **cfg)
    elif path == "sm90" and token_group > 1:
        scores_fn = jit.get_kernel("indexer_scores_token_group_sm90", a, group=token_group, **cfg)
    elif path == "sm90" and use_wgmma is not False and IndexerScoresSm90.can_implement(H, D):
        scores_fn = jit.get_kernel("indexer_scores_sm90", a, **cfg)
    else:
        scores_fn = jit.get_kernel("indexer_scores", a, **cfg)
    scores_fn(P(cutlass.BFloat16, q, 16), P(Float32, w, 16), P(cutlass.BFloat16, k_cache, 16),
              P(Int32, kv_offset, 4), P(Int32, kv_len, 4), P(Int32, pos, 4), P(cutlass.Uint8, mask, 1),
              P(Float32, workspace.scores, 16), jit.i32(T), jit.i32(R), jit.i32(pitch), cs)
    _select(workspace, kv_len, pos, out, T, topk, max_keys, compress_ratio, a, cs)
    return out

