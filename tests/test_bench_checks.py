"""The benchmarks' checks and measurement helpers, on the CPU: the peer bench's output checks
(bench/bench_peers.py) decide whether a peer is timed, so a wrong check would time a peer that
computes something else; the overlap helper (bench/common.py) is what the side-stream tables
report."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import bench_compressor  # noqa: E402
import bench_peers  # noqa: E402
import common  # noqa: E402


def _codes(vals):
    return torch.tensor(vals, dtype=torch.uint8).view(torch.float8_e4m3fn)


def test_e4m3_agreement_counts_one_step_codes_and_refuses_further():
    q = _codes([0x00, 0x38, 0xB8, 0x7E, 0x01])  # +0, 1.0, -1.0, 448, the smallest subnormal
    assert bench_peers.e4m3_agreement(q, q.clone()) == "bit-exact"
    one = _codes([0x80, 0x39, 0xB7, 0x7E, 0x00])  # -0, next up, next toward 0, equal, 0
    assert bench_peers.e4m3_agreement(q, one).startswith("3 of 5 e4m3 codes one step")
    assert bench_peers.e4m3_agreement(q, _codes([0x00, 0x3A, 0xB8, 0x7E, 0x01])) is None  # two steps
    assert bench_peers.e4m3_agreement(q, _codes([0x00, 0xB8, 0xB8, 0x7E, 0x01])) is None  # sign
    zeros = torch.zeros(5, dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert bench_peers.e4m3_agreement(q, zeros) is None  # a peer that wrote nothing


def test_rel_norm_and_bounds():
    a = torch.tensor([1.0, 2.0, 2.0])
    assert bench_peers.rel_norm(a, a) == 0.0
    assert abs(bench_peers.rel_norm(a * 1.01, a) - 0.01) < 1e-6
    # the bounds are the documented rounding counts
    assert bench_peers.NORM_REL_BOUND == 6 * 2.0 ** -8 and bench_peers.FP8_GEMM_REL_BOUND == 2.0 ** -3


def test_overlap_fractions_and_median():
    from types import SimpleNamespace as S

    spans = [S(start=0, end=10), S(start=20, end=30), S(start=40, end=40)]
    others = [S(start=5, end=8), S(start=7, end=12), S(start=25, end=100)]
    # [0, 10]: 3 + 3 (summed, the two others overlap each other) = 6 of 10; [20, 30]: 5 of 10; empty span: 0
    assert common.overlap_fractions(spans, others) == [0.6, 0.5, 0.0]
    assert common.overlap_fractions([S(start=0, end=4)], [S(start=0, end=4), S(start=1, end=3)]) == [1.0]  # capped
    assert common.median([3.0, 1.0, 2.0]) == 2.0 and common.median([]) != common.median([])  # NaN when empty


def test_compressor_bench_cases_close_the_windows_it_says():
    """bench/bench_compressor.py's verify steps: at BS 1 one token closes a CSA and an HCA window;
    at BS 64 every request closes at least one CSA window and three requests close an HCA
    window -- the table's "tokens closing a window" -- and the fallback writes exactly those
    entries (run on the CPU at the indexer's width)."""
    from cute_kernels.compressor_pool import compressor_pool_torch

    g = torch.Generator().manual_seed(0)
    for B, ratio, overlap, want in ((1, 4, True, 1), (1, 128, False, 1), (64, 128, False, 3)):
        (fresh, ring, pool, ape, w, rot, pos, slot), closing, nbytes = bench_compressor.make_inputs(
            B, 128, ratio, overlap, g, device="cpu")
        assert closing == want and nbytes > 0
        compressor_pool_torch(fresh, ring, pool, ape, w, rot, pos, slot, ratio=ratio, overlap=overlap, eps=1e-6,
                              tokens_per_request=bench_compressor.S)
        assert int((pool.abs().sum(-1) > 0).sum()) == want
    *_, pos, slot = bench_compressor.make_inputs(64, 128, 4, True, g, device="cpu")[0]
    closes = ((pos + 1) % 4 == 0).view(64, -1).sum(1)
    assert bool((closes >= 1).all())


def test_compressor_bench_composite_is_the_runtime_step():
    """bench/bench_compressor.py's baseline (the torch-bf16 arm's gathered composite) writes the
    same entries and ring rows as the per-token fallback with the kernel's rounding points (both
    on the CPU: the same PyTorch ops in the same order, so bit for bit), CSA and HCA, a request
    whose windows begin before position 0 included -- a baseline that computed something else
    would make the bench's speedup meaningless."""
    from cute_kernels.compressor_pool import compressor_pool_torch

    g = torch.Generator().manual_seed(1)
    for B, d, ratio, overlap in ((1, 128, 4, True), (4, 128, 4, True), (4, 64, 128, False)):
        (fresh, ring, pool, ape, w, rot, pos, slot), closing, _ = bench_compressor.make_inputs(
            B, d, ratio, overlap, g, device="cpu")
        ring_f, pool_f, ring_c, pool_c = ring.clone(), pool.clone(), ring.clone(), pool.clone()
        compressor_pool_torch(fresh, ring_f, pool_f, ape, w, rot, pos, slot, ratio=ratio, overlap=overlap, eps=1e-6,
                              tokens_per_request=bench_compressor.S)
        bench_compressor.composite(fresh, ring_c, pool_c, ape, w, pos, slot, bench_compressor.INV_FREQ, B=B,
                                   ratio=ratio, overlap=overlap, eps=1e-6)
        assert closing >= 1 and torch.equal(ring_c, ring_f)
        assert torch.equal(pool_c[:, :-1], pool_f[:, :-1])  # the composite also writes the last, unread row
    # the windows before position 0: a step at positions 0..5 (CSA's first window lacks its previous one)
    (fresh, ring, pool, ape, w, rot, pos, slot), _, _ = bench_compressor.make_inputs(1, 128, 4, True, g, device="cpu")
    pos = torch.arange(bench_compressor.S, dtype=torch.int32)
    rot = torch.view_as_real(rope_start(pos, 4)).reshape(pos.shape[0], -1, 2).contiguous()
    ring_f, pool_f, ring_c, pool_c = ring.clone(), pool.clone(), ring.clone(), pool.clone()
    compressor_pool_torch(fresh, ring_f, pool_f, ape, w, rot, pos, slot, ratio=4, overlap=True, eps=1e-6,
                          tokens_per_request=bench_compressor.S)
    bench_compressor.composite(fresh, ring_c, pool_c, ape, w, pos, slot, bench_compressor.INV_FREQ, B=1, ratio=4,
                               overlap=True, eps=1e-6)
    assert torch.isfinite(pool_f[0, 0].float()).all() and pool_f[0, 0].abs().sum() > 0
    assert torch.equal(pool_c[:, :-1], pool_f[:, :-1]) and torch.equal(ring_c, ring_f)


def rope_start(pos, ratio):
    from spec_decode.model import rope_table

    return rope_table(torch.div(pos + 1, ratio, rounding_mode="floor") * ratio - ratio, bench_compressor.INV_FREQ)


def test_report_heading_command_parts_and_file(tmp_path, monkeypatch, capsys):
    """Every bench's markdown comes from common.report: the heading names the card and the date,
    the command stands in backticks, the parts follow a blank line apart; printed, and the file
    ends in exactly one newline."""
    import datetime

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "CARD")
    out = tmp_path / "t.md"
    text = common.report("Title", "python bench/x.py --n 1", "| a |", "", "tail\n", out=str(out))
    assert text == f"## Title -- CARD, {datetime.date.today()}\n\nCommand: `python bench/x.py --n 1`\n\n| a |\n\ntail\n"
    assert capsys.readouterr().out == text + "\n"
    assert out.read_text() == text
    common.emit("x\n\n", str(out))
    assert out.read_text() == "x\n"


def test_host_cost_pairs_each_chunk_with_the_yardstick(monkeypatch):
    """bench_host_cost.host_us with a yardstick: the op's and torch.add's chunks alternate
    (yardstick first), each behind its own sleep kernel, and the pair of medians comes back;
    without one, the op's median alone."""
    import bench_host_cost as hc

    calls, sleeps = [], []
    monkeypatch.setattr(hc.torch.cuda, "_sleep", lambda cycles: sleeps.append(cycles))
    monkeypatch.setattr(hc.torch.cuda, "synchronize", lambda: None)
    op, add = (lambda: calls.append("op")), (lambda: calls.append("add"))
    t_op, t_add = hc.host_us(op, calls=2 * hc.CHUNK, trials=1, yard=add)
    assert calls[:2] == ["op", "add"]  # one warm-up call each
    chunks = calls[2:]
    assert chunks == (["add"] * hc.CHUNK + ["op"] * hc.CHUNK) * 2 and len(sleeps) == 4
    assert t_op > 0 and t_add > 0
    calls.clear()
    assert isinstance(hc.host_us(op, calls=hc.CHUNK, trials=1), float) and calls == ["op"] * (1 + hc.CHUNK)


def test_flashinfer_top_k_runs_with_its_jit_off_unless_asked(monkeypatch):
    """The top-k family calls FlashInfer's ``top_k`` with ``FLASHINFER_DISABLE_JIT`` set (its
    module's build outlasts a device call) unless ``--peer-jit``, and leaves the environment
    as it found it, also when the call raises."""
    seen = []

    class FakeFlashInfer:
        @staticmethod
        def top_k(scores, k, **kw):
            seen.append(os.environ.get("FLASHINFER_DISABLE_JIT"))
            if k < 0:
                raise RuntimeError("missing module")
            return kw

    monkeypatch.delenv("FLASHINFER_DISABLE_JIT", raising=False)
    monkeypatch.setattr(bench_peers, "TOPK_PEER_JIT", False)
    assert bench_peers.flashinfer_top_k(FakeFlashInfer, None, 4) == dict(sorted=False, tie_break=1,
                                                                           dsa_graph_safe=True)
    with pytest.raises(RuntimeError):
        bench_peers.flashinfer_top_k(FakeFlashInfer, None, -1)
    assert "FLASHINFER_DISABLE_JIT" not in os.environ
    monkeypatch.setattr(bench_peers, "TOPK_PEER_JIT", True)
    bench_peers.flashinfer_top_k(FakeFlashInfer, None, 4)
    assert seen == ["1", "1", None]


def test_kept_outputs_holds_every_result():
    """bench_peers.kept_outputs: the wrapped call's results all stay referenced (in a captured
    graph each call then keeps its own output memory, as ours writes rotated buffers)."""
    import gc
    import weakref

    made = []

    def call(i):
        t = torch.full((4,), float(i))
        made.append(weakref.ref(t))
        return t

    launch = bench_peers.kept_outputs(call)
    for i in range(5):
        assert float(launch(i)[0]) == i
    gc.collect()
    assert all(r() is not None for r in made)
