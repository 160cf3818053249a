"""What pyproject.toml cannot say: the CUDA sources ship inside the package, and an opt-in build at install time.

`csrc/` stays at the top of the repository; wheels carry a copy as `lkcnn/csrc/` (and the sdist carries `csrc/`
through MANIFEST.in), so an installed lkcnn JIT-builds its kernels from its own copy. With `LKCNN_BUILD_EXT=1`
(and `--no-build-isolation`, so the build sees the torch it will run with) the extension is compiled at install time
for `TORCH_CUDA_ARCH_LIST`, for clusters whose compute nodes have no compiler.
"""
from __future__ import annotations

import json
import os
import runpy
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
SRC = runpy.run_path(str(ROOT / "lkcnn" / "ops" / "sources.py"))  # the one list of sources (torch-free module)
PREBUILD = os.environ.get("LKCNN_BUILD_EXT", "0") == "1"


class BuildPy(build_py):
    """Copies csrc/ into the package (and records what a prebuilt extension was built from)."""

    def run(self) -> None:
        super().run()
        package = Path(self.build_lib) / "lkcnn"
        shutil.copytree(ROOT / "csrc", package / "csrc", dirs_exist_ok=True)
        if PREBUILD:
            import torch

            archs = os.environ["TORCH_CUDA_ARCH_LIST"]
            info = {"digest": SRC["source_digest"](torch.__version__, torch.version.cuda, archs, ROOT / "csrc"),
                    "archs": archs, "torch": torch.__version__}
            (package / "ops" / "_prebuilt.json").write_text(json.dumps(info) + "\n")


def _prebuilt_extension() -> dict:
    if not PREBUILD:
        return {}
    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        raise SystemExit("LKCNN_BUILD_EXT=1 needs TORCH_CUDA_ARCH_LIST, e.g. TORCH_CUDA_ARCH_LIST=9.0 for H100/H200")
    try:
        from torch.utils.cpp_extension import BuildExtension, CUDAExtension
    except ImportError:
        raise SystemExit("LKCNN_BUILD_EXT=1 builds against the installed torch: install torch first, then "
                         "`pip install --no-build-isolation .`") from None
    ext = CUDAExtension("lkcnn.ops._prebuilt", sources=[f"csrc/{s}" for s in SRC["SOURCES"]],
                        extra_compile_args={"cxx": list(SRC["CXX_FLAGS"]), "nvcc": list(SRC["CUDA_FLAGS"])},
                        libraries=list(SRC["LIBRARIES"]))
    return {"ext_modules": [ext], "cmdclass": {"build_py": BuildPy, "build_ext": BuildExtension}}


setup(**{"cmdclass": {"build_py": BuildPy}, **_prebuilt_extension()})
