#!/usr/bin/env bash
# Device calls of the next session (each phase fits one 600 s call), most important first:
#   phase 1: never-run code (FP8 indexer scores, the swap-AB expert decode kernel), the whole GPU
#            suite, the benches whose tables are stale (indexer wgmma column, WO-A default path);
#   phase 2: the MoE layer bench (decode-kernel column, all T), the runtime on the small config
#            (family counts after the counter fix);
#   phase 3: the decode runtime at real sizes (slice), both backends.
#   device run (carry .devcache):  bash tools/device_next.sh N   (N = 1, 2, 3)
# Full logs under $OUT/*.log; the tail of each step on stdout.
set -u
source tools/device-env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
step() { local t=$1 name=$2; shift 2; echo "== $name: $*"; timeout "$t" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?"
  grep -v -e Warning -e _warn_once "$OUT/$name.log" | grep -v "^\s*$" | tail -14; }
PYT="python -m pytest -q -rf --tb=short -p no:cacheprovider"
case "${1:-1}" in
1)
  step 90 fp8_indexer_and_decode_experts $PYT tests/test_indexer.py tests/test_moe_experts.py -m gpu -k "fp8 or decode"
  step 260 gpu_suite $PYT tests -m gpu
  step 80 bench_indexer python bench/bench_indexer.py --out "$OUT/bench_indexer.md"
  step 90 bench_wo_a python bench/bench_wo_a.py --out "$OUT/bench_wo_a.md"
  ;;
2)
  step 90 fused_gate_up_tests bash -c "for i in 1 2 3; do $PYT tests/test_moe_experts.py -m gpu -k gate_up || exit 1; done"
  step 300 bench_moe python bench/bench_moe_experts.py --out "$OUT/bench_moe.md"
  step 120 spec_small python -m spec_decode.bench --model small --backends baseline,fused --quick --out "$OUT/spec_small.md"
  step 100 bench_indexer python bench/bench_indexer.py --out "$OUT/bench_indexer.md"
  ;;
4)  # the decode expert kernel as the default at T <= 64 (ping-pong promotion, stages per token tile)
  step 150 decode_kernel_tests bash -c "for i in 1 2; do $PYT tests/test_moe_experts.py -m gpu -k 'decode or gate_up' || exit 1; done"
  step 40 probe_precision python tools/probe_decode_precision.py
  step 120 runtime_tests $PYT tests/test_spec_decode.py -m gpu
  step 150 bench_moe python bench/bench_moe_experts.py --tokens 1,64 --out "$OUT/bench_moe.md"
  step 100 spec_small python -m spec_decode.bench --model small --backends baseline,fused --quick --out "$OUT/spec_small.md"
  ;;
5)  # stages 3 default, the engine's one-copy host logic, then the slice runtime (quick form)
  step 60 decode_and_runtime_tests $PYT tests/test_moe_experts.py tests/test_spec_decode.py -m gpu -k "decode or gate_up or engine or fused_ops"
  step 90 bench_moe python bench/bench_moe_experts.py --tokens 1,64 --out "$OUT/bench_moe.md"
  step 70 spec_small python -m spec_decode.bench --model small --backends baseline,fused --quick --out "$OUT/spec_small.md"
  step 300 spec_slice python -m spec_decode.bench --model slice --backends baseline,fused --quick --out "$OUT/spec_slice.md"
  ;;
6)  # the slice runtime, quick form, smaller prefill chunks (512 gathers 32 GiB of K and of V)
  step 400 spec_slice python -m spec_decode.bench --model slice --backends baseline,fused --quick --prefill-chunk 64 --out "$OUT/spec_slice.md"
  ;;
3)
  step 560 spec_slice python -m spec_decode.bench --model slice --backends baseline,fused --quick --out "$OUT/spec_slice.md"
  ;;
esac
