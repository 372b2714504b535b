"""The GPU leg of the main job: run kernels from the artifact cache once, against PyTorch.

Called by ``python -m cute_kernels build --demo``. Without a GPU it says so and returns.
The decode-runtime demo (``spec_decode``) hooks in here once it exists.
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
