#!/usr/bin/env bash
# Device calls for re-measuring the current tree (each phase fits one 600 s call):
#   phase 1: the whole GPU suite, the MoE layer bench (T = 1, 64, 384) and the indexer bench;
#   phase 2: the decode runtime's GPU tests, the small and slice configs (quick, both backends);
#   phase 3: the small config at the lengths (BS1 4096/1024, BS64 4096/2048) and the
#            slice verify step's kernel profile (BS1 and BS64);
#   phase 4: the slice config at the lengths (~220 s), then the whole GPU suite (~200 s);
#   phase 5: (staged before the seventh session) the latent (MLA-style) KV cache and the FP8 draft head
#            above 16 rows: their GPU tests, the slice config quick (each attention core on
#            the latent cache; the FP8 head) and the routed quantisation without padding
#            writes; phase 6: both at the lengths; phase 7: the MoE layer bench (its
#            quant columns with and without padding writes) and the whole GPU suite;
#   phase 8: the slice BS64 verify step's kernel profile on the latent cache at ~5100 positions;
#   phase 9: the masked-softmax kernel's tests and bench, the slice config at the issue's
#            lengths on the latent cache with the FP8 draft head; phase 10: the same with the
#            defaults that adopted both, and the fused BS64 verify step's profile;
#   phase 11: (staged) WO-A's tile x cluster sweep at T = 320 / 16384 against cuBLAS bmm alone;
#   phase 12: WO-A's programmatic-dependent-launch GPU tests, its bench (with a PDL column),
#            row bands at T = 320 against bmm alone (probe only: the bands lost, no kernel path);
#   phase 13: WO-A clusters at T = 16384 against bmm alone; the masked softmax's GPU tests and
#            bench after the review edit;
#   phase 14: WO-A with swapped operands (tokens on wgmma N): GPU tests and the tile sweep;
#   phase 15: clusters on the swapped tiles at T = 320 and on 128x256 at T = 4096; wo_a()'s
#            swapped config against the (T, R) tile at 64 < T <= 512;
#   phase 16: WO-A's and the runtime's GPU tests, the swapped configs with and without CTA pairs,
#            the bench (T = 16384 left out: its config is unchanged);
#   phase 17: two token tiles for the small-G*R shapes at 64 < T <= 256, swapped tiles at T = 64;
#   phase 18: WO-A's GPU tests and the bench at every T with the final mid-size configs;
#   phase 19: clusters on 128x256 at T = 4096 and 16384 in one call;
#   phase 20: two CTAs per SM for the swapped mid-size tiles and for 128x128 at T = 16384 (probe).
#   phase 21: large T with swapped operands (o read once), two CTAs per SM there and mid-T (probe).
#   phase 22: WO-A's and the runtime's GPU tests, the bench with two CTAs per SM at T = 272 / 320.
#   phase 23: 64x256 at two CTAs per SM against 128x256 at T = 1024 / 4096 / 16384 (probe).
#   phase 24: the engine's persistent tile loop: GPU tests, against 128x256 at T >= 1024 (probe).
#   phase 25: WO-A's and the runtime's GPU tests on the final tree.
#   phase 26: the project's own Hopper engine (cute_kernels/gemm/sm90_gemm.py, replacing the
#            vendored CUTLASS example): WO-A's and the FP8 draft head's GPU tests, then (only
#            if they pass) the WO-A bench at every T.
#   phase 27: the own engine's two-CTAs-per-SM configs at T = 272 / 320 (probe: 128x160 ran
#            slower at occupancy 2 in phase 26) and CTA pairs at T = 16384.
#   phase 28: narrower swapped tiles at two CTAs per SM (probe), then WO-A's, the draft head's
#            and the runtime's GPU tests and the WO-A bench with the mid-size configs at one
#            CTA per SM.
#   phase 29: WO-A's GPU tests (the runtime test model's shape added), 128x160 at two CTAs per
#            SM with warp 0 as the producer (probe), the runtime's GPU tests three times, the
#            draft head's and WO-A's benches (epilogue: one barrier per subtile but where a
#            buffer is reused).
#            (phase 28's latent-cache FP32-tracking test missed its statistical bound once).
#   phase 30: two CTAs per SM again for G=16 R=1024 at 256 < T <= 320 (inline producer): the
#            config's GPU tests, WO-A bench at T = 272 / 320 (twelfth session: with the
#            inline-producer build split by const_expr, so it has no producer-warp branch; all
#            of WO-A's and the draft head's GPU tests).
#   phase 31: the engine's persistent pingpong schedule: WO-A's and the draft head's GPU tests
#            (pingpong tests added), pingpong against 128x256 at T = 1024 / 4096 / 16384 and
#            against the swapped mid-size tiles at T = 320 (probe), the bench at T = 272 / 320,
#            the decode kernel's split counts at T = 1 / 5 against the launch floor (probe).
#   phase 32: the pingpong configs at T > 512 and the decode plan's one-CTA-per-SM splits as
#            defaults: WO-A's, the draft head's and the runtime's GPU tests, the WO-A bench.
#   phase 33: the decode kernel's cp.async pipeline depth (4 / 6 / 9 stages) at T = 1 / 5 / 64
#            against the launch floor and cuBLAS (probe).
#   phase 34: the decode plan (32-column tiles for G * R = 4096, 6 / 9 stages at one CTA per SM):
#            WO-A's decode / PDL GPU tests, the WO-A bench at the T, the runtime's GPU
#            tests, cuBLAS's kernel names per (shape, T) (baseline (b)'s schedule), the
#            engine's 32-column tiles at T = 64 (probe), the decode kernel's
#            column-tile / split / depth probe at T = 1 / 5.
#   phase 35: the decode plan from phase 34's probe (32-column tiles at 6 stages where they fit
#            one wave two per SM): WO-A's decode / PDL GPU tests, the bench at T = 1 / 5, the
#            runtime's GPU tests.
#   phase 42: FP8-weight WO-A with 256-wide K slices (GPU tests, bench), the whole GPU suite.
#   phase 43: the WO-A bench on the final tree.
#   phase 44: FP8-weight WO-A widening in registers (K-permuted 16-byte fragment loads, one
#            barrier a slice): its GPU tests (both widenings), the bench's variants (widening,
#            K slice, depth).
#   phase 45: the same with each CTA's block scales staged in shared memory once (no global
#            load inside the slice loop).
#   phase 46: independent MMA accumulator chains in both decode kernels: their GPU tests, the
#            decode kernel's plan with 1 / 2 / 4 chains (probe), the FP8 kernel's likewise.
#   phase 47: a per-CTA start of the decode kernels' K walk (rotate_k): GPU tests, the plan with
#            and without it (probe), the FP8 kernel likewise.
#   phase 48: the final tree: the decode kernels' GPU tests (bf16 and FP8), the 32-row decode
#            route (T = 17..32) with and without rotated K walks / two chains (probe).
#   phase 49: L2-only cp.async (cp.async.cg) for the decode kernel's streamed operands: its GPU
#            tests, the plan with and without it at T = 1 / 5 / 16 (probe; slower everywhere, the
#            option was removed after -- commit 3dd128e has it).
#   phase 50: the decode kernel's weight rows as cp.async.bulk copies under stage mbarriers
#            (bulk_w): its GPU tests (6 passed), the plan with and without it (probe; 1.5-2.9x
#            slower everywhere; the option was removed after -- commit 6a8e825 has it).
#   phase 51: the Hopper swap-AB decode kernel (wo_a_decode_sm90: TMA + wgmma, weight rows as M,
#            split-K): its GPU tests, then its plan and neighbours against wo_a() / the warp-MMA
#            decode kernel / bmm (probe).
#   phase 52: the read ceiling of each WO-A shape's weight bytes (row_rms, torch sum) and the
#            swap-AB decode kernel with 128-wide slices, 4 / 8 stages, 1 / 2 / 4 splits.
#   phase 53: the swap-AB decode kernel's splits as clusters (DSMEM sum): its GPU tests, then
#            splits 1 / 2 / 4 (cluster and global) x 4 / 6 / 8 stages x 64 / 128-wide slices.
#   phase 54: wo_a() routes 16 < T <= 32 (G=8 R=512) to the wgmma decode kernel: the WO-A GPU
#            tests, the bench at decode T with both decode kernels, the engine's swapped
#            64-row tiles with 32 / 64 token columns and CTA pairs at T = 64 (probe).
#   phase 55: the final tree (wgmma decode kernel for G=8 R=512 at T <= 32, swapped 64 x 32 CTA
#            pairs at 32 < T <= 64 there): the whole GPU suite, then the bench with
#            T = 20 / 32 added.
#   phase 56: the issue's bench again with a discarded warm-up graph per row (phase 55's first
#            timing of each row ran up to 0.8 us slow at decode T).
#   phase 57: T = 320 near cuBLAS.s G=8 R=512 schedule (128 x 80 swapped tiles, CTA pairs along
#            T sharing the weight tile; the engine needs N tiles of 32s: 128 x 96) and the other
#            swapped pairs; T = 64 pairs (probe).
#   phase 58: (seventeenth session, adopted) CTA pairs along R for the 64x64
#            tile at 32 < T <= 64 and along T for swapped 128 x 160 tiles at T = 257..320: the
#            WO-A GPU tests, the picks against the other pairing (probe), the bench.
#   phase 59: (seventeenth session, adopted) 64 x 128 (T, R) tiles in CTA pairs along R at 32 < T <= 64
#            (G=16 R=1024): their GPU tests, the pair against one CTA at T = 33 / 48 / 64 twice
#            (probe), the bench at those T (the run also had the whole GPU suite: now phase 60).
#   phase 60: the whole GPU suite alone (~400 s since the seventeenth session: phase 59's 330 s
#            step stopped it inside tests/test_wo_a.py; phases 1 / 4 / 55 budget less for it).
#   phase 61: (seventeenth session; commit bd7a5df, removed after it) the engine's split_k=2 --
#            a tile's K halves in a CTA pair summed through distributed shared memory: 10 GPU
#            tests passed, 1.2-1.7x the shipped T = 320 configs' time (probe, twice).
#   phase 62: the WO-A bench on the seventeenth session's final tree.
#   phase 63: the same with the bench's ours / (a) / (b) timed interleaved after a 0.5 s warm-up.
#   phase 64: (eighteenth session) the engine's debug timeline: its GPU tests, the per-CTA trace of
#            the shipped configs at T = 320 (full / mma_only / load_only) and T = 64 / 4096, then
#            the bench (the first GPU run of the c614d65 timing refactor).
#   phase 65: (the 16-column subtiles: commit 6e71e4a, removed after phase 69: 128x80 tied 64x160)
#            16-column epilogue subtiles (128x80 tiles, cuBLAS's G=8 R=512 T=320 tile): GPU tests,
#            the graph edges of back-to-back bmm / wo_a (is cuBLAS launched programmatically?),
#            the T = 320 traces with 128x80 pairs (raw traces under $OUT/traces).
#   phase 66: the graph edges of back-to-back bmm / wo_a, WO-A's GPU tests (the replay_fresh
#            helper, the 16-column subtiles), the G=8 R=512 T = 320 trace kept whole.
#   phase 67: an evict_first L2 hint on the engine's weight loads: GPU tests, then the shipped
#            configs with and without it at T = 64 / 320 / 4096 (timeline probe, full mode), twice.
#   phase 68: evict_first on the weights adopted at 32 < T <= 512: WO-A's GPU tests, the issue's
#            bench, the decode runtime's GPU tests.
#   phase 69: (commit 991892f, reverted after it) 256-row tiles (cuBLAS's 256x128 at T >= 1024):
#            4 GPU tests passed; within +-3% of the shipped 128x256 at T = 1024 / 4096 (probe).
#   phase 70: the eighteenth session's final tree: WO-A's and the FP8 draft head's GPU tests, the
#            issue's bench.
#   phase 71: the debug timeline's row clamp (a grid larger than the trace): its GPU tests.
#   phase 72: WO-A against bmm as Dg shrinks (fixed cost vs streaming rate, probe); (commit 4a93440,
#            reverted after it) the engine's early_loads (a CTA's own operand before the cluster
#            sync): 5 GPU tests passed, slower or equal at T = 64 / 320 (probe).
#   phase 73: WO-A's GPU tests, the indexer's and MoE experts' (defined, not run: phases
#            74 / 75 ran those tests).
#   phase 74: (probe) each k-tile's stage freed right after its own wgmma batch ("eager") and a
#            5-stage cap at T = 320 / 64; WO-A's GPU tests.
#   phase 75: at most 5 operand stages at 256 < T <= 512 adopted: WO-A's GPU tests, the issue's
#            bench, the indexer's and MoE experts' GPU tests (wgmma_fragments / tma_pipeline).
#   phase 76: (probe) T = 320 G=8 R=512: 64x160 in clusters 1x1 / 1x2 / 2x2 x stage caps 4-6 x hint.
#   phase 77: wo_a()'s wgmma decode kernel at T <= 16 for G=16 R=1024: routed GPU tests, bench T = 1 / 5.
#   phase 78: (probe) the PDL build at T = 320 / 4096 (Dg = 2048) launched as a programmatic
#            dependent, and launched as an ordinary kernel, against the ordinary build: traces kept.
#   phase 79: the engine's persistent cooperative schedule (128-row tiles, the next tile's loads
#            under the epilogue): its GPU tests, then against 128x256 at T = 1024 / 4096 (probe).
#   phase 80: (probe) paired A/B (configs and bmm interleaved within each trial) of the persistent
#            and pingpong schedules against wo_a()'s config at T = 1024 / 4096, Dg = 2048.
#   phase 81: pingpong CTA pairs at Dg = 2048 where its tiles number >= 3 per SM adopted: WO-A's
#            large-T / pingpong / persistent GPU tests, the bench, the paired A/B again.
#   phase 82: the final tree: WO-A's GPU tests; (probe) paired A/B at T = 320 (G=8) of the stage
#            cap, the pair's orientation and the weights' L2 hint.
#   phase 83: (probe) T = 320 G=8 R=512: 2x2 clusters at two CTAs' worth of shared memory per SM
#            (3 stages), so 32 four-CTA clusters can all be resident: paired A/B and timeline.
#   phase 84: (probe) k_rotate -- each cluster row starts its K walk at its own k-tile, so the
#            CTAs sharing a token tile are not on one k-tile at once: paired A/B at T = 64-512.
#            (ran on commit 7987dc1; the option was reverted after it -- slower at 11 of 14 points)
#   phase 85: the twentieth session's final tree: the whole GPU suite.
#   phase 86: wo_a()'s one routing rule (route) and the AOT build of every tile class: WO-A's and
#            the runtime's GPU tests, a first call's host cost compiled / loaded / steady.
#   phase 87: the twenty-first session's final tree (route, AOT classes, check_tensor reading
#            shape and strides once): the whole GPU suite.
#   phase 88: the per-k-tile clock64 trace of the T = 320 pipelines (tools/probe_wo_a_ktrace.py):
#            G=8 R=512 (0.88x bmm) against G=8 R=1024 (parity), full and load-only, 5 / 8 stages.
#   phase 89: the same trace with fewer CTAs (G = 2 / 4 / 8 at R=512 Dg=2048, T = 320): is the
#            load roof per SM or shared?
#   phase 90: the trace at T = 320 G=8 R=512 with the clusters walking the tiles in other orders
#            (RASTER), and with the weights L2-resident (WSETS=1; bmm then too).
#   phase 91: grids under one wave at 256 < T <= 512 (G = 2 / 4, outside the shapes):
#            the 5-stage cap and the 160-token tile against all stages and narrower tiles (A/B).
#   phase 92: the k-tile trace at T = 320 G=8 R=512 with and without multicast (64x160 1x1 / 2x1,
#            128x160 1x2): does the mainloop follow the L2 bytes a CTA issues or those it receives?
#   phase 93: the twenty-second session's final tree: the k-tile trace's GPU tests, then the
#            whole GPU suite.
#   phase 94: a K split inside a CTA pair, priced before building it: its per-CTA twin (G=8
#            R=1024 Dg=1024 128x160 tiles without a cluster: 128 CTAs, K = 1024, no multicast).
#   phase 95: after the closing review (the engine's stage waits as acquire_stage / wait_stage,
#            same sm_90a instruction text): the engine's GPU tests (WO-A, FP8 draft head).
#   phase 96: cuBLAS storing the token-major output itself (bmm into a strided out, ldc = G*R):
#            one kernel a call, checked on a poisoned y, timed against wo_a() and bmm alone
#            (tools/probe_wo_a_cublas_token_major.py); the bench with that as column (c).
#   phase 97: the same probe over T = 128 .. 2048 at the four shapes: where cuBLAS into the
#            token-major y is faster than wo_a()'s default path.
#   phase 98: the same probe on a T grid (16 / 32 / 48, 64 .. 2048 every 32, 2560 .. 3584), CSV out:
#            the measurements behind wo_a()'s cuBLAS bands.
#   phase 99: wo_a()'s cuBLAS bands (cute_kernels/wo_a_cublas.py): WO-A's and the runtime's GPU
#            tests, the bench (CuTe path column beside the default), the bench at
#            off-grid mid-size T.
#   phase 100: the cuBLAS-vs-CuTe probe on a finer T grid (8 .. 1024 every 8), CSV out: the
#            bands at a quarter of phase 98's spacing where the verify / prefill T live.
#   phase 101: the twenty-third session's final tree (the 8-token bands): the whole GPU suite, the
#            issue's bench, the bench at off-grid mid-size T.
#   phase 102: the cuBLAS-vs-CuTe probe at the other four supported shapes (Dg swapped: G=8 R=512
#            Dg=1024, G=8 R=1024 Dg=2048, G=16 R=512 Dg=1024, G=16 R=1024 Dg=2048), the same grids.
#   phase 103: the final tree (bands for all eight shapes): the cuBLAS route's GPU tests.
#   phase 104: the two single-kernel profile tests after the twenty-third session's review; the
#            engine's candidates for 512 < T <= 1024 (tokens on wgmma N as at T <= 512, in
#            ceil(T / 256) or one more token tiles; two CTAs per SM; a swapped pingpong) at
#            the eight supported shapes against the shipped config and bmm (probe_wo_a_ab).
#   phase 105: swapped 128-row tiles at 512 < T <= 1024 where G * R <= 8192 (wo_a_sm90's
#            mid_t_token_tile): the new routes' GPU tests; paired against both earlier configs
#            (pingpong 64x256, cooperative 128x256) and the other token tiling on a T grid.
#   phase 106: the refined mid-T token tiling (fewer waves, then less padding): the routes' GPU
#            tests; the cuBLAS-vs-CuTe probe at 512 < T <= 1024 on the six G * R <= 8192
#            shapes (CSV: those rows of bench/data/wo_a_cublas_sm90.csv re-measured).
#   phase 107: the final tree (mid-T tiling, the bands rebuilt from phase 106's rows): WO-A's and
#            the runtime's GPU tests, the bench at mid-size T off its grid.
#   phase 108: the engine's 16-column epilogue subtiles again (tiles an odd multiple of 16 wide):
#            GPU tests; the mid-T token tiles rounded to 16 instead of 32 against the shipped
#            tiling (probe), and swapped tiles at G=16 R=1024 just past T = 512 (probe).
#   phase 109: the mid-T token tiles in steps of 16, fewer waves then more tiles, and G=16 R=1024
#            up to T = 576: GPU tests; the rule against the other tilings on a T grid (probe);
#            the cuBLAS bands re-measured where the configs changed (CSV); the bench at mid T.
#   phase 110: the twenty-fourth session's final tree (the bands rebuilt from phase 109's rows):
#            the engine's GPU tests (WO-A, FP8 draft head) and the runtime's; the bench;
#            the bench at mid-size T.
#   phase 111: the bands with single-point holes filled (a narrow cuBLAS win between two clear
#            ones): the cuBLAS route's GPU tests, the bench at mid-size T.
#   phase 112: G=8 R=512 (both Dg) at 128 < T <= 512, where cuBLAS leads: token tiles in steps of
#            16 and 128-row weight tiles in fewer, larger CTAs against the shipped configs (probe).
#   phase 113: token tiles in steps of 16 at 256 < T <= 512 too: the routes' GPU tests (T = 400),
#            the eight shapes against the 32-step tiles (probe).
#   phase 114: token tiles in steps of 16 at 64 < T <= 256 against the shipped 32-step tiles
#            (probe); the cuBLAS bands' rows at 256 < T <= 512 re-measured against the 16-step
#            tiles (CSV), all eight shapes.
#   phase 115: token tiles in steps of 16 at 64 < T <= 256 as well: the bands' rows there
#            re-measured (CSV), then the whole GPU suite.
#   phase 116: the twenty-fifth session's final tree (bands rebuilt from phases 114 / 115): the
#            cuBLAS route's GPU tests, the bench, the bench at off-grid T <= 512.
#   device run (carry .devcache):  bash tools/device_next.sh N   (N = 1..116)
# Full logs under $OUT/*.log; the tail of each step on stdout. Run `python -m pyflakes` on the
# touched files before a device call: a NameError costs a cold start. The sixth session's
# runs (bench/RESULTS.md) used phases 2-4's commands.
set -u
source tools/device-env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
step() { local t=$1 name=$2; shift 2; echo "== $name: $*"; timeout "$t" "$@" > "$OUT/$name.log" 2>&1; STEP_RC=$?
  echo "rc=$STEP_RC"
  grep -v -e Warning -e _warn_once "$OUT/$name.log" | grep -v "^\s*$" | tail -14; }
PYT="python -m pytest -q -rf --tb=short -p no:cacheprovider"
BENCH="python -m spec_decode.bench --backends baseline,fused"
# WO-A's eight supported shapes (G x R x Dg), for the probes' SHAPES
EIGHT=16x1024x1024,8x512x2048,16x512x2048,8x1024x1024,8x512x1024,8x1024x2048,16x512x1024,16x1024x2048
case "${1:-1}" in
116)  # the final tree: the cuBLAS route's GPU tests, the bench, off-grid T <= 512
  step 120 cublas_tests $PYT tests/test_wo_a.py -m gpu -k "cublas or backend or aot_entries"
  step 140 bench_wo_a python bench/bench_wo_a.py --tokens 1,5,64,320,4096,16384 --out "$OUT/bench_wo_a.md"
  step 110 bench_wo_a_low python bench/bench_wo_a.py --tokens 80,150,200,240,333,400,480 --out "$OUT/bench_wo_a_low.md"
  ;;
115)  # 16-step token tiles from T = 65: the bands' rows at 64 < T <= 256 (CSV), the whole GPU suite
  step 140 probe_cublas_tm_72_256 env SHAPES=$EIGHT TS=72:256:8 TRIALS=15 CSV="$OUT/cublas_tm_72_256.csv" \
    python tools/probe_wo_a_cublas_token_major.py
  step 430 gpu_suite $PYT tests -m gpu
  ;;
114)  # 16-step token tiles at 64 < T <= 256 (probe); the bands' rows at 256 < T <= 512 (CSV)
  step 230 probe_16_step_low env SHAPES=$EIGHT TS=80,112,144,176,208,240 TRIALS=15 CONFIGS="tile_n=shipped16" \
    python tools/probe_wo_a_ab.py
  step 300 probe_cublas_tm_264_512 env SHAPES=$EIGHT TS=264:512:8 TRIALS=15 CSV="$OUT/cublas_tm_264_512.csv" \
    python tools/probe_wo_a_cublas_token_major.py
  ;;
113)  # 16-step token tiles at 256 < T <= 512: GPU tests, against the 32-step tiles (probe)
  step 100 tests_400 $PYT tests/test_wo_a.py -m gpu -k "hopper_matches_fp64 and 400"
  step 200 probe_16_step env SHAPES=16x1024x1024,8x512x2048,16x512x2048,8x1024x1024,8x512x1024,8x1024x2048,16x512x1024,16x1024x2048 \
    TS=272,336,400,464,480 TRIALS=15 CONFIGS="tile_n=auto" python tools/probe_wo_a_ab.py
  ;;
112)  # G=8 R=512 at 128 < T <= 512: 16-step token tiles, 128-row weight tiles (probe)
  step 200 probe_g8r512 env SHAPES=8x512x2048,8x512x1024 TS=160,240,320,400,480 TRIALS=15 \
    CONFIGS="tile_n=auto16/tile_m=128,tile_n=auto16+1/tile_m=128,tile_n=auto16+2" python tools/probe_wo_a_ab.py
  ;;
111)  # holes in the bands filled: the cuBLAS route's GPU tests, the bench at mid-size T
  step 120 cublas_tests $PYT tests/test_wo_a.py -m gpu -k "cublas or backend or aot_entries"
  step 100 bench_wo_a_mid python bench/bench_wo_a.py --tokens 517,600,700,800,900,1000 --out "$OUT/bench_wo_a_mid.md"
  ;;
110)  # the final tree: the engine's and the runtime's GPU tests, the bench, mid-size T
  step 260 engine_tests $PYT tests/test_wo_a.py tests/test_draft_head_fp8.py -m gpu
  step 60 runtime_tests $PYT tests/test_spec_decode.py -m gpu
  step 130 bench_wo_a python bench/bench_wo_a.py --tokens 1,5,64,320,4096,16384 --out "$OUT/bench_wo_a.md"
  step 100 bench_wo_a_mid python bench/bench_wo_a.py --tokens 517,600,700,800,900,1000 --out "$OUT/bench_wo_a_mid.md"
  ;;
109)  # mid-T tiles in steps of 16: GPU tests, the rule on a T grid, the bands' rows, the bench at mid T
  step 120 mid_t_tests $PYT tests/test_wo_a.py -m gpu -k "mid_t_swapped or 16_column or large_t_long_k"
  SIX=8x512x2048,16x512x2048,8x1024x1024,8x512x1024,8x1024x2048,16x512x1024
  step 200 probe_mid_t_v3 env SHAPES=$SIX TS=528:1008:32 TRIALS=11 \
    CONFIGS="tile_n=auto/tile_n=auto+1/tile_n=auto16/tile_n=auto16+1" python tools/probe_wo_a_ab.py
  step 60 probe_mid_t_v3_g16 env SHAPES=16x1024x1024,16x1024x2048 TS=528:576:16 TRIALS=11 \
    CONFIGS="tile_n=auto16/tile_n=auto16+1/swap_ab=0,pingpong=1,tile_m=64,tile_n=256,cluster_m=2,weight_l2_hint=none" \
    python tools/probe_wo_a_ab.py
  step 150 probe_cublas_tm_mid env SHAPES=$SIX TS=520:1024:8 TRIALS=15 CSV="$OUT/cublas_tm_mid.csv" \
    python tools/probe_wo_a_cublas_token_major.py
  step 40 probe_cublas_tm_mid_g16 env SHAPES=16x1024x1024,16x1024x2048 TS=520:576:8 TRIALS=15 \
    CSV="$OUT/cublas_tm_mid_g16.csv" python tools/probe_wo_a_cublas_token_major.py
  step 100 bench_wo_a_mid python bench/bench_wo_a.py --tokens 517,600,700,800,900,1000 --out "$OUT/bench_wo_a_mid.md"
  ;;
108)  # 16-column subtiles: GPU tests; token tiles in steps of 16 at mid T (probe)
  step 150 sub16_tests $PYT tests/test_wo_a.py -m gpu -k "16_column or swap_ab_engine or mid_t_swapped"
  step 300 probe_mid_t16 env SHAPES=8x512x2048,16x512x2048,8x1024x1024,8x512x1024,8x1024x2048,16x512x1024 \
    TS=520,600,680,700,840,900 TRIALS=15 CONFIGS="tile_n=auto16/tile_n=auto16+1/tile_n=auto/tile_n=auto+1" \
    python tools/probe_wo_a_ab.py
  SW="swap_ab=1,pingpong=0,cluster_n=none,cluster_m=2,tile_m=128,weight_l2_hint=evict_first"
  step 120 probe_g16r1024 env SHAPES=16x1024x1024,16x1024x2048 TS=520,560,600 TRIALS=15 \
    CONFIGS="$SW,tile_n=auto/$SW,tile_n=auto16/$SW,tile_n=auto16+1" python tools/probe_wo_a_ab.py
  ;;
107)  # the final tree: WO-A's and the runtime's GPU tests, the bench at mid-size T
  step 300 wo_a_tests $PYT tests/test_wo_a.py -m gpu
  step 90 runtime_tests $PYT tests/test_spec_decode.py -m gpu
  step 150 bench_wo_a_mid python bench/bench_wo_a.py --tokens 517,600,700,800,900,1000 --out "$OUT/bench_wo_a_mid.md"
  ;;
106)  # refined mid-T tiling: its GPU tests; cuBLAS bands re-measured where the CuTe configs changed
  step 120 mid_t_tests $PYT tests/test_wo_a.py -m gpu -k "mid_t_swapped or large_t_long_k or cublas_route"
  step 470 probe_cublas_tm_mid env SHAPES=8x512x2048,16x512x2048,8x1024x1024,8x512x1024,8x1024x2048,16x512x1024 \
    TS=520:1024:8 TRIALS=15 CSV="$OUT/cublas_tm_mid.csv" python tools/probe_wo_a_cublas_token_major.py
  ;;
105)  # mid-T swapped routes: GPU tests; the rule against the earlier configs on a T grid
  step 150 mid_t_tests $PYT tests/test_wo_a.py -m gpu -k "mid_t_swapped or large_t_long_k or launch_configs"
  step 420 probe_mid_t_rule env SHAPES=8x512x2048,16x512x2048,8x1024x1024,8x512x1024,8x1024x2048,16x512x1024 \
    TS=544,608,672,736,800,864,928,992,1024 TRIALS=11 CONFIGS="tile_n=auto/tile_n=auto+1/swap_ab=0,pingpong=1,tile_m=64,tile_n=256,cluster_m=2,weight_l2_hint=none/swap_ab=0,tile_m=128,tile_n=256,cluster_m=none,weight_l2_hint=none" \
    python tools/probe_wo_a_ab.py
  ;;
104)  # the refactored profile tests; mid-T engine candidates, paired against the shipped config
  step 120 profile_tests $PYT tests/test_wo_a.py -m gpu -k "single_kernel or one_kernel"
  SW="swap_ab=1,pingpong=0,cluster_n=none,cluster_m=2"
  step 460 probe_mid_t env SHAPES=16x1024x1024,8x512x2048,16x512x2048,8x1024x1024,8x512x1024,8x1024x2048,16x512x1024,16x1024x2048 \
    TS=520,640,800,960 TRIALS=15 CONFIGS="$SW,tile_m=128,tile_n=auto,weight_l2_hint=evict_first/$SW,tile_m=128,tile_n=auto/$SW,tile_m=128,tile_n=auto+1,weight_l2_hint=evict_first/$SW,tile_m=64,tile_n=auto,weight_l2_hint=evict_first/$SW,tile_m=64,tile_n=auto+1,occupancy=2,weight_l2_hint=evict_first/swap_ab=1,pingpong=1,cluster_n=none,cluster_m=2,tile_m=64,tile_n=auto" \
    python tools/probe_wo_a_ab.py
  ;;
1)
  step 240 gpu_suite $PYT tests -m gpu
  step 150 bench_moe python bench/bench_moe_experts.py --tokens 1,64,384 --out "$OUT/bench_moe.md"
  step 100 bench_indexer python bench/bench_indexer.py --out "$OUT/bench_indexer.md"
  ;;
2)
  step 100 spec_tests $PYT tests/test_spec_decode.py -m gpu -s
  step 120 spec_small $BENCH --model small --quick --out "$OUT/spec_small.md"
  step 120 spec_slice $BENCH --model slice --quick --out "$OUT/spec_slice.md"
  ;;
3)
  step 250 spec_small_full $BENCH --model small --out "$OUT/spec_small_full.md"
  step 100 probe_profile_bs1 python tools/probe_slice_profile.py
  step 100 probe_profile_bs64 env B=64 python tools/probe_slice_profile.py
  ;;
4)
  step 300 spec_slice_full $BENCH --model slice --out "$OUT/spec_slice_full.md"
  step 250 gpu_suite $PYT tests -m gpu
  ;;
5)  # the latent KV cache and the FP8 draft head above 16 rows -- GPU tests, slice quick
  step 150 staged_tests $PYT tests/test_spec_decode.py tests/test_draft_head_fp8.py tests/test_moe_quant.py -m gpu -s
  step 90 spec_slice_latent_dense $BENCH --model slice --quick --kv-cache latent --attention-core masked_dense --out "$OUT/spec_slice_latent_dense.md"
  step 90 spec_slice_latent_gather $BENCH --model slice --quick --kv-cache latent --attention-core gather --out "$OUT/spec_slice_latent_gather.md"
  step 60 bench_draft_head python bench/bench_draft_head.py --out "$OUT/bench_draft_head.md"
  step 90 spec_slice_fp8_head $BENCH --model slice --quick --draft-head mxfp8+fp8 --out "$OUT/spec_slice_fp8_head.md"
  ;;
6)  # then the slice config at the lengths with the latent cache (and the FP8 head if it won)
  step 280 spec_slice_full_latent $BENCH --model slice --kv-cache latent --out "$OUT/spec_slice_full_latent.md"
  step 280 spec_slice_full_latent_fp8 $BENCH --model slice --kv-cache latent --draft-head mxfp8+fp8 --out "$OUT/spec_slice_full_latent_fp8.md"
  ;;
7)  # the MoE layer with the routed quantisation's padding rows unwritten (quant columns), GPU suite
  step 150 bench_moe python bench/bench_moe_experts.py --tokens 1,64,384 --out "$OUT/bench_moe.md"
  step 250 gpu_suite $PYT tests -m gpu
  ;;
8)  # where the slice BS64 verify step's time goes on the latent cache at the lengths
  step 200 profile_latent_dense env B=64 AT=5100 KV_CACHE=latent CORE=masked_dense python tools/probe_slice_profile.py
  step 120 profile_latent_gather env B=64 AT=5100 KV_CACHE=latent CORE=gather BACKENDS=fused python tools/probe_slice_profile.py
  ;;
9)  # the masked-softmax kernel in the latent core; the slice config at the lengths with it
  step 150 softmax_tests $PYT tests/test_masked_softmax.py tests/test_spec_decode.py -m gpu -s
  step 60 bench_masked_softmax python bench/bench_masked_softmax.py --out "$OUT/bench_masked_softmax.md"
  step 300 spec_slice_full_latent_fp8 $BENCH --model slice --kv-cache latent --draft-head mxfp8+fp8 --out "$OUT/spec_slice_full_latent_fp8.md"
  ;;
10)  # the slice config at the lengths with the defaults (latent cache, FP8 draft head above 16 rows)
  step 300 spec_slice_full $BENCH --model slice --out "$OUT/spec_slice_full.md"
  step 100 profile_bs64 env B=64 AT=5100 BACKENDS=fused python tools/probe_slice_profile.py
  ;;
11)  # issue 4: WO-A tiles x thread-block clusters (TMA multicast) at T = 320 and 16384, against bmm alone
  step 400 probe_wo_a_clusters env TS=320,16384 TILES=128x256,128x128,64x256 CLUSTERS=1x1,2x1,1x2 python tools/probe_wo_a_tiles.py
  # and the masked softmax after the review's block-reduction edit (tests + re-timing)
  step 80 softmax_tests $PYT tests/test_masked_softmax.py -m gpu
  step 60 bench_masked_softmax python bench/bench_masked_softmax.py --out "$OUT/bench_masked_softmax.md"
  ;;
12)  # issue 4: WO-A's PDL GPU tests, the bench (PDL column), row bands at T = 320 (probe)
  step 110 wo_a_pdl_tests $PYT tests/test_wo_a.py -m gpu -k "pdl or every_split"
  step 300 bench_wo_a python bench/bench_wo_a.py --out "$OUT/bench_wo_a.md"
  step 150 probe_wo_a_bands env TS=320 TILES=128x256,128x128,64x128 BANDS=256:128x256+64:64x128,256:128x256+64:64x64,256:128x256+64:64x256 python tools/probe_wo_a_tiles.py
  ;;
13)  # issue 4: clusters (TMA multicast) at T = 16384; the masked softmax's GPU tests after the review edit
  step 200 probe_wo_a_clusters env TS=16384 TILES=128x256 CLUSTERS=1x1,2x1,1x2 python tools/probe_wo_a_tiles.py
  step 80 softmax_tests $PYT tests/test_masked_softmax.py -m gpu
  step 60 bench_masked_softmax python bench/bench_masked_softmax.py --out "$OUT/bench_masked_softmax.md"
  ;;
14)  # issue 4: WO-A with swapped operands (tokens on wgmma N, any multiple of 32): GPU tests, tile sweep
  step 100 wo_a_swap_tests $PYT tests/test_wo_a.py -m gpu -k "swap"
  step 400 probe_wo_a_swap env TS=64,320,4096 TILES=64x64,64x128,64x256,128x256 SWAP_TILES=128x160,64x160,128x64,64x64,128x96,128x128,128x192,128x256 python tools/probe_wo_a_tiles.py
  ;;
15)  # issue 4: thread-block clusters (TMA multicast) on the swapped tiles at T = 320, on 128x256 at T = 4096
  step 250 probe_wo_a_swap_clusters env TS=320 TILES=128x256 SWAP_TILES=128x160,64x160,128x192 CLUSTERS=1x1,2x1,1x2,2x2 python tools/probe_wo_a_tiles.py
  step 200 probe_wo_a_clusters_4096 env TS=4096 TILES=128x256 CLUSTERS=1x1,2x1,1x2 python tools/probe_wo_a_tiles.py
  step 150 probe_wo_a_picks env TS=65,77,96,128,200,256,400,512 PICKS=1 python tools/probe_wo_a_tiles.py
  ;;
16)  # issue 4: WO-A's GPU tests with the swapped mid-size configs, their clusters per T, the bench
  step 120 wo_a_tests $PYT tests/test_wo_a.py -m gpu
  step 110 spec_gpu_tests $PYT tests/test_spec_decode.py -m gpu  # the BS64 verify step is T = 320
  step 90 probe_wo_a_pick_clusters env TS=77,128,200,320,400 PICKS=1 CLUSTERS=1x1,2x1 python tools/probe_wo_a_tiles.py
  step 240 bench_wo_a python bench/bench_wo_a.py --tokens 1,5,64,96,200,320,4096 --out "$OUT/bench_wo_a.md"
  ;;
17)  # issue 4: more CTAs for the small-G*R shapes -- two token tiles at 64 < T <= 256, and at T = 64
  step 120 probe_wo_a_small_gr env TS=96,200 TILES=64x64 SWAP_TILES=64x96,64x64,64x128,64x224 CLUSTERS=1x1,2x1 python tools/probe_wo_a_tiles.py
  step 120 probe_wo_a_t64 env TS=64 TILES=64x64,64x128 SWAP_TILES=64x32,128x32,64x64 CLUSTERS=1x1,1x2,2x1 python tools/probe_wo_a_tiles.py
  ;;
18)  # issue 4: the final mid-size configs -- WO-A's GPU tests, the bench at every T
  step 120 wo_a_tests $PYT tests/test_wo_a.py -m gpu
  step 300 bench_wo_a python bench/bench_wo_a.py --tokens 1,5,64,96,200,320,4096,16384 --out "$OUT/bench_wo_a.md"
  ;;
19)  # issue 4: clusters for the large-T tile once more (both T), to settle the G = 8 shapes
  step 60 wo_a_one_kernel $PYT tests/test_wo_a.py -m gpu -k no_transpose
  step 300 probe_wo_a_clusters_large env TS=4096,16384 TILES=128x256 CLUSTERS=1x1,1x2,2x1 python tools/probe_wo_a_tiles.py
  ;;
20)  # issue 4: two CTAs per SM (fewer stages) for the swapped mid-size tiles -- epilogue overlap
  step 260 probe_wo_a_occupancy env TS=200,320 TILES=128x256 SWAP_TILES=128x160,64x160,128x224,64x224 CLUSTERS=2x1 OCCUPANCY=1,2 python tools/probe_wo_a_tiles.py
  # the large-T tile's epilogue is not overlapped (non-persistent kernel): 128x128 at two CTAs
  # per SM (64 accumulator registers a thread leaves room for the second CTA) against 128x256
  step 220 probe_wo_a_occupancy_large env TS=16384 TILES=128x256,128x128 OCCUPANCY=1,2 python tools/probe_wo_a_tiles.py
  ;;
21)  # issue 4: large T with the weight rows on M (swap AB: consecutive CTAs share one token tile,
     # so o is read from DRAM once, not R/tile_n times), x two CTAs per SM; mid-T two CTAs per SM
  step 240 probe_wo_a_swap_large env TS=4096,16384 TILES=128x256,128x128 SWAP_TILES=128x256,128x128 OCCUPANCY=1,2 python tools/probe_wo_a_tiles.py
  step 120 probe_wo_a_swap_large_cluster env TS=16384 TILES=128x256 SWAP_TILES=128x256,128x128 CLUSTERS=2x1 OCCUPANCY=1,2 python tools/probe_wo_a_tiles.py
  step 150 probe_wo_a_mid_occupancy env TS=272,320,384,448 PICKS=1 OCCUPANCY=1,2 python tools/probe_wo_a_tiles.py
  ;;
22)  # issue 4: two CTAs per SM for G=16 R=1024 at 256 < T <= 320 -- WO-A's and the runtime's GPU
     # tests (the slice config's BS64 verify step is that launch), the bench at every T
  step 200 wo_a_tests $PYT tests/test_wo_a.py -m gpu
  step 100 spec_tests $PYT tests/test_spec_decode.py -m gpu
  step 300 bench_wo_a python bench/bench_wo_a.py --tokens 1,5,64,96,200,272,320,4096,16384 --out "$OUT/bench_wo_a.md"
  ;;
23)  # issue 4: 64x256 tiles (one consumer warp group, 152 registers) at two CTAs per SM against
     # 128x256 at large T -- one CTA's epilogue and prologue under the other's mainloop
  step 60 wo_a_occupancy_tests $PYT tests/test_wo_a.py -m gpu -k "two_ctas or launch or swap_ab_engine"
  step 300 probe_wo_a_large_64x256 env TS=1024,4096,16384 TILES=128x256,64x256 OCCUPANCY=1,2 python tools/probe_wo_a_tiles.py
  ;;
24)  # issue 4: the engine's persistent tile loop (next tile's loads under this tile's epilogue):
     # its GPU tests (a hang ends at the step's timeout), then against 128x256 per tile at large T
  step 120 wo_a_persistent_tests $PYT tests/test_wo_a.py -m gpu -k persistent
  step 300 probe_wo_a_persistent env TS=1024,4096,16384 TILES=128x256 PERSISTENT=0,132 python tools/probe_wo_a_tiles.py
  ;;
25)  # issue 4: the final tree -- WO-A's GPU tests (all, including the persistent loop's) and the runtime's
  step 200 wo_a_tests $PYT tests/test_wo_a.py -m gpu
  step 100 spec_tests $PYT tests/test_spec_decode.py -m gpu
  ;;
26)  # the project's own Hopper engine: correctness first (a hang ends at the step's timeout)
  step 200 wo_a_tests $PYT -x tests/test_wo_a.py -m gpu
  ok=$STEP_RC
  step 60 draft_head_tests $PYT tests/test_draft_head_fp8.py -m gpu
  [ "$ok" = 0 ] && step 300 bench_wo_a python bench/bench_wo_a.py --tokens 1,5,64,96,200,272,320,4096,16384 --out "$OUT/bench_wo_a.md"
  ;;
27)  # the own engine: occupancy 1 vs 2 on the swapped mid-size tiles, clusters at large T
  step 260 probe_wo_a_occupancy env TS=272,320 TILES=128x256 SWAP_TILES=128x160,64x160 CLUSTERS=2x1 OCCUPANCY=1,2 python tools/probe_wo_a_tiles.py
  step 250 probe_wo_a_clusters_large env TS=16384 TILES=128x256 CLUSTERS=1x1,2x1,1x2 python tools/probe_wo_a_tiles.py
  ;;
28)  # the own engine's final mid-size configs (one CTA per SM): narrower tiles probed first
  step 120 probe_wo_a_narrow env TS=272,320 TILES=128x256 SWAP_TILES=128x160,128x96,128x128 CLUSTERS=2x1 OCCUPANCY=1,2 python tools/probe_wo_a_tiles.py
  step 150 wo_a_tests $PYT tests/test_wo_a.py -m gpu
  step 60 draft_head_tests $PYT tests/test_draft_head_fp8.py -m gpu
  step 120 spec_tests $PYT tests/test_spec_decode.py -m gpu
  step 200 bench_wo_a python bench/bench_wo_a.py --tokens 1,5,64,96,200,272,320,4096,16384 --out "$OUT/bench_wo_a.md"
  ;;
29)  # WO-A at spec_decode SMALL's shape; two CTAs per SM with the inline producer (8 warps);
     # the runtime's GPU tests, three seeds
  step 120 probe_wo_a_occupancy env TS=272,320 TILES=128x256 SWAP_TILES=128x160 CLUSTERS=2x1 OCCUPANCY=1,2 python tools/probe_wo_a_tiles.py
  step 100 wo_a_tests $PYT tests/test_wo_a.py -m gpu
  for i in 1 2 3; do step 90 spec_tests_$i $PYT tests/test_spec_decode.py -m gpu -k "track_fp32" -s; done
  step 90 spec_tests $PYT tests/test_spec_decode.py -m gpu
  step 90 bench_draft_head python bench/bench_draft_head.py --out "$OUT/bench_draft_head.md"
  step 200 bench_wo_a python bench/bench_wo_a.py --tokens 1,5,64,96,200,272,320,4096,16384 --out "$OUT/bench_wo_a.md"
  ;;
32)  # the new defaults: tests, then the bench at every T of the issue
  step 200 wo_a_tests $PYT tests/test_wo_a.py tests/test_draft_head_fp8.py -m gpu
  [ "$STEP_RC" = 0 ] || exit 1
  step 250 bench_wo_a python bench/bench_wo_a.py --tokens 1,5,64,1024,4096,16384 --out "$OUT/bench_wo_a.md"
  step 120 spec_tests $PYT tests/test_spec_decode.py -m gpu
  ;;
31)  # pingpong: tests, then probes at large and mid-size T, then phase 30's bench
  step 200 wo_a_tests $PYT tests/test_wo_a.py tests/test_draft_head_fp8.py -m gpu
  [ "$STEP_RC" = 0 ] || exit 1
  step 190 probe_pingpong_large env TS=1024,4096,16384 TILES=128x256 PINGPONG_TILES=64x256 CLUSTERS=1x1,2x1 \
    python tools/probe_wo_a_tiles.py
  step 70 bench_wo_a python bench/bench_wo_a.py --tokens 272,320 --out "$OUT/bench_wo_a.md"
  step 90 probe_pingpong_mid env TS=200,320 TILES=128x256 SWAP_TILES=128x160 PINGPONG_SWAP_TILES=64x160,64x224 \
    CLUSTERS=2x1 python tools/probe_wo_a_tiles.py
  step 100 probe_decode_splits env TS=1,5 python tools/probe_wo_a_decode.py
  ;;
33)  # the decode kernel's pipeline depth (stages - 1 K slices in flight per CTA) at decode T
  step 360 probe_decode_stages env TS=1,5,64 SPLITS=1,2 STAGES=4,6,9 python tools/probe_wo_a_decode.py
  ;;
34)  # the decode plan with 32-column tiles and deep pipelines: tests, the bench, the probe
  step 150 wo_a_decode_tests $PYT tests/test_wo_a.py -m gpu -k "decode or pdl or no_transpose"
  [ "$STEP_RC" = 0 ] || exit 1
  step 200 bench_wo_a python bench/bench_wo_a.py --tokens 1,5,64,320,4096,16384 --out "$OUT/bench_wo_a.md"
  step 60 spec_tests $PYT tests/test_spec_decode.py -m gpu
  step 40 probe_cublas_kernels python tools/probe_cublas_kernels.py
  step 90 probe_t64_narrow env TS=64 TILES=64x32,64x64,64x128 CLUSTERS=1x1,1x2 python tools/probe_wo_a_tiles.py
  step 240 probe_decode_bn env TS=1,5 SPLITS=1,2 STAGES=4,6,9,17 BNS=32,64 python tools/probe_wo_a_decode.py
  ;;
35)  # the decode plan from phase 34's probe (32-column tiles at 6 stages up to 290 tiles): tests, bench at T <= 5
  step 120 wo_a_decode_tests $PYT tests/test_wo_a.py -m gpu -k "decode or pdl"
  [ "$STEP_RC" = 0 ] || exit 1
  step 240 bench_wo_a python bench/bench_wo_a.py --tokens 1,5,64,320,4096,16384 --out "$OUT/bench_wo_a.md"
  step 60 spec_tests $PYT tests/test_spec_decode.py -m gpu
  ;;
36)  # the engine's producer-tail cluster exit (tests, probe at T = 320 / 4096), PDL after cuBLAS, 128x96 pairs at T = 320
  step 130 wo_a_exit_tests $PYT tests/test_wo_a.py -m gpu -k "cluster_exit"
  step 180 probe_exits env TS=320,4096 PICKS=1 EXITS=barrier,producer_tail python tools/probe_wo_a_tiles.py
  step 60 spec_tests $PYT tests/test_spec_decode.py -m gpu
  step 100 probe_pdl_runtime python tools/probe_wo_a_pdl_runtime.py
  step 90 probe_t320_swap env TS=320 TILES=64x64 SWAP_TILES=128x96,64x160 CLUSTERS=2x1,1x2 python tools/probe_wo_a_tiles.py
  ;;
37)  # the producer-tail exit as the cooperative kernel's default: every WO-A / draft-head GPU test, the bench
  step 200 wo_a_tests $PYT tests/test_wo_a.py tests/test_draft_head_fp8.py -m gpu
  [ "$STEP_RC" = 0 ] || exit 1
  step 200 bench_wo_a python bench/bench_wo_a.py --tokens 1,5,64,320,4096,16384 --out "$OUT/bench_wo_a.md"
  step 60 spec_tests $PYT tests/test_spec_decode.py -m gpu
  ;;
38)  # the decode kernel with 8 warps (option removed after this run: WARPS is ignored now): tests, probe at T = 20 / 64, bench
  step 90 decode_warps_tests $PYT tests/test_wo_a.py -m gpu -k "every_split"
  [ "$STEP_RC" = 0 ] || exit 1
  step 240 probe_decode_warps env TS=20,64 SPLITS=1,2 STAGES=4 WARPS=4,8 PDL=0 python tools/probe_wo_a_decode.py
  step 90 bench_wo_a python bench/bench_wo_a.py --tokens 20,64 --out "$OUT/bench_wo_a.md"
  ;;
39)  # the decode kernel's 32-row token tile (17 <= T <= 32): GPU tests, probe and bench at T = 20 / 32
  step 120 decode_tests $PYT tests/test_wo_a.py -m gpu -k "decode_kernel"
  [ "$STEP_RC" = 0 ] || exit 1
  step 200 probe_decode_bm32 env TS=20,32 SPLITS=1,2 STAGES=4,6 BNS=32,64 PDL=0 python tools/probe_wo_a_decode.py
  step 90 bench_wo_a python bench/bench_wo_a.py --tokens 20,32 --out "$OUT/bench_wo_a.md"
  ;;
40)  # 128-element k-tiles (k_steps=8, option removed after this run: KSTEPS is ignored now) at T = 320; decode / runtime tests
  step 150 wo_a_tests $PYT tests/test_wo_a.py -m gpu -k "decode_kernel or eight_k_steps"
  step 130 probe_ksteps env TS=320 TILES=64x64 SWAP_TILES=128x160,64x160 CLUSTERS=2x1 KSTEPS=4,8 \
    python tools/probe_wo_a_tiles.py
  step 60 spec_tests $PYT tests/test_spec_decode.py -m gpu
  ;;
41)  # wo_a() routes 16 < T <= 32 to the decode kernel where 64-column engine tiles leave SMs idle: tests, bench
  step 120 wo_a_tests $PYT tests/test_wo_a.py -m gpu -k "hopper_matches"
  step 90 bench_wo_a python bench/bench_wo_a.py --tokens 17,20,32 --out "$OUT/bench_wo_a.md"
  ;;
42)  # FP8-weight WO-A with 256-wide K slices too (GPU tests, bench), then the whole GPU suite on the final tree
  step 90 wo_a_fp8_tests $PYT tests/test_wo_a_fp8.py -m gpu
  step 120 bench_wo_a_fp8 python bench/bench_wo_a_fp8.py --bk 128,256 --out "$OUT/bench_wo_a_fp8.md"
  step 400 gpu_suite $PYT tests -m gpu
  ;;
43)  # the WO-A bench on the final tree
  step 200 bench_wo_a python bench/bench_wo_a.py --tokens 1,5,64,320,4096,16384 --out "$OUT/bench_wo_a.md"
  ;;
44)  # FP8-weight WO-A widened in registers: GPU tests, then the variants side by side
  step 150 wo_a_fp8_tests $PYT tests/test_wo_a_fp8.py -m gpu
  step 300 bench_wo_a_fp8 python bench/bench_wo_a_fp8.py \
    --variants registers/128/plan,smem/128/plan,registers/128/x2,registers/256/plan,registers/256/x2 \
    --out "$OUT/bench_wo_a_fp8.md"
  ;;
72)  # WO-A fixed cost vs K (probe); early loads: GPU tests, the shipped configs with / without them
  step 150 fixed_cost env TS=320,64 SHAPES=8x512,16x1024 DGS=64,256,1024,2048 python tools/probe_wo_a_fixed_cost.py
  # early_loads ran on commit 4a93440 (reverted after it)
  step 100 early_tests $PYT tests/test_wo_a.py -m gpu -k "early_loads"
  step 250 probe_early env TS=64,320 MODES=full EARLY=1 python tools/probe_wo_a_timeline.py
  ;;
103)  # the final tree: the cuBLAS route's GPU tests
  step 150 cublas_tests $PYT tests/test_wo_a.py -m gpu -k "cublas or backend or aot_entries"
  ;;
102)  # the cuBLAS bands at the other four supported shapes
  OTHER=8x512x1024,8x1024x2048,16x512x1024,16x1024x2048
  step 300 probe_cublas_tm_other_fine env SHAPES=$OTHER TS=8:1024:8 TRIALS=15 CSV="$OUT/cublas_tm_other_fine.csv" \
    python tools/probe_wo_a_cublas_token_major.py
  step 150 probe_cublas_tm_other_grid env SHAPES=$OTHER TS=1056:2048:32 TRIALS=15 CSV="$OUT/cublas_tm_other_grid.csv" \
    python tools/probe_wo_a_cublas_token_major.py
  step 60 probe_cublas_tm_other_large env SHAPES=$OTHER TS=2560:3584:512 TRIALS=9 CSV="$OUT/cublas_tm_other_large.csv" \
    python tools/probe_wo_a_cublas_token_major.py
  ;;
101)  # the final tree: the whole GPU suite, the bench, off-grid mid-size T
  step 370 gpu_suite $PYT tests -m gpu
  step 120 bench_wo_a python bench/bench_wo_a.py --tokens 1,5,64,320,4096,16384 --out "$OUT/bench_wo_a.md"
  step 100 bench_wo_a_mid python bench/bench_wo_a.py --tokens 150,200,333,517,700,1100 --out "$OUT/bench_wo_a_mid.md"
  ;;
100)  # the finer T grid for wo_a()'s cuBLAS bands
  step 560 probe_cublas_tm_fine env TS=8:1024:8 TRIALS=15 CSV="$OUT/cublas_tm_fine.csv" \
    python tools/probe_wo_a_cublas_token_major.py
  ;;
99)  # the cuBLAS bands: GPU tests, the bench, off-grid T
  step 280 wo_a_tests $PYT tests/test_wo_a.py -m gpu
  step 90 runtime_tests $PYT tests/test_spec_decode.py -m gpu
  step 120 bench_wo_a python bench/bench_wo_a.py --tokens 1,5,64,320,4096,16384 --out "$OUT/bench_wo_a.md"
  step 90 bench_wo_a_mid python bench/bench_wo_a.py --tokens 200,333,517,700,1100 --out "$OUT/bench_wo_a_mid.md"
  ;;
98)  # the T grid of the cuBLAS-vs-ours probe, CSV for wo_a()'s bands
  step 120 probe_cublas_tm_small env TS=16:48:16 TRIALS=15 CSV="$OUT/cublas_tm_small.csv" \
    python tools/probe_wo_a_cublas_token_major.py
  step 420 probe_cublas_tm_grid env TS=64:2048:32 TRIALS=15 CSV="$OUT/cublas_tm_grid.csv" \
    python tools/probe_wo_a_cublas_token_major.py
  step 60 probe_cublas_tm_large env TS=2560:3584:512 TRIALS=9 CSV="$OUT/cublas_tm_large.csv" \
    python tools/probe_wo_a_cublas_token_major.py
  ;;
97)  # cuBLAS into the token-major y against wo_a() over the mid-size T
  step 500 probe_cublas_tm env TS=128,192,256,288,320,352,384,448,512,640,768,1024,2048 TRIALS=20 \
    python tools/probe_wo_a_cublas_token_major.py
  ;;
96)  # cuBLAS into a strided token-major out: checked, timed against ours; the bench with column (c)
  step 240 probe_cublas_tm env TS=1,5,64,256,320,384,512,4096 TRIALS=30 python tools/probe_wo_a_cublas_token_major.py
  step 240 bench_wo_a python bench/bench_wo_a.py --tokens 1,5,64,320,4096,16384 --out "$OUT/bench_wo_a.md"
  ;;
95)  # the engine's GPU tests after the review edit
  step 400 engine_tests $PYT tests/test_wo_a.py tests/test_draft_head_fp8.py -m gpu
  ;;
94)  # the per-CTA twin of a cluster K split
  step 200 probe_ktrace_ksplit env TS=320 SHAPES=8x1024x1024 MODES=full,load_only STAGES=5 \
    CONFIGS=swap:128x160:1x1:occ1 python tools/probe_wo_a_ktrace.py
  ;;
93)  # the final tree: the trace probe's GPU tests, the whole GPU suite
  step 60 ktrace_tests $PYT tests/test_wo_a.py -m gpu -k ktrace
  step 540 gpu_suite $PYT tests -m gpu
  ;;
92)  # multicast or not: issued vs received bytes
  step 200 probe_ktrace_mcast env TS=320 SHAPES=8x512x2048 MODES=load_only,full STAGES=5 \
    CONFIGS=swap:64x160:1x1:occ1,swap:64x160:2x1:occ1,swap:128x160:1x2:occ1 OUT="$OUT" python tools/probe_wo_a_ktrace.py
  ;;
91)  # small grids at mid T: stage cap / tile width (paired A/B)
  step 300 probe_ab_small_g env TS=320,512 SHAPES=2x512x2048,4x512x2048,4x1024x1024 TRIALS=30 \
    CONFIGS="max_stages=none/tile_n=96,max_stages=none/tile_n=64,max_stages=none" python tools/probe_wo_a_ab.py
  ;;
90)  # T = 320 G=8 R=512: tile orders; weights L2-resident
  step 200 probe_ktrace_raster env TS=320 SHAPES=8x512x2048 MODES=full RASTER=engine,mnl,nml,lmn,lnm OUT="$OUT" \
    python tools/probe_wo_a_ktrace.py
  step 120 probe_ktrace_hot env TS=320 SHAPES=8x512x2048,8x1024x1024 MODES=full,load_only WSETS=1 \
    python tools/probe_wo_a_ktrace.py
  ;;
89)  # per-k-tile trace at T = 320 with 32 / 64 / 128 CTAs
  step 200 probe_ktrace_g env TS=320 SHAPES=2x512x2048,4x512x2048,8x512x2048 MODES=load_only,full OUT="$OUT" \
    python tools/probe_wo_a_ktrace.py
  ;;
88)  # per-k-tile trace at T = 320: who waits for whom (G=8 R=512 vs G=8 R=1024)
  step 240 probe_ktrace env TS=320 SHAPES=8x512x2048,8x1024x1024 MODES=full,load_only STAGES=8 OUT="$OUT" \
    python tools/probe_wo_a_ktrace.py
  ;;
87)  # the final tree: the whole GPU suite
  step 560 gpu_suite $PYT tests -m gpu
  ;;
86)  # the WO-A route refactor and its AOT coverage: WO-A's and the runtime's GPU tests, first-call host cost
  step 260 wo_a_tests $PYT tests/test_wo_a.py tests/test_wo_a_fp8.py -m gpu
  step 120 runtime_tests $PYT tests/test_spec_decode.py -m gpu
  step 120 first_call python tools/probe_wo_a_first_call.py
  step 60 first_call_16 env SHAPE=16x1024x1024 TS=1,64,320,4096 python tools/probe_wo_a_first_call.py
  ;;
85)  # the final tree: the whole GPU suite
  step 540 gpu_suite $PYT tests -m gpu
  ;;
84)  # (commit 7987dc1 only) k_rotate against wo_a()'s configs at T = 64 / 320 / 512 (paired A/B), then at 4096
  step 200 probe_ab_krot env TS=320,64,512 SHAPES=8x512x2048,8x1024x1024,16x512x2048,16x1024x1024 TRIALS=60 \
    CONFIGS="k_rotate=1" python tools/probe_wo_a_ab.py
  step 120 probe_ab_krot_4096 env TS=4096,1024 SHAPES=8x512x2048,16x1024x1024 TRIALS=40 \
    CONFIGS="k_rotate=1,pingpong=0,tile_m=128,cluster_m=1/pingpong=0,tile_m=128,cluster_m=1" python tools/probe_wo_a_ab.py
  ;;
83)  # T = 320 G=8 R=512: 2x2 clusters sized for two CTAs per SM (A/B, timeline)
  step 150 probe_ab_2x2 env TS=320 SHAPES=8x512x2048 TRIALS=60 \
    CONFIGS="cluster_n=2,occupancy=2,max_stages=none/cluster_n=2,occupancy=2,max_stages=none,tile_n=96" \
    python tools/probe_wo_a_ab.py
  step 150 probe_tl_2x2 env TS=320 SHAPES=8x512x2048 MODES=full HINTS=evict_first \
    CONFIGS=swap:64x160:2x2:occ2,swap:64x96:2x2:occ2 python tools/probe_wo_a_timeline.py
  ;;
82)  # the final tree: WO-A's GPU tests; paired A/B around the T = 320 configs (G=8)
  step 240 wo_a_tests $PYT tests/test_wo_a.py -m gpu
  step 150 probe_ab_320 env TS=320 SHAPES=8x512x2048,8x1024x1024 TRIALS=60 \
    CONFIGS="max_stages=4/max_stages=6/max_stages=none/cluster_m=1,cluster_n=2/cluster_m=2,cluster_n=1/weight_l2_hint=none" \
    python tools/probe_wo_a_ab.py
  ;;
81)  # pingpong at Dg = 2048 (>= 3 tiles per SM) adopted: GPU tests, the bench, the A/B against the old tile
  step 200 wo_a_tests $PYT tests/test_wo_a.py -m gpu -k "large_t_long or pingpong or persistent or single_kernel"
  step 200 bench_wo_a python bench/bench_wo_a.py --tokens 1,5,64,320,4096,16384 --out "$OUT/bench_wo_a.md"
  step 120 probe_ab env TS=4096,2048 SHAPES=16x512x2048,8x512x2048 TRIALS=60 \
    CONFIGS="pingpong=0,tile_m=128,cluster_m=1" python tools/probe_wo_a_ab.py
  ;;
80)  # paired A/B at T = 1024 / 4096 (Dg = 2048): persistent / pingpong schedules against the shipped tile
  step 300 probe_ab env TS=4096,1024 SHAPES=16x512x2048,8x512x2048 TRIALS=60 \
    CONFIGS="persistent=1/persistent=1,cluster_m=2/pingpong=1,tile_m=64,cluster_m=2" python tools/probe_wo_a_ab.py
  ;;
79)  # the persistent cooperative schedule: GPU tests, against the one-tile-per-CTA 128x256 (probe)
  step 200 persistent_tests $PYT tests/test_wo_a.py -m gpu -k "persistent_engine"
  step 330 probe_persistent env TS=4096,1024 TILES=128x256 PERSISTENT_TILES=128x256 CLUSTERS=1x1,2x1 \
    python tools/probe_wo_a_tiles.py
  ;;
78)  # where the PDL build's speed-up comes from at T = 4096 / 320 (probe, raw traces kept)
  step 420 probe_pdl env TS=4096,320 SHAPES=16x512x2048,8x512x2048 MODES=full PDL=0,1,code OUT="$OUT" \
    python tools/probe_wo_a_timeline.py
  ;;
77)  # the wgmma decode kernel for G=16 R=1024 at T <= 16: WO-A's routed GPU tests, the bench at T = 1 / 5
  step 150 wo_a_decode_tests $PYT tests/test_wo_a.py -m gpu -k "hopper_matches or decode or graph or single_kernel"
  step 90 bench_wo_a_decode python bench/bench_wo_a.py --tokens 1,5 --out "$OUT/bench_wo_a.md"
  ;;
76)  # T = 320 G=8 R=512: clusters x stage caps x the weights' hint (probe)
  step 300 probe_320 env TS=320 SHAPES=8x512x2048 MODES=full HINTS=evict_first STAGES=4,5,6 \
    CONFIGS=swap:64x160:1x1:occ1,swap:64x160:1x2:occ1,swap:64x160:2x2:occ1 python tools/probe_wo_a_timeline.py
  ;;
75)  # the stage cap adopted: WO-A's GPU tests, the issue's bench, the review-touched kernels' GPU tests
  step 200 wo_a_tests $PYT tests/test_wo_a.py -m gpu
  step 170 bench_wo_a python bench/bench_wo_a.py --tokens 1,5,64,320,4096,16384 --out "$OUT/bench_wo_a.md"
  step 150 kernels_tests $PYT tests/test_indexer.py tests/test_moe_experts.py -m gpu
  ;;
74)  # stage release right after each batch ("eager") and fewer stages (probe); WO-A's GPU tests
  step 150 probe_eager_320 env TS=320 MODES=full,eager STAGES=5 python tools/probe_wo_a_timeline.py
  step 90 probe_eager_64 env TS=64 MODES=full,eager python tools/probe_wo_a_timeline.py
  step 240 wo_a_tests $PYT tests/test_wo_a.py -m gpu
  ;;
73)  # the final tree: WO-A's GPU tests and those of the kernels the eighteenth session's review touched
  step 240 wo_a_tests $PYT tests/test_wo_a.py -m gpu
  step 150 kernels_tests $PYT tests/test_indexer.py tests/test_moe_experts.py -m gpu
  step 60 timeline_smoke env TS=320 SHAPES=8x512x2048 MODES=full,load_only python tools/probe_wo_a_timeline.py
  ;;
71)  # the timeline's row clamp
  step 90 timeline_tests $PYT tests/test_wo_a.py -m gpu -k "timeline"
  ;;
70)  # the final tree: WO-A's / the draft head's GPU tests, the bench
  step 240 wo_a_tests $PYT tests/test_wo_a.py tests/test_draft_head_fp8.py -m gpu
  step 150 bench_wo_a python bench/bench_wo_a.py --tokens 1,5,64,320,4096,16384 --out "$OUT/bench_wo_a.md"
  ;;
69)  # 256-row tiles: tests, probe at large T
  step 90 tests_256 $PYT tests/test_wo_a.py -m gpu -k "256_row"
  step 300 probe_256 env SHAPES=8x512x2048,16x512x2048 TS=1024,4096,16384 MODES=full \
    CONFIGS=noswap:256x128:1x1:occ1,noswap:256x128:2x1:occ1,swap:256x128:1x2:occ1 python tools/probe_wo_a_timeline.py
  ;;
68)  # evict_first adopted: tests, the bench, the runtime's GPU tests
  step 240 wo_a_tests $PYT tests/test_wo_a.py -m gpu
  step 150 bench_wo_a python bench/bench_wo_a.py --tokens 1,5,64,320,4096,16384 --out "$OUT/bench_wo_a.md"
  step 150 spec_tests $PYT tests/test_spec_decode.py -m gpu
  ;;
67)  # evict_first on the weights: tests, the shipped configs with / without it, twice
  step 120 hint_tests $PYT tests/test_wo_a.py -m gpu -k "l2_hint or bad_config"
  for r in 1 2; do
    step 200 hints_$r env TS=64,320,4096 MODES=full HINTS=evict_first python tools/probe_wo_a_timeline.py
  done
  ;;
66)  # graph edges, WO-A's GPU tests, one raw trace
  step 60 graph_edges python tools/probe_graph_edges.py
  step 60 timeline_g8 env TS=320 SHAPES=8x512x2048 MODES=full,load_only,mma_only OUT="$OUT" \
    python tools/probe_wo_a_timeline.py
  step 360 wo_a_tests $PYT tests/test_wo_a.py -m gpu
  ;;
65)  # 128x80 tiles, graph edges, T = 320 traces
  step 150 tests_16col $PYT tests/test_wo_a.py -m gpu -k "16_column or swap_ab_engine or timeline or bad_config"
  step 60 graph_edges python tools/probe_graph_edges.py
  step 200 timeline_320 env TS=320 MODES=full,load_only CONFIGS=swap:128x80:1x2:occ1,swap:128x80:2x1:occ1 \
    OUT="$OUT" python tools/probe_wo_a_timeline.py
  ;;
64)  # the debug timeline: tests, traces at T = 320 / 64 / 4096, the bench
  step 90 timeline_tests $PYT tests/test_wo_a.py -m gpu -k "timeline"
  step 150 timeline_320 env TS=320 python tools/probe_wo_a_timeline.py
  step 150 timeline_64_4096 env TS=64,4096 MODES=full,mma_only python tools/probe_wo_a_timeline.py
  step 150 bench_wo_a python bench/bench_wo_a.py --tokens 1,5,64,320,4096,16384 --out "$OUT/bench_wo_a.md"
  ;;
63)  # the WO-A bench, interleaved baselines
  step 240 bench_wo_a python bench/bench_wo_a.py --tokens 1,5,64,320,4096,16384 --out "$OUT/bench_wo_a.md"
  ;;
62)  # the WO-A bench, final tree
  step 200 bench_wo_a python bench/bench_wo_a.py --tokens 1,5,64,320,4096,16384 --out "$OUT/bench_wo_a.md"
  ;;
60)  # the whole GPU suite, alone
  step 560 gpu_suite $PYT tests -m gpu
  ;;
59)  # 64x128 pairs at T = 33..64: tests, probe twice, bench (its whole-suite step: phase 60)
  step 60 pairs_tests $PYT tests/test_wo_a.py -m gpu -k "pairs_through or launch_configs or 33_to_64"
  for r in 1 2; do
    step 60 probe_pairs_$r env TS=33,48,64 TILES=64x128 CLUSTERS=1x1,1x2 python tools/probe_wo_a_tiles.py
  done
  step 70 bench_wo_a python bench/bench_wo_a.py --tokens 33,48,64 --out "$OUT/bench_wo_a.md"
  ;;
58)  # CTA pairs along the other mode at T = 33..64 and 257..320 (adopted) -- tests, probe, bench
  step 280 wo_a_tests $PYT tests/test_wo_a.py -m gpu
  step 90 probe_picks env TS=64,320 PICKS=1 CLUSTERS=2x1,1x2 python tools/probe_wo_a_tiles.py
  step 200 bench_wo_a python bench/bench_wo_a.py --tokens 1,5,64,320,4096,16384 --out "$OUT/bench_wo_a.md"
  ;;
57)  # swapped tiles and CTA pairs at T = 320 (incl. cuBLAS's 128x80 1x2) and T = 64
  step 150 probe_t320 env TS=320 TILES=128x256 SWAP_TILES=128x96,128x160,64x160 CLUSTERS=2x1,1x2 python tools/probe_wo_a_tiles.py
  step 80 probe_t64 env TS=64 TILES=64x64 SWAP_TILES=64x64,64x32 CLUSTERS=1x1,2x1,1x2 python tools/probe_wo_a_tiles.py
  ;;
56)  # the WO-A bench (T = 20 / 32 added), a warm-up graph per row
  step 230 bench_wo_a python bench/bench_wo_a.py --tokens 1,5,20,32,64,320,4096,16384 --out "$OUT/bench_wo_a.md"
  ;;
55)  # the final tree: the whole GPU suite, then the WO-A bench (T = 20 / 32 added)
  step 330 gpu_suite $PYT tests -m gpu
  step 230 bench_wo_a python bench/bench_wo_a.py --tokens 1,5,20,32,64,320,4096,16384 --out "$OUT/bench_wo_a.md"
  ;;
54)  # the wgmma decode route: WO-A GPU tests, decode-T bench, swapped 64-row engine tiles at T = 64
  step 270 wo_a_tests $PYT tests/test_wo_a.py -m gpu
  step 170 bench_wo_a_decode python bench/bench_wo_a.py --tokens 1,5,20,32,64 --out "$OUT/bench_wo_a_decode.md"
  step 130 probe_t64 env TS=64 TILES=64x64,64x32 SWAP_TILES=64x64,64x32 CLUSTERS=1x1,2x1,1x2 python tools/probe_wo_a_tiles.py
  ;;
53)  # cluster splits for the swap-AB decode kernel: GPU tests, then the sweep
  step 200 sm90_decode_tests $PYT tests/test_wo_a.py -m gpu -k "sm90_decode"
  step 380 probe_sm90_cluster env TS=1,16,32,64 SPLITS=1,2,4 STAGES=4,6,8 BKS=64,128 CLUSTER=0,1 python tools/probe_wo_a_decode_sm90.py
  ;;
52)  # read ceiling per shape + deeper swap-AB decode configs
  step 420 probe_sm90_deep env READ=1 TS=1,16,64 SPLITS=1,2,4 STAGES=4,8 BKS=128 python tools/probe_wo_a_decode_sm90.py
  ;;
51)  # the Hopper swap-AB decode kernel: GPU tests, then the probe around its plan
  step 200 sm90_decode_tests $PYT tests/test_wo_a.py -m gpu -k "sm90_decode"
  step 370 probe_sm90_decode python tools/probe_wo_a_decode_sm90.py
  ;;
50)  # bulk weight copies for the decode kernel: GPU tests, the plan with and without (probe)
  step 150 bulk_tests $PYT tests/test_wo_a.py -m gpu -k "bulk or config_errors"
  step 200 probe_bulk env TS=1,5,16,32 PLAN_ONLY=1 BULK=0,1 PDL=0 python tools/probe_wo_a_decode.py
  ;;
49)  # cp.async.cg for the decode kernel: GPU tests, the plan with and without it (probe)
  step 100 decode_tests $PYT tests/test_wo_a.py -m gpu -k "every_split"
  step 130 probe_bypass env TS=1,5,16 PLAN_ONLY=1 BYPASS=0,1 PDL=0 python tools/probe_wo_a_decode.py
  ;;
48)  # the final tree: the decode kernels' GPU tests, the 32-row route's knobs (probe)
  step 150 decode_tests $PYT tests/test_wo_a.py tests/test_wo_a_fp8.py -m gpu -k "decode_kernel or fp8"
  step 150 probe_route32 env TS=17,24,32 PLAN_ONLY=1 ROTATE=0,1 CHAINS=1,2 PDL=0 python tools/probe_wo_a_decode.py
  ;;
47)  # the rotated K walk: GPU tests, the bf16 decode plan and the FP8 kernel with and without it
  step 150 decode_tests $PYT tests/test_wo_a.py tests/test_wo_a_fp8.py -m gpu -k "every"
  step 150 probe_rotate env TS=1,5,16,32 PLAN_ONLY=1 ROTATE=0,1 PDL=0 python tools/probe_wo_a_decode.py
  step 200 bench_wo_a_fp8 python bench/bench_wo_a_fp8.py \
    --variants registers/128/plan/1/straight,registers/128/plan/1/rotate,registers/128/plan/2/rotate \
    --out "$OUT/bench_wo_a_fp8.md"
  ;;
46)  # MMA chains: GPU tests, the bf16 decode plan and the FP8 kernel with 1 / 2 / 4 chains
  step 150 decode_tests $PYT tests/test_wo_a.py tests/test_wo_a_fp8.py -m gpu -k "decode_kernel or fp8"
  step 200 probe_chains env TS=1,5,16,32 PLAN_ONLY=1 CHAINS=1,2,4 PDL=0 python tools/probe_wo_a_decode.py
  step 200 bench_wo_a_fp8 python bench/bench_wo_a_fp8.py \
    --variants registers/128/plan/1,registers/128/plan/2,registers/128/plan/4 --out "$OUT/bench_wo_a_fp8.md"
  ;;
45)  # FP8-weight WO-A with its scales staged in shared memory: GPU tests, the variants
  step 150 wo_a_fp8_tests $PYT tests/test_wo_a_fp8.py -m gpu
  step 300 bench_wo_a_fp8 python bench/bench_wo_a_fp8.py \
    --variants registers/128/plan,registers/256/plan,registers/128/x2,registers/256/x2,registers/128/8 \
    --out "$OUT/bench_wo_a_fp8.md"
  ;;
30)  # wo_a()'s two-CTAs-per-SM config on the inline-producer engine: GPU tests, bench at T = 272 / 320
  step 240 wo_a_tests $PYT tests/test_wo_a.py tests/test_draft_head_fp8.py -m gpu
  step 100 bench_wo_a python bench/bench_wo_a.py --tokens 272,320 --out "$OUT/bench_wo_a.md"
  ;;
esac
