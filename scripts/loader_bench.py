"""How fast the input pipeline alone delivers training batches: train.py's `data` config with any Hydra overrides,
no model. Compare its images/s with a training run's (the throughput callback) to tell whether training waits for
its data: a loader that is not several times faster than the step shares the CPU with the step and will slow it.
It also prints how many loading cores one GPU needs to feed a training rate (--train-rate, images/s), from the
rate measured per loading core (the workers, or the main process with data.num_workers=0, on the cores they share).

    python scripts/loader_bench.py [--batches 50] [--warmup 10] [--train-rate 1280] [hydra overrides ...]
    e.g. python scripts/loader_bench.py data=synthetic data.batch_size=64 data.num_workers=6
         python scripts/loader_bench.py data=imagenet data.root=/data/imagenet data.num_workers=16

Batches are collated and pinned (data.pin_memory, where CUDA is present) as in training, but not moved to a GPU.
(Lightning has no loader-only benchmark; its profilers time the fetch inside a training run.)

`--jpegs N` compares data.decode=cpu with data.decode=gpu on a machine without ImageNet: it writes N real JPEGs
(500x375, cut from scikit-learn's sample photos at random, quality 75-95) into a temporary ImageNet layout, times
the `data=imagenet` recipe's CPU pipeline (images/s per worker, workers needed for --train-rate) and the GPU path
with --gpu-workers workers (decode, augmentation and mixup on the GPU included), prints a table and, with
--json PATH, writes an `lkcnn-benchmark/1` record (kind `loader`):

    python scripts/loader_bench.py --jpegs 4000 --json benchmarks/h100_loader.json
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from multiprocessing import Pool
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
# RepLKNet-31B (224 px, bf16, channels_last, CUDA graphs) trains at about 1100-1300 images/s on one H100
# (docs/performance.md); a loader for one such GPU must deliver this much
DEFAULT_TRAIN_RATE = 1280.0


def loading_cores(num_workers: int) -> int:
    """Cores the loader's processes run on: its workers (the main process if none), at most the usable cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(max(num_workers, 1), cores)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    args = parser.parse_args()
    if args.batches < 1 or args.warmup < 1:
        sys.exit("--batches and --warmup must be at least 1")
    if not args.train_rate > 0:
        sys.exit("--train-rate must be a positive number of images/s")
    if args.jpegs:
        compare_decode(args)
        return
    sys.path.insert(0, str(ROOT))
    import torch
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from lkcnn.training.errors import exit_on_user_error

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=args.overrides)
    if cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)  # as train.py does: the main process pins and collates
    with exit_on_user_error():
        datamodule = instantiate(cfg.data)
        datamodule.setup("fit")
        loader = datamodule.train_dataloader()
    if len(loader) < args.warmup + args.batches:
        sys.exit(f"the training set has {len(loader)} batches, fewer than --warmup + --batches = "
                 f"{args.warmup + args.batches}: lower them or raise the dataset size")
    batches = iter(loader)
    for _ in range(args.warmup):
        next(batches)
    start = time.perf_counter()
    images = sum(len(next(batches)[0]) for _ in range(args.batches))
    seconds = time.perf_counter() - start
    rate, workers = images / seconds, datamodule.num_workers  # data.num_workers=null resolved to a count
    print(f"{cfg.data._target_.rsplit('.', 1)[-1]}: {rate:.1f} images/s, "
          f"{seconds / args.batches * 1e3:.1f} ms per batch of {datamodule.batch_size} "
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


def time_loader(datamodule, args: argparse.Namespace, device) -> tuple[float, int]:
    """(images/s, workers) of the training loader; on `device` through the DataModule's transfer hooks as
    Lightning runs them (with decode=gpu: decode, augmentation and mixup), else the loader alone."""
    import torch

    loader = datamodule.train_dataloader()
    if len(loader) < args.warmup + args.batches:
        sys.exit(f"--jpegs {args.jpegs} makes {len(loader)} batches, fewer than --warmup + --batches = "
                 f"{args.warmup + args.batches}: raise --jpegs or lower them")
    datamodule.trainer = SimpleNamespace(training=True)

    def step(batch):
        if device is None:
            return len(batch[0])
        images, targets = datamodule.on_before_batch_transfer(batch, 0)
        images, _ = datamodule.on_after_batch_transfer((images, targets.to(device, non_blocking=True)), 0)
        return len(images)

    batches = iter(loader)
    for _ in range(args.warmup):
        step(next(batches))
    if device is not None:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    images = sum(step(next(batches)) for _ in range(args.batches))
    if device is not None:
        torch.cuda.synchronize(device)
    return images / (time.perf_counter() - start), datamodule.num_workers


def compare_decode(args: argparse.Namespace) -> None:
    """--jpegs: the recipe's CPU pipeline against the GPU decode path, on JPEGs written here."""
    sys.path.insert(0, str(ROOT))
    import torch
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from lkcnn.training.errors import exit_on_user_error

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
            overrides = ["data=imagenet", f"data.root={tmp}", "data.num_classes=10", f"data.decode={decode}",
                         f"data.num_workers={workers}", *args.overrides]
            with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
                cfg = compose("train", overrides=overrides)
            if cfg.cpu_threads:
                torch.set_num_threads(cfg.cpu_threads)
            with exit_on_user_error():
                datamodule = instantiate(cfg.data)
                datamodule.setup("fit")
            rate, workers = time_loader(datamodule, args, device if decode == "gpu" else None)
            per_core = rate / loading_cores(workers)
            rows.append({"what": f"decode={decode}", "workers": workers, "batch_size": datamodule.batch_size,
                         "images_per_s": round(rate, 1), "images_per_s_per_worker": round(per_core, 1),
                         "workers_needed": round(args.train_rate / per_core, 2)})
    print(f"{'':12} {'workers':>7} {'images/s':>9} {'per worker':>10} {f'workers for {args.train_rate:g}/s':>18}")
    for row in rows:
        print(f"{row['what']:12} {row['workers']:>7} {row['images_per_s']:>9.1f} "
              f"{row['images_per_s_per_worker']:>10.1f} {row['workers_needed']:>18.2f}")
    print("decode=gpu skips RandAugment (timm runs it on PIL images); its rate includes decoding, augmentation "
          "and mixup on the GPU")
    if args.json:
        from lkcnn.bench import SCHEMA, environment

        record = {
            "schema": SCHEMA, "kind": "loader", "environment": environment(device),
            "command": shlex.join(["python", "scripts/loader_bench.py", *sys.argv[1:]]),
            "method": {"timer": "time.perf_counter over --batches after --warmup, CUDA synchronized for decode=gpu",
                       "units": "images/s of the data=imagenet training loader",
                       "jpegs": args.jpegs, "train_rate": args.train_rate, "batches": args.batches,
                       "warmup": args.warmup, "overrides": args.overrides,
                       "note": "decode=cpu: the full recipe in the workers, batches not moved; decode=gpu: workers "
                               "read bytes, the GPU decodes (nvJPEG), crops, flips, normalizes, erases and mixes; "
                               "RandAugment skipped"},
            "rows": rows,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
