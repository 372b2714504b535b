"""row_rms: FP64 reference on the H200; argument validation and machine code on the CPU."""

import cutlass
import pytest
import torch

from cute_kernels.rms_norm import rms_norm, rms_norm_torch
from cute_kernels.row_rms import row_rms
from cute_kernels.testing import sass
from references import rel_err, rms_norm_ref, row_rms_ref

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


def _check_replays(g, x, out, replays: int):
    """Replay ``g`` (row_rms of ``x`` into ``out``) on fresh ``x`` each time, ``out`` poisoned
    first, and check every replay against the FP64 reference."""
    for _ in range(replays):
        x.copy_(torch.randn(*x.shape, device="cuda").bfloat16())
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(out, row_rms_ref(x, 1e-6)) < TOL


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
    _check_replays(g, x, out, 3)


@pytest.mark.gpu
def test_explicit_stream_argument(seed):
    x = torch.randn(9, 7168, device="cuda").bfloat16()
    out = torch.full((9,), float("nan"), device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    row_rms(x, out=out, stream=s)
    s.synchronize()
    assert rel_err(out, row_rms_ref(x, 1e-6)) < TOL


@pytest.mark.gpu
def test_tensor_entry_through_tvm_ffi(seed, monkeypatch):
    """With TVM-FFI on, calls after the first validated one take the tensor entry (torch tensors
    checked in C): bit-equal to the pointer launch, on the current stream and in a graph; every
    input the C checks or the hot path refuse still gets the entry point's named error, and a
    refused call launches nothing (the poisoned output stays poisoned)."""
    pytest.importorskip("tvm_ffi")
    from cute_kernels import jit
    from cute_kernels import row_rms as mod

    T, C = 6, 7168
    x = torch.randn(T, C, device="cuda").bfloat16()
    want = torch.empty(T, device="cuda")
    row_rms(x, out=want)  # the pointer launch (TVM-FFI off)
    real_get_kernel = jit.get_kernel
    jit.use_tvm_ffi()
    try:
        out = torch.empty(T, device="cuda")
        row_rms(x, out=out)  # first call: validated, registers the tensor entry
        assert (x.dtype, C, x.get_device()) in mod._TENSOR_FNS

        def pointer_path(*args, **kwargs):
            raise AssertionError("a call that the tensor entry takes reached the pointer path")

        monkeypatch.setattr(jit, "get_kernel", pointer_path)  # from here on: tensor entries or a named error
        for _ in range(3):
            x.copy_(torch.randn(T, C, device="cuda").bfloat16())
            jit.use_tvm_ffi(False)
            with monkeypatch.context() as m:
                m.setattr(jit, "get_kernel", real_get_kernel)
                row_rms(x, out=want)  # the pointer launch
            jit.use_tvm_ffi()
            out.fill_(float("nan"))
            assert row_rms(x, out=out) is out
            torch.cuda.synchronize()
            assert torch.equal(out, want) and rel_err(out, row_rms_ref(x, 1e-6)) < TOL
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            out.fill_(float("nan"))
            row_rms(x, out=out)
        s.synchronize()
        assert torch.equal(out, want)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            row_rms(x, out=out)
        _check_replays(g, x, out, 2)
        poisoned = torch.full((T,), float("nan"), device="cuda")
        buf = torch.randn(T * C + 8, device="cuda").bfloat16()
        bad = [
            (dict(x=x.float(), out=poisoned), TypeError, "x must have dtype"),
            (dict(x=x, out=poisoned[:5]), ValueError, "out must have shape"),
            (dict(x=x, out=poisoned.double()), TypeError, "out must have dtype"),
            (dict(x=torch.randn(2 * T, C, device="cuda").bfloat16()[::2], out=poisoned), ValueError, "contiguous"),
            (dict(x=buf[1:1 + T * C].view(T, C), out=poisoned), ValueError, "16-byte aligned"),
            (dict(x=x.cpu(), out=poisoned), ValueError, "CUDA tensor"),
            (dict(x=x, out=poisoned, eps=-1.0), TypeError, "eps"),
            (dict(x=x, out=poisoned, eps="1e-6"), TypeError, "eps"),
        ]
        for kw, exc, words in bad:
            with pytest.raises(exc, match=words):
                row_rms(**kw)
        torch.cuda.synchronize()
        assert poisoned.isnan().all()
        assert row_rms(x[:0], out=poisoned[:0]).shape == (0,)
        # the aligned 16-byte-offset view is legal: computed, not refused
        v = buf[8:8 + T * C].view(T, C)
        assert rel_err(row_rms(v, out=out), row_rms_ref(v, 1e-6)) < TOL
    finally:
        jit.use_tvm_ffi(False)


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
    # 896 16-byte vectors over 448 threads: 2 16-byte cp.async copies per thread, nothing narrower
    assert hist["LDGSTS.E.128"] == 2, hist
    assert sass.count(hist, "LDG") == 0  # (no register loads besides)
    assert sass.count(hist, "SHFL") >= 10  # two 5-step butterflies
    assert sass.count(hist, "BAR.SYNC") == 1
    assert sass.local_memory_ops(hist) == 0


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_row_rms_issues_the_whole_row_before_its_first_square(arch):
    """Every vector of the row is requested before the first square (its first FFMA): with
    register loads the compiler once issued the last two only after the first had arrived."""
    text = sass.disassemble(sass.compile_cubin("row_rms", arch, hidden=7168, dtype="bfloat16"))
    assert sass.global_loads_before(text, "FFMA") == (2, True)  # 896 vectors over 448 threads


# ------------------------------------------------------------------------- rms_norm -----
# Per element: y = round(round(x * round(r)) * w), three roundings to bf16 (unit roundoff
# u = 2^-8 each, relative), plus the FP32 statistic's ~1e-6: |y - ref| <= (3u + 4u^2 + 1e-5)
# |ref| against the unrounded FP64 value -- except where ref is below bf16's normal range,
# covered by half its smallest subnormal step (2^-134) per rounding.
BF16_U = 2.0 ** -8


def assert_rms_norm_bound(y, x, eps, w, cols=slice(None)):
    """``y`` (features ``cols`` of the normed rows) within the three-rounding bound above."""
    ref = rms_norm_ref(x.cpu(), eps, None if w is None else w.cpu())[..., cols]
    bound = (3 * BF16_U + 4 * BF16_U ** 2 + 1e-5) * ref.abs() + 3 * 2.0 ** -134
    bad = int(((y.double().cpu() - ref).abs() > bound).sum())
    assert bad == 0, f"{bad} of {ref.numel()} elements outside the per-element bound"


def assert_rope_bound(got, x, eps, w, cs_rows):
    """The rotated last ``r`` features ``got`` of RMSNorm + RoPE (``cs_rows``: each row's (cos,
    sin) ``[rows, r/2, 2]``) against the FP64 value: a pair (a, b) carries the norm's three
    roundings (3u relative each), the rotation is exact in FP64 and rounded once (u), so |err|
    <= 3.1u (|a c| + |b s|) + u |ref| for the first of the pair, (|a s| + |b c|) for the second."""
    r = got.shape[-1]
    ref = rms_norm_ref(x.cpu(), eps, None if w is None else w.cpu())[:, -r:]
    a, b = ref[:, 0::2], ref[:, 1::2]
    c, s = cs_rows.cpu().double()[..., 0], cs_rows.cpu().double()[..., 1]
    rot = torch.stack([a * c - b * s, a * s + b * c], -1).flatten(-2)
    mag = torch.stack([a.abs() * c.abs() + b.abs() * s.abs(), a.abs() * s.abs() + b.abs() * c.abs()], -1).flatten(-2)
    bound = 3.1 * BF16_U * mag + BF16_U * rot.abs() + 3 * 2.0 ** -134
    bad = int(((got.double().cpu() - rot).abs() > bound).sum())
    assert bad == 0, f"{bad} of {rot.numel()} rotated elements outside the per-element bound"


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 512), (5, 4096), (6, 64, 512), (3, 128), (77, 1024), (2, 8)])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_rounding_points_and_fp64_bound(seed, shape, weighted):
    """The kernel's output equals the composite's rounding sequence applied to the same FP32
    statistic (row_rms: the same reduction order) bit for bit, and every element is within the
    three-rounding bound of the FP64 value; written into a poisoned output."""
    x = (torch.randn(*shape, device="cuda") * 3 + 0.25).bfloat16()
    w = (torch.randn(shape[-1], device="cuda") + 1).bfloat16() if weighted else None
    out = torch.full_like(x, float("nan"))
    rms_norm(x, 1e-6, w, out=out)
    r = row_rms(x.reshape(-1, shape[-1]), 1e-6).view(*shape[:-1], 1).to(torch.bfloat16)
    want = x * r if w is None else (x * r) * w
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    assert_rms_norm_bound(out, x, 1e-6, w)


@pytest.mark.gpu
def test_rms_norm_edge_rows(seed):
    """An all-zero row (0 out), a row holding NaN (NaN out), a row holding +Inf (rstd 0: NaN at
    the Inf, Inf * 0, and 0 elsewhere), huge and subnormal magnitudes -- each as the composite
    gives them."""
    C = 512
    x = torch.randn(6, C, device="cuda").bfloat16()
    x[0] = 0
    x[1, 7] = float("nan")
    x[2, 3] = float("inf")
    x[3] *= 2.0 ** 100
    x[4] = torch.full((C,), 2.0 ** -130, device="cuda").bfloat16()  # subnormal bf16
    w = torch.randn(C, device="cuda").bfloat16()
    out = rms_norm(x, 1e-6, w)
    want = rms_norm_torch(x, 1e-6, w)
    torch.cuda.synchronize()
    assert torch.equal(out.isnan(), want.isnan())
    fin = ~want.isnan()
    assert torch.equal(out[fin], want[fin])
    assert (out[0] == 0).all() and out[1].isnan().all()
    # the +Inf row: its sum of squares is Inf, its rstd 0 -- NaN where x is Inf, 0 elsewhere
    assert out[2, 3].isnan() and (out[2, torch.arange(C, device="cuda") != 3] == 0).all()


@pytest.mark.gpu
def test_rms_norm_in_cuda_graph_each_replay(seed):
    """Captured once; every replay with fresh inputs gives the composite's output."""
    x = torch.randn(6, 4096, device="cuda").bfloat16()
    w = torch.randn(4096, device="cuda").bfloat16()
    out = torch.empty_like(x)
    rms_norm(x, 1e-6, w, out=out)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        rms_norm(x, 1e-6, w, out=out)
    for _ in range(5):
        x.copy_(torch.randn_like(x, dtype=torch.float32).bfloat16())
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        r = row_rms(x, 1e-6)[:, None].to(torch.bfloat16)
        assert torch.equal(out, (x * r) * w)


@pytest.mark.parametrize("args, kwargs, words", [
    ((torch.zeros(3, 64),), {}, "x must have dtype"),
    ((torch.zeros(3, 100, dtype=torch.bfloat16),), {}, "multiple of 8"),
    ((torch.zeros(3, 64, dtype=torch.bfloat16), 1e-6, torch.zeros(64)), {}, "weight must have dtype"),
    ((torch.zeros(3, 64, dtype=torch.bfloat16), 1e-6, torch.zeros(32, dtype=torch.bfloat16)), {}, "weight"),
    ((torch.zeros(3, 64, dtype=torch.bfloat16),), {"out": torch.zeros(3, 32, dtype=torch.bfloat16)}, "out"),
    ((torch.zeros(3, 64, dtype=torch.bfloat16), -1.0), {}, "eps"),
    ((torch.zeros(3, 64, dtype=torch.bfloat16),), {}, "CUDA"),
])
def test_rms_norm_rejects_bad_arguments(args, kwargs, words):
    with pytest.raises((ValueError, TypeError), match=words):
        rms_norm(*args, **kwargs)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("hidden, weighted", [(512, False), (4096, True)])
def test_rms_norm_machine_code(arch, hidden, weighted):
    """x read once in 16-byte vectors (cp.async copies) and written once in 16-byte vectors
    (and the weight's 16-byte vectors); a row of one warp (512) needs no barrier, one of eight
    warps (4096) one; no local memory."""
    from cute_kernels.row_rms import RowRms

    h = sass.sass_histogram("rms_norm", arch, hidden=hidden, weighted=weighted)
    op = RowRms(cutlass.BFloat16, hidden)
    per_thread = op.iters  # a row's vectors over its threads
    assert (per_thread, op.row_threads) == {512: (2, 32), 4096: (2, 256)}[hidden]
    assert sass.count(h, "LDGSTS.E.128") == per_thread * (2 if weighted else 1)
    assert sass.count(h, "STG.E.128") == per_thread
    assert sass.count(h, "BAR") == (0 if hidden <= 2048 else 1)
    assert sass.local_memory_ops(h) == 0


@pytest.mark.parametrize("loads, layout", [(2, (256, 1)), (4, (128, 1)), (8, (64, 2)), (16, (32, 4))])
def test_rms_norm_loads_per_thread_variants(loads, layout):
    """The bench's row layouts (``loads_per_thread``): a 4096-element row over 256 / 128 / 64 / 32
    threads (1, 1, 2, 4 rows a CTA), each thread issuing that many 16-byte loads of the row (and
    of the weight) and storing as many; no local memory; a value outside [1, 64] is refused."""
    import cute_kernels.rms_norm  # noqa: F401 -- registers the kernel
    from cute_kernels.row_rms import RowRms

    op = RowRms(cutlass.BFloat16, 4096, loads)
    assert (op.row_threads, op.rows_per_cta) == layout and op.iters == loads
    h = sass.sass_histogram("rms_norm", "sm_90a", hidden=4096, weighted=True, rope_dim=0, loads_per_thread=loads)
    assert sass.count(h, "LDGSTS.E.128") == 2 * loads and sass.count(h, "STG.E.128") == loads
    assert sass.local_memory_ops(h) == 0
    with pytest.raises(ValueError, match="loads_per_thread"):
        RowRms(cutlass.BFloat16, 4096, 0)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("cfg", [dict(hidden=4096, weighted=True), dict(hidden=512, weighted=True, rope_dim=64),
                                 dict(hidden=7168, weighted=True)])
def test_rms_norm_issues_every_load_before_the_first_use(arch, cfg):
    """The row, the weight and the rotation's (cos, sin) are all issued before the first
    arithmetic on the row (its first square, an FFMA): a load issued after it waits for the
    row's arrival -- one more memory round trip on the critical path of a short row, which
    the compiler's scheduling once produced for the weight's register loads."""
    from cute_kernels.row_rms import RowRms

    text = sass.disassemble(sass.compile_cubin("rms_norm", arch, dtype="bfloat16", **cfg))
    per_thread = RowRms(cutlass.BFloat16, cfg["hidden"]).iters
    # x, w; (cos, sin): 8 FP32 = 2 x 16 B, for the one vector of a thread that can be rotated
    want = per_thread * 2 + (2 if cfg.get("rope_dim") else 0)
    assert sass.global_loads_before(text, "FFMA") == (want, True)


def _rope_table(tokens, r, device="cuda"):
    """(cos, sin) FP32 [tokens, r/2, 2] of positions 0 .. tokens-1 times RoPE frequencies."""
    pos = torch.arange(tokens, device=device).float() * 37 + 5
    inv = 1.0 / (10000 ** (torch.arange(0, r, 2, device=device).float() / r))
    ang = pos[:, None] * inv
    return torch.stack([ang.cos(), ang.sin()], -1).contiguous()


@pytest.mark.gpu
@pytest.mark.parametrize("rows_per_token, C, weighted", [(1, 512, True), (64, 512, False), (1, 128, True),
                                                         (3, 64, False)])
@pytest.mark.parametrize("tokens", [1, 6, 77])
def test_rms_norm_rope_against_the_composite_and_fp64(seed, rows_per_token, C, weighted, tokens):
    """RMSNorm + RoPE on the last 64 features in one launch: the unrotated features equal
    rms_norm's bit for bit; each rotated pair is within one bf16 rounding of the composite's
    (the spec's FP32 complex product on rms_norm's output) and within the derived bound of the
    FP64 value (:func:`assert_rope_bound`)."""
    r = 64
    x = (torch.randn(tokens * rows_per_token, C, device="cuda") * 2).bfloat16()
    w = (torch.randn(C, device="cuda") * 0.2 + 1).bfloat16() if weighted else None
    cs = _rope_table(tokens, r)
    out = torch.full_like(x, float("nan"))
    rms_norm(x, 1e-6, w, rotate=cs, out=out)
    plain = rms_norm(x, 1e-6, w)
    torch.cuda.synchronize()
    assert torch.equal(out[:, :C - r], plain[:, :C - r])
    # the composite: FP32 complex product of rms_norm's rounded output, rounded once
    csr = cs.repeat_interleave(rows_per_token, 0)
    pairs = torch.view_as_complex(plain[:, C - r:].float().unflatten(-1, (r // 2, 2)).contiguous())
    comp = torch.view_as_real(pairs * torch.view_as_complex(csr)).flatten(-2).to(torch.bfloat16)
    got = out[:, C - r:]
    # both round an FP32 value once to bf16: one bf16 ulp of the larger apart, plus the two FP32
    # evaluations' difference (FMA or not: 2^-23 of the products' magnitudes each), which
    # decides the distance where the pair's two products cancel
    p, c = plain[:, C - r:].float().unflatten(-1, (r // 2, 2)), csr.float()
    mag = torch.stack([p[..., 0].abs() * c[..., 0].abs() + p[..., 1].abs() * c[..., 1].abs(),
                       p[..., 0].abs() * c[..., 1].abs() + p[..., 1].abs() * c[..., 0].abs()], -1).flatten(-2)
    big = torch.maximum(torch.maximum(comp.float().abs(), got.float().abs()), torch.tensor(2.0 ** -126, device="cuda"))
    bound = big * 2.0 ** -7 + mag * 2.0 ** -22
    assert bool(((got.float() - comp.float()).abs() <= bound).all())
    assert_rope_bound(got, x, 1e-6, w, csr)


@pytest.mark.parametrize("rotate, words", [
    (torch.zeros(3, 32, 2, dtype=torch.float64), "rotate must have dtype"),
    (torch.zeros(3, 64), "rotate must be 3-D"),
    (torch.zeros(3, 32, 3), r"rotate must be \[tokens, r/2, 2\]"),
    (torch.zeros(3, 3, 2), "multiple of 8"),
    (torch.zeros(3, 64, 2), "<= 64"),
    (torch.zeros(4, 32, 2), "not 4 tokens"),
])
def test_rms_norm_rejects_bad_rotations(rotate, words):
    x = torch.zeros(6, 64, dtype=torch.bfloat16)
    with pytest.raises((ValueError, TypeError), match=words):
        rms_norm(x, 1e-6, rotate=rotate)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_rms_norm_rope_machine_code(arch):
    """The rotation reads each rotated vector's (cos, sin) in two 16-byte copies; x and the
    output still move in 16-byte vectors (the loads through cp.async); no local memory."""
    import cute_kernels.rms_norm  # noqa: F401

    h = sass.sass_histogram("rms_norm", arch, hidden=512, weighted=False, rope_dim=64)
    # a row of 64 vectors over one warp: two each, the second of them rotated for the last 8 lanes
    assert sass.count(h, "LDGSTS.E.128") == 4 and sass.count(h, "STG.E.128") == 2
    assert sass.local_memory_ops(h) == 0


@pytest.mark.parametrize("C", [8, 136, 512, 1024, 2048, 2056, 4096, 4104, 7168, 28672, 65536])
def test_row_threads_cover_the_row_and_rows_share_a_cta(C):
    """The row kernels' thread layout (RowRms): a row's threads cover its vectors with at most
    ``LOADS_PER_THREAD`` each (``iters``) up to 1024 threads a row; rows of up to two warps'
    loads (1024 elements at two loads a thread) share a CTA of 4 warps (whole warps per row:
    the statistic needs no barrier for one warp), longer ones have a CTA each of at least 4
    warps; what goes through shared memory fits its budget."""
    import cutlass

    from cute_kernels.rms_norm import RmsNorm
    from cute_kernels.row_rms import ASYNC_SMEM_BYTES, LOADS_PER_THREAD, RowRms

    k = RowRms(cutlass.BFloat16, C)
    n_vec = C // 8
    assert k.row_threads * k.iters >= n_vec > k.row_threads * (k.iters - 1)
    assert k.iters <= LOADS_PER_THREAD or k.row_threads == 1024
    assert k.row_threads % 32 == 0 and k.threads == k.row_threads * k.rows_per_cta <= 1024
    if n_vec <= 64 * LOADS_PER_THREAD:
        assert k.threads == 128 and k.rows_per_cta == 128 // k.row_threads
    else:
        assert k.rows_per_cta == 1 and k.threads >= 128
    for weighted in (False, True):
        n = RmsNorm(cutlass.BFloat16, C, weighted, rope_dim=64 if C >= 64 else 0)
        if n.async_loads:
            assert n.rows_per_cta * (C * 2 * (1 + weighted) + 4 * n.rope_dim) <= ASYNC_SMEM_BYTES
        assert n.async_loads or n.rows_per_cta == 1


@pytest.mark.parametrize("rotated", [False, True])
def test_cpu_fallback_within_the_bounds(seed, rotated):
    """The CPU / custom-op implementation (rms_norm_torch) against the FP64 definition, per
    element, with the bounds of the GPU tests."""
    from cute_kernels.rms_norm import rms_norm_torch

    x = (torch.randn(12, 128) * 2).bfloat16()
    w = (torch.randn(128) * 0.2 + 1).bfloat16()
    cs = _rope_table(4, 64, device="cpu") if rotated else None
    y = rms_norm_torch(x, 1e-6, w, cs)
    if not rotated:
        assert_rms_norm_bound(y, x, 1e-6, w)
        return
    assert_rms_norm_bound(y[:, :64], x, 1e-6, w, cols=slice(None, 64))
    assert_rope_bound(y[:, 64:], x, 1e-6, w, cs.repeat_interleave(3, 0))
