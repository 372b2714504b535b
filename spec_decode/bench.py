"""``python -m spec_decode.bench``: the decode runtime's benchmark tables (H200).

    python -m spec_decode.bench [--model v4_flash_slice|v4_pro_slice|small|tiny] [--backends base,fused]
                                [--quick]
                                [--out bench/spec_decode.md]

Per backend, side by side (same seeded weights, same fixed input ids -- their hash is
printed). The default pair is the reference PR's comparison: ``base`` (the fused arm's number
formats and expert kernels with the PR's fusions undone, :class:`spec_decode.fused_ops.BaseOps`)
against ``fused``; ``torch-bf16`` is the bf16 PyTorch arm (bf16 experts: other formats).

* BS1, input 4096 / output 1024: output tok/s after the first token;
* BS64, input 4096 / output 2048: decode tok/s (after every first token) and full-batch
  tok/s including the (eager, unoptimised) prefill;
* median acceptance length; median target-verify and draft graph replay times at BS1 and BS64 (CUDA events
  around each replay); kernels per verify / draft graph replay (profiled);
* each graph's roofline: the bytes the step must move at least (:func:`step_bytes`: weights
  touched, state rows read, activations) over its replay time, as a fraction of 4.3 TB/s and
  of this card's copy bandwidth measured at the start of the run (:func:`card_copy_bandwidth`);
* token agreement with the first backend (same prompts and weights): the fraction of
  generated tokens equal to its tokens (free-running greedy continuations part at the first
  near-tie), and teacher-forced -- request 0 of each case: this backend's greedy token at each
  position given the first backend's prompt and output before it (the first backend's own
  column compares its eager prefill forward with its graph-generated tokens), and the two
  backends' teacher-forced picks against each other (both eager over the same tokens: the
  backends' numerics alone), where they differ counting the near-ties in the first backend's
  logits (:func:`teacher_forced_comparison`), and how far each backend's teacher-forced FP32
  logits are from the first's (:func:`logit_difference`; ``python -m spec_decode.numerics``
  says which ops' roundings differ);
* at BS1, from a trace of 20 draft + verify replays: the graph medians, target start to next
  target start, the mHC statistics' overlap with other kernels, and where the median verify
  replay's time goes -- this project's CuTe kernels, cuBLAS GEMMs, other PyTorch kernels, and
  the time no kernel ran (:func:`kernel_origin`);
* kernel launches per family over 20 verify + draft cycles (one eager verify step -- what
  its graph replays -- profiled: torch kernels inside each family's range plus this
  project's kernels by class name, times 20; the draft step has no MoE families).

Random weights make the draft's proposals near-random, so the real acceptance length is ~1
and both paths do the same number of verify steps -- tok/s compare the step costs.
``--acceptance-length 5.5`` draws the accepted count on the device instead (the reference PR
measured 5.4-5.8): the multi-token accept path runs and tok/s become a block-5 server's. ``--quick``
shrinks the runs (input 512 / output 64) for a smoke test. ``--model v4_flash_slice`` (the
default) has DeepSeek-V4-Flash's per-layer shapes and one layer of every kind
(:data:`spec_decode.config.V4_FLASH_SLICE`); ``small`` is the smallest config every fused kernel
accepts (``tiny`` is CPU-test sized: torch-bf16 only).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import math
import os
import random
import statistics
import sys
import time

import torch

from cute_kernels.profiling import copy_bandwidth, cuda_profile
from cute_kernels.progress import progress

from .config import PRESETS, EngineConfig
from .engine import DRAFT_HEADS, Engine
from .model import layer_weight_shapes

FAMILIES = ("router top-k / padding", "ID packing (sort / scatter)", "standalone finalize", "shared-expert add",
            "fused finalize (+ shared add)", "all-reduce")
#: (as the reference PR counts: with TP on the fused backend the MoE's finalize + shared add +
#: all-reduce is one kernel, counted under "fused finalize (+ shared add)" only; "all-reduce"
#: counts the other, plain push all-reduces)


def prompts(n, length, vocab, seed=0):
    rng = random.Random(seed)
    ids = [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]
    return ids, hashlib.sha256(repr(ids).encode()).hexdigest()[:16]


GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64)
#: the H200's measured copy bandwidth (bench/RESULTS.md), the roofline's denominator
HBM_BYTES_PER_S = 4.3e12
_CARD_COPY_BW: list[float] = []


def card_copy_bandwidth() -> float:
    """This card's copy bandwidth (:func:`cute_kernels.profiling.copy_bandwidth`), measured once
    per process, before any engine is built -- the roofline's second denominator, beside 4.3
    TB/s, for a card other than the H200."""
    if not _CARD_COPY_BW:
        _CARD_COPY_BW.append(copy_bandwidth())
    return _CARD_COPY_BW[0]


def estimate_bytes(m, slots: int, max_len: int, backend: str) -> int:
    """Device memory of one engine, roughly: bf16 weights (target layers, the draft's stages,
    embedding and head; the fused engine's routed experts as MXFP8 copies, +3% scales,
    instead) and the decode state. Activations and graphs come on top."""
    def numel(shapes):
        return sum(math.prod(s) for s in shapes.values())

    E, I, C = m.experts, m.expert_inter, m.hidden
    layers = sum(numel(layer_weight_shapes(m, li, hash_routed=m.is_hash(li), ratio=m.ratio(li)))
                 for li in range(m.layers))
    stage = numel(layer_weight_shapes(m, None, hash_routed=False, ratio=0))
    n_moe = m.layers + m.draft_stages
    weights = 2 * (layers + m.draft_stages * stage + 2 * m.vocab * C + 3 * C * C)
    fused = 0
    if backend in ("base", "fused"):
        # routed experts as MXFP8 (+3% scales) for bf16; the shared expert's gate | up and each
        # compressor's kv | gate side by side (bf16 copies FusedOps keeps)
        fused = int(1.03 * n_moe * 3 * E * I * C) - 2 * n_moe * 3 * E * I * C
        fused += 2 * n_moe * 2 * m.shared_inter * C
        for li in range(m.layers):
            shapes = layer_weight_shapes(m, li, hash_routed=m.is_hash(li), ratio=m.ratio(li))
            fused += 2 * sum(math.prod(v) for k, v in shapes.items() if k.endswith(("wkv.weight", "wgate.weight"))
                             and "compressor" in k)
    hd, D = m.head_dim, m.indexer_dim
    state = 0
    for li in range(m.layers):
        r = m.ratio(li)
        state += (m.window + 8) * hd
        if r == m.csa_ratio:  # rings of span 2m (+ lookahead) of kv | gate at 2 x width; pools
            state += (max_len // r + 1) * (hd + D) + (2 * r + 8) * 4 * (hd + D)
        elif r:
            state += (max_len // r + 1) * hd + (r + 8) * 2 * hd
    state += m.draft_stages * (m.window + 15) * hd  # + the discarded row, + a draft block's rows
    return weights + fused + 2 * slots * state


def build_engine(backend, model, batch, n_in, n_out, **engine) -> "Engine | str":
    """An engine for one case, compiled and its graphs captured for every padded batch size
    up to ``batch`` (requests finish at different steps, so a run steps down through them; no
    clock may see a compile or a capture), or why not (it would not fit the device) as a
    string."""
    sizes = tuple(s for s in GRAPH_SIZES if s < batch) + (next(s for s in GRAPH_SIZES if s >= batch),)
    cfg = EngineConfig(model=model, device="cuda", dtype="bfloat16", backend=backend,
                       max_seq_len=n_in + n_out + 16, graph_batch_sizes=sizes, **engine)
    need = estimate_bytes(model, cfg.max_batch + 1, cfg.max_seq_len, backend)
    have = torch.cuda.get_device_properties(0).total_memory
    if need > 0.92 * have:
        return f"needs ~{need / 2**30:.0f} GiB of the device's {have / 2**30:.0f} GiB (weights + state)"
    eng = Engine(cfg)
    for size in sizes:
        eng.warm_up(size)
    return eng


def sweep_acceptance(backends, model, cases, lengths, **engine) -> list[tuple]:
    """Decode tok/s of each backend and case at each synthetic acceptance length (one engine
    per backend and case, :meth:`Engine.set_acceptance_length` between runs): rows
    ``(backend, case, requested, achieved mean, decode tok/s)``."""
    rows = []
    for b in backends:
        for name, bs, n_in, n_out in cases:
            eng = build_engine(b, model, bs, n_in, n_out, **engine)
            if isinstance(eng, str):
                print(f"[{b}: {name}: {eng}]", flush=True)
                continue
            ids, _ = prompts(bs, n_in, model.vocab)
            for L in lengths:
                eng.set_acceptance_length(L)
                out = eng.generate(ids, n_out)
                st, n = eng.stats, sum(len(o) for o in out)
                acc = st.acceptance_lengths
                rows.append((b, name, L, sum(acc) / len(acc) if acc else float("nan"),
                             (n - bs) / (st.t_end - st.t_first)))
                print(f"[{b}: {name}: acceptance {L}: {rows[-1][-1]:.1f} tok/s]", flush=True)
            del eng
            gc.collect()
            torch.cuda.empty_cache()
    return rows


def write_sweep(rows, csv_path: str, png_path: str | None, title: str) -> str:
    """The sweep as CSV, and as a PNG (one panel per case, tok/s vs acceptance length, a line
    per backend) where matplotlib is installed; returns a note of what was written."""
    with open(csv_path, "w") as f:
        f.write("backend,case,acceptance_requested,acceptance_achieved,decode_tok_s\n")
        for r in rows:
            f.write(",".join([r[0], r[1], f"{r[2]:g}", f"{r[3]:.3f}", f"{r[4]:.1f}"]) + "\n")
    if png_path is None:
        return f"wrote {csv_path}"
    return plot_sweep(csv_path, png_path, title)


def plot_sweep(csv_path: str, png_path: str, title: str = "") -> str:
    """Draw a sweep's CSV (:func:`write_sweep`) as a PNG; any machine with matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return (f"wrote {csv_path}; matplotlib is not installed here, plot it elsewhere: "
                f"python -m spec_decode.bench --plot-from {csv_path} --plot {png_path}")
    lines = open(csv_path).read().strip().split("\n")[1:]
    data: dict = {}
    for line in lines:
        b, case, _, achieved, tps = line.split(",")
        data.setdefault(case, {}).setdefault(b, []).append((float(achieved), float(tps)))
    fig, axes = plt.subplots(1, len(data), figsize=(5.5 * len(data), 4), squeeze=False)
    for ax, (case, per) in zip(axes[0], data.items()):
        for b, pts in per.items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=b)
        ax.set_title(case)
        ax.set_xlabel("acceptance length (achieved mean)")
        ax.set_ylabel("decode tok/s")
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png_path, dpi=80)
    plt.close(fig)
    try:  # a 64-colour palette: a line plot loses nothing visible, the file a third of the size
        from PIL import Image
        Image.open(png_path).convert("RGB").quantize(colors=64).save(png_path, optimize=True)
    except ImportError:
        pass
    return f"wrote {csv_path} and {png_path}"


#: positions of request 0 whose yardstick logits the table keeps (to judge differing picks)
TEACHER_LOGIT_ROWS = 128


def teacher_forced_comparison(yard: dict, other: dict) -> tuple[float, int, int]:
    """Two backends' teacher-forced picks over the yardstick's tokens (both eager forwards of
    the same sequence, so neither is judged against the other's graph path): the fraction
    equal, and of the differing picks within the yardstick's kept logits, (how many, how many
    of those are near-ties -- the other pick's logit within a quarter of the row's std of the
    row's maximum, a gap rounding can close; a wrong kernel picks tokens whole stds down)."""
    a, b = yard["teacher_picks"], other["teacher_picks"]
    equal = sum(x == y for x, y in zip(a, b)) / max(len(a), 1)
    lg = yard["teacher_logits"]
    diff = [i for i in range(min(len(lg), len(b))) if a[i] != b[i]]
    ties = sum(float(lg[i].max() - lg[i, b[i]]) <= 0.25 * float(lg[i].std()) for i in diff)
    return equal, len(diff), ties


def logit_difference(yard: dict, other: dict) -> tuple[float, float]:
    """Median and largest over positions of ``|other - yard| / |yard|`` (norms of a position's
    teacher-forced logits): the two backends' numbers on the same sequence."""
    a, b = yard["teacher_logits"], other["teacher_logits"]
    n = min(len(a), len(b))
    rel = ((b[:n] - a[:n]).norm(dim=-1) / a[:n].norm(dim=-1).clamp_min(1e-30)).tolist()
    return statistics.median(rel), max(rel)


def run_case(backend, model, batch, n_in, n_out, reference=None, **engine):
    """One (backend, case) run; ``engine``: further EngineConfig fields (prefill_chunk, ...).
    ``reference``: another backend's generated tokens for the same prompts (None: this run's
    own) -- request 0's are teacher-forced through this engine (:meth:`Engine.greedy_given`)."""
    eng = build_engine(backend, model, batch, n_in, n_out, **engine)
    if isinstance(eng, str):
        return {"error": eng}
    cfg = eng.config
    ids, digest = prompts(batch, n_in, model.vocab)
    eng.verify_graphs.timing = eng.draft_graphs.timing = True
    out = eng.generate(ids, n_out)
    torch.cuda.synchronize()
    st = eng.stats
    n = sum(len(o) for o in out)
    res = dict(synthetic=cfg.acceptance_length is not None, hash=digest,
               decode_tps=(n - batch) / (st.t_end - st.t_first), full_tps=n / (st.t_end - st.t_start),
               acceptance=st.median_acceptance,
               mean_acceptance=(sum(st.acceptance_lengths) / len(st.acceptance_lengths)
                                if st.acceptance_lengths else float("nan")),
               verify_ms=statistics.median(eng.verify_graphs.replay_times_ms() or [float("nan")]),
               draft_ms=statistics.median(eng.draft_graphs.replay_times_ms() or [float("nan")]),
               verify_nodes=eng.verify_graphs.kernels_per_replay(batch),
               draft_nodes=eng.draft_graphs.kernels_per_replay(batch), tokens=out)
    res["launches"] = count_families(eng, batch)
    K, ctx = cfg.block_size, n_in + n_out // 2  # the mean context of the run
    for key, width, draft in (("verify", K + 1, False), ("draft", K, True)):
        need = step_bytes(model, batch, width, ctx, draft=draft)["total"]
        bytes_per_s = need / (res[f"{key}_ms"] * 1e-3)
        res[f"{key}_roofline"] = bytes_per_s / HBM_BYTES_PER_S
        res[f"{key}_roofline_card"] = bytes_per_s / card_copy_bandwidth()
    if batch == 1:
        try:  # the reference PR's trace metrics (BS1); a failure here keeps the other numbers
            res.update(timeline(eng, batch))
        except Exception as e:  # noqa: BLE001
            res["timeline_error"] = f"{type(e).__name__}: {e}"
    if cfg.acceptance_length is not None:
        # Synthetic acceptance keeps drafts the target would not have chosen: its outputs are no
        # greedy continuation. The agreement rows compare request 0's continuation with the
        # draft's real acceptance (the target's greedy tokens) instead.
        eng.set_acceptance_length(None)
        res["tokens"] = eng.generate(ids[:1], min(n_out, 128))
        eng.set_acceptance_length(cfg.acceptance_length)
    ref = (reference or res["tokens"])[0]
    # FP32 logits over the yardstick's first positions: where another backend's picks differ, how
    # near a tie; and how far each backend's logits are from the yardstick's. Their argmax is
    # the teacher-forced picks there; a longer continuation takes a second, argmax-only pass.
    res["teacher_logits"] = eng.logits_given(ids[0], ref[:TEACHER_LOGIT_ROWS]).cpu()
    res["teacher_picks"] = (res["teacher_logits"].argmax(-1).tolist() if len(ref) <= TEACHER_LOGIT_ROWS
                            else eng.greedy_given(ids[0], ref))
    res["teacher_forced"] = sum(a == b for a, b in zip(res["teacher_picks"], ref)) / len(ref)
    del eng  # free the weights, state and graph pools before the next case
    gc.collect()
    torch.cuda.empty_cache()
    return res


#: this project's kernels by class name (CuTe DSL launches carry no CPU-op correlation in a
#: torch profile, so they are not inside the family ranges): the router kernel does top-k,
#: padding and ID packing in one launch
#: (the first name found in a kernel's name decides; the push all-reduce kernel is named
#: ``FinalizeSharedAllReduce`` when it also finalizes and adds the shared expert)
CUTE_FAMILIES = {"RouterTopkAlign": "router top-k / padding",
                 "FinalizeSharedAllReduce": "fused finalize (+ shared add)",
                 "FinalizeShared": "fused finalize (+ shared add)", "MoeFinalize": "standalone finalize",
                 "PushAllReduce": "all-reduce"}


def cute_family(kernel_name: str) -> str | None:
    """The launch family of one of this project's kernels by its name (the DSL names a kernel
    after its class, or the string its configuration object gives), or None."""
    return next((f for cls, f in CUTE_FAMILIES.items() if cls in kernel_name), None)


#: a traced kernel's origin, for the verify replay's time breakdown
KERNEL_ORIGINS = ("cute", "gemm", "torch")


def kernel_origin(name: str) -> str:
    """``cute``: this project's CuTe DSL kernels; ``gemm``: cuBLAS / cuBLASLt GEMMs (the
    projections both arms run through torch); ``torch``: every other PyTorch kernel (norms,
    RoPE, gathers, the compressors, the attention's softmax, copies)."""
    if name.startswith("kernel_cutlass"):
        return "cute"
    low = name.lower()
    if any(s in low for s in ("gemm", "nvjet", "xmma", "cublas", "cutlass", "splitk")):
        return "gemm"
    return "torch"


def kernel_table(kernels) -> list[tuple[str, int, float]]:
    """One replay's kernels grouped by name: ``(name, launches, total ms)``, the longest total
    first (names cut to 90 characters: CuTe DSL names carry their whole signature)."""
    rows: dict[str, list] = {}
    for k in kernels:
        r = rows.setdefault(k.name[:90], [0, 0.0])
        r[0] += 1
        r[1] += (k.time_range.end - k.time_range.start) * 1e-3
    return sorted(((n, c, t) for n, (c, t) in rows.items()), key=lambda r: -r[2])


def kernel_lines(backends: list[str], case: str, results: dict) -> list[str]:
    """Markdown tables of :func:`kernel_table` for the BS1 case's median verify and draft
    replays of each backend: where a graph's time goes, kernel by kernel."""
    lines = []
    for b in backends:
        res = results.get((b, case), {})
        for graph in ("verify", "draft"):
            rows = res.get(f"kernels_{graph}")
            if not rows:
                continue
            total = sum(t for _, _, t in rows)
            lines += ["", f"### {b}: {graph} graph, {case} (median replay; kernel time {total:.3f} ms)", "",
                      "| kernel | launches | ms | % |", "|---|---|---|---|"]
            lines += [f"| `{n}` | {c} | {t:.4f} | {100 * t / total:.1f} |" for n, c, t in rows]
    return lines


def timeline(eng, batch: int, cycles: int = 20) -> dict:
    """Trace metrics like the reference PR's: ``cycles`` draft + verify graph replays (the
    graphs captured for ``batch``, run on the scratch slot) under the CUDA profiler. The kernel
    stream is cut into replays by the graphs' kernel counts; returns the verify / draft replay
    medians (first kernel start to last kernel end), the median target-start to next
    target-start, and the mHC statistics kernels' overlap with other kernels (the fraction of
    their duration during which another kernel ran)."""
    dev, K = eng.config.device, eng.config.block_size
    nv, nd = eng.verify_graphs.kernels_per_replay(batch), eng.draft_graphs.kernels_per_replay(batch)
    slots = torch.full((batch,), eng.scratch_slot, dtype=torch.long, device=dev)
    one = torch.zeros(batch, 1, dtype=torch.long, device=dev)
    block = torch.zeros(batch, K + 1, dtype=torch.long, device=dev)
    feats = torch.zeros(batch, K + 1, eng.feat_dim, dtype=eng.model.dtype, device=dev)
    none = torch.zeros(batch, dtype=torch.long, device=dev)
    timing = eng.verify_graphs.timing, eng.draft_graphs.timing
    eng.verify_graphs.timing = eng.draft_graphs.timing = False
    torch.cuda.synchronize()
    with cuda_profile() as prof:
        for _ in range(cycles):
            eng.draft_graphs.run(one, one, slots, feats, none)
            eng.verify_graphs.run(block, block, slots)
        torch.cuda.synchronize()
    eng.verify_graphs.timing, eng.draft_graphs.timing = timing
    kern = sorted((e for e in prof.events() if e.device_type.name == "CUDA" and "emcpy" not in e.name
                   and "emset" not in e.name), key=lambda e: e.time_range.start)
    if len(kern) != cycles * (nv + nd):
        raise RuntimeError(f"{len(kern)} kernels traced, expected {cycles} x ({nd} + {nv})")
    spans = lambda ks: (min(k.time_range.start for k in ks), max(k.time_range.end for k in ks))  # noqa: E731
    drafts, verifies = [], []
    for c in range(cycles):
        base = c * (nv + nd)
        drafts.append(spans(kern[base:base + nd]))
        verifies.append(spans(kern[base + nd:base + nd + nv]))
    starts = [v[0] for v in verifies]
    mhc = [k for k in kern if "MhcStats" in k.name]
    # the stream most kernels ran on (the graphs' main stream): mHC time on other streams is
    # the fused arm's side part (H_post / H_res)
    ids = [k.device_resource_id for k in kern]
    main_id = max(set(ids), key=ids.count) if ids else None
    side = sum(k.time_range.end - k.time_range.start for k in mhc if k.device_resource_id != main_id)
    overlap = dur = 0.0
    for k in mhc:
        a, z = k.time_range.start, k.time_range.end
        cover = [(max(a, o.time_range.start), min(z, o.time_range.end)) for o in kern
                 if o is not k and o.time_range.end > a and o.time_range.start < z]
        cover.sort()
        covered, cur = 0.0, a
        for lo, hi in cover:  # the union of the other kernels' intervals inside this one
            lo = max(lo, cur)
            if hi > lo:
                covered += hi - lo
                cur = hi
        overlap += covered
        dur += z - a
    us = 1e-3  # profiler times are in us; report ms
    # Where a verify replay's time goes: the median replay's kernel time by origin, and the
    # time no kernel of it ran (launch gaps between dependent nodes)
    mid = sorted(range(cycles), key=lambda c: verifies[c][1] - verifies[c][0])[cycles // 2]
    vk = kern[mid * (nv + nd) + nd:(mid + 1) * (nv + nd)]
    split, count = dict.fromkeys(KERNEL_ORIGINS, 0.0), dict.fromkeys(KERNEL_ORIGINS, 0)
    for k in vk:
        o = kernel_origin(k.name)
        split[o] += k.time_range.end - k.time_range.start
        count[o] += 1
    busy, cur = 0.0, verifies[mid][0]
    for k in sorted(vk, key=lambda k: k.time_range.start):  # the union of the replay's kernel intervals
        lo, hi = max(k.time_range.start, cur), k.time_range.end
        if hi > lo:
            busy += hi - lo
            cur = hi
    breakdown = {f"verify_{o}_ms": t * us for o, t in split.items()}
    mid_d = sorted(range(cycles), key=lambda c: drafts[c][1] - drafts[c][0])[cycles // 2]
    breakdown["kernels_verify"] = kernel_table(vk)
    breakdown["kernels_draft"] = kernel_table(kern[mid_d * (nv + nd):mid_d * (nv + nd) + nd])
    breakdown["verify_mix"] = " / ".join(str(count[o]) for o in KERNEL_ORIGINS)
    breakdown["verify_idle_ms"] = (verifies[mid][1] - verifies[mid][0] - busy) * us
    return {**breakdown, "trace_verify_ms": statistics.median(z - a for a, z in verifies) * us,
            "trace_draft_ms": statistics.median(z - a for a, z in drafts) * us,
            "target_to_target_ms": statistics.median(b - a for a, b in zip(starts, starts[1:])) * us,
            "mhc_overlap": overlap / dur if dur else float("nan"),
            "mhc_side": side / dur if dur else float("nan")}


def token_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of generated positions (per request, up to the shorter output) holding the
    same token -- greedy continuations diverge after a first differing token, so this is
    a lower bound on per-step agreement."""
    pairs = [(x, y) for p, q in zip(a, b) for x, y in zip(p, q)]
    return sum(x == y for x, y in pairs) / max(len(pairs), 1)


def count_families(eng, batch, cycles=20):
    """Kernels per op family in one eager verify step at ``batch``, times ``cycles`` (a replayed
    verify graph runs exactly the kernels its eager capture launched; the draft step has no MoE
    families): torch kernels launched inside each family's profiler range
    (:func:`spec_decode.step_model.family`), plus this project's CuTe kernels by class name in
    one replay of the captured verify graph (the eager step where nothing is captured)."""
    K = eng.config.block_size
    dev = "cuda"
    tok = torch.zeros(batch, K + 1, dtype=torch.long, device=dev)
    pos = torch.arange(K + 1, device=dev)[None].expand(batch, -1).contiguous()
    slots = torch.arange(batch, device=dev)
    eng.step.forward(tok, pos, slots, eng.state)  # warm (compiles) outside the profile
    torch.cuda.synchronize()
    with cuda_profile(cpu=True) as prof:
        eng.step.forward(tok, pos, slots, eng.state)
        torch.cuda.synchronize()

    def torch_kernels(ev):
        own = sum(not k.name.startswith("kernel_cutlass") for k in ev.kernels)
        return own + sum(torch_kernels(c) for c in ev.cpu_children)

    # this project's kernels from one replay of the captured verify graph where there is one:
    # what the step runs (simulated TP ranks push only inside graphs; eagerly they sum on threads)
    kernels = prof.events()
    if eng.verify_graphs.use_graphs:
        eng.verify_graphs.run(tok, pos, slots)
        torch.cuda.synchronize()
        with cuda_profile() as replay:
            eng.verify_graphs.run(tok, pos, slots)
            torch.cuda.synchronize()
        kernels = replay.events()
    counts = dict.fromkeys(FAMILIES, 0)
    for ev in prof.events():
        if ev.name.startswith("family::") and (ev.cpu_parent is None or not ev.cpu_parent.name.startswith("family::")):
            fam = ev.name[len("family::"):]
            counts[fam] = counts.get(fam, 0) + torch_kernels(ev)
    for ev in kernels:
        if ev.device_type.name == "CUDA" and ev.name.startswith("kernel_cutlass"):
            fam = cute_family(ev.name)
            if fam is not None:
                counts[fam] += 1
    return {fam: n * cycles for fam, n in counts.items()}


def card_bw_tb() -> str:
    """The measured copy bandwidth the ``*_roofline_card`` rows divide by, for their label."""
    return f"{_CARD_COPY_BW[0] / 1e12:.2f} TB/s" if _CARD_COPY_BW else "not measured"


def table_lines(backends: list[str], cases: list[tuple], results: dict) -> list[str]:
    """The Markdown table (and error lines) of ``results[(backend, case name)]`` as ``run_case``
    returns them, one column per backend, ``cases`` as (name, batch, input, output) with the
    BS1 case first."""
    header = "| metric | " + " | ".join(backends) + " |"
    lines = [header, "|" + "---|" * (len(backends) + 1)]

    def cell(b, name, key, fmt="{:.1f}"):
        r = results.get((b, name), {})
        if "error" in r:
            return "n/a"
        v = r.get(key)
        # statistics.median of ints is an int when the count is odd: format numbers alike
        return "-" if v is None else (fmt.format(v) if isinstance(v, (int, float)) and not isinstance(v, bool)
                                      else str(v))

    bs1, bs64 = cases[0][0], cases[1][0]
    rows = [("input ids hash", bs64, "hash", "{}"), (f"{bs1}: output tok/s after first token", bs1, "decode_tps", None),
            (f"{bs64}: decode tok/s", bs64, "decode_tps", None), (f"{bs64}: full-batch tok/s incl. prefill", bs64,
                                                                   "full_tps", None),
            ("median acceptance length (achieved)", bs64, "acceptance", "{:.2f}"),
            ("mean acceptance length (achieved)", bs64, "mean_acceptance", "{:.2f}"),
            ("median verify graph ms (BS1)", bs1, "verify_ms", "{:.3f}"),
            ("median draft graph ms (BS1)", bs1, "draft_ms", "{:.3f}"),
            ("median verify graph ms (BS64)", bs64, "verify_ms", "{:.3f}"),
            ("median draft graph ms (BS64)", bs64, "draft_ms", "{:.3f}"),
            ("verify graph (BS1): minimum bytes / time, of 4.3 TB/s", bs1, "verify_roofline", "{:.1%}"),
            ("verify graph (BS64): of 4.3 TB/s", bs64, "verify_roofline", "{:.1%}"),
            ("draft graph (BS1): of 4.3 TB/s", bs1, "draft_roofline", "{:.1%}"),
            ("draft graph (BS64): of 4.3 TB/s", bs64, "draft_roofline", "{:.1%}"),
            (f"verify graph (BS1): of this card's measured copy bandwidth ({card_bw_tb()})", bs1,
             "verify_roofline_card", "{:.1%}"),
            ("verify graph (BS64): of this card's copy", bs64, "verify_roofline_card", "{:.1%}"),
            ("draft graph (BS1): of this card's copy", bs1, "draft_roofline_card", "{:.1%}"),
            ("draft graph (BS64): of this card's copy", bs64, "draft_roofline_card", "{:.1%}"),
            ("trace (BS1): verify graph median ms", bs1, "trace_verify_ms", "{:.3f}"),
            ("trace (BS1): draft graph median ms", bs1, "trace_draft_ms", "{:.3f}"),
            ("trace (BS1): target start to next target start, median ms", bs1, "target_to_target_ms", "{:.3f}"),
            ("trace (BS1): mHC statistics overlapped with other kernels", bs1, "mhc_overlap", "{:.1%}"),
            ("trace (BS1): mHC statistics time on a side stream", bs1, "mhc_side", "{:.1%}"),
            ("trace (BS1) verify replay: ms in this project's CuTe kernels", bs1, "verify_cute_ms", "{:.3f}"),
            ("trace (BS1) verify replay: ms in cuBLAS GEMMs", bs1, "verify_gemm_ms", "{:.3f}"),
            ("trace (BS1) verify replay: ms in other PyTorch kernels", bs1, "verify_torch_ms", "{:.3f}"),
            ("trace (BS1) verify replay: ms with no kernel running", bs1, "verify_idle_ms", "{:.3f}"),
            ("trace (BS1) verify replay: CuTe / cuBLAS / other kernels", bs1, "verify_mix", "{}"),
            ("kernels per verify graph replay", bs64, "verify_nodes", "{}"),
            ("kernels per draft graph replay", bs64, "draft_nodes", "{}")]
    for label, case, key, fmt in rows:
        lines.append(f"| {label} | " + " | ".join(cell(b, case, key, fmt or "{:.1f}") for b in backends) + " |")
    for name, *_ in cases:  # same prompts and weights: how often each backend's greedy tokens match the first's
        ref = results.get((backends[0], name), {}).get("tokens")
        lines.append(f"| {name}: tokens equal to {backends[0]}'s | " + " | ".join(
            f"{token_agreement(ref, results.get((b, name), {}).get('tokens')):.3f}"
            if ref is not None and results.get((b, name), {}).get("tokens") is not None else "n/a"
            for b in backends) + " |")
        lines.append(f"| {name}: teacher-forced tokens equal to {backends[0]}'s (request 0) | " + " | ".join(
            cell(b, name, "teacher_forced", "{:.3f}") for b in backends) + " |")
        yard = results.get((backends[0], name), {})
        cmp = {b: teacher_forced_comparison(yard, results[(b, name)]) for b in backends
               if "teacher_logits" in yard and "teacher_picks" in results.get((b, name), {})}
        lines.append(f"| {name}: teacher-forced picks equal to {backends[0]}'s teacher-forced picks (request 0) | "
                     + " | ".join(f"{cmp[b][0]:.3f}" if b in cmp else "n/a" for b in backends) + " |")
        lgd = {b: logit_difference(yard, results[(b, name)]) for b in backends
               if "teacher_logits" in yard and "teacher_logits" in results.get((b, name), {})}
        lines.append(f"| {name}: teacher-forced logits vs {backends[0]}'s, relative difference per position "
                     f"(first {TEACHER_LOGIT_ROWS}): median / max | "
                     + " | ".join(f"{lgd[b][0]:.1e} / {lgd[b][1]:.1e}" if b in lgd else "n/a" for b in backends) + " |")
        lines.append(f"| {name}: picks differing from {backends[0]}'s in the first {TEACHER_LOGIT_ROWS} positions: "
                     f"near-ties / all | " + " | ".join(f"{cmp[b][2]} / {cmp[b][1]}" if b in cmp else "n/a"
                                                        for b in backends) + " |")
    for fam in FAMILIES:
        lines.append(f"| launches / 20 cycles: {fam} | " + " | ".join(
            str(results.get((b, bs64), {}).get("launches", {}).get(fam, "n/a")) for b in backends) + " |")
    if any(r.get("synthetic") for r in results.values()):
        lines.append("\nSynthetic acceptance: the token-agreement rows compare request 0's continuation decoded "
                     "with the draft's real acceptance (up to 128 tokens), not the timed outputs.")
    for b in backends:
        for name, *_ in cases:
            if "error" in results.get((b, name), {}):
                lines.append(f"\n{b}: {results[(b, name)]['error']}")
                break
        for name, *_ in cases:
            if "timeline_error" in results.get((b, name), {}):
                lines.append(f"\n{b}, {name}: trace metrics failed: {results[(b, name)]['timeline_error']}")
    return lines


def parser() -> argparse.ArgumentParser:
    """The command line (every option with its help and default)."""
    ap = argparse.ArgumentParser(prog="python -m spec_decode.bench",
                                 description="Decode throughput of the runtime's backends at BS1 and BS64 (GPU).")
    ap.add_argument("--model", choices=tuple(PRESETS), default="v4_flash_slice",
                    help="model config (default: %(default)s)")
    ap.add_argument("--backends", default="base,fused",
                    help="comma-separated backends to compare (default: %(default)s)")
    ap.add_argument("--quick", action="store_true",
                    help="input 512 / output 64 instead of 4096 / 1024 (BS1) and 4096 / 2048 (BS64) (default: off)")
    ap.add_argument("--cases", default=None,
                    help="comma-separated BATCHxINPUTxOUTPUT cases instead of the reference lengths (e.g. "
                         "1x4096x1024,64x1024x512; default: the reference PR's, or --quick's)")
    ap.add_argument("--out", default=None, help="also write the table to this file (default: none)")
    ap.add_argument("--prefill-chunk", type=int, default=384,
                    help="prompt positions per eager prefill forward (default: %(default)s)")
    ap.add_argument("--moe-row-tile", type=int, default=16, choices=(0, 16, 32, 64),
                    help="fused backend: the MoE decode kernel in passes of this many token columns for "
                         "steps of 17-384 tokens (0: one pass up to 64 tokens, the tiled kernel above; "
                         "default: %(default)s)")
    ap.add_argument("--acceptance-length", type=float, default=None,
                    help="synthetic acceptance with this mean (accepted drafts + 1, in [1, 6]) drawn on the device "
                         "through the real multi-token accept path, instead of the random-weight draft's real "
                         "acceptance (about 1); the table shows the achieved mean (default: real acceptance)")
    ap.add_argument("--sweep-acceptance", default=None,
                    help="instead of the tables: decode tok/s at each of these comma-separated synthetic "
                         "acceptance lengths (e.g. 1,2,3,4,5,6) per backend and case, to --out as CSV and to "
                         "--plot as PNG (default: off)")
    ap.add_argument("--plot", default=None,
                    help="with --sweep-acceptance or --plot-from: the PNG to write (default: none)")
    ap.add_argument("--plot-from", default=None,
                    help="draw a sweep's CSV (needs matplotlib, no GPU) and exit (default: none)")
    ap.add_argument("--tp", type=int, default=1, choices=(1, 2, 4, 8),
                    help="tensor-parallel ranks, simulated on this GPU (needs --simulate-ranks; default: %(default)s)")
    ap.add_argument("--simulate-ranks", action="store_true",
                    help="run the --tp ranks in this process, each on its own stream, all-reduces on the simulated "
                         "push group: the kernels and launch counts of a TP step, not its real latency -- the ranks "
                         "share one GPU's SMs and HBM and the push goes through local memory, not NVLink "
                         "(default: off)")
    ap.add_argument("--draft-head", default=EngineConfig.draft_head, choices=DRAFT_HEADS,
                    help="fused backend: the draft's LM head -- MXFP8 up to 16 rows and per-tensor e4m3 "
                         "above; MXFP8 up to 16 rows, bf16 above; bf16 throughout (default: %(default)s)")
    ap.add_argument("--wo-a-pdl", action="store_true",
                    help="fused backend: WO-A as a programmatic dependent launch of the attention before it "
                         "in steps of <= 16 tokens (EngineConfig.wo_a_pdl; default: off)")
    ap.add_argument("--router-pdl", action="store_true",
                    help="fused backend: the MoE router as a programmatic dependent launch of the gate product "
                         "before it (EngineConfig.router_pdl; default: off)")
    ap.add_argument("--indexer-token-group", type=int, default=3, choices=(1, 2, 3, 4),
                    help="fused backend: consecutive tokens of a request scored per indexer CTA (default: "
                         "%(default)s)")
    return ap


def run_cases(ap: argparse.ArgumentParser, args) -> list[tuple[str, int, int, int]]:
    """The (name, batch, input, output) cases of a run: the reference PR's lengths, ``--quick``'s,
    or ``--cases`` (``BATCHxINPUTxOUTPUT``, comma-separated; a malformed one is a usage error)."""
    cases = [("BS1 in 4096 / out 1024", 1, 4096, 1024), ("BS64 in 4096 / out 2048", 64, 4096, 2048)]
    if args.quick:
        cases = [("BS1 in 512 / out 64", 1, 512, 64), ("BS64 in 512 / out 64", 64, 512, 64)]
    if args.cases:
        cases = []
        for spec in args.cases.split(","):
            try:
                bs, n_in, n_out = (int(v) for v in spec.strip().lower().split("x"))
            except ValueError:
                ap.error(f"--cases: {spec!r} is not BATCHxINPUTxOUTPUT")
            if min(bs, n_in, n_out) < 1:
                ap.error(f"--cases: {spec!r} needs positive sizes")
            cases.append((f"BS{bs} in {n_in} / out {n_out}", bs, n_in, n_out))
    return cases


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.plot_from:
        if not args.plot:
            ap.error("--plot-from needs --plot FILE.png")
        print(plot_sweep(args.plot_from, args.plot))
        return 0
    model = PRESETS[args.model]
    cases = run_cases(ap, args)
    if not torch.cuda.is_available():
        print("spec_decode.bench needs a CUDA GPU", file=sys.stderr)
        return 2
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    engine = dict(prefill_chunk=args.prefill_chunk, moe_row_tile=args.moe_row_tile or None,
                  indexer_token_group=args.indexer_token_group, draft_head=args.draft_head,
                  acceptance_length=args.acceptance_length, wo_a_pdl=args.wo_a_pdl,
                  router_pdl=args.router_pdl)
    if args.tp > 1:
        if not args.simulate_ranks:
            print("spec_decode.bench: --tp > 1 runs simulated ranks on this GPU: add --simulate-ranks (a real "
                  "multi-GPU run is `python -m torch.distributed.run ... -m spec_decode run --tp N`)", file=sys.stderr)
            return 2
        engine.update(tp=args.tp, simulate_ranks=True)
    # the command as run: every option that differs from its default
    tuned = "".join(f" --{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in vars(args).items()
                    if k not in ("model", "backends", "quick", "out") and v != ap.get_default(k))
    head = [f"## Decode runtime ({args.model}) -- {torch.cuda.get_device_name()}, {datetime.date.today()}", "",
            f"Command: `python -m spec_decode.bench --model {args.model} --backends {args.backends}"
            f"{' --quick' if args.quick else ''}{tuned}`", ""]

    if args.sweep_acceptance:
        lengths = [float(x) for x in args.sweep_acceptance.split(",")]
        engine.pop("acceptance_length")
        rows = sweep_acceptance(backends, model, cases, lengths, **engine)
        csv_path = args.out or "acceptance_sweep.csv"
        print(write_sweep(rows, csv_path, args.plot, f"{args.model}, {torch.cuda.get_device_name()}"))
        return 0

    def write(partial):
        text = "\n".join(head + table_lines(backends, cases, results))
        if args.out:  # after every case: a run cut short by a time limit keeps what it measured
            open(args.out, "w").write(text + ("\n\n(partial: the run was cut short)\n" if partial else "\n"))
            kernels = kernel_lines(backends, cases[0][0], results)
            if kernels:  # the BS1 graphs kernel by kernel, beside the table
                open(os.path.splitext(args.out)[0] + ".kernels.md", "w").write("\n".join(head + kernels) + "\n")
        return text

    card_copy_bandwidth()  # before any engine holds the memory
    results = {}
    total = len(cases) * len(backends)
    t0 = time.perf_counter()
    i = 0
    for b in backends:
        for name, bs, n_in, n_out in cases:
            progress(i, total, f"{b}: {name}")
            try:
                reference = results.get((backends[0], name), {}).get("tokens") if b != backends[0] else None
                results[(b, name)] = run_case(b, model, bs, n_in, n_out, reference=reference, **engine)
            except NotImplementedError as e:
                results[(b, name)] = {"error": str(e).split(";")[0]}
            except torch.OutOfMemoryError as e:  # keep the other cases' results
                results[(b, name)] = {"error": "out of memory: " + str(e).split(".")[0]}
                gc.collect()
                torch.cuda.empty_cache()
            i += 1
            progress(i, total, f"{b}: {name}")
            print(f"[{b}: {name}: {time.perf_counter() - t0:.0f} s]", flush=True)
            text = write(partial=i < total)
    print(text)
    return 0


def expected_experts_touched(E: int, k: int, tokens: int) -> float:
    """Expected distinct experts among ``tokens`` tokens' ``k`` distinct choices each, for
    uniform routing: ``E (1 - (1 - k/E)^tokens)``."""
    return E * (1 - (1 - k / E) ** tokens)


def step_bytes(m, batch: int, width: int, context: int, *, draft: bool = False, experts_touched: float | None = None,
               expert_bytes_per_param: float = 1 + 1 / 32) -> dict[str, float]:
    """The bytes one decode step must move at least (HBM reads and writes), by part:
    ``batch`` requests of ``width`` tokens at ``context`` positions each.

    * weights: every non-expert weight once (bf16; the mHC / sink / bias tensors FP32), the
      routed experts touched (``experts_touched`` per MoE layer, default the uniform-routing
      expectation; MXFP8 ``1 + 1/32`` bytes a parameter), the LM head once;
    * state: per request and layer the window's raw rows (``window`` of them, bf16), the
      compressed entries read (HCA: all visible; CSA: the visible indexer keys, and up to
      ``index_topk`` main entries per token); the draft (``draft=True``): its stages' context
      rows;
    * activations: the mHC streams in and out of each sublayer (bf16, ``n`` streams).

    A lower bound, not a model of any kernel: re-reads, partial sums and scratch are not
    counted."""
    C, n, hd, D = m.hidden, m.mhc_n, m.head_dim, m.indexer_dim
    T = batch * width
    layers = [(0, False)] * m.draft_stages if draft else [(m.ratio(li), m.is_hash(li)) for li in range(m.layers)]
    w = s = a = 0.0
    for ratio, hashed in layers:
        shapes = layer_weight_shapes(m, None, hash_routed=hashed, ratio=ratio)
        for name, shape in shapes.items():
            size = math.prod(shape)
            if name.startswith("ffn.experts."):
                continue
            if name.endswith("tid2eid"):  # only the step's tokens' rows (int64)
                w += T * m.top_k * 8
                continue
            w += size * (4 if name.endswith(("_fn", "_base", "_scale")) else 2)
        per_expert = 3 * m.expert_inter * C
        touched = experts_touched if experts_touched is not None else expected_experts_touched(m.experts, m.top_k, T)
        w += touched * per_expert * expert_bytes_per_param
        s += batch * min(m.window, context + width) * hd * 2
        if ratio == m.hca_ratio:
            s += batch * ((context + width) // ratio) * hd * 2
        elif ratio == m.csa_ratio:
            visible = (context + width) // ratio
            s += batch * visible * D * 2 + batch * min(visible, m.index_topk * width) * hd * 2
        a += 2 * 2 * T * n * C * 2  # two sublayers: streams read and written
    w += m.vocab * C * 2  # the LM head
    return {"weights": w, "state": s, "activations": a, "total": w + s + a}


if __name__ == "__main__":
    import faulthandler
    import signal

    # stopped by a job's time limit (SIGTERM): every thread's stack first, then the default exit
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    raise SystemExit(main())
