"""WO-A on Hopper (sm_90a): TMA + wgmma batched GEMM writing token-major output.

See :mod:`cute_kernels.wo_a` for the operation. This file only maps it onto the vendored
Hopper engine (:mod:`cute_kernels.gemm.hopper_wgmma`): group ``g`` is the batch mode ``L``,
and the three operands are strided views of the original buffers -- no copies::

    A = o     as (M=T, K=Dg, L=G)  strides (G*Dg, 1, Dg)      # o [T, H, Dv] = [T, G, Dg]
    B = wo_a  as (N=R, K=Dg, L=G)  strides (Dg, 1, R*Dg)      # wo_a [G, R, Dg]
    C = y     as (M=T, N=R, L=G)   strides (G*R, 1, R)        # y [T, G*R], token-major

The epilogue's TMA store walks C through that view, so each (T-tile, R-tile, g) block lands
directly at columns ``g*R + n`` of token-major ``y``: the transpose + copy of the unfused
group-major path never happens. Rows past T are clipped by TMA (loads zero-fill, stores
drop), so any T >= 1 works.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import Float32, Int32

from .gemm.hopper_wgmma import HopperWgmmaGemmKernel


def wo_a_layouts(T, G: int, R: int, Dg: int):
    """(shape, stride) of the A, B, C operand views -- shared by the kernels and the CPU
    emulation in tests/test_wo_a.py (torch.as_strided with the same numbers)."""
    return (
        ((T, Dg, G), (G * Dg, 1, Dg)),  # A = o as (M, K, L)
        ((R, Dg, G), (Dg, 1, R * Dg)),  # B = wo_a as (N, K, L)
        ((T, R, G), (G * R, 1, R)),  # C = y as (M, N, L): token-major
    )


def wo_a_views(o_ptr, w_ptr, y_ptr, T, G: int, R: int, Dg: int):
    (sa, da), (sb, db), (sc, dc) = wo_a_layouts(T, G, R, Dg)
    a = cute.make_tensor(o_ptr, cute.make_layout(sa, stride=da))
    b = cute.make_tensor(w_ptr, cute.make_layout(sb, stride=db))
    c = cute.make_tensor(y_ptr, cute.make_layout(sc, stride=dc))
    return a, b, c


class WoAGemm:
    """Shared launch of both paths: build the strided views, hand them to ``self.gemm``
    (the arch's engine, set by the subclass)."""

    def __init__(self, G: int, R: int, Dg: int):
        self.G, self.R, self.Dg = G, R, Dg

    @cute.jit
    def __call__(self, o_ptr: cute.Pointer, w_ptr: cute.Pointer, y_ptr: cute.Pointer, num_tokens: Int32,
                 stream: cuda.CUstream):
        a, b, c = wo_a_views(o_ptr, w_ptr, y_ptr, num_tokens, self.G, self.R, self.Dg)
        self.gemm(a, b, c, stream)


class WoASm90(WoAGemm):
    """Compile-time configuration: group count, rank, per-group K, CTA tile."""

    def __init__(self, G: int, R: int, Dg: int, tile_mn: tuple[int, int], cluster_mn: tuple[int, int] = (1, 1),
                 pdl: bool = False):
        super().__init__(G, R, Dg)
        self.gemm = HopperWgmmaGemmKernel(Float32, tile_mn, cluster_mn, pdl)

    @staticmethod
    def tile_for(T: int, G: int, R: int) -> tuple[int, int]:
        """Decode (T <= 64): one 64-row tile; 128-wide N tiles unless that leaves most of the
        132 SMs idle. Prefill: 128x256 cooperative tiles (two consumer warp groups), except
        mid-size T with few output columns (G*R < 8192), where 64x256 keeps more CTAs busy.
        Chosen from tools/probe_wo_a_tiles.py on the H200 (bench/RESULTS.md)."""
        if T <= 64:
            return (64, 128) if G * (R // 128) >= 96 else (64, 64)
        if R % 256:
            return (128, 128)
        if T <= 512 and G * R < 8192:
            return (64, 256)
        return (128, 256)

    @staticmethod
    def can_implement(G: int, R: int, Dg: int) -> bool:
        return G >= 1 and R % 64 == 0 and Dg % 64 == 0
