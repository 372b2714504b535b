"""Indexer scores + fused candidate masking + top-k: against an FP64 reference on the H200,
validation and machine code on the CPU."""

import pytest
import torch

from cute_kernels.indexer_topk import IndexerWorkspace, indexer_select, indexer_topk
from cute_kernels.testing import sass
from references import indexer_scores_ref, v4_indexer_scores_ref

# Score tolerance: bf16 inputs are exact in the FP32 MMA; the sum over D = 128 products and
# 64 heads in FP32 is good to ~1e-6 relative to the score's scale (|w| ~ 1, |q.k| ~ 10).
# A selected key may trail the reference k-th score by this much (near-ties).
ATOL = 1e-3


def make(T, S, n_seq=1, H=64, D=128, device="cuda"):
    """n_seq sequences of S cached keys in one offset-indexed cache; T tokens spread over them."""
    k_cache = (torch.randn(n_seq * S + 7, D, device=device)).bfloat16()
    q = (torch.randn(T, H, D, device=device) / 4).bfloat16()
    w = torch.randn(T, H, device=device)
    seq = torch.arange(T, device=device) % n_seq
    kv_offset = (seq * S).int()
    kv_len = torch.full((T,), S, dtype=torch.int32, device=device)
    # a verify block: the last 6 tokens of each sequence sit at positions S-6 .. S-1
    pos = (S - 6 + (torch.arange(T, device=device) // n_seq) % 6).int().clamp_min(0)
    return q, w, k_cache, kv_offset, kv_len, pos


def check(idx, ref_scores, topk, atol=ATOL):
    idx, ref = idx.cpu(), ref_scores
    T = idx.shape[0]
    for t in range(T):
        cand = torch.isfinite(ref[t])
        n_valid = int(cand.sum())
        want = min(topk, n_valid)
        sel = idx[t, :want]
        assert (idx[t, want:] == -1).all(), f"token {t}: padding after {want}"
        assert (sel >= 0).all() and (sel[1:] > sel[:-1]).all(), f"token {t}: not ascending / unique"
        assert cand[sel.long()].all(), f"token {t}: a masked key was selected"
        if n_valid > topk:
            kth = ref[t][cand].topk(topk).values[-1]
            assert (ref[t][sel.long()] >= kth - atol).all(), f"token {t}: selected score below the k-th"


@pytest.mark.gpu
@pytest.mark.parametrize("T, S, n_seq, topk", [
    (6, 4096, 1, 2048),      # one verify block
    (1, 2048, 1, 2048),      # T = 1, fewer candidates than k: all taken, -1 padded
    (12, 5000, 2, 2048),     # two sequences, S not a multiple of the key tile
    (6, 33000, 1, 2048),
    (7, 300, 3, 64),         # small k
])
def test_matches_reference(seed, T, S, n_seq, topk):
    q, w, kc, off, ln, pos = make(T, S, n_seq)
    out = torch.full((T, topk), -7, dtype=torch.int32, device="cuda")  # poison
    indexer_topk(q, w, kc, off, ln, pos, topk=topk, max_keys=S, out=out)
    torch.cuda.synchronize()
    check(out, indexer_scores_ref(q.cpu(), w.cpu(), kc.cpu(), off.cpu(), ln.cpu(), pos.cpu(), S), topk)


@pytest.mark.gpu
def test_masking_causal_lengths_and_slots(seed):
    """Verify-block causality, a short sequence, invalid slots, an out-of-range offset."""
    T, S, topk = 8, 3000, 256
    q, w, kc, off, ln, pos = make(T, S)
    pos[:6] = torch.arange(100, 106, dtype=torch.int32)  # token j sees one key more than token j-1
    ln[6] = 50  # a short sequence: 50 < topk candidates
    off[7] = kc.shape[0] - 10  # only 10 rows left in the cache: the rest masked, never read
    slot_valid = torch.rand(kc.shape[0], device="cuda") > 0.3
    out = indexer_topk(q, w, kc, off, ln, pos, topk=topk, max_keys=S, slot_valid=slot_valid)
    torch.cuda.synchronize()
    ref = indexer_scores_ref(q.cpu(), w.cpu(), kc.cpu(), off.cpu(), ln.cpu(), pos.cpu(), S, slot_valid.cpu())
    check(out, ref, topk)
    assert int((out[6] >= 0).sum()) == int(slot_valid[off[6]:off[6] + 50].sum())
    assert int((out[7] >= 0).sum()) <= 10
    o = out.cpu()
    for j in range(6):
        assert o[j][o[j] >= 0].max() <= 100 + j  # causal within the verify block


@pytest.mark.gpu
def test_ties_prefer_lower_index_and_graph_replay(seed):
    """All-equal scores: the k lowest positions win; a replayed graph reproduces the result."""
    T, S, topk = 3, 5000, 2048
    q, w, kc, off, ln, pos = make(T, S)
    kc.fill_(1.0)  # every key scores the same
    ws = IndexerWorkspace(T, S)
    out = torch.empty(T, topk, dtype=torch.int32, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        indexer_topk(q, w, kc, off, ln, pos, topk=topk, max_keys=S, out=out, workspace=ws)
    torch.cuda.synchronize()
    expect = torch.arange(topk, dtype=torch.int32).expand(T, -1)
    assert torch.equal(out.cpu(), expect)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        indexer_topk(q, w, kc, off, ln, pos, topk=topk, max_keys=S, out=out, workspace=ws)
    q2, w2, kc2, *_ = make(T, S)
    q.copy_(q2), w.copy_(w2), kc.copy_(kc2)
    out.fill_(-7)
    g.replay()
    torch.cuda.synchronize()
    check(out, indexer_scores_ref(q.cpu(), w.cpu(), kc.cpu(), off.cpu(), ln.cpu(), pos.cpu(), S), topk)


def select_ref_check(out, scores, limits, topk):
    """The select on given rows: exactly the reference's set when the k-th score is unique
    among the row, else every strict winner plus the lowest-index ties."""
    for t in range(out.shape[0]):
        row = scores[t, : limits[t]].double()
        n = min(topk, row.numel())
        sel = out[t, :n].long()
        assert (out[t, n:] == -1).all() and (sel >= 0).all() and (sel[1:] > sel[:-1]).all(), f"row {t}"
        kth = row.topk(n).values[-1]
        gt = torch.nonzero(row > kth).flatten()
        eq = torch.nonzero(row == kth).flatten()[: n - gt.numel()]
        assert torch.equal(sel, torch.cat([gt, eq]).sort().values), f"row {t}: selection differs"


@pytest.mark.gpu
@pytest.mark.parametrize("T, S, topk", [(7, 300, 64), (5, 4096, 2048), (3, 33000, 2048), (2, 70000, 2048)])
@pytest.mark.parametrize("kind", ["randn", "positive", "negative", "rounded", "ties"])
def test_select_on_given_rows(seed, T, S, topk, kind):
    """The radix select alone: sign classes (positive scores' keys have the top bit set --
    a signed shift once lost them), many ties at the k-th score, all-equal rows, rows cut
    short by kv_len (fewer than k), and chunk boundaries (8192 scores per pass)."""
    x = torch.randn(T, S, device="cuda")
    x = {"randn": x, "positive": x.abs() + 1e-3, "negative": -x.abs() - 1e-3, "rounded": x.round(),
         "ties": torch.full_like(x, 1.5)}[kind]
    ws = IndexerWorkspace(T, S)
    ws.scores.fill_(float("nan"))  # poison past each row's limit: never read
    ws.scores[:, :S].copy_(x)
    ln = torch.full((T,), S, dtype=torch.int32, device="cuda")
    ln[-1] = max(1, topk // 2)  # a row with fewer candidates than k
    pos = torch.full((T,), S + 5, dtype=torch.int32, device="cuda")
    out = torch.full((T, topk), -7, dtype=torch.int32, device="cuda")
    indexer_select(ws, ln, pos, topk=topk, max_keys=S, out=out)
    torch.cuda.synchronize()
    select_ref_check(out.cpu(), x.cpu(), ln.tolist(), topk)


@pytest.mark.gpu
@pytest.mark.parametrize("plan", [None, (1, 4), (1, 16), (1, 32), (2, 4), (2, 16), (4, 8), (8, 4), (8, 16),
                                  (2, 4, True), (8, 16, True), (2, 32, True)])
@pytest.mark.parametrize("kind", ["randn", "rounded", "ties"])
def test_select_plans(seed, plan, kind):
    """The split select at every cluster size (and the streaming kernel) on the same rows, V4's
    top-512 over compressed entries: rows that end inside any CTA's slice (the later CTAs hold no
    key), ties across CTAs (the lowest indices win), a row with fewer candidates than k, a row
    of one; a graph replayed on fresh rows. ``(C, items, True)``: the counts exchanged by
    ``red.async`` and mbarriers."""
    from cute_kernels.indexer_topk_split import THREADS
    C, items = (plan or (4, 8))[:2]
    S, topk, T = min(C * THREADS * items, 12000 if items < 32 else 24000), 512, 6
    gen = torch.Generator().manual_seed(seed)
    ln = torch.tensor([S, S - 3, int(torch.randint(topk + 1, S, (1,), generator=gen)), (S * 3) // (2 * C) + 1,
                       topk // 2, 1], dtype=torch.int32, device="cuda")
    pos = 4 * ln + 3  # compress_ratio 4: every entry of the row visible
    ws = IndexerWorkspace(T, S)
    out = torch.full((T, topk), -7, dtype=torch.int32, device="cuda")

    def rows():
        x = torch.randn(T, S, device="cuda")
        return {"randn": x, "rounded": (x * 4).round(), "ties": torch.full_like(x, -2.5)}[kind]

    x = rows()
    ws.scores.fill_(float("nan"))  # poison past each row's limit: never read
    ws.scores[:, :S].copy_(x)
    indexer_select(ws, ln, pos, topk=topk, max_keys=S, compress_ratio=4, out=out, plan=plan)
    torch.cuda.synchronize()
    select_ref_check(out.cpu(), x.cpu(), ln.tolist(), topk)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        indexer_select(ws, ln, pos, topk=topk, max_keys=S, compress_ratio=4, out=out, plan=plan)
    for _ in range(2):
        x = rows()
        ws.scores[:, :S].copy_(x)
        out.fill_(-7)
        g.replay()
        torch.cuda.synchronize()
        select_ref_check(out.cpu(), x.cpu(), ln.tolist(), topk)


def split_select_model(row: torch.Tensor, limit: int, topk: int, cluster: int, items: int) -> torch.Tensor:
    """The split select's steps on the CPU, in the kernel's own layout (``IndexerTopkSplit``):
    CTA ``r`` of the cluster holds keys ``[r * S, (r + 1) * S)`` (``S = 512 * items``), thread
    ``i`` of it ``items`` consecutive ones; the digit rounds on the cluster's summed counts (the
    k-th key and how many of its ties to take); each CTA's selected keys written after those of
    the lower ranks and of its lower threads; the padding shared by rank."""
    from cute_kernels.indexer_topk_split import THREADS
    S = THREADS * items
    bits = row.float().view(torch.int32).long() & 0xFFFFFFFF
    bits = torch.where(bits == 0x80000000, 0, bits)  # -0.0 ranks as +0.0
    keys = torch.where(bits >> 31 == 1, ~bits & 0xFFFFFFFF, bits | 0x80000000)
    keys = torch.cat([keys, torch.zeros(cluster * S - keys.numel(), dtype=torch.long)])
    keys[limit:] = 0  # past the row: below every key
    thr, take_eq = 0x007FFFFF, 0
    if int((keys > 0x007FFFFF).sum()) > topk:  # the rounds: 11 + 11 + 10 bits, counts over the cluster
        prefix, k_rem = 0, topk
        for shift, width in ((21, 11), (10, 11), (0, 10)):
            match = (keys >> (shift + width)) == prefix if shift + width < 32 else torch.ones_like(keys, dtype=bool)
            counts = torch.bincount((keys[match] >> shift) & ((1 << width) - 1), minlength=1 << width)
            above = counts.flip(0).cumsum(0).flip(0)  # keys at this digit or above
            d = int(torch.nonzero(above >= k_rem).max())
            k_rem -= int(above[d]) - int(counts[d])
            prefix = (prefix << width) | d
        thr, take_eq = prefix, k_rem
    out = torch.full((topk,), -7, dtype=torch.int32)
    gt, eq = (keys > thr).view(cluster, THREADS, items), (keys == thr).view(cluster, THREADS, items)
    cta_gt, cta_eq = gt.sum((1, 2)), eq.sum((1, 2))
    for r in range(cluster):
        gt_before = int(cta_gt[:r].sum()) + torch.cat([torch.zeros(1, dtype=torch.long), gt[r].sum(1).cumsum(0)])
        eq_before = int(cta_eq[:r].sum()) + torch.cat([torch.zeros(1, dtype=torch.long), eq[r].sum(1).cumsum(0)])
        for i in range(THREADS):
            g, e = int(gt_before[i]), int(eq_before[i])
            for j in range(items):
                if gt[r, i, j] or (eq[r, i, j] and e < take_eq):
                    out[g + min(e, take_eq)] = r * S + i * items + j
                g, e = g + int(gt[r, i, j]), e + int(eq[r, i, j])
    n_sel = int(cta_gt.sum()) + min(int(cta_eq.sum()), take_eq)
    for r in range(cluster):  # rank r's threads: slots n_sel + r * 512 + i, then every cluster * 512
        for i in range(THREADS):
            out[n_sel + r * THREADS + i:: cluster * THREADS] = -1
    return out


@pytest.mark.parametrize("cluster, items", [(1, 4), (2, 4), (4, 8), (8, 4), (2, 32)])
@pytest.mark.parametrize("kind", ["randn", "rounded", "ties", "short"])
def test_split_select_model(cluster, items, kind):
    """The split select's layout and offsets (:func:`split_select_model`) give the definition's
    selection -- every strict winner and the lowest-index ties, ascending, ``-1`` after -- for
    rows whose ties straddle the CTAs' slices and rows that end inside a slice."""
    gen = torch.Generator().manual_seed(cluster * 131 + items)
    S, topk = cluster * 512 * items, 512
    x = torch.randn(S, generator=gen)
    x = {"randn": x, "rounded": (x * 2).round(), "ties": torch.full_like(x, 0.75), "short": x}[kind]
    for limit in (S, S - 5, (S * 2) // 3 + 1, topk + 1, topk // 3):
        if kind == "short" and limit == S:
            continue
        out = split_select_model(x, limit, topk, cluster, items)
        select_ref_check(out[None], x[None], [limit], topk)


@pytest.mark.parametrize("wide", [False, True])
def test_split_plan_and_its_validation(monkeypatch, request, wide):
    """split_plan: the row always fits the plan; rows up to 8192 keys take one CTA; longer
    rows spread over more CTAs at small T (counts by red.async), over half as many holding 32
    keys a thread where 16 would pass the grid limit (with ``WIDE_PLANS_BY_DEFAULT``), the
    streaming kernel at large T and past 8 CTAs' registers; a plan that cannot hold the row is
    refused by name before any launch."""
    from cute_kernels import indexer_topk_split
    from cute_kernels.indexer_topk_split import MAX_SPLIT_CTAS, THREADS, split_plan
    monkeypatch.setattr(indexer_topk_split, "WIDE_PLANS_BY_DEFAULT", wide)
    split_plan.cache_clear()
    request.addfinalizer(split_plan.cache_clear)  # (after monkeypatch restores the flag)
    widest = 32 if wide else 16
    for T in (1, 5, 6, 12, 20, 64, 100, 384):
        for N in (1, 300, 4096, 8192, 16384, 32768, 65536, 131072, 131073):
            plan = split_plan(T, N)
            if plan is None:
                assert N > 8 * THREADS * widest or N > 8192 and T * -(-N // (THREADS * widest)) > MAX_SPLIT_CTAS
                continue
            c, i, a = plan
            assert c * THREADS * i >= N and a == (c > 1) and T * c <= max(T, MAX_SPLIT_CTAS)
            assert i < 32 or wide and (T * -(-N // (THREADS * 16)) > MAX_SPLIT_CTAS or N > 8 * THREADS * 16)
    assert split_plan(384, 4096) == (1, 8, False)
    assert split_plan(5, 32768) == (8, 8, True) and split_plan(20, 32768) == (4, 16, True)
    assert split_plan(64, 32768) == ((2, 32, True) if wide else None)
    assert split_plan(5, 131072) == ((8, 32, True) if wide else None)
    assert split_plan(64, 65536) is None and split_plan(320, 16384) is None and split_plan(1, 131073) is None
    ws = IndexerWorkspace(2, 8192, device="cpu")
    ln = torch.full((2,), 8192, dtype=torch.int32)
    for bad in ((1, 8), (3, 16), (2, 5), (2, 8, 1), (1, 64), "fast"):
        with pytest.raises(ValueError, match="plan"):
            indexer_select(ws, ln, ln, topk=512, plan=bad)


def make_fp8(T, S, n_seq=1, H=64, D=128):
    """FP8 operands in DeepSeek's form: e4m3 q and keys, a positive scale per key row, the
    query heads' scales folded into w. Returns the FP8 tensors and the dequantised keys."""
    q, w, kc, off, ln, pos = make(T, S, n_seq, H, D)
    ks = (kc.float().abs().amax(-1) / 448).clamp_min(1e-4)  # per-row e4m3 scale
    k8 = (kc.float() / ks[:, None]).to(torch.float8_e4m3fn)
    qs = (q.float().abs().amax(-1) / 448).clamp_min(1e-4)  # per (token, head)
    q8 = (q.float() / qs[..., None]).to(torch.float8_e4m3fn)
    w8 = (w * qs).contiguous()
    return q8, w8, k8, ks.contiguous(), off, ln, pos


@pytest.mark.gpu
@pytest.mark.parametrize("T, S, n_seq, topk", [(6, 4096, 1, 2048), (12, 5000, 2, 2048), (7, 300, 3, 64)])
def test_fp8_matches_reference(seed, T, S, n_seq, topk):
    """FP8 scores: the dequantised FP64 reference (k_scale commutes with the ReLU), mask exact."""
    q8, w8, k8, ks, off, ln, pos = make_fp8(T, S, n_seq)
    ws = IndexerWorkspace(T, S)
    out = torch.full((T, topk), -7, dtype=torch.int32, device="cuda")
    indexer_topk(q8, w8, k8, off, ln, pos, topk=topk, max_keys=S, out=out, workspace=ws, k_scale=ks)
    torch.cuda.synchronize()
    k_deq = (k8.float() * ks[:, None]).cpu()
    ref = indexer_scores_ref(q8.float().cpu(), w8.cpu(), k_deq, off.cpu(), ln.cpu(), pos.cpu(), S)
    got = ws.scores[:, :S].cpu().double()
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(got))  # the mask, exactly
    assert (got[fin] - ref[fin]).abs().max() <= 1e-4 * ref[fin].abs().max()
    check(out, ref, topk)


def _cpu(**over):
    kw = dict(q=torch.zeros(2, 64, 128).bfloat16(), w=torch.zeros(2, 64), k_cache=torch.zeros(100, 128).bfloat16(),
              kv_offset=torch.zeros(2, dtype=torch.int32), kv_len=torch.zeros(2, dtype=torch.int32),
              pos=torch.zeros(2, dtype=torch.int32))
    kw.update(over)
    return kw


@pytest.mark.parametrize("over, exc, words", [
    (dict(q=torch.zeros(2, 64, 128)), TypeError, "q must have dtype bfloat16"),
    (dict(q=torch.zeros(2, 48, 128).bfloat16(), w=torch.zeros(2, 48)), ValueError, "H=48"),
    (dict(w=torch.zeros(2, 64).bfloat16()), TypeError, "w must have dtype float32"),
    (dict(k_cache=torch.zeros(100, 64).bfloat16()), ValueError, "k_cache must have shape"),
    (dict(pos=torch.zeros(2, dtype=torch.int64)), TypeError, "pos must have dtype int32"),
    (dict(kv_len=torch.zeros(3, dtype=torch.int32)), ValueError, "kv_len must have shape"),
    (dict(slot_valid=torch.zeros(99, dtype=torch.bool)), ValueError, "slot_valid must have shape"),
    (dict(topk=0), ValueError, "topk"),
    (dict(max_keys=0), ValueError, "max_keys"),
    (dict(), ValueError, "CUDA"),
    (dict(q=torch.zeros(2, 64, 128).to(torch.float8_e4m3fn)), TypeError, "k_cache must have dtype float8"),
    (dict(q=torch.zeros(2, 64, 128).to(torch.float8_e4m3fn), k_cache=torch.zeros(100, 128).to(torch.float8_e4m3fn)),
     ValueError, "need k_scale"),
    (dict(q=torch.zeros(2, 64, 128).to(torch.float8_e4m3fn), k_cache=torch.zeros(100, 128).to(torch.float8_e4m3fn),
          k_scale=torch.ones(99)), ValueError, "k_scale must have shape"),
    (dict(k_scale=torch.ones(100)), ValueError, "only for FP8"),
    (dict(use_wgmma=1), TypeError, "use_wgmma must be"),
    (dict(token_group=5), ValueError, "token_group must be"),
    (dict(token_group=2, use_wgmma=False), ValueError, "token_group > 1 needs"),
    (dict(q=torch.zeros(2, 32, 128).bfloat16(), w=torch.zeros(2, 32), token_group=2), ValueError, "token_group"),
    (dict(q=torch.zeros(2, 32, 128).bfloat16(), w=torch.zeros(2, 32), use_wgmma=True), ValueError, "H = 64"),
])
def test_validation(over, exc, words):
    with pytest.raises(exc, match=words):
        indexer_topk(**_cpu(**over))


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_machine_code(arch):
    h = sass.sass_histogram("indexer_scores", arch, heads=64, dim=128, has_slot_mask=True)
    assert sass.local_memory_ops(h) == 0
    assert sass.count(h, "HMMA") >= 128  # 64 x 128 x 128 per CTA in m16n8k16 steps over 4 warps
    assert sass.count(h, "LDSM") >= 1 and sass.count(h, "LDGSTS") >= 1
    h = sass.sass_histogram("indexer_topk", arch, topk=2048)
    assert sass.local_memory_ops(h) == 0
    assert sass.count(h, "ATOMS") >= 1  # shared-memory histograms
    assert sass.count(h, "LDG.E.128") >= 1  # vectorised compaction reads


def test_select_histogram_padding():
    """The radix select's histogram places (``radix_select.padded``): one slot per bin inside the
    padded buffer, each lane's share contiguous and 16-byte aligned, and the eight lanes of every
    quarter-warp phase of ``find_digit``'s 16-byte loads in eight different groups of four banks."""
    from cute_kernels.radix_select import BINS_PADDED, padded

    for bits in (10, 11):
        nb, per = 1 << bits, (1 << bits) // 32
        places = [padded(d, bits) for d in range(nb)]
        assert len(set(places)) == nb and max(places) < BINS_PADDED
        for lane in range(32):
            low = nb - (lane + 1) * per
            share = [padded(low + i, bits) for i in range(per)]
            assert share == list(range(share[0], share[0] + per)) and share[0] % 4 == 0
        for v in range(per // 4):
            for phase in range(4):
                groups = {(padded(nb - (lane + 1) * per, bits) // 4 + v) % 8
                          for lane in range(8 * phase, 8 * phase + 8)}
                assert len(groups) == 8


def emulate_scores_sm100(q, w, k_cache, kv_offset, kv_len, pos, s_max, slot_valid=None):
    """CPU emulation of the tcgen05 kernel's tiling: per (128-key tile, token), the
    transposed product C'[key, head] (keys at the token's own row offset, rows past the
    cache zero-filled as TMA does) in FP32, then per key -- one thread's registers -- the
    weighted ReLU sum over the 64 heads in order, then the mask."""
    T, H, D = q.shape
    R = k_cache.shape[0]
    out = torch.empty(T, s_max, dtype=torch.float32)
    for t in range(T):
        off = int(kv_offset[t])
        limit = 0 if off < 0 else min(int(pos[t]) + 1, int(kv_len[t]), R - off)
        for s0 in range(0, s_max, 128):
            n = min(128, s_max - s0)
            if s0 >= limit:
                out[t, s0:s0 + n] = float("-inf")
                continue
            tile = torch.zeros(128, D)
            lo, hi = off + s0, min(off + s0 + 128, R)
            tile[:hi - lo] = k_cache[lo:hi].float()
            c = tile @ q[t].float().T  # [keys, heads] in tensor memory
            acc = torch.zeros(128)
            for h in range(H):  # the per-thread head loop
                acc = acc + w[t, h] * torch.relu(c[:, h])
            sc = acc[:n]
            ok = torch.arange(s0, s0 + n) < limit
            if slot_valid is not None:
                rows = (off + torch.arange(s0, s0 + n)).clamp(max=R - 1)
                ok &= slot_valid[rows].bool()
            out[t, s0:s0 + n] = torch.where(ok & ~torch.isnan(sc), sc, torch.full_like(sc, float("-inf")))
    return out


def test_sm100_tiling_emulation_matches_fp64():
    """The Blackwell kernel's data layout on the CPU: offsets not multiples of the tile, a
    row range past the cache end, invalid slots, causal limits, S not a multiple of 128."""
    g = torch.Generator().manual_seed(0)
    T, H, D, S = 5, 64, 128, 300
    k_cache = torch.randn(2 * S + 3, D, generator=g).bfloat16()
    q = (torch.randn(T, H, D, generator=g) / 4).bfloat16()
    w = torch.randn(T, H, generator=g)
    off = torch.tensor([0, 37, S + 3, 2 * S + 3 - 50, -1], dtype=torch.int32)
    ln = torch.tensor([S, S, 130, S, S], dtype=torch.int32)
    pos = torch.tensor([S - 1, 200, S - 6, S - 1, 10], dtype=torch.int32)
    valid = torch.rand(k_cache.shape[0], generator=g) > 0.2
    emu = emulate_scores_sm100(q, w, k_cache, off, ln, pos, S, valid)
    ref = indexer_scores_ref(q, w, k_cache, off, ln, pos, S, valid)
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(emu), fin)  # the mask, exactly
    assert (emu.double()[fin] - ref[fin]).abs().max() < 1e-4 * ref[fin].abs().max()


def test_sm100_kernel_layouts_read_the_token_rows():
    """The Blackwell score kernel's own layout objects, evaluated on the CPU (traced for
    sm_100a, never launched): the CTA of key tile s0 and token t reads cache rows ``off + s0 ..
    off + s0 + 127`` and the 64 query rows of token t, all of D once each, through views that
    put them at ``k_cache[row, d]`` and ``q[t, h, d]`` (the definitions); and epilogue thread i
    loads key s0 + i's value for every head exactly once -- the kernel's one-key-per-thread
    head loop and its ``key = tDcC[0][0]``."""
    import cutlass
    import cutlass.cute as cute
    import numpy as np
    from cutlass import Float32

    from cute_kernels import jit
    from cute_kernels.indexer_scores import mma_operand_tensors
    from cute_kernels.indexer_scores_sm100 import IndexerScoresSm100
    from cute_kernels.testing.layouts import coords, flatten, offsets

    H, D, T, R = 64, 128, 3, 700
    kern, got = IndexerScoresSm100(H, D, has_slot_mask=False), {}
    cases = [(0, 0), (37 + 128, 1), (R - 50, 2)]  # (the token's row offset + s0, token)

    def walk(mK, mQ):
        got["views"] = [(flatten(x.layout.shape), flatten(x.layout.stride)) for x in (mK, mQ)]
        thr = kern.make_tiled_mma().get_slice(0)
        mKc, mQc = cute.make_identity_tensor(mK.shape), cute.make_identity_tensor(mQ.shape)
        for first_row, t in cases:
            tCgA, tCgB = kern.partition_gmem(thr, mKc, mQc, first_row, t)
            got[(first_row, t)] = coords(tCgA), coords(tCgB)
        tiled_mma = kern.make_tiled_mma()
        acc = cute.make_tensor(cute.make_ptr(Float32, 0, cute.AddressSpace.tmem),
                               tiled_mma.make_fragment_C(tiled_mma.partition_shape_C(kern.mma_tiler[:2])).layout)
        for tidx in range(128):
            got[tidx] = coords(kern.accumulator_rows(acc, thr, tidx)[2])

    @cute.jit
    def trace(q_ptr: cute.Pointer, w_ptr: cute.Pointer, k_ptr: cute.Pointer):
        mK, mQ, _ = mma_operand_tensors(q_ptr, w_ptr, k_ptr, T, R, H, D)
        walk(mK, mQ)

    bf = jit.fake_gmem_ptr(cutlass.BFloat16)
    cute.compile(trace, bf, jit.fake_gmem_ptr(Float32, 4), bf, options="--gpu-arch=sm_100a")
    (sk, dk), (sq, dq) = got.pop("views")
    for first_row, t in cases:
        A, B = got[(first_row, t)]
        assert (A[:, 2] == 0).all() and (B[:, 2] == 0).all()
        assert np.array_equal(np.unique(A[:, 0]), first_row + np.arange(128))  # rows >= R: TMA zero-fills
        assert len(np.unique(A[:, 0] * D + A[:, 1])) == len(A) == 128 * D
        assert np.array_equal(np.unique(B[:, 0]), t * H + np.arange(H))
        assert len(np.unique(B[:, 0] * D + B[:, 1])) == len(B) == H * D
        live = A[A[:, 0] < R]
        k_def = torch.arange(R * D).view(R, D).numpy()
        assert np.array_equal(offsets(live, sk, dk), k_def[live[:, 0], live[:, 1]])
        q_def = torch.arange(T * H * D).view(T, H, D).numpy()
        assert np.array_equal(offsets(B, sq, dq), q_def[t, B[:, 0] - t * H, B[:, 1]])
    for tidx in range(128):
        kh = got[tidx]
        assert (kh[:, 0] == tidx).all() and kh[0, 0] == tidx
        assert sorted(kh[:, 1].tolist()) == list(range(H))


@pytest.mark.parametrize("mask", [False, True])
def test_machine_code_sm100(mask):
    h = sass.sass_histogram("indexer_scores_sm100", "sm_100a", heads=64, dim=128, has_slot_mask=mask)
    assert sass.count(h, "UTCHMMA") >= 8  # D = 128 in K = 16 steps, keys x heads in tensor memory
    assert sass.count(h, "UTMALDG") >= 2 and sass.count(h, "LDTM") >= 1
    assert sass.count(h, "FFMA") >= 64  # the per-thread head reduction
    assert sass.local_memory_ops(h) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("use_wgmma", [False, True])
@pytest.mark.parametrize("T, S, n_seq", [(6, 4096, 1), (12, 5000, 2)])
def test_both_hopper_score_kernels(seed, T, S, n_seq, use_wgmma):
    """H200: the warp-MMA and the wgmma score kernels (the default for H = 64) through the same checks."""
    q, w, kc, off, ln, pos = make(T, S, n_seq)
    out = indexer_topk(q, w, kc, off, ln, pos, topk=2048, max_keys=S, use_wgmma=use_wgmma)
    torch.cuda.synchronize()
    check(out, indexer_scores_ref(q.cpu(), w.cpu(), kc.cpu(), off.cpu(), ln.cpu(), pos.cpu(), S), 2048)


@pytest.mark.gpu
@pytest.mark.parametrize("T, S, n_seq, group, token_major", [
    (12, 5000, 2, 3, True),   # verify blocks of 6 tokens, consecutive: groups share their keys
    (12, 5000, 2, 2, False),  # interleaved sequences: every group mixes offsets (one pass per token)
    (7, 4096, 1, 4, True),    # T not a multiple of the group: the last group is part empty
    (8, 300, 2, 4, True),     # a group straddling two sequences; short sequences (< k candidates)
])
def test_token_group_kernel(seed, T, S, n_seq, group, token_major):
    """H200: one CTA per group of tokens; same checks as the one-token kernels."""
    q, w, kc, off, ln, pos = make(T, S, n_seq)
    if token_major:
        order = torch.sort(off, stable=True).indices
        q, w, off, ln, pos = q[order].contiguous(), w[order].contiguous(), off[order].contiguous(), \
            ln[order].contiguous(), pos[order].contiguous()
    out = indexer_topk(q, w, kc, off, ln, pos, topk=2048, max_keys=S, token_group=group)
    torch.cuda.synchronize()
    check(out, indexer_scores_ref(q.cpu(), w.cpu(), kc.cpu(), off.cpu(), ln.cpu(), pos.cpu(), S), 2048)


@pytest.mark.parametrize("group", [2, 3, 4])
def test_machine_code_sm90_token_group(group):
    h = sass.sass_histogram("indexer_scores_token_group_sm90", "sm_90a", heads=64, dim=128, has_slot_mask=True,
                            group=group)
    assert sass.count(h, f"HGMMA.64x{64 * group}x16.F32.BF16") >= 8 and sass.count(h, "UTMALDG") >= 2
    assert sass.count(h, "SHFL.BFLY") >= 4 * group  # the quad's head-sum, per token
    assert sass.local_memory_ops(h) == 0


@pytest.mark.parametrize("mask", [False, True])
def test_machine_code_sm90_wgmma(mask):
    h = sass.sass_histogram("indexer_scores_sm90", "sm_90a", heads=64, dim=128, has_slot_mask=mask)
    assert sass.count(h, "HGMMA") >= 8 and sass.count(h, "UTMALDG") >= 2
    assert sass.count(h, "SHFL.BFLY") >= 4  # the quad's head-sum
    assert sass.local_memory_ops(h) == 0


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_fp8_machine_code(arch):
    """FP8 scores: mma.sync e4m3 (ptxas lowers it to e4m3 -> f16 unpacks + HMMA.16816 on these
    archs), cp.async loads, no spills."""
    h = sass.sass_histogram("indexer_scores_fp8", arch, heads=64, dim=128, has_slot_mask=True)
    assert sass.local_memory_ops(h) == 0
    assert sass.count(h, "HMMA") >= 64 and sass.count(h, "LDSM") >= 1 and sass.count(h, "LDGSTS") >= 1


def _fp8_cpu(T, S, H, D):
    g = torch.Generator().manual_seed(5)
    kc = torch.randn(S + 3, D, generator=g)
    q = torch.randn(T, H, D, generator=g) / 4
    ks = kc.abs().amax(-1) / 448
    qs = q.abs().amax(-1) / 448
    k8 = (kc / ks[:, None]).to(torch.float8_e4m3fn).float()
    q8 = (q / qs[..., None]).to(torch.float8_e4m3fn).float()
    w8 = torch.randn(T, H, generator=g) * qs
    return q8, w8, k8, ks, None, None, None


# ------------------------------------------------- DeepSeek-V4: compressed entries -------
def make_v4(T, n_tokens, n_seq=1, H=64, D=128, ratio=4):
    """V4's CSA indexer inputs: n_seq sequences of n_tokens tokens, each with n_tokens // ratio
    compressed index keys in one pool; T query tokens per sequence group at the sequence's last
    positions (a verify block), so consecutive queries straddle window boundaries."""
    n_entries = n_tokens // ratio
    pool = torch.randn(n_seq * n_entries + 5, D, device="cuda").bfloat16()
    q = (torch.randn(T, H, D, device="cuda") / 4).bfloat16()
    w = torch.randn(T, H, device="cuda")                                  # weights_proj output
    seq = torch.arange(T, device="cuda") % n_seq
    offset = (seq * n_entries).int()
    entries = torch.full((T,), n_entries, dtype=torch.int32, device="cuda")
    pos = (n_tokens - 5 + (torch.arange(T, device="cuda") // n_seq) % 5).int()
    return q, w, pool, offset, entries, pos


@pytest.mark.gpu
@pytest.mark.parametrize("T, n_tokens, n_seq, topk", [
    (5, 4096, 1, 512),       # V4-Flash, one DSpark verify block of 5
    (5, 8190, 1, 1024),      # V4-Pro; the block's positions cross a window boundary
    (1, 1000, 1, 512),       # T = 1, fewer visible entries than k: all taken, -1 padded
    (7, 131072, 1, 512),     # a long context (32768 entries), T not a block multiple
    (10, 6001, 2, 1024),     # two sequences in one pool
])
@pytest.mark.parametrize("kernel", ["default", "warp_mma", "token_group"])
def test_v4_compressed_entries_match_reference(seed, T, n_tokens, n_seq, topk, kernel):
    """H200: the score kernels + select over compressed entries (compress_ratio = 4) against the
    FP64 V4 definition, V4's two scales folded into the head weights."""
    H, D = 64, 128
    q, w, pool, off, ent, pos = make_v4(T, n_tokens, n_seq, H, D)
    max_entries = n_tokens // 4
    out = torch.full((T, topk), -7, dtype=torch.int32, device="cuda")  # poison
    kw = {"default": {}, "warp_mma": {"use_wgmma": False}, "token_group": {"token_group": 3}}[kernel]
    if kernel == "token_group":  # the group kernel wants a sequence's tokens consecutive
        order = torch.sort(off, stable=True).indices
        q, w, off, ent, pos = (x[order].contiguous() for x in (q, w, off, ent, pos))
    w_folded = w * (H ** -0.5 * D ** -0.5)
    indexer_topk(q, w_folded, pool, off, ent, pos, topk=topk, max_keys=max_entries, compress_ratio=4, out=out, **kw)
    torch.cuda.synchronize()
    ref = v4_indexer_scores_ref(q.cpu(), w.cpu(), pool.cpu(), off.cpu(), ent.cpu(), pos.cpu(), 4, max_entries)
    # the folded FP32 weights and the FP32 sums: ~1e-6 of the score scale
    check(out, ref, topk, atol=1e-5 * float(ref[torch.isfinite(ref)].abs().max()))
    for t in range(T):  # the visibility rule exactly: the count of valid indices
        visible = min((int(pos[t]) + 1) // 4, int(ent[t]), max_entries)
        assert int((out[t] >= 0).sum()) == min(topk, visible), f"token {t}"


@pytest.mark.gpu
def test_v4_window_boundaries_and_padding_rows(seed):
    """Positions at, just before and just after a window's end, and a padding row (pos = -1):
    the number of selected entries is exactly (pos + 1) // 4 (or 0)."""
    H, D, ratio = 64, 128, 4
    pos = torch.tensor([-1, 0, 2, 3, 4, 7, 8, 11, 4095], dtype=torch.int32, device="cuda")
    T = pos.numel()
    pool = torch.randn(1024, D, device="cuda").bfloat16()
    q = (torch.randn(T, H, D, device="cuda") / 4).bfloat16()
    w = torch.rand(T, H, device="cuda") + 0.1  # positive: every visible entry scores >= 0
    off = torch.zeros(T, dtype=torch.int32, device="cuda")
    ent = torch.full((T,), 1024, dtype=torch.int32, device="cuda")
    out = indexer_topk(q, w, pool, off, ent, pos, topk=2048, max_keys=1024, compress_ratio=ratio)
    torch.cuda.synchronize()
    for t in range(T):
        want = max(int(pos[t]) + 1, 0) // ratio
        got = out[t].cpu()
        assert got[:want].tolist() == list(range(want)), f"pos {int(pos[t])}"
        assert (got[want:] == -1).all(), f"pos {int(pos[t])}"


@pytest.mark.parametrize("bad", [0, True, 2.0, 2000])
def test_v4_compress_ratio_validation(bad):
    with pytest.raises(ValueError, match="compress_ratio"):
        indexer_topk(**_cpu(compress_ratio=bad))


@pytest.mark.parametrize("name, arch, cfg", [
    ("indexer_scores_sm90", "sm_90a", {}),
    ("indexer_scores_token_group_sm90", "sm_90a", {"group": 3}),
    ("indexer_scores_sm100", "sm_100a", {}),
    ("indexer_scores", "sm_90a", {}),
])
def test_v4_machine_code(name, arch, cfg):
    """The compressed-entry configs compile to the same tensor-core path, with no local memory
    beyond the raw-key config's."""
    h = sass.sass_histogram(name, arch, heads=64, dim=128, has_slot_mask=False, compress_ratio=4, **cfg)
    h1 = sass.sass_histogram(name, arch, heads=64, dim=128, has_slot_mask=False, **cfg)
    assert sass.local_memory_ops(h) <= sass.local_memory_ops(h1)
    mma = {"sm_90a": "HGMMA", "sm_100a": "UTCHMMA"}[arch] if name != "indexer_scores" else "HMMA"
    assert sass.count(h, mma) >= 1
    for k in (512, 1024):
        h = sass.sass_histogram("indexer_topk", arch, topk=k, compress_ratio=4)
        assert sass.local_memory_ops(h) == 0 and sass.count(h, "ATOMS") >= 1


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("cluster, items, async_counts", [(1, 16, False), (8, 8, False), (8, 8, True), (2, 32, True)])
def test_split_select_machine_code(arch, cluster, items, async_counts):
    """The split select keeps its row in registers (no local memory; one set of 16-byte loads,
    no reload per round), counts in shared memory, and with a cluster adds the counts into the
    other CTAs' shared memory behind cluster barriers (none without one) -- or, with
    ``async_counts``, by ``red.async`` credited to mbarriers, with one cluster barrier (entry) and
    one GPU-scope fence instead of five."""
    h = sass.sass_histogram("indexer_topk_split", arch, topk=512, compress_ratio=4, cluster=cluster, items=items,
                            async_counts=async_counts)
    assert sass.local_memory_ops(h) == 0
    assert sass.count(h, "LDG.E.128") == items // 4
    assert sass.count(h, "ATOMS") >= 3 * items  # three rounds of per-key counts
    barriers, fences = sass.count(h, "UCGABAR_ARV"), sass.count(h, "MEMBAR.ALL.GPU")
    if async_counts:
        assert barriers == fences == 1 and sass.count(h, "REDAS.ADD") >= 3 * cluster
        assert sass.count(h, "SYNCS.ARRIVE.TRANS64.RED") >= 4 * cluster  # every sender's announcement
    else:
        assert barriers == fences == (5 if cluster > 1 else 0)  # entry, three rounds, the compaction's offsets
        assert (sass.count(h, "ATOM.E.ADD") >= 3 * cluster) == (cluster > 1)  # red.shared::cluster
