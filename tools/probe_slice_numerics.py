"""Device probe: are the fused ops' logits sane at the slice config (which family is not)?

    device run (carry .devcache): source tools/device-env.sh && python tools/probe_slice_numerics.py
    (env MODEL=small|slice, default slice; BATCHES = comma-separated request counts, default 1,11,64;
    TRACE=1 synchronises after every kernel entry point of spec_decode.fused_ops and prints its
    name first -- run with CUDA_LAUNCH_BLOCKING=1 to find a faulting kernel)

Why: the slice bench (H200, 2026-12-02) measured a median acceptance length of 6.00 for the
fused backend against 1.00 for the baseline on the same random model -- every draft accepted,
what degenerate (e.g. non-finite) logits would give. One eager verify forward (6 tokens per
request at position ~506, random KV pool) per variant: the baseline ops, the fused ops, and
the baseline with one fused family at a time. Printed per variant: the finite fraction of the
logits and of the final hidden state, ||x - x_baseline|| / ||x_baseline|| for both, and the
fraction of tokens whose argmax matches the baseline's. B = 11 (66 tokens) and 64 (384) take
the MoE row-pass and tiled expert kernels; B = 1 the one-pass decode kernel.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_fused_ops_families import FAMILIES, hybrid, random_kv_pool, verify_block  # noqa: E402

from spec_decode.config import SLICE, SMALL  # noqa: E402
from spec_decode.fused_ops import FusedOps  # noqa: E402
from spec_decode.model import TargetModel  # noqa: E402
from spec_decode.step_model import Ops, StepModel  # noqa: E402


def summary(x, ref):
    x, ref = x.float(), ref.float()
    fin = torch.isfinite(x).float().mean().item()
    ok = torch.isfinite(x).all()
    rel = ((x - ref).norm() / ref.norm()).item() if ok else float("nan")
    return fin, rel, x.abs().max().item() if ok else float("nan")


def trace_kernels():
    """Wrap the kernel entry points FusedOps calls: print the name, call, synchronise."""
    import spec_decode.fused_ops as fo

    def wrap(name, fn):
        def traced(*a, **k):
            shapes = [tuple(x.shape) for x in a if isinstance(x, torch.Tensor)][:3]
            print(f"  -> {name} {shapes} {k.get('token_group', '')}{k.get('expert_row_tile', '')}", flush=True)
            out = fn(*a, **k)
            torch.cuda.synchronize()
            return out
        return traced
    for name in ("indexer_topk", "mhc_post_mix", "mhc_pre_mix", "mhc_stats", "wo_a", "moe_expert_gate_up",
                 "moe_expert_gemm", "moe_finalize", "mxfp8_quantize_routed", "shared_expert"):
        setattr(fo, name, wrap(name, getattr(fo, name)))
    fo.MoeRouter.__call__ = wrap("router", fo.MoeRouter.__call__)


def main():
    if os.environ.get("TRACE"):
        trace_kernels()
    name = os.environ.get("MODEL", "slice")
    cfg = {"slice": SLICE, "small": SMALL}[name]
    batches = [int(b) for b in os.environ.get("BATCHES", "1,11,64").split(",")]
    S, max_len = 6, 600
    m = TargetModel(cfg, seed=3, dtype=torch.bfloat16, device="cuda")
    fused = FusedOps(m, max_tokens=max(batches) * S, max_len=max_len)
    variants = {f"baseline + fused {f}": hybrid(fused, [f]) for f in FAMILIES}
    variants["fused"] = fused
    kv = random_kv_pool(cfg, max(batches) + 1, max_len)
    for B in batches:
        toks, pos, slots = verify_block(cfg, B, S)
        with torch.no_grad():
            ref_logits, ref_h = StepModel(m, Ops()).forward(toks, pos, slots, kv)
        fin, _, amax = summary(ref_logits, ref_logits)
        print(f"{name} B={B} baseline: logits finite {fin:.4f} max|.| {amax:.3g}; "
              f"hidden finite {summary(ref_h, ref_h)[0]:.4f}", flush=True)
        for vname, ops in variants.items():
            with torch.no_grad():
                logits, h = StepModel(m, ops).forward(toks, pos, slots, kv)
            torch.cuda.synchronize()
            lf, lrel, lmax = summary(logits, ref_logits)
            hf, hrel, _ = summary(h, ref_h)
            agree = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
            top = torch.bincount(logits.argmax(-1).flatten()).max().item() / logits.shape[0] / S
            print(f"{name} B={B} {vname:26s} logits finite {lf:.4f} rel {lrel:.3e} max|.| {lmax:.3g} | "
                  f"hidden finite {hf:.4f} rel {hrel:.3e} | argmax agree {agree:.3f} "
                  f"(most common argmax {top:.2f} of tokens)", flush=True)
            del logits, h
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
