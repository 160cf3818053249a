"""The tiling that lkcnn's Triton normalization kernels share (lkcnn/ops/grn_triton.py, lkcnn/ops/bn_gelu_triton.py).

A tensor is read as groups of rows of channels, (N, R, C) contiguous: an NHWC activation, one group an image (GRN's
per-image sums) or one group of all N*H*W rows (BatchNorm's per-channel sums). A program works on tiles of rows by
channels (BLOCK_R x BLOCK_C for GELU + GRN's elementwise passes; its reductions and BatchNorm's passes have their
own below), channels innermost, so each row of a tile is one contiguous load and each per-channel term is loaded
once a tile. A reduction over a group's rows is split over several programs when the groups and channel blocks
alone give too few programs to fill the GPU; each split writes its partial result, which the caller merges (a
handful of rows per channel: deterministic, unlike atomics).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

BLOCK_R = 32
BLOCK_C = 128
WARPS = 8
# BatchNorm's passes over all of a tensor's rows take their own launch shapes, from a sweep of tiles, warps, waves and
# pipeline stages on an H200 at RepLKNet-31B's FFN shapes (scripts/triton_launch_shapes.py, docs/performance.md): the
# elementwise passes 16 x 128 tiles in 2 warps (32 values a thread in flight where the tiles above have 16: the
# gradient apply 1.22-1.29x the rate), the column reductions 32 x 64 tiles in 4 warps over ~4 waves of programs, their
# row loop software-pipelined (the next tiles' loads in flight while one is summed: 1.1-1.5x); one shape for both
# reductions and one for both elementwise passes, each within 2.1% of a pass's own best over the FFN's shapes.
APPLY_BLOCK_R = 16
APPLY_WARPS = 2
REDUCE_BLOCK_R = 32
REDUCE_BLOCK_C = 64
REDUCE_WARPS = 4
REDUCE_WAVES = 4
REDUCE_STAGES = 3
# GELU + GRN's two per-image reductions: 8 x 64 tiles in 4 warps over ~8 waves, from the same sweep at
# UniRepLKNet-B's MLP shapes (its weighted time 0.81x the 32 x 128 tiles in 8 warps that its elementwise passes keep,
# which were within 2.5% of their best).
GRN_REDUCE_BLOCK_R = 8
GRN_REDUCE_BLOCK_C = 64
GRN_REDUCE_WARPS = 4
GRN_REDUCE_WAVES = 8


@triton.jit
def load_tile(ptr, n, rows, cols, R, C, end):
    """The (rows, cols) tile of group n (R rows of C) as float32, zero at rows from `end` and columns past C; and
    its offsets and mask."""
    offs = tl.cast(n, tl.int64) * R * C + rows[:, None].to(tl.int64) * C + cols[None, :]
    mask = (rows[:, None] < end) & (cols[None, :] < C)
    return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32), offs, mask


@functools.cache
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def splits(n: int, r: int, c: int, device: torch.device, block_c: int, block_r: int, waves: int) -> tuple[int, int]:
    """(splits of each group's rows, rows a split): enough programs of `block_c` channels for ~`waves` waves of one
    program an SM, each split a whole number of `block_r`-row blocks."""
    programs = n * triton.cdiv(c, block_c)
    count = max(1, min(triton.cdiv(waves * sm_count(device), programs), triton.cdiv(r, block_r)))
    rows = triton.cdiv(triton.cdiv(r, count), block_r) * block_r
    return triton.cdiv(r, rows), rows
