"""The radix select's shared pieces: order keys, the padded digit histogram, the digit search.

Both top-k selects of the indexer (:mod:`cute_kernels.indexer_topk`, streaming the row;
:mod:`cute_kernels.indexer_topk_split`, the row in registers over a cluster) find the k-th
largest score by counting the digits of order-preserving uint32 keys (11 + 11 + 10 bits) in
shared-memory histograms; these are the steps they share. Integer keys and counts: no rounding.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Uint32

NEG_INF_KEY = 0x007FFFFF  # order-preserving key of -inf
BINS = 2048
#: the histogram holds four pad words per BINS / 32 bins (find_digit: a lane's bins, conflict-free)
BINS_PADDED = BINS + 4 * 32


@cute.jit
def order_key(bits: Uint32) -> Uint32:
    """Float bits -> uint32 whose unsigned order is the float order (NaN excluded upstream)."""
    # select_ returns a signless value: re-type it, or `>>` and `>` on keys would be signed
    # (positive scores' keys have the top bit set; the H200 run lost them in the digit passes).
    # -0.0 ranks as +0.0 (they compare equal; ties then go to the lower index).
    b = Uint32(cutlass.select_(bits == Uint32(0x80000000), Uint32(0), bits))
    return Uint32(cutlass.select_((b >> 31) == Uint32(1), ~b, b | Uint32(0x80000000)))


@cute.jit
def find_digit(sHist: cute.Tensor, sState: cute.Tensor, k_rem: Int32, bits: int, first: bool):
    """Warp 0: the digit holding the k_rem-th largest key -> sState[0], how many of that
    digit's keys are still to take -> sState[1]; on the first pass also the number of
    candidates (keys above -inf's, digit > 3) -> sState[2]. Lane ``l`` reads its ``2^bits /
    32`` consecutive bins in 16-byte loads, which the histogram's padding (:func:`padded`)
    keeps free of bank conflicts."""
    lane = cute.arch.lane_idx()
    nb = 1 << bits
    per = nb // 32
    top = nb - 1 - lane * per  # lane l owns bins top, top-1, ..., top-per+1 (descending)
    # the lane's bins in 16-byte loads (its lowest bin, top - per + 1, is a multiple of 4 and
    # so is its padded place), summed; on the first pass also those above -inf's digit
    sH4 = cute.zipped_divide(sHist, (4,))
    low4 = padded(top - per + 1, bits) // 4
    c, valid = Int32(0), Int32(0)
    for v in cutlass.range_constexpr(per // 4):
        r4 = cute.make_rmem_tensor(cute.make_layout((4,)), Int32)
        cute.autovec_copy(sH4[None, low4 + v], r4)
        for i in cutlass.range_constexpr(4):
            c = c + r4[i]
            if cutlass.const_expr(first):
                valid = valid + cutlass.select_(top - per + 1 + 4 * v + i > 3, r4[i], Int32(0))
    incl = c
    for sh in cutlass.range_constexpr(5):
        o = cute.arch.shuffle_sync_up(incl, offset=1 << sh)
        incl = incl + cutlass.select_(lane >= (1 << sh), o, Int32(0))
    if cutlass.const_expr(first):
        valid = cute.arch.warp_reduction_sum(valid)
        if lane == 0:
            sState[2] = valid
    # incl is non-decreasing in the lane: the crossing lane is the count of lanes below k_rem
    below = Int32(cute.arch.popc(cute.arch.vote_ballot_sync(incl < k_rem)))
    if lane == below:
        run = incl - c
        found = Int32(0)
        for v in cutlass.range_constexpr(per // 4 - 1, -1, -1):  # its bins from the top down
            r4 = cute.make_rmem_tensor(cute.make_layout((4,)), Int32)
            cute.autovec_copy(sH4[None, low4 + v], r4)
            for i in cutlass.range_constexpr(3, -1, -1):
                h = r4[i]
                if found == 0 and run + h >= k_rem:
                    sState[0] = top - per + 1 + 4 * v + i
                    sState[1] = k_rem - run
                    found = Int32(1)
                run = run + h


def padded(d, bits: int):
    """Where bin ``d`` of a ``2^bits``-bin histogram lives: four pad words after every ``2^bits
    / 32`` bins (a lane's share in :func:`find_digit`), so the lanes' 16-byte loads of their
    bins are ``2^bits / 32 + 4`` words apart: the eight lanes of each quarter-warp phase hit
    eight different groups of four banks, where without the padding they all hit one."""
    return d + ((d >> (bits - 5)) << 2)


@cute.jit
def block_exclusive_scan(value: Int32, sWarp: cute.Tensor, warps: cutlass.Constexpr):
    """``(exclusive, total)``: the sum of ``value`` over the CTA's threads below this one, and
    over all of them (warp shuffles, then the warps' sums through ``sWarp``, one word a warp;
    one CTA barrier -- the caller syncs before ``sWarp`` is written again). The selects scan
    their packed ``eq << 16 | gt`` counts with it."""
    warp, lane = cute.arch.warp_idx(), cute.arch.lane_idx()
    incl = value
    for sh in cutlass.range_constexpr(5):
        o = cute.arch.shuffle_sync_up(incl, offset=1 << sh)
        incl = incl + cutlass.select_(lane >= (1 << sh), o, Int32(0))
    if lane == 31:
        sWarp[warp] = incl
    cute.arch.barrier()
    before, total = Int32(0), Int32(0)
    for w in cutlass.range_constexpr(warps):
        x = sWarp[w]
        before = before + cutlass.select_(w < warp, x, Int32(0))
        total = total + x
    return before + incl - value, total
