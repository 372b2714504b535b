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
"""

from __future__ import annotations

import os

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
