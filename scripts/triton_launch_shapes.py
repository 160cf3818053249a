"""Launch shapes of lkcnn's Triton normalization kernels on one GPU: the sweep behind lkcnn/ops/triton_tiles.py's
settings (docs/performance.md, "RepLKNet's FFN BatchNorm + GELU").

Each kernel of lkcnn/ops/bn_gelu_triton.py (RepLKNet's BatchNorm + GELU) and of lkcnn/ops/grn_triton.py
(UniRepLKNet's GELU + GRN) runs on bf16 inputs of its network's shapes at batch 64 (RepLKNet-31B's FFN hidden
activation, 4C channels, and its blocks' width, C; UniRepLKNet-B's MLP hidden activation, reduced per image) at the
current launch shapes and at every candidate: tile rows x channels and warps, and for the reductions also the
programs' waves (one program an SM each) and, for BatchNorm's, the row loop's pipelining depth. Each candidate's
result is checked against the current shapes' (outputs poisoned first) before it is timed (triton's do_bench: L2
flushed, median); inductor's compiled torch ops time BatchNorm's two reductions beside them (the peer,
`max_autotune_pointwise` on). Prints each kernel's current, best and inductor's time per shape, then the candidates
ranked by their time weighted by the networks' block counts; --json writes the record.

    python scripts/triton_launch_shapes.py [--shapes bn,grn s3] [--json FILE]
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
from lkcnn.ops import grn_triton as G
from lkcnn.ops import triton_tiles as T

# name: (images, rows an image, channels, units a step); BatchNorm reduces over all N * H * W rows of the batch
SHAPES = {"bn ffn s1": (1, 200704, 512, 2), "bn ffn s2": (1, 50176, 1024, 2), "bn ffn s3": (1, 12544, 2048, 18),
          "bn ffn s4": (1, 3136, 4096, 2), "bn C s1": (1, 200704, 128, 2), "bn C s3": (1, 12544, 512, 18),
          "grn s1": (64, 3136, 512, 3), "grn s2": (64, 784, 1024, 3), "grn s3": (64, 196, 2048, 27),
          "grn s4": (64, 49, 4096, 3)}
# candidates: reductions (tile rows, tile channels, warps, waves[, pipelining depth]), the rest (rows, channels, warps)
TILES = [(r, c) for r in (8, 16, 32, 64) for c in (64, 128, 256) if 512 <= r * c <= 8192]
CONFIGS = {"bn reduce": [(r, c, w, v, s) for r, c in TILES for w in (4, 8) for v in (4, 8, 16) for s in (1, 3)
                         if r >= 16 and not (r * c <= 2048 and w == 8)],
           "grn reduce": [(r, c, w, v) for r, c in TILES for w in (2, 4, 8) for v in (4, 8) if w * 128 <= r * c],
           "apply": [(r, c, w) for r, c in TILES for w in (2, 4, 8) if w * 128 <= r * c]}


def _reduction(kernel, args, extra, n, r, c, parts, merge):
    """launch(cfg) -> (run, result) of a reduction kernel whose grid is (channel blocks, splits, images); its
    partial results are written into a NaN-filled buffer and merged."""
    def launch(cfg):
        block_r, block_c, warps, waves, *stages = cfg
        count, rows = T.splits(n, r, c, args[0].device, block_c, block_r, waves)
        part = torch.full((*parts, n, count, c), float("nan"), device=args[0].device)
        consts = {"STAGES": stages[0]} if stages else {}

        def run():
            kernel[(triton.cdiv(c, block_c), count, n)](*args, part, *extra, r, c, rows, BLOCK_R=block_r,
                                                        BLOCK_C=block_c, num_warps=warps, **consts)
        return run, lambda: merge(part)
    return launch


def _pointwise(kernel, args, consts, n, r, c):
    """launch(cfg) -> (run, result) of an elementwise kernel whose grid is (channel blocks, row blocks, images),
    its output NaN-filled first."""
    def launch(cfg):
        block_r, block_c, warps = cfg
        out = torch.full((n * r, c), float("nan"), device=args[0].device, dtype=args[0].dtype)

        def run():
            kernel[(triton.cdiv(c, block_c), triton.cdiv(r, block_r), n)](*args, out, r, c, BLOCK_R=block_r,
                                                                         BLOCK_C=block_c, num_warps=warps, **consts)
        return run, lambda: out
    return launch


def kernels(op: str, n: int, r: int, c: int, device: torch.device, peers: bool) -> dict[str, dict]:
    """kernel -> {launch(config) -> (run, result), current config, candidates' kind, bytes moved, inductor's peer}
    on seeded bf16 inputs; the reductions' partial results merged, so that any two splits compare."""
    gen = torch.Generator(device).manual_seed(0)

    def rand(*shape, normal=True):
        return (torch.randn if normal else torch.rand)(*shape, generator=gen, device=device)
    x, g = (0.5 * rand(n * r, c) + rand(c)).bfloat16(), rand(n * r, c).bfloat16()
    size = n * r * c * x.element_size()
    if op == "bn":  # all rows as one image: the BatchNorm kernels' grids have no images axis
        reduce_now = (T.REDUCE_BLOCK_R, T.REDUCE_BLOCK_C, T.REDUCE_WARPS, T.REDUCE_WAVES, T.REDUCE_STAGES)
        apply_now = (T.APPLY_BLOCK_R, T.BLOCK_C, T.APPLY_WARPS)
        a, b, mean, rstd = rand(c, normal=False) + 0.5, rand(c), rand(c), rand(c, normal=False) + 0.5
        terms = [a, b, mean, rstd, 0.1 * rand(c), 0.1 * rand(c)]
        peer = _peers(x, g, terms[:4]) if peers else {}
        return {"statistics": dict(launch=_reduction(K._bn_stats_kernel, [x], [], 1, n * r, c, (3,),
                                                     lambda p: torch.stack(B.merge_moments(p[:, 0], n * r))),
                                   current=reduce_now, kind="bn reduce", bytes=size, peer=peer.get("statistics")),
                "output": dict(launch=_pointwise(K._bn_gelu_apply_kernel, [x, a, b], {}, 1, n * r, c),
                               current=apply_now, kind="apply", bytes=2 * size),
                "gradient sums": dict(launch=_reduction(K._bn_gelu_grad_sums_kernel, [g, x, *terms[:4]], [], 1,
                                                        n * r, c, (2,), lambda p: p.sum(2)),
                                      current=reduce_now, kind="bn reduce", bytes=2 * size,
                                      peer=peer.get("gradient sums")),
                "gradient apply": dict(launch=_pointwise(K._bn_gelu_grad_apply_kernel, [g, x, *terms], {}, 1, n * r,
                                                         c), current=apply_now, kind="apply", bytes=3 * size)}
    scale, t, beta = rand(n, c, normal=False) + 0.5, 0.1 * rand(n, c), rand(c)
    apply_now = (T.BLOCK_R, T.BLOCK_C, T.WARPS)
    reduce_now = (T.GRN_REDUCE_BLOCK_R, T.GRN_REDUCE_BLOCK_C, T.GRN_REDUCE_WARPS, T.GRN_REDUCE_WAVES)
    return {"sum of squares": dict(launch=_reduction(G._grn_sumsq_kernel, [x], [], n, r, c, (), lambda p: p.sum(1)),
                                   current=reduce_now, kind="grn reduce", bytes=size),
            "output": dict(launch=_pointwise(G._grn_apply_kernel, [x, scale, beta], {"HAS_BETA": True}, n, r, c),
                           current=apply_now, kind="apply", bytes=2 * size),
            "gradient sums": dict(launch=_reduction(G._grn_grad_sums_kernel, [g, x], [n], n, r, c, (2,),
                                                    lambda p: p.sum(2)),
                                  current=reduce_now, kind="grn reduce", bytes=2 * size),
            "gradient apply": dict(launch=_pointwise(G._grn_grad_apply_kernel, [g, x, scale, t], {}, n, r, c),
                                   current=apply_now, kind="apply", bytes=3 * size)}


def _peers(x: torch.Tensor, g: torch.Tensor, terms: list[torch.Tensor]) -> dict[str, Callable]:
    """Inductor's compiled torch ops for BatchNorm's two reductions."""
    import torch._inductor.config as inductor

    inductor.max_autotune_pointwise = True
    # static shapes: the same code compiled for each shape would otherwise turn dynamic from the second on
    stats = torch.compile(lambda t: torch.var_mean(t.float(), dim=0, correction=0), dynamic=False)

    def grad_sums_ops(g, x, a, b, mean, rstd):
        dz, x_hat = B._dz(g, x, a, b, mean, rstd)  # bn_gelu_grad_sums's torch implementation
        return dz.sum(0), (dz * x_hat).sum(0)
    grad_sums = torch.compile(grad_sums_ops, dynamic=False)
    return {"statistics": lambda: stats(x), "gradient sums": lambda: grad_sums(g, x, *terms)}


def sweep(names: list[str], timer: Callable[[Callable], float], peers: bool = True,
          configs: dict[str, list] | None = None) -> list[dict]:
    """A row per kernel and shape: ms at the current launch shape, at each candidate whose result matches it within
    1e-4 relative (None where it does not), and inductor's where there is a peer."""
    configs = configs or CONFIGS
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    rows = []
    for name in names:
        n, r, c, units = SHAPES[name]
        for kernel, k in kernels(name.split()[0], n, r, c, device, peers).items():
            run, result = k["launch"](k["current"])
            run()
            expected = result().clone()
            row = {"shape": name, "kernel": kernel, "images": n, "rows": r, "channels": c, "units_per_step": units,
                   "bytes": k["bytes"], "current": k["current"], "ms_current": timer(run), "ms": {}}
            for cfg in configs[k["kind"]]:
                run, result = k["launch"](cfg)
                run()
                same = bool((result() - expected).norm() <= 1e-4 * expected.norm())
                row["ms"][str(cfg)] = timer(run) if same else None
            if k.get("peer") is not None:
                k["peer"]()
                row["ms_inductor"] = timer(k["peer"])
            rows.append(row)
    return rows


def report(rows: list[dict]) -> list[str]:
    """Each kernel's current, best and inductor's time and rate per shape, then per op and kernel the candidates
    ranked by time weighted by block counts (RepLKNet's FFN shapes, UniRepLKNet's)."""
    lines = []
    for row in rows:
        timed = {k: v for k, v in row["ms"].items() if v is not None}

        def rate(ms, row=row):
            return f"{ms * 1e3:6.1f} us {row['bytes'] / ms / 1e9:5.2f} TB/s"
        best = min(timed, key=timed.get) if timed else None
        best = f"best {best} {rate(timed[best])}" if best else "no candidate matched"
        peer = f" | inductor {rate(row['ms_inductor'])}" if "ms_inductor" in row else ""
        failed = len(row["ms"]) - len(timed)
        lines.append(f"{row['shape']:9s} {row['kernel']:14s} current {rate(row['ms_current'])} | {best}{peer}"
                     + (f" | {failed} candidates differed" if failed else ""))
    for op in ("bn ffn", "grn"):
        for kernel in dict.fromkeys(row["kernel"] for row in rows if row["shape"].startswith(op)):
            group = [row for row in rows if row["shape"].startswith(op) and row["kernel"] == kernel]
            total = {cfg: sum(row["units_per_step"] * row["ms"][cfg] for row in group)
                     for cfg in group[0]["ms"] if all(row["ms"][cfg] is not None for row in group)}
            current = sum(row["units_per_step"] * row["ms_current"] for row in group)
            ranked = sorted(total, key=total.get)[:5]
            lines.append(f"{op} {kernel}, weighted by block count: current {current:.3f} ms; best "
                         + ", ".join(f"{cfg} {total[cfg]:.3f}" for cfg in ranked))
    return lines


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="bn,grn",
                        help=f"comma-separated prefixes of the shapes' names ({', '.join(SHAPES)})")
    parser.add_argument("--json", default=None, help="write the record to this file")
    args = parser.parse_args(argv)
    names = [name for name in SHAPES if any(name.startswith(p) for p in args.shapes.split(","))]
    if not names:
        sys.exit(f"triton_launch_shapes: no shape starts with {args.shapes!r}; the shapes: {', '.join(SHAPES)}")
    if not torch.cuda.is_available():
        sys.exit("triton_launch_shapes: needs a CUDA GPU")
    from triton.testing import do_bench

    rows = sweep(names, lambda fn: do_bench(fn, warmup=5, rep=25, return_mode="median"))
    print("\n".join(report(rows)))
    if args.json:
        method = {"timer": "triton.testing.do_bench median (L2 flushed), 25 ms after 5 ms of warm-up",
                  "inputs": "bf16, seeded; each candidate's merged result checked against the current launch "
                            "shape's (relative error 1e-4, outputs NaN-filled first) before it is timed, null where "
                            "it differed",
                  "configs": "reductions: (tile rows, tile channels, warps, waves[, pipelining depth]); the rest: "
                             "(tile rows, tile channels, warps)",
                  "peer": "torch.compile of var_mean and of the GELU gradient's sums in torch ops, "
                          "max_autotune_pointwise"}
        write_record(args.json, make_record("triton_launch_shapes", torch.device("cuda"),
                                            "python scripts/triton_launch_shapes.py " + " ".join(argv), method,
                                            rows))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main(sys.argv[1:])
