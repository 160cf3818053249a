"""`python -m lkcnn.doctor` on a machine without a GPU: says so, shows where the sources are, exits 0."""
from __future__ import annotations

import os
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the report of a machine without a GPU")
@pytest.mark.parametrize("value,problem", [("cdua", "LKCNN_CONV_IMPL=cdua is not one of auto, cuda, torch"),
                                           ("cuda", "LKCNN_CONV_IMPL=cuda forces lkcnn's CUDA kernels")])
def test_doctor_names_a_conv_impl_setting_that_cannot_work_here(value, problem):
    proc = subprocess.run([sys.executable, "-m", "lkcnn.doctor"], capture_output=True, text=True,
                          env={**os.environ, "LKCNN_CONV_IMPL": value})
    assert proc.returncode == 1 and f"- {problem}" in proc.stdout, proc.stdout
    assert "No problems found" not in proc.stdout and "Traceback" not in proc.stderr
