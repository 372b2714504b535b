"""Where does eager host time go in a torch-facing call? cProfile of row_rms(x, out=out)."""
import cProfile
import io
import pstats
import time

import torch

from cute_kernels.row_rms import row_rms

x = torch.randn(64, 7168, device="cuda").bfloat16()
out = torch.empty(64, device="cuda")
row_rms(x, out=out)
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(2000):
    row_rms(x, out=out)
torch.cuda.synchronize()
print(f"row_rms eager: {(time.perf_counter() - t0) / 2000 * 1e6:.1f} us/call")
pr = cProfile.Profile()
pr.enable()
for _ in range(500):
    row_rms(x, out=out)
pr.disable()
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
print(s.getvalue()[:5000])
