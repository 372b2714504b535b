"""mHC pre-mix: the sublayer input ``u[t] = sum_i H_pre[t, i] * X[t, i]`` (bf16 out).

Rounding (matched bit for bit by ``tests/references.py::mhc_pre_mix_ref``)::

    acc = 0.0 (FP32);  for i in 0..n-1:  acc = acc + rn(H_pre[t, i] * float(X[t, i, c]))
    u[t, c] = bf16(acc)

Products are rounded on their own (``mul.rn``, never contracted into an FMA) and summed
in stream order, so the PyTorch reference reproduces the kernel exactly.

Kernel: one thread per 8 consecutive columns of one token: ``n`` 16-byte loads (and the
token's ``n`` weights), all issued at once as ``cp.async`` copies into the thread's
shared-memory stage, then one wait; one 16-byte store; grid ``(ceil(C / 8 / 128), T)``. ``H`` is the fp32 ``[T, 2n + n*n]``
output of :mod:`cute_kernels.mhc_stats` (its first ``n`` columns are ``H_pre``).
Constraints: bf16 ``X [T, n, C]`` contiguous, ``C % 8 == 0``; ``(n, C)`` static, T runtime.

Tests::

    pytest tests/test_mhc.py
"""

from __future__ import annotations

import os

import torch

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from . import jit
from .arch import current_arch, dispatch
from .mhc_stats import MAX_STREAMS, num_maps
from .validate import check_cuda, check_int32_indexable, check_tensor

VEC = 8
RN = cute.math.RoundingMode.NEAREST_EVEN


class MhcPreMix:
    def __init__(self, n: int, hidden: int, threads: int = 128):
        self.n, self.C, self.threads = n, hidden, threads
        self.m = num_maps(n)
        self.nvec = hidden // VEC

    @cute.jit
    def __call__(self, x_ptr: cute.Pointer, h_ptr: cute.Pointer, u_ptr: cute.Pointer, num_tokens: Int32,
                 stream: cuda.CUstream):
        n, C = self.n, self.C
        mX = cute.make_tensor(x_ptr, cute.make_layout((num_tokens, n, C), stride=(n * C, C, 1)))
        mH = cute.make_tensor(h_ptr, cute.make_layout((num_tokens, self.m), stride=(self.m, 1)))
        mU = cute.make_tensor(u_ptr, cute.make_layout((num_tokens, C), stride=(C, 1)))
        self.kernel(mX, mH, mU).launch(grid=[(self.nvec + self.threads - 1) // self.threads, num_tokens, 1],
                                       block=[self.threads, 1, 1], stream=stream)

    @cute.jit
    def tensor_call(self, mX: cute.Tensor, mH: cute.Tensor, mU: cute.Tensor, stream: cuda.CUstream):
        """The tensor entry (``jit.get_tensor_kernel``): ``mX [T, n, C]``, ``mH [T, m]``, ``mU [T, C]``."""
        self.__call__(mX.iterator, mH.iterator, mU.iterator, mX.shape[0], stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mH: cute.Tensor, mU: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bx, t, _ = cute.arch.block_idx()
        v = bx * self.threads + tidx
        # Each thread's n 16-byte vectors and the token's n mixing weights go through its own
        # shared-memory stage as cp.async copies issued at once, then one wait: one memory
        # round trip. (As register loads the compiler issued two streams, then the next ones
        # behind the products waiting for those -- a round trip per pair.)
        smem = cutlass.memory.SmemAllocator()
        sX = smem.allocate_tensor(mX.element_type, cute.make_layout((VEC, self.n, self.threads)), 16)
        sH = smem.allocate_tensor(Float32, cute.make_layout((self.n, self.threads)), 4)
        if v < self.nvec:
            atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), mX.element_type, num_bits_per_copy=128)
            atom_h = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), Float32, num_bits_per_copy=32)
            gX = cute.zipped_divide(mX, (1, 1, VEC))
            gH = cute.zipped_divide(mH, (1, 1))
            sHv = cute.zipped_divide(sH, (1, 1))
            for i in cutlass.range_constexpr(self.n):
                cute.copy(atom_h, gH[(None, None), (t, i)], sHv[(None, None), (i, tidx)])
                cute.copy(atom, gX[(0, 0, None), (t, i, v)], sX[None, i, tidx])
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            rX = cute.make_rmem_tensor(cute.make_layout((VEC,)), mX.element_type)
            acc = cute.make_rmem_tensor(cute.make_layout((VEC,)), Float32)
            acc.fill(0.0)
            for i in cutlass.range_constexpr(self.n):
                cute.autovec_copy(sX[None, i, tidx], rX)
                h = sH[i, tidx]
                for e in cutlass.range_constexpr(VEC):
                    acc[e] = acc[e] + cute.math.mul(h, Float32(rX[e]), rounding=RN)
            rU = cute.make_rmem_tensor(cute.make_layout((VEC,)), mU.element_type)
            rU.store(acc.load().to(mU.element_type))
            cute.autovec_copy(rU, cute.zipped_divide(mU, (1, VEC))[(0, None), (t, v)])

    @staticmethod
    def can_implement(n: int, hidden: int) -> bool:
        return 1 <= n <= MAX_STREAMS and hidden > 0 and hidden % VEC == 0


def _build(arch: str, *, n: int, hidden: int):
    if not MhcPreMix.can_implement(n, hidden):
        raise ValueError(f"mhc_pre_mix: unsupported n={n}, hidden={hidden}")
    P = jit.fake_gmem_ptr
    args = (P(cutlass.BFloat16, 16), P(Float32, 4), P(cutlass.BFloat16, 16), Int32(1), jit.fake_stream())
    return MhcPreMix(n, hidden), args


KERNEL = jit.register(jit.KernelDef(
    name="mhc_pre_mix",
    build=_build,
    sources=(os.path.abspath(__file__), os.path.join(os.path.dirname(os.path.abspath(__file__)), "mhc_stats.py")),
    archs=("sm_90a", "sm_100a", "sm_103a"),
    aot_configs=({"n": 4, "hidden": 7168},),
    description="mHC pre-mix u = sum_i H_pre[i] X[i], bf16",
))


def _build_tensors(arch: str, *, n: int, hidden: int):
    op, _ = _build(arch, n=n, hidden=hidden)
    sym, bf = {}, cutlass.BFloat16
    args = (jit.fake_tensor(bf, ("T", n, hidden), 16, sym), jit.fake_tensor(Float32, ("T", num_maps(n)), 4, sym),
            jit.fake_tensor(bf, ("T", hidden), 16, sym), jit.fake_env_stream())
    return op.tensor_call, args


jit.register_tensor_entry(KERNEL, _build_tensors, aot_configs=KERNEL.aot_configs)
#: (x.shape[1:], device index) -> the tensor entry (jit.launch_tensor_entry)
_TENSOR_FNS: dict = {}


def check_mappings(op: str, x: torch.Tensor, h: torch.Tensor):
    """Shared checks of ``x [T, n, C]`` bf16 and the mappings ``h [T, 2n + n*n]`` fp32."""
    check_tensor(op, "x", x, dtype=torch.bfloat16, ndim=3, contiguous=True, align_bytes=0)
    T, n, C = x.shape
    if not 1 <= n <= MAX_STREAMS:
        raise ValueError(f"{op}: x.shape[1] (streams n) = {n} must be in [1, {MAX_STREAMS}]")
    if C % VEC:
        raise ValueError(f"{op}: x.shape[2] (hidden C) = {C} must be a multiple of {VEC}")
    check_tensor(op, "x", x, align_bytes=16)
    check_int32_indexable(op, "x", T * n * C)
    check_tensor(op, "h", h, dtype=torch.float32, shape=(T, num_maps(n)), contiguous=True, align_bytes=4)
    return T, n, C


def mhc_pre_mix(x: torch.Tensor, h: torch.Tensor, *, out: torch.Tensor | None = None, stream=None,
                arch: str | None = None) -> torch.Tensor:
    """``u [T, C]`` bf16 from ``x [T, n, C]`` and the mappings ``h`` of :func:`mhc_stats`."""
    if (out is not None and stream is None and arch is None and jit.TVM_FFI
            and isinstance(x, torch.Tensor)):  # the eager hot path
        shape = x.shape  # (the C checks: dtypes, extents, strides, alignment, device)
        if (len(shape) == 3 and shape[0] and x.numel() < 2**31
                and jit.launch_tensor_entry(_TENSOR_FNS, (shape[1:], x.get_device()), x, h, out)):
            return out
    op = "mhc_pre_mix"
    T, n, C = check_mappings(op, x, h)
    if out is None:
        out = torch.empty(T, C, dtype=torch.bfloat16, device=x.device)
    check_tensor(op, "out", out, dtype=torch.bfloat16, shape=(T, C), contiguous=True, align_bytes=16)
    check_cuda(op, ("x", x), ("h", h), ("out", out))
    a = arch if arch is not None else current_arch(x.device)
    dispatch(op, ("portable",), arch=a)
    if T == 0:
        return out
    fn = jit.get_kernel("mhc_pre_mix", a, n=n, hidden=C)
    P = jit.gmem_ptr
    fn(P(cutlass.BFloat16, x, 16), P(Float32, h, 4), P(cutlass.BFloat16, out, 16), jit.i32(T), jit.cu_stream(stream))
    if stream is None and arch is None:
        jit.remember_tensor_entry(_TENSOR_FNS, (x.shape[1:], x.get_device()), "mhc_pre_mix_tensors", a, n=n, hidden=C)
    return out
