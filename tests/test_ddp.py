"""Multi-process training on the CPU (gloo): train.py with trainer=ddp on two processes splits the data, scales the
learning rate to the global batch and reports global throughput; a multirun launched by torchrun runs every job on
two processes; lkcnn's SyncBatchNorm reaches every BatchNorm of a RepLKNet and is BatchNorm outside distributed
training (its distributed path runs on GPUs: tests/test_sync_batchnorm_gpu.py)."""
from __future__ import annotations

import copy
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch
import torch.nn as nn
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from lightning.pytorch.strategies import DDPStrategy

import lkcnn.models  # noqa: F401  (registers lkcnn's models with timm)
from lkcnn.layers import LargeKernelConv
from lkcnn.training import ClassificationModule, SyncBatchNorm, SyncBatchNormPlugin

ROOT = Path(__file__).resolve().parents[1]
DEVICES, BATCH, NUM_TRAIN, LR, BASE_BATCH = 2, 4, 32, 2e-3, 64
# SyncBatchNorm runs on GPUs only (torch raises on CPU tensors); conf/trainer/ddp.yaml turns it on for real runs.
CPU_DDP = ["trainer=ddp", "trainer.accelerator=cpu", f"trainer.devices={DEVICES}", "trainer.precision=32-true",
           "trainer.sync_batchnorm=false", "data=synthetic", "data.img_size=16",
           "data.num_classes=4", f"data.num_train={NUM_TRAIN}", "data.num_val=8", f"data.batch_size={BATCH}",
           "data.num_workers=0", "trainer.max_epochs=1", "trainer.num_sanity_val_steps=0",
           "trainer.log_every_n_steps=1", "callbacks.progress_bar.refresh_rate=0", "model.small_kernel=3",
           f"optim.optimizer.lr={LR}", f"optim.lr_base_batch={BASE_BATCH}", "optim.scheduler.warmup_epochs=0"]


def train(*args: str, launcher: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *launcher, "train.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HYDRA_FULL_ERROR": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def lr_rows(job: Path) -> list[dict[str, str]]:
    with open(job / "csv" / "metrics.csv", newline="") as f:
        return [row for row in csv.DictReader(f) if row.get("lr-AdamW/pg1")]


def test_ddp_on_two_processes_scales_to_the_global_batch(tmp_path):
    run = tmp_path / "run"
    train(*CPU_DDP, "model.kernel_sizes=[5,3,3,3]", "callbacks=[default,kernel_timing,throughput]",
          "callbacks.kernel_timing.every_n_steps=1", "callbacks.kernel_timing.warmup_steps=0",
          "callbacks.throughput.warmup_batches=1", f"hydra.run.dir={run}")
    assert (run / "train_ddp_process_1.log").is_file()  # Lightning relaunched train.py for rank 1
    global_batch = BATCH * DEVICES
    steps = lr_rows(run)
    # each rank sees half of the data: NUM_TRAIN / global batch optimizer steps, not NUM_TRAIN / BATCH
    assert [int(r["step"]) for r in steps] == list(range(NUM_TRAIN // global_batch))
    assert float(steps[0]["lr-AdamW/pg1"]) == pytest.approx(LR * global_batch / BASE_BATCH)
    throughput = json.loads((run / "throughput.json").read_text())
    assert throughput["world_size"] == DEVICES
    assert throughput["images"] == (NUM_TRAIN // global_batch - 1) * global_batch  # every batch after the first
    with open(run / "kernel_timing.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    n_layers = sum(isinstance(m, LargeKernelConv) for m in timm.create_model(
        "replknet_tiny", kernel_sizes=[5, 3, 3, 3], small_kernel=3).modules())
    assert len(rows) == n_layers * NUM_TRAIN // global_batch  # rank 0 alone writes, once per timed step


def test_multirun_under_torchrun_trains_every_job_on_two_processes(tmp_path):
    # torchrun starts the ranks, so Lightning relaunches nothing and every rank walks the same sweep
    train("-m", *CPU_DDP, "model.kernel_sizes=[3,3,3,3],[5,3,3,3]", f"hydra.sweep.dir={tmp_path}",
          launcher=("-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={DEVICES}"))
    for job in ("0", "1"):
        steps = lr_rows(tmp_path / job)
        assert [int(r["step"]) for r in steps] == list(range(NUM_TRAIN // (BATCH * DEVICES)))
        assert float(steps[0]["lr-AdamW/pg1"]) == pytest.approx(LR * BATCH * DEVICES / BASE_BATCH)
        assert (tmp_path / job / "checkpoints" / "last.ckpt").is_file()


def test_ddp_config_syncs_batchnorm_and_every_batchnorm_converts():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=["trainer=ddp"])
    strategy = instantiate(cfg.trainer.strategy)
    assert type(strategy) is DDPStrategy and strategy._ddp_kwargs == {"broadcast_buffers": False}
    assert cfg.trainer.sync_batchnorm is True and cfg.trainer.devices == "auto"
    net = timm.create_model("replknet_tiny", kernel_sizes=[7, 5, 3, 3], small_kernel=3)
    n_bn = sum(isinstance(m, nn.BatchNorm2d) for m in net.modules())
    synced = SyncBatchNormPlugin().apply(net)  # what train.py gives Lightning for sync_batchnorm=True
    assert n_bn > 0 and sum(type(m) is SyncBatchNorm for m in synced.modules()) == n_bn
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, SyncBatchNorm)
                   for m in synced.modules())
    reverted = SyncBatchNormPlugin().revert(synced)  # Lightning reverts before saving a deployable model
    assert not any(isinstance(m, nn.SyncBatchNorm) for m in reverted.modules())
    assert sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in reverted.modules()) == n_bn


def test_sync_batchnorm_is_batchnorm_outside_distributed_training():
    """Without a process group (or in eval mode, or on the CPU) it is torch's forward: plain BatchNorm."""
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(5)
    synced = SyncBatchNormPlugin().apply(nn.Sequential(copy.deepcopy(bn)))[0]
    x = torch.randn(4, 5, 6, 6) * 3 + 1
    for mode in (True, False):
        bn.train(mode), synced.train(mode)
        torch.testing.assert_close(synced(x), bn(x))
    torch.testing.assert_close(synced.running_mean, bn.running_mean)
    assert synced.num_batches_tracked.item() == bn.num_batches_tracked.item() == 1


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_sync_batchnorm_traces_into_graph_ops(monkeypatch, layout):
    """What torch.compile sees of the synchronized path (run on GPUs by tests/test_sync_batchnorm_gpu.py), traced
    with fake tensors: the forward and backward ops with outputs shaped, typed and laid out as the real passes
    return them (so the compiled graph is laid out right), and the running statistics updated in the graph."""
    from types import SimpleNamespace

    from torch.fx.experimental.proxy_tensor import make_fx

    from lkcnn.training.sync_batchnorm import sync_batch_norm

    group = SimpleNamespace(group_name="0", size=lambda: 2)  # the two attributes a process group is asked for
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # the path dynamo takes

    def step(x, weight, bias, running_mean, running_var, dy):
        y = sync_batch_norm(x, weight, bias, running_mean, running_var, 1e-5, 0.1, group)
        return (y, *torch.autograd.grad(y, (x, weight, bias), dy))

    memory_format = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    x = torch.randn(4, 6, 5, 3, dtype=torch.bfloat16).contiguous(memory_format=memory_format).requires_grad_()
    weight, bias = torch.ones(6, requires_grad=True), torch.zeros(6, requires_grad=True)
    graph = make_fx(step, tracing_mode="fake")(x, weight, bias, torch.zeros(6), torch.ones(6), torch.randn_like(x))
    called = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert {"lkcnn.sync_batch_norm_fwd.default", "lkcnn.sync_batch_norm_bwd.default"} <= set(called), called
    assert called.count("aten.lerp_.Scalar") == 2, called  # running mean and running variance
    outs = [n.meta["val"] for n in graph.graph.find_nodes(op="output")[0].args[0]]
    assert [(o.shape, o.dtype) for o in outs] == [(x.shape, x.dtype), (x.shape, x.dtype), (weight.shape, torch.float32),
                                                  (bias.shape, torch.float32)]
    assert outs[0].is_contiguous(memory_format=memory_format) and outs[1].is_contiguous(memory_format=memory_format)


def test_ema_copy_takes_no_gradients():
    """DDP registers every parameter that requires grad; an EMA copy that did would stop DDP with unused parameters."""
    model = dict(name="replknet_tiny", num_classes=4, kernel_sizes=[3, 3, 3, 3], small_kernel=3)
    module = ClassificationModule(model, dict(optimizer=dict(opt="adamw", lr=1e-3), scheduler=dict(sched="cosine")),
                                  ema=dict(decay=0.9))
    assert not any(p.requires_grad for p in module.model_ema.parameters())
