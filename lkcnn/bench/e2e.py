"""`python -m lkcnn.bench e2e`: whole-network training throughput (bf16 autocast, AdamW) on one GPU: lkcnn's kernels
vs PyTorch's convolution vs the same net with 3x3 kernels, and against other timm networks (e.g. convnext_base).
The numbers behind docs/performance.md's end-to-end table. A bare loop: the Hydra/Lightning route is
`python train.py model=replknet31b data=synthetic ...`, and this needs neither.

    python -m lkcnn.bench e2e [--models replknet31b,convnext_base] [--batch 64] [--steps 20] [--channels-last]
                              [--compile] [--cuda-graph] [--repeat 3] [--json FILE]
    python -m lkcnn.bench e2e --profile --runs cuda,torch3 --steps 5 [--channels-last]   # GPU time per kernel
    python -m lkcnn.bench e2e --compare convnext_base [--json FILE]   # compiled: vs the peer and the 3x3 twin
    python -m lkcnn.bench e2e --runs auto --compile --channels-last --inductor combo_kernels=False   # A/B
    python -m lkcnn.bench e2e --models convnext_base,unireplknet_b --runs auto,torch --compile --channels-last
                              --warm-cache --isolate   # compiled side by side first, then timed one process each
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import timm
import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor.runtime.cache_dir_utils import cache_dir

from lkcnn import timing
from lkcnn.bench.profile import by_category, kernel_table, profile_kernels
from lkcnn.bench.record import command_line, make_record, write_record
from lkcnn.compile import AUTO_COMPILE_MODE, INDUCTOR_SETTINGS, compile_model, network_settings, parse_settings
from lkcnn.models import NO_SMALL_KERNEL, list_models  # importing lkcnn registers the models
from lkcnn.layers import ReparamLargeKernelConv
from lkcnn.layers.unireplknet_blocks import DilatedReparamBlock
from lkcnn.ops import set_bn_gelu_kernels, set_branch_kernels, set_conv_impl, set_grn_kernels, use_conv_impl

COMPILE_MODE = AUTO_COMPILE_MODE  # the training app's module.compile=auto on a GPU
SMALL = dict(kernel_sizes=3, small_kernel=NO_SMALL_KERNEL)  # RepLKNet's keywords for its 3x3 twin
VARIANTS = {  # --runs key: (label, conv implementation, model keywords)
    "cuda": ("lkcnn kernels, every depthwise conv", "cuda", {}),
    # the default dispatch: large kernels and the blocks' small branches (channels_last) on lkcnn's kernels, other
    # kernels under AUTO_MIN_KERNEL on cuDNN
    "auto": ("lkcnn 'auto' (default dispatch)", "auto", {}),
    # the same with the blocks' small branches on cuDNN (one nn.Conv2d each): the branch kernels' A/B
    "auto_cudnn_small": ("lkcnn 'auto', small branches on cuDNN", "auto:no_branch_kernels", {}),
    # the same with UniRepLKNet's GELU + GRN as torch ops (inductor's kernels): the GELU + GRN kernels' A/B
    "auto_torch_grn": ("lkcnn 'auto', GELU + GRN as torch ops", "auto:no_grn_kernels", {}),
    # the same with RepLKNet's FFN BatchNorm + GELU as torch ops: the BatchNorm + GELU kernels' A/B
    "auto_torch_bn_gelu": ("lkcnn 'auto', BatchNorm + GELU as torch ops", "auto:no_bn_gelu_kernels", {}),
    # the same dispatch with cuDNN autotuning its convolutions (cudnn.benchmark; else its heuristics pick)
    "auto_cudnn_benchmark": ("lkcnn 'auto', cudnn.benchmark", "auto:cudnn_benchmark", {}),
    "torch": ("PyTorch conv", "torch", {}),
    "cuda3": ("lkcnn kernels, 3x3, no small branch", "cuda", SMALL),
    # the 3x3 twin as a user trains it: its 3x3 convs on cuDNN (under AUTO_MIN_KERNEL), its FFN's BatchNorm + GELU on
    # lkcnn's kernels like the network it is compared with (--compare's twin)
    "auto3": ("lkcnn 'auto', 3x3, no small branch", "auto", SMALL),
    "torch3": ("PyTorch conv, 3x3, no small branch", "torch", SMALL),
}
Job = tuple[str, str, dict[str, Any]]  # (timm name, conv implementation[:flag...], model keywords)
Samples = dict[str, list[float]]  # by variant label: one value per round


# ----------------------------------------------------------------------------------------------- one variant
def setup(name: str, impl: str, batch: int, channels_last: bool, compile: str | None, cuda_graph: bool = False,
          inductor: dict[str, Any] | None = None, regional: bool = False,
          **model_kwargs) -> tuple[Callable[[], None], tuple]:
    """(train step, its state) for one variant: network `name`, AdamW, synthetic batch, bf16 autocast; `compile` a
    torch.compile mode ("default" for torch's) or None for eager, with lkcnn.compile's settings and `inductor`'s
    over them, the whole network as one graph or, with `regional`, block by block. With cuda_graph, the whole step
    (forward, backward, optimizer) is captured once and each step replays it: no host time per step, so the GPU's own
    time per step is what is measured."""
    conv, *flags = impl.split(":")
    set_conv_impl(conv)
    set_branch_kernels("no_branch_kernels" not in flags)
    set_grn_kernels("no_grn_kernels" not in flags)
    set_bn_gelu_kernels("no_bn_gelu_kernels" not in flags)
    torch.backends.cudnn.benchmark = "cudnn_benchmark" in flags
    model = timm.create_model(name, **model_kwargs).cuda()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    if compile:  # in place, as the training app compiles (peers too); the warm-up steps absorb the compilation
        compile_model(model, compile, inductor, regional)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05, fused=True, capturable=cuda_graph)
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device="cuda")

    def step() -> None:
        if compile and regional:  # CUDA-graph trees replay a region's graph on their fast path only when told a
            torch.compiler.cudagraph_mark_step_begin()  # step began: each forward runs with the last one's backward
        # autocast's weight-cast cache must be off under capture (cached casts would outlive the graph's pool)
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=not cuda_graph):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    if not cuda_graph:
        return step, (model, opt, x, y)
    side = torch.cuda.Stream()  # warm-up on a side stream, as torch.cuda.graph requires
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        step()
    return graph.replay, (model, opt, x, y, graph)


def time_steps(step: Callable[[], None], batch: int, steps: int, warmup: int) -> dict[str, float]:
    """images/s and ms per step over `steps` steps after `warmup` (the first among them), wall time with the GPU
    synchronized, and the first step's seconds: a compiled network compiles there, so that is what an inductor
    setting costs at compile time (cold, or from torch's caches)."""
    first_s = timing.mean_ms(step, 1, wall=True) / 1e3
    step_ms = timing.mean_ms(step, steps, max(warmup - 1, 0), wall=True)
    return {"images_per_s": batch / step_ms * 1e3, "step_ms": step_ms, "first_step_s": first_s}


def run_variant(name: str, impl: str, batch: int, steps: int, warmup: int, channels_last: bool, compile: str | None,
                cuda_graph: bool = False, inductor: dict[str, Any] | None = None, regional: bool = False,
                **model_kwargs) -> tuple[float, float]:
    """Training images/s of one variant (`time_steps`) and its first step's seconds."""
    step, state = setup(name, impl, batch, channels_last, compile, cuda_graph, inductor, regional, **model_kwargs)
    timed = time_steps(step, batch, steps, warmup)
    del step, state
    release()
    return timed["images_per_s"], timed["first_step_s"]


def release() -> None:
    """Hand a variant's memory back: a variant run after PyTorch's large-kernel convolution (large workspaces) measured
    22% slower on its fragmented cache than in a fresh process; a compiled one also holds CUDA-graph pools."""
    torch._dynamo.reset()
    torch.cuda.empty_cache()


def step_report(name: str, impl: str, batch: int, steps: int, warmup: int, channels_last: bool, compile: str | None,
                cuda_graph: bool = False, profile_steps: int = 5, inductor: dict[str, Any] | None = None,
                regional: bool = False, on_timed: Callable[[dict[str, float]], None] | None = None,
                **model_kwargs) -> dict[str, Any]:
    """One variant from one setup (a compiled one compiles once): its images/s (wall time of `steps` steps after
    `warmup`, handed to `on_timed` before the profile) and its GPU time per step by cost category over
    `profile_steps` more steps under torch.profiler."""
    step, state = setup(name, impl, batch, channels_last, compile, cuda_graph, inductor, regional, **model_kwargs)
    timed = time_steps(step, batch, steps, warmup)
    if on_timed:
        on_timed(timed)
    kernels = profile_kernels(step, profile_steps)
    del step, state
    release()
    return {**timed, "gpu_ms_by_category": by_category(kernels, profile_steps),
            "gpu_busy_ms": sum(e.self_device_time_total for e in kernels) / 1e3 / profile_steps}


def kernel_profile(name: str, impl: str, batch: int, steps: int, warmup: int, channels_last: bool, compile: str | None,
                   cuda_graph: bool = False, top: int = 30, inductor: dict[str, Any] | None = None,
                   regional: bool = False, **model_kwargs) -> str:
    """Where a variant's step time goes: GPU time per kernel over `steps` steps (torch.profiler, busiest first) and per
    cost category (`lkcnn.bench.profile.CATEGORIES`), and the GPU's busy time per step against the wall time per step
    (a gap is host time the GPU waits for)."""
    from torch.profiler import ProfilerActivity, profile

    step, state = setup(name, impl, batch, channels_last, compile, cuda_graph, inductor, regional, **model_kwargs)
    for _ in range(warmup):
        step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall_ms = timing.mean_ms(step, steps, wall=True)
    events = prof.key_averages()
    del step, state
    release()
    table = events.table(sort_by="self_device_time_total", row_limit=top, max_name_column_width=70)
    # GPU work only: operator rows carry their kernels' time too, and the optimizer's annotation spans its kernels
    ms_by_category = by_category(kernel_table(events), steps)
    categories = "\n".join(f"  {label:<45s} {ms:7.2f}" for label, ms in ms_by_category.items())
    return (f"{table}\nGPU ms per step by category:\n{categories}\n"
            f"per step: wall {wall_ms:.1f} ms, GPU busy {sum(ms_by_category.values()):.1f} ms (kernels, summed)")


# ----------------------------------------------------------------------------------------------- floors
# How many times a training step moves the output (S bytes) of a normalization or activation layer at the least, when
# the GEMMs and convolutions around it cannot take it in (cuBLAS's, cuDNN's and lkcnn's kernels have no such prologue
# or epilogue) and no kernel holds a tensor across a grid-wide barrier:
# - BatchNorm in training: 3S forward (the statistics read S; the apply reads S and writes S), 5S backward (the
#   reduction reads dy and x; the apply reads both and writes dx). n BatchNorms whose outputs a block sums (its
#   parallel branches) share the apply: (5n + 3)S.
# - LayerNorm: 2S forward, 3S backward (a pixel's statistics come with its one read).
# - UniRepLKNet's GRN (a per-channel L2 norm over the map, then an apply): as a BatchNorm.
# - An activation between two GEMMs (ConvNeXt's GELU): 2S forward, 3S backward. Right before or after a
#   normalization it is part of that normalization's passes.
NORM_PASSES = {"BatchNorm": 8, "LayerNorm": 5, "GRN": 8, "activation": 5}
_NORMS = ("BatchNorm", "LayerNorm", "GRN")
_NO_OPS = (nn.Identity, nn.Dropout, nn.Flatten)  # leaves that move no data between a norm and its activation


def _norm_kind(module: nn.Module) -> str | None:
    if isinstance(module, nn.modules.batchnorm._BatchNorm):  # timm's BatchNormAct2d too
        return "BatchNorm"
    if isinstance(module, nn.LayerNorm) or "LayerNorm" in type(module).__name__:  # timm's LayerNorm2d too
        return "LayerNorm"
    if "GRN" in type(module).__name__ or "GlobalResponseNorm" in type(module).__name__:
        return "GRN"
    if isinstance(module, (nn.GELU, nn.ReLU, nn.SiLU)) or type(module).__name__ in ("GELU", "GELUTanh"):
        return "activation"
    return None


def norm_floor_gb(model: nn.Module, batch: int, image: int = 224, itemsize: int = 2) -> dict[str, float]:
    """The least GB a training step of `model` (batch `batch`, `itemsize`-byte activations) moves in its
    normalization and activation passes (NORM_PASSES), by kind, from one forward of two images on the model's
    device, in eval mode (the model's statistics stay as they were) and on PyTorch's convolutions."""
    group_of = {id(bn): id(block) for block in model.modules()
                if isinstance(block, (ReparamLargeKernelConv, DilatedReparamBlock))
                for bn in block.modules() if _norm_kind(bn) == "BatchNorm"}
    scale = itemsize * batch / 2 / 1e9  # per image of the two
    gb: dict[str, float] = {}
    groups: dict[int, list[float]] = {}  # summed BatchNorms: [count, GB of one output]
    state: dict[str, Any] = {"previous": None, "pending": 0.0}  # pending: an activation's GB unless a norm follows

    def add(kind: str, value: float) -> None:
        gb[kind] = gb.get(kind, 0.0) + value

    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        kind = _norm_kind(module)
        if kind is None and isinstance(module, _NO_OPS):
            return
        if kind not in _NORMS:  # the activation before this layer was not a norm's; before a norm, it is part of it
            add("activation", state["pending"])
        state["pending"] = 0.0
        if kind == "activation" and state["previous"] not in _NORMS:
            state["pending"] = NORM_PASSES[kind] * out.numel() * scale
        elif id(module) in group_of:
            group = groups.setdefault(group_of[id(module)], [0, out.numel() * scale])
            group[0] += 1
        elif kind in _NORMS:
            add(kind, NORM_PASSES[kind] * out.numel() * scale)
        state["previous"] = kind

    def hooked(module: nn.Module) -> list[nn.Module]:  # a norm, or a leaf outside any norm
        children = list(module.children())
        if _norm_kind(module) in _NORMS or not children:
            return [module]
        return [m for child in children for m in hooked(child)]
    handles = [m.register_forward_hook(hook) for m in hooked(model)]
    training = model.training
    parameter = next(model.parameters(), None)
    try:
        with torch.no_grad(), use_conv_impl("torch"):
            model.eval()(torch.randn(2, 3, image, image, device=None if parameter is None else parameter.device))
    finally:
        model.train(training)
        for h in handles:
            h.remove()
    add("activation", state["pending"])
    for count, size in groups.values():
        add("BatchNorm", (5 * count + 3) * size)
    return {kind: value for kind, value in gb.items() if value}


def copy_bandwidth_gbps(gib: int = 1) -> float:
    """This GPU's device-to-device copy rate, GB/s counting bytes read and written (median of 20 copies)."""
    src = torch.empty(gib << 28, device="cuda")  # gib GiB of float32
    dst = torch.empty_like(src)
    ms = timing.median_ms(lambda: dst.copy_(src), reps=20, warmup=3)
    return 2 * src.numel() * 4 / ms / 1e6


# ----------------------------------------------------------------------------------------------- the run
def check_models(parser: argparse.ArgumentParser, option: str, names: Sequence[str]) -> None:
    """parser.error (one line, exit 2) naming those of an option's `names` that timm does not know."""
    if missing := [m for m in names if not timm.is_model(m)]:
        parser.error(f"{option}: {missing} are not timm model names (lkcnn's are registered by `import lkcnn`)")


def jobs(models: Sequence[str], runs: Sequence[str]) -> dict[str, Job]:
    """The variants to time, by label: each of `runs` for lkcnn's models (the 3x3 ones for RepLKNet only), one run
    on PyTorch's convolutions for any other timm network (a peer)."""
    lkcnn_models = set(list_models())
    out: dict[str, Job] = {}
    for model in models:
        if model not in lkcnn_models:
            out[f"{model} (timm)"] = (model, "torch", {})
            continue
        for key in runs:
            if key.endswith("3") and not model.startswith("replknet"):  # the 3x3 variant takes RepLKNet's keywords
                continue
            label, impl, kwargs = VARIANTS[key]
            out[f"{model}: {label}"] = (model, impl, kwargs)
    return out


def measure(variants: dict[str, Job], repeat: int, on_variant: Callable[[Samples, Samples], None] | None = None,
            isolated: Callable[[str], tuple[float, float]] | None = None, **common) -> tuple[Samples, Samples]:
    """images/s of every variant and its first steps' seconds, `repeat` rounds of all variants in turn: single runs
    of one variant spread by 20% and more between calls, so a ratio is read from medians of interleaved runs.
    `isolated(label)`, if given, times a variant instead of this process (`run_isolated`).
    `on_variant(samples, first_steps)` runs after each variant, with what has been measured so far."""
    samples: Samples = {label: [] for label in variants}
    first_steps: Samples = {label: [] for label in variants}
    for _ in range(repeat):
        for label, (model, impl, kwargs) in variants.items():
            ips, first_s = isolated(label) if isolated else run_variant(model, impl, **common, **kwargs)
            samples[label].append(ips)
            first_steps[label].append(first_s)
            # printed as it finishes: kept if a later variant fails
            _progress(label, {"images_per_s": ips, "first_step_s": first_s})
            if on_variant:
                on_variant(samples, first_steps)
    return samples, first_steps


def compare(models: Sequence[str], peer: str, on_rows: Callable[[list[dict[str, Any]]], None] | None = None,
            **common) -> list[dict[str, Any]]:
    """`--compare`: one row each for `models` under the default dispatch, RepLKNet's 3x3 twin and `peer`, in that
    order, with images/s, the ratio to the peer and to the network's 3x3 twin, and GPU ms per step by category. The
    peer is measured first, so each network's progress line carries its ratio, also in a run stopped partway; a
    line prints once a network is timed, before its profile, and lines at each network's start and after its
    profile, with the seconds since the run began: where a run that ran out of time spent it. `on_rows` gets the
    rows measured so far after each network's profile."""
    _log(peer, "building and compiling")
    peer_row = {"network": peer, "model": peer, "variant": "timm",
                **step_report(peer, "torch", channels_last=True, on_timed=functools.partial(_progress, peer),
                              **common),
                "norm_floor_gb": norm_floor_gb(timm.create_model(peer), common["batch"])}
    _log(peer, "profiled")
    rows: list[dict[str, Any]] = []
    if on_rows:
        on_rows(_with_ratios(rows, peer_row))
    for model in models:
        for key in ("auto", "auto3"):
            if key == "auto3" and not model.startswith("replknet"):
                continue
            _, impl, kwargs = VARIANTS[key]
            net = timm.create_model(model, **kwargs)
            label = model if key == "auto" else f"{model} 3x3"
            timed = functools.partial(_progress, label, peer=peer_row)
            _log(label, "building and compiling")
            rows.append({"network": label, "model": model, "variant": key,
                         **step_report(model, impl, channels_last=True, on_timed=timed, **common, **kwargs),
                         "norm_floor_gb": norm_floor_gb(net, common["batch"]),
                         "network_inductor_settings": network_settings(net)})
            _log(label, "profiled")
            if on_rows:
                on_rows(_with_ratios(rows, peer_row))
    return _with_ratios(rows, peer_row)


def _with_ratios(rows: list[dict[str, Any]], peer_row: dict[str, Any]) -> list[dict[str, Any]]:
    """The networks' rows and the peer's last, each with its ratio to the peer and a network's to its 3x3 twin."""
    out = [dict(row) for row in (*rows, peer_row)]
    twins = {row["model"]: row["images_per_s"] for row in out if row["variant"] == "auto3"}
    for row in out:
        row[f"ratio_to_{peer_row['network']}"] = row["images_per_s"] / peer_row["images_per_s"]
        if row["variant"] == "auto" and row["model"] in twins:
            row["ratio_to_3x3"] = row["images_per_s"] / twins[row["model"]]
    return out


_STARTED = time.monotonic()


def _log(network: str, text: str) -> None:
    """A progress line on stderr, flushed (kept if the run is stopped), with the seconds since lkcnn.bench started."""
    print(f"lkcnn-bench e2e [{time.monotonic() - _STARTED:.0f} s]: {network}: {text}", file=sys.stderr, flush=True)


def _progress(network: str, timed: dict[str, float], peer: dict[str, Any] | None = None) -> None:
    ratio = f" ({timed['images_per_s'] / peer['images_per_s']:.2f}x {peer['network']})" if peer else ""
    _log(network, f"{timed['images_per_s']:.1f} images/s{ratio}, first step {timed['first_step_s']:.1f} s")


def compare_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """`--compare`'s printout: images/s and ratios per network, then GPU ms per step by category."""
    peer = args.compare
    lines = [f"batch {args.batch}, 224 px, bf16 autocast, fused AdamW, {regime(args)}, {torch.cuda.get_device_name()}",
             f"{'network':24s} {'img/s':>8s} {'x ' + peer:>18s} {'x own 3x3':>10s} {'step ms':>8s} {'GPU busy':>9s}"]
    for row in rows:
        twin = f"{row['ratio_to_3x3']:.2f}x" if "ratio_to_3x3" in row else "-"
        lines.append(f"{row['network']:24s} {row['images_per_s']:8.1f} {row[f'ratio_to_{peer}']:17.2f}x "
                     f"{twin:>10s} {row['step_ms']:8.1f} {row['gpu_busy_ms']:9.1f}")
    categories = list(dict.fromkeys(c for row in rows for c in row["gpu_ms_by_category"]))
    lines += ["", f"{'GPU ms per step':44s}" + "".join(f"{row['network']:>20s}" for row in rows)]
    for cat in categories:
        cells = (row["gpu_ms_by_category"].get(cat) for row in rows)
        lines.append(f"{cat:44s}" + "".join(f"{c:20.2f}" if c is not None else f"{'-':>20s}" for c in cells))
    if "copy_gbps" in args and all("norm_floor_gb" in row for row in rows):
        label = f"norm/activation floor ({args.copy_gbps / 1e3:.1f} TB/s)"
        lines.append(f"{label:44s}" + "".join(f"{sum(row['norm_floor_gb'].values()) / args.copy_gbps * 1e3:20.2f}"
                                               for row in rows))
    return "\n".join(lines)


def regime(args: argparse.Namespace) -> str:
    """The step's mode as one phrase: compiled (with any --inductor settings), channels_last, CUDA graph, or eager."""
    settings = ", ".join(f"{k}={v}" for k, v in (getattr(args, "inductor", None) or {}).items())
    regional = ", block by block" if getattr(args, "regional", False) else ""
    compiled = f"compiled ({args.compile}{regional}{', ' + settings if settings else ''})"
    modes = [name for name, on in ((compiled, args.compile), ("channels_last", args.channels_last),
                                   ("CUDA graph", args.cuda_graph)) if on]
    return ", ".join(modes) or "eager"


def medians(samples: Samples) -> dict[str, float]:
    """Each variant's median images/s over its rounds."""
    return {label: statistics.median(values) for label, values in samples.items()}


def table(samples: Samples, first_steps: Samples, args: argparse.Namespace) -> str:
    """The printed result: one line per variant, its median images/s, its ratio to the first variant's and its
    first steps' seconds (a compiled variant's compile)."""
    ips_by_label = medians(samples)
    first = next(iter(ips_by_label.values()))
    lines = [f"batch {args.batch}, 224px, bf16 autocast, AdamW, {regime(args)}, {torch.cuda.get_device_name()}"]
    for label, ips in ips_by_label.items():
        each = f"  (runs: {', '.join(f'{v:.1f}' for v in samples[label])})" if args.repeat > 1 else ""
        lines.append(f"{label:56s} {ips:8.1f} img/s  {ips / first:5.2f}x  first step "
                     f"{', '.join(f'{s:.0f}' for s in first_steps[label])} s{each}")
    return "\n".join(lines)


def record(samples: Samples, first_steps: Samples, variants: dict[str, Job],
           args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    """The `train_e2e` benchmark record: one row per variant measured so far (network, variant, median images/s,
    ratio, runs, the runs' first steps in seconds)."""
    ips_by_label = medians({label: values for label, values in samples.items() if values})
    first = next(iter(ips_by_label.values()))
    settings = {}  # per network: its class's settings (the variants' kwargs do not change the class)
    if args.compile:
        with torch.device("meta"):  # without building the weights
            settings = {name: network_settings(timm.create_model(name)) for name in {v[0] for v in variants.values()}}
    rows = [{"network": variants[label][0], "variant": label.split(": ", 1)[-1], "images_per_s": ips,
             "ratio_to_first": ips / first, "runs": samples[label], "first_step_s": first_steps[label],
             "network_inductor_settings": settings.get(variants[label][0])} for label, ips in ips_by_label.items()]
    method = {"timer": "time.perf_counter over --steps after --warmup, CUDA synchronized",
              "units": "training images/s (forward, backward, AdamW step)", "batch": args.batch,
              "regime": regime(args), "dtype": "bf16 autocast",
              "lkcnn_inductor_settings": INDUCTOR_SETTINGS if args.compile else None}
    if getattr(args, "isolate", False):
        method["isolate"] = "each variant timed in a fresh process of its own, one after another"
    if getattr(args, "warm_cache_s", None) is not None:
        method["warm_cache"] = (f"every variant compiled side by side into torch's caches first "
                                f"({args.warm_cache_s:.0f} s); first_step_s is the compile from those caches")
    return make_record("train_e2e", torch.device("cuda"), command_line(["e2e", *argv]), method, rows)


# ----------------------------------------------------------------------------------------------- processes
# Variants in processes of their own. In one process a variant timed after other networks can run slower than in a
# fresh one (UniRepLKNet-B compiled: 1191 images/s after UniRepLKNet-S's two variants, 1496 alone, one H200 call), so
# --isolate times each in its own; and a cold compile is mostly one CPU core's work (1.5-3.5 minutes a network on a
# 16-core GPU machine), so --warm-cache compiles them all side by side into torch's caches first, and each timed run
# compiles from those in seconds: several compiled networks then fit one GPU call. The timed steps run the same
# generated code either way. But inductor times the launch configurations of its Triton kernels
# (max_autotune_pointwise) at their first launch and caches the picks beside them; side by side, those timings share
# the GPU and the CPUs with the other compiles (RepLKNet-31B trained at 1607.6 images/s on such picks and at 1653.6 on
# its own, one H200 each), so --warm-cache drops the picks it made and each timed run times its own, alone.
def variant_selectors(models: Sequence[str], runs: Sequence[str]) -> dict[str, tuple[str, str]]:
    """By variant label (as `jobs` names it): the --models and --runs values that select that variant alone."""
    return {label: (model, key) for model in models for key in runs for label in jobs([model], [key])}


def variant_argv(args: argparse.Namespace, inductor: str, model: str, key: str, steps: int, warmup: int) -> list[str]:
    """The command line of `lkcnn.bench e2e` for one variant, in this run's regime."""
    argv = [sys.executable, "-m", "lkcnn.bench", "e2e", "--models", model, "--runs", key, "--batch", str(args.batch),
            "--steps", str(steps), "--warmup", str(warmup)]
    argv += ["--compile", args.compile] if args.compile else []
    argv += ["--channels-last"] * args.channels_last + ["--cuda-graph"] * args.cuda_graph
    argv += ["--regional"] * args.regional
    return argv + (["--inductor", inductor] if inductor else [])


def warm_cache(args: argparse.Namespace, inductor: str, selectors: dict[str, tuple[str, str]]) -> float:
    """Compile every variant (`variant_selectors`) at once into torch's caches, each in its own process taking two
    steps; the seconds."""
    started = time.time()  # also the age of the launch picks this warm-up writes
    procs: dict[str, tuple[subprocess.Popen, Any]] = {}
    with contextlib.ExitStack() as logs:
        for label, (model, key) in selectors.items():
            log = logs.enter_context(tempfile.TemporaryFile("w+"))  # not a pipe: a full pipe would stall the compile
            procs[label] = subprocess.Popen(variant_argv(args, inductor, model, key, steps=1, warmup=1), stdout=log,
                                            stderr=subprocess.STDOUT, text=True), log
        failed = [label for label, (proc, _) in procs.items() if proc.wait()]
        for label in failed:
            log = procs[label][1]
            log.seek(0)
            print(f"== --warm-cache: compiling {label} failed; its output ends:\n{log.read()[-3000:]}",
                  file=sys.stderr)
    if failed:
        sys.exit(f"lkcnn-bench e2e --warm-cache: {len(failed)} of {len(procs)} variants failed to compile (above)")
    seconds = time.time() - started
    dropped = drop_launch_picks(since=started)
    print(f"compiled {len(procs)} variants side by side into torch's caches in {seconds:.0f} s (dropped the "
          f"{dropped} launch configurations they picked under contention: each timed run picks its own)", flush=True)
    return seconds


def drop_launch_picks(since: float) -> int:
    """Delete the launch-configuration picks (inductor's `*.best_config` files) written into inductor's cache since
    `since` (a `time.time()`); how many. Earlier picks, a user's own runs', stay."""
    root = pathlib.Path(cache_dir())
    picks = [p for p in root.rglob("*.best_config") if p.stat().st_mtime >= since] if root.is_dir() else []
    for path in picks:
        path.unlink(missing_ok=True)
    return len(picks)


def run_isolated(args: argparse.Namespace, inductor: str, selectors: dict[str, tuple[str, str]],
                 label: str) -> tuple[float, float]:
    """Images/s and first step's seconds of one variant (`label`, selected by `selectors[label]`), timed by
    `lkcnn.bench e2e` in a fresh process."""
    model, key = selectors[label]
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/record.json"
        proc = subprocess.run([*variant_argv(args, inductor, model, key, args.steps, args.warmup), "--json", path],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode:
            print(proc.stdout[-3000:], file=sys.stderr)
            sys.exit(f"lkcnn-bench e2e --isolate: {label} failed (exit {proc.returncode}; its output ends above)")
        with open(path) as f:
            row = json.load(f)["rows"][0]
    return row["images_per_s"], row["first_step_s"][0]


# ----------------------------------------------------------------------------------------------- CLI
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lkcnn-bench e2e", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=lambda s: s.split(","), default=["replknet31b"],
                        help="comma list of timm names; lkcnn's models run each of --runs, others run once")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--compile", nargs="?", const=COMPILE_MODE, default=None, metavar="MODE",
                        help=f"torch.compile the model in this mode (alone: {COMPILE_MODE}, as the training app "
                             "compiles on a GPU; 'default' for torch's default mode) with lkcnn's inductor settings "
                             "(lkcnn.compile), every network alike; use --warmup 3 or more")
    parser.add_argument("--regional", action="store_true",
                        help="with --compile: compile each block on its own (blocks of one structure share their "
                             "compiled code) instead of the whole network as one graph (lkcnn.compile.regions)")
    parser.add_argument("--compare", metavar="PEER", default=None,
                        help="the comparison table: each --models network as users run it (default dispatch), its "
                             "3x3 twin and the timm network PEER, images/s, ratios and GPU ms per step by category; "
                             "always channels_last and compiled (in --compile's mode if given, else the training app's)")
    parser.add_argument("--inductor", default="", metavar="KEY=VALUE[,...]",
                        help="torch._inductor.config settings over lkcnn's for every compiled network of this run "
                             "(an A/B is two runs in one call; realize_reads_threshold=4,combo_kernels=False,"
                             "max_autotune_pointwise=False is inductor's default)")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of all variants; medians are printed")
    parser.add_argument("--json", default="", help="write a train_e2e benchmark record here")
    parser.add_argument("--runs", type=lambda s: s.split(","), default=list(VARIANTS),
                        help=f"comma list of {','.join(VARIANTS)} (default all)")
    parser.add_argument("--warm-cache", action="store_true",
                        help="with --compile: first compile every variant at once, each in its own process, into "
                             "torch's caches; the timed runs then compile from them (several compiled networks in "
                             "one GPU call; first steps then show the warm-cache compile and the timed run's own "
                             "choice of inductor's launch configurations)")
    parser.add_argument("--isolate", action="store_true",
                        help="time each variant in a fresh process of its own, one after another (in one process a "
                             "network timed after others can run slower)")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="capture each variant's whole training step in a CUDA graph and replay it (GPU time only)")
    parser.add_argument("--profile", action="store_true",
                        help="instead of throughput: GPU time per kernel of each --runs variant over --steps steps")
    return parser


def main(argv: Sequence[str]) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    unknown = set(args.runs) - set(VARIANTS)
    if unknown:
        parser.error(f"--runs: unknown {sorted(unknown)}; choose from {','.join(VARIANTS)}")
    check_models(parser, "--models", args.models)
    if args.compare and not timm.is_model(args.compare):
        parser.error(f"--compare: {args.compare!r} is not a timm model name")
    if args.regional and not (args.compile or args.compare):
        parser.error("--regional is a way to compile: give it with --compile or --compare")
    if args.warm_cache and (not args.compile or args.compare):
        parser.error("--warm-cache compiles the --runs variants: give it with --compile and without --compare")
    if args.isolate and (args.compare or args.profile):
        parser.error("--isolate times the --runs variants: give it without --compare and --profile")
    inductor_text = args.inductor
    try:
        args.inductor = parse_settings(args.inductor)
    except ValueError as err:
        parser.error(f"--inductor: {err}")
    if not torch.cuda.is_available():
        sys.exit("lkcnn-bench e2e: no CUDA device is visible; it times training steps on a GPU")
    if args.compare:
        args.compile, args.channels_last = args.compile or COMPILE_MODE, True
        args.copy_gbps = copy_bandwidth_gbps()
        method = {"timer": "time.perf_counter over --steps after --warmup, CUDA synchronized; categories: "
                           "torch.profiler kernel times over 5 more steps",
                  "units": "training images/s (forward, backward, AdamW step); GPU ms per step",
                  "norm_floor_gb": "least GB of the normalization/activation passes per step, by kind "
                                   "(lkcnn.bench.e2e.NORM_PASSES)", "copy_gbps": args.copy_gbps,
                  "batch": args.batch, "regime": regime(args), "dtype": "bf16 autocast",
                  "lkcnn_inductor_settings": INDUCTOR_SETTINGS,
                  "order": "the peer first, then each network and its 3x3 twin"}

        def save(rows: list[dict[str, Any]]) -> None:  # after each network: kept by a run stopped at a time limit
            write_record(args.json, make_record("train_e2e_compare", torch.device("cuda"),
                                                command_line(["e2e", *argv]), method, rows))

        rows = compare(args.models, args.compare, on_rows=save if args.json else None, batch=args.batch,
                       steps=args.steps, warmup=args.warmup, compile=args.compile, inductor=args.inductor,
                       regional=args.regional)
        print(compare_table(rows, args))
        if args.json:
            print(f"wrote {args.json}")
        return
    variants = jobs(args.models, args.runs)
    selectors = variant_selectors(args.models, args.runs)
    args.warm_cache_s = warm_cache(args, inductor_text, selectors) if args.warm_cache else None
    common = dict(batch=args.batch, steps=args.steps, warmup=args.warmup, channels_last=args.channels_last,
                  compile=args.compile, cuda_graph=args.cuda_graph, inductor=args.inductor, regional=args.regional)
    if args.profile:
        for label, (model, impl, kwargs) in variants.items():
            print(f"== {label}")
            print(kernel_profile(model, impl, **common, **kwargs))
        return

    def save(samples: Samples, first_steps: Samples) -> None:  # after each variant: a run stopped by a GPU call's
        write_record(args.json, record(samples, first_steps, variants, args, argv))  # time limit keeps its rows

    isolated = functools.partial(run_isolated, args, inductor_text, selectors) if args.isolate else None
    samples, first_steps = measure(variants, args.repeat, on_variant=save if args.json else None, isolated=isolated,
                                   **common)
    print(table(samples, first_steps, args))
    if args.json:
        print(f"wrote {args.json}")
