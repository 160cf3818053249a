"""ConvNeXt with large per-stage depthwise kernels (optionally a re-parameterizable small / dilated branch, or SLaK's
decomposed K x N + N x K pair).

timm's ConvNeXt is reused as is; only each block's `conv_dw` is swapped for lkcnn's large-kernel module, so with
kernel_sizes=7 and no branch the model is timm's convnext_tiny key for key. SLaK (slak_*) is this network with
`decomposed=5`: SLaK's own code is Facebook's ConvNeXt with the large-kernel module in each block.
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import to_ntuple
from timm.models import generate_default_cfgs, register_model
from timm.models._manipulate import named_apply
from timm.models.convnext import ConvNeXt, _init_weights

from lkcnn.layers import DecomposedLargeKernelConv, LargeKernelConv, ReparamLargeKernelConv, to_kernel_size
from lkcnn.layers.reparam_conv import DilatedBranches

from ._factory import LkcnnModel, create_lkcnn_model

__all__ = ["ConvNeXtLK"]


class ConvNeXtLK(LkcnnModel, ConvNeXt):
    """timm ConvNeXt whose depthwise convs are LargeKernelConv (or ReparamLargeKernelConv with a branch, or
    DecomposedLargeKernelConv with `decomposed=N`: each stage's K x K kernel becomes K x N + N x K, SLaK's)."""

    def __init__(self, kernel_sizes: int | Sequence[int | tuple[int, int]] = (31, 29, 27, 13),
                 small_kernel: int | None = None, dilated_branches: DilatedBranches = False, decomposed: int = 0,
                 deploy: bool = False, head_init_scale: float = 1.0, **kwargs) -> None:
        if kwargs.get("output_stride", 32) != 32:
            raise ValueError("ConvNeXt-LK supports output_stride=32 only: its large kernels are stride 1, undilated")
        stage_kernels = [to_kernel_size(k) for k in to_ntuple(4)(kernel_sizes)]
        if decomposed and (dilated_branches or any(kh != kw for kh, kw in stage_kernels)):
            raise ValueError(f"decomposed={decomposed} turns each square kernel K into K x {decomposed} + "
                             f"{decomposed} x K: give square kernel_sizes and no dilated_branches")
        # timm builds throwaway 1x1 depthwise convs that are replaced right below (cheaper than building big ones)
        super().__init__(kernel_sizes=1, head_init_scale=head_init_scale, **kwargs)
        for stage, ks in zip(self.stages, stage_kernels):
            for block in stage.blocks:
                channels = block.conv_dw.in_channels
                if decomposed:
                    conv_dw = DecomposedLargeKernelConv(channels, ks[0], decomposed, small_kernel, deploy)
                elif small_kernel or dilated_branches:
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


_slak_cfg = dict(paper_ids="arXiv:2207.03620", origin_url="https://github.com/VITA-Group/SLaK")
default_cfgs = generate_default_cfgs({
    "convnext_lk_tiny": _cfg(),
    "slak_tiny": _cfg(**_slak_cfg),
    "slak_small": _cfg(**_slak_cfg),
    "slak_base": _cfg(**_slak_cfg),
})


@register_model
def convnext_lk_tiny(pretrained: bool = False, **kwargs) -> ConvNeXtLK:
    """ConvNeXt-T body, kernels (31, 29, 27, 13): 31.93M params (kernel_sizes=31: 34.63M; 7: convnext_tiny, 28.59M)."""
    model_args = dict(depths=(3, 3, 9, 3), dims=(96, 192, 384, 768))
    return create_lkcnn_model(ConvNeXtLK, "convnext_lk_tiny", pretrained, model_args, kwargs)


# SLaK's networks, dense: its kernels (51, 49, 47, 13) decomposed at width 5 with a 5x5 small kernel. SLaK trains them
# sparse at 1.3x the width (`width_factor`); that is a sparse-training recipe, not built here (pass dims for it).
_SLAK_ARGS = dict(kernel_sizes=(51, 49, 47, 13), decomposed=5, small_kernel=5)


@register_model
def slak_tiny(pretrained: bool = False, **kwargs) -> ConvNeXtLK:
    """SLaK-T, dense: ConvNeXt-T body, kernels 51, 49, 47, 13 as K x 5 + 5 x K + 5 x 5: 30.82M (30.62M deployed)."""
    model_args = dict(depths=(3, 3, 9, 3), dims=(96, 192, 384, 768), **_SLAK_ARGS)
    return create_lkcnn_model(ConvNeXtLK, "slak_tiny", pretrained, model_args, kwargs)


@register_model
def slak_small(pretrained: bool = False, **kwargs) -> ConvNeXtLK:
    """SLaK-S, dense: ConvNeXt-S body (depths 3, 3, 27, 3), SLaK-T's kernels: 55.57M (55.16M deployed)."""
    model_args = dict(depths=(3, 3, 27, 3), dims=(96, 192, 384, 768), **_SLAK_ARGS)
    return create_lkcnn_model(ConvNeXtLK, "slak_small", pretrained, model_args, kwargs)


@register_model
def slak_base(pretrained: bool = False, **kwargs) -> ConvNeXtLK:
    """SLaK-B, dense: ConvNeXt-B body (widths 128 to 1024), SLaK-T's kernels: 95.72M (95.18M deployed)."""
    model_args = dict(depths=(3, 3, 27, 3), dims=(128, 256, 512, 1024), **_SLAK_ARGS)
    return create_lkcnn_model(ConvNeXtLK, "slak_base", pretrained, model_args, kwargs)
