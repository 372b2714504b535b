"""Calling an artifact-cache entry without the CuTe DSL compiler: a ctypes loader.

An entry of the artifact cache (:mod:`cute_kernels.artifact_cache`) is what the DSL's
``export_to_c`` writes: ``kernel.o`` (the host launcher and the cubin) and ``kernel.h``. The
object needs only the DSL's runtime library, ``libcute_dsl_runtime.so`` (43 MB; CUDA runtime
inside, the driver loaded lazily), not the MLIR compiler (the ``cutlass`` package, 260 MB,
about 1 s to import). This module links an entry's ``kernel.o`` into ``kernel.so`` (once,
with the system C compiler, next to the entry) and calls it through ctypes:

* ``<prefix>_cuda_init`` and ``<prefix>_cuda_load_to_device`` (per device) load the cubin;
* the launcher ``_mlir_<prefix>__mlir_ciface_...(void **args, int32 n)`` takes a pointer to
  each argument value, then the return code, in the order of ``kernel.h``'s
  ``cute_dsl_<prefix>_wrapper`` -- parsed from the header here (``void *`` pointers,
  ``int32_t`` / ``float`` scalars, ``cudaStream_t``).

Nothing here imports ``cutlass``. What it is: the building block of a compiler-free
deployment (the entry points still pack their arguments with the DSL's pointer types; a
runtime-only call path per kernel is not built). Checked on the CPU up to the CUDA calls
(tests/test_caches.py); the launch itself needs a GPU.
"""

from __future__ import annotations

import ctypes
import os
import re
import subprocess

_CTYPES = {"void *": ctypes.c_void_p, "int32_t": ctypes.c_int32, "float": ctypes.c_float,
           "cudaStream_t": ctypes.c_void_p, "int64_t": ctypes.c_int64}
_RUNTIME = None


def runtime_library() -> str:
    """Path of ``libcute_dsl_runtime.so`` (``$CUTE_DSL_RUNTIME_LIB``, else found beside the DSL
    package without importing it)."""
    env = os.environ.get("CUTE_DSL_RUNTIME_LIB")
    if env:
        return env
    import importlib.util

    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("libcute_dsl_runtime.so: set CUTE_DSL_RUNTIME_LIB (the DSL package is not installed)")
    root = list(spec.submodule_search_locations)[0]
    for sub in ("cu13", "cu12"):
        p = os.path.join(root, sub, "lib", "libcute_dsl_runtime.so")
        if os.path.exists(p):
            return p
    raise FileNotFoundError(f"libcute_dsl_runtime.so not found under {root}")


def _load_runtime():
    global _RUNTIME
    if _RUNTIME is None:
        _RUNTIME = ctypes.CDLL(runtime_library(), mode=ctypes.RTLD_GLOBAL)
    return _RUNTIME


class ExportedKernel:
    """One artifact-cache entry (a directory holding ``kernel.o`` and ``kernel.h``), callable
    without the DSL compiler: ``k = ExportedKernel(path); k.load(); k(x_ptr, out_ptr, T, eps,
    stream)`` with raw device pointers (ints) and scalars in ``k.arg_names`` order."""

    def __init__(self, entry_dir: str):
        header = open(os.path.join(entry_dir, "kernel.h")).read()
        m = re.search(r"static inline int32_t cute_dsl_\w+?_wrapper\((\w+)_Kernel_Module_t \*module, (.*?)\)", header,
                      re.S)
        if m is None:
            raise ValueError(f"{entry_dir}: kernel.h has no cute_dsl_*_wrapper launcher")
        self.prefix = m.group(1)
        params = [p.strip() for p in m.group(2).split(",")]
        self.arg_names, self.arg_types = [], []
        for p in params:  # "void *x_ptr", "int32_t num_tokens", "float eps", "cudaStream_t stream"
            ctype, name = p.rsplit(" ", 1)
            if name.startswith("*"):
                ctype, name = ctype + " *", name[1:]
            if ctype not in _CTYPES:
                raise ValueError(f"{entry_dir}: launcher argument {p!r} has an unsupported type")
            self.arg_names.append(name)
            self.arg_types.append(_CTYPES[ctype])
        launch = re.search(r"void (_mlir_\w+__mlir_ciface_\w+)\(void \*\*args, int32_t num_args\);", header)
        if launch is None:
            raise ValueError(f"{entry_dir}: kernel.h declares no ciface launcher")
        self._launch_name = launch.group(1)
        self.entry_dir = entry_dir
        self._lib = None
        self._module = ctypes.c_void_p()

    def link(self) -> str:
        """``kernel.so`` beside the entry (linked once against the runtime library)."""
        so = os.path.join(self.entry_dir, "kernel.so")
        if not os.path.exists(so):
            rt = runtime_library()
            tmp = so + f".tmp{os.getpid()}"
            subprocess.run(["cc", "-shared", "-o", tmp, os.path.join(self.entry_dir, "kernel.o"),
                            f"-L{os.path.dirname(rt)}", "-lcute_dsl_runtime", f"-Wl,-rpath,{os.path.dirname(rt)}"],
                           check=True, capture_output=True)
            os.replace(tmp, so)
        return so

    def open(self) -> None:
        """Resolve the object's symbols (no CUDA call yet)."""
        if self._lib is None:
            _load_runtime()
            self._lib = ctypes.CDLL(self.link(), mode=os.RTLD_NOW)

    def load(self, devices=(0,)) -> None:
        """Load the cubin (CUDA): the header's ``Kernel_Module_Load`` sequence."""
        self.open()
        ret = ctypes.c_int(0)
        libp = ctypes.pointer(self._module)
        args = (ctypes.c_void_p * 2)(ctypes.addressof(libp), ctypes.addressof(ret))
        getattr(self._lib, f"_mlir_{self.prefix}_cuda_init")(args)
        if ret.value:
            raise RuntimeError(f"{self.prefix}: cuda_init failed with CUDA error {ret.value}")
        for d in devices:
            dev = ctypes.c_int32(d)
            largs = (ctypes.c_void_p * 3)(ctypes.addressof(libp), ctypes.addressof(dev), ctypes.addressof(ret))
            getattr(self._lib, f"_mlir_{self.prefix}_cuda_load_to_device")(largs)
            if ret.value:
                raise RuntimeError(f"{self.prefix}: loading to device {d} failed with CUDA error {ret.value}")

    def __call__(self, *args) -> int:
        if len(args) != len(self.arg_types):
            raise TypeError(f"{self.prefix}: takes {len(self.arg_types)} arguments {self.arg_names}, got {len(args)}")
        vals = [t(a) for t, a in zip(self.arg_types, args)]
        ret = ctypes.c_int32(0)
        ptrs = (ctypes.c_void_p * (len(vals) + 1))(*[ctypes.addressof(v) for v in vals], ctypes.addressof(ret))
        getattr(self._lib, self._launch_name)(ptrs, ctypes.c_int32(len(vals) + 1))
        return ret.value
