"""Building models through timm for every lkcnn tool, and recording how to rebuild them (`model.lkcnn_spec`)."""
from __future__ import annotations

import difflib
import inspect
import json
import re
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import timm
import torch
import torch.nn as nn
import yaml
from timm.models import build_model_with_cfg, model_entrypoint

from lkcnn.errors import UserError, first_line
from lkcnn.layers import REPARAM_LAYERS

from ._checkpoint import checkpoint_filter_fn

# timm plumbing and placement arguments: they do not describe the architecture, so they stay out of the spec
_NOT_ARCHITECTURE = {"pretrained_cfg", "pretrained_cfg_overlay", "pretrained_strict", "cache_dir", "device", "dtype",
                     "features_only", "feature_cls", "feature_cfg", "out_indices", "output_fmt", "pruned"}

NO_SMALL_KERNEL = 0
"""`small_kernel` for "no parallel small branch". The layers read None the same way, but lkcnn spells it 0 wherever
arguments pass through timm.create_model (configs, specs, `--set`): timm drops None-valued keyword arguments, so an
explicit None would silently bring back the model's default branch."""


class _YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader, reading 1e-5 as a float (YAML 1.1 wants a dot) the way Hydra / OmegaConf do."""


_YamlLoader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)[eE][-+]?\d+$"),
                                  list("-+0123456789."))


class ModelError(UserError, ValueError):
    """A model name or argument that cannot build; the message is one line that says what to change."""


class UnknownModelError(ModelError):
    """A name timm does not know; `suggestion` names what to type instead (close names, else lkcnn's models)."""

    def __init__(self, name: Any) -> None:
        self.name = name
        ours = list_models()
        text = name if isinstance(name, str) else ""
        close = difflib.get_close_matches(text, ours, n=3) or difflib.get_close_matches(text, timm.list_models(), n=3)
        self.suggestion = (f"did you mean {', '.join(close)}?" if close else
                           f"lkcnn's models are {', '.join(ours)}; any name in timm.list_models() works too")
        super().__init__(f"unknown model {name!r}: {self.suggestion}")


def list_models() -> list[str]:
    """Names of the timm models that lkcnn registers: the one list of lkcnn's models."""
    return [n for n in timm.list_models() if is_lkcnn_model(n)]


def is_lkcnn_model(name: str) -> bool:
    """Whether the timm model `name` (a registered one) is lkcnn's."""
    return model_entrypoint(name).__module__.startswith(__package__)


def build_model(name_or_spec: str | Mapping[str, Any], /, **kwargs: Any) -> nn.Module:
    """`timm.create_model(name, **kwargs)`, the way every lkcnn tool builds a model.

    `name_or_spec` is a timm name or an `lkcnn_spec` ({"name", "kwargs"}, whose kwargs `kwargs` extend). On top of
    timm: small_kernel=None keeps its meaning (NO_SMALL_KERNEL), every model gets `lkcnn_spec` (lkcnn's models record
    it themselves; for any other timm model it is the name and kwargs, which rebuild it just as well), and an unknown
    name or an argument the architecture rejects raises ModelError in one line.
    """
    if isinstance(name_or_spec, Mapping):
        name, kwargs = name_or_spec.get("name"), {**name_or_spec.get("kwargs", {}), **kwargs}
    else:
        name = name_or_spec
    if not isinstance(name, str) or not timm.is_model(name):
        raise UnknownModelError(name)
    kwargs = spell_small_kernel(kwargs)
    path = kwargs.get("checkpoint_path")  # timm raises a FileNotFoundError without the path for a missing one
    if path and not Path(path).is_file():
        raise ModelError(f"model {name!r}: checkpoint_path={path} is not a file: pass a weights file (a state_dict "
                         "of this network)")
    rate = kwargs.get("drop_path_rate", 0.0)  # timm builds any value; a bad one fails in the first training step
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < 1:
        raise ModelError(f"model {name!r}: drop_path_rate={rate!r} must be a number in [0, 1) (the stochastic depth "
                         "of the last block)")
    if not (path and is_lkcnn_model(name)):
        return _create(name, kwargs)
    # timm's checkpoint_path loads a file's state_dict as it is; lkcnn's models load it through their pretrained
    # filter (a train.py checkpoint, official and timm layouts, training form into deploy=True: docs/models.md)
    architecture = {k: v for k, v in kwargs.items() if k != "checkpoint_path"}
    with torch.device("meta"):  # the architecture's own mistakes first, without building weights
        _create(name, architecture)
    # the model's own number of classes: timm would otherwise drop a head that fits, as for a pretrained_cfg's 1000
    overlay = {"file": str(path), **({"num_classes": kwargs["num_classes"]} if "num_classes" in kwargs else {})}
    try:
        model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, **architecture)
    except (ValueError, RuntimeError) as err:  # the filter's check, or load_state_dict's shapes (the classifier's)
        shapes = re.search(r"size mismatch for (\S+): copying a param with shape torch.Size\((\[[^]]*\])\) from "
                           r"checkpoint, the shape in current model is torch.Size\((\[[^]]*\])\)", str(err))
        problem = (f"its {shapes[1]} is {shapes[2]}, the model's {shapes[3]} (another number of classes: set "
                   "model.num_classes to the checkpoint's)") if shapes else first_line(err)
        raise ModelError(f"model {name!r}: checkpoint_path={path}: {problem}") from None
    return model


def _create(name: str, kwargs: dict[str, Any]) -> nn.Module:
    """timm.create_model with build_model's one-line error and rebuild spec."""
    try:
        model = timm.create_model(name, **kwargs)
    except (TypeError, ValueError) as err:  # an unknown keyword or a value the architecture rejects
        raise ModelError(f"model {name!r} does not accept {kwargs}: {first_line(err)}") from err
    if not hasattr(model, "lkcnn_spec"):
        model.lkcnn_spec = {"name": name, "kwargs": _jsonable(kwargs)}
    return model


def parse_model_args(items: Iterable[str]) -> dict[str, Any]:
    """Command-line `--set key=value` strings -> model kwargs. Values are read as YAML, as Hydra reads overrides:
    `10`, `true`, `[31,29,27,13]`, `null` (None), anything else is text."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise ModelError(f"--set expects key=value with a model argument name as key, got {item!r} "
                             "(e.g. --set kernel_sizes=[31,29,27,13])")
        try:
            out[key] = yaml.load(value, Loader=_YamlLoader)
        except yaml.YAMLError:
            raise ModelError(f"--set {item!r}: the value is not YAML; write e.g. 7, [31,29,27,13], true, null or "
                             "a quoted string") from None
    return out


def spell_small_kernel(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """`kwargs` with a small_kernel of None (or any false value) spelled NO_SMALL_KERNEL (see there)."""
    if "small_kernel" in kwargs and not kwargs["small_kernel"]:
        return {**kwargs, "small_kernel": NO_SMALL_KERNEL}
    return dict(kwargs)


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
        deployed = [m.deploy for m in self.modules() if isinstance(m, REPARAM_LAYERS)]
        if deployed:
            kwargs.pop("deploy", None)
            if all(deployed):
                kwargs["deploy"] = True
        return {"name": self._lkcnn_name, "kwargs": kwargs}

    def mark_deployed(self) -> None:
        """Record deploy=True in the spec (for models whose modules cannot tell, having nothing to merge)."""
        self._lkcnn_kwargs = {**self._lkcnn_kwargs, "deploy": True}


def spec_kwargs(model_cls: type, model_args: dict[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The user's architecture kwargs that differ from the entrypoint's defaults, JSON-ready (no small kernel as
    NO_SMALL_KERNEL)."""
    defaults = {name: p.default for name, p in inspect.signature(model_cls.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
    defaults = spell_small_kernel({**defaults, **model_args})
    out = {}
    for key, value in spell_small_kernel(kwargs).items():
        if key in _NOT_ARCHITECTURE or _jsonable(value) == _jsonable(defaults.get(key, inspect.Parameter.empty)):
            continue
        try:
            json.dumps(_jsonable(value))
        except TypeError:
            warnings.warn(f"{key}={value!r} is not JSON-serialisable and is left out of lkcnn_spec; "
                          "pass it by name (a string) so the model can be rebuilt from its spec")
            continue
        out[key] = _jsonable(value)
    return out


def create_lkcnn_model(model_cls: type, variant: str, pretrained: bool, model_args: dict[str, Any],
                       kwargs: dict[str, Any], filter_fn: Callable[..., dict] = checkpoint_filter_fn,
                       **build_kwargs: Any) -> nn.Module:
    """timm's build_model_with_cfg (pretrained files through `filter_fn`, features_only) plus the rebuild spec."""
    model = build_model_with_cfg(
        model_cls, variant, pretrained,
        pretrained_filter_fn=filter_fn,
        feature_cfg=dict(feature_cls="getter", out_indices=(0, 1, 2, 3)),
        **build_kwargs, **dict(model_args, **kwargs))
    target = getattr(model, "model", model)  # features_only wraps the model
    target._lkcnn_name = variant
    target._lkcnn_kwargs = spec_kwargs(model_cls, model_args, kwargs)
    return model
