"""Tune the WO-A Hopper tile choice: time every CTA tile per (shape, T) and check it.

    python tools/probe_wo_a_tiles.py
Prints, per shape and T, us per call (graph replay, rotating weights) and the relative error
against an FP32 einsum for each tile; '*' marks the tile the current heuristic picks.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from common import rotation_count, time_graph  # noqa: E402

import cutlass  # noqa: E402
from cute_kernels import jit  # noqa: E402
from cute_kernels.wo_a_sm90 import WoASm90  # noqa: E402

TILES = [(64, 64), (64, 128), (64, 256), (128, 128), (128, 256)]
for G, R, Dg in [(16, 1024, 1024), (8, 512, 2048), (16, 512, 2048), (8, 1024, 1024)]:
    n = rotation_count(G * R * Dg * 2)
    ws = [(torch.randn(G, R, Dg, device="cuda") / Dg**0.5).bfloat16() for _ in range(n)]
    for T in (1, 64, 320, 1024):
        o = torch.randn(T, G * 8, Dg // 8, device="cuda").bfloat16()
        y = torch.empty(T, G * R, device="cuda", dtype=torch.bfloat16)
        ref = torch.einsum("tgd,grd->tgr", o.view(T, G, Dg).float(), ws[0].float()).reshape(T, G * R)
        pick = WoASm90.tile_for(T, G, R)
        res = []
        for tm, tn in TILES:
            if R % tn:
                continue
            fn = jit.get_kernel("wo_a", "sm_90a", G=G, R=R, Dg=Dg, tile_m=tm, tile_n=tn)

            def call(i):
                fn(jit.gmem_ptr(cutlass.BFloat16, o), jit.gmem_ptr(cutlass.BFloat16, ws[i]),
                   jit.gmem_ptr(cutlass.BFloat16, y), jit.i32(T), jit.cu_stream())

            call(0)
            torch.cuda.synchronize()
            err = ((y.float() - ref).norm() / ref.norm()).item()
            t = time_graph(call, n, max(n, 8))
            res.append(f"{tm}x{tn}{'*' if (tm, tn) == pick else ''}: {t * 1e6:.1f} us (err {err:.1e})")
        print(f"T={T} G={G} R={R} Dg={Dg}: " + "; ".join(res), flush=True)
    del ws
