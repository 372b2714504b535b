"""MoE router: DeepSeek-V3/V4 top-k with padded, packed outputs, in one launch.

Scoring (per token ``t``, experts ``e < E``)::

    s[e] = score(logits[t, e])                         # FP32: sigmoid (V3) or sqrt(softplus) (V4)
    b[e] = s[e] + e_score_correction_bias[e]           # selection score
    group score g = top1(b in g) + top2(b in g)        # n_group groups of E/n_group experts (V3)
    keep the topk_group best groups; pick the k best b[e] among their experts
    w[i] = s[id_i] / (s[id_0] + ... + s[id_{k-1}] + 1e-20) * routed_scaling_factor

With ``n_group == 1`` there is no group stage: a plain top-k of ``b`` (DeepSeek-V4: k = 6,
E = 256 (Flash) or 384 (Pro), ``score="sqrtsoftplus"``).

Hash routing (``hash_routed=True``; DeepSeek-V4's first MoE layers): the experts are not
chosen by score but read from a frozen table, ``id_i = tid2eid[token_ids[t], i]``; the weights
are the same normalised scores of those experts (no bias). Table rows must hold ``k``
distinct experts in ``[0, E)`` (:meth:`MoeRouter.set_hash_table` checks once, offline);
a token id outside ``[0, vocab)`` is clamped into it in the kernel (never an out-of-bounds
read; the host cannot check ids on the hot path without a sync). ``sqrt(softplus(x))`` is computed
as ``sqrt(max(x, 0) + log1p(exp(-|x|)))``: no overflow for large ``x``, full relative
precision for very negative ``x`` (the ``log1p`` of an argument in [0, 1]: :func:`log1p_unit`).

Ties (groups and experts): the lower index wins, everywhere -- the reference uses a stable
descending sort, which implements the same rule. ``topk_ids[t]`` lists the experts in
selection order (descending ``b``); the weight sum runs in that order.

Packed outputs (what ``moe_align_block_size`` computes in vLLM/SGLang), for M-tile ``tile``:

* ``expert_counts[e]``: routed rows of expert ``e``;
* ``expert_offsets[e]`` (E+1 entries): start of expert ``e``'s rows, each expert padded to a
  multiple of ``tile``; ``expert_offsets[E] == total_rows[0]``, the padded row count;
* ``sorted_token_ids[p]`` for ``p < total``: the routed row ``t * k + i`` (token t's i-th
  choice); rows of one expert in increasing order; padding slots hold the sentinel ``T * k``;
* ``tile_expert[j]``: expert of M-tile ``j`` for ``j < total / tile``, else -1;
* ``routed_row_pos[t*k + i]``: the slot ``p`` with ``sorted_token_ids[p] == t*k + i`` -- where
  the finalize (:mod:`moe.finalize`) finds routed row ``(t, i)`` in the expert outputs.

Slots at or past ``total`` are not written (consumers never read them). Buffers have fixed
capacities for a maximum T (:func:`capacity`), so a captured CUDA graph serves any T up to it.

Kernel (one launch, no host sync): every warp routes whole tokens -- lane ``l`` holds experts
``[l*V, (l+1)*V)`` with ``V = E/32``; group top-2 merges across the ``32/n_group`` lanes of a
group with butterfly shuffles; each of the k picks is a warp arg-max: every lane's best
candidate (a pairwise tree over its V) as an order-preserving unsigned key, one
``redux.sync`` maximum, and the lowest lane holding it (a ballot) wins -- its experts have the
lower indices, so ties go to the lower index. Three paths build the packed layout:

* up to ``SINGLE_CTA_MAX_TOKENS`` = 12 tokens (a verify step of BS1-2) one CTA routes them all
  (its capacity is 64; above 12 the cluster path's parallel routing wins) and keeps, per
  expert, the mask of tokens that picked it in shared memory (``atomicOr`` into two 32-bit
  words, one bit per token). After one barrier the counts are popcounts, a warp scan gives
  the padded offsets, and routed row ``t*k + i`` of expert ``e`` lands at
  ``offset[e] + popc(mask[e] & (2^t - 1))`` -- its rank among the expert's rows, in row
  order, since a token picks an expert once. No count atomics in global memory, no grid
  handshake.
* from there up to ``CLUSTER_MAX_TOKENS`` = 64 tokens (a verify step of BS4-12), the cluster
  path: one thread-block cluster of ``CLUSTER_CTAS`` = 8 CTAs of 8 warps (or 4 CTAs of 16
  warps: ``CLUSTER_SIZES``), each routing a token per warp as the single-CTA path does (its
  token masks: one bit per warp, by shared-memory ``atomicOr``). Each CTA then stores its mask
  words and picks into every CTA's shared memory with ``st.async`` (a cluster barrier, arrived
  at on entry, guarantees all CTAs run), each store crediting its bytes to the target CTA's
  mbarrier, which expects ``(C E + T k) * 4`` bytes; one wait on it and every CTA holds all the
  picks and masks (:mod:`cute_kernels.cluster_smem`: no release barrier, whose GPU-scope
  memory fence on sm_90 would wait for the ids and weights going to global memory alongside).
  Every CTA counts and scans them itself and writes its share of the layout -- counts,
  offsets, tile experts, the padding slots of each tile (those past its expert's rows, so no
  ordering with the live rows is needed) and the routed rows (rank ``popc`` of the mask words
  before the token). No global atomics, no grid-scope fence, no workspace.
* above that, a grid of CTAs counts with integer atomics in a workspace; the last CTA to finish
  (a release/acquire counter) builds the layout deterministically: a warp scan of padded counts,
  then rounds of 32 tokens per warp where a per-warp mask per expert (each pick one
  shared-memory ``atomicOr`` of its lane's bit) gives each row its rank among equal experts
  (``popc(mask & lanemask_lt)``) and a per-expert prefix over warps orders the rounds. It
  then zeroes the workspace, so graph replays need no host reset. ``workspace`` (int32, E+1
  entries) must be zero before the first launch.

The path is a host-side choice from T (a compile configuration of its own;
``bench/bench_moe.py --sections router-paths`` times the three at decode T).

Programmatic dependent launch (``pdl=True``, a compile option of every path): the kernel
signals its own dependents on entry and runs its set-up -- shared memory, the cluster's
arrival, the bias -- while the kernel before it on the stream finishes; ``griddepcontrol.wait``
then stands before its first read of the logits (or token ids) and its first global store.
Results are identical; only the launch differs.

NaN: a NaN score (a NaN logit or bias) ranks above every number and ties among NaNs go to
the lower index -- ``torch.sort``'s order, so the picks stay real experts and match the
PyTorch definition; the token's weights are then NaN. (A NaN and a +inf score tie here, to
the lower index; torch puts the NaN first.)

Constraints: E % 32 == 0, E <= 512; n_group divides 32 and E; topk_group <= n_group;
k <= 32 and k <= topk_group * E / n_group; tile a power of two <= 1024. Logits fp32 or bf16
``[T, E]`` row-major; bias fp32 ``[E]`` or None.

Test / bench::

    pytest tests/test_moe_router.py
    python bench/bench_moe.py
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32

from cute_kernels import jit
from cute_kernels.arch import current_arch, dispatch
from cute_kernels.cluster_smem import f32_bits, store_async_to_cta, store_async_to_cta_x4
from cute_kernels.grid_sync import last_arrival
from cute_kernels.validate import check_cuda, check_tensor

_LOGIT_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
#: The single-CTA path's capacity: one CTA routes them all (four per warp at most) and builds the
#: layout from shared memory -- no grid handshake, no global count atomics (one bit per token in
#: a 64-bit mask per expert)
SINGLE_CTA_CAPACITY = 64
#: Up to this many tokens the router takes the single-CTA path (<= SINGLE_CTA_CAPACITY); above,
#: the cluster path, whose CTAs route the tokens in parallel (``bench/bench_moe.py --sections
#: router-paths`` times the paths at each T: the single CTA is the faster up to 12 tokens, the
#: cluster of 8 from 16)
SINGLE_CTA_MAX_TOKENS = 12
#: The cluster path's capacity: a token per warp of the cluster's CTAs (module docstring)
CLUSTER_CAPACITY = 64
#: The cluster sizes it is built for, each with CLUSTER_CAPACITY / size warps per CTA: 4 CTAs
#: of 16 warps, or 8 CTAs of 8 warps (half the tokens per CTA to route, twice the CTAs to
#: all-gather between; ``bench/bench_moe.py --sections router-paths`` times both)
CLUSTER_SIZES = (4, 8)
#: ... and the one the host takes: 8, the faster of the two from T = 12 to 64 (the bench above)
CLUSTER_CTAS = 8
#: Above SINGLE_CTA_MAX_TOKENS and up to this many tokens (<= CLUSTER_CAPACITY) the router
#: takes the cluster path (0: never); above, the grid path. ``bench/bench_moe.py --sections
#: router-paths`` times the paths at each T: the cluster path is the fastest from T = 16 to
#: 64
CLUSTER_MAX_TOKENS = 64
#: expert score functions (RouterConfig.score)
SCORES = ("sigmoid", "sqrtsoftplus")
_NAME2CUTE = {"float32": Float32, "bfloat16": cutlass.BFloat16}


#: 2 / (2 n + 1), n = 7 .. 0: log1p_unit's series, highest power first
ATANH2_COEFFS = tuple(2.0 / (2 * n + 1) for n in range(7, -1, -1))


def log1p_unit(ys: list) -> list:
    """``log(1 + y)`` of each ``y`` in [0, 1] (and NaN): ``2 atanh(s)`` with ``s = y / (2 + y)`` in
    [0, 1/3], by the odd series ``2 (s + s^3/3 + ... + s^15/15)`` -- the first term left out is
    below 2^-26 of the sum, and ``s`` comes from one Newton step on the approximate reciprocal,
    so the result is within a few ulp of FP32, in 12 instructions where the general ``log1p``
    takes about thirty. (Traced inline, step by step over the list: the chains interleave.)"""
    d = [Float32(2.0) + y for y in ys]
    r = [cute.arch.rcp_approx(v) for v in d]
    r = [ri + ri * (Float32(1.0) - di * ri) for ri, di in zip(r, d)]
    s = [y * ri for y, ri in zip(ys, r)]
    z = [v * v for v in s]
    p = [Float32(ATANH2_COEFFS[0])] * len(ys)
    for c in ATANH2_COEFFS[1:]:
        p = [pi * zi + Float32(c) for pi, zi in zip(p, z)]
    return [si * pi for si, pi in zip(s, p)]


def sqrt_rn(xs: list) -> list:
    """``sqrt(x)`` rounded to nearest of each ``x >= 0`` (and +inf, NaN) without a branch:
    ``sqrt.rn``'s fast path (rsqrt estimate, product, one FMA correction), inputs below 2^-100
    scaled by 2^64 into its range first. ``sqrt.rn`` branches to a slow-path call for those,
    which keeps one expert's score from overlapping the next's. (Traced inline, step by step
    over the list.)"""
    small = [x < Float32(2.0**-100) for x in xs]
    xs = [cutlass.select_(m, x * Float32(2.0**64), x) for m, x in zip(small, xs)]
    r = [cute.math.rsqrt(x, approx=True, ftz=True) for x in xs]
    y = [x * ri for x, ri in zip(xs, r)]
    y = [cute.math.fma(cute.math.fma(-yi, yi, x), ri * Float32(0.5), yi) for yi, x, ri in zip(y, xs, r)]
    y = [cutlass.select_(m, yi * Float32(2.0**-32), yi) for m, yi in zip(small, y)]
    return [cutlass.select_((x == Float32(0.0)) | (x == Float32(math.inf)), x, yi) for x, yi in zip(xs, y)]


def rcp_rn_from_one(ds: list) -> list:
    """``1 / d`` rounded to nearest of each ``d >= 1`` (and +inf, NaN) without a branch, as
    :func:`sqrt_rn`: ``rcp.rn``'s fast path (estimate, FMA residual, FMA correction), ``d >=
    2^126`` scaled by 2^-64 first (its result, below 2^-126, then rounds twice)."""
    big = [d >= Float32(2.0**126) for d in ds]
    ds = [cutlass.select_(b, d * Float32(2.0**-64), d) for b, d in zip(big, ds)]
    r = [cute.arch.rcp_approx(d) for d in ds]
    r = [cute.math.fma(ri, -cute.math.fma(d, ri, Float32(-1.0)), ri) for ri, d in zip(r, ds)]
    r = [cutlass.select_(b, ri * Float32(2.0**-64), ri) for b, ri in zip(big, r)]
    return [cutlass.select_(d == Float32(math.inf), Float32(0.0), ri) for d, ri in zip(ds, r)]


@cute.jit
def ordered_key(x: Float32) -> Uint32:
    """An unsigned integer with the order of the float ``x`` (not NaN): negative values have
    every bit flipped, others the sign bit set; -0.0 maps to +0.0's key (they compare equal)."""
    u = f32_bits(x)
    flip = cutlass.select_(Int32(u) < 0, Uint32(0xFFFFFFFF), Uint32(0x80000000))
    return cutlass.select_(x == Float32(0.0), Uint32(0x80000000), u ^ flip)


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    num_experts: int = 256
    n_group: int = 8
    topk_group: int = 4
    top_k: int = 8
    routed_scaling_factor: float = 2.5
    tile_m: int = 128
    #: the expert score: "sigmoid" (DeepSeek-V3) or "sqrtsoftplus" (DeepSeek-V4)
    score: str = "sigmoid"
    #: experts from a token-id table instead of a top-k (DeepSeek-V4's hash-routed layers)
    hash_routed: bool = False

    def validate(self) -> None:
        E, G, TG, k, tile = self.num_experts, self.n_group, self.topk_group, self.top_k, self.tile_m
        for name in ("num_experts", "n_group", "topk_group", "top_k", "tile_m"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"router: {name} must be a positive int, got {v!r}")
        if E % G:
            raise ValueError(f"router: num_experts={E} is not divisible by n_group={G}")
        if TG > G:
            raise ValueError(f"router: topk_group={TG} exceeds n_group={G}")
        if k > TG * (E // G):
            raise ValueError(f"router: top_k={k} exceeds the {TG * (E // G)} experts in the kept groups")
        if E % 32 or E > 512:
            raise ValueError(f"router: num_experts={E} must be a multiple of 32 and <= 512 for the kernel")
        if 32 % G:
            raise ValueError(f"router: n_group={G} must divide 32 for the kernel")
        if G > 1 and E // G < 2:
            raise ValueError("router: groups need at least 2 experts (group score is a top-2 sum)")
        if k > 32:
            raise ValueError(f"router: top_k={k} must be <= 32")
        if tile & (tile - 1) or tile > 1024:
            raise ValueError(f"router: tile_m={tile} must be a power of two <= 1024")
        if self.hash_routed and self.n_group != 1:
            raise ValueError(f"router: hash_routed picks experts from a table, without groups (n_group={G})")
        if self.score not in SCORES:
            raise ValueError(f"router: score={self.score!r}, expected one of {SCORES}")
        if not isinstance(self.routed_scaling_factor, (int, float)) or not math.isfinite(self.routed_scaling_factor):
            raise ValueError(f"router: routed_scaling_factor must be a finite float, got {self.routed_scaling_factor!r}")


#: DeepSeek-V4's routers (no group stage, top-6, sqrt-softplus scores)
V4_FLASH_ROUTER = RouterConfig(num_experts=256, n_group=1, topk_group=1, top_k=6, routed_scaling_factor=1.5,
                               score="sqrtsoftplus")
V4_PRO_ROUTER = RouterConfig(num_experts=384, n_group=1, topk_group=1, top_k=6, routed_scaling_factor=2.5,
                             score="sqrtsoftplus")
#: ... and their hash-routed first MoE layers
V4_FLASH_HASH_ROUTER = dataclasses.replace(V4_FLASH_ROUTER, hash_routed=True)
V4_PRO_HASH_ROUTER = dataclasses.replace(V4_PRO_ROUTER, hash_routed=True)


def capacity(cfg: RouterConfig, max_tokens: int) -> tuple[int, int]:
    """(sorted_token_ids slots, tile_expert entries) that hold any T <= max_tokens."""
    rows = max_tokens * cfg.top_k
    slots = rows + min(cfg.num_experts, rows) * (cfg.tile_m - 1)
    slots = -(-slots // cfg.tile_m) * cfg.tile_m
    return slots, slots // cfg.tile_m


#: MoeRouter's one int32 buffer (:func:`buffer_layout`): these pieces first, their places fixed
#: by E alone (the buffer entry computes them at compile time), then the rest, sized by max_tokens
_BUFFER_HEAD = ("workspace", "expert_counts", "expert_offsets", "total_rows")


def _round4(n: int) -> int:
    return -(-n // 4) * 4


def _buffer_head(E: int) -> tuple[dict[str, tuple[int, int]], int]:
    """``(name -> (offset, length))`` in int32 elements of the _BUFFER_HEAD pieces, and the
    offset of what follows them."""
    at, head = 0, {}
    for name, n in zip(_BUFFER_HEAD, (E + 1, E, E + 1, 1)):
        head[name] = (at, n)
        at += _round4(n)
    return head, at


def buffer_layout(cfg: RouterConfig, max_tokens: int) -> tuple[dict[str, tuple[int, int]], int]:
    """Where :class:`MoeRouter` keeps its outputs and workspace in one int32 buffer: ``(name ->
    (offset, length) in int32 elements, total length)``; every piece starts on a 16-byte
    boundary. One buffer lets its eager calls hand the kernel one tensor instead of nine."""
    slots, tiles = capacity(cfg, max_tokens)
    rows = max_tokens * cfg.top_k
    layout, at = _buffer_head(cfg.num_experts)
    for name, n in (("sorted_token_ids", slots), ("tile_expert", tiles), ("topk_ids", rows),
                    ("topk_weights", rows), ("routed_row_pos", rows)):
        layout[name] = (at, n)
        at += _round4(n)
    return layout, at


def topk_torch(logits: torch.Tensor, bias: torch.Tensor | None, cfg: RouterConfig,
               tid2eid: torch.Tensor | None = None, token_ids: torch.Tensor | None = None):
    """The router's selection in PyTorch ops (the ``base`` arm's separate kernels, the custom
    op's CPU kernel): ``(ids [T, k] int64, weights [T, k] fp32)`` by the rule in the module
    docstring -- the kernel's sqrt(softplus) formula, ties to the lower index, the weight sum in
    selection order. Hash-routed configs take ``tid2eid`` and ``token_ids``. Sync-free."""
    T, E = logits.shape
    x = logits.float()
    s = torch.sigmoid(x) if cfg.score == "sigmoid" else torch.sqrt(x.clamp_min(0) + torch.log1p(torch.exp(-x.abs())))
    if cfg.hash_routed:
        ids = tid2eid[token_ids.long().clamp(0, tid2eid.shape[0] - 1)].long()
    else:
        b = s + bias.float() if bias is not None else s.clone()
        if cfg.n_group > 1:
            G, gs = cfg.n_group, E // cfg.n_group
            top2 = torch.sort(b.view(T, G, gs), dim=-1, descending=True, stable=True).values[..., :2]
            keep_g = torch.sort(top2[..., 0] + top2[..., 1], dim=-1, descending=True, stable=True).indices
            keep = torch.zeros(T, G, dtype=torch.bool, device=x.device).scatter_(1, keep_g[:, :cfg.topk_group], True)
            b = torch.where(keep.repeat_interleave(gs, 1), b, torch.full_like(b, float("-inf")))
        ids = torch.sort(b, dim=-1, descending=True, stable=True).indices[:, :cfg.top_k]
    w = s.gather(1, ids)
    tot = w[:, 0].clone()
    for i in range(1, cfg.top_k):  # the kernel's summation order
        tot = tot + w[:, i]
    return ids, w / (tot[:, None] + 1e-20) * cfg.routed_scaling_factor


def align_torch(ids: torch.Tensor, num_experts: int, tile_m: int, slots: int, tiles: int):
    """``moe_align_block_size`` in PyTorch ops (sync-free): ``(expert_counts [E],
    expert_offsets [E + 1], sorted_token_ids [slots], tile_expert [tiles], total_rows [1],
    routed_row_pos [T k])``, int32, the packed layout of the module docstring (rows of one
    expert in increasing order, padding slots the sentinel ``T k``, tiles past the total -1)."""
    dev = ids.device
    flat = ids.flatten().long()
    n = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + tile_m - 1) // tile_m * tile_m
    offsets = torch.zeros(num_experts + 1, dtype=torch.long, device=dev)
    offsets[1:] = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[flat[order]]
    pos = torch.empty_like(flat).scatter_(0, order, offsets[flat[order]] + rank)
    sorted_ids = torch.full((slots,), n, dtype=torch.long, device=dev).scatter_(0, pos, torch.arange(n, device=dev))
    start = torch.arange(tiles, device=dev) * tile_m
    te = torch.searchsorted(offsets[1:], start, right=True)
    te = torch.where(start < offsets[-1], te, torch.full_like(te, -1))
    i32 = torch.int32
    return (counts.to(i32), offsets.to(i32), sorted_ids.to(i32), te.to(i32), offsets[-1:].to(i32), pos.to(i32))


class RouterTopkAlign:
    """Compile-time configuration of the fused router kernel."""

    def __init__(self, cfg: RouterConfig, logits_dtype, has_bias: bool, threads: int = 512, max_ctas: int = 132,
                 single_cta: bool = False, cluster: int = 0, pdl: bool = False):
        self.E, self.G, self.TG, self.k = cfg.num_experts, cfg.n_group, cfg.topk_group, cfg.top_k
        self.tile = cfg.tile_m
        self.scale = float(cfg.routed_scaling_factor)
        self.score = cfg.score
        self.hash_routed = cfg.hash_routed
        self.logits_dtype = logits_dtype
        self.has_bias = has_bias
        self.threads = threads
        self.warps = threads // 32
        self.max_ctas = max_ctas
        self.V = self.E // 32  # experts per lane
        self.L = 32 // self.G  # lanes per group
        self.single_cta = single_cta  # T <= SINGLE_CTA_MAX_TOKENS: one CTA, counts and ids in shared memory
        self.cluster = cluster  # > 0: the cluster path, this many CTAs of one cluster (T <= cluster * warps)
        self.pdl = pdl  # a programmatic dependent launch: the set-up before the previous kernel completes

    @cute.jit
    def __call__(self, logits_ptr: cute.Pointer, bias_ptr: cute.Pointer, ids_ptr: cute.Pointer,
                 w_ptr: cute.Pointer, counts_ptr: cute.Pointer, offsets_ptr: cute.Pointer,
                 sorted_ptr: cute.Pointer, tile_expert_ptr: cute.Pointer, total_ptr: cute.Pointer,
                 ws_ptr: cute.Pointer, pos_ptr: cute.Pointer, tok_ptr: cute.Pointer, table_ptr: cute.Pointer,
                 num_tokens: Int32, sorted_cap: Int32, tiles_cap: Int32, vocab: Int32, stream: cuda.CUstream):
        E, k = self.E, self.k
        mLogits = cute.make_tensor(logits_ptr, cute.make_layout((num_tokens, E), stride=(E, 1)))
        mBias = cute.make_tensor(bias_ptr, cute.make_layout((E,)))
        mIds = cute.make_tensor(ids_ptr, cute.make_layout((num_tokens, k), stride=(k, 1)))
        mW = cute.make_tensor(w_ptr, cute.make_layout((num_tokens, k), stride=(k, 1)))
        mCounts = cute.make_tensor(counts_ptr, cute.make_layout((E,)))
        mOffsets = cute.make_tensor(offsets_ptr, cute.make_layout((E + 1,)))
        mSorted = cute.make_tensor(sorted_ptr, cute.make_layout((sorted_cap,)))
        mTileExpert = cute.make_tensor(tile_expert_ptr, cute.make_layout((tiles_cap,)))
        mTotal = cute.make_tensor(total_ptr, cute.make_layout((1,)))
        mWs = cute.make_tensor(ws_ptr, cute.make_layout((E + 1,)))
        mPos = cute.make_tensor(pos_ptr, cute.make_layout((num_tokens * k,)))
        mTok = cute.make_tensor(tok_ptr, cute.make_layout((num_tokens,)))  # hash routing only
        mTable = cute.make_tensor(table_ptr, cute.make_layout((vocab, k), stride=(k, 1)))
        grid = cutlass.min((num_tokens + self.warps - 1) // self.warps, self.max_ctas)
        if cutlass.const_expr(self.single_cta):
            grid = 1
        kernel = self.kernel(mLogits, mBias, mIds, mW, mCounts, mOffsets, mSorted, mTileExpert, mTotal, mWs, mPos,
                             mTok, mTable, num_tokens, tiles_cap, vocab)
        if cutlass.const_expr(self.cluster > 0):  # one cluster: every CTA of it, whatever T
            kernel.launch(grid=[self.cluster, 1, 1], block=[self.threads, 1, 1], cluster=(self.cluster, 1, 1),
                          stream=stream, use_pdl=self.pdl)
        else:
            kernel.launch(grid=[grid, 1, 1], block=[self.threads, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.jit
    def tensor_call(self, mLogits: cute.Tensor, mBias: cute.Tensor, mTok: cute.Tensor, mTable: cute.Tensor,
                    mIds: cute.Tensor, mW: cute.Tensor, mCounts: cute.Tensor, mOffsets: cute.Tensor,
                    mSorted: cute.Tensor, mTileExpert: cute.Tensor, mTotal: cute.Tensor, mWs: cute.Tensor,
                    mPos: cute.Tensor, stream: cuda.CUstream):
        """The tensor entry (``jit.get_tensor_kernel``): ``mLogits [T, E]``, ``mBias [E]``,
        ``mTok [T]`` and ``mTable [vocab, k]`` (hash routing; stand-ins otherwise, as is ``mBias``
        without a bias), then the outputs and workspace of :class:`RouterOutput` (``mPos [T k]``
        and the capacities of ``mSorted`` / ``mTileExpert``: checked by the caller)."""
        self.__call__(mLogits.iterator, mBias.iterator, mIds.iterator, mW.iterator, mCounts.iterator,
                      mOffsets.iterator, mSorted.iterator, mTileExpert.iterator, mTotal.iterator, mWs.iterator,
                      mPos.iterator, mTok.iterator, mTable.iterator, mLogits.shape[0], mSorted.shape[0],
                      mTileExpert.shape[0], mTable.shape[0], stream)

    @cute.jit
    def buffer_call(self, mLogits: cute.Tensor, mBias: cute.Tensor, mBuf: cute.Tensor, sorted_cap: Int32,
                    tiles_at: Int32, tiles_cap: Int32, ids_at: Int32, w_at: Int32, pos_at: Int32,
                    stream: cuda.CUstream):
        """The buffer entry of a scored router (:class:`MoeRouter`'s eager calls): ``mLogits
        [T, E]``, ``mBias [E]`` (a stand-in without a bias) and the outputs and workspace in
        one int32 buffer ``mBuf`` at :func:`buffer_layout`'s offsets (the head's fixed by E,
        the rest passed)."""
        b = mBuf.iterator
        self.buffer_launch(mLogits, mBias.iterator, b + ids_at, b, b, 1, b, sorted_cap, tiles_at, tiles_cap, w_at,
                           pos_at, stream)

    @cute.jit
    def hashed_buffer_call(self, mLogits: cute.Tensor, mTok: cute.Tensor, mTable: cute.Tensor, mBuf: cute.Tensor,
                           sorted_cap: Int32, tiles_at: Int32, tiles_cap: Int32, ids_at: Int32, w_at: Int32,
                           pos_at: Int32, stream: cuda.CUstream):
        """:meth:`buffer_call` of a hash-routed router: ``mTok [T]`` and ``mTable [vocab, k]``
        instead of the bias."""
        b = mBuf.iterator
        self.buffer_launch(mLogits, cute.recast_ptr(b, dtype=Float32), b + ids_at, mTok.iterator, mTable.iterator,
                           mTable.shape[0], b, sorted_cap, tiles_at, tiles_cap, w_at, pos_at, stream)

    @cute.jit
    def buffer_launch(self, mLogits: cute.Tensor, bias_ptr: cute.Pointer, ids_ptr: cute.Pointer,
                      tok_ptr: cute.Pointer, table_ptr: cute.Pointer, vocab: Int32, b: cute.Pointer,
                      sorted_cap: Int32, tiles_at: Int32, tiles_cap: Int32, w_at: Int32, pos_at: Int32,
                      stream: cuda.CUstream):
        """The pointer launch on the buffer ``b``'s pieces: the head's at their fixed offsets,
        the rest at the offsets passed."""
        head, sorted_at = _buffer_head(self.E)
        at = {name: off for name, (off, _) in head.items()}
        self.__call__(mLogits.iterator, bias_ptr, ids_ptr, cute.recast_ptr(b + w_at, dtype=Float32),
                      b + at["expert_counts"], b + at["expert_offsets"], b + sorted_at, b + tiles_at,
                      b + at["total_rows"], b + at["workspace"], b + pos_at, tok_ptr, table_ptr,
                      mLogits.shape[0], sorted_cap, tiles_cap, vocab, stream)

    @cute.kernel
    def kernel(self, mLogits: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor, mW: cute.Tensor,
               mCounts: cute.Tensor, mOffsets: cute.Tensor, mSorted: cute.Tensor, mTileExpert: cute.Tensor,
               mTotal: cute.Tensor, mWs: cute.Tensor, mPos: cute.Tensor, mTok: cute.Tensor, mTable: cute.Tensor,
               num_tokens: Int32, tiles_cap: Int32, vocab: Int32):
        E, V, k, W = self.E, self.V, self.k, self.warps
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp, lane = cute.arch.warp_idx(), cute.arch.lane_idx()
        neg_inf = Float32(-math.inf)

        if cutlass.const_expr(self.pdl):
            # the next kernel on the stream may start its own set-up now (its reads of this
            # kernel's outputs wait for this grid to complete)
            cute.arch.griddepcontrol_launch_dependents()
        smem = cutlass.memory.SmemAllocator()
        sOff = smem.allocate_tensor(Int32, cute.make_layout((E + 1,)), 16)
        if cutlass.const_expr(self.single_cta):
            # the picks, and per expert the mask of tokens that picked it (T <= 64: one bit each)
            sIds = smem.allocate_tensor(Int32, cute.make_layout((SINGLE_CTA_CAPACITY, k), stride=(k, 1)), 16)
            sTokMask = smem.allocate_tensor(Uint32, cute.make_layout((2, E), stride=(E, 1)), 16)  # tokens 0-31, 32-63
            for e in cutlass.range(tidx, 2 * E, self.threads):
                sTokMask[e] = Uint32(0)
            cute.arch.barrier()
        elif cutlass.const_expr(self.cluster > 0):
            # every CTA of the cluster ends with all its picks and per-expert token masks (word c:
            # CTA c's tokens, bit w: its warp w's token), gathered from the others' stores
            sIds = smem.allocate_tensor(Int32, cute.make_layout((self.cluster * W, k), stride=(k, 1)), 16)
            sTokMask = smem.allocate_tensor(Uint32, cute.make_layout((self.cluster, E), stride=(E, 1)), 16)
            sMyIds = smem.allocate_tensor(Int32, cute.make_layout((W, k), stride=(k, 1)), 16)
            sMyW = smem.allocate_tensor(Float32, cute.make_layout((W, k), stride=(k, 1)), 16)
            sMyMask = smem.allocate_tensor(Uint32, cute.make_layout((E,)), 16)
            sCnt = smem.allocate_tensor(Int32, cute.make_layout((E,)), 16)  # the counts, from the masks
            mbar = smem.allocate_tensor(cutlass.Int64, cute.make_layout((1,)), 8)  # counts the bytes sent here
            if tidx == 0:
                cute.arch.mbarrier_init(mbar.iterator, 1)
                cute.arch.mbarrier_init_fence()
            cute.arch.cluster_arrive_relaxed()  # (its wait, before the first remote store: all CTAs running)
            for e in cutlass.range(tidx, E, self.threads):
                sMyMask[e] = Uint32(0)
            cute.arch.barrier()
        else:
            sCnt = smem.allocate_tensor(Int32, cute.make_layout((E,)), 16)
            sCursor = smem.allocate_tensor(Int32, cute.make_layout((E,)), 16)
            sMask = smem.allocate_tensor(Uint32, cute.make_layout((W, E), stride=(E, 1)), 16)
            sPre = smem.allocate_tensor(Int32, cute.make_layout((W, E), stride=(E, 1)), 16)
            sFlag = smem.allocate_tensor(Int32, cute.make_layout((1,)), 4)

        # ---------------- stage 1: route tokens, one warp per token ----------------------
        rBias = cute.make_rmem_tensor(cute.make_layout((V,)), Float32)
        rBias.fill(0.0)
        if cutlass.const_expr(self.has_bias):
            for j in cutlass.range_constexpr(V):
                rBias[j] = mBias[lane * V + j]
        if cutlass.const_expr(self.pdl):
            # Everything above -- shared memory, the cluster's arrival, the bias (a weight: no
            # kernel of the step writes it) -- ran while the previous kernel finished; the
            # logits (and token ids), and every global store below, wait for its grid.
            cute.arch.griddepcontrol_wait()
        gL = cute.zipped_divide(mLogits, (1, V))  # ((1, V), (T, 32))
        for t in cutlass.range(bidx * W + warp, num_tokens, grid * W):
            rL = cute.make_rmem_tensor(cute.make_layout((V,)), mLogits.element_type)
            cute.autovec_copy(gL[(0, None), (t, lane)], rL)
            rS = cute.make_rmem_tensor(cute.make_layout((V,)), Float32)
            rCand = cute.make_rmem_tensor(cute.make_layout((V,)), Float32)
            scores = self.scores_of([Float32(rL[j]) for j in range(V)])
            for j in cutlass.range_constexpr(V):
                s = scores[j]
                rS[j] = s
                c = s + rBias[j]
                # a NaN candidate ranks above every number (torch.sort's order): +inf here, so
                # every comparison below stays ordered and a pick is always a real expert
                rCand[j] = cutlass.select_(c != c, Float32(math.inf), c)
            my_tab = Int32(0)  # hash routing: lane i < k holds the token's i-th expert
            if cutlass.const_expr(self.hash_routed):
                tok = cutlass.max(cutlass.min(mTok[t], vocab - 1), Int32(0))  # never read past the table
                if lane < k:
                    my_tab = mTable[tok, lane]
            if cutlass.const_expr(self.G > 1):
                # Top-2 of the lane's experts, then merged across the lanes of the group.
                a1, a2 = neg_inf, neg_inf
                for j in cutlass.range_constexpr(V):
                    v = rCand[j]
                    a2 = cutlass.select_(v > a1, a1, cutlass.max(a2, v))
                    a1 = cutlass.max(a1, v)
                off = 1
                while cutlass.const_expr(off < self.L):
                    o1 = cute.arch.shuffle_sync_bfly(a1, offset=off)
                    o2 = cute.arch.shuffle_sync_bfly(a2, offset=off)
                    a2 = cutlass.max(cutlass.min(a1, o1), cutlass.max(a2, o2))
                    a1 = cutlass.max(a1, o1)
                    off *= 2
                gscore = a1 + a2
                my_group = lane // self.L
                rank = Int32(0)
                for g in cutlass.range_constexpr(self.G):
                    og = cute.arch.shuffle_sync(gscore, g * self.L)
                    beats = cutlass.select_(og > gscore, Int32(1),
                                            cutlass.select_(og == gscore, cutlass.select_(my_group > g, Int32(1), Int32(0)),
                                                            Int32(0)))
                    rank += beats
                for j in cutlass.range_constexpr(V):
                    rCand[j] = cutlass.select_(rank < self.TG, rCand[j], neg_inf)

            my_id = Int32(0)
            my_s = Float32(0.0)
            ssum = Float32(0.0)
            for i in cutlass.range_constexpr(k):
                if cutlass.const_expr(self.hash_routed):
                    bi = cute.arch.shuffle_sync(my_tab, i)
                    sv = Float32(0.0)
                    for j in cutlass.range_constexpr(V):
                        sv = cutlass.select_(bi == lane * V + j, rS[j], sv)
                    sw = cute.arch.shuffle_sync(sv, bi // V)
                else:
                    # The lane's best (a tie within the lane to the lower index), then the
                    # warp's: one redux of order-preserving keys, and the lowest lane
                    # holding the maximum (its experts have the lower indices) wins a tie.
                    bv, bj, bs = self.lane_best(rCand, rS)
                    key = ordered_key(bv)
                    best = cute.arch.warp_redux_sync(key, "umax")
                    src = Int32(cute.arch.clz(cute.arch.brev(Uint32(cute.arch.vote_ballot_sync(key == best)))))
                    bi = cute.arch.shuffle_sync(lane * V + bj, src)
                    sw = cute.arch.shuffle_sync(bs, src)
                    for j in cutlass.range_constexpr(V):
                        rCand[j] = cutlass.select_((lane == src) & (bj == j), neg_inf, rCand[j])
                ssum = ssum + sw
                my_id = cutlass.select_(lane == i, bi, my_id)
                my_s = cutlass.select_(lane == i, sw, my_s)
            if lane < k:
                weight = my_s / (ssum + Float32(1e-20)) * Float32(self.scale)
                if cutlass.const_expr(self.cluster == 0):
                    mIds[t, lane] = my_id
                    mW[t, lane] = weight
                if cutlass.const_expr(self.single_cta):
                    sIds[t, lane] = my_id
                    cute.arch.atomic_or((sTokMask.iterator + (t >> 5) * E + my_id).llvm_ptr,
                                        Uint32(1) << Uint32(t & 31), sem="relaxed", scope="cta")
                elif cutlass.const_expr(self.cluster > 0):
                    # (t = bidx * W + warp: one token per warp) ids and weights go to global memory
                    # beside the exchange below
                    sMyIds[warp, lane] = my_id
                    sMyW[warp, lane] = weight
                    cute.arch.atomic_or((sMyMask.iterator + my_id).llvm_ptr, Uint32(1) << Uint32(warp),
                                        sem="relaxed", scope="cta")
                else:
                    cute.arch.atomic_add((mWs.iterator + my_id).llvm_ptr, Int32(1), sem="relaxed", scope="gpu")

        # ---------------- padded, packed layout -------------------------------------------
        if cutlass.const_expr(self.single_cta):
            # the CTA's own picks and token masks, in shared memory: one barrier, no grid handshake
            cute.arch.barrier()
            self.align_single_cta(sIds, sTokMask, mCounts, mOffsets, mSorted, mTileExpert, mTotal, mPos, sOff,
                                  num_tokens, tiles_cap)
        elif cutlass.const_expr(self.cluster > 0):
            cute.arch.barrier()  # this CTA's picks and masks are in
            cute.arch.cluster_wait()  # every CTA of the cluster is running: its shared memory takes stores
            if tidx == 0:  # every CTA's mask words and its live tokens' picks come here
                cute.arch.mbarrier_arrive_and_expect_tx(mbar.iterator, (self.cluster * E + num_tokens * k) * 4)
            for q in cutlass.range(tidx, E // 4, self.threads):  # every word, zeros included: no remote init
                for d in cutlass.range_constexpr(self.cluster):
                    store_async_to_cta_x4(sTokMask.iterator + bidx * E + 4 * q, Int32(d), sMyMask[4 * q],
                                          sMyMask[4 * q + 1], sMyMask[4 * q + 2], sMyMask[4 * q + 3], mbar.iterator)
            for idx in cutlass.range(tidx, W * k, self.threads):
                w = idx // k
                t = bidx * W + w
                if t < num_tokens:
                    for d in cutlass.range_constexpr(self.cluster):
                        store_async_to_cta(sIds.iterator + bidx * W * k + idx, Int32(d), Uint32(sMyIds[w, idx - w * k]),
                                           mbar.iterator)
                    mIds[t, idx - w * k] = sMyIds[w, idx - w * k]  # this CTA's tokens' ids and weights
                    mW[t, idx - w * k] = sMyW[w, idx - w * k]
            cute.arch.mbarrier_wait(mbar.iterator, 0)  # every CTA's stores are here
            self.align_cluster(sIds, sTokMask, sCnt, mCounts, mOffsets, mSorted, mTileExpert, mTotal, mPos, sOff,
                               num_tokens, tiles_cap, bidx)
        else:
            # The last CTA sees every CTA's ids / weights / count atomics (cute_kernels.grid_sync).
            if last_arrival(mWs.iterator + E, sFlag, grid):
                self.align(mIds, mCounts, mOffsets, mSorted, mTileExpert, mTotal, mWs, mPos, sOff, sCnt, sCursor,
                           sMask, sPre, num_tokens, tiles_cap)

    def lane_best(self, rCand, rS):
        """``(value, j, score)`` of the lane's best candidate ``rCand[j]`` (the lowest ``j``
        among equal values) by a pairwise tree: ``log2 V`` dependent compare-selects instead of
        ``V`` in a running maximum -- each pick of the top-k waits on it. (Plain Python, not
        ``@cute.jit``: the tree unrolls as the kernel is traced.) A pair keeps its right
        (higher-index) element only when strictly greater, and every left subtree holds lower
        indices than its right one, so ties go to the lower index at every level."""
        level = [(rCand[j], Int32(j), rS[j]) for j in range(self.V)]
        while len(level) > 1:
            merged = []
            for a in range(0, len(level) - 1, 2):
                (lv, lj, ls), (rv, rj, rs) = level[a], level[a + 1]
                take = rv > lv
                merged.append((cutlass.select_(take, rv, lv), cutlass.select_(take, rj, lj),
                               cutlass.select_(take, rs, ls)))
            if len(level) % 2:
                merged.append(level[-1])
            level = merged
        return level[0]

    def scores_of(self, xs: list) -> list:
        """The expert scores of the lane's logits ``xs`` (FP32), step by step over all of them:
        ``sqrt(max(x, 0) + log1p(exp(-|x|)))`` or ``1 / (1 + exp(-x))``, the root and reciprocal
        correctly rounded without branches (:func:`sqrt_rn`, :func:`rcp_rn_from_one`). (Traced
        inline.)"""
        if cutlass.const_expr(self.score == "sqrtsoftplus"):
            e = [cute.math.exp(-cute.math.absf(x)) for x in xs]
            return sqrt_rn([cutlass.max(x, Float32(0.0)) + lg for x, lg in zip(xs, log1p_unit(e))])
        return rcp_rn_from_one([Float32(1.0) + cute.math.exp(-x) for x in xs])

    @cute.jit
    def align_single_cta(self, sIds, sTokMask, mCounts, mOffsets, mSorted, mTileExpert, mTotal, mPos, sOff,
                         num_tokens: Int32, tiles_cap: Int32):
        """The padded, packed layout from the single-CTA path's picks ``sIds [T, k]`` and token
        masks ``sTokMask[:, e]`` (bit t of the 64 in two words: token t picked expert e). A token
        picks an expert at most once, so routed row ``t k + i`` of expert ``e`` has rank
        ``popc(mask_e & (2^t - 1))`` among that expert's rows, in row order: no ballots, no
        cross-warp prefix."""
        E, k = self.E, self.k
        tidx, _, _ = cute.arch.thread_idx()
        if cute.arch.warp_idx() == 0:
            self.scan_padded_counts(sTokMask, 2, sOff, mTotal)
        cute.arch.barrier()
        total = sOff[E]
        for e in cutlass.range(tidx, E, self.threads):
            mCounts[e] = self.masked_count(sTokMask, 2, e)
            mOffsets[e] = sOff[e]
            self.write_expert_tiles(sOff, mTileExpert, e)
        if tidx == 0:
            mOffsets[E] = total
        self.clear_tiles_past(total, mTileExpert, tiles_cap, tidx, self.threads)
        self.fill_sentinels(mSorted, total, num_tokens * k)
        cute.arch.barrier()  # sentinels land before the live slots are written
        for r in cutlass.range(tidx, num_tokens * k, self.threads):
            t = r // k
            e = sIds[t, r - t * k]
            below = (Uint32(1) << Uint32(t & 31)) - Uint32(1)  # the tokens before t in its word
            hi = t >= 32
            rank = Int32(cute.arch.popc(sTokMask[0, e] & cutlass.select_(hi, Uint32(0xFFFFFFFF), below)))
            rank += Int32(cute.arch.popc(sTokMask[1, e] & cutlass.select_(hi, below, Uint32(0))))
            pos = sOff[e] + rank
            mSorted[pos] = r
            mPos[r] = pos

    @cute.jit
    def scan_padded_counts(self, counts, mask_words: cutlass.Constexpr, sOff, mTotal):
        """Warp 0: ``sOff`` = exclusive scan of the tile-padded counts (lane l owns experts
        ``[l V, l V + V)``), ``sOff[E]`` and ``mTotal[0]`` the padded total. ``counts[e]`` is
        the count, or (``mask_words`` > 0) ``counts[:mask_words, e]`` words whose set bits are
        counted."""
        E, V, tile = self.E, self.V, self.tile
        lane = cute.arch.lane_idx()
        rLocal = cute.make_rmem_tensor(cute.make_layout((V,)), Int32)
        run = Int32(0)
        for j in cutlass.range_constexpr(V):
            if cutlass.const_expr(mask_words > 0):
                c = self.masked_count(counts, mask_words, lane * V + j)
            else:
                c = counts[lane * V + j]
            rLocal[j] = run
            run += (c + tile - 1) // tile * tile
        incl = run
        for sh in cutlass.range_constexpr(5):
            o = cute.arch.shuffle_sync_up(incl, offset=1 << sh)
            incl += cutlass.select_(lane >= (1 << sh), o, Int32(0))
        excl = incl - run
        for j in cutlass.range_constexpr(V):
            sOff[lane * V + j] = excl + rLocal[j]
        if lane == 31:
            sOff[E] = incl
            mTotal[0] = incl

    @cute.jit
    def fill_sentinels(self, mSorted, total: Int32, sentinel: Int32):
        """``mSorted[0:total] = sentinel`` by the whole CTA (16-byte stores when ``tile % 4 == 0``:
        ``total`` is a multiple of ``tile``)."""
        tidx, _, _ = cute.arch.thread_idx()
        if cutlass.const_expr(self.tile % 4 == 0):
            gSorted4 = cute.zipped_divide(mSorted, (4,))
            rSent = cute.make_rmem_tensor(cute.make_layout((4,)), Int32)
            rSent.fill(sentinel)
            for p in cutlass.range(tidx, total // 4, self.threads):
                cute.autovec_copy(rSent, gSorted4[(None, p)])
        else:
            for p in cutlass.range(tidx, total, self.threads):
                mSorted[p] = sentinel

    @cute.jit
    def fill_padding(self, mSorted, lo: Int32, hi: Int32, sentinel: Int32, lane: Int32):
        """``mSorted[lo:hi] = sentinel`` by one warp, for one expert's padding (``hi`` a multiple
        of ``tile``, ``hi - lo < tile``): with ``tile % 4 == 0``, up to three single slots to the
        first 16-byte boundary, then 16-byte stores -- with ``tile <= 128`` at most 31 of them,
        one per lane and no loop."""
        if cutlass.const_expr(self.tile % 4 == 0):
            head = cutlass.min((lo + 3) // 4 * 4, hi)
            if lane < head - lo:
                mSorted[lo + lane] = sentinel
            gSorted4 = cute.zipped_divide(mSorted, (4,))
            rSent = cute.make_rmem_tensor(cute.make_layout((4,)), Int32)
            rSent.fill(sentinel)
            if cutlass.const_expr(self.tile <= 128):
                if head // 4 + lane < hi // 4:
                    cute.autovec_copy(rSent, gSorted4[(None, head // 4 + lane)])
            else:
                for q in cutlass.range(head // 4 + lane, hi // 4, 32):
                    cute.autovec_copy(rSent, gSorted4[(None, q)])
        else:
            for p in cutlass.range(lo + lane, hi, 32):
                mSorted[p] = sentinel

    @cute.jit
    def masked_count(self, masks, words: cutlass.Constexpr, e: Int32) -> Int32:
        """Tokens that picked expert ``e``: the set bits of ``masks[0:words, e]``."""
        c = Int32(0)
        for w in cutlass.range_constexpr(words):
            c += Int32(cute.arch.popc(masks[w, e]))
        return c

    @cute.jit
    def write_expert_tiles(self, sOff, mTileExpert, e: Int32):
        """``tile_expert`` for expert ``e``'s M-tiles, from its padded offsets (none for an empty
        expert): every path's tile table, one expert at a time, no search over the offsets."""
        for j in cutlass.range(sOff[e] // self.tile, sOff[e + 1] // self.tile):
            mTileExpert[j] = e

    @cute.jit
    def clear_tiles_past(self, total: Int32, mTileExpert, tiles_cap: Int32, first: Int32, stride: Int32):
        """``tile_expert[j] = -1`` for the tiles past the padded ``total``: this thread's
        ``first, first + stride, ...`` of them."""
        for j in cutlass.range(total // self.tile + first, tiles_cap, stride):
            mTileExpert[j] = Int32(-1)

    @cute.jit
    def align_cluster(self, sIds, sTokMask, sCnt, mCounts, mOffsets, mSorted, mTileExpert, mTotal, mPos, sOff,
                      num_tokens: Int32, tiles_cap: Int32, rank: Int32):
        """The cluster path's padded, packed layout, a share of it in each CTA (``rank``): every
        CTA holds all the picks ``sIds [T, k]`` and token masks ``sTokMask[c, e]`` (bit w: token
        ``c W + w`` picked expert e), counts them (``sCnt``, the whole CTA) and scans the counts
        itself (warp 0); the CTAs then split the experts' counts and offsets, the M-tiles'
        experts (each expert's tiles, from its offsets), the padding slots (a warp per expert:
        the slots of its last tile past its rows) and the routed rows (each at its expert's
        offset plus its rank among the expert's rows, ``popc`` of the masks before it).
        Padding and live slots are disjoint, so no ordering between the CTAs is needed."""
        E, k, C, W = self.E, self.k, self.cluster, self.warps
        tidx, _, _ = cute.arch.thread_idx()
        warp, lane = cute.arch.warp_idx(), cute.arch.lane_idx()
        for e in cutlass.range(tidx, E, self.threads):
            sCnt[e] = self.masked_count(sTokMask, C, e)
        cute.arch.barrier()
        if warp == 0:
            self.scan_padded_counts(sCnt, 0, sOff, mTotal)  # (every CTA writes the same total)
        cute.arch.barrier()
        total = sOff[E]
        first, stride = rank * self.threads + tidx, C * self.threads
        for e in cutlass.range(first, E, stride):
            mCounts[e] = sCnt[e]
            mOffsets[e] = sOff[e]
            self.write_expert_tiles(sOff, mTileExpert, e)
        if first == 0:
            mOffsets[E] = total
        self.clear_tiles_past(total, mTileExpert, tiles_cap, first, stride)
        sentinel = num_tokens * k
        for j in cutlass.range_constexpr(-(-E // (C * W))):  # a warp an expert: its last tile's padding
            e = rank * W + warp + j * C * W  # (unrolled: the experts' loads overlap)
            if e < E:
                self.fill_padding(mSorted, sOff[e] + sCnt[e], sOff[e + 1], sentinel, lane)
        for r in cutlass.range(first, num_tokens * k, stride):
            t = r // k
            e = sIds[t, r - t * k]
            c_t = t // W  # the CTA that routed token t; its bit in that CTA's word: t - c_t W
            below = (Uint32(1) << Uint32(t - c_t * W)) - Uint32(1)
            before = Int32(0)  # the expert's rows of earlier tokens: whole earlier words, then t's own
            for c in cutlass.range_constexpr(C):
                word = sTokMask[c, e]
                before += cutlass.select_(Int32(c) < c_t, Int32(cute.arch.popc(word)),
                                          cutlass.select_(Int32(c) == c_t, Int32(cute.arch.popc(word & below)),
                                                          Int32(0)))
            pos = sOff[e] + before
            mSorted[pos] = r
            mPos[r] = pos

    @cute.jit
    def align(self, mIds, mCounts, mOffsets, mSorted, mTileExpert, mTotal, mWs, mPos, sOff, sCnt, sCursor, sMask,
              sPre, num_tokens: Int32, tiles_cap: Int32):
        """The grid path's padded, packed layout (last CTA) from every CTA's picks ``mIds [T, k]``
        and count atomics ``mWs``; zeroes ``mWs`` for the next launch."""
        E, V, k, W = self.E, self.V, self.k, self.warps
        tidx, _, _ = cute.arch.thread_idx()
        warp, lane = cute.arch.warp_idx(), cute.arch.lane_idx()
        if warp == 0:
            for j in cutlass.range_constexpr(V):
                sCnt[lane * V + j] = mWs[lane * V + j]  # (each lane reads back its own experts)
            self.scan_padded_counts(sCnt, 0, sOff, mTotal)
        cute.arch.barrier()
        total = sOff[E]
        for e in cutlass.range(tidx, E, self.threads):
            mCounts[e] = sCnt[e]
            mOffsets[e] = sOff[e]
            self.write_expert_tiles(sOff, mTileExpert, e)
            mWs[e] = 0  # ready for the next launch (graph replay needs no host reset)
            sCursor[e] = 0
        if tidx == 0:
            mOffsets[E] = total
            mWs[E] = 0
        self.clear_tiles_past(total, mTileExpert, tiles_cap, tidx, self.threads)
        self.fill_sentinels(mSorted, total, num_tokens * k)
        # Sentinels land before the scatter below overwrites the live slots.
        cute.arch.barrier()

        for base in cutlass.range(0, num_tokens, W * 32):
            t = base + warp * 32 + lane
            rId = cute.make_rmem_tensor(cute.make_layout((k,)), Int32)
            for i in cutlass.range_constexpr(k):
                rId[i] = E
                if t < num_tokens:
                    rId[i] = mIds[t, i]
            # sMask[warp, e]: bit l set when lane l's token picked expert e -- each pick one
            # shared-memory atomicOr into the warp's own (zeroed) row
            for wd in cutlass.range_constexpr(V):
                sMask[warp, wd * 32 + lane] = Uint32(0)
            cute.arch.sync_warp()
            if t < num_tokens:
                for i in cutlass.range_constexpr(k):
                    cute.arch.atomic_or((sMask.iterator + warp * E + rId[i]).llvm_ptr, Uint32(1) << Uint32(lane),
                                        sem="relaxed", scope="cta")
            cute.arch.barrier()
            for e in cutlass.range(tidx, E, self.threads):
                run = sCursor[e]
                for w in cutlass.range_constexpr(W):
                    sPre[w, e] = run
                    run += Int32(cute.arch.popc(sMask[w, e]))
                sCursor[e] = run
            cute.arch.barrier()
            if t < num_tokens:
                lt = Uint32(cute.arch.lanemask_lt())
                for i in cutlass.range_constexpr(k):
                    e = rId[i]
                    pos = sOff[e] + sPre[warp, e] + Int32(cute.arch.popc(sMask[warp, e] & lt))
                    mSorted[pos] = t * k + i
                    mPos[t * k + i] = pos
            cute.arch.barrier()

    @staticmethod
    def can_implement(cfg: RouterConfig) -> bool:
        try:
            cfg.validate()
        except ValueError:
            return False
        return True


def _build(arch: str, *, num_experts: int, n_group: int, topk_group: int, top_k: int, routed_scaling_factor: float,
           tile_m: int, logits_dtype: str, has_bias: bool, score: str = "sigmoid", hash_routed: bool = False,
           single_cta: bool = False, cluster: int = 0, pdl: bool = False):
    """``single_cta``: the single-CTA path; ``cluster`` (one of CLUSTER_SIZES): the cluster path
    of that many CTAs; neither: the grid path. ``pdl``: a programmatic dependent launch of any
    path (the caller's promise: only the logits and token ids come from the kernels before it
    on the stream)."""
    cfg = RouterConfig(num_experts, n_group, topk_group, top_k, routed_scaling_factor, tile_m, score, hash_routed)
    cfg.validate()
    if cluster not in (0, *CLUSTER_SIZES) or (cluster and single_cta):
        raise ValueError(f"router: cluster={cluster!r} must be 0 or one of {CLUSTER_SIZES}, and not with "
                         f"single_cta")
    cdt = _NAME2CUTE[logits_dtype]
    P = jit.fake_gmem_ptr
    args = (P(cdt, 16), P(Float32, 16), P(Int32, 4), P(Float32, 4), P(Int32, 4), P(Int32, 4), P(Int32, 16),
            P(Int32, 4), P(Int32, 4), P(Int32, 4), P(Int32, 4), P(Int32, 4), P(Int32, 4), Int32(1), Int32(1),
            Int32(1), Int32(1), jit.fake_stream())
    threads = 32 * CLUSTER_CAPACITY // cluster if cluster else 512  # the cluster path: a token per warp
    return RouterTopkAlign(cfg, cdt, has_bias, threads=threads, single_cta=single_cta, cluster=cluster,
                           pdl=pdl), args


def _build_tensors(arch: str, **config):
    op, _ = _build(arch, **config)
    E, k, cdt = config["num_experts"], config["top_k"], _NAME2CUTE[config["logits_dtype"]]
    sym, T = {}, jit.fake_tensor
    args = (T(cdt, ("T", E), 16, sym), T(Float32, (E,), 16, sym), T(Int32, ("T",), 4, sym), T(Int32, ("V", k), 4, sym),
            T(Int32, ("T", k), 4, sym), T(Float32, ("T", k), 4, sym), T(Int32, (E,), 4, sym),
            T(Int32, (E + 1,), 4, sym), T(Int32, ("S",), 16, sym), T(Int32, ("N",), 4, sym), T(Int32, (1,), 4, sym),
            T(Int32, (E + 1,), 4, sym), T(Int32, ("Tk",), 4, sym), jit.fake_env_stream())
    return op.tensor_call, args


KERNEL = jit.register(jit.KernelDef(
    name="moe_router",
    build=_build,
    sources=(os.path.abspath(__file__),
             *(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "cute_kernels", f)
               for f in ("cluster_smem.py", "grid_sync.py"))),
    archs=("sm_90a", "sm_100a", "sm_103a"),
    aot_configs=tuple(  # each config's three paths: grid, single CTA, cluster (V4's fp32 logits: also with PDL)
        dict(dataclasses.asdict(cfg), logits_dtype=dt, has_bias=not cfg.hash_routed, **path, **pdl)
        for cfg in (RouterConfig(), V4_FLASH_ROUTER, V4_PRO_ROUTER, V4_FLASH_HASH_ROUTER, V4_PRO_HASH_ROUTER)
        for dt in ("float32", "bfloat16")
        for path in (dict(single_cta=False), dict(single_cta=True), dict(single_cta=False, cluster=CLUSTER_CTAS))
        for pdl in ([{}, dict(pdl=True)] if cfg in (V4_FLASH_ROUTER, V4_PRO_ROUTER) and dt == "float32" else [{}])),
    description="sigmoid / sqrt-softplus (grouped) top-k + moe_align_block_size in one launch",
))
jit.register_tensor_entry(KERNEL, _build_tensors, aot_configs=KERNEL.aot_configs)


def _build_buffer_entry(arch: str, **config):
    op, _ = _build(arch, **config)
    E, k, cdt = config["num_experts"], config["top_k"], _NAME2CUTE[config["logits_dtype"]]
    sym, T = {}, jit.fake_tensor
    logits, buf, places = T(cdt, ("T", E), 16, sym), T(Int32, ("B",), 16, sym), (Int32(1),) * 6
    if config.get("hash_routed"):
        return op.hashed_buffer_call, (logits, T(Int32, ("T",), 4, sym), T(Int32, ("V", k), 4, sym), buf, *places,
                                       jit.fake_env_stream())
    return op.buffer_call, (logits, T(Float32, (E,), 16, sym), buf, *places, jit.fake_env_stream())


jit.register_tensor_entry(KERNEL, _build_buffer_entry, "moe_router_buffer_tensors",
                          "moe_router on MoeRouter's one output buffer, through TVM-FFI",
                          aot_configs=KERNEL.aot_configs)


@dataclasses.dataclass
class RouterOutput:
    """Views of T live tokens into fixed-capacity buffers (see module docstring)."""

    topk_ids: torch.Tensor  # int32 [T, k]
    topk_weights: torch.Tensor  # fp32 [T, k]
    expert_counts: torch.Tensor  # int32 [E]
    expert_offsets: torch.Tensor  # int32 [E + 1]
    sorted_token_ids: torch.Tensor  # int32 [slots]  (valid below total_rows[0])
    tile_expert: torch.Tensor  # int32 [slots / tile]
    total_rows: torch.Tensor  # int32 [1]
    routed_row_pos: torch.Tensor  # int32 [T * k]: slot in sorted order of routed row t*k+i (finalize reads it)


class MoeRouter:
    """Router with preallocated outputs for up to ``max_tokens`` tokens (graph capturable).

    ``router(logits, bias)`` returns a :class:`RouterOutput` whose ``topk_ids`` /
    ``topk_weights`` are views of the first T rows. A hash-routed router
    (``cfg.hash_routed``) takes ``router(logits, token_ids=ids)`` after :meth:`set_hash_table`.
    ``pdl=True`` launches every call as a programmatic dependent of the kernel before it on the
    stream (:func:`route`). The outputs and the workspace are views of one int32 buffer
    (:func:`buffer_layout`): with TVM-FFI on, a call after the first with the same logits shape
    hands the kernel that buffer and the inputs -- three or four tensors instead of thirteen.
    """

    def __init__(self, cfg: RouterConfig = RouterConfig(), max_tokens: int = 512, device="cuda", *,
                 pdl: bool = False):
        cfg.validate()
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"router: max_tokens must be a positive int, got {max_tokens!r}")
        if not isinstance(pdl, bool):
            raise TypeError(f"router: pdl must be a bool, got {pdl!r}")
        self.cfg, self.max_tokens, self.pdl = cfg, max_tokens, pdl
        E, k = cfg.num_experts, cfg.top_k
        layout, length = buffer_layout(cfg, max_tokens)
        # every output and the workspace: views of one buffer (zeroed: the workspace must start so;
        # the kernel re-zeroes it), which the eager hot path hands the kernel as one tensor
        self.buffer = torch.zeros(length, dtype=torch.int32, device=device)
        piece = {name: self.buffer[at:at + n] for name, (at, n) in layout.items()}
        self.topk_ids = piece["topk_ids"].view(max_tokens, k)
        self.topk_weights = piece["topk_weights"].view(torch.float32).view(max_tokens, k)
        self.expert_counts = piece["expert_counts"]
        self.expert_offsets = piece["expert_offsets"]
        self.sorted_token_ids = piece["sorted_token_ids"]
        self.tile_expert = piece["tile_expert"]
        self.total_rows = piece["total_rows"]
        self.routed_row_pos = piece["routed_row_pos"]
        self.workspace = piece["workspace"]
        self.tid2eid: torch.Tensor | None = None
        # the buffer entry's hot path (TVM-FFI on): per (logits shape, dtype, bias or not,
        # device) the RouterOutput views, memoised by a validated call; the places of the
        # buffer's pieces past its head (buffer_call); a stand-in for an absent bias (never read)
        self._tensor_calls: dict = {}
        self._tensor_fns: dict = {}
        self._places = (layout["sorted_token_ids"][1], *layout["tile_expert"], layout["topk_ids"][0],
                        layout["topk_weights"][0], layout["routed_row_pos"][0])
        self._no_bias = torch.zeros(E, dtype=torch.float32, device=device)

    def set_hash_table(self, tid2eid: torch.Tensor) -> None:
        """The hash-routed layers' token-id -> experts table ``[vocab, k]`` (any integer dtype),
        checked once -- every row ``k`` distinct experts in ``[0, E)`` -- and kept as int32 on
        the router's device."""
        op = "moe_router"
        if not self.cfg.hash_routed:
            raise ValueError(f"{op}: set_hash_table needs a RouterConfig with hash_routed=True")
        if not isinstance(tid2eid, torch.Tensor) or tid2eid.dtype.is_floating_point or tid2eid.dtype == torch.bool:
            raise TypeError(f"{op}: tid2eid must be an integer torch.Tensor, got "
                            f"{getattr(tid2eid, 'dtype', type(tid2eid).__name__)}")
        E, k = self.cfg.num_experts, self.cfg.top_k
        if tid2eid.dim() != 2 or tid2eid.shape[1] != k or tid2eid.shape[0] < 1:
            raise ValueError(f"{op}: tid2eid must have shape [vocab, {k}], got {list(tid2eid.shape)}")
        t = tid2eid.long()
        if bool(((t < 0) | (t >= E)).any()):
            raise ValueError(f"{op}: tid2eid holds expert ids outside [0, {E})")
        if bool((t.sort(dim=1).values.diff(dim=1) == 0).any()):
            raise ValueError(f"{op}: tid2eid has a row with a repeated expert")
        self.tid2eid = tid2eid.to(device=self.topk_ids.device, dtype=torch.int32).contiguous()

    def __call__(self, logits: torch.Tensor, bias: torch.Tensor | None = None, *, token_ids: torch.Tensor | None = None,
                 stream=None, arch: str | None = None) -> RouterOutput:
        if jit.TVM_FFI and stream is None and arch is None and isinstance(logits, torch.Tensor):  # the eager hot path
            key = (logits.shape, logits.dtype, bias is None, logits.get_device())
            hit = self._tensor_calls.get(key)
            if hit is not None and (token_ids is None) != self.cfg.hash_routed and (
                    bias is None or not self.cfg.hash_routed):
                # (the C checks: dtypes, extents, strides, alignment, device)
                if self.cfg.hash_routed:
                    args = (logits, token_ids, self.tid2eid, self.buffer)
                else:
                    args = (logits, self._no_bias if bias is None else bias, self.buffer)
                if jit.launch_tensor_entry(self._tensor_fns, key, *args, *self._places):
                    return hit
        T = logits.shape[0] if isinstance(logits, torch.Tensor) and logits.dim() == 2 else -1
        if T > self.max_tokens:
            raise ValueError(f"router: logits has {T} tokens, more than max_tokens={self.max_tokens}")
        Tv = max(T, 0)
        out = RouterOutput(self.topk_ids[:Tv], self.topk_weights[:Tv], self.expert_counts, self.expert_offsets,
                           self.sorted_token_ids, self.tile_expert, self.total_rows,
                           self.routed_row_pos[:Tv * self.cfg.top_k])
        route(logits, bias, self.cfg, out=out, workspace=self.workspace, token_ids=token_ids, tid2eid=self.tid2eid,
              stream=stream, arch=arch, pdl=self.pdl)
        if jit.TVM_FFI and stream is None and arch is None and T > 0:  # its tensor entry for the next calls
            key = (logits.shape, logits.dtype, bias is None, logits.get_device())
            self._tensor_calls[key] = out
            jit.remember_tensor_entry(self._tensor_fns, key, "moe_router_buffer_tensors", current_arch(logits.device),
                                      **kernel_config(self.cfg, logits.dtype, bias is not None, T, self.pdl))
        return out


def kernel_config(cfg: RouterConfig, logits_dtype: torch.dtype, has_bias: bool, T: int, pdl: bool = False) -> dict:
    """The compile configuration of the router kernel for ``cfg`` and a call's logits dtype,
    bias and token count: the single-CTA path up to SINGLE_CTA_MAX_TOKENS, the cluster path up
    to CLUSTER_MAX_TOKENS, else the grid path; ``pdl`` as :func:`route`'s."""
    single = T <= min(SINGLE_CTA_MAX_TOKENS, SINGLE_CTA_CAPACITY)
    config = dict(num_experts=cfg.num_experts, n_group=cfg.n_group, topk_group=cfg.topk_group, top_k=cfg.top_k,
                  routed_scaling_factor=float(cfg.routed_scaling_factor), tile_m=cfg.tile_m,
                  logits_dtype=_LOGIT_DTYPES[logits_dtype], has_bias=has_bias, score=cfg.score,
                  hash_routed=cfg.hash_routed, single_cta=single)
    if not single and T <= min(CLUSTER_MAX_TOKENS, CLUSTER_CAPACITY):  # (in the key only when taken)
        config["cluster"] = CLUSTER_CTAS
    if pdl:
        config["pdl"] = True
    return config


def route(logits: torch.Tensor, bias: torch.Tensor | None, cfg: RouterConfig, *, out: RouterOutput,
          workspace: torch.Tensor, token_ids: torch.Tensor | None = None, tid2eid: torch.Tensor | None = None,
          stream=None, arch: str | None = None, pdl: bool = False) -> RouterOutput:
    """Launch the fused router into ``out`` (validated; nothing allocated). Hash-routed configs
    take ``token_ids`` (int32 ``[T]``) and the int32 table ``tid2eid [vocab, k]``. ``pdl``:
    launch as a programmatic dependent of the previous kernel on the stream -- the kernel's
    set-up (shared memory, its cluster's arrival, the bias) overlaps that kernel's end, and its
    reads of ``logits`` / ``token_ids`` and all its stores wait for it; only those two inputs may
    come from the kernels before it."""
    op = "moe_router"
    cfg.validate()
    if not isinstance(pdl, bool):
        raise TypeError(f"{op}: pdl must be a bool, got {pdl!r}")
    if cfg.hash_routed:
        if bias is not None:
            raise ValueError(f"{op}: a hash-routed router takes no bias (its experts come from tid2eid)")
        if tid2eid is None:
            raise ValueError(f"{op}: hash routing needs the tid2eid table (MoeRouter.set_hash_table)")
        check_tensor(op, "tid2eid", tid2eid, dtype=torch.int32, ndim=2, contiguous=True, align_bytes=4)
        if tid2eid.shape[1] != cfg.top_k:
            raise ValueError(f"{op}: tid2eid must have shape [vocab, {cfg.top_k}], got {list(tid2eid.shape)}")
    elif token_ids is not None or tid2eid is not None:
        raise ValueError(f"{op}: token_ids / tid2eid are for a hash-routed RouterConfig (hash_routed=True)")
    E, k = cfg.num_experts, cfg.top_k
    check_tensor(op, "logits", logits, dtype=tuple(_LOGIT_DTYPES), ndim=2, contiguous=True, align_bytes=16)
    T = logits.shape[0]
    if logits.shape[1] != E:
        raise ValueError(f"{op}: logits must have shape [T, {E}], got {list(logits.shape)}")
    if bias is not None:
        check_tensor(op, "bias", bias, dtype=torch.float32, shape=(E,), contiguous=True, align_bytes=16)
    if cfg.hash_routed:
        check_tensor(op, "token_ids", token_ids, dtype=torch.int32, shape=(T,), contiguous=True, align_bytes=4)
    check_tensor(op, "topk_ids", out.topk_ids, dtype=torch.int32, shape=(T, k), contiguous=True, align_bytes=4)
    check_tensor(op, "topk_weights", out.topk_weights, dtype=torch.float32, shape=(T, k), contiguous=True,
                 align_bytes=4)
    check_tensor(op, "expert_counts", out.expert_counts, dtype=torch.int32, shape=(E,), contiguous=True)
    check_tensor(op, "expert_offsets", out.expert_offsets, dtype=torch.int32, shape=(E + 1,), contiguous=True)
    check_tensor(op, "total_rows", out.total_rows, dtype=torch.int32, shape=(1,), contiguous=True)
    check_tensor(op, "workspace", workspace, dtype=torch.int32, shape=(E + 1,), contiguous=True)
    check_tensor(op, "routed_row_pos", out.routed_row_pos, dtype=torch.int32, shape=(T * k,), contiguous=True,
                 align_bytes=4)
    slots, tiles = capacity(cfg, T)
    check_tensor(op, "sorted_token_ids", out.sorted_token_ids, dtype=torch.int32, ndim=1, contiguous=True,
                 align_bytes=16)
    check_tensor(op, "tile_expert", out.tile_expert, dtype=torch.int32, ndim=1, contiguous=True)
    if out.sorted_token_ids.numel() < slots:
        raise ValueError(f"{op}: sorted_token_ids holds {out.sorted_token_ids.numel()} slots; T={T} needs {slots}")
    if out.tile_expert.numel() < tiles:
        raise ValueError(f"{op}: tile_expert holds {out.tile_expert.numel()} entries; T={T} needs {tiles}")
    if T * max(E, k) >= 2**31:
        raise ValueError(f"{op}: T={T} too large for 32-bit indexing")
    tensors = [("logits", logits), ("topk_ids", out.topk_ids), ("topk_weights", out.topk_weights),
               ("sorted_token_ids", out.sorted_token_ids), ("workspace", workspace)]
    if bias is not None:
        tensors.append(("bias", bias))
    if cfg.hash_routed:
        tensors += [("token_ids", token_ids), ("tid2eid", tid2eid)]
    check_cuda(op, *tensors)
    if T == 0:
        return out
    a = arch if arch is not None else current_arch(logits.device)
    dispatch(op, ("portable",), arch=a)
    fn = jit.get_kernel("moe_router", a, **kernel_config(cfg, logits.dtype, bias is not None, T, pdl))
    tok = token_ids if cfg.hash_routed else out.topk_ids  # unread without hash routing
    table = tid2eid if cfg.hash_routed else out.topk_ids
    P = jit.gmem_ptr
    fn(P(_NAME2CUTE[_LOGIT_DTYPES[logits.dtype]], logits, 16), P(Float32, bias if bias is not None else logits, 16),
       P(Int32, out.topk_ids, 4), P(Float32, out.topk_weights, 4), P(Int32, out.expert_counts, 4),
       P(Int32, out.expert_offsets, 4), P(Int32, out.sorted_token_ids, 16), P(Int32, out.tile_expert, 4),
       P(Int32, out.total_rows, 4), P(Int32, workspace, 4), P(Int32, out.routed_row_pos, 4), P(Int32, tok, 4),
       P(Int32, table, 4), jit.i32(T), jit.i32(out.sorted_token_ids.numel()), jit.i32(out.tile_expert.numel()),
       jit.i32(table.shape[0] if cfg.hash_routed else 1), jit.cu_stream(stream))
    return out
