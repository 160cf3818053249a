"""timm's RandAugment for `data.decode=gpu`: a loader worker draws each image's ops, the device applies a batch.

`GpuRandAugment` wraps the `timm.data.auto_augment.RandAugment` that timm's `create_transform` built from the config
string (the RepLKNet recipe's `rand-m9-mstd0.5-inc1`), so timm parses it and timm's own code draws: `draw` runs a copy
of it whose ops record themselves instead of changing an image, which keeps timm's op choice (num_layers, choice
weights), per-op probability, magnitude noise and clamp, level-to-argument functions (random signs, the increasing
variants) and interpolation draw, and the worker's RNG streams, as the CPU path has them. `__call__` applies a batch
of such plans: one group of images per (position in the plan, op), so a batch costs a bounded number of launches and
host-to-device copies whatever its size.

The ops follow the PIL functions timm calls, on uint8 images:
- Equalize, Invert: torchvision's ops, which compute PIL's lookup tables per image and channel.
- AutoContrast: PIL's table in double, as PIL computes it; torchvision's, in float32, is a level off for some entries.
- Posterize, Solarize, SolarizeAdd, and Color, Contrast, Brightness, Sharpness (ImageEnhance: a blend with a
  "degenerate" image): written here, because torchvision's take one argument per call where a group needs one per
  image, and their degenerate images are not PIL's (float luma weights 0.2989/0.587/0.114 against PIL's rounded
  fixed-point ones, an unrounded mean for Contrast). PIL's blend truncates, as here.
- Rotate, ShearX/Y, TranslateX/Y(Rel): PIL's affine transform (each output pixel centre mapped by PIL's matrix,
  neighbours clamped at the border, the fill colour wherever the source point falls outside the image, truncation)
  as one grid_sample per group; torchvision's affine takes one matrix per call and blends the fill into edge pixels.
  grid_sample's bicubic is Keys' cubic with a = -0.75 where PIL's transform uses a = -1: a slightly softer bicubic,
  a fraction of a level off on average. PIL's nearest runs in 16.16 fixed point and picks the other pixel at some
  ties.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as nnf
from PIL import Image
from timm.data import auto_augment
from torchvision.transforms.v2 import functional as F

from . import augment
from ..errors import ConfigError

_MODES = {Image.Resampling.NEAREST: "nearest", Image.Resampling.BILINEAR: "bilinear",
          Image.Resampling.BICUBIC: "bicubic"}  # the filters PIL's transform takes


class Step(NamedTuple):
    """One op drawn for one image: timm's op name, the arguments its level function gave, and for geometric ops the
    PIL filter (timm draws one per op when the recipe's interpolation is "random")."""

    name: str
    args: tuple[float, ...]
    resample: int | None = None


class _Record:
    """Stands in for an op's PIL function in a copy of timm's RandAugment: appends the op to the plan it is given."""

    def __init__(self, name: str, geometric: bool) -> None:
        self.name, self.geometric = name, geometric

    def __call__(self, plan: tuple[Step, ...], *args: Any, **kwargs: Any) -> tuple[Step, ...]:
        resample = int(auto_augment._interpolation(kwargs)) if self.geometric else None
        return (*plan, Step(self.name, tuple(args), resample))


def _per_image(p: torch.Tensor) -> torch.Tensor:
    return p.view(-1, 1, 1, 1)


def _blend(degenerate: torch.Tensor, x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`Image.blend(degenerate, image, factor)`, all of ImageEnhance's work: float32, clipped, truncated."""
    d = degenerate.float()
    return (d + _per_image(p[:, 0]) * (x.float() - d)).clamp_(0, 255).to(torch.uint8)


def _luma(x: torch.Tensor) -> torch.Tensor:
    """PIL's convert("L") (ITU-R 601-2 in 16-bit fixed point, rounded): (N, 1, H, W) int32."""
    r, g, b = x.int().unbind(1)
    return ((r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16).unsqueeze(1)


def _color(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return _blend(_luma(x), x, p)


def _contrast(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    luma = _luma(x)
    pixels = luma[0].numel()
    mean = (2 * luma.sum((1, 2, 3), keepdim=True) + pixels) // (2 * pixels)  # PIL's int(mean + 0.5)
    return _blend(mean, x, p)


def _brightness(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return _blend(torch.zeros((), device=x.device), x, p)


def _sharpness(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    # PIL's SMOOTH filter: kernel 1 1 1 / 1 5 1 / 1 1 1 over 13 (the 3x3 sum plus 4 centres), rounded (sums of
    # integers over 13 are never within float error of .5), the outermost rows and columns kept
    f = x.float()
    smooth = nnf.avg_pool2d(f, 3, stride=1, divisor_override=1).add_(f[..., 1:-1, 1:-1], alpha=4)
    degenerate = x.clone()
    degenerate[..., 1:-1, 1:-1] = smooth.div_(13).add_(0.5).floor_().to(torch.uint8)
    return _blend(degenerate, x, p)


def _autocontrast(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    # PIL's lookup table, int(i * scale + offset), in double as PIL computes it: torchvision's float32 division lands
    # on the other side of a whole level for some entries (hi - lo = 255, say), one level off for all their pixels
    lo, hi = x.amin((-2, -1), keepdim=True).double(), x.amax((-2, -1), keepdim=True).double()
    scale = torch.full_like(lo, 255.0) / (hi - lo)  # `255.0 / t` multiplies by a rounded reciprocal instead
    stretched = (x.double() * scale + -lo * scale).clamp_(0, 255).to(torch.uint8)
    return torch.where(hi > lo, stretched, x)


def _posterize(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    bits = p[:, 0].clamp(1, 8)  # augment.posterize's rule: at least 1 bit, 8 and more the image unchanged
    return x & _per_image((256 - 2 ** (8 - bits)).to(torch.uint8))


def _solarize(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= _per_image(p[:, 0]), 255 - x, x)


def _solarize_add(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    added = (x.short() + _per_image(p[:, 0].short())).clamp_(0, 255).to(torch.uint8)
    return torch.where(x < 128, added, x)  # 128: timm's solarize_add threshold, which RandAugment never sets


PIXEL_OPS: dict[Callable, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    auto_augment.auto_contrast: _autocontrast,
    auto_augment.equalize: lambda x, p: F.equalize(x),
    auto_augment.invert: lambda x, p: F.invert(x),
    augment.posterize: _posterize,
    auto_augment.posterize: _posterize,
    auto_augment.solarize: _solarize,
    auto_augment.solarize_add: _solarize_add,
    auto_augment.color: _color,
    auto_augment.contrast: _contrast,
    auto_augment.brightness: _brightness,
    auto_augment.sharpness: _sharpness,
}
"""The device form of each PIL function timm's ops call: (uint8 images, per-image args (N, k)) -> uint8 images."""


def _rotation(degrees: float, w: int, h: int) -> tuple[float, ...]:
    """PIL's `Image.rotate` matrix: about the centre, output to input."""
    a = -math.radians(degrees)
    cos, sin = round(math.cos(a), 15), round(math.sin(a), 15)
    cx, cy = w / 2, h / 2
    return cos, sin, cx - cos * cx - sin * cy, -sin, cos, cy + sin * cx - cos * cy


AFFINE_OPS: dict[Callable, Callable[..., tuple[float, ...]]] = {
    auto_augment.rotate: _rotation,
    auto_augment.shear_x: lambda f, w, h: (1, f, 0, 0, 1, 0),
    auto_augment.shear_y: lambda f, w, h: (1, 0, 0, f, 1, 0),
    auto_augment.translate_x_rel: lambda pct, w, h: (1, 0, pct * w, 0, 1, 0),
    auto_augment.translate_y_rel: lambda pct, w, h: (1, 0, 0, 0, 1, pct * h),
    auto_augment.translate_x_abs: lambda px, w, h: (1, 0, px, 0, 1, 0),
    auto_augment.translate_y_abs: lambda px, w, h: (1, 0, 0, 0, 1, px),
}
"""The PIL AFFINE matrix (a, b, c, d, e, f: input = (a x + b y + c, d x + e y + f)) of each geometric op."""


def affine(x: torch.Tensor, matrices: torch.Tensor, mode: str, fill: torch.Tensor) -> torch.Tensor:
    """PIL's `Image.transform(size, AFFINE, matrix, resample, fillcolor=fill)` for a batch, one matrix (N, 6) each."""
    n, _, h, w = x.shape
    m = matrices.view(n, 6, 1, 1)
    ys = torch.arange(h, device=x.device, dtype=torch.float32).view(h, 1) + 0.5  # PIL maps pixel centres
    xs = torch.arange(w, device=x.device, dtype=torch.float32).view(1, w) + 0.5
    sx = m[:, 0] * xs + m[:, 1] * ys + m[:, 2]
    sy = m[:, 3] * xs + m[:, 4] * ys + m[:, 5]
    inside = ((sx >= 0) & (sx < w) & (sy >= 0) & (sy < h)).unsqueeze(1)
    if mode == "nearest":  # PIL takes the pixel the point falls in; grid_sample rounds ties to even
        sx, sy = sx.floor() + 0.5, sy.floor() + 0.5
    grid = torch.stack((sx * (2 / w) - 1, sy * (2 / h) - 1), -1)
    out = nnf.grid_sample(x.float(), grid, mode=mode, padding_mode="border", align_corners=False)
    # where PIL (in double) samples a pixel centre exactly, grid_sample's float32 coordinates land within ~1e-3 of
    # a level below it, which PIL's truncation would make a whole level: 3e-3 absorbs that
    out = out.add_(3e-3).clamp_(0, 255).to(torch.uint8)
    return torch.where(inside, out, fill.view(1, -1, 1, 1))


def unsupported(randaugment: auto_augment.RandAugment) -> list[str]:
    """The names of the policy's ops without a device form here (timm's "3a" set's Desaturate and GaussianBlur)."""
    return sorted(op.name for op in randaugment.ops if op.aug_fn not in PIXEL_OPS and op.aug_fn not in AFFINE_OPS)


class GpuRandAugment:
    """A timm RandAugment split in two: `draw` (per image, where timm would run it) and `__call__` (per batch)."""

    def __init__(self, randaugment: auto_augment.RandAugment) -> None:
        if unsupported(randaugment):
            raise ValueError(f"no device form of RandAugment's {', '.join(unsupported(randaugment))}")
        self.functions = {op.name: op.aug_fn for op in randaugment.ops}
        self.fill = tuple(randaugment.ops[0].kwargs["fillcolor"])
        other = {r for op in randaugment.ops for r in _as_tuple(op.kwargs["resample"])} - set(_MODES)
        if other:
            name = Image.Resampling(other.pop()).name.lower()
            raise ConfigError(f"RandAugment rotates, shears and translates with nearest, bilinear or bicubic filtering "
                              f"only (PIL's transform), and data.transform.interpolation is {name}: set one of those")
        ops = []
        for op in randaugment.ops:
            op = copy.copy(op)
            op.aug_fn = _Record(op.name, op.aug_fn in AFFINE_OPS)
            ops.append(op)
        self.recorder = auto_augment.RandAugment(ops, randaugment.num_layers, randaugment.choice_weights)
        self._fills: dict[torch.device, torch.Tensor] = {}

    def draw(self) -> tuple[Step, ...]:
        """The ops timm's RandAugment would apply to the next image, in order, with their arguments."""
        return self.recorder(())

    def __call__(self, images: torch.Tensor, plans: Sequence[Sequence[Step]]) -> torch.Tensor:
        """Images (N, 3, H, W), uint8 or float in 0..1 (rounded to PIL's 8 bits), with their drawn plans -> the
        augmented images, same dtype."""
        if len(plans) != len(images):
            raise ValueError(f"{len(plans)} plans for {len(images)} images")
        h, w = images.shape[-2:]
        groups: dict[tuple[int, Any], tuple[list[int], list[tuple[float, ...]]]] = {}
        for i, plan in enumerate(plans):
            for position, step in enumerate(plan):
                function = self.functions[step.name]
                if function in AFFINE_OPS:
                    key, params = (position, step.resample), AFFINE_OPS[function](*step.args, w, h)
                else:
                    key, params = (position, step.name), (*step.args, *[0.0] * (6 - len(step.args)))
                rows, group_params = groups.setdefault(key, ([], []))
                rows.append(i)
                group_params.append(params)
        if not groups:
            return images
        order = sorted(groups, key=lambda key: key[0])  # by position; the groups of one position are disjoint
        table = torch.tensor([[i, *p] for key in order for i, p in zip(*groups[key])], dtype=torch.float64)
        if images.is_cuda:  # one asynchronous copy of every index and argument of the batch
            table = table.pin_memory()
        table = table.to(images.device, non_blocking=True)
        index, params = table[:, 0].long(), table[:, 1:].float()  # float32 holds every argument closely enough
        x = images.clone() if images.dtype == torch.uint8 else images.mul(255).round_().clamp_(0, 255).byte()
        start = 0
        for key in order:
            rows = slice(start, start + len(groups[key][0]))
            start = rows.stop
            group = x.index_select(0, index[rows])
            if isinstance(key[1], str):
                out = PIXEL_OPS[self.functions[key[1]]](group, params[rows])
            else:
                out = affine(group, params[rows], _MODES[key[1]], self._fill(x.device))
            x.index_copy_(0, index[rows], out)
        return x if images.dtype == torch.uint8 else x.to(images.dtype).div_(255)

    def _fill(self, device: torch.device) -> torch.Tensor:
        if device not in self._fills:
            self._fills[device] = torch.tensor(self.fill, dtype=torch.uint8, device=device)
        return self._fills[device]

    def __getstate__(self) -> dict[str, Any]:  # workers draw only; device tensors stay in this process
        return {**self.__dict__, "_fills": {}}


def _as_tuple(value: Any) -> tuple:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)
