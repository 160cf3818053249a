"""All-reduce bus bandwidth and small-message latency between the GPUs of this machine (NCCL), for the DDP notes in
docs/performance.md.

    torchrun --standalone --nproc-per-node 2 scripts/allreduce_bw.py

Sizes: the gradient buckets DDP sends (25 MB) and RepLKNet-31B's whole fp32 gradient (319 MB). Bus bandwidth as
nccl-tests defines it: bytes * 2 (n - 1) / n / time. Latency: 8 KB, the size of one SyncBatchNorm's statistics
at 1024 channels, as 100 back-to-back all-reduces launched from Python and captured in one CUDA graph (as a compiled
step runs them), through NCCL, torch's symmetric-memory one-shot all-reduce and lkcnn's NVLink exchange
(csrc/sync_bn/sync_exchange.cu); the graph's time per all-reduce is the floor of what each synchronized BatchNorm adds to a
step, forward and backward each.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

from lkcnn import timing
from lkcnn.ops.sync_batchnorm import all_reduce_sum, enable_nvlink_exchange


def main() -> None:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    for mbytes in (25, 319):
        t = torch.ones(mbytes * 2**20 // 4, device="cuda")
        seconds = timing.mean_ms(lambda: dist.all_reduce(t), reps=20, warmup=5) / 1e3
        if rank == 0:
            busbw = t.numel() * 4 * 2 * (world - 1) / world / seconds / 1e9
            print(f"all_reduce {mbytes} MB x {world} GPUs: {seconds * 1e3:.2f} ms, bus bandwidth {busbw:.0f} GB/s")
    small = torch.ones(2048, device="cuda")
    _latency("NCCL", lambda: dist.all_reduce(small), rank, world)
    try:  # torch's one-shot all-reduce over symmetric memory: peers read each other's buffers over NVLink
        buffer = symm_mem.empty(2048, device="cuda").fill_(1)
        symm_mem.rendezvous(buffer, dist.group.WORLD.group_name)
        _latency("symmetric memory one-shot",
                 lambda: torch.ops.symm_mem.one_shot_all_reduce(buffer, "sum", dist.group.WORLD.group_name), rank,
                 world)
    except (RuntimeError, AttributeError) as e:  # a diagnostic script: say why and go on
        print(f"symmetric memory one-shot all-reduce: unavailable ({type(e).__name__}: {e})")
    try:  # lkcnn's: each rank pushes its values into the others' workspaces and polls its own until theirs arrive
        enable_nvlink_exchange(dist.group.WORLD)  # all_reduce_sum then runs it
        _latency("lkcnn NVLink exchange", lambda: all_reduce_sum(small, dist.group.WORLD.group_name), rank, world)
    except RuntimeError as e:
        print(f"lkcnn NVLink exchange: unavailable ({e})")
    dist.destroy_process_group()


def _latency(name: str, all_reduce, rank: int, world: int) -> None:
    """Microseconds per all-reduce of 100 back-to-back ones, launched from Python and replayed from a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # collectives must have run once on a side stream before capture
        for _ in range(3):
            all_reduce()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(100):
            all_reduce()
    for how, step in (("eager", lambda: [all_reduce() for _ in range(100)]), ("CUDA graph", graph.replay)):
        us = timing.mean_ms(step, reps=10, warmup=1) * 1e3 / 100  # a step is 100 all-reduces
        if rank == 0:
            print(f"all_reduce 8 KB x {world} GPUs, {name}, {how}: {us:.1f} us each")
    del graph  # a graph that captured NCCL collectives must go before the process group (pytorch/pytorch#115388)


if __name__ == "__main__":
    main()
