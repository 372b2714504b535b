"""Tune WO-A decode split-K: time split_k in {1, 2, 4, 8} per decode shape (graph replay)."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from common import rotation_count, time_graph  # noqa: E402

from cute_kernels.wo_a import wo_a  # noqa: E402

for G, R, Dg in [(16, 1024, 1024), (8, 512, 2048), (16, 512, 2048), (8, 1024, 1024)]:
    n = rotation_count(G * R * Dg * 2)
    ws = [(torch.randn(G, R, Dg, device="cuda") / Dg**0.5).bfloat16() for _ in range(n)]
    for T in (1, 64):
        o = torch.randn(T, G * 8, Dg // 8, device="cuda").bfloat16()
        y = torch.empty(T, G * R, device="cuda", dtype=torch.bfloat16)
        res = []
        for S in (1, 2, 4, 8):
            if (Dg // 64) % S:
                continue
            t = time_graph(lambda i: wo_a(o, ws[i], out=y, split_k=S), n, max(n, 8))
            res.append(f"S={S}: {t * 1e6:.2f} us ({G * R * Dg * 2 / t / 1e12:.2f} TB/s)")
        print(f"T={T} G={G} R={R} Dg={Dg}: " + "; ".join(res))
    del ws
