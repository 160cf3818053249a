"""Sharded image datasets: a class-folder tree converted into tar shards, and the DataModule that trains from them.

    python -m lkcnn.training.data.shards /data/imagenet /data/imagenet-shards     # train/ and val/ -> shards + index
    python train.py data=imagenet_shards data.root=/data/imagenet-shards

Why shards: on a shared file system of a multi-node cluster, 1.28M small files cost a metadata lookup each, per
epoch, per node; ~1300 large files cost almost none, and can be copied to each node's local disk in one go.

Format: WebDataset-style tar shards, `<split>-000000.tar ...`, plain POSIX tar files of `<class>/<stem>.jpg` (the
image bytes exactly as in the source tree) + `<class>/<stem>.cls` (the class index, decimal), written by Python's
`tarfile`, so `tar`, the `webdataset` library and any tar reader read them. Beside them, `<split>.json` (class names,
per-shard sample and byte counts) and `<split>.npy` (per sample: shard, byte offset, byte size, class), written last:
their presence marks a finished conversion. Training images are shuffled into the shards with a fixed seed, so that a
streaming reader that reads shards in sequence (webdataset) still sees mixed classes.

Reading: a map-style dataset that seeks to a sample's bytes (`os.pread` at the recorded offset), so the project's
epoch-seeded sampler (lkcnn.training.seeding) decides the order exactly as for class folders: a run killed and resumed
from its last checkpoint sees the same samples in the same order, and under DDP Lightning's distributed sampler splits
them among the ranks. Every node needs every shard (shared file system, or a local copy); that is the price of a
global shuffle.

Not used: Lightning's `litdata` (streaming format, iterable dataset with a saved loader position for mid-epoch
resume). It would add boto3, obstore, tifffile and requests as dependencies, a format only litdata reads, and a second
resume mechanism beside the epoch seeding the rest of the project relies on; the `webdataset` library is not needed
either, since writing and seeking in tar files is the standard library's.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tarfile
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from threading import Lock
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from .datamodule import ImageDataModule
from .datasets import CorruptImage, Transform, load_rgb, scan_class_folders
from ..errors import ConfigError, PathNotFoundError, UserError

FORMAT = "lkcnn-shards"
VERSION = 1
SHARD_NAME = "{split}-{index:06d}.tar"
MAX_OPEN_SHARDS = 64  # per process: well under the usual 1024 open-file limit, however many shards
COLUMNS = ("shard", "offset", "size", "target")  # the columns of <split>.npy


class ShardsExistError(UserError, FileExistsError):
    """The destination already holds shards of a split being converted."""


# ---------------------------------------------------------------------------------------------------------- writing

def scan_split(folder: Path) -> tuple[list[str], list[tuple[str, int]]]:
    """(classes, (path, class index) samples) as ImageFolderDataModule sees them (the same scan)."""
    return scan_class_folders(folder, f": expected {folder}/<class>/<image>, one folder per class")


def member_keys(samples: Sequence[tuple[str, int]], classes: Sequence[str]) -> list[str]:
    """A webdataset key per sample, `<class>/<stem>`: no dots (webdataset splits the extension at the first dot),
    unique (a.jpg beside a.png gets a suffix), and traceable to the source file."""
    keys, seen = [], set()
    for path, target in samples:
        key = f"{classes[target]}/{Path(path).stem.replace('.', '_')}"
        base, n = key, 0
        while key in seen:
            n += 1
            key = f"{base}_{n}"
        seen.add(key)
        keys.append(key)
    return keys


def _extension(path: str) -> str:
    ext = Path(path).suffix.lower().lstrip(".")
    return "jpg" if ext == "jpeg" else ext


def _tarinfo(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o444, 0  # fixed metadata: the same tree gives the same bytes
    return info


def write_shard(path: Path, samples: Sequence[tuple[str, int]], keys: Sequence[str]) -> list[tuple[int, int]]:
    """Write one tar shard (to a temporary name, renamed when complete); (data offset, size) of each image."""
    partial = path.with_name(f".{path.name}.partial")
    where = []
    with tarfile.open(partial, "w", format=tarfile.PAX_FORMAT) as tar:
        for (source, target), key in zip(samples, keys):
            data = Path(source).read_bytes()
            tar.addfile(_tarinfo(f"{key}.{_extension(source)}", len(data)), io.BytesIO(data))
            where.append((tar.offset - _padded(len(data)), len(data)))  # the data ends the member, padded
            label = str(target).encode()
            tar.addfile(_tarinfo(f"{key}.cls", len(label)), io.BytesIO(label))
    os.replace(partial, path)
    return where


def _padded(size: int) -> int:
    return -(-size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE


def split_files(dst: Path, split: str) -> list[Path]:
    """What a converted split consists of in `dst` (shards and index), as far as it exists."""
    return sorted(dst.glob(f"{split}-[0-9]*.tar")) + [p for p in (dst / f"{split}.json", dst / f"{split}.npy")
                                                       if p.exists()]


def convert(src: str | Path, dst: str | Path, splits: Sequence[str] | None = None, shard_size: int = 1000,
            seed: int = 0, overwrite: bool = False, workers: int = 1,
            echo: Callable[[str], None] = print) -> dict[str, dict[str, Any]]:
    """Convert `src/<split>/<class>/<image>` into `dst/<split>-NNNNNN.tar` + `dst/<split>.{json,npy}` per split.

    splits: None converts train/ and val/ (those present; train/ must be). Every split must have the class folders
    of the first. Nothing under `src` is written; existing shards of a converted split are refused unless
    `overwrite`, which deletes them first. Returns each split's index (the content of `<split>.json`).
    """
    src, dst = Path(src).expanduser().resolve(), Path(dst).expanduser().resolve()
    if not src.is_dir():
        raise PathNotFoundError(f"{src} does not exist: pass the root of a class-folder tree "
                                "(SRC/train/<class>/<image>, SRC/val/<class>/<image>)")
    if dst == src or src in dst.parents:
        raise ConfigError(f"{dst} is inside the source tree {src}: pass a destination outside it")
    if shard_size < 1 or workers < 1:
        raise ConfigError(f"--shard-size ({shard_size}) and --workers ({workers}) must be 1 or more")
    if splits is None:
        splits = [s for s in ("train", "val") if (src / s).is_dir()]
        if "train" not in splits:
            raise PathNotFoundError(f"{src} has no train/ folder: pass --split NAME for each subfolder of class "
                                    "folders to convert (e.g. --split train --split val)")
    for split in splits:
        if not (src / split).is_dir():
            raise PathNotFoundError(f"{src / split} does not exist: pass --split with subfolders of {src}")
        existing = split_files(dst, split)
        if existing and not overwrite:
            raise ShardsExistError(f"{existing[0]} exists: pass --overwrite to replace the {split} split, or "
                                   "choose another destination")
    scanned = {split: scan_split(src / split) for split in splits}  # all scanned before anything is written
    classes = scanned[splits[0]][0]
    for split, (split_classes, _) in scanned.items():
        if split_classes != classes:
            raise ConfigError(f"the class folders of {src / split} differ from those of {src / splits[0]}: "
                              "every split needs the same classes")
    dst.mkdir(parents=True, exist_ok=True)
    return {split: _convert_split(src / split, dst, split, classes, samples, shard_size, seed, workers, echo)
            for split, (_, samples) in scanned.items()}


def _convert_split(folder: Path, dst: Path, split: str, classes: list[str], samples: list[tuple[str, int]],
                   shard_size: int, seed: int, workers: int, echo: Callable[[str], None]) -> dict[str, Any]:
    for old in split_files(dst, split):  # only reached with overwrite
        old.unlink()
    order = np.random.default_rng(seed).permutation(len(samples)) if split == "train" else np.arange(len(samples))
    samples = [samples[i] for i in order]
    keys = member_keys(samples, classes)
    starts = range(0, len(samples), shard_size)
    paths = [dst / SHARD_NAME.format(split=split, index=i) for i in range(len(starts))]
    lock = Lock()  # one line at a time from the writing threads

    def one(i: int) -> list[tuple[int, int]]:
        s = starts[i]
        where = write_shard(paths[i], samples[s:s + shard_size], keys[s:s + shard_size])
        with lock:
            echo(f"wrote {paths[i]} ({len(where)} images, {paths[i].stat().st_size / 1e6:.1f} MB)")
        return where

    with ThreadPoolExecutor(workers) as pool:  # the work is file I/O, which releases the GIL
        where = list(pool.map(one, range(len(paths))))
    table = np.array([(shard, offset, size, target) for shard, (located, start) in enumerate(zip(where, starts))
                      for (offset, size), (_, target) in zip(located, samples[start:start + shard_size])],
                     dtype=np.int64).reshape(-1, len(COLUMNS))
    index = {"format": FORMAT, "version": VERSION, "split": split, "source": str(folder), "seed": seed,
             "samples": len(samples), "classes": classes, "columns": list(COLUMNS),
             "shards": [{"file": p.name, "samples": len(w), "bytes": p.stat().st_size} for p, w in zip(paths, where)]}
    _replace(dst / f"{split}.npy", lambda f: np.save(f, table, allow_pickle=False))
    _replace(dst / f"{split}.json", lambda f: f.write(json.dumps(index, indent=1).encode()))
    total = sum(s["bytes"] for s in index["shards"])
    echo(f"{split}: {len(samples)} images of {len(classes)} classes -> {len(paths)} shards "
         f"({total / 1e9:.2f} GB), index {dst / f'{split}.json'}")
    return index


def _replace(path: Path, write: Callable[[Any], Any]) -> None:
    partial = path.with_name(f".{path.name}.partial")
    with open(partial, "wb") as f:
        write(f)
    os.replace(partial, path)


# ---------------------------------------------------------------------------------------------------------- reading

def read_index(root: Path, split: str) -> tuple[dict[str, Any], np.ndarray]:
    """A converted split's index and sample table, checked against the shards on disk."""
    path = root / f"{split}.json"
    if not path.is_file():
        hint = ("the conversion did not finish: run it again with --overwrite" if split_files(root, split) else
                f"convert a class-folder tree first: python -m lkcnn.training.data.shards SRC_ROOT {root}")
        raise PathNotFoundError(f"{path} does not exist ({hint})")
    try:
        index = json.loads(path.read_text())
        table = np.load(root / f"{split}.npy", allow_pickle=False)
    except (OSError, ValueError) as err:
        raise PathNotFoundError(f"cannot read the index of {root}/{split}-*.tar ({err}): convert again with "
                                "--overwrite") from err
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise ConfigError(f"{path} is not an index written by lkcnn.training.data.shards (format {FORMAT} "
                          f"version {VERSION}): convert the class folders with python -m lkcnn.training.data.shards")
    if table.shape != (index["samples"], len(COLUMNS)):
        raise ConfigError(f"{root / f'{split}.npy'} does not match {path}: convert again with --overwrite")
    for shard in index["shards"]:
        file = root / shard["file"]
        if not file.is_file():
            raise PathNotFoundError(f"{file} is missing (listed in {path}): copy every shard of the split")
        if file.stat().st_size != shard["bytes"]:
            raise ConfigError(f"{file} has {file.stat().st_size} bytes, its index says {shard['bytes']}: an "
                              "incomplete copy? Copy it again or convert again with --overwrite")
    return index, table


class ShardSamples(Dataset):
    """The images of one converted split, read by random access into the tar shards, decoded with `load_rgb`."""

    def __init__(self, root: Path, index: dict[str, Any], table: np.ndarray, transform: Transform) -> None:
        self.paths = [str(root / shard["file"]) for shard in index["shards"]]
        self.table = table  # a numpy array, not Python lists: forked workers do not copy it page by page
        self.transform = transform
        self._files: OrderedDict[int, int] = OrderedDict()  # shard -> descriptor, opened by this process
        self._pid = os.getpid()

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int] | CorruptImage:
        shard, offset, size, target = (int(v) for v in self.table[index])
        data = os.pread(self._descriptor(shard), size, offset)
        try:
            if len(data) != size:
                raise OSError(f"the shard ends {size - len(data)} bytes early")
            image = load_rgb(io.BytesIO(data))
        except Exception as err:  # only the read check and PIL run here: whatever they raise is the member's
            return CorruptImage(self.member_name(shard, offset), f"{type(err).__name__}: {err}")
        return self.transform(image), target

    def member_name(self, shard: int, offset: int) -> str:
        """`shard.tar:<member>` for messages, from the tar header that precedes the data."""
        try:
            header = os.pread(self._descriptor(shard), tarfile.BLOCKSIZE, offset - tarfile.BLOCKSIZE)
            name = tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape").name
        except (OSError, tarfile.TarError):
            name = f"<member at byte {offset}>"
        return f"{self.paths[shard]}:{name}"

    def _descriptor(self, shard: int) -> int:
        if self._pid != os.getpid():  # a forked worker: its inherited descriptors are the parent's to close
            self._files, self._pid = OrderedDict(), os.getpid()
        if shard in self._files:
            self._files.move_to_end(shard)
            return self._files[shard]
        if len(self._files) >= MAX_OPEN_SHARDS:
            os.close(self._files.popitem(last=False)[1])
        self._files[shard] = os.open(self.paths[shard], os.O_RDONLY)
        return self._files[shard]

    def __getstate__(self) -> dict[str, Any]:  # spawned workers open their own files
        return {**self.__dict__, "_files": OrderedDict()}

    def __del__(self) -> None:
        if getattr(self, "_pid", None) == os.getpid():
            for descriptor in self._files.values():
                os.close(descriptor)


class ShardedImageDataModule(ImageDataModule):
    """Images from tar shards written by `python -m lkcnn.training.data.shards` (root/<split>-NNNNNN.tar + index).

    The same transforms, loaders, sampler and corrupt-image policy as the class-folder sources; only the bytes come
    from the shards.
    """

    def __init__(self, root: str, train_split: str = "train", val_split: str = "val", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.root = Path(root).expanduser()
        self.train_split, self.val_split = train_split, val_split
        if not self.root.is_dir():
            raise PathNotFoundError(f"data.root={self.root} does not exist: pass the folder of the shards, written "
                                    f"by python -m lkcnn.training.data.shards SRC_ROOT {self.root}")

    def make_datasets(self, train_transform: Transform, eval_transform: Transform) -> tuple[Dataset, Dataset]:
        train, train_table = read_index(self.root, self.train_split)
        val, val_table = read_index(self.root, self.val_split)
        if len(train["classes"]) != self.num_classes:
            raise ConfigError(f"{self.root}/{self.train_split}.json has {len(train['classes'])} classes but "
                              f"data.num_classes={self.num_classes}: set data.num_classes={len(train['classes'])}")
        if val["classes"] != train["classes"]:
            raise ConfigError(f"the classes of {self.root}/{self.val_split}.json differ from those of "
                              f"{self.train_split}.json: convert both splits from one tree")
        return (ShardSamples(self.root, train, train_table, train_transform),
                ShardSamples(self.root, val, val_table, eval_transform))


# -------------------------------------------------------------------------------------------------------------- CLI

def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lkcnn.training.data.shards",
        description="Convert a class-folder tree (SRC_ROOT/<split>/<class>/<image>, ImageNet's layout) into tar "
                    "shards DST_ROOT/<split>-NNNNNN.tar plus an index, for data=imagenet_shards. "
                    "SRC_ROOT is only read.")
    parser.add_argument("src", metavar="SRC_ROOT")
    parser.add_argument("dst", metavar="DST_ROOT")
    parser.add_argument("--split", action="append", dest="splits", metavar="NAME",
                        help="a subfolder of SRC_ROOT to convert, repeatable (default: train and val, if present)")
    parser.add_argument("--shard-size", type=int, default=1000,
                        help="images per shard (default 1000: ~110 MB of ImageNet JPEGs)")
    parser.add_argument("--seed", type=int, default=0, help="the order of the training images in the shards")
    parser.add_argument("--workers", type=int, default=4, help="shards written at once (default 4)")
    parser.add_argument("--overwrite", action="store_true", help="replace the existing shards of the splits")
    args = parser.parse_args(argv)
    try:
        convert(args.src, args.dst, args.splits, args.shard_size, args.seed, args.overwrite, args.workers)
    except UserError as err:
        sys.exit(f"Error: {err}")
    except OSError as err:  # e.g. DST_ROOT or a folder above it is a file, or not writable
        sys.exit(f"Error: cannot write the shards under {args.dst}: {err.strerror or err} ({err.filename}); pass a "
                 "DST_ROOT folder that can be created or written")


if __name__ == "__main__":
    main()
