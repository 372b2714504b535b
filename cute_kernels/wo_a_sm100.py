"""WO-A on Blackwell (sm_100a): TMA + tcgen05 (tensor-memory accumulator) batched GEMM,
token-major output.

Same strided views as the Hopper path (:func:`cute_kernels.wo_a_sm90.wo_a_views`) on the
project's Blackwell engine (:mod:`cute_kernels.gemm.sm100_gemm`): a TMA warp loading into a
multi-stage mbarrier pipeline, an MMA warp issuing tcgen05.mma into tensor memory, four
epilogue warps reading it with tcgen05.ld, converting to bf16 and TMA-storing through the
token-major C view. Decode uses 1-CTA 128x128 MMA tiles; prefill 2-CTA 256x256 (cluster 2x1),
where the pair of CTAs shares B tiles.

No Blackwell GPU is available to this project: this path is proven by compiling for sm_100a
on the CPU and asserting its machine code (UTCHMMA, LDTM, UTMALDG, UTMASTG); by evaluating the
engine's own layout objects on the CPU (every element of ``y`` written by one CTA, each CTA
reading the A / B rows its C block needs: ``tests/test_wo_a.py -k cover_the_product``); and
its numerics by a CPU emulation of the same views and by the Hopper path on the H200.
"""

from __future__ import annotations

from .gemm.sm100_gemm import Sm100Gemm
from .wo_a_sm90 import WoAGemm


class WoASm100(WoAGemm):
    def __init__(self, G: int, R: int, Dg: int, tile_mn: tuple[int, int]):
        super().__init__(G, R, Dg)
        self.gemm = Sm100Gemm(tile_mn)

    @staticmethod
    def tile_for(T: int, G: int, R: int) -> tuple[int, int]:
        if T <= 128:
            return (128, 128) if G * (R // 128) >= 96 else (128, 64)
        return (256, 256) if R % 256 == 0 else (256, 128)

    @staticmethod
    def config_for(T: int, G: int, R: int, Dg: int | None = None, pdl: bool = False) -> dict:
        """The compile config wo_a() launches (the Hopper path's swapped operands are not
        built here: nothing is measured on Blackwell)."""
        tile_m, tile_n = WoASm100.tile_for(T, G, R)
        return dict(tile_m=tile_m, tile_n=tile_n)

    @staticmethod
    def can_implement(G: int, R: int, Dg: int) -> bool:
        return G >= 1 and R % 64 == 0 and Dg % 64 == 0
