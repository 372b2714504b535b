"""Shared fixtures. GPU tests carry ``@pytest.mark.gpu`` and skip cleanly without CUDA."""

import os
import tempfile

import pytest
import torch

# Every test run gets its own artifact cache unless the caller chose one.
os.environ.setdefault("CUTE_KERNELS_CACHE_DIR", tempfile.mkdtemp(prefix="cute_kernels_test_cache_"))

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


#: A GPU test running longer than this many seconds besides its kernel compiles and loads
#: (``jit.CACHE.busy_seconds``) is taken for a hung kernel: every thread's stack is printed and
#: the run exits (status 3), so a device job shows which test hung instead of running out its
#: time limit in silence. CUTE_KERNELS_GPU_TEST_TIMEOUT_S changes it (0: never). A run stopped
#: by SIGTERM (a job's ``timeout``) during a GPU test prints the same, then exits (status 124).
GPU_TEST_TIMEOUT_S = float(os.environ.get("CUTE_KERNELS_GPU_TEST_TIMEOUT_S", "300"))

#: Set (``CUTE_KERNELS_UNDER_SANITIZER=1``) by ``tools/device.sh sanitize``: compute-sanitizer's
#: shadow memory shares the GPU, so the engine tests drop their largest batch and the recycled-
#: memory fill stays small (on an 80 GB card the BS 64 engine beside the shadow ran out).
UNDER_SANITIZER = os.environ.get("CUTE_KERNELS_UNDER_SANITIZER") == "1"


def _report_and_exit(item, why: str, status: int) -> None:
    """Every thread's stack on the terminal (not pytest's capture), then the process ends."""
    import faulthandler
    import sys

    capture = item.config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.suspend_global_capture(in_=True)
    print(f"\n{item.nodeid}: {why}; every thread's stack:", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(status)


_SIGTERM_READ_FD = None  # set once: the read end of the signal wakeup pipe
_CURRENT_GPU_TEST = []  # the GPU test running now (at most one)


def _watch_sigterm() -> None:
    """Once, from the main thread: SIGTERM writes its number into a pipe (``set_wakeup_fd``,
    written by the C-level handler even while the main thread waits inside a CUDA call), and a
    thread reading it reports the GPU test under way."""
    global _SIGTERM_READ_FD
    import signal
    import threading

    if _SIGTERM_READ_FD is not None or threading.current_thread() is not threading.main_thread():
        return
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # (the reader thread ends the run)
    signal.set_wakeup_fd(w)
    _SIGTERM_READ_FD = r
    # a forked child (no reader thread there) dies of SIGTERM as usual
    os.register_at_fork(after_in_child=lambda: (signal.set_wakeup_fd(-1),
                                                signal.signal(signal.SIGTERM, signal.SIG_DFL)))

    def reader():
        while True:
            data = os.read(r, 64)
            if signal.SIGTERM in data:
                if _CURRENT_GPU_TEST:
                    _report_and_exit(_CURRENT_GPU_TEST[0], "stopped by SIGTERM (a job's time limit)", 124)
                os._exit(124)

    threading.Thread(target=reader, daemon=True, name="gpu-test-sigterm").start()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    if not (HAS_CUDA and "gpu" in item.keywords):
        yield
        return
    import threading
    import time

    from cute_kernels import jit

    _watch_sigterm()

    def watch():
        while not done.wait(1.0):
            if time.perf_counter() - start - (jit.CACHE.busy_seconds() - busy0) > GPU_TEST_TIMEOUT_S:
                _report_and_exit(item, f"still running {GPU_TEST_TIMEOUT_S:.0f} s past its compiles -- "
                                       f"taken for a hung kernel", 3)

    done = threading.Event()
    start, busy0 = time.perf_counter(), jit.CACHE.busy_seconds()
    if GPU_TEST_TIMEOUT_S > 0:
        threading.Thread(target=watch, daemon=True, name="gpu-test-watchdog").start()
    _CURRENT_GPU_TEST[:] = [item]
    try:
        yield
    finally:
        _CURRENT_GPU_TEST.clear()
        done.set()


@pytest.fixture
def seed():
    """Fresh random inputs every run; the seed is printed so a failure can be replayed
    (``CUTE_KERNELS_TEST_SEED=<seed> pytest ...``)."""
    s = int(os.environ.get("CUTE_KERNELS_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    torch.manual_seed(s)
    print(f"seed={s}")
    return s


def capture_after_warm_up(step) -> "torch.cuda.CUDAGraph":
    """``step()`` once on a side stream (its kernels compile and load outside the capture),
    then captured there into a CUDA graph; the current stream waits for the side stream."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            step()
    torch.cuda.current_stream().wait_stream(s)
    return g


def _fill_cached_memory(byte: int) -> None:
    """Leave the caching allocator's free blocks filled with ``byte``: 128 MiB blocks (the large
    pool; up to 16 GiB, 2 GiB under the sanitizer) and a few hundred 256 KiB blocks (the small pool), written and freed,
    so a buffer allocated next and not initialised holds ``byte``s (0xFF: NaN in bf16, FP32
    and e4m3, a NaN UE8M0 scale). Blocks, not one segment: a long-lived allocation made from
    one (a cuBLAS workspace) keeps only its block from being released."""
    import gc

    gc.collect()  # an engine dropped before: its memory back into the cache first
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    n = min(int(free * 0.5), (2 if UNDER_SANITIZER else 16) << 30) // (128 << 20)
    large = [torch.empty(128 << 20, dtype=torch.uint8, device="cuda").fill_(byte) for _ in range(n)]
    small = [torch.empty(256 << 10, dtype=torch.uint8, device="cuda").fill_(byte) for _ in range(400)]
    torch.cuda.synchronize()
    del large, small


def _generate_on_recycled_memory(make_engine, prompts, max_new_tokens) -> dict:
    """``{byte: outputs}`` for 0x00 and 0xFF: each time the cached memory filled with ``byte``,
    then ``make_engine()`` built on it generates ``prompts`` (its collectives checked)."""
    outs = {}
    for byte in (0x00, 0xFF):
        _fill_cached_memory(byte)
        eng = make_engine()
        outs[byte] = eng.generate(prompts, max_new_tokens)
        eng._check_collectives()
        del eng
    return outs


@pytest.fixture
def generate_on_recycled_memory():
    """``generate(make_engine, prompts, max_new_tokens) -> {0x00: outputs, 0xFF: outputs}``:
    engines built on recycled memory of known contents, for tests that a result never depends
    on a buffer's bytes before it is written (0xFF is NaN in every float format here)."""
    return _generate_on_recycled_memory
