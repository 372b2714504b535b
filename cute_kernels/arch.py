"""Target-architecture detection and per-arch dispatch.

A kernel family has up to three paths:

* ``sm100``  -- Blackwell (sm_100a / sm_103a): TMA + tcgen05 tensor-memory MMA;
* ``sm90``   -- Hopper (sm_90a): TMA + wgmma;
* ``portable`` -- a SIMT CuTe kernel that compiles for either (or, where a family
  has no kernel for the device at all, the PyTorch reference).

``dispatch(...)`` maps the running device (or an explicit override) to one of these;
an unknown device falls back to the portable path with one warning per family.

Overrides, for tests and for AOT builds on a machine without a GPU:
``with override_arch("sm_100a"): ...`` or ``arch=`` on every entry point.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import warnings

log = logging.getLogger("cute_kernels")

#: Arch strings we compile for. Tensor-memory (tcgen05) code needs the "a" variants.
SUPPORTED_ARCHS = ("sm_90a", "sm_100a", "sm_103a")

_ARCH_RE = re.compile(r"^sm_?(\d+)([af]?)$")
_override = threading.local()
_warned: set[str] = set()
_warn_lock = threading.Lock()


def normalize_arch(arch: str) -> str:
    """'sm90', 'sm_90', '90', 'sm_90a' -> 'sm_90a'; 'sm_100' -> 'sm_100a'.

    Hopper and Blackwell kernels use arch-specific instructions (wgmma, tcgen05), so the
    'a' suffix is always implied.
    """
    if arch in SUPPORTED_ARCHS:  # fast path: already canonical
        return arch
    if not isinstance(arch, str):
        raise TypeError(f"arch must be a str like 'sm_90a', got {type(arch).__name__}")
    s = arch.strip().lower()
    if s.isdigit():
        s = "sm_" + s
    m = _ARCH_RE.match(s)
    if not m:
        raise ValueError(f"arch {arch!r} is not an arch string like 'sm_90a' or 'sm_100a'")
    canon = f"sm_{m.group(1)}a"
    if canon not in SUPPORTED_ARCHS:
        raise ValueError(f"arch {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHS)}")
    return canon


def family(arch: str) -> str:
    """'sm_90a' -> 'sm90', 'sm_100a'/'sm_103a' -> 'sm100'."""
    a = normalize_arch(arch)
    return "sm90" if a == "sm_90a" else "sm100"


_device_arch_cache: dict[int, str | None] = {}


def device_arch(device=None) -> str | None:
    """Arch string of a CUDA device, or None without CUDA or for an arch we do not target."""
    if device is not None and getattr(device, "type", None) == "cuda" and device.index in _device_arch_cache:
        return _device_arch_cache[device.index]
    import torch

    if not torch.cuda.is_available():
        return None
    idx = torch.cuda.current_device() if device is None else torch.device(device).index
    if idx is None:
        idx = torch.cuda.current_device()
    if idx not in _device_arch_cache:
        major, minor = torch.cuda.get_device_capability(idx)
        cand = f"sm_{major}{minor}a"
        _device_arch_cache[idx] = cand if cand in SUPPORTED_ARCHS else None
    return _device_arch_cache[idx]


_sm_count_cache: dict[int, int] = {}


def num_sms(device) -> int:
    """Streaming multiprocessors of a CUDA device (a ``torch.device`` or an index), cached:
    the split-K / grid planners call it on the hot path."""
    idx = device if isinstance(device, int) else device.index
    n = _sm_count_cache.get(idx)
    if n is None:
        import torch

        if idx is None:
            idx = torch.cuda.current_device()
        n = _sm_count_cache[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return n


def current_arch(device=None) -> str | None:
    """The override if one is active, else the device's arch (None on CPU/unknown GPUs)."""
    ov = getattr(_override, "arch", None)
    if ov is not None:
        return ov
    return device_arch(device)


@contextlib.contextmanager
def override_arch(arch: str | None):
    """Pretend the target is ``arch`` inside the block (thread-local)."""
    prev = getattr(_override, "arch", None)
    _override.arch = normalize_arch(arch) if arch is not None else None
    try:
        yield
    finally:
        _override.arch = prev


def warn_once(key: str, msg: str) -> None:
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    log.warning(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


def dispatch(kernel_family: str, paths: tuple[str, ...], arch: str | None = None, device=None) -> str:
    """Choose a path among ``paths`` (subset of 'sm100', 'sm90', 'portable', 'reference').

    A targeted arch (sm_90a, sm_100a, sm_103a) gets its tensor-core path if the family has
    one, else the family's portable CuTe kernel. A device we do not target (or none) gets
    the PyTorch reference; when that is not the family's only path, one warning per
    family says so.
    """
    a = normalize_arch(arch) if arch is not None else current_arch(device)
    if a is not None:
        if family(a) in paths:
            return family(a)
        if "portable" in paths:
            return "portable"
    if "reference" not in paths:
        raise RuntimeError(f"{kernel_family}: no kernel for arch {a or 'of this device'} and no reference path")
    warn_once(
        f"dispatch:{kernel_family}",
        f"cute_kernels: {kernel_family} has no kernel for {a or 'this device'}; using the PyTorch reference",
    )
    return "reference"
