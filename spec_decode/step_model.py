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
(``torch-bf16``) for this project's kernels (``fused``) one family at a time.
"""

from __future__ import annotations

import math

import torch

from cute_kernels.sink_attention import sink_attention_torch
from moe.streams import dedicated_stream

from .config import ModelConfig
from .model import (TargetModel, compress_entries, hc_head, mhc_mappings, moe_gathered, post_mix, pre_mix, rmsnorm,
                    forward_memo, forward_tables, rope, rope_table, route, shared_expert, sink_attention, swiglu,
                    visible_entries, wo_a_ref)


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
        #: per layer, one buffer of K = V rows: every slot's raw-KV ring (``win_rows`` rows each),
        #: then every slot's pool of compressed entries; ``win[l]`` and ``pool[l]`` are views of
        #: it, so one row index addresses both (the row attention's ``kv``)
        self.kv, self.win = [], []
        self.crows, self.pool, self.irows, self.ipool = {}, {}, {}, {}
        for li in range(cfg.layers):
            m = cfg.ratio(li)
            ne = max_len // m if m else 0
            buf = torch.zeros(slots * self.win_rows + (slots * (ne + 1) if m else 0), hd, dtype=dtype, device=device)
            self.kv.append(buf)
            self.win.append(buf[:slots * self.win_rows].view(slots, self.win_rows, hd))
            if not m:
                continue
            csa = m == cfg.csa_ratio
            span, coff = (2 * m, 2) if csa else (m, 1)
            rows = span + lookahead
            # kv and gate rows side by side: one gather serves both
            self.crows[li] = z(rows, 2 * coff * hd)
            self.pool[li] = buf[slots * self.win_rows:].view(slots, ne + 1, hd)  # + 1: the row non-closing tokens write (never read)
            if csa:
                self.irows[li] = z(rows, 4 * D)
                self.ipool[li] = z(ne + 1, D)
        # the draft's context rows (target features' K = V per stage): + 1 row that
        # uncommitted positions write (never read), then ``lookahead`` rows for a draft block's
        # own rows (the row attention reads them there)
        self.draft_win = [z(self.win_rows + 1 + lookahead, hd) for _ in range(draft_stages)]

    def nbytes(self) -> int:
        ts = self.kv + list(self.crows.values()) + list(self.irows.values()) + list(self.ipool.values()) + \
            self.draft_win
        return sum(t.numel() * t.element_size() for t in ts)


def ring_index(pos: torch.Tensor, span: int, ring_rows: int) -> tuple:
    """Where :func:`rows_at` finds the rows of positions ``p - span + 1 .. p`` of each query at
    ``pos [B, S]`` (a request's positions consecutive): ``(batch index [B, 1, 1], row index [B,
    S, span] into cat([ring rows, this step's rows]), valid [B, S, span], its negation)``. A position ``q >=
    pos[b, 0]`` is this step's row ``q - pos[b, 0]``, an older one ring row ``q % ring_rows``;
    positions below 0 (not ``valid``) read position 0's row -- callers mask them. Built once
    per forward (:func:`spec_decode.model.forward_memo`): every layer's window shares it."""
    def build():
        q = pos[..., None] + torch.arange(1 - span, 1, device=pos.device)
        valid = q >= 0
        q = q.clamp_min(0)
        rel = q - pos[:, :1, None]
        idx = torch.where(rel >= 0, ring_rows + rel.clamp(max=pos.shape[1] - 1), q.remainder(ring_rows))
        return torch.arange(pos.shape[0], device=pos.device)[:, None, None], idx, valid, ~valid

    return forward_memo(("ring_index", span, ring_rows), (pos,), build)


def rows_at(fresh: torch.Tensor, ring: torch.Tensor, ring_rows: int, slots: torch.Tensor, index: tuple) -> torch.Tensor:
    """Rows ``[B, S, span, ch]`` at :func:`ring_index` ``index``: from this step's ``fresh [B, S,
    ch]`` or the ring ``[slots, >= ring_rows, ch]``."""
    b, idx = index[:2]
    return torch.cat([ring[slots, :ring_rows], fresh], 1)[b, idx]


def write_ring(ring: torch.Tensor, ring_rows: int, slots: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor):
    """Store a step's rows ``[B, S, ch]`` at ``pos % ring_rows``: only its last ``ring_rows``
    positions (earlier ones would share ring rows with them)."""
    k = min(pos.shape[1], ring_rows)

    def build():
        p = pos[:, -k:]
        return slots[:, None].expand_as(p), p.remainder(ring_rows)

    at = forward_memo(("write_ring", ring_rows), (slots, pos), build)
    ring[at] = rows[:, -k:].to(ring.dtype)


def window_entries(pos: torch.Tensor, slots: torch.Tensor, m: int, pool_rows: int) -> tuple:
    """For a compressor of ratio ``m``: each token's entry start position ``i m`` with ``i = (p +
    1) // m - 1`` (the window it closes, or would), and the pool rows its entry goes to -- ``i``
    when it closes a window (``(p + 1) % m == 0``, ``0 <= i < pool_rows - 1``), else the pool's
    last row (written, never read). Built once per forward."""
    def build():
        p1 = pos + 1
        entry = torch.div(p1, m, rounding_mode="floor") - 1
        closes = (p1 % m == 0) & (entry >= 0) & (entry < pool_rows - 1)
        dst = torch.where(closes, entry, torch.full_like(entry, pool_rows - 1))
        return entry * m, (slots[:, None].expand_as(dst), dst)

    return forward_memo(("window_entries", m, pool_rows), (pos, slots), build)


def visible_mask(pos: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """``[B, S, n]``: entry ``i < n`` visible to the query at ``pos`` (its window whole). Built
    once per forward."""
    return forward_memo(("visible", m, n), (pos,),
                        lambda: torch.arange(n, device=pos.device) < visible_entries(pos, m)[..., None])


def window_rows(pos: torch.Tensor, slots: torch.Tensor, span: int, ring_rows: int, slot_rows: int,
                block_row: int | None = None) -> torch.Tensor:
    """Row indices ``[B, S, span]`` (int32, -1 before position 0) of the window positions ``p -
    span + 1 .. p`` of each query at ``pos [B, S]`` in a buffer of ``slot_rows`` rows per slot:
    ring row ``q % ring_rows`` of the slot -- or, with ``block_row``, positions ``q >= pos[b,
    0]`` at the slot's rows ``block_row + q - pos[b, 0]`` (a draft block's own rows, kept apart
    from the committed context). Built once per forward."""
    def build():
        q = pos[..., None] + torch.arange(1 - span, 1, device=pos.device)
        r = q.remainder(ring_rows)
        if block_row is not None:
            rel = q - pos[:, :1, None]
            r = torch.where(rel >= 0, block_row + rel, r)
        return torch.where(q >= 0, slots[:, None, None] * slot_rows + r, -1).int()

    return forward_memo(("window_rows", span, ring_rows, slot_rows, block_row), (pos, slots), build)


def entry_rows(pos: torch.Tensor, slots: torch.Tensor, m: int, first_row: int, pool_rows: int) -> torch.Tensor:
    """Row indices ``[B, S, pool_rows - 1]`` (int32) of every entry of each query's pool (slot
    ``b``'s entry ``i`` at ``first_row + b * pool_rows + i``), -1 where not yet visible: an HCA
    layer's compressed keys. Built once per forward."""
    def build():
        n = pool_rows - 1
        rows = first_row + slots[:, None, None] * pool_rows + torch.arange(n, device=pos.device)
        return torch.where(visible_mask(pos, m, n), rows, -1).int()

    return forward_memo(("entry_rows", m, first_row, pool_rows), (pos, slots), build)


# --------------------------------------------------------------------------------- ops ----
class Ops:
    """PyTorch composites of every op family (the ``torch-bf16`` path; runs on CPU and GPU)."""

    def mhc_mappings(self, X, L, site, cfg):
        """-> the mappings object pre_mix / post_mix take (here (pre, post, comb) in X's dtype)."""
        pre, post, comb = mhc_mappings(X, L[f"hc_{site}_fn"], L[f"hc_{site}_base"], L[f"hc_{site}_scale"], cfg)
        return pre.to(X.dtype), post.to(X.dtype), comb.to(X.dtype)

    def rmsnorm(self, x, eps, weight=None):
        """:func:`spec_decode.model.rmsnorm` (the statistic in FP32, rounded to x's dtype, then
        x * it, then * weight)."""
        return rmsnorm(x, eps, weight)

    def rmsnorm_rope(self, x, eps, weight, pos, inv_freq):
        """RoPE at ``pos`` (x's leading dims) of :meth:`rmsnorm`'s output: the q, KV and
        compressed-entry norms."""
        return rope(self.rmsnorm(x, eps, weight), pos, inv_freq)

    def pre_mix(self, X, maps):
        return pre_mix(X, maps[0])

    def hc_head(self, X, W, cfg):
        """V4's final collapse of the streams (:func:`spec_decode.model.hc_head`; ``W`` the
        target's or the draft's global tensors) in X's dtype."""
        return hc_head(X, W, cfg).to(X.dtype)

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

    #: a decode / verify step's compressor in one call (the fused ops' kernel), or None:
    #: ``compress_step(L, prefix, h, pos, slots, ring, pool, m, csa, inv_freq, eps)`` pools an
    #: entry for every token closing a window into ``pool`` and stores the step's raw rows in
    #: ``ring`` -- what :meth:`V4Layer._close_windows` does in PyTorch
    compress_step = None

    #: whether decode / verify / draft steps take :meth:`V4Layer.row_attention` (row indices
    #: into the layer's K = V buffer, :meth:`sink_attention`) instead of gathering the keys
    row_attention = False

    def sink_attention(self, q, kv, rows, L, scale, rotate):
        """``q [T, H, hd]``, the K = V rows ``kv[rows[t]]`` (``rows [T, K]`` int32, -1: masked),
        the layer's sink logits, ``rotate [T, r/2, 2]`` the output's (cos, sin) -> ``[T, H, hd]``
        (the contract of :func:`cute_kernels.sink_attention.sink_attention`), in PyTorch."""
        return sink_attention_torch(q, kv, rows, L["attn.attn_sink"].float(), scale, rotate)

    #: tensor parallelism: the group whose partial sums :meth:`all_reduce` adds (None: one
    #: rank) -- a torch.distributed group, or a :class:`ThreadAllReduce` (simulated ranks);
    #: ``push`` / ``push_rank``: the custom push all-reduce group (a real one, or simulated on
    #: one GPU) and this rank in it, used for bf16 CUDA tensors inside captured graphs
    group = None
    push = None
    push_rank = 0

    def pushes(self, x: torch.Tensor) -> bool:
        """Whether ``x``'s all-reduce takes the push kernel: only while a CUDA graph is being
        captured. Eagerly (prefill, warm-ups) a rank may reach its push long before its peers
        (host enqueue skew, a first compile, a lazy module load that synchronises the context
        while the kernel spins) and the kernel's bounded wait would give up; a graph replay
        launches every rank's step at once."""
        return (self.push is not None and x.is_cuda and x.dtype == torch.bfloat16
                and torch.cuda.is_current_stream_capturing())

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum a tensor-parallel partial ``x`` over the ranks: FP32 in rank order, then one
        rounding to ``x``'s dtype, so every rank gets the same sum and every path the same
        numbers (the push kernel; else ``group``: threads, or a torch.distributed all-gather
        then the same sum). One rank: ``x``."""
        if self.pushes(x):
            with family("all-reduce"):
                return self.push.allreduce(self.push_rank, x.reshape(-1, x.shape[-1]).contiguous()).view(x.shape)
        if self.group is None:
            return x
        if isinstance(self.group, ThreadAllReduce):
            return self.group.all_reduce(self.push_rank, x)
        import torch.distributed as dist

        with family("all-reduce"):
            parts = [torch.empty_like(x) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(parts, x.contiguous(), group=self.group)
            return rank_order_sum(parts, x.dtype)

    def moe(self, h, L, cfg, tokens, first_expert: int = 0, reduce: bool = False):
        """h [N, C] (normed), tokens [N] -> routed + shared [N, C]. An expert shard returns its
        partial, or with ``reduce`` the sum over the ranks (finalize, shared add and
        all-reduce as separate launches)."""
        if h.is_cuda and h.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
            with family("router top-k / padding"):
                ids, w = route(h, L, cfg, tokens)
            out = self._moe_grouped(h, L, cfg, ids, w, first_expert)
        else:
            out = moe_gathered(h, L, cfg, tokens, first_expert)  # the spec's per-choice gathers: the CPU's small configs
        return self.all_reduce(out) if reduce else out

    def expert_operand(self, x):
        """Rounding of every expert-GEMM operand (weights, routed input, SiLU * up): none in the
        bf16 composite; the tests' MXFP8-rounded yardstick overrides it."""
        return x

    def _moe_grouped(self, h, L, cfg, ids, w, first_expert=0):
        """The unfused GPU composite: sort the routed rows by expert, bf16 grouped GEMMs,
        clamped SiLU * up, a standalone weighted finalize, then the separate shared add. An
        expert shard sorts other ranks' choices past its last group (never computed; masked
        out of the finalize)."""
        N, k = ids.shape
        n_local = L["ffn.experts.w1"].shape[0]
        with family("ID packing (sort / scatter)"):
            local = ids.flatten() - first_expert
            mine = (local >= 0) & (local < n_local)
            flat = torch.where(mine, local, torch.full_like(local, n_local))
            order = torch.argsort(flat, stable=True)
            # scatter_add, not bincount: bincount sizes its output on the host (a sync, uncapturable)
            counts = torch.zeros(n_local + 1, dtype=torch.long, device=h.device).scatter_add_(
                0, flat, torch.ones_like(flat))[:n_local]
            offs = counts.cumsum(0).int()
            xs = h[order // k]
        xs, op = self.expert_operand(xs), self.expert_operand
        g = torch._grouped_mm(xs, op(L["ffn.experts.w1"]).transpose(1, 2), offs=offs)
        up = torch._grouped_mm(xs, op(L["ffn.experts.w3"]).transpose(1, 2), offs=offs)
        y = torch._grouped_mm(op(swiglu(g, up, cfg.swiglu_limit)), op(L["ffn.experts.w2"]).transpose(1, 2), offs=offs)
        with family("standalone finalize"):
            routed = torch.empty_like(y).index_copy_(0, order, y).view(N, k, -1)
            routed = torch.where(mine.view(N, k, 1), routed, torch.zeros_like(routed))  # rows past the groups
            out = (routed.float() * w[..., None].float()).sum(1).to(h.dtype)
        sh = shared_expert(h, L)
        with family("shared-expert add"):
            return out + sh


# ---------------------------------------------------------------------------- the layer ----
class V4Layer:
    """One DeepSeek-V4 decoder layer over :class:`DecodeState` rows (the target's layers and
    the draft's stages). ``ratio`` 0 / CSA / HCA; ``win`` is the layer's raw-KV ring (the
    draft's: its context ring, written elsewhere -- ``write_window=False``)."""

    def __init__(self, cfg: ModelConfig, L: dict, ratio: int, inv_freq: dict, ops: Ops, shard: "Shard | None" = None):
        self.cfg, self.L, self.ratio, self.ops = cfg, L, ratio, ops
        self.inv = inv_freq[ratio > 0]
        self.inv_c = inv_freq[True]
        #: a tensor-parallel rank's slice of the layer (None: the whole layer, no all-reduce)
        self.shard = shard
        self.heads = L["attn.attn_sink"].numel()  # this rank's query heads

    def forward(self, X, tokens, pos, slots, st: DecodeState, li, win=None, write_window=True, before_ring=None):
        """``before_ring``: called just before the attention first reads the raw-KV ring (the
        draft joins the side stream that writes its context rows there)."""
        cfg, ops, L = self.cfg, self.ops, self.L
        maps = ops.mhc_mappings(X, L, "attn", cfg)
        h = ops.rmsnorm(ops.pre_mix(X, maps), cfg.eps, L["attn_norm.weight"])
        X = ops.post_mix(X, maps, self.attention(h, pos, slots, st, li, win, write_window, before_ring))
        maps = ops.mhc_mappings(X, L, "ffn", cfg)
        h = ops.rmsnorm(ops.pre_mix(X, maps), cfg.eps, L["ffn_norm.weight"])
        B, S, C = h.shape
        sh = self.shard
        # a shard's experts and shared-expert slice: partial sums, all-reduced
        f = ops.moe(h.reshape(-1, C), L, cfg, tokens.reshape(-1), sh.first_expert if sh else 0, reduce=sh is not None)
        return ops.post_mix(X, maps, f.view(B, S, C))

    def kv(self, h, pos):
        """The raw K = V rows ``[B, S, hd]`` of normed hidden states ``h``."""
        return self.ops.rmsnorm_rope(h @ self.L["attn.wkv.weight"].T, self.cfg.eps, self.L["attn.kv_norm.weight"], pos,
                                     self.inv)

    def attention(self, h, pos, slots, st: DecodeState, li, win, write_window, before_ring=None):
        cfg, ops, L = self.cfg, self.ops, self.L
        B, S, _ = h.shape
        H, hd = self.heads, cfg.head_dim
        qr = ops.rmsnorm(h @ L["attn.wq_a.weight"].T, cfg.eps, L["attn.q_norm.weight"])
        q = ops.rmsnorm_rope((qr @ L["attn.wq_b.weight"].T).view(B, S, H, hd), cfg.eps, None, pos, self.inv)
        kv = self.kv(h, pos)
        if ops.row_attention and S <= st.lookahead + 1 and (win is not None or write_window):
            o = self.row_attention(q, kv, h, qr, pos, slots, st, li, win, before_ring)
        else:
            o = self.gathered_attention(q, kv, h, qr, pos, slots, st, li, win, write_window, before_ring)
        out = ops.wo_a(o, L["attn.wo_a.weight"], cfg) @ L["attn.wo_b.weight"].T
        return ops.all_reduce(out) if self.shard is not None else out  # the ranks' head groups

    def gathered_attention(self, q, kv, h, qr, pos, slots, st: DecodeState, li, win, write_window, before_ring):
        """The keys gathered into ``[B, S, K, hd]`` (the ring's rows, this step's fresh ones, the
        compressed entries), the sink softmax, then the ring written and the inverse RoPE: any
        step width (a prefill chunk), the ``torch-bf16`` ops' path."""
        cfg, L = self.cfg, self.L
        ring = st.win[li] if win is None else win
        # window: positions p - W + 1 .. p
        index = ring_index(pos, cfg.window, st.win_rows)
        if before_ring is not None:
            before_ring()
        keys = rows_at(kv, ring, st.win_rows, slots, index)  # [B, S, W, hd]
        valid = index[2]
        if self.ratio:
            idx, ent_valid = self.compressed_entries(h, qr, pos, slots, st, li)
            pool = st.pool[li]
            if idx is None:  # HCA: every visible entry
                ent = pool[slots, :-1][:, None].expand(-1, pos.shape[1], -1, -1)
            else:
                ent = pool[slots[:, None, None], idx]
            keys = torch.cat([keys, ent], 2)
            valid = torch.cat([valid, ent_valid], 2)
        o = sink_attention(q, keys, valid, L["attn.attn_sink"], 1 / math.sqrt(cfg.head_dim))
        if write_window:
            write_ring(ring, st.win_rows, slots, pos, kv)
        return rope(o, pos, self.inv, inverse=True)

    def row_attention(self, q, kv, h, qr, pos, slots, st: DecodeState, li, win, before_ring):
        """A decode / verify / draft step (``S <= lookahead + 1``) in one launch of
        :meth:`Ops.sink_attention` over row indices into the layer's K = V buffer: the target
        writes the step's rows into its ring first (the ring holds them beside the window of
        the step's first query: ``win_rows = window + lookahead``), a draft block into its
        slot's rows after the context ring; then the window's rows and the compressed entries'
        (HCA: every visible one; CSA: the indexer's top-k), with the inverse RoPE fused."""
        cfg, L = self.cfg, self.L
        B, S = pos.shape
        W = cfg.window
        if win is None:  # the target layer's ring, in its buffer
            write_ring(st.win[li], st.win_rows, slots, pos, kv)
            buf, slot_rows, block_row = st.kv[li], st.win_rows, None
        else:  # a draft stage: the block's own rows after the context ring (+ its discarded row)
            block_row = st.win_rows + 1
            at = forward_memo(("block_rows", block_row), (slots, pos), lambda: (
                slots[:, None].expand(B, S), block_row + torch.arange(S, device=pos.device).expand(B, S)))
            win[at] = kv.to(win.dtype)
            buf, slot_rows = win.view(-1, win.shape[-1]), win.shape[1]
        rows = window_rows(pos, slots, W, st.win_rows, slot_rows, block_row)
        if self.ratio:
            first, n = st.slots * st.win_rows, st.pool[li].shape[1]  # the pool's first row; rows per slot
            idx, valid = self.compressed_entries(h, qr, pos, slots, st, li)
            if idx is None:  # HCA: the window's rows then every entry's, once per forward
                ent = entry_rows(pos, slots, self.ratio, first, n)
                rows = forward_memo(("hca_rows",), (rows, ent), lambda: torch.cat([rows, ent], -1))
            else:  # CSA: the indexer's choices, offset by the slot's first pool row
                base = forward_memo(("pool_base", first, n), (slots,), lambda: first + slots[:, None, None] * n)
                rows = torch.cat([rows, torch.where(valid, idx + base, -1).int()], -1)
        if before_ring is not None:
            before_ring()
        rot = torch.view_as_real(rope_table(pos, self.inv, inverse=True)).reshape(B * S, -1, 2)
        o = self.ops.sink_attention(q.reshape(B * S, self.heads, -1), buf, rows.reshape(B * S, -1), L,
                                    1 / math.sqrt(cfg.head_dim), rot)
        return o.view(B, S, self.heads, -1)

    def _close_windows(self, h, pos, slots, prefix, rows, pool, inv_c):
        """Pool an entry for every token that closes a window; store this step's raw rows."""
        cfg, L, m = self.cfg, self.L, self.ratio
        csa = m == cfg.csa_ratio
        span = 2 * m if csa else m
        ring_rows = rows.shape[1]
        if self.ops.compress_step is not None and h.shape[1] <= ring_rows - span + 1:
            self.ops.compress_step(L, prefix, h, pos, slots, rows, pool, m, csa, inv_c, cfg.eps)
            return
        fresh = torch.cat([h @ L[prefix + "wkv.weight"].T, h @ L[prefix + "wgate.weight"].T], -1)
        index = ring_index(pos, span, ring_rows)
        r = rows_at(fresh, rows, ring_rows, slots, index)  # [B, S, span, 2 ch]
        ch = fresh.shape[-1] // 2
        # rows before position 0: gate -inf, so their softmax weight is 0 and their (finite)
        # kv adds nothing -- the spec's "kv 0, gate -inf"
        kv, gate = r[..., :ch], r[..., ch:].masked_fill(index[3][..., None], float("-inf"))
        start, dst = window_entries(pos, slots, m, pool.shape[1])
        ent = compress_entries(kv, gate, L[prefix + "ape"], L[prefix + "norm.weight"], csa, start, inv_c, cfg.eps,
                               norm_rope=self.ops.rmsnorm_rope)
        pool[dst] = ent.to(pool.dtype)
        write_ring(rows, ring_rows, slots, pos, fresh)

    def compressed_entries(self, h, qr, pos, slots, st: DecodeState, li):
        """Close this step's compressor windows (their entries into the pool), and choose the
        compressed keys: ``(None, visible [B, S, N])`` for HCA (every visible entry of the
        pool), ``(idx [B, S, k], valid)`` for CSA (the indexer's top-k; ``idx`` -1 where not
        ``valid``)."""
        cfg, L, m = self.cfg, self.L, self.ratio
        self._close_windows(h, pos, slots, "attn.compressor.", st.crows[li], st.pool[li], self.inv_c)
        if m != cfg.csa_ratio:  # HCA: every visible entry
            return None, visible_mask(pos, m, st.pool[li].shape[1] - 1)
        p = "attn.indexer."
        self._close_windows(h, pos, slots, p + "compressor.", st.irows[li], st.ipool[li], self.inv_c)
        B, S, _ = h.shape
        HI, D = cfg.indexer_heads, cfg.indexer_dim
        q_idx = rope((qr @ L[p + "wq_b.weight"].T).view(B, S, HI, D), pos, self.inv_c)
        # the score's scales D^-1/2 and H^-1/2 ride on the head weights
        w_idx = (h @ L[p + "weights_proj.weight"].T).float() / math.sqrt(HI * D)
        return self.ops.indexer_topk(q_idx, w_idx, st.ipool[li], slots, pos, cfg.index_topk, m)


def rank_order_sum(parts: list, dtype: torch.dtype) -> torch.Tensor:
    """``dtype(parts[0] + parts[1] + ...)`` summed in FP32 in rank order, one rounding at the
    end: the push all-reduce kernel's numbers, which every all-reduce path here reproduces."""
    total = parts[0].float()
    for p in parts[1:]:
        total = total + p.float()
    return total.to(dtype)


class ThreadAllReduce:
    """The all-reduce of simulated ranks run by threads, one per rank: each call waits for every
    rank's partial (bounded: ``timeout`` s), sums them in rank order in FP32 and gives every
    rank the same result -- the push kernel's numbers. CUDA partials (each rank's thread on its
    own stream): a rank's stream waits for the others' partials (events) before summing, and
    the partials' memory is held for those reads (``record_stream``)."""

    def __init__(self, world: int, timeout: float = 60.0):
        import threading

        self.world, self.timeout = world, timeout
        self.barrier = threading.Barrier(world, timeout=timeout)
        self.parts: list = [None] * world
        self.events: list = [None] * world
        #: held by the rank thread that runs (:meth:`SimulatedRanks.forward`): one rank's
        #: Python -- its kernel launches included -- at a time, handed over at the barriers
        self.baton = threading.Lock()
        self._turn = threading.local()  # whether this thread holds the baton

    def take_turn(self) -> None:
        """Take the baton, waiting at most ``timeout`` s for the rank that holds it."""
        if not self.baton.acquire(timeout=self.timeout):
            raise TimeoutError(f"simulated rank: no turn within {self.timeout:g} s (another rank holds it)")
        self._turn.held = True

    def end_turn(self) -> None:
        if getattr(self._turn, "held", False):
            self._turn.held = False
            self.baton.release()

    def _wait(self) -> None:
        """The barrier, with the baton handed to the other ranks while this one waits."""
        self.end_turn()
        try:
            self.barrier.wait()
        finally:
            self.take_turn()

    def all_reduce(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            ev = torch.cuda.Event()
            ev.record()  # on this rank's current stream
            self.events[rank] = ev
        self.parts[rank] = x
        self._wait()
        if x.is_cuda:
            s = torch.cuda.current_stream()
            for q in range(self.world):
                if q != rank:
                    s.wait_event(self.events[q])
                    self.parts[q].record_stream(s)
        total = rank_order_sum(self.parts, x.dtype)
        self._wait()  # every rank has read the partials before any is replaced
        return total


class RankView:
    """One simulated rank's view of a full :class:`TargetModel`: the shared global tensors
    and this rank's slices of the layers (views: no copy)."""

    def __init__(self, target: TargetModel, shard: "Shard"):
        self.cfg, self.w, self.inv_freq, self.shard = target.cfg, target.w, target.inv_freq, shard
        self.dtype, self.device = target.dtype, target.device
        self.embed, self.lm_head = target.embed, target.lm_head
        self.layers = [shard.slice_layer(L, target.cfg) for L in target.layers]


class SimulatedRanks:
    """Every tensor-parallel rank in this process: per rank a :class:`StepModel` over its
    slices, its own :class:`DecodeState` (rank 0's is the engine's) and its own ops. A forward
    runs all ranks and returns rank 0's outputs (every rank holds the same all-reduced values):

    * captured into a CUDA graph: each rank on its own stream, forked from and joined to the
      capturing one -- the whole TP step, the push all-reduce (``ops.push``) and its phase
      counters in one graph, whose replays launch every rank's kernels at once;
    * eagerly (prefill, graph warm-ups; on a CPU always): one thread per rank (on a GPU each on
      its own stream), all-reduces through ``threads`` (:class:`ThreadAllReduce`: the same
      FP32 rank-order sums). Not the push kernel: it spin-waits for its peers' launches,
      which an eager rank reaches only after the host has enqueued the ranks before it, and a
      first launch of any kernel (lazy module loading) can synchronise the context while a
      peer spins -- a deadlock that only the bounded wait would end."""

    def __init__(self, steps: list, states: list, threads: ThreadAllReduce):
        self.steps, self.states, self.threads = steps, states, threads
        self.tp = len(steps)
        self.ops = steps[0].ops
        cuda = torch.device(steps[0].t.device).type == "cuda"
        self.streams = [dedicated_stream(steps[0].t.device) for _ in steps] if cuda else None

    def forward(self, tokens, pos, slots, st=None):
        if self.streams is not None and torch.cuda.is_current_stream_capturing():
            main = torch.cuda.current_stream()
            outs = []
            for step, state, s in zip(self.steps, self.states, self.streams):
                s.wait_stream(main)
                with torch.cuda.stream(s):
                    outs.append(step.forward(tokens, pos, slots, state))
            for s in self.streams:
                main.wait_stream(s)
            return outs[0]
        return self._threaded(tokens, pos, slots)

    def _threaded(self, tokens, pos, slots):
        import threading

        outs, errs = [None] * self.tp, []
        main = torch.cuda.current_stream() if self.streams is not None else None

        def run(r):
            # One rank thread runs at a time (the baton; handed over inside the all-reduce's
            # barriers): its Python, kernel launches and compiles are never concurrent with
            # another rank's -- the DSL's launch path is not documented as thread-safe.
            s = self.streams[r] if main is not None else None  # None: a CPU run, no stream
            try:
                self.threads.take_turn()
                with torch.cuda.stream(s):
                    if s is not None:
                        s.wait_stream(main)
                    outs[r] = self.steps[r].forward(tokens, pos, slots, self.states[r])
            except BaseException as e:  # noqa: BLE001 -- re-raised on the caller's thread
                errs.append(e)
                self.threads.barrier.abort()  # release the peers waiting on this rank
            finally:
                self.threads.end_turn()
        self.threads.barrier.reset()  # a failed step broke it; nobody waits on it now
        threads = [threading.Thread(target=run, args=(r,)) for r in range(self.tp)]
        for t in threads:  # no capture here: every rank's ops sum through `threads`
            t.start()
        for t in threads:
            t.join()
        if main is not None:
            for s in self.streams:
                main.wait_stream(s)
        if errs:
            raise errs[0]
        return outs[0]


class Shard:
    """Rank ``rank`` of ``tp``'s slice of a layer: query heads ``[rank H/tp, ..)`` (their WO-A
    groups, WO-B columns and sinks), routed experts ``[first_expert, + E/tp)``, shared-expert
    width ``[rank I/tp, ..)``. The KV head, compressors, indexer, router, mHC and norms are
    replicated; the attention output and the MoE output are partial sums, all-reduced."""

    def __init__(self, cfg: ModelConfig, rank: int, tp: int):
        check_tp(cfg, tp)
        if not 0 <= rank < tp:
            raise ValueError(f"rank {rank} outside [0, tp={tp})")
        self.rank, self.tp = rank, tp
        self.first_expert = rank * cfg.experts // tp

    def slice_layer(self, L: dict, cfg: ModelConfig) -> dict:
        """This rank's tensors of layer ``L`` (views of the full ones)."""
        r, tp = self.rank, self.tp
        H, hd, G, R = cfg.heads, cfg.head_dim, cfg.wo_groups, cfg.wo_rank
        E, Is = cfg.experts, cfg.shared_inter

        def part(t, n, dim=0):
            k = t.shape[dim] // n
            return t.narrow(dim, r * k, k)

        out = dict(L)
        out["attn.wq_b.weight"] = part(L["attn.wq_b.weight"], tp)  # [H hd, q_lora]: whole heads
        out["attn.attn_sink"] = part(L["attn.attn_sink"], tp)
        out["attn.wo_a.weight"] = part(L["attn.wo_a.weight"], tp)  # [G R, Dg]: whole groups
        out["attn.wo_b.weight"] = part(L["attn.wo_b.weight"], tp, 1)
        experts = [k for k in L if k.startswith("ffn.experts.")]  # bf16 w1 / w3 / w2, or MXFP8 operands
        for k in experts:  # each [E, ...]: whole experts
            out[k] = part(L[k], tp)
        p = "ffn.shared_experts."
        out[p + "w1.weight"], out[p + "w3.weight"] = part(L[p + "w1.weight"], tp), part(L[p + "w3.weight"], tp)
        out[p + "w2.weight"] = part(L[p + "w2.weight"], tp, 1)
        assert out["attn.wq_b.weight"].shape[0] == H // tp * hd and out["attn.wo_a.weight"].shape[0] == G // tp * R
        assert all(out[k].shape[0] == E // tp for k in experts) and out[p + "w1.weight"].shape[0] == Is // tp
        return out


def shard_model(target: TargetModel, rank: int, tp: int) -> Shard:
    """Keep only rank ``rank`` of ``tp``'s slices of ``target``'s layers (copies: the rest is
    freed); the embedding, LM head and final norms stay whole. Marks ``target.shard``, which
    makes :class:`StepModel` all-reduce the partial sums."""
    shard = Shard(target.cfg, rank, tp)
    full = {k for L in target.layers for k in L}
    target.layers = [{k: v.clone() if v.data_ptr() != L[k].data_ptr() or v.shape != L[k].shape else v
                      for k, v in shard.slice_layer(L, target.cfg).items()} for L in target.layers]
    assert full == {k for L in target.layers for k in L}
    target.shard = shard
    return shard


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """Tensor parallelism splits whole WO-A groups (and so heads), routed experts and the shared
    expert's width evenly."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp not in (1, 2, 4, 8):
        raise ValueError(f"tp must be 1, 2, 4 or 8, got {tp!r}")
    for name, n in (("wo_groups", cfg.wo_groups), ("experts", cfg.experts), ("shared_inter", cfg.shared_inter)):
        if n % tp:
            raise ValueError(f"tp={tp} must divide the model's {name}={n}")


class StepModel:
    """Sync-free forward over a :class:`TargetModel`'s weights and a :class:`DecodeState`;
    with ``shard`` the forward of one tensor-parallel rank (its slices of every layer, partial
    sums all-reduced through ``ops.all_reduce``)."""

    def __init__(self, target: TargetModel, ops: Ops | None = None):
        self.t, self.cfg = target, target.cfg
        self.ops = ops or Ops()
        self.shard = getattr(target, "shard", None)  # set by shard_model
        self.layers = [V4Layer(self.cfg, L, self.cfg.ratio(li), target.inv_freq, self.ops, self.shard)
                       for li, L in enumerate(target.layers)]

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, st: DecodeState):
        """tokens, pos [B, S] int64 (device; a request's positions consecutive), slots [B] ->
        logits [B, S, V], the draft's features [B, S, 3C]."""
        cfg, t = self.cfg, self.t
        X = t.embed[tokens][:, :, None, :].expand(-1, -1, cfg.mhc_n, -1).contiguous()
        feats = []
        with forward_tables():  # position-derived tables (rotations, ring indices) shared by every layer
            for li, layer in enumerate(self.layers):
                X = layer.forward(X, tokens, pos, slots, st, li)
                if li in cfg.draft_feature_layers:
                    feats.append(X.mean(2))
        hidden = self.ops.rmsnorm(self.ops.hc_head(X, t.w, cfg), cfg.eps, t.w["norm.weight"])
        return hidden @ t.lm_head.T, torch.cat(feats, -1)
