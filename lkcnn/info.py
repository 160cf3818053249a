"""`python -m lkcnn.info MODEL`: parameter counts (train and deploy form) and MACs of a model at an input size."""
from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from lkcnn.export import positive_int
from lkcnn.deploy.reparam import reparameterize_model
from lkcnn.layers import BranchConvs, LargeKernelConv
from lkcnn.models import UnknownModelError, build_model, list_models, parse_model_args
from lkcnn.training.configs import CONF_DIR


def build(name: str, kwargs: dict[str, Any]) -> nn.Module:
    """The model on the meta device (no memory, no init time, nothing downloaded)."""
    with torch.device("meta"):
        return build_model(name, **{**kwargs, "pretrained": False})


def count_macs(model: nn.Module, img_size: int) -> tuple[int, int]:
    """(total MACs, MACs FlopCounterMode attributed to the large-kernel convs and their parallel small branches, the
    LargeKernelConv and BranchConvs modules) for one image; MACs = FLOPs / 2.

    The meta-device model gets uninitialized CPU storage (untouched, so no real memory) and runs under fake tensors:
    shapes only, no arithmetic, yet ops see a CPU device as they would in real use.
    """
    model.to_empty(device="cpu")
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(1, getattr(model, "in_chans", 3), img_size, img_size)
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad():
            model.eval()(x)
    root = type(model).__name__
    lk_names = {f"{root}.{n}" for n, m in model.named_modules() if isinstance(m, (LargeKernelConv, BranchConvs))}
    lk_flops = sum(sum(ops.values()) for n, ops in counter.get_flop_counts().items() if n in lk_names)
    return counter.get_total_flops() // 2, lk_flops // 2


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def info(name: str, img_size: int = 224, kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Params and MACs at img_size x img_size, in training and deploy form."""
    model = build(name, kwargs or {})
    deployed = reparameterize_model(copy.deepcopy(model))
    has_lk = any(isinstance(m, LargeKernelConv) for m in deployed.modules())
    result = dict(name=name, kwargs=kwargs or {}, img_size=img_size)
    for form, net in (("train", model), ("deploy", deployed)):
        result[f"params_{form}"] = num_params(net)
        result[f"macs_{form}"], result[f"large_kernel_macs_{form}"] = count_macs(net, img_size)
    result["large_kernel_counted"] = result["large_kernel_macs_deploy"] > 0 or not has_lk
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lkcnn-info", description=__doc__)
    parser.add_argument("model", help=f"a timm model name, e.g. one of lkcnn's: {', '.join(list_models())}")
    parser.add_argument("--img-size", type=positive_int, default=224, help="square input size (default 224)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="model keyword argument, read as YAML, e.g. --set kernel_sizes=[31,29,27,13] "
                        "--set small_kernel=0")
    args = parser.parse_args(argv)
    try:
        result = info(args.model, args.img_size, parse_model_args(args.set))
    except ValueError as err:  # a name or setting the user typed (ModelError): one line, no usage block
        if isinstance(err, UnknownModelError) and (CONF_DIR / "model" / f"{args.model}.yaml").is_file():
            # a config name of train.py's model=..., which need not be a timm name
            err = (f"{args.model} is a train.py model config (conf/model/{args.model}.yaml), not a timm model name: "
                   f"`python train.py model={args.model} --cfg job` shows its model.name and settings for --set")
        print(f"lkcnn-info: error: {err}", file=sys.stderr)
        return 2
    print(f"model          {result['name']} {result['kwargs'] or ''}".rstrip())
    print(f"params         {result['params_train'] / 1e6:.2f}M (train form)  "
          f"{result['params_deploy'] / 1e6:.2f}M (deploy form)")
    print(f"MACs           {result['macs_train'] / 1e9:.2f}G (train form)  {result['macs_deploy'] / 1e9:.2f}G "
          f"(deploy form) at {args.img_size}x{args.img_size}; large-kernel convs "
          f"{result['large_kernel_macs_train'] / 1e9:.2f}G / {result['large_kernel_macs_deploy'] / 1e9:.2f}G")
    if not result["large_kernel_counted"]:
        print("warning        FlopCounterMode did not see the large-kernel op: MACs exclude the large-kernel convs",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
