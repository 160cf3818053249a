"""Compile the extension's sources to object files for sm_90 against torch's headers: a compile error fails CI
without a GPU. `python scripts/compile_check.py [ARCH] [CSRC_DIR]` (CSRC_DIR: e.g. an installed package's copy).

The CUDA sources go through nvcc (with the resource report of -Xptxas -v), the binding through the host C++
compiler, as torch.utils.cpp_extension would build them; the files compile in parallel.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from torch.utils import cpp_extension

from lkcnn.ops.sources import CUDA_FLAGS, CXX_FLAGS, SOURCES, csrc_dir


def _includes() -> list[str]:
    paths = [*cpp_extension.include_paths("cuda"), sysconfig.get_paths()["include"]]
    # pip's CUDA wheels ship the math-library headers (cusparse.h, ...) that ATen's CUDA headers include.
    paths += [str(p) for p in Path(cpp_extension.__file__).parents[2].glob("nvidia/*/include")]
    return [f"-I{p}" for p in paths]


def _command(src: Path, obj: Path, arch: str) -> list[str]:
    """The build's own flags (lkcnn.ops.sources), so the register and spill report is the built kernels'."""
    common = ["-c", str(src), "-o", str(obj), "-std=c++20", "-DTORCH_EXTENSION_NAME=lkcnn_check", *_includes()]
    if src.suffix == ".cu":
        nvcc = shutil.which("nvcc") or str(Path(cpp_extension.CUDA_HOME or "/usr/local/cuda", "bin", "nvcc"))
        return [nvcc, *common, *CUDA_FLAGS, f"-gencode=arch=compute_{arch},code=sm_{arch}", "-Xptxas", "-v",
                "-Xcompiler", "-fPIC"]
    return [shutil.which("c++") or "g++", *common, *CXX_FLAGS, "-fPIC"]


def compile_all(arch: str = "90", verbose: bool = True, directory: Path | None = None) -> list[Path]:
    """Compile every source of lkcnn.ops.sources.SOURCES in `directory` (default: where lkcnn finds them)."""
    directory = directory or csrc_dir()
    out_dir = Path(tempfile.mkdtemp(prefix="lkcnn_cc_"))
    jobs = [(directory / name, out_dir / f"{Path(name).name}.o") for name in SOURCES]
    # one compiler per core: each holds torch's headers (~1 GB), and all of them at once on a small machine ran out
    # of memory, for no gain in time where they share its cores
    with ThreadPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 1)) as pool:
        results = list(pool.map(lambda job: subprocess.run(_command(*job, arch), capture_output=True, text=True), jobs))
    for (src, _), proc in zip(jobs, results):
        if verbose:
            print(f"== {src.name}: rc={proc.returncode}")
            print("\n".join(line for line in proc.stderr.splitlines() if "registers" in line or "spill" in line
                            or "error" in line))
        if proc.returncode != 0:
            raise RuntimeError(f"compiling {src.name} failed:\n{proc.stderr[-4000:]}")
    return [obj for _, obj in jobs]


if __name__ == "__main__":
    compile_all(sys.argv[1] if len(sys.argv) > 1 else "90",
                directory=Path(sys.argv[2]) if len(sys.argv) > 2 else None)
