"""masked_softmax: float64 reference on the H200; argument validation and machine code on the CPU."""

import pytest
import torch

from cute_kernels.masked_softmax import masked_softmax
from cute_kernels.testing import sass
from references import masked_softmax_ref, rel_err

# Tolerance: each probability is rounded once to bf16 (relative 2^-9) from an FP32 value whose
# exp2 / sum / rcp error is ~1e-6; ||round(p) - p|| / ||p|| <= 2^-9 ~ 2.0e-3, typically half.
TOL = {torch.bfloat16: 2.5e-3, torch.float16: 4e-4}


def _mask_width(M: int) -> int:
    """A masked-dense attention core's mask row stride over M keys: one spare column, padded to
    16 (a multiple of 8 that is not M itself, so the kernel's stride handling is exercised)."""
    return -(-(M + 1) // 16) * 16


def _inputs(lead, H, M, W=None, dtype=torch.bfloat16, density=0.4):
    """Attention-like scores (a few large logits per row) and a random selection mask with at
    least one key per token and garbage in the unused columns past M."""
    W = W or _mask_width(M)
    scores = (torch.randn(*lead, H, M, device="cuda") * 4).to(dtype)
    mask = torch.rand(*lead, W, device="cuda") < density
    first = torch.randint(0, M, (*lead, 1), device="cuda")
    mask.scatter_(-1, first, True)
    return scores, mask


@pytest.mark.gpu
@pytest.mark.parametrize("lead, H, M", [((1, 1), 1, 8), ((1, 6), 128, 592), ((3, 5), 16, 1000), ((65, 6), 128, 6160),
                                        ((2, 1), 4, 20000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_fp64_reference(seed, lead, H, M, dtype):
    scores, mask = _inputs(lead, H, M, dtype=dtype)
    out = torch.full_like(scores, float("nan"))  # poison: every element must be written
    masked_softmax(scores, mask, out=out)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    ref = masked_softmax_ref(scores, mask)
    assert rel_err(out, ref) < TOL[dtype]
    assert (out[~mask[..., None, :M].expand_as(out)] == 0).all()  # unselected keys exactly 0
    assert (out.double().sum(-1) - 1).abs().max() < 0.02


@pytest.mark.gpu
def test_in_place_matches_torch_composite(seed):
    """In place on the scores, as the runtime's attention core calls it; against the
    composite the baseline runs (masked_fill_ then bf16 softmax): the same rounding point."""
    scores, mask = _inputs((4, 6), 32, 6160, density=0.3)
    ref = masked_softmax_ref(scores, mask)
    composite = scores.clone().masked_fill_(~mask[:, :, None, :6160], float("-inf")).softmax(-1)
    out = masked_softmax(scores, mask, out=scores)
    assert out.data_ptr() == scores.data_ptr()
    assert rel_err(out, ref) < TOL[torch.bfloat16]
    assert rel_err(out, composite) < TOL[torch.bfloat16]


@pytest.mark.gpu
def test_extremes_and_empty_rows(seed):
    scores, mask = _inputs((2, 3), 8, 64)
    scores[0, 0, 0, 5] = 3e38  # near bf16 max: exp of the rest underflows
    mask[0, 0, 5] = True
    mask[1, 2] = False  # a token selecting nothing: zeros, not NaN
    scores[1, 1, 3, 7] = float("-inf")
    out = masked_softmax(scores, mask)
    ref = masked_softmax_ref(scores, mask)
    assert torch.isfinite(out).all()
    assert out[0, 0, 0, 5] == 1
    assert (out[1, 2] == 0).all()
    assert rel_err(out, ref) < TOL[torch.bfloat16]


@pytest.mark.gpu
def test_side_stream_and_cuda_graph(seed):
    scores, mask = _inputs((64, 6), 128, 592)
    out = torch.empty_like(scores)
    masked_softmax(scores, mask, out=out)  # compile outside capture
    s = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            masked_softmax(scores, mask, out=out)
    for _ in range(3):
        fresh, fresh_mask = _inputs((64, 6), 128, 592)
        scores.copy_(fresh)
        mask.copy_(fresh_mask)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(out, masked_softmax_ref(scores, mask)) < TOL[torch.bfloat16]


# ---------------------------------------------------------------- validation (CPU) ----
def _s(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape).to(dtype)


def _m(*shape):
    return torch.rand(*shape) < 0.5


@pytest.mark.parametrize(
    "make, exc, words",
    [
        (lambda: dict(scores=_s(2, 4, 64, dtype=torch.float32), mask=_m(2, 64)), TypeError, "scores must have dtype"),
        (lambda: dict(scores=_s(2, 4, 64), mask=_m(2, 64).float()), TypeError, "mask must have dtype"),
        (lambda: dict(scores=_s(64), mask=_m(64)), ValueError, "scores must be"),
        (lambda: dict(scores=_s(2, 4, 64), mask=_m(3, 64)), ValueError, "mask must be"),
        (lambda: dict(scores=_s(2, 4, 64), mask=_m(2, 1, 64)), ValueError, "mask must be 2-D"),
        (lambda: dict(scores=_s(2, 4, 60), mask=_m(2, 64)), ValueError, "multiple of 8"),
        (lambda: dict(scores=_s(2, 4, 64), mask=_m(2, 56)), ValueError, r"mask.shape\[-1\]=56"),
        (lambda: dict(scores=_s(2, 4, 64), mask=_m(2, 68)), ValueError, r"mask.shape\[-1\]=68"),
        (lambda: dict(scores=_s(2, 64, 4).transpose(1, 2), mask=_m(2, 64)), ValueError, "scores must be contiguous"),
        (lambda: dict(scores=_s(2, 4, 64), mask=_m(2, 64), out=_s(2, 4, 56)), ValueError, "out must have shape"),
        (lambda: dict(scores=_s(2, 4, 64), mask=_m(2, 64)), ValueError, "must be a CUDA tensor"),
        (lambda: dict(scores=_s(2 * 4 * 64 + 1)[1:].view(2, 4, 64), mask=_m(2, 64)), ValueError, "16-byte aligned"),
        (lambda: dict(scores=_s(2, 4, 64), mask=_m(2 * 64 + 1)[1:].view(2, 64)), ValueError, "8-byte aligned"),
    ],
)
def test_bad_arguments_raise_before_launch(make, exc, words):
    kw = make()
    with pytest.raises(exc, match=words):
        masked_softmax(**kw)


# ------------------------------------------------------------ machine code (CPU) ----
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_machine_code_vectorised_no_spills(arch):
    hist = sass.sass_histogram("masked_softmax", arch, length=6160, heads=128, mask_stride=6176, dtype="bfloat16")
    # 770 score vectors over 128 threads: 7 16-byte score loads, 7 8-byte mask loads and 7
    # 16-byte stores per thread, one ex2 per element, two barriers, nothing in local memory
    assert hist["LDG.E.128"] == 7 and hist["LDG.E.64"] == 7, hist
    assert sass.count(hist, "LDG") == 14
    assert hist["STG.E.128"] == 7 and sass.count(hist, "STG") == 7
    assert hist["MUFU.EX2"] == 56
    assert sass.count(hist, "BAR") == 2
    assert sass.local_memory_ops(hist) == 0
