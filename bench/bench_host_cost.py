"""Eager host cost per call of every kernel entry point at decode shapes, next to torch.add.

    python bench/bench_host_cost.py [--calls 2000] [--out FILE]

For each op: the Python entry point (``cute_kernels.*`` / ``moe.*``) and its custom op
(``torch.ops.cute_kernels.*``), called eagerly ``--calls`` times back to back on warm caches
(compiled once before), outputs preallocated where the API allows. Host time per call is the
median over 5 trials of (wall time of the loop) / calls, measured while the stream is kept
busy by a long sleep kernel enqueued first -- so the loop never waits on the GPU and what is
timed is the host path: validation, cache lookup, argument packing, the launch call. The
kernels' own GPU time is not in it. ``torch.add`` on a small tensor is the yardstick in the
same run (goal: <= 5 us for single-kernel ops, never more than torch.add). The entry points
are timed twice: with :class:`cute_kernels.jit.DirectLaunch` resolving the arguments (the
default) and through the DSL's own call path (``jit.DIRECT_LAUNCH = False``); before timing,
each op's output through the first is checked bit-equal to its output through the second. The
kernels' own benches and tests check the outputs against their references.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import markdown_table  # noqa: E402

import cute_kernels.ops  # noqa: E402,F401
from cute_kernels import jit  # noqa: E402
import moe.ops  # noqa: E402,F401
from cute_kernels.masked_softmax import masked_softmax  # noqa: E402
from cute_kernels.mhc_post_mix import mhc_post_mix  # noqa: E402
from cute_kernels.mhc_pre_mix import mhc_pre_mix  # noqa: E402
from cute_kernels.mhc_stats import MhcStatsWorkspace, mhc_split_phi, mhc_stats  # noqa: E402
from cute_kernels.row_rms import row_rms  # noqa: E402
from cute_kernels.wo_a import wo_a  # noqa: E402
from moe.finalize import moe_finalize  # noqa: E402
from moe.quant import mxfp8_quantize  # noqa: E402

ops = torch.ops.cute_kernels


def host_us(fn, calls: int, trials: int = 5) -> float:
    """Median host microseconds per ``fn()`` with the GPU kept busy (see the module docstring)."""
    fn()
    torch.cuda.synchronize()
    per = []
    for _ in range(trials):
        torch.cuda._sleep(int(2e9))  # a long kernel ahead: the loop below never waits on the GPU
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        per.append((time.perf_counter() - t) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(per)


def cases():
    dev = "cuda"
    T, C, n = 6, 7168, 4
    bf = lambda *s: torch.randn(*s, device=dev).bfloat16()  # noqa: E731
    x2, x3 = bf(T, C), bf(T, n, C)
    rms_out = torch.empty(T, device=dev)
    h = torch.rand(T, 24, device=dev)
    u, xo = torch.empty(T, C, device=dev, dtype=torch.bfloat16), torch.empty_like(x3)
    phi = torch.randn(24, n * C, device=dev) / (n * C) ** 0.5
    planes, alpha, bias = mhc_split_phi(phi), torch.rand(3, device=dev) + 0.5, torch.randn(24, device=dev)
    ws, H = MhcStatsWorkspace(n, T, device=dev), torch.empty(T, 24, device=dev)
    o, w = bf(T, 64, 512), bf(8, 1024, 4096) / 64
    y = torch.empty(T, 8 * 1024, device=dev, dtype=torch.bfloat16)
    sc, mk = bf(T, 1, 64, 592), torch.rand(T, 1, 608, device=dev) < 0.3
    sm = torch.empty_like(sc)
    q, s = torch.empty(T, C, dtype=torch.float8_e4m3fn, device=dev), torch.empty(T, C // 32, dtype=torch.uint8,
                                                                                  device=dev)
    yr, wt = bf(T * 6 + 128, C), torch.rand(T, 6, device=dev)
    pos = torch.randperm(T * 6 + 128, device=dev)[:T * 6].int()
    sh, fo = bf(T, C), torch.empty(T, C, device=dev, dtype=torch.bfloat16)
    small = torch.randn(16, device=dev)
    return [
        ("torch.add (yardstick)", lambda: torch.add(small, small), None, None),
        ("row_rms", lambda: row_rms(x2, 1e-6, out=rms_out), lambda: ops.row_rms_out(x2, 1e-6, rms_out), rms_out),
        ("mhc_stats", lambda: mhc_stats(x3, planes, alpha, bias, workspace=ws, out=H),
         lambda: ops.mhc_stats(x3, planes, alpha, bias, 1e-6, 20, 0.0), H),
        ("mhc_pre_mix", lambda: mhc_pre_mix(x3, h, out=u), lambda: ops.mhc_pre_mix_out(x3, h, u), u),
        ("mhc_post_mix", lambda: mhc_post_mix(x3, h, x2, out=xo), lambda: ops.mhc_post_mix(x3, h, x2), xo),
        ("masked_softmax", lambda: masked_softmax(sc, mk, out=sm), lambda: ops.masked_softmax(sc, mk), sm),
        ("wo_a (Dg 4096)", lambda: wo_a(o, w, out=y), lambda: ops.wo_a_out(o, w, y), y),
        ("mxfp8_quantize", lambda: mxfp8_quantize(x2, q=q, scales=s), lambda: ops.mxfp8_quantize(x2, "plain"), q),
        ("moe_finalize (+ shared)", lambda: moe_finalize(yr, wt, pos, sh, out=fo),
         lambda: ops.moe_finalize(yr, wt, pos, sh), fo),
    ]


def direct_equals_dsl(entry, out) -> bool:
    """The entry point's output through :class:`cute_kernels.jit.DirectLaunch` equals, bit for
    bit, its output through the DSL's own call path (each into a poisoned buffer)."""
    poison = 0x55 if out.dtype in (torch.uint8, torch.float8_e4m3fn) else float("nan")
    jit.DIRECT_LAUNCH = False
    out.fill_(poison)
    entry()
    ref = out.clone()
    jit.DIRECT_LAUNCH = True
    entry()
    entry()  # the first call per argument types checks; this one takes the direct path
    out.fill_(poison)
    entry()
    torch.cuda.synchronize()
    return torch.equal(out.view(torch.uint8), ref.view(torch.uint8))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = []
    add = None
    for name, entry, op, out in cases():
        print(f"{name}: checking, then timing", flush=True)  # a fatal CUDA error names its op
        if out is not None and not direct_equals_dsl(entry, out):
            raise SystemExit(f"{name}: the direct launch's output differs from the DSL call path's; not timing it")
        t_entry = host_us(entry, args.calls)
        jit.DIRECT_LAUNCH = False
        t_dsl = host_us(entry, args.calls) if out is not None else float("nan")
        jit.DIRECT_LAUNCH = True
        t_op = host_us(op, args.calls) if op is not None else float("nan")
        add = t_entry if add is None else add
        rows.append([name, f"{t_entry:.1f}", f"{t_dsl:.1f}", f"{t_op:.1f}", f"{t_entry / add:.1f}x"])
        print("| " + " | ".join(rows[-1]) + " |", flush=True)
    text = "\n".join([f"## Eager host cost per call -- {torch.cuda.get_device_name()}, {datetime.date.today()}", "",
                      f"Command: `python bench/bench_host_cost.py --calls {args.calls}`", "",
                      markdown_table(["op (decode shapes: T = 6)", "entry point us", "entry point, DSL call path us",
                                      "custom op us", "entry point vs torch.add"], rows)])
    print(text)
    if args.out:
        open(args.out, "w").write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
