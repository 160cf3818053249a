"""`python -m lkcnn.bench loader`: how fast the input pipeline alone delivers training batches: train.py's `data`
config with any Hydra overrides, no model. Compare its images/s with a training run's (the throughput callback) to
tell whether training waits for its data: a loader that is not several times faster than the step shares the CPU
with the step and will slow it. It also prints how many loading cores one GPU needs to feed a training rate
(--train-rate, images/s), from the rate measured per loading core (the workers, or the main process with
data.num_workers=0, on the cores they share).

    python -m lkcnn.bench loader [--batches 50] [--warmup 10] [--train-rate 1280] [hydra overrides ...]
    e.g. python -m lkcnn.bench loader data=synthetic data.batch_size=64 data.num_workers=6
         python -m lkcnn.bench loader data=imagenet data.root=/data/imagenet data.num_workers=16

Batches are collated and pinned (data.pin_memory, where CUDA is present) as in training, but not moved to a GPU.
(Lightning has no loader-only benchmark; its profilers time the fetch inside a training run.)

`--jpegs N` compares data.decode=cpu with data.decode=gpu on a machine without ImageNet: it writes N real JPEGs
(500x375, cut from scikit-learn's sample photos at random, quality 75-95) into a temporary ImageNet layout, times
the `data=imagenet` recipe's CPU pipeline (images/s per worker, workers needed for --train-rate) and the GPU path
with --gpu-workers workers (decode, augmentation and mixup on the GPU included), prints a table and, with
--json PATH, writes an `lkcnn-benchmark/1` record (kind `loader`). For the GPU path it also times each stage of the
device half per batch (decode, crop+resize+flip, RandAugment, normalize+erase) between CUDA events:

    python -m lkcnn.bench loader --jpegs 4000 --json benchmarks/h100_loader.json
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from multiprocessing import Pool
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from hydra.utils import instantiate

from lkcnn import timing
from lkcnn.bench.record import command_line, make_record, write_record
from lkcnn.training.configs import compose_checked
from lkcnn.training.data import gpu_decode
from lkcnn.training.errors import exit_on_user_error

# RepLKNet-31B (224 px, bf16, channels_last, CUDA graphs) trains at about 1100-1300 images/s on one H100
# (docs/performance.md); a loader for one such GPU must deliver this much
DEFAULT_TRAIN_RATE = 1280.0


def loading_cores(num_workers: int) -> int:
    """Cores the loader's processes run on: its workers (the main process if none), at most the usable cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(max(num_workers, 1), cores)


def training_datamodule(overrides: Sequence[str]) -> Any:
    """The DataModule of train.py's config with `overrides`, set up for fit, in a process threaded as train.py's."""
    with exit_on_user_error():
        cfg = compose_checked(overrides)
        if cfg.cpu_threads:
            torch.set_num_threads(cfg.cpu_threads)  # as train.py does: the main process pins and collates
        datamodule = instantiate(cfg.data)
        datamodule.setup("fit")
    return datamodule


def time_loader(datamodule: Any, batches: int, warmup: int,
                device: torch.device | None = None) -> tuple[float, float]:
    """(images/s, ms per batch) of the training loader over `batches` batches after `warmup`. On `device`, each
    batch goes through the DataModule's transfer hooks as Lightning runs them (with decode=gpu: decode, augmentation
    and mixup); without one, the loader alone."""
    loader = datamodule.train_dataloader()
    if len(loader) < warmup + batches:
        sys.exit(f"the training loader has {len(loader)} batches, fewer than --warmup + --batches = "
                 f"{warmup + batches}: lower them or give it more data")
    datamodule.trainer = SimpleNamespace(training=True)  # the hooks augment in training only
    batch_iter = iter(loader)
    images: list[int] = []

    def step() -> None:
        batch = next(batch_iter)
        if device is not None:
            inputs, targets = datamodule.on_before_batch_transfer(batch, 0)
            batch = datamodule.on_after_batch_transfer((inputs, targets.to(device, non_blocking=True)), 0)
        images.append(len(batch[0]))

    batch_ms = timing.mean_ms(step, batches, warmup, device=device or "cpu", wall=True)
    return sum(images[warmup:]) / (batch_ms * batches / 1e3), batch_ms


DEVICE_STAGES = ("decode", "crop+resize+flip", "RandAugment", "normalize+erase")


def device_stage_ms(datamodule: Any, batches: int, warmup: int, device: torch.device) -> dict[str, float]:
    """Mean ms per batch of each stage of the decode=gpu path (gpu_decode's decode, resize, rand_augment, finish),
    between CUDA events, on batches the loader made beforehand so that no stage waits for a worker. On a GPU bound by
    launches an interval is about the host's time for the stage's launches."""
    loader = iter(datamodule.train_dataloader())
    encoded = [datamodule.on_before_batch_transfer(next(loader), 0)[0] for _ in range(warmup + batches)]
    intervals = []
    for batch in encoded:
        marks = [timing.mark(device)]
        decoded, _ = gpu_decode.decode(batch, device)
        marks.append(timing.mark(device))
        kept = [(image, encoded_image.crop) for image, encoded_image in zip(decoded, batch.images) if image is not None]
        images, crops = [image for image, _ in kept], [crop for _, crop in kept]
        out = gpu_decode.resize(images, crops, batch.transform)
        marks.append(timing.mark(device))
        out = gpu_decode.rand_augment(out, crops, batch.transform)
        marks.append(timing.mark(device))
        gpu_decode.finish(out, batch.transform)
        marks.append(timing.mark(device))
        intervals.append(marks)
    timing.synchronize(device)
    return {stage: sum(timing.elapsed_ms(marks[i], marks[i + 1]) for marks in intervals[warmup:]) / batches
            for i, stage in enumerate(DEVICE_STAGES)}


def measure_loader(args: argparse.Namespace) -> None:
    """The loader of train.py's config with the overrides: images/s, ms per batch, cores needed per GPU."""
    datamodule = training_datamodule(args.overrides)
    rate, batch_ms = time_loader(datamodule, args.batches, args.warmup)
    workers = datamodule.num_workers  # data.num_workers=null resolved to a count
    print(f"{type(datamodule).__name__}: {rate:.1f} images/s, "
          f"{batch_ms:.1f} ms per batch of {datamodule.batch_size} "
          f"({workers} workers, {args.batches} batches after {args.warmup})")
    per_core = rate / loading_cores(workers)
    print(f"cores needed per GPU at {args.train_rate:g} images/s: {args.train_rate / per_core:.2f} "
          f"({per_core:.1f} images/s per loading core; plus one for the training process)")


def _write_jpegs(job: tuple[Path, int, int]) -> None:
    """One class folder of 500x375 JPEGs cut from the sample photos (run in a process pool)."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_sample_images

    folder, count, seed = job
    rng = np.random.default_rng(seed)
    photos = load_sample_images().images  # two (427, 640, 3) photos
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        pixels = photos[int(rng.integers(len(photos)))]
        h, w = int(rng.integers(200, 427)), int(rng.integers(300, 640))
        top, left = int(rng.integers(0, 428 - h)), int(rng.integers(0, 641 - w))
        image = Image.fromarray(pixels[top:top + h, left:left + w]).resize((500, 375), Image.Resampling.BICUBIC)
        image.save(folder / f"{i}.JPEG", "JPEG", quality=int(rng.integers(75, 96)))


def write_imagenet(root: Path, count: int, classes: int = 10) -> None:
    """`count` training JPEGs (and a tenth of that for val/) in root/{train,val}/<class>/."""
    jobs = [(root / split / f"n{c:08d}", max(1, n // classes), 1000 * s + c)
            for s, (split, n) in enumerate((("train", count), ("val", max(count // 10, classes))))
            for c in range(classes)]
    with Pool(min(len(jobs), os.cpu_count() or 1)) as pool:
        pool.map(_write_jpegs, jobs)


def compare_decode(args: argparse.Namespace, argv: Sequence[str]) -> None:
    """--jpegs: the recipe's CPU pipeline against the GPU decode path, on JPEGs written here."""
    if not torch.cuda.is_available():
        sys.exit("--jpegs compares the CPU pipeline with the GPU decode path and needs a CUDA GPU")
    device = torch.device("cuda")
    with tempfile.TemporaryDirectory(prefix="lkcnn-jpegs-") as tmp:
        start = time.perf_counter()
        write_imagenet(Path(tmp), args.jpegs)
        print(f"wrote {args.jpegs} training JPEGs (500x375) in {time.perf_counter() - start:.1f} s")
        rows = []
        cpu_workers = "null" if args.cpu_workers is None else args.cpu_workers
        for decode, workers in (("cpu", cpu_workers), ("gpu", args.gpu_workers)):
            datamodule = training_datamodule(
                ["data=imagenet", f"data.root={tmp}", "data.num_classes=10", f"data.decode={decode}",
                 f"data.num_workers={workers}", *args.overrides])
            rate, _ = time_loader(datamodule, args.batches, args.warmup, device if decode == "gpu" else None)
            per_core = rate / loading_cores(datamodule.num_workers)
            rows.append({"what": f"decode={decode}", "workers": datamodule.num_workers,
                         "batch_size": datamodule.batch_size, "images_per_s": round(rate, 1),
                         "images_per_s_per_worker": round(per_core, 1),
                         "workers_needed": round(args.train_rate / per_core, 2)})
            if decode == "gpu":
                stages = device_stage_ms(datamodule, args.batches, args.warmup, device)
                rows[-1]["stage_ms"] = {stage: round(ms, 2) for stage, ms in stages.items()}
    print(f"{'':12} {'workers':>7} {'images/s':>9} {'per worker':>10} {f'workers for {args.train_rate:g}/s':>18}")
    for row in rows:
        print(f"{row['what']:12} {row['workers']:>7} {row['images_per_s']:>9.1f} "
              f"{row['images_per_s_per_worker']:>10.1f} {row['workers_needed']:>18.2f}")
    print("decode=gpu: its rate includes decoding, RandAugment, erasing and mixup on the GPU; per batch of "
          f"{rows[-1]['batch_size']}, ms (CUDA events, batches loaded beforehand, no mixup): "
          + ", ".join(f"{stage} {ms:.2f}" for stage, ms in rows[-1]["stage_ms"].items()))
    if args.json:
        method = {"timer": "time.perf_counter over --batches after --warmup, CUDA synchronized for decode=gpu",
                  "units": "images/s of the data=imagenet training loader",
                  "jpegs": args.jpegs, "train_rate": args.train_rate, "batches": args.batches,
                  "warmup": args.warmup, "overrides": args.overrides,
                  "note": "decode=cpu: the full recipe in the workers, batches not moved; decode=gpu: workers "
                          "read bytes and draw the crop, flips and RandAugment plan; the GPU decodes (nvJPEG), "
                          "crops, flips, augments, normalizes, erases and mixes"}
        write_record(args.json, make_record("loader", device, command_line(["loader", *argv]), method, rows))
        print(f"wrote {args.json}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lkcnn-bench loader", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=50, help="batches timed")
    parser.add_argument("--warmup", type=int, default=10, help="batches left out first (worker start-up)")
    parser.add_argument("--train-rate", type=float, default=DEFAULT_TRAIN_RATE,
                        help="training images/s of one GPU to size the loader for (default: RepLKNet-31B, one H100)")
    parser.add_argument("--jpegs", type=int, default=0,
                        help="write this many JPEGs into a temporary ImageNet layout and compare data.decode=cpu "
                             "with data.decode=gpu on them (see above)")
    parser.add_argument("--cpu-workers", type=int, default=None,
                        help="--jpegs: workers of the CPU pipeline (default: one per core, at most 8)")
    parser.add_argument("--gpu-workers", type=int, default=4, help="--jpegs: workers of the GPU path")
    parser.add_argument("--json", type=Path, default=None, help="--jpegs: write an lkcnn-benchmark/1 record here")
    parser.add_argument("overrides", nargs="*", help="train.py's Hydra overrides")
    return parser


def main(argv: Sequence[str]) -> None:
    args = _parser().parse_args(argv)
    if args.batches < 1 or args.warmup < 1:
        sys.exit("--batches and --warmup must be at least 1")
    if not args.train_rate > 0:
        sys.exit("--train-rate must be a positive number of images/s")
    if args.jpegs:
        compare_decode(args, argv)
    else:
        measure_loader(args)
