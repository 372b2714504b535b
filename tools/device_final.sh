#!/usr/bin/env bash
# One device call: the changed kernels' GPU tests, the drift probe, the WO-A and MoE benches.
#   device run (carry .devcache):  bash tools/device_final.sh
set -u
source tools/device-env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PYT="python -m pytest -q -rf --tb=short -p no:cacheprovider"
step() { local t=$1 name=$2; shift 2; local t0=$SECONDS; timeout "$t" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "== $name rc=$rc $((SECONDS - t0))s"; grep -v -e Warning -e _warn_once "$OUT/$name.log" | tail -12; }
step 80 moe_tests $PYT tests/test_moe_experts.py -m gpu
step 80 wo_a_decode_tests $PYT tests/test_wo_a.py -m gpu -k decode
step 45 probe_fused python tools/probe_fused_ops.py
step 100 bench_wo_a python bench/bench_wo_a.py --out "$OUT/bench_wo_a.md"
step 230 bench_moe python bench/bench_moe_experts.py --out "$OUT/bench_moe.md"
