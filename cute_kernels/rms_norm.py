"""RMSNorm in one launch: ``y = (x * rsqrt(mean(x^2) + eps)) * weight`` with the composite's
rounding points.

The decode runtime's norms (sublayer, q, kv, per-head, compressor entries, final) were the
:mod:`cute_kernels.row_rms` statistic plus three PyTorch launches (rounding the statistic, the
two multiplies); this is the same statistic kernel with the multiplies in its epilogue.

Algorithm. One CTA per row, as :class:`cute_kernels.row_rms.RowRms` (whose row load and
statistic it reuses): the row's 16-byte vectors stay in registers while the statistic is
reduced, and its result is broadcast through shared memory; each thread then scales its own
vectors and stores them -- ``x`` is read once.

Numerics: the rounding points of ``spec_decode.model.rmsnorm`` in bf16 (or fp16) exactly:
``r = rsqrt(sum(x^2) / C + eps)`` in FP32 (the sum in :class:`RowRms`'s fixed order), rounded
to x's dtype; ``y = round(x * r)``; with a weight, ``round(y * w)`` -- each product exact in
FP32 and rounded to nearest even once, as PyTorch's bf16 ``mul`` does. So the output equals the
composite's whenever the two statistics round to the same bf16 value (their FP32 sums differ
only in order).

Constraints: ``x`` ``[..., C]`` bf16 / fp16, contiguous; ``weight`` None or ``[C]`` of x's
dtype; ``C % 8 == 0`` and ``8 <= C <= 65536`` (static: one compile per size and weighting);
``T`` (rows) a runtime value, ``T * C < 2**31``. sm_90a and sm_100a (no tensor cores).

    pytest tests/test_row_rms.py -k rms_norm
"""

from __future__ import annotations

import os

import torch

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from . import jit
from .arch import current_arch, dispatch
from .row_rms import MAX_HIDDEN, RowRms
from .validate import check_cuda, check_int32_indexable, check_tensor


_TORCH2CUTE = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}
_NAME2CUTE = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}


class RmsNorm(RowRms):
    """Compile-time configuration: element type, row length, whether a weight multiplies."""

    def __init__(self, dtype: type[cutlass.Numeric], hidden: int, weighted: bool):
        super().__init__(dtype, hidden)
        self.weighted = weighted

    @cute.jit
    def __call__(self, x_ptr: cute.Pointer, w_ptr: cute.Pointer, y_ptr: cute.Pointer, num_tokens: Int32,
                 eps: Float32, stream: cuda.CUstream):
        """``w_ptr`` is not read when the configuration has no weight."""
        layout = cute.make_layout((num_tokens, self.hidden), stride=(self.hidden, 1))
        mX, mY = cute.make_tensor(x_ptr, layout), cute.make_tensor(y_ptr, layout)
        mW = cute.make_tensor(w_ptr, cute.make_layout((self.hidden,)))
        self.kernel(mX, mW, mY, eps).launch(grid=[num_tokens, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        tXrX = self.load_row(mX, row, tidx)
        r = self.row_rstd(tXrX, eps, tidx).to(self.dtype).to(Float32)  # the statistic in x's dtype
        gY = cute.zipped_divide(mY[row, None], (self.vec,))
        gW = cute.zipped_divide(mW, (self.vec,))
        rW = cute.make_rmem_tensor(cute.make_layout((self.vec,)), self.dtype)
        rY = cute.make_rmem_tensor(cute.make_layout((self.vec,)), self.dtype)
        for i in cutlass.range_constexpr(self.iters):
            v = tidx + i * self.threads
            if v < self.n_vec:
                y = (tXrX[None, i].load().to(Float32) * r).to(self.dtype)
                if const_expr(self.weighted):
                    cute.autovec_copy(gW[(None, v)], rW)
                    y = (y.to(Float32) * rW.load().to(Float32)).to(self.dtype)
                rY.store(y)
                cute.autovec_copy(rY, gY[(None, v)])


def _build(arch: str, *, hidden: int, dtype: str = "bfloat16", weighted: bool = True):
    if not RowRms.can_implement(hidden, dtype):
        raise ValueError(f"rms_norm: unsupported hidden={hidden}, dtype={dtype}")
    cdt = _NAME2CUTE[dtype]
    P = jit.fake_gmem_ptr
    return RmsNorm(cdt, hidden, weighted), (P(cdt, 16), P(cdt, 16), P(cdt, 16), Int32(1), Float32(1e-6),
                                            jit.fake_stream())


KERNEL = jit.register(
    jit.KernelDef(
        name="rms_norm",
        build=_build,
        sources=(os.path.abspath(__file__), os.path.join(os.path.dirname(os.path.abspath(__file__)), "row_rms.py")),
        archs=("sm_90a", "sm_100a", "sm_103a"),
        # DeepSeek-V4-Flash's norms: hidden 4096, q-LoRA 1024, the KV / per-head / entry width
        # 512 (weighted and, per head, not), the indexer's entries 128
        aot_configs=tuple({"hidden": c, "dtype": "bfloat16", "weighted": w}
                          for c, w in ((4096, True), (1024, True), (512, True), (512, False), (128, True))),
        description="RMSNorm (statistic, rounding, weight) in one launch, bf16 / fp16",
    )
)


def rms_norm_torch(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """The op in PyTorch (the rounding points above): the fallback for devices without a CuTe
    path (not the test reference: tests/references.py)."""
    y = x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
    return y if weight is None else y * weight


def rms_norm(x: torch.Tensor, eps: float = 1e-6, weight: torch.Tensor | None = None, *,
             out: torch.Tensor | None = None, stream=None, arch: str | None = None) -> torch.Tensor:
    """RMSNorm of bf16 / fp16 ``x [..., C]`` over its last dim, times ``weight [C]`` if given,
    in x's dtype with the composite's rounding points (module docstring).

    ``out`` (x's shape and dtype) makes the call allocation-free; ``stream`` defaults to torch's
    current stream. Capturable in a CUDA graph.
    """
    op = "rms_norm"
    check_tensor(op, "x", x, dtype=tuple(_TORCH2CUTE), contiguous=True, align_bytes=0)
    if x.dim() < 1:
        raise ValueError(f"{op}: x must have a last dim to normalise, got shape {tuple(x.shape)}")
    C = x.shape[-1]
    if C % 8 or not 8 <= C <= MAX_HIDDEN:
        raise ValueError(f"{op}: x.shape[-1]={C} must be a multiple of 8 in [8, {MAX_HIDDEN}]")
    check_tensor(op, "x", x, align_bytes=16)
    check_int32_indexable(op, "x", x.numel())
    if not isinstance(eps, (int, float)) or eps < 0:
        raise TypeError(f"{op}: eps must be a non-negative float, got {eps!r}")
    if weight is not None:
        check_tensor(op, "weight", weight, dtype=x.dtype, shape=(C,), contiguous=True, align_bytes=16)
    if out is None:
        out = torch.empty_like(x)
    else:
        check_tensor(op, "out", out, dtype=x.dtype, shape=tuple(x.shape), contiguous=True, align_bytes=16)
    check_cuda(op, ("x", x), ("out", out), *((("weight", weight),) if weight is not None else ()))
    a = arch if arch is not None else current_arch(x.device)
    if dispatch(op, ("portable", "reference"), arch=a) == "reference":
        out.copy_(rms_norm_torch(x, eps, weight))
        return out
    T = x.numel() // C
    if T == 0:
        return out
    cdt = _TORCH2CUTE[x.dtype]
    fn = jit.get_kernel(op, a, hidden=C, dtype=str(x.dtype).replace("torch.", ""), weighted=weight is not None)
    fn(jit.gmem_ptr(cdt, x, 16), jit.gmem_ptr(cdt, weight if weight is not None else x, 16), jit.gmem_ptr(cdt, out, 16),
       jit.i32(T), jit.f32(eps), jit.cu_stream(stream))
    return out
