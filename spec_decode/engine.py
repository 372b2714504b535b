"""Decode engine: batched greedy decoding, plain or speculative (block size 5).

``Engine(config).generate(input_ids, max_new_tokens)`` -> one list of new token ids per
request. Speculative step for every live request (last accepted token ``t`` at position
``n``, KV holding positions ``< n``)::

    drafts d1..d5      = draft.propose(hidden(t), t)
    target logits      = forward([t, d1, ..., d5] at positions n..n+5)   # one verify pass
    g_i                = argmax(logits[i])                                # greedy targets
    accept j           = longest prefix with d_{i+1} == g_i  (0 <= j <= 5)
    emit               d1..dj, then the bonus token g_j                    # j + 1 tokens
    KV valid length    = n + 1 + j   (later slots are overwritten by the next verify)

Acceptance length = tokens emitted per verify. With the reference backend the output equals
plain greedy decoding token for token (tests/test_spec_decode.py). Requests have their own
lengths and finish independently; impossible requests are refused before any work (a batch
above the largest captured graph size, a KV pool too small for prompt + output + one block).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from .config import EngineConfig
from .draft import DraftModel
from .graphs import StepGraphs
from .model import KVPool, TargetModel
from .step_model import Ops, StepModel

BACKENDS = ("reference", "baseline", "fused")


@dataclasses.dataclass
class GenerationStats:
    verify_steps: int = 0
    acceptance_lengths: list[int] = dataclasses.field(default_factory=list)
    t_start: float = 0.0  # generate() entry
    t_first: float = 0.0  # prefill done: every request has its first token
    t_end: float = 0.0

    @property
    def median_acceptance(self) -> float:
        return statistics.median(self.acceptance_lengths) if self.acceptance_lengths else 0.0


class Engine:
    def __init__(self, config: EngineConfig = EngineConfig()):
        self.config = config
        dtype = getattr(torch, config.dtype)
        self.model = TargetModel(config.model, seed=config.seed, dtype=dtype, device=config.device)
        self.draft = DraftModel(config.model, self.model, config.block_size, seed=config.seed + 1, dtype=dtype,
                                device=config.device)
        if config.weights is not None:
            from .weights import load_weights

            load_weights(config.weights, self.model, self.draft)
        if config.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {config.backend!r}")
        if config.backend == "fused" and (dtype != torch.bfloat16 or torch.device(config.device).type != "cuda"):
            raise ValueError("backend='fused' runs this project's kernels: it needs dtype='bfloat16' and a CUDA "
                             f"device (got {config.dtype!r} on {config.device!r})")
        # one extra slot: the scratch row that padded graph rows write into
        self.scratch_slot = config.max_batch
        self.kv = KVPool(config.model, config.max_batch + 1, config.max_seq_len, dtype, config.device)
        self.stats = GenerationStats()
        if config.backend != "reference":
            if config.backend == "fused":
                from .fused_ops import FusedOps  # imports the CuTe DSL kernels: only when asked for

                width = max(max(config.graph_batch_sizes) * (config.block_size + 1), config.prefill_chunk)
                ops = FusedOps(self.model, max_tokens=width, max_len=config.max_seq_len)
            else:
                ops = Ops()
            self.step = StepModel(self.model, ops)
            K, sizes, dev = config.block_size, config.graph_batch_sizes, config.device
            fwd = lambda tok, pos, slots, _x: self.step.forward(tok, pos, slots, self.kv)  # noqa: E731
            self.verify_graphs = StepGraphs(fwd, sizes, K + 1, self.scratch_slot, dev)
            self.decode_graphs = StepGraphs(fwd, sizes, 1, self.scratch_slot, dev)
            self.draft_graphs = StepGraphs(lambda tok, pos, slots, hid: (self.draft.propose(hid, tok[:, 0]),),
                                           sizes, 1, self.scratch_slot, dev, hidden_dim=config.model.hidden,
                                           hidden_dtype=dtype)

    def warm_up(self, batch: int, speculative: bool = True) -> None:
        """Compile the kernels and capture the graphs a ``batch``-request ``generate`` replays.
        Otherwise the first step of each padded size compiles and captures inside ``generate``
        (seconds on a cold kernel cache) -- call this before timing. Runs on the scratch slot
        only, so no request's KV state changes."""
        if self.config.backend == "reference" or not self.verify_graphs.use_graphs:
            return
        dev = self.config.device
        slots = torch.full((batch,), self.scratch_slot, dtype=torch.long, device=dev)
        one = torch.zeros(batch, 1, dtype=torch.long, device=dev)
        if speculative:
            block = torch.zeros(batch, self.config.block_size + 1, dtype=torch.long, device=dev)
            self.verify_graphs.run(block, block.clone(), slots)
            hid = torch.zeros(batch, self.draft_graphs.hidden_dim, dtype=self.draft_graphs.hidden_dtype, device=dev)
            self.draft_graphs.run(one, one.clone(), slots, hid)
        else:
            self.decode_graphs.run(one, one.clone(), slots)
        torch.cuda.synchronize(dev)

    def _target(self, tokens, pos, slots):
        """Target forward of a decode (width 1) or verify (width K+1) step."""
        if self.config.backend == "reference":
            return self.model.forward(tokens, pos, slots, self.kv)
        runner = self.decode_graphs if tokens.shape[1] == 1 else self.verify_graphs
        return runner.run(tokens, pos, slots)

    def _propose(self, hid, last_t, live, last, length, K):
        if self.config.backend == "reference" or self.draft.oracle or self.draft.corrupt:
            return self.draft.propose(hid, last_t, oracle_ctx=lambda: self._oracle(live, last, length, K))
        zeros = torch.zeros_like(last_t)[:, None]
        return self.draft_graphs.run(last_t[:, None], zeros, zeros[:, 0], hid)[0]

    def _check(self, input_ids, max_new_tokens: int) -> None:
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        if not input_ids:
            raise ValueError("input_ids is empty")
        self.config.padded_batch(len(input_ids))  # raises above the largest graph size
        need = max(len(p) for p in input_ids) + max_new_tokens + self.config.block_size + 1
        if need > self.config.max_seq_len:
            raise ValueError(f"KV pool too small: a request needs {need} positions, the pool holds "
                             f"{self.config.max_seq_len} per request (raise max_seq_len)")
        for i, p in enumerate(input_ids):
            if not p or any((not isinstance(t, int)) or t < 0 or t >= self.config.model.vocab for t in p):
                raise ValueError(f"input_ids[{i}] must be a non-empty list of token ids in [0, {self.config.model.vocab})")

    def _prefill(self, input_ids):
        """Per request: run the prompt, return (first new token, its hidden state source)."""
        dev = self.config.device
        first, hidden = [], []
        fwd = self.model.forward if self.config.backend == "reference" else self.step.forward
        ch = self.config.prefill_chunk
        for r, prompt in enumerate(input_ids):
            # eager and unoptimised; chunks are exact (causal attention over the cache so far)
            for c0 in range(0, len(prompt), ch):
                toks = torch.tensor([prompt[c0:c0 + ch]], device=dev)
                pos = torch.arange(c0, c0 + toks.shape[1], device=dev)[None]
                logits, h = fwd(toks, pos, torch.tensor([r], device=dev), self.kv)
            first.append(int(logits[0, -1].argmax()))
            hidden.append(h[0, -1])
        return first, hidden

    def generate(self, input_ids: list[list[int]], max_new_tokens: int, speculative: bool = True) -> list[list[int]]:
        self._check(input_ids, max_new_tokens)
        B, dev = len(input_ids), self.config.device
        self.stats.t_start = time.perf_counter()
        first, hidden = self._prefill(input_ids)
        self.stats.t_first = time.perf_counter()  # every request has its first token (host-synced)
        out = [[t] for t in first]
        last = list(first)
        length = [len(p) for p in input_ids]  # KV valid length; `last` sits at position length
        live = [r for r in range(B) if len(out[r]) < max_new_tokens]
        while live:
            slots = torch.tensor(live, device=dev)
            last_t = torch.tensor([last[r] for r in live], device=dev)
            # Host logic reads each step's tokens with one device-to-host copy: a per-element
            # int(tensor) is a synchronising copy each, ~K x batch of them per step.
            if not speculative:
                pos = torch.tensor([[length[r]] for r in live], device=dev)
                logits, h = self._target(last_t[:, None], pos, slots)
                nxt = logits[:, 0].argmax(-1).tolist()
                for i, r in enumerate(live):
                    length[r] += 1
                    last[r] = nxt[i]
                    out[r].append(last[r])
            else:
                K = self.config.block_size
                hid = torch.stack([hidden[r] for r in live])
                drafts = self._propose(hid, last_t, live, last, length, K)
                block = torch.cat([last_t[:, None], drafts], 1)  # [b, K+1]
                pos = torch.tensor([[length[r] + j for j in range(K + 1)] for r in live], device=dev)
                logits, h = self._target(block, pos, slots)
                # [b, 2K + 1] on the host in one copy: the drafts, then the target's greedy tokens
                both = torch.cat([drafts, logits.argmax(-1)], 1).tolist()
                self.stats.verify_steps += 1
                accepted = []
                for i, r in enumerate(live):
                    d, g = both[i][:K], both[i][K:]
                    j = 0
                    while j < K and d[j] == g[j]:
                        j += 1
                    emitted = d[:j] + [g[j]]
                    self.stats.acceptance_lengths.append(len(emitted))
                    out[r].extend(emitted)
                    length[r] += 1 + j
                    last[r] = emitted[-1]
                    accepted.append(j)
                # the next draft starts from the hidden state of each request's last accepted token
                h_next = h[torch.arange(len(live), device=dev), torch.tensor(accepted, device=dev)]
                for i, r in enumerate(live):
                    hidden[r] = h_next[i]
            live = [r for r in live if len(out[r]) < max_new_tokens]
        self.stats.t_end = time.perf_counter()  # the last step's tokens were read on the host
        return [o[:max_new_tokens] for o in out]

    def _oracle(self, live, last, length, K):
        """Target's own greedy continuation (test-only draft); does not disturb the KV state
        the verify pass relies on: it writes positions the verify pass then overwrites."""
        dev = self.config.device
        slots = torch.tensor(live, device=dev)
        tok = torch.tensor([last[r] for r in live], device=dev)
        res = []
        for j in range(K):
            pos = torch.tensor([[length[r] + j] for r in live], device=dev)
            logits, _ = self._target(tok[:, None], pos, slots)
            tok = logits[:, 0].argmax(-1)
            res.append(tok)
        return torch.stack(res, 1)
