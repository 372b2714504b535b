"""Block-scaled FP8 weights to bf16: ``w[r, k] = bf16(float(w8[r, k]) * scale[r // 128, k // 128])``.

The checkpoint format of DeepSeek-V4's non-expert linears (``wo_a`` among them): e4m3 values
with one scale per 128 x 128 block -- FP32 in V4-Flash-Base, UE8M0 (a power of two) in
V4-Flash / V4-Pro. :func:`cute_kernels.wo_a_decode_fp8.wo_a_fp8` widens the weights this way
once per call above decode T, where the GEMM that follows is compute bound and the widening
(one read of the FP8 bytes, one write of the bf16 ones) is a few per cent of it.

Numerics: the e4m3 value is exact in FP32; the product with the scale is rounded once to FP32
and once to bf16. With a power-of-two scale (UE8M0) both are exact -- the bf16 weights equal
the checkpoint's values -- and otherwise the weight is within one bf16 rounding (2^-9
relative) of the product.

Kernel: one thread per 16 consecutive weights of a row (a 16-byte load, a 32-byte store,
all inside one 128-wide scale block), 256 threads per CTA; ``K`` static, the row count at run
time. Same source on sm_90a and sm_100a.

Constraints: rows and ``K`` multiples of 128; contiguous row-major tensors.
Run: ``pytest tests/test_wo_a_fp8.py``.
"""

import os

import torch

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from . import jit
from .validate import check_cuda, check_tensor

SCALE_BLOCK = 128
VEC = 16  # e4m3 weights per thread: one 16-byte load
THREADS = 256


class DequantFp8Blockwise:
    """Compile-time configuration: the row length ``K``."""

    def __init__(self, K: int):
        self.K = K

    @cute.jit
    def __call__(self, w_ptr: cute.Pointer, s_ptr: cute.Pointer, out_ptr: cute.Pointer, rows: Int32,
                 stream: cuda.CUstream):
        K = self.K
        mW = cute.make_tensor(w_ptr, cute.make_layout((rows, K), stride=(K, 1)))
        mS = cute.make_tensor(s_ptr, cute.make_layout((rows // SCALE_BLOCK, K // SCALE_BLOCK),
                                                      stride=(K // SCALE_BLOCK, 1)))
        mOut = cute.make_tensor(out_ptr, cute.make_layout((rows, K), stride=(K, 1)))
        n_vec = rows * (K // VEC)
        self.kernel(mW, mS, mOut, n_vec).launch(grid=[(n_vec + THREADS - 1) // THREADS, 1, 1],
                                                block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mW: cute.Tensor, mS: cute.Tensor, mOut: cute.Tensor, n_vec: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * THREADS + tidx
        VPR = self.K // VEC
        if i < n_vec:
            r, v = i // VPR, i % VPR
            gW = cute.zipped_divide(mW, (1, VEC))
            gOut = cute.zipped_divide(mOut, (1, VEC))
            rW = cute.make_rmem_tensor(cute.make_layout((1, VEC)), cutlass.Float8E4M3FN)
            cute.autovec_copy(gW[None, (r, v)], rW)
            scale = mS[r // SCALE_BLOCK, v * VEC // SCALE_BLOCK]
            rOut = cute.make_rmem_tensor(cute.make_layout((1, VEC)), cutlass.BFloat16)
            rOut.store((rW.load().to(Float32) * scale).to(cutlass.BFloat16))
            cute.autovec_copy(rOut, gOut[None, (r, v)])

    @staticmethod
    def can_implement(rows: int, K: int) -> bool:
        return rows >= 1 and rows % SCALE_BLOCK == 0 and K >= SCALE_BLOCK and K % SCALE_BLOCK == 0


def _build(arch: str, *, K: int):
    if not DequantFp8Blockwise.can_implement(SCALE_BLOCK, K):
        raise ValueError(f"dequant_fp8_blockwise: K={K} must be a positive multiple of {SCALE_BLOCK}")
    P = jit.fake_gmem_ptr
    return DequantFp8Blockwise(K), (P(cutlass.Float8E4M3FN, 16), P(Float32, 4), P(cutlass.BFloat16, 16), Int32(128),
                                    jit.fake_stream())


KERNEL = jit.register(jit.KernelDef(
    name="dequant_fp8_blockwise",
    build=_build,
    sources=(os.path.abspath(__file__),),
    archs=("sm_90a", "sm_100a", "sm_103a"),
    aot_configs=({"K": 4096},),  # DeepSeek-V4's WO-A groups
    description="e4m3 weights with 128x128 block scales -> bf16",
))


def dequantize_fp8_blockwise_torch(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The op in PyTorch (FP32 product, one rounding to bf16): the fallback for devices without
    a CuTe path and the custom op's CPU kernel."""
    K = w.shape[-1]
    rows = w.numel() // K
    blk = w.float().view(rows // SCALE_BLOCK, SCALE_BLOCK, K // SCALE_BLOCK, SCALE_BLOCK)
    return (blk * scale.reshape(rows // SCALE_BLOCK, 1, K // SCALE_BLOCK, 1)).view(w.shape).to(torch.bfloat16)


def dequantize_fp8_blockwise(w: torch.Tensor, scale: torch.Tensor, *, out: torch.Tensor | None = None,
                             stream=None, arch: str | None = None) -> torch.Tensor:
    """bf16 ``[..., N, K]`` from e4m3 ``w [..., N, K]`` and FP32 ``scale [..., N/128, K/128]`` (the
    leading dims flattened into rows: ``[G, R, Dg]`` weights with ``[G, R/128, Dg/128]`` scales)."""
    from .arch import current_arch, dispatch

    op = "dequantize_fp8_blockwise"
    check_tensor(op, "w", w, dtype=torch.float8_e4m3fn, contiguous=True, align_bytes=0)
    if w.dim() < 2:
        raise ValueError(f"{op}: w must have at least 2 dims, got {list(w.shape)}")
    K = w.shape[-1]
    rows = w.numel() // K if K else 0
    if K % SCALE_BLOCK or w.shape[-2] % SCALE_BLOCK or rows == 0:
        raise ValueError(f"{op}: w's last two dims {list(w.shape[-2:])} must be positive multiples of {SCALE_BLOCK}")
    check_tensor(op, "w", w, align_bytes=16)  # rows of K % 128 == 0 bytes: the base address only
    want = (*w.shape[:-2], w.shape[-2] // SCALE_BLOCK, K // SCALE_BLOCK)
    check_tensor(op, "scale", scale, dtype=torch.float32, shape=want, contiguous=True, align_bytes=4)
    if w.numel() >= 2**31:
        raise ValueError(f"{op}: w has {w.numel()} elements; at most 2**31 - 1 (32-bit indexing)")
    if out is None:
        out = torch.empty(w.shape, dtype=torch.bfloat16, device=w.device)
    check_tensor(op, "out", out, dtype=torch.bfloat16, shape=tuple(w.shape), contiguous=True, align_bytes=16)
    check_cuda(op, ("w", w), ("scale", scale), ("out", out))
    a = arch if arch is not None else current_arch(w.device)
    if dispatch(op, ("sm100", "sm90", "reference"), arch=a) == "reference":
        return out.copy_(dequantize_fp8_blockwise_torch(w, scale))
    P = jit.gmem_ptr
    fn = jit.get_kernel("dequant_fp8_blockwise", a, K=K)
    fn(P(cutlass.Float8E4M3FN, w, 16), P(Float32, scale, 4), P(cutlass.BFloat16, out, 16), jit.i32(rows),
       jit.cu_stream(stream))
    return out
