"""Lightning-indexer scores for groups of tokens sharing a key cache, Hopper (TMA + wgmma).

The :mod:`cute_kernels.indexer_scores_sm90` kernel scores one token per CTA: each CTA loads a
64-key tile and its token's ``q [64 heads, D]`` -- as many bytes of q as of keys -- and the
6 tokens of a verify block each reload the same key tile. Here one CTA scores ``G``
consecutive tokens (2-4; a verify block's tokens are consecutive in the runtime's layout):
the key tile is loaded once and wgmma's N is the group's ``G * 64`` head columns
(``C = K_tile q_group^T``, ``[64, G * 64]``), then each token's head-weighted ReLU sum and
mask as in the one-token kernel (same helpers, same outputs).

Any token layout is correct: the CTA compares the group's ``kv_offset`` values and, when they
differ, runs one pass per token (each with that token's key tile, keeping only its columns)
-- slower, never wrong. Tokens past ``T`` in the last group are loaded as zeros by TMA and
never stored.

Status: GPU-tested on the H200 against the FP32 reference (``tests/test_indexer.py -m gpu
-k token_group``, including layouts whose groups span requests) and machine-code checked on
the CPU; ``python bench/bench_indexer.py`` times it against the one-token kernel (faster on
verify blocks, where a request's tokens share their key tiles). ``indexer_topk(...,
token_group=G)``; the decode runtime passes 3.

Constraints: heads = 64, ``D % 16 == 0`` and ``D <= 256``, ``G`` in 2..4 (N = 64 G <= 256).
"""

import os

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32

from . import jit
from .indexer_scores import (candidate_limit, candidate_tensors, check_compress_ratio, fake_args, mma_operand_tensors,
                             store_masked_score)
# the shared one-stage buffers and fragments assume the one-token kernel's key tile and threads
from .indexer_scores_sm90 import KEY_TILE, THREADS, keys_by_queries, one_stage_buffers, wgmma_whole_k
from .tma_pipeline import tma_tiles
from .warp_mma import quad_sum, wgmma_fragments

GROUPS = (2, 3, 4)


class IndexerScoresTokenGroupSm90:
    def __init__(self, heads: int, dim: int, has_slot_mask: bool, group: int, compress_ratio: int = 1):
        self.H, self.D, self.has_slot_mask, self.G, self.ratio = heads, dim, has_slot_mask, group, compress_ratio
        self.N = group * heads
        self.tile = (KEY_TILE, self.N, dim)

    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, w_ptr: cute.Pointer, k_ptr: cute.Pointer, off_ptr: cute.Pointer,
                 len_ptr: cute.Pointer, pos_ptr: cute.Pointer, valid_ptr: cute.Pointer, score_ptr: cute.Pointer,
                 num_tokens: Int32, num_rows: Int32, s_max: Int32, stream: cuda.CUstream):
        H, D, G = self.H, self.D, self.G
        mK, mQ, mW = mma_operand_tensors(q_ptr, w_ptr, k_ptr, num_tokens, num_rows, H, D)
        mOff, mLen, mPos, mValid, mScore = candidate_tensors(off_ptr, len_ptr, pos_ptr, valid_ptr, score_ptr,
                                                             num_tokens, num_rows, s_max)

        tiled_mma, tma_a, tma_tensor_a, tma_b, tma_tensor_b, a_smem, b_smem = keys_by_queries(mK, mQ, self.tile)
        self.kernel(tiled_mma, tma_a, tma_tensor_a, tma_b, tma_tensor_b, a_smem, b_smem, mW, mOff, mLen, mPos,
                    mValid, mScore, num_tokens, num_rows, s_max).launch(
            grid=[(s_max + KEY_TILE - 1) // KEY_TILE, (num_tokens + G - 1) // G, 1], block=[THREADS, 1, 1],
            stream=stream)

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tma_a: cute.CopyAtom, mK: cute.Tensor, tma_b: cute.CopyAtom,
               mQ: cute.Tensor, a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout, mW: cute.Tensor,
               mOff: cute.Tensor, mLen: cute.Tensor, mPos: cute.Tensor, mValid: cute.Tensor, mScore: cute.Tensor,
               num_tokens: Int32, num_rows: Int32, s_max: Int32):
        G = self.G
        tidx, _, _ = cute.arch.thread_idx()
        kt, tg, _ = cute.arch.block_idx()
        s0 = kt * KEY_TILE
        t0 = tg * G
        # The group's metadata (a token past T mirrors the last one: read, never stored).
        offs = cute.make_rmem_tensor(cute.make_layout((G,)), Int32)
        lims = cute.make_rmem_tensor(cute.make_layout((G,)), Int32)
        same = Int32(1)
        live = Int32(0)
        for g in cutlass.range_constexpr(G):
            t = cutlass.min(t0 + g, num_tokens - 1)
            offs[g] = mOff[t]
            lims[g] = candidate_limit(mOff, mLen, mPos, t, num_rows, self.ratio)
            if t0 + g < num_tokens:
                if offs[g] != offs[0]:
                    same = Int32(0)
                if s0 < lims[g]:
                    live = Int32(1)
        if live == 0:
            # no token of the group has a candidate in this tile
            for g in cutlass.range_constexpr(G):
                if t0 + g < num_tokens:
                    for s in cutlass.range(tidx, cutlass.min(KEY_TILE, s_max - s0), THREADS):
                        mScore[t0 + g, s0 + s] = Float32(float("-inf"))
        else:
            self.score_group(tiled_mma, tma_a, mK, tma_b, mQ, a_smem, b_smem, mW, mValid, mScore, offs, lims, same,
                             tidx, tg, t0, s0, num_tokens, s_max)

    @cute.jit
    def score_group(self, tiled_mma: cute.TiledMma, tma_a: cute.CopyAtom, mK: cute.Tensor, tma_b: cute.CopyAtom,
                    mQ: cute.Tensor, a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout, mW: cute.Tensor,
                    mValid: cute.Tensor, mScore: cute.Tensor, offs: cute.Tensor, lims: cute.Tensor, same: Int32,
                    tidx: Int32, tg: Int32, t0: Int32, s0: Int32, num_tokens: Int32, s_max: Int32):
        G, H, D = self.G, self.H, self.D
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        sA, sB, pipe = one_stage_buffers(a_smem, b_smem)

        gB = cute.local_tile(mQ, (self.N, D), (None, None, None))[(None, None, tg, 0, 0)]
        tBsB, tBgB = tma_tiles(tma_b, sB, gB)
        prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        tCrA, tCrB, tCcC, acc = wgmma_fragments(tiled_mma, tidx, sA, sB, (KEY_TILE, self.N))
        part = cute.make_rmem_tensor(cute.make_layout((2 * G,)), Float32)
        rows = cute.make_rmem_tensor(cute.make_layout((2,)), Int32)

        # One pass when the group shares its keys; else pass p scores token p alone.
        n_pass = cutlass.select_(same != 0, Int32(1), Int32(G))
        for p in cutlass.range(n_pass, unroll=1):
            key_off = offs[0]
            for g in cutlass.range_constexpr(1, G):
                key_off = cutlass.select_(p == g, offs[g], key_off)
            gA = cute.local_tile(cute.domain_offset((key_off + s0, 0, 0), mK), (KEY_TILE, D),
                                 (None, None, None))[(None, None, 0, 0, 0)]
            tAsA, tAgA = tma_tiles(tma_a, sA, gA)
            if warp_idx == 0:
                pipe.producer_acquire(prod)
                cute.copy(tma_a, tAgA, tAsA[(None, 0)], tma_bar_ptr=pipe.producer_get_barrier(prod))
                cute.copy(tma_b, tBgB, tBsB[(None, 0)], tma_bar_ptr=pipe.producer_get_barrier(prod))
                pipe.producer_commit(prod)
            prod.advance()
            pipe.consumer_wait(cons)
            wgmma_whole_k(tiled_mma, acc, tCrA, tCrB)
            pipe.consumer_release(cons)  # the wgmmas have read the stage: the next pass may refill it
            cons.advance()

            # Per thread: two key rows (r and r + 8) x 2 columns of every 8-column block; the
            # block's token is static (g = 8 nb // H), the head is the column within the token.
            part.fill(0.0)
            for i in cutlass.range_constexpr(cute.size(acc)):
                m, n = tCcC[i]
                r8 = (i // 2) % 2  # accumulator mode 0 is (column pair, row + 8, n block)
                g = (i // 4) * 8 // H
                rows[r8] = m
                part[r8 * G + g] = part[r8 * G + g] + \
                    mW[cutlass.min(t0 + g, num_tokens - 1), n - g * H] * cutlass.max(acc[i], Float32(0.0))
            for r8 in cutlass.range_constexpr(2):
                s = s0 + rows[r8]
                for g in cutlass.range_constexpr(G):
                    v = quad_sum(part[r8 * G + g])
                    mine = (same != 0) or (p == g)  # this pass scored token g with its own keys
                    if cute.arch.lane_idx() % 4 == 0 and mine and t0 + g < num_tokens and s < s_max:
                        store_masked_score(mScore, mValid, t0 + g, s, offs[g] + s, lims[g], v, self.has_slot_mask)

    @staticmethod
    def can_implement(heads: int, dim: int, group: int) -> bool:
        return heads == 64 and dim % 16 == 0 and 16 <= dim <= 256 and group in GROUPS


def _build(arch: str, *, heads: int, dim: int, has_slot_mask: bool, group: int, compress_ratio: int = 1):
    if not IndexerScoresTokenGroupSm90.can_implement(heads, dim, group):
        raise ValueError(f"indexer_scores_token_group_sm90: unsupported heads={heads}, dim={dim}, group={group} "
                         f"(heads must be 64, group in {GROUPS})")
    check_compress_ratio("indexer_scores_token_group_sm90", compress_ratio)
    return IndexerScoresTokenGroupSm90(heads, dim, has_slot_mask, group, compress_ratio), fake_args()


KERNEL = jit.register(jit.KernelDef(
    name="indexer_scores_token_group_sm90",
    build=_build,
    sources=tuple(os.path.join(os.path.dirname(os.path.abspath(__file__)), f)
                  for f in ("indexer_scores_token_group_sm90.py", "indexer_scores.py", "indexer_scores_sm90.py",
                            "warp_mma.py", "tma_pipeline.py")),
    archs=("sm_90a",),
    aot_configs=({"heads": 64, "dim": 128, "has_slot_mask": False, "group": 3},
                 {"heads": 64, "dim": 128, "has_slot_mask": False, "group": 3, "compress_ratio": 4}),
    description="lightning-indexer scores for groups of tokens sharing keys, wgmma (keys x G*heads)",
))
