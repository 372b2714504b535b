"""Split-K reduction: ``y[t, c] = bf16(sum_s ws[s, t, c])`` for FP32 partials ``ws [S, T, N]``.

The second launch of a split-K GEMM (WO-A at decode sizes, :mod:`cute_kernels.wo_a`): each
thread owns 8 consecutive columns, reads the S partials with 16-byte loads, sums them in
split order (deterministic) in FP32 and writes one 16-byte bf16 vector -- one rounding, the
same rounding point as the unsplit GEMM epilogue. ``N % 8 == 0``; T is a runtime value.
"""

from __future__ import annotations

import os

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from . import jit


class SplitKReduce:
    def __init__(self, splits: int, N: int, threads: int = 256):
        self.S, self.N, self.threads = splits, N, threads
        self.vec = 8

    @cute.jit
    def __call__(self, ws_ptr: cute.Pointer, y_ptr: cute.Pointer, num_tokens: Int32, stream: cuda.CUstream):
        mWs = cute.make_tensor(ws_ptr, cute.make_layout((self.S, num_tokens * self.N)))
        mY = cute.make_tensor(y_ptr, cute.make_layout((num_tokens * self.N,)))
        nvec = num_tokens * (self.N // self.vec)
        self.kernel(mWs, mY, nvec).launch(grid=[(nvec + self.threads - 1) // self.threads, 1, 1],
                                          block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mWs: cute.Tensor, mY: cute.Tensor, nvec: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        v = bidx * self.threads + tidx
        if v < nvec:
            gWs = cute.zipped_divide(mWs, (1, self.vec))  # ((1, 8), (S, nvec))
            gY = cute.zipped_divide(mY, (self.vec,))
            acc = cute.make_rmem_tensor(cute.make_layout((self.vec,)), Float32)
            part = cute.make_rmem_tensor(cute.make_layout((self.vec,)), Float32)
            cute.autovec_copy(gWs[(0, None), (0, v)], acc)
            for s in cutlass.range_constexpr(1, self.S):
                cute.autovec_copy(gWs[(0, None), (s, v)], part)
                acc.store(acc.load() + part.load())
            out = cute.make_rmem_tensor(cute.make_layout((self.vec,)), mY.element_type)
            out.store(acc.load().to(mY.element_type))
            cute.autovec_copy(out, gY[(None, v)])


def _build(arch: str, *, splits: int, N: int):
    if N % 8 or splits < 2:
        raise ValueError(f"splitk_reduce: N={N} must be a multiple of 8 and splits={splits} >= 2")
    args = (jit.fake_gmem_ptr(Float32, 16), jit.fake_gmem_ptr(cutlass.BFloat16, 16), Int32(1), jit.fake_stream())
    return SplitKReduce(splits, N), args


KERNEL = jit.register(jit.KernelDef(
    name="splitk_reduce",
    build=_build,
    sources=(os.path.abspath(__file__),),
    archs=("sm_90a", "sm_100a", "sm_103a"),
    aot_configs=({"splits": 2, "N": 4096}, {"splits": 2, "N": 8192}),
    description="sum FP32 split-K partials -> bf16",
))
