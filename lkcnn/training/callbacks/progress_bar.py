"""The progress bar of train.py: Lightning's TQDM bar, showing the training loss without a host-GPU wait per step.

Why not the loss logged with `prog_bar=True` on Lightning's bar: Lightning turns every such value into a Python
number at the end of every batch, shown or not (Lightning-AI/pytorch-lightning#21232). That makes the host wait for
the GPU once per step, and a step replayed as CUDA graphs then leaves the GPU idle while the host prepares the next
batch. ClassificationModule logs its loss without `prog_bar`; this bar reads it from the trainer's callback metrics
(tensors, left on the GPU) every `loss_every_n_steps` optimizer steps, where the loggers read it anyway, and shows the
last reading in between.
"""
from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar
from torch import Tensor

LOSSES = ("train/loss_step", "train/loss_epoch")  # as ClassificationModule.training_step logs them


class ProgressBar(TQDMProgressBar):
    """TQDMProgressBar that also shows the training loss, read every `loss_every_n_steps` steps (the trainer's
    log_every_n_steps when None) and at the end of each epoch."""

    def __init__(self, refresh_rate: int = 1, leave: bool = False, loss_every_n_steps: int | None = None) -> None:
        super().__init__(refresh_rate=refresh_rate, leave=leave)
        if loss_every_n_steps is not None and loss_every_n_steps < 1:
            raise ValueError(f"the progress bar needs loss_every_n_steps >= 1, got {loss_every_n_steps}: fix "
                             "callbacks.progress_bar.loss_every_n_steps")
        self.loss_every_n_steps = loss_every_n_steps
        self._read: dict[str, tuple[Tensor, float]] = {}  # name -> (the tensor last read, its value)

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        every = self.loss_every_n_steps or trainer.log_every_n_steps
        for name in LOSSES:
            value = trainer.callback_metrics.get(name)
            due = name.endswith("_epoch") or trainer.global_step % every == 0  # an epoch's loss is read once anyway
            if value is not None and due and (name not in self._read or self._read[name][0] is not value):
                self._read[name] = (value, value.item())  # the one wait for the GPU
            if name in self._read:
                metrics[name] = self._read[name][1]
        return metrics
