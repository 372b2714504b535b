"""Fused finalize + shared add + push all-reduce vs the unfused sequence, simulated ranks.

    python bench/bench_comm.py [--out FILE]

All ranks of a simulated group live on one GPU, each launching on its own stream; a CUDA
graph holds one step of every rank (forked/joined with events) and is replayed; the time per
step (median of 30 replays of 20 steps) is the latency of the whole group's exchange. On one
GPU the "links" are HBM, so absolute numbers say nothing about NVLink; the comparison of the
fused single launch with the unfused three launches per rank (finalize, bf16 add, push
all-reduce) is what this measures. NCCL needs several GPUs and is not run.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit, markdown_table, time_graph  # noqa: E402

from comm.buffers import PushAllReduceGroup  # noqa: E402
from moe.finalize import moe_finalize  # noqa: E402


def time_group_step(step, steps=20):
    """Seconds per group step: ``steps`` steps captured in one graph (common.time_graph)."""
    return time_graph(lambda i: step(), 1, steps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    H, k = 7168, 8
    rows = []
    for world in (2, 4, 8):
        for T in (1, 8, 64):
            g = PushAllReduceGroup.simulated(world, max_tokens=64, hidden=H)
            streams = [torch.cuda.Stream() for _ in range(world)]
            nrows = T * k + 128
            ys = [torch.randn(nrows, H, device="cuda").bfloat16() for _ in range(world)]
            ws = [torch.rand(T, k, device="cuda") for _ in range(world)]
            pos = [torch.randperm(nrows, device="cuda")[: T * k].int() for _ in range(world)]
            sh = [torch.randn(T, H, device="cuda").bfloat16() for _ in range(world)]
            outs = [torch.empty(T, H, device="cuda", dtype=torch.bfloat16) for _ in range(world)]
            routed = [torch.empty(T, H, device="cuda", dtype=torch.bfloat16) for _ in range(world)]
            partial = [torch.empty(T, H, device="cuda", dtype=torch.bfloat16) for _ in range(world)]

            def fork(body):
                cur = torch.cuda.current_stream()
                for s in streams:
                    s.wait_stream(cur)
                for r, s in enumerate(streams):
                    with torch.cuda.stream(s):
                        body(r)
                for s in streams:
                    cur.wait_stream(s)

            def fused(r):
                g.finalize_shared_allreduce(r, ys[r], ws[r], pos[r], sh[r], out=outs[r])

            def unfused(r):
                moe_finalize(ys[r], ws[r], pos[r], out=routed[r])
                torch.add(routed[r], sh[r], out=partial[r])
                g.allreduce(r, partial[r], out=outs[r])

            def ar_only(r):
                g.allreduce(r, partial[r], out=outs[r])

            fork(fused)  # checked once before timing: every rank holds the FP32 rank-order sum
            torch.cuda.synchronize()
            want = None
            for r in range(world):
                routed_r = moe_finalize(ys[r], ws[r], pos[r])
                part = (routed_r.float() + sh[r].float()).bfloat16().float()
                want = part if want is None else want + part
            if not all(torch.equal(o, want.bfloat16()) for o in outs):
                raise SystemExit(f"finalize_shared_allreduce world={world} T={T}: output check failed; not timing it")
            t_f = time_group_step(lambda: fork(fused))
            t_u = time_group_step(lambda: fork(unfused))
            t_a = time_group_step(lambda: fork(ar_only))
            rows.append([f"world={world} T={T} H={H}", f"{t_f * 1e6:.2f}", f"{t_u * 1e6:.2f}", f"{t_a * 1e6:.2f}",
                         f"{t_u / t_f:.2f}x", "1", "3"])
            g.check()
    text = "\n".join([f"## Push all-reduce, simulated ranks on one {torch.cuda.get_device_name()}, {datetime.date.today()}",
                      "", "Command: `python bench/bench_comm.py`", "",
                      markdown_table(["group step", "fused us", "unfused us", "all-reduce alone us", "speedup",
                                      "launches/rank fused", "launches/rank unfused"], rows)])
    emit(text, args.out)


if __name__ == "__main__":
    main()
