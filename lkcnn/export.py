"""`python -m lkcnn.export CHECKPOINT OUT_DIR` (`lkcnn-export`): the exporter's command line. The float export is
lkcnn.deploy.export, the 8-bit one lkcnn.deploy.quantized_export; the calibration images come from the evaluator's data
side (lkcnn.evaluate), which is why the command line lives here, above both."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from torch import Tensor

from lkcnn.deploy.export import CONFIG_FILE, DEFAULT_RTOL, ONNX_FILE, WEIGHTS_FILE, ExportError, export_checkpoint
from lkcnn.deploy.quantize import DEFAULT_PERCENTILE, OBSERVERS
from lkcnn.deploy.quantized_export import (
    DEFAULT_CALIB_BATCHES,
    DEFAULT_MIN_AGREEMENT,
    DEFAULT_OBSERVER,
    DEFAULT_OPSET,
    PRECISIONS,
    export_quantized,
)
from lkcnn.errors import UserError
from lkcnn.evaluate import DataError, calibration_batches, preprocessing_overrides
from lkcnn.models import parse_model_args


def positive_int(text: str) -> int:
    """argparse type of a size in pixels: a positive int, else argparse's one-line usage error."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive number of pixels, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    """Command line: export a checkpoint as deployed weights."""
    parser = argparse.ArgumentParser(
        prog="lkcnn-export", description="Re-parameterize a checkpoint (Lightning, state_dict or official RepLKNet) "
        "and write model.safetensors + config.json (+ model.onnx) after checking the deployed model is equivalent.")
    parser.add_argument("checkpoint", type=Path, help="checkpoint file (.ckpt, .pt, .pth, .safetensors)")
    parser.add_argument("out_dir", type=Path, help="output folder (must be empty or absent unless --force)")
    parser.add_argument("--model", help="timm model name, needed when the file stores no model config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="model argument override, e.g. --set num_classes=10 (repeatable)")
    parser.add_argument("--ema", action="store_true", help="export the EMA weights instead of the raw ones")
    parser.add_argument("--onnx", action="store_true", help=f"also write {ONNX_FILE} (needs the onnx package)")
    parser.add_argument("--force", action="store_true",
                        help="replace an earlier export in OUT_DIR (other files there are kept)")
    parser.add_argument("--input-size", type=positive_int, nargs=2, metavar=("H", "W"),
                        help="input size recorded and used for the checks (default: the training run's img_size, "
                        "else the model's pretrained_cfg)")
    parser.add_argument("--rtol", type=float, default=DEFAULT_RTOL,
                        help="largest relative error accepted between original and deployed outputs")
    add_quantized_arguments(parser)  # --precision int8|fp8, --calibrate data=..., ...
    args = parser.parse_args(argv)
    if args.precision != "fp32" or args.calibrate:
        return run_quantized(args, parser)
    try:
        config = export_checkpoint(args.checkpoint, args.out_dir, args.model, parse_model_args(args.overrides),
                                   ema=args.ema, onnx=args.onnx, force=args.force,
                                   input_size=tuple(args.input_size) if args.input_size else None, rtol=args.rtol)
    except (UserError, ValueError, OSError) as e:  # CheckpointError, ExportError, ConvImplError, bad OUT_DIR, ...
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    files = [CONFIG_FILE, WEIGHTS_FILE] + ([ONNX_FILE] if args.onnx else [])
    print(f"exported {config['model']['name']} to {args.out_dir} ({', '.join(files)}); relative error "
          f"{config['equivalence']['relative_error']:.2e}")
    return 0


def add_quantized_arguments(parser: argparse.ArgumentParser) -> None:
    """The exporter's 8-bit options (python -m lkcnn.export ... --precision int8 --calibrate data=digits)."""
    group = parser.add_argument_group("8-bit export (docs/export.md#8-bit-export)")
    group.add_argument("--precision", choices=PRECISIONS, default="fp32",
                       help="fp32 (default): re-parameterized float weights; int8 / fp8 (e4m3): quantized weights "
                       "per output channel and activations per tensor, calibrated with --calibrate")
    group.add_argument("--calibrate", nargs="+", metavar="OVERRIDE", default=None,
                       help="calibration data: train.py's Hydra data overrides, e.g. data=digits, or data=imagenet "
                       "data.root=/data/imagenet (training images, validation transform)")
    group.add_argument("--calib-batches", type=int, default=DEFAULT_CALIB_BATCHES, metavar="N",
                       help=f"calibration batches of data.batch_size images (default {DEFAULT_CALIB_BATCHES})")
    group.add_argument("--observer", choices=OBSERVERS, default=DEFAULT_OBSERVER,
                       help=f"activation range: minmax, percentile or mse (default {DEFAULT_OBSERVER})")
    group.add_argument("--percentile", type=float, default=DEFAULT_PERCENTILE,
                       help=f"--observer percentile: the percentile of |x| kept (default {DEFAULT_PERCENTILE})")
    group.add_argument("--keep-float", nargs="+", metavar="MODULE", default=None,
                       help="modules whose conv and linear layers stay in float, e.g. stem head (default: the "
                       "model's stem and classifier, where 8-bit rounding costs the most accuracy); none: quantize "
                       "every layer")
    group.add_argument("--min-agreement", type=float, default=DEFAULT_MIN_AGREEMENT, metavar="SHARE",
                       help="refuse to write unless the 8-bit model's top-1 class matches the float model's on this "
                       f"share of the calibration images (default {DEFAULT_MIN_AGREEMENT})")
    group.add_argument("--opset", type=int, default=DEFAULT_OPSET,
                       help=f"ONNX opset of an 8-bit --onnx export (default {DEFAULT_OPSET}; int8 needs 18+, "
                       "fp8 19+)")


def run_quantized(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`main` for --precision int8|fp8: load the calibration data, export, print one line."""
    def fail(message: str) -> None:
        parser.exit(2, f"{parser.prog}: error: {message}\n")

    if args.precision == "fp32":
        fail("--calibrate applies to 8-bit exports only: add --precision int8 or --precision fp8.")
    if not args.calibrate:
        fail(f"--precision {args.precision} needs calibration data: add --calibrate data=<config> (a config of "
             "conf/data, e.g. --calibrate data=digits).")
    if args.calib_batches < 1:
        fail(f"--calib-batches {args.calib_batches} must be at least 1.")
    keep_float = args.keep_float
    if keep_float is not None and "none" in keep_float:
        if len(keep_float) > 1:
            fail("--keep-float none quantizes every layer; it takes no module names beside it.")
        keep_float = []

    def batches(data_config: dict[str, Any]) -> list[Tensor]:
        try:  # the export's preprocessing first: --calibrate's own data.* settings win
            return calibration_batches([*preprocessing_overrides(data_config), *args.calibrate], args.calib_batches)
        except DataError as e:
            raise ExportError(f"--calibrate {' '.join(args.calibrate)}: {e}") from None

    try:
        overrides = parse_model_args(args.overrides)
        config = export_quantized(
            args.checkpoint, args.out_dir, args.precision, batches, " ".join(args.calibrate), args.observer,
            args.percentile, args.min_agreement, args.onnx, args.opset, args.model, overrides, ema=args.ema,
            force=args.force, input_size=tuple(args.input_size) if args.input_size else None, rtol=args.rtol,
            keep_float=keep_float)
    except (UserError, ValueError, OSError) as e:  # ExportError, QuantizeError, ConvImplError, bad OUT_DIR, ...
        fail(str(e))
    quant = config["quantization"]
    floats = len(quant["float_layers"])
    files = [CONFIG_FILE, WEIGHTS_FILE] + ([ONNX_FILE] if args.onnx else [])
    print(f"exported {config['model']['name']} in {args.precision} to {args.out_dir} ({', '.join(files)}); top-1 "
          f"agreement with the float model {quant['top1_agreement']:.2%} on {quant['calibration']['images']} "
          f"calibration images ({args.observer} observer, {floats} layer{'s' * (floats != 1)} in float)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
