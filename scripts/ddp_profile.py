"""Where a DDP training step of RepLKNet-31B spends its time, per BatchNorm choice: images/s over all GPUs, the
GPU-busy and host (CPU) time of a step, and the CUDA kernels that take the most time (rank 0). Plain DDP, no
Lightning, so the numbers isolate the model, the BatchNorm and the collectives from the training app.

    torchrun --standalone --nproc-per-node 2 scripts/ddp_profile.py [--batch 64] [--bn none,lkcnn,torch] \
        [--channels-last]

With one process, `--bn lkcnn` still takes lkcnn's synchronized path (a one-rank group), so its host cost shows on
a single GPU; a small --batch (8) makes the GPU wait for the host, so the step time is the host time.
"""
from __future__ import annotations

import argparse
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile

import lkcnn  # noqa: F401  registers the models
from lkcnn.training.sync_batchnorm import SyncBatchNorm, sync_batch_norm


class _AlwaysSynced(SyncBatchNorm):
    """lkcnn's SyncBatchNorm that takes the synchronized path in one process too (see the module docstring)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or dist.get_world_size() > 1:
            return super().forward(input)
        self.num_batches_tracked.add_(1)
        return sync_batch_norm(input, self.weight, self.bias, self.running_mean, self.running_var, self.eps,
                               self.momentum, dist.group.WORLD)


def build(bn: str, device: torch.device, channels_last: bool) -> torch.nn.Module:
    model = timm.create_model("replknet31b").to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    if bn != "none":
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        if bn == "lkcnn":
            for m in model.modules():
                if type(m) is torch.nn.SyncBatchNorm:
                    m.__class__ = _AlwaysSynced
    return DistributedDataParallel(model, device_ids=[device.index])


def step_fn(model, opt, x, y):
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="images per GPU")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--bn", type=lambda s: s.split(","), default=["none", "lkcnn", "torch"])
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--top", type=int, default=18, help="kernels to list")
    parser.add_argument("--top-host", type=int, default=0, help="host (CPU) ops to list")
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    x = torch.randn(args.batch, 3, 224, 224, device=device)
    if args.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (args.batch,), device=device)
    for bn in args.bn:
        model = build(bn, device, args.channels_last)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        step = step_fn(model, opt, x, y)
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / args.steps
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        if rank == 0:
            averages = prof.key_averages()
            host_ms = sum(e.self_cpu_time_total for e in averages) / 1e3 / 3
            kernels = [e for e in averages if e.device_type.name == "CUDA"]
            kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
            busy_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / 3
            nccl_ms = sum(e.self_device_time_total for e in kernels if "nccl" in e.key.lower()) / 1e3 / 3
            print(f"\n== bn={bn}: {world} GPU(s) x {args.batch}: {world * args.batch / seconds:.1f} img/s, "
                  f"step {seconds * 1e3:.1f} ms; kernels {busy_ms:.1f} ms/step (NCCL {nccl_ms:.1f}); "
                  f"host {host_ms:.1f} ms/step (profiled, both threads)")
            for e in kernels[:args.top]:
                print(f"{e.self_device_time_total / 1e3 / 3:8.2f} ms/step {e.count // 3:5d}x  {e.key[:110]}")
            for e in sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:args.top_host]:
                print(f"{e.self_cpu_time_total / 1e3 / 3:8.2f} host ms/step {e.count // 3:5d}x  {e.key[:100]}")
        del model, opt, step
        torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
