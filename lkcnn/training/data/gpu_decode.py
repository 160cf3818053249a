"""`data.decode=gpu`: loader workers read JPEG bytes, the device decodes them with nvJPEG and augments the batch.

Decoding and resizing are most of the CPU pipeline's cost per image, and a training GPU needs many cores' worth of
them. With decode=gpu a worker only reads a file, parses its header (size, colour mode, EXIF orientation) and draws
the random crop and flips; the DataModule's `on_after_batch_transfer` decodes the batch with one batched
`torchvision.io.decode_jpeg(..., device=...)` call and runs crop + resize, flips, RandAugment (its ops drawn in the
worker too: gpu_randaugment), colour jitter, normalization and random erasing on the device. The ops and their
settings are read from timm's CPU pipeline (`create_transform`), so both paths follow one config; ops that only exist
for PIL images (timm's AutoAugment / AugMix, grayscale, blur) are skipped, and the DataModule says so once.

Files nvJPEG should not get - anything but a plain RGB JPEG: CMYK, grayscale, EXIF-rotated, PNG behind a .JPEG
name, or a JPEG without its end marker (truncated) - are decoded in the worker by the CPU path's own `load_rgb`
and travel decoded; a failure there is a `CorruptImage`, as on the CPU path. A JPEG the device decoder rejects is
retried on the CPU, then counted per data.on_corrupt. Everything here also runs with device="cpu" (libjpeg), which
is how the CPU tests run the device path.
"""
from __future__ import annotations

import dataclasses
import functools
import io
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from PIL import Image
from timm.data.auto_augment import RandAugment
from timm.data.random_erasing import RandomErasing
from timm.data.transforms import MaybeToTensor, RandomResizedCropAndInterpolation
from torch.utils.data import Dataset
from torchvision import transforms as T
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms.v2 import functional as F

from . import gpu_randaugment
from .datasets import CorruptImage, ImageFiles, load_rgb
from .gpu_randaugment import GpuRandAugment, Step
from ..errors import ConfigError

DECODE = ("cpu", "gpu")
JPEG_END = b"\xff\xd9"  # EOI: a truncated JPEG lacks it
ORIENTATION = 0x0112  # EXIF tag; 1 (or none) is upright

_SILENT = (MaybeToTensor, T.ToTensor, T.PILToTensor)  # the device path makes float tensors itself


def require_cuda() -> None:
    """decode=gpu needs nvJPEG, hence a CUDA device; a machine without one gets a one-line ConfigError."""
    if not torch.cuda.is_available():
        raise ConfigError("data.decode=gpu decodes JPEGs with nvJPEG and needs a CUDA GPU, and this machine has "
                          "none: set data.decode=cpu")


class Crop(NamedTuple):
    """What a worker drew for one training image: the crop box in the decoded image, flips, the resize filter and
    the RandAugment ops."""

    top: int
    left: int
    height: int
    width: int
    hflip: bool
    vflip: bool
    interpolation: F.InterpolationMode
    rand_augment: tuple[Step, ...] = ()


@dataclasses.dataclass
class DeviceTransform:
    """The CPU pipeline's ops, re-expressed for the device path; built by `device_transform` from timm's Compose.

    Training: a random resized crop (box drawn in the worker), flips, RandAugment, colour jitter, normalize, random
    erasing.
    Eval: resize (shorter side) and centre crop. `skipped` names the CPU pipeline's ops the device path lacks.
    """

    training: bool
    size: tuple[int, int]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    interpolation: Any = F.InterpolationMode.BILINEAR  # a mode, or a list to pick from per image (timm's "random")
    hflip: float = 0.0
    vflip: float = 0.0
    resize: Any = None  # eval: torchvision Resize size (int: the shorter side)
    rand_augment: GpuRandAugment | None = None
    color_jitter: T.ColorJitter | None = None
    random_erasing: RandomErasing | None = None
    skipped: tuple[str, ...] = ()

    def draw(self, image: Image.Image) -> Crop | None:
        """The worker's random draws for an image of this size (timm's own crop-box sampler); eval draws nothing."""
        if not self.training:
            return None
        top, left, height, width = RandomResizedCropAndInterpolation.get_params(image, self.scale, self.ratio)
        interpolation = random.choice(self.interpolation) if isinstance(self.interpolation, (list, tuple)) \
            else self.interpolation
        # torch.rand like torchvision's RandomHorizontalFlip, so the worker's seeding covers both draws
        hflip, vflip = bool(torch.rand(1) < self.hflip), bool(torch.rand(1) < self.vflip)
        ops = self.rand_augment.draw() if self.rand_augment is not None else ()
        return Crop(top, left, height, width, hflip, vflip, interpolation, ops)


def device_transform(pipeline: T.Compose, training: bool) -> DeviceTransform:
    """Read timm's `create_transform` pipeline into a DeviceTransform; a crop the device path cannot do is an error.

    Ops that change pixels but not geometry and exist only for PIL images are listed in `skipped` instead, so the
    caller can say what the device path leaves out.
    """
    steps = list(pipeline.transforms) if isinstance(pipeline, T.Compose) else [pipeline]
    found: dict[str, Any] = {"training": training, "mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0)}
    skipped, geometry = [], []
    for step in steps:
        if isinstance(step, RandomResizedCropAndInterpolation) and training:
            found.update(size=tuple(step.size), scale=tuple(step.scale), ratio=tuple(step.ratio),
                         interpolation=step.interpolation)
            geometry.append(step)
        elif isinstance(step, T.Resize) and not training:
            found.update(resize=step.size, interpolation=step.interpolation)
            geometry.append(step)
        elif isinstance(step, T.CenterCrop) and not training:
            found["size"] = tuple(step.size)
            geometry.append(step)
        elif isinstance(step, T.RandomHorizontalFlip):
            found["hflip"] = step.p
        elif isinstance(step, T.RandomVerticalFlip):
            found["vflip"] = step.p
        elif isinstance(step, RandAugment):
            missing = gpu_randaugment.unsupported(step)
            if missing:
                skipped.append(f"RandAugment (no device form of its {', '.join(missing)})")
            else:
                found["rand_augment"] = GpuRandAugment(step)
        elif isinstance(step, T.ColorJitter):
            found["color_jitter"] = step  # torchvision's own op: it takes float tensors as well as PIL images
        elif isinstance(step, T.Normalize):
            found.update(mean=tuple(float(m) for m in step.mean), std=tuple(float(s) for s in step.std))
        elif isinstance(step, RandomErasing):
            found["random_erasing"] = step
        elif not isinstance(step, _SILENT):
            skipped.append(type(step).__name__)
    expected = 1 if training else 2
    if len(geometry) != expected or "size" not in found:
        what = "a random resized crop" if training else "a resize and a centre crop"
        names = ", ".join(type(step).__name__ for step in steps)
        raise ConfigError(f"data.decode=gpu crops {'training' if training else 'eval'} images with {what} only, and "
                          f"this data.transform makes [{names}]: set data.decode=cpu")
    return DeviceTransform(**found, skipped=tuple(skipped))


@dataclasses.dataclass(frozen=True)
class EncodedImage:
    """A worker's output for one image: JPEG bytes (1-D uint8) or, for files nvJPEG should not get, the decoded
    (3, H, W) uint8 image; and the random draws."""

    data: torch.Tensor
    crop: Crop | None
    path: str


def read_for_device(path: str) -> tuple[torch.Tensor, Image.Image]:
    """(JPEG bytes or decoded CHW uint8 image, a PIL image of the right size) - the worker's whole job per file.

    PIL reads only the header of a plain JPEG here; anything else is decoded now with the CPU path's `load_rgb`
    (its exceptions are the file's: the caller marks it corrupt).
    """
    data = Path(path).read_bytes()
    with Image.open(io.BytesIO(data)) as header:  # lazy: parses the markers, decodes nothing
        plain = (header.format == "JPEG" and header.mode == "RGB" and header.getexif().get(ORIENTATION, 1) == 1
                 and data.rstrip(b"\0").endswith(JPEG_END))
        if plain:
            return torch.frombuffer(bytearray(data), dtype=torch.uint8), header
    image = load_rgb(io.BytesIO(data))
    return F.pil_to_tensor(image), image


class EncodedImageFiles(Dataset):
    """(path, class index) pairs served as `EncodedImage`s for the device path; corrupt files as `CorruptImage`."""

    def __init__(self, samples: Sequence[tuple[str, int]], transform: DeviceTransform) -> None:
        self.samples = list(samples)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[EncodedImage, int] | CorruptImage:
        path, target = self.samples[index]
        try:
            data, image = read_for_device(path)
        except Exception as err:  # PIL's errors are the file's (OSError, SyntaxError...), as in ImageFiles
            return CorruptImage(path, f"{type(err).__name__}: {err}")
        return EncodedImage(data, self.transform.draw(image), path), target

    def collate(self, samples: list[Any]) -> tuple[EncodedBatch | None, torch.Tensor | None, list[CorruptImage]]:
        """As `collate_skipping_corrupt`, with the images left as a list (their sizes differ) in an EncodedBatch
        that carries this dataset's transform (the device half needs it, whichever loader the batch came from)."""
        corrupt = [s for s in samples if isinstance(s, CorruptImage)]
        good = [s for s in samples if not isinstance(s, CorruptImage)]
        if not good:
            return None, None, corrupt
        return EncodedBatch([s[0] for s in good], self.transform), torch.tensor([s[1] for s in good]), corrupt


class EncodedBatch:
    """A batch for the device path. Deliberately no `.to()` and not a dataclass: Lightning's batch transfer leaves
    it on the host, where `decode_jpeg` wants its input even when it decodes on the GPU.

    Pickled (a loader worker handing it to the main process), the JPEG bytes of all images travel as one tensor:
    torch shares every tensor of a worker's batch through a shared-memory segment of its own, and receiving 64 of
    them cost the main process more than decoding and augmenting the batch on the GPU.
    """

    def __init__(self, images: list[EncodedImage], transform: DeviceTransform) -> None:
        self.images = images
        self.transform = transform

    def __len__(self) -> int:
        return len(self.images)

    def __getstate__(self) -> dict[str, Any]:
        jpegs = [image.data for image in self.images if image.data.dim() == 1]
        return {"transform": self.transform, "sizes": [len(data) for data in jpegs],
                "jpegs": torch.cat(jpegs) if jpegs else torch.empty(0, dtype=torch.uint8),
                "images": [image if image.data.dim() != 1 else dataclasses.replace(image, data=None)
                           for image in self.images]}

    def __setstate__(self, state: dict[str, Any]) -> None:
        jpegs = iter(torch.split(state["jpegs"], state["sizes"]))  # views of the one tensor
        self.transform = state["transform"]
        self.images = [image if image.data is not None else dataclasses.replace(image, data=next(jpegs))
                       for image in state["images"]]


_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def _decode_jpegs(data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """One batched decode_jpeg call on `device`.

    torchvision's CUDA decoder allocates its outputs on the current stream but writes them from a stream of its own
    that does not wait for it (pytorch/vision#9606), so on the training stream it can overwrite memory that queued
    kernels still read. Decoding with an idle side stream current avoids that; `record_stream` keeps the outputs'
    memory from being handed out again before the training stream has used them.
    """
    if device.type != "cuda":
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    main = torch.cuda.current_stream(device)
    side = _side_streams.setdefault(device, torch.cuda.Stream(device))
    with torch.cuda.stream(side):
        images = decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    main.wait_stream(side)
    for image in images:
        image.record_stream(main)
    return images


def _cpu_decode(data: torch.Tensor) -> torch.Tensor:
    return F.pil_to_tensor(load_rgb(io.BytesIO(data.numpy().tobytes())))


def decode(batch: EncodedBatch, device: torch.device | str) -> tuple[list[torch.Tensor | None], list[CorruptImage]]:
    """Every image of the batch as (3, H, W) uint8 on `device` (None where it failed), and the failures.

    One batched call for the JPEG bytes; if it fails, each image again alone, then on the CPU (PIL), so one bad
    file costs only itself.
    """
    device = torch.device(device)
    out: list[torch.Tensor | None] = [None] * len(batch)
    jpegs = [i for i, image in enumerate(batch.images) if image.data.dim() == 1]
    for i, image in enumerate(batch.images):
        if image.data.dim() == 3:  # decoded by the worker
            out[i] = image.data.to(device, non_blocking=True)
    try:
        decoded = _decode_jpegs([batch.images[i].data for i in jpegs], device) if jpegs else []
    except RuntimeError:
        decoded = [None] * len(jpegs)
    corrupt = []
    for i, image in zip(jpegs, decoded, strict=True):
        if image is None or image.shape[0] != 3:
            try:
                image = _decode_jpegs([batch.images[i].data], device)[0]
            except RuntimeError:
                try:
                    image = _cpu_decode(batch.images[i].data).to(device)
                except Exception as err:  # PIL's errors are the file's
                    corrupt.append(CorruptImage(batch.images[i].path, f"{type(err).__name__}: {err}"))
                    continue
        out[i] = image
    return out, corrupt


def _resized_crop(image: torch.Tensor, crop: Crop, size: tuple[int, int]) -> torch.Tensor:
    # Per image with torchvision's resize rather than one batched roi_align: the crops differ in size, roi_align
    # only samples bilinearly, and antialiased bicubic (as PIL does it on the CPU path) keeps both paths' images
    # alike; a batch is a few dozen small launches.
    box = image[:, crop.top:crop.top + crop.height, crop.left:crop.left + crop.width].float()
    return F.resize(box, list(size), interpolation=crop.interpolation, antialias=True)


def _eval_crop(image: torch.Tensor, transform: DeviceTransform) -> torch.Tensor:
    resized = F.resize(image.float(), transform.resize, interpolation=transform.interpolation, antialias=True)
    return F.center_crop(resized, list(transform.size))


def _flip(batch: torch.Tensor, images: list[int], dim: int) -> None:
    """Flip `images` of the batch along `dim` in place: one flip for all of them, not one per image."""
    if not images:
        return
    index = torch.tensor(images)
    if batch.is_cuda:  # an asynchronous copy: a pageable one would make the host wait for the queued work
        index = index.pin_memory()
    index = index.to(batch.device, non_blocking=True)
    batch.index_copy_(0, index, batch.index_select(0, index).flip(dim))


def resize(images: list[torch.Tensor], crops: list[Crop | None], transform: DeviceTransform) -> torch.Tensor:
    """Decoded uint8 images (on one device) -> the float batch (N, 3, H, W) in 0..1: training images cropped,
    resized and flipped as drawn, eval images resized and centre-cropped. Values are clamped after resizing, as
    PIL's uint8 output is (bicubic overshoots)."""
    if not transform.training:
        return torch.stack([_eval_crop(image, transform) for image in images]).clamp_(0, 255).div_(255)
    batch = torch.stack([_resized_crop(image, crop, transform.size) for image, crop in zip(images, crops, strict=True)])
    _flip(batch, [i for i, crop in enumerate(crops) if crop.hflip], -1)
    _flip(batch, [i for i, crop in enumerate(crops) if crop.vflip], -2)
    return batch.clamp_(0, 255).div_(255)


def rand_augment(batch: torch.Tensor, crops: list[Crop | None], transform: DeviceTransform) -> torch.Tensor:
    """RandAugment's ops the workers drew, on the float batch in 0..1 (unchanged without RandAugment)."""
    if transform.rand_augment is None:
        return batch
    return transform.rand_augment(batch, [crop.rand_augment for crop in crops])


def finish(batch: torch.Tensor, transform: DeviceTransform) -> torch.Tensor:
    """Colour jitter on the float batch in 0..1, normalization, then random erasing, as timm's pipeline orders them."""
    if transform.color_jitter is not None:
        batch = torch.stack([transform.color_jitter(image) for image in batch])
    mean, std = _normalization(transform.mean, transform.std, batch.device)
    batch = batch.sub_(mean).div_(std)
    if transform.random_erasing is not None:
        erasing = transform.random_erasing
        if str(erasing.device) != str(batch.device):  # the CPU pipeline made it for the CPU
            erasing = transform.random_erasing = _on_device(erasing, batch.device)
        batch = erasing(batch)
    return batch


def augment(images: list[torch.Tensor], crops: list[Crop | None], transform: DeviceTransform) -> torch.Tensor:
    """Decoded uint8 images (on one device) -> the normalized float batch (N, 3, H, W), as the CPU pipeline makes it:
    `resize`, `rand_augment`, `finish` (the stages `python -m lkcnn.bench loader --jpegs` times one by one)."""
    return finish(rand_augment(resize(images, crops, transform), crops, transform), transform)


@functools.lru_cache
def _normalization(mean: tuple[float, ...], std: tuple[float, ...],
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalize's mean and std (1, C, 1, 1) on `device`, made once: a tensor made from a list on a GPU is a copy
    that waits for the work queued there, which would keep the host from launching ahead."""
    return tuple(torch.tensor(values, device=device).view(1, -1, 1, 1) for values in (mean, std))


def _on_device(erasing: RandomErasing, device: torch.device) -> RandomErasing:
    moved = RandomErasing.__new__(RandomErasing)
    moved.__dict__.update(erasing.__dict__, device=device)
    return moved


def decode_batch(batch: EncodedBatch, device: torch.device | str
                 ) -> tuple[torch.Tensor | None, torch.Tensor, list[CorruptImage]]:
    """(images, indices of the batch's images that made it, corrupt markers): the device half of decode=gpu."""
    decoded, corrupt = decode(batch, device)
    keep = [i for i, image in enumerate(decoded) if image is not None]
    if not keep:
        return None, torch.tensor(keep, dtype=torch.long), corrupt
    images = augment([decoded[i] for i in keep], [batch.images[i].crop for i in keep], batch.transform)
    return images, torch.tensor(keep, dtype=torch.long), corrupt


def encoded_dataset(dataset: Dataset, transform: DeviceTransform, source: str) -> EncodedImageFiles:
    """The decode=gpu form of a source's dataset: only image files can be read as bytes."""
    if not isinstance(dataset, ImageFiles):
        raise ConfigError(f"data.decode=gpu reads image files, and {source} serves {type(dataset).__name__}: "
                          "set data.decode=cpu")
    return EncodedImageFiles(dataset.samples, transform)
