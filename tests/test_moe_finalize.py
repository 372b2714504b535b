"""Deferred finalize + shared-expert add: bit-exact against the unfused rounding sequence."""

import pytest
import torch

from cute_kernels.testing import sass
from moe.finalize import moe_finalize
from references import finalize_shared_ref


def make(T, k, H, rows, device="cuda"):
    y = torch.full((rows, H), float("nan"), device=device).bfloat16()  # poisoned padding rows
    pos = torch.randperm(rows, device=device)[: T * k].int()
    y[pos.long()] = torch.randn(T * k, H, device=device).bfloat16()
    w = torch.rand(T, k, device=device) * 2.5
    shared = torch.randn(T, H, device=device).bfloat16()
    return y, w, pos, shared


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 5, 64, 77, 320])
@pytest.mark.parametrize("k, H", [(8, 7168), (6, 2048), (1, 64)])
def test_fused_and_unfused_bit_exact(seed, T, k, H):
    y, w, pos, shared = make(T, k, H, rows=T * k + 300)
    fused = torch.full((T, H), float("nan"), device="cuda", dtype=torch.bfloat16)
    moe_finalize(y, w, pos, shared, out=fused)
    routed = moe_finalize(y, w, pos)
    unfused = routed + shared  # the unfused path's separate bf16 add
    torch.cuda.synchronize()
    ref_routed = finalize_shared_ref(y.cpu(), w.cpu(), pos.cpu())
    ref = finalize_shared_ref(y.cpu(), w.cpu(), pos.cpu(), shared.cpu())
    assert torch.equal(routed.cpu(), ref_routed)
    assert torch.equal(fused.cpu(), ref)
    assert torch.equal(unfused.cpu(), ref)
    assert torch.isfinite(fused).all()  # poisoned padding rows never read


@pytest.mark.gpu
def test_all_tokens_to_one_expert(seed):
    T, k, H = 33, 8, 1024
    y = torch.randn(T * k, H, device="cuda").bfloat16()
    pos = torch.arange(T * k, device="cuda").int()  # one expert's contiguous block
    w = torch.rand(T, k, device="cuda")
    out = moe_finalize(y, w, pos, torch.zeros(T, H, device="cuda").bfloat16())
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), finalize_shared_ref(y.cpu(), w.cpu(), pos.cpu(), torch.zeros(T, H).bfloat16()))


@pytest.mark.parametrize("kw, exc, words", [
    (dict(y=torch.zeros(8, 64), topk_weights=torch.zeros(2, 4), routed_row_pos=torch.zeros(8, dtype=torch.int32)),
     TypeError, "y must have dtype bfloat16"),
    (dict(y=torch.zeros(8, 60).bfloat16(), topk_weights=torch.zeros(2, 4), routed_row_pos=torch.zeros(8, dtype=torch.int32)),
     ValueError, "multiple of 8"),
    (dict(y=torch.zeros(8, 64).bfloat16(), topk_weights=torch.zeros(2, 4), routed_row_pos=torch.zeros(7, dtype=torch.int32)),
     ValueError, "routed_row_pos must have shape"),
    (dict(y=torch.zeros(8, 64).bfloat16(), topk_weights=torch.zeros(2, 4), routed_row_pos=torch.zeros(8, dtype=torch.int32),
          shared=torch.zeros(3, 64).bfloat16()), ValueError, "shared must have shape"),
    (dict(y=torch.zeros(8, 64).bfloat16(), topk_weights=torch.zeros(2, 4), routed_row_pos=torch.zeros(8, dtype=torch.int32)),
     ValueError, "CUDA"),
])
def test_bad_arguments(kw, exc, words):
    with pytest.raises(exc, match=words):
        moe_finalize(**kw)


def test_y_past_32_bit_offsets_is_refused():
    m = dict(device="meta")
    with pytest.raises(ValueError, match="2\\*\\*31"):
        moe_finalize(torch.empty(300_000, 7168, dtype=torch.bfloat16, **m), torch.empty(8, 8, **m),
                     torch.empty(64, dtype=torch.int32, **m))


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_machine_code_no_fma_contraction(arch):
    h = sass.sass_histogram("moe_finalize", arch, hidden=7168, topk=8, add_shared=True)
    assert sass.count(h, "FMUL") >= 64 and sass.count(h, "FFMA") == 0  # rounded products, then sums
    assert h["LDGSTS.E.128"] == 9 and h["STG.E.128"] == 1  # 8 routed rows + the shared row, 16 B each
    assert sass.local_memory_ops(h) == 0


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_machine_code_two_round_trips(arch):
    """The routed rows and the shared row are all issued before the one wait, and every product
    comes after it: the positions' round trip, then one for all the vectors (a load issued
    behind products waiting for an earlier one would add a round trip per group)."""
    text = sass.disassemble(sass.compile_cubin("moe_finalize", arch, hidden=7168, topk=8, add_shared=True))
    # 8 positions and 8 weights (register loads), 8 routed rows and the shared row (cp.async)
    assert sass.global_loads_before(text, "FMUL") == (25, True)