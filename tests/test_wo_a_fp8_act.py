"""WO-A with FP8 weights and MXFP8 activations (cute_kernels.wo_a_fp8_act_sm90): the reference,
the plan and the named refusals on the CPU, its sm_90a machine code, and on a Hopper GPU every
output element against the float64 product of the dequantised operands."""

import pytest
import torch

from cute_kernels.testing import sass
from cute_kernels.wo_a_decode_fp8 import SCALE_BLOCK, checkpoint_scales_fp32
from cute_kernels.wo_a_fp8_act_sm90 import (MAX_T, TOK_N, WoAFp8ActSm90, plan, smem_bytes, wo_a_fp8_act,
                                            wo_a_fp8_act_reference)
from conftest import capture_after_warm_up
from references import mxfp8_dequant_ref, mxfp8_quant_ref

V4_SHAPES = [(8, 8, 512, 1024), (16, 8, 512, 1024)]  # (G, H/G, Dv, R): V4-Flash, V4-Pro


def make(T, G, HG, Dv, R, device="cpu"):
    """o quantised to MXFP8 by the definition (references.mxfp8_quant_ref, rows of H*Dv), e4m3
    weights over their whole range and power-of-two (UE8M0, V4's) 128 x 128 block scales."""
    Dg = HG * Dv
    o = (torch.randn(T, G * HG * Dv) * torch.exp2(torch.randint(-6, 6, (T, G * HG * Dv // 32, 1)).float())
         .repeat_interleave(32, 1).view(T, -1)).bfloat16()
    qb, qs = mxfp8_quant_ref(o)
    q = qb.view(torch.float8_e4m3fn).view(T, G * HG, Dv)
    w8 = (torch.randn(G, R, Dg) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    e = torch.randint(127 - 16, 127 - 6, (G, R // SCALE_BLOCK, Dg // SCALE_BLOCK))
    ws = checkpoint_scales_fp32(e.to(torch.uint8))
    return tuple(t.to(device) for t in (q, qs, w8, ws))


def dequantized(q, qs, w8, ws):
    """float64 operands: activations ``[T, G, Dg]`` (each 32-block times 2^(byte - 127); NaN
    for byte 0xFF) and weights ``[G, R, Dg]`` (each 128 x 128 block times its scale)."""
    T = q.shape[0]
    G, R, Dg = w8.shape
    a = mxfp8_dequant_ref(q.cpu().view(torch.uint8).view(T, -1), qs.cpu()).double().view(T, G, Dg)
    w = (w8.double().cpu().view(G, R // SCALE_BLOCK, SCALE_BLOCK, Dg // SCALE_BLOCK, SCALE_BLOCK)
         * ws.double().cpu()[:, :, None, :, None]).view(G, R, Dg)
    return a, w


def error_bound(a, w):
    """Per element, sound whatever the data: the bf16 output rounding (2^-8 of |y|: half an ulp,
    doubled for the accumulator's own error) plus the FP8 tensor core's sum of each 32-deep
    block, which keeps ~14 mantissa bits before the FP32 promotion -- at most 32 additions of
    2^-14 of the running sum, <= 2^-9 of the block's sum of |a_k w_k|, summed over blocks:
    2^-9 (|a| @ |w|). The exact products, the power-of-two activation scales and the FP32
    promotion (K / 32 additions of 2^-24) are inside that. Returns (reference, bound)."""
    T, G, _ = a.shape
    R = w.shape[1]
    ref = torch.einsum("tgd,grd->tgr", a, w).reshape(T, G * R)
    mag = torch.einsum("tgd,grd->tgr", a.abs(), w.abs()).reshape(T, G * R)
    return ref, 2.0**-8 * ref.abs() + 2.0**-9 * mag + 2.0**-126


# ------------------------------------------------------------------------- CPU ------
def test_reference_is_the_definition(seed):
    """The spec (wo_a_fp8_act_reference) is the bf16 rounding of the float64 product of the
    dequantised operands; a NaN activation block (scale byte 0xFF) makes its token's outputs
    in that group NaN and nothing else."""
    q, qs, w8, ws = make(3, 2, 2, 128, 256)
    a, w = dequantized(q, qs, w8, ws)
    ref, _ = error_bound(a, w)
    assert torch.equal(wo_a_fp8_act_reference(q, qs, w8, ws), ref.bfloat16())
    qs = qs.clone()
    qs[1, 9] = 0xFF  # token 1, group 1's second 32-block (Dg = 256: 8 blocks per group)
    y = wo_a_fp8_act_reference(q, qs, w8, ws).view(3, 2, 256)
    assert y[1, 1].isnan().all() and not y[1, 0].isnan().any() and not y[[0, 2]].isnan().any()


def test_plan_maps_every_decode_t_to_a_config_that_fits():
    for G, HG, Dv, R in V4_SHAPES:
        for T in range(1, MAX_T + 1):
            cfg = plan(T, G, R, HG * Dv)
            assert cfg["tok_n"] in TOK_N and T <= cfg["tok_n"] and (cfg["tok_n"] == TOK_N[0] or T > cfg["tok_n"] // 2)
            assert WoAFp8ActSm90.can_implement(T, G, R, HG * Dv, **cfg)
            assert smem_bytes(cfg["tok_n"], cfg["stages"]) <= 227 * 1024
    with pytest.raises(ValueError, match="T=65"):
        plan(65, 8, 1024, 4096)


def test_plan_keeps_a_grid_of_more_than_one_wave_at_two_ctas_per_sm():
    """V4-Flash's 128 CTAs fit 132 SMs at one CTA each: the full depth. V4-Pro's 256 need two
    per SM: the 32- and 64-token tiles drop to the deepest pipeline that fits twice (6 and 4
    stages; the 16-token tile fits twice at 8)."""
    from cute_kernels.wo_a_fp8_act_sm90 import two_ctas_fit

    depth = {G: [plan(T, G, 1024, 4096)["stages"] for T in (16, 32, 64)] for G in (8, 16)}
    assert depth == {8: [8, 8, 6], 16: [8, 6, 4]}
    for T in (16, 32, 64):
        cfg = plan(T, 16, 1024, 4096)
        assert two_ctas_fit(cfg["tok_n"], cfg["stages"], 4096)
        assert not two_ctas_fit(cfg["tok_n"], cfg["stages"] + cfg["kgroups"], 4096) or cfg["stages"] == 8
    assert plan(64, 16, 1024, 4096, num_sms=264)["stages"] == 6  # one wave at one CTA per SM: full depth


def _args(T=5, G=2, HG=2, Dv=128, R=256):
    q, qs, w8, ws = make(T, G, HG, Dv, R)
    return dict(q=q, q_scales=qs, w=w8, w_scale=ws)


@pytest.mark.parametrize("change, exc, words", [
    (dict(q=torch.zeros(5, 4, 128, dtype=torch.bfloat16)), TypeError, "q must have dtype"),
    (dict(w=torch.zeros(2, 256, 256)), TypeError, "w must have dtype"),
    (dict(q_scales=torch.zeros(5, 15, dtype=torch.uint8)), ValueError, "q_scales must have shape"),
    (dict(q_scales=torch.zeros(5, 16, dtype=torch.int32)), TypeError, "q_scales must have dtype"),
    (dict(w_scale=torch.zeros(2, 2, 2, dtype=torch.float16)), TypeError, "w_scale must have dtype"),
    (dict(w_scale=torch.zeros(2, 2, 1)), ValueError, "w_scale must have shape"),
    (dict(w=torch.zeros(3, 256, 256, dtype=torch.float8_e4m3fn)), ValueError, "groups take"),
    (dict(w=torch.zeros(2, 192, 256, dtype=torch.float8_e4m3fn)), ValueError, "R % 128"),
    (dict(q=torch.zeros(65, 4, 128, dtype=torch.float8_e4m3fn)), ValueError, "T=65"),
    (dict(q=torch.zeros(5, 8, 128, dtype=torch.float8_e4m3fn)[:, ::2]), ValueError, "q must be contiguous"),
    (dict(), ValueError, "must be a CUDA tensor"),
])
def test_bad_arguments_are_refused_by_name(change, exc, words):
    """Every argument is checked before any launch, its name in the error (CPU tensors: the
    last check, the device, refuses them)."""
    kw = dict(_args(), **change)
    with pytest.raises(exc, match=words):
        wo_a_fp8_act(kw["q"], kw["q_scales"], kw["w"], kw["w_scale"])


def test_pdl_must_be_a_bool():
    kw = _args()
    with pytest.raises(TypeError, match="wo_a_fp8_act: pdl must be a bool"):
        wo_a_fp8_act(kw["q"], kw["q_scales"], kw["w"], kw["w_scale"], pdl=1)


def test_output_tile_reuses_the_weight_stages():
    """The FP32 output tile lives in the weight stages (read only after the main loop), so a
    64-token CTA of 4 stages fits twice in an SM's 228 KB -- two CTAs per SM for V4-Pro's 256 --
    and a depth whose weight stages cannot hold the tile is refused."""
    from cute_kernels.wo_a_fp8_act_sm90 import out_fits_stages

    assert 2 * (smem_bytes(64, 4) + 1024) <= 228 * 1024
    assert out_fits_stages(64, 3) and not out_fits_stages(64, 2) and out_fits_stages(16, 1)
    assert not WoAFp8ActSm90.can_implement(1, 16, 1024, 4096, 64, stages=2, kgroups=2)
    assert WoAFp8ActSm90.can_implement(1, 16, 1024, 4096, 64, stages=4, kgroups=2)


def test_kgroups_and_stages_are_refused_by_name():
    kw = _args()
    with pytest.raises(ValueError, match="wo_a_fp8_act: kgroups=3"):
        wo_a_fp8_act(kw["q"], kw["q_scales"], kw["w"], kw["w_scale"], kgroups=3)
    with pytest.raises(TypeError, match="wo_a_fp8_act: stages must be"):
        wo_a_fp8_act(kw["q"], kw["q_scales"], kw["w"], kw["w_scale"], stages=4.0)
    for bad in (dict(stages=5, kgroups=2), dict(stages=1, kgroups=1), dict(stages=40)):  # odd, too shallow, too big
        with pytest.raises(ValueError, match="wo_a_fp8_act: stages="):
            wo_a_fp8_act(kw["q"], kw["q_scales"], kw["w"], kw["w_scale"], **bad)
    assert not WoAFp8ActSm90.can_implement(1, 8, 1024, 4096, 64, stages=5, kgroups=2)  # stages split evenly


@pytest.mark.parametrize("kgroups", [1, 2])
@pytest.mark.parametrize("tok_n, stages", [(16, 8), (32, 8), (64, 6), (16, 16), (64, 10)])
def test_machine_code(tok_n, stages, kgroups):
    """Per 128-byte K slice: four e4m3 x e4m3 wgmmas (m64 n{tok_n} k32) into FP32, each block's
    partial promoted with one FFMA per accumulator element; the weight and token tiles by TMA
    (each K group's first warp issues its ``stages / kgroups`` prologue slices, then one slice
    per step); the scales read from global memory only before the first wgmma (staged once:
    tok_n * 32 words, each with its weight scale, over 128 x kgroups threads) and decoded there,
    in the slice one shared load per token column and block and no decoding; with two K
    groups the epilogue reads the second group's sums back once per element; no spills."""
    text = sass.disassemble(sass.compile_cubin("wo_a_fp8_act_sm90", "sm_90a", G=8, R=1024, Dg=4096, tok_n=tok_n,
                                               stages=stages, kgroups=kgroups))
    h = sass.histogram(text)
    assert h[f"QGMMA.64x{tok_n}x32.F32.E4M3.E4M3"] == 4, h
    nv = 64 * tok_n // 128  # accumulator elements per thread
    assert h["FFMA"] == 4 * nv, h
    # a thread's words all belong to one K slice (128 x kgroups threads, 32 slices): one weight-scale load
    assert h["LDG.E"] == tok_n * 32 // (128 * kgroups) + 1, h
    assert text.rindex("LDG.E") < text.index("QGMMA"), "a global scale load inside the K-slice loop"
    # per block one per token column (nv / 2 of them), and the epilogue's
    assert sass.count(h, "LDS") == 4 * (nv // 2) + 1 + (nv if kgroups == 2 else 0), h
    assert sass.count(h, "UTMALDG") == 2 * (stages // kgroups) + 2 and sass.count(h, "HMMA") == 0
    assert sass.local_memory_ops(h) == 0


@pytest.mark.parametrize("tok_n, stages, kgroups", [(16, 8, 1), (64, 6, 1), (64, 6, 2)])
def test_machine_code_with_programmatic_dependent_launch(tok_n, stages, kgroups):
    """``pdl=True``: the prologue's weight slices (``stages / kgroups`` TMA loads: each K group's
    first warp issues its own, one code path) go out before the one
    grid-dependency wait (``ACQBULK``); the token slices, every scale load and every store come
    after it; the dependents' trigger (``PREEXIT``) is issued once. The K-slice loop is the
    default build's."""
    text = sass.disassemble(sass.compile_cubin("wo_a_fp8_act_sm90", "sm_90a", G=8, R=1024, Dg=4096, tok_n=tok_n,
                                               stages=stages, pdl=True, kgroups=kgroups))
    ops = sass.opcodes(text)
    wait = ops.index("ACQBULK")
    assert ops.count("ACQBULK") == 1 and ops.count("PREEXIT") == 1
    assert sum(o.startswith("UTMALDG") for o in ops[:wait]) == stages // kgroups  # the weights alone
    assert not any(o.startswith(("LDG", "STG", "LDS", "STS")) for o in ops[:wait])
    default = sass.histogram(sass.disassemble(sass.compile_cubin(
        "wo_a_fp8_act_sm90", "sm_90a", G=8, R=1024, Dg=4096, tok_n=tok_n, stages=stages, kgroups=kgroups)))
    h = sass.histogram(text)
    for key in (f"QGMMA.64x{tok_n}x32.F32.E4M3.E4M3", "FFMA", "LDG.E"):
        assert h[key] == default[key], key
    assert sass.local_memory_ops(h) == 0


# ------------------------------------------------------------------------- GPU ------
@pytest.mark.gpu
@pytest.mark.parametrize("kgroups", [None, 1])
@pytest.mark.parametrize("G, HG, Dv, R", V4_SHAPES)
@pytest.mark.parametrize("T", [1, 5, 16, 17, 33, 64])
def test_v4_per_element(seed, G, HG, Dv, R, T, kgroups):
    """V4-Flash / -Pro at every token tile (odd T among them), the plan's K groups and one:
    output poisoned, every element within its rounding bound of the float64 product of the
    dequantised operands, and the norm-wise error below what one dropped 32-block would cost."""
    q, qs, w8, ws = make(T, G, HG, Dv, R, "cuda")
    out = torch.full((T, G * R), float("nan"), device="cuda", dtype=torch.bfloat16)
    wo_a_fp8_act(q, qs, w8, ws, out=out, kgroups=kgroups)
    torch.cuda.synchronize()
    ref, bound = error_bound(*dequantized(q, qs, w8, ws))
    err = (out.double().cpu() - ref).abs()
    assert int((~(err <= bound)).sum()) == 0, f"{int((~(err <= bound)).sum())} of {err.numel()} out of bound"
    assert float((out.double().cpu() - ref).norm() / ref.norm()) <= 2.0**-8


@pytest.mark.gpu
def test_nan_block_and_zero_blocks():
    """A NaN activation block poisons its token's outputs in that group only; all-zero blocks
    (scale byte 0) contribute nothing."""
    G, HG, Dv, R, T = 8, 8, 512, 1024, 5
    q, qs, w8, ws = make(T, G, HG, Dv, R, "cuda")
    qs[2, 130] = 0xFF  # token 2, group 1 (blocks 128..255)
    q.view(torch.uint8).view(T, -1)[3, :4096] = 0
    qs[3, :128] = 0  # token 3's group 0: zero blocks
    out = wo_a_fp8_act(q, qs, w8, ws)
    torch.cuda.synchronize()
    y = out.float().cpu().view(T, G, R)
    assert y[2, 1].isnan().all() and not y[2, [0, 2, 3, 4, 5, 6, 7]].isnan().any()
    assert not y[[0, 1, 3, 4]].isnan().any() and (y[3, 0] == 0).all()


@pytest.mark.gpu
def test_graph_replay_with_fresh_inputs(seed):
    """Captured once; every replay gets fresh activations, scales and weights and is checked."""
    G, HG, Dv, R, T = 16, 8, 512, 1024, 6
    q, qs, w8, ws = make(T, G, HG, Dv, R, "cuda")
    out = torch.empty(T, G * R, device="cuda", dtype=torch.bfloat16)
    wo_a_fp8_act(q, qs, w8, ws, out=out)  # compile outside the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        wo_a_fp8_act(q, qs, w8, ws, out=out, stream=s)
    for it in range(3):
        for dst, src in zip((q, qs, w8, ws), make(T, G, HG, Dv, R, "cuda")):
            dst.copy_(src)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref, bound = error_bound(*dequantized(q, qs, w8, ws))
        assert bool(((out.double().cpu() - ref).abs() <= bound).all()), f"replay {it}"


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 6, 64])
def test_programmatic_dependent_chain_in_a_graph(seed, T):
    """``pdl=True`` as the decode step would launch it: a graph of (a torch copy of fresh bf16
    ``o``, its MXFP8 quantization and this kernel, both of ours programmatic dependents of the
    kernel before them; the GEMM's weights stream before it waits for the quantization's
    output). Every replay's activations equal the definition's quantization of that replay's
    ``o`` and every output element is within the bound of their product."""
    from moe.quant import mxfp8_quantize

    G, HG, Dv, R = 8, 8, 512, 1024
    _, _, w8, ws = make(T, G, HG, Dv, R, "cuda")
    src = torch.empty(T, G * HG * Dv, dtype=torch.bfloat16, device="cuda")
    o = torch.empty_like(src)
    q = torch.empty(T, G * HG, Dv, dtype=torch.float8_e4m3fn, device="cuda")
    qs = torch.empty(T, G * HG * Dv // 32, dtype=torch.uint8, device="cuda")
    out = torch.empty(T, G * R, device="cuda", dtype=torch.bfloat16)

    def step():
        o.copy_(src)
        mxfp8_quantize(o, q=q.view(T, -1), scales=qs, pdl=True)
        wo_a_fp8_act(q, qs, w8, ws, out=out, pdl=True)

    g = capture_after_warm_up(step)
    for it in range(4):
        src.copy_((torch.randn(T, G * HG * Dv) * 4).bfloat16())
        q.view(torch.uint8).fill_(0xAB)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        qb, qsb = mxfp8_quant_ref(src.cpu())
        assert torch.equal(q.view(torch.uint8).cpu().view(T, -1), qb) and torch.equal(qs.cpu(), qsb), f"replay {it}"
        ref, bound = error_bound(*dequantized(q, qs, w8, ws))
        assert bool(((out.double().cpu() - ref).abs() <= bound).all()), f"replay {it}"


@pytest.mark.parametrize("tok_n", TOK_N)
def test_accumulator_columns_match_the_scale_loads(tok_n):
    """The kernel's tiled MMA (``make_trivial_tiled_mma`` of e4m3 operands, 64 x tok_n), its C
    thread-value layout evaluated on the CPU for all 128 threads (what ``partition_C`` hands each
    thread, whose coordinates ``promote`` indexes the staged scales with): the threads cover the
    tile once, and a thread's values lie in tok_n / 4 token columns, two values each -- the
    column count behind the promotion's shared loads that test_machine_code counts."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    import numpy as np
    from cutlass import Float32

    got = {}

    @cute.jit
    def trace():
        f8 = cutlass.Float8E4M3FN
        K_MAJOR = cute.nvgpu.OperandMajorMode.K
        tiled_mma = sm90_utils.make_trivial_tiled_mma(f8, f8, K_MAJOR, K_MAJOR, Float32, (1, 1, 1),
                                                      tiler_mn=(64, tok_n))
        tv = tiled_mma.tv_layout_C_tiled  # (thread, value) -> m + 64 n
        nv = cute.size(tv, mode=[1])
        got["nv"] = nv
        got.update({tidx: [tv((tidx, v)) for v in range(nv)] for tidx in range(128)})  # (no traced loop)

    cute.compile(trace, options="--gpu-arch=sm_90a")
    nv = got.pop("nv")
    assert nv == 64 * tok_n // 128
    seen = np.zeros((64, tok_n), dtype=np.int64)
    for tidx, idx in got.items():
        col = [v // 64 for v in idx]
        assert sorted(col.count(c) for c in set(col)) == [2] * (tok_n // 4), tidx
        for i in range(nv):
            seen[idx[i] % 64, col[i]] += 1
    assert (seen == 1).all()
