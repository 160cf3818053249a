"""RepLKNet blocks (official structure and state-dict keys): RepLKBlock and ConvFFN."""
from __future__ import annotations

import torch
import torch.nn as nn
from timm.layers import DropPath

from lkcnn.ops import batch_norm_gelu

from .conv_bn import conv_bn
from .reparam_conv import DilatedBranches, ReparamLargeKernelConv


class RepLKBlock(nn.Module):
    """BN -> 1x1 conv-BN-ReLU -> large depthwise re-param conv -> ReLU -> 1x1 conv-BN, plus residual."""

    def __init__(self, in_chs: int, dw_chs: int, kernel_size: int | tuple[int, int], small_kernel: int | None,
                 drop_path: float = 0.0, dilated_branches: DilatedBranches = False, deploy: bool = False) -> None:
        super().__init__()
        self.prelkb_bn = nn.BatchNorm2d(in_chs)
        self.pw1 = conv_bn(in_chs, dw_chs, 1, act=True)
        self.large_kernel = ReparamLargeKernelConv(dw_chs, kernel_size, small_kernel, dilated_branches, deploy)
        self.lk_nonlinear = nn.ReLU()
        self.pw2 = conv_bn(dw_chs, in_chs, 1)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.pw2(self.lk_nonlinear(self.large_kernel(self.pw1(self.prelkb_bn(x)))))
        return x + self.drop_path(out)


class ConvFFN(nn.Module):
    """BN -> 1x1 conv-BN -> GELU -> 1x1 conv-BN, plus residual."""

    def __init__(self, in_chs: int, hidden_chs: int, drop_path: float = 0.0) -> None:
        super().__init__()
        self.preffn_bn = nn.BatchNorm2d(in_chs)
        self.pw1 = conv_bn(in_chs, hidden_chs, 1)
        self.nonlinear = nn.GELU()
        self.pw2 = conv_bn(hidden_chs, in_chs, 1)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.preffn_bn(x)
        bn = getattr(self.pw1, "bn", None)  # nn.Identity in the deploy form (folded into the conv)
        if (type(bn) is nn.BatchNorm2d and bn.training and bn.affine and bn.track_running_stats
                and bn.momentum is not None and type(self.nonlinear) is nn.GELU
                and self.nonlinear.approximate == "none"):
            # in training, the BatchNorm and GELU as one op with lkcnn's kernels on a GPU (lkcnn.ops.bn_gelu); a
            # synchronized BatchNorm (another type) keeps the module path
            bn.num_batches_tracked.add_(1)
            h = batch_norm_gelu(self.pw1.conv(h), bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.momentum,
                                bn.eps)
        else:
            h = self.nonlinear(self.pw1(h))
        return x + self.drop_path(self.pw2(h))
