"""The LightningModule: a timm/lkcnn classifier trained with timm's optimizer, scheduler, losses and EMA.

Checkpoint contract (read by lkcnn's exporter):
- `state_dict`: the network under `model.<official keys>`, its EMA copy under `model_ema.module.<official keys>`;
- `checkpoint["lkcnn_model"]`: `model.lkcnn_spec` ({"name", "kwargs"}), enough for timm.create_model;
- `checkpoint["hydra_config"]`: the resolved run config as a plain dict.
"""
from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from timm.loss import SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.scheduler.scheduler import Scheduler
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy

from lkcnn.compile import AUTO_COMPILE_MODE, check_settings, compile_model
from lkcnn.errors import first_line
from lkcnn.ops.sync_batchnorm import DEFAULT_EXCHANGE_TIMEOUT_S, check_nvlink_exchange

from .distributed import compile_as_one_graph_under_ddp, configure_sync_bn_exchange, use_nvlink_exchange
from .ema import ModelEma
from .errors import ConfigError
from .model_factory import build_model
from .seeding import reseed_globals

# the EMA copy is in eval mode on purpose (it is never trained); Lightning would warn about it at every fit
warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode at the start of training")


def auto_compile_mode(device_type: str, callbacks: list[L.Callback]) -> tuple[str | None, str]:
    """module.compile=auto: (the torch.compile mode, or None for eager; why eager). Eager off a GPU, where the step
    is bound by the kernels, not the host, and where a callback times modules through hooks (needs_eager_modules),
    which a compiled network skips."""
    if device_type != "cuda":
        return None, f"auto: eager on {device_type}"
    eager_for = [type(c).__name__ for c in callbacks if getattr(c, "needs_eager_modules", False)]
    if eager_for:
        return None, f"auto: eager, {', '.join(eager_for)} times modules through hooks"
    return AUTO_COMPILE_MODE, ""


class ClassificationModule(L.LightningModule):
    """Image classification with an lkcnn (or any timm) model.

    Args:
        model: `conf/model/*.yaml` node: `name` and the keyword arguments of timm.create_model.
        optim: `conf/optim/*.yaml` node: `optimizer` (create_optimizer_v2 kwargs, `lr` for a total batch of
            `lr_base_batch` when that is set, else as is) and `scheduler` (create_scheduler_v2 kwargs), stepped
            every iteration.
        conv_impl: large-kernel conv implementation (auto|cuda|torch), chosen with lkcnn.ops.set_conv_impl.
        ema: timm ModelEmaV3 kwargs (decay, use_warmup, ...) for lkcnn.training.ema.ModelEma, or None; the EMA
            weights are validated too.
        seed: run seed; every epoch re-seeds torch/numpy/random from (seed, epoch, rank) so resumes repeat.
        channels_last, grad_checkpointing: speed/memory options.
        compile: torch.compile the network in place: "auto" (default: AUTO_COMPILE_MODE when the run trains on a
            GPU and no callback needs eager module hooks, else eager), False, True (torch's default mode) or a
            torch.compile mode, e.g. "reduce-overhead" (forward and backward replayed as CUDA graphs, which takes
            the launch cost of the eager step off the host).
        inductor: `torch._inductor.config` settings over lkcnn's (lkcnn.compile) when the network compiles, e.g.
            {"coordinate_descent_tuning": True}: faster kernels for a longer compile.
        sync_bn_exchange: where SyncBatchNorm's statistics travel: "auto" (default: lkcnn's NVLink kernels when
            compiled on several GPUs of one machine, else NCCL), "lkcnn" (the same, warning where they do not
            apply) or "torch" (NCCL); docs/training_multigpu.md.
        sync_bn_exchange_timeout_s: how long an lkcnn exchange waits for a peer before the run fails with
            ExchangeError.

    `hydra_config` (the resolved run config as a plain dict, set by train.py) goes into every checkpoint.
    """

    def __init__(self, model: Mapping[str, Any], optim: Mapping[str, Any], conv_impl: str = "auto",
                 ema: Mapping[str, Any] | None = None, seed: int = 0, channels_last: bool = False,
                 compile: bool | str = "auto", inductor: Mapping[str, Any] | None = None,
                 grad_checkpointing: bool = False, sync_bn_exchange: str = "auto",
                 sync_bn_exchange_timeout_s: float = DEFAULT_EXCHANGE_TIMEOUT_S) -> None:
        super().__init__()
        self.save_hyperparameters()
        for key, value in (("channels_last", channels_last), ("grad_checkpointing", grad_checkpointing)):
            if not isinstance(value, bool):  # a string such as 'maybe' would count as true
                raise ConfigError(f"module.{key}={value!r} must be true or false")
        try:  # the config's mistakes fail here, not after the processes have started
            use_nvlink_exchange(sync_bn_exchange, compiled=False, world_size=1, num_nodes=1, device_type="cpu")
        except ValueError as err:
            raise ConfigError(str(err)) from err
        if not (isinstance(sync_bn_exchange_timeout_s, (int, float)) and sync_bn_exchange_timeout_s > 0):
            raise ConfigError(f"module.sync_bn_exchange_timeout_s={sync_bn_exchange_timeout_s!r}: use a positive "
                              "number of seconds")
        try:
            self.inductor = check_settings(inductor) if inductor else {}  # imports inductor: only when set
        except ValueError as err:
            raise ConfigError(f"module.inductor: {err} (the names are torch._inductor.config's)") from err
        self.hydra_config: dict[str, Any] | None = None
        self.model = build_model(model, conv_impl)
        if grad_checkpointing:
            if not hasattr(self.model, "set_grad_checkpointing"):
                raise ConfigError(f"{model['name']} has no set_grad_checkpointing: set module.grad_checkpointing=false")
            self.model.set_grad_checkpointing(True)
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.model.to(memory_format=self.memory_format)
        self.model_ema = ModelEma(self.model, **ema) if ema else None
        if self.model_ema is not None:  # its deep copy still requires grad, which DDP reports as unused parameters
            self.model_ema.requires_grad_(False)
        # the compile mode in force (None: eager); "auto" is settled in setup(), once the device is known
        self.compile_mode: str | None = None
        self.compile_reason = ""
        if compile != "auto":
            self._compile(compile)
        num_classes = self.model.num_classes
        metrics = MetricCollection({
            "acc1": MulticlassAccuracy(num_classes, top_k=1, average="micro"),
            "acc5": MulticlassAccuracy(num_classes, top_k=min(5, num_classes), average="micro"),
        })
        self.val_metrics = metrics.clone(prefix="val/")
        self.val_ema_metrics = metrics.clone(prefix="val_ema/") if self.model_ema is not None else None
        self.soft_target_loss = SoftTargetCrossEntropy()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images.contiguous(memory_format=self.memory_format))

    def _compile(self, compile: bool | str) -> None:
        if compile is False or compile is None:
            self.compile_reason = "module.compile=false"
            return
        compile_as_one_graph_under_ddp()
        mode = "default" if compile is True else str(compile)
        try:  # in place: state_dict keys stay model.<official keys>
            compile_model(self.model, mode, self.inductor)
        except RuntimeError as err:  # an unknown mode
            raise ConfigError(f"module.compile={compile!r}: {err} (or true for the default mode, false for eager)") \
                from err
        self.compile_mode = mode

    def setup(self, stage: str) -> None:
        trainer, hp = self.trainer, self.hparams
        if hp.compile == "auto" and self.compile_mode is None and not self.compile_reason:
            mode, self.compile_reason = auto_compile_mode(trainer.strategy.root_device.type, trainer.callbacks)
            if mode:
                self._compile(mode)
        configure_sync_bn_exchange(hp.sync_bn_exchange, hp.sync_bn_exchange_timeout_s,
                                   compiled=self.compile_mode is not None,
                                   world_size=trainer.world_size, num_nodes=trainer.num_nodes,
                                   device_type=trainer.strategy.root_device.type)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        check_nvlink_exchange()  # raises ExchangeError once an NVLink exchange has failed (no GPU synchronization)

    def teardown(self, stage: str) -> None:
        # With module.compile=reduce-overhead on several GPUs the step's CUDA graphs hold SyncBatchNorm's
        # collectives, and while such graphs live, destroying the process group (at exit) hangs in
        # ncclCommDestroy (pytorch/pytorch#115388): free them when the stage ends. A later stage records anew.
        if self.compile_mode is not None:  # (imported here: inductor loads only when compiling)
            from torch._inductor.cudagraph_trees import reset_cudagraph_trees

            reset_cudagraph_trees()

    def on_train_epoch_start(self) -> None:
        reseed_globals(self.hparams.seed, self.current_epoch, self.global_rank)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, targets = batch
        logits = self(images)
        # soft targets come from mixup/cutmix or label smoothing (see ImageDataModule)
        loss = self.soft_target_loss(logits, targets) if targets.ndim == 2 else F.cross_entropy(logits, targets)
        # not prog_bar=True: Lightning would then wait for the GPU every step (lkcnn/training/callbacks/progress_bar.py)
        self.log("train/loss", loss, on_step=True, on_epoch=True, batch_size=len(images))
        return loss

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        if self.model_ema is not None:
            self.model_ema.update(self.model, step=self.global_step)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, targets = batch
        self._evaluate(self(images), targets, self.val_metrics, "val")
        if self.model_ema is not None:
            logits = self.model_ema.module(images.contiguous(memory_format=self.memory_format))
            self._evaluate(logits, targets, self.val_ema_metrics, "val_ema")

    def _evaluate(self, logits: torch.Tensor, targets: torch.Tensor, metrics: MetricCollection, prefix: str) -> None:
        metrics.update(logits, targets)
        self.log(f"{prefix}/loss", F.cross_entropy(logits, targets), batch_size=len(targets))
        self.log_dict(metrics, prog_bar=prefix == "val", batch_size=len(targets))

    def configure_optimizers(self) -> dict[str, Any]:
        optim = self.hparams.optim
        kwargs = dict(optim["optimizer"])
        kwargs["lr"] = self.scaled_lr(kwargs["lr"], optim.get("lr_base_batch"))
        if kwargs.get("fused") and self.trainer.gradient_clip_val:
            # Lightning's mixed-precision plugins refuse to clip the gradients of a fused optimizer (it unscales them
            # itself); clipping wins over the fused kernel
            rank_zero_info(f"gradient clipping is on: {kwargs['opt']} runs unfused (optim.optimizer.fused=false)")
            kwargs["fused"] = False
        try:
            try:
                optimizer = create_optimizer_v2(self.model, **kwargs)
            except TypeError as err:  # optimizers without a fused kernel (timm's lamb, lion, ...) take no `fused`
                if "fused" not in kwargs or "fused" not in str(err):
                    raise
                rank_zero_info(f"optimizer {kwargs['opt']!r} has no fused kernel: optim.optimizer.fused ignored")
                optimizer = create_optimizer_v2(self.model, **{k: v for k, v in kwargs.items() if k != "fused"})
        except (TypeError, ValueError) as err:  # timm's and torch's checks: an unknown opt, a negative or text lr
            raise ConfigError(f"optim.optimizer: {first_line(err)} (the settings are timm's create_optimizer_v2 "
                              "arguments, e.g. optim.optimizer.opt=adamw optim.optimizer.lr=2e-3)") from err
        epochs = self.trainer.max_epochs
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise ConfigError(f"trainer.max_epochs={epochs!r}: the cosine schedule is laid out over epochs; set a "
                              "positive whole number")
        if self.trainer.accumulate_grad_batches < 1:
            raise ConfigError(f"trainer.accumulate_grad_batches={self.trainer.accumulate_grad_batches} must be at "
                              "least 1")
        updates_per_epoch = math.ceil(self.trainer.estimated_stepping_batches / epochs)
        try:
            scheduler, _ = create_scheduler_v2(optimizer, num_epochs=epochs, step_on_epochs=False,
                                               updates_per_epoch=updates_per_epoch, **optim["scheduler"])
        except (TypeError, ValueError) as err:  # e.g. an unknown sched
            raise ConfigError(f"optim.scheduler: {first_line(err)} (the settings are timm's create_scheduler_v2 "
                              "arguments, e.g. optim.scheduler.sched=cosine)") from err
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def scaled_lr(self, lr: float, lr_base_batch: int | None) -> float:
        """`lr` as given, or linearly scaled from a total batch of `lr_base_batch` to this run's total batch."""
        if not lr_base_batch:
            return lr
        datamodule = self.trainer.datamodule
        if datamodule is None or not hasattr(datamodule, "batch_size"):
            raise ConfigError("optim.lr_base_batch needs a DataModule with a batch_size to scale the lr")
        total = datamodule.batch_size * self.trainer.accumulate_grad_batches * self.trainer.world_size
        return lr * total / lr_base_batch

    def lr_scheduler_step(self, scheduler: Scheduler, metric: Any) -> None:
        # timm schedulers step by update count (Lightning's default would call step() as for torch schedulers)
        scheduler.step_update(num_updates=self.global_step)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["lkcnn_model"] = copy.deepcopy(self.model.lkcnn_spec)
        checkpoint["hydra_config"] = self.hydra_config

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.hydra_config is None:  # load_from_checkpoint: keep the config of the run that wrote it
            self.hydra_config = checkpoint.get("hydra_config")
