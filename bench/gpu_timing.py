"""Measuring helpers shared by the GPU benchmarks (bench_split_gpu.py, placement.py): CUDA-graph and eager timing
with CUDA events, kernel launches counted by torch.profiler, and a pinned host copy read through the production
device view. One copy of each, so the benchmarks time things the same way."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
from pinsidecar_hook.rehome import device_view_of_pinned

__all__ = ["eager_samples_us", "eager_time_us", "graph_time_us", "kernels_launched", "pinned_view"]


def pinned_view(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in pinned host memory, returned as its device view (zero-copy reads over the bus)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t)
    return device_view_of_pinned(host)


def kernels_launched(fn: Callable[[], object]) -> list[str]:
    """Names of the CUDA kernels one call of ``fn`` launches (after three warm-up calls), memcpy/memset left out."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], acc_events=True) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
    return [n for n in names if not n.startswith(("Memcpy", "Memset"))]


def graph_time_us(fn: Callable[[], object], inner: int = 100, reps: int = 7) -> float:
    """Median over ``reps`` replays of a CUDA graph holding ``inner`` calls of ``fn``, per call, in µs (launch gaps
    as in serving, without Python's)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / inner)
    return statistics.median(times)


def eager_samples_us(fn: Callable[[], object], reps: int = 5, warmup: bool = True) -> list[float]:
    """``reps`` eager calls of ``fn`` (after one warm-up unless ``warmup`` is off), each timed with CUDA events, in
    µs: for callers that interleave several things round by round and keep the spread."""
    if warmup:
        fn()
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return times


def eager_time_us(fn: Callable[[], object], reps: int = 5) -> float:
    """Median of ``reps`` eager calls of ``fn`` (after one warm-up), timed with CUDA events, in µs."""
    return statistics.median(eager_samples_us(fn, reps))
