"""``python -m spec_decode run [--backend B] [--device D] [--model M] [--batch B] [--prompt-len N] [--new M] [--plain] [--tp N]``: decode demo.

Tensor parallel: one process per rank, e.g. ``python -m torch.distributed.run --standalone --nproc-per-node 4
-m spec_decode run --tp 4 --backend fused --device cuda`` (gloo on CPUs with ``--device cpu
--backend torch-bf16``); rank 0 prints.

Runs the chosen backend (``--backend reference|torch-bf16|base|fused``; torch-bf16, base and fused replay
CUDA graphs on a GPU; fused needs ``--device cuda`` and runs in bf16 on the ``small`` model
unless ``--model`` says otherwise) with speculative decoding and prints tokens/s and the
median acceptance length.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
import time

import torch

from .config import PRESETS, EngineConfig
from .engine import Engine


def parser() -> argparse.ArgumentParser:
    """The command line (every subcommand and option with its help and default)."""
    ap = argparse.ArgumentParser(prog="python -m spec_decode", description="The speculative decode runtime.")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{run}")
    run = sub.add_parser("run", help="decode random prompts and print tokens/s and the acceptance length",
                         description="Decode random prompts with speculative decoding (block 5) and print "
                                     "tokens/s and the median acceptance length.")
    run.add_argument("--batch", type=int, default=2, help="requests (default: %(default)s)")
    run.add_argument("--prompt-len", type=int, default=16, help="prompt tokens per request (default: %(default)s)")
    run.add_argument("--new", type=int, default=32, help="new tokens per request (default: %(default)s)")
    run.add_argument("--plain", action="store_true",
                     help="plain greedy decoding instead of speculative (default: speculative)")
    run.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    run.add_argument("--backend", default="reference", choices=("reference", "torch-bf16", "base", "fused"),
                     help="reference: the spec's per-token loops; torch-bf16: sync-free torch ops (bf16 experts) in "
                          "step graphs; base: this project's expert kernels and formats without the fusions; "
                          "fused: this project's kernels in step graphs (base and fused: bf16, need --device cuda) "
                          "(default: %(default)s)")
    run.add_argument("--model", choices=tuple(PRESETS), default=None,
                     help="model config (default: small for the fused backend, tiny otherwise)")
    run.add_argument("--tp", type=int, default=1, choices=(1, 2, 4, 8),
                     help="tensor-parallel ranks (experts: ep = tp); start one process per rank with torchrun "
                          "(default: %(default)s)")
    run.add_argument("--allreduce", default=None, choices=("custom_push", "nccl"),
                     help="force the all-reduce backend (default: the automatic choice)")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("python -m spec_decode run: --device cuda, but PyTorch sees no CUDA device here "
              "(use --device cpu with the reference or torch-bf16 backend)", file=sys.stderr)
        return 2
    if args.backend in ("base", "fused") and not args.device.startswith("cuda"):
        print(f"python -m spec_decode run: --backend {args.backend} runs this project's GPU kernels; add --device cuda",
              file=sys.stderr)
        return 2
    name = args.model or ("small" if args.backend in ("base", "fused") else "tiny")
    model = PRESETS[name]
    if args.tp > 1 and args.backend == "reference":
        print("python -m spec_decode run: --tp > 1 runs the step model: add --backend torch-bf16 or fused",
              file=sys.stderr)
        return 2
    cfg = EngineConfig(model=model, device=args.device, max_seq_len=args.prompt_len + args.new + 16,
                       backend=args.backend, dtype="bfloat16" if args.backend in ("base", "fused") else "float32",
                       tp=args.tp, allreduce=args.allreduce)
    eng = Engine(cfg)
    say = print if eng.rank == 0 else (lambda *a, **k: None)
    rng = random.Random(0)
    ids = [[rng.randrange(cfg.model.vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    say(f"input token ids hash: {hashlib.sha256(repr(ids).encode()).hexdigest()[:16]}")
    t0 = time.perf_counter()
    out = eng.generate(ids, args.new, speculative=not args.plain)
    dt = time.perf_counter() - t0
    n = sum(len(o) for o in out)
    tp = f", TP{args.tp} ({getattr(eng, 'allreduce_backend', '')} all-reduce)" if args.tp > 1 else ""
    say(f"{'plain' if args.plain else 'speculative'} greedy, batch {args.batch}: {n} tokens in {dt:.2f} s "
        f"({n / dt:.1f} tok/s, {args.backend} backend incl. prefill{tp}); median acceptance length "
        f"{eng.stats.median_acceptance:.1f}")
    say("first request:", out[0][:16], "...")
    eng.close()  # tp > 1: destroys the process group it set up (before the interpreter exits)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
