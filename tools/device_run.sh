#!/usr/bin/env bash
# One device call: GPU tests, then benchmarks, logs under $OUT.
#   device run (carry .devcache):  bash tools/device_run.sh [pytest args...]
# Env: BENCH=0 skips the benchmarks; BENCHES="bench/bench_row_rms.py ..." picks them.
set -u
source tools/device-env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python -c "import torch, cutlass; print('torch', torch.__version__, 'cutlass-dsl', cutlass.__version__)" | tee -a "$OUT/gpu.txt"
rc=0
python -m pytest tests -q -x -ra "$@" 2>&1 | tee "$OUT/pytest.log" | tail -40
rc=${PIPESTATUS[0]}
python -m cute_kernels build --arch sm_90a --arch sm_100a --demo 2>/dev/null | tee "$OUT/build.log"
if [ "${BENCH:-1}" = "1" ]; then
  for b in ${BENCHES:-bench/bench_*.py}; do
    n=$(basename "$b" .py)
    timeout 300 python "$b" --out "$OUT/$n.md" 2>&1 | tail -60
  done
fi
exit $rc
