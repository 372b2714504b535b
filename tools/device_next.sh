#!/usr/bin/env bash
# Device calls for re-measuring the current tree (each phase fits one 600 s call), most
# important first:
#   phase 1: the whole GPU suite, the MoE layer bench (T = 1, 64, 384) and the indexer bench;
#   phase 2: the decode runtime's GPU tests (incl. the staged masked-dense attention core),
#            the slice config with that core, the small config (quick, both backends), the
#            slice config (quick, prefill chunks of 64) with the default gather core;
#   phase 3: the small config at the full lengths (BS1 4096/1024, BS64 4096/2048),
#            the slice config's per-family logits probe, the tiled-kernel fault probe, the
#            slice verify step's kernel profile (BS1 gather core, BS64 masked-dense core);
#   phase 4: the slice config at the full lengths with the masked-dense attention
#            core (never run; if it does not fit in memory the bench prints n/a and why).
#   device run (carry .devcache):  bash tools/device_next.sh N   (N = 1..12)
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
  step 240 gpu_suite $PYT tests -m gpu
  step 150 bench_moe python bench/bench_moe_experts.py --tokens 1,64,384 --out "$OUT/bench_moe.md"
  step 100 bench_indexer python bench/bench_indexer.py --out "$OUT/bench_indexer.md"
  ;;
2)
  step 90 spec_tests $PYT tests/test_spec_decode.py -m gpu
  # staged: the masked-dense attention core (both backends), then the measured default
  step 200 spec_slice_dense python -m spec_decode.bench --model slice --backends baseline,fused --quick --prefill-chunk 64 --attention-core masked_dense --out "$OUT/spec_slice_dense.md"
  step 120 spec_small python -m spec_decode.bench --model small --backends baseline,fused --quick --out "$OUT/spec_small.md"
  step 200 spec_slice python -m spec_decode.bench --model slice --backends baseline,fused --quick --prefill-chunk 64 --out "$OUT/spec_slice.md"
  ;;
3)
  step 200 spec_small_full python -m spec_decode.bench --model small --backends baseline,fused --out "$OUT/spec_small_full.md"
  step 100 probe_numerics env BATCHES=1,64 python tools/probe_slice_numerics.py
  step 80 probe_fault env CUDA_LAUNCH_BLOCKING=1 python tools/probe_moe_fault.py
  step 100 probe_profile_bs1 python tools/probe_slice_profile.py
  step 100 probe_profile_bs64 env B=64 CORE=masked_dense python tools/probe_slice_profile.py
  ;;
5)  # the staged masked-dense core's GPU test and slice quick run, then where a slice step goes
  step 90 spec_tests $PYT tests/test_spec_decode.py -m gpu
  step 200 spec_slice_dense python -m spec_decode.bench --model slice --backends baseline,fused --quick --prefill-chunk 64 --attention-core masked_dense --out "$OUT/spec_slice_dense.md"
  step 100 probe_profile_bs1 python tools/probe_slice_profile.py
  step 100 probe_profile_bs64 env B=64 CORE=masked_dense python tools/probe_slice_profile.py
  ;;
6)  # the masked-dense core as the default (in-place pool path), the teacher-forced agreement row
  step 90 spec_tests $PYT tests/test_spec_decode.py -m gpu -s
  step 200 spec_slice python -m spec_decode.bench --model slice --backends baseline,fused --quick --out "$OUT/spec_slice.md"
  step 120 spec_small python -m spec_decode.bench --model small --backends baseline,fused --quick --out "$OUT/spec_small.md"
  step 100 probe_profile_bs64 env B=64 python tools/probe_slice_profile.py
  ;;
8)  # the MXFP8 draft head (GPU test, slice quick), the MoE row passes of 32 columns at T = 384
  step 100 spec_tests $PYT tests/test_spec_decode.py -m gpu -s
  step 90 row_pass_tests $PYT tests -m gpu -k "row_passes or draft_head"
  step 150 spec_slice python -m spec_decode.bench --model slice --backends baseline,fused --quick --out "$OUT/spec_slice.md"
  step 100 spec_slice_row32 python -m spec_decode.bench --model slice --backends fused --quick --moe-row-tile 32 --out "$OUT/spec_slice_row32.md"
  step 60 probe_profile_bs1 python tools/probe_slice_profile.py
  ;;
9)  # the draft head in one pass, prefill chunks of 384: slice quick, then the lengths
  step 110 spec_slice python -m spec_decode.bench --model slice --backends baseline,fused --quick --out "$OUT/spec_slice.md"
  step 460 spec_slice_full python -m spec_decode.bench --model slice --backends baseline,fused --out "$OUT/spec_slice_full.md"
  ;;
10)  # the draft-head policy (MXFP8 up to 16 rows): spec GPU tests, slice quick, small at full lengths
  step 100 spec_tests $PYT tests/test_spec_decode.py -m gpu -s
  step 110 spec_slice python -m spec_decode.bench --model slice --backends baseline,fused --quick --out "$OUT/spec_slice.md"
  step 250 spec_small_full python -m spec_decode.bench --model small --backends baseline,fused --out "$OUT/spec_small_full.md"
  ;;
11)  # attention_core="auto", the draft head's size rule: spec GPU tests, small at full lengths, slice quick
  step 100 spec_tests $PYT tests/test_spec_decode.py -m gpu -s
  step 250 spec_small_full python -m spec_decode.bench --model small --backends baseline,fused --out "$OUT/spec_small_full.md"
  step 110 spec_slice python -m spec_decode.bench --model slice --backends baseline,fused --quick --out "$OUT/spec_slice.md"
  ;;
12)  # the final defaults at the lengths (slice), then the whole GPU suite
  step 300 spec_slice_full python -m spec_decode.bench --model slice --backends baseline,fused --out "$OUT/spec_slice_full.md"
  step 250 gpu_suite $PYT tests -m gpu
  ;;
7)  # the slice config at the lengths (default masked-dense core, prefill chunks of 512)
  step 570 spec_slice_full python -m spec_decode.bench --model slice --backends baseline,fused --out "$OUT/spec_slice_full.md"
  ;;
4)  # BS64 at 2048 output tokens: minutes per backend even when the attention core is not the bound
  step 560 spec_slice_full_dense python -m spec_decode.bench --model slice --backends baseline,fused --prefill-chunk 64 --attention-core masked_dense --out "$OUT/spec_slice_full_dense.md"
  ;;
esac
