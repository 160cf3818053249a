"""The DataModule machinery shared by every data source: timm transforms, loaders, mixup, corrupt-image policy.

Subclasses (lkcnn.training.data.sources) say only where the images come from, by implementing `make_datasets`.
Batches are (images, targets); in training the targets become soft (mixup/cutmix and label smoothing, timm's
`Mixup` / `mixup_target`) and the module picks SoftTargetCrossEntropy for them.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
from timm.data import Mixup, create_transform
from timm.data.mixup import mixup_target
from torch.utils.data import DataLoader, Dataset

from . import augment  # noqa: F401 - registers the RandAugment ops that work with every Pillow (posterize)
from . import gpu_decode
from .datasets import CorruptImage, Transform, collate_skipping_corrupt
from ..errors import ConfigError, CorruptImageError
from ..seeding import DeferredStartDataLoader, EpochShuffleSampler

log = logging.getLogger(__name__)

ON_CORRUPT = ("skip", "error")
MAX_DEFAULT_WORKERS = 8


def default_num_workers() -> int:
    """Loader workers when data.num_workers is null: one per core this process may use, at most 8.

    More workers than cores only share them (and torch warns); the cores are those of the process's CPU affinity
    (taskset, a container's cpuset), as torch's own check counts them.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(MAX_DEFAULT_WORKERS, cores)


class ImageDataModule(L.LightningDataModule):
    """Image classification data: (train, val) datasets from `make_datasets`, loaded and augmented the timm way.

    Args:
        num_classes: classes in the dataset (the model config reads it as ${data.num_classes}).
        img_size: square input resolution fed to the model.
        batch_size: per-device batch size (total = batch_size * devices * accumulate_grad_batches).
        num_workers: DataLoader worker processes; None: `default_num_workers()` (one per core, at most 8).
        pin_memory: pin batches in page-locked memory (only happens when CUDA is present).
        transform: keyword arguments for timm.data.create_transform (training and eval use the same dict;
            timm ignores the training-only keys for eval).
        mixup: keyword arguments for timm.data.Mixup (mixup_alpha, cutmix_alpha, prob, ...), or None.
        label_smoothing: applied to the training targets (inside Mixup when mixup is on).
        on_corrupt: "skip" drops undecodable images and counts each file once in a warning; "error" stops at the
            first.
        seed: shuffling and worker seeds derive from (seed, epoch); see lkcnn.training.seeding.
        decode: "cpu" decodes and augments in the loader workers (timm's pipeline); "gpu" has the workers read the
            JPEG bytes and the device decode (nvJPEG) and augment them (lkcnn.training.data.gpu_decode), image files only.
    """

    def __init__(self, num_classes: int, img_size: int, batch_size: int, num_workers: int | None = 0,
                 pin_memory: bool = True, transform: Mapping[str, Any] | None = None,
                 mixup: Mapping[str, Any] | None = None, label_smoothing: float = 0.0, on_corrupt: str = "skip",
                 seed: int = 0, decode: str = "cpu") -> None:
        super().__init__()
        if decode not in gpu_decode.DECODE:
            raise ConfigError(f"data.decode={decode!r} must be one of {', '.join(gpu_decode.DECODE)}")
        if decode == "gpu":
            gpu_decode.require_cuda()
        if on_corrupt not in ON_CORRUPT:
            raise ConfigError(f"data.on_corrupt={on_corrupt!r} must be one of {', '.join(ON_CORRUPT)}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"data.batch_size={batch_size} must be a positive number of images per device: "
                              "set e.g. data.batch_size=64")
        if num_workers is not None and (isinstance(num_workers, bool) or not isinstance(num_workers, int)
                                        or num_workers < 0):
            raise ConfigError(f"data.num_workers={num_workers} must be 0 or more (0 loads in the training "
                              "process), or null for one per core: set e.g. data.num_workers=null")
        if isinstance(img_size, bool) or not isinstance(img_size, int) or img_size < 1:
            raise ConfigError(f"data.img_size={img_size} must be a positive number of pixels: set e.g. "
                              "data.img_size=224")
        if mixup and batch_size % 2:
            raise ConfigError(f"mixup/cutmix needs an even batch, got data.batch_size={batch_size}")
        self.num_classes = num_classes
        self.img_size = img_size
        self.batch_size = batch_size
        self.num_workers = default_num_workers() if num_workers is None else num_workers
        self.pin_memory = pin_memory
        self.transform = dict(transform or {})
        self.label_smoothing = label_smoothing
        self.on_corrupt = on_corrupt
        self.seed = seed
        self.decode = decode
        self.mixup = Mixup(num_classes=num_classes, label_smoothing=label_smoothing, **mixup) if mixup else None
        self.corrupt_paths: set[str] = set()  # each file counted once, however many epochs skip it
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None

    def make_datasets(self, train_transform: Transform, eval_transform: Transform) -> tuple[Dataset, Dataset]:
        """(train, val) datasets yielding (image tensor, class index) or a CorruptImage marker."""
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            try:
                train_transform = create_transform(self.img_size, is_training=True, **self.transform)
                eval_transform = create_transform(self.img_size, is_training=False, **self.transform)
            except (AssertionError, KeyError, TypeError, ValueError) as err:  # timm's checks of its arguments
                raise ConfigError(f"data.transform: {type(err).__name__} {err} from timm's create_transform; its "
                                  "arguments are timm's (interpolation=bicubic, auto_augment=rand-m9-mstd0.5-inc1, "
                                  "...)") from err
            self.train_set, self.val_set = self.make_datasets(train_transform, eval_transform)
            if self.decode == "gpu":
                self._to_device_decode(train_transform, eval_transform)

    def _to_device_decode(self, train_transform: Transform, eval_transform: Transform) -> None:
        """Serve JPEG bytes for the device path, the augmentation read from the same timm pipelines."""
        source = type(self).__name__
        train, val = (gpu_decode.device_transform(t, training) for t, training in
                      ((train_transform, True), (eval_transform, False)))
        self.train_set = gpu_decode.encoded_dataset(self.train_set, train, source)
        self.val_set = gpu_decode.encoded_dataset(self.val_set, val, source)
        if train.skipped:  # never silently: the run trains without these ops
            log.warning("data.decode=gpu skips %s of data.transform (timm runs them on PIL images only, in the "
                        "workers); set data.decode=cpu for the full recipe", ", ".join(train.skipped))

    def _loader(self, dataset: Dataset, train: bool) -> DataLoader:
        sampler = EpochShuffleSampler(dataset, self.seed) if train else None
        return DeferredStartDataLoader(
            dataset, batch_size=self.batch_size, sampler=sampler, drop_last=train,
            generator=sampler.generator if sampler is not None else None,
            num_workers=self.num_workers, pin_memory=self.pin_memory and torch.cuda.is_available(),
            collate_fn=getattr(dataset, "collate", collate_skipping_corrupt))

    def train_dataloader(self) -> DataLoader:
        if len(self.train_set) < self.batch_size:
            raise ConfigError(f"the training set has {len(self.train_set)} images, fewer than "
                              f"data.batch_size={self.batch_size}: lower the batch size")
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Account for the corrupt images the collate function set aside (runs in the main process)."""
        images, targets, corrupt = batch
        if corrupt:
            self._report_corrupt(corrupt)
        if images is None:
            raise CorruptImageError(f"every image of a batch failed to decode, e.g. {corrupt[0].path} "
                                    f"({corrupt[0].error}): check the dataset files")
        return images, targets

    def _decode_on_device(self, batch: gpu_decode.EncodedBatch, targets: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        images, keep, corrupt = gpu_decode.decode_batch(batch, targets.device)
        if corrupt:
            self._report_corrupt(corrupt)
        if images is None:
            raise CorruptImageError(f"every image of a batch failed to decode, e.g. {corrupt[0].path} "
                                    f"({corrupt[0].error}): check the dataset files")
        return images, targets if len(keep) == len(targets) else targets[keep.to(targets.device)]

    @property
    def num_corrupt(self) -> int:
        """Distinct files skipped as corrupt so far in this run (this process)."""
        return len(self.corrupt_paths)

    def _report_corrupt(self, corrupt: list[CorruptImage]) -> None:
        first = corrupt[0]
        if self.on_corrupt == "error":
            raise CorruptImageError(f"cannot decode {first.path} ({first.error}). Remove or replace the file, "
                                    "or set data.on_corrupt=skip to skip such images with a warning")
        new = {c.path: c for c in corrupt if c.path not in self.corrupt_paths}
        if not new:  # reported when an earlier epoch met them: skipped again, silently
            return
        self.corrupt_paths.update(new)
        example = next(iter(new.values()))
        log.warning("skipped %d corrupt image(s), %d so far in this run (e.g. %s: %s); "
                    "set data.on_corrupt=error to stop instead", len(new), self.num_corrupt,
                    example.path, example.error)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """decode=gpu batches are decoded and augmented here, on the targets' device; training batches get soft
        targets: mixup/cutmix (on the device) and label smoothing."""
        images, targets = batch
        if isinstance(images, gpu_decode.EncodedBatch):
            images, targets = self._decode_on_device(images, targets)
        if self.trainer is None or not self.trainer.training:
            return images, targets
        if self.mixup is not None:
            if len(images) % 2:  # a skipped corrupt image left an odd batch; timm's Mixup needs pairs
                images, targets = images[:-1], targets[:-1]
            return self.mixup(images, targets)
        if self.label_smoothing > 0:
            return images, mixup_target(targets, self.num_classes, smoothing=self.label_smoothing)
        return images, targets
