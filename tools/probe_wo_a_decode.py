"""Sweep the WO-A decode kernel's split count against the launch floor and cuBLAS at decode T.

    python tools/probe_wo_a_decode.py
    env TS=1,5 SPLITS=1,2,4,8 python tools/probe_wo_a_decode.py
    env TS=1,5,16 SPLITS=1,2 STAGES=4,6,9 python tools/probe_wo_a_decode.py   # pipeline depth
    env TS=1,5 SPLITS=1,2 STAGES=6,9,17 BNS=32,64 python tools/probe_wo_a_decode.py   # column tile
    env TS=1,5,16,32 PLAN_ONLY=1 CHAINS=1,2,4 PDL=0 python tools/probe_wo_a_decode.py   # MMA chains
    env TS=1,5,16,32 PLAN_ONLY=1 ROTATE=0,1 PDL=0 python tools/probe_wo_a_decode.py   # per-CTA K walk

Per shape and T, us per call (graph replay, rotating weights larger than L2), with and without
PDL: the decode kernel's plan ('*') and, per column tile in BNS, each split count its K allows and
each pipeline depth in STAGES that its shared memory and K allow (at most one more stage than the
CTA's K slices) (bm as :func:`wo_a_decode.plan` picks;
'*' marks the plan's split count), cuBLAS ``bmm`` alone, and the floor of this timing -- a
one-element ``zero_`` (the per-launch cost of a graph of back-to-back kernels) plus the weight
bytes at 4.3 TB/s. Every launch's output is checked against an FP32 einsum (relative error).
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from bench_wo_a import bmm_only, token_counts, tokens_out_ref, weight_sets  # noqa: E402
from common import H200_COPY_BW, measure, time_graph  # noqa: E402

import cutlass  # noqa: E402
from cute_kernels import jit  # noqa: E402
from cute_kernels.wo_a_decode import BK, SMEM_PER_CTA, WoADecode, WoADecodeWorkspace, plan, smem_bytes  # noqa: E402

TS = token_counts(os.environ.get("TS", "1,5,16,64"))
SPLITS = [int(s) for s in os.environ.get("SPLITS", "1,2,4,8").split(",")]
STAGES = [int(s) for s in os.environ.get("STAGES", "4").split(",")]
BNS = [int(s) for s in os.environ.get("BNS", "64").split(",")]
PDLS = [False, True] if os.environ.get("PDL", "1") == "1" else [False]
CHAINS = [int(s) for s in os.environ.get("CHAINS", "1").split(",")]  # independent MMA accumulators
ROTATE = [r == "1" for r in os.environ.get("ROTATE", "0").split(",")]  # per-CTA start of the K walk
PLAN_ONLY = os.environ.get("PLAN_ONLY", "0") == "1"  # only the plan's config (times CHAINS)

empty = torch.zeros(1, device="cuda")
t_launch = time_graph(lambda i: empty.zero_(), 1, 64)
print(f"one-element zero_ per launch: {t_launch * 1e6:.2f} us", flush=True)
for G, R, Dg in [(16, 1024, 1024), (8, 512, 2048), (16, 512, 2048), (8, 1024, 1024)]:
    wbytes = G * R * Dg * 2
    ws = weight_sets(G, R, Dg)
    n = len(ws)
    workspace = WoADecodeWorkspace(G, R, max_splits=max(SPLITS + [8]), device="cuda")
    floor = t_launch + wbytes / H200_COPY_BW
    for T in TS:
        o, y, ref = tokens_out_ref(T, G, R, Dg, ws[0])
        picked = plan(T, G, R, Dg)
        bm = picked["bm"]
        t_bmm = time_graph(lambda i: bmm_only(o, ws[i]), n, max(n, 8))
        res = [f"floor {floor * 1e6:.1f}", f"bmm {t_bmm * 1e6:.1f}"]
        cfgs = [dict(bm=bm, bn=bn, splits=sp, stages=st) for bn in BNS for sp in SPLITS for st in STAGES
                if WoADecode.can_implement(T, G, R, Dg, sp, bn) and smem_bytes(bm, st, bn) <= SMEM_PER_CTA
                and st <= Dg // BK // sp + 1] if not PLAN_ONLY else []
        cfgs = ([picked] if picked not in cfgs else []) + cfgs
        cfgs = [dict(c, chains=ch) if ch != 1 else c for c in cfgs for ch in CHAINS]
        cfgs = [dict(c, rotate_k=True) if rot else c for c in cfgs for rot in ROTATE]
        for cfg in cfgs:
            for pdl in PDLS:
                fn = jit.get_kernel("wo_a_decode", "sm_90a", G=G, R=R, Dg=Dg, **cfg, **({"pdl": True} if pdl else {}))

                def call(i, fn=fn):
                    P = jit.gmem_ptr
                    fn(P(cutlass.BFloat16, o, 16), P(cutlass.BFloat16, ws[i], 16), P(cutlass.BFloat16, y, 4),
                       P(cutlass.Float32, workspace.partials, 4), P(cutlass.Int32, workspace.counters, 4),
                       jit.i32(T), jit.cu_stream())

                t, err = measure(call, y, ref, n)
                mark = "*" if cfg == picked else ""
                chains = (f"c{cfg['chains']}" if "chains" in cfg else "") + ("rot" if cfg.get("rotate_k") else "")
                res.append(f"n{cfg['bn']}s{cfg['splits']}x{cfg['stages']}st{chains}{'+pdl' if pdl else ''}{mark} "
                           f"{t * 1e6:.1f} ({wbytes / t / H200_COPY_BW:.0%}, err {err:.1e})")
        print(f"T={T} G={G} R={R} Dg={Dg} bm={bm}: " + "; ".join(res), flush=True)
    ws = None
