"""A Hydra callback that finishes the active W&B run at the end of every job (conf/logger/wandb.yaml adds it).

Lightning's WandbLogger never calls wandb.finish(), and when a run is still active a new WandbLogger reuses it, so
without this every job of a multirun after the first would log into the first job's run. Hydra's job-end hook is
the one place that runs once per job, after trainer.fit and trainer.validate, in the process that owns the run.
"""
from __future__ import annotations

from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class FinishWandbRun(Callback):
    """wandb.finish() after each Hydra job (a no-op when no run is active, e.g. on DDP ranks other than 0)."""

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        import wandb  # imported here: runs without the W&B logger never load it

        if wandb.run is not None:
            wandb.finish(exit_code=0 if job_return.status == JobStatus.COMPLETED else 1)
