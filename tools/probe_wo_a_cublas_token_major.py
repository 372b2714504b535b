"""cuBLAS storing WO-A's token-major output itself: ``torch.bmm`` into a strided ``out``.

The issue's unfused path (a) runs the group-major batched GEMM and then a transposing copy.
cuBLAS's strided-batched GEMM takes any leading dimension and batch stride for C, so the same
GEMM can store straight into token-major ``y [T, G*R]`` viewed as ``[G, T, R]`` with strides
``(R, G*R, 1)`` -- ldc = G*R, batch stride R -- and PyTorch's ``bmm(out=)`` passes such a view
through (its result is "transposed-contiguous" per batch). This probe proves that it does, per
(shape, T): the captured graph of three calls holds three kernels and no copy (some cuBLAS
kernels clear their own counters with a memset node, as they do in the group-major ``bmm``) --
and a NaN-poisoned ``y`` comes back whole and within the FP32 tolerance. Then it times that
call, (c), against this project's kernels (``wo_a(backend="cute")``: the default route before
the cuBLAS bands) and the group-major ``bmm`` alone (b), the three graphs replayed in turn in
every trial (bench/common.replay_interleaved), and prints the medians and the per-trial
speed-ups; ``CSV=file`` also writes one row per (shape, T):
``G,R,Dg,T,ours_us,b_us,c_us,c_speedup,c_won,trials`` (c_speedup: median over trials of ours /
(c); c_won: the trials (c) was faster in) -- the source of ``cute_kernels.wo_a``'s cuBLAS bands.

    env TS=1,5,64,256,320,384,512,4096 SHAPES=8x512x2048,8x1024x1024 TRIALS=30 \
        python tools/probe_wo_a_cublas_token_major.py

``SHAPES``: G x R x Dg (default: the issue's four). ``TS`` also takes ``a:b:step``.
"""
import os
import statistics
import sys

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "bench"))
sys.path.insert(0, _HERE)
from bench_wo_a import SHAPES, bmm_only, bmm_token_major, token_counts, wo_a_points  # noqa: E402
from common import gpu_warmup, poisoned_error, replay_interleaved  # noqa: E402
from probe_graph_edges import graph_nodes  # noqa: E402

from cute_kernels.wo_a import route, wo_a  # noqa: E402


def main():
    TS = token_counts(os.environ.get("TS", "1,5,64,256,320,384,512,4096"))
    shapes = ([tuple(int(v) for v in s.split("x")) for s in os.environ["SHAPES"].split(",")]
              if os.environ.get("SHAPES") else SHAPES)
    trials = int(os.environ.get("TRIALS", "30"))
    csv = open(os.environ["CSV"], "w") if os.environ.get("CSV") else None
    if csv:
        csv.write("G,R,Dg,T,ours_us,b_us,c_us,c_speedup,c_won,trials\n")
    gpu_warmup()
    for G, R, Dg, ws, T, o, y, ref in wo_a_points(shapes, TS):
        n = len(ws)
        reps = max(n, 8)
        y_c = torch.empty_like(y)
        labels = [lab for _, lab in graph_nodes(lambda: bmm_token_major(o, ws[0], y_c), calls=3)[0]]
        labels_b = [lab for _, lab in graph_nodes(lambda: bmm_only(o, ws[0]), calls=3)[0]]
        kernels = [lab for lab in labels if "TYPE_" not in lab]
        others = sorted(lab for lab in labels if "TYPE_" in lab)
        assert len(kernels) == 3 and all("MEMSET" in lab for lab in others), \
            f"(c) is not one kernel a call (and cuBLAS's own memsets): {labels}"
        memsets = len(others) // 3
        if others != sorted(lab for lab in labels_b if "TYPE_" in lab):
            print(f"  note: (b)'s graph has other non-kernel nodes: {labels_b}")
        same = kernels[0].split()[0] == [lab for lab in labels_b if "TYPE_" not in lab][0].split()[0]
        err_c = poisoned_error(lambda i: bmm_token_major(o, ws[i], y_c), y_c, ref)
        err_ours = poisoned_error(lambda i: wo_a(o, ws[i], out=y, backend="cute"), y, ref)
        assert err_c < 1e-2 and err_ours < 1e-2, (err_c, err_ours)
        times = replay_interleaved([lambda i: wo_a(o, ws[i], out=y, backend="cute"), lambda i: bmm_only(o, ws[i]),
                                    lambda i: bmm_token_major(o, ws[i], y_c)], n, reps, trials)
        ours, b, c = times
        med = [statistics.median(ts) * 1e6 for ts in times]
        c_vs_ours = statistics.median(x / z for x, z in zip(ours, c))
        c_vs_b = statistics.median(x / z for x, z in zip(b, c))
        won = sum(z < x for x, z in zip(ours, c))
        name, cfg = route(T, G, R, Dg, "sm_90a", backend="cute")
        print(f"T={T} G={G} R={R} Dg={Dg}: ours {med[0]:.2f} us ({name}), (b) bmm {med[1]:.2f}, "
              f"(c) bmm into y {med[2]:.2f} [{kernels[0]}{' + memset' if memsets else ''}{'' if same else ', not (b)s kernel'}] err {err_c:.1e} (ours {err_ours:.1e}); "
              f"(c) {c_vs_ours:.3f}x ours (faster in {won}/{trials} trials), {c_vs_b:.3f}x (b)", flush=True)
        if csv:
            csv.write(f"{G},{R},{Dg},{T},{med[0]:.3f},{med[1]:.3f},{med[2]:.3f},{c_vs_ours:.4f},{won},{trials}\n")
            csv.flush()


if __name__ == "__main__":
    main()
