"""`python -m lkcnn.bench branches`: the re-parameterizable blocks' small branches, each pass on a GPU.

Three ways to run a block's small branches on a channels_last input, timed per pass (forward, input gradient summed
over the branches, every weight gradient): lkcnn's branch kernels (`dwconv2d_branches`, one launch per pass), cuDNN
(what PyTorch runs for `nn.Conv2d` with dilation: one convolution per branch and pass, autotuned, plus the adds of
the input gradients), and lkcnn's large-kernel kernels on each branch's dilated kernel expanded to a dense one (how
lkcnn ran UniRepLKNet's dilated branches before the branch kernels). The cases: RepLKNet-31B's 5x5 branch at its four
stage maps and UniRepLKNet's five dilated branches of a 13x13 block at UniRepLKNet-B's stage 2-4 maps, batch 64.
"""
from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lkcnn.bench import kernels
from lkcnn.bench.record import command_line, make_record, write_record
from lkcnn.layers.fuse import dilate_kernel
from lkcnn.layers.reparam_conv import UNIREPLKNET_DILATED_BRANCHES
from lkcnn.ops import reference, set_conv_impl

UNIREP13 = tuple(UNIREPLKNET_DILATED_BRANCHES[13])
CASES: dict[str, tuple[tuple[int, int, int, int], tuple[tuple[int, int], ...]]] = {
    "replknet31b s1 5x5": ((64, 128, 56, 56), ((5, 1),)),
    "replknet31b s2 5x5": ((64, 256, 28, 28), ((5, 1),)),
    "replknet31b s3 5x5": ((64, 512, 14, 14), ((5, 1),)),
    "replknet31b s4 5x5": ((64, 1024, 7, 7), ((5, 1),)),
    "unireplknet_b s2 k13": ((64, 256, 28, 28), UNIREP13),
    "unireplknet_b s3 k13": ((64, 512, 14, 14), UNIREP13),
    "unireplknet_b s4 k13": ((64, 1024, 7, 7), UNIREP13),
    "unireplknet_b s1 3x3": ((64, 128, 56, 56), ((3, 1),)),
    "unireplknet_b s3 3x3": ((64, 512, 14, 14), ((3, 1),)),
}
WAYS = ("lkcnn_branches", "cudnn", "lkcnn_dense")


def _inputs(nchw, pairs, dtype, device) -> dict[str, Any]:
    def cl(t):
        return t.contiguous(memory_format=torch.channels_last)
    c = nchw[1]
    return {"x": cl(torch.randn(nchw, device=device, dtype=dtype)),
            "dys": [cl(torch.randn(nchw, device=device, dtype=dtype)) for _ in pairs],
            "ws": [cl(torch.randn(c, 1, k, k, device=device, dtype=dtype) / k) for k, _ in pairs]}


def passes(way: str, pairs) -> dict[str, Callable[[dict[str, Any]], object]]:
    ks, rs = [k for k, _ in pairs], [r for _, r in pairs]
    pads = [[r * (k // 2)] * 2 for k, r in pairs]
    if way == "lkcnn_branches":
        ops = torch.ops.lkcnn
        return {"fwd": lambda s: ops.dwconv2d_branches_fwd(s["x"], s["ws"], rs),
                "bwd_input": lambda s: ops.dwconv2d_branches_bwd_input(s["dys"], s["ws"], rs),
                "bwd_weight": lambda s: ops.dwconv2d_branches_bwd_weight(s["dys"], s["x"], ks, rs)}
    if way == "cudnn":
        return {"fwd": lambda s: [reference.forward(s["x"], w, None, p, r) for w, p, r in zip(s["ws"], pads, rs)],
                "bwd_input": lambda s: sum(reference.grad_input(d, w, p, r)
                                           for d, w, p, r in zip(s["dys"], s["ws"], pads, rs)),
                "bwd_weight": lambda s: [reference.grad_weight(d, s["x"], [k, k], p, r)
                                         for d, k, p, r in zip(s["dys"], ks, pads, rs)]}
    ops = torch.ops.lkcnn  # each branch's kernel dilated to its dense ((k-1)r+1)^2 form on the large-kernel op
    dense = [(k - 1) * r + 1 for k, r in pairs]
    return {"fwd": lambda s: [ops.dwconv2d_fwd(s["x"], dilate_kernel(w, r), None, p)
                              for w, r, p in zip(s["ws"], rs, pads)],
            "bwd_input": lambda s: sum(ops.dwconv2d_bwd_input(d, dilate_kernel(w, r), p)
                                       for d, w, r, p in zip(s["dys"], s["ws"], rs, pads)),
            "bwd_weight": lambda s: [ops.dwconv2d_bwd_weight(d, s["x"], [n, n], p)
                                     for d, n, p in zip(s["dys"], dense, pads)]}


def graphed(fn: Callable[[dict[str, Any]], object], inputs: dict[str, Any]) -> torch.cuda.CUDAGraph:
    """One pass on one input set as a CUDA graph: replays time the GPU's work alone, as a compiled training step
    (`reduce-overhead`) runs it, not the host's dispatch of the op and its small weight-table kernels."""
    fn(inputs)  # outside the capture: cuDNN's autotuning, the extension's load
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(inputs)
    return graph


def bench_case(name: str, dtype: str, timer, device, ways: Sequence[str] = WAYS) -> dict[str, Any]:
    nchw, pairs = CASES[name]
    torch_dtype = kernels.DTYPES[dtype]
    set_bytes = (1 + 2 * len(pairs)) * torch.Size(nchw).numel() * torch_dtype.itemsize
    sets = [_inputs(nchw, pairs, torch_dtype, device) for _ in range(kernels.n_input_sets(set_bytes))]
    row: dict[str, Any] = {"case": name, "nchw": list(nchw), "branches": [list(p) for p in pairs], "dtype": dtype}
    for way in ways:
        def measure(way=way) -> dict[str, float]:
            with kernels.pytorch_backend(cudnn=True):
                times = {}
                for pass_name, fn in passes(way, pairs).items():
                    cycle = itertools.cycle([graphed(fn, s) for s in sets])
                    times[pass_name] = timer(lambda: next(cycle).replay())
            times["total"] = sum(times.values())
            return times
        row[way] = kernels._guarded(measure)
        torch.cuda.empty_cache()
    if "total" in row.get("lkcnn_branches", {}):
        for way in WAYS[1:]:
            if "total" in row.get(way, {}):
                row[f"x_{way}"] = row[way]["total"] / row["lkcnn_branches"]["total"]
    return row


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    head = ["case", "dtype", "lkcnn fwd / dgrad / wgrad = total", "cuDNN total", "x cuDNN", "dense lkcnn total",
            "x dense"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    nan = float("nan")
    for r in rows:
        lk = r.get("lkcnn_branches", {})
        ours = (f"{lk['fwd']:.3f} / {lk['bwd_input']:.3f} / {lk['bwd_weight']:.3f} = {lk['total']:.3f}"
                if "total" in lk else lk.get("error", "-"))
        lines.append(" | ".join([r["case"], r["dtype"], ours,
                                 f"{r.get('cudnn', {}).get('total', nan):.3f}", f"{r.get('x_cudnn', nan):.2f}x",
                                 f"{r.get('lkcnn_dense', {}).get('total', nan):.3f}",
                                 f"{r.get('x_lkcnn_dense', nan):.2f}x"]))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lkcnn-bench branches", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated case names (default: all)")
    parser.add_argument("--dtypes", default="bf16", help="comma-separated: fp32, fp16, bf16 (default bf16)")
    parser.add_argument("--ways", default=",".join(WAYS),
                        help=f"comma-separated, of {', '.join(WAYS)} (default: all)")
    parser.add_argument("--json", help="write the benchmark record here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("python -m lkcnn.bench branches needs a CUDA GPU: run it on a GPU machine")
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {', '.join(unknown)}: choose from {', '.join(CASES)}")
    bad = [d for d in args.dtypes.split(",") if d not in kernels.DTYPES]
    if bad:
        raise SystemExit(f"unknown dtype(s) {', '.join(bad)}: choose from {', '.join(kernels.DTYPES)}")
    ways = args.ways.split(",")
    if bad := [w for w in ways if w not in WAYS]:
        raise SystemExit(f"unknown way(s) {', '.join(bad)}: choose from {', '.join(WAYS)}")
    set_conv_impl("cuda")  # the lkcnn columns are lkcnn's kernels or an error, never the fallback
    device = torch.device("cuda")
    timer_name, timer = kernels.gpu_timer()
    rows = [bench_case(c, d, timer, device, ways) for d in args.dtypes.split(",") for c in args.cases.split(",")]
    if args.json:
        method = {"timer": timer_name, "units": "ms per pass (CUDA graph replays: device time), median, channels_last "
                                                "inputs rotated past L2",
                  "ways": {"lkcnn_branches": "dwconv2d_branches' kernels, one launch per pass",
                           "cudnn": "PyTorch's dilated depthwise convolution per branch (cuDNN, autotuned)",
                           "lkcnn_dense": "lkcnn's large-kernel op per branch on the dense dilated kernel"}}
        write_record(args.json, make_record("branches", device, command_line(["branches", *(argv or [])]), method,
                                            rows))
    print(format_table(rows))
