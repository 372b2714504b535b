"""WO-A with e4m3 weights and 128 x 128 block scales (decode T): the reference and the
quantiser on the CPU, machine code for sm_90a / sm_100a, the kernel on the H200 (staged)."""

import cutlass
import pytest
import torch

from cute_kernels.testing import sass
from cute_kernels.wo_a_decode_fp8 import (SCALE_BLOCK, WoADecodeFp8, k_permutation, plan, quantize_wo_a_fp8,
                                          wo_a_fp8, wo_a_fp8_reference)
from references import rel_err

# bf16 output rounding dominates (~1.1e-3 for an exact sum); FP32 accumulation over K <= 2048
# in another order than the reference's: the engine tests' 4e-3.
TOL = 4e-3
SHAPES = [(16, 8, 128, 1024), (8, 16, 128, 512), (8, 8, 256, 512), (4, 3, 128, 256)]  # (G, H/G, Dv, R)


def make(T, G, HG, Dv, R, device):
    """Fresh activations and FP8 weights: a bf16 weight with a per-block spread of magnitudes
    (so the block scales differ), quantised."""
    Dg = HG * Dv
    o = torch.randn(T, G * HG, Dv, device=device).bfloat16()
    spread = torch.exp2(torch.randint(-3, 4, (G, R // SCALE_BLOCK, 1, Dg // SCALE_BLOCK, 1), device=device).float())
    w = (torch.randn(G, R // SCALE_BLOCK, SCALE_BLOCK, Dg // SCALE_BLOCK, SCALE_BLOCK, device=device) * spread)
    w8, scale = quantize_wo_a_fp8((w.view(G, R, Dg) / Dg**0.5).bfloat16())
    return o, w8, scale


def dequantized_ref(o, w8, scale):
    """FP32 einsum on the dequantised weights: the same sum as the spec up to FP32 ordering."""
    T = o.shape[0]
    G, R, Dg = w8.shape
    w = (w8.float().view(G, R // SCALE_BLOCK, SCALE_BLOCK, Dg // SCALE_BLOCK, SCALE_BLOCK)
         * scale[:, :, None, :, None]).view(G, R, Dg)
    return torch.einsum("tgd,grd->tgr", o.reshape(T, G, Dg).float(), w).reshape(T, G * R)


def test_quantizer_blocks_and_rounding(seed):
    """Each 128 x 128 block's largest magnitude maps to 448 (e4m3's largest finite), the
    dequantised weights stay within e4m3's half-ulp (2^-4 relative), an all-zero block gets
    scale 1 and zeros."""
    G, R, Dg = 2, 256, 384
    w = torch.randn(G, R, Dg)
    w[1, :128, 128:256] = 0
    w8, scale = quantize_wo_a_fp8(w)
    assert w8.dtype == torch.float8_e4m3fn and scale.shape == (G, 2, 3) and scale.dtype == torch.float32
    assert scale[1, 0, 1] == 1 and not w8[1, :128, 128:256].float().any()
    blocks = w8.float().view(G, 2, 128, 3, 128).abs().amax(dim=(2, 4))
    assert torch.equal(blocks[scale != 1], torch.full_like(blocks[scale != 1], 448.0))
    deq = w8.float().view(G, 2, 128, 3, 128) * scale[:, :, None, :, None]
    err = (deq.view(G, R, Dg) - w).abs()
    assert (err <= w.abs() * 2.0**-4 + scale.amax() * 2.0**-9).all()


def test_quantizer_rejects_nonfinite_and_partial_blocks():
    w = torch.randn(1, 128, 128)
    w[0, 3, 5] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_wo_a_fp8(w)
    with pytest.raises(ValueError, match="multiples of 128"):
        quantize_wo_a_fp8(torch.randn(1, 128, 192))


@pytest.mark.parametrize("T", [1, 5, 32])
def test_reference_is_the_dequantized_product(seed, T):
    """The spec (per-block FP32 sums times the scales) agrees with an FP32 einsum on the
    dequantised weights to bf16 rounding; wo_a_fp8 itself wants CUDA tensors, as every entry
    point here (a clear error, not a silent CPU fallback)."""
    G, HG, Dv, R = SHAPES[1]
    o, w8, scale = make(T, G, HG, Dv, R, "cpu")
    ref = wo_a_fp8_reference(o, w8, scale)
    assert ref.dtype == torch.bfloat16 and ref.shape == (T, G * R)
    assert rel_err(ref, dequantized_ref(o, w8, scale)) < TOL
    with pytest.raises(ValueError, match="o must be a CUDA tensor"):
        wo_a_fp8(o, w8, scale)


@pytest.mark.parametrize("o, w, scale, words", [
    ((1, 16, 128), (2, 256, 1024), (2, 2, 8), "w must have dtype"),  # bf16 weights
    ((1, 16, 128), (2, 256, 1024), (2, 2, 4), "scale must have shape"),
    ((33, 16, 128), (2, 256, 1024), (2, 2, 8), "1 <= T <= 32"),
    ((1, 16, 128), (2, 192, 1024), (2, 1, 8), "multiples of 128"),
    ((1, 15, 128), (3, 256, 768), (3, 2, 6), "w.shape\\[2\\]=768 must equal"),
])
def test_bad_arguments(o, w, scale, words):
    """Wrong weight dtype, scale shape, token count, block multiple or K: errors naming the
    argument, before any launch."""
    wt = torch.zeros(w, dtype=torch.bfloat16 if words.startswith("w must") else torch.float8_e4m3fn)
    with pytest.raises((TypeError, ValueError), match=words):
        wo_a_fp8(torch.zeros(o, dtype=torch.bfloat16), wt, torch.ones(scale))


def test_plan_and_config_errors():
    from cute_kernels import jit
    assert plan(5, 8, 512, 2048) == dict(bm=16, bn=32, splits=1, stages=6)
    assert plan(20, 8, 512, 2048)["bm"] == 32
    assert WoADecodeFp8.can_implement(32, 8, 512, 2048) and not WoADecodeFp8.can_implement(33, 8, 512, 2048)
    assert not WoADecodeFp8.can_implement(1, 8, 192, 2048)  # R inside whole scale blocks
    with pytest.raises(ValueError, match="bm 16 or 32"):
        jit.get_kernel("wo_a_decode_fp8", "sm_90a", G=8, R=512, Dg=1024, bm=64, use_disk=False)
    with pytest.raises(ValueError, match="shared memory"):
        jit.get_kernel("wo_a_decode_fp8", "sm_90a", G=8, R=512, Dg=1024, bm=32, bn=64, stages=20, use_disk=False)
    with pytest.raises(ValueError, match="bk=192"):
        jit.get_kernel("wo_a_decode_fp8", "sm_90a", G=8, R=512, Dg=1024, bk=192, use_disk=False)
    assert not WoADecodeFp8.can_implement(1, 8, 512, 384, bk=256)  # K in whole 256-wide slices


def k_columns(bk):
    """The shared column each logical k of a slice reads, from k_permutation's (shape, stride)
    -- logical k decomposed colexicographically, as CuTe does."""
    shape, stride = k_permutation(bk)
    cols = []
    for k in range(bk):
        c, rest = 0, k
        for n, d in zip(shape, stride):
            c, rest = c + (rest % n) * d, rest // n
        cols.append(c)
    return cols


@pytest.mark.parametrize("bk", [128, 256])
def test_k_permutation_is_a_permutation_with_16_byte_runs(seed, bk):
    """A CPU emulation of the register widening's layout: the K permutation is a bijection that
    stays inside each 64-wide chunk (so inside a 128-wide scale block), a dot product read
    through it on both operands is unchanged, and the values one lane holds over a chunk's four
    m16n8k16 k-steps -- logical k = 16 s + 2 q + {0, 1, 8, 9} for quad lane q -- are the 16
    contiguous columns 16 q .. 16 q + 15, in fragment order."""
    cols = k_columns(bk)
    assert sorted(cols) == list(range(bk))
    assert all(c // 64 == k // 64 for k, c in enumerate(cols))
    for chunk in range(bk // 64):
        for q in range(4):
            lane = [cols[64 * chunk + 16 * s + 2 * q + j] for s in range(4) for j in (0, 1, 8, 9)]
            assert lane == list(range(64 * chunk + 16 * q, 64 * chunk + 16 * q + 16))
    a, b = torch.randn(bk, dtype=torch.float64), torch.randn(bk, dtype=torch.float64)
    idx = torch.tensor(cols)
    assert torch.allclose((a[idx] * b[idx]).sum(), (a * b).sum(), rtol=1e-12, atol=0)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("bm, splits, bn, stages, bk", [(16, 1, 32, 6, 128), (32, 2, 64, 4, 128), (16, 1, 32, 4, 256)])
def test_machine_code(arch, bm, splits, bn, stages, bk):
    """cp.async of both operands, the e4m3 -> bf16 widening in registers (F2FP ... E4M3 unpack,
    then bf16 packs), bf16 warp MMAs per K slice, one FFMA per accumulator element and scale
    block (the promotion), no spills; the permuted fragments load as 16-byte shared loads (a
    thread's slice: 16 o elements per row and 16 weight bytes per column, per 64-wide chunk),
    no ldmatrix, and one barrier per slice."""
    h = sass.sass_histogram("wo_a_decode_fp8", arch, G=16, R=1024, Dg=2048, bm=bm, splits=splits, bn=bn,
                            stages=stages, **({"bk": bk} if bk != 128 else {}))
    per_k_slice = bm * bn // (16 * 8 * 4) * (bk // 16)  # m16n8k16 per warp over a bk-wide K slice
    assert sass.count(h, "HMMA") >= per_k_slice and sass.count(h, "LDGSTS") >= 2, h
    assert any("E4M3" in m for m in h), h
    assert sass.count(h, "FFMA") >= bm * bn // 128 * (bk // 128)
    assert sass.local_memory_ops(h) == 0
    chunks = bk // 64
    a_loads = (bm // 16) * 2 * chunks * 2  # m16 blocks x 2 rows x chunks x two 16-byte loads
    b_loads = (bn // 32) * chunks  # n8 blocks per warp x chunks
    assert sass.count(h, "LDS.128") >= a_loads + b_loads and sass.count(h, "LDSM") == 0, h
    if splits == 1:
        assert sass.count(h, "BAR.SYNC") == 1, h


@pytest.mark.gpu
@pytest.mark.parametrize("G, HG, Dv, R", SHAPES)
@pytest.mark.parametrize("T", [1, 5, 16, 17, 32])
def test_matches_reference_on_gpu(seed, G, HG, Dv, R, T):
    """wo_a_fp8's plan on the H200, output poisoned: against the FP32 einsum on the
    dequantised weights and the bf16 spec."""
    o, w8, scale = make(T, G, HG, Dv, R, "cuda")
    out = torch.full((T, G * R), float("nan"), device="cuda", dtype=torch.bfloat16)
    wo_a_fp8(o, w8, scale, out=out)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    assert rel_err(out, dequantized_ref(o, w8, scale)) < TOL
    assert rel_err(out, wo_a_fp8_reference(o, w8, scale)) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("bm, splits, bn, stages, bk", [(16, 1, 32, 6, 128), (16, 4, 64, 4, 128), (32, 2, 32, 3, 128),
                                                       (32, 1, 64, 6, 128), (16, 1, 32, 4, 256), (32, 2, 64, 3, 256),
                                                       (16, 1, 32, 12, 128)])
def test_every_config_and_graph_replay(seed, bm, splits, bn, stages, bk):
    """Each token tile, column tile, split count, depth and K slice: twice eagerly,
    then replayed in a graph with fresh inputs (the split counters re-zero themselves)."""
    from cute_kernels import jit
    from cute_kernels.wo_a_decode import WoADecodeWorkspace

    G, HG, Dv, R, T = 8, 8, 128, 512, (3 if bm == 16 else 29)
    fn = jit.get_kernel("wo_a_decode_fp8", "sm_90a", G=G, R=R, Dg=HG * Dv, bm=bm, splits=splits, bn=bn,
                        stages=stages, **({"bk": bk} if bk != 128 else {}))
    ws = WoADecodeWorkspace(G, R, max_splits=8)
    o, w8, scale = make(T, G, HG, Dv, R, "cuda")
    out = torch.empty(T, G * R, device="cuda", dtype=torch.bfloat16)
    P = jit.gmem_ptr

    def launch(stream):
        fn(P(cutlass.BFloat16, o, 16), P(cutlass.Float8E4M3FN, w8, 16), P(cutlass.Float32, scale, 4),
           P(cutlass.BFloat16, out, 4), P(cutlass.Float32, ws.partials, 4), P(cutlass.Int32, ws.counters, 4),
           jit.i32(T), jit.cu_stream(stream))

    for _ in range(2):
        out.fill_(float("nan"))
        launch(None)
        torch.cuda.synchronize()
        assert rel_err(out, dequantized_ref(o, w8, scale)) < TOL
    assert int(ws.counters.abs().sum()) == 0
    s = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        launch(s)
    o2, w2, s2 = make(T, G, HG, Dv, R, "cuda")
    o.copy_(o2), w8.copy_(w2), scale.copy_(s2)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert rel_err(out, dequantized_ref(o, w8, scale)) < TOL
