"""WO-A: the first half of the attention output projection, token-major output.

The attention output ``o [T, H, Dv]`` (bf16) is split into ``G`` head groups; group ``g`` has
its own low-rank projection ``wo_a[g] : [R, Dg]`` with ``Dg = (H/G) * Dv``::

    y[t, g*R + r] = sum_d wo_a[g, r, d] * o[t, g*(H/G):(g+1)*(H/G), :].flatten()[d]

FP32 accumulation, one rounding to bf16. WO-B consumes ``y [T, G*R]`` token-major; the
unfused path computes group-major ``[G, T, R]`` with a batched GEMM and then transposes with
a contiguous copy. Here the GEMM epilogue stores through a token-major view of ``y``
(:mod:`cute_kernels.wo_a_sm90` explains the views), so that copy does not exist.

Paths: sm_90a -> :mod:`.wo_a_sm90` (TMA + wgmma), sm_100a/sm_103a -> :mod:`.wo_a_sm100`
(TMA + tcgen05); any other device -> the PyTorch reference, with one warning. On Hopper, at
the (shape, T) bands where the H200 measured it faster, one cuBLAS strided-batched GEMM that
stores the token-major ``y`` itself (:mod:`.wo_a_cublas`; ``backend=`` overrides). At decode T
(<= 64) two weight-streaming kernels: :mod:`.wo_a_decode` (warp MMAs, any arch) and
:mod:`.wo_a_decode_sm90` (TMA + wgmma, weight rows as M; Hopper) -- :func:`wo_a` says which T
takes which.

Constraints: bf16 ``o`` and ``wo_a``, contiguous; ``H % G == 0``; ``R % 64 == 0``,
``Dg % 64 == 0`` (16-byte TMA rows, whole K tiles); any ``T >= 1``. One compile per tile
class serves every T in it: per supported shape 20-26 configs on Hopper (decode-kernel plans
at T <= 16 -- 32 at G=8 R=512 --, engine tiles up to 64, swapped token tiles matched to T up to
T = 1024 / 960 / 576 at G * R = 4096 / 8192 / 16384, the cooperative and the pingpong tile
above), 2 on Blackwell. :func:`route` names the
one a call takes; ``python -m cute_kernels build`` compiles every one of them for the
supported shapes (:func:`aot_routes`), ``--wo-a-shape G,R,Dg`` for a model's own; else each
compiles on first use.
Supported and tested: G in {8, 16}, Dg in {1024, 2048}, R in {512, 1024}.

Run / bench::

    pytest tests/test_wo_a.py
    python bench/bench_wo_a.py
"""

from __future__ import annotations

import functools
import os

import torch

import cutlass
from cutlass import Float32, Int32

from . import jit
from .arch import current_arch, dispatch, family, normalize_arch, num_sms
from .validate import check_cuda, check_int32_indexable, check_tensor
from .wo_a_cublas import prefers_cublas, wo_a_cublas
from .wo_a_sm90 import WoASm90
from .wo_a_sm100 import WoASm100
from .wo_a_decode import BN_NARROW, WoADecode, WoADecodeWorkspace, plan as decode_plan
from .wo_a_decode_sm90 import plan as sm90_decode_plan

_HERE = os.path.dirname(os.path.abspath(__file__))
_PATHS = {"sm90": WoASm90, "sm100": WoASm100}


def _build(arch: str, *, G: int, R: int, Dg: int, tile_m: int, tile_n: int, cluster_m: int = 1, cluster_n: int = 1,
           pdl: bool = False, swap_ab: bool = False, occupancy: int = 1, pingpong: bool = False,
           cluster_exit: str | None = None, weight_l2_hint: str | None = None, max_stages: int | None = None,
           persistent: bool = False):
    """``cluster_m`` / ``cluster_n``: the Hopper engine's thread-block cluster (TMA multicast of
    the operand tiles the cluster's CTAs share): (2, 1) in the shipped swapped configs, (1, 1)
    in the others, any of 1/2 x 1/2 for tools/probe_wo_a_tiles.py. ``pdl``: the Hopper engine
    as a programmatic dependent launch (see :func:`wo_a`). ``swap_ab``: weight rows on M,
    tokens on N (:mod:`.wo_a_sm90`); the tile is then (R-tile, T-tile). ``occupancy``: CTAs
    per SM the engine's stage count (and, for 128-row tiles, its warp count) leave room for.
    ``pingpong``: the Hopper engine's persistent schedule, 64-row tiles taken by its two
    consumer warp groups in turn (one's epilogue under the other's MMAs); ``persistent``: the
    same persistent CTA on 128-row cooperative tiles (the next tile's loads under the
    epilogue; tools/probe_wo_a_tiles.py ``PERSISTENT_TILES``). ``cluster_exit``: how
    a clustered Hopper CTA outlives its peers' arrivals (:class:`.gemm.sm90_gemm.Sm90Gemm`).
    ``weight_l2_hint``: an L2 cache hint on the Hopper engine's weight loads
    (:data:`.gemm.sm90_gemm.L2_HINTS`, e.g. ``"evict_first"``: weights are streamed once).
    ``max_stages``: a cap on the Hopper engine's operand stages (otherwise as many as fit).
    Which kernel and config a call launches: :func:`route` (the path's ``config_for`` above the decode T)."""

    cls = _PATHS[family(arch)]
    if not cls.can_implement(G, R, Dg):
        raise ValueError(f"wo_a: unsupported G={G}, R={R}, Dg={Dg} on {arch}")
    P = jit.fake_gmem_ptr
    args = (P(cutlass.BFloat16, 16), P(cutlass.BFloat16, 16), P(cutlass.BFloat16, 16), Int32(1), jit.fake_stream())
    if (cluster_m, cluster_n) == (1, 1) and not pdl and not swap_ab and occupancy == 1 and not pingpong \
            and not persistent and cluster_exit is None and weight_l2_hint is None and max_stages is None:
        return cls(G, R, Dg, (tile_m, tile_n)), args
    if family(arch) != "sm90" or cluster_m not in (1, 2) or cluster_n not in (1, 2) or occupancy not in (1, 2):
        raise ValueError(f"wo_a: cluster ({cluster_m}, {cluster_n}), pdl={pdl}, swap_ab={swap_ab}, "
                         f"occupancy={occupancy}, pingpong={pingpong}, persistent={persistent}, "
                         f"cluster_exit={cluster_exit!r}, "
                         f"weight_l2_hint={weight_l2_hint!r}, max_stages={max_stages} -- only the Hopper path "
                         f"takes a cluster (1 or 2 CTAs per mode), a programmatic dependent launch, swapped "
                         f"operands, 2 CTAs per SM, a persistent schedule, a cluster exit, an L2 hint or a stage cap")
    return cls(G, R, Dg, (tile_m, tile_n), (cluster_m, cluster_n), pdl, swap_ab, occupancy, pingpong,
               cluster_exit, weight_l2_hint, max_stages, persistent), args


def _aot(arch: str):
    """Every engine config :func:`wo_a` routes to on ``arch`` at T = 1 .. AOT_MAX_T for each
    of AOT_SHAPES (:func:`aot_routes`; the decode kernels' AOT configs are the rest)."""
    return tuple(cfg for name, cfg in aot_routes(arch) if name == "wo_a")


KERNEL = jit.register(jit.KernelDef(
    name="wo_a",
    build=_build,
    sources=tuple(os.path.join(_HERE, f) for f in ("wo_a.py", "wo_a_sm90.py", "wo_a_sm100.py",
                                                   "gemm/sm90_gemm.py", "gemm/sm100_gemm.py")),
    archs=("sm_90a", "sm_100a", "sm_103a"),
    aot_configs=_aot,
    description="grouped low-rank output projection, token-major epilogue (wgmma / tcgen05)",
))


def _torch_path(o, w, out):
    T, H, Dv = o.shape
    G, R, Dg = w.shape
    y = torch.einsum("tgd,grd->tgr", o.reshape(T, G, Dg).float(), w.float())
    out.copy_(y.reshape(T, G * R))
    return out


#: tokens up to which wo_a() uses the decode kernel by default on Hopper (H200, bench_wo_a:
#: faster than the wgmma engine at T = 1 and 5 for all four shapes; its 64-row variant is
#: slower at T = 64). Blackwell keeps its tcgen05 engine unless asked (nothing measured there).
DECODE_MAX_T = 16
#: ... and up to this many where the engine's 64-column tiles would leave SMs idle (the
#: warp-MMA decode plan's 32-row tile would take 32-column tiles: G=8 R=512), with the swap-AB
#: wgmma decode kernel (:mod:`.wo_a_decode_sm90`). H200 (bench/RESULTS.md): the warp-MMA
#: kernel's 9.5 / 9.9 us at T = 20 / 32 beat the engine's 10.75 / 10.15 (fourteenth session,
#: phase 39); the wgmma kernel's 8.5 us at T = 32 beats the warp-MMA kernel's 9.9 (sixteenth
#: session, phase 53). At the other three shapes the engine ties or wins there.
DECODE_NARROW_MAX_T = 32
#: values of ``wo_a(decode_kernel=...)`` beyond None / False: True is "mma"
DECODE_KINDS = ("mma", "wgmma")
#: values of ``wo_a(backend=...)``: None is the measured rule (:func:`route`)
BACKENDS = (None, "cute", "cublas")


def use_decode_kernel(T: int, decode_kernel: bool | str | None, path: str = "sm90", G: int | None = None,
                      R: int | None = None, Dg: int | None = None, sms: int = 132) -> bool:
    """Whether :func:`wo_a` takes a decode kernel (``decode_kernel``: the caller's choice;
    ``None``: the default above, which for 16 < T <= 32 needs the shape)."""
    if decode_kernel is not None:
        return decode_kernel in DECODE_KINDS or decode_kernel is True
    if path != "sm90":
        return False
    if T <= DECODE_MAX_T:
        return True
    return (T <= DECODE_NARROW_MAX_T and None not in (G, R, Dg)
            and decode_plan(T, G, R, Dg, sms)["bn"] == BN_NARROW)


def decode_kernel_kind(T: int, decode_kernel: bool | str | None, path: str = "sm90", G: int | None = None,
                       R: int | None = None, Dg: int | None = None, sms: int = 132, pdl: bool = False) -> str:
    """Which decode kernel a call that :func:`use_decode_kernel` routes to one takes: the
    caller's ``"mma"`` / ``"wgmma"`` (True: ``"mma"``); by default on Hopper the wgmma kernel
    (:mod:`.wo_a_decode_sm90`) where 64-row weight tiles fill under 90% of the SMs -- the
    16 < T <= 32 route's shapes (G=8 R=512) -- and, at T <= 16 without ``pdl``, where the
    warp-MMA plan takes 64-column tiles (G * R > 9292: G=16 R=1024); the warp-MMA kernel
    (:mod:`.wo_a_decode`) where its plan takes 32-column tiles (G=16 R=512, G=8 R=1024).
    H200 (bench/RESULTS.md, sixteenth session, phases 52-54), G=8 R=512 T = 1 / 5 / 20 / 32:
    wgmma 7.02 / 7.31 / 8.26 / 8.37 us against warp MMAs 7.39 / 7.60 / 9.77 / 9.84. The
    issue's bench times both kernels at T = 1 / 5 in every run (six runs, sixteenth to
    nineteenth session): at G=16 R=1024 the wgmma kernel was faster in 12 of 12 readings
    (10.55-11.06 against 10.74-11.23 us), at G=8 R=1024 slower in 12 of 12 (by 0.5-2%), at
    G=16 R=512 slower in 10 of 12. As a programmatic dependent (the bench's PDL column) the
    warp-MMA kernel stays faster at G=16 R=1024: 9.01-9.36 us at T = 1 in six runs against the
    wgmma kernel's 9.93 (nineteenth session, phase 77)."""
    if decode_kernel in DECODE_KINDS:
        return decode_kernel
    if decode_kernel is None and path == "sm90" and None not in (G, R, Dg) \
            and (decode_plan(DECODE_NARROW_MAX_T, G, R, Dg, sms)["bn"] == BN_NARROW
                 or (T <= DECODE_MAX_T and not pdl and decode_plan(T, G, R, Dg, sms)["bn"] != BN_NARROW)):
        return "wgmma"
    return "mma"


_WORKSPACES: dict = {}


def _default_workspace(device, G, R) -> WoADecodeWorkspace:
    """One per (device, G, R), created on first use (do that outside graph capture: a warm-up)."""
    key = (device, G, R)
    ws = _WORKSPACES.get(key)
    if ws is None:
        ws = _WORKSPACES[key] = WoADecodeWorkspace(G, R, device=device)
    return ws


def _group_shapes(op: str, o: torch.Tensor, w: torch.Tensor, w_name: str) -> tuple[int, ...]:
    """``(T, H, Dv, G, R, Dg)`` of ``o [T, H, Dv]`` and ``w [G, R, (H/G)*Dv]`` (either WO-A
    weight format), with an error naming the argument where the head groups do not match."""
    T, H, Dv = o.shape
    G, R, Dg = w.shape
    if H % G:
        raise ValueError(f"{op}: o has H={H} heads, not divisible by G={G} groups ({w_name}.shape[0])")
    if Dg != (H // G) * Dv:
        raise ValueError(f"{op}: {w_name}.shape[2]={Dg} must equal (H/G)*Dv = {(H // G) * Dv}")
    return T, H, Dv, G, R, Dg


def _decode_workspace(op: str, workspace, o: torch.Tensor, G: int, R: int, splits: int) -> WoADecodeWorkspace:
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

    ``decode_kernel`` routes the call (T <= 64) to a weight-streaming decode kernel: ``"mma"``
    (or ``True``) to :mod:`cute_kernels.wo_a_decode` (warp MMAs, split-K; any arch),
    ``"wgmma"`` to :mod:`cute_kernels.wo_a_decode_sm90` (TMA + wgmma with the weight rows as
    M; Hopper only), ``False`` to neither. ``None`` (default) on Hopper: a decode kernel for
    T <= 16 -- where the H200 measured both faster than the TMA/wgmma engine at every shape
    (bench/RESULTS.md) -- and for 16 < T <= 32 where the engine's 64-column tiles leave SMs
    idle (:data:`DECODE_NARROW_MAX_T`); :func:`decode_kernel_kind` says which. Split
    partials live in ``workspace`` (default: one shared per device and shape -- pass your own
    for concurrent calls on several streams).

    On Hopper the TMA/wgmma engine serves the rest: (T, R) tiles at T <= 64 and past T = 1024 /
    960 / 576 (G * R = 4096 / 8192 / 16384; T > 512 for shapes not measured), swapped operands
    in between and at 32 < T <= 64 where 64-row weight tiles leave most SMs idle (tokens on
    wgmma N, token tiles matched to T in steps of 16, CTA pairs sharing a
    tile by multicast -- :meth:`WoASm90.config_for`).

    ``pdl`` (the decode kernel and the Hopper engine; the Blackwell engine ignores it): launch
    as a programmatic dependent of the previous kernel on the stream, so the first weight
    tiles load while that kernel drains; ``o`` is read and anything written only after that
    kernel's grid has completed. Contract: the kernel just
    before it on the stream must not write ``wo_a_weight`` (true of inference weights).
    H200 (bench/RESULTS.md, eighth session): 1.13-1.26x at T <= 64 back to back, 1.03-1.06x at
    T = 320 in three of four shapes, 0.84-1.00x at T >= 4096 (the early dependents compete
    with the last wave) -- use it for decode-size T, after a kernel that triggers its
    dependents early (this project's). After a cuBLAS ``bmm`` (which never does) it lost at
    15 of 16 (shape, T <= 320) points, 0.85-1.03x (tools/probe_wo_a_pdl_runtime.py,
    fourteenth session).

    ``backend``: ``"cute"`` -- this project's kernels only; ``"cublas"`` -- one cuBLAS
    strided-batched GEMM storing token-major ``y`` itself (:mod:`.wo_a_cublas`; any CUDA
    device; not with ``decode_kernel`` or ``pdl``); ``None`` (default) -- cuBLAS on Hopper
    inside the bands where the H200 measured it faster than this project's kernels
    (:data:`.wo_a_cublas.SM90_BANDS`: up to 1.30x at T = 513-1024 since the twenty-fourth
    session's mid-T tiles, 1.74x before; e.g. T = 320 at G=8 R=512 Dg=2048), unless
    ``decode_kernel`` or ``pdl`` asks for a CuTe kernel; else the CuTe kernels.
    """
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
    T, H, Dv, G, R, Dg = _group_shapes(op, o, wo_a_weight, "wo_a_weight")
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
        return _torch_path(o, wo_a_weight, out)
    name, cfg = route(T, G, R, Dg, a, decode_kernel=decode_kernel, pdl=pdl, sms=num_sms(o.device), backend=backend)
    if name == "wo_a_cublas":
        return wo_a_cublas(o, wo_a_weight, out, stream)
    P = jit.gmem_ptr
    if name == op:
        fn = jit.get_kernel(name, a, **cfg)
        fn(P(cutlass.BFloat16, o, 16), P(cutlass.BFloat16, wo_a_weight, 16), P(cutlass.BFloat16, out, 16),
           jit.i32(T), jit.cu_stream(stream))
        return out
    # both decode kernels take the same arguments; only the kernel and its plan differ
    workspace = _decode_workspace(op, workspace, o, G, R, cfg["splits"])
    fn = jit.get_kernel(name, a, **cfg)
    fn(P(cutlass.BFloat16, o, 16), P(cutlass.BFloat16, wo_a_weight, 16), P(cutlass.BFloat16, out, 4),
       P(Float32, workspace.partials, 4), P(Int32, workspace.counters, 4), jit.i32(T), jit.cu_stream(stream))
    return out


def route(T: int, G: int, R: int, Dg: int, arch: str, *, decode_kernel: bool | str | None = None,
          pdl: bool = False, sms: int = WoASm90.NUM_SMS, backend: str | None = None) -> tuple[str, dict]:
    """The kernel (``"wo_a"``, ``"wo_a_decode"``, ``"wo_a_decode_sm90"``, or
    ``"wo_a_cublas"`` -- nothing to compile) and the whole compile config (shape included)
    that :func:`wo_a` launches for ``T`` tokens of the shape on ``arch`` (sm_90a / sm_100a /
    sm_103a) with ``sms`` SMs -- the one routing rule, which the AOT build
    (:func:`aot_routes`, ``backend="cute"``) enumerates too. A ``ValueError`` for a decode
    kernel the arch or T cannot take."""
    path = family(arch)
    if backend == "cublas" or (backend is None and decode_kernel is None and not pdl
                               and prefers_cublas(T, G, R, Dg, path, sms)):
        return "wo_a_cublas", dict(G=G, R=R, Dg=Dg)
    pdl_cfg = {"pdl": True} if pdl else {}  # in the compile key only when asked: default keys unchanged
    if use_decode_kernel(T, decode_kernel, path, G, R, Dg, sms):
        wgmma = decode_kernel_kind(T, decode_kernel, path, G, R, Dg, sms, pdl) == "wgmma"
        if wgmma and (path != "sm90" or T > 64):
            raise ValueError(f"wo_a: decode_kernel='wgmma' needs a Hopper (sm_90a) device and T <= 64, "
                             f"got {arch} and T={T}")
        if wgmma:
            return "wo_a_decode_sm90", dict(G=G, R=R, Dg=Dg, **sm90_decode_plan(T, G, R, Dg, sms), **pdl_cfg)
        if WoADecode.can_implement(T, G, R, Dg):
            return "wo_a_decode", dict(G=G, R=R, Dg=Dg, **decode_plan(T, G, R, Dg, sms), **pdl_cfg)
    cfg = _PATHS[path].config_for(T, G, R, Dg, pdl=pdl)
    return "wo_a", dict(G=G, R=R, Dg=Dg, **cfg, **(pdl_cfg if path == "sm90" else {}))


#: (G, R, Dg) shapes the AOT build (``python -m cute_kernels build``) covers at every T:
#: the supported and tested set
AOT_SHAPES = tuple((G, R, Dg) for G in (8, 16) for R in (512, 1024) for Dg in (1024, 2048))
#: ... for T = 1 .. AOT_MAX_T; every larger T takes one of these configs (the classes stop
#: changing above the pingpong rule's threshold, T = 1537 at G=8 R=512)
AOT_MAX_T = 16384


def aot_routes(arch: str, shapes=AOT_SHAPES, max_tokens: int = AOT_MAX_T, sms: int = WoASm90.NUM_SMS) \
        -> tuple[tuple[str, dict], ...]:
    """Every distinct (kernel, config) :func:`route` takes with ``backend="cute"`` (no
    ``decode_kernel``, no ``pdl``) for T = 1 .. ``max_tokens`` of each (G, R, Dg) in ``shapes``
    on ``arch`` with ``sms`` SMs: what a deployment must have built so that no call compiles --
    the default route's CuTe kernels, and those ``backend="cute"`` takes inside the cuBLAS
    bands (the default's cuBLAS calls compile nothing). ``wo_a``'s and
    ``wo_a_decode_sm90``'s AOT configs are these; ``wo_a_decode``'s own list holds its share
    (tests/test_wo_a.py checks both); ``python -m cute_kernels build --wo-a-shape G,R,Dg``
    adds a model's own shape. (Routes on a part with another SM count differ at decode T and
    compile on first use.) The configs are fresh dicts: the enumeration is memoised."""
    routes = _aot_routes(normalize_arch(arch), tuple(tuple(s) for s in shapes), max_tokens, sms)
    return tuple((name, dict(items)) for name, items in routes)


@functools.lru_cache(maxsize=None)
def _aot_routes(arch: str, shapes: tuple, max_tokens: int, sms: int) -> tuple:
    """:func:`aot_routes` with each config as its sorted items, in first-seen order."""
    seen = {}
    for G, R, Dg in shapes:
        for T in range(1, max_tokens + 1):
            name, cfg = route(T, G, R, Dg, arch, sms=sms, backend="cute")
            seen.setdefault((name, tuple(sorted(cfg.items()))), None)
    return tuple(seen)
