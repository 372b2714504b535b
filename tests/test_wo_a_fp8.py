"""WO-A with e4m3 weights and 128 x 128 block scales: the reference, the quantiser and the
checkpoint-scale conversion on the CPU, machine code for sm_90a / sm_100a, the decode kernel
and the widened (T > 64) path on the H200."""

import cutlass
import pytest
import torch

from cute_kernels.testing import sass
from cute_kernels.dequant_fp8_blockwise import dequantize_fp8_blockwise
from cute_kernels.wo_a_decode_fp8 import (SCALE_BLOCK, WoADecodeFp8, checkpoint_scales_fp32, k_permutation, plan,
                                          quantize_wo_a_fp8, wo_a_fp8, wo_a_fp8_reference)
from references import gemm_error_bound, rel_err, wo_a_ref

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
    """At every decode T of the AOT shapes (V4-Flash and -Pro first) the plan is a config the
    FP8 kernel implements within shared memory, with the smallest token tile covering T;
    errors name the bad argument."""
    from cute_kernels import jit
    from cute_kernels.wo_a_decode_fp8 import AOT_SHAPES, SMEM_PER_CTA, smem_bytes

    for G, R, Dg in AOT_SHAPES:
        for T in range(1, 65):
            c = plan(T, G, R, Dg)
            assert WoADecodeFp8.can_implement(T, G, R, Dg, c["splits"], c["bn"]), (T, G, R, Dg, c)
            assert smem_bytes(c["bm"], c["stages"], c["bn"], Dg=Dg) <= SMEM_PER_CTA, (T, G, R, Dg, c)
            assert c["bm"] == min(b for b in (16, 32, 64) if b >= T)
    assert WoADecodeFp8.can_implement(64, 8, 512, 2048) and not WoADecodeFp8.can_implement(65, 8, 512, 2048)
    assert not WoADecodeFp8.can_implement(1, 8, 192, 2048)  # R inside whole scale blocks
    with pytest.raises(ValueError, match="bm 16, 32 or 64"):
        jit.get_kernel("wo_a_decode_fp8", "sm_90a", G=8, R=512, Dg=1024, bm=128, use_disk=False)
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
@pytest.mark.parametrize("bm, splits, bn, stages, bk", [(16, 1, 32, 6, 128), (32, 2, 64, 4, 128), (16, 1, 32, 4, 256),
                                                       (64, 1, 64, 4, 128)])
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
    # a warp's tile: bm x bn/4 (warps side by side, bm < 64) or bm/2 x bn/2 (2 x 2 warps, bm = 64)
    warp_m, warp_n = (bm, bn // 4) if bm < 64 else (bm // 2, bn // 2)
    a_loads = (warp_m // 16) * 2 * chunks * 2  # m16 blocks x 2 rows x chunks x two 16-byte loads
    b_loads = (warp_n // 8) * chunks  # n8 blocks per warp x chunks
    assert sass.count(h, "LDS.128") >= a_loads + b_loads and sass.count(h, "LDSM") == 0, h
    if splits == 1:
        assert sass.count(h, "BAR.SYNC") == 1, h


def test_bits_widening_model_is_exact_for_every_finite_code():
    """:mod:`cute_kernels.e4m3_widen`'s sequence (its Python model: the prmt, the masks, the
    multiply by 2^120) against torch's e4m3 -> bf16 conversion for all 256 codes in both byte
    pairs of a word: equal bit patterns for the 254 finite codes (zeros, subnormals, 448), and
    +-480 for the two NaN codes, as documented."""
    from cute_kernels.e4m3_widen import e4m3_pairs_to_bf16_model

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ref = codes.view(torch.float8_e4m3fn).to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    for c in range(256):
        other = (c * 37 + 11) % 256 if (c * 37 + 11) % 128 != 127 else 0x38
        for pair in (0, 1):
            word = (c | (other << 8)) << (16 * pair) | (0xFF7F if pair == 0 else 0x7FFF) << (16 * (1 - pair))
            lo, hi = e4m3_pairs_to_bf16_model(word, pair)
            assert hi == int(ref[other]), (c, pair)
            if c & 0x7F == 0x7F:  # NaN -> +-480
                assert lo == (0x43F0 | (c & 0x80) << 8), (c, pair, hex(lo))
            else:
                assert lo == int(ref[c]), (c, pair, hex(lo), hex(int(ref[c])))


@pytest.mark.parametrize("bm, bn, bk", [(16, 32, 128), (64, 64, 128), (16, 32, 256)])
def test_bits_widening_machine_code(bm, bn, bk):
    """``widen="bits"``: no conversion instruction in the slice (no E4M3 unpack, no HADD2.F32);
    per two weights a PRMT, a shift, two LOP3 and one bf16x2 multiply; no spills."""
    h = sass.sass_histogram("wo_a_decode_fp8", "sm_90a", G=16, R=1024, Dg=2048, bm=bm, bn=bn, stages=4,
                            widen="bits", **({"bk": bk} if bk != 128 else {}))
    warp_n = bn // 4 if bm < 64 else bn // 2  # a warp's weight rows (test_machine_code's warp tiles)
    pairs = warp_n * bk // 32 // 2  # a thread's weights per slice, in pairs
    assert not any("E4M3" in m for m in h) and sass.count(h, "HADD2") == 0, h
    assert sass.count(h, "HMUL2") == pairs and sass.count(h, "PRMT") >= pairs, h
    assert sass.count(h, "LOP3") >= 2 * pairs, h
    assert sass.local_memory_ops(h) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("widen", ["cvt", "bits"])
def test_widening_every_code_exact_on_gpu(widen):
    """Every finite e4m3 code through each widening route on the GPU: one-hot token rows pick
    single weights (scale 1), so each output is one weight's bf16 value exactly -- except that
    the code -0 gives +0 (the accumulator sums it with the +0 products of the zero columns)."""
    from cute_kernels import jit
    from cute_kernels.wo_a_decode import WoADecodeWorkspace

    G, HG, Dv, R, T = 8, 8, 128, 512, 16
    Dg = HG * Dv
    finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    g, r, k = torch.meshgrid(torch.arange(G), torch.arange(R), torch.arange(Dg), indexing="ij")
    codes = finite[(g * 5 + r * 7 + k) % finite.numel()]
    w8 = codes.view(torch.float8_e4m3fn).cuda()
    scale = torch.ones(G, R // 128, Dg // 128, device="cuda")
    cols = (torch.arange(T) * 67) % Dg
    o = torch.zeros(T, G, Dg)
    o[torch.arange(T), :, cols] = 1.0
    o = o.bfloat16().view(T, G * HG, Dv).cuda()
    fn = jit.get_kernel("wo_a_decode_fp8", "sm_90a", G=G, R=R, Dg=Dg, bm=16, splits=1, bn=32, stages=6,
                        **({"widen": widen} if widen != "cvt" else {}))  # (cvt: the default build's key)
    ws = WoADecodeWorkspace(G, R, max_splits=8)
    out = torch.full((T, G * R), float("nan"), device="cuda", dtype=torch.bfloat16)
    P = jit.gmem_ptr
    fn(P(cutlass.BFloat16, o, 16), P(cutlass.Float8E4M3FN, w8, 16), P(cutlass.Float32, scale, 4),
       P(cutlass.BFloat16, out, 4), P(cutlass.Float32, ws.partials, 4), P(cutlass.Int32, ws.counters, 4),
       jit.i32(T), jit.cu_stream(None))
    torch.cuda.synchronize()
    picked = codes[:, :, cols].permute(2, 0, 1).reshape(T, G * R)
    want = picked.view(torch.float8_e4m3fn).double().to(torch.bfloat16)  # exact: e4m3 is in bf16
    want[picked == 0x80] = 0.0  # -0 sums to +0
    got_bits, want_bits = out.cpu().view(torch.int16), want.view(torch.int16)
    bad = (got_bits != want_bits).nonzero()
    report = sorted({(int(picked[i, j]), int(got_bits[i, j]) & 0xFFFF, int(want_bits[i, j]) & 0xFFFF)
                     for i, j in bad[:4096].tolist()})
    assert bad.numel() == 0, f"{len(bad)} wrong outputs; (code, got bf16 bits, want): {report[:12]}"


# ----------------------------------------------- DeepSeek-V4: Dg = 4096, any T, UE8M0 ------
V4_SHAPES = [(8, 8, 512, 1024), (16, 8, 512, 1024)]  # (G, H/G, Dv, R): V4-Flash, V4-Pro


def make_v4(T, G, HG, Dv, R, scales, device="cuda"):
    """V4-shaped activations and FP8 weights with either FP32 block scales (V4-Flash-Base) or
    power-of-two ones (UE8M0: V4-Flash / -Pro), the latter built as UE8M0 bytes and converted
    by checkpoint_scales_fp32."""
    Dg = HG * Dv
    o = torch.randn(T, G * HG, Dv, device=device).bfloat16()
    w8 = (torch.randn(G, R, Dg, device=device) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    if scales == "ue8m0":
        e = torch.randint(127 - 16, 127 - 6, (G, R // SCALE_BLOCK, Dg // SCALE_BLOCK), device=device)
        scale = checkpoint_scales_fp32(e.to(torch.uint8))
    else:
        scale = torch.rand(G, R // SCALE_BLOCK, Dg // SCALE_BLOCK, device=device) * 1e-3 + 1e-5
    return o, w8, scale


def fp8_bound(o, w8, scale, widened_with_fp32_scales):
    """references.gemm_error_bound on the dequantised weights; + one bf16 rounding of each
    weight where the T > 64 path widened them with non-power-of-two scales."""
    G, R, Dg = w8.shape
    w = (w8.double().view(G, R // SCALE_BLOCK, SCALE_BLOCK, Dg // SCALE_BLOCK, SCALE_BLOCK)
         * scale.double()[:, :, None, :, None]).view(G, R, Dg)
    return w, gemm_error_bound(o, w, Dg, 2.0 ** -8 if widened_with_fp32_scales else 0.0)


def assert_fp8_per_element(out, o, w8, scale, widened=False):
    """Every element of ``out`` within :func:`fp8_bound` of the float64 product (zero
    elements outside it)."""
    w, bound = fp8_bound(o, w8, scale, widened)
    err = (out.double().cpu() - wo_a_ref(o, w).double().cpu()).abs()
    assert bool((err <= bound).all()), f"{int((err > bound).sum())} of {err.numel()} elements out of bound"


@pytest.mark.gpu
@pytest.mark.parametrize("G, HG, Dv, R", V4_SHAPES)
@pytest.mark.parametrize("T", [1, 5, 17, 33, 64, 65, 300, 4097])
@pytest.mark.parametrize("scales", ["ue8m0", "fp32"])
def test_v4_any_t_per_element(seed, G, HG, Dv, R, T, scales):
    """wo_a_fp8 at V4 shapes on the H200 -- decode kernel (T <= 64, bm 16 / 32 / 64) and the
    widened path (T > 64) -- output poisoned, every element within its rounding bound against
    the float64 product of o and the dequantised weights."""
    o, w8, scale = make_v4(T, G, HG, Dv, R, scales)
    out = torch.full((T, G * R), float("nan"), device="cuda", dtype=torch.bfloat16)
    wo_a_fp8(o, w8, scale, out=out)
    torch.cuda.synchronize()
    w, bound = fp8_bound(o, w8, scale, T > 64 and scales == "fp32")
    err = (out.double().cpu() - wo_a_ref(o, w)).abs()
    assert bool((err <= bound).all()), f"{int((err > bound).sum())} elements out of bound"


@pytest.mark.gpu
def test_v4_widened_path_graph_replay(seed):
    """The T > 64 path (widen + bf16 WO-A) captured once, replayed with fresh activations,
    weights and scales each time; every replay checked."""
    G, HG, Dv, R, T = 8, 8, 512, 1024, 200
    o, w8, scale = make_v4(T, G, HG, Dv, R, "ue8m0")
    out = torch.empty(T, G * R, device="cuda", dtype=torch.bfloat16)
    wide = torch.empty(G, R, HG * Dv, device="cuda", dtype=torch.bfloat16)
    wo_a_fp8(o, w8, scale, out=out, wide_weights=wide)  # warm-up: compiles outside capture
    s = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        wo_a_fp8(o, w8, scale, out=out, wide_weights=wide, stream=s)
    for _ in range(3):
        o2, w2, s2 = make_v4(T, G, HG, Dv, R, "ue8m0")
        o.copy_(o2), w8.copy_(w2), scale.copy_(s2)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        w, bound = fp8_bound(o, w8, scale, False)
        assert bool(((out.double().cpu() - wo_a_ref(o, w)).abs() <= bound).all())


def test_checkpoint_scales_are_exact_powers_of_two():
    """UE8M0 bytes -> 2**(e - 127) exactly (e = 0: 2**-127, a subnormal; 255: NaN), from uint8
    or float8_e8m0fnu; FP32 passes through; other dtypes are refused."""
    e = torch.tensor([0, 1, 100, 127, 128, 254, 255], dtype=torch.uint8)
    got = checkpoint_scales_fp32(e)
    want = torch.tensor([2.0 ** (int(v) - 127) for v in e[:-1]], dtype=torch.float64)
    assert got.dtype == torch.float32 and torch.equal(got[:-1].double(), want) and torch.isnan(got[-1])
    assert torch.equal(checkpoint_scales_fp32(e[:-1].view(torch.float8_e8m0fnu)), got[:-1])
    f = torch.rand(3)
    assert checkpoint_scales_fp32(f) is not None and torch.equal(checkpoint_scales_fp32(f), f)
    with pytest.raises(TypeError, match="scale must be float32"):
        checkpoint_scales_fp32(torch.ones(3, dtype=torch.float16))


@pytest.mark.parametrize("w, scale, words", [
    ((256, 1024), (2, 8), None),
    ((256, 1000), (2, 8), "multiples of 128"),
    ((192, 1024), (1, 8), "multiples of 128"),
    ((256, 1024), (2, 4), "scale must have shape"),
])
def test_dequantize_validation(w, scale, words):
    """Shapes checked before the device check (a CPU call with good shapes reaches it)."""
    with pytest.raises((TypeError, ValueError), match=words or "must be a CUDA tensor"):
        dequantize_fp8_blockwise(torch.zeros(w).to(torch.float8_e4m3fn), torch.ones(scale))


def test_wide_weights_validation():
    G, HG, Dv, R = 8, 2, 128, 256
    o = torch.zeros(100, G * HG, Dv, dtype=torch.bfloat16)
    w8 = torch.zeros(G, R, HG * Dv).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="wide_weights must have shape"):
        wo_a_fp8(o, w8, torch.ones(G, R // 128, HG * Dv // 128), wide_weights=torch.zeros(G, R, 64).bfloat16())


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_dequantize_machine_code(arch):
    """16-byte loads of the e4m3 weights, 32-byte (two 16-byte) stores of the bf16 ones, one
    scale load per thread, no local memory."""
    h = sass.sass_histogram("dequant_fp8_blockwise", arch, K=4096)
    assert sass.count(h, "LDG.E.128") == 1 and sass.count(h, "STG.E.128") == 2, h
    assert sass.local_memory_ops(h) == 0


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
    assert_fp8_per_element(out, o, w8, scale)


@pytest.mark.gpu
@pytest.mark.parametrize("bm, splits, bn, stages, bk, widen", [
    (16, 1, 32, 6, 128, "cvt"), (16, 4, 64, 4, 128, "cvt"), (32, 2, 32, 3, 128, "cvt"), (32, 1, 64, 6, 128, "cvt"),
    (16, 1, 32, 4, 256, "cvt"), (32, 2, 64, 3, 256, "cvt"), (16, 1, 32, 12, 128, "cvt"),
    (16, 1, 32, 6, 128, "bits"), (32, 2, 64, 3, 256, "bits"), (64, 1, 64, 4, 128, "bits")])
def test_every_config_and_graph_replay(seed, bm, splits, bn, stages, bk, widen):
    """Each token tile, column tile, split count, depth, K slice and widening: twice eagerly,
    then replayed in a graph with fresh inputs (the split counters re-zero themselves)."""
    from cute_kernels import jit
    from cute_kernels.wo_a_decode import WoADecodeWorkspace

    G, HG, Dv, R, T = 8, 8, 128, 512, (3 if bm == 16 else 29)
    fn = jit.get_kernel("wo_a_decode_fp8", "sm_90a", G=G, R=R, Dg=HG * Dv, bm=bm, splits=splits, bn=bn,
                        stages=stages, **({"bk": bk} if bk != 128 else {}), **({"widen": widen} if widen != "cvt" else {}))
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
        assert_fp8_per_element(out, o, w8, scale)
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
    assert_fp8_per_element(out, o, w8, scale)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("G", [8, 16])
@pytest.mark.parametrize("T", [5, 20, 64])
def test_v4_decode_plans_compile(arch, G, T):
    """The FP8 decode kernel at V4's shapes (Dg = 4096) and the plan's configs for each token
    tile compile on both archs with the e4m3 widening, warp MMAs and no local memory; each is in
    the AOT set."""
    cfg = dict(G=G, R=1024, Dg=4096, **plan(T, G, 1024, 4096))
    h = sass.sass_histogram("wo_a_decode_fp8", arch, **cfg)
    assert sass.count(h, "HMMA") >= 1 and any("E4M3" in m for m in h)
    assert sass.local_memory_ops(h) == 0
    from cute_kernels.wo_a_decode_fp8 import aot_configs
    assert cfg in aot_configs()
