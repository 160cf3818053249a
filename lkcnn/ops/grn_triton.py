"""The Triton kernels behind `lkcnn.ops.gelu_grn` (see lkcnn/ops/grn.py for what they compute).

Every tensor is an image's rows of channels, (N, R, C) contiguous: the NHWC output of the linear layer before the
GELU, tiled as lkcnn/ops/triton_tiles.py says. The two reductions sum over an image's rows for each channel (GRN's
norm, its gradient's terms), split over programs where needed, each split writing its partial sums, which the caller
adds. GELU is nn.GELU()'s erf form from lkcnn/ops/triton_math.py: with libdevice's erf, its arithmetic rather than
memory bounded these kernels (1.1-2.8 TB/s on an H200).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lkcnn.ops.triton_math import gelu, normal_cdf_pdf
from lkcnn.ops.triton_tiles import (BLOCK_C, BLOCK_R, GRN_REDUCE_BLOCK_C, GRN_REDUCE_BLOCK_R, GRN_REDUCE_WARPS,
                                    GRN_REDUCE_WAVES, WARPS, load_tile, splits)


@triton.jit
def _grn_sumsq_kernel(h_ptr, part_ptr, R, C, rows_per_split, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """part[n, s, c] = sum of GELU(h)^2 over split s of image n's rows."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    s, n = tl.program_id(1), tl.program_id(2)
    first = s * rows_per_split
    end = tl.minimum(first + rows_per_split, R)
    acc = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)
    for r in range(0, rows_per_split, BLOCK_R):
        rows = first + r + tl.arange(0, BLOCK_R)
        x = gelu(load_tile(h_ptr, n, rows, cols, R, C, end)[0])
        acc += x * x
    tl.store(part_ptr + (n * tl.num_programs(1) + s).to(tl.int64) * C + cols, tl.sum(acc, axis=0), mask=cols < C)


@triton.jit
def _grn_apply_kernel(h_ptr, scale_ptr, beta_ptr, out_ptr, R, C, HAS_BETA: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_C: tl.constexpr):
    """out = GELU(h) * scale[n, c] + beta[c]."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    n = tl.program_id(2)
    h, offs, mask = load_tile(h_ptr, n, rows, cols, R, C, R)
    scale = tl.load(scale_ptr + n.to(tl.int64) * C + cols, mask=cols < C, other=0.0)
    out = gelu(h) * scale[None, :]
    if HAS_BETA:
        out += tl.load(beta_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _grn_grad_sums_kernel(g_ptr, h_ptr, part_ptr, N, R, C, rows_per_split, BLOCK_R: tl.constexpr,
                          BLOCK_C: tl.constexpr):
    """part[0, n, s, c] = sum of g * GELU(h) and part[1, n, s, c] = sum of g over split s of image n's rows."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    s, n = tl.program_id(1), tl.program_id(2)
    first = s * rows_per_split
    end = tl.minimum(first + rows_per_split, R)
    acc_gx = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)
    acc_g = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)
    for r in range(0, rows_per_split, BLOCK_R):
        rows = first + r + tl.arange(0, BLOCK_R)
        g, _, _ = load_tile(g_ptr, n, rows, cols, R, C, end)
        h, _, _ = load_tile(h_ptr, n, rows, cols, R, C, end)
        acc_gx += g * gelu(h)
        acc_g += g
    offs = (n * tl.num_programs(1) + s).to(tl.int64) * C + cols
    tl.store(part_ptr + offs, tl.sum(acc_gx, axis=0), mask=cols < C)
    tl.store(part_ptr + N * tl.num_programs(1) * C + offs, tl.sum(acc_g, axis=0), mask=cols < C)


@triton.jit
def _grn_grad_apply_kernel(g_ptr, h_ptr, scale_ptr, t_ptr, dh_ptr, R, C, BLOCK_R: tl.constexpr,
                           BLOCK_C: tl.constexpr):
    """dh = (g * scale[n, c] + GELU(h) * t[n, c]) * GELU'(h), GELU'(h) = Phi(h) + h * phi(h)."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    n = tl.program_id(2)
    g, offs, mask = load_tile(g_ptr, n, rows, cols, R, C, R)
    h, _, _ = load_tile(h_ptr, n, rows, cols, R, C, R)
    scale = tl.load(scale_ptr + n.to(tl.int64) * C + cols, mask=cols < C, other=0.0)
    t = tl.load(t_ptr + n.to(tl.int64) * C + cols, mask=cols < C, other=0.0)
    cdf, pdf = normal_cdf_pdf(h)
    dx = g * scale[None, :] + h * cdf * t[None, :]
    dh = dx * (cdf + h * pdf)
    tl.store(dh_ptr + offs, dh.to(dh_ptr.dtype.element_ty), mask=mask)


def reduction_splits(n: int, r: int, c: int, device: torch.device) -> tuple[int, int]:
    """(splits of each image's rows, rows a split) of the two reductions over an (n, r, c) tensor."""
    return splits(n, r, c, device, GRN_REDUCE_BLOCK_C, GRN_REDUCE_BLOCK_R, GRN_REDUCE_WAVES)


def sumsq(h: torch.Tensor, part: torch.Tensor) -> None:
    """part (N, splits, C) float32 = the partial sums of GELU(h)^2 over each image's rows; h (N, R, C) contiguous."""
    n, r, c = h.shape
    _grn_sumsq_kernel[(triton.cdiv(c, GRN_REDUCE_BLOCK_C), part.shape[1], n)](
        h, part, r, c, reduction_splits(n, r, c, h.device)[1], BLOCK_R=GRN_REDUCE_BLOCK_R,
        BLOCK_C=GRN_REDUCE_BLOCK_C, num_warps=GRN_REDUCE_WARPS)


def apply(h: torch.Tensor, scale: torch.Tensor, beta: torch.Tensor | None, out: torch.Tensor) -> None:
    """out = GELU(h) * scale[n, c] (+ beta[c]); h and out (N, R, C) contiguous, scale (N, C) float32."""
    n, r, c = h.shape
    _grn_apply_kernel[(triton.cdiv(c, BLOCK_C), triton.cdiv(r, BLOCK_R), n)](
        h, scale, scale if beta is None else beta, out, r, c, HAS_BETA=beta is not None, BLOCK_R=BLOCK_R,
        BLOCK_C=BLOCK_C, num_warps=WARPS)


def grad_sums(g: torch.Tensor, h: torch.Tensor, part: torch.Tensor) -> None:
    """part (2, N, splits, C) float32 = the partial sums over each image's rows of g * GELU(h) and of g."""
    n, r, c = h.shape
    _grn_grad_sums_kernel[(triton.cdiv(c, GRN_REDUCE_BLOCK_C), part.shape[2], n)](
        g, h, part, n, r, c, reduction_splits(n, r, c, h.device)[1], BLOCK_R=GRN_REDUCE_BLOCK_R,
        BLOCK_C=GRN_REDUCE_BLOCK_C, num_warps=GRN_REDUCE_WARPS)


def grad_apply(g: torch.Tensor, h: torch.Tensor, scale: torch.Tensor, t: torch.Tensor, dh: torch.Tensor) -> None:
    """dh = (g * scale[n, c] + GELU(h) * t[n, c]) * GELU'(h); scale and t (N, C) float32."""
    n, r, c = h.shape
    _grn_grad_apply_kernel[(triton.cdiv(c, BLOCK_C), triton.cdiv(r, BLOCK_R), n)](
        g, h, scale, t, dh, r, c, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, num_warps=WARPS)
