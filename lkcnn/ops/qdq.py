"""The registered ops `torch.ops.lkcnn.quantize_linear` / `dequantize_linear`: ONNX's QuantizeLinear and
DequantizeLinear (symmetric, zero point 0) for int8 and float8 e4m3, with their ONNX translations.

Why own ops: torch.ao's `quantized_decomposed.quantize_per_tensor` rounds to integers before casting, which is wrong
for float8, and its ONNX translation takes the scale as a Python float; a fake-quant written in plain torch ops would
export as Div/Round/Clip/Cast instead of QDQ nodes. One registered op per direction runs the same code in eager mode
(the CPU reference) and exports to exactly one QuantizeLinear / DequantizeLinear node (`onnx_translations`).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

# quantized dtype -> (smallest, largest) value QuantizeLinear saturates to (ONNX: saturate=1 for float8)
QRANGE: dict[torch.dtype, tuple[float, float]] = {
    torch.int8: (-128.0, 127.0),
    torch.float8_e4m3fn: (-448.0, 448.0),
}
DTYPE_NAMES = {"int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn}


def _broadcast(scale: Tensor, dim: int, axis: int) -> Tensor:
    """A per-tensor (0-d) scale as is, a per-channel (C,) scale shaped to broadcast along `axis`."""
    if scale.dim() == 0:
        return scale
    shape = [1] * dim
    shape[axis] = -1
    return scale.reshape(shape)


@torch.library.custom_op("lkcnn::quantize_linear", mutates_args=())
def quantize_linear(x: Tensor, scale: Tensor, dtype: str, axis: int = 1) -> Tensor:
    """ONNX QuantizeLinear, zero point 0: int8 rounds half to even and saturates; float8 e4m3fn rounds to nearest
    even and saturates at +-448 (a plain cast would give NaN)."""
    return quantize_values(x, _broadcast(scale, x.dim(), axis), DTYPE_NAMES[dtype])


def quantize_values(x: Tensor, scale: Tensor, qdtype: torch.dtype) -> Tensor:
    """QuantizeLinear's arithmetic (x / scale, rounded, saturated, cast to `qdtype`) in plain torch ops, `scale`
    broadcastable to `x`: the registered op runs it, and the 8-bit GEMMs (lkcnn.deploy.gemm8) call it directly, so
    that torch.compile fuses it into the kernel that produces `x` (a registered op is opaque to inductor)."""
    low, high = QRANGE[qdtype]
    y = x.float() / scale
    if qdtype == torch.int8:
        y = torch.round(y)
    return y.clamp(low, high).to(qdtype)


@quantize_linear.register_fake
def _(x: Tensor, scale: Tensor, dtype: str, axis: int = 1) -> Tensor:
    return torch.empty_like(x, dtype=DTYPE_NAMES[dtype])


@torch.library.custom_op("lkcnn::dequantize_linear", mutates_args=())
def dequantize_linear(q: Tensor, scale: Tensor, axis: int = 1) -> Tensor:
    """ONNX DequantizeLinear, zero point 0: `q * scale` in float32 (scale per tensor, or per channel of `axis`)."""
    return dequantize_values(q, scale, axis)


def dequantize_values(q: Tensor, scale: Tensor, axis: int = 1) -> Tensor:
    """DequantizeLinear's arithmetic in plain torch ops (see `quantize_values`)."""
    return q.float() * _broadcast(scale, q.dim(), axis)


@dequantize_linear.register_fake
def _(q: Tensor, scale: Tensor, axis: int = 1) -> Tensor:
    return torch.empty_like(q, dtype=torch.float32)


def fake_quantize(x: Tensor, scale: Tensor, dtype: str, axis: int = 1) -> Tensor:
    """Quantize then dequantize: the value the 8-bit model computes with, in float32."""
    return dequantize_linear(quantize_linear(x, scale, dtype, axis), scale, axis)


def onnx_translations(opset: int) -> dict[Any, Any]:
    """`torch.onnx.export(custom_translation_table=...)` entries: each op becomes one QuantizeLinear /
    DequantizeLinear node of `opset` (int8 with `axis` needs 13+, float8 needs 19+)."""
    import ml_dtypes  # numpy's float8 types; an onnx dependency
    import numpy as np
    from onnxscript import ir
    from onnxscript.values import Opset

    op = Opset("", opset)
    numpy_dtypes = {"int8": np.int8, "float8_e4m3fn": ml_dtypes.float8_e4m3fn}

    def quantize(x, scale, dtype: str, axis: int = 1):
        # the zero point's type selects QuantizeLinear's output type (before opset 21's output_dtype)
        zero_point = op.Constant(value=ir.tensor(np.zeros((), numpy_dtypes[dtype])))
        return op.QuantizeLinear(x, scale, zero_point, axis=axis)

    def dequantize(q, scale, axis: int = 1):
        return op.DequantizeLinear(q, scale, axis=axis)

    return {torch.ops.lkcnn.quantize_linear.default: quantize, torch.ops.lkcnn.dequantize_linear.default: dequantize}
