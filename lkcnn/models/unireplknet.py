"""UniRepLKNet (Ding et al., "UniRepLKNet: A Universal Perception Large-Kernel ConvNet for Audio, Video, Point Cloud,
Time-Series and Image Recognition", CVPR 2024; github AILab-CVC/UniRepLKNet) as timm models.

The architecture, module names and parameter counts are the official ones, so official checkpoints (training or
deploy form, raw or under `model` / `state_dict`) load strictly. The large depthwise convs (Dilated Reparam Blocks)
run through lkcnn's `dwconv2d` op. Read top to bottom: block -> stage -> model -> checkpoint filter -> configs ->
entrypoints.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import DropPath, LayerNorm2d, SelectAdaptivePool2d, calculate_drop_path_rates, trunc_normal_
from timm.models import generate_default_cfgs, register_model
from timm.models._features import feature_take_indices
from timm.models._manipulate import checkpoint_seq

from lkcnn.layers.fuse import fuse_bn
from lkcnn.layers.image_conv import ImageConv2d
from lkcnn.layers.unireplknet_blocks import GELUGRN, DilatedReparamBlock, NCHWtoNHWC, NHWCtoNCHW, SEBlock

from ._checkpoint import check_keys, unwrap_state_dict
from ._factory import LkcnnModel, create_lkcnn_model

__all__ = ["UniRepLKNet", "UniRepLKNetBlock"]

# the official depth settings, and the per-block kernel sizes of each: 3x3 in stage 1, 13x13 in stages 2-4, and in
# the deep third stages of T (13 alternating with 3) and S/B/L/XL (13 then two 3s)
_DEPTHS_AFP, _DEPTHS_N, _DEPTHS_T, _DEPTHS_SBLXL = (2, 2, 6, 2), (2, 2, 8, 2), (3, 3, 18, 3), (3, 3, 27, 3)
_K_AFP = ((3, 3), (13, 13), (13,) * 6, (13, 13))
_K_N = ((3, 3), (13, 13), (13,) * 8, (13, 13))
_K_T = ((3,) * 3, (13,) * 3, (13, 3) * 9, (13,) * 3)
_K_SBLXL = ((3,) * 3, (13,) * 3, (13, 3, 3) * 9, (13,) * 3)
DEFAULT_KERNEL_SIZES = {_DEPTHS_AFP: _K_AFP, _DEPTHS_N: _K_N, _DEPTHS_T: _K_T, _DEPTHS_SBLXL: _K_SBLXL}

KernelSizes = int | Sequence[int | Sequence[int]] | None


class UniRepLKNetBlock(nn.Module):
    """dwconv (Dilated Reparam Block for K >= 7, plain depthwise conv for 3/5, none for 0) -> BN -> SE ->
    Linear 4C -> GELU -> GRN -> Linear (no bias) -> BN -> layer scale -> drop path, plus the residual.

    `reparameterize()` does the official folds: branches and `norm` into the depthwise conv's kernel and bias; GRN's
    bias, the last BatchNorm and the layer scale into `pwconv2`'s linear layer.
    """

    def __init__(self, dim: int, kernel_size: int, drop_path: float = 0.0, layer_scale_init_value: float = 1e-6,
                 deploy: bool = False, ffn_factor: float = 4.0) -> None:
        super().__init__()
        self.deploy = deploy
        if kernel_size == 0:
            self.dwconv = nn.Identity()
        elif kernel_size >= 7:
            self.dwconv = DilatedReparamBlock(dim, kernel_size, deploy=deploy)
        elif kernel_size in (3, 5):  # small kernels: PyTorch's convolution, as in the official code
            self.dwconv = nn.Conv2d(dim, dim, kernel_size, padding=kernel_size // 2, groups=dim, bias=deploy)
        else:
            raise ValueError(f"UniRepLKNet block kernel_size must be 0, 3, 5 or a tabled size >= 7, got {kernel_size}")
        self.norm = nn.Identity() if deploy or kernel_size == 0 else nn.BatchNorm2d(dim)
        self.se = SEBlock(dim, dim // 4)
        ffn_dim = int(ffn_factor * dim)
        self.pwconv1 = nn.Sequential(NCHWtoNHWC(), nn.Linear(dim, ffn_dim))
        self.act = GELUGRN(ffn_dim, use_bias=not deploy)
        if deploy:
            self.pwconv2 = nn.Sequential(nn.Linear(ffn_dim, dim), NHWCtoNCHW())
        else:
            self.pwconv2 = nn.Sequential(nn.Linear(ffn_dim, dim, bias=False), NHWCtoNCHW(), nn.BatchNorm2d(dim))
        use_ls = not deploy and layer_scale_init_value is not None and layer_scale_init_value > 0
        self.gamma = nn.Parameter(layer_scale_init_value * torch.ones(dim)) if use_ls else None
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.se(self.norm(self.dwconv(x)))
        y = self.pwconv2(self.act(self.pwconv1(y)))
        if self.gamma is not None:
            y = self.gamma.view(1, -1, 1, 1) * y
        return x + self.drop_path(y)

    @torch.no_grad()
    def reparameterize(self) -> None:
        """Fold into the deploy form in place (eval-mode statistics); a no-op when already deployed."""
        if isinstance(self.dwconv, DilatedReparamBlock):
            self.dwconv.reparameterize()
        if isinstance(self.norm, nn.BatchNorm2d):
            conv = self.dwconv.lk_origin if isinstance(self.dwconv, DilatedReparamBlock) else self.dwconv
            weight, bias = fuse_bn(conv.weight, self.norm, conv.bias)
            if conv.bias is None:
                conv.bias = nn.Parameter(bias)
            else:
                conv.bias.data.copy_(bias)
            conv.weight.data.copy_(weight)
            self.norm = nn.Identity()
        if len(self.pwconv2) == 3:
            scale = self.gamma.data if self.gamma is not None else 1.0
            linear, bn = self.pwconv2[0], self.pwconv2[2]
            grn = self.act[1]
            # GRN's bias goes through the linear layer as a constant: W @ beta joins the bias before the BN folds
            linear_bias = linear.bias if linear.bias is not None else torch.zeros_like(bn.running_mean)
            if grn.beta is not None:
                linear_bias = linear_bias + linear.weight @ grn.beta.reshape(-1)
                grn.beta = None
            weight, bias = fuse_bn(linear.weight, bn, linear_bias)
            merged = nn.Linear(linear.in_features, linear.out_features, bias=True,
                               device=weight.device, dtype=weight.dtype)
            merged.weight.data.copy_(weight * (scale.reshape(-1, 1) if torch.is_tensor(scale) else scale))
            merged.bias.data.copy_(bias * scale)
            self.pwconv2 = nn.Sequential(merged, self.pwconv2[1])
            self.gamma = None
        self.deploy = True


class UniRepLKNetStage(nn.Sequential):
    """The blocks of one stage; a plain Sequential so keys are `stages.{i}.{j}` as in the official code."""

    def __init__(self, *blocks: nn.Module) -> None:
        super().__init__(*blocks)
        self.grad_checkpointing = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.grad_checkpointing and not torch.jit.is_scripting():
            return checkpoint_seq(list(self), x)
        return super().forward(x)


def _stage_kernel_sizes(kernel_sizes: KernelSizes, depths: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Per-block kernel sizes: None -> the official table for these depths; else one int for all blocks, one int
    per stage, or a list of per-block sizes per stage (the official form)."""
    if kernel_sizes is None:
        if depths not in DEFAULT_KERNEL_SIZES:
            raise ValueError(f"UniRepLKNet has no default kernel sizes for depths {depths} (official settings: "
                             f"{sorted(DEFAULT_KERNEL_SIZES)}); pass kernel_sizes, one int per stage "
                             "(e.g. [3, 13, 13, 13]) or one list of per-block sizes per stage")
        return DEFAULT_KERNEL_SIZES[depths]
    if isinstance(kernel_sizes, int):
        kernel_sizes = [kernel_sizes] * len(depths)
    if len(kernel_sizes) != len(depths):
        raise ValueError(f"kernel_sizes needs one entry per stage ({len(depths)}), got {kernel_sizes}")
    out = []
    for i, (ks, depth) in enumerate(zip(kernel_sizes, depths)):
        ks = (int(ks),) * depth if isinstance(ks, int) else tuple(int(k) for k in ks)
        if len(ks) != depth:
            raise ValueError(f"stage {i} has {depth} blocks but kernel_sizes gives {len(ks)}: {ks}")
        out.append(ks)
    return tuple(out)


class UniRepLKNet(LkcnnModel, nn.Module):
    """UniRepLKNet: conv-LN-GELU-conv-LN stem (stride 4) -> 4 stages of UniRepLKNet blocks, joined by 3x3 stride-2
    conv-LN downsampling -> global average pool -> LayerNorm -> linear head."""

    def __init__(
            self,
            depths: Sequence[int] = (3, 3, 27, 3),
            dims: Sequence[int] = (96, 192, 384, 768),
            kernel_sizes: KernelSizes = None,
            layer_scale_init_value: float = 1e-6,
            head_init_scale: float = 1.0,
            deploy: bool = False,
            in_chans: int = 3,
            num_classes: int = 1000,
            global_pool: str = "avg",
            drop_rate: float = 0.0,
            drop_path_rate: float = 0.0,
    ) -> None:
        super().__init__()
        depths, dims = tuple(depths), tuple(dims)
        if len(depths) != 4 or len(dims) != 4:
            raise ValueError(f"UniRepLKNet has 4 stages: depths {depths} and dims {dims} need 4 entries each")
        stage_kernels = _stage_kernel_sizes(kernel_sizes, depths)
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.drop_rate = drop_rate
        self.grad_checkpointing = False

        self.downsample_layers = nn.ModuleList([nn.Sequential(
            ImageConv2d(in_chans, dims[0] // 2, 3, stride=2, padding=1),
            LayerNorm2d(dims[0] // 2, eps=1e-6),
            nn.GELU(),
            nn.Conv2d(dims[0] // 2, dims[0], 3, stride=2, padding=1),
            LayerNorm2d(dims[0], eps=1e-6),
        )])
        for i in range(3):
            self.downsample_layers.append(nn.Sequential(
                nn.Conv2d(dims[i], dims[i + 1], 3, stride=2, padding=1),
                LayerNorm2d(dims[i + 1], eps=1e-6),
            ))
        dpr = calculate_drop_path_rates(drop_path_rate, sum(depths))  # linear over all blocks, as the official code
        self.stages = nn.ModuleList()
        self.feature_info = []
        cur = 0
        for i in range(4):
            self.stages.append(UniRepLKNetStage(*[
                UniRepLKNetBlock(dims[i], stage_kernels[i][j], dpr[cur + j], layer_scale_init_value, deploy)
                for j in range(depths[i])]))
            self.feature_info.append(dict(num_chs=dims[i], reduction=2 ** (i + 2), module=f"stages.{i}"))
            cur += depths[i]
        self.num_features = self.head_hidden_size = dims[-1]
        self.global_pool = SelectAdaptivePool2d(pool_type=global_pool, flatten=True)
        self.norm = nn.LayerNorm(dims[-1], eps=1e-6)  # on the pooled features, as the official classifier
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(dims[-1], num_classes) if num_classes > 0 else nn.Identity()
        self.apply(self._init_weights)
        if isinstance(self.head, nn.Linear):
            self.head.weight.data.mul_(head_init_scale)
            self.head.bias.data.mul_(head_init_scale)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    @property
    def lkcnn_spec(self) -> dict[str, Any]:
        """The mixin's spec with `deploy` read from the blocks, so it stays true after timm's reparameterize_model."""
        spec = LkcnnModel.lkcnn_spec.fget(self)
        kwargs = {k: v for k, v in spec["kwargs"].items() if k != "deploy"}
        blocks = [m for m in self.modules() if isinstance(m, UniRepLKNetBlock)]
        if blocks and all(b.deploy for b in blocks):
            kwargs["deploy"] = True
        return {"name": spec["name"], "kwargs": kwargs}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict:
        """Layer-decay groups: the stem, then one group per block (a stage's downsampling joins its first block);
        the final norm sits in the head's group, as it belongs to the classifier."""
        return dict(
            stem=r"^downsample_layers\.0\.",
            blocks=r"^(?:downsample_layers|stages)\.(\d+)" if coarse else [
                (r"^downsample_layers\.(\d+)", (0,)),
                (r"^stages\.(\d+)\.(\d+)", None),
            ],
        )

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        for stage in self.stages:
            stage.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        self.num_classes = num_classes
        if global_pool is not None:
            self.global_pool = SelectAdaptivePool2d(pool_type=global_pool, flatten=True)
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()

    def forward_intermediates(
            self,
            x: torch.Tensor,
            indices: int | list[int] | None = None,
            norm: bool = False,
            stop_early: bool = False,
            output_fmt: str = "NCHW",
            intermediates_only: bool = False,
    ) -> list[torch.Tensor] | tuple[torch.Tensor, list[torch.Tensor]]:
        """Stage outputs at strides 4, 8, 16, 32 (timm's feature API, used by features_only=True). `norm` has no
        effect: the final LayerNorm acts on pooled features, not on maps."""
        if output_fmt != "NCHW":
            raise ValueError(f"UniRepLKNet features are NCHW only, got output_fmt={output_fmt!r}")
        take_indices, max_index = feature_take_indices(len(self.stages), indices)
        last = max_index if stop_early else len(self.stages) - 1
        intermediates = []
        for i in range(last + 1):
            x = self.stages[i](self.downsample_layers[i](x))
            if i in take_indices:
                intermediates.append(x)
        if intermediates_only:
            return intermediates
        return x, intermediates

    def prune_intermediate_layers(self, indices: int | list[int] = 1, prune_norm: bool = False,
                                  prune_head: bool = True) -> list[int]:
        """Drop the stages (and the head) after the last wanted feature."""
        take_indices, max_index = feature_take_indices(len(self.stages), indices)
        self.stages = self.stages[:max_index + 1]
        self.downsample_layers = self.downsample_layers[:max_index + 1]
        if prune_head:
            self.norm = nn.Identity()
            self.reset_classifier(0, "")
        return take_indices

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        for downsample, stage in zip(self.downsample_layers, self.stages):
            x = stage(downsample(x))
        return x

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.global_pool(x)
        if x.ndim == 4:  # global_pool="": the norm and the classifier act at every position
            x = x.permute(0, 2, 3, 1)
            x = self.head_drop(self.norm(x))
            return (x if pre_logits else self.head(x)).permute(0, 3, 1, 2)
        x = self.head_drop(self.norm(x))
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def checkpoint_filter_fn(state_dict: Mapping[str, object], model: nn.Module) -> dict[str, torch.Tensor]:
    """Official / lkcnn UniRepLKNet checkpoints: unwrap (`model`, `state_dict`, EMA, `module.` prefixes), merge a
    training-form checkpoint block by block when the model is built with deploy=True, and fail with one clear message
    on missing, unexpected or mis-shaped keys.

    lkcnn's shared filter is not used as is: it reads `downsample_layers.*` keys as Facebook ConvNeXt's and maps them
    to timm's ConvNeXt names, but they are UniRepLKNet's own.
    """
    state_dict = unwrap_state_dict(state_dict)
    target = getattr(model, "model", model)
    for name, block in target.named_modules():
        if not (isinstance(block, UniRepLKNetBlock) and block.deploy):
            continue
        prefix = f"{name}."
        if f"{prefix}pwconv2.2.running_var" not in state_dict:
            continue  # this block is already in deploy form
        sub = {k[len(prefix):]: state_dict.pop(k) for k in list(state_dict) if k.startswith(prefix)}
        kernel = 0 if isinstance(block.dwconv, nn.Identity) else block.dwconv.kernel_size[0]
        dim = block.pwconv2[0].out_features
        twin = UniRepLKNetBlock(dim, kernel, layer_scale_init_value=1.0 if "gamma" in sub else 0.0,
                                ffn_factor=block.pwconv2[0].in_features / dim)
        try:
            twin.load_state_dict(sub)
        except RuntimeError as err:
            raise ValueError(f"checkpoint weights for {name} do not fit a UniRepLKNet block of width {dim} and "
                             f"kernel {kernel}: {str(err).splitlines()[-1].strip()}") from None
        twin.eval().reparameterize()
        state_dict.update({prefix + k: v for k, v in twin.state_dict().items()})
    check_keys(state_dict, target)
    return state_dict


def _cfg(**kwargs) -> dict:
    return {
        "url": "", "num_classes": 1000, "input_size": (3, 224, 224), "pool_size": (7, 7),
        "crop_pct": 0.875, "interpolation": "bicubic", "mean": IMAGENET_DEFAULT_MEAN, "std": IMAGENET_DEFAULT_STD,
        "first_conv": "downsample_layers.0.0", "classifier": "head", "license": "apache-2.0",
        "paper_ids": "arXiv:2311.15599", "origin_url": "https://github.com/AILab-CVC/UniRepLKNet", **kwargs,
    }


# ImageNet-1K evaluation as the official code does it: 224 px resized to 256 and center-cropped (crop_pct 0.875,
# bicubic); at 384 px (the ImageNet-22K -> 1K fine-tunes of S/B/L/XL) the image is resized to 384x384 without a crop.
_CFG_384 = dict(input_size=(3, 384, 384), pool_size=(12, 12), crop_pct=1.0, crop_mode="squash")
default_cfgs = generate_default_cfgs({
    "unireplknet_a": _cfg(),
    "unireplknet_f": _cfg(),
    "unireplknet_p": _cfg(),
    "unireplknet_n": _cfg(),
    "unireplknet_t": _cfg(),
    "unireplknet_s": _cfg(),
    "unireplknet_s.in22k_ft_in1k_384": _cfg(**_CFG_384),
    "unireplknet_b": _cfg(),
    "unireplknet_b.in22k_ft_in1k_384": _cfg(**_CFG_384),
    "unireplknet_l": _cfg(),
    "unireplknet_l.in22k_ft_in1k_384": _cfg(**_CFG_384),
    "unireplknet_xl": _cfg(),
    "unireplknet_xl.in22k_ft_in1k_384": _cfg(**_CFG_384),
})


def _create(variant: str, pretrained: bool, model_args: dict, kwargs: dict) -> nn.Module:
    """create_lkcnn_model with this family's checkpoint_filter_fn (see its docstring) for pretrained weights (e.g.
    pretrained_cfg_overlay=dict(file=...))."""
    return create_lkcnn_model(UniRepLKNet, variant, pretrained, model_args, kwargs, filter_fn=checkpoint_filter_fn)


@register_model
def unireplknet_a(pretrained: bool = False, **kwargs) -> UniRepLKNet:
    """UniRepLKNet-A: 4.65M params (4.44M deployed)."""
    return _create("unireplknet_a", pretrained, dict(depths=_DEPTHS_AFP, dims=(40, 80, 160, 320)), kwargs)


@register_model
def unireplknet_f(pretrained: bool = False, **kwargs) -> UniRepLKNet:
    """UniRepLKNet-F: 6.49M params (6.24M deployed)."""
    return _create("unireplknet_f", pretrained, dict(depths=_DEPTHS_AFP, dims=(48, 96, 192, 384)), kwargs)


@register_model
def unireplknet_p(pretrained: bool = False, **kwargs) -> UniRepLKNet:
    """UniRepLKNet-P: 11.08M params (10.74M deployed)."""
    return _create("unireplknet_p", pretrained, dict(depths=_DEPTHS_AFP, dims=(64, 128, 256, 512)), kwargs)


@register_model
def unireplknet_n(pretrained: bool = False, **kwargs) -> UniRepLKNet:
    """UniRepLKNet-N: 18.82M params (18.32M deployed)."""
    return _create("unireplknet_n", pretrained, dict(depths=_DEPTHS_N, dims=(80, 160, 320, 640)), kwargs)


@register_model
def unireplknet_t(pretrained: bool = False, **kwargs) -> UniRepLKNet:
    """UniRepLKNet-T: 31.69M params (31.04M deployed)."""
    return _create("unireplknet_t", pretrained, dict(depths=_DEPTHS_T, dims=(80, 160, 320, 640)), kwargs)


@register_model
def unireplknet_s(pretrained: bool = False, **kwargs) -> UniRepLKNet:
    """UniRepLKNet-S: 56.46M params (55.65M deployed)."""
    return _create("unireplknet_s", pretrained, dict(depths=_DEPTHS_SBLXL, dims=(96, 192, 384, 768)), kwargs)


@register_model
def unireplknet_b(pretrained: bool = False, **kwargs) -> UniRepLKNet:
    """UniRepLKNet-B: 99.09M params (98.01M deployed)."""
    return _create("unireplknet_b", pretrained, dict(depths=_DEPTHS_SBLXL, dims=(128, 256, 512, 1024)), kwargs)


@register_model
def unireplknet_l(pretrained: bool = False, **kwargs) -> UniRepLKNet:
    """UniRepLKNet-L: 220.08M params (218.45M deployed)."""
    return _create("unireplknet_l", pretrained, dict(depths=_DEPTHS_SBLXL, dims=(192, 384, 768, 1536)), kwargs)


@register_model
def unireplknet_xl(pretrained: bool = False, **kwargs) -> UniRepLKNet:
    """UniRepLKNet-XL: 388.69M params (386.53M deployed)."""
    return _create("unireplknet_xl", pretrained, dict(depths=_DEPTHS_SBLXL, dims=(256, 512, 1024, 2048)), kwargs)
