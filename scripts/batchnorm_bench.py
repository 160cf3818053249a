"""What one training-mode BatchNorm layer costs, forward + backward, bf16: host time (a small input, so the GPU never
limits the loop) and GPU time (RepLKNet-31B's stage shapes, CUDA events), for BatchNorm2d, torch.nn.SyncBatchNorm
and lkcnn's SyncBatchNorm, plus the host time of the bare collectives they issue. The numbers behind the
Multi-GPU section of docs/performance.md. Run with 2+ processes (with one, the synchronized modules fall back to
plain BatchNorm):

    torchrun --standalone --nproc-per-node 2 scripts/batchnorm_bench.py [--channels-last]
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

from lkcnn import timing
from lkcnn.layers.sync_batchnorm import SyncBatchNorm

SHAPES = [(64, 128, 56, 56), (64, 256, 28, 28), (64, 512, 14, 14), (64, 1024, 7, 7)]
HOST_SHAPE = (2, 256, 4, 4)


def modules(c: int) -> dict[str, nn.Module]:
    torch_sync = nn.SyncBatchNorm(c)
    lkcnn_sync = nn.SyncBatchNorm(c)
    lkcnn_sync.__class__ = SyncBatchNorm  # what SyncBatchNormPlugin does
    return {"BatchNorm2d": nn.BatchNorm2d(c), "torch SyncBatchNorm": torch_sync, "lkcnn SyncBatchNorm": lkcnn_sync}


def per_call_ms(fn, reps: int, events: bool) -> float:
    """Mean ms per call after 5 warm-up calls, the ranks started together: CUDA events (GPU time) or the host clock
    with one synchronization at the end (host time, as long as the GPU keeps up)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    return timing.mean_ms(fn, reps, wall=not events)


def layer_step(module: nn.Module, x: torch.Tensor, grad: torch.Tensor):
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            module(x).backward(grad)
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--channels-last", action="store_true")
    args = parser.parse_args()
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"{world} processes, bf16, {'channels_last' if args.channels_last else 'NCHW'}, per layer, forward + backward")

    results: dict[str, list[str]] = {}
    for shape in [HOST_SHAPE, *SHAPES]:
        host = shape == HOST_SHAPE
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=fmt).requires_grad_()
        grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=fmt)
        for name, module in modules(shape[1]).items():
            ms = per_call_ms(layer_step(module.cuda().train(), x, grad), 200 if host else 30, events=not host)
            results.setdefault(name, []).append(f"{ms * 1e3:7.0f} us" if host else f"{ms:6.3f} ms")
    say(f"{'':22s} {'host ' + str(HOST_SHAPE):>18s}" + "".join(f"{str(s):>20s}" for s in SHAPES))
    for name, cells in results.items():
        say(f"{name:22s} {cells[0]:>18s}" + "".join(f"{c:>20s}" for c in cells[1:]))

    small = torch.zeros(2 * 256, device="cuda")
    gathered = torch.empty(world * small.numel(), device="cuda")
    for name, fn in {"all_gather_into_tensor": lambda: dist.all_gather_into_tensor(gathered, small),
                     "all_reduce": lambda: dist.all_reduce(small)}.items():
        say(f"{name} of {small.numel()} floats: host {per_call_ms(fn, 500, events=False) * 1e3:.0f} us per call")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
