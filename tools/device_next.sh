#!/usr/bin/env bash
# Device calls of the next session (each phase fits one 600 s call), most important first:
#   phase 1: staged code -- the MoE decode kernel's row passes and the indexer's token-group
#            kernel (tests, then the MoE layer bench at T = 1, 64, 320 and the indexer bench
#            with their columns); the whole GPU suite;
#   phase 2: the decode runtime at the slice config after the indexer-width fix (both backends,
#            quick form), the small config's fused path with both staged options (MoE row
#            passes, indexer token groups; if phase 1's tests pass), the per-family probes;
#   phase 3: the runtime bench at the full lengths on the small config (BS1 4096/1024,
#            BS64 4096/2048; never run), the benches not re-run this session.
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
  step 330 spec_slice python -m spec_decode.bench --model slice --backends baseline,fused --quick --prefill-chunk 64 --out "$OUT/spec_slice.md"
  step 80 spec_small_staged python -m spec_decode.bench --model small --backends fused --quick --moe-row-tile 16 --indexer-token-group 3 --out "$OUT/spec_small_staged.md"
  step 90 probe_slice python tools/probe_slice_families.py
  step 90 probe_small_bs64 env MODEL=small B=64 python tools/probe_slice_families.py
  ;;
3)
  step 300 spec_small_full python -m spec_decode.bench --model small --backends baseline,fused --out "$OUT/spec_small_full.md"
  for b in bench_row_rms bench_moe bench_mhc bench_comm; do
    [ -f "bench/$b.py" ] && step 120 "$b" python "bench/$b.py" --out "$OUT/$b.md"
  done
  ;;
esac
