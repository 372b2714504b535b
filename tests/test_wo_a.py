"""WO-A (token-major grouped low-rank projection): Hopper path on the H200, Blackwell path
by machine code + CPU emulation of its operand views, validation on the CPU."""

import cutlass
import numpy as np
import pytest
import torch

from cute_kernels import catalog, jit
from cute_kernels.testing import sass
from cute_kernels.testing.layouts import offsets
from cute_kernels.wo_a import aot_routes, route, wo_a
from cute_kernels.wo_a_sm90 import WoASm90, wo_a_layouts
from cute_kernels.wo_a_sm100 import WoASm100
from references import gemm_error_bound, rel_err, wo_a_ref

# bf16 output rounding dominates: ||err||/||ref|| ~ 2^-9 / sqrt(3) ~ 1.1e-3 for an exact
# accumulation; 4e-3 leaves room for FP32 accumulation over K <= 2048.
TOL = 4e-3
SHAPES = [(16, 8, 128, 1024), (8, 16, 128, 512), (8, 8, 256, 512), (16, 16, 128, 1024)]  # (G, H/G, Dv, R)


def make(T, G, HG, Dv, R, device):
    o = torch.randn(T, G * HG, Dv, device=device).bfloat16()
    w = (torch.randn(G, R, HG * Dv, device=device) / (HG * Dv) ** 0.5).bfloat16()
    return o, w


def assert_per_element(out, o, w):
    """Every element within :func:`references.gemm_error_bound` (bf16 output rounding plus FP32
    accumulation over K = (H/G) Dv, derived in its docstring) of the float64 product: the count
    of elements outside it must be zero -- a norm-wise tolerance would let a few wrong or
    zeroed elements through."""
    K = w.shape[2]
    err = (out.double().cpu() - wo_a_ref(o, w).double().cpu()).abs()
    bad = int((err > gemm_error_bound(o, w, K)).sum())
    assert bad == 0, f"{bad} of {err.numel()} elements outside the per-element bound"


def check_wo_a(T, G, HG, Dv, R, **kwargs):
    """``wo_a(..., **kwargs)`` on fresh inputs into a NaN-poisoned output: every element
    written and within the per-element bound (:func:`assert_per_element`), and the norm-wise
    error within TOL. Returns the output. This project's kernels
    unless ``backend`` says otherwise (the default route takes cuBLAS inside its measured
    bands: the cuBLAS tests below)."""
    kwargs.setdefault("backend", "cute")
    o, w = make(T, G, HG, Dv, R, "cuda")
    out = torch.full((T, G * R), float("nan"), device="cuda", dtype=torch.bfloat16)
    wo_a(o, w, out=out, **kwargs)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    assert rel_err(out, wo_a_ref(o, w)) < TOL
    assert_per_element(out, o, w)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("G, HG, Dv, R", SHAPES)
@pytest.mark.parametrize("T", [1, 5, 20, 41, 64, 77, 200, 300, 400])
@pytest.mark.parametrize("decode", [None, False])  # this project's route (decode kernels at T <= 16) / the engine
def test_hopper_matches_fp64(seed, G, HG, Dv, R, T, decode):
    out = check_wo_a(T, G, HG, Dv, R, decode_kernel=decode)
    assert out.stride() == (G * R, 1)


#: DeepSeek-V4's WO-A: 8 (Flash) or 16 (Pro) groups of 8 heads x 512 (Dg = 4096), R = 1024
V4_SHAPES = [(8, 8, 512, 1024), (16, 8, 512, 1024)]


@pytest.mark.gpu
@pytest.mark.parametrize("G, HG, Dv, R", V4_SHAPES)
@pytest.mark.parametrize("T", [1, 5, 16, 17, 33, 64, 65, 200, 1000, 4097])
@pytest.mark.parametrize("backend", [None, "cute"])
def test_v4_shapes_every_route_per_element(seed, G, HG, Dv, R, T, backend):
    """V4-Flash / V4-Pro at decode and prefill T through the default route (cuBLAS at T <= 32
    and T = 1000 on the H100 / H200, the engine elsewhere) and this project's kernels alone
    (``backend="cute"``: the decode kernels at T <= 16), output poisoned, every element within
    its own rounding bound (bf16 output, FP32 sum over K = 4096)."""
    o, w = make(T, G, HG, Dv, R, "cuda")
    out = torch.full((T, G * R), float("nan"), device="cuda", dtype=torch.bfloat16)
    wo_a(o, w, out=out, backend=backend)
    torch.cuda.synchronize()
    err = (out.double().cpu() - wo_a_ref(o, w)).abs()
    bound = gemm_error_bound(o, w, HG * Dv)
    assert bool((err <= bound).all()), f"{int((err > bound).sum())} elements out of bound"


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 24, 30, 120])
def test_runtime_small_shape_matches_fp64(seed, T):
    """The decode runtime's test model (spec_decode.config.SMALL: G=4, R=1024, Dg=8 x 512 =
    4096, V4's group width) and one TP4 rank of it (G=1): B x S = 4 x 6 = 24 tokens and its
    neighbours."""
    check_wo_a(T, 4, 8, 512, 1024)
    check_wo_a(T, 1, 8, 512, 1024)


@pytest.mark.gpu
@pytest.mark.parametrize("G, T", [(8, 1100), (8, 2100), (16, 1056), (16, 4097)])
def test_large_t_long_k_routes_match_fp64(seed, G, T):
    """wo_a() at T > 1024 with K = Dg = 2048, on both sides of the pingpong rule (64 x 256
    tiles >= 3 per SM): the cooperative 128 x 256 tile at G=8 T = 1100 (288 tiles), the
    pingpong CTA pairs at 2100 / 1056 / 4097 (528 / 544 / 2064 tiles, T = 4097 ending in a
    one-token tile)."""
    cfg = WoASm90.config_for(T, G, 512, 2048)
    assert cfg.get("pingpong", False) == (T != 1100)
    check_wo_a(T, G, 16, 128, 512)


@pytest.mark.gpu
@pytest.mark.parametrize("G, HG, Dv, R, T", [(G, HG, Dv, R, T) for G, HG, Dv, R in
                                             [(8, 16, 128, 512), (8, 8, 128, 1024), (16, 8, 128, 512)]
                                             for T in (513, 577, 700, 960)] + [(8, 16, 128, 512, 1000),
                                                                                (8, 8, 256, 512, 1024),
                                                                                (16, 8, 128, 1024, 521)])
def test_mid_t_swapped_routes_match_fp64(seed, G, HG, Dv, R, T):
    """wo_a()'s CuTe path at 512 < T <= 960 / 1024 where G * R = 8192 / 4096: 128-row weight
    tiles in CTA pairs, tokens on wgmma N in 144 / 160 / 176 / 240 / 256-token tiles (16-column
    epilogue subtiles at 144 / 176 / 240; T = 513 and 1000: the last tile 81 / 232 tokens deep)."""
    cfg = WoASm90.config_for(T, G, R, HG * Dv)
    assert cfg["swap_ab"] and cfg["tile_m"] == 128 and cfg["cluster_m"] == 2
    assert cfg["tile_n"] == WoASm90.mid_t_token_tile(T, G, R)
    check_wo_a(T, G, HG, Dv, R)


def profiled_kernels(call):
    """The CUDA kernels one ``call()`` launches, by name, from a profile (after one warm-up
    call outside it: compiles, workspaces)."""
    from cute_kernels.profiling import cuda_profile

    call()
    torch.cuda.synchronize()
    with cuda_profile() as prof:
        call()
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA" and e.time_range.elapsed_us() > 0]
    if not kernels:  # a blind profiler, or a call that launched nothing? a control kernel tells
        with cuda_profile() as control:
            torch.ones(1, device="cuda")
            torch.cuda.synchronize()
        if not [e for e in control.events() if e.device_type.name == "CUDA"]:
            pytest.skip("the profiler records no CUDA kernels in this process (CUPTI unavailable: "
                        "compute-sanitizer holds it)")
    return kernels


@pytest.mark.gpu
@pytest.mark.parametrize("T", [5, 64, 320, 4096])  # decode kernel, engine, swapped engine, engine
def test_single_kernel_no_transpose_copy(seed, T):
    """Only the GEMM runs: no transpose/copy kernel in a profile."""
    o, w = make(T, 16, 8, 128, 1024, "cuda")
    out = torch.empty(T, 16 * 1024, device="cuda", dtype=torch.bfloat16)
    kernels = profiled_kernels(lambda: wo_a(o, w, out=out, backend="cute"))
    # exactly one launch, and it is the CuTe GEMM (its mangled name mentions CopyAtom, so
    # identify it by its prefix rather than by the absence of "copy")
    assert len(kernels) == 1 and kernels[0].startswith("kernel_cutlass"), kernels


@pytest.mark.gpu
def test_cuda_graph_replay(seed):
    o, w = make(5, 8, 16, 128, 512, "cuda")
    out = torch.empty(5, 8 * 512, device="cuda", dtype=torch.bfloat16)
    wo_a(o, w, out=out)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        wo_a(o, w, out=out)
    for _ in range(3):
        o.copy_(torch.randn_like(o, dtype=torch.float32).bfloat16())
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(out, wo_a_ref(o, w)) < TOL


def check_engine(T, G, HG, Dv, R, **config):
    """The Hopper engine in ``config``, straight from the kernel cache (no wo_a() dispatch),
    on a poisoned output: every element written, FP32-reference error within TOL."""
    from cute_kernels import jit

    o, w = make(T, G, HG, Dv, R, "cuda")
    out = torch.full((T, G * R), float("nan"), device="cuda", dtype=torch.bfloat16)
    fn = jit.get_kernel("wo_a", "sm_90a", G=G, R=R, Dg=HG * Dv, **config)
    P = jit.gmem_ptr
    fn(P(cutlass.BFloat16, o, 16), P(cutlass.BFloat16, w, 16), P(cutlass.BFloat16, out, 16), jit.i32(T),
       jit.cu_stream())
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    assert rel_err(out, wo_a_ref(o, w)) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [(128, 160), (64, 160), (128, 64), (64, 96), (128, 80), (64, 48)])
@pytest.mark.parametrize("T", [1, 77, 320, 333])
def test_swap_ab_engine_matches_fp64(seed, tile, T):
    """The engine with weight rows on M and tokens on N (M-major C view of token-major y):
    T past the last token tile is clipped, every element of the poisoned output written
    (80 / 48-token tiles: 16-column epilogue subtiles)."""
    check_engine(T, 8, 16, 128, 512, tile_m=tile[0], tile_n=tile[1], swap_ab=True)


@pytest.mark.gpu
@pytest.mark.parametrize("tile, cluster, swap_ab, pingpong, T", [
    ((128, 80), (1, 2), True, False, 320), ((128, 176), (2, 1), True, False, 521), ((128, 240), (2, 1), True, False, 700),
    ((64, 112), (1, 1), False, False, 77), ((64, 176), (2, 1), True, True, 525)])
def test_engine_16_column_subtiles_matches_fp64(seed, tile, cluster, swap_ab, pingpong, T):
    """Tiles an odd multiple of 16 wide (16-column epilogue subtiles): in CTA pairs either way,
    unswapped (N-major C), and in the pingpong schedule's own subtile buffers."""
    check_engine(T, 8, 16, 128, 512, tile_m=tile[0], tile_n=tile[1], cluster_m=cluster[0], cluster_n=cluster[1],
                 swap_ab=swap_ab, pingpong=pingpong)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg, T", [(dict(tile_m=64, tile_n=160, cluster_m=2, swap_ab=True), 320),
                                    (dict(tile_m=128, tile_n=160, cluster_n=2, swap_ab=True), 300),
                                    (dict(tile_m=64, tile_n=64, cluster_n=2), 64),
                                    (dict(tile_m=128, tile_n=256), 1100)])
@pytest.mark.parametrize("hint", ["evict_first", "evict_last"])
def test_engine_weight_l2_hint_matches_fp64(seed, cfg, T, hint):
    """A cache hint on the weight loads (either operand, multicast or not) changes no result."""
    check_engine(T, 8, 16, 128, 512, weight_l2_hint=hint, **cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg, T", [(dict(tile_m=64, tile_n=160, cluster_m=2, swap_ab=True), 320),
                                    (dict(tile_m=128, tile_n=160, cluster_n=2, swap_ab=True), 300),
                                    (dict(tile_m=64, tile_n=64), 64)])
@pytest.mark.parametrize("stages", [2, 5])
def test_engine_max_stages_matches_fp64(seed, cfg, T, stages):
    """Fewer operand stages than fit (the pipeline's phases wrap every 2 / 5 of the 32 k-tiles)
    change no result."""
    check_engine(T, 8, 16, 128, 512, max_stages=stages, weight_l2_hint="evict_first", **cfg)


def test_max_stages_machine_code():
    """A full and an empty barrier per operand stage: eight stages fill shared memory for the
    64 x 160 tile (8 x 28 KiB), ``max_stages=5`` initialises ten barriers."""
    cfg = dict(G=8, R=512, Dg=2048, tile_m=64, tile_n=160, cluster_m=2, swap_ab=True)
    inits = lambda **extra: sass.disassemble(sass.compile_cubin("wo_a", "sm_90a", **cfg, **extra)).count(  # noqa: E731
        "SYNCS.EXCH.64")
    assert (inits(), inits(max_stages=5)) == (16, 10)


@pytest.mark.parametrize("swap_ab, cluster", [(True, (2, 1)), (False, (1, 2))])
def test_weight_l2_hint_machine_code(swap_ab, cluster):
    """Only the weight operand's TMA loads carry a cache policy (``desc[UR..]``; a load
    without one reads ``desc[URZ]``), and none does in the default build."""
    import re

    cfg = dict(G=8, R=512, Dg=2048, tile_m=64, tile_n=64 if not swap_ab else 160, cluster_m=cluster[0],
               cluster_n=cluster[1], swap_ab=swap_ab)
    plain = sass.disassemble(sass.compile_cubin("wo_a", "sm_90a", **cfg))
    hinted = sass.disassemble(sass.compile_cubin("wo_a", "sm_90a", weight_l2_hint="evict_first", **cfg))
    policy = lambda text: [("MULTICAST" in ln, "desc[URZ]" not in ln) for ln in text.splitlines()  # noqa: E731
                           if re.search(r"UTMALDG", ln)]
    assert policy(plain) and not any(p for _, p in policy(plain))
    # the weights are the operand each CTA loads whole (the token tile is the one its pair shares)
    assert policy(hinted) and all(p == (not mc) for mc, p in policy(hinted)), policy(hinted)


@pytest.mark.gpu
@pytest.mark.parametrize("tile, swap_ab, T, pdl", [((64, 256), False, 1000, False), ((128, 160), True, 300, False),
                                                   ((128, 160), True, 333, True)])
def test_engine_two_ctas_per_sm_matches_fp64(seed, tile, swap_ab, T, pdl):
    """Stages sized for two CTAs per SM (``occupancy=2``), a partial last token tile; 128-row
    tiles run without the producer warp (warp 0 loads between its MMAs), also under PDL."""
    check_engine(T, 16, 8, 128, 1024, tile_m=tile[0], tile_n=tile[1], cluster_m=2 if swap_ab else 1,
                 swap_ab=swap_ab, occupancy=2, **({"pdl": True} if pdl else {}))


@pytest.mark.gpu
@pytest.mark.parametrize("tile, cluster, T", [((128, 256), (1, 1), 1100), ((128, 256), (2, 1), 1100),
                                              ((128, 128), (1, 2), 333), ((64, 128), (2, 2), 77),
                                              ((64, 64), (1, 1), 4096)])
def test_engine_clusters_and_raster_matches_fp64(seed, tile, cluster, T):
    """The engine's tile walk: raster groups of 8 cluster rows along M with a partial last
    group (T = 1100: 9 token tiles of 128), CTA pairs and quads multicasting the shared tile,
    a cluster row past the last token tile (T = 77, 2 x 64-row tiles in a pair: one CTA of
    the pair reads only zero-filled rows), and 4096 tokens in 64-row tiles (64 raster groups)."""
    for G, HG, Dv, R in [(16, 8, 128, 1024), (8, 16, 128, 512)]:
        check_engine(T, G, HG, Dv, R, tile_m=tile[0], tile_n=tile[1], cluster_m=cluster[0],
                     cluster_n=cluster[1])


@pytest.mark.gpu
@pytest.mark.parametrize("tile, cluster, swap_ab, T", [((64, 256), (1, 1), False, 1100),
                                                       ((64, 256), (2, 1), False, 1100),
                                                       ((64, 128), (1, 2), False, 77),
                                                       ((64, 160), (2, 1), True, 333),
                                                       ((64, 256), (1, 1), False, 1),
                                                       ((64, 256), (2, 1), False, 4096)])
def test_pingpong_engine_matches_fp64(seed, tile, cluster, swap_ab, T):
    """The persistent pingpong schedule: each CTA walks tiles 132 (clusters) apart, its two
    warp groups taking them in turn -- odd and even tile counts per CTA (T = 1100: 1152 and
    576 tiles), a partial last tile, CTA pairs multicasting across tiles, fewer tiles than
    SMs (T = 1: one tile per CTA, the second warp group idle), ~30 tiles per CTA (T = 4096)."""
    for G, HG, Dv, R in [(16, 8, 128, 1024), (8, 16, 128, 512)]:
        check_engine(T, G, HG, Dv, R, tile_m=tile[0], tile_n=tile[1], cluster_m=cluster[0],
                     cluster_n=cluster[1], swap_ab=swap_ab, pingpong=True)


@pytest.mark.gpu
@pytest.mark.parametrize("cluster_exit", ["barrier", "producer_tail"])
@pytest.mark.parametrize("cfg, T", [
    (dict(tile_m=128, tile_n=160, cluster_m=2, swap_ab=True, occupancy=2), 320),  # inline producer
    (dict(tile_m=128, tile_n=160, cluster_m=2, swap_ab=True), 333),
    (dict(tile_m=64, tile_n=160, cluster_m=2, swap_ab=True), 77),
    (dict(tile_m=128, tile_n=128, cluster_n=2), 333),  # the weight tile multicast instead
    (dict(tile_m=64, tile_n=256, cluster_m=2, pingpong=True), 1100),
])
def test_cluster_exit_matches_fp64(seed, cfg, T, cluster_exit):
    """Both ways a CTA pair leaves, on both kernels: the cluster barrier, or none (each
    producer waits for every stage's release by both CTAs' consumers instead). Three launches
    on fresh inputs per shape: a CTA exiting under its peer's remote arrivals would show up as
    a hang, a fault or a wrong tile."""
    for G, HG, Dv, R in [(16, 8, 128, 1024), (8, 16, 128, 512)]:
        for _ in range(3):
            check_engine(T, G, HG, Dv, R, cluster_exit=cluster_exit, **cfg)


@pytest.mark.gpu
def test_pingpong_graph_replay_fresh_inputs(seed):
    """Replays of one captured pingpong launch pick up new inputs (nothing carried between
    launches in its barriers or pipeline phases)."""
    from cute_kernels import jit

    T, G, HG, Dv, R = 700, 8, 16, 128, 512
    fn = jit.get_kernel("wo_a", "sm_90a", G=G, R=R, Dg=HG * Dv, tile_m=64, tile_n=256, pingpong=True)
    o, w = make(T, G, HG, Dv, R, "cuda")
    out = torch.full((T, G * R), float("nan"), device="cuda", dtype=torch.bfloat16)
    P = jit.gmem_ptr
    stream = torch.cuda.Stream()
    call = lambda: fn(P(cutlass.BFloat16, o, 16), P(cutlass.BFloat16, w, 16), P(cutlass.BFloat16, out, 16),  # noqa: E731
                      jit.i32(T), jit.cu_stream(stream))
    with torch.cuda.stream(stream):
        call()  # compile and warm up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        call()
    for _ in range(3):
        o2, w2 = make(T, G, HG, Dv, R, "cuda")
        o.copy_(o2)
        w.copy_(w2)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        assert rel_err(out, wo_a_ref(o, w)) < TOL


# --------------------------------------------------- Blackwell path on the CPU ---------
def emulate_tiled(o, w, tile_mn, k_tile=64, swap_ab=False):
    """CPU emulation of the kernels' data layout: operands read through the same strided
    views the kernels build (wo_a_layouts), C tiles of tile_mn accumulated in FP32 over
    K tiles in order, one bf16 rounding, written through the token-major C view (M-major
    when ``swap_ab`` puts the weight rows on M)."""
    T, H, Dv = o.shape
    G, R, Dg = w.shape
    (sa, da), (sb, db), (sc, dc) = wo_a_layouts(T, G, R, Dg, swap_ab)
    A = torch.as_strided(w if swap_ab else o, sa, da)
    B = torch.as_strided(o if swap_ab else w, sb, db)
    y = torch.full((T * G * R,), float("nan"), dtype=torch.bfloat16)
    C = torch.as_strided(y, sc, dc)
    M, N = A.shape[0], B.shape[0]
    tm, tn = tile_mn
    for g in range(G):
        for m0 in range(0, M, tm):
            for n0 in range(0, N, tn):
                acc = torch.zeros(min(tm, M - m0), min(tn, N - n0))
                for k0 in range(0, Dg, k_tile):
                    acc += A[m0:m0 + tm, k0:k0 + k_tile, g].float() @ B[n0:n0 + tn, k0:k0 + k_tile, g].float().T
                C[m0:m0 + tm, n0:n0 + tn, g] = acc.bfloat16()
    return y.view(T, G * R)


@pytest.mark.parametrize("T", [1, 5, 130])
def test_blackwell_layout_emulation(seed, T):
    G, HG, Dv, R = 8, 8, 128, 512
    o, w = make(T, G, HG, Dv, R, "cpu")
    y = emulate_tiled(o, w, WoASm100.tile_for(T, G, R))
    assert not torch.isnan(y.float()).any()  # every element written through the C view
    assert rel_err(y, wo_a_ref(o, w)) < TOL


def sm100_gemm_footprint(T, G, R, Dg, tile_mn):
    """Trace the Blackwell engine on the CPU (compiled for sm_100a, never launched) and read
    back, per CTA of its grid, the global coordinates its own layout objects give: A and B as
    its TMA warp loads them over the whole K loop (``partition_gmem``'s views at the CTA's
    tile), C as its epilogue's TMA stores write them (``epilogue_subtiles`` at the tile). The
    TMA tensors the kernel partitions are coordinate tensors over the views' shapes, so the same
    calls are applied to identity tensors of those shapes (cute_kernels.testing.layouts).
    -> ({block: (A, B, C) coordinates}, the views' (shape, stride) as the kernel built them)."""
    import cutlass.cute as cute

    from cute_kernels.gemm.sm100_gemm import Sm100Gemm, epilogue_subtiles
    from cute_kernels.testing.layouts import coords, flatten
    from cute_kernels.wo_a_sm90 import wo_a_views

    gemm, got = Sm100Gemm(tile_mn), {}

    def walk(a, b, c):  # plain Python: loops over the grid at trace time
        tiled_mma = gemm.configure(a, b, c)
        got["views"] = [(flatten(x.layout.shape), flatten(x.layout.stride)) for x in (a, b, c)]
        mA, mB, mC = (cute.make_identity_tensor(x.shape) for x in (a, b, c))
        gx, gy, gz = gemm.grid(c)
        pair = cute.size(tiled_mma.thr_id.shape)
        for bx in range(gx):
            for by in range(gy):
                for bz in range(gz):
                    cta_v, (tm, tn, l) = gemm.cta_tile_coord((bx, by, bz), pair)
                    tCgA, tCgB, tCgC = gemm.partition_gmem(tiled_mma, cta_v, mA, mB, mC)
                    got[(bx, by, bz)] = (coords(tCgA[(None, None, None, tm, None, l)]),
                                         coords(tCgB[(None, None, None, tn, None, l)]),
                                         coords(epilogue_subtiles(tCgC, gemm.epi_tile)[(None,) * 4 + (tm, tn, l)]))

    @cute.jit
    def trace(o_ptr: cute.Pointer, w_ptr: cute.Pointer, y_ptr: cute.Pointer):
        walk(*wo_a_views(o_ptr, w_ptr, y_ptr, T, G, R, Dg))

    ptr = jit.fake_gmem_ptr(cutlass.BFloat16, 16)
    cute.compile(trace, ptr, ptr, ptr, options="--gpu-arch=sm_100a")
    return got, got.pop("views")


@pytest.mark.parametrize("T, G, R, Dg, tile", [
    (1, 2, 256, 128, (128, 128)), (5, 3, 128, 192, (128, 64)), (130, 2, 256, 128, (128, 128)),
    (130, 2, 512, 128, (256, 256)), (300, 1, 256, 256, (256, 128)), (77, 2, 160, 64, (256, 32)),
])
def test_blackwell_engine_layouts_cover_the_product(T, G, R, Dg, tile):
    """The Blackwell WO-A engine's own layout objects, evaluated on the CPU: every element of
    token-major ``y`` is written by exactly one CTA's epilogue (rows / columns past the tensor
    clipped, as TMA does); the C block of each CTA (pair) is exactly (its A rows) x (its B rows)
    at its group, with all of K read once for each -- C[t, r, g] = sum_k A[t, k, g] B[r, k, g] --
    and the views the kernel builds put A at ``o[t, g*Dg + k]``, B at ``wo_a[g, r, k]``, C at
    ``y[t, g*R + r]`` (the definitions, as ``torch.arange`` views)."""
    blocks, views = sm100_gemm_footprint(T, G, R, Dg, tile)
    pair = 2 if tile[0] == 256 else 1
    written = []
    tiles: dict = {}
    for (bx, by, bz), (A, B, C) in blocks.items():
        C = C[(C[:, 0] < T) & (C[:, 1] < R)]
        A = A[(A[:, 0] < T) & (A[:, 1] < Dg)]
        B = B[(B[:, 0] < R) & (B[:, 1] < Dg)]
        assert (A[:, 2] == bz).all() and (B[:, 2] == bz).all() and (C[:, 2] == bz).all()
        # this CTA's A rows are its C rows, each with all of K exactly once
        rows = np.unique(C[:, 0])
        assert np.array_equal(np.unique(A[:, 0]), rows)
        assert len(np.unique(A[:, 0] * Dg + A[:, 1])) == len(A) == len(rows) * Dg
        tiles.setdefault((bx // pair, by, bz), []).append((B, C))
        written.append(C)
    for (_, _, l), parts in tiles.items():
        B = np.concatenate([p[0] for p in parts])
        C = np.concatenate([p[1] for p in parts])
        cols = np.unique(C[:, 1])
        # the pair's B rows (each CTA loads its half) are the tile's C columns, all K, once
        assert np.array_equal(np.unique(B[:, 0]), cols)
        assert len(np.unique(B[:, 0] * Dg + B[:, 1])) == len(B) == len(cols) * Dg
        assert len(C) == len(np.unique(C[:, 0])) * len(cols)  # a full (rows x cols) block
    C = np.concatenate(written)
    key = (C[:, 2] * T + C[:, 0]) * R + C[:, 1]
    assert len(key) == T * R * G and len(np.unique(key)) == T * R * G, "y not written exactly once"
    # the views, against the operands' definitions
    (sa, da), (sb, db), (sc, dc) = views
    t, k, g, r = (np.arange(n)[:, None] for n in (T, Dg, G, R))
    o_def = torch.arange(T * G * Dg).view(T, G * Dg).numpy()
    w_def = torch.arange(G * R * Dg).view(G, R, Dg).numpy()
    y_def = torch.arange(T * G * R).view(T, G * R).numpy()
    for gi in range(G):
        xyz = np.stack(np.broadcast_arrays(t, k.T, gi), -1).reshape(-1, 3)
        assert np.array_equal(offsets(xyz, sa, da), o_def[xyz[:, 0], gi * Dg + xyz[:, 1]])
        xyz = np.stack(np.broadcast_arrays(r, k.T, gi), -1).reshape(-1, 3)
        assert np.array_equal(offsets(xyz, sb, db), w_def[gi, xyz[:, 0], xyz[:, 1]])
        xyz = np.stack(np.broadcast_arrays(t, r.T, gi), -1).reshape(-1, 3)
        assert np.array_equal(offsets(xyz, sc, dc), y_def[xyz[:, 0], gi * R + xyz[:, 1]])


@pytest.mark.parametrize("T", [1, 77, 320])
def test_swap_ab_layout_emulation(seed, T):
    """Swapped operands: weight rows on M, tokens on N, C an M-major view of token-major y."""
    G, HG, Dv, R = 8, 8, 128, 512
    o, w = make(T, G, HG, Dv, R, "cpu")
    y = emulate_tiled(o, w, (128, 160), swap_ab=True)
    assert not torch.isnan(y.float()).any()
    assert rel_err(y, wo_a_ref(o, w)) < TOL


@pytest.mark.parametrize("T", [400, 513, 700, 1000])
def test_mid_t_route_layout_emulation(seed, T):
    """The Hopper route's own swapped tile past T = 256 (token tiles in steps of 16: 208 / 144 /
    176 / 256 here, the last one partial), emulated on the CPU: every element of y written
    once through the M-major C view, within the FP32 tolerance."""
    G, HG, Dv, R = 8, 8, 128, 512
    cfg = WoASm90.config_for(T, G, R, HG * Dv)
    assert cfg["swap_ab"] and T % cfg["tile_n"]
    o, w = make(T, G, HG, Dv, R, "cpu")
    y = emulate_tiled(o, w, (cfg["tile_m"], cfg["tile_n"]), swap_ab=True)
    assert not torch.isnan(y.float()).any()
    assert rel_err(y, wo_a_ref(o, w)) < TOL


@pytest.mark.parametrize("tile, cluster_m", [((128, 160), 2), ((64, 96), 1)])
@pytest.mark.parametrize("pdl", [False, True])
def test_swap_ab_machine_code(tile, cluster_m, pdl):
    """Tokens on wgmma N: a 160- or 96-wide HGMMA, TMA in and out (the token tile multicast
    to a CTA pair), no spills; under PDL the weights (now A) still load before the one
    grid-dependency wait (and the consumers wait before their stores)."""
    h = sass.sass_histogram("wo_a", "sm_90a", G=8, R=512, Dg=2048, tile_m=tile[0], tile_n=tile[1], swap_ab=True,
                            cluster_m=cluster_m, **({"pdl": True} if pdl else {}))
    assert sass.count(h, f"HGMMA.64x{tile[1]}x16.F32.BF16") >= 1, h
    assert sass.count(h, "UTMALDG") >= 2 and sass.count(h, "UTMASTG") >= 1 and sass.local_memory_ops(h) == 0
    assert (sass.count(h, "UTMALDG.3D.MULTICAST") >= 1) == (cluster_m == 2)
    assert sass.count(h, "ACQBULK") == (2 if pdl else 0) and sass.count(h, "PREEXIT") == (1 if pdl else 0)


@pytest.mark.parametrize("tile_n, epi_n", [(160, 32), (176, 16), (240, 16)])
def test_16_column_subtiles_machine_code(tile_n, epi_n):
    """A token tile an odd multiple of 16 wide: one wgmma of that width, its epilogue in
    16-column subtiles (twice the TMA stores per column of a 32-column build), no spills."""
    h = sass.sass_histogram("wo_a", "sm_90a", G=8, R=512, Dg=2048, tile_m=128, tile_n=tile_n, cluster_m=2,
                            swap_ab=True)
    assert sass.count(h, f"HGMMA.64x{tile_n}x16.F32.BF16") >= 1, h
    assert sass.count(h, "UTMASTG") == 2 * (tile_n // epi_n) and sass.local_memory_ops(h) == 0, h


@pytest.mark.parametrize("cluster_m, swap_ab", [(1, False), (2, False), (2, True)])
def test_pingpong_machine_code(cluster_m, swap_ab):
    """The pingpong schedule: 64 x 256 (or 64 x 160 token) HGMMAs, TMA in (multicast in a CTA
    pair) and out, the ordering barrier's arrive, no spills, and a register count that lets
    its 9 warps launch (288 threads x regs <= 64K: 224 at most)."""
    tile_n = 160 if swap_ab else 256
    cfg = dict(G=8, R=1024, Dg=1024, tile_m=64, tile_n=tile_n, cluster_m=cluster_m, swap_ab=swap_ab, pingpong=True)
    h = sass.sass_histogram("wo_a", "sm_90a", **cfg)
    assert sass.count(h, f"HGMMA.64x{tile_n}x16.F32.BF16") >= 1, h
    assert sass.count(h, "UTMALDG") >= 2 and sass.count(h, "UTMASTG") >= 1 and sass.local_memory_ops(h) == 0
    assert (sass.count(h, "UTMALDG.3D.MULTICAST") >= 1) == (cluster_m == 2)
    assert sass.count(h, "BAR.ARV") >= 1
    (regs,) = sass.register_counts(sass.compile_cubin("wo_a", "sm_90a", **cfg)).values()
    assert regs <= 224, regs


@pytest.mark.parametrize("cfg", [dict(tile_m=128, tile_n=160, swap_ab=True, occupancy=2),
                                 dict(tile_m=64, tile_n=160, swap_ab=True),
                                 dict(tile_m=64, tile_n=256, pingpong=True)])
def test_cluster_exit_machine_code(cfg):
    """``cluster_exit``: the barrier exit meets the cluster twice (after the barriers' init and
    at the end), with the release fence (MEMBAR.ALL.GPU + ERRBAR) its arrive implies; the
    producer tail leaves only the init's cluster barrier and no ERRBAR, and polls the empty
    barriers instead."""
    cfg = dict(G=16, R=1024, Dg=1024, cluster_m=2, **cfg)
    h_bar = sass.sass_histogram("wo_a", "sm_90a", **cfg, cluster_exit="barrier")
    h_tail = sass.sass_histogram("wo_a", "sm_90a", **cfg, cluster_exit="producer_tail")
    assert sass.count(h_bar, "UCGABAR_ARV") >= 2 and sass.count(h_bar, "ERRBAR") >= 1, h_bar
    assert sass.count(h_tail, "UCGABAR_ARV") == 1 and sass.count(h_tail, "UCGABAR_WAIT") == 1, h_tail
    assert sass.count(h_tail, "ERRBAR") == 0, h_tail
    assert sass.count(h_tail, "SYNCS.PHASECHK") > sass.count(h_bar, "SYNCS.PHASECHK")
    assert sass.local_memory_ops(h_tail) == 0


@pytest.mark.parametrize("tile", [(128, 160), (64, 224), (128, 256)])
def test_engine_two_ctas_per_sm_fit(tile):
    """occupancy=2: the stage count leaves each of two CTAs its half of the SM's 228 KiB less
    the 1 KiB the hardware reserves per CTA, and a 128-row CTA is its 8 consumer warps (no
    producer warp) at <= 128 registers, so two CTAs' 16 warps fit the SM's four 16K-register
    sub-partitions -- past either the launch would silently run one CTA per SM."""
    import cutlass.cute as cute

    obj, args = catalog.kernels()["wo_a"].build("sm_90a", G=16, R=1024, Dg=1024, tile_m=tile[0], tile_n=tile[1],
                                             swap_ab=True, occupancy=2)
    cute.compile(obj, *args, options="--gpu-arch=sm_90a")
    assert obj.gemm.stages >= 2
    assert obj.gemm.shared_storage.size_in_bytes() <= (228 * 1024 - 2 * 1024) // 2
    if tile == (128, 160):  # wo_a()'s config for G=16 R=1024 at 256 < T <= 320
        assert obj.gemm.threads == 256
        cubin = sass.compile_cubin("wo_a", "sm_90a", G=16, R=1024, Dg=1024, tile_m=128, tile_n=160, swap_ab=True,
                                   cluster_m=2, occupancy=2)
        (regs,) = sass.register_counts(cubin).values()
        assert regs <= 128, regs


@pytest.mark.parametrize("arch, tile, expect", [
    ("sm_100a", (128, 128), {"UTCHMMA": 1, "LDTM": 1, "UTMALDG": 1, "UTMASTG": 1}),
    ("sm_100a", (256, 256), {"UTCHMMA.2CTA": 1, "UTMALDG": 1, "LDTM": 1, "UTMASTG": 1}),
    ("sm_90a", (64, 128), {"HGMMA.64x128x16.F32.BF16": 1, "UTMALDG": 1, "UTMASTG": 1}),
    ("sm_90a", (128, 256), {"HGMMA.64x256x16.F32.BF16": 1, "UTMALDG": 1, "UTMASTG": 1}),
    ("sm_90a", (64, 256), {"HGMMA.64x256x16.F32.BF16": 1, "UTMALDG": 1, "UTMASTG": 1}),
])
def test_machine_code(arch, tile, expect):
    h = sass.sass_histogram("wo_a", arch, G=16, R=1024, Dg=1024, tile_m=tile[0], tile_n=tile[1])
    for mnemonic, at_least in expect.items():
        assert sass.count(h, mnemonic) >= at_least, (mnemonic, h)
    assert sass.local_memory_ops(h) == 0


@pytest.mark.parametrize("cluster", [(2, 1), (1, 2)])
def test_hopper_cluster_variant_multicasts(cluster):
    """The tuning probe's clustered Hopper engine: the shared operand tile arrives by TMA
    multicast; the default (1, 1) build names the shipped artifact (no cluster in its key)."""
    h = sass.sass_histogram("wo_a", "sm_90a", G=16, R=1024, Dg=1024, tile_m=128, tile_n=256, cluster_m=cluster[0],
                            cluster_n=cluster[1])
    assert sass.count(h, "UTMALDG.3D.MULTICAST") >= 1 and sass.count(h, "HGMMA.64x256x16.F32.BF16") >= 1, h
    assert sass.local_memory_ops(h) == 0

    k = catalog.kernels()["wo_a"]
    assert k.canonical_config(dict(G=16, R=1024, Dg=1024, tile_m=128, tile_n=256, cluster_m=1, cluster_n=1)) == \
        dict(G=16, R=1024, Dg=1024, tile_m=128, tile_n=256)
    with pytest.raises(ValueError, match="only the Hopper path takes a cluster"):
        k.build("sm_100a", G=16, R=1024, Dg=1024, tile_m=128, tile_n=256, cluster_m=2)


# ------------------------------------------------------------ validation (CPU) --------
@pytest.mark.parametrize("o, w, words", [
    (torch.zeros(2, 16, 128), torch.zeros(8, 512, 256).bfloat16(), "o must have dtype bfloat16"),
    (torch.zeros(2, 16, 128).bfloat16(), torch.zeros(3, 512, 256).bfloat16(), "not divisible by G"),
    (torch.zeros(2, 16, 128).bfloat16(), torch.zeros(8, 512, 512).bfloat16(), r"must equal \(H/G\)\*Dv"),
    (torch.zeros(2, 16, 128).bfloat16(), torch.zeros(8, 500, 256).bfloat16(), "multiples of 64"),
    (torch.zeros(2, 16, 128).bfloat16(), torch.zeros(8, 512, 256).bfloat16(), "CUDA"),
    (torch.zeros(2, 128, 16).bfloat16().transpose(1, 2), torch.zeros(8, 512, 256).bfloat16(), "contiguous"),
    (torch.empty(140_000, 128, 128, dtype=torch.bfloat16, device="meta"),  # 2.3e9 elements: no memory (meta)
     torch.empty(16, 1024, 1024, dtype=torch.bfloat16, device="meta"), r"2\*\*31"),
])
def test_bad_arguments(o, w, words):
    with pytest.raises((TypeError, ValueError), match=words):
        wo_a(o, w)


def test_bad_decode_kernel_value():
    o, w = torch.zeros(2, 16, 128).bfloat16(), torch.zeros(8, 512, 256).bfloat16()
    with pytest.raises(ValueError, match="decode_kernel='fast'"):
        wo_a(o, w, decode_kernel="fast")


@pytest.mark.gpu
def test_wgmma_decode_kernel_needs_hopper_and_t_64():
    """``decode_kernel="wgmma"`` on a Blackwell arch or above 64 tokens: an error, before any launch."""
    o, w = make(5, 8, 16, 128, 512, "cuda")
    with pytest.raises(ValueError, match="needs a Hopper"):
        wo_a(o, w, decode_kernel="wgmma", arch="sm_100a")
    o, w = make(65, 8, 16, 128, 512, "cuda")
    with pytest.raises(ValueError, match="T=65"):
        wo_a(o, w, decode_kernel="wgmma")


@pytest.mark.parametrize("engine, args, kwargs, words", [
    ("sm90", ((96, 128),), {}, "tile_m must be 64 or 128"),
    ("sm90", ((128, 40),), {}, "tile_n must be a multiple of 16"),
    ("sm90", ((128, 288),), {}, "tile_n must be a multiple of 16"),
    ("sm90", ((128, 128), (4, 1)), {}, "cluster_mn must be 1 or 2"),
    ("sm90", ((128, 128),), {"occupancy": 3}, "occupancy must be 1 or 2"),
    ("sm90", ((128, 128),), {"pdl_early_operand": "c"}, "pdl_early_operand"),
    ("sm90", ((128, 256),), {"pingpong": True}, "pingpong runs 64-row tiles"),
    ("sm90", ((64, 256),), {"pingpong": True, "pdl": True}, "without PDL"),
    ("sm90", ((64, 256),), {"pingpong": True, "occupancy": 2}, "one persistent CTA per SM"),
    ("sm90", ((64, 256),), {"pingpong": True, "sm_count": 0}, "sm_count"),
    ("sm90", ((128, 128), (2, 1)), {"cluster_exit": "fence"}, "cluster_exit must be"),
    ("sm90", ((128, 128),), {"l2_hint_b": "evict"}, "l2_hint_b must be None or one of"),
    ("sm90", ((128, 128),), {"max_stages": 1}, "max_stages must be None or >= 2"),
    ("sm100", ((64, 128),), {}, "tile_m must be 128"),
    ("sm100", ((128, 40),), {}, "tile_n must be a multiple of 32"),
])
def test_engine_bad_configs(engine, args, kwargs, words):
    """The engines reject an unsupported tile, cluster or occupancy when configured, naming it."""
    from cute_kernels.gemm.sm90_gemm import Sm90Gemm
    from cute_kernels.gemm.sm100_gemm import Sm100Gemm

    with pytest.raises(ValueError, match=words):
        (Sm90Gemm if engine == "sm90" else Sm100Gemm)(*args, **kwargs)


def test_engine_warp_roles():
    """A producer warp after the consumer warp groups, except for 128-row tiles at two CTAs per
    SM (8 warps, warp 0 loads); a CTA pair for 256-row Blackwell tiles."""
    from cute_kernels.gemm.sm90_gemm import Sm90Gemm
    from cute_kernels.gemm.sm100_gemm import Sm100Gemm

    assert (Sm90Gemm((64, 128)).threads, Sm90Gemm((64, 128)).producer_warp) == (160, 4)
    assert (Sm90Gemm((128, 256)).threads, Sm90Gemm((128, 256)).producer_warp) == (288, 8)
    g = Sm90Gemm((128, 160), (2, 1), occupancy=2)
    assert g.inline_producer and (g.threads, g.producer_warp) == (256, 0)
    assert not Sm90Gemm((64, 160), occupancy=2).inline_producer
    g = Sm90Gemm((64, 256), pingpong=True)  # two consumer warp groups on alternate 64-row tiles
    assert (g.consumer_wgs, g.threads, g.producer_warp) == (2, 288, 8)
    # their own epilogue subtiles, 2 x 2 x (64 x 32) bf16, leave 5 stages of 64x64 + 256x64
    assert g.epilogue_bytes(16) == 16 * 1024 and g.stages_for(64, 16, 16) == 5
    # a CTA pair leaves by the producer tail, except the persistent pingpong CTA
    assert g.cluster_exit == "barrier" and Sm90Gemm((128, 160), (2, 1)).cluster_exit == "producer_tail"
    assert Sm100Gemm((256, 256)).cluster_mn == (2, 1) and Sm100Gemm((128, 128)).cluster_mn == (1, 1)


def test_tile_heuristics():
    assert WoASm90.tile_for(1, 16, 1024) == (64, 128)  # 128 CTAs for 132 SMs
    assert WoASm90.tile_for(1, 8, 512) == (64, 64)
    assert WoASm90.tile_for(4096, 16, 1024) == (128, 256)
    assert WoASm90.tile_for(320, 8, 512) == (64, 256)  # measured 16.1 vs 23.7 us (128x256)
    assert WoASm90.tile_for(320, 8, 1024) == (128, 256)
    assert WoASm100.tile_for(4096, 16, 1024) == (256, 256)


def test_launch_configs():
    """wo_a()'s configs by the properties config_for's docstring states (its tuned tiles are
    measured in bench/bench_wo_a.py, not pinned here): at every T over V3 and V4 shapes, with
    and without PDL -- the weights' evict_first L2 hint at 32 < T <= 512 (and on the swapped
    tiles above), at most MID_T_MAX_STAGES operand stages only at 256 < T <= 512 with one CTA
    per SM, the persistent pingpong schedule only above 512 tokens and never under PDL;
    swapped token tiles the fewest legal ones, each padded by less than one 16-token step; CTA
    pairs never leave half a cluster idle."""
    hi = WoASm90.SWAP_AB_T[1]
    for G, R, Dg in ((8, 512, 2048), (16, 1024, 1024), (16, 512, 2048), (8, 1024, 4096), (16, 1024, 4096)):
        for pdl in (False, True):
            for T in list(range(1, 1100, 3)) + [4096, 16384]:
                cfg = WoASm90.config_for(T, G, R, Dg, pdl=pdl)
                where = (T, G, R, Dg, pdl, cfg)
                hinted = 32 < T and (T <= hi or bool(cfg.get("swap_ab")))
                assert (cfg.get("weight_l2_hint") == "evict_first") == hinted, where
                if "max_stages" in cfg:
                    assert cfg["max_stages"] == WoASm90.MID_T_MAX_STAGES and 256 < T <= hi, where
                    assert cfg.get("occupancy", 1) == 1, where
                if cfg.get("pingpong"):
                    assert T > hi and not pdl and (cfg["tile_m"], cfg["tile_n"]) == (64, 256), where
                if cfg.get("swap_ab"):
                    tn = cfg["tile_n"]
                    assert tn % 16 == 0 and tn <= 256 and (-(-T // tn)) * tn - T < 16 * -(-T // tn), where
                assert (R // cfg["tile_m"]) % cfg.get("cluster_m", 1) == 0 or not cfg.get("swap_ab"), where
    assert WoASm90.config_for(320, 16, 1024, 1024) == WoASm90.config_for(320, 16, 1024)  # Dg matters above 512 only
    for G, R in [(8, 512), (8, 1024), (16, 512), (16, 1024)]:
        for T in range(513, WoASm90.mid_t_swap_max(G, R) + 1):
            cfg = WoASm90.config_for(T, G, R)
            tn, n = cfg["tile_n"], -(-T // cfg["tile_n"])
            assert cfg["swap_ab"] and tn % 16 == 0 and tn <= 256 and n in (-(-T // 256), -(-T // 256) + 1)
            assert n * tn - T < 16 * n and (R // 128) % 2 == 0
    for T in range(65, 513):  # the fewest legal token tiles, each padded by less than one 16-token step
        for G, R in [(8, 512), (16, 1024)]:
            cfg = WoASm90.config_for(T, G, R)
            tn, n = cfg["tile_n"], -(-T // cfg["tile_n"])
            assert tn % 16 == 0 and tn <= 256 and n in (-(-T // 256), 2 * -(-T // 256)) and n * tn - T < 16 * n
            assert (R // cfg["tile_m"]) % cfg["cluster_m"] == 0  # CTA pairs along R: no idle half-cluster
            assert n % cfg.get("cluster_n", 1) == 0  # pairs along T: no idle half-cluster


@pytest.mark.gpu
@pytest.mark.parametrize("G, HG, Dv, R", SHAPES)
@pytest.mark.parametrize("T", [1, 5, 16, 17, 32, 37, 64])
def test_decode_kernel_matches_fp64(seed, G, HG, Dv, R, T):
    """The weight-streaming decode kernel through wo_a (its own {bm, bn, splits, stages} plan)."""
    check_wo_a(T, G, HG, Dv, R, decode_kernel=True)


@pytest.mark.gpu
@pytest.mark.parametrize("bm, splits, bn, stages", [
    (16, 1, 64, 4), (16, 2, 64, 4), (16, 8, 64, 4), (64, 1, 64, 4), (64, 4, 64, 4), (16, 1, 64, 6), (16, 1, 32, 9),
    (16, 2, 32, 6), (64, 2, 32, 4), (16, 4, 32, 3), (16, 1, 32, 6), (32, 1, 32, 6), (32, 2, 64, 4), (32, 1, 64, 6)])
def test_decode_kernel_every_split_and_graph_replay(seed, bm, splits, bn, stages):
    """Each token tile, column tile, split count and pipeline depth (deeper than the CTA's K
    slices included), launched twice eagerly and replayed in a graph with fresh inputs: the
    last-CTA counters re-zero themselves and the sums stay exact."""
    _check_decode_config(bm=bm, splits=splits, bn=bn, stages=stages)


def _check_decode_config(**cfg):
    _check_decode_build("wo_a_decode", {16: 3, 32: 29, 64: 41}[cfg["bm"]], 8, 8, 128, 512, max_splits=8, **cfg)


def _check_decode_build(kernel, T, G, HG, Dv, R, max_splits, **cfg):
    """One decode kernel build (``wo_a_decode``: split-K through a workspace; ``wo_a_decode_swap_ab``:
    none) against float64: launched twice eagerly into a poisoned output (the last-split
    counters re-zero themselves), then replayed in a graph with fresh inputs."""
    from cute_kernels import jit
    from cute_kernels.wo_a_decode import WoADecodeWorkspace

    fn = jit.get_kernel(kernel, "sm_90a", G=G, R=R, Dg=HG * Dv, **cfg)
    ws = WoADecodeWorkspace(G, R, max_splits=max_splits)
    o, w = make(T, G, HG, Dv, R, "cuda")
    out = torch.empty(T, G * R, device="cuda", dtype=torch.bfloat16)
    P = jit.gmem_ptr

    def launch(stream):
        if kernel == "wo_a_decode_swap_ab":
            fn(P(cutlass.BFloat16, o, 16), P(cutlass.BFloat16, w, 16), P(cutlass.BFloat16, out, 4), jit.i32(T),
               jit.cu_stream(stream))
        else:
            fn(P(cutlass.BFloat16, o, 16), P(cutlass.BFloat16, w, 16), P(cutlass.BFloat16, out, 4),
               P(cutlass.Float32, ws.partials, 4), P(cutlass.Int32, ws.counters, 4), jit.i32(T),
               jit.cu_stream(stream))

    for _ in range(2):
        out.fill_(float("nan"))
        launch(None)
        torch.cuda.synchronize()
        assert rel_err(out, wo_a_ref(o, w)) < TOL
    assert int(ws.counters.abs().sum()) == 0
    s = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        launch(s)
    o2, w2 = make(T, G, HG, Dv, R, "cuda")
    o.copy_(o2), w.copy_(w2)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    assert rel_err(out, wo_a_ref(o, w)) < TOL


def replay_fresh(g, srcs, outs, w, expect=None):
    """Replay graph ``g`` twice, each time after refreshing the inputs ``srcs`` (copied into
    the kernels' ``o`` inside the graph) and poisoning ``outs``: output ``i`` must be the
    product of ``srcs[expect[i]]`` (default: ``srcs[i]``) with ``w``."""
    expect = list(range(len(outs))) if expect is None else expect
    for _ in range(2):
        for src in srcs:
            src.normal_()
        for out in outs:
            out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        for i, out in enumerate(outs):
            assert rel_err(out, wo_a_ref(srcs[expect[i]], w)) < TOL, i


@pytest.mark.gpu
@pytest.mark.parametrize("T, decode", [(1, True), (5, True), (37, True), (5, False), (64, False), (77, False)])
def test_pdl_after_a_writer_and_back_to_back(seed, T, decode):
    """The programmatic-dependent launch (decode kernel and TMA/wgmma engine) reads ``o``
    only after the kernel before it has finished: a graph of (copy fresh inputs into ``o``, WO-A with pdl) x 4, sharing one ``o``,
    one workspace and one output per step, must give every step's own product. Back-to-back
    PDL launches (the last two) must not race on the output or the split partials."""
    G, HG, Dv, R = 8, 8, 256, 512  # decode kernel at T = 37: the plan splits K (workspace in use)
    o, w = make(T, G, HG, Dv, R, "cuda")
    srcs = [make(T, G, HG, Dv, R, "cuda")[0] for _ in range(4)]
    outs = [torch.empty(T, G * R, device="cuda", dtype=torch.bfloat16) for _ in range(5)]
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        wo_a(o, w, out=outs[0], decode_kernel=decode, pdl=True, stream=s)  # compile outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for i, src in enumerate(srcs):
            o.copy_(src)
            wo_a(o, w, out=outs[i], decode_kernel=decode, pdl=True, stream=s)
        wo_a(o, w, out=outs[4], decode_kernel=decode, pdl=True, stream=s)
    replay_fresh(g, srcs, outs, w, [0, 1, 2, 3, 3])


@pytest.mark.gpu
@pytest.mark.parametrize("G, HG, Dv, R", [(16, 16, 128, 512), (8, 8, 128, 1024), (16, 8, 128, 1024)])
@pytest.mark.parametrize("T", [33, 41, 64, 300, 320])
@pytest.mark.parametrize("pdl", [False, True])
def test_engine_pairs_through_wo_a(seed, G, HG, Dv, R, T, pdl):
    """The CTA pairs through wo_a() -- 64-row (T, R) tiles in pairs along R at 32 < T <= 64, swapped
    128x160 pairs along T at T = 300 / 320 -- eager and as a programmatic dependent, against
    float64 with a poisoned output."""
    check_wo_a(T, G, HG, Dv, R, pdl=pdl)


def test_engine_config_at_33_to_64_tokens():
    """Where 64-row weight tiles leave most SMs idle (G=8 R=512), 32 < T <= 64 runs swapped
    64 x 32 tiles in CTA pairs along T sharing each weight tile; elsewhere 64-row (T, R) tiles in
    CTA pairs along R sharing the token tile."""
    ef = dict(weight_l2_hint="evict_first")
    for T in (33, 41, 64):
        assert WoASm90.config_for(T, 8, 512, 2048) == dict(tile_m=64, tile_n=32, cluster_n=2, swap_ab=True, **ef)
        assert WoASm90.config_for(T, 16, 512, 2048) == dict(tile_m=64, tile_n=64, cluster_n=2, **ef)
        assert WoASm90.config_for(T, 8, 1024, 1024) == dict(tile_m=64, tile_n=64, cluster_n=2, **ef)
        assert WoASm90.config_for(T, 16, 1024, 1024) == dict(tile_m=64, tile_n=128, cluster_n=2, **ef)
    assert WoASm90.config_for(32, 8, 512, 2048) == dict(tile_m=64, tile_n=64)  # one token tile: no pair
    assert WoASm90.config_for(32, 16, 512, 2048) == dict(tile_m=64, tile_n=64)  # not measured below 33


def test_decode_plan():
    """plan()'s properties at every decode T over V3- and V4-like shapes and SM counts (not its
    tuned choices, which bench/bench_wo_a_fp8.py and docs/wo_a.md justify): a config the kernel
    implements and shared memory holds; the smallest token tile covering T; K splits a power of
    two dividing the K slices, only to fill one wave, their FP32 partials at most 1/4 of the
    weight bytes; no deeper pipeline than the K slices need beyond the default depth."""
    from cute_kernels.wo_a_decode import BK, SMEM_PER_CTA, STAGES, WoADecode, plan, smem_bytes

    for G, R, Dg in ((2, 512, 1024), (8, 512, 2048), (16, 1024, 1024), (8, 1024, 4096), (16, 1024, 4096)):
        for num_sms in (16, 78, 132, 148):
            for T in range(1, 65):
                c = plan(T, G, R, Dg, num_sms=num_sms)
                where = (T, G, R, Dg, num_sms, c)
                assert WoADecode.can_implement(T, G, R, Dg, c["splits"], c["bn"]), where
                assert smem_bytes(c["bm"], c["stages"], c["bn"]) <= SMEM_PER_CTA, where
                assert c["bm"] == min(b for b in (16, 32, 64) if b >= T), where
                if c["splits"] > 1:
                    assert G * R // c["bn"] * c["splits"] <= 1.1 * num_sms, where
                    assert 16 * c["splits"] * T <= Dg, where
                assert 2 <= c["stages"] <= max(STAGES, Dg // BK // c["splits"] + 1), where


def test_decode_kernel_config_errors():
    from cute_kernels import jit
    with pytest.raises(ValueError, match="stages=12 with bm=64"):  # 12 x 34.8 KB of shared memory
        jit.get_kernel("wo_a_decode", "sm_90a", G=8, R=512, Dg=1024, bm=64, stages=12, use_disk=False)
    with pytest.raises(ValueError, match="bn=48"):
        jit.get_kernel("wo_a_decode", "sm_90a", G=8, R=512, Dg=1024, bm=16, bn=48, use_disk=False)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("bm, splits, bn, stages", [(16, 4, 64, 4), (64, 1, 64, 4), (16, 1, 32, 9), (32, 1, 32, 6)])
def test_decode_kernel_machine_code(arch, bm, splits, bn, stages):
    """ldmatrix, warp MMAs and cp.async, no spills."""
    h = sass.sass_histogram("wo_a_decode", arch, G=16, R=1024, Dg=2048, bm=bm, splits=splits, bn=bn, stages=stages)
    per_k_slice = bm * bn // (16 * 8 * 4) * (128 // 16)  # m16n8k16 per warp (4 warps) over a 128-wide K slice
    assert sass.count(h, "HMMA") >= per_k_slice and sass.count(h, "LDSM") >= 1 and sass.count(h, "LDGSTS") >= 1
    assert sass.local_memory_ops(h) == 0
    assert sass.count(h, "ACQBULK") == 0  # no grid-dependency wait unless asked


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_decode_kernel_pdl_machine_code(arch):
    """The PDL variant waits on the previous grid (griddepcontrol.wait -> ACQBULK) and lets
    the next one launch (griddepcontrol.launch_dependents -> PREEXIT), once each."""
    h = sass.sass_histogram("wo_a_decode", arch, G=8, R=512, Dg=2048, bm=16, splits=4, pdl=True)
    assert sass.count(h, "ACQBULK") == 1 and sass.count(h, "PREEXIT") == 1
    assert sass.count(h, "HMMA") >= 16 and sass.local_memory_ops(h) == 0


@pytest.mark.parametrize("cfg", [dict(tile_m=64, tile_n=64), dict(tile_m=128, tile_n=256, cluster_m=2)])
def test_engine_pdl_machine_code(cfg):
    """The Hopper engine's PDL build: grid-dependency waits (the TMA producer's, between the
    prologue's weight and activation loads, and the consumers' before their stores) and one
    early launch of dependents; still TMA + wgmma, no spills. The default build has neither."""
    h = sass.sass_histogram("wo_a", "sm_90a", G=8, R=512, Dg=2048, pdl=True, **cfg)
    assert sass.count(h, "ACQBULK") == 2 and sass.count(h, "PREEXIT") == 1
    assert sass.count(h, "HGMMA") >= 1 and sass.count(h, "UTMALDG") >= 2 and sass.local_memory_ops(h) == 0
    h0 = sass.sass_histogram("wo_a", "sm_90a", G=8, R=512, Dg=2048, tile_m=64, tile_n=64)
    assert sass.count(h0, "ACQBULK") == 0 and sass.count(h0, "PREEXIT") == 0


# --- the Hopper swap-AB decode kernel (cute_kernels/wo_a_decode_swap_ab.py) -------------------

@pytest.mark.gpu
@pytest.mark.parametrize("T, G, HG, Dv, R, cfg", [
    (1, 8, 16, 128, 512, dict(tok_n=8, stages=4)),
    (3, 16, 8, 128, 1024, dict(tok_n=8, stages=4)),
    (5, 8, 8, 256, 512, dict(tok_n=8, stages=3)),
    (13, 8, 8, 128, 1024, dict(tok_n=16, stages=6)),
    (16, 16, 16, 128, 512, dict(tok_n=16, stages=4, bk=128)),
    (29, 8, 16, 128, 512, dict(tok_n=32, stages=4)),
    (41, 8, 16, 128, 512, dict(tok_n=64, stages=4)),
    (64, 16, 8, 128, 1024, dict(tok_n=64, stages=3)),
    (64, 8, 16, 128, 512, dict(tok_n=64, stages=6, bk=128)),
    (2, 8, 8, 64, 512, dict(tok_n=16, stages=2)),  # one K slice per CTA
])
def test_swap_ab_decode_kernel_matches_fp64_and_replays(seed, T, G, HG, Dv, R, cfg):
    """Each token tile, depth and K slice against float64, with odd T (token rows past T
    zero-filled by TMA, never stored): launched twice eagerly, then replayed in a graph with
    fresh inputs."""
    _check_decode_build("wo_a_decode_swap_ab", T, G, HG, Dv, R, max_splits=1, **cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("G, HG, Dv, R", SHAPES)
@pytest.mark.parametrize("T", [1, 5, 16, 20, 32, 41, 64])
def test_swap_ab_decode_kernel_through_wo_a(seed, G, HG, Dv, R, T):
    """``wo_a(decode_kernel="wgmma")`` at every shape with its plan (which the default takes
    at T <= 16 where 64-row weight tiles leave SMs idle, G=8 R=512, and at G=16 R=1024)."""
    check_wo_a(T, G, HG, Dv, R, decode_kernel="wgmma")


@pytest.mark.gpu
@pytest.mark.parametrize("bk", [64, 128])
def test_swap_ab_decode_kernel_pdl_after_a_writer(seed, bk):
    """The PDL build reads ``o`` only after the kernel before it: a graph of (copy fresh
    inputs into ``o``, the kernel) x 3 on one ``o`` gives each step's product."""
    from cute_kernels import jit

    T, G, HG, Dv, R = 5, 8, 16, 128, 512
    fn = jit.get_kernel("wo_a_decode_swap_ab", "sm_90a", G=G, R=R, Dg=HG * Dv, tok_n=8, bk=bk, pdl=True)
    o, w = make(T, G, HG, Dv, R, "cuda")
    srcs = [make(T, G, HG, Dv, R, "cuda")[0] for _ in range(3)]
    outs = [torch.empty(T, G * R, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    P = jit.gmem_ptr
    s = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for src, out in zip(srcs, outs):
            o.copy_(src)
            fn(P(cutlass.BFloat16, o, 16), P(cutlass.BFloat16, w, 16), P(cutlass.BFloat16, out, 4), jit.i32(T),
               jit.cu_stream(s))
    replay_fresh(g, srcs, outs, w)


@pytest.mark.parametrize("cfg", [dict(tok_n=8, stages=4), dict(tok_n=64, stages=3), dict(tok_n=32, stages=6, bk=128),
                                 dict(tok_n=16, pdl=True)])
def test_swap_ab_decode_kernel_machine_code(cfg):
    """TMA loads and wgmma of the token tile's width (m64n{tok_n}k16), one per 16 of K in a
    slice; no spills, no global atomics; a grid-dependency wait and early launch only in the
    PDL build."""
    h = sass.sass_histogram("wo_a_decode_swap_ab", "sm_90a", G=16, R=1024, Dg=2048, **cfg)
    bk = cfg.get("bk", 64)
    assert sass.count(h, f"HGMMA.64x{cfg['tok_n']}x16.F32.BF16") >= bk // 16, h
    assert sass.count(h, "UTMALDG") >= 2 and sass.count(h, "LDGSTS") == 0 and sass.count(h, "HMMA") == 0
    assert sass.local_memory_ops(h) == 0
    pdl = cfg.get("pdl", False)
    assert sass.count(h, "ACQBULK") == int(pdl) and sass.count(h, "PREEXIT") == int(pdl)
    assert sass.count(h, "ATOMG") == 0


def test_swap_ab_decode_plan_and_errors():
    """plan()'s properties (not its tuned depths): at every decode T a config the kernel
    implements within shared memory, the narrowest token tile covering T, 128-wide K slices
    only where K divides by 128; errors name the bad argument."""
    from cute_kernels import jit
    from cute_kernels.wo_a_decode_swap_ab import TOK_N, WoADecodeSwapAB, plan

    for G, R, Dg in ((8, 512, 2048), (16, 1024, 1024), (8, 512, 1024 + 64), (8, 1024, 4096), (16, 1024, 4096)):
        for num_sms in (78, 132):
            for T in range(1, 65):
                c = plan(T, G, R, Dg, num_sms=num_sms)
                where = (T, G, R, Dg, num_sms, c)
                assert WoADecodeSwapAB.can_implement(T, G, R, Dg, c["tok_n"], c["stages"], c["bk"]), where
                assert c["tok_n"] == min(n for n in TOK_N if n >= T), where
                assert c["bk"] == 64 or Dg % 128 == 0, where
    with pytest.raises(ValueError, match="T=65"):
        plan(65, 8, 512, 2048)
    with pytest.raises(ValueError, match="tok_n=24"):
        jit.get_kernel("wo_a_decode_swap_ab", "sm_90a", G=8, R=512, Dg=1024, tok_n=24, use_disk=False)
    with pytest.raises(TypeError, match="splits"):  # no K split
        jit.get_kernel("wo_a_decode_swap_ab", "sm_90a", G=8, R=512, Dg=1024, tok_n=16, splits=2, use_disk=False)
    with pytest.raises(ValueError, match="stages=40"):
        jit.get_kernel("wo_a_decode_swap_ab", "sm_90a", G=8, R=512, Dg=1024, tok_n=64, stages=40, use_disk=False)


# ------------------------------------------------------------ AOT coverage ------------
def _aot_keys(arch):
    """(kernel, canonical config) of every AOT item for ``arch``: what the artifact build compiles."""
    import json

    from cute_kernels import jit

    return {(k.name, json.dumps(k.canonical_config(c), sort_keys=True))
            for k, c in jit.iter_aot(catalog.kernels(), None, arch) if arch in k.archs}


def _route_key(name, cfg):
    import json

    return name, json.dumps(catalog.kernels()[name].canonical_config(cfg), sort_keys=True)


# every T up to 600, odd ones past the tile edges above, and far past AOT_MAX_T
AOT_TOKENS = list(range(1, 601)) + [767, 769, 1023, 1025, 1536, 1537, 2047, 4097, 8191, 16383, 16384,
                                    16385, 40000, 100003]


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_aot_build_covers_every_default_route(arch):
    """`python -m cute_kernels build` leaves no default wo_a() call of a supported shape to
    compile on the hot path: the kernel and config route() picks is an AOT item for every T
    (decode kernels, swapped mid-size tiles, pingpong prefill) outside the cuBLAS ranges."""
    from cute_kernels.wo_a import AOT_SHAPES, route

    have = _aot_keys(arch)
    missing = {(G, R, Dg, T) for G, R, Dg in AOT_SHAPES for T in AOT_TOKENS
               if (r := route(T, G, R, Dg, arch))[0] != "wo_a_cublas" and _route_key(*r) not in have}
    assert not missing, sorted(missing)[:10]
    if arch == "sm_90a":  # every kernel wo_a() dispatches to on Hopper is among them
        assert {route(T, 8, 512, 2048, arch)[0] for T in (1, 20, 64, 4096)} == \
            {"wo_a", "wo_a_decode_swap_ab", "wo_a_cublas"}
        assert route(1, 8, 1024, 1024, arch)[0] == "wo_a_decode"


def test_route_matches_the_configs_it_names():
    """route() spells the same configs as the tile rules it dispatches to, and rejects the
    wgmma decode kernel off Hopper or above 64 tokens before anything compiles."""
    from cute_kernels.wo_a import aot_routes, route
    from cute_kernels.wo_a_decode_swap_ab import plan as sm90_plan

    assert route(320, 8, 512, 2048, "sm_90a", backend="cute") == \
        ("wo_a", dict(G=8, R=512, Dg=2048, **WoASm90.config_for(320, 8, 512, 2048)))
    assert route(320, 8, 512, 2048, "sm_90a", pdl=True)[1]["pdl"] is True
    assert "pdl" not in route(320, 8, 512, 2048, "sm_100a", pdl=True)[1]  # the Blackwell engine has no PDL build
    assert route(4096, 16, 1024, 1024, "sm_100a") == ("wo_a", dict(G=16, R=1024, Dg=1024,
                                                                   **WoASm100.config_for(4096, 16, 1024, 1024)))
    assert route(5, 8, 512, 2048, "sm_90a") == ("wo_a_decode_swap_ab", dict(G=8, R=512, Dg=2048,
                                                                          **sm90_plan(5, 8, 512, 2048)))
    assert route(5, 8, 512, 2048, "sm_90a", decode_kernel=False)[0] == "wo_a"
    with pytest.raises(ValueError, match="decode_kernel='wgmma' needs a Hopper"):
        route(5, 8, 512, 2048, "sm_100a", decode_kernel="wgmma")
    with pytest.raises(ValueError, match="T=65"):
        route(65, 8, 512, 2048, "sm_90a", decode_kernel="wgmma")
    # distinct and stable: one entry per compile, the same tuple on a second call
    r = aot_routes("sm_90a", [(8, 512, 2048)], 2000)
    assert len({_route_key(*x) for x in r}) == len(r) and aot_routes("sm_90a", [(8, 512, 2048)], 2000) == r


def test_default_route_rule():
    """The default rule, stated independently of route()'s code: on the 132-SM Hopper part, for
    each measured shape cuBLAS inside its T ranges (16 < T <= 32 among them; V4's shapes from
    T = 1) and nowhere else; decode kernels at T <= 16 outside them (wgmma where 64-row weight
    tiles leave SMs idle, G=8 R=512, or at G=16 R=1024 without PDL; warp MMAs otherwise); the
    engine elsewhere. Unmeasured shapes, another SM count and Blackwell never take cuBLAS by
    default."""
    from cute_kernels.wo_a import SM90_CUBLAS_T, route

    for ranges in SM90_CUBLAS_T.values():  # at most three sorted, disjoint, non-empty ranges
        assert 1 <= len(ranges) <= 3 and list(ranges) == sorted(ranges)
        assert all(0 <= lo < hi for lo, hi in ranges) and all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))
    for (G, R, Dg), ranges in SM90_CUBLAS_T.items():
        assert ranges[0] == ((0, 32) if Dg == 4096 else (16, 32))
        for T in range(1, 4200, 7):
            name = route(T, G, R, Dg, "sm_90a")[0]
            assert (name == "wo_a_cublas") == any(lo < T <= hi for lo, hi in ranges), (G, R, Dg, T)
            if T <= 16 and Dg != 4096:
                wgmma = (G, R) in ((8, 512), (16, 1024))
                assert name == ("wo_a_decode_swap_ab" if wgmma else "wo_a_decode"), (G, R, Dg, T)
            assert route(T, G, R, Dg, "sm_90a", backend="cute")[0] != "wo_a_cublas"
            assert route(T, G, R, Dg, "sm_90a", sms=114)[0] != "wo_a_cublas"
            assert route(T, G, R, Dg, "sm_100a")[0] == "wo_a"
    assert route(1, 16, 1024, 1024, "sm_90a", pdl=True)[0] == "wo_a_decode"
    assert route(1, 8, 512, 2048, "sm_90a", pdl=True)[0] == "wo_a_decode_swap_ab"
    assert route(100, 8, 512, 2048, "sm_90a", pdl=True)[0] == "wo_a"  # PDL keeps this project's kernels
    assert route(20, 8, 512, 2048, "sm_90a", decode_kernel=True)[0] == "wo_a_decode"
    assert route(500, 4, 1024, 4096, "sm_90a")[0] == "wo_a"  # an unmeasured shape
    assert route(100, 8, 512, 2048, "sm_90a", backend="cublas")[0] == "wo_a_cublas"


@pytest.mark.gpu
def test_aot_entries_serve_every_t_without_compiling(seed, tmp_path, monkeypatch):
    """A deployment's view: the AOT items of one shape exported to a fresh artifact cache and
    the in-process cache emptied, wo_a() at decode, mid-size and prefill T (odd ones among
    them) loads every kernel from disk -- nothing compiles -- and matches FP32."""
    from cute_kernels import jit
    from cute_kernels.artifact_cache import ArtifactCache
    from cute_kernels.wo_a import aot_routes, route

    G, HG, Dv, R = 8, 16, 128, 512
    Ts = (1, 5, 20, 33, 64, 100, 320, 513, 1100, 2100, 4097)
    monkeypatch.setenv("CUTE_KERNELS_CACHE_DIR", str(tmp_path))
    store = ArtifactCache(str(tmp_path))
    for name, cfg in aot_routes("sm_90a", [(G, R, HG * Dv)], max(Ts)):
        kdef = catalog.kernels()[name]
        key = jit.CacheKey.make(kdef, "sm_90a", cfg)
        assert store.put(key, jit.compile_now(kdef, "sm_90a", cfg, options=key.options).fn)
    jit.CACHE.clear()
    try:
        for T in Ts:
            check_wo_a(T, G, HG, Dv, R, backend=None)  # the default route
        routes = {_route_key(*r) for T in Ts if (r := route(T, G, R, HG * Dv, "sm_90a"))[0] != "wo_a_cublas"}
        assert jit.CACHE.stats.compiles == 0 and jit.CACHE.stats.disk_loads == len(routes) >= 3
    finally:
        jit.CACHE.clear()


# ---- the cuBLAS route (cute_kernels/wo_a_cublas.py) ----

@pytest.mark.parametrize("T", [1, 77])
def test_cublas_views_compute_wo_a_on_cpu(seed, T):
    """The cuBLAS route's operand views (o as [G, T, Dg], y as [G, T, R] with strides
    (R, G*R, 1)) are WO-A: on CPU tensors the same bmm, into a poisoned token-major y that
    keeps its storage, matches the float64 reference."""
    from cute_kernels.wo_a_cublas import wo_a_cublas

    G, HG, Dv, R = 8, 4, 64, 128
    o, w = make(T, G, HG, Dv, R, "cpu")
    out = torch.full((T, G * R), float("nan"), dtype=torch.bfloat16)
    ptr = out.data_ptr()
    assert wo_a_cublas(o, w, out) is out and out.data_ptr() == ptr
    assert torch.isfinite(out).all() and rel_err(out, wo_a_ref(o, w)) < TOL


@pytest.mark.parametrize("kwargs, words", [
    (dict(backend="cudnn"), "backend='cudnn'"),
    (dict(backend="cublas", pdl=True), "backend='cublas' takes neither"),
    (dict(backend="cublas", decode_kernel="mma"), "backend='cublas' takes neither"),
])
def test_bad_backend(kwargs, words):
    o, w = torch.zeros(2, 16, 128).bfloat16(), torch.zeros(8, 512, 256).bfloat16()
    with pytest.raises(ValueError, match=words):
        wo_a(o, w, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("G, HG, Dv, R, T", [
    (8, 16, 128, 512, 320), (8, 16, 128, 512, 333), (8, 8, 256, 512, 1100),  # G=8 R=512 Dg=2048
    (16, 8, 128, 1024, 288), (16, 8, 128, 1024, 517),  # G=16 R=1024 Dg=1024
    (16, 16, 128, 512, 700), (8, 8, 128, 1024, 200),  # G=16 R=512 Dg=2048, G=8 R=1024 Dg=1024
    (8, 8, 128, 512, 601),  # G=8 R=512 Dg=1024
])
def test_default_route_cublas_matches_fp64(seed, G, HG, Dv, R, T):
    """Inside a band the default route is one cuBLAS GEMM storing token-major y itself:
    every element of a poisoned output written, within the FP32 tolerance, ``y`` the caller's
    buffer (strides unchanged)."""
    from cute_kernels.wo_a import route

    assert route(T, G, R, HG * Dv, "sm_90a")[0] == "wo_a_cublas"
    out = check_wo_a(T, G, HG, Dv, R, backend=None)
    assert out.stride() == (G * R, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 77])
def test_backend_cublas_anywhere_matches_fp64(seed, T):
    check_wo_a(T, 2, 8, 128, 512, backend="cublas")


@pytest.mark.gpu
def test_cublas_route_one_kernel_no_copy(seed):
    """The cuBLAS route is one GEMM kernel: no transpose, copy or second launch."""
    o, w = make(320, 8, 16, 128, 512, "cuda")
    out = torch.empty(320, 8 * 512, device="cuda", dtype=torch.bfloat16)
    kernels = profiled_kernels(lambda: wo_a(o, w, out=out))
    assert len(kernels) == 1 and ("nvjet" in kernels[0] or "gemm" in kernels[0].lower()), kernels


@pytest.mark.gpu
@pytest.mark.parametrize("as_handle", [False, True])
def test_cublas_route_explicit_stream_and_graph(seed, as_handle):
    """The cuBLAS route runs on the caller's stream (a torch stream or its raw handle) and is
    captured into a CUDA graph on it: replays over fresh inputs give each one's product, and the
    current stream is left as it was."""
    G, HG, Dv, R, T = 8, 16, 128, 512, 320
    o, w = make(T, G, HG, Dv, R, "cuda")
    out = torch.empty(T, G * R, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    arg = s.cuda_stream if as_handle else s
    before = torch.cuda.current_stream()
    s.wait_stream(before)
    wo_a(o, w, out=out, stream=arg)  # the stream's first cuBLAS call (its workspace) outside capture
    s.synchronize()
    assert torch.cuda.current_stream() == before
    assert rel_err(out, wo_a_ref(o, w)) < TOL
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        wo_a(o, w, out=out, stream=arg)
    for _ in range(3):
        o.copy_(torch.randn_like(o, dtype=torch.float32).bfloat16())
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(out).all() and rel_err(out, wo_a_ref(o, w)) < TOL


#: per route kernel, the MMA that must appear in its machine code
_ROUTE_MMA = {("wo_a", "sm_90a"): "HGMMA", ("wo_a", "sm_100a"): "UTCHMMA", ("wo_a_decode", "sm_90a"): "HMMA",
              ("wo_a_decode", "sm_100a"): "HMMA", ("wo_a_decode_swap_ab", "sm_90a"): "HGMMA"}


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("G", [8, 16])
@pytest.mark.parametrize("T", [5, 64, 4096])
def test_v4_routes_compile_machine_code(arch, G, T):
    """DeepSeek-V4's WO-A (Dg = 4096, R = 1024) on both archs: the kernel and config the default
    route takes at a decode, the largest decode and a prefill T compile, with their tensor-core
    instruction and no local memory (the Blackwell proof without a Blackwell GPU)."""
    name, cfg = route(T, G, 1024, 4096, arch, backend="cute")  # (the default: cuBLAS at T <= 32 on sm_90a)
    h = sass.sass_histogram(name, arch, **cfg)
    assert sass.count(h, _ROUTE_MMA[(name, arch)]) >= 1, (name, cfg)
    assert sass.local_memory_ops(h) == 0, (name, cfg)
    if route(T, G, 1024, 4096, arch)[0] != "wo_a_cublas":
        assert (name, cfg) in [(n, c) for n, c in aot_routes(arch, shapes=((G, 1024, 4096),))]
