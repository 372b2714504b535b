"""Hopper (sm_90a) batched GEMM engine: TMA loads, a warp-specialised mbarrier pipeline, wgmma
accumulating in registers, and a TMA-store epilogue.

    C[m, n, l] = sum_k A[m, k, l] * B[n, k, l]        (FP32 accumulation, one rounding to C)

over (M, K, L) / (N, K, L) / (M, N, L) tensors of any strides TMA accepts (A and B K-major; C
N- or M-major), so callers hand it strided views of their own buffers --
:mod:`cute_kernels.wo_a_sm90` writes token-major WO-A output through a (T, R, G) view.

One CTA per output tile (``tile_m`` x ``tile_n``, batch ``l`` = blockIdx.z): ``tile_m / 64``
consumer warp groups and one producer warp (none for 128-row tiles at two CTAs per SM: warp 0
then issues the loads between its MMAs, ``inline_producer``).

- the producer warp issues the TMA loads of A and B k-tiles into ``stages`` shared-memory
  buffers, each guarded by a full / empty mbarrier pair
  (``PipelineTmaAsync``). With a thread-block cluster, each CTA loads its slice of the tiles
  its cluster row / column shares and multicasts it; the empty barriers then collect one
  arrival per consumer warp of every CTA that reads the buffer.
- consumer warp group ``w`` owns rows ``64w .. 64w + 63``: wgmma over each k-tile as it lands,
  one batch in flight (a buffer is released once the batch after it is issued and the batch
  reading it retired), then the epilogue: bf16 (or C's type) conversion, ``stmatrix`` into
  32-column shared-memory subtiles that reuse A's buffers, and TMA stores (4 subtiles in
  flight; a store is waited for only before its buffer is rewritten), TMA clipping rows and
  columns past the tensor -- so M, N need not be tile multiples.

Tiles are walked in groups of 8 cluster rows along M (every N tile of 8 consecutive M tiles
before the next 8), so CTAs that run together share their A and B tiles in L2.

``pingpong`` (persistent, for large M x N): one CTA (cluster) per SM walks the cluster tiles
``P`` apart (``P`` = the clusters launched, ``sm_count`` SMs' worth), in the same raster order.
Its producer warp loads every tile's k-tiles back to back (pipeline position ``j * k_tiles +
kt`` for its j-th tile, so a stage's phase bit is again a function of the position), and its
two consumer warp groups take the 64-row tiles in turn: while one runs its epilogue -- through
its own two subtile buffers, since A's stages now hold the other's operands -- the other runs
its MMAs, and the producer is already filling the stages of the tile after. A named-barrier
handshake orders the mainloops: warp group ``j % 2`` starts tile ``j`` only once the other has
waited for every k-tile of tile ``j - 1``. That keeps the tensor cores on one tile at a time,
and it is what makes the stateless phase bits safe: a stage's barrier can then be at most one
phase behind the position waited on, never two.

Options (compile time): ``cluster_mn`` (1 or 2 per mode: TMA multicast of shared tiles);
``pdl`` (launch as a programmatic dependent: the prologue's tiles of ``pdl_early_operand``,
the one the previous kernel does not write, load before ``griddepcontrol.wait``);
``occupancy`` (CTAs per SM that the stage count, and for 128-row tiles the warp count, leave
room for); ``pingpong`` with ``sm_count`` (64-row tiles, one CTA per SM, no PDL);
``l2_hint_a`` / ``l2_hint_b`` (an :data:`L2_HINTS` cache hint on that operand's TMA loads);
``max_stages`` (a cap on the operand stages, which otherwise fill shared memory);
``cluster_exit``, how a clustered CTA outlives its peers' arrivals on its barriers:
``"barrier"`` (every thread meets the cluster at a ``barrier.cluster`` arrive / wait around
the epilogue) or ``"producer_tail"`` (the producer -- warp 0 with ``inline_producer``, after
its epilogue -- waits on every stage's empty barrier, which the last remote consumer release
completes, as CUTLASS's Hopper kernels do; no cluster-wide barrier, so no release fence
before the epilogue and no CTA waits for its slower peer to finish its own). Default: the
producer tail for the one-tile-per-CTA kernel (faster for WO-A's swapped CTA pairs), the
barrier for pingpong.

Constraints: A and B of one 16-bit type (bf16 / fp16) or 8-bit floats (e4m3 / e5m2), both
K-major; ``tile_m`` in {64, 128}; ``tile_n`` a multiple of 16 in 32..256 (an odd multiple of 16:
16-column epilogue subtiles); 16-byte aligned
TMA rows. Written for this project from the public CuTe DSL API (``cutlass.pipeline``,
``cutlass.utils.hopper_helpers``).

Tests / machine code: ``pytest tests/test_wo_a.py tests/test_draft_head_fp8.py``.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.memory
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.tensor_utils import LayoutEnum

WARP_GROUP = 128
#: H100 / H200: 228 KiB of shared memory per SM, of which the hardware reserves 1 KiB per CTA;
#: at most 227 KiB for one CTA
SMEM_PER_SM = 228 * 1024
SMEM_PER_CTA_MAX = 227 * 1024
#: barriers (2 x 8 bytes a stage) and the operand buffers' 1024-byte alignment
SMEM_RESERVE = 2048
EPI_STAGES = 4
#: epilogue subtiles of each pingpong warp group (its own buffers: A's are the other's operands)
PINGPONG_EPI_STAGES = 2
#: epilogue subtile width (columns of C a TMA store writes); 16 for tiles an odd multiple of 16 wide
EPI_N = 32
#: named barriers: 1 the cooperative epilogue; pingpong: 2 + w "warp group w may start its
#: mainloop", 4 + w warp group w's epilogue
ORDER_BARRIER, PINGPONG_EPI_BARRIER = 2, 4
#: TMA loads' L2 cache hints (``createpolicy``-format 64-bit policies, as CUTLASS's
#: ``CacheHintSm90``): ``evict_first`` for an operand streamed once (weights), so it does not
#: push the re-read one out of L2
L2_HINTS = {"evict_first": 0x12F0000000000000, "evict_normal": 0x1000000000000000,
            "evict_last": 0x14F0000000000000}
#: M tiles per raster group (L2 reuse of the B tiles across concurrent CTAs)
RASTER_GROUP_M = 8


class Sm90Gemm:
    """Compile-time configuration of one GEMM kernel; ``__call__(a, b, c, stream)`` launches."""

    def __init__(self, tile_mn: tuple[int, int], cluster_mn: tuple[int, int] = (1, 1), *, pdl: bool = False,
                 pdl_early_operand: str = "b", occupancy: int = 1, pingpong: bool = False,
                 sm_count: int = 132, acc_dtype=Float32, cluster_exit: str | None = None,
                 l2_hint_a: str | None = None, l2_hint_b: str | None = None, max_stages: int | None = None):
        tile_m, tile_n = tile_mn
        if tile_m not in (64, 128):
            raise ValueError(f"Sm90Gemm: tile_m must be 64 or 128, got {tile_m}")
        if pingpong and (tile_m != 64 or occupancy != 1 or pdl):
            raise ValueError(f"Sm90Gemm: pingpong runs 64-row tiles, one persistent CTA per SM, without PDL; got "
                             f"tile_m={tile_m}, occupancy={occupancy}, pdl={pdl}")
        if sm_count < 1:
            raise ValueError(f"Sm90Gemm: sm_count must be >= 1, got {sm_count}")
        if tile_n % 16 or not 32 <= tile_n <= 256:
            raise ValueError(f"Sm90Gemm: tile_n must be a multiple of 16 in 32..256, got {tile_n}")
        if any(c not in (1, 2) for c in cluster_mn):
            raise ValueError(f"Sm90Gemm: cluster_mn must be 1 or 2 per mode, got {cluster_mn}")
        if occupancy not in (1, 2):
            raise ValueError(f"Sm90Gemm: occupancy must be 1 or 2, got {occupancy}")
        if cluster_exit is None:
            cluster_exit = "barrier" if pingpong else "producer_tail"
        if cluster_exit not in ("barrier", "producer_tail"):
            raise ValueError(f"Sm90Gemm: cluster_exit must be 'barrier' or 'producer_tail', got {cluster_exit!r}")
        for name, hint in (("l2_hint_a", l2_hint_a), ("l2_hint_b", l2_hint_b)):
            if hint is not None and hint not in L2_HINTS:
                raise ValueError(f"Sm90Gemm: {name} must be None or one of {sorted(L2_HINTS)}, got {hint!r}")
        self.l2_hints = (l2_hint_a, l2_hint_b)
        if max_stages is not None and max_stages < 2:
            raise ValueError(f"Sm90Gemm: max_stages must be None or >= 2, got {max_stages}")
        self.max_stages = max_stages
        if pdl_early_operand not in ("a", "b"):
            raise ValueError(f"Sm90Gemm: pdl_early_operand must be 'a' or 'b', got {pdl_early_operand!r}")
        self.tile_mn = (tile_m, tile_n)
        # epilogue subtile width: EPI_N columns, 16 where the tile is an odd multiple of 16
        self.epi_n = EPI_N if tile_n % EPI_N == 0 else 16
        self.cluster_mn = tuple(cluster_mn)
        self.pdl, self.pdl_early_a = pdl, pdl_early_operand == "a"
        self.occupancy = occupancy
        self.cluster_exit = cluster_exit
        self.acc_dtype = acc_dtype
        self.consumer_wgs = tile_m // 64
        # A producer warp after the consumer warp groups (no setmaxnreg: a producer warp group
        # would starve the consumers at two CTAs per SM) -- except for 128-row tiles at two
        # CTAs per SM: an SM sub-partition's 16K registers then hold at most 4 warps of a
        # 128 x 160 tile's 106 (112 allocated) a thread, and 2 x 9 warps put 5 on one. There
        # the CTA is the two consumer warp groups alone and warp 0 also issues the loads, each
        # stage's as soon as the consumers free one (``inline_producer``).
        self.inline_producer = occupancy == 2 and self.consumer_wgs == 2
        # ``pingpong``: a persistent CTA per SM whose two consumer warp groups take alternate
        # 64-row tiles -- one's epilogue (and the producer's next loads) under the other's MMAs
        self.pingpong, self.sm_count = pingpong, sm_count
        if pingpong:
            self.consumer_wgs = 2
        self.threads = WARP_GROUP * self.consumer_wgs + (0 if self.inline_producer else 32)
        self.producer_warp = 0 if self.inline_producer else 4 * self.consumer_wgs

    def epilogue_bytes(self, c_width: int) -> int:
        """Shared memory of the pingpong kernel's epilogue subtiles, each consumer warp group's
        own 64-row ones (the one-tile-per-CTA epilogue reuses A's buffers: 0)."""
        return 2 * PINGPONG_EPI_STAGES * 64 * self.epi_n * c_width // 8 if self.pingpong else 0

    def stages_for(self, tile_k: int, ab_width: int, c_width: int = 16) -> int:
        """Operand stages that fit ``occupancy`` CTAs per SM (the cooperative epilogue reuses A's
        buffers; the pingpong one has its own), at most ``max_stages``."""
        tile_m, tile_n = self.tile_mn
        smem = SMEM_PER_CTA_MAX if self.occupancy == 1 else SMEM_PER_SM // self.occupancy - 1024
        smem -= SMEM_RESERVE + self.epilogue_bytes(c_width)
        fit = smem // ((tile_m + tile_n) * tile_k * ab_width // 8)
        return fit if self.max_stages is None else min(fit, self.max_stages)

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, stream: cuda.CUstream):
        self.a_dtype, self.b_dtype, self.c_dtype = a.element_type, b.element_type, c.element_type
        if const_expr(self.a_dtype.width != self.b_dtype.width or self.a_dtype.width not in (8, 16)):
            raise TypeError(f"Sm90Gemm: A and B must both be 16-bit or both 8-bit, got {self.a_dtype}, {self.b_dtype}")
        if const_expr(self.a_dtype.width == 16 and self.a_dtype != self.b_dtype):
            raise TypeError(f"Sm90Gemm: 16-bit A and B must match, got {self.a_dtype}, {self.b_dtype}")
        a_major, b_major = LayoutEnum.from_tensor(a), LayoutEnum.from_tensor(b)
        self.c_major = c_major = LayoutEnum.from_tensor(c)
        tile_m, tile_n = self.tile_mn
        cluster_m, cluster_n = self.cluster_mn

        mma_wgs = 1 if self.pingpong else self.consumer_wgs  # warp groups sharing one tile
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.a_dtype, self.b_dtype, a_major.sm90_mma_major_mode(), b_major.sm90_mma_major_mode(),
            self.acc_dtype, (mma_wgs, 1, 1), tiler_mn=(64, tile_n))
        # four wgmma k-steps per stage: 64 (16-bit) or 128 (8-bit) elements, 128 bytes a row (one
        # swizzle atom)
        tile_k = cute.size(tiled_mma.shape_mnk, mode=[2]) * 4
        self.tile_mnk = (tile_m, tile_n, tile_k)
        self.stages = self.stages_for(tile_k, self.a_dtype.width, self.c_dtype.width)
        if const_expr(self.stages < 2):
            raise ValueError(f"Sm90Gemm: a {tile_m}x{tile_n}x{tile_k} tile leaves {self.stages} operand stage(s) "
                             f"at occupancy {self.occupancy}; at least 2 are needed")
        # epi_n-column subtiles over the whole tile height (both warp groups' rows); pingpong's
        # warp groups each store their own 64 rows
        epi_tile = (64 if self.pingpong else tile_m, self.epi_n)
        self.epi_tile = epi_tile
        sA_layout = sm90_utils.make_smem_layout_a(a_major, self.tile_mnk, self.a_dtype, self.stages)
        sB_layout = sm90_utils.make_smem_layout_b(b_major, self.tile_mnk, self.b_dtype, self.stages)
        epi_stages = 2 * PINGPONG_EPI_STAGES if self.pingpong else EPI_STAGES
        sC_layout = sm90_utils.make_smem_layout_epi(self.c_dtype, c_major, epi_tile, epi_stages)
        if const_expr(not self.pingpong
                      and cute.cosize(sC_layout) * self.c_dtype.width > cute.cosize(sA_layout) * self.a_dtype.width):
            raise ValueError("Sm90Gemm: the epilogue's subtiles do not fit in A's buffers")

        # A tiles are shared by the cluster's CTAs along N, B tiles along M
        tma_a, mA = self._tma_load(a, sA_layout, (tile_m, tile_k), cluster_n)
        tma_b, mB = self._tma_load(b, sB_layout, (tile_n, tile_k), cluster_m)
        tma_c, mC = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), c,
                                                cute.slice_(sC_layout, (None, None, 0)), epi_tile)

        M, N, L = cute.size(c, mode=[0]), cute.size(c, mode=[1]), cute.size(c, mode=[2])
        cluster_rows = (M + tile_m * cluster_m - 1) // (tile_m * cluster_m)
        cluster_cols = (N + tile_n * cluster_n - 1) // (tile_n * cluster_n)
        if const_expr(self.pingpong):
            @cute.struct
            class PersistentStorage:
                ab_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
                sA: cute.struct.Align[cute.struct.MemRange[self.a_dtype, cute.cosize(sA_layout)], 1024]
                sB: cute.struct.Align[cute.struct.MemRange[self.b_dtype, cute.cosize(sB_layout)], 1024]
                sC: cute.struct.Align[cute.struct.MemRange[self.c_dtype, cute.cosize(sC_layout)], 1024]

            self.shared_storage = PersistentStorage
            # one cluster per (cluster_m x cluster_n) SMs, each walking cluster tiles P apart
            clusters = cutlass.min(cluster_rows * cluster_cols * L, self.sm_count // (cluster_m * cluster_n))
            self.kernel_pingpong(tma_a, mA, tma_b, mB, tma_c, mC, tiled_mma, sA_layout, sB_layout,
                                   sC_layout, cluster_rows, cluster_cols, L).launch(
                grid=(clusters * cluster_m, cluster_n, 1), block=[self.threads, 1, 1],
                cluster=(cluster_m, cluster_n, 1), stream=stream)
        else:
            @cute.struct
            class SharedStorage:
                ab_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
                sA: cute.struct.Align[cute.struct.MemRange[self.a_dtype, cute.cosize(sA_layout)], 1024]
                sB: cute.struct.Align[cute.struct.MemRange[self.b_dtype, cute.cosize(sB_layout)], 1024]

            self.shared_storage = SharedStorage
            grid = (cluster_rows * cluster_m, cluster_cols * cluster_n, L)
            self.kernel(tma_a, mA, tma_b, mB, tma_c, mC, tiled_mma, sA_layout, sB_layout, sC_layout).launch(
                grid=grid, block=[self.threads, 1, 1], cluster=(cluster_m, cluster_n, 1), stream=stream,
                use_pdl=self.pdl)

    @staticmethod
    def _tma_load(t: cute.Tensor, smem_layout_staged, tile: tuple[int, int], multicast: int):
        op = cpasync.CopyBulkTensorTileG2SOp() if multicast == 1 else cpasync.CopyBulkTensorTileG2SMulticastOp()
        return cpasync.make_tiled_tma_atom(op, t, cute.slice_(smem_layout_staged, (None, None, 0)), tile,
                                           num_multicast=multicast)

    @cute.jit
    def tile_coord(self):
        """(m tile, n tile, l) of this CTA: clusters in raster groups of RASTER_GROUP_M along M."""
        cx, cy, _ = cute.arch.cluster_idx()
        ncx, ncy, _ = cute.arch.cluster_dim()
        _, _, l = cute.arch.block_idx()
        m, n = self.raster(cx + cy * ncx, ncx, ncy)
        return m, n, l

    @cute.jit
    def raster(self, linear, ncx, ncy):
        """(m tile, n tile) of this CTA in cluster tile ``linear`` of an ``ncx`` x ``ncy`` grid
        of cluster tiles, walked in groups of RASTER_GROUP_M cluster rows (every column of a
        group before the next group)."""
        per_group = RASTER_GROUP_M * ncy
        group = linear // per_group
        first = group * RASTER_GROUP_M
        rows = cutlass.min(RASTER_GROUP_M, ncx - first)
        within = linear - group * per_group
        in_cluster = cute.arch.block_in_cluster_idx()
        m = (first + within % rows) * self.cluster_mn[0] + in_cluster[0]
        n = (within // rows) * self.cluster_mn[1] + in_cluster[1]
        return m, n

    def shared_ab_pipeline(self, sA_layout, sB_layout, consumers: int):
        """Inside a kernel: the cluster layout, this CTA's coordinate in it, the shared storage,
        and the A + B stage pipeline whose stages ``consumers`` threads (of each multicast
        partner) free; the barriers' init is fenced, and the caller waits on it once its other
        setup is issued (``pipeline_init_wait``)."""
        cluster_layout = cute.make_layout((*self.cluster_mn, 1))
        cluster_coord = cluster_layout.get_flat_coord(cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster()))
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        stage_bytes = (cute.size_in_bytes(self.a_dtype, cute.slice_(sA_layout, (None, None, 0)))
                       + cute.size_in_bytes(self.b_dtype, cute.slice_(sB_layout, (None, None, 0))))
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_barriers.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumers),
            tx_count=stage_bytes, cta_layout_vmnk=cute.make_layout((1, *cluster_layout.shape)),
            enable_multicast_signaling=True, defer_sync=True)
        pipeline_init_arrive(cluster_shape_mn=self.cluster_mn, is_relaxed=True)
        return cluster_layout, cluster_coord, storage, ab_pipe

    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
               tma_c: cute.CopyAtom, mC: cute.Tensor, tiled_mma: cute.TiledMma, sA_layout: cute.ComposedLayout,
               sB_layout: cute.ComposedLayout, sC_layout: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == self.producer_warp:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
        if const_expr(self.pdl):
            # the next kernel may launch now; it waits for this grid's completion itself
            cute.arch.griddepcontrol_launch_dependents()

        m, n, l = self.tile_coord()
        # both consumer warp groups read every stage
        cluster_layout, cluster_coord, storage, ab_pipe = self.shared_ab_pipeline(
            sA_layout, sB_layout, WARP_GROUP * self.consumer_wgs)
        is_clustered = const_expr(cute.size(cluster_layout) > 1)

        sA = storage.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sB = storage.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
        coord = (m, n, None, l)
        gA = cute.local_tile(mA, self.tile_mnk, coord, proj=(1, None, 1))  # (bM, bK, k tiles)
        gB = cute.local_tile(mB, self.tile_mnk, coord, proj=(None, 1, 1))  # (bN, bK, k tiles)
        gC = cute.local_tile(mC, self.tile_mnk, coord, proj=(1, 1, None))  # (bM, bN)
        k_tiles = cute.size(gA, mode=[2])
        pipeline_init_wait(cluster_shape_mn=self.cluster_mn)

        loads = self.load_partitions(tma_a, tma_b, sA, sB, gA, gB, cluster_layout, cluster_coord)
        consume = (ab_pipe, tiled_mma, tma_c, sA, sB, sC_layout, gC, tidx, warp, k_tiles, loads)
        if const_expr(self.inline_producer):
            # every warp consumes (warp 0 also loads): no producer-warp branch in the binary
            self.consume(*consume, is_clustered)
        else:
            if warp >= 4 * self.consumer_wgs:  # the producer warp
                self.load(ab_pipe, loads, k_tiles)
                if const_expr(is_clustered):
                    self.exit_tail(ab_pipe, k_tiles)
            else:
                self.consume(*consume, is_clustered)

    @cute.jit
    def consume(self, ab_pipe, tiled_mma, tma_c, sA, sB, sC_layout, gC, tidx, warp, k_tiles, loads,
                is_clustered: cutlass.Constexpr):
        """A consumer warp group: the MMAs over every k-tile, then its share of the epilogue."""
        if const_expr(self.inline_producer):
            if warp == 0:
                self.load_prologue(ab_pipe, loads, k_tiles)
        acc = self.mma(ab_pipe, tiled_mma, sA, sB, gC, warp, k_tiles, loads)
        barrier_exit = const_expr(is_clustered and self.cluster_exit == "barrier")
        if const_expr(barrier_exit):
            cute.arch.cluster_arrive()
        if const_expr(self.pdl):
            # stores after the previous grid's writes (the loads already waited for it)
            cute.arch.griddepcontrol_wait()
        self.epilogue(acc, tiled_mma, tma_c, sA, sC_layout, gC, tidx, warp)
        if const_expr(barrier_exit):
            cute.arch.cluster_wait()
        if const_expr(is_clustered and not barrier_exit and self.inline_producer):
            if warp == 0:
                self.exit_tail(ab_pipe, k_tiles)

    @cute.jit
    def exit_tail(self, ab_pipe, loads_issued):
        """The producer's last act in a cluster: no CTA of the cluster exits while another may
        still arrive on its barriers. ``loads_issued``: the producer's pipeline position after
        its last load."""
        if const_expr(self.cluster_exit == "barrier"):
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        else:
            # the positions a further stages loads would take: waiting to acquire each means
            # every consumer of every earlier load (remote ones included) has released it
            pos = loads_issued
            ab_pipe.producer_tail(
                pipeline.PipelineState(self.stages, pos, pos % self.stages, (pos // self.stages + 1) % 2))

    @cute.kernel
    def kernel_pingpong(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
                        tma_c: cute.CopyAtom, mC: cute.Tensor, tiled_mma: cute.TiledMma,
                        sA_layout: cute.ComposedLayout, sB_layout: cute.ComposedLayout,
                        sC_layout: cute.ComposedLayout, cluster_rows: cutlass.Int32, cluster_cols: cutlass.Int32,
                        batches: cutlass.Int32):
        """Persistent pingpong: cluster ``c`` of ``P`` takes cluster tiles ``c, c + P, ...``,
        the producer warp loads every tile's k-tiles in order at pipeline positions ``j *
        k_tiles + kt`` for the CTA's j-th tile, and tile j goes to consumer warp group ``j % 2``."""
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == self.producer_warp:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
        # one warp group reads each stage, its 4 warps (x multicast partners) free it
        cluster_layout, cluster_coord, storage, ab_pipe = self.shared_ab_pipeline(sA_layout, sB_layout, WARP_GROUP)
        is_clustered = const_expr(cute.size(cluster_layout) > 1)

        sA = storage.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sB = storage.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
        sC = storage.sC.get_tensor(sC_layout.outer, swizzle=sC_layout.inner)
        k_tiles = cute.ceil_div(cute.size(mA, mode=[1]), self.tile_mnk[2])
        per_batch = cluster_rows * cluster_cols
        cid, _, _ = cute.arch.cluster_idx()
        clusters, _, _ = cute.arch.cluster_dim()
        tiles = (per_batch * batches - cid + clusters - 1) // clusters  # this CTA's tile count
        pipeline_init_wait(cluster_shape_mn=self.cluster_mn)

        if warp == self.producer_warp:
            for j in cutlass.range(tiles, unroll=1):
                linear = cid + j * clusters
                m, n = self.raster(linear % per_batch, cluster_rows, cluster_cols)
                coord = (m, n, None, linear // per_batch)
                gA = cute.local_tile(mA, self.tile_mnk, coord, proj=(1, None, 1))
                gB = cute.local_tile(mB, self.tile_mnk, coord, proj=(None, 1, 1))
                loads = self.load_partitions(tma_a, tma_b, sA, sB, gA, gB, cluster_layout, cluster_coord)
                for kt in cutlass.range(k_tiles, unroll=1):
                    self.load_k_tile(ab_pipe, loads, kt, base=j * k_tiles)
            if const_expr(is_clustered and self.cluster_exit == "producer_tail"):
                self.exit_tail(ab_pipe, tiles * k_tiles)
        else:  # the consumer warp groups
            wg = warp // 4
            # a 64-row tiled MMA, the same for both warp groups
            thr_mma = tiled_mma.get_slice(0)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
            k_blocks = cute.size(tCrA, mode=[2])
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            for j in cutlass.range(wg, tiles, 2, unroll=1):
                linear = cid + j * clusters
                m, n = self.raster(linear % per_batch, cluster_rows, cluster_cols)
                gC = cute.local_tile(mC, self.tile_mnk, (m, n, None, linear // per_batch), proj=(1, 1, None))
                acc = cute.make_rmem_tensor(thr_mma.partition_C(gC).shape, self.acc_dtype)
                acc.fill(0.0)
                if j > 0:
                    # the other warp group has waited for every k-tile of tile j - 1, so the
                    # stages' phase bits this one waits on are those of tile j (not older
                    # ones) -- and the tensor cores take the tiles in order
                    cute.arch.barrier(barrier_id=ORDER_BARRIER + wg, number_of_threads=2 * WARP_GROUP)
                base = j * k_tiles
                read = pipeline.PipelineState(self.stages, base, base % self.stages, (base // self.stages) % 2)
                release = read.clone()
                self.mma_k_tile(ab_pipe, tiled_mma, tCrA, tCrB, acc, read, k_blocks)
                read.advance()
                for _ in cutlass.range(1, k_tiles, unroll=1):
                    self.mma_k_tile(ab_pipe, tiled_mma, tCrA, tCrB, acc, read, k_blocks)
                    warpgroup.wait_group(1)
                    ab_pipe.consumer_release(release)
                    release.advance()
                    read.advance()
                if j + 1 < tiles:
                    cute.arch.barrier_arrive(barrier_id=ORDER_BARRIER + 1 - wg, number_of_threads=2 * WARP_GROUP)
                warpgroup.wait_group(0)
                ab_pipe.consumer_release(release)
                # this warp group's own subtile buffers, store warp and barrier
                self.store_tile(acc, tiled_mma, tma_c, sC, gC, tidx % WARP_GROUP, warp % 4 == 0, WARP_GROUP,
                                PINGPONG_EPI_BARRIER + wg, wg * PINGPONG_EPI_STAGES, PINGPONG_EPI_STAGES)
        if const_expr(is_clustered and self.cluster_exit == "barrier"):
            self.exit_tail(ab_pipe, tiles * k_tiles)

    @cute.jit
    def load_partitions(self, tma_a, tma_b, sA, sB, gA, gB, cluster_layout, cluster_coord):
        """The TMA views of this CTA's share of the A / B k-tiles, and the multicast masks."""
        tAsA, tAgA = cpasync.tma_partition(
            tma_a, cluster_coord[1], cute.make_layout(cute.slice_(cluster_layout, (0, None, 0)).shape),
            cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cpasync.tma_partition(
            tma_b, cluster_coord[0], cute.make_layout(cute.slice_(cluster_layout, (None, 0, 0)).shape),
            cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))
        a_mask = 0
        b_mask = 0
        if const_expr(self.cluster_mn[1] > 1):
            a_mask = cute.make_layout_image_mask(cluster_layout, cluster_coord, mode=1)
        if const_expr(self.cluster_mn[0] > 1):
            b_mask = cute.make_layout_image_mask(cluster_layout, cluster_coord, mode=0)
        return (tma_a, tAgA, tAsA, a_mask), (tma_b, tBgB, tBsB, b_mask)

    @cute.jit
    def tma_load(self, atom, src, dst, bar, mask, hint: cutlass.Constexpr):
        """One TMA load of an operand k-tile, with the operand's L2 cache hint if it has one."""
        if const_expr(hint is None):
            cute.copy(atom, src, dst, tma_bar_ptr=bar, mcast_mask=mask)
        else:
            cute.copy(atom, src, dst, tma_bar_ptr=bar, mcast_mask=mask, cache_policy=cutlass.Int64(L2_HINTS[hint]))

    @cute.jit
    def load_k_tile(self, ab_pipe, loads, kt, operands: cutlass.Constexpr = "ab", acquire: cutlass.Constexpr = True,
                    base=None):
        """Issue k-tile ``kt``'s loads into stage ``kt % stages`` (after its buffer is free).

        The producer's pipeline position is a function of ``kt`` (phase bit 1 on the first pass),
        so no state is carried between calls. A persistent CTA passes ``base``, the k-tiles
        of its earlier tiles: the position is then ``base + kt``."""
        pos = kt if const_expr(base is None) else base + kt
        state = pipeline.PipelineState(self.stages, pos, pos % self.stages, (pos // self.stages + 1) % 2)
        if const_expr(acquire):
            ab_pipe.producer_acquire(state)
        bar = ab_pipe.producer_get_barrier(state)
        for name, (atom, tXgX, tXsX, mask), hint in zip("ab", loads, self.l2_hints):
            if const_expr(name in operands):
                self.tma_load(atom, tXgX[(None, kt)], tXsX[(None, state.index)], bar, mask, hint)

    @cute.jit
    def load_prologue(self, ab_pipe, loads, k_tiles):
        """The first ``min(stages, k_tiles)`` k-tiles. Under PDL the early operand's (weights:
        not written by the previous kernel) load before the grid-dependency wait, the late
        one's after it; the full barriers expect both, so the consumers see whole stages."""
        first = cutlass.min(self.stages, k_tiles)
        if const_expr(self.pdl):
            early, late = ("a", "b") if self.pdl_early_a else ("b", "a")
            for kt in cutlass.range(first, unroll=1):
                self.load_k_tile(ab_pipe, loads, kt, early)
            cute.arch.griddepcontrol_wait()
            for kt in cutlass.range(first, unroll=1):
                self.load_k_tile(ab_pipe, loads, kt, late, acquire=False)
        else:
            for kt in cutlass.range(first, unroll=1):
                self.load_k_tile(ab_pipe, loads, kt)
        return first

    @cute.jit
    def load(self, ab_pipe, loads, k_tiles):
        """The producer warp: every k-tile into the stage buffers, as the consumers free them."""
        first = self.load_prologue(ab_pipe, loads, k_tiles)
        for kt in cutlass.range(first, k_tiles, unroll=1):
            self.load_k_tile(ab_pipe, loads, kt)

    @cute.jit
    def mma(self, ab_pipe, tiled_mma, sA, sB, gC, warp, k_tiles, loads):
        """A consumer warp group: its 64 rows of the tile, accumulated over every k-tile (and,
        with ``inline_producer``, warp 0 loading k-tile ``k + stages`` once stage ``k`` is free,
        after the prologue's stages it loaded in :meth:`consume`)."""
        tCrA, tCrB, acc, k_blocks = self.mma_fragments(tiled_mma, sA, sB, gC, warp)
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        release = read.clone()

        # first k-tile: overwrite the (uninitialised) accumulators
        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
        self.mma_k_tile(ab_pipe, tiled_mma, tCrA, tCrB, acc, read, k_blocks, first=True)
        read.advance()
        for _ in cutlass.range(1, k_tiles, unroll=1):
            self.mma_k_tile(ab_pipe, tiled_mma, tCrA, tCrB, acc, read, k_blocks)
            # the previous batch has retired once at most this one is in flight: free its stage
            warpgroup.wait_group(1)
            ab_pipe.consumer_release(release)
            self.refill(ab_pipe, loads, warp, release.count, k_tiles)
            release.advance()
            read.advance()
        warpgroup.wait_group(0)
        ab_pipe.consumer_release(release)
        return acc

    def mma_fragments(self, tiled_mma, sA, sB, gC, warp):
        """Warp group ``warp // 4``'s wgmma operand fragments of the stage buffers, its
        (uninitialised) accumulator of tile ``gC``, and the wgmma k-steps per stage."""
        thr_mma = tiled_mma.get_slice(warp // 4 * WARP_GROUP)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        acc = cute.make_rmem_tensor(thr_mma.partition_C(gC).shape, self.acc_dtype)
        return tCrA, tCrB, acc, cute.size(tCrA, mode=[2])

    @cute.jit
    def refill(self, ab_pipe, loads, warp, freed, k_tiles):
        """With ``inline_producer``: warp 0 loads k-tile ``freed + stages`` into the stage that
        k-tile ``freed`` has just vacated, if that k-tile exists; nothing otherwise."""
        if const_expr(self.inline_producer):
            if warp == 0 and freed + self.stages < k_tiles:
                self.load_k_tile(ab_pipe, loads, freed + self.stages)

    @cute.jit
    def mma_k_tile(self, ab_pipe, tiled_mma, tCrA, tCrB, acc, read, k_blocks: cutlass.Constexpr,
                   first: cutlass.Constexpr = False):
        """One k-tile's wgmma batch of a consumer warp group: wait for stage ``read``, issue its
        ``k_blocks`` k-steps into ``acc``, commit. ``first``: the caller cleared ACCUMULATE,
        so the first k-step overwrites ``acc``; the rest accumulate."""
        ab_pipe.consumer_wait(read)
        warpgroup.fence()
        for kb in cutlass.range_constexpr(k_blocks):
            cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, read.index)], tCrB[(None, None, kb, read.index)], acc)
            if const_expr(first):
                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.jit
    def epilogue(self, acc, tiled_mma, tma_c, sA, sC_layout, gC, tidx, warp):
        """The cooperative epilogue: both warp groups' rows, through subtiles in A's buffers."""
        consumers = WARP_GROUP * self.consumer_wgs
        # every consumer warp group's wgmmas have read A's buffers before they are overwritten
        cute.arch.barrier(barrier_id=1, number_of_threads=consumers)
        sC = cute.make_tensor(cute.recast_ptr(sA.iterator, sC_layout.inner, dtype=self.c_dtype), sC_layout.outer)
        self.store_tile(acc, tiled_mma, tma_c, sC, gC, tidx, warp == 0, consumers, 1, 0, EPI_STAGES)

    @cute.jit
    def store_tile(self, acc, tiled_mma, tma_c, sC, gC, tidx, store_warp, consumers: cutlass.Constexpr,
                   barrier_id, buf0, bufs: cutlass.Constexpr):
        """Accumulators -> C's type -> ``epi_n``-column shared subtiles (buffers ``buf0 ..
        buf0 + bufs - 1`` of ``sC``) -> TMA stores issued by ``store_warp``; ``consumers``
        threads (``tidx`` among them) meet at named barrier ``barrier_id``."""
        c_major = self.c_major
        stmatrix = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(c_major.is_m_major_c(), 4), self.c_dtype)
        r2s = cute.make_tiled_copy_S(sm90_utils.sm90_get_smem_store_op(c_major, self.c_dtype, self.acc_dtype),
                                     cute.make_tiled_copy_C_atom(stmatrix, tiled_mma))
        thr_r2s = r2s.get_slice(tidx)
        tRS_sC = thr_r2s.partition_D(sC)  # (R2S, R2S_M, R2S_N, stage)
        tRS_acc = r2s.retile(acc)
        rC_layout = cute.make_layout(cute.shape(thr_r2s.partition_S(sC))[:3])
        rC = cute.make_rmem_tensor_like(rC_layout, self.acc_dtype)
        per_subtile = cute.size(rC)

        gC_epi = cute.zipped_divide(gC, self.epi_tile)  # ((epi tile), (subtiles M, subtiles N))
        bSG_sC, bSG_gC = cpasync.tma_partition(tma_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), gC_epi)
        subtiles = cute.size(gC_epi, mode=[1])
        subtile_grid = cute.make_layout(gC_epi.shape[1], stride=(gC_epi.shape[1][1], 1))
        store_pipe = pipeline.PipelineTmaStore.create(
            num_stages=bufs, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumers))
        for s in cutlass.range_constexpr(subtiles):
            for v in cutlass.range_constexpr(per_subtile):
                rC[v] = tRS_acc[s * per_subtile + v]
            rC_out = cute.make_rmem_tensor_like(rC_layout, self.c_dtype)
            rC_out.store(rC.load().to(self.c_dtype))
            buf = buf0 + s % bufs
            cute.copy(r2s, rC_out, tRS_sC[(None, None, None, buf)])
            # the generic-proxy smem writes become visible to TMA, then one warp stores
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=barrier_id, number_of_threads=consumers)
            reuse = s + 1 < subtiles and s + 1 >= bufs  # the next subtile reuses a buffer
            if store_warp:
                cute.copy(tma_c, bSG_sC[(None, buf)], bSG_gC[(None, subtile_grid.get_hier_coord(s))])
                store_pipe.producer_commit()
                if const_expr(reuse):
                    # the store bufs - 1 subtiles back has read its buffer: free to rewrite
                    store_pipe.producer_acquire()
            if const_expr(reuse):
                cute.arch.barrier(barrier_id=barrier_id, number_of_threads=consumers)
        if store_warp:
            # every store has read its buffer: the next tile's epilogue may rewrite them
            store_pipe.producer_tail()
