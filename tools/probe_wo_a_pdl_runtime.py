"""Does WO-A's programmatic dependent launch pay after a cuBLAS kernel (the decode runtime's case)?

    python tools/probe_wo_a_pdl_runtime.py

In the runtime the kernel before WO-A is not one of ours: it never triggers its dependents
early, so a PDL launch can only overlap WO-A's prologue (weight tiles load before
``griddepcontrol.wait``) with that kernel's tail. Per shape and T: graph replay (rotating
weights larger than L2) of a cuBLAS ``bmm`` writing ``o`` followed by ``wo_a(o)`` with and
without ``pdl``, and the ``bmm`` alone; prints us per pair and WO-A's share (pair - bmm).
Each variant's output is checked against an FP32 einsum.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from bench_wo_a import token_counts  # noqa: E402
from common import rotation_count, time_graph  # noqa: E402

from cute_kernels.wo_a import wo_a  # noqa: E402

TS = token_counts(os.environ.get("TS", "5,20,64,320"))

for G, R, Dg in [(16, 1024, 1024), (8, 512, 2048), (16, 512, 2048), (8, 1024, 1024)]:
    H, Dv = G * 8, Dg // 8
    n = rotation_count(G * R * Dg * 2)
    ws = [(torch.randn(G, R, Dg, device="cuda") / Dg**0.5).bfloat16() for _ in range(n)]
    for T in TS:
        # the "attention core": per token, [H, 64] probabilities times [64, Dv] values -> o [T, H, Dv]
        p = torch.softmax(torch.randn(T, H, 64, device="cuda"), -1).bfloat16()
        v = torch.randn(T, 64, Dv, device="cuda").bfloat16()
        o = torch.empty(T, H, Dv, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(T, G * R, device="cuda", dtype=torch.bfloat16)
        row = [f"T={T} G={G} R={R} Dg={Dg}"]
        t_bmm = time_graph(lambda i: torch.bmm(p, v, out=o), n)
        for pdl in (False, True):
            def pair(i, pdl=pdl):
                torch.bmm(p, v, out=o)
                wo_a(o, ws[i], out=y, pdl=pdl, stream=torch.cuda.current_stream())

            y.fill_(float("nan"))
            pair(0)
            torch.cuda.synchronize()
            ref = torch.einsum("tgd,grd->tgr", (p.float() @ v.float()).bfloat16().float().view(T, G, Dg),
                               ws[0].float()).reshape(T, G * R)
            err = ((y.float() - ref).norm() / ref.norm()).item()
            t = time_graph(pair, n)
            row.append(f"pdl={pdl}: pair {t * 1e6:.2f} us, WO-A share {(t - t_bmm) * 1e6:.2f} us (err {err:.1e})")
        row.append(f"bmm alone {t_bmm * 1e6:.2f} us")
        print("; ".join(row), flush=True)
    ws = None
