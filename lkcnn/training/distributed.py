"""Distributed training setup: the Lightning plugin that installs lkcnn's SyncBatchNorm, the choice of its exchange
(NCCL or lkcnn's NVLink kernels), and the torch.compile setting that DDP needs."""
from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from lkcnn.layers.sync_batchnorm import SyncBatchNorm
from lkcnn.ops.sync_batchnorm import enable_nvlink_exchange

# module.sync_bn_exchange: where SyncBatchNorm's statistics travel under torch.compile. auto: lkcnn's NVLink kernels
# where they apply (compiled, several GPUs of one machine), NCCL elsewhere, silently; lkcnn: the same, with a warning
# where they do not apply; torch: NCCL always.
EXCHANGES = ("auto", "lkcnn", "torch")


def use_nvlink_exchange(setting: str, *, compiled: bool, world_size: int, num_nodes: int,
                        device_type: str) -> tuple[bool, str]:
    """Whether a run sets up lkcnn's NVLink exchange, and if not, why (empty unless the config asked for it by name).

    Compiled runs only (eager SyncBatchNorm runs the C++ function on NCCL), on several GPUs of one machine; several
    machines keep NCCL.
    """
    if setting not in EXCHANGES:
        raise ValueError(f"module.sync_bn_exchange={setting!r}: use one of {', '.join(EXCHANGES)}")
    if setting == "torch":
        return False, ""
    if not compiled:
        why_not = "it serves compiled runs only: add module.compile=reduce-overhead (or true)"
    elif device_type != "cuda" or world_size < 2:
        why_not = "it needs several GPUs"
    elif num_nodes > 1:
        why_not = f"the run spans {num_nodes} machines, and NVLink joins the GPUs of one"
    else:
        return True, ""
    return False, why_not if setting == "lkcnn" else ""


def configure_sync_bn_exchange(setting: str, timeout_s: float, *, compiled: bool, world_size: int, num_nodes: int,
                               device_type: str) -> None:
    """Compiled on several GPUs of one machine (module.sync_bn_exchange auto or lkcnn), SyncBatchNorm's exchanges (two
    per layer, on the critical path of the step) go through lkcnn's NVLink kernels instead of NCCL; elsewhere, and
    with module.sync_bn_exchange=torch, they stay on NCCL."""
    wanted, why_not = use_nvlink_exchange(setting, compiled=compiled, world_size=world_size, num_nodes=num_nodes,
                                          device_type=device_type)
    if not (wanted and dist.is_initialized()):
        if why_not:
            rank_zero_warn(f"module.sync_bn_exchange=lkcnn: SyncBatchNorm stays on NCCL: {why_not}")
        return
    try:
        enable_nvlink_exchange(dist.group.WORLD, timeout_s)
    except RuntimeError as err:  # e.g. GPUs without peer access: NCCL still works
        rank_zero_warn(f"SyncBatchNorm stays on NCCL: the NVLink exchange cannot be set up ({err})")
    else:
        rank_zero_info(f"SyncBatchNorm exchanges statistics over NVLink (symmetric memory), each wait bounded by "
                       f"{timeout_s:g} s")


def compile_as_one_graph_under_ddp() -> None:
    """Under DDP, dynamo by default splits the graph at DDP's gradient buckets (DDPOptimizer) to overlap the
    all-reduce with the backward; in the split graphs BatchNorm's running-statistics updates count as mutated inputs,
    and inductor then runs them without CUDA graphs (pytorch/pytorch#139207). One graph gives up the overlap, which
    is cheap here: RepLKNet-31B's whole gradient all-reduces in ~1.1 ms on two H200s (docs/performance.md), against
    a ~60 ms step. A process-wide dynamo setting, so it is set where a compiled module is built."""
    torch._dynamo.config.optimize_ddp = False


class SyncBatchNormPlugin(TorchSyncBatchNorm):
    """Lightning's `sync_batchnorm` plugin, converting to lkcnn's SyncBatchNorm (reverting like Lightning's)."""

    def apply(self, model: nn.Module) -> nn.Module:
        model = super().apply(model)  # torch.nn.SyncBatchNorm modules with the BatchNorms' state
        for module in model.modules():
            if type(module) is nn.SyncBatchNorm:
                module.__class__ = SyncBatchNorm  # a subclass with no state of its own: only forward changes
        return model
