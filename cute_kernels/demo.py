"""The GPU leg of the main job (``python -m cute_kernels build --demo``).

On a supported GPU: one kernel loaded from the artifact cache and checked against PyTorch,
then a few speculative decode steps of the runtime on its ``fused`` backend (this project's
kernels in CUDA graphs) against its ``torch-bf16`` backend. Without a GPU it says so and
returns. This module sits above the kernel packages: it imports ``spec_decode`` lazily and
nothing in the core imports it.
"""

from __future__ import annotations

import time


def run_demo(store) -> None:
    import torch

    from .arch import current_arch

    arch = current_arch()
    if arch is None:
        print("demo: no supported CUDA GPU here; AOT build only")
        return
    from . import jit
    from .row_rms import row_rms

    jit.CACHE.clear()
    x = torch.randn(64, 7168, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    jit.get_kernel("row_rms", arch, artifact_cache=store, hidden=7168, dtype="bfloat16")
    t_get = time.perf_counter() - t0
    r = row_rms(x)
    ref = torch.rsqrt(x.double().square().mean(-1) + 1e-6)
    err = ((r.double() - ref).norm() / ref.norm()).item()
    s = jit.CACHE.stats
    print(f"demo: row_rms on {torch.cuda.get_device_name()} ({arch}): rel err {err:.2e}; "
          f"kernel obtained in {t_get * 1e3:.1f} ms ({'artifact cache load' if s.disk_loads else 'compiled'})")
    run_decode_demo()


def run_decode_demo(new_tokens: int = 16) -> None:
    """A few decode steps of the small model on both graph backends, prompt of 32 tokens."""
    import random

    from spec_decode import SMALL, Engine, EngineConfig

    rng = random.Random(0)
    ids = [[rng.randrange(SMALL.vocab) for _ in range(32)]]
    for backend in ("torch-bf16", "fused"):
        eng = Engine(EngineConfig(model=SMALL, backend=backend, device="cuda", dtype="bfloat16",
                                  max_seq_len=32 + new_tokens + 16, graph_batch_sizes=(1,)))
        eng.warm_up(1)
        t0 = time.perf_counter()
        out = eng.generate(ids, new_tokens)
        dt = time.perf_counter() - t0
        print(f"demo: decode runtime ({backend}, small model, BS1): {len(out[0])} tokens in {dt * 1e3:.0f} ms "
              f"(prefill and its first-call compiles included), first {out[0][:6]}")
