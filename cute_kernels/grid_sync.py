"""Last-arrival detection across CTAs (split-K reductions, grid-wide epilogues).

Every CTA of a group calls :func:`last_arrival` once its results are in global memory; the
call returns True in the one CTA that arrived last, which then sees every other CTA's stores.
``bar.sync`` orders the CTA's own stores before thread 0's cumulative release fence; the
acq_rel counter increment (gpu scope) and the acquire fence in the last CTA make the others'
stores visible -- the cooperative-groups grid-sync pattern. The last CTA re-zeroes the
counter itself when it is done, so a replayed CUDA graph needs no host reset.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32


@cute.jit
def last_arrival(counter: cute.Pointer, sFlag: cute.Tensor, arrivals: Int32) -> cutlass.Boolean:
    """Count this CTA in ``*counter`` (one of ``arrivals``); True in the last one to arrive.
    ``sFlag``: one Int32 of shared memory to broadcast thread 0's ticket."""
    tidx, _, _ = cute.arch.thread_idx()
    cute.arch.barrier()
    if tidx == 0:
        cute.arch.fence_acq_rel_gpu()
        sFlag[0] = cute.arch.atomic_add(counter.llvm_ptr, Int32(1), sem="acq_rel", scope="gpu")
    cute.arch.barrier()
    last = sFlag[0] == arrivals - 1
    if last:
        cute.arch.fence_acq_rel_gpu()
    return last
