"""Shared helpers for the layer / model / re-parameterization tests (imported as `from conftest import ...`), and the
data tests' fixture for decode=gpu without CUDA."""
import pytest
import torch
import torch.nn as nn

from lkcnn.ops import set_conv_impl


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
