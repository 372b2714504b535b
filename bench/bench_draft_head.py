"""Benchmark the draft's LM head variants on the GPU (the decode runtime's five head reads per
draft step); prints a markdown table for bench/RESULTS.md.

    python bench/bench_draft_head.py [--vocab 129280] [--hidden 7168] [--out FILE]

Per batch B, one head call including its input quantisation, then the row argmax (the draft
token), timed by CUDA-graph replay (bench/common.py): the baseline ``bf16 h @ W^T`` (cuBLAS);
:meth:`spec_decode.fused_ops.MxDraftHead.mx_logits` (MXFP8, the expert decode kernel in one
pass of 16 / 32 / 64 columns, at every B -- the runtime uses it up to 16 rows); ``cute_kernels.draft_head_fp8`` (per-tensor e4m3, wgmma). Each head
(0.9-1.9 GB at the slice config) exceeds the 60 MB L2 by itself, so every call reads it from
HBM; % of 4.3 TB/s is on the head's weight bytes.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import H200_COPY_BW, markdown_table, report, time_graph  # noqa: E402

from cute_kernels.draft_head_fp8 import draft_head_scores, quantize_head  # noqa: E402
from spec_decode.fused_ops import MxDraftHead  # noqa: E402

BATCHES = (1, 5, 16, 32, 64)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    V, C = args.vocab, args.hidden
    w = (torch.randn(V, C, device="cuda") / C ** 0.5).bfloat16()
    mx = MxDraftHead(w, max_batch=64)
    w8, _ = quantize_head(w)
    h_q = torch.empty(64, C, dtype=torch.float8_e4m3fn, device="cuda")
    s8 = torch.empty(64, V, dtype=torch.bfloat16, device="cuda")

    rows = []
    for B in BATCHES:
        hs = [torch.randn(B, C, device="cuda").bfloat16() for _ in range(4)]
        bf = (hs[0] @ w.T).float()
        mxl = mx.mx_logits(hs[0]).float()
        if not ((mxl - bf).norm() / bf.norm()).item() < 0.08:  # MXFP8 operands (tests/test_spec_decode.py)
            raise SystemExit(f"draft head B={B}: MXFP8 logits check failed; not timing it")
        agree_mx = (mxl.argmax(-1) == bf.argmax(-1)).float().mean().item()
        agree_8 = (draft_head_scores(hs[0], w8, h_q=h_q, out=s8).argmax(-1) == (hs[0] @ w.T).argmax(-1)) \
            .float().mean().item()
        if agree_8 < 0.75:  # per-tensor e4m3 scores keep most rows' argmax (tests/test_spec_decode.py)
            raise SystemExit(f"draft head B={B}: FP8 scores keep {agree_8:.2f} of the argmaxes; not timing it")
        t_bf16 = time_graph(lambda i: (hs[i] @ w.T).argmax(-1), 4, 20)
        t_mx = time_graph(lambda i: mx.mx_logits(hs[i]).argmax(-1), 4, 20)
        t_8 = time_graph(lambda i: draft_head_scores(hs[i], w8, h_q=h_q, out=s8).argmax(-1), 4, 20)
        best = min(t_mx, t_8)
        rows.append([f"B={B} V={V} C={C}", f"{t_bf16 * 1e6:.1f}", f"{t_mx * 1e6:.1f}", f"{t_8 * 1e6:.1f}",
                     f"{t_bf16 / best:.2f}x", f"{100 * 2 * V * C / t_bf16 / H200_COPY_BW:.0f}%",
                     f"{100 * V * C / t_mx / H200_COPY_BW:.0f}%", f"{100 * V * C / t_8 / H200_COPY_BW:.0f}%",
                     f"{agree_mx:.2f} / {agree_8:.2f}"])
    table = markdown_table(["shape", "bf16 us (baseline)", "MXFP8 us", "FP8 per-tensor us", "best vs bf16",
                            "bf16 % of 4.3 TB/s", "MXFP8 %", "FP8 %", "argmax = bf16's (MX / FP8)"], rows)
    report("Draft LM head", f"python bench/bench_draft_head.py --vocab {V} --hidden {C}", table, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
