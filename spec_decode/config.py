"""Model and engine configuration for the decode runtime (DeepSeek-V4's layer structure).

A :class:`ModelConfig` names the per-layer shapes and the layer schedule of a DeepSeek-V4 model
(huggingface/transformers ``models/deepseek_v4/configuration_deepseek_v4.py``; the checkpoints'
``config.json``): ``compress_ratios`` per layer (0: sliding window only, ``csa_ratio``: CSA --
window + the indexer's top-k of overlapping compressed windows, ``hca_ratio``: HCA -- window +
every compressed entry), the first ``n_hash_layers`` MoE layers hash-routed (``tid2eid``), the
rest sqrt-softplus top-k. Presets: :data:`V4_FLASH_SLICE` / :data:`V4_PRO_SLICE` (the real
per-layer shapes, a few layers holding every layer kind), :data:`TINY` and :data:`SMALL` (the
same structure at CPU-test and fused-kernel-test sizes).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab: int = 128
    hidden: int = 64  # C
    #: per layer: 0 (window only), csa_ratio (CSA) or hca_ratio (HCA)
    compress_ratios: tuple[int, ...] = (0, 4, 128, 4)
    n_hash_layers: int = 2  # the first MoE layers route by tid2eid[token]
    mhc_n: int = 4  # residual streams (hc_mult)
    mhc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    heads: int = 4
    head_dim: int = 32  # the one KV head's width, and every query head's
    rope_dim: int = 8  # the LAST rope_dim dims of a head are rotated (interleaved pairs)
    q_lora: int = 32
    wo_groups: int = 2  # G
    wo_rank: int = 16  # R
    window: int = 128  # raw keys per query: positions (p - window, p]
    csa_ratio: int = 4  # m: CSA windows (overlapping, width 2m, stride m)
    hca_ratio: int = 128  # m': HCA windows (non-overlapping)
    indexer_heads: int = 2  # H_I
    indexer_dim: int = 16  # D_I (its last rope_dim dims rotated)
    index_topk: int = 8  # compressed entries a CSA query attends
    experts: int = 16
    top_k: int = 6
    routed_scaling_factor: float = 1.5
    expert_inter: int = 32  # I (routed)
    shared_inter: int = 32  # the one shared expert's width
    swiglu_limit: float = 10.0  # routed experts: gate <= limit, |up| <= limit
    eps: float = 1e-6
    rope_theta: float = 10000.0  # window-only layers (no YaRN)
    compress_rope_theta: float = 160000.0  # compressed layers (q, keys, entries, indexer), with YaRN
    yarn_factor: float = 16.0
    yarn_original_len: int = 65536
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    #: DSpark-style draft: stages (V4 layers, window-only attention) and the target layers
    #: whose hidden states (stream means) feed stage 0 through one projection
    draft_stages: int = 3
    draft_feature_layers: tuple[int, ...] = (1, 2, 3)

    @property
    def layers(self) -> int:
        return len(self.compress_ratios)

    def ratio(self, li: int) -> int:
        return self.compress_ratios[li]

    def is_hash(self, li: int) -> bool:
        return li < self.n_hash_layers

    def validate(self) -> None:
        if not self.compress_ratios:
            raise ValueError("compress_ratios must name at least one layer")
        bad = [r for r in self.compress_ratios if r not in (0, self.csa_ratio, self.hca_ratio)]
        if bad:
            raise ValueError(f"compress_ratios entries must be 0, csa_ratio={self.csa_ratio} or "
                             f"hca_ratio={self.hca_ratio}, got {bad}")
        if self.csa_ratio < 1 or self.hca_ratio < 1 or self.csa_ratio == self.hca_ratio:
            raise ValueError("csa_ratio and hca_ratio must be distinct positive ints")
        if self.heads % self.wo_groups:
            raise ValueError(f"heads={self.heads} must be divisible by wo_groups={self.wo_groups}")
        if self.rope_dim % 2 or self.rope_dim > self.head_dim or self.rope_dim > self.indexer_dim:
            raise ValueError(f"rope_dim={self.rope_dim} must be even and <= head_dim and indexer_dim")
        if not 1 <= self.top_k <= min(self.experts, 8):
            raise ValueError(f"top_k={self.top_k} must be in [1, min(experts, 8)]")
        if not 0 <= self.n_hash_layers <= self.layers:
            raise ValueError(f"n_hash_layers={self.n_hash_layers} must be in [0, layers={self.layers}]")
        if self.window < 1 or self.index_topk < 1:
            raise ValueError("window and index_topk must be positive")
        if len(self.draft_feature_layers) != 3 or any(not 0 <= i < self.layers for i in self.draft_feature_layers):
            raise ValueError(f"draft_feature_layers must name 3 target layers in [0, {self.layers}), got "
                             f"{self.draft_feature_layers}")
        if self.draft_stages < 1:
            raise ValueError("draft_stages must be >= 1")


#: every layer kind (window-only, CSA, HCA; two hash-routed MoE layers) at CPU-test sizes
TINY = ModelConfig()
#: the smallest sizes every fused kernel accepts (hidden % 128; 64 indexer heads of 128; WO-A
#: groups of 4096 (V4's) with R = 1024; expert dims % 128), also split 4 ways (4 WO-A groups, a
#: shared expert of 4 x 128): the fused backend's test size, TP1 to TP4
SMALL = ModelConfig(vocab=512, hidden=1024, heads=32, head_dim=512, rope_dim=64, q_lora=256, wo_groups=4,
                    wo_rank=1024, indexer_heads=64, indexer_dim=128, index_topk=64, experts=32, top_k=6,
                    expert_inter=256, shared_inter=512)
#: DeepSeek-V4-Flash's per-layer shapes (config.json of deepseek-ai/DeepSeek-V4-Flash) with four
#: layers holding every kind -- the checkpoint's layers 1-4: window-only and CSA (both
#: hash-routed), HCA, CSA (``load_weights(..., layer_map={i: i + 1 for i in range(4)})``)
V4_FLASH_SLICE = ModelConfig(vocab=129280, hidden=4096, compress_ratios=(0, 4, 128, 4), n_hash_layers=2,
                             heads=64, head_dim=512, rope_dim=64, q_lora=1024, wo_groups=8, wo_rank=1024,
                             indexer_heads=64, indexer_dim=128, index_topk=512, experts=256, top_k=6,
                             routed_scaling_factor=1.5, expert_inter=2048, shared_inter=2048)
#: DeepSeek-V4-Pro's per-layer shapes, the same four layer kinds (its bf16 routed experts, 51 GB a
#: layer, do not fit the H200 four times over: for a larger GPU or several)
V4_PRO_SLICE = ModelConfig(vocab=129280, hidden=7168, compress_ratios=(0, 4, 128, 4), n_hash_layers=2,
                           heads=128, head_dim=512, rope_dim=64, q_lora=1536, wo_groups=16, wo_rank=1024,
                           indexer_heads=64, indexer_dim=128, index_topk=1024, experts=384, top_k=6,
                           routed_scaling_factor=2.5, expert_inter=3072, shared_inter=3072)

PRESETS = {"tiny": TINY, "small": SMALL, "v4_flash_slice": V4_FLASH_SLICE, "v4_pro_slice": V4_PRO_SLICE}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = TINY
    block_size: int = 5  # draft tokens per verify
    graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    max_seq_len: int = 1024  # positions per request (bounds the compressed pools)
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    #: "reference" (TargetModel's per-token loops over the full history, the spec),
    #: "torch-bf16" (the sync-free step model over fixed-size state, PyTorch ops, captured CUDA
    #: graphs), "fused" (this project's kernels in the step graphs)
    backend: str = "reference"
    #: safetensors file with the model's weights in DeepSeek-V4's checkpoint names
    #: (spec_decode.weights); None = seeded random
    weights: str | None = None
    #: prompt positions per (eager) prefill forward
    prefill_chunk: int = 384
    #: fused backend, steps of 17-384 tokens: run the MoE decode kernel in passes of this many
    #: token columns (16 / 32 / 64; moe.experts.expert_kernel_args). None: one pass up to 64
    #: tokens, the tiled kernel above.
    moe_row_tile: int | None = 16
    #: fused backend: score this many consecutive tokens of a request per CTA in the indexer
    #: (indexer_topk's token_group; 1 = one token per CTA)
    indexer_token_group: int = 3
    #: fused backend: launch WO-A as a programmatic dependent of the attention kernel before it
    #: in steps of <= 16 tokens (its decode kernels' ``pdl``: the first weight stages stream
    #: while the attention finishes, before the kernel waits for its output). Off: no measurable
    #: change in the step graphs (``python -m spec_decode.bench --wo-a-pdl``; docs/runtime.md)
    wo_a_pdl: bool = False
    #: fused backend: launch the MoE router as a programmatic dependent of the gate product
    #: before it (``MoeRouter(pdl=True)``: its set-up overlaps the product's tail; it waits for
    #: the product's grid to complete before it reads the logits). Off: no measurable change in
    #: the step graphs (``python -m spec_decode.bench --router-pdl``; docs/runtime.md)
    router_pdl: bool = False
    #: benchmarks: accept a number of drafts drawn on the device with this mean acceptance
    #: length (accepted drafts + 1, in [1, block_size + 1]) instead of the drafts' agreement
    #: with the target's greedy tokens -- every draft position accepted with one probability p
    #: (the leading run), p solved from the mean, seeded. The verify, bonus token, state
    #: advance and finish logic run as with real acceptance; the tokens are then not the
    #: greedy continuation. None: real acceptance.
    acceptance_length: float | None = None
    #: tensor parallelism (experts: ep = tp): one process per rank, started by torchrun (or a
    #: process group initialised before the engine); heads / WO-A groups, routed experts and
    #: the shared expert's width split over the ranks, partial sums all-reduced
    tp: int = 1
    #: force the all-reduce backend ("custom_push" or "nccl"; tests, benchmarks); None: the
    #: automatic choice (comm.backend.select_allreduce_backend: custom push on one node of
    #: P2P-capable sm_90a / sm_100a GPUs for decode-sized messages, else torch.distributed)
    allreduce: str | None = None
    #: tp > 1 in one process: every rank's slices on one device (each rank on its own stream on
    #: a GPU, with the simulated push all-reduce group; one thread each on a CPU) -- the whole
    #: TP step captured in one graph, for tests and benchmarks without several GPUs
    simulate_ranks: bool = False
    #: seconds a rank waits for its peers (process-group set-up and every collective) before
    #: it raises instead of hanging
    dist_timeout_s: float = 60.0
    #: fused backend, the draft's LM head (spec_decode.fused_ops.MxDraftHead; heads of 64 MiB
    #: or more): "mxfp8+fp8", "mxfp8" or "bf16". The draft only proposes, so this can move the
    #: acceptance length, never the output tokens.
    draft_head: str = "mxfp8+fp8"

    @property
    def max_batch(self) -> int:
        return max(self.graph_batch_sizes)

    def padded_batch(self, b: int) -> int:
        """Smallest captured batch size >= b."""
        for s in sorted(self.graph_batch_sizes):
            if s >= b:
                return s
        raise ValueError(f"batch of {b} requests exceeds the largest captured batch size {self.max_batch}")
