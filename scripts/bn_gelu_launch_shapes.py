"""Launch shapes of lkcnn's BatchNorm + GELU kernels on one GPU: the sweep behind lkcnn/ops/triton_tiles.py's APPLY_*
and REDUCE_* settings (docs/performance.md, "RepLKNet's FFN BatchNorm + GELU").

Each of lkcnn/ops/bn_gelu_triton.py's four kernels runs on bf16 inputs of RepLKNet-31B's shapes at batch 64 (the
FFN's hidden activation, 4C channels, and the blocks' width, C) at the current launch shapes and at every candidate:
tile rows x channels and warps, and for the two reductions also the programs' waves (one program an SM each) and the
row loop's pipelining depth. Each candidate's result is checked against the current shapes' before it is timed
(triton's do_bench: L2 flushed, median), and inductor's compiled torch ops time the two reductions beside them (the
peer, `max_autotune_pointwise` on). Prints each kernel's current, best and inductor's time per shape, then the
candidates ranked by their time weighted by the stages' block counts (the FFN shapes); --json writes the record.

    python scripts/bn_gelu_launch_shapes.py [--json benchmarks/h200_bn_gelu_launch_shapes.json]
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch
import triton

from lkcnn.bench.record import make_record, write_record
from lkcnn.ops import bn_gelu as B
from lkcnn.ops import bn_gelu_triton as K
from lkcnn.ops import triton_tiles as T

# name: (rows = N * H * W at batch 64, channels, units a step of RepLKNet-31B)
SHAPES = {"ffn s1": (200704, 512, 2), "ffn s2": (50176, 1024, 2), "ffn s3": (12544, 2048, 18),
          "ffn s4": (3136, 4096, 2), "C s1": (200704, 128, 2), "C s3": (12544, 512, 18)}
# (tile rows, tile channels, warps, waves, pipelining depth) and (tile rows, tile channels, warps)
REDUCE = [(r, c, w, v, s) for r in (16, 32, 64) for c in (64, 128, 256) for w in (4, 8) for v in (4, 8, 16)
          for s in (1, 3) if r * c <= 8192 and not (r * c <= 2048 and w == 8)]
APPLY = [(r, c, w) for r in (8, 16, 32, 64) for c in (64, 128, 256) for w in (2, 4, 8)
         if 512 <= r * c <= 8192 and w * 128 <= r * c]
CURRENT = {"reduce": (T.BLOCK_R, T.REDUCE_BLOCK_C, T.REDUCE_WARPS, 4, T.REDUCE_STAGES),
           "apply": (T.APPLY_BLOCK_R, T.BLOCK_C, T.APPLY_WARPS)}
KERNELS = {"statistics": ("reduce", 1), "output": ("apply", 2), "gradient sums": ("reduce", 2),
           "gradient apply": ("apply", 3)}  # kind of launch shape, passes over the activation


def launches(x: torch.Tensor, g: torch.Tensor, terms: list[torch.Tensor]) -> dict[str, Callable]:
    """kernel -> launch(config) -> (run, result): a call of the kernel at that launch shape and what it computes,
    the reductions' partial results merged so that any two splits compare."""
    r, c = x.shape

    def reduction(kernel, args, parts, merge):
        def launch(cfg):
            block_r, block_c, warps, waves, stages = cfg
            count, rows = T.splits(1, r, c, x.device, block_c, block_r, waves)
            part = torch.full((parts, count, c), float("nan"), device=x.device)

            def run():
                kernel[(triton.cdiv(c, block_c), count)](*args, part, r, c, rows, BLOCK_R=block_r, BLOCK_C=block_c,
                                                         STAGES=stages, num_warps=warps)
            return run, lambda: merge(part)
        return launch

    def pointwise(kernel, args):
        def launch(cfg):
            block_r, block_c, warps = cfg
            out = torch.full_like(x, float("nan"))

            def run():
                kernel[(triton.cdiv(c, block_c), triton.cdiv(r, block_r))](*args, out, r, c, BLOCK_R=block_r,
                                                                          BLOCK_C=block_c, num_warps=warps)
            return run, lambda: out
        return launch

    return {"statistics": reduction(K._bn_stats_kernel, [x], 3, lambda p: torch.stack(B.merge_moments(p, r))),
            "output": pointwise(K._bn_gelu_apply_kernel, [x, *terms[:2]]),
            "gradient sums": reduction(K._bn_gelu_grad_sums_kernel, [g, x, *terms[:4]], 2, lambda p: p.sum(1)),
            "gradient apply": pointwise(K._bn_gelu_grad_apply_kernel, [g, x, *terms])}


def peers(x: torch.Tensor, g: torch.Tensor, terms: list[torch.Tensor]) -> dict[str, Callable]:
    """kernel -> inductor's compiled torch ops for the same reduction (the two reductions only)."""
    import torch._inductor.config as inductor

    inductor.max_autotune_pointwise = True
    stats = torch.compile(lambda t: torch.var_mean(t.float(), dim=0, correction=0))

    def grad_sums_ops(g, x, a, b, mean, rstd):
        dz, x_hat = B._dz(g, x, a, b, mean, rstd)  # bn_gelu_grad_sums's torch implementation
        return dz.sum(0), (dz * x_hat).sum(0)
    grad_sums = torch.compile(grad_sums_ops)
    return {"statistics": lambda: stats(x), "gradient sums": lambda: grad_sums(g, x, *terms[:4])}


def sweep(names: list[str], timer: Callable[[Callable], float], with_peers: bool = True,
          configs: dict[str, list] | None = None) -> list[dict]:
    """A row per kernel and shape: ms at the current launch shape, at each candidate whose result matches it (None
    where it does not), and inductor's where there is a peer."""
    configs = configs or {"reduce": REDUCE, "apply": APPLY}
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    rows = []
    for name in names:
        r, c, units = SHAPES[name]
        gen = torch.Generator(device).manual_seed(0)
        x = (torch.randn(r, c, generator=gen, device=device) * 0.5 + torch.randn(c, generator=gen, device=device))
        x, g = x.bfloat16(), torch.randn(r, c, generator=gen, device=device).bfloat16()
        terms = [torch.rand(c, generator=gen, device=device) + 0.5, torch.randn(c, generator=gen, device=device),
                 torch.randn(c, generator=gen, device=device), torch.rand(c, generator=gen, device=device) + 0.5,
                 *(0.1 * torch.randn(c, generator=gen, device=device) for _ in range(2))]  # a, b, mean, rstd, c0, c1
        peer = peers(x, g, terms) if with_peers else {}
        for kernel, launch in launches(x, g, terms).items():
            kind, passes = KERNELS[kernel]
            run, result = launch(CURRENT[kind])
            run()
            expected = result().clone()
            row = {"kernel": kernel, "shape": name, "rows": r, "channels": c, "units_per_step": units,
                   "bytes": passes * r * c * x.element_size(), "ms_current": timer(run), "ms": {}}
            for cfg in configs[kind]:
                run, result = launch(cfg)
                run()
                same = bool((result() - expected).norm() <= 1e-4 * expected.norm())
                row["ms"][str(cfg)] = timer(run) if same else None
            if kernel in peer:
                peer[kernel]()
                row["ms_inductor"] = timer(peer[kernel])
            rows.append(row)
    return rows


def report(rows: list[dict]) -> list[str]:
    """Each kernel's current, best and inductor's time and rate per shape, then the candidates ranked by time weighted
    by block counts over the FFN shapes."""
    lines = []
    for row in rows:
        timed = {k: v for k, v in row["ms"].items() if v is not None}
        best = min(timed, key=timed.get)

        def rate(ms, row=row):
            return f"{ms * 1e3:6.1f} us {row['bytes'] / ms / 1e9:5.2f} TB/s"
        peer = f" | inductor {rate(row['ms_inductor'])}" if "ms_inductor" in row else ""
        failed = len(row["ms"]) - len(timed)
        lines.append(f"{row['kernel']:14s} {row['shape']:7s} current {rate(row['ms_current'])} | best {best} "
                     f"{rate(timed[best])}{peer}" + (f" | {failed} candidates differed" if failed else ""))
    for kernel in KERNELS:
        ffn = [row for row in rows if row["kernel"] == kernel and row["shape"].startswith("ffn")]
        if not ffn:
            continue
        total = {cfg: sum(row["units_per_step"] * row["ms"][cfg] for row in ffn)
                 for cfg in ffn[0]["ms"] if all(row["ms"][cfg] is not None for row in ffn)}
        current = sum(row["units_per_step"] * row["ms_current"] for row in ffn)
        ranked = sorted(total, key=total.get)[:5]
        lines.append(f"{kernel}, the FFN shapes weighted by block count: current {current:.3f} ms; best "
                     + ", ".join(f"{cfg} {total[cfg]:.3f}" for cfg in ranked))
    return lines


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--json", default=None, help="write the record to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bn_gelu_launch_shapes: needs a CUDA GPU")
    from triton.testing import do_bench

    rows = sweep(args.shapes.split(","), lambda fn: do_bench(fn, warmup=5, rep=25, return_mode="median"))
    print("\n".join(report(rows)))
    if args.json:
        method = {"timer": "triton.testing.do_bench median (L2 flushed), 25 ms after 5 ms of warm-up",
                  "inputs": "bf16 (rows, channels), seeded; each candidate's merged result checked against the "
                            "current launch shape's (relative error 1e-4) before it is timed, null where it differed",
                  "current": {"reduce": CURRENT["reduce"], "apply": CURRENT["apply"]},
                  "configs": "reduce: (tile rows, tile channels, warps, waves, pipelining depth); apply: (tile rows, "
                             "tile channels, warps)",
                  "peer": "torch.compile of var_mean and of the GELU gradient's sums in torch ops, "
                          "max_autotune_pointwise"}
        write_record(args.json, make_record("bn_gelu_launch_shapes", torch.device("cuda"),
                                            "python scripts/bn_gelu_launch_shapes.py " + " ".join(argv), method,
                                            rows))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main(sys.argv[1:])
