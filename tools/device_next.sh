#!/usr/bin/env bash
# Device calls of the next session, in two phases that each fit one 600 s call:
#   phase 1 (correctness of never-run kernels/paths), phase 2 (regression suite + benches).
#   device run (carry .devcache):  bash tools/device_next.sh 1   /   bash tools/device_next.sh 2
# Full logs under $OUT/*.log; the tail of each step on stdout.
set -u
source tools/device-env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
step() { local t=$1 name=$2; shift 2; echo "== $name: $*"; timeout "$t" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?"; grep -v Warning "$OUT/$name.log" | tail -15; }
PYT="python -m pytest -q -rf --tb=short -p no:cacheprovider"
case "${1:-1}" in
1)
  step 230 indexer_experts $PYT tests/test_indexer.py tests/test_moe_experts.py -m gpu
  step 110 wo_a_decode $PYT tests/test_wo_a.py -m gpu -k decode_kernel
  step 200 spec_mhc $PYT tests/test_spec_decode.py tests/test_mhc.py -m gpu
  ;;
2)
  step 200 suite $PYT tests -m gpu --deselect tests/test_indexer.py --deselect tests/test_moe_experts.py \
    --deselect tests/test_spec_decode.py --deselect tests/test_mhc.py
  step 120 bench_indexer python bench/bench_indexer.py --out "$OUT/bench_indexer.md"
  step 240 bench_wo_a python bench/bench_wo_a.py --out "$OUT/bench_wo_a.md"
  ;;
3)
  step 240 bench_moe_experts python bench/bench_moe_experts.py --out "$OUT/bench_moe_experts.md"
  step 240 spec_quick python -m spec_decode.bench --model tiny --backends baseline --quick --out "$OUT/spec_decode_quick.md"
  ;;
esac
