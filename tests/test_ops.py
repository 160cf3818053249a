"""CPU tests of the dwconv2d op: results equal PyTorch's, registration (opcheck, compile, autocast, flop count),
implementation choice and fallback, argument errors, and the build's lock handling."""
from __future__ import annotations

import importlib
import importlib.machinery
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lkcnn.ops import build, conv_impl, dwconv, dwconv2d, reference, set_conv_impl, sources, use_conv_impl


def _rand_case(kh, kw, bias=True):
    # at least 2 channels: PyTorch's own CPU weight gradient (the reference here) segfaults for 1 channel with tall
    # kernels; test_single_channel_tall_kernel covers that case against a brute-force sum
    c = torch.randint(2, 6, ()).item()
    # float64: lkcnn's CPU weight gradient sums in another order than PyTorch's (see reference.grad_weight)
    f64 = dict(dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, c, torch.randint(3, 20, ()).item(), torch.randint(3, 20, ()).item(), **f64)
    w = torch.randn(c, 1, kh, kw, **f64)
    b = torch.randn(c, **f64) if bias else None
    return x, w, b


@pytest.mark.parametrize("kernel", [(1, 1), (3, 3), (7, 7), (31, 31), (51, 5), (5, 51)])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_pytorch_forward_and_backward(kernel, bias):
    x, w, b = _rand_case(*kernel, bias)
    y = dwconv2d(x, w, b)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, [t for t in (x, w, b) if t is not None], dy)
    pad = (kernel[0] // 2, kernel[1] // 2)
    ref = F.conv2d(x, w, b, 1, pad, 1, x.shape[1])
    ref_grads = torch.autograd.grad(ref, [t for t in (x, w, b) if t is not None], dy)
    torch.testing.assert_close(y, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


def test_explicit_padding_and_channels_last():
    x, w, b = _rand_case(5, 3)
    y = dwconv2d(x.contiguous(memory_format=torch.channels_last), w, b, padding=(1, 0))
    torch.testing.assert_close(y, F.conv2d(x, w, b, 1, (1, 0), 1, x.shape[1]))
    if x.shape[1] > 1:
        assert y.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("layout", [torch.channels_last, torch.contiguous_format], ids=["nhwc", "nchw"])
def test_pytorch_input_gradient_runs_in_the_gradients_layout(layout):
    """The PyTorch path's input gradient is autograd's, computed in the incoming gradient's layout: a channels_last
    gradient must not detour through NCHW kernels (on a GPU, cuDNN's NCHW depthwise kernels and two copies)."""
    x = torch.randn(2, 8, 13, 11, dtype=torch.float64).contiguous(memory_format=layout).requires_grad_()
    w = torch.randn(8, 1, 7, 7, dtype=torch.float64)
    y = F.conv2d(x, w, None, 1, [6, 6], 2, 8)
    g = torch.randn_like(y)
    dx = reference.grad_input(g, w, [6, 6], 2)
    assert dx.is_contiguous(memory_format=layout)
    torch.testing.assert_close(dx, torch.autograd.grad(y, x, g)[0], rtol=0, atol=1e-12)


def test_weight_gradient_keeps_the_weights_layout():
    """A channels_last weight gets a channels_last gradient (the layout contract DDP's gradient buckets rely on)."""
    x, w, b = _rand_case(7, 5)
    w_cl = w.detach().to(memory_format=torch.channels_last).requires_grad_()  # as Module.to(memory_format=...)
    assert w_cl.stride() != w.stride()  # (C, 1, kh, kw): the strides differ in the size-1 dim
    dwconv2d(x, w_cl, b).sum().backward()
    dwconv2d(x, w, b).sum().backward()
    w_t = w.detach().transpose(2, 3).contiguous().transpose(2, 3).requires_grad_()  # column-major taps: a copy
    dwconv2d(x, w_t, b).sum().backward()
    assert w_cl.grad.stride() == w_cl.stride() and w.grad.stride() == w.stride() and w_t.grad.stride() == w_t.stride()
    torch.testing.assert_close(w_cl.grad, w.grad)
    torch.testing.assert_close(w_t.grad, w.grad)


def test_opcheck_cpu():
    x, w, b = (t.detach() for t in _rand_case(7, 5))
    torch.library.opcheck(torch.ops.lkcnn.dwconv2d_fwd, (x, w, b, [3, 2]))
    torch.library.opcheck(torch.ops.lkcnn.dwconv2d_bwd_input, (torch.randn_like(x), w, [3, 2]))
    torch.library.opcheck(torch.ops.lkcnn.dwconv2d_bwd_weight, (torch.randn_like(x), x, [7, 5], [3, 2]))
    torch.library.opcheck(torch.ops.lkcnn.dwconv2d_bwd, (torch.randn_like(x), x, w, [3, 2]))
    torch.library.opcheck(torch.ops.lkcnn.dwconv2d_fwd_keep_flat, (x, w, b, [3, 2]))
    # the backward ops also take the forward's kept copy, flat
    torch.library.opcheck(torch.ops.lkcnn.dwconv2d_bwd_weight, (torch.randn_like(x), x.flatten(2), [7, 5], [3, 2]))
    torch.library.opcheck(torch.ops.lkcnn.dwconv2d_bwd, (torch.randn_like(x), x.flatten(2), w, [3, 2]))


def test_compiled_training_saves_the_kept_copy_flat():
    """Inductor's layout optimization gives every 4-D activation a compiled forward saves downstream of a convolution
    channels_last strides (the CPU's inductor decides layouts as the GPU's does): the forward's NCHW copy of x is
    saved as (N, C, H*W), so nothing transposes it to channels_last after the forward and back before the backward."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 12, 12).contiguous(memory_format=torch.channels_last)
    w1 = torch.randn(8, 8, 1, 1, requires_grad=True)
    wd = torch.randn(8, 1, 7, 7, requires_grad=True)

    def step(x, w1, wd):
        y = torch.relu(F.conv2d(x, w1))
        z = torch.ops.lkcnn.dwconv2d_fwd_keep_flat(y, wd, None, [3, 3])[0]
        return torch.relu(F.conv2d(z, w1)).square().sum()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = torch.compile(step)(x, w1, wd)
    compiled_grads = torch.autograd.grad(loss, (w1, wd))
    eager_grads = torch.autograd.grad(step(x, w1, wd), (w1, wd))
    for got, want in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    kept = [t for t in saved if t.shape == (2, 8, 144)]
    assert len(kept) == 1 and kept[0].is_contiguous()


def test_compile_fullgraph_has_no_graph_break():
    conv = torch.nn.Conv2d(4, 4, 9, padding=4, groups=4)
    x = torch.randn(2, 4, 12, 12, requires_grad=True)
    fn = torch.compile(lambda t: dwconv2d(t, conv.weight, conv.bias).sum(), fullgraph=True, backend="aot_eager")
    loss = fn(x)
    (grad,) = torch.autograd.grad(loss, x)
    ref = F.conv2d(x, conv.weight, conv.bias, 1, 4, 1, 4).sum()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad, torch.autograd.grad(ref, x)[0])


def test_autocast_casts_inputs():
    x, w, b = _rand_case(5, 5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = dwconv2d(x, w, b)
    assert y.dtype == torch.bfloat16
    ref = F.conv2d(x.double(), w.double(), b.double(), 1, 2, 1, x.shape[1])
    assert ((y.double() - ref).norm() / ref.norm()).item() < 2e-2


def test_flop_counter_sees_the_op():
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randn(2, 3, 10, 10, requires_grad=True)
    w = torch.randn(3, 1, 7, 7, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        dwconv2d(x, w).sum().backward()
    assert counter.get_total_flops() == 3 * 2 * (2 * 3 * 10 * 10 * 49)


@pytest.mark.parametrize("kwargs,match", [
    (dict(x=torch.randn(3, 8, 8), weight=torch.randn(3, 1, 3, 3)), r"\(N, C, H, W\)"),
    (dict(x=torch.randn(1, 3, 8, 8), weight=torch.randn(3, 3, 3, 3)), r"depthwise weight of shape \(3, 1, kh, kw\)"),
    (dict(x=torch.randn(1, 3, 8, 8), weight=torch.randn(3, 1, 3, 3), bias=torch.randn(4)), r"bias of shape \(3,\)"),
    (dict(x=torch.randn(1, 3, 8, 8), weight=torch.randn(3, 1, 3, 3, dtype=torch.float64)), "one dtype"),
    (dict(x=torch.randn(1, 3, 8, 8), weight=torch.randn(3, 1, 3, 3), padding=(-1, 1)), "non-negative"),
])
def test_bad_arguments_give_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dwconv2d(**kwargs)


def _fresh_process_env(monkeypatch, value: str) -> None:
    """LKCNN_CONV_IMPL=value as a new process would see it (lkcnn reads the variable when imported)."""
    monkeypatch.setenv("LKCNN_CONV_IMPL", value)
    monkeypatch.setattr(dwconv, "_env_impl", dwconv.read_env())


def test_impl_selection(monkeypatch):
    _fresh_process_env(monkeypatch, "Torch")
    assert conv_impl() == "torch"
    monkeypatch.setenv("LKCNN_CONV_IMPL", "cuda")
    assert conv_impl() == "torch"  # read once: a run's choice does not change under it
    with use_conv_impl("cuda"):
        assert conv_impl() == "cuda"
        with pytest.raises(RuntimeError, match="cannot run: the input is on cpu"):
            dwconv2d(torch.randn(1, 2, 5, 5), torch.randn(2, 1, 3, 3))
    assert conv_impl() == "torch"
    set_conv_impl("auto")
    assert conv_impl() == "auto"
    set_conv_impl(None)  # back to the user's default
    assert conv_impl() == "torch"
    with pytest.raises(ValueError, match="auto, cuda, torch"):
        set_conv_impl("triton")
    _fresh_process_env(monkeypatch, "triton")
    with pytest.raises(ValueError, match="LKCNN_CONV_IMPL='triton' is not one of auto, cuda, torch"):
        dwconv2d(torch.randn(1, 2, 5, 5), torch.randn(2, 1, 3, 3))


def test_auto_falls_back_silently_on_cpu(recwarn):
    x, w, b = _rand_case(3, 3)
    with use_conv_impl("auto"):
        torch.testing.assert_close(dwconv2d(x, w, b), F.conv2d(x, w, b, 1, 1, 1, x.shape[1]))
    assert not [w for w in recwarn if "lkcnn" in str(w.message)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_build_without_gpu_says_why():
    with pytest.raises(build.BuildError, match="no CUDA device"):
        build._load(verbose=False)


def test_stale_build_lock_is_reported_not_waited_on(tmp_path, monkeypatch):
    lock = tmp_path / "lock"
    lock.touch()
    old = time.time() - 2 * build.LOCK_STALE_S
    os.utime(lock, (old, old))
    start = time.monotonic()
    with pytest.raises(build.BuildError, match="stale build lock"):
        build._check_lock(tmp_path)
    assert time.monotonic() - start < 5


def test_build_directory_depends_on_sources_and_arch(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    a, b = build.build_directory("9.0"), build.build_directory("8.0")
    assert a != b and a.parent == tmp_path and a.name.startswith("lkcnn_dwconv_")
    copy = tmp_path / "csrc"
    shutil.copytree(sources.csrc_dir(), copy)
    before = sources.source_digest("2.0", "13.0", "9.0", copy)
    header = next(p for p in copy.rglob("*.h"))
    header.write_text(header.read_text() + "\n// edited\n")  # a header edit is a source change too
    edited = sources.source_digest("2.0", "13.0", "9.0", copy)
    assert edited != before
    (copy / "dwconv" / "extra.inl").write_text("// included by a source\n")  # any file a source may include
    assert sources.source_digest("2.0", "13.0", "9.0", copy) != edited
    assert sources.source_digest("2.0", "13.0", "9.0", copy, python=sys.implementation.cache_tag) == \
        sources.source_digest("2.0", "13.0", "9.0", copy)
    assert sources.source_digest("2.0", "13.0", "9.0", copy, python="cpython-399") != \
        sources.source_digest("2.0", "13.0", "9.0", copy)  # a module for another Python


def _stdlib_extension() -> Path:
    """A compiled module of Python's own (lib-dynload), to stand in for a finished build's extension."""
    for name in ("_json", "_bisect", "_heapq", "_csv", "array"):
        path = getattr(importlib.import_module(name), "__file__", None)
        if path and path.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)):
            return Path(path)
    pytest.skip("this Python has its extension modules built in")


def test_a_finished_build_loads_without_ninja_or_nvcc(monkeypatch, tmp_path):
    """A build directory holding its module and the stamp of a finished build (restored from a cache, copied with a
    checkout) loads that module as it is; a module without the stamp (a link a killed build left) is built again;
    a stamped module that does not load says what to delete; a stale lock is reported first."""
    from torch.utils import cpp_extension

    ext = _stdlib_extension()
    name = ext.name.split(".")[0]
    monkeypatch.setattr(build, "arch_list", lambda: "9.0")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)  # no toolkit: only a finished build can load

    def directory(kind: str) -> Path:
        path = tmp_path / kind / name  # the module takes the directory's name, as the build names it
        path.mkdir(parents=True)
        monkeypatch.setattr(build, "build_directory", lambda archs: path)
        return path

    built = directory("built")
    with pytest.raises(build.BuildError, match="nvcc was not found"):
        build._jit_build(verbose=False)  # nothing built yet
    module_file = built / f"{name}{cpp_extension.LIB_EXT}"
    shutil.copy(ext, module_file)
    assert not build.is_built(built)
    with pytest.raises(build.BuildError, match="nvcc was not found"):
        build._jit_build(verbose=False)  # a module without the stamp: an unfinished build
    build._write_stamp(built)
    assert build.is_built(built)
    assert build._jit_build(verbose=False).__file__ == str(module_file)

    broken = directory("broken")
    (broken / f"{name}{cpp_extension.LIB_EXT}").write_bytes(b"not a shared object")
    build._write_stamp(broken)
    with pytest.raises(build.BuildError, match=f"delete {broken}"):
        build._jit_build(verbose=False)

    locked = directory("locked")
    shutil.copy(ext, locked / f"{name}{cpp_extension.LIB_EXT}")
    build._write_stamp(locked)
    old = time.time() - 2 * build.LOCK_STALE_S
    (locked / "lock").touch()
    os.utime(locked / "lock", (old, old))
    with pytest.raises(build.BuildError, match="stale build lock"):
        build._jit_build(verbose=False)


def test_prebuilt_extension_is_used_only_when_it_matches(monkeypatch, tmp_path):
    info = tmp_path / "_prebuilt.json"
    monkeypatch.setattr(build, "PREBUILT_INFO", info)
    usable, why = build.prebuilt_status()
    assert not usable and "LKCNN_BUILD_EXT=1" in why
    info.write_text(json.dumps({"digest": "0" * 16, "archs": "9.0", "torch": "1.0"}))
    usable, why = build.prebuilt_status()
    assert not usable and "built for torch 1.0" in why
    digest = sources.source_digest(torch.__version__, torch.version.cuda, "9.0")
    info.write_text(json.dumps({"digest": digest, "archs": "9.0", "torch": torch.__version__}))
    monkeypatch.setattr(build, "arch_list", lambda: "8.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    usable, why = build.prebuilt_status()
    assert not usable and "not this GPU's 8.0" in why
    monkeypatch.setattr(build, "arch_list", lambda: "9.0")
    assert build.prebuilt_status()[0]


def test_single_channel_tall_kernel():
    """1 channel, kernel taller than the map: the case where PyTorch's CPU convolution_backward crashes."""
    x = torch.randn(2, 1, 17, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(1, 1, 51, 5, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(2, 1, 17, 8, dtype=torch.float64)
    grad_w = torch.autograd.grad(dwconv2d(x, w), w, dy)[0]
    windows = F.pad(x.detach(), (2, 2, 25, 25)).unfold(2, 17, 1).unfold(3, 8, 1)  # (N, C, 51, 5, H, W)
    brute = (windows * dy[:, :, None, None]).sum((0, 4, 5)).unsqueeze(1)
    torch.testing.assert_close(grad_w, brute)


def test_meta_tensors_and_implementation_report():
    from lkcnn.ops import implementation

    y = dwconv2d(torch.empty(2, 3, 9, 9, device="meta"), torch.empty(3, 1, 7, 7, device="meta"))
    assert y.shape == (2, 3, 9, 9) and y.device.type == "meta"
    assert implementation(torch.randn(1, 3, 9, 9), [7, 7], [3, 3]) == "torch"
