"""Buffers of the push all-reduce, the simulated one-GPU group, and the launchers.

:class:`RankBuffers` holds one rank's receive buffer, flags, phase counters and error flag
(allocated once, zeroed once). :class:`PushAllReduceGroup` binds every rank's view of all
peers' ``recv``/``flags`` pointers:

* real group (one process per GPU): :func:`exchange_ipc` maps the peers' allocations
  through CUDA IPC handles exchanged with ``torch.distributed.all_gather_object``;
* simulated group (:meth:`PushAllReduceGroup.simulated`): all ranks' buffers are separate
  allocations on one GPU and each rank launches on its own stream -- used by the tests and
  benchmarks while multi-GPU machines are unavailable.

Launching: :meth:`PushAllReduceGroup.allreduce` (one rank) and
:meth:`PushAllReduceGroup.finalize_shared_allreduce`; :meth:`check` raises
``AllReduceTimeout`` if any rank's bounded wait expired.
"""

from __future__ import annotations

import dataclasses

import torch

import cutlass
from cutlass import Float32, Int32

from cute_kernels import jit
from cute_kernels.arch import current_arch
from cute_kernels.validate import check_tensor

from .push_allreduce import MAX_WORLD, VEC, WORLDS

DEFAULT_CTAS = 16
#: ~1-2 s of polling on an H200 before a wait gives up
DEFAULT_MAX_SPINS = 1 << 21


class AllReduceTimeout(RuntimeError):
    pass


@dataclasses.dataclass
class RankBuffers:
    recv: torch.Tensor  # bf16 [2, world, slot_elems]
    flags: torch.Tensor  # int32 [world, ctas]
    phase: torch.Tensor  # int32 [ctas]
    error: torch.Tensor  # int32 [1]

    @classmethod
    def allocate(cls, world: int, max_tokens: int, hidden: int, ctas: int, device) -> "RankBuffers":
        slot = max_tokens * hidden
        return cls(
            recv=torch.zeros(2, world, slot, dtype=torch.bfloat16, device=device),
            flags=torch.zeros(world, ctas, dtype=torch.int32, device=device),
            phase=torch.zeros(ctas, dtype=torch.int32, device=device),
            error=torch.zeros(1, dtype=torch.int32, device=device),
        )


def exchange_ipc(local: RankBuffers, group=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(recv, flags) of every rank of ``group``, peers mapped through CUDA IPC.

    Each rank shares its allocations' IPC handles (``UntypedStorage._share_cuda_``) with
    ``all_gather_object`` and opens the peers' with ``UntypedStorage._new_shared_cuda``.
    Plain P2P mappings only: no multicast objects. Not exercised here (multi-GPU machines are
    withheld); the one-GPU simulation binds separate allocations instead.
    """
    import torch.distributed as dist

    def share(t):
        return (t.untyped_storage()._share_cuda_(), t.shape, t.dtype, t.storage_offset())

    mine = (share(local.recv), share(local.flags))
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    allh = [None] * world
    dist.all_gather_object(allh, mine, group=group)
    out = []
    for q, handles in enumerate(allh):
        if q == rank:
            out.append((local.recv, local.flags))
            continue
        views = []
        for handle, shape, dtype, offset in handles:
            storage = torch.UntypedStorage._new_shared_cuda(*handle)
            t = torch.empty(0, dtype=dtype, device=local.recv.device).set_(storage, offset, shape)
            views.append(t)
        out.append(tuple(views))
    return out


class PushAllReduceGroup:
    """The ranks' buffers plus, per rank, the list of every peer's (recv, flags)."""

    def __init__(self, world: int, max_tokens: int, hidden: int, ranks: list[RankBuffers],
                 peers: list[list[tuple[torch.Tensor, torch.Tensor]]], ctas: int = DEFAULT_CTAS):
        if world not in WORLDS:
            raise ValueError(f"push all-reduce: world={world} must be one of {WORLDS}")
        if hidden % VEC:
            raise ValueError(f"push all-reduce: hidden={hidden} must be a multiple of {VEC}")
        self.world, self.max_tokens, self.hidden, self.ctas = world, max_tokens, hidden, ctas
        self.ranks, self.peers = ranks, peers
        self.max_spins = DEFAULT_MAX_SPINS
        self._peer_ptrs = [self._ptrs(peers[r]) for r in range(len(peers))]

    @classmethod
    def simulated(cls, world: int, max_tokens: int, hidden: int, device="cuda", ctas: int = DEFAULT_CTAS):
        """All ranks on one GPU: separate allocations as 'peer memory'."""
        ranks = [RankBuffers.allocate(world, max_tokens, hidden, ctas, device) for _ in range(world)]
        peers = [[(rb.recv, rb.flags) for rb in ranks] for _ in range(world)]
        return cls(world, max_tokens, hidden, ranks, peers, ctas)

    @classmethod
    def from_process_group(cls, max_tokens: int, hidden: int, device, group=None,
                           ctas: int = DEFAULT_CTAS) -> "tuple[PushAllReduceGroup, int]":
        """This process's view of a real group (one process per GPU): its own buffers, the
        peers' mapped through CUDA IPC (:func:`exchange_ipc`; every rank of ``group`` must
        call this). Returns ``(group, rank)``; launch with that rank. Not run here (no
        multi-GPU machine)."""
        import torch.distributed as dist

        world, rank = dist.get_world_size(group), dist.get_rank(group)
        local = RankBuffers.allocate(world, max_tokens, hidden, ctas, device)
        peers = exchange_ipc(local, group)
        ranks = [local if q == rank else None for q in range(world)]
        return cls(world, max_tokens, hidden, ranks, [peers] * world, ctas), rank

    def _ptrs(self, peer_list):
        bf = cutlass.BFloat16
        recv = [jit.gmem_ptr(bf, peer_list[q % self.world][0], 16) for q in range(MAX_WORLD)]
        flags = [jit.gmem_ptr(Int32, peer_list[q % self.world][1], 4) for q in range(MAX_WORLD)]
        return recv, flags

    def reset(self) -> None:
        """Zero every rank's state (after a timeout left the phases inconsistent)."""
        for rb in self.ranks:
            if rb is None:  # a real group: another process's
                continue
            rb.recv.zero_()
            rb.flags.zero_()
            rb.phase.zero_()
            rb.error.zero_()

    def check(self) -> None:
        """Raise AllReduceTimeout if a rank's bounded wait expired (synchronises)."""
        bad = [r for r, rb in enumerate(self.ranks) if rb is not None and int(rb.error.item())]
        if bad:
            raise AllReduceTimeout(f"push all-reduce: ranks {bad} timed out waiting for peers "
                                   f"(a rank did not launch, or ranks ran different phases); call reset()")

    def _launch(self, rank, T, fused, inp, w, pos, shared, out, stream, arch, delay):
        op = "finalize_shared_allreduce" if fused else "push_allreduce"
        if not 0 <= rank < len(self.ranks):
            raise ValueError(f"{op}: rank={rank} out of range for this process's {len(self.ranks)} ranks")
        if not 0 <= T <= self.max_tokens:
            raise ValueError(f"{op}: T={T} exceeds the group's max_tokens={self.max_tokens}")
        check_tensor(op, "out", out, dtype=torch.bfloat16, shape=(T, self.hidden), contiguous=True)
        a = arch if arch is not None else current_arch(out.device)
        if a is None:
            raise ValueError(f"{op}: needs an sm_90a or sm_100a GPU")
        k = w.shape[1] if fused else 1
        fn = jit.get_kernel("push_allreduce", a, world=self.world, hidden=self.hidden, fused=fused, topk=k)
        rb = self.ranks[rank]
        recv, flags = self._peer_ptrs[rank]
        P = jit.gmem_ptr
        bf = cutlass.BFloat16
        fn(P(bf, inp, 16), P(Float32, w if w is not None else rb.phase, 4), P(Int32, pos if pos is not None else rb.phase, 4),
           P(bf, shared if shared is not None else out, 16), P(bf, out, 16), *recv, *flags,
           P(Int32, rb.phase, 4), P(Int32, rb.error, 4), jit.i32(rank), jit.i32(T), jit.i32(inp.shape[0]),
           jit.i32(self.max_tokens * self.hidden // VEC), jit.i32(self.ctas), jit.i32(self.max_spins),
           jit.i32(delay), jit.cu_stream(stream))
        return out

    def warm_up(self, streams: dict, topk: int | None = None) -> None:
        """Compile, load and launch once -- before any CUDA-graph capture -- each kernel variant
        the graphs will replay: the all-reduce, and with ``topk`` the finalize + shared add +
        all-reduce. A kernel's first call compiles it and loads its module, which a capturing
        stream does not permit (the capture is invalidated). ``streams``: this process's ranks
        and the stream each launches on -- every rank of the group must call this at the same
        point (the launches wait for each other); one token of zeros per variant, the same
        launches on every rank, so the phase counters stay in step. Synchronises, then raises
        :class:`AllReduceTimeout` if a rank's bounded wait expired."""
        if not streams:
            return
        dev = next(rb.phase.device for rb in self.ranks if rb is not None)
        x = torch.zeros(1, self.hidden, dtype=torch.bfloat16, device=dev)
        outs = {r: torch.empty_like(x) for r in streams}
        main = torch.cuda.current_stream(dev)
        variants = [lambda r, s: self.allreduce(r, x, out=outs[r], stream=s)]
        if topk is not None:
            y = torch.zeros(topk, self.hidden, dtype=torch.bfloat16, device=dev)
            w = torch.zeros(1, topk, dtype=torch.float32, device=dev)
            pos = torch.arange(topk, dtype=torch.int32, device=dev)  # [T * topk]: rows of y
            variants.append(lambda r, s: self.finalize_shared_allreduce(r, y, w, pos, x, out=outs[r], stream=s))
        for launch in variants:  # every rank's launch of one variant before the next variant
            for r, s in streams.items():
                s.wait_stream(main)
                with torch.cuda.stream(s):
                    launch(r, s)
            for s in streams.values():
                main.wait_stream(s)
        torch.cuda.synchronize(dev)
        self.check()

    def allreduce(self, rank: int, partial: torch.Tensor, *, out: torch.Tensor | None = None, stream=None,
                  arch: str | None = None, delay: int = 0) -> torch.Tensor:
        """``out = bf16(sum over ranks of partial)`` -- every rank of the group must call it."""
        op = "push_allreduce"
        check_tensor(op, "partial", partial, dtype=torch.bfloat16, ndim=2, contiguous=True)
        T, H = partial.shape
        if H != self.hidden:
            raise ValueError(f"{op}: partial.shape[1]={H} != the group's hidden={self.hidden}")
        if out is None:
            out = torch.empty_like(partial)
        return self._launch(rank, T, False, partial, None, None, None, out, stream, arch, delay)

    def finalize_shared_allreduce(self, rank: int, y: torch.Tensor, topk_weights: torch.Tensor,
                                  routed_row_pos: torch.Tensor, shared: torch.Tensor, *,
                                  out: torch.Tensor | None = None, stream=None, arch: str | None = None,
                                  delay: int = 0) -> torch.Tensor:
        """One launch: this rank's finalize (-> bf16) + shared add (-> bf16), pushed and
        all-reduced across the group (FP32 in rank order -> bf16)."""
        from moe.finalize import check_finalize_args

        op = "finalize_shared_allreduce"
        T, k, H = check_finalize_args(op, y, topk_weights, routed_row_pos)
        if H != self.hidden:
            raise ValueError(f"{op}: y.shape[1]={H} != the group's hidden={self.hidden}")
        check_tensor(op, "shared", shared, dtype=torch.bfloat16, shape=(T, H), contiguous=True)
        if out is None:
            out = torch.empty(T, H, dtype=torch.bfloat16, device=y.device)
        return self._launch(rank, T, True, y, topk_weights, routed_row_pos, shared, out, stream, arch, delay)
