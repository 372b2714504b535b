"""Tune the WO-A Hopper tile choice: time every CTA tile (and cluster) per (shape, T) and check it.

    python tools/probe_wo_a_tiles.py
    env TS=320,16384 TILES=128x256,128x128,64x256 CLUSTERS=1x1,2x1,1x2 python tools/probe_wo_a_tiles.py
    env TS=320 TILES=128x256 BANDS=256:128x256+64:64x128,256:128x256+64:64x64 python tools/probe_wo_a_tiles.py
    env TS=320 TILES=128x256 SWAP_TILES=128x160,64x160,128x64 python tools/probe_wo_a_tiles.py
    env TS=96,200,512 PICKS=1 python tools/probe_wo_a_tiles.py
    env TS=320 TILES=128x256 SWAP_TILES=128x160,64x160 CLUSTERS=2x1 OCCUPANCY=1,2 python tools/probe_wo_a_tiles.py
    env TS=4096,16384 TILES=128x256 PINGPONG_TILES=64x256 CLUSTERS=1x1,2x1 python tools/probe_wo_a_tiles.py
    env TS=4096 TILES=128x256 PERSISTENT_TILES=128x256 CLUSTERS=1x1,2x1 python tools/probe_wo_a_tiles.py
    env TS=320,4096 PICKS=1 CLUSTERS=2x1 EXITS=default,barrier,producer_tail python tools/probe_wo_a_tiles.py

Prints, per shape and T, us per call (graph replay, rotating weights) and the relative error
against an FP32 einsum for each tile / cluster, and cuBLAS ``bmm`` alone (group-major output,
issue 4's baseline (b)) timed the same way; '*' marks the config wo_a() launches.
Defaults: T = 1, 64, 320, 1024, the five tiles, cluster 1x1 (the sweep the shipped heuristic
came from).
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from bench_wo_a import bmm_only, token_counts, tokens_out_ref, weight_sets  # noqa: E402
from common import measure, time_graph  # noqa: E402

import cutlass  # noqa: E402
from cute_kernels import jit  # noqa: E402
from cute_kernels.wo_a_sm90 import WoASm90  # noqa: E402


def _pairs(env: str, default: str):
    return [tuple(int(v) for v in p.split("x")) for p in os.environ.get(env, default).split(",")]


TILES = _pairs("TILES", "64x64,64x128,64x256,128x128,128x256")
# swap AB: weight rows on M, tokens on N -- tiles written (R-tile)x(T-tile), e.g. 128x160
SWAP_TILES = _pairs("SWAP_TILES", "") if os.environ.get("SWAP_TILES") else []
# the engine's persistent pingpong schedule (64-row tiles; (T, R) or, with PINGPONG_SWAP_TILES, (R, T))
PINGPONG_TILES = _pairs("PINGPONG_TILES", "") if os.environ.get("PINGPONG_TILES") else []
PINGPONG_SWAP_TILES = _pairs("PINGPONG_SWAP_TILES", "") if os.environ.get("PINGPONG_SWAP_TILES") else []
# the engine's persistent cooperative schedule (128-row (T, R) tiles, both warp groups on each)
PERSISTENT_TILES = _pairs("PERSISTENT_TILES", "") if os.environ.get("PERSISTENT_TILES") else []
OCCUPANCY = [int(v) for v in os.environ.get("OCCUPANCY", "1").split(",")]  # CTAs per SM the stages leave room for
# how a clustered CTA leaves (Sm90Gemm's cluster_exit; "default": the engine's choice); 1x1
# configs run the default only
EXITS = os.environ.get("EXITS", "default").split(",")
PICKS = bool(os.environ.get("PICKS"))  # only tile_for()'s tile and config_for()'s config, per T
CLUSTERS = _pairs("CLUSTERS", "1x1")
TS = token_counts(os.environ.get("TS", "1,64,320,1024"))
# e.g. BANDS=256:128x256+64:64x128 -- T split into row bands launched one after the other
# (a full wave of large tiles, then the remainder with small ones); bands not summing to T skip.
BANDS = [[(int(b.split(":")[0]), tuple(int(v) for v in b.split(":")[1].split("x"))) for b in spec.split("+")]
         for spec in os.environ.get("BANDS", "").split(",") if spec]


for G, R, Dg in [(16, 1024, 1024), (8, 512, 2048), (16, 512, 2048), (8, 1024, 1024)]:
    ws = weight_sets(G, R, Dg)
    n = len(ws)
    for T in TS:
        o, y, ref = tokens_out_ref(T, G, R, Dg, ws[0])
        pick = WoASm90.tile_for(T, G, R)  # the unswapped (T, R) tile
        cfg = WoASm90.config_for(T, G, R, Dg)  # what wo_a() launches
        launched = (cfg["tile_m"], cfg["tile_n"], cfg.get("cluster_m", 1), cfg.get("cluster_n", 1),
                    cfg.get("swap_ab", False), cfg.get("pingpong", False))
        t_bmm = time_graph(lambda i: bmm_only(o, ws[i]), n, max(n, 8))
        res = [f"bmm alone: {t_bmm * 1e6:.1f} us"]
        if PICKS:  # the (T, R) heuristic's tile against wo_a()'s launch config, in each of CLUSTERS
            tm, tn, _, _, swap, pp = launched
            configs = list(dict.fromkeys([(*pick, 1, 1, False, False)]
                                         + [(tm, tn, cm, cn, swap, pp) for cm, cn in CLUSTERS]))
        else:
            configs = [(tm, tn, cm, cn, False, False) for tm, tn in TILES if R % tn == 0 for cm, cn in CLUSTERS]
            configs += [(tm, tn, cm, cn, True, False) for tm, tn in SWAP_TILES if R % tm == 0 for cm, cn in CLUSTERS]
            configs += [(tm, tn, cm, cn, False, True) for tm, tn in PINGPONG_TILES if R % tn == 0
                        for cm, cn in CLUSTERS]
            configs += [(tm, tn, cm, cn, True, True) for tm, tn in PINGPONG_SWAP_TILES if R % tm == 0
                        for cm, cn in CLUSTERS]
            configs += [(tm, tn, cm, cn, False, "persistent") for tm, tn in PERSISTENT_TILES if R % tn == 0
                        for cm, cn in CLUSTERS]
        if PICKS:  # the launched config at wo_a()'s own occupancy, the others at one CTA per SM
            runs = [(c, cfg.get("occupancy", 1) if c == launched else 1, ex) for c in configs for ex in EXITS]
        else:
            runs = [(c, occ, ex) for c in configs for occ in OCCUPANCY for ex in EXITS]
        for (tm, tn, cm, cn, swap, pp), occ, ex in runs:
            if (pp and occ > 1) or (ex != "default" and cm * cn == 1):
                continue
            fn = jit.get_kernel("wo_a", "sm_90a", G=G, R=R, Dg=Dg, tile_m=tm, tile_n=tn, cluster_m=cm,
                                cluster_n=cn, swap_ab=swap, occupancy=occ,
                                # pp: True the pingpong schedule, "persistent" the persistent cooperative one
                                **({"pingpong": True} if pp is True else {"persistent": True} if pp else {}),
                                **({"cluster_exit": ex} if ex != "default" else {}),
                                # every config with the weight loads' L2 hint wo_a() uses at this T
                                **({"weight_l2_hint": cfg["weight_l2_hint"]} if cfg.get("weight_l2_hint") else {}))

            def call(i, fn=fn):
                fn(jit.gmem_ptr(cutlass.BFloat16, o), jit.gmem_ptr(cutlass.BFloat16, ws[i]),
                   jit.gmem_ptr(cutlass.BFloat16, y), jit.i32(T), jit.cu_stream())

            t, err = measure(call, y, ref, n)
            mark = ("*" if (tm, tn, cm, cn, swap, pp) == launched and occ == cfg.get("occupancy", 1)
                    and ex == "default" else "")
            name = (f"{'pingpong ' if pp is True else 'persistent ' if pp else ''}{'swap ' if swap else ''}"
                    f"{tm}x{tn} c{cm}x{cn}"
                    f"{f' occ{occ}' if occ > 1 else ''}{f' {ex}' if ex != 'default' else ''}")
            res.append(f"{name}{mark}: {t * 1e6:.1f} us ({t_bmm / t:.2f}x bmm, err {err:.1e})")
        for bands in BANDS:  # row bands: one launch per band, each with its own tile
            if sum(rows for rows, _ in bands) != T or any(R % tn for _, (_, tn) in bands):
                continue
            launches = []
            r0 = 0
            for rows, (tm, tn) in bands:
                fn = jit.get_kernel("wo_a", "sm_90a", G=G, R=R, Dg=Dg, tile_m=tm, tile_n=tn)
                launches.append((fn, r0, rows))
                r0 += rows

            def call(i, launches=launches):
                for fn, r0, rows in launches:
                    fn(jit.gmem_ptr(cutlass.BFloat16, o[r0:]), jit.gmem_ptr(cutlass.BFloat16, ws[i]),
                       jit.gmem_ptr(cutlass.BFloat16, y[r0:]), jit.i32(rows), jit.cu_stream())

            t, err = measure(call, y, ref, n)
            name = "+".join(f"{rows}:{tm}x{tn}" for rows, (tm, tn) in bands)
            res.append(f"bands {name}: {t * 1e6:.1f} us ({t_bmm / t:.2f}x bmm, err {err:.1e})")
        print(f"T={T} G={G} R={R} Dg={Dg}: " + "; ".join(res), flush=True)
    ws = None
