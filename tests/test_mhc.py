"""mHC statistics / mappings (vs FP64), pre-mix and post-mix (bit-exact vs the FP32 rounding
sequence), side-stream use inside a CUDA graph; validation and machine code on the CPU."""

import pytest
import torch

from cute_kernels.mhc_pre_mix import mhc_pre_mix
from cute_kernels.mhc_post_mix import mhc_post_mix
from cute_kernels.mhc_stats import (MhcStatsWorkspace, map_range, mhc_split_phi, mhc_stats, mhc_stats_torch, num_maps,
                                    plan_splits)
from cute_kernels.testing import sass
from references import mhc_post_mix_ref, mhc_pre_mix_ref, mhc_stats_ref

# Tolerance on H (values in (0, 2)): phi is carried to 16 significant bits (two bf16
# planes, <= 2^-17 relative per weight) and the sums are FP32, so P is good to ~1e-5
# relative at K = 28672; sigmoid has slope <= 1/2 and exp/Sinkhorn amplify by O(1)
# (a 1e-5 relative perturbation of P moves H by ~7e-6 in a CPU experiment).
ATOL = 2e-5
EPS = 1e-6


def make_inputs(T, n, C, device="cuda"):
    m, K = num_maps(n), n * C
    x = (torch.randn(T, n, C, device=device) * 2 + 0.3).bfloat16()
    phi = torch.randn(m, K, device=device) / K**0.5  # P ~ N(0, 1): the mappings see all of sigmoid/exp
    alpha = torch.rand(3, device=device) + 0.5
    bias = torch.randn(m, device=device) * 0.5
    return x, phi, alpha, bias


def check_stats(x, phi, alpha, bias, H, iters=20, hc_eps=0.0):
    ref = mhc_stats_ref(x.cpu(), phi.cpu(), alpha.cpu(), bias.cpu(), EPS, iters, hc_eps)
    err = (H.double().cpu() - ref).abs().max().item()
    assert err < ATOL, err


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 5, 32, 33, 64, 320])
@pytest.mark.parametrize("n, C", [(4, 7168), (4, 64), (3, 1000), (2, 1000), (1, 8)])
def test_stats_match_fp64(seed, T, n, C):
    x, phi, alpha, bias = make_inputs(T, n, C)
    H = torch.full((T, num_maps(n)), float("nan"), device="cuda")  # poison: every entry written
    mhc_stats(x, phi, alpha, bias, eps=EPS, out=H)
    torch.cuda.synchronize()
    assert torch.isfinite(H).all()
    check_stats(x, phi, alpha, bias, H)
    res = H[:, 2 * n:].view(T, n, n).double()
    assert (res.sum(-2) - 1).abs().max() < 1e-5  # columns: the last Sinkhorn step normalises them
    # rows: as converged as 20 iterations of the exact algorithm get (an input property)
    ref_rows = mhc_stats_ref(x.cpu(), phi.cpu(), alpha.cpu(), bias.cpu(), EPS, 20)[:, 2 * n:].view(T, n, n).sum(-1)
    assert (res.sum(-1).cpu() - ref_rows).abs().max() < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 6, 37])
@pytest.mark.parametrize("C", [4096, 7168])
def test_stats_v4_hc_eps_match_fp64(seed, T, C):
    """DeepSeek-V4's mappings (hc_eps = 1e-6 in pre and every Sinkhorn denominator)."""
    x, phi, alpha, bias = make_inputs(T, 4, C)
    H = torch.full((T, num_maps(4)), float("nan"), device="cuda")
    mhc_stats(x, phi, alpha, bias, eps=EPS, hc_eps=1e-6, out=H)
    torch.cuda.synchronize()
    check_stats(x, phi, alpha, bias, H, hc_eps=1e-6)
    # the eps terms are visible: pre is sigmoid + 1e-6, and the reference without them differs
    plain = mhc_stats_ref(x.cpu(), phi.cpu(), alpha.cpu(), bias.cpu(), EPS, 20)
    assert (H[:, :4].double().cpu() - plain[:, :4] - 1e-6).abs().max() < ATOL


@pytest.mark.gpu
def test_stats_workspace_reuse_and_graph_replay(seed):
    """One workspace serves many T (counters self-reset); replay with fresh inputs in place."""
    n, C = 4, 7168
    ws = MhcStatsWorkspace(n, 128)
    for T in (128, 1, 77, 5):
        x, phi, alpha, bias = make_inputs(T, n, C)
        H = torch.full((T, num_maps(n)), float("nan"), device="cuda")
        mhc_stats(x, phi, alpha, bias, eps=EPS, workspace=ws, out=H)
        torch.cuda.synchronize()
        check_stats(x, phi, alpha, bias, H)
    assert int(ws.counters.abs().sum()) == 0

    T = 64
    x, phi, alpha, bias = make_inputs(T, n, C)
    planes = mhc_split_phi(phi)  # the hot path takes pre-split weights: nothing allocated
    H = torch.empty(T, num_maps(n), device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        mhc_stats(x, planes, alpha, bias, eps=EPS, workspace=ws, out=H)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        mhc_stats(x, planes, alpha, bias, eps=EPS, workspace=ws, out=H)
    for _ in range(3):
        x2, phi2, alpha2, bias2 = make_inputs(T, n, C)
        x.copy_(x2), phi.copy_(phi2), alpha.copy_(alpha2), bias.copy_(bias2)
        planes.copy_(mhc_split_phi(phi))
        H.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check_stats(x, phi, alpha, bias, H)


@pytest.mark.gpu
def test_stats_extreme_inputs(seed):
    """Large activations (r small) and a zero token (r = rsqrt(eps)) stay finite and exact."""
    T, n, C = 9, 4, 7168
    x, phi, alpha, bias = make_inputs(T, n, C)
    x[0] *= 1000
    x[3] = 0
    H = mhc_stats(x, phi, alpha, bias, eps=EPS)
    torch.cuda.synchronize()
    assert torch.isfinite(H).all()
    check_stats(x, phi, alpha, bias, H)


def _mappings(T, n, device="cuda"):
    h = torch.rand(T, num_maps(n), device=device)
    h[:, n:2 * n] *= 2
    return h


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 5, 77, 320])
@pytest.mark.parametrize("n, C", [(4, 7168), (4, 1032), (3, 8)])
def test_pre_and_post_mix_bit_exact(seed, T, n, C):
    x = torch.randn(T, n, C, device="cuda").bfloat16()
    h = _mappings(T, n)
    f = torch.randn(T, C, device="cuda").bfloat16()
    u = torch.full((T, C), float("nan"), device="cuda").bfloat16()
    mhc_pre_mix(x, h, out=u)
    out = torch.full_like(x, float("nan"))
    mhc_post_mix(x, h, f, out=out)
    torch.cuda.synchronize()
    assert torch.equal(u.cpu(), mhc_pre_mix_ref(x.cpu(), h.cpu()))
    ref = mhc_post_mix_ref(x.cpu(), h.cpu(), f.cpu())
    assert torch.equal(out.cpu(), ref)
    mhc_post_mix(x, h, f, out=x)  # the residual update in place
    torch.cuda.synchronize()
    assert torch.equal(x.cpu(), ref)


@pytest.mark.gpu
def test_mhc_sublayer_against_model_reference(seed):
    """stats -> pre-mix -> F -> post-mix equals the runtime's fp32 mHC (spec_decode.model, V4's
    hc_eps) within bf16 rounding."""
    from spec_decode.model import post_mix, pre_mix

    T, n, C = 6, 4, 7168
    x, phi, alpha, bias = make_inputs(T, n, C)
    H = mhc_stats(x, phi, alpha, bias, eps=EPS, hc_eps=1e-6)
    u = mhc_pre_mix(x, H)
    f = (u.float() * 0.5).bfloat16()  # a stand-in sublayer
    X2 = mhc_post_mix(x, H, f)
    torch.cuda.synchronize()
    Hr = mhc_stats_ref(x.cpu(), phi.cpu(), alpha.cpu(), bias.cpu(), EPS, 20, 1e-6).float()
    hp, hq, hr = Hr[:, :n], Hr[:, n:2 * n], Hr[:, 2 * n:].view(T, n, n)
    u_ref = pre_mix(x.cpu().float()[None], hp[None])[0]
    X2_ref = post_mix(x.cpu().float()[None], hq[None], hr[None], (u_ref * 0.5)[None])[0]
    assert (u.float().cpu() - u_ref).norm() / u_ref.norm() < 2**-8
    assert (X2.float().cpu() - X2_ref).norm() / X2_ref.norm() < 2**-8


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 6, 37, 384])
@pytest.mark.parametrize("n, C, hc_eps", [(4, 4096, 1e-6), (4, 7168, 0.0), (3, 1000, 0.0)])
def test_stats_parts_bit_equal_to_all(seed, T, n, C, hc_eps):
    """``"pre"`` and ``"post_res"`` write exactly their columns, each bit-equal to one ``"all"``
    launch (the same products, splits and sums): launched concurrently on two streams inside a
    CUDA graph, as the decode step does, with fresh inputs before every replay."""
    x, phi, alpha, bias = make_inputs(T, n, C)
    m = num_maps(n)
    planes = {p: mhc_split_phi(phi, p) for p in ("all", "pre", "post_res")}
    ws_main, ws_side = MhcStatsWorkspace(n, T), MhcStatsWorkspace(n, T)
    H_all = torch.empty(T, m, device="cuda")
    H = torch.empty(T, m, device="cuda")
    side = torch.cuda.Stream()

    def step():
        mhc_stats(x, planes["all"], alpha, bias, eps=EPS, hc_eps=hc_eps, workspace=ws_main, out=H_all)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            mhc_stats(x, planes["post_res"], alpha, bias, eps=EPS, hc_eps=hc_eps, maps="post_res",
                      workspace=ws_side, out=H)
        mhc_stats(x, planes["pre"], alpha, bias, eps=EPS, hc_eps=hc_eps, maps="pre", workspace=ws_main, out=H)
        torch.cuda.current_stream().wait_stream(side)

    first, count = map_range(n, "pre")
    for part in ("pre", "post_res"):  # eager, one part at a time: the other columns untouched
        H.fill_(float("nan"))
        mhc_stats(x, planes[part], alpha, bias, eps=EPS, hc_eps=hc_eps, maps=part, workspace=ws_main, out=H)
        mhc_stats(x, planes["all"], alpha, bias, eps=EPS, hc_eps=hc_eps, workspace=ws_main, out=H_all)
        torch.cuda.synchronize()
        a, c = map_range(n, part)
        assert torch.equal(H[:, a:a + c], H_all[:, a:a + c])
        assert H[:, :a].isnan().all() and H[:, a + c:].isnan().all()
    step()  # warm (compiles) outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for _ in range(3):
        x.copy_((torch.randn(T, n, C, device="cuda") * 2 + 0.3).bfloat16())
        H.fill_(float("nan"))
        H_all.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(H, H_all)
        check_stats(x, phi, alpha, bias, H, hc_eps=hc_eps)


def test_stats_parts_cpu_fallback_write_their_columns():
    """The PyTorch path computes a part's columns as the whole op does and leaves the rest."""
    x, phi, alpha, bias = make_inputs(3, 4, 64, device="cpu")
    full = mhc_stats_torch(x, phi, alpha, bias, EPS, 20, 1e-6)
    for part in ("pre", "post_res"):
        a, c = map_range(4, part)
        H = mhc_stats_torch(x, mhc_split_phi(phi, part), alpha, bias, EPS, 20, 1e-6, maps=part)
        planes = mhc_stats_torch(x, mhc_split_phi(phi), alpha, bias, EPS, 20, 1e-6)
        assert torch.equal(H[:, a:a + c], planes[:, a:a + c])
        assert H[:, :a].isnan().all() and H[:, a + c:].isnan().all()
        H32 = mhc_stats_torch(x, phi, alpha, bias, EPS, 20, 1e-6, maps=part)
        assert torch.equal(H32[:, a:a + c], full[:, a:a + c])


def test_split_phi_planes():
    phi = torch.randn(24, 512) / 20
    planes = mhc_split_phi(phi)
    assert planes.shape == (48, 512) and planes.dtype == torch.bfloat16
    assert (planes[:24].float() + planes[24:].float() - phi).abs().max() <= phi.abs().max() * 2**-16
    planes = mhc_split_phi(torch.randn(15, 64))  # n = 3: planes padded to 16 rows
    assert planes.shape == (32, 64) and planes[15].abs().sum() == 0 and planes[31].abs().sum() == 0
    with pytest.raises(ValueError, match="2n \\+ n\\*n"):
        mhc_split_phi(torch.zeros(7, 64))
    # a part's planes: its rows of phi, padded to 8 (pre: 4 -> 8; post_res: 20 -> 24)
    phi = torch.randn(24, 64)
    pre, rest = mhc_split_phi(phi, "pre"), mhc_split_phi(phi, "post_res")
    assert pre.shape == (16, 64) and rest.shape == (48, 64)
    assert torch.equal(pre[:4], phi[:4].bfloat16()) and pre[4:8].abs().sum() == 0
    assert torch.equal(rest[:20], phi[4:].bfloat16()) and rest[20:24].abs().sum() == 0
    assert torch.equal(rest[24:44], mhc_split_phi(phi)[28:48])
    with pytest.raises(ValueError, match="maps"):
        mhc_split_phi(phi, "res")


def test_plan_splits_covers_k_and_bounds_workspace():
    for T in (1, 5, 64, 320, 4096):
        for K in (8, 256, 4000, 28672):
            s, per = plan_splits(T, K, 264)
            nchunks = -(-K // 128)
            assert 1 <= s <= 64 and (s - 1) * per < nchunks <= s * per


def _cpu_args(**over):
    x = torch.zeros(2, 4, 64).bfloat16()
    kw = dict(x=x, phi=torch.zeros(24, 256), alpha=torch.zeros(3), bias=torch.zeros(24))
    kw.update(over)
    return kw


@pytest.mark.parametrize("over, exc, words", [
    (dict(x=torch.zeros(2, 4, 64)), TypeError, "x must have dtype bfloat16"),
    (dict(x=torch.zeros(2, 4, 60).bfloat16()), ValueError, "multiple of 8"),
    (dict(x=torch.zeros(2, 5, 64).bfloat16()), ValueError, "streams n"),
    (dict(phi=torch.zeros(256, 24)), ValueError, "phi must have shape [24, 256]"),
    (dict(phi=torch.zeros(24, 256).double()), TypeError, "phi must have dtype float32 or bfloat16"),
    (dict(phi=torch.zeros(24, 256).bfloat16()), ValueError, "phi must have shape [48, 256]"),
    (dict(alpha=torch.zeros(2)), ValueError, "alpha must have shape [3]"),
    (dict(bias=torch.zeros(20)), ValueError, "bias must have shape [24]"),
    (dict(maps="res"), ValueError, "maps must be one of"),
    (dict(maps="pre", phi=torch.zeros(48, 256).bfloat16()), ValueError, "phi must have shape [16, 256]"),
    (dict(), ValueError, "CUDA"),
])
def test_stats_validation(over, exc, words):
    with pytest.raises(exc, match=words.replace("[", r"\[").replace("]", r"\]")):
        mhc_stats(**_cpu_args(**over))


def test_stats_rejects_bad_options():
    with pytest.raises(ValueError, match="sinkhorn_iters"):
        mhc_stats(**_cpu_args(), sinkhorn_iters=-1)
    with pytest.raises(TypeError, match="eps"):
        mhc_stats(**_cpu_args(), eps="1e-6")


def test_mix_validation():
    x = torch.zeros(2, 4, 64).bfloat16()
    with pytest.raises(ValueError, match=r"h must have shape \[2, 24\]"):
        mhc_pre_mix(x, torch.zeros(2, 4))
    with pytest.raises(TypeError, match="h must have dtype float32"):
        mhc_post_mix(x, torch.zeros(2, 24).bfloat16(), torch.zeros(2, 64).bfloat16())
    with pytest.raises(ValueError, match=r"f must have shape \[2, 64\]"):
        mhc_post_mix(x, torch.zeros(2, 24), torch.zeros(2, 32).bfloat16())
    with pytest.raises(ValueError, match="overlap"):  # a shifted view of x's own storage
        buf = torch.zeros(2 * 4 * 64 + 8).bfloat16()
        mhc_post_mix(buf[:512].view(2, 4, 64), torch.zeros(2, 24), torch.zeros(2, 64).bfloat16(),
                     out=buf[8:].view(2, 4, 64))
    with pytest.raises(ValueError, match="CUDA"):
        mhc_pre_mix(x, torch.zeros(2, 24))


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_machine_code(arch):
    h = sass.sass_histogram("mhc_stats", arch, n=4, hidden=7168, sinkhorn_iters=20)
    assert sass.local_memory_ops(h) == 0
    assert sass.count(h, "HMMA") >= 24  # 8 k-steps x 3 n-tiles of m16n8k16 per warp and chunk
    assert sass.count(h, "LDSM") >= 16 and sass.count(h, "LDGSTS") >= 1  # ldmatrix, cp.async
    assert sass.count(h, "ATOMG") >= 1  # the last-CTA counter
    h = sass.sass_histogram("mhc_stats", arch, n=4, hidden=4096, sinkhorn_iters=20, hc_eps=1e-6)  # V4-Flash
    assert sass.local_memory_ops(h) == 0 and sass.count(h, "HMMA") >= 24
    # the decode step's two parts: H_pre (one n-tile: 8 k-steps) and H_post + H_res
    pre = sass.sass_histogram("mhc_stats", arch, n=4, hidden=4096, sinkhorn_iters=20, hc_eps=1e-6, maps="pre")
    rest = sass.sass_histogram("mhc_stats", arch, n=4, hidden=4096, sinkhorn_iters=20, hc_eps=1e-6,
                               maps="post_res")
    # Sinkhorn's 20 iterations x 2n reciprocals live in post_res only (pre: the sigmoid's divide)
    assert sass.local_memory_ops(pre) == 0 and sass.count(pre, "HMMA") == 8 and sass.count(pre, "MUFU.RCP") < 8
    assert sass.local_memory_ops(rest) == 0 and sass.count(rest, "HMMA") >= 24 and sass.count(rest, "MUFU.RCP") >= 160
    # the last CTA reads alpha and the bias from shared memory (staged with the first chunk): its
    # only global loads are the partials' 16-byte vectors -- no round trip for the parameters after them
    assert pre["LDG.E"] == 0 and rest["LDG.E"] == 0 and pre["LDG.E.128"] > 0
    for name, loads in (("mhc_pre_mix", "LDGSTS.E.128"), ("mhc_post_mix", "LDG.E.128")):
        h = sass.sass_histogram(name, arch, n=4, hidden=7168)
        assert sass.local_memory_ops(h) == 0
        assert sass.count(h, "FFMA") == 0  # rounded products: bit-exact with the reference
        assert sass.count(h, loads) >= 4 and sass.count(h, "STG.E.128") >= 1


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_pre_mix_one_round_trip(arch):
    """mhc_pre_mix requests the token's n stream vectors and n weights before its one wait, and
    every product comes after it (as register loads the compiler issued them a pair at a time,
    each pair behind the products of the one before)."""
    text = sass.disassemble(sass.compile_cubin("mhc_pre_mix", arch, n=4, hidden=7168))
    assert sass.global_loads_before(text, "FMUL") == (8, True)


def test_default_workspace_is_reused_per_stream_and_grows():
    """A call without a workspace (the custom op's) reuses one per (device, stream, n) instead
    of allocating per call; a larger T gets a larger one (at least twice) and the old one stays
    alive; another stream gets its own (launches on two streams may overlap)."""
    from cute_kernels import mhc_stats as ms

    dev = torch.device("cpu")
    a = ms.default_workspace(4, 6, dev, 11)
    assert ms.default_workspace(4, 6, dev, 11) is a and ms.default_workspace(4, 64, dev, 11) is a
    b = ms.default_workspace(4, 100, dev, 11)
    assert b is not a and b.max_tokens >= 128 and ms.default_workspace(4, 6, dev, 11) is b
    assert any(r is a for r in ms._RETIRED)  # kept alive: a graph captured with it may replay
    assert ms.default_workspace(4, 6, dev, 12) is not b
    assert ms.default_workspace(2, 6, dev, 11).n == 2
