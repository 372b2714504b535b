"""Where does eager host time go in a torch-facing call? cProfile of ``row_rms(x, out=out)``
or (``KERNEL=wo_a``) of ``wo_a(o, w, out=y)`` at ``T`` tokens of G=8 R=512 Dg=2048.

    python tools/probe_host_overhead.py
    env KERNEL=wo_a T=320 python tools/probe_host_overhead.py
"""
import cProfile
import io
import os
import pstats
import time

import torch

KERNEL = os.environ.get("KERNEL", "row_rms")
if KERNEL == "wo_a":
    from cute_kernels.wo_a import wo_a

    T, G, R, Dg = int(os.environ.get("T", "320")), 8, 512, 2048
    o = torch.randn(T, G * 16, Dg // 16, device="cuda").bfloat16()
    w = torch.randn(G, R, Dg, device="cuda").bfloat16()
    y = torch.empty(T, G * R, device="cuda", dtype=torch.bfloat16)
    call = lambda: wo_a(o, w, out=y)  # noqa: E731
else:
    from cute_kernels.row_rms import row_rms

    x = torch.randn(64, 7168, device="cuda").bfloat16()
    out = torch.empty(64, device="cuda")
    call = lambda: row_rms(x, out=out)  # noqa: E731
call()
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(2000):
    call()
torch.cuda.synchronize()
print(f"{KERNEL} eager: {(time.perf_counter() - t0) / 2000 * 1e6:.1f} us/call")
pr = cProfile.Profile()
pr.enable()
for _ in range(500):
    call()
pr.disable()
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
print(s.getvalue()[:5000])
