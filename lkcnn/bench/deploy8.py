"""`python -m lkcnn.bench deploy8`: inference throughput of a deployed network with its GEMMs in 8 bits
(lkcnn.deploy.gemm8, INT8 and FP8) against its bfloat16 float form, in one call, with GPU time per cost category.

    python -m lkcnn.bench deploy8 [--model replknet31b] [--batch 128 1] [--steps 50] [--warmup 5] [--json FILE]
                                  [--variants bf16,int8,fp8,int8-lk16,fp8-lk16] [--compile-mode max-autotune]
    python -m lkcnn.bench deploy8 --model replknet_tiny --size 32 --batch 4 --steps 2   # a CPU dry run

The network has random weights and BatchNorm statistics, is re-parameterized, and for the 8-bit models quantized
(`lkcnn.deploy.quantize`, default settings: the stem and classifier stay float) on --calib-batches random batches.
Each model runs with bfloat16 activations, channels_last, under torch.compile (--compile-mode, default
"reduce-overhead": CUDA graphs take the host's launch time out of batch 1, where it would decide the result, and a
model compiles in about a minute; "max-autotune" adds inductor's GEMM search, whose Triton GEMMs can take the
BatchNorm, activation and the next layer's quantization into their prologue and epilogue, at minutes of compile
time per model and batch size). Images/s is the wall time of --steps calls
after --warmup (lkcnn.timing); the categories come from --profile-steps more calls under torch.profiler. On the CPU
the models run eagerly, without the profile: a check that the command works, not a measurement.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import timm
import torch
from torch import nn

from lkcnn import timing
from lkcnn.bench.e2e import release
from lkcnn.bench.profile import by_category, per_step, profile_kernels
from lkcnn.bench.record import command_line, make_record, write_record
from lkcnn.deploy.gemm8 import to_8bit_gemms
from lkcnn.deploy.quantize import QuantizeError, quantize
from lkcnn.deploy.reparam import reparameterize_model

COMPILE_MODE = "reduce-overhead"
COMPILE_MODES = ("reduce-overhead", "max-autotune")
PRECISIONS = ("int8", "fp8")
# "-lk16": the large kernels on the 16-bit kernels (to_8bit_gemms(large_kernels=False)); else in 8 bits too
VARIANTS = ("bf16", *PRECISIONS, *(f"{p}-lk16" for p in PRECISIONS))
TOP_KERNELS = 15  # kept per row in the record, to check the categories against the kernels' names


def deployed(name: str, device: torch.device) -> nn.Module:
    """`name` in deploy form with random weights and random BatchNorm statistics (a fold that is not the identity)."""
    model = timm.create_model(name)
    for bn in model.modules():
        if isinstance(bn, nn.modules.batchnorm._BatchNorm):
            bn.running_mean.normal_(0, 0.1)
            bn.running_var.uniform_(0.5, 2.0)
    return reparameterize_model(model.eval()).to(device)


def models(args: argparse.Namespace, device: torch.device) -> dict[str, nn.Module]:
    """The bf16 float model and the 8-bit ones (calibrated in float32, as the exporter calibrates), channels_last."""
    float_model = deployed(args.model, device)
    batches = [torch.randn(args.calib_batch, 3, args.size, args.size, device=device)
               for _ in range(args.calib_batches)]
    precision = {v: v.split("-")[0] for v in args.variants if v != "bf16"}  # "fp8-lk16" -> "fp8"
    fake = {p: quantize(float_model, batches, p) for p in PRECISIONS if p in precision.values()}
    eight_bit = {v: to_8bit_gemms(fake[p], torch.bfloat16, large_kernels=not v.endswith("-lk16"))
                 for v, p in precision.items()}
    variants = {"bf16": float_model.to(torch.bfloat16), **eight_bit}  # bf16 always: the ratios' denominator
    return {name: model.to(memory_format=torch.channels_last) for name, model in variants.items()}


def measure(model: nn.Module, batch: int, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """images/s of `model` at `batch` (compiled on a GPU) and, on a GPU, its GPU ms per batch by category."""
    x = torch.randn(batch, 3, args.size, args.size, device=device, dtype=torch.bfloat16)
    x = x.contiguous(memory_format=torch.channels_last)
    run = torch.compile(model, mode=args.compile_mode, dynamic=False) if device.type == "cuda" else model

    def call() -> None:
        with torch.inference_mode():
            run(x)
    batch_ms = timing.mean_ms(call, args.steps, args.warmup, device=device, wall=True)
    row = {"batch": batch, "images_per_s": batch / batch_ms * 1e3, "batch_ms": batch_ms}
    if device.type == "cuda":
        kernels = profile_kernels(call, args.profile_steps)
        row |= {"gpu_busy_ms": sum(e.self_device_time_total for e in kernels) / 1e3 / args.profile_steps,
                "gpu_ms_by_category": by_category(kernels, args.profile_steps),
                "gpu_ms_by_kernel": per_step(kernels[:TOP_KERNELS], args.profile_steps)}
    release()
    return row


def run(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    """One row per (batch, variant), with its ratio to the bf16 model's images/s at that batch."""
    variants = models(args, device)
    rows = []
    for batch in args.batch:
        for name, model in variants.items():
            row = {"network": args.model, "variant": name, **measure(model, batch, args, device)}
            if name != "bf16":
                row["gemm8_layers"] = len(model.lkcnn_gemm8["layers"])
                row["fused_blocks"] = len(model.lkcnn_gemm8["fused_blocks"])
                row["large_kernels_8bit"] = len(model.lkcnn_gemm8["large_kernels"])
            rows.append(row)
            print(f"lkcnn-bench deploy8: {name} batch {batch}: {row['images_per_s']:.1f} images/s",
                  file=sys.stderr, flush=True)
    for row in rows:
        bf16 = next(r for r in rows if r["batch"] == row["batch"] and r["variant"] == "bf16")
        row["ratio_to_bf16"] = row["images_per_s"] / bf16["images_per_s"]
    return rows


def table(rows: list[dict[str, Any]], args: argparse.Namespace, device: torch.device) -> str:
    """images/s, the ratio to bf16 and GPU ms per batch by category, one column per (variant, batch)."""
    where = (f"compiled ({args.compile_mode}), {torch.cuda.get_device_name(device)}" if device.type == "cuda"
             else "eager on the CPU (a dry run, not a measurement)")
    lines = [f"{args.model} deploy form, {args.size} px, bf16 activations, channels_last, {where}",
             f"{'variant':9s} {'batch':>6s} {'img/s':>10s} {'x bf16':>7s} {'ms/batch':>9s} {'8-bit GEMMs':>12s}"]
    for row in rows:
        gemms = "-" if "gemm8_layers" not in row else f"{row['gemm8_layers']}"
        lines.append(f"{row['variant']:9s} {row['batch']:6d} {row['images_per_s']:10.1f} {row['ratio_to_bf16']:6.2f}x "
                     f"{row['batch_ms']:9.2f} {gemms:>12s}")
    if device.type != "cuda":
        return "\n".join(lines)
    heads = [f"{row['variant']}@{row['batch']}" for row in rows]
    lines += ["", f"{'GPU ms per batch':42s}" + "".join(f"{h:>11s}" for h in heads)]
    categories = dict.fromkeys(c for row in rows for c in row["gpu_ms_by_category"])
    for cat in [*categories, "GPU busy"]:
        cells = [row["gpu_busy_ms"] if cat == "GPU busy" else row["gpu_ms_by_category"].get(cat) for row in rows]
        lines.append(f"{cat:42s}" + "".join(f"{c:11.3f}" if c is not None else f"{'-':>11s}" for c in cells))
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lkcnn-bench deploy8", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="replknet31b", help="a timm name (lkcnn's models register on import)")
    parser.add_argument("--batch", type=int, nargs="+", default=[128, 1], help="batch sizes, each timed")
    parser.add_argument("--size", type=int, help="image side in px (default: the model's input size)")
    parser.add_argument("--steps", type=int, default=50, help="timed calls per model and batch size")
    parser.add_argument("--warmup", type=int, default=5, help="calls before timing (the first one compiles)")
    parser.add_argument("--profile-steps", type=int, default=5, help="calls under torch.profiler (GPU only)")
    parser.add_argument("--calib-batches", type=int, default=4, help="random calibration batches")
    parser.add_argument("--calib-batch", type=int, default=16, help="images per calibration batch")
    parser.add_argument("--variants", type=lambda s: s.split(","), default=["bf16", *PRECISIONS],
                        help="comma-separated, of bf16,int8,fp8,int8-lk16,fp8-lk16 (-lk16: the large kernels on "
                             "the 16-bit kernels; bf16 is always measured: the ratios' denominator)")
    parser.add_argument("--compile-mode", choices=COMPILE_MODES, default=COMPILE_MODE,
                        help="torch.compile mode on a GPU")
    parser.add_argument("--json", help="write an lkcnn-benchmark/1 record (kind deploy8) to this path")
    return parser


def main(argv: Sequence[str]) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    if not timm.is_model(args.model):
        parser.exit(2, f"{parser.prog}: error: --model: {args.model!r} is not a timm model name\n")
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.exit(2, f"{parser.prog}: error: --variants: {','.join(unknown)} not among {','.join(VARIANTS)}\n")
    if min(args.batch + [args.steps, args.calib_batches, args.calib_batch]) < 1:
        parser.exit(2, f"{parser.prog}: error: --batch, --steps, --calib-batches and --calib-batch must be positive\n")
    args.size = args.size or timm.get_pretrained_cfg_value(args.model, "input_size")[-1]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        rows = run(args, device)
    except QuantizeError as e:  # e.g. FP8 on a GPU without FP8 tensor cores
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    print(table(rows, args, device))
    if args.json:
        method = {"timer": "lkcnn.timing.mean_ms(wall=True) over --steps calls after --warmup; categories: "
                           "torch.profiler kernel times over --profile-steps more calls",
                  "units": "inference images/s; GPU ms per batch", "size": args.size,
                  "regime": f"compiled ({args.compile_mode}), channels_last, bf16 activations" if device.type == "cuda"
                  else "eager, CPU", "calibration": f"{args.calib_batches} random batches of {args.calib_batch}"}
        write_record(args.json, make_record("deploy8", device, command_line(["deploy8", *argv]), method, rows))
        print(f"wrote {args.json}")
