"""Lightning-indexer scores on FP8 (e4m3) queries and keys, candidate mask in the epilogue.

The FP8 variant of :mod:`cute_kernels.indexer_scores` (same tiling, same mask, same
outputs), in DeepSeek's formulation of the FP8 indexer::

    score[t, s] = k_scale[row] * sum_h w[t, h] * relu(q8[t, h, :] . k8[row, :])     row = kv_offset[t] + s

``q8`` / ``k8`` are e4m3; ``w`` already carries each query head's scale (DeepSeek folds
``q_scale * softmax_scale`` into the head weights) and ``k_scale [R]`` is the key row's
(positive) dequantisation scale, applied after the ReLU-sum because ``relu(c x) = c relu(x)``
for ``c > 0``. The mask rule is :func:`cute_kernels.indexer_scores.candidate_limit` /
:func:`~cute_kernels.indexer_scores.store_masked_score`.

Kernel: the body of :class:`cute_kernels.indexer_scores.IndexerScores` on e4m3 operands --
one CTA per ``(128-key tile, token)``; ``q8[t]`` (``[64, 128]`` bytes) and the key tile
(``[128, 128]`` bytes) arrive by cp.async into shared rows padded by 16 bytes (conflict-free
ldmatrix); 2 x 2 warps of FP8 ``mma.sync m16n8k32`` accumulate ``C = q8 k8^T`` in FP32
(e4m3 products are exact in FP32; ptxas lowers the e4m3 MMA to f16 unpacks + HMMA on these
archs); thread ``s`` reduces column ``s`` over the heads in a fixed order and scales by
``k_scale``.
Half the bytes of the bf16 kernel per key; the same select (:mod:`cute_kernels.indexer_topk`)
follows. Same source on sm_90a and sm_100a (a tcgen05 FP8 variant is not written).

Status: GPU-tested on the H200 (``tests/test_indexer.py -k fp8``: three shapes incl. short
sequences); timed in ``bench/bench_indexer.py``'s FP8 column.

Constraints: ``H % 32 == 0`` in [32, 128], ``D % 32 == 0`` in [32, 256]; ``k_scale > 0``.
"""

from __future__ import annotations

import os

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from . import jit
from .indexer_scores import KEY_TILE, IndexerScores, candidate_tensors, check_compress_ratio


class IndexerScoresFp8(IndexerScores):
    """The bf16 kernel's body on e4m3 q / keys, with the keys' scales (``mKs``) in the epilogue."""

    dtype = cutlass.Float8E4M3FN
    k_step = 32  # K of one e4m3 mma.sync: exactly one 32-wide block

    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, w_ptr: cute.Pointer, k_ptr: cute.Pointer, ks_ptr: cute.Pointer,
                 off_ptr: cute.Pointer, len_ptr: cute.Pointer, pos_ptr: cute.Pointer, valid_ptr: cute.Pointer,
                 score_ptr: cute.Pointer, num_tokens: Int32, num_rows: Int32, s_max: Int32, stream: cuda.CUstream):
        H, D = self.H, self.D
        mQ = cute.make_tensor(q_ptr, cute.make_layout((num_tokens, H, D), stride=(H * D, D, 1)))
        mW = cute.make_tensor(w_ptr, cute.make_layout((num_tokens, H), stride=(H, 1)))
        mK = cute.make_tensor(k_ptr, cute.make_layout((num_rows, D), stride=(D, 1)))
        mKs = cute.make_tensor(ks_ptr, cute.make_layout((num_rows,)))
        mOff, mLen, mPos, mValid, mScore = candidate_tensors(off_ptr, len_ptr, pos_ptr, valid_ptr, score_ptr,
                                                             num_tokens, num_rows, s_max)
        tiled_mma = cute.make_tiled_mma(cute.nvgpu.warp.MmaFP8Op(cutlass.Float8E4M3FN, Float32, (16, 8, 32)),
                                        cute.make_layout((2, 2, 1)))
        self.kernel(mQ, mW, mK, mKs, mOff, mLen, mPos, mValid, mScore, tiled_mma, num_rows, s_max).launch(
            grid=[(s_max + KEY_TILE - 1) // KEY_TILE, num_tokens, 1], block=[self.threads, 1, 1], stream=stream)

    @staticmethod
    def can_implement(heads: int, dim: int) -> bool:
        return heads % 32 == 0 and 32 <= heads <= 128 and dim % 32 == 0 and 32 <= dim <= 256


def _build(arch: str, *, heads: int, dim: int, has_slot_mask: bool, compress_ratio: int = 1):
    if not IndexerScoresFp8.can_implement(heads, dim):
        raise ValueError(f"indexer_scores_fp8: unsupported heads={heads}, dim={dim}")
    P = jit.fake_gmem_ptr
    f8 = cutlass.Float8E4M3FN
    args = (P(f8, 16), P(Float32, 16), P(f8, 16), P(Float32, 4), P(Int32, 4), P(Int32, 4), P(Int32, 4),
            P(cutlass.Uint8, 1), P(Float32, 16), Int32(1), Int32(1), Int32(4), jit.fake_stream())
    check_compress_ratio("indexer_scores_fp8", compress_ratio)
    return IndexerScoresFp8(heads, dim, has_slot_mask, compress_ratio), args


KERNEL = jit.register(jit.KernelDef(
    name="indexer_scores_fp8",
    build=_build,
    sources=tuple(os.path.join(os.path.dirname(os.path.abspath(__file__)), f)
                  for f in ("indexer_scores_fp8.py", "indexer_scores.py", "warp_mma.py")),
    archs=("sm_90a", "sm_100a", "sm_103a"),
    aot_configs=({"heads": 64, "dim": 128, "has_slot_mask": False}, {"heads": 64, "dim": 128, "has_slot_mask": True}),
    description="lightning-indexer scores on FP8 q/k (warp FP8 MMA), k scale and candidate mask in the epilogue",
))
