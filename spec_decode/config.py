"""Model and engine configuration for the decode runtime."""

from __future__ import annotations

import dataclasses


KV_CACHES = ("per_head", "latent")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab: int = 128
    hidden: int = 64  # C
    layers: int = 2
    mhc_n: int = 4  # residual streams
    mhc_sinkhorn_iters: int = 20
    heads: int = 4
    head_dim: int = 16  # qk and v head dim
    rope_dim: int = 8  # leading dims of each head rotated by RoPE
    q_lora: int = 32
    kv_lora: int = 32
    wo_groups: int = 2  # G
    wo_rank: int = 32  # R
    indexer_heads: int = 2  # H_I
    indexer_dim: int = 16  # D_I
    index_topk: int = 64  # keys selected per query by the indexer
    experts: int = 16
    n_group: int = 4
    topk_group: int = 2
    top_k: int = 4
    routed_scaling_factor: float = 2.5
    expert_inter: int = 32  # I
    shared_inter: int = 32
    eps: float = 1e-6
    #: "per_head": cache every head's RoPE'd K and V (2 * heads * head_dim values a position);
    #: "latent": MLA-style -- cache the normed KV latent and one RoPE key shared by the heads
    #: (kv_lora + rope_dim values a position: 57x fewer at the slice config). K_h =
    #: [k_rope ; lat @ k_b_h^T] (k_b then spans head_dim - rope_dim per head), V_h = lat @ v_b_h^T.
    kv_cache: str = "per_head"

    def validate(self) -> None:
        if self.heads % self.wo_groups:
            raise ValueError(f"heads={self.heads} must be divisible by wo_groups={self.wo_groups}")
        if self.rope_dim % 2 or self.rope_dim > self.head_dim:
            raise ValueError(f"rope_dim={self.rope_dim} must be even and <= head_dim={self.head_dim}")
        if self.experts % self.n_group or self.topk_group > self.n_group:
            raise ValueError("experts must be divisible by n_group and topk_group <= n_group")
        if self.top_k > self.topk_group * (self.experts // self.n_group):
            raise ValueError("top_k exceeds the experts of the kept groups")
        if self.kv_cache not in KV_CACHES:
            raise ValueError(f"kv_cache must be one of {KV_CACHES}, got {self.kv_cache!r}")
        if self.kv_cache == "latent" and self.rope_dim >= self.head_dim:
            raise ValueError(f"kv_cache='latent' needs rope_dim={self.rope_dim} < head_dim={self.head_dim}")


TINY = ModelConfig()
#: the smallest config every fused kernel accepts (hidden % 128, 64 indexer heads of 128,
#: WO-A R % 64 and group width % 128, expert dims % 128): the fused backend's test size
SMALL = ModelConfig(vocab=512, hidden=1024, layers=2, heads=16, head_dim=128, rope_dim=64, q_lora=256, kv_lora=256,
                    wo_groups=2, wo_rank=512, indexer_heads=64, indexer_dim=128, index_topk=64, experts=32,
                    n_group=4, topk_group=2, top_k=4, expert_inter=256, shared_inter=256)
#: real per-layer sizes of a DeepSeek-V4-class model with few layers (for the H200), caching
#: the KV latent as DeepSeek's MLA does (at the benchmark's BS64 lengths 1 GB of KV pool instead
#: of 53 GB per-head)
SLICE = ModelConfig(vocab=129280, hidden=7168, layers=2, heads=128, head_dim=128, rope_dim=64, q_lora=1536,
                    kv_lora=512, wo_groups=16, wo_rank=1024, indexer_heads=64, indexer_dim=128, index_topk=2048,
                    experts=256, n_group=8, topk_group=4, top_k=8, expert_inter=2048, shared_inter=2048,
                    kv_cache="latent")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = TINY
    block_size: int = 5  # draft tokens per verify
    graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    max_seq_len: int = 512  # KV slots per request in the preallocated pool
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    #: "reference" (TargetModel's per-token loops, the spec), "baseline" (sync-free PyTorch
    #: composites in captured CUDA graphs), "fused" (this project's kernels in the step graphs)
    backend: str = "reference"
    #: safetensors file with the model's weights (name map: spec_decode.weights); None = seeded random
    weights: str | None = None
    #: prompt positions per (eager) prefill forward: bounds the indexer's temporaries; 384 keeps
    #: the fused MoE on its decode kernel's row passes (moe.experts.ROW_PASS_MAX_TOKENS; H200,
    #: slice quick bench, chunks of 512: the tiled kernel made the fused prefill slower)
    prefill_chunk: int = 384
    #: fused backend, steps of 17-384 tokens: run the MoE decode kernel in passes of this many
    #: token columns (16 / 32 / 64; moe.experts.expert_kernel_args). None: one pass up to 64
    #: tokens, the tiled kernel above. H200: passes of 16 halve the expert GEMMs at T = 64.
    moe_row_tile: int | None = 16
    #: fused backend: score this many consecutive tokens of a request per CTA in the indexer
    #: (indexer_topk's token_group: one key tile per group; 1 = one token per CTA). H200,
    #: bench_indexer: groups of 3 were 1.43x the one-token wgmma kernel at T = 384 (6-token
    #: verify blocks), 1.07x at T = 6.
    indexer_token_group: int = 3
    #: baseline and fused backends: the attention core (spec_decode.step_model): "auto" (per
    #: step shape, the core moving fewer K/V rows: StepModel.pick_attention_core),
    #: "masked_dense" (SDPA over each request's KV row with a mask of the selected keys) or
    #: "gather" (the selected keys per token)
    attention_core: str = "auto"
    #: fused backend, the draft's LM head (spec_decode.fused_ops.MxDraftHead; heads of 64 MiB
    #: or more, smaller ones stay bf16): "mxfp8+fp8" -- an MXFP8 copy for batches up to 16 and
    #: above 16 rows a per-tensor-scaled e4m3 copy whose scores keep each row's argmax
    #: (cute_kernels.draft_head_fp8; H200 at the slice head: 292-297 us at 32-64 rows against
    #: bf16's 477-506); "mxfp8" -- the MXFP8 copy up to 16 rows, bf16 above; "bf16" -- the bf16
    #: head throughout. The draft only proposes, so this can move the acceptance length, never
    #: the output tokens.
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
