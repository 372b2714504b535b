"""Tensor / expert parallel decode on the CPU: one process per rank (gloo), spawned here.

TP = 2 and 4 generate the greedy tokens of TP = 1 (FP32, `tiny`), plain and speculative, and
their step logits agree to FP32 reduction-order error; a rank that dies mid-generation makes
the others raise within a bounded time instead of hanging."""

import dataclasses
import os
import queue
import tempfile
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from spec_decode import CollectiveError, Engine, EngineConfig
from spec_decode.config import TINY
from spec_decode.model import TargetModel
from spec_decode.step_model import Shard, check_tp, shard_model

from references import greedy_shortfall

PROMPTS = [[5, 9, 100, 3, 3, 17, 40], [1, 2], [77] * 11]
NEW = 21
#: the dying run: request 0 asks for 3 tokens (done after the first verify steps), the others
#: for NEW; the last rank exits at its DIE_AT-th all-reduce, steps after request 0 finished
DIE_NEW, DIE_AT = [3, NEW, NEW], 120
#: tiny with 4 WO-A groups (of 2 heads): TP 2 and 4 split whole groups
MODEL = dataclasses.replace(TINY, heads=8, wo_groups=4)


def _config(tp, **kw):
    return EngineConfig(model=MODEL, tp=tp, backend="torch-bf16", max_seq_len=64, graph_batch_sizes=(1, 2, 4), seed=3,
                        **kw)


def _probe_logits(eng):
    """One 6-token verify-shaped forward on the scratch slot (no request's state changes)."""
    toks = torch.tensor([[4, 8, 15, 16, 23, 42]])
    pos = torch.arange(6)[None] + 9
    return eng.step.forward(toks, pos, torch.tensor([eng.scratch_slot]), eng.state)[0]


def _worker(rank, world, init, results, mode):
    import torch.distributed as dist

    torch.set_num_threads(1)  # world processes share the machine's cores
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=__import__("datetime").timedelta(seconds=20))
        eng = Engine(_config(world, dist_timeout_s=20))
        if mode == "die":
            calls = [0]
            real = eng.step.ops.all_reduce

            def dying(x):
                calls[0] += 1
                if rank == world - 1 and calls[0] == DIE_AT:  # mid-generation
                    os._exit(3)
                return real(x)
            eng.step.ops.all_reduce = dying
            t0 = time.monotonic()
            try:
                eng.generate(PROMPTS, DIE_NEW)
                results.put((rank, ("no error", None, None), time.monotonic() - t0))
            except CollectiveError as e:
                results.put((rank, (str(e), e.outputs, e.finished), time.monotonic() - t0))
            return
        out = {"plain": eng.generate(PROMPTS, NEW, speculative=False), "spec": eng.generate(PROMPTS, NEW),
               "logits": _probe_logits(eng).tolist()}  # plain lists: the process may exit before the read
        eng.close()  # the caller's group: released, not destroyed
        try:
            eng.generate(PROMPTS, 1)
            after = "generated"
        except RuntimeError as e:
            after = str(e)
        out["closed"] = (eng.step.ops.group, dist.is_initialized(), "closed" in after)
        results.put((rank, out, None))
    except Exception:
        results.put((rank, traceback.format_exc(), None))


def _run(world, mode, timeout=240):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        init = "file://" + os.path.join(d, "rendezvous")
        procs = [ctx.Process(target=_worker, args=(r, world, init, results, mode)) for r in range(world)]
        for p in procs:
            p.start()
        got = {}
        deadline = time.monotonic() + timeout
        want = world if mode != "die" else world - 1
        while len(got) < want and time.monotonic() < deadline:
            try:
                r, val, dt = results.get(timeout=5)
                got[r] = (val, dt)
            except queue.Empty:
                pass
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert len(got) == want, f"ranks answered: {sorted(got)} of {want} within {timeout} s (a hang?)"
    return got


@pytest.fixture(scope="module")
def tp1():
    eng = Engine(_config(1))
    return {"plain": eng.generate(PROMPTS, NEW, speculative=False), "spec": eng.generate(PROMPTS, NEW),
            "logits": _probe_logits(eng)}


@pytest.mark.parametrize("world", [2, 4])
def test_tp_generates_the_tp1_tokens(world, tp1):
    got = _run(world, "generate")
    for rank, (out, _) in got.items():
        assert isinstance(out, dict), out  # a traceback otherwise
        # every rank holds the same all-reduced logits: the same tokens
        assert out["plain"] == got[0][0]["plain"] and out["spec"] == got[0][0]["spec"]
        assert out["closed"] == (None, True, True)  # and a closed engine refuses to generate
        diff = (torch.tensor(out["logits"]) - tp1["logits"]).abs().max().item()
        assert diff < 1e-5 * tp1["logits"].abs().max().item(), diff  # FP32 reduction order only
    assert got[0][0]["spec"] == got[0][0]["plain"]
    if got[0][0]["plain"] != tp1["plain"]:  # only a near-tie may part them: show its gap
        pytest.fail(f"TP{world} tokens differ from TP1: {got[0][0]['plain']} vs {tp1['plain']}")


def test_a_dead_rank_makes_the_others_raise_in_bounded_time(tp1):
    """The surviving rank raises CollectiveError within the timeout; the request that finished
    before the death keeps its whole output, the others a prefix of theirs (TP1's tokens)."""
    got = _run(2, "die", timeout=120)
    (msg, outputs, finished), dt = got[0]
    assert "tensor-parallel rank 0 of 2" in msg and "collective" in msg, msg
    assert dt < 60
    assert finished == [True, False, False], (finished, outputs)
    assert outputs[0] == tp1["spec"][0][:DIE_NEW[0]]
    for out, want in zip(outputs[1:], tp1["spec"][1:]):
        assert out == want[:len(out)] and len(out) < NEW


def test_shards_partition_the_layer():
    m = TargetModel(TINY, seed=0)
    full = [dict(L) for L in m.layers]
    shards = [Shard(TINY, r, 2).slice_layer(full[1], TINY) for r in range(2)]
    for k in ("attn.wq_b.weight", "attn.attn_sink", "attn.wo_a.weight", "ffn.experts.w1", "ffn.shared_experts.w1.weight"):
        assert torch.equal(torch.cat([s[k] for s in shards]), full[1][k])
    assert torch.equal(torch.cat([s["attn.wo_b.weight"] for s in shards], 1), full[1]["attn.wo_b.weight"])
    assert torch.equal(shards[1]["attn.wkv.weight"], full[1]["attn.wkv.weight"])  # the KV head: replicated
    shard_model(m, 1, 2)
    assert m.shard.first_expert == TINY.experts // 2 and m.layers[1]["ffn.experts.w1"].shape[0] == TINY.experts // 2
    with pytest.raises(ValueError, match="tp must be"):
        check_tp(TINY, 3)
    with pytest.raises(ValueError, match="wo_groups"):
        check_tp(TINY, 4)  # 2 WO-A groups
    check_tp(MODEL, 4)


def test_tp_config_errors():
    with pytest.raises(ValueError, match="backend='torch-bf16' or 'fused'"):
        Engine(EngineConfig(tp=2))
    with pytest.raises(ValueError, match="torchrun"):
        Engine(EngineConfig(tp=2, backend="torch-bf16"))


def test_torchrun_command_line_matches_one_rank():
    """The README's command: torchrun starts 2 gloo ranks of `python -m spec_decode run --tp 2`;
    rank 0 prints the tokens one rank prints."""
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = ["-m", "spec_decode", "run", "--backend", "torch-bf16", "--new", "12"]
    one = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, env=env)
    # (--standalone: a free rendezvous port, not the fixed default another run may still hold)
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          *args, "--tp", "2"], capture_output=True, text=True, timeout=300, env=env)
    # a failing rank's own traceback comes before torchrun's summary: both in the message
    assert one.returncode == 0 and two.returncode == 0, (one.stderr[-1500:], two.stderr[:4000], two.stderr[-1500:])
    first = [ln for ln in two.stdout.splitlines() if ln.startswith("first request")]
    assert len(first) == 1 and "TP2 (torch.distributed all-reduce)" in two.stdout  # rank 0 only
    assert first[0] in one.stdout


@pytest.mark.parametrize("world", [2, 4])
def test_simulated_ranks_generate_the_tp1_tokens(world, tp1):
    """EngineConfig(tp=N, simulate_ranks=True): every rank in this process (one thread each on
    the CPU, an FP32 rank-order sum as the all-reduce): the tokens of TP1, plain and
    speculative, and the probe logits to FP32 reduction-order error."""
    eng = Engine(_config(world, simulate_ranks=True))
    assert eng.step.tp == world and len({id(s.state if hasattr(s, "state") else s) for s in eng.step.states}) == world
    assert eng.generate(PROMPTS, NEW, speculative=False) == tp1["plain"]
    assert eng.generate(PROMPTS, NEW) == tp1["spec"]
    diff = (_probe_logits(eng) - tp1["logits"]).abs().max().item()
    assert diff < 1e-5 * tp1["logits"].abs().max().item()


def test_simulated_rank_failure_raises_on_the_caller():
    eng = Engine(_config(2, simulate_ranks=True, dist_timeout_s=5))

    def broken(*a, **k):
        raise RuntimeError("rank 1 broke")
    eng.step.steps[1].forward = broken
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 broke"):
        eng.generate(PROMPTS, 4, speculative=False)
    assert time.monotonic() - t0 < 30


# ---------------------------------------------------------------------------------- GPU ----
def _gpu_engine(backend, tp, **kw):
    from spec_decode.config import SMALL

    return Engine(EngineConfig(model=SMALL, device="cuda", dtype="bfloat16", backend=backend, tp=tp,
                               simulate_ranks=tp > 1, max_seq_len=256, graph_batch_sizes=(1, 4), **kw))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch-bf16", "base", "fused"])
def test_simulated_tp4_on_gpu_agrees_with_tp1(backend):
    """TP4 on one GPU (simulated ranks, push all-reduce in the graphs) against TP1 of the same
    weights, teacher-forced through TP1's output: logits within 2^-3 of TP1's (norm-wise, as
    the fused-vs-FP32 test: the ranks' bf16 partial sums round differently and a random model
    amplifies it), and every TP4 pick TP1's argmax or a near-tie in TP1's logits (a random
    model's top two logits are often closer than bf16's rounding); TP4's graph-generated
    tokens likewise against its own eager logits. Finite outputs, every request as many
    tokens as asked."""
    ps = [prompts_gpu(s) for s in range(4)]
    one = _gpu_engine(backend, 1)
    out1 = one.generate(ps, 16)
    ref = [one.logits_given(p, o) for p, o in zip(ps, out1)]
    del one
    four = _gpu_engine(backend, 4)
    out4 = four.generate(ps, 16)
    assert [len(o) for o in out4] == [16] * 4
    for r, (p, o1, o4) in enumerate(zip(ps, out1, out4)):
        got = four.logits_given(p, o1)
        rel = float((got - ref[r]).norm() / ref[r].norm())
        noise = (got - ref[r]).pow(2).mean(-1).sqrt()
        short = greedy_shortfall(ref[r], got.argmax(-1), noise)
        print(f"TP4 ({backend}, simulated) vs TP1, request {r}: relative {rel:.2e}, "
              f"{int((short > 0).sum())} / {len(o1)} picks differ")
        assert torch.isfinite(got).all() and rel < 2 ** -3, (r, rel)
        assert float(short.max()) <= 1, (r, float(short.max()))
        # the graphs against the eager forward: a wrong graph path cannot hide behind it
        own = four.logits_given(p, o4)
        short = greedy_shortfall(own, torch.tensor(o4, device=own.device), noise)
        assert float(short.max()) <= 1, (r, "graph vs eager", float(short.max()))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["base", "fused"])
def test_simulated_tp4_does_not_read_uninitialised_memory(backend, generate_on_recycled_memory):
    """An engine built on recycled memory full of NaN bytes generates exactly the tokens of the
    same engine built on memory full of zeros: no result depends on a buffer's bytes before
    the engine writes it (a rank's expert-parallel output rows that its GEMMs do not write,
    padding rows, split-K partials, rings before their first write). Speculative decoding
    through the captured TP4 graphs, four requests."""
    outs = generate_on_recycled_memory(lambda: _gpu_engine(backend, 4), [prompts_gpu(s) for s in range(4)], 12)
    assert outs[0xFF] == outs[0x00]


@pytest.mark.gpu
@pytest.mark.parametrize("T", [6, 70, 384])
def test_fused_expert_parallel_partials_sum_to_the_whole_on_gpu(T):
    """The fused MoE of each of 4 expert-parallel ranks of SMALL (8 of 32 routed experts and a
    quarter of the shared expert each, the router's whole packing) on the real kernels, at a
    verify step, a mid-size step and a prefill chunk: the ranks' partials summed in FP32 equal
    the unsharded fused MoE within the four partials' bf16 roundings (norm-wise 4 x 2^-8) on
    every layer -- a rank that dropped tiles of its experts would be off by tens of percent."""
    from spec_decode.config import SMALL
    from spec_decode.fused_ops import FusedOps
    from spec_decode.step_model import RankView

    torch.manual_seed(T)
    t = TargetModel(SMALL, seed=0, dtype=torch.bfloat16, device="cuda")
    whole_ops = FusedOps(t, max_tokens=512, max_len=256)
    views = [RankView(t, Shard(SMALL, r, 4)) for r in range(4)]
    ranks = [FusedOps(v, max_tokens=512, max_len=256) for v in views]
    for li, L in enumerate(t.layers):
        h = torch.randn(T, SMALL.hidden, device="cuda").bfloat16()
        tok = torch.randint(0, SMALL.vocab, (T,), device="cuda")
        want = whole_ops.moe(h, L, SMALL, tok).float()
        got = sum(ops.moe(h, v.layers[li], SMALL, tok, v.shard.first_expert).float() for ops, v in zip(ranks, views))
        err = float((got - want).norm() / want.norm())
        assert err < 4 * 2.0**-8, f"layer {li}, T={T}: sum of the ranks' partials off by {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("T", [6, 70])
def test_expert_parallel_fused_and_base_partials_on_gpu(T):
    """Each of 4 expert-parallel ranks of SMALL, every layer (hash-routed ones included), the
    fused MoE's partial against the base backend's, in two parts:

    * routers: the kernel's picks and packed layout equal PyTorch's top-k + alignment; the
      weights differ in rounding only (the kernel's ``exp`` and series ``log1p`` against
      torch's: each within 4e-6 relative of the FP64 definition, ``tests/test_moe_router.py``,
      so within 8e-6 of each other);
    * with the kernel router's outputs in both, the fused partial (finalize + shared add in one
      launch, the routed input quantized beside the router) equals the base one (standalone
      finalize -> bf16, + shared -> bf16, quantized after the router) bit for bit: the fusions
      keep every rounding point. The all-reduce that follows is bit-exact to its unfused
      sequence (`tests/test_comm.py`)."""
    from spec_decode.config import SMALL
    from spec_decode.fused_ops import BaseOps, FusedOps
    from spec_decode.step_model import RankView

    class BaseOpsKernelRouter(BaseOps):
        route = FusedOps.route  # every other change of the base arm kept

    torch.manual_seed(100 + T)
    t = TargetModel(SMALL, seed=1, dtype=torch.bfloat16, device="cuda")
    views = [RankView(t, Shard(SMALL, r, 4)) for r in range(4)]
    for v in views:
        kw = dict(max_tokens=256, max_len=256)
        fused, base, base_kr = FusedOps(v, **kw), BaseOps(v, **kw), BaseOpsKernelRouter(v, **kw)
        for li, L in enumerate(v.layers):
            h = torch.randn(T, SMALL.hidden, device="cuda").bfloat16()
            tok = torch.randint(0, SMALL.vocab, (T,), device="cuda")
            where = (v.shard.rank, li)
            logits = h @ L["ffn.gate.weight"].T
            rk = fused.route(logits, L, fused._layer[id(L)], SMALL, tok)
            rt = base.route(logits, L, base._layer[id(L)], SMALL, tok)
            assert torch.equal(rk.topk_ids, rt.topk_ids), where
            n = int(rt.total_rows)
            assert int(rk.total_rows) == n, where
            for name in ("expert_counts", "expert_offsets", "routed_row_pos"):
                assert torch.equal(getattr(rk, name), getattr(rt, name)), (where, name)
            assert torch.equal(rk.sorted_token_ids[:n], rt.sorted_token_ids[:n]), where
            tiles = n // fused.router.cfg.tile_m
            assert torch.equal(rk.tile_expert[:tiles], rt.tile_expert[:tiles]), where
            assert torch.allclose(rk.topk_weights, rt.topk_weights, rtol=8e-6, atol=0), where

            got = fused.moe(h, L, SMALL, tok, v.shard.first_expert)
            want = base_kr.moe(h, L, SMALL, tok, v.shard.first_expert)
            assert got.isfinite().all()
            assert torch.equal(got, want), (where, float((got.float() - want.float()).abs().max()))


def prompts_gpu(seed, n=40, vocab=512):
    import random

    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


@pytest.mark.gpu
@pytest.mark.parametrize("backend,batch,replays", [("fused", 1, 200), ("fused", 4, 50), ("base", 1, 50),
                                                   ("base", 4, 50)])
def test_simulated_tp4_graph_replays_with_fresh_inputs(backend, batch, replays):
    """Replays of one captured TP4 verify graph (push all-reduce and phase counters inside),
    new tokens before every replay, each replay's logits == an eager TP4 forward of the same
    tokens at the same positions (the same kernels, the same FP32 rank-order sums: bit for
    bit) -- over a history an eager prefill wrote first (160 positions: full sliding windows,
    closed CSA and HCA compressor windows), so the graph reads the state the prefill left.
    (Each replay's eager reference runs the four simulated ranks in turn, so replays are
    costly: 200 at BS1, 50 elsewhere.)"""
    eng = _gpu_engine(backend, 4)
    K1 = eng.config.block_size + 1
    g = torch.Generator(device="cuda").manual_seed(0)
    n_hist = 160
    for slot in range(batch):
        seq = torch.randint(0, eng.config.model.vocab, (n_hist,), generator=torch.Generator().manual_seed(slot))
        for _ in eng._chunked_forward(seq.tolist(), slot):
            pass
    slots = torch.arange(batch, device="cuda")
    pos = (torch.arange(K1, device="cuda") + n_hist)[None].expand(batch, -1).contiguous()
    for i in range(replays):
        toks = torch.randint(0, eng.config.model.vocab, (batch, K1), device="cuda", generator=g)
        got = eng.verify_graphs.run(toks, pos, slots)[0].clone()
        want = eng.step.forward(toks, pos, slots, eng.state)[0]
        assert torch.equal(got, want), (i, float((got.float() - want.float()).abs().max()))
    eng._check_collectives()


@pytest.mark.gpu
def test_simulated_tp4_absent_rank_raises():
    """A rank that never joins its all-reduces: eagerly (the prefill) the others' bounded
    waits expire (dist_timeout_s) and generate raises naming the collective; inside a
    captured graph the push kernels' bounded spins expire and the engine's check raises
    AllReduceTimeout -- never a hang or a silent result."""
    from comm.buffers import AllReduceTimeout

    eng = _gpu_engine("torch-bf16", 4, dist_timeout_s=2.0)
    absent = eng.step.steps[3].ops
    absent.all_reduce = lambda x: x
    with pytest.raises(RuntimeError, match="collective"):
        eng.generate([prompts_gpu(0)], 4, speculative=False)
    eng = _gpu_engine("torch-bf16", 4)
    eng.warm_up(1)  # every graph captured while all ranks still push
    push = eng.step.ops.push
    push.max_spins = 1 << 14
    K1 = eng.config.block_size + 1
    slots = torch.tensor([0], device="cuda")
    pos = (torch.arange(K1, device="cuda") + 7)[None]
    toks = torch.zeros(1, K1, dtype=torch.long, device="cuda")
    push.ranks[3].phase.add_(1)  # rank 3 a phase ahead: its pushes are not the ones its peers wait for
    eng.verify_graphs.run(toks, pos, slots)
    torch.cuda.synchronize()
    with pytest.raises(AllReduceTimeout):
        eng._check_collectives()


@pytest.mark.gpu
def test_simulated_tp4_delayed_rank_still_correct():
    """A rank whose push all-reduces in the captured graphs start late (an in-kernel delay
    before its pushes): its peers wait for it within the bounded spin and the outputs equal an
    undelayed run's."""
    ps = [prompts_gpu(s) for s in range(2)]
    want = _gpu_engine("torch-bf16", 4).generate(ps, 8, speculative=False)
    eng = _gpu_engine("torch-bf16", 4)
    slow = eng.step.steps[2].ops
    push, eager = slow.push, slow.all_reduce

    def late(x):
        if not torch.cuda.is_current_stream_capturing():
            return eager(x)  # eager forwards sum through threads
        return push.allreduce(2, x.reshape(-1, x.shape[-1]).contiguous(), delay=20000).view(x.shape)
    slow.all_reduce = late
    assert eng.generate(ps, 8, speculative=False) == want
    eng._check_collectives()
