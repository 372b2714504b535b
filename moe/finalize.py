"""Deferred MoE finalize fused with the shared-expert add.

Per token ``t`` and hidden column ``c`` (``y`` = expert outputs in expert-sorted order,
``pos[t, i]`` = the slot of routed row ``(t, i)``, from :mod:`moe.router`)::

    acc = 0.0 (FP32);  for i in 0..k-1:  acc = acc + rn(w[t, i] * y[pos[t, i], c])
    routed[t, c] = bf16(acc)                                   # finalize's rounding
    out[t, c]    = bf16(float(routed[t, c]) + float(shared[t, c]))   # the add's rounding

Every product is rounded on its own (``mul.rn``, never contracted into an FMA) and the sum
runs in the fixed order i = 0..k-1, so the unfused path (standalone finalize launch, then
the bf16 add) and the fused launch here are bit-identical, and so is the PyTorch reference
``acc = acc + w * y`` in FP32 (tests/references.py).

"Deferred": the finalize is not a launch of its own after the expert GEMM; it runs where
the shared expert's output is ready, in the launch that adds it -- and :mod:`comm.push_allreduce`
reuses :func:`finalize_shared_vec` so the same per-vector computation feeds its all-reduce.

Kernel: one thread per 8 consecutive columns of one token: k 16-byte gathers of ``y`` rows and
one 16-byte load of ``shared``, all issued at once as ``cp.async`` copies into the thread's
shared-memory stage once the positions are in (two memory round trips), one 16-byte store.
``H % 8 == 0``; T is a runtime value.

Test / bench::

    pytest tests/test_moe_finalize.py
"""

from __future__ import annotations

import os

import torch

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cute_kernels import jit
from cute_kernels.arch import current_arch, dispatch
from cute_kernels.validate import check_cuda, check_int32_indexable, check_tensor

VEC = 8  # bf16 per 16-byte vector


def stage_layout(topk: int, threads: int):
    """The shared-memory staging buffer of :func:`finalize_shared_vec` for a CTA: per thread its
    ``topk`` routed vectors and the shared expert's, 16 bytes each, contiguous."""
    return cute.make_layout((VEC, topk + 1, threads))


@cute.jit
def finalize_shared_vec(mY: cute.Tensor, mW: cute.Tensor, mPos: cute.Tensor, mShared: cute.Tensor, t: Int32,
                        c: Int32, topk: cutlass.Constexpr[int], add_shared: cutlass.Constexpr[bool],
                        out: cute.Tensor, sStage: cute.Tensor):
    """Fill the bf16 register vector ``out`` with columns ``[8c, 8c+8)`` of token ``t``.
    ``sStage``: this thread's ``(VEC, topk + 1)`` slice of a :func:`stage_layout` buffer.

    Two memory round trips: the ``topk`` positions and weights into registers, then the
    ``topk`` routed vectors and the shared expert's as ``cp.async`` copies into ``sStage``
    issued at once, one wait, and the thread reads back its own vectors. (As register loads
    inside or before the summation, the compiler issued the routed vectors a pair at a time,
    each pair behind the products waiting for the one before; the wait, which the reads
    depend on, keeps every copy ahead of it.)"""
    atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), mY.element_type, num_bits_per_copy=128)
    gY = cute.zipped_divide(mY, (1, VEC))
    rPos = cute.make_rmem_tensor(cute.make_layout((topk,)), Int32)
    rW = cute.make_rmem_tensor(cute.make_layout((topk,)), Float32)
    for i in cutlass.range_constexpr(topk):
        rPos[i] = mPos[t * topk + i]
        rW[i] = mW[t, i]
    if cutlass.const_expr(add_shared):
        cute.copy(atom, cute.zipped_divide(mShared, (1, VEC))[(0, None), (t, c)], sStage[None, topk])
    for i in cutlass.range_constexpr(topk):
        cute.copy(atom, gY[(0, None), (rPos[i], c)], sStage[None, i])
    cute.arch.cp_async_commit_group()
    cute.arch.cp_async_wait_group(0)
    rY = cute.make_rmem_tensor(cute.make_layout((VEC,)), mY.element_type)
    acc = cute.make_rmem_tensor(cute.make_layout((VEC,)), Float32)
    acc.fill(0.0)
    for i in cutlass.range_constexpr(topk):
        cute.autovec_copy(sStage[None, i], rY)
        for j in cutlass.range_constexpr(VEC):
            # rounded product, then rounded sum: no FMA contraction (bit-exact with the unfused path)
            acc[j] = acc[j] + cute.math.mul(rW[i], Float32(rY[j]), rounding=cute.math.RoundingMode.NEAREST_EVEN)
    routed = cute.make_rmem_tensor(cute.make_layout((VEC,)), mY.element_type)
    routed.store(acc.load().to(mY.element_type))
    if cutlass.const_expr(add_shared):
        rS = cute.make_rmem_tensor(cute.make_layout((VEC,)), mShared.element_type)
        cute.autovec_copy(sStage[None, topk], rS)
        out.store((routed.load().to(Float32) + rS.load().to(Float32)).to(out.element_type))
    else:
        out.store(routed.load())


class FinalizeShared:
    def __init__(self, hidden: int, topk: int, add_shared: bool, threads: int = 256):
        self.H, self.k, self.add_shared, self.threads = hidden, topk, add_shared, threads
        self.nvec = hidden // VEC

    def __str__(self) -> str:
        # the DSL names the kernel after str(self): profiles tell the two variants apart
        return "FinalizeShared" if self.add_shared else "MoeFinalize"

    @cute.jit
    def __call__(self, y_ptr: cute.Pointer, w_ptr: cute.Pointer, pos_ptr: cute.Pointer, shared_ptr: cute.Pointer,
                 out_ptr: cute.Pointer, num_tokens: Int32, y_rows: Int32, stream: cuda.CUstream):
        mY = cute.make_tensor(y_ptr, cute.make_layout((y_rows, self.H), stride=(self.H, 1)))
        mW = cute.make_tensor(w_ptr, cute.make_layout((num_tokens, self.k), stride=(self.k, 1)))
        mPos = cute.make_tensor(pos_ptr, cute.make_layout((num_tokens * self.k,)))
        mShared = cute.make_tensor(shared_ptr, cute.make_layout((num_tokens, self.H), stride=(self.H, 1)))
        mOut = cute.make_tensor(out_ptr, cute.make_layout((num_tokens, self.H), stride=(self.H, 1)))
        total = num_tokens * self.nvec
        self.kernel(mY, mW, mPos, mShared, mOut, total).launch(
            grid=[(total + self.threads - 1) // self.threads, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.jit
    def tensor_call(self, mY: cute.Tensor, mW: cute.Tensor, mPos: cute.Tensor, mShared: cute.Tensor,
                    mOut: cute.Tensor, stream: cuda.CUstream):
        """The tensor entry (``jit.get_tensor_kernel``): ``mY [rows, H]``, ``mW [T, k]``, ``mPos
        [T * k]`` (its length checked by the caller), ``mShared`` / ``mOut [T, H]``."""
        self.__call__(mY.iterator, mW.iterator, mPos.iterator, mShared.iterator, mOut.iterator, mW.shape[0],
                      mY.shape[0], stream)

    @cute.kernel
    def kernel(self, mY: cute.Tensor, mW: cute.Tensor, mPos: cute.Tensor, mShared: cute.Tensor, mOut: cute.Tensor,
               total: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        v = bidx * self.threads + tidx
        smem = cutlass.memory.SmemAllocator()
        sStage = smem.allocate_tensor(mY.element_type, stage_layout(self.k, self.threads), 16)
        if v < total:
            t = v // self.nvec
            c = v - t * self.nvec
            out = cute.make_rmem_tensor(cute.make_layout((VEC,)), mOut.element_type)
            finalize_shared_vec(mY, mW, mPos, mShared, t, c, self.k, self.add_shared, out, sStage[None, None, tidx])
            cute.autovec_copy(out, cute.zipped_divide(mOut, (1, VEC))[(0, None), (t, c)])


def _build(arch: str, *, hidden: int, topk: int, add_shared: bool):
    if hidden % VEC or topk < 1:
        raise ValueError(f"moe.finalize: hidden={hidden} must be a multiple of {VEC}, topk={topk} >= 1")
    P = jit.fake_gmem_ptr
    args = (P(cutlass.BFloat16, 16), P(Float32, 4), P(Int32, 4), P(cutlass.BFloat16, 16), P(cutlass.BFloat16, 16),
            Int32(1), Int32(1), jit.fake_stream())
    return FinalizeShared(hidden, topk, add_shared), args


KERNEL = jit.register(jit.KernelDef(
    name="moe_finalize",
    build=_build,
    sources=(os.path.abspath(__file__),),
    archs=("sm_90a", "sm_100a", "sm_103a"),
    aot_configs=({"hidden": 7168, "topk": 8, "add_shared": True}, {"hidden": 7168, "topk": 8, "add_shared": False}),
    description="weighted top-k combine of expert rows (+ shared-expert add), bf16",
))


def _build_tensors(arch: str, *, hidden: int, topk: int, add_shared: bool):
    op, _ = _build(arch, hidden=hidden, topk=topk, add_shared=add_shared)
    sym, bf, T = {}, cutlass.BFloat16, jit.fake_tensor
    args = (T(bf, ("rows", hidden), 16, sym), T(Float32, ("T", topk), 4, sym), T(Int32, ("Tk",), 4, sym),
            T(bf, ("T", hidden), 16, sym), T(bf, ("T", hidden), 16, sym), jit.fake_env_stream())
    return op.tensor_call, args


jit.register_tensor_entry(KERNEL, _build_tensors, aot_configs=KERNEL.aot_configs)
#: (hidden, topk, add_shared, device index) -> the tensor entry (jit.launch_tensor_entry)
_TENSOR_FNS: dict = {}


def check_finalize_args(op, y, topk_weights, routed_row_pos):
    """``(T, k, H)`` of a finalize call's routed rows ``y``, ``topk_weights`` and
    ``routed_row_pos``, each checked (dtype, shape, contiguity, alignment) with an error naming it
    (shared by :mod:`comm.push_allreduce`'s fused finalize)."""
    check_tensor(op, "y", y, dtype=torch.bfloat16, ndim=2, contiguous=True, align_bytes=0)
    H = y.shape[1]
    if H % VEC:
        raise ValueError(f"{op}: hidden size y.shape[1]={H} must be a multiple of {VEC}")
    check_tensor(op, "y", y, align_bytes=16)
    check_int32_indexable(op, "y", y.numel())
    check_tensor(op, "topk_weights", topk_weights, dtype=torch.float32, ndim=2, contiguous=True, align_bytes=4)
    T, k = topk_weights.shape
    check_tensor(op, "routed_row_pos", routed_row_pos, dtype=torch.int32, shape=(T * k,), contiguous=True,
                 align_bytes=4)
    return T, k, H


def moe_finalize(y: torch.Tensor, topk_weights: torch.Tensor, routed_row_pos: torch.Tensor,
                 shared: torch.Tensor | None = None, *, out: torch.Tensor | None = None, stream=None,
                 arch: str | None = None) -> torch.Tensor:
    """``bf16(sum_i w[t,i] * y[pos[t,i]])`` (+ ``shared`` with its own bf16 rounding when given).

    ``shared=None`` is the standalone (unfused) finalize; the unfused add is then
    ``routed + shared`` in bf16. ``routed_row_pos`` entries must index rows of ``y``.
    """
    if (out is not None and stream is None and arch is None and jit.TVM_FFI and isinstance(y, torch.Tensor)
            and isinstance(topk_weights, torch.Tensor) and isinstance(routed_row_pos, torch.Tensor)):  # hot path
        ws = topk_weights.shape  # (the C checks: dtypes, extents, strides, alignment, device)
        if (len(ws) == 2 and ws[0] and routed_row_pos.numel() == ws[0] * ws[1] and y.numel() < 2**31
                and jit.launch_tensor_entry(_TENSOR_FNS, (y.shape[-1], ws[1], shared is not None, y.get_device()),
                                            y, topk_weights, routed_row_pos, out if shared is None else shared, out)):
            return out
    op = "moe_finalize"
    T, k, H = check_finalize_args(op, y, topk_weights, routed_row_pos)
    if shared is not None:
        check_tensor(op, "shared", shared, dtype=torch.bfloat16, shape=(T, H), contiguous=True)
    if out is None:
        out = torch.empty(T, H, dtype=torch.bfloat16, device=y.device)
    check_tensor(op, "out", out, dtype=torch.bfloat16, shape=(T, H), contiguous=True)
    named = [("y", y), ("topk_weights", topk_weights), ("routed_row_pos", routed_row_pos), ("out", out)]
    check_cuda(op, *named, *([("shared", shared)] if shared is not None else []))
    if T == 0:
        return out
    a = arch if arch is not None else current_arch(y.device)
    dispatch(op, ("portable",), arch=a)
    fn = jit.get_kernel("moe_finalize", a, hidden=H, topk=k, add_shared=shared is not None)
    P = jit.gmem_ptr
    fn(P(cutlass.BFloat16, y, 16), P(Float32, topk_weights, 4), P(Int32, routed_row_pos, 4),
       P(cutlass.BFloat16, shared if shared is not None else out, 16), P(cutlass.BFloat16, out, 16), jit.i32(T),
       jit.i32(y.shape[0]), jit.cu_stream(stream))
    if stream is None and arch is None:
        jit.remember_tensor_entry(_TENSOR_FNS, (H, k, shared is not None, y.get_device()), "moe_finalize_tensors", a,
                                  hidden=H, topk=k, add_shared=shared is not None)
    return out
