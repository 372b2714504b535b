"""Fork work onto a side stream and join it back, eagerly or inside a CUDA graph capture.

    side = SideStream()
    with side.fork():                      # records an event on the current stream, waits on it
        mxfp8_quantize(x, q=q, scales=s)   # kernels default to the current (= side) stream
    router(logits, bias)                   # runs concurrently on the main stream
    side.join()                            # main waits for the side work before its consumer

Under ``torch.cuda.graph(...)`` the event record/wait pairs become graph edges, so the
replayed graph has the same fork/join structure. Events and the stream are created once.
"""

from __future__ import annotations

import contextlib

import torch


class SideStream:
    def __init__(self, device=None, priority: int = 0):
        self.stream = torch.cuda.Stream(device=device, priority=priority)
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
