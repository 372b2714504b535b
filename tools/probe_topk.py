"""Device probe: isolate the indexer top-k failure (scores kernel vs radix select).

    device run (carry .devcache): source tools/device-env.sh && python tools/probe_topk.py
"""
import sys
import torch
sys.path.insert(0, "tests")
from cutlass import Float32, Int32
from cute_kernels import jit
from cute_kernels.indexer_topk import IndexerWorkspace, indexer_topk
from references import indexer_scores_ref


def order_keys(x):
    b = x.contiguous().view(torch.int32).long() & 0xFFFFFFFF
    return torch.where(b >> 31 == 1, (~b) & 0xFFFFFFFF, b | 0x80000000)


def expect_state(row, limit, k):
    keys = order_keys(row[:limit].cpu())
    valid = int((keys > 0x007FFFFF).sum())
    if valid <= k:
        return dict(valid=valid, thr=0x007FFFFF, take_eq=0)
    thr = int(keys.sort(descending=True).values[k - 1])
    gt = int((keys > thr).sum())
    return dict(valid=valid, d0=thr >> 21, d1=(thr >> 10) & 0x7FF, d2=thr & 0x3FF, thr=thr, take_eq=k - gt,
                gt=gt, eq=int((keys == thr).sum()))


def run_topk(scores, lens, k, tag):
    T, S = scores.shape
    ws = IndexerWorkspace(T, S)
    ws.scores[:, :S].copy_(scores)
    pos = torch.full((T,), S + 100, dtype=torch.int32, device="cuda")
    ln = lens.int().cuda()
    fn = jit.get_kernel("indexer_topk", "sm_90a", topk=k, debug=True)
    out = torch.full((T, k + 16), -7, dtype=torch.int32, device="cuda")
    P = jit.gmem_ptr
    fn(P(Float32, ws.scores, 16), P(Int32, ln, 4), P(Int32, pos, 4), P(Int32, out, 4), jit.i32(T), jit.i32(ws.pitch),
       jit.i32(S), jit.cu_stream(None))
    torch.cuda.synchronize()
    out = out.cpu()
    bad = 0
    for t in range(T):
        lim = int(lens[t])
        e = expect_state(scores[t].cpu(), lim, k)
        dbg = out[t, k:k + 10].tolist()
        sel = out[t, :k]
        n = int((sel >= 0).sum())
        ok = n == min(k, e["valid"]) and (sel[:n][1:] > sel[:n][:-1]).all()
        if ok and e["valid"] > k:
            keys = order_keys(scores[t, :lim].cpu())
            ok = bool((keys[sel[:n].long()] >= e["thr"]).all())
        if not ok:
            bad += 1
            if bad <= 4:
                print(f"[{tag}] row {t} limit {lim}: n_sel {n} expect {e}")
                print(f"   dbg [d0 krem valid | d1 krem | d2 take | gt eq thr] = {dbg}  thr_hex={dbg[9] & 0xFFFFFFFF:#x}")
                keys = order_keys(scores[t, :lim].cpu())
                if e["valid"] > k:
                    want = set(torch.nonzero(keys > e["thr"]).flatten().tolist())
                    got = set(sel[:n].tolist())
                    miss = sorted(want - got)
                    print(f"   missing gt keys: {len(miss)} first {miss[:12]}; extra {sorted(got - want - set(torch.nonzero(keys == e['thr']).flatten().tolist()))[:12]}")
    print(f"[{tag}] T={T} S={S} k={k}: {bad} bad rows")


torch.manual_seed(0)
# 1. radix select alone on synthetic rows
for (T, S, k) in [(7, 300, 64), (8, 4096, 2048), (4, 33000, 2048), (4, 5000, 2048)]:
    sc = torch.randn(T, S, device="cuda")
    run_topk(sc, torch.full((T,), S), k, "randn")
    run_topk(sc.abs(), torch.full((T,), S), k, "abs")
    run_topk(-sc.abs(), torch.full((T,), S), k, "negabs")
    run_topk(torch.full((T, S), 1.5, device="cuda"), torch.full((T,), S), k, "ties+")
    run_topk(torch.full((T, S), -1.5, device="cuda"), torch.full((T,), S), k, "ties-")
    run_topk(sc.round(), torch.full((T,), S), k, "rounded")

# 2. score kernel vs FP64 reference
from test_indexer import make
for (T, S, n_seq) in [(6, 4096, 1), (7, 300, 3), (12, 5000, 2)]:
    q, w, kc, off, ln, pos = make(T, S, n_seq)
    ws = IndexerWorkspace(T, S)
    indexer_topk(q, w, kc, off, ln, pos, topk=64, max_keys=S, workspace=ws)
    torch.cuda.synchronize()
    ref = indexer_scores_ref(q.cpu(), w.cpu(), kc.cpu(), off.cpu(), ln.cpu(), pos.cpu(), S)
    got = ws.scores[:, :S].cpu().double()
    fin = torch.isfinite(ref)
    print(f"scores T={T} S={S}: mask mismatches {int((fin != torch.isfinite(got)).sum())}, "
          f"max abs err {float((got[fin] - ref[fin]).abs().max()):.3g}, |ref| max {float(ref[fin].abs().max()):.3g}")
