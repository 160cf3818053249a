"""lkcnn.deploy.checkpoint: weights-only reading of real Lightning checkpoints, state_dicts and official-style files, and
one clear error for every bad file."""
from __future__ import annotations

import argparse
import os

import lightning as L
import pytest
import safetensors.torch
import timm
import torch
from omegaconf import DictConfig, OmegaConf
from timm.utils import ModelEmaV3
from torch.utils.data import DataLoader, TensorDataset

import lkcnn  # noqa: F401  registers the models
from lkcnn.deploy.checkpoint import CheckpointError, load_file, load_weights, read_checkpoint

KWARGS = {"num_classes": 4}


def tiny(**kwargs) -> torch.nn.Module:
    return timm.create_model("replknet_tiny", **{**KWARGS, **kwargs})


def assert_same_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for k, v in expected.items():
        torch.testing.assert_close(actual[k], v, rtol=0, atol=0, msg=k)


class TinyModule(L.LightningModule):
    """Shaped like lkcnn's training module: the net at `model`, timm EMA at `model_ema`, Hydra config as hparams."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.save_hyperparameters(cfg)  # Hydra apps pass a DictConfig: Lightning pickles it into the checkpoint
        self.model = tiny()
        self.model_ema = ModelEmaV3(self.model, decay=0.5)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.model(x), y)

    def on_train_batch_end(self, *args) -> None:
        self.model_ema.update(self.model)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["lkcnn_model"] = self.model.lkcnn_spec
        checkpoint["hydra_config"] = self.hparams_initial


@pytest.fixture(scope="module")
def lightning_ckpt(tmp_path_factory):
    """A checkpoint written by a real lightning.Trainer (2 steps, CPU) and the module it came from."""
    root = tmp_path_factory.mktemp("lightning")
    cfg = OmegaConf.create({"model": {"name": "replknet_tiny", "num_classes": 4}, "optim": {"lr": 1e-2}})
    module = TinyModule(cfg)
    data = TensorDataset(torch.randn(4, 3, 32, 32), torch.randint(0, 4, (4,)))
    trainer = L.Trainer(max_steps=2, default_root_dir=root, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu")
    trainer.fit(module, DataLoader(data, batch_size=2))
    path = root / "last.ckpt"
    trainer.save_checkpoint(path)
    return path, module


def test_real_lightning_checkpoint_needs_and_gets_safe_loading(lightning_ckpt):
    path, module = lightning_ckpt
    with pytest.raises(Exception, match="DictConfig"):  # torch's default allowlist refuses the pickled Hydra config
        torch.load(path, weights_only=True)
    ckpt = read_checkpoint(path)
    assert ckpt.kind == "lightning"
    assert ckpt.spec == module.model.lkcnn_spec
    assert_same_weights(ckpt.state_dict, module.model.state_dict())
    ema = read_checkpoint(path, ema=True)
    assert_same_weights(ema.state_dict, module.model_ema.module.state_dict())
    assert not torch.equal(ema.state_dict["head.weight"], ckpt.state_dict["head.weight"])  # EMA lags the weights
    assert isinstance(load_file(path)["hydra_config"], DictConfig)  # the file really holds a pickled DictConfig
    assert type(ckpt.hydra_config) is dict  # a pickled DictConfig comes back as a plain dict
    assert ckpt.hydra_config == OmegaConf.to_container(module.hparams_initial)


def test_plain_wrapped_and_safetensors_files(tmp_path):
    raw, ema = tiny().state_dict(), tiny().state_dict()
    torch.save(raw, tmp_path / "plain.pth")
    torch.save({"model": raw, "model_ema": ema, "epoch": 299, "args": argparse.Namespace(model="RepLKNet-31B")},
               tmp_path / "official.pth")  # the official trainer's layout, argparse args included
    safetensors.torch.save_file(raw, tmp_path / "weights.safetensors")
    # torch's legacy format (before 1.6, and `_use_new_zipfile_serialization=False`) cannot be memory-mapped
    torch.save(raw, tmp_path / "legacy.pth", _use_new_zipfile_serialization=False)
    for name, kind in (("plain.pth", "state_dict"), ("official.pth", "wrapped"), ("weights.safetensors",
                                                                                  "state_dict"),
                       ("legacy.pth", "state_dict")):
        ckpt = read_checkpoint(tmp_path / name)
        assert (ckpt.kind, ckpt.spec) == (kind, None)
        assert_same_weights(ckpt.state_dict, raw)
    assert_same_weights(read_checkpoint(tmp_path / "official.pth", ema=True).state_dict, ema)
    torch.save({"module." + k: v for k, v in raw.items()}, tmp_path / "ddp.pth")  # DDP prefix is stripped
    assert_same_weights(read_checkpoint(tmp_path / "ddp.pth").state_dict, raw)


def test_missing_truncated_and_garbage_files(tmp_path, lightning_ckpt):
    with pytest.raises(CheckpointError, match="nope.ckpt does not exist"):
        read_checkpoint(tmp_path / "nope.ckpt")
    data = lightning_ckpt[0].read_bytes()
    # stop.ckpt: a pickle stream that ends before any value (the weights-only unpickler raises IndexError; random
    # garbage.ckpt hit that now and then)
    cases = {"truncated.ckpt": data[: len(data) // 2], "empty.ckpt": b"", "garbage.ckpt": os.urandom(2048),
             "stop.ckpt": b"\x80\x02."}
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(CheckpointError, match=rf"{name} .*(truncated|corrupt|not a readable)"):
            read_checkpoint(tmp_path / name)
    (tmp_path / "bad.safetensors").write_bytes(os.urandom(64))
    with pytest.raises(CheckpointError, match="bad.safetensors is not a readable safetensors"):
        read_checkpoint(tmp_path / "bad.safetensors")


class _Payload:
    """Unpickling this would create a folder: the loader must refuse it without running it."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_code_in_a_checkpoint_is_refused_not_run(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"state_dict": tiny().state_dict(), "extra": _Payload(str(marker))}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match=r"evil.pt contains a pickled object .*\(posix.mkdir\)"):
        read_checkpoint(tmp_path / "evil.pt")
    assert not marker.exists()


def test_files_that_are_not_state_dicts(tmp_path):
    torch.save([torch.ones(1)], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match="list.pt holds a list"):
        read_checkpoint(tmp_path / "list.pt")
    torch.save({"weight": torch.ones(1), "step": 3}, tmp_path / "mixed.pt")
    with pytest.raises(CheckpointError, match="entry 'step' is a int"):
        read_checkpoint(tmp_path / "mixed.pt")
    torch.save(tiny().state_dict(), tmp_path / "plain.pt")
    with pytest.raises(CheckpointError, match="plain.pt has no EMA weights.*drop --ema"):
        read_checkpoint(tmp_path / "plain.pt", ema=True)
    torch.save({"state_dict": {"other.w": torch.ones(1)}, "pytorch-lightning_version": "2.6.0"}, tmp_path / "l.ckpt")
    with pytest.raises(CheckpointError, match="l.ckpt has no model weights .*'model.'"):
        read_checkpoint(tmp_path / "l.ckpt")
    torch.save({"model": tiny().state_dict(), "lkcnn_model": "replknet_tiny"}, tmp_path / "spec.pt")
    with pytest.raises(CheckpointError, match="spec.pt has a malformed 'lkcnn_model' entry.*--model NAME"):
        read_checkpoint(tmp_path / "spec.pt")


@pytest.mark.parametrize("other, problem", [
    ({"kernel_sizes": (13, 13, 13, 13)}, "shape mismatches"),
    ({"depths": (1, 1, 1, 1)}, "missing keys"),
    ({"num_classes": 7}, "shape mismatches"),
])
def test_weights_for_another_model_are_refused(tmp_path, other, problem):
    torch.save(tiny(**other).state_dict(), tmp_path / "other.pth")
    model = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=rf"other.pth does not fit model 'replknet_tiny'.*{problem}.*--model"):
        load_weights(model, read_checkpoint(tmp_path / "other.pth"), "replknet_tiny")
    assert_same_weights(model.state_dict(), before)  # nothing half-loaded


def test_matching_weights_load(tmp_path):
    source = tiny()
    torch.save(source.state_dict(), tmp_path / "w.pth")
    model = tiny()
    load_weights(model, read_checkpoint(tmp_path / "w.pth"), "replknet_tiny")
    assert_same_weights(model.state_dict(), source.state_dict())
