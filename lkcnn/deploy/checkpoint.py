"""Safe loading of checkpoint files: Lightning checkpoints, plain state_dicts, official RepLKNet checkpoints.

Checkpoints are untrusted input, so they are unpickled with ``torch.load(weights_only=True)``. Every problem with a
file (missing, truncated, not a checkpoint, weights that do not fit the model) raises one ``CheckpointError`` whose
message names the file, the problem and what to do.
"""
from __future__ import annotations

import argparse
import collections
import pickle
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import omegaconf
import safetensors.torch
import torch
from safetensors import SafetensorError
from torch import nn

from lkcnn.errors import UserError, first_line
from lkcnn.models import select_weights

# Plain data holders that Hydra (an OmegaConf config in `hyper_parameters`) and the official RepLKNet trainer
# (argparse `args`) pickle next to the weights. torch's weights-only unpickler refuses them by default; restoring them
# only sets attributes, so allowing them runs no code from the file. Anything else stays refused.
TRUSTED_GLOBALS: list[Any] = [
    omegaconf.DictConfig, omegaconf.ListConfig, omegaconf.base.ContainerMetadata, omegaconf.base.Metadata,
    omegaconf.nodes.AnyNode, omegaconf.nodes.StringNode, omegaconf.nodes.IntegerNode, omegaconf.nodes.FloatNode,
    omegaconf.nodes.BooleanNode, typing.Any, collections.defaultdict, dict, list, int, float, str, bool,
    argparse.Namespace,
]


class CheckpointError(UserError, ValueError):
    """A checkpoint file lkcnn cannot use; the message names the file, the problem and what to do."""


@dataclass
class Checkpoint:
    """The weights of one net read from a checkpoint file, and the model spec stored with them (if any)."""

    path: Path
    kind: str  # "lightning", "wrapped" (official / timm style) or "state_dict"
    state_dict: dict[str, torch.Tensor]
    spec: dict[str, Any] | None  # {"name": timm model name, "kwargs": {...}} or None when the file carries none
    hydra_config: dict[str, Any] | None = None  # the training run's resolved config (lkcnn's training app)


def _torch_load(path: Path) -> Any:
    """torch.load, weights only, with the tensors mapped from the file (copy-on-write): a check that reads only the
    shapes or the stored config (resuming reads a checkpoint twice before Lightning loads it) then costs ~0.06 s
    instead of ~0.8 s for a 1.2 GB checkpoint in the page cache, and more from a cold disk. Files in torch's legacy
    format cannot be mapped and are read whole."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "mmap can only be used" not in str(e):
            raise
        return torch.load(path, map_location="cpu", weights_only=True)


def load_file(path: str | Path) -> dict[str, Any]:
    """Unpickle a checkpoint file safely (weights only); a ``.safetensors`` file is read as a state_dict."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist (or is not a file); check the path.")
    if path.suffix == ".safetensors":
        try:
            return safetensors.torch.load_file(path)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"checkpoint {path} is not a readable safetensors file ({e}); "
                                  "it may be truncated or corrupt: copy or download it again.") from None
    try:
        with torch.serialization.safe_globals(TRUSTED_GLOBALS):
            obj = _torch_load(path)
    except pickle.UnpicklingError as e:
        refused = re.search(r"GLOBAL (\S+)", str(e))
        if refused is None:  # a damaged pickle stream, not a refused class
            raise CheckpointError(f"checkpoint {path} is not a readable PyTorch checkpoint (damaged pickle data); "
                                  "copy or save it again.") from None
        raise CheckpointError(
            f"checkpoint {path} contains a pickled object that lkcnn does not load from a file it cannot trust "
            f"({refused.group(1)}). If you trust the file, save only its weights, e.g. torch.save(torch.load(path, "
            "weights_only=False)['state_dict'], 'weights.pt'), and export that with --model NAME.") from None
    except Exception as e:  # noqa: BLE001  damaged bytes fail the unpickler in many ways (IndexError, KeyError, ...)
        raise CheckpointError(f"checkpoint {path} could not be read ({first_line(e)}); it is probably truncated or "
                              "corrupt: copy or save it again.") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(obj).__name__}, not a dict of weights; save "
                              "model.state_dict() (or a Lightning checkpoint) instead.")
    return obj


def read_checkpoint(path: str | Path, ema: bool = False) -> Checkpoint:
    """Read the net's weights and the stored model spec from a checkpoint file: the plain weights, or the EMA copy
    when ``ema`` (lkcnn.models.select_weights holds this rule and the layouts it reads)."""
    path = Path(path)
    obj = load_file(path)
    try:
        kind, state_dict = select_weights(obj, ema)
    except ValueError as e:
        if ema:
            hint = "train with EMA enabled or drop --ema" if "pytorch-lightning_version" in obj else "drop --ema"
        elif "pytorch-lightning_version" in obj:
            hint = "was it written by lkcnn's training app?"
        else:
            hint = "pass a Lightning checkpoint, a state_dict, or a dict wrapping one under 'model' / 'state_dict'"
        raise CheckpointError(f"checkpoint {path} {e}; {hint}.") from None
    hydra_config = obj.get("hydra_config")
    if isinstance(hydra_config, omegaconf.DictConfig):
        hydra_config = omegaconf.OmegaConf.to_container(hydra_config)
    return Checkpoint(path, kind, state_dict, _spec(obj.get("lkcnn_model"), path),
                      hydra_config if isinstance(hydra_config, dict) else None)


def load_weights(model: nn.Module, checkpoint: Checkpoint, model_name: str) -> None:
    """Load ``checkpoint``'s weights into ``model`` strictly; a mismatch says which keys/shapes differ and what to
    do."""
    expected = model.state_dict()
    given = checkpoint.state_dict
    missing = [k for k in expected if k not in given]
    unexpected = [k for k in given if k not in expected]
    shapes = [f"{k}: file {tuple(v.shape)} vs model {tuple(expected[k].shape)}"
              for k, v in given.items() if k in expected and v.shape != expected[k].shape]
    if missing or unexpected or shapes:
        problems = [f"{len(items)} {what} (e.g. {items[0]})"
                    for what, items in (("missing keys", missing), ("unexpected keys", unexpected),
                                        ("shape mismatches", shapes)) if items]
        raise CheckpointError(
            f"checkpoint {checkpoint.path} does not fit model '{model_name}': {'; '.join(problems)}. Was it made "
            "for another model or configuration? Pass --model NAME and --set key=value to match it.")
    model.load_state_dict(given, strict=True)


def _spec(spec: Any, path: Path) -> dict[str, Any] | None:
    """Validate the stored model spec ``{"name": str, "kwargs": dict}``."""
    if spec is None:
        return None
    if not (isinstance(spec, dict) and isinstance(spec.get("name"), str) and isinstance(spec.get("kwargs", {}), dict)):
        raise CheckpointError(f"checkpoint {path} has a malformed 'lkcnn_model' entry ({spec!r}); it must be "
                              "{'name': timm model name, 'kwargs': {...}}: fix it, or save only the state_dict and "
                              "pass --model NAME.")
    return {"name": spec["name"], "kwargs": dict(spec.get("kwargs", {}))}
