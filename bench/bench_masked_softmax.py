"""Benchmark masked_softmax against the PyTorch composite the baseline runs; markdown for bench/RESULTS.md.

    python bench/bench_masked_softmax.py [--out FILE]

Shapes: the decode runtime's masked-dense attention core over a latent KV pool at the slice
config (128 heads, 6-token verify blocks): ``[R, 6, 128, M]`` bf16 scores for R = 2 (BS1: the
pool's two slots read in place) and R = 65 (BS64), M = 592 (``--quick``) and 6160 (the full
BS64 lengths). Both run in place on the scores, as the runtime does: ours one kernel; the
composite ``masked_fill_(~mask, -inf)`` then ``softmax(-1)``. Times from CUDA-graph replay
over rotating inputs (> L2); bandwidth counts one read and one write of the scores plus the
mask read once per token (its H heads share it in L2).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import H200_COPY_BW, markdown_table, report, rotation_count, time_graph  # noqa: E402

from cute_kernels.masked_softmax import masked_softmax  # noqa: E402

SHAPES = [(2, 6, 128, 592), (65, 6, 128, 592), (2, 6, 128, 6160), (65, 6, 128, 6160)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for R, S, H, M in SHAPES:
        W = -(-(M + 1) // 16) * 16  # a mask row stride padded to 16 (one spare column)
        nbytes = 2 * R * S * H * M * 2 + R * S * W
        n = rotation_count(nbytes)
        xs = [(torch.randn(R, S, H, M, device="cuda") * 4).bfloat16() for _ in range(n)]
        masks = [torch.rand(R, S, W, device="cuda") < 0.35 for _ in range(n)]
        for m in masks:
            m[..., 0] = True
        reps = max(n, 20)
        probe = xs[0].clone()  # one call checked against the FP64 definition before any timing
        want = probe.double().masked_fill(~masks[0][:, :, None, :M], float("-inf")).softmax(-1).nan_to_num(0.0)
        got = masked_softmax(probe, masks[0], out=probe).double()
        if not (got - want).abs().max().item() <= 2 ** -8:  # bf16 output rounding of values <= 1
            raise SystemExit(f"masked_softmax {R}x{S}x{H}x{M}: output check failed; not timing it")
        t_ours = time_graph(lambda i: masked_softmax(xs[i], masks[i], out=xs[i]), n, reps)
        t_torch = time_graph(lambda i: xs[i].masked_fill_(~masks[i][:, :, None, :M], float("-inf")).softmax(-1),
                             n, reps)
        bw = nbytes / t_ours
        rows.append([f"{R}x{S}x{H}x{M}", f"{t_ours * 1e6:.1f}", f"{t_torch * 1e6:.1f}", f"{t_torch / t_ours:.2f}x",
                     f"{bw / 1e12:.2f}", f"{100 * bw / H200_COPY_BW:.0f}%"])
        xs = masks = None  # free before the next shape
        torch.cuda.empty_cache()
    table = markdown_table(["scores R x S x H x M (bf16)", "ours us", "torch masked_fill_+softmax us", "speedup",
                            "ours TB/s", "% of 4.3 TB/s"], rows)
    report("Masked softmax (latent attention core)", "python bench/bench_masked_softmax.py", table, out=args.out)


if __name__ == "__main__":
    main()
