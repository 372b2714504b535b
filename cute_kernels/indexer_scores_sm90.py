"""Lightning-indexer scores with the candidate mask fused, Hopper wgmma path (TMA + wgmma).

Same contract and the same transposed product as :mod:`cute_kernels.indexer_scores_sm100`:
one CTA (one warpgroup) per (64-key tile, token), ``C'[key, head] = k[off + s0 + key] .
q[t, head]`` with the keys as wgmma's M (A = the key tile, TMA-loaded at the token's own row
offset) and the 64 heads as N (B = ``q[t]``), K = D in 16-wide steps, FP32 accumulators in
registers. In wgmma's accumulator layout a row (key) lives in the 4 threads of a quad, 16
head columns each: each thread folds ``w[h] * relu(C')`` over its 16 columns, two xor
shuffles finish the head sum (a fixed order: deterministic), then the mask and the store.

Status: GPU-tested on the H200 (``tests/test_indexer.py -k wgmma``) and faster than the
warp-MMA kernel there (``bench/bench_indexer.py``), so it is :func:`indexer_topk`'s Hopper
default for H = 64 (``use_wgmma=False`` keeps the warp-MMA one).

Constraints: heads = 64, D % 16 == 0 and D <= 256.

    pytest tests/test_indexer.py
"""

import os

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32

from . import jit
from .indexer_scores import (candidate_limit, candidate_tensors, check_compress_ratio, fake_args, mma_operand_tensors,
                             store_masked_score)
from .tma_pipeline import single_cta_tma_pipeline, tma_tiles
from .warp_mma import quad_sum, wgmma_fragments

KEY_TILE = 64
THREADS = 128


def keys_by_queries(mK: cute.Tensor, mQ: cute.Tensor, tile: tuple):
    """One-stage TMA + wgmma setup for ``tile = (keys, query rows, D)``: keys as A (M), query
    rows as B (N), both K-major bf16 in 128B-swizzled shared memory. Returns the tiled MMA,
    the two TMA atoms with their tensors, and the two shared-memory layouts."""
    bf16 = cutlass.BFloat16
    K_MAJOR = cute.nvgpu.OperandMajorMode.K
    tiled_mma = sm90_utils.make_trivial_tiled_mma(bf16, bf16, K_MAJOR, K_MAJOR, Float32, (1, 1, 1),
                                                  tiler_mn=(tile[0], tile[1]))
    a_smem = sm90_utils.make_smem_layout_a(utils.LayoutEnum.ROW_MAJOR, tile, bf16, 1)
    b_smem = sm90_utils.make_smem_layout_b(utils.LayoutEnum.ROW_MAJOR, tile, bf16, 1)
    op = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
    tma_a, tma_tensor_a = cute.nvgpu.cpasync.make_tiled_tma_atom(op, mK, cute.slice_(a_smem, (None, None, 0)),
                                                                 (tile[0], tile[2]))
    tma_b, tma_tensor_b = cute.nvgpu.cpasync.make_tiled_tma_atom(op, mQ, cute.slice_(b_smem, (None, None, 0)),
                                                                 (tile[1], tile[2]))
    return tiled_mma, tma_a, tma_tensor_a, tma_b, tma_tensor_b, a_smem, b_smem


@cute.jit
def one_stage_buffers(a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout):
    """Shared memory for one A (keys) and one B (query rows) bf16 tile, and the one-stage TMA
    pipeline (tx-count mbarrier) that fills them: ``(sA, sB, pipe)``."""
    bf16 = cutlass.BFloat16
    smem = cutlass.memory.SmemAllocator()
    mbar = smem.allocate_tensor(cutlass.Int64, cute.make_layout((2,)), 8)
    sA = smem.allocate_tensor(bf16, a_smem.outer, 128, swizzle=a_smem.inner)
    sB = smem.allocate_tensor(bf16, b_smem.outer, 128, swizzle=b_smem.inner)
    return sA, sB, single_cta_tma_pipeline(mbar, 1, THREADS // 32, (bf16, a_smem), (bf16, b_smem))


@cute.jit
def wgmma_whole_k(tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor):
    """acc = A B^T over all of K held in shared-memory stage 0 (one wgmma per K step), waited
    for: the score kernels' whole product is one stage."""
    tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
    cute.nvgpu.warpgroup.fence()
    for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
        cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, 0)], tCrB[(None, None, kb, 0)], acc)
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
    cute.nvgpu.warpgroup.commit_group()
    cute.nvgpu.warpgroup.wait_group(0)


class IndexerScoresSm90:
    def __init__(self, heads: int, dim: int, has_slot_mask: bool, compress_ratio: int = 1):
        self.H, self.D, self.has_slot_mask, self.ratio = heads, dim, has_slot_mask, compress_ratio
        self.tile = (KEY_TILE, heads, dim)

    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, w_ptr: cute.Pointer, k_ptr: cute.Pointer, off_ptr: cute.Pointer,
                 len_ptr: cute.Pointer, pos_ptr: cute.Pointer, valid_ptr: cute.Pointer, score_ptr: cute.Pointer,
                 num_tokens: Int32, num_rows: Int32, s_max: Int32, stream: cuda.CUstream):
        H, D = self.H, self.D
        mK, mQ, mW = mma_operand_tensors(q_ptr, w_ptr, k_ptr, num_tokens, num_rows, H, D)
        mOff, mLen, mPos, mValid, mScore = candidate_tensors(off_ptr, len_ptr, pos_ptr, valid_ptr, score_ptr,
                                                             num_tokens, num_rows, s_max)

        tiled_mma, tma_a, tma_tensor_a, tma_b, tma_tensor_b, a_smem, b_smem = keys_by_queries(mK, mQ, self.tile)
        self.kernel(tiled_mma, tma_a, tma_tensor_a, tma_b, tma_tensor_b, a_smem, b_smem, mW, mOff, mLen, mPos,
                    mValid, mScore, num_rows, s_max).launch(
            grid=[(s_max + KEY_TILE - 1) // KEY_TILE, num_tokens, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tma_a: cute.CopyAtom, mK: cute.Tensor, tma_b: cute.CopyAtom,
               mQ: cute.Tensor, a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout, mW: cute.Tensor,
               mOff: cute.Tensor, mLen: cute.Tensor, mPos: cute.Tensor, mValid: cute.Tensor, mScore: cute.Tensor,
               num_rows: Int32, s_max: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        kt, t, _ = cute.arch.block_idx()
        s0 = kt * KEY_TILE
        off = mOff[t]
        limit = candidate_limit(mOff, mLen, mPos, t, num_rows, self.ratio)
        neg_inf = Float32(float("-inf"))
        if s0 >= limit:
            for s in cutlass.range(tidx, cutlass.min(KEY_TILE, s_max - s0), THREADS):
                mScore[t, s0 + s] = neg_inf
        else:
            sA, sB, pipe = one_stage_buffers(a_smem, b_smem)

            # Keys at the token's own row offset (TMA zero-fills rows past the cache).
            gA = cute.local_tile(cute.domain_offset((off + s0, 0, 0), mK), (KEY_TILE, self.D),
                                 (None, None, None))[(None, None, 0, 0, 0)]
            gB = cute.local_tile(mQ, (self.H, self.D), (None, None, None))[(None, None, t, 0, 0)]
            tAsA, tAgA = tma_tiles(tma_a, sA, gA)
            tBsB, tBgB = tma_tiles(tma_b, sB, gB)
            prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            if warp_idx == 0:
                pipe.producer_acquire(prod)
                cute.copy(tma_a, tAgA, tAsA[(None, 0)], tma_bar_ptr=pipe.producer_get_barrier(prod))
                cute.copy(tma_b, tBgB, tBsB[(None, 0)], tma_bar_ptr=pipe.producer_get_barrier(prod))
                pipe.producer_commit(prod)

            tCrA, tCrB, tCcC, acc = wgmma_fragments(tiled_mma, tidx, sA, sB, (KEY_TILE, self.H))
            pipe.consumer_wait(cons)
            wgmma_whole_k(tiled_mma, acc, tCrA, tCrB)

            # Per thread: two key rows (r and r + 8) x 16 head columns; fold, then the quad.
            part = cute.make_rmem_tensor(cute.make_layout((2,)), Float32)
            part.fill(0.0)
            rows = cute.make_rmem_tensor(cute.make_layout((2,)), Int32)
            for i in cutlass.range_constexpr(cute.size(acc)):
                m, h = tCcC[i]
                r8 = (i // 2) % 2  # accumulator mode 0 is (column pair, row + 8, n block)
                rows[r8] = m
                part[r8] = part[r8] + mW[t, h] * cutlass.max(acc[i], Float32(0.0))
            for r8 in cutlass.range_constexpr(2):
                v = quad_sum(part[r8])
                s = s0 + rows[r8]
                if cute.arch.lane_idx() % 4 == 0 and s < s_max:
                    store_masked_score(mScore, mValid, t, s, off + s, limit, v, self.has_slot_mask)

    @staticmethod
    def can_implement(heads: int, dim: int) -> bool:
        return heads == 64 and dim % 16 == 0 and 16 <= dim <= 256


def _build(arch: str, *, heads: int, dim: int, has_slot_mask: bool, compress_ratio: int = 1):
    if not IndexerScoresSm90.can_implement(heads, dim):
        raise ValueError(f"indexer_scores_sm90: unsupported heads={heads}, dim={dim} (heads must be 64)")
    check_compress_ratio("indexer_scores_sm90", compress_ratio)
    return IndexerScoresSm90(heads, dim, has_slot_mask, compress_ratio), fake_args()


KERNEL = jit.register(jit.KernelDef(
    name="indexer_scores_sm90",
    build=_build,
    sources=tuple(os.path.join(os.path.dirname(os.path.abspath(__file__)), f)
                  for f in ("indexer_scores_sm90.py", "indexer_scores.py", "warp_mma.py", "tma_pipeline.py")),
    archs=("sm_90a",),
    aot_configs=({"heads": 64, "dim": 128, "has_slot_mask": False}, {"heads": 64, "dim": 128, "has_slot_mask": False, "compress_ratio": 4}),
    description="lightning-indexer scores, wgmma (keys x heads) + fused candidate mask",
))
