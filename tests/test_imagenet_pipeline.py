"""The `data=imagenet` recipe on real JPEG files: every RandAugment op at every magnitude, the full train and val
pipelines (RandAugment, random erasing, mixup/cutmix) from the real Hydra config, and the odd files a real dataset
holds (CMYK, grayscale, a PNG named .JPEG, truncated, EXIF-rotated, tiny) under both `data.on_corrupt` modes.

The photos are scikit-learn's two sample images (china, flower), cut and re-encoded as JPEG by PIL in each test.
"""
from __future__ import annotations

import copy
import functools
import io
import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from PIL import Image, ImageOps
from timm.data import auto_augment, create_transform
from timm.data.auto_augment import RandAugment
from timm.data.random_erasing import RandomErasing

from lkcnn.training import CorruptImageError
from lkcnn.training.data import augment
from lkcnn.training.data.datasets import CorruptImage, load_rgb

ROOT = Path(__file__).resolve().parents[1]
BATCH = 4


@functools.cache
def _photos() -> tuple[np.ndarray, ...]:
    from sklearn.datasets import load_sample_images

    return tuple(load_sample_images().images)  # two (427, 640, 3) uint8 photos


def photo(rng: np.random.Generator, size: tuple[int, int] = (500, 375)) -> Image.Image:
    """A random crop of one of the sample photos, resized to `size` (ImageNet's typical 500x375), re-encoded as JPEG."""
    pixels = _photos()[int(rng.integers(len(_photos())))]
    h, w = int(rng.integers(200, 427)), int(rng.integers(300, 640))
    top, left = int(rng.integers(0, 428 - h)), int(rng.integers(0, 641 - w))
    image = Image.fromarray(pixels[top:top + h, left:left + w]).resize(size, Image.Resampling.BICUBIC)
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=int(rng.integers(75, 96)))
    return Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")


def write_imagenet(root: Path, train: int, val: int, rng: np.random.Generator, classes: int = 3) -> None:
    """ImageNet's layout, root/{train,val}/<wnid>/*.JPEG, with `train` / `val` real JPEGs per class."""
    for split, count in (("train", train), ("val", val)):
        for c in range(classes):
            folder = root / split / f"n{c:08d}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                photo(rng).save(folder / f"{split}_{c}_{i}.JPEG", "JPEG", quality=int(rng.integers(75, 96)))


def imagenet_config(root: Path, classes: int, **overrides: object):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=[
            "data=imagenet", f"data.root={root}", f"data.num_classes={classes}", "data.num_workers=0",
            f"data.batch_size={BATCH}", "data.img_size=64", *(f"data.{k}={v}" for k, v in overrides.items())])


class Counting:
    """Stands in for one transform of a Compose: counts its calls and the calls that changed the input."""

    def __init__(self, transform):
        self.transform, self.calls, self.changed = transform, 0, 0

    def __call__(self, x):
        before = x.clone() if isinstance(x, torch.Tensor) else np.asarray(x).copy()
        out = self.transform(x)  # RandomErasing works in place: compare against the copy
        after = out if isinstance(out, torch.Tensor) else np.asarray(out)
        self.calls += 1
        self.changed += before.shape != after.shape or not np.array_equal(np.asarray(before), np.asarray(after))
        return out


def instrument(dm) -> dict[type, Counting]:
    """Wrap the training pipeline's RandAugment and RandomErasing in counters."""
    steps = dm.train_set.transform.transforms
    counters = {}
    for i, step in enumerate(steps):
        if isinstance(step, (RandAugment, RandomErasing)):
            steps[i] = counters[type(step)] = Counting(step)
    assert set(counters) == {RandAugment, RandomErasing}, steps  # the recipe's transforms are in the pipeline
    return counters


def run_epoch(dm, epoch: int, train: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch as Lightning feeds the module: the loader through the DataModule's transfer hooks."""
    dm.trainer = SimpleNamespace(training=train)
    loader = dm.train_dataloader() if train else dm.val_dataloader()
    if train:
        loader.sampler.set_epoch(epoch)
    return [dm.on_after_batch_transfer(dm.on_before_batch_transfer(batch, 0), 0) for batch in loader]


def test_every_recipe_op_at_every_magnitude_on_a_real_photo():
    rng = np.random.default_rng()
    cfg = imagenet_config(Path("/unused"), 1000)  # the transform only: img_size 224, the recipe's hparams
    pipeline = create_transform(224, is_training=True, **cfg.data.transform)
    (randaugment,) = [t for t in pipeline.transforms if isinstance(t, RandAugment)]
    names = {op.name for op in randaugment.ops}
    assert "PosterizeIncreasing" in names and len(names) == 15  # rand-...-inc1: the "increasing" ops
    image = photo(rng)
    for template in randaugment.ops:
        for magnitude in range(11):
            for std, repeats in ((0.0, 1), (0.5, 4)):  # exact, then with the recipe's magnitude noise
                op = copy.copy(template)
                op.prob, op.magnitude, op.magnitude_std = 1.0, magnitude, std
                for _ in range(repeats):
                    out = op(image)
                    assert isinstance(out, Image.Image) and out.mode == "RGB" and out.size == image.size, op
    strongest = copy.copy(next(op for op in randaugment.ops if op.name == "PosterizeIncreasing"))
    strongest.prob, strongest.magnitude, strongest.magnitude_std = 1.0, 10, 0.0  # 0 bits by timm's table
    out = np.asarray(strongest(image))
    assert np.array_equal(out, np.asarray(ImageOps.posterize(image, 1)))  # one bit kept, not a black image
    assert len(np.unique(out)) == 2


def test_posterize_ops_registered_once_and_only_over_timms_own():
    names = augment.POSTERIZE_OPS
    assert all(auto_augment.NAME_TO_OP[n] is augment.posterize for n in names)
    augment.register_safe_ops()  # again: nothing changes
    assert all(auto_augment.NAME_TO_OP[n] is augment.posterize for n in names)
    image = photo(np.random.default_rng(), size=(40, 30))
    for bits in range(-1, 10):
        expected = image if bits >= 8 else ImageOps.posterize(image, max(bits, 1))
        assert np.array_equal(np.asarray(augment.posterize(image, bits)), np.asarray(expected))


def test_imagenet_train_and_val_pipelines_on_real_jpegs(tmp_path):
    rng = np.random.default_rng()
    write_imagenet(tmp_path, train=8, val=2, rng=rng)  # 24 training images: 6 batches of 4
    cfg = imagenet_config(tmp_path, 3)
    dm = instantiate(cfg.data)  # as train.py does
    dm.setup("fit")
    counters = instrument(dm)
    mixed = 0
    for epoch in range(2):
        for images, targets in run_epoch(dm, epoch, train=True):
            assert images.shape == (BATCH, 3, 64, 64) and images.dtype == torch.float32
            assert torch.isfinite(images).all() and images.std() > 0.1
            assert targets.shape == (BATCH, 3)  # soft: mixup/cutmix and label smoothing
            torch.testing.assert_close(targets.sum(1), torch.ones(BATCH))
            assert targets.min() >= 0.1 / 3 - 1e-6 and targets.max() <= 0.9 + 0.1 / 3 + 1e-6
            mixed += int(((targets > 0.1 / 3 + 0.02).sum(1) >= 2).any())  # two classes in one target
    assert counters[RandAugment].calls == 48 and counters[RandAugment].changed > 24
    assert counters[RandomErasing].calls == 48 and counters[RandomErasing].changed > 0  # p=0.25 of 48
    assert mixed > 0
    val = run_epoch(dm, 0, train=False)
    assert sum(len(t) for _, t in val) == 6
    for images, targets in val:
        assert images.shape[1:] == (3, 64, 64) and targets.dtype == torch.int64 and targets.max() <= 2
    assert dm.num_corrupt == 0


def write_odd_files(root: Path, rng: np.random.Generator) -> dict[str, Path]:
    """The odd files of a real dataset, in the first class of train/ (and a truncated one in val/)."""
    folder = root / "train" / "n00000000"
    files = {name: folder / f"odd_{name}.JPEG" for name in ("cmyk", "gray", "png", "truncated", "exif", "tiny")}
    photo(rng).convert("CMYK").save(files["cmyk"], "JPEG")
    photo(rng).convert("L").save(files["gray"], "JPEG")
    photo(rng).save(files["png"], "PNG")  # a PNG behind a .JPEG name
    photo(rng).save(files["truncated"], "JPEG")
    files["truncated"].write_bytes(files["truncated"].read_bytes()[:3000])
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: the stored pixels are turned 90 degrees counter-clockwise of upright
    upright = photo(rng)
    upright.transpose(Image.Transpose.ROTATE_90).save(files["exif"], "JPEG", exif=exif, quality=95)
    upright.save(root / "exif_upright.png")  # outside the class folders: the reference
    photo(rng, size=(5, 3)).save(files["tiny"], "JPEG")
    files["val_truncated"] = root / "val" / "n00000001" / "odd_truncated.JPEG"
    files["val_truncated"].write_bytes(files["truncated"].read_bytes()[:2000])
    return files


def test_odd_files_decode_as_upright_rgb_or_as_corrupt(tmp_path):
    rng = np.random.default_rng()
    write_imagenet(tmp_path, train=1, val=1, rng=rng)
    files = write_odd_files(tmp_path, rng)
    for name in ("cmyk", "gray", "png", "tiny"):
        image = load_rgb(str(files[name]))
        assert image.mode == "RGB" and image.size == ((5, 3) if name == "tiny" else (500, 375)), name
    upright = np.asarray(Image.open(tmp_path / "exif_upright.png"), dtype=float)
    rotated = load_rgb(str(files["exif"]))
    assert rotated.size == (500, 375)  # stored 375x500, turned by its tag
    error = np.abs(np.asarray(rotated, dtype=float) - upright).mean()  # JPEG's loss only
    wrong_turn = np.abs(np.asarray(rotated.rotate(180), dtype=float) - upright).mean()  # turned the other way
    assert error < 8 and error < wrong_turn / 3, (error, wrong_turn)
    dm = instantiate(imagenet_config(tmp_path, 3).data)
    dm.setup("fit")
    index = {Path(p).name: i for i, (p, _) in enumerate(dm.train_set.samples)}
    for name, path in files.items():
        if name.startswith("val"):
            continue
        sample = dm.train_set[index[path.name]]
        if name == "truncated":
            assert isinstance(sample, CorruptImage) and "truncated" in sample.error
        else:
            assert sample[0].shape == (3, 64, 64) and torch.isfinite(sample[0]).all() and sample[1] == 0, name


def test_odd_files_in_training_are_trained_or_skipped_and_counted_once(tmp_path, caplog):
    rng = np.random.default_rng()
    write_imagenet(tmp_path, train=6, val=2, rng=rng)  # 18 + 6 odd files = 24 training files, 6 full batches
    write_odd_files(tmp_path, rng)
    dm = instantiate(imagenet_config(tmp_path, 3).data)
    dm.setup("fit")
    assert len(dm.train_set) == 24 and len(dm.val_set) == 7
    counters = instrument(dm)
    with caplog.at_level(logging.WARNING, logger="lkcnn.training.data.datamodule"):
        for epoch in range(3):
            train, val = run_epoch(dm, epoch, train=True), run_epoch(dm, epoch, train=False)
            assert dm.num_corrupt == 2  # the truncated train and val files, counted once however many epochs
            assert all(torch.isfinite(images).all() for images, _ in train + val)
            assert sum(len(t) for _, t in val) == 6  # validation keeps every good image
    assert counters[RandAugment].calls == 3 * 23  # every training file but the truncated one, every epoch
    warnings = [r.getMessage() for r in caplog.records if "corrupt image" in r.getMessage()]
    assert len(warnings) == 2 and "1 so far" in warnings[0] and "2 so far" in warnings[1], warnings
    assert all("odd_truncated.JPEG" in w and "data.on_corrupt=error" in w for w in warnings)


def test_a_truncated_jpeg_stops_training_when_on_corrupt_is_error(tmp_path):
    rng = np.random.default_rng()
    write_imagenet(tmp_path, train=2, val=1, rng=rng)
    write_odd_files(tmp_path, rng)
    dm = instantiate(imagenet_config(tmp_path, 3, on_corrupt="error").data)
    dm.setup("fit")
    with pytest.raises(CorruptImageError, match=r"cannot decode \S*odd_truncated\.JPEG .*data\.on_corrupt=skip") \
            as info:
        run_epoch(dm, 0, train=True)
    assert "\n" not in str(info.value)
