"""Three-stage draft module: proposes ``block_size`` tokens from the target's last hidden
state and the last accepted token.

* stage 1 (fuse): ``h0 = tanh(W_f [hidden ; embed(token)])``;
* stage 2 (propose): a recurrent cell unrolled ``block_size`` times, each step consuming the
  token it proposed before -- ``h_{j+1} = tanh(W_r [h_j ; embed(d_j)])``;
* stage 3 (head): ``d_j = argmax(lm_head(h_j))`` with the target's LM head (the fused
  engine, batches up to 16 of a large head: an MXFP8 copy of it,
  :class:`spec_decode.fused_ops.MxDraftHead` -- the draft only proposes, so its rounding moves
  the acceptance length, never the verified output).

The three stages run as one captured graph in the GPU runtime. ``oracle=True`` replaces the
proposal with the target's own greedy continuation (a test device that makes every draft
token correct), and ``corrupt`` flips chosen draft positions, so acceptance logic and KV
rollback are exercised at every acceptance length.
"""

from __future__ import annotations

import math

import torch

from .config import ModelConfig


class DraftModel:
    def __init__(self, cfg: ModelConfig, target, block_size: int = 5, seed: int = 1, dtype=torch.float32,
                 device="cpu"):
        self.cfg, self.target, self.block = cfg, target, block_size
        gdev = torch.device(device)
        g = torch.Generator(device=gdev).manual_seed(seed)
        C = cfg.hidden
        self.w_fuse = torch.randn(C, 2 * C, generator=g, device=gdev, dtype=dtype) / math.sqrt(2 * C)
        self.w_rec = torch.randn(C, 2 * C, generator=g, device=gdev, dtype=dtype) / math.sqrt(2 * C)
        #: ``h [B, C] -> [B, vocab]`` scores whose per-row argmax is the draft token, for stage
        #: 3; None: the logits ``h @ lm_head^T`` in the model's dtype. The fused engine sets
        #: :class:`spec_decode.fused_ops.MxDraftHead`.
        self.head = None
        self.oracle = False
        self.corrupt: set[int] = set()  # draft positions (0-based) to flip, for tests

    @torch.no_grad()
    def propose(self, hidden: torch.Tensor, last_tokens: torch.Tensor, oracle_ctx=None) -> torch.Tensor:
        """hidden [B, C], last_tokens [B] -> drafts [B, block]."""
        if self.oracle:
            drafts = oracle_ctx()
        else:
            emb = self.target.embed
            h = torch.tanh(torch.cat([hidden, emb[last_tokens]], -1) @ self.w_fuse.T)  # stage 1
            tok = last_tokens
            out = []
            for _ in range(self.block):  # stage 2 + 3
                h = torch.tanh(torch.cat([h, emb[tok]], -1) @ self.w_rec.T)
                logits = self.head(h) if self.head is not None else h @ self.target.lm_head.T
                tok = logits.argmax(-1)
                out.append(tok)
            drafts = torch.stack(out, 1)
        for j in self.corrupt:
            drafts[:, j] = (drafts[:, j] + 1) % self.cfg.vocab
        return drafts
