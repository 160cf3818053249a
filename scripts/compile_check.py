"""Compile csrc/ to object files for sm_90 with nvcc against torch's headers: a compile error fails CI without a GPU.

Uses torch.utils.cpp_extension's include paths and flags so the check compiles exactly what the JIT build compiles.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from torch.utils import cpp_extension

CSRC = Path(__file__).resolve().parents[1] / "csrc"


def compile_all(arch: str = "90", verbose: bool = True) -> list[Path]:
    nvcc = shutil.which("nvcc") or str(Path(cpp_extension.CUDA_HOME or "/usr/local/cuda") / "bin" / "nvcc")
    includes = [f"-I{p}" for p in cpp_extension.include_paths("cuda")] + [f"-I{sysconfig.get_paths()['include']}"]
    # pip's CUDA wheels ship the math-library headers (cusparse.h, ...) that ATen's CUDA headers include.
    includes += [f"-I{p}" for p in Path(cpp_extension.__file__).parents[2].glob("nvidia/*/include")]
    out_dir = Path(tempfile.mkdtemp(prefix="lkcnn_cc_"))
    objects = []
    for src in sorted(CSRC.glob("*.cu")) + sorted(CSRC.glob("*.cpp")):
        obj = out_dir / (src.name + ".o")
        cmd = [nvcc, "-c", str(src), "-o", str(obj), "-std=c++20", "-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}",
               "-Xptxas", "-v", "-DTORCH_EXTENSION_NAME=lkcnn_check", "-D_GLIBCXX_USE_CXX11_ABI=1",
               "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC", *includes]
        if src.suffix == ".cpp":
            cmd += ["-x", "cu"]  # nvcc drives the host compiler for the binding too
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if verbose:
            print(f"== {src.name}: rc={proc.returncode}")
            print("\n".join(line for line in proc.stderr.splitlines() if "ptxas" in line or "error" in line))
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed on {src.name}:\n{proc.stderr[-4000:]}")
        objects.append(obj)
    return objects


if __name__ == "__main__":
    compile_all(sys.argv[1] if len(sys.argv) > 1 else "90")
