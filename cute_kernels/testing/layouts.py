"""Evaluating a kernel's own CuTe layout objects on the CPU.

A kernel partitions its global tensors with CuTe layout algebra (``local_tile``,
``partition_A`` / ``partition_C``, ``flat_divide``) applied to the TMA tensors that
``make_tiled_tma_atom`` returns -- coordinate tensors over the operand's (M, K, L) shape. Traced
on the CPU with static shapes (inside ``@cute.jit``, compiled but never launched), the same
calls applied to ``cute.make_identity_tensor(shape)`` give tensors whose layouts are static:
each stride is a scaled basis element (``k@i``: ``k`` along coordinate mode ``i``) or 0, and
whose iterator is the coordinate of element 0. :func:`coords` enumerates every element's
coordinate from those, so a test can check which global elements a CTA reads or writes --
from the kernel's objects, not from a re-derivation of them.

Usage (inside a ``@cute.jit`` function being traced; a plain helper it calls may loop)::

    mC = cute.make_identity_tensor(c.shape)
    tCgC = thr_mma.partition_C(cute.local_tile(mC, tiler, (None,) * 3))
    xyz = coords(tCgC[(None, None, None, m_tile, n_tile, l)])   # numpy [size, 3]
"""

from __future__ import annotations

import numpy as np


def flatten(x) -> list:
    """A nested CuTe tuple's leaves, in mode order."""
    return [leaf for y in x for leaf in flatten(y)] if isinstance(x, tuple) else [x]


def coords(t) -> np.ndarray:
    """Coordinates ``[size(t), rank]`` (int64) of every element of a coordinate tensor ``t``
    with a static layout, elements in CuTe's colexicographic order (mode 0 fastest)."""
    base = t.iterator
    base = list(base) if isinstance(base, tuple) else [base]
    shape = flatten(t.layout.shape)
    stride = flatten(t.layout.stride)
    if not all(isinstance(s, int) for s in shape + flatten(tuple(base))):
        raise TypeError(f"coords: {t} has a dynamic shape or offset (trace with static extents)")
    rank = len(base)
    out = np.zeros((int(np.prod(shape)) if shape else 1, rank), dtype=np.int64)
    out[:] = base
    step = 1
    for n, d in zip(shape, stride):
        idx = (np.arange(out.shape[0]) // step) % n
        step *= n
        if isinstance(d, int):
            if d != 0:
                raise TypeError(f"coords: {t} has an integer stride {d} (not a coordinate tensor)")
            continue
        mode = d.mode
        mode = mode[0] if isinstance(mode, (list, tuple)) and len(mode) == 1 else mode
        if not isinstance(mode, int):
            raise TypeError(f"coords: nested basis mode {d.mode} is not supported")
        out[:, mode] += idx * int(d.value)
    return out


def offsets(xyz: np.ndarray, shape, stride) -> np.ndarray:
    """Element offsets of coordinates ``xyz [n, rank]`` through a flat (shape, stride) layout
    (a view's layout read back from the kernel's tensor: ``flatten(t.layout.stride)``)."""
    if xyz.shape[1] != len(stride):
        raise ValueError(f"offsets: {xyz.shape[1]}-d coordinates for a rank-{len(stride)} layout")
    return xyz @ np.asarray(stride, dtype=np.int64)
