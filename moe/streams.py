"""Fork work onto a side stream and join it back, eagerly or inside a CUDA graph capture.

    side = SideStream()
    with side.fork():                      # records an event on the current stream, waits on it
        mxfp8_quantize(x, q=q, scales=s)   # kernels default to the current (= side) stream
    router(logits, bias)                   # runs concurrently on the main stream
    side.join()                            # main waits for the side work before its consumer

Under ``torch.cuda.graph(...)`` the event record/wait pairs become graph edges, so the
replayed graph has the same fork/join structure. Events and the stream are created once.

:func:`dedicated_stream` makes a stream of its own rather than one of PyTorch's pooled
streams: ``torch.cuda.Stream()`` hands out 32 streams per priority round-robin, so after 32
requests in a process a "new" stream is an old one. Two branches that must run concurrently
-- simulated tensor-parallel ranks whose all-reduce kernels wait for each other -- would then
share one stream, capture one behind the other, and wait until the all-reduce's bounded wait
gives up.
"""

from __future__ import annotations

import contextlib

import torch


def dedicated_stream(device=None, priority: int = 0) -> torch.cuda.Stream:
    """A new non-blocking CUDA stream on ``device`` that no other ``torch.cuda.Stream()`` or
    ``dedicated_stream()`` call of this process returns (not from PyTorch's stream pool). Use
    it for streams whose work must not be serialised behind another stream's: a simulated
    rank's, a fork that must overlap. Like PyTorch's pooled streams it lives as long as the
    process: the caching allocator records events on every stream a freed block was used on,
    long after the stream's owner is gone, so destroying it would fail there -- make these
    once per engine, not per step."""
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"dedicated_stream: device must be a CUDA device, got {device}")
    from cuda.bindings import runtime as cudart

    with torch.cuda.device(device):
        torch.cuda.init()
        err, handle = cudart.cudaStreamCreateWithPriority(cudart.cudaStreamNonBlocking, priority)
        if err != cudart.cudaError_t.cudaSuccess:
            raise RuntimeError(f"dedicated_stream: cudaStreamCreateWithPriority failed: {err}")
        stream = torch.cuda.ExternalStream(int(handle), device=device)
    return stream


class SideStream:
    def __init__(self, device=None, priority: int = 0):
        self.stream = dedicated_stream(device, priority)
        self._fork = torch.cuda.Event()
        self._done = torch.cuda.Event()
        self._main = None

    @contextlib.contextmanager
    def fork(self, main: torch.cuda.Stream | None = None):
        self._main = main if main is not None else torch.cuda.current_stream()
        self._fork.record(self._main)
        self.stream.wait_event(self._fork)
        with torch.cuda.stream(self.stream):
            yield self.stream
        self._done.record(self.stream)

    def join(self, main: torch.cuda.Stream | None = None) -> None:
        target = main if main is not None else (self._main or torch.cuda.current_stream())
        target.wait_event(self._done)
