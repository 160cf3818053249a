"""lkcnn: large-kernel CNNs with fast depthwise convolutions."""
__version__ = "0.1.0"
from . import models  # noqa: E402,F401  registers lkcnn's models with timm
