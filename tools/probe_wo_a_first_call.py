"""What a ``wo_a()`` call costs the host the first time its tile class of T is seen.

Each tile class (:func:`cute_kernels.wo_a.route`) is one compile. Without an artifact-cache
entry the first call of a class runs the compiler; with the AOT build's entry
(``python -m cute_kernels build``, which covers every class of the supported shapes) it only
loads the exported object; after that a call is a dict lookup plus the launch. Per T this
prints: the route, the first call with an empty artifact cache (compile + export + launch),
the first call in a fresh process-level cache with the entry on disk (load + launch), and the
steady-state host time per call (200 calls enqueued back to back, no sync in between).

    python tools/probe_wo_a_first_call.py
    env SHAPE=16x1024x1024 TS=1,5,64,320,4096 python tools/probe_wo_a_first_call.py

Wall-clock seconds on the host (``time.perf_counter``), each first call followed by a device
synchronize; one reading per T (a probe, not a benchmark).
"""
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from bench_wo_a import token_counts  # noqa: E402
from common import markdown_table  # noqa: E402

from cute_kernels import jit  # noqa: E402
from cute_kernels.arch import current_arch, num_sms  # noqa: E402
from cute_kernels.wo_a import _default_workspace, route, wo_a  # noqa: E402


def first_call(o, w, y) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    wo_a(o, w, out=y, backend="cute")
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main():
    G, R, Dg = (int(v) for v in os.environ.get("SHAPE", "8x512x2048").split("x"))
    tokens = token_counts(os.environ.get("TS", "1,20,64,320,1100,4096"))
    HG = 16
    w = (torch.randn(G, R, Dg, device="cuda") / Dg**0.5).bfloat16()
    arch, sms = current_arch(), num_sms(torch.device("cuda"))
    # the CUDA context and the decode kernels' split workspace exist before the first reading
    _default_workspace(w.device, G, R)
    rows = []
    for T in tokens:
        o = torch.randn(T, G * HG, Dg // HG, device="cuda").bfloat16()
        y = torch.empty(T, G * R, device="cuda", dtype=torch.bfloat16)
        name, cfg = route(T, G, R, Dg, arch, sms=sms, backend="cute")  # the CuTe kernels: the cuBLAS route compiles nothing
        # an empty artifact cache per T: T values sharing a class each compile it
        os.environ["CUTE_KERNELS_CACHE_DIR"] = tempfile.mkdtemp(prefix="wo_a_first_call_")
        jit.CACHE.clear()
        compiled = first_call(o, w, y)
        stats = jit.CACHE.stats
        assert stats.compiles == 1 and stats.disk_writes == 1, stats
        jit.CACHE.clear()
        loaded = first_call(o, w, y)
        stats = jit.CACHE.stats
        assert stats.compiles == 0 and stats.disk_loads == 1, stats
        host = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                wo_a(o, w, out=y, backend="cute")
            host.append((time.perf_counter() - t0) / 200)
            torch.cuda.synchronize()
        shown = {k: v for k, v in cfg.items() if k not in ("G", "R", "Dg")}
        rows.append([str(T), f"{name} {shown}", f"{compiled:.2f}", f"{loaded * 1e3:.1f}",
                     f"{statistics.median(host) * 1e6:.1f}"])
    print(f"wo_a first call, G={G} R={R} Dg={Dg}, {torch.cuda.get_device_name()}")
    print(markdown_table(["T", "route", "first call, compiled (s)", "first call, from the artifact cache (ms)",
                          "steady host us / call"], rows))


if __name__ == "__main__":
    main()
