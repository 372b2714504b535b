"""The MoE kernels as PyTorch custom ops: ``torch.ops.cute_kernels.<name>`` (see
:mod:`cute_kernels.ops` for the conventions: a CUDA implementation calling the documented
entry point, a CPU implementation written from the op's definition, a fake implementation
for ``torch.compile``).

Ops: ``mxfp8_quantize``, ``mxfp8_quantize_routed``, ``mxfp8_gather_routed``, ``moe_route`` (the fused router's padded,
packed outputs; sigmoid / sqrt-softplus, grouped or not; the hash-routed variant is not
registered yet), ``moe_expert_gemm``, ``moe_expert_gate_up`` (SiLU * up, optional SwiGLU
clamp, MXFP8 requantisation), ``moe_finalize`` (+ the shared-expert add). A compiled MoE
block is these five calls in a row (``tests/test_ops.py``).

Test::

    pytest tests/test_ops.py
"""

from __future__ import annotations

import torch

from cute_kernels import jit
from cute_kernels.arch import current_arch
from cute_kernels.ops import cuda_op  # the core ops, the namespace's library and its op definition

from . import experts as _ex
from . import finalize as _fin
from . import quant as _q
from . import router as _rt

Tensor = torch.Tensor
F8 = torch.float8_e4m3fn


def _scale_shape(rows: int, K: int, layout: str) -> tuple[int, ...]:
    return (rows, K // _q.MX_BLOCK) if layout == "plain" else (_q.scale_buffer_size(rows, K, layout),)


def _quant_outputs(like: Tensor, rows: int, K: int, layout: str) -> tuple[Tensor, Tensor]:
    """Fresh MXFP8 outputs on ``like``'s device: e4m3 ``[rows, K]`` and the ``layout``'s scales."""
    return like.new_empty(rows, K, dtype=F8), like.new_empty(_scale_shape(rows, K, layout), dtype=torch.uint8)


def _routed_outputs(x: Tensor, sorted_token_ids: Tensor, layout: str) -> dict:
    """Fresh outputs for a routed quantisation where the arguments look valid (else none: the
    entry point then allocates and names what is wrong): with the outputs given, the entry
    point's eager hot path (its tensor entry) serves every call after the first."""
    if (layout not in _q.LAYOUTS or x.dim() != 2 or sorted_token_ids.dim() != 1 or x.shape[1] % _q.MX_BLOCK
            or not sorted_token_ids.shape[0]):
        return {}
    q, scales = _quant_outputs(x, sorted_token_ids.shape[0], x.shape[1], layout)
    return dict(q=q, scales=scales)


def _quant_cpu(x: Tensor, layout: str) -> tuple[Tensor, Tensor]:
    q, s = _ex.mxfp8_quantize_torch(x)
    return q.view(F8), (s if layout == "plain" else _ex.swizzle_scales(s))


# ---------------------------------------------------------------------------- MXFP8 ----
@cuda_op("mxfp8_quantize")
def mxfp8_quantize(x: Tensor, layout: str) -> tuple[Tensor, Tensor]:
    """MXFP8 of bf16 ``x [R, K]``: (e4m3 ``[R, K]``, UE8M0 scales -- ``[R, K/32]`` for
    ``layout="plain"``, the expert GEMMs' flat swizzled buffer for ``"swizzled"``)."""
    if layout != "plain" or x.dim() != 2 or x.shape[1] % _q.MX_BLOCK:  # (the entry names the errors)
        return _q.mxfp8_quantize(x, layout=layout)
    q, scales = _quant_outputs(x, *x.shape, layout)  # outputs given: the entry point's eager hot path
    return _q.mxfp8_quantize(x, layout=layout, q=q, scales=scales)


mxfp8_quantize.register_kernel("cpu")(_quant_cpu)


@mxfp8_quantize.register_fake
def _(x, layout):
    return _quant_outputs(x, *x.shape, layout)


@cuda_op("mxfp8_quantize_routed")
def mxfp8_quantize_routed(x: Tensor, sorted_token_ids: Tensor, total_rows: Tensor, topk: int,
                          layout: str) -> tuple[Tensor, Tensor]:
    """Rows of ``x [T, K]`` gathered through the router's ``sorted_token_ids`` (routed row
    ``t * topk + i`` -> token ``t``; padding slots zero), quantised to MXFP8. Rows at or past
    ``total_rows[0]`` are unspecified."""
    return _q.mxfp8_quantize_routed(x, sorted_token_ids, total_rows, topk, layout=layout,
                                    **_routed_outputs(x, sorted_token_ids, layout))


@mxfp8_quantize_routed.register_kernel("cpu")
def _(x, sorted_token_ids, total_rows, topk, layout):
    T, K = x.shape
    ids = sorted_token_ids.long()
    live = (ids < T * topk) & (torch.arange(ids.numel()) < total_rows.long()[0])
    g = torch.zeros(ids.numel(), K, dtype=x.dtype)
    g[live] = x[ids[live] // topk]
    return _quant_cpu(g, layout)


@mxfp8_quantize_routed.register_fake
def _(x, sorted_token_ids, total_rows, topk, layout):
    return _quant_outputs(x, sorted_token_ids.shape[0], x.shape[1], layout)


@cuda_op("mxfp8_gather_routed")
def mxfp8_gather_routed(xq: Tensor, xs: Tensor, sorted_token_ids: Tensor, total_rows: Tensor, topk: int,
                        layout: str) -> tuple[Tensor, Tensor]:
    """:func:`mxfp8_quantize_routed` of tokens already quantized (``mxfp8_quantize(x, "plain")``:
    ``xq [T, K]`` e4m3, ``xs [T, K/32]``): their blocks and scale bytes gathered into the
    routed order -- the same bytes. Rows at or past ``total_rows[0]`` are unspecified."""
    return _q.mxfp8_gather_routed(xq, xs, sorted_token_ids, total_rows, topk, layout=layout,
                                  **_routed_outputs(xq, sorted_token_ids, layout))


@mxfp8_gather_routed.register_kernel("cpu")
def _(xq, xs, sorted_token_ids, total_rows, topk, layout):
    T, K = xq.shape
    ids = sorted_token_ids.long()
    live = (ids >= 0) & (ids < T * topk) & (torch.arange(ids.numel()) < total_rows.long()[0])
    q = torch.zeros(ids.numel(), K, dtype=torch.uint8)
    s = torch.zeros(ids.numel(), K // _q.MX_BLOCK, dtype=torch.uint8)
    q[live] = xq.view(torch.uint8)[ids[live] // topk]
    s[live] = xs[ids[live] // topk]
    return q.view(F8), (s if layout == "plain" else _ex.swizzle_scales(s))


@mxfp8_gather_routed.register_fake
def _(xq, xs, sorted_token_ids, total_rows, topk, layout):
    return _quant_outputs(xq, sorted_token_ids.shape[0], xq.shape[1], layout)


# --------------------------------------------------------------------------- router ----
def _route_cpu(logits, bias, num_experts, n_group, topk_group, top_k, routed_scaling_factor, score, tile_m):
    cfg = _rt.RouterConfig(num_experts=logits.shape[1], n_group=n_group, topk_group=topk_group, top_k=top_k,
                           routed_scaling_factor=routed_scaling_factor, tile_m=tile_m, score=score)
    ids, w = _rt.topk_torch(logits, bias, cfg)
    return (ids.int(), w, *_rt.align_torch(ids, cfg.num_experts, tile_m, *_rt.capacity(cfg, logits.shape[0])))


#: the op's eager hot path: per (its scalar arguments, logits shape / dtype, bias or not, device)
#: the layout's capacities and whether the grid path (the one that reads the zeroed counter
#: workspace) serves, filled by a first validated call, and the router's tensor entries
_ROUTE_PLAN: dict = {}
_ROUTE_FNS: dict = {}


def _route_outputs(logits: Tensor, T: int, E: int, k: int, slots: int, tiles: int) -> tuple[Tensor, ...]:
    i32 = dict(dtype=torch.int32)
    return (logits.new_empty(T, k, **i32), logits.new_empty(T, k, dtype=torch.float32), logits.new_empty(E, **i32),
            logits.new_empty(E + 1, **i32), logits.new_empty(slots, **i32), logits.new_empty(tiles, **i32),
            logits.new_empty(1, **i32), logits.new_empty(T * k, **i32))


@cuda_op("moe_route")
def moe_route(logits: Tensor, bias: Tensor | None, num_experts: int, n_group: int, topk_group: int, top_k: int,
              routed_scaling_factor: float, score: str, tile_m: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                               Tensor, Tensor, Tensor]:
    """The fused router (:mod:`moe.router`): ``(topk_ids [T, k] int32, topk_weights [T, k]
    fp32, expert_counts [E], expert_offsets [E + 1], sorted_token_ids [slots],
    tile_expert [tiles], total_rows [1], routed_row_pos [T k])``, capacities for this T.

    After a first validated call per key, a call allocates its outputs and launches the
    router's tensor entry (its C checks refuse what does not match; the validated path then
    names it). Only the grid path (T above the cluster path's) reads the counter workspace, a
    fresh zeroed one per call: a functional op keeps no state, so nothing it allocates outlives
    a torch.compile CUDA-graph pool's recording; the other paths get an output as a stand-in,
    never read."""
    key = (num_experts, n_group, topk_group, top_k, routed_scaling_factor, score, tile_m, logits.shape, logits.dtype,
           bias is None, logits.get_device())
    plan = _ROUTE_PLAN.get(key) if jit.TVM_FFI else None
    if plan is not None:
        slots, tiles, grid_path = plan
        E, k, T = num_experts, top_k, logits.shape[0]
        out = _route_outputs(logits, T, E, k, slots, tiles)
        ws = logits.new_zeros(E + 1, dtype=torch.int32) if grid_path else out[3]
        no_bias = logits.new_empty(E, dtype=torch.float32) if bias is None else bias  # (unread)
        # (token ids and table: stand-ins of their shapes, unread without hash routing)
        if jit.launch_tensor_entry(_ROUTE_FNS, key, logits, no_bias, out[7][:T], out[0], *out[:7], ws, out[7]):
            return out
    cfg = _rt.RouterConfig(num_experts=num_experts, n_group=n_group, topk_group=topk_group, top_k=top_k,
                           routed_scaling_factor=routed_scaling_factor, tile_m=tile_m, score=score)
    cfg.validate()
    T = logits.shape[0] if logits.dim() == 2 else 0  # (route names a wrong rank)
    slots, tiles = _rt.capacity(cfg, T)
    out = _rt.RouterOutput(*_route_outputs(logits, T, num_experts, top_k, slots, tiles))
    _rt.route(logits, bias, cfg, out=out, workspace=logits.new_zeros(num_experts + 1, dtype=torch.int32))
    if T == 0:  # (no launch) no rows: every count, offset and the total are zero, as on the CPU
        for t in (out.expert_counts, out.expert_offsets, out.total_rows):
            t.zero_()
    elif jit.TVM_FFI:
        config = _rt.kernel_config(cfg, logits.dtype, bias is not None, T)
        _ROUTE_PLAN[key] = (slots, tiles, not config["single_cta"] and "cluster" not in config)
        jit.remember_tensor_entry(_ROUTE_FNS, key, "moe_router_tensors", current_arch(logits.device), **config)
    return (out.topk_ids, out.topk_weights, out.expert_counts, out.expert_offsets, out.sorted_token_ids,
            out.tile_expert, out.total_rows, out.routed_row_pos)


moe_route.register_kernel("cpu")(_route_cpu)


@moe_route.register_fake
def _(logits, bias, num_experts, n_group, topk_group, top_k, routed_scaling_factor, score, tile_m):
    T, E = logits.shape
    cfg = _rt.RouterConfig(num_experts=E, n_group=n_group, topk_group=topk_group, top_k=top_k,
                           routed_scaling_factor=routed_scaling_factor, tile_m=tile_m, score=score)
    return _route_outputs(logits, T, E, top_k, *_rt.capacity(cfg, T))


# ---------------------------------------------------------------------- expert GEMMs ----
@cuda_op("moe_expert_gemm")
def moe_expert_gemm(a_q: Tensor, a_scales: Tensor, w_q: Tensor, w_scales: Tensor, expert_offsets: Tensor,
                    expert_counts: Tensor, tile_expert: Tensor, routed_rows: int) -> Tensor:
    """``y [rows, N]`` bf16: each expert's MXFP8 rows times its MXFP8 weights (padding rows
    unspecified)."""
    return _ex.moe_expert_gemm(a_q, a_scales, w_q, w_scales, expert_offsets, expert_counts, tile_expert,
                               routed_rows=routed_rows)


@moe_expert_gemm.register_kernel("cpu")
def _(a_q, a_scales, w_q, w_scales, expert_offsets, expert_counts, tile_expert, routed_rows):
    out = torch.zeros(a_q.shape[0], w_q.shape[1], dtype=torch.bfloat16)
    return _ex.expert_gemm_torch(a_q.view(torch.uint8), a_scales, w_q.view(torch.uint8), w_scales, expert_offsets,
                                 out)


@moe_expert_gemm.register_fake
def _(a_q, a_scales, w_q, w_scales, expert_offsets, expert_counts, tile_expert, routed_rows):
    return a_q.new_empty(a_q.shape[0], w_q.shape[1], dtype=torch.bfloat16)


@cuda_op("moe_expert_gate_up")
def moe_expert_gate_up(a_q: Tensor, a_scales: Tensor, w_q: Tensor, w_scales: Tensor, expert_offsets: Tensor,
                       expert_counts: Tensor, tile_expert: Tensor, routed_rows: int,
                       swiglu_limit: float | None) -> tuple[Tensor, Tensor]:
    """The gate/up GEMM (weights interleaved, :func:`moe.experts.interleave_gate_up`), clamp,
    SiLU(gate) * up, MXFP8 requantised: ``(h_q [rows, N/2] e4m3, swizzled scales)``."""
    return _ex.moe_expert_gate_up(a_q, a_scales, w_q, w_scales, expert_offsets, expert_counts, tile_expert,
                                  routed_rows=routed_rows, swiglu_limit=swiglu_limit)


@moe_expert_gate_up.register_kernel("cpu")
def _(a_q, a_scales, w_q, w_scales, expert_offsets, expert_counts, tile_expert, routed_rows, swiglu_limit):
    y = torch.zeros(a_q.shape[0], w_q.shape[1], dtype=torch.bfloat16)
    _ex.expert_gemm_torch(a_q.view(torch.uint8), a_scales, w_q.view(torch.uint8), w_scales, expert_offsets, y)
    return _quant_cpu(_ex.silu_mul_interleaved(y, swiglu_limit), "swizzled")


@moe_expert_gate_up.register_fake
def _(a_q, a_scales, w_q, w_scales, expert_offsets, expert_counts, tile_expert, routed_rows, swiglu_limit):
    return _quant_outputs(a_q, a_q.shape[0], w_q.shape[1] // 2, "swizzled")


# ------------------------------------------------------------------------- finalize ----
@cuda_op("moe_finalize")
def moe_finalize(y: Tensor, topk_weights: Tensor, routed_row_pos: Tensor, shared: Tensor | None) -> Tensor:
    """``bf16(sum_i w[t, i] y[pos[t, i]])`` (rounded products, summed in choice order), then
    ``+ shared`` with its own bf16 rounding when given (:mod:`moe.finalize`)."""
    out = (y.new_empty(topk_weights.shape[0], y.shape[1], dtype=torch.bfloat16)
           if y.dim() == 2 and topk_weights.dim() == 2 else None)
    return _fin.moe_finalize(y, topk_weights, routed_row_pos, shared, out=out)


@moe_finalize.register_kernel("cpu")
def _(y, topk_weights, routed_row_pos, shared):
    T, k = topk_weights.shape
    rows = y[routed_row_pos.long()].view(T, k, -1).float()
    acc = torch.zeros(T, y.shape[1])
    for i in range(k):
        acc = acc + topk_weights[:, i:i + 1] * rows[:, i]
    out = acc.to(torch.bfloat16)
    return out if shared is None else (out.float() + shared.float()).to(torch.bfloat16)


@moe_finalize.register_fake
def _(y, topk_weights, routed_row_pos, shared):
    return y.new_empty(topk_weights.shape[0], y.shape[1], dtype=torch.bfloat16)


def moe_block(x: Tensor, router_logits: Tensor, bias: Tensor | None, gu_q: Tensor, gu_s: Tensor, d_q: Tensor,
              d_s: Tensor, shared: Tensor | None, *, n_group: int = 1, topk_group: int = 1, top_k: int = 6,
              routed_scaling_factor: float = 1.5, score: str = "sqrtsoftplus",
              swiglu_limit: float | None = None) -> Tensor:
    """A routed MoE layer in ops (router -> routed MXFP8 quantisation -> gate/up -> down ->
    finalize + shared add), the composition ``torch.compile`` traces whole: bf16 ``x [T, C]``,
    the router's logits, MXFP8 expert weights from :func:`moe.experts.quantize_expert_weights`
    (gate/up interleaved)."""
    T = x.shape[0]
    E = gu_q.shape[0]
    ops = torch.ops.cute_kernels
    ids, w, counts, offsets, sorted_ids, tiles, total, pos = ops.moe_route(
        router_logits, bias, E, n_group, topk_group, top_k, routed_scaling_factor, score, 128)
    aq, asc = ops.mxfp8_quantize_routed(x, sorted_ids, total, top_k, "swizzled")
    hq, hs = ops.moe_expert_gate_up(aq, asc, gu_q, gu_s, offsets, counts, tiles, T * top_k, swiglu_limit)
    y = ops.moe_expert_gemm(hq, hs, d_q, d_s, offsets, counts, tiles, T * top_k)
    return ops.moe_finalize(y, w, pos, shared)


