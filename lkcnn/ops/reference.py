"""PyTorch's own depthwise convolution, per pass: the fallback path and the float64 reference of the tests."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def forward(x: Tensor, weight: Tensor, bias: Tensor | None, padding: list[int], dilation: int = 1) -> Tensor:
    return F.conv2d(x, weight, bias, 1, padding, dilation, x.shape[1])


def grad_input(grad_out: Tensor, weight: Tensor, padding: list[int], dilation: int = 1) -> Tensor:
    # What autograd runs for F.conv2d's input gradient. The input's values are not read, only its layout, from
    # which the convolution picks NHWC or NCHW kernels: a 'same' conv's input has grad_out's shape, so grad_out
    # stands in for it. (torch.nn.grad.conv2d_input passes an expanded scalar, which has no channels_last layout:
    # cuDNN then ran a channels_last gradient through NCHW kernels and copies: 3.4x slower for a 5x5 at 128 channels,
    # 56x56, batch 64, bf16, on an H200.)
    return torch.ops.aten.convolution_backward(grad_out, grad_out, weight, None, [1, 1], padding, [dilation] * 2,
                                               False, [0, 0], weight.shape[0], (True, False, False))[0]


def grad_weight(grad_out: Tensor, x: Tensor, kernel_size: list[int], padding: list[int], dilation: int = 1) -> Tensor:
    n, c, h, w = x.shape
    if x.device.type == "cpu":
        # torch 2.14's CPU convolution_backward segfaults on single-channel inputs with kernels taller than the map
        # (e.g. 1x17x8 with 51x5). On the CPU compute the same sum as a grouped forward convolution of each (n, c)
        # plane of x with the matching plane of grad_out (every offset the kernel's span covers; a dilated kernel's
        # taps are every dilation-th), then sum over the batch.
        planes = F.conv2d(x.reshape(1, n * c, h, w), grad_out.reshape(n * c, 1, h, w), None, 1, padding, 1, n * c)
        planes = planes[..., ::dilation, ::dilation]
        return planes.reshape(n, c, *planes.shape[-2:]).sum(0).unsqueeze(1)
    return torch.nn.grad.conv2d_weight(x, (c, 1, *kernel_size), grad_out, 1, padding, dilation, c)
