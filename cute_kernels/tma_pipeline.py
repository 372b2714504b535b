"""Single-CTA TMA helpers shared by the kernels that stream operand tiles into shared memory
without a thread-block cluster: the Hopper decode kernels (``wo_a_decode_swap_ab``, ``wo_a_fp8_act_sm90``,
``moe.experts_swap_ab_sm90``), the indexer score kernels (sm_90a and sm_100a) and the
Blackwell MoE expert GEMM. Called while a kernel is traced: they emit exactly the code of the
inline calls they replace (the same machine code)."""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32
from cutlass.tensor_utils import LayoutEnum


def single_cta_tma_pipeline(mbar: cute.Tensor, stages: int, consumer_warps: int, *operands):
    """A ``stages``-deep TMA pipeline over the mbarriers in ``mbar`` (2 x ``stages`` Int64):
    a stage's full barrier expects one stage of every operand ``(dtype, staged smem layout)``,
    and ``consumer_warps`` warps (one arrival each) free it. The barriers' initialisation is
    made visible to the whole CTA before it returns."""
    tx = sum(cute.size_in_bytes(dtype, cute.slice_(layout, (None, None, 0))) for dtype, layout in operands)
    pipe = pipeline.PipelineTmaAsync.create(
        barrier_storage=mbar.iterator, num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps), tx_count=tx,
        cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))
    cute.arch.barrier()  # barrier initialisation visible before any wait
    return pipe


def tma_tiles(atom: cute.CopyAtom, sX: cute.Tensor, gX: cute.Tensor, tile_modes: int = 2):
    """One CTA's TMA views of an operand (no multicast): ``(per-stage shared, per-tile global)``,
    the first ``tile_modes`` modes of ``sX`` / ``gX`` being one TMA box (2: an (M, K) tile;
    3: a tcgen05 MMA-partitioned tile)."""
    return cute.nvgpu.cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, tile_modes),
                                            cute.group_modes(gX, 0, tile_modes))


def swap_ab_operands(dtype, mW: cute.Tensor, mO: cute.Tensor, tile: tuple, stages: int):
    """The host side of a Hopper swap-AB kernel (weight rows as wgmma M, tokens as N, both
    K-major; ``tile = (M, N, K slice)``): its tiled MMA (FP32 accumulator), the swizzled
    ``stages``-deep shared layouts of both operands and their TMA atoms, ``(tiled_mma, w_smem,
    o_smem, tma_w, tma_tensor_w, tma_o, tma_tensor_o)``. Called while ``__call__`` is traced
    (``wo_a_decode_swap_ab``, ``wo_a_fp8_act_sm90``, ``moe.experts_swap_ab_sm90``)."""
    bm, tok_n, bk = tile
    K_MAJOR = cute.nvgpu.OperandMajorMode.K
    tiled_mma = sm90_utils.make_trivial_tiled_mma(dtype, dtype, K_MAJOR, K_MAJOR, Float32, (1, 1, 1),
                                                  tiler_mn=(bm, tok_n))
    w_smem = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tile, dtype, stages)
    o_smem = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tile, dtype, stages)
    op = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
    tma_w, tma_tensor_w = cute.nvgpu.cpasync.make_tiled_tma_atom(op, mW, cute.slice_(w_smem, (None, None, 0)), (bm, bk))
    tma_o, tma_tensor_o = cute.nvgpu.cpasync.make_tiled_tma_atom(op, mO, cute.slice_(o_smem, (None, None, 0)),
                                                                 (tok_n, bk))
    return tiled_mma, w_smem, o_smem, tma_w, tma_tensor_w, tma_o, tma_tensor_o


def swap_ab_shared_storage(dtype, w_smem: cute.ComposedLayout, o_smem: cute.ComposedLayout, stages: int,
                           tile: tuple, consumer_warps: int, align: int = 1024, extra: tuple = (),
                           out_in_stages: bool = False):
    """A swap-AB CTA's shared memory (``tile = (M, N, K slice)``): the stage mbarriers, the
    swizzled weight and token stages of ``dtype`` (``align``-byte aligned), the FP32 output tile
    ``(N, M + 1)`` (token-major; the odd pitch keeps the transposing writes conflict-free) and
    the TMA pipeline over the stages: ``(sW, sO, sOut, pipe)``, then one tensor per ``(dtype,
    layout)`` of ``extra`` (16-byte aligned, after the others). ``out_in_stages``: the output
    tile takes the weight stages' memory instead of its own -- the caller writes it only once
    every stage has been read (a CTA barrier after the main loop) and no load is in flight.
    Called while a kernel is traced."""
    bm, tok_n, _ = tile
    smem = cutlass.memory.SmemAllocator()
    mbar = smem.allocate_tensor(cutlass.Int64, cute.make_layout((2 * stages,)), 8)
    sW = smem.allocate_tensor(dtype, w_smem.outer, align, swizzle=w_smem.inner)
    sO = smem.allocate_tensor(dtype, o_smem.outer, align, swizzle=o_smem.inner)
    out_layout = cute.make_layout((tok_n, bm + 1), stride=(bm + 1, 1))
    if out_in_stages:
        assert cute.cosize(out_layout) * 4 <= cute.size_in_bytes(dtype, w_smem.outer), "the output tile outgrows the stages"
        sOut = cute.make_tensor(cute.recast_ptr(sW.iterator, dtype=Float32), out_layout)
    else:
        sOut = smem.allocate_tensor(Float32, out_layout, 16)
    pipe = single_cta_tma_pipeline(mbar, stages, consumer_warps, (dtype, w_smem), (dtype, o_smem))
    return (sW, sO, sOut, pipe, *(smem.allocate_tensor(t, layout, 16) for t, layout in extra))
