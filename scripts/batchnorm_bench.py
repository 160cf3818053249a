"""Forward + backward time of one BatchNorm layer: cuDNN's (unsynchronized training) vs lkcnn's SyncBatchNorm
function (PyTorch's synchronized-BatchNorm kernels; a one-rank NCCL group, so the collectives are nearly free), bf16,
at RepLKNet-31B's stage shapes: the numbers behind the Multi-GPU section of docs/performance.md.

    python scripts/batchnorm_bench.py [--channels-last]
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lkcnn.training.sync_batchnorm import _SyncBatchNormFn

SHAPES = [(64, 128, 56, 56), (64, 256, 28, 28), (64, 512, 14, 14), (64, 1024, 7, 7)]


def cuda_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--channels-last", action="store_true")
    args = parser.parse_args()
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    for shape in SHAPES:
        c = shape[1]
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=fmt).requires_grad_()
        grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=fmt)
        w = torch.ones(c, device="cuda", requires_grad=True)
        b = torch.zeros(c, device="cuda", requires_grad=True)
        mean, var = torch.zeros(c, device="cuda"), torch.ones(c, device="cuda")

        def cudnn():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                F.batch_norm(x, mean, var, w, b, True, 0.1, 1e-5).backward(grad)

        def synced():
            _SyncBatchNormFn.apply(x, w, b, mean, var, 1e-5, 0.1, dist.group.WORLD, 1).backward(grad)

        print(f"{shape}: cuDNN BatchNorm {cuda_ms(cudnn):.3f} ms, synchronized {cuda_ms(synced):.3f} ms (fwd+bwd)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
