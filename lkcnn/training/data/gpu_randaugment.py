"""timm's RandAugment for `data.decode=gpu`: a loader worker draws each image's ops, the device applies a batch.

`GpuRandAugment` wraps the `timm.data.auto_augment.RandAugment` that timm's `create_transform` built from the config
string (the RepLKNet recipe's `rand-m9-mstd0.5-inc1`), so timm parses it and timm's own code draws: `draw` runs a copy
of it whose ops record themselves instead of changing an image, which keeps timm's op choice (num_layers, choice
weights), per-op probability, magnitude noise and clamp, level-to-argument functions (random signs, the increasing
variants) and interpolation draw, and the worker's RNG streams, as the CPU path has them. `__call__` applies a batch
of such plans position by position, each op kind in one batched form for every image that drew it there, whichever op
it drew: one table lookup for Posterize, Solarize, SolarizeAdd, Invert, AutoContrast and Equalize, one blend for
Color, Contrast, Brightness and Sharpness, one grid_sample per filter for the geometric ops. A batch so costs a
bounded number of launches (about 150 for the recipe) and one host-to-device copy, whatever its size and draws: on
a GPU each launch costs the host microseconds, which is what bounds this work there.

The ops follow the PIL functions timm calls, on whole levels 0..255:
- Posterize, Solarize, SolarizeAdd, Invert: PIL's `point` tables from their arguments. Equalize: PIL's table from the
  histogram, as torchvision's equalize computes it. AutoContrast: PIL's table in double, as PIL computes it;
  torchvision's, in float32, is a level off for some entries.
- Color, Contrast, Brightness, Sharpness (ImageEnhance: a blend with a "degenerate" image): written here, because
  torchvision's take one argument per call where a batch needs one per image, and their degenerate images are not
  PIL's (float luma weights 0.2989/0.587/0.114 against PIL's rounded fixed-point ones, an unrounded mean for
  Contrast). PIL's blend truncates, as here.
- Rotate, ShearX/Y, TranslateX/Y(Rel): PIL's affine transform (each output pixel centre mapped by PIL's matrix,
  neighbours clamped at the border, the fill colour wherever the source point falls outside the image, truncation)
  as one grid_sample per filter; torchvision's affine takes one matrix per call and blends the fill into edge
  pixels. grid_sample's bicubic is Keys' cubic with a = -0.75 where PIL's transform uses a = -1: a slightly softer
  bicubic, a fraction of a level off on average. PIL's nearest runs in 16.16 fixed point and picks the other pixel
  at some ties.
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


LOOKUP, BLEND = "lookup", "blend"
AUTOCONTRAST, EQUALIZE = 1.0, 2.0  # lookup kinds whose tables depend on the image (0: a table from the arguments)


def _posterize(bits: float) -> tuple[float, ...]:
    # v & ~(q - 1) is v - v mod q
    return 2.0 ** (8 - augment.kept_bits(bits)), 0, 0, 0, 0, 0


PIXEL_OPS: dict[Callable, tuple[str, Callable[..., tuple[float, ...]]]] = {
    auto_augment.auto_contrast: (LOOKUP, lambda: (1, 0, 0, 0, 0, AUTOCONTRAST)),
    auto_augment.equalize: (LOOKUP, lambda: (1, 0, 0, 0, 0, EQUALIZE)),
    auto_augment.invert: (LOOKUP, lambda: (1, -1, 255, 0, 256, 0)),
    augment.posterize: (LOOKUP, _posterize),
    auto_augment.posterize: (LOOKUP, _posterize),
    auto_augment.solarize: (LOOKUP, lambda thresh: (1, -1, 255, thresh, 256, 0)),
    # 128: timm's solarize_add threshold, which RandAugment never sets
    auto_augment.solarize_add: (LOOKUP, lambda add: (1, 1, add, 0, 128, 0)),
    auto_augment.color: (BLEND, lambda factor: (factor, 1, 0, 0, 0, 0)),
    auto_augment.contrast: (BLEND, lambda factor: (factor, 0, 1, 0, 0, 0)),
    auto_augment.brightness: (BLEND, lambda factor: (factor, 0, 0, 0, 0, 0)),
    auto_augment.sharpness: (BLEND, lambda factor: (factor, 0, 0, 1, 0, 0)),
}
"""Each PIL function timm's ops call, as its batched form and a row of six numbers per image:
- LOOKUP, PIL's `Image.point` table per image and channel: (q, s, c, lo, hi, kind): clamp(s v + c, 0, 255) where
  lo <= v < hi, else v - v mod q; AutoContrast's and Equalize's tables are made from the image (kind).
- BLEND, ImageEnhance's `Image.blend(degenerate, image, factor)`: the factor, then the degenerate image's weights of
  luma (Color), mean luma (Contrast) and the smoothed image (Sharpness); all 0: black (Brightness)."""


def _tables(p: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """The lookup table (N, 1, 256) that each row `p` of PIXEL_OPS makes from its arguments alone."""
    q, s, c, lo, hi = (column.view(-1, 1, 1) for column in p.unbind(1)[:5])
    return torch.where((levels >= lo) & (levels < hi), levels.mul(s).add_(c).clamp_(0, 255), levels - levels.fmod(q))


def _lookup(x: torch.Tensor, p: torch.Tensor, tables: torch.Tensor, kinds: set[float],
            levels: torch.Tensor) -> torch.Tensor:
    """Each image's lookup op (its row `p` of PIXEL_OPS, its table from `_tables`) as one gather."""
    kind = p[:, 5].view(-1, 1, 1)
    indices = x.flatten(2).long()
    if AUTOCONTRAST in kinds:
        tables = torch.where(kind == AUTOCONTRAST, _autocontrast(x, levels), tables)
    if EQUALIZE in kinds:
        tables = torch.where(kind == EQUALIZE, _equalize(indices, levels), tables)
    return tables.expand(len(x), 3, 256).gather(2, indices).view_as(x)


def _autocontrast(x: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    # PIL's table, int(i * scale + offset), in double as PIL computes it: torchvision's float32 division lands on the
    # other side of a whole level for some entries (hi - lo = 255, say), one level off for all their pixels
    lo, hi = (bound.double().unsqueeze(-1) for bound in x.flatten(2).aminmax(dim=-1))
    scale = torch.full_like(lo, 255.0) / (hi - lo)  # `255.0 / t` multiplies by a rounded reciprocal instead
    stretched = (levels.double() * scale + -lo * scale).clamp_(0, 255).trunc_().float()
    return torch.where(hi > lo, stretched, levels)


def _equalize(indices: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    # PIL's ImageOps.equalize table, as torchvision's equalize computes it: step = the pixels below the last level
    # used // 255, table[i] = (pixels below level i + step // 2) // step; a step of 0 leaves the image unchanged
    histogram = torch.zeros((*indices.shape[:2], 256), dtype=torch.int32, device=indices.device)
    histogram.scatter_add_(2, indices, histogram.new_ones(1).expand_as(indices))
    at_or_below = histogram.cumsum(2)
    last = at_or_below.argmax(2, keepdim=True)  # the first level with every pixel at or below it
    step = (indices.shape[-1] - histogram.gather(2, last)).div_(255, rounding_mode="floor")
    table = (at_or_below - histogram).add_(step // 2).div_(step.clamp(min=1), rounding_mode="floor").clamp_(0, 255)
    return torch.where(step > 0, table.float(), levels)


def _blend(x: torch.Tensor, p: torch.Tensor, ops: set[Callable], constants: _Constants) -> torch.Tensor:
    """`Image.blend(degenerate, image, factor)` with each image's degenerate image (rows `p` of PIXEL_OPS): float32,
    clipped, truncated, as PIL's blend. Weights of 0 and 1 pick one degenerate image exactly."""
    factor, luma_weight, mean_weight, smooth_weight = (column.view(-1, 1, 1, 1) for column in p.unbind(1)[:4])
    degenerate = torch.zeros((), device=x.device)  # Brightness's black
    if ops & {auto_augment.color, auto_augment.contrast}:
        luma = _luma(x, constants.luma)
        degenerate = luma * luma_weight
        if auto_augment.contrast in ops:
            # PIL's int(mean + 0.5), in double: exact at any image size
            total = luma.sum((1, 2, 3), keepdim=True, dtype=torch.float64).add_(luma[0].numel() / 2)
            mean = total.div_(luma[0].numel(), rounding_mode="floor").float()
            degenerate = degenerate.addcmul_(mean, mean_weight)
    if auto_augment.sharpness in ops:
        degenerate = torch.addcmul(degenerate, _smooth(x, constants.interior), smooth_weight)
    return (x - degenerate).mul_(factor).add_(degenerate).clamp_(0, 255).trunc_()


def _luma(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """PIL's convert("L") (ITU-R 601-2 in 16-bit fixed point, rounded): (N, 1, H, W). Every partial sum is a whole
    number below 2**24, which float32 holds exactly."""
    return (x * weights).sum(1, keepdim=True).add_(0x8000).div_(0x10000, rounding_mode="floor")


def _smooth(x: torch.Tensor, interior: torch.Tensor) -> torch.Tensor:
    # PIL's SMOOTH filter: kernel 1 1 1 / 1 5 1 / 1 1 1 over 13 (the 3x3 sum plus 4 centres), rounded, the outermost
    # rows and columns kept
    total = nnf.avg_pool2d(x, 3, stride=1, padding=1, divisor_override=1).add_(x, alpha=4).add_(6.5)
    return torch.where(interior, total.div_(13, rounding_mode="floor"), x)


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


class _Constants(NamedTuple):
    """The tensors every batch of one image size on one device uses, made there once."""

    levels: torch.Tensor  # 0..255 in float32: the identity lookup table
    luma: torch.Tensor  # PIL's convert("L") weights, (1, 3, 1, 1)
    fill: torch.Tensor  # the geometric ops' fill colour, (1, 3, 1, 1)
    xs: torch.Tensor  # pixel centres (PIL maps those), (1, 1, W, 1) and (1, H, 1, 1)
    ys: torch.Tensor
    interior: torch.Tensor  # (1, 1, H, W), False on the outermost rows and columns
    size: torch.Tensor  # (W, H)
    to_grid: torch.Tensor  # (2 / W, 2 / H): pixels to grid_sample's -1..1

    @classmethod
    def make(cls, device: torch.device, h: int, w: int, fill: tuple[int, ...]) -> _Constants:
        def tensor(values: Any, *shape: int) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32).view(*shape).to(device)

        return cls(tensor(range(256), 256), tensor([19595, 38470, 7471], 1, 3, 1, 1), tensor(fill, 1, 3, 1, 1),
                   tensor([i + 0.5 for i in range(w)], 1, 1, w, 1), tensor([i + 0.5 for i in range(h)], 1, h, 1, 1),
                   nnf.pad(torch.ones(1, 1, h - 2, w - 2, dtype=torch.bool), (1, 1, 1, 1)).to(device),
                   tensor([w, h], 2), tensor([2 / w, 2 / h], 2))


def _sources(matrices: torch.Tensor, constants: _Constants) -> tuple[torch.Tensor, torch.Tensor]:
    """PIL's AFFINE transform's source point of each output pixel centre, (N, H, W, 2), one matrix (N, 6) per
    image, and whether it falls inside the image, (N, 1, H, W)."""
    m = matrices.view(-1, 1, 1, 2, 3)  # columns (a, d), (b, e), (c, f): the source point per output x, y and 1
    source = m[..., 0] * constants.xs + m[..., 1] * constants.ys + m[..., 2]
    return source, ((source >= 0) & (source < constants.size)).all(-1).unsqueeze(1)


def _affine(x: torch.Tensor, source: torch.Tensor, inside: torch.Tensor, mode: str,
            constants: _Constants) -> torch.Tensor:
    """PIL's `Image.transform(size, AFFINE, matrix, resample, fillcolor=fill)` at the points `_sources` gave."""
    if mode == "nearest":  # PIL takes the pixel the point falls in; grid_sample rounds ties to even
        source = source.floor() + 0.5
    grid = (source * constants.to_grid).sub_(1)
    out = nnf.grid_sample(x, grid, mode=mode, padding_mode="border", align_corners=False)
    # where PIL (in double) samples a pixel centre exactly, grid_sample's float32 coordinates land within ~1e-3 of
    # a level below it, which PIL's truncation would make a whole level: 3e-3 absorbs that
    out = out.add_(3e-3).clamp_(0, 255).trunc_()
    return torch.where(inside, out, constants.fill)


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
        self._constants: dict[tuple[torch.device, int, int], _Constants] = {}

    def draw(self) -> tuple[Step, ...]:
        """The ops timm's RandAugment would apply to the next image, in order, with their arguments."""
        return self.recorder(())

    def __call__(self, images: torch.Tensor, plans: Sequence[Sequence[Step]]) -> torch.Tensor:
        """Images (N, 3, H, W), uint8 or float in 0..1 (rounded to PIL's 8 bits), with their drawn plans -> the
        augmented images, same dtype."""
        if len(plans) != len(images):
            raise ValueError(f"{len(plans)} plans for {len(images)} images")
        h, w = images.shape[-2:]
        groups: dict[tuple[int, str | int], list[tuple[int, tuple[float, ...], Callable]]] = {}
        for i, plan in enumerate(plans):
            for position, step in enumerate(plan):
                function = self.functions[step.name]
                if function in AFFINE_OPS:
                    key, row = (position, step.resample), AFFINE_OPS[function](*step.args, w, h)
                else:
                    kind, make_row = PIXEL_OPS[function]
                    key, row = (position, kind), make_row(*step.args)
                groups.setdefault(key, []).append((i, row, function))
        if not groups:
            return images
        order = sorted(groups, key=lambda key: key[0])  # by position; the groups of one position are disjoint
        # the table lists the geometric ops' rows last, so one call makes the points all of them sample
        listed = sorted(order, key=lambda key: isinstance(key[1], int))
        table = torch.tensor([[i, *row] for key in listed for i, row, _ in groups[key]], dtype=torch.float64)
        if images.is_cuda:  # one asynchronous copy of every index and argument of the batch
            table = table.pin_memory()
        table = table.to(images.device, non_blocking=True)
        index, params = table[:, 0].long(), table[:, 1:].float()  # float32 holds every argument closely enough
        rows, start = {}, 0
        for key in listed:
            rows[key] = slice(start, start + len(groups[key]))
            start += len(groups[key])
        constants = self._constants.get((images.device, h, w))
        if constants is None:
            constants = self._constants[images.device, h, w] = _Constants.make(images.device, h, w, self.fill)
        tables = _tables(params, constants.levels) if any(key[1] == LOOKUP for key in order) else None
        geometric = next((rows[key].start for key in listed if isinstance(key[1], int)), len(params))
        sources, inside = _sources(params[geometric:], constants) if geometric < len(params) else (None, None)
        # whole levels 0..255 in float32 throughout: lookups, blends and grid_sample take them as they are
        x = images.float() if images.dtype == torch.uint8 else images.mul(255).round_().clamp_(0, 255)
        for key in order:
            at = rows[key]
            group = x.index_select(0, index[at])
            if key[1] == LOOKUP:
                kinds = {row[5] for _, row, _ in groups[key]}
                out = _lookup(group, params[at], tables[at], kinds, constants.levels)
            elif key[1] == BLEND:
                out = _blend(group, params[at], {function for _, _, function in groups[key]}, constants)
            else:
                at = slice(at.start - geometric, at.stop - geometric)
                out = _affine(group, sources[at], inside[at], _MODES[key[1]], constants)
            x.index_copy_(0, index[rows[key]], out)
        return x.to(torch.uint8) if images.dtype == torch.uint8 else x.to(images.dtype).div_(255)

    def __getstate__(self) -> dict[str, Any]:  # workers draw only; device tensors stay in this process
        return {**self.__dict__, "_constants": {}}


def _as_tuple(value: Any) -> tuple:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)

