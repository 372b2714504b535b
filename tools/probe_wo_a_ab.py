"""Paired A/B timing of WO-A Hopper configs: each against wo_a()'s own config in the same trial.

At large T the H200's run-to-run spread is larger than the differences being decided: over
one lease, cuBLAS ``bmm`` alone read 194-223 us at T = 4096 G=16 R=512 (bench/RESULTS.md,
twentieth session), so configs timed one after another (tools/probe_wo_a_tiles.py) can rank
either way. Here every trial replays each config's graph and bmm's in turn (the order rotating
from trial to trial, as bench/common.time_graphs_interleaved), and each config is compared
with the shipped one *within a trial*: the median of the per-trial speed-ups and the share of
trials it won. Every config is first checked against FP32 on a poisoned output.

    env TS=4096 SHAPES=16x512x2048,8x512x2048 CONFIGS="persistent=1/persistent=1,cluster_m=2" \
        python tools/probe_wo_a_ab.py

``CONFIGS``: '/'-separated overrides of ``WoASm90.config_for``'s config, ``key=value`` pairs
(``pingpong=1,tile_m=64,cluster_m=2``; ``pingpong=0`` drops a flag, ``weight_l2_hint=none`` a
key; ``weight_l2_hint=evict_last`` a string). ``tile_n=auto`` follows T as the swapped
mid-size rule does (T in ceil(T / 256) token tiles, each rounded up to 32), ``tile_n=auto+1``
in one tile more, ``auto16`` / ``auto16+1`` the same rounded up to 16, ``shipped16`` the
shipped config's number of token tiles with each rounded up to 16 instead; a resolved tile over
256, or a config the engine refuses to build, is
reported and left out of that point. ``SHAPES``: G x R x Dg. ``TS``: T values, or ``a:b:s`` (a, a + s, ... up to b).
``TRIALS`` (default 60). Prints, per (shape, T): us (median over trials) of the shipped config,
of each override and of ``bmm``; per override its speed-up over the shipped config (median of
the trials' ratios) and the trials it was faster in; every column's speed-up over ``bmm``.
"""
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from bench_wo_a import bmm_only, token_counts, wo_a_points  # noqa: E402
from common import gpu_warmup, poisoned_error, replay_interleaved  # noqa: E402

import cutlass  # noqa: E402
from cute_kernels import jit  # noqa: E402
from cute_kernels.wo_a_sm90 import WoASm90  # noqa: E402

FLAGS = ("pingpong", "persistent", "swap_ab")


def parse(spec: str) -> dict:
    """``k=v,...``: flags 0 / 1, other ints, ``none`` (drop the key), else a string."""
    out = {}
    for kv in spec.split(","):
        k, v = kv.split("=")
        out[k] = (bool(int(v)) if k in FLAGS else None if v == "none" else int(v) if v.lstrip("-").isdigit()
                  else v)
    return out


def token_tile(spec, T: int, shipped: int) -> int:
    """``tile_n``'s value at ``T``: an int as given, ``auto[+k]`` / ``shipped16`` as described
    above (``shipped``: the shipped config's token tile)."""
    if spec == "shipped16":
        return WoASm90.token_tile(T, -(-T // shipped), 16)
    m = re.fullmatch(r"auto(16)?(\+\d+)?", spec) if isinstance(spec, str) else None
    if not m:
        return spec
    step = 16 if m[1] else 32
    n_tiles = -(-T // 256) + int(m[2] or 0)
    return WoASm90.token_tile(T, n_tiles, step)


def main():
    TS = token_counts(os.environ.get("TS", "4096"))
    shapes = [tuple(int(v) for v in s.split("x")) for s in os.environ.get("SHAPES", "16x512x2048,8x512x2048").split(",")]
    overrides = [parse(s) for s in os.environ.get("CONFIGS", "persistent=1").split("/") if s]
    trials = int(os.environ.get("TRIALS", "60"))
    gpu_warmup()
    for G, R, Dg, ws, T, o, y, ref in wo_a_points(shapes, TS):
        n = len(ws)
        reps = max(n, 8)
        base = WoASm90.config_for(T, G, R, Dg)
        cfgs, launches = [], []
        for ov in [{}] + overrides:
            cfg = {k: v for k, v in {**base, **ov}.items() if v is not False and v is not None}
            if "tile_n" in cfg:
                cfg["tile_n"] = token_tile(cfg["tile_n"], T, base["tile_n"])
                if cfg["tile_n"] > 256:
                    print(f"  T={T}: {ov} resolves to tile_n {cfg['tile_n']} > 256, left out", flush=True)
                    continue
            try:
                fn = jit.get_kernel("wo_a", "sm_90a", G=G, R=R, Dg=Dg, **cfg)
            except Exception as e:  # a probe: report the config the engine refused, go on
                if not cfgs:
                    raise
                print(f"  T={T}: {cfg} not built ({type(e).__name__}: {str(e)[:160]})", flush=True)
                continue

            def call(i, fn=fn):
                fn(jit.gmem_ptr(cutlass.BFloat16, o), jit.gmem_ptr(cutlass.BFloat16, ws[i % n]),
                   jit.gmem_ptr(cutlass.BFloat16, y), jit.i32(T), jit.cu_stream())

            err = poisoned_error(call, y, ref)
            if not err < 1e-2:
                assert cfgs, (cfg, err)  # the shipped config must be right
                print(f"  T={T}: {cfg} WRONG (err {err:.3g}), left out", flush=True)
                continue
            cfgs.append(cfg)
            launches.append(call)
        launches.append(lambda i: bmm_only(o, ws[i % n]))
        times = replay_interleaved(launches, n, reps, trials)
        med = [statistics.median(ts) * 1e6 for ts in times]
        bmm = times[-1]
        print(f"T={T} G={G} R={R} Dg={Dg}: bmm {med[-1]:.1f} us", flush=True)
        for j, cfg in enumerate(cfgs):
            vs_bmm = statistics.median(b / x for b, x in zip(bmm, times[j]))
            line = f"  {'shipped ' if j == 0 else ''}{cfg}: {med[j]:.1f} us, {vs_bmm:.3f}x bmm"
            if j:
                ratios = [a / x for a, x in zip(times[0], times[j])]
                won = sum(r > 1 for r in ratios)
                line += f", {statistics.median(ratios):.3f}x shipped (faster in {won}/{trials} trials)"
            print(line, flush=True)


if __name__ == "__main__":
    main()
