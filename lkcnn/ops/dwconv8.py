"""`torch.ops.lkcnn.dwconv8`: the large depthwise convolution of a deploy-form network on 8-bit operands (INT8 or
FP8 e4m3), with what follows it in an 8-bit inference engine fused into its epilogue:

    out[n, c] = grid(act(alpha[c] * sum_taps x[n, c] * w[c] + beta[c]))      ("same" zero padding, stride 1)

`alpha` holds the operands' scales (input scale x weight scale), `beta` the bias; `grid` is QuantizeLinear onto
`out_scale`'s grid (int8: round half to even, saturate at [-128, 127]; e4m3: round to nearest even, saturate at
+-448) written in x's 8-bit dtype, or, without `out_scale`, the float value in `out_dtype`. x is NCHW.

The kernels (csrc/dwconv8/) multiply Toeplitz blocks of the weights with the map on the tensor cores: a map of up
to 32 columns as one GEMM per channel (samples x output positions), wider maps in strips of rows; `pack_weight` lays
the weights out as those blocks once per model (`table`), and the op takes the table. Why our own kernel: PyTorch
has no 8-bit depthwise convolution, and the float kernels would read a 16-bit copy of the input and write a 16-bit
output for a separate quantization pass. Elsewhere (and as the tests' oracle) the op runs the same arithmetic in
torch ops.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from lkcnn.ops.gemm8 import ACTS, activate
from lkcnn.ops.qdq import DTYPE_NAMES, quantize_values

FLOAT_OUT = (torch.bfloat16, torch.float16, torch.float32)
MAX_KERNEL = 33  # the CUDA kernel holds 3 Toeplitz chunks per kernel row: rows of up to 33 taps
CHUNK = 16  # input columns of one Toeplitz chunk


def chunks_left(k: int) -> int:
    """Toeplitz chunks left of an output block's first column: the block's input starts 16 * this columns left."""
    return (k // 2 + CHUNK - 1) // CHUNK


def chunks(k: int) -> int:
    """Toeplitz chunks per kernel row: chunk j covers taps 16 j + i - m + k // 2 - 16 * chunks_left(k) (i, m < 16)."""
    offset = k // 2 - CHUNK * chunks_left(k)
    return next(j for j in range(1, 8) if CHUNK * j - (CHUNK - 1) + offset > k - 1)


def pack_weight(weight: Tensor) -> Tensor:
    """The (C, 1, k, k) 8-bit kernel as the CUDA kernel's table of Toeplitz blocks, block (c, d, j)[m][i] =
    w[c, d, 16 j + i - m + k // 2 - 16 * chunks_left(k)] (zero outside the kernel, and in the row that completes the
    last pair of rows of an odd kernel): for INT8 (2 * ceil(k / 2), J, 16, 16) bytes per channel; for FP8, whose
    kernel multiplies in f16 (e4m3 values are exact there), (2 * ceil(k / 2), J, 2, 16, 8) float16, each block's
    two 8-column halves apart. Flattened to (C, -1): a 2-D buffer, which `module.to(memory_format=...)` leaves
    alone."""
    c, _, k, _ = weight.shape
    raw = weight.reshape(c, k, k)
    raw = raw.view(torch.uint8) if raw.dtype == torch.int8 else raw.half()
    j = torch.arange(chunks(k), device=weight.device).view(-1, 1, 1)
    m = torch.arange(CHUNK, device=weight.device).view(1, -1, 1)
    i = torch.arange(CHUNK, device=weight.device).view(1, 1, -1)
    tap = CHUNK * j + i - m + k // 2 - CHUNK * chunks_left(k)
    inside = (tap >= 0) & (tap < k)
    blocks = torch.where(inside, raw[:, :, tap.clamp(0, k - 1)], 0)  # (C, k, J, 16, 16)
    table = blocks.new_zeros((c, k + k % 2, *blocks.shape[2:]))
    table[:, :k] = blocks
    if weight.dtype != torch.int8:
        table = table.view(*table.shape[:3], CHUNK, 2, CHUNK // 2).transpose(3, 4)
    return table.reshape(c, -1).contiguous()


def unpack_weight(table: Tensor, k: int, dtype: torch.dtype) -> Tensor:
    """`pack_weight`'s inverse: the (C, 1, k, k) kernel in `dtype` (int8 or float8_e4m3fn)."""
    c = table.shape[0]
    table = table.view(c, k + k % 2, chunks(k), *table_shape(c, k, dtype)[2])
    if dtype != torch.int8:
        table = table.transpose(3, 4).reshape(*table.shape[:3], CHUNK, CHUNK)
    first = table[:, :k, :, 0, :].reshape(c, k, -1)  # output column 0: taps 16 j + i + k // 2 - 16 * chunks_left
    start = CHUNK * chunks_left(k) - k // 2
    kernel = first[:, :, start:start + k].contiguous()
    return (kernel.view(dtype) if dtype == torch.int8 else kernel.to(dtype)).reshape(c, 1, k, k)


def table_shape(channels: int, k: int, dtype: torch.dtype) -> tuple[tuple[int, int], torch.dtype, tuple[int, ...]]:
    """`pack_weight`'s shape and dtype for `channels` kernels of k x k in `dtype`, and the shape of one block."""
    block, table_dtype = ((CHUNK, CHUNK), torch.uint8) if dtype == torch.int8 else ((2, CHUNK, 8), torch.float16)
    return (channels, (k + k % 2) * chunks(k) * CHUNK * CHUNK), table_dtype, block


def _check(x: Tensor, table: Tensor, k: int, alpha: Tensor, beta: Tensor, act: str, out_scale: Tensor | None,
           out_dtype: torch.dtype) -> None:
    if x.dtype not in DTYPE_NAMES.values() or x.dim() != 4:
        raise ValueError(f"lkcnn.dwconv8 takes an (N, C, H, W) int8 or float8_e4m3fn x, got {x.dtype} {tuple(x.shape)}")
    if k % 2 == 0 or not 3 <= k <= MAX_KERNEL:
        raise ValueError(f"lkcnn.dwconv8 takes odd kernels of 3 to {MAX_KERNEL} taps, got {k}")
    c = x.shape[1]
    shape, dtype, _ = table_shape(c, k, x.dtype)
    if table.dtype != dtype or tuple(table.shape) != shape:
        raise ValueError(f"lkcnn.dwconv8: table must be pack_weight of a ({c}, 1, {k}, {k}) kernel, got "
                         f"{table.dtype} {tuple(table.shape)}")
    if alpha.shape != (c,) or beta.shape != (c,) or alpha.dtype != torch.float32 or beta.dtype != torch.float32:
        raise ValueError(f"lkcnn.dwconv8: alpha and beta must be float32 vectors of {c} channels")
    if act not in ACTS:
        raise ValueError(f"lkcnn.dwconv8: act must be one of {ACTS}, got {act!r}")
    if out_scale is not None and (out_scale.numel() != 1 or out_dtype != x.dtype):
        raise ValueError(f"lkcnn.dwconv8: a quantized output is one-element out_scale and out_dtype {x.dtype}")
    if out_scale is None and out_dtype not in FLOAT_OUT:
        raise ValueError(f"lkcnn.dwconv8: without out_scale, out_dtype must be one of {FLOAT_OUT}")


@torch.library.custom_op("lkcnn::dwconv8", mutates_args=())
def dwconv8(x: Tensor, table: Tensor, k: int, alpha: Tensor, beta: Tensor, act: str, out_scale: Tensor | None,
            out_dtype: torch.dtype) -> Tensor:
    """grid(act(alpha[c] * correlate(x, w)[n, c] + beta[c])) as `out_dtype`, w the kernel `table` packs."""
    _check(x, table, k, alpha, beta, act, out_scale, out_dtype)
    return reference(x, table, k, alpha, beta, act, out_scale, out_dtype)


def reference(x: Tensor, table: Tensor, k: int, alpha: Tensor, beta: Tensor, act: str, out_scale: Tensor | None,
              out_dtype: torch.dtype) -> Tensor:
    """The op's arithmetic in torch ops: exact sums (products of 8-bit values summed in float64), then float32."""
    w = unpack_weight(table, k, x.dtype)
    sums = F.conv2d(x.double(), w.double(), padding=k // 2, groups=x.shape[1]).float()
    y = activate(sums * alpha.view(-1, 1, 1) + beta.view(-1, 1, 1), act)
    if out_scale is not None:
        return quantize_values(y, out_scale.reshape(()), x.dtype)
    return y.to(out_dtype)


@dwconv8.register_fake
def _(x: Tensor, table: Tensor, k: int, alpha: Tensor, beta: Tensor, act: str, out_scale: Tensor | None,
      out_dtype: torch.dtype) -> Tensor:
    return x.new_empty(x.shape, dtype=out_dtype)


@dwconv8.register_kernel("cuda")
def _(x: Tensor, table: Tensor, k: int, alpha: Tensor, beta: Tensor, act: str, out_scale: Tensor | None,
      out_dtype: torch.dtype) -> Tensor:
    _check(x, table, k, alpha, beta, act, out_scale, out_dtype)
    out = x.new_empty(x.shape, dtype=out_dtype)
    launch(x, table, k, alpha, beta, act, out_scale, out)
    return out


def launch(x: Tensor, table: Tensor, k: int, alpha: Tensor, beta: Tensor, act: str, out_scale: Tensor | None,
           out: Tensor) -> None:
    """Run the CUDA kernel into `out` (NCHW-contiguous; the GPU tests poison it first, then check every value)."""
    from lkcnn.ops import build  # the compiled extension, built on first use

    x = x.contiguous()
    if x.data_ptr() % 4:  # the kernel reads rows as aligned words
        x = x.clone()
    build.load().dwconv8_fwd(x, table, k, alpha.contiguous(), beta.contiguous(), ACTS.index(act),
                             None if out_scale is None else out_scale.reshape(1).float(), out)
