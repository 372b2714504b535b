"""Shared by the device probes: op families of FusedOps, a baseline Ops with chosen families
swapped for the fused ones, and the probes' verify-step inputs."""
import torch

from spec_decode.model import KVPool
from spec_decode.step_model import Ops

FAMILIES = {"mhc": ("mhc_mappings", "pre_mix", "post_mix"), "indexer": ("indexer_topk",), "wo_a": ("wo_a",),
            "moe": ("moe",)}


def hybrid(fused, fams):
    class H(Ops):
        pass
    h = H()
    for f in fams:
        for name in FAMILIES[f]:
            setattr(h, name, getattr(fused, name))
    return h


def random_kv_pool(cfg, slots: int, max_len: int) -> KVPool:
    """A bf16 CUDA KV pool filled with N(0, 1): every position a plausible key / value."""
    kv = KVPool(cfg, slots, max_len, torch.bfloat16, "cuda")
    kv.k.normal_()
    kv.v.normal_()
    kv.k_idx.normal_()
    return kv


def verify_block(cfg, B: int, S: int = 6, at: int = 506):
    """(tokens, positions, slots) of B requests' S-token verify blocks at positions at..at+S-1,
    request b in slot b (the bench's --quick shape: ~512 prompt positions)."""
    toks = torch.randint(0, cfg.vocab, (B, S), device="cuda")
    pos = (at + torch.arange(S, device="cuda")[None].expand(B, S)).contiguous()
    return toks, pos, torch.arange(B, device="cuda")
