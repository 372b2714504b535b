"""Masked row softmax: the sparse-attention core's probabilities over a latent KV pool row.

``probs[..., h, j] = softmax_j(where(mask[..., j], scores[..., h, j], -inf))`` for scores
``[*lead, H, M]`` and a key-selection mask ``[*lead, W]`` (``W >= M``) shared by the ``H``
query heads of one token: the core of a masked-dense sparse attention over an MLA-style latent
cache -- ``[R, S, H, M]`` bf16 scores from one batched matmul, this kernel, then a second
matmul -- where PyTorch's composite (``masked_fill_`` then ``softmax``) makes three passes over
the scores. (The decode runtime used it with its earlier DeepSeek-V3-shaped model; DeepSeek-V4's
window + compressed attention does not.)

Algorithm. One CTA per ``(lead, h)`` row. Thread ``i`` loads the 16-byte score vectors ``i,
i+nt, ...`` (8 elements) and the matching 8-byte mask vectors into registers, all loads issued
before the first use; masked entries become ``-inf``; the row max and then the sum of
``exp2((x - max) * log2 e)`` are reduced by warp shuffles and one shared-memory exchange each
(every warp re-reduces the partials, so no broadcast barrier); the probabilities are written
back in the input dtype -- in place when ``out`` is ``scores``. One read and one write of the
scores, one read of the mask per head (L2-resident: H rows share it).

Numerics. FP32 inside, one rounding to bf16/fp16 at the end -- the same rounding point as
``torch.softmax`` on bf16 scores (its accumulation is FP32 too); ``exp2`` is the approximate
``ex2`` (2 ulp), far below the output rounding. A row whose mask selects nothing is written
as zeros (``torch.softmax`` gives NaN there; the attention core never produces one: every
token selects at least itself).

Constraints. ``scores`` and ``out`` contiguous, 16-byte aligned; ``M % 8 == 0``, ``8 <= M <=
65536``; ``mask`` bool, contiguous, ``W % 8 == 0``, ``W >= M`` (columns past ``M`` are
ignored); static ``(M, H, W)`` -- one compile per KV pool length -- and a runtime row count
(one compile serves every batch size). No tensor cores: the same source compiles for
sm_90a and sm_100a.

Run the tests / benchmark::

    pytest tests/test_masked_softmax.py
    python bench/bench_masked_softmax.py     # on a GPU; the table for bench/RESULTS.md
"""

from __future__ import annotations

import math
import os

import torch

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint8, const_expr

from . import jit
from .arch import current_arch, dispatch
from .validate import check_cuda, check_int32_indexable, check_tensor

_TORCH2CUTE = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}
_NAME2CUTE = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}
MAX_LENGTH = 65536
_LOG2E = math.log2(math.e)


class MaskedSoftmax:
    """Compile-time configuration: element type, row length ``M``, heads per mask row ``H``,
    mask row stride ``W``."""

    def __init__(self, dtype: type[cutlass.Numeric], length: int, heads: int, mask_stride: int):
        self.dtype, self.length, self.heads, self.mask_stride = dtype, length, heads, mask_stride
        self.vec = 128 // dtype.width  # elements per 16-byte load (8 mask bytes)
        self.n_vec = length // self.vec
        # enough threads that each keeps <= 8 score loads in flight; at least 4 warps
        self.threads = min(1024, max(128, -(-self.n_vec // 8 + 31) // 32 * 32))
        self.iters = -(-self.n_vec // self.threads)
        self.warps = self.threads // 32

    @cute.jit
    def __call__(self, scores_ptr: cute.Pointer, mask_ptr: cute.Pointer, out_ptr: cute.Pointer, mask_rows: Int32,
                 stream: cuda.CUstream):
        rows = mask_rows * self.heads
        mS = cute.make_tensor(scores_ptr, cute.make_layout((rows, self.length), stride=(self.length, 1)))
        mM = cute.make_tensor(mask_ptr, cute.make_layout((mask_rows, self.length), stride=(self.mask_stride, 1)))
        mO = cute.make_tensor(out_ptr, cute.make_layout((rows, self.length), stride=(self.length, 1)))
        self.kernel(mS, mM, mO).launch(grid=[rows, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.jit
    def tensor_call(self, mS: cute.Tensor, mM: cute.Tensor, mO: cute.Tensor, stream: cuda.CUstream):
        """The tensor entry (``jit.get_tensor_kernel``) of the one- or two-lead-dim form: ``mS`` /
        ``mO [R, heads, length]`` or ``[B, S, heads, length]``, the bool ``mM [R, mask_stride]``
        or ``[B, S, mask_stride]`` (read as bytes)."""
        rows = mM.shape[0]
        if const_expr(cute.rank(mM.shape) == 3):
            rows = mM.shape[0] * mM.shape[1]
        self.__call__(mS.iterator, cute.recast_ptr(mM.iterator, dtype=Uint8), mO.iterator, rows, stream)

    @cute.kernel
    def kernel(self, mS: cute.Tensor, mM: cute.Tensor, mO: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        # ((vec), (n_vec)): mode 0 one 16-byte score vector / 8-byte mask vector, aligned because
        # M % 8 == 0, W % 8 == 0 and the base pointers are 16- / 8-byte aligned
        gS = cute.zipped_divide(mS[row, None], (self.vec,))
        gM = cute.zipped_divide(mM[row // self.heads, None], (self.vec,))
        gO = cute.zipped_divide(mO[row, None], (self.vec,))
        tSrS = cute.make_rmem_tensor(cute.make_layout((self.vec, self.iters)), self.dtype)
        tMrM = cute.make_rmem_tensor(cute.make_layout((self.vec, self.iters)), Uint8)
        tSrS.fill(0.0)
        tMrM.fill(0)  # vectors past the row stay unselected: -inf below
        for i in cutlass.range_constexpr(self.iters):
            v = tidx + i * self.threads
            if v < self.n_vec:
                cute.autovec_copy(gS[(None, v)], tSrS[None, i])
                cute.autovec_copy(gM[(None, v)], tMrM[None, i])
        x = cute.where(tMrM.load() != Uint8(0), tSrS.load().to(Float32), Float32(-math.inf))

        smem = cutlass.memory.SmemAllocator()
        sMax = smem.allocate_tensor(Float32, cute.make_layout(self.warps), 4)
        sSum = smem.allocate_tensor(Float32, cute.make_layout(self.warps), 4)
        warp, lane = cute.arch.warp_idx(), cute.arch.lane_idx()

        # The max and sum block reductions are written out separately on purpose: one shared
        # helper for both measured 10% slower at the BS64 shape on the H200.
        row_max = cute.arch.warp_reduction_max(x.reduce(cute.ReductionOp.MAX, Float32(-math.inf), 0))
        if lane == 0:
            sMax[warp] = row_max
        # every warp's max in shared memory before any warp re-reduces them
        cute.arch.barrier()
        row_max = Float32(-math.inf)
        if lane < self.warps:
            row_max = sMax[lane]
        row_max = cute.arch.warp_reduction_max(row_max)
        if row_max == Float32(-math.inf):
            row_max = Float32(0.0)  # nothing selected: exp2(-inf) = 0 everywhere, no NaN

        e = cute.math.exp2((x - row_max) * Float32(_LOG2E), fastmath=True)
        row_sum = cute.arch.warp_reduction_sum(e.reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
        if lane == 0:
            sSum[warp] = row_sum
        cute.arch.barrier()
        row_sum = Float32(0.0)
        if lane < self.warps:
            row_sum = sSum[lane]
        row_sum = cute.arch.warp_reduction_sum(row_sum)
        inv = Float32(0.0)
        if row_sum > Float32(0.0):
            inv = cute.arch.rcp_approx(row_sum)

        tOrO = cute.make_rmem_tensor(cute.make_layout((self.vec, self.iters)), self.dtype)
        tOrO.store((e * inv).to(self.dtype))
        for i in cutlass.range_constexpr(self.iters):
            v = tidx + i * self.threads
            if v < self.n_vec:
                cute.autovec_copy(tOrO[None, i], gO[(None, v)])

    @staticmethod
    def compile(arch: str, length: int, heads: int, mask_stride: int, dtype: str = "bfloat16"):
        """The compiled function (through the shared cache) for one pool length and head count."""
        return jit.get_kernel("masked_softmax", arch, length=length, heads=heads, mask_stride=mask_stride,
                              dtype=dtype)

    @staticmethod
    def can_implement(length: int, heads: int, mask_stride: int, dtype: str = "bfloat16") -> bool:
        return (dtype in _NAME2CUTE and length % 8 == 0 and 8 <= length <= MAX_LENGTH and heads >= 1
                and mask_stride % 8 == 0 and mask_stride >= length)


def _build(arch: str, *, length: int, heads: int, mask_stride: int, dtype: str = "bfloat16"):
    if not MaskedSoftmax.can_implement(length, heads, mask_stride, dtype):
        raise ValueError(f"masked_softmax: unsupported length={length}, heads={heads}, mask_stride={mask_stride}, "
                         f"dtype={dtype}")
    cdt = _NAME2CUTE[dtype]
    args = (jit.fake_gmem_ptr(cdt, 16), jit.fake_gmem_ptr(Uint8, 8), jit.fake_gmem_ptr(cdt, 16), Int32(1),
            jit.fake_stream())
    return MaskedSoftmax(cdt, length, heads, mask_stride), args


KERNEL = jit.register(
    jit.KernelDef(
        name="masked_softmax",
        build=_build,
        sources=(os.path.abspath(__file__),),
        archs=("sm_90a", "sm_100a", "sm_103a"),
        # 128 heads over KV pools of 592 and 6160 keys (the earlier V3-shaped runtime's bench
        # lengths; the peer bench's shapes), mask rows padded to 16 with one spare column
        aot_configs=tuple({"length": M, "heads": 128, "mask_stride": W, "dtype": "bfloat16"}
                          for M, W in ((592, 608), (6160, 6176))),
        description="softmax over a row of scores with a per-token key mask, bf16 in/out",
    )
)


def _build_tensors(arch: str, *, length: int, heads: int, mask_stride: int, dtype: str = "bfloat16",
                   lead_dims: int = 1):
    op, _ = _build(arch, length=length, heads=heads, mask_stride=mask_stride, dtype=dtype)
    if lead_dims not in (1, 2):
        raise ValueError(f"masked_softmax tensor entry: lead_dims={lead_dims} must be 1 or 2")
    sym, cdt = {}, _NAME2CUTE[dtype]
    lead = ("R",) if lead_dims == 1 else ("B", "S")
    scores = lead + (heads, length)
    args = (jit.fake_tensor(cdt, scores, 16, sym), jit.fake_tensor(cutlass.Boolean, lead + (mask_stride,), 8, sym),
            jit.fake_tensor(cdt, scores, 16, sym), jit.fake_env_stream())
    return op.tensor_call, args


jit.register_tensor_entry(KERNEL, _build_tensors,
                          description="masked_softmax (scores [*lead, H, M], mask [*lead, W], one or two lead dims) "
                                      "through TVM-FFI",
                          aot_configs=KERNEL.aot_configs)
#: (dtype, (heads, length), mask.shape[-1], scores.dim(), device index) -> the tensor entry
#: (jit.launch_tensor_entry)
_TENSOR_FNS: dict = {}


def masked_softmax_torch(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The op in PyTorch: the fallback for devices without a CuTe path and the custom op's CPU
    kernel (not the test reference: tests/references.py)."""
    M = scores.shape[-1]
    x = scores.float().masked_fill(~mask[..., None, :M], float("-inf"))
    p = x.softmax(-1).nan_to_num_(0.0)
    return p.to(scores.dtype)


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor, *, out: torch.Tensor | None = None, stream=None,
                   arch: str | None = None) -> torch.Tensor:
    """Softmax over the last dim of ``scores [*lead, H, M]`` (bf16/fp16) where the bool
    ``mask [*lead, W]`` (``W >= M``; ``mask[..., :M]`` used) selects the keys, ``-inf``
    elsewhere; a row selecting nothing is zeros.

    ``out`` (same shape and dtype as ``scores``; ``scores`` itself for in place) makes the
    call allocation-free; ``stream`` defaults to torch's current stream. Capturable in a CUDA
    graph.
    """
    if (out is not None and stream is None and arch is None and jit.TVM_FFI and isinstance(scores, torch.Tensor)
            and isinstance(mask, torch.Tensor)):  # the eager hot path (3-D or 4-D scores)
        shape = scores.shape  # (the C checks: dtypes, extents, strides, alignment, device)
        if (3 <= len(shape) <= 4 and shape[0] and scores.numel() < 2**31 and mask.dim() == len(shape) - 1
                and jit.launch_tensor_entry(_TENSOR_FNS, (scores.dtype, shape[len(shape) - 2:], mask.shape[-1],
                                                          len(shape), scores.get_device()), scores, mask, out)):
            return out
    op = "masked_softmax"
    check_tensor(op, "scores", scores, dtype=tuple(_TORCH2CUTE), contiguous=True, align_bytes=0)
    if scores.dim() < 2:
        raise ValueError(f"{op}: scores must be [*lead, heads, length], got shape {tuple(scores.shape)}")
    *lead, H, M = scores.shape
    check_tensor(op, "mask", mask, dtype=torch.bool, ndim=len(lead) + 1, contiguous=True, align_bytes=0)
    if tuple(mask.shape[:-1]) != tuple(lead):
        raise ValueError(f"{op}: mask must be [*lead, W] with lead = scores.shape[:-2] = {tuple(lead)}, "
                         f"got shape {tuple(mask.shape)}")
    W = mask.shape[-1]
    if M % 8 or not 8 <= M <= MAX_LENGTH:
        raise ValueError(f"{op}: scores.shape[-1]={M} must be a multiple of 8 in [8, {MAX_LENGTH}]")
    if W < M or W % 8:
        raise ValueError(f"{op}: mask.shape[-1]={W} must be a multiple of 8 and >= scores.shape[-1]={M}")
    check_tensor(op, "scores", scores, align_bytes=16)
    check_tensor(op, "mask", mask, align_bytes=8)
    check_int32_indexable(op, "scores", scores.numel())
    check_int32_indexable(op, "mask", mask.numel())
    if out is None:
        out = torch.empty_like(scores)
    else:
        check_tensor(op, "out", out, dtype=scores.dtype, shape=tuple(scores.shape), contiguous=True, align_bytes=16)
    check_cuda(op, ("scores", scores), ("mask", mask), ("out", out))
    a = arch if arch is not None else current_arch(scores.device)
    if dispatch(op, ("portable", "reference"), arch=a) == "reference":
        out.copy_(masked_softmax_torch(scores, mask))
        return out
    mask_rows = mask.numel() // W
    if mask_rows == 0 or H == 0:
        return out
    fn = MaskedSoftmax.compile(a, M, H, W, str(scores.dtype).replace("torch.", ""))
    cdt = _TORCH2CUTE[scores.dtype]
    fn(jit.gmem_ptr(cdt, scores, 16), jit.gmem_ptr(Uint8, mask, 8), jit.gmem_ptr(cdt, out, 16), jit.i32(mask_rows),
       jit.cu_stream(stream))
    if scores.dim() in (3, 4) and stream is None and arch is None:
        jit.remember_tensor_entry(_TENSOR_FNS, (scores.dtype, (H, M), W, scores.dim(), scores.get_device()),
                                  "masked_softmax_tensors", a, length=M, heads=H, mask_stride=W,
                                  dtype=str(scores.dtype).replace("torch.", ""), lead_dims=scores.dim() - 2)
    return out
