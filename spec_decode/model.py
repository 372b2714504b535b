"""DeepSeek-V4 decoder, reference backend: the specification (plain PyTorch, FP32 by default).

Follows huggingface/transformers ``models/deepseek_v4/modular_deepseek_v4.py`` and DeepSeek's
checkpoint layout (tensor names in :mod:`spec_decode.weights`). Per layer, ``n`` mHC residual
streams ``X [B, S, n, C]``::

    mHC (attn) -> collapse -> RMSNorm -> attention -> expand/mix
    mHC (ffn)  -> collapse -> RMSNorm -> MoE       -> expand/mix

then V4's learned collapse of the streams (``hc_head``), RMSNorm and the LM head.

**mHC** (``fn [2n + n*n, n*C]``, ``base``, ``scale [3]``): ``P = rsqrt(mean(x^2) + eps) * (x @
fn^T)`` over the flattened streams; ``pre = sigmoid(s0 P[:n] + b) + hc_eps``, ``post = 2
sigmoid(s1 P[n:2n] + b)``, ``comb = Sinkhorn(softmax_rows(s2 P[2n:] + b) + hc_eps)`` -- a
column normalisation, then ``iters - 1`` (row, column) rounds, each denominator ``+ hc_eps``
(DeepSeek's ``hc_split_sinkhorn``). Collapse ``u = sum_i pre_i X_i``; mix ``X_i' = post_i f +
sum_j comb_ij X_j`` (transformers' ``matmul(comb, X)``). ``hc_head``: ``pre = sigmoid(s P +
b) + hc_eps`` (``n`` mappings), ``u = sum_i pre_i X_i``.

**Attention** (one 512-wide KV head read as both K and V; ``H`` query heads):
``q = rope(unweighted_rmsnorm_per_head(q_b(rmsnorm(q_a h))))``, ``kv = rope(rmsnorm(wkv h))``.
Keys: the raw ``kv`` of positions ``(p - window, p]`` plus, in compressed layers, compressed
entries -- HCA (ratio ``m' = 128``) every visible entry, CSA (``m = 4``) the indexer's top-k
of the visible ones. Entry ``i`` pools positions ``[i m, (i + 1) m)`` (CSA: also the window
before, through the low half of its channels) and is visible to a query at ``p`` iff ``(i + 1)
m <= p + 1`` (its window is whole). Logits ``q.k / sqrt(head_dim)`` with a learned per-head
sink logit in the softmax denominator; ``o = sum p_k k``, then the inverse RoPE of ``o``'s RoPE
slice at ``p``; WO-A (groups of ``H / G`` heads, token-major) then WO-B.

**Compressor** (``wkv``, ``wgate`` to ``coff * d`` channels, ``coff`` = 2 for CSA, 1 for HCA;
``ape [m, coff * d]``, a bias per position in the window): entry ``i`` = ``rope(rmsnorm(sum_r
softmax_r(gate_r) kv_r))`` per channel over its rows ``r`` -- HCA: the window's ``m`` rows;
CSA: the previous window's rows on channels ``[:d]`` and this window's on ``[d:]`` (``2m``
rows; entry 0's previous rows are zero with gate ``-inf``) -- RoPE'd at the window's first
position ``i m``. The CSA indexer runs the same compressor at ``indexer_dim`` and scores
``sum_h w_h relu(q_h . k) / sqrt(D_I)``, ``w = weights_proj(h) / sqrt(H_I)``, ``q_h`` from the
q-LoRA output; top-k, ties to the lower entry.

**RoPE**: interleaved pairs on the last ``rope_dim`` dims; window-only layers use
``rope_theta``, compressed layers (their queries, keys, entries and indexer)
``compress_rope_theta`` with YaRN (factor 16, original 65536, betas 32 / 1; magnitude 1).

**MoE**: ``s = sqrt(softplus(h W_r^T))`` (FP32); top-k of ``s + bias`` (ties to the lower
expert) or, in the first ``n_hash_layers``, ``tid2eid[token]``; weights ``s[ids] / sum *
routed_scaling_factor``; routed SwiGLU experts with ``gate <= limit``, ``|up| <= limit`` before
``silu(gate) * up`` (transformers' routed experts; the shared expert is unclamped); plus the
shared expert.

This module is the reference: it keeps every position's raw projections (:class:`History`) and
recomputes each query's window, entries and selection from them in per-token loops, so a
rejected speculative token can leave no trace by construction. The step model
(:mod:`spec_decode.step_model`) computes the same from fixed-size state.
"""

from __future__ import annotations

import contextlib
import math
import threading

import torch
import torch.nn.functional as F

from .config import ModelConfig


# ----------------------------------------------------------------------------------- math ----
def rmsnorm(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    y = x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
    return y if weight is None else y * weight


def rope_inv_freq(cfg: ModelConfig, compressed: bool, device=None) -> torch.Tensor:
    """FP32 ``[rope_dim / 2]`` angular frequencies: ``rope_theta`` (window-only layers), or
    ``compress_rope_theta`` with YaRN's frequency blend (compressed layers; DeepSeek's
    ``precompute_freqs_cis``)."""
    dim = cfg.rope_dim
    base = cfg.compress_rope_theta if compressed else cfg.rope_theta
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    if not compressed:
        return freqs

    def corr(rot):  # the dim whose wavelength fits `rot` turns in the original context
        return dim * math.log(cfg.yarn_original_len / (rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr(cfg.yarn_beta_fast)), 0)
    high = min(math.ceil(corr(cfg.yarn_beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    smooth = 1 - ramp
    return freqs / cfg.yarn_factor * (1 - smooth) + freqs * smooth


_FORWARD = threading.local()  # per thread: simulated tensor-parallel ranks run forwards side by side


@contextlib.contextmanager
def forward_tables():
    """Scope of one forward: inside it, :func:`forward_memo` builds each table derived from the
    step's positions (RoPE's rotations, the rings' gather indices, the compressors' entry
    indices) once and hands the same tensor to every later call -- every layer of a step
    shares its positions. The same numbers, fewer kernels; nothing cached outlives the scope."""
    outer = getattr(_FORWARD, "tables", None)
    _FORWARD.tables = {} if outer is None else outer
    try:
        yield
    finally:
        _FORWARD.tables = outer


def forward_memo(key: tuple, inputs: tuple, build):
    """``build()`` once per forward for ``key`` (ids of ``inputs``, the tensors it derives from,
    plus any parameters); outside :func:`forward_tables`, every call. The entry holds
    ``inputs``, so their ids cannot be reused while it lives."""
    tables = getattr(_FORWARD, "tables", None)
    if tables is None:
        return build()
    full = key + tuple(id(t) for t in inputs)
    hit = tables.get(full)
    if hit is None:
        hit = tables[full] = (inputs, build())
    return hit[1]


def rope_table(pos: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """``exp(i pos * inv_freq)`` (``inverse``: its conjugate), complex64 ``[*pos, len(inv_freq)]``
    from FP32 angles: what :func:`rope` multiplies by (``torch.view_as_real``: (cos, sin) pairs).
    Built once per forward."""
    def cis():
        # the integer positions convert to FP32 exactly inside the product (|pos| < 2^24)
        return torch.polar(torch.ones((), device=pos.device), pos[..., None] * inv_freq)

    c = forward_memo(("rope",), (pos, inv_freq), cis)
    return forward_memo(("rope_inverse",), (c,), lambda: c.conj().resolve_conj()) if inverse else c


def rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last ``2 len(inv_freq)`` features of x ``[*pos.shape, ..., d]`` in adjacent
    pairs by ``pos * inv_freq`` (``inverse``: by minus that). ``pos`` has x's leading dims. As
    DeepSeek's ``apply_rotary_emb``: the pairs as complex numbers in FP32 times ``exp(i
    angle)`` (FP32 angles), one rounding to x's dtype."""
    r = 2 * inv_freq.shape[0]
    c = rope_table(pos, inv_freq, inverse)
    c = c.view(*pos.shape, *([1] * (x.dim() - pos.dim() - 1)), r // 2)
    pairs = torch.view_as_complex(x[..., -r:].float().unflatten(-1, (r // 2, 2)).contiguous())
    rot = torch.view_as_real(pairs * c).flatten(-2).to(x.dtype)
    return torch.cat([x[..., :-r], rot], -1)


def mhc_mappings(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, cfg: ModelConfig):
    """(pre [.., n], post [.., n], comb [.., n, n]) of the streams X ``[B, S, n, C]``."""
    n, e = cfg.mhc_n, cfg.hc_eps
    Xf = X.flatten(-2).float()  # the mappings in FP32 (fn, base and scale are FP32 tensors)
    P = torch.rsqrt(Xf.square().mean(-1, keepdim=True) + cfg.eps) * (Xf @ fn.float().T)
    pre = torch.sigmoid(scale[0] * P[..., :n] + base[:n]) + e
    post = 2 * torch.sigmoid(scale[1] * P[..., n:2 * n] + base[n:2 * n])
    comb = (scale[2] * P[..., 2 * n:] + base[2 * n:]).unflatten(-1, (n, n)).softmax(-1) + e
    comb = comb / (comb.sum(-2, keepdim=True) + e)
    for _ in range(cfg.mhc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + e)
        comb = comb / (comb.sum(-2, keepdim=True) + e)
    return pre, post, comb


def pre_mix(X, pre):
    return torch.einsum("bsi,bsic->bsc", pre, X)


def post_mix(X, post, comb, f):
    return torch.einsum("bsij,bsjc->bsic", comb, X) + post[..., None] * f[..., None, :]


def hc_head(X: torch.Tensor, W: dict, cfg: ModelConfig, prefix: str = "") -> torch.Tensor:
    """V4's final collapse of the streams ``X [B, S, n, C]`` -> ``[B, S, C]`` (weights in FP32)."""
    Xf = X.flatten(-2).float()
    P = torch.rsqrt(Xf.square().mean(-1, keepdim=True) + cfg.eps) * (Xf @ W[prefix + "hc_head_fn"].float().T)
    pre = torch.sigmoid(P * W[prefix + "hc_head_scale"][0] + W[prefix + "hc_head_base"]) + cfg.hc_eps
    return pre_mix(X.float(), pre).to(X.dtype)


def sqrt_softplus(logits: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(F.softplus(logits.float()))


def route(h: torch.Tensor, L: dict, cfg: ModelConfig, tokens: torch.Tensor | None):
    """(ids [N, k], weights [N, k] fp32) of normed h [N, C]: hash-routed where ``L`` holds a
    ``tid2eid`` table (``tokens [N]`` the token ids), else top-k of score + bias."""
    s = sqrt_softplus(h.float() @ L["ffn.gate.weight"].float().T)
    if "ffn.gate.tid2eid" in L:
        ids = L["ffn.gate.tid2eid"][tokens].long()
    else:
        ids = torch.sort(s + L["ffn.gate.bias"].float(), dim=-1, descending=True, stable=True).indices[:, :cfg.top_k]
    w = s.gather(1, ids)
    return ids, w / (w.sum(-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor


def swiglu(g: torch.Tensor, u: torch.Tensor, limit: float | None) -> torch.Tensor:
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return F.silu(g) * u


def shared_expert(h: torch.Tensor, L: dict) -> torch.Tensor:
    p = "ffn.shared_experts."
    return swiglu(h @ L[p + "w1.weight"].T, h @ L[p + "w3.weight"].T, None) @ L[p + "w2.weight"].T


def moe_gathered(h: torch.Tensor, L: dict, cfg: ModelConfig, tokens: torch.Tensor | None,
                 first_expert: int = 0) -> torch.Tensor:
    """Routed + shared experts of normed h [N, C], gathering each choice's expert weights (the
    spec; far too big for real sizes on a GPU). An expert-parallel shard (``L`` holding experts
    ``first_expert ..`` and a slice of the shared expert) returns its partial sum: choices of
    other ranks' experts contribute nothing."""
    ids, w = route(h, L, cfg, tokens)
    n_local = L["ffn.experts.w1"].shape[0]
    out = torch.zeros_like(h)
    for i in range(ids.shape[1]):  # finalize: weighted sum over the k choices, in order
        e = ids[:, i] - first_expert
        mine = (e >= 0) & (e < n_local)
        e = e.clamp(0, n_local - 1)
        g = torch.einsum("nc,nic->ni", h, L["ffn.experts.w1"][e])
        u = torch.einsum("nc,nic->ni", h, L["ffn.experts.w3"][e])
        y = torch.einsum("ni,nci->nc", swiglu(g, u, cfg.swiglu_limit), L["ffn.experts.w2"][e])
        out = out + torch.where(mine[:, None], w[:, i:i + 1].to(h.dtype) * y, torch.zeros_like(y))
    return out + shared_expert(h, L)


def compress_entries(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, norm_w: torch.Tensor, overlap: bool,
                     entry_pos: torch.Tensor, inv_freq: torch.Tensor, eps: float, norm_rope=None) -> torch.Tensor:
    """Compressed entries from their windows' raw projections.

    ``kv``, ``gate [..., rows, coff * d]``: HCA (``overlap=False``) the window's ``m`` rows;
    CSA (``overlap=True``) ``2m`` rows, the previous window's then this one's (a missing
    previous window: kv 0, gate ``-inf``). ``ape [m, coff * d]`` is added per position in
    the window. Returns ``[..., d]``: softmax over the rows per channel (FP32, rounded to kv's
    dtype), the weighted sum, RMSNorm, RoPE at ``entry_pos`` (the leading dims) -- the last two
    by ``norm_rope(x, eps, weight, pos, inv_freq)`` if given (another implementation of both)."""
    d = norm_w.shape[0]
    m = ape.shape[0]
    if overlap:
        g = gate + ape.repeat(2, 1)
        kv = torch.cat([kv[..., :m, :d], kv[..., m:, d:]], -2)
        g = torch.cat([g[..., :m, :d], g[..., m:, d:]], -2)
    else:
        g = gate + ape
    w = g.float().softmax(-2).to(kv.dtype)
    pooled = (kv * w).sum(-2)
    if norm_rope is not None:
        return norm_rope(pooled, eps, norm_w, entry_pos, inv_freq)
    return rope(rmsnorm(pooled, eps, norm_w), entry_pos, inv_freq)


def sink_attention(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor | None, sink: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """``q [..., H, d]``, ``keys [..., K, d]`` (also the values), ``valid [..., K]`` bool or
    None, ``sink [H]`` -> ``[..., H, d]``: softmax over the keys with ``exp(sink_h)`` added to
    each head's denominator (computed in FP32)."""
    kf = keys.float()  # once: the keys are also the values
    logits = torch.einsum("...hd,...kd->...hk", q.float(), kf) * scale
    if valid is not None:
        logits = logits.masked_fill(~valid[..., None, :], float("-inf"))
    s = sink.float().view(*([1] * (logits.dim() - 2)), -1, 1).expand(*logits.shape[:-1], 1)
    p = torch.cat([logits, s], -1).softmax(-1)[..., :-1]
    return torch.einsum("...hk,...kd->...hd", p, kf).to(q.dtype)


def visible_entries(pos: torch.Tensor, ratio: int) -> torch.Tensor:
    """Compressed entries a query at ``pos`` sees: ``(pos + 1) // ratio`` (0 for ``pos < 0``)."""
    return torch.div(pos + 1, ratio, rounding_mode="floor").clamp_min(0)


# -------------------------------------------------------------------------------- weights ----
#: a layer's routed experts as the kernel backends read them, in place of ``ffn.experts.w1 / w3 /
#: w2`` once converted (:func:`spec_decode.fused_ops.quantize_layer_experts`)
EXPERT_OPERANDS = ("ffn.experts.gate_up_q", "ffn.experts.gate_up_s", "ffn.experts.down_q", "ffn.experts.down_s")


def layer_weight_shapes(cfg: ModelConfig, li: int | None, *, hash_routed: bool, ratio: int) -> dict:
    """``{name: shape}`` of one decoder layer's tensors (names relative to ``layers.{i}.``,
    DeepSeek's checkpoint names; routed experts stacked as ``ffn.experts.w1 [E, I, C]``, ``w3``,
    ``w2 [E, C, I]``)."""
    C, n, H, hd = cfg.hidden, cfg.mhc_n, cfg.heads, cfg.head_dim
    G, R, E, I = cfg.wo_groups, cfg.wo_rank, cfg.experts, cfg.expert_inter
    mix = (2 + n) * n
    s = {}
    for site in ("attn", "ffn"):
        s[f"hc_{site}_fn"], s[f"hc_{site}_base"], s[f"hc_{site}_scale"] = (mix, n * C), (mix,), (3,)
    s["attn_norm.weight"], s["ffn_norm.weight"] = (C,), (C,)
    s["attn.wq_a.weight"], s["attn.q_norm.weight"], s["attn.wq_b.weight"] = (cfg.q_lora, C), (cfg.q_lora,), (H * hd, cfg.q_lora)
    s["attn.wkv.weight"], s["attn.kv_norm.weight"] = (hd, C), (hd,)
    s["attn.wo_a.weight"], s["attn.wo_b.weight"], s["attn.attn_sink"] = (G * R, H * hd // G), (C, G * R), (H,)
    if ratio:
        coff = 2 if ratio == cfg.csa_ratio else 1
        p = "attn.compressor."
        s[p + "wkv.weight"], s[p + "wgate.weight"] = (coff * hd, C), (coff * hd, C)
        s[p + "ape"], s[p + "norm.weight"] = (ratio, coff * hd), (hd,)
    if ratio == cfg.csa_ratio:
        p, D = "attn.indexer.", cfg.indexer_dim
        s[p + "wq_b.weight"], s[p + "weights_proj.weight"] = (cfg.indexer_heads * D, cfg.q_lora), (cfg.indexer_heads, C)
        s[p + "compressor.wkv.weight"], s[p + "compressor.wgate.weight"] = (2 * D, C), (2 * D, C)
        s[p + "compressor.ape"], s[p + "compressor.norm.weight"] = (ratio, 2 * D), (D,)
    s["ffn.gate.weight"] = (E, C)
    if hash_routed:
        s["ffn.gate.tid2eid"] = (cfg.vocab, cfg.top_k)
    else:
        s["ffn.gate.bias"] = (E,)
    s["ffn.experts.w1"], s["ffn.experts.w3"], s["ffn.experts.w2"] = (E, I, C), (E, I, C), (E, C, I)
    p = "ffn.shared_experts."
    s[p + "w1.weight"], s[p + "w3.weight"], s[p + "w2.weight"] = (cfg.shared_inter, C), (cfg.shared_inter, C), (C, cfg.shared_inter)
    return s


def init_layer(cfg: ModelConfig, shapes: dict, w, g: torch.Generator, dtype, device) -> dict:
    """Seeded random weights for ``shapes``: matrices ~ N(0, 1/fan_in), norm weights ~ 1, mHC
    scales 1 and small biases, sinks and compressor biases small, a random distinct
    ``tid2eid`` row per token."""
    L = {}
    for name, shape in shapes.items():
        if name.endswith("tid2eid"):
            L[name] = torch.rand(shape[0], cfg.experts, generator=g, device=device).argsort(-1)[:, :shape[1]]
        elif name.endswith("norm.weight"):
            L[name] = 1 + w(*shape, scale=0.1)
        elif name.endswith("_scale"):
            L[name] = torch.ones(shape, dtype=torch.float32, device=device)
        elif name.endswith("_base"):
            L[name] = w(*shape, scale=0.1).float()
        elif name.endswith("_fn"):
            L[name] = w(*shape).float()
        elif name.endswith(("attn_sink", "ape", "gate.bias")):
            L[name] = w(*shape, scale=0.1 if not name.endswith("attn_sink") else 1.0)
        else:
            L[name] = w(*shape)
    return L


class WeightFactory:
    """``w(*shape, scale=None)``: N(0, 1) * scale (default ``1 / sqrt(fan_in)``) from one
    seeded generator, made where it lives (a CUDA model's weights never touch the host)."""

    def __init__(self, seed: int, dtype, device):
        self.dev, self.dtype = torch.device(device), dtype
        self.g = torch.Generator(device=self.dev).manual_seed(seed)

    def __call__(self, *shape, scale=None):
        t = torch.randn(*shape, generator=self.g, device=self.dev, dtype=self.dtype)
        return t.mul_(scale if scale is not None else 1.0 / math.sqrt(shape[-1]))


# -------------------------------------------------------------------------------- history ----
class History:
    """The reference's state: every position's raw projections, ``[slots, max_len, ...]`` per
    layer (window KV; compressor and indexer ``kv`` / ``gate`` rows). A step writes its positions
    before its queries read positions ``<= p``, so what a rejected token wrote is overwritten
    before anything reads it."""

    def __init__(self, cfg: ModelConfig, slots: int, max_len: int, dtype, device):
        self.slots, self.max_len = slots, max_len
        z = lambda *s: torch.zeros(slots, max_len, *s, dtype=dtype, device=device)  # noqa: E731
        self.kv, self.ckv, self.cgate, self.ikv, self.igate = [], {}, {}, {}, {}
        for li in range(cfg.layers):
            r = cfg.ratio(li)
            self.kv.append(z(cfg.head_dim))
            if r:
                coff = 2 if r == cfg.csa_ratio else 1
                self.ckv[li], self.cgate[li] = z(coff * cfg.head_dim), z(coff * cfg.head_dim)
            if r == cfg.csa_ratio:
                self.ikv[li], self.igate[li] = z(2 * cfg.indexer_dim), z(2 * cfg.indexer_dim)


def entries_from_rows(kv_rows: torch.Tensor, gate_rows: torch.Tensor, n: int, ratio: int, overlap: bool,
                      ape, norm_w, inv_freq, eps) -> torch.Tensor:
    """Entries ``0..n-1`` ``[n, d]`` from one sequence's rows ``[>= n * ratio, ch]`` (the spec:
    every window recomputed)."""
    ch = kv_rows.shape[-1]
    if n == 0:
        return kv_rows.new_zeros(0, norm_w.shape[0])
    kv = kv_rows[:n * ratio].view(n, ratio, ch)
    gate = gate_rows[:n * ratio].view(n, ratio, ch)
    if overlap:
        kv = torch.cat([torch.cat([kv.new_zeros(1, ratio, ch), kv[:-1]]), kv], 1)
        gate = torch.cat([torch.cat([gate.new_full((1, ratio, ch), float("-inf")), gate[:-1]]), gate], 1)
    pos = torch.arange(n, device=kv.device) * ratio
    return compress_entries(kv, gate, ape, norm_w, overlap, pos, inv_freq, eps)


# ---------------------------------------------------------------------------------- model ----
class TargetModel:
    """A DeepSeek-V4 model's weights (``self.w``: global tensors by checkpoint name;
    ``self.layers[i]``: layer ``i``'s, names relative to ``layers.{i}.``) and the reference
    forward."""

    def __init__(self, cfg: ModelConfig, seed: int = 0, dtype=torch.float32, device="cpu", on_layer=None):
        """``on_layer``: called with each layer's weights as they are made (draws nothing): the
        kernel backends turn the routed experts into their MXFP8 operands there
        (:func:`spec_decode.fused_ops.quantize_layer_experts`), so the model never holds every
        layer's bf16 experts at once."""
        cfg.validate()
        self.cfg, self.dtype, self.device = cfg, dtype, device
        keep = on_layer or (lambda L: L)
        w = WeightFactory(seed, dtype, device)
        C, n = cfg.hidden, cfg.mhc_n
        self.w = {"embed.weight": w(cfg.vocab, C, scale=1.0), "head.weight": w(cfg.vocab, C),
                  "norm.weight": 1 + w(C, scale=0.1), "hc_head_fn": w(n, n * C).float(),
                  "hc_head_base": w(n, scale=0.1).float(), "hc_head_scale": torch.ones(1, device=device)}
        self.layers = [keep(init_layer(cfg, layer_weight_shapes(cfg, li, hash_routed=cfg.is_hash(li),
                                                                ratio=cfg.ratio(li)), w, w.g, dtype, device))
                       for li in range(cfg.layers)]
        self.inv_freq = {False: rope_inv_freq(cfg, False, device), True: rope_inv_freq(cfg, True, device)}

    @property
    def embed(self):
        return self.w["embed.weight"]

    @property
    def lm_head(self):
        return self.w["head.weight"]

    # ------------------------------------------------------------ attention -------------
    def attention(self, h, L, li, pos, slots, hist: History):
        cfg = self.cfg
        B, S, _ = h.shape
        H, hd, m = cfg.heads, cfg.head_dim, cfg.ratio(li)
        inv = self.inv_freq[m > 0]
        inv_c = self.inv_freq[True]
        qr = rmsnorm(h @ L["attn.wq_a.weight"].T, cfg.eps, L["attn.q_norm.weight"])
        q = rope(rmsnorm((qr @ L["attn.wq_b.weight"].T).view(B, S, H, hd), cfg.eps), pos, inv)
        kv = rope(rmsnorm(h @ L["attn.wkv.weight"].T, cfg.eps, L["attn.kv_norm.weight"]), pos, inv)
        for b in range(B):
            hist.kv[li][slots[b], pos[b]] = kv[b]
            if m:
                hist.ckv[li][slots[b], pos[b]] = h[b] @ L["attn.compressor.wkv.weight"].T
                hist.cgate[li][slots[b], pos[b]] = h[b] @ L["attn.compressor.wgate.weight"].T
            if m == cfg.csa_ratio:
                hist.ikv[li][slots[b], pos[b]] = h[b] @ L["attn.indexer.compressor.wkv.weight"].T
                hist.igate[li][slots[b], pos[b]] = h[b] @ L["attn.indexer.compressor.wgate.weight"].T
        o = torch.empty(B, S, H, hd, dtype=h.dtype, device=h.device)
        for b in range(B):
            for s in range(S):
                p = int(pos[b, s])
                keys = hist.kv[li][slots[b], max(0, p - cfg.window + 1): p + 1]
                if m:
                    n = (p + 1) // m
                    ent = entries_from_rows(hist.ckv[li][slots[b]], hist.cgate[li][slots[b]], n, m,
                                            m == cfg.csa_ratio, L["attn.compressor.ape"],
                                            L["attn.compressor.norm.weight"], inv_c, cfg.eps)
                    if m == cfg.csa_ratio and n:
                        p_ = "attn.indexer."
                        ik = entries_from_rows(hist.ikv[li][slots[b]], hist.igate[li][slots[b]], n, m, True,
                                               L[p_ + "compressor.ape"], L[p_ + "compressor.norm.weight"], inv_c,
                                               cfg.eps)
                        qi = (qr[b, s] @ L[p_ + "wq_b.weight"].T).view(cfg.indexer_heads, cfg.indexer_dim)
                        qi = rope(qi, pos[b, s].expand(cfg.indexer_heads), inv_c)
                        wi = (h[b, s] @ L[p_ + "weights_proj.weight"].T).float() / math.sqrt(cfg.indexer_heads)
                        score = (torch.relu(ik.float() @ qi.float().T) * wi).sum(-1) / math.sqrt(cfg.indexer_dim)
                        sel = torch.sort(score, descending=True, stable=True).indices[:cfg.index_topk]
                        ent = ent[sel.sort().values]
                    keys = torch.cat([keys, ent])
                o[b, s] = sink_attention(q[b, s], keys, None, L["attn.attn_sink"], 1 / math.sqrt(hd))
        o = rope(o, pos, inv, inverse=True)
        return wo_a_ref(o, L["attn.wo_a.weight"], cfg) @ L["attn.wo_b.weight"].T

    # -------------------------------------------------------------- forward -------------
    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, hist: History):
        """tokens, pos [B, S] (absolute positions), slots [B]. Returns logits [B, S, V] and the
        draft's features [B, S, 3C] (the stream means after ``cfg.draft_feature_layers``)."""
        cfg = self.cfg
        X = self.embed[tokens][:, :, None, :].expand(-1, -1, cfg.mhc_n, -1).contiguous()
        feats = []
        for li, L in enumerate(self.layers):
            pre, post, comb = mhc_mappings(X, L["hc_attn_fn"], L["hc_attn_base"], L["hc_attn_scale"], cfg)
            h = rmsnorm(pre_mix(X, pre.to(X.dtype)), cfg.eps, L["attn_norm.weight"])
            X = post_mix(X, post.to(X.dtype), comb.to(X.dtype), self.attention(h, L, li, pos, slots, hist))
            pre, post, comb = mhc_mappings(X, L["hc_ffn_fn"], L["hc_ffn_base"], L["hc_ffn_scale"], cfg)
            h = rmsnorm(pre_mix(X, pre.to(X.dtype)), cfg.eps, L["ffn_norm.weight"])
            B, S, C = h.shape
            f = moe_gathered(h.reshape(-1, C), L, cfg, tokens.reshape(-1)).view(B, S, C)
            X = post_mix(X, post.to(X.dtype), comb.to(X.dtype), f)
            if li in cfg.draft_feature_layers:
                feats.append(X.mean(2))
        hidden = rmsnorm(hc_head(X, self.w, cfg).to(X.dtype), cfg.eps, self.w["norm.weight"])
        return hidden @ self.lm_head.T, torch.cat(feats, -1)


def wo_a_ref(o: torch.Tensor, wo_a: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """WO-A of ``o [B, S, H, hd]``: group g (heads ``g H/G ..``) times ``wo_a[g R:(g+1) R]``,
    token-major ``[B, S, G * R]`` (G from ``wo_a``'s rows: a tensor-parallel shard holds G / tp
    groups)."""
    B, S = o.shape[:2]
    R = cfg.wo_rank
    G = wo_a.shape[0] // R
    og = o.reshape(B, S, G, -1)
    return torch.einsum("bsgd,grd->bsgr", og, wo_a.view(G, R, -1)).reshape(B, S, G * R)
