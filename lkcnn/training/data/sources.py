"""Where the images come from: scikit-learn's digits, a class-folder tree (ImageNet or any), or random tensors.

Each is an ImageDataModule that implements `make_datasets`; loading, augmentation and mixup are shared.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from .datamodule import ImageDataModule
from .datasets import ArrayImages, ImageFiles, RandomImages, Transform, scan_class_folders
from ..errors import ConfigError, PathNotFoundError


def carve_validation(targets: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) indices with `fraction` of every class in val, the same for the same seed."""
    if not 0 < fraction < 1:
        raise ConfigError(f"data.val_fraction={fraction} must be in (0, 1): the share of each class held out for "
                          "validation")
    rng = np.random.default_rng(seed)
    val = np.concatenate([rng.permutation(np.flatnonzero(targets == c))[:round(fraction * np.sum(targets == c))]
                          for c in np.unique(targets)])
    is_val = np.zeros(len(targets), dtype=bool)
    is_val[val] = True
    return np.flatnonzero(~is_val), np.flatnonzero(is_val)


class DigitsDataModule(ImageDataModule):
    """scikit-learn's 1797 handwritten digits (8x8, 10 classes), shipped with the package: no download.

    The 8x8 images are upsampled to `img_size` by the transforms (RandomResizedCrop / Resize).
    """

    def __init__(self, val_fraction: float = 0.2, split_seed: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if self.num_classes != 10:
            raise ConfigError(f"digits has 10 classes, got data.num_classes={self.num_classes}")
        self.val_fraction = val_fraction
        self.split_seed = split_seed

    def make_datasets(self, train_transform: Transform, eval_transform: Transform) -> tuple[Dataset, Dataset]:
        from sklearn.datasets import load_digits  # imported here: only this source needs scikit-learn

        digits = load_digits()
        images = np.round(digits.images * (255 / 16)).astype(np.uint8)  # pixel values are 0..16
        train, val = carve_validation(digits.target, self.val_fraction, self.split_seed)
        return (ArrayImages(images[train], digits.target[train], train_transform),
                ArrayImages(images[val], digits.target[val], eval_transform))


class ImageFolderDataModule(ImageDataModule):
    """Images in class folders: root/train/<class>/* and root/val/<class>/*, or root/<class>/* with a validation
    split carved out (`val_fraction` of every class). `require_val` insists on the train/ + val/ layout (ImageNet).
    """

    def __init__(self, root: str, val_fraction: float = 0.1, require_val: bool = False, split_seed: int = 0,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.root = Path(root).expanduser()
        self.val_fraction = val_fraction
        self.split_seed = split_seed
        has_split = (self.root / "train").is_dir()
        if not self.root.is_dir() or (require_val and not (has_split and (self.root / "val").is_dir())):
            raise PathNotFoundError(self._layout_message(require_val))
        self.train_dir = self.root / "train" if has_split else self.root
        self.val_dir = self.root / "val" if has_split and (self.root / "val").is_dir() else None

    def _layout_message(self, require_val: bool) -> str:
        missing = ("is not a folder" if self.root.exists() else "does not exist") if not self.root.is_dir() else \
            "lacks train/ and val/ folders"
        layout = (f"  {self.root}/train/<class>/<image>   (one folder per class)\n"
                  f"  {self.root}/val/<class>/<image>     (the same class folders)")
        if not require_val:
            layout += f"\nor, with {self.val_fraction:.0%} of each class held out for validation:\n" \
                      f"  {self.root}/<class>/<image>"
        return f"data.root={self.root} {missing}. Expected:\n{layout}\nPass data.root=/path/to/dataset."

    def _scan(self, folder: Path) -> tuple[list[str], list[tuple[str, int]]]:
        return scan_class_folders(folder, f". {self._layout_message(False)}")

    def make_datasets(self, train_transform: Transform, eval_transform: Transform) -> tuple[Dataset, Dataset]:
        classes, samples = self._scan(self.train_dir)
        if len(classes) != self.num_classes:
            raise ConfigError(f"{self.train_dir} has {len(classes)} class folders but data.num_classes="
                              f"{self.num_classes}: set data.num_classes={len(classes)}")
        if self.val_dir is not None:
            val_classes, val_samples = self._scan(self.val_dir)
            if val_classes != classes:
                only = sorted(set(val_classes) ^ set(classes))[:5]
                raise ConfigError(f"the class folders of {self.val_dir} differ from those of {self.train_dir} "
                                  f"({', '.join(only)} in one of them only): give both the same class folders")
            return ImageFiles(samples, train_transform), ImageFiles(val_samples, eval_transform)
        train, val = carve_validation(np.array([t for _, t in samples]), self.val_fraction, self.split_seed)
        return (ImageFiles([samples[i] for i in train], train_transform),
                ImageFiles([samples[i] for i in val], eval_transform))


class SyntheticDataModule(ImageDataModule):
    """Random tensors at `img_size` (no decoding, no augmentation): measures model and loader throughput."""

    def __init__(self, num_train: int = 10_000, num_val: int = 1_000, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.num_train = num_train
        self.num_val = num_val

    def make_datasets(self, train_transform: Transform, eval_transform: Transform) -> tuple[Dataset, Dataset]:
        return (RandomImages(self.num_train, self.num_classes, self.img_size),
                RandomImages(self.num_val, self.num_classes, self.img_size))
