"""lkcnn: large-kernel CNNs with fast depthwise convolutions."""
__version__ = "0.1.0"
