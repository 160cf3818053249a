"""lkcnn.timing on the CPU, against a fake host clock: the warm-up calls run first and are not timed, the
median is over single calls, the mean over back-to-back calls, and the estimate and the budget follow from them."""
from __future__ import annotations

import random
import statistics

import pytest
import torch

from lkcnn import timing

WARMUP_S = 100.0  # a warm-up call's length on the fake clock, far beyond any timed call's: timed, it would show


@pytest.fixture
def clock(monkeypatch):
    """A host clock that only the timed function advances: [now, calls so far]."""
    state = [0.0, 0]
    monkeypatch.setattr(timing, "perf_counter", lambda: state[0])
    return state


def _fn(clock, warmup: int, seconds: list[float]):
    """A function whose i-th call lasts WARMUP_S during the warm-up, then seconds[i - warmup]."""
    def fn():
        i = clock[1]
        clock[1] += 1
        clock[0] += WARMUP_S if i < warmup else seconds[i - warmup]
    return fn


def test_median_of_single_calls_after_the_warmup(clock):
    warmup, reps = random.randint(1, 4), random.choice([3, 5, 7])
    seconds = [random.uniform(1e-4, 1.0) for _ in range(reps)]
    ms = timing.median_ms(_fn(clock, warmup, seconds), reps, warmup, device="cpu")
    assert clock[1] == warmup + reps
    assert ms == pytest.approx(1e3 * statistics.median(seconds))


def test_mean_of_back_to_back_calls_after_the_warmup(clock):
    warmup, reps = random.randint(1, 4), random.randint(2, 9)
    seconds = [random.uniform(1e-4, 1.0) for _ in range(reps)]
    for wall in (False, True):  # on the CPU both are the host clock
        clock[:] = [0.0, 0]
        ms = timing.mean_ms(_fn(clock, warmup, seconds), reps, warmup, device="cpu", wall=wall)
        assert clock[1] == warmup + reps
        assert ms == pytest.approx(1e3 * statistics.mean(seconds))


def test_estimate_times_the_second_call_and_sizes_the_budget(clock):
    estimate_s = 2.0 ** -random.randint(5, 9)  # exact in binary: the test's counts are the timer's, to the call
    assert timing.estimate_ms(_fn(clock, 1, [estimate_s]), device="cpu") == pytest.approx(1e3 * estimate_s)
    clock[:] = [0.0, 0]
    assert timing.estimate_ms(_fn(clock, 1, [0.0]), device="cpu") == 1e-3  # never 0: budgets divide by it

    # every call after the first lasts estimate_s: warm-up and timed calls are counted from that estimate
    warmup_ms, rep_ms = random.uniform(20, 60), random.uniform(20, 60)
    warmup, reps = int(warmup_ms / (1e3 * estimate_s)), max(3, int(rep_ms / (1e3 * estimate_s)))
    clock[:] = [0.0, 0]
    ms = timing.budget_median_ms(_fn(clock, 1, [estimate_s] * (1 + warmup + reps)), warmup_ms, rep_ms, min_reps=3,
                                 device="cpu")
    assert clock[1] == 2 + warmup + reps  # two calls for the estimate
    assert ms == pytest.approx(1e3 * estimate_s)


def test_the_device_picks_the_clock():
    assert not timing.on_gpu("cpu") and timing.on_gpu("cuda")
    assert timing.on_gpu(None) == torch.cuda.is_available()
    timing.synchronize("cpu")  # nothing to wait for, and no CUDA needed
