"""sink_attention: the FP64 definition on the H200 (per-element bounds from the formats' roundings
and the reduction lengths), edge cases, graph replay; argument validation, the planner and the
machine code on the CPU."""

import math

import pytest
import torch

from cute_kernels.sink_attention import (HEAD_TILES, KEY_TILE, MAX_SPLITS, SinkAttention, SinkAttentionWorkspace,
                                         plan, sink_attention, sink_attention_torch)
from cute_kernels.testing import sass
from references import sink_attention_ref

U = 2.0 ** -8  # bf16's relative rounding step (2u), used for the output and P roundings
U32 = 2.0 ** -24


def assert_bound(got, q, kv, rows, sink, scale, rotate=None, where=""):
    """Every element within ``2^-8 |o| + (2^-8 + 2 ds + (K + 16) 2^-23) m + tiny`` of the FP64
    value ``o``: the output's bf16 rounding; P's bf16 rounding (2^-9) and the FP32 P V sum (K
    terms) relative to ``m = sum_k p_k |v_k|``; ``ds``: the worst FP32 error of the token and
    head's scores (a reduction of D products: (D + 4) 2^-24 of their magnitude), which moves
    numerator and denominator of p by up to that factor each."""
    o, mag, smag = sink_attention_ref(q, kv, rows, sink, scale, rotate)
    D, K = q.shape[-1], rows.shape[1]
    ds = (smag.amax(-1, keepdim=True) * (D + 4) * U32)  # [T, H, 1]
    bound = U * o.abs() + (U + 2 * ds + (K + 16) * 2 * U32) * mag + 2.0 ** -130
    g = got.cpu().double()
    both_nan = torch.isnan(g) & torch.isnan(o)
    bad = ~((g - o).abs() <= bound) & ~both_nan
    assert int(bad.sum()) == 0, (f"{where}: {int(bad.sum())} of {o.numel()} outside the bound; worst at "
                                 f"{torch.nonzero(bad)[:3].tolist()}: got {g[bad][:3].tolist()} want {o[bad][:3].tolist()}")


def rope_rotation(T, r, g=None, inverse=True):
    """FP32 ``[T, r/2, 2]`` (cos, sin) of DeepSeek's RoPE at random positions (conjugate: inverse)."""
    pos = torch.randint(0, 1 << 16, (T,), generator=g).double()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, r, 2).double() / r))
    ang = pos[:, None] * inv_freq
    sgn = -1.0 if inverse else 1.0
    return torch.stack([ang.cos(), sgn * ang.sin()], -1).float()


def make_case(T, H, K, D=512, R=None, r=64, masked=0.2, g=None, device="cuda"):
    """Random queries, a kv pool, rows mixing valid rows, -1 and out-of-range ones, sinks."""
    R = R if R is not None else max(4 * K, 64)
    q = (torch.randn(T, H, D, generator=g) * 0.5).bfloat16()
    kv = torch.randn(R, D, generator=g).bfloat16()
    rows = torch.randint(0, R, (T, K), generator=g, dtype=torch.int32)
    drop = torch.rand(T, K, generator=g) < masked
    rows[drop] = -1
    rows[torch.rand(T, K, generator=g) < masked / 4] = R + 7  # outside kv: masked, never read
    sink = torch.randn(H, generator=g) * 2
    rot = rope_rotation(T, r, g) if r else None
    to = lambda x: None if x is None else x.to(device)  # noqa: E731
    return to(q), to(kv), to(rows), to(sink), to(rot)


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,K", [(1, 64, 640), (6, 64, 640), (6, 16, 128), (7, 32, 200), (1, 128, 1),
                                   (13, 64, 65), (200, 64, 640), (384, 16, 129), (3, 48, 1100)])
def test_matches_fp64_definition(seed, T, H, K):
    """Token counts below and above one CTA per SM (key splits merged by the last CTA, or none),
    head groups of 16 / 32 / 64 (and H = 48: three 16-head groups), K not a tile multiple, one key,
    rows masked by -1 and by lying outside kv; output poisoned with NaN before the launch."""
    g = torch.Generator().manual_seed(seed)
    q, kv, rows, sink, rot = make_case(T, H, K, g=g)
    scale = 1 / math.sqrt(512)
    out = torch.full_like(q, float("nan"))
    sink_attention(q, kv, rows, sink, scale, rotate=rot, out=out)
    torch.cuda.synchronize()
    assert_bound(out, q, kv, rows, sink, scale, rot, where=f"T={T} H={H} K={K} plan={plan(T, H, K)}")


@pytest.mark.gpu
@pytest.mark.parametrize("D,r", [(64, 0), (128, 64), (256, 2), (512, 0), (512, 512)])
def test_head_dims_and_rotations(seed, D, r):
    g = torch.Generator().manual_seed(seed)
    q, kv, rows, sink, rot = make_case(5, 32, 300, D=D, r=r, g=g)
    scale = 0.3
    out = torch.full_like(q, float("nan"))
    sink_attention(q, kv, rows, sink, scale, rotate=rot, out=out)
    torch.cuda.synchronize()
    assert_bound(out, q, kv, rows, sink, scale, rot, where=f"D={D} r={r}")


@pytest.mark.gpu
def test_edge_cases(seed):
    """No valid key: 0 (the sink takes the mass); no valid key and a -inf sink: NaN; a -inf sink
    with keys: the plain softmax; a NaN in one key row: NaN for that token only; large logits
    (scale 50): no overflow; zero queries: the sink-weighted mean of the values."""
    g = torch.Generator().manual_seed(seed)
    T, H, K, D = 8, 16, 130, 512
    q, kv, rows, sink, _ = make_case(T, H, K, r=0, masked=0.0, g=g)
    rows[0] = -1
    rows[1] = -1
    sink[3] = float("-inf")  # head 3 of every token: no sink
    kv[kv.shape[0] - 1] = float("nan")
    rows[2, 5] = kv.shape[0] - 1  # token 2 reads the NaN row
    rows[2 + 1:, :][rows[2 + 1:, :] == kv.shape[0] - 1] = 0
    q[4] = 0
    for scale in (1 / math.sqrt(D), 50.0):
        out = torch.full_like(q, float("nan"))
        sink_attention(q, kv, rows, sink, scale, out=out)
        torch.cuda.synchronize()
        o = out.float().cpu()
        keep = torch.ones(H, dtype=torch.bool)
        keep[3] = False
        assert (o[0, keep] == 0).all() and (o[1, keep] == 0).all()
        assert torch.isnan(o[0, 3]).all() and torch.isnan(o[1, 3]).all()
        assert torch.isnan(o[2]).all()
        assert torch.isfinite(o[3:]).all()
        rest = torch.arange(3, T)
        assert_bound(out[rest], q[rest], kv, rows[rest], sink, scale, where=f"scale={scale}")


@pytest.mark.gpu
def test_bad_rows_never_fault(seed):
    """Rows far outside kv (int32 extremes) are masked, never read (compute-sanitizer runs this
    test in tools/device.sh sanitize)."""
    g = torch.Generator().manual_seed(seed)
    q, kv, rows, sink, rot = make_case(4, 16, 70, R=100, g=g)
    rows[:, ::3] = 2 ** 31 - 1
    rows[:, 1::7] = -(2 ** 31)
    out = torch.full_like(q, float("nan"))
    sink_attention(q, kv, rows, sink, 0.05, rotate=rot, out=out)
    torch.cuda.synchronize()
    assert_bound(out, q, kv, rows, sink, 0.05, rot)


@pytest.mark.gpu
def test_deterministic_and_graph_replay(seed):
    """Split merging in a fixed order: two launches are bit-equal. In a captured graph the
    counters reset themselves: every replay with fresh inputs matches its own FP64 value."""
    g = torch.Generator().manual_seed(seed)
    T, H, K = 6, 64, 640
    q, kv, rows, sink, rot = make_case(T, H, K, g=g)
    assert plan(T, H, K)[1] > 1  # the split path
    ws = SinkAttentionWorkspace(T, H, 512)
    out = torch.empty_like(q)
    a = sink_attention(q, kv, rows, sink, 0.04, rotate=rot, out=out, workspace=ws).clone()
    b = sink_attention(q, kv, rows, sink, 0.04, rotate=rot, out=out, workspace=ws).clone()
    assert torch.equal(a, b)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        sink_attention(q, kv, rows, sink, 0.04, rotate=rot, out=out, workspace=ws)
    for i in range(4):
        q2, kv2, rows2, sink2, rot2 = make_case(T, H, K, R=kv.shape[0], g=g)
        for dst, src in ((q, q2), (kv, kv2), (rows, rows2), (sink, sink2), (rot, rot2)):
            dst.copy_(src)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_bound(out, q, kv, rows, sink, 0.04, rot, where=f"replay {i}")
    assert int(ws.counters.abs().sum()) == 0


def test_torch_fallback_matches_definition(seed):
    """The fallback (devices without a CuTe path) on the CPU, within the same bound."""
    g = torch.Generator().manual_seed(seed)
    q, kv, rows, sink, rot = make_case(5, 16, 150, g=g, device="cpu")
    out = sink_attention_torch(q, kv, rows, sink, 0.05, rot)
    assert_bound(out, q, kv, rows, sink, 0.05, rot)


def test_plan():
    """64 heads per CTA when the tokens fill the SMs; else 16 heads and key splits to about one
    CTA per SM, never more splits than key tiles or MAX_SPLITS."""
    assert plan(384, 64, 640, 132) == (64, 1)
    assert plan(132, 64, 640, 132) == (64, 1)
    assert plan(66, 64, 640, 132) == (32, 1)
    assert plan(6, 64, 640, 132) == (16, 5)
    assert plan(1, 16, 640, 132) == (16, 10)
    assert plan(1, 16, 64 * 40, 132) == (16, MAX_SPLITS)
    assert plan(2, 16, 1, 132) == (16, 1)
    for ht in HEAD_TILES:  # every head tile fits the 227 KB a CTA may use, the output tile over the key buffers
        k = SinkAttention(ht, 512, 64)
        assert k.smem_bytes() <= 227 * 1024 and ht * k.o_pitch * 4 <= 2 * KEY_TILE * k.pitch * 2
    for T in range(1, 300, 7):
        for K in (1, 63, 640, 5000):
            ht, sp = plan(T, 64, K, 132)
            assert 64 % ht == 0 and 1 <= sp <= min(MAX_SPLITS, -(-K // KEY_TILE))
            ws = SinkAttentionWorkspace(T, 64, 512, device="cpu", sms=132)
            assert ws.fits(T, 64, 512, ht, sp)


def _args(device="cpu"):
    q = torch.zeros(4, 16, 512, dtype=torch.bfloat16, device=device)
    kv = torch.zeros(10, 512, dtype=torch.bfloat16, device=device)
    rows = torch.zeros(4, 8, dtype=torch.int32, device=device)
    sink = torch.zeros(16, device=device)
    return q, kv, rows, sink


@pytest.mark.parametrize("bad,exc,name", [
    (lambda a: (a[0].float(),) + a[1:], TypeError, "q"),
    (lambda a: (a[0][:, :8].contiguous(),) + a[1:], ValueError, "heads"),
    (lambda a: (a[0][..., :96].contiguous(),) + a[1:], ValueError, "head dim"),
    (lambda a: (a[0], a[1][:, :256].contiguous()) + a[2:], ValueError, "kv"),
    (lambda a: (a[0], a[1].half()) + a[2:], TypeError, "kv"),
    (lambda a: a[:2] + (a[2].long(), a[3]), TypeError, "rows"),
    (lambda a: a[:2] + (a[2][:3], a[3]), ValueError, "rows"),
    (lambda a: a[:3] + (a[3][:8],), ValueError, "sink"),
    (lambda a: a[:3] + (a[3].bfloat16(),), TypeError, "sink"),
])
def test_bad_arguments_raise_before_launch(bad, exc, name):
    args = bad(_args())
    with pytest.raises(exc, match=name):
        sink_attention(*args, 0.1)


def test_bad_scale_rotate_out_and_device():
    q, kv, rows, sink = _args()
    with pytest.raises(TypeError, match="scale"):
        sink_attention(q, kv, rows, sink, float("nan"))
    with pytest.raises(ValueError, match="rotate"):
        sink_attention(q, kv, rows, sink, 0.1, rotate=torch.zeros(4, 2, 32).transpose(1, 2))  # not contiguous
    with pytest.raises(ValueError, match="rotate"):
        sink_attention(q, kv, rows, sink, 0.1, rotate=torch.zeros(3, 32, 2))
    with pytest.raises(ValueError, match="out"):
        sink_attention(q, kv, rows, sink, 0.1, out=torch.zeros(4, 16, 256, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="CUDA"):
        sink_attention(q, kv, rows, sink, 0.1)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("ht", [16, 64])
def test_machine_code(arch, ht):
    """Tensor-core MMAs (64 keys x HT heads x 512 per tile, both products), ldmatrix (the V
    operand transposed), cp.async gathers, no spills -- compiled on the CPU."""
    cubin = sass.compile_cubin("sink_attention", arch, heads_per_cta=ht, dim=512, rope_dim=64)
    h = sass.histogram(sass.disassemble(cubin))
    per_warp = ht * KEY_TILE * 512 // 8 // (16 * 8 * 16)  # one product's m16n8k16 steps per warp
    assert sass.count(h, "HMMA") >= 2 * per_warp
    assert sass.count(h, "LDSM.16.MT88") >= 1 and sass.count(h, "LDSM") >= 8
    assert sass.count(h, "LDGSTS") >= 2 and sass.count(h, "SHFL.BFLY") >= 2
    assert sass.local_memory_ops(h) == 0


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_split_merge_loads_each_split_at_once(arch):
    """The last CTA's merge (16 heads, the plan's split configuration): every split's (m, l) is
    loaded before the first exp2 of the weights, and a split's partial vectors (8 x 16 bytes a
    thread) before their first product -- a memory round trip per split, not per column pair
    and split (what the pair-by-pair loop compiled to)."""
    ops = sass.opcodes(sass.disassemble(sass.compile_cubin("sink_attention", arch, heads_per_cta=16, dim=512,
                                                            rope_dim=64)))
    ml = "".join("L" if o == "LDG.E.64" else "X" if o.startswith("MUFU.EX2") else "" for o in ops)
    assert ml.count("L") == 16 and "L" * 16 + "X" in ml
    part = "".join("L" if o == "LDG.E.128" else "F" if o.startswith("FFMA") else "" for o in ops)
    assert part.count("L") == 8 and "F" + "L" * 8 + "F" in part
