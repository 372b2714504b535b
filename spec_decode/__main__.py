"""``python -m spec_decode run [--batch B] [--prompt-len N] [--new M] [--plain]``: decode demo.

Runs the chosen backend (``--backend reference|baseline|fused``; baseline and fused replay
CUDA graphs on a GPU; fused needs ``--device cuda`` and runs in bf16 on the ``small`` model
unless ``--model`` says otherwise) with speculative decoding and prints tokens/s and the
median acceptance length.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import time

from .config import SLICE, SMALL, TINY, EngineConfig
from .engine import Engine


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m spec_decode")
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="decode demo on the tiny model")
    run.add_argument("--batch", type=int, default=2)
    run.add_argument("--prompt-len", type=int, default=16)
    run.add_argument("--new", type=int, default=32)
    run.add_argument("--plain", action="store_true", help="plain greedy decoding instead of speculative")
    run.add_argument("--device", default="cpu")
    run.add_argument("--backend", default="reference", choices=("reference", "baseline", "fused"),
                     help="reference: the spec's per-token loops; baseline: sync-free torch ops in step graphs; "
                          "fused: this project's kernels in step graphs (bf16, CUDA)")
    run.add_argument("--model", choices=("tiny", "small", "slice"), default=None,
                     help="default: small for the fused backend, tiny otherwise")
    args = ap.parse_args(argv)
    name = args.model or ("small" if args.backend == "fused" else "tiny")
    model = {"tiny": TINY, "small": SMALL, "slice": SLICE}[name]
    cfg = EngineConfig(model=model, device=args.device, max_seq_len=args.prompt_len + args.new + 16,
                       backend=args.backend, dtype="bfloat16" if args.backend == "fused" else "float32")
    eng = Engine(cfg)
    rng = random.Random(0)
    ids = [[rng.randrange(cfg.model.vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    print(f"input token ids hash: {hashlib.sha256(repr(ids).encode()).hexdigest()[:16]}")
    t0 = time.perf_counter()
    out = eng.generate(ids, args.new, speculative=not args.plain)
    dt = time.perf_counter() - t0
    n = sum(len(o) for o in out)
    print(f"{'plain' if args.plain else 'speculative'} greedy, batch {args.batch}: {n} tokens in {dt:.2f} s "
          f"({n / dt:.1f} tok/s, {args.backend} backend incl. prefill); median acceptance length "
          f"{eng.stats.median_acceptance:.1f}")
    print("first request:", out[0][:16], "...")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
