"""Building lkcnn models through timm and recording how to rebuild them (`model.lkcnn_spec`)."""
from __future__ import annotations

import inspect
import json
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch.nn as nn
from timm.models import build_model_with_cfg

from lkcnn.layers import ReparamLargeKernelConv

from ._checkpoint import checkpoint_filter_fn

# timm plumbing and placement arguments: they do not describe the architecture, so they stay out of the spec
_NOT_ARCHITECTURE = {"pretrained_cfg", "pretrained_cfg_overlay", "pretrained_strict", "cache_dir", "device", "dtype",
                     "features_only", "feature_cls", "feature_cfg", "out_indices", "output_fmt", "pruned"}


def _jsonable(value: Any) -> Any:
    """Tuples (and config containers such as OmegaConf's) become lists / dicts, so the spec round-trips through JSON."""
    if isinstance(value, Mapping):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str):
        return [_jsonable(v) for v in value]
    return value


class LkcnnModel:
    """Mixin for lkcnn models: `lkcnn_spec` = {"name", "kwargs"} such that
    `timm.create_model(spec["name"], **spec["kwargs"])` rebuilds the architecture.

    `deploy` is read from the modules themselves, so the spec stays true after lkcnn's or timm's
    reparameterize_model (which knows nothing about specs).
    """

    _lkcnn_name: str = ""
    _lkcnn_kwargs: dict[str, Any] = {}

    @property
    def lkcnn_spec(self) -> dict[str, Any]:
        kwargs = dict(self._lkcnn_kwargs)
        deployed = [m.deploy for m in self.modules() if isinstance(m, ReparamLargeKernelConv)]
        if deployed:
            kwargs.pop("deploy", None)
            if all(deployed):
                kwargs["deploy"] = True
        return {"name": self._lkcnn_name, "kwargs": kwargs}

    def mark_deployed(self) -> None:
        """Record deploy=True in the spec (for models whose modules cannot tell, having nothing to merge)."""
        self._lkcnn_kwargs = {**self._lkcnn_kwargs, "deploy": True}


def spec_kwargs(model_cls: type, model_args: dict[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The user's architecture kwargs that differ from the entrypoint's defaults, JSON-ready.

    small_kernel=None is recorded as 0 because timm.create_model drops None-valued kwargs.
    """
    defaults = {name: p.default for name, p in inspect.signature(model_cls.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
    defaults.update(model_args)
    out = {}
    for key, value in kwargs.items():
        if key in _NOT_ARCHITECTURE or _jsonable(value) == _jsonable(defaults.get(key, inspect.Parameter.empty)):
            continue
        if key == "small_kernel" and not value:
            value = 0
        try:
            json.dumps(_jsonable(value))
        except TypeError:
            warnings.warn(f"{key}={value!r} is not JSON-serialisable and is left out of lkcnn_spec; "
                          "pass it by name (a string) so the model can be rebuilt from its spec")
            continue
        out[key] = _jsonable(value)
    return out


def create_lkcnn_model(model_cls: type, variant: str, pretrained: bool, model_args: dict[str, Any],
                       kwargs: dict[str, Any], **build_kwargs: Any) -> nn.Module:
    """timm's build_model_with_cfg (pretrained files, features_only) plus the rebuild spec."""
    if kwargs.get("small_kernel") == 0:  # 0 is the create_model-safe spelling of "no small kernel"
        kwargs = dict(kwargs, small_kernel=None)
    model = build_model_with_cfg(
        model_cls, variant, pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(feature_cls="getter", out_indices=(0, 1, 2, 3)),
        **build_kwargs, **dict(model_args, **kwargs))
    target = getattr(model, "model", model)  # features_only wraps the model
    target._lkcnn_name = variant
    target._lkcnn_kwargs = spec_kwargs(model_cls, model_args, kwargs)
    return model
