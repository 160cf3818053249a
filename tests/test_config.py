"""Hydra config tests: every option of every group composes and resolves, overrides land where they should,
mistakes end in Hydra's one-line messages, and the RepLKNet-31B recipe carries the published numbers."""
from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import DictConfig, OmegaConf

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
GROUPS = ("model", "data", "optim", "trainer", "logger", "callbacks", "experiment")
# values the user must supply for some options (???) so that those compose to a complete config
REQUIRED = {"data=imagenet": ["data.root=/data/imagenet"],
            "data=imagefolder": ["data.root=/data/flowers", "data.num_classes=102"],
            "data=imagenet_shards": ["data.root=/data/imagenet-shards"],
            "experiment=replknet31b_in1k": ["data.root=/data/imagenet"],
            "experiment=unireplknet_in1k": ["data.root=/data/imagenet"]}


def make_cfg(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=["paths.output_dir=/tmp/lkcnn-test", *overrides])


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True, check=False,
                          timeout=120, env={**os.environ, "HYDRA_FULL_ERROR": "0"})


def options() -> list[str]:
    return [f"{group}={path.stem}" for group in GROUPS for path in sorted((CONF / group).glob("*.yaml"))]


def test_every_group_has_options_and_every_zoo_model_a_config():
    assert all(any((CONF / group).glob("*.yaml")) for group in GROUPS)
    models = {path.stem for path in (CONF / "model").glob("*.yaml")}
    assert {"replknet31b", "replknet31l", "replknet_xl", "replknet_tiny", "convnext_lk_tiny"} <= models


@pytest.mark.parametrize("option", options())
def test_every_option_composes_and_resolves(option):
    cfg = make_cfg(option, *REQUIRED.get(option, []))
    resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    assert resolved["module"]["model"] == resolved["model"]
    assert resolved["model"]["num_classes"] == resolved["data"]["num_classes"]
    group, name = option.split("=")
    if group == "model":
        assert resolved["model"]["name"] in name  # replknet_tiny_32px is replknet_tiny at other kernel sizes


def test_default_run_is_the_small_model_on_digits_on_any_device():
    cfg = make_cfg()
    assert cfg.model.name == "replknet_tiny" and cfg.data._target_.endswith("DigitsDataModule")
    assert cfg.trainer.accelerator == "auto"
    assert cfg.conv_impl == "auto" and list(cfg.logger) == ["csv"]
    assert set(cfg.callbacks) == {"checkpoint_best", "checkpoint_last", "lr_monitor", "progress_bar"}
    assert cfg.callbacks.checkpoint_last.filename == "last" and cfg.callbacks.checkpoint_best.monitor == "val/acc1"


def test_overrides_reach_the_model_and_the_module():
    sizes = random.sample(range(3, 32, 2), 4)
    cfg = make_cfg("model=replknet31b", f"model.kernel_sizes=[{','.join(map(str, sizes))}]",
                   "model.drop_path_rate=0.25", "conv_impl=torch", "data.batch_size=16")
    module_cfg = OmegaConf.to_container(cfg.module, resolve=True)
    assert cfg.model.name == "replknet31b"
    assert module_cfg["model"]["kernel_sizes"] == sizes and module_cfg["model"]["drop_path_rate"] == 0.25
    assert module_cfg["conv_impl"] == "torch" and cfg.data.batch_size == 16


def test_replknet31b_in1k_carries_the_published_recipe():
    cfg = OmegaConf.to_container(make_cfg("experiment=replknet31b_in1k", "data.root=/x"), resolve=True)
    model, data, optim = cfg["model"], cfg["data"], cfg["optim"]
    assert model["name"] == "replknet31b" and model["kernel_sizes"] == [31, 29, 27, 13] and model["small_kernel"] == 5
    assert model["drop_path_rate"] == 0.5 and cfg["trainer"]["max_epochs"] == 300
    assert optim["optimizer"]["opt"] == "adamw" and optim["optimizer"]["lr"] == 4e-3
    assert optim["lr_base_batch"] == 2048 and optim["optimizer"]["weight_decay"] == 0.05
    assert optim["optimizer"]["eps"] == 1e-8
    assert optim["scheduler"] == {"sched": "cosine", "warmup_epochs": 10, "warmup_lr": 1e-6, "min_lr": 1e-6}
    assert cfg["module"]["ema"]["decay"] == 0.9999
    assert data["transform"]["auto_augment"] == "rand-m9-mstd0.5-inc1" and data["transform"]["re_prob"] == 0.25
    assert data["transform"]["color_jitter"] == 0.4 and data["transform"]["interpolation"] == "bicubic"
    assert data["mixup"]["mixup_alpha"] == 0.8 and data["mixup"]["cutmix_alpha"] == 1.0
    assert data["label_smoothing"] == 0.1 and data["num_classes"] == 1000


def test_unknown_key_and_unknown_option_fail_with_hydra_messages():
    with pytest.raises(ConfigCompositionException, match="model.kernel_size"):
        make_cfg("model.kernel_size=13")  # typo of kernel_sizes
    with pytest.raises(MissingConfigException, match="model/replknet99"):
        make_cfg("model=replknet99")


def test_missing_root_is_reported_by_name():
    cfg = make_cfg("data=imagenet")
    with pytest.raises(Exception, match="data.root"):
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)


def test_cli_cfg_job_and_help():
    job = run_cli("model=replknet31b", "model.kernel_sizes=[13,13,13,13]", "--cfg", "job")
    assert job.returncode == 0, job.stderr
    printed = OmegaConf.create(job.stdout)
    assert printed.model.name == "replknet31b" and list(printed.model.kernel_sizes) == [13] * 4
    helped = run_cli("--help")
    assert helped.returncode == 0, helped.stderr
    for text in ("model: ", "replknet31b", "experiment: ", "replknet31b_in1k", "ckpt_path=latest"):
        assert text in helped.stdout


@pytest.mark.parametrize("override, message", [
    ("model.no_such_key=1", "Error: model.no_such_key is not a setting of this config"),
    ("data=no_such_data", "Error: data=no_such_data is not one of the data configs (digits, imagefolder"),
    pytest.param("trainer=ddp", "add trainer.accelerator=cpu", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="the GPU machine trains instead")),
])
def test_cli_bad_override_fails_without_traceback(override, message):
    result = run_cli(override)
    assert result.returncode != 0
    assert message in result.stderr and "Traceback" not in result.stderr
