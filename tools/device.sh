#!/usr/bin/env bash
# Run one named job on the H200 device machine (repo root as cwd; carry .devcache, see
# docs/device.md). Logs and tables go under $OUT.
#
#   bash tools/device.sh gpu-tests [SHARD]   GPU tests: SHARD 1 / 2 / 3 / 4 splits the suite so each
#                                            part fits one call with a cold compile cache; no
#                                            SHARD: the whole suite
#   bash tools/device.sh sanitize [ARGS]     the GPU tests ARGS under compute-sanitizer memcheck
#   bash tools/device.sh sanitize-sync TOOL  the grid-synchronising kernels' GPU tests (router, mHC
#                                            split-K and its two-stream parts, WO-A decode split-K,
#                                            push all-reduce, sink_attention's split merge) under
#                                            compute-sanitizer --tool TOOL (racecheck or synccheck)
#   bash tools/device.sh bench-kernels [B..] the kernel benchmarks B (default: every bench/bench_*.py;
#                                            tables in $OUT)
#   bash tools/device.sh bench-wo-a-routes   WO-A's default route against cuBLAS and the CuTe path
#   bash tools/device.sh wo-a-fp8-variants   the FP8 WO-A decode kernel's K-slice / stage / split variants at
#                                            V4's shapes (which should be the default plan)
#   bash tools/device.sh bench-runtime [A..] the decode runtime at the reference lengths, synthetic
#                                            acceptance 5.5 (further bench options A)
#   bash tools/device.sh deepgemm            the peer benchmark's DeepGEMM family with the wheels carried in
#                                            .devcache/peers-dg (sgl-deep-gemm 0.2.0 + apache-tvm-ffi 0.1.11,
#                                            in their own folder; with the DSL bundle, 8 MB)
#   bash tools/device.sh build               the AOT build for sm_90a + sm_100a and its demo
#   bash tools/device.sh peers [A..]         the peer benchmark (bench/bench_peers.py): installs the
#                                            wheels carried in .devcache/peers into /tmp/site (no deps)
#                                            first -- carry .devcache/peers (13 MB) or .devcache/peers-
#                                            flashinfer (62 MB, alone) without the DSL bundle, in
#                                            a call right after one that unpacked it (same machine)
#   bash tools/device.sh v4 tests|bench      DeepSeek-V4's kernels: their GPU tests (-k "v4 or mxfp4"),
#                                            or their benches (WO-A bf16 / FP8, indexer, MoE layers)
#   bash tools/device.sh v4 runtime [quick]  the V4 runtime's GPU tests (fused vs FP32, graphs at BS
#                                            1..64), then its bench at v4_flash_slice (quick: --quick)
#   bash tools/device.sh topk                the split top-k select's GPU tests, then the streaming select
#                                            against its plans (bench_indexer.py --select)
#   bash tools/device.sh numerics [MODEL]    per-op error of fused / base against FP32 (spec_decode.numerics;
#                                            MODEL default small)
#   bash tools/device.sh tp [MODEL]          simulated TP4 on one GPU: its GPU tests (and the push group's
#                                            warm-up before a first capture), then the bench
#                                            (--tp 4 --simulate-ranks; MODEL default small)
#   bash tools/device.sh host-cost [A..]     the tensor entries' GPU tests, then the eager host cost per
#                                            call (entry points, the DSL call path,
#                                            TVM-FFI launches when apache-tvm-ffi's wheel is carried,
#                                            custom ops, runtime-only ctypes launchers) and the
#                                            import / first-call times with and without the DSL
#   bash tools/device.sh h200 test|kernels|runtime
#                                            what needs an H200 (run with needs_h200: the first is the
#                                            one test that needs more than an H100's 80 GB): test --
#                                            the bf16 V4-Flash slice tracked in FP32 (~100 GB);
#                                            kernels -- WO-A at V4's decode T and the MXFP8
#                                            quantization against 4.3 TB/s; runtime -- the decode
#                                            runtime's bench at v4_flash_slice (--quick)
#   bash tools/device.sh cache-out           the machine's compiled-kernel cache as $OUT/kernel-cache.tar.xz
#   bash tools/device.sh cache-in [FILE]     unpack a carried cache (default .devcache/kernel-cache.tar.xz) into it
#                                            (a call right after one that unpacked the DSL: see docs/device.md)
set -u
source tools/device-env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PYT="python -m pytest -q -ra -p no:cacheprovider"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

job=${1:-}; shift || true
case "$job" in
gpu-tests)
  case "${1:-all}" in
    1) files="tests/test_wo_a.py" ;;
    2) files="tests/test_wo_a_fp8.py tests/test_wo_a_fp8_act.py tests/test_draft_head_fp8.py tests/test_moe_experts.py tests/test_moe_quant.py tests/test_moe_router.py tests/test_moe_finalize.py" ;;
    3) files="tests/test_comm.py tests/test_indexer.py tests/test_mhc.py tests/test_row_rms.py tests/test_masked_softmax.py tests/test_fused_ops_plumbing.py tests/test_spec_decode.py tests/test_caches.py tests/test_arch.py tests/test_provenance.py" ;;
    4) files="tests/test_ops.py tests/test_tensor_entries.py tests/test_tensor_parallel.py tests/test_sink_attention.py tests/test_compressor_pool.py" ;;
    all) files="tests" ;;
    *) echo "gpu-tests: SHARD must be 1, 2, 3, 4 or empty" >&2; exit 2 ;;
  esac
  $PYT $files -m gpu 2>&1 | tee "$OUT/gpu-tests-${1:-all}.log" | tail -25
  exit "${PIPESTATUS[0]}"
  ;;
sanitize)
  # (no hang watchdog under the sanitizer: kernels run many times slower there)
  CUTE_KERNELS_GPU_TEST_TIMEOUT_S=0 CUTE_KERNELS_UNDER_SANITIZER=1 \
    compute-sanitizer --tool memcheck --report-api-errors no $PYT -m gpu "$@" 2>&1 | tee "$OUT/sanitize.log" | tail -25
  exit "${PIPESTATUS[0]}"
  ;;
sanitize-sync)
  tool=${1:-racecheck}
  CUTE_KERNELS_GPU_TEST_TIMEOUT_S=0 CUTE_KERNELS_UNDER_SANITIZER=1 \
    compute-sanitizer --tool "$tool" --report-api-errors no $PYT -m gpu -x \
    tests/test_moe_router.py "tests/test_mhc.py::test_stats_match_fp64" \
    tests/test_wo_a.py::test_decode_kernel_every_split_and_graph_replay "tests/test_comm.py::test_fused_finalize_shared_allreduce_bit_exact" \
    tests/test_sink_attention.py::test_deterministic_and_graph_replay "tests/test_mhc.py::test_stats_parts_bit_equal_to_all" \
    2>&1 | tee "$OUT/sanitize-$tool.log" | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" | tail -10
  exit "${PIPESTATUS[0]}"
  ;;
bench-kernels)
  for b in ${@:-bench/bench_*.py}; do
    n=$(basename "$b" .py)
    timeout 300 python "$b" --out "$OUT/$n.md" 2>&1 | grep -v "^|" | tail -5
  done
  ;;
bench-wo-a-routes)
  python bench/bench_wo_a_routes.py --out "$OUT/bench_wo_a_routes.md" "$@"
  ;;
wo-a-fp8-variants)
  timeout 400 python bench/bench_wo_a_fp8.py --tokens 1,5,16,32,64 --shapes 8x1024x4096,16x1024x4096 \
    --variants 128/plan,128/plan/plan/bits,256/plan/plan/bits,128/x2/plan/bits --out "$OUT/bench_wo_a_fp8_variants.md" 2>&1 | tail -30
  ;;
bench-runtime)
  python -m spec_decode.bench --model v4_flash_slice --acceptance-length 5.5 --out "$OUT/bench_runtime.md" "$@"
  ;;
v4)
  case "${1:-tests}" in
    tests)
      $PYT -m gpu -k "v4 or mxfp4 or fp8" tests/test_wo_a.py tests/test_wo_a_fp8.py tests/test_wo_a_fp8_act.py tests/test_indexer.py \
        tests/test_moe_experts.py tests/test_moe_router.py 2>&1 | tee "$OUT/v4-tests.log" | tail -25
      exit "${PIPESTATUS[0]}" ;;
    bench)
      python bench/bench_wo_a_v4.py --out "$OUT/bench_wo_a_v4.md" 2>&1 | tail -3
      python bench/bench_indexer.py --model v4 --out "$OUT/bench_indexer_v4.md" 2>&1 | tail -3
      for m in v4-flash v4-pro; do
        timeout 240 python bench/bench_moe_experts.py --model $m --out "$OUT/bench_moe_experts_$m.md" 2>&1 | tail -3
      done ;;
    runtime)
      $PYT -m gpu tests/test_spec_decode.py "tests/test_mhc.py::test_stats_v4_hc_eps_match_fp64" \
        "tests/test_mhc.py::test_mhc_sublayer_against_model_reference" 2>&1 | tee "$OUT/v4-runtime-tests.log" | tail -25
      python -m spec_decode.bench --model v4_flash_slice --acceptance-length 5.5 ${2:+--$2} \
        --out "$OUT/bench_runtime_v4.md" 2>&1 | tail -45 ;;
    *) echo "v4: tests, bench or runtime" >&2; exit 2 ;;
  esac
  ;;
topk)
  # the indexer's two selects: the split select's GPU tests (every plan against the definition,
  # graph replay), then the streaming select against every split plan
  # (bench_indexer.py --select: what SPLIT_BY_DEFAULT and split_plan rest on)
  $PYT -m gpu tests/test_indexer.py -k "plans or select_on_given or ties" 2>&1 | tee "$OUT/topk-tests.log" | tail -6
  python bench/bench_indexer.py --select --out "$OUT/bench_select.md" 2>&1 | tail -20
  ;;
numerics)
  python -m spec_decode.numerics --model "${1:-small}" --out "$OUT/numerics_${1:-small}.md" 2>&1 | tail -15
  ;;
tp)
  $PYT -m gpu "tests/test_comm.py::test_warm_up_then_first_capture_replays" tests/test_tensor_parallel.py 2>&1 \
    | tee "$OUT/tp-tests.log" | tail -25
  python -m spec_decode.bench --model "${1:-small}" --tp 4 --simulate-ranks --quick \
    --out "$OUT/bench_runtime_tp4.md" > "$OUT/tp4.log" 2>&1
  # (no CUDA_LAUNCH_BLOCKING rerun on failure: serialised launches make the simulated ranks'
  # push warm-up time out before any kernel of interest runs)
  grep -v "^frame" "$OUT/tp4.log" | tail -40
  ;;
host-cost)
  # the TVM-FFI column needs apache-tvm-ffi: a carried wheel (.devcache/peers/apache_tvm_ffi-*.whl,
  # 3.3 MB: in a call after one that unpacked the DSL) is installed into /tmp/site first
  for w in .devcache/peers/apache_tvm_ffi-*.whl; do
    [ -e "$w" ] && python -m pip install -q --no-deps --no-index --target /tmp/site "$w" 2>&1 | tail -1
  done
  # the tensor entries (TVM-FFI taking torch tensors) first: bit-equal to the pointer launch, refusals named
  timeout 150 $PYT -m gpu tests/test_tensor_entries.py "tests/test_row_rms.py::test_tensor_entry_through_tvm_ffi" \
    "tests/test_caches.py::test_runtime_only_entry_points_match_the_dsl_path_on_gpu" \
    2>&1 | tee "$OUT/tensor-entries.log" | tail -8
  # the machine's cache: what the carried cache and the tests hold is not compiled again
  # (further bench_host_cost options pass through, e.g. --only row_rms,mxfp8_quantize: the whole
  # bench compiles every entry point's TVM-FFI pointer variant and can outlast one call)
  timeout 400 python bench/bench_host_cost.py --calls 1000 --cache "$CUTE_KERNELS_CACHE_DIR" \
    --out "$OUT/bench_host_cost.md" "$@" 2>&1 | tee "$OUT/bench_host_cost.log" | tail -30
  ;;
h200)
  case "${1:-test}" in
    test)
      timeout 560 $PYT -m gpu "tests/test_spec_decode.py::test_fused_ops_track_fp32_on_gpu" 2>&1 \
        | tee "$OUT/h200-test.log" | tail -8 ;;
    kernels)
      timeout 200 python bench/bench_wo_a_v4.py --tokens 1,5,16,32,64 --out "$OUT/bench_wo_a_v4.md" 2>&1 \
        | tee "$OUT/bench_wo_a_v4.log" | tail -12
      timeout 200 python bench/bench_moe.py --sections quant --out "$OUT/bench_quant.md" 2>&1 \
        | tee "$OUT/bench_quant.log" | tail -14 ;;
    runtime)
      timeout 560 python -m spec_decode.bench --model v4_flash_slice --acceptance-length 5.5 --quick \
        --out "$OUT/bench_runtime_quick.md" 2>&1 | tee "$OUT/bench_runtime_quick.log" | tail -45 ;;
    *) echo "h200: test, kernels or runtime" >&2; exit 2 ;;
  esac
  ;;
peers)
  for w in .devcache/peers/*.whl .devcache/peers-flashinfer/*.whl; do
    [ -e "$w" ] && python -m pip install -q --no-deps --no-index --target /tmp/site "$w" 2>&1 | tail -1
  done
  # FlashInfer with its top-k module prebuilt (tools/build-flashinfer-topk.sh), over the wheel's
  f=.devcache/peers-fi-aot/flashinfer-aot-topk.tar.xz
  [ -e "$f" ] && rm -rf /tmp/site/flashinfer && tar -xJf "$f" -C /tmp/site
  # further options pass through (--families mxfp8,router); rows land in the log as they come
  python bench/bench_peers.py --out "$OUT/bench_peers.md" "$@" 2>&1 | tee "$OUT/bench_peers.log" | tail -30
  ;;
deepgemm)
  # sgl-deep-gemm 0.2.0 with the apache-tvm-ffi it pins, in a folder of their own (docs/device.md)
  for w in .devcache/peers-dg/*.whl; do
    [ -e "$w" ] && python -m pip install -q --no-deps --no-index --target /tmp/site-dg "$w" 2>&1 | tail -1
  done
  PYTHONPATH=/tmp/site-dg:$PYTHONPATH DG_JIT_CACHE_DIR=/tmp/dgcache \
    python bench/bench_peers.py --families deepgemm --out "$OUT/bench_peers_dg.md" 2>&1 | tee "$OUT/bench_peers_dg.log" | tail -20
  ;;
build)
  python -m cute_kernels build --arch sm_90a --arch sm_100a --demo 2>&1 | tail -20 | tee "$OUT/build.log"
  ;;
cache-out)
  # the machine's compiled-kernel cache, brought home through $OUT: carried into a later
  # session's machine (cache-in), its kernels load instead of compiling (entries whose kernel
  # source changed since are simply not found)
  tar -cJf "$OUT/kernel-cache.tar.xz" -C "$(dirname "$CUTE_KERNELS_CACHE_DIR")" "$(basename "$CUTE_KERNELS_CACHE_DIR")"
  ls -la "$OUT/kernel-cache.tar.xz"
  ;;
cache-in)
  # in a call that carries the cache file (right after one that unpacked the DSL)
  mkdir -p "$(dirname "$CUTE_KERNELS_CACHE_DIR")"
  tar -xJf "${1:-.devcache/kernel-cache.tar.xz}" -C "$(dirname "$CUTE_KERNELS_CACHE_DIR")" && \
    find "$CUTE_KERNELS_CACHE_DIR" -name manifest.json | wc -l
  ;;
*)
  sed -n '2,/^set -u/p' "$0" | sed '$d'; exit 2 ;;
esac
