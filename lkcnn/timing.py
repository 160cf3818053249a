"""The one way lkcnn times work: warm-up calls, then a median over single calls or a mean over back-to-back calls,
on CUDA events where the work runs on a GPU and on the host clock where it runs on the CPU. `mark` and `elapsed_ms`
are the clock itself, for timings taken between hooks (the per-layer KernelTimingCallback).

Events, because a launch returns before its kernels run: the host clock would time the launches unless the GPU were
synchronized around every call, which adds that latency to each. Events sit in the stream between the calls and are
read once at the end. `mean_ms(wall=True)` is the exception the callers ask for: the time the host waits from a
synchronized start to a synchronized end (host time when the host limits, GPU time when the GPU does).

A leaf module (torch alone), like lkcnn.errors, so that every layer may time with it: the training callbacks as well
as the benchmarks and the evaluator above them.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable
from time import perf_counter

import torch

Device = torch.device | str | None
Mark = float | torch.cuda.Event  # a point in time: perf_counter() seconds, or an event recorded in a GPU stream


def on_gpu(device: Device = None) -> bool:
    """Whether `device` is a CUDA device, timed with events; None means CUDA where a GPU is visible."""
    return torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"


def synchronize(device: Device = None) -> None:
    """Wait for the work queued on `device` (on the CPU there is none)."""
    if on_gpu(device):
        torch.cuda.synchronize(device)


def mark(device: Device = None) -> Mark:
    """Now, on `device`'s clock: an event recorded in its current stream on a GPU, the host clock on the CPU."""
    if not on_gpu(device):
        return perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


def elapsed_ms(start: Mark, end: Mark) -> float:
    """ms from one mark to a later one of the same clock (events must have completed: synchronize first)."""
    return start.elapsed_time(end) if isinstance(start, torch.cuda.Event) else (end - start) * 1e3


def median_ms(fn: Callable[[], object], reps: int, warmup: int = 0, device: Device = None) -> float:
    """Median ms of `reps` single calls of `fn`, run back to back after `warmup` calls."""
    for _ in range(warmup):
        fn()
    marks = []
    for _ in range(reps):
        start = mark(device)
        fn()
        marks.append((start, mark(device)))
    synchronize(device)
    return statistics.median(elapsed_ms(start, end) for start, end in marks)


def mean_ms(fn: Callable[[], object], reps: int, warmup: int = 0, device: Device = None, wall: bool = False) -> float:
    """Mean ms per call of `reps` back-to-back calls of `fn` after `warmup` calls, between two marks only (for work
    too short or too entangled to time call by call: collectives, training steps). With `wall`, the host clock from
    a synchronized start to a synchronized end; the CPU is always timed so."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    clock = "cpu" if wall else device  # "cpu": the host clock
    start = mark(clock)
    for _ in range(reps):
        fn()
    if not on_gpu(clock):
        synchronize(device)  # the host waits for the GPU before it reads the clock
    end = mark(clock)
    synchronize(device)
    return elapsed_ms(start, end) / reps


def estimate_ms(fn: Callable[[], object], device: Device = None) -> float:
    """One warm call's time, at least 1 us (callers divide by it); the call before it absorbs JIT builds and
    cuDNN autotuning."""
    return max(median_ms(fn, reps=1, warmup=1, device=device), 1e-3)


def budget_median_ms(fn: Callable[[], object], warmup_ms: float, rep_ms: float, min_reps: int,
                     device: Device = None) -> float:
    """Median over as many single calls as fit in `rep_ms` (at least `min_reps`), after warm-up calls that fill
    `warmup_ms`; both counts from `estimate_ms`."""
    estimate = estimate_ms(fn, device)
    return median_ms(fn, max(min_reps, int(rep_ms / estimate)), warmup=int(warmup_ms / estimate), device=device)
