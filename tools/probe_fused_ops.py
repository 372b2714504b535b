"""Device probe: which op family makes FusedOps drift from the baseline ops?

Runs one verify step with the baseline ops, the fused ops, each family alone fused, and the
baseline with MXFP8-rounded expert weights + activations (what the fused MoE computes, in torch).
    device run (carry .devcache): source tools/device-env.sh && python tools/probe_fused_ops.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from test_spec_decode import MxBaselineOps as MxBaseline  # noqa: E402  (the test's yardstick)
from spec_decode.config import ModelConfig
from spec_decode.fused_ops import FusedOps
from spec_decode.model import KVPool, TargetModel
from spec_decode.step_model import Ops, StepModel

from probe_fused_ops_families import FAMILIES, hybrid  # noqa: E402

cfg = ModelConfig(vocab=512, hidden=1024, layers=2, heads=16, head_dim=128, rope_dim=64, q_lora=256, kv_lora=256,
                  wo_groups=2, wo_rank=512, indexer_heads=64, indexer_dim=128, index_topk=64, experts=32,
                  n_group=4, topk_group=2, top_k=4, expert_inter=256, shared_inter=256)
m = TargetModel(cfg, seed=3, dtype=torch.bfloat16, device="cuda")
B, S, max_len = 4, 6, 256
fused_ops = FusedOps(m, max_tokens=B * S, max_len=max_len)
variants = {"baseline": Ops(), "fused": fused_ops, "mx_baseline": MxBaseline()}
for f in FAMILIES:
    variants[f"only {f}"] = hybrid(fused_ops, [f])
g = torch.Generator(device="cuda").manual_seed(1)
toks = torch.randint(0, cfg.vocab, (B, S), device="cuda", generator=g)
pos = torch.arange(S, device="cuda")[None] + torch.arange(B, device="cuda")[:, None] * 5
slots = torch.arange(B, device="cuda")
out = {}
for name, ops in variants.items():
    kv = KVPool(cfg, B, max_len, torch.bfloat16, "cuda")
    out[name], _ = StepModel(m, ops).forward(toks, pos, slots, kv)
torch.cuda.synchronize()
ref = out["baseline"].float()
for name, l in out.items():
    print(f"{name:14s} rel {float((l.float() - ref).norm() / ref.norm()):.4f}  argmax agree "
          f"{float((l.argmax(-1) == ref.argmax(-1)).float().mean()):.3f}")
