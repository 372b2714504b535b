"""Device probe: verify-graph time at the slice config per fused op family (which one is slow?).

    device run (carry .devcache): source tools/device-env.sh && python tools/probe_slice_families.py
    (env MODEL=small|slice, default slice; B = requests, default 1)

One request, a 6-token verify block at position ~512 (the bench's --quick shape), the slice
model (real per-layer sizes, 2 layers). Variants: the baseline ops, the fused ops, and the
baseline with one family fused at a time. Each is captured as a CUDA graph (spec_decode's
StepGraphs) and replayed; median of 30 replays, CUDA events.
"""
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_fused_ops_families import FAMILIES, hybrid, random_kv_pool, verify_block  # noqa: E402

from spec_decode.config import SLICE, SMALL  # noqa: E402
from spec_decode.fused_ops import FusedOps  # noqa: E402
from spec_decode.graphs import StepGraphs  # noqa: E402
from spec_decode.model import TargetModel  # noqa: E402
from spec_decode.step_model import Ops, StepModel  # noqa: E402


def main():
    cfg = {"slice": SLICE, "small": SMALL}[os.environ.get("MODEL", "slice")]
    B, S, max_len = int(os.environ.get("B", "1")), 6, 600
    m = TargetModel(cfg, seed=3, dtype=torch.bfloat16, device="cuda")
    fused = FusedOps(m, max_tokens=B * S, max_len=max_len)
    variants = {"baseline": Ops(), "fused": fused}
    for f in FAMILIES:
        variants[f"baseline + fused {f}"] = hybrid(fused, [f])
    kv = random_kv_pool(cfg, B + 1, max_len)
    toks, pos, slots = verify_block(cfg, B, S)
    for name, ops in variants.items():
        step = StepModel(m, ops)
        g = StepGraphs(lambda t, p, s, _x, step=step: step.forward(t, p, s, kv), (B,), S, B, "cuda")
        g.run(toks, pos, slots)  # compile, capture
        g.timing = True
        for _ in range(30):
            g.run(toks, pos, slots)
        ms = statistics.median(g.replay_times_ms())
        print(f"{os.environ.get('MODEL', 'slice')} B={B} {name:28s} verify graph {ms:8.3f} ms", flush=True)
        del g, step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
