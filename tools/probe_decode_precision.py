"""Probe: how far each Hopper expert kernel's bf16 output is from the FP32-exact emulation.

    python tools/probe_decode_precision.py      (H200)

The tiled kernel (moe.experts_sm90) multiplies e4m3 through f16 HMMA with FP32 accumulation;
the decode kernel (moe.experts_sm90_decode) uses FP8 wgmma, whose in-block accumulation is not
FP32-exact. Prints, per kernel, the fraction of outputs whose bf16 differs from the emulation's
and the largest difference in units of the row's RMS.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from test_moe_experts import _quantized_problem, _reference, _router_maps  # noqa: E402

from moe.experts import moe_expert_gemm  # noqa: E402


def main():
    E, N, K = 8, 4096, 7168
    counts = [1, 0, 2, 0, 1, 5, 0, 3]
    gen = torch.Generator().manual_seed(0)
    a, w, aq, asw, wq, wsw, offs, asc, wsc = _quantized_problem(E, N, K, counts, gen)
    cnt, te = _router_maps(offs, counts, aq.shape[0])
    ref = torch.zeros(aq.shape[0], N).bfloat16()
    _reference(aq, asw, wq, wsw, offs, ref)
    dev = [t.cuda() for t in (aq, asw, wq, wsw, offs, cnt, te)]
    live = torch.cat([torch.arange(int(offs[e]), int(offs[e]) + counts[e]) for e in range(E)])
    r = ref[live].float()
    rms = r.pow(2).mean(-1, keepdim=True).sqrt()
    for name, kw in (("tiled (HMMA)", {}), ("decode (FP8 wgmma)", dict(max_expert_rows=8))):
        o = moe_expert_gemm(*dev, routed_rows=sum(counts), **kw).cpu()[live].float()
        d = (o - r).abs()
        print(f"{name:20s} bf16 mismatches {100 * (d > 0).float().mean():.3f}%  max |diff| / row rms "
              f"{float((d / rms).max()):.2e}  rel-norm {float(d.norm() / r.norm()):.2e}", flush=True)


if __name__ == "__main__":
    main()
