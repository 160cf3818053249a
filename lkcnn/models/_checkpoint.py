"""checkpoint_filter_fn: load official / timm / lkcnn checkpoints into lkcnn models with clear errors."""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn as nn
from timm.models import clean_state_dict
from timm.models.convnext import checkpoint_filter_fn as timm_convnext_filter

from lkcnn.layers import REPARAM_LAYERS

LIGHTNING_PREFIX = "model."  # a LightningModule holding the net at attribute `model`
LIGHTNING_EMA_PREFIX = "model_ema.module."  # timm's ModelEmaV3 at attribute `model_ema`, the net at `.module`
WRAPPER_KEYS = ("state_dict", "model")  # official RepLKNet / timm-style wrappers, first present wins
EMA_WRAPPER_KEYS = ("state_dict_ema", "model_ema")


def select_weights(checkpoint: Mapping[str, object], ema: bool = False) -> tuple[str, dict[str, torch.Tensor]]:
    """(layout, the net's tensors) in a checkpoint: "lightning", "wrapped" (official / timm style) or "state_dict";
    DDP (`module.`) and LightningModule (`model.`) prefixes removed.

    The one EMA rule of lkcnn: a checkpoint's plain weights, unless `ema` asks for its EMA copy, which must then be
    there (a ValueError, never a silent fallback). Plain is what the official RepLKNet / ConvNeXt trainers load on
    `--resume` and `--eval`, and what a Lightning checkpoint's `model.*` holds; the EMA copy is a choice the user
    makes (`lkcnn-export --ema`). timm's pretrained-file loader makes that choice itself: it unwraps files with
    `timm.models.load_state_dict(use_ema=True)` before checkpoint_filter_fn sees the weights. A ValueError's message
    reads after "checkpoint <path> ".
    """
    state_dict = dict(checkpoint)
    if "pytorch-lightning_version" in state_dict and isinstance(state_dict.get("state_dict"), Mapping):
        return "lightning", _module_weights(state_dict["state_dict"], ema)
    kind, keys = "state_dict", EMA_WRAPPER_KEYS if ema else WRAPPER_KEYS
    while not any(isinstance(v, torch.Tensor) for v in state_dict.values()):
        key = next((k for k in keys if isinstance(state_dict.get(k), Mapping)), None)
        if key is None:
            break
        kind, state_dict = "wrapped", dict(state_dict[key])
    cleaned = clean_state_dict(state_dict)
    if cleaned and all(k.startswith((LIGHTNING_PREFIX, LIGHTNING_EMA_PREFIX)) for k in cleaned):
        # a LightningModule's state_dict alone: timm's loaders hand over a train.py checkpoint's `state_dict` so
        return "lightning", _module_weights(cleaned, ema)
    if ema and kind != "wrapped":
        raise ValueError(f"has no EMA weights (none of {', '.join(EMA_WRAPPER_KEYS)})")
    bad = [k for k, v in state_dict.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise ValueError(f"is not a state_dict: entry '{bad[0]}' is a {type(state_dict[bad[0]]).__name__}, not a "
                         f"tensor (top-level keys: {sorted(state_dict)[:10]})")
    return kind, cleaned


def _module_weights(state_dict: Mapping[str, object], ema: bool) -> dict[str, torch.Tensor]:
    """The net in a LightningModule's state_dict: its `model.*` weights, or with `ema` its EMA copy's."""
    prefix = LIGHTNING_EMA_PREFIX if ema else LIGHTNING_PREFIX
    weights = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
    if not weights:
        raise ValueError(f"has no {'EMA' if ema else 'model'} weights (no keys starting with '{prefix}')")
    return clean_state_dict(weights)


def unwrap_state_dict(checkpoint: Mapping[str, object]) -> dict[str, torch.Tensor]:
    """The plain weights inside a checkpoint (select_weights' rule), for pretrained filters."""
    try:
        return select_weights(checkpoint)[1]
    except ValueError as err:
        raise ValueError(f"checkpoint {err}") from None


def _deploy_from_training(state_dict: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Merge the training-form branches of each re-parameterizable layer built with deploy=True (lkcnn.layers'
    REPARAM_LAYERS) through a training-form twin; layers whose keys are already in deploy form stay as they are."""
    out = dict(state_dict)
    for name, module in model.named_modules():
        if not (isinstance(module, REPARAM_LAYERS) and module.deploy):
            continue
        prefix = f"{name}."
        keys = [k for k in out if k.startswith(prefix)]
        if not keys or {k[len(prefix):] for k in keys} == set(module.state_dict()):
            continue
        branch = {k[len(prefix):]: out.pop(k) for k in keys}
        twin = module.training_form()
        try:
            twin.load_state_dict(branch)
        except RuntimeError as err:
            raise ValueError(f"checkpoint weights for {name} do not fit {type(twin).__name__}({twin.extra_repr()}): "
                             f"{str(err).splitlines()[-1].strip()}") from None
        twin.reparameterize()
        out.update({prefix + k: v for k, v in twin.state_dict().items()})
    return out


def check_keys(state_dict: dict[str, torch.Tensor], model: nn.Module) -> None:
    """Raise one readable error for missing/unexpected keys or non-classifier shape mismatches."""
    expected = model.state_dict()
    cfg = getattr(model, "pretrained_cfg", None) or {}
    classifier = f"{cfg['classifier']}." if cfg.get("classifier") else None
    # timm drops or re-initializes the classifier when num_classes differs, and adapts the first conv to in_chans
    adaptable = tuple(f"{cfg[k]}." for k in ("classifier", "first_conv") if cfg.get(k))
    missing = sorted(k for k in set(expected) - set(state_dict) if not (classifier and k.startswith(classifier)))
    unexpected = sorted(k for k in set(state_dict) - set(expected) if not (classifier and k.startswith(classifier)))
    if missing or unexpected:
        hint = ""
        if any("_reparam." in k for k in unexpected):
            hint = " The checkpoint is re-parameterized (deploy form): create the model with deploy=True."
        raise ValueError(f"checkpoint does not match {type(model).__name__}: {len(missing)} missing keys "
                         f"{missing[:3]}, {len(unexpected)} unexpected keys {unexpected[:3]}.{hint} Check the model "
                         "name and its kernel_sizes / small_kernel / dw_ratio / dilated_branches / decomposed "
                         "arguments.")
    for key, value in state_dict.items():
        if key in expected and value.shape != expected[key].shape and not key.startswith(adaptable):
            raise ValueError(f"checkpoint tensor {key} has shape {tuple(value.shape)}, the model expects "
                             f"{tuple(expected[key].shape)}: create the model with matching kernel_sizes / widths.")


def checkpoint_filter_fn(state_dict: Mapping[str, object], model: nn.Module) -> dict[str, torch.Tensor]:
    """timm pretrained filter for every lkcnn model.

    Unwraps `state_dict` / `model` (select_weights' rule: the plain weights), maps Facebook ConvNeXt and SLaK keys
    through timm's own filter, and loads a training-form checkpoint into a deploy-form model by merging its branches.
    Official RepLKNet keys are lkcnn's keys.
    """
    state_dict = unwrap_state_dict(state_dict)
    if any(k.startswith("downsample_layers.") for k in state_dict):  # facebookresearch/ConvNeXt layout
        # SLaK's blocks (Facebook's ConvNeXt otherwise) hold the decomposed kernel as `large_kernel`, not `dwconv`
        state_dict = timm_convnext_filter({k.replace(".large_kernel.", ".dwconv."): v for k, v in state_dict.items()},
                                          model)
    state_dict = _deploy_from_training(state_dict, model)
    check_keys(state_dict, model)
    return state_dict
