"""Where a DDP training step of RepLKNet-31B spends its time, per BatchNorm choice: images/s over all GPUs, the
GPU-busy and host (CPU) time of a step, and the CUDA kernels that take the most time (rank 0). Plain DDP, no
Lightning, so the numbers isolate the model, the BatchNorm and the collectives from the training app.

    torchrun --standalone --nproc-per-node 2 scripts/ddp_profile.py [--batch 64] [--bn none,lkcnn,torch] \
        [--channels-last] [--compile reduce-overhead [--nvlink]] [--ddp default,bucket400,bf16] [--json FILE] \
        [--trace DIR]

With --compile the network is compiled in place before DDP wraps it, as the training app does (one graph:
module.py turns off dynamo's DDP graph splitting), and lkcnn's SyncBatchNorm runs as traced tensor ops around
its exchange ops; --nvlink sends those through lkcnn's NVLink kernels as the app does on one machine.
Each rank reports its GPU timeline per step: the span, the time no kernel ran, and its time in collective
kernels, which includes waiting for the other ranks at each synchronized BatchNorm, so the two ranks' figures show
the skew between them. --ddp compares DDP's settings on the same compiled network; --json keeps rank 0's whole
kernel table, to compare runs kernel by kernel.

One process runs the network without DDP, as the training app's single-GPU run does: the baseline of the scaling.

With one process, `--bn lkcnn` still takes lkcnn's synchronized path (a one-rank group), so its host cost shows on
a single GPU; a small --batch (8) makes the GPU wait for the host, so the step time is the host time.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile

import lkcnn  # noqa: F401  registers the models
from lkcnn import timing
from lkcnn.bench.profile import gpu_timeline, kernel_table, per_step
from lkcnn.compile import compile_model
from lkcnn.layers.sync_batchnorm import SyncBatchNorm
from lkcnn.ops.sync_batchnorm import enable_nvlink_exchange, sync_batch_norm


class _AlwaysSynced(SyncBatchNorm):
    """lkcnn's SyncBatchNorm that takes the synchronized path in one process too (see the module docstring)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or dist.get_world_size() > 1:
            return super().forward(input)
        self.num_batches_tracked.add_(1)
        return sync_batch_norm(input, self.weight, self.bias, self.running_mean, self.running_var, self.eps,
                               self.momentum, dist.group.WORLD)


def build(bn: str, device: torch.device, channels_last: bool, compile_mode: str | None) -> torch.nn.Module:
    model = timm.create_model("replknet31b").to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    if bn != "none":
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        if bn == "lkcnn":
            for m in model.modules():
                if type(m) is torch.nn.SyncBatchNorm:
                    m.__class__ = _AlwaysSynced
    if compile_mode:
        torch._dynamo.config.optimize_ddp = False  # as lkcnn.training.module
        compile_model(model, compile_mode)
    return model


# DDP's settings to compare on one compiled network (DDP wraps it outside the compiled graphs, so no recompile):
# trainer=ddp's (25 MB buckets, no buffer broadcast), the whole gradient in one bucket, and gradients all-reduced in
# bfloat16 (torch's bf16_compress_hook).
DDP_VARIANTS = {"default": ({}, None), "bucket400": ({"bucket_cap_mb": 400}, None),
                "bf16": ({}, default_hooks.bf16_compress_hook)}  # name -> (DDP's arguments, communication hook)


def wrap(model: torch.nn.Module, variant: str, device: torch.device) -> torch.nn.Module:
    """The network as the training step runs it: DDP with `variant`'s settings, or itself in one process (as the
    app's single-GPU strategy)."""
    if dist.get_world_size() == 1:
        return model
    kwargs, hook = DDP_VARIANTS[variant]
    ddp = DistributedDataParallel(model, device_ids=[device.index], broadcast_buffers=False, **kwargs)
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    return ddp


def _kernel_ms(kernels, *names: str) -> float:
    """Device ms per profiled step (3 steps) of the kernels whose name contains any of `names`."""
    return sum(e.self_device_time_total for e in kernels if any(n in e.key.lower() for n in names)) / 1e3 / 3


def step_fn(model, opt, x, y):
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def report(name: str, images_per_s: float, seconds: float, gathered, kernels, averages, args) -> None:
    host_ms = sum(e.self_cpu_time_total for e in averages) / 1e3 / 3
    busy_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / 3
    print(f"\n== {name} x {args.batch}: {images_per_s:.1f} img/s, step {seconds * 1e3:.1f} ms; kernels "
          f"{busy_ms:.1f} ms/step; host {host_ms:.1f} ms/step (profiled, both threads)")
    for r, (nccl_ms, t) in enumerate(gathered):
        print(f"   rank {r}: GPU span {t['span_ms']:.1f} ms/step, busy {t['busy_ms']:.1f}, idle "
              f"{t['idle_ms']:.1f}, {t['kernels']:.0f} kernels; NCCL {nccl_ms:.2f} ms; {t['exchanges']:.0f} NVLink "
              f"exchanges {t['exchange_ms']:.2f} ms (us p10 {t['exchange_p10_us']:.1f} p50 "
              f"{t['exchange_p50_us']:.1f} p90 {t['exchange_p90_us']:.1f} max {t['exchange_max_us']:.0f})")
    for e in kernels[:args.top]:
        print(f"{e.self_device_time_total / 1e3 / 3:8.2f} ms/step {e.count // 3:5d}x  {e.key[:110]}")
    for e in sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:args.top_host]:
        print(f"{e.self_cpu_time_total / 1e3 / 3:8.2f} host ms/step {e.count // 3:5d}x  {e.key[:100]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="images per GPU")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--bn", type=lambda s: s.split(","), default=["none", "lkcnn", "torch"])
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--top", type=int, default=18, help="kernels to list")
    parser.add_argument("--top-host", type=int, default=0, help="host (CPU) ops to list")
    parser.add_argument("--compile", default=None, help="torch.compile mode, e.g. reduce-overhead")
    parser.add_argument("--nvlink", action="store_true", help="SyncBatchNorm's exchanges on lkcnn's NVLink kernels")
    parser.add_argument("--ddp", type=lambda s: s.split(","), default=["default"],
                        help=f"DDP settings to compare, of {','.join(DDP_VARIANTS)} (several GPUs only)")
    parser.add_argument("--json", default=None, help="write the results and rank 0's kernel table to this file")
    parser.add_argument("--trace", default=None, help="write each rank's Chrome trace (gzipped) into this folder")
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    if args.nvlink:
        enable_nvlink_exchange(dist.group.WORLD)
    x = torch.randn(args.batch, 3, 224, 224, device=device)
    if args.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (args.batch,), device=device)
    results = {}
    for bn in args.bn:
        compiled = build(bn, device, args.channels_last, args.compile)
        for variant in args.ddp if world > 1 else ["single"]:
            name = f"{world}gpu-{bn}-{variant}"
            model = wrap(compiled, variant, device)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            step = step_fn(model, opt, x, y)
            if rank == 0:  # compiling a synchronized network takes minutes: say so, so that the wait is no hang
                print(f"[{name}] 5 warm-up steps (compile, CUDA graph capture) ...", flush=True)
            warmup = time.perf_counter()
            for _ in range(5):
                step()
            torch.cuda.synchronize()
            if rank == 0:
                print(f"[{name}] warm-up took {time.perf_counter() - warmup:.0f} s", flush=True)
            dist.barrier()
            seconds = timing.mean_ms(step, args.steps, device=device, wall=True) / 1e3
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
            if args.trace:
                os.makedirs(args.trace, exist_ok=True)
                prof.export_chrome_trace(os.path.join(args.trace, f"{name}_rank{rank}.json.gz"))  # gzipped by name
            averages = prof.key_averages()
            kernels = kernel_table(averages)
            gathered = [None] * world  # each rank's NCCL ms per step and GPU timeline
            dist.all_gather_object(gathered, (_kernel_ms(kernels, "nccl"), gpu_timeline(prof)))
            if rank == 0:
                report(name, world * args.batch / seconds, seconds, gathered, kernels, averages, args)
                results[name] = {"images_per_s": world * args.batch / seconds, "step_ms": seconds * 1e3,
                                 "ranks": [{"nccl_ms": n, **t} for n, t in gathered],
                                 "kernels": per_step(kernels)}
                if args.json:  # after each variant, so that a run stopped later keeps what it measured
                    with open(args.json, "w") as f:
                        json.dump(results, f, indent=1)
            del model, opt, step
            gc.collect()  # the DDP wrapper's reducer, so that its gradient hooks go before the next variant's
        del compiled
        if args.compile:  # CUDA graphs holding collectives hang the process group's destruction (module.py)
            from torch._inductor.cudagraph_trees import reset_cudagraph_trees

            reset_cudagraph_trees()
        torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
