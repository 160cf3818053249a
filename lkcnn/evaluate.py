"""`python -m lkcnn.evaluate SOURCE data=<config> [data.key=value ...]`: top-1, top-5 and images/s of a model on the
validation set of one of train.py's data configs (conf/data/*.yaml).

SOURCE is an export folder (float or 8-bit: `lkcnn.load_deployed`) or a checkpoint (re-parameterized and verified
the way the exporter does it). Prints `top1=... top5=... images/s=...`; images/s counts the model's time only
(CUDA events around each call on a GPU, the first batch left out as warm-up), not the loading of the images. On a GPU
an 8-bit export runs as deployed, its GEMMs and large kernels in 8 bits (`lkcnn.deploy.gemm8`); on the CPU, and for
FP8 on a GPU without FP8 tensor cores, it runs its fake-quant reference. The images are preprocessed as the model was
trained (its data config: size, mean/std, interpolation, crop), the command line's data.* settings winning; another
size than the model's is evaluated with a warning.

This module also turns a data config into calibration batches for the 8-bit exporter: data configs are the training
app's (Hydra, lkcnn.training), a layer above lkcnn.deploy.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lkcnn import timing
from lkcnn.errors import UserError, one_line


class DataError(ValueError):
    """A data config that cannot give images; the message is one line that says what to change."""


def compose_data(overrides: Sequence[str]) -> Any:
    """train.py's config composed with `overrides` (Hydra, as `python -m lkcnn.bench loader` does); only data keys may
    change, since nothing else of the config is used."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from lkcnn.training.configs import CONF_DIR, compose_train

    if not (CONF_DIR / "train.yaml").is_file():
        raise DataError(f"the data configs are not at {CONF_DIR}: they ship with lkcnn's source tree, so run this "
                        "from a checkout (pip install -e .).")
    other = [o for o in overrides if not o.lstrip("+~").split("=", 1)[0].split(".", 1)[0] == "data"]
    if other:
        raise DataError(f"{other[0]!r} is not a data override: pass data=<config> (one of "
                        f"{', '.join(data_configs())}) and data.<key>=<value> settings only.")
    try:
        return compose_train(overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise DataError(f"{one_line(e)} (data configs: {', '.join(data_configs())})") from None


def data_configs() -> list[str]:
    from lkcnn.training.configs import CONF_DIR

    return sorted(p.stem for p in (CONF_DIR / "data").glob("*.yaml"))


def make_datamodule(overrides: Sequence[str]) -> Any:
    """The DataModule of the composed `data` config, set up (train and val datasets built)."""
    from hydra.utils import instantiate

    from lkcnn.training.errors import user_error_message

    cfg = compose_data(overrides)
    try:
        datamodule = instantiate(cfg.data)
        datamodule.setup("fit")
    except Exception as e:
        message = user_error_message(e)
        if message is None:
            raise
        raise DataError(one_line(message)) from None
    if getattr(datamodule, "decode", "cpu") != "cpu":
        raise DataError("evaluation and calibration decode images on the CPU: add data.decode=cpu.")
    return datamodule


def _batches(datamodule: Any, loader: Any) -> Iterator[tuple[Tensor, Tensor]]:
    """(images, targets) of a DataModule loader, through its own batch hook (skipped corrupt images)."""
    from lkcnn.training.errors import user_error_message

    try:
        for batch in loader:
            yield datamodule.on_before_batch_transfer(batch, 0)
    except Exception as e:
        message = user_error_message(e)
        if message is None:
            raise
        raise DataError(one_line(message)) from None


def preprocessing_overrides(data_config: Mapping[str, Any]) -> list[str]:
    """A model's preprocessing (config.json's `data_config`: timm's input size, mean/std, interpolation and crop) as
    data overrides. Placed before a user's overrides (which win), they make evaluation and calibration feed the model
    what it was trained and is deployed with, not the data config's defaults (another image size or normalization
    would give another accuracy, or activation ranges of other inputs): timm's validate resolves its transform from
    the model's data config the same way."""
    def value(v: Any) -> str:
        return f"[{','.join(map(str, v))}]" if isinstance(v, (list, tuple)) else str(v)

    _, height, width = data_config["input_size"]
    size = [f"data.img_size={height}"] if height == width else []  # data.img_size is square; else check_calibration_size
    return size + [f"++data.transform.{key}={value(data_config[key])}" for key in ("mean", "std", "interpolation",
                                                                                   "crop_pct")
                   if data_config.get(key) is not None]


def calibration_batches(overrides: Sequence[str], batches: int) -> list[Tensor]:
    """`batches` batches of training images (shuffled by the config's seed) through the validation transform: the
    inputs the deployed model will see, without the training augmentation, and not the images it is evaluated on."""
    from timm.data import create_transform

    datamodule = make_datamodule(overrides)
    if hasattr(datamodule.train_set, "transform"):
        datamodule.train_set.transform = create_transform(datamodule.img_size, is_training=False,
                                                          **datamodule.transform)
    try:
        loader = datamodule.train_dataloader()
    except ValueError as e:  # ConfigError: fewer images than a batch
        raise DataError(one_line(e)) from None
    out = []
    for images, _ in _batches(datamodule, loader):
        out.append(images)
        if len(out) == batches:
            break
    return out


@torch.no_grad()
def evaluate(model: nn.Module, datamodule: Any, device: torch.device, limit_batches: int | None = None
             ) -> dict[str, float]:
    """top1, top5 (shares), images/s (model time only) and the image count on the validation set."""
    model.eval().to(device)
    correct1 = correct5 = images = timed_images = 0
    spans = []  # (start, end) marks of the model's calls, read once at the end
    for i, (x, targets) in enumerate(_batches(datamodule, datamodule.val_dataloader())):
        if limit_batches is not None and i == limit_batches:
            break
        x, targets = x.to(device), targets.to(device)
        start = timing.mark(device)
        logits = model(x)
        if i > 0:  # the first batch warms up (allocations, the CUDA extension's first call)
            spans.append((start, timing.mark(device)))
            timed_images += len(x)
        if i == 0 and logits.shape[-1] != datamodule.num_classes:
            raise DataError(f"the model predicts {logits.shape[-1]} classes but the data has "
                            f"{datamodule.num_classes}: evaluate on the data config the model was trained for.")
        top = logits.topk(min(5, logits.shape[-1]), dim=-1).indices
        correct1 += int((top[:, 0] == targets).sum())
        correct5 += int((top == targets[:, None]).any(-1).sum())
        images += len(x)
    if images == 0:
        raise DataError("the validation set has no images: check the data config.")
    timing.synchronize(device)
    seconds = sum(timing.elapsed_ms(start, end) for start, end in spans) / 1e3
    return {"top1": correct1 / images, "top5": correct5 / images, "images": images,
            "images_per_s": timed_images / seconds if seconds > 0 else float("nan")}


def load_source(source: Path, model_name: str | None = None, overrides: dict[str, Any] | None = None,
                ema: bool = False) -> tuple[nn.Module, str, dict[str, Any]]:
    """(model in eval mode, its precision, its config.json content): an export folder through `load_deployed`, a
    checkpoint through the float exporter's checks (re-parameterized; the config.json its export writes)."""
    from lkcnn.deploy.export import CONFIG_FILE, load_deployed
    from lkcnn.deploy.quantized_export import deployed_from_checkpoint

    if source.is_dir():
        model = load_deployed(source)
        config = json.loads((source / CONFIG_FILE).read_text())  # load_deployed has checked that it parses
    else:
        model, config = deployed_from_checkpoint(source, model_name, overrides, ema)
    return model, getattr(model, "lkcnn_quantization", {}).get("precision", "fp32"), config


def resolution_warning(source: Path, config: dict[str, Any], img_size: int) -> str | None:
    """What to say when the data's images (data.img_size, square) differ from the model's input size (config.json's
    data_config): evaluating at another resolution is legitimate (e.g. FixRes) and works (lkcnn's models pool
    globally), but the accuracy differs from the model's, so it is a warning, not an error."""
    from lkcnn.deploy.export import CONFIG_FILE

    size = config.get("data_config", {}).get("input_size", [])[-2:]
    if len(size) != 2 or tuple(size) == (img_size, img_size):
        return None
    height, width = size
    origin = source / CONFIG_FILE if source.is_dir() else "its training run's data.img_size, else the model's " \
        "pretrained_cfg"
    hint = f": leave data.img_size out (the model's {height} is the default), unless that is what you mean (e.g. a " \
        "FixRes test resolution)" if height == width else " (the data configs give square images)"
    return (f"the images are {img_size}x{img_size} (data.img_size={img_size}) but the model's input size is "
            f"{height}x{width} ({origin}); accuracy at another resolution differs{hint}.")


def on_device(model: nn.Module, precision: str, device: torch.device) -> tuple[nn.Module, str]:
    """The model to evaluate on `device` and how it runs there: on a GPU an 8-bit model with its GEMMs and large
    kernels in 8 bits (float32 activations, the fake-quant model's), else `model` itself."""
    from lkcnn.deploy.gemm8 import FP8_CAPABILITY, to_8bit_gemms

    if precision not in ("int8", "fp8") or device.type != "cuda":
        return model, precision
    if precision == "fp8" and torch.cuda.get_device_capability(device) < FP8_CAPABILITY:
        return model, "fp8 as fake-quant reference (no FP8 tensor cores)"
    return to_8bit_gemms(model.to(device)), f"{precision} on 8-bit kernels"


def main(argv: list[str] | None = None) -> int:
    """Command line: evaluate an export folder or a checkpoint on a data config's validation set."""
    parser = argparse.ArgumentParser(
        prog="lkcnn-evaluate", description="Top-1 / top-5 and images/s of an exported model (float or 8-bit) or a "
        "checkpoint on the validation set of a data config: python -m lkcnn.evaluate SOURCE data=digits")
    parser.add_argument("source", type=Path, help="export folder (python -m lkcnn.export) or checkpoint file")
    parser.add_argument("overrides", nargs="+", metavar="OVERRIDE",
                        help="train.py's data overrides: data=<config> and data.<key>=<value>")
    parser.add_argument("--model", help="checkpoint SOURCE without a stored model config: the timm model name")
    parser.add_argument("--set", dest="model_args", action="append", default=[], metavar="KEY=VALUE",
                        help="checkpoint SOURCE: model argument, e.g. --set num_classes=10 (repeatable)")
    parser.add_argument("--ema", action="store_true", help="checkpoint SOURCE: evaluate the EMA weights")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if present, else cpu)")
    parser.add_argument("--limit-batches", type=int, default=None, metavar="N",
                        help="evaluate the first N validation batches only")
    args = parser.parse_args(argv)

    def fail(message: str) -> None:
        parser.exit(2, f"{parser.prog}: error: {one_line(message)}\n")

    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as e:
        fail(f"--device {args.device}: {e}")
    if device.type == "cuda" and not torch.cuda.is_available():
        fail(f"--device {args.device}: this machine has no usable CUDA GPU; pass --device cpu.")
    if not args.source.exists():
        fail(f"{args.source} does not exist: pass an export folder or a checkpoint file.")
    if args.limit_batches is not None and args.limit_batches < 1:
        fail(f"--limit-batches {args.limit_batches} must be at least 1 (leave it out to evaluate every batch).")
    try:
        from lkcnn.models import parse_model_args

        model, precision, config = load_source(args.source, args.model, parse_model_args(args.model_args),
                                               args.ema)
        model, precision = on_device(model, precision, device)
        datamodule = make_datamodule([*preprocessing_overrides(config["data_config"]), *args.overrides])
        warning = resolution_warning(args.source, config, datamodule.img_size)
        if warning:
            print(f"{parser.prog}: warning: {warning}", file=sys.stderr)
        result = evaluate(model, datamodule, device, args.limit_batches)
    except (UserError, ValueError, OSError) as e:  # DataError, ExportError, ConvImplError, a damaged export, ...
        fail(str(e))
    speed = "n/a (the first batch only warms up)" if math.isnan(result["images_per_s"]) else \
        f"{result['images_per_s']:.1f}"
    print(f"top1={result['top1']:.4f} top5={result['top5']:.4f} images/s={speed} "
          f"({result['images']} images, {' '.join(args.overrides)}, {precision}, {device})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
