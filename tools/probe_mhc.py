"""Probe: where mhc_stats spends its time (Sinkhorn iterations, split count, T)."""
import sys, os
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import torch
from common import time_graph, rotation_count
from cute_kernels.mhc_stats import MhcStatsWorkspace, mhc_split_phi, mhc_stats, plan_splits

N, C = 4, 7168
for T in (1, 32, 64, 320):
    rot = rotation_count(T * N * C * 2)
    xs = [torch.randn(T, N, C, device="cuda").bfloat16() for _ in range(rot)]
    phi = torch.randn(24, N * C, device="cuda") / 169
    alpha = torch.rand(3, device="cuda") + 0.5
    bias = torch.randn(24, device="cuda") * 0.5
    phi = mhc_split_phi(phi)
    ws = MhcStatsWorkspace(N, T)
    H = torch.empty(T, 24, device="cuda")
    row = []
    for iters in (20, 0):
        for mc in (1, 8, 32, 132):
            t = time_graph(lambda i: mhc_stats(xs[i], phi, alpha, bias, workspace=ws, out=H, max_ctas=mc,
                                               sinkhorn_iters=iters), rot)
            row.append(f"it{iters}/ctas{mc}({plan_splits(T, N * C, mc)[0]}):{t * 1e6:.1f}")
    print(f"T={T}", " ".join(row), flush=True)
# empty-ish kernel floor: row_rms on 1 row
from cute_kernels.row_rms import row_rms
x = torch.randn(1, 7168, device="cuda").bfloat16(); o = torch.empty(1, device="cuda")
print("row_rms T=1 us", time_graph(lambda i: row_rms(x, out=o), 1, 20) * 1e6)
