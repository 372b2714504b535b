"""mHC post-mix fused with the residual update:
``X'[t, i] = sum_j H_res[t, i, j] * X[t, j] + H_post[t, i] * F[t]`` (bf16 out, in place allowed).

Rounding (matched bit for bit by ``tests/references.py::mhc_post_mix_ref``)::

    acc = 0.0 (FP32)
    for j in 0..n-1:  acc = acc + rn(H_res[t, i, j] * float(X[t, j, c]))
    acc = acc + rn(H_post[t, i] * float(F[t, c]))
    X'[t, i, c] = bf16(acc)

``F`` is the sublayer output (bf16, already rounded by its producer). Products are never
contracted into FMAs, so the PyTorch reference reproduces the kernel exactly.

Kernel: one thread per 8 consecutive columns of one token: it loads that column block of
all ``n`` streams and of ``F`` before it stores any stream, so ``out`` may be ``x`` itself
(the residual update in place; no other thread touches those bytes). Grid
``(ceil(C / 8 / 128), T)``. Constraints as :mod:`cute_kernels.mhc_pre_mix`.

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
from .mhc_pre_mix import VEC, check_mappings
from .mhc_stats import MAX_STREAMS, num_maps
from .validate import check_cuda, check_tensor

RN = cute.math.RoundingMode.NEAREST_EVEN


class MhcPostMix:
    def __init__(self, n: int, hidden: int, threads: int = 128):
        self.n, self.C, self.threads = n, hidden, threads
        self.m = num_maps(n)
        self.nvec = hidden // VEC

    @cute.jit
    def __call__(self, x_ptr: cute.Pointer, h_ptr: cute.Pointer, f_ptr: cute.Pointer, out_ptr: cute.Pointer,
                 num_tokens: Int32, stream: cuda.CUstream):
        n, C = self.n, self.C
        mX = cute.make_tensor(x_ptr, cute.make_layout((num_tokens, n, C), stride=(n * C, C, 1)))
        mH = cute.make_tensor(h_ptr, cute.make_layout((num_tokens, self.m), stride=(self.m, 1)))
        mF = cute.make_tensor(f_ptr, cute.make_layout((num_tokens, C), stride=(C, 1)))
        mOut = cute.make_tensor(out_ptr, cute.make_layout((num_tokens, n, C), stride=(n * C, C, 1)))
        self.kernel(mX, mH, mF, mOut).launch(grid=[(self.nvec + self.threads - 1) // self.threads, num_tokens, 1],
                                             block=[self.threads, 1, 1], stream=stream)

    @cute.jit
    def tensor_call(self, mX: cute.Tensor, mH: cute.Tensor, mF: cute.Tensor, mOut: cute.Tensor,
                    stream: cuda.CUstream):
        """The tensor entry (``jit.get_tensor_kernel``): ``mX`` / ``mOut [T, n, C]``, ``mH [T, m]``,
        ``mF [T, C]``."""
        self.__call__(mX.iterator, mH.iterator, mF.iterator, mOut.iterator, mX.shape[0], stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mH: cute.Tensor, mF: cute.Tensor, mOut: cute.Tensor):
        n = self.n
        tidx, _, _ = cute.arch.thread_idx()
        bx, t, _ = cute.arch.block_idx()
        v = bx * self.threads + tidx
        if v < self.nvec:
            gX = cute.zipped_divide(mX, (1, 1, VEC))
            gOut = cute.zipped_divide(mOut, (1, 1, VEC))
            rX = cute.make_rmem_tensor(cute.make_layout((VEC, n)), mX.element_type)
            for j in cutlass.range_constexpr(n):
                cute.autovec_copy(gX[(0, 0, None), (t, j, v)], rX[None, j])
            rF = cute.make_rmem_tensor(cute.make_layout((VEC,)), mF.element_type)
            cute.autovec_copy(cute.zipped_divide(mF, (1, VEC))[(0, None), (t, v)], rF)
            acc = cute.make_rmem_tensor(cute.make_layout((VEC,)), Float32)
            rO = cute.make_rmem_tensor(cute.make_layout((VEC,)), mOut.element_type)
            for i in cutlass.range_constexpr(n):
                acc.fill(0.0)
                for j in cutlass.range_constexpr(n):
                    h = mH[t, 2 * n + i * n + j]
                    for e in cutlass.range_constexpr(VEC):
                        acc[e] = acc[e] + cute.math.mul(h, Float32(rX[e, j]), rounding=RN)
                hp = mH[t, n + i]
                for e in cutlass.range_constexpr(VEC):
                    acc[e] = acc[e] + cute.math.mul(hp, Float32(rF[e]), rounding=RN)
                rO.store(acc.load().to(mOut.element_type))
                cute.autovec_copy(rO, gOut[(0, 0, None), (t, i, v)])

    @staticmethod
    def can_implement(n: int, hidden: int) -> bool:
        return 1 <= n <= MAX_STREAMS and hidden > 0 and hidden % VEC == 0


def _build(arch: str, *, n: int, hidden: int):
    if not MhcPostMix.can_implement(n, hidden):
        raise ValueError(f"mhc_post_mix: unsupported n={n}, hidden={hidden}")
    P = jit.fake_gmem_ptr
    args = (P(cutlass.BFloat16, 16), P(Float32, 4), P(cutlass.BFloat16, 16), P(cutlass.BFloat16, 16), Int32(1),
            jit.fake_stream())
    return MhcPostMix(n, hidden), args


KERNEL = jit.register(jit.KernelDef(
    name="mhc_post_mix",
    build=_build,
    sources=(os.path.abspath(__file__), os.path.join(os.path.dirname(os.path.abspath(__file__)), "mhc_stats.py"),
             os.path.join(os.path.dirname(os.path.abspath(__file__)), "mhc_pre_mix.py")),
    archs=("sm_90a", "sm_100a", "sm_103a"),
    aot_configs=({"n": 4, "hidden": 7168},),
    description="mHC post-mix + residual update X' = H_res X + H_post F, bf16, in place allowed",
))


def _build_tensors(arch: str, *, n: int, hidden: int):
    op, _ = _build(arch, n=n, hidden=hidden)
    sym, bf = {}, cutlass.BFloat16
    args = (jit.fake_tensor(bf, ("T", n, hidden), 16, sym), jit.fake_tensor(Float32, ("T", num_maps(n)), 4, sym),
            jit.fake_tensor(bf, ("T", hidden), 16, sym), jit.fake_tensor(bf, ("T", n, hidden), 16, sym),
            jit.fake_env_stream())
    return op.tensor_call, args


jit.register_tensor_entry(KERNEL, _build_tensors, aot_configs=KERNEL.aot_configs)
#: (x.shape[1:], device index) -> the tensor entry (jit.launch_tensor_entry)
_TENSOR_FNS: dict = {}


def mhc_post_mix(x: torch.Tensor, h: torch.Tensor, f: torch.Tensor, *, out: torch.Tensor | None = None,
                 stream=None, arch: str | None = None) -> torch.Tensor:
    """``X' [T, n, C]`` bf16; ``out=x`` updates the residual streams in place."""
    if (out is not None and stream is None and arch is None and jit.TVM_FFI
            and isinstance(x, torch.Tensor)):  # the eager hot path
        shape = x.shape  # (the C checks: dtypes, extents, strides, alignment, device)
        if (len(shape) == 3 and shape[0] and x.numel() < 2**31 and (out is x or not _overlaps(out, x))
                and jit.launch_tensor_entry(_TENSOR_FNS, (shape[1:], x.get_device()), x, h, f, out)):
            return out
    op = "mhc_post_mix"
    T, n, C = check_mappings(op, x, h)
    check_tensor(op, "f", f, dtype=torch.bfloat16, shape=(T, C), contiguous=True, align_bytes=16)
    if out is None:
        out = torch.empty_like(x)
    check_tensor(op, "out", out, dtype=torch.bfloat16, shape=(T, n, C), contiguous=True, align_bytes=16)
    if out.data_ptr() != x.data_ptr() and _overlaps(out, x):
        raise ValueError(f"{op}: out must be x itself or not overlap x")
    check_cuda(op, ("x", x), ("h", h), ("f", f), ("out", out))
    a = arch if arch is not None else current_arch(x.device)
    dispatch(op, ("portable",), arch=a)
    if T == 0:
        return out
    fn = jit.get_kernel("mhc_post_mix", a, n=n, hidden=C)
    P = jit.gmem_ptr
    fn(P(cutlass.BFloat16, x, 16), P(Float32, h, 4), P(cutlass.BFloat16, f, 16), P(cutlass.BFloat16, out, 16),
       jit.i32(T), jit.cu_stream(stream))
    if stream is None and arch is None:
        jit.remember_tensor_entry(_TENSOR_FNS, (x.shape[1:], x.get_device()), "mhc_post_mix_tensors", a, n=n, hidden=C)
    return out


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()
