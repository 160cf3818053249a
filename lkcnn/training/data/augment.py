"""timm's AutoAugment / RandAugment ops, made to work with every Pillow: imported by the module that builds transforms.

timm's "increasing" posterize (RandAugment `inc1`, the RepLKNet recipe `rand-m9-mstd0.5-inc1`) keeps
`4 - int(4 * m / 10)` bits, so magnitude 10 - reached at m9 whenever the magnitude noise (mstd0.5) draws >= 10 - asks
`PIL.ImageOps.posterize` for 0 bits; plain `Posterize` does the same below magnitude 2.5. Pillow up to 12 turned
that into an all-black image (timm's author asked whether that was ever intended in
https://github.com/tensorflow/tpu/issues/495); Pillow 13 raises `ValueError: bits must be between or equal to 1
and 8`, which stops training about once in 700 images. The ops here keep at least 1 bit - the strongest
posterize that still leaves an image - so the recipe strings keep their ops, magnitudes and noise.
"""
from __future__ import annotations

from typing import Any

from PIL import Image, ImageOps
from timm.data import auto_augment

POSTERIZE_OPS = ("Posterize", "PosterizeIncreasing", "PosterizeOriginal")


def kept_bits(bits_to_keep: float) -> int:
    """The bits `posterize` keeps: timm's argument clamped to Pillow's 1..8 (8: the image unchanged)."""
    return min(8, max(1, int(bits_to_keep)))


def posterize(img: Image.Image, bits_to_keep: int, **_: Any) -> Image.Image:
    """timm's posterize op with `kept_bits` (8 and more: the image unchanged)."""
    bits = kept_bits(bits_to_keep)
    return img if bits == 8 else ImageOps.posterize(img, bits)


def register_safe_ops() -> None:
    """Put `posterize` in timm's op table (read when a RandAugment / AutoAugment transform is built); idempotent.

    Only entries that still hold timm's own op are replaced, so a replacement made elsewhere is left alone.
    """
    for name in POSTERIZE_OPS:
        if auto_augment.NAME_TO_OP.get(name) is auto_augment.posterize:
            auto_augment.NAME_TO_OP[name] = posterize


register_safe_ops()
