"""lkcnn.layers: the large-kernel conv module, its re-parameterizable form, and RepLKNet blocks."""
from .blocks import ConvFFN, RepLKBlock
from .conv_bn import conv_bn
from .fuse import dilate_kernel, fuse_bn, pad_to
from .large_kernel_conv import LargeKernelConv, to_kernel_size
from .reparam_conv import UNIREPLKNET_DILATED_BRANCHES, ReparamLargeKernelConv, resolve_dilated_branches

__all__ = [
    "ConvFFN", "LargeKernelConv", "RepLKBlock", "ReparamLargeKernelConv", "UNIREPLKNET_DILATED_BRANCHES",
    "conv_bn", "dilate_kernel", "fuse_bn", "pad_to", "resolve_dilated_branches", "to_kernel_size",
]
