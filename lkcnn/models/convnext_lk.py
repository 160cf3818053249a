"""ConvNeXt with large per-stage depthwise kernels (optionally a re-parameterizable small / dilated branch).

timm's ConvNeXt is reused as is; only each block's `conv_dw` is swapped for lkcnn's large-kernel module, so with
kernel_sizes=7 and no branch the model is timm's convnext_tiny key for key.
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import to_ntuple
from timm.models import generate_default_cfgs, register_model
from timm.models._manipulate import named_apply
from timm.models.convnext import ConvNeXt, _init_weights

from lkcnn.layers import LargeKernelConv, ReparamLargeKernelConv, to_kernel_size
from lkcnn.layers.reparam_conv import DilatedBranches

from ._factory import LkcnnModel, create_lkcnn_model

__all__ = ["ConvNeXtLK"]


class ConvNeXtLK(LkcnnModel, ConvNeXt):
    """timm ConvNeXt whose depthwise convs are LargeKernelConv (or ReparamLargeKernelConv with a branch)."""

    def __init__(self, kernel_sizes: int | Sequence[int | tuple[int, int]] = (31, 29, 27, 13),
                 small_kernel: int | None = None, dilated_branches: DilatedBranches = False, deploy: bool = False,
                 head_init_scale: float = 1.0, **kwargs) -> None:
        if kwargs.get("output_stride", 32) != 32:
            raise ValueError("ConvNeXt-LK supports output_stride=32 only: its large kernels are stride 1, undilated")
        stage_kernels = [to_kernel_size(k) for k in to_ntuple(4)(kernel_sizes)]
        # timm builds throwaway 1x1 depthwise convs that are replaced right below (cheaper than building big ones)
        super().__init__(kernel_sizes=1, head_init_scale=head_init_scale, **kwargs)
        for stage, ks in zip(self.stages, stage_kernels):
            for block in stage.blocks:
                channels = block.conv_dw.in_channels
                if small_kernel or dilated_branches:
                    conv_dw = ReparamLargeKernelConv(channels, ks, small_kernel, dilated_branches, deploy)
                else:
                    conv_dw = LargeKernelConv(channels, ks, bias=block.conv_dw.bias is not None)
                named_apply(partial(_init_weights, head_init_scale=head_init_scale), conv_dw)
                block.conv_dw = conv_dw


def _cfg(**kwargs) -> dict:
    return {
        "url": "", "num_classes": 1000, "input_size": (3, 224, 224), "pool_size": (7, 7),
        "crop_pct": 0.875, "interpolation": "bicubic", "mean": IMAGENET_DEFAULT_MEAN, "std": IMAGENET_DEFAULT_STD,
        "first_conv": "stem.0", "classifier": "head.fc", "license": "apache-2.0", **kwargs,
    }


default_cfgs = generate_default_cfgs({
    "convnext_lk_tiny": _cfg(),
})


@register_model
def convnext_lk_tiny(pretrained: bool = False, **kwargs) -> ConvNeXtLK:
    """ConvNeXt-T body, kernels (31, 29, 27, 13): 31.93M params (kernel_sizes=31: 34.63M; 7: convnext_tiny, 28.59M)."""
    model_args = dict(depths=(3, 3, 9, 3), dims=(96, 192, 384, 768))
    return create_lkcnn_model(ConvNeXtLK, "convnext_lk_tiny", pretrained, model_args, kwargs)
