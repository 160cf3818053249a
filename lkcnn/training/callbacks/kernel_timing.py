"""Per-layer timings of the large-kernel convolutions during training: a Lightning callback.

Every `every_n_steps` optimizer steps (after `warmup_steps`) the callback hooks every `LargeKernelConv` and every
block's small / dilated branches (`BranchConvs`: one call for all of a block's branches, named `<block>.branch_convs`
in the table) for one training batch, times each one's forward and backward (CUDA events on a GPU, the wall clock
on the CPU), removes the hooks, and reports one row per layer: scalars `kernel_ms/<layer>/fwd|bwd` (plus
`kernel_ms/total/...`) to every logger, the table to loggers that take tables (W&B table, TensorBoard text), and
the rows of all timed steps to `<dirpath>/kernel_timing.csv` and `.json`. Between timed steps no hook is installed,
so training runs untouched.
One timed step is one sample of a noisy quantity (the CPU's wall clock especially): a fit that timed fewer than
`MIN_SAMPLES` steps warns, and `python -m lkcnn.ablation` reports the mean, median, IQR and count over the samples.

Why not torch.profiler: it times every op of the step and costs far more than the hooks; the question here is only
how long each large-kernel layer takes in a real training step, with its real shapes, dtype and implementation.
Lightning's callbacks have no per-module timer.
"""
from __future__ import annotations

import csv
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn as nn
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from torch.utils.hooks import RemovableHandle

from lkcnn.timing import Mark, elapsed_ms, mark
from lkcnn.layers import BranchConvs, LargeKernelConv
from lkcnn.ops import implementation as op_implementation  # the ops' own dispatch: the table matches what ran
from lkcnn.ops.dwconv_branches import uses_kernels

TIMED = (LargeKernelConv, BranchConvs)

log = logging.getLogger(__name__)

COLUMNS = ("step", "layer", "kernel_size", "input_shape", "dtype", "implementation", "fwd_ms", "bwd_ms")
MIN_SAMPLES = 3  # timed steps below which a fit warns: no mean or spread worth reading


def implementation(module: LargeKernelConv | BranchConvs, x: torch.Tensor) -> str:
    """"cuda" when this call runs lkcnn's CUDA kernels (lkcnn.ops.dwconv2d, or dwconv2d_branches for the branches),
    "torch" when PyTorch's convolution runs."""
    if isinstance(module, BranchConvs):
        return "cuda" if uses_kernels(x, list(module.kernel_sizes), list(module.dilations)) else "torch"
    return op_implementation(x, list(module.kernel_size), list(module.padding))


def kernel_size(module: LargeKernelConv | BranchConvs) -> str:
    """The table's kernel size: 31x31, or a block's branches as 5x5+7x7d2+..."""
    if isinstance(module, BranchConvs):
        return module.describe()
    return "x".join(map(str, module.kernel_size))


@dataclass
class _Layer:
    """What the hooks recorded for one layer during one timed batch (a layer called twice sums its calls)."""

    name: str
    kernel_size: str
    input_shape: str = ""
    dtype: str = ""
    implementation: str = ""
    device: torch.device | None = None
    fwd: list[tuple[Mark, Mark]] = field(default_factory=list)
    bwd: list[tuple[Mark, Mark]] = field(default_factory=list)
    fwd_start: Mark | None = None
    bwd_start: Mark | None = None


class KernelTimingCallback(L.Callback):
    """Time the forward and backward of every LargeKernelConv and BranchConvs every `every_n_steps` training steps.

    Args:
        every_n_steps: optimizer steps between timed batches (the first timed step is `warmup_steps`).
        warmup_steps: steps left untimed at the start of a fit (extension build, cuDNN autotuning, allocator).
        dirpath: folder of kernel_timing.csv/.json; the trainer's default_root_dir (the run folder) when None.
    """

    needs_eager_modules = True  # module.compile=auto leaves the network eager: a compiled one skips module hooks

    def __init__(self, every_n_steps: int = 100, warmup_steps: int = 10, dirpath: str | None = None) -> None:
        super().__init__()
        if every_n_steps < 1 or warmup_steps < 0:
            raise ValueError(f"kernel timing needs every_n_steps >= 1 and warmup_steps >= 0, got {every_n_steps} "
                             f"and {warmup_steps}: set callbacks.kernel_timing.every_n_steps / .warmup_steps")
        self.every_n_steps = every_n_steps
        self.warmup_steps = warmup_steps
        self.dirpath = dirpath
        self.rows: list[dict[str, Any]] = []  # every timed step so far, in COLUMNS order
        self._layers: dict[nn.Module, _Layer] = {}
        self._handles: list[RemovableHandle] = []
        self._timed_step = -1
        self._timing = False  # hooks are in place for the current batch
        self._warned_empty = False

    def _due(self, step: int) -> bool:
        return step >= self.warmup_steps and (step - self.warmup_steps) % self.every_n_steps == 0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        step = trainer.global_step
        if self._due(step) and step != self._timed_step:  # with gradient accumulation: the first micro-batch
            self._timed_step = step
            self._timing = True
            self._install(pl_module)

    def _install(self, pl_module: nn.Module) -> None:
        for name, module in pl_module.named_modules():
            if isinstance(module, TIMED):
                self._layers[module] = _Layer(name, kernel_size(module))
                self._handles += [module.register_forward_pre_hook(self._fwd_pre),
                                  module.register_forward_hook(self._fwd_post),
                                  module.register_full_backward_pre_hook(self._bwd_pre),
                                  module.register_full_backward_hook(self._bwd_post)]

    def _fwd_pre(self, module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        layer, x = self._layers[module], args[0]
        layer.device = x.device
        if not layer.fwd:
            dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
            layer.input_shape = "x".join(map(str, x.shape))
            layer.dtype = str(dtype).removeprefix("torch.")
            layer.implementation = implementation(module, x)
        layer.fwd_start = mark(x.device)

    def _fwd_post(self, module: nn.Module, args: tuple[torch.Tensor, ...], output: Any) -> None:
        layer = self._layers[module]
        layer.fwd.append((layer.fwd_start, mark(layer.device)))

    def _bwd_pre(self, module: nn.Module, grad_output: tuple[torch.Tensor, ...]) -> None:
        layer = self._layers[module]
        layer.bwd_start = mark(layer.device)

    def _bwd_post(self, module: nn.Module, grad_input: Any, grad_output: Any) -> None:
        layer = self._layers[module]
        layer.bwd.append((layer.bwd_start, mark(layer.device)))

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self._timing:
            return
        self._timing = False
        self._remove()
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)  # events must have completed before elapsed_time
        rows = [{"step": self._timed_step, "layer": layer.name,
                 "kernel_size": layer.kernel_size, "input_shape": layer.input_shape,
                 "dtype": layer.dtype, "implementation": layer.implementation,
                 "fwd_ms": sum(elapsed_ms(*pair) for pair in layer.fwd),
                 "bwd_ms": sum(elapsed_ms(*pair) for pair in layer.bwd) if layer.bwd else None}
                for layer in self._layers.values() if layer.fwd]  # layers that ran (not the EMA copy)
        self._layers.clear()
        if not trainer.is_global_zero:
            return
        if rows:
            self.rows += rows
            self._report(trainer, rows)
        elif not self._warned_empty:
            self._warned_empty = True
            log.warning("kernel timing: no LargeKernelConv ran in the timed batch: the model has none, or it is "
                        "compiled (a compiled model skips module hooks: set module.compile=false to time it)")

    def _report(self, trainer: L.Trainer, rows: list[dict[str, Any]]) -> None:
        metrics = {}
        for row in rows:
            metrics[f"kernel_ms/{row['layer']}/fwd"] = row["fwd_ms"]
            if row["bwd_ms"] is not None:
                metrics[f"kernel_ms/{row['layer']}/bwd"] = row["bwd_ms"]
        metrics["kernel_ms/total/fwd"] = sum(row["fwd_ms"] for row in rows)
        metrics["kernel_ms/total/bwd"] = sum(row["bwd_ms"] or 0.0 for row in rows)
        step = rows[0]["step"]
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
            log_table(logger, "kernel_timing", rows, step)
        self._write(Path(self.dirpath or trainer.default_root_dir), trainer.strategy.root_device)

    def _write(self, folder: Path, device: torch.device) -> None:
        """Rewrite the CSV and JSON with every timed step so far (a killed run keeps what it measured)."""
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "kernel_timing.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(self.rows)
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        timer = "cuda events" if device.type == "cuda" else "wall clock"
        (folder / "kernel_timing.json").write_text(json.dumps(
            {"device": device_name, "timer": timer, "every_n_steps": self.every_n_steps,
             "warmup_steps": self.warmup_steps, "columns": list(COLUMNS), "rows": self.rows}, indent=1))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._remove()
        if not trainer.is_global_zero:
            return
        if self._timed_step < 0:
            log.warning("kernel timing: no step was timed (the first is step %d): lower "
                        "callbacks.kernel_timing.warmup_steps or train longer", self.warmup_steps)
            return
        timed = len({row["step"] for row in self.rows})
        if 0 < timed < MIN_SAMPLES:
            log.warning("kernel timing: only %d step(s) timed (every %d steps after %d), too few for a mean: lower "
                        "callbacks.kernel_timing.every_n_steps or train longer", timed, self.every_n_steps,
                        self.warmup_steps)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._timing = False
        self._remove()
        self._layers.clear()


def log_table(logger: Any, key: str, rows: list[dict[str, Any]], step: int) -> None:
    """Send a table to loggers that take one: a W&B Table, a Markdown text in TensorBoard. Others (CSVLogger)
    have no table API; the CSV/JSON files in the run folder hold the table for them."""
    columns = list(rows[0])
    if isinstance(logger, WandbLogger):
        logger.log_table(key, columns=columns, data=[list(row.values()) for row in rows], step=step)
    elif isinstance(logger, TensorBoardLogger):
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(_cell(v) for v in row.values()) + " |" for row in rows]
        logger.experiment.add_text(key, "\n".join(lines), global_step=step)


def _cell(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)
