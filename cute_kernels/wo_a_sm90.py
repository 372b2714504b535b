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
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .gemm.hopper_wgmma import HopperWgmmaGemmKernel


def wo_a_layouts(T, G: int, R: int, Dg: int, S: int = 1):
    """(shape, stride) of the A, B, C operand views -- shared by the kernels and the CPU
    emulation in tests/test_wo_a.py (torch.as_strided with the same numbers).

    Split-K by S (decode): K splits become a second batch mode, L = (S, G). Split ``s`` of
    group ``g`` reads K range ``[s*Dg/S, (s+1)*Dg/S)`` and writes FP32 partials to
    ``ws[s]`` (a ``[S, T, G*R]`` workspace, still token-major), summed by
    :mod:`cute_kernels.splitk_reduce`.
    """
    if S == 1:
        return (
            ((T, Dg, G), (G * Dg, 1, Dg)),  # A = o as (M, K, L)
            ((R, Dg, G), (Dg, 1, R * Dg)),  # B = wo_a as (N, K, L)
            ((T, R, G), (G * R, 1, R)),  # C = y as (M, N, L): token-major
        )
    Ks = Dg // S
    return (
        ((T, Ks, (S, G)), (G * Dg, 1, (Ks, Dg))),
        ((R, Ks, (S, G)), (Dg, 1, (Ks, R * Dg))),
        ((T, R, (S, G)), (G * R, 1, (T * G * R, R))),
    )


def split_k_for(T: int, G: int, R: int, Dg: int, tile_mn: tuple[int, int], target_ctas: int = 128) -> int:
    """Smallest power-of-two split that brings the CTA count near ``target_ctas`` (132 SMs),
    keeping whole 64-wide K tiles per split; 1 outside decode (T > 64)."""
    if T > 64:
        return 1
    ctas = -(-T // tile_mn[0]) * (R // tile_mn[1]) * G
    S = 1
    while ctas * S * 2 <= target_ctas * 1.25 and (Dg // 64) % (S * 2) == 0 and S < 8:
        S *= 2
    return S


def wo_a_views(o_ptr, w_ptr, y_ptr, T, G: int, R: int, Dg: int, S: int = 1):
    (sa, da), (sb, db), (sc, dc) = wo_a_layouts(T, G, R, Dg, S)
    a = cute.make_tensor(o_ptr, cute.make_layout(sa, stride=da))
    b = cute.make_tensor(w_ptr, cute.make_layout(sb, stride=db))
    c = cute.make_tensor(y_ptr, cute.make_layout(sc, stride=dc))
    return a, b, c


class WoASm90:
    """Compile-time configuration: group count, rank, per-group K, CTA tile."""

    def __init__(self, G: int, R: int, Dg: int, tile_mn: tuple[int, int], split_k: int = 1):
        self.G, self.R, self.Dg, self.S = G, R, Dg, split_k
        self.gemm = HopperWgmmaGemmKernel(Float32, tile_mn, (1, 1))

    @cute.jit
    def __call__(self, o_ptr: cute.Pointer, w_ptr: cute.Pointer, y_ptr: cute.Pointer, num_tokens: Int32,
                 stream: cuda.CUstream):
        # y_ptr: bf16 y [T, G*R] (split_k == 1) or the FP32 workspace [S, T, G*R]
        a, b, c = wo_a_views(o_ptr, w_ptr, y_ptr, num_tokens, self.G, self.R, self.Dg, self.S)
        self.gemm(a, b, c, stream)

    @staticmethod
    def tile_for(T: int, G: int, R: int) -> tuple[int, int]:
        """Decode (T <= 64): one 64-row tile; 128-wide N tiles unless that leaves most of the
        132 SMs idle. Prefill: 128x256 cooperative tiles (two consumer warp groups)."""
        if T <= 64:
            return (64, 128) if G * (R // 128) >= 96 else (64, 64)
        return (128, 256) if R % 256 == 0 else (128, 128)

    @staticmethod
    def can_implement(G: int, R: int, Dg: int) -> bool:
        return G >= 1 and R % 64 == 0 and Dg % 64 == 0
