"""The installed package (not a checkout) finds its CUDA sources, and they compile for sm_90 from there."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from lkcnn.ops.sources import SOURCES

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """lkcnn built as a wheel and installed (without dependencies) into a fresh folder."""
    tmp = tmp_path_factory.mktemp("install")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT),
                    "-w", str(tmp / "dist")], check=True, cwd=tmp)
    wheel, = (tmp / "dist").glob("lkcnn-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert all(f"lkcnn/csrc/{name}" in names for name in SOURCES), "the wheel lacks the CUDA sources"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp / "site"),
                    str(wheel)], check=True, cwd=tmp)
    return tmp / "site"


def test_installed_package_finds_its_own_sources(installed):
    env = {**os.environ, "PYTHONPATH": str(installed)}
    code = "import lkcnn, lkcnn.ops.sources as s; print(lkcnn.__file__); print(s.csrc_dir())"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=installed.parent, capture_output=True,
                         text=True, check=True).stdout.split()
    assert Path(out[0]).is_relative_to(installed), f"imported {out[0]}, not the installed copy"
    assert Path(out[1]) == installed / "lkcnn" / "csrc"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_installed_sources_compile_for_sm90(installed):
    spec = importlib.util.spec_from_file_location("compile_check", ROOT / "scripts" / "compile_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    objects = module.compile_all("90", verbose=False, directory=installed / "lkcnn" / "csrc")
    assert [o.name for o in objects] == [f"{Path(name).name}.o" for name in SOURCES]
    assert all(o.stat().st_size > 0 for o in objects)
