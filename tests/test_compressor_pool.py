"""compressor_pool: DeepSeek-V4's compressor step against its definition (FP64 with the bf16
rounding points) on the H200; the PyTorch fallback, argument validation and machine code on the
CPU; the fallback against the runtime's composite (spec_decode) on the CPU."""

import pytest
import torch

from cute_kernels.compressor_pool import compressor_pool, compressor_pool_torch
from cute_kernels.testing import sass
from references import compressor_entry_ref

EPS = 1e-6


def make_state(d, m, overlap, S=6, B=3, slots=4, lookahead=6, max_len=512, g=None, device="cuda"):
    """A compressor's ring and pool (random history), one step's rows for B requests at random
    positions (some < the window span: rows before 0), slots permuted, rotations."""
    coff = 2 if overlap else 1
    span = 2 * m if overlap else m
    ch = coff * d
    ring = torch.randn(slots, span + lookahead, 2 * ch, generator=g).bfloat16()
    pool = torch.full((slots, max_len // m + 1, d), float("nan")).bfloat16()
    fresh = torch.randn(B * S, 2 * ch, generator=g).bfloat16()
    ape = (torch.randn(m, ch, generator=g) * 0.5).bfloat16()
    nw = (1 + 0.1 * torch.randn(d, generator=g)).bfloat16()
    starts = torch.randint(0, max_len - S - m, (B,), generator=g)
    starts[0] = 0  # the first windows: rows before position 0
    starts[1] = m - 3 if m > 3 else 1
    pos = (starts[:, None] + torch.arange(S)).reshape(-1).int()
    slot = torch.randperm(slots, generator=g)[:B].repeat_interleave(S).int()
    ang = pos.double()[:, None] / (160000.0 ** (torch.arange(0, 64, 2).double() / 64))
    cs = torch.stack([ang.cos(), ang.sin()], -1).float()
    ent = ((pos + 1) // m - 1).clamp_min(0) * m  # the entry's first position: its rotation
    ang_e = ent.double()[:, None] / (160000.0 ** (torch.arange(0, 64, 2).double() / 64))
    cs_e = torch.stack([ang_e.cos(), ang_e.sin()], -1).float()
    to = lambda x: x.to(device)  # noqa: E731
    return [to(x) for x in (fresh, ring, pool, ape, nw, cs_e, pos, slot)], S


def check_against_definition(before_ring, fresh, ring, pool, ape, nw, cs, pos, slot, m, overlap, S):
    """Every closing token's entry within 2 ulp of the FP64 definition plus a 1-ulp flip of each
    intermediate rounding (compressor_entry_ref's magnitude x 2^-7); every other pool row
    untouched (NaN); the ring rows of the step's positions equal its fresh rows, others unchanged."""
    span = 2 * m if overlap else m
    R = ring.shape[1]
    pool, ring, fresh = pool.cpu(), ring.cpu(), fresh.cpu()
    written = torch.zeros(pool.shape[:2], dtype=torch.bool)
    ring_want = before_ring.cpu().clone()
    for t in range(fresh.shape[0]):
        p, s = int(pos[t]), int(slot[t])
        first = t // S * S
        p0 = int(pos[first])
        ring_want[s, p % R] = fresh[t]
        if (p + 1) % m or (p + 1) // m - 1 >= pool.shape[1] - 1:
            continue
        e = (p + 1) // m - 1
        rows = [fresh[first + q - p0] if q >= p0 else before_ring.cpu()[s, q % R]
                for q in range(p - span + 1, p + 1) if q >= 0]
        y, mag = compressor_entry_ref(torch.stack(rows), ape, nw, EPS, overlap, cs[t].cpu())
        got = pool[s, e].double()
        bound = 2 * 2.0 ** -8 * y.abs() + 2.0 ** -7 * mag + 2.0 ** -120
        bad = ~((got - y).abs() <= bound)
        assert not bad.any(), f"token {t} p={p}: {int(bad.sum())} channels off, e.g. {got[bad][:3]} vs {y[bad][:3]}"
        written[s, e] = True
    assert torch.isnan(pool[~written].float()).all()
    assert torch.equal(ring, ring_want)
    return int(written.sum())


@pytest.mark.gpu
# V4's three compressors; one CTA (d = 64); a window not a multiple of the row groups (100 rows
# over 64 groups: a second row for some threads); four rows per thread (d = 1024); three CTAs of
# 24 channel vectors (d = 576)
@pytest.mark.parametrize("d,m,overlap", [(512, 4, True), (128, 4, True), (512, 128, False), (64, 16, False),
                                         (256, 100, False), (1024, 128, False), (576, 4, True)])
def test_matches_definition(seed, d, m, overlap):
    g = torch.Generator().manual_seed(seed)
    for trial in range(3):
        (fresh, ring, pool, ape, nw, cs, pos, slot), S = make_state(d, m, overlap, g=g)
        before = ring.clone()
        compressor_pool(fresh, ring, pool, ape, nw, cs, pos, slot, ratio=m, overlap=overlap, eps=EPS,
                        tokens_per_request=S)
        torch.cuda.synchronize()
        n = check_against_definition(before, fresh, ring, pool, ape, nw, cs, pos, slot, m, overlap, S)
        assert n >= 1 or m > 6


@pytest.mark.gpu
def test_equals_the_fallback_and_replays_in_a_graph(seed):
    """The kernel and the PyTorch fallback (the runtime composite's rounding points) agree bit
    for bit on at least 99% of the entries' elements (the rest one bf16 ulp: exp and summation
    order); a captured graph replays with fresh inputs, each replay checked."""
    g = torch.Generator().manual_seed(seed)
    (fresh, ring, pool, ape, nw, cs, pos, slot), S = make_state(512, 4, True, g=g)
    args = dict(ratio=4, overlap=True, eps=EPS, tokens_per_request=S)
    r2, p2 = ring.clone(), pool.clone()
    compressor_pool(fresh, ring, pool, ape, nw, cs, pos, slot, **args)
    compressor_pool_torch(fresh, r2, p2, ape, nw, cs, pos, slot, **args)
    torch.cuda.synchronize()
    assert torch.equal(ring, r2)
    live = ~torch.isnan(p2.float())
    assert torch.equal(live, ~torch.isnan(pool.float()))
    same = (pool[live] == p2[live]).float().mean().item()
    assert same >= 0.99, same
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        compressor_pool(fresh, ring, pool, ape, nw, cs, pos, slot, **args)
    for _ in range(3):
        (f2, rg2, pl2, _, _, cs2, pos2, slot2), _ = make_state(512, 4, True, g=g)
        for dst, src in ((fresh, f2), (ring, rg2), (pool, pl2), (cs, cs2), (pos, pos2), (slot, slot2)):
            dst.copy_(src)
        before = ring.clone()
        graph.replay()
        torch.cuda.synchronize()
        check_against_definition(before, fresh, ring, pool, ape, nw, cs, pos, slot, 4, True, S)


@pytest.mark.parametrize("d,m,overlap", [(128, 4, True), (64, 16, False)])
def test_fallback_matches_definition(seed, d, m, overlap):
    g = torch.Generator().manual_seed(seed)
    (fresh, ring, pool, ape, nw, cs, pos, slot), S = make_state(d, m, overlap, g=g, device="cpu")
    before = ring.clone()
    compressor_pool_torch(fresh, ring, pool, ape, nw, cs, pos, slot, ratio=m, overlap=overlap, eps=EPS,
                          tokens_per_request=S)
    check_against_definition(before, fresh, ring, pool, ape, nw, cs, pos, slot, m, overlap, S)


def _args():
    (fresh, ring, pool, ape, nw, cs, pos, slot), S = make_state(128, 4, True, device="cpu")
    return dict(fresh=fresh, ring=ring, pool=pool, ape=ape, norm_weight=nw, rotate=cs, pos=pos, slot=slot)


@pytest.mark.parametrize("name,bad,exc", [
    ("fresh", lambda a: a["fresh"].float(), TypeError),
    ("fresh", lambda a: a["fresh"][:, :100].contiguous(), ValueError),
    ("ring", lambda a: a["ring"][:, :3].contiguous(), ValueError),
    ("pool", lambda a: a["pool"][:, :, :64].contiguous(), ValueError),
    ("ape", lambda a: a["ape"][:2].contiguous(), ValueError),
    ("ape", lambda a: torch.cat([a["ape"].new_zeros(1), a["ape"].flatten()])[1:].view_as(a["ape"]), ValueError),
    ("norm_weight", lambda a: torch.cat([a["norm_weight"][:1], a["norm_weight"]])[1:], ValueError),
    ("pos", lambda a: a["pos"].long(), TypeError),
    ("slot", lambda a: a["slot"][:5].contiguous(), ValueError),
    ("rotate", lambda a: a["rotate"][:, :, :1].contiguous(), ValueError),
])
def test_bad_arguments_raise_before_launch(name, bad, exc):
    a = _args()
    a[name] = bad(a)
    with pytest.raises(exc, match=name):
        compressor_pool(**a, ratio=4, overlap=True, eps=EPS, tokens_per_request=6)


def test_step_wider_than_the_ring_allows_and_cpu_tensors_raise():
    a = _args()
    with pytest.raises(ValueError, match="tokens_per_request"):
        compressor_pool(**a, ratio=4, overlap=True, eps=EPS, tokens_per_request=18)
    with pytest.raises(ValueError, match="CUDA"):
        compressor_pool(**a, ratio=4, overlap=True, eps=EPS, tokens_per_request=6)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("d,m,overlap,vectors", [(512, 128, False, 12), (512, 4, True, 7)])
def test_machine_code(arch, d, m, overlap, vectors):
    """A closing token's loads -- the window rows' gate / kv / ape vectors (16-byte ``LDG.E.128``,
    both row sources per row), the norm weight, the rotation -- all stand before the first
    arithmetic on them (the window maximum's ``FMNMX``): one memory round trip; the entry's sum
    of squares goes to each of the cluster's 8 CTAs by ``st.async`` (no release barrier, no
    memory fence); nothing spills."""
    text = sass.disassemble(sass.compile_cubin("compressor_pool", arch, dim=d, ratio=m, overlap=overlap,
                                               rope_dim=64))
    h = sass.histogram(text)
    assert sass.local_memory_ops(h) == 0
    assert sass.count(h, "LDG.E.128") == vectors
    loads, all_before = sass.global_loads_before(text, "FMNMX")
    assert all_before, f"{loads} loads, not all before the first FMNMX"
    assert sass.count(h, "UCGABAR_ARV") == 1 and sass.count(h, "UCGABAR_WAIT") == 1
    assert sass.count(h, "MEMBAR") == 0 and h.get("STAS", 0) == 8 and sass.count(h, "SYNCS.ARRIVE") == 1
