"""UniRepLKNet (Ding et al., CVPR 2024; github AILab-CVC/UniRepLKNet): official parameter counts and state-dict keys of
every variant, loading official-layout checkpoints, re-parameterization to the deploy form, and the timm API.

The expected key names and shapes are written here from the official `unireplknet.py` module tree (its per-block
kernel table and dilated-branch table are restated literally), independently of lkcnn's model code.
"""
import copy

import pytest
import timm
import torch
import torch.nn.functional as F
from conftest import randomize_bn, rel_err
from timm.models import group_parameters
from timm.optim import param_groups_layer_decay
from timm.utils import reparameterize_model as timm_reparameterize_model

import lkcnn  # noqa: F401  (registers the models)
from lkcnn.deploy.reparam import reparameterize_model
from lkcnn.layers.unireplknet_blocks import DilatedDWConv, DilatedReparamBlock
from lkcnn.models import unireplknet
from lkcnn.ops import dwconv2d

# the official code's tables: dilated branches (kernels, dilations) per large kernel, per-block kernels per depth
OFFICIAL_BRANCHES = {17: ((5, 9, 3, 3, 3), (1, 2, 4, 5, 7)), 15: ((5, 7, 3, 3, 3), (1, 2, 3, 5, 7)),
                     13: ((5, 7, 3, 3, 3), (1, 2, 3, 4, 5)), 11: ((5, 5, 3, 3, 3), (1, 2, 3, 4, 5)),
                     9: ((5, 5, 3, 3), (1, 2, 3, 4)), 7: ((5, 3, 3), (1, 2, 3))}
OFFICIAL_KERNELS = {
    (2, 2, 6, 2): ((3, 3), (13, 13), (13,) * 6, (13, 13)),
    (2, 2, 8, 2): ((3, 3), (13, 13), (13,) * 8, (13, 13)),
    (3, 3, 18, 3): ((3, 3, 3), (13, 13, 13), (13, 3) * 9, (13, 13, 13)),
    (3, 3, 27, 3): ((3, 3, 3), (13, 13, 13), (13, 3, 3) * 9, (13, 13, 13)),
}
# name: depths, dims, official params in millions (training form, deploy form)
VARIANTS = {
    "a": ((2, 2, 6, 2), (40, 80, 160, 320), 4.65, 4.44),
    "f": ((2, 2, 6, 2), (48, 96, 192, 384), 6.49, 6.24),
    "p": ((2, 2, 6, 2), (64, 128, 256, 512), 11.08, 10.74),
    "n": ((2, 2, 8, 2), (80, 160, 320, 640), 18.82, 18.32),
    "t": ((3, 3, 18, 3), (80, 160, 320, 640), 31.69, 31.04),
    "s": ((3, 3, 27, 3), (96, 192, 384, 768), 56.46, 55.65),
    "b": ((3, 3, 27, 3), (128, 256, 512, 1024), 99.09, 98.01),
    "l": ((3, 3, 27, 3), (192, 384, 768, 1536), 220.08, 218.45),
    "xl": ((3, 3, 27, 3), (256, 512, 1024, 2048), 388.69, 386.53),
}


def official_shapes(depths, dims, deploy, num_classes=1000, in_chans=3) -> dict[str, tuple[int, ...]]:
    """Key -> shape of the official UniRepLKNet state dict (training form, or the form after its reparameterize)."""
    shapes = {}

    def conv(prefix, out_chs, in_chs, k, bias=True):
        shapes[f"{prefix}.weight"] = (out_chs, in_chs, k, k)
        if bias:
            shapes[f"{prefix}.bias"] = (out_chs,)

    def norm(prefix, c, batch=True):
        shapes.update({f"{prefix}.weight": (c,), f"{prefix}.bias": (c,)})
        if batch:
            shapes.update({f"{prefix}.running_mean": (c,), f"{prefix}.running_var": (c,),
                           f"{prefix}.num_batches_tracked": ()})

    conv("downsample_layers.0.0", dims[0] // 2, in_chans, 3)
    norm("downsample_layers.0.1", dims[0] // 2, batch=False)
    conv("downsample_layers.0.3", dims[0], dims[0] // 2, 3)
    norm("downsample_layers.0.4", dims[0], batch=False)
    for i in range(1, 4):
        conv(f"downsample_layers.{i}.0", dims[i], dims[i - 1], 3)
        norm(f"downsample_layers.{i}.1", dims[i], batch=False)
    for i, depth in enumerate(depths):
        c = dims[i]
        for j in range(depth):
            p, k = f"stages.{i}.{j}", OFFICIAL_KERNELS[tuple(depths)][i][j]
            if k >= 7:
                conv(f"{p}.dwconv.lk_origin", c, 1, k, bias=deploy)
                if not deploy:
                    norm(f"{p}.dwconv.origin_bn", c)
                    for kk, r in zip(*OFFICIAL_BRANCHES[k]):
                        conv(f"{p}.dwconv.dil_conv_k{kk}_{r}", c, 1, kk, bias=False)
                        norm(f"{p}.dwconv.dil_bn_k{kk}_{r}", c)
            else:
                conv(f"{p}.dwconv", c, 1, k, bias=deploy)
            if not deploy:
                norm(f"{p}.norm", c)
            conv(f"{p}.se.down", c // 4, c, 1)
            conv(f"{p}.se.up", c, c // 4, 1)
            shapes.update({f"{p}.pwconv1.1.weight": (4 * c, c), f"{p}.pwconv1.1.bias": (4 * c,),
                           f"{p}.act.1.gamma": (1, 1, 1, 4 * c), f"{p}.pwconv2.0.weight": (c, 4 * c)})
            if deploy:
                shapes[f"{p}.pwconv2.0.bias"] = (c,)
            else:
                shapes.update({f"{p}.act.1.beta": (1, 1, 1, 4 * c), f"{p}.gamma": (c,)})
                norm(f"{p}.pwconv2.2", c)
    norm("norm", dims[-1], batch=False)
    shapes.update({"head.weight": (num_classes, dims[-1]), "head.bias": (num_classes,)})
    return shapes


def _meta(name: str, **kwargs) -> torch.nn.Module:
    with torch.device("meta"):
        return timm.create_model(name, **kwargs)


def _shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _mparams(model: torch.nn.Module) -> float:
    return round(sum(p.numel() for p in model.parameters()) / 1e6, 2)


def randomize(model: torch.nn.Module) -> torch.nn.Module:
    """Random BN statistics, GRN gamma/beta and layer scales, so every fold of the deploy form is exercised (at their
    initial values GRN is the identity and the layer scale 1e-6 all but removes each block)."""
    randomize_bn(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("act.1.gamma", "act.1.beta")):
                p.normal_(0, 0.3)
            elif name.endswith(".gamma"):
                p.uniform_(0.1, 0.5)
    return model


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_official_counts_and_keys(variant):
    depths, dims, train, deploy = VARIANTS[variant]
    model = _meta(f"unireplknet_{variant}")
    assert _mparams(model) == train
    assert _shapes(model) == official_shapes(depths, dims, deploy=False)
    deployed = _meta(f"unireplknet_{variant}", deploy=True)
    assert _mparams(deployed) == deploy
    assert _shapes(deployed) == official_shapes(depths, dims, deploy=True)
    reparameterize_model(model)  # meta tensors: shapes only
    assert _shapes(model) == _shapes(deployed) and _mparams(model) == deploy


def test_large_convs_run_through_lkcnn_modules():
    model = _meta("unireplknet_t")
    block = model.stages[2][0].dwconv
    assert isinstance(block, DilatedReparamBlock) and isinstance(block.lk_origin, lkcnn.layers.LargeKernelConv)
    assert isinstance(block.dil_conv_k7_2, DilatedDWConv) and block.dil_conv_k7_2.dilation == (2, 2)
    assert isinstance(model.stages[2][1].dwconv, torch.nn.Conv2d)  # 3x3 blocks: PyTorch's conv, as officially


# --- checkpoints in the official layouts ------------------------------------------------------------------------

def _official_file(path, shapes: dict, wrap: str | None) -> dict[str, torch.Tensor]:
    """A synthesized checkpoint with the official key names and shapes (no official weights are downloaded)."""
    state = {k: (torch.rand(s) + 0.5 if k.endswith("running_var") else
                 torch.randint(0, 9, s) if k.endswith("num_batches_tracked") else torch.randn(s))
             for k, s in shapes.items()}
    torch.save({wrap: state, "epoch": 299} if wrap else state, path)
    return state


def _load(name: str, path, **kwargs) -> torch.nn.Module:
    return timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **kwargs)


@pytest.mark.parametrize("deploy", [False, True])
@pytest.mark.parametrize("wrap", [None, "model", "state_dict"])
def test_official_checkpoint_layouts_load_strictly(tmp_path, wrap, deploy):
    depths, dims = VARIANTS["a"][:2]
    state = _official_file(tmp_path / "ckpt.pth", official_shapes(depths, dims, deploy), wrap)
    model = _load("unireplknet_a", tmp_path / "ckpt.pth", deploy=deploy)  # timm loads strictly
    loaded = model.state_dict()
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], v) for k, v in state.items())


def test_training_checkpoint_into_deploy_model_is_merged(tmp_path):
    source = randomize(timm.create_model("unireplknet_a")).eval()
    torch.save({"model": source.state_dict()}, tmp_path / "train.pth")
    deployed = timm.create_model("unireplknet_a", deploy=True).eval()
    checkpoint = torch.load(tmp_path / "train.pth", weights_only=True)
    deployed.load_state_dict(unireplknet.checkpoint_filter_fn(checkpoint, deployed))
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert rel_err(deployed(x), source(x)) <= 1e-5


def test_deploy_checkpoint_into_training_model_is_a_clear_error(tmp_path):
    torch.save(_meta("unireplknet_a", deploy=True).to_empty(device="cpu").state_dict(), tmp_path / "deploy.pth")
    with pytest.raises(ValueError, match="missing keys"):
        _load("unireplknet_a", tmp_path / "deploy.pth")


# --- re-parameterization -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", sorted(OFFICIAL_BRANCHES))
def test_dilated_reparam_block_merge_is_exact(k):
    block = randomize_bn(DilatedReparamBlock(6, k)).eval()
    assert [(kk, r) for kk, r in block.branches] == list(zip(*OFFICIAL_BRANCHES[k]))
    x = torch.randn(2, 6, 17, 21)
    with torch.no_grad():
        expected = block(x)
        block.reparameterize()
        deployed = block(x)
    assert rel_err(deployed, expected) <= 1e-5
    twin = DilatedReparamBlock(6, k, deploy=True)
    twin.load_state_dict(block.state_dict())  # strict: the module built with deploy=True


@pytest.mark.parametrize("k,r", [(5, 1), (7, 2), (3, 3), (3, 5), (9, 2), (3, 7)])
def test_dilated_branch_is_pytorchs_dilated_conv(k, r):
    conv = DilatedDWConv(4, k, r, bias=True)
    torch.nn.init.normal_(conv.bias)
    x = torch.randn(2, 4, 23, 19)
    reference = F.conv2d(x, conv.weight, conv.bias, padding=conv.padding, dilation=r, groups=4)
    assert rel_err(conv(x), reference) <= 1e-6


# input sizes keep CPU time down; at 32 px the last stage is 1x1, which still exercises every fold
@pytest.mark.parametrize("variant,size", [("a", 64), ("f", 64), ("p", 64), ("n", 48), ("t", 48), ("s", 32),
                                          ("b", 32), ("l", 32), ("xl", 32)])
def test_every_variant_deploys_to_the_same_function(variant, size):
    torch.manual_seed(0)
    model = randomize(timm.create_model(f"unireplknet_{variant}")).eval()
    x = torch.randn(1, 3, size, size)
    with torch.no_grad():
        expected = model(x)
        assert reparameterize_model(model) is model
        deployed = model(x)
    assert rel_err(deployed, expected) <= 1e-5
    assert _mparams(model) == VARIANTS[variant][3]
    spec = model.lkcnn_spec
    assert spec["kwargs"]["deploy"] is True
    with torch.device("meta"):  # the spec rebuilds the deploy architecture: same keys, same shapes
        assert _shapes(timm.create_model(spec["name"], **spec["kwargs"])) == _shapes(model)


def test_timm_reparameterize_model_matches_lkcnns():
    model = randomize(timm.create_model("unireplknet_a")).eval()
    by_timm = timm_reparameterize_model(model)  # a deep copy
    assert by_timm.lkcnn_spec["kwargs"] == {"deploy": True} and model.lkcnn_spec["kwargs"] == {}
    by_lkcnn = reparameterize_model(copy.deepcopy(model))
    timm_state = by_timm.state_dict()
    assert all(torch.equal(v, timm_state[k]) for k, v in by_lkcnn.state_dict().items())
    deployed = timm.create_model("unireplknet_a", deploy=True).eval()
    deployed.load_state_dict(timm_state)  # strict
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert rel_err(deployed(x), model(x)) <= 1e-5
    reparameterize_model(deployed)  # idempotent
    assert all(torch.equal(v, timm_state[k]) for k, v in deployed.state_dict().items())


# --- the timm API ------------------------------------------------------------------------------------------------

def test_timm_api():
    model = timm.create_model("unireplknet_a", num_classes=7).eval()
    x = torch.randn(2, 3, 64, 64)
    feats = model.forward_features(x)
    assert feats.shape == (2, 320, 2, 2)
    assert model.forward_head(feats, pre_logits=True).shape == (2, 320)
    assert model(x).shape == (2, 7) and model.get_classifier().out_features == 7
    model.reset_classifier(3)
    assert model(x).shape == (2, 3)
    cfg = model.pretrained_cfg
    assert cfg["input_size"] == (3, 224, 224) and cfg["crop_pct"] == 0.875 and cfg["interpolation"] == "bicubic"
    assert cfg["mean"] == timm.data.IMAGENET_DEFAULT_MEAN and cfg["std"] == timm.data.IMAGENET_DEFAULT_STD
    fine_tuned = _meta("unireplknet_xl.in22k_ft_in1k_384").pretrained_cfg
    assert fine_tuned["input_size"] == (3, 384, 384) and fine_tuned["crop_pct"] == 1.0


def test_features_only_and_intermediates():
    model = timm.create_model("unireplknet_a", features_only=True).eval()
    outs = model(torch.randn(1, 3, 64, 64))
    assert [o.shape[1:] for o in outs] == [(40, 16, 16), (80, 8, 8), (160, 4, 4), (320, 2, 2)]
    assert model.feature_info.reduction() == [4, 8, 16, 32]
    pruned = timm.create_model("unireplknet_a", features_only=True, out_indices=(1,)).eval()
    assert [o.shape[1:] for o in pruned(torch.randn(1, 3, 64, 64))] == [(80, 8, 8)]
    assert len(pruned.model.stages) == 2 and len(pruned.model.downsample_layers) == 2
    full = timm.create_model("unireplknet_a").eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        final, early = full.forward_intermediates(x, indices=[0, 1], stop_early=True)
        assert final.shape[1] == 80 and [e.shape[1] for e in early] == [40, 80]
        last, _ = full.forward_intermediates(x)
        assert torch.equal(last, full.forward_features(x))


def test_layer_decay_groups_follow_depth():
    model = _meta("unireplknet_a")
    groups = param_groups_layer_decay(model, weight_decay=0.05, layer_decay=0.7)
    assert len({g["lr_scale"] for g in groups}) == 1 + 12 + 1  # stem, 12 blocks, head (with the final norm)
    layer_of = group_parameters(model, model.group_matcher(), reverse=True)
    assert layer_of["downsample_layers.0.3.weight"] == layer_of["downsample_layers.0.0.weight"] == 0
    assert layer_of["downsample_layers.1.0.weight"] == layer_of["stages.1.0.se.up.weight"]
    assert layer_of["stages.1.0.se.up.weight"] == layer_of["stages.0.1.gamma"] + 1
    assert layer_of["norm.weight"] == layer_of["head.weight"] > layer_of["stages.3.1.gamma"]
    assert len(set(group_parameters(model, model.group_matcher(coarse=True), reverse=True).values())) == 1 + 4 + 1


def test_grad_checkpointing_gives_same_gradients():
    torch.manual_seed(0)
    model = timm.create_model("unireplknet_a", dims=(8, 8, 16, 16), depths=(2, 1, 1, 1), kernel_sizes=[3, 7, 7, 7])
    x = torch.randn(2, 3, 32, 32)
    model(x).square().sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.set_grad_checkpointing(True)
    assert all(s.grad_checkpointing for s in model.stages)
    model(x).square().sum().backward()
    assert max(rel_err(p.grad, g) for p, g in zip(model.parameters(), expected) if g.norm() > 0) < 1e-5


def test_kernel_sizes_argument():
    model = _meta("unireplknet_a", kernel_sizes=[3, 7, [9, 0, 5, 11, 13, 15], 17], drop_path_rate=0.2)
    state = model.state_dict()
    assert state["stages.1.0.dwconv.dil_conv_k3_3.weight"].shape == (80, 1, 3, 3)  # kernel 7's branches
    assert state["stages.2.2.dwconv.weight"].shape == (160, 1, 5, 5)
    assert "stages.2.1.dwconv.weight" not in state and "stages.2.1.norm.weight" not in state  # kernel 0: no dwconv
    assert state["stages.3.1.dwconv.dil_conv_k9_2.weight"].shape == (320, 1, 9, 9)
    rates = [getattr(b.drop_path, "drop_prob", 0.0) for s in model.stages for b in s]
    assert rates[0] == 0 and rates[-1] == pytest.approx(0.2) and rates == sorted(rates)


@pytest.mark.parametrize("kwargs,match", [
    (dict(depths=(1, 1, 1, 1)), "pass kernel_sizes"),
    (dict(kernel_sizes=[3, 13, 19, 13]), "table"),
    (dict(kernel_sizes=[3, 13, [13, 13], 13]), "stage 2 has 6 blocks"),
])
def test_bad_kernel_sizes_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _meta("unireplknet_a", **kwargs)


def test_pretrained_file_with_features_only(tmp_path):
    source = timm.create_model("unireplknet_a").eval()
    torch.save({"model": source.state_dict()}, tmp_path / "w.pth")
    features = _load("unireplknet_a", tmp_path / "w.pth", features_only=True, out_indices=(1, 2)).eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        expected = source.forward_intermediates(x, indices=[1, 2], intermediates_only=True)
        assert all(torch.equal(a, b) for a, b in zip(features(x), expected))
    assert features.feature_info.channels() == [80, 160]
    fresh_head = _load("unireplknet_a", tmp_path / "w.pth", num_classes=10)
    assert fresh_head.head.out_features == 10
    assert torch.equal(fresh_head.downsample_layers[0][0].weight, source.downsample_layers[0][0].weight)
