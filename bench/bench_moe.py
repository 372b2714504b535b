"""Benchmark the MoE router and MXFP8 quantization against unfused PyTorch composites.

    python bench/bench_moe.py [--sections router,router-paths,router-after-gate,quant,overlap] [--out FILE]

All times: CUDA-graph replay, per call, median of 30 replays, rotating inputs (> L2 for the
quantization). The router composite is sync-free torch (sigmoid or sqrt-softplus scores,
grouped or plain top-k, scatter-add counts, cumsum offsets, stable argsort + scatter packing,
searchsorted tile map): the separate top-k, padding and packing kernels of the unfused path.
Routers: DeepSeek-V3 (E=256, 8 groups, k=8) and DeepSeek-V4-Flash / -Pro (E=256 / 384, no
groups, k=6, sqrt-softplus); each row first checks that both pick the same experts with the
same weights. ``router-paths`` times the router's single-CTA and grid paths at decode T (where
the dispatch threshold belongs); ``router-after-gate`` times it behind the gate product, as
the decode step runs it, plainly and as a programmatic dependent. The quantization baseline
is the same MX rule written in torch ops; the routed rows (decode T, swizzled scales) compare
padding rows zeroed, left unwritten, and the routed rows alone (``routed_row_pos``, the decode
runtime's call), their live rows checked equal first. A third table profiles a replayed graph in which
the token-order quantization is forked onto a side stream while the router runs.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (H200_COPY_BW, markdown_table, median, overlap_fractions, report,  # noqa: E402
                    profiled_graph_kernels, rotation_count, time_graph)

from cute_kernels.profiling import copy_bandwidth  # noqa: E402
from moe.experts import swizzle_scales  # noqa: E402
from moe.quant import mxfp8_quantize, mxfp8_quantize_routed, scale_buffer_size  # noqa: E402
from moe.router import V4_FLASH_ROUTER, V4_PRO_ROUTER, MoeRouter, RouterConfig, capacity  # noqa: E402
from moe.streams import SideStream  # noqa: E402


def selection_scores(logits, bias, cfg: RouterConfig):
    """The routing rule's FP32 expert scores ``s`` (sigmoid or sqrt-softplus of the logits) and
    selection scores ``b = s + bias``."""
    x = logits.float()
    s = x.sigmoid() if cfg.score == "sigmoid" else torch.nn.functional.softplus(x).sqrt()
    return s, (s if bias is None else s + bias)


def router_composite(logits, bias, cfg: RouterConfig, slots, tiles):
    E, G, TG, k, tile = cfg.num_experts, cfg.n_group, cfg.topk_group, cfg.top_k, cfg.tile_m
    T = logits.shape[0]
    s, b = selection_scores(logits, bias, cfg)
    if G > 1:
        gscore = b.view(T, G, E // G).topk(2, dim=-1).values.sum(-1)
        gidx = gscore.topk(TG, dim=-1).indices
        gmask = torch.zeros_like(gscore).scatter_(1, gidx, 1.0)
        b = b.masked_fill(gmask.repeat_interleave(E // G, dim=1) == 0, float("-inf"))
    ids = b.topk(k, dim=-1).indices
    w = s.gather(1, ids)
    w = w / (w.sum(-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor
    flat = ids.flatten()
    counts = torch.zeros(E, dtype=torch.int64, device=logits.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + tile - 1) // tile * tile
    offsets = torch.cat([padded.new_zeros(1), padded.cumsum(0)])
    starts = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    order = torch.argsort(flat, stable=True)
    ranks = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    sorted_ids = torch.full((slots,), T * k, dtype=torch.int64, device=flat.device)
    sorted_ids.scatter_(0, offsets[flat[order]] + ranks, order)
    tile_start = torch.arange(tiles, device=flat.device) * tile
    tile_expert = torch.searchsorted(offsets[1:], tile_start, right=True)
    tile_expert = torch.where(tile_start < offsets[-1], tile_expert, -1)
    return ids, w, counts, offsets, sorted_ids, tile_expert


def quant_composite(x):
    R, K = x.shape
    bits = (x.view(torch.int16).to(torch.int32) & 0x7FFF).view(R, K // 32, 32)
    amax = bits.amax(-1)
    scale = ((amax >> 7) - 8 + ((amax & 0x7F) > 0x60).to(torch.int32)).clamp(0, 254)
    mult = ((254 - scale) << 23).view(torch.float32)
    q = (x.float().view(R, K // 32, 32) * mult[..., None]).to(torch.float8_e4m3fn)
    return q, scale.to(torch.uint8)


ROUTERS = (("DeepSeek-V3", RouterConfig()), ("V4-Flash", V4_FLASH_ROUTER), ("V4-Pro", V4_PRO_ROUTER))
#: the router + align goal at decode token counts (T <= 64)
ROUTER_GOAL_S = 6e-6


def unexplained_picks(our_ids, ids, logits, bias, cfg: RouterConfig) -> tuple[torch.Tensor, list[int]]:
    """Tokens whose experts (as sets) differ from the reference picks ``ids``: ``(same, bad)`` --
    the mask of tokens that agree, and the differing tokens *not* at a near-tie the two FP32
    evaluations of the scores can break either way (their picks' selection scores equal the
    reference picks' within 1e-5, or, with grouped routing, the groups kept differently score
    within 2e-5)."""
    ours, ref = torch.sort(our_ids.long(), dim=-1).values, torch.sort(ids.long(), dim=-1).values
    same = (ours == ref).all(-1)
    _, b = selection_scores(logits, bias, cfg)
    gs = cfg.num_experts // cfg.n_group
    bad = []
    for t in torch.nonzero(~same).flatten().tolist():
        tie = bool(torch.allclose(b[t, ours[t]].sort().values, b[t, ref[t]].sort().values, rtol=0, atol=1e-5))
        if not tie and cfg.n_group > 1:
            g = b[t].view(cfg.n_group, gs).topk(2, dim=-1).values.sum(-1)
            differ = sorted(set((ours[t] // gs).tolist()) ^ set((ref[t] // gs).tolist()))
            tie = len(differ) == 2 and float((g[differ[0]] - g[differ[1]]).abs()) <= 2e-5
        if not tie:
            bad.append(t)
    return same, bad


def check_router(out, ids, w, T, logits, bias, cfg: RouterConfig):
    """Our router's experts (as sets per token) and weights (matched by expert) against the
    composite's: a token may differ only at a near-tie (:func:`unexplained_picks`); weights are
    compared on the tokens whose picks agree."""
    same, bad = unexplained_picks(out.topk_ids[:T], ids, logits, bias, cfg)
    if bad:
        raise SystemExit(f"router T={T}: tokens {bad[:8]} pick other experts than the torch composite (no near-tie)")
    ours, ref = torch.sort(out.topk_ids[:T].long(), dim=-1), torch.sort(ids, dim=-1)
    if not torch.allclose(out.topk_weights[:T].gather(1, ours.indices)[same], w.gather(1, ref.indices)[same],
                          rtol=1e-5):
        raise SystemExit(f"router T={T}: weights differ from the torch composite")


def router_inputs(cfg: RouterConfig, T: int, n: int = 16):
    """``n`` rotating logits ``[T, E]`` and one bias of the router benches."""
    return [torch.randn(T, cfg.num_experts, device="cuda") * 3 for _ in range(n)], \
        torch.randn(cfg.num_experts, device="cuda") * 0.1


def time_router(cfg: RouterConfig, T: int, logits: list, bias, pdl: bool = False) -> float:
    """Seconds per call of our router over the rotating ``logits`` (CUDA-graph replay), its
    output checked once against the composite first; the path is the one the host's thresholds
    (``moe.router.SINGLE_CTA_MAX_TOKENS``, ``CLUSTER_MAX_TOKENS``) pick for T. ``pdl``: each
    launch a programmatic dependent of the one before (its set-up overlaps that one's end)."""
    slots, tiles = capacity(cfg, T)
    routers = [MoeRouter(cfg, max_tokens=T, pdl=pdl) for _ in logits]
    check_router(routers[0](logits[0], bias), *router_composite(logits[0], bias, cfg, slots, tiles)[:2], T,
                 logits[0], bias, cfg)
    return time_graph(lambda i: routers[i](logits[i], bias), len(logits), 64)


def bench_router():
    rows = []
    for name, cfg in ROUTERS:
        E = cfg.num_experts
        for T in (1, 6, 8, 64, 320, 384):  # decode: a verify step is 6 tokens per request (BS1: 6, BS64: 384)
            slots, tiles = capacity(cfg, T)
            logits, bias = router_inputs(cfg, T)
            t_ours = time_router(cfg, T, logits, bias)
            t_pdl = time_router(cfg, T, logits, bias, pdl=True)
            t_ref = time_graph(lambda i: router_composite(logits[i], bias, cfg, slots, tiles), len(logits), 64)
            rows.append([f"{name}: T={T}, E={E}, k={cfg.top_k}, {cfg.score}, tile {cfg.tile_m}",
                         f"{t_ours * 1e6:.2f}", f"{t_pdl * 1e6:.2f}", f"{t_ref * 1e6:.2f}", f"{t_ref / t_ours:.1f}x",
                         ("yes" if t_ours <= ROUTER_GOAL_S else "no") if T <= 64 else "-"])
            print("| " + " | ".join(rows[-1]) + " |", flush=True)  # (a run cut short keeps its rows)
    return markdown_table(["router + align", "ours us", "ours, PDL us", "torch composite us", "speedup",
                           "<= 6 us (T <= 64)"], rows)


def bench_router_paths():
    """The router's paths at decode T: the single-CTA path, the cluster path (T <= 64) of each
    size in ``moe.router.CLUSTER_SIZES`` and the grid path, each forced through the host's
    thresholds (``SINGLE_CTA_MAX_TOKENS``, ``CLUSTER_MAX_TOKENS``, ``CLUSTER_CTAS``), which
    should sit where the next path becomes the faster; the last column is the path the host
    picks today."""
    import moe.router as router_mod

    names = ("SINGLE_CTA_MAX_TOKENS", "CLUSTER_MAX_TOKENS", "CLUSTER_CTAS")
    saved = tuple(getattr(router_mod, n) for n in names)
    paths = {"single CTA": (router_mod.SINGLE_CTA_CAPACITY, 0, saved[2])}
    paths.update({f"cluster of {c}": (0, router_mod.CLUSTER_CAPACITY, c) for c in router_mod.CLUSTER_SIZES})
    paths["grid"] = (0, 0, saved[2])
    rows = []
    try:
        for name, cfg in ROUTERS:
            for T in (4, 8, 12, 16, 24, 32, 48, 64):
                logits, bias = router_inputs(cfg, T)
                times = {}
                for path, values in paths.items():
                    for n, v in zip(names, values):
                        setattr(router_mod, n, v)
                    times[path] = time_router(cfg, T, logits, bias)
                picked = ("single CTA" if T <= saved[0] else f"cluster of {saved[2]}" if T <= saved[1] else "grid")
                rows.append([f"{name}: T={T}, E={cfg.num_experts}, k={cfg.top_k}"]
                            + [f"{times[p] * 1e6:.2f}" for p in paths] + [min(times, key=times.get), picked])
                print("| " + " | ".join(rows[-1]) + " |", flush=True)  # (a run cut short keeps its rows)
    finally:
        for n, v in zip(names, saved):
            setattr(router_mod, n, v)
    return markdown_table(["router + align"] + [f"{p} us" for p in paths] + ["fastest", "dispatched to"], rows)


#: the routers after their gate product: (name, router, hidden size)
GATED_ROUTERS = (("V4-Flash", V4_FLASH_ROUTER, 4096), ("V4-Pro", V4_PRO_ROUTER, 7168))


def bench_router_after_gate():
    """The router as the decode step runs it: after the gate product ``logits = h @ W_g^T``
    (bf16, cuBLAS), in one replayed graph, launched plainly or as a programmatic dependent of
    the product (``MoeRouter(pdl=True)``, ``EngineConfig.router_pdl``); the product alone
    beside. "router's share" is the pair's time less the product's. The router's output is
    checked once against the composite on the product's logits."""
    rows = []
    for name, cfg, hidden in GATED_ROUTERS:
        E = cfg.num_experts
        w = (torch.randn(E, hidden, device="cuda") / hidden**0.5).bfloat16()
        bias = torch.randn(E, device="cuda") * 0.1
        for T in (6, 64, 384):  # a verify step of BS1 / ~BS11 / BS64
            slots, tiles = capacity(cfg, T)
            hs = [torch.randn(T, hidden, device="cuda").bfloat16() for _ in range(16)]
            t_gate = time_graph(lambda i: hs[i] @ w.T, len(hs), 64)
            logits = (hs[0] @ w.T).float()  # (the router widens the bf16 logits exactly)
            ids, wts = router_composite(logits, bias, cfg, slots, tiles)[:2]
            times = []
            for pdl in (False, True):
                routers = [MoeRouter(cfg, max_tokens=T, pdl=pdl) for _ in hs]
                check_router(routers[0](hs[0] @ w.T, bias), ids, wts, T, logits, bias, cfg)
                times.append(time_graph(lambda i: routers[i](hs[i] @ w.T, bias), len(hs), 64))
            rows.append([f"{name}: T={T}, hidden {hidden}, E={E}", f"{t_gate * 1e6:.2f}", f"{times[0] * 1e6:.2f}",
                         f"{times[1] * 1e6:.2f}", f"{(times[0] - t_gate) * 1e6:.2f}",
                         f"{(times[1] - t_gate) * 1e6:.2f}"])
            print("| " + " | ".join(rows[-1]) + " |", flush=True)  # (a run cut short keeps its rows)
    return markdown_table(["gate product + router + align", "gate product us", "both us", "both, router PDL us",
                           "router's share us", "router's share, PDL us"], rows)


def bench_quant():
    rows = []
    K = 7168
    card_bw = copy_bandwidth()  # this card's limit, measured in this run
    for T, layout in [(64, "plain"), (4096, "plain"), (16384, "plain"), (4096, "swizzled"), (16384, "swizzled")]:
        nbytes = T * K * 2 + T * K + scale_buffer_size(T, K, layout)
        n = rotation_count(nbytes)
        xs = [torch.randn(T, K, device="cuda").bfloat16() for _ in range(n)]
        qs = [torch.empty(T, K, dtype=torch.float8_e4m3fn, device="cuda") for _ in range(n)]
        ss = [torch.empty(scale_buffer_size(T, K, layout), dtype=torch.uint8, device="cuda") for _ in range(n)]
        if layout == "plain":
            ss = [s.view(T, K // 32) for s in ss]
        reps = max(n, 20)
        mxfp8_quantize(xs[0], layout=layout, q=qs[0], scales=ss[0])  # checked once before timing
        qc, sc = quant_composite(xs[0])
        want_s = sc if layout == "plain" else swizzle_scales(sc.reshape(T, K // 32))
        if not torch.equal(qs[0].view(torch.uint8), qc.view(torch.uint8).reshape(T, K)) or not torch.equal(
                ss[0].reshape(-1), want_s.reshape(-1)):
            raise SystemExit(f"mxfp8_quantize {T}x{K} {layout}: output check failed; not timing it")
        t_ours = time_graph(lambda i: mxfp8_quantize(xs[i], layout=layout, q=qs[i], scales=ss[i]), n, reps)
        # the torch composite writes plain scales only: no baseline for the swizzled rows
        t_ref = time_graph(lambda i: quant_composite(xs[i]), n, reps) if layout == "plain" else None
        bw = nbytes / t_ours
        rows.append([f"{T}x{K} {layout}", f"{t_ours * 1e6:.2f}", "-" if t_ref is None else f"{t_ref * 1e6:.2f}",
                     "-" if t_ref is None else f"{t_ref / t_ours:.1f}x",
                     f"{bw / 1e12:.2f}", f"{100 * bw / H200_COPY_BW:.0f}%", f"{100 * bw / card_bw:.0f}%"])
        del xs, qs, ss
    # routed (gather through sorted ids, swizzled scales), decode sizes: padding rows zeroed, left
    # unwritten, or the routed rows alone walked through routed_row_pos (the decode runtime's call)
    cfg = RouterConfig()
    k = cfg.top_k
    for T in (8, 64, 320):
        r = MoeRouter(cfg, max_tokens=T)
        x = torch.randn(T, K, device="cuda").bfloat16()
        out = r(torch.randn(T, 256, device="cuda"), torch.zeros(256, device="cuda"))
        total = int(out.total_rows.item())
        cap = out.sorted_token_ids.numel()
        q = torch.empty(cap, K, dtype=torch.float8_e4m3fn, device="cuda")
        s = torch.empty(scale_buffer_size(cap, K, "swizzled"), dtype=torch.uint8, device="cuda")
        modes = (("padding zeroed", total, {}), ("padding unwritten", T * k, dict(zero_padding=False)),
                 ("routed rows only", T * k, dict(zero_padding=False, routed_row_pos=out.routed_row_pos)))
        live = out.routed_row_pos.long()  # routed row t*k + i: token t's quantized row
        want = quant_composite(x)[0].view(torch.uint8).reshape(T, K).repeat_interleave(k, 0)
        for name, written, kw in modes:
            q.view(torch.uint8).fill_(0xAB)
            mxfp8_quantize_routed(x, out.sorted_token_ids, out.total_rows, k, q=q, scales=s, **kw)
            if not torch.equal(q.view(torch.uint8)[live], want):  # checked once before timing
                raise SystemExit(f"mxfp8_quantize_routed T={T} ({name}): live rows differ from the torch composite")
            t = time_graph(lambda i, kw=kw: mxfp8_quantize_routed(x, out.sorted_token_ids, out.total_rows, k, q=q,
                                                                   scales=s, **kw), 1, 20)
            nbytes = T * K * 2 + written * K + written * K // 32
            rows.append([f"routed T={T}, {name} ({written} rows written of {total}), swizzled", f"{t * 1e6:.2f}", "-",
                         "-", f"{nbytes / t / 1e12:.2f}", f"{100 * nbytes / t / H200_COPY_BW:.0f}%",
                         f"{100 * nbytes / t / card_bw:.0f}%"])
    return markdown_table(["MXFP8 quant (bytes = x + q + scales)", "ours us", "torch us", "speedup", "TB/s",
                           "% of 4.3 TB/s", f"% of this card's copy ({card_bw / 1e12:.2f} TB/s)"], rows)


def profile_overlap():

    cfg, T, K = RouterConfig(), 320, 7168
    r = MoeRouter(cfg, max_tokens=T)
    logits = torch.randn(T, 256, device="cuda")
    bias = torch.randn(256, device="cuda") * 0.1
    x = torch.randn(T, K, device="cuda").bfloat16()
    q = torch.empty(T, K, dtype=torch.float8_e4m3fn, device="cuda")
    s = torch.empty(T, K // 32, dtype=torch.uint8, device="cuda")
    side = SideStream()

    def step():
        with side.fork():
            # 32 CTAs: the router's CTAs must find free SMs beside the quantization
            mxfp8_quantize(x, q=q, scales=s, max_ctas=32)
        r(logits, bias)
        side.join()

    kern = profiled_graph_kernels(step, 10)
    quants = [e.time_range for e in kern if "MxQuant" in e.name]
    routers = [e.time_range for e in kern if "Router" in e.name]
    fr = overlap_fractions(quants, routers)
    qd, rd = median([e.elapsed_us() for e in quants]), median([e.elapsed_us() for e in routers])
    a_ser = time_graph(lambda i: (mxfp8_quantize(x, q=q, scales=s), r(logits, bias)), 1, 10)
    a_par = time_graph(lambda i: step(), 1, 10)
    rows = [[f"T={T}", len(quants), f"{qd:.1f}", f"{rd:.1f}", f"{100 * sum(fr) / max(len(fr), 1):.0f}%",
             f"{a_ser * 1e6:.2f}", f"{a_par * 1e6:.2f}"]]
    return markdown_table(["shape", "replays profiled", "quant us (median)", "router us (median)",
                           "quant time overlapped by router", "serial step us", "forked step us"], rows) + "\n\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", default="router,quant,overlap",
                    help="comma-separated tables to run: router, router-paths, router-after-gate, quant, overlap "
                         "(default: %(default)s)")
    ap.add_argument("--out", default=None, help="also write the tables to this file (default: none)")
    args = ap.parse_args()
    sections = {"router": bench_router, "router-paths": bench_router_paths,
                "router-after-gate": bench_router_after_gate, "quant": bench_quant,
                "overlap": lambda: "Side-stream overlap (replayed graph, torch profiler):\n\n" + profile_overlap()}
    wanted = [x.strip() for x in args.sections.split(",") if x.strip()]
    if not set(wanted) <= set(sections):
        ap.error(f"--sections: {args.sections!r}, expected a list of {', '.join(sections)}")
    report("MoE router + MXFP8 quantization", f"python bench/bench_moe.py --sections {args.sections}",
           *[part for w in wanted for part in (sections[w](), "")], out=args.out)


if __name__ == "__main__":
    main()
