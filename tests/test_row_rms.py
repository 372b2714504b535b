"""row_rms: FP64 reference on the H200; argument validation and machine code on the CPU."""

import pytest
import torch

from cute_kernels.row_rms import row_rms
from cute_kernels.testing import sass
from references import rel_err, row_rms_ref

# Tolerance: an FP32 sum of C squares has relative error <= ~C * 2^-24 in the worst case
# and ~sqrt(C) * 2^-24 typically; rsqrt adds ~2 ulp. 1e-5 covers C = 65536 with margin.
TOL = 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 5, 77, 1000])
@pytest.mark.parametrize("C", [8, 136, 7168, 28672])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_fp64_reference(seed, T, C, dtype):
    x = (torch.randn(T, C, device="cuda") * 3 + 0.5).to(dtype)
    out = torch.full((T,), float("nan"), device="cuda")  # poison: every row must be written
    row_rms(x, 1e-6, out=out)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    assert rel_err(out, row_rms_ref(x, 1e-6)) < TOL


@pytest.mark.gpu
def test_large_magnitudes_and_eps(seed):
    x = (torch.randn(33, 7168, device="cuda") * 1e3).bfloat16()
    x[3] = 0  # an all-zero row: rsqrt(eps)
    out = row_rms(x, 1e-2)
    ref = row_rms_ref(x, 1e-2)
    assert rel_err(out, ref) < TOL
    assert abs(out[3].item() - 10.0) < 1e-4


@pytest.mark.gpu
def test_side_stream_and_cuda_graph(seed):
    T, C = 6, 28672
    x = torch.randn(T, C, device="cuda").bfloat16()
    out = torch.empty(T, device="cuda")
    row_rms(x, out=out)  # compile outside capture
    s = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            row_rms(x, out=out)
    for _ in range(3):
        x.copy_(torch.randn(T, C, device="cuda").bfloat16())
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(out, row_rms_ref(x, 1e-6)) < TOL


@pytest.mark.gpu
def test_explicit_stream_argument(seed):
    x = torch.randn(9, 7168, device="cuda").bfloat16()
    out = torch.full((9,), float("nan"), device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    row_rms(x, out=out, stream=s)
    s.synchronize()
    assert rel_err(out, row_rms_ref(x, 1e-6)) < TOL


# ---------------------------------------------------------------- validation (CPU) ----
def _x(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape).to(dtype)


@pytest.mark.parametrize(
    "make, exc, words",
    [
        (lambda: dict(x=_x(4, 64, dtype=torch.float32)), TypeError, "x must have dtype"),
        (lambda: dict(x=[1, 2, 3]), TypeError, "x must be a torch.Tensor"),
        (lambda: dict(x=_x(4, 2, 64)), ValueError, "x must be 2-D"),
        (lambda: dict(x=_x(64, 4).t()), ValueError, "x must be contiguous"),
        (lambda: dict(x=_x(4, 12)), ValueError, "multiple of 8"),
        (lambda: dict(x=_x(4, 64), out=torch.empty(5)), ValueError, "out must have shape"),
        (lambda: dict(x=_x(4, 64), out=torch.empty(4, dtype=torch.float16)), TypeError, "out must have dtype"),
        (lambda: dict(x=_x(4, 64)), ValueError, "must be a CUDA tensor"),
        (lambda: dict(x=_x(4, 64), eps=-1.0), TypeError, "eps"),
        (lambda: dict(x=_x(4 * 72 + 1)[1:].view(4, 72)), ValueError, "16-byte aligned"),
    ],
)
def test_bad_arguments_raise_before_launch(make, exc, words):
    kw = make()
    with pytest.raises(exc, match=words):
        row_rms(**kw)


# ------------------------------------------------------------ machine code (CPU) ----
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_machine_code_vectorised_no_spills(arch):
    hist = sass.sass_histogram("row_rms", arch, hidden=7168, dtype="bfloat16")
    # 896 16-byte vectors over 128 threads: 7 LDG.E.128 per thread, nothing narrower.
    assert hist["LDG.E.128"] == 7, hist
    assert sass.count(hist, "LDG") == 7
    assert sass.count(hist, "SHFL") >= 10  # two 5-step butterflies
    assert sass.local_memory_ops(hist) == 0
