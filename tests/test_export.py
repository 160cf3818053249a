"""lkcnn.deploy.export: checkpoint -> verified deployed files -> lkcnn.load_deployed, ONNX, refusals and CLI errors."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import onnx
import pytest
import timm
import torch
from onnx.reference import ReferenceEvaluator
from torch.utils.data import DataLoader, TensorDataset

import lkcnn
from conftest import randomize_bn, rel_err
from lkcnn.deploy import export
from lkcnn.deploy.checkpoint import CheckpointError
from lkcnn.deploy.export import ExportError, export_checkpoint, load_deployed
from lkcnn.export import main
from lkcnn.ops import dwconv
from lkcnn.training.module import ClassificationModule

SIZE = (32, 32)  # small inputs keep the CPU tests fast; the large kernels still overhang the maps
KWARGS = {"num_classes": 5}


def trained_like(name: str = "replknet_tiny", **kwargs) -> torch.nn.Module:
    """An lkcnn model in eval mode with random BN statistics, so that folding BN changes every weight."""
    return randomize_bn(timm.create_model(name, **{**KWARGS, **kwargs})).eval()


def save_lightning(path: Path, model: torch.nn.Module, ema: torch.nn.Module | None = None,
                   data: dict | None = None) -> Path:
    """Save a dict shaped like the Lightning 2.x checkpoints of lkcnn's training app (test_checkpoint runs a real
    Trainer); `data` is the run's data config."""
    state_dict = {f"model.{k}": v for k, v in model.state_dict().items()}
    if ema is not None:
        state_dict.update({f"model_ema.module.{k}": v for k, v in ema.state_dict().items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({
        "epoch": 3, "global_step": 120, "pytorch-lightning_version": "2.6.6", "state_dict": state_dict,
        "loops": {"fit_loop": {"state_dict": {}}}, "callbacks": {}, "optimizer_states": [], "lr_schedulers": [],
        "hparams_name": "kwargs", "hyper_parameters": {"model": model.lkcnn_spec},
        "lkcnn_model": model.lkcnn_spec, "hydra_config": {"model": model.lkcnn_spec, "data": data or {}},
    }, path)
    return path


def outputs(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


@pytest.fixture
def ckpt(tmp_path) -> tuple[Path, torch.nn.Module, torch.nn.Module]:
    model, ema = trained_like(), trained_like()
    return save_lightning(tmp_path / "run" / "last.ckpt", model, ema), model, ema


def test_round_trip_matches_the_original_model(ckpt, tmp_path):
    path, model, _ = ckpt
    out = tmp_path / "deployed"
    config = export_checkpoint(path, out, input_size=SIZE)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text()) == config
    assert config["model"] == {"name": "replknet_tiny", "kwargs": {**KWARGS, "deploy": True}}
    assert config["data_config"]["input_size"] == [3, *SIZE]
    assert config["data_config"]["mean"] == list(model.pretrained_cfg["mean"])  # the run's data config has none
    assert config["data_config"]["std"] == list(model.pretrained_cfg["std"])
    assert config["lkcnn_version"] == lkcnn.__version__
    assert config["weights"]["sha256"] == export._sha256(out / "model.safetensors")

    deployed = lkcnn.load_deployed(out)
    assert not deployed.training
    assert deployed.lkcnn_spec["kwargs"]["deploy"] is True
    assert not any("lkb_origin" in k for k in deployed.state_dict())
    x = torch.randn(4, 3, *SIZE)
    assert rel_err(outputs(deployed, x), outputs(model, x)) < 1e-4


@pytest.mark.parametrize("small_kernel", [0, 5])  # plain LargeKernelConv blocks / mergeable branches
def test_convnext_lk_round_trip(tmp_path, small_kernel):
    model = trained_like("convnext_lk_tiny", depths=[1, 1, 1, 1], dims=[16, 32, 64, 128], small_kernel=small_kernel,
                         ls_init_value=1.0)  # layer scale 1 so that the large kernels matter to the output
    config = export_checkpoint(save_lightning(tmp_path / "last.ckpt", model), tmp_path / "out", input_size=SIZE)
    assert config["model"]["kwargs"]["deploy"] is True
    x = torch.randn(2, 3, *SIZE)
    assert rel_err(outputs(load_deployed(tmp_path / "out"), x), outputs(model, x)) < 1e-4


def test_slak_round_trip(tmp_path):
    model = trained_like("slak_tiny", depths=[1, 1, 1, 1], dims=[16, 32, 64, 128], ls_init_value=1.0)
    config = export_checkpoint(save_lightning(tmp_path / "last.ckpt", model), tmp_path / "out", input_size=SIZE)
    assert config["model"] == {"name": "slak_tiny", "kwargs": {"depths": [1, 1, 1, 1], "dims": [16, 32, 64, 128],
                                                                "ls_init_value": 1.0, **KWARGS, "deploy": True}}
    deployed = load_deployed(tmp_path / "out")
    assert {"stages.0.blocks.0.conv_dw.LoRA1_reparam.bias", "stages.0.blocks.0.conv_dw.LoRA2_reparam.weight"} <= set(
        deployed.state_dict())
    x = torch.randn(2, 3, *SIZE)
    assert rel_err(outputs(deployed, x), outputs(model, x)) < 1e-4


def test_data_config_comes_from_the_training_run(tmp_path):
    model = trained_like()
    data = {"img_size": 24, "batch_size": 64, "transform": {"mean": [0.5] * 3, "std": [0.25] * 3, "crop_pct": 1.0,
                                                            "interpolation": "bilinear", "hflip": 0.5}}
    config = export_checkpoint(save_lightning(tmp_path / "a.ckpt", model, data=data), tmp_path / "out")
    assert config["data_config"] == {"input_size": [3, 24, 24], "mean": [0.5] * 3, "std": [0.25] * 3,
                                     "interpolation": "bilinear", "crop_pct": 1.0, "crop_mode": "center"}
    config = export_checkpoint(tmp_path / "a.ckpt", tmp_path / "out", force=True, input_size=(16, 20))
    assert config["data_config"]["input_size"] == [3, 16, 20]


def test_checkpoint_of_lkcnn_training_module_exports(tmp_path):
    """The contract with lkcnn.training: its real LightningModule, trained for two steps, exports raw and EMA (the
    conv_impl it chooses is undone by conftest's fixture)."""
    module = ClassificationModule(
        model={"name": "replknet_tiny", "num_classes": 4}, ema={"decay": 0.5}, conv_impl="torch",
        optim={"optimizer": {"opt": "adamw", "lr": 1e-2}, "scheduler": {"sched": "cosine", "warmup_epochs": 0}})
    module.hydra_config = {"data": {"img_size": 24, "transform": {"mean": [0.5] * 3, "std": [0.5] * 3}}}
    data = TensorDataset(torch.randn(4, 3, 24, 24), torch.randint(0, 4, (4,)))
    trainer = L.Trainer(max_epochs=1, default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, accelerator="cpu")
    trainer.fit(module, DataLoader(data, batch_size=2))
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    x = torch.randn(2, 3, 24, 24)
    for ema, net in ((False, module.model), (True, module.model_ema.module)):
        config = export_checkpoint(tmp_path / "last.ckpt", tmp_path / f"out{ema}", ema=ema)
        assert config["data_config"]["input_size"] == [3, 24, 24] and config["data_config"]["mean"] == [0.5] * 3
        assert rel_err(outputs(load_deployed(tmp_path / f"out{ema}"), x), outputs(net.eval(), x)) < 1e-4


def test_ema_weights_are_exported_on_request(ckpt, tmp_path):
    path, model, ema = ckpt
    export_checkpoint(path, tmp_path / "ema", ema=True, input_size=SIZE)
    x = torch.randn(2, 3, *SIZE)
    got = outputs(load_deployed(tmp_path / "ema"), x)
    assert rel_err(got, outputs(ema, x)) < 1e-4
    assert not torch.allclose(got, outputs(model, x))


@pytest.mark.parametrize("layout", ["plain", "official", "official_ema"])
def test_state_dicts_without_config_need_model_name(tmp_path, layout):
    model, ema = trained_like(), trained_like()
    content = {"plain": model.state_dict(),  # official RepLKNet trainer layout, training-form keys, argparse args
               "official": {"model": model.state_dict(), "model_ema": ema.state_dict(), "epoch": 299,
                            "args": argparse.Namespace(model="RepLKNet-31B", lr=4e-3)}}
    path = tmp_path / "weights.pth"
    torch.save(content.get(layout, content["official"]), path)
    use_ema = layout == "official_ema"
    with pytest.raises(ExportError, match="weights.pth stores no model config.*pass --model NAME"):
        export_checkpoint(path, tmp_path / "out", ema=use_ema, input_size=SIZE)
    export_checkpoint(path, tmp_path / "out", "replknet_tiny", KWARGS, ema=use_ema, input_size=SIZE)
    x = torch.randn(2, 3, *SIZE)
    assert rel_err(outputs(load_deployed(tmp_path / "out"), x), outputs(ema if use_ema else model, x)) < 1e-4


def test_checkpoint_for_another_configuration_is_refused(ckpt, tmp_path):
    path = ckpt[0]
    with pytest.raises(CheckpointError, match=r"last.ckpt does not fit model 'replknet_tiny'.*--model"):
        export_checkpoint(path, tmp_path / "out", overrides={"kernel_sizes": [13, 13, 13, 7]}, input_size=SIZE)
    with pytest.raises(ExportError, match="unknown model 'replknet_huge'"):
        export_checkpoint(path, tmp_path / "out", "replknet_huge", input_size=SIZE)
    assert not (tmp_path / "out").exists()


def test_onnx_graph_uses_standard_conv_nodes(ckpt, tmp_path):
    path, model, _ = ckpt
    config = export_checkpoint(path, tmp_path / "out", onnx=True, input_size=SIZE)
    assert config["onnx"]["file"] == "model.onnx"
    graph = onnx.load(str(tmp_path / "out" / "model.onnx"))
    onnx.checker.check_model(graph)
    nodes = list(graph.graph.node)
    assert {n.domain for n in nodes} <= {"", "ai.onnx"} and not graph.functions
    kernels = {tuple(a.ints) for n in nodes if n.op_type == "Conv" for a in n.attribute if a.name == "kernel_shape"}
    assert {(31, 31), (29, 29), (27, 27), (13, 13)} <= kernels  # the merged large kernels are plain Conv nodes
    if "onnxruntime_relative_error" in config["onnx"]:  # onnxruntime is optional
        assert config["onnx"]["onnxruntime_relative_error"] <= 1e-4
    x = torch.randn(3, 3, *SIZE)  # another batch size: the batch dimension is dynamic
    (got,) = ReferenceEvaluator(graph).run(None, {"input": x.numpy()})  # onnx's own reference runtime
    assert rel_err(torch.from_numpy(got), outputs(model, x)) < 1e-4
    export_checkpoint(path, tmp_path / "out", force=True, input_size=SIZE)  # a re-export drops the stale ONNX
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]


def test_a_forced_export_that_fails_while_moving_in_leaves_the_earlier_one(ckpt, tmp_path, monkeypatch):
    """--force replaces an earlier export all or none: a move that fails half way (a full disk, a read-only file)
    puts the earlier files back, so the folder never mixes a new config.json with old weights."""
    out = tmp_path / "out"
    export_checkpoint(ckpt[0], out, input_size=SIZE)
    (out / "notes.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    replace = os.replace

    def failing_replace(src, dst):
        if Path(dst) == out / "model.safetensors" and Path(src).parent.name != ".earlier":
            raise PermissionError(1, "Operation not permitted")
        replace(src, dst)
    monkeypatch.setattr(export.os, "replace", failing_replace)
    with pytest.raises(ExportError, match=r"could not write the export into .*Operation not permitted.*left as it was"):
        export_checkpoint(ckpt[0], out, force=True, input_size=(40, 40))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert load_deployed(out)(torch.randn(1, 3, *SIZE)).shape[0] == 1
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left beside it


def test_onnx_without_its_packages_is_refused_before_any_work(ckpt, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxscript", None)  # as if not installed
    with pytest.raises(ExportError, match=r"pip install 'lkcnn\[onnx\]'"):
        export_checkpoint(ckpt[0], tmp_path / "out", onnx=True, input_size=SIZE)
    assert not (tmp_path / "out").exists()


def test_failed_equivalence_check_writes_nothing(ckpt, tmp_path, monkeypatch):
    reparameterize = export.reparameterize_model

    def broken_reparameterize(model):  # a merge bug: the merged biases are off
        reparameterize(model)
        for name, module in model.named_modules():
            if name.endswith("lkb_reparam"):
                module.bias.data += 0.5
        return model

    monkeypatch.setattr(export, "reparameterize_model", broken_reparameterize)
    out = tmp_path / "out"
    with pytest.raises(ExportError, match="re-parameterized model differs .*Nothing was written"):
        export_checkpoint(ckpt[0], out, input_size=SIZE)
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no temporary folder left behind


def test_existing_output_is_kept_unless_forced(ckpt, tmp_path):
    path = ckpt[0]
    out = path.parent  # the run folder: it holds the user's checkpoint
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="is not empty.*--force"):
        export_checkpoint(path, out, input_size=SIZE)
    assert sorted(p.name for p in out.iterdir()) == ["last.ckpt", "notes.txt"]
    export_checkpoint(path, out, force=True, input_size=SIZE)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "last.ckpt", "model.safetensors", "notes.txt"]
    assert (out / "notes.txt").read_text() == "mine"
    load_deployed(out)
    with pytest.raises(FileExistsError, match="overwrite its own input"):  # re-exporting an export in place
        export_checkpoint(out / "model.safetensors", out, "replknet_tiny", KWARGS, force=True, input_size=SIZE)
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="not a folder"):
        export_checkpoint(path, tmp_path / "file", force=True, input_size=SIZE)


def test_load_deployed_detects_changed_weights(ckpt, tmp_path):
    out = tmp_path / "out"
    export_checkpoint(ckpt[0], out, input_size=SIZE)
    data = bytearray((out / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF  # one flipped bit pattern in the last weight
    (out / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="model.safetensors does not match the sha256.*Export the checkpoint again"):
        load_deployed(out)
    (out / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="is not an lkcnn export"):
        load_deployed(out)


def test_cli_exports_and_reports_errors_in_one_line(ckpt, tmp_path, capsys, monkeypatch):
    path = ckpt[0]
    assert main([str(path), str(tmp_path / "out"), "--set", "num_classes=5", "--input-size", *map(str, SIZE)]) == 0
    assert "exported replknet_tiny" in capsys.readouterr().out
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(SystemExit) as exit_info:
        main([str(truncated), str(tmp_path / "out2")])
    assert exit_info.value.code == 2
    assert "truncated.ckpt could not be read" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(path), str(tmp_path / "out3"), "--set", "kernel_sizes"])
    assert "--set expects key=value" in capsys.readouterr().err
    if not torch.cuda.is_available():  # LKCNN_CONV_IMPL=cuda exported where lkcnn's kernels cannot run
        monkeypatch.setenv("LKCNN_CONV_IMPL", "cuda")
        monkeypatch.setattr(dwconv, "_env_impl", dwconv.read_env())  # as a new process reads it
        with pytest.raises(SystemExit) as exit_info:
            main([str(path), str(tmp_path / "out4"), "--input-size", *map(str, SIZE)])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and "forced to cuda" in err and len(err.strip().splitlines()) == 1, err


def test_module_entry_point_fails_cleanly(tmp_path):
    result = subprocess.run([sys.executable, "-m", "lkcnn.export", str(tmp_path / "missing.ckpt"), str(tmp_path)],
                            capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert result.returncode == 2
    assert "missing.ckpt does not exist" in result.stderr
    assert "Traceback" not in result.stderr
