"""Calling an artifact-cache entry without the CuTe DSL compiler: a ctypes launcher.

An entry of the artifact cache (:mod:`cute_kernels.artifact_cache`) is what the DSL's
``export_to_c`` writes: ``kernel.o`` (the host launcher and the cubin) and ``kernel.h``. The
object needs only the DSL's runtime library, ``libcute_dsl_runtime.so`` (43 MB; CUDA runtime
inside, the driver loaded lazily), not the MLIR compiler (the ``cutlass`` package, 260 MB,
about 1 s to import). :class:`ExportedKernel` links an entry's ``kernel.o`` into ``kernel.so``
(``python -m cute_kernels build --with-runtime`` does it for every entry, so a deployment needs
no C compiler; else the first use, with the system's ``cc``), resolves its symbols against the
runtime library loaded first (``RTLD_GLOBAL``), and calls it through ctypes:

* ``<prefix>_cuda_init`` and ``<prefix>_cuda_load_to_device`` load the cubin -- on each device
  at its first call there (``torch.cuda.current_device()``);
* the launcher ``_mlir_<prefix>__mlir_ciface_...(void **args, int32 n)`` takes a pointer to
  each argument value, then the return code, in the order of ``kernel.h``'s
  ``cute_dsl_<prefix>_wrapper`` -- parsed from the header here (``void *`` pointers,
  ``int32_t`` / ``float`` scalars, ``cudaStream_t``).

Nothing here imports ``cutlass``. In runtime-only mode (:mod:`cute_kernels.runtime_only`)
:func:`cute_kernels.jit.get_kernel` returns these launchers, and the entry points pass them raw
addresses, numbers and stream handles. A nonzero return code (a CUDA error of the launch)
raises ``RuntimeError``.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import threading

_CTYPES = {"void *": ctypes.c_void_p, "int32_t": ctypes.c_int32, "float": ctypes.c_float,
           "cudaStream_t": ctypes.c_void_p, "int64_t": ctypes.c_int64}
_RUNTIME = None


def runtime_library(bundled: str | None = None) -> str:
    """Path of ``libcute_dsl_runtime.so``: ``$CUTE_DSL_RUNTIME_LIB``, else ``bundled`` (the copy
    ``build --with-runtime`` puts in the artifact cache), else the DSL package's own (found
    without importing it)."""
    env = os.environ.get("CUTE_DSL_RUNTIME_LIB")
    if env:
        return env
    if bundled and os.path.isfile(bundled):
        return bundled
    import importlib.util

    try:
        spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("libcute_dsl_runtime.so: not in the artifact cache (python -m cute_kernels build "
                                "--with-runtime) and the DSL package is not installed; or set CUTE_DSL_RUNTIME_LIB")
    root = list(spec.submodule_search_locations)[0]
    for sub in ("cu13", "cu12"):
        p = os.path.join(root, sub, "lib", "libcute_dsl_runtime.so")
        if os.path.exists(p):
            return p
    raise FileNotFoundError(f"libcute_dsl_runtime.so not found under {root}")


def _load_runtime(bundled: str | None = None):
    global _RUNTIME
    if _RUNTIME is None:
        _RUNTIME = ctypes.CDLL(runtime_library(bundled), mode=ctypes.RTLD_GLOBAL)
    return _RUNTIME


def _current_device() -> int:
    import torch

    return torch._C._cuda_getDevice()


def link_entry(entry_dir: str) -> str:
    """``kernel.so`` beside the entry's ``kernel.o`` (linked once; its runtime symbols stay
    undefined and resolve against the runtime library loaded before it)."""
    so = os.path.join(entry_dir, "kernel.so")
    if not os.path.exists(so):
        cc = shutil.which("cc")
        if cc is None:
            raise FileNotFoundError(f"{entry_dir}: kernel.so is missing and there is no C compiler to link "
                                    f"kernel.o; build the cache with `python -m cute_kernels build --with-runtime`")
        tmp = so + f".tmp{os.getpid()}"
        subprocess.run([cc, "-shared", "-o", tmp, os.path.join(entry_dir, "kernel.o")], check=True,
                       capture_output=True)
        os.replace(tmp, so)
    return so


_TVM_FFI_MODULES: dict[str, object] = {}


def load_tvm_ffi_entry(entry_dir: str, name: str, runtime_library: str | None = None):
    """The ``tvm_ffi.Function`` ``name`` of a TVM-FFI entry (its ``kernel.o`` exports one),
    without the DSL: the runtime library loaded first, ``kernel.so`` linked once and loaded by
    ``tvm_ffi.load_module`` (the module kept for the process). Its first call loads the cubin."""
    import tvm_ffi

    _load_runtime(runtime_library)
    mod = _TVM_FFI_MODULES.get(entry_dir)
    if mod is None:
        mod = _TVM_FFI_MODULES[entry_dir] = tvm_ffi.load_module(link_entry(entry_dir))
    return mod[name]


class ExportedKernel:
    """One artifact-cache entry (a directory holding ``kernel.o`` and ``kernel.h``), callable
    without the DSL compiler: ``k = ExportedKernel(path); k.load(); k(x_ptr, out_ptr, T, eps,
    stream)`` with raw device pointers (ints) and scalars in ``k.arg_names`` order."""

    def __init__(self, entry_dir: str, runtime_library: str | None = None):
        self._runtime_library = runtime_library
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
        self._launch = None
        self._module = ctypes.c_void_p()
        self._initialised = False
        self._devices: set[int] = set()
        self._cells = [t() for t in self.arg_types]
        self._ret = ctypes.c_int32(0)
        self._ptrs = (ctypes.c_void_p * (len(self._cells) + 1))(*[ctypes.addressof(c) for c in self._cells],
                                                                 ctypes.addressof(self._ret))
        self._nargs = ctypes.c_int32(len(self._cells) + 1)
        self._cells_lock = threading.Lock()

    def link(self) -> str:
        """``kernel.so`` beside the entry (:func:`link_entry`)."""
        return link_entry(self.entry_dir)

    def open(self) -> None:
        """Resolve the object's symbols (no CUDA call yet)."""
        if self._lib is None:
            _load_runtime(self._runtime_library)
            self._lib = ctypes.CDLL(self.link(), mode=os.RTLD_NOW)
            self._launch = getattr(self._lib, self._launch_name)

    def load(self, devices=(0,)) -> None:
        """Load the cubin onto ``devices`` (CUDA): the header's ``Kernel_Module_Load`` sequence."""
        self.open()
        ret = ctypes.c_int(0)
        libp = ctypes.pointer(self._module)
        if not self._initialised:
            args = (ctypes.c_void_p * 2)(ctypes.addressof(libp), ctypes.addressof(ret))
            getattr(self._lib, f"_mlir_{self.prefix}_cuda_init")(args)
            if ret.value:
                raise RuntimeError(f"{self.prefix}: cuda_init failed with CUDA error {ret.value}")
            self._initialised = True
        for d in devices:
            if d in self._devices:
                continue
            dev = ctypes.c_int32(d)
            largs = (ctypes.c_void_p * 3)(ctypes.addressof(libp), ctypes.addressof(dev), ctypes.addressof(ret))
            getattr(self._lib, f"_mlir_{self.prefix}_cuda_load_to_device")(largs)
            if ret.value:
                raise RuntimeError(f"{self.prefix}: loading to device {d} failed with CUDA error {ret.value}")
            self._devices.add(d)

    def __call__(self, *args) -> int:
        """Launch with ``args`` in :attr:`arg_names` order: device pointers and stream handles
        as ints, scalars as Python numbers. Loads the cubin onto the current device first if
        it is not there yet."""
        if len(args) != len(self.arg_types):
            raise TypeError(f"{self.prefix}: takes {len(self.arg_types)} arguments {self.arg_names}, got {len(args)}")
        dev = _current_device()
        # one set of argument cells, reused: the values are written, then the launcher reads
        # them through the fixed pointer array (under a lock: ctypes releases the GIL, and
        # simulated ranks launch from several threads)
        with self._cells_lock:
            if dev not in self._devices:
                self.load((dev,))
            for cell, a in zip(self._cells, args):
                cell.value = a
            self._ret.value = 0
            self._launch(self._ptrs, self._nargs)
            ret = self._ret.value
        if ret:
            raise RuntimeError(f"{self.prefix}: launch failed with CUDA error {ret}")
        return ret
