"""lkcnn.ops: the large-kernel depthwise convolution.

`dwconv2d(x, weight, bias=None, padding=None)` is the one entry point; it is backed by the registered ops
`torch.ops.lkcnn.dwconv2d_fwd`, `dwconv2d_bwd_input` and `dwconv2d_bwd_weight`, and two variants that share layout
copies in channels_last training: `dwconv2d_fwd_keep_flat` (the output and the NCHW copy of x, flat, saved for the
weight gradient) and `dwconv2d_bwd` (both gradients from one call). Which implementation runs (lkcnn's CUDA kernels or
PyTorch's convolution) is `set_conv_impl` / `use_conv_impl`'s choice, LKCNN_CONV_IMPL the user's default.
`dwconv2d_branches(x, weights, dilations)` runs several small (dilated) depthwise convolutions of one input, the
small branches of the re-parameterizable blocks, in one pass per direction. `gelu_grn(h, gamma, beta)` is
UniRepLKNet's GELU then GRN on an NHWC tensor, two passes each way; `batch_norm_gelu(x, ...)` RepLKNet's training-mode
BatchNorm then GELU on a channels_last tensor, likewise.
"""
from .bn_gelu import batch_norm_gelu, set_bn_gelu_kernels
from .build import BuildError
from .dwconv import (
    conv_impl,
    conv_impl_from_env,
    cuda_unsupported_reason,
    dwconv2d,
    implementation,
    set_conv_impl,
    use_conv_impl,
)
from .dwconv_branches import dwconv2d_branches, set_branch_kernels
from .grn import gelu_grn, set_grn_kernels

__all__ = ["BuildError", "batch_norm_gelu", "conv_impl", "conv_impl_from_env", "cuda_unsupported_reason", "dwconv2d",
           "dwconv2d_branches", "gelu_grn", "implementation", "set_bn_gelu_kernels", "set_branch_kernels",
           "set_conv_impl", "set_grn_kernels", "use_conv_impl"]
