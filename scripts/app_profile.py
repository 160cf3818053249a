"""Where the training app's step time goes: train.py's `train()` with a profiler switched on for a stretch of
training batches after a warm-up. By default cProfile, then the functions with the most own time (Python, and the
C++ calls they make); with --gpu (a CUDA GPU) torch.profiler, then the GPU's timeline per step (span, busy and idle
time, kernels) and the kernels that take the most time, as scripts/ddp_profile.py reports the plain training loop.

    python scripts/app_profile.py [--warmup 10] [--batches 10] [--top 40] [--gpu [--json FILE]] [hydra overrides ...]
    e.g. python scripts/app_profile.py --gpu --json app.json model=replknet31b data=synthetic data.batch_size=64 \
             trainer=ddp trainer.devices=1 trainer.max_steps=30 trainer.limit_val_batches=0 \
             module.compile=reduce-overhead

cProfile slows Python down, so the step time it prints is longer than a real step; the ranking is what it is for.
(Lightning's AdvancedProfiler and PyTorchProfiler profile per hook for the whole run, warm-up included; this one
profiles whole loop iterations, logging and data loading included, and only the steady state.) --json writes the
kernel table in ddp_profile.py's format, so the app and the plain loop compare kernel by kernel.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
RESULT: dict = {}  # filled by the callback instance Hydra creates (this module, imported by name)


class StepProfile(L.Callback):
    def __init__(self, warmup: int, batches: int, gpu: bool) -> None:
        self.warmup, self.batches = warmup, batches
        if gpu:
            # the GPU's activity only: recording every host op too would slow the host and so add idle GPU time
            self.profiler = profile(activities=[ProfilerActivity.CUDA])
            self.start, self.stop = self.profiler.start, self.profiler.stop
        else:
            self.profiler = cProfile.Profile()
            self.start, self.stop = self.profiler.enable, self.profiler.disable

    @staticmethod
    def _sync(module: L.LightningModule) -> None:
        if module.device.type == "cuda":
            torch.cuda.synchronize(module.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        # from one batch start to another: whole loop iterations, with their logging and the next batch's fetch
        if trainer.global_step == self.warmup and "start" not in RESULT:
            self._sync(pl_module)
            self.start()  # before the clock: starting torch.profiler takes a while
            RESULT["start"] = time.perf_counter()
        elif trainer.global_step == self.warmup + self.batches and "profiler" not in RESULT:
            self._sync(pl_module)
            RESULT["step_ms"] = (time.perf_counter() - RESULT["start"]) / self.batches * 1e3
            self.stop()  # (torch.profiler's takes a while too: it collects the events)
            RESULT["profiler"] = self.profiler


def _print_host(profiler: cProfile.Profile, top: int) -> None:
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    print(text.getvalue())


def _print_gpu(prof, step_ms: float, steps: int, top: int, json_path: str | None) -> None:
    # the plain loop's report (scripts/ddp_profile.py), so that the two compare
    from ddp_profile import gpu_timeline, kernel_table, per_step

    t = gpu_timeline(prof, steps)
    kernels = per_step(kernel_table(prof.key_averages()), steps)
    print(f"GPU per step: span {t['span_ms']:.1f} ms, busy {t['busy_ms']:.1f}, idle {t['idle_ms']:.1f}, "
          f"{t['kernels']:.0f} kernels")
    for name, (ms, count) in list(kernels.items())[:top]:
        print(f"{ms:8.2f} ms/step {count:7.1f}x  {name[:110]}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"app": {"step_ms": step_ms, "ranks": [t], "kernels": kernels}}, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=10, help="optimizer steps before profiling")
    parser.add_argument("--batches", type=int, default=10, help="steps profiled")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--gpu", action="store_true", help="the GPU's timeline and kernels (torch.profiler)")
    parser.add_argument("--json", default=None, help="with --gpu: write the kernel table to this file")
    parser.add_argument("overrides", nargs="*", help="train.py's Hydra overrides")
    args = parser.parse_args()
    if args.gpu and not torch.cuda.is_available():
        sys.exit("--gpu needs a CUDA GPU: without it, profile the host (no --gpu)")
    sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]
    from hydra import compose, initialize_config_dir

    import train as app

    out = tempfile.mkdtemp(prefix="lkcnn_profile_")
    callback = (f"{{_target_: app_profile.StepProfile, warmup: {args.warmup}, batches: {args.batches}, "
                f"gpu: {str(args.gpu).lower()}}}")
    extra = [f"paths.output_dir={out}", f"paths.runs_dir={out}", f"+callbacks.step_profile={callback}"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[*args.overrides, *extra])
    app.train(cfg)
    import app_profile  # the module Hydra instantiated the callback from

    result = app_profile.RESULT
    if "profiler" not in result:
        sys.exit(f"no profile: the run ended before step {args.warmup + args.batches} (raise trainer.max_steps)")
    what = "torch.profiler" if args.gpu else "cProfile"
    print(f"{result['step_ms']:.1f} ms per step under {what}, {args.batches} steps after {args.warmup}")
    if args.gpu:
        _print_gpu(result["profiler"], result["step_ms"], args.batches, args.top, args.json)
    else:
        _print_host(result["profiler"], args.top)


if __name__ == "__main__":
    main()
