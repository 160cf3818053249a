"""`python -m lkcnn.doctor` on a machine without a GPU: says so, shows where the sources are, exits 0."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lkcnn.ops.sources import SOURCES


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the report of a machine without a GPU")
def test_doctor_without_gpu_says_so_and_exits_0():
    proc = subprocess.run([sys.executable, "-m", "lkcnn.doctor"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    report = dict(line.split(None, 1) for line in proc.stdout.splitlines() if line and not line.startswith(" "))
    assert report["GPU"].startswith("none"), proc.stdout
    assert (Path(report["sources"]) / SOURCES[0]).is_file()
    assert "Traceback" not in proc.stderr
