#!/usr/bin/env bash
# The session's last device call: the expert-kernel configs' GPU tests, then the MoE and
# indexer benches (logs under $OUT; results come back even if the call is cut short).
#   device run (carry .devcache):  bash tools/device_last.sh
source tools/device-env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 110 python -m pytest -q -rf --tb=line -p no:cacheprovider tests/test_moe_experts.py tests/test_spec_decode.py -m gpu > "$OUT/moe_tests.log" 2>&1
echo "moe tests rc=$?"; tail -4 "$OUT/moe_tests.log"
timeout 130 python bench/bench_moe_experts.py --tokens 1,64,4096 --out "$OUT/bench_moe.md" > "$OUT/bench_moe.log" 2>&1
echo "bench_moe rc=$?"; grep "^|" "$OUT/bench_moe.log" | tail -12
timeout 80 python -m spec_decode.bench --model small --backends baseline,fused --quick --out "$OUT/spec_small.md" > "$OUT/spec_small.log" 2>&1
echo "spec bench rc=$?"; grep "^|" "$OUT/spec_small.log" | tail -20
timeout 70 python bench/bench_indexer.py --out "$OUT/bench_indexer.md" > "$OUT/bench_indexer.log" 2>&1
echo "bench_indexer rc=$?"; grep "^|" "$OUT/bench_indexer.log" | tail -8
