"""Timing helpers shared by the benchmarks.

Every timed op is captured into a CUDA graph as ``reps`` back-to-back launches over
``rotate`` different input buffers whose total size exceeds the H200's 60 MB L2, so each
launch reads from HBM and no host launch overhead is in the number. The graph is replayed
after warm-up; the per-launch time is the median over ``trials`` replays (CUDA events)
divided by ``reps``.
"""

from __future__ import annotations

import faulthandler
import signal
import statistics

import torch

# A bench stopped by its job's time limit (``timeout`` sends SIGTERM) prints every thread's
# stack first -- the shape whose kernel hung, where the process would otherwise end silently.
try:
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
except (AttributeError, ValueError, OSError):  # a stderr without a file descriptor (imported by a test)
    pass

H200_COPY_BW = 4.3e12  # bytes/s, measured copy bandwidth (device README)
H200_BF16_FLOPS = 790e12  # dense bf16 FLOP/s, measured


def rotation_count(bytes_per_call: int, l2_bytes: int = 60 << 20, min_count: int = 4) -> int:
    return max(min_count, -(-2 * l2_bytes // max(bytes_per_call, 1)))


def _capture(launch, n_inputs: int, reps: int, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    """A graph of ``reps`` back-to-back ``launch(r % n_inputs)`` calls on ``stream``, captured
    after up to three eager calls (compile / autotune outside capture)."""
    with torch.cuda.stream(stream):
        for i in range(min(n_inputs, 3)):
            launch(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        for r in range(reps):
            launch(r % n_inputs)
    return g


def _capture_stream() -> torch.cuda.Stream:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    return s


def _replay_seconds(g: torch.cuda.CUDAGraph, reps: int) -> float:
    """Seconds per launch of one replay of ``g`` (CUDA events)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e-3 / reps


def time_graph(launch, n_inputs: int, reps: int | None = None, trials: int = 30, warmup: int = 3) -> float:
    """Median seconds per ``launch(i)`` call (i indexes the rotating inputs)."""
    reps = reps or n_inputs
    g = _capture(launch, n_inputs, reps, _capture_stream())
    for _ in range(warmup):
        g.replay()
    torch.cuda.synchronize()
    return statistics.median(_replay_seconds(g, reps) for _ in range(trials))


def time_graphs_interleaved(launches, n_inputs: int, reps: int | None = None, trials: int = 30,
                            warmup: int = 3) -> list[float]:
    """Median seconds per call of each ``launches[j](i)``, as :func:`time_graph`, but the
    graphs' replays take turns within every trial (the order rotating from trial to trial):
    a drift of the clocks over the run (power, temperature) then moves every column alike
    instead of whichever op was timed during it -- what a speed ratio between them needs."""
    return [statistics.median(ts) for ts in replay_interleaved(launches, n_inputs, reps, trials, warmup)]


def replay_interleaved(launches, n_inputs: int, reps: int | None = None, trials: int = 30,
                       warmup: int = 3) -> list[list[float]]:
    """Each trial's seconds per call of every ``launches[j](i)``, the graphs replayed in turn
    as in :func:`time_graphs_interleaved`: ``times[j][t]`` -- trial ``t``'s readings of two
    launches can be compared with each other."""
    reps = reps or n_inputs
    s = _capture_stream()
    graphs = [_capture(launch, n_inputs, reps, s) for launch in launches]
    for _ in range(warmup):
        for g in graphs:
            g.replay()
    torch.cuda.synchronize()
    times = [[] for _ in graphs]
    for t in range(trials):
        for k in range(len(graphs)):
            j = (t + k) % len(graphs)
            times[j].append(_replay_seconds(graphs[j], reps))
    return times


def gpu_warmup(seconds: float = 0.5) -> None:
    """Dense matmuls for ``seconds``: clocks up before the first timed row (the first row of a
    run measured up to 4% slow without it)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    while True:
        for _ in range(20):
            a @ a
        stop.record()
        stop.synchronize()
        if start.elapsed_time(stop) * 1e-3 >= seconds:
            return


def poisoned_error(call, y: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error of ``y`` against ``ref`` after one ``call(0)`` into a NaN-poisoned ``y``
    (an unwritten element makes it NaN)."""
    y.fill_(float("nan"))
    call(0)
    torch.cuda.synchronize()
    return ((y.float() - ref).norm() / ref.norm()).item()


def check_output(what: str, call, y: torch.Tensor, ref: torch.Tensor, tol: float = 1e-2) -> float:
    """:func:`poisoned_error` of one ``call(0)``; exits the benchmark (status 1, the case named)
    if it is above ``tol`` or NaN (an unwritten element) -- a wrong kernel is never timed."""
    err = poisoned_error(call, y, ref)
    if not err <= tol:
        raise SystemExit(f"{what}: output check failed (relative error {err:.3g} > {tol:g}); not timing it")
    return err


def measure(call, y: torch.Tensor, ref: torch.Tensor, n: int, what: str = "case",
            tol: float = 1e-2) -> tuple[float, float]:
    """(seconds per ``call(i)``, :func:`check_output`'s error): every element proven written and
    right before the time counts."""
    err = check_output(what, call, y, ref, tol)
    return time_graph(call, n, max(n, 8)), err


def profiled_graph_kernels(step, replays: int) -> list:
    """The kernels (profiler events with a duration) of ``replays`` replays of a CUDA graph of
    ``step()`` -- captured on a side stream after one eager call (compiles, workspaces) and five
    warm-up replays -- for side-stream overlap measurements."""
    from cute_kernels.profiling import cuda_profile

    step()
    torch.cuda.synchronize()
    cs = torch.cuda.Stream()
    cs.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(cs), torch.cuda.graph(g, stream=cs):
        step()
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    with cuda_profile() as prof:
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize()
    return [e for e in prof.events() if e.device_type.name == "CUDA" and e.time_range.elapsed_us() > 0]


def overlap_fractions(spans, others) -> list[float]:
    """For each ``span`` (objects with ``start`` / ``end``), the fraction of its duration during
    which one of ``others`` ran (overlaps summed, capped at the whole span)."""
    out = []
    for s in spans:
        d = s.end - s.start
        ov = sum(max(0, min(s.end, o.end) - max(s.start, o.start)) for o in others)
        out.append(min(ov, d) / d if d > 0 else 0.0)
    return out


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def markdown_table(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def report(title: str, command: str, *parts: str, out: str | None = None) -> str:
    """A bench's markdown for ``bench/RESULTS.md``: ``## title -- card, date``, the command,
    then ``parts`` a blank line apart; printed, and written to ``out`` where given."""
    import datetime

    return emit("\n".join([f"## {title} -- {torch.cuda.get_device_name()}, {datetime.date.today()}", "",
                           f"Command: `{command}`", "", *parts]), out)


def emit(text: str, out: str | None) -> str:
    """Print a bench's markdown and write it to ``out`` where given (one trailing newline)."""
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text.rstrip("\n") + "\n")
    return text
