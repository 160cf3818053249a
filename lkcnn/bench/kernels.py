"""`python -m lkcnn.bench [kernels]` (`lkcnn-bench`): lkcnn's depthwise-conv kernels against PyTorch's best backend,
on a GPU.

For each shape, kernel size and dtype of the benchmark set it times the three passes of lkcnn's op (forward, grad wrt
input, grad wrt weight) and the same passes in PyTorch (cuDNN on/off x NCHW/channels_last, all measured in this run),
relates them to the FMA and memory floors and to MegEngine's H100 anchors, writes a benchmark record (the schema of
benchmarks/README.md) and prints a table last. The flop, floor and table logic are pure functions so the CPU tests
can check them.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lkcnn import timing
from lkcnn.bench import ROOT
from lkcnn.bench.record import command_line, make_record, write_record
from lkcnn.ops import build, reference, set_conv_impl  # importing lkcnn.ops registers torch.ops.lkcnn.*

# The benchmark set: the MegEngine article's shape and RepLKNet-31B's four stages, exactly the (shape, k) pairs of
# benchmarks/h100_anchors.json.
SHAPES: dict[str, tuple[int, int, int, int]] = {
    "seed": (64, 384, 32, 32),  # the MegEngine article's shape
    "s1": (64, 128, 56, 56),  # RepLKNet-31B stages at 224 px, batch 64
    "s2": (64, 256, 28, 28),
    "s3": (64, 512, 14, 14),
    "s4": (64, 1024, 7, 7),
}
KERNEL_SIZES: dict[str, tuple[int, ...]] = {
    "seed": (3, 5, 7, 9, 13, 17, 21, 27, 31), "s1": (7, 31), "s2": (7, 29), "s3": (7, 27), "s4": (7, 13)}
QUICK_KERNEL_SIZES: dict[str, tuple[int, ...]] = {"seed": (9, 31), "s1": (31,), "s2": (29,), "s3": (27,), "s4": (13,)}
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
PASSES = ("fwd", "bwd_input", "bwd_weight")
TOTAL_KEYS = (*PASSES, "total")

# H100 SXM floors: 67 TFLOP/s fp32 FMA, 134 TFLOP/s packed fp16/bf16 FMA (HFMA2),
# ~3 TB/s measured copy bandwidth. L2 is 50 MB: input sets smaller than that are rotated between timed calls.
FP32_FMA_FLOPS = 67e12
HALF_FMA_FLOPS = 134e12
MEMORY_BYTES_PER_S = 3.0e12
L2_BYTES = 50e6
MAX_INPUT_SETS = 8

# Timing budget per timed function: warm-up and repetition time (ms). Functions slower than SLOW_MS (PyTorch's seed
# k31 weight gradient takes ~37 ms) get MIN_REPS timed runs and nothing more: at that length L2 and launch effects do
# not matter, and do_bench's fixed 5-run estimate would triple their cost (the default run must stay ~4 minutes).
WARMUP_MS = 10.0
REP_MS = 40.0
SLOW_MS = 10.0
MIN_REPS = 3

DEFAULT_ANCHORS = ROOT / "benchmarks" / "h100_anchors.json"
Timer = Callable[[Callable[[], object]], float]
Anchors = dict[tuple[tuple[int, ...], int, str], dict[str, dict[str, float]]]


@dataclass(frozen=True)
class Config:
    """One benchmark point: a named (N, C, H, W) shape, a square odd kernel size, a dtype name, and the memory
    format lkcnn's passes are timed in (channels_last is what the training app runs; PyTorch is timed in both)."""
    shape: str
    nchw: tuple[int, int, int, int]
    k: int
    dtype: str
    channels_last: bool = False


@dataclass(frozen=True)
class Inputs:
    """One input set for the three passes: x, the output gradient dy and the (C, 1, k, k) weight."""
    x: Tensor
    dy: Tensor
    w: Tensor
    kernel_size: list[int]
    padding: list[int]


LKCNN_PASSES: dict[str, Callable[[Inputs], Tensor]] = {
    "fwd": lambda s: torch.ops.lkcnn.dwconv2d_fwd(s.x, s.w, None, s.padding),
    "bwd_input": lambda s: torch.ops.lkcnn.dwconv2d_bwd_input(s.dy, s.w, s.padding),
    "bwd_weight": lambda s: torch.ops.lkcnn.dwconv2d_bwd_weight(s.dy, s.x, s.kernel_size, s.padding),
}
TORCH_PASSES: dict[str, Callable[[Inputs], Tensor]] = {
    "fwd": lambda s: reference.forward(s.x, s.w, None, s.padding),
    "bwd_input": lambda s: reference.grad_input(s.dy, s.w, s.padding),
    "bwd_weight": lambda s: reference.grad_weight(s.dy, s.x, s.kernel_size, s.padding),
}
# PyTorch variants: name -> (cuDNN enabled, channels_last). With cuDNN on, cudnn.benchmark picks its best algorithm.
TORCH_VARIANTS: dict[str, tuple[bool, bool]] = {
    "cudnn_nchw": (True, False), "cudnn_channels_last": (True, True),
    "native_nchw": (False, False), "native_channels_last": (False, True),
}


# ----------------------------------------------------------------------------------------------- flops and floors
def in_bounds_taps(size: int, k: int, padding: int | None = None) -> int:
    """Kernel taps that land inside a 1-D extent of `size`, summed over the stride-1 output positions.

    Padded taps multiply zeros, so a kernel may skip them; this is the count it cannot skip (padding defaults to k//2).
    """
    pad = k // 2 if padding is None else padding
    return sum(max(0, min(k, size + pad - p) - max(0, pad - p)) for p in range(size + 2 * pad - k + 1))


def useful_flops(nchw: Sequence[int], k: int) -> int:
    """FLOPs (2 per multiply-add) of one pass counting only in-bounds taps; equal for all three passes."""
    n, c, h, w = nchw
    return 2 * n * c * in_bounds_taps(h, k) * in_bounds_taps(w, k)


def pass_bytes(nchw: Sequence[int], k: int, itemsize: int) -> int:
    """Bytes one pass moves at least once: two feature maps (read one, write or read the other) and the kernel."""
    n, c, h, w = nchw
    return (2 * n * c * h * w + c * k * k) * itemsize


def floors_ms(nchw: Sequence[int], k: int, dtype: str) -> dict[str, dict[str, float]]:
    """FMA and memory floors in ms per pass and for the total of the three passes."""
    rate = FP32_FMA_FLOPS if dtype == "fp32" else HALF_FMA_FLOPS
    per_pass = {"fma": useful_flops(nchw, k) / rate * 1e3,
                "memory": pass_bytes(nchw, k, DTYPES[dtype].itemsize) / MEMORY_BYTES_PER_S * 1e3}
    return {name: {**dict.fromkeys(PASSES, ms), "total": len(PASSES) * ms} for name, ms in per_pass.items()}


def ratios(num: dict[str, float] | None, den: dict[str, float] | None) -> dict[str, float] | None:
    """num / den per pass and for the total, where both have the number (None when either is missing or failed)."""
    if not _ok(num) or not _ok(den):
        return None
    return {key: num[key] / den[key] for key in TOTAL_KEYS if key in num and key in den}


def _ok(times: dict | None) -> bool:
    return bool(times) and "error" not in times


def best_torch(result: dict[str, Any]) -> dict[str, float] | None:
    """The per-pass times of the fastest PyTorch variant of a result, or None."""
    torch_result = result.get("torch")
    if not torch_result or torch_result["best"] is None:
        return None
    return torch_result["variants"][torch_result["best"]]


def describe(cfg: Config) -> dict[str, Any]:
    """The static part of a result: the config, its useful FLOPs, bytes and floors."""
    flops = useful_flops(cfg.nchw, cfg.k)
    n, c, h, w = cfg.nchw
    return {
        "shape": cfg.shape, "nchw": list(cfg.nchw), "k": cfg.k, "dtype": cfg.dtype,
        "lkcnn_layout": "channels_last" if cfg.channels_last else "nchw",
        "useful_flop_per_pass": flops, "dense_fraction": flops / (2 * n * c * h * w * cfg.k ** 2),
        "bytes_per_pass": pass_bytes(cfg.nchw, cfg.k, DTYPES[cfg.dtype].itemsize),
        "floor_ms": floors_ms(cfg.nchw, cfg.k, cfg.dtype),
    }


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Add speedups (other / lkcnn) and fractions of the floors (floor / lkcnn) to a measured result."""
    lk = result.get("lkcnn")
    result["speedup_vs_torch"] = ratios(best_torch(result), lk)
    result["speedup_vs_megengine"] = ratios(result["anchors"]["megengine"], lk)
    result["fraction_of_fma_floor"] = ratios(result["floor_ms"]["fma"], lk)
    result["fraction_of_memory_floor"] = ratios(result["floor_ms"]["memory"], lk)
    return result


# ----------------------------------------------------------------------------------------------- selection, anchors
def parse_shape(name: str) -> tuple[int, int, int, int] | None:
    """(N, C, H, W) of a shape written NxCxHxW (e.g. 64x384x24x24), or None where `name` is not one."""
    parts = name.split("x")
    if len(parts) != 4 or not all(part.isdigit() and int(part) > 0 for part in parts):
        return None
    n, c, h, w = map(int, parts)
    return n, c, h, w


def select_configs(shapes: Iterable[str] | None = None, ks: Iterable[int] | None = None,
                   dtypes: Iterable[str] | None = None, quick: bool = False,
                   channels_last: bool = False) -> list[Config]:
    """The configs to run: every (shape, k, dtype) of the set (or of --quick) that passes the filters. A shape
    written NxCxHxW is timed at the kernel sizes `ks` names (the set's own shapes at theirs)."""
    table = QUICK_KERNEL_SIZES if quick else KERNEL_SIZES
    shapes, dtypes = list(shapes or SHAPES), list(dtypes or DTYPES)
    sizes = {name: SHAPES.get(name) or parse_shape(name) for name in shapes}
    if unknown := [name for name in shapes if sizes[name] is None]:
        raise ValueError(f"unknown shape {', '.join(unknown)}; choose from {', '.join(SHAPES)} or NxCxHxW "
                         "(e.g. 64x384x24x24)")
    if unknown := [name for name in dtypes if name not in DTYPES]:
        raise ValueError(f"unknown dtype {', '.join(unknown)}; choose from {', '.join(DTYPES)}")
    if ks is None and any(name not in table for name in shapes):
        raise ValueError("a shape given as NxCxHxW needs --ks, the kernel sizes to time on it (e.g. --ks 9,13)")
    wanted = None if ks is None else sorted(set(ks))
    if wanted and any(k < 1 or k % 2 == 0 for k in wanted):
        raise ValueError(f"kernel sizes must be odd ('same' padding); got {','.join(map(str, wanted))}")
    configs = [Config(shape, sizes[shape], k, dtype, channels_last) for shape in shapes
               for k in (table[shape] if shape in table else wanted) if wanted is None or k in wanted
               for dtype in dtypes]
    if not configs:
        offered = "; ".join(f"{shape}: {','.join(map(str, table[shape]))}" for shape in shapes if shape in table)
        raise ValueError(f"no kernel size in {sorted(wanted or [])} is benchmarked for these shapes "
                         f"({offered}{' with --quick' if quick else ''})")
    return configs


def load_anchors(path: str | Path) -> tuple[str, Anchors]:
    """The anchors record (kind "anchors": rows of PyTorch's and MegEngine's H100 times): its device line and
    {(nchw, k, dtype): {"pytorch": ms, "megengine": ms}} per pass. Also reads the pre-schema anchors file
    ({"device", "pytorch": [...], "megengine": [...]}, times named <source>_<pass>_ms)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"anchors file {path} not found; pass --anchors PATH (the repo has "
                                f"benchmarks/h100_anchors.json) or --anchors '' to run without anchors")
    try:
        data = json.loads(path.read_text())
        if "rows" in data:
            env = data["environment"]
            device = f"{env['gpu']}, torch {env['torch']}, {env['date']}"
            entries = [(row["source"], row, "") for row in data["rows"]]
        else:
            device = str(data.get("device", ""))
            entries = [(source, entry, f"{source}_") for source in ("pytorch", "megengine") for entry in data[source]]
        anchors: Anchors = {}
        for source, entry, prefix in entries:
            key = (tuple(entry["nchw"]), int(entry["k"]), entry["dtype"])
            times = {name[len(prefix):-3]: float(value) for name, value in entry.items()
                     if name.startswith(prefix) and name.endswith("_ms") and name[len(prefix):-3] in TOTAL_KEYS}
            if not times:
                raise KeyError(f"no <pass>_ms time in {entry}")
            anchors.setdefault(key, {})[source] = times
        return device, anchors
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is not an lkcnn anchors record (needs rows with source, nchw, k, dtype and "
                         f"<pass>_ms times): {type(err).__name__}: {err}") from None


# ----------------------------------------------------------------------------------------------- timing
def gpu_timer() -> tuple[str, Timer]:
    """(name, timer): triton's do_bench median (it flushes L2 between runs) when triton imports, else CUDA events;
    either way a function slower than SLOW_MS gets only MIN_REPS timed runs."""
    try:
        from triton.testing import do_bench
    except ImportError:
        return "CUDA events median", functools.partial(timing.budget_median_ms, warmup_ms=WARMUP_MS, rep_ms=REP_MS,
                                                       min_reps=MIN_REPS)

    def timer(fn: Callable[[], object]) -> float:
        if timing.estimate_ms(fn) > SLOW_MS:
            return timing.median_ms(fn, MIN_REPS)
        return float(do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median"))
    return "triton.testing.do_bench median", timer


def n_input_sets(set_bytes: float) -> int:
    """How many input sets to rotate so that a set has left L2 (other sets passed through it) when it comes back."""
    if set_bytes >= L2_BYTES:
        return 1
    return min(MAX_INPUT_SETS, math.ceil(L2_BYTES / set_bytes) + 1)


def in_layout(sets: list[Inputs], channels_last: bool) -> list[Inputs]:
    """The input sets in NCHW or channels_last memory format (the weight too: PyTorch's kernels take it so)."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return [replace(s, x=s.x.contiguous(memory_format=fmt), dy=s.dy.contiguous(memory_format=fmt),
                    w=s.w.contiguous(memory_format=fmt)) for s in sets]


def make_inputs(cfg: Config, device: torch.device) -> list[Inputs]:
    """Fresh random input sets (never zeros) for the config, as many as n_input_sets asks for, in lkcnn's layout."""
    c, dtype, k = cfg.nchw[1], DTYPES[cfg.dtype], cfg.k

    def one() -> Inputs:
        return Inputs(x=torch.randn(cfg.nchw, device=device, dtype=dtype),
                      dy=torch.randn(cfg.nchw, device=device, dtype=dtype),
                      w=torch.randn(c, 1, k, k, device=device, dtype=dtype) / k,
                      kernel_size=[k, k], padding=[k // 2, k // 2])
    sets = [one() for _ in range(n_input_sets(pass_bytes(cfg.nchw, k, dtype.itemsize)))]
    return in_layout(sets, cfg.channels_last)


def _rotating(fn: Callable[[Inputs], Tensor], sets: list[Inputs]) -> Callable[[], Tensor]:
    cycle = itertools.cycle(sets)
    return lambda: fn(next(cycle))


def time_passes(passes: dict[str, Callable[[Inputs], Tensor]], sets: list[Inputs], timer: Timer) -> dict[str, float]:
    """Median ms of each pass over rotating input sets, plus their total."""
    times = {name: timer(_rotating(fn, sets)) for name, fn in passes.items()}
    times["total"] = sum(times.values())
    return times


def _time_torch(sets: list[Inputs], timer: Timer, cudnn: bool, channels_last: bool) -> dict[str, float]:
    sets = in_layout(sets, channels_last)
    with pytorch_backend(cudnn):
        return time_passes(TORCH_PASSES, sets, timer)


def cudnn_depthwise_mode() -> str | None:
    """'cudnn' where torch can force cuDNN for depthwise convs (torch.backends.cudnn.depthwise_kernel), else None."""
    return "cudnn" if hasattr(torch.backends.cudnn, "depthwise_kernel") else None


def pytorch_backend(cudnn: bool) -> contextlib.AbstractContextManager:
    """cuDNN with autotuning, or PyTorch's native kernels. With cuDNN on, depthwise_kernel='cudnn' (where torch has
    it) overrides the heuristic that sends NCHW depthwise k >= 7 to the native kernels, so cuDNN is really measured."""
    mode = cudnn_depthwise_mode() if cudnn else None
    return torch.backends.cudnn.flags(enabled=cudnn, benchmark=cudnn, **({"depthwise_kernel": mode} if mode else {}))


def _failure(err: Exception) -> dict[str, str]:
    torch.cuda.empty_cache()  # an out-of-memory config must not starve the next one
    return {"error": f"{type(err).__name__}: {err}".strip()}


def _guarded(measure: Callable[[], dict[str, float]]) -> dict[str, Any]:
    """The measurement, or {"error": ...} when it fails (out of memory, unsupported config): the run goes on."""
    try:
        return measure()
    except Exception as err:  # noqa: BLE001  any failure of one measurement is recorded, not fatal
        return _failure(err)


def bench_config(cfg: Config, timer: Timer, device: torch.device, with_torch: bool, anchors: Anchors) -> dict[str, Any]:
    """Measure lkcnn (and PyTorch's four variants) on one config; failures are recorded in the result."""
    result = describe(cfg)
    anchor = anchors.get((cfg.nchw, cfg.k, cfg.dtype), {})
    result["anchors"] = {"pytorch": anchor.get("pytorch"), "megengine": anchor.get("megengine")}
    result["lkcnn"], result["torch"] = None, None
    try:
        sets = make_inputs(cfg, device)
    except Exception as err:  # noqa: BLE001  e.g. out of memory: recorded, the run goes on
        result.update(_failure(err))
        return summarize(result)
    result["lkcnn"] = _guarded(lambda: time_passes(LKCNN_PASSES, sets, timer))
    if with_torch:
        variants = {}
        for name, (cudnn, channels_last) in TORCH_VARIANTS.items():
            variants[name] = _guarded(functools.partial(_time_torch, sets, timer, cudnn, channels_last))
        timed = {name: times["total"] for name, times in variants.items() if _ok(times)}
        result["torch"] = {"variants": variants, "best": min(timed, key=timed.get) if timed else None}
    return summarize(result)


def run(configs: Sequence[Config], timer: Timer, device: torch.device, with_torch: bool = True,
        anchors: Anchors | None = None, log: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
        ) -> list[dict[str, Any]]:
    """Benchmark every config in turn, logging one progress line each."""
    results = []
    for i, cfg in enumerate(configs, 1):
        start = time.perf_counter()
        result = bench_config(cfg, timer, device, with_torch, anchors or {})
        results.append(result)
        cells = dict(zip(TABLE_HEADER, table_row(result)))
        log(f"[{i}/{len(configs)}] {cfg.shape} k{cfg.k} {cfg.dtype}: lkcnn {cells['total']} ms, torch "
            f"{cells['torch']} ms, speedup {cells['speedup']} ({time.perf_counter() - start:.1f} s) {cells['note']}")
    return results


# ----------------------------------------------------------------------------------------------- report
def method(timer_name: str) -> dict[str, Any]:
    """How the numbers were taken: timer, units, PyTorch's variants and the floors."""
    return {
        "timer": timer_name,
        "units": "times in ms (median per pass; total = fwd + bwd_input + bwd_weight); flop; bytes",
        "torch_variants": "cudnn_* = cuDNN enabled with cudnn.benchmark (and depthwise_kernel=cudnn_depthwise_kernel"
                          "); native_* = cuDNN disabled; best = smallest total",
        "cudnn_depthwise_kernel": cudnn_depthwise_mode(),
        "floors": {"fp32_fma_flops": FP32_FMA_FLOPS, "half_fma_flops": HALF_FMA_FLOPS,
                   "memory_bytes_per_s": MEMORY_BYTES_PER_S, "source": "H100 SXM datasheet rates; measured copy"},
    }


def benchmark(configs: Sequence[Config], timer: Timer, timer_name: str, device: torch.device,
              with_torch: bool = True, anchors: Anchors | None = None, command: str = "",
              **extra: Any) -> dict[str, Any]:
    """The whole record: schema, kind, environment, the command, the method (with `extra`), one row per config."""
    start = time.perf_counter()
    rows = run(configs, timer, device, with_torch, anchors)
    return make_record("kernels", device, command,
                       {**method(timer_name), **extra, "wall_s": round(time.perf_counter() - start, 1)}, rows)


TABLE_HEADER = ("shape", "k", "dtype", "fwd", "dgrad", "wgrad", "total", "torch", "speedup", "MegEngine", "xMegE",
                "%FMA", "note")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}" if value < 10 else f"{value:.1f}"


def _times(times: dict[str, float] | None, key: str) -> float | None:
    return times.get(key) if _ok(times) else None


def table_row(result: dict[str, Any]) -> list[str]:
    """One table row of a result, numbers formatted, failures in the note column."""
    lk, best, mge = result.get("lkcnn"), best_torch(result), result["anchors"]["megengine"]
    speedup, vs_mge, fma = ((result[key] or {}).get("total") for key in
                            ("speedup_vs_torch", "speedup_vs_megengine", "fraction_of_fma_floor"))
    notes = [f"{where}: {times['error']}" for where, times in (("config", result), ("lkcnn", lk)) if times and
             "error" in times]
    torch_result = result.get("torch")
    if torch_result and best is None:
        notes.append(f"torch: {next(iter(torch_result['variants'].values()))['error']}")
    note = "; ".join(note.splitlines()[0] for note in notes)
    layout = " CL" if result.get("lkcnn_layout") == "channels_last" else ""
    return [result["shape"] + layout, str(result["k"]), result["dtype"], *(_ms(_times(lk, key)) for key in TOTAL_KEYS),
            _ms(_times(best, "total")), "-" if speedup is None else f"{speedup:.2f}x", _ms(_times(mge, "total")),
            "-" if vs_mge is None else f"{vs_mge:.2f}x", "-" if fma is None else f"{100 * fma:.1f}%",
            note[:100] + ("..." if len(note) > 100 else "")]


def format_table(results: Sequence[dict[str, Any]]) -> str:
    """The compact table: lkcnn per pass and total, PyTorch best total, speedup, MegEngine anchor, % of FMA floor."""
    rows = [list(TABLE_HEADER)] + [table_row(r) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(TABLE_HEADER))]
    lines = ["  ".join(cell.ljust(width) if i in (0, 2, len(widths) - 1) else cell.rjust(width)
                       for i, (cell, width) in enumerate(zip(row, widths))).rstrip() for row in rows]
    legend = ("ms, median. fwd/dgrad/wgrad/total: lkcnn; torch: best PyTorch variant total, same run; speedup: "
              "torch/lkcnn; MegEngine: H100 anchor total; xMegE: MegEngine/lkcnn; %FMA: FMA floor/lkcnn total")
    return "\n".join([legend, lines[0], "-" * len(lines[0]), *lines[1:]])


def plot(results: Sequence[dict[str, Any]], path: str | Path) -> None:
    """Time per iteration vs kernel size at the seed shape, one panel per dtype: lkcnn, PyTorch best, MegEngine
    (H100 anchor) and the FMA floor. Drawn with matplotlib's Agg canvas (no display needed)."""
    from matplotlib.figure import Figure  # Figure.savefig renders through Agg for .png; no pyplot state

    seed = [r for r in results if r["shape"] == "seed"]
    if not seed:
        raise ValueError("--plot draws the seed shape over kernel sizes; include --shapes seed")
    dtypes = [d for d in DTYPES if any(r["dtype"] == d for r in seed)]
    fig = Figure(figsize=(5 * len(dtypes), 4.2), layout="constrained")
    axes = fig.subplots(1, len(dtypes), sharey=True, squeeze=False)[0]
    curves = (("lkcnn", "o-", lambda r: r.get("lkcnn")), ("PyTorch best", "s--", best_torch),
              ("MegEngine (H100 anchor)", "^-.", lambda r: r["anchors"]["megengine"]),
              ("FMA floor", "k:", lambda r: r["floor_ms"]["fma"]))
    for ax, dtype in zip(axes, dtypes):
        rows = sorted((r for r in seed if r["dtype"] == dtype), key=lambda r: r["k"])
        for label, style, times in curves:
            points = [(r["k"], t) for r in rows if (t := _times(times(r), "total")) is not None]
            if points:
                ax.plot(*zip(*points), style, label=label)
        ax.set(title=f"{dtype}, {'x'.join(map(str, rows[0]['nchw']))}", xlabel="kernel size", yscale="log",
               xticks=[r["k"] for r in rows])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    axes[0].set_ylabel("fwd + dgrad + wgrad (ms)")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


# ----------------------------------------------------------------------------------------------- CLI
def _csv(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        try:
            return [kind(item) for item in text.split(",") if item.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, e.g. 9,31; got {text!r}") from None
    return parse


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lkcnn-bench", description="Time lkcnn's depthwise-conv passes against PyTorch's best backend on a GPU.",
        epilog="The other benchmarks: lkcnn-bench branches (the blocks' small and dilated branches), blocks (each "
               "stage's block trained alone), e2e (training steps of whole networks; --compare with a timm peer), "
               "rates (a compiled step's Triton kernels against the copy rate), loader (the input pipeline), app "
               "(where the training app's step time goes), deploy8 (8-bit deployed inference), codegen (inductor's "
               "code for a training step, without a GPU); each takes --help.")
    parser.add_argument("--shapes", type=_csv(str.strip),
                        help=f"comma list of {','.join(SHAPES)} or NxCxHxW shapes (default the set's five)")
    parser.add_argument("--ks", type=_csv(int),
                        help="comma list of kernel sizes to keep (default all of the shape; NxCxHxW shapes: these)")
    parser.add_argument("--dtypes", type=_csv(str.strip), help=f"comma list of {','.join(DTYPES)} (default all)")
    parser.add_argument("--quick", action="store_true", help="seed k9 and k31, s1..s4 at their large kernel only")
    parser.add_argument("--json", default="bench.json", help="where to write the record (default bench.json)")
    parser.add_argument("--plot", help="PNG of time vs kernel size at the seed shape (default: no plot)")
    parser.add_argument("--anchors", default=str(DEFAULT_ANCHORS),
                        help="H100 anchors JSON with MegEngine's times ('' for none; default %(default)s)")
    parser.add_argument("--no-torch", action="store_true", help="time lkcnn only (no PyTorch variants)")
    parser.add_argument("--channels-last", action="store_true",
                        help="time lkcnn's passes on channels_last tensors (the training app's layout; rows marked CL)")
    return parser


def _load_extension() -> str | None:
    """Build lkcnn's extension before timing; its file name carries the hash of the sources that were measured."""
    print("lkcnn-bench: loading lkcnn's CUDA extension (a cold build takes one to two minutes) ...", file=sys.stderr)
    try:
        return build.load().__file__
    except build.BuildError as err:
        print(f"lkcnn-bench: {err}. Every lkcnn column will carry this error; PyTorch is still timed.",
              file=sys.stderr)
        return None


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the flags, check for a GPU, benchmark, write JSON (and a plot), print the table last."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        configs = select_configs(args.shapes, args.ks, args.dtypes, args.quick, args.channels_last)
    except ValueError as err:
        parser.error(str(err))
    try:
        anchors_device, anchors = load_anchors(args.anchors) if args.anchors else ("", {})
    except (FileNotFoundError, ValueError) as err:
        sys.exit(f"lkcnn-bench: {err}")
    if not torch.cuda.is_available():
        sys.exit(f"lkcnn-bench: no CUDA device is visible (torch {torch.__version__}, CUDA build "
                 f"{torch.version.cuda}). The benchmark times GPU kernels and never times on the CPU: run it on a "
                 f"machine with an NVIDIA GPU (check nvidia-smi and CUDA_VISIBLE_DEVICES).")
    set_conv_impl("cuda")  # the lkcnn columns must be lkcnn's kernels, never the fallback
    extension = _load_extension()
    timer_name, timer = gpu_timer()
    report = benchmark(configs, timer, timer_name, torch.device("cuda"), not args.no_torch, anchors,
                       command=command_line(sys.argv[1:] if argv is None else argv), lkcnn_extension=extension,
                       anchors_file={"path": args.anchors or None, "device": anchors_device})
    write_record(args.json, report)
    print(f"wrote {args.json} ({len(configs)} configs in {report['method']['wall_s']} s)")
    if args.plot:
        try:
            plot(report["rows"], args.plot)
            print(f"wrote {args.plot}")
        except ValueError as err:
            print(f"lkcnn-bench: no plot: {err}")
    print(format_table(report["rows"]))

