"""lkcnn model zoo: official RepLKNet architecture/keys/counts, SLaK's decomposed ConvNeXt-LK, timm model API,
ablation kwargs, lkcnn_spec, checkpoint loading through timm's pretrained-file mechanism, and the `info` command."""
import json

import pytest
import timm
import torch
from conftest import randomize_bn, rel_err
from timm.models import group_parameters
from timm.optim import param_groups_layer_decay

import lkcnn
from lkcnn.info import info, main
from lkcnn.layers import DecomposedLargeKernelConv, LargeKernelConv, ReparamLargeKernelConv
from lkcnn.models import checkpoint_filter_fn
from lkcnn.deploy.reparam import reparameterize_model


def _meta(name: str, **kwargs) -> torch.nn.Module:
    """Build without memory or init time: enough for structure, keys and parameter counts."""
    with torch.device("meta"):
        return timm.create_model(name, **kwargs)


def _mparams(model: torch.nn.Module) -> float:
    return round(sum(p.numel() for p in model.parameters()) / 1e6, 2)


@pytest.mark.parametrize("name,train,deploy,keys_train,keys_deploy", [
    ("replknet31b", 79.86, 79.53, 1171, 931),
    ("replknet31l", 172.67, 172.17, 1171, 931),
    ("replknet_xl", 335.44, 335.40, None, 931),
])
def test_official_replknet_counts(name, train, deploy, keys_train, keys_deploy):
    model = _meta(name)
    assert _mparams(model) == train
    if keys_train:
        assert len(model.state_dict()) == keys_train
    reparameterize_model(model)
    assert _mparams(model) == deploy and len(model.state_dict()) == keys_deploy
    assert _mparams(_meta(name, deploy=True)) == deploy


def test_official_replknet31b_key_layout():
    state = _meta("replknet31b").state_dict()
    block = "stages.2.blocks.16"
    assert state[f"{block}.large_kernel.lkb_origin.conv.weight"].shape == (512, 1, 27, 27)
    assert state[f"{block}.large_kernel.small_conv.conv.weight"].shape == (512, 1, 5, 5)
    assert {f"{block}.prelkb_bn.weight", f"{block}.pw1.conv.weight", f"{block}.pw2.bn.running_var",
            "stages.2.blocks.17.preffn_bn.bias", "stem.3.conv.weight", "transitions.2.1.bn.weight",
            "norm.running_mean", "head.weight", "head.bias"} <= set(state)
    assert state["stages.2.blocks.17.pw1.conv.weight"].shape == (2048, 512, 1, 1)
    assert "stages.3.blocks.4.prelkb_bn.weight" not in state  # depth 2 -> blocks 0..3
    deployed = _meta("replknet31b", deploy=True).state_dict()
    assert deployed[f"{block}.large_kernel.lkb_reparam.bias"].shape == (512,)


def test_replknet_xl_uses_dw_ratio_and_no_small_kernel():
    state = _meta("replknet_xl").state_dict()
    assert state["stages.0.blocks.0.large_kernel.lkb_origin.conv.weight"].shape == (384, 1, 27, 27)
    assert not any("small_conv" in k for k in state)


def test_tiny_model_timm_api():
    model = timm.create_model("replknet_tiny", num_classes=7).eval()
    x = torch.randn(2, 3, 64, 64)
    feats = model.forward_features(x)
    assert feats.shape == (2, 256, 2, 2)
    assert model.forward_head(feats, pre_logits=True).shape == (2, 256)
    assert model(x).shape == (2, 7) and model.get_classifier().out_features == 7
    model.reset_classifier(3)
    assert model(x).shape == (2, 3)
    assert [f["reduction"] for f in model.feature_info] == [4, 8, 16, 32]
    cfg = model.pretrained_cfg
    assert cfg["input_size"] == (3, 224, 224) and cfg["interpolation"] == "bicubic" and cfg["crop_pct"] == 0.875
    assert cfg["mean"] == timm.data.IMAGENET_DEFAULT_MEAN and cfg["std"] == timm.data.IMAGENET_DEFAULT_STD


def test_features_only_returns_every_stage():
    model = timm.create_model("replknet_tiny", features_only=True).eval()
    outs = model(torch.randn(1, 3, 64, 64))
    assert [o.shape[1:] for o in outs] == [(32, 16, 16), (64, 8, 8), (128, 4, 4), (256, 2, 2)]
    assert model.feature_info.channels() == [32, 64, 128, 256]
    pruned = timm.create_model("replknet_tiny", features_only=True, out_indices=(1,)).eval()
    assert [o.shape[1:] for o in pruned(torch.randn(1, 3, 64, 64))] == [(64, 8, 8)]
    assert len(pruned.model.stages) == 2  # the stages after the last wanted feature are dropped
    full = timm.create_model("replknet_tiny").eval()
    x = torch.randn(1, 3, 64, 64)
    final, early = full.forward_intermediates(x, indices=[0, 1], stop_early=True)
    assert final.shape[1] == 64 and [e.shape[1] for e in early] == [32, 64]


def test_layer_decay_groups_follow_depth():
    model = timm.create_model("replknet_tiny")
    groups = param_groups_layer_decay(model, weight_decay=0.05, layer_decay=0.7)
    assert len({g["lr_scale"] for g in groups}) == 1 + 10 + 1  # stem, 10 blocks (5 RepLK + 5 FFN), head
    layer_of = group_parameters(model, model.group_matcher(), reverse=True)
    assert layer_of["transitions.0.0.conv.weight"] == layer_of["stages.0.blocks.1.pw1.conv.weight"]
    assert layer_of["stages.1.blocks.0.pw1.conv.weight"] == layer_of["transitions.0.1.conv.weight"] + 1
    assert layer_of["norm.weight"] == layer_of["stages.3.blocks.1.pw2.conv.weight"] < layer_of["head.weight"]
    assert len(set(group_parameters(model, model.group_matcher(coarse=True), reverse=True).values())) == 1 + 4 + 1


def test_grad_checkpointing_gives_same_gradients():
    torch.manual_seed(0)
    model = timm.create_model("replknet_tiny", kernel_sizes=7)
    x = torch.randn(2, 3, 32, 32)
    model(x).square().sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.set_grad_checkpointing(True)
    assert all(s.grad_checkpointing for s in model.stages)
    model(x).square().sum().backward()
    assert max(rel_err(p.grad, g) for p, g in zip(model.parameters(), expected) if g.norm() > 0) < 1e-5


def test_ablation_kwargs():
    model = _meta("replknet_tiny", kernel_sizes=[9, 7, 5, 3], small_kernel=0, dw_ratio=2, ffn_ratio=2,
                  in_chans=1, num_classes=5, drop_path_rate=0.2)
    state = model.state_dict()
    assert state["stages.1.blocks.0.large_kernel.lkb_origin.conv.weight"].shape == (128, 1, 7, 7)
    assert not any("small_conv" in k for k in state)
    assert state["stages.0.blocks.0.pw1.conv.weight"].shape == (64, 32, 1, 1)  # dw_ratio
    assert state["stages.0.blocks.1.pw1.conv.weight"].shape == (64, 32, 1, 1)  # ffn_ratio
    assert state["stem.0.conv.weight"].shape[1] == 1 and state["head.weight"].shape[0] == 5
    rates = [getattr(b.drop_path, "drop_prob", 0.0) for s in model.stages for b in s.blocks]
    assert rates[0] == 0 and rates[-1] == pytest.approx(0.2) and rates == sorted(rates)
    assert rates[::2] == rates[1::2]  # a RepLKBlock and its ConvFFN share the rate


def test_small_kernel_larger_than_kernel_says_how_to_drop_it():
    with pytest.raises(ValueError, match="small_kernel=0"):
        _meta("replknet_tiny", kernel_sizes=3)


def test_build_model_keeps_an_explicit_small_kernel_none():
    """timm.create_model would drop small_kernel=None and bring back the default branch; lkcnn's builder does not."""
    with torch.device("meta"):
        model = lkcnn.models.build_model("replknet_tiny", small_kernel=None)
    assert not any(isinstance(m, ReparamLargeKernelConv) and m.small_kernel for m in model.modules())
    assert model.lkcnn_spec["kwargs"] == {"small_kernel": 0}


def test_set_values_are_read_as_yaml():
    assert lkcnn.models.parse_model_args(["a=null", "b=[31,29,27,13]", "c=true", "d=1e-5", "e=text", "f='7'"]) == {
        "a": None, "b": [31, 29, 27, 13], "c": True, "d": 1e-5, "e": "text", "f": "7"}
    with pytest.raises(lkcnn.models.ModelError, match="not YAML"):
        lkcnn.models.parse_model_args(["kernel_sizes=[31,29"])


def test_small_kernel_none_survives_timm_create_model():
    # timm.create_model drops None kwargs; 0 is the spelling that survives, and the spec uses it
    model = _meta("replknet_tiny", small_kernel=0)
    assert not any(isinstance(m, ReparamLargeKernelConv) and m.small_kernel for m in model.modules())
    assert model.lkcnn_spec["kwargs"] == {"small_kernel": 0}


@pytest.mark.parametrize("name,kwargs", [
    ("replknet_tiny", {}),
    ("replknet_tiny", dict(kernel_sizes=(13, 11, 9, 7), small_kernel=None, dilated_branches=True, num_classes=10)),
    ("replknet31b", dict(kernel_sizes=13, drop_path_rate=0.3, dw_ratio=1.5)),
    ("convnext_lk_tiny", dict(kernel_sizes=(7, 7, 31, 13), small_kernel=5, in_chans=1)),
    ("convnext_lk_tiny", dict(kernel_sizes=(51, 49, 47, 13), decomposed=5, small_kernel=5)),
    ("slak_tiny", dict(decomposed=7, small_kernel=0, dims=(64, 128, 256, 512))),
])
def test_spec_rebuilds_the_architecture(name, kwargs):
    model = _meta(name, **kwargs)
    spec = json.loads(json.dumps(model.lkcnn_spec))
    assert spec["name"] == name
    assert "drop_path_rate" not in spec["kwargs"] or spec["kwargs"]["drop_path_rate"] == kwargs["drop_path_rate"]
    rebuilt = _meta(spec["name"], **spec["kwargs"])
    assert {k: v.shape for k, v in rebuilt.state_dict().items()} == {k: v.shape for k, v in model.state_dict().items()}


def test_spec_leaves_out_defaults():
    assert _meta("replknet31b", kernel_sizes=(31, 29, 27, 13), small_kernel=5).lkcnn_spec == {
        "name": "replknet31b", "kwargs": {}}


def test_convnext_lk_matches_timm_convnext():
    ref = timm.create_model("convnext_tiny").eval()
    model = timm.create_model("convnext_lk_tiny", kernel_sizes=7).eval()
    assert _mparams(model) == _mparams(ref) == 28.59
    model.load_state_dict(ref.state_dict(), strict=True)
    assert all(isinstance(b.conv_dw, LargeKernelConv) for s in model.stages for b in s.blocks)
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert rel_err(model(x), ref(x)) < 1e-5


@pytest.mark.parametrize("kernel_sizes,mparams", [(31, 34.63), ((31, 29, 27, 13), 31.93)])
def test_convnext_lk_large_kernel_counts(kernel_sizes, mparams):
    model = _meta("convnext_lk_tiny", kernel_sizes=kernel_sizes)
    assert _mparams(model) == mparams == _mparams(_meta("convnext_tiny", kernel_sizes=kernel_sizes))


def test_convnext_lk_rejects_even_kernels():
    with pytest.raises(ValueError, match="odd"):
        _meta("convnext_lk_tiny", kernel_sizes=(31, 28, 27, 13))
    with pytest.raises(ValueError, match="odd"):
        _meta("replknet_tiny", kernel_sizes=8)


@pytest.mark.parametrize("name,train,deploy", [
    ("slak_tiny", 30.82, 30.62), ("slak_small", 55.57, 55.16), ("slak_base", 95.72, 95.18)])
def test_slak_counts(name, train, deploy):
    model = _meta(name)
    assert _mparams(model) == train and _mparams(_meta(name, deploy=True)) == deploy
    reparameterize_model(model)
    assert _mparams(model) == deploy


def test_slak_tiny_is_convnext_lk_decomposed_with_slaks_keys():
    state = _meta("slak_tiny").state_dict()
    same = _meta("convnext_lk_tiny", kernel_sizes=(51, 49, 47, 13), decomposed=5, small_kernel=5).state_dict()
    assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in same.items()}
    assert state["stages.0.blocks.0.conv_dw.LoRA1.conv.weight"].shape == (96, 1, 51, 5)
    assert state["stages.2.blocks.8.conv_dw.LoRA2.conv.weight"].shape == (384, 1, 5, 47)
    assert state["stages.3.blocks.2.conv_dw.small_conv.conv.weight"].shape == (768, 1, 5, 5)
    assert state["stages.3.blocks.2.conv_dw.LoRA1.bn.running_var"].shape == (768,)
    assert not any(k.endswith(("conv_dw.weight", "conv_dw.bias")) for k in state)
    deployed = _meta("slak_tiny", deploy=True)
    assert deployed.lkcnn_spec == {"name": "slak_tiny", "kwargs": {"deploy": True}}
    conv = deployed.stages[1].blocks[0].conv_dw
    assert isinstance(conv, DecomposedLargeKernelConv) and conv.LoRA1_reparam.weight.shape == (192, 1, 49, 5)


@pytest.mark.parametrize("kwargs,match", [
    (dict(kernel_sizes=[(51, 5), 49, 47, 13], decomposed=5), "square kernel_sizes"),
    (dict(kernel_sizes=13, decomposed=5, dilated_branches=True), "no dilated_branches"),
    (dict(kernel_sizes=13, decomposed=3, small_kernel=5), r"must fit inside the 13x3 kernel"),
])
def test_decomposed_rejects_what_it_cannot_build(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _meta("convnext_lk_tiny", **kwargs)


def test_slak_features_and_head():
    model = timm.create_model("slak_tiny", dims=(8, 16, 24, 32), depths=(1, 1, 1, 1), num_classes=3).eval()
    x = torch.randn(1, 3, 64, 64)
    assert model(x).shape == (1, 3)
    feats = timm.create_model("slak_tiny", dims=(8, 16, 24, 32), depths=(1, 1, 1, 1), features_only=True)(x)
    assert [tuple(f.shape[1:]) for f in feats] == [(8, 16, 16), (16, 8, 8), (24, 4, 4), (32, 2, 2)]


def test_unknown_model_is_a_clear_error():
    with pytest.raises(RuntimeError, match="Unknown model"):
        timm.create_model("replknet31x")
    with pytest.raises(ValueError, match="did you mean.*replknet31b"):
        info("replknet31x")


# --- checkpoints through timm's pretrained-file mechanism ---------------------------------------------------------

def _load(name: str, path, **kwargs) -> torch.nn.Module:
    return timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **kwargs)


def test_official_wrapped_checkpoint_loads(tmp_path):
    ema = randomize_bn(timm.create_model("replknet_tiny")).eval()
    raw = {k: torch.zeros_like(v) for k, v in ema.state_dict().items()}
    torch.save({"model": raw, "model_ema": ema.state_dict(), "epoch": 3}, tmp_path / "ckpt.pth")
    loaded = _load("replknet_tiny", tmp_path / "ckpt.pth").eval()  # timm's file loader asks for the EMA weights
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded(x), ema(x))
    # unasked, lkcnn reads the plain weights (lkcnn.models.select_weights' rule)
    assert checkpoint_filter_fn({"model": raw, "model_ema": ema.state_dict()}, loaded)["head.weight"].norm() == 0
    torch.save({"state_dict": {f"module.{k}": v for k, v in ema.state_dict().items()}}, tmp_path / "ddp.pth")
    assert torch.equal(_load("replknet_tiny", tmp_path / "ddp.pth").head.weight, ema.head.weight)


def test_checkpoint_into_new_num_classes(tmp_path):
    source = timm.create_model("replknet_tiny")
    torch.save(source.state_dict(), tmp_path / "w.pth")
    model = _load("replknet_tiny", tmp_path / "w.pth", num_classes=10)
    assert model.head.out_features == 10 and torch.equal(model.stem[0].conv.weight, source.stem[0].conv.weight)


def test_training_checkpoint_into_deploy_model_is_merged(tmp_path):
    source = randomize_bn(timm.create_model("replknet_tiny", dilated_branches=[(3, 2)])).eval()
    torch.save(source.state_dict(), tmp_path / "train.pth")
    deployed = _load("replknet_tiny", tmp_path / "train.pth", dilated_branches=[(3, 2)], deploy=True).eval()
    assert all(m.deploy for m in deployed.modules() if isinstance(m, ReparamLargeKernelConv))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert rel_err(deployed(x), source(x)) <= 1e-5


def test_deploy_checkpoint_into_training_model_says_what_to_do(tmp_path):
    torch.save(timm.create_model("replknet_tiny", deploy=True).state_dict(), tmp_path / "deploy.pth")
    with pytest.raises(ValueError, match="deploy=True"):
        _load("replknet_tiny", tmp_path / "deploy.pth")


@pytest.mark.parametrize("kwargs,match", [
    (dict(kernel_sizes=13), "shape"),
    (dict(small_kernel=0), "unexpected keys"),
])
def test_mismatched_checkpoint_is_a_clear_error(tmp_path, kwargs, match):
    torch.save(timm.create_model("replknet_tiny").state_dict(), tmp_path / "w.pth")
    with pytest.raises(ValueError, match=match):
        _load("replknet_tiny", tmp_path / "w.pth", **kwargs)


def test_filter_maps_facebook_convnext_keys():
    model = timm.create_model("convnext_lk_tiny", kernel_sizes=7)
    fb = {k.replace("stem.", "downsample_layers.0.").replace("conv_dw", "dwconv").replace("mlp.fc", "pwconv")
          .replace("head.fc.", "head.").replace("head.norm", "norm"): v for k, v in model.state_dict().items()}
    fb = {_fb_stage_key(k): v for k, v in fb.items()}
    mapped = checkpoint_filter_fn({"model": fb}, model)
    model.load_state_dict(mapped, strict=True)


@pytest.mark.parametrize("deploy", [False, True])
def test_slak_checkpoint_layout_loads(tmp_path, deploy):
    """SLaK's own keys (Facebook ConvNeXt's, with `large_kernel.LoRA1/LoRA2/small_conv` for the depthwise conv) load
    into slak_*, merged on the fly into a deploy=True model."""
    kwargs = dict(dims=(8, 16, 24, 32), depths=(1, 1, 1, 1), ls_init_value=1.0)
    source = randomize_bn(timm.create_model("slak_tiny", **kwargs)).eval()
    slak = {_fb_stage_key(k.replace("stem.", "downsample_layers.0.").replace("conv_dw", "large_kernel")
                          .replace("mlp.fc", "pwconv").replace("head.fc.", "head.").replace("head.norm", "norm")): v
            for k, v in source.state_dict().items()}
    assert "stages.1.0.large_kernel.LoRA2.conv.weight" in slak and "downsample_layers.1.1.weight" in slak
    torch.save({"model": slak}, tmp_path / "slak.pth")
    loaded = _load("slak_tiny", tmp_path / "slak.pth", deploy=deploy, **kwargs).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert rel_err(loaded(x), source(x)) <= 1e-5


def test_deployed_slak_checkpoint_into_training_model_says_what_to_do(tmp_path):
    kwargs = dict(dims=(8, 16, 24, 32), depths=(1, 1, 1, 1))
    torch.save(timm.create_model("slak_tiny", deploy=True, **kwargs).state_dict(), tmp_path / "deploy.pth")
    with pytest.raises(ValueError, match="deploy=True"):
        _load("slak_tiny", tmp_path / "deploy.pth", **kwargs)


def _fb_stage_key(key: str) -> str:
    """timm 'stages.i.blocks.j' / 'stages.i.downsample.j' -> Facebook 'stages.i.j' / 'downsample_layers.i.j'."""
    parts = key.split(".")
    if parts[0] == "stages" and parts[2] == "blocks":
        return ".".join(["stages", parts[1], *parts[3:]])
    if parts[0] == "stages" and parts[2] == "downsample":
        return ".".join(["downsample_layers", parts[1], *parts[3:]])
    return key


# --- info ---------------------------------------------------------------------------------------------------------

def test_info_counts_replknet31b():
    result = info("replknet31b")
    assert round(result["params_train"] / 1e6, 2) == 79.86 and round(result["params_deploy"] / 1e6, 2) == 79.53
    assert result["macs_train"] / 1e9 == pytest.approx(15.4, abs=0.1)
    assert result["large_kernel_counted"] and result["large_kernel_macs_train"] > 0
    # the training form's 5x5 branches count too: 25 MACs per output of each block's branch
    branches = sum(blocks * c * hw * hw * 25 for blocks, c, hw in zip((2, 2, 18, 2), (128, 256, 512, 1024),
                                                                      (56, 28, 14, 7)))
    assert result["large_kernel_macs_train"] - result["large_kernel_macs_deploy"] == branches


def test_info_cli(capsys):
    args = ["replknet_tiny", "--img-size", "64", "--set", "kernel_sizes=[7,7,5,3]", "--set", "small_kernel=null"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "replknet_tiny" in out and "deploy form" in out and "64x64" in out
    assert main(["replknet_tiny", "--set", "kernel_sizes"]) == 2
    assert "key=value" in capsys.readouterr().err
    assert main(["replknet_tiny", "--set", "kernel_sizes=6"]) == 2
    assert "odd" in capsys.readouterr().err


def test_import_registers_models():
    assert {"replknet31b", "replknet31l", "replknet_xl", "replknet_tiny", "convnext_lk_tiny"} <= set(
        timm.list_models()) and lkcnn.models.list_models()
