# Source on the H200 device machine (repo root as cwd): unpack CuTe DSL from .devcache
# (see ../shared/device/README.md) and put it and this checkout on PYTHONPATH.
#
# The bundle travels recompressed (.devcache/cutedsl-4.8.1-cp312-cu13.d256.tar.xz, 52.3 MiB,
# docs/device.md), as shipped (cutedsl-4.8.1-cp312-cu13.tar.xz, 61.75 MiB), or in two
# parts (.devcache/cutedsl-4.8.1.part00 / part01, `split -b 32M -d`), one per call. A part
# carried in is kept in /tmp (the machine keeps /tmp while warm); with both there, they are
# joined and unpacked. With one part only this returns 1 after keeping it (docs/device.md).
SITE=${CUTE_KERNELS_DSL_SITE:-/tmp/site}
mkdir -p "$SITE"
if [ ! -d "$SITE/nvidia_cutlass_dsl" ]; then
  whole=""  # the recompressed bundle first, then the one as shipped
  for f in .devcache/cutedsl-4.8.1-cp312-cu13.d256.tar.xz .devcache/cutedsl-4.8.1-cp312-cu13.tar.xz; do
    [ -f "$f" ] && { whole=$f; break; }
  done
  if [ -n "$whole" ]; then
    tar -xJf "$whole" -C "$SITE" || return 1
  else
    for part in .devcache/cutedsl-4.8.1.part*; do
      [ -f "$part" ] && cp "$part" "$(dirname "$SITE")/"
    done
    parts=("$(dirname "$SITE")"/cutedsl-4.8.1.part0[01])
    if [ -f "${parts[0]}" ] && [ -f "${parts[1]:-}" ]; then
      cat "${parts[@]}" | tar -xJ -C "$SITE" || return 1
      rm -f "${parts[@]}"
    else
      echo "device-env: a part of the DSL bundle is kept in $(dirname "$SITE"); carry the other next" >&2
      return 1
    fi
  fi
fi
export PYTHONPATH=$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages:$PWD${PYTHONPATH:+:$PYTHONPATH}
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
