"""`python -m lkcnn.bench app`: where the training app's step time goes: train.py's `train()` with a profiler
switched on for a stretch of training batches after a warm-up. By default cProfile, then the functions with the most
own time (Python, and the C++ calls they make); with --gpu (a CUDA GPU) torch.profiler, then the GPU's timeline per
step (span, busy and idle time, kernels) and the kernels that take the most time, as scripts/ddp_profile.py reports
the plain training loop.

    python -m lkcnn.bench app [--warmup 10] [--batches 10] [--top 40] [--gpu [--json FILE]] [hydra overrides ...]
    e.g. python -m lkcnn.bench app --gpu --json app.json model=replknet31b data=synthetic data.batch_size=64 \\
             trainer=ddp trainer.devices=1 trainer.max_steps=30 trainer.limit_val_batches=0 \\
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
import runpy
import sys
import tempfile
import time
from collections.abc import Sequence

import lightning as L
import torch
from torch.profiler import ProfilerActivity, profile

from lkcnn import timing
from lkcnn.bench import ROOT
from lkcnn.bench.profile import gpu_timeline, kernel_table, per_step
from lkcnn.training.configs import compose_checked
from lkcnn.training.errors import exit_on_user_error

# What the StepProfile that Hydra instantiates measured: the callback is built inside train.py's train(), which
# hands back only metrics, so it leaves its profiler and step time here.
RESULT: dict = {}


class StepProfile(L.Callback):
    """Runs a profiler over `batches` optimizer steps after `warmup` steps, from one batch start to another."""

    def __init__(self, warmup: int, batches: int, gpu: bool) -> None:
        self.warmup, self.batches = warmup, batches
        if gpu:
            # the GPU's activity only: recording every host op too would slow the host and so add idle GPU time
            self.profiler = profile(activities=[ProfilerActivity.CUDA])
            self.start, self.stop = self.profiler.start, self.profiler.stop
        else:
            self.profiler = cProfile.Profile()
            self.start, self.stop = self.profiler.enable, self.profiler.disable

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        # from one batch start to another: whole loop iterations, with their logging and the next batch's fetch
        if trainer.global_step == self.warmup and "start" not in RESULT:
            timing.synchronize(pl_module.device)
            self.start()  # before the clock: starting torch.profiler takes a while
            RESULT["start"] = time.perf_counter()
        elif trainer.global_step == self.warmup + self.batches and "profiler" not in RESULT:
            timing.synchronize(pl_module.device)
            RESULT["step_ms"] = (time.perf_counter() - RESULT["start"]) / self.batches * 1e3
            self.stop()  # (torch.profiler's takes a while too: it collects the events)
            RESULT["profiler"] = self.profiler
            trainer.should_stop = True  # the profile is what this run is for


def _print_host(profiler: cProfile.Profile, top: int) -> None:
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    print(text.getvalue())


def _print_gpu(prof, step_ms: float, steps: int, top: int, json_path: str | None) -> None:
    t = gpu_timeline(prof, steps)
    kernels = per_step(kernel_table(prof.key_averages()), steps)
    print(f"GPU per step: span {t['span_ms']:.1f} ms, busy {t['busy_ms']:.1f}, idle {t['idle_ms']:.1f}, "
          f"{t['kernels']:.0f} kernels")
    for name, (ms, count) in list(kernels.items())[:top]:
        print(f"{ms:8.2f} ms/step {count:7.1f}x  {name[:110]}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"app": {"step_ms": step_ms, "ranks": [t], "kernels": kernels}}, f, indent=1)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lkcnn-bench app", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warmup", type=int, default=10, help="optimizer steps before profiling")
    parser.add_argument("--batches", type=int, default=10, help="steps profiled")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--gpu", action="store_true", help="the GPU's timeline and kernels (torch.profiler)")
    parser.add_argument("--json", default=None, help="with --gpu: write the kernel table to this file")
    parser.add_argument("overrides", nargs="*", help="train.py's Hydra overrides")
    return parser


def main(argv: Sequence[str]) -> None:
    args = _parser().parse_args(argv)
    if args.gpu and not torch.cuda.is_available():
        sys.exit("--gpu needs a CUDA GPU: without it, profile the host (no --gpu)")
    steps = args.warmup + args.batches
    train = runpy.run_path(str(ROOT / "train.py"))["train"]  # the app's own entry, a file of the checkout
    callback = (f"{{_target_: {__name__}.StepProfile, warmup: {args.warmup}, batches: {args.batches}, "
                f"gpu: {str(args.gpu).lower()}}}")
    with tempfile.TemporaryDirectory(prefix="lkcnn_profile_") as out, exit_on_user_error():
        extra = [f"paths.output_dir={out}", f"paths.runs_dir={out}", f"+callbacks.step_profile={callback}"]
        cfg = compose_checked([*args.overrides, *extra])
        if 0 < cfg.trainer.get("max_steps", -1) < steps:
            sys.exit(f"trainer.max_steps={cfg.trainer.max_steps} ends the run before the profile's last step "
                     f"({steps} = --warmup + --batches): raise it, or leave it out (the run stops after the profile)")
        train(cfg)
    if "profiler" not in RESULT:
        sys.exit(f"no profile: the run ended before step {steps} (raise trainer.max_epochs)")
    what = "torch.profiler" if args.gpu else "cProfile"
    print(f"{RESULT['step_ms']:.1f} ms per step under {what}, {args.batches} steps after {args.warmup}")
    if args.gpu:
        _print_gpu(RESULT["profiler"], RESULT["step_ms"], args.batches, args.top, args.json)
    else:
        _print_host(RESULT["profiler"], args.top)
