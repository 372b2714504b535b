"""Warp-level helpers of the MMA kernels: shared-memory -> register operand copies for the
``mma.sync`` kernels (mhc_stats, wo_a_decode, indexer_scores, the Hopper MoE tiled kernel),
the wgmma kernels' per-thread fragments (indexer_scores_sm90*, wo_a_decode_swap_ab,
moe.experts_swap_ab_sm90), the FP8 wgmma kernels' per-block promotion (moe.experts_swap_ab_sm90,
wo_a_fp8_act_sm90), and the quad reduction over an accumulator row's 4 threads."""

import cutlass.cute as cute
from cutlass import Float32


def ldmatrix_operands(tiled_mma: cute.TiledMma, dtype, tidx, sA: cute.Tensor, sB: cute.Tensor,
                      tCrA: cute.Tensor, tCrB: cute.Tensor):
    """ldmatrix x4 for A (an m16 x k fragment) and x2 for B (n8 x k), partitioned for thread
    ``tidx``: ``(s2r_A, tAsA, tArA, s2r_B, tBsB, tBrB)`` -- per operand the tiled copy, its
    shared-memory source and the MMA's register fragment retiled as its destination."""
    s2r_A = cute.make_tiled_copy_A(cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(False, 4), dtype),
                                   tiled_mma)
    s2r_B = cute.make_tiled_copy_B(cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(False, 2), dtype),
                                   tiled_mma)
    thr_A, thr_B = s2r_A.get_slice(tidx), s2r_B.get_slice(tidx)
    return s2r_A, thr_A.partition_S(sA), thr_A.retile(tCrA), s2r_B, thr_B.partition_S(sB), thr_B.retile(tCrB)


def wgmma_fragments(tiled_mma: cute.TiledMma, tidx, sA: cute.Tensor, sB: cute.Tensor, shape_mn):
    """Thread ``tidx``'s wgmma operand fragments of the shared-memory tiles ``sA`` / ``sB``,
    the (m, n) coordinates of its accumulator elements over a ``shape_mn`` product, and that
    FP32 accumulator (uninitialised): ``(tCrA, tCrB, tCcC, acc)``."""
    thr_mma = tiled_mma.get_slice(tidx)
    tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
    tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
    tCcC = thr_mma.partition_C(cute.make_identity_tensor(shape_mn))
    return tCrA, tCrB, tCcC, cute.make_rmem_tensor(tCcC.shape, Float32)


@cute.jit
def quad_sum(v):
    """Sum over the 4 threads of a quad (lanes 4q .. 4q + 3): in the m16n8 / wgmma accumulator
    layouts they hold one row's columns. Every lane of the quad gets the sum."""
    v = v + cute.arch.shuffle_sync_bfly(v, offset=1)
    return v + cute.arch.shuffle_sync_bfly(v, offset=2)


def fp8_wgmma_blocks(tiled_mma: cute.TiledMma, tCrA: cute.Tensor, tCrB: cute.Tensor, stage, frags: list, blocks: int,
                     promote):
    """One K slice of a block-scaled FP8 wgmma kernel: per 32-wide K block ``kb`` (the K mode of
    stage ``stage``'s fragments ``tCrA`` / ``tCrB``) a wgmma into a fresh FP32 fragment (the
    caller's tiled MMA has ACCUMULATE off), then ``promote(frag, kb)`` adds it into the caller's
    accumulator with the block's scales. Two fragments (``frags``) alternate, so block kb's
    wgmma runs while block kb - 1 is promoted; the fence orders a wgmma after the promotion's
    reads of the same registers. Called while a kernel is traced (the loop unrolls there)."""
    for kb in range(blocks + 1):
        if kb < blocks:
            cute.nvgpu.warpgroup.fence()
            cute.gemm(tiled_mma, frags[kb % 2], tCrA[(None, None, kb, stage)], tCrB[(None, None, kb, stage)],
                      frags[kb % 2])
            cute.nvgpu.warpgroup.commit_group()
        if kb > 0:
            cute.nvgpu.warpgroup.wait_group(1 if kb < blocks else 0)
            promote(frags[(kb - 1) % 2], kb - 1)
