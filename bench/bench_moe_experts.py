"""Benchmark one MoE layer: MXFP8 experts + fused finalize vs the unfused bf16 composite.

    python bench/bench_moe_experts.py [--model v4-flash|v4-pro|v3] [--sweep] [--out FILE]

Models (one GPU holds every routed expert): ``v4-flash`` (default) -- hidden 4096, E = 256,
k = 6, I = 2048, sqrt-softplus top-k, SwiGLU clamp 10, routed experts MXFP4 as in the
checkpoint (converted exactly to MXFP8 operands: moe.experts.mxfp4_expert_weights);
``v4-pro`` -- hidden 7168, E = 384, k = 6, I = 3072, likewise; ``v3`` -- hidden 7168, E = 256,
k = 8, I = 2048, sigmoid grouped top-k, bf16 weights quantised to MXFP8. One shared expert
(I wide) each. T in {1, 64, 320, 4096}. Before timing, the layer's output is checked once
against the composite's (relative error < 5e-2: MXFP8 activations against bf16 ones). Ours (H200 = Hopper path): router (one launch) -> routed MXFP8
quantisation -> gate/up GEMM with SiLU * up + MXFP8 requantisation fused -> down GEMM ->
finalize fused with the shared-expert add. Composite: the same router math in torch,
argsort packing, ``torch._grouped_mm`` on bf16 weights for gate/up and down, SiLU * up,
a standalone weighted finalize, a separate shared add. Same random weights (bf16 originals;
ours quantised from them). Stage times are CUDA-graph replays of each stage alone; the layer
time is one graph of the whole layer; launches per layer are counted from a profiled replay.
The layer's expert kernels are the runtime's choice (moe.experts.expert_kernel_args): the
swap-AB decode kernel (moe.experts_swap_ab_sm90) at T <= 16, in passes of 16 token columns
up to T = 384, the tiled kernel (moe.experts_tiled_sm90, default tile) above; the second layer
column forces the tiled kernel with tile_k 256. ``--sweep``: the per-stage table also times every
tiled-kernel configuration and decode-kernel depth.
Weight bandwidth at decode T counts the bytes of the experts the router actually selected.

"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import H200_COPY_BW, markdown_table, profiled_graph_kernels, report, time_graph  # noqa: E402

from moe.experts import (dequantize, expert_kernel_args, interleave_gate_up, moe_expert_gate_up,  # noqa: E402
                        moe_expert_gemm, mxfp4_expert_weights, quantize_expert_weights)
from moe.experts_swap_ab_sm90 import MoeExpertSwapABSm90, tok_n_for  # noqa: E402
from moe.finalize import moe_finalize  # noqa: E402
from moe.quant import mxfp8_gather_routed, mxfp8_quantize, mxfp8_quantize_routed, scale_buffer_size  # noqa: E402
from moe.router import V4_FLASH_ROUTER, V4_PRO_ROUTER, MoeRouter, RouterConfig  # noqa: E402

#: model -> (hidden C, expert width I, router config, SwiGLU clamp, MXFP4 checkpoint weights)
MODELS = {"v4-flash": (4096, 2048, V4_FLASH_ROUTER, 10.0, True),
          "v4-pro": (7168, 3072, V4_PRO_ROUTER, 10.0, True),
          "v3": (7168, 2048, RouterConfig(), None, False)}
C, I, TOPK, LIMIT = 7168, 2048, 8, None  # set from --model in main()
#: Hopper expert-kernel (K tile, stages, CTAs per SM) swept per stage
TILES = ((128, 4, 1), (256, 3, 1), (128, 4, 2), (256, 2, 2))
#: decode-kernel pipeline depths swept at T <= 64 (the default: moe.experts_swap_ab_sm90.STAGES)
DECODE_STAGES = (3, 4, 5, 6)


def mxfp4_checkpoint(E, N, K):
    """Random MXFP4 weights in the V4 checkpoint layout (packed e2m1, UE8M0 per 32), scaled for
    O(1) outputs; returned as (MXFP8 operands, bf16 dequantised copy for the composite)."""
    packed = torch.randint(0, 256, (E, N, K // 2), device="cuda", dtype=torch.uint8)
    s = 127 - 2 - int(torch.log2(torch.tensor(K ** 0.5)).round())
    scale = torch.full((E, N, K // 32), s, device="cuda", dtype=torch.uint8)
    q, sc = mxfp4_expert_weights(packed, scale)
    del packed, scale
    bf = torch.empty(E, N, K, dtype=torch.bfloat16, device="cuda")  # filled per expert: no stacked copy
    for e in range(E):
        bf[e] = dequantize(q[e], sc[e], N, K)
    return q, sc, bf


def make_weights(E, mxfp4):
    if mxfp4:  # the checkpoint's format: gate / up interleaved as one [E, 2I, C] tensor
        gu_q, gu_s, gu = mxfp4_checkpoint(E, 2 * I, C)
        d_q, d_s, d = mxfp4_checkpoint(E, C, I)
        blocks = gu.view(E, I // 32, 2, 32, C)  # interleave_gate_up's blocks of 32 rows: gate, up, ...
        g, u = blocks[:, :, 0].reshape(E, I, C), blocks[:, :, 1].reshape(E, I, C)
        assert torch.equal(interleave_gate_up(g[:1], u[:1]), gu[:1])  # the row order the kernels read
        del gu, blocks
    else:
        g = torch.randn(E, I, C, device="cuda").bfloat16() / C**0.5
        u = torch.randn(E, I, C, device="cuda").bfloat16() / C**0.5
        d = torch.randn(E, C, I, device="cuda").bfloat16() / I**0.5
        gu = interleave_gate_up(g, u)
        gu_q, gu_s = quantize_expert_weights(gu)
        d_q, d_s = quantize_expert_weights(d)
    sh = [torch.randn(I, C, device="cuda").bfloat16() / C**0.5 for _ in range(2)] + \
        [torch.randn(C, I, device="cuda").bfloat16() / I**0.5]
    return dict(g=g, u=u, d=d, gu_q=gu_q, gu_s=gu_s, d_q=d_q, d_s=d_s, sh=sh)


def shared_expert(x, sh):
    return (torch.nn.functional.silu(x @ sh[0].T) * (x @ sh[1].T)) @ sh[2].T


def composite_route(logits, bias, cfg):
    """The router math in torch: (ids [T, k], weights [T, k])."""
    T, E = logits.shape
    if cfg.score == "sqrtsoftplus":  # V4: plain top-k of score + bias, no group stage
        s = torch.nn.functional.softplus(logits.float()).sqrt()
        ids = (s + bias).topk(TOPK, dim=-1).indices
    else:
        s = logits.float().sigmoid()
        b = s + bias
        gs = E // cfg.n_group
        gscore = b.view(T, cfg.n_group, gs).topk(2, dim=-1).values.sum(-1)
        gmask = torch.zeros_like(gscore).scatter_(1, gscore.topk(cfg.topk_group, dim=-1).indices, 1.0)
        ids = b.masked_fill(gmask.repeat_interleave(gs, dim=1) == 0, float("-inf")).topk(TOPK, dim=-1).indices
    w = s.gather(1, ids)
    w = w / (w.sum(-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor
    return ids, w


def swiglu(gate, up):
    """SiLU(gate) * up, with V4's clamp (gate <= limit, |up| <= limit) where the model has one."""
    if LIMIT is not None:
        gate, up = gate.clamp(max=LIMIT), up.clamp(-LIMIT, LIMIT)
    return torch.nn.functional.silu(gate) * up


def composite_layer(x, logits, bias, W, cfg):
    T, E = x.shape[0], cfg.num_experts
    ids, w = composite_route(logits, bias, cfg)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.long, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    offs = counts.cumsum(0).int()  # (no bincount: it syncs to size its output; graphs forbid that)
    xs = x[order // TOPK]
    gate = torch._grouped_mm(xs, W["g"].transpose(1, 2), offs=offs)
    up = torch._grouped_mm(xs, W["u"].transpose(1, 2), offs=offs)
    y = torch._grouped_mm(swiglu(gate, up), W["d"].transpose(1, 2), offs=offs)
    routed = torch.zeros(T * TOPK, C, device=x.device, dtype=y.dtype).index_copy_(0, order, y)
    routed = (routed.view(T, TOPK, C).float() * w[..., None]).sum(1).bfloat16()  # standalone finalize
    return routed + shared_expert(x, W["sh"])  # separate add


class OursLayer:
    def __init__(self, T, W, cfg, tile_k=None):
        self.cfg, self.W, self.tile_k = cfg, W, tile_k
        self.router = MoeRouter(cfg, max_tokens=T)

    def __call__(self, x, logits, bias):
        r = self.router(logits, bias)
        aq, asc = mxfp8_quantize_routed(x, r.sorted_token_ids, r.total_rows, TOPK, zero_padding=False)
        n = x.shape[0] * TOPK
        # the runtime's choice by token count (decode kernel, in row passes above 16 tokens), or
        # the tiled kernel with a fixed K tile
        kw = expert_kernel_args(x.shape[0]) if self.tile_k is None else dict(tile_k=self.tile_k)
        hq, hs = moe_expert_gate_up(aq, asc, self.W["gu_q"], self.W["gu_s"], r.expert_offsets, r.expert_counts,
                                    r.tile_expert, routed_rows=n, swiglu_limit=LIMIT, **kw)
        y = moe_expert_gemm(hq, hs, self.W["d_q"], self.W["d_s"], r.expert_offsets, r.expert_counts, r.tile_expert,
                            routed_rows=n, **kw)
        return moe_finalize(y, r.topk_weights, r.routed_row_pos, shared_expert(x, self.W["sh"]))


def stage_times(T, x, logits, bias, W, cfg, ours, sweep):
    """Each stage alone as a replayed graph (inputs produced once beforehand), in us."""
    t = {}
    r = ours.router(logits, bias)
    aq, asc = mxfp8_quantize_routed(x, r.sorted_token_ids, r.total_rows, TOPK)
    n = T * TOPK
    hq, hs = moe_expert_gate_up(aq, asc, W["gu_q"], W["gu_s"], r.expert_offsets, r.expert_counts, r.tile_expert,
                                routed_rows=n, swiglu_limit=LIMIT)
    y = moe_expert_gemm(hq, hs, W["d_q"], W["d_s"], r.expert_offsets, r.expert_counts, r.tile_expert, routed_rows=n)
    sh = shared_expert(x, W["sh"])
    us = lambda f: time_graph(lambda i: f(), 1, 5, trials=15) * 1e6  # noqa: E731
    t["router"] = us(lambda: ours.router(logits, bias))
    t["quant"] = us(lambda: mxfp8_quantize_routed(x, r.sorted_token_ids, r.total_rows, TOPK, q=aq, scales=asc))
    t["quant, padding unwritten"] = us(lambda: mxfp8_quantize_routed(x, r.sorted_token_ids, r.total_rows, TOPK, q=aq,
                                                                     scales=asc, zero_padding=False))
    # the decode runtime's fused arm: the tokens quantized beside the router (side stream), then
    # only their bytes gathered after it (the critical path's part)
    xq, xs = mxfp8_quantize(x)
    gq, gs = mxfp8_gather_routed(xq, xs, r.sorted_token_ids, r.total_rows, TOPK)
    live = int(r.total_rows[0])
    if not (torch.equal(gq[:live].view(torch.uint8), aq[:live].view(torch.uint8))
            and torch.equal(gs[:scale_buffer_size(live, C, "swizzled")], asc[:scale_buffer_size(live, C, "swizzled")])):
        raise SystemExit(f"T={T}: the gather of the quantized tokens differs from the routed quantization")
    t["tokens' quant (side stream)"] = us(lambda: mxfp8_quantize(x, q=xq, scales=xs))
    t["gather of the quantized tokens, padding unwritten"] = us(
        lambda: mxfp8_gather_routed(xq, xs, r.sorted_token_ids, r.total_rows, TOPK, q=aq, scales=asc,
                                    zero_padding=False))

    def gate_up(**kw):
        return us(lambda: moe_expert_gate_up(aq, asc, W["gu_q"], W["gu_s"], r.expert_offsets, r.expert_counts,
                                             r.tile_expert, routed_rows=n, swiglu_limit=LIMIT, **kw))

    def down(**kw):
        return us(lambda: moe_expert_gemm(hq, hs, W["d_q"], W["d_s"], r.expert_offsets, r.expert_counts,
                                          r.tile_expert, out=y, routed_rows=n, **kw))

    gemms = (("gate/up", gate_up, 2 * I, C), ("down", down, C, I))
    kw_default = expert_kernel_args(T)
    t["gate/up (+SiLU, requant), default kernel"] = gate_up(**kw_default)
    t["down, default kernel"] = down(**kw_default)
    for name, run, _, _ in gemms if sweep else ():  # the tiled kernel's configurations
        label = "gate/up (+SiLU, requant)" if name == "gate/up" else name
        for tk, st, c in TILES:
            t[f"{label} {tk}x{st} {c}cta"] = run(tile_k=tk, stages=st, ctas_per_sm=c)
    # the swap-AB TMA + FP8 wgmma decode kernel (moe.experts_swap_ab_sm90) at T <= 64, by pipeline depth
    tn = tok_n_for(T)
    for name, run, N, K in gemms if sweep else ():
        for st in DECODE_STAGES:
            ok = tn is not None and MoeExpertSwapABSm90.can_implement(cfg.num_experts, N, K, tn, st)
            t[f"{name} decode kernel, {st} stages"] = run(max_expert_rows=T, stages=st) if ok else float("nan")
    # the decode kernel in row passes of 16 / 32 token columns (any rows per expert; 32 halves
    # the passes over each weight tile where experts hold more than 16 rows)
    for rt in (16, 32) if sweep else ():
        for name, run, _, _ in gemms:
            t[f"{name} decode kernel, row passes of {rt}"] = run(expert_row_tile=rt) if T > 1 or rt == 16 \
                else float("nan")
    t["finalize + shared add"] = us(lambda: moe_finalize(y, r.topk_weights, r.routed_row_pos, sh))
    t["shared expert (both)"] = us(lambda: shared_expert(x, W["sh"]))
    # composite stages
    ids, w = composite_route(logits, bias, cfg)  # the same routing as the layer rows
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(cfg.num_experts, dtype=torch.long, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    offs = counts.cumsum(0).int()
    xs = x[order // TOPK]
    hh = swiglu(torch._grouped_mm(xs, W["g"].transpose(1, 2), offs=offs),
                torch._grouped_mm(xs, W["u"].transpose(1, 2), offs=offs))
    yy = torch._grouped_mm(hh, W["d"].transpose(1, 2), offs=offs)
    t["c: gate/up + SiLU*up"] = us(lambda: swiglu(torch._grouped_mm(xs, W["g"].transpose(1, 2), offs=offs),
                                                  torch._grouped_mm(xs, W["u"].transpose(1, 2), offs=offs)))
    t["c: down"] = us(lambda: torch._grouped_mm(hh, W["d"].transpose(1, 2), offs=offs))
    t["c: finalize + add"] = us(lambda: (torch.zeros(T * TOPK, C, device=x.device, dtype=yy.dtype).index_copy_(0, order, yy)
                                         .view(T, TOPK, C).float() * w[..., None]).sum(1).bfloat16() + sh)
    return t


def count_launches(fn):
    """Kernels one replay of a graph of ``fn()`` launches, and how many of them finalize."""
    names = [e.name for e in profiled_graph_kernels(fn, 1)]
    return len(names), sum("Finalize" in n or "finalize" in n for n in names)


def main():
    global C, I, TOPK, LIMIT
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=tuple(MODELS), default="v4-flash",
                    help="model shapes, router and weight format (default: v4-flash)")
    ap.add_argument("--out", default=None, help="also write the markdown tables here (default: none)")
    ap.add_argument("--tokens", default="1,64,320,4096", help="comma-separated T values (default: 1,64,320,4096)")
    ap.add_argument("--sweep", action="store_true",
                    help="time every tiled-kernel config and decode depth per stage (default: off)")
    args = ap.parse_args()
    C, I, cfg, LIMIT, mxfp4 = MODELS[args.model]
    TOPK, E = cfg.top_k, cfg.num_experts
    W = make_weights(E, mxfp4)
    bias = torch.randn(E, device="cuda") * 0.1
    rows, stage_rows, stage_names = [], [], []
    for T in [int(v) for v in args.tokens.split(",")]:
        x = torch.randn(T, C, device="cuda").bfloat16()
        logits = torch.randn(T, E, device="cuda") * 3
        ours = OursLayer(T, W, cfg)
        got, want = ours(x, logits, bias).float(), composite_layer(x, logits, bias, W, cfg).float()
        err = ((got - want).norm() / want.norm()).item()
        if not err < 5e-2:
            raise SystemExit(f"{args.model} T={T}: layer output differs from the composite (rel. error {err:.3g})")
        t_ours = time_graph(lambda i: ours(x, logits, bias), 1, 5, trials=20)
        ours256 = OursLayer(T, W, cfg, tile_k=256)
        t_ours256 = time_graph(lambda i: ours256(x, logits, bias), 1, 5, trials=20)
        t_base = time_graph(lambda i: composite_layer(x, logits, bias, W, cfg), 1, 5, trials=20)
        r = ours.router(logits, bias)
        active = int((r.expert_counts > 0).sum())
        wbytes = active * (2 * I * C + C * I)  # e4m3 weights of the selected experts (+ scales ~3%)
        n_ours, fin_ours = count_launches(lambda: ours(x, logits, bias))
        n_base, _ = count_launches(lambda: composite_layer(x, logits, bias, W, cfg))
        rows.append([f"T={T}", f"{t_ours * 1e6:.1f}", f"{t_ours256 * 1e6:.1f}", f"{t_base * 1e6:.1f}",
                     f"{t_base / min(t_ours, t_ours256):.2f}x", active,
                     f"{100 * wbytes / min(t_ours, t_ours256) / H200_COPY_BW:.0f}%", n_ours, n_base, fin_ours])
        print(rows[-1], flush=True)
        st = stage_times(T, x, logits, bias, W, cfg, ours, args.sweep)
        stage_rows.append([f"T={T}"] + [f"{v:.1f}" for v in st.values()])
        stage_names = list(st)
        print(stage_rows[-1], flush=True)
    fmt = "MXFP4 checkpoint weights as MXFP8" if mxfp4 else "MXFP8 weights"
    report(f"MoE layer, {args.model} (E={E}, k={TOPK}, hidden {C}, I={I}, {fmt})",
           f"python bench/bench_moe_experts.py --model {args.model} --tokens {args.tokens}"
           f"{' --sweep' if args.sweep else ''}",
           markdown_table(["shape", "ours us (layer graph, expert_kernel_args)", "ours us (tiled kernel, tile_k 256)",
                           "bf16 composite us", "speedup (best)",
                           "experts hit", "ours weight bytes/s as % of 4.3 TB/s (best)", "launches ours",
                           "launches composite", "finalize launches (ours: the fused finalize + shared add)"], rows),
           "", "Per stage, each alone as a replayed graph, us (c: = the composite's stage):", "",
           markdown_table(["shape"] + stage_names, stage_rows), out=args.out)


if __name__ == "__main__":
    main()
