#!/usr/bin/env bash
# Device calls of the next session (each phase fits one 600 s call), most important first:
#   phase 1: never-run code (FP8 indexer, fused engine after the family-counter fix), then the
#            benches whose tables are stale (indexer wgmma column, WO-A default path, MoE full T);
#   phase 2: the decode runtime at real sizes (slice), both backends.
#   device run (carry .devcache):  bash tools/device_next.sh 1   /   bash tools/device_next.sh 2
# Full logs under $OUT/*.log; the tail of each step on stdout.
set -u
source tools/device-env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
step() { local t=$1 name=$2; shift 2; echo "== $name: $*"; timeout "$t" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?"
  grep -v -e Warning -e _warn_once "$OUT/$name.log" | grep -v "^\s*$" | tail -14; }
PYT="python -m pytest -q -rf --tb=short -p no:cacheprovider"
case "${1:-1}" in
1)
  step 90 fp8_indexer $PYT tests/test_indexer.py -m gpu -k fp8
  step 150 gpu_suite $PYT tests -m gpu
  step 80 bench_indexer python bench/bench_indexer.py --out "$OUT/bench_indexer.md"
  step 90 bench_wo_a python bench/bench_wo_a.py --out "$OUT/bench_wo_a.md"
  step 150 bench_moe python bench/bench_moe_experts.py --out "$OUT/bench_moe.md"
  ;;
2)
  step 580 spec_slice python -m spec_decode.bench --model slice --backends baseline,fused --out "$OUT/spec_slice.md"
  ;;
esac
