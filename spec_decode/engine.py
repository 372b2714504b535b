"""Decode engine: batched greedy decoding, plain or speculative (block size 5).

``Engine(config).generate(input_ids, max_new_tokens)`` -> one list of new token ids per
request. Speculative step for every live request (last accepted token ``t`` at position
``n``, the state holding positions ``< n``)::

    drafts d1..d5      = draft(t at n; the draft's context: target features of positions < n)
    target logits      = forward([t, d1, ..., d5] at positions n..n+5)   # one verify pass
    g_i                = argmax(logits[i])                                # greedy targets
    accept j           = longest prefix with d_{i+1} == g_i  (0 <= j <= 5)
    emit               d1..dj, then the bonus token g_j                    # j + 1 tokens
    new length         = n + 1 + j   (state rows of later positions are never read, then
                                      overwritten: spec_decode.step_model)
    draft context     += the target's features at n .. n + j (committed tokens only)

Acceptance length = tokens emitted per verify. With the reference backend the output equals
plain greedy decoding token for token (tests/test_spec_decode.py). Requests have their own
lengths (and output lengths) and finish independently; impossible requests are refused
before any work (a batch above the largest captured graph size, a state too small for
prompt + output + one block).

Host path (torch-bf16 / base / fused backends, speculative): the acceptance above also runs on the
device (``j = sum(cumprod(d == g))``), so step s + 1 -- draft graph, verify graph -- is
enqueued from device state before step s's tokens are read back; the host's bookkeeping for
step s overlaps step s + 1 on the GPU, and each step costs one device-to-host copy. A request
that finished in step s rides along in step s + 1 (positions clamped into its own state slot,
tokens dropped). A step whose padded batch size has no captured graph yet is enqueued only
after the read-back, so a capture never overlaps a step in flight.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import statistics
import time

import torch

from moe.streams import dedicated_stream

from .config import EngineConfig
from .draft import DraftModel
from .graphs import StepGraphs
from .model import History, TargetModel
from .step_model import (DecodeState, Ops, RankView, Shard, SimulatedRanks, StepModel, ThreadAllReduce, check_tp,
                         shard_model)

#: "base": the fused arm's formats and kernels with the reference PR's fusions undone
#: (spec_decode.fused_ops.BaseOps) -- the comparison the PR makes
BACKENDS = ("reference", "torch-bf16", "base", "fused")
KERNEL_BACKENDS = ("base", "fused")
DRAFT_HEADS = ("mxfp8", "mxfp8+fp8", "bf16")


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


class CollectiveError(RuntimeError):
    """A tensor-parallel generate that failed in a collective (a peer exited, or did not answer
    within ``EngineConfig.dist_timeout_s``). ``outputs[i]``: request i's tokens produced before
    the failure, a prefix of what it would have generated; ``finished[i]``: whether that is all
    of them -- a request that completed before the failure keeps its whole output."""

    def __init__(self, message: str, outputs: list[list[int]], finished: list[bool]):
        super().__init__(message)
        self.outputs, self.finished = outputs, finished


class Engine:
    def __init__(self, config: EngineConfig = EngineConfig()):
        self.config = config
        if config.draft_head not in DRAFT_HEADS:
            raise ValueError(f"draft_head must be one of {DRAFT_HEADS}, got {config.draft_head!r}")
        if config.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {config.backend!r}")
        if not isinstance(config.block_size, int) or config.block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {config.block_size!r}")
        self.set_acceptance_length(config.acceptance_length)
        dtype = getattr(torch, config.dtype)
        if config.backend in KERNEL_BACKENDS and (dtype != torch.bfloat16 or torch.device(config.device).type != "cuda"):
            raise ValueError(f"backend={config.backend!r} runs this project's kernels: it needs dtype='bfloat16' and "
                             f"a CUDA device (got {config.dtype!r} on {config.device!r})")
        mc = config.model
        mc.validate()
        self.rank = 0
        if config.tp != 1:
            check_tp(mc, config.tp)
            if config.backend == "reference":
                raise ValueError("tp > 1 runs the step model: backend='torch-bf16' or 'fused'")
            if config.allreduce not in (None, "custom_push", "nccl"):
                raise ValueError(f"allreduce must be None, 'custom_push' or 'nccl', got {config.allreduce!r}")
            if not config.simulate_ranks:
                self.rank, config, self.owns_group = _init_process_group(config)
                self.config = config
        on_layer = None
        if config.backend in KERNEL_BACKENDS and config.weights is None:
            # random weights for the kernel backends: each layer's routed experts become their
            # MXFP8 operands as the layer is made (the bf16 experts of a V4-Flash slice alone
            # would fill an 80 GB card)
            from .fused_ops import quantize_layer_experts

            on_layer = quantize_layer_experts
        self.model = TargetModel(mc, seed=config.seed, dtype=dtype, device=config.device, on_layer=on_layer)
        self.draft = DraftModel(mc, self.model, config.block_size, seed=config.seed + 1, dtype=dtype,
                                device=config.device, on_layer=on_layer)
        if config.weights is not None:
            from .weights import load_weights

            load_weights(config.weights, self.model, self.draft)
        if config.tp != 1 and not config.simulate_ranks:  # every rank made the same weights; keep this rank's
            shard_model(self.model, self.rank, config.tp)
        K = config.block_size
        # one extra slot: the scratch row that padded graph rows write into
        self.scratch_slot = config.max_batch
        slots = config.max_batch + 1
        self.state = DecodeState(mc, slots, config.max_seq_len, K + 1, dtype, config.device,
                                 draft_stages=mc.draft_stages)
        self.history = History(mc, slots, config.max_seq_len, dtype, config.device) \
            if config.backend == "reference" else None
        self.stats = GenerationStats()
        self.feat_dim = 3 * mc.hidden
        if config.backend != "reference":
            width = max(config.max_batch * (K + 1), config.prefill_chunk)
            simulated = config.tp != 1 and config.simulate_ranks
            if simulated:
                self.step = self._simulated_ranks(width)
                ops = self.step.ops
            elif config.backend in KERNEL_BACKENDS:
                ops = self._kernel_ops(self.model, width, self.draft)
            else:
                ops = Ops()
            if config.backend in KERNEL_BACKENDS:
                from .fused_ops import MxDraftHead

                if config.draft_head != "bf16" and MxDraftHead.pays_off(self.model.lm_head):
                    self.draft.head = MxDraftHead(self.model.lm_head, config.max_batch * K,
                                                  fp8_above=config.draft_head == "mxfp8+fp8")
            if not simulated:
                if config.tp != 1:
                    self._bind_group(ops, width)
                self.step = StepModel(self.model, ops)
            self.draft.bind(ops)  # replicated: rank 0's ops run it (simulated ranks: once)
            sizes, dev = config.graph_batch_sizes, config.device
            fwd = lambda tok, pos, slots: self.step.forward(tok, pos, slots, self.state)  # noqa: E731
            self.verify_graphs = StepGraphs(fwd, sizes, K + 1, self.scratch_slot, dev)
            self.decode_graphs = StepGraphs(fwd, sizes, 1, self.scratch_slot, dev)
            self.draft_graphs = StepGraphs(self._draft_step, sizes, 1, self.scratch_slot, dev,
                                           extras=(((K + 1, self.feat_dim), dtype), ((), torch.long)))

    def _bind_group(self, ops, max_tokens: int) -> None:
        """The ops' all-reduce: the default process group, and on the fused backend the custom
        push group where select_allreduce_backend picks it (the reason for a fallback is
        logged once)."""
        import torch.distributed as dist

        ops.group = dist.group.WORLD
        cfg = self.config
        self.allreduce_backend = "torch.distributed"
        if cfg.backend not in KERNEL_BACKENDS:
            return
        from comm.backend import peers_p2p_capable, select_allreduce_backend
        from cute_kernels.arch import current_arch

        dev = torch.device(cfg.device)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.tp))
        choice = select_allreduce_backend(world_size=cfg.tp, tokens=max_tokens, hidden=cfg.model.hidden,
                                          arch=current_arch(dev), p2p_ok=peers_p2p_capable(range(local_world)),
                                          single_node=local_world == cfg.tp, force=cfg.allreduce)
        self.allreduce_backend = choice.backend
        if choice.backend == "custom_push":
            from comm.buffers import PushAllReduceGroup

            ops.push, ops.push_rank = PushAllReduceGroup.from_process_group(max_tokens, cfg.model.hidden, dev)
            # its kernels compiled, loaded and launched once before any graph captures them
            ops.push.warm_up({ops.push_rank: torch.cuda.current_stream(dev)},
                             topk=cfg.model.top_k if cfg.backend == "fused" else None)

    def _simulated_ranks(self, max_tokens: int):
        """``tp`` ranks in this process (:class:`spec_decode.step_model.SimulatedRanks`): rank 0
        has the engine's state and runs the draft; on a GPU all-reduces run on the simulated push
        group (FP32 in rank order -> bf16), on a CPU through :class:`ThreadAllReduce`."""
        cfg, tp = self.config, self.config.tp
        mc, dev = cfg.model, cfg.device
        cuda = torch.device(dev).type == "cuda"
        views = [RankView(self.model, Shard(mc, r, tp)) for r in range(tp)]
        if cfg.backend in KERNEL_BACKENDS:
            opss = [self._kernel_ops(views[r], max_tokens, self.draft if r == 0 else None) for r in range(tp)]
            for L in self.model.layers:  # the views' bf16 experts are released: free the storage too
                for w in ("w1", "w3", "w2"):
                    L.pop(f"ffn.experts.{w}", None)
        else:
            opss = [Ops() for _ in range(tp)]
        # eager forwards (threads) sum through `threads`; on a GPU the captured graphs push
        threads = ThreadAllReduce(tp, timeout=cfg.dist_timeout_s)
        push = None
        if cuda:
            from comm.buffers import PushAllReduceGroup

            push = PushAllReduceGroup.simulated(tp, max_tokens, mc.hidden, device=dev)
            self.allreduce_backend = "custom_push in the graphs, threads eagerly (simulated ranks)"
        else:
            self.allreduce_backend = "FP32 rank-order sum (simulated ranks, threads)"
        for r, o in enumerate(opss):
            o.push_rank, o.push, o.group = r, push, threads
        states = [self.state] + [DecodeState(mc, self.state.slots, cfg.max_seq_len, cfg.block_size + 1,
                                             self.model.dtype, dev) for _ in range(1, tp)]
        ranks = SimulatedRanks([StepModel(v, o) for v, o in zip(views, opss)], states, threads)
        if push is not None:  # the push kernels compiled, loaded and launched before any capture
            push.warm_up(dict(enumerate(ranks.streams)), topk=mc.top_k if cfg.backend == "fused" else None)
        return ranks

    def _kernel_ops(self, target, max_tokens: int, draft):
        """The base or fused backend's ops for ``target`` (the model, or one rank's view of it),
        preparing the kernel weights of its layers and of ``draft``'s stages. This engine runs
        no torch-bf16 MoE, so the bf16 expert weights are released."""
        from .fused_ops import BaseOps, FusedOps  # imports the CuTe DSL kernels: only when asked for

        cfg = self.config
        return (FusedOps if cfg.backend == "fused" else BaseOps)(
            target, max_tokens=max_tokens, max_len=cfg.max_seq_len, moe_row_tile=cfg.moe_row_tile,
            indexer_token_group=cfg.indexer_token_group, draft=draft, release_bf16_experts=True,
            **(dict(wo_a_pdl=cfg.wo_a_pdl, router_pdl=cfg.router_pdl) if cfg.backend == "fused" else {}))

    def _draft_step(self, tok, pos, slots, feats, n_commit):
        """The draft graph: commit the previous verify's accepted positions to the draft's
        context (``feats [b, K + 1, 3C]`` of positions ``pos - n_commit ..``; the first
        ``n_commit`` are accepted), then propose from the last token ``tok`` at ``pos``.

        Fused on a GPU: each stage's context write on a side stream, forked as the stage starts
        and joined before it reads its ring, so it runs beside the stage's mHC statistics and
        projections (parallel branches of the captured draft graph). Elsewhere (the base arm
        included): written first, inline."""
        if not feats.is_cuda or self.config.backend != "fused":
            self.draft.commit_verify(feats, pos[:, 0], n_commit, slots, self.state)
            return (self.draft.forward_block(tok[:, 0], pos[:, 0], slots, self.state),)
        main = torch.cuda.current_stream()
        side = getattr(self, "_draft_side", None)
        if side is None:
            side = self._draft_side = dedicated_stream(feats.device)
        cpos, commit = self.draft.commit_positions(feats, pos[:, 0], n_commit)
        ctx = None

        def stage_start(s):
            nonlocal ctx
            side.wait_stream(main)
            with torch.cuda.stream(side):
                if s == 0:  # the context vectors, once, for every stage's write
                    ctx = self.draft.context_rows(feats, cpos, slots, commit, self.state)
                self.draft.write_stage_context(s, ctx, self.state)

        return (self.draft.forward_block(tok[:, 0], pos[:, 0], slots, self.state, stage_start=stage_start,
                                         before_ring=lambda s: main.wait_stream(side)),)

    def warm_up(self, batch: int, speculative: bool = True) -> None:
        """Compile the kernels and capture the graphs a ``batch``-request ``generate`` replays.
        Otherwise the first step of each padded size compiles and captures inside ``generate``
        (seconds on a cold kernel cache) -- call this before timing. Runs on the scratch slot
        only, so no request's state changes."""
        if self.config.backend == "reference" or not self.verify_graphs.use_graphs:
            return
        dev, K = self.config.device, self.config.block_size
        slots = torch.full((batch,), self.scratch_slot, dtype=torch.long, device=dev)
        one = torch.zeros(batch, 1, dtype=torch.long, device=dev)
        if speculative:
            block = torch.zeros(batch, K + 1, dtype=torch.long, device=dev)
            self.verify_graphs.run(block, block.clone(), slots)
            feats = torch.zeros(batch, K + 1, self.feat_dim, dtype=self.model.dtype, device=dev)
            self.draft_graphs.run(one, one.clone(), slots, feats, torch.zeros(batch, dtype=torch.long, device=dev))
        else:
            self.decode_graphs.run(one, one.clone(), slots)
        torch.cuda.synchronize(dev)

    def _target(self, tokens, pos, slots):
        """Target forward of a decode (width 1) or verify (width K+1) step -> (logits, feats)."""
        if self.config.backend == "reference":
            return self.model.forward(tokens, pos, slots, self.history)
        runner = self.decode_graphs if tokens.shape[1] == 1 else self.verify_graphs
        return runner.run(tokens, pos, slots)

    def _propose(self, last_t, len_t, slots, feats, n_commit, live, last, length):
        """Drafts ``[b, K]``: commits the previous verify's accepted features to the draft's
        context, then proposes (the oracle / corrupted test drafts eagerly)."""
        K = self.config.block_size
        if self.config.backend == "reference" or self.draft.oracle or self.draft.corrupt:
            self.draft.commit_verify(feats, len_t, n_commit, slots, self.state)
            return self.draft.propose(last_t, len_t, slots, self.state,
                                      oracle_ctx=lambda: self._oracle(live, last, length, K))
        return self.draft_graphs.run(last_t[:, None], len_t[:, None], slots, feats, n_commit)[0]

    def _check(self, input_ids, max_new_tokens) -> list[int]:
        """Validates a request batch; returns each request's max_new_tokens."""
        if self.closed:
            raise RuntimeError("this Engine was closed (Engine.close): its process group is released; build a new one")
        if not input_ids:
            raise ValueError("input_ids is empty")
        per = [max_new_tokens] * len(input_ids) if isinstance(max_new_tokens, int) else max_new_tokens
        if not isinstance(per, (list, tuple)) or len(per) != len(input_ids) or \
                any(not isinstance(m, int) or isinstance(m, bool) or m < 1 for m in per):
            raise ValueError(f"max_new_tokens must be a positive int or one per request, got {max_new_tokens!r}")
        self.config.padded_batch(len(input_ids))  # raises above the largest graph size
        # (the pipelined loop may run one verify step past a request's last: its positions are
        # clamped into the pool and its tokens discarded, so no extra room is needed)
        need = max(len(p) + m for p, m in zip(input_ids, per)) + self.config.block_size + 1
        if need > self.config.max_seq_len:
            raise ValueError(f"state too small: a request needs {need} positions, the state holds "
                             f"{self.config.max_seq_len} per request (raise max_seq_len)")
        for i, p in enumerate(input_ids):
            if not p or any((not isinstance(t, int)) or t < 0 or t >= self.config.model.vocab for t in p):
                raise ValueError(f"input_ids[{i}] must be a non-empty list of token ids in [0, {self.config.model.vocab})")
        return list(per)

    def _chunked_forward(self, seq: list[int], slot: int):
        """Eager target forwards over ``seq`` at positions 0.. in state slot ``slot``, one per
        prefill chunk (exact: every state row is keyed by position); yields each chunk's
        (logits, feats, pos) ``[1, chunk, ...]``."""
        dev, ch = self.config.device, self.config.prefill_chunk
        slot_t = torch.tensor([slot], device=dev)
        for c0 in range(0, len(seq), ch):
            toks = torch.tensor([seq[c0:c0 + ch]], device=dev)
            pos = torch.arange(c0, c0 + toks.shape[1], device=dev)[None]
            if self.config.backend == "reference":
                logits, feats = self.model.forward(toks, pos, slot_t, self.history)
            else:
                logits, feats = self.step.forward(toks, pos, slot_t, self.state)
            yield logits, feats, pos

    def _prefill(self, input_ids):
        """Per request: run the prompt (its features committed to the draft's context);
        return the first new tokens."""
        first = []
        slot_t = None
        for r, prompt in enumerate(input_ids):  # eager and unoptimised
            slot_t = torch.tensor([r], device=self.config.device)
            for logits, feats, pos in self._chunked_forward(prompt, r):
                self.draft.write_context(feats, pos, slot_t, torch.ones_like(pos, dtype=torch.bool), self.state)
            first.append(int(logits[0, -1].argmax()))
        return first

    def _rows_given(self, prompt: list[int], continuation: list[int]):
        """Teacher forcing: eager forwards over the prompt and the continuation but its last
        token, one per prefill chunk on the scratch slot (no request's state changes), yielding
        each chunk's logits rows at the continuation's positions (a view of a buffer the next
        chunk's forward may reuse)."""
        seq = list(prompt) + list(continuation[:-1])
        self._check([seq], 1)
        first = len(prompt) - 1
        for logits, _, pos in self._chunked_forward(seq, self.scratch_slot):
            yield logits[0, max(first - int(pos[0, 0]), 0):]

    @torch.no_grad()
    def logits_given(self, prompt: list[int], continuation: list[int]) -> torch.Tensor:
        """Teacher forcing: this engine's FP32 logits ``[len(continuation), vocab]`` at each
        position of ``continuation`` given the prompt and the continuation before it."""
        return torch.cat([r.to(torch.float32, copy=True) for r in self._rows_given(prompt, continuation)])

    @torch.no_grad()
    def greedy_given(self, prompt: list[int], continuation: list[int]) -> list[int]:
        """Teacher forcing: this engine's greedy token at each position of ``continuation``
        (the argmax of :meth:`logits_given`, without keeping the logits).
        ``spec_decode.bench`` feeds it another backend's output: the fraction of equal tokens
        is a per-step agreement that one early near-tie cannot collapse, unlike comparing two
        free-running greedy continuations."""
        return torch.cat([r.argmax(-1) for r in self._rows_given(prompt, continuation)]).tolist()

    def generate(self, input_ids: list[list[int]], max_new_tokens: int | list[int],
                 speculative: bool = True, pipelined: bool | None = None) -> list[list[int]]:
        """Greedy continuation of every request: ``max_new_tokens`` new ids each (an int, or one
        per request). ``pipelined`` (default: on wherever it applies -- speculative decoding
        with the captured draft graph) enqueues each verify step before reading the previous
        step's tokens back, so the host's bookkeeping overlaps the GPU."""
        per = self._check(input_ids, max_new_tokens)
        if self.config.tp != 1:
            self._outputs = None
            try:
                return self._generate(input_ids, per, speculative, pipelined)
            except RuntimeError as e:  # a peer died or timed out inside a collective
                raise CollectiveError(f"tensor-parallel rank {self.rank} of {self.config.tp}: generate failed in a "
                                      f"collective (a peer exited or did not answer within "
                                      f"{self.config.dist_timeout_s:g} s): {e}",
                                      *self._outputs_before_failure(e, per)) from e
        return self._generate(input_ids, per, speculative, pipelined)

    def _outputs_before_failure(self, err, per):
        """``(outputs, finished)`` of a generate that failed with ``err``: each request's tokens
        read back before the failure. A collective that raises where it fails (gloo, the
        simulated ranks' threads) leaves every earlier step's tokens valid. A push all-reduce
        that timed out is only seen when the generate ends (its reduction was skipped, so any
        step after it may be wrong): then no token is reported."""
        try:
            from comm.buffers import AllReduceTimeout
        except ImportError:  # no push group could have run
            AllReduceTimeout = ()
        cause = err
        while cause is not None and not isinstance(cause, AllReduceTimeout):
            cause = cause.__cause__
        if self._outputs is None or cause is not None:
            return [[] for _ in per], [False] * len(per)
        outs = [o[:m] for o, m in zip(self._outputs, per)]
        return outs, [len(o) == m for o, m in zip(outs, per)]

    owns_group = False  #: whether this engine initialised torch.distributed (close() destroys it)
    closed = False  #: close() released the process group: no further generate

    def close(self) -> None:
        """Let go of torch.distributed (tp > 1 over processes; otherwise nothing to do): drop the
        ops' references to the process group and, if this engine initialised the group, wait for
        every rank and destroy it. A group still referenced when the interpreter exits is torn
        down during finalisation, where gloo's worker threads abort the process. Idempotent; the
        engine runs no further steps (``generate`` raises)."""
        ops = getattr(getattr(self, "step", None), "ops", None)
        if ops is None or ops.group is None or isinstance(ops.group, ThreadAllReduce):
            return
        ops.group = ops.push = None
        self.closed = True
        if self.owns_group:
            import torch.distributed as dist

            dist.barrier()  # no rank tears the group down while a peer still uses it
            dist.destroy_process_group()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_collectives(self) -> None:
        """Raise comm.buffers.AllReduceTimeout if a push all-reduce gave up waiting for a peer
        during the last generate (a rank that never launched: its outputs are not to be used)."""
        push = getattr(getattr(self, "step", None), "ops", None)
        push = getattr(push, "push", None)
        if push is not None:
            push.check()

    def _generate(self, input_ids, per, speculative, pipelined):
        self.stats = GenerationStats()  # this call's
        self.stats.t_start = time.perf_counter()
        first = self._prefill(input_ids)
        self.stats.t_first = time.perf_counter()  # every request has its first token (host-synced)
        can_pipeline = speculative and self.config.backend != "reference" and not (self.draft.oracle or
                                                                                   self.draft.corrupt)
        if pipelined and not can_pipeline:
            raise ValueError("pipelined=True needs speculative decoding with the model draft on the torch-bf16, base or "
                             "fused backend")
        if can_pipeline and pipelined is not False:
            out = self._decode_pipelined(input_ids, per, first)
        else:
            out = self._decode_sync(input_ids, per, first, speculative)
        self.stats.t_end = time.perf_counter()  # the last step's tokens were read on the host
        self._check_collectives()
        return [o[:m] for o, m in zip(out, per)]

    def _decode_sync(self, input_ids, per, first, speculative):
        """One step at a time: enqueue, read the tokens back, bookkeeping (the reference
        backend, plain decoding and the test drafts)."""
        B, dev, K = len(input_ids), self.config.device, self.config.block_size
        out = self._outputs = [[t] for t in first]  # the lists a failed generate reports
        last = list(first)
        length = [len(p) for p in input_ids]  # positions processed; `last` sits at position length
        # the last verify's features and how many of its positions were accepted (0: none yet)
        feats = torch.zeros(B, K + 1, self.feat_dim, dtype=self.model.dtype, device=dev)
        n_commit = torch.zeros(B, dtype=torch.long, device=dev)
        live = [r for r in range(B) if len(out[r]) < per[r]]
        while live:
            idx = torch.tensor(live, device=dev)
            slots = idx
            last_t = torch.tensor([last[r] for r in live], device=dev)
            # Host logic reads each step's tokens with one device-to-host copy: a per-element
            # int(tensor) is a synchronising copy each, ~K x batch of them per step.
            if not speculative:
                pos = torch.tensor([[length[r]] for r in live], device=dev)
                logits, _ = self._target(last_t[:, None], pos, slots)
                nxt = logits[:, 0].argmax(-1).tolist()
                for i, r in enumerate(live):
                    length[r] += 1
                    last[r] = nxt[i]
                    out[r].append(last[r])
            else:
                len_t = torch.tensor([length[r] for r in live], device=dev)
                drafts = self._propose(last_t, len_t, slots, feats[idx], n_commit[idx], live, last, length)
                block = torch.cat([last_t[:, None], drafts], 1)  # [b, K+1]
                pos = len_t[:, None] + torch.arange(K + 1, device=dev)
                logits, fv = self._target(block, pos, slots)
                # [b, 2K + 2] on the host in one copy: the drafts, the greedy tokens, the accepted count
                greedy = logits.argmax(-1)
                js = self._accepted(drafts, greedy)  # [b] on the device
                both = torch.cat([drafts, greedy, js[:, None]], 1).tolist()
                self.stats.verify_steps += 1
                accepted = [self._accept(both[i], out[r], both[i][-1]) for i, r in enumerate(live)]
                for i, r in enumerate(live):
                    length[r] += 1 + accepted[i]
                    last[r] = out[r][-1]
                feats[idx] = fv.to(feats.dtype)
                n_commit[idx] = torch.tensor(accepted, device=dev) + 1
            live = [r for r in live if len(out[r]) < per[r]]
        return out

    def _accept(self, both: list[int], out_r: list[int], j: int | None = None) -> int:
        """Acceptance of one request's verify step (``both`` = its K drafts, then the target's
        K + 1 greedy tokens): appends the accepted drafts and the bonus token to ``out_r``,
        returns the number of accepted drafts -- the drafts' greedy agreement, or ``j`` when
        given (the device's choice: synthetic acceptance, the pipelined loop)."""
        K = self.config.block_size
        d, g = both[:K], both[K:2 * K + 1]
        if j is None:
            j = 0
            while j < K and d[j] == g[j]:
                j += 1
        out_r.extend(d[:j] + [g[j]])
        self.stats.acceptance_lengths.append(j + 1)
        return j

    def _decode_pipelined(self, input_ids, per, first):
        """Speculative decoding with the next verify step enqueued before this one's tokens
        are read back. Everything a step needs from the previous one (last token, length,
        the verify's features and accepted count: greedy acceptance on the device) stays on the device; the host reads
        a step's drafts and greedy tokens once, a step late, for the output lists. A request
        that finished in step s still runs step s + 1 (enqueued before s was read): its
        positions are clamped into its own state slot and its tokens dropped."""
        B, dev = len(input_ids), self.config.device
        out = self._outputs = [[t] for t in first]  # the lists a failed generate reports
        live = [r for r in range(B) if len(out[r]) < per[r]]
        if not live:
            return out
        K = self.config.block_size
        state = (live, _to_device(live, dev), _to_device([first[r] for r in live], dev),
                 _to_device([len(input_ids[r]) for r in live], dev),
                 torch.zeros(len(live), K + 1, self.feat_dim, dtype=self.model.dtype, device=dev),
                 torch.zeros(len(live), dtype=torch.long, device=dev))
        pending = self._enqueue_verify(state)
        while pending is not None:
            # requests that may outlive `pending` (known: the outputs before it; it adds >= 1 token each)
            keep = [i for i, r in enumerate(pending.live) if per[r] - len(out[r]) > 1]
            nxt = None
            if keep and self._captured(len(keep)):
                nxt = self._enqueue_verify(_select(pending.next_state, keep, dev))
            both = pending.tokens()  # the one device-to-host sync of the step
            self.stats.verify_steps += 1
            for i, r in enumerate(pending.live):
                if len(out[r]) < per[r]:  # else it finished in an earlier step: drop these tokens
                    self._accept(both[i], out[r], both[i][-1])
            if keep and nxt is None:
                # a batch size with no captured graph yet: capture with nothing in flight, for
                # exactly the requests still live
                keep = [i for i, r in enumerate(pending.live) if len(out[r]) < per[r]]
                nxt = self._enqueue_verify(_select(pending.next_state, keep, dev)) if keep else None
            pending = nxt
        return out

    def _captured(self, b: int) -> bool:
        return self.verify_graphs.captured(b) and self.draft_graphs.captured(b)

    def _enqueue_verify(self, state):
        """Enqueues one draft + verify step for ``state`` = (live request ids, slots, last
        tokens, lengths, the last verify's features, its accepted positions); returns a
        :class:`_Step`."""
        live, slots, last_t, len_t, feats, n_commit = state
        K, b, dev = self.config.block_size, len(live), self.config.device
        drafts = self.draft_graphs.run(last_t[:, None], len_t[:, None], slots, feats, n_commit)[0]
        block = torch.cat([last_t[:, None], drafts], 1)  # [b, K+1]
        pos = (len_t[:, None] + torch.arange(K + 1, device=dev)).clamp_max(self.config.max_seq_len - 1)
        logits, fv = self._target(block, pos, slots)
        greedy = logits.argmax(-1)  # [b, K+1]
        j = self._accepted(drafts, greedy)  # accepted drafts per request
        rows = torch.arange(b, device=dev)
        next_state = (live, slots, greedy[rows, j], len_t + 1 + j, fv, j + 1)
        return _Step(live, next_state, torch.cat([drafts, greedy, j[:, None]], 1))

    def set_acceptance_length(self, length: float | None) -> None:
        """Synthetic acceptance with mean ``length`` (in ``[1, block_size + 1]``) from the next
        generate on, or the draft's real acceptance (None). Host-side: captured graphs stay
        valid (a benchmark sweeps it on one engine)."""
        K = self.config.block_size
        if length is not None and (isinstance(length, bool) or not isinstance(length, (int, float))
                                   or not 1 <= length <= K + 1):
            raise ValueError(f"acceptance_length must be in [1, block_size + 1 = {K + 1}], got {length!r}")
        self._accept_p = None if length is None else acceptance_probability(length, K)

    def _accepted(self, drafts: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
        """Accepted drafts per request ``[b]`` on the device: the leading run of drafts equal to
        the target's greedy tokens -- or, with ``acceptance_length``, a leading run of
        Bernoulli(p) successes from the engine's seeded device generator."""
        K = drafts.shape[1]
        if self._accept_p is None:
            ok = drafts == greedy[:, :K]
        else:
            if getattr(self, "_accept_gen", None) is None:
                self._accept_gen = torch.Generator(device=drafts.device).manual_seed(self.config.seed)
            ok = torch.rand(drafts.shape, generator=self._accept_gen, device=drafts.device) < self._accept_p
        return ok.long().cumprod(1).sum(1)

    def _oracle(self, live, last, length, K):
        """Target's own greedy continuation (test-only draft); does not disturb the state the
        verify pass relies on: it writes positions the verify pass then overwrites."""
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


def acceptance_probability(length: float, block: int) -> float:
    """The per-position acceptance probability ``p`` whose leading-run acceptance has mean
    length ``length``: ``sum_{i=0..block} p^i = length`` (bisection; 1 -> 0, block + 1 -> 1)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid ** i for i in range(block + 1)) < length:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _init_process_group(config: EngineConfig):
    """-> (rank, config on this rank's device, whether this call initialised the group). Uses
    the process group set up by the caller, or initialises one from torchrun's environment
    (gloo on CPUs, NCCL on GPUs, with NVLink multicast off). The world must be ``config.tp``
    ranks."""
    import torch.distributed as dist

    cuda = torch.device(config.device).type == "cuda"
    created = not dist.is_initialized()
    if created:
        if "RANK" not in os.environ:
            raise ValueError(f"tp={config.tp}: start one process per rank with torchrun (python -m "
                             f"torch.distributed.run --standalone --nproc-per-node {config.tp} ...) or "
                             f"initialise torch.distributed before building the engine")
        if cuda:
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast
        dist.init_process_group("nccl" if cuda else "gloo",
                                timeout=datetime.timedelta(seconds=config.dist_timeout_s))
    if dist.get_world_size() != config.tp:
        raise ValueError(f"tp={config.tp} but the process group has {dist.get_world_size()} ranks")
    rank = dist.get_rank()
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        config = dataclasses.replace(config, device=f"cuda:{local}")
    return rank, config, created


def _to_device(values: list[int], dev) -> torch.Tensor:
    """int64 ``values`` on ``dev`` without a stream sync (pinned staging for CUDA: a pageable
    host-to-device copy waits for the stream to drain)."""
    t = torch.tensor(values, dtype=torch.long)
    if torch.device(dev).type != "cuda":
        return t.to(dev)
    return t.pin_memory().to(dev, non_blocking=True)


def _select(state, keep: list[int], dev):
    """The rows ``keep`` of a step state (all rows: the state itself)."""
    live = state[0]
    if len(keep) == len(live):
        return state
    idx = _to_device(keep, dev)
    return ([live[i] for i in keep],) + tuple(t[idx] for t in state[1:])


class _Step:
    """An enqueued verify step: its requests, the device state the next step starts from, and
    its [b, 2K + 2] drafts, greedy tokens and accepted count on their way to the host."""

    def __init__(self, live, next_state, tokens: torch.Tensor):
        self.live, self.next_state = live, next_state
        if tokens.is_cuda:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()
        else:
            self._host, self._done = tokens, None

    def tokens(self) -> list[list[int]]:
        if self._done is not None:
            self._done.synchronize()
        return self._host.tolist()
