"""WO-A's default route against both of its backends at the same points, on the GPU.

    python bench/bench_wo_a_routes.py [--tokens 1,5,64,...] [--shapes GxRxDg,...] [--out FILE]

For each shape (default: :data:`bench_wo_a.SHAPES`, then DeepSeek-V4-Flash's and -Pro's
8x1024x4096 and 16x1024x4096) and each T: ``wo_a()`` (the default route,
:func:`cute_kernels.wo_a.route`), ``wo_a(backend="cute")`` (this project's kernels) and
``wo_a(backend="cublas")`` (one cuBLAS GEMM into token-major ``y``), each checked once against
FP32 into a NaN-poisoned output, then timed interleaved by CUDA-graph replay over rotating
weight sets larger than L2 (:func:`common.time_graphs_interleaved`). The route column says
which backend the default took; "default / best" is how far the default is from the faster of
the two at that point (1.00: it took the faster one).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_wo_a import SHAPES, V4_SHAPES, tokens_out_ref, weight_sets  # noqa: E402
from common import gpu_warmup, markdown_table, poisoned_error, report, time_graphs_interleaved  # noqa: E402

from cute_kernels.wo_a import route, wo_a  # noqa: E402

#: the WO-A bench's points, then T between them
TOKENS = [1, 5, 64, 320, 4096, 16384, 80, 150, 200, 240, 333, 400, 480, 700, 1500]
#: relative error allowed against FP32: the bf16 output rounding (2^-9 / sqrt(3)), doubled
TOL = 2.5e-3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated T (default %(default)s)")
    ap.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES + V4_SHAPES),
                    help="comma-separated GxRxDg (default %(default)s)")
    ap.add_argument("--out", default=None, help="also write the table to this file")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    gpu_warmup()
    rows = []
    for G, R, Dg in shapes:
        ws = weight_sets(G, R, Dg)
        n = len(ws)
        for T in tokens:
            o, y, ref = tokens_out_ref(T, G, R, Dg, ws[0])
            calls = {b: (lambda i, b=b: wo_a(o, ws[i], out=y, backend=b)) for b in (None, "cute", "cublas")}
            for b, call in calls.items():
                err = poisoned_error(call, y, ref)
                if not err < TOL:
                    raise SystemExit(f"wo_a(backend={b!r}) T={T} G={G} R={R} Dg={Dg}: rel. error {err:.2e}")
            t_def, t_cute, t_cublas = time_graphs_interleaved(list(calls.values()), n, max(n, 8))
            name = route(T, G, R, Dg, "sm_90a", sms=torch.cuda.get_device_properties(0).multi_processor_count)[0]
            rows.append([f"{G}", f"{R}", f"{Dg}", f"{T}", "cuBLAS" if name == "wo_a_cublas" else name,
                         f"{t_def * 1e6:.2f}", f"{t_cute * 1e6:.2f}", f"{t_cublas * 1e6:.2f}",
                         f"{min(t_cute, t_cublas) / t_def:.2f}"])
            print("| " + " | ".join(rows[-1]) + " |", flush=True)
        ws = None
    report("WO-A routes", f"python bench/bench_wo_a_routes.py --tokens {args.tokens} --shapes {args.shapes}",
           markdown_table(["G", "R", "Dg", "T", "default route", "default us", "CuTe us", "cuBLAS us",
                           "best / default"], rows), out=args.out)


if __name__ == "__main__":
    main()
