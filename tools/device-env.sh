# Source on the H200 device machine (repo root as cwd): unpack CuTe DSL from .devcache
# (see ../shared/device/README.md) and put it and this checkout on PYTHONPATH.
mkdir -p /tmp/site
if [ ! -d /tmp/site/nvidia_cutlass_dsl ]; then
  tar -xJf .devcache/cutedsl-4.8.1-cp312-cu13.tar.xz -C /tmp/site || return 1
fi
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export CUTE_KERNELS_CACHE_DIR=${CUTE_KERNELS_CACHE_DIR:-/tmp/cute_kernels_cache}
# compiled kernels carried in (docs/device.md): a fresh machine loads them instead of compiling
if [ -f .devcache/kernel-cache.tar.xz ] && [ ! -d "$CUTE_KERNELS_CACHE_DIR" ]; then
  mkdir -p "$(dirname "$CUTE_KERNELS_CACHE_DIR")"
  tar -xJf .devcache/kernel-cache.tar.xz -C "$(dirname "$CUTE_KERNELS_CACHE_DIR")" \
    || echo "device-env: the carried kernel cache did not unpack; kernels compile" >&2
  # (the archive holds cute_kernels_cache/: move it only where the cache lives elsewhere)
  src="$(dirname "$CUTE_KERNELS_CACHE_DIR")/cute_kernels_cache"
  [ "$src" -ef "$CUTE_KERNELS_CACHE_DIR" ] || mv -n "$src" "$CUTE_KERNELS_CACHE_DIR" 2>/dev/null || true
fi
true
