"""`python -m lkcnn.bench app` on the CPU: it profiles the steady-state steps of the real app and prints the table."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_profiles_the_requested_steps_of_a_tiny_run():
    overrides = ["model=replknet_tiny", "data=synthetic", "data.num_classes=10", "data.img_size=32", "data.num_train=64",
                 "data.batch_size=8", "data.num_workers=0", "trainer.max_steps=5", "trainer.limit_val_batches=0",
                 "cpu_threads=1"]
    result = subprocess.run([sys.executable, "-m", "lkcnn.bench", "app", "--warmup", "2", "--batches", "2",
                             "--top", "5", *overrides], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(r"[\d.]+ ms per step under cProfile, 2 steps after 2", result.stdout)
    assert "Ordered by: internal time" in result.stdout and "ncalls" in result.stdout
    short = subprocess.run([sys.executable, "-m", "lkcnn.bench", "app", "--warmup", "4", "--batches", "4",
                            *overrides], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert short.returncode != 0 and "trainer.max_steps=5 ends the run before the profile's last step" in short.stderr
    assert "Traceback" not in short.stderr
    typo = subprocess.run([sys.executable, "-m", "lkcnn.bench", "app", "trainer.max_step=3"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    assert typo.returncode != 0 and "did you mean trainer.max_steps" in typo.stderr and "Traceback" not in typo.stderr


def test_gpu_timeline_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this checks the message on a machine without a GPU")
    result = subprocess.run([sys.executable, "-m", "lkcnn.bench", "app", "--gpu"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode != 0 and "--gpu needs a CUDA GPU" in result.stderr
