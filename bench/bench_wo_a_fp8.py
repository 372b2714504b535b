"""Benchmark WO-A with e4m3 weights (128 x 128 block scales) at decode T against bf16 WO-A.

    python bench/bench_wo_a_fp8.py [--tokens 1,5,16,32] [--out FILE]

Per shape and T, same run, CUDA-graph replay over rotating weight sets larger than L2: the FP8
kernel (:func:`cute_kernels.wo_a_decode_fp8.wo_a_fp8`), bf16 WO-A's default path
(:func:`cute_kernels.wo_a.wo_a`) and cuBLAS ``bmm`` alone on the bf16 weights (issue 4's
baseline (b)). Bandwidth: the FP8 call's bytes (e4m3 weights + scales + o + y) against 4.3
TB/s; the speed-ups are against the bf16 calls, which move twice the weight bytes.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_wo_a import SHAPES, bmm_only  # noqa: E402
from common import H200_COPY_BW, markdown_table, rotation_count, time_graph  # noqa: E402

from cute_kernels.wo_a import wo_a  # noqa: E402
from cute_kernels.wo_a_decode_fp8 import plan, quantize_wo_a_fp8, wo_a_fp8, wo_a_fp8_reference  # noqa: E402

TOKENS = [1, 5, 16, 32]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated T values (<= 32)")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    for G, R, Dg in SHAPES:
        n = rotation_count(G * R * Dg * 2)  # sized by the bf16 set, the larger
        ws = [(torch.randn(G, R, Dg, device="cuda") / Dg**0.5).bfloat16() for _ in range(n)]
        qs = [quantize_wo_a_fp8(w) for w in ws]
        for T in tokens:
            o = torch.randn(T, G * 8, Dg // 8, device="cuda").bfloat16()
            y = torch.empty(T, G * R, device="cuda", dtype=torch.bfloat16)
            y.fill_(float("nan"))
            wo_a_fp8(o, *qs[0], out=y)
            torch.cuda.synchronize()
            ref = wo_a_fp8_reference(o, *qs[0]).float()
            err = ((y.float() - ref).norm() / ref.norm()).item()
            t8 = time_graph(lambda i: wo_a_fp8(o, *qs[i], out=y), n, max(n, 8))
            t16 = time_graph(lambda i: wo_a(o, ws[i], out=y), n, max(n, 8))
            t_bmm = time_graph(lambda i: bmm_only(o, ws[i]), n, max(n, 8))
            nbytes = G * R * Dg + qs[0][1].numel() * 4 + o.numel() * 2 + y.numel() * 2
            d = plan(T, G, R, Dg)
            rows.append([f"T={T} G={G} R={R} Dg={Dg} fp8 {d['bm']}x{d['bn']}, {d['splits']} split(s), "
                         f"{d['stages']} stages", f"{t8 * 1e6:.2f}", f"{t16 * 1e6:.2f}", f"{t_bmm * 1e6:.2f}",
                         f"{t16 / t8:.2f}x", f"{t_bmm / t8:.2f}x", f"{nbytes / t8 / 1e12:.2f}",
                         f"{100 * nbytes / t8 / H200_COPY_BW:.0f}%", f"{err:.1e}"])
            print("| " + " | ".join(rows[-1]) + " |", flush=True)
        ws = qs = None  # free this shape's weights before the next
    text = "\n".join([f"## WO-A with FP8 weights -- {torch.cuda.get_device_name()}, {datetime.date.today()}", "",
                      f"Command: `python bench/bench_wo_a_fp8.py --tokens {args.tokens}`", "",
                      markdown_table(["shape", "fp8 us", "bf16 wo_a us", "bmm alone (bf16) us", "vs bf16 wo_a",
                                      "vs bmm", "TB/s", "of 4.3 TB/s", "rel. err vs spec"], rows)])
    print(text)
    if args.out:
        open(args.out, "w").write(text + "\n")


if __name__ == "__main__":
    main()
