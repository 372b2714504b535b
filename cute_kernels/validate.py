"""Argument checks shared by every torch-facing entry point.

Each check raises before any launch: ``TypeError`` for a wrong Python type or dtype,
``ValueError`` for a wrong device, shape, stride or alignment. Messages name the argument
and say what was expected, e.g.::

    ValueError: row_rms: x must be contiguous in its last dim (stride 1), got strides (1, 7168)
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch


def _fmt(dtypes) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    op: str,
    name: str,
    t,
    *,
    dtype: torch.dtype | Iterable[torch.dtype] | None = None,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    device: torch.device | str | None = None,
    last_dim_contiguous: bool = True,
    contiguous: bool = False,
    align_bytes: int = 16,
) -> torch.Tensor:
    """Validate one tensor argument. ``shape`` entries of None are free."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        dts = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in dts:
            raise TypeError(f"{op}: {name} must have dtype {_fmt(dts)}, got {_fmt([t.dtype])}")
    # the shape and strides read once: every entry point runs this on its hot path
    shp, st = tuple(t.shape), t.stride()
    dims = len(shp)
    if ndim is not None and dims != ndim:
        raise ValueError(f"{op}: {name} must be {ndim}-D, got shape {shp}")
    if shape is not None:
        if dims != len(shape) or any(e is not None and e != s for e, s in zip(shape, shp)):
            want = "[" + ", ".join("*" if e is None else str(e) for e in shape) + "]"
            raise ValueError(f"{op}: {name} must have shape {want}, got {list(shp)}")
    if device is not None:
        dev = torch.device(device)
        if t.device.type != dev.type or (dev.index is not None and t.device.index != dev.index):
            raise ValueError(f"{op}: {name} must be on {dev}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous, got strides {st}")
    if last_dim_contiguous and dims > 0 and shp[-1] > 1 and st[-1] != 1:
        raise ValueError(f"{op}: {name} must be contiguous in its last dim (stride 1), got strides {st}")
    if align_bytes and 0 not in shp:
        if t.data_ptr() % align_bytes:
            raise ValueError(f"{op}: {name} data pointer must be {align_bytes}-byte aligned")
        es = t.element_size()
        for d in range(dims - 1):
            if shp[d] > 1 and (st[d] * es) % align_bytes:
                raise ValueError(
                    f"{op}: {name} stride of dim {d} ({st[d]} elements) must be a multiple of "
                    f"{align_bytes} bytes"
                )
    return t


def check_cuda(op: str, *named: tuple[str, torch.Tensor]) -> torch.device:
    """All tensors on one CUDA device; returns it."""
    # is_cuda / get_device(): a fifth of the cost of reading .device (entry points' hot path)
    index = None
    for name, t in named:
        if not t.is_cuda:
            raise ValueError(f"{op}: {name} must be a CUDA tensor, got device {t.device}")
        if index is None:
            index, first = t.get_device(), t
        elif t.get_device() != index:
            raise ValueError(f"{op}: {name} is on {t.device} but the other arguments are on {first.device}")
    return first.device if index is not None else None


def check_rotation(op: str, rotate, tokens: int, width: int) -> int:
    """A RoPE rotation table: FP32 ``[tokens, r / 2, 2]`` (each token's (cos, sin) per pair),
    contiguous, ``2 <= r <= width``. Returns ``r``."""
    check_tensor(op, "rotate", rotate, dtype=torch.float32, ndim=3, contiguous=True, align_bytes=8)
    if rotate.shape[0] != tokens or rotate.shape[2] != 2 or not 1 <= 2 * rotate.shape[1] <= width:
        raise ValueError(f"{op}: rotate must be [{tokens}, r/2, 2] with 2 <= r <= {width}, got {list(rotate.shape)}")
    return 2 * rotate.shape[1]


def check_bool(op: str, name: str, value) -> None:
    """A flag argument (``pdl``, ``zero_padding``, ...) must be a real bool, not a truthy value."""
    if not isinstance(value, bool):
        raise TypeError(f"{op}: {name} must be a bool, got {value!r}")


def check_divisible(op: str, name: str, value: int, by: int, why: str = "") -> None:
    if value % by:
        raise ValueError(f"{op}: {name}={value} must be a multiple of {by}" + (f" ({why})" if why else ""))


def check_int32_indexable(op: str, what: str, elements: int) -> None:
    """The SIMT / warp-MMA kernels index global tensors with 32-bit element offsets: refuse a
    tensor of 2**31 or more elements before launch (it would wrap: an illegal address or a
    silent read of a neighbouring allocation)."""
    if elements >= 2**31:
        raise ValueError(f"{op}: {what} has {elements} elements; 32-bit indexing needs fewer than 2**31")


def check_arch_supported(op: str, arch: str | None, supported: Sequence[str]) -> str:
    if arch is None:
        raise ValueError(f"{op}: no supported CUDA device found (kernels target {', '.join(supported)})")
    if arch not in supported:
        raise ValueError(f"{op}: arch {arch} is not supported (supported: {', '.join(supported)})")
    return arch
