"""All-reduce bus bandwidth between the GPUs of this machine (NCCL), for the DDP notes in docs/performance.md.

    torchrun --standalone --nproc-per-node 2 scripts/allreduce_bw.py

Sizes: the gradient buckets DDP sends (25 MB) and RepLKNet-31B's whole fp32 gradient (319 MB). Bus bandwidth as
nccl-tests defines it: bytes * 2 (n - 1) / n / time.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    for mbytes in (25, 319):
        t = torch.ones(mbytes * 2**20 // 4, device="cuda")
        for _ in range(5):
            dist.all_reduce(t)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(20):
            dist.all_reduce(t)
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / 20
        if rank == 0:
            busbw = t.numel() * 4 * 2 * (world - 1) / world / seconds / 1e9
            print(f"all_reduce {mbytes} MB x {world} GPUs: {seconds * 1e3:.2f} ms, bus bandwidth {busbw:.0f} GB/s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
