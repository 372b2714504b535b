"""MXFP8 routed-input quantization: bit-exact against tests/references.py."""

import pytest
import torch

from moe.quant import mxfp8_gather_routed, mxfp8_quantize, mxfp8_quantize_routed, scale_buffer_size
from conftest import capture_after_warm_up
from references import (align_ref, mxfp8_dequant_ref, mxfp8_quant_ref, routed_row_pos_ref, swizzle_scales_ref,
                        unswizzle_scales_ref)
from cute_kernels.testing import sass


def make_x(T, K, device="cpu", specials=True):
    """bf16 rows whose 32-blocks span many binades, with zero blocks, subnormals, scale-rule
    boundaries (amax = 1.75 * 2^k and the next bf16 up), NaN and Inf blocks."""
    nb = K // 32
    x = torch.randn(T, nb, 32) * torch.exp2(torch.randint(-30, 30, (T, nb, 1)).float())
    if specials and T * nb >= 8:
        flat = x.view(-1, 32)
        n = flat.shape[0]
        idx = torch.randperm(n)[:8]
        flat[idx[0]] = 0.0
        flat[idx[1]] = torch.randn(32) * 2.0**-130  # bf16 subnormals
        flat[idx[2], 3] = 448.0 * 2.0**5  # m == 1.75 exactly: no bump
        flat[idx[3], 7] = -1.7578125 * 2.0**-3  # mantissa7 = 0x61: bump
        flat[idx[4], 1] = float("nan")
        flat[idx[5], 9] = float("inf")
        flat[idx[6], 0] = -float("inf")
        flat[idx[7]] = 2.0**120  # large
    return x.view(T, K).bfloat16().to(device)


# ------------------------------------------------------------- reference checks (CPU) --
def test_reference_never_clips_and_is_tight():
    x = make_x(64, 1024, specials=False)
    q, s = mxfp8_quant_ref(x)
    deq = mxfp8_dequant_ref(q, s)
    amax = x.float().view(64, 32, 32).abs().amax(-1)
    qmax = q.view(torch.float8_e4m3fn).float().view(64, 32, 32).abs().amax(-1)
    assert (qmax <= 448).all()
    # tight: with a scale one binade smaller the block would clip (amax/s > 448)
    assert ((amax / torch.exp2(s.float() - 128)) > 448).all()
    rel = ((deq - x.float()).abs() / x.float().abs().clamp_min(1e-30))[x.float().abs() > amax.repeat_interleave(32, 1) / 16]
    assert rel.max() <= 2.0**-4 + 1e-7  # e4m3 has 3 mantissa bits: half-ulp 2^-4


def test_reference_special_blocks():
    x = torch.zeros(1, 128).bfloat16()
    x[0, 32 + 5] = float("nan")
    x[0, 64 + 2] = float("inf")
    x[0, 96:128] = 2.0**-140  # below every scale: clamps to 2^-127, quantizes to 0
    q, s = mxfp8_quant_ref(x)
    assert s.tolist() == [[0, 0xFF, 0xFF, 0]]
    assert (q[0, 32:96] == 0x7F).all() and (q[0, :32] == 0).all()


def test_reference_matches_torchao_rceil():
    """The reference's rule against an established library's: torchao's MX reference
    (``to_mx(..., ScaleCalculationMode.RCEIL)``, the round-up scale of NVIDIA's hardware
    conversion) on ~4000 random blocks over 60 binades plus the boundary blocks of
    :func:`make_x`: every scale byte and every e4m3 byte equal. Excluded, and why: blocks whose
    scale is 2^-127 (byte 0: amax < 448 * 2^-127) -- torchao divides in FP32, where that
    scale is itself subnormal and the quotient flushes to 0; the reference (and the kernels,
    test_plain_bit_exact) keep e.g. 2^-130 / 2^-127 = 0.125. NaN blocks: the same 0xFF
    scale, torchao's own NaN element bytes. Inf blocks: torchao clamps the scale to 2^127
    (byte 254); the reference and the kernels mark the block NaN (0xFF), as a NaN block --
    an Inf input is not representable in e4m3fn either way."""
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    torch.manual_seed(0)
    x = make_x(128, 1024)
    q, s = mxfp8_quant_ref(x)
    s_ao, q_ao = mx.to_mx(x, torch.float8_e4m3fn, 32, scaling_mode=ScaleCalculationMode.RCEIL)
    s_ao = s_ao.view(torch.uint8).reshape(s.shape)
    q_ao = q_ao.view(torch.uint8).reshape(q.shape)
    inf = x.float().isinf().view(*s.shape, 32).any(-1)
    assert torch.equal(s_ao[~inf], s[~inf]) and (s_ao[inf] == 254).all() and (s[inf] == 0xFF).all()
    keep = ((s != 0) & (s != 0xFF)).repeat_interleave(32, 1)
    assert int(keep.sum()) > 0.95 * keep.numel()
    assert torch.equal(q_ao[keep], q[keep])


def test_swizzle_round_trip_and_offsets():
    for R, C in [(1, 1), (130, 7), (256, 224), (5, 4)]:
        sc = torch.randint(0, 255, (R, C), dtype=torch.uint8)
        flat = swizzle_scales_ref(sc)
        assert flat.numel() == scale_buffer_size(R, C * 32, "swizzled")
        assert torch.equal(unswizzle_scales_ref(flat, R, C), sc)
        ncb = -(-C // 4)
        for r, c in [(0, 0), (R - 1, C - 1), (R // 2, C // 2)]:
            off = ((r // 128) * ncb + c // 4) * 512 + (r % 32) * 16 + ((r // 32) % 4) * 4 + c % 4
            assert flat[off] == sc[r, c]


# ------------------------------------------------------------------- GPU, bit exact ----
def _check_plain(x, q, s):
    qr, sr = mxfp8_quant_ref(x.cpu())
    assert torch.equal(s.cpu(), sr), "scales differ"
    assert torch.equal(q.cpu().view(torch.uint8), qr), "q differs"


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 5, 64, 77, 320, 4096])
@pytest.mark.parametrize("K", [7168, 32, 160])
def test_plain_bit_exact(seed, T, K):
    x = make_x(T, K, "cuda")
    q = torch.full((T, K), 0xAB, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    s = torch.full((T, K // 32), 0xAB, dtype=torch.uint8, device="cuda")
    mxfp8_quantize(x, q=q, scales=s)
    torch.cuda.synchronize()
    _check_plain(x, q, s)


def test_dedicated_stream_rejects_a_cpu_device():
    from moe.streams import dedicated_stream

    with pytest.raises(ValueError, match="device"):
        dedicated_stream("cpu")


@pytest.mark.gpu
def test_dedicated_stream_is_never_a_pooled_one():
    """After PyTorch's stream pool has wrapped around (64 requests: every pooled stream twice),
    dedicated streams are distinct from each of them and from each other, and order work like
    any stream (a fork / join inside a capture replays)."""
    from moe.streams import dedicated_stream

    pooled = {torch.cuda.Stream().cuda_stream for _ in range(64)}
    own = [dedicated_stream() for _ in range(4)]
    handles = [s.cuda_stream for s in own]
    assert len(set(handles)) == 4 and not set(handles) & pooled
    x = torch.randn(1 << 20, device="cuda")
    y = torch.empty_like(x)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        main = torch.cuda.current_stream()
        own[0].wait_stream(main)
        with torch.cuda.stream(own[0]):
            y.copy_(x * 3)
        main.wait_stream(own[0])
    for _ in range(3):
        x.normal_()
        y.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, x * 3)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["plain", "swizzled"])
def test_tiny_grid_strides_over_all_work(seed, layout):
    T, K = 300, 2048
    x = make_x(T, K, "cuda")
    q, s = mxfp8_quantize(x, layout=layout, max_ctas=1)
    q2, s2 = mxfp8_quantize(x, layout=layout)
    torch.cuda.synchronize()
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    if layout == "plain":
        _check_plain(x, q2, s2)


@pytest.mark.gpu
@pytest.mark.parametrize("T, K", [(1, 7168), (130, 224), (256, 7168), (5, 96)])
def test_swizzled_bit_exact_with_padding(seed, T, K):
    x = make_x(T, K, "cuda")
    s = torch.full((scale_buffer_size(T, K, "swizzled"),), 0xAB, dtype=torch.uint8, device="cuda")
    q, s = mxfp8_quantize(x, layout="swizzled", scales=s)
    torch.cuda.synchronize()
    qr, sr = mxfp8_quant_ref(x.cpu())
    assert torch.equal(s.cpu(), swizzle_scales_ref(sr))  # padding bytes are zero too
    assert torch.equal(q.cpu().view(torch.uint8), qr)
    # layout round trip: dequantize(swizzled) == dequantize(plain)
    d1 = mxfp8_dequant_ref(q.cpu().view(torch.uint8), unswizzle_scales_ref(s.cpu(), T, K // 32))
    assert torch.equal(torch.nan_to_num(d1, nan=7.0), torch.nan_to_num(mxfp8_dequant_ref(qr, sr), nan=7.0))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["plain", "swizzled"])
@pytest.mark.parametrize("T", [1, 5, 64])
@pytest.mark.parametrize("zero_padding", [True, False])
@pytest.mark.parametrize("K", [7168, 224])  # 224: 7 scale columns, the swizzled atom's last one padded
def test_routed_gather_bit_exact(seed, layout, T, zero_padding, K):
    """Live rows bit-exact; padding rows zero (q and scale bytes) -- or, with
    zero_padding=False, untouched like the rows past the total."""
    E, k, tile = 256, 8, 128
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).to(torch.int32)
    _, _, sorted_ids, _, total = align_ref(ids, E, tile)
    cap = total + 2 * tile  # slack rows past total must stay untouched
    sorted_full = torch.full((cap,), -7, dtype=torch.int32)
    sorted_full[:total] = sorted_ids
    x = make_x(T, K, "cuda")
    q = torch.full((cap, K), 0xAB, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    s = torch.full((scale_buffer_size(cap, K, layout),), 0xAB, dtype=torch.uint8, device="cuda")
    mxfp8_quantize_routed(x, sorted_full.cuda(), torch.tensor([total], dtype=torch.int32, device="cuda"), k,
                          layout=layout, q=q, scales=s, zero_padding=zero_padding)
    torch.cuda.synchronize()
    src = sorted_ids.long()
    pad = src >= T * k
    xg = x.cpu()[torch.where(pad, 0, src // k)]
    xg[pad] = 0
    qr, sr = mxfp8_quant_ref(xg)
    qb = q.cpu().view(torch.uint8)
    assert (qb[total:] == 0xAB).all()  # rows past the live total are never written
    if layout == "plain":
        sp = s.cpu().view(cap, K // 32)
        got = sp[:total]
        assert (sp[total:] == 0xAB).all()
    else:
        got = unswizzle_scales_ref(s.cpu()[: scale_buffer_size(total, K, "swizzled")], total, K // 32)
    live = ~pad
    assert torch.equal(qb[:total][live], qr[live]) and torch.equal(got[live], sr[live])
    if zero_padding:
        assert torch.equal(qb[:total], qr) and torch.equal(got, sr)
        assert (qb[:total][pad] == 0).all() and (sr[pad] == 0).all()
    else:
        assert (qb[:total][pad] == 0xAB).all() and (got[pad] == 0xAB).all()


@pytest.mark.gpu
def test_side_stream_eager_and_graph(seed):
    from moe.streams import SideStream

    T, K = 64, 7168
    x = make_x(T, K, "cuda", specials=False)
    q = torch.empty(T, K, dtype=torch.float8_e4m3fn, device="cuda")
    s = torch.empty(T, K // 32, dtype=torch.uint8, device="cuda")
    y = torch.empty(T, K, device="cuda")
    side = SideStream()
    with side.fork():
        mxfp8_quantize(x, q=q, scales=s)
    y.copy_(x.float() * 2)
    side.join()
    torch.cuda.synchronize()
    _check_plain(x, q, s)

    g = torch.cuda.CUDAGraph()
    cap = torch.cuda.Stream()
    cap.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(cap), torch.cuda.graph(g, stream=cap):
        with side.fork():
            mxfp8_quantize(x, q=q, scales=s)
        y.copy_(x.float() * 2)
        side.join()
    for _ in range(3):
        x.copy_(make_x(T, K, "cuda", specials=False))
        q.view(torch.uint8).fill_(0xAB)
        g.replay()
        torch.cuda.synchronize()
        _check_plain(x, q, s)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["plain", "swizzled"])
@pytest.mark.parametrize("T", [1, 6, 64, 384])
@pytest.mark.parametrize("zero_padding", [True, False])
def test_gather_of_prequantized_tokens_equals_routed_quantization(seed, layout, T, zero_padding):
    """V4-Flash's routed input (K = 4096, top-6): the tokens quantized first (plain layout),
    then gathered through the router's packing, equal the routed quantization of the bf16
    rows byte for byte -- q and scales, padding rows and the untouched rows past the total
    included (all outputs poisoned alike), special values in the blocks included. With the
    padding unwritten, both walked through ``routed_row_pos`` (the routed rows only) write
    the same bytes again."""
    E, k, tile, K = 256, 6, 128, 4096
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).to(torch.int32)
    _, _, sorted_ids, _, total = align_ref(ids, E, tile)
    cap = total + 2 * tile
    sorted_full = torch.full((cap,), -7, dtype=torch.int32)
    sorted_full[:total] = sorted_ids
    sorted_full, total_t = sorted_full.cuda(), torch.tensor([total], dtype=torch.int32, device="cuda")
    x = make_x(T, K, "cuda")
    xq, xs = mxfp8_quantize(x)
    row_pos = routed_row_pos_ref(sorted_ids, T * k).cuda()
    outs = []
    for gather, by_pos in ((False, False), (True, False)) + (((False, True), (True, True)) if not zero_padding else ()):
        q = torch.full((cap, K), 0xAB, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
        s = torch.full((scale_buffer_size(cap, K, layout),), 0xAB, dtype=torch.uint8, device="cuda")
        kw = dict(layout=layout, q=q, scales=s, zero_padding=zero_padding, routed_row_pos=row_pos if by_pos else None)
        if gather:
            mxfp8_gather_routed(xq, xs, sorted_full, total_t, k, **kw)
        else:
            mxfp8_quantize_routed(x, sorted_full, total_t, k, **kw)
        torch.cuda.synchronize()
        outs.append((q.view(torch.uint8).cpu(), s.cpu()))
    for i in range(1, len(outs)):
        assert torch.equal(outs[0][0], outs[i][0]) and torch.equal(outs[0][1], outs[i][1]), i
    src = sorted_ids.long()
    live = src < T * k
    qr, _ = mxfp8_quant_ref(x.cpu()[src[live] // k])  # and both equal the definition
    assert torch.equal(outs[1][0][:total][live], qr)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["plain", "swizzled"])
def test_programmatic_dependent_chain_in_a_graph(seed, layout):
    """``pdl=True``: a CUDA graph of a torch copy into ``x``, the tokens' quantization and the
    routed gather of its output, each of ours launched as a programmatic dependent of the kernel
    before it (the gather reads what the quantization wrote one launch earlier). Every replay
    takes fresh tokens and must give the bytes of the same chain launched without PDL -- a
    launch that read before its producer finished would return the previous replay's bytes."""
    E, k, tile, K, T = 256, 6, 128, 4096, 64
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).to(torch.int32)
    _, _, sorted_ids, _, total = align_ref(ids, E, tile)
    row_pos = routed_row_pos_ref(sorted_ids, T * k)
    sorted_ids, row_pos = sorted_ids.cuda(), row_pos.cuda()
    total_t = torch.tensor([total], dtype=torch.int32, device="cuda")
    src = torch.empty(T, K, dtype=torch.bfloat16, device="cuda")
    x = torch.empty_like(src)
    xq = torch.empty(T, K, dtype=torch.float8_e4m3fn, device="cuda")
    xs = torch.empty(T, K // 32, dtype=torch.uint8, device="cuda")
    q = torch.empty(total, K, dtype=torch.float8_e4m3fn, device="cuda")
    s = torch.empty(scale_buffer_size(total, K, layout), dtype=torch.uint8, device="cuda")

    def chain(pdl):
        x.copy_(src)
        mxfp8_quantize(x, q=xq, scales=xs, pdl=pdl)
        mxfp8_gather_routed(xq, xs, sorted_ids, total_t, k, layout=layout, q=q, scales=s, zero_padding=False,
                            routed_row_pos=row_pos, pdl=pdl)

    g = capture_after_warm_up(lambda: chain(True))
    live = sorted_ids.cpu() < T * k
    for _ in range(4):
        src.copy_(make_x(T, K, "cuda"))
        for t in (xq.view(torch.uint8), xs, q.view(torch.uint8), s):
            t.fill_(0xAB)
        g.replay()
        torch.cuda.synchronize()
        got = (q.view(torch.uint8).cpu()[live], xs.cpu().clone())
        qr, _ = mxfp8_quant_ref(src.cpu()[sorted_ids.cpu()[live].long() // k])  # the definition
        assert torch.equal(got[0], qr)
        chain(False)
        torch.cuda.synchronize()
        assert torch.equal(got[0], q.view(torch.uint8).cpu()[live]) and torch.equal(got[1], xs.cpu())


# -------------------------------------------------------------- validation (CPU) ------
@pytest.mark.parametrize("kw, exc, words", [
    (dict(x=torch.randn(4, 64)), TypeError, "x must have dtype bfloat16"),
    (dict(x=torch.randn(4, 48).bfloat16()), ValueError, "multiple of 32"),
    (dict(x=torch.randn(4, 64).bfloat16(), layout="zigzag"), ValueError, "layout"),
    (dict(x=torch.randn(4, 64).bfloat16(), scales=torch.empty(4, 3, dtype=torch.uint8)), ValueError, "scales"),
    (dict(x=torch.randn(4, 64).bfloat16(), q=torch.empty(4, 64, dtype=torch.uint8)), TypeError, "q must have dtype"),
    (dict(x=torch.randn(4, 64).bfloat16()), ValueError, "CUDA"),
])
def test_bad_arguments(kw, exc, words):
    with pytest.raises(exc, match=words):
        mxfp8_quantize(**kw)


def test_pdl_must_be_a_bool():
    x = torch.randn(4, 64).bfloat16()
    ids, total = torch.zeros(8, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with pytest.raises(TypeError, match="mxfp8_quantize: pdl must be a bool"):
        mxfp8_quantize(x, pdl=1)
    with pytest.raises(TypeError, match="mxfp8_quantize_routed: pdl must be a bool"):
        mxfp8_quantize_routed(x, ids, total, 2, pdl="yes")
    with pytest.raises(TypeError, match="mxfp8_gather_routed: pdl must be a bool"):
        mxfp8_gather_routed(torch.zeros(4, 64, dtype=torch.float8_e4m3fn), torch.zeros(4, 2, dtype=torch.uint8),
                            ids, total, 2, pdl=None)


def test_routed_bad_arguments():
    x = torch.randn(4, 64).bfloat16()
    with pytest.raises(TypeError, match="sorted_token_ids"):
        mxfp8_quantize_routed(x, torch.zeros(8, dtype=torch.int64), torch.zeros(1, dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="topk"):
        mxfp8_quantize_routed(x, torch.zeros(8, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), 0)
    with pytest.raises(TypeError, match="zero_padding"):
        mxfp8_quantize_routed(x, torch.zeros(8, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), 2,
                              zero_padding=0)
    ids, total = torch.zeros(8, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="routed_row_pos walks the routed rows only"):
        mxfp8_quantize_routed(x, ids, total, 2, routed_row_pos=torch.zeros(8, dtype=torch.int32))
    with pytest.raises(ValueError, match="routed_row_pos must have shape"):
        mxfp8_quantize_routed(x, ids, total, 2, zero_padding=False, routed_row_pos=torch.zeros(7, dtype=torch.int32))
    with pytest.raises(TypeError, match="routed_row_pos must have dtype"):
        mxfp8_quantize_routed(x, ids, total, 2, zero_padding=False, routed_row_pos=torch.zeros(8))
    # q [capacity, K] past 2^31 elements would wrap the 32-bit offsets (meta tensors: no memory)
    with pytest.raises(ValueError, match="2\\*\\*31"):
        mxfp8_quantize_routed(torch.empty(8, 7168, dtype=torch.bfloat16, device="meta"),
                              torch.empty(300_000, dtype=torch.int32, device="meta"),
                              torch.empty(1, dtype=torch.int32, device="meta"), 8)


def test_gather_routed_bad_arguments():
    xq = torch.zeros(4, 64, dtype=torch.float8_e4m3fn)
    xs = torch.zeros(4, 2, dtype=torch.uint8)
    ids, total = torch.zeros(8, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with pytest.raises(TypeError, match="xq must have dtype"):
        mxfp8_gather_routed(xq.view(torch.uint8), xs, ids, total, 2)
    with pytest.raises(ValueError, match="xs"):
        mxfp8_gather_routed(xq, torch.zeros(4, 3, dtype=torch.uint8), ids, total, 2)
    with pytest.raises(ValueError, match="topk"):
        mxfp8_gather_routed(xq, xs, ids, total, 0)
    with pytest.raises(TypeError, match="sorted_token_ids"):
        mxfp8_gather_routed(xq, xs, ids.long(), total, 2)
    with pytest.raises(ValueError, match="CUDA"):
        mxfp8_gather_routed(xq, xs, ids, total, 2)
    with pytest.raises(ValueError, match="routed_row_pos must have shape"):
        mxfp8_gather_routed(xq, xs, ids, total, 2, zero_padding=False, routed_row_pos=ids[:3])


# ------------------------------------------------------------ machine code (CPU) ------
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("layout, routed, extra", [("plain", False, {}), ("swizzled", True, {}),
                                                  ("swizzled", True, {"zero_padding": False}),
                                                  ("swizzled", True, {"zero_padding": False, "by_row_pos": True}),
                                                  ("plain", True, {"zero_padding": False, "by_row_pos": True})])
def test_machine_code(arch, layout, routed, extra):
    """Plain: a thread per block (32 bf16 = four 16-byte loads, 32 e4m3 = two 16-byte stores, 16
    packed conversions, one scale byte). Swizzled: the same, the scale bytes of four lanes
    gathered by three shuffles and stored as one word (no byte stores). Swizzled routed rows
    (``by_row_pos``): a thread per scale word -- four blocks, the word stored whole, no
    shuffles. No spills."""
    h = sass.sass_histogram("mxfp8_quant", arch, K=7168, layout=layout, routed=routed, topk=8 if routed else 1,
                            **extra)
    word_per_thread = layout == "swizzled" and extra.get("by_row_pos", False)
    n = 4 if word_per_thread else 1  # blocks per thread
    assert h["LDG.E.128"] == 4 * n
    assert h["STG.E.128"] == 2 * n
    assert sass.count(h, "F2FP") == 16 * n
    if layout == "swizzled":
        assert h["STG.E"] == 1 and sass.count(h, "STG.E.U8") == 0
        # three shuffles (ptxas keeps a second copy behind BRA.DIV for a diverged warp)
        assert sass.count(h, "SHFL") in ((0,) if word_per_thread else (3, 6))
    else:
        assert h["STG.E.U8"] == 1
    assert sass.local_memory_ops(h) == 0


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_machine_code_of_the_prequantized_gather(arch):
    """A 32-byte block moves as two 16-byte loads and stores (four blocks per thread on the
    swizzled routed-rows walk, all eight loads before the first store: one memory round trip
    after the position's, not one per block), with nothing to convert."""
    h = sass.sass_histogram("mxfp8_quant", arch, K=4096, layout="swizzled", routed=True, topk=6,
                            zero_padding=False, prequantized=True)
    assert h["LDG.E.128"] == 2 and h["STG.E.128"] == 2
    text = sass.disassemble(sass.compile_cubin("mxfp8_quant", arch, K=4096, layout="swizzled", routed=True, topk=6,
                                               zero_padding=False, prequantized=True, by_row_pos=True))
    h, ops = sass.histogram(text), sass.opcodes(text)
    assert h["LDG.E.128"] == 8 and h["STG.E.128"] == 8
    assert max(i for i, o in enumerate(ops) if o == "LDG.E.128") < ops.index("STG.E.128")
    assert sass.count(h, "F2FP") == 0
    assert sass.local_memory_ops(h) == 0


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("config", [dict(K=7168, layout="plain", routed=False, topk=1),
                                    dict(K=4096, layout="swizzled", routed=True, topk=6, zero_padding=False,
                                         prequantized=True, by_row_pos=True)])
def test_machine_code_with_programmatic_dependent_launch(arch, config):
    """``pdl=True``: the grid-dependency wait (``ACQBULK``) comes before the first global load
    of every path, and the dependents' trigger (``PREEXIT``) after the last global store; the
    default build has neither. The rest of the kernel is the same instruction for instruction
    apart from the two (and the register allocation around them)."""
    plain = sass.disassemble(sass.compile_cubin("mxfp8_quant", arch, **config))
    pdl = sass.disassemble(sass.compile_cubin("mxfp8_quant", arch, pdl=True, **config))
    assert "ACQBULK" not in plain and "PREEXIT" not in plain
    ops = sass.opcodes(pdl)
    loads = [i for i, o in enumerate(ops) if o.startswith(("LDG", "LD.", "ATOMG"))]
    stores = [i for i, o in enumerate(ops) if o.startswith(("STG", "ST.", "RED"))]
    assert ops.count("ACQBULK") == 1 and ops.count("PREEXIT") == 1
    assert loads and ops.index("ACQBULK") < min(loads)
    assert stores and ops.index("PREEXIT") > max(stores)
    h_plain, h_pdl = sass.histogram(plain), sass.histogram(pdl)
    for key in ("LDG.E.128", "STG.E.128", "STG.E", "STG.E.U8", "F2FP.SATFINITE.E4M3.F32.PACK_AB"):
        assert h_plain[key] == h_pdl[key], key


# --------------------------------------------------- the scale rule's edges (CPU) ------
def test_reference_boundary_blocks_by_hand():
    """The float64 reference on deterministic edge blocks gives the scale bytes derived by hand
    (e = ceil(log2(amax / 448))), and every finite q stays <= 448."""
    from references import mx_boundary_blocks

    x, want = mx_boundary_blocks()
    q, s = mxfp8_quant_ref(x.view(1, -1))
    assert s.view(-1).tolist() == want
    vals = q.view(torch.float8_e4m3fn).float()
    assert (vals[torch.isfinite(vals)].abs() <= 448).all()
    assert (q.view(-1, 32)[torch.tensor(want) == 255] == 0x7F).all()


def test_package_cpu_quantizer_matches_the_definition():
    """moe.experts.mxfp8_quantize_torch (the CPU path of the quantizer ops) against the float64
    definition: the edge blocks plus random blocks over many binades, byte for byte."""
    from moe.experts import mxfp8_quantize_torch
    from references import mx_boundary_blocks

    edges, _ = mx_boundary_blocks()
    x = torch.cat([edges.view(1, -1).repeat(3, 1), make_x(3, edges.numel(), specials=False)])
    q, s = mxfp8_quantize_torch(x)
    qr, sr = mxfp8_quant_ref(x)
    assert torch.equal(s, sr) and torch.equal(q, qr)


def test_swizzled_layout_formula_matches_the_package():
    """moe.experts.swizzle_scales (the package's permute) against the published per-byte formula."""
    from moe.experts import swizzle_scales

    for R, C in [(1, 1), (130, 7), (256, 224), (5, 4), (129, 9)]:
        sc = torch.randint(0, 255, (R, C), dtype=torch.uint8)
        assert torch.equal(swizzle_scales(sc), swizzle_scales_ref(sc))


def test_kernels_scale_index_helpers_match_the_published_layout():
    """cute_kernels.mx_scales' byte and word indices (the quantizer's and the fused epilogues'
    stores), evaluated on Python ints, put every (row, block) where the published layout does."""
    from cute_kernels.mx_scales import swizzled_scale_byte, swizzled_scale_word

    for R, C in [(130, 7), (256, 224), (129, 9)]:
        ncb = -(-C // 4)
        sc = torch.arange(R * C, dtype=torch.int64).view(R, C) % 251 + 1
        got = torch.zeros(scale_buffer_size(R, C * 32, "swizzled"), dtype=torch.int64)
        for r in range(R):
            for c in range(C):
                b = swizzled_scale_byte(r, c, ncb)
                assert b == swizzled_scale_word(r, c // 4, ncb) * 4 + c % 4
                got[b] = sc[r, c]
        assert torch.equal(got.to(torch.uint8), swizzle_scales_ref(sc.to(torch.uint8)))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["plain", "swizzled"])
def test_boundary_blocks_bit_exact_on_gpu(layout):
    """The kernel on the deterministic edge blocks (every block a row of its own and all in one
    row), plain and swizzled scales."""
    from references import mx_boundary_blocks

    edges, want = mx_boundary_blocks()
    for x in (edges.repeat(1, 4), edges.view(1, -1)):
        x = x.contiguous().cuda()
        q, s = mxfp8_quantize(x, layout=layout)
        torch.cuda.synchronize()
        qr, sr = mxfp8_quant_ref(x.cpu())
        assert torch.equal(q.cpu().view(torch.uint8), qr)
        assert torch.equal(s.cpu(), sr if layout == "plain" else swizzle_scales_ref(sr))


def test_swizzled_scales_must_be_word_aligned():
    """The swizzled layout's scales are stored as 32-bit words: a buffer that is not 4-byte
    aligned is refused before any launch (the plain layout takes any byte)."""
    x = torch.zeros(8, 128, dtype=torch.bfloat16)
    n = scale_buffer_size(8, 128, "swizzled")
    backing = torch.zeros(n + 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match="scales data pointer must be 4-byte aligned"):
        mxfp8_quantize(x, layout="swizzled", scales=backing[1:])
