"""Per-layer A/B of RepLKNet-31B's large depthwise convolutions in deploy form (batch 128, its four stage shapes) on
one GPU: the 16-bit path (bf16 models, and 8-bit ones with large_kernels=False: lkcnn.dwconv2d on a bf16
channels_last input, its layout copies included, then ReLU) against lkcnn.dwconv8 in INT8 and FP8 (8-bit NCHW in, the
ReLU and the quantization for the next GEMM in its epilogue, 8-bit out), alone and with the two 8-bit layout copies
around it that a model pays where no pass before it writes NCHW. Device time of CUDA-graph replays (triton's
do_bench: L2 flushed, median), and the ratio to the 16-bit path.

    python scripts/dwconv8_layers.py [--batch 128]
"""
from __future__ import annotations

import argparse

import torch
import triton

from lkcnn.bench.branches import graphed
from lkcnn.ops.dwconv import dwconv2d
from lkcnn.ops.dwconv8 import dwconv8, pack_weight

STAGES = {"s1": (128, 56, 31), "s2": (256, 28, 29), "s3": (512, 14, 27), "s4": (1024, 7, 13)}  # C, H = W, k


def ways(n: int, c: int, h: int, k: int) -> dict[str, object]:
    """label -> a call on fresh random inputs of one stage's shape."""
    xb = torch.randn(n, c, h, h, device="cuda").bfloat16().contiguous(memory_format=torch.channels_last)
    wb = torch.randn(c, 1, k, k, device="cuda").bfloat16() * 0.05
    bb = torch.randn(c, device="cuda").bfloat16()
    calls = {"bf16 dwconv2d + ReLU (channels_last)": lambda: torch.relu_(dwconv2d(xb, wb, bb, [k // 2, k // 2]))}
    for qdtype, tag in ((torch.int8, "int8"), (torch.float8_e4m3fn, "fp8")):
        x8 = (torch.randn(n, c, h, h, device="cuda") * 20).clamp(-100, 100).to(qdtype)
        x8_cl = x8.contiguous(memory_format=torch.channels_last)
        table = pack_weight((torch.randn(c, 1, k, k, device="cuda") * 20).clamp(-100, 100).to(qdtype))
        alpha, beta = torch.rand(c, device="cuda") * 1e-4, torch.randn(c, device="cuda")
        scale = torch.tensor(0.05, device="cuda")

        def conv(x, table=table, alpha=alpha, beta=beta, scale=scale, qdtype=qdtype):
            return dwconv8(x, table, k, alpha, beta, "relu", scale, qdtype)
        calls[f"{tag} dwconv8 (NCHW)"] = lambda x=x8, conv=conv: conv(x)
        calls[f"{tag} dwconv8 + layout copies"] = lambda x=x8_cl, conv=conv: conv(x.contiguous()).contiguous(
            memory_format=torch.channels_last)
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=128)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, batch {args.batch}, us per call")
    for stage, (c, h, k) in STAGES.items():
        times = {}
        for label, call in ways(args.batch, c, h, k).items():
            graph = graphed(lambda _: call(), {})
            times[label] = triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median")
        base = next(iter(times.values()))
        for label, ms in times.items():
            print(f"{stage} k{k:<3d} {label:38s} {ms * 1e3:8.1f}  x{base / ms:5.2f}")


if __name__ == "__main__":
    main()
