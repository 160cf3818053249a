"""`python -m lkcnn.bench loader` on the CPU: it times train.py's own training loader, sizes the loader for a
training rate and says when the data is too small."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TINY = ["data=synthetic", "data.num_classes=10", "data.img_size=16", "data.batch_size=8", "data.num_workers=0"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lkcnn.bench", "loader", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=False)


def test_times_the_training_loader_and_sizes_it_for_a_training_rate():
    train_rate = float(np.random.default_rng().integers(500, 5000))
    result = _run("--batches", "3", "--warmup", "1", "--train-rate", f"{train_rate:g}", *TINY, "data.num_train=40")
    assert result.returncode == 0, result.stderr[-2000:]
    line = re.search(r"SyntheticDataModule: ([\d.]+) images/s, ([\d.]+) ms per batch of 8 \(0 workers, 3 batches "
                     r"after 1\)", result.stdout)
    assert line, result.stdout
    images_per_s, ms_per_batch = float(line[1]), float(line[2])
    # the two figures agree on 8 images a batch, up to the rounding of the printed ms (0.05 ms)
    assert images_per_s > 0 and abs(images_per_s * ms_per_batch / 1e3 - 8) <= images_per_s * 0.05e-3 + 0.01
    cores = re.search(rf"cores needed per GPU at {train_rate:g} images/s: ([\d.]+) \(([\d.]+) images/s per loading "
                      r"core; plus one for the training process\)", result.stdout)
    assert cores, result.stdout
    needed, per_core = float(cores[1]), float(cores[2])
    # with 0 workers the main process is the one loading core; needed x per-core rate is the training rate
    assert per_core == float(line[1])
    assert abs(needed * per_core - train_rate) <= 0.005 * per_core + 0.05 * needed + 1e-6


def test_a_worker_count_is_resolved_before_it_is_printed():
    result = _run("--batches", "2", "--warmup", "1", *TINY[:-1], "data.num_workers=null", "data.num_train=40")
    assert result.returncode == 0, result.stderr[-2000:]
    workers = int(re.search(r"\((\d+) workers", result.stdout)[1])
    assert 1 <= workers <= min(8, len(os.sched_getaffinity(0)))
    per_core = float(re.search(r"\(([\d.]+) images/s per loading core", result.stdout)[1])
    images_per_s = float(re.search(r": ([\d.]+) images/s,", result.stdout)[1])
    assert abs(per_core * workers - images_per_s) <= 0.05 * workers + 0.05  # all workers fit on the cores


def test_a_training_rate_must_be_positive():
    result = _run("--train-rate", "0", *TINY)
    assert result.returncode != 0 and "--train-rate must be a positive number" in result.stderr


def test_too_few_batches_is_one_clear_error():
    result = _run("--batches", "3", "--warmup", "1", *TINY, "data.num_train=24")  # 3 batches of 8, 4 needed
    assert result.returncode != 0 and "has 3 batches, fewer than --warmup + --batches = 4" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_config_typo_is_one_line_with_the_closest_name():
    result = _run("data=digitz")
    assert result.returncode != 0 and "data=digitz is not one of the data configs" in result.stderr
    assert "did you mean digits" in result.stderr and "Traceback" not in result.stderr


def test_comparing_the_decode_paths_needs_a_gpu_and_says_so():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: test_decode_paths_compared_on_generated_jpegs runs instead")
    result = _run("--jpegs", "40")
    assert result.returncode != 0 and "needs a CUDA GPU" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_decode_paths_compared_on_generated_jpegs(tmp_path):
    record_path = tmp_path / "loader.json"
    result = _run("--jpegs", "200", "--batches", "3", "--warmup", "1", "--gpu-workers", "2",
                  "--json", str(record_path), "data.batch_size=16", "data.img_size=64")
    assert result.returncode == 0, result.stderr[-2000:]
    rows = {m[1]: (int(m[2]), float(m[3]), float(m[4]), float(m[5])) for m in re.finditer(
        r"^(decode=(?:cpu|gpu))\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", result.stdout, re.M)}
    assert set(rows) == {"decode=cpu", "decode=gpu"} and rows["decode=gpu"][0] == 2, result.stdout
    record = json.loads(record_path.read_text())
    assert record["schema"] == "lkcnn-benchmark/1" and record["kind"] == "loader"
    for row in record["rows"]:
        workers, rate, per_worker, needed = rows[row["what"]]
        assert row["images_per_s"] == rate > 0 and abs(per_worker * min(workers, len(os.sched_getaffinity(0))) - rate) < 0.1 * rate
        assert abs(needed - 1280 / per_worker) < 0.0051  # printed to two decimals: a fast worker's 0.21 is 0.2133
    (gpu_row,) = [row for row in record["rows"] if row["what"] == "decode=gpu"]
    stages = gpu_row["stage_ms"]
    assert list(stages) == ["decode", "crop+resize+flip", "RandAugment", "normalize+erase"], stages
    assert all(ms > 0 for ms in stages.values()), stages
    assert ", ".join(f"{stage} {ms:.2f}" for stage, ms in stages.items()) in result.stdout, result.stdout
