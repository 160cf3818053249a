"""UniRepLKNet's layers (Ding et al., "UniRepLKNet", CVPR 2024; github AILab-CVC/UniRepLKNet) with the official
module names, so official state dicts load by key: the Dilated Reparam Block (a large depthwise conv plus parallel
dilated depthwise branches, each with a BatchNorm), squeeze-and-excitation, GELU and GRN.

The large kernel runs through lkcnn's `dwconv2d` op; the dilated branches all run through one `dwconv2d_branches`
call (on a GPU, one pass over x for every branch's output, one for the summed input gradient, one for the dilated
branches' weight gradients), each branch keeping its own BatchNorm.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lkcnn.ops import dwconv2d_branches
from lkcnn.ops.grn import gelu_grn, grn

from .branch_convs import BranchConvs
from .fuse import merge_branches
from .large_kernel_conv import LargeKernelConv, to_kernel_size
from .reparam_conv import resolve_dilated_branches


class DilatedDWConv(LargeKernelConv):
    """Depthwise 'same' conv with dilation r; state (weight (C,1,k,k)) is nn.Conv2d's, like the official branch. It
    runs through `dwconv2d_branches` (lkcnn's kernels on a channels_last GPU input, PyTorch's dilated conv elsewhere),
    which multiplies only the k x k taps."""

    def __init__(self, channels: int, kernel_size: int, dilation: int = 1, bias: bool = False,
                 device=None, dtype=None) -> None:
        k = to_kernel_size(kernel_size)
        super().__init__(channels, k, bias=bias, padding=(dilation * (k[0] // 2), dilation * (k[1] // 2)),
                         device=device, dtype=dtype)
        self.dilation = (dilation, dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = dwconv2d_branches(x, [self.weight], [self.dilation[0]])[0]
        return y if self.bias is None else y + self.bias.view(-1, 1, 1).to(y.dtype)


class DilatedReparamBlock(nn.Module):
    """UniRepLKNet's large-kernel depthwise conv: `lk_origin` (KxK) + `origin_bn`, plus `dil_conv_k{k}_{r}` +
    `dil_bn_k{k}_{r}` per dilated branch (UniRepLKNet's table for K), summed.

    `reparameterize()` folds every BatchNorm and merges the branches into `lk_origin` with a bias, in place, which
    is the module built with deploy=True (the official deploy keys: `lk_origin.weight`, `lk_origin.bias`).
    """

    def __init__(self, channels: int, kernel_size: int, deploy: bool = False) -> None:
        super().__init__()
        self.channels = channels
        self.kernel_size = to_kernel_size(kernel_size)
        self.branches = resolve_dilated_branches(self.kernel_size, True)
        self.deploy = deploy
        self.lk_origin = LargeKernelConv(channels, self.kernel_size, bias=deploy)
        if deploy:
            return
        self.origin_bn = nn.BatchNorm2d(channels)
        for k, r in self.branches:
            self.add_module(f"dil_conv_k{k}_{r}", DilatedDWConv(channels, k, r))
            self.add_module(f"dil_bn_k{k}_{r}", nn.BatchNorm2d(channels))
        self.branch_convs = BranchConvs([k for k, _ in self.branches], [r for _, r in self.branches])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.deploy:
            return self.lk_origin(x)
        out = self.origin_bn(self.lk_origin(x))
        convs = [getattr(self, f"dil_conv_k{k}_{r}") for k, r in self.branches]
        ys = self.branch_convs(x, *[conv.weight for conv in convs])
        for (k, r), y in zip(self.branches, ys):
            out = out + getattr(self, f"dil_bn_k{k}_{r}")(y)
        return out

    @torch.no_grad()
    def get_equivalent_kernel_bias(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The (C,1,K,K) kernel and (C,) bias equal to the sum of the BN-folded branches (eval mode)."""
        branches = [(self.lk_origin.weight, self.origin_bn, 1, self.lk_origin.bias)]
        branches += [(getattr(self, f"dil_conv_k{k}_{r}").weight, getattr(self, f"dil_bn_k{k}_{r}"), r, None)
                     for k, r in self.branches]
        return merge_branches(branches, self.kernel_size)

    def reparameterize(self) -> None:
        """Merge the branches into `lk_origin` (with bias) in place; a no-op when already deployed."""
        if self.deploy:
            return
        self.lk_origin = LargeKernelConv.from_kernel(*self.get_equivalent_kernel_bias())
        del self.origin_bn, self.branch_convs
        for k, r in self.branches:
            delattr(self, f"dil_conv_k{k}_{r}")
            delattr(self, f"dil_bn_k{k}_{r}")
        self.deploy = True

    def extra_repr(self) -> str:
        return f"channels={self.channels}, kernel_size={self.kernel_size}, branches={self.branches}, " \
               f"deploy={self.deploy}"


class SEBlock(nn.Module):
    """Squeeze-and-excitation (Hu et al., SENet) with 1x1 convs `down` / `up` and ReLU, as UniRepLKNet has it."""

    def __init__(self, channels: int, internal: int) -> None:
        super().__init__()
        self.down = nn.Conv2d(channels, internal, 1, bias=True)
        self.up = nn.Conv2d(internal, channels, 1, bias=True)
        self.nonlinear = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.up(self.nonlinear(self.down(F.adaptive_avg_pool2d(x, 1))))
        return x * torch.sigmoid(s)


class GRN(nn.Module):
    """Global Response Normalization (ConvNeXt V2) on NHWC inputs; `beta` is absent in the deploy form, where it is
    folded into the next linear layer's bias."""

    def __init__(self, dim: int, use_bias: bool = True) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.zeros(1, 1, 1, dim))
        self.beta = nn.Parameter(torch.zeros(1, 1, 1, dim)) if use_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return grn(x, self.gamma, self.beta)


class GELUGRN(nn.Sequential):
    """GELU then GRN, under the official keys (`act.1.gamma`, `act.1.beta`), computed together by
    `lkcnn.ops.gelu_grn`: on a GPU two passes each way over the activation instead of inductor's slower column
    reductions."""

    def __init__(self, dim: int, use_bias: bool = True) -> None:
        super().__init__(nn.GELU(), GRN(dim, use_bias=use_bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_grn(x, self[1].gamma, self[1].beta)


class NCHWtoNHWC(nn.Module):
    """Layout permute as a module: it holds the official Sequential indices (`pwconv1.1` is the linear layer)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.permute(0, 2, 3, 1)


class NHWCtoNCHW(nn.Module):
    """Layout permute as a module (`pwconv2.2` is the BatchNorm in the training form)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.permute(0, 3, 1, 2)
