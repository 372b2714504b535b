"""Fused router (grouped top-k + moe_align_block_size) against tests/references.py."""

import dataclasses

import pytest
import torch

import moe.router as router_mod
from cute_kernels.testing import sass
from moe.router import (CLUSTER_CTAS, V4_FLASH_HASH_ROUTER, V4_FLASH_ROUTER, V4_PRO_HASH_ROUTER, V4_PRO_ROUTER,
                        MoeRouter, RouterConfig, buffer_layout, capacity, route, topk_torch)
from conftest import capture_after_warm_up
from references import align_ref, expert_scores_ref, grouped_topk_ref, hash_route_ref, routing_weights_ref

CONFIGS = [
    RouterConfig(),  # DeepSeek-V3: E=256, 8 groups, keep 4, k=8, sigmoid, scale 2.5, tile 128
    RouterConfig(num_experts=64, n_group=1, topk_group=1, top_k=6, routed_scaling_factor=1.0, tile_m=16),
    RouterConfig(num_experts=160, n_group=8, topk_group=3, top_k=6, routed_scaling_factor=16.0, tile_m=64),
    V4_FLASH_ROUTER,  # DeepSeek-V4-Flash: E=256, no groups, k=6, sqrt-softplus, scale 1.5
    V4_PRO_ROUTER,  # DeepSeek-V4-Pro: E=384, no groups, k=6, sqrt-softplus, scale 2.5
    dataclasses.replace(V4_FLASH_ROUTER, n_group=4, topk_group=2, top_k=8),  # sqrt-softplus with groups
]
CONFIG_IDS = ["dsv3", "E64g1", "E160g8", "v4flash", "v4pro", "sqrtsoftplus_g4"]


@pytest.fixture(params=["default", "cluster4", "cluster8"])
def router_path(request, monkeypatch):
    """The host's own choice of path for T, or the cluster path (of 4 or 8 CTAs) for every T it
    takes (T <= 64: the single-CTA threshold set to 0, the cluster threshold to 64). A test then
    skips T the cluster path does not take."""
    if request.param.startswith("cluster"):
        monkeypatch.setattr(router_mod, "SINGLE_CTA_MAX_TOKENS", 0)
        monkeypatch.setattr(router_mod, "CLUSTER_MAX_TOKENS", router_mod.CLUSTER_CAPACITY)
        monkeypatch.setattr(router_mod, "CLUSTER_CTAS", 8 if request.param == "cluster8" else 4)
    return request.param


def needs_path(path: str, T: int) -> None:
    if path.startswith("cluster") and T > router_mod.CLUSTER_CAPACITY:
        pytest.skip("the cluster path takes T <= 64")


def valid_under_rounding(picks, b, cfg, tol: float = 1e-6) -> bool:
    """Whether ``picks`` (one token's k experts, in selection order) is the selection of the
    rule in the module docstring for selection scores ``b`` (the float64 definition's, FP32)
    moved by at most ``tol`` each: the kernel's FP32 scores differ from those by an ulp or two,
    so where two experts -- or, with groups, two groups' top-2 sums -- tie within that, either
    choice is right. Checked: distinct experts, in descending order; with groups, at most
    ``topk_group`` groups picked from, none of them outside the near-top groups, and every group
    strictly better than a picked-from group kept too; no expert of a kept group left out that
    beats the last pick."""
    E, G, TG, k = cfg.num_experts, cfg.n_group, cfg.topk_group, cfg.top_k
    picks = picks.long()
    v = b[picks]
    if len(set(picks.tolist())) != k or bool((v[1:] > v[:-1] + tol).any()):
        return False
    allowed = torch.ones(E, dtype=torch.bool)
    if G > 1:
        gs = E // G
        top2 = torch.sort(b.view(G, gs), dim=-1, descending=True).values[:, :2]
        g = top2[:, 0] + top2[:, 1]
        picked = sorted(set((picks // gs).tolist()))
        threshold = torch.sort(g, descending=True).values[TG - 1]
        if len(picked) > TG or bool((g[picked] < threshold - 2 * tol).any()):
            return False
        kept = set(picked) | set(torch.nonzero(g > g[picked].min() + 2 * tol).flatten().tolist())
        if len(kept) > TG:
            return False
        allowed = torch.zeros(G, dtype=torch.bool)
        allowed[sorted(kept)] = True
        allowed = allowed.repeat_interleave(gs)
    allowed[picks] = False
    return not bool((b[allowed] > v[-1] + tol).any())


def check_ids_and_weights(ids, w, logits, bias, cfg):
    """Ids must match the reference; a token may differ only where its selection is the rule's
    under rounding of the scores (:func:`valid_under_rounding`: the kernel's FP32 exp / log1p /
    sqrt and the float64 definition round differently by an ulp or two). Weights, every token:
    the definition's for the kernel's picks (their scores normalised in selection order, times
    the scale) -- a ratio of k scores of a few ulp each."""
    rid, rw, _ = grouped_topk_ref(logits.cpu(), bias.cpu() if bias is not None else None, cfg.n_group,
                                  cfg.topk_group, cfg.top_k, cfg.routed_scaling_factor, cfg.score)
    s = expert_scores_ref(logits.cpu(), cfg.score)
    b = s + bias.cpu().float() if bias is not None else s  # the selection scores, before any group mask
    ids, w = ids.cpu(), w.cpu()
    same = (ids == rid).all(1)
    for t in torch.nonzero(~same).flatten().tolist():
        assert valid_under_rounding(ids[t], b[t], cfg), (t, ids[t], rid[t])
    want = routing_weights_ref(s, ids, cfg.routed_scaling_factor)
    assert torch.equal(want[same], rw[same])  # (the reference's own weights where the picks agree)
    assert torch.allclose(w, want, rtol=2e-6 if cfg.score == "sigmoid" else 4e-6, atol=0)


def test_rounding_tolerant_check_accepts_near_ties_and_refuses_wrong_picks():
    """The check above, on the CPU: selections by the rule in FP32 (group sums and expert
    scores rounded differently from the reference's) pass even where the groups kept differ;
    a pick replaced by a worse expert, a pick from a group no rounding keeps, and a repeated
    expert fail. bf16 logits at T = 4096 tie often: sigmoid saturates."""
    cfg = RouterConfig()
    logits = (torch.randn(4096, 256) * 4).bfloat16().float()
    ids32, _ = topk_torch(logits, None, cfg)  # the rule in FP32 (torch's sigmoid: another rounding)
    s = expert_scores_ref(logits, cfg.score)
    rid, _, _ = grouped_topk_ref(logits, None, cfg.n_group, cfg.topk_group, cfg.top_k, cfg.routed_scaling_factor)
    for t in range(logits.shape[0]):
        assert valid_under_rounding(ids32[t], s[t], cfg), t
    t = 0
    gs = 256 // cfg.n_group
    worst = int(torch.argmin(s[t]))
    bad = rid[t].clone()
    bad[-1] = worst if worst not in bad.tolist() else int(torch.argsort(s[t])[1])
    assert not valid_under_rounding(bad, s[t], cfg)
    g = torch.sort(s[t].view(cfg.n_group, gs), -1, descending=True).values[:, :2].sum(-1)
    worst_group = int(torch.argmin(g))
    bad = rid[t].clone()
    bad[-1] = worst_group * gs + int(torch.argmax(s[t].view(cfg.n_group, gs)[worst_group]))
    assert not valid_under_rounding(bad, s[t], cfg)
    bad = rid[t].clone()
    bad[-1] = bad[0]
    assert not valid_under_rounding(bad, s[t], cfg)


def check_align(out, T, cfg):
    ids = out.topk_ids[:T].cpu()
    counts, offsets, sorted_ids, tile_expert, total = align_ref(ids, cfg.num_experts, cfg.tile_m)
    assert int(out.total_rows.item()) == total
    assert torch.equal(out.expert_counts.cpu(), counts)
    assert torch.equal(out.expert_offsets.cpu(), offsets)
    assert torch.equal(out.sorted_token_ids.cpu()[:total], sorted_ids)
    nt = total // cfg.tile_m
    te = out.tile_expert.cpu()
    assert torch.equal(te[:nt], tile_expert) and (te[nt:] == -1).all()
    pos = out.routed_row_pos[: T * cfg.top_k].cpu().long()
    assert torch.equal(sorted_ids[pos], torch.arange(T * cfg.top_k, dtype=torch.int32))


def poison(r: MoeRouter):
    for t in (r.topk_ids, r.expert_counts, r.expert_offsets, r.sorted_token_ids, r.tile_expert, r.total_rows,
              r.routed_row_pos):
        t.fill_(-12345)
    r.topk_weights.fill_(float("nan"))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("T", [1, 5, 32, 33, 64, 65, 320, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_router_matches_reference(seed, cfg, T, dtype, with_bias, router_path):
    needs_path(router_path, T)
    r = MoeRouter(cfg, max_tokens=T)
    logits = (torch.randn(T, cfg.num_experts, device="cuda") * 4).to(dtype)
    bias = torch.randn(cfg.num_experts, device="cuda") * 0.5 if with_bias else None
    poison(r)
    out = r(logits, bias)
    torch.cuda.synchronize()
    check_ids_and_weights(out.topk_ids, out.topk_weights, logits.float(), bias, cfg)
    check_align(out, T, cfg)
    assert (r.workspace == 0).all()  # re-zeroed for the next launch


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [V4_FLASH_ROUTER, V4_PRO_ROUTER], ids=["v4flash", "v4pro"])
def test_sqrtsoftplus_extreme_logits(seed, cfg):
    """Logits far out on both sides (+-80: softplus's exp would overflow or its log1p round
    to 0 in a naive FP32 form) and exact zeros: finite scores, the reference's picks."""
    T = 64
    r = MoeRouter(cfg, max_tokens=T)
    logits = torch.randn(T, cfg.num_experts, device="cuda") * 4
    logits[::4, ::3] = 80.0
    logits[1::4, ::2] = -80.0
    logits[2::4] = 0.0
    poison(r)
    out = r(logits, None)
    torch.cuda.synchronize()
    assert torch.isfinite(out.topk_weights).all()
    check_ids_and_weights(out.topk_ids, out.topk_weights, logits, None, cfg)
    check_align(out, T, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [RouterConfig(), V4_FLASH_ROUTER], ids=["dsv3", "v4flash"])
@pytest.mark.parametrize("T", [5, 65])  # the single-CTA path and the grid's
def test_nan_logits_pick_real_experts(seed, cfg, T, router_path):
    """NaN logits (one in a row, several, a whole row) rank first, ties to the lower index
    (torch.sort's order, the reference's): every pick a real expert, the NaN picks the
    reference's and the rest its picks up to FP32-rounding near-ties (sigmoid saturates near
    |logit| = 12, where scores tie in FP32 but not in float64), a row's weights NaN exactly
    where it picked a NaN score; the layout stays consistent."""
    needs_path(router_path, T)
    E = cfg.num_experts
    logits = torch.randn(T, E, device="cuda") * 4
    logits[0, 7] = float("nan")
    logits[1, 3::17] = float("nan")
    logits[2] = float("nan")
    logits[4, -1] = float("nan")
    r = MoeRouter(cfg, max_tokens=T)
    poison(r)
    out = r(logits, None)
    torch.cuda.synchronize()
    rid, rw, b = grouped_topk_ref(logits.cpu(), None, cfg.n_group, cfg.topk_group, cfg.top_k,
                                  cfg.routed_scaling_factor, cfg.score)
    ids, w = out.topk_ids.cpu(), out.topk_weights.cpu()
    assert ((ids >= 0) & (ids < E)).all()
    nan_rows = [0, 1, 2, 4]
    assert torch.isnan(w[nan_rows]).all()
    for t in nan_rows:  # the NaN picks exactly the reference's; after them, its picks up to near-ties
        got, want = b[t, ids[t].long()], b[t, rid[t].long()]
        assert torch.equal(torch.isnan(got), torch.isnan(want)), t
        assert torch.equal(ids[t][torch.isnan(got)], rid[t][torch.isnan(want)]), t
        assert torch.allclose(got[~torch.isnan(got)], want[~torch.isnan(want)], rtol=0, atol=1e-6), t
    for t in range(T):  # the other rows: the reference's picks up to FP32-rounding near-ties
        if t not in nan_rows and not torch.equal(ids[t], rid[t]):
            assert torch.allclose(b[t, ids[t].long()], b[t, rid[t].long()], rtol=0, atol=1e-6), t
        elif t not in nan_rows:
            assert torch.allclose(w[t], rw[t], rtol=4e-6, atol=0), t
    check_align(out, T, cfg)
    assert (r.workspace == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 320])
def test_ties_lower_index_wins(seed, T, router_path):
    needs_path(router_path, T)
    cfg = RouterConfig()
    # few distinct logit values -> many exact ties among experts and among groups
    logits = torch.randint(-2, 3, (T, 256), device="cuda").float()
    r = MoeRouter(cfg, max_tokens=T)
    poison(r)
    out = r(logits, None)
    torch.cuda.synchronize()
    rid, rw, _ = grouped_topk_ref(logits.cpu(), None, 8, 4, 8, 2.5)
    assert torch.equal(out.topk_ids.cpu(), rid)
    assert torch.allclose(out.topk_weights.cpu(), rw, rtol=2e-6, atol=0)
    check_align(out, T, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [6, 65])  # the single-CTA path (masks re-zeroed in shared memory) and the grid's
def test_graph_replay_with_changing_inputs(seed, T, router_path):
    needs_path(router_path, T)
    cfg = RouterConfig()
    r = MoeRouter(cfg, max_tokens=T)
    logits = torch.randn(T, 256, device="cuda")
    bias = torch.randn(256, device="cuda") * 0.1
    r(logits, bias)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        r(logits, bias)
    for _ in range(5):
        logits.copy_(torch.randn(T, 256, device="cuda") * 3)
        poison(r)
        g.replay()
        torch.cuda.synchronize()
        check_ids_and_weights(r.topk_ids, r.topk_weights, logits, bias, cfg)
        check_align(r, T, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [V4_FLASH_ROUTER, V4_PRO_ROUTER], ids=["v4flash", "v4pro"])
@pytest.mark.parametrize("T", [6, 40, 200])  # the single-CTA path, the cluster's, the grid's
def test_programmatic_dependent_chain_in_a_graph(seed, cfg, T):
    """``pdl=True``: a CUDA graph of a torch copy into the logits, then two routers launched as
    programmatic dependents (each triggers its dependents on entry, so the second one's set-up
    runs beside the first). Every replay takes fresh logits and poisoned outputs; both routers
    must give the reference's picks and layout and the bytes of a router launched without PDL
    -- a read of the logits before the copy finished would route the previous replay's."""
    E = cfg.num_experts
    src = torch.empty(T, E, device="cuda")
    logits = torch.empty_like(src)
    bias = torch.randn(E, device="cuda") * 0.1
    routers = [MoeRouter(cfg, max_tokens=T, pdl=True) for _ in range(2)]
    plain = MoeRouter(cfg, max_tokens=T)

    def chain():
        logits.copy_(src)
        for r in routers:
            r(logits, bias)

    src.normal_()
    g = capture_after_warm_up(chain)
    fields = ("topk_ids", "topk_weights", "expert_counts", "expert_offsets", "total_rows", "routed_row_pos")
    for _ in range(4):
        src.copy_(torch.randn(T, E, device="cuda") * 3)
        for r in routers:
            poison(r)
        g.replay()
        torch.cuda.synchronize()
        want = plain(src, bias)
        torch.cuda.synchronize()
        check_ids_and_weights(want.topk_ids, want.topk_weights, src, bias, cfg)
        for r in routers:
            check_align(r, T, cfg)
            for f in fields:
                assert torch.equal(getattr(r, f)[:getattr(want, f).shape[0]].view(torch.int32),
                                   getattr(want, f).view(torch.int32)), f


def random_table(vocab, E, k, gen=None):
    """A tid2eid table: each row k distinct experts."""
    return torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(vocab)]).int()


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [V4_FLASH_HASH_ROUTER, V4_PRO_HASH_ROUTER], ids=["v4flash", "v4pro"])
@pytest.mark.parametrize("T", [1, 5, 32, 33, 64, 65, 320, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hash_routing_matches_reference(seed, cfg, T, dtype, router_path):
    needs_path(router_path, T)
    """Experts straight from the table (exactly), weights from the scores of those experts,
    and the padded packed layout; token ids past the vocabulary (and negative ones) are
    clamped into the table, never read out of bounds."""
    vocab = 1000
    r = MoeRouter(cfg, max_tokens=T)
    table = random_table(vocab, cfg.num_experts, cfg.top_k)
    r.set_hash_table(table)
    logits = (torch.randn(T, cfg.num_experts, device="cuda") * 4).to(dtype)
    tok = torch.randint(0, vocab, (T,), dtype=torch.int32, device="cuda")
    tok[::7] = vocab + 5
    tok[3::11] = -2
    poison(r)
    out = r(logits, token_ids=tok)
    torch.cuda.synchronize()
    rid, rw = hash_route_ref(logits.float().cpu(), tok.cpu(), table, cfg.top_k, cfg.routed_scaling_factor, cfg.score)
    assert torch.equal(out.topk_ids.cpu(), rid)
    assert torch.allclose(out.topk_weights.cpu(), rw, rtol=4e-6, atol=0)
    check_align(out, T, cfg)
    assert (r.workspace == 0).all()


@pytest.mark.gpu
def test_hash_routing_graph_replay_with_changing_tokens(seed, router_path):
    cfg, T, vocab = V4_FLASH_HASH_ROUTER, 64, 4096
    r = MoeRouter(cfg, max_tokens=T)
    table = random_table(vocab, cfg.num_experts, cfg.top_k)
    r.set_hash_table(table)
    logits = torch.randn(T, cfg.num_experts, device="cuda")
    tok = torch.randint(0, vocab, (T,), dtype=torch.int32, device="cuda")
    r(logits, token_ids=tok)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        r(logits, token_ids=tok)
    for _ in range(5):
        logits.copy_(torch.randn(T, cfg.num_experts, device="cuda") * 3)
        tok.copy_(torch.randint(0, vocab, (T,), dtype=torch.int32, device="cuda"))
        poison(r)
        g.replay()
        torch.cuda.synchronize()
        rid, rw = hash_route_ref(logits.cpu(), tok.cpu(), table, cfg.top_k, cfg.routed_scaling_factor, cfg.score)
        assert torch.equal(r.topk_ids.cpu(), rid)
        assert torch.allclose(r.topk_weights.cpu(), rw, rtol=4e-6, atol=0)
        check_align(r, T, cfg)


# ------------------------------------------------------------------ CPU ---------------
def test_hash_table_and_argument_checks():
    """The table is checked once (shape, range, distinct experts per row); hash routing
    refuses a bias and needs token ids; a top-k router refuses hash arguments."""
    r = MoeRouter(V4_FLASH_HASH_ROUTER, max_tokens=4, device="cpu")
    with pytest.raises(ValueError, match=r"shape \[vocab, 6\]"):
        r.set_hash_table(torch.zeros(10, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match="outside"):
        r.set_hash_table(torch.full((10, 6), 256))
    with pytest.raises(ValueError, match="repeated expert"):
        r.set_hash_table(torch.tensor([[0, 1, 2, 3, 4, 4]]))
    with pytest.raises(TypeError, match="integer"):
        r.set_hash_table(torch.zeros(10, 6))
    r.set_hash_table(random_table(10, 256, 6))
    assert r.tid2eid.dtype == torch.int32
    with pytest.raises(ValueError, match="hash_routed=True"):
        MoeRouter(V4_FLASH_ROUTER, max_tokens=4, device="cpu").set_hash_table(random_table(10, 256, 6))
    logits = torch.zeros(4, 256)
    with pytest.raises(ValueError, match="no bias"):
        r(logits, torch.zeros(256))
    with pytest.raises(TypeError, match="token_ids must be a torch.Tensor"):
        r(logits)
    top = MoeRouter(V4_FLASH_ROUTER, max_tokens=4, device="cpu")
    with pytest.raises(ValueError, match="hash-routed"):
        top(logits, token_ids=torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="without groups"):
        RouterConfig(hash_routed=True).validate()


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_machine_code_hash_routed(arch):
    """The hash-routed build reads the table instead of running k warp arg-maxes (one redux
    each in the top-k build); no spills."""
    cfg = dict(logits_dtype="float32", has_bias=False)
    h = sass.sass_histogram("moe_router", arch, **dataclasses.asdict(V4_FLASH_HASH_ROUTER), **cfg)
    h0 = sass.sass_histogram("moe_router", arch, **dataclasses.asdict(V4_FLASH_ROUTER), **cfg)
    assert sass.count(h, "REDUX") + sass.count(h, "CREDUX") == 0
    assert sass.count(h0, "REDUX") + sass.count(h0, "CREDUX") >= V4_FLASH_ROUTER.top_k
    assert sass.local_memory_ops(h) == 0


@pytest.mark.parametrize("cfg", [RouterConfig(tile_m=1), V4_FLASH_ROUTER, V4_PRO_HASH_ROUTER],
                         ids=["dsv3-tile1", "v4flash", "v4pro-hash"])
@pytest.mark.parametrize("max_tokens", [1, 7, 64, 513])
def test_one_buffer_holds_every_output_apart(cfg, max_tokens):
    """MoeRouter's outputs and workspace are views of one int32 buffer (its eager hot path
    hands the kernel that one tensor): each piece as long as capacity() says, on a 16-byte
    boundary, inside the buffer and overlapping no other; the workspace starts zeroed."""
    layout, length = buffer_layout(cfg, max_tokens)
    slots, tiles = capacity(cfg, max_tokens)
    E, rows = cfg.num_experts, max_tokens * cfg.top_k
    want = dict(workspace=E + 1, expert_counts=E, expert_offsets=E + 1, total_rows=1, sorted_token_ids=slots,
                tile_expert=tiles, topk_ids=rows, topk_weights=rows, routed_row_pos=rows)
    assert {name: n for name, (_, n) in layout.items()} == want
    spans = sorted((at, at + n) for at, n in layout.values())
    assert all(at % 4 == 0 for at, _ in spans) and spans[-1][1] <= length
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    router = MoeRouter(cfg, max_tokens=max_tokens, device="cpu")
    for name, (at, n) in layout.items():
        view = getattr(router, name)
        assert view.numel() == n and view.is_contiguous(), name
        assert view.untyped_storage().data_ptr() == router.buffer.untyped_storage().data_ptr(), name
        assert view.data_ptr() == router.buffer.data_ptr() + 4 * at, name
    assert router.topk_weights.dtype == torch.float32 and router.topk_ids.shape == (max_tokens, cfg.top_k)
    assert not router.workspace.any()


@pytest.mark.parametrize("cfg", [V4_FLASH_ROUTER, V4_PRO_HASH_ROUTER], ids=["v4flash", "v4pro-hash"])
@pytest.mark.parametrize("path", [dict(single_cta=True), dict(cluster=CLUSTER_CTAS)], ids=["single", "cluster"])
def test_buffer_entry_is_the_tensor_entrys_code(cfg, path):
    """The buffer entry (MoeRouter's eager calls: the outputs as one tensor, placed by offsets)
    compiles to the same sm_90a instructions as the tensor entry of nine output tensors, which
    the GPU tests compare with the pointer launch bit for bit: the same loads and stores at the
    same widths (the single CTA's 16-byte stores of ``sorted_token_ids`` too)."""
    pytest.importorskip("tvm_ffi")
    config = dict(dataclasses.asdict(cfg), logits_dtype="float32", has_bias=not cfg.hash_routed, **path)
    h = sass.histogram(sass.disassemble(sass.compile_cubin("moe_router_buffer_tensors", "sm_90a", **config)))
    h0 = sass.histogram(sass.disassemble(sass.compile_cubin("moe_router_tensors", "sm_90a", **config)))
    memory = ("LDG", "STG", "LDS", "STS", "ATOM", "RED", "ST.", "LD.")
    assert {k: v for k, v in h.items() if k.startswith(memory)} == {k: v for k, v in h0.items() if k.startswith(memory)}
    assert sass.count(h, "STG.E.128") > 0 or "cluster" in path  # (the single CTA's 16-byte stores kept)
    assert abs(sum(h.values()) - sum(h0.values())) <= 16
    assert sass.local_memory_ops(h) == 0


@pytest.mark.parametrize("kw, words", [
    (dict(num_experts=250), "divisible by n_group"),
    (dict(topk_group=9), "exceeds n_group"),
    (dict(top_k=200), "exceeds"),
    (dict(num_experts=1024, n_group=8), "<= 512"),
    (dict(n_group=3, topk_group=2, num_experts=96), "must divide 32"),
    (dict(tile_m=100), "power of two"),
    (dict(top_k=0), "positive int"),
    (dict(score="softmax"), "score='softmax'"),
])
def test_invalid_configs(kw, words):
    with pytest.raises(ValueError, match=words):
        RouterConfig(**kw).validate()


def test_bad_arguments():
    cfg = RouterConfig()
    with pytest.raises(TypeError, match="logits must have dtype"):
        route(torch.zeros(4, 256, dtype=torch.float16), None, cfg, out=None, workspace=None)
    with pytest.raises(ValueError, match=r"logits must have shape \[T, 256\]"):
        route(torch.zeros(4, 128), None, cfg, out=None, workspace=None)


def test_capacity_bound_is_tight_enough():
    cfg = RouterConfig()
    for T in [1, 5, 64, 320]:
        slots, tiles = capacity(cfg, T)
        ids = torch.stack([torch.randperm(256)[:8] for _ in range(T)]).int()
        total = align_ref(ids, 256, 128)[4]
        assert total <= slots and slots % 128 == 0 and tiles * 128 == slots


def test_reference_ties_and_groups():
    logits = torch.zeros(1, 256)
    ids, w, _ = grouped_topk_ref(logits, None, 8, 4, 8, 2.5)
    assert ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]  # all tied: lowest indices
    assert torch.allclose(w, torch.full((1, 8), 2.5 / 8))
    logits = torch.full((1, 256), -5.0)
    logits[0, 200:202] = 5.0  # group 6 wins on its top-2
    ids, _, _ = grouped_topk_ref(logits, None, 8, 1, 8, 1.0)
    assert set(ids[0].tolist()) <= set(range(192, 224))


def test_sqrtsoftplus_reference_is_the_definition():
    """The reference's scores at points with known values: sqrt(ln 2) at 0, ~sqrt(x) far
    right, ~e^(x/2) far left (no underflow to 0 at -80)."""
    x = torch.tensor([[0.0, 30.0, -30.0, -80.0]])
    s = expert_scores_ref(x, "sqrtsoftplus").double()
    assert abs(s[0, 0] - 0.6931471805599453 ** 0.5) < 1e-7
    assert abs(s[0, 1] / 30.0 ** 0.5 - 1) < 1e-7
    assert abs(s[0, 2] / torch.exp(torch.tensor(-15.0, dtype=torch.float64)) - 1) < 1e-6
    assert s[0, 3] > 0


@pytest.mark.parametrize("V", [1, 2, 3, 5, 8, 12, 16])
def test_lane_best_is_the_lowest_index_of_the_maximum(monkeypatch, V):
    """The lane's pick (``RouterTopkAlign.lane_best``, a pairwise tree unrolled as the kernel
    is traced) run on plain Python numbers, its selects as Python's conditional: on random
    values with many ties, and after clearing picks to -inf one at a time as the kernel does,
    it returns the maximum and the lowest index holding it -- the rule the warp's tie-break
    relies on -- at every lane width the configs use (V = E / 32)."""
    import random

    monkeypatch.setattr(router_mod.cutlass, "select_", lambda c, a, b: a if c else b)
    monkeypatch.setattr(router_mod, "Int32", int)
    op = router_mod.RouterTopkAlign.__new__(router_mod.RouterTopkAlign)
    op.V = V
    rng = random.Random(V)
    for _ in range(200):
        cand = [float(rng.randint(0, 3)) for _ in range(V)]
        score = [rng.random() for _ in range(V)]
        for _ in range(V):
            v, j, sc = op.lane_best(cand, score)
            assert v == max(cand) and j == cand.index(max(cand)) and sc == score[j], (cand, v, j)
            cand[j] = float("-inf")


def test_log1p_series_bound():
    """The kernel's ``log1p`` of ``y = exp(-|x|)`` in [0, 1] (``moe.router.log1p_unit``: ``2 atanh(s)``,
    ``s = y / (2 + y)``, by the odd series with ``ATANH2_COEFFS``) against float64's ``log1p``:
    its truncation alone (the series in float64) leaves less than 2^-26 of the sum, and every
    operation rounded to float32, without fused multiply-adds (the GPU's FMAs round less), it
    stays within 4 float32 ulp -- on a grid of [0, 1], both ends, and powers of two down to the
    subnormals."""
    import numpy as np

    y64 = np.concatenate([np.linspace(0.0, 1.0, 100001), 2.0 ** -np.arange(1, 149)])
    s64 = y64 / (2 + y64)
    poly = np.zeros_like(s64)
    for c in router_mod.ATANH2_COEFFS:
        poly = poly * s64 * s64 + c
    truth = np.log1p(y64)
    live = truth > 0
    assert np.all(np.abs(s64 * poly - truth)[live] <= truth[live] * 2.0 ** -26)
    f32 = np.float32
    y = y64.astype(f32)
    d = f32(2) + y
    r = f32(1) / d  # (the kernel: the approximate reciprocal, then one Newton step)
    r = f32(r + r * (f32(1) - d * r))
    sv = f32(y * r)
    z = f32(sv * sv)
    p = f32(router_mod.ATANH2_COEFFS[0])
    for c in router_mod.ATANH2_COEFFS[1:]:
        p = f32(p * z + f32(c))
    got = (sv * p).astype(np.float64)
    want = np.log1p(y.astype(np.float64))
    ulp = np.spacing(want.astype(f32)).astype(np.float64)
    assert got[0] == 0.0 and np.all(np.abs(got - want)[want > 0] <= 4 * ulp[want > 0])


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("cfg", [V4_FLASH_ROUTER, V4_PRO_ROUTER], ids=["v4flash", "v4pro"])
def test_machine_code_sqrtsoftplus(arch, cfg):
    """The V4 routers: each lane's E/32 fp32 logits in 16-byte loads; per expert one exp and one
    square root on the special-function unit (log1p is a polynomial), and one NaN test of its
    candidate (a NaN ranks first: not folded away); no spills. The scores have no slow-path call
    (``sqrt.rn``'s would close each expert's chain before the next): the one call left is the
    weights' division, once per token."""
    h = sass.sass_histogram("moe_router", arch, **dataclasses.asdict(cfg), logits_dtype="float32", has_bias=True)
    V = cfg.num_experts // 32
    assert h["LDG.E.128"] >= V // 4
    assert sass.count(h, "MUFU.EX2") >= V
    assert sass.count(h, "MUFU.SQRT") + sass.count(h, "MUFU.RSQ") >= V
    assert sass.count(h, "FSETP.NAN") >= V
    assert sass.count(h, "CALL") <= 1
    assert sass.local_memory_ops(h) == 0


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_machine_code(arch):
    h = sass.sass_histogram("moe_router", arch, **dataclasses.asdict(RouterConfig()), logits_dtype="float32",
                            has_bias=True)
    assert h["LDG.E.128"] >= 2  # 8 fp32 logits per lane as two 16-byte loads
    assert sass.count(h, "ATOMS") >= 1  # the packing pass's per-warp expert masks (atomicOr)
    assert sass.count(h, "VOTE") <= 8  # no ballot packing: one ballot per pick (the arg-max's tie-break)
    assert sass.count(h, "REDUX") + sass.count(h, "CREDUX") >= 8  # one warp maximum per pick
    assert sass.count(h, "POPC") >= 8
    assert sass.count(h, "ATOMG") + sass.count(h, "RED") >= 2  # counts + last-CTA counter
    assert sass.count(h, "CALL") <= 1  # the sigmoid's reciprocal without rcp.rn's slow-path call per expert
    assert sass.local_memory_ops(h) == 0


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("cfg", [RouterConfig(), V4_FLASH_ROUTER, V4_FLASH_HASH_ROUTER], ids=["v3", "v4flash", "hash"])
def test_machine_code_single_cta(arch, cfg):
    """The decode-size path (T <= SINGLE_CTA_MAX_TOKENS): per-expert token masks by shared-memory
    atomics, no global atomics, no memory fences of a grid handshake, no ballot packing (at
    most one ballot per pick: the arg-max's tie-break); no spills."""
    h = sass.sass_histogram("moe_router", arch, **dataclasses.asdict(cfg), logits_dtype="float32",
                            has_bias=not cfg.hash_routed, single_cta=True)
    assert sass.count(h, "ATOMS") >= 1
    assert sass.count(h, "ATOMG") + sass.count(h, "RED") == 0
    assert sass.count(h, "MEMBAR") == 0
    assert sass.count(h, "VOTE") <= cfg.top_k
    assert sass.local_memory_ops(h) == 0


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("cfg", [RouterConfig(), V4_FLASH_ROUTER, V4_PRO_ROUTER, V4_FLASH_HASH_ROUTER],
                         ids=["v3", "v4flash", "v4pro", "hash"])
@pytest.mark.parametrize("ctas", router_mod.CLUSTER_SIZES)
def test_machine_code_cluster(arch, cfg, ctas):
    """The cluster path (13 <= T <= 64): token masks by shared-memory atomics, no global atomics;
    one cluster barrier (all CTAs running before the first remote store, its arrive before the
    routing) and no memory fence: the exchange is ``st.async`` -- a 16-byte store of mask words
    and a pick to each of the CTAs (unrolled) -- between that barrier's wait and the wait on the
    CTA's own transaction mbarrier, armed once; the layout's global stores after that wait (only
    the CTA's own ids and weights may go before it); no spills."""
    text = sass.disassemble(sass.compile_cubin(
        "moe_router", arch, **dataclasses.asdict(cfg), logits_dtype="float32", has_bias=not cfg.hash_routed,
        cluster=ctas))
    h = sass.histogram(text)
    ops = sass.opcodes(text)
    assert ops.count("UCGABAR_ARV") == 1 and ops.count("UCGABAR_WAIT") == 1
    assert ops.index("UCGABAR_ARV") < min(i for i, o in enumerate(ops) if o.startswith("LDG"))
    assert sass.count(h, "ATOMS") >= 1 and sass.count(h, "ATOMG") + sass.count(h, "RED") == 0
    assert sass.count(h, "MEMBAR") == 0
    assert ops.count("SYNCS.ARRIVE.TRANS64") == 1
    wait = ops.index("UCGABAR_WAIT")
    remote = [i for i, o in enumerate(ops) if o.startswith("STAS")]
    assert ops.count("STAS.128") == ctas and ops.count("STAS") == ctas
    done = min(i for i, o in enumerate(ops) if o.startswith("SYNCS.PHASECHK"))
    assert wait < min(remote) and max(remote) < done
    assert len([i for i, o in enumerate(ops) if o.startswith("STG") and i < done]) == 2  # ids, weights
    assert sass.local_memory_ops(h) == 0


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("path", [dict(single_cta=True), dict(cluster=8), {}], ids=["single", "cluster", "grid"])
def test_machine_code_programmatic_dependent_launch(arch, path):
    """``pdl``: each path signals its dependents on entry (``PREEXIT``) and waits for the
    previous grid once (``ACQBULK``) -- after the set-up, before the logits' 16-byte loads and
    every global store; without ``pdl`` neither instruction is there."""
    kw = dict(dataclasses.asdict(V4_PRO_ROUTER), logits_dtype="float32", has_bias=True, **path)
    plain = sass.opcodes(sass.disassemble(sass.compile_cubin("moe_router", arch, **kw)))
    assert not {"PREEXIT", "ACQBULK"} & set(plain)
    ops = sass.opcodes(sass.disassemble(sass.compile_cubin("moe_router", arch, **kw, pdl=True)))
    assert ops.count("PREEXIT") == 1 and ops.count("ACQBULK") == 1
    wait = ops.index("ACQBULK")
    assert ops.index("PREEXIT") < wait
    assert min(i for i, o in enumerate(ops) if o == "LDG.E.128" or o.startswith(("STG", "ATOMG", "RED"))) > wait


def test_cluster_path_choice_and_config_checks(monkeypatch):
    """The host takes the cluster path only between the two thresholds (none with
    CLUSTER_MAX_TOKENS = 0); a cluster size other than CLUSTER_CTAS, or with single_cta, is
    refused by name."""
    from moe.router import _build, kernel_config

    cfg = V4_FLASH_ROUTER
    paths = {T: ("single" if kernel_config(cfg, torch.float32, True, T)["single_cta"] else
                 "cluster" if "cluster" in kernel_config(cfg, torch.float32, True, T) else "grid")
             for T in (1, 12, 13, 64, 65)}
    assert paths == {1: "single", 12: "single", 13: "cluster", 64: "cluster", 65: "grid"}
    monkeypatch.setattr(router_mod, "CLUSTER_MAX_TOKENS", 0)
    assert all("cluster" not in kernel_config(cfg, torch.float32, True, T) for T in (1, 16, 17, 64, 65))
    kw = dict(dataclasses.asdict(cfg), logits_dtype="float32", has_bias=True)
    with pytest.raises(ValueError, match="cluster=2"):
        _build("sm_90a", **kw, cluster=2)
    with pytest.raises(ValueError, match="not with single_cta"):
        _build("sm_90a", **kw, cluster=4, single_cta=True)


def _rounding_kernel():
    """``mS[i] = sqrt_rn(mX[i])``, ``mR[i] = rcp_rn_from_one(mX[i])``: the router's own helpers."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute

    @cute.kernel
    def kernel(mX: cute.Tensor, mS: cute.Tensor, mR: cute.Tensor, n: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * 256 + tidx
        if i < n:
            x = mX[i]
            mS[i] = router_mod.sqrt_rn([x])[0]
            mR[i] = router_mod.rcp_rn_from_one([x])[0]

    @cute.jit
    def launch(mX: cute.Tensor, mS: cute.Tensor, mR: cute.Tensor, n: cutlass.Int32, stream: cuda.CUstream):
        kernel(mX, mS, mR, n).launch(grid=[(n + 255) // 256, 1, 1], block=[256, 1, 1], stream=stream)

    return launch


def _rounding_inputs(n: int) -> torch.Tensor:
    """Random non-negative float32 bit patterns (subnormals included), then the edges and their
    neighbours: 0, the smallest subnormal, the scaling thresholds, 1, the largest float, inf, NaN."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    bits = torch.randint(0, 0x7F800000, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    edges = [0.0, 2.0**-149, 2.0**-126, 2.0**-100, 1.0, 2.0**64, 2.0**126, 3.4028234663852886e38,
             float("inf"), float("nan")]
    e = torch.tensor(edges, dtype=torch.float32)
    near = torch.cat([(e.view(torch.int32) + d).view(torch.float32) for d in (-1, 1)])
    x = torch.cat([bits.view(torch.float32), e, near[torch.isfinite(near) & (near >= 0)]])
    return x


@pytest.mark.gpu
def test_branch_free_sqrt_and_reciprocal_are_correctly_rounded():
    """``sqrt_rn`` / ``rcp_rn_from_one`` against float64 rounded to float32 (correctly rounded:
    53 >= 2 * 24 + 2 bits), bit for bit over 2^20 random floats and the edges; the reciprocal on
    ``d >= 1``, within one subnormal ulp for ``d >= 2^126`` (its second rounding)."""
    from cutlass.cute.runtime import from_dlpack

    x = _rounding_inputs(1 << 20).cuda()
    s = torch.full_like(x, float("nan"))  # poisoned
    r = torch.full_like(x, float("nan"))
    fn = _rounding_kernel()
    stream = torch.cuda.current_stream()
    import cuda.bindings.driver as cuda

    fn(from_dlpack(x), from_dlpack(s), from_dlpack(r), x.numel(), cuda.CUstream(stream.cuda_stream))
    torch.cuda.synchronize()
    xd = x.cpu().double()
    s_ref = torch.sqrt(xd).float()
    s_got = s.cpu()
    nan = torch.isnan(s_ref)
    assert torch.equal(torch.isnan(s_got), nan)
    assert torch.equal(s_got[~nan].view(torch.int32), s_ref[~nan].view(torch.int32))
    dom = (xd >= 1) | torch.isnan(xd)
    r_ref = (1.0 / xd[dom]).float()
    r_got = r.cpu()[dom]
    nan = torch.isnan(r_ref)
    assert torch.equal(torch.isnan(r_got), nan)
    exact = ~nan & (xd[dom] < 2.0**126)
    assert torch.equal(r_got[exact].view(torch.int32), r_ref[exact].view(torch.int32))
    tiny = ~nan & ~exact
    assert (r_got[tiny].view(torch.int32) - r_ref[tiny].view(torch.int32)).abs().max() <= 1
