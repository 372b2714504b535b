"""Benchmark WO-A (token-major output) against the unfused PyTorch path on the GPU.

    python bench/bench_wo_a.py [--tokens 1,5,64,320,4096,16384] [--out FILE]

Baselines, same run: (a) the unfused path (the model's original): group-major batched GEMM
``torch.bmm(o.view(T, G, Dg).transpose(0, 1), wo_a.transpose(1, 2))`` -> ``[G, T, R]``, then
``.transpose(0, 1).reshape(T, G*R)`` (a copy); (b) that ``torch.bmm`` alone (cuBLAS,
group-major output); (c) ``torch.bmm`` storing token-major ``y`` itself through a strided
``out`` (ldc = G*R: cuBLAS alone, no copy -- the unfused path without its transpose). "ours
(default path)" is ``wo_a()`` -- on Hopper cuBLAS into ``y`` inside the measured bands of
:mod:`cute_kernels.wo_a_cublas` (those rows say so), this project's kernels elsewhere; "CuTe
path" is ``wo_a(backend="cute")``, this project's kernels at every row. "default path + PDL":
``wo_a(..., pdl=True)``, launched as a programmatic dependent: back to back in the graph, each
launch's first weight tiles load while the previous launch drains. At T <= 64 also the two
decode kernels on their own: ``decode_kernel="mma"`` (warp MMAs) and ``"wgmma"`` (TMA + wgmma,
weight rows as M). All timed by CUDA-graph replay over rotating weight sets larger than L2,
after 0.5 s of dense matmuls; ours, (a), (b), (c) and the CuTe path interleaved (each trial
replays the five graphs in turn), so a drift of the clocks during a row moves all five alike.
Decode rows report weight-streaming bandwidth (bytes = weights + o + y) against 4.3 TB/s;
prefill rows report TFLOP/s against 790.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (check_output, H200_BF16_FLOPS, H200_COPY_BW, gpu_warmup, markdown_table, report,  # noqa: E402
                    rotation_count, time_graph, time_graphs_interleaved)

from cute_kernels.wo_a import route, wo_a  # noqa: E402
from cute_kernels.wo_a_cublas import wo_a_cublas  # noqa: E402

SHAPES = [(16, 1024, 1024), (8, 512, 2048), (16, 512, 2048), (8, 1024, 1024)]  # (G, R, Dg)
#: DeepSeek-V4-Flash's and -Pro's WO-A (G, R, Dg)
V4_SHAPES = [(8, 1024, 4096), (16, 1024, 4096)]
TOKENS = [1, 5, 64, 320, 4096, 16384]


def weight_sets(G: int, R: int, Dg: int) -> list[torch.Tensor]:
    """Rotating bf16 weight sets ``wo_a [G, R, Dg]`` (scaled for O(1) outputs): enough of them
    that one pass over the list is twice L2 (:func:`common.rotation_count`)."""
    return [(torch.randn(G, R, Dg, device="cuda") / Dg**0.5).bfloat16() for _ in range(rotation_count(G * R * Dg * 2))]


def tokens_out_ref(T: int, G: int, R: int, Dg: int, w: torch.Tensor):
    """A random attention output ``o [T, 8G, Dg/8]``, an output buffer ``y [T, G*R]`` and the
    FP32 einsum of ``o`` with ``w``, token-major like ``y``: the problem at ``T``."""
    o = torch.randn(T, G * 8, Dg // 8, device="cuda").bfloat16()
    y = torch.empty(T, G * R, device="cuda", dtype=torch.bfloat16)
    ref = torch.einsum("tgd,grd->tgr", o.view(T, G, Dg).float(), w.float()).reshape(T, G * R)
    return o, y, ref


def bmm_only(o, w):
    """cuBLAS batched GEMM alone, group-major output [G, T, R] (no transpose)."""
    T = o.shape[0]
    G, R, Dg = w.shape
    return torch.bmm(o.view(T, G, Dg).transpose(0, 1), w.transpose(1, 2))


def bmm_token_major(o, w, y):
    """cuBLAS batched GEMM storing token-major ``y [T, G*R]`` itself -- ``y`` viewed as
    ``[G, T, R]`` with strides ``(R, G*R, 1)``, a valid strided-batched C (ldc = G*R) -- on the
    current stream: the call ``wo_a()``'s cuBLAS route makes."""
    return wo_a_cublas(o, w, y)


def describe(kernel_config) -> str:
    """A route's kernel and tiling in words (the table's shape column)."""
    name, cfg = kernel_config
    if name == "wo_a_decode":
        return f"decode {cfg['bm']}x{cfg['bn']}, {cfg['splits']} split(s), {cfg['stages']} stages"
    if name == "wo_a_decode_swap_ab":
        return f"wgmma decode 64x{cfg['tok_n']}, {cfg['stages']} stages of {cfg['bk']}"
    tile = f"tile {cfg['tile_m']}x{cfg['tile_n']}"
    if cfg.get("pingpong"):
        tile = f"pingpong {tile} cluster {cfg.get('cluster_m', 1)}x{cfg.get('cluster_n', 1)}"
    if cfg.get("swap_ab"):
        tile = f"swapped (R x T) {tile} cluster {cfg.get('cluster_m', 1)}x{cfg.get('cluster_n', 1)}"
        if cfg.get("occupancy", 1) > 1:
            tile += f", {cfg['occupancy']} CTAs/SM"
    if cfg.get("weight_l2_hint"):
        tile += f", weights {cfg['weight_l2_hint']}"
    if cfg.get("max_stages"):
        tile += f", at most {cfg['max_stages']} stages"
    return tile


def unfused(o, w):
    T = o.shape[0]
    G, R, Dg = w.shape
    y = torch.bmm(o.view(T, G, Dg).transpose(0, 1), w.transpose(1, 2))
    return y.transpose(0, 1).reshape(T, G * R)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated T values")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    gpu_warmup()
    for G, R, Dg in SHAPES:
        wbytes = G * R * Dg * 2
        ws = weight_sets(G, R, Dg)
        n = len(ws)
        for T in tokens:
            o = torch.randn(T, G * 8, Dg // 8, device="cuda").bfloat16()
            y = torch.empty(T, G * R, device="cuda", dtype=torch.bfloat16)
            ref = torch.einsum("tgd,grd->tgr", o.view(T, G, Dg).float(), ws[0].float()).reshape(T, G * R)
            what = f"wo_a T={T} G={G} R={R} Dg={Dg}"
            check_output(what, lambda i: wo_a(o, ws[0], out=y), y, ref)  # the default path, once
            for k in (("mma", "wgmma") if T <= 64 else ()):
                check_output(f"{what} decode {k}", lambda i, k=k: wo_a(o, ws[0], out=y, decode_kernel=k), y, ref)
            check_output(f"{what} engine", lambda i: wo_a(o, ws[0], out=y, decode_kernel=False), y, ref)
            # Discarded: the first graph timed after the previous row's launches ran up to 0.8 us
            # slow at decode T.
            time_graph(lambda i: wo_a(o, ws[i], out=y), n, max(n, 8), trials=10)
            # the default path and the three baselines interleaved: their ratios are the verdicts
            y_c, y_cute = torch.empty_like(y), torch.empty_like(y)
            t_ours, t_ref, t_bmm, t_tm, t_cute = time_graphs_interleaved(
                [lambda i: wo_a(o, ws[i], out=y), lambda i: unfused(o, ws[i]), lambda i: bmm_only(o, ws[i]),
                 lambda i: bmm_token_major(o, ws[i], y_c), lambda i: wo_a(o, ws[i], out=y_cute, backend="cute")],
                n, max(n, 8))
            t_eng = time_graph(lambda i: wo_a(o, ws[i], out=y, decode_kernel=False), n, max(n, 8))
            t_dec = {k: time_graph(lambda i, k=k: wo_a(o, ws[i], out=y, decode_kernel=k), n, max(n, 8))
                     for k in ("mma", "wgmma")} if T <= 64 else {}
            t_pdl = time_graph(lambda i: wo_a(o, ws[i], out=y, pdl=True), n, max(n, 8))
            flops = 2 * T * G * R * Dg
            nbytes = wbytes + T * G * Dg * 2 + T * G * R * 2
            def lim(t):
                return (f"{100 * nbytes / t / H200_COPY_BW:.0f}% of 4.3 TB/s" if T <= 64
                        else f"{100 * flops / t / H200_BF16_FLOPS:.0f}% of 790 TFLOP/s")
            tile = describe(route(T, G, R, Dg, "sm_90a", backend="cute"))
            if route(T, G, R, Dg, "sm_90a")[0] == "wo_a_cublas":
                tile = f"**cuBLAS into y** (CuTe path: {tile})"
            rows.append([f"T={T} G={G} R={R} Dg={Dg} {tile}",
                         f"{t_ours * 1e6:.2f}", f"{t_ref * 1e6:.2f}", f"{t_bmm * 1e6:.2f}",
                         f"{t_tm * 1e6:.2f}", f"{t_cute * 1e6:.2f}",
                         f"{t_ref / t_ours:.2f}x", f"{t_bmm / t_ours:.2f}x", f"{t_tm / t_ours:.2f}x",
                         f"{t_bmm / t_cute:.2f}x", f"{nbytes / t_ours / 1e12:.2f}", f"{flops / t_ours / 1e12:.1f}", lim(t_ours),
                         f"{t_eng * 1e6:.2f}",
                         *(f"{t_dec[k] * 1e6:.2f} ({100 * nbytes / t_dec[k] / H200_COPY_BW:.0f}%)" if t_dec else "-"
                           for k in ("mma", "wgmma")),
                         f"{t_pdl * 1e6:.2f} ({t_ours / t_pdl:.2f}x, {lim(t_pdl)})"])
            print("| " + " | ".join(rows[-1]) + " |", flush=True)  # progress: a cut-off run keeps its rows
        ws = None
    report("WO-A token-major", f"python bench/bench_wo_a.py --tokens {args.tokens}",
           markdown_table(["shape", "ours us (default path)", "(a) bmm+transpose us", "(b) bmm alone us",
                           "(c) bmm into token-major y us", "CuTe path us", "vs (a)", "vs (b)", "vs (c)",
                           "CuTe path vs (b)", "TB/s", "TFLOP/s", "of limit", "engine us",
                           "mma decode us (% of 4.3 TB/s)", "wgmma decode us (%)",
                           "default path + PDL us (speed-up)"], rows), out=args.out)


if __name__ == "__main__":
    main()
