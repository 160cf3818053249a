"""Build the network from a `conf/model/*.yaml` node: `name` plus keyword arguments for timm.create_model."""
from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from torch import nn

from lkcnn import models
from lkcnn.ops import conv_impl_from_env, set_conv_impl

from .errors import ConfigError


def build_model(spec: Mapping[str, Any], conv_impl: str = "auto") -> nn.Module:
    """lkcnn.models.build_model(spec["name"], **rest_of_spec), after choosing `conv_impl` for lkcnn's dwconv2d op
    (lkcnn.ops.set_conv_impl: the whole process, so the whole run). Mistakes are ConfigErrors that name the key."""
    try:
        set_conv_impl(conv_impl)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    # the config's choice replaces a LKCNN_CONV_IMPL the user exported: say so (a forgotten export would otherwise
    # silently time or train a different implementation than the shell suggests)
    user = conv_impl_from_env()
    if user is not None and user != conv_impl:
        warnings.warn(f"LKCNN_CONV_IMPL={user} from the environment is replaced by the config's conv_impl={conv_impl}; "
                      f"pass conv_impl={user} to train.py to use it", stacklevel=2)
    kwargs = {key: value for key, value in spec.items() if key != "name"}
    try:
        return models.build_model(spec.get("name"), **kwargs)
    except models.UnknownModelError as err:
        raise ConfigError(f"unknown model name {err.name!r}: pick one of conf/model/ with model=<config>, or set "
                          f"model.name to any timm model name ({err.suggestion})") from err
    except models.ModelError as err:
        raise ConfigError(f"{err}. Fix or remove the model.* override.") from err
