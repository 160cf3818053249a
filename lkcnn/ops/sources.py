"""Where the extension's C++/CUDA sources are and which of them it compiles; torch-free, since setup.py reads it.

The sources live in `csrc/` at the top of the repository. A wheel or sdist ships them inside the package as
`lkcnn/csrc/` (setup.py copies them), so an installed lkcnn builds its kernels from its own copy; a checkout or an
editable install builds from the repository's `csrc/`.
"""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path

# compiled in this order, relative to csrc/ (one folder per op family, each with its own bindings); every other
# C++/CUDA file there is one they include. Object files are named by base name, so base names are unique.
SOURCES = ("extension.cpp",
           "dwconv/dwconv_bindings.cpp", "dwconv/dwconv_fwd.cu", "dwconv/dwconv_wgrad.cu", "dwconv/dwconv_fwd_tc.cu",
           "dwconv/dwconv_wgrad_tc.cu", "dwconv/dwconv_small.cu", "dwconv/dwconv_map_tc.cu",
           "dwconv/dwconv_fwd_strip.cu", "dwconv/dwconv_branches.cu", "dwconv/dwconv_branches_tc.cu",
           "dwconv/layout.cu",
           "sync_bn/sync_bn_bindings.cpp", "sync_bn/sync_batchnorm.cpp", "sync_bn/sync_exchange.cu",
           "gemm8/gemm8_bindings.cpp", "gemm8/gemm8_lt.cu",
           "dwconv8/dwconv8_bindings.cpp", "dwconv8/dwconv8_fwd.cu", "dwconv8/dwconv8_small.cu")
# what an included file may be called: all of them are hashed with the sources (source_digest)
HEADER_SUFFIXES = (".h", ".hh", ".hpp", ".cuh", ".inl", ".inc", ".cu", ".cpp", ".cc")
CXX_FLAGS = ("-O3",)
CUDA_FLAGS = ("-O3", "-lineinfo", "--expt-relaxed-constexpr")
LIBRARIES = ("cublasLt",)  # gemm8: cuBLASLt's FP8 GEMMs, called directly for their epilogues

_PACKAGE = Path(__file__).resolve().parents[1]


def csrc_dir() -> Path:
    """The folder holding the sources: the installed package's copy, else the checkout's `csrc/`."""
    for candidate in (_PACKAGE / "csrc", _PACKAGE.parent / "csrc"):
        if (candidate / SOURCES[0]).is_file():
            return candidate
    raise FileNotFoundError(
        f"lkcnn's CUDA sources are neither in {_PACKAGE / 'csrc'} (an installed package) nor in "
        f"{_PACKAGE.parent / 'csrc'} (a checkout): reinstall lkcnn (`pip install --force-reinstall lkcnn`)")


def source_files(directory: Path | None = None) -> list[Path]:
    """Every file the build reads: the compiled sources and the files beside them they may include."""
    directory = directory or csrc_dir()
    compiled = [directory / name for name in SOURCES]
    included = sorted(p for p in directory.rglob("*") if p.suffix in HEADER_SUFFIXES and p not in compiled)
    return compiled + included


def source_digest(torch_version: str, cuda_version: str | None, archs: str, directory: Path | None = None,
                  python: str | None = None) -> str:
    """A hash of the sources, the flags, torch, CUDA, the target architectures and the Python the module is built
    for (`python`: its cache tag, this interpreter's by default): one build per distinct input, so a module found
    under this name loads as it is (lkcnn.ops.build)."""
    digest = hashlib.sha256()
    directory = directory or csrc_dir()
    for path in sorted(source_files(directory)):
        digest.update(path.relative_to(directory).as_posix().encode() + path.read_bytes())
    digest.update(f"{torch_version}|{cuda_version}|{archs}|{CXX_FLAGS}|{CUDA_FLAGS}|{LIBRARIES}|"
                  f"{python or sys.implementation.cache_tag}".encode())
    return digest.hexdigest()[:16]
