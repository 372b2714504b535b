"""Single-CTA TMA helpers shared by the kernels that stream operand tiles into shared memory
without a thread-block cluster: the Hopper decode kernels (``wo_a_decode_swap_ab``,
``moe.experts_swap_ab_sm90``), the indexer score kernels (sm_90a and sm_100a) and the
Blackwell MoE expert GEMM. Called while a kernel is traced: they emit exactly the code of the
inline calls they replace (the same machine code)."""

import cutlass.cute as cute
import cutlass.pipeline as pipeline


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
