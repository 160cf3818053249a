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
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from lightning.pytorch.strategies import DDPStrategy

import lkcnn.models  # noqa: F401  (registers lkcnn's models with timm)
from lkcnn.layers.sync_batchnorm import SyncBatchNorm
from lkcnn.training import ClassificationModule, SyncBatchNormPlugin
from lkcnn.training.callbacks.kernel_timing import TIMED

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
    n_layers = sum(isinstance(m, TIMED) for m in timm.create_model(
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
    assert type(strategy) is DDPStrategy
    assert strategy._ddp_kwargs == {"broadcast_buffers": False, "gradient_as_bucket_view": True}
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


def _fake_group_with_exchange(monkeypatch, max_channels: int | None = 16384):
    """A stand-in for a two-rank process group named "0" (what the traced path asks it), and, unless max_channels is
    None, the NVLink exchange registered for it as enable_nvlink_exchange would (nothing here runs its kernels)."""
    from types import SimpleNamespace

    from lkcnn.ops import sync_batchnorm

    if max_channels is not None:
        monkeypatch.setitem(sync_batchnorm._exchanges, "0",
                            sync_batchnorm._Exchange(torch.empty(0), [0, 0], 0, max_channels, 32768,
                                                     torch.zeros(1, dtype=torch.int64), 60.0))
    return SimpleNamespace(group_name="0", size=lambda: 2, rank=lambda: 0)


@pytest.mark.parametrize("exchange", ["none", "nvlink", "nvlink-too-many-channels"])
def test_compiled_sync_batchnorm_traces_to_fusable_ops_around_one_exchange_each_way(monkeypatch, exchange):
    """What torch.compile sees of the synchronized path, traced with fake tensors: plain tensor ops (which inductor
    fuses with the neighbouring layers) around one exchange in the forward and lkcnn::all_reduce_sum in the
    backward, and a channels_last output for a channels_last input. The forward's exchange is lkcnn::all_reduce_sum
    with the running statistics updated in the graph, or, once the NVLink exchange is set up (for layers within its
    kernel's channel limit), the one op lkcnn::exchange_batch_norm_stats that also updates them. The backward
    reduces over the batch just twice (sum dy and sum dy * x_hat, which inductor fuses into one pass), as
    BatchNorm's own backward does, not the five sums (and two means) of autograd through var_mean."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from lkcnn.ops.sync_batchnorm import sync_batch_norm

    group = _fake_group_with_exchange(
        monkeypatch, {"none": None, "nvlink": 16384, "nvlink-too-many-channels": 5}[exchange])
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # the path dynamo takes
    fused = exchange == "nvlink"

    def step(x, weight, bias, running_mean, running_var, dy):
        y = sync_batch_norm(x, weight, bias, running_mean, running_var, 1e-5, 0.1, group)
        return (y, *torch.autograd.grad(y, (x, weight, bias), dy))

    x = torch.randn(4, 6, 5, 3, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last).requires_grad_()
    weight, bias = torch.ones(6, requires_grad=True), torch.zeros(6, requires_grad=True)
    graph = make_fx(step, tracing_mode="fake")(x, weight, bias, torch.zeros(6), torch.ones(6), torch.randn_like(x))
    called = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert called.count("lkcnn.exchange_batch_norm_stats.default") == fused, called
    assert called.count("lkcnn.all_reduce_sum.default") == 2 - fused, called
    assert called.count("aten.lerp_.Scalar") == 2 * (not fused), called  # running mean and running variance
    assert called.count("aten.sum.dim_IntList") == 2, called
    y = graph.graph.find_nodes(op="output")[0].args[0][0].meta["val"]
    assert y.dtype == x.dtype and y.is_contiguous(memory_format=torch.channels_last)


def test_compiled_sync_batchnorm_saves_no_float32_activation_for_backward(monkeypatch):
    """What AOT autograd's partitioner keeps from a compiled bf16 forward through the synchronized path for the
    backward: bfloat16 activations, as with plain BatchNorm, not a float32 x - mean or x_hat per BatchNorm. That copy
    cost one more pass per layer, ~3 ms per RepLKNet-31B step on 2x H200 (docs/training_multigpu.md). The
    layers are RepLKNet's patterns: BatchNorm before a convolution, and after one followed by GELU, by a residual
    addition and by ReLU."""
    from types import SimpleNamespace

    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from lkcnn.ops import sync_batchnorm

    group = _fake_group_with_exchange(monkeypatch)

    def exchange(mean, var, running_mean, running_var, mean_out, invstd_out, momentum, eps, *_):  # one rank's
        mean_out.copy_(mean), invstd_out.copy_(torch.rsqrt(var + eps))

    monkeypatch.setattr(sync_batchnorm.build, "load", lambda: SimpleNamespace(exchange_batch_norm_stats=exchange))

    def bn(channels: int) -> nn.Module:
        module = nn.BatchNorm2d(channels)
        module.forward = lambda x: sync_batchnorm.traceable_sync_batch_norm(
            x, module.weight, module.bias, module.running_mean, module.running_var, 1e-5, 0.1, group)
        return module

    conv = lambda cin, cout: nn.Conv2d(cin, cout, 1, bias=False)
    pre, pw1, bn1, pw2, bn2, pw3, bn3 = bn(16), conv(16, 64), bn(64), conv(64, 16), bn(16), conv(16, 16), bn(16)

    def block(x):
        x = x + bn2(pw2(F.gelu(bn1(pw1(pre(x))))))
        return torch.relu(bn3(pw3(x)))

    saved = []

    def forward_compiler(graph, _):  # the forward's outputs: the block's, then what the backward gets
        outputs = graph.graph.find_nodes(op="output")[0].args[0]
        saved.extend(n.meta["val"] for n in outputs[1:] if isinstance(n, torch.fx.Node) and n.op != "placeholder")
        return graph

    compiled = torch.compile(block, backend=lambda gm, inputs: aot_module_simplified(  # partitioned as inductor does
        gm, inputs, fw_compiler=forward_compiler, bw_compiler=lambda graph, _: graph,
        partition_fn=min_cut_rematerialization_partition))
    x = torch.randn(4, 16, 12, 12).contiguous(memory_format=torch.channels_last).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        compiled(x)
    activations = [t for t in saved if t.dim() == 4 and t.shape[0] == 4]
    assert len(activations) >= 5, saved  # the convolutions' outputs at least
    assert [(t.shape, t.dtype) for t in activations if t.dtype != torch.bfloat16] == []


def test_nvlink_statistics_exchange_without_setup_says_what_to_do():
    from lkcnn.ops.sync_batchnorm import exchange_batch_norm_stats

    stats = torch.zeros(4)
    with pytest.raises(RuntimeError, match="call enable_nvlink_exchange on group 7"):
        exchange_batch_norm_stats(stats, stats, stats.clone(), stats.clone(), 0.1, 1e-5, 8, "7")


def _traceable_rank(rank: int, folder: str, compiled: str) -> None:
    """One gloo rank: its half of the batch through traceable_sync_batch_norm (compiled or not), saved to a file."""
    import torch.distributed as dist

    from lkcnn.ops.sync_batchnorm import traceable_sync_batch_norm

    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
    try:
        inputs = torch.load(Path(folder) / "inputs.pt")
        half = slice(rank * 4, rank * 4 + 4)
        x = inputs["x"][half].contiguous(memory_format=torch.channels_last).requires_grad_()
        weight, bias = (None if inputs[k] is None else inputs[k].clone().requires_grad_() for k in ("weight", "bias"))
        running = [inputs["running_mean"].clone(), torch.ones(x.shape[1])]
        fn = traceable_sync_batch_norm if compiled == "eager" else \
            torch.compile(traceable_sync_batch_norm, backend=compiled, fullgraph=True)
        y = fn(x, weight, bias, *running, 1e-5, 0.1, dist.group.WORLD)
        y.backward(inputs["dy"][half])
        torch.save({"y": y.detach(), "grad_x": x.grad, "grad_w": None if weight is None else weight.grad,
                    "grad_b": None if bias is None else bias.grad,
                    "running": running, "channels_last": y.is_contiguous(memory_format=torch.channels_last)},
                   Path(folder) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("compiled,offset,affine", [
    (compiled, offset, True) for compiled in ("eager", "aot_eager", "inductor") for offset in (0.5, 1000.0)]
    + [("eager", 0.5, False), ("inductor", 0.5, False)])
def test_traceable_sync_batchnorm_on_two_ranks_is_batchnorm_of_the_whole_batch(tmp_path, compiled, offset, affine):
    """The path torch.compile takes (its all-reduce on gloo here): each rank's half of the batch normalized with the
    statistics of both halves gives BatchNorm of the whole batch, the input gradient included; weight and bias
    gradients are each rank's share (DDP sums them); every rank's running statistics are the whole batch's. With
    activations far from zero (offset 1000) and a running mean that has followed them, the variance must keep its
    precision in float32. Without weight and bias too (affine=False)."""
    import torch.multiprocessing as mp

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 6, 5, 3, generator=gen) * 2 + offset
    dy, weight, bias = torch.randn(8, 6, 5, 3, generator=gen), torch.rand(6, generator=gen) + 0.5, torch.randn(6)
    running_mean = torch.full((6,), offset) + torch.randn(6, generator=gen)  # near the batch mean, as in training
    if not affine:
        weight = bias = None
    torch.save({"x": x, "dy": dy, "weight": weight, "bias": bias, "running_mean": running_mean},
               tmp_path / "inputs.pt")
    mp.spawn(_traceable_rank, args=(str(tmp_path), compiled), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    x64, w64, b64 = (None if t is None else t.double().requires_grad_() for t in (x, weight, bias))
    running64 = [running_mean.double(), torch.ones(6, dtype=torch.float64)]
    y64 = F.batch_norm(x64, *running64, w64, b64, training=True, momentum=0.1, eps=1e-5)
    y64.backward(dy.double())
    close = {"rtol": 1e-4, "atol": 1e-4}
    torch.testing.assert_close(torch.cat([r["y"] for r in ranks]).double(), y64.detach(), **close)
    torch.testing.assert_close(torch.cat([r["grad_x"] for r in ranks]).double(), x64.grad, **close)
    if affine:
        torch.testing.assert_close(sum(r["grad_w"] for r in ranks).double(), w64.grad, **close)
        torch.testing.assert_close(sum(r["grad_b"] for r in ranks).double(), b64.grad, **close)
    for r in ranks:
        assert r["channels_last"]
        torch.testing.assert_close([t.double() for t in r["running"]], running64, **close)


def _nvlink_setup_rank(rank: int, folder: str) -> None:
    """One gloo rank setting up the NVLink exchange, where rank 1 cannot allocate its workspace; the outcome saved."""
    from types import SimpleNamespace

    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    from lkcnn.ops import sync_batchnorm

    def empty(*args, **kwargs):
        if rank == 1:
            raise RuntimeError("CUDA out of memory")
        return torch.zeros(4)

    symm_mem.empty = empty
    sync_batchnorm.build.load = lambda: SimpleNamespace(  # (no GPU here)
        exchange_workspace_bytes=lambda world: 4, exchange_status_word=lambda: torch.zeros(1, dtype=torch.int64))
    torch.cuda.current_device, torch.cuda.synchronize = (lambda: 0), (lambda: None)
    symm_mem.rendezvous = lambda *args: (Path(folder) / f"rendezvous{rank}").touch()  # would wait for rank 1
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
    try:
        sync_batchnorm.enable_nvlink_exchange(dist.group.WORLD)
        outcome = "set up"
    except RuntimeError as err:
        outcome = str(err)
    finally:
        dist.destroy_process_group()
    (Path(folder) / f"rank{rank}.txt").write_text(outcome)


def test_nvlink_setup_fails_on_every_rank_when_one_rank_fails(tmp_path):
    """Symmetric memory's rendezvous is a collective: a rank that went on to it while another had failed to allocate
    its workspace would wait forever. Every rank must raise instead (and so stay on NCCL), saying which rank failed."""
    import torch.multiprocessing as mp

    mp.spawn(_nvlink_setup_rank, args=(str(tmp_path),), nprocs=2, join=True)
    for rank in range(2):
        assert (tmp_path / f"rank{rank}.txt").read_text() == "rank 1: CUDA out of memory"
    assert not list(tmp_path.glob("rendezvous*"))


def test_ema_copy_takes_no_gradients():
    """DDP registers every parameter that requires grad; an EMA copy that did would stop DDP with unused parameters."""
    model = dict(name="replknet_tiny", num_classes=4, kernel_sizes=[3, 3, 3, 3], small_kernel=3)
    module = ClassificationModule(model, dict(optimizer=dict(opt="adamw", lr=1e-3), scheduler=dict(sched="cosine")),
                                  ema=dict(decay=0.9))
    assert not any(p.requires_grad for p in module.model_ema.parameters())
