"""Benchmark sink_attention against the PyTorch composite the runtime's base arm runs; markdown
for bench/RESULTS.md.

    python bench/bench_sink_attention.py [--out FILE]

Shapes: DeepSeek-V4-Flash attention (64 heads, head dim 512, RoPE on the last 64) of a verify
step (6 tokens per request) at BS 1, 4 and 64: every token attends its 128-position window plus
either a CSA layer's 512 indexer-chosen entries out of 1024 (a 4096-token context) or an HCA
layer's 32 entries. Rows are laid out as the runtime's per-layer buffer (each request's ring,
then its entry pool). Composite: gather the rows, the FP32 sink softmax
(``spec_decode.model.sink_attention``), the inverse RoPE as a complex product -- the launches
the base arm makes. Times from CUDA-graph replay over rotating inputs (> L2). Bytes: the
distinct rows each request reads once, q and out -- the HBM floor (tokens of a request share
their rows in L2).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (H200_COPY_BW, gpu_warmup, markdown_table, report, rotation_count,  # noqa: E402
                    time_graphs_interleaved)

from cute_kernels.sink_attention import SinkAttentionWorkspace, plan, sink_attention  # noqa: E402
from spec_decode.model import sink_attention as sink_attention_composite  # noqa: E402

H, D, R_ROPE, S, WINDOW = 64, 512, 64, 6, 128
RING = WINDOW + 6
CASES = [(1, "CSA", 1024, 512), (1, "HCA", 32, 32), (4, "CSA", 1024, 512), (64, "CSA", 1024, 512),
         (64, "HCA", 32, 32)]


def make_inputs(B: int, entries: int, topk: int, g: torch.Generator):
    """One layer's buffer (B requests' rings then pools), rows, queries, the rotation."""
    per = RING + entries + 1
    kv = torch.randn(B * per, D, generator=g).bfloat16()
    T = B * S
    pos = 4096 + torch.arange(S)
    rows = []
    for b in range(B):
        for p in pos.tolist():
            win = [b * per + (x % RING) for x in range(p - WINDOW + 1, p + 1)]
            ent = torch.randperm(entries, generator=g)[:topk] + b * per + RING
            rows.append(win + ent.tolist())
    rows = torch.tensor(rows, dtype=torch.int32)
    q = (torch.randn(T, H, D, generator=g) * 0.3).bfloat16()
    ang = pos.repeat(B).double()[:, None] / (10000.0 ** (torch.arange(0, R_ROPE, 2).double() / R_ROPE))
    rot = torch.stack([ang.cos(), -ang.sin()], -1).float()
    distinct = sum(len(set(rows[b * S:(b + 1) * S].flatten().tolist())) for b in range(B))
    return [x.cuda() for x in (q, kv, rows, rot)], distinct


def composite(q, kv, rows, sink, scale, rot):
    """The base arm's launches: gather, the FP32 sink softmax, the inverse RoPE (FP32 complex
    product of the bf16 output, rounded again)."""
    keys = kv[rows.clamp_min(0).long()]
    o = sink_attention_composite(q, keys, rows >= 0, sink, scale)
    pairs = torch.view_as_complex(o[..., -R_ROPE:].float().unflatten(-1, (R_ROPE // 2, 2)).contiguous())
    rotated = torch.view_as_real(pairs * torch.view_as_complex(rot)[:, None]).flatten(-2).to(o.dtype)
    return torch.cat([o[..., :-R_ROPE], rotated], -1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    gpu_warmup()
    scale = 1 / math.sqrt(D)
    table = []
    for B, kind, entries, topk in CASES:
        (q, kv, rows, rot), distinct = make_inputs(B, entries, topk, g)
        T, K = rows.shape
        sink = torch.randn(H, device="cuda")
        nbytes = distinct * D * 2 + 2 * T * H * D * 2
        n = rotation_count(nbytes)
        qs = [q] + [q.clone() for _ in range(n - 1)]
        kvs = [kv] + [kv.clone() for _ in range(n - 1)]
        outs = [torch.empty_like(q) for _ in range(n)]
        ws = SinkAttentionWorkspace(T, H, D)
        want = composite(qs[0], kvs[0], rows, sink, scale, rot).float()
        got = sink_attention(qs[0], kvs[0], rows, sink, scale, rotate=rot, out=outs[0], workspace=ws).float()
        err = ((got - want).norm() / want.norm()).item()
        if not err <= 2e-2:  # P's bf16 rounding vs the composite's FP32 P and double output rounding
            raise SystemExit(f"sink_attention B={B} {kind}: relative error {err:.3g} vs the composite; not timing it")
        t_ours, t_torch = time_graphs_interleaved([
            lambda i: sink_attention(qs[i], kvs[i], rows, sink, scale, rotate=rot, out=outs[i], workspace=ws),
            lambda i: composite(qs[i], kvs[i], rows, sink, scale, rot)], n, max(n, 8))
        ht, splits = plan(T, H, K)
        table.append([f"BS{B} {kind}: T={T}, K={K}", f"{ht} / {splits}", f"{t_ours * 1e6:.1f}",
                      f"{t_torch * 1e6:.1f}", f"{t_torch / t_ours:.2f}x",
                      f"{100 * nbytes / t_ours / H200_COPY_BW:.0f}%", f"{err:.1e}"])
        qs = kvs = outs = None
        torch.cuda.empty_cache()
    report("Decode attention with a sink (`bench/bench_sink_attention.py`)", "python bench/bench_sink_attention.py",
           markdown_table(["V4-Flash step (64 heads x 512)", "heads per CTA / splits", "ours us",
                           "torch composite us", "speedup", "% of 4.3 TB/s (distinct rows + q + out)",
                           "rel. diff vs composite"], table), out=args.out)


if __name__ == "__main__":
    main()
