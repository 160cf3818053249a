"""JIT build of the CUDA kernels in csrc/ with torch.utils.cpp_extension, cached per source hash and GPU arch.

The build directory is keyed by a hash of the sources, the torch/CUDA versions and the target architectures (as in
StyleGAN3's custom_ops), so a stale build is never loaded and two versions never fight over one directory.
`python -m lkcnn.ops.build` builds ahead of time and prints where the build lives.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

CSRC = Path(__file__).resolve().parents[2] / "csrc"
SOURCES = ("bindings.cpp", "sync_batchnorm.cpp", "sync_exchange.cu", "dwconv_fwd.cu", "dwconv_wgrad.cu", "dwconv_fwd_tc.cu",
           "dwconv_wgrad_tc.cu", "dwconv_small.cu", "dwconv_map_tc.cu", "dwconv_fwd_strip.cu",
           "layout.cu")
CUDA_FLAGS = ("-O3", "-lineinfo", "--expt-relaxed-constexpr")
# A build lock older than this belongs to a build that was killed (a cold build takes well under a minute).
LOCK_STALE_S = float(os.environ.get("LKCNN_BUILD_LOCK_TIMEOUT", "600"))


class BuildError(RuntimeError):
    """The extension cannot be built or loaded here; the message says why and what to do."""


_module: ModuleType | None = None
_failure: str | None = None


def arch_list() -> str:
    """TORCH_CUDA_ARCH_LIST if set, else the compute capabilities of the visible GPUs (e.g. '9.0')."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"]
    caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    return ";".join(f"{major}.{minor}" for major, minor in sorted(caps))


def build_directory(archs: str) -> Path:
    """Where the build for these sources, this torch and these architectures lives (TORCH_EXTENSIONS_DIR honoured)."""
    from torch.utils.cpp_extension import _get_build_directory

    digest = hashlib.sha256()
    for name in sorted(p.name for p in CSRC.iterdir() if p.suffix in {".cpp", ".cu", ".h", ".cuh"}):
        digest.update(name.encode() + (CSRC / name).read_bytes())
    digest.update(f"{torch.__version__}|{torch.version.cuda}|{archs}|{CUDA_FLAGS}".encode())
    name = f"lkcnn_dwconv_{digest.hexdigest()[:16]}"
    return Path(_get_build_directory(name, verbose=False))


def _check_lock(directory: Path) -> None:
    """Wait for a concurrent build to finish; report a lock left by a killed build instead of waiting forever."""
    lock = directory / "lock"
    while lock.exists():
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > LOCK_STALE_S:
            raise BuildError(
                f"stale build lock {lock} ({age:.0f} s old): a build of the lkcnn CUDA extension was killed. "
                f"Delete that file (or the directory {directory}) and run `python -m lkcnn.ops.build` again.")
        time.sleep(1.0)


@contextlib.contextmanager
def _env(**values: str):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def load(verbose: bool = False) -> ModuleType:
    """The compiled extension, building it on first use; raises BuildError (once, then cached) when it cannot."""
    global _module, _failure
    if _module is not None:
        return _module
    if _failure is not None:
        raise BuildError(_failure)
    try:
        _module = _build(verbose)
        return _module
    except BuildError as err:
        _failure = str(err)
        raise
    except Exception as err:  # compiler errors arrive as RuntimeError/OSError/subprocess errors
        _failure = f"building the lkcnn CUDA extension failed: {err}".strip()
        raise BuildError(_failure) from err


def _build(verbose: bool) -> ModuleType:
    if not torch.cuda.is_available():
        raise BuildError("no CUDA device is visible")
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None or not (shutil.which("nvcc") or Path(cpp_extension.CUDA_HOME, "bin", "nvcc").exists()):
        raise BuildError("nvcc was not found: install the CUDA toolkit or set CUDA_HOME")
    archs = arch_list()
    directory = build_directory(archs)
    directory.mkdir(parents=True, exist_ok=True)
    _check_lock(directory)
    with _env(TORCH_CUDA_ARCH_LIST=archs, MAX_JOBS=os.environ.get("MAX_JOBS", str(os.cpu_count() or 4))):
        return cpp_extension.load(
            name=directory.name, sources=[str(CSRC / s) for s in SOURCES], build_directory=str(directory),
            extra_cflags=["-O3"], extra_cuda_cflags=list(CUDA_FLAGS), verbose=verbose)


def main() -> None:
    start = time.perf_counter()
    try:
        module = load(verbose="-v" in sys.argv)
    except BuildError as err:
        sys.exit(f"lkcnn: {err}")
    print(f"lkcnn CUDA extension ready in {time.perf_counter() - start:.1f} s (archs {arch_list()}): {module.__file__}")


if __name__ == "__main__":
    main()
