"""DeepSeek-V4's forward without host synchronisation, over fixed-size per-request state, so
a CUDA graph can capture a decode / verify / draft step.

Same weights and math as :class:`spec_decode.model.TargetModel` (the specification, which keeps
every position's projections and loops over tokens on the host). Here each request owns a
:class:`DecodeState` slot of preallocated buffers:

* ``win[l]`` -- a ring of the last ``window + lookahead`` raw KV rows (row ``p % R``);
* compressed layers: ``crows`` rings of the compressor's raw ``kv`` / ``gate`` rows (the
  ``span`` = ``2m`` (CSA) or ``m'`` (HCA) rows an entry pools, plus ``lookahead``), and the
  pool of compressed entries (entry ``i`` at row ``i``); CSA layers the same for the indexer;
* the draft's context ring per stage.

**Speculative verify leaves no trace** -- by keying all state by position instead of by
count. A step of ``S`` tokens at positions ``p0 .. p0 + S - 1`` reads rows of positions
``< p0`` from the rings and its own rows from the step's fresh projections, writes a pool entry
for every token that closes a window (``(p + 1) % m == 0``: entry ``(p + 1) / m - 1``), and
writes its rows to the rings last. A query sees entries ``i < (p + 1) // m`` only (the pool
needs no count). Tokens rejected after a verify leave rows and entries at positions ``>=`` the
new length; the next step at ``p0' <=`` those positions reads none of them -- rows of positions
``>= p0'`` come from its own fresh projections and entries past the visible count are masked
-- and overwrites them as it moves forward. A ring slot is not clobbered early as long as
``R >= span + lookahead - 1`` (a stale row of position ``q + R`` can exist only while ``q + R
<= p0 + lookahead - 2``; the oldest row read is ``p0 - span + 1``), so rings are ``span +
lookahead`` rows, ``lookahead`` = the verify width. No host sync, no copy, no restore.

Ops are grouped behind :class:`Ops` so the GPU runtime swaps the PyTorch composites
(``baseline``) for this project's kernels (``fused``) one family at a time.
"""

from __future__ import annotations

import math

import torch

from .config import ModelConfig
from .model import (TargetModel, compress_entries, hc_head, mhc_mappings, moe_gathered, post_mix, pre_mix, rmsnorm,
                    rope, route, shared_expert, sink_attention, swiglu, visible_entries, wo_a_ref)


def family(name: str):
    """A profiler range naming an op family; spec_decode.bench counts the kernels launched
    inside each (a no-op for graph replay, which runs no Python)."""
    return torch.profiler.record_function(f"family::{name}")


# ------------------------------------------------------------------------------- state ----
class DecodeState:
    """Fixed-size per-request decode state (see the module docstring). ``slots`` rows (the last
    is the graphs' scratch slot), positions up to ``max_len``, ``lookahead`` = the widest
    step that may be rejected (the verify width)."""

    def __init__(self, cfg: ModelConfig, slots: int, max_len: int, lookahead: int, dtype, device,
                 draft_stages: int = 0):
        self.cfg, self.slots, self.max_len, self.lookahead = cfg, slots, max_len, lookahead
        z = lambda *s: torch.zeros(slots, *s, dtype=dtype, device=device)  # noqa: E731
        hd, D = cfg.head_dim, cfg.indexer_dim
        self.win_rows = cfg.window + lookahead
        self.win = [z(self.win_rows, hd) for _ in range(cfg.layers)]
        self.crows, self.pool, self.irows, self.ipool = {}, {}, {}, {}
        for li in range(cfg.layers):
            m = cfg.ratio(li)
            if not m:
                continue
            csa = m == cfg.csa_ratio
            span, coff = (2 * m, 2) if csa else (m, 1)
            rows = span + lookahead
            ne = max_len // m
            # kv and gate rows side by side: one gather serves both
            self.crows[li] = z(rows, 2 * coff * hd)
            self.pool[li] = z(ne + 1, hd)  # + 1: the row non-closing tokens write (never read)
            if csa:
                self.irows[li] = z(rows, 4 * D)
                self.ipool[li] = z(ne + 1, D)
        # the draft's context rows (target features' K = V per stage): + 1 row that
        # uncommitted positions write (never read)
        self.draft_win = [z(self.win_rows + 1, hd) for _ in range(draft_stages)]

    def nbytes(self) -> int:
        ts = self.win + list(self.crows.values()) + list(self.pool.values()) + list(self.irows.values()) + \
            list(self.ipool.values()) + self.draft_win
        return sum(t.numel() * t.element_size() for t in ts)


def rows_at(fresh: torch.Tensor, ring: torch.Tensor, ring_rows: int, slots: torch.Tensor, pos0: torch.Tensor,
            q: torch.Tensor) -> torch.Tensor:
    """Rows of positions ``q [B, S, K]`` (``>= 0``; callers mask the rest): position ``q >=
    pos0[b]`` from this step's ``fresh [B, S, ch]`` (row ``q - pos0``), older ones from the
    ring ``[slots, >= ring_rows, ch]`` (row ``q % ring_rows``). -> ``[B, S, K, ch]``."""
    B, S = fresh.shape[:2]
    src = torch.cat([ring[slots, :ring_rows], fresh], 1)  # [B, ring_rows + S, ch]
    rel = q - pos0[:, None, None]
    idx = torch.where(rel >= 0, ring_rows + rel.clamp(max=S - 1), q.remainder(ring_rows))
    return src[torch.arange(B, device=q.device)[:, None, None], idx]


def write_ring(ring: torch.Tensor, ring_rows: int, slots: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor):
    """Store a step's rows ``[B, S, ch]`` at ``pos % ring_rows``: only its last ``ring_rows``
    positions (earlier ones would share ring rows with them)."""
    k = min(pos.shape[1], ring_rows)
    p = pos[:, -k:]
    ring[slots[:, None].expand_as(p), p.remainder(ring_rows)] = rows[:, -k:].to(ring.dtype)


# --------------------------------------------------------------------------------- ops ----
class Ops:
    """PyTorch composites of every op family (the ``baseline`` path; runs on CPU and GPU)."""

    def mhc_mappings(self, X, L, site, cfg):
        """-> the mappings object pre_mix / post_mix take (here (pre, post, comb) in X's dtype)."""
        pre, post, comb = mhc_mappings(X, L[f"hc_{site}_fn"], L[f"hc_{site}_base"], L[f"hc_{site}_scale"], cfg)
        return pre.to(X.dtype), post.to(X.dtype), comb.to(X.dtype)

    def pre_mix(self, X, maps):
        return pre_mix(X, maps[0])

    def post_mix(self, X, maps, f):
        return post_mix(X, maps[1], maps[2], f)

    def indexer_topk(self, q_idx, w_idx, ipool, slots, pos, topk, ratio):
        """q_idx [B,S,H,D] (RoPE'd), w_idx [B,S,H] (the score scales folded in), ipool [slots,
        N + 1, D] (one layer's indexer entries), slots [B], pos [B,S] -> (idx [B,S,k] entry
        ids, valid [B,S,k]), k = min(topk, N)."""
        keys = ipool[slots, :-1]  # [B, N, D]
        N = keys.shape[1]
        logits = torch.einsum("bshd,bnd->bshn", q_idx.float(), keys.float())
        score = (torch.relu(logits) * w_idx.float()[..., None]).sum(2)  # [B, S, N]
        vis = torch.arange(N, device=pos.device) < visible_entries(pos, ratio)[..., None]
        score = torch.where(vis, score, torch.full_like(score, float("-inf")))
        vals, idx = torch.sort(score, dim=-1, descending=True, stable=True)  # ties -> lower entry
        k = min(topk, N)
        return idx[..., :k], torch.isfinite(vals[..., :k])

    def wo_a(self, o, wo_a, cfg):
        return wo_a_ref(o, wo_a, cfg)

    def moe(self, h, L, cfg, tokens):
        """h [N, C] (normed), tokens [N] -> routed + shared [N, C]."""
        if h.is_cuda and h.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
            with family("router top-k / padding"):
                ids, w = route(h, L, cfg, tokens)
            return self._moe_grouped(h, L, cfg, ids, w)
        return moe_gathered(h, L, cfg, tokens)  # the spec's per-choice gathers: fine for the CPU's small configs

    def expert_operand(self, x):
        """Rounding of every expert-GEMM operand (weights, routed input, SiLU * up): none in the
        bf16 composite; the tests' MXFP8-rounded yardstick overrides it."""
        return x

    def _moe_grouped(self, h, L, cfg, ids, w):
        """The unfused GPU composite: sort the routed rows by expert, bf16 grouped GEMMs,
        clamped SiLU * up, a standalone weighted finalize, then the separate shared add."""
        N, k = ids.shape
        with family("ID packing (sort / scatter)"):
            flat = ids.flatten()
            order = torch.argsort(flat, stable=True)
            # scatter_add, not bincount: bincount sizes its output on the host (a sync, uncapturable)
            counts = torch.zeros(cfg.experts, dtype=torch.long, device=h.device).scatter_add_(
                0, flat, torch.ones_like(flat))
            offs = counts.cumsum(0).int()
            xs = h[order // k]
        xs, op = self.expert_operand(xs), self.expert_operand
        g = torch._grouped_mm(xs, op(L["ffn.experts.w1"]).transpose(1, 2), offs=offs)
        up = torch._grouped_mm(xs, op(L["ffn.experts.w3"]).transpose(1, 2), offs=offs)
        y = torch._grouped_mm(op(swiglu(g, up, cfg.swiglu_limit)), op(L["ffn.experts.w2"]).transpose(1, 2), offs=offs)
        with family("standalone finalize"):
            routed = torch.empty_like(y).index_copy_(0, order, y).view(N, k, -1)
            out = (routed.float() * w[..., None].float()).sum(1).to(h.dtype)
        sh = shared_expert(h, L)
        with family("shared-expert add"):
            return out + sh


# ---------------------------------------------------------------------------- the layer ----
class V4Layer:
    """One DeepSeek-V4 decoder layer over :class:`DecodeState` rows (the target's layers and
    the draft's stages). ``ratio`` 0 / CSA / HCA; ``win`` is the layer's raw-KV ring (the
    draft's: its context ring, written elsewhere -- ``write_window=False``)."""

    def __init__(self, cfg: ModelConfig, L: dict, ratio: int, inv_freq: dict, ops: Ops):
        self.cfg, self.L, self.ratio, self.ops = cfg, L, ratio, ops
        self.inv = inv_freq[ratio > 0]
        self.inv_c = inv_freq[True]

    def forward(self, X, tokens, pos, slots, st: DecodeState, li, win=None, write_window=True):
        cfg, ops, L = self.cfg, self.ops, self.L
        maps = ops.mhc_mappings(X, L, "attn", cfg)
        h = rmsnorm(ops.pre_mix(X, maps), cfg.eps, L["attn_norm.weight"])
        X = ops.post_mix(X, maps, self.attention(h, pos, slots, st, li, win, write_window))
        maps = ops.mhc_mappings(X, L, "ffn", cfg)
        h = rmsnorm(ops.pre_mix(X, maps), cfg.eps, L["ffn_norm.weight"])
        B, S, C = h.shape
        f = ops.moe(h.reshape(-1, C), L, cfg, tokens.reshape(-1)).view(B, S, C)
        return ops.post_mix(X, maps, f)

    def kv(self, h, pos):
        """The raw K = V rows ``[B, S, hd]`` of normed hidden states ``h``."""
        return rope(rmsnorm(h @ self.L["attn.wkv.weight"].T, self.cfg.eps, self.L["attn.kv_norm.weight"]), pos,
                    self.inv)

    def attention(self, h, pos, slots, st: DecodeState, li, win, write_window):
        cfg, ops, L = self.cfg, self.ops, self.L
        B, S, _ = h.shape
        H, hd, m = cfg.heads, cfg.head_dim, self.ratio
        pos0 = pos[:, 0]
        qr = rmsnorm(h @ L["attn.wq_a.weight"].T, cfg.eps, L["attn.q_norm.weight"])
        q = rope(rmsnorm((qr @ L["attn.wq_b.weight"].T).view(B, S, H, hd), cfg.eps), pos, self.inv)
        kv = self.kv(h, pos)
        ring = st.win[li] if win is None else win
        # window: positions p - W + 1 .. p
        qpos = pos[..., None] - cfg.window + 1 + torch.arange(cfg.window, device=pos.device)
        keys = rows_at(kv, ring, st.win_rows, slots, pos0, qpos.clamp_min(0))  # [B, S, W, hd]
        valid = qpos >= 0
        if m:
            ent, ent_valid = self.compressed_keys(h, qr, pos, slots, st, li)
            keys = torch.cat([keys, ent], 2)
            valid = torch.cat([valid, ent_valid], 2)
        o = sink_attention(q, keys, valid, L["attn.attn_sink"], 1 / math.sqrt(hd))
        if write_window:
            write_ring(ring, st.win_rows, slots, pos, kv)
        o = rope(o, pos, self.inv, inverse=True)
        return ops.wo_a(o, L["attn.wo_a.weight"], cfg) @ L["attn.wo_b.weight"].T

    def _close_windows(self, h, pos, slots, prefix, rows, pool, inv_c):
        """Pool an entry for every token that closes a window; store this step's raw rows."""
        cfg, L, m = self.cfg, self.L, self.ratio
        csa = m == cfg.csa_ratio
        span = 2 * m if csa else m
        ring_rows = rows.shape[1]
        fresh = torch.cat([h @ L[prefix + "wkv.weight"].T, h @ L[prefix + "wgate.weight"].T], -1)
        qpos = pos[..., None] - span + 1 + torch.arange(span, device=pos.device)  # [B, S, span]
        r = rows_at(fresh, rows, ring_rows, slots, pos[:, 0], qpos.clamp_min(0))
        ch = fresh.shape[-1] // 2
        kv, gate = r[..., :ch], r[..., ch:]
        before = (qpos < 0)[..., None]  # rows before position 0: kv 0, gate -inf
        kv = kv.masked_fill(before, 0)
        gate = gate.masked_fill(before, float("-inf"))
        entry = torch.div(pos + 1, m, rounding_mode="floor") - 1
        ent = compress_entries(kv, gate, L[prefix + "ape"], L[prefix + "norm.weight"], csa, entry * m, inv_c, cfg.eps)
        closes = ((pos + 1) % m == 0) & (entry >= 0) & (entry < pool.shape[1] - 1)
        dst = torch.where(closes, entry, torch.full_like(entry, pool.shape[1] - 1))
        pool[slots[:, None].expand_as(dst), dst] = ent.to(pool.dtype)
        write_ring(rows, ring_rows, slots, pos, fresh)

    def compressed_keys(self, h, qr, pos, slots, st: DecodeState, li):
        """This layer's compressed keys per query ``[B, S, K, hd]`` and their validity."""
        cfg, L, m = self.cfg, self.L, self.ratio
        self._close_windows(h, pos, slots, "attn.compressor.", st.crows[li], st.pool[li], self.inv_c)
        pool = st.pool[li]
        if m != cfg.csa_ratio:  # HCA: every visible entry
            ent = pool[slots, :-1]  # [B, N, hd]
            N = ent.shape[1]
            valid = torch.arange(N, device=pos.device) < visible_entries(pos, m)[..., None]  # [B, S, N]
            return ent[:, None].expand(-1, pos.shape[1], -1, -1), valid
        p = "attn.indexer."
        self._close_windows(h, pos, slots, p + "compressor.", st.irows[li], st.ipool[li], self.inv_c)
        B, S, _ = h.shape
        HI, D = cfg.indexer_heads, cfg.indexer_dim
        q_idx = rope((qr @ L[p + "wq_b.weight"].T).view(B, S, HI, D), pos, self.inv_c)
        # the score's scales D^-1/2 and H^-1/2 ride on the head weights
        w_idx = (h @ L[p + "weights_proj.weight"].T).float() / math.sqrt(HI * D)
        idx, valid = self.ops.indexer_topk(q_idx, w_idx, st.ipool[li], slots, pos, cfg.index_topk, m)
        return pool[slots[:, None, None], idx], valid


class StepModel:
    """Sync-free forward over a :class:`TargetModel`'s weights and a :class:`DecodeState`."""

    def __init__(self, target: TargetModel, ops: Ops | None = None):
        self.t, self.cfg = target, target.cfg
        self.ops = ops or Ops()
        self.layers = [V4Layer(self.cfg, L, self.cfg.ratio(li), target.inv_freq, self.ops)
                       for li, L in enumerate(target.layers)]

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, st: DecodeState):
        """tokens, pos [B, S] int64 (device; a request's positions consecutive), slots [B] ->
        logits [B, S, V], the draft's features [B, S, 3C]."""
        cfg, t = self.cfg, self.t
        X = t.embed[tokens][:, :, None, :].expand(-1, -1, cfg.mhc_n, -1).contiguous()
        feats = []
        for li, layer in enumerate(self.layers):
            X = layer.forward(X, tokens, pos, slots, st, li)
            if li in cfg.draft_feature_layers:
                feats.append(X.mean(2))
        hidden = rmsnorm(hc_head(X, t.w, cfg).to(X.dtype), cfg.eps, t.w["norm.weight"])
        return hidden @ t.lm_head.T, torch.cat(feats, -1)
