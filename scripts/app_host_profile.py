"""Where the training app's host time goes: train.py's `train()` with cProfile switched on for a stretch of training
batches after a warm-up, then the functions with the most own time (Python, and the C++ calls they make).

    python scripts/app_host_profile.py [--warmup 10] [--batches 10] [--top 40] [hydra overrides ...]
    e.g. python scripts/app_host_profile.py model=replknet31b data=synthetic data.batch_size=64 trainer=ddp \
             trainer.devices=1 trainer.max_steps=25 trainer.limit_val_batches=0

cProfile slows Python down, so the step time it prints is longer than a real step; the ranking is what it is for.
(Lightning's AdvancedProfiler profiles per hook for the whole run, warm-up included; this one profiles whole steps,
and only the steady state.)
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

ROOT = Path(__file__).resolve().parents[1]
RESULT: dict = {}  # filled by the callback instance Hydra creates (this module, imported by name)


class HostProfile(L.Callback):
    def __init__(self, warmup: int, batches: int) -> None:
        self.warmup, self.batches = warmup, batches
        self.profiler = cProfile.Profile()

    @staticmethod
    def _sync(module: L.LightningModule) -> None:
        if module.device.type == "cuda":
            torch.cuda.synchronize(module.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if trainer.global_step == self.warmup and "start" not in RESULT:
            self._sync(pl_module)
            RESULT["start"] = time.perf_counter()
            self.profiler.enable()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step == self.warmup + self.batches and "stats" not in RESULT:
            self._sync(pl_module)
            self.profiler.disable()
            RESULT["step_ms"] = (time.perf_counter() - RESULT["start"]) / self.batches * 1e3
            RESULT["stats"] = pstats.Stats(self.profiler)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=10, help="optimizer steps before profiling")
    parser.add_argument("--batches", type=int, default=10, help="steps profiled")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("overrides", nargs="*", help="train.py's Hydra overrides")
    args = parser.parse_args()
    sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]
    from hydra import compose, initialize_config_dir

    import train as app

    out = tempfile.mkdtemp(prefix="lkcnn_host_profile_")
    callback = f"{{_target_: app_host_profile.HostProfile, warmup: {args.warmup}, batches: {args.batches}}}"
    extra = [f"paths.output_dir={out}", f"paths.runs_dir={out}", f"+callbacks.host_profile={callback}"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[*args.overrides, *extra])
    app.train(cfg)
    import app_host_profile  # the module Hydra instantiated the callback from

    result = app_host_profile.RESULT
    if "stats" not in result:
        sys.exit(f"no profile: the run ended before step {args.warmup + args.batches} (raise trainer.max_steps)")
    print(f"{result['step_ms']:.1f} ms per step under cProfile, {args.batches} steps after {args.warmup}")
    text = io.StringIO()
    result["stats"].stream = text
    result["stats"].sort_stats("tottime").print_stats(args.top)
    print(text.getvalue())


if __name__ == "__main__":
    main()
