"""Training tests on the CPU: a fast dev run of every model config at a tiny size, the speed/memory options, a
shortened default run that learns and writes checkpoints the exporter can read, and the optimizer/schedule."""
from __future__ import annotations

import importlib.util
import math
import os
import random
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import DictConfig

from lkcnn.compile import AUTO_COMPILE_MODE, compile_options
from lkcnn.ops import conv_impl, dwconv
from lkcnn.training import ClassificationModule, ConfigError, PathNotFoundError, build_model, resolve_ckpt_path
from lkcnn.training.callbacks.kernel_timing import KernelTimingCallback
from lkcnn.training.callbacks.throughput import ThroughputCallback
from lkcnn.training.module import auto_compile_mode

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("train_app", ROOT / "train.py")
train_app = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_app)

# a few pixels and channels, one block per stage: every model config runs in about a second
TINY_DATA = ["data=synthetic", "data.num_classes=10", "data.img_size=32", "data.num_train=8", "data.num_val=4",
             "data.batch_size=4", "data.num_workers=0"]
TINY_WIDTH = {"replknet": ["+model.channels=[8,8,16,16]", "+model.depths=[1,1,1,1]"],
              "convnext": ["+model.dims=[8,8,16,16]", "+model.depths=[1,1,1,1]"],
              "slak": ["+model.dims=[8,8,16,16]", "+model.depths=[1,1,1,1]"],
              "unireplknet": ["+model.dims=[8,8,16,16]", "+model.depths=[1,1,1,1]", "+model.kernel_sizes=[3,13,13,13]"]}
MODEL_CONFIGS = sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml"))


pytestmark = pytest.mark.usefixtures("one_thread")


class LrProbe(L.Callback):
    """Records the schedule's lr (before layer-decay scaling) at every training step."""

    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_train_batch_start(self, trainer: L.Trainer, *args) -> None:
        group = trainer.optimizers[0].param_groups[0]
        self.lrs.append(group["lr"] / group["lr_scale"])


def make_cfg(tmp_path: Path, *overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=[f"paths.output_dir={tmp_path}", f"paths.runs_dir={tmp_path}",
                                           *overrides])


def tiny(model: str) -> list[str]:
    return [f"model={model}", *TINY_WIDTH[model.split("_")[0].rstrip("0123456789bl")], *TINY_DATA]


@pytest.mark.parametrize("model", MODEL_CONFIGS)
def test_fast_dev_run_of_every_model_config(tmp_path, model):
    metrics = train_app.train(make_cfg(tmp_path, *tiny(model), "trainer.fast_dev_run=true"))
    assert 0 <= metrics["val/acc1"] <= metrics["val/acc5"] <= 1 and math.isfinite(metrics["val/loss"])
    assert "val_ema/acc1" in metrics


def test_speed_and_memory_options_train(tmp_path):
    cfg = make_cfg(tmp_path, *tiny("replknet_tiny"), "trainer.fast_dev_run=true", "trainer.precision=bf16-mixed",
                   "module.channels_last=true", "module.grad_checkpointing=true", "trainer.gradient_clip_val=1.0",
                   "data.mixup={mixup_alpha:0.8,cutmix_alpha:1.0}", "data.label_smoothing=0.1")
    assert math.isfinite(train_app.train(cfg)["val/loss"])  # clipping: AdamW unfused (Lightning refuses fused)
    module = instantiate(cfg.module)
    assert all(stage.grad_checkpointing for stage in module.model.stages)
    assert not any(p.requires_grad for p in module.model_ema.parameters())  # DDP would call them unused


def test_compile_keeps_the_state_dict_keys(tmp_path):
    cfg = make_cfg(tmp_path, *tiny("replknet_tiny"))
    plain = instantiate(cfg.module)
    compiled = instantiate(cfg.module, compile=True)
    assert compiled.model._compiled_call_impl is not None
    assert list(compiled.state_dict()) == list(plain.state_dict())
    compiled.teardown("fit")  # frees CUDA graphs where there are any; none here
    with pytest.raises(ConfigError, match=r"module.compile='fast'.*reduce-overhead"):
        ClassificationModule(dict(cfg.model), dict(cfg.optim), compile="fast")  # a mode torch.compile lacks


def test_compile_takes_lkcnns_inductor_settings(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kwargs: seen.append(kwargs))
    module = instantiate(make_cfg(tmp_path, *tiny("replknet_tiny")).module, compile="reduce-overhead")
    # the mode's options, INDUCTOR_SETTINGS and RepLKNet's own
    assert seen == [{"options": compile_options("reduce-overhead", module.model)}]
    assert seen[0]["options"]["realize_opcount_threshold"] == 40
    cfg = make_cfg(tmp_path, *tiny("replknet_tiny"), "module.compile=reduce-overhead",
                   "module.inductor={coordinate_descent_tuning:true,combo_kernels:false}")
    instantiate(cfg.module)
    assert seen[-1] == {"options": {**compile_options("reduce-overhead", module.model),
                                    "coordinate_descent_tuning": True, "combo_kernels": False}}  # config's over lkcnn's
    with pytest.raises(ConfigError, match=r"^module.inductor: .* no inductor setting 'coordinate_descent'"):
        ClassificationModule(dict(cfg.model), dict(cfg.optim), inductor={"coordinate_descent": True})


def test_auto_compile_compiles_on_a_gpu_unless_a_callback_times_modules(tmp_path):
    cfg = make_cfg(tmp_path, *tiny("replknet_tiny"))
    module = instantiate(cfg.module)
    assert cfg.module.compile == "auto" and module.model._compiled_call_impl is None  # settled in setup()
    assert auto_compile_mode("cuda", [ThroughputCallback()]) == (AUTO_COMPILE_MODE, "")
    assert auto_compile_mode("cpu", []) == (None, "auto: eager on cpu")
    mode, why = auto_compile_mode("cuda", [ThroughputCallback(), KernelTimingCallback()])
    assert mode is None and "KernelTimingCallback" in why


def test_default_run_shortened_learns_and_checkpoints_carry_the_contract(tmp_path):
    cfg = make_cfg(tmp_path, "trainer.max_epochs=2", "data.batch_size=32", "optim.scheduler.warmup_epochs=0",
                   "optim.optimizer.lr=4e-3")
    metrics = train_app.train(cfg)
    assert metrics["val/acc1"] > 0.5 and metrics["val_ema/acc1"] > 0.3  # chance is 0.1
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "last.ckpt").is_file() and len(list(checkpoints.glob("best-*.ckpt"))) == 1
    assert (tmp_path / "csv" / "metrics.csv").is_file()
    ckpt = torch.load(checkpoints / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["lkcnn_model"]["name"] == "replknet_tiny"
    assert ckpt["lkcnn_model"]["kwargs"]["kernel_sizes"] == list(cfg.model.kernel_sizes)
    assert type(ckpt["hydra_config"]) is dict and ckpt["hydra_config"]["model"] == dict(cfg.model, num_classes=10)
    net = {k[len("model."):] for k in ckpt["state_dict"] if k.startswith("model.")}
    ema = {k[len("model_ema.module."):] for k in ckpt["state_dict"] if k.startswith("model_ema.module.")}
    assert net == ema and "head.weight" in net
    rebuilt = build_model({"name": ckpt["lkcnn_model"]["name"], **ckpt["lkcnn_model"]["kwargs"]})
    rebuilt.load_state_dict({k: ckpt["state_dict"][f"model_ema.module.{k}"] for k in net})
    restored = ClassificationModule.load_from_checkpoint(checkpoints / "last.ckpt", map_location="cpu")
    assert restored.hydra_config == ckpt["hydra_config"]


def test_run_without_validation_trains_and_returns_no_metrics(tmp_path):
    """limit_val_batches=0 (the throughput benchmark's setting) ended in an IndexError after training."""
    cfg = make_cfg(tmp_path, *tiny("replknet_tiny"), "trainer.max_steps=2", "trainer.limit_val_batches=0")
    assert train_app.train(cfg) == {}
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()


def test_optimizer_groups_lr_scaling_and_per_iteration_schedule(tmp_path):
    batch, base = random.choice([4, 8]), random.choice([256, 512, 2048])
    cfg = make_cfg(tmp_path, *tiny("replknet_tiny"), f"data.batch_size={batch}", "data.num_train=24",
                   f"optim.lr_base_batch={base}", "optim.scheduler.warmup_epochs=1", "optim.scheduler.min_lr=0",
                   "trainer.max_epochs=2", "optim.optimizer.layer_decay=0.7", "module.ema=null")
    module = instantiate(cfg.module)
    trainer = instantiate(cfg.trainer, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    probe = LrProbe()
    trainer.callbacks.append(probe)
    trainer.fit(module, datamodule=instantiate(cfg.data))
    lrs = probe.lrs
    optimizer = trainer.optimizers[0]
    peak = cfg.optim.optimizer.lr * batch / base
    assert all(group["initial_lr"] == pytest.approx(peak) for group in optimizer.param_groups)
    assert optimizer.defaults["fused"]  # conf/optim/adamw.yaml's default (unfused only with gradient clipping)
    for group in optimizer.param_groups:  # timm: no weight decay on 1-D params (BN, biases)
        assert all(p.ndim <= 1 for p in group["params"]) == (group["weight_decay"] == 0)
    scales = sorted({g["lr_scale"] for g in optimizer.param_groups})
    assert len(scales) > 2 and scales[-1] == pytest.approx(1.0) and scales[-2] == pytest.approx(0.7)
    steps = 24 // batch  # per epoch; warmup is the first epoch, the cosine spans both
    expected = [1e-6 + t * (peak - 1e-6) / steps if t < steps else 0.5 * peak * (1 + math.cos(math.pi * t / steps / 2))
                for t in range(2 * steps)]
    assert lrs == pytest.approx(expected, rel=1e-6)  # set every iteration, not once per epoch


@pytest.mark.parametrize("opt", ["lamb", "sgd"])
def test_other_optimizers_train_with_the_fused_default(tmp_path, opt):
    """conf/optim/adamw.yaml sets fused: true; optimizers without a fused kernel (lamb) run without it."""
    cfg = make_cfg(tmp_path, *tiny("replknet_tiny"), f"optim.optimizer.opt={opt}", "trainer.max_steps=1",
                   "trainer.limit_val_batches=0")
    train_app.train(cfg)
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()


def test_a_users_conv_impl_variable_is_not_replaced_silently(tmp_path, monkeypatch):
    """LKCNN_CONV_IMPL exported by the user loses to the config's conv_impl, with a warning that names the override;
    the variable itself is left as the user set it, so a multirun's later jobs see the user's value, not a job's."""
    model = make_cfg(tmp_path, *tiny("replknet_tiny")).model
    monkeypatch.setenv("LKCNN_CONV_IMPL", "torch")
    monkeypatch.setattr(dwconv, "_env_impl", dwconv.read_env())  # as a new process sees it: read at import
    with pytest.warns(UserWarning, match="pass conv_impl=torch"):
        build_model(model, conv_impl="auto")
    assert conv_impl() == "auto" and os.environ["LKCNN_CONV_IMPL"] == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_model(model, conv_impl="torch")
    assert conv_impl() == "torch"


def test_model_mistakes_are_config_errors(tmp_path):
    cfg = make_cfg(tmp_path, *tiny("replknet_tiny"), "conv_impl=torch")
    instantiate(cfg.module)
    assert conv_impl() == "torch"
    with pytest.raises(ConfigError, match="conv_impl='triton'"):
        build_model(cfg.model, conv_impl="triton")
    with pytest.raises(ConfigError, match="kernel_sizes"):
        build_model({**cfg.model, "kernel_sizes": [13, 13]})
    with pytest.raises(ConfigError, match="no_such_kwarg"):
        build_model({**cfg.model, "no_such_kwarg": 1})
    with pytest.raises(ConfigError, match="unknown model name"):
        build_model({"name": "replknet_huge"})


def test_ckpt_path_without_a_checkpoint_says_what_to_pass(tmp_path):
    model = torch.nn.Linear(1, 1)  # the checks below fail before any checkpoint is compared with the model
    with pytest.raises(PathNotFoundError, match="ckpt_path=latest found no checkpoints"):
        resolve_ckpt_path("latest", str(tmp_path), model)
    assert resolve_ckpt_path(None, str(tmp_path), model) is None
    with pytest.raises(PathNotFoundError, match="is not a file"):
        resolve_ckpt_path(str(tmp_path / "missing.ckpt"), str(tmp_path), model)


def test_training_waits_for_the_device_only_at_logging_steps(tmp_path, monkeypatch):
    """Each Tensor.item() makes the host wait for the GPU, and a CUDA-graph step then idles while the host prepares
    the next batch. Lightning reads values logged with prog_bar=True every step (Lightning-AI/pytorch-lightning#21232),
    so the loss reaches the progress bar through lkcnn's ProgressBar, which reads it only at logging steps."""
    from lkcnn.training.callbacks.progress_bar import ProgressBar

    steps, every = 12, 4
    cfg = make_cfg(tmp_path, *tiny("replknet_tiny"), f"data.num_train={4 * steps}", f"trainer.max_steps={steps}",
                   f"trainer.log_every_n_steps={every}", "trainer.limit_val_batches=0", "module.ema=null")
    reads, counting = [], [False]
    item = torch.Tensor.item

    def counted_item(t):
        if counting[0] and t.is_floating_point():  # (not the loader's integer seed, drawn on the host)
            reads.append(t)
        return item(t)

    class Count(L.Callback):
        def on_train_start(self, *_):
            counting[0] = True

        def on_train_end(self, *_):
            counting[0] = False

    monkeypatch.setattr(torch.Tensor, "item", counted_item)
    bar = ProgressBar()
    trainer = instantiate(cfg.trainer, logger=L.pytorch.loggers.CSVLogger(tmp_path), enable_checkpointing=False,
                          callbacks=[bar, Count()])
    module = instantiate(cfg.module)
    trainer.fit(module, datamodule=instantiate(cfg.data))
    # per logging step the logger's read and the bar's, and the epoch's loss at its end: not one per step
    assert 0 < len(reads) <= 2 * (steps // every) + 3, len(reads)
    shown = bar.get_metrics(trainer, module)
    assert shown["train/loss_step"] == pytest.approx(trainer.callback_metrics["train/loss_step"].item())


def test_progress_bar_rejects_a_loss_interval_below_one():
    from lkcnn.training.callbacks.progress_bar import ProgressBar

    with pytest.raises(ValueError, match="fix callbacks.progress_bar.loss_every_n_steps"):
        ProgressBar(loss_every_n_steps=0)
