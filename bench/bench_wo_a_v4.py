"""Benchmark WO-A at DeepSeek-V4's shapes, bf16 and the checkpoint's FP8, against PyTorch.

    python bench/bench_wo_a_v4.py [--tokens 1,5,...,16384] [--kgroups 1|2] [--stages N] [--out FILE]

Shapes: V4-Flash (G = 8 groups of 8 heads x 512, Dg = 4096, R = 1024) and V4-Pro (G = 16).
Per T, same run, CUDA-graph replay over rotating weight sets larger than L2, interleaved:

* bf16 -- ours: :func:`cute_kernels.wo_a.wo_a` (default route); baselines: ``torch.bmm``
  group-major alone (cuBLAS, no transpose) and ``torch.bmm`` storing token-major ``y``
  through a strided ``out`` (:mod:`cute_kernels.wo_a_cublas`); the better one is "best".
* FP8 (e4m3, 128 x 128 block scales, UE8M0 as in the V4 checkpoints) -- ours:
  :func:`cute_kernels.wo_a_decode_fp8.wo_a_fp8`; baselines: PyTorch dequantisation to bf16
  then ``bmm`` into token-major ``y``, and ``torch._scaled_mm`` per group with 1 x 128
  activation / 128 x 128 weight block scales (the activation quantisation timed with it;
  "n/a" with the reason where this torch / GPU does not take block-wise scales).
* FP8 weights and MXFP8 activations (T <= 64, Hopper) -- ours:
  :func:`moe.quant.mxfp8_quantize` of ``o`` then :func:`cute_kernels.wo_a_fp8_act_sm90.wo_a_fp8_act`
  (timed together; together again with both launched as programmatic dependents, ``pdl=True``,
  so the GEMM's weights stream while the quantization finishes; and the GEMM alone): the
  like-for-like peer of ``_scaled_mm``'s quantised
  activations, numerically not the bf16-activation FP8 path's (each activation rounds to e4m3);
  checked against an FP32 einsum of the dequantised MXFP8 activations and weights.

Each of our outputs is checked once against an FP32 einsum before timing (NaN-poisoned
output; relative error < 1e-2). Limits: T <= 64 rows report weight-streaming bandwidth (all
bytes moved) against 4.3 TB/s, larger T TFLOP/s against 790.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (H200_BF16_FLOPS, H200_COPY_BW, emit, gpu_warmup, markdown_table, poisoned_error,  # noqa: E402
                    rotation_count, time_graphs_interleaved)

from cute_kernels.wo_a import wo_a  # noqa: E402
from cute_kernels.wo_a_cublas import wo_a_cublas  # noqa: E402
from cute_kernels.wo_a_decode_fp8 import SCALE_BLOCK, checkpoint_scales_fp32, wo_a_fp8  # noqa: E402
from cute_kernels.wo_a_fp8_act_sm90 import MAX_T as FP8_ACT_MAX_T, wo_a_fp8_act  # noqa: E402
from moe.quant import mxfp8_quantize  # noqa: E402

TOKENS = [1, 5, 16, 32, 64, 128, 320, 1024, 4096, 16384]
SHAPES = [("V4-Flash", 8, 1024, 4096), ("V4-Pro", 16, 1024, 4096)]


def bmm_group_major(o, w):
    T = o.shape[0]
    G, R, Dg = w.shape
    return torch.bmm(o.view(T, G, Dg).transpose(0, 1), w.transpose(1, 2))


def torch_dequant_bmm(o, w8, scale, y):
    """The unfused FP8 path: widen the block-scaled weights in PyTorch, then cuBLAS into y."""
    G, R, Dg = w8.shape
    w = (w8.float().view(G, R // SCALE_BLOCK, SCALE_BLOCK, Dg // SCALE_BLOCK, SCALE_BLOCK)
         * scale[:, :, None, :, None]).bfloat16().view(G, R, Dg)
    return wo_a_cublas(o, w, y)


def torch_scaled_mm(o, w8, scale, y):
    """Per group: o quantised to e4m3 with one scale per 1 x 128 block (PyTorch), then
    ``torch._scaled_mm`` with block-wise scales, written into token-major y's columns."""
    T = o.shape[0]
    G, R, Dg = w8.shape
    og = o.view(T, G, Dg // SCALE_BLOCK, SCALE_BLOCK).float()
    amax = og.abs().amax(-1).clamp(min=1e-12)
    a_scale = amax / 448.0
    a8 = (og / a_scale[..., None]).to(torch.float8_e4m3fn).view(T, G, Dg)
    for g in range(G):
        sa = a_scale[:, g].t().contiguous().t()  # [T, Dg/128], outer-dim (T) major
        sb = scale[g].t().contiguous().t()  # [R/128, Dg/128]
        y[:, g * R:(g + 1) * R] = torch._scaled_mm(a8[:, g], w8[g].t(), scale_a=sa, scale_b=sb,
                                                    out_dtype=torch.bfloat16)
    return y


def fp8_weight_sets(G, R, Dg):
    n = rotation_count(G * R * Dg)
    sets = []
    for _ in range(n):
        w8 = (torch.randn(G, R, Dg, device="cuda") * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        e = torch.randint(127 - 14, 127 - 10, (G, R // SCALE_BLOCK, Dg // SCALE_BLOCK), device="cuda")
        sets.append((w8, checkpoint_scales_fp32(e.to(torch.uint8))))
    return sets


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)),
                    help=f"comma-separated T values (default: {','.join(map(str, TOKENS))})")
    ap.add_argument("--out", default=None, help="also write the markdown table here (default: none)")
    ap.add_argument("--kgroups", type=int, choices=(1, 2), default=None,
                    help="the FP8-activation kernel's K groups (default: its plan's)")
    ap.add_argument("--stages", type=int, default=None,
                    help="the FP8-activation kernel's pipeline depth (default: its plan's)")
    args = ap.parse_args()
    kg = {k: v for k, v in (("kgroups", args.kgroups), ("stages", args.stages)) if v is not None}
    tokens = [int(t) for t in args.tokens.split(",")]
    gpu_warmup()
    rows = []
    scaled_mm_error = None
    for model, G, R, Dg in SHAPES:
        ws = [(torch.randn(G, R, Dg, device="cuda") / Dg ** 0.5).bfloat16() for _ in range(rotation_count(G * R * Dg * 2))]
        fs = fp8_weight_sets(G, R, Dg)
        for T in tokens:
            o = torch.randn(T, G * 8, Dg // 8, device="cuda").bfloat16()
            y, yb = (torch.empty(T, G * R, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            ref = torch.einsum("tgd,grd->tgr", o.view(T, G, Dg).float(), ws[0].float()).reshape(T, G * R)
            if poisoned_error(lambda i: wo_a(o, ws[0], out=y), y, ref) > 1e-2:
                raise SystemExit(f"{model} T={T}: bf16 WO-A output check failed")
            w8, sc = fs[0]
            w_deq = (w8.float().view(G, R // SCALE_BLOCK, SCALE_BLOCK, Dg // SCALE_BLOCK, SCALE_BLOCK)
                     * sc[:, :, None, :, None]).view(G, R, Dg)
            ref8 = torch.einsum("tgd,grd->tgr", o.view(T, G, Dg).float(), w_deq).reshape(T, G * R)
            if poisoned_error(lambda i: wo_a_fp8(o, w8, sc, out=y), y, ref8) > 1e-2:
                raise SystemExit(f"{model} T={T}: FP8 WO-A output check failed")
            n = max(len(ws), len(fs))
            reps = max(n, 4 if T >= 4096 else 8)
            bf = time_graphs_interleaved(
                [lambda i: wo_a(o, ws[i % len(ws)], out=y), lambda i: bmm_group_major(o, ws[i % len(ws)]),
                 lambda i: wo_a_cublas(o, ws[i % len(ws)], yb)], n, reps, trials=15)
            f8_launches = [lambda i: wo_a_fp8(o, *fs[i % len(fs)], out=y),
                           lambda i: torch_dequant_bmm(o, *fs[i % len(fs)], yb)]
            if scaled_mm_error is None:
                try:
                    torch_scaled_mm(o, w8, sc, yb)
                    torch.cuda.synchronize()
                    scaled_mm_error = ""
                except (RuntimeError, ValueError, NotImplementedError) as e:
                    scaled_mm_error = str(e).splitlines()[0][:120]
            if not scaled_mm_error:
                f8_launches.append(lambda i: torch_scaled_mm(o, *fs[i % len(fs)], yb))
            f8 = time_graphs_interleaved(f8_launches, n, reps, trials=15)
            wbytes8 = G * R * Dg + G * R * Dg // 128 ** 2 * 4  # e4m3 weights and their FP32 block scales
            act_cols = ["-", "-", "-", "-"]
            if T <= FP8_ACT_MAX_T and torch.cuda.get_device_capability()[0] == 9:
                q8 = torch.empty(T, G * 8, Dg // 8, dtype=torch.float8_e4m3fn, device="cuda")
                qs = torch.empty(T, G * Dg // 32, dtype=torch.uint8, device="cuda")

                def quant(pdl=False):
                    mxfp8_quantize(o.view(T, -1), q=q8.view(T, -1), scales=qs, pdl=pdl)

                quant()
                a = (q8.float().view(T, -1, 32) * torch.exp2(qs.float() - 127)[..., None]).view(T, G, Dg)
                ref_act = torch.einsum("tgd,grd->tgr", a, w_deq).reshape(T, G * R)
                try:  # (a newer kernel: a failure marks its cells, loudly, and keeps the other columns)
                    err = poisoned_error(lambda i: wo_a_fp8_act(q8, qs, w8, sc, out=y, **kg), y, ref_act)
                except Exception as e:  # noqa: BLE001
                    err, act_cols = None, [f"FAILED: {type(e).__name__}: {str(e)[:80]}", "-", "-", "-"]
                if err is not None and not err < 1e-2:
                    print(f"{model} T={T}: FP8-activation WO-A OUTPUT CHECK FAILED (rel. error {err:.2e})", flush=True)
                    act_cols = [f"OUTPUT CHECK FAILED (rel. error {err:.1e}): not timed", "-", "-", "-"]
                elif err is not None:
                    pdl_err = poisoned_error(lambda i: (quant(True), wo_a_fp8_act(q8, qs, w8, sc, out=y, pdl=True, **kg)),
                                             y, ref_act)
                    if not pdl_err < 1e-2:
                        raise SystemExit(f"{model} T={T}: FP8-activation WO-A with PDL: OUTPUT CHECK FAILED "
                                         f"(rel. error {pdl_err:.2e})")
                    t_q, t_qp, t_g = time_graphs_interleaved(
                        [lambda i: (quant(), wo_a_fp8_act(q8, qs, *fs[i % len(fs)], out=y, **kg)),
                         lambda i: (quant(True), wo_a_fp8_act(q8, qs, *fs[i % len(fs)], out=y, pdl=True, **kg)),
                         lambda i: wo_a_fp8_act(q8, qs, *fs[i % len(fs)], out=y, **kg)], n, reps, trials=15)
                    act_cols = [f"{t_q * 1e6:.1f}", f"{t_qp * 1e6:.1f}", f"{t_g * 1e6:.1f}",
                                f"{100 * (wbytes8 + T * G * Dg * 33 // 32 + T * G * R * 2) / t_g / H200_COPY_BW:.0f}%"
                                " of 4.3 TB/s"]
            t_bf, best_bf = bf[0], min(bf[1], bf[2])
            t_f8, best_f8 = f8[0], min(f8[1:])
            flops = 2 * T * G * R * Dg
            act = T * G * Dg * 2 + T * G * R * 2

            def limit(t, wbytes):
                return (f"{100 * (wbytes + act) / t / H200_COPY_BW:.0f}% of 4.3 TB/s" if T <= 64
                        else f"{100 * flops / t / H200_BF16_FLOPS:.0f}% of 790 TFLOP/s")

            rows.append([f"{model} T={T}", f"{t_bf * 1e6:.1f}", f"{bf[1] * 1e6:.1f}", f"{bf[2] * 1e6:.1f}",
                         f"{best_bf / t_bf:.2f}x", limit(t_bf, G * R * Dg * 2),
                         f"{t_f8 * 1e6:.1f}", f"{f8[1] * 1e6:.1f}",
                         f"{f8[2] * 1e6:.1f}" if len(f8) > 2 else "n/a",
                         f"{best_f8 / t_f8:.2f}x", limit(t_f8, wbytes8)] + act_cols)
            print("| " + " | ".join(rows[-1]) + " |", flush=True)
        ws = fs = None
        torch.cuda.empty_cache()
    note = f" `torch._scaled_mm` with block-wise scales: n/a ({scaled_mm_error})." if scaled_mm_error else ""
    text = "\n".join([f"## WO-A at DeepSeek-V4 shapes, bf16 and FP8 -- {torch.cuda.get_device_name()}, "
                      f"{datetime.date.today()}", "",
                      f"Command: `python bench/bench_wo_a_v4.py --tokens {args.tokens}"
                      + "".join(f" --{k} {v}" for k, v in kg.items()) + f"`.{note}", "",
                      markdown_table(["shape (Dg=4096, R=1024)", "bf16 ours us", "bmm group-major us",
                                      "bmm into token-major y us", "bf16 vs best", "bf16 of limit",
                                      "FP8 ours us", "torch dequant + bmm us", "_scaled_mm per group us",
                                      "FP8 vs best", "FP8 of limit", "FP8 act. ours us (quant + GEMM)",
                                      "FP8 act. ours us (quant + GEMM, PDL)", "FP8 act. GEMM alone us",
                                      "FP8 act. GEMM of limit"], rows)])
    emit(text, args.out)


if __name__ == "__main__":
    main()
