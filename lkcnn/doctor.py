"""`python -m lkcnn.doctor [--build]` (or `lkcnn-doctor`): can this machine run lkcnn's CUDA kernels, and if not, why.

Prints the versions that matter for the JIT build (torch, CUDA runtime and driver, nvcc, the host compiler), the
GPUs, where the sources and the build cache are, whether the extension is built, a self-test of the built kernels
against PyTorch in float64, and which implementation each kernel size and dtype runs. Every problem is one line that
says what to do. Exit status: 0 when nothing is wrong (a machine without a GPU included: it runs PyTorch's
convolution, which is fine), 1 otherwise.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time

import torch

from lkcnn.ops import build, dwconv
from lkcnn.ops.sources import csrc_dir

KERNEL_SIZES = (3, 5, 7, 13, 27, 31, 51)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# Relative-norm tolerances of the self-test (the GPU test suite's, which every kernel is held to).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _run(*cmd: str) -> str | None:
    """The command's output, or None when it is missing or fails."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def _nvcc() -> tuple[str | None, str | None]:
    """(path, release) of the nvcc torch's JIT build would use."""
    from torch.utils import cpp_extension

    path = shutil.which("nvcc")
    if path is None and cpp_extension.CUDA_HOME and os.path.exists(os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")):
        path = os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")
    out = _run(path, "--version") if path else None
    match = re.search(r"release (\d+\.\d+)", out or "")
    return path, match.group(1) if match else None


def _self_test() -> list[str]:
    """Forward and both gradients of lkcnn's kernels against float64 PyTorch on fresh inputs; the failures."""
    from lkcnn.ops import reference

    failures = []
    for k in (7, 31):
        for name, dtype in DTYPES.items():
            x = torch.randn(2, 32, 24, 24, device="cuda", dtype=torch.float64)
            w = torch.randn(32, 1, k, k, device="cuda", dtype=torch.float64) / k
            dy = torch.randn_like(x)
            pad = [k // 2, k // 2]
            xs, ws = x.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
            y = dwconv.dwconv2d(xs, ws, None, pad)
            y.backward(dy.to(dtype))
            xr, wr = xs.detach().double(), ws.detach().double()  # the reference sees the rounded inputs
            expected = (reference.forward(xr, wr, None, pad), reference.grad_input(dy, wr, pad),
                        reference.grad_weight(dy, xr, [k, k], pad))
            for what, got, ref in zip(("forward", "input gradient", "weight gradient"), (y, xs.grad, ws.grad), expected):
                err = ((got.double() - ref).norm() / ref.norm()).item()
                if not err <= TOLERANCE[dtype]:  # NaN fails too
                    failures.append(f"{k}x{k} {name} {what}: relative error {err:.1e} > {TOLERANCE[dtype]:.0e}")
    return failures


def _dispatch_table(module) -> list[str]:
    """Which implementation (and which of lkcnn's kernels) runs each kernel size and dtype on a 56 x 56 map."""
    rows = [f"    {'kernel':>8}  " + "  ".join(f"{name:<18}" for name in DTYPES)]
    for k in KERNEL_SIZES:
        cells = []
        for dtype in DTYPES.values():
            x = torch.empty(64, 128, 56, 56, device="cuda", dtype=dtype)
            impl = dwconv.implementation(x, [k, k], [k // 2, k // 2])
            cells.append(f"lkcnn ({module.path(x, k, k)})" if impl == "cuda" else "PyTorch")
        rows.append(f"    {f'{k}x{k}':>8}  " + "  ".join(f"{c:<18}" for c in cells))
    return rows


def diagnose(do_build: bool) -> tuple[list[str], list[str]]:
    """(report lines, problems): each problem is one line that says what to do."""
    import lkcnn

    lines, problems = [], []
    lines.append(f"lkcnn       {lkcnn.__version__} at {os.path.dirname(lkcnn.__file__)}")
    lines.append(f"torch       {torch.__version__} (CUDA runtime {torch.version.cuda or 'none: a CPU build'})")
    try:
        sources = csrc_dir()
        lines.append(f"sources     {sources}")
    except FileNotFoundError as err:
        problems.append(str(err))
    chosen = dwconv.conv_impl_from_env()
    lines.append(f"impl        LKCNN_CONV_IMPL={chosen or 'auto'} (the default policy)")
    if chosen is not None and chosen not in dwconv.IMPLS:
        problems.append(f"LKCNN_CONV_IMPL={chosen} is not one of {', '.join(dwconv.IMPLS)}: unset it (auto) or set "
                        "one of those")
    if not torch.cuda.is_available():
        reason = "torch is a CPU build" if torch.version.cuda is None else "no CUDA device is visible"
        lines.append(f"GPU         none ({reason}): lkcnn runs PyTorch's convolution; its CUDA kernels need an NVIDIA GPU")
        if chosen == "cuda":
            problems.append("LKCNN_CONV_IMPL=cuda forces lkcnn's CUDA kernels, which need a GPU: every large-kernel "
                            "convolution on this machine fails; unset it (auto) here")
        return lines, problems

    smi = _run("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")
    lines.append(f"driver      {smi.splitlines()[0].strip() if smi else 'unknown (nvidia-smi not found)'}")
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        lines.append(f"GPU {i}       {torch.cuda.get_device_name(i)} (compute capability {major}.{minor})")
    nvcc, release = _nvcc()
    lines.append(f"nvcc        {nvcc or 'not found'}" + (f" (CUDA {release})" if release else ""))
    cxx = _run(os.environ.get("CXX", "c++"), "--version")
    lines.append(f"compiler    {cxx.splitlines()[0] if cxx else 'not found'}")
    usable, why = build.prebuilt_status()
    lines.append(f"prebuilt    {'yes, ' if usable else 'no: '}{why}")
    directory = build.build_directory(build.arch_list())
    built = build.is_built(directory)  # a finished build loads without the toolchain
    if not usable:
        lines.append(f"build cache {directory} ({'built' if built else 'not built yet'})")
    if not usable and not built:
        if nvcc is None:
            problems.append("nvcc was not found: install the CUDA toolkit (matching torch's CUDA "
                            f"{torch.version.cuda}) or set CUDA_HOME, or install lkcnn with LKCNN_BUILD_EXT=1 "
                            "where a compiler is")
        elif release and torch.version.cuda and release.split(".")[0] != torch.version.cuda.split(".")[0]:
            problems.append(f"nvcc is CUDA {release} but torch was built with CUDA {torch.version.cuda}: install "
                            f"a CUDA {torch.version.cuda.split('.')[0]}.x toolkit or point CUDA_HOME at one")
        if cxx is None:
            problems.append("no C++ compiler (c++) was found: install one (e.g. apt-get install g++) or set CXX")
        if not do_build:
            problems.append("the extension is not built yet: run `python -m lkcnn.doctor --build` (or let the first "
                            "call build it, one to two minutes)")
            return lines, problems
    start = time.perf_counter()
    try:
        module = build.load()
    except build.BuildError as err:
        problems.append(f"the extension does not build: {err}. Rebuild verbosely with `python -m lkcnn.ops.build -v`")
        return lines, problems
    lines.append(f"extension   {module.__file__} (loaded in {time.perf_counter() - start:.1f} s)")
    with dwconv.use_conv_impl("cuda"):  # test lkcnn's kernels whatever the user's default is
        failures = _self_test()
    lines.append(f"self-test   {'passed' if not failures else 'FAILED'} (7x7 and 31x31, fp32/fp16/bf16, forward and "
                 "both gradients against float64 PyTorch)")
    problems += [f"self-test failed: {f}: report this with the output of `python -m lkcnn.doctor`" for f in failures]
    lines.append("dispatch    (64, 128, 56, 56) inputs, 'same' padding:")
    lines += _dispatch_table(module)
    return lines, problems


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lkcnn-doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", action="store_true", help="build the extension if it is not built yet")
    args = parser.parse_args(argv)
    lines, problems = diagnose(args.build)
    print("\n".join(lines))
    if problems:
        print("\n".join(["", "Problems:"] + [f"- {p}" for p in problems]))
        sys.exit(1)
    print("\nNo problems found.")


if __name__ == "__main__":
    main()
