"""End-to-end training-step throughput (bf16 autocast, AdamW) on one GPU, lkcnn's kernels vs PyTorch's convolution
vs the same net with 3x3 kernels, and against other timm networks (e.g. convnext_base): the numbers behind
docs/performance.md's end-to-end table. (The Hydra/Lightning route is `python train.py model=replknet31b
data=synthetic ...`; this script needs neither.)

    python scripts/e2e_throughput.py [--models replknet31b,convnext_base] [--batch 64] [--steps 20] [--channels-last]
                                     [--compile] [--repeat 3]
    python scripts/e2e_throughput.py --profile --runs cuda,torch3 --steps 5 [--channels-last]   # GPU time per kernel
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time

import timm
import torch
import torch.nn.functional as F

from lkcnn.models import NO_SMALL_KERNEL, list_models  # importing lkcnn registers the models
from lkcnn.ops import set_conv_impl


def setup(name: str, impl: str, batch: int, channels_last: bool, compile: bool, cuda_graph: bool = False,
          **model_kwargs):
    """(train step, its state) for one variant: network `name`, AdamW, synthetic batch, bf16 autocast. With
    cuda_graph, the whole step (forward, backward, optimizer) is captured once and each step replays it: no host
    time per step, so the GPU's own time per step is what is measured."""
    set_conv_impl(impl)
    model = timm.create_model(name, **model_kwargs).cuda()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    if compile:
        model.compile()  # as the training app's `compile=true` does; the warm-up steps absorb the compilation
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05, fused=True, capturable=cuda_graph)
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device="cuda")

    def step() -> None:
        # autocast's weight-cast cache must be off under capture (cached casts would outlive the graph's pool)
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=not cuda_graph):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    if not cuda_graph:
        return step, (model, opt, x, y)
    side = torch.cuda.Stream()  # warm-up on a side stream, as torch.cuda.graph requires
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        step()
    return graph.replay, (model, opt, x, y, graph)


def images_per_s(name: str, impl: str, batch: int, steps: int, warmup: int, channels_last: bool, compile: bool,
                 cuda_graph: bool = False, **model_kwargs) -> float:
    step, state = setup(name, impl, batch, channels_last, compile, cuda_graph, **model_kwargs)
    for i in range(warmup + steps):
        if i == warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        step()
    torch.cuda.synchronize()
    images_per_s = batch * steps / (time.perf_counter() - start)
    # hand this variant's memory back: a variant run after PyTorch's large-kernel convolution (large workspaces)
    # measured 22% slower on its fragmented cache than in a fresh process
    del step, state
    torch.cuda.empty_cache()
    return images_per_s


def kernel_profile(name: str, impl: str, batch: int, steps: int, warmup: int, channels_last: bool, compile: bool,
                   cuda_graph: bool = False, top: int = 30, **model_kwargs) -> str:
    """Where a variant's step time goes: GPU time per kernel over `steps` steps (torch.profiler, busiest first), and
    the GPU's busy time per step against the wall time per step (a gap is host time the GPU waits for)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    step, state = setup(name, impl, batch, channels_last, compile, cuda_graph, **model_kwargs)
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3 / steps
    events = prof.key_averages()
    # kernels only: operator rows carry their kernels' time too
    busy_ms = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / 1e3 / steps
    del step, state
    torch.cuda.empty_cache()
    table = events.table(sort_by="self_device_time_total", row_limit=top, max_name_column_width=70)
    return f"{table}\nper step: wall {wall_ms:.1f} ms, GPU busy {busy_ms:.1f} ms (kernels, summed)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=lambda s: s.split(","), default=["replknet31b"],
                        help="comma list of timm names; lkcnn's models run each of --runs, others run once")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (use --warmup 3 or more)")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of all variants; medians are printed")
    parser.add_argument("--json", default="")
    parser.add_argument("--runs", type=lambda s: s.split(","), default=["cuda", "auto", "torch", "cuda3", "torch3"],
                        help="comma list of cuda,auto,torch,cuda3,torch3 (default all)")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="capture each variant's whole training step in a CUDA graph and replay it (GPU time only)")
    parser.add_argument("--profile", action="store_true",
                        help="instead of throughput: GPU time per kernel of each --runs variant over --steps steps")
    args = parser.parse_args()
    common = dict(batch=args.batch, steps=args.steps, warmup=args.warmup, channels_last=args.channels_last,
                  compile=args.compile, cuda_graph=args.cuda_graph)
    small = dict(kernel_sizes=3, small_kernel=NO_SMALL_KERNEL)
    variants = {  # key: (label, conv implementation, model keywords)
        "cuda": ("lkcnn kernels, every depthwise conv", "cuda", {}),
        # the default dispatch: large kernels on lkcnn, small ones (under AUTO_MIN_KERNEL) on cuDNN
        "auto": ("lkcnn 'auto' (small kernels on cuDNN)", "auto", {}),
        "torch": ("PyTorch conv", "torch", {}),
        "cuda3": ("lkcnn kernels, 3x3, no small branch", "cuda", small),
        "torch3": ("PyTorch conv, 3x3, no small branch", "torch", small),
    }
    unknown = set(args.runs) - set(variants)
    if unknown:
        parser.error(f"--runs: unknown {sorted(unknown)}; choose from {','.join(variants)}")
    missing = [m for m in args.models if not timm.is_model(m)]
    if missing:
        parser.error(f"--models: {missing} are not timm model names")
    lkcnn_models = set(list_models())
    jobs = {}  # label: (model, implementation, keywords)
    for model in args.models:
        if model not in lkcnn_models:  # a peer network: PyTorch's convolutions, one run
            jobs[f"{model} (timm)"] = (model, "torch", {})
            continue
        for k in args.runs:
            if k.endswith("3") and not model.startswith("replknet"):  # the 3x3 variant takes RepLKNet's keywords
                continue
            label, impl, kwargs = variants[k]
            jobs[f"{model}: {label}"] = (model, impl, kwargs)
    if args.profile:
        for label, (model, impl, kwargs) in jobs.items():
            print(f"== {label}")
            print(kernel_profile(model, impl, **common, **kwargs))
        return
    # rounds of all variants in turn: single runs of one variant spread by 20% and more between calls, so a ratio
    # is read from medians of interleaved runs
    samples: dict[str, list[float]] = {label: [] for label in jobs}
    for _ in range(args.repeat):
        for label, (model, impl, kwargs) in jobs.items():
            samples[label].append(images_per_s(model, impl, **common, **kwargs))
    runs = {name: statistics.median(values) for name, values in samples.items()}
    mode = ("compiled, " if args.compile else "") + ("channels_last, " if args.channels_last else "") + (
        "CUDA graph, " if args.cuda_graph else "")
    print(f"batch {args.batch}, 224px, bf16 autocast, AdamW, {mode}{torch.cuda.get_device_name()}")
    first = next(iter(runs.values()))
    for name, ips in runs.items():
        each = f"  (runs: {', '.join(f'{v:.1f}' for v in samples[name])})" if args.repeat > 1 else ""
        print(f"{name:56s} {ips:8.1f} img/s  {ips / first:5.2f}x{each}")
    if args.json:
        from lkcnn.bench import SCHEMA, environment

        rows = [{"network": jobs[label][0], "variant": label.split(": ", 1)[-1], "images_per_s": ips,
                 "ratio_to_first": ips / first, "runs": samples[label]} for label, ips in runs.items()]
        record = {"schema": SCHEMA, "kind": "train_e2e", "environment": environment(torch.device("cuda")),
                  "command": shlex.join(["python", "scripts/e2e_throughput.py", *sys.argv[1:]]),
                  "method": {"timer": "time.perf_counter over --steps after --warmup, CUDA synchronized",
                             "units": "training images/s (forward, backward, AdamW step)", "batch": args.batch,
                             "regime": mode.rstrip(", ") or "eager", "dtype": "bf16 autocast"},
                  "rows": rows}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
