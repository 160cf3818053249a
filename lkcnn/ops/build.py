"""The compiled extension: a prebuilt one from `LKCNN_BUILD_EXT=1 pip install`, else a JIT build of the sources.

The JIT build directory is keyed by a hash of the sources, the torch/CUDA versions, the target architectures and the
Python version (as in StyleGAN3's custom_ops), so a stale build is never loaded, two versions never fight over one
directory, and a finished build found there loads as it is. A prebuilt extension is used only when the same hash
says it was built from these sources for this torch and covers the GPU's architecture. `python -m lkcnn.ops.build`
builds ahead of time and prints where the build lives; `python -m lkcnn.doctor` tells what is missing when it
cannot.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from types import ModuleType

import torch

from .sources import CUDA_FLAGS, CXX_FLAGS, LIBRARIES, SOURCES, csrc_dir, source_digest

PREBUILT_MODULE = "lkcnn.ops._prebuilt"
# written by setup.py beside the prebuilt extension: {"digest": ..., "archs": ..., "torch": ...}
PREBUILT_INFO = Path(__file__).with_name("_prebuilt.json")
# A build lock older than this belongs to a build that was killed (a cold build takes one to two minutes).
LOCK_STALE_S = float(os.environ.get("LKCNN_BUILD_LOCK_TIMEOUT", "600"))
# Written into the build directory once its module has loaded (is_built).
BUILT_STAMP = "lkcnn_built.json"


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
    """Where the JIT build for these sources, this torch and these archs lives (TORCH_EXTENSIONS_DIR honoured)."""
    from torch.utils.cpp_extension import _get_build_directory

    name = f"lkcnn_dwconv_{source_digest(torch.__version__, torch.version.cuda, archs)}"
    return Path(_get_build_directory(name, verbose=False))


def prebuilt_status() -> tuple[bool, str]:
    """(usable, why): whether the extension compiled at install time fits these sources, this torch and the GPUs."""
    if not PREBUILT_INFO.is_file():
        return False, "not installed (LKCNN_BUILD_EXT=1 pip install --no-build-isolation . builds one)"
    info = json.loads(PREBUILT_INFO.read_text())
    if info.get("digest") != source_digest(torch.__version__, torch.version.cuda, info.get("archs", "")):
        return False, (f"built for torch {info.get('torch')} or other sources, this is torch {torch.__version__}: "
                       "reinstall with LKCNN_BUILD_EXT=1 to refresh it")
    built = {a.replace("+PTX", "").strip() for a in info.get("archs", "").replace(" ", ";").split(";") if a.strip()}
    missing = sorted(set(arch_list().split(";")) - built) if torch.cuda.is_available() else []
    if missing:
        return False, f"built for compute capability {', '.join(sorted(built))}, not this GPU's {', '.join(missing)}"
    return True, f"{info.get('archs')} for torch {info.get('torch')}"


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
        _module = _load(verbose)
        return _module
    except BuildError as err:
        _failure = str(err)
        raise
    except Exception as err:  # compiler errors arrive as RuntimeError/OSError/subprocess errors
        _failure = f"building the lkcnn CUDA extension failed: {err}".strip()
        raise BuildError(_failure) from err


def _load(verbose: bool) -> ModuleType:
    if not torch.cuda.is_available():
        raise BuildError("no CUDA device is visible")
    usable, why = prebuilt_status()
    if usable:
        try:
            return importlib.import_module(PREBUILT_MODULE)
        except ImportError as err:
            why = f"it does not import ({err})"
    if PREBUILT_INFO.is_file():
        warnings.warn(f"lkcnn's prebuilt CUDA extension is not used: {why}; building from the sources", stacklevel=3)
    return _jit_build(verbose)


def _module_path(directory: Path) -> Path:
    from torch.utils.cpp_extension import LIB_EXT

    return directory / f"{directory.name}{LIB_EXT}"


def _write_stamp(directory: Path) -> None:
    """Mark the build in `directory` finished: its module's file name and size, written once it has loaded."""
    path = _module_path(directory)
    (directory / BUILT_STAMP).write_text(json.dumps({"module": path.name, "bytes": path.stat().st_size}) + "\n")


def is_built(directory: Path) -> bool:
    """Whether a build in `directory` finished: its stamp names the module file there, at the size it has."""
    path = _module_path(directory)
    try:
        stamp = json.loads((directory / BUILT_STAMP).read_text())
        return stamp == {"module": path.name, "bytes": path.stat().st_size}
    except (OSError, ValueError):
        return False


def _load_built(directory: Path) -> ModuleType | None:
    """The module a finished build left in `directory` (is_built), or None. The directory's name is a hash of
    everything the build reads (build_directory), so that module was built from these sources for this torch, this
    Python and these GPUs, and it loads without ninja, which judges by file times: a build directory restored or
    copied beside a fresh checkout (a container image, a CI cache) was built again, 79 s on an H200 machine,
    although nothing had changed."""
    if not is_built(directory):
        return None
    path = _module_path(directory)
    spec = importlib.util.spec_from_file_location(directory.name, path)
    try:
        module = importlib.util.module_from_spec(spec)  # (an extension module loads here)
        spec.loader.exec_module(module)
    except ImportError as err:
        # a library that loaded and failed stays loaded: a rebuild could not replace it in this process
        raise BuildError(f"the built extension {path} does not load ({err}): delete {directory} and run again, "
                         "which builds it anew") from err
    return module


def _jit_build(verbose: bool) -> ModuleType:
    from torch.utils import cpp_extension

    try:
        csrc = csrc_dir()
    except FileNotFoundError as err:
        raise BuildError(str(err)) from err
    archs = arch_list()
    directory = build_directory(archs)
    directory.mkdir(parents=True, exist_ok=True)
    _check_lock(directory)
    built = _load_built(directory)
    if built is not None:
        return built
    nvcc = cpp_extension.CUDA_HOME and (shutil.which("nvcc") or Path(cpp_extension.CUDA_HOME, "bin", "nvcc").exists())
    if not nvcc:
        raise BuildError("nvcc was not found: install the CUDA toolkit or set CUDA_HOME")
    with _env(TORCH_CUDA_ARCH_LIST=archs, MAX_JOBS=os.environ.get("MAX_JOBS", str(os.cpu_count() or 4))):
        module = cpp_extension.load(
            name=directory.name, sources=[str(csrc / s) for s in SOURCES], build_directory=str(directory),
            extra_cflags=list(CXX_FLAGS), extra_cuda_cflags=list(CUDA_FLAGS),
            extra_ldflags=[f"-l{lib}" for lib in LIBRARIES], verbose=verbose)
    _write_stamp(directory)
    return module


def main() -> None:
    start = time.perf_counter()
    try:
        module = load(verbose="-v" in sys.argv)
    except BuildError as err:
        sys.exit(f"lkcnn: {err}")
    print(f"lkcnn CUDA extension ready in {time.perf_counter() - start:.1f} s (archs {arch_list()}): {module.__file__}")


if __name__ == "__main__":
    main()
