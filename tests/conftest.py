"""Shared helpers for the layer / model / re-parameterization tests (imported as `from conftest import ...`), and the
data tests' fixture for decode=gpu without CUDA."""
import os
import random
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from lkcnn.ops import set_conv_impl


@pytest.fixture(autouse=True)
def _same_draws_whatever_ran_before():
    """Each test starts from one random state: the kernel checks reseed from the clock on purpose (fresh inputs each
    run, the seed in a failure's message), so without this a test run after them drew different inputs each run."""
    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _user_default_conv_impl():
    """Each test starts from the user's conv implementation: the training app (conv_impl) and the tools choose one
    for the whole process."""
    set_conv_impl(None)
    yield
    set_conv_impl(None)


def randomize_bn(module: nn.Module) -> nn.Module:
    """Give every BatchNorm fresh random running stats and affine params, so BN folding is really exercised."""
    for bn in module.modules():
        if isinstance(bn, nn.modules.batchnorm._BatchNorm):
            bn.running_mean.normal_(0, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.data.uniform_(0.5, 1.5)
            bn.bias.data.normal_(0, 0.5)
    return module


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative error in the L2 norm."""
    return ((actual - expected).norm() / expected.norm()).item()


def assert_switch_and_conv_policy_gate(ops_module, x: torch.Tensor, set_kernels) -> None:
    """An op module's `uses_kernels(x)` on a tensor that claims to be on a GPU: true where Triton imports, false with
    the op's kernels switched off (`set_kernels(False)`, switched back on after) or under the 'torch' conv policy."""
    assert x.is_cuda  # the caller patches is_cuda: a meta tensor stands in for a GPU one
    assert ops_module.uses_kernels(x) == ops_module.TRITON
    set_kernels(False)
    try:
        assert not ops_module.uses_kernels(x)
    finally:
        set_kernels(True)
    from lkcnn.ops import use_conv_impl
    with use_conv_impl("torch"):
        assert not ops_module.uses_kernels(x)


def written_rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """rel_err in float64 of a kernel's output that was poisoned with NaN before the launch (the `poison` fixture):
    fails on an element the kernel never wrote."""
    assert not torch.isnan(actual).any(), "NaN: an element the kernels never wrote"
    return ((actual.double() - expected).norm() / expected.norm()).item()


@pytest.fixture
def poison(monkeypatch):
    """lkcnn's ops fill their outputs with NaN before each kernel launch (LKCNN_DEBUG_POISON=1)."""
    monkeypatch.setenv("LKCNN_DEBUG_POISON", "1")


_INTERPRETER_PRELUDE = """
import torch
def assert_close(checks, dtype, where):
    # each result (name: (kernel's, float64 reference)): float32 ones within 1e-5 (float32 sums, the shifted sums'
    # cancellation included: 1e-6 failed one draw in ~15), 16-bit ones within their dtype's tolerance
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
    for name, (a, b) in checks.items():
        err = ((a.double() - b).norm() / b.norm()).item()
        assert err < tol[torch.float32 if a.dtype in (torch.float32, torch.float64) else dtype], (name, *where, err)
"""


def run_in_triton_interpreter(script: str) -> None:
    """Run `script` under Triton's interpreter on the CPU, in its own process (TRITON_INTERPRET is read when the kernels
    are defined), after a prelude defining `assert_close(checks, dtype, where)`; it must print "ok". Skips before
    Triton 3.8, whose interpreter cannot take a runtime loop bound."""
    triton = pytest.importorskip("triton")
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 8):
        pytest.skip("Triton's interpreter takes a runtime loop bound from 3.8 on (before, int() of a 1-element array)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", _INTERPRETER_PRELUDE + script], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def _loss_runs(model: nn.Module, x: torch.Tensor, extra=lambda: [], autocast: bool = False):
    """run(fn): [output, *parameter gradients, *extra()] of a loss on fn(x), `model` reset to its state now first
    (bf16 autocast on CUDA with `autocast`)."""
    start = {k: v.clone() for k, v in model.state_dict().items()}

    def run(fn):
        model.load_state_dict(start)
        model.zero_grad()
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            y = fn(x)
        y.float().square().mean().backward()
        return [y.detach().float()] + [p.grad.clone() for p in model.parameters()] + extra()
    return run


def eager_and_compiled(model: nn.Module, x: torch.Tensor, cache_dir) -> tuple[list, list, dict]:
    """([output, *parameter gradients] of a loss on `model(x)` eager, the same compiled with fullgraph from the same
    state, AOT autograd's cache counters of the compile), with torch's caches on in `cache_dir`: whether the graph
    can be stored, as a second run of the training app needs to skip its compile."""
    from torch._dynamo.utils import counters

    run = _loss_runs(model, x)
    eager = run(model)
    torch._dynamo.reset()
    counters.clear()
    with (pytest.MonkeyPatch.context() as patch, torch._functorch.config.patch(enable_autograd_cache=True),
          torch._inductor.config.patch(fx_graph_cache=True)):
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache_dir))
        compiled = run(torch.compile(model, fullgraph=True))
    return eager, compiled, dict(counters["aot_autograd"])


def autocast_runs(model: nn.Module, x: torch.Tensor, kernels_switch, extra=lambda: []) -> tuple[list, list, list]:
    """[output, *parameter gradients, *extra()] of a loss on `model(x)` under bf16 autocast (CUDA), from the same
    state each time: eager, compiled with fullgraph (a graph break fails), and eager with `kernels_switch(False)`
    (lkcnn's torch-ops path; switched back on after)."""
    run = _loss_runs(model, x, extra, autocast=True)
    eager = run(model)
    compiled = run(torch.compile(model, fullgraph=True))
    kernels_switch(False)
    try:
        return eager, compiled, run(model)
    finally:
        kernels_switch(True)


@pytest.fixture
def one_thread():
    """Tiny models gain next to nothing from intra-op threads, and on a busy CPU each thread barrier can stall for a
    scheduler slice (measured: 14 s single-threaded vs 207 s with two threads for the default-run test in
    test_train.py). Modules use it with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def no_cuda_check(monkeypatch):
    """decode=gpu DataModules on a machine without CUDA: the device half then runs on the CPU."""
    from lkcnn.training.data import gpu_decode  # here, not at the top: the other tests need no data stack

    monkeypatch.setattr(gpu_decode, "require_cuda", lambda: None)


def grid_step(units: torch.Tensor, quant: str) -> torch.Tensor:
    """The spacing of `quant`'s grid at each value (in units of the scale): 1 for int8; for e4m3, 2^-3 of the
    value's binade, 2^-9 among the subnormals."""
    if quant == "int8":
        return torch.ones_like(units)
    # frexp's exponent is exact, where log2 may put an exact power of two (8, 64) a hair below it on the GPU, which
    # halves the step there
    _, exponent = torch.frexp(units.abs().clamp(min=2.0 ** -6))  # x = m 2^e, 0.5 <= m < 1: the binade is 2^(e-1)
    return torch.exp2((exponent - 4).to(units.dtype))
