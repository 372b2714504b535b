"""Decode runtime (DeepSeek-V4 layer, DSpark-style draft): speculative greedy == plain greedy,
the step model == the reference, compressor state under speculative verify, weights in the
checkpoint's names and formats. CPU unless marked gpu."""

import dataclasses
import math
import random

import pytest
import torch

from spec_decode import Engine, EngineConfig
from spec_decode.config import TINY
from spec_decode.model import (History, TargetModel, entries_from_rows, rope_inv_freq, route, shared_expert, swiglu,
                               visible_entries)
from spec_decode.step_model import DecodeState, Ops, StepModel

from conftest import UNDER_SANITIZER
from references import greedy_shortfall


def prompts(seed, n, vocab=128, lo=1, hi=12):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("draft", ["model", "oracle", "oracle_bad0", "oracle_bad2", "oracle_bad4"])
def test_speculative_equals_plain_greedy(seed, draft):
    """Reference backend (the spec's per-token loops over the full history)."""
    eng = Engine(EngineConfig(seed=seed, max_seq_len=64))
    ps = prompts(seed, 3)
    plain = eng.generate(ps, 17, speculative=False)
    if draft.startswith("oracle"):
        eng.draft.oracle = True
        if "bad" in draft:
            eng.draft.corrupt = {int(draft[-1])}
    spec = eng.generate(ps, 17, speculative=True)
    assert spec == plain
    assert all(len(o) == 17 for o in spec)
    acc = eng.stats.acceptance_lengths
    if draft == "oracle":
        assert set(acc) == {6}  # 5 drafts + bonus every verify
    elif "bad" in draft:
        assert set(acc) == {int(draft[-1]) + 1}  # accepted up to the corrupted draft, plus the bonus
    else:
        assert all(1 <= a <= 6 for a in acc)


def test_compressor_state_survives_speculative_verify():
    """The compressor-state probe: 700 new tokens per request (175 m = 4 windows, 5 m' = 128
    windows closed, the 128-position raw window wrapped many times), with an oracle draft whose
    accepted count follows a random schedule over 0..5: speculative == plain greedy token for
    token, and every accepted count was seen at every phase of the m = 4 window."""
    eng = Engine(EngineConfig(seed=4, max_seq_len=768, backend="torch-bf16", graph_batch_sizes=(1, 2)))
    ps = [prompts(5, 1, lo=13, hi=13)[0], prompts(6, 1, lo=41, hi=41)[0]]
    plain = eng.generate(ps, 700, speculative=False)
    rng = random.Random(0)
    schedule = []

    def corrupt(i):
        j = rng.randrange(6)  # drafts accepted this step
        schedule.append(j)
        return set() if j == 5 else {j}

    eng.draft.oracle, eng.draft.corrupt = True, corrupt
    spec = eng.generate(ps, 700)
    assert spec == plain
    acc = eng.stats.acceptance_lengths
    assert sorted(set(acc)) == [1, 2, 3, 4, 5, 6]
    # request 1's verify steps: (its position mod 4 at the step, drafts accepted)
    n, seen = len(ps[1]), set()
    for a in acc[1::2]:
        seen.add((n % 4, a - 1))
        n += a
    assert seen == {(p, j) for p in range(4) for j in range(6)}
    assert n > 5 * 128


def test_step_model_matches_reference():
    """The sync-free step model over fixed-size state == the reference over the full history:
    chunks of 37 positions (every phase of both windows crossed), two requests in slots out of
    order; logits to FP32 rounding, the draft features too."""
    m = TargetModel(TINY, seed=3)
    st = DecodeState(TINY, 3, 512, 6, torch.float32, "cpu")
    hist = History(TINY, 3, 512, torch.float32, "cpu")
    step = StepModel(m)
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, TINY.vocab, (2, 300), generator=g)
    slots = torch.tensor([2, 0])
    for c0 in range(0, 300, 37):
        toks = seq[:, c0:c0 + 37]
        pos = torch.arange(c0, c0 + toks.shape[1])[None].expand(2, -1)
        a, fa = m.forward(toks, pos, slots, hist)
        b, fb = step.forward(toks, pos, slots, st)
        assert (a - b).abs().max() < 1e-4 * a.abs().max()
        assert (fa - fb).abs().max() < 1e-4 * fa.abs().max()


@pytest.mark.parametrize("backend", ["reference", "torch-bf16"])
def test_batched_equals_single_requests(backend):
    eng = Engine(EngineConfig(seed=3, max_seq_len=64, backend=backend, graph_batch_sizes=(1, 2, 4)))
    ps = prompts(7, 4)
    batched = eng.generate(ps, [9, 3, 12, 1])
    singles = [eng.generate([p], m)[0] for p, m in zip(ps, [9, 3, 12, 1])]
    assert batched == singles


def test_prefill_chunk_boundaries_at_every_phase():
    """A 270-token prompt prefilled in chunks whose boundaries fall at every phase of the m = 4
    windows and around the m' = 128 window and the raw window: the same continuation as one
    chunk (state keyed by position: no chunk boundary is special)."""
    p = prompts(3, 1, lo=270, hi=270)
    want = Engine(EngineConfig(seed=2, max_seq_len=300, backend="torch-bf16", prefill_chunk=384,
                               graph_batch_sizes=(1,))).generate(p, 6, speculative=False)
    for chunk in (1, 2, 3, 5, 7, 127, 129):
        eng = Engine(EngineConfig(seed=2, max_seq_len=300, backend="torch-bf16", prefill_chunk=chunk,
                                  graph_batch_sizes=(1,)))
        assert eng.generate(p, 6, speculative=False) == want, chunk


def test_torch_bf16_backend_equals_reference():
    ps = prompts(1, 3)
    ref = Engine(EngineConfig(seed=1, max_seq_len=64)).generate(ps, 13, speculative=False)
    eng = Engine(EngineConfig(seed=1, max_seq_len=64, backend="torch-bf16", graph_batch_sizes=(1, 2, 4)))
    assert eng.generate(ps, 13) == eng.generate(ps, 13, speculative=False) == ref
    assert eng.verify_graphs.replays > 0 and eng.decode_graphs.replays > 0 and eng.draft_graphs.replays > 0


def _oracle_draft_graph(eng, corrupt):
    """Stands in for the captured draft graph: the target's own greedy continuation from the
    (token, position, slot) the pipelined loop hands the draft graph, one position flipped --
    so every verify accepts exactly ``corrupt`` drafts, through the device-side acceptance."""
    K, vocab, top = eng.config.block_size, eng.config.model.vocab, eng.config.max_seq_len - 1

    def run(tok, pos, slots, feats, n_commit):
        t, res = tok[:, 0], []
        for j in range(K):
            logits, _ = eng._target(t[:, None], (pos + j).clamp_max(top), slots)
            t = logits[:, 0].argmax(-1)
            res.append(t)
        d = torch.stack(res, 1)
        d[:, corrupt] = (d[:, corrupt] + 1) % vocab
        return (d,)
    return run


@pytest.mark.parametrize("seed", [0, 1])
def test_pipelined_decoding_matches_plain_greedy(seed):
    """The pipelined loop (next verify enqueued before this one's tokens are read; acceptance,
    last token, length and the draft's features carried on the device) against plain greedy,
    with per-request output lengths so requests finish at different steps (one right after
    prefill) and finished requests ride along one extra step."""
    ps = prompts(seed, 4)
    per = [1, 4, 9, 13]
    ref = Engine(EngineConfig(seed=seed, max_seq_len=64)).generate(ps, per, speculative=False)
    eng = Engine(EngineConfig(seed=seed, max_seq_len=64, backend="torch-bf16", graph_batch_sizes=(1, 2, 4)))
    assert eng.generate(ps, per) == eng.generate(ps, per, pipelined=False) == ref
    assert [len(o) for o in ref] == per
    eng.draft_graphs.run = _oracle_draft_graph(eng, corrupt=2)
    spec = eng.generate(ps, per, pipelined=True)
    assert spec == ref
    assert set(eng.stats.acceptance_lengths) == {3}  # 2 accepted drafts + the bonus, every verify
    calls = []
    eng._captured = lambda b: calls.append(b) or len(calls) % 2 == 0
    assert eng.generate(ps, per, pipelined=True) == ref and len(calls) > 2


def test_draft_context_holds_committed_positions_only():
    """The draft's context ring after a verify: rows of the accepted positions hold their
    target features' K = V; rejected positions were written to the discarded row only."""
    eng = Engine(EngineConfig(seed=0, max_seq_len=64, backend="torch-bf16", graph_batch_sizes=(1,)))
    st = eng.state
    K, R = eng.config.block_size, st.win_rows
    feats = torch.randn(1, K + 1, eng.feat_dim)
    before = [w.clone() for w in st.draft_win]
    pos = torch.tensor([[20]])
    eng._draft_step(torch.tensor([[3]]), pos, torch.tensor([0]), feats, torch.tensor([2]))  # 2 of 6 accepted
    c = eng.draft.context(feats[:, :2])
    for s, layer in enumerate(eng.draft.layers):
        want = layer.kv(c, torch.tensor([[18, 19]]))
        assert torch.allclose(st.draft_win[s][0, [18 % R, 19 % R]], want[0], atol=1e-6)
        changed = (st.draft_win[s][0, :R] != before[s][0, :R]).any(-1).nonzero().flatten().tolist()
        assert changed == [18 % R, 19 % R]


def test_routes_hash_and_sqrt_softplus():
    """The first n_hash_layers route by tid2eid[token]; the others by top-k of sqrt(softplus)
    + bias; weights are the chosen scores normalised, times the scaling factor."""
    m = TargetModel(TINY, seed=0)
    h = torch.randn(5, TINY.hidden)
    tok = torch.tensor([3, 3, 7, 0, 127])
    ids, w = route(h, m.layers[0], TINY, tok)
    assert torch.equal(ids, m.layers[0]["ffn.gate.tid2eid"][tok])
    s = torch.sqrt(torch.log1p(torch.exp(h.double() @ m.layers[0]["ffn.gate.weight"].double().T)))
    sel = s.gather(1, ids)
    assert torch.allclose(w.double(), sel / sel.sum(-1, keepdim=True) * TINY.routed_scaling_factor, atol=1e-5)
    ids, w = route(h, m.layers[2], TINY, tok)
    s = torch.sqrt(torch.log1p(torch.exp(h.double() @ m.layers[2]["ffn.gate.weight"].double().T)))
    want = (s + m.layers[2]["ffn.gate.bias"].double()).topk(TINY.top_k).indices
    assert torch.equal(ids.sort(-1).values, want.sort(-1).values)


def test_compressed_entries_match_an_incremental_compressor():
    """Entries recomputed from position-keyed rows (this runtime) == transformers' incremental
    formulation (a buffer of tokens short of a window, the last full window kept as the next
    call's overlap), fed in uneven chunks -- written here from its description, not from the
    runtime's code -- for CSA (overlap) and HCA."""
    g = torch.Generator().manual_seed(0)
    inv = rope_inv_freq(TINY, True)
    for m, overlap, d in ((4, True, 16), (16, False, 16)):
        coff = 2 if overlap else 1
        T = 9 * m + 3
        kv, gate = torch.randn(T, coff * d, generator=g), torch.randn(T, coff * d, generator=g)
        ape, norm_w = torch.randn(m, coff * d, generator=g), 1 + 0.1 * torch.randn(d, generator=g)
        want = entries_from_rows(kv, gate, T // m, m, overlap, ape, norm_w, inv, 1e-6)
        buf_kv, buf_g, prior, pool, t0 = kv[:0], gate[:0], None, [], 0
        for n in (1, 6, 2, 13, 9, T):  # uneven chunks
            ck, cg = torch.cat([buf_kv, kv[t0:t0 + n]]), torch.cat([buf_g, gate[t0:t0 + n]])
            t0 += n
            usable = ck.shape[0] // m * m
            ck, cg, buf_kv, buf_g = ck[:usable], cg[:usable], ck[usable:], cg[usable:]
            if not usable:
                continue
            w = usable // m
            ck, cg = ck.view(w, m, -1), cg.view(w, m, -1) + ape
            if overlap:
                nk = torch.zeros(w, 2 * m, d)
                ng = torch.full((w, 2 * m, d), float("-inf"))
                nk[:, m:], ng[:, m:] = ck[..., d:], cg[..., d:]
                nk[1:, :m], ng[1:, :m] = ck[:-1, :, :d], cg[:-1, :, :d]
                if prior is not None:
                    nk[0, :m], ng[0, :m] = prior[0][:, :d], prior[1][:, :d]
                prior = (ck[-1], cg[-1])
                ck, cg = nk, ng
            pooled = (ck * cg.softmax(1)).sum(1)
            pooled = pooled * torch.rsqrt(pooled.square().mean(-1, keepdim=True) + 1e-6) * norm_w
            first = len(pool) * m
            pos = torch.arange(w) * m + first
            ang = pos[:, None].float() * inv
            pairs = pooled[:, -2 * inv.numel():].unflatten(-1, (-1, 2))
            a, b = pairs[..., 0], pairs[..., 1]
            rot = torch.stack([a * ang.cos() - b * ang.sin(), a * ang.sin() + b * ang.cos()], -1).flatten(-2)
            pool.extend(torch.cat([pooled[:, :-2 * inv.numel()], rot], -1))
        assert len(pool) == T // m
        assert torch.allclose(torch.stack(pool), want, atol=1e-5)
    assert visible_entries(torch.tensor([-1, 0, 2, 3, 4, 7, 8]), 4).tolist() == [0, 0, 0, 1, 1, 2, 2]


def test_yarn_frequencies():
    """Window-only layers: plain RoPE; compressed layers: compress_rope_theta with YaRN --
    the high-frequency dims untouched, the low-frequency ones divided by the factor."""
    plain = rope_inv_freq(TINY, False)
    assert torch.allclose(plain, 1 / TINY.rope_theta ** (torch.arange(0, 8, 2) / 8))
    cfg = dataclasses.replace(TINY, rope_dim=64)
    y = rope_inv_freq(cfg, True)
    base = 1 / cfg.compress_rope_theta ** (torch.arange(0, 64, 2) / 64)
    assert torch.allclose(y[:4], base[:4]) and torch.allclose(y[-4:], base[-4:] / cfg.yarn_factor)


def test_impossible_requests_are_refused_up_front():
    eng = Engine(EngineConfig(max_seq_len=32, graph_batch_sizes=(1, 2, 4)))
    with pytest.raises(ValueError, match="largest captured batch size 4"):
        eng.generate(prompts(0, 5), 4)
    with pytest.raises(ValueError, match="state too small"):
        eng.generate([[1] * 20], 10)
    with pytest.raises(ValueError, match="token ids"):
        eng.generate([[1, 999]], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.generate([[1]], 0)
    assert EngineConfig().padded_batch(3) == 4 and EngineConfig().padded_batch(33) == 64


def test_generate_argument_errors():
    eng = Engine(EngineConfig(max_seq_len=32, graph_batch_sizes=(1, 2, 4)))
    with pytest.raises(ValueError, match="one per request"):
        eng.generate([[1], [2]], [3])
    with pytest.raises(ValueError, match="positive int"):
        eng.generate([[1]], [True])
    with pytest.raises(ValueError, match="pipelined=True"):
        eng.generate([[1]], 2, pipelined=True)  # the reference backend


@pytest.mark.parametrize("bad, words", [(dict(compress_ratios=(0, 5)), "compress_ratios"),
                                        (dict(heads=3), "wo_groups"), (dict(rope_dim=7), "rope_dim"),
                                        (dict(top_k=9), "top_k"), (dict(n_hash_layers=9), "n_hash_layers"),
                                        (dict(draft_feature_layers=(0, 1)), "draft_feature_layers")])
def test_model_config_validation(bad, words):
    with pytest.raises(ValueError, match=words):
        dataclasses.replace(TINY, **bad).validate()


def test_presets_hold_every_layer_kind():
    from spec_decode.config import PRESETS

    for name, c in PRESETS.items():
        c.validate()
        kinds = set(c.compress_ratios)
        assert kinds == {0, c.csa_ratio, c.hca_ratio}, name
        assert 0 < c.n_hash_layers < c.layers, name
    v4f = PRESETS["v4_flash_slice"]
    assert (v4f.hidden, v4f.heads, v4f.head_dim, v4f.wo_groups, v4f.experts, v4f.top_k) == (4096, 64, 512, 8, 256, 6)
    assert v4f.heads * v4f.head_dim // v4f.wo_groups == 4096 and v4f.index_topk == 512


@pytest.mark.parametrize("backend", ["reference", "torch-bf16"])
def test_teacher_forced_greedy_reproduces_own_generation(backend):
    """Engine.greedy_given (and logits_given's argmax) fed an engine's own greedy output returns
    it (prefill chunks that split the continuation), writes only the scratch slot, and refuses
    a sequence the state cannot hold."""
    eng = Engine(EngineConfig(seed=3, max_seq_len=40, backend=backend, prefill_chunk=5, graph_batch_sizes=(1, 2)))
    ps = prompts(9, 2)
    out = eng.generate(ps, 12)
    win = eng.state.win[0][:eng.scratch_slot].clone()
    assert eng.greedy_given(ps[0], out[0]) == out[0]
    lg = eng.logits_given(ps[0], out[0])
    assert lg.dtype == torch.float32 and lg.shape == (12, eng.config.model.vocab)
    assert lg.argmax(-1).tolist() == out[0]
    assert torch.equal(eng.state.win[0][:eng.scratch_slot], win)
    assert eng.greedy_given(ps[1], out[1][:1]) == out[1][:1]
    with pytest.raises(ValueError, match="state too small"):
        eng.greedy_given(ps[0], list(range(40)))


def test_graph_runner_pads_with_the_scratch_slot():
    from spec_decode.graphs import StepGraphs

    seen = []

    def fn(tok, pos, slots, extra):
        seen.append((slots.clone(), extra.clone()))
        return (tok * 2,)

    g = StepGraphs(fn, (1, 4), 2, scratch_slot=9, device="cpu", extras=(((3,), torch.float32),))
    out = g.run(torch.ones(3, 2, dtype=torch.long), torch.zeros(3, 2, dtype=torch.long), torch.tensor([0, 1, 2]),
                torch.ones(3, 3))
    assert out[0].shape == (3, 2) and seen[-1][0].tolist() == [0, 1, 2, 9]
    assert seen[-1][1][3].abs().sum() == 0  # padded rows' extras are zero
    with pytest.raises(ValueError, match="extra inputs"):
        g.run(torch.ones(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long), torch.tensor([0]))


def test_bench_table_rows():
    """spec_decode.bench's table from fake results: numbers formatted alike (an int median
    prints as 1.00), token agreement against the first backend (free-running, teacher-forced,
    and the two backends' teacher-forced picks with their near-ties counted, their logits'
    difference), n/a and the error line for a failed case."""
    from spec_decode import bench

    cases = [("BS1 x", 1, 8, 4), ("BS64 x", 64, 8, 4)]
    ok = dict(hash="ab", decode_tps=10.0, full_tps=5.0, acceptance=1, verify_ms=2.0, draft_ms=0.5, verify_nodes=7,
              draft_nodes=3, launches={f: 2 for f in bench.FAMILIES})
    logits = torch.linspace(0, 9, 10).repeat(4, 1)  # yardstick rows: pick 3 at 0.2 above token 9, pick 4 far above
    logits[0, 1] = logits[1, 2] = logits[2, 3] = 9.2
    logits[3, 4] = 20.0
    results = {("torch-bf16", "BS1 x"): dict(ok, tokens=[[1, 2, 3, 4]], teacher_forced=1.0,
                                             teacher_picks=[1, 2, 3, 4], teacher_logits=logits),
               ("torch-bf16", "BS64 x"): dict(ok, tokens=[[1, 2], [3, 4]], teacher_forced=1.0),
               ("fused", "BS1 x"): dict(ok, tokens=[[1, 2, 9, 9]], teacher_forced=0.75, teacher_picks=[1, 2, 9, 9],
                                        teacher_logits=logits * torch.tensor([1.0, 1.0, 1.01, 1.02])[:, None]),
               ("fused", "BS64 x"): {"error": "out of memory: boom"}}
    lines = bench.table_lines(["torch-bf16", "fused"], cases, results)
    text = "\n".join(lines)
    assert "| median acceptance length (achieved) | 1.00 | n/a |" in text
    assert "| BS1 x: tokens equal to torch-bf16's | 1.000 | 0.500 |" in text
    assert "| BS64 x: tokens equal to torch-bf16's | 1.000 | n/a |" in text
    assert "| BS1 x: teacher-forced tokens equal to torch-bf16's (request 0) | 1.000 | 0.750 |" in text
    # the two backends' teacher-forced picks: 2 of 4 equal; of the 2 differing, 1 a near-tie
    assert ("| BS1 x: teacher-forced picks equal to torch-bf16's teacher-forced picks (request 0) | 1.000 | 0.500 |"
            in text)
    assert ("| BS1 x: picks differing from torch-bf16's in the first 128 positions: near-ties / all | 0 / 0 | 1 / 2 |"
            in text)
    assert "| BS64 x: teacher-forced picks equal to torch-bf16's teacher-forced picks (request 0) | n/a | n/a |" in text
    # logits 0, 0, 1% and 2% off by position: median 0.5%, largest 2%
    assert ("| BS1 x: teacher-forced logits vs torch-bf16's, relative difference per position (first 128): "
            "median / max | 0.0e+00 / 0.0e+00 | 5.0e-03 / 2.0e-02 |") in text
    assert ("| BS64 x: teacher-forced logits vs torch-bf16's, relative difference per position (first 128): "
            "median / max | n/a | n/a |") in text
    assert "| median verify graph ms (BS1) | 2.000 | 2.000 |" in text
    assert "fused: out of memory: boom" in text
    assert "| verify graph (BS1): of this card's measured copy bandwidth (not measured) | - | - |" in text
    assert bench.token_agreement([[1, 2, 3]], [[1, 5]]) == 0.5


def test_trace_kernel_origins():
    """The verify replay's time breakdown sorts traced kernel names by origin: the CuTe DSL's
    launches, cuBLAS GEMMs, and everything else PyTorch runs."""
    from spec_decode.bench import kernel_origin

    assert kernel_origin("kernel_cutlass_kernel_MhcStats_object_at_0x7f_0") == "cute"
    assert kernel_origin("nvjet_tst_128x64_64x8_1x1_v_bz_TNN") == "gemm"
    assert kernel_origin("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64") == "gemm"
    assert kernel_origin("void at::native::vectorized_elementwise_kernel<4, ...>") == "torch"
    assert kernel_origin("void at::native::(anonymous namespace)::cunn_SoftMaxForward<...>") == "torch"


def test_launch_families_of_this_projects_kernels():
    """Launch counts as the reference PR counts them: the push kernel that also finalizes and
    adds the shared expert is a fused finalize, not an all-reduce; the finalize without the
    add is a standalone finalize (the kernels' names, as the DSL gives them)."""
    from spec_decode.bench import cute_family

    name = "kernel_cutlass_kernel_{}_tensorptrbf16gmemalign16o716871681_0".format
    assert cute_family(name("FinalizeSharedAllReduce")) == "fused finalize (+ shared add)"
    assert cute_family(name("PushAllReduce")) == "all-reduce"
    assert cute_family(name("FinalizeShared")) == "fused finalize (+ shared add)"
    assert cute_family(name("MoeFinalize")) == "standalone finalize"
    assert cute_family("kernel_cutlass_kernel_moerouterRouterTopkAlign_object_at__0") == "router top-k / padding"
    assert cute_family(name("MxGatherRouted")) is None


def test_kernel_table_groups_one_replay_by_name():
    """The per-kernel tables: launches and time summed per kernel name, longest total first,
    percentages of the replay's kernel time."""
    from types import SimpleNamespace as NS

    from spec_decode import bench

    ev = lambda name, a, z: NS(name=name, time_range=NS(start=a, end=z))  # noqa: E731 (profiler us)
    rows = bench.kernel_table([ev("gemm", 0, 10), ev("norm", 10, 12), ev("gemm", 12, 22), ev("x" * 200, 22, 23)])
    assert rows == [("gemm", 2, 0.02), ("norm", 1, 0.002), ("x" * 90, 1, 0.001)]
    lines = bench.kernel_lines(["fused"], "BS1", {("fused", "BS1"): {"kernels_verify": rows}})
    assert "### fused: verify graph, BS1 (median replay; kernel time 0.023 ms)" in lines
    assert "| `gemm` | 2 | 0.0200 | 87.0 |" in lines


def test_bench_cli_refuses_without_gpu_and_formats_progress(capsys):
    from spec_decode import bench

    if torch.cuda.is_available():
        pytest.skip("the CPU-only behaviour")
    assert bench.main(["--quick"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    ids, h = bench.prompts(2, 5, 128)
    assert len(ids) == 2 and all(len(p) == 5 for p in ids) and len(h) == 16
    assert bench.prompts(2, 5, 128) == (ids, h)  # fixed inputs: the hash is reproducible


def test_fused_backend_needs_bf16_cuda():
    with pytest.raises(ValueError, match="bfloat16"):
        Engine(EngineConfig(backend="fused"))
    with pytest.raises(ValueError, match="draft_head"):
        Engine(EngineConfig(draft_head="fp4"))


def _tensor_eq(a, b):
    return all(torch.equal(x if e is None else x[e], y if f is None else y[f])
               for (x, e), (y, f) in zip(a.values(), b.values()))


def test_weights_file_round_trip_and_strict_loading(tmp_path):
    """save -> load into an engine of another seed: same tensors, same generated tokens; a
    missing, unexpected or mis-shaped tensor is refused before any weight is replaced."""
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file, save_file

    from spec_decode.weights import load_weights, named_tensors, save_weights

    src = Engine(EngineConfig(seed=3, max_seq_len=48))
    path = str(tmp_path / "w.safetensors")
    save_weights(path, src.model, src.draft)
    dst = Engine(EngineConfig(seed=11, weights=path, max_seq_len=48))
    a, b = named_tensors(src.model, src.draft), named_tensors(dst.model, dst.draft)
    assert a.keys() == b.keys() and _tensor_eq(a, b)
    assert "layers.1.attn.indexer.compressor.ape" in a and "layers.0.ffn.gate.tid2eid" in a
    assert "layers.3.ffn.experts.15.w2.weight" in a and "draft.layers.2.attn.wkv.weight" in a
    ids = prompts(2, 5)
    assert src.generate(ids, 6) == dst.generate(ids, 6)

    full = load_file(path)
    bad = dict(full)
    del bad["layers.1.ffn.experts.3.w2.weight"]
    save_file(bad, str(tmp_path / "missing.safetensors"))
    with pytest.raises(ValueError, match="lack 1 tensor.*layers.1.ffn.experts.3.w2.weight"):
        Engine(EngineConfig(weights=str(tmp_path / "missing.safetensors")))
    bad = dict(full, **{"layers.0.extra": torch.zeros(2)})
    save_file(bad, str(tmp_path / "extra.safetensors"))
    with pytest.raises(ValueError, match="unexpected tensor.*layers.0.extra"):
        Engine(EngineConfig(weights=str(tmp_path / "extra.safetensors")))
    bad = dict(full, **{"embed.weight": torch.zeros(3, 3)})
    save_file(bad, str(tmp_path / "shape.safetensors"))
    eng = Engine(EngineConfig(seed=3))
    before = eng.model.layers[0]["attn.wq_a.weight"].clone()
    with pytest.raises(ValueError, match="embed.weight has shape"):
        load_weights(str(tmp_path / "shape.safetensors"), eng.model, eng.draft)
    assert torch.equal(eng.model.layers[0]["attn.wq_a.weight"], before)  # nothing replaced


def test_weights_in_the_checkpoint_formats(tmp_path):
    """A synthetic checkpoint under V4's names and formats -- FP8 e4m3 linears with UE8M0 128 x
    128 block scales, packed-FP4 routed experts with UE8M0 scales per 32, a slice of a larger
    checkpoint's layers (layer_map, allow_unused) -- loads to the values the formats define."""
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    from spec_decode.weights import load_weights, named_tensors

    cfg = dataclasses.replace(TINY, hidden=256, expert_inter=64)
    m = TargetModel(cfg, seed=0)
    g = torch.Generator().manual_seed(1)
    tensors = {k: (v if e is None else v[e]).contiguous() for k, (v, e) in named_tensors(m).items()}
    # model layer i <- checkpoint layer i + 5
    tensors = {(f"layers.{int(k.split('.')[1]) + 5}." + k.split(".", 2)[2] if k.startswith("layers.") else k): v
               for k, v in tensors.items()}
    tensors["layers.0.attn_norm.weight"] = torch.ones(3)  # another layer of the checkpoint
    name = "layers.7.attn.wq_a.weight"  # [q_lora = 32, 256]: a 1 x 2 grid of 128-blocks
    w8 = (torch.randn(32, 256, generator=g) * 4).to(torch.float8_e4m3fn)
    sc = torch.tensor([[120, 131]], dtype=torch.uint8)  # 2^-7, 2^4
    tensors[name], tensors[name[:-7] + ".scale"] = w8, sc.view(torch.float8_e8m0fnu)
    want8 = w8.float() * torch.tensor([2.0 ** -7] * 128 + [2.0 ** 4] * 128)
    name4 = "layers.8.ffn.experts.2.w1.weight"  # [I = 64, C = 256] as [64, 128] bytes
    packed = torch.randint(0, 256, (64, 128), dtype=torch.uint8, generator=g)
    s4 = torch.randint(120, 134, (64, 8), dtype=torch.uint8, generator=g)
    tensors[name4], tensors[name4[:-7] + ".scale"] = packed, s4
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    lo, hi = packed.long() & 15, packed.long() >> 4
    val = lambda c: (1 - 2 * (c >= 8).float()) * torch.tensor(e2m1)[c & 7]  # noqa: E731
    want4 = torch.stack([val(lo), val(hi)], -1).flatten(-2) * (2.0 ** (s4.float() - 127)).repeat_interleave(32, -1)
    path = str(tmp_path / "ck.safetensors")
    save_file(tensors, path)
    dst = TargetModel(cfg, seed=9)
    with pytest.raises(ValueError, match="unexpected"):
        load_weights(path, dst, layer_map={i: i + 5 for i in range(cfg.layers)})
    load_weights(path, dst, layer_map={i: i + 5 for i in range(cfg.layers)}, allow_unused=True)
    assert torch.equal(dst.layers[2]["attn.wq_a.weight"], want8)
    assert torch.equal(dst.layers[3]["ffn.experts.w1"][2], want4)
    assert torch.equal(dst.layers[1]["attn.compressor.ape"], m.layers[1]["attn.compressor.ape"])


def test_bench_memory_estimate_matches_the_model():
    """The bench's up-front memory estimate counts the tensors a TargetModel + DraftModel +
    DecodeState allocate (tiny config, bf16; the state's ring lookahead taken as 8)."""
    from spec_decode.bench import estimate_bytes
    from spec_decode.draft import DraftModel

    m = TargetModel(TINY, dtype=torch.bfloat16)
    d = DraftModel(TINY, m, dtype=torch.bfloat16)
    st = DecodeState(TINY, 3, 64, 8, torch.bfloat16, "cpu", draft_stages=TINY.draft_stages)
    tensors = list(m.w.values()) + list(d.w.values())
    tensors += [t for L in m.layers + d.stages for t in L.values()]
    exact = sum(t.numel() * 2 for t in tensors) + st.nbytes()  # estimate counts every weight as bf16
    assert abs(estimate_bytes(TINY, 3, 64, "torch-bf16") - exact) < 0.02 * exact


# ----------------------------------------------------------------- FP32 yardstick ----
class StreamingFp32Experts(Ops):
    """FP32 ops whose MoE widens the routed experts -- left in the layer as they are, bf16 or
    the MXFP8 operands of a model made with ``quantize_layer_experts`` (:func:`fp32_view`) --
    one expert at a time: the spec's math (:func:`spec_decode.model.moe_gathered`: route;
    per choice, the clamped SwiGLU expert; the weighted sum over the choices in order; the
    shared expert) without an FP32 copy of every expert, which at V4-Flash's sizes would not fit
    beside the bf16 and MXFP8 ones."""

    def moe(self, h, L, cfg, tokens, first_expert: int = 0, reduce: bool = False):
        ids, w = route(h, L, cfg, tokens)
        N, k = ids.shape
        Y = torch.zeros(k, N, h.shape[1], dtype=h.dtype, device=h.device)  # each choice's expert output
        for e in ids.unique().tolist():
            n, i = (ids == e).nonzero(as_tuple=True)
            x = h[n]
            w1, w3, w2 = self.expert(L, e)
            g = x @ w1.T
            u = x @ w3.T
            Y[i, n] = swiglu(g, u, cfg.swiglu_limit) @ w2.T
        out = torch.zeros_like(h)
        for i in range(k):
            out = out + w[:, i:i + 1].to(h.dtype) * Y[i]
        return out + shared_expert(h, L)

    @staticmethod
    def expert(L, e):
        """Expert ``e``'s (gate, up, down) weights in FP32, their exact values."""
        if "ffn.experts.w1" in L:
            return (L["ffn.experts.w1"][e].float(), L["ffn.experts.w3"][e].float(), L["ffn.experts.w2"][e].float())
        from references import mxfp8_dequant_ref, unswizzle_scales_ref

        def mx(q, flat):  # e4m3 rows with swizzled UE8M0 block scales -> FP32, by definition
            R, K = q.shape
            return mxfp8_dequant_ref(q.view(torch.uint8), unswizzle_scales_ref(flat, R, K // 32).to(q.device))

        gu = mx(L["ffn.experts.gate_up_q"][e], L["ffn.experts.gate_up_s"][e])  # blocks of 32 rows: gate, up, ...
        I2, C = gu.shape
        blocks = gu.view(I2 // 64, 2, 32, C)
        return (blocks[:, 0].reshape(I2 // 2, C), blocks[:, 1].reshape(I2 // 2, C),
                mx(L["ffn.experts.down_q"][e], L["ffn.experts.down_s"][e]))


def fp32_view(target: TargetModel) -> TargetModel:
    """An FP32 model of ``target``'s weights (their exact FP32 values): every tensor widened but
    the routed experts, which stay ``target``'s (run it with :class:`StreamingFp32Experts`)."""
    m = object.__new__(TargetModel)  # the weights are target's: nothing to initialise
    m.cfg, m.dtype, m.device, m.inv_freq = target.cfg, torch.float32, target.device, target.inv_freq
    widen = lambda k, v: v if k.startswith("ffn.experts.") or not v.is_floating_point() else v.float()  # noqa: E731
    m.w = {k: widen(k, v) for k, v in target.w.items()}
    m.layers = [{k: widen(k, v) for k, v in L.items()} for L in target.layers]
    return m


def test_streaming_fp32_experts_equal_the_spec():
    """The yardstick's MoE == the spec's per-choice gathers (an FP32 model, every layer kind):
    the step model's logits and draft features agree to FP32 rounding."""
    m = TargetModel(TINY, seed=5)
    g = torch.Generator().manual_seed(1)
    slots = torch.tensor([1, 0])
    outs = []
    for ops in (Ops(), StreamingFp32Experts()):
        st = DecodeState(TINY, 2, 256, 6, torch.float32, "cpu")
        step, out = StepModel(m, ops), []
        g.manual_seed(1)
        for c0, S in ((0, 40), (40, 6), (46, 6)):
            toks = torch.randint(0, TINY.vocab, (2, S), generator=g)
            out.append(step.forward(toks, torch.arange(c0, c0 + S)[None].expand(2, -1), slots, st))
        outs.append(out)
    for (a, fa), (b, fb) in zip(*outs):
        assert (a - b).abs().max() <= 1e-5 * a.abs().max() and (fa - fb).abs().max() <= 1e-5 * fa.abs().max()


def test_streaming_fp32_experts_read_mxfp8_operands(monkeypatch):
    """The yardstick on a model made with ``quantize_layer_experts`` (the MXFP8 operands, gate
    and up interleaved in 32-row blocks, swizzled scales) equals an FP32 model holding those
    operands' values as plain w1 / w3 / w2 (dequantized by the definition): the yardstick
    reads each expert's exact weights, in the right rows."""
    import spec_decode.fused_ops as fo
    from moe.experts import mxfp8_quantize_torch, swizzle_scales
    from references import mxfp8_dequant_ref

    def quantize_cpu(w):  # the kernel's rule, on the CPU (tests/test_moe_quant.py checks the kernel)
        qs, ss = zip(*(mxfp8_quantize_torch(w[e]) for e in range(w.shape[0])))
        return torch.stack(qs).view(torch.float8_e4m3fn), torch.stack([swizzle_scales(x) for x in ss])

    monkeypatch.setattr(fo, "quantize_expert_weights", quantize_cpu)
    made = TargetModel(TINY, seed=5, dtype=torch.bfloat16, on_layer=fo.quantize_layer_experts)
    plain = TargetModel(TINY, seed=5, dtype=torch.bfloat16)
    for L in plain.layers:  # the same experts, through the same rounding, kept unfused
        for w in ("w1", "w3", "w2"):
            E, N, K = L[f"ffn.experts.{w}"].shape
            q, sc = zip(*(mxfp8_quantize_torch(L[f"ffn.experts.{w}"][e]) for e in range(E)))
            L[f"ffn.experts.{w}"] = torch.stack([mxfp8_dequant_ref(a, b) for a, b in zip(q, sc)])
    a32, b32 = fp32_view(made), fp32_view(plain)
    for L in b32.layers:
        for w in ("w1", "w3", "w2"):
            L[f"ffn.experts.{w}"] = L[f"ffn.experts.{w}"].float()
    g = torch.Generator().manual_seed(2)
    toks = torch.randint(0, TINY.vocab, (2, 30), generator=g)
    pos, slots = torch.arange(30)[None].expand(2, -1), torch.tensor([1, 0])
    outs = []
    for m in (a32, b32):
        st = DecodeState(TINY, 2, 64, 6, torch.float32, "cpu")
        outs.append(StepModel(m, StreamingFp32Experts()).forward(toks, pos, slots, st)[0])
    assert (outs[0] - outs[1]).abs().max() <= 1e-5 * outs[1].abs().max()


# ---------------------------------------------------------------------------------- GPU ----
@pytest.mark.gpu
@pytest.mark.parametrize("model, prefill, experts", [("small", 29, "bf16"), ("v4_flash_slice", 200, "bf16"),
                                                     ("v4_flash_slice", 200, "mxfp8")])
def test_fused_ops_track_fp32_on_gpu(model, prefill, experts):
    """The fused backend (every layer kind) against an FP32 run of the same weights
    (:func:`fp32_view`, the routed experts widened one at a time) over a prefill chunk and
    verify steps crossing window boundaries (at V4-Flash's sizes the prefill closes an HCA
    window of 128): logits within a bound from bf16 activations and MXFP8 experts (relative
    2^-3 of the logits' norm), and wherever the greedy tokens differ, a near-tie in FP32: the
    fused pick's FP32 logit within a quarter of the row's logit spread (std) of the FP32
    maximum, or within 8 rms errors of the row (the MXFP8 experts' 3-bit-mantissa activations
    leave ~9% noise at V4-Flash's size; a pick further down needs an error far in its row's
    tail). (Exact argmax agreement is not the criterion: a random model's top-2 logits are
    often closer than bf16's rounding; a wrong state row or weight picks tokens whole standard
    deviations down and fails the relative bound too.) The V4-Flash case with bf16 experts holds the bf16 model, its MXFP8
    experts and the FP32 view at once (~100 GB: an H200); with ``experts="mxfp8"`` the model is
    made as the kernel engines make it (each layer's experts MXFP8 as it is made), and the FP32
    run reads those MXFP8 weights' exact values (~55 GB)."""
    from spec_decode.config import PRESETS
    from spec_decode.fused_ops import FusedOps, quantize_layer_experts

    cfg = PRESETS[model]
    max_len = 256
    if model != "small" and experts == "bf16" and torch.cuda.get_device_properties(0).total_memory < 100 << 30:
        pytest.skip("the bf16 V4-Flash slice beside its MXFP8 experts and FP32 view needs ~100 GB")
    target = TargetModel(cfg, seed=0, dtype=torch.bfloat16, device="cuda",
                         on_layer=quantize_layer_experts if experts == "mxfp8" else None)
    fused = StepModel(target, FusedOps(target, max_tokens=2 * prefill, max_len=max_len))
    base = StepModel(fp32_view(target), StreamingFp32Experts())
    st_f = DecodeState(cfg, 3, max_len, 6, torch.bfloat16, "cuda")
    st_b = DecodeState(cfg, 3, max_len, 6, torch.float32, "cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    slots, start = torch.tensor([2, 0], device="cuda"), torch.tensor([0, 7], device="cuda")
    for S in (prefill, 6, 6, 6, 1, 6):
        toks = torch.randint(0, cfg.vocab, (2, S), device="cuda", generator=g)
        pos = torch.arange(S, device="cuda")[None] + start[:, None]
        with torch.no_grad():
            a = fused.forward(toks, pos, slots, st_f)[0].float()
            b = base.forward(toks, pos, slots, st_b)[0]
        rel = float((a - b).norm() / b.norm())
        assert torch.isfinite(a).all() and rel < 0.125, f"S={S}: relative error {rel:.4f}"
        a, b = a.flatten(0, -2), b.flatten(0, -2)
        short = greedy_shortfall(b, a.argmax(-1), (a - b).pow(2).mean(-1).sqrt())  # the row's rms error
        assert float(short.max()) <= 1, f"S={S}: fused pick {float(short.max()):.2f} near-ties below the FP32 maximum"
        start = start + S


@pytest.mark.gpu
@pytest.mark.parametrize("model,backend", [("small", "fused"), ("v4_flash_slice", "fused"), ("small", "base")])
def test_kernel_engine_generates_in_graphs_on_gpu(model, backend):
    """The fused (and the base) engine at BS 1, 3 and 64 in captured graphs: speculative decoding with the model
    draft and plain greedy decoding each produce as many tokens as asked, and each token is the
    engine's own greedy pick given the tokens before it (teacher-forced, one eager prefill
    forward) at >= 75% of positions, checked for every request of BS 1 and 3 and 4 of BS 64.
    (Not bit-equal continuations: a verify block's T = 6 launches take other kernels and
    accumulation orders than a prefill chunk's, and the MXFP8 requantisation of SiLU * up can
    move a byte, so near-ties flip -- with random weights and V4's 129K vocabulary the top-2
    logits are often that close, a few positions in 24. A state row read from the wrong
    position or slot picks a near-random token: agreement near 0.)"""
    from spec_decode.config import PRESETS

    eng = Engine(EngineConfig(model=PRESETS[model], device="cuda", dtype="bfloat16", backend=backend,
                              max_seq_len=320))
    for B in (1, 3) if UNDER_SANITIZER else (1, 3, 64):
        ps = prompts(B, B, vocab=PRESETS[model].vocab, lo=200, hi=260)
        spec = eng.generate(ps, 24)
        plain = eng.generate(ps, 24, speculative=False) if B <= 3 else []
        assert [len(o) for o in spec] == [24] * B and [len(o) for o in plain] == [24] * len(plain)
        for what, outs in (("speculative", spec[:4]), ("plain", plain)):
            agree = sum(a == b for p, o in zip(ps, outs) for a, b in zip(eng.greedy_given(p, o), o))
            n = sum(map(len, outs))
            assert agree >= 0.75 * n, f"BS {B} {what}: {agree} / {n} tokens are the teacher-forced greedy"
    assert eng.verify_graphs.use_graphs and eng.draft_graphs.replays > 0


@pytest.mark.gpu
def test_programmatic_dependent_launches_change_no_token_on_gpu():
    """EngineConfig.wo_a_pdl and .router_pdl (WO-A's decode kernels and the routers launched as
    programmatic dependents inside the step graphs): the same kernels, numerics and launch
    order, so the fused engine generates exactly the tokens it generates without them (BS 1
    and 3, speculative, captured graphs) -- a dependent that read its input before the kernel
    before it finished would not."""
    from spec_decode.config import SMALL

    outs = []
    for pdl in (False, True):
        eng = Engine(EngineConfig(model=SMALL, device="cuda", dtype="bfloat16", backend="fused", max_seq_len=160,
                                  wo_a_pdl=pdl, router_pdl=pdl))
        outs.append([eng.generate(prompts(10 + B, B, vocab=SMALL.vocab, lo=40, hi=80), 16) for B in (1, 3)])
        assert eng.verify_graphs.use_graphs and eng.draft_graphs.replays > 0
    assert outs[0] == outs[1]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["base", "fused"])
def test_kernel_engine_does_not_read_uninitialised_memory(backend, generate_on_recycled_memory):
    """An engine built on recycled memory full of NaN bytes generates exactly the tokens of the
    same engine built on memory full of zeros (BS 3, speculative, captured graphs): no result
    depends on a buffer's bytes before the engine writes it -- padding rows of the expert
    GEMMs, split-K partials, state rows before their first write."""
    from spec_decode.config import SMALL

    ps = prompts(3, 3, vocab=SMALL.vocab, lo=40, hi=80)
    outs = generate_on_recycled_memory(
        lambda: Engine(EngineConfig(model=SMALL, device="cuda", dtype="bfloat16", backend=backend, max_seq_len=160)),
        ps, 16)
    assert outs[0xFF] == outs[0x00]


@pytest.mark.gpu
def test_mx_draft_head_on_gpu():
    """H200: the fused engine's MXFP8 draft head against the FP32 product of its own dequantised
    operands (the GEMM's spec: rounding only at the bf16 output) and against the bf16 head
    (MXFP8's own error) for batches of 1, 5 and 16 rows (output poisoned before each call); the
    bf16 head's product above 16 rows; then one head serving two batch sizes (the MXFP8 and the
    bf16 path) inside captured graphs."""
    from moe.experts import dequantize
    from spec_decode.fused_ops import MxDraftHead

    V, C = 4096 + 64, 1024  # vocab not a multiple of 128 (the kernel's 64-row weight tiles)
    g = torch.Generator(device="cuda").manual_seed(random.randrange(2**31))  # fresh inputs each run
    lm_head = (torch.randn(V, C, device="cuda", generator=g) / C ** 0.5).bfloat16()
    head = MxDraftHead(lm_head, max_batch=64)
    w = dequantize(head.w_q[0], head.w_s[0], V, C)
    for B in (1, 5, 16):
        h = torch.randn(B, C, device="cuda", generator=g).bfloat16()
        head.out.fill_(float("nan"))
        out = head(h).float()
        a = dequantize(head.q, head.s, head.TILE, C)[:B]
        ref = a @ w.T
        assert torch.isfinite(out).all()
        assert ((out - ref).norm() / ref.norm()).item() < 5e-3, B
        bf = (h.float() @ lm_head.float().T)
        assert ((out - bf).norm() / bf.norm()).item() < 0.08, B
    h = torch.randn(40, C, device="cuda", generator=g).bfloat16()
    assert torch.equal(head(h), h @ lm_head.T)
    # fp8_above (the default draft head above 16 rows): per-tensor e4m3 scores above 16 rows keep most rows' argmax
    fp8 = MxDraftHead(lm_head, max_batch=64, fp8_above=True)
    fp8.fp8[2].fill_(float("nan"))
    agree = (fp8(h).argmax(-1) == (h @ lm_head.T).argmax(-1)).float().mean().item()
    assert agree >= 0.75, agree
    # captured: each graph keeps its batch's inputs, counts and output rows
    hs = {B: torch.randn(B, C, device="cuda", generator=g).bfloat16() for B in (2, 33)}
    outs, graphs = {}, {}
    for B in hs:
        head(hs[B])  # warm (compiles) outside the capture
        torch.cuda.synchronize()
        graphs[B] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[B]):
            outs[B] = head(hs[B]).argmax(-1)
    for B in (33, 2, 33):
        graphs[B].replay()
        torch.cuda.synchronize()
        assert torch.equal(outs[B], head(hs[B]).argmax(-1))


@pytest.mark.parametrize("backend, length", [("torch-bf16", 5.5), ("torch-bf16", 3.0), ("reference", 4.0),
                                             ("torch-bf16", 1.0), ("torch-bf16", 6.0)])
def test_synthetic_acceptance(backend, length):
    """acceptance_length: the verify accepts a device-drawn number of drafts with that mean (the
    per-position probability solved from it): the achieved mean within 3.5 standard errors of the
    target (the distribution's own variance), exact at the ends (1: nothing accepted, 6: everything), every request's output
    length and finish unchanged by it, the pipelined and the synchronous loops alike."""
    from spec_decode.engine import acceptance_probability

    p = acceptance_probability(length, 5)
    assert abs(sum(p ** i for i in range(6)) - length) < 1e-9
    eng = Engine(EngineConfig(seed=2, max_seq_len=320, backend=backend, graph_batch_sizes=(1, 2, 4),
                              acceptance_length=length))
    per = [200, 150, 90]
    out = eng.generate(prompts(3, 3), per)
    assert [len(o) for o in out] == per
    acc = eng.stats.acceptance_lengths
    mean = sum(acc) / len(acc)
    if length in (1.0, 6.0):
        assert set(acc) == {int(length)}
    else:  # the length's variance from the distribution itself: P(j) = p^j (1 - p) for j < 5, P(5) = p^5
        probs = [p ** j * (1 - p) for j in range(5)] + [p ** 5]
        var = sum(q * (j + 1 - length) ** 2 for j, q in enumerate(probs))
        assert abs(mean - length) <= 3.5 * math.sqrt(var / len(acc)), (mean, length, len(acc))
    with pytest.raises(ValueError, match="acceptance_length"):
        Engine(EngineConfig(acceptance_length=7.0))


def test_acceptance_length_set_on_a_built_engine(tmp_path):
    """Engine.set_acceptance_length (the bench's sweep): the next generate draws with the new
    mean on the same engine, None restores the draft's real acceptance, bad values raise; the
    sweep's CSV round-trips through the plotter (a PNG where matplotlib is installed, else a
    note naming the command)."""
    from spec_decode.bench import plot_sweep, write_sweep

    eng = Engine(EngineConfig(seed=2, max_seq_len=320, backend="torch-bf16", graph_batch_sizes=(1, 2)))
    eng.set_acceptance_length(6.0)
    eng.generate(prompts(3, 2), 60)
    assert set(eng.stats.acceptance_lengths) == {6}
    eng.set_acceptance_length(1.0)
    eng.generate(prompts(3, 2), 20)
    assert set(eng.stats.acceptance_lengths) == {1}
    for bad in (0.5, 6.5, True, "5"):
        with pytest.raises(ValueError, match="acceptance_length"):
            eng.set_acceptance_length(bad)
    rows = [("base", "BS1", 1.0, 1.0, 100.0), ("fused", "BS1", 1.0, 1.0, 130.0), ("base", "BS1", 6.0, 6.0, 500.0)]
    note = write_sweep(rows, str(tmp_path / "s.csv"), str(tmp_path / "s.png"), "t")
    assert (tmp_path / "s.csv").read_text().splitlines()[1] == "base,BS1,1,1.000,100.0"
    try:
        import matplotlib  # noqa: F401
        assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
    except ImportError:
        assert "--plot-from" in note and plot_sweep(str(tmp_path / "s.csv"), "x.png").startswith("wrote")


def test_step_bytes_roofline():
    """spec_decode.bench.step_bytes: the weights term counts every non-expert weight and the
    routed experts touched; more requests touch more experts and read more state, never fewer
    bytes; all experts touched -> every expert's MXFP8 bytes."""
    from spec_decode.bench import expected_experts_touched, step_bytes
    from spec_decode.config import V4_FLASH_SLICE as m

    one, many = step_bytes(m, 1, 6, 4096), step_bytes(m, 64, 6, 4096)
    assert one["weights"] < many["weights"] and one["state"] * 64 == many["state"]
    assert expected_experts_touched(256, 6, 1) == pytest.approx(6) and expected_experts_touched(256, 6, 10**6) == pytest.approx(256)
    full = step_bytes(m, 64, 6, 4096, experts_touched=m.experts)
    per_layer_experts = m.experts * 3 * m.expert_inter * m.hidden * (1 + 1 / 32)
    none = step_bytes(m, 64, 6, 4096, experts_touched=0)
    assert full["weights"] - none["weights"] == pytest.approx(m.layers * per_layer_experts)
    # BS1 verify at the V4-Flash slice: ~0.28 GB of non-expert bf16 weights a layer, ~33 of 256
    # experts touched by 36 choices (26 MB each in MXFP8) a layer, the 1.06 GB head
    assert 5.0e9 < one["total"] < 6.5e9
    d = step_bytes(m, 1, 5, 4096, draft=True)
    assert d["state"] > 0 and d["weights"] > m.vocab * m.hidden * 2
