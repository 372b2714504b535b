#!/usr/bin/env bash
# The session's last device call (about 240 s of device time left): the expert-kernel
# configs' and fused runtime's GPU tests, the MoE bench at decode T, the runtime bench.
# Logs under $OUT come back even if the call is cut short.
#   device run (carry .devcache):  bash tools/device_last.sh
source tools/device-env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 75 python -m pytest -q -rf --tb=line -p no:cacheprovider tests/test_moe_experts.py tests/test_spec_decode.py -m gpu > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -4 "$OUT/gpu_tests.log"
timeout 70 python bench/bench_moe_experts.py --tokens 1,64 --out "$OUT/bench_moe.md" > "$OUT/bench_moe.log" 2>&1
echo "bench_moe rc=$?"; grep "^|" "$OUT/bench_moe.log" | tail -8
timeout 55 python -m spec_decode.bench --model small --backends baseline,fused --quick --out "$OUT/spec_small.md" > "$OUT/spec_small.log" 2>&1
echo "spec bench rc=$?"; grep "^|" "$OUT/spec_small.log" | tail -20
