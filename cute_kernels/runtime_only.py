"""Runtime-only mode: every kernel served from the artifact cache, without the CuTe DSL compiler.

A deployment that ships the artifact cache built by ``python -m cute_kernels build`` (kernel
objects for its archs and shapes) does not need the DSL's compiler -- the ``cutlass`` package,
about 260 MB with its MLIR libraries and a second to import. It needs the DSL's runtime
library (``libcute_dsl_runtime.so``, 43 MB: the CUDA runtime the kernel objects call), which
``python -m cute_kernels build --with-runtime`` copies into the cache, and torch.

The mode is automatic: it is on exactly when the ``cutlass`` package cannot be found
(:func:`active`). Then

* importing a kernel module works as usual (``from cute_kernels.row_rms import row_rms``): its
  ``import cutlass ...`` lines receive stand-ins (:class:`StandIn`) -- the kernel classes are
  defined but never traced. The stand-ins are given only to this project's modules; any other
  importer of ``cutlass`` gets the usual ``ImportError``, and no stand-in stays in
  ``sys.modules`` once the project's module has been imported;
* :func:`cute_kernels.jit.get_kernel` returns the cache entry's launcher
  (:class:`cute_kernels.exported.ExportedKernel`: the object's C entry point through
  ``ctypes``), and the argument helpers (``jit.gmem_ptr``, ``jit.i32``, ``jit.f32``,
  ``jit.cu_stream``) pass plain addresses and numbers -- so every entry point, with its
  validation, runs unchanged;
* an entry missing from the cache (another config, another arch, another DSL version or an
  edited kernel source) raises :class:`MissingArtifact`, naming the ``build`` command that
  would produce it; nothing is compiled.

Prepare a cache: ``python -m cute_kernels build --with-runtime`` (the AOT configs, or one with
``--kernel K --config JSON``), or run the workload once where the DSL is installed and then
``python -m cute_kernels bundle``. Measure it: ``python bench/bench_host_cost.py`` (its
runtime-only column, import time and first call; on a GPU). Test: ``pytest
tests/test_caches.py -k runtime_only``.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

#: the project's packages: the importers that get stand-ins
PACKAGES = ("cute_kernels", "moe", "comm", "spec_decode")
#: what the stand-ins replace (``cuda.bindings.driver`` only when cuda-bindings is absent)
_DSL_ROOTS = ("cutlass",)


class MissingArtifact(FileNotFoundError):
    """A kernel the artifact cache does not hold, asked for in runtime-only mode."""


_probing = False


@functools.lru_cache(maxsize=None)
def _findable(name: str) -> bool:
    """Whether ``name`` is installed (the stand-in finder stays out of the probe)."""
    global _probing
    _probing = True
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
    finally:
        _probing = False


def dsl_installed() -> bool:
    """Whether the CuTe DSL compiler (``cutlass``) can be imported in this process."""
    return _findable("cutlass")


def active() -> bool:
    """Runtime-only mode: on when the DSL compiler is not installed."""
    return not dsl_installed()


class StandIn:
    """What a kernel module's DSL names are bound to in runtime-only mode: any attribute,
    index or call gives another stand-in, except that a call on one function or class (a
    decorator: ``@cute.jit``, ``@cute.kernel``, ``@cute.struct``) returns it unchanged. Kernel
    code never runs in this mode; the stand-ins only let the modules define their classes."""

    __slots__ = ("_name",)

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> "StandIn":
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return StandIn(f"{self._name}.{attr}")

    def __getitem__(self, item) -> "StandIn":
        return StandIn(f"{self._name}[...]")

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and isinstance(args[0], (types.FunctionType, type)):
            return args[0]
        return StandIn(f"{self._name}(...)")

    def __mro_entries__(self, bases):
        return (object,)

    def __repr__(self) -> str:
        return f"<runtime-only stand-in for {self._name}>"


class _StandInModule(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return StandIn(f"{self.__name__}.{attr}")


def _importer_is_project() -> bool:
    """Whether the frame that runs the ``import`` statement belongs to a project module."""
    f = sys._getframe(1)
    while f is not None:
        code = f.f_code.co_filename
        if not (code.startswith("<frozen importlib") or code == __file__):
            name = f.f_globals.get("__name__", "")
            return name.split(".")[0] in PACKAGES
        f = f.f_back
    return False


class _StandInLoader(importlib.abc.Loader):
    def create_module(self, spec):
        mod = _StandInModule(spec.name)
        mod.__path__ = []  # a package: its submodules import too
        return mod

    def exec_module(self, module) -> None:
        _served.add(module.__name__)


class _ProjectLoader(importlib.abc.Loader):
    """Runs a project module's own loader, then takes the stand-ins it received out of
    ``sys.modules`` (the module keeps its references)."""

    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        global _depth
        _depth += 1
        try:
            self.inner.exec_module(module)
        finally:
            _depth -= 1
            if _depth == 0:
                for name in list(_served):
                    sys.modules.pop(name, None)
                _served.clear()

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


_served: set[str] = set()
_depth = 0


class StandInFinder(importlib.abc.MetaPathFinder):
    """Serves :class:`StandIn` modules for the DSL to the project's modules (runtime-only
    mode), and wraps the project's own modules' loaders to clean up after them."""

    def find_spec(self, fullname, path=None, target=None):
        if _probing:
            return None
        root = fullname.split(".")[0]
        if root in PACKAGES:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    if spec.loader is not None and not isinstance(spec.loader, _ProjectLoader):
                        spec.loader = _ProjectLoader(spec.loader)
                    return spec
            return None
        stand_in = root in _DSL_ROOTS or (fullname.startswith("cuda.bindings") and not _findable("cuda.bindings"))
        if stand_in and _importer_is_project():
            return importlib.machinery.ModuleSpec(fullname, _StandInLoader(), is_package=True)
        return None


_FINDER = StandInFinder()


def install() -> None:
    """Put the stand-in finder first on ``sys.meta_path`` (idempotent; only in runtime-only
    mode -- :mod:`cute_kernels` calls it on import)."""
    if active() and _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
