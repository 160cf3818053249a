"""The Triton kernels behind `torch.ops.lkcnn.gemm8` (see lkcnn/ops/gemm8.py for what they compute).

One program computes a BLOCK_M x BLOCK_N tile of out = a @ w^T with tensor-core dots (Hopper: wgmma on FP8 / INT8
operands, both K-major as stored), then applies the whole epilogue to the tile in registers and stores it once.
Programs walk the tiles in groups of GROUP_M rows of tiles so that neighbouring programs share w's rows in L2.
Two kernels with one body: operands through TMA descriptors (the hardware copies whole tiles, clips them at the
tensor's edges, and the program holds no per-element addresses: 30-50% fewer registers on sm_90, no spills), and
through pointers with masks for operands TMA cannot take. Either kernel can write its output as channel planes
(`planes`: NCHW, for a consumer that reads them) through pointers instead of rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lkcnn.ops.triton_math import gelu

# 1.5 * 2^23: y + ROUND rounds a float32 |y| < 2^22 half to even, the result's bits are 0x4B400000 + round(y)
ROUND = tl.constexpr(12582912.0)
# Hopper's FP8 tensor cores add products into an accumulator of about 14 mantissa bits (Triton's default there lets
# the whole K run so); adding each 32-deep product into the float32 accumulator keeps float32 sums, as cuBLASLt does
# without its fast-accumulation mode
FP8_PRECISE_K = tl.constexpr(32)
KEY = ["M", "N", "K", "ACT", "GRID", "HAS_RES", "DEQUANT", "NEXT_GRID", "PLANE_VEC"]


def _config(m: int, n: int, k: int, warps: int, stages: int, pre_hook=None) -> triton.Config:
    return triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8}, num_warps=warps,
                         num_stages=stages, pre_hook=pre_hook)


# Most of these GEMMs have K = 128-1024 and stream far more output than they multiply: what pays is tiles in flight
# per SM (few pipeline stages, registers under 128 a thread for two 8-warp programs), not deep K pipelines.
CONFIGS = [_config(128, 128, 128, 8, 2), _config(128, 128, 128, 8, 3), _config(64, 128, 128, 4, 3),
           _config(128, 64, 128, 4, 3), _config(64, 64, 128, 4, 3)]


@triton.jit
def _tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    tiles_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * tiles_n
    first_m = (pid // group) * GROUP_M
    rows = min(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    return (first_m + (pid % group) % rows) * BLOCK_M, ((pid % group) // rows) * BLOCK_N


@triton.jit
def _dot(a, w_t, acc, IS_INT: tl.constexpr):
    if IS_INT:
        acc = tl.dot(a, w_t, acc, out_dtype=tl.int32)
    else:
        acc = tl.dot(a, w_t, acc, max_num_imprecise_acc=FP8_PRECISE_K, out_dtype=tl.float32)
    return acc


@triton.jit
def _scale_act(acc, alpha_ptr, beta_ptr, offs_n, N, ACT: tl.constexpr):
    n_in = offs_n < N
    alpha = tl.load(alpha_ptr + offs_n, mask=n_in, other=0.0)
    beta = tl.load(beta_ptr + offs_n, mask=n_in, other=0.0)
    y = acc.to(tl.float32) * alpha[None, :] + beta[None, :]
    if ACT == 1:
        y = tl.maximum(y, 0.0)
    elif ACT == 2:
        y = gelu(y)
    return y


@triton.jit
def _quotient(y, scale, SIGNED_ZERO: tl.constexpr):
    """y / scale correctly rounded, as QuantizeLinear divides (a reciprocal multiply alone rounds differently),
    without `div_rn`'s branch to its slow path for every element, which serialized the epilogue: the correctly
    rounded reciprocal, then two corrections by the exact remainder (Markstein's; the second starts within half an
    ulp, so it rounds correctly), as lkcnn's 8-bit large kernel does (csrc/dwconv8/dwconv8_device.cuh). |y| is
    first clamped to 1024 scales, where every 8-bit grid has saturated, so nothing overflows. With SIGNED_ZERO a
    zero keeps its sign (e4m3 has a -0; int8 has one zero, so its epilogues skip that select)."""
    inv = tl.div_rn(1.0, scale)
    c = tl.minimum(tl.maximum(y, -1024.0 * scale), 1024.0 * scale)
    q = c * inv
    q = tl.fma(tl.fma(-q, scale, c), inv, q)
    q = tl.fma(tl.fma(-q, scale, c), inv, q)
    if SIGNED_ZERO:
        q = tl.where(y == 0.0, y, q)
    return q


@triton.jit
def _quantize(y, scale_ptr, GRID: tl.constexpr, DEQUANT: tl.constexpr):
    if GRID != 0:
        scale = tl.load(scale_ptr)
        y = _quotient(y, scale, GRID != 1)
        if GRID == 1:  # int8
            y = tl.minimum(tl.maximum(y, -128.0), 127.0) + ROUND  # saturating first rounds as torch.round does
            if DEQUANT:
                y = y - ROUND
            else:  # the sum's low byte is the rounded value in two's complement: no float-to-int conversion, which
                y = y.to(tl.int32, bitcast=True).to(tl.int8)  # runs at a quarter of the FMA rate on Hopper
        else:  # float8_e4m3fn: saturate, then the cast rounds to nearest even
            y = tl.minimum(tl.maximum(y, -448.0), 448.0).to(tl.float8e4nv)
        if DEQUANT:
            y = y.to(tl.float32) * scale
    return y


@triton.jit
def _next_input(stored, a2_ptr, b2_ptr, scale2_ptr, offs_n, N, NEXT_GRID: tl.constexpr):
    """The next layer's 8-bit input from this output as stored: its per-channel affine (a folded BatchNorm), then
    QuantizeLinear onto the next layer's grid."""
    n_in = offs_n < N
    a2 = tl.load(a2_ptr + offs_n, mask=n_in, other=0.0)
    b2 = tl.load(b2_ptr + offs_n, mask=n_in, other=0.0)
    return _quantize(stored.to(tl.float32) * a2[None, :] + b2[None, :], scale2_ptr, NEXT_GRID, False)


@triton.jit
def _store_planes(out_ptr, y, offs_m, offs_n, M, N, HW, VEC: tl.constexpr):
    """The tile into an (M // HW, N, HW) output: each image's channel planes (NCHW), row m of image m // HW at
    pixel m % HW. VEC divides HW and the tile's first row, so each VEC rows lie in one image, consecutive in a
    plane: the hints let Triton store them as one VEC-byte vector (a warp writes 32 VEC bytes of one plane)."""
    image = offs_m // HW
    rows = tl.max_contiguous(tl.multiple_of(image.to(tl.int64) * N * HW + (offs_m - image * HW), VEC), VEC)
    planes = tl.multiple_of(offs_n.to(tl.int64) * HW, VEC)
    inside = tl.max_constancy(offs_m < M, VEC)
    ptrs = out_ptr + rows[:, None] + planes[None, :]
    tl.store(ptrs, y, mask=inside[:, None] & (offs_n[None, :] < N))


@triton.autotune(configs=CONFIGS, key=KEY)
@triton.jit
def _gemm8_kernel(a_ptr, w_ptr, alpha_ptr, beta_ptr, res_ptr, out_ptr, scale_ptr, a2_ptr, b2_ptr, next_ptr,
                  scale2_ptr, M, N, K, HW, stride_am, stride_wn, stride_rm, stride_om, stride_xm,
                  ACT: tl.constexpr, GRID: tl.constexpr, HAS_RES: tl.constexpr, DEQUANT: tl.constexpr,
                  NEXT_GRID: tl.constexpr, PLANE_VEC: tl.constexpr, IS_INT: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    off_m, off_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None]  # the (BLOCK_K, BLOCK_N) tile of w^T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32 if IS_INT else tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        w = tl.load(w_ptrs, mask=(offs_n[None, :] < N) & (offs_k[:, None] < k_left), other=0.0)
        acc = _dot(a, w, acc, IS_INT)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y = _scale_act(acc, alpha_ptr, beta_ptr, offs_n, N, ACT)
    inside = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    rows64 = offs_m[:, None].to(tl.int64)
    if HAS_RES:
        y += tl.load(res_ptr + rows64 * stride_rm + offs_n[None, :], mask=inside, other=0.0).to(tl.float32)
    y = _quantize(y, scale_ptr, GRID, DEQUANT).to(out_ptr.dtype.element_ty)
    if PLANE_VEC == 0:
        tl.store(out_ptr + rows64 * stride_om + offs_n[None, :], y, mask=inside)
    else:
        _store_planes(out_ptr, y, offs_m, offs_n, M, N, HW, PLANE_VEC)
    if NEXT_GRID != 0:
        x = _next_input(y, a2_ptr, b2_ptr, scale2_ptr, offs_n, N, NEXT_GRID)
        tl.store(next_ptr + rows64 * stride_xm + offs_n[None, :], x.to(next_ptr.dtype.element_ty), mask=inside)


def _tma_blocks(nargs) -> None:
    """Autotune pre-hook: the descriptors' boxes follow the config's tile."""
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [bm, bk]
    nargs["w_desc"].block_shape = [bn, bk]
    nargs["res_desc"].block_shape = [bm, bn]
    nargs["out_desc"].block_shape = [bm, bn]
    nargs["next_desc"].block_shape = [bm, bn]


def _tma_config(m: int, n: int, warps: int, stages: int, per_sm: int, maxnreg: int | None = None) -> triton.Config:
    return triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": 128, "GROUP_M": 8, "PER_SM": per_sm},
                         num_warps=warps, num_stages=stages, maxnreg=maxnreg, pre_hook=_tma_blocks)


# PER_SM: persistent programs per SM, as many as its registers and shared memory hold (sm_90: 150-190 registers a
# thread at 8 warps for 128 x 128 tiles, 120-200 at 4 warps for 64-row ones; capped at 128 two fit, with spills).
# 64 x 64 tiles for the few rows of small batches (batch 1: 49-3136 rows), where larger tiles leave most SMs idle.
TMA_CONFIGS = [_tma_config(128, 128, 8, 2, 1), _tma_config(128, 128, 8, 2, 2, maxnreg=128),
               _tma_config(128, 64, 4, 3, 2), _tma_config(64, 128, 4, 3, 2), _tma_config(64, 64, 4, 3, 4)]


@triton.autotune(configs=TMA_CONFIGS, key=KEY)
@triton.jit
def _gemm8_tma_kernel(a_desc, w_desc, alpha_ptr, beta_ptr, res_desc, out_desc, out_ptr, scale_ptr, a2_ptr, b2_ptr,
                      next_desc, scale2_ptr, M, N, K, HW, ACT: tl.constexpr, GRID: tl.constexpr,
                      HAS_RES: tl.constexpr, DEQUANT: tl.constexpr, NEXT_GRID: tl.constexpr,
                      PLANE_VEC: tl.constexpr, IS_INT: tl.constexpr, NUM_SMS: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PER_SM: tl.constexpr):
    # persistent: NUM_SMS * PER_SM programs walk the tiles; the flattened loop lets the pipeliner load the next
    # tile's operands while this one's epilogue runs (most of these GEMMs are one 128-deep K step per tile)
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), tiles, NUM_SMS * PER_SM, flatten=True):
        off_m, off_n = _tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32 if IS_INT else tl.float32)
        for k in range(0, k_steps):  # TMA fills the rows and columns past the tensor with zeros
            acc = _dot(a_desc.load([off_m, k * BLOCK_K]), w_desc.load([off_n, k * BLOCK_K]).T, acc, IS_INT)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        y = _scale_act(acc, alpha_ptr, beta_ptr, offs_n, N, ACT)
        if HAS_RES:
            y += res_desc.load([off_m, off_n]).to(tl.float32)
        y = _quantize(y, scale_ptr, GRID, DEQUANT).to(out_desc.dtype)
        if PLANE_VEC == 0:
            out_desc.store([off_m, off_n], y)  # TMA writes only the part inside the tensor
        else:
            _store_planes(out_ptr, y, off_m + tl.arange(0, BLOCK_M), offs_n, M, N, HW, PLANE_VEC)
        if NEXT_GRID != 0:
            x = _next_input(y, a2_ptr, b2_ptr, scale2_ptr, offs_n, N, NEXT_GRID)
            next_desc.store([off_m, off_n], x.to(next_desc.dtype))


def tma_ok(*tensors) -> bool:
    """TMA's rules for every 2-D operand: 16-byte aligned base and row stride, contiguous rows."""
    return all(t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
               for t in tensors)


def run(a, w, alpha, beta, residual, out, scale, m: int, n: int, k: int, act: int, grid_id: int, *, is_int: bool,
        dequant: bool, one_config: bool = False, next_input=None, planes: int = 0) -> None:
    """Launch over every output tile (arguments as checked by lkcnn.ops.gemm8): the TMA kernel where every operand
    meets TMA's alignment (channel counts in multiples of 16), else the pointer kernel; autotuned, or with
    `one_config` the last tile configuration of its list alone (the GPU tests: one compile per epilogue instead of
    one per config).
    `next_input`: (affine scale, affine shift, 8-bit output, its scale, its grid id) of the next layer's input.
    `planes`: out is (m // planes, n, planes), each image's channel planes, stored through pointers."""
    rows = out.view(m, n)  # with planes, the output's memory as rows: a placeholder for the kernels' row store
    a2, b2, nxt, scale2, next_grid = next_input or (alpha, beta, rows, scale, 0)
    vec = next(v for v in (16, 8, 4, 2, 1) if planes % v == 0) if planes else 0  # every tile starts at 64 rows
    consts = dict(ACT=act, GRID=grid_id, HAS_RES=residual is not None, DEQUANT=dequant, NEXT_GRID=next_grid,
                  PLANE_VEC=vec, IS_INT=is_int)
    tensors = (a, w, rows, nxt) if residual is None else (a, w, rows, nxt, residual)
    use_tma = tma_ok(*tensors)
    kernel = _gemm8_tma_kernel if use_tma else _gemm8_kernel
    config, meta = None, {}
    if one_config:
        config = (TMA_CONFIGS if use_tma else CONFIGS)[-1]
        kernel = kernel.fn
        meta = {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}

    def grid(tile):
        tiles = triton.cdiv(m, tile["BLOCK_M"]) * triton.cdiv(n, tile["BLOCK_N"])
        return (min(tiles, tile["NUM_SMS"] * tile["PER_SM"]),) if use_tma else (tiles,)
    if use_tma:
        consts["NUM_SMS"] = torch.cuda.get_device_properties(a.device).multi_processor_count
        from triton.tools.tensor_descriptor import TensorDescriptor
        box = [config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]] if config else [1, 1]  # the pre-hook sets them
        descs = [TensorDescriptor.from_tensor(t, box)
                 for t in (a, w, rows if residual is None else residual, rows, nxt)]
        if config:
            descs[0].block_shape = [config.kwargs["BLOCK_M"], config.kwargs["BLOCK_K"]]
            descs[1].block_shape = [config.kwargs["BLOCK_N"], config.kwargs["BLOCK_K"]]
        kernel[grid](descs[0], descs[1], alpha, beta, descs[2], descs[3], out, scale, a2, b2, descs[4], scale2, m, n,
                     k, max(planes, 1), **consts, **meta)
    else:
        kernel[grid](a, w, alpha, beta, rows if residual is None else residual, out, scale, a2, b2, nxt, scale2, m,
                     n, k, max(planes, 1), a.stride(0), w.stride(0), 0 if residual is None else residual.stride(0),
                     rows.stride(0), nxt.stride(0), **consts, **meta)
