"""`torch.ops.lkcnn.gemm8`: an 8-bit GEMM (INT8 or FP8 e4m3 operands) whose epilogue does what an 8-bit inference
engine fuses after a 1x1 convolution: per-output-channel scale and shift (the operands' scales, the bias and a
folded BatchNorm), ReLU or GELU, a residual addition, and the quantization of the result for the next 8-bit layer.

    out = grid(act(acc * alpha[n] + beta[n]) + residual)      acc[m, n] = sum_k a[m, k] * w[n, k]

`grid` is the identity, or QuantizeLinear with `out_scale` onto `quant`'s grid (int8: round half to even, saturate
at [-128, 127]; float8_e4m3fn: round to nearest even, saturate at +-448), written either as 8-bit values (`out_dtype`
the 8-bit dtype: the next GEMM's input) or dequantized (`out_dtype` a float dtype: the input of a layer that computes
in float on 8-bit values). With `planes` = P > 0 the output is written as (M / P, N, P): each group of P rows (an
image's pixels) as channel planes, NCHW, for a consumer that reads planes (the 8-bit large depthwise convolution)
without a layout copy.

Why our own kernel: cuBLASLt's 8-bit GEMMs behind `torch._scaled_mm` / `torch._int_mm` take a bias at most, so every
BatchNorm, activation, residual addition and quantization after them was a pass of its own over the GEMM's output
(written in bfloat16 or int32) - more GPU time than the GEMMs. On a GPU the op runs one Triton kernel (its GELU
within 4e-7 |y| of the erf form, lkcnn/ops/gemm8_triton.py); elsewhere (and as the tests' oracle) the same
arithmetic in torch ops.

`torch.ops.lkcnn.gemm8_next` is gemm8 with a float output that also writes, from that output as stored, the next
layer's 8-bit input through a per-channel affine (the BatchNorm before a residual block's first GEMM):

    out = act(acc * alpha[n] + beta[n]) + residual      next = QuantizeLinear(out * next_alpha[n] + next_beta[n])

`torch.ops.lkcnn.gemm8_lt` is the FP8 GEMM of cuBLASLt itself with the epilogue cuBLASLt offers, called from lkcnn's
extension (csrc/gemm8/gemm8_lt.cu) because `torch._scaled_mm` passes no activation or residual:

    out = act(acc * alpha[n] + bias[n]) + residual      (a residual with act "none" only)

in a 16- or 32-bit output (cuBLASLt writes no FP8 under per-channel scaling, so a following quantization is a torch
op that inductor fuses into the next pass), its GELU the tanh form, its bias in the dtype cuBLASLt takes with that
output (`LT_BIAS_DTYPES`).
"""
from __future__ import annotations

import torch
from torch import Tensor

from lkcnn.ops.qdq import DTYPE_NAMES, dequantize_values, quantize_values

ACTS = ("none", "relu", "gelu")
LT_ACTS = ("none", "relu", "gelu_tanh")  # cuBLASLt's epilogue activations
# output dtype -> bias dtype of cuBLASLt's FP8 kernels: the output's, but bfloat16 for a float32 output
LT_BIAS_DTYPES = {torch.bfloat16: torch.bfloat16, torch.float16: torch.float16, torch.float32: torch.bfloat16}
LT_OUT_DTYPES = tuple(LT_BIAS_DTYPES)
GRIDS = ("", *DTYPE_NAMES)  # "" = no quantization of the output


def _check(a: Tensor, w: Tensor, alpha: Tensor, beta: Tensor, residual: Tensor | None, act: str, quant: str,
           out_scale: Tensor | None, out_dtype: torch.dtype, planes: int = 0) -> None:
    if a.dtype not in DTYPE_NAMES.values() or w.dtype != a.dtype:
        raise ValueError(f"lkcnn.gemm8 takes int8 or float8_e4m3fn operands of one dtype, got {a.dtype} and {w.dtype}")
    if a.dim() != 2 or w.dim() != 2 or a.shape[1] != w.shape[1]:
        raise ValueError(f"lkcnn.gemm8 multiplies (M, K) by (N, K)^T, got {tuple(a.shape)} and {tuple(w.shape)}")
    n = w.shape[0]
    if alpha.shape != (n,) or beta.shape != (n,) or alpha.dtype != torch.float32 or beta.dtype != torch.float32:
        raise ValueError(f"lkcnn.gemm8: alpha and beta must be float32 vectors of {n} output channels")
    if residual is not None and residual.shape != (a.shape[0], n):
        raise ValueError(f"lkcnn.gemm8: residual {tuple(residual.shape)} is not the output's {(a.shape[0], n)}")
    if act not in ACTS or quant not in GRIDS:
        raise ValueError(f"lkcnn.gemm8: act must be one of {ACTS} and quant one of {GRIDS}, got {act!r}, {quant!r}")
    if quant and (out_scale is None or out_scale.numel() != 1):
        raise ValueError("lkcnn.gemm8: a quantized output needs a one-element out_scale")
    if out_dtype in DTYPE_NAMES.values() and out_dtype != DTYPE_NAMES.get(quant):
        raise ValueError(f"lkcnn.gemm8: an {out_dtype} output needs quant={str(out_dtype).split('.')[-1]!r}")
    if planes < 0 or (planes and a.shape[0] % planes):
        raise ValueError(f"lkcnn.gemm8: planes must be 0 (rows) or divide the {a.shape[0]} rows, got {planes}")


@torch.library.custom_op("lkcnn::gemm8", mutates_args=())
def gemm8(a: Tensor, w: Tensor, alpha: Tensor, beta: Tensor, residual: Tensor | None, act: str, quant: str,
          out_scale: Tensor | None, out_dtype: torch.dtype, planes: int = 0) -> Tensor:
    """out[m, n] = grid(act(sum_k a[m, k] w[n, k] * alpha[n] + beta[n]) + residual[m, n]) as `out_dtype`; with
    `planes` = P, as (M / P, N, P) channel planes."""
    _check(a, w, alpha, beta, residual, act, quant, out_scale, out_dtype, planes)
    return as_planes(reference(a, w, alpha, beta, residual, act, quant, out_scale, out_dtype), planes)


def as_planes(rows: Tensor, planes: int) -> Tensor:
    """(M, N) rows as (M / planes, N, planes) channel planes (contiguous); planes 0: the rows."""
    if not planes:
        return rows
    return rows.view(-1, planes, rows.shape[1]).transpose(1, 2).contiguous()


def _out_shape(a: Tensor, w: Tensor, planes: int) -> tuple[int, ...]:
    return (a.shape[0] // planes, w.shape[0], planes) if planes else (a.shape[0], w.shape[0])


def _scaled_sums(a: Tensor, w: Tensor, alpha: Tensor) -> Tensor:
    """sum_k a[m, k] w[n, k] * alpha[n] in float32 after exact sums (products of 8-bit values summed in float64)."""
    return (a.double() @ w.double().t()).float() * alpha


def activate(y: Tensor, act: str) -> Tensor:
    """The 8-bit ops' activation: "none", "relu", "gelu" (erf form) or "gelu_tanh"."""
    if act == "relu":
        return torch.relu(y)
    if act in ("gelu", "gelu_tanh"):
        return torch.nn.functional.gelu(y, approximate="tanh" if act == "gelu_tanh" else "none")
    return y


def reference(a: Tensor, w: Tensor, alpha: Tensor, beta: Tensor, residual: Tensor | None, act: str, quant: str,
              out_scale: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    """The op's arithmetic in torch ops, float32 after exact sums (products of 8-bit values summed in float64)."""
    y = activate(_scaled_sums(a, w, alpha) + beta, act)
    if residual is not None:
        y = y + residual.float()
    if quant:
        q = quantize_values(y, out_scale.reshape(()), DTYPE_NAMES[quant])
        y = q if out_dtype == q.dtype else dequantize_values(q, out_scale.reshape(()))
    return y.to(out_dtype)


@gemm8.register_fake
def _(a: Tensor, w: Tensor, alpha: Tensor, beta: Tensor, residual: Tensor | None, act: str, quant: str,
      out_scale: Tensor | None, out_dtype: torch.dtype, planes: int = 0) -> Tensor:
    return a.new_empty(_out_shape(a, w, planes), dtype=out_dtype)


@gemm8.register_kernel("cuda")
def _(a: Tensor, w: Tensor, alpha: Tensor, beta: Tensor, residual: Tensor | None, act: str, quant: str,
      out_scale: Tensor | None, out_dtype: torch.dtype, planes: int = 0) -> Tensor:
    _check(a, w, alpha, beta, residual, act, quant, out_scale, out_dtype, planes)
    out = a.new_empty(_out_shape(a, w, planes), dtype=out_dtype)
    launch(a, w, alpha, beta, residual, act, quant, out_scale, out, planes=planes)
    return out


def launch(a: Tensor, w: Tensor, alpha: Tensor, beta: Tensor, residual: Tensor | None, act: str, quant: str,
           out_scale: Tensor | None, out: Tensor, one_config: bool = False,
           next_input: tuple[Tensor, Tensor, str, Tensor, Tensor] | None = None, planes: int = 0) -> None:
    """Run the Triton kernel into `out` (contiguous; the GPU tests poison it first, then check every value),
    autotuned or with one tile configuration; with `next_input` (gemm8_next's next_alpha, next_beta, next_quant,
    next_scale and the 8-bit output) into that output too; with `planes`, out as gemm8's channel planes."""
    from lkcnn.ops import gemm8_triton  # Triton is imported only where a GPU runs the kernel

    a, w = a.contiguous(), w.contiguous()
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    m, k = a.shape
    n = w.shape[0]
    grid_id = GRIDS.index(quant)
    gemm8_triton.run(a, w, alpha.contiguous(), beta.contiguous(), residual, out,
                     alpha if out_scale is None else out_scale.reshape(1), m, n, k, ACTS.index(act), grid_id,
                     is_int=a.dtype == torch.int8, dequant=bool(quant) and out.dtype not in DTYPE_NAMES.values(),
                     one_config=one_config, planes=planes, next_input=None if next_input is None else (
                         next_input[0].contiguous(), next_input[1].contiguous(), next_input[4],
                         next_input[3].reshape(1), GRIDS.index(next_input[2])))


def _check_next(n: int, out_dtype: torch.dtype, next_alpha: Tensor, next_beta: Tensor, next_quant: str,
                next_scale: Tensor) -> None:
    if out_dtype in DTYPE_NAMES.values():
        raise ValueError(f"lkcnn.gemm8_next writes a float output and the next layer's 8-bit input, got {out_dtype}")
    if next_alpha.shape != (n,) or next_beta.shape != (n,) or next_alpha.dtype != torch.float32 \
            or next_beta.dtype != torch.float32:
        raise ValueError(f"lkcnn.gemm8_next: next_alpha and next_beta must be float32 vectors of {n} channels")
    if next_quant not in DTYPE_NAMES or next_scale.numel() != 1:
        raise ValueError(f"lkcnn.gemm8_next: next_quant must be one of {tuple(DTYPE_NAMES)} and next_scale one value")


@torch.library.custom_op("lkcnn::gemm8_next", mutates_args=())
def gemm8_next(a: Tensor, w: Tensor, alpha: Tensor, beta: Tensor, residual: Tensor | None, act: str,
               out_dtype: torch.dtype, next_alpha: Tensor, next_beta: Tensor, next_quant: str,
               next_scale: Tensor) -> tuple[Tensor, Tensor]:
    """gemm8 with a float output, and from that output as stored the next layer's 8-bit input in the same pass:
    next[m, n] = QuantizeLinear(out[m, n] * next_alpha[n] + next_beta[n], next_scale) on `next_quant`'s grid (the
    BatchNorm before a residual block's first GEMM, folded: in a RepLKNet stage the last GEMM of one block writes
    the next block's input, which was a pass of its own over the residual stream)."""
    _check_next(w.shape[0], out_dtype, next_alpha, next_beta, next_quant, next_scale)
    _check(a, w, alpha, beta, residual, act, "", None, out_dtype)
    return reference_next(a, w, alpha, beta, residual, act, out_dtype, next_alpha, next_beta, next_quant, next_scale)


def reference_next(a: Tensor, w: Tensor, alpha: Tensor, beta: Tensor, residual: Tensor | None, act: str,
                   out_dtype: torch.dtype, next_alpha: Tensor, next_beta: Tensor, next_quant: str,
                   next_scale: Tensor) -> tuple[Tensor, Tensor]:
    """gemm8_next's arithmetic in torch ops: `reference`, then the affine and QuantizeLinear in float32."""
    out = reference(a, w, alpha, beta, residual, act, "", None, out_dtype)
    return out, quantize_values(out.float() * next_alpha + next_beta, next_scale.reshape(()), DTYPE_NAMES[next_quant])


@gemm8_next.register_fake
def _(a: Tensor, w: Tensor, alpha: Tensor, beta: Tensor, residual: Tensor | None, act: str, out_dtype: torch.dtype,
      next_alpha: Tensor, next_beta: Tensor, next_quant: str, next_scale: Tensor) -> tuple[Tensor, Tensor]:
    shape = (a.shape[0], w.shape[0])
    return a.new_empty(shape, dtype=out_dtype), a.new_empty(shape, dtype=DTYPE_NAMES[next_quant])


@gemm8_next.register_kernel("cuda")
def _(a: Tensor, w: Tensor, alpha: Tensor, beta: Tensor, residual: Tensor | None, act: str, out_dtype: torch.dtype,
      next_alpha: Tensor, next_beta: Tensor, next_quant: str, next_scale: Tensor) -> tuple[Tensor, Tensor]:
    _check_next(w.shape[0], out_dtype, next_alpha, next_beta, next_quant, next_scale)
    _check(a, w, alpha, beta, residual, act, "", None, out_dtype)
    out = a.new_empty((a.shape[0], w.shape[0]), dtype=out_dtype)
    nxt = a.new_empty(out.shape, dtype=DTYPE_NAMES[next_quant])
    launch(a, w, alpha, beta, residual, act, "", None, out, next_input=(next_alpha, next_beta, next_quant, next_scale,
                                                                        nxt))
    return out, nxt


def _check_lt(a: Tensor, w: Tensor, alpha: Tensor, bias: Tensor | None, residual: Tensor | None, act: str,
              out_dtype: torch.dtype) -> None:
    if a.dtype != torch.float8_e4m3fn or w.dtype != a.dtype:
        raise ValueError(f"lkcnn.gemm8_lt takes float8_e4m3fn operands, got {a.dtype} and {w.dtype}")
    if a.dim() != 2 or w.dim() != 2 or a.shape[1] != w.shape[1]:
        raise ValueError(f"lkcnn.gemm8_lt multiplies (M, K) by (N, K)^T, got {tuple(a.shape)} and {tuple(w.shape)}")
    n = w.shape[0]
    if a.shape[1] % 16 or n % 16:
        raise ValueError(f"lkcnn.gemm8_lt: cuBLASLt's FP8 GEMMs take channels in multiples of 16, got {a.shape[1]} "
                         f"-> {n}")
    if alpha.shape != (n,) or alpha.dtype != torch.float32:
        raise ValueError(f"lkcnn.gemm8_lt: alpha must be a float32 vector of {n} output channels")
    if out_dtype not in LT_OUT_DTYPES or act not in LT_ACTS:
        raise ValueError(f"lkcnn.gemm8_lt: out_dtype must be one of {LT_OUT_DTYPES} and act one of {LT_ACTS}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != LT_BIAS_DTYPES[out_dtype]):
        raise ValueError(f"lkcnn.gemm8_lt: bias must be {n} values of {LT_BIAS_DTYPES[out_dtype]} "
                         f"(with {out_dtype} out)")
    if residual is not None and (residual.shape != (a.shape[0], n) or residual.dtype != out_dtype or act != "none"):
        raise ValueError(f"lkcnn.gemm8_lt: residual must be {(a.shape[0], n)} of {out_dtype}, with act 'none' "
                         "(cuBLASLt adds it before the activation)")


@torch.library.custom_op("lkcnn::gemm8_lt", mutates_args=())
def gemm8_lt(a: Tensor, w: Tensor, alpha: Tensor, bias: Tensor | None, residual: Tensor | None, act: str,
             out_dtype: torch.dtype) -> Tensor:
    """out[m, n] = act(sum_k a[m, k] w[n, k] * alpha[n] + bias[n]) + residual[m, n] as `out_dtype`."""
    _check_lt(a, w, alpha, bias, residual, act, out_dtype)
    return reference_lt(a, w, alpha, bias, residual, act, out_dtype)


def reference_lt(a: Tensor, w: Tensor, alpha: Tensor, bias: Tensor | None, residual: Tensor | None, act: str,
                 out_dtype: torch.dtype) -> Tensor:
    """gemm8_lt's arithmetic in torch ops: float32 after exact sums, as cuBLASLt's epilogue computes."""
    y = _scaled_sums(a, w, alpha)
    if bias is not None:
        y = y + bias.float()
    if residual is not None:
        y = y + residual.float()
    return activate(y, act).to(out_dtype)


@gemm8_lt.register_fake
def _(a: Tensor, w: Tensor, alpha: Tensor, bias: Tensor | None, residual: Tensor | None, act: str,
      out_dtype: torch.dtype) -> Tensor:
    return a.new_empty((a.shape[0], w.shape[0]), dtype=out_dtype)


@gemm8_lt.register_kernel("cuda")
def _(a: Tensor, w: Tensor, alpha: Tensor, bias: Tensor | None, residual: Tensor | None, act: str,
      out_dtype: torch.dtype) -> Tensor:
    from lkcnn.ops import build  # the compiled extension, built on first use

    _check_lt(a, w, alpha, bias, residual, act, out_dtype)
    out = a.new_empty((a.shape[0], w.shape[0]), dtype=out_dtype)
    # cuBLASLt's per-channel scaling takes a vector for each operand: the activations' is all ones (made per call:
    # a tensor kept across calls would outlive a CUDA graph's memory pool)
    ones = torch.ones(len(a), device=a.device)
    build.load().gemm_fp8_lt(a.contiguous(), w.contiguous(), alpha.contiguous(), ones,
                             None if bias is None else bias.contiguous(),
                             None if residual is None else residual.contiguous(), LT_ACTS.index(act), out)
    return out
