"""Map-style datasets for the data sources, the scan of a class-folder tree, and the collate function that sets corrupt
images aside.

A corrupt file must not crash a DataLoader worker: the dataset returns a `CorruptImage` marker instead of a sample,
`collate_skipping_corrupt` drops markers from the batch and passes them on as a third element, and the
DataModule (main process) counts them in a warning or stops with a clear message.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from PIL import Image, ImageOps
from torch.utils.data import Dataset, default_collate
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

from ..errors import PathNotFoundError

Transform = Callable[[Image.Image], torch.Tensor]


@dataclass(frozen=True)
class CorruptImage:
    """Stands in for a sample whose file could not be decoded."""

    path: str
    error: str


def load_rgb(path: str | BinaryIO) -> Image.Image:
    """Decode a file (a path or an open binary file) fully as RGB, turned upright by its EXIF orientation tag (as a
    viewer shows it).

    Whatever the format inside (a PNG named .JPEG is fine), CMYK and grayscale become RGB; a truncated file fails
    here, in `load`, not later in a transform.
    """
    with Image.open(path) as image:
        image.load()
        ImageOps.exif_transpose(image, in_place=True)
        return image.convert("RGB")


class ImageFiles(Dataset):
    """(path, class index) pairs decoded with PIL (`load_rgb`) and transformed."""

    def __init__(self, samples: Sequence[tuple[str, int]], transform: Transform) -> None:
        self.samples = list(samples)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int] | CorruptImage:
        path, target = self.samples[index]
        try:
            image = load_rgb(path)
        except Exception as err:  # only PIL decodes here: whatever it raises (OSError, SyntaxError...) is the file's
            return CorruptImage(path, f"{type(err).__name__}: {err}")
        return self.transform(image), target


class ArrayImages(Dataset):
    """Grayscale uint8 images (N, H, W) held in memory, served as RGB PIL images through `transform`."""

    def __init__(self, images: np.ndarray, targets: np.ndarray, transform: Transform) -> None:
        self.images = images
        self.targets = targets
        self.transform = transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = Image.fromarray(self.images[index]).convert("RGB")  # uint8 (H, W) -> mode "L"
        return self.transform(image), int(self.targets[index])


class RandomImages(Dataset):
    """Normal-noise images with labels `index % num_classes`, the same for an index every time (throughput runs)."""

    def __init__(self, num_samples: int, num_classes: int, img_size: int) -> None:
        self.num_samples = num_samples
        self.num_classes = num_classes
        self.img_size = img_size

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        noise = torch.Generator().manual_seed(index)
        return torch.randn(3, self.img_size, self.img_size, generator=noise), index % self.num_classes


def collate_skipping_corrupt(samples: list[Any]) -> tuple[torch.Tensor | None, torch.Tensor | None,
                                                           list[CorruptImage]]:
    """(images, targets, corrupt markers); images and targets are None when every sample was corrupt."""
    corrupt = [s for s in samples if isinstance(s, CorruptImage)]
    good = [s for s in samples if not isinstance(s, CorruptImage)]
    if not good:
        return None, None, corrupt
    images, targets = default_collate(good)
    return images, targets, corrupt


def scan_class_folders(folder: Path, layout: str) -> tuple[list[str], list[tuple[str, int]]]:
    """(classes, (path, class index) samples) of `folder`/<class>/<image> as torchvision's ImageFolder sees them; a
    folder without class folders, or a class folder without images, is a PathNotFoundError ending in `layout`."""
    try:
        classes, class_to_idx = find_classes(str(folder))
        return classes, make_dataset(str(folder), class_to_idx, extensions=IMG_EXTENSIONS)
    except FileNotFoundError as err:
        raise PathNotFoundError(f"{str(err).rstrip('.')}{layout}") from err
