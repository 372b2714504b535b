"""The ``fused`` op families: this project's kernels behind :class:`spec_decode.step_model.Ops`.

Per op family (activations bf16 on the GPU; weights prepared once here):

* mHC: :func:`mhc_stats` (inline: see ``mhc_mappings``), :func:`mhc_pre_mix`,
  :func:`mhc_post_mix` (bit-exact rounding sequences);
* indexer: :func:`indexer_topk` over the layer's KV pool rows (scores + fused causal mask +
  radix top-k, ties to the lower index -- the reference's rule);
* WO-A: :func:`wo_a` writing token-major;
* MoE: :class:`MoeRouter` (one launch), :func:`mxfp8_quantize_routed`, the expert GEMMs
  (gate/up with SiLU * up + MXFP8 requantisation fused on Hopper) and :func:`moe_finalize`
  fused with the shared-expert add;
* attention core (latent KV pool, masked-dense): :func:`masked_softmax`, the selection mask and
  softmax over the scores in one in-place pass (the matmuls around it stay cuBLAS).

Draft: :class:`MxDraftHead`, the draft's LM head on an MXFP8 copy (the engine sets it for
batches up to 16 and heads of 64 MiB or more; by default per-tensor e4m3 scores above 16 rows).

Status: GPU-tested on the H200 (``tests/test_spec_decode.py -m gpu``: each path against an
FP32 run of the same weights, the draft head against its dequantised operands, the engine in
captured graphs); timings in ``bench/RESULTS.md`` (``python -m spec_decode.bench``).
"""

from __future__ import annotations

import warnings

import torch

from cute_kernels.draft_head_fp8 import draft_head_scores, quantize_head
from cute_kernels.indexer_topk import IndexerWorkspace, indexer_topk
from cute_kernels.masked_softmax import MaskedSoftmax, masked_softmax
from cute_kernels.mhc_post_mix import mhc_post_mix
from cute_kernels.mhc_pre_mix import mhc_pre_mix
from cute_kernels.mhc_stats import MhcStatsWorkspace, mhc_split_phi, mhc_stats
from cute_kernels.wo_a import wo_a
from moe.experts import (expert_kernel_args, interleave_gate_up, moe_expert_gate_up, moe_expert_gemm,
                         quantize_expert_weights)
from moe.finalize import moe_finalize
from moe.quant import mxfp8_quantize, mxfp8_quantize_routed, scale_buffer_size
from moe.router import MoeRouter, RouterConfig

from .model import shared_expert
from .step_model import Ops, StepModel, family


class FusedOps(Ops):
    """Kernels for a bf16 :class:`TargetModel` on a CUDA device (every activation is bf16)."""

    def __init__(self, target, max_tokens: int, max_len: int, moe_row_tile: int | None = 16,
                 indexer_token_group: int = 3, release_bf16_experts: bool = False, _cpu_for_tests: bool = False):
        """``release_bf16_experts``: delete each layer's bf16 routed-expert weights (``gate``,
        ``up``, ``down``) from ``target`` once their MXFP8 copies exist -- the fused MoE never
        reads them (45 GB at the slice config). For an engine that owns its model; leave it
        off where the same model also runs the baseline ops."""
        cfg = target.cfg
        on_cuda = torch.device(target.device).type == "cuda"
        if target.dtype != torch.bfloat16 or not (on_cuda or _cpu_for_tests):
            raise ValueError("FusedOps needs a bfloat16 TargetModel on a CUDA device")
        if moe_row_tile not in (None, 16, 32, 64):
            raise ValueError(f"moe_row_tile must be None, 16, 32 or 64, got {moe_row_tile!r}")
        if indexer_token_group not in (1, 2, 3, 4):
            raise ValueError(f"indexer_token_group must be 1, 2, 3 or 4, got {indexer_token_group!r}")
        dev = target.device
        if cfg.kv_cache == "latent" and not MaskedSoftmax.can_implement(max_len, cfg.heads,
                                                                        StepModel.mask_width(max_len)):
            warnings.warn(f"FusedOps: a KV pool of max_len={max_len} positions (not a multiple of 8 in [8, "
                          f"65536]) runs the latent attention core's softmax as the torch composite; "
                          f"round max_seq_len up to a multiple of 16 for the masked_softmax kernel", stacklevel=2)
        self.cfg, self.max_tokens, self.max_len = cfg, max_tokens, max_len
        self.moe_row_tile, self.indexer_token_group = moe_row_tile, indexer_token_group
        n = cfg.mhc_n
        self.mhc_ws = MhcStatsWorkspace(n, max_tokens, device=dev)
        self.idx_ws = IndexerWorkspace(max_tokens, max_len, device=dev)
        self.router = MoeRouter(RouterConfig(num_experts=cfg.experts, n_group=cfg.n_group,
                                             topk_group=cfg.topk_group, top_k=cfg.top_k,
                                             routed_scaling_factor=cfg.routed_scaling_factor), max_tokens=max_tokens,
                                device=dev)
        # The shared expert needs only h: it runs on this side stream, forked and joined with
        # events (captured into the step graphs as parallel branches), beside the routed path.
        self.side = torch.cuda.Stream(device=dev) if on_cuda else None
        self._layer = {}  # id(layer dict) -> its prepared kernel weights
        for L in target.layers:
            P = {}
            for sub in ("attn", "moe"):
                P[f"{sub}_planes"] = mhc_split_phi(L[f"{sub}_phi"].float().contiguous())
                P[f"{sub}_alpha"] = L[f"{sub}_a"].float().contiguous()
                P[f"{sub}_bias"] = torch.cat([L[f"{sub}_b_pre"], L[f"{sub}_b_post"],
                                              L[f"{sub}_b_res"].flatten()]).float().contiguous()
            P["router_bias"] = L["router_bias"].float().contiguous()
            P["gu_q"], P["gu_s"] = quantize_expert_weights(interleave_gate_up(L["gate"], L["up"]).contiguous())
            P["d_q"], P["d_s"] = quantize_expert_weights(L["down"].contiguous())
            if release_bf16_experts:  # per layer: the peak holds one layer's two copies, not all
                for name in ("gate", "up", "down"):
                    del L[name]
            self._layer[id(L)] = P

    # ------------------------------------------------------------------ mHC --------------
    def mhc_mappings(self, X, L, sub, cfg):
        """-> the packed fp32 [T, 2n + n*n] mappings the mix kernels read."""
        P, n = self._layer[id(L)], cfg.mhc_n
        B, S = X.shape[:2]
        x = X.reshape(B * S, n, cfg.hidden).contiguous()
        H = torch.empty(B * S, 2 * n + n * n, device=X.device)
        # In this layer order nothing independent of X is in flight here (X is the previous
        # sublayer's output), so the statistics run inline; bench/bench_mhc.py measures the
        # side-stream overlap where independent work exists.
        mhc_stats(x, P[f"{sub}_planes"], P[f"{sub}_alpha"], P[f"{sub}_bias"], eps=cfg.eps,
                  sinkhorn_iters=cfg.mhc_sinkhorn_iters, workspace=self.mhc_ws, out=H)
        return H

    def pre_mix(self, X, maps):
        B, S, n, C = X.shape
        return mhc_pre_mix(X.reshape(B * S, n, C).contiguous(), maps).view(B, S, C)

    def post_mix(self, X, maps, f):
        B, S, n, C = X.shape
        x = X.reshape(B * S, n, C).contiguous()
        return mhc_post_mix(x, maps, f.reshape(B * S, C).to(torch.bfloat16).contiguous()).view(B, S, n, C)

    # -------------------------------------------------------------- indexer --------------
    def indexer_topk(self, q_idx, w_idx, k_idx_layer, slots, pos, topk):
        B, S, Hi, D = q_idx.shape
        rows = k_idx_layer.reshape(-1, D)  # the pool's rows: token t's keys start at slot * max_len
        off = (slots[:, None].expand(B, S) * self.max_len).reshape(-1).int().contiguous()
        p = pos.reshape(-1).int().contiguous()
        # a token has at most max_len candidates: columns past that are always -1, and the
        # attention would gather (and mask) their keys and values -- at the slice config with
        # top-2048 over 592 positions, 3.5x the attention's gathers. Same width as the
        # baseline's min(topk, L).
        k = min(topk, self.max_len)
        # token t = b * S + s: a request's tokens are consecutive, so a group within one
        # request shares its key tiles (groups no larger than a request's S tokens: a group
        # spanning requests scores them in per-token passes, no saving)
        g = min(self.indexer_token_group, S)
        group = dict(token_group=g) if g > 1 else {}
        idx = indexer_topk(q_idx.reshape(B * S, Hi, D).contiguous(), w_idx.reshape(B * S, Hi).float().contiguous(),
                           rows, off, p + 1, p, topk=k, max_keys=self.max_len, workspace=self.idx_ws, **group)
        idx = idx.view(B, S, k).long()
        return idx.clamp_min(0), idx >= 0

    # ------------------------------------------------------------------ WO-A -------------
    def wo_a(self, o, w):
        # no pdl: the kernel before is cuBLAS's (the attention core), which never triggers its
        # dependents early -- there PDL measured slower on the H200
        B, S, H, hd = o.shape
        return wo_a(o.reshape(B * S, H, hd).contiguous(), w).view(B, S, -1)

    # ------------------------------------------------------------------ MoE --------------
    def moe(self, h, L, cfg):
        P = self._layer[id(L)]
        x = h.contiguous()
        main = torch.cuda.current_stream() if self.side is not None else None
        if main is not None:
            self.side.wait_stream(main)  # fork: x is ready
            with torch.cuda.stream(self.side):
                sh = shared_expert(x, L).contiguous()
        logits = (x @ L["router"].T).float().contiguous()
        with family("router top-k / padding"):  # one kernel: top-k, padding and ID packing
            r = self.router(logits, P["router_bias"])
        # padding rows left unwritten: at T = 6 they are most of the ~5000 rows (~25 us of each
        # layer's quantisation on the H200); a padding row's GEMM output is never read back
        aq, asc = mxfp8_quantize_routed(x, r.sorted_token_ids, r.total_rows, cfg.top_k, zero_padding=False)
        n = x.shape[0] * cfg.top_k  # routed rows: bounds the expert grids to the live tiles
        # a token routes to an expert at most once: T bounds every expert's rows, which picks
        # the Hopper decode kernel (weights as wgmma's M), in passes of moe_row_tile columns
        # above 16 tokens (moe.experts.expert_kernel_args: the measured choice)
        rows = expert_kernel_args(x.shape[0], self.moe_row_tile)
        hq, hs = moe_expert_gate_up(aq, asc, P["gu_q"], P["gu_s"], r.expert_offsets, r.expert_counts, r.tile_expert,
                                    routed_rows=n, **rows)
        y = moe_expert_gemm(hq, hs, P["d_q"], P["d_s"], r.expert_offsets, r.expert_counts, r.tile_expert,
                            routed_rows=n, **rows)
        if main is not None:
            main.wait_stream(self.side)  # join before the add reads sh (every later side-stream
            # op waits on main first, so sh's memory is not reused while main reads it)
        else:
            sh = shared_expert(x, L).contiguous()
        with family("fused finalize (+ shared add)"):
            return moe_finalize(y, r.topk_weights, r.routed_row_pos, sh)

    @staticmethod
    def attention_probs(att, mask):
        """The latent masked-dense core's softmax in one kernel, in place (the composite makes
        three passes over 0.6 GB of scores a layer at the slice config's BS64 verify step)."""
        H, M = att.shape[-2:]
        if (att.is_cuda and att.dtype == torch.bfloat16 and att.is_contiguous() and mask.is_contiguous()
                and MaskedSoftmax.can_implement(M, H, mask.shape[-1])):
            return masked_softmax(att, mask, out=att)
        return Ops.attention_probs(att, mask)


class MxDraftHead:
    """The draft's LM head ``logits = h @ lm_head^T`` on this project's MXFP8 expert GEMM: the
    whole head is one "expert" (``[1, vocab, hidden]`` e4m3 + swizzled block scales, made
    once), the draft's ``B <= 16`` rows one router tile of 128 (rows past ``B`` stay whatever
    an earlier, larger batch left: computed, never read).

    Why: the three-stage draft reads the LM head once per proposed token, five times per step,
    and at the slice config (vocab 129280, hidden 7168: 1.85 GB bf16) those reads are most of
    the draft graph (H200: 2.6 ms at BS1, as long as the fused verify graph). MXFP8 halves the
    bytes. The draft only proposes -- the target verifies every token with its bf16 head -- so
    the rounding can change the acceptance length, never the output tokens.

    Per call (up to :attr:`MX_MAX_BATCH` rows): one copy into the padded input,
    :func:`mxfp8_quantize` (swizzled scales), the Hopper decode kernel (weights as wgmma's M)
    in one pass of 16 token columns; larger batches use the bf16 head. Graph capturable;
    allocates nothing per call.
    """

    TILE = 128  # one router tile: the expert GEMM's row granularity
    #: Largest batch the MXFP8 head serves; above it the bf16 head. H200, slice config, draft
    #: graph: BS1 1.82 ms against 2.68 (bf16); BS64 3.50 ms in one 64-column pass and 5.38 in
    #: passes of 16, against 3.04 -- at 64 live columns the per-block FP32 promotion, not the
    #: weight bytes, bounds the kernel. Up to 16 rows it runs the one 16-column pass of BS1.
    MX_MAX_BATCH = 16
    #: Smallest bf16 head worth an MXFP8 copy: below it the three launches per call (copy,
    #: quantise, GEMM) outweigh the halved bytes (H200, small config -- vocab 512, hidden 1024,
    #: a 1 MB head: draft graph 0.180 ms against 0.150 for the bf16 head at BS1).
    MIN_HEAD_BYTES = 64 << 20

    @classmethod
    def pays_off(cls, lm_head: torch.Tensor) -> bool:
        """Whether ``lm_head`` is large enough for the MXFP8 copy (:attr:`MIN_HEAD_BYTES`)."""
        return lm_head.numel() * lm_head.element_size() >= cls.MIN_HEAD_BYTES

    def __init__(self, lm_head: torch.Tensor, max_batch: int, fp8_above: bool = False):
        """``fp8_above``: above :attr:`MX_MAX_BATCH` rows, per-tensor e4m3 scores that keep each
        row's argmax (:func:`cute_kernels.draft_head_fp8.draft_head_scores`) instead of the
        bf16 head."""
        V, C = lm_head.shape
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"MxDraftHead: max_batch must be a positive int, got {max_batch!r}")
        dev = lm_head.device
        self.max_batch, self.lm_head = max_batch, lm_head
        self.fp8 = None
        if fp8_above and max_batch > self.MX_MAX_BATCH:
            w_q, _ = quantize_head(lm_head)  # its scale only multiplies every score: not kept
            self.fp8 = (w_q, torch.empty(max_batch, C, dtype=torch.float8_e4m3fn, device=dev),
                        torch.empty(max_batch, V, dtype=torch.bfloat16, device=dev))
        self.w_q, self.w_s = quantize_expert_weights(lm_head[None].contiguous())
        self.x = torch.zeros(self.TILE, C, dtype=torch.bfloat16, device=dev)
        self.q = torch.empty(self.TILE, C, dtype=torch.float8_e4m3fn, device=dev)
        self.s = torch.empty(scale_buffer_size(self.TILE, C, "swizzled"), dtype=torch.uint8, device=dev)
        self.offsets = torch.tensor([0, self.TILE], dtype=torch.int32, device=dev)
        self.tile_expert = torch.zeros(1, dtype=torch.int32, device=dev)
        # expert count B is the view _counts[B:B + 1]: a constant address per captured batch size
        self._counts = torch.arange(min(max_batch, 64) + 1, dtype=torch.int32, device=dev)
        self.out = torch.empty(self.TILE, V, dtype=torch.bfloat16, device=dev)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """h [B, hidden] bf16 -> logits [B, vocab] bf16 (a view of this head's buffer; above
        :attr:`MX_MAX_BATCH` rows, the bf16 head's product, or with ``fp8_above`` scores with
        the logits' per-row argmax)."""
        B = h.shape[0]
        if not 1 <= B <= self.max_batch:
            raise ValueError(f"MxDraftHead: batch {B} outside [1, {self.max_batch}]")
        if B > self.MX_MAX_BATCH:
            if self.fp8 is not None:
                w_q, h_q, out = self.fp8
                return draft_head_scores(h.contiguous(), w_q, h_q=h_q, out=out)
            return h @ self.lm_head.T
        return self.mx_logits(h)

    def mx_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The MXFP8 path at any batch up to ``min(max_batch, 64)`` (one decode-kernel pass of
        16, 32 or 64 columns; :meth:`__call__` takes it up to :attr:`MX_MAX_BATCH` rows)."""
        B = h.shape[0]
        if not 1 <= B < self._counts.numel():
            raise ValueError(f"MxDraftHead.mx_logits: batch {B} outside [1, {self._counts.numel() - 1}]")
        self.x[:B].copy_(h)
        mxfp8_quantize(self.x, layout="swizzled", q=self.q, scales=self.s)
        # one pass (passes re-stream the weights: see MX_MAX_BATCH)
        moe_expert_gemm(self.q, self.s, self.w_q, self.w_s, self.offsets, self._counts[B:B + 1], self.tile_expert,
                        out=self.out, routed_rows=B, max_expert_rows=B)
        return self.out[:B]
