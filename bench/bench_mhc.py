"""Benchmark mHC: statistics kernel (whole, and the decode step's two parts), pre/post-mix, and
the side-stream overlap.

    python bench/bench_mhc.py [--out FILE]

n = 4 streams, C = 7168. All times: CUDA-graph replay, per call, median of 30 replays,
rotating X buffers (> 2x L2 in total). phi (two bf16 planes, 2.75 MB) is one buffer, as in decode,
where it stays L2-resident between layers' calls only if nothing evicts it -- so the
bandwidth column counts its bytes too. Baselines are the PyTorch composites of the same math
(FP32 upcast, rsqrt-mean, matmul, sigmoid, exp, 20 Sinkhorn iterations; einsum mixes).

Overlap: a replayed graph whose main stream runs a decode "tail" -- the WO-B GEMM
``[T, 16384] x [16384, 7168]`` bf16 (cuBLAS) -- while the statistics of an X that is
ready are forked onto a side stream and joined after. (In the model, the X whose stats
are computed is the *output* of such a tail, so this measures how well the stats kernel
co-runs with a weight-streaming GEMM, which is the condition for hiding it wherever the
runtime has independent work; the decode runtime's placement is documented there.)
The fraction of each stats kernel's duration that overlaps another kernel is measured from
a torch-profiler trace; serial vs forked graph time gives the net saving.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (H200_COPY_BW, markdown_table, median, overlap_fractions, report,  # noqa: E402
                    profiled_graph_kernels, rotation_count, time_graph)

from cute_kernels.mhc_post_mix import mhc_post_mix  # noqa: E402
from cute_kernels.mhc_pre_mix import mhc_pre_mix  # noqa: E402
from cute_kernels.mhc_stats import MhcStatsWorkspace, mhc_split_phi, mhc_stats, num_maps  # noqa: E402
from moe.streams import SideStream  # noqa: E402

N, C, EPS, ITERS = 4, 7168, 1e-6, 20
TS = (1, 5, 64, 320)


def stats_composite(x, phi, alpha, bias):
    T = x.shape[0]
    xf = x.float().reshape(T, N * C)
    P = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + EPS)) @ phi.T
    h_pre = torch.sigmoid(alpha[0] * P[:, :N] + bias[:N])
    h_post = 2 * torch.sigmoid(alpha[1] * P[:, N:2 * N] + bias[N:2 * N])
    M = torch.exp(alpha[2] * P[:, 2 * N:] + bias[2 * N:]).view(T, N, N)
    for _ in range(ITERS):
        M = M / M.sum(-1, keepdim=True)
        M = M / M.sum(-2, keepdim=True)
    return torch.cat([h_pre, h_post, M.reshape(T, N * N)], -1)


def inputs(T, C=C):
    m = num_maps(N)
    rot = rotation_count(T * N * C * 2)
    xs = [torch.randn(T, N, C, device="cuda").bfloat16() for _ in range(rot)]
    phi = torch.randn(m, N * C, device="cuda") / (N * C) ** 0.5
    alpha = torch.rand(3, device="cuda") + 0.5
    bias = torch.randn(m, device="cuda") * 0.5
    return xs, phi, alpha, bias


def bench_stats():
    rows = []
    m = num_maps(N)
    for T in TS:
        xs, phi, alpha, bias = inputs(T)
        ws = MhcStatsWorkspace(N, T)
        H = torch.empty(T, m, device="cuda")
        planes = mhc_split_phi(phi)
        mhc_stats(xs[0], planes, alpha, bias, eps=EPS, workspace=ws, out=H)  # checked once before timing
        err = (H - stats_composite(xs[0], phi, alpha, bias)).abs().max().item()
        if not err <= 1e-4:  # H in (0, 2); phi carried to 16 bits, FP32 sums (tests/test_mhc.py)
            raise SystemExit(f"mhc_stats T={T}: output check failed (max error {err:.3g}); not timing it")
        ours = time_graph(lambda i: mhc_stats(xs[i], planes, alpha, bias, eps=EPS, workspace=ws, out=H), len(xs))
        base = time_graph(lambda i: stats_composite(xs[i], phi, alpha, bias), len(xs))
        nbytes = T * N * C * 2 + phi.numel() * 4 + T * m * 4
        rows.append([f"T={T}", f"{ours * 1e6:.2f}", f"{base * 1e6:.2f}", f"{base / ours:.1f}x",
                     f"{nbytes / ours / 1e12:.2f}", f"{100 * nbytes / ours / H200_COPY_BW:.0f}%"])
    return markdown_table(["shape (n=4, C=7168)", "mhc_stats us", "torch composite us", "speedup",
                           "TB/s (X + phi)", "% of 4.3 TB/s"], rows)


def bench_parts():
    """The decode step's split: ``maps="pre"`` (the main stream's part) and ``"post_res"`` (the
    side stream's) against one ``"all"`` launch, at DeepSeek-V4-Flash's C = 4096 with its
    ``hc_eps``; the parts are checked bit-equal to ``"all"`` first. "critical path saved" is
    ``all - pre``: what the main stream no longer waits for when the side part is hidden."""
    rows = []
    m = num_maps(N)
    for T in (1, 6, 64, 384):
        xs, phi, alpha, bias = inputs(T, C=4096)
        rot = len(xs)
        ws = MhcStatsWorkspace(N, T)
        planes = {p: mhc_split_phi(phi, p) for p in ("all", "pre", "post_res")}
        H_all, H = torch.empty(T, m, device="cuda"), torch.full((T, m), float("nan"), device="cuda")

        def run(i, p, out):
            mhc_stats(xs[i], planes[p], alpha, bias, eps=EPS, hc_eps=1e-6, maps=p, workspace=ws, out=out)

        run(0, "all", H_all)
        run(0, "pre", H)
        run(0, "post_res", H)
        torch.cuda.synchronize()
        if not torch.equal(H, H_all):
            raise SystemExit(f"mhc_stats parts T={T}: not bit-equal to one launch; not timing them")
        t = {p: time_graph(lambda i, p=p: run(i, p, H), rot) for p in ("all", "pre", "post_res")}
        rows.append([f"T={T}", f"{t['all'] * 1e6:.2f}", f"{t['pre'] * 1e6:.2f}", f"{t['post_res'] * 1e6:.2f}",
                     f"{(t['all'] - t['pre']) * 1e6:.2f}"])
    return markdown_table(["shape (n=4, C=4096, hc_eps)", "all us", "pre us (main stream)",
                           "post_res us (side stream)", "critical path saved us"], rows)


def bench_mix():
    rows = []
    m = num_maps(N)
    for T in TS:
        rot = rotation_count(T * N * C * 2 * 2)
        xs = [torch.randn(T, N, C, device="cuda").bfloat16() for _ in range(rot)]
        fs = [torch.randn(T, C, device="cuda").bfloat16() for _ in range(rot)]
        h = torch.rand(T, m, device="cuda")
        u = torch.empty(T, C, device="cuda", dtype=torch.bfloat16)
        outs = [torch.empty_like(x) for x in xs]
        hres = h[:, 2 * N:].reshape(T, N, N)
        want_pre = torch.einsum("ti,tic->tc", h[:, :N], xs[0].float())
        want_post = torch.einsum("tij,tjc->tic", hres, xs[0].float()) + h[:, N:2 * N, None] * fs[0].float()[:, None, :]
        for got, want, name in ((mhc_pre_mix(xs[0], h, out=u), want_pre, "pre"),
                                (mhc_post_mix(xs[0], h, fs[0], out=outs[0]), want_post, "post")):
            if not ((got.float() - want).abs() <= 2 ** -7 * want.abs() + 1e-6).all():  # one bf16 rounding
                raise SystemExit(f"mhc_{name}_mix T={T}: output check failed; not timing it")
        pre = time_graph(lambda i: mhc_pre_mix(xs[i], h, out=u), rot)
        pre_b = time_graph(lambda i: torch.einsum("ti,tic->tc", h[:, :N], xs[i].float()).bfloat16(), rot)
        post = time_graph(lambda i: mhc_post_mix(xs[i], h, fs[i], out=outs[i]), rot)
        post_b = time_graph(lambda i: (torch.einsum("tij,tjc->tic", hres, xs[i].float())
                                       + h[:, N:2 * N, None] * fs[i].float()[:, None, :]).bfloat16(), rot)
        pre_bytes, post_bytes = T * N * C * 2 + T * C * 2, 2 * T * N * C * 2 + T * C * 2
        rows.append([f"T={T}", f"{pre * 1e6:.2f}", f"{pre_b * 1e6:.2f}", f"{pre_b / pre:.1f}x",
                     f"{100 * pre_bytes / pre / H200_COPY_BW:.0f}%", f"{post * 1e6:.2f}", f"{post_b * 1e6:.2f}",
                     f"{post_b / post:.1f}x", f"{100 * post_bytes / post / H200_COPY_BW:.0f}%"])
    return markdown_table(["shape", "pre-mix us", "torch us", "speedup", "% of 4.3 TB/s", "post-mix us", "torch us",
                           "speedup", "% of 4.3 TB/s"], rows)


def profile_overlap(T=64, max_ctas=None):

    xs, phi, alpha, bias = inputs(T)
    x = xs[0]
    planes = mhc_split_phi(phi)
    ws = MhcStatsWorkspace(N, T)
    H = torch.empty(T, num_maps(N), device="cuda")
    a = torch.randn(T, 16384, device="cuda").bfloat16()
    w = torch.randn(16384, C, device="cuda").bfloat16() / 128
    y = torch.empty(T, C, device="cuda", dtype=torch.bfloat16)
    side = SideStream()

    def stats():
        mhc_stats(x, planes, alpha, bias, eps=EPS, workspace=ws, out=H, max_ctas=max_ctas)

    def forked():
        with side.fork():
            stats()
        torch.matmul(a, w, out=y)
        side.join()

    def serial():
        stats()
        torch.matmul(a, w, out=y)

    kern = profiled_graph_kernels(forked, 20)
    st = [e.time_range for e in kern if "MhcStats" in e.name]
    others = [e.time_range for e in kern if "MhcStats" not in e.name]
    fr = overlap_fractions(st, others)
    sd, gd = median([e.elapsed_us() for e in st]), median([e.elapsed_us() for e in others])
    t_ser = time_graph(lambda i: serial(), 1, 10)
    t_par = time_graph(lambda i: forked(), 1, 10)
    t_gemm = time_graph(lambda i: torch.matmul(a, w, out=y), 1, 10)
    return [f"T={T}", str(max_ctas or "2/SM"), len(st), f"{sd:.1f}", f"{gd:.1f}",
            f"{100 * sum(fr) / max(len(fr), 1):.0f}%", f"{t_gemm * 1e6:.1f}", f"{t_ser * 1e6:.1f}",
            f"{t_par * 1e6:.1f}", f"{(t_ser - t_par) * 1e6:.1f}"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ov = [profile_overlap(T, mc) for T in (5, 64) for mc in (None, 32)]
    report(
        "mHC statistics / mixes", "python bench/bench_mhc.py", bench_stats(), "", bench_parts(), "", bench_mix(), "",
        "Side-stream overlap (replayed graph, torch profiler; main stream: WO-B GEMM [T,16384]x[16384,7168]):", "",
        markdown_table(["shape", "stats max_ctas", "stats kernels profiled", "stats us (median)", "GEMM us (median)",
                        "stats time overlapped", "GEMM alone us", "serial graph us", "forked graph us",
                        "saved us"], ov), out=args.out)


if __name__ == "__main__":
    main()
