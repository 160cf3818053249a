"""RepLKNet (Ding et al., CVPR 2022) with official state-dict keys, as timm models.

Read top to bottom: stage -> model -> configs -> entrypoints. Blocks live in lkcnn.layers.
`replknet_tiny` is an lkcnn original: channels (32, 64, 128, 256), depths (1, 1, 2, 1), kernels (31, 29, 27, 13),
small kernel 5 - the same blocks as RepLKNet-31B at 1.69M params, for tests and the default CPU training run.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import calculate_drop_path_rates, create_classifier, to_ntuple
from timm.models import generate_default_cfgs, register_model
from timm.models._features import feature_take_indices
from timm.models._manipulate import MATCH_PREV_GROUP, checkpoint_seq

from lkcnn.layers import ConvFFN, RepLKBlock, conv_bn
from lkcnn.layers.reparam_conv import DilatedBranches

from ._factory import LkcnnModel, create_lkcnn_model

__all__ = ["RepLKNet"]


class RepLKNetStage(nn.Module):
    """`depth` pairs of (RepLKBlock, ConvFFN) at one width; official key layout `blocks.{i}`."""

    def __init__(self, channels: int, depth: int, kernel_size: int | tuple[int, int], small_kernel: int | None,
                 drop_path_rates: Sequence[float], dw_ratio: float, ffn_ratio: float,
                 dilated_branches: DilatedBranches, deploy: bool) -> None:
        super().__init__()
        self.grad_checkpointing = False
        blocks = []
        for i in range(depth):
            blocks.append(RepLKBlock(channels, int(channels * dw_ratio), kernel_size, small_kernel,
                                     drop_path_rates[i], dilated_branches, deploy))
            blocks.append(ConvFFN(channels, int(channels * ffn_ratio), drop_path_rates[i]))
        self.blocks = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.grad_checkpointing and not torch.jit.is_scripting():
            return checkpoint_seq(self.blocks, x)
        return self.blocks(x)


class RepLKNet(LkcnnModel, nn.Module):
    """RepLKNet: conv stem (stride 4) -> 4 stages of large-kernel blocks joined by transitions -> BN -> pool -> fc."""

    # Inductor settings of this network over lkcnn's (lkcnn.compile.network_settings). In the ConvFFN's backward
    # inductor writes the GELU's input gradient, da * gelu'(bn(z)), out in fp32 and reads it back in two kernels: it
    # reads six inputs and takes ~30 operations, past both thresholds' defaults. With these both readers recompute it
    # from da and z: +0.8% images/s on RepLKNet-31B's compiled step (one H200, three processes each way,
    # docs/performance.md). UniRepLKNet-B's MLP backward moves 10.7 GB more under them, so they are RepLKNet's.
    inductor_settings = {"realize_reads_threshold": 6, "realize_opcount_threshold": 40}

    def __init__(
            self,
            kernel_sizes: int | Sequence[int] = (31, 29, 27, 13),
            depths: Sequence[int] = (2, 2, 18, 2),
            channels: Sequence[int] = (128, 256, 512, 1024),
            small_kernel: int | None = 5,
            dw_ratio: float = 1.0,
            ffn_ratio: float = 4.0,
            dilated_branches: DilatedBranches = False,
            deploy: bool = False,
            in_chans: int = 3,
            num_classes: int = 1000,
            global_pool: str = "avg",
            drop_rate: float = 0.0,
            drop_path_rate: float = 0.0,
    ) -> None:
        super().__init__()
        num_stages = len(depths)
        if len(channels) != num_stages:
            raise ValueError(f"depths {tuple(depths)} and channels {tuple(channels)} must have the same length")
        kernel_sizes = to_ntuple(num_stages)(kernel_sizes)
        if len(kernel_sizes) != num_stages:
            raise ValueError(f"kernel_sizes {kernel_sizes} needs one entry per stage ({num_stages}) or a single int")
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.drop_rate = drop_rate
        self.grad_checkpointing = False

        c0 = channels[0]
        self.stem = nn.Sequential(
            conv_bn(in_chans, c0, 3, stride=2, act=True),
            conv_bn(c0, c0, 3, groups=c0, act=True),
            conv_bn(c0, c0, 1, act=True),
            conv_bn(c0, c0, 3, stride=2, groups=c0, act=True),
        )
        # drop path rises linearly over the (RepLKBlock, ConvFFN) pairs, both of a pair share the rate
        dpr = calculate_drop_path_rates(drop_path_rate, sum(depths))
        self.stages = nn.ModuleList()
        self.transitions = nn.ModuleList()
        self.feature_info = []
        reduction = 4
        for i in range(num_stages):
            self.stages.append(RepLKNetStage(channels[i], depths[i], kernel_sizes[i], small_kernel,
                                             dpr[sum(depths[:i]):sum(depths[:i + 1])], dw_ratio, ffn_ratio,
                                             dilated_branches, deploy))
            self.feature_info.append(dict(num_chs=channels[i], reduction=reduction, module=f"stages.{i}"))
            if i < num_stages - 1:
                self.transitions.append(nn.Sequential(
                    conv_bn(channels[i], channels[i + 1], 1, act=True),
                    conv_bn(channels[i + 1], channels[i + 1], 3, stride=2, groups=channels[i + 1], act=True),
                ))
                reduction *= 2
        self.num_features = self.head_hidden_size = channels[-1]
        self.norm = nn.BatchNorm2d(channels[-1])
        self.global_pool, self.head = create_classifier(self.num_features, num_classes, pool_type=global_pool)
        self.head_drop = nn.Dropout(drop_rate)

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict:
        """Parameter groups for layer decay: stem, then one group per block; a transition and the final norm join the
        group of the block before them (timm's MATCH_PREV_GROUP)."""
        return dict(
            stem=r"^stem",
            blocks=r"^(?:stages|transitions)\.(\d+)" if coarse else [
                (r"^stages\.(\d+)\.blocks\.(\d+)", None),
                (r"^transitions\.(\d+)", MATCH_PREV_GROUP),
                (r"^norm", MATCH_PREV_GROUP),
            ],
        )

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        for stage in self.stages:
            stage.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str = "avg") -> None:
        self.num_classes = num_classes
        self.global_pool, self.head = create_classifier(self.num_features, num_classes, pool_type=global_pool)

    def forward_intermediates(
            self,
            x: torch.Tensor,
            indices: int | list[int] | None = None,
            norm: bool = False,
            stop_early: bool = False,
            output_fmt: str = "NCHW",
            intermediates_only: bool = False,
    ) -> list[torch.Tensor] | tuple[torch.Tensor, list[torch.Tensor]]:
        """Stage outputs (timm's feature API, used by features_only=True)."""
        if output_fmt != "NCHW":
            raise ValueError(f"RepLKNet features are NCHW only, got output_fmt={output_fmt!r}")
        take_indices, max_index = feature_take_indices(len(self.stages), indices)
        last = max_index if stop_early else len(self.stages) - 1
        intermediates = []
        x = self.stem(x)
        for i in range(last + 1):
            x = self.stages[i](x)
            if i in take_indices:
                intermediates.append(self.norm(x) if norm and i == len(self.stages) - 1 else x)
            if i < len(self.transitions) and i < last:
                x = self.transitions[i](x)
        if intermediates_only:
            return intermediates
        return (self.norm(x) if last == len(self.stages) - 1 else x), intermediates

    def prune_intermediate_layers(self, indices: int | list[int] = 1, prune_norm: bool = False,
                                  prune_head: bool = True) -> list[int]:
        """Drop the stages (and head) after the last wanted feature."""
        take_indices, max_index = feature_take_indices(len(self.stages), indices)
        self.stages = self.stages[:max_index + 1]
        self.transitions = self.transitions[:max_index]
        if prune_norm or max_index < len(self.feature_info) - 1:
            self.norm = nn.Identity()
        if prune_head:
            self.reset_classifier(0, "")
        return take_indices

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for i, stage in enumerate(self.stages):
            x = stage(x)
            if i < len(self.transitions):
                x = self.transitions[i](x)
        return self.norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.head_drop(self.global_pool(x))
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def _cfg(**kwargs) -> dict:
    return {
        "url": "", "num_classes": 1000, "input_size": (3, 224, 224), "pool_size": (7, 7),
        "crop_pct": 0.875, "interpolation": "bicubic", "mean": IMAGENET_DEFAULT_MEAN, "std": IMAGENET_DEFAULT_STD,
        "first_conv": "stem.0.conv", "classifier": "head", "license": "mit",
        "paper_ids": "arXiv:2203.06717", "origin_url": "https://github.com/DingXiaoH/RepLKNet-pytorch", **kwargs,
    }


default_cfgs = generate_default_cfgs({
    "replknet31b": _cfg(),
    "replknet31l": _cfg(),
    "replknet_xl": _cfg(input_size=(3, 320, 320), pool_size=(10, 10), crop_pct=1.0),
    "replknet_tiny": _cfg(license="apache-2.0", origin_url="", paper_ids=""),
})


def _create(variant: str, pretrained: bool, model_args: dict, kwargs: dict) -> RepLKNet:
    return create_lkcnn_model(RepLKNet, variant, pretrained, model_args, kwargs)


@register_model
def replknet31b(pretrained: bool = False, **kwargs) -> RepLKNet:
    """RepLKNet-31B: 79.86M params (79.53M deployed)."""
    return _create("replknet31b", pretrained, dict(channels=(128, 256, 512, 1024)), kwargs)


@register_model
def replknet31l(pretrained: bool = False, **kwargs) -> RepLKNet:
    """RepLKNet-31L: 172.67M params (172.17M deployed)."""
    return _create("replknet31l", pretrained, dict(channels=(192, 384, 768, 1536)), kwargs)


@register_model
def replknet_xl(pretrained: bool = False, **kwargs) -> RepLKNet:
    """RepLKNet-XL: 335.44M params (335.40M deployed); no small kernel, dw_ratio 1.5."""
    return _create("replknet_xl", pretrained, dict(
        kernel_sizes=(27, 27, 27, 13), channels=(256, 512, 1024, 2048), small_kernel=None, dw_ratio=1.5), kwargs)


@register_model
def replknet_tiny(pretrained: bool = False, **kwargs) -> RepLKNet:
    """lkcnn's small RepLKNet for CPU tests and the default run: 31B's blocks and kernels at 1/4 width."""
    return _create("replknet_tiny", pretrained, dict(channels=(32, 64, 128, 256), depths=(1, 1, 2, 1)), kwargs)
