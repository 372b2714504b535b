"""Benchmark the lightning indexer: scores + fused masking + top-k vs the torch composite.

    python bench/bench_indexer.py [--model v4|v3] [--out FILE]
    python bench/bench_indexer.py --select [--keys N,..] [--tokens T,..] [--out FILE]

``--model v4`` (default): DeepSeek-V4's CSA indexer -- compressed entries (one per 4 tokens,
``compress_ratio=4``) of contexts {16K, 128K, 1M} tokens, top-512 (V4-Flash) and top-1024
(V4-Pro); T = 5 (one DSpark verify block) and T = 64 * 5 (64 sequences, a block each).
``--model v3``: raw token keys S in {4096, 32768, 131072}, T = 6 and 64 * 6, top-2048.
H_I = 64, D_I = 128 in both. The composite is what an unfused implementation runs:
per-sequence bf16 bmm of the block's queries with the keys, FP32 upcast, ReLU, head-weighted
sum, then a separate causal/length mask pass (``torch.where`` against ``arange``) and
``torch.topk``. Before timing, each shape's selection is checked once against the
FP32 scores of the bf16 operands (every selected entry visible and within 1e-4 of the k-th score's
scale of it; the count of selected entries exact). The FP8 column runs the e4m3 variant
(per-key-row scales) on the same shapes; the token-group column scores 3 consecutive tokens
of a sequence per CTA (tokens reordered sequence-major, as the runtime lays them out). Key
caches rotate (>= 80 MB in all) so no launch reads keys another left in L2. CUDA-graph
replay, median of 20.

``--select``: the top-k select alone on V4's score rows (random FP32, compressed entries of 16K /
128K / 256K tokens of context, top-512 / 1024, T = 5 / 20 / 64 / 320) -- the streaming select
against every plan of the split select (the row in registers over a cluster of 1-8 CTAs; ``+a``:
its counts exchanged by red.async and mbarriers), each plan's output first checked equal to the
streaming select's; ``split_plan``'s pick and the best plan marked. Score rows rotate past L2.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import H200_BF16_FLOPS, markdown_table, report, rotation_count, time_graph  # noqa: E402

from cute_kernels.indexer_topk import IndexerWorkspace, indexer_select, indexer_topk  # noqa: E402
from cute_kernels.indexer_topk_split import CLUSTERS, ITEMS, THREADS, split_plan  # noqa: E402

H, D = 64, 128
ROTATE_BYTES = 80 * 2**20  # > the H200's 60 MB L2


def composite_scores(q, w, kc, n_seq, S, pos, ratio, exact=False):
    """[T, S] FP32 scores, -inf where the entry is not visible: the unfused path's first passes
    (bf16 bmm, so each logit is rounded to bf16 before the FP32 upcast). ``exact``: the check's
    reference instead -- FP32 products of the bf16 operands, no bf16 rounding of the logits."""
    T = q.shape[0]
    blk = T // n_seq
    keys = kc[: n_seq * S].view(n_seq, S, D)
    qs = q.view(blk, n_seq, H, D).transpose(0, 1).reshape(n_seq, blk * H, D)  # token t = b * n_seq + seq
    scores = []
    for g in range(0, n_seq, 8):  # groups of 8 sequences bound the [.., blk*H, S] temporaries
        qg, kg = (qs[g:g + 8].float(), keys[g:g + 8].float()) if exact else (qs[g:g + 8], keys[g:g + 8])
        logits = torch.bmm(qg, kg.transpose(1, 2)).float().relu()  # [g, blk*H, S]
        ww = w.view(blk, n_seq, H).transpose(0, 1)[g:g + 8]  # [g, blk, H]
        scores.append(torch.einsum("gbhs,gbh->gbs", logits.view(-1, blk, H, S), ww))
    sc = torch.cat(scores).transpose(0, 1).reshape(T, S)
    visible = (pos + 1) // ratio
    mask = torch.arange(S, device=q.device)[None, :] < visible[:, None]  # the separate masking pass
    return torch.where(mask, sc, torch.full_like(sc, float("-inf")))


def composite(q, w, kc, n_seq, S, pos, topk, ratio):
    return torch.topk(composite_scores(q, w, kc, n_seq, S, pos, ratio), topk, dim=-1).indices


def check_selection(idx, scores, topk, what):
    """Every selected entry visible, none above the k-th's score skipped (1e-4 of the scale), the
    count exact and the rest -1: the one output check before timing."""
    finite = torch.isfinite(scores)
    n_vis = finite.sum(1)
    want = n_vis.clamp(max=topk)
    valid = idx >= 0
    if not torch.equal(valid.sum(1), want):
        raise SystemExit(f"{what}: wrong number of selected entries")
    sel = torch.gather(scores, 1, idx.clamp(min=0).long())
    if not torch.isfinite(sel[valid]).all():
        raise SystemExit(f"{what}: a masked entry was selected")
    kth = torch.where(finite, scores, torch.full_like(scores, -3e38)).topk(topk, dim=1).values[:, -1]
    tol = 1e-4 * scores[finite].abs().max()
    low = (sel < (kth[:, None] - tol)) & valid & (n_vis[:, None] > topk)
    if low.any():
        raise SystemExit(f"{what}: a selected entry scores below the k-th")


def label(plan: tuple) -> str:
    """``CxI`` for a split plan of C CTAs of I keys a thread; ``+a`` with its counts by red.async."""
    return f"{plan[0]}x{plan[1]}" + ("+a" if len(plan) == 3 and plan[2] else "")


SELECT_ROWS = ((4096, 512), (32768, 512), (32768, 1024), (65536, 1024))
SELECT_TOKENS = (5, 20, 64, 320)


def select_main(out: str | None, keys=None, tokens=SELECT_TOKENS):
    """The streaming select against the split select's plans (module docstring, ``--select``);
    ``keys``: only the rows of these N."""
    rows = []
    for N, k in SELECT_ROWS:
        if keys and N not in keys:
            continue
        for T in tokens:
            n = rotation_count(T * N * 4)
            wss = [IndexerWorkspace(T, N) for _ in range(n)]
            for w in wss:
                w.scores.copy_(torch.randn(T, N, device="cuda"))
            ln = torch.full((T,), N, dtype=torch.int32, device="cuda")
            pos = torch.full((T,), 4 * N + 3, dtype=torch.int32, device="cuda")  # every entry visible
            outs = [torch.empty(T, k, dtype=torch.int32, device="cuda") for _ in range(n)]
            plans = [None] + [(c, i) for c in CLUSTERS for i in ITEMS if N <= c * THREADS * i <= 4 * N]
            plans += [(c, i, True) for c, i in plans[1:] if c > 1]  # the counts by red.async and mbarriers
            kw = dict(topk=k, compress_ratio=4)
            want = indexer_select(wss[0], ln, pos, plan=None, **kw).clone()
            if not torch.equal(want.long(), torch.topk(wss[0].scores, k).indices.sort(-1).values):
                raise SystemExit(f"T={T} N={N} k={k}: the streaming select differs from torch.topk")
            times = {}
            for plan in plans:
                if not torch.equal(indexer_select(wss[0], ln, pos, plan=plan, **kw), want):
                    raise SystemExit(f"T={T} N={N} k={k}: plan {plan} selects other entries")
                times[plan] = time_graph(lambda i, plan=plan: indexer_select(wss[i], ln, pos, plan=plan, out=outs[i],
                                                                             **kw), n, max(n, 20))
            best = min((p for p in plans if p is not None), key=times.get)
            auto = split_plan(T, N)
            auto = auto if auto is None or auto[2] else auto[:2]  # (the key its time is under)
            rows.append([f"T={T} N={N} k={k}", f"{times[None] * 1e6:.2f}",
                         " ".join(f"{label(p)}:{times[p] * 1e6:.2f}" for p in plans[1:]),
                         label(best), label(auto) if auto else "streaming",
                         f"{times[None] / times[auto] if auto else 1.0:.2f}x"])
            print(rows[-1], flush=True)
    table = markdown_table(["shape (random FP32 rows, all visible)", "streaming us",
                            "split us by plan (cluster x items, +a: async counts)", "best plan", "split_plan's pick",
                            "streaming / pick"], rows)
    report("The indexer's top-k select: streaming against split", "python bench/bench_indexer.py --select", table,
           out=out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=("v4", "v3"), default="v4",
                    help="v4: compressed entries, top-512 / top-1024; v3: raw keys, top-2048 (default: v4)")
    ap.add_argument("--select", action="store_true",
                    help="the top-k select alone: the streaming select against the split select's plans")
    ap.add_argument("--keys", default=None,
                    help="with --select: only the rows of these N (comma-separated; default: "
                         + ", ".join(str(n) for n in sorted({n for n, _ in SELECT_ROWS})) + ")")
    ap.add_argument("--tokens", default=",".join(map(str, SELECT_TOKENS)),
                    help="with --select: the token counts T (default: %(default)s)")
    ap.add_argument("--out", default=None, help="also write the markdown table here (default: none)")
    args = ap.parse_args()
    if args.select:
        return select_main(args.out, keys={int(n) for n in args.keys.split(",")} if args.keys else None,
                           tokens=[int(t) for t in args.tokens.split(",")])
    if args.model == "v4":  # (tokens of context, entries per sequence, block, k, model)
        ratio, block = 4, 5
        cases = [(ctx, ctx // 4, k, name) for ctx in (16384, 131072, 1048576)
                 for k, name in ((512, "Flash"), (1024, "Pro"))]
    else:
        ratio, block = 1, 6
        cases = [(S, S, 2048, "V3") for S in (4096, 32768, 131072)]
    rows, refused = [], []
    for ctx, S, K, name in cases:
        for n_seq in (1, 64):
            T = block * n_seq
            # key caches rotated so that each launch reads keys not left in L2 (60 MB) by the last
            n_rot = max(1, min(64, -(-ROTATE_BYTES // (n_seq * S * D * 2))))
            kcs = [torch.randn(n_seq * S, D, device="cuda").bfloat16() for _ in range(n_rot)]
            q = (torch.randn(T, H, D, device="cuda") / 4).bfloat16()
            w = torch.randn(T, H, device="cuda")
            seq = torch.arange(T, device="cuda") % n_seq
            off = (seq * S).int()
            ln = torch.full((T,), S, dtype=torch.int32, device="cuda")
            pos = (ctx - block + torch.arange(T, device="cuda") // n_seq).int()
            ws = IndexerWorkspace(T, S)
            out = torch.empty(T, K, dtype=torch.int32, device="cuda")
            kw = dict(topk=K, max_keys=S, out=out, workspace=ws, compress_ratio=ratio)
            what = f"{name} ctx={ctx} T={T}"
            try:
                indexer_topk(q, w, kcs[0], off, ln, pos, **kw)
            except ValueError as e:  # a shape the kernel refuses (e.g. 64 x 1M-token contexts: > 2^31 key elements)
                rows.append([f"{what} N={S} k={K}"] + ["n/a"] * 8)
                print(f"{what}: {e}", flush=True)
                refused.append(f"{what}: {e}")
                del kcs
                torch.cuda.empty_cache()
                continue
            check_selection(indexer_topk(q, w, kcs[0], off, ln, pos, **kw).clone(),
                            composite_scores(q, w, kcs[0], n_seq, S, pos, ratio, exact=True), K, what)
            reps = max(n_rot, 3)
            ours = time_graph(lambda i: indexer_topk(q, w, kcs[i], off, ln, pos, use_wgmma=False, **kw),
                              n_rot, reps, trials=20)
            wg = time_graph(lambda i: indexer_topk(q, w, kcs[i], off, ln, pos, use_wgmma=True, **kw),
                            n_rot, reps, trials=20)
            # the runtime's token-major layout (a verify block's tokens consecutive), groups of 3
            # tokens per CTA sharing one key tile (indexer_scores_token_group_sm90; the runtime's default)
            order = torch.sort(off, stable=True).indices
            q_tm, w_tm, off_tm, pos_tm = (x[order].contiguous() for x in (q, w, off, pos))
            grp = time_graph(lambda i: indexer_topk(q_tm, w_tm, kcs[i], off_tm, ln, pos_tm, token_group=3, **kw),
                             n_rot, reps, trials=20)
            # FP8 variant (DeepSeek's): e4m3 q and keys, a per-key-row scale, the heads' scales in w
            q8 = q.to(torch.float8_e4m3fn)
            kc8s = [kc.to(torch.float8_e4m3fn) for kc in kcs]
            ks = torch.rand(n_seq * S, device="cuda") + 0.5
            f8 = time_graph(lambda i: indexer_topk(q8, w, kc8s[i], off, ln, pos, k_scale=ks, **kw),
                            n_rot, reps, trials=20)
            base = time_graph(lambda i: composite(q, w, kcs[i], n_seq, S, pos, K, ratio), n_rot, reps, trials=20)
            flops = 2.0 * T * H * D * S
            best = min(ours, wg, grp)
            rows.append([f"{what} N={S} k={K}", f"{ours * 1e6:.1f}", f"{wg * 1e6:.1f}", f"{grp * 1e6:.1f}",
                         f"{f8 * 1e6:.1f}", f"{base * 1e6:.1f}", f"{base / best:.2f}x",
                         f"{flops / best / 1e12:.0f}", f"{100 * flops / best / H200_BF16_FLOPS:.0f}%"])
            print(rows[-1], flush=True)
            del kcs, kc8s, ws
            torch.cuda.empty_cache()
    title = ("DeepSeek-V4 CSA indexer (compressed entries, scores + masking + top-k)" if args.model == "v4"
             else "Lightning indexer, raw keys (scores + masking + top-2048)")
    table = markdown_table(["shape (H_I=64, D_I=128; N entries per sequence)", "ours us (warp-MMA scores + select)",
                            "ours us (wgmma scores + select)", "ours us (wgmma, groups of 3 tokens, token-major)",
                            "ours us (FP8 scores + select)", "torch composite us", "speedup (best bf16)",
                            "score TFLOP/s (best)", "% of 790 TFLOP/s"], rows)
    refusals = [""] + [f"Refused (a named ValueError before launch): {r}" for r in refused] if refused else []
    report(title, f"python bench/bench_indexer.py --model {args.model}", table, *refusals, out=args.out)


if __name__ == "__main__":
    main()
