"""`python -m lkcnn.bench rates`: where a compiled training step's Triton kernels stand against the GPU's copy rate.
Each kernel's bytes, counted in the output code that inductor generated for this very step (`lkcnn.bench.codegen`'s
count: its pointer arguments' whole buffers once), over its GPU time inside the step (torch.profiler), the kernels
that lose the most time against the copy rate first:

    python -m lkcnn.bench rates --models unireplknet_b [--runs auto] [--top 30] [--inductor K=V,...] [--json FILE]

Why: the fused normalization kernels of RepLKNet and UniRepLKNet move ~1.2x their floor's bytes and take 2-3x its
time (docs/performance.md, Open 5), so what is left is their rate, kernel by kernel. Inductor's own report
(`TORCHINDUCTOR_PROFILE=1`) times each kernel alone with the L2 cache flushed, which does not rank them inside the
step. One network at a time, compiled as `lkcnn.bench e2e --compile` compiles it (reduce-overhead, lkcnn's settings
and the network's, channels_last, bf16 autocast, AdamW, batch 64).
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from lkcnn.bench.codegen import family, kernel_bytes
from lkcnn.bench.e2e import COMPILE_MODE, VARIANTS, check_models, copy_bandwidth_gbps, jobs, release, setup
from lkcnn.bench.profile import per_step, profile_kernels
from lkcnn.bench.record import command_line, make_record, write_record
from lkcnn.compile import parse_settings


def step_bytes(codes: Sequence[str]) -> Counter:
    """Bytes per training step of each Triton kernel, by name, over the output codes of the step's graphs (each graph
    runs once a step). A name in several graphs (each graph numbers its kernels from 0) sums, as the profiler's
    average by name does."""
    total: Counter = Counter()
    for code in codes:
        for kernel, nbytes in kernel_bytes(code):
            total[kernel] += nbytes
    return total


def launch_configs(modules: Sequence[Any]) -> dict[str, str]:
    """The launch configuration each Triton kernel of inductor's loaded output-code `modules` runs with, by name
    (block sizes and warps): its heuristic's one pick, or the one autotuning chose among several."""
    configs = {}
    for module in modules:
        for name, kernel in vars(module).items():
            launchers = getattr(kernel, "launchers", None)  # a compiled kernel (CachingAutotuner) once it has run
            if isinstance(launchers, list) and len(launchers) == 1:
                config = launchers[0].config
                configs[name] = " ".join([*(f"{k}={v}" for k, v in config.kwargs.items()), f"warps={config.num_warps}"])
    return configs


def _rate(ms: float, gb: float, copy_gbps: float) -> dict[str, float]:
    """TB/s, and the ms beyond what `gb` takes at the copy rate."""
    return {"tb_per_s": gb / ms if ms > 0 else float("inf"), "lost_ms": ms - gb / copy_gbps * 1e3}


def rate_rows(nbytes: Counter, kernels: Sequence[Any], steps: int, copy_gbps: float,
              configs: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """One row per Triton kernel of the profile that the output code names: launches, ms and GB per step, TB/s,
    `lost_ms` (its time beyond what its bytes take at the copy rate) and its launch configuration where `configs` has
    it; the most lost first. Kernels of the profile that the code does not name (cuBLAS's, cuDNN's, lkcnn's, the
    optimizer's) are left out."""
    rows = [{"kernel": name, "family": family(name), "launches": launches, "ms": ms, "gb": nbytes[name] / 1e9,
             **_rate(ms, nbytes[name] / 1e9, copy_gbps), "config": (configs or {}).get(name, "")}
            for name, (ms, launches) in per_step(kernels, steps).items() if name in nbytes]
    return sorted(rows, key=lambda r: r["lost_ms"], reverse=True)


def by_family(rows: Sequence[dict[str, Any]], copy_gbps: float) -> list[dict[str, Any]]:
    """`rate_rows` summed per kernel family (a fused pattern across the network's blocks), the most lost first."""
    sums: dict[str, dict[str, float]] = {}
    for r in rows:
        s = sums.setdefault(r["family"], {"kernels": 0, "launches": 0.0, "ms": 0.0, "gb": 0.0})
        s["kernels"] += 1
        for key in ("launches", "ms", "gb"):
            s[key] += r[key]
    out = [{"family": name, **s, **_rate(s["ms"], s["gb"], copy_gbps)} for name, s in sums.items()]
    return sorted(out, key=lambda r: r["lost_ms"], reverse=True)


def measure(model: str, impl: str, batch: int, steps: int, warmup: int, inductor: dict[str, Any] | None = None,
            **model_kwargs) -> tuple[Counter, list, dict[str, str]]:
    """(bytes per step by kernel, the profiled kernels over `steps` steps, launch configurations by kernel) of one
    compiled network, with `inductor`'s settings over lkcnn's and the network's: its first step compiles it (fresh,
    so that inductor generates the code rather than loading it from its cache) and runs each kernel once."""
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.utils import fresh_cache, run_and_get_code

    step, state = setup(model, impl, batch, channels_last=True, compile=COMPILE_MODE, inductor=inductor,
                        **model_kwargs)
    with fresh_cache():
        _, codes = run_and_get_code(step)
        configs = launch_configs(PyCodeCache.modules)
    for _ in range(warmup):
        step()
    kernels = profile_kernels(step, steps)
    del step, state
    release()
    return step_bytes(codes), kernels, configs


def table(rows: Sequence[dict[str, Any]], top: int, name_key: str) -> list[str]:
    lines = [f"{'lost ms':>8} {'ms':>7} {'GB':>7} {'TB/s':>6} {'launches':>8}  {name_key}"]
    for r in rows[:top]:
        config = f"  [{r['config']}]" if r.get("config") else ""
        lines.append(f"{r['lost_ms']:8.3f} {r['ms']:7.3f} {r['gb']:7.3f} {r['tb_per_s']:6.2f} {r['launches']:8.1f}  "
                     f"{r[name_key][:110]}{config}")
    return lines


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(prog="lkcnn-bench rates", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=lambda s: s.split(","), default=["unireplknet_b"],
                        help="comma list of timm names (lkcnn's after `import lkcnn`, or a peer such as convnext_base)")
    parser.add_argument("--runs", default="auto", choices=sorted(VARIANTS),
                        help="lkcnn's models: which variant, as `lkcnn.bench e2e --runs` (default auto)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5, help="profiled steps")
    parser.add_argument("--warmup", type=int, default=5, help="steps between the compiling one and the profile")
    parser.add_argument("--top", type=int, default=25, help="kernels and families listed")
    parser.add_argument("--inductor", default="", metavar="KEY=VALUE[,...]",
                        help="torch._inductor.config settings over lkcnn's and the network's")
    parser.add_argument("--json", default="", help="write a train_rates benchmark record here")
    args = parser.parse_args(argv)
    try:
        args.inductor = parse_settings(args.inductor)
    except ValueError as err:
        parser.error(f"--inductor: {err}")
    check_models(parser, "--models", args.models)
    picked = {model: jobs([model], [args.runs]) for model in args.models}
    if none := [model for model, variants in picked.items() if not variants]:
        parser.error(f"--runs {args.runs}: {none} have no such variant (the 3x3 twin is RepLKNet's)")
    if not torch.cuda.is_available():
        sys.exit("lkcnn-bench rates: no CUDA device is visible; it profiles a compiled training step on a GPU")
    copy_gbps = copy_bandwidth_gbps()
    print(f"copy rate {copy_gbps / 1e3:.2f} TB/s (bytes read and written)")
    rows = []
    for model in args.models:
        (_, impl, kwargs), = picked[model].values()
        nbytes, kernels, configs = measure(model, impl, args.batch, args.steps, args.warmup, args.inductor, **kwargs)
        kernel_rows = rate_rows(nbytes, kernels, args.steps, copy_gbps, configs)
        unnamed = [e.key for e in kernels if e.key.startswith("triton_") and e.key not in nbytes]
        if not kernel_rows:
            print(f"== {model} ({impl}): no profiled Triton kernel is named in the captured output code "
                  f"({len(unnamed)} profiled, {len(nbytes)} in the code): this torch names them differently")
            continue
        families = by_family(kernel_rows, copy_gbps)
        ms, gb = sum(r["ms"] for r in kernel_rows), sum(r["gb"] for r in kernel_rows)
        print(f"== {model} ({impl}): {len(kernel_rows)} Triton kernels, {ms:.2f} ms and {gb:.2f} GB a step, "
              f"{gb / ms:.2f} TB/s; {sum(r['lost_ms'] for r in kernel_rows):.2f} ms beyond the copy rate"
              + (f"; {len(unnamed)} profiled Triton kernels not in the code" if unnamed else ""))
        print("\n".join(table(families, args.top, "family")))
        print("\n".join(table(kernel_rows, args.top, "kernel")))
        rows.append({"network": model, "conv_impl": impl, "inductor": args.inductor, "triton_ms": ms, "triton_gb": gb,
                     "families": families, "kernels": kernel_rows, "unnamed_triton_kernels": unnamed})
    if args.json:
        method = {"timer": "torch.profiler kernel times over --steps after the compiling step and --warmup",
                  "bytes": "each Triton kernel's pointer arguments' whole buffers once, in the step's own output "
                           "code (lkcnn.bench.codegen.kernel_bytes)",
                  "lost_ms": "ms - GB / copy rate", "copy_gbps": copy_gbps, "batch": args.batch,
                  "regime": f"compiled ({COMPILE_MODE}), channels_last", "dtype": "bf16 autocast"}
        write_record(args.json, make_record("train_rates", torch.device("cuda"), command_line(["rates", *argv]),
                                            method, rows))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main(sys.argv[1:])
