"""Lightning-indexer scores on FP8 (e4m3) queries and keys, candidate mask in the epilogue.

The FP8 variant of :mod:`cute_kernels.indexer_scores` (same tiling, same mask, same
outputs), in DeepSeek's formulation of the FP8 indexer::

    score[t, s] = k_scale[row] * sum_h w[t, h] * relu(q8[t, h, :] . k8[row, :])     row = kv_offset[t] + s

``q8`` / ``k8`` are e4m3; ``w`` already carries each query head's scale (DeepSeek folds
``q_scale * softmax_scale`` into the head weights) and ``k_scale [R]`` is the key row's
(positive) dequantisation scale, applied after the ReLU-sum because ``relu(c x) = c relu(x)``
for ``c > 0``. The mask rule is :func:`cute_kernels.indexer_scores.candidate_limit` /
:func:`~cute_kernels.indexer_scores.store_masked_score`.

Kernel: one CTA per ``(128-key tile, token)``; ``q8[t]`` (``[64, 128]`` bytes) and the key
tile (``[128, 128]`` bytes) arrive by cp.async into shared rows padded to 144 bytes
(conflict-free ldmatrix, as in :mod:`moe.experts_sm90`); 2 x 2 warps of FP8
``mma.sync m16n8k32`` accumulate ``C = q8 k8^T`` in FP32 (e4m3 products are exact in FP32);
thread ``s`` reduces column ``s`` over the heads in a fixed order and scales by ``k_scale``.
Half the bytes of the bf16 kernel per key; the same select (:mod:`cute_kernels.indexer_topk`)
follows. Same source on sm_90a and sm_100a (a tcgen05 FP8 variant is not written).

Status: compiled and machine-code checked on the CPU; its GPU test is staged
(``tests/test_indexer.py -k fp8``), **not yet run** (the session's device time was spent).

Constraints: ``H % 32 == 0`` in [32, 128], ``D % 32 == 0`` in [32, 256]; ``k_scale > 0``.
"""

from __future__ import annotations

import os

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from . import jit
from .indexer_scores import KEY_TILE, candidate_limit, store_masked_score

VEC = 16  # fp8 elements per 16-byte copy


class IndexerScoresFp8:
    """Compile-time configuration: heads ``H``, head dim ``D``, whether a slot mask exists."""

    def __init__(self, heads: int, dim: int, has_slot_mask: bool):
        self.H, self.D, self.has_slot_mask = heads, dim, has_slot_mask
        self.pitch = dim + 16  # bytes per shared row: ldmatrix rows land in distinct 16-byte bank groups
        self.threads = 128

    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, w_ptr: cute.Pointer, k_ptr: cute.Pointer, ks_ptr: cute.Pointer,
                 off_ptr: cute.Pointer, len_ptr: cute.Pointer, pos_ptr: cute.Pointer, valid_ptr: cute.Pointer,
                 score_ptr: cute.Pointer, num_tokens: Int32, num_rows: Int32, s_max: Int32, stream: cuda.CUstream):
        H, D = self.H, self.D
        mQ = cute.make_tensor(q_ptr, cute.make_layout((num_tokens, H, D), stride=(H * D, D, 1)))
        mW = cute.make_tensor(w_ptr, cute.make_layout((num_tokens, H), stride=(H, 1)))
        mK = cute.make_tensor(k_ptr, cute.make_layout((num_rows, D), stride=(D, 1)))
        mKs = cute.make_tensor(ks_ptr, cute.make_layout((num_rows,)))
        mOff = cute.make_tensor(off_ptr, cute.make_layout((num_tokens,)))
        mLen = cute.make_tensor(len_ptr, cute.make_layout((num_tokens,)))
        mPos = cute.make_tensor(pos_ptr, cute.make_layout((num_tokens,)))
        mValid = cute.make_tensor(valid_ptr, cute.make_layout((num_rows,)))
        mScore = cute.make_tensor(score_ptr, cute.make_layout((num_tokens, s_max), stride=(s_max, 1)))
        tiled_mma = cute.make_tiled_mma(cute.nvgpu.warp.MmaFP8Op(cutlass.Float8E4M3FN, Float32, (16, 8, 32)),
                                        cute.make_layout((2, 2, 1)))
        self.kernel(mQ, mW, mK, mKs, mOff, mLen, mPos, mValid, mScore, tiled_mma, num_rows, s_max).launch(
            grid=[(s_max + KEY_TILE - 1) // KEY_TILE, num_tokens, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mW: cute.Tensor, mK: cute.Tensor, mKs: cute.Tensor, mOff: cute.Tensor,
               mLen: cute.Tensor, mPos: cute.Tensor, mValid: cute.Tensor, mScore: cute.Tensor,
               tiled_mma: cute.TiledMma, num_rows: Int32, s_max: Int32):
        H, D, P = self.H, self.D, self.pitch
        f8 = cutlass.Float8E4M3FN
        tidx, _, _ = cute.arch.thread_idx()
        kt, t, _ = cute.arch.block_idx()
        s0 = kt * KEY_TILE
        off = mOff[t]
        limit = candidate_limit(mOff, mLen, mPos, t, num_rows)
        neg_inf = Float32(float("-inf"))
        if s0 >= limit:
            for s in cutlass.range(tidx, cutlass.min(KEY_TILE, s_max - s0), self.threads):
                mScore[t, s0 + s] = neg_inf
        else:
            smem = cutlass.memory.SmemAllocator()
            sQ = smem.allocate_tensor(f8, cute.make_layout((H, D), stride=(P, 1)), 16)
            sK = smem.allocate_tensor(f8, cute.make_layout((KEY_TILE, D), stride=(P, 1)), 16)
            sC = smem.allocate_tensor(Float32, cute.make_layout((H, KEY_TILE), stride=(KEY_TILE, 1)), 16)
            sW = smem.allocate_tensor(Float32, cute.make_layout((H,)), 16)

            atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), cutlass.Uint8, num_bits_per_copy=128)
            gQv = cute.zipped_divide(cute.recast_tensor(mQ[t, None, None], cutlass.Uint8), (1, VEC))
            gKv = cute.zipped_divide(cute.recast_tensor(mK, cutlass.Uint8), (1, VEC))
            sQv = cute.zipped_divide(cute.recast_tensor(sQ, cutlass.Uint8), (1, VEC))
            sKv = cute.zipped_divide(cute.recast_tensor(sK, cutlass.Uint8), (1, VEC))
            VPR = D // VEC
            for i in cutlass.range_constexpr(-(-H * VPR // self.threads)):
                idx = tidx + i * self.threads
                if idx < H * VPR:
                    cute.copy(atom, gQv[(0, None), (idx // VPR, idx % VPR)], sQv[(0, None), (idx // VPR, idx % VPR)])
            for i in cutlass.range_constexpr(-(-KEY_TILE * VPR // self.threads)):
                idx = tidx + i * self.threads
                s = idx // VPR
                # Keys past the limit are not loaded: their columns are masked below, and a
                # column of C depends on its own key row only.
                if idx < KEY_TILE * VPR and s0 + s < limit:
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
            s2r_A = cute.make_tiled_copy_A(cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(False, 4), f8),
                                           tiled_mma)
            s2r_B = cute.make_tiled_copy_B(cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(False, 2), f8),
                                           tiled_mma)
            thr_A, thr_B = s2r_A.get_slice(tidx), s2r_B.get_slice(tidx)
            tAsA, tArA = thr_A.partition_S(sQ), thr_A.retile(tCrA)
            tBsB, tBrB = thr_B.partition_S(sK), thr_B.retile(tCrB)
            for kb in cutlass.range_constexpr(D // 32):
                cute.copy(s2r_A, tAsA[None, None, kb], tArA[None, None, kb])
                cute.copy(s2r_B, tBsB[None, None, kb], tBrB[None, None, kb])
                cute.gemm(tiled_mma, acc, tCrA[None, None, kb], tCrB[None, None, kb], acc)
            tCsC.store(acc.load())
            cute.arch.barrier()

            # Thread s owns key column s: FP32 weighted ReLU sum over the heads in order, then
            # the key row's scale (positive, so it commutes with the ReLU).
            for s in cutlass.range(tidx, cutlass.min(KEY_TILE, s_max - s0), self.threads):
                acc_s = Float32(0.0)
                for h in cutlass.range(H, unroll_full=True):
                    acc_s = acc_s + sW[h] * cutlass.max(sC[h, s], Float32(0.0))
                row = off + s0 + s
                ks = Float32(1.0)
                if s0 + s < limit:  # rows past the limit may lie outside the cache
                    ks = mKs[row]
                store_masked_score(mScore, mValid, t, s0 + s, row, limit, acc_s * ks, self.has_slot_mask)

    @staticmethod
    def can_implement(heads: int, dim: int) -> bool:
        return heads % 32 == 0 and 32 <= heads <= 128 and dim % 32 == 0 and 32 <= dim <= 256


def _build(arch: str, *, heads: int, dim: int, has_slot_mask: bool):
    if not IndexerScoresFp8.can_implement(heads, dim):
        raise ValueError(f"indexer_scores_fp8: unsupported heads={heads}, dim={dim}")
    P = jit.fake_gmem_ptr
    f8 = cutlass.Float8E4M3FN
    args = (P(f8, 16), P(Float32, 16), P(f8, 16), P(Float32, 4), P(Int32, 4), P(Int32, 4), P(Int32, 4),
            P(cutlass.Uint8, 1), P(Float32, 16), Int32(1), Int32(1), Int32(4), jit.fake_stream())
    return IndexerScoresFp8(heads, dim, has_slot_mask), args


KERNEL = jit.register(jit.KernelDef(
    name="indexer_scores_fp8",
    build=_build,
    sources=(os.path.abspath(__file__), os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                     "indexer_scores.py")),
    archs=("sm_90a", "sm_100a", "sm_103a"),
    aot_configs=({"heads": 64, "dim": 128, "has_slot_mask": False}, {"heads": 64, "dim": 128, "has_slot_mask": True}),
    description="lightning-indexer scores on FP8 q/k (warp FP8 MMA), k scale and candidate mask in the epilogue",
))
