#!/usr/bin/env bash
# Build FlashInfer's top-k module for sm_90a on this machine (nvcc, no GPU) and pack FlashInfer
# without its JIT sources, the module in its AOT place (flashinfer/data/aot/topk/topk.so: loaded
# with the JIT off), as .devcache/peers-fi-aot/flashinfer-aot-topk.tar.xz (~17 MB) -- on the
# device its nvcc build of the module outlasts a call. `bash tools/device.sh peers --families
# topk` unpacks it over /tmp/site (a call after the one that unpacked the DSL and apache-tvm-ffi).
# Needs the flashinfer wheel in .devcache/peers-flashinfer, curand's headers (nvidia-curand wheel)
# and FlashInfer's import-time modules (pynvml, tqdm: installed into the build tree).
set -eu
wheel=$(ls .devcache/peers-flashinfer/flashinfer_python-*.whl)
b=${FI_BUILD:-/tmp/fi-topk}; rm -rf "$b"; mkdir -p "$b/site" "$b/curand" "$b/stub"
python -m pip install -q --no-deps --target "$b/site" "$wheel" nvidia-ml-py tqdm
python -m pip download -q --no-deps -d "$b/curand" nvidia-curand && (cd "$b/curand" && unzip -q -o ./*.whl)
echo "" > "$b/stub/s.c" && gcc -shared -o "$b/stub/libcuda.so" -Wl,-soname,libcuda.so.1 "$b/stub/s.c"  # (link only)
PYTHONPATH="$b/site" FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_WORKSPACE_BASE="$b/ws" \
  FLASHINFER_EXTRA_CUDAFLAGS="-I$b/curand/nvidia/cu13/include" \
  FLASHINFER_EXTRA_LDFLAGS="-L/usr/local/cuda/lib64 -L$b/stub" \
  python -c "from flashinfer.jit.topk import gen_topk_module as g; s = g(); s.build(); print(s.jit_library_path)" | tail -1
so=$(ls "$b"/ws/.cache/flashinfer/*/90a/cached_ops/topk/topk.so)
p="$b/pack"; mkdir -p "$p" && (cd "$p" && unzip -q "$OLDPWD/$wheel")
rm -rf "$p"/flashinfer/data/{cccl,csrc,cutlass,include,spdlog}; mkdir -p "$p/flashinfer/data/aot/topk"
cp "$so" "$p/flashinfer/data/aot/topk/"
mkdir -p .devcache/peers-fi-aot
tar -C "$p" -cf - flashinfer "$(cd "$p" && ls -d flashinfer_python-*.dist-info)" | xz -9 -T2 \
  > .devcache/peers-fi-aot/flashinfer-aot-topk.tar.xz
ls -la .devcache/peers-fi-aot/flashinfer-aot-topk.tar.xz
