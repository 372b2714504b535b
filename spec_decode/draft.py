"""DSpark-style draft: proposes ``block_size`` tokens per step in one forward of three stages.

Each stage is a DeepSeek-V4 decoder layer (:class:`spec_decode.step_model.V4Layer`) with
sliding-window attention only (no compressor), its own mHC mappings and its own MoE
(sqrt-softplus top-k); then the draft's own ``hc_head`` collapse and RMSNorm, and the target's
LM head.

* **Context** (the target's view of the committed tokens): at every committed position ``p``,
  ``c_p = rmsnorm(fc [f_a ; f_b ; f_c])`` of the target's hidden states after three layers
  (``cfg.draft_feature_layers``; the stream means). Each stage's K = V of position ``p`` is its
  own ``rope(rmsnorm(wkv c_p))``, kept in a ring of the last ``window`` positions
  (:class:`spec_decode.step_model.DecodeState` ``draft_win``) and written for committed
  tokens only: the draft step receives the previous verify's features and how many of its
  positions were accepted, and writes the others to a discarded row (all on the device,
  inside the draft graph).
* **Overlap** (the fused engine on a GPU): each stage's context write runs on a side stream,
  forked as the stage begins, while the stage's mHC statistics, pre-mix and projections run on
  the main stream, and joined before the stage reads its ring -- so the statistics of all three
  stages have work beside them. The base engine writes the context inline.
* **Block**: the last accepted token ``t`` at position ``n`` and ``block_size - 1`` mask
  embeddings at ``n + 1 ..``; causal attention over the context window and the block; the
  logits at block position ``j`` give draft ``d_{j+1}``. One forward, no sampling loop.

Not kept from sglang's DSpark (not public here): any low-rank token-to-token bias and any
confidence head -- every block position proposes its argmax and the target verifies greedily.
The fused engine puts the LM head on :class:`spec_decode.fused_ops.MxDraftHead`; the draft
only proposes, so its rounding moves the acceptance length, never the verified output.

``oracle=True`` replaces the proposal with the target's own greedy continuation (a test
device that makes every draft token correct), and ``corrupt`` flips chosen draft positions,
so acceptance logic and state rollback are exercised at every acceptance length.
"""

from __future__ import annotations

import torch

from .config import ModelConfig
from .model import WeightFactory, init_layer, layer_weight_shapes, forward_tables
from .step_model import DecodeState, Ops, V4Layer


class DraftModel:
    def __init__(self, cfg: ModelConfig, target, block_size: int = 5, seed: int = 1, dtype=torch.float32,
                 device="cpu", on_layer=None):
        """``on_layer``: as :class:`spec_decode.model.TargetModel`'s, for each stage's weights."""
        self.cfg, self.target, self.block = cfg, target, block_size
        keep = on_layer or (lambda L: L)
        w = WeightFactory(seed, dtype, device)
        C, n = cfg.hidden, cfg.mhc_n
        #: global tensors by name (``draft.`` prefix in a weights file)
        self.w = {"fc.weight": w(C, 3 * C), "fc_norm.weight": 1 + w(C, scale=0.1), "mask_embed": w(C, scale=1.0),
                  "norm.weight": 1 + w(C, scale=0.1), "hc_head_fn": w(n, n * C).float(),
                  "hc_head_base": w(n, scale=0.1).float(), "hc_head_scale": torch.ones(1, device=device)}
        self.stages = [keep(init_layer(cfg, layer_weight_shapes(cfg, None, hash_routed=False, ratio=0), w, w.g,
                                       dtype, device)) for _ in range(cfg.draft_stages)]
        #: ``h [B, C] -> [B, vocab]`` scores whose per-row argmax is the draft token; None: the
        #: target's LM head in the model's dtype. The fused engine sets MxDraftHead.
        self.head = None
        self.oracle = False
        #: draft positions (0-based) to flip, for tests: a set, or a function of the proposal
        #: count returning one (a schedule of acceptance lengths)
        self.corrupt = set()
        self.proposals = 0
        self.bind(Ops())

    def bind(self, ops: Ops) -> None:
        """Run the stages with ``ops`` (the engine's backend)."""
        self.ops = ops
        self.layers = [V4Layer(self.cfg, L, 0, self.target.inv_freq, ops) for L in self.stages]

    def context(self, feats: torch.Tensor) -> torch.Tensor:
        return self.ops.rmsnorm(feats @ self.w["fc.weight"].T, self.cfg.eps, self.w["fc_norm.weight"])

    @torch.no_grad()
    def write_context(self, feats: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, commit: torch.Tensor,
                      st: DecodeState) -> None:
        """Store every stage's K = V of the target features ``feats [B, S, 3C]`` at positions
        ``pos [B, S]`` (consecutive) where ``commit [B, S]``; the others go to the ring's
        discarded last row. Only the last ``window`` positions of a long prefill chunk are
        kept (the older ones share ring rows with them and fall out of the window anyway)."""
        ctx = self.context_rows(feats, pos, slots, commit, st)
        with forward_tables():  # the stages rotate the same positions
            for s in range(len(self.layers)):
                self.write_stage_context(s, ctx, st)

    def context_rows(self, feats, pos, slots, commit, st: DecodeState) -> tuple:
        """``(c, pos, rows, dst)``: the context vectors of the kept positions and where each
        stage's ring stores them (:meth:`write_context`, in two parts so each stage's write
        can run beside that stage)."""
        R = st.win_rows
        k = min(pos.shape[1], R)
        feats, pos, commit = feats[:, -k:], pos[:, -k:], commit[:, -k:]
        dst = torch.where(commit, pos.remainder(R), torch.full_like(pos, R))
        return self.context(feats), pos, slots[:, None].expand_as(dst), dst

    def write_stage_context(self, s: int, ctx: tuple, st: DecodeState) -> None:
        c, pos, rows, dst = ctx
        st.draft_win[s][rows, dst] = self.layers[s].kv(c, pos).to(st.draft_win[s].dtype)

    def commit_positions(self, feats: torch.Tensor, next_pos: torch.Tensor, n_commit: torch.Tensor) -> tuple:
        """``(pos, commit)`` ``[B, K + 1]`` of a verify step's features ``feats [B, K + 1, 3C]``:
        positions ``next_pos - n_commit ..``, of which the first ``n_commit [B]`` were accepted
        (``next_pos [B]``: the position of the token the next draft starts from)."""
        ar = torch.arange(feats.shape[1], device=feats.device)
        return next_pos[:, None] - n_commit[:, None] + ar, ar < n_commit[:, None]

    def commit_verify(self, feats: torch.Tensor, next_pos: torch.Tensor, n_commit: torch.Tensor,
                      slots: torch.Tensor, st: DecodeState) -> None:
        """Commit a verify step's accepted positions to the context (:meth:`commit_positions`)."""
        pos, commit = self.commit_positions(feats, next_pos, n_commit)
        self.write_context(feats, pos, slots, commit, st)

    @torch.no_grad()
    def forward_block(self, last_tokens: torch.Tensor, last_pos: torch.Tensor, slots: torch.Tensor,
                      st: DecodeState, stage_start=None, before_ring=None) -> torch.Tensor:
        """Drafts ``[B, block]`` for requests whose last accepted token ``last_tokens [B]`` sits
        at ``last_pos [B]`` (their context rows hold the committed positions before it).
        ``stage_start(s)``: called as stage ``s`` begins (the engine forks that stage's context
        write onto a side stream there); ``before_ring(s)``: called before stage ``s`` first
        reads its context rows (that write joins there)."""
        cfg, K = self.cfg, self.block
        B = last_tokens.shape[0]
        dev = last_tokens.device
        pos = last_pos[:, None] + torch.arange(K, device=dev)
        x = self.w["mask_embed"].expand(B, K, -1).clone()
        x[:, 0] = self.target.embed[last_tokens]
        X = x[:, :, None, :].expand(-1, -1, cfg.mhc_n, -1).contiguous()
        toks = torch.cat([last_tokens[:, None], last_tokens[:, None].expand(B, K - 1)], 1)
        with forward_tables():  # the stages rotate at the same positions
            for s, layer in enumerate(self.layers):
                if stage_start is not None:
                    stage_start(s)
                X = layer.forward(X, toks, pos, slots, st, s, win=st.draft_win[s], write_window=False,
                                  before_ring=(lambda s=s: before_ring(s)) if before_ring is not None else None)
        h = self.ops.rmsnorm(self.ops.hc_head(X, self.w, cfg), cfg.eps, self.w["norm.weight"])
        flat = h.reshape(B * K, -1)
        logits = self.head(flat) if self.head is not None else flat @ self.target.lm_head.T
        return logits.argmax(-1).view(B, K)

    @torch.no_grad()
    def propose(self, last_tokens, last_pos, slots, st, oracle_ctx=None) -> torch.Tensor:
        """-> drafts [B, block] (the oracle's when set), with the ``corrupt`` positions flipped."""
        drafts = oracle_ctx() if self.oracle else self.forward_block(last_tokens, last_pos, slots, st)
        flip = self.corrupt(self.proposals) if callable(self.corrupt) else self.corrupt
        self.proposals += 1
        for j in flip:
            drafts[:, j] = (drafts[:, j] + 1) % self.cfg.vocab
        return drafts
