"""Per-k-tile trace of WO-A's Hopper pipeline: who waits for whom, k-tile by k-tile.

``tools/probe_wo_a_timeline.py`` showed the T = 320 launches load-bound (a load-only build
takes 88-96% of the full kernel) with ``%globaltimer``, whose 256 ns tick is about one
k-tile here. This probe stamps the SM's cycle counter (``clock64``) at the four points of
every k-tile ``kt`` that a stall can sit between, in every CTA:

- ``c0`` / ``c1``: the consumer (thread 0) before / after its wait on the stage's full
  barrier -- ``c1 - c0`` is time the tensor cores had nothing to read;
- ``p0`` / ``p1``: the producer (lane 0 of its warp) before / after acquiring the stage's
  empty barrier -- ``p1 - p0`` is time the producer could not issue because every stage was
  still held (by this CTA's consumers or, in a cluster, a peer's); its TMA loads go out at
  ``p1``, so ``c1 - p1`` bounds the load's latency from above (exactly that latency where
  the consumer was waiting: ``c1 - c0`` > 0).

Plus ``%globaltimer`` and ``clock64`` at entry and at the mainloop's end (the SM clock rate,
to turn cycles into ns) and the CTA's SM. Configs as ``probe_wo_a_timeline.py``'s ``CONFIGS``
(``swap:64x160:1x1:occ1``: operand order, tile, cluster, CTAs per SM; traced at one CTA per
SM only) and ``STAGES``; ``MODES`` full / load_only (the consumers then issue no wgmma). A
diagnostic build: nothing shipped compiles these stamps (``tests/test_wo_a.py -k ktrace``).
Findings: bench/RESULTS.md, twenty-second session.

    env TS=320 SHAPES=8x512x2048,8x1024x1024 MODES=full,load_only python tools/probe_wo_a_ktrace.py
    env TS=320 SHAPES=8x512x2048 STAGES=8 OUT=/tmp python tools/probe_wo_a_ktrace.py
    env TS=320 SHAPES=8x512x2048 STAGES=5 CONFIGS=swap:64x160:1x1:occ1 python tools/probe_wo_a_ktrace.py
    env TS=320 SHAPES=8x512x2048 MODES=full RASTER=engine,nml,lmn WSETS=1 python tools/probe_wo_a_ktrace.py

``RASTER``: orders (fastest first) in which the dispatched clusters walk the m / n / l cluster
tiles, ``engine`` the engine's own; ``WSETS=1``: one weight set, L2-resident across launches
(default: enough sets to rotate through twice L2, as the benches).

Prints per (shape, T, config, mode): us per call (graph replay, rotating weights, as the
benches) next to cuBLAS ``bmm``; the SM clock; and over the CTAs of one launch (the median
of the last ones by mainloop length), medians of: the mainloop (first wait to the last
stage landed), the first stage's latency, the consumer's total and per-k-tile full-barrier
wait, the producer's total empty-barrier wait, the issue-to-land latency of the loads the
consumer waited for, and the k-tile cadence; and the spread of the CTAs' mainloop ends.
"""
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_wo_a import bmm_only, token_counts, tokens_out_ref, weight_sets  # noqa: E402
from common import gpu_warmup, measure, time_graph  # noqa: E402
from probe_wo_a_timeline import Sm90GemmProbe, config_spec  # noqa: E402

import cuda.bindings.driver as cuda  # noqa: E402
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Int32, Int64, const_expr  # noqa: E402

from cute_kernels import jit  # noqa: E402
from cute_kernels.gemm import sm90_gemm  # noqa: E402
from cute_kernels.wo_a_sm90 import WoASm90, wo_a_views  # noqa: E402

MAX_CTAS = 256
#: k-tile rows of a CTA's trace; the last two hold the CTA-wide stamps
KT_ROWS = 66
C0, C1, P0, P1 = range(4)
#: row KT_ROWS - 1: globaltimer / clock64 at entry and at the mainloop's end; row KT_ROWS - 2: SM
ROW_T, ROW_SM = KT_ROWS - 1, KT_ROWS - 2


class Sm90GemmKTrace(Sm90GemmProbe):
    """The probe engine (full or load_only) with clock64 stamps around each k-tile's barrier
    waits. The trace row is kept on the object while the kernel is traced (a probe's
    shortcut: the engine's methods do not pass it to the loads)."""

    #: ``RASTER``: the order (fastest first) in which the launch's clusters walk the m / n / l
    #: cluster tiles -- None: the engine's own (raster groups along M, l = blockIdx.z)
    raster_order = None

    @cute.jit
    def tile_coord(self):
        if const_expr(self.raster_order is None):
            return Sm90GemmProbe.tile_coord(self)
        cx, cy, cz = cute.arch.cluster_idx()
        ncx, ncy, ncz = cute.arch.cluster_dim()
        rest = cx + cy * ncx + cz * ncx * ncy  # the hardware's dispatch order: x, then y, then z
        sizes = dict(m=ncx, n=ncy, l=ncz)
        coord = {}
        for d in self.raster_order:
            coord[d] = rest % sizes[d]
            rest = rest // sizes[d]
        in_cluster = cute.arch.block_in_cluster_idx()
        return (coord["m"] * self.cluster_mn[0] + in_cluster[0], coord["n"] * self.cluster_mn[1] + in_cluster[1],
                coord["l"])

    @cute.jit
    def trace_row(self, mT):
        bx, by, bz = cute.arch.block_idx()
        gx, gy, _ = cute.arch.grid_dim()
        linear = cutlass.min(bx + by * gx + bz * gx * gy, MAX_CTAS - 1)
        row = mT[(linear, None, None)]
        tidx, _, _ = cute.arch.thread_idx()
        if tidx == 0:
            row[(ROW_SM, 0)] = Int64(cute.arch.smid())
        self._krow = row
        return row

    @cute.jit
    def stamp(self, row, slot: cutlass.Constexpr, pred):
        if const_expr(slot == sm90_gemm.STAMP_ENTRY or slot == sm90_gemm.STAMP_MAINLOOP_END):
            col = 0 if const_expr(slot == sm90_gemm.STAMP_ENTRY) else 2
            if pred:
                row[(ROW_T, col)] = cute.arch.globaltimer()
                row[(ROW_T, col + 1)] = cute.arch.clock64()

    @cute.jit
    def kstamp(self, kt, col: cutlass.Constexpr, pred):
        row = self._krow
        if pred:
            row[(cutlass.min(kt, ROW_SM - 1), col)] = cute.arch.clock64()

    @cute.jit
    def acquire_stage(self, ab_pipe, state):
        # one-tile-per-CTA kernel: the pipeline position is the k-tile
        lane0 = cute.arch.thread_idx()[0] % 32 == 0
        self.kstamp(state.count, P0, lane0)
        Sm90GemmProbe.acquire_stage(self, ab_pipe, state)
        self.kstamp(state.count, P1, lane0)

    @cute.jit
    def wait_stage(self, ab_pipe, read):
        t0 = cute.arch.thread_idx()[0] == 0
        self.kstamp(read.count, C0, t0)
        Sm90GemmProbe.wait_stage(self, ab_pipe, read)
        self.kstamp(read.count, C1, t0)


class WoAKTrace(WoASm90):
    """WO-A on the k-tile-traced engine; ``t_ptr``: Int64 (MAX_CTAS, KT_ROWS, 4)."""

    def __init__(self, *args, mode: str = "full", max_stages: int | None = None, raster: str | None = None, **kw):
        super().__init__(*args, **kw)
        self.gemm = Sm90GemmKTrace(self.gemm, mode, max_stages)
        self.gemm.raster_order = raster

    @cute.jit
    def __call__(self, o_ptr: cute.Pointer, w_ptr: cute.Pointer, y_ptr: cute.Pointer, t_ptr: cute.Pointer,
                 num_tokens: Int32, stream: cuda.CUstream):
        a, b, c = wo_a_views(o_ptr, w_ptr, y_ptr, num_tokens, self.G, self.R, self.Dg, self.swap_ab)
        trace = cute.make_tensor(t_ptr, cute.make_layout((MAX_CTAS, KT_ROWS, 4), stride=(KT_ROWS * 4, 4, 1)))
        self.gemm(a, b, c, stream, trace)


def compile_ktrace(G, R, Dg, cfg, mode, raster=None, options=None):
    """The traced build of ``cfg`` for sm_90a and its operand stage count; ``options``: the
    compile options (default: the project's for sm_90a)."""
    obj = WoAKTrace(G, R, Dg, (cfg["tile_m"], cfg["tile_n"]), (cfg.get("cluster_m", 1), cfg.get("cluster_n", 1)),
                    False, cfg.get("swap_ab", False), cfg.get("occupancy", 1), False, cfg.get("cluster_exit"),
                    cfg.get("weight_l2_hint"), mode=mode, max_stages=cfg.get("max_stages"), raster=raster)
    P = jit.fake_gmem_ptr
    fn = cute.compile(obj, P(cutlass.BFloat16), P(cutlass.BFloat16), P(cutlass.BFloat16), P(cutlass.Int64, 8),
                      Int32(1), jit.fake_stream(), options=options or jit.default_options("sm_90a"))
    return fn, obj.gemm.stages


def summarize(tr: torch.Tensor, ctas: int, k_tiles: int, stages: int) -> dict:
    """Medians over the CTAs of one launch's trace (cycles -> ns at each CTA's own clock)."""
    t = tr[:ctas].double()
    k = t[:, :k_tiles]
    c0, c1, p0, p1 = (k[:, :, i] for i in range(4))
    ghz = (t[:, ROW_T, 3] - t[:, ROW_T, 1]) / (t[:, ROW_T, 2] - t[:, ROW_T, 0])  # cycles per ns
    ns = lambda x: x / ghz[:, None]  # noqa: E731
    cwait = ns(c1 - c0)
    pwait = ns(p1 - p0)[:, stages:]  # the first `stages` acquisitions find fresh buffers
    lat = ns(c1 - p1)
    waited = cwait > 20.0  # the consumer was there first: c1 is when the stage landed
    cadence = ns(c1[:, 1:] - c1[:, :-1])
    mainloop = ns(c1[:, -1:] - c0[:, :1])[:, 0]
    main_end = t[:, ROW_T, 2]  # globaltimer
    med = lambda x: statistics.median(x.flatten().tolist())  # noqa: E731
    return dict(
        ghz=med(ghz), main=med(mainloop) / 1e3, first=med(lat[:, 0]) / 1e3,
        cwait=med(cwait.sum(1)) / 1e3, cwait_kt=med(cwait[:, 1:]), waited=waited[:, 1:].double().mean().item(),
        pwait=med(pwait.sum(1)) / 1e3, pwait_kt=med(pwait) if pwait.numel() else 0.0,
        lat_waited=med(lat[:, 1:][waited[:, 1:]]) if waited[:, 1:].any() else float("nan"),
        lat_all=med(lat[:, 1:]), cadence=med(cadence),
        cadence_p90=torch.quantile(cadence.flatten(), 0.9).item(),
        end_spread=(main_end.max() - main_end.median()).item() / 1e3,
        sms=int(torch.unique(t[:, ROW_SM, 0]).numel()))


def main():
    TS = token_counts(os.environ.get("TS", "320"))
    MODES = os.environ.get("MODES", "full,load_only").split(",")
    EXTRA = [c for c in os.environ.get("CONFIGS", "").split(",") if c and c != "default"]
    STAGES = [int(n) for n in os.environ.get("STAGES", "").split(",") if n]
    RASTERS = [None if r == "engine" else r for r in os.environ.get("RASTER", "engine").split(",")]
    wsets = int(os.environ.get("WSETS", "0"))  # weight sets rotated (0: enough for twice L2; 1: L2-hot)
    shapes = [tuple(int(v) for v in sh.split("x")) for sh in os.environ.get("SHAPES", "8x512x2048").split(",")]
    traces = {}
    gpu_warmup()
    for G, R, Dg in shapes:
        ws = weight_sets(G, R, Dg)
        ws = ws[:wsets] if wsets else ws
        n = len(ws)
        reps = max(n, 8)
        for T in TS:
            o, y, ref = tokens_out_ref(T, G, R, Dg, ws[0])
            t_bmm = time_graph(lambda i: bmm_only(o, ws[i]), n, reps)
            cfgs = [WoASm90.config_for(T, G, R, Dg)]
            cfgs += [config_spec(spec) for spec in EXTRA]
            cfgs += [dict(c, max_stages=s) for s in STAGES for c in list(cfgs)]
            cfgs = [dict(c, raster=r) for r in RASTERS for c in cfgs]
            print(f"T={T} G={G} R={R} Dg={Dg}: bmm alone {t_bmm * 1e6:.2f} us", flush=True)
            for cfg in cfgs:
                if cfg.get("pingpong") or cfg.get("occupancy", 1) > 1:
                    print(f"  {cfg}: not traced (pingpong / two CTAs per SM)")
                    continue
                k_tiles = Dg // 64
                tls = torch.zeros(reps, MAX_CTAS, KT_ROWS, 4, device="cuda", dtype=torch.int64)
                for mode in MODES:
                    fn, stages = compile_ktrace(G, R, Dg, cfg, mode, cfg.get("raster"))

                    def call(i, r, fn=fn):
                        fn(jit.gmem_ptr(cutlass.BFloat16, o), jit.gmem_ptr(cutlass.BFloat16, ws[i % n]),
                           jit.gmem_ptr(cutlass.BFloat16, y), jit.gmem_ptr(cutlass.Int64, tls[r], 8), jit.i32(T),
                           jit.cu_stream())

                    if mode == "full":  # checked against FP32 on a poisoned y first
                        t, err = measure(lambda r: call(r, r), y, ref, reps)
                    else:
                        t, err = time_graph(lambda r: call(r, r), reps, reps), float("nan")
                    ctas = int((tls[-1, :, ROW_T, 0] != 0).sum().item())
                    sums = [summarize(tls[r].cpu(), ctas, k_tiles, stages) for r in range(reps // 2, reps)]
                    s = sorted(sums, key=lambda d: d["main"])[len(sums) // 2]
                    name = (f"G{G}R{R}Dg{Dg}T{T}_{cfg['tile_m']}x{cfg['tile_n']}_c{cfg.get('cluster_m', 1)}x"
                            f"{cfg.get('cluster_n', 1)}_s{stages}_{cfg.get('weight_l2_hint') or 'nohint'}"
                            f"{'_' + cfg['raster'] if cfg.get('raster') else ''}{'_hot' if wsets == 1 else ''}_{mode}")
                    if os.environ.get("OUT"):
                        traces[name] = tls[-1, :ctas].cpu()  # the last launch's trace
                        torch.save(traces, os.path.join(os.environ["OUT"], "ktraces.pt"))
                    print(f"  {name}: {t * 1e6:.2f} us ({t_bmm / t:.2f}x bmm, err {err:.1e}); {ctas} CTAs on "
                          f"{s['sms']} SMs at {s['ghz']:.2f} GHz; median CTA: mainloop {s['main']:.2f} us, first "
                          f"stage {s['first']:.2f} us after issue; consumer waits {s['cwait']:.2f} us in all "
                          f"({s['cwait_kt']:.0f} ns a k-tile, waited at {100 * s['waited']:.0f}% of k-tiles); "
                          f"producer waits {s['pwait']:.2f} us ({s['pwait_kt']:.0f} ns a k-tile); load issue->"
                          f"land {s['lat_waited']:.0f} ns where waited ({s['lat_all']:.0f} all); cadence "
                          f"{s['cadence']:.0f} ns (p90 {s['cadence_p90']:.0f}); last mainloop end "
                          f"+{s['end_spread']:.2f} us after the median", flush=True)
        ws = None


if __name__ == "__main__":
    main()
