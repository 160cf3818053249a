"""How lkcnn compiles a network for training: a torch.compile mode plus the inductor settings measured to pay.

One home for the training app (`module.compile`) and the benchmarks that stand in for it (`lkcnn.bench e2e`,
`lkcnn.bench blocks`), so that what is measured is what trains. Beside lkcnn.timing and lkcnn.errors: a utility of
the entry points and of lkcnn.training, which the benchmarks use without importing Lightning.
"""
from __future__ import annotations

import ast
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

# module.compile=auto on a GPU: CUDA graphs take the host's launch time out of the step; eager, RepLKNet-31B's step
# waits on the host (docs/performance.md, end to end)
AUTO_COMPILE_MODE = "reduce-overhead"

# Inductor stores a pointwise result that several kernels read once it reads more than `realize_reads_threshold`
# (4) inputs. A training-mode BatchNorm's output, (x - mean) * rstd * weight + bias, reads 5, so where the backward
# recomputes it for a GELU's gradient (RepLKNet's FFN) inductor wrote it out in fp32 and read it back twice: three
# passes of twice the bytes of its bf16 input, which the readers can recompute from that input instead. 5 lets
# them: RepLKNet-31B's compiled step +3.2% images/s on an H200 (docs/performance.md, "The current code against
# ConvNeXt-B").
# `combo_kernels` launches kernels of a graph that do not depend on each other as one: fewer of the short kernels a
# step of small normalization passes is made of. +2.5% images/s on RepLKNet-31B's compiled step on an H200, compile
# time unchanged (docs/performance.md, "The current code against ConvNeXt-B").
# `max_autotune_pointwise` times a few launch configurations of each pointwise and reduction kernel while compiling
# instead of taking its heuristic's one. Torch 2.11's heuristic gives every column reduction of a channels_last tensor
# (a BatchNorm's statistics and gradient sums) a single small configuration; timed, RepLKNet-31B's compiled step
# trained +3.1% images/s and UniRepLKNet-B's +1.4% on an H200 (docs/performance.md, "The current code against
# ConvNeXt-B"). The timings are kept in inductor's cache, so a second run of the same configuration skips them.
INDUCTOR_SETTINGS: dict[str, Any] = {
    "realize_reads_threshold": 5, "combo_kernels": True, "max_autotune_pointwise": True}


def network_settings(model: nn.Module | None) -> dict[str, Any]:
    """The inductor settings `model`'s class measured to pay for that network alone, over INDUCTOR_SETTINGS: its
    `inductor_settings` class attribute (none for other models). A setting that speeds one network and slows another
    stays with the network it speeds."""
    return dict(getattr(type(model), "inductor_settings", {}))


def _inductor_settings() -> dict[str, Any]:
    """This torch's inductor settings (imported here: inductor loads only when compiling)."""
    import torch._inductor.config as inductor_config

    return inductor_config.get_config_copy()


def compile_options(mode: str, model: nn.Module | None = None) -> dict[str, Any]:
    """torch.compile options for `mode` ("default", "reduce-overhead", ...) with those of lkcnn's INDUCTOR_SETTINGS
    and `model`'s network_settings that this torch's inductor has on top (torch.compile takes a mode or options, not
    both, and rejects an option it does not know). RuntimeError names the modes for an unknown one."""
    from torch._inductor import list_mode_options

    known = _inductor_settings()
    settings = {**INDUCTOR_SETTINGS, **network_settings(model)}
    return {**list_mode_options(mode), **{k: v for k, v in settings.items() if k in known}}


def stage_blocks(stage: nn.Module) -> list[nn.Module]:
    """The blocks of one of timm's `stages`: its `blocks` (ConvNeXt, RepLKNet) or else its children (UniRepLKNet)."""
    return list(stage.blocks if hasattr(stage, "blocks") else stage.children())


def regions(model: nn.Module) -> list[nn.Module]:
    """The parts of `model` that a regional compile compiles one by one: every block of every stage (timm's `stages`),
    and around them every other part that holds parameters or buffers (the stem, downsampling layers, the head; a
    ModuleList's items one by one). [model] for a network without `stages`."""
    stages = getattr(model, "stages", None)
    if not isinstance(stages, nn.Sequential | nn.ModuleList):
        return [model]

    def parts(module: nn.Module) -> list[nn.Module]:
        if module is stages:
            return [part for stage in stages for part in stage_parts(stage)]
        if isinstance(module, nn.ModuleList):
            return [part for child in module for part in parts(child)]
        has_state = next(module.parameters(), None) is not None or next(module.buffers(), None) is not None
        return [module] if has_state else []

    def stage_parts(stage: nn.Module) -> list[nn.Module]:
        blocks = stage_blocks(stage)
        container = getattr(stage, "blocks", None)
        if container is None:  # the stage is its blocks
            return blocks
        return [part for child in stage.children()
                for part in (blocks if child is container else parts(child))]
    return [part for child in model.children() for part in parts(child)]


def compile_model(model: nn.Module, mode: str, settings: dict[str, Any] | None = None, regional: bool = False) -> None:
    """torch.compile `model` in place (state_dict keys unchanged) in `mode` with lkcnn's settings and the network's,
    and `settings` (inductor config keys) over them; with `regional`, each of `regions(model)` on its own instead.

    A regional compile compiles each distinct block once: blocks of the same structure share one compiled graph (torch
    passes their parameters in as inputs), so RepLKNet-31B's 48 blocks compile as 8. Each block is compiled for fixed
    shapes (`dynamic=False`: a later stage's wider block would otherwise make the code of its class shape-generic), and
    dynamo may keep as many compiled versions of one block class as the network has distinct blocks of it, in training
    and in eval mode (its default, 8, is fewer than UniRepLKNet-B's blocks need). It halves RepLKNet-31B's cold compile
    on an H200 and trains 1.5-6% slower than the whole network's one graph, whose single CUDA graph costs the host
    less than the regions' replays (docs/performance.md, Open 5): lkcnn compiles whole networks."""
    options = {**compile_options(mode, model), **(settings or {})}
    if not regional:
        model.compile(options=options)
        return
    parts = regions(model)
    versions: dict[type, set[str]] = {}
    for part in parts:
        versions.setdefault(type(part), set()).add(repr(part))
    needed = 2 * max(len(kinds) for kinds in versions.values())
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, needed)
    for part in parts:
        part.compile(options=options, dynamic=False)


def check_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """`settings` as a dict of `torch._inductor.config` settings; ValueError names the first key inductor lacks."""
    known = _inductor_settings()
    for key in settings:
        if key not in known:
            raise ValueError(f"torch {torch.__version__} has no inductor setting {key!r}")
    return dict(settings)


def parse_settings(text: str) -> dict[str, Any]:
    """`key=value,...` as `torch._inductor.config` settings (the benchmarks' `--inductor`); values are Python
    literals (`True`, `1`) or strings. ValueError names the first key inductor does not have or an item without `=`."""
    settings: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{item!r} is not key=value")
        try:
            settings[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            settings[key] = value
    return check_settings(settings)
