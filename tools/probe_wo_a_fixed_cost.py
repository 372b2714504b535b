"""WO-A against cuBLAS ``bmm`` as K (``Dg``) shrinks: fixed cost per launch vs streaming rate.

At T = 320 G=8 R=512 the shipped config loses to ``bmm`` alone (0.84x, bench/RESULTS.md,
eighteenth session) although its load-only mainloop is as long as cuBLAS's whole kernel
minus the launch gap. This sweeps ``Dg`` at fixed (T, G, R): both times are then about
``a + b * Dg``, the intercept ``a`` the per-launch fixed cost (launch, barrier init, first
stage latency, epilogue, tail, the graph's kernel-to-kernel gap) and the slope ``b`` the
streaming rate of the mainloop. A least-squares line per column tells which of the two
makes the difference. Each point is timed twice: ``cold`` (rotating weight sets larger than
L2, as the benches) and ``warm`` (one weight set: every operand L2-resident after the first
launch), the two graphs of a point interleaved as the benches do.

    python tools/probe_wo_a_fixed_cost.py
    env TS=320,64 SHAPES=8x512,16x1024 DGS=64,256,1024,2048 python tools/probe_wo_a_fixed_cost.py

Prints a row per (shape, T, Dg, cold/warm): ours (``wo_a()``'s default path), bmm alone and
the ratio; then the fitted intercept / slope (us, us per 1024 of Dg) of each column.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from bench_wo_a import bmm_only, token_counts, tokens_out_ref, weight_sets  # noqa: E402
from common import gpu_warmup, time_graphs_interleaved  # noqa: E402

from cute_kernels.wo_a import wo_a  # noqa: E402


def fit(xs, ys):
    """Least-squares (intercept, slope) of ys over xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def main():
    TS = token_counts(os.environ.get("TS", "320"))
    DGS = [int(d) for d in os.environ.get("DGS", "64,128,256,512,1024,2048").split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in os.environ.get("SHAPES", "8x512").split(",")]
    gpu_warmup()
    for G, R in shapes:
        for T in TS:
            pts = {"cold": [], "warm": []}
            for Dg in DGS:
                ws = weight_sets(G, R, Dg)
                o, y, ref = tokens_out_ref(T, G, R, Dg, ws[0])
                y.fill_(float("nan"))
                wo_a(o, ws[0], out=y)
                torch.cuda.synchronize()
                err = ((y.float() - ref).norm() / ref.norm()).item()
                assert err < 1e-2, f"G={G} R={R} T={T} Dg={Dg}: rel err {err:.2e}"
                for temp, n in (("cold", len(ws)), ("warm", 1)):
                    t_ours, t_bmm = time_graphs_interleaved(
                        [lambda i: wo_a(o, ws[i], out=y), lambda i: bmm_only(o, ws[i])], n, max(n, 8))
                    pts[temp].append((Dg, t_ours * 1e6, t_bmm * 1e6))
                    print(f"G={G} R={R} T={T} Dg={Dg} {temp}: ours {t_ours * 1e6:.2f} us, bmm {t_bmm * 1e6:.2f} us, "
                          f"{t_bmm / t_ours:.2f}x (err {err:.1e})", flush=True)
                ws = None
            for temp, p in pts.items():
                xs = [d / 1024 for d, _, _ in p]
                a_o, b_o = fit(xs, [t for _, t, _ in p])
                a_b, b_b = fit(xs, [t for _, _, t in p])
                print(f"G={G} R={R} T={T} {temp} fit: ours {a_o:.2f} us + {b_o:.2f} us per 1024 of Dg; "
                      f"bmm {a_b:.2f} + {b_b:.2f}", flush=True)


if __name__ == "__main__":
    main()
