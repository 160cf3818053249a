"""How fast the input pipeline alone delivers training batches: train.py's `data` config with any Hydra overrides,
no model. Compare its images/s with a training run's (the throughput callback) to tell whether training waits for
its data: a loader that is not several times faster than the step shares the CPU with the step and will slow it.

    python scripts/loader_bench.py [--batches 50] [--warmup 10] [hydra overrides ...]
    e.g. python scripts/loader_bench.py data=synthetic data.batch_size=64 data.num_workers=6
         python scripts/loader_bench.py data=imagenet data.root=/data/imagenet data.num_workers=16

Batches are collated and pinned (data.pin_memory, where CUDA is present) as in training, but not moved to a GPU.
(Lightning has no loader-only benchmark; its profilers time the fetch inside a training run.)
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=50, help="batches timed")
    parser.add_argument("--warmup", type=int, default=10, help="batches left out first (worker start-up)")
    parser.add_argument("overrides", nargs="*", help="train.py's Hydra overrides")
    args = parser.parse_args()
    if args.batches < 1 or args.warmup < 1:
        sys.exit("--batches and --warmup must be at least 1")
    sys.path.insert(0, str(ROOT))
    import torch
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from lkcnn.training import user_error_message

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=args.overrides)
    if cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)  # as train.py does: the main process pins and collates
    try:
        datamodule = instantiate(cfg.data)
        datamodule.setup("fit")
        loader = datamodule.train_dataloader()
    except Exception as err:
        message = user_error_message(err)
        if message is None:
            raise
        sys.exit(f"Error: {message}")
    if len(loader) < args.warmup + args.batches:
        sys.exit(f"the training set has {len(loader)} batches, fewer than --warmup + --batches = "
                 f"{args.warmup + args.batches}: lower them or raise the dataset size")
    batches = iter(loader)
    for _ in range(args.warmup):
        next(batches)
    start = time.perf_counter()
    images = sum(len(next(batches)[0]) for _ in range(args.batches))
    seconds = time.perf_counter() - start
    print(f"{cfg.data._target_.rsplit('.', 1)[-1]}: {images / seconds:.1f} images/s, "
          f"{seconds / args.batches * 1e3:.1f} ms per batch of {cfg.data.batch_size} "
          f"({cfg.data.num_workers} workers, {args.batches} batches after {args.warmup})")


if __name__ == "__main__":
    main()
