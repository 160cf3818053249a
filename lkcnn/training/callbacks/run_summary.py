"""What train.py prints before the first step, and a time estimate when a GPU-sized network trains on the CPU.

Lightning's own start-up lines say which accelerator exists but not what the run will do; a user who typed
`python train.py model=replknet31b` on a laptop should see at once what data, size, device and step count that means.
"""
from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

# A network this large trains on the CPU only for checks: warn and estimate the time from the first steps.
CPU_PARAMS_WARN = 10_000_000
CPU_TIMED_STEPS = 3  # after the first step (allocations, lazy inits), time this many to estimate the run


def _count(n: float) -> str:
    return f"{n / 1e6:.1f} M" if n >= 1e5 else f"{n / 1e3:.1f} K"


def stage_kernels(model: torch.nn.Module) -> list[int]:
    """The largest depthwise kernel of each stage of a network with `stages` (RepLKNet's, ConvNeXt-LK's and SLaK's
    re-parameterizable or plain large kernels, UniRepLKNet's dilated blocks and 3x3 convs, timm's ConvNeXt's 7x7;
    the larger side of a rectangular one); [] where a stage has none."""
    from lkcnn.layers import REPARAM_LAYERS, LargeKernelConv, to_kernel_size
    from lkcnn.layers.unireplknet_blocks import DilatedReparamBlock

    def kernel(m: torch.nn.Module) -> int | None:
        if isinstance(m, (*REPARAM_LAYERS, DilatedReparamBlock, LargeKernelConv)) or (
                isinstance(m, torch.nn.Conv2d) and m.groups == m.in_channels > 1):
            return max(to_kernel_size(m.kernel_size))
        return None

    sizes = []
    for stage in getattr(model, "stages", []):
        found = [k for m in stage.modules() if (k := kernel(m)) is not None]
        if not found:
            return []
        sizes.append(max(found))
    return sizes


def _compile_line(module: L.LightningModule) -> str:
    mode = getattr(module, "compile_mode", None)
    if mode is None:
        reason = getattr(module, "compile_reason", "")
        return f"off ({reason})" if reason else "off"
    settings = getattr(module, "inductor", None)
    extra = f" with inductor settings {settings}" if settings else ""
    return (f"torch.compile mode {mode}{extra}: the first steps compile the network (a minute or more cold, faster "
            "from torch's caches on the next run; module.compile=false for eager)")


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


class RunSummary(L.Callback):
    """Prints one block before the first step: model, data, device and precision, threads and workers, steps, output
    and what a resumed run starts from.

    Args:
        choices: the config group choices of the run (Hydra's runtime choices: model, data, ...).
        output_dir: the run's folder.
        resume: the checkpoint a resumed run starts from, as lkcnn.training.resume.resume_note words it.
    """

    def __init__(self, choices: dict[str, Any], output_dir: str, resume: str | None = None) -> None:
        self.choices = choices
        self.output_dir = output_dir
        self.resume = resume
        self._step_ends: list[float] | None = None  # timed on the CPU with a large network only
        self._total_steps = 0
        self._time_first_step = False  # a compiled network: print how long its first step (the compilation) took
        self._compile_started: float | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        model = pl_module.model
        spec = getattr(model, "lkcnn_spec", {}) or {}
        params = sum(p.numel() for p in model.parameters())
        dm = trainer.datamodule
        kernels, sizes = "", stage_kernels(model)
        if sizes:
            kernels = f", kernels {','.join(map(str, sizes))}"
            if getattr(dm, "img_size", None):  # the stems of lkcnn's models downsample 4x, each stage 2x more
                maps = [max(dm.img_size // 4 // 2**i, 1) for i in range(len(sizes))]
                kernels += f" on {','.join(map(str, maps))} px maps"
                # a 3x3 kernel is the floor of a stage (its small branch), not a large kernel wasted on a tiny map
                wasted = [k for k, m in zip(sizes, maps) if k > max(2 * m - 1, 3)]
                if wasted:
                    rank_zero_warn(f"kernels {wasted} are larger than their stage's map needs (2 x map - 1 reaches "
                                   "every pixel): they only multiply zeros. Raise data.img_size or lower "
                                   "model.kernel_sizes.")
        data = f"{self.choices.get('data', type(dm).__name__)}"
        if dm is not None and getattr(dm, "train_set", None) is not None:
            val = len(dm.val_set) if getattr(dm, "val_set", None) is not None else 0
            data += (f": {dm.num_classes} classes, {dm.img_size} px, {len(dm.train_set)} train / {val} val images, "
                     f"batch {dm.batch_size}")
        device = trainer.strategy.root_device
        threads = f"{torch.get_num_threads()} CPU threads"
        workers = getattr(dm, "num_workers", None)
        self._total_steps = int(trainer.estimated_stepping_batches)
        self._time_first_step = getattr(pl_module, "compile_mode", None) is not None
        epochs = trainer.max_epochs if trainer.max_steps == -1 else None
        steps = f"{self._total_steps}" + (f" in {epochs} epoch{'s' * (epochs != 1)}" if epochs else "")
        rank_zero_info("\n".join([
            "lkcnn run:",
            f"  model      {spec.get('name', type(model).__name__)} ({_count(params)} parameters{kernels})",
            f"  data       {data}",
            f"  device     {device}{f' x{trainer.world_size}' if trainer.world_size > 1 else ''}, "
            f"precision {trainer.precision}",
            f"  compile    {_compile_line(pl_module)}",
            f"  threads    {threads}" + (f", {workers} loader workers" if workers is not None else ""),
            f"  steps      {steps}",
            f"  output     {self.output_dir}",
            *([f"  resume     {self.resume}"] if self.resume else []),
        ]))
        if device.type == "cpu" and params > CPU_PARAMS_WARN:
            rank_zero_warn(
                f"{spec.get('name', 'this model')} has {_count(params)} parameters, a GPU-sized network: on the CPU "
                "it trains for checks only (an estimate of the run's time follows after a few steps). "
                "`python train.py` (replknet_tiny_32px) is the model that fits a CPU.")
            self._step_ends = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._time_first_step:
            self._time_first_step = False
            self._compile_started = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self._compile_started is not None:
            if trainer.strategy.root_device.type == "cuda":  # the step's kernels, not only their launch
                torch.cuda.synchronize(trainer.strategy.root_device)
            seconds = time.perf_counter() - self._compile_started
            rank_zero_info(f"lkcnn: the first step, compiling included, took {seconds:.1f} s")
            self._compile_started = None
        if self._step_ends is None:
            return
        self._step_ends.append(time.perf_counter())
        if len(self._step_ends) == CPU_TIMED_STEPS + 1:  # the ends of the first step and the CPU_TIMED_STEPS after it
            per_step = (self._step_ends[-1] - self._step_ends[0]) / CPU_TIMED_STEPS
            rank_zero_warn(f"at {per_step:.1f} s per step the {self._total_steps} steps take about "
                           f"{_duration(per_step * self._total_steps)} on the CPU: pass trainer.max_steps=N for a "
                           "shorter check, or train it on a GPU")
            self._step_ends = None
