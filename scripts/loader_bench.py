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
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

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
    parser.add_argument("overrides", nargs="*", help="train.py's Hydra overrides")
    args = parser.parse_args()
    if args.batches < 1 or args.warmup < 1:
        sys.exit("--batches and --warmup must be at least 1")
    if not args.train_rate > 0:
        sys.exit("--train-rate must be a positive number of images/s")
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


if __name__ == "__main__":
    main()
