"""lkcnn's synchronized BatchNorm on two GPUs (two processes, NCCL) against float64 BatchNorm over the whole batch.

Each rank normalizes its half of the batch with the statistics of both halves: the outputs, the input gradient and
the running statistics must be those of BatchNorm over the whole batch, and the weight and bias gradients each
rank's share of the whole (DDP sums them). The same through lkcnn.training.SyncBatchNorm compiled with
mode="reduce-overhead" (the collectives captured into CUDA graphs), over three steps, with its all-reduce on NCCL and
on symmetric memory. Skips without two GPUs; the
one-rank cases are in test_sync_batchnorm_gpu.py.
"""
from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch._inductor.cudagraph_trees import reset_cudagraph_trees

from lkcnn.ops import build
from lkcnn.training.sync_batchnorm import (
    SyncBatchNorm,
    enable_one_shot_all_reduce,
    sync_batch_norm,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]
WORLD = 2


def _rank(rank: int, folder: str) -> None:
    """One process: its half of the batch through sync_batch_norm (or, with `steps`, the compiled module that many
    times), results saved to folder/rank<rank>.pt."""
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{folder}/store", rank=rank, world_size=WORLD,
                            device_id=device)
    try:
        inputs = torch.load(Path(folder) / "inputs.pt")
        half = inputs["x"].shape[0] // WORLD
        part = slice(rank * half, (rank + 1) * half)
        memory_format = torch.channels_last if inputs["channels_last"] else torch.contiguous_format
        x = inputs["x"][part].to(device).contiguous(memory_format=memory_format).requires_grad_()
        dy = inputs["dy"][part].to(device).contiguous(memory_format=memory_format)
        if inputs["steps"]:
            if inputs["one_shot"]:
                enable_one_shot_all_reduce(dist.group.WORLD)
            bn = SyncBatchNorm(x.shape[1]).to(device)
            with torch.no_grad():
                bn.weight.copy_(inputs["weight"]), bn.bias.copy_(inputs["bias"])
            compiled = torch.compile(bn, fullgraph=True, mode="reduce-overhead")
            for _ in range(inputs["steps"]):  # CUDA graph trees warm up, record, then replay
                bn.zero_grad(set_to_none=True)
                x.grad = None
                torch.compiler.cudagraph_mark_step_begin()
                y = compiled(x)
                y.backward(dy)
            weight, bias, running = bn.weight, bn.bias, [bn.running_mean, bn.running_var]
        else:
            weight, bias = (inputs[k].to(device).requires_grad_() for k in ("weight", "bias"))
            running = [torch.zeros(weight.shape, device=device), torch.ones(weight.shape, device=device)]
            y = sync_batch_norm(x, weight, bias, running[0], running[1], 1e-5, 0.1, dist.group.WORLD)
            y.backward(dy)
        torch.save({"y": y.detach().cpu(), "grad_x": x.grad.cpu(), "grad_w": weight.grad.cpu(),
                    "grad_b": bias.grad.cpu(), "running_mean": running[0].cpu(), "running_var": running[1].cpu()},
                   Path(folder) / f"rank{rank}.pt")
    finally:
        # CUDA graphs that captured NCCL collectives must go before the process group (pytorch/pytorch#115388)
        reset_cudagraph_trees()
        dist.destroy_process_group()


@pytest.mark.parametrize("dtype,channels_last,steps,one_shot", [
    (torch.float32, False, 0, False), (torch.float32, True, 0, False), (torch.bfloat16, False, 0, False),
    (torch.bfloat16, True, 0, False), (torch.float32, False, 3, False), (torch.bfloat16, True, 3, False),
    (torch.float32, True, 3, True), (torch.bfloat16, False, 3, True)],
    ids=["float32-nchw", "float32-channels_last", "bfloat16-nchw", "bfloat16-channels_last",
         "float32-nchw-compiled", "bfloat16-channels_last-compiled", "float32-channels_last-compiled-one-shot",
         "bfloat16-nchw-compiled-one-shot"])
def test_two_ranks_match_batchnorm(tmp_path, dtype, channels_last, steps, one_shot):
    build.load()  # build once here, not in both processes at once
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    n, c, h, w = 8, 24, 9, 7
    x = (torch.randn(n, c, h, w, generator=gen) * 2 + 0.5).to(dtype)
    dy = torch.randn(n, c, h, w, generator=gen).to(dtype)
    weight, bias = torch.randn(c, generator=gen) + 1, torch.randn(c, generator=gen)
    torch.save({"x": x, "dy": dy, "weight": weight, "bias": bias, "channels_last": channels_last,
                "steps": steps, "one_shot": one_shot},
               tmp_path / "inputs.pt")
    processes = mp.spawn(_rank, args=(str(tmp_path),), nprocs=WORLD, join=False)
    deadline = time.monotonic() + 300  # a rank that hangs in a collective fails the test instead of the session
    while not processes.join(timeout=5):
        if time.monotonic() > deadline:
            for process in processes.processes:
                process.kill()
            pytest.fail(f"the two ranks did not finish within 300 s (seed={seed})")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]

    x64, w64, b64 = (t.double().requires_grad_() for t in (x, weight, bias))
    running64 = [torch.zeros(c, dtype=torch.float64), torch.ones(c, dtype=torch.float64)]
    for _ in range(max(steps, 1)):  # the running statistics move at every step
        x64.grad = w64.grad = b64.grad = None
        y64 = F.batch_norm(x64, *running64, w64, b64, training=True, momentum=0.1, eps=1e-5)
        y64.backward(dy.double())

    tol = 1e-4 if dtype == torch.float32 else 2e-2
    what = f"seed={seed} {dtype} channels_last={channels_last} steps={steps} one_shot={one_shot}"
    checks = [("out", torch.cat([r["y"] for r in ranks]), y64),
              ("grad_x", torch.cat([r["grad_x"] for r in ranks]), x64.grad),
              ("grad_w (sum over ranks)", sum(r["grad_w"] for r in ranks), w64.grad),
              ("grad_b (sum over ranks)", sum(r["grad_b"] for r in ranks), b64.grad)]
    for r in ranks:  # every rank's running statistics are the global ones
        checks += [("running_mean", r["running_mean"], running64[0]), ("running_var", r["running_var"], running64[1])]
    for name, got, ref in checks:
        err = ((got.double() - ref).norm() / ref.norm()).item()
        assert err <= tol, f"{name}: relative error {err:.1e} ({what})"
