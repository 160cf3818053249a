"""BranchConvs: a block's small and dilated depthwise branches as one module call of `lkcnn.ops.dwconv2d_branches`."""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

from lkcnn.ops import dwconv2d_branches


class BranchConvs(nn.Module):
    """Every branch's output from one call (`forward(x, *weights)`, one weight per branch, in order).

    It holds no state: the weights stay in the branches' own conv modules, under the official state-dict keys. It
    is a module so that module hooks see the fused call: the kernel-timing callback times it as one layer.
    """

    def __init__(self, kernel_sizes: Sequence[int], dilations: Sequence[int]) -> None:
        super().__init__()
        self.kernel_sizes, self.dilations = tuple(kernel_sizes), tuple(dilations)

    def forward(self, x: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(dwconv2d_branches(x, list(weights), list(self.dilations)))

    def describe(self) -> str:
        """The branches as the timing table names a kernel size: 5x5, or 5x5+7x7d2+3x3d3 ..."""
        return "+".join(f"{k}x{k}" + (f"d{r}" if r > 1 else "") for k, r in zip(self.kernel_sizes, self.dilations))

    def extra_repr(self) -> str:
        return self.describe()
