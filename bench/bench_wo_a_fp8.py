"""Benchmark WO-A with e4m3 weights (128 x 128 block scales) at decode T against bf16 WO-A.

    python bench/bench_wo_a_fp8.py [--tokens 1,5,16,32] [--shapes GxRxDg,...] [--variants 128/plan,...] [--out FILE]

Per shape and T, same run, CUDA-graph replay over rotating weight sets larger than L2: the FP8
kernel at :func:`cute_kernels.wo_a_decode_fp8.wo_a_fp8`'s plan, bf16 WO-A's default path
(:func:`cute_kernels.wo_a.wo_a`) and cuBLAS ``bmm`` alone on the bf16 weights. Bandwidth: the
FP8 call's bytes (e4m3 weights + scales + o + y) against 4.3 TB/s; the speed-ups are against
the bf16 calls, which move twice the weight bytes. ``--variants``: one row each,
``bk/stages[/splits[/widen]]`` at the plan's tiles -- the K slice 128 (the plan) or 256 (two
scale blocks, the bf16 kernel's bytes per slice); the depth ``plan``, ``x2`` (twice the
plan's) or a number, lowered until it fits shared memory; the K splits ``plan`` (the
default), ``x2`` or a number; the weights' widening ``cvt`` (the default: conversion
instructions) or ``bits`` (:mod:`cute_kernels.e4m3_widen`).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_wo_a import SHAPES, V4_SHAPES, bmm_only  # noqa: E402
from common import H200_COPY_BW, markdown_table, measure, report, rotation_count, time_graph  # noqa: E402

import cutlass  # noqa: E402
from cute_kernels import jit  # noqa: E402
from cute_kernels.wo_a import wo_a  # noqa: E402
from cute_kernels.wo_a_decode import WoADecodeWorkspace  # noqa: E402
from cute_kernels.wo_a_decode_fp8 import (SMEM_PER_CTA, WIDEN, WoADecodeFp8, plan,  # noqa: E402
                                          quantize_wo_a_fp8, smem_bytes, wo_a_fp8_reference)

TOKENS = [1, 5, 16, 32]


def variant_config(d: dict, bk: int, depth: str, splits: str, widen: str = "cvt") -> dict:
    """The plan ``d`` with the K slice ``bk``, the depth, the splits and the widening of a
    ``--variants`` entry."""
    d = dict(d, **({"bk": bk} if bk != 128 else {}), **({"widen": widen} if widen != "cvt" else {}))
    if depth != "plan":
        d["stages"] = 2 * d["stages"] if depth == "x2" else int(depth)
    if splits != "plan":
        d["splits"] = 2 * d["splits"] if splits == "x2" else int(splits)
    return d


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="also write the table to this file")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated T values (<= 64; default "
                    "%(default)s)")
    ap.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in V4_SHAPES + SHAPES),
                    help="comma-separated GxRxDg (default: V4-Flash, V4-Pro, then the bf16 bench's: %(default)s)")
    ap.add_argument("--variants", default="128/plan",
                    help="comma-separated bk/stages[/splits[/widen]] (bk: 128 or 256; stages, splits: plan, x2 or a "
                         "number; widen: cvt or bits; default %(default)s)")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    defaults = ["", "plan", "plan", "cvt"]  # what an entry leaves off: stages, splits, widen
    variants = [(v.split("/") + defaults[len(v.split("/")):])[:4] for v in args.variants.split(",")]
    for v in variants:
        if (v[0] not in ("128", "256") or not all(x in ("plan", "x2") or x.isdigit() for x in v[1:3])
                or v[3] not in WIDEN):
            ap.error(f"--variants: {'/'.join(v)!r} is not bk/stages[/splits[/widen]] (e.g. 256/plan, 128/plan/x2 "
                     f"or 128/plan/plan/bits)")
    rows = []
    for G, R, Dg in shapes:
        n = rotation_count(G * R * Dg * 2)  # sized by the bf16 set, the larger
        ws = [(torch.randn(G, R, Dg, device="cuda") / Dg**0.5).bfloat16() for _ in range(n)]
        qs = [quantize_wo_a_fp8(w) for w in ws]
        workspace = WoADecodeWorkspace(G, R, device="cuda")
        for T in tokens:
            o = torch.randn(T, G * 8, Dg // 8, device="cuda").bfloat16()
            y = torch.empty(T, G * R, device="cuda", dtype=torch.bfloat16)
            ref = wo_a_fp8_reference(o, *qs[0]).float()
            t16 = time_graph(lambda i: wo_a(o, ws[i], out=y), n, max(n, 8))
            t_bmm = time_graph(lambda i: bmm_only(o, ws[i]), n, max(n, 8))
            nbytes = G * R * Dg + qs[0][1].numel() * 4 + o.numel() * 2 + y.numel() * 2
            for bk, depth, splits, widen in variants:
                bk = int(bk)
                d = variant_config(plan(T, G, R, Dg), bk, depth, splits, widen)
                while smem_bytes(d["bm"], d["stages"], d["bn"], bk, Dg) > SMEM_PER_CTA:
                    d["stages"] -= 1
                if not WoADecodeFp8.can_implement(T, G, R, Dg, d["splits"], d["bn"], bk):
                    continue
                fn = jit.get_kernel("wo_a_decode_fp8", "sm_90a", G=G, R=R, Dg=Dg, **d)

                def call(i, fn=fn):
                    P = jit.gmem_ptr
                    fn(P(cutlass.BFloat16, o, 16), P(cutlass.Float8E4M3FN, qs[i][0], 16),
                       P(cutlass.Float32, qs[i][1], 4), P(cutlass.BFloat16, y, 4),
                       P(cutlass.Float32, workspace.partials, 4), P(cutlass.Int32, workspace.counters, 4),
                       jit.i32(T), jit.cu_stream())

                t8, err = measure(call, y, ref, n)
                rows.append([f"T={T} G={G} R={R} Dg={Dg} fp8 {d['bm']}x{d['bn']}, {d['splits']} split(s), "
                             f"{d['stages']} stages, K slice {bk}, widen {widen}",
                             f"{t8 * 1e6:.2f}", f"{t16 * 1e6:.2f}",
                             f"{t_bmm * 1e6:.2f}", f"{t16 / t8:.2f}x", f"{t_bmm / t8:.2f}x",
                             f"{nbytes / t8 / 1e12:.2f}", f"{100 * nbytes / t8 / H200_COPY_BW:.0f}%", f"{err:.1e}"])
                print("| " + " | ".join(rows[-1]) + " |", flush=True)
        ws = qs = None  # free this shape's weights before the next
    report("WO-A with FP8 weights", f"python bench/bench_wo_a_fp8.py --tokens {args.tokens} "
           f"--shapes {args.shapes} --variants {args.variants}",
           markdown_table(["shape", "fp8 us", "bf16 wo_a us", "bmm alone (bf16) us", "vs bf16 wo_a",
                           "vs bmm", "TB/s", "of 4.3 TB/s", "rel. err vs spec"], rows), out=args.out)


if __name__ == "__main__":
    main()
