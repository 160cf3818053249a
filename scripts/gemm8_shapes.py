"""Per-shape A/B of RepLKNet-31B's 8-bit GEMMs (deploy form, batch 128) on one GPU, each with a BatchNorm + GELU +
quantize-for-the-next-GEMM epilogue: cuBLASLt's FP8 GEMM through `torch._scaled_mm` (row-wise scales, bf16 out)
followed by that epilogue as one compiled pass; lkcnn.gemm8_lt (the same kernels, the BatchNorm and GELU in
cuBLASLt's epilogue) followed by a compiled quantize pass; with --triton, lkcnn.gemm8's Triton kernel with the whole
epilogue fused. Device time of CUDA-graph replays (no host overhead, as in the compiled model), median.

    python scripts/gemm8_shapes.py [--batch 128] [--reps 50] [--triton]
"""
from __future__ import annotations

import argparse

import timm
import torch
from torch import nn

import lkcnn  # noqa: F401  (registers the models)
from lkcnn import timing
from lkcnn.bench.branches import graphed
from lkcnn.ops.gemm8 import gemm8, gemm8_lt
from lkcnn.ops.qdq import quantize_values


def shapes(batch: int) -> dict[tuple[int, int, int], int]:
    """(M, N, K) of every ungrouped 1x1 conv of RepLKNet-31B at 224 px -> how many layers have it."""
    model, seen, found = timm.create_model("replknet31b").eval(), {}, []
    for m in model.modules():
        if isinstance(m, nn.Conv2d) and m.kernel_size == (1, 1) and m.groups == 1:
            m.register_forward_hook(lambda mod, a, o: found.append(
                (a[0].shape[2] * a[0].shape[3] * batch, mod.out_channels, mod.in_channels)))
    with torch.no_grad():
        model(torch.randn(1, 3, 224, 224))
    for s in found:
        seen[s] = seen.get(s, 0) + 1
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--triton", action="store_true", help="also time the Triton kernel (autotunes each shape)")
    args = parser.parse_args()
    dev = torch.device("cuda")
    f8 = torch.float8_e4m3fn

    @torch.compile
    def epilogue(y, a, b, s):  # what inductor runs after _scaled_mm: BatchNorm + GELU + the next quantization
        return quantize_values(torch.nn.functional.gelu(y.float() * a + b), s, f8)

    quantize = torch.compile(lambda y, s: quantize_values(y, s, f8))  # what follows gemm8_lt: the quantization alone

    names = ["_scaled_mm", "+pass", "lt", "lt+q"] + (["triton"] if args.triton else [])
    print(f"{'M x N x K':>22s} {'layers':>6s} | " + " ".join(f"{n:>10s}" for n in names) + "  ms")
    totals = [0.0] * len(names)
    for (m, n, k), count in sorted(shapes(args.batch).items()):
        a = torch.randn(m, k, device=dev).clamp(-448, 448).to(f8)
        w = torch.randn(n, k, device=dev).clamp(-448, 448).to(f8)
        sa, sw = torch.ones(m, 1, device=dev), torch.ones(1, n, device=dev)
        alpha, beta, s = torch.rand(n, device=dev), torch.randn(n, device=dev), torch.tensor([0.05], device=dev)
        bias = beta.bfloat16()
        cublas = lambda: torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sw, out_dtype=torch.bfloat16)  # noqa: E731
        lt = lambda: gemm8_lt(a, w, alpha, bias, None, "gelu_tanh", torch.bfloat16)  # noqa: E731
        y, z = cublas(), lt()
        runs = [cublas, lambda: epilogue(y, alpha, beta, s), lt, lambda: quantize(z, s)]
        if args.triton:
            runs.append(lambda: gemm8(a, w, alpha, beta, None, "gelu", "float8_e4m3fn", s, f8))
        ms = [timing.median_ms(graphed(lambda _, fn=fn: fn(), {}).replay, args.reps, warmup=5, device=dev)
              for fn in runs]
        ms[1] += ms[0]
        ms[3] += ms[2]
        totals = [t + x * count for t, x in zip(totals, ms)]
        print(f"{m:>10d} x{n:>5d} x{k:>5d} {count:6d} | " + " ".join(f"{x:10.3f}" for x in ms))
    print(f"{'all layers':>22s} {'':6s} | " + " ".join(f"{x:10.3f}" for x in totals))


if __name__ == "__main__":
    main()
