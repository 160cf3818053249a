"""`python -m lkcnn.bench blocks`: one repeating unit of each stage of a network, compiled and trained alone, GPU time
by category, and that time times the stage's number of units: the step's block work in seconds of compilation
instead of the minutes a whole compiled network takes (`lkcnn.bench e2e`). The quick way to try a lever on the work
around the kernels, such as inductor's settings, before a whole-network run confirms it:

    python -m lkcnn.bench blocks [--models replknet31b,convnext_base] [--batch 64] [--json FILE]
    python -m lkcnn.bench blocks --inductor coordinate_descent_tuning=True --inductor triton.tile_reductions=True
    python -m lkcnn.bench blocks --models replknet31b --kernels 12   # and each unit's 12 longest kernels

A unit is a stage's shortest repeating run of blocks of the same structure (RepLKNet: a RepLK block and its ConvFFN;
UniRepLKNet-B's third stage: a 13x13 block and two 3x3 ones; ConvNeXt: one block). Each runs as `lkcnn.bench e2e`'s
step does: channels_last, bf16 autocast, compiled as the training app compiles (`lkcnn.compile`: reduce-overhead and
lkcnn's inductor settings), forward and backward (no optimizer), on an input of the shape and dtype the whole network
hands that stage, with a mean-square loss. The stems, downsampling layers and head are left out. Each `--inductor`
value (comma-separated settings of `torch._inductor.config`) is one more variant, those settings over lkcnn's, run
after lkcnn's own (`--inductor realize_reads_threshold=4,combo_kernels=False,max_autotune_pointwise=False` is
inductor's default). The unit's own kernels ("blocks" in the table) leave out two costs of running it alone: its loss
(eager PyTorch kernels, "other") and the CUDA graph's copy of its input (a foreach copy, which the profile files under
"optimizer"); inside the whole network neither exists.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import timm
import torch
from torch import nn

from lkcnn.bench.e2e import COMPILE_MODE, check_models, release
from lkcnn.bench.profile import ELEMENTWISE, OTHER, by_category, category, profile_kernels
from lkcnn.bench.record import command_line, make_record, write_record
from lkcnn.compile import INDUCTOR_SETTINGS, compile_model, network_settings, parse_settings, stage_blocks
from lkcnn.errors import UserError
from lkcnn.ops import set_conv_impl

DEFAULT = "lkcnn's compile settings"  # lkcnn.compile: inductor's defaults, INDUCTOR_SETTINGS, the network's
INDUCTOR = ELEMENTWISE[1]
HARNESS = (OTHER, "optimizer")  # a unit's loss and the CUDA graph's input copy: not the blocks' work (module doc)


def period(kinds: Sequence[str]) -> int:
    """The length of the shortest run that `kinds` repeats (the whole sequence where none repeats)."""
    return next(p for p in range(1, len(kinds) + 1) if all(k == kinds[i % p] for i, k in enumerate(kinds)))


def stage_units(model: nn.Module, image: int = 224) -> list[dict[str, Any]]:
    """Per stage of `model` (timm's `stages`): its repeating unit (sharing the model's modules), how many units the
    stage holds, and the shape (C, H, W) and dtype of the input the network hands its first block under the
    autocast of the step (bf16 on a GPU). UserError for a network without timm's `stages`."""
    if not isinstance(getattr(model, "stages", None), nn.Sequential | nn.ModuleList):
        raise UserError(f"{type(model).__name__} keeps no blocks in timm's `stages` (as ConvNeXt, RepLKNet and "
                         "UniRepLKNet do); choose such a network")
    stages = [stage_blocks(stage) for stage in model.stages]
    inputs: dict[int, torch.Tensor] = {}
    hooks = [blocks[0].register_forward_pre_hook(lambda _, args, i=i: inputs.setdefault(i, args[0]))
             for i, blocks in enumerate(stages)]
    device = next(model.parameters()).device
    try:
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            model.eval()(torch.zeros(1, 3, image, image, device=device))
    finally:
        for hook in hooks:
            hook.remove()
    units = []
    for i, blocks in enumerate(stages):
        p = period([repr(b) for b in blocks])  # the structure: kinds, channels, kernel sizes, dilations
        units.append({"stage": i, "unit": nn.Sequential(*blocks[:p]), "count": len(blocks) // p,
                      "kinds": [type(b).__name__ for b in blocks[:p]], "shape": tuple(inputs[i].shape[1:]),
                      "dtype": inputs[i].dtype})
    return units


def top_kernels(kernels, steps: int, n: int) -> list[dict[str, Any]]:
    """The first `n` of profile_kernels' rows (the longest first): name, category, GPU us and launches per step."""
    return [{"kernel": e.key, "category": category(e.key), "us": e.self_device_time_total / steps,
             "launches": e.count / steps} for e in kernels[:n]]


def unit_report(unit: nn.Module, shape: tuple[int, ...], dtype: torch.dtype, batch: int, steps: int,
                settings: dict[str, Any], top: int = 0) -> dict[str, Any]:
    """GPU ms per training step of one unit by category (torch.profiler over `steps` steps after the warm-up that
    compiles it as the training app compiles, the inductor `settings` over lkcnn's), and its `top` longest
    kernels."""
    unit = unit.cuda().train().to(memory_format=torch.channels_last)
    compile_model(unit, COMPILE_MODE, settings)
    x = torch.randn(batch, *shape, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)

    def step() -> None:
        unit.zero_grad(set_to_none=True)  # the gradients are CUDA-graph outputs: never accumulated into
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = unit(x).float().square().mean()
        loss.backward()
    for _ in range(6):  # the first 3 compile
        step()
    kernels = profile_kernels(step, steps)
    # the unit's blocks are the network's, used again by the next variant: drop the gradients, which live in the
    # CUDA graphs' pool that release() frees (moving them later fails with "invalid argument")
    unit.zero_grad(set_to_none=True)
    del x
    release()
    return {"gpu_ms_by_category": by_category(kernels, steps),
            "gpu_busy_ms": sum(e.self_device_time_total for e in kernels) / 1e3 / steps,
            "kernels": top_kernels(kernels, steps, top)}


def network_rows(name: str, batch: int, steps: int, variants: dict[str, dict[str, Any]],
                 top: int = 0) -> list[dict[str, Any]]:
    """One row per variant of network `name`: per stage the unit's report (with its `top` longest kernels), and
    the step's block time (each category summed over the stages, times their unit counts)."""
    model = timm.create_model(name).cuda()
    units = stage_units(model)
    own = network_settings(model)  # the units compile as the network does
    rows = []
    for label, settings in variants.items():
        stages, total = [], {}
        for u in units:
            report = unit_report(u["unit"], u["shape"], u["dtype"], batch, steps, {**own, **settings}, top)
            stages.append({"stage": u["stage"], "kinds": u["kinds"], "units": u["count"], "shape": list(u["shape"]),
                           "dtype": str(u["dtype"]).removeprefix("torch."), **report})
            for category, ms in report["gpu_ms_by_category"].items():
                total[category] = total.get(category, 0.0) + ms * u["count"]
        rows.append({"network": name, "variant": label, "settings": settings,
                     "network_inductor_settings": own, "stages": stages,
                     "gpu_ms_by_category": total, "gpu_busy_ms": sum(total.values())})
        print(f"lkcnn-bench blocks: {name}, {label}: {rows[-1]['gpu_busy_ms']:.2f} ms", file=sys.stderr, flush=True)
    return rows


def blocks_ms(categories: dict[str, float]) -> float:
    """The blocks' own GPU ms: every category but the harness's."""
    return sum(ms for category, ms in categories.items() if category not in HARNESS)


def table(rows: list[dict[str, Any]], batch: int, device: str) -> str:
    """Per network and variant: the step's block time (the blocks' own kernels, of them inductor's fused ones, all
    kernels with the harness's) and each stage's unit."""
    lines = [f"batch {batch}, 224 px, bf16 autocast, channels_last, compiled ({COMPILE_MODE}), forward + backward, "
             f"{device}; GPU ms per step (the blocks; stems, downsampling and head left out)",
             f"{'network':16s} {'variant':40s} {'blocks':>7s} {'inductor':>9s} {'x default':>9s} {'all':>7s}   "
             "per stage: unit's blocks ms x units"]
    base: dict[str, float] = {}
    for row in rows:
        own = blocks_ms(row["gpu_ms_by_category"])
        base.setdefault(row["network"], own)
        stages = "  ".join(f"{blocks_ms(s['gpu_ms_by_category']):.3f}x{s['units']}" for s in row["stages"])
        lines.append(f"{row['network']:16s} {row['variant'][:40]:40s} {own:7.2f} "
                     f"{row['gpu_ms_by_category'].get(INDUCTOR, 0.0):9.2f} {own / base[row['network']]:9.3f} "
                     f"{row['gpu_busy_ms']:7.2f}   {stages}")
    return "\n".join(lines)


def kernel_lines(rows: list[dict[str, Any]]) -> str:
    """Per network, variant and stage: the unit's longest kernels as the report kept them (--kernels)."""
    lines = []
    for row in rows:
        for stage in row["stages"]:
            if stage.get("kernels"):
                lines.append(f"{row['network']}, {row['variant']}, stage {stage['stage']} "
                             f"({'+'.join(stage['kinds'])}, {stage['shape']}): GPU us per unit step")
                lines += [f"  {k['us']:8.1f} {k['launches']:4.0f}x  {k['category'][:24]:24s} {k['kernel'][:110]}"
                          for k in stage["kernels"]]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lkcnn-bench blocks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=lambda s: s.split(","), default=["replknet31b"],
                        help="comma list of timm names whose stages hold blocks (timm's `stages`)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10, help="profiled steps per unit, after the warm-up")
    parser.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE[,...]",
                        help="one more variant: these torch._inductor.config settings (repeatable)")
    parser.add_argument("--kernels", type=int, default=0, metavar="N",
                        help="also list each unit's N longest kernels (in the record too): where to read inductor's "
                             "generated code next (TORCH_LOGS=output_code)")
    parser.add_argument("--json", default="", help="write a train_blocks benchmark record here")
    return parser


def main(argv: Sequence[str]) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    variants = {DEFAULT: {}}
    for text in args.inductor:
        try:
            variants[text] = parse_settings(text)
        except ValueError as err:
            parser.error(f"--inductor: {err}")
    check_models(parser, "--models", args.models)
    if not torch.cuda.is_available():
        sys.exit("lkcnn-bench blocks: no CUDA device is visible; it times training steps on a GPU")
    set_conv_impl("auto")  # the default dispatch, as users train
    try:
        rows = [row for name in args.models
                for row in network_rows(name, args.batch, args.steps, variants, args.kernels)]
    except UserError as err:
        sys.exit(f"lkcnn-bench blocks: {err}")
    print(table(rows, args.batch, torch.cuda.get_device_name()))
    if args.kernels:
        print(kernel_lines(rows))
    if args.json:
        method = {"timer": "torch.profiler kernel times over --steps steps after 6 warm-up steps (3 compiling)",
                  "units": "GPU ms per training step (forward + backward, no optimizer) of each stage's unit, and "
                           "summed over the stages times their unit counts",
                  "batch": args.batch, "regime": f"compiled ({COMPILE_MODE}), channels_last", "dtype": "bf16 autocast",
                  "lkcnn_inductor_settings": INDUCTOR_SETTINGS}
        write_record(args.json, make_record("train_blocks", torch.device("cuda"), command_line(["blocks", *argv]),
                                            method, rows))
        print(f"wrote {args.json}")
