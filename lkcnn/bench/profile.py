"""Reports of a torch.profiler run that the profiling tools share, so that their numbers compare kernel by kernel:
the plain DDP loop (scripts/ddp_profile.py) and the training app (`python -m lkcnn.bench app --gpu`).
"""
from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile


def gpu_timeline(prof, steps: int = 3) -> dict[str, float]:
    """This rank's (or process's) GPU timeline over the profiled steps, per step: the span from the first kernel's
    start to the last one's end, the time some kernel ran (their union) and so the idle time between kernels, and the
    NVLink exchange kernels' count and durations. An exchange that runs much longer than its ~3 us alone was waiting for
    another rank, so their median and tail show the skew that each synchronized BatchNorm costs."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type.name == "CUDA" and not e.is_user_annotation)  # kernels, copies, memsets
    busy, end = 0.0, spans[0][0]
    for start, stop, _ in spans:  # the union of the intervals (kernels of NCCL's streams may overlap compute)
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    exchange = sorted(stop - start for start, stop, name in spans if "exchange_kernel" in name)
    pick = (lambda q: exchange[min(len(exchange) - 1, int(q * len(exchange)))]) if exchange else (lambda q: 0.0)
    span = (end - spans[0][0]) / steps
    return {"span_ms": span / 1e3, "busy_ms": busy / steps / 1e3, "idle_ms": span / 1e3 - busy / steps / 1e3,
            "kernels": len(spans) / steps, "exchanges": len(exchange) / steps,
            "exchange_ms": sum(exchange) / steps / 1e3, "exchange_p10_us": pick(0.1),
            "exchange_p50_us": pick(0.5), "exchange_p90_us": pick(0.9), "exchange_max_us": pick(1.0)}


def kernel_table(averages) -> list:
    """The profiled GPU work (kernels, copies, memsets; not user annotations) of `prof.key_averages()`, by name,
    the longest first."""
    return sorted((e for e in averages if e.device_type.name == "CUDA" and not e.is_user_annotation),
                  key=lambda e: e.self_device_time_total, reverse=True)


def per_step(kernels, steps: int = 3) -> dict[str, list[float]]:
    """`kernel_table`'s rows as {name: [ms per step, launches per step]}, the --json format."""
    return {e.key: [e.self_device_time_total / 1e3 / steps, e.count / steps] for e in kernels}


def profile_kernels(fn, calls: int) -> list:
    """`kernel_table` of `calls` calls of `fn` (GPU work) under torch.profiler."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return kernel_table(prof.key_averages())


# Kernel names -> the step's cost categories of docs/performance.md, first match wins; a needle matches when it is in
# the name, a tuple of needles when all are (lkcnn's kernels are in namespace lkcnn: `dwconv_*` and the layout
# `transpose_kernel`; cuDNN's depthwise kernels are `*2d_c1_k1*`; the 8-bit GEMMs name their operand types: cuBLASLt's
# `i8i32` / `s8` / `qq`, CUTLASS's `float_e4m3_t`, lkcnn's Triton `_gemm8_kernel` / `_gemm8_tma_kernel`; inductor's
# Triton GEMM templates (`triton_tem_*`) name their ops in sorted order, `_scaled_mm` / `_int_mm` anywhere). Inductor's
# pointwise and reduction kernels are elementwise work whatever ops their names list (`..._scaled_mm_...` or
# `..._gemm8_lt_...` when they quantize a GEMM's input or output): ELEMENTWISE decides them first.
CATEGORIES = (
    # before dwconv_, which the mangled names of these kernels hold (their files' names)
    ("lkcnn small-branch conv", ("branches_conv_kernel", "branches_wgrad_kernel", "branch_tc_kernel")),
    ("lkcnn large-kernel conv, 8-bit", ("dwconv8_",)),
    ("lkcnn large-kernel conv", ("dwconv_",)),
    ("lkcnn layout copies", ("transpose_kernel",)),
    ("lkcnn GELU + GRN", ("_grn_",)),  # lkcnn/ops/grn_triton.py's Triton kernels
    ("lkcnn BatchNorm + GELU", ("_bn_stats_kernel", "_bn_gelu_")),  # lkcnn/ops/bn_gelu_triton.py's
    ("cuDNN depthwise conv", ("_c1_k1", "depthwise")),
    ("optimizer", ("multi_tensor", "adam")),
    ("8-bit GEMM (INT8 / FP8)", ("gemm8_kernel", "gemm8_tma_kernel", "i8i32", "_s8", "imma", "e4m3", "f8f8", "_qqtst",
                                 ("triton_tem", "_int_mm"), ("triton_tem", "_scaled_mm"))),
    ("GEMM (1x1 convs, head)", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "triton_tem", "sm90_", "sm80_")),
    ("inductor fused (norms, activations, adds)", ("triton_",)),
)
OTHER = "other (PyTorch elementwise, reductions, copies)"
ELEMENTWISE = (("triton_poi_", "triton_per_", "triton_red_"), "inductor fused (norms, activations, adds)")


def category(kernel: str) -> str:
    """The cost category of a GPU kernel, by its name."""
    name = kernel.lower()
    if name.startswith(ELEMENTWISE[0]):
        return ELEMENTWISE[1]

    def found(needle: str | tuple[str, ...]) -> bool:
        return needle in name if isinstance(needle, str) else all(n in name for n in needle)
    return next((label for label, needles in CATEGORIES if any(found(n) for n in needles)), OTHER)


def by_category(kernels, steps: int) -> dict[str, float]:
    """`kernel_table`'s rows summed per category, ms per step, in CATEGORIES' order (empty ones left out)."""
    totals = dict.fromkeys([label for label, _ in CATEGORIES] + [OTHER], 0.0)
    for e in kernels:
        totals[category(e.key)] += e.self_device_time_total / 1e3 / steps
    return {label: ms for label, ms in totals.items() if ms > 0}
