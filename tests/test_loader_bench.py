"""scripts/loader_bench.py on the CPU: it times train.py's own training loader and says when the data is too small."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ["data=synthetic", "data.num_classes=10", "data.img_size=16", "data.batch_size=8", "data.num_workers=0"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/loader_bench.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=False)


def test_times_the_training_loader():
    result = _run("--batches", "3", "--warmup", "1", *TINY, "data.num_train=40")
    assert result.returncode == 0, result.stderr[-2000:]
    line = re.search(r"SyntheticDataModule: ([\d.]+) images/s, ([\d.]+) ms per batch of 8 \(0 workers, 3 batches "
                     r"after 1\)", result.stdout)
    assert line, result.stdout
    images_per_s, ms_per_batch = float(line[1]), float(line[2])
    # the two figures agree on 8 images a batch, up to the rounding of the printed ms (0.05 ms)
    assert images_per_s > 0 and abs(images_per_s * ms_per_batch / 1e3 - 8) <= images_per_s * 0.05e-3 + 0.01


def test_too_few_batches_is_one_clear_error():
    result = _run("--batches", "3", "--warmup", "1", *TINY, "data.num_train=24")  # 3 batches of 8, 4 needed
    assert result.returncode != 0 and "has 3 batches, fewer than --warmup + --batches = 4" in result.stderr
    assert "Traceback" not in result.stderr
