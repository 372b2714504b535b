"""Routed-expert GEMM on MXFP8 operands: the torch-facing entry point and its weight prep.

    w_q, w_scales = quantize_expert_weights(w)             # once, at weight load
    y = moe_expert_gemm(a_q, a_scales, w_q, w_scales, r.expert_offsets, r.expert_counts, r.tile_expert)

``a_q [rows, K]`` / ``a_scales`` come from :func:`moe.quant.mxfp8_quantize_routed`
(expert-sorted, 128-row-padded, swizzled scales); ``expert_offsets`` is the router's
``[E + 1]`` padded prefix. Row ``r`` of the bf16 result is ``A[r] @ W[e]^T`` for the expert
``e`` whose padded range holds ``r``; rows past ``expert_offsets[E]`` are not written.

Paths: sm_100a runs :mod:`moe.experts_sm100` (tcgen05 block-scaled MMA, the expert of each
128-row tile from the router's ``tile_expert``; compiled and machine-code checked in CI, never
run here -- no Blackwell GPU); sm_90a runs
:mod:`moe.experts_swap_ab_sm90` (swap-AB TMA + FP8 wgmma, weights as M) for decode steps --
:func:`expert_kernel_args` picks it from the token count -- and :mod:`moe.experts_tiled_sm90`
(FP8 warp MMA per 32-block with scale promotion) for larger steps; both GPU-tested on the
H200 (docs/moe_experts.md). Other devices get
the PyTorch reference (exact dequantisation, then a bf16 grouped matmul with FP32
accumulation), with one warning.

:func:`moe_expert_gate_up` fuses SiLU(gate) * up and the MXFP8 requantisation into the GEMM's
epilogue on both paths (Blackwell: a constexpr-selected epilogue that computes them from the
tensor-memory loads instead of storing C; compile + SASS checked only).
"""

from __future__ import annotations


import torch

from cute_kernels import jit
from cute_kernels.arch import current_arch, dispatch
from cute_kernels.validate import check_cuda, check_tensor

from .experts_tiled_sm90 import STAGE_RANGE, TILE_K, MoeExpertGemmTiledSm90, check_swiglu_limit
from .experts_swap_ab_sm90 import TOK_N, MoeExpertSwapABSm90, tok_n_for
from .quant import MX_BLOCK, SF_ATOM_COLS, SF_ATOM_ROWS, mxfp8_quantize, scale_buffer_size

F8 = torch.float8_e4m3fn


def expert_scale_bytes(N: int, K: int) -> int:
    """Bytes of one expert's swizzled weight scales (``[N, K/32]`` in 128 x 4 atoms)."""
    return scale_buffer_size(N, K, "swizzled")


def unswizzle_scales(flat: torch.Tensor, rows: int, K: int) -> torch.Tensor:
    """Swizzled block-scale bytes -> ``[rows, K/32]`` (torch ops only; any device)."""
    C = K // MX_BLOCK
    rb, cb = -(-rows // SF_ATOM_ROWS), -(-C // SF_ATOM_COLS)
    blocks = flat[: rb * cb * 512].view(rb * cb, 32, 4, 4).transpose(1, 2).reshape(rb, cb, 128, 4)
    return blocks.permute(0, 2, 1, 3).reshape(rb * 128, cb * 4)[:rows, :C]


def dequantize(q: torch.Tensor, flat_scales: torch.Tensor, rows: int, K: int) -> torch.Tensor:
    """FP32 ``e4m3(q) * 2^(s - 127)`` (scale byte 0xFF -> NaN, the E8M0 rule)."""
    s = unswizzle_scales(flat_scales, rows, K)
    f = torch.exp2(s.float() - 127)
    f = torch.where(s == 0xFF, torch.full_like(f, float("nan")), f)
    return (q[:rows].view(F8).float().view(rows, K // MX_BLOCK, MX_BLOCK) * f[..., None]).view(rows, K)


def quantize_expert_weights(w: torch.Tensor, *, stream=None) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 ``w [E, N, K]`` -> (``w_q [E, N, K]`` e4m3, ``w_scales [E, expert_scale_bytes]`` uint8)."""
    op = "quantize_expert_weights"
    check_tensor(op, "w", w, dtype=torch.bfloat16, ndim=3, contiguous=True, align_bytes=16)
    E, N, K = w.shape
    if K % 32:
        raise ValueError(f"{op}: K = w.shape[2] = {K} must be a multiple of 32")
    w_q = torch.empty(E, N, K, dtype=F8, device=w.device)
    w_s = torch.empty(E, expert_scale_bytes(N, K), dtype=torch.uint8, device=w.device)
    for e in range(E):  # offline, once per weight load
        mxfp8_quantize(w[e], layout="swizzled", q=w_q[e], scales=w_s[e], stream=stream)
    return w_q, w_s


#: e4m3 bytes of the 16 e2m1 codes (sign bit 3, exponent bits 2-1, mantissa bit 0): 0, 0.5, 1,
#: 1.5, 2, 3, 4, 6 and their negatives -- every e2m1 value is exact in e4m3
_E2M1_TO_E4M3 = (0x00, 0x30, 0x38, 0x3C, 0x40, 0x44, 0x48, 0x4C, 0x80, 0xB0, 0xB8, 0xBC, 0xC0, 0xC4, 0xC8, 0xCC)


def mxfp4_expert_weights(w: torch.Tensor, w_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint's MXFP4 routed-expert weights as this package's MXFP8 operands, exactly.

    DeepSeek-V4-Flash / -Pro store the routed experts as MXFP4 (``expert_dtype: fp4`` in their
    config; vLLM's ``DeepseekV4FP8Config`` dispatches them to its MXFP4 MoE method): ``w [E, N,
    K/2]`` uint8 (or ``torch.float4_e2m1fn_x2``), two e2m1 codes per byte, element ``2i`` in the
    low nibble, and ``w_scale [E, N, K/32]`` UE8M0 (uint8 or ``torch.float8_e8m0fnu``), one per 32
    consecutive K elements. MXFP8 has the same 32-element blocks and UE8M0 scales and every
    e2m1 value is exact in e4m3, so the conversion keeps each block's scale and maps each code
    to its e4m3 byte: ``dequantize`` of the result equals the checkpoint's values bit for bit,
    and the MXFP8 GEMMs (:func:`moe_expert_gemm`, :func:`moe_expert_gate_up`) then compute with
    the checkpoint's weights on both archs. The cost: twice the FP4 bytes in memory and per
    decode step (a native e2m1 operand path is not built). Load time, torch ops, any device.

    Returns ``(w_q [E, N, K]`` e4m3, ``w_scales [E, expert_scale_bytes(N, K)]`` uint8 swizzled)."""
    op = "mxfp4_expert_weights"
    if not isinstance(w, torch.Tensor) or w.dtype not in (torch.uint8, torch.float4_e2m1fn_x2):
        raise TypeError(f"{op}: w must be a uint8 or float4_e2m1fn_x2 tensor [E, N, K/2], got "
                        f"{getattr(w, 'dtype', type(w).__name__)}")
    if not isinstance(w_scale, torch.Tensor) or w_scale.dtype not in (torch.uint8, torch.float8_e8m0fnu):
        raise TypeError(f"{op}: w_scale must be a uint8 or float8_e8m0fnu tensor [E, N, K/32], got "
                        f"{getattr(w_scale, 'dtype', type(w_scale).__name__)}")
    if w.dim() != 3:
        raise ValueError(f"{op}: w must have 3 dims [E, N, K/2], got {list(w.shape)}")
    E, N, half = w.shape
    K = 2 * half
    if K % MX_BLOCK:
        raise ValueError(f"{op}: K = 2 * w.shape[2] = {K} must be a multiple of {MX_BLOCK}")
    if tuple(w_scale.shape) != (E, N, K // MX_BLOCK):
        raise ValueError(f"{op}: w_scale must have shape [{E}, {N}, {K // MX_BLOCK}], got {list(w_scale.shape)}")
    packed = w.contiguous().view(torch.uint8)
    lut = torch.tensor(_E2M1_TO_E4M3, dtype=torch.uint8, device=w.device)
    w_q = torch.empty(E, N, K, dtype=torch.uint8, device=w.device)
    for e in range(E):  # one expert at a time: the int64 codes of a whole layer would not fit
        codes = torch.stack((packed[e] & 0xF, packed[e] >> 4), dim=-1).view(N, K).long()  # 2i: low nibble
        w_q[e] = lut[codes]
    w_q = w_q.view(F8)
    scales = w_scale.contiguous().view(torch.uint8)
    w_s = torch.stack([swizzle_scales(scales[e]) for e in range(E)])
    return w_q, w_s


def expert_gemm_torch(a_q, a_scales, w_q, w_scales, expert_offsets, out):
    """The expert GEMM in PyTorch (the CPU path and the fallback): the MXFP8 operands (uint8
    e4m3 bits, swizzled scales) dequantised, each expert's rows ``[offsets[e], offsets[e+1])``
    times its weights, FP32 accumulation, into ``out``; rows past the last offset untouched."""
    rows, K = a_q.shape
    E, N, _ = w_q.shape
    a = dequantize(a_q, a_scales, rows, K)
    offs = expert_offsets.long()
    w = torch.stack([dequantize(w_q[e], w_scales[e], N, K) for e in range(E)])
    if a.is_cuda and hasattr(torch, "_grouped_mm"):
        # bf16 operands, FP32 accumulation; rows past the last offset are left alone.
        total = offs[-1:]
        y = torch._grouped_mm(a.bfloat16(), w.bfloat16().transpose(1, 2), offs=expert_offsets[1:].int())
        keep = (torch.arange(rows, device=a.device) < total)[:, None]
        out.copy_(torch.where(keep, y, out))
        return out
    for e in range(E):  # CPU: a host loop is fine
        lo, hi = int(offs[e]), int(offs[e + 1])
        if hi > lo:
            out[lo:hi] = (a[lo:hi] @ w[e].T).to(out.dtype)
    return out



def _check_operand_shapes(op, a_q, w_q):
    """e4m3 ``a_q [rows, K]`` and ``w_q [E, N, K]`` -> (rows, K, E, N)."""
    check_tensor(op, "a_q", a_q, dtype=(F8, torch.uint8), ndim=2, contiguous=True, align_bytes=16)
    check_tensor(op, "w_q", w_q, dtype=(F8, torch.uint8), ndim=3, contiguous=True, align_bytes=16)
    rows, K = a_q.shape
    E, N, Kw = w_q.shape
    if Kw != K:
        raise ValueError(f"{op}: w_q.shape[2] = {Kw} must equal a_q.shape[1] = {K}")
    return rows, K, E, N


def _check_scales(op, a_scales, w_scales, expert_offsets, rows, K, E, N):
    """Swizzled block scales of both operands and the router's [E + 1] padded offsets."""
    check_tensor(op, "a_scales", a_scales, dtype=torch.uint8, shape=(scale_buffer_size(rows, K, "swizzled"),),
                 contiguous=True, align_bytes=16)
    check_tensor(op, "w_scales", w_scales, dtype=torch.uint8, shape=(E, expert_scale_bytes(N, K)), contiguous=True,
                 align_bytes=16)
    check_tensor(op, "expert_offsets", expert_offsets, dtype=torch.int32, shape=(E + 1,), contiguous=True,
                 align_bytes=4)


def _check_tile_expert(op, tile_expert, rows, min_tiles):
    """The router's ``tile_expert`` (int32, one entry per 128-row tile) holds >= ``min_tiles`` entries."""
    check_tensor(op, "tile_expert", tile_expert, dtype=torch.int32, ndim=1, contiguous=True, align_bytes=4)
    if tile_expert.numel() < min_tiles:
        raise ValueError(f"{op}: tile_expert has {tile_expert.numel()} tiles of 128 rows; a_q has {rows} rows")


def _launch_sm90(op, arch, a_q, a_scales, w_q, w_scales, expert_offsets, expert_counts, tile_expert, out, fused,
                 stream, routed_rows=None, tile_k=None, stages=None, ctas_per_sm=None, max_expert_rows=None,
                 expert_row_tile=None, swiglu_limit=None, router_experts=None):
    """The Hopper kernel: bf16 ``out``, or (``fused`` = (q, scales)) SiLU * up + MXFP8."""
    import cutlass
    from cutlass import Int32

    rows, K = a_q.shape
    E, N, _ = w_q.shape
    router_e = E if router_experts is None else router_experts
    if not isinstance(router_e, int) or isinstance(router_e, bool) or router_e < E:
        raise ValueError(f"{op}: router_experts must be an int >= the weights' {E} experts (the experts the router "
                         f"packed rows for), got {router_experts!r}")
    if expert_counts is None or tile_expert is None:
        raise ValueError(f"{op}: the Hopper kernel needs the router's expert_counts and tile_expert")
    check_tensor(op, "expert_counts", expert_counts, dtype=torch.int32, shape=(E,), contiguous=True, align_bytes=4)
    # the tiled kernel's grid is bounded by the entries (a partial last tile may go unlisted)
    _check_tile_expert(op, tile_expert, rows, rows // 128)
    if N % 64:
        raise ValueError(f"{op}: the Hopper kernel needs N % 64 == 0, got N={N}")
    if rows * max(K, N) >= 2**31:  # the kernels index A and out with 32-bit element offsets
        raise ValueError(f"{op}: a_q has {rows} rows; rows * max(K={K}, N={N}) must stay below 2^31 (split the "
                         f"tokens into several calls)")
    check_cuda(op, ("a_q", a_q), ("expert_counts", expert_counts), ("tile_expert", tile_expert))
    P = jit.gmem_ptr
    f8 = cutlass.Float8E4M3FN
    tok_n = None
    if max_expert_rows is not None:
        if not isinstance(max_expert_rows, int) or max_expert_rows < 1:
            raise ValueError(f"{op}: max_expert_rows must be a positive int (an upper bound on any expert's rows, "
                             f"e.g. the token count), got {max_expert_rows!r}")
        tok_n = tok_n_for(max_expert_rows)
    row_passes = expert_row_tile is not None
    if row_passes:
        if expert_row_tile not in TOK_N:
            raise ValueError(f"{op}: expert_row_tile must be one of {TOK_N}, got {expert_row_tile!r}")
        tok_n = expert_row_tile
    if tok_n is not None:  # the swap-AB TMA + wgmma decode kernel (moe.experts_swap_ab_sm90)
        if tile_k is not None or ctas_per_sm is not None:
            raise ValueError(f"{op}: tile_k / ctas_per_sm configure the tiled kernel; max_expert_rows / "
                             f"expert_row_tile select the decode kernel (only stages applies)")
        if not MoeExpertSwapABSm90.can_implement(E, N, K, tok_n, stages):
            raise ValueError(f"{op}: the decode kernel (token tile {tok_n}) cannot run stages={stages} "
                             f"(2-12 within shared memory) or E={E}, N={N}, K={K}")
        name, cfg = "moe_expert_swap_ab_sm90", dict(E=E, N=N, K=K, tok_n=tok_n, silu_quant=fused is not None,
                                                     stages=stages, row_passes=row_passes, **_limit_cfg(swiglu_limit))
    else:
        if tile_k is None:
            tile_k, d_stages, d_ctas = default_tile(K, fused is not None)
            stages = d_stages if stages is None else stages
            ctas_per_sm = d_ctas if ctas_per_sm is None else ctas_per_sm
        ctas_per_sm = 1 if ctas_per_sm is None else ctas_per_sm
        if tile_k not in TILE_K or K % tile_k:
            raise ValueError(f"{op}: tile_k must be one of {sorted(TILE_K)} dividing K={K}, got {tile_k!r}")
        if not MoeExpertGemmTiledSm90.can_implement(E, N, K, tile_k, stages, ctas_per_sm):
            raise ValueError(f"{op}: tile_k={tile_k}, stages={stages}, ctas_per_sm={ctas_per_sm} unsupported (stages "
                             f"in {STAGE_RANGE}; ctas_per_sm 1 or 2 with both CTAs' shared memory within 227 KB)")
        name, cfg = "moe_expert_gemm_tiled_sm90", dict(E=E, N=N, K=K, silu_quant=fused is not None, tile_k=tile_k,
                                                        stages=stages, ctas_per_sm=ctas_per_sm,
                                                        **_limit_cfg(swiglu_limit))
    fn = jit.get_kernel(name, arch, **cfg)
    # both kernels take the same arguments
    q_out, s_out = fused if fused is not None else (a_q, a_scales)  # not touched unless fused
    out_t = out if out is not None else a_q  # not touched when fused
    tiles = grid_tiles(op, rows, tile_expert.numel(), router_e, routed_rows)
    fn(P(f8, a_q, 16), P(f8, w_q, 16), P(cutlass.Uint8, a_scales, 16), P(cutlass.Uint8, w_scales, 16),
       P(cutlass.BFloat16, out_t, 16), P(f8, q_out, 16), P(cutlass.Uint8, s_out, 1), P(Int32, expert_offsets, 4),
       P(Int32, expert_counts, 4), P(Int32, tile_expert, 4), jit.i32(rows), jit.i32(tiles), jit.cu_stream(stream))
    return f"{name}_tensors", cfg, tiles


#: (a_q.shape, w_q.shape, tile_expert length, fused, the kernel-choice arguments, device index)
#: -> the Hopper kernel's tensor entry (jit.launch_tensor_entry), filled by a first validated
#: call with TVM-FFI on; under the same key (grid tiles, a_scales bytes, scales_out bytes): the
#: grid and the two buffer sizes the C checks cannot make
_TENSOR_FNS: dict = {}
_TENSOR_ARGS: dict = {}


def _tensor_key(hot: bool, a_q, w_q, tile_expert, fused: bool, *choice):
    """The memo key of a call that may take the eager hot path (``hot``: the caller's defaults
    -- no stream, arch or tiling override -- and its outputs given), or None."""
    if not (hot and jit.TVM_FFI and isinstance(a_q, torch.Tensor) and isinstance(w_q, torch.Tensor)
            and isinstance(tile_expert, torch.Tensor)):
        return None
    try:
        key = (a_q.shape, w_q.shape, tile_expert.shape[0], fused, *choice, a_q.get_device())
        hash(key)
    except (TypeError, AttributeError, IndexError):  # an argument the validated path will name
        return None
    return key


def _tensor_hot_path(key, a_q, a_scales, w_q, w_scales, out, q_out, s_out, expert_offsets, expert_counts,
                     tile_expert) -> bool:
    """Launch the memoised tensor entry of ``key`` (the caller checked TVM-FFI and the
    defaults) and return True, or False: the validated path then runs."""
    extra = _TENSOR_ARGS.get(key)
    if extra is None or not isinstance(a_scales, torch.Tensor) or a_scales.numel() != extra[1] or (
            s_out is not None and (not isinstance(s_out, torch.Tensor) or s_out.numel() != extra[2])):
        return False
    return jit.launch_tensor_entry(_TENSOR_FNS, key, a_q, w_q, a_scales, w_scales, a_q if out is None else out,
                                   a_q if q_out is None else q_out, a_scales if s_out is None else s_out,
                                   expert_offsets, expert_counts, tile_expert, extra[0])


def _remember(key, launched, a_q, a_scales, s_out) -> None:
    """After a validated Hopper launch with the defaults: its tensor entry for the next calls."""
    if key is None or not jit.TVM_FFI:
        return
    name, cfg, tiles = launched
    _TENSOR_ARGS[key] = (tiles, a_scales.numel(), None if s_out is None else s_out.numel())
    jit.remember_tensor_entry(_TENSOR_FNS, key, name, current_arch(a_q.device), **cfg)


#: Largest step (tokens) for which :func:`expert_kernel_args` takes the caller's row tile: a
#: BS64 verify step (64 x 6 tokens) and the runtime's prefill chunks; above it, passes of
#: :data:`LARGE_ROW_TILE` columns.
ROW_PASS_MAX_TOKENS = 384
#: Row passes above :data:`ROW_PASS_MAX_TOKENS` tokens: wider passes re-stream each weight
#: tile fewer times once experts hold ~100 rows. On the H200 (V3-shaped layer, T = 4096,
#: bench/RESULTS.md) passes of 32 took the gate/up and down GEMMs 10.9 + 4.9 ms against 14.8 +
#: 7.4 ms for the tiled kernel's best configurations (passes of 16: 13.8 + 5.9 ms).
LARGE_ROW_TILE = 32


def expert_kernel_args(tokens: int, row_tile: int | None = 16) -> dict:
    """The Hopper kernel choice for a step of ``tokens`` tokens, as keyword arguments of
    :func:`moe_expert_gemm` / :func:`moe_expert_gate_up`.

    A token routes to an expert at most once, so ``tokens`` bounds every expert's rows:
    ``tokens <= 16`` runs the decode kernel with that bound (one 16-column pass); up to
    :data:`ROW_PASS_MAX_TOKENS` it runs in passes of ``row_tile`` columns (one wide pass
    would promote 64 columns for experts holding ~2 rows; on the H200 passes of 16 halve the
    expert GEMMs at T = 64 and beat the tiled kernel ~2x up to T = 384), above it in passes
    of :data:`LARGE_ROW_TILE`. ``row_tile=None`` keeps one pass up to 64 tokens and the tiled
    kernel above.
    """
    if not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"expert_kernel_args: tokens must be a non-negative int, got {tokens!r}")
    if row_tile is not None and row_tile not in TOK_N:
        raise ValueError(f"expert_kernel_args: row_tile must be None or one of {TOK_N}, got {row_tile!r}")
    if tokens <= 16 or (row_tile is None and tokens <= TOK_N[-1]):
        return dict(max_expert_rows=max(tokens, 1))
    if row_tile is not None:
        return dict(expert_row_tile=row_tile if tokens <= ROW_PASS_MAX_TOKENS else LARGE_ROW_TILE)
    return {}


def default_tile(K: int, fused: bool) -> tuple[int, int | None, int]:
    """The tiled Hopper kernel's (K tile, stages, CTAs per SM) by default: 256 x 2 at 2 CTAs
    per SM for the down projection, 128 x 4 at 1 CTA per SM for the fused gate/up (the
    fastest GPU-tested configuration of each on the H200)."""
    if not fused and K % 256 == 0:
        return 256, 2, 2
    return 128, None, 1


def grid_tiles(op, rows, tile_capacity, E, routed_rows):
    """Router tiles the Hopper kernels' grid covers. The router packs live tiles first and each
    of its ``E`` experts adds at most one partial tile, so ``ceil(routed_rows / 128) + min(E,
    routed_rows)`` tiles hold every live row. ``E`` is the router's expert count: an
    expert-parallel shard's tiles sit among every expert's. Without ``routed_rows`` the grid
    spans the whole capacity (``E * 127`` padding rows): at decode that is ~250 tiles of which
    ~9 are live, and the early-exiting CTAs cost more than the work."""
    tiles = min(tile_capacity, -(-rows // 128))
    if routed_rows is None:
        return tiles
    if not isinstance(routed_rows, int) or routed_rows < 0:
        raise ValueError(f"{op}: routed_rows must be a non-negative int (tokens x top-k), got {routed_rows!r}")
    return max(1, min(tiles, -(-routed_rows // 128) + min(E, routed_rows)))

def moe_expert_gemm(a_q: torch.Tensor, a_scales: torch.Tensor, w_q: torch.Tensor, w_scales: torch.Tensor,
                    expert_offsets: torch.Tensor, expert_counts: torch.Tensor | None = None,
                    tile_expert: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                    stream=None, arch: str | None = None,
                    routed_rows: int | None = None, tile_k: int | None = None,
                    stages: int | None = None, ctas_per_sm: int | None = None,
                    max_expert_rows: int | None = None, expert_row_tile: int | None = None,
                    router_experts: int | None = None) -> torch.Tensor:
    """bf16 ``[rows, N]``: expert-sorted rows of ``a`` times their expert's ``W^T``.

    ``expert_offsets`` / ``expert_counts`` / ``tile_expert`` are the router's outputs
    (:class:`moe.router.RouterOutput`); the Hopper kernel needs all three, the Blackwell
    kernel ``tile_expert``. ``routed_rows`` (tokens x top-k, known on the host without a sync)
    bounds the Hopper grid to the tiles that can hold live rows; pass it at decode.
    ``tile_k`` / ``stages`` pick the Hopper kernel's K tile (128 or 256; default
    :func:`default_tile`), pipeline depth (2-4; default per tile, see ``TILE_K``) and
    ``ctas_per_sm`` (2: a launch bound capping registers so two CTAs share an SM).
    ``max_expert_rows`` (an upper bound on any expert's live rows -- the token count, since a
    token routes to an expert once) <= 64 selects the Hopper swap-AB TMA + FP8 wgmma decode
    kernel (:mod:`moe.experts_swap_ab_sm90`, faster than the tiled kernel at decode; ``stages``
    then sets its pipeline depth); pass the token count at decode.
    ``expert_row_tile`` (16 / 32 / 64) runs the decode kernel for any rows per expert: a CTA
    covers its router tile's live rows in passes of that many token columns (GPU-tested; for
    T = 17-384, where an expert's rows are usually <= 16 but not bounded by it).
    :func:`expert_kernel_args` picks between these from the token count.
    ``router_experts``: the experts the router packed rows for, when ``w_q`` holds fewer -- an
    expert-parallel shard's experts, with ``expert_offsets`` / ``expert_counts`` its slice of
    the router's and the other experts' tiles at -1 in ``tile_expert`` (default: ``E``).
    Padding rows of ``out`` are unspecified.
    """
    defaults = stream is None and arch is None and tile_k is None and stages is None and ctas_per_sm is None
    key = _tensor_key(defaults and out is not None, a_q, w_q, tile_expert, False, routed_rows, max_expert_rows,
                      expert_row_tile, router_experts)
    if key is not None and _tensor_hot_path(key, a_q, a_scales, w_q, w_scales, out, None, None, expert_offsets,
                                            expert_counts, tile_expert):  # the eager hot path (Hopper)
        return out
    op = "moe_expert_gemm"
    rows, K, E, N = _check_operand_shapes(op, a_q, w_q)
    if K % 128 or N % 16:
        raise ValueError(f"{op}: need K % 128 == 0 and N % 16 == 0, got K={K}, N={N}")
    _check_scales(op, a_scales, w_scales, expert_offsets, rows, K, E, N)
    if out is None:
        out = torch.empty(rows, N, dtype=torch.bfloat16, device=a_q.device)
    check_tensor(op, "out", out, dtype=torch.bfloat16, shape=(rows, N), contiguous=True, align_bytes=16)
    check_cuda(op, ("a_q", a_q), ("a_scales", a_scales), ("w_q", w_q), ("w_scales", w_scales),
               ("expert_offsets", expert_offsets), ("out", out))
    a = arch if arch is not None else current_arch(a_q.device)
    path = dispatch(op, ("sm100", "sm90", "reference"), arch=a)
    if path == "reference" or rows == 0:
        return expert_gemm_torch(a_q, a_scales, w_q, w_scales, expert_offsets, out) if rows else out
    if path == "sm90":
        launched = _launch_sm90(op, a, a_q, a_scales, w_q, w_scales, expert_offsets, expert_counts, tile_expert, out,
                                None, stream, routed_rows, tile_k, stages, ctas_per_sm, max_expert_rows,
                                expert_row_tile, router_experts=router_experts)
        _remember(key, launched, a_q, a_scales, None)
        return out
    _launch_sm100(op, a, a_q, a_scales, w_q, w_scales, tile_expert, out, None, stream)
    return out


def _launch_sm100(op, arch, a_q, a_scales, w_q, w_scales, tile_expert, out, fused, stream, swiglu_limit=None):
    """The Blackwell kernel: bf16 ``out``, or (``fused`` = (q, scales)) the SiLU * up + MXFP8
    epilogue, which writes no C (``a_q`` then stands in for C's never-used address)."""
    import cutlass
    from cutlass import Int32

    from .experts_sm100 import MoeExpertGemmSm100

    rows, K = a_q.shape
    E, N, _ = w_q.shape
    if tile_expert is None:
        raise ValueError(f"{op}: the Blackwell kernel needs the router's tile_expert (expert of each 128-row tile)")
    _check_tile_expert(op, tile_expert, rows, -(-rows // 128))  # one CTA row per 128-row tile reads its entry
    if not MoeExpertGemmSm100.can_implement(E, N, K, silu_quant=fused is not None):
        raise ValueError(f"{op}: the Blackwell kernel needs N = w_q.shape[1] = {N} a multiple of 128 and "
                         f"K = {K} of 128")
    check_cuda(op, ("a_q", a_q), ("tile_expert", tile_expert))
    P = jit.gmem_ptr
    f8, sf = cutlass.Float8E4M3FN, cutlass.Float8E8M0FNU
    if fused is None:
        fn = jit.get_kernel("moe_expert_gemm_sm100", arch, E=E, N=N, K=K)
        c, (q, s) = out, (a_q, a_scales)  # q / s: unused without the fused epilogue
    else:
        fn = jit.get_kernel("moe_expert_gemm_sm100", arch, E=E, N=N, K=K, silu_quant=True, **_limit_cfg(swiglu_limit))
        c, (q, s) = a_q, fused
    fn(P(f8, a_q, 16), P(f8, w_q, 16), P(sf, a_scales, 16), P(sf, w_scales, 16), P(cutlass.BFloat16, c, 16),
       P(Int32, tile_expert, 4), P(f8, q, 16), P(cutlass.Uint8, s, 1), jit.i32(rows), jit.cu_stream(stream))


def interleave_gate_up(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """``[E, I, K]`` gate and up weights -> ``[E, 2I, K]`` in blocks of 32 rows (gate, up, ...).

    The fused gate/up kernel computes one 64-column tile per CTA: its first 32 columns are the
    gates and its last 32 the ups of the same 32 features, so SiLU(gate) * up and the MXFP8
    block of those 32 features stay inside the tile.
    """
    E, I, K = w_gate.shape
    if w_up.shape != w_gate.shape or I % 32:
        raise ValueError(f"interleave_gate_up: gate and up must both be [E, I, K] with I % 32 == 0, got "
                         f"{list(w_gate.shape)}, {list(w_up.shape)}")
    return torch.stack([w_gate.view(E, I // 32, 32, K), w_up.view(E, I // 32, 32, K)], 2).reshape(E, 2 * I, K)


def _limit_cfg(swiglu_limit) -> dict:
    """The kernels' compile config for a clamp: absent without one (the unclamped builds' keys)."""
    return {} if swiglu_limit is None else {"swiglu_limit": float(swiglu_limit)}


def silu_mul_interleaved(y: torch.Tensor, swiglu_limit: float | None = None) -> torch.Tensor:
    """The unfused epilogue on the gate/up GEMM's bf16 output (interleaved columns):
    ``h = bf16(bf16(silu(g)) * u)`` -- the unfused path's rounding points -- after DeepSeek-V4's
    clamp ``g <= limit``, ``-limit <= u <= limit`` when ``swiglu_limit`` is given."""
    R, N = y.shape
    blocks = y.view(R, N // 64, 2, 32)
    g, u = blocks[:, :, 0].reshape(R, N // 2), blocks[:, :, 1].reshape(R, N // 2)
    if swiglu_limit is not None:
        g, u = g.clamp(max=swiglu_limit), u.clamp(min=-swiglu_limit, max=swiglu_limit)
    return torch.nn.functional.silu(g) * u  # bf16 in, bf16 out at each op


def moe_expert_gate_up(a_q: torch.Tensor, a_scales: torch.Tensor, w_q: torch.Tensor, w_scales: torch.Tensor,
                       expert_offsets: torch.Tensor, expert_counts: torch.Tensor, tile_expert: torch.Tensor, *,
                       q_out: torch.Tensor | None = None, scales_out: torch.Tensor | None = None, stream=None,
                       arch: str | None = None, routed_rows: int | None = None,
                       tile_k: int | None = None, stages: int | None = None,
                       ctas_per_sm: int | None = None,
                       max_expert_rows: int | None = None,
                       expert_row_tile: int | None = None,
                       swiglu_limit: float | None = None,
                       router_experts: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate/up projection with SiLU(gate) * up and MXFP8 requantisation fused in the epilogue.

    ``swiglu_limit`` (DeepSeek-V4: 10.0): clamp ``gate <= limit`` and ``-limit <= up <= limit``
    on the GEMM's bf16 outputs before SiLU(gate) * up (``None``: no clamp). ``router_experts``
    and the kernel choice: as :func:`moe_expert_gemm`.

    ``w_q`` / ``w_scales`` are the quantised :func:`interleave_gate_up` weights ``[E, 2I, K]``.
    Returns the down projection's input: ``q [rows, I]`` e4m3 and its swizzled scales (live
    rows written; padding rows unspecified). One fused launch on Hopper (GPU-tested) and on
    Blackwell (the tcgen05 GEMM's epilogue: compile + SASS checked only, no Blackwell GPU
    here); the CPU fallback runs expert GEMM -> bf16, SiLU * up, then the quantiser.
    """
    defaults = stream is None and arch is None and tile_k is None and stages is None and ctas_per_sm is None
    key = _tensor_key(defaults and q_out is not None and scales_out is not None, a_q, w_q, tile_expert, True,
                      routed_rows, max_expert_rows, expert_row_tile, router_experts, swiglu_limit)
    if key is not None and _tensor_hot_path(key, a_q, a_scales, w_q, w_scales, None, q_out, scales_out,
                                            expert_offsets, expert_counts, tile_expert):  # the eager hot path (Hopper)
        return q_out, scales_out
    op = "moe_expert_gate_up"
    check_swiglu_limit(op, swiglu_limit, True)
    rows, K, E, N = _check_operand_shapes(op, a_q, w_q)
    if N % 64:
        raise ValueError(f"{op}: w_q.shape[1] = 2I = {N} must be a multiple of 64")
    if K % 128:
        raise ValueError(f"{op}: K = {K} must be a multiple of 128")
    _check_scales(op, a_scales, w_scales, expert_offsets, rows, K, E, N)
    I = N // 2
    if q_out is None:
        q_out = torch.empty(rows, I, dtype=F8, device=a_q.device)
    if scales_out is None:
        scales_out = torch.zeros(scale_buffer_size(rows, I, "swizzled"), dtype=torch.uint8, device=a_q.device)
    check_tensor(op, "q_out", q_out, dtype=(F8, torch.uint8), shape=(rows, I), contiguous=True, align_bytes=16)
    check_tensor(op, "scales_out", scales_out, dtype=torch.uint8, shape=(scale_buffer_size(rows, I, "swizzled"),),
                 contiguous=True, align_bytes=0)
    a = arch if arch is not None else (current_arch(a_q.device) if a_q.is_cuda else None)
    path = dispatch(op, ("sm100", "sm90", "portable"), arch=a) if a is not None and a_q.is_cuda else "portable"
    if path == "sm100":  # tcgen05 GEMM with the SiLU * up + MXFP8 epilogue (compile + SASS checked only)
        check_cuda(op, ("a_q", a_q), ("a_scales", a_scales), ("w_q", w_q), ("w_scales", w_scales),
                   ("expert_offsets", expert_offsets), ("q_out", q_out), ("scales_out", scales_out))
        _launch_sm100(op, a, a_q, a_scales, w_q, w_scales, tile_expert, None, (q_out, scales_out), stream,
                      swiglu_limit)
        return q_out, scales_out
    if path == "sm90":
        check_cuda(op, ("a_q", a_q), ("a_scales", a_scales), ("w_q", w_q), ("w_scales", w_scales),
                   ("expert_offsets", expert_offsets), ("q_out", q_out), ("scales_out", scales_out))
        launched = _launch_sm90(op, a, a_q, a_scales, w_q, w_scales, expert_offsets, expert_counts, tile_expert, None,
                                (q_out, scales_out), stream, routed_rows, tile_k, stages, ctas_per_sm,
                                max_expert_rows, expert_row_tile, swiglu_limit, router_experts)
        _remember(key, launched, a_q, a_scales, scales_out)
        return q_out, scales_out
    if a_q.is_cuda:
        y = moe_expert_gemm(a_q, a_scales, w_q, w_scales, expert_offsets, expert_counts, tile_expert, arch=a,
                            stream=stream, routed_rows=routed_rows, router_experts=router_experts)
    else:
        y = expert_gemm_torch(a_q, a_scales, w_q, w_scales, expert_offsets, torch.zeros(rows, N, dtype=torch.bfloat16))
    h = silu_mul_interleaved(y, swiglu_limit)
    if a_q.is_cuda:
        mxfp8_quantize(h, layout="swizzled", q=q_out, scales=scales_out, stream=stream)
    else:
        q, sc = mxfp8_quantize_torch(h)
        q_out.view(torch.uint8).copy_(q)
        scales_out.copy_(swizzle_scales(sc))
    return q_out, scales_out


def mxfp8_quantize_torch(x: torch.Tensor):
    """CPU fallback of moe.quant's MX rule (bf16 [R, K] -> e4m3 bits, UE8M0 scales)."""
    R, K = x.shape
    nb = K // MX_BLOCK
    bits = (x.contiguous().view(torch.int16).to(torch.int32) & 0x7FFF).view(R, nb, MX_BLOCK)
    amax = bits.amax(-1)
    scale = ((amax >> 7) - 8 + ((amax & 0x7F) > 0x60).to(torch.int32)).clamp(0, 254)
    mult = ((254 - scale) << 23).to(torch.int32).view(torch.float32)
    q = (x.float().view(R, nb, MX_BLOCK) * mult[..., None]).to(F8).view(torch.uint8)
    bad = amax >= 0x7F80
    q = torch.where(bad[..., None], torch.full_like(q, 0x7F), q)
    scale = torch.where(bad, torch.full_like(scale, 0xFF), scale)
    return q.view(R, K), scale.to(torch.uint8)


def swizzle_scales(scale: torch.Tensor) -> torch.Tensor:
    """Row-major block-scale bytes ``[R, C]`` -> the flat swizzled layout the expert GEMMs read
    (128 x 4 atoms, zero padded; the inverse of :func:`unswizzle_scales`). Torch ops, any device."""
    R, C = scale.shape
    rb, cb = -(-R // 128), -(-C // 4)
    p = torch.zeros(rb * 128, cb * 4, dtype=scale.dtype, device=scale.device)
    p[:R, :C] = scale
    return p.view(rb, 128, cb, 4).permute(0, 2, 1, 3).reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1)
