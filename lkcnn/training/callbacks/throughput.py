"""Training throughput in images/s, warm-up excluded: a Lightning callback, and the number the ablation table reads.

The clock runs over training batches only: it starts (after a device synchronize) at the end of the
`warmup_batches`-th training batch and pauses before validation and at each epoch end, so neither validation, nor
warm-up (extension build, cuDNN autotuning, allocator growth), nor the first batch of each epoch (loader restart)
is counted. Within a stretch the time includes data loading, so a slow input pipeline shows up.
The device is synchronized only where the clock starts, pauses or is read (every `log_every_n_steps`), not per batch.

Why not Lightning's ThroughputMonitor: it synchronizes after every batch, reports a sliding window, and gives no
run-level figure with the warm-up left out, which is what a benchmark and the ablation table need.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

log = logging.getLogger(__name__)


class ThroughputCallback(L.Callback):
    """Log `throughput/train_images_per_s` (all devices together) and write `<dirpath>/throughput.json` at the end.

    Args:
        warmup_batches: training batches left out at the start of a fit.
        log_every_n_steps: batches between logged readings; the trainer's log_every_n_steps when None.
        dirpath: folder of throughput.json; the trainer's default_root_dir (the run folder) when None.
    """

    def __init__(self, warmup_batches: int = 20, log_every_n_steps: int | None = None,
                 dirpath: str | None = None) -> None:
        super().__init__()
        if warmup_batches < 0 or (log_every_n_steps is not None and log_every_n_steps < 1):
            raise ValueError(f"throughput needs warmup_batches >= 0 and log_every_n_steps >= 1, got {warmup_batches} "
                             f"and {log_every_n_steps}: fix callbacks.throughput.*")
        self.warmup_batches = warmup_batches
        self.log_every_n_steps = log_every_n_steps
        self.dirpath = dirpath
        self.images = 0          # images of all devices in the measured batches
        self.seconds = 0.0       # time of the measured batches
        self.batch_size = 0
        self._seen = 0           # training batches of this fit so far
        self._start: float | None = None  # perf_counter() when the current stretch started; None while paused

    def _now(self, trainer: L.Trainer) -> float:
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the GPU runs behind the Python thread
        return time.perf_counter()

    def _pause(self, trainer: L.Trainer) -> None:
        if self._start is not None:
            self.seconds += self._now(trainer) - self._start
            self._start = None

    @property
    def images_per_s(self) -> float | None:
        return self.images / self.seconds if self.seconds > 0 else None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.images, self.seconds, self._seen, self._start = 0, 0.0, 0, None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._seen += 1
        if self._seen < max(self.warmup_batches, 1):
            return
        if self._start is None:  # this batch ends the warm-up or a pause: the clock starts now
            self._start = self._now(trainer)
            return
        self.batch_size = len(batch[0])
        self.images += self.batch_size * trainer.world_size  # every rank runs a batch of the same size
        every = self.log_every_n_steps or trainer.log_every_n_steps
        if (self._seen - self.warmup_batches) % every == 0:
            self.seconds += self._now(trainer) - self._start
            self._start = time.perf_counter()
            self._log(trainer)

    def _log(self, trainer: L.Trainer) -> None:
        if self.images_per_s is None:
            return
        metrics = {"throughput/train_images_per_s": self.images_per_s,
                   "throughput/train_images_per_s_per_device": self.images_per_s / trainer.world_size}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._pause(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._pause(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._start = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._pause(trainer)
        if not trainer.is_global_zero:
            return
        if self.images_per_s is None:
            log.warning("throughput: no training batch was measured after the %d warm-up batches: train longer "
                        "or lower callbacks.throughput.warmup_batches", self.warmup_batches)
            return
        self._log(trainer)
        device = trainer.strategy.root_device
        result = {"images_per_s": self.images_per_s, "images_per_s_per_device": self.images_per_s / trainer.world_size,
                  "images": self.images, "seconds": self.seconds, "warmup_batches": self.warmup_batches,
                  "batch_size_per_device": self.batch_size, "world_size": trainer.world_size,
                  "precision": str(trainer.precision),
                  "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
        folder = Path(self.dirpath or trainer.default_root_dir)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "throughput.json").write_text(json.dumps(result, indent=1))
        log.info("throughput: %.1f images/s over %d images on %d device(s) (%s, %s), %d warm-up batches left out",
                 self.images_per_s, self.images, trainer.world_size, result["device"], result["precision"],
                 self.warmup_batches)
