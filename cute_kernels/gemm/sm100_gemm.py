"""Blackwell (sm_100a) batched GEMM engine: TMA loads, tcgen05 MMA accumulating in tensor
memory, a warp-specialised pipeline, and a TMA-store epilogue.

    C[m, n, l] = sum_k A[m, k, l] * B[n, k, l]        (FP32 accumulation, one rounding to C)

over (M, K, L) / (N, K, L) / (M, N, L) tensors of any strides TMA accepts (A and B K-major, C
N- or M-major) -- :mod:`cute_kernels.wo_a_sm100` hands it the token-major WO-A views.

One MMA tile (``tile_m`` x ``tile_n``) per CTA, or per CTA pair when ``tile_m == 256``
(``tcgen05.mma.cta_group::2``: a cluster of two CTAs, each loading and storing its own 128 rows
and half of the B tile, the leader CTA issuing the MMA over both CTAs' shared memory into both
CTAs' tensor memory). Six warps, each with one role:

- warp 5 (TMA): loads A / B k-tiles into ``stages`` shared-memory buffers as the MMA frees
  them (``PipelineTmaUmma``: full barriers counted in bytes, empty barriers signalled by
  ``tcgen05.commit``);
- warp 4 (MMA): in the leader CTA, ``tcgen05.mma`` over each k-tile as it lands, then one
  commit that marks the accumulator full for the epilogue of both CTAs;
- warps 0-3 (epilogue): allocate the accumulator's tensor-memory columns (warp 0), wait for
  it, then per 32-column subtile ``tcgen05.ld`` (each warp its 32 lanes = rows), conversion to
  C's type, a store to shared memory and a TMA store (clipping rows / columns past the
  tensor); finally free the tensor memory.

Constraints: A and B bf16 / fp16, K-major; ``tile_m`` 128 (one CTA) or 256 (a CTA pair);
``tile_n`` a multiple of 32 in 32..256. Written for this project from the public CuTe DSL API
(``cutlass.pipeline``, ``cutlass.utils.blackwell_helpers``, ``cutlass.memory``).

No Blackwell GPU is available here: the engine is compiled for sm_100a on the CPU and its
machine code asserted (``pytest tests/test_wo_a.py -k machine_code``).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, const_expr
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.tensor_utils import LayoutEnum

EPILOGUE_WARPS = 4
MMA_WARP = 4
TMA_WARP = 5
THREADS = 32 * 6
#: sm_100: 227 KiB of shared memory for one CTA
SMEM_PER_CTA_MAX = 227 * 1024
EPI_STAGES = 4
# named barriers (0 is __syncthreads): the epilogue warps' subtile handshake, and the
# epilogue + MMA warps' wait for the tensor-memory address
EPI_BARRIER, TMEM_BARRIER = 1, 2


class Sm100Gemm:
    """Compile-time configuration of one GEMM kernel; ``__call__(a, b, c, stream)`` launches."""

    def __init__(self, tile_mn: tuple[int, int], acc_dtype=Float32):
        tile_m, tile_n = tile_mn
        if tile_m not in (128, 256):
            raise ValueError(f"Sm100Gemm: tile_m must be 128 (one CTA) or 256 (a CTA pair), got {tile_m}")
        if tile_n % 32 or not 32 <= tile_n <= 256:
            raise ValueError(f"Sm100Gemm: tile_n must be a multiple of 32 in 32..256, got {tile_n}")
        self.tile_mn = (tile_m, tile_n)
        self.two_cta = tile_m == 256
        self.cluster_mn = (2, 1) if self.two_cta else (1, 1)
        self.acc_dtype = acc_dtype

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, stream: cuda.CUstream):
        tiled_mma = self.configure(a, b, c)
        sA_one = sm100_utils.make_smem_layout_a(tiled_mma, self.mma_tiler, self.a_dtype, 1)
        sB_one = sm100_utils.make_smem_layout_b(tiled_mma, self.mma_tiler, self.b_dtype, 1)
        sC_layout = sm100_utils.make_smem_layout_epi(self.c_dtype, self.c_major, self.epi_tile, EPI_STAGES)
        stage_bytes = cute.size_in_bytes(self.a_dtype, sA_one) + cute.size_in_bytes(self.b_dtype, sB_one)
        # less the epilogue buffers, and 1 KiB for barriers and alignment
        self.stages = (SMEM_PER_CTA_MAX - 1024 - cute.size_in_bytes(self.c_dtype, sC_layout)) // stage_bytes
        sA_layout = sm100_utils.make_smem_layout_a(tiled_mma, self.mma_tiler, self.a_dtype, self.stages)
        sB_layout = sm100_utils.make_smem_layout_b(tiled_mma, self.mma_tiler, self.b_dtype, self.stages)
        # the pair's two halves of each stage land on the leader's full barrier
        self.tx_bytes = stage_bytes * cute.size(tiled_mma.thr_id.shape)

        tma_a, mA = cute.nvgpu.make_tiled_tma_atom_A(
            sm100_utils.cluster_shape_to_tma_atom_A(self.cluster_mn, tiled_mma.thr_id), a,
            cute.slice_(sA_layout, (None, None, None, 0)), self.mma_tiler, tiled_mma, self.cluster_vmnk.shape)
        tma_b, mB = cute.nvgpu.make_tiled_tma_atom_B(
            sm100_utils.cluster_shape_to_tma_atom_B(self.cluster_mn, tiled_mma.thr_id), b,
            cute.slice_(sB_layout, (None, None, None, 0)), self.mma_tiler, tiled_mma, self.cluster_vmnk.shape)
        tma_c, mC = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), c,
                                                cute.slice_(sC_layout, (None, None, 0)), self.epi_tile)
        self.tmem_cols = cutlass.memory.get_num_tmem_alloc_cols(
            tiled_mma.make_fragment_C(tiled_mma.partition_shape_C(self.mma_tiler[:2])))

        self.kernel(tiled_mma, tma_a, mA, tma_b, mB, tma_c, mC, sA_layout, sB_layout, sC_layout, self.cluster_vmnk,
                    self.epi_tile).launch(
            grid=self.grid(c), block=[THREADS, 1, 1], cluster=(*self.cluster_mn, 1), stream=stream)

    def configure(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor) -> cute.TiledMma:
        """What a launch derives from its operands at compile time: their types, the tiled MMA
        (returned), the MMA / CTA / epilogue tiles and the cluster layout. Also called by the
        CPU evaluation of this kernel's layouts (tests/test_wo_a.py)."""
        self.a_dtype, self.b_dtype, self.c_dtype = a.element_type, b.element_type, c.element_type
        if const_expr(self.a_dtype != self.b_dtype or self.a_dtype.width != 16):
            raise TypeError(f"Sm100Gemm: A and B must be one 16-bit type, got {self.a_dtype}, {self.b_dtype}")
        self.c_major = LayoutEnum.from_tensor(c)
        tiled_mma = self.make_tiled_mma(LayoutEnum.from_tensor(a), LayoutEnum.from_tensor(b))
        # four MMA k-steps per stage (64 16-bit elements: 128-byte rows)
        self.mma_tiler = (*self.tile_mn, cute.size(tiled_mma.shape_mnk, mode=[2]) * 4)
        self.cta_tile = (self.tile_mn[0] // cute.size(tiled_mma.thr_id.shape), *self.mma_tiler[1:])
        self.cluster_vmnk = cute.tiled_divide(cute.make_layout((*self.cluster_mn, 1)), (tiled_mma.thr_id.shape,))
        self.epi_tile = sm100_utils.compute_epilogue_tile_shape(self.cta_tile, self.two_cta, self.c_major,
                                                                self.c_dtype)
        return tiled_mma

    def grid(self, c: cute.Tensor) -> tuple:
        """CTAs per (M, N, L) of C: one per MMA tile, two (a pair, x-adjacent) when tile_m is 256."""
        M, N, L = cute.size(c, mode=[0]), cute.size(c, mode=[1]), cute.size(c, mode=[2])
        pair = self.tile_mn[0] // self.cta_tile[0]
        return ((M + self.tile_mn[0] - 1) // self.tile_mn[0] * pair, (N + self.tile_mn[1] - 1) // self.tile_mn[1], L)

    @staticmethod
    def cta_tile_coord(block: tuple, pair_size: int) -> tuple:
        """(this CTA's half of a CTA-pair MMA tile, the (m, n, l) MMA tile) of block index
        ``block`` -- the inverse of :meth:`grid`."""
        bidx, bidy, l = block
        return bidx % pair_size, (bidx // pair_size, bidy, l)

    def partition_gmem(self, tiled_mma: cute.TiledMma, cta_v, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor):
        """CTA ``cta_v``'s MMA views of the operands, every tile kept as a mode:
        (MMA, MMA_M|N, MMA_K, RestM|N, RestK, RestL) for A / B and (MMA, MMA_M, MMA_N, RestM,
        RestN, RestL) for C."""
        thr_mma = tiled_mma.get_slice(cta_v)
        return (thr_mma.partition_A(cute.local_tile(mA, cute.slice_(self.mma_tiler, (None, 0, None)), (None,) * 3)),
                thr_mma.partition_B(cute.local_tile(mB, cute.slice_(self.mma_tiler, (0, None, None)), (None,) * 3)),
                thr_mma.partition_C(cute.local_tile(mC, cute.slice_(self.mma_tiler, (None, None, 0)), (None,) * 3)))

    def make_tiled_mma(self, a_major: LayoutEnum, b_major: LayoutEnum):
        group = tcgen05.CtaGroup.TWO if self.two_cta else tcgen05.CtaGroup.ONE
        return sm100_utils.make_trivial_tiled_mma(self.a_dtype, a_major.mma_major_mode(), b_major.mma_major_mode(),
                                                  self.acc_dtype, group, self.tile_mn)

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom,
               mB: cute.Tensor, tma_c: cute.CopyAtom, mC: cute.Tensor, sA_layout: cute.ComposedLayout,
               sB_layout: cute.ComposedLayout, sC_layout: cute.ComposedLayout, cluster_vmnk: cute.Layout,
               epi_tile: cute.Tile):
        # (the host-side layouts arrive as kernel arguments: IR values of the host function
        # cannot be used inside the kernel's region)
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp == TMA_WARP:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
            cpasync.prefetch_descriptor(tma_c)

        cta_v, tile_mnl = self.cta_tile_coord(cute.arch.block_idx(), cute.size(tiled_mma.thr_id.shape))
        is_leader = cta_v == 0
        cluster_coord = cluster_vmnk.get_flat_coord(cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster()))

        @cute.struct
        class SharedStorage:
            ab_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            acc_barriers: cute.struct.MemRange[cutlass.Int64, 2]
            tmem_dealloc_barrier: cutlass.Int64
            tmem_address: cutlass.Int32

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        mcast_a = cute.size(cluster_vmnk.shape[2])
        mcast_b = cute.size(cluster_vmnk.shape[1])
        # one tcgen05.commit arrival per CTA whose loads the stage holds
        ab_producer, ab_consumer, acc_pipe, tmem = make_pipelines(
            storage, self.stages, self.tx_bytes, cluster_vmnk, mcast_a + mcast_b - 1, self.two_cta,
            storage.tmem_dealloc_barrier.ptr)

        sC = smem.allocate_tensor(element_type=self.c_dtype, layout=sC_layout.outer, byte_alignment=128,
                                  swizzle=sC_layout.inner)
        sA = smem.allocate_tensor(element_type=self.a_dtype, layout=sA_layout.outer, byte_alignment=1024,
                                  swizzle=sA_layout.inner)
        sB = smem.allocate_tensor(element_type=self.b_dtype, layout=sB_layout.outer, byte_alignment=1024,
                                  swizzle=sB_layout.inner)

        tCgA, tCgB, tCgC = self.partition_gmem(tiled_mma, cta_v, mA, mB, mC)
        k_tiles = cute.size(tCgA, mode=[4])
        tCtAcc_layout = tiled_mma.make_fragment_C(tiled_mma.partition_shape_C(self.mma_tiler[:2])).layout
        pipeline_init_wait(cluster_shape_mn=cluster_vmnk)

        if warp == TMA_WARP:
            self.load(ab_producer, tma_a, tma_b, sA, sB, tCgA, tCgB, cluster_vmnk, cluster_coord, tile_mnl, k_tiles)
        if warp == MMA_WARP:
            tmem.wait_for_alloc()
            tCtAcc = cute.make_tensor(tmem.retrieve_ptr(self.acc_dtype), tCtAcc_layout)
            if is_leader:
                self.mma(ab_consumer, acc_pipe, tiled_mma, sA, sB, tCtAcc, k_tiles)
        if warp < EPILOGUE_WARPS:
            tmem.allocate(self.tmem_cols)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(self.acc_dtype)
            tmem.relinquish_alloc_permit()
            acc_pipe.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))
            self.epilogue(tma_c, cute.make_tensor(tmem_ptr, tCtAcc_layout), sC, tCgC, epi_tile, tile_mnl, tidx, warp)
            # every epilogue warp's tensor-memory loads are done before warp 0 frees the columns
            cute.arch.barrier(barrier_id=EPI_BARRIER, number_of_threads=32 * EPILOGUE_WARPS)
            tmem.free(tmem_ptr)

    @cute.jit
    def load(self, ab_producer, tma_a, tma_b, sA, sB, tCgA, tCgB, cluster_vmnk, cluster_coord, tile_mnl, k_tiles):
        """The TMA warp: this CTA's share of each k-tile, multicast where the cluster shares it."""
        tAsA, tAgA = cpasync.tma_partition(
            tma_a, cluster_coord[2], cute.make_layout(cute.slice_(cluster_vmnk, (0, 0, None, 0)).shape),
            cute.group_modes(sA, 0, 3), cute.group_modes(tCgA, 0, 3))
        tBsB, tBgB = cpasync.tma_partition(
            tma_b, cluster_coord[1], cute.make_layout(cute.slice_(cluster_vmnk, (0, None, 0, 0)).shape),
            cute.group_modes(sB, 0, 3), cute.group_modes(tCgB, 0, 3))
        tAgA = tAgA[(None, tile_mnl[0], None, tile_mnl[2])]
        tBgB = tBgB[(None, tile_mnl[1], None, tile_mnl[2])]
        a_mask = None
        b_mask = None
        if const_expr(self.two_cta):
            a_mask = cpasync.create_tma_multicast_mask(cluster_vmnk, cluster_coord, mcast_mode=2)
            b_mask = cpasync.create_tma_multicast_mask(cluster_vmnk, cluster_coord, mcast_mode=1)
        for k in cutlass.range(k_tiles, unroll=1):
            stage = ab_producer.acquire_and_advance()
            cute.copy(tma_a, tAgA[(None, k)], tAsA[(None, stage.index)], tma_bar_ptr=stage.barrier, mcast_mask=a_mask)
            cute.copy(tma_b, tBgB[(None, k)], tBsB[(None, stage.index)], tma_bar_ptr=stage.barrier, mcast_mask=b_mask)
        # no exit while the MMA may still signal this CTA's empty barriers
        ab_producer.tail()

    @cute.jit
    def mma(self, ab_consumer, acc_pipe, tiled_mma, sA, sB, tCtAcc, k_tiles):
        """The leader CTA's MMA warp: the whole K loop into tensor memory, then one commit."""
        tCrA = tiled_mma.make_fragment_A(sA)
        tCrB = tiled_mma.make_fragment_B(sB)
        tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
        for _ in cutlass.range(k_tiles, unroll=1):
            stage = ab_consumer.wait_and_advance()
            for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
                cute.gemm(tiled_mma, tCtAcc, tCrA[(None, None, kb, stage.index)], tCrB[(None, None, kb, stage.index)],
                          tCtAcc)
                tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
            # tcgen05.commit: the stage is free once these MMAs have read it
            stage.release()
        acc_pipe.producer_commit(pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1))

    @cute.jit
    def epilogue(self, tma_c, tCtAcc, sC, tCgC, epi_tile, tile_mnl, tidx, warp):
        """Tensor memory -> registers (C's type) -> shared subtile -> TMA store, per subtile."""
        t2r_atom = sm100_utils.get_tmem_load_op(self.cta_tile, self.c_major, self.c_dtype, self.acc_dtype,
                                                epi_tile, self.two_cta)
        store_tmem_acc(tma_c, tCtAcc, sC, tCgC, epi_tile, tile_mnl, tidx, warp, t2r_atom, self.c_major,
                       self.c_dtype, self.acc_dtype)


@cute.jit
def make_pipelines(storage, stages: int, tx_bytes: int, cluster_vmnk: cute.Layout, ab_consumers: int,
                   two_cta: bool = False, tmem_dealloc_mbar_ptr=None):
    """Inside a kernel of this warp layout: the operand stages' TMA -> MMA pipeline (producer
    and consumer participants; ``ab_consumers`` tcgen05.commit arrivals free a stage), the
    accumulator's MMA -> epilogue pipeline, and the tensor-memory allocator, over ``storage``'s
    ``ab_barriers`` / ``acc_barriers`` / ``tmem_address``. Their init is fenced; the caller
    waits on it (``pipeline_init_wait``) once its other setup is issued."""
    ab_producer, ab_consumer = pipeline.PipelineTmaUmma.create(
        barrier_storage=storage.ab_barriers.data_ptr(), num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, ab_consumers),
        tx_count=tx_bytes, cta_layout_vmnk=cluster_vmnk, defer_sync=True).make_participants()
    acc_pipe = pipeline.PipelineUmmaAsync.create(
        barrier_storage=storage.acc_barriers.data_ptr(), num_stages=1,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32 * EPILOGUE_WARPS),
        cta_layout_vmnk=cluster_vmnk, defer_sync=True)
    tmem = cutlass.memory.TmemAllocator(
        storage.tmem_address.ptr,
        barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=TMEM_BARRIER, num_threads=32 * (EPILOGUE_WARPS + 1)),
        allocator_warp_id=0, is_two_cta=two_cta, two_cta_tmem_dealloc_mbar_ptr=tmem_dealloc_mbar_ptr)
    pipeline_init_arrive(cluster_shape_mn=cluster_vmnk, is_relaxed=True)
    return ab_producer, ab_consumer, acc_pipe, tmem


def tmem_subtiles(tCtAcc: cute.Tensor, epi_tile, t2r_atom, tidx):
    """The tensor-memory load of each epilogue subtile of the accumulator ``tCtAcc`` by thread
    ``tidx`` of the four epilogue warps: (tiled copy, its thread slice, (T2R, T2R_M, T2R_N,
    subtile) view of the accumulator)."""
    tAcc_epi = cute.flat_divide(tCtAcc[((None, None), 0, 0)], epi_tile)  # (EPI_M, EPI_N, subtiles M, N)
    t2r = tcgen05.make_tmem_copy(t2r_atom, tAcc_epi[(None, None, 0, 0)])
    thr_t2r = t2r.get_slice(tidx)
    tTR_tAcc = thr_t2r.partition_S(tAcc_epi)
    return t2r, thr_t2r, cute.group_modes(tTR_tAcc, 3, cute.rank(tTR_tAcc))


def epilogue_subtiles(tCgC: cute.Tensor, epi_tile) -> cute.Tensor:
    """C's MMA view split into the epilogue's subtiles: (EPI_M, EPI_N, subtiles M, subtiles N,
    RestM, RestN, RestL); one TMA store writes one subtile of one tile."""
    return cute.flat_divide(tCgC[((None, None), 0, 0, None, None, None)], epi_tile)


@cute.jit
def store_tmem_acc(tma_c, tCtAcc, sC, tCgC, epi_tile, tile_mnl, tidx, warp, t2r_atom, c_major, c_dtype, acc_dtype):
    """The four epilogue warps' store of a tensor-memory accumulator: per subtile a
    ``tcgen05.ld`` (``t2r_atom``), conversion to ``c_dtype``, a store to shared subtile buffer
    ``s % EPI_STAGES`` of ``sC`` and a TMA store (warp 0) to tile ``tile_mnl`` of ``tCgC``.
    Shared by this engine and :mod:`moe.experts_sm100`."""
    t2r, thr_t2r, tTR_tAcc = tmem_subtiles(tCtAcc, epi_tile, t2r_atom, tidx)
    gC_epi = epilogue_subtiles(tCgC, epi_tile)
    tTR_rAcc = cute.make_rmem_tensor(thr_t2r.partition_D(gC_epi)[(None, None, None, 0, 0, 0, 0, 0)].shape, acc_dtype)
    tTR_rC = cute.make_rmem_tensor(tTR_rAcc.shape, c_dtype)
    r2s = cute.make_tiled_copy_D(sm100_utils.get_smem_store_op(c_major, c_dtype, acc_dtype, t2r), t2r)
    tRS_sC = r2s.get_slice(tidx).partition_D(sC)
    tRS_rC = r2s.retile(tTR_rC)

    bSG_sC, bSG_gC = cpasync.tma_partition(tma_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2),
                                           cute.group_modes(gC_epi, 0, 2))
    bSG_gC = bSG_gC[(None, None, None, *tile_mnl)]
    bSG_gC = cute.group_modes(bSG_gC, 1, cute.rank(bSG_gC))  # (TMA, subtile)
    store_pipe = pipeline.PipelineTmaStore.create(
        num_stages=EPI_STAGES, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32 * EPILOGUE_WARPS))
    for s in cutlass.range(cute.size(tTR_tAcc.shape, mode=[3])):
        cute.copy(t2r, tTR_tAcc[(None, None, None, s)], tTR_rAcc)
        tRS_rC.store(r2s.retile(tTR_rAcc).load().to(c_dtype))
        buf = s % EPI_STAGES
        cute.copy(r2s, tRS_rC, tRS_sC[(None, None, None, buf)])
        # the generic-proxy smem writes become visible to TMA, then one warp stores
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=EPI_BARRIER, number_of_threads=32 * EPILOGUE_WARPS)
        if warp == 0:
            cute.copy(tma_c, bSG_sC[(None, buf)], bSG_gC[(None, s)])
            store_pipe.producer_commit()
            # the subtile EPI_STAGES - 1 stores back has been read: its buffer is free
            store_pipe.producer_acquire()
        cute.arch.barrier(barrier_id=EPI_BARRIER, number_of_threads=32 * EPILOGUE_WARPS)
    if warp == 0:
        store_pipe.producer_tail()
