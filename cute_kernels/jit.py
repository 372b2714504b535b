"""Kernel registry and the one compiled-kernel cache every kernel goes through.

A kernel module registers a :class:`KernelDef`: a name, the source files whose text
defines it, a ``build(arch, **config) -> (jit_object, compile_args)`` function that
returns the ``@cute.jit`` callable and the fake (CPU-only) arguments to compile it with,
and the configurations the AOT build covers. :func:`get_kernel` then returns a callable
compiled for ``(kernel, source hash, config, arch, options, DSL version)``:

1. in-process cache hit -> the same function object (no host work beyond a dict lookup);
2. else the on-disk artifact cache (:mod:`cute_kernels.artifact_cache`) is asked; a
   valid entry is loaded with ``cute.runtime.load_module`` -- the compiler is not run;
3. else ``cute.compile`` runs, and the result is exported into the artifact cache.

Calling convention. Kernels are compiled against raw global-memory pointers
(``cute.runtime.make_ptr``) plus ``Int32`` runtime extents, with static extents (hidden
size, tile shapes) in the config. One compile therefore serves every batch size, the
exported object has a plain C ABI, and a call costs no DLPack conversion (45-86 us per
tensor on the H200 host, see the device README); :func:`gmem_ptr` caches pointer
wrappers so steady-state decode calls build nothing, and :class:`DirectLaunch` (what
:func:`get_kernel` returns) hands their addresses to the DSL's executor without the DSL's
per-call argument adaptation, once it has checked they are the addresses the DSL would pass.

Runtime-only mode (:mod:`cute_kernels.runtime_only`: the DSL compiler is not installed): step 2
only, through :class:`cute_kernels.exported.ExportedKernel` (no DSL import); a key the cache
does not hold raises :class:`~cute_kernels.runtime_only.MissingArtifact` naming the ``build``
command; the argument helpers pass raw addresses and numbers.

TVM-FFI launches (:func:`use_tvm_ffi`, needs the ``apache-tvm-ffi`` package): kernels compile
with the DSL's ``--enable-tvm-ffi`` calling convention, whose compiled function converts its
arguments in C (pointers as ints, scalars as Python numbers, the stream as its handle); the
argument helpers then pass raw addresses and numbers, as in runtime-only mode. Such kernels go
through the same three steps under a key whose options name ``--enable-tvm-ffi``: the artifact
cache holds them as TVM-FFI objects, loaded as ``tvm_ffi.Function``.

Tensor entries (:func:`get_tensor_kernel`, with :func:`use_tvm_ffi` on): a kernel registered
a second time with a build that takes ``cute.Tensor`` arguments of symbolic extents
(:func:`fake_tensor`) and the stream TVM-FFI tracks (torch's current stream), compiled with
``--enable-tvm-ffi``. Its compiled function takes the torch tensors themselves and checks
their dtype, rank, static extents, extents shared between arguments, strides, alignment and
device in C, raising a ``ValueError`` that names the parameter before any launch -- so an
entry point's eager hot path is one dictionary lookup and this call (the pattern quack and
FlashInfer use). The entry point keeps its Python validation for the first call and for any
call the C checks refuse, so errors still name the entry point's argument.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import threading
import time
from typing import Any, Callable, Iterable

from . import runtime_only
from .arch import normalize_arch, warn_once
from .artifact_cache import TVM_FFI_OPTION, default_cache

_REGISTRY: dict[str, "KernelDef"] = {}


@dataclasses.dataclass(frozen=True)
class KernelDef:
    name: str
    #: build(arch, **config) -> (jit_callable, tuple_of_compile_args)
    build: Callable[..., tuple[Any, tuple]]
    #: files whose contents define the kernel (hashed into the cache key)
    sources: tuple[str, ...]
    #: archs this kernel has code for
    archs: tuple[str, ...]
    #: configs compiled by ``python -m cute_kernels build``: a tuple, or ``f(arch) -> tuple``
    #: where the static config (tile shapes) depends on the arch
    aot_configs: tuple[dict, ...] | Callable[[str], tuple[dict, ...]] = ()
    description: str = ""
    #: a tensor entry (:func:`get_tensor_kernel`) of the kernel of this name: always compiled
    #: with TVM-FFI (its key's default options); the AOT build compiles its ``aot_configs``
    #: only when asked to (``build --tensor-entries``: it needs apache-tvm-ffi)
    tensor_entry_of: str = ""

    def source_hash(self) -> str:
        return _source_hash(self.sources)

    def canonical_config(self, config: dict) -> dict:
        """``config`` without the entries equal to ``build``'s keyword defaults: a caller that
        spells a default out (``stages=None``) and an AOT config that leaves it out name the
        same compiled artifact."""
        defaults = _build_defaults(self.build)
        return {k: v for k, v in config.items() if not (k in defaults and defaults[k] == v
                                                        and type(defaults[k]) is type(v))}


@functools.lru_cache(maxsize=None)
def _build_defaults(build: Callable) -> dict:
    import inspect

    return {n: p.default for n, p in inspect.signature(build).parameters.items()
            if p.default is not inspect.Parameter.empty}


_src_hash_cache: dict[tuple[str, ...], tuple[tuple, str]] = {}


def _source_hash(paths: tuple[str, ...]) -> str:
    stamp = tuple((p, os.stat(p).st_mtime_ns, os.stat(p).st_size) for p in paths)
    hit = _src_hash_cache.get(paths)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    h = hashlib.sha256()
    for p in paths:
        h.update(os.path.basename(p).encode())
        with open(p, "rb") as f:
            h.update(f.read())
    digest = h.hexdigest()[:16]
    _src_hash_cache[paths] = (stamp, digest)
    return digest


def register(kdef: KernelDef) -> KernelDef:
    prev = _REGISTRY.get(kdef.name)
    if prev is not None and prev.sources != kdef.sources:
        raise ValueError(f"kernel name {kdef.name!r} registered twice from different sources")
    _REGISTRY[kdef.name] = kdef
    return kdef


def registry() -> dict[str, KernelDef]:
    """The kernels registered so far: those of every module imported. The whole catalogue
    (which imports them all): :func:`cute_kernels.catalog.kernels`."""
    return dict(_REGISTRY)


@functools.lru_cache(maxsize=1)
def dsl_version() -> str:
    """The installed DSL's version; in runtime-only mode, the one the artifact cache was built
    with (its one version directory)."""
    if runtime_only.active():
        store = default_cache()
        versions = store.dsl_versions()
        if len(versions) != 1:
            raise runtime_only.MissingArtifact(
                f"runtime-only mode (no CuTe DSL compiler installed): the artifact cache {store.root} holds "
                f"{'no kernels' if not versions else 'kernels of several DSL versions ' + ', '.join(versions)}; "
                f"build it with `python -m cute_kernels build` where the DSL is installed")
        return versions[0]
    from importlib.metadata import version

    return version("nvidia-cutlass-dsl")


def default_options(arch: str) -> str:
    return f"--gpu-arch={arch}"


def entry_options(kdef: "KernelDef", arch: str, tvm_ffi: bool = False) -> str:
    """The compile options of ``kdef``'s entries: with TVM-FFI for a tensor entry, or for any
    kernel with ``tvm_ffi`` (:func:`use_tvm_ffi`)."""
    return f"{default_options(arch)} {TVM_FFI_OPTION}" if tvm_ffi or kdef.tensor_entry_of else default_options(arch)


def _canon(v: Any) -> Any:
    """JSON-stable form of a config value (dtypes and DSL types by name)."""
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, (tuple, list)):
        return [_canon(x) for x in v]
    if hasattr(v, "__name__"):
        return v.__name__
    return str(v)


@dataclasses.dataclass(frozen=True)
class CacheKey:
    kernel: str
    source_hash: str
    config: str  # canonical JSON
    arch: str
    options: str
    dsl_version: str

    @classmethod
    def make(cls, kdef: KernelDef, arch: str, config: dict, options: str | None = None) -> "CacheKey":
        arch = normalize_arch(arch)
        config = kdef.canonical_config(config)
        cfg = json.dumps({k: _canon(v) for k, v in sorted(config.items())}, sort_keys=True)
        return cls(
            kernel=kdef.name,
            source_hash=kdef.source_hash(),
            config=cfg,
            arch=arch,
            options=options if options is not None else entry_options(kdef, arch),
            dsl_version=dsl_version(),
        )

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    compiles: int = 0
    compile_seconds: float = 0.0
    disk_loads: int = 0
    disk_load_seconds: float = 0.0
    disk_writes: int = 0


_COMPILE_LOCK = threading.Lock()


class KernelCache:
    """Thread-safe in-process cache of compiled kernels.

    A per-key lock makes concurrent first calls of the same kernel compile once; other keys
    load from disk in parallel, but compile one at a time (``_COMPILE_LOCK``: the DSL's
    compiler is not documented as thread-safe, and threads that enqueue simulated ranks'
    first steps reach the same compiles together).
    """

    def __init__(self) -> None:
        self._fns: dict[CacheKey, Any] = {}
        #: (name, arch, config, ...) -> fn, filled by get_kernel after a full-key lookup
        self.fast: dict[tuple, Any] = {}
        self._keep_alive: dict[CacheKey, Any] = {}
        self._locks: dict[CacheKey, threading.Lock] = {}
        self._lock = threading.Lock()
        self.stats = CacheStats()
        self._busy_done = 0.0  # wall seconds of finished misses
        self._busy_since: dict[int, float] = {}  # thread -> start of its miss under way

    def busy_seconds(self) -> float:
        """Wall seconds this process has spent in the cache's misses -- disk loads, compiles and
        the waits for them -- the ones under way included: what a watchdog for hung kernels
        must not count (``tests/conftest.py``)."""
        now = time.perf_counter()
        with self._lock:
            return self._busy_done + sum(now - t0 for t0 in self._busy_since.values())

    def clear(self) -> None:
        with self._lock:
            self._fns.clear()
            self.fast.clear()
            self._keep_alive.clear()
            self._locks.clear()
            self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._fns)

    def get(self, kdef: KernelDef, arch: str, config: dict, *, options: str | None = None,
            artifact_cache=None, use_disk: bool = True):
        key = CacheKey.make(kdef, arch, config, options)
        fn = self._fns.get(key)
        if fn is not None:
            with self._lock:
                self.stats.hits += 1
            return fn
        with self._lock:
            klock = self._locks.setdefault(key, threading.Lock())
            me = threading.get_ident()
            outer = me not in self._busy_since  # (a build's own lookups count once)
            if outer:
                self._busy_since[me] = time.perf_counter()
        try:
            return self._get_missed(kdef, key, config, klock, artifact_cache, use_disk)
        finally:
            if outer:
                with self._lock:
                    self._busy_done += time.perf_counter() - self._busy_since.pop(me)

    def _get_missed(self, kdef: KernelDef, key: CacheKey, config: dict, klock: threading.Lock, artifact_cache,
                    use_disk: bool):
        with klock:
            fn = self._fns.get(key)
            if fn is not None:
                with self._lock:
                    self.stats.hits += 1
                return fn
            with self._lock:
                self.stats.misses += 1
            if runtime_only.active():
                fn = self._fns[key] = self._load_exported(kdef, key, config, artifact_cache)
                return fn
            fn = None
            store = None
            if use_disk:
                store = artifact_cache if artifact_cache is not None else default_cache()
                t0 = time.perf_counter()
                loaded = store.load(key)
                if loaded is not None:
                    module, fn = loaded
                    with self._lock:
                        self.stats.disk_loads += 1
                        self.stats.disk_load_seconds += time.perf_counter() - t0
                    self._keep_alive[key] = module
            if fn is None:
                with _COMPILE_LOCK:
                    compiled = compile_now(kdef, key.arch, config, options=key.options)
                fn = compiled.fn
                with self._lock:
                    self.stats.compiles += 1
                    self.stats.compile_seconds += compiled.seconds
                if store is not None and store.put(key, compiled.fn):
                    with self._lock:
                        self.stats.disk_writes += 1
            # a TVM-FFI function converts its own arguments (C), nothing to skip around it
            fn = self._fns[key] = fn if TVM_FFI_OPTION in key.options else DirectLaunch(fn)
            return fn


    def _load_exported(self, kdef: KernelDef, key: CacheKey, config: dict, artifact_cache=None):
        """Runtime-only mode: the cache entry's ctypes launcher, or MissingArtifact."""
        store = artifact_cache if artifact_cache is not None else default_cache()
        t0 = time.perf_counter()
        fn = store.load_exported(key)
        if fn is None:
            cfg = json.dumps(kdef.canonical_config(config), sort_keys=True)
            vdir = os.path.join(store.root, key.dsl_version)
            held = sorted(a for a in (os.listdir(vdir) if os.path.isdir(vdir) else ())
                          if os.path.isdir(os.path.join(vdir, a, kdef.name)))
            raise runtime_only.MissingArtifact(
                f"{kdef.name} for {key.arch} with config {cfg} is not in the artifact cache {store.root} "
                f"(it holds {kdef.name} for: {', '.join(held) or 'no arch'}; "
                f"runtime-only mode: the CuTe DSL compiler is not installed, nothing is compiled). Build it where "
                f"the DSL is installed: python -m cute_kernels build --arch {key.arch} --kernel {kdef.name} "
                f"--config '{cfg}' --cache {store.root}")
        with self._lock:
            self.stats.disk_loads += 1
            self.stats.disk_load_seconds += time.perf_counter() - t0
        return fn


@dataclasses.dataclass
class Compiled:
    fn: Any
    seconds: float


def compile_now(kdef: KernelDef, arch: str, config: dict, *, options: str | None = None) -> Compiled:
    """Run ``cute.compile`` for ``arch`` (works without a GPU: fake args, ``--gpu-arch``)."""
    import cutlass.cute as cute

    arch = normalize_arch(arch)
    if arch not in kdef.archs:
        raise ValueError(f"kernel {kdef.name} has no code for arch {arch} (it supports {', '.join(kdef.archs)})")
    jit_obj, args = kdef.build(arch, **config)
    t0 = time.perf_counter()
    fn = cute.compile(jit_obj, *args, options=options or default_options(arch))
    return Compiled(fn, time.perf_counter() - t0)


#: The one process-wide cache.
CACHE = KernelCache()


#: Eager calls resolve their arguments' addresses themselves (:class:`DirectLaunch`); False:
#: the DSL's own call path everywhere (what ``bench/bench_host_cost.py`` compares against).
DIRECT_LAUNCH = True

_ADDR_MAX = 8192
_addr_memo: dict[int, tuple] = {}


def c_entry(arg) -> tuple:
    """``(arg, address, owner)``: the address of the C value the compiled function reads for
    ``arg`` -- a ``cute`` pointer or a DSL scalar (``__c_pointers__``, its one entry) or a
    ``CUstream`` (``getPtr``, the handle inside it) -- and what keeps that value alive (a
    scalar's owning C pointer). Memoised per object (the object is held, so its id cannot be
    reused). The memo is cleared when full, so a caller holds the entries of a launch's
    arguments until the launch has read them (a cleared owner frees its scalar's value)."""
    hit = _addr_memo.get(id(arg))
    if hit is not None and hit[0] is arg:
        return hit
    if hasattr(arg, "__c_pointers__"):
        ptrs = arg.__c_pointers__()
        if len(ptrs) != 1:
            raise TypeError(f"{type(arg).__name__} passes {len(ptrs)} C values, not one")
        keep = ptrs[0]  # a scalar's pointer owns its backing value
        addr = keep if isinstance(keep, int) else keep.value
    else:
        keep, addr = None, int(arg.getPtr())
    entry = (arg, addr, keep)
    if len(_addr_memo) >= _ADDR_MAX:
        _addr_memo.clear()
    _addr_memo[id(arg)] = entry
    return entry


def c_address(arg) -> int:
    """The address of :func:`c_entry`; valid while ``arg``'s entry is held or memoised."""
    return c_entry(arg)[1]


def _c_width(arg) -> int:
    """Bytes of the C value behind ``arg``: a DSL scalar's width, else a pointer or handle."""
    width = getattr(type(arg), "width", None)
    return width // 8 if isinstance(width, int) and not hasattr(arg, "memspace") else 8


class DirectLaunch:
    """A compiled kernel called without the DSL's per-call argument adaptation.

    The DSL's ``JitCompiledFunction.__call__`` turns each argument into the address of its C
    value (``generate_execution_args``: an adapter lookup and an owning pointer per argument,
    most of the call's host time) and hands the addresses to its executor
    (``run_compiled_program``). The entry points here pass only cached ``cute`` pointers
    (:func:`gmem_ptr`), cached scalars (:func:`i32`, :func:`f32`) and cached streams
    (:func:`cu_stream`), whose addresses :func:`c_address` memoises, so this calls the executor
    with them directly. It does so only for argument types it has checked: the first call with
    a tuple of argument types goes through the DSL, then the DSL's addresses for those
    arguments are compared with these, byte for byte at each value's width; any difference (or
    an object without the DSL's executor) keeps that tuple on the DSL's path. Other attributes
    are the compiled function's (``export_to_c``, ``artifacts``)."""

    __slots__ = ("fn", "_checked", "_executor")

    def __init__(self, fn):
        self.fn = fn
        self._checked: dict[tuple, bool] = {}
        self._executor = None

    def __getattr__(self, name):
        return getattr(self.fn, name)

    def __call__(self, *args):
        types = tuple(map(type, args))
        if DIRECT_LAUNCH and self._checked.get(types):
            entries = [c_entry(a) for a in args]  # held: the scalars' values live through the launch
            return self._executor.run_compiled_program([e[1] for e in entries])
        out = self.fn(*args)
        if DIRECT_LAUNCH and types not in self._checked:
            self._checked[types] = self._same_addresses(args)
        return out

    def _same_addresses(self, args) -> bool:
        import ctypes

        executor = getattr(self.fn, "_default_executor", None)
        generate = getattr(self.fn, "generate_execution_args", None)
        if executor is None or generate is None or not hasattr(executor, "run_compiled_program"):
            return False
        try:
            theirs, _adapted = generate(*args)
            entries = [c_entry(a) for a in args]
            ours = [e[1] for e in entries]
        except Exception:  # noqa: BLE001 -- any surprise: stay on the DSL's path
            return False
        if len(theirs) != len(ours):
            return False
        for a, t, o in zip(args, theirs, ours):
            t = t.value if isinstance(t, ctypes.c_void_p) else int(t)
            n = _c_width(a)
            if not t or ctypes.string_at(t, n) != ctypes.string_at(o, n):
                return False
        self._executor = executor
        return True


def get_kernel(name: str, arch: str, *, use_disk: bool = True, artifact_cache=None, **config):
    """Compiled function for ``name`` built for ``arch`` with static ``config``
    (a :class:`DirectLaunch` around it; with :func:`use_tvm_ffi`, the TVM-FFI function).

    The hot path is one dict lookup on (name, arch, config): the full :class:`CacheKey`
    (source hash, DSL version) is built only on the first call, so source edits made while
    a process runs are picked up by the next process, not by the running one.
    """
    fast_key = (name, arch, tuple(sorted(config.items())), use_disk, id(artifact_cache), TVM_FFI)
    fn = CACHE.fast.get(fast_key)
    if fn is not None:
        CACHE.stats.hits += 1  # racy increment is fine for a counter
        return fn
    kdef = _REGISTRY.get(name)
    if kdef is None:
        raise KeyError(f"unknown kernel {name!r} (import the module that defines it); registered: "
                       f"{', '.join(sorted(_REGISTRY))}")
    if TVM_FFI and not runtime_only.active():  # (runtime-only: the ctypes launchers take the same arguments)
        fn = CACHE.get(kdef, arch, config, options=entry_options(kdef, arch, tvm_ffi=True),
                       artifact_cache=artifact_cache, use_disk=use_disk)
    else:
        fn = CACHE.get(kdef, arch, config, artifact_cache=artifact_cache, use_disk=use_disk)
    CACHE.fast[fast_key] = fn
    return fn


# --------------------------------------------------------------------------------------
# Runtime argument helpers (hot path: keep them to dict lookups).
# --------------------------------------------------------------------------------------
_ptr_cache: dict[tuple, Any] = {}
_stream_cache: dict[int, Any] = {}
_PTR_CACHE_MAX = 4096


def gmem_ptr(dtype, t, align: int = 16):
    """CuTe global-memory pointer to a torch tensor's data, cached by (dtype, address, align)."""
    addr = t.data_ptr()
    k = (dtype, addr, align)
    p = _ptr_cache.get(k)
    if p is None:
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_ptr

        if len(_ptr_cache) >= _PTR_CACHE_MAX:
            _ptr_cache.clear()
        p = _ptr_cache[k] = make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=align)
    return p


def _raw_stream_query():
    import torch

    f = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    dev = getattr(torch._C, "_cuda_getDevice", None)
    if f is None or dev is None:
        return None
    return lambda torch_mod: f(dev())


_raw_current_stream = None
try:
    _raw_current_stream = _raw_stream_query()
except Exception:  # pragma: no cover - torch without CUDA bindings
    _raw_current_stream = None


def stream_handle(stream=None) -> int:
    """The CUDA handle of a torch stream, of a raw handle, or (None) of torch's current stream."""
    if stream is None:
        import torch

        # the raw-stream query skips torch.cuda.current_stream()'s Stream object (~3 us)
        return _raw_current_stream(torch) if _raw_current_stream else torch.cuda.current_stream().cuda_stream
    return stream if isinstance(stream, int) else stream.cuda_stream


def cu_stream(stream=None):
    """``cuda.CUstream`` for a torch stream (default: the current stream), cached by handle.

    Kernels must be launched on an explicit stream: a launch on the legacy default
    stream is silently left out of a CUDA graph being captured on another stream.
    """
    handle = stream_handle(stream)
    s = _stream_cache.get(handle)
    if s is None:
        import cuda.bindings.driver as cuda

        s = _stream_cache[handle] = cuda.CUstream(handle)
    return s


_scalar_cache: dict[tuple, Any] = {}


def _scalar(kind: str, v):
    k = (kind, v)
    r = _scalar_cache.get(k)
    if r is None:
        import cutlass

        if len(_scalar_cache) >= _PTR_CACHE_MAX:
            _scalar_cache.clear()
        r = _scalar_cache[k] = (cutlass.Int32 if kind == "i32" else cutlass.Float32)(v)
    return r


def i32(v: int):
    """Cached ``cutlass.Int32`` (building one costs several microseconds)."""
    return _scalar("i32", v)


def f32(v: float):
    """Cached ``cutlass.Float32``."""
    return _scalar("f32", v)


def fake_gmem_ptr(dtype, align: int = 16):
    """Placeholder pointer for compiling without a GPU."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=align)


def fake_tensor(dtype, shape: tuple, align: int = 16, symbols: dict | None = None):
    """Placeholder row-major compact tensor for a tensor entry: ``shape`` holds ints (static
    extents) and names (symbolic extents; one symbol per name within ``symbols``, so two
    arguments that share a name must have equal extents -- checked by the compiled function)."""
    import cutlass.cute as cute

    symbols = {} if symbols is None else symbols
    dims = tuple(d if isinstance(d, int) else symbols.setdefault(d, cute.sym_int()) for d in shape)
    return cute.runtime.make_fake_compact_tensor(dtype, dims, stride_order=tuple(range(len(dims) - 1, -1, -1)),
                                                 assumed_align=align)


def fake_env_stream():
    """The stream argument of a tensor entry: TVM-FFI passes torch's current stream."""
    import cutlass.cute as cute

    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


def get_tensor_kernel(name: str, arch: str, **config):
    """The TVM-FFI function of tensor entry ``name`` (module docstring) for ``arch`` and static
    ``config``, or None while :func:`use_tvm_ffi` is off. Loaded from the artifact cache, or
    compiled (and stored there), on first use per process."""
    if not TVM_FFI:
        return None
    fast_key = (name, arch, tuple(sorted(config.items())), "tensors")
    fn = CACHE.fast.get(fast_key)
    if fn is None:
        kdef = _REGISTRY[name]
        if arch not in kdef.archs:
            return None
        fn = CACHE.fast[fast_key] = CACHE.get(kdef, arch, config)
    return fn


def register_tensor_entry(of: KernelDef, build: Callable[..., tuple[Any, tuple]], name: str = "",
                          description: str = "", aot_configs: tuple[dict, ...] = ()) -> KernelDef:
    """Register the tensor entry of kernel ``of`` (module docstring): ``name`` (default
    ``<of.name>_tensors``) built by ``build(arch, **config)``, hashed from ``of``'s sources, for
    the sm_90a / sm_100a of ``of``'s archs (elsewhere its pointer launch serves); ``aot_configs``:
    what ``python -m cute_kernels build --tensor-entries`` compiles."""
    return register(KernelDef(name=name or f"{of.name}_tensors", build=build, sources=of.sources,
                              archs=tuple(a for a in of.archs if a in ("sm_90a", "sm_100a")), tensor_entry_of=of.name,
                              aot_configs=aot_configs,
                              description=description or f"{of.name} taking torch tensors through TVM-FFI"))


#: calls whose tensor entry refused its arguments (the validated launch then served them),
#: counted per memo key: a hot path that refuses every call is slow, not wrong -- the host-cost
#: bench reports these
TENSOR_ENTRY_REFUSALS: dict = {}


def launch_tensor_entry(memo: dict, key, *args) -> bool:
    """The eager hot path of an entry point with a tensor entry: launch ``memo[key]`` (filled by
    :func:`remember_tensor_entry`) on ``args`` and return True; False when there is none or its
    C checks refused the arguments (nothing launched; counted in :data:`TENSOR_ENTRY_REFUSALS`)
    -- the caller then validates in Python, which names the bad argument."""
    fn = memo.get(key)
    if fn is None:
        return False
    try:
        fn(*args)
    except (TypeError, ValueError, BufferError):  # raised converting or checking, before the launch
        TENSOR_ENTRY_REFUSALS[key] = TENSOR_ENTRY_REFUSALS.get(key, 0) + 1
        return False
    return True


def remember_tensor_entry(memo: dict, key, name: str, arch: str | None, **config) -> None:
    """After a validated launch on torch's current stream with TVM-FFI on: memoise tensor entry
    ``name`` for ``arch`` (the device's; callers skip this when a call names a stream or an
    arch of its own) under ``key`` for the next calls' hot path. An entry that fails to build
    or load warns once and leaves ``key`` on the validated path (the launch has been made)."""
    if TVM_FFI and arch is not None and key not in memo:
        try:
            fn = get_tensor_kernel(name, arch, **config)
        except Exception as e:  # noqa: BLE001 -- the call itself succeeded; only the fast path is lost
            warn_once(f"tensor-entry:{name}", f"cute_kernels: tensor entry {name} {config} is unavailable "
                                              f"({type(e).__name__}: {e}); its calls take the validated path")
            memo[key] = None
            return
        if fn is not None:
            memo[key] = _FirstTensorCall(memo, key, fn)


class _FirstTensorCall:
    """A memoised tensor entry until its first call, which loads its module: refused inside a
    CUDA graph capture (the caller falls back to the pointer launch, loaded already -- a module
    load inside a capture can invalidate it); after it, the memo holds the bare
    ``tvm_ffi.Function`` (positional, without the DSL's Python call wrapper)."""

    def __init__(self, memo: dict, key, fn):
        self.memo, self.key, self.fn = memo, key, fn

    def __call__(self, *args):
        import torch

        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise ValueError("tensor entry: first call inside a CUDA graph capture")
        self.fn(*args)
        raw = getattr(self.fn, "__tvm_ffi_object__", None)
        self.memo[self.key] = (raw() if raw is not None else None) or self.fn


def fake_stream():
    import cutlass.cute as cute

    return cute.runtime.make_fake_stream()


# Runtime-only mode: the launchers take addresses and numbers (ExportedKernel converts them
# to the C types kernel.h declares).
def _raw_gmem_ptr(dtype, t, align: int = 16) -> int:
    return t.data_ptr()


def _raw_scalar(v):
    return v


if runtime_only.active():
    gmem_ptr, i32, f32, cu_stream = _raw_gmem_ptr, _raw_scalar, _raw_scalar, stream_handle  # noqa: F811


# TVM-FFI launches (module docstring).
TVM_FFI = False
_DSL_HELPERS = (gmem_ptr, i32, f32, cu_stream)


def use_tvm_ffi(enabled: bool = True) -> None:
    """Launch every kernel fetched from now on through the DSL's TVM-FFI calling convention
    (``enabled``), and let entry points take their tensor entries; or through
    :class:`DirectLaunch` again. Process-wide; switch between calls, not while another thread
    launches. Raises ``ImportError`` without the ``apache-tvm-ffi`` package. In runtime-only
    mode only the tensor entries change: they come from the artifact cache (``build
    --tensor-entries --with-runtime``) through apache-tvm-ffi, and the other kernels keep their
    ctypes launchers."""
    global TVM_FFI, gmem_ptr, i32, f32, cu_stream
    if enabled:
        try:
            import tvm_ffi  # noqa: F401
        except ImportError as e:
            raise ImportError("use_tvm_ffi needs the apache-tvm-ffi package (pip install apache-tvm-ffi)") from e
        gmem_ptr, i32, f32, cu_stream = _raw_gmem_ptr, _raw_scalar, _raw_scalar, stream_handle
    elif not runtime_only.active():
        gmem_ptr, i32, f32, cu_stream = _DSL_HELPERS
    TVM_FFI = bool(enabled)


#: ``CUTE_KERNELS_TVM_FFI=1`` in the environment: :func:`use_tvm_ffi` at import -- a serving
#: process's eager calls take the tensor entries without a code change (``0`` / unset: off)
TVM_FFI_ENV = "CUTE_KERNELS_TVM_FFI"
if os.environ.get(TVM_FFI_ENV, "0") not in ("", "0"):
    use_tvm_ffi()


def iter_aot(reg: dict[str, KernelDef], names: Iterable[str] | None = None, arch: str = "sm_100a",
             tensor_entries: bool = False):
    """(KernelDef, config) pairs of the kernels ``reg`` (by name) that the AOT build compiles
    for ``arch`` -- all of them, or ``names``; tensor entries only with ``tensor_entries``
    (named or not: compiling them needs apache-tvm-ffi)."""
    for n in sorted(reg) if names is None else names:
        kdef = reg[n]
        if normalize_arch(arch) not in kdef.archs or (kdef.tensor_entry_of and not tensor_entries):
            continue  # e.g. a Blackwell-only engine in an sm_90a build
        if callable(kdef.aot_configs):  # configs that depend on the arch: maybe none on this one
            yield from ((kdef, cfg) for cfg in kdef.aot_configs(normalize_arch(arch)))
        else:  # a static list; empty: the kernel's one config-less build
            yield from ((kdef, cfg) for cfg in kdef.aot_configs or ({},))
