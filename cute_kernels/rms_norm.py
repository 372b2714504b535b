"""RMSNorm in one launch: ``y = (x * rsqrt(mean(x^2) + eps)) * weight`` with the composite's
rounding points, optionally followed by RoPE on the last features (DeepSeek-V4's q, KV and
compressed-entry norms).

The decode runtime's norms (sublayer, q, kv, per-head, compressor entries, final) were the
:mod:`cute_kernels.row_rms` statistic plus three PyTorch launches (rounding the statistic, the
two multiplies); this is the same statistic kernel with the multiplies in its epilogue.

Algorithm. A row's threads as :class:`cute_kernels.row_rms.RowRms` (whose statistic it
reuses: rows of up to 1024 elements share a CTA, longer ones have one each): the row's 16-byte
vectors stay in registers while the statistic is reduced (at most one barrier); each thread
then scales its own vectors and stores them -- ``x`` is read once. The
row, the weight's vectors and the rotation's (cos, sin) are all
issued at once as ``cp.async`` copies into shared memory, then one wait, then each thread
reads back its own vectors: a short row -- decode has a few -- waits for one memory round
trip, not two. (As register loads the weight's were issued by the compiler only after the
row had arrived; the wait, which the row's reads depend on, keeps every copy ahead of it. Rows
whose copies would take more than ``row_rms.ASYNC_SMEM_BYTES`` of shared memory load into registers.)

Numerics: the rounding points of ``spec_decode.model.rmsnorm`` in bf16 (or fp16) exactly:
``r = rsqrt(sum(x^2) / C + eps)`` in FP32 (the sum in :class:`RowRms`'s fixed order), rounded
to x's dtype; ``y = round(x * r)``; with a weight, ``round(y * w)`` -- each product exact in
FP32 and rounded to nearest even once, as PyTorch's bf16 ``mul`` does. So the output equals the
composite's whenever the two statistics round to the same bf16 value (their FP32 sums differ
only in order). RoPE (``rotate``): each adjacent pair ``(a, b)`` of the last ``r`` features of
the rounded ``y`` becomes ``(a cos - b sin, a sin + b cos)`` in FP32 with the token's FP32
``(cos, sin)``, rounded once -- ``spec_decode.model.rope``'s complex product, equal to it up to
how the compilers contract the two products into a fused multiply-add (at most one bf16 ulp).

Constraints: ``x`` ``[..., C]`` bf16 / fp16, contiguous; ``weight`` None or ``[C]`` of x's
dtype; ``rotate`` None or FP32 ``[tokens, r / 2, 2]`` with ``r % 8 == 0``, ``r <= C``, the rows a
whole number of groups per token; ``C % 8 == 0`` and ``8 <= C <= 65536`` (static: one compile
per size, weighting and ``r``); ``T`` (rows) a runtime value, ``T * C < 2**31``. sm_90a and sm_100a (no tensor cores).

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
from .row_rms import ASYNC_SMEM_BYTES, LOADS_PER_THREAD, MAX_HIDDEN, NAME2CUTE, TORCH2CUTE, RowRms
from .validate import check_cuda, check_int32_indexable, check_tensor


class RmsNorm(RowRms):
    """Compile-time configuration: element type, row length, whether a weight multiplies, and
    how many trailing features are rotated (0: none)."""

    def __init__(self, dtype: type[cutlass.Numeric], hidden: int, weighted: bool, rope_dim: int = 0,
                 loads_per_thread: int = LOADS_PER_THREAD):
        super().__init__(dtype, hidden, loads_per_thread)
        if rope_dim % self.vec or not 0 <= rope_dim <= hidden:
            raise ValueError(f"RmsNorm: rope_dim={rope_dim} must be a multiple of {self.vec} in [0, {hidden}]")
        self.weighted, self.rope_dim = weighted, rope_dim
        self.rope_first_vec = (hidden - rope_dim) // self.vec  # the first vector of the rotated features
        # every load through shared memory, issued before the first use (the kernel's comment),
        # where the row, the weight and the (cos, sin) fit
        smem_bytes = self.rows_per_cta * (hidden * dtype.width // 8 * (2 if weighted else 1) + 4 * rope_dim)
        self.async_loads = smem_bytes <= ASYNC_SMEM_BYTES
        assert self.async_loads or self.rows_per_cta == 1  # rows that share a CTA fit

    @cute.jit
    def __call__(self, x_ptr: cute.Pointer, w_ptr: cute.Pointer, cs_ptr: cute.Pointer, y_ptr: cute.Pointer,
                 num_rows: Int32, rows_per_token: Int32, eps: Float32, stream: cuda.CUstream):
        """``w_ptr`` is not read without a weight, ``cs_ptr`` (FP32 ``[tokens, rope_dim / 2, 2]``
        cos / sin) and ``rows_per_token`` without a rotation."""
        layout = cute.make_layout((num_rows, self.hidden), stride=(self.hidden, 1))
        mX, mY = cute.make_tensor(x_ptr, layout), cute.make_tensor(y_ptr, layout)
        mW = cute.make_tensor(w_ptr, cute.make_layout((1, self.hidden), stride=(self.hidden, 1)))  # a row: load_row
        tokens = (num_rows + rows_per_token - 1) // rows_per_token
        mCS = cute.make_tensor(cs_ptr, cute.make_layout((tokens, max(self.rope_dim, 1)), stride=(self.rope_dim, 1)))
        self.kernel(mX, mW, mCS, mY, rows_per_token, eps).launch(grid=[self.ctas(num_rows), 1, 1],
                                                                 block=[self.threads, 1, 1], stream=stream)

    # The tensor entries (``jit.get_tensor_kernel``), one per form: ``mX`` / ``mY`` ``[rows, C]``
    # or ``[T, H, C]`` (a token's heads), ``mW [C]``, ``mCS`` FP32 ``[rows or T, r / 2, 2]``. An
    # absent weight or rotation is not read: ``x``'s address stands in for it.
    @cute.jit
    def tensor_call(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, eps: Float32, stream: cuda.CUstream):
        self._tensor_launch(mX, mW.iterator, cute.recast_ptr(mX.iterator, dtype=Float32), mY, eps, stream)

    @cute.jit
    def tensor_call_rotated(self, mX: cute.Tensor, mCS: cute.Tensor, mY: cute.Tensor, eps: Float32,
                            stream: cuda.CUstream):
        self._tensor_launch(mX, mX.iterator, mCS.iterator, mY, eps, stream)

    @cute.jit
    def tensor_call_weighted_rotated(self, mX: cute.Tensor, mW: cute.Tensor, mCS: cute.Tensor, mY: cute.Tensor,
                                     eps: Float32, stream: cuda.CUstream):
        self._tensor_launch(mX, mW.iterator, mCS.iterator, mY, eps, stream)

    @cute.jit
    def tensor_call_plain(self, mX: cute.Tensor, mY: cute.Tensor, eps: Float32, stream: cuda.CUstream):
        self._tensor_launch(mX, mX.iterator, cute.recast_ptr(mX.iterator, dtype=Float32), mY, eps, stream)

    @cute.jit
    def _tensor_launch(self, mX: cute.Tensor, w_ptr: cute.Pointer, cs_ptr: cute.Pointer, mY: cute.Tensor,
                       eps: Float32, stream: cuda.CUstream):
        if const_expr(cute.rank(mX.shape) == 3):  # [T, H, C]: a token's H heads share its rotation
            self.__call__(mX.iterator, w_ptr, cs_ptr, mY.iterator, mX.shape[0] * mX.shape[1], mX.shape[1], eps,
                          stream)
        else:
            self.__call__(mX.iterator, w_ptr, cs_ptr, mY.iterator, mX.shape[0], 1, eps, stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mCS: cute.Tensor, mY: cute.Tensor, rows_per_token: Int32,
               eps: Float32):
        row, local, rt = self.row_of_thread()
        live = row < mX.shape[0]  # the last CTA's rows past the end: no loads, no stores
        cs_vec = 4  # FP32 per 16-byte copy: a row vector's vec / 2 (cos, sin) pairs are vec FP32
        gCSv = cute.zipped_divide(mCS[row // rows_per_token, None], (cs_vec,))
        # (vec / 2 (cos, sin) pairs in order: column h holds the h-th 16-byte piece)
        tCrCS = cute.make_rmem_tensor(cute.make_layout((cs_vec, self.vec // cs_vec, self.iters)), Float32)
        tWrW = cute.make_rmem_tensor(cute.make_layout((self.vec, self.iters)), self.dtype)
        if const_expr(self.async_loads):
            # Everything the row needs is issued before any of it is used: the row, the weight
            # and the rotation's (cos, sin) as cp.async copies into shared memory (each row of the
            # CTA its own), one wait, then each thread reads back its own vectors. (With the
            # weight as register loads beside the row's, the compiler issued them only after the
            # row had arrived -- behind the instructions waiting for it -- one more memory round
            # trip on the critical path of a short row; the wait orders them.)
            smem = cutlass.memory.SmemAllocator()
            atom_cs = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), Float32, num_bits_per_copy=128)
            R, w_len, cs_len = self.rows_per_cta, self.hidden if self.weighted else self.vec, max(self.rope_dim, cs_vec)
            sX = smem.allocate_tensor(self.dtype, cute.make_layout((R, self.hidden), stride=(self.hidden, 1)), 16)
            sW = smem.allocate_tensor(self.dtype, cute.make_layout((R, w_len), stride=(w_len, 1)), 16)
            sCS = smem.allocate_tensor(Float32, cute.make_layout((R, cs_len), stride=(cs_len, 1)), 16)
            sCSv = cute.zipped_divide(sCS[local, None], (cs_vec,))
            if live:
                self.copy_row_async(mX, row, rt, sX[local, None])
                if const_expr(self.weighted):
                    self.copy_row_async(mW, 0, rt, sW[local, None])
                if const_expr(self.rope_dim > 0):
                    for i in cutlass.range_constexpr(self.iters):
                        v = rt + i * self.row_threads
                        if v < self.n_vec:
                            if v >= self.rope_first_vec:
                                for h in cutlass.range_constexpr(self.vec // cs_vec):
                                    c = (v - self.rope_first_vec) * (self.vec // cs_vec) + h
                                    cute.copy(atom_cs, gCSv[(None, c)], sCSv[(None, c)])
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            tXrX = self.read_row(sX[local, None], rt)  # (a dead row's: never written, never stored)
            if const_expr(self.weighted):
                tWrW = self.read_row(sW[local, None], rt)
            if const_expr(self.rope_dim > 0):
                self.rotation_vectors(sCSv, rt, tCrCS)
        else:
            # (rows too long for shared memory -- a CTA each, always live: register loads, the
            # weight's after the row)
            tXrX = self.load_row(mX, row, rt)
            if const_expr(self.weighted):
                tWrW = self.load_row(mW, 0, rt)
            if const_expr(self.rope_dim > 0):
                self.rotation_vectors(gCSv, rt, tCrCS)
        r = self.row_rstd(tXrX, eps, local, rt).to(self.dtype).to(Float32)  # the statistic in x's dtype
        if live:
            gY = cute.zipped_divide(mY[row, None], (self.vec,))
            rY = cute.make_rmem_tensor(cute.make_layout((self.vec,)), self.dtype)
            for i in cutlass.range_constexpr(self.iters):
                v = rt + i * self.row_threads
                if v < self.n_vec:
                    y = (tXrX[None, i].load().to(Float32) * r).to(self.dtype)
                    if const_expr(self.weighted):
                        y = (y.to(Float32) * tWrW[None, i].load().to(Float32)).to(self.dtype)
                    rY.store(y)
                    if const_expr(self.rope_dim > 0):
                        if v >= self.rope_first_vec:
                            self.rotate(rY, tCrCS[None, None, i])
                    cute.autovec_copy(rY, gY[(None, v)])

    @cute.jit
    def rotation_vectors(self, csv: cute.Tensor, tidx, tCrCS: cute.Tensor):
        """The (cos, sin) of the row's thread ``tidx``'s rotated vectors from ``csv`` (the token's
        row, global or shared, as 16-byte pieces) into ``tCrCS [4, vec / 4, iters]``."""
        cs_vec = 4
        for i in cutlass.range_constexpr(self.iters):
            v = tidx + i * self.row_threads
            if v < self.n_vec:
                if v >= self.rope_first_vec:
                    c0 = (v - self.rope_first_vec) * (self.vec // cs_vec)
                    for h in cutlass.range_constexpr(self.vec // cs_vec):
                        cute.autovec_copy(csv[(None, c0 + h)], tCrCS[None, h, i])

    @cute.jit
    def rotate(self, rY: cute.Tensor, rCS: cute.Tensor):
        """Rotate the vector's adjacent pairs ``(a, b)`` by their ``(cos, sin)`` (``rCS``, FP32,
        loaded with the row): ``(a cos - b sin, a sin + b cos)`` in FP32, one rounding (the
        complex product of ``spec_decode.model.rope``)."""
        for j in cutlass.range_constexpr(self.vec // 2):
            a, b = Float32(rY[2 * j]), Float32(rY[2 * j + 1])
            c, sn = rCS[2 * j], rCS[2 * j + 1]
            rY[2 * j] = (a * c - b * sn).to(self.dtype)
            rY[2 * j + 1] = (a * sn + b * c).to(self.dtype)


def _build(arch: str, *, hidden: int, dtype: str = "bfloat16", weighted: bool = True, rope_dim: int = 0,
           loads_per_thread: int = LOADS_PER_THREAD):
    """``loads_per_thread`` (a variant; the entry points take the default): see ``RowRms``."""
    if not RowRms.can_implement(hidden, dtype):
        raise ValueError(f"rms_norm: unsupported hidden={hidden}, dtype={dtype}")
    cdt = NAME2CUTE[dtype]
    P = jit.fake_gmem_ptr
    args = (P(cdt, 16), P(cdt, 16), P(Float32, 16), P(cdt, 16), Int32(1), Int32(1), Float32(1e-6), jit.fake_stream())
    return RmsNorm(cdt, hidden, weighted, rope_dim, loads_per_thread), args


def _build_tensors(arch: str, *, hidden: int, dtype: str = "bfloat16", weighted: bool = True, rope_dim: int = 0,
                   rank: int = 2):
    op, _ = _build(arch, hidden=hidden, dtype=dtype, weighted=weighted, rope_dim=rope_dim)
    if rank not in (2, 3):
        raise ValueError(f"rms_norm tensor entry: rank={rank} must be 2 ([rows, C]) or 3 ([T, H, C])")
    sym, cdt, T = {}, NAME2CUTE[dtype], jit.fake_tensor
    rows = ("R", hidden) if rank == 2 else ("R", "H", hidden)
    x, y = T(cdt, rows, 16, sym), T(cdt, rows, 16, sym)
    w, cs = T(cdt, (hidden,), 16, sym), T(Float32, ("R", rope_dim // 2, 2), 16, sym)
    tail = (Float32(1e-6), jit.fake_env_stream())
    if weighted and rope_dim:
        return op.tensor_call_weighted_rotated, (x, w, cs, y) + tail
    if weighted:
        return op.tensor_call, (x, w, y) + tail
    if rope_dim:
        return op.tensor_call_rotated, (x, cs, y) + tail
    return op.tensor_call_plain, (x, y) + tail


def tensor_entry_config(c: dict) -> dict:
    """The tensor entry's config serving an AOT config ``c`` of the kernel in its natural form:
    a rotated, unweighted norm is the per-head one (``[T, H, C]``), the others ``[rows, C]``."""
    return dict(c, rank=3 if c.get("rope_dim") and not c.get("weighted", True) else 2)


KERNEL = jit.register(
    jit.KernelDef(
        name="rms_norm",
        build=_build,
        sources=(os.path.abspath(__file__), os.path.join(os.path.dirname(os.path.abspath(__file__)), "row_rms.py")),
        archs=("sm_90a", "sm_100a", "sm_103a"),
        # DeepSeek-V4's norms: hidden 4096 / 7168 and q-LoRA 1024 / 1536 (Flash / Pro); the KV
        # rows and compressed entries (512, weighted, RoPE on the last 64), the queries per head
        # (512, no weight, RoPE), the indexer's entries (128, RoPE)
        aot_configs=tuple({"hidden": c, "dtype": "bfloat16", "weighted": w, "rope_dim": r}
                          for c, w, r in ((4096, True, 0), (7168, True, 0), (1024, True, 0), (1536, True, 0),
                                          (512, True, 64), (512, False, 64), (128, True, 64))),
        description="RMSNorm (statistic, rounding, weight, optional RoPE) in one launch, bf16 / fp16",
    )
)


jit.register_tensor_entry(KERNEL, _build_tensors,
                          description="rms_norm ([rows, C] or [T, H, C], weighted or not, rotated or not) through "
                                      "TVM-FFI",
                          aot_configs=tuple(tensor_entry_config(c) for c in KERNEL.aot_configs))
#: (dtype, x.shape[1:], no weight, rotate.shape[1:] or None, device index) -> the tensor entry
#: (jit.launch_tensor_entry)
_TENSOR_FNS: dict = {}


def rms_norm_torch(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None,
                   rotate: torch.Tensor | None = None) -> torch.Tensor:
    """The op in PyTorch (the rounding points above): the fallback for devices without a CuTe
    path (not the test reference: tests/references.py)."""
    y = x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
    y = y if weight is None else y * weight
    if rotate is None:
        return y
    r, C = 2 * rotate.shape[1], y.shape[-1]
    rows = y.reshape(-1, C)
    cs = rotate.repeat_interleave(rows.shape[0] // rotate.shape[0], 0)  # each row's token's (cos, sin)
    a, b = rows[:, C - r::2].float(), rows[:, C - r + 1::2].float()
    c, sn = cs[..., 0], cs[..., 1]
    rot = torch.stack([a * c - b * sn, a * sn + b * c], -1).flatten(-2).to(y.dtype)
    return torch.cat([rows[:, :C - r], rot], -1).view(y.shape)


def rms_norm(x: torch.Tensor, eps: float = 1e-6, weight: torch.Tensor | None = None, *,
             rotate: torch.Tensor | None = None, out: torch.Tensor | None = None, stream=None,
             arch: str | None = None) -> torch.Tensor:
    """RMSNorm of bf16 / fp16 ``x [..., C]`` over its last dim, times ``weight [C]`` if given,
    in x's dtype with the composite's rounding points (module docstring).

    ``rotate`` (FP32 ``[tokens, r / 2, 2]``: each token's (cos, sin) per pair, contiguous)
    then rotates the last ``r`` features of every row in adjacent pairs -- RoPE, one rounding;
    the rows are ``tokens`` groups of ``x.numel() / C / tokens`` consecutive rows (a token's
    heads). ``out`` (x's shape and dtype) makes the call allocation-free; ``stream`` defaults
    to torch's current stream. Capturable in a CUDA graph.
    """
    if (out is not None and stream is None and arch is None and jit.TVM_FFI and isinstance(x, torch.Tensor)
            and (rotate is None or isinstance(rotate, torch.Tensor))):  # the eager hot path
        shape = x.shape  # (the C checks: dtypes, extents, strides, alignment, device)
        if 2 <= len(shape) <= 3 and shape[0] and x.numel() < 2**31 and isinstance(eps, float) and eps >= 0:
            key = (x.dtype, shape[1:], weight is None, None if rotate is None else rotate.shape[1:], x.get_device())
            args = (x,) + ((weight,) if weight is not None else ()) + ((rotate,) if rotate is not None else ())
            if jit.launch_tensor_entry(_TENSOR_FNS, key, *args, out, eps):
                return out
    op = "rms_norm"
    check_tensor(op, "x", x, dtype=tuple(TORCH2CUTE), contiguous=True, align_bytes=0)
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
    rows = x.numel() // C
    rope_dim, per_token = 0, 1
    if rotate is not None:
        check_tensor(op, "rotate", rotate, dtype=torch.float32, ndim=3, contiguous=True, align_bytes=0)
        tokens, half, two = rotate.shape
        rope_dim = 2 * half
        if two != 2 or rope_dim % 8 or rope_dim > C:
            raise ValueError(f"{op}: rotate must be [tokens, r/2, 2] with r a multiple of 8 and <= {C}, got "
                             f"{list(rotate.shape)}")
        if rotate.data_ptr() % 16:  # contiguous, r a multiple of 8: every token's row 16-byte aligned
            raise ValueError(f"{op}: rotate data pointer must be 16-byte aligned")
        if tokens == 0 or rows % tokens:
            raise ValueError(f"{op}: x's {rows} rows are not {tokens} tokens' groups of equal size (rotate.shape[0])")
        per_token = rows // tokens
    if out is None:
        out = torch.empty_like(x)
    else:
        check_tensor(op, "out", out, dtype=x.dtype, shape=tuple(x.shape), contiguous=True, align_bytes=16)
    check_cuda(op, ("x", x), ("out", out), *((("weight", weight),) if weight is not None else ()),
               *((("rotate", rotate),) if rotate is not None else ()))
    a = arch if arch is not None else current_arch(x.device)
    if dispatch(op, ("portable", "reference"), arch=a) == "reference":
        out.copy_(rms_norm_torch(x, eps, weight, rotate))
        return out
    if rows == 0:
        return out
    cdt = TORCH2CUTE[x.dtype]
    fn = jit.get_kernel(op, a, hidden=C, dtype=str(x.dtype).replace("torch.", ""), weighted=weight is not None,
                        rope_dim=rope_dim)
    P = jit.gmem_ptr
    fn(P(cdt, x, 16), P(cdt, weight if weight is not None else x, 16), P(Float32, rotate if rotate is not None else x, 16),
       P(cdt, out, 16), jit.i32(rows), jit.i32(per_token), jit.f32(eps), jit.cu_stream(stream))
    if (stream is None and arch is None and x.dim() in (2, 3)
            and (rotate is None or rotate.shape[0] == x.shape[0])):  # a natural form: its tensor entry next time
        key = (x.dtype, x.shape[1:], weight is None, None if rotate is None else rotate.shape[1:], x.get_device())
        jit.remember_tensor_entry(_TENSOR_FNS, key, "rms_norm_tensors", a, **tensor_entry_config(
            dict(hidden=C, dtype=str(x.dtype).replace("torch.", ""), weighted=weight is not None, rope_dim=rope_dim,
                 rank=x.dim())))
    return out
