"""WO-A on Hopper (sm_90a): TMA + wgmma batched GEMM writing token-major output.

See :mod:`cute_kernels.wo_a` for the operation. This file only maps it onto the project's
Hopper engine (:mod:`cute_kernels.gemm.sm90_gemm`): group ``g`` is the batch mode ``L``,
and the three operands are strided views of the original buffers -- no copies::

    A = o     as (M=T, K=Dg, L=G)  strides (G*Dg, 1, Dg)      # o [T, H, Dv] = [T, G, Dg]
    B = wo_a  as (N=R, K=Dg, L=G)  strides (Dg, 1, R*Dg)      # wo_a [G, R, Dg]
    C = y     as (M=T, N=R, L=G)   strides (G*R, 1, R)        # y [T, G*R], token-major

The epilogue's TMA store walks C through that view, so each (T-tile, R-tile, g) block lands
directly at columns ``g*R + n`` of token-major ``y``: the transpose + copy of the unfused
group-major path never happens. Rows past T are clipped by TMA (loads zero-fill, stores
drop), so any T >= 1 works.

``swap_ab`` puts the weight rows on M and the tokens on N (``y^T = wo_a @ o^T`` per group)::

    A = wo_a  as (M=R, K=Dg, L=G)  strides (Dg, 1, R*Dg)
    B = o     as (N=T, K=Dg, L=G)  strides (G*Dg, 1, Dg)
    C = y     as (M=R, N=T, L=G)   strides (1, G*R, R)        # M-major C: still token-major y

wgmma's N goes in steps of 8 (the engine's epilogue: 16) where its M is 64 or 128, so the
token tile can match T (T = 320 in two 160-token tiles) instead of wasting a third of a
128-row tile -- what limits the unswapped T = 320 launch.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import Int32

from .gemm.sm90_gemm import Sm90Gemm


def wo_a_layouts(T, G: int, R: int, Dg: int, swap_ab: bool = False):
    """(shape, stride) of the A, B, C operand views -- shared by the kernels and the CPU
    emulation in tests/test_wo_a.py (torch.as_strided with the same numbers)."""
    o_view = ((T, Dg, G), (G * Dg, 1, Dg))  # o as (T, K, L)
    w_view = ((R, Dg, G), (Dg, 1, R * Dg))  # wo_a as (R, K, L)
    if swap_ab:
        return w_view, o_view, ((R, T, G), (1, G * R, R))  # C = y as (R, T, L): M-major, token-major y
    return o_view, w_view, ((T, R, G), (G * R, 1, R))  # C = y as (T, R, L): token-major


def wo_a_views(o_ptr, w_ptr, y_ptr, T, G: int, R: int, Dg: int, swap_ab: bool = False):
    (sa, da), (sb, db), (sc, dc) = wo_a_layouts(T, G, R, Dg, swap_ab)
    a_ptr, b_ptr = (w_ptr, o_ptr) if swap_ab else (o_ptr, w_ptr)
    a = cute.make_tensor(a_ptr, cute.make_layout(sa, stride=da))
    b = cute.make_tensor(b_ptr, cute.make_layout(sb, stride=db))
    c = cute.make_tensor(y_ptr, cute.make_layout(sc, stride=dc))
    return a, b, c


class WoAGemm:
    """Shared launch of both paths: build the strided views, hand them to ``self.gemm``
    (the arch's engine, set by the subclass)."""

    def __init__(self, G: int, R: int, Dg: int, swap_ab: bool = False):
        self.G, self.R, self.Dg, self.swap_ab = G, R, Dg, swap_ab

    @cute.jit
    def __call__(self, o_ptr: cute.Pointer, w_ptr: cute.Pointer, y_ptr: cute.Pointer, num_tokens: Int32,
                 stream: cuda.CUstream):
        a, b, c = wo_a_views(o_ptr, w_ptr, y_ptr, num_tokens, self.G, self.R, self.Dg, self.swap_ab)
        self.gemm(a, b, c, stream)


class WoASm90(WoAGemm):
    """Compile-time configuration: group count, rank, per-group K, CTA tile (over (T, R), or
    (R, T) with ``swap_ab``), and the engine's options (``weight_l2_hint``: the L2 cache hint
    of the weight operand's loads; ``max_stages``: a cap on the operand stages; ``pingpong``:
    its persistent schedule)."""

    def __init__(self, G: int, R: int, Dg: int, tile_mn: tuple[int, int], cluster_mn: tuple[int, int] = (1, 1),
                 pdl: bool = False, swap_ab: bool = False, occupancy: int = 1, pingpong: bool = False,
                 cluster_exit: str | None = None, weight_l2_hint: str | None = None,
                 max_stages: int | None = None):
        super().__init__(G, R, Dg, swap_ab)
        # under PDL the weights load before the grid-dependency wait: B, or A when swapped
        hints = dict(l2_hint_a=weight_l2_hint) if swap_ab else dict(l2_hint_b=weight_l2_hint)
        self.gemm = Sm90Gemm(tile_mn, cluster_mn, pdl=pdl, pdl_early_operand="a" if swap_ab else "b",
                             occupancy=occupancy, pingpong=pingpong, sm_count=WoASm90.NUM_SMS,
                             cluster_exit=cluster_exit, max_stages=max_stages, **hints)

    @staticmethod
    def tile_for(T: int, G: int, R: int) -> tuple[int, int]:
        """Decode (T <= 64): one 64-row tile; 128-wide N tiles unless that leaves most of the
        132 SMs idle. Prefill: 128x256 cooperative tiles (two consumer warp groups), except
        mid-size T with few output columns (G*R < 8192), where 64x256 keeps more CTAs busy."""
        if T <= 64:
            return (64, 128) if G * (R // 128) >= 96 else (64, 64)
        if R % 256:
            return (128, 128)
        if T <= 512 and G * R < 8192:
            return (64, 256)
        return (128, 256)

    #: token counts (exclusive, inclusive) for which the swapped operands are launched
    SWAP_AB_T = (64, 512)
    #: SMs of the H100 / H200 SXM parts the configs were tuned on
    NUM_SMS = 132
    #: the pingpong schedule above SWAP_AB_T for K = Dg up to this, and at any K where its 64 x 256
    #: tiles number at least PINGPONG_MIN_TILES_PER_SM per SM
    PINGPONG_MAX_DG, PINGPONG_MIN_TILES_PER_SM = 1024, 3
    #: operand stages at 256 < T <= 512 (one CTA per SM): fewer than fit ran faster there
    MID_T_MAX_STAGES = 5

    @staticmethod
    def token_tile(T: int, n_tiles: int, step: int) -> int:
        """The width of ``n_tiles`` token tiles covering ``T`` tokens, rounded up to ``step``."""
        return (-(-T // n_tiles) + step - 1) // step * step

    @staticmethod
    def mid_t_swap_max(G: int, R: int) -> int:
        """Up to which T past SWAP_AB_T[1] the swapped 128-row tiles run, per G * R (measured at
        the eight supported shapes only; elsewhere SWAP_AB_T[1]): where the pingpong tiles
        caught up with them on the H200 (docs/wo_a.md)."""
        return {4096: 1024, 8192: 960, 16384: 576}.get(G * R, WoASm90.SWAP_AB_T[1])

    @staticmethod
    def mid_t_token_tile(T: int, G: int, R: int) -> int:
        """The token tile of the swapped 128-row CTAs past SWAP_AB_T[1]: T in ceil(T / 256) or
        one more tiles, each rounded up to 16 (the engine's 16-column epilogue subtiles) -- the
        one in fewer waves of 132 CTAs, then the more tiles (an extra tile that adds a wave
        loses)."""
        options = []
        for n_tiles in (-(-T // 256), -(-T // 256) + 1):
            tile_n = WoASm90.token_tile(T, n_tiles, 16)
            n = -(-T // tile_n)
            waves = -(-(R // 128) * G * n // WoASm90.NUM_SMS)
            options.append((waves, -n, tile_n))
        return min(options)[-1]

    @staticmethod
    def config_for(T: int, G: int, R: int, Dg: int | None = None, pdl: bool = False) -> dict:
        """The compile config :func:`cute_kernels.wo_a.wo_a` launches for ``T`` tokens (every
        choice below was measured faster than its alternatives on the H200; docs/wo_a.md).

        * 32 < T <= 64 where 64-row weight tiles leave most SMs idle: tokens on wgmma N in two
          32-token tiles, the CTA pair of a weight tile sharing it by multicast; where the (T, R)
          tile takes an even number of R tiles, CTA pairs along R sharing the token tile.
        * 64 < T <= 512: tokens on wgmma N, in the fewest <= 256-token tiles, each rounded up to
          16 (T = 320: two tiles of 160, where (T, R) tiling runs 2.5 rows of 128-token tiles);
          128 weight rows per CTA unless that leaves most SMs idle; CTA pairs along R share each
          token tile by TMA multicast -- along T (sharing the weight tile) for 128-row tiles in
          an even number of token tiles at one CTA per SM; two CTAs per SM where the grid is
          more than one wave and the accumulators fit twice.
        * 512 < T <= :meth:`mid_t_swap_max`: the same swapped 128-row tiles in CTA pairs, token
          tiles by :meth:`mid_t_token_tile` ((T, R) tiles quantise badly on 132 SMs there).
        * T > 512 with 256-wide R tiles: the engine's persistent pingpong schedule (64 x 256
          tiles, CTA pairs along T sharing each weight tile) where the K loop is short (``Dg <=
          1024``: the cooperative CTA's prologue and epilogue are a large share of it) or its
          tiles number at least ``PINGPONG_MIN_TILES_PER_SM`` per SM; not under ``pdl`` (the
          pingpong CTA is persistent). Else :meth:`tile_for` over (T, R).

        At 32 < T <= 512 (and on the swapped tiles above) the weight loads carry an
        ``evict_first`` L2 hint: the weights are streamed once, the token tiles re-read by
        every R tile, and without the hint the weight stream pushes them out of L2. At 256 < T
        <= 512 with one CTA per SM, at most ``MID_T_MAX_STAGES`` operand stages (fewer than fit
        ran faster there)."""
        cfg = WoASm90._tile_config(T, G, R, Dg, pdl)
        if T > 32 and (T <= WoASm90.SWAP_AB_T[1] or cfg.get("swap_ab")):
            cfg["weight_l2_hint"] = "evict_first"
        if 256 < T <= WoASm90.SWAP_AB_T[1] and cfg.get("swap_ab") and cfg.get("occupancy", 1) == 1:
            cfg["max_stages"] = WoASm90.MID_T_MAX_STAGES
        return cfg

    @staticmethod
    def _tile_config(T: int, G: int, R: int, Dg: int | None, pdl: bool) -> dict:
        """:meth:`config_for`'s tile, cluster, operand order and schedule."""
        lo, hi = WoASm90.SWAP_AB_T
        if 32 < T <= lo and G * (R // 64) < WoASm90.NUM_SMS // 2:
            # 64-row weight tiles alone leave most SMs idle (G=8 R=512: 64): two 32-token tiles
            # per weight tile, the CTA pair sharing it by multicast -- W read once, 128 CTAs
            return dict(tile_m=64, tile_n=32, cluster_n=2, swap_ab=True)
        tile_m, tile_n = WoASm90.tile_for(T, G, R)
        if 32 < T <= lo and (R // tile_n) % 2 == 0:
            # CTA pairs along R sharing the token tile by multicast
            return dict(tile_m=tile_m, tile_n=tile_n, cluster_n=2)
        if lo < T <= hi:
            n_tiles = -(-T // 256)
            tile_m = 128 if (R // 128) * G * n_tiles >= 96 else 64
            if (R // tile_m) * G * n_tiles < 96 and -(-T // (2 * n_tiles)) > 96:
                # still most SMs idle (G=8 R=512): twice the token tiles, if they stay >= 128
                # wide -- narrower ones run the wgmma pipe at a loss
                n_tiles *= 2
            # token tiles in steps of 16 (16-column epilogue subtiles where that is an odd
            # multiple of 16): less padding
            tile_n = WoASm90.token_tile(T, n_tiles, 16)
            cfg = dict(tile_m=tile_m, tile_n=tile_n, cluster_m=2, swap_ab=True)
            if (R // tile_m) * G * n_tiles > WoASm90.NUM_SMS and tile_m == 128 and tile_n <= 160:
                # more than one wave at one CTA per SM (G=16 R=1024, 256 < T <= 320: 256 CTAs):
                # stages for two per SM (the engine then drops its producer warp) run them in
                # one wave, one CTA's epilogue under the other's mainloop. Wider token tiles need
                # too many accumulator registers for a second CTA.
                cfg["occupancy"] = 2
            elif tile_m == 128 and n_tiles % 2 == 0 and tile_n <= 160:
                # CTA pairs along T sharing the weight tile instead of along R sharing the token tile
                cfg.update(cluster_m=1, cluster_n=2)
            return cfg
        if hi < T <= WoASm90.mid_t_swap_max(G, R) and R % 256 == 0:
            # past 512 tokens the (T, R) tiles below quantise badly on 132 SMs (T = 520 G=8
            # R=512: 80 CTAs of 128x256, the fifth token row 8 deep); tokens stay on wgmma N,
            # 128-row weight tiles in CTA pairs along R
            return dict(tile_m=128, tile_n=WoASm90.mid_t_token_tile(T, G, R), cluster_m=2, swap_ab=True)
        pingpong_tiles = -(-T // 64) * (R // 256) * G
        if (T > hi and tile_n == 256 and not pdl and Dg is not None
                and (Dg <= WoASm90.PINGPONG_MAX_DG
                     or pingpong_tiles >= WoASm90.PINGPONG_MIN_TILES_PER_SM * WoASm90.NUM_SMS)):
            return dict(tile_m=64, tile_n=256, cluster_m=2, pingpong=True)
        return dict(tile_m=tile_m, tile_n=tile_n)

    @staticmethod
    def can_implement(G: int, R: int, Dg: int) -> bool:
        return G >= 1 and R % 64 == 0 and Dg % 64 == 0
