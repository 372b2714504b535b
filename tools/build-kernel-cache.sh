#!/usr/bin/env bash
# Build the sm_90a compile cache on this machine (no GPU) and pack it for the device machine in
# two parts (docs/device.md): .devcache/kernel-cache.tar.xz (WO-A's bf16 routes, the router,
# the MXFP8 quantization, the expert GEMMs and the finalize: carried beside the DSL bundle,
# unpacked by tools/device-env.sh; about 240 KB, which with the bundle and the tracked tree must
# stay under the 64 MiB a call carries) and .devcache/kernel-cache-b.tar.xz (the rest and the
# tensor entries: carried in the next call, `bash tools/device.sh cache-in
# .devcache/kernel-cache-b.tar.xz`).
#
#   bash tools/build-kernel-cache.sh [extra `python -m cute_kernels build` arguments]
#   KC_PACK_ONLY=1 bash tools/build-kernel-cache.sh   pack $KC_ROOT again (after adding entries to
#                                                    it with `python -m cute_kernels build --kernel
#                                                    NAME --config JSON --cache $KC_ROOT/cute_kernels_cache`)
set -eu
root=${KC_ROOT:-/tmp/kc}
if [ -z "${KC_PACK_ONLY:-}" ]; then
  rm -rf "$root"
  python -m cute_kernels build --arch sm_90a --tensor-entries --cache "$root/cute_kernels_cache" "$@" | tail -1
fi
version=$(ls "$root/cute_kernels_cache")
second="sink_attention compressor_pool indexer_scores indexer_scores_fp8 indexer_scores_sm90
  indexer_scores_token_group_sm90 indexer_topk mhc_stats mhc_pre_mix mhc_post_mix push_allreduce rms_norm row_rms
  masked_softmax wo_a_fp8_act_sm90 draft_head_fp8 wo_a_decode_fp8 dequant_fp8_blockwise"
exclude=() include=()
for d in "$root/cute_kernels_cache/$version"/sm_90a/*; do
  k=$(basename "$d")
  case " $(echo $second) " in
    *" $k "*) ;;
    *) [[ $k == *_tensors ]] || { exclude+=("--exclude=cute_kernels_cache/$version/sm_90a/$k"); continue; } ;;
  esac
  include+=("cute_kernels_cache/$version/sm_90a/$k")
done
mkdir -p .devcache
tar -cJf .devcache/kernel-cache-b.tar.xz -C "$root" "${include[@]}"
tar -cJf .devcache/kernel-cache.tar.xz -C "$root" "${include[@]/#/--exclude=}" cute_kernels_cache
ls -la .devcache/kernel-cache.tar.xz .devcache/kernel-cache-b.tar.xz
