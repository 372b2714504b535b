"""Row-wise RMS statistic: ``rstd[t] = rsqrt(mean(x[t, :]^2) + eps)`` -- the template kernel.

Used by mHC (``r`` over the flattened ``n*C`` residual streams) and by every RMSNorm; it is
also the pattern the other kernels copy: config class -> ``@cute.jit __call__`` -> ``@cute.kernel``
-> registry entry -> validated torch-facing function.

Algorithm. ``nt`` threads per row, enough that each issues at most ``LOADS_PER_THREAD`` (2)
16-byte loads: rows of up to 512 / 1024 bf16 take one / two warps and share a CTA of four
warps (four / two rows, as quack's ``threads_per_row``), longer rows a CTA each (4096: 256
threads; at most 1024). Thread ``i`` of a
row loads its 16-byte vectors ``i, i+nt, i+2nt, ...`` (8 bf16 each) -- as ``cp.async`` copies
through shared memory, all issued before one wait (rows over 64 KiB: register loads) --
squares and sums in FP32, then a warp shuffle reduction and, for a row of several warps, a
cross-warp reduction through shared memory (one barrier; every warp then sums its row's
partials itself, as quack's ``block_reduce`` does). The row's thread 0 writes
``rsqrt(sum / C + eps)`` in FP32.

Numerics. Inputs are upcast exactly to FP32; the sum is FP32 in a fixed tree order (per
thread, then butterfly, then the row's warps), so the result is deterministic run to run; against an
FP64 reference the relative error is O(sqrt(C) * 2^-24).

Constraints. ``x`` is ``[T, C]`` bf16 or fp16, row-major and contiguous, 16-byte aligned,
``C % 8 == 0`` and ``8 <= C <= 65536`` (static: one compile per hidden size); ``T`` is a
runtime value (one compile serves every batch size), ``T * C < 2**31``. Works on sm_90a and
sm_100a (no tensor cores; the same source compiles for both).

Run the tests / benchmark::

    pytest tests/test_row_rms.py
    python bench/bench_row_rms.py          # on a GPU; prints the table for bench/RESULTS.md
"""

from __future__ import annotations

import os

import torch

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from . import jit
from .arch import dispatch, current_arch
from .validate import check_cuda, check_int32_indexable, check_tensor

#: the element types the row kernels take (torch dtype / config name -> DSL type)
TORCH2CUTE = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}
NAME2CUTE = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}
MAX_HIDDEN = 65536
#: shared memory a row (and, in :mod:`cute_kernels.rms_norm`, its weight and rotation) may take
#: to be loaded through it (``RowRms.load_row_async``; above: register loads)
ASYNC_SMEM_BYTES = 64 * 1024
#: 16-byte loads each of a row's threads issues (at most): sets the threads per row. Two: a
#: decode step's few rows are latency bound, and a short chain of loads per thread (a
#: 4096-element row over 256 threads) beats fewer, longer ones
#: (``bench/bench_row_rms.py --loads-per-thread`` times other values)
LOADS_PER_THREAD = 2


class RowRms:
    """Compile-time configuration: element type and the (static) row length."""

    def __init__(self, dtype: type[cutlass.Numeric], hidden: int, loads_per_thread: int = LOADS_PER_THREAD):
        if not isinstance(loads_per_thread, int) or not 1 <= loads_per_thread <= 64:
            raise ValueError(f"RowRms: loads_per_thread={loads_per_thread!r} must be an int in [1, 64]")
        self.dtype = dtype
        self.hidden = hidden
        self.vec = 128 // dtype.width  # elements per 16-byte load
        self.n_vec = hidden // self.vec
        # Threads per row: enough that each issues <= loads_per_thread loads. A row that needs at
        # most two warps gets one or two and shares a CTA of 4 warps with other rows (rows of up to
        # 1024 bf16 at two loads a thread: a CTA of their own would leave most of its threads
        # idle, and the many small CTAs of a short-row batch would each pay their own launch and
        # reduction); a longer row has the CTA to itself, at least 4 warps.
        want = -(-self.n_vec // loads_per_thread)
        if want <= 64:
            self.row_threads = 32 if want <= 32 else 64
        else:
            self.row_threads = min(1024, max(128, (want + 31) // 32 * 32))
        self.rows_per_cta = max(1, 128 // self.row_threads)
        self.threads = self.row_threads * self.rows_per_cta
        self.iters = -(-self.n_vec // self.row_threads)
        self.warps = self.threads // 32
        self.row_warps = self.row_threads // 32
        # the row through shared memory where it fits (copy_row_async); rows that share a CTA
        # always fit (at most 4 rows of 2048 or 2 of 4096 elements)
        self.async_row = self.rows_per_cta * hidden * dtype.width // 8 <= ASYNC_SMEM_BYTES
        assert self.async_row or self.rows_per_cta == 1

    @cute.jit
    def __call__(self, x_ptr: cute.Pointer, rstd_ptr: cute.Pointer, num_tokens: Int32, eps: Float32,
                 stream: cuda.CUstream):
        mX = cute.make_tensor(x_ptr, cute.make_layout((num_tokens, self.hidden), stride=(self.hidden, 1)))
        mR = cute.make_tensor(rstd_ptr, cute.make_layout((num_tokens,)))
        self.kernel(mX, mR, eps).launch(grid=[self.ctas(num_tokens), 1, 1], block=[self.threads, 1, 1], stream=stream)

    def ctas(self, num_rows):
        """The grid: ``rows_per_cta`` rows a CTA."""
        return (num_rows + self.rows_per_cta - 1) // self.rows_per_cta

    @cute.jit
    def tensor_call(self, mX: cute.Tensor, mR: cute.Tensor, eps: Float32, stream: cuda.CUstream):
        """The tensor entry (``jit.get_tensor_kernel``): ``mX [T, hidden]``, ``mR [T]``."""
        self.__call__(mX.iterator, mR.iterator, mX.shape[0], eps, stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mR: cute.Tensor, eps: Float32):
        row, local, rt = self.row_of_thread()
        live = row < mX.shape[0]  # the last CTA's rows past the end: no loads, no store
        if cutlass.const_expr(self.async_row):
            smem = cutlass.memory.SmemAllocator()
            sX = smem.allocate_tensor(self.dtype, cute.make_layout((self.rows_per_cta, self.hidden),
                                                                   stride=(self.hidden, 1)), 16)
            if live:
                self.copy_row_async(mX, row, rt, sX[local, None])
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            tXrX = self.read_row(sX[local, None], rt)  # (a dead row's: never written, never stored)
        else:
            tXrX = self.load_row(mX, row, rt)  # (rows this long have a CTA each: always live)
        rstd = self.row_rstd(tXrX, eps, local, rt)
        if rt == 0 and live:
            mR[row] = rstd

    @cute.jit
    def row_of_thread(self):
        """``(row, its index in the CTA, this thread's index in the row)``: ``rows_per_cta``
        consecutive rows a CTA, ``row_threads`` consecutive threads a row."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        local = Int32(0)
        rt = tidx
        if cutlass.const_expr(self.rows_per_cta > 1):
            local = tidx // self.row_threads
            rt = tidx % self.row_threads
        return bidx * self.rows_per_cta + local, local, rt

    @cute.jit
    def load_row(self, mX: cute.Tensor, row, tidx) -> cute.Tensor:
        """Row ``row`` of ``mX`` into registers: the row's thread ``tidx`` holds 16-byte vectors
        ``tidx, tidx + row_threads, ...`` as the ``(vec, iters)`` tensor (zeros past the row)."""
        return self.own_vectors(mX[row, None], tidx)

    @cute.jit
    def own_vectors(self, src: cute.Tensor, tidx) -> cute.Tensor:
        """Thread ``tidx``'s 16-byte vectors of the ``[hidden]`` row ``src`` (global or shared
        memory) as :meth:`load_row` returns them."""
        # ((vec), (n_vec)): mode 0 is one 16-byte vector, contiguous and 16-byte aligned
        # because hidden % vec == 0 and the base pointer is 16-byte aligned.
        gX = cute.zipped_divide(src, (self.vec,))
        tXrX = cute.make_rmem_tensor(cute.make_layout((self.vec, self.iters)), self.dtype)
        tXrX.fill(0.0)
        for i in cutlass.range_constexpr(self.iters):
            v = tidx + i * self.row_threads
            if v < self.n_vec:
                cute.autovec_copy(gX[(None, v)], tXrX[None, i])
        return tXrX

    @cute.jit
    def copy_row_async(self, mX: cute.Tensor, row, tidx, sX: cute.Tensor):
        """Issue row ``row`` of ``mX`` as ``cp.async`` copies into ``sX [hidden]``, the row's
        thread ``tidx`` its vectors ``tidx, tidx + row_threads, ...`` (the caller commits and waits).

        Why not :meth:`load_row`: the compiler, keeping a row kernel at 32 registers, issued
        the last vectors' register loads only after the first had arrived -- behind the squares
        waiting for it -- a second memory round trip on a short row. The reads back
        (:meth:`read_row`) depend on the wait, and the wait on every copy."""
        atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), self.dtype, num_bits_per_copy=128)
        gXv, sXv = cute.zipped_divide(mX[row, None], (self.vec,)), cute.zipped_divide(sX, (self.vec,))
        for i in cutlass.range_constexpr(self.iters):
            v = tidx + i * self.row_threads
            if v < self.n_vec:
                cute.copy(atom, gXv[(None, v)], sXv[(None, v)])

    @cute.jit
    def read_row(self, sX: cute.Tensor, tidx) -> cute.Tensor:
        """This thread's vectors of :meth:`copy_row_async`'s row (after the wait), as
        :meth:`load_row` returns them."""
        return self.own_vectors(sX, tidx)

    @cute.jit
    def row_rstd(self, tXrX: cute.Tensor, eps: Float32, local, rt) -> Float32:
        """``rsqrt(sum / hidden + eps)`` of the row (``local``-th of the CTA) whose vectors its
        threads hold, in each of them: FP32 squares summed per thread, then a warp butterfly;
        a row of several warps then adds its warps' partials through shared memory -- one
        barrier, after which every warp sums its row's partials with the same butterfly (a
        fixed order: deterministic, and the same value in every thread: a butterfly's two lanes
        of a pair add the same two values). No second barrier to broadcast one warp's total.
        Called once per kernel: a second call's partials would overwrite ones another warp may
        still be reading. Every thread of the CTA calls it (the barrier), live row or not."""
        x = tXrX.load().to(Float32)
        partial = (x * x).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        total = cute.arch.warp_reduction_sum(partial)
        if cutlass.const_expr(self.row_warps > 1):
            smem = cutlass.memory.SmemAllocator()
            sPartial = smem.allocate_tensor(Float32, cute.make_layout(self.warps), 4)
            warp, lane = cute.arch.warp_idx(), cute.arch.lane_idx()
            if lane == 0:
                sPartial[warp] = total
            # Every warp's partial must be in shared memory before any warp reads them.
            cute.arch.barrier()
            total = Float32(0.0)
            if lane < self.row_warps:
                total = sPartial[local * self.row_warps + lane]
            total = cute.arch.warp_reduction_sum(total)
        return cute.math.rsqrt(total / Float32(self.hidden) + eps)

    @staticmethod
    def compile(arch: str, hidden: int, dtype: str = "bfloat16"):
        """The compiled function (through the shared cache) for one hidden size."""
        return jit.get_kernel("row_rms", arch, hidden=hidden, dtype=dtype)

    @staticmethod
    def can_implement(hidden: int, dtype: str = "bfloat16") -> bool:
        return dtype in NAME2CUTE and hidden % 8 == 0 and 8 <= hidden <= MAX_HIDDEN


def _build(arch: str, *, hidden: int, dtype: str = "bfloat16", loads_per_thread: int = LOADS_PER_THREAD):
    """``loads_per_thread`` (a variant; the entry points take the default): see ``RowRms``."""
    if not RowRms.can_implement(hidden, dtype):
        raise ValueError(f"row_rms: unsupported hidden={hidden}, dtype={dtype}")
    cdt = NAME2CUTE[dtype]
    args = (jit.fake_gmem_ptr(cdt, 16), jit.fake_gmem_ptr(Float32, 4), Int32(1), Float32(1e-6), jit.fake_stream())
    return RowRms(cdt, hidden, loads_per_thread), args


def _build_tensors(arch: str, *, hidden: int, dtype: str = "bfloat16"):
    op, _ = _build(arch, hidden=hidden, dtype=dtype)
    sym = {}
    args = (jit.fake_tensor(op.dtype, ("T", hidden), 16, sym), jit.fake_tensor(Float32, ("T",), 4, sym),
            Float32(1e-6), jit.fake_env_stream())
    return op.tensor_call, args


KERNEL = jit.register(
    jit.KernelDef(
        name="row_rms",
        build=_build,
        sources=(os.path.abspath(__file__),),
        archs=("sm_90a", "sm_100a", "sm_103a"),
        # hidden 7168 (DeepSeek-V3/V4 model dim) and 4*7168 (mHC n=4 flattened streams).
        aot_configs=({"hidden": 7168, "dtype": "bfloat16"}, {"hidden": 28672, "dtype": "bfloat16"}),
        description="rsqrt(mean(x^2)+eps) per row, bf16 -> fp32",
    )
)


jit.register_tensor_entry(KERNEL, _build_tensors, aot_configs=KERNEL.aot_configs)

#: (dtype, hidden, device index) -> the tensor entry, filled by a first validated call with
#: TVM-FFI on (jit.use_tvm_ffi)
_TENSOR_FNS: dict = {}


def row_rms_torch(x: torch.Tensor, eps: float) -> torch.Tensor:
    """The op in PyTorch: the fallback for devices without a CuTe path and the custom op's CPU
    kernel (not the test reference: tests/references.py)."""
    xf = x.float()
    return torch.rsqrt(xf.square().mean(dim=-1) + eps).float()


def row_rms(x: torch.Tensor, eps: float = 1e-6, *, out: torch.Tensor | None = None, stream=None,
            arch: str | None = None) -> torch.Tensor:
    """``rsqrt(mean(x**2, -1) + eps)`` in FP32 for bf16/fp16 ``x [T, C]``.

    ``out`` (fp32 ``[T]``) makes the call allocation-free; ``stream`` defaults to torch's
    current stream. Capturable in a CUDA graph.
    """
    if (out is not None and stream is None and arch is None and jit.TVM_FFI
            and isinstance(x, torch.Tensor)):  # the eager hot path
        shape = x.shape  # (the C checks: dtype, extents, strides, alignment, device)
        if (len(shape) == 2 and shape[0] and x.numel() < 2**31 and isinstance(eps, float) and eps >= 0
                and jit.launch_tensor_entry(_TENSOR_FNS, (x.dtype, shape[1], x.get_device()), x, out, eps)):
            return out
    op = "row_rms"
    check_tensor(op, "x", x, dtype=tuple(TORCH2CUTE), ndim=2, contiguous=True, align_bytes=0)
    T, C = x.shape
    if C % 8 or not 8 <= C <= MAX_HIDDEN:
        raise ValueError(f"{op}: x.shape[1]={C} must be a multiple of 8 in [8, {MAX_HIDDEN}]")
    check_tensor(op, "x", x, align_bytes=16)
    check_int32_indexable(op, "x", T * C)
    if not isinstance(eps, (int, float)) or eps < 0:
        raise TypeError(f"{op}: eps must be a non-negative float, got {eps!r}")
    if out is None:
        out = torch.empty(T, dtype=torch.float32, device=x.device)
    else:
        check_tensor(op, "out", out, dtype=torch.float32, shape=(T,), contiguous=True, align_bytes=4)
    check_cuda(op, ("x", x), ("out", out))
    a = arch if arch is not None else current_arch(x.device)
    if dispatch(op, ("portable", "reference"), arch=a) == "reference":
        out.copy_(row_rms_torch(x, eps))
        return out
    if T == 0:
        return out
    dtype = str(x.dtype).replace("torch.", "")
    fn = RowRms.compile(a, C, dtype)
    cdt = TORCH2CUTE[x.dtype]
    fn(jit.gmem_ptr(cdt, x, 16), jit.gmem_ptr(Float32, out, 4), jit.i32(T), jit.f32(eps), jit.cu_stream(stream))
    if stream is None and arch is None:
        jit.remember_tensor_entry(_TENSOR_FNS, (x.dtype, C, x.get_device()), "row_rms_tensors", a, hidden=C,
                                  dtype=dtype)
    return out
