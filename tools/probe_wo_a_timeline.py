"""Where a WO-A Hopper launch spends its time: the engine's debug timeline, per CTA.

The lent H200 has no profiler, so this traces the one-tile-per-CTA kernel itself
(:class:`cute_kernels.gemm.sm90_gemm.Sm90Gemm` with ``timeline``): every CTA writes its SM
and ``%globaltimer`` stamps at entry, after the barrier-init cluster sync, when its first
stage has landed, when its last MMAs retired and when its epilogue's stores were issued.
Each config also runs in two stripped modes and one variant, timed the same way:

- ``mma_only``: no loads; the consumers run every wgmma on whatever the stages hold -- the
  tensor-core + epilogue time of the schedule, without memory;
- ``load_only``: every load, no wgmma -- the memory time of the schedule;
- ``eager``: every load and wgmma, each k-tile's stage freed as soon as its own batch retired.

    python tools/probe_wo_a_timeline.py
    env TS=320,4096 MODES=full,mma_only,load_only CONFIGS=default python tools/probe_wo_a_timeline.py
    env TS=320 CONFIGS=swap:128x160:1x2:occ1,swap:64x160:1x2:occ1 python tools/probe_wo_a_timeline.py
    env TS=320 SHAPES=8x512x2048 MODES=full OUT=/tmp python tools/probe_wo_a_timeline.py
    env TS=64,320,4096 MODES=full HINTS=evict_first python tools/probe_wo_a_timeline.py
    env TS=64,320 MODES=full,eager STAGES=4,5 python tools/probe_wo_a_timeline.py
    env TS=4096 SHAPES=16x512x2048 MODES=full PDL=0,1,code OUT=/tmp python tools/probe_wo_a_timeline.py

Prints, per (shape, T, config, mode): us per call (graph replay of back-to-back launches
with rotating weights, as the benches) next to cuBLAS ``bmm`` alone, and from the trace of
one of those launches (the median of the last ones): the span from the first CTA's entry to
the last epilogue, the entry skew across CTAs, and the median CTA's phases (init, first
stage, mainloop, epilogue) in us, with CTAs per SM; the gap from a launch's last epilogue to
the next launch's first entry and the launch period. Full-mode output is checked against
FP32. With ``OUT`` set, the raw traces go to ``$OUT/timeline_traces.pt`` (a dict).
``%globaltimer`` ticks in 256 ns steps on the H200 (phase 64), so the phases are +-0.26 us.
"""
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from bench_wo_a import bmm_only, token_counts, tokens_out_ref, weight_sets  # noqa: E402
from common import gpu_warmup, measure, time_graph  # noqa: E402

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Int32, const_expr  # noqa: E402
import cutlass.pipeline as pipeline  # noqa: E402
from cutlass.cute.nvgpu import warpgroup  # noqa: E402

from cute_kernels import jit  # noqa: E402
from cute_kernels.gemm import sm90_gemm  # noqa: E402
from cute_kernels.gemm.sm90_gemm import Sm90Gemm  # noqa: E402
from cute_kernels.wo_a_sm90 import WoASm90, WoASm90Traced  # noqa: E402

MAX_CTAS = WoASm90Traced.MAX_CTAS
SLOTS = sm90_gemm.TIMELINE_SLOTS


class Sm90GemmProbe(Sm90Gemm):
    """The engine with its loads or its MMAs left out (``mode``); ``full`` is the engine;
    ``eager``: the engine, but each k-tile's wgmma batch is waited for right after it is
    issued and its stage freed at once (not after the next batch is issued) -- a stage then
    spends less time held by the consumers and more in flight, at the price of a tensor-core
    bubble between batches."""

    def __init__(self, base: Sm90Gemm, mode: str, max_stages: int | None = None):
        self.__dict__.update(base.__dict__)
        self.mode, self.max_stages = mode, max_stages

    def stages_for(self, tile_k: int, ab_width: int, c_width: int = 16) -> int:
        n = Sm90Gemm.stages_for(self, tile_k, ab_width, c_width)
        return min(n, self.max_stages) if self.max_stages else n

    @cute.jit
    def load_k_tile(self, ab_pipe, loads, kt, operands: cutlass.Constexpr = "ab", acquire: cutlass.Constexpr = True,
                    base=None):
        if const_expr(self.mode != "mma_only"):
            Sm90Gemm.load_k_tile(self, ab_pipe, loads, kt, operands, acquire, base)

    @cute.jit
    def mma(self, ab_pipe, tiled_mma, sA, sB, gC, warp, k_tiles, loads, trace=None):
        if const_expr(self.mode != "eager"):
            return Sm90Gemm.mma(self, ab_pipe, tiled_mma, sA, sB, gC, warp, k_tiles, loads, trace)
        tCrA, tCrB, acc, k_blocks = self.mma_fragments(tiled_mma, sA, sB, gC, warp)
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
        self.mma_k_tile(ab_pipe, tiled_mma, tCrA, tCrB, acc, read, k_blocks, first=True)
        self.stamp(trace, sm90_gemm.STAMP_FIRST_STAGE, cute.arch.thread_idx()[0] == 0)
        self.free_now(ab_pipe, loads, read, warp, k_tiles)
        read.advance()
        for _ in cutlass.range(1, k_tiles, unroll=1):
            self.mma_k_tile(ab_pipe, tiled_mma, tCrA, tCrB, acc, read, k_blocks)
            self.free_now(ab_pipe, loads, read, warp, k_tiles)
            read.advance()
        return acc

    @cute.jit
    def free_now(self, ab_pipe, loads, read, warp, k_tiles):
        """``eager``: wait for the batch just issued, free its stage and refill it."""
        warpgroup.wait_group(0)
        ab_pipe.consumer_release(read)
        self.refill(ab_pipe, loads, warp, read.count, k_tiles)

    @cute.jit
    def mma_k_tile(self, ab_pipe, tiled_mma, tCrA, tCrB, acc, read, k_blocks: cutlass.Constexpr,
                   first: cutlass.Constexpr = False):
        if const_expr(self.mode != "mma_only"):
            self.wait_stage(ab_pipe, read)
        warpgroup.fence()
        if const_expr(self.mode != "load_only"):
            for kb in cutlass.range_constexpr(k_blocks):
                cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, read.index)], tCrB[(None, None, kb, read.index)], acc)
                if const_expr(first):
                    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()


class WoATimeline(WoASm90Traced):
    """WO-A's traced launch on the probe's engine mode."""

    def __init__(self, *args, mode: str = "full", max_stages: int | None = None, **kw):
        super().__init__(*args, **kw)
        self.gemm = Sm90GemmProbe(self.gemm, mode, max_stages)


def compile_probe(G, R, Dg, cfg, mode, arch="sm_90a"):
    pdl = cfg.get("pdl", False)
    obj = WoATimeline(G, R, Dg, (cfg["tile_m"], cfg["tile_n"]), (cfg.get("cluster_m", 1), cfg.get("cluster_n", 1)),
                      bool(pdl), cfg.get("swap_ab", False), cfg.get("occupancy", 1), False, cfg.get("cluster_exit"),
                      cfg.get("weight_l2_hint"), mode=mode, max_stages=cfg.get("max_stages"))
    if pdl == "code":  # the PDL build's machine code, launched as an ordinary kernel
        obj.gemm.pdl_launch = False
    P = jit.fake_gmem_ptr
    return cute.compile(obj, P(cutlass.BFloat16), P(cutlass.BFloat16), P(cutlass.BFloat16), P(cutlass.Int64, 8),
                        Int32(1), jit.fake_stream(), options=jit.default_options(arch))


def config_spec(spec: str) -> dict:
    """A ``CONFIGS`` entry, ``swap:128x160:1x2:occ1`` (operand order ``swap`` or not, tile,
    cluster, CTAs per SM), as an engine config."""
    sw, tile, cl, occ = spec.split(":")
    tm, tn = (int(v) for v in tile.split("x"))
    cm, cn = (int(v) for v in cl.split("x"))
    return dict(tile_m=tm, tile_n=tn, cluster_m=cm, cluster_n=cn, swap_ab=sw == "swap", occupancy=int(occ[3:]))


def summarize(tl: torch.Tensor, ctas: int) -> dict:
    """Phases of one launch's trace (ns -> us)."""
    t = tl[:ctas].double()
    sm, entry, init, first, main_end, epi_end = (t[:, i] for i in range(6))
    t0 = entry.min()
    med = lambda x: statistics.median(x.tolist()) / 1e3  # noqa: E731
    per_sm = torch.bincount(sm.long()).max().item()
    return dict(span=(epi_end.max() - t0).item() / 1e3, skew=(entry.max() - t0).item() / 1e3,
                init=med(init - entry), first=med(first - init), main=med(main_end - first),
                epi=med(epi_end - main_end), last_main=(main_end.max() - t0).item() / 1e3,
                sms=int(torch.unique(sm).numel()), per_sm=per_sm)


def main():
    TS = token_counts(os.environ.get("TS", "320"))
    MODES = os.environ.get("MODES", "full,mma_only,load_only").split(",")
    HINTS = [h for h in os.environ.get("HINTS", "").split(",") if h]
    EXTRA = [c for c in os.environ.get("CONFIGS", "").split(",") if c and c != "default"]
    STAGES = [int(n) for n in os.environ.get("STAGES", "").split(",") if n]
    PDL = [{"0": False, "1": True, "code": "code"}[p] for p in os.environ.get("PDL", "0").split(",")]
    traces = {}
    gpu_warmup()
    shapes = [(16, 1024, 1024), (8, 512, 2048), (16, 512, 2048), (8, 1024, 1024)]
    if os.environ.get("SHAPES"):  # e.g. SHAPES=8x512x2048 (G x R x Dg)
        shapes = [tuple(int(v) for v in sh.split("x")) for sh in os.environ["SHAPES"].split(",")]
    for G, R, Dg in shapes:
        ws = weight_sets(G, R, Dg)
        n = len(ws)
        for T in TS:
            o, y, ref = tokens_out_ref(T, G, R, Dg, ws[0])
            t_bmm = time_graph(lambda i: bmm_only(o, ws[i]), n, max(n, 8))
            cfgs = [WoASm90.config_for(T, G, R, Dg)]
            cfgs += [config_spec(spec) for spec in EXTRA]
            # each config also with the weight loads' L2 hints in HINTS (e.g. HINTS=evict_first)
            cfgs += [dict(c, weight_l2_hint=h) for h in HINTS for c in list(cfgs)]
            # ... and with at most that many operand stages for each of STAGES (e.g. STAGES=4,5)
            cfgs += [dict(c, max_stages=n) for n in STAGES for c in list(cfgs)]
            # ... and as a programmatic dependent launch (PDL=1), or its build launched without
            # the attribute (PDL=code); PDL=0 (the default) keeps the ordinary launch
            cfgs = [dict(c, pdl=p) for p in PDL for c in cfgs]
            print(f"T={T} G={G} R={R} Dg={Dg}: bmm alone {t_bmm * 1e6:.2f} us", flush=True)
            for cfg in cfgs:
                if cfg.get("pingpong"):
                    print(f"  {cfg}: pingpong is not traced")
                    continue
                reps = max(n, 8)
                tls = torch.zeros(reps, MAX_CTAS, SLOTS, device="cuda", dtype=torch.int64)
                for mode in MODES:
                    fn = compile_probe(G, R, Dg, cfg, mode)

                    def call(i, r, fn=fn):
                        fn(jit.gmem_ptr(cutlass.BFloat16, o), jit.gmem_ptr(cutlass.BFloat16, ws[i % n]),
                           jit.gmem_ptr(cutlass.BFloat16, y), jit.gmem_ptr(cutlass.Int64, tls[r], 8), jit.i32(T),
                           jit.cu_stream())

                    # the benches' graph timing over reps launches, launch r writing trace r (the
                    # traces read below are the last replay's); full mode first checked against FP32
                    # on a poisoned y
                    if mode == "full":
                        t, err = measure(lambda r: call(r, r), y, ref, reps)
                    else:
                        t, err = time_graph(lambda r: call(r, r), reps, reps), float("nan")
                    us = t * 1e6
                    # grid size from the trace: rows with an entry stamp
                    ctas = int((tls[-1, :, 1] != 0).sum().item())
                    if ctas >= MAX_CTAS:
                        print(f"  {cfg} {mode}: more than {MAX_CTAS} CTAs, the trace's last row is shared")
                    sums = [summarize(tls[r].cpu(), ctas) for r in range(reps // 2, reps)]
                    mid = sorted(sums, key=lambda d: d["span"])[len(sums) // 2]
                    # launch-to-launch gap inside the graph: next first entry - this last epilogue
                    gaps = [(tls[r + 1, :ctas, 1].min() - tls[r, :ctas, 5].max()).item() / 1e3
                            for r in range(reps // 2, reps - 1)]
                    # launch period inside the graph: first entry to the next launch's first entry
                    period = statistics.median((tls[r + 1, :ctas, 1].min() - tls[r, :ctas, 1].min()).item() / 1e3
                                               for r in range(reps // 2, reps - 1))
                    if os.environ.get("OUT"):  # the raw traces, for a look at every CTA: one file
                        name = (f"G{G}R{R}T{T}_{cfg['tile_m']}x{cfg['tile_n']}_c{cfg.get('cluster_m', 1)}x"
                                f"{cfg.get('cluster_n', 1)}_{cfg.get('weight_l2_hint') or 'nohint'}"
                                f"{'_s%d' % cfg['max_stages'] if cfg.get('max_stages') else ''}"
                                f"{'_pdl' + str(cfg['pdl']) if cfg.get('pdl') else ''}_{mode}")
                        traces[name] = tls[:, :ctas].cpu()
                        torch.save(traces, os.path.join(os.environ["OUT"], "timeline_traces.pt"))
                    print(f"  {cfg} {mode}: {us:.2f} us ({t_bmm * 1e6 / us:.2f}x bmm, err {err:.1e}); "
                          f"{ctas} CTAs on {mid['sms']} SMs (<= {mid['per_sm']}/SM); span {mid['span']:.2f}, "
                          f"entry skew {mid['skew']:.2f}, last mainloop end {mid['last_main']:.2f}; median CTA: "
                          f"init {mid['init']:.2f}, first stage {mid['first']:.2f}, mainloop {mid['main']:.2f}, "
                          f"epilogue {mid['epi']:.2f}; gap to next launch {statistics.median(gaps):.2f}, "
                          f"launch period {period:.2f}",
                          flush=True)
        ws = None


if __name__ == "__main__":
    main()
