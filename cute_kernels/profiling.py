"""A ``torch.profiler`` session that is safe in a process holding CUDA graphs.

``cuda_profile()`` is ``torch.profiler.profile`` over CUDA activity (and CPU with ``cpu=True``)
with CUPTI kept initialised between sessions: Kineto's ``TEARDOWN_CUPTI=0`` and
``DISABLE_CUPTI_LAZY_REINIT=1``. When a session ends, Kineto otherwise finalises CUPTI and
re-initialises it at the next session, which with CUDA graphs in the process has crashed with
illegal memory accesses (pytorch/pytorch#75504). torch sets the same two variables itself, but
only for torch.compile's graphs and only below CUDA 12.6; this project's runtime captures its
own graphs and profiles them between captures. The settings are process-wide and only keep
CUPTI loaded; values already in the environment win.

    from cute_kernels.profiling import cuda_profile
    with cuda_profile() as prof:
        graph.replay(); torch.cuda.synchronize()

``copy_bandwidth()`` measures the card's device copy bandwidth, the yardstick the benchmarks
(``bench/``, ``spec_decode.bench``) quote a bandwidth-bound kernel's share against on a card
other than the H200.
"""

from __future__ import annotations

import os
import statistics

CUPTI_SETTINGS = {"TEARDOWN_CUPTI": "0", "DISABLE_CUPTI_LAZY_REINIT": "1"}


def keep_cupti_initialised() -> None:
    """Set Kineto's two CUPTI settings unless the environment already has them."""
    for k, v in CUPTI_SETTINGS.items():
        os.environ.setdefault(k, v)


def cuda_profile(cpu: bool = False):
    """``torch.profiler.profile`` over CUDA (+ CPU) activity, CUPTI kept initialised."""
    from torch.profiler import ProfilerActivity, profile

    keep_cupti_initialised()
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cpu else [ProfilerActivity.CUDA]
    return profile(activities=acts)


def copy_bandwidth(nbytes: int = 256 << 20, pairs: int = 4, trials: int = 30) -> float:
    """This CUDA device's copy bandwidth, bytes read + written per second: a CUDA graph of
    ``pairs`` copies of ``nbytes`` (2 GiB in all with the defaults, past L2), captured on a side
    stream after one eager round, replayed three times to warm up, then the median of ``trials``
    replays timed with CUDA events. Allocates its buffers and frees them (and the cache) after."""
    import torch

    src = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(pairs)]
    dst = [torch.empty_like(x) for x in src]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for d, x in zip(dst, src):
            d.copy_(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        for d, x in zip(dst, src):
            d.copy_(x)
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(trials):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    del graph, src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes * pairs / statistics.median(times)
