"""DeepSeek-V4-class decoder, reference backend (plain PyTorch, FP32 by default).

Per layer (``n`` mHC residual streams ``X [B, L, n, C]``)::

    mHC pre-mix -> attention (low-rank q / kv, RoPE, indexer top-k candidates over the KV
    cache, attention over the selected keys) -> WO-A (token-major) -> WO-B -> mHC post-mix
    -> mHC pre-mix -> MoE (sigmoid grouped top-k router, SwiGLU experts, shared expert,
    finalize) -> mHC post-mix

then the streams are averaged, normalised and projected by the LM head. The mHC mappings:
``r = rsqrt(mean(X^2) + eps)``, ``P = (X * r) @ phi``,
``H_pre = sigmoid(a_pre P[:n] + b_pre)``, ``H_post = 2 sigmoid(a_post P[n:2n] + b_post)``,
``H_res = Sinkhorn(exp(a_res P[2n:] + b_res))``.

Weights are deterministic (seeded) random. The fused backend replaces these ops with the
project's kernels on the GPU; this module is the specification it is compared with, and the
backend the CPU tests run (speculative greedy decoding == plain greedy decoding).
"""

from __future__ import annotations

import math

import torch

from .config import ModelConfig


def rmsnorm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def rope(x: torch.Tensor, pos: torch.Tensor, dims: int) -> torch.Tensor:
    """Rotate the first ``dims`` features of every head of x [B, L, h, d] by position. The
    angles are computed in FP32 and rounded to x's dtype once: a bf16 position would round to
    a multiple of 32 beyond 4096."""
    half = dims // 2
    inv = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32, device=x.device) / half))
    ang = pos[..., None].float() * inv  # [B, L, half]
    cos, sin = ang.cos().to(x.dtype)[:, :, None, :], ang.sin().to(x.dtype)[:, :, None, :]
    x1, x2, rest = x[..., :half], x[..., half:dims], x[..., dims:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest], dim=-1)


def sinkhorn(m: torch.Tensor, iters: int) -> torch.Tensor:
    for _ in range(iters):
        m = m / m.sum(-1, keepdim=True)
        m = m / m.sum(-2, keepdim=True)
    return m


def grouped_topk(logits: torch.Tensor, bias: torch.Tensor, cfg: ModelConfig):
    """Sigmoid grouped top-k (ties -> lower index), the router spec of moe/router.py."""
    s = torch.sigmoid(logits)
    b = s + bias
    N, E = b.shape
    G, gs = cfg.n_group, cfg.experts // cfg.n_group
    top2 = torch.sort(b.view(N, G, gs), dim=-1, descending=True, stable=True).values[..., :2]
    gscore = top2[..., 0] + top2[..., 1]
    keep_g = torch.sort(gscore, dim=-1, descending=True, stable=True).indices[:, :cfg.topk_group]
    keep = torch.zeros(N, G, dtype=torch.bool, device=b.device).scatter_(1, keep_g, True)
    b = torch.where(keep.repeat_interleave(gs, dim=1), b, torch.full_like(b, float("-inf")))
    ids = torch.sort(b, dim=-1, descending=True, stable=True).indices[:, :cfg.top_k]
    w = s.gather(1, ids)
    w = w / (w.sum(-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor
    return ids, w


def mhc_mappings(X: torch.Tensor, L: dict, sub: str, cfg: ModelConfig):
    """(H_pre, H_post, H_res) of sublayer ``sub`` from the streams X [B, S, n, C]."""
    n = cfg.mhc_n
    Xf = X.flatten(-2)  # [B, S, n*C]
    r = torch.rsqrt(Xf.square().mean(-1, keepdim=True) + cfg.eps)
    P = (Xf * r) @ L[f"{sub}_phi"].T
    a_pre, a_post, a_res = L[f"{sub}_a"]
    h_pre = torch.sigmoid(a_pre * P[..., :n] + L[f"{sub}_b_pre"])
    h_post = 2 * torch.sigmoid(a_post * P[..., n:2 * n] + L[f"{sub}_b_post"])
    h_res = sinkhorn(torch.exp(a_res * P[..., 2 * n:].unflatten(-1, (n, n)) + L[f"{sub}_b_res"]),
                     cfg.mhc_sinkhorn_iters)
    return h_pre, h_post, h_res


def pre_mix(X, h_pre):
    return torch.einsum("bsi,bsic->bsc", h_pre, X)


def post_mix(X, h_post, h_res, f):
    return torch.einsum("bsij,bsjc->bsic", h_res, X) + h_post[..., None] * f[..., None, :]


def shared_expert(h: torch.Tensor, L: dict) -> torch.Tensor:
    return (torch.nn.functional.silu(h @ L["sh_gate"].T) * (h @ L["sh_up"].T)) @ L["sh_down"].T


def moe_gathered(h: torch.Tensor, L: dict, cfg: ModelConfig) -> torch.Tensor:
    """Routed + shared experts for normed h [N, C], gathering each choice's expert weights
    (the spec; far too big for real sizes on a GPU)."""
    ids, w = grouped_topk(h @ L["router"].T, L["router_bias"], cfg)
    out = torch.zeros_like(h)
    for i in range(cfg.top_k):  # finalize: weighted sum over the k choices, in order
        e = ids[:, i]
        g = torch.einsum("nc,nic->ni", h, L["gate"][e])
        up = torch.einsum("nc,nic->ni", h, L["up"][e])
        y = torch.einsum("ni,nci->nc", torch.nn.functional.silu(g) * up, L["down"][e])
        out = out + w[:, i:i + 1] * y
    return out + shared_expert(h, L)


class KVPool:
    """Preallocated per-request KV slots: ``[layers, slots, max_len, ...]``.

    ``k`` / ``v``: ``[..., heads, head_dim]`` each (``kv_cache="per_head"``), or
    (``"latent"``) ``k`` the cache entry ``[..., 1, rope_dim + kv_lora]`` -- the shared RoPE'd
    key, then the normed latent -- and ``v`` a view of its latent part: one key / value "head"
    that every query head attends (after absorbing ``k_b`` / ``v_b``)."""

    def __init__(self, cfg: ModelConfig, slots: int, max_len: int, dtype, device):
        self.slots, self.max_len, self.latent = slots, max_len, cfg.kv_cache == "latent"
        shape = (cfg.layers, slots, max_len)
        if self.latent:
            self.k = torch.zeros(*shape, 1, cfg.rope_dim + cfg.kv_lora, dtype=dtype, device=device)
            self.v = self.k[..., cfg.rope_dim:]
        else:
            self.k = torch.zeros(*shape, cfg.heads, cfg.head_dim, dtype=dtype, device=device)
            self.v = torch.zeros(*shape, cfg.heads, cfg.head_dim, dtype=dtype, device=device)
        self.k_idx = torch.zeros(*shape, cfg.indexer_dim, dtype=dtype, device=device)


def attention_query(h: torch.Tensor, L: dict, pos: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The RoPE'd queries ``[B, S, heads, head_dim]`` of normed hidden states ``h [B, S, C]``."""
    B, S, _ = h.shape
    return rope((rmsnorm(h @ L["q_a"].T, cfg.eps) @ L["q_b"].T).view(B, S, cfg.heads, cfg.head_dim), pos,
                cfg.rope_dim)


def kv_entries(h: torch.Tensor, L: dict, pos: torch.Tensor, cfg: ModelConfig):
    """What the KV pool stores for normed hidden states ``h [B, S, C]``: ``(k, v)``, every
    head's RoPE'd key and value ``[B, S, heads, head_dim]`` (``kv_cache="per_head"``), or
    ``(entry, None)`` (``"latent"``): ``[B, S, 1, rope_dim + kv_lora]``, the RoPE'd shared key
    then the normed latent (the pool's v is a view of it)."""
    r = cfg.rope_dim
    if cfg.kv_cache == "latent":
        c = h @ L["kv_a"].T  # [B, S, r + kv_lora]
        return torch.cat([rope(c[..., None, :r], pos, r), rmsnorm(c[..., None, r:], cfg.eps)], -1), None
    B, S, _ = h.shape
    lat = rmsnorm(h @ L["kv_a"].T, cfg.eps)
    k = rope((lat @ L["k_b"].T).view(B, S, cfg.heads, cfg.head_dim), pos, r)
    return k, (lat @ L["v_b"].T).view(B, S, cfg.heads, cfg.head_dim)


def latent_heads(entries: torch.Tensor, L: dict, cfg: ModelConfig):
    """Per-head keys and values ``[t, heads, head_dim]`` of latent cache entries ``[t, 1, r +
    kv_lora]`` (the spec; the step model absorbs ``k_b`` / ``v_b`` into the query / output)."""
    r, H, hd = cfg.rope_dim, cfg.heads, cfg.head_dim
    t, lat = entries.shape[0], entries[:, 0, r:]
    keys = torch.cat([entries[:, :, :r].expand(t, H, r), (lat @ L["k_b"].T).view(t, H, hd - r)], -1)
    return keys, (lat @ L["v_b"].T).view(t, H, hd)


class TargetModel:
    def __init__(self, cfg: ModelConfig, seed: int = 0, dtype=torch.float32, device="cpu"):
        cfg.validate()
        self.cfg, self.dtype, self.device = cfg, dtype, device
        # Generated where they live: a CUDA model's tens of GB of weights never touch the host
        # (the CPU and CUDA generators give different, each deterministic, weights).
        gdev = torch.device(device)
        g = torch.Generator(device=gdev).manual_seed(seed)

        def w(*shape, scale=None):
            fan_in = shape[-1]
            t = torch.randn(*shape, generator=g, device=gdev, dtype=dtype)
            return t.mul_(scale if scale is not None else 1.0 / math.sqrt(fan_in))

        C, n, H, hd = cfg.hidden, cfg.mhc_n, cfg.heads, cfg.head_dim
        G, R, E = cfg.wo_groups, cfg.wo_rank, cfg.experts
        self.embed = w(cfg.vocab, C, scale=1.0)
        self.lm_head = w(cfg.vocab, C)
        self.layers = []
        for _ in range(cfg.layers):
            L = {}
            for sub in ("attn", "moe"):
                L[f"{sub}_phi"] = w(2 * n + n * n, n * C)
                L[f"{sub}_a"] = torch.tensor([1.0, 1.0, 1.0], dtype=dtype, device=device)
                L[f"{sub}_b_pre"] = w(n, scale=0.1)
                L[f"{sub}_b_post"] = w(n, scale=0.1)
                L[f"{sub}_b_res"] = w(n, n, scale=0.1)
            L["q_a"], L["q_b"] = w(cfg.q_lora, C), w(H * hd, cfg.q_lora)
            if cfg.kv_cache == "latent":  # kv_a also makes the shared RoPE key; k_b the non-RoPE dims
                L["kv_a"], L["k_b"] = w(cfg.rope_dim + cfg.kv_lora, C), w(H * (hd - cfg.rope_dim), cfg.kv_lora)
            else:
                L["kv_a"], L["k_b"] = w(cfg.kv_lora, C), w(H * hd, cfg.kv_lora)
            L["v_b"] = w(H * hd, cfg.kv_lora)
            L["idx_q"], L["idx_w"], L["idx_k"] = (w(cfg.indexer_heads * cfg.indexer_dim, C),
                                                  w(cfg.indexer_heads, C), w(cfg.indexer_dim, C))
            L["wo_a"] = w(G, R, (H // G) * hd)
            L["wo_b"] = w(C, G * R)
            L["router"], L["router_bias"] = w(E, C), w(E, scale=0.1)
            L["gate"], L["up"] = w(E, cfg.expert_inter, C), w(E, cfg.expert_inter, C)
            L["down"] = w(E, C, cfg.expert_inter)
            L["sh_gate"], L["sh_up"], L["sh_down"] = (w(cfg.shared_inter, C), w(cfg.shared_inter, C),
                                                      w(C, cfg.shared_inter))
            self.layers.append(L)

    # ---------------------------------------------------------------- mHC ---------------
    def mhc_mappings(self, X: torch.Tensor, L: dict, sub: str):
        return mhc_mappings(X, L, sub, self.cfg)

    pre_mix = staticmethod(pre_mix)
    post_mix = staticmethod(post_mix)

    # ------------------------------------------------------------ attention -------------
    def attention(self, u, L, li, pos, slots, kv: KVPool):
        cfg = self.cfg
        B, S, _ = u.shape
        H, hd = cfg.heads, cfg.head_dim
        h = rmsnorm(u, cfg.eps)
        q = attention_query(h, L, pos, cfg)
        k, v = kv_entries(h, L, pos, cfg)
        q_idx = (h @ L["idx_q"].T).view(B, S, cfg.indexer_heads, cfg.indexer_dim)
        w_idx = h @ L["idx_w"].T
        k_idx = h @ L["idx_k"].T
        for b in range(B):
            kv.k[li, slots[b], pos[b]] = k[b]
            if v is not None:  # the latent pool's v is a view of its k
                kv.v[li, slots[b], pos[b]] = v[b]
            kv.k_idx[li, slots[b], pos[b]] = k_idx[b]
        o = torch.empty(B, S, H, hd, dtype=u.dtype, device=u.device)
        for b in range(B):
            for s in range(S):
                p = int(pos[b, s])
                keys = kv.k[li, slots[b], : p + 1]  # causal: keys 0..p of this sequence
                vals = kv.v[li, slots[b], : p + 1]
                if kv.latent:
                    keys, vals = latent_heads(keys, L, cfg)
                # lightning indexer: candidate keys, masked to the causal range
                score = (torch.relu(kv.k_idx[li, slots[b], : p + 1] @ q_idx[b, s].T) * w_idx[b, s]).sum(-1)
                # ties (exact zeros after the ReLUs are common) -> the lower key index, as the
                # indexer kernel's radix select breaks them
                sel = torch.sort(score, descending=True, stable=True).indices[:cfg.index_topk].sort().values
                att = torch.einsum("hd,thd->ht", q[b, s], keys[sel]) / math.sqrt(hd)
                o[b, s] = torch.einsum("ht,thd->hd", att.softmax(-1), vals[sel])
        G = cfg.wo_groups
        og = o.reshape(B, S, G, (H // G) * hd)
        y = torch.einsum("bsgd,grd->bsgr", og, L["wo_a"]).reshape(B, S, -1)  # WO-A, token-major
        return y @ L["wo_b"].T  # WO-B

    # ------------------------------------------------------------------ MoE -------------
    def moe(self, u, L):
        B, S, C = u.shape
        return moe_gathered(rmsnorm(u, self.cfg.eps).reshape(-1, C), L, self.cfg).view(B, S, C)

    # -------------------------------------------------------------- forward -------------
    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, kv: KVPool):
        """tokens, pos [B, S] (absolute positions), slots [B] (KV pool rows).
        Returns logits [B, S, V] and the final hidden state [B, S, C]."""
        cfg = self.cfg
        X = self.embed[tokens][:, :, None, :].expand(-1, -1, cfg.mhc_n, -1).contiguous()
        for li, L in enumerate(self.layers):
            hp, hq, hr = self.mhc_mappings(X, L, "attn")
            X = self.post_mix(X, hq, hr, self.attention(self.pre_mix(X, hp), L, li, pos, slots, kv))
            hp, hq, hr = self.mhc_mappings(X, L, "moe")
            X = self.post_mix(X, hq, hr, self.moe(self.pre_mix(X, hp), L))
        hidden = rmsnorm(X.mean(2), cfg.eps)
        return hidden @ self.lm_head.T, hidden
