"""lkcnn: large-kernel CNNs with fast depthwise convolutions."""
__version__ = "0.1.0"
from . import models  # noqa: E402,F401  registers lkcnn's models with timm


def __getattr__(name: str):  # lazy: `lkcnn.load_deployed` imports the exporter only when used
    if name == "load_deployed": from lkcnn.deploy.export import load_deployed; return load_deployed  # noqa: E701,E702
    raise AttributeError(f"module 'lkcnn' has no attribute {name!r}")
