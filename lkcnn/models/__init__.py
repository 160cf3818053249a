"""lkcnn.models: large-kernel CNNs registered with timm (importing this package registers them)."""
from ._checkpoint import checkpoint_filter_fn
from ._factory import LkcnnModel
from .replknet import RepLKNet

__all__ = ["LkcnnModel", "RepLKNet", "checkpoint_filter_fn"]
