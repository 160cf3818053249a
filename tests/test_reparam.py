"""Structural re-parameterization: each branch type and every registered model give the same outputs in deploy form."""
import pytest
import timm
import torch
from conftest import randomize_bn, rel_err
from timm.utils import reparameterize_model as timm_reparameterize_model

import lkcnn
from lkcnn.layers import REPARAM_LAYERS, DecomposedLargeKernelConv, ReparamLargeKernelConv, fuse_bn
from lkcnn.deploy.reparam import reparameterize_model


@pytest.mark.parametrize("kernel_size,small_kernel,dilated", [
    (31, 5, False),            # RepLKNet: large + small
    (27, None, False),         # RepLKNet-XL: large only (BN folding alone)
    (13, None, True),          # UniRepLKNet: dilated branches from the table
    (17, 5, True),             # small + dilated together
    (11, 3, [(3, 2), (5, 2)]),  # explicit dilated branches
    ((51, 5), 5, False),       # SLaK-style rectangular kernels
    ((5, 51), (5, 3), False),  # rectangular small kernel
])
def test_branch_merge_is_exact(kernel_size, small_kernel, dilated):
    module = randomize_bn(ReparamLargeKernelConv(6, kernel_size, small_kernel, dilated)).eval()
    x = torch.randn(2, 6, 19, 23)
    with torch.no_grad():
        expected = module(x)
        module.reparameterize()
        deployed = module(x)
    assert module.deploy and not hasattr(module, "lkb_origin") and not hasattr(module, "small_conv")
    assert rel_err(deployed, expected) <= 1e-5
    twin = ReparamLargeKernelConv(6, kernel_size, small_kernel, dilated, deploy=True)
    twin.load_state_dict(module.state_dict())  # strict: identical to a module built with deploy=True
    assert repr(twin) == repr(module)
    module.reparameterize()  # idempotent
    assert torch.equal(module(x), deployed)


@pytest.mark.parametrize("kernel_size,width,small_kernel", [
    (51, 5, 5),     # SLaK's first stage
    (13, 5, 3),     # a small kernel narrower than the width: centred in the 13x5 kernel
    (9, 3, None),   # the pair alone (BN folding only)
    (7, 7, 5),      # width = kernel: both branches square
])
def test_decomposed_merge_is_exact_and_keeps_the_pair(kernel_size, width, small_kernel):
    module = randomize_bn(DecomposedLargeKernelConv(6, kernel_size, width, small_kernel)).eval()
    x = torch.randn(2, 6, 19, 23)
    with torch.no_grad():
        expected = module(x)
        wide = fuse_bn(module.LoRA2.conv.weight, module.LoRA2.bn)[0]
        module.reparameterize()
        deployed = module(x)
    assert module.deploy and not any(hasattr(module, n) for n in ("LoRA1", "LoRA2", "small_conv"))
    assert rel_err(deployed, expected) <= 1e-5
    assert torch.equal(module.LoRA2_reparam.weight, wide)  # the small kernel went into LoRA1 only
    twin = DecomposedLargeKernelConv(6, kernel_size, width, small_kernel, deploy=True)
    twin.load_state_dict(module.state_dict())  # strict: identical to a module built with deploy=True
    assert repr(twin) == repr(module)
    module.reparameterize()  # idempotent
    assert torch.equal(module(x), deployed)


def _eval_with_random_bn(name: str, **kwargs) -> torch.nn.Module:
    return randomize_bn(timm.create_model(name, **kwargs)).eval()


@pytest.mark.parametrize("name,kwargs,size", [
    ("replknet_tiny", {}, 64),
    ("replknet_tiny", dict(kernel_sizes=13, small_kernel=3, dilated_branches=True, dw_ratio=1.5), 48),
    ("replknet_tiny", dict(kernel_sizes=[(51, 5), (29, 5), (27, 5), (13, 5)]), 48),
    ("replknet31b", {}, 32),
    ("replknet31l", {}, 16),  # big models: tiny inputs keep CPU time down (stage 4 is 1x1)
    ("replknet_xl", {}, 16),
    ("convnext_lk_tiny", dict(small_kernel=5), 32),
    ("convnext_lk_tiny", dict(kernel_sizes=13, dilated_branches=True), 32),
    ("convnext_lk_tiny", dict(kernel_sizes=(15, 13, 11, 9), decomposed=3, small_kernel=3, ls_init_value=1.0), 32),
    ("slak_tiny", dict(ls_init_value=1.0), 32),  # layer scale 1 so that the large kernels matter to the output
    ("slak_small", {}, 32),
    ("slak_base", {}, 32),  # ConvNeXt needs 32 px: its stem and downsamplings divide by 32
])
def test_every_model_deploys_to_the_same_function(name, kwargs, size):
    model = _eval_with_random_bn(name, **kwargs)
    x = torch.randn(1, 3, size, size)
    with torch.no_grad():
        expected = model(x)
        assert reparameterize_model(model) is model
        deployed = model(x)
    assert rel_err(deployed, expected) <= 1e-5
    assert not any(isinstance(m, REPARAM_LAYERS) and not m.deploy for m in model.modules())
    spec = model.lkcnn_spec
    assert spec["kwargs"]["deploy"] is True
    with torch.device("meta"):  # the spec rebuilds the deploy architecture: same keys, same shapes
        twin = timm.create_model(spec["name"], **spec["kwargs"])
    assert _shapes(twin) == _shapes(model)


def _shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def test_model_without_branches_is_marked_deployed():
    model = timm.create_model("convnext_lk_tiny", depths=(1, 1, 1, 1), dims=(8, 16, 24, 32), kernel_sizes=9)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert "deploy" not in model.lkcnn_spec["kwargs"]
    reparameterize_model(model)
    assert model.lkcnn_spec["kwargs"]["deploy"] is True
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing to merge, nothing changed


def test_every_registered_model_is_covered():
    covered = {"replknet_tiny", "replknet31b", "replknet31l", "replknet_xl", "convnext_lk_tiny", "slak_tiny",
               "slak_small", "slak_base"}
    covered |= {f"unireplknet_{v}" for v in ("a", "f", "p", "n", "t", "s", "b", "l", "xl")}  # test_unireplknet.py
    assert set(lkcnn.models.list_models()) == covered


@pytest.mark.parametrize("name,kwargs", [
    ("replknet_tiny", dict(kernel_sizes=9, small_kernel=3)),
    ("slak_tiny", dict(dims=(8, 16, 24, 32), depths=(1, 1, 1, 1), kernel_sizes=(15, 13, 11, 9), ls_init_value=1.0)),
])
def test_timm_reparameterize_model_works_and_copies(name, kwargs):
    model = _eval_with_random_bn(name, **kwargs)
    x = torch.randn(1, 3, 32, 32)
    deployed = timm_reparameterize_model(model)  # not in place: returns a merged deep copy
    assert deployed is not model and model.lkcnn_spec["kwargs"].get("deploy") is None
    assert deployed.lkcnn_spec["kwargs"]["deploy"] is True
    with torch.no_grad():
        assert rel_err(deployed(x), model(x)) <= 1e-5


def test_root_module_is_reparameterized():
    module = randomize_bn(ReparamLargeKernelConv(3, 9, 3)).eval()
    x = torch.randn(1, 3, 12, 12)
    with torch.no_grad():
        expected = module(x)
        assert reparameterize_model(module).deploy
        assert rel_err(module(x), expected) <= 1e-5


def test_reparameterize_keeps_dtype():
    module = randomize_bn(ReparamLargeKernelConv(3, 9, 3)).double().eval()
    x = torch.randn(1, 3, 12, 12, dtype=torch.float64)
    expected = module(x).detach()
    module.reparameterize()
    assert module.lkb_reparam.weight.dtype == torch.float64
    assert rel_err(module(x).detach(), expected) <= 1e-12
