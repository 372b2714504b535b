"""On-disk compiled-artifact cache for deployment, built on the DSL's own AOT path.

Each entry is what ``JitCompiledFunction.export_to_c`` writes -- a C header and an ELF
object holding the host launcher and the cubin -- plus ``manifest.json``::

    <root>/<dsl version>/<arch>/<kernel>/<key digest[:24]>/
        kernel.o  kernel.h  manifest.json

An entry compiled with TVM-FFI (its key's options hold ``--enable-tvm-ffi``: tensor entries,
and launches under ``jit.use_tvm_ffi``) is the object alone, exporting one TVM-FFI function;
it loads as a ``tvm_ffi.Function`` -- through the DSL, or in runtime-only mode through
apache-tvm-ffi from its linked ``kernel.so``.

The manifest records every key field (kernel, source hash, config, arch, compile options,
DSL version), the function prefix, and the sha256 and size of each payload file. An entry
is loaded (``cute.runtime.load_module``, no compiler involved) only if the manifest parses,
every key field equals the requested key and every payload hash matches. Anything else --
truncated object, flipped byte, manifest from another arch or DSL version -- is reported
once as a warning, never loaded, and replaced by a fresh build.

Writes are atomic and safe with several processes: an entry is assembled in a private
temporary directory next to its final place and moved in with one ``rename``; a writer
that loses the race drops its copy (the winner's entry is equivalent). A corrupt entry is
first renamed aside, then replaced.

Root directory: the ``cache_dir`` argument, else ``$CUTE_KERNELS_CACHE_DIR``, else
``$XDG_CACHE_HOME/cute_kernels`` (``~/.cache/cute_kernels``).

Note (DSL 4.8.1, CPU-only machine): ``export_to_c`` of an sm_90a kernel needs the DSL's
runtime library (``libcute_dsl_runtime.so``) loaded into the process; an sm_100a compile
happens to load it, an sm_90a compile does not. :func:`_load_dsl_runtime` loads it
through the DSL's public ``find_runtime_libraries`` before any export.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import tempfile
import threading
import uuid
from typing import Any, Protocol

from .arch import warn_once


class CacheKey(Protocol):
    """What the store needs of a key (:class:`cute_kernels.jit.CacheKey` is the one used):
    the kernel name, arch and DSL version (the entry's path), a digest, and its fields."""

    kernel: str
    arch: str
    options: str
    dsl_version: str

    def digest(self) -> str: ...

    def as_dict(self) -> dict: ...

ENV_VAR = "CUTE_KERNELS_CACHE_DIR"
MANIFEST_VERSION = 1
_PAYLOAD = ("kernel.o", "kernel.h")
_TVM_FFI_PAYLOAD = ("kernel.o",)
TVM_FFI_OPTION = "--enable-tvm-ffi"


def is_tvm_ffi(options: str) -> bool:
    """Whether compile ``options`` build a TVM-FFI function (an object without a C header)."""
    return TVM_FFI_OPTION in options.split()


def _payload(options: str) -> tuple[str, ...]:
    return _TVM_FFI_PAYLOAD if is_tvm_ffi(options) else _PAYLOAD


def default_root() -> str:
    env = os.environ.get(ENV_VAR)
    if env:
        return os.path.abspath(os.path.expanduser(env))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cute_kernels")


_runtime_loaded = False
_runtime_lock = threading.Lock()


def _load_dsl_runtime() -> None:
    global _runtime_loaded
    with _runtime_lock:
        if _runtime_loaded:
            return
        from cutlass.cute.runtime import find_runtime_libraries

        for lib in find_runtime_libraries(enable_tvm_ffi=False):
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
        _runtime_loaded = True


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def function_prefix(key: CacheKey) -> str:
    safe = "".join(c if c.isalnum() else "_" for c in key.kernel)
    return f"ck_{safe}_{key.digest()[:16]}"


class ArtifactCache:
    def __init__(self, root: str | None = None) -> None:
        self.root = os.path.abspath(root) if root else default_root()

    # -- layout ------------------------------------------------------------------------
    def entry_dir(self, key: CacheKey) -> str:
        return os.path.join(self.root, key.dsl_version, key.arch, key.kernel, key.digest()[:24])

    def dsl_versions(self) -> list[str]:
        """The DSL versions the cache holds entries of (its top-level directories)."""
        if not os.path.isdir(self.root):
            return []
        return sorted(d for d in os.listdir(self.root)
                      if not d.startswith(".") and os.path.isdir(os.path.join(self.root, d)))

    def runtime_library_path(self, dsl_version: str) -> str:
        """Where ``build --with-runtime`` puts the DSL's runtime library for ``dsl_version``."""
        return os.path.join(self.root, dsl_version, "lib", "libcute_dsl_runtime.so")

    def entries(self) -> list[str]:
        """Every entry directory under the root (valid or not)."""
        out = []
        if not os.path.isdir(self.root):
            return out
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            if "manifest.json" in filenames or any(f in filenames for f in _PAYLOAD):
                out.append(dirpath)
                dirnames[:] = []
        return sorted(out)

    # -- verification -----------------------------------------------------------------
    def check_entry(self, path: str, key: CacheKey | None = None) -> tuple[bool, str, dict | None]:
        """(ok, reason, manifest). With ``key``, the manifest must match it field by field."""
        mpath = os.path.join(path, "manifest.json")
        try:
            with open(mpath) as f:
                man = json.load(f)
        except FileNotFoundError:
            return False, "manifest.json missing", None
        except (OSError, ValueError) as e:
            return False, f"manifest.json unreadable ({e.__class__.__name__})", None
        if not isinstance(man, dict) or man.get("manifest_version") != MANIFEST_VERSION:
            return False, "manifest version mismatch", None
        if key is not None:
            want = key.as_dict()
            got = man.get("key", {})
            for field, v in want.items():
                if got.get(field) != v:
                    return False, f"manifest {field} is {got.get(field)!r}, expected {v!r}", man
            if man.get("function_prefix") != function_prefix(key):
                return False, "function prefix mismatch", man
        payload = _payload(str(man.get("key", {}).get("options", "")))
        for name in payload:
            p = os.path.join(path, name)
            meta = man.get("files", {}).get(name)
            if meta is None:
                return False, f"manifest lists no {name}", man
            if not os.path.isfile(p):
                return False, f"{name} missing", man
            if os.path.getsize(p) != meta.get("size"):
                return False, f"{name} size {os.path.getsize(p)} != {meta.get('size')} (truncated?)", man
            if _sha256(p) != meta.get("sha256"):
                return False, f"{name} sha256 mismatch (corrupt)", man
        for name, meta in man.get("files", {}).items():  # optional files (kernel.so): checked when present
            p = os.path.join(path, name)
            if name not in payload and os.path.isfile(p) and (os.path.getsize(p) != meta.get("size")
                                                              or _sha256(p) != meta.get("sha256")):
                return False, f"{name} does not match the manifest (corrupt)", man
        return True, "ok", man

    def has_valid(self, key: CacheKey) -> bool:
        path = self.entry_dir(key)
        if not os.path.isdir(path):
            return False
        ok, why, _ = self.check_entry(path, key)
        if not ok:
            warn_once(f"artifact:{path}", f"cute_kernels: artifact cache entry {path} is invalid ({why}); rebuilding")
        return ok

    # -- load / store -----------------------------------------------------------------
    def load(self, key: CacheKey) -> tuple[Any, Any] | None:
        """(module, function) for a valid entry, else None (invalid entries warn once)."""
        if not self.has_valid(key):
            return None
        from cutlass.cute.runtime import load_module

        path = self.entry_dir(key)
        try:
            module = load_module(os.path.join(path, "kernel.o"), enable_tvm_ffi=is_tvm_ffi(key.options))
            fn = getattr(module, function_prefix(key))
        except Exception as e:  # a DSL-level load failure is treated like corruption
            warn_once(f"artifact-load:{path}", f"cute_kernels: could not load {path} ({e}); rebuilding")
            return None
        return module, fn

    def load_exported(self, key: CacheKey):
        """The entry's launcher without the DSL (:class:`cute_kernels.exported.ExportedKernel`,
        symbols resolved, loaded onto a device at its first call; for a TVM-FFI entry its
        ``tvm_ffi.Function``), else None."""
        if not self.has_valid(key):
            return None
        from .exported import ExportedKernel, load_tvm_ffi_entry

        path = self.entry_dir(key)
        if is_tvm_ffi(key.options):  # a tvm_ffi.Function (apache-tvm-ffi, no DSL)
            return load_tvm_ffi_entry(path, function_prefix(key), self._bundled_runtime(key.dsl_version))
        k = ExportedKernel(path, runtime_library=self._bundled_runtime(key.dsl_version))
        k.open()
        return k

    def _bundled_runtime(self, dsl_version: str) -> str | None:
        p = self.runtime_library_path(dsl_version)
        return p if os.path.isfile(p) else None

    def put(self, key: CacheKey, compiled_fn) -> bool:
        """Export ``compiled_fn`` as the entry for ``key``. Returns True if written."""
        final = self.entry_dir(key)
        parent = os.path.dirname(final)
        os.makedirs(parent, exist_ok=True)
        _load_dsl_runtime()
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
        try:
            prefix = function_prefix(key)
            if is_tvm_ffi(key.options):
                compiled_fn.export_to_c(os.path.join(tmp, "kernel.o"), prefix)
            else:
                compiled_fn.export_to_c(tmp, "kernel", function_prefix=prefix)
            files = {}
            for name in _payload(key.options):
                p = os.path.join(tmp, name)
                files[name] = {"sha256": _sha256(p), "size": os.path.getsize(p)}
            man = {
                "manifest_version": MANIFEST_VERSION,
                "key": key.as_dict(),
                "digest": key.digest(),
                "function_prefix": prefix,
                "files": files,
            }
            with open(os.path.join(tmp, "manifest.json"), "w") as f:
                json.dump(man, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            return self._install(tmp, final, key)
        finally:
            if os.path.isdir(tmp):
                shutil.rmtree(tmp, ignore_errors=True)

    def _install(self, tmp: str, final: str, key: CacheKey) -> bool:
        try:
            os.rename(tmp, final)
            return True
        except OSError:
            pass  # final exists: another writer won, or a corrupt entry sits there
        ok, _, _ = self.check_entry(final, key)
        if ok:
            return False
        trash = os.path.join(os.path.dirname(final), f".trash-{uuid.uuid4().hex}")
        try:
            os.rename(final, trash)
        except OSError:
            return False  # someone else is replacing it right now
        shutil.rmtree(trash, ignore_errors=True)
        try:
            os.rename(tmp, final)
            return True
        except OSError:
            return False

    # -- runtime-only deployment ------------------------------------------------------
    def bundle_runtime(self, dsl_version: str) -> tuple[str, int]:
        """For a deployment without the DSL compiler: copy the DSL's runtime library next to the
        ``dsl_version`` entries and link every valid entry's ``kernel.so`` (recorded in its
        manifest, hash-checked like the payload). -> (library path, entries linked)."""
        from .exported import link_entry, runtime_library

        dst = self.runtime_library_path(dsl_version)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        src = runtime_library()
        if os.path.abspath(src) != dst:
            tmp = dst + f".tmp{os.getpid()}"
            shutil.copyfile(src, tmp)
            os.replace(tmp, dst)
        linked = 0
        for path in self.entries():
            ok, _, man = self.check_entry(path)
            if not ok or man["key"].get("dsl_version") != dsl_version:
                continue
            so = link_entry(path)
            man["files"]["kernel.so"] = {"sha256": _sha256(so), "size": os.path.getsize(so)}
            tmp = os.path.join(path, f".manifest.tmp{os.getpid()}")
            with open(tmp, "w") as f:
                json.dump(man, f, indent=1, sort_keys=True)
            os.replace(tmp, os.path.join(path, "manifest.json"))
            linked += 1
        return dst, linked

    # -- maintenance ------------------------------------------------------------------
    def verify(self) -> list[tuple[str, bool, str]]:
        return [(p, *self.check_entry(p)[:2]) for p in self.entries()]

    def clear(self) -> int:
        n = len(self.entries())
        if os.path.isdir(self.root):
            shutil.rmtree(self.root)
        return n


_default: ArtifactCache | None = None


def default_cache() -> ArtifactCache:
    """Cache at the default root (re-read if ``$CUTE_KERNELS_CACHE_DIR`` changed)."""
    global _default
    root = default_root()
    if _default is None or _default.root != root:
        _default = ArtifactCache(root)
    return _default
