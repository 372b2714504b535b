#!/usr/bin/env bash
# The first device call of the next session: everything written or changed since the last
# GPU run, most important first, each step time-boxed; logs and tables under $OUT.
#   device run (carry .devcache):  bash tools/device_next.sh
set -u
source tools/device-env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
step() { local t=$1; shift; echo "== $*"; timeout "$t" "$@" 2>&1 | grep -v Warning | tail -25; }
# 1. never-run kernels / paths (correctness first)
step 200 python -m pytest -q -x tests/test_indexer.py tests/test_moe_experts.py -m gpu
step 120 python -m pytest -q tests/test_wo_a.py -m gpu -k decode_kernel
step 200 python -m pytest -q tests/test_spec_decode.py tests/test_mhc.py -m gpu
# 2. the whole GPU suite (regressions)
step 240 python -m pytest -q tests -m gpu --deselect tests/test_indexer.py --deselect tests/test_moe_experts.py \
  --deselect tests/test_spec_decode.py --deselect tests/test_mhc.py
# 3. benchmarks for the tables that are missing or stale in bench/RESULTS.md
step 150 python bench/bench_indexer.py --out "$OUT/bench_indexer.md"
step 240 python bench/bench_wo_a.py --out "$OUT/bench_wo_a.md"
step 240 python bench/bench_moe_experts.py --out "$OUT/bench_moe_experts.md"
step 240 python -m spec_decode.bench --model tiny --backends baseline --quick --out "$OUT/spec_decode_quick.md"
