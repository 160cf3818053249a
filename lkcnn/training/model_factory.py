"""Build the network from a `conf/model/*.yaml` node: `name` plus keyword arguments for timm.create_model."""
from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

import timm
from torch import nn

import lkcnn.models  # noqa: F401  (registers lkcnn's models with timm)

from .errors import ConfigError

CONV_IMPLS = ("auto", "cuda", "torch")
_exported: str | None = None  # what build_model last wrote to LKCNN_CONV_IMPL (a multirun's earlier job, not the user)


def build_model(spec: Mapping[str, Any], conv_impl: str = "auto") -> nn.Module:
    """timm.create_model(spec["name"], **rest_of_spec), after pointing lkcnn's dwconv2d op at `conv_impl`.

    Every returned model has `lkcnn_spec` ({"name", "kwargs"}); lkcnn models set it themselves, for other timm
    models (stand-ins, baselines) it is the config node, which rebuilds them just as well.
    """
    if conv_impl not in CONV_IMPLS:
        raise ConfigError(f"conv_impl={conv_impl!r} is not one of {', '.join(CONV_IMPLS)}")
    # The op reads the variable when it runs, so setting it before building covers the whole run. A value the user
    # exported is replaced by the config's, so say so (a stale export once made a benchmark time PyTorch's convolution as lkcnn's).
    global _exported
    user = os.environ.get("LKCNN_CONV_IMPL")
    if user is not None and user != _exported and user.strip().lower() != conv_impl:
        warnings.warn(f"LKCNN_CONV_IMPL={user} from the environment is replaced by the config's conv_impl={conv_impl}; "
                      f"pass conv_impl={user.strip().lower()} to train.py to use it", stacklevel=2)
    os.environ["LKCNN_CONV_IMPL"] = _exported = conv_impl
    kwargs = {key: value for key, value in spec.items() if key != "name"}
    name = spec.get("name")
    if not name or not timm.is_model(name):
        raise ConfigError(f"unknown model name {name!r}: pick one of conf/model/ with model=<config>, "
                          f"or set model.name to any timm model name")
    try:
        model = timm.create_model(name, **kwargs)
    except (TypeError, ValueError) as err:  # unknown keyword or a value the architecture rejects
        raise ConfigError(f"model {name!r} cannot be built with {kwargs}: {err}. "
                          f"Fix or remove the model.* override.") from err
    if not hasattr(model, "lkcnn_spec"):
        model.lkcnn_spec = {"name": name, "kwargs": kwargs}
    return model
