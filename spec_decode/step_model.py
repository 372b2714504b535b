"""The target model's forward without host synchronisation: static shapes, tensor indexing
only, so a CUDA graph can capture a decode / verify step.

Same weights and math as :class:`spec_decode.model.TargetModel` (the specification, whose
per-token Python loops read positions on the host). Differences, all exact in real
arithmetic: the indexer scores every slot of the sequence's KV row and masks ``s > pos``
to ``-inf`` before selecting ``min(index_topk, max_len)`` by a stable sort (the reference
selects from the unmasked prefix; both break ties toward the lower key index -- the same
set); attention then masks the unselected entries. Sums run in a different order, so logits agree to FP32
rounding (tests/test_spec_decode.py bounds it), not bit for bit.

Ops are grouped behind :class:`Ops` so the GPU runtime can swap the PyTorch composites
(``baseline``) for this project's kernels (``fused``) one family at a time.

Attention core (shared by both backends; plain torch; ``"auto"``, the
default, picks per step shape by K/V traffic: :meth:`StepModel.pick_attention_core`):
``"masked_dense"`` runs ``scaled_dot_product_attention`` over the request's whole KV row with a
boolean mask of the selected keys -- the same softmax over the same keys, reading each
request's row once instead of materialising k copies per token; ``"gather"`` gathers each
token's selected keys and values, ``[B, S, k, heads, head_dim]``, and computes the softmax in
the activation dtype. On the H200 (slice config) the masked-dense core is the faster one
wherever a request's row is short against its tokens' selected keys.

With ``kv_cache="latent"`` (MLA-style: the pool holds the normed latent and one shared RoPE
key) the step model absorbs the up-projections: scores ``[q_rope ; k_b_h^T q_nope] . entry``
and ``o_h = v_b_h (softmax . latent)`` -- the reference expands every head's K and V from the
cached latent instead, equal in exact arithmetic. Both cores then attend one key / value head
(the masked-dense core by two batched matmuls around a masked softmax: ``Ops.attention_probs``,
in the fused ops one kernel); on the H200 it is the faster cache at the slice config.
"""

from __future__ import annotations

import math

import torch

from .model import (KVPool, TargetModel, attention_query, grouped_topk, kv_entries, mhc_mappings, moe_gathered,
                    post_mix, pre_mix, rmsnorm, shared_expert)


def family(name: str):
    """A profiler range naming an op family; spec_decode.bench counts the kernels launched
    inside each (a no-op for graph replay, which runs no Python)."""
    return torch.profiler.record_function(f"family::{name}")


class Ops:
    """PyTorch composites of every op family (the ``baseline`` path; runs on CPU and GPU)."""

    def mhc_mappings(self, X, L, sub, cfg):
        """-> the mappings object pre_mix / post_mix take (here the tuple (H_pre, H_post, H_res))."""
        return mhc_mappings(X, L, sub, cfg)

    def pre_mix(self, X, maps):
        return pre_mix(X, maps[0])

    def post_mix(self, X, maps, f):
        return post_mix(X, maps[1], maps[2], f)

    def indexer_topk(self, q_idx, w_idx, k_idx_layer, slots, pos, topk):
        """q_idx [B,S,H,D], w_idx [B,S,H], k_idx_layer [pool slots, L, D] (one layer of the KV
        pool), slots [B], pos [B,S] -> (idx [B,S,k] key positions, valid [B,S,k])."""
        k_idx_seq = k_idx_layer[slots]
        L = k_idx_seq.shape[1]
        logits = torch.einsum("bshd,bld->bshl", q_idx, k_idx_seq)
        score = (torch.relu(logits) * w_idx[..., None]).sum(2)  # [B, S, L]
        cand = torch.arange(L, device=pos.device)[None, None, :] <= pos[..., None]
        score = torch.where(cand, score, torch.full_like(score, float("-inf")))
        # stable descending sort: ties go to the lower key index (the reference's and the
        # indexer kernel's rule); masked keys sort last
        vals, idx = torch.sort(score, dim=-1, descending=True, stable=True)
        k = min(topk, L)
        return idx[..., :k], torch.isfinite(vals[..., :k])

    @staticmethod
    def attention_probs(att, mask):
        """att [R, S, H, M] scores (bf16 on the GPU), mask [R, S, W >= M] bool (the token's
        selected keys) -> softmax over M of the selected scores (the latent masked-dense core);
        may overwrite att."""
        return att.masked_fill_(~mask[:, :, None, :att.shape[-1]], float("-inf")).softmax(-1)

    def wo_a(self, o, wo_a):
        B, S, G = o.shape[0], o.shape[1], wo_a.shape[0]
        return torch.einsum("bsgd,grd->bsgr", o.reshape(B, S, G, -1), wo_a).reshape(B, S, -1)

    def moe(self, h, L, cfg):
        """h [N, C] (normed) -> routed + shared [N, C]."""
        if h.is_cuda and h.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
            logits = h @ L["router"].T
            with family("router top-k / padding"):
                ids, w = grouped_topk(logits, L["router_bias"], cfg)
            return self._moe_grouped(h, L, cfg, ids, w)
        return moe_gathered(h, L, cfg)  # the spec's per-choice gathers: fine for the CPU's small configs

    def expert_operand(self, x):
        """Rounding of every expert-GEMM operand (weights, routed input, SiLU * up): none in the
        bf16 composite; the tests' MXFP8-rounded yardstick overrides it."""
        return x

    def _moe_grouped(self, h, L, cfg, ids, w):
        """The unfused GPU composite: sort the routed rows by expert, bf16 grouped GEMMs,
        SiLU * up, a standalone weighted finalize, then the separate shared add."""
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
        g = torch._grouped_mm(xs, op(L["gate"]).transpose(1, 2), offs=offs)
        up = torch._grouped_mm(xs, op(L["up"]).transpose(1, 2), offs=offs)
        y = torch._grouped_mm(op(torch.nn.functional.silu(g) * up), op(L["down"]).transpose(1, 2), offs=offs)
        with family("standalone finalize"):
            routed = torch.empty_like(y).index_copy_(0, order, y).view(N, k, -1)
            out = (routed.float() * w[..., None].float()).sum(1).to(h.dtype)
        sh = shared_expert(h, L)
        with family("shared-expert add"):
            return out + sh


class StepModel:
    """Sync-free forward over a :class:`TargetModel`'s weights."""

    ATTENTION_CORES = ("auto", "gather", "masked_dense")

    @classmethod
    def check_attention_core(cls, attention_core: str) -> None:
        if attention_core not in cls.ATTENTION_CORES:
            raise ValueError(f"attention_core must be one of {cls.ATTENTION_CORES}, got {attention_core!r}")

    def __init__(self, target: TargetModel, ops: Ops | None = None, attention_core: str = "auto"):
        self.check_attention_core(attention_core)
        self.t, self.cfg = target, target.cfg
        self.ops = ops or Ops()
        self.attention_core = attention_core

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, kv: KVPool):
        """tokens, pos [B, S] int64 (device), slots [B] -> logits [B, S, V], hidden [B, S, C]."""
        cfg, ops, t = self.cfg, self.ops, self.t
        X = t.embed[tokens][:, :, None, :].expand(-1, -1, cfg.mhc_n, -1).contiguous()
        for li, L in enumerate(t.layers):
            maps = ops.mhc_mappings(X, L, "attn", cfg)
            X = ops.post_mix(X, maps, self.attention(ops.pre_mix(X, maps), L, li, pos, slots, kv))
            maps = ops.mhc_mappings(X, L, "moe", cfg)
            u = ops.pre_mix(X, maps)
            B, S, C = u.shape
            f = ops.moe(rmsnorm(u, cfg.eps).reshape(-1, C), L, cfg).view(B, S, C)
            X = ops.post_mix(X, maps, f)
        hidden = rmsnorm(X.mean(2), cfg.eps)
        return hidden @ t.lm_head.T, hidden

    def attention(self, u, L, li, pos, slots, kv: KVPool):
        cfg, ops = self.cfg, self.ops
        B, S, _ = u.shape
        H, hd, r = cfg.heads, cfg.head_dim, cfg.rope_dim
        h = rmsnorm(u, cfg.eps)
        q = attention_query(h, L, pos, cfg)
        q_idx = (h @ L["idx_q"].T).view(B, S, cfg.indexer_heads, cfg.indexer_dim)
        w_idx = h @ L["idx_w"].T
        k_idx = h @ L["idx_k"].T
        rows = slots[:, None].expand(B, S)
        k, v = kv_entries(h, L, pos, cfg)
        kv.k[li, rows, pos] = k  # tensor-indexed writes: no host sync
        if v is not None:  # the latent pool's v is a view of its k
            kv.v[li, rows, pos] = v
        if kv.latent:  # absorbed: q_h . [k_rope ; k_b_h lat] = [q_rope ; k_b_h^T q_nope] . entry
            q = torch.cat([q[..., :r], torch.einsum("bshd,hdc->bshc", q[..., r:],
                                                    L["k_b"].view(H, hd - r, cfg.kv_lora))], -1)
        kv.k_idx[li, rows, pos] = k_idx
        idx, valid = ops.indexer_topk(q_idx, w_idx, kv.k_idx[li], slots, pos, cfg.index_topk)  # [B, S, k]
        core = self.attention_core
        if core == "auto":
            core = self.pick_attention_core(B, S, idx.shape[-1], kv.k.shape[1], kv.max_len)
        if core == "masked_dense":
            o = self._masked_dense(q, idx, valid, li, slots, kv, 1 / math.sqrt(hd), ops)
        else:
            o = self._gather(q, idx, valid, li, slots, kv, 1 / math.sqrt(hd))
        if kv.latent:  # o_h = v_b_h (softmax . lat)
            o = torch.einsum("bshc,hdc->bshd", o, L["v_b"].view(H, hd, cfg.kv_lora))
        return ops.wo_a(o, L["wo_a"]) @ L["wo_b"].T

    @staticmethod
    def mask_width(M: int) -> int:
        """Row stride of the masked-dense core's key mask over ``M`` pool positions: one spare
        column (invalid selections scatter there), padded to 16 elements -- SDPA's
        memory-efficient kernel wants an aligned mask stride, and the fused ops'
        masked_softmax a multiple of 8."""
        return -(-(M + 1) // 16) * 16

    @staticmethod
    def pool_in_place(B: int, P: int) -> bool:
        """Whether the masked-dense core reads a ``P``-row pool in place for ``B`` requests (P
        row reads) rather than gathering the batch's rows first (3B row transfers)."""
        return P <= 3 * B

    @staticmethod
    def pick_attention_core(B: int, S: int, k: int, P: int, M: int) -> str:
        """``"auto"``: the core moving fewer K/V rows per step (static shapes: one choice per
        captured graph). Gather: ``3 S k`` per request (read, write, read of ``[S, k]``
        selected rows); masked-dense: ``M`` pool positions per pool row read -- ``P / B``
        rows per request in place (``P <= 3B``), else 3 (gather the row, read it). H200: the
        slice config (top-k 2048, M = 592-6160) ran 2x (BS1) and 11x (BS64) faster verify
        graphs masked-dense; the small config (top-k 64, M = 5136) ran BS1 2.27x baseline
        gathering and 1.95x masked-dense (bench/RESULTS.md). A latent pool's masked-dense core
        also writes bf16 scores for every pool position (not counted here); at the slice
        config's BS64 verify step it still beat gathering, 16.2 vs 17.6 ms of kernels."""
        dense_rows = P / B if StepModel.pool_in_place(B, P) else 3
        return "gather" if 3 * S * k < dense_rows * M else "masked_dense"

    @staticmethod
    def _gather(q, idx, valid, li, slots, kv: KVPool, scale: float):
        """Each token's selected keys and values gathered, ``[B, S, k, heads, dim]``; the
        softmax runs in the activation dtype. A latent pool's one key / value head serves every
        query head."""
        keys = kv.k[li, slots[:, None, None], idx]  # [B, S, k, Hk, dk]
        if kv.latent:
            # the value is the key's latent part (kv.v views it): one gather, not two
            keys = keys[..., 0, :]
            vals = keys[..., keys.shape[-1] - kv.v.shape[-1]:]
            att = torch.einsum("bshd,bskd->bshk", q, keys) * scale
        else:
            att = torch.einsum("bshd,bskhd->bshk", q, keys) * scale
        att = att.masked_fill(~valid[:, :, None, :], float("-inf")).softmax(-1)
        if kv.latent:
            return torch.einsum("bshk,bskd->bshd", att, vals)
        vals = kv.v[li, slots[:, None, None], idx]
        return torch.einsum("bshk,bskhd->bshd", att, vals)

    @staticmethod
    def _masked_dense(q, idx, valid, li, slots, kv: KVPool, scale: float, ops: Ops):
        """Attention over each request's whole KV row, keys outside its token's selection masked.

        Reads the pool in place when the batch covers a third of its slots or more (``P <= 3B``):
        the queries and masks are scattered into pool-slot order and every pool row is
        attended, ``P`` row reads. Otherwise the batch's rows are gathered first, 3B row
        transfers (read, write, read). Padded graph rows share the scratch slot: their scatters
        collide and their outputs are garbage either way (the runner discards them). Per-head
        pools run SDPA; a latent pool (one key head, key dim rope_dim + kv_lora) two batched
        matmuls around a softmax of bf16 scores -- SDPA would expand its key head to every
        query head."""
        B, S, _ = idx.shape
        P, M = kv.k.shape[1], kv.max_len
        # invalid selections scatter into a discarded column M (a clamped index 0 must not
        # clear a valid selection of key 0)
        sel = torch.where(valid, idx, torch.full_like(idx, M))
        width = StepModel.mask_width(M)
        mask = torch.zeros(B, S, width, dtype=torch.bool, device=q.device).scatter_(2, sel, True)
        in_place = StepModel.pool_in_place(B, P)
        if in_place:
            # slots outside the batch attend to key 0 only: finite, never read back
            mask_p = torch.zeros(P, S, width, dtype=torch.bool, device=q.device)
            mask_p[:, :, 0] = True
            mask = mask_p.index_copy(0, slots, mask)
            q = torch.zeros(P, *q.shape[1:], dtype=q.dtype, device=q.device).index_copy(0, slots, q)
            keys, vals = kv.k[li], kv.v[li]  # [P, M, Hk, d]
        else:
            keys, vals = kv.k[li, slots], kv.v[li, slots]  # [B, M, Hk, d]: the batch's pool rows
        if kv.latent:
            # [R, S*H, M] scores: at the slice config's BS64 verify step 0.6 GB a layer in bf16,
            # so the scale rides on q and the masked softmax (FP32 inside) writes bf16 -- the
            # activation-dtype scores the gather core uses too -- in place where the ops can
            R, H = q.shape[0], q.shape[2]
            att = torch.bmm((q * scale).reshape(R, S * H, -1), keys[:, :, 0].transpose(1, 2))
            att = ops.attention_probs(att.view(R, S, H, M), mask)
            o = torch.bmm(att.view(R, S * H, M), vals[:, :, 0]).view(R, S, H, -1)
        else:
            o = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), keys.transpose(1, 2), vals.transpose(1, 2), attn_mask=mask[:, None, :, :M],
                scale=scale).transpose(1, 2)
        # [B, S, H, dv]; every token selects at least itself: no empty row
        return o[slots] if in_place else o
