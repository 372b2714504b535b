"""Time the Hopper swap-AB WO-A decode kernel (:mod:`cute_kernels.wo_a_decode_sm90`) around its
plan against the shipped ``wo_a()`` path, the warp-MMA decode kernel and cuBLAS ``bmm`` alone.

    python tools/probe_wo_a_decode_sm90.py
    env TS=1,64 SPLITS=1,2,4,8 STAGES=3,4,6 BKS=64,128 python tools/probe_wo_a_decode_sm90.py  # full sweep
    env READ=1 TS=1 python tools/probe_wo_a_decode_sm90.py   # + the read ceiling of each shape's bytes
    env SPLITS=1,2,4 STAGES=4,8 BKS=128 CLUSTER=0,1 python tools/probe_wo_a_decode_sm90.py  # cluster splits

Per shape and T, us per call (graph replay, rotating weights larger than L2, bench/common.py)
and % of 4.3 TB/s on the weight bytes: ``bmm``, ``wo_a()`` (its default route), ``mma`` (the
warp-MMA decode kernel at its plan, :mod:`cute_kernels.wo_a_decode`), then the swap-AB kernel
per config ``s{splits}x{stages}k{bk}`` ('*': its plan; ``c`` instead of ``s``: the splits as one
cluster summing through distributed shared memory). Without SPLITS / STAGES / BKS the
configs are the plan and its neighbours (splits x2 and /2, 6 stages, 128-wide slices). Every
launch's output is checked against an FP32 einsum after a NaN poison (relative error).

``READ=1`` adds, per shape, what a pure streaming read of the same weight bytes costs in the
same harness: :func:`cute_kernels.row_rms.row_rms` (one CTA per row, every 16-byte load of a
thread in flight at once, 4 bytes written per row) over the weights viewed as rows of C
elements, for several C -- the floor any WO-A kernel that reads each weight once can reach.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from bench_wo_a import bmm_only, token_counts, tokens_out_ref, weight_sets  # noqa: E402
from common import H200_COPY_BW, measure, time_graph  # noqa: E402

import cutlass  # noqa: E402
from cute_kernels import jit  # noqa: E402
from cute_kernels.row_rms import row_rms  # noqa: E402
from cute_kernels.wo_a import wo_a  # noqa: E402
from cute_kernels.wo_a_decode import WoADecodeWorkspace  # noqa: E402
from cute_kernels.wo_a_decode_sm90 import WoADecodeSm90, plan  # noqa: E402

TS = token_counts(os.environ.get("TS", "1,5,16,32,64"))
SHAPES = [(16, 1024, 1024), (8, 512, 2048), (16, 512, 2048), (8, 1024, 1024)]


def env_list(name):
    v = os.environ.get(name)
    return [int(x) for x in v.split(",")] if v else None


def configs(T, G, R, Dg):
    base = plan(T, G, R, Dg)
    sweep = [env_list(k) for k in ("SPLITS", "STAGES", "BKS")]
    clusters = [bool(x) for x in (env_list("CLUSTER") or [0])]
    if any(s is not None for s in sweep):
        sp, st, bk = (s or [base[k]] for s, k in zip(sweep, ("splits", "stages", "bk")))
        cands = [dict(base, splits=a, stages=b, bk=c, **({"cluster": True} if cl and a > 1 else {}))
                 for a in sp for b in st for c in bk for cl in clusters]
    else:
        cands = [dict(base, splits=base["splits"] * 2), dict(base, splits=max(base["splits"] // 2, 1)),
                 dict(base, stages=6), dict(base, bk=128, splits=max(base["splits"] // 2, 1))]
    out = [base]
    for c in cands:
        if c not in out and WoADecodeSm90.can_implement(T, G, R, Dg, c["tok_n"], c["splits"], c["stages"], c["bk"]):
            out.append(c)
    return base, out


def main():
    P = jit.gmem_ptr
    for G, R, Dg in SHAPES:
        wbytes = G * R * Dg * 2
        ws = weight_sets(G, R, Dg)
        n = len(ws)
        workspace = WoADecodeWorkspace(G, R, max_splits=16, device="cuda")
        if os.environ.get("READ") == "1":
            res = []
            for C in (Dg, 4096, 8192, 16384):
                rows = G * R * Dg // C
                rstd = torch.empty(rows, device="cuda", dtype=torch.float32)
                t = time_graph(lambda i: row_rms(ws[i].view(rows, C), out=rstd), n, max(n, 8))
                res.append(f"C={C} {t * 1e6:.2f} ({wbytes / t / H200_COPY_BW:.0%})")
            t = time_graph(lambda i: ws[i].sum(dtype=torch.float32), n, max(n, 8))
            res.append(f"torch sum {t * 1e6:.2f} ({wbytes / t / H200_COPY_BW:.0%})")
            print(f"G={G} R={R} Dg={Dg} {wbytes / 1e6:.1f} MB, pure read (row_rms over rows of C): "
                  + "; ".join(res), flush=True)
        for T in TS:
            o, y, ref = tokens_out_ref(T, G, R, Dg, ws[0])

            def pct(t):
                return f"{t * 1e6:.2f} ({wbytes / t / H200_COPY_BW:.0%})"

            t_bmm = time_graph(lambda i: bmm_only(o, ws[i]), n, max(n, 8))
            t_def, e_def = measure(lambda i: wo_a(o, ws[i], out=y), y, ref, n)
            t_mma, e_mma = measure(lambda i: wo_a(o, ws[i], out=y, decode_kernel=True), y, ref, n)
            res = [f"bmm {pct(t_bmm)}", f"wo_a() {pct(t_def)}", f"mma {pct(t_mma)}"]
            base, cfgs = configs(T, G, R, Dg)
            errs = [e_def, e_mma]
            for cfg in cfgs:
                fn = jit.get_kernel("wo_a_decode_sm90", "sm_90a", G=G, R=R, Dg=Dg, **cfg)

                def call(i, fn=fn):
                    fn(P(cutlass.BFloat16, o, 16), P(cutlass.BFloat16, ws[i], 16), P(cutlass.BFloat16, y, 4),
                       P(cutlass.Float32, workspace.partials, 4), P(cutlass.Int32, workspace.counters, 4),
                       jit.i32(T), jit.cu_stream())

                t, err = measure(call, y, ref, n)
                errs.append(err)
                name = f"{'c' if cfg.get('cluster') else 's'}{cfg['splits']}x{cfg['stages']}k{cfg['bk']}"
                res.append(f"{name}{'*' if cfg == base else ''} {pct(t)}")
            bad = " -- ERROR above the tests' 4e-3" if max(errs) > 4e-3 else ""
            print(f"T={T} G={G} R={R} Dg={Dg} tok_n={base['tok_n']}: " + "; ".join(res)
                  + f"; max err {max(errs):.1e}{bad}", flush=True)
        ws = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
