"""Train a large-kernel CNN: compose conf/train.yaml with the command-line overrides, instantiate, fit.

    python train.py                      # replknet_tiny on scikit-learn's digits (CPU or GPU, a few minutes)
    python train.py --help               # groups, options, examples, how to resume
"""
from __future__ import annotations

from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf


def train(cfg: DictConfig) -> dict[str, float]:
    """Fit, then validate the best checkpoint (Lightning prints the metrics table); returns those metrics."""
    # imported here, not at the top: Hydra's --help and --cfg need none of these
    import lightning as L
    import torch
    from hydra.core.hydra_config import HydraConfig
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate
    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn

    from lkcnn.errors import first_line
    from lkcnn.training import ConfigError, SyncBatchNormPlugin, resolve_ckpt_path, user_error_message
    from lkcnn.training.callbacks.run_summary import RunSummary
    from lkcnn.training.console import quiet_known_noise
    from lkcnn.training.resume import check_resume_config, claim_run_dir, resume_note

    quiet_known_noise()
    resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)  # a ??? left unset fails here
    for key, least in (("seed", 0), ("cpu_threads", 1)):
        value = cfg[key]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            raise ConfigError(f"{key}={value!r} must be a whole number of at least {least}"
                              + (" (or null: one thread per core on the CPU)" if key == "cpu_threads" else ""))
    on_gpu = torch.cuda.is_available() and cfg.trainer.get("accelerator") != "cpu"
    distributed = cfg.trainer.get("strategy") is not None or cfg.trainer.get("num_nodes", 1) != 1 \
        or cfg.trainer.get("devices") not in (None, 1, "1", "auto")
    if cfg.trainer.get("sync_batchnorm") and distributed and not on_gpu:  # DDP refuses it once the ranks have started
        raise ConfigError("trainer.sync_batchnorm=true needs GPUs (DDP runs SyncBatchNorm on CUDA tensors only): for "
                          "DDP on the CPU (gloo) add trainer.accelerator=cpu trainer.devices=2 "
                          "trainer.sync_batchnorm=false")
    threads = cfg.cpu_threads or (1 if on_gpu else None)  # null: one per core on the CPU, 1 beside a GPU
    if threads:
        torch.set_num_threads(threads)
    L.seed_everything(cfg.seed, workers=True)
    datamodule = instantiate(cfg.data)
    module = instantiate(cfg.module)
    module.hydra_config = resolved  # saved in every checkpoint
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values()]
    if cfg.trainer.get("limit_val_batches") == 0:  # a training-speed run: no val/ metric for a callback to watch
        callbacks = [c for c in callbacks if not str(getattr(c, "monitor", None) or "").startswith("val")]
    choices = dict(HydraConfig.get().runtime.choices) if HydraConfig.initialized() else {}
    ckpt_path = resolve_ckpt_path(cfg.ckpt_path, cfg.paths.runs_dir, module.model)
    for warning in check_resume_config(ckpt_path, resolved):  # a changed setting the checkpoint's state overrides
        rank_zero_warn(warning)
    if rank_zero_only.rank == 0:  # the run's other processes (DDP ranks) write into the folder rank 0 claimed
        claim_run_dir(cfg.paths.output_dir, ckpt_path)  # another run's folder is refused: nothing of it is overwritten
    # always: what the run does, before its first step
    callbacks.append(RunSummary(choices, cfg.paths.output_dir, resume_note(ckpt_path, cfg.paths.output_dir)))
    loggers = [instantiate(c) for c in (cfg.get("logger") or {}).values()]
    if not loggers:  # logger=[] or ~logger: nothing for the learning-rate monitor to log to (Lightning refuses it)
        callbacks = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
    # sync_batchnorm: lkcnn's SyncBatchNorm, which (unlike torch.nn.SyncBatchNorm) does not stall the CPU per layer
    plugins = {"plugins": [SyncBatchNormPlugin()]} if cfg.trainer.get("sync_batchnorm") else {}
    try:
        trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False, **plugins)
    except InstantiationException as err:  # Lightning's check of a value or keyword (its Misconfigurations pass)
        if not isinstance(err.__cause__, (TypeError, ValueError)) or user_error_message(err) is not None:
            raise
        raise ConfigError(f"trainer: {first_line(err.__cause__)} (check the trainer.* settings)") from None
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
    # trainer.limit_val_batches=0 (a training-speed run) validates nothing: no metrics, not an error
    results = trainer.validate(module, datamodule=datamodule, ckpt_path=best or None)
    return results[0] if results else {}


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> Any:
    from lkcnn.training.errors import exit_on_user_error
    from lkcnn.training.resume import remove_unused_run_dirs

    try:
        with exit_on_user_error():
            return train(cfg).get("val/acc1")  # the value a Hydra sweeper optimizes
    except SystemExit as exited:  # a config mistake: the folder made for the run holds nothing but Hydra's files
        if str(exited.code).startswith("Error: "):  # exit_on_user_error's, not an interrupt's
            remove_unused_run_dirs()
        raise


if __name__ == "__main__":
    import logging
    import sys

    # imported before Hydra sets up logging, Lightning would give its loggers a console handler of their own and stop
    # them propagating to the root logger, whose handlers Hydra sets (train.log): a root handler first prevents that
    logging.getLogger().addHandler(logging.NullHandler())
    from lkcnn.training.configs import command_line_error

    mistake = command_line_error(sys.argv[1:])  # a misspelled key or option: one line, not Hydra's report
    if mistake:
        sys.exit(f"Error: {mistake}")
    from lightning.pytorch.utilities import rank_zero_only

    from lkcnn.training.resume import other_run, unused_run_dir

    # conf/train.yaml's run folder, made when a run starts (not for Hydra's --cfg, --info or --help)
    runs = not {"--cfg", "-c", "--info", "-i", "--help", "-h", "--hydra-help"} & set(sys.argv[1:])
    OmegaConf.register_new_resolver("lkcnn.unused_dir", unused_run_dir if runs else str, replace=True)
    # hydra.run.dir=<another run's folder>: refused before Hydra writes its .hydra/ files there (train() checks again,
    # for runs whose folder comes from elsewhere). Lightning starts a DDP run's other ranks with rank 0's folder.
    given = dict(arg.split("=", 1) for arg in sys.argv[1:] if arg.startswith(("hydra.run.dir=", "ckpt_path=")))
    if "hydra.run.dir" in given and given.get("ckpt_path") != "latest" and rank_zero_only.rank == 0:
        if taken := other_run(given["hydra.run.dir"], given.get("ckpt_path")):
            sys.exit(f"Error: {taken}")
    main()
