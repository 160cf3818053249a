"""lkcnn.models: large-kernel CNNs registered with timm (importing this package registers them)."""
from ._checkpoint import checkpoint_filter_fn, select_weights
from ._factory import (
    NO_SMALL_KERNEL,
    LkcnnModel,
    ModelError,
    UnknownModelError,
    build_model,
    list_models,
    parse_model_args,
)
from .convnext_lk import ConvNeXtLK
from .replknet import RepLKNet
from .unireplknet import UniRepLKNet  # noqa: F401  (registers unireplknet_*)

__all__ = ["NO_SMALL_KERNEL", "ConvNeXtLK", "LkcnnModel", "ModelError", "RepLKNet", "UnknownModelError", "build_model",
           "checkpoint_filter_fn", "list_models", "parse_model_args", "select_weights"]
