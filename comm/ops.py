"""The push all-reduce as PyTorch custom ops: ``torch.ops.cute_kernels.push_allreduce`` and
``torch.ops.cute_kernels.finalize_shared_allreduce`` (conventions: :mod:`cute_kernels.ops`).

A group of peer buffers is not a tensor, so the ops take an integer handle from
:func:`register_group`:

* on CUDA the handle names a :class:`comm.buffers.PushAllReduceGroup` (real, or simulated on
  one GPU) and the op is its per-rank launch -- every rank of the group calls it, each with
  its own ``rank``;
* on the CPU it names a ``torch.distributed`` process group (gloo) and the op is the same
  contract written in PyTorch: every rank's partial gathered, summed in FP32 in rank order,
  rounded to bf16 once -- bit for bit what the kernel computes;
* the fake implementation gives the output's shape for ``torch.compile``.

``finalize_shared_allreduce`` first forms this rank's partial as the fused kernel does:
``bf16(sum_i w[:, i] * y[pos[:, i]])`` (FP32 in choice order), plus ``shared`` (FP32, one
more bf16 rounding), then all-reduces it.

Usage::

    import comm.ops
    h = comm.ops.register_group(group)          # PushAllReduceGroup or a gloo ProcessGroup
    out = torch.ops.cute_kernels.push_allreduce(partial, h, rank)

Test::

    pytest tests/test_ops.py -k allreduce
"""

from __future__ import annotations

import itertools

import torch

import moe.ops  # noqa: F401 -- moe_finalize's CPU implementation, used below
from cute_kernels.ops import cuda_op

Tensor = torch.Tensor

_GROUPS: dict[int, object] = {}
_NEXT = itertools.count(1)


def register_group(group) -> int:
    """A handle for ``group`` to pass to the ops: a :class:`comm.buffers.PushAllReduceGroup`
    (the CUDA implementations) or a ``torch.distributed`` process group (the CPU ones)."""
    h = next(_NEXT)
    _GROUPS[h] = group
    return h


def unregister_group(handle: int) -> None:
    """Forget a handle (the group itself is not freed while the caller holds it)."""
    _GROUPS.pop(handle, None)


def _group(op: str, handle: int, cuda: bool):
    g = _GROUPS.get(handle)
    if g is None:
        raise ValueError(f"{op}: group={handle} is not a handle from comm.ops.register_group")
    from .buffers import PushAllReduceGroup

    if cuda != isinstance(g, PushAllReduceGroup):
        want = "a PushAllReduceGroup" if cuda else "a torch.distributed process group"
        raise TypeError(f"{op}: group={handle} holds {type(g).__name__}; {'CUDA' if cuda else 'CPU'} tensors "
                        f"need {want}")
    return g


def _gloo_sum(op: str, x: Tensor, handle: int) -> Tensor:
    """bf16(sum over ranks of x in FP32, in rank order): every rank's partial gathered first so
    that the order is the kernel's, not the transport's."""
    pg = _group(op, handle, cuda=False)
    x32 = x.float().contiguous()
    parts = [torch.empty_like(x32) for _ in range(pg.size())]
    pg.allgather([parts], [x32]).wait()
    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p
    return acc.to(torch.bfloat16)


@cuda_op("push_allreduce")
def push_allreduce(partial: Tensor, group: int, rank: int) -> Tensor:
    """``bf16(sum over the group's ranks of partial [T, H])`` (bf16); every rank calls it."""
    return _group("push_allreduce", group, cuda=True).allreduce(rank, partial)


@push_allreduce.register_kernel("cpu")
def _(partial, group, rank):
    if partial.dtype != torch.bfloat16 or partial.dim() != 2:
        raise TypeError(f"push_allreduce: partial must be a 2-D bf16 tensor, got {partial.dtype} "
                        f"{list(partial.shape)}")
    return _gloo_sum("push_allreduce", partial, group)


@push_allreduce.register_fake
def _(partial, group, rank):
    return torch.empty_like(partial)


@cuda_op("finalize_shared_allreduce")
def finalize_shared_allreduce(y: Tensor, topk_weights: Tensor, routed_row_pos: Tensor, shared: Tensor,
                              group: int, rank: int) -> Tensor:
    """This rank's MoE finalize + shared add, all-reduced over the group, in one launch."""
    g = _group("finalize_shared_allreduce", group, cuda=True)
    return g.finalize_shared_allreduce(rank, y, topk_weights, routed_row_pos, shared)


@finalize_shared_allreduce.register_kernel("cpu")
def _(y, topk_weights, routed_row_pos, shared, group, rank):
    local = torch.ops.cute_kernels.moe_finalize(y, topk_weights, routed_row_pos, shared)
    return _gloo_sum("finalize_shared_allreduce", local, group)


@finalize_shared_allreduce.register_fake
def _(y, topk_weights, routed_row_pos, shared, group, rank):
    return y.new_empty(topk_weights.shape[0], y.shape[1])
