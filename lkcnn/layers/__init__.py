"""lkcnn.layers: the large-kernel conv module, its re-parameterizable forms, and RepLKNet blocks."""
from .blocks import ConvFFN, RepLKBlock
from .branch_convs import BranchConvs
from .conv_bn import conv_bn, lk_conv_bn
from .decomposed_conv import DecomposedLargeKernelConv
from .fuse import dilate_kernel, fuse_bn, pad_to
from .image_conv import ImageConv2d
from .large_kernel_conv import LargeKernelConv, to_kernel_size
from .reparam_conv import UNIREPLKNET_DILATED_BRANCHES, ReparamLargeKernelConv, resolve_dilated_branches

REPARAM_LAYERS = (ReparamLargeKernelConv, DecomposedLargeKernelConv)
"""lkcnn's re-parameterizable depthwise layers: each has `deploy`, `kernel_size`, `reparameterize()` and
`training_form()`."""

__all__ = [
    "REPARAM_LAYERS", "BranchConvs", "ConvFFN", "DecomposedLargeKernelConv", "ImageConv2d", "LargeKernelConv",
    "RepLKBlock", "ReparamLargeKernelConv", "UNIREPLKNET_DILATED_BRANCHES", "conv_bn", "dilate_kernel", "fuse_bn",
    "lk_conv_bn", "pad_to", "resolve_dilated_branches", "to_kernel_size",
]
