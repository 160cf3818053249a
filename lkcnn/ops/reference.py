"""PyTorch's own depthwise convolution, per pass: the fallback path and the float64 reference of the tests."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def forward(x: Tensor, weight: Tensor, bias: Tensor | None, padding: list[int]) -> Tensor:
    return F.conv2d(x, weight, bias, 1, padding, 1, x.shape[1])


def grad_input(grad_out: Tensor, weight: Tensor, padding: list[int]) -> Tensor:
    return torch.nn.grad.conv2d_input(grad_out.shape, weight, grad_out, 1, padding, 1, weight.shape[0])


def grad_weight(grad_out: Tensor, x: Tensor, kernel_size: list[int], padding: list[int]) -> Tensor:
    shape = (x.shape[1], 1, *kernel_size)
    return torch.nn.grad.conv2d_weight(x, shape, grad_out, 1, padding, 1, x.shape[1])
