"""lkcnn's synchronized BatchNorm on two GPUs (two processes, NCCL) against float64 BatchNorm over the whole batch.

Each rank normalizes its half of the batch with the statistics of both halves: the outputs, the input gradient and
the running statistics must be those of BatchNorm over the whole batch, and the weight and bias gradients each
rank's share of the whole (DDP sums them). The same through lkcnn.layers.sync_batchnorm.SyncBatchNorm compiled with
mode="reduce-overhead" (the collectives captured into CUDA graphs), over three steps, with its exchanges on NCCL and
on lkcnn's NVLink kernels; and those kernels alone, call after call, against float64. And faults in training
through the NVLink exchange under DDP: a rank killed, a rank raising out-of-memory, a rank skipping one exchange; the
other rank must end with the clear ExchangeError, within the exchange's limit (plus the watchdog's grace where its
host blocks in NCCL), never hang. Skips without two GPUs; the one-rank cases are in test_sync_batchnorm_gpu.py.
"""
from __future__ import annotations

import os
import random
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch._inductor.cudagraph_trees import reset_cudagraph_trees

from lkcnn.layers.sync_batchnorm import SyncBatchNorm
from lkcnn.ops import build, sync_batchnorm
from lkcnn.ops.sync_batchnorm import (
    ExchangeError,
    check_nvlink_exchange,
    enable_nvlink_exchange,
    sync_batch_norm,
    traceable_sync_batch_norm,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]
WORLD = 2
COUNT = 2 * 37  # samples per channel over both ranks in the kernel test


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
            if inputs["nvlink"]:
                enable_nvlink_exchange(dist.group.WORLD)
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


def _spawn(fn, folder: Path, what: str) -> list[dict]:
    """fn(rank, folder) on WORLD processes; what each saved to folder/rank<rank>.pt. A rank that hangs in a collective
    fails the test (after 300 s) instead of the session."""
    processes = mp.spawn(fn, args=(str(folder),), nprocs=WORLD, join=False)
    deadline = time.monotonic() + 300
    while not processes.join(timeout=5):
        if time.monotonic() > deadline:
            for process in processes.processes:
                process.kill()
            pytest.fail(f"the two ranks did not finish within 300 s ({what})")
    return [torch.load(folder / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.parametrize("dtype,channels_last,steps,nvlink", [
    (torch.float32, False, 0, False), (torch.float32, True, 0, False), (torch.bfloat16, False, 0, False),
    (torch.bfloat16, True, 0, False), (torch.float32, False, 3, False), (torch.bfloat16, True, 3, False),
    (torch.float32, True, 3, True), (torch.bfloat16, False, 3, True)],
    ids=["float32-nchw", "float32-channels_last", "bfloat16-nchw", "bfloat16-channels_last",
         "float32-nchw-compiled", "bfloat16-channels_last-compiled", "float32-channels_last-compiled-nvlink",
         "bfloat16-nchw-compiled-nvlink"])
def test_two_ranks_match_batchnorm(tmp_path, dtype, channels_last, steps, nvlink):
    build.load()  # build once here, not in both processes at once
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    n, c, h, w = 8, 24, 9, 7
    x = (torch.randn(n, c, h, w, generator=gen) * 2 + 0.5).to(dtype)
    dy = torch.randn(n, c, h, w, generator=gen).to(dtype)
    weight, bias = torch.randn(c, generator=gen) + 1, torch.randn(c, generator=gen)
    torch.save({"x": x, "dy": dy, "weight": weight, "bias": bias, "channels_last": channels_last,
                "steps": steps, "nvlink": nvlink},
               tmp_path / "inputs.pt")
    ranks = _spawn(_rank, tmp_path, f"seed={seed}")

    x64, w64, b64 = (t.double().requires_grad_() for t in (x, weight, bias))
    running64 = [torch.zeros(c, dtype=torch.float64), torch.ones(c, dtype=torch.float64)]
    for _ in range(max(steps, 1)):  # the running statistics move at every step
        x64.grad = w64.grad = b64.grad = None
        y64 = F.batch_norm(x64, *running64, w64, b64, training=True, momentum=0.1, eps=1e-5)
        y64.backward(dy.double())

    tol = 1e-4 if dtype == torch.float32 else 2e-2
    what = f"seed={seed} {dtype} channels_last={channels_last} steps={steps} nvlink={nvlink}"
    checks = [("out", torch.cat([r["y"] for r in ranks]), y64),
              ("grad_x", torch.cat([r["grad_x"] for r in ranks]), x64.grad),
              ("grad_w (sum over ranks)", sum(r["grad_w"] for r in ranks), w64.grad),
              ("grad_b (sum over ranks)", sum(r["grad_b"] for r in ranks), b64.grad)]
    for r in ranks:  # every rank's running statistics are the global ones
        checks += [("running_mean", r["running_mean"], running64[0]), ("running_var", r["running_var"], running64[1])]
    for name, got, ref in checks:
        err = ((got.double() - ref).norm() / ref.norm()).item()
        assert err <= tol, f"{name}: relative error {err:.1e} ({what})"


def _exchange_rank(rank: int, folder: str) -> None:
    """One process: a random sequence of NVLink exchange calls of every size class (eager, then replayed from a CUDA
    graph), each against float64 of every rank's inputs (which both ranks draw from one seed); errors and outputs
    saved to folder/rank<rank>.pt."""
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{folder}/store", rank=rank, world_size=WORLD,
                            device_id=device)
    try:
        enable_nvlink_exchange(dist.group.WORLD)
        ext, exchange = build.load(), sync_batchnorm._exchanges[dist.group.WORLD.group_name]
        peers = (exchange.peers, exchange.rank, exchange.status.data_ptr(), exchange.timeout_s)
        gen = torch.Generator().manual_seed(torch.load(Path(folder) / "inputs.pt")["seed"])
        max_values, max_channels = ext.exchange_max_values(), ext.exchange_max_channels()
        # one and several blocks, partial blocks, the largest sizes; in a shuffled order, three times over, so that
        # blocks are reused across calls of other sizes and both halves of the workspace
        calls = [("sum", n) for n in (1, 48, 512, 513, 8192, max_values)]
        calls += [("stats", c) for c in (1, 24, 256, 257, 4096, max_channels)]
        order = [calls[i] for _ in range(3) for i in torch.randperm(len(calls), generator=gen).tolist()]
        errors, outputs = [], []

        def draw(kind, size):
            """Every rank's inputs (float32, CPU) and their float64 reference results."""
            if kind == "sum":
                values = torch.randn(WORLD, size, generator=gen) * 10
                return (values,), (values.double().sum(0),)
            means = torch.randn(WORLD, size, generator=gen) * 3 + 0.5
            variances = torch.rand(WORLD, size, generator=gen) * 4 + 0.1
            running = [torch.randn(size, generator=gen), torch.rand(size, generator=gen) + 0.5]
            m64 = means.double().mean(0)
            v64 = (variances.double() + (means.double() - m64).square()).mean(0)
            refs = (m64, (v64 + 1e-5).rsqrt(), running[0].double().lerp(m64, 0.1),
                    running[1].double().lerp(v64 * COUNT / (COUNT - 1), 0.1))
            return (means, variances, *running), refs

        def launch(kind, ins, outs):
            if kind == "sum":
                ext.exchange_sum(ins[0], outs[0], *peers)
            else:
                ext.exchange_batch_norm_stats(ins[0], ins[1], outs[2], outs[3], outs[0], outs[1], 0.1, 1e-5, COUNT,
                                              *peers)

        def staged(kind, cpu_ins, outs):
            """This rank's inputs on the GPU; outputs poisoned, running statistics (in/out) set to their start."""
            ins = [t[rank].to(device) for t in cpu_ins[:2 if kind == "stats" else 1]]
            for out in outs[:2 if kind == "stats" else 1]:
                out.fill_(float("nan"))
            for out, start in zip(outs[2:], cpu_ins[2:]):
                out.copy_(start)
            return ins

        def record(label, outs, refs):
            for i, (got, ref) in enumerate(zip(outs, refs)):
                errors.append((f"{label} output {i}", ((got.double().cpu() - ref).norm() / ref.norm()).item()))
                outputs.append(got.cpu())

        for step, (kind, size) in enumerate(order):
            cpu_ins, refs = draw(kind, size)
            outs = [torch.empty(size, device=device) for _ in refs]
            launch(kind, staged(kind, cpu_ins, outs), outs)
            record(f"call {step} ({kind} of {size})", outs, refs)

        # replayed from a CUDA graph, as reduce-overhead runs them: the call counters advance on the GPU
        graph_calls = [("stats", 300), ("sum", 1000), ("stats", 4096)]
        static = []
        for kind, size in graph_calls:
            cpu_ins, refs = draw(kind, size)
            outs = [torch.empty(size, device=device) for _ in refs]
            static.append((staged(kind, cpu_ins, outs), outs))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for (kind, _), (ins, outs) in zip(graph_calls, static):
                launch(kind, ins, outs)
        for replay in range(3):
            all_refs = []
            for (kind, size), (ins, outs) in zip(graph_calls, static):
                cpu_ins, refs = draw(kind, size)
                for dst, src in zip(ins, staged(kind, cpu_ins, outs)):
                    dst.copy_(src)
                all_refs.append(refs)
            graph.replay()
            for (kind, size), (_, outs), refs in zip(graph_calls, static, all_refs):
                record(f"graph replay {replay} ({kind} of {size})", outs, refs)
        torch.save({"errors": errors, "outputs": outputs}, Path(folder) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_nvlink_exchange_kernels_match_float64(tmp_path):
    build.load()
    seed = random.randrange(2**31)
    torch.save({"seed": seed}, tmp_path / "inputs.pt")
    ranks = _spawn(_exchange_rank, tmp_path, f"seed={seed}")
    for r in ranks:
        for label, err in r["errors"]:
            assert err <= 1e-5, f"{label}: relative error {err:.1e} (seed={seed})"
    assert len(ranks[0]["outputs"]) == len(ranks[1]["outputs"]) > 0
    for a, b in zip(ranks[0]["outputs"], ranks[1]["outputs"]):  # every rank gets the same numbers, bit for bit
        assert torch.equal(a, b), f"the ranks' results differ (seed={seed})"


# The fault tests: the exchange's limit, the watchdog's grace (shortened in the ranks), the step at which rank 1 fails
LIMIT_S, GRACE_S, FAULT_STEP, STEPS = 3.0, 4.0, 3, 8


class _SyncedBN(nn.BatchNorm2d):
    """BatchNorm2d through the compiled path's ops, run eagerly (no compile time in the test): the exchanges are the
    NVLink kernels. `skip` makes one forward normalize with local statistics instead, leaving out its exchange."""
    skip = False

    def forward(self, x):
        if self.skip:
            return super().forward(x)
        return traceable_sync_batch_norm(x, self.weight, self.bias, self.running_mean, self.running_var, self.eps,
                                         self.momentum, dist.group.WORLD)


def _fault_rank(rank: int, folder: str, fault: str) -> None:
    """One DDP rank training a small network whose BatchNorms (16 and 32 channels) exchange over NVLink; rank 1 fails
    at FAULT_STEP as `fault` says (writing the time first). Rank 0 writes the ExchangeError's message to
    rank0.error and leaves at once (the NCCL teardown would wait for the dead rank); its stderr goes to rank0.err,
    where the watchdog writes instead if the host blocks first."""
    folder = Path(folder)
    err = os.open(folder / f"rank{rank}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(err, 2)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    sync_batchnorm._WATCHDOG_GRACE_S = GRACE_S
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{folder}/store", rank=rank, world_size=WORLD,
                            device_id=device)
    enable_nvlink_exchange(dist.group.WORLD, LIMIT_S)
    bn1 = _SyncedBN(16)
    net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), bn1, nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1),
                        _SyncedBN(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 4)).to(device)
    model = nn.parallel.DistributedDataParallel(net, device_ids=[rank], broadcast_buffers=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 3, 12, 12, device=device), torch.randint(0, 4, (8,), device=device)
    try:
        for step in range(STEPS):
            if rank == 1 and step == FAULT_STEP:
                (folder / "fault_time").write_text(repr(time.time()))
                if fault == "killed":
                    os.kill(os.getpid(), signal.SIGKILL)
                if fault == "oom":
                    raise torch.cuda.OutOfMemoryError("CUDA out of memory (raised by the test)")
                bn1.skip = True  # "skip": this step leaves out bn1's exchanges
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            bn1.skip = False
            check_nvlink_exchange()  # as ClassificationModule.on_train_batch_end does
        torch.cuda.synchronize()
        check_nvlink_exchange()
        (folder / f"rank{rank}.done").touch()
    except ExchangeError as error:
        (folder / f"rank{rank}.error").write_text(str(error))
        os._exit(3)
    dist.destroy_process_group()


@pytest.mark.parametrize("fault", ["killed", "oom", "skip"])
def test_the_other_rank_fails_with_the_clear_error_within_the_limit(tmp_path, fault):
    """Killed or out of memory, rank 1 never sends again: rank 0's exchange gives up after LIMIT_S and rank 0 ends
    with the error naming rank 1 (raised after its step, or from the watchdog once its host blocks in the DDP
    all-reduce that waits for rank 1 too). Skipping one exchange, rank 1 makes another one at the same call: both
    ranks fail at once, long before the limit."""
    import multiprocessing

    build.load()  # build once here, not in both processes at once
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=_fault_rank, args=(r, str(tmp_path), fault)) for r in range(WORLD)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + 300  # the first steps load the extension; the bound that matters is below
    while processes[0].is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    ended, hung = time.time(), processes[0].is_alive()
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join()
    assert (tmp_path / "fault_time").is_file(), "rank 1 did not reach the fault step"
    assert not hung, f"rank 0 did not end within 300 s ({fault})"
    assert processes[0].exitcode != 0 and not (tmp_path / "rank0.done").exists(), "rank 0 trained on"
    error_file = tmp_path / "rank0.error"
    message = error_file.read_text() if error_file.exists() else (tmp_path / "rank0.err").read_text()
    assert "SyncBatchNorm's NVLink exchange" in message and "Set module.sync_bn_exchange=torch" in message, message
    assert "failed on rank 0: rank 1 " in message, message
    seconds = ended - float((tmp_path / "fault_time").read_text())
    if fault == "skip":
        assert "made another exchange" in message or "gave up on an exchange of its own" in message, message
        assert seconds < LIMIT_S + GRACE_S, seconds
    else:
        assert f"did not answer within {LIMIT_S:g} s" in message, message
        # rank 0 may begin its wait a little before rank 1's host notes the time; +10: a step, the process's exit
        assert LIMIT_S - 0.5 <= seconds < LIMIT_S + GRACE_S + 10, seconds
