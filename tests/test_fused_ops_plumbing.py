"""CPU check of the fused backend's glue (spec_decode.fused_ops): every kernel it calls is
replaced by a PyTorch implementation of the same contract (built from tests/references.py),
so what is tested is FusedOps itself -- shapes, dtypes, packing, argument order -- against
the baseline ops on the same bf16 weights. The kernels are tested on their own elsewhere."""

import pytest
import torch

import spec_decode.fused_ops as fo
from moe.experts import mxfp8_quantize_torch, expert_gemm_torch, swizzle_scales, silu_mul_interleaved
from moe.router import RouterOutput, capacity, topk_torch
from cute_kernels.compressor_pool import compressor_pool_torch
from cute_kernels.sink_attention import sink_attention_torch
from references import (align_ref, finalize_shared_ref, mhc_post_mix_ref,
                        mhc_pre_mix_ref, mhc_stats_ref, row_rms_ref, v4_indexer_scores_ref)
from cute_kernels.mhc_stats import map_range
from spec_decode.config import ModelConfig
from spec_decode.draft import DraftModel
from spec_decode.model import TargetModel
from spec_decode.step_model import DecodeState, Ops, StepModel


MHC_CALLS = []  # (maps, workspace) per mhc_stats call


def fake_mhc_stats(x, planes, alpha, bias, *, eps, hc_eps, sinkhorn_iters, workspace, out, maps="all"):
    """The part's columns of the FP64 reference from the part's planes; the others untouched."""
    MHC_CALLS.append((maps, workspace))
    first, count = map_range(x.shape[1], maps)
    mp = planes.shape[0] // 2
    phi = torch.zeros(bias.shape[0], planes.shape[1])
    phi[first:first + count] = (planes[:mp].float() + planes[mp:].float())[:count]
    H = mhc_stats_ref(x, phi, alpha, bias, eps, sinkhorn_iters, hc_eps).float()
    out[:, first:first + count] = H[:, first:first + count]
    return out


INDEXER_GROUPS = []  # token_group per indexer call


def fake_indexer_topk(q, w, rows, off, kv_len, pos, *, topk, max_keys, workspace, compress_ratio, token_group=1):
    INDEXER_GROUPS.append(token_group)
    if token_group > 1:  # the kernel is correct for any layout; fast when a group shares its offset
        g = off[: off.numel() // token_group * token_group].view(-1, token_group)
        assert (g == g[:, :1]).all(), "token groups should share kv_offset in the runtime's layout"
    # (the reference's constant scales do not move the selection)
    sc = v4_indexer_scores_ref(q, w, rows, off, kv_len, pos, compress_ratio, max_keys)
    vals, idx = torch.sort(sc, dim=-1, descending=True, stable=True)
    idx = idx[:, :topk].int()
    idx[~torch.isfinite(vals[:, :topk])] = -1
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int32)
    out[:, :idx.shape[1]] = idx
    return out


ATTENTION_CALLS = []  # (tokens, keys) per sink_attention call


def fake_sink_attention(q, kv, rows, sink, scale, *, rotate, workspace):
    """The kernel's contract (cute_kernels.sink_attention, checked against FP64 in
    tests/test_sink_attention.py) in PyTorch; FusedOps passes its own workspace, int32 rows
    inside kv or -1, FP32 sinks and an FP32 rotation."""
    assert workspace is not None and rows.dtype == torch.int32 and sink.dtype == torch.float32
    assert int(rows.max()) < kv.shape[0] and int(rows.min()) >= -1
    assert rotate.dtype == torch.float32 and rotate.shape[0] == q.shape[0]
    ATTENTION_CALLS.append(tuple(rows.shape))
    return sink_attention_torch(q, kv, rows, sink, scale, rotate)


COMPRESSOR_CALLS = []  # (tokens, ratio, overlap) per compressor_pool call


def fake_compressor_pool(fresh, ring, pool, ape, norm_weight, rotate, pos, slot, **kw):
    """The kernel's contract (cute_kernels.compressor_pool, checked against its definition in
    tests/test_compressor_pool.py) in PyTorch."""
    assert fresh.is_contiguous() and pos.dtype == slot.dtype == torch.int32 and rotate.dtype == torch.float32
    COMPRESSOR_CALLS.append((fresh.shape[0], kw["ratio"], kw["overlap"]))
    compressor_pool_torch(fresh, ring, pool, ape, norm_weight, rotate, pos, slot, **kw)


WO_A_CALLS: list = []  # (tokens, the pdl keyword FusedOps passed or None)


def fake_wo_a(o, w, workspace=None, **kw):
    assert w.dim() == 3 and workspace is not None  # FusedOps passes its own split-K workspace
    assert set(kw) <= {"pdl"}
    WO_A_CALLS.append((o.shape[0], kw.get("pdl")))
    T, H, hd = o.shape
    G = w.shape[0]
    return torch.einsum("tgd,grd->tgr", o.reshape(T, G, -1).float(), w.float()).reshape(T, -1).bfloat16()


class FakeRouter:
    def __init__(self, cfg, max_tokens, device=None, *, pdl=False):
        self.cfg, self.tid2eid, self.pdl = cfg, None, pdl

    def set_hash_table(self, t):
        self.tid2eid = t

    def __call__(self, logits, bias=None, token_ids=None):
        c = self.cfg
        assert c.score == "sqrtsoftplus" and c.n_group == 1 and (token_ids is not None) == c.hash_routed
        # the kernel's FP32 arithmetic (moe.router.topk_torch, checked against the FP64 definition
        # in tests/test_moe_router.py): the base arm routes with it too, so the two arms' glue is
        # compared on the same experts and weights -- the FP64 reference's scores round
        # differently in the last bit, and near-ties then pick other experts
        ids, w = topk_torch(logits, bias, c, self.tid2eid, token_ids)
        ids = ids.int()
        counts, offsets, sorted_ids, tile_expert, total = align_ref(ids, c.num_experts, c.tile_m)
        slots, tiles = capacity(c, logits.shape[0])
        sid = torch.full((slots,), ids.numel(), dtype=torch.int32)
        sid[:total] = sorted_ids
        te = torch.full((tiles,), -1, dtype=torch.int32)
        te[:tile_expert.numel()] = tile_expert
        pos = torch.empty(ids.numel(), dtype=torch.int32)
        pos[sorted_ids[sorted_ids < ids.numel()].long()] = torch.nonzero(sorted_ids < ids.numel()).flatten().int()
        return RouterOutput(ids, w, counts, offsets, sid, te, torch.tensor([total], dtype=torch.int32), pos)


def _check_row_pos(sorted_ids, topk, tokens, zero_padding, routed_row_pos):
    """``routed_row_pos`` (the routed rows walked one by one) is the router's: the inverse of
    the live part of ``sorted_ids``, and only with the padding left unwritten."""
    if routed_row_pos is None:
        return
    assert not zero_padding and routed_row_pos.numel() == tokens * topk
    live = torch.nonzero(sorted_ids < tokens * topk).flatten()
    assert torch.equal(routed_row_pos[sorted_ids[live].long()].long(), live)


def fake_quant_routed(x, sorted_ids, total, topk, zero_padding=True, routed_row_pos=None):
    """The routed quantisation; ``zero_padding=False`` leaves padding rows "unwritten" -- here
    the worst case, e4m3 NaN with NaN scale bytes -- so the test proves no consumer mixes a
    padding row into a live one."""
    _check_row_pos(sorted_ids, topk, x.shape[0], zero_padding, routed_row_pos)
    rows, K = sorted_ids.numel(), x.shape[1]
    g = torch.zeros(rows, K, dtype=torch.bfloat16)
    live = sorted_ids < x.shape[0] * topk
    g[live] = x[(sorted_ids[live] // topk).long()]
    q, s = mxfp8_quantize_torch(g)
    if not zero_padding:
        q[~live], s[~live] = 0x7F, 0xFF
    return q.view(torch.float8_e4m3fn), swizzle_scales(s)


def fake_quantize_plain(x, layout="plain", q=None, scales=None):
    """The tokens' MXFP8 (the fused arm's side-stream quantization) into its buffers."""
    assert layout == "plain"
    qq, ss = mxfp8_quantize_torch(x)
    q.view(torch.uint8).copy_(qq)
    scales.copy_(ss)
    return q, scales


def fake_gather_routed(xq, xs, sorted_ids, total, topk, zero_padding=True, routed_row_pos=None):
    """The prequantized tokens' blocks gathered into the routed order; padding rows as
    :func:`fake_quant_routed` leaves them."""
    _check_row_pos(sorted_ids, topk, xq.shape[0], zero_padding, routed_row_pos)
    rows, K = sorted_ids.numel(), xq.shape[1]
    q = torch.zeros(rows, K, dtype=torch.uint8)
    s = torch.zeros(rows, K // 32, dtype=torch.uint8)
    live = sorted_ids < xq.shape[0] * topk
    q[live] = xq.view(torch.uint8)[(sorted_ids[live] // topk).long()]
    s[live] = xs[(sorted_ids[live] // topk).long()]
    if not zero_padding:
        q[~live], s[~live] = 0x7F, 0xFF
    return q.view(torch.float8_e4m3fn), swizzle_scales(s)


EXPERT_CALLS = []  # (max_expert_rows, expert_row_tile) per expert-GEMM call


def _check_bounds(counts, routed_rows, max_expert_rows, expert_row_tile, offs=None, te=None, router_experts=None):
    assert routed_rows is not None and routed_rows >= int(counts.sum())  # the grid bound covers every live row
    if offs is not None:
        # the Hopper kernels' grid covers router tiles [0, grid_tiles(...)): every tile holding
        # one of these experts' live rows must be inside it (an expert-parallel shard's tiles sit
        # among every expert's: the bound takes the router's expert count)
        from moe.experts import grid_tiles

        bound = grid_tiles("fake", te.numel() * 128, te.numel(), router_experts or counts.numel(), routed_rows)
        for e in range(counts.numel()):
            if int(counts[e]):
                assert (int(offs[e]) + int(counts[e]) - 1) // 128 < bound, "live tile outside the kernel's grid"
    EXPERT_CALLS.append((max_expert_rows, expert_row_tile))
    if max_expert_rows is not None:
        # the decode kernel's token tile holds max_expert_rows: it must bound every expert's rows
        assert expert_row_tile is None and max_expert_rows >= int(counts.max())
    elif expert_row_tile is not None:  # row passes: any rows per expert
        assert expert_row_tile in (16, 32, 64)
    # neither: the tiled kernel, any rows per expert


def fake_gate_up(aq, asc, wq, ws, offs, counts, te, routed_rows=None, max_expert_rows=None, expert_row_tile=None,
                 swiglu_limit=None, router_experts=None):
    _check_bounds(counts, routed_rows, max_expert_rows, expert_row_tile, offs, te, router_experts)
    assert swiglu_limit == CFG.swiglu_limit
    rows, K = aq.shape
    E, N, _ = wq.shape
    y = expert_gemm_torch(aq.view(torch.uint8), asc, wq.view(torch.uint8), ws, offs, torch.zeros(rows, N).bfloat16())
    q, s = mxfp8_quantize_torch(silu_mul_interleaved(y, swiglu_limit))
    return q.view(torch.float8_e4m3fn), swizzle_scales(s)


def fake_gemm(aq, asc, wq, ws, offs, counts, te, routed_rows=None, max_expert_rows=None, expert_row_tile=None,
              out=None, router_experts=None):
    """The down GEMM's contract: each expert's live rows ``[offs[e], offs[e] + counts[e])``
    (absolute rows of ``aq``) written, every other row of ``out`` left as it was."""
    _check_bounds(counts, routed_rows, max_expert_rows, expert_row_tile, offs, te, router_experts)
    rows = aq.shape[0]
    y = expert_gemm_torch(aq.view(torch.uint8), asc, wq.view(torch.uint8), ws, offs,
                          torch.zeros(rows, wq.shape[1]).bfloat16())
    if out is None:
        return y
    for e in range(wq.shape[0]):
        lo, n = int(offs[e]), int(counts[e])
        out[lo:lo + n] = y[lo:lo + n]
    return out


def fake_quantize_expert_weights(w):
    E, N, K = w.shape
    qs, ss = zip(*(mxfp8_quantize_torch(w[e]) for e in range(E)))
    return torch.stack(qs).view(torch.float8_e4m3fn), torch.stack([swizzle_scales(s) for s in ss])


def fake_rms_norm(x, eps, weight=None, rotate=None):
    """RMSNorm's rounding points (x's dtype): the FP32 statistic rounded, x times it, times the
    weight -- the statistic from the FP64 reference; with ``rotate`` ([tokens, r/2, 2] cos / sin
    per token, the rows a token's groups), each pair of the last r features of the rounded
    result rotated in FP32 and rounded once."""
    C = x.shape[-1]
    y = x * row_rms_ref(x.reshape(-1, C), eps).float().view(*x.shape[:-1], 1).to(x.dtype)
    y = y if weight is None else y * weight
    if rotate is None:
        return y
    r = 2 * rotate.shape[1]
    rows = y.reshape(-1, C)
    cs = rotate.repeat_interleave(rows.shape[0] // rotate.shape[0], 0).double()
    a, b = rows[:, C - r::2].double(), rows[:, C - r + 1::2].double()
    rot = torch.stack([a * cs[..., 0] - b * cs[..., 1], a * cs[..., 1] + b * cs[..., 0]], -1).flatten(-2)
    return torch.cat([rows[:, :C - r], rot.to(y.dtype)], -1).view(y.shape)


@pytest.fixture
def fakes(monkeypatch):
    monkeypatch.setattr(fo, "mhc_stats", fake_mhc_stats)
    monkeypatch.setattr(fo, "rms_norm", fake_rms_norm)
    monkeypatch.setattr(fo, "mhc_pre_mix", lambda x, H: mhc_pre_mix_ref(x, H))
    monkeypatch.setattr(fo, "mhc_post_mix", lambda x, H, f: mhc_post_mix_ref(x, H, f))
    monkeypatch.setattr(fo, "indexer_topk", fake_indexer_topk)
    monkeypatch.setattr(fo, "wo_a", fake_wo_a)
    monkeypatch.setattr(fo, "MoeRouter", FakeRouter)
    monkeypatch.setattr(fo, "mxfp8_quantize_routed", fake_quant_routed)
    monkeypatch.setattr(fo, "mxfp8_quantize", fake_quantize_plain)
    monkeypatch.setattr(fo, "mxfp8_gather_routed", fake_gather_routed)
    monkeypatch.setattr(fo, "moe_expert_gate_up", fake_gate_up)
    monkeypatch.setattr(fo, "moe_expert_gemm", fake_gemm)
    monkeypatch.setattr(fo, "moe_finalize", lambda y, w, pos, shared=None: finalize_shared_ref(y, w, pos, shared))
    monkeypatch.setattr(fo, "quantize_expert_weights", fake_quantize_expert_weights)
    monkeypatch.setattr(fo, "sink_attention", fake_sink_attention)
    monkeypatch.setattr(fo, "compressor_pool", fake_compressor_pool)


#: every layer kind (window-only hash-routed, CSA hash-routed, HCA) at glue-test sizes (64
#: indexer heads: the fused indexer's)
CFG = ModelConfig(vocab=64, hidden=128, compress_ratios=(0, 4, 16), csa_ratio=4, hca_ratio=16, n_hash_layers=2,
                  heads=4, head_dim=32, rope_dim=16, q_lora=64, wo_groups=2, wo_rank=64, indexer_heads=64,
                  indexer_dim=32, index_topk=4, experts=32, top_k=6, expert_inter=64, shared_inter=64,
                  window=8, draft_feature_layers=(0, 1, 2))


def _models():
    m = TargetModel(CFG, seed=2, dtype=torch.bfloat16)
    m32 = TargetModel(CFG, seed=2, dtype=torch.float32)  # the same draws, unrounded
    m32.w = {k: v.float() for k, v in m.w.items()}
    m32.layers = [{k: v.float() if v.is_floating_point() else v for k, v in L.items()} for L in m.layers]
    return m, m32


def test_each_fused_family_matches_its_baseline(fakes):
    """Family by family on identical inputs: the glue passes the right tensors in the right
    layout (a packing or argument-order slip shows up as an O(1) error)."""
    m, m32 = _models()
    fops, base = fo.FusedOps(m, max_tokens=12, max_len=64, _cpu_for_tests=True), Ops()
    g = torch.Generator().manual_seed(1)
    X = (torch.randn(2, 6, CFG.mhc_n, CFG.hidden, generator=g)).bfloat16()
    for li in range(CFG.layers):
        L, L32 = m.layers[li], m32.layers[li]
        H = fops.mhc_mappings(X, L, "attn", CFG)  # packed [T, 2n + n*n]
        hp, hq, hr = base.mhc_mappings(X.float(), L32, "attn", CFG)
        ref = torch.cat([hp, hq, hr.flatten(-2)], -1).reshape(12, -1)
        assert (H - ref).abs().max() < 1e-3  # phi in bf16 planes vs fp32: same weights, FP32 math
    u = fops.pre_mix(X, H)
    assert (u.float() - base.pre_mix(X.float(), (hp, hq, hr))).abs().max() < 0.05 * X.float().abs().max()
    f = torch.randn(2, 6, CFG.hidden, generator=g).bfloat16()
    X2 = fops.post_mix(X, H, f)
    X2_ref = base.post_mix(X.float(), (hp, hq, hr), f.float())
    assert X2.shape == X.shape and (X2.float() - X2_ref).norm() / X2_ref.norm() < 0.01

    ipool = torch.randn(3, 64 // 4 + 1, 32, generator=g).bfloat16()
    q_idx = torch.randn(2, 6, 64, 32, generator=g).bfloat16()
    w_idx = torch.randn(2, 6, 64, generator=g).bfloat16()
    slots, pos = torch.tensor([1, 0]), torch.arange(6)[None] + torch.tensor([[20], [3]])
    for topk in (4, 100):  # top-k wider than the entries: both return min(topk, entries) columns
        i1, v1 = fops.indexer_topk(q_idx, w_idx, ipool, slots, pos, topk, 4)
        i2, v2 = base.indexer_topk(q_idx.float(), w_idx.float(), ipool.float(), slots, pos, topk, 4)
        assert i1.shape == i2.shape and torch.equal(v1, v2)
        for b in range(2):
            for s_ in range(6):
                assert set(i1[b, s_][v1[b, s_]].tolist()) == set(i2[b, s_][v2[b, s_]].tolist())

    L, L32 = m.layers[1], m32.layers[1]
    o = torch.randn(2, 6, CFG.heads, CFG.head_dim, generator=g).bfloat16()
    y1, y2 = fops.wo_a(o, L["attn.wo_a.weight"], CFG), base.wo_a(o.float(), L32["attn.wo_a.weight"], CFG)
    assert (y1.float() - y2).norm() / y2.norm() < 0.01

    h = torch.randn(12, CFG.hidden, generator=g).bfloat16()
    toks = torch.randint(0, CFG.vocab, (12,), generator=g)
    for li in (1, 2):  # hash-routed, then top-k
        z1, z2 = fops.moe(h, m.layers[li], CFG, toks), base.moe(h.float(), m32.layers[li], CFG, toks)
        assert (z1.float() - z2).norm() / z2.norm() < 0.1  # MXFP8 activations and weights, twice


def test_wo_a_pdl_at_the_decode_kernels_steps_only(fakes):
    """EngineConfig.wo_a_pdl: FusedOps passes ``pdl=True`` to WO-A for steps of up to 16 tokens
    (its decode kernels'), nothing above; off by default; a non-bool is refused by name."""
    m = TargetModel(CFG, seed=3, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    w = m.layers[1]["attn.wo_a.weight"]
    for flag, T, want in ((False, 12, None), (True, 12, True), (True, 16, True), (True, 22, None)):
        fops = fo.FusedOps(m, max_tokens=40, max_len=64, wo_a_pdl=flag, _cpu_for_tests=True)
        WO_A_CALLS.clear()
        o = torch.randn(1, T, CFG.heads, CFG.head_dim, generator=g).bfloat16()
        fops.wo_a(o, w, CFG)
        assert WO_A_CALLS == [(T, want)], (flag, T)
    with pytest.raises(TypeError, match="wo_a_pdl"):
        fo.FusedOps(m, max_tokens=12, max_len=64, wo_a_pdl=1, _cpu_for_tests=True)


def test_router_pdl_reaches_every_router(fakes):
    """EngineConfig.router_pdl: FusedOps builds its routers -- the shared top-k one and each
    hash-routed layer's own -- with ``pdl`` as asked (off by default); a non-bool is refused
    by name."""
    m = TargetModel(CFG, seed=3, dtype=torch.bfloat16)
    for flag in (False, True):
        fops = fo.FusedOps(m, max_tokens=12, max_len=64, router_pdl=flag, _cpu_for_tests=True)
        routers = [fops._layer[id(L)]["router"] for L in m.layers]
        assert sum(r is not fops.router for r in routers) == CFG.n_hash_layers
        assert all(r.pdl is flag for r in routers + [fops.router]), flag
    assert fo.FusedOps(m, max_tokens=12, max_len=64, _cpu_for_tests=True).router.pdl is False
    with pytest.raises(TypeError, match="router_pdl"):
        fo.FusedOps(m, max_tokens=12, max_len=64, router_pdl=1, _cpu_for_tests=True)


def test_moe_ignores_unwritten_padding_rows(fakes, monkeypatch):
    """The routed input as the runtime makes it -- mxfp8_gather_routed / mxfp8_quantize_routed
    with zero_padding=False and the router's routed_row_pos: padding rows left as NaN garbage
    (the emulations' worst case) -- changes no live output against zeroed padding rows: the
    expert GEMMs, the SiLU * up requantisation and the finalize read every routed row on its
    own. Both routed-input paths (tokens quantized first, or the routed rows quantized)."""
    m, _ = _models()
    h = torch.randn(12, CFG.hidden).bfloat16()
    toks = torch.randint(0, CFG.vocab, (12,))
    L = m.layers[2]
    calls = []
    for prequantize in (True, False):
        monkeypatch.setattr(fo.FusedOps, "prequantize_routed_input", prequantize)
        fops = fo.FusedOps(m, max_tokens=12, max_len=64, _cpu_for_tests=True)
        outs = []
        for zero in (False, True):  # the runtime's own arguments, then padding zeroed
            over = {"zero_padding": True, "routed_row_pos": None} if zero else {}
            monkeypatch.setattr(fo, "mxfp8_quantize_routed", lambda *a, over=over, **k: calls.append(
                ("routed", k.get("routed_row_pos") is not None)) or fake_quant_routed(*a, **{**k, **over}))
            monkeypatch.setattr(fo, "mxfp8_gather_routed", lambda *a, over=over, **k: calls.append(
                ("gather", k.get("routed_row_pos") is not None)) or fake_gather_routed(*a, **{**k, **over}))
            outs.append(fops.moe(h, L, CFG, toks))
        assert torch.isfinite(outs[0].float()).all() and torch.equal(outs[0], outs[1])
    # each path taken, the runtime's calls walking the routed rows (routed_row_pos)
    assert {c for c in calls if c[1]} == {("gather", True), ("routed", True)}


@pytest.mark.parametrize("row_tile", [None, 16])
def test_moe_kernel_choice_by_step_tokens(fakes, row_tile):
    """The expert GEMMs get moe.experts.expert_kernel_args's choice for the step's tokens: the
    token count as the rows bound at <= 16 tokens (the decode kernel, one pass); above, the
    decode kernel's row passes with moe_row_tile (the default, 16) -- or, with
    moe_row_tile=None, one pass up to 64 tokens and the tiled kernel (neither keyword) above."""
    m, _ = _models()
    fops = fo.FusedOps(m, max_tokens=80, max_len=64, moe_row_tile=row_tile, _cpu_for_tests=True)
    L = m.layers[2]
    want = {6: (6, None), 40: (40, None) if row_tile is None else (None, 16),
            80: (None, None) if row_tile is None else (None, 16)}
    for T, w in want.items():
        EXPERT_CALLS.clear()
        fops.moe(torch.randn(T, CFG.hidden).bfloat16(), L, CFG, torch.zeros(T, dtype=torch.long))
        assert EXPERT_CALLS == [w, w]  # gate/up, then down
    assert fo.FusedOps(m, max_tokens=8, max_len=64, _cpu_for_tests=True).moe_row_tile == 16  # the default
    with pytest.raises(ValueError, match="moe_row_tile"):
        fo.FusedOps(m, max_tokens=8, max_len=64, moe_row_tile=8, _cpu_for_tests=True)


def _run_steps(model, ops, steps=4):
    """A prefill chunk then decode / verify steps over two requests; -> every step's logits."""
    B, max_len = 2, 64
    st = DecodeState(CFG, 3, max_len, 6, model.dtype, "cpu", draft_stages=CFG.draft_stages)
    sm = StepModel(model, ops)
    g = torch.Generator().manual_seed(4)
    out, start = [], torch.tensor([0, 5])
    for step, S in enumerate([13, 6, 6, 1][:steps]):
        toks = torch.randint(0, CFG.vocab, (B, S), generator=g)
        pos = torch.arange(S)[None] + start[:, None]
        out.append(sm.forward(toks, pos, torch.tensor([1, 0]), st)[0])
        start = start + S
    return out


@pytest.mark.parametrize("group", [1, 3])
def test_fused_step_model_tracks_baseline(fakes, group):
    """Every layer kind through the fused glue over several steps (windows and compressor
    boundaries crossed) against the baseline ops on the FP32 copy of the same weights."""
    m, m32 = _models()
    INDEXER_GROUPS.clear()
    fused = _run_steps(m, fo.FusedOps(m, max_tokens=26, max_len=64, indexer_token_group=group,
                                      _cpu_for_tests=True))
    base = _run_steps(m32, Ops())
    for a, b in zip(fused, base):
        assert torch.isfinite(a.float()).all()
        assert (a.float() - b).norm() / b.norm() < 0.1  # bf16 activations, MXFP8 experts
    assert INDEXER_GROUPS and set(INDEXER_GROUPS) <= {1, group}


def test_release_bf16_experts_keeps_the_fused_logits(fakes):
    """release_bf16_experts (what the fused engine passes) drops the bf16 routed-expert weights
    (the target's and the draft's) and nothing the fused forward reads."""
    out = []
    for release in (False, True):
        m, _ = _models()
        d = DraftModel(CFG, m, seed=3, dtype=torch.bfloat16)
        ops = fo.FusedOps(m, max_tokens=26, max_len=64, draft=d, release_bf16_experts=release, _cpu_for_tests=True)
        for L in m.layers + d.stages:
            assert ("ffn.experts.w1" in L) == (not release) and "ffn.shared_experts.w1.weight" in L
        out.append(_run_steps(m, ops, steps=2)[-1])
    assert torch.equal(out[0], out[1])


def test_base_arm_same_numbers_other_launches(fakes):
    """BaseOps (the reference PR's "before": separate router padding / ID packing, standalone
    finalize then the shared add, main stream) gives the MoE output of FusedOps bit for bit --
    the same formats and rounding points -- through the documented op families."""
    from torch.profiler import ProfilerActivity, profile

    m, _ = _models()
    fused = fo.FusedOps(m, max_tokens=12, max_len=64, _cpu_for_tests=True)
    base = fo.BaseOps(m, max_tokens=12, max_len=64, _cpu_for_tests=True)
    h = torch.randn(12, CFG.hidden).bfloat16()
    toks = torch.randint(0, CFG.vocab, (12,))
    for li in (1, 2):  # hash-routed, then top-k
        want = fused.moe(h, m.layers[li], CFG, toks)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            got = base.moe(h, m.layers[li], CFG, toks)
        assert torch.equal(got, want), li
        fams = {e.name[len("family::"):] for e in prof.events() if e.name.startswith("family::")}
        assert fams == {"router top-k / padding", "ID packing (sort / scatter)", "standalone finalize",
                        "shared-expert add"}, fams
    o = torch.randn(2, 6, CFG.heads, CFG.head_dim).bfloat16()
    w = m.layers[1]["attn.wo_a.weight"]
    assert (base.wo_a(o, w, CFG).float() - fused.wo_a(o, w, CFG).float()).abs().max() <= 2 ** -7 * (
        fused.wo_a(o, w, CFG).float().abs().max())  # cuBLAS order vs the kernel's: bf16 rounding apart


def test_expert_parallel_partials_sum_to_the_whole(fakes):
    """Expert parallelism's glue: each of 2 ranks (its half of the routed experts, half the
    shared expert's width; spec_decode.step_model.Shard) runs FusedOps.moe on its slices with
    the router's full packing -- local offsets, the tile map with other ranks' tiles at -1,
    other experts' weights zeroed in the finalize, rows it never writes in a persistent
    buffer. The ranks' partials, summed in FP32, equal one rank's whole MoE within the bf16
    roundings of the partials (hash-routed and top-k layers)."""
    from spec_decode.step_model import RankView, Shard

    m, _ = _models()
    whole = fo.FusedOps(m, max_tokens=12, max_len=64, _cpu_for_tests=True)
    views = [RankView(m, Shard(CFG, r, 2)) for r in range(2)]
    ranks = [fo.FusedOps(v, max_tokens=12, max_len=64, _cpu_for_tests=True) for v in views]
    g = torch.Generator().manual_seed(3)
    h = torch.randn(12, CFG.hidden, generator=g).bfloat16()
    toks = torch.randint(0, CFG.vocab, (12,), generator=g)
    for li in (1, 2):
        want = whole.moe(h, m.layers[li], CFG, toks).float()
        parts = [ops.moe(h, v.layers[li], CFG, toks, v.shard.first_expert).float() for ops, v in zip(ranks, views)]
        got = parts[0] + parts[1]
        assert float((got - want).norm() / want.norm()) < 2 * 2.0**-8  # two partials' bf16 roundings


def test_numerics_probe_records_every_family(fakes):
    """spec_decode.numerics's probe over a verify step (CPU, the fakes): every op family it
    tabulates -- the norms with and without RoPE included -- is recorded, fused and base agree
    (the same fakes), and each is near its FP32 composite. The model is made as op_errors makes
    it: both backends read one MXFP8 copy of the experts, the FP32 reference the bf16 ones."""
    from spec_decode.model import EXPERT_OPERANDS
    from spec_decode.numerics import FAMILIES, OpProbe, share_experts, summarize, table

    m = TargetModel(CFG, seed=2, dtype=torch.bfloat16, on_layer=share_experts)
    fused, base = (cls(m, max_tokens=26, max_len=64, _cpu_for_tests=True) for cls in (fo.FusedOps, fo.BaseOps))
    for L in m.layers:
        assert fused._layer[id(L)]["gu_q"] is base._layer[id(L)]["gu_q"] is L[EXPERT_OPERANDS[0]]
        assert L["ffn.experts.w1"].dtype == torch.bfloat16
    probe = OpProbe(fused, base, CFG)
    st = DecodeState(CFG, 3, 64, 6, m.dtype, "cpu")
    sm = StepModel(m, probe)
    slots = torch.tensor([0, 1])
    probe.prefill = True  # the chunk: fused vs base only
    sm.forward(torch.randint(0, CFG.vocab, (2, 13)), torch.arange(13)[None].expand(2, -1), slots, st)
    assert not any(probe.errors.values())
    assert {"mhc_mappings", "wo_a", "moe", "indexer_topk"} <= {n for n, e in probe.prefill_errors.items() if e}
    probe.prefill, probe.active = False, True
    sm.forward(torch.randint(0, CFG.vocab, (2, 6)), 13 + torch.arange(6)[None].expand(2, -1), slots, st)
    assert {n for n, e in probe.errors.items() if e} == {n for n, _ in FAMILIES}
    for name in ("rmsnorm", "rmsnorm_rope"):
        for f32, b32, fb in probe.errors[name]:
            assert fb == 0 and f32 < 2 ** -7 and b32 < 2 ** -7, (name, f32, b32, fb)
    # the table: one row per family, the prefill column filled where the chunk called the family
    summary = summarize(probe)
    assert set(summary) == {n for n, _ in FAMILIES}
    assert summary["wo_a"][0] == len(probe.errors["wo_a"]) and summary["wo_a"][4] is not None
    assert summary["sink_attention"][4] is None or summary["sink_attention"][4] >= 0
    text = table("tiny", summary, prefill=13)
    assert "--prefill 13`" in text and "fused vs base, prefill chunk (2 x 13)" in text
    assert len([ln for ln in text.splitlines() if ln.startswith("| ") and "---" not in ln]) == len(FAMILIES) + 1


def test_row_attention_matches_gathered_keys(fakes):
    """Layer by layer on the same state: the row path (the step's rows written into the ring
    first, window / HCA / CSA row indices into the layer buffer, a draft block's rows after its
    context ring, one attention call) and the gathered-keys path give the same output up to
    their rounding difference (the row path rounds once, after the inverse RoPE; the gathered
    one before and after it) and leave the same rings, compressor rows and pools behind, for
    verify steps at every phase of the compressors' windows and for the draft's stages."""
    import copy

    from spec_decode.model import forward_tables

    m, _ = _models()
    d = DraftModel(CFG, m, seed=3, dtype=torch.bfloat16)
    ops = fo.FusedOps(m, max_tokens=26, max_len=64, draft=d, _cpu_for_tests=True)
    d.bind(ops)
    sm = StepModel(m, ops)
    st = DecodeState(CFG, 3, 64, 6, m.dtype, "cpu", draft_stages=CFG.draft_stages)
    g = torch.Generator().manual_seed(4)
    slots, start = torch.tensor([1, 0]), torch.tensor([0, 5])
    ops.row_attention = False
    toks = torch.randint(0, CFG.vocab, (2, 13), generator=g)
    pos = torch.arange(13)[None] + start[:, None]
    feats = sm.forward(toks, pos, slots, st)[1]
    d.write_context(feats, pos, slots, torch.ones_like(pos, dtype=torch.bool), st)
    start = start + 13
    checked = set()
    for step in range(8):  # positions 13 .. 60: every phase of m = 4 and 16
        pos = torch.arange(6)[None] + start[:, None]
        layers = [(L, li, None) for li, L in enumerate(sm.layers)] + [(L, s, st.draft_win[s])
                                                                       for s, L in enumerate(d.layers)]
        for layer, li, win in layers:
            h = (torch.randn(2, 6, CFG.hidden, generator=g) * 0.5).bfloat16()
            B, S, _ = h.shape
            L = layer.L
            qr = ops.rmsnorm(h @ L["attn.wq_a.weight"].T, CFG.eps, L["attn.q_norm.weight"])
            q = ops.rmsnorm_rope((qr @ L["attn.wq_b.weight"].T).view(B, S, layer.heads, CFG.head_dim), CFG.eps,
                                 None, pos, layer.inv)
            kv = layer.kv(h, pos)
            states, out = [copy.deepcopy(st), copy.deepcopy(st)], []
            for row, sx in zip((True, False), states):
                w = None if win is None else sx.draft_win[li]
                with forward_tables():
                    if row:
                        out.append(layer.row_attention(q, kv, h, qr, pos, slots, sx, li, w, None).float())
                    else:
                        out.append(layer.gathered_attention(q, kv, h, qr, pos, slots, sx, li, w, win is None,
                                                            None).float())
            a, b = out
            assert float((a - b).abs().max()) <= 2 ** -7 * float(b.abs().max()), (step, li, win is None)
            for x, y in zip(states[0].kv + states[0].draft_win, states[1].kv + states[1].draft_win):
                assert torch.equal(x[:, :st.win_rows + 1] if x.dim() == 3 else x,
                                   y[:, :st.win_rows + 1] if y.dim() == 3 else y)
            for name in ("crows", "irows", "ipool"):
                for k in getattr(states[0], name):
                    assert torch.equal(getattr(states[0], name)[k], getattr(states[1], name)[k]), name
            checked.add((layer.ratio, win is None))
        st = states[1]
        start = start + 6
    assert checked == {(0, True), (CFG.csa_ratio, True), (CFG.hca_ratio, True), (0, False)}


def test_row_attention_in_the_step_and_draft_forwards(fakes):
    """Every decode / verify layer and every draft stage takes the row path (one attention call
    each, with the window / HCA / CSA key counts); prefill chunks wider than the lookahead
    gather their keys."""
    m, _ = _models()
    d = DraftModel(CFG, m, seed=3, dtype=torch.bfloat16)
    ops = fo.FusedOps(m, max_tokens=26, max_len=64, draft=d, _cpu_for_tests=True)
    d.bind(ops)
    st = DecodeState(CFG, 3, 64, 6, m.dtype, "cpu", draft_stages=CFG.draft_stages)
    sm = StepModel(m, ops)
    g = torch.Generator().manual_seed(4)
    slots, start = torch.tensor([1, 0]), torch.tensor([0, 5])
    ATTENTION_CALLS.clear()
    for S in (13, 6, 1):
        toks = torch.randint(0, CFG.vocab, (2, S), generator=g)
        pos = torch.arange(S)[None] + start[:, None]
        feats = sm.forward(toks, pos, slots, st)[1]
        d.write_context(feats, pos, slots, torch.ones_like(pos, dtype=torch.bool), st)
        start = start + S
    d.forward_block(toks[:, -1], start - 1, slots, st)
    assert len(ATTENTION_CALLS) == 2 * CFG.layers + CFG.draft_stages
    assert {k for _, k in ATTENTION_CALLS} == {CFG.window, CFG.window + 64 // CFG.hca_ratio,
                                               CFG.window + CFG.index_topk}


def test_compress_step_matches_the_composite(fakes):
    """FusedOps.compress_step (one product, compressor_pool) against the composite of
    V4Layer._close_windows on the same state, for the main and indexer compressors of CSA and
    HCA layers over verify steps at every phase of their windows: the same ring rows, and pool
    entries equal up to one bf16 ulp (the norm's FP32 statistic order), nothing else written."""
    import copy

    m, _ = _models()
    ops = fo.FusedOps(m, max_tokens=26, max_len=64, _cpu_for_tests=True)
    sm = StepModel(m, ops)
    st = DecodeState(CFG, 3, 64, 6, m.dtype, "cpu")
    g = torch.Generator().manual_seed(5)
    slots, start = torch.tensor([2, 0]), torch.tensor([0, 3])
    COMPRESSOR_CALLS.clear()
    seen = set()
    for step in range(9):
        pos = torch.arange(6)[None] + start[:, None]
        for li, layer in enumerate(sm.layers):
            if not layer.ratio:
                continue
            h = (torch.randn(2, 6, CFG.hidden, generator=g) * 0.5).bfloat16()
            prefixes = [("attn.compressor.", st.crows, st.pool)]
            if layer.ratio == CFG.csa_ratio:
                prefixes.append(("attn.indexer.compressor.", st.irows, st.ipool))
            for prefix, rings, pools in prefixes:
                a, b = copy.deepcopy(st), copy.deepcopy(st)
                ring_a = getattr(a, "crows" if rings is st.crows else "irows")[li]
                pool_a = getattr(a, "pool" if pools is st.pool else "ipool")[li]
                ring_b = getattr(b, "crows" if rings is st.crows else "irows")[li]
                pool_b = getattr(b, "pool" if pools is st.pool else "ipool")[li]
                layer._close_windows(h, pos, slots, prefix, ring_a, pool_a, layer.inv_c)
                ops.compress_step, saved = None, ops.compress_step
                layer._close_windows(h, pos, slots, prefix, ring_b, pool_b, layer.inv_c)
                ops.compress_step = saved
                assert torch.equal(ring_a, ring_b)
                n = pool_a.shape[1] - 1  # the composite also writes the discarded last row
                diff = (pool_a[:, :n].float() - pool_b[:, :n].float()).abs()
                assert float(diff.max()) <= 2 ** -7 * float(pool_b[:, :n].float().abs().max()), (step, li, prefix)
                seen.add((layer.ratio, prefix))
            st = b
        start = start + 6
    assert seen == {(CFG.csa_ratio, "attn.compressor."), (CFG.csa_ratio, "attn.indexer.compressor."),
                    (CFG.hca_ratio, "attn.compressor.")}
    assert COMPRESSOR_CALLS


def test_mhc_mappings_in_two_parts_equal_one_launch(fakes):
    """The fused arm computes each sublayer's mappings as H_pre (main workspace) and H_post /
    H_res (the side stream's workspace); the base arm in one launch; hc_head H_pre only. The
    step's outputs equal the one-launch mappings' (the parts are the same columns)."""
    class OneLaunch(fo.FusedOps):
        split_mhc = False

    m, _ = _models()
    out = {}
    for cls in (fo.FusedOps, OneLaunch, fo.BaseOps):
        ops = cls(m, max_tokens=26, max_len=64, _cpu_for_tests=True)
        st = DecodeState(CFG, 3, 64, 6, m.dtype, "cpu", draft_stages=CFG.draft_stages)
        sm = StepModel(m, ops)
        slots = torch.tensor([1, 0])
        g = torch.Generator().manual_seed(2)
        sm.forward(torch.randint(0, CFG.vocab, (2, 9), generator=g), torch.arange(9)[None].expand(2, -1), slots, st)
        MHC_CALLS.clear()
        out[cls] = sm.forward(torch.randint(0, CFG.vocab, (2, 6), generator=g),
                              9 + torch.arange(6)[None].expand(2, -1), slots, st)
        calls = list(MHC_CALLS)
        sublayers = 2 * CFG.layers
        if cls is fo.FusedOps:
            assert [c[0] for c in calls] == ["post_res", "pre"] * sublayers + ["pre"]
            assert all(w is ops.mhc_side_ws for p, w in calls if p == "post_res")
            assert all(w is ops.mhc_ws for p, w in calls if p == "pre")
        else:
            assert [c[0] for c in calls] == ["all"] * sublayers + ["pre"]
    a, b = out[fo.FusedOps], out[OneLaunch]
    for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
        assert torch.equal(x, y)


def test_hc_head_through_the_mappings_kernels(fakes):
    """FusedOps.hc_head (mhc_stats with hc_head's weights as the H_pre rows, then mhc_pre_mix)
    against the composite for the target's and the draft's collapse: within one bf16 rounding
    of the output (the two sum in different orders) -- a wrong row of phi, bias or scale is an
    O(1) error."""
    m, _ = _models()
    d = DraftModel(CFG, m, seed=3, dtype=torch.bfloat16)
    ops = fo.FusedOps(m, max_tokens=26, max_len=64, draft=d, _cpu_for_tests=True)
    g = torch.Generator().manual_seed(6)
    for W in (m.w, d.w):
        W["hc_head_scale"] = W["hc_head_scale"] * 0 + 1.5  # a scale other than 1 is applied
        ops = fo.FusedOps(m, max_tokens=26, max_len=64, draft=d, _cpu_for_tests=True)
        X = torch.randn(2, 6, CFG.mhc_n, CFG.hidden, generator=g).bfloat16()
        got, want = ops.hc_head(X, W, CFG).float(), Ops().hc_head(X, W, CFG).float()
        assert float((got - want).abs().max()) <= 2 ** -7 * float(want.abs().max())
        # the composite's weights, perturbed, move it: the comparison can fail
        W2 = dict(W, hc_head_base=W["hc_head_base"] + 1)
        assert float((Ops().hc_head(X, W2, CFG).float() - got).abs().max()) > 2 ** -5 * float(want.abs().max())


def test_experts_converted_as_the_model_is_made(fakes):
    """A model made with ``on_layer=quantize_layer_experts`` (what the kernel engines build:
    no bf16 copy of every layer's experts at once) draws the same weights as a plain one,
    holds only the MXFP8 expert operands, and gives FusedOps the operands it would have made
    from the bf16 experts -- also through a tensor-parallel rank's view (whole experts)."""
    from spec_decode.step_model import RankView, Shard

    plain = TargetModel(CFG, seed=2, dtype=torch.bfloat16)
    made = TargetModel(CFG, seed=2, dtype=torch.bfloat16, on_layer=fo.quantize_layer_experts)
    d_plain = DraftModel(CFG, plain, seed=3, dtype=torch.bfloat16)
    d_made = DraftModel(CFG, made, seed=3, dtype=torch.bfloat16, on_layer=fo.quantize_layer_experts)
    for Lp, Lm in zip(plain.layers + d_plain.stages, made.layers + d_made.stages):
        assert not any(k in Lm for k in ("ffn.experts.w1", "ffn.experts.w3", "ffn.experts.w2"))
        assert set(Lm) - set(fo.EXPERT_OPERANDS) == set(Lp) - {"ffn.experts.w1", "ffn.experts.w3", "ffn.experts.w2"}
        for k in set(Lp) & set(Lm):
            assert torch.equal(Lp[k], Lm[k]), k  # the conversion draws nothing
    ops_plain = fo.FusedOps(plain, max_tokens=12, max_len=64, draft=d_plain, _cpu_for_tests=True)
    ops_made = fo.FusedOps(made, max_tokens=12, max_len=64, draft=d_made, _cpu_for_tests=True)
    for Lp, Lm in zip(plain.layers + d_plain.stages, made.layers + d_made.stages):
        Pp, Pm = ops_plain._layer[id(Lp)], ops_made._layer[id(Lm)]
        for k in ("gu_q", "gu_s", "d_q", "d_s"):
            assert torch.equal(Pp[k].view(torch.uint8), Pm[k].view(torch.uint8)), k
    from spec_decode.weights import named_tensors

    with pytest.raises(ValueError, match="converted to MXFP8"):  # a checkpoint loads into bf16 experts
        named_tensors(made)
    tp = 2  # CFG's two WO-A groups
    for r in range(tp):
        vp, vm = RankView(plain, Shard(CFG, r, tp)), RankView(made, Shard(CFG, r, tp))
        rank_plain = fo.FusedOps(vp, max_tokens=12, max_len=64, _cpu_for_tests=True)
        rank_made = fo.FusedOps(vm, max_tokens=12, max_len=64, _cpu_for_tests=True)
        for Lp, Lm in zip(vp.layers, vm.layers):
            Pp, Pm = rank_plain._layer[id(Lp)], rank_made._layer[id(Lm)]
            assert Pm["gu_q"].shape[0] == CFG.experts // tp
            for k in ("gu_q", "gu_s", "d_q", "d_s"):
                assert torch.equal(Pp[k].view(torch.uint8), Pm[k].view(torch.uint8)), (r, k)


@pytest.mark.parametrize("arm", ["fused", "base"])
def test_expert_parallel_output_buffer_is_never_replaced(fakes, arm):
    """A rank's expert-parallel down-projection output is one buffer for the largest step,
    made on first use: a decode step's graph captured before a larger prefill chunk keeps
    writing the memory it captured (the base arm packs its routed rows per step's T, so a
    buffer grown for the chunk would free the captured one)."""
    from spec_decode.step_model import RankView, Shard

    m, _ = _models()
    view = RankView(m, Shard(CFG, 1, 2))
    ops = (fo.FusedOps if arm == "fused" else fo.BaseOps)(view, max_tokens=80, max_len=64, _cpu_for_tests=True)
    g = torch.Generator().manual_seed(4)
    ptrs = []
    for T in (6, 80, 1, 80):  # a verify step, a prefill chunk, a decode step, a chunk again
        h = torch.randn(T, CFG.hidden, generator=g).bfloat16()
        toks = torch.randint(0, CFG.vocab, (T,), generator=g)
        ops.moe(h, view.layers[1], CFG, toks, view.shard.first_expert)
        ptrs.append(ops._y.data_ptr())
    assert len(set(ptrs)) == 1


@pytest.mark.parametrize("arm", ["fused", "base"])
def test_expert_parallel_stale_rows_never_reach_the_output(fakes, arm):
    """Rows of the expert-parallel output that this step's GEMMs do not write hold whatever an
    earlier step left (a padding row's output of unwritten input bytes: NaN in recycled
    memory). Poisoned with NaN between two identical steps, they change nothing: another
    rank's routed rows are read from the buffer's zero row, not from stale rows."""
    from spec_decode.step_model import RankView, Shard

    m, _ = _models()
    view = RankView(m, Shard(CFG, 1, 2))
    ops = (fo.FusedOps if arm == "fused" else fo.BaseOps)(view, max_tokens=12, max_len=64, _cpu_for_tests=True)
    g = torch.Generator().manual_seed(5)
    h = torch.randn(6, CFG.hidden, generator=g).bfloat16()
    toks = torch.randint(0, CFG.vocab, (6,), generator=g)
    L = view.layers[1]
    want = ops.moe(h, L, CFG, toks, view.shard.first_expert)
    assert torch.isfinite(want.float()).all()
    ops._y[:-1].fill_(float("nan"))  # every row but the zero row
    got = ops.moe(h, L, CFG, toks, view.shard.first_expert)
    assert torch.equal(got, want)
    assert (ops._y[-1] == 0).all()


def test_routed_input_quantized_before_the_router_on_the_fused_arm(fakes, monkeypatch):
    """The fused arm quantizes the step's tokens (on the side stream, beside the router) and
    gathers their bytes; the base arm quantizes the gathered rows after the router. Same
    expert outputs."""
    calls = []
    monkeypatch.setattr(fo, "mxfp8_gather_routed", lambda *a, **k: calls.append("gather") or fake_gather_routed(*a, **k))
    monkeypatch.setattr(fo, "mxfp8_quantize_routed", lambda *a, **k: calls.append("routed") or fake_quant_routed(*a, **k))
    m, _ = _models()
    g = torch.Generator().manual_seed(6)
    h = torch.randn(6, CFG.hidden, generator=g).bfloat16()
    toks = torch.randint(0, CFG.vocab, (6,), generator=g)
    out = {}
    for arm in (fo.FusedOps, fo.BaseOps):
        calls.clear()
        out[arm] = arm(m, max_tokens=12, max_len=64, _cpu_for_tests=True).moe(h, m.layers[2], CFG, toks)
        assert calls == (["gather"] if arm is fo.FusedOps else ["routed"])
    assert torch.equal(out[fo.FusedOps], out[fo.BaseOps])
