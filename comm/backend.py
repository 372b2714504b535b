"""Choose the all-reduce backend for the MoE output: the custom push kernel or NCCL.

``select_allreduce_backend(...)`` returns a :class:`BackendChoice` -- ``"custom_push"``
(fused finalize + shared add + push all-reduce, one launch) when every condition holds,
otherwise ``"nccl"`` (``torch.distributed.all_reduce`` after the unfused finalize and add),
with the reason. A fallback reason is logged once per distinct reason. ``force=`` overrides
the choice (tests, benchmarks); forcing ``"custom_push"`` where it cannot run raises.

Conditions for custom push: single node; world size in {2, 4, 8}; every pair of GPUs
peer-to-peer capable; message ``tokens * hidden * 2`` bytes <= ``max_message_bytes``
(default 8 MiB: one-shot push moves world x message over the links, which beats NCCL's ring
only for small decode messages); arch sm_100a/sm_103a (preferred) or sm_90a.
"""

from __future__ import annotations

import dataclasses
import logging

from cute_kernels.arch import warn_once

from .push_allreduce import WORLDS

log = logging.getLogger("cute_kernels")
DEFAULT_MAX_MESSAGE_BYTES = 8 << 20


@dataclasses.dataclass(frozen=True)
class BackendChoice:
    backend: str  # "custom_push" | "nccl"
    reason: str


def select_allreduce_backend(*, world_size: int, tokens: int, hidden: int, arch: str | None,
                             p2p_ok: bool, single_node: bool = True,
                             max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                             force: str | None = None) -> BackendChoice:
    reasons = []
    if not single_node:
        reasons.append("ranks span several nodes")
    if world_size not in WORLDS:
        reasons.append(f"world size {world_size} not in {WORLDS}")
    if not p2p_ok:
        reasons.append("not every GPU pair is peer-to-peer capable")
    msg = tokens * hidden * 2
    if msg > max_message_bytes:
        reasons.append(f"message {msg} B exceeds {max_message_bytes} B")
    if arch not in ("sm_100a", "sm_103a", "sm_90a"):
        reasons.append(f"arch {arch} has no custom push kernel")
    if force is not None:
        if force not in ("custom_push", "nccl"):
            raise ValueError(f"select_allreduce_backend: force must be 'custom_push' or 'nccl', got {force!r}")
        if force == "custom_push" and reasons:
            raise ValueError("select_allreduce_backend: custom_push forced but unsupported: " + "; ".join(reasons))
        return BackendChoice(force, "forced")
    if reasons:
        why = "; ".join(reasons)
        warn_once(f"allreduce-fallback:{why}", f"cute_kernels: all-reduce falls back to NCCL: {why}")
        return BackendChoice("nccl", why)
    pref = "Blackwell" if arch in ("sm_100a", "sm_103a") else "Hopper"
    return BackendChoice("custom_push", f"single node, world {world_size}, P2P, {msg} B message, {pref}")


def peers_p2p_capable(devices) -> bool:
    """True if every ordered pair of CUDA devices can access each other's memory."""
    import torch

    devs = list(devices)
    return all(torch.cuda.can_device_access_peer(a, b) for a in devs for b in devs if a != b)
