"""Benchmark row_rms and rms_norm against PyTorch on the GPU; prints markdown tables for bench/RESULTS.md.

    python bench/bench_row_rms.py [--out FILE]
    python bench/bench_row_rms.py --loads-per-thread 2,4,8   # rms_norm's and row_rms' row layouts alone

Table 1: kernel time per call from CUDA-graph replay over rotating inputs (> L2), vs the
PyTorch composite ``rsqrt(x.float().square().mean(-1) + eps)`` timed the same way, and
the achieved fraction of the H200's 4.3 TB/s copy bandwidth (bytes = x read + rstd write).
Table 2: rms_norm (statistic + both bf16 multiplies, one launch) at the decode runtime's norm
shapes against the composite it replaces (``x * rsqrt(...).to(bf16) * w``: row_rms + three
launches, or the all-PyTorch composite), after checking it equals the row_rms-based composite
bit for bit; bytes = x read + y written + w read.
Table 3: eager host cost per call (prebuilt pointer wrappers, no graph) and the artifact
cache: load from disk vs compile, each in a fresh process.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import H200_COPY_BW, emit, markdown_table, report, rotation_count, time_graph  # noqa: E402

from cute_kernels.rms_norm import rms_norm  # noqa: E402
from cute_kernels.row_rms import row_rms  # noqa: E402

SHAPES = [(1, 7168), (5, 7168), (64, 7168), (64, 28672), (1024, 7168), (4096, 7168), (16384, 7168), (4096, 28672)]
EPS = 1e-6


def bench_kernel():
    rows = []
    for T, C in SHAPES:
        nbytes = T * C * 2 + T * 4
        n = rotation_count(nbytes)
        xs = [torch.randn(T, C, device="cuda").bfloat16() for _ in range(n)]
        outs = [torch.empty(T, device="cuda") for _ in range(n)]
        reps = max(n, 20)
        want = torch.rsqrt(xs[0].double().square().mean(-1) + EPS)
        if not ((row_rms(xs[0], EPS, out=outs[0]).double() - want).abs() <= 1e-5 * want).all():  # FP32 sums
            raise SystemExit(f"row_rms {T}x{C}: output check failed; not timing it")
        t_ours = time_graph(lambda i: row_rms(xs[i], EPS, out=outs[i]), n, reps)
        t_torch = time_graph(lambda i: torch.rsqrt(xs[i].float().square().mean(-1) + EPS), n, reps)
        bw = nbytes / t_ours
        rows.append([f"{T}x{C}", f"{t_ours * 1e6:.2f}", f"{t_torch * 1e6:.2f}", f"{t_torch / t_ours:.2f}x",
                     f"{bw / 1e12:.2f}", f"{100 * bw / H200_COPY_BW:.0f}%"])
        del xs, outs
    return markdown_table(["T x C (bf16)", "ours us", "torch us", "speedup", "ours TB/s", "% of 4.3 TB/s"], rows)


#: (rows, C, weighted): V4-Flash's norms at T = 6 tokens (a verify step) and 384 (BS64 x 6):
#: sublayer (4096), q-LoRA (1024), kv / entries (512), per head (64 x 512, no weight)
NORM_SHAPES = [(6, 4096, True), (6, 1024, True), (6, 512, True), (384, 512, False), (384, 4096, True),
               (24576, 512, False)]

#: the variants table's further shapes: V4-Pro's hidden size (7168) at decode and prefill rows
VARIANT_SHAPES = [(6, 7168, True), (384, 7168, True), (4096, 7168, True), (4096, 4096, True)]


def norm_inputs(T: int, C: int, weighted: bool):
    """``(bytes moved, rotation count, inputs, outputs, weight or None)`` of one norm shape."""
    nbytes = 2 * T * C * 2 + (C * 2 if weighted else 0)
    n = rotation_count(nbytes)
    xs = [torch.randn(T, C, device="cuda").bfloat16() for _ in range(n)]
    outs = [torch.empty(T, C, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
    return nbytes, n, xs, outs, torch.randn(C, device="cuda").bfloat16() if weighted else None


def bench_norm():
    rows = []
    for T, C, weighted in NORM_SHAPES:
        nbytes, n, xs, outs, w = norm_inputs(T, C, weighted)
        reps = max(n, 20)

        def composite_row_rms(i):
            y = xs[i] * row_rms(xs[i], EPS)[:, None].to(torch.bfloat16)
            return y if w is None else y * w

        def composite_torch(i):
            y = xs[i] * torch.rsqrt(xs[i].float().square().mean(-1, keepdim=True) + EPS).to(torch.bfloat16)
            return y if w is None else y * w

        rms_norm(xs[0], EPS, w, out=outs[0])
        if not torch.equal(outs[0], composite_row_rms(0)):
            raise SystemExit(f"rms_norm {T}x{C}: output differs from the row_rms composite; not timing it")
        t_ours = time_graph(lambda i: rms_norm(xs[i], EPS, w, out=outs[i]), n, reps)
        t_rr = time_graph(composite_row_rms, n, reps)
        t_torch = time_graph(composite_torch, n, reps)
        bw = nbytes / t_ours
        rows.append([f"{T}x{C}{'' if weighted else ' (no weight)'}", f"{t_ours * 1e6:.2f}", f"{t_rr * 1e6:.2f}",
                     f"{t_torch * 1e6:.2f}", f"{t_rr / t_ours:.2f}x", f"{100 * bw / H200_COPY_BW:.0f}%"])
        del xs, outs
    return markdown_table(["rms_norm T x C (bf16)", "ours us", "row_rms + 3 torch us", "torch composite us",
                           "vs row_rms + torch", "% of 4.3 TB/s"], rows)


def _variant_cells(loads: list[int], make, n: int, out0: torch.Tensor, ok, what: str) -> list[str]:
    """One variants-table row's cells: per ``loads_per_thread`` L, ``make(L)`` gives ``(launch(i),
    the kernel's RowRms layout)``; input 0's output (``out0``, NaN-poisoned first) must pass
    ``ok()`` before the variant is timed over the ``n`` rotating inputs. Then the fastest L."""
    times, shapes = [], []
    for L in loads:
        launch, op = make(L)
        out0.fill_(float("nan"))
        launch(0)
        if not ok():
            raise SystemExit(f"{what} loads_per_thread={L}: output check failed")
        times.append(time_graph(launch, n, max(n, 20)))
        shapes.append(f"{op.row_threads} x {op.rows_per_cta}")
    best = min(range(len(loads)), key=times.__getitem__)
    return [f"{t * 1e6:.2f} ({s})" for t, s in zip(times, shapes)] + [str(loads[best])]


def _variant_table(kernel: str, loads: list[int], rows: list[list[str]]) -> str:
    return markdown_table([f"{kernel} T x C (bf16)"] + [f"{L} loads / thread us (threads x rows a CTA)" for L in loads]
                          + ["fastest"], rows)


def bench_norm_variants(loads: list[int]):
    """rms_norm at the decode shapes with each ``loads_per_thread`` (16-byte loads per thread,
    which sets a row's threads; the entry point's is ``cute_kernels.rms_norm.LOADS_PER_THREAD``),
    each variant's output checked against the entry point's first (within two bf16 ulps: the
    variants sum a row in different orders, so a statistic may round the other way)."""
    from cute_kernels import jit
    from cute_kernels.arch import current_arch
    from cute_kernels.rms_norm import RmsNorm
    from cutlass import BFloat16, Float32

    P = jit.gmem_ptr
    rows = []
    for T, C, weighted in NORM_SHAPES + VARIANT_SHAPES:
        _, n, xs, outs, w = norm_inputs(T, C, weighted)
        want = rms_norm(xs[0], EPS, w).float()

        def make(L):
            fn = jit.get_kernel("rms_norm", current_arch(), hidden=C, dtype="bfloat16", weighted=weighted,
                                rope_dim=0, loads_per_thread=L)

            def launch(i):
                fn(P(BFloat16, xs[i], 16), P(BFloat16, w if w is not None else xs[i], 16), P(Float32, xs[i], 16),
                   P(BFloat16, outs[i], 16), jit.i32(T), jit.i32(1), jit.f32(EPS), jit.cu_stream(None))
            return launch, RmsNorm(BFloat16, C, weighted, 0, L)

        def ok():  # against the entry point's output
            return bool(((outs[0].float() - want).abs() <= 2.0**-6 * want.abs()).all())

        rows.append([f"{T}x{C}{'' if weighted else ' (no weight)'}"]
                    + _variant_cells(loads, make, n, outs[0], ok, f"rms_norm {T}x{C}"))
        del xs, outs
    return _variant_table("rms_norm", loads, rows)


def bench_stat_variants(loads: list[int]):
    """row_rms (the statistic alone) at its shapes with each ``loads_per_thread``, each checked
    against FP64 first."""
    from cute_kernels import jit
    from cute_kernels.arch import current_arch
    from cute_kernels.row_rms import RowRms
    from cutlass import BFloat16, Float32

    P = jit.gmem_ptr
    rows = []
    for T, C in SHAPES:
        n = rotation_count(T * C * 2 + T * 4)
        xs = [torch.randn(T, C, device="cuda").bfloat16() for _ in range(n)]
        outs = [torch.empty(T, device="cuda") for _ in range(n)]
        want = torch.rsqrt(xs[0].double().square().mean(-1) + EPS)

        def make(L):
            fn = jit.get_kernel("row_rms", current_arch(), hidden=C, dtype="bfloat16", loads_per_thread=L)

            def launch(i):
                fn(P(BFloat16, xs[i], 16), P(Float32, outs[i], 4), jit.i32(T), jit.f32(EPS), jit.cu_stream(None))
            return launch, RowRms(BFloat16, C, L)

        def ok():  # against FP64
            return bool(((outs[0].double() - want).abs() <= 1e-5 * want).all())

        rows.append([f"{T}x{C}"] + _variant_cells(loads, make, n, outs[0], ok, f"row_rms {T}x{C}"))
        del xs, outs
    return _variant_table("row_rms", loads, rows)


def bench_host():
    x = torch.randn(64, 7168, device="cuda").bfloat16()
    out = torch.empty(64, device="cuda")
    row_rms(x, out=out)
    torch.cuda.synchronize()

    def per_call(f, n=2000):
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                f()
            torch.cuda.synchronize()
            ts.append((time.perf_counter() - t0) / n)
        return statistics.median(ts)

    ours = per_call(lambda: row_rms(x, EPS, out=out))
    ref = per_call(lambda: torch.rsqrt(x.float().square().mean(-1) + EPS))
    return ours, ref


_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from cute_kernels import catalog, jit
catalog.kernels()
t_import = time.perf_counter() - t0
t0 = time.perf_counter()
jit.get_kernel("row_rms", sys.argv[1], hidden=7168, dtype="bfloat16")
print(json.dumps({"get": time.perf_counter() - t0, "import": t_import, "compiles": jit.CACHE.stats.compiles,
                  "loads": jit.CACHE.stats.disk_loads}))
"""


def bench_artifact(arch):
    import json
    import tempfile

    env = dict(os.environ, CUTE_KERNELS_CACHE_DIR=tempfile.mkdtemp())
    res = []
    for _ in range(2):  # first: empty cache -> compile + export; second: load only
        p = subprocess.run([sys.executable, "-c", _CHILD, arch], env=env, capture_output=True, text=True, check=True)
        res.append(json.loads(p.stdout.strip().splitlines()[-1]))
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--loads-per-thread", default=None,
                    help="comma-separated loads per thread: only the rms_norm / row_rms variants tables (e.g. 2,4,8)")
    args = ap.parse_args()
    from cute_kernels.arch import current_arch

    arch = current_arch()
    if args.loads_per_thread:
        loads = [int(v) for v in args.loads_per_thread.split(",")]
        report("rms_norm and row_rms variants",
               f"python bench/bench_row_rms.py --loads-per-thread {args.loads_per_thread}",
               bench_norm_variants(loads), "", bench_stat_variants(loads), "", out=args.out)
        return
    lines = [f"## row_rms -- {torch.cuda.get_device_name()} ({arch}), {datetime.date.today()}",
             "", "Command: `python bench/bench_row_rms.py`", "", bench_kernel(), "", bench_norm(), ""]
    ours, ref = bench_host()
    cold, warm = bench_artifact(arch)
    lines += [
        markdown_table(["host cost per eager call", "us"], [
            ["row_rms (cached compiled fn + cached pointer wrappers)", f"{ours * 1e6:.1f}"],
            ["torch composite (4 kernels)", f"{ref * 1e6:.1f}"],
        ]),
        "",
        markdown_table(["artifact cache, fresh process", "seconds", "compiler runs", "disk loads"], [
            ["empty cache: compile + export", f"{cold['get']:.3f}", cold["compiles"], cold["loads"]],
            ["warm cache: load_module", f"{warm['get']:.4f}", warm["compiles"], warm["loads"]],
        ]),
    ]
    text = "\n".join(lines)
    emit(text, args.out)


if __name__ == "__main__":
    main()
