"""lkcnn.ops: the large-kernel depthwise convolution op (placeholder until the CUDA op lands)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def dwconv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             padding: tuple[int, int] | None = None) -> torch.Tensor:
    """Depthwise stride-1 convolution of x (N,C,H,W) with weight (C,1,kh,kw); 'same' padding by default."""
    if padding is None:
        padding = (weight.shape[-2] // 2, weight.shape[-1] // 2)
    return F.conv2d(x, weight, bias, 1, padding, 1, x.shape[1])
