"""lkcnn.models: large-kernel CNNs registered with timm (importing this package registers them)."""
import timm
from timm.models import model_entrypoint

from ._checkpoint import checkpoint_filter_fn
from ._factory import LkcnnModel
from .convnext_lk import ConvNeXtLK
from .replknet import RepLKNet

__all__ = ["ConvNeXtLK", "LkcnnModel", "RepLKNet", "checkpoint_filter_fn", "list_models"]


def list_models() -> list[str]:
    """Names of the timm models that lkcnn registers."""
    return [n for n in timm.list_models() if model_entrypoint(n).__module__.startswith(__name__)]
