"""Which cuBLAS kernel does issue 4's baseline (b), ``torch.bmm`` alone, launch per (shape, T)?

    python tools/probe_cublas_kernels.py
    env TS=64,320,4096 python tools/probe_cublas_kernels.py

cuBLAS's Hopper kernel names carry their schedule (tile, cluster, warp-group layout, stream-K
or split-K), the configuration the WO-A engine is measured against. Prints, per shape and T,
the names of the kernels one ``bmm`` launches (torch profiler, CUDA activity) with their
device time in us.
"""
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from bench_wo_a import SHAPES, bmm_only, token_counts  # noqa: E402

TS = token_counts(os.environ.get("TS", "1,5,64,320,1024,4096,16384"))

for G, R, Dg in SHAPES:
    w = (torch.randn(G, R, Dg, device="cuda") / Dg**0.5).bfloat16()
    for T in TS:
        o = torch.randn(T, G * 8, Dg // 8, device="cuda").bfloat16()
        for _ in range(3):
            bmm_only(o, w)  # heuristics / workspace outside the profile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA], record_shapes=False) as prof:
            bmm_only(o, w)
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        desc = "; ".join(f"{e.name} ({e.device_time_total:.1f} us)" for e in kernels) or "(no kernel recorded)"
        print(f"T={T} G={G} R={R} Dg={Dg}: {desc}", flush=True)
