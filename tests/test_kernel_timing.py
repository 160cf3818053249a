"""Kernel timing callback: on a tiny RepLKNet trained for a few CPU steps, the per-layer table (CSV, JSON, logger
scalars, TensorBoard text) has one row per large-kernel conv and per block's branch call per timed step with the
layer's real kernel size,
input shape, dtype and implementation; the timer brackets the layer; no hook outlives a timed batch; a fit that
timed too few steps for a mean says so."""
from __future__ import annotations

import csv
import json
import random
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lkcnn.layers import BranchConvs, LargeKernelConv
from lkcnn.training import ClassificationModule, SyntheticDataModule
from lkcnn.training.callbacks.kernel_timing import COLUMNS, MIN_SAMPLES, TIMED, KernelTimingCallback

BATCH = 4
SLEEP_S = 0.05


def hook_count(module: torch.nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._backward_pre_hooks) + len(m._backward_hooks)
               for m in module.modules() if isinstance(m, TIMED))


class HookProbe(L.Callback):
    """Runs after the timing callback: how many hooks the large-kernel convs carry at each batch start and end."""

    def __init__(self) -> None:
        self.at_start: dict[int, int] = {}
        self.at_end: dict[int, int] = {}
        self.after_fit = -1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.at_start[trainer.global_step] = hook_count(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.at_end[trainer.global_step - 1] = hook_count(pl_module)

    def on_fit_end(self, trainer, pl_module):
        self.after_fit = hook_count(pl_module)


def tiny_module(kernel_sizes: list[int]) -> ClassificationModule:
    model = dict(name="replknet_tiny", num_classes=4, kernel_sizes=kernel_sizes, small_kernel=3)
    optim = dict(optimizer=dict(opt="adamw", lr=1e-3), scheduler=dict(sched="cosine", warmup_epochs=0))
    return ClassificationModule(model, optim, conv_impl="auto", ema=dict(decay=0.9))


def expected_inputs(module: ClassificationModule, img_size: int) -> dict[str, str]:
    """Input shape of every timed layer of the trained network (not the EMA copy) for a training batch."""
    shapes, handles = {}, []
    for name, m in module.named_modules():
        if isinstance(m, TIMED) and name.startswith("model."):
            handles.append(m.register_forward_pre_hook(
                lambda mod, args, name=name: shapes.__setitem__(name, "x".join(map(str, args[0].shape)))))
    with torch.no_grad():
        module.model(torch.randn(BATCH, 3, img_size, img_size))
    for h in handles:
        h.remove()
    return shapes


@pytest.fixture(scope="module")
def timed_run(tmp_path_factory):
    """Four training steps with every_n_steps=2 (steps 0 and 2 timed) and one layer slowed by a sleep."""
    tmp = tmp_path_factory.mktemp("timing")
    kernel_sizes = random.sample([3, 5, 7, 9], 4)
    img_size = 16
    module = tiny_module(kernel_sizes)
    slow_name, slow = next((n, m) for n, m in module.named_modules() if isinstance(m, LargeKernelConv))
    # the sleep is inside the module's forward, so it lies between the timing pre-hook and post-hook
    slow.forward = lambda x, layer=slow: (time.sleep(SLEEP_S), LargeKernelConv.forward(layer, x))[1]
    data = SyntheticDataModule(num_train=4 * BATCH, num_val=BATCH, num_classes=4, img_size=img_size,
                               batch_size=BATCH, num_workers=0)
    timing, probe = KernelTimingCallback(every_n_steps=2, warmup_steps=0, dirpath=str(tmp / "run")), HookProbe()
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, max_steps=4, limit_val_batches=0, num_sanity_val_steps=0,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        log_every_n_steps=1, default_root_dir=tmp, callbacks=[timing, probe],
                        logger=[CSVLogger(tmp, name="csv", version=""),
                                TensorBoardLogger(tmp, name="tb", version="")])
    trainer.fit(module, datamodule=data)
    with open(tmp / "run" / "kernel_timing.csv", newline="") as f:
        reader = csv.DictReader(f)
        header, rows = reader.fieldnames, list(reader)
    return dict(tmp=tmp, module=module, probe=probe, header=header, rows=rows, slow=slow_name,
                inputs=expected_inputs(module, img_size))


def test_table_has_one_row_per_layer_and_timed_step_with_its_real_shape(timed_run):
    module, rows = timed_run["module"], timed_run["rows"]
    assert timed_run["header"] == list(COLUMNS)
    layers = {n: m for n, m in module.named_modules() if isinstance(m, TIMED) and n.startswith("model.")}
    branches = [n for n, m in layers.items() if isinstance(m, BranchConvs)]
    assert len(layers) >= 8 and len(branches) == len(layers) // 2  # a 3x3 branch beside every large kernel
    assert sorted((int(r["step"]), r["layer"]) for r in rows) == sorted((s, n) for s in (0, 2) for n in layers)
    for row in rows:
        layer = layers[row["layer"]]
        size = "3x3" if isinstance(layer, BranchConvs) else f"{layer.kernel_size[0]}x{layer.kernel_size[1]}"
        assert row["kernel_size"] == size
        assert row["input_shape"] == timed_run["inputs"][row["layer"]]
        assert row["dtype"] == "float32" and row["implementation"] == "torch"  # CPU: PyTorch's convolution
        assert float(row["fwd_ms"]) > 0 and float(row["bwd_ms"]) > 0


def test_timer_brackets_the_layer(timed_run):
    slow = [float(r["fwd_ms"]) for r in timed_run["rows"] if r["layer"] == timed_run["slow"]]
    assert len(slow) == 2 and min(slow) >= SLEEP_S * 1e3


def test_json_holds_the_same_table(timed_run):
    result = json.loads((timed_run["tmp"] / "run" / "kernel_timing.json").read_text())
    assert result["device"] == "cpu" and result["timer"] == "wall clock" and result["columns"] == list(COLUMNS)
    assert (result["every_n_steps"], result["warmup_steps"]) == (2, 0)  # the settings behind the sample count
    as_text = [{k: "" if v is None else str(v) for k, v in row.items()} for row in result["rows"]]
    assert as_text == timed_run["rows"]


def test_hooks_exist_only_during_timed_batches(timed_run):
    probe = timed_run["probe"]
    assert probe.at_start[0] > 0 and probe.at_start[2] > 0  # installed for the timed steps...
    assert probe.at_start[1] == 0 and probe.at_start[3] == 0  # ...not for the others
    assert set(probe.at_end.values()) == {0} and len(probe.at_end) == 4  # removed before any other batch starts
    assert probe.after_fit == 0


def test_scalars_reach_the_csv_logger(timed_run):
    with open(timed_run["tmp"] / "csv" / "metrics.csv", newline="") as f:
        logged = [r for r in csv.DictReader(f) if r.get("kernel_ms/total/fwd")]
    assert [int(r["step"]) for r in logged] == [0, 2]
    for step_row in logged:
        rows = [r for r in timed_run["rows"] if int(r["step"]) == int(step_row["step"])]
        for row in rows:
            assert float(step_row[f"kernel_ms/{row['layer']}/fwd"]) == pytest.approx(float(row["fwd_ms"]))
            assert float(step_row[f"kernel_ms/{row['layer']}/bwd"]) == pytest.approx(float(row["bwd_ms"]))
        assert float(step_row["kernel_ms/total/fwd"]) == pytest.approx(sum(float(r["fwd_ms"]) for r in rows))


def test_table_reaches_tensorboard_as_text(timed_run):
    events = EventAccumulator(str(timed_run["tmp"] / "tb"), size_guidance={"tensors": 0})
    events.Reload()
    texts = events.Tensors("kernel_timing/text_summary")
    assert [t.step for t in texts] == [0, 2]
    table = texts[0].tensor_proto.string_val[0].decode()
    assert table.startswith("| " + " | ".join(COLUMNS))
    assert all(r["layer"] in table for r in timed_run["rows"])


@pytest.mark.parametrize("kwargs", [dict(every_n_steps=0), dict(warmup_steps=-1)])
def test_bad_settings_say_what_to_fix(kwargs):
    with pytest.raises(ValueError, match="callbacks.kernel_timing"):
        KernelTimingCallback(**kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_timings_use_cuda_events(tmp_path: Path):
    module = tiny_module([13, 9, 7, 5])
    data = SyntheticDataModule(num_train=2 * BATCH, num_val=BATCH, num_classes=4, img_size=32, batch_size=BATCH,
                               num_workers=0)
    timing = KernelTimingCallback(every_n_steps=1, warmup_steps=1, dirpath=str(tmp_path))
    trainer = L.Trainer(accelerator="gpu", devices=1, max_epochs=1, max_steps=2, limit_val_batches=0,
                        num_sanity_val_steps=0, enable_checkpointing=False, enable_progress_bar=False, logger=False,
                        callbacks=[timing], default_root_dir=tmp_path)
    trainer.fit(module, datamodule=data)
    result = json.loads((tmp_path / "kernel_timing.json").read_text())
    assert result["timer"] == "cuda events" and result["device"] != "cpu"
    assert {r["step"] for r in result["rows"]} == {1}
    assert all(r["fwd_ms"] > 0 and r["bwd_ms"] > 0 for r in result["rows"])
    assert hook_count(module) == 0


def test_a_model_without_large_kernel_convs_gets_a_warning_not_a_table(tmp_path, caplog):
    model = dict(name="resnet10t", num_classes=4)  # a timm model: no LargeKernelConv to time
    optim = dict(optimizer=dict(opt="adamw", lr=1e-3), scheduler=dict(sched="cosine", warmup_epochs=0))
    module = ClassificationModule(model, optim, ema=None)
    data = SyntheticDataModule(num_train=2 * BATCH, num_val=BATCH, num_classes=4, img_size=16, batch_size=BATCH,
                               num_workers=0)
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[KernelTimingCallback(every_n_steps=1, warmup_steps=0, dirpath=str(tmp_path))])
    with caplog.at_level("WARNING", logger="lkcnn.training.callbacks.kernel_timing"):
        trainer.fit(module, datamodule=data)
    assert sum("no LargeKernelConv ran" in r.message for r in caplog.records) == 1  # once, not per timed step
    assert not (tmp_path / "kernel_timing.csv").exists()


@pytest.mark.parametrize("steps", [MIN_SAMPLES - 1, MIN_SAMPLES])
def test_too_few_timed_steps_for_a_mean_get_a_warning(steps, tmp_path, caplog):
    data = SyntheticDataModule(num_train=steps * BATCH, num_val=BATCH, num_classes=4, img_size=16, batch_size=BATCH,
                               num_workers=0)
    timing = KernelTimingCallback(every_n_steps=1, warmup_steps=0, dirpath=str(tmp_path))  # every step: `steps` samples
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[timing])
    with caplog.at_level("WARNING", logger="lkcnn.training.callbacks.kernel_timing"):
        trainer.fit(tiny_module([3, 3, 3, 3]), datamodule=data)
    assert len({row["step"] for row in timing.rows}) == steps
    warned = [r.message for r in caplog.records if "too few for a mean" in r.message]
    assert len(warned) == (steps < MIN_SAMPLES)
    assert all("callbacks.kernel_timing.every_n_steps" in message for message in warned)
