"""Tar shards (lkcnn.training.data.shards): the converter's round trip against the class folders it read (classes, counts,
bytes, determinism, the source left untouched), refusing to overwrite, a corrupt member under both `data.on_corrupt`
modes, the index checks, the `data=imagenet_shards` recipe, and an exact resume after SIGKILL from shards.

The images are real JPEGs: crops of scikit-learn's sample photos (test_imagenet_pipeline.photo).
"""
from __future__ import annotations

import collections
import hashlib
import json
import logging
import signal
import tarfile
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from test_imagenet_pipeline import photo
from test_train_resume import final_state, finish, start
from torchvision.datasets import ImageFolder

from lkcnn.training import ConfigError, CorruptImageError, PathNotFoundError
from lkcnn.training.data.datasets import CorruptImage, load_rgb
from lkcnn.training.data.shards import ShardedImageDataModule, ShardsExistError, convert, main

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"img_size": 32, "batch_size": 4, "num_workers": 0, "transform": {"hflip": 0.0, "color_jitter": 0.0}}


def write_tree(root: Path, counts: dict[str, list[int]], rng: np.random.Generator) -> None:
    """root/<split>/<class>/*.JPEG with counts[split][c] small real JPEGs in class c (plus names with dots)."""
    for split, per_class in counts.items():
        for c, count in enumerate(per_class):
            folder = root / split / f"n{c:08d}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                name = f"{split}.{c}.{i}.JPEG" if i % 3 == 2 else f"{split}_{c}_{i}.JPEG"
                photo(rng, (48, 40)).save(folder / name, "JPEG", quality=int(rng.integers(75, 96)))


def snapshot(root: Path) -> dict[str, tuple[int, int, bytes]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns, hashlib.sha1(p.read_bytes()).digest())
            for p in sorted(root.rglob("*")) if p.is_file()}


def tar_members(dst: Path, split: str) -> list[tuple[str, bytes, int]]:
    """(name, image bytes, class from .cls) of every sample, read by tarfile alone (as any tar reader would)."""
    samples = []
    for shard in sorted(dst.glob(f"{split}-*.tar")):
        with tarfile.open(shard) as tar:
            members = tar.getmembers()
            assert [m.name.rsplit(".", 1)[1] for m in members] == ["jpg", "cls"] * (len(members) // 2)
            for image, label in zip(members[::2], members[1::2]):
                assert image.name.rsplit(".", 1)[0] == label.name.rsplit(".", 1)[0]
                assert "." not in image.name.rsplit(".", 1)[0].split("/")[-1]  # webdataset: key ends at first dot
                samples.append((image.name, tar.extractfile(image).read(), int(tar.extractfile(label).read())))
    return samples


def test_convert_round_trip_matches_the_class_folders(tmp_path, capsys):
    rng = np.random.default_rng()
    classes = int(rng.integers(2, 5))
    counts = {"train": [int(n) for n in rng.integers(1, 7, classes)],
              "val": [int(n) for n in rng.integers(1, 3, classes)]}
    write_tree(tmp_path / "src", counts, rng)
    before = snapshot(tmp_path / "src")
    shard_size = int(rng.integers(1, 6))
    indexes = convert(tmp_path / "src", tmp_path / "dst", shard_size=shard_size, echo=print)
    printed = capsys.readouterr().out
    assert snapshot(tmp_path / "src") == before  # the source tree is only read

    dst = tmp_path / "dst"
    for split in ("train", "val"):
        folder = ImageFolder(str(tmp_path / "src" / split))
        index = json.loads((dst / f"{split}.json").read_text())
        assert index == indexes[split] and index["classes"] == folder.classes
        assert index["samples"] == len(folder.samples) == sum(counts[split])
        assert [s["samples"] for s in index["shards"]] == \
            [min(shard_size, len(folder.samples) - i) for i in range(0, len(folder.samples), shard_size)]
        assert f"{split}: {len(folder.samples)} images of {classes} classes -> {len(index['shards'])} shards" in printed
        assert all(f"wrote {dst / s['file']} ({s['samples']} images" in printed for s in index["shards"])
        # every source file once, byte for byte, under its ImageFolder class index
        expected = collections.Counter((Path(p).read_bytes(), t) for p, t in folder.samples)
        members = tar_members(dst, split)
        assert collections.Counter((data, target) for _, data, target in members) == expected
        assert all(name.split("/")[0] == folder.classes[target] for name, _, target in members)
        # the dataset reads the same bytes by seeking, and decodes them as load_rgb decodes the source file
        dm = ShardedImageDataModule(root=str(dst), num_classes=classes, **SMALL)
        dm.setup("fit")
        data = dm.train_set if split == "train" else dm.val_set
        data.transform = np.asarray
        table = np.load(dst / f"{split}.npy")
        assert [int(t) for t in table[:, 3]] == [t for _, _, t in members]
        by_bytes = {Path(p).read_bytes(): p for p, _ in folder.samples}
        for i, (name, raw, target) in enumerate(members):
            pixels, label = data[i]
            assert label == target and np.array_equal(pixels, np.asarray(load_rgb(by_bytes[raw]))), name
    # training images lie in the seeded random order (mixed classes for streaming readers), val in ImageFolder's
    train = ImageFolder(str(tmp_path / "src" / "train")).samples
    shuffled = [Path(train[i][0]).read_bytes() for i in np.random.default_rng(0).permutation(len(train))]
    assert [data for _, data, _ in tar_members(dst, "train")] == shuffled
    val = ImageFolder(str(tmp_path / "src" / "val")).samples
    assert [data for _, data, _ in tar_members(dst, "val")] == [Path(p).read_bytes() for p, _ in val]

    again = convert(tmp_path / "src", tmp_path / "dst2", shard_size=shard_size, echo=lambda line: None)
    assert again == indexes
    assert {k: v[2] for k, v in snapshot(tmp_path / "dst2").items()} == {k: v[2] for k, v in snapshot(dst).items()}
    with pytest.raises(ConfigError, match="inside the source tree"):
        convert(tmp_path / "src", tmp_path / "src" / "shards")
    assert snapshot(tmp_path / "src") == before


def test_refuses_to_overwrite_unless_asked(tmp_path, capsys):
    rng = np.random.default_rng()
    write_tree(tmp_path / "src", {"train": [3, 2], "val": [1, 1]}, rng)
    convert(tmp_path / "src", tmp_path / "dst", shard_size=1, echo=lambda line: None)
    before = snapshot(tmp_path / "dst")
    assert sum(name.startswith("train-") for name in before) == 5
    with pytest.raises(ShardsExistError, match=r"train-000000\.tar exists: pass --overwrite"):
        convert(tmp_path / "src", tmp_path / "dst")
    with pytest.raises(SystemExit) as info:  # the command: one line, non-zero exit, nothing written
        main([str(tmp_path / "src"), str(tmp_path / "dst"), "--split", "val"])
    assert str(info.value).startswith("Error: ") and "val-000000.tar exists" in str(info.value)
    assert "\n" not in str(info.value) and snapshot(tmp_path / "dst") == before

    main([str(tmp_path / "src"), str(tmp_path / "dst"), "--split", "train", "--shard-size", "2", "--overwrite"])
    assert "train: 5 images of 2 classes -> 3 shards" in capsys.readouterr().out
    after = snapshot(tmp_path / "dst")
    assert sorted(n for n in after if n.startswith("train-")) == [f"train-00000{i}.tar" for i in range(3)]
    assert {n: v for n, v in after.items() if n.startswith("val")} == \
        {n: v for n, v in before.items() if n.startswith("val")}  # the split not asked for is untouched
    (tmp_path / "a_file").write_text("mine")
    with pytest.raises(SystemExit) as info:  # DST_ROOT under a file: one line, the file kept
        main([str(tmp_path / "src"), str(tmp_path / "a_file" / "dst")])
    assert str(info.value).startswith("Error: cannot write the shards under") and "\n" not in str(info.value)
    assert (tmp_path / "a_file").read_text() == "mine"


def corrupt_one_member(dst: Path) -> str:
    """Overwrite the bytes of one training image inside its shard (sizes unchanged); the member's name."""
    index, table = json.loads((dst / "train.json").read_text()), np.load(dst / "train.npy")
    shard, offset, size, _ = (int(v) for v in table[1])
    path = dst / index["shards"][shard]["file"]
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"not a jpeg" * (size // 10) + b"\0" * (size % 10))
    with tarfile.open(path) as tar:
        return next(m.name for m in tar.getmembers() if m.offset_data == offset)


def epoch_batches(dm: ShardedImageDataModule, epoch: int):
    dm.trainer = SimpleNamespace(training=True)
    loader = dm.train_dataloader()
    loader.sampler.set_epoch(epoch)
    return [dm.on_after_batch_transfer(dm.on_before_batch_transfer(b, 0), 0) for b in loader]


def test_a_corrupt_member_is_skipped_and_counted_once_or_stops_training(tmp_path, caplog):
    rng = np.random.default_rng()
    write_tree(tmp_path / "src", {"train": [4, 4], "val": [1, 1]}, rng)
    convert(tmp_path / "src", tmp_path / "dst", shard_size=3, echo=lambda line: None)
    member = corrupt_one_member(tmp_path / "dst")

    dm = ShardedImageDataModule(root=str(tmp_path / "dst"), num_classes=2, on_corrupt="skip", **SMALL)
    dm.setup("fit")
    sample = dm.train_set[1]
    assert isinstance(sample, CorruptImage) and sample.path.endswith(f"train-000000.tar:{member}")
    with caplog.at_level(logging.WARNING, logger="lkcnn.training.data.datamodule"):
        for epoch in range(2):
            batches = epoch_batches(dm, epoch)
            assert sum(len(t) for _, t in batches) == 7 and all(torch.isfinite(x).all() for x, _ in batches)
    warnings = [r.getMessage() for r in caplog.records if "corrupt image" in r.getMessage()]
    assert len(warnings) == 1 and f"train-000000.tar:{member}" in warnings[0], warnings
    assert dm.num_corrupt == 1

    dm = ShardedImageDataModule(root=str(tmp_path / "dst"), num_classes=2, on_corrupt="error", **SMALL)
    dm.setup("fit")
    with pytest.raises(CorruptImageError, match=rf"cannot decode \S*train-000000\.tar:{member} .*on_corrupt=skip"):
        epoch_batches(dm, 0)


def test_missing_or_mismatched_shards_end_in_one_line(tmp_path):
    rng = np.random.default_rng()
    write_tree(tmp_path / "src", {"train": [2, 2], "val": [1, 1]}, rng)
    with pytest.raises(PathNotFoundError, match="has no train/ folder"):
        convert(tmp_path / "src" / "train", tmp_path / "x")
    with pytest.raises(PathNotFoundError, match="does not exist"):
        ShardedImageDataModule(root=str(tmp_path / "nowhere"), num_classes=2, **SMALL)
    (tmp_path / "empty").mkdir()
    with pytest.raises(PathNotFoundError, match=r"train\.json does not exist \(convert .*python -m lkcnn"):
        ShardedImageDataModule(root=str(tmp_path / "empty"), num_classes=2, **SMALL).setup("fit")
    dst = tmp_path / "dst"
    convert(tmp_path / "src", dst, shard_size=2, echo=lambda line: None)
    with pytest.raises(ConfigError, match="data.num_classes=2"):
        ShardedImageDataModule(root=str(dst), num_classes=5, **SMALL).setup("fit")
    with open(dst / "train-000001.tar", "r+b") as f:  # an incomplete copy
        f.truncate(1024)
    with pytest.raises(ConfigError, match=r"train-000001\.tar has 1024 bytes, its index says \d+"):
        ShardedImageDataModule(root=str(dst), num_classes=2, **SMALL).setup("fit")
    (dst / "train.json").unlink()  # a conversion that stopped before its index
    with pytest.raises(PathNotFoundError, match="did not finish: run it again with --overwrite"):
        ShardedImageDataModule(root=str(dst), num_classes=2, **SMALL).setup("fit")


def shards_config(root: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=["data=imagenet_shards", f"data.root={root}", *overrides])


def test_imagenet_shards_config_is_the_imagenet_recipe(tmp_path):
    cfg = shards_config(tmp_path)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        imagenet = compose("train", overrides=["data=imagenet", f"data.root={tmp_path}"])
    for key in ("num_classes", "img_size", "batch_size", "on_corrupt", "transform", "mixup", "label_smoothing"):
        assert cfg.data[key] == imagenet.data[key], key
    rng = np.random.default_rng()
    write_tree(tmp_path / "src", {"train": [4, 4, 4], "val": [2, 2, 2]}, rng)
    convert(tmp_path / "src", tmp_path / "dst", echo=lambda line: None)
    dm = instantiate(shards_config(tmp_path / "dst", "data.num_classes=3", "data.num_workers=0",
                                   "data.img_size=32", "data.batch_size=4").data)
    dm.setup("fit")
    images, targets = epoch_batches(dm, 0)[0]  # RandAugment, random erasing, mixup/cutmix with smoothing
    assert images.shape == (4, 3, 32, 32) and targets.shape == (4, 3) and torch.isfinite(images).all()
    assert torch.allclose(targets.sum(1), torch.ones(4))


class RecordSamples(L.Callback):
    """Appends, per training step, the epoch, the step and a hash of each image of the batch as trained on (after
    augmentation) with its class to a JSON-lines file: the samples in their order."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_start(self, trainer: L.Trainer, module, batch, batch_idx: int) -> None:
        images, targets = batch
        hashes = [hashlib.sha1(image.contiguous().numpy().tobytes()).hexdigest()[:16] for image in images]
        with open(self.path, "a") as f:
            f.write(json.dumps({"epoch": trainer.current_epoch, "step": trainer.global_step,
                                "samples": list(zip(hashes, targets.tolist()))}) + "\n")


def recorded(path: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_trains_on_the_same_samples(tmp_path):
    """train.py on data=imagenet_shards (2 loader workers), killed half way through its second epoch and resumed
    from last.ckpt, trains the resumed epoch on the same augmented images in the same order as an uninterrupted run,
    and ends with the same weights."""
    rng = np.random.default_rng()
    write_tree(tmp_path / "src", {"train": [6, 6, 6], "val": [2, 2, 2]}, rng)
    convert(tmp_path / "src", tmp_path / "shards", shard_size=5, echo=lambda line: None)
    steps = 4  # 18 images, batches of 4, the last one dropped
    data = [f"seed={int(rng.integers(1 << 20))}", "data=imagenet_shards", f"data.root={tmp_path / 'shards'}",
            "data.num_classes=3", "data.img_size=32", "data.batch_size=4", "data.mixup=null",
            "data.label_smoothing=0", "+callbacks.record._target_=test_shards.RecordSamples"]
    runs = {name: tmp_path / name for name in ("whole", "killed", "resumed")}
    record = {name: f"+callbacks.record.path={run}.jsonl" for name, run in runs.items()}
    whole = start(runs["whole"], *data, record["whole"])
    killed = start(runs["killed"], *data, record["killed"], "+callbacks.kill._target_=test_train_resume.SigkillAtStep",
                   f"+callbacks.kill.step={steps + steps // 2}")
    code, output = finish(killed, runs["killed"])
    assert code == -signal.SIGKILL, output
    checkpoint = runs["killed"] / "checkpoints" / "last.ckpt"
    assert torch.load(checkpoint, map_location="cpu", weights_only=False)["global_step"] == steps
    resumed = start(runs["resumed"], *data, record["resumed"], f"ckpt_path={checkpoint}")
    for process, name in ((whole, "whole"), (resumed, "resumed")):
        code, output = finish(process, runs[name])
        assert code == 0, output

    expected = recorded(Path(f"{runs['whole']}.jsonl"))
    assert sorted(expected) == list(range(2 * steps))
    first = [expected[s]["samples"] for s in range(steps)]
    second = [expected[s]["samples"] for s in range(steps, 2 * steps)]
    assert first != second  # each epoch draws anew: replaying the first epoch's samples would fail below
    assert len({t for batch in first for _, t in batch}) == 3
    actual = recorded(Path(f"{runs['resumed']}.jsonl"))
    assert sorted(actual) == list(range(steps, 2 * steps))  # the resumed run starts at the second epoch
    for step in actual:
        assert actual[step] == expected[step], f"step {step}: the resumed run trained on other samples"
    weights, resumed_weights = final_state(runs["whole"]), final_state(runs["resumed"])
    different = [k for k in weights if not torch.equal(weights[k], resumed_weights[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:5]}"
