"""A run killed with SIGKILL mid-epoch and resumed from its last checkpoint ends with exactly the weights of an
uninterrupted run of the same seed (CPU, deterministic algorithms), with every random stream in play: shuffling,
augmentation in two DataLoader workers, mixup/cutmix, drop path, EMA."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
STEPS_PER_EPOCH = 4
OVERRIDES = ["cpu_threads=1", "trainer.max_epochs=2", f"trainer.limit_train_batches={STEPS_PER_EPOCH}",
             "trainer.limit_val_batches=1", "trainer.deterministic=true", "data.num_workers=2", "data.batch_size=16",
             "data.mixup={mixup_alpha:0.8,cutmix_alpha:1.0}", "data.label_smoothing=0.1",
             "model.drop_path_rate=0.2", "callbacks.progress_bar.refresh_rate=0"]


class SigkillAtStep(L.Callback):
    """Kills its own process, with no chance to clean up, after optimizer step `step`."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def start(run_dir: Path, *extra: str) -> subprocess.Popen:
    """train.py in a subprocess, single-threaded (cpu_threads=1: the same thread count in every run keeps CPU math
    bitwise equal, and two runs can share the two cores); its output goes to <run_dir>.log."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    with open(run_dir.with_suffix(".log"), "w") as log:
        return subprocess.Popen([sys.executable, "train.py", f"hydra.run.dir={run_dir}", *OVERRIDES, *extra],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def finish(process: subprocess.Popen, run_dir: Path) -> tuple[int, str]:
    """Exit code and the end of the output."""
    process.wait(timeout=600)
    return process.returncode, run_dir.with_suffix(".log").read_text()[-3000:]


def final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_matches_an_uninterrupted_run(tmp_path):
    seed = f"seed={torch.randint(1 << 20, ()).item()}"
    kill_step = STEPS_PER_EPOCH + STEPS_PER_EPOCH // 2  # half way through the second (last) epoch
    whole = start(tmp_path / "whole", seed)
    killed = start(tmp_path / "killed", seed, "+callbacks.kill._target_=test_train_resume.SigkillAtStep",
                   f"+callbacks.kill.step={kill_step}")
    code, output = finish(killed, tmp_path / "killed")
    assert code == -signal.SIGKILL, output
    partial = torch.load(tmp_path / "killed" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert partial["epoch"] == 0 and partial["global_step"] == STEPS_PER_EPOCH

    resumed = start(tmp_path / "resumed", seed, f"ckpt_path={tmp_path / 'killed' / 'checkpoints' / 'last.ckpt'}")
    for process, name in ((whole, "whole"), (resumed, "resumed")):
        code, output = finish(process, tmp_path / name)
        assert code == 0, output

    expected, actual = final_state(tmp_path / "whole"), final_state(tmp_path / "resumed")
    assert expected.keys() == actual.keys() and any(k.startswith("model_ema.module.") for k in expected)
    assert any(not torch.equal(expected[k], partial["state_dict"][k]) for k in expected)  # it did train on
    different = [k for k in expected if not torch.equal(expected[k], actual[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:5]}"
