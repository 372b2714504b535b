"""Device probe: where a slice-config verify step's time goes, kernel by kernel.

    device run (carry .devcache): source tools/device-env.sh && python tools/probe_slice_profile.py
    (env MODEL=small|slice, default slice; B = requests, default 1; CORE = auto|masked_dense|gather;
    KV_CACHE = per_head|latent, default the config's; AT = the block's first position, default 506;
    BACKENDS = comma list, default baseline,fused)

One verify step (6 tokens per request at position AT, random KV pool of AT + 100 rounded up to 16), captured as a CUDA
graph for the baseline and the fused ops, replayed 10 times under torch.profiler. Prints per
backend the replay's total GPU time and the 15 kernels with the most time (name, calls per
replay, us per replay): the fused path's remaining cost beside the torch attention core, the
LM head and the projections this project does not replace.
"""
import collections
import dataclasses
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_fused_ops_families import random_kv_pool, verify_block  # noqa: E402

from spec_decode.config import SLICE, SMALL  # noqa: E402
from spec_decode.fused_ops import FusedOps  # noqa: E402
from spec_decode.graphs import StepGraphs  # noqa: E402
from spec_decode.model import TargetModel  # noqa: E402
from spec_decode.step_model import Ops, StepModel  # noqa: E402


def main():
    cfg = {"slice": SLICE, "small": SMALL}[os.environ.get("MODEL", "slice")]
    if os.environ.get("KV_CACHE"):
        cfg = dataclasses.replace(cfg, kv_cache=os.environ["KV_CACHE"])
    B, S, reps = int(os.environ.get("B", "1")), 6, 10
    at = int(os.environ.get("AT", "506"))
    max_len = -(-(at + 100) // 16) * 16
    core = os.environ.get("CORE", "auto")
    m = TargetModel(cfg, seed=3, dtype=torch.bfloat16, device="cuda")
    kv = random_kv_pool(cfg, B + 1, max_len)
    toks, pos, slots = verify_block(cfg, B, S, at)
    backends = {"baseline": lambda: Ops(), "fused": lambda: FusedOps(m, max_tokens=B * S, max_len=max_len)}
    for name in os.environ.get("BACKENDS", "baseline,fused").split(","):
        ops = backends[name]()
        step = StepModel(m, ops, attention_core=core)
        g = StepGraphs(lambda t, p, s, _x, step=step: step.forward(t, p, s, kv), (B,), S, B, "cuda")
        for _ in range(3):
            g.run(toks, pos, slots)  # compile, capture, warm
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                g.run(toks, pos, slots)
            torch.cuda.synchronize()
        us, calls = collections.Counter(), collections.Counter()
        for e in prof.events():
            if e.device_type.name == "CUDA" and e.time_range.elapsed_us() > 0:
                us[e.name[:90]] += e.time_range.elapsed_us() / reps
                calls[e.name[:90]] += 1 / reps
        print(f"{os.environ.get('MODEL', 'slice')} {cfg.kv_cache} B={B} at={at} core={core} {name}: {sum(us.values()):.1f} us of "
              f"kernels per verify replay, {sum(calls.values()):.0f} kernels", flush=True)
        for k, v in us.most_common(15):
            print(f"   {v:9.1f} us  x{calls[k]:4.0f}  {k}", flush=True)
        del g, step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
