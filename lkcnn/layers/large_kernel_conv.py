"""LargeKernelConv: a depthwise stride-1 'same' conv module that runs through lkcnn.ops.dwconv2d."""
from __future__ import annotations

import torch
import torch.nn as nn

from lkcnn.ops import dwconv2d


def to_kernel_size(kernel_size: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    """Normalise an int or (kh, kw) kernel size and reject sizes that have no stride-1 'same' padding."""
    ks = (kernel_size, kernel_size) if isinstance(kernel_size, int) else tuple(kernel_size)
    if len(ks) != 2 or not all(isinstance(k, int) and k > 0 and k % 2 == 1 for k in ks):
        raise ValueError(f"kernel_size must be a positive odd int or a pair of them, got {kernel_size!r}: "
                         "stride-1 'same' padding needs odd kernels (use e.g. 31 or (51, 5))")
    return ks


class LargeKernelConv(nn.Conv2d):
    """Depthwise conv with weight (C,1,kh,kw), optional bias (C,) and explicit `padding`.

    Subclassing nn.Conv2d keeps the state dict, init code and isinstance checks of the ecosystem (timm init, fusers)
    working; only forward changes, so the custom large-kernel op (CUDA kernels) is used when available.
    """

    def __init__(self, channels: int, kernel_size: int | tuple[int, int], bias: bool = False,
                 padding: tuple[int, int] | None = None, device=None, dtype=None) -> None:
        ks = to_kernel_size(kernel_size)
        if padding is None:
            padding = (ks[0] // 2, ks[1] // 2)
        super().__init__(channels, channels, ks, stride=1, padding=tuple(padding), groups=channels, bias=bias,
                         device=device, dtype=dtype)

    @classmethod
    def from_kernel(cls, kernel: torch.Tensor, bias: torch.Tensor | None) -> LargeKernelConv:
        """The deploy-form conv holding a merged (C,1,kh,kw) kernel and its (C,) bias (None: none)."""
        conv = cls(kernel.shape[0], tuple(kernel.shape[-2:]), bias=bias is not None, device=kernel.device,
                   dtype=kernel.dtype)
        conv.weight.data.copy_(kernel)
        if bias is not None:
            conv.bias.data.copy_(bias)
        return conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dwconv2d(x, self.weight, self.bias, self.padding)
