"""Per-op numerics of the kernel backends: each op family's error against FP32, same inputs.

    python -m spec_decode.numerics [--model small|v4_flash_slice|...] [--prefill 300] [--out FILE]

The decode benchmark compares ``fused`` and ``base`` by their tokens (teacher-forced
agreement); this says where their numbers come from. One prefill chunk fills the state, then
during one verify step of the fused backend (B = 2 requests x S = 6 positions) every call of
an op family is re-run on the same inputs by

* the base backend's ops (:class:`spec_decode.fused_ops.BaseOps`: the same formats and
  kernels, the reference PR's fusions undone), and
* FP32 PyTorch composites (:class:`spec_decode.step_model.Ops` on FP32 copies of the inputs
  and the bf16 weights: the definition, no rounding but FP32's).

Per op family the table gives the relative error (Frobenius norm) of fused and of base
against FP32, the largest over the step's calls, and the fused-vs-base difference (0 where
they are bit-equal: the fusions kept every rounding point). The indexer's row is the fraction
of its selected entries that the FP32 scores also select (ties aside, it is 1). The op
families: mHC mappings (``mhc_stats``), pre / post mix, the indexer's top-k, the attention
(``sink_attention``: P rounded to bf16 for its product, the one rounding FP32 lacks), WO-A, and the MoE
block (router, MXFP8 routed experts, finalize, shared expert): its FP32 reference uses the
bf16 expert weights, so its row includes the experts' MXFP8 weight rounding. The last column
re-runs the prefill chunk's calls with the base backend alone: at a chunk's sizes the arms
may take other kernels (WO-A's GEMM engine or cuBLAS range against ``bmm``; the MoE at wider
tiles), and the benchmark's teacher-forced comparison runs each backend's eager prefill chunks
over the whole sequence -- the column says whether the arms differ at that chunk size
(``--prefill``; the teacher-forced chunks are ``EngineConfig.prefill_chunk`` long).
"""

from __future__ import annotations

import argparse
import datetime

import torch

from .config import PRESETS
from .model import TargetModel, mhc_mappings, post_mix, pre_mix
from .step_model import DecodeState, Ops, StepModel

#: op families in the table's order: (method, row label)
FAMILIES = (("mhc_mappings", "mHC mappings (statistics, Sinkhorn)"), ("pre_mix", "mHC pre-mix"),
            ("rmsnorm", "RMSNorm"), ("rmsnorm_rope", "RMSNorm + RoPE (q, KV, compressed entries)"),
            ("post_mix", "mHC post-mix"), ("indexer_topk", "indexer top-k (entries also FP32's)"),
            ("sink_attention", "attention (window + entries, sink, inverse RoPE)"),
            ("wo_a", "WO-A"), ("moe", "MoE block (router, MXFP8 experts, finalize, shared)"))


class _Upcast:
    """A bf16 expert-weight stack read in FP32 one gather at a time (``w[ids]``), on the
    device of the indices: the FP32 MoE reference never holds a whole FP32 copy of a layer's
    experts, and the stack may stay in host memory (:func:`op_errors`)."""

    def __init__(self, t: torch.Tensor):
        self.t, self.shape = t, t.shape

    def __getitem__(self, i):
        if isinstance(i, torch.Tensor):
            return self.t[i.to(self.t.device)].to(i.device).float()
        return self.t[i].float()


def share_experts(L: dict) -> dict:
    """A model's ``on_layer`` for :func:`op_errors`: layer ``L``'s routed experts quantized once
    into the MXFP8 operands both kernel backends read (the same format, so one copy serves
    both), the bf16 experts moved to host memory, where only the FP32 reference reads them (a
    gather at a time). What lets the V4-Flash slice fit an 80 GB GPU."""
    from .fused_ops import quantize_layer_experts
    from .model import EXPERT_OPERANDS

    names = [f"ffn.experts.{w}" for w in ("w1", "w3", "w2")]
    mx = quantize_layer_experts({k: L[k] for k in names})
    for k in EXPERT_OPERANDS:
        L[k] = mx[k]
    for k in names:
        L[k] = L[k].cpu()
    return L


def _fp32(x):
    if isinstance(x, torch.Tensor):
        return x.float() if x.is_floating_point() else x
    if isinstance(x, dict):
        return {k: (_Upcast(v) if k.startswith("ffn.experts.") else _fp32(v)) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_fp32(v) for v in x)
    return x


def _unpack_maps(H: torch.Tensor, X: torch.Tensor, n: int):
    """The kernels' packed mappings ``[T, 2n + n*n]`` (pre | post | comb row-major) as the FP32
    composites' (pre, post, comb) for streams ``X [B, S, n, C]``."""
    B, S = X.shape[:2]
    H = H.float().view(B, S, -1)
    return H[..., :n], H[..., n:2 * n], H[..., 2 * n:].unflatten(-1, (n, n))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


class OpProbe:
    """An ops object for :class:`StepModel` that runs ``fused`` and re-runs each op family's
    call on the same inputs: while ``active``, with ``base`` and FP32 composites, recording
    the errors (``errors``); while ``prefill``, with ``base`` alone, recording the fused-vs-base
    difference (``prefill_errors``: a prefill chunk's sizes take other kernels -- WO-A's GEMM
    engine, the MoE's wider tiles -- and the FP32 MoE reference does not fit there).
    Everything else is ``fused``'s."""

    def __init__(self, fused, base, cfg):
        self.fused, self.base, self.cfg, self.ref = fused, base, cfg, Ops()
        self.active = False
        self.prefill = False
        self.errors = {name: [] for name, _ in FAMILIES}  # (fused vs FP32, base vs FP32, fused vs base)
        self.prefill_errors = {name: [] for name, _ in FAMILIES}  # fused vs base

    def __getattr__(self, name):
        return getattr(self.fused, name)

    @property
    def _on(self) -> bool:
        return self.active or self.prefill

    def _record(self, name, a, b, ref):
        """``ref()``: the FP32 composite's output, computed only in the verify step."""
        if self.prefill:
            self.prefill_errors[name].append(_rel(a, b))
        else:
            r = ref()
            self.errors[name].append((_rel(a, r), _rel(b, r), _rel(a, b)))

    def mhc_mappings(self, X, L, site, cfg):
        H = self.fused.mhc_mappings(X, L, site, cfg)
        if getattr(self.fused, "mhc_side", None) is not None:
            # H_post / H_res are the side stream's until the post-mix joins it: wait for them
            # before the copy below reads them (the forward itself reads them only after that
            # join, and goes on with the copy)
            torch.cuda.current_stream().wait_stream(self.fused.mhc_side)
        a = H.clone()
        if self._on:
            b = self.base.mhc_mappings(X, L, site, cfg)

            def ref():
                pre, post, comb = mhc_mappings(X.float(), L[f"hc_{site}_fn"], L[f"hc_{site}_base"],
                                               L[f"hc_{site}_scale"], cfg)
                return torch.cat([pre, post, comb.flatten(-2)], -1).flatten(0, 1)

            self._record("mhc_mappings", a, b, ref)
        return a

    def pre_mix(self, X, maps):
        a = self.fused.pre_mix(X, maps).clone()
        if self._on:
            b = self.base.pre_mix(X, maps)
            self._record("pre_mix", a, b, lambda: pre_mix(X.float(), _unpack_maps(maps, X, self.cfg.mhc_n)[0]))
        return a

    def rmsnorm(self, x, eps, weight=None):
        a = self.fused.rmsnorm(x, eps, weight).clone()
        if self._on:
            w32 = None if weight is None else weight.float()
            self._record("rmsnorm", a, self.base.rmsnorm(x, eps, weight), lambda: self.ref.rmsnorm(x.float(), eps, w32))
        return a

    def rmsnorm_rope(self, x, eps, weight, pos, inv_freq):
        a = self.fused.rmsnorm_rope(x, eps, weight, pos, inv_freq).clone()
        if self._on:
            w32 = None if weight is None else weight.float()
            self._record("rmsnorm_rope", a, self.base.rmsnorm_rope(x, eps, weight, pos, inv_freq),
                         lambda: self.ref.rmsnorm_rope(x.float(), eps, w32, pos, inv_freq))
        return a

    def post_mix(self, X, maps, f):
        a = self.fused.post_mix(X, maps, f).clone()
        if self._on:
            b = self.base.post_mix(X, maps, f)

            def ref():
                _, post, comb = _unpack_maps(maps, X, self.cfg.mhc_n)
                return post_mix(X.float(), post, comb, f.float())

            self._record("post_mix", a, b, ref)
        return a

    def indexer_topk(self, q_idx, w_idx, ipool, slots, pos, topk, ratio):
        idx, valid = (t.clone() for t in self.fused.indexer_topk(q_idx, w_idx, ipool, slots, pos, topk, ratio))
        if self._on:
            b_idx, b_valid = self.base.indexer_topk(q_idx, w_idx, ipool, slots, pos, topk, ratio)

            def chosen(i, v):  # the selected set per token, in entry order (the kernels' orders differ)
                return torch.where(v, i, torch.full_like(i, -1)).sort(-1).values

            same = float(torch.equal(chosen(idx, valid), chosen(b_idx, b_valid)))
            if self.prefill:
                self.prefill_errors["indexer_topk"].append(1.0 - same)
                return idx, valid
            r_idx, r_valid = self.ref.indexer_topk(*_fp32((q_idx, w_idx, ipool)), slots, pos, topk, ratio)

            def overlap(i, v):  # fraction of FP32's selected entries this selection also holds
                n = int(r_valid.sum())
                if n == 0:
                    return 1.0
                hit = (i[..., :, None] == r_idx[..., None, :]) & v[..., :, None] & r_valid[..., None, :]
                return float(hit.any(-2).sum()) / n

            self.errors["indexer_topk"].append((overlap(idx, valid), overlap(b_idx, b_valid), 1.0 - same))
        return idx, valid

    def sink_attention(self, q, kv, rows, L, scale, rotate):
        a = self.fused.sink_attention(q, kv, rows, L, scale, rotate).clone()
        if self._on:
            self._record("sink_attention", a, self.base.sink_attention(q, kv, rows, L, scale, rotate),
                         lambda: self.ref.sink_attention(q.float(), kv.float(), rows, L, scale, rotate))
        return a

    def wo_a(self, o, w, cfg):
        a = self.fused.wo_a(o, w, cfg).clone()
        if self._on:
            self._record("wo_a", a, self.base.wo_a(o, w, cfg), lambda: self.ref.wo_a(o.float(), w.float(), cfg))
        return a

    def moe(self, h, L, cfg, tokens, first_expert: int = 0, reduce: bool = False):
        a = self.fused.moe(h, L, cfg, tokens, first_expert, reduce).clone()
        if self._on:
            b = self.base.moe(h, L, cfg, tokens, first_expert, reduce)
            self._record("moe", a, b, lambda: self.ref.moe(h.float(), _fp32(L), cfg, tokens, first_expert))
        return a


def op_errors(model: str = "small", seed: int = 0, prefill: int = 300, device: str = "cuda") -> dict:
    """``{family: (calls, fused vs FP32, base vs FP32, fused vs base, fused vs base in the
    prefill chunk)}`` for one verify step (B = 2, S = 6) after a ``prefill``-position chunk per
    request, each the largest over the step's calls (the indexer's first two: the smallest
    overlap; its fused-vs-base entries: the fraction of calls whose selected sets differ);
    the last, over the prefill chunk's calls (None where the family made none). The default
    300 positions give ``small``'s CSA layers 75 visible entries for its top-64 (the V4
    presets' top-512 / 1024 select among more than they keep from ``prefill`` > 4 x
    index_topk). Needs a GPU with room for the model's other weights and one MXFP8 copy of its
    experts (both backends read it), and host memory for the bf16 experts
    (:func:`share_experts`)."""
    from .fused_ops import BaseOps, FusedOps

    cfg = PRESETS[model]
    target = TargetModel(cfg, seed=seed, dtype=torch.bfloat16, device=device, on_layer=share_experts)
    width, max_len = 2 * prefill, prefill + 64  # the prefill chunk: 2 requests x prefill tokens
    fused = FusedOps(target, max_tokens=width, max_len=max_len)
    base = BaseOps(target, max_tokens=width, max_len=max_len)
    probe = OpProbe(fused, base, cfg)
    step = StepModel(target, probe)
    st = DecodeState(cfg, 3, max_len, 6, torch.bfloat16, device)
    g = torch.Generator(device=device).manual_seed(seed)
    slots = torch.tensor([0, 1], device=device)
    with torch.no_grad():
        toks = torch.randint(0, cfg.vocab, (2, prefill), device=device, generator=g)
        probe.prefill = True
        step.forward(toks, torch.arange(prefill, device=device)[None].expand(2, -1), slots, st)
        probe.prefill, probe.active = False, True
        toks = torch.randint(0, cfg.vocab, (2, 6), device=device, generator=g)
        step.forward(toks, prefill + torch.arange(6, device=device)[None].expand(2, -1), slots, st)
    torch.cuda.synchronize()
    return summarize(probe)


def summarize(probe: OpProbe) -> dict:
    """:func:`op_errors`' table from a probe's records: per family with verify-step records,
    (calls, worst fused vs FP32, worst base vs FP32, largest fused vs base, the prefill
    chunk's largest fused vs base or None) -- for the indexer the smallest overlaps, and the
    fraction of prefill calls whose sets differ."""
    out = {}
    for name, _ in FAMILIES:
        e, p = probe.errors[name], probe.prefill_errors[name]
        if not e:
            continue
        pick = min if name == "indexer_topk" else max
        out[name] = (len(e), pick(x[0] for x in e), pick(x[1] for x in e), max(x[2] for x in e),
                     (sum(p) / len(p) if name == "indexer_topk" else max(p)) if p else None)
    return out


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(r) + " |" for r in [header, ["---"] * len(header)] + rows])


def table(model: str, errors: dict, prefill: int = 300) -> str:
    rows = []
    for name, label in FAMILIES:
        if name not in errors:
            continue
        calls, f, b, fb, pre = errors[name]
        if name == "indexer_topk":
            rows.append([label, str(calls), f"{f:.4f}", f"{b:.4f}", "same sets" if fb == 0 else "sets differ",
                         "n/a" if pre is None else "same sets" if pre == 0 else f"sets differ in {pre:.0%} of calls"])
        else:
            rows.append([label, str(calls), f"{f:.2e}", f"{b:.2e}", "bit-equal" if fb == 0 else f"{fb:.2e}",
                         "n/a" if pre is None else "bit-equal" if pre == 0 else f"{pre:.2e}"])
    card = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return "\n".join([f"## Per-op error against FP32, {model} -- {card}, "
                      f"{datetime.date.today()}", "",
                      f"Command: `python -m spec_decode.numerics --model {model}"
                      f"{'' if prefill == 300 else f' --prefill {prefill}'}`", "",
                      _markdown(["op family (one verify step, B=2 x 6)", "calls", "fused vs FP32 (rel.)",
                                 "base vs FP32 (rel.)", "fused vs base",
                                 f"fused vs base, prefill chunk (2 x {prefill})"], rows)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=tuple(PRESETS), default="small")
    ap.add_argument("--prefill", type=int, default=300,
                    help="positions per request before the measured verify step (default: %(default)s)")
    ap.add_argument("--out", default=None, help="also write the table to this file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("spec_decode.numerics needs a CUDA GPU (the kernel backends)")
        return 2
    if args.prefill < 1:
        ap.error("--prefill must be positive")
    text = table(args.model, op_errors(args.model, prefill=args.prefill), args.prefill)
    print(text)
    if args.out:
        open(args.out, "w").write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
