"""Lightning-indexer scores with the candidate mask fused, Blackwell path (TMA + tcgen05).

Same contract as :mod:`cute_kernels.indexer_scores` (scores ``[T, S]`` fp32, ``-inf`` where
key ``s`` of token ``t`` is not a candidate). The product is computed transposed, one CTA
per (128-key tile, token): ``C'[key, head] = k_cache[off + s0 + key, :] . q[t, head, :]``
with the 128 keys as the tcgen05 MMA's M (A = the key tile, TMA-loaded at the token's own
row offset) and the 64 heads as N (B = ``q[t]``). The accumulator lands in tensor memory
as 128 lanes (keys) x 64 columns (heads), so the epilogue's ``tcgen05.ld 32x32b`` hands
thread ``i`` every head of key ``i``: ``score = sum_h w[h] * relu(C'[i, h])`` is a
register-only loop in a fixed head order -- no cross-thread reduction -- followed by the
mask and one coalesced store per key tile.

It cannot run here (no Blackwell GPU): CI compiles it for sm_100a and checks the machine
code (UTCHMMA, UTMALDG, LDTM); ``tests/test_indexer.py`` evaluates its own layout objects on
the CPU (the rows each CTA reads, the key and heads each thread loads from tensor memory) and
emulates its transposed tiling (keys x heads, per-thread head reduction, mask) against the
FP64 reference. The
Hopper path is the warp-MMA kernel in :mod:`cute_kernels.indexer_scores`.

Constraints: heads = 64 (the MMA's N; DeepSeek's indexer), D % 16 == 0 and D <= 256.

    pytest tests/test_indexer.py
"""

import os

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, tcgen05

from . import jit
from .indexer_scores import (candidate_limit, candidate_tensors, check_compress_ratio, fake_args, mma_operand_tensors,
                             store_masked_score)
from .tma_pipeline import tma_tiles

KEY_TILE = 128
THREADS = 128


# (no `from __future__ import annotations` here: cute.struct reads real annotation types)
@cute.struct
class _Storage:
    ab_mbar: cute.struct.MemRange[cutlass.Int64, 2]
    acc_mbar: cute.struct.MemRange[cutlass.Int64, 2]
    tmem_holding_buf: Int32


class IndexerScoresSm100:
    def __init__(self, heads: int, dim: int, has_slot_mask: bool, compress_ratio: int = 1):
        self.H, self.D, self.has_slot_mask, self.ratio = heads, dim, has_slot_mask, compress_ratio
        self.mma_tiler = (KEY_TILE, heads, dim)

    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, w_ptr: cute.Pointer, k_ptr: cute.Pointer, off_ptr: cute.Pointer,
                 len_ptr: cute.Pointer, pos_ptr: cute.Pointer, valid_ptr: cute.Pointer, score_ptr: cute.Pointer,
                 num_tokens: Int32, num_rows: Int32, s_max: Int32, stream: cuda.CUstream):
        H, D = self.H, self.D
        bf16 = cutlass.BFloat16
        mK, mQ, mW = mma_operand_tensors(q_ptr, w_ptr, k_ptr, num_tokens, num_rows, H, D)
        mOff, mLen, mPos, mValid, mScore = candidate_tensors(off_ptr, len_ptr, pos_ptr, valid_ptr, score_ptr,
                                                             num_tokens, num_rows, s_max)

        tiled_mma = self.make_tiled_mma()
        a_smem = sm100_utils.make_smem_layout_a(tiled_mma, self.mma_tiler, bf16, 1)
        b_smem = sm100_utils.make_smem_layout_b(tiled_mma, self.mma_tiler, bf16, 1)
        tma_op = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        tma_a, tma_tensor_a = cute.nvgpu.make_tiled_tma_atom_A(tma_op, mK, cute.select(a_smem, mode=[0, 1, 2]),
                                                               self.mma_tiler, tiled_mma)
        tma_b, tma_tensor_b = cute.nvgpu.make_tiled_tma_atom_B(tma_op, mQ, cute.select(b_smem, mode=[0, 1, 2]),
                                                               self.mma_tiler, tiled_mma)
        self.kernel(tiled_mma, tma_a, tma_tensor_a, tma_b, tma_tensor_b, a_smem, b_smem, mW, mOff, mLen, mPos,
                    mValid, mScore, num_rows, s_max).launch(
            grid=[(s_max + KEY_TILE - 1) // KEY_TILE, num_tokens, 1], block=[THREADS, 1, 1], stream=stream)

    def make_tiled_mma(self) -> cute.TiledMma:
        """128 keys (M) x the heads (N) x 16, bf16 operands from shared memory, FP32 accumulator."""
        return cute.make_tiled_mma(tcgen05.MmaF16BF16Op(
            cutlass.BFloat16, Float32, (KEY_TILE, self.H, 16), tcgen05.CtaGroup.ONE, tcgen05.OperandSource.SMEM,
            tcgen05.OperandMajorMode.K, tcgen05.OperandMajorMode.K))

    def partition_gmem(self, thr_mma, mK: cute.Tensor, mQ: cute.Tensor, first_row, t):
        """The MMA views of this CTA's operands, (MMA, MMA_M|N, MMA_K, RestK): A the 128 cache
        rows from ``first_row`` (the token's row offset plus the key tile's start: the TMA
        coordinate tensor shifted there, then tiled; TMA zero-fills rows past the cache, and
        those keys are masked), B token ``t``'s heads."""
        gA = cute.local_tile(cute.domain_offset((first_row, 0, 0), mK), cute.slice_(self.mma_tiler, (None, 0, None)),
                             (None, None, None))[(None, None, 0, None, 0)]
        gB = cute.local_tile(mQ, cute.slice_(self.mma_tiler, (0, None, None)),
                             (None, None, None))[(None, None, t, None, 0)]
        return thr_mma.partition_A(gA), thr_mma.partition_B(gB)

    def accumulator_rows(self, tCtAcc: cute.Tensor, thr_mma, tidx):
        """Thread ``tidx``'s ``tcgen05.ld 32x32b`` of the accumulator (thread i <- tensor-memory
        lane i: key s0 + i, every head column): (the tiled copy, its source view, the (key,
        head) of each value it loads)."""
        tmem_copy = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x64), Float32),
                                           tCtAcc)
        thr_copy = tmem_copy.get_slice(tidx)
        return (tmem_copy, thr_copy.partition_S(tCtAcc),
                thr_copy.partition_D(thr_mma.partition_C(cute.make_identity_tensor(self.mma_tiler[:2]))))

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
        s = s0 + tidx
        if s0 >= limit:
            if s < s_max:
                mScore[t, s] = neg_inf
        else:
            smem = cutlass.memory.SmemAllocator()
            storage = smem.allocate(_Storage)
            sA = smem.allocate_tensor(cutlass.BFloat16, a_smem.outer, 128, swizzle=a_smem.inner)
            sB = smem.allocate_tensor(cutlass.BFloat16, b_smem.outer, 128, swizzle=b_smem.inner)
            tmem = utils.TmemAllocator(storage.tmem_holding_buf.ptr,
                                       barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=1, num_threads=THREADS))
            tmem.allocate(self.H)  # 64 fp32 columns x 128 lanes
            if warp_idx == 0:
                cpasync.prefetch_descriptor(tma_a)
                cpasync.prefetch_descriptor(tma_b)
            tx = cute.size_in_bytes(cutlass.BFloat16, cute.select(a_smem, mode=[0, 1, 2])) + \
                cute.size_in_bytes(cutlass.BFloat16, cute.select(b_smem, mode=[0, 1, 2]))
            ab_prod, ab_cons = pipeline.PipelineTmaUmma.create(
                num_stages=1, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread), tx_count=tx,
                barrier_storage=storage.ab_mbar.data_ptr()).make_participants()
            acc_prod, acc_cons = pipeline.PipelineUmmaAsync.create(
                num_stages=1, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, THREADS),
                barrier_storage=storage.acc_mbar.data_ptr()).make_participants()

            # The key tile starts at the token's own row offset: shift the TMA coordinate
            # tensor, then tile from there (TMA zero-fills rows past the cache; those keys
            # are masked below anyway).
            thr_mma = tiled_mma.get_slice(0)
            tCgA, tCgB = self.partition_gmem(thr_mma, mK, mQ, off + s0, t)
            tCrA, tCrB = tiled_mma.make_fragment_A(sA), tiled_mma.make_fragment_B(sB)
            tCtAcc = tiled_mma.make_fragment_C(tiled_mma.partition_shape_C(self.mma_tiler[:2]))
            tAsA, tAgA = tma_tiles(tma_a, sA, tCgA, tile_modes=3)
            tBsB, tBgB = tma_tiles(tma_b, sB, tCgB, tile_modes=3)
            tmem.wait_for_alloc()
            tCtAcc = cute.make_tensor(tmem.retrieve_ptr(Float32), tCtAcc.layout)

            if warp_idx == 0:
                acc_empty = acc_prod.acquire_and_advance()
                ab_empty = ab_prod.acquire_and_advance()
                cute.copy(tma_a, tAgA[(None, 0)], tAsA[(None, ab_empty.index)], tma_bar_ptr=ab_empty.barrier)
                cute.copy(tma_b, tBgB[(None, 0)], tBsB[(None, ab_empty.index)], tma_bar_ptr=ab_empty.barrier)
                ab_full = ab_cons.wait_and_advance()
                for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
                    cute.gemm(tiled_mma, tCtAcc, tCrA[(None, None, kb, ab_full.index)],
                              tCrB[(None, None, kb, ab_full.index)], tCtAcc)
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                ab_full.release()
                acc_empty.commit()

            tmem.relinquish_alloc_permit()
            acc_full = acc_cons.wait_and_advance()
            tmem_copy, tDtC, tDcC = self.accumulator_rows(tCtAcc, thr_mma, tidx)
            rAcc = cute.make_rmem_tensor(tDcC.shape, Float32)
            cute.copy(tmem_copy, tDtC, rAcc)
            acc_full.release()
            acc_s = Float32(0.0)
            key = tDcC[0][0]
            for i in cutlass.range_constexpr(cute.size(rAcc)):
                h = tDcC[i][1]
                acc_s = acc_s + mW[t, h] * cutlass.max(rAcc[i], Float32(0.0))
            s = s0 + key
            if s < s_max:
                store_masked_score(mScore, mValid, t, s, off + s, limit, acc_s, self.has_slot_mask)
            pipeline.sync(barrier_id=1)
            tmem.free(tCtAcc.iterator)

    @staticmethod
    def can_implement(heads: int, dim: int) -> bool:
        return heads == 64 and dim % 16 == 0 and 16 <= dim <= 256


def _build(arch: str, *, heads: int, dim: int, has_slot_mask: bool, compress_ratio: int = 1):
    if not IndexerScoresSm100.can_implement(heads, dim):
        raise ValueError(f"indexer_scores_sm100: unsupported heads={heads}, dim={dim} (heads must be 64)")
    check_compress_ratio("indexer_scores_sm100", compress_ratio)
    return IndexerScoresSm100(heads, dim, has_slot_mask, compress_ratio), fake_args()


KERNEL = jit.register(jit.KernelDef(
    name="indexer_scores_sm100",
    build=_build,
    sources=tuple(os.path.join(os.path.dirname(os.path.abspath(__file__)), f)
                  for f in ("indexer_scores_sm100.py", "indexer_scores.py", "tma_pipeline.py")),
    archs=("sm_100a",),
    aot_configs=({"heads": 64, "dim": 128, "has_slot_mask": False}, {"heads": 64, "dim": 128, "has_slot_mask": True},
                 {"heads": 64, "dim": 128, "has_slot_mask": False, "compress_ratio": 4}),
    description="lightning-indexer scores, tcgen05 (keys x heads in TMEM) + fused candidate mask",
))
