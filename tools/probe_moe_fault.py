"""Device probe: the illegal address in the fused MoE at the slice config, B = 64 (T = 384).

    device run (carry .devcache): source tools/device-env.sh && CUDA_LAUNCH_BLOCKING=1 python tools/probe_moe_fault.py

tools/probe_slice_numerics.py (TRACE=1, H200) faulted inside moe_expert_gate_up (the tiled
kernel, T = 384 > the row-pass bound) on the first layer's MoE input, after the router and the
routed quantisation returned. The bench's T = 384 layer (uniform random logits) did not. This
probe takes the real MoE input (the baseline step up to layer 0's MoE), checks the router's
outputs against torch (counts, offsets, tile_expert, capacity), prints the routing skew, then
runs the expert kernels one at a time -- row passes first, the tiled configurations last
(a fault ends the process; the printed lines before it say which call).
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_fused_ops_families import random_kv_pool, verify_block  # noqa: E402

from moe.experts import moe_expert_gate_up, moe_expert_gemm  # noqa: E402
from moe.quant import mxfp8_quantize_routed  # noqa: E402
from spec_decode.config import SLICE  # noqa: E402
from spec_decode.fused_ops import FusedOps  # noqa: E402
from spec_decode.model import TargetModel  # noqa: E402
from spec_decode.step_model import Ops, StepModel  # noqa: E402


class Captured(Exception):
    pass


def main():
    cfg, B, S, max_len = SLICE, int(os.environ.get("B", "64")), 6, 600
    m = TargetModel(cfg, seed=3, dtype=torch.bfloat16, device="cuda")
    fused = FusedOps(m, max_tokens=B * S, max_len=max_len)
    kv = random_kv_pool(cfg, B + 1, max_len)
    toks, pos, slots = verify_block(cfg, B, S)
    got = {}

    class Grab(Ops):
        def moe(self, h, L, cfg):
            got["h"], got["L"] = h, L
            raise Captured

    try:
        with torch.no_grad():
            StepModel(m, Grab()).forward(toks, pos, slots, kv)
    except Captured:
        pass
    x, L = got["h"].contiguous(), got["L"]
    P = fused._layer[id(L)]
    logits = (x @ L["router"].T).float().contiguous()
    print(f"x {tuple(x.shape)} finite {torch.isfinite(x).all().item()}  logits finite "
          f"{torch.isfinite(logits).all().item()}", flush=True)
    r = fused.router(logits, P["router_bias"])
    torch.cuda.synchronize()
    E, k, T = cfg.experts, cfg.top_k, x.shape[0]
    ids = r.topk_ids[:T].long()
    cnt_ref = torch.bincount(ids.flatten(), minlength=E)
    cnt = r.expert_counts.long()
    offs = r.expert_offsets.long()
    print(f"ids in range {bool(((ids >= 0) & (ids < E)).all())}; counts match bincount {torch.equal(cnt, cnt_ref)}; "
          f"sum {int(cnt.sum())} (= T*k {T * k}); max count {int(cnt.max())}; experts hit {int((cnt > 0).sum())}",
          flush=True)
    pad = (cnt + 127) // 128 * 128
    offs_ref = torch.cat([torch.zeros(1, dtype=torch.long, device="cuda"), pad.cumsum(0)])
    print(f"offsets match {torch.equal(offs, offs_ref)}; total {int(offs[E])} capacity {r.sorted_token_ids.numel()} "
          f"tiles {r.tile_expert.numel()} total_rows {int(r.total_rows[0])}", flush=True)
    te = r.tile_expert.long()
    nt = int(offs[E]) // 128
    te_ref = torch.full_like(te, -1)
    for e in torch.nonzero(cnt).flatten().tolist():
        te_ref[int(offs[e]) // 128:int(offs[e + 1]) // 128] = e
    print(f"tile_expert match {torch.equal(te, te_ref)}; live tiles {nt}; values in [-1, E) "
          f"{bool(((te >= -1) & (te < E)).all())}", flush=True)
    srt = r.sorted_token_ids.long()
    live = srt[srt < T * k]
    print(f"sorted ids: live {live.numel()} unique {live.unique().numel()}", flush=True)
    aq, asc = mxfp8_quantize_routed(x, r.sorted_token_ids, r.total_rows, k)
    torch.cuda.synchronize()
    n = T * k
    args = (aq, asc, P["gu_q"], P["gu_s"], r.expert_offsets, r.expert_counts, r.tile_expert)
    print(f"gu_q {tuple(P['gu_q'].shape)} {P['gu_q'].dtype} gu_s {tuple(P['gu_s'].shape)} d_q "
          f"{tuple(P['d_q'].shape)} d_s {tuple(P['d_s'].shape)} aq {tuple(aq.shape)} asc {tuple(asc.shape)}", flush=True)
    for name, kw in [("row passes 16", dict(expert_row_tile=16)), ("row passes 64", dict(expert_row_tile=64)),
                     ("tiled 256x2 2cta", dict(tile_k=256, stages=2, ctas_per_sm=2)),
                     ("tiled 128x4 1cta (default)", {}), ("tiled 128x4 1cta, no routed_rows", dict(_nobound=True))]:
        kw = dict(kw)
        bound = {} if kw.pop("_nobound", False) else dict(routed_rows=n)
        print(f"gate/up {name} ...", flush=True)
        hq, hs = moe_expert_gate_up(*args, **bound, **kw)
        torch.cuda.synchronize()
        print(f"gate/up {name}: ok", flush=True)
        print(f"down {name} ...", flush=True)
        moe_expert_gemm(hq, hs, P["d_q"], P["d_s"], r.expert_offsets, r.expert_counts, r.tile_expert, **bound, **kw)
        torch.cuda.synchronize()
        print(f"down {name}: ok", flush=True)


if __name__ == "__main__":
    main()
