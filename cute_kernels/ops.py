"""This package's kernels as PyTorch custom ops: ``torch.ops.cute_kernels.<name>``.

Importing this module registers them (``import cute_kernels.ops``; :mod:`moe.ops` adds the MoE
kernels). Each op has

* a CUDA implementation -- the documented Python entry point of the kernel (validation,
  compile cache, launch on torch's current stream);
* a CPU implementation written from the op's definition in PyTorch (the same contract:
  shapes, dtypes, rounding points where the kernel documents them), so the ops run and are
  checked without a GPU;
* a fake (meta) implementation giving the outputs' shapes and dtypes, so ``torch.compile``
  traces through the ops without graph breaks (``fullgraph=True``).

Functional ops return fresh tensors; ``*_out`` ops write a caller's ``out`` (declared as
mutated) and return nothing -- the allocation-free form CUDA graphs want. The plain Python
functions (``cute_kernels.row_rms.row_rms``, ...) stay the documented API; the ops call them.
Under ``torch.compile(mode="reduce-overhead")`` (CUDA graphs), call a block once eagerly first:
``wo_a``'s split decode kernel and ``wo_a_fp8`` keep a default workspace per device, created
on first use, which must not be allocated inside the graph's memory pool (``mhc_stats`` and
:mod:`moe.ops`' ``moe_route`` take a fresh one per call).

Ops: ``rms_norm`` / ``rms_norm_out``, ``row_rms`` / ``row_rms_out``, ``masked_softmax`` / ``masked_softmax_out``, ``mhc_stats``,
``mhc_pre_mix`` / ``mhc_pre_mix_out``, ``mhc_post_mix`` / ``mhc_post_mix_`` (the residual
update in place), ``wo_a`` / ``wo_a_out``, ``dequantize_fp8_blockwise``, ``indexer_topk``,
``wo_a_fp8``, ``wo_a_fp8_act``, ``draft_head_scores_out``, ``sink_attention``, ``compressor_pool_`` (ring and pool
in place). The push all-reduce's ops (``push_allreduce``,
``finalize_shared_allreduce``, a group handle for the peer buffers) are in :mod:`comm.ops`.

Test::

    pytest tests/test_ops.py
"""

from __future__ import annotations

import torch

from . import compressor_pool as _cp
from . import dequant_fp8_blockwise as _dq
from . import draft_head_fp8 as _dh
from . import indexer_topk as _idx
from . import masked_softmax as _ms
from . import mhc_post_mix as _post
from . import mhc_pre_mix as _pre
from . import mhc_stats as _stats
from . import rms_norm as _norm
from . import row_rms as _rms
from . import sink_attention as _attn
from . import wo_a as _wo
from . import wo_a_decode_fp8 as _wo8
from . import wo_a_fp8_act_sm90 as _wo8a

NS = "cute_kernels"
Tensor = torch.Tensor
#: the namespace's library: every op of this package (here, :mod:`moe.ops`, :mod:`comm.ops`)
LIB = torch.library.Library(NS, "DEF")


class CudaOp:
    """A custom op ``cute_kernels::<name>`` defined on :data:`LIB` from ``fn``'s annotations
    (``torch.library.infer_schema``; ``mutates`` marks the arguments written in place), with
    ``fn`` as its CUDA kernel. ``register_kernel("cpu")`` and ``register_fake`` add the CPU and
    fake (meta) kernels, as on ``torch.library.custom_op``'s objects; calling it calls the op.

    Why not ``torch.library.custom_op``: its Python autograd and in-place-view wrappers run on
    every eager call and cost several times a plain ``Library`` definition's dispatch -- more
    than these kernels take at decode sizes (``bench/bench_host_cost.py``, its custom-op
    column). These are inference ops: no autograd formula is registered, as with
    ``custom_op`` without ``register_autograd``."""

    def __init__(self, name: str, fn, mutates=()):
        self.name = name
        LIB.define(name + torch.library.infer_schema(fn, mutates_args=mutates))
        LIB.impl(name, fn, "CUDA")
        self._op = getattr(getattr(torch.ops, NS), name).default
        self.__doc__, self.__wrapped__ = fn.__doc__, fn

    def register_kernel(self, device_type: str):
        if device_type != "cpu":
            raise ValueError(f"{NS}::{self.name}: only a 'cpu' kernel is registered this way, got {device_type!r}")

        def register(fn):
            LIB.impl(self.name, fn, "CPU")
            return fn
        return register

    def register_fake(self, fn):
        torch.library.register_fake(f"{NS}::{self.name}", fn, lib=LIB)
        return fn

    def __call__(self, *args, **kwargs):
        return self._op(*args, **kwargs)


def _like(x: Tensor) -> Tensor:
    """A contiguous output of ``x``'s shape and dtype. The functional ops allocate their outputs
    and call the entry point's ``out=`` form: the form whose eager hot path (a memoised tensor
    entry with TVM-FFI on) skips the Python validation after a first validated call."""
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _wo_a_out(o: Tensor, w: Tensor) -> Tensor | None:
    """WO-A's token-major ``y [T, G*R]`` bf16, or None for operands of the wrong rank (the
    entry point names the error)."""
    if o.dim() != 3 or w.dim() != 3:
        return None
    return o.new_empty(o.shape[0], w.shape[0] * w.shape[1], dtype=torch.bfloat16)


def cuda_op(name: str, mutates=()):
    """Decorator: ``fn`` as the CUDA kernel of the custom op ``cute_kernels::<name>`` (a
    :class:`CudaOp`)."""
    return lambda fn: CudaOp(name, fn, mutates)



# --------------------------------------------------------------------------- rms_norm ----
@cuda_op("rms_norm")
def rms_norm(x: Tensor, eps: float, weight: Tensor | None = None, rotate: Tensor | None = None) -> Tensor:
    """RMSNorm of bf16/fp16 ``x [..., C]`` times ``weight [C]`` if given, in x's dtype; with
    ``rotate`` (FP32 ``[tokens, r/2, 2]`` cos / sin) RoPE on the last r features."""
    return _norm.rms_norm(x, eps, weight, rotate=rotate, out=_like(x))


rms_norm.register_kernel("cpu")(_norm.rms_norm_torch)


@rms_norm.register_fake
def _(x, eps, weight=None, rotate=None):
    return torch.empty_like(x)


@cuda_op("rms_norm_out", mutates=("out",))
def rms_norm_out(x: Tensor, eps: float, weight: Tensor | None, rotate: Tensor | None, out: Tensor) -> None:
    _norm.rms_norm(x, eps, weight, rotate=rotate, out=out)


@rms_norm_out.register_kernel("cpu")
def _(x, eps, weight, rotate, out):
    out.copy_(_norm.rms_norm_torch(x, eps, weight, rotate))


@rms_norm_out.register_fake
def _(x, eps, weight, rotate, out):
    return None


# ---------------------------------------------------------------------------- row_rms ----
@cuda_op("row_rms")
def row_rms(x: Tensor, eps: float) -> Tensor:
    """``rsqrt(mean(x**2, -1) + eps)`` in FP32 of bf16/fp16 ``x [T, C]`` -> ``[T]``."""
    out = x.new_empty(x.shape[0], dtype=torch.float32) if x.dim() == 2 else None
    return _rms.row_rms(x, eps, out=out)


row_rms.register_kernel("cpu")(_rms.row_rms_torch)


@row_rms.register_fake
def _(x, eps):
    return x.new_empty(x.shape[0], dtype=torch.float32)


@cuda_op("row_rms_out", mutates=("out",))
def row_rms_out(x: Tensor, eps: float, out: Tensor) -> None:
    _rms.row_rms(x, eps, out=out)


@row_rms_out.register_kernel("cpu")
def _(x, eps, out):
    out.copy_(_rms.row_rms_torch(x, eps))


@row_rms_out.register_fake
def _(x, eps, out):
    return None


# --------------------------------------------------------------------- masked_softmax ----
@cuda_op("masked_softmax")
def masked_softmax(scores: Tensor, mask: Tensor) -> Tensor:
    """Softmax over the last dim of ``scores [*lead, H, M]`` where ``mask [*lead, W >= M]``
    selects the keys (``-inf`` elsewhere); a row selecting nothing is zeros."""
    return _ms.masked_softmax(scores, mask, out=_like(scores))


masked_softmax.register_kernel("cpu")(_ms.masked_softmax_torch)


@masked_softmax.register_fake
def _(scores, mask):
    return torch.empty_like(scores)


@cuda_op("masked_softmax_out", mutates=("out",))
def masked_softmax_out(scores: Tensor, mask: Tensor, out: Tensor) -> None:
    _ms.masked_softmax(scores, mask, out=out)


@masked_softmax_out.register_kernel("cpu")
def _(scores, mask, out):
    out.copy_(_ms.masked_softmax_torch(scores, mask))


@masked_softmax_out.register_fake
def _(scores, mask, out):
    return None


# ------------------------------------------------------------------------------- mHC ----
@cuda_op("mhc_stats")
def mhc_stats(x: Tensor, phi: Tensor, alpha: Tensor, bias: Tensor, eps: float, sinkhorn_iters: int,
              hc_eps: float) -> Tensor:
    """mHC mappings ``[T, 2n + n*n]`` fp32 of ``x [T, n, C]`` (see :mod:`cute_kernels.mhc_stats`)."""
    if x.dim() != 3:  # (the entry names the error)
        return _stats.mhc_stats(x, phi, alpha, bias, eps=eps, sinkhorn_iters=sinkhorn_iters, hc_eps=hc_eps)
    T, n = x.shape[:2]
    return _stats.mhc_stats(x, phi, alpha, bias, eps=eps, sinkhorn_iters=sinkhorn_iters, hc_eps=hc_eps,
                            workspace=_stats.MhcStatsWorkspace(n, T, device=x.device),  # (no state kept:
                            # nothing outlives a torch.compile CUDA-graph pool's recording)
                            out=x.new_empty(T, 2 * n + n * n, dtype=torch.float32))


@mhc_stats.register_kernel("cpu")
def _(x, phi, alpha, bias, eps, sinkhorn_iters, hc_eps):
    return _stats.mhc_stats_torch(x, phi, alpha, bias, eps, sinkhorn_iters, hc_eps)


@mhc_stats.register_fake
def _(x, phi, alpha, bias, eps, sinkhorn_iters, hc_eps):
    n = x.shape[1]
    return x.new_empty(x.shape[0], 2 * n + n * n, dtype=torch.float32)


def _pre_mix_cpu(x, h):
    T, n, C = x.shape
    acc = torch.zeros(T, C, dtype=torch.float32, device=x.device)
    for i in range(n):  # rounded products, summed in stream order (the kernel's sequence)
        acc = acc + h[:, i:i + 1] * x[:, i].float()
    return acc.to(torch.bfloat16)


def _post_mix_cpu(x, h, f):
    T, n, C = x.shape
    out = torch.empty_like(x)
    for i in range(n):
        acc = torch.zeros(T, C, dtype=torch.float32, device=x.device)
        for j in range(n):
            acc = acc + h[:, 2 * n + i * n + j:2 * n + i * n + j + 1] * x[:, j].float()
        out[:, i] = (acc + h[:, n + i:n + i + 1] * f.float()).to(x.dtype)
    return out


@cuda_op("mhc_pre_mix")
def mhc_pre_mix(x: Tensor, h: Tensor) -> Tensor:
    """``u[t] = sum_i H_pre[t, i] X[t, i]`` (bf16) of ``x [T, n, C]`` and mappings ``h``."""
    out = x.new_empty(x.shape[0], x.shape[2], dtype=torch.bfloat16) if x.dim() == 3 else None
    return _pre.mhc_pre_mix(x, h, out=out)


mhc_pre_mix.register_kernel("cpu")(_pre_mix_cpu)


@mhc_pre_mix.register_fake
def _(x, h):
    return x.new_empty(x.shape[0], x.shape[2])


@cuda_op("mhc_pre_mix_out", mutates=("out",))
def mhc_pre_mix_out(x: Tensor, h: Tensor, out: Tensor) -> None:
    _pre.mhc_pre_mix(x, h, out=out)


@mhc_pre_mix_out.register_kernel("cpu")
def _(x, h, out):
    out.copy_(_pre_mix_cpu(x, h))


@mhc_pre_mix_out.register_fake
def _(x, h, out):
    return None


@cuda_op("mhc_post_mix")
def mhc_post_mix(x: Tensor, h: Tensor, f: Tensor) -> Tensor:
    """``X'[t, i] = sum_j H_res[t, i, j] X[t, j] + H_post[t, i] F[t]`` (bf16)."""
    return _post.mhc_post_mix(x, h, f, out=_like(x))


mhc_post_mix.register_kernel("cpu")(_post_mix_cpu)


@mhc_post_mix.register_fake
def _(x, h, f):
    return torch.empty_like(x)


@cuda_op("mhc_post_mix_", mutates=("x",))
def mhc_post_mix_(x: Tensor, h: Tensor, f: Tensor) -> None:
    """:func:`mhc_post_mix` writing the residual streams ``x`` in place."""
    _post.mhc_post_mix(x, h, f, out=x)


@mhc_post_mix_.register_kernel("cpu")
def _(x, h, f):
    x.copy_(_post_mix_cpu(x, h, f))


@mhc_post_mix_.register_fake
def _(x, h, f):
    return None


# ------------------------------------------------------------------------------- WO-A ----
@cuda_op("wo_a")
def wo_a(o: Tensor, w: Tensor) -> Tensor:
    """Token-major ``y [T, G*R]`` bf16 of ``o [T, H, Dv]`` and ``w [G, R, (H/G) Dv]`` (the
    default route of :func:`cute_kernels.wo_a.wo_a`)."""
    return _wo.wo_a(o, w, out=_wo_a_out(o, w))


wo_a.register_kernel("cpu")(_wo.wo_a_torch)


@wo_a.register_fake
def _(o, w):
    return o.new_empty(o.shape[0], w.shape[0] * w.shape[1], dtype=torch.bfloat16)


@cuda_op("wo_a_out", mutates=("out",))
def wo_a_out(o: Tensor, w: Tensor, out: Tensor) -> None:
    _wo.wo_a(o, w, out=out)


@wo_a_out.register_kernel("cpu")
def _(o, w, out):
    _wo.wo_a_torch(o, w, out)


@wo_a_out.register_fake
def _(o, w, out):
    return None


# ------------------------------------------------------------------ FP8 dequantisation ----
@cuda_op("dequantize_fp8_blockwise")
def dequantize_fp8_blockwise(w: Tensor, scale: Tensor) -> Tensor:
    """bf16 ``w * scale`` of e4m3 ``w [..., N, K]`` with FP32 128 x 128 block scales."""
    return _dq.dequantize_fp8_blockwise(w, scale)


dequantize_fp8_blockwise.register_kernel("cpu")(_dq.dequantize_fp8_blockwise_torch)


@dequantize_fp8_blockwise.register_fake
def _(w, scale):
    return torch.empty(w.shape, dtype=torch.bfloat16, device=w.device)


# ---------------------------------------------------------------------------- indexer ----
def _indexer_topk_cpu(q, w, k_cache, kv_offset, kv_len, pos, topk, max_keys, compress_ratio):
    T = q.shape[0]
    R = k_cache.shape[0]
    out = torch.full((T, topk), -1, dtype=torch.int32)
    for t in range(T):
        p = int(pos[t])
        visible = (p + 1) // compress_ratio if compress_ratio > 1 else p + 1
        n = max(0, min(visible, int(kv_len[t]), max_keys, R - int(kv_offset[t])))
        if n == 0:
            continue
        keys = k_cache[int(kv_offset[t]):int(kv_offset[t]) + n].float()
        score = (torch.relu(keys @ q[t].float().T) * w[t].float()).sum(-1)  # sum_h w_h relu(q_h . k)
        sel = torch.sort(score, descending=True, stable=True).indices[:topk]  # ties: the lower key
        out[t, :sel.numel()] = sel.sort().values.int()
    return out


@cuda_op("indexer_topk")
def indexer_topk(q: Tensor, w: Tensor, k_cache: Tensor, kv_offset: Tensor, kv_len: Tensor, pos: Tensor, topk: int,
                 max_keys: int, compress_ratio: int) -> Tensor:
    """Top-``topk`` candidate keys per token (int32 ``[T, topk]``, ascending, -1 padded) of the
    Lightning Indexer's scores ``sum_h w[t, h] relu(q[t, h] . k)`` over key ``s`` of row
    ``kv_offset[t] + s``, candidates ``s < min(visible(pos), kv_len, max_keys)`` (visible:
    ``pos + 1`` raw keys, or ``(pos + 1) // compress_ratio`` compressed entries)."""
    return _idx.indexer_topk(q, w, k_cache, kv_offset, kv_len, pos, topk=topk, max_keys=max_keys,
                             compress_ratio=compress_ratio)


indexer_topk.register_kernel("cpu")(_indexer_topk_cpu)


@indexer_topk.register_fake
def _(q, w, k_cache, kv_offset, kv_len, pos, topk, max_keys, compress_ratio):
    return q.new_empty(q.shape[0], topk, dtype=torch.int32)


# ----------------------------------------------------------------------- WO-A FP8 ----
@cuda_op("wo_a_fp8")
def wo_a_fp8(o: Tensor, w: Tensor, scale: Tensor) -> Tensor:
    """Token-major ``y [T, G*R]`` bf16 of ``o`` and e4m3 ``w [G, R, Dg]`` with FP32 128 x 128
    block ``scale`` (:func:`cute_kernels.wo_a_decode_fp8.wo_a_fp8`)."""
    return _wo8.wo_a_fp8(o, w, scale, out=_wo_a_out(o, w))


@wo_a_fp8.register_kernel("cpu")
def _(o, w, scale):
    return _wo8.wo_a_fp8_reference(o, w, scale).to(torch.bfloat16)


@wo_a_fp8.register_fake
def _(o, w, scale):
    return o.new_empty(o.shape[0], w.shape[0] * w.shape[1], dtype=torch.bfloat16)


@cuda_op("wo_a_fp8_act")
def wo_a_fp8_act(q: Tensor, q_scales: Tensor, w: Tensor, w_scale: Tensor) -> Tensor:
    """Token-major ``y [T, G*R]`` bf16 of MXFP8 activations ``q [T, H, Dv]`` (e4m3) with UE8M0
    ``q_scales [T, H*Dv/32]`` and e4m3 ``w [G, R, Dg]`` with FP32 128 x 128 block ``w_scale``
    (:func:`cute_kernels.wo_a_fp8_act_sm90.wo_a_fp8_act`; Hopper, T <= 64)."""
    return _wo8a.wo_a_fp8_act(q, q_scales, w, w_scale, out=_wo_a_out(q, w))


@wo_a_fp8_act.register_kernel("cpu")
def _(q, q_scales, w, w_scale):
    return _wo8a.wo_a_fp8_act_reference(q, q_scales, w, w_scale)


@wo_a_fp8_act.register_fake
def _(q, q_scales, w, w_scale):
    return q.new_empty(q.shape[0], w.shape[0] * w.shape[1], dtype=torch.bfloat16)


# --------------------------------------------------------------------- draft head ----
@cuda_op("draft_head_scores_out", mutates=("h_q", "out"))
def draft_head_scores_out(h: Tensor, w_q: Tensor, h_q: Tensor, out: Tensor) -> None:
    """``out[:B]`` = bf16 scores whose per-row argmax is the draft token (rows of ``h`` scaled
    to e4m3 into ``h_q``, times the per-tensor-scaled e4m3 head ``w_q``)."""
    _dh.draft_head_scores(h, w_q, h_q=h_q, out=out)


@draft_head_scores_out.register_kernel("cpu")
def _(h, w_q, h_q, out):
    _dh.quantize_rows(h, h_q)
    B = h.shape[0]
    out[:B].copy_((h_q[:B].float() @ w_q.float().T).to(torch.bfloat16))


@draft_head_scores_out.register_fake
def _(h, w_q, h_q, out):
    return None


# ---------------------------------------------------------------------- attention ----
@cuda_op("sink_attention")
def sink_attention(q: Tensor, kv: Tensor, rows: Tensor, sink: Tensor, scale: float,
                   rotate: Tensor | None = None) -> Tensor:
    """Decode attention of ``q [T, H, D]`` over the K = V rows ``kv[rows[t]]`` (-1: masked) with
    a learned ``sink [H]`` logit, ``rotate`` (FP32 ``[T, r/2, 2]``) applied to the output's
    last r features. Allocates its output and split workspace (the Python function takes
    both preallocated)."""
    return _attn.sink_attention(q, kv, rows, sink, scale, rotate=rotate)


@sink_attention.register_kernel("cpu")
def _(q, kv, rows, sink, scale, rotate=None):
    return _attn.sink_attention_torch(q, kv, rows, sink, scale, rotate)


@sink_attention.register_fake
def _(q, kv, rows, sink, scale, rotate=None):
    return torch.empty_like(q)


# --------------------------------------------------------------------- compressor ----
@cuda_op("compressor_pool_", mutates=("ring", "pool"))
def compressor_pool_(fresh: Tensor, ring: Tensor, pool: Tensor, ape: Tensor, norm_weight: Tensor,
                     rotate: Tensor | None, pos: Tensor, slot: Tensor, ratio: int, overlap: bool, eps: float,
                     tokens_per_request: int) -> None:
    """DeepSeek-V4's compressor step in place: the closing tokens' entries into ``pool``, every
    token's raw row into ``ring``."""
    _cp.compressor_pool(fresh, ring, pool, ape, norm_weight, rotate, pos, slot, ratio=ratio, overlap=overlap,
                        eps=eps, tokens_per_request=tokens_per_request)


@compressor_pool_.register_kernel("cpu")
def _(fresh, ring, pool, ape, norm_weight, rotate, pos, slot, ratio, overlap, eps, tokens_per_request):
    _cp.compressor_pool_torch(fresh, ring, pool, ape, norm_weight, rotate, pos, slot, ratio=ratio, overlap=overlap,
                              eps=eps, tokens_per_request=tokens_per_request)


@compressor_pool_.register_fake
def _(fresh, ring, pool, ape, norm_weight, rotate, pos, slot, ratio, overlap, eps, tokens_per_request):
    return None
