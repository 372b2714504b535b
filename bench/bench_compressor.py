"""Benchmark compressor_pool (DeepSeek-V4's KV compressors in one launch) at a verify step's
shapes; markdown for bench/RESULTS.md.

    python bench/bench_compressor.py [--out FILE]

Shapes: V4-Flash's compressors -- CSA (d = 512, ratio 4, overlapping windows of 8 rows), HCA
(d = 512, ratio 128: windows of 128 rows) and the indexer's CSA compressor (d = 128) -- for a
verify step of 6 tokens per request at BS 1 and 64, around position 4096: at BS 1 one token
closes a window (CSA and HCA); at BS 64 request b starts at 4093 + b, so every request closes
one or two CSA windows and three requests close an HCA window. The step's rows, the rings and
the pools are rotated past L2.

Ours and the baseline: CUDA-graph replay (``bench/common.py``). The baseline is the PyTorch
composite the ``torch-bf16`` arm runs for a step's compressor (``spec_decode.step_model``'s
``_close_windows`` after the projections: the windows gathered from ring and step, masked,
``compress_entries`` for every token, the pool scatter, the ring write) -- what the kernel
replaces. The output (every pool entry written and the ring rows) is checked once against
``compressor_pool_torch``, the per-token PyTorch fallback with the kernel's rounding points,
and the composite's entries against ours (their relative difference printed). Bytes: the window
rows the closing tokens read, the step's rows read and written to the ring, the entries written.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import H200_COPY_BW, gpu_warmup, markdown_table, report, rotation_count, time_graph  # noqa: E402

from cute_kernels.compressor_pool import compressor_pool, compressor_pool_torch  # noqa: E402
from spec_decode.model import compress_entries, rope_table  # noqa: E402
from spec_decode.step_model import ring_index, rows_at, window_entries, write_ring  # noqa: E402

S, P0, ROPE = 6, 4093, 64
INV_FREQ = 1.0 / (10000.0 ** (torch.arange(0, ROPE, 2, dtype=torch.float32) / ROPE))
#: (name, batch, d, ratio, overlapping windows)
CASES = [("CSA kv, BS1", 1, 512, 4, True), ("HCA kv, BS1", 1, 512, 128, False),
         ("indexer CSA, BS1", 1, 128, 4, True), ("CSA kv, BS64", 64, 512, 4, True),
         ("HCA kv, BS64", 64, 512, 128, False)]


def make_inputs(B: int, d: int, ratio: int, overlap: bool, g: torch.Generator, device: str = "cuda"):
    """``(fresh, ring, pool, ape, norm_weight, rotate, pos, slot)``, the tokens closing a window,
    and the bytes a call moves at least."""
    coff = 2 if overlap else 1
    ch, span = coff * d, (2 * ratio if overlap else ratio)
    T = B * S
    ring_rows, pool_rows = span + S + 2, (P0 + B + S) // ratio + 2
    pos = torch.cat([P0 + b + torch.arange(S) for b in range(B)]).int()
    slot = torch.arange(B).repeat_interleave(S).int()
    fresh = torch.randn(T, 2 * ch, generator=g).bfloat16()
    ring = torch.randn(B, ring_rows, 2 * ch, generator=g).bfloat16()
    pool = torch.zeros(B, pool_rows, d).bfloat16()
    ape = (torch.randn(ratio, ch, generator=g) * 0.1).bfloat16()
    norm_w = (torch.randn(d, generator=g) * 0.1 + 1).bfloat16()
    # each token's entry's first position ((p + 1) // m - 1) m: its RoPE, as the runtime builds it
    rot = torch.view_as_real(rope_table(torch.div(pos + 1, ratio, rounding_mode="floor") * ratio - ratio,
                                        INV_FREQ)).reshape(T, -1, 2).contiguous()
    closing = int(((pos + 1) % ratio == 0).sum())
    tensors = [x.to(device) for x in (fresh, ring, pool, ape, norm_w, rot, pos, slot)]
    nbytes = closing * span * 2 * ch * 2 + 2 * T * 2 * ch * 2 + closing * d * 2
    return tensors, closing, nbytes


def composite(fresh, ring, pool, ape, norm_w, pos, slot, inv_freq, *, B: int, ratio: int, overlap: bool,
              eps: float):
    """The ``torch-bf16`` arm's step compressor after its projections (module docstring)."""
    span = 2 * ratio if overlap else ratio
    ring_rows = ring.shape[1]
    posb, slots = pos.view(B, S).long(), slot.view(B, S)[:, 0].long()
    rows = fresh.view(B, S, -1)
    index = ring_index(posb, span, ring_rows)
    r = rows_at(rows, ring, ring_rows, slots, index)  # [B, S, span, 2 ch]
    ch = rows.shape[-1] // 2
    kv, gate = r[..., :ch], r[..., ch:].masked_fill(index[3][..., None], float("-inf"))
    start, dst = window_entries(posb, slots, ratio, pool.shape[1])
    ent = compress_entries(kv, gate, ape, norm_w, overlap, start, inv_freq, eps)
    pool[dst] = ent.to(pool.dtype)
    write_ring(ring, ring_rows, slots, posb, rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    gpu_warmup()
    inv_freq = INV_FREQ.cuda()
    table = []
    for name, B, d, ratio, overlap in CASES:
        (fresh, ring, pool, ape, norm_w, rot, pos, slot), closing, nbytes = make_inputs(B, d, ratio, overlap, g)
        kw = dict(ratio=ratio, overlap=overlap, eps=1e-6, tokens_per_request=S)
        ring_t, pool_t, ring_c, pool_c = ring.clone(), pool.clone(), ring.clone(), pool.clone()
        compressor_pool(fresh, ring, pool, ape, norm_w, rot, pos, slot, **kw)
        compressor_pool_torch(fresh, ring_t, pool_t, ape, norm_w, rot, pos, slot, **kw)
        composite(fresh, ring_c, pool_c, ape, norm_w, pos, slot, inv_freq, B=B, ratio=ratio, overlap=overlap, eps=1e-6)
        torch.cuda.synchronize()
        live = pool_t[:, :-1].float()  # the composite also writes the pool's last (never read) row
        err = ((pool[:, :-1].float() - live).norm() / live.norm()).item()
        if not (torch.equal(ring, ring_t) and err <= 1e-2):  # exp's and the FP32 sums' order apart
            raise SystemExit(f"compressor_pool {name}: ring equal {torch.equal(ring, ring_t)}, pool relative "
                             f"error {err:.3g} against the PyTorch fallback; not timing it")
        diff = ((pool[:, :-1].float() - pool_c[:, :-1].float()).norm() / live.norm()).item()
        if not (torch.equal(ring, ring_c) and diff <= 1e-2):
            raise SystemExit(f"the composite {name}: ring equal {torch.equal(ring, ring_c)}, pool relative "
                             f"difference {diff:.3g} from ours; not timing it")
        n = rotation_count(nbytes + ring.numel() * 2)
        sets = [(fresh, ring, pool)] + [(fresh.clone(), ring.clone(), pool.clone()) for _ in range(n - 1)]
        t_ours = time_graph(lambda i: compressor_pool(sets[i][0], sets[i][1], sets[i][2], ape, norm_w, rot, pos, slot,
                                                      **kw), n, max(n, 8))
        t_torch = time_graph(lambda i: composite(sets[i][0], sets[i][1], sets[i][2], ape, norm_w, pos, slot, inv_freq,
                                                 B=B, ratio=ratio, overlap=overlap, eps=1e-6), n, max(n, 8))
        table.append([f"{name}: T={B * S}, d={d}, ratio {ratio}", str(closing), f"{t_ours * 1e6:.1f}",
                      f"{t_torch * 1e6:.1f}", f"{t_torch / t_ours:.1f}x",
                      f"{100 * nbytes / t_ours / H200_COPY_BW:.0f}%",
                      f"{diff:.1e}"])
        sets = None
        torch.cuda.empty_cache()
    report("KV compressors (`bench/bench_compressor.py`)", "python bench/bench_compressor.py",
           markdown_table(["V4-Flash compressor, verify step", "tokens closing a window", "ours us",
                           "torch composite us (the torch-bf16 arm's step)", "speedup", "% of 4.3 TB/s",
                           "rel. diff vs composite"], table), out=args.out)


if __name__ == "__main__":
    main()
