#!/usr/bin/env bash
# Device calls of this session after phase 1 (each phase fits one 600 s call):
#   phase 1: the MoE decode kernel's row passes and the indexer's token-group kernel (tests,
#            MoE layer bench at T = 1, 64, 320, indexer bench), the whole GPU suite -- run;
#   phase 2: with both now the runtime's defaults: the runtime's GPU tests, the small config
#            (quick, both backends), the slice config after the indexer-width fix;
#   phase 3: the slice config's fused logits per family (its acceptance length was 6.00 against
#            the baseline's 1.00), the small config at the full lengths (BS1 4096/1024,
#            BS64 4096/2048; never run), the MoE layer bench at T = 384 (a BS64 verify step).
#   device run (carry .devcache):  bash tools/device_next.sh N   (N = 1, 2, 3)
# Full logs under $OUT/*.log; the tail of each step on stdout. Run `python -m pyflakes` on the
# touched files before a device call: a NameError costs a cold start.
set -u
source tools/device-env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
step() { local t=$1 name=$2; shift 2; echo "== $name: $*"; timeout "$t" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?"
  grep -v -e Warning -e _warn_once "$OUT/$name.log" | grep -v "^\s*$" | tail -14; }
PYT="python -m pytest -q -rf --tb=short -p no:cacheprovider"
case "${1:-1}" in
1)
  step 90 staged_tests $PYT tests/test_moe_experts.py tests/test_indexer.py -m gpu -k "row_passes or decode or token_group"
  grep -q " passed" "$OUT/staged_tests.log" && ! grep -q -e " failed" -e " error" "$OUT/staged_tests.log" \
    || export SKIP_STAGED=1  # the benches leave the staged columns out
  step 150 bench_moe python bench/bench_moe_experts.py --tokens 1,64,320 --out "$OUT/bench_moe.md"
  step 100 bench_indexer python bench/bench_indexer.py --out "$OUT/bench_indexer.md"
  step 230 gpu_suite $PYT tests -m gpu
  ;;
2)
  step 90 spec_tests $PYT tests/test_spec_decode.py -m gpu
  step 170 spec_small python -m spec_decode.bench --model small --backends baseline,fused --quick --out "$OUT/spec_small.md"
  step 300 spec_slice python -m spec_decode.bench --model slice --backends baseline,fused --quick --prefill-chunk 64 --out "$OUT/spec_slice.md"
  ;;
3)
  step 150 probe_numerics python tools/probe_slice_numerics.py
  step 280 spec_small_full python -m spec_decode.bench --model small --backends baseline,fused --out "$OUT/spec_small_full.md"
  step 120 bench_moe python bench/bench_moe_experts.py --tokens 1,64,384 --out "$OUT/bench_moe.md"
  ;;
4)  # after the 64-bit expert-weight offset fix of the tiled kernel (and row passes up to T = 384)
  step 120 moe_tests $PYT tests/test_moe_experts.py -m gpu
  step 60 probe_fault env CUDA_LAUNCH_BLOCKING=1 python tools/probe_moe_fault.py
  step 60 probe_numerics env BATCHES=1,64 python tools/probe_slice_numerics.py
  step 150 spec_slice python -m spec_decode.bench --model slice --backends baseline,fused --quick --prefill-chunk 64 --out "$OUT/spec_slice.md"
  step 80 spec_small python -m spec_decode.bench --model small --backends baseline,fused --quick --out "$OUT/spec_small.md"
  step 100 spec_small_full python -m spec_decode.bench --model small --backends baseline,fused --out "$OUT/spec_small_full.md"
  step 80 bench_moe python bench/bench_moe_experts.py --tokens 1,64,384 --out "$OUT/bench_moe.md"
  ;;
esac
