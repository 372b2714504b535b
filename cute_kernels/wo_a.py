"""WO-A: the first half of the attention output projection, token-major output.

The attention output ``o [T, H, Dv]`` (bf16) is split into ``G`` head groups; group ``g`` has
its own low-rank projection ``wo_a[g] : [R, Dg]`` with ``Dg = (H/G) * Dv``::

    y[t, g*R + r] = sum_d wo_a[g, r, d] * o[t, g*(H/G):(g+1)*(H/G), :].flatten()[d]

FP32 accumulation, one rounding to bf16. WO-B consumes ``y [T, G*R]`` token-major; the
unfused path computes group-major ``[G, T, R]`` with a batched GEMM and then transposes with
a contiguous copy. Here every kernel stores through a token-major view of ``y``
(:mod:`cute_kernels.wo_a_sm90` explains the views), so that copy does not exist.

Kernels (:func:`route` picks one per call; docs/wo_a.md explains the rule):

* the arch's TMA GEMM engine -- sm_90a :mod:`.wo_a_sm90` (wgmma), sm_100a / sm_103a
  :mod:`.wo_a_sm100` (tcgen05) -- tiled for T;
* at decode T two weight-streaming kernels: :mod:`.wo_a_decode` (split-K warp MMAs, any arch)
  and :mod:`.wo_a_decode_swap_ab` (TMA + wgmma with the weight rows as M; Hopper);
* on a 132-SM Hopper part, inside measured T ranges, one cuBLAS strided-batched GEMM that
  stores token-major ``y`` itself (:mod:`.wo_a_cublas`);
* any other device: the PyTorch reference, with one warning.

Constraints: bf16 ``o`` and ``wo_a``, contiguous; ``H % G == 0``; ``R % 64 == 0``,
``Dg % 64 == 0`` (16-byte TMA rows, whole K tiles); any ``T >= 1``. One compile per tile
class serves every T in it; ``python -m cute_kernels build`` compiles every class the default
route takes for the supported shapes (:func:`aot_routes`), ``--wo-a-shape G,R,Dg`` a model's
own; else each compiles on first use. Supported and tested: DeepSeek-V4-Flash (G = 8) and
-Pro (G = 16) -- Dg = 4096, R = 1024 -- first; also G in {8, 16}, Dg in {1024, 2048}, R in
{512, 1024}. The checkpoints' FP8 format (e4m3, 128 x 128 block scales) at any T:
:func:`cute_kernels.wo_a_decode_fp8.wo_a_fp8`.

Run / bench::

    pytest tests/test_wo_a.py
    python bench/bench_wo_a.py
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch

import cutlass
from cutlass import Float32, Int32

from . import jit
from .arch import current_arch, dispatch, family, normalize_arch, num_sms
from .validate import check_cuda, check_int32_indexable, check_tensor
from .wo_a_cublas import wo_a_cublas
from .wo_a_sm90 import WoASm90
from .wo_a_sm100 import WoASm100
from .wo_a_decode import BN_NARROW, WoADecode, WoADecodeWorkspace, plan as decode_plan
from .wo_a_decode_swap_ab import plan as swap_ab_plan

_HERE = os.path.dirname(os.path.abspath(__file__))
_PATHS = {"sm90": WoASm90, "sm100": WoASm100}


def _build(arch: str, *, G: int, R: int, Dg: int, tile_m: int, tile_n: int, cluster_m: int = 1, cluster_n: int = 1,
           pdl: bool = False, swap_ab: bool = False, occupancy: int = 1, pingpong: bool = False,
           cluster_exit: str | None = None, weight_l2_hint: str | None = None, max_stages: int | None = None):
    """``cluster_m`` / ``cluster_n``: the Hopper engine's thread-block cluster (TMA multicast of
    the operand tiles the cluster's CTAs share), 1 or 2 CTAs per mode. ``pdl``: the Hopper engine
    as a programmatic dependent launch (see :func:`wo_a`). ``swap_ab``: weight rows on M,
    tokens on N (:mod:`.wo_a_sm90`); the tile is then (R-tile, T-tile). ``occupancy``: CTAs
    per SM the engine's stage count (and, for 128-row tiles, its warp count) leave room for.
    ``pingpong``: the Hopper engine's persistent schedule, 64-row tiles taken by its two
    consumer warp groups in turn (one's epilogue under the other's MMAs). ``cluster_exit``: how
    a clustered Hopper CTA outlives its peers' arrivals (:class:`.gemm.sm90_gemm.Sm90Gemm`).
    ``weight_l2_hint``: an L2 cache hint on the Hopper engine's weight loads
    (:data:`.gemm.sm90_gemm.L2_HINTS`, e.g. ``"evict_first"``: weights are streamed once).
    ``max_stages``: a cap on the Hopper engine's operand stages (otherwise as many as fit).
    Which kernel and config a call launches: :func:`route`."""

    cls = _PATHS[family(arch)]
    if not cls.can_implement(G, R, Dg):
        raise ValueError(f"wo_a: unsupported G={G}, R={R}, Dg={Dg} on {arch}")
    P = jit.fake_gmem_ptr
    args = (P(cutlass.BFloat16, 16), P(cutlass.BFloat16, 16), P(cutlass.BFloat16, 16), Int32(1), jit.fake_stream())
    if (cluster_m, cluster_n) == (1, 1) and not pdl and not swap_ab and occupancy == 1 and not pingpong \
            and cluster_exit is None and weight_l2_hint is None and max_stages is None:
        return cls(G, R, Dg, (tile_m, tile_n)), args
    if family(arch) != "sm90" or cluster_m not in (1, 2) or cluster_n not in (1, 2) or occupancy not in (1, 2):
        raise ValueError(f"wo_a: cluster ({cluster_m}, {cluster_n}), pdl={pdl}, swap_ab={swap_ab}, "
                         f"occupancy={occupancy}, pingpong={pingpong}, "
                         f"cluster_exit={cluster_exit!r}, "
                         f"weight_l2_hint={weight_l2_hint!r}, max_stages={max_stages} -- only the Hopper path "
                         f"takes a cluster (1 or 2 CTAs per mode), a programmatic dependent launch, swapped "
                         f"operands, 2 CTAs per SM, a persistent schedule, a cluster exit, an L2 hint or a stage cap")
    return cls(G, R, Dg, (tile_m, tile_n), (cluster_m, cluster_n), pdl, swap_ab, occupancy, pingpong,
               cluster_exit, weight_l2_hint, max_stages), args


def _aot(arch: str):
    """Every engine config the default :func:`route` takes on ``arch`` (:func:`aot_routes`)."""
    return _routed_configs("wo_a", arch)


KERNEL = jit.register(jit.KernelDef(
    name="wo_a",
    build=_build,
    sources=tuple(os.path.join(_HERE, f) for f in ("wo_a.py", "wo_a_sm90.py", "wo_a_sm100.py",
                                                   "gemm/sm90_gemm.py", "gemm/sm100_gemm.py")),
    archs=("sm_90a", "sm_100a", "sm_103a"),
    aot_configs=_aot,
    description="grouped low-rank output projection, token-major epilogue (wgmma / tcgen05)",
))


def wo_a_torch(o, w, out=None):
    """The op in PyTorch (FP32 einsum, one rounding to ``out``'s dtype, bf16 by default): the
    fallback for devices without a CuTe path and the custom op's CPU kernel."""
    T, H, Dv = o.shape
    G, R, Dg = w.shape
    y = torch.einsum("tgd,grd->tgr", o.reshape(T, G, Dg).float(), w.float()).reshape(T, G * R)
    return y.to(torch.bfloat16) if out is None else out.copy_(y)


# --------------------------------------------------------------------------------------
# Routing: which kernel serves T tokens of a shape. The whole rule is on this screen;
# docs/wo_a.md has the measurements behind it.
# --------------------------------------------------------------------------------------

#: values of ``wo_a(decode_kernel=...)`` beyond None / False: True is "mma"
DECODE_KINDS = ("mma", "wgmma")
#: values of ``wo_a(backend=...)``: None is the default rule (:func:`route`)
BACKENDS = (None, "cute", "cublas")
#: tokens up to which Hopper takes a decode kernel (both beat the TMA/wgmma engine there)
DECODE_MAX_T = 16
#: SMs of the H100 / H200 SXM parts the Hopper rule was measured on
SM90_SMS = 132
#: (G, R, Dg) -> T ranges ``(lo, hi]`` where the Hopper default takes cuBLAS (one strided-batched
#: GEMM into token-major ``y``, :mod:`.wo_a_cublas`): at most three ranges per shape, fitted to
#: paired CuTe / cuBLAS timings (bench/data/wo_a_cublas_sm90*.csv, docs/wo_a.md).
#: Other shapes, other SM counts and Blackwell take this project's kernels at every T.
SM90_CUBLAS_T: dict[tuple[int, int, int], tuple[tuple[int, int], ...]] = {
    (8, 512, 1024): ((16, 32), (64, 664), (704, 3584)),
    (8, 512, 2048): ((16, 32), (64, 664), (960, 3584)),
    (8, 1024, 1024): ((16, 32), (120, 1408), (1536, 1664)),
    (8, 1024, 2048): ((16, 32), (128, 304), (512, 1984)),
    (16, 512, 1024): ((16, 32), (128, 440), (480, 1696)),
    (16, 512, 2048): ((16, 32), (480, 1440), (1536, 1664)),
    (16, 1024, 1024): ((16, 32), (256, 984), (1056, 1088)),
    (16, 1024, 2048): ((16, 32), (256, 872), (888, 984)),
    # DeepSeek-V4 (Dg = 4096): T <= 32 from the paired points of bench_wo_a_v4 on the H200 and
    # the H100 (cuBLAS level or 1-3% ahead of the decode kernels at T = 5..16 on both, 3-7% at
    # T = 32); above 64 from an H100's grid of 48 T per shape
    # (bench/data/wo_a_cublas_sm90_v4_h100.csv.xz), capped at T = 2048 where the H200 measured this
    # project's engine ahead at T = 4096 / 16384 and the H100 cuBLAS (docs/wo_a.md)
    (8, 1024, 4096): ((0, 32), (320, 640), (896, 2048)),
    (16, 1024, 4096): ((0, 32), (256, 2048)),
}


def route(T: int, G: int, R: int, Dg: int, arch: str, *, decode_kernel: bool | str | None = None,
          pdl: bool = False, sms: int = SM90_SMS, backend: str | None = None) -> tuple[str, dict]:
    """The kernel (``"wo_a"``, ``"wo_a_decode"``, ``"wo_a_decode_swap_ab"``, or ``"wo_a_cublas"`` --
    nothing to compile) and its whole compile config that :func:`wo_a` launches for ``T``
    tokens of the shape on ``arch`` with ``sms`` SMs.

    1. ``backend="cublas"``, or by default (no ``decode_kernel``, no ``pdl``) on a 132-SM Hopper
       part inside :data:`SM90_CUBLAS_T`: cuBLAS.
    2. A decode kernel where asked (``decode_kernel``), or by default on Hopper at T <= 16: the
       TMA + wgmma one (weight rows as M) where 64-row weight tiles leave SMs idle, or where the
       warp-MMA kernel's 32-column tiles would not fit one wave two per SM (unless ``pdl``);
       else the split-K warp-MMA one.
    3. Else the arch's TMA GEMM engine, tiled for T by its ``config_for``."""
    path = family(arch)
    if backend == "cublas" or (backend is None and decode_kernel is None and not pdl and path == "sm90"
                               and sms == SM90_SMS
                               and any(lo < T <= hi for lo, hi in SM90_CUBLAS_T.get((G, R, Dg), ()))):
        return "wo_a_cublas", dict(G=G, R=R, Dg=Dg)
    pdl_cfg = {"pdl": True} if pdl else {}  # in the compile key only when asked
    kind = {True: "mma", False: None}.get(decode_kernel, decode_kernel)
    if decode_kernel is None and path == "sm90" and T <= DECODE_MAX_T:
        idle_sms = G * R // 64 < 0.9 * sms
        over_one_wave = G * R // BN_NARROW > 2.2 * sms
        kind = "wgmma" if idle_sms or (over_one_wave and not pdl) else "mma"
    if kind == "wgmma":
        if path != "sm90" or T > 64:
            raise ValueError(f"wo_a: decode_kernel='wgmma' needs a Hopper (sm_90a) device and T <= 64, "
                             f"got {arch} and T={T}")
        return "wo_a_decode_swap_ab", dict(G=G, R=R, Dg=Dg, **swap_ab_plan(T, G, R, Dg, sms), **pdl_cfg)
    if kind == "mma" and WoADecode.can_implement(T, G, R, Dg):
        return "wo_a_decode", dict(G=G, R=R, Dg=Dg, **decode_plan(T, G, R, Dg, sms), **pdl_cfg)
    cfg = _PATHS[path].config_for(T, G, R, Dg, pdl=pdl)
    return "wo_a", dict(G=G, R=R, Dg=Dg, **cfg, **(pdl_cfg if path == "sm90" else {}))


_WORKSPACES: dict = {}


#: (o.shape, wo_a_weight.shape, device index) -> the decode kernel's tensor entry
#: (jit.launch_tensor_entry), filled by a first validated call of the default route with TVM-FFI
#: on; the split kernel's default workspace under the same key
_TENSOR_FNS: dict = {}
_TENSOR_WORKSPACES: dict = {}


def _default_workspace(device, G, R) -> WoADecodeWorkspace:
    """One per (device, G, R), created on first use (do that outside graph capture: a warm-up)."""
    key = (device, G, R)
    ws = _WORKSPACES.get(key)
    if ws is None:
        ws = _WORKSPACES[key] = WoADecodeWorkspace(G, R, device=device)
    return ws


def group_shapes(op: str, o: torch.Tensor, w: torch.Tensor, w_name: str) -> tuple[int, ...]:
    """``(T, H, Dv, G, R, Dg)`` of ``o [T, H, Dv]`` and ``w [G, R, (H/G)*Dv]`` (either WO-A
    weight format), with an error naming the argument where the head groups do not match."""
    T, H, Dv = o.shape
    G, R, Dg = w.shape
    if H % G:
        raise ValueError(f"{op}: o has H={H} heads, not divisible by G={G} groups ({w_name}.shape[0])")
    if Dg != (H // G) * Dv:
        raise ValueError(f"{op}: {w_name}.shape[2]={Dg} must equal (H/G)*Dv = {(H // G) * Dv}")
    return T, H, Dv, G, R, Dg


def decode_workspace(op: str, workspace, o: torch.Tensor, G: int, R: int, splits: int) -> WoADecodeWorkspace:
    """The split workspace of a decode-kernel call (:mod:`.wo_a_decode`, :mod:`.wo_a_decode_fp8`):
    the caller's, checked for its type, shape, split capacity and device, or the shared default."""
    if workspace is None:
        workspace = _default_workspace(o.device, G, R)
    if not isinstance(workspace, WoADecodeWorkspace) or (workspace.G, workspace.R) != (G, R) \
            or workspace.max_splits < splits:
        raise ValueError(f"{op}: workspace must be a WoADecodeWorkspace for G={G}, R={R} with max_splits >= "
                         f"{splits}")
    check_cuda(op, ("o", o), ("workspace.partials", workspace.partials))
    return workspace


def wo_a(o: torch.Tensor, wo_a_weight: torch.Tensor, *, out: torch.Tensor | None = None, stream=None,
         arch: str | None = None, decode_kernel: bool | str | None = None,
         workspace: WoADecodeWorkspace | None = None, pdl: bool = False,
         backend: str | None = None) -> torch.Tensor:
    """``y [T, G*R]`` (bf16, token-major) from ``o [T, H, Dv]`` and ``wo_a_weight [G, R, (H/G)*Dv]``.

    :func:`route` chooses the kernel; the keyword arguments override it:

    ``decode_kernel`` (T <= 64): ``"mma"`` (or ``True``) -- :mod:`cute_kernels.wo_a_decode`
    (warp MMAs, split-K; any arch); ``"wgmma"`` -- :mod:`cute_kernels.wo_a_decode_swap_ab` (TMA +
    wgmma, weight rows as M; Hopper); ``False`` -- neither. The warp-MMA kernel's split partials
    live in ``workspace`` (default: one shared per device and shape -- pass your own for
    concurrent calls on several streams).

    ``pdl`` (the decode kernels and the Hopper engine; the Blackwell engine ignores it): launch
    as a programmatic dependent of the previous kernel on the stream, so the first weight tiles
    load while that kernel drains; ``o`` is read and anything written only after that kernel's
    grid has completed. Contract: the kernel just before it on the stream must not write
    ``wo_a_weight`` (true of inference weights). It pays after a kernel that triggers its
    dependents early (this project's), not after a cuBLAS GEMM.

    ``backend``: ``"cute"`` -- this project's kernels only; ``"cublas"`` -- one cuBLAS
    strided-batched GEMM storing token-major ``y`` (:mod:`.wo_a_cublas`; any CUDA device; not
    with ``decode_kernel`` or ``pdl``); ``None`` -- the default rule.
    """
    # the default route on torch's current stream: the calls that take a tensor entry
    default_call = (stream is None and arch is None and decode_kernel is None and workspace is None and not pdl
                    and backend is None)
    if (out is not None and jit.TVM_FFI and default_call and isinstance(o, torch.Tensor)
            and isinstance(wo_a_weight, torch.Tensor)):  # the eager hot path (T <= 64)
        key = (o.shape, wo_a_weight.shape, o.get_device())  # (the C checks: dtypes, extents, strides, ...)
        ws = _TENSOR_WORKSPACES.get(key)
        if (jit.launch_tensor_entry(_TENSOR_FNS, key, o, wo_a_weight, out) if ws is None else
                jit.launch_tensor_entry(_TENSOR_FNS, key, o, wo_a_weight, out, ws.partials, ws.counters)):
            return out
    op = "wo_a"
    if decode_kernel not in (None, True, False) + DECODE_KINDS:
        raise ValueError(f"{op}: decode_kernel={decode_kernel!r}, expected None, True, False, 'mma' or 'wgmma'")
    if backend not in BACKENDS:
        raise ValueError(f"{op}: backend={backend!r}, expected None, 'cute' or 'cublas'")
    if backend == "cublas" and (decode_kernel is not None or pdl):
        raise ValueError(f"{op}: backend='cublas' takes neither decode_kernel ({decode_kernel!r}) nor pdl ({pdl}): "
                         f"those choose among this project's kernels")
    check_tensor(op, "o", o, dtype=torch.bfloat16, ndim=3, contiguous=True)
    check_tensor(op, "wo_a_weight", wo_a_weight, dtype=torch.bfloat16, ndim=3, contiguous=True)
    T, H, Dv, G, R, Dg = group_shapes(op, o, wo_a_weight, "wo_a_weight")
    if R % 64 or Dg % 64:
        raise ValueError(f"{op}: R={R} and Dg={Dg} must be multiples of 64")
    check_int32_indexable(op, f"the largest of o / out / wo_a_weight (T={T})", max(T * H * Dv, T * G * R, G * R * Dg))
    if out is None:
        out = torch.empty(T, G * R, dtype=torch.bfloat16, device=o.device)
    check_tensor(op, "out", out, dtype=torch.bfloat16, shape=(T, G * R), contiguous=True)
    check_cuda(op, ("o", o), ("wo_a_weight", wo_a_weight), ("out", out))
    if T == 0:
        return out
    if backend == "cublas":
        return wo_a_cublas(o, wo_a_weight, out, stream)
    a = arch if arch is not None else current_arch(o.device)
    path = dispatch(op, ("sm100", "sm90", "reference"), arch=a)
    if path == "reference":
        return wo_a_torch(o, wo_a_weight, out)
    name, cfg = route(T, G, R, Dg, a, decode_kernel=decode_kernel, pdl=pdl, sms=num_sms(o.device), backend=backend)
    if name == "wo_a_cublas":
        return wo_a_cublas(o, wo_a_weight, out, stream)
    P, bf16 = jit.gmem_ptr, cutlass.BFloat16
    fn = jit.get_kernel(name, a, **cfg)
    ws = None
    if name == "wo_a_decode":  # split-K: FP32 partials and tile counters in the workspace
        ws = decode_workspace(op, workspace, o, G, R, cfg["splits"])
        fn(P(bf16, o, 16), P(bf16, wo_a_weight, 16), P(bf16, out, 4), P(Float32, ws.partials, 4),
           P(Int32, ws.counters, 4), jit.i32(T), jit.cu_stream(stream))
    else:  # the engine (TMA-stored y: 16-byte aligned) and the wgmma decode kernel
        fn(P(bf16, o, 16), P(bf16, wo_a_weight, 16), P(bf16, out, 16 if name == op else 4), jit.i32(T),
           jit.cu_stream(stream))
    if name != op and default_call:  # a decode kernel by the default route: its tensor entry for the next calls
        key = (o.shape, wo_a_weight.shape, o.get_device())
        if ws is not None:
            _TENSOR_WORKSPACES[key] = ws
        jit.remember_tensor_entry(_TENSOR_FNS, key, f"{name}_tensors", a, **cfg)
    return out


#: (G, R, Dg) shapes the AOT build (``python -m cute_kernels build``) covers at every T:
#: the supported and tested set, DeepSeek-V4-Flash / -Pro first
AOT_SHAPES = ((8, 1024, 4096), (16, 1024, 4096)) + tuple(
    (G, R, Dg) for G in (8, 16) for R in (512, 1024) for Dg in (1024, 2048))
#: ... for T = 1 .. AOT_MAX_T; every larger T takes one of these configs (the classes stop
#: changing above the pingpong rule's threshold, T = 1537 at G=8 R=512)
AOT_MAX_T = 16384


def aot_routes(arch: str, shapes=AOT_SHAPES, max_tokens: int = AOT_MAX_T, sms: int = SM90_SMS) \
        -> tuple[tuple[str, dict], ...]:
    """Every distinct (kernel, config) the default :func:`route` (no ``decode_kernel``, no
    ``pdl``, no ``backend``) takes for T = 1 .. ``max_tokens`` of each (G, R, Dg) in ``shapes`` on
    ``arch`` with ``sms`` SMs, cuBLAS left out (it compiles nothing): what a deployment must
    have built so that no default call compiles. ``wo_a``'s, ``wo_a_decode``'s and
    ``wo_a_decode_swap_ab``'s AOT configs are these; ``python -m cute_kernels build --wo-a-shape
    G,R,Dg`` adds a model's own shape. The configs are fresh dicts (the enumeration is memoised)."""
    routes = _aot_routes(normalize_arch(arch), tuple(tuple(s) for s in shapes), max_tokens, sms)
    return tuple((name, dict(items)) for name, items in routes)


@functools.lru_cache(maxsize=None)
def _aot_routes(arch: str, shapes: tuple, max_tokens: int, sms: int) -> tuple:
    """:func:`aot_routes` with each config as its sorted items, in first-seen order."""
    seen = {}
    for G, R, Dg in shapes:
        for T in range(1, max_tokens + 1):
            name, cfg = route(T, G, R, Dg, arch, sms=sms)
            if name != "wo_a_cublas":
                seen.setdefault((name, tuple(sorted(cfg.items()))), None)
    return tuple(seen)


def _routed_configs(kernel: str, arch: str) -> tuple[dict, ...]:
    """``kernel``'s configs among :func:`aot_routes` on ``arch``: its ahead-of-time build."""
    return tuple(cfg for name, cfg in aot_routes(arch) if name == kernel)


# The decode kernels' AOT configs are the ones this router sends them: set here, where the
# routing rule lives, so that their modules need not import it.
for _kernel in ("wo_a_decode", "wo_a_decode_swap_ab"):
    jit.register(dataclasses.replace(jit.registry()[_kernel], aot_configs=functools.partial(_routed_configs, _kernel)))
    jit.register(dataclasses.replace(jit.registry()[f"{_kernel}_tensors"],
                                     aot_configs=functools.partial(_routed_configs, _kernel)))
