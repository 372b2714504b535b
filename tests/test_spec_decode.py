"""Decode runtime, reference backend on the CPU: speculative greedy == plain greedy."""

import random

import pytest
import torch

from spec_decode import Engine, EngineConfig
from spec_decode.model import sinkhorn


def prompts(seed, n, vocab=128):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, 12))] for _ in range(n)]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("draft", ["model", "oracle", "oracle_bad0", "oracle_bad2", "oracle_bad4"])
def test_speculative_equals_plain_greedy(seed, draft):
    eng = Engine(EngineConfig(seed=seed, max_seq_len=96))
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


def test_requests_finish_independently_and_batch_matches_single():
    eng = Engine(EngineConfig(seed=3, max_seq_len=96))
    ps = prompts(7, 4)
    batched = eng.generate(ps, 9)
    singles = [eng.generate([p], 9)[0] for p in ps]
    assert batched == singles


def test_impossible_requests_are_refused_up_front():
    eng = Engine(EngineConfig(max_seq_len=32, graph_batch_sizes=(1, 2, 4)))
    with pytest.raises(ValueError, match="largest captured batch size 4"):
        eng.generate(prompts(0, 5), 4)
    with pytest.raises(ValueError, match="KV pool too small"):
        eng.generate([[1] * 20], 10)
    with pytest.raises(ValueError, match="token ids"):
        eng.generate([[1, 999]], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.generate([[1]], 0)
    assert EngineConfig().padded_batch(3) == 4 and EngineConfig().padded_batch(33) == 64


def test_mhc_residual_mixing_is_doubly_stochastic():
    m = sinkhorn(torch.rand(5, 4, 4) + 0.1, 20)
    assert torch.allclose(m.sum(-1), torch.ones(5, 4), atol=1e-3)
    assert torch.allclose(m.sum(-2), torch.ones(5, 4), atol=1e-6)
    eng = Engine(EngineConfig(max_seq_len=16))
    X = torch.randn(2, 3, 4, 64)
    _, h_post, h_res = eng.model.mhc_mappings(X, eng.model.layers[0], "attn")
    assert torch.allclose(h_res.sum(-2), torch.ones(2, 3, 4), atol=1e-5)
    assert ((h_post > 0) & (h_post < 2)).all()
