"""Eager host cost per call of every kernel entry point at decode shapes, next to torch.add.

    python bench/bench_host_cost.py [--calls 2000] [--only row_rms,mhc_stats] [--out FILE]

For each op: the Python entry point (``cute_kernels.*`` / ``moe.*``) and its custom op
(``torch.ops.cute_kernels.*``), called eagerly ``--calls`` times back to back on warm caches
(compiled once before), outputs preallocated where the API allows. Host time per call is the
median over chunks of 200 calls (5 x calls / 200 of them) of (wall time of the chunk) / 200,
each chunk timed while the stream is kept busy by a sleep kernel enqueued first -- so the loop
never waits on the GPU (the chunk's launches fit the driver's launch queue) and what is timed
is the host path: validation, cache lookup, argument packing, the launch call. The
kernels' own GPU time is not in it. ``torch.add`` on a small tensor is the yardstick in the
same run (goal: <= 5 us for single-kernel ops, never more than torch.add): its own row, and
for the TVM-FFI launches, timed chunk for chunk beside each op (the last column: the op's
time over torch.add's in the same stretch of the run, so a host whose speed drifts -- this
pool's do -- moves both alike). The entry points
are timed three ways: with :class:`cute_kernels.jit.DirectLaunch` resolving the arguments (the
default), through the DSL's own call path (``jit.DIRECT_LAUNCH = False``) and, where the
``apache-tvm-ffi`` package imports, compiled with the DSL's TVM-FFI calling convention
(:func:`cute_kernels.jit.use_tvm_ffi`: the ops with a tensor entry -- every row here --
take it from their second call on; the custom ops, whose kernels are the entry points, are
timed that way too); before timing, each op's output through the first is
checked bit-equal to its output through the other two. The kernels' own benches and tests
check the outputs against their references.

Runtime-only mode (:mod:`cute_kernels.runtime_only`): the kernels this run compiled are in the
artifact cache (``--cache``, default a fresh directory); after the table above, the cache is
made a deployment (``bundle_runtime``) and this script runs again in a child process that
cannot import the DSL (compiler or runtime package): it times the entry points through the
cache's ctypes launchers and then, with apache-tvm-ffi, with :func:`cute_kernels.jit.use_tvm_ffi`
on (the tensor entries this run compiled, loaded through apache-tvm-ffi from the cache), after
checking each op's output bit-equal to this process's, and reports the import time of
``cute_kernels.row_rms`` and its first call (cubin load), next to the same two figures of a
fresh process with the DSL.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

#: run first, it makes a process one without the DSL: its packages cannot be found
NO_DSL = """
import importlib.abc, sys
class _NoDsl(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("cutlass", "nvidia_cutlass_dsl"):
            raise ModuleNotFoundError(f"no module named {name!r} (runtime-only run)", name=name)
sys.meta_path.insert(0, _NoDsl())
"""
if "--runtime-only-child" in sys.argv:  # before anything imports the DSL
    exec(NO_DSL)

import json  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import markdown_table, report  # noqa: E402

import cute_kernels.ops  # noqa: E402,F401
from cute_kernels import jit  # noqa: E402
import moe.ops  # noqa: E402,F401
from cute_kernels.masked_softmax import masked_softmax  # noqa: E402
from cute_kernels.mhc_post_mix import mhc_post_mix  # noqa: E402
from cute_kernels.mhc_pre_mix import mhc_pre_mix  # noqa: E402
from cute_kernels.mhc_stats import MhcStatsWorkspace, mhc_split_phi, mhc_stats  # noqa: E402
from cute_kernels.rms_norm import rms_norm  # noqa: E402
from cute_kernels.row_rms import row_rms  # noqa: E402
from cute_kernels.wo_a import wo_a  # noqa: E402
from cute_kernels.wo_a_decode_fp8 import quantize_wo_a_fp8, wo_a_fp8  # noqa: E402
from moe.finalize import moe_finalize  # noqa: E402
from moe.quant import mxfp8_gather_routed, mxfp8_quantize, mxfp8_quantize_routed, scale_buffer_size  # noqa: E402
from moe.router import V4_FLASH_ROUTER, MoeRouter  # noqa: E402

ops = torch.ops.cute_kernels


#: calls per timed chunk: each chunk runs behind its own sleep kernel, and a chunk's launches
#: must fit the driver's launch queue (about 1024 pending launches), or the loop stalls until
#: the sleep ends and times the GPU, not the host (an op that launches twice per call -- a
#: zeroed workspace, then its kernel -- would stall within 1000 calls)
CHUNK = 200


def _chunk_us(fn) -> float:
    """Host microseconds per call of one chunk of :data:`CHUNK` ``fn()`` calls behind a sleep
    kernel (the module docstring)."""
    torch.cuda._sleep(int(5e7))  # ~25 ms ahead: the chunk below (< 125 us a call) never waits
    t = time.perf_counter()
    for _ in range(CHUNK):
        fn()
    per = (time.perf_counter() - t) / CHUNK * 1e6
    torch.cuda.synchronize()
    return per


def host_us(fn, calls: int, trials: int = 5, yard=None):
    """Median host microseconds per ``fn()`` with the GPU kept busy (see the module docstring):
    ``trials`` x (``calls`` / :data:`CHUNK`) chunks of :data:`CHUNK` calls, each behind a sleep
    kernel long enough to outlast it. With ``yard`` (the ``torch.add`` yardstick), its chunks
    alternate with ``fn``'s and the result is the pair (``fn``'s median, ``yard``'s median):
    a host whose speed drifts during the run moves both alike. Says so when a tensor entry
    refused calls (their time is the validated launch's, not the hot path's)."""
    refused = dict(jit.TENSOR_ENTRY_REFUSALS)
    fn()
    if yard is not None:
        yard()
    torch.cuda.synchronize()
    per, per_yard = [], []
    for _ in range(trials * max(1, calls // CHUNK)):
        if yard is not None:
            per_yard.append(_chunk_us(yard))
        per.append(_chunk_us(fn))
    for key, n in jit.TENSOR_ENTRY_REFUSALS.items():
        if n > refused.get(key, 0):
            print(f"  (a tensor entry refused {n - refused.get(key, 0)} of these calls: {key})", flush=True)
    if yard is not None:
        return statistics.median(per), statistics.median(per_yard)
    return statistics.median(per)


_T0 = time.perf_counter()


def log(msg: str) -> None:
    """A progress line with the seconds since the start (a run cut short shows where it was)."""
    print(f"[{time.perf_counter() - _T0:6.1f} s] {msg}", flush=True)


def cases():
    dev = "cuda"
    torch.manual_seed(0)  # the same inputs in the runtime-only child
    T, C, n = 6, 7168, 4
    bf = lambda *s: torch.randn(*s, device=dev).bfloat16()  # noqa: E731
    x2, x3 = bf(T, C), bf(T, n, C)
    rms_out = torch.empty(T, device=dev)
    h = torch.rand(T, 24, device=dev)
    u, xo = torch.empty(T, C, device=dev, dtype=torch.bfloat16), torch.empty_like(x3)
    phi = torch.randn(24, n * C, device=dev) / (n * C) ** 0.5
    planes, alpha, bias = mhc_split_phi(phi), torch.rand(3, device=dev) + 0.5, torch.randn(24, device=dev)
    ws, H = MhcStatsWorkspace(n, T, device=dev), torch.empty(T, 24, device=dev)
    o, w = bf(T, 64, 512), bf(8, 1024, 4096) / 64  # V4-Flash's WO-A (FP8 below)
    # bf16 WO-A where the default route takes a decode kernel (V4's Dg = 4096 takes cuBLAS at T <= 32)
    o2, w2 = bf(T, 32, 512), bf(8, 1024, 2048) / 64
    y = torch.empty(T, 8 * 1024, device=dev, dtype=torch.bfloat16)  # (both WO-A rows' output: same shape)
    sc, mk = bf(T, 1, 64, 592), torch.rand(T, 1, 608, device=dev) < 0.3
    sm = torch.empty_like(sc)
    q, s = torch.empty(T, C, dtype=torch.float8_e4m3fn, device=dev), torch.empty(T, C // 32, dtype=torch.uint8,
                                                                                  device=dev)
    yr, wt = bf(T * 6 + 128, C), torch.rand(T, 6, device=dev)
    pos = torch.randperm(T * 6 + 128, device=dev)[:T * 6].int()
    sh, fo = bf(T, C), torch.empty(T, C, device=dev, dtype=torch.bfloat16)
    small = torch.randn(16, device=dev)
    xq, cs = bf(T, 64, 512), torch.rand(T, 32, 2, device=dev)  # V4's per-head q norm + RoPE
    yq = torch.empty_like(xq)
    nw, yn = bf(C), torch.empty_like(x2)  # a weighted 2-D RMSNorm (q_a / kv norms)
    sc3, mk2 = sc.view(T, 64, 592), mk.view(T, 608)  # masked_softmax's one-lead-dim form
    sm3 = torch.empty_like(sc3)
    cfg = V4_FLASH_ROUTER  # the router and the routed quantization at DeepSeek-V4-Flash's shapes
    router, logits = MoeRouter(cfg, max_tokens=64, device=dev), torch.randn(T, cfg.num_experts, device=dev)
    rbias = torch.randn(cfg.num_experts, device=dev) * 0.1
    routed = router(logits, rbias)
    xv4 = bf(T, 4096)
    slots = routed.sorted_token_ids.numel()
    qr, sr = torch.empty(slots, 4096, dtype=torch.float8_e4m3fn, device=dev), \
        torch.empty(scale_buffer_size(slots, 4096, "swizzled"), dtype=torch.uint8, device=dev)
    xq4, xs4 = mxfp8_quantize(xv4)  # the decode runtime's routed input: tokens quantized, then gathered
    w8, s8 = quantize_wo_a_fp8(w)  # the checkpoint's WO-A format: e4m3, 128 x 128 block scales
    return [
        ("torch.add (yardstick)", lambda: torch.add(small, small), None, None),
        ("row_rms", lambda: row_rms(x2, 1e-6, out=rms_out), lambda: ops.row_rms_out(x2, 1e-6, rms_out), rms_out),
        ("rms_norm (+ RoPE, per head)", lambda: rms_norm(xq, 1e-6, None, rotate=cs, out=yq),
         lambda: ops.rms_norm_out(xq, 1e-6, None, cs, yq), yq),
        ("rms_norm (weighted, 2-D)", lambda: rms_norm(x2, 1e-6, nw, out=yn),
         lambda: ops.rms_norm_out(x2, 1e-6, nw, None, yn), yn),
        ("mhc_stats", lambda: mhc_stats(x3, planes, alpha, bias, workspace=ws, out=H),
         lambda: ops.mhc_stats(x3, planes, alpha, bias, 1e-6, 20, 0.0), H),
        ("mhc_pre_mix", lambda: mhc_pre_mix(x3, h, out=u), lambda: ops.mhc_pre_mix_out(x3, h, u), u),
        ("mhc_post_mix", lambda: mhc_post_mix(x3, h, x2, out=xo), lambda: ops.mhc_post_mix(x3, h, x2), xo),
        ("masked_softmax", lambda: masked_softmax(sc, mk, out=sm), lambda: ops.masked_softmax(sc, mk), sm),
        ("masked_softmax (3-D)", lambda: masked_softmax(sc3, mk2, out=sm3), lambda: ops.masked_softmax(sc3, mk2), sm3),
        ("wo_a (decode kernel, Dg 2048)", lambda: wo_a(o2, w2, out=y), lambda: ops.wo_a_out(o2, w2, y), y),
        ("mxfp8_quantize", lambda: mxfp8_quantize(x2, q=q, scales=s), lambda: ops.mxfp8_quantize(x2, "plain"), q),
        ("moe_finalize (+ shared)", lambda: moe_finalize(yr, wt, pos, sh, out=fo),
         lambda: ops.moe_finalize(yr, wt, pos, sh), fo),
        ("router (V4-Flash, + align)", lambda: router(logits, rbias),
         lambda: ops.moe_route(logits, rbias, cfg.num_experts, cfg.n_group, cfg.topk_group, cfg.top_k,
                               cfg.routed_scaling_factor, cfg.score, cfg.tile_m), router.topk_ids[:T]),
        ("mxfp8_quantize_routed (swizzled)",
         lambda: mxfp8_quantize_routed(xv4, routed.sorted_token_ids, routed.total_rows, cfg.top_k, layout="swizzled",
                                       q=qr, scales=sr),
         lambda: ops.mxfp8_quantize_routed(xv4, routed.sorted_token_ids, routed.total_rows, cfg.top_k, "swizzled"),
         sr),
        # as the decode runtime calls it: padding unwritten, the routed rows walked (no custom-op form)
        ("mxfp8_gather_routed (routed rows)",
         lambda: mxfp8_gather_routed(xq4, xs4, routed.sorted_token_ids, routed.total_rows, cfg.top_k, q=qr, scales=sr,
                                     zero_padding=False, routed_row_pos=routed.routed_row_pos), None, sr),
        ("wo_a_fp8 (Dg 4096)", lambda: wo_a_fp8(o, w8, s8, out=y), lambda: ops.wo_a_fp8(o, w8, s8), y),
    ]


def selected_cases(only: str | None):
    """``cases()``, or those named in ``only`` (comma-separated, a row's name or its first word;
    the torch.add yardstick always)."""
    names = None if not only else {n.strip() for n in only.split(",")}
    return [c for c in cases()
            if names is None or c[0] in names or c[0].split(" ")[0] in names or c[0].startswith("torch.add")]


def yardstick(cases_) -> object:
    """The ``torch.add`` entry of ``cases_`` (:func:`selected_cases` always keeps it)."""
    return next(entry for name, entry, _, _ in cases_ if name.startswith("torch.add"))


def poison_value(out: torch.Tensor):
    """What a poisoned output holds: NaN, or a byte / integer no kernel writes here."""
    if out.dtype in (torch.uint8, torch.float8_e4m3fn):
        return 0x55
    return float("nan") if out.dtype.is_floating_point else -7


def poisoned_output(entry, out) -> torch.Tensor:
    """``entry()``'s output written into ``out`` poisoned first, as raw bytes."""
    out.fill_(poison_value(out))
    entry()
    torch.cuda.synchronize()
    return out.view(torch.uint8).cpu().clone()


FIRST_CALL = """
import time, torch
x = torch.randn(6, 7168, device="cuda").bfloat16(); torch.cuda.synchronize()
t0 = time.perf_counter()
from cute_kernels.row_rms import row_rms
t1 = time.perf_counter()
row_rms(x); torch.cuda.synchronize()
t2 = time.perf_counter()
print(f"IMPORT_FIRST {(t1 - t0) * 1e3:.1f} {(t2 - t1) * 1e3:.1f}")
"""


def import_and_first_call(env: dict, no_dsl: bool) -> tuple[float, float]:
    """(ms to import cute_kernels.row_rms after torch, ms of its first call) in a fresh process."""
    r = subprocess.run([sys.executable, "-c", (NO_DSL if no_dsl else "") + FIRST_CALL], capture_output=True, text=True, env=env, timeout=600)
    if r.returncode:
        raise SystemExit(f"first-call probe failed:\n{r.stderr}")
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("IMPORT_FIRST"))
    a, b = line.split()[1:]
    return float(a), float(b)


def runtime_only_child(args) -> int:
    """In the child without the DSL: check each op against the parent's bytes, then time it."""
    from cute_kernels import runtime_only

    assert runtime_only.active() and "cutlass" not in sys.modules
    want = torch.load(args.expect)
    res = {}
    for mode in ("ctypes", "TVM-FFI"):
        if mode == "TVM-FFI":  # the tensor entries the parent compiled, through apache-tvm-ffi
            try:
                jit.use_tvm_ffi(True)
            except ImportError:
                break
        cases_ = selected_cases(args.only)
        yard = yardstick(cases_)
        for name, entry, _, out in cases_:
            if out is not None and not torch.equal(poisoned_output(entry, out), want[name]):
                raise SystemExit(f"{name}: the runtime-only ({mode}) launch's output differs from the DSL process's")
            if mode == "TVM-FFI":  # beside torch.add, chunk for chunk
                res[f"{mode}:{name}"], res[f"{mode} torch.add:{name}"] = host_us(entry, args.calls, yard=yard)
            else:
                res[f"{mode}:{name}"] = host_us(entry, args.calls)
            print(f"{name}: {res[f'{mode}:{name}']:.1f} us (runtime-only, {mode})", flush=True)
    print("RESULT " + json.dumps(res))
    return 0


def direct_equals_dsl(entry, out) -> bool:
    """The entry point's output through :class:`cute_kernels.jit.DirectLaunch` equals, bit for
    bit, its output through the DSL's own call path (each into a poisoned buffer)."""
    poison = poison_value(out)
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


def us_cell(t: float) -> str:
    """A host time (us) for the table; ``-`` where a row has no such path (NaN)."""
    return "-" if t != t else f"{t:.1f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out", default=None)
    ap.add_argument("--cache", default=None, help="artifact cache of this run (default: a fresh temporary one)")
    ap.add_argument("--only", default=None, metavar="OPS",
                    help="time only these ops (comma-separated names of the table's first column)")
    ap.add_argument("--runtime-only-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--expect", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not args.runtime_only_child:  # this run's compiles land in its own artifact cache
        os.environ["CUTE_KERNELS_CACHE_DIR"] = args.cache or tempfile.mkdtemp(prefix="host-cost-cache-")
    if args.runtime_only_child:
        return runtime_only_child(args)
    rows, expect = [], {}
    add = None
    for name, entry, op, out in selected_cases(args.only):
        log(f"{name}: checking, then timing")  # a fatal CUDA error names its op
        if out is not None and not direct_equals_dsl(entry, out):
            raise SystemExit(f"{name}: the direct launch's output differs from the DSL call path's; not timing it")
        t_entry = host_us(entry, args.calls)
        jit.DIRECT_LAUNCH = False
        t_dsl = host_us(entry, args.calls) if out is not None else float("nan")
        jit.DIRECT_LAUNCH = True
        t_op = host_us(op, args.calls) if op is not None else float("nan")
        add = t_entry if add is None else add
        if out is not None:
            expect[name] = poisoned_output(entry, out)
        rows.append([name, f"{t_entry:.1f}", us_cell(t_dsl), us_cell(t_op), f"{t_entry / add:.1f}x"])
        print("| " + " | ".join(rows[-1]) + " |", flush=True)
    # TVM-FFI launches (jit.use_tvm_ffi): the same entry points, each output checked against the
    # direct launch's bytes first; n/a without the apache-tvm-ffi package
    paired = {}  # op -> TVM-FFI time / torch.add's in the same chunks
    try:
        jit.use_tvm_ffi(True)
        tvm_ffi = True
    except ImportError:
        tvm_ffi = False
    try:
        cases_ = selected_cases(args.only)
        yard = yardstick(cases_)
        for r, (name, entry, op, out) in zip(rows, cases_):
            t = t_op = float("nan")
            if tvm_ffi:
                if out is not None and not torch.equal(poisoned_output(entry, out), expect[name]):
                    raise SystemExit(f"{name}: the TVM-FFI launch's output differs from the direct launch's")
                t, t_add = host_us(entry, args.calls, yard=yard)  # beside torch.add, chunk for chunk
                paired[name] = t / t_add
                log(f"{name}: {t:.1f} us (TVM-FFI)")
                if op is not None:  # the custom op's kernel is the entry point: its hot path too
                    t_op = host_us(op, args.calls)
                    log(f"{name}: {t_op:.1f} us (custom op, TVM-FFI)")
            r.insert(2, f"{t:.1f}" if tvm_ffi else "n/a")
            r.insert(len(r) - 1, us_cell(t_op) if tvm_ffi else "n/a")
    finally:
        if tvm_ffi:
            jit.use_tvm_ffi(False)
    # runtime-only: the same entry points from this run's artifact cache, in a process without the DSL
    from cute_kernels.artifact_cache import default_cache

    lib, linked = default_cache().bundle_runtime(jit.dsl_version())
    exp = os.path.join(default_cache().root, "expect.pt")
    torch.save(expect, exp)
    env = dict(os.environ, CUTE_KERNELS_CACHE_DIR=default_cache().root)
    log("the runtime-only child process: starting")
    child = subprocess.run([sys.executable, os.path.abspath(__file__), "--runtime-only-child", "--expect", exp,
                            "--calls", str(args.calls)] + (["--only", args.only] if args.only else []),
                           capture_output=True, text=True, env=env, timeout=1200)
    print(child.stdout[-4000:], child.stderr[-4000:], flush=True)
    if child.returncode:
        raise SystemExit("the runtime-only run failed")
    ro = json.loads(next(ln for ln in child.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    for r in rows:
        r.insert(2, f"{ro[f'ctypes:{r[0]}']:.1f}")
        t = ro.get(f"TVM-FFI:{r[0]}")
        r.insert(4, "n/a" if t is None else f"{t:.1f}")
        # TVM-FFI against torch.add timed chunk for chunk beside it, with the DSL / runtime-only
        t_add = ro.get(f"TVM-FFI torch.add:{r[0]}")
        r.append(" / ".join(["n/a" if r[0] not in paired else f"{paired[r[0]]:.2f}x",
                             "n/a" if t is None else f"{t / t_add:.2f}x"]))
    first = [("with the DSL", *import_and_first_call(env, False)), ("runtime-only", *import_and_first_call(env, True))]
    report("Eager host cost per call",
           f"python bench/bench_host_cost.py --calls {args.calls}"
           + (f" --only '{args.only}'" if args.only else ""),
           markdown_table(["op (decode shapes: T = 6)", "entry point us", "runtime-only entry point us",
                           "entry point, TVM-FFI us", "runtime-only, TVM-FFI us",
                           "entry point, DSL call path us", "custom op us", "custom op, TVM-FFI us",
                           "entry point vs torch.add",
                           "TVM-FFI vs torch.add beside it: with the DSL / runtime-only"],
                          rows), "",
           f"Import of `cute_kernels.row_rms` (after torch) and its first call (artifact cache warm; "
           f"runtime-only: {linked} entries linked, runtime library {os.path.getsize(lib) >> 20} MiB):", "",
           markdown_table(["process", "import ms", "first call ms"],
                          [[p, f"{a:.0f}", f"{b:.1f}"] for p, a, b in first]), out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
