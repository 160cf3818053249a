"""W&B logging without an account or network: offline unless a mode is chosen, runs in the Hydra run folder, one
finished run per multirun job, holding the kernel-timing table; CSV and TensorBoard logs alongside."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import timm
from hydra import compose, initialize_config_dir

import lkcnn.models  # noqa: F401  (registers lkcnn's models with timm)
from lkcnn.training.callbacks.kernel_timing import COLUMNS, TIMED

ROOT = Path(__file__).resolve().parents[1]
SWEEP = ([3, 3, 3, 3], [5, 3, 3, 3])
TINY = ["data=synthetic", "data.img_size=16", "data.num_classes=4", "data.num_train=8", "data.num_val=4",
        "data.batch_size=4", "data.num_workers=0", "trainer.max_epochs=1", "trainer.accelerator=cpu",
        "trainer.num_sanity_val_steps=0", "callbacks.progress_bar.refresh_rate=0", "model.small_kernel=3",
        "callbacks.kernel_timing.every_n_steps=1", "callbacks.kernel_timing.warmup_steps=0"]


def make_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=["paths.output_dir=/tmp/lkcnn-test", *overrides], return_hydra_config=True)


def test_offline_unless_a_mode_is_chosen(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = make_cfg("logger=wandb")
    assert cfg.logger.wandb.mode == "offline" and cfg.logger.wandb.save_dir == "/tmp/lkcnn-test"
    assert cfg.hydra.callbacks.finish_wandb_run._target_ == "lkcnn.training.callbacks.wandb_run.FinishWandbRun"
    assert make_cfg("logger=wandb", "logger.wandb.mode=disabled").logger.wandb.mode == "disabled"
    monkeypatch.setenv("WANDB_MODE", "online")
    assert make_cfg("logger=wandb").logger.wandb.mode == "online"
    assert set(make_cfg("logger=[csv,wandb,tensorboard]").logger) == {"csv", "wandb", "tensorboard"}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """A two-job multirun with the csv, wandb and tensorboard loggers; no W&B mode or credentials in the env."""
    out = tmp_path_factory.mktemp("wandb")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    sizes = ",".join("[" + ",".join(map(str, s)) + "]" for s in SWEEP)
    proc = subprocess.run([sys.executable, "train.py", "-m", f"model.kernel_sizes={sizes}",
                           "logger=[csv,wandb,tensorboard]", "callbacks=[default,kernel_timing]", *TINY,
                           f"hydra.sweep.dir={out}"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**env, "HYDRA_FULL_ERROR": "1", "WANDB_SILENT": "true"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def offline_runs(job: Path) -> list[Path]:
    return sorted((job / "wandb").glob("offline-run-*"))


def test_every_job_has_its_own_offline_run_in_its_folder(sweep):
    runs = [offline_runs(sweep / job) for job in ("0", "1")]
    assert [len(r) for r in runs] == [1, 1]  # a run left open would be reused by the next job's logger
    ids = [run.name.rsplit("-", 1)[1] for (run,) in runs]
    assert ids[0] != ids[1]
    for (run,), run_id in zip(runs, ids):
        data = (run / f"run-{run_id}.wandb").read_bytes()
        assert b"kernel_ms/total/fwd" in data and b"val/acc1" in data


def test_the_offline_runs_hold_the_timing_table(sweep):
    for job, sizes in zip(("0", "1"), SWEEP):
        net = timm.create_model("replknet_tiny", kernel_sizes=sizes, small_kernel=3)
        n_layers = sum(isinstance(m, TIMED) for m in net.modules())
        (run,) = offline_runs(sweep / job)
        tables = sorted((run / "files" / "media" / "table").glob("kernel_timing_*.table.json"))
        assert len(tables) == 2  # every_n_steps=1: both training steps
        for path in tables:
            table = json.loads(path.read_text())
            assert table["columns"] == list(COLUMNS) and len(table["data"]) == n_layers
            assert {row[2] for row in table["data"]} >= {f"{k}x{k}" for k in set(sizes)}
        with open(sweep / job / "kernel_timing.csv", newline="") as f:
            assert csv.DictReader(f).fieldnames == list(COLUMNS)


def test_csv_and_tensorboard_log_beside_wandb(sweep):
    for job in ("0", "1"):
        with open(sweep / job / "csv" / "metrics.csv", newline="") as f:
            assert "kernel_ms/total/bwd" in csv.DictReader(f).fieldnames
        assert list((sweep / job / "tensorboard").glob("events.out.tfevents.*"))
