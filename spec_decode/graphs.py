"""Captured steps: one CUDA graph per (padded batch size, step kind), replayed each step.

A :class:`StepGraphs` owns static input buffers (tokens, positions, KV slots) and the output
tensors a capture produced. ``run(tokens, pos, slots)`` copies the live rows in, pads the
rest of the batch with the pool's scratch slot (row ``pool.slots - 1``, never a request's),
replays, and returns views of the live rows. On a CPU (tests) the same object runs the
function eagerly through the same static buffers, so the padding and bookkeeping are the
code the GPU runs.

Kinds used by the engine: ``verify`` (target forward over ``block_size + 1`` positions),
``decode`` (one position, plain greedy), ``draft`` (the three draft stages in one graph).
Capture happens on first use of a batch size (warm-up call outside the capture first, so
every kernel is compiled and every lazy allocation made before the graph records).
"""

from __future__ import annotations

import gc
from typing import Callable

import torch


def _capture(fn: Callable, args: tuple) -> tuple:
    """``(graph, outputs)`` of ``fn(*args)`` captured. Python's garbage collector is run first
    and held off until the capture ends: PyTorch no longer collects before a capture, and a
    collection inside one that frees a dead engine (its graphs, its events and memory) makes
    CUDA calls that invalidate the capture (cudaErrorStreamCaptureInvalidated at whichever
    launch comes next)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = fn(*args)
    finally:
        if enabled:
            gc.enable()
    return g, out


class StepGraphs:
    def __init__(self, fn: Callable, batch_sizes: tuple[int, ...], width: int, scratch_slot: int, device,
                 extras: tuple[tuple[tuple[int, ...], torch.dtype], ...] = ()):
        """``fn(tokens [b, width], pos [b, width], slots [b], *extras) -> tuple of tensors``;
        ``extras``: ``(per-row shape, dtype)`` of each further static input (padded rows zero)."""
        self.fn, self.sizes, self.width = fn, tuple(sorted(batch_sizes)), width
        self.scratch, self.device = scratch_slot, torch.device(device)
        self.use_graphs = self.device.type == "cuda"
        self._warm_up_stream = None
        self.extras = tuple(extras)
        self._static: dict[int, dict] = {}
        self.replays = 0
        self.timing = False  # record CUDA events around each replay (benchmarks)
        self._events: list = []

    def replay_times_ms(self) -> list[float]:
        """Per-replay GPU times recorded while ``timing`` was on (synchronises once)."""
        if self._events:
            self._events[-1][1].synchronize()
        return [a.elapsed_time(z) for a, z in self._events]

    def padded(self, b: int) -> int:
        for s in self.sizes:
            if s >= b:
                return s
        raise ValueError(f"batch of {b} exceeds the largest captured batch size {self.sizes[-1]}")

    def _buffers(self, n: int) -> dict:
        st = self._static.get(n)
        if st is None:
            dev = self.device
            st = {"tokens": torch.zeros(n, self.width, dtype=torch.long, device=dev),
                  "pos": torch.zeros(n, self.width, dtype=torch.long, device=dev),
                  "slots": torch.full((n,), self.scratch, dtype=torch.long, device=dev),
                  "extras": [torch.zeros(n, *shape, device=dev, dtype=dt) for shape, dt in self.extras],
                  "graph": None, "out": None}
            self._static[n] = st
        return st

    def captured(self, b: int) -> bool:
        """Whether a batch of ``b`` replays an existing graph (eager runners: always)."""
        if not self.use_graphs:
            return True
        st = self._static.get(self.padded(b))
        return st is not None and st["graph"] is not None

    def run(self, tokens: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, *extras: torch.Tensor):
        b = tokens.shape[0]
        n = self.padded(b)
        st = self._buffers(n)
        st["tokens"][:b].copy_(tokens)
        st["pos"][:b].copy_(pos)
        st["slots"][:b].copy_(slots)
        st["slots"][b:].fill_(self.scratch)
        st["tokens"][b:].zero_()
        st["pos"][b:].zero_()
        if len(extras) != len(self.extras):
            raise ValueError(f"StepGraphs.run: {len(extras)} extra inputs, the graph takes {len(self.extras)}")
        for buf, x in zip(st["extras"], extras):
            buf[:b].copy_(x)
            buf[b:].zero_()
        args = (st["tokens"], st["pos"], st["slots"], *st["extras"])
        if not self.use_graphs:
            out = self.fn(*args)
        else:
            if st["graph"] is None:
                if self._warm_up_stream is None:  # one for every capture: the pool's streams are few
                    self._warm_up_stream = torch.cuda.Stream(self.device)
                s = self._warm_up_stream
                s.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(s):
                    self.fn(*args)  # warm-up: compile kernels, allocate lazily-created state
                torch.cuda.current_stream(self.device).wait_stream(s)
                st["graph"], st["out"] = _capture(self.fn, args)
            if self.timing:
                a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                st["graph"].replay()
                z.record()
                self._events.append((a, z))
            else:
                st["graph"].replay()
            out = st["out"]
        self.replays += 1
        return tuple(o[:b] for o in out)

    def kernels_per_replay(self, b: int) -> int | None:
        """GPU kernels one replay of the captured graph for batch ``b`` runs (profiled; None
        before capture / on CPU). Memcpy / memset nodes are not counted."""
        st = self._static.get(self.padded(b))
        if st is None or st["graph"] is None:
            return None
        from cute_kernels.profiling import cuda_profile

        torch.cuda.synchronize(self.device)
        with cuda_profile() as prof:
            st["graph"].replay()
            torch.cuda.synchronize(self.device)
        return sum(1 for e in prof.events() if e.device_type.name == "CUDA" and "emcpy" not in e.name
                   and "emset" not in e.name)
