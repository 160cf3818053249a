"""Data tests: the digits default, class-folder datasets (with and without val/), corrupt files, a missing root,
mixup / label smoothing, synthetic tensors, the epoch-seeded sampler, batch-size and worker-count settings.
(Real JPEGs through the ImageNet recipe: test_imagenet_pipeline.py.)"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from PIL import Image

from lkcnn.training import (
    ConfigError,
    CorruptImageError,
    DigitsDataModule,
    ImageFolderDataModule,
    PathNotFoundError,
    SyntheticDataModule,
    user_error_message,
)
from lkcnn.training.seeding import EpochShuffleSampler
from lkcnn.training.data.sources import carve_validation

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"img_size": 16, "batch_size": 4, "transform": {"hflip": 0.0, "color_jitter": 0.0}}


def write_images(folder: Path, counts: dict[str, int], rng: np.random.Generator) -> None:
    for name, count in counts.items():
        (folder / name).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            pixels = rng.integers(0, 256, size=(int(rng.integers(8, 24)), int(rng.integers(8, 24)), 3), dtype=np.uint8)
            Image.fromarray(pixels).save(folder / name / f"{i}.png")


def batches(dm, train: bool = True, training: bool = False):
    """What Lightning feeds the module: loader output through the DataModule's transfer hooks."""
    dm.trainer = SimpleNamespace(training=training)
    loader = dm.train_dataloader() if train else dm.val_dataloader()
    for batch in loader:
        yield dm.on_after_batch_transfer(dm.on_before_batch_transfer(batch, 0), 0)


def test_carve_validation_holds_out_a_fraction_of_every_class():
    rng = np.random.default_rng()
    targets = rng.integers(0, 7, size=int(rng.integers(200, 400)))
    fraction = float(rng.uniform(0.1, 0.5))
    train, val = carve_validation(targets, fraction, seed=3)
    assert np.intersect1d(train, val).size == 0 and len(train) + len(val) == len(targets)
    for c in np.unique(targets):
        assert np.sum(targets[val] == c) == round(fraction * np.sum(targets == c))
    again = carve_validation(targets, fraction, seed=3)
    assert np.array_equal(again[1], val)
    assert not np.array_equal(carve_validation(targets, fraction, seed=4)[1], val)
    with pytest.raises(ConfigError, match="fraction"):
        carve_validation(targets, 1.5, seed=0)


def test_digits_default_config_serves_upsampled_normalized_batches():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=["paths.output_dir=/tmp/x"])
    dm = instantiate(cfg.data)
    dm.setup("fit")
    assert len(dm.train_set) + len(dm.val_set) == 1797 and abs(len(dm.val_set) - 0.2 * 1797) < 10
    images, targets = next(batches(dm))
    assert images.shape == (cfg.data.batch_size, 3, cfg.data.img_size, cfg.data.img_size)
    assert images.min() >= -1 and images.max() <= 1 and images.std() > 0.1
    assert targets.dtype == torch.int64 and 0 <= targets.min() and targets.max() <= 9
    assert sum(len(t) for _, t in batches(dm, train=False)) == len(dm.val_set)  # val keeps every image
    with pytest.raises(ConfigError, match="10 classes"):
        DigitsDataModule(num_classes=11, **SMALL)


def test_imagefolder_carves_validation_when_there_is_no_val_folder(tmp_path):
    rng = np.random.default_rng()
    counts = {f"class_{i}": int(rng.integers(5, 9)) for i in range(3)}
    write_images(tmp_path, counts, rng)
    dm = ImageFolderDataModule(root=str(tmp_path), num_classes=3, val_fraction=0.4, **SMALL)
    dm.setup("fit")
    assert len(dm.val_set) == sum(round(0.4 * n) for n in counts.values())
    assert len(dm.train_set) + len(dm.val_set) == sum(counts.values())
    assert not {p for p, _ in dm.train_set.samples} & {p for p, _ in dm.val_set.samples}
    images, targets = next(batches(dm))
    assert images.shape == (4, 3, 16, 16) and set(targets.tolist()) <= {0, 1, 2}


def test_imagefolder_uses_train_and_val_folders(tmp_path):
    rng = np.random.default_rng()
    write_images(tmp_path / "train", {"a": 6, "b": 5}, rng)
    write_images(tmp_path / "val", {"a": 2, "b": 3}, rng)
    dm = ImageFolderDataModule(root=str(tmp_path), num_classes=2, require_val=True, **SMALL)
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set)) == (11, 5)
    assert all("/val/" in p for p, _ in dm.val_set.samples)
    with pytest.raises(ConfigError, match="data.num_classes=2"):
        ImageFolderDataModule(root=str(tmp_path), num_classes=5, **SMALL).setup("fit")


def test_missing_root_fails_with_the_expected_layout(tmp_path):
    with pytest.raises(PathNotFoundError, match=r"does not exist(.|\n)*/train/<class>/<image>"):
        ImageFolderDataModule(root=str(tmp_path / "nowhere"), num_classes=2, require_val=True, **SMALL)
    write_images(tmp_path / "flat", {"a": 2}, np.random.default_rng())  # a class-folder tree, but no train/val
    with pytest.raises(PathNotFoundError, match="lacks train/ and val/"):
        ImageFolderDataModule(root=str(tmp_path / "flat"), num_classes=1, require_val=True, **SMALL)
    (tmp_path / "empty").mkdir()
    with pytest.raises(PathNotFoundError, match="class folder"):
        ImageFolderDataModule(root=str(tmp_path / "empty"), num_classes=1, **SMALL).setup("fit")


@pytest.mark.parametrize("root, message", [
    ("{tmp}/imagenet", "does not exist. Expected:\n  {tmp}/imagenet/train/<class>/<image>"),
    (None, "Error: data.root has no value: set it on the command line"),
])
def test_missing_root_on_the_command_line_is_one_message(tmp_path, root, message):
    args = ["data=imagenet", f"hydra.run.dir={tmp_path}/run"] + ([f"data.root={root.format(tmp=tmp_path)}"] if root else [])
    result = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True, check=False,
                            timeout=300, env={**os.environ, "HYDRA_FULL_ERROR": "0"})
    assert result.returncode == 1
    assert message.format(tmp=tmp_path) in result.stderr and "Traceback" not in result.stderr


def make_corrupt_folder(root: Path, rng: np.random.Generator) -> None:
    """Two classes of 7 good images plus one undecodable file each (random bytes; a truncated PNG)."""
    write_images(root, {"a": 7, "b": 7}, rng)
    (root / "a" / "garbage.jpg").write_bytes(rng.integers(0, 256, size=300, dtype=np.uint8).tobytes())
    truncated = root / "b" / "truncated.png"
    Image.fromarray(rng.integers(0, 256, size=(64, 64, 3), dtype=np.uint8)).save(truncated)
    truncated.write_bytes(truncated.read_bytes()[:400])


def test_corrupt_images_are_skipped_and_counted_even_in_workers(tmp_path, caplog):
    make_corrupt_folder(tmp_path, np.random.default_rng())
    dm = ImageFolderDataModule(root=str(tmp_path), num_classes=2, val_fraction=0.25, num_workers=2, **SMALL)
    dm.setup("fit")  # 12 training images (three full batches of 4) and 4 validation images: all are read
    with caplog.at_level(logging.WARNING):
        seen = sum(len(t) for _, t in batches(dm, training=True))
        seen += sum(len(t) for _, t in batches(dm, train=False))
    assert dm.num_corrupt == 2 and seen == 14
    assert "2 so far" in caplog.text and "data.on_corrupt=error" in caplog.text


def test_corrupt_image_fails_clearly_when_asked(tmp_path):
    make_corrupt_folder(tmp_path, np.random.default_rng())
    dm = ImageFolderDataModule(root=str(tmp_path), num_classes=2, on_corrupt="error", val_fraction=0.25, **SMALL)
    dm.setup("fit")
    with pytest.raises(CorruptImageError, match="cannot decode .*(garbage.jpg|truncated.png).*on_corrupt=skip"):
        for _ in [*batches(dm, training=True), *batches(dm, train=False)]:
            pass


def test_mixup_and_label_smoothing_make_soft_targets():
    num_classes = int(np.random.default_rng().integers(3, 20))
    dm = SyntheticDataModule(num_classes=num_classes, num_train=10, num_val=4, img_size=8, batch_size=6,
                             mixup={"mixup_alpha": 0.8, "cutmix_alpha": 1.0}, label_smoothing=0.1)
    dm.setup("fit")
    dm.trainer = SimpleNamespace(training=True)
    images, targets = torch.randn(5, 3, 8, 8), torch.randint(0, num_classes, (5,))  # odd: a corrupt image skipped
    mixed_images, soft = dm.on_after_batch_transfer((images, targets), 0)
    assert mixed_images.shape == (4, 3, 8, 8) and soft.shape == (4, num_classes)
    torch.testing.assert_close(soft.sum(1), torch.ones(4))
    assert soft.min() >= 0.1 / num_classes - 1e-6 and soft.max() <= 1 - 0.1 + 0.1 / num_classes + 1e-6
    dm.trainer.training = False  # validation keeps hard labels
    assert dm.on_after_batch_transfer((images, targets), 0)[1] is targets
    smooth = SyntheticDataModule(num_classes=num_classes, img_size=8, batch_size=6, label_smoothing=0.2)
    smooth.trainer = SimpleNamespace(training=True)
    soft = smooth.on_after_batch_transfer((images, targets), 0)[1]
    assert torch.equal(soft.argmax(1), targets)
    torch.testing.assert_close(soft.max(1).values, torch.full((5,), 0.8 + 0.2 / num_classes))
    with pytest.raises(ConfigError, match="even batch"):
        SyntheticDataModule(num_classes=4, img_size=8, batch_size=7, mixup={"mixup_alpha": 1.0})


def test_synthetic_samples_are_fixed_per_index():
    dm = SyntheticDataModule(num_classes=7, num_train=20, num_val=5, img_size=12, batch_size=4)
    dm.setup("fit")
    index = int(np.random.default_rng().integers(0, 20))
    first, again = dm.train_set[index], dm.train_set[index]
    assert first[0].shape == (3, 12, 12) and torch.equal(first[0], again[0]) and first[1] == index % 7
    assert not torch.equal(first[0], dm.train_set[(index + 1) % 20][0])


def test_epoch_sampler_order_depends_only_on_seed_and_epoch():
    n, seed = int(np.random.default_rng().integers(50, 100)), int(np.random.default_rng().integers(1 << 30))
    a, b = EpochShuffleSampler(range(n), seed), EpochShuffleSampler(range(n), seed)
    a.set_epoch(3)
    b.set_epoch(5)
    b.set_epoch(3)
    assert sorted(a) == list(range(n)) and list(a) == list(b)
    assert torch.equal(torch.randint(1 << 30, (4,), generator=a.generator),
                       torch.randint(1 << 30, (4,), generator=b.generator))
    b.set_epoch(4)
    assert list(a) != list(b)


def test_train_loader_takes_its_epoch_at_the_first_batch_not_at_iter():
    dm = SyntheticDataModule(num_classes=5, num_train=12, num_val=4, img_size=4, batch_size=4, num_workers=1,
                             seed=int(np.random.default_rng().integers(1 << 30)))
    dm.setup("fit")
    loader = dm.train_dataloader()
    iterator = iter(loader)  # as Lightning does while configuring a resumed run, before set_epoch
    loader.sampler.set_epoch(7)
    targets = torch.cat([t for _, t, _ in iterator])
    assert targets.tolist() == [i % 5 for i in loader.sampler]  # epoch 7's order


def compose_data(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=list(overrides)).data


@pytest.mark.parametrize("batch_size", [0, -1])
def test_a_batch_size_below_one_is_a_one_line_config_error(batch_size):
    cfg = compose_data("data=synthetic", f"data.batch_size={batch_size}")
    with pytest.raises(Exception) as info:
        instantiate(cfg)  # Hydra wraps the constructor's error: train.py prints user_error_message's line
    message = user_error_message(info.value)
    assert message == (f"data.batch_size={batch_size} must be a positive number of images per device: "
                       "set e.g. data.batch_size=64")
    with pytest.raises(ConfigError, match="data.num_workers=-2 must be 0 or more"):
        SyntheticDataModule(num_classes=3, img_size=8, batch_size=2, num_workers=-2)


@pytest.mark.parametrize("data", ["imagefolder", "imagenet"])
def test_default_workers_fit_the_cores(tmp_path, monkeypatch, data):
    rng = np.random.default_rng()
    write_images(tmp_path / "train", {"a": 4, "b": 4}, rng)
    write_images(tmp_path / "val", {"a": 2, "b": 2}, rng)
    cfg = compose_data(f"data={data}", f"data.root={tmp_path}", "data.num_classes=2", "data.batch_size=2",
                       "data.img_size=16")
    assert cfg.num_workers is None  # the shipped default: sized to the machine
    cores = len(os.sched_getaffinity(0))
    dm = instantiate(cfg)
    dm.setup("fit")
    assert dm.num_workers == min(8, cores)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when a loader asks for more workers than there are cores
        dm.train_dataloader().check_worker_number_rationality()
    for usable, expected in ((int(rng.integers(1, 8)), None), (int(rng.integers(9, 256)), 8)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=usable: set(range(n)))
        assert instantiate(cfg).num_workers == (expected or usable)
    assert instantiate(cfg, num_workers=3).num_workers == 3  # an explicit count is kept
