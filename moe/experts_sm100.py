"""MXFP8 routed-expert GEMM, Blackwell path (sm_100a): ``out[r] = A[r] @ W[expert(r)]^T``.

``A [rows, K]`` e4m3 holds the routed inputs in the router's expert-sorted order, padded so
each 128-row tile belongs to one expert (:func:`moe.quant.mxfp8_quantize_routed`), with its
UE8M0 scales (one per 32 K-elements) in the tcgen05 block-scale layout; ``W [E, N, K]`` e4m3
with per-expert scales in the same layout; ``tile_expert[j]`` (the router's) names the expert
of 128-row tile ``j``, or -1 past the routed total. bf16 ``out [rows, N]``, or with
``silu_quant`` the fused gate/up epilogue: ``h = bf16(bf16(silu(g)) * u)`` over the
interleaved gate/up columns (:func:`moe.experts.interleave_gate_up`) quantised to MXFP8
(``q [rows, N/2]`` e4m3 + swizzled scales) -- no C at all.

Kernel: one CTA per (128-row tile, ``tile_n`` columns); because a tile holds one expert's rows,
the expert is a batch coordinate -- W and its scales are 3-D TMA tensors indexed by the
tile's expert, A and its scales 2-D: no per-expert descriptors, no host sync (graph
capturable). Tiles whose ``tile_expert`` is -1 exit at once. Six warps, one role each:

- warp 5 (TMA): per 128-wide k-tile, A (128 x 128), W (tile_n x 128) and both scale tiles into
  one shared-memory stage (``PipelineTmaUmma``: full barrier counted in bytes);
- warp 4 (MMA): per k-tile, ``tcgen05.cp`` of the stage's scales into tensor memory, then
  ``tcgen05.mma.block_scale`` (kind::mxf8f6f4, 4 K-steps of 32 -- one scale block each) into
  the FP32 accumulator in tensor memory; ``tcgen05.commit`` frees the stage (the copies and
  MMAs of one thread execute in issue order, so the next k-tile's scale copy may overwrite
  the scale columns the previous MMAs read); a final commit hands the accumulator over;
- warps 0-3 (epilogue): per 32-column subtile a ``tcgen05.ld`` (thread = row), then either
  bf16 -> shared subtile -> TMA store, or, fused, subtile 2f stashed (bf16-rounded: the
  unfused path's rounding point) and subtile 2f + 1 completing feature block f of the row:
  SiLU * up, one MXFP8 block and its scale byte, stored directly.

Written for this project from the public CuTe DSL API (``cutlass.utils.blockscaled_layout``,
``cutlass.utils.blackwell_helpers``, ``cutlass.pipeline``); the warp roles and the bf16
epilogue (``store_tmem_acc``) are those of the project's :mod:`cute_kernels.gemm.sm100_gemm`.

It cannot run here (no Blackwell GPU): CI compiles it for sm_100a and checks the machine code
(``UTCQMMA`` with ``UTCCP`` scale copies to tensor memory, ``UTMALDG``; ``pytest
tests/test_moe_experts.py -k machine_code``), and ``tests/test_moe_experts.py`` evaluates the
kernel's own layout objects on the CPU (each CTA's A / W / C footprint per router tile, the
fused epilogue's row and gate / up columns per thread) and checks that the scale layout the kernel reads (CuTe's ``tile_atom_to_shape_SF``, evaluated on the
host) is byte for byte the layout :mod:`moe.quant` writes, the fused epilogue's subtile
pairing against the unfused rounding points, and the block-scaled math against an FP64
dequantised reference.

Constraints: ``K % 128 == 0`` (the k-tile is 4 scale blocks), ``N % tile_n == 0`` with
``tile_n`` 128 or 256 (the scale tile of W is 128 rows), ``N % 64 == 0`` for ``silu_quant``;
E static (one compile per ``(E, N, K)``), rows runtime.
"""

from __future__ import annotations

import os

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.blockscaled_layout as blockscaled_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05
from cutlass.pipeline import pipeline_init_wait
from cutlass.tensor_utils import LayoutEnum

from cute_kernels import jit
# the warp roles, named barriers and the bf16 epilogue are those of the project's dense engine
from cute_kernels.gemm.sm100_gemm import (EPI_BARRIER, EPI_STAGES, EPILOGUE_WARPS, MMA_WARP, SMEM_PER_CTA_MAX,
                                          THREADS, TMA_WARP, make_pipelines, store_tmem_acc, tmem_subtiles)
from cute_kernels.tma_pipeline import tma_tiles

MX_BLOCK = 32
TILE_M = 128


class MoeExpertGemmSm100:
    """Compile-time configuration: experts, N, K, the CTA's column tile, fused SiLU/MXFP8."""

    def __init__(self, E: int, N: int, K: int, tile_n: int = 128, silu_quant: bool = False,
                 swiglu_limit: float | None = None):
        if not self.can_implement(E, N, K, tile_n, silu_quant):
            raise ValueError(f"MoeExpertGemmSm100: unsupported E={E}, N={N}, K={K}, tile_n={tile_n}, "
                             f"silu_quant={silu_quant} (K % 128, N % tile_n, tile_n 128 or 256, N % 64 fused)")
        self.E, self.N, self.K, self.tile_n, self.silu_quant = E, N, K, tile_n, silu_quant
        self.swiglu_limit = swiglu_limit  # the fused epilogue's clamp of gate / up (None: none)
        self.acc_dtype = Float32
        self.ab_dtype, self.sf_dtype, self.c_dtype = cutlass.Float8E4M3FN, cutlass.Float8E8M0FNU, cutlass.BFloat16

    @staticmethod
    def can_implement(E: int, N: int, K: int, tile_n: int = 128, silu_quant: bool = False) -> bool:
        return (1 <= E <= 1024 and K % 128 == 0 and K > 0 and N > 0 and tile_n in (128, 256) and N % tile_n == 0
                and (not silu_quant or N % 64 == 0))

    @cute.jit
    def __call__(self, a_ptr: cute.Pointer, w_ptr: cute.Pointer, sfa_ptr: cute.Pointer, sfw_ptr: cute.Pointer,
                 out_ptr: cute.Pointer, tile_expert_ptr: cute.Pointer, q_ptr: cute.Pointer, sq_ptr: cute.Pointer,
                 rows: Int32, stream: cuda.CUstream):
        N = self.N
        mA_full, mW_full, c = self.operand_views(a_ptr, w_ptr, out_ptr, rows)
        # the scales in tcgen05's 128 x 4 atoms, exactly as moe.quant writes them (swizzled):
        # per expert, ceil(N / 128) * ceil(K / 128) atoms of 512 bytes
        sfa = cute.make_tensor(sfa_ptr, blockscaled_utils.tile_atom_to_shape_SF(mA_full.shape, MX_BLOCK))
        sfw = cute.make_tensor(sfw_ptr, blockscaled_utils.tile_atom_to_shape_SF(mW_full.shape, MX_BLOCK))
        tile_expert = cute.make_tensor(tile_expert_ptr, cute.make_layout(((rows + TILE_M - 1) // TILE_M,)))

        tiled_mma = self.configure()

        sA_one = sm100_utils.make_smem_layout_a(tiled_mma, self.mma_tiler, self.ab_dtype, 1)
        sB_one = sm100_utils.make_smem_layout_b(tiled_mma, self.mma_tiler, self.ab_dtype, 1)
        sSFA_one = blockscaled_utils.make_smem_layout_sfa(tiled_mma, self.mma_tiler, MX_BLOCK, 1)
        sSFB_one = blockscaled_utils.make_smem_layout_sfb(tiled_mma, self.mma_tiler, MX_BLOCK, 1)
        sC_layout = sm100_utils.make_smem_layout_epi(self.c_dtype, self.c_major, self.epi_tile, EPI_STAGES)
        self.tx_bytes = (cute.size_in_bytes(self.ab_dtype, sA_one) + cute.size_in_bytes(self.ab_dtype, sB_one)
                         + cute.size_in_bytes(self.sf_dtype, sSFA_one) + cute.size_in_bytes(self.sf_dtype, sSFB_one))
        epi_bytes = 0 if self.silu_quant else cute.size_in_bytes(self.c_dtype, sC_layout)
        # less the epilogue buffers, and 2 KiB for barriers and the scale buffers' alignment
        self.stages = (SMEM_PER_CTA_MAX - 2048 - epi_bytes) // self.tx_bytes
        sA_layout = sm100_utils.make_smem_layout_a(tiled_mma, self.mma_tiler, self.ab_dtype, self.stages)
        sB_layout = sm100_utils.make_smem_layout_b(tiled_mma, self.mma_tiler, self.ab_dtype, self.stages)
        sSFA_layout = blockscaled_utils.make_smem_layout_sfa(tiled_mma, self.mma_tiler, MX_BLOCK, self.stages)
        sSFB_layout = blockscaled_utils.make_smem_layout_sfb(tiled_mma, self.mma_tiler, MX_BLOCK, self.stages)

        one_cta = cute.make_layout((1, 1, 1, 1))
        g2s = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        tma_a, mA = cute.nvgpu.make_tiled_tma_atom_A(g2s, mA_full, cute.slice_(sA_layout, (None, None, None, 0)),
                                                     self.mma_tiler, tiled_mma, one_cta.shape)
        tma_b, mB = cute.nvgpu.make_tiled_tma_atom_B(g2s, mW_full, cute.slice_(sB_layout, (None, None, None, 0)),
                                                     self.mma_tiler, tiled_mma, one_cta.shape)
        # scale tiles move as 16-bit elements (TMA has no 8-bit-float element type of its own)
        tma_sfa, mSFA = cute.nvgpu.make_tiled_tma_atom_A(g2s, sfa, cute.slice_(sSFA_layout, (None, None, None, 0)),
                                                         self.mma_tiler, tiled_mma, one_cta.shape,
                                                         internal_type=cutlass.Int16)
        tma_sfb, mSFB = cute.nvgpu.make_tiled_tma_atom_B(g2s, sfw, cute.slice_(sSFB_layout, (None, None, None, 0)),
                                                         self.mma_tiler, tiled_mma, one_cta.shape,
                                                         internal_type=cutlass.Int16)
        if const_expr(self.silu_quant):
            I = N // 2
            mQ = cute.make_tensor(q_ptr, cute.make_layout((rows, I), stride=(I, 1)))
            rows_pad = (rows + TILE_M - 1) // TILE_M * TILE_M
            mSQ = cute.make_tensor(sq_ptr, cute.make_layout((rows_pad * ((I // MX_BLOCK + 3) // 4 * 4),)))
            tma_c, mC = None, None
        else:
            mQ, mSQ = None, None
            tma_c, mC = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), c,
                                                    cute.slice_(sC_layout, (None, None, 0)), self.epi_tile)

        # accumulator columns, then the scale columns of A (128 rows / 32 x 4 K-steps) and W
        # (FP32 accumulator: one column per output column; scales: 4 columns per 32 rows of A or W)
        self.acc_cols = self.tile_n
        self.sfa_cols = TILE_M // 32 * 4
        self.sfb_cols = self.tile_n // 32 * 4
        # tensor memory is allocated in powers of two columns
        self.tmem_cols = 1 << (self.acc_cols + self.sfa_cols + self.sfb_cols - 1).bit_length()

        self.kernel(tiled_mma, tma_a, mA, tma_b, mB, tma_sfa, mSFA, tma_sfb, mSFB, tma_c, mC, mQ, mSQ, tile_expert,
                    sA_layout, sB_layout, sSFA_layout, sSFB_layout, sC_layout, self.epi_tile).launch(
            grid=self.grid(rows), block=[THREADS, 1, 1], cluster=(1, 1, 1), stream=stream)

    def operand_views(self, a_ptr, w_ptr, out_ptr, rows):
        """(M, K, L) / (N, K, L) / (M, N, L) views of A, W and the bf16 output: A and C one
        batch, W batched by expert."""
        E, N, K = self.E, self.N, self.K
        return (cute.make_tensor(a_ptr, cute.make_layout((rows, K, 1), stride=(K, 1, rows * K))),
                cute.make_tensor(w_ptr, cute.make_layout((N, K, E), stride=(K, 1, N * K))),
                cute.make_tensor(out_ptr, cute.make_layout((rows, N, 1), stride=(N, 1, rows * N))))

    def configure(self) -> cute.TiledMma:
        """The block-scaled tiled MMA (returned) and the MMA / epilogue tiles. Also called by the
        CPU evaluation of this kernel's layouts (tests/test_moe_experts.py)."""
        k_major = OperandMajorMode.K
        tiled_mma = sm100_utils.make_blockscaled_trivial_tiled_mma(
            self.ab_dtype, k_major, k_major, self.sf_dtype, MX_BLOCK, tcgen05.CtaGroup.ONE, (TILE_M, self.tile_n))
        # four MMA K-steps (32 e4m3 = one scale block each) per stage: 128-byte rows
        self.mma_tiler = (TILE_M, self.tile_n, cute.size(tiled_mma.shape_mnk, mode=[2]) * 4)
        self.c_major = LayoutEnum.ROW_MAJOR
        self.epi_tile = sm100_utils.compute_epilogue_tile_shape(self.mma_tiler, False, self.c_major, self.c_dtype)
        return tiled_mma

    def grid(self, rows):
        """One CTA per (128-row tile, tile_n columns)."""
        return ((rows + TILE_M - 1) // TILE_M, self.N // self.tile_n, 1)

    def partition_gmem(self, tiled_mma: cute.TiledMma, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor | None = None):
        """The MMA views of A / W (or their scales), every tile kept as a mode: (MMA, MMA_M|N,
        MMA_K, RestM|N, RestK, RestL); and of C (MMA, MMA_M, MMA_N, RestM, RestN, RestL) when given."""
        thr_mma = tiled_mma.get_slice(0)
        tCgA = thr_mma.partition_A(cute.local_tile(mA, cute.slice_(self.mma_tiler, (None, 0, None)), (None,) * 3))
        tCgB = thr_mma.partition_B(cute.local_tile(mB, cute.slice_(self.mma_tiler, (0, None, None)), (None,) * 3))
        if const_expr(mC is None):
            return tCgA, tCgB
        return tCgA, tCgB, thr_mma.partition_C(cute.local_tile(mC, cute.slice_(self.mma_tiler, (None, None, 0)),
                                                               (None,) * 3))

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom,
               mB: cute.Tensor, tma_sfa: cute.CopyAtom, mSFA: cute.Tensor, tma_sfb: cute.CopyAtom, mSFB: cute.Tensor,
               tma_c, mC, mQ, mSQ, tile_expert: cute.Tensor, sA_layout: cute.ComposedLayout,
               sB_layout: cute.ComposedLayout, sSFA_layout: cute.Layout, sSFB_layout: cute.Layout,
               sC_layout: cute.ComposedLayout, epi_tile: cute.Tile):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        m_tile, n_tile, _ = cute.arch.block_idx()
        expert = tile_expert[m_tile]
        if expert >= 0:  # the tiles past the router's total hold no rows
            if warp == TMA_WARP:
                for atom in (tma_a, tma_b, tma_sfa, tma_sfb):
                    cpasync.prefetch_descriptor(atom)

            @cute.struct
            class SharedStorage:
                ab_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
                acc_barriers: cute.struct.MemRange[cutlass.Int64, 2]
                tmem_address: cutlass.Int32

            smem = cutlass.memory.SmemAllocator()
            storage = smem.allocate(SharedStorage)
            one_cta = cute.make_layout((1, 1, 1, 1))
            ab_producer, ab_consumer, acc_pipe, tmem = make_pipelines(storage, self.stages, self.tx_bytes, one_cta, 1)

            sC = None
            if const_expr(not self.silu_quant):
                sC = smem.allocate_tensor(element_type=self.c_dtype, layout=sC_layout.outer, byte_alignment=128,
                                          swizzle=sC_layout.inner)
            sA = smem.allocate_tensor(element_type=self.ab_dtype, layout=sA_layout.outer, byte_alignment=1024,
                                      swizzle=sA_layout.inner)
            sB = smem.allocate_tensor(element_type=self.ab_dtype, layout=sB_layout.outer, byte_alignment=1024,
                                      swizzle=sB_layout.inner)
            sSFA = smem.allocate_tensor(element_type=self.sf_dtype, layout=sSFA_layout, byte_alignment=128)
            sSFB = smem.allocate_tensor(element_type=self.sf_dtype, layout=sSFB_layout, byte_alignment=128)

            tCgA, tCgB = self.partition_gmem(tiled_mma, mA, mB)
            tCgSFA, tCgSFB = self.partition_gmem(tiled_mma, mSFA, mSFB)
            k_tiles = cute.size(tCgA, mode=[4])
            tCtAcc_layout = tiled_mma.make_fragment_C(tiled_mma.partition_shape_C(self.mma_tiler[:2])).layout
            pipeline_init_wait(cluster_shape_mn=one_cta)

            if warp == TMA_WARP:
                loads = []
                # A and its scales: (this M tile, batch 0); W and its scales: (this N tile, the expert)
                for atom, tCgX, sX, mn, l in ((tma_a, tCgA, sA, m_tile, 0), (tma_b, tCgB, sB, n_tile, expert),
                                              (tma_sfa, tCgSFA, sSFA, m_tile, 0),
                                              (tma_sfb, tCgSFB, sSFB, n_tile, expert)):
                    tXsX, tXgX = tma_tiles(atom, sX, tCgX, tile_modes=3)
                    loads.append((atom, tXgX[(None, mn, None, l)], tXsX))
                for k in cutlass.range(k_tiles, unroll=1):
                    stage = ab_producer.acquire_and_advance()
                    for load in loads:
                        cute.copy(load[0], load[1][(None, k)], load[2][(None, stage.index)], tma_bar_ptr=stage.barrier)
                ab_producer.tail()
            if warp == MMA_WARP:
                tmem.wait_for_alloc()
                acc_ptr = tmem.retrieve_ptr(self.acc_dtype)
                self.mma(ab_consumer, acc_pipe, tiled_mma, sA, sB, sSFA, sSFB, acc_ptr, tCtAcc_layout,
                         sSFA_layout, sSFB_layout, k_tiles)
            if warp < EPILOGUE_WARPS:
                tmem.allocate(self.tmem_cols)
                tmem.wait_for_alloc()
                acc_ptr = tmem.retrieve_ptr(self.acc_dtype)
                tmem.relinquish_alloc_permit()
                acc_pipe.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))
                tCtAcc = cute.make_tensor(acc_ptr, tCtAcc_layout)
                if const_expr(self.silu_quant):
                    self.epilogue_silu_quant(tCtAcc, mQ, mSQ, epi_tile, m_tile, n_tile, tidx)
                else:
                    _, _, tCgC = self.partition_gmem(tiled_mma, mA, mB, mC)
                    store_tmem_acc(tma_c, tCtAcc, sC, tCgC, epi_tile, (m_tile, n_tile, 0), tidx, warp,
                                   self.t2r_atom(epi_tile), self.c_major, self.c_dtype, self.acc_dtype)
                # every epilogue warp's tensor-memory loads are done before warp 0 frees the columns
                cute.arch.barrier(barrier_id=EPI_BARRIER, number_of_threads=32 * EPILOGUE_WARPS)
                tmem.free(acc_ptr)

    @cute.jit
    def mma(self, ab_consumer, acc_pipe, tiled_mma, sA, sB, sSFA, sSFB, acc_ptr, tCtAcc_layout, sSFA_layout,
            sSFB_layout, k_tiles):
        """The MMA warp: per k-tile the scale copies to tensor memory and the block-scaled MMAs,
        then one commit for the epilogue."""
        tCtAcc = cute.make_tensor(acc_ptr, tCtAcc_layout)
        # the scale factors' tensor-memory columns follow the accumulator's
        sfa_ptr = cute.recast_ptr(acc_ptr + self.acc_cols, dtype=self.sf_dtype)
        sfb_ptr = cute.recast_ptr(acc_ptr + self.acc_cols + self.sfa_cols, dtype=self.sf_dtype)
        tCtSFA = cute.make_tensor(sfa_ptr, blockscaled_utils.make_tmem_layout_sfa(
            tiled_mma, self.mma_tiler, MX_BLOCK, cute.slice_(sSFA_layout, (None, None, None, 0))))
        tCtSFB = cute.make_tensor(sfb_ptr, blockscaled_utils.make_tmem_layout_sfb(
            tiled_mma, self.mma_tiler, MX_BLOCK, cute.slice_(sSFB_layout, (None, None, None, 0))))
        s2t_a, tCsSFA_s2t, tCtSFA_s2t = self.scale_copy(sSFA, tCtSFA)
        s2t_b, tCsSFB_s2t, tCtSFB_s2t = self.scale_copy(sSFB, tCtSFB)
        tCrA = tiled_mma.make_fragment_A(sA)
        tCrB = tiled_mma.make_fragment_B(sB)
        for k in cutlass.range(k_tiles, unroll=1):
            stage = ab_consumer.wait_and_advance()
            cute.copy(s2t_a, tCsSFA_s2t[(None, None, None, None, stage.index)], tCtSFA_s2t)
            cute.copy(s2t_b, tCsSFB_s2t[(None, None, None, None, stage.index)], tCtSFB_s2t)
            # the first k-tile overwrites the (uninitialised) accumulator
            tiled_mma.set(tcgen05.Field.ACCUMULATE, k != 0)
            crd = (None, None, None, stage.index)
            cute.gemm(tiled_mma, tCtAcc, [tCrA[crd], tCtSFA], [tCrB[crd], tCtSFB], tCtAcc)
            # tcgen05.commit: the stage is free once these MMAs (and scale copies) have read it
            stage.release()
        acc_pipe.producer_commit(pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1))

    @cute.jit
    def scale_copy(self, sSF: cute.Tensor, tSF: cute.Tensor):
        """``tcgen05.cp`` (4 x 32 lanes x 128 bits) of one stage's scale tile into its
        tensor-memory columns: the tiled copy, the staged shared-memory descriptors and the
        tensor-memory destination."""
        tCsSF = cute.filter_zeros(sSF)
        tCtSF = cute.filter_zeros(tSF)
        s2t = tcgen05.make_s2t_copy(cute.make_copy_atom(tcgen05.Cp4x32x128bOp(tcgen05.CtaGroup.ONE), self.sf_dtype),
                                    tCtSF)
        thr = s2t.get_slice(0)
        return s2t, tcgen05.get_s2t_smem_desc_tensor(s2t, thr.partition_S(tCsSF)), thr.partition_D(tCtSF)

    def t2r_atom(self, epi_tile):
        """The 32x32b tensor-memory load of a 32-column subtile: thread t holds row t."""
        return sm100_utils.get_tmem_load_op(self.mma_tiler, self.c_major, self.c_dtype, self.acc_dtype, epi_tile, False)

    def subtile_coords(self, thr_t2r, epi_tile) -> cute.Tensor:
        """The (row, column) in the MMA tile of each value thread ``thr_t2r`` loads from tensor
        memory: (T2R, T2R_M, T2R_N, subtile)."""
        tTR_cC = thr_t2r.partition_D(cute.flat_divide(cute.make_identity_tensor(self.mma_tiler[:2]), epi_tile))
        return cute.group_modes(tTR_cC, 3, cute.rank(tTR_cC))

    @cute.jit
    def epilogue_silu_quant(self, tCtAcc, mQ, mSQ, epi_tile, m_tile, n_tile, tidx):
        """Subtiles 2f and 2f + 1 are the gate and up columns of features 32f .. 32f + 31 of
        this tile (the weights are interleaved by 32); each thread holds one row of each. The
        gate subtile is stashed bf16-rounded; the up subtile completes the row's block:
        h = bf16(bf16(silu(g)) * u), one MXFP8 block and its swizzled scale byte."""
        from cute_kernels.mx_scales import swizzled_scale_byte
        from moe.experts_tiled_sm90 import MX, silu_mul_mx_block

        t2r, thr_t2r, tTR_tAcc = tmem_subtiles(tCtAcc, epi_tile, self.t2r_atom(epi_tile), tidx)
        tTR_cC = self.subtile_coords(thr_t2r, epi_tile)
        tTR_rAcc = cute.make_rmem_tensor(tTR_cC[(None, None, None, 0)].shape, self.acc_dtype)
        if const_expr(cute.size(tTR_rAcc) != MX or cute.size(epi_tile[1]) != MX):
            raise NotImplementedError(f"the fused SiLU/MXFP8 epilogue needs 32-column subtiles held one row per "
                                      f"thread, got {cute.size(tTR_rAcc)} values per thread")
        rG = cute.make_rmem_tensor(cute.make_layout((MX,)), Float32)
        rU = cute.make_rmem_tensor(cute.make_layout((MX,)), Float32)
        rQ = cute.make_rmem_tensor(cute.make_layout((MX,)), cutlass.Float8E4M3FN)
        rows = cute.size(mQ, mode=[0])
        ncb = (cute.size(mQ, mode=[1]) // MX + 3) // 4
        for f in cutlass.range(cute.size(tTR_tAcc.shape, mode=[3]) // 2):
            cute.copy(t2r, tTR_tAcc[(None, None, None, 2 * f)], tTR_rAcc)
            for j in cutlass.range_constexpr(MX):
                rG[j] = Float32(tTR_rAcc[j].to(cutlass.BFloat16))  # the unfused GEMM's bf16 output
            cute.copy(t2r, tTR_tAcc[(None, None, None, 2 * f + 1)], tTR_rAcc)
            for j in cutlass.range_constexpr(MX):
                rU[j] = Float32(tTR_rAcc[j].to(cutlass.BFloat16))
            m, n = tTR_cC[(None, None, None, 2 * f)][0]
            r = m_tile * TILE_M + m
            if r < rows:
                scale = silu_mul_mx_block(rG, rU, rQ, self.swiglu_limit)
                fb = (n_tile * self.tile_n + n) // (2 * MX)  # output scale block = feature block
                cute.autovec_copy(rQ, cute.zipped_divide(mQ, (1, MX))[(0, None), (r, fb)])
                mSQ[swizzled_scale_byte(r, fb, ncb)] = cutlass.Uint8(scale)


def _build(arch: str, *, E: int, N: int, K: int, tile_n: int = 128, silu_quant: bool = False,
           swiglu_limit: float | None = None):
    from moe.experts_tiled_sm90 import check_swiglu_limit

    check_swiglu_limit("moe_expert_gemm_sm100", swiglu_limit, silu_quant)
    if not MoeExpertGemmSm100.can_implement(E, N, K, tile_n, silu_quant):
        raise ValueError(f"moe_expert_gemm_sm100: unsupported E={E}, N={N}, K={K}, tile_n={tile_n}, silu_quant={silu_quant} "
                         f"(K % 128, N % tile_n, tile_n 128 or 256, N % 64 with the fused SiLU)")
    P = jit.fake_gmem_ptr
    f8, sf = cutlass.Float8E4M3FN, cutlass.Float8E8M0FNU
    args = (P(f8, 16), P(f8, 16), P(sf, 16), P(sf, 16), P(cutlass.BFloat16, 16), P(Int32, 4), P(f8, 16),
            P(cutlass.Uint8, 1), Int32(128), jit.fake_stream())
    return MoeExpertGemmSm100(E, N, K, tile_n, silu_quant, swiglu_limit), args


KERNEL = jit.register(jit.KernelDef(
    name="moe_expert_gemm_sm100",
    build=_build,
    sources=(os.path.abspath(__file__),
             os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "cute_kernels", "gemm", "sm100_gemm.py"),
             os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "cute_kernels", "mx_scales.py"),
             # its fused epilogue's SiLU * up + MXFP8 block
             os.path.join(os.path.dirname(os.path.abspath(__file__)), "experts_tiled_sm90.py"),
             os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "cute_kernels", "tma_pipeline.py")),
    archs=("sm_100a",),
    # DeepSeek-like: gate/up (N = 2 I = 4096, K = 7168) and down (N = 7168, K = I = 2048)
    aot_configs=({"E": 256, "N": 4096, "K": 7168, "silu_quant": True}, {"E": 256, "N": 4096, "K": 7168},
                 {"E": 256, "N": 7168, "K": 2048}),
    description="MXFP8 routed-expert grouped GEMM (tcgen05 block-scaled), bf16 or fused SiLU + MXFP8 out",
))
