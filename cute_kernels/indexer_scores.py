"""Lightning-indexer scores with the candidate mask applied in the same kernel.

For query token ``t`` (absolute position ``pos[t]``, its sequence's keys at rows
``kv_offset[t] + s`` of ``k_cache``, ``kv_len[t]`` of them cached)::

    score[t, s] = sum_h w[t, h] * relu(q[t, h, :] . k_cache[kv_offset[t] + s, :])   (FP32)
    score[t, s] = -inf   unless  s <= pos[t]  and  s < kv_len[t]  and  slot_valid[row]
                                 (and the row lies inside k_cache: bad offsets mask, never fault)

With compressed entries (``compress_ratio = m > 1``, DeepSeek-V4's CSA indexer) the rows are
entries pooled from ``m`` tokens each and ``s <= pos[t]`` becomes ``s < (pos[t] + 1) // m``:
an entry is visible once its whole window lies at or before the query (a static config).

The mask is evaluated in the epilogue from those per-token integers (and the optional
per-slot byte array of the paged pool): no ``[T, S]`` mask is materialised and no second
pass rewrites the scores. Keys past ``min(pos + 1, kv_len)`` are never loaded; a tile with
no candidate key writes ``-inf`` without touching the cache. NaN scores are written as
``-inf`` (never selected). :mod:`cute_kernels.indexer_topk` turns the rows into indices.

Kernel (tensor cores, ``mma.sync m16n8k16``, bf16 in, FP32 accumulate): one CTA per
``(128-key tile, token)``; ``q[t]`` (``[H, D] = [64, 128]``) and the key tile ``[128, D]``
arrive by cp.async into padded shared-memory rows (conflict-free ldmatrix), 2 x 2 warps
compute ``C = q k^T [64, 128]``; C goes to shared memory and thread ``s`` reduces column
``s`` over the heads in a fixed order (deterministic). On Hopper the TMA + wgmma variant
(:mod:`cute_kernels.indexer_scores_sm90`, measured 1.1-1.6x faster) is the default for H = 64
and this warp-MMA kernel serves every other H (or ``use_wgmma=False``); Blackwell uses :mod:`cute_kernels.indexer_scores_sm100`
(tcgen05) when ``H = 64``; FP8 operands use :mod:`cute_kernels.indexer_scores_fp8`.

Constraints: ``H % 32 == 0`` and ``D % 16 == 0`` (static; 64 x 128 as in DeepSeek's
indexer), bf16 ``q``/``k_cache``, fp32 ``w``, int32 metadata. T and S are runtime.

Tests / bench::

    pytest tests/test_indexer.py
    python bench/bench_indexer.py
"""

from __future__ import annotations

import os
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from . import jit
from .warp_mma import ldmatrix_operands

KEY_TILE = 128


@cute.jit
def visible_entries(pos: Int32, ratio: cutlass.Constexpr[int]) -> Int32:
    """Entries a query at position ``pos`` may see: ``pos + 1`` raw keys, or with compressed
    entries (one per ``ratio`` tokens) the ``(pos + 1) // ratio`` whose whole window ends at or
    before ``pos``. A negative position (a padding row) sees none."""
    n = pos + 1
    if cutlass.const_expr(ratio > 1):
        n = cutlass.select_(n > 0, n // ratio, Int32(0))
    return n


@cute.jit
def candidate_limit(mOff: cute.Tensor, mLen: cute.Tensor, mPos: cute.Tensor, t: Int32, num_rows: Int32,
                    ratio: cutlass.Constexpr[int] = 1) -> Int32:
    """Token t's candidates are entries [0, limit): causal (:func:`visible_entries`), cached
    (< kv_len), and rows inside the cache -- a bad offset masks keys, it never reads out of
    bounds."""
    off = mOff[t]
    limit = cutlass.min(cutlass.min(visible_entries(mPos[t], ratio), mLen[t]), num_rows - off)
    return cutlass.select_(off < 0, Int32(0), limit)


def candidate_tensors(off_ptr, len_ptr, pos_ptr, valid_ptr, score_ptr, num_tokens, num_rows, s_max):
    """Every score kernel's per-token metadata (kv_offset, kv_len, pos), per-row slot mask and
    score rows: ``(mOff, mLen, mPos, mValid, mScore)``."""
    return (cute.make_tensor(off_ptr, cute.make_layout((num_tokens,))),
            cute.make_tensor(len_ptr, cute.make_layout((num_tokens,))),
            cute.make_tensor(pos_ptr, cute.make_layout((num_tokens,))),
            cute.make_tensor(valid_ptr, cute.make_layout((num_rows,))),
            cute.make_tensor(score_ptr, cute.make_layout((num_tokens, s_max), stride=(s_max, 1))))


def mma_operand_tensors(q_ptr, w_ptr, k_ptr, num_tokens, num_rows, H: int, D: int):
    """The TMA-fed score kernels' operands (wgmma, tcgen05): the key cache as MMA A
    ``(M = rows, K = D, L = 1)``, the queries as B ``(N = T * H, K = D, L = 1)`` -- a token's
    heads are consecutive N rows -- and the head weights ``[T, H]``: ``(mK, mQ, mW)``."""
    return (cute.make_tensor(k_ptr, cute.make_layout((num_rows, D, 1), stride=(D, 1, num_rows * D))),
            cute.make_tensor(q_ptr, cute.make_layout((num_tokens * H, D, 1), stride=(D, 1, num_tokens * H * D))),
            cute.make_tensor(w_ptr, cute.make_layout((num_tokens, H), stride=(H, 1))))


@cute.jit
def store_masked_score(mScore: cute.Tensor, mValid: cute.Tensor, t: Int32, s: Int32, row: Int32, limit: Int32,
                       score: Float32, has_slot_mask: cutlass.Constexpr[bool]):
    """score[t, s], or -inf when key s (cache row ``row``) is not a candidate or the score is NaN."""
    ok = s < limit
    if cutlass.const_expr(has_slot_mask):
        if ok:
            ok = mValid[row] != 0
    # score != score is NaN: ranked as masked
    mScore[t, s] = cutlass.select_(ok and score == score, score, Float32(float("-inf")))


def fake_args():
    """Compile-time stand-ins for the score kernels' common launch signature."""
    P = jit.fake_gmem_ptr
    return (P(cutlass.BFloat16, 16), P(Float32, 16), P(cutlass.BFloat16, 16), P(Int32, 4), P(Int32, 4),
            P(Int32, 4), P(cutlass.Uint8, 1), P(Float32, 16), Int32(1), Int32(1), Int32(4), jit.fake_stream())


class IndexerScores:
    """Compile-time configuration: heads ``H``, head dim ``D``, whether a slot mask exists.

    The operand type is a class attribute: :class:`cute_kernels.indexer_scores_fp8.IndexerScoresFp8`
    runs this kernel body on e4m3 operands (and a per-key scale)."""

    dtype = cutlass.BFloat16
    k_step = 16  # K of one mma.sync

    def __init__(self, heads: int, dim: int, has_slot_mask: bool, compress_ratio: int = 1):
        self.H, self.D, self.has_slot_mask, self.ratio = heads, dim, has_slot_mask, compress_ratio
        self.vec = 128 // self.dtype.width  # elements per 16-byte copy
        # shared-memory row pitch: 16 bytes of padding, so ldmatrix rows land in distinct banks
        self.pitch = dim + self.vec
        self.threads = 128

    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, w_ptr: cute.Pointer, k_ptr: cute.Pointer, off_ptr: cute.Pointer,
                 len_ptr: cute.Pointer, pos_ptr: cute.Pointer, valid_ptr: cute.Pointer, score_ptr: cute.Pointer,
                 num_tokens: Int32, num_rows: Int32, s_max: Int32, stream: cuda.CUstream):
        H, D = self.H, self.D
        mQ = cute.make_tensor(q_ptr, cute.make_layout((num_tokens, H, D), stride=(H * D, D, 1)))
        mW = cute.make_tensor(w_ptr, cute.make_layout((num_tokens, H), stride=(H, 1)))
        mK = cute.make_tensor(k_ptr, cute.make_layout((num_rows, D), stride=(D, 1)))
        mOff, mLen, mPos, mValid, mScore = candidate_tensors(off_ptr, len_ptr, pos_ptr, valid_ptr, score_ptr,
                                                             num_tokens, num_rows, s_max)
        tiled_mma = cute.make_tiled_mma(cute.nvgpu.warp.MmaF16BF16Op(cutlass.BFloat16, Float32, (16, 8, 16)),
                                        cute.make_layout((2, 2, 1)))
        self.kernel(mQ, mW, mK, None, mOff, mLen, mPos, mValid, mScore, tiled_mma, num_rows, s_max).launch(
            grid=[(s_max + KEY_TILE - 1) // KEY_TILE, num_tokens, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mW: cute.Tensor, mK: cute.Tensor, mKs: Optional[cute.Tensor],
               mOff: cute.Tensor, mLen: cute.Tensor, mPos: cute.Tensor, mValid: cute.Tensor, mScore: cute.Tensor,
               tiled_mma: cute.TiledMma, num_rows: Int32, s_max: Int32):
        """``mKs``: per-key-row scales applied after the head sum (FP8 keys), or None."""
        H, D, P, VEC, dt = self.H, self.D, self.pitch, self.vec, self.dtype
        tidx, _, _ = cute.arch.thread_idx()
        kt, t, _ = cute.arch.block_idx()
        s0 = kt * KEY_TILE
        # Candidates of token t: keys [0, limit) (causal and within the cached length).
        off = mOff[t]
        limit = candidate_limit(mOff, mLen, mPos, t, num_rows, self.ratio)
        neg_inf = Float32(float("-inf"))
        if s0 >= limit:
            for s in cutlass.range(tidx, cutlass.min(KEY_TILE, s_max - s0), self.threads):
                mScore[t, s0 + s] = neg_inf
        else:
            smem = cutlass.memory.SmemAllocator()
            sQ = smem.allocate_tensor(dt, cute.make_layout((H, D), stride=(P, 1)), 16)
            sK = smem.allocate_tensor(dt, cute.make_layout((KEY_TILE, D), stride=(P, 1)), 16)
            sC = smem.allocate_tensor(Float32, cute.make_layout((H, KEY_TILE), stride=(KEY_TILE, 1)), 16)
            sW = smem.allocate_tensor(Float32, cute.make_layout((H,)), 16)

            atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), dt, num_bits_per_copy=128)
            gQv = cute.zipped_divide(mQ[t, None, None], (1, VEC))
            gKv = cute.zipped_divide(mK, (1, VEC))
            sQv = cute.zipped_divide(sQ, (1, VEC))
            sKv = cute.zipped_divide(sK, (1, VEC))
            VPR = D // VEC
            for i in cutlass.range_constexpr(-(-H * VPR // self.threads)):
                idx = tidx + i * self.threads
                if cutlass.const_expr(H * VPR % self.threads == 0):
                    cute.copy(atom, gQv[(0, None), (idx // VPR, idx % VPR)], sQv[(0, None), (idx // VPR, idx % VPR)])
                else:  # fewer 16-byte vectors than threads x rounds: the last round is partial
                    if idx < H * VPR:
                        cute.copy(atom, gQv[(0, None), (idx // VPR, idx % VPR)],
                                  sQv[(0, None), (idx // VPR, idx % VPR)])
            for i in cutlass.range_constexpr(KEY_TILE * VPR // self.threads):
                idx = tidx + i * self.threads
                s = idx // VPR
                # Keys past the limit are not loaded: their columns are masked below, and a
                # column of C depends on its own key row only.
                if s0 + s < limit:
                    cute.copy(atom, gKv[(0, None), (off + s0 + s, idx % VPR)], sKv[(0, None), (s, idx % VPR)])
            for h in cutlass.range(tidx, H, self.threads):
                sW[h] = mW[t, h]
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()

            thr_mma = tiled_mma.get_slice(tidx)
            tCsA = thr_mma.partition_A(sQ)
            tCsB = thr_mma.partition_B(sK)
            tCrA = tiled_mma.make_fragment_A(tCsA)
            tCrB = tiled_mma.make_fragment_B(tCsB)
            tCsC = thr_mma.partition_C(sC)
            acc = tiled_mma.make_fragment_C(tCsC)
            acc.fill(0.0)
            s2r_A, tAsA, tArA, s2r_B, tBsB, tBrB = ldmatrix_operands(tiled_mma, dt, tidx, sQ, sK, tCrA, tCrB)
            for kb in cutlass.range_constexpr(D // self.k_step):
                cute.copy(s2r_A, tAsA[None, None, kb], tArA[None, None, kb])
                cute.copy(s2r_B, tBsB[None, None, kb], tBrB[None, None, kb])
                cute.gemm(tiled_mma, acc, tCrA[None, None, kb], tCrB[None, None, kb], acc)
            tCsC.store(acc.load())
            cute.arch.barrier()

            # Thread s owns key column s: FP32 weighted ReLU sum over the heads in order (then the
            # key row's scale, if any: positive, so it commutes with the ReLU).
            for s in cutlass.range(tidx, cutlass.min(KEY_TILE, s_max - s0), self.threads):
                acc_s = Float32(0.0)
                for h in cutlass.range(H, unroll_full=True):
                    acc_s = acc_s + sW[h] * cutlass.max(sC[h, s], Float32(0.0))
                if cutlass.const_expr(mKs is not None):
                    ks = Float32(1.0)
                    if s0 + s < limit:  # rows past the limit may lie outside the cache
                        ks = mKs[off + s0 + s]
                    acc_s = acc_s * ks
                store_masked_score(mScore, mValid, t, s0 + s, off + s0 + s, limit, acc_s, self.has_slot_mask)

    @staticmethod
    def can_implement(heads: int, dim: int) -> bool:
        return heads % 32 == 0 and 32 <= heads <= 128 and dim % 16 == 0 and 16 <= dim <= 256


def check_compress_ratio(op: str, compress_ratio) -> None:
    """``compress_ratio``: tokens per key entry (1: raw keys; DeepSeek-V4's CSA indexer: 4)."""
    if not isinstance(compress_ratio, int) or isinstance(compress_ratio, bool) or not 1 <= compress_ratio <= 1024:
        raise ValueError(f"{op}: compress_ratio must be an int in [1, 1024], got {compress_ratio!r}")


def _build(arch: str, *, heads: int, dim: int, has_slot_mask: bool, compress_ratio: int = 1):
    if not IndexerScores.can_implement(heads, dim):
        raise ValueError(f"indexer_scores: unsupported heads={heads}, dim={dim}")
    check_compress_ratio("indexer_scores", compress_ratio)
    return IndexerScores(heads, dim, has_slot_mask, compress_ratio), fake_args()


KERNEL = jit.register(jit.KernelDef(
    name="indexer_scores",
    build=_build,
    sources=tuple(os.path.join(os.path.dirname(os.path.abspath(__file__)), f)
                  for f in ("indexer_scores.py", "warp_mma.py")),
    archs=("sm_90a", "sm_100a", "sm_103a"),
    aot_configs=({"heads": 64, "dim": 128, "has_slot_mask": False}, {"heads": 64, "dim": 128, "has_slot_mask": True}),
    description="lightning-indexer scores (warp MMA) with causal / length / slot masking in the epilogue",
))
