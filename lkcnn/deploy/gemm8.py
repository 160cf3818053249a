"""8-bit execution of a fake-quant model's GEMMs: its 1x1 convolutions and linear layers run as INT8 / FP8 matrix
products (`torch._int_mm`, `torch._scaled_mm`), on a GPU as on the CPU.

A layer runs as a GEMM when it is a QuantLinear or a 1x1, stride-1, unpadded, ungrouped QuantConv2d: a conv over the
channels-last view of its input, (N*H*W, C_in) @ (C_in, C_out), which is a view, not a copy, of a channels_last
tensor. Its input is quantized with the layer's calibrated static scale in plain torch ops (divide, round, saturate,
cast), so that torch.compile fuses it into the kernel that produced the input; the product is scaled back per output
channel and the bias added:
  INT8  `torch._int_mm` (exact int32 sums), then * (input_scale * weight_scale) + bias in float32, one elementwise
        op that inductor fuses after the GEMM;
  FP8   `torch._scaled_mm` on e4m3 operands with row-wise scales (the input scale repeated per row: a tensor-wise
        scale_a cannot be mixed with a row-wise scale_b) and the bias in its epilogue, bfloat16 out.
Every other layer (the large depthwise convolutions, the stride-2 depthwise ones, the float stem and classifier,
BatchNorms, activations) runs as in the fake-quant model, its QDQ in plain torch ops (`fusable`) so that inductor
fuses it too.

Shape limits, CUDA's, applied on every device so that which layers convert does not depend on where the model runs:
cuBLASLt's INT8 GEMM takes input and output channels in multiples of 8 and more than 16 rows (fewer rows are padded
with zero rows); `_scaled_mm` takes channels in multiples of 16. A GEMM layer outside them keeps its fake-quant form
and is listed with the reason in the converted model's `lkcnn_gemm8["fallback"]`.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lkcnn.deploy.quantize import QuantConv2d, QuantizeError, QuantLinear
from lkcnn.ops.qdq import quantize_values

CHANNEL_MULTIPLE = {"int8": 8, "fp8": 16}  # torch._int_mm / torch._scaled_mm on CUDA
INT_MM_MIN_ROWS = 17  # torch._int_mm on CUDA: more than 16 rows
FP8_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada, Hopper and later
QuantLayer = QuantConv2d | QuantLinear


class Gemm8(nn.Module):
    """A QuantLinear, or a 1x1 QuantConv2d on the channels-last view, as one 8-bit GEMM with its scales and bias in
    the epilogue; same state as the fake-quant layer, the weight as an (out, in) matrix."""

    def __init__(self, layer: QuantLayer) -> None:
        super().__init__()
        self.precision = layer.precision
        self.conv = isinstance(layer, QuantConv2d)
        self.register_buffer("weight", layer.weight.reshape(layer.weight.shape[0], -1).contiguous())
        self.register_buffer("weight_scale", layer.weight_scale.clone())
        self.register_buffer("input_scale", layer.input_scale.clone())
        bias = layer.bias
        if bias is not None and self.precision == "fp8":
            bias = bias.to(torch.bfloat16)  # _scaled_mm's row-wise epilogue takes a bias of its output dtype
        self.register_buffer("bias", None if bias is None else bias.clone())

    def forward(self, x: Tensor) -> Tensor:
        if self.conv:  # (B, C, H, W) -> (B*H*W, C)
            b, c, h, w = x.shape
            rows = x.permute(0, 2, 3, 1).reshape(-1, c)
        else:
            rows = x.reshape(-1, x.shape[-1])
        out = (self._int8 if self.precision == "int8" else self._fp8)(rows).to(x.dtype)
        if self.conv:
            return out.view(b, h, w, -1).permute(0, 3, 1, 2)
        return out.view(*x.shape[:-1], -1)

    def _int8(self, rows: Tensor) -> Tensor:
        q = quantize_values(rows, self.input_scale, torch.int8)
        m = len(q)
        if m < INT_MM_MIN_ROWS:
            q = F.pad(q, (0, 0, 0, INT_MM_MIN_ROWS - m))  # zero rows: their sums are discarded below
        out = torch._int_mm(q, self.weight.t())[:m].float() * (self.input_scale * self.weight_scale)
        return out if self.bias is None else out + self.bias

    def _fp8(self, rows: Tensor) -> Tensor:
        q = quantize_values(rows, self.input_scale, torch.float8_e4m3fn)
        # use_fast_accum stays off: Hopper's fast FP8 accumulation keeps ~14 mantissa bits over K up to 4096
        return torch._scaled_mm(q, self.weight.t(), scale_a=self.input_scale.expand(len(q), 1).contiguous(),
                                scale_b=self.weight_scale.view(1, -1), bias=self.bias, out_dtype=torch.bfloat16)

    def extra_repr(self) -> str:
        return f"{self.precision}, weight={tuple(self.weight.shape)}, bias={self.bias is not None}, conv={self.conv}"


def _is_gemm(layer: QuantLayer) -> bool:
    if isinstance(layer, QuantLinear):
        return True
    return (isinstance(layer, QuantConv2d) and not layer.large_kernel and layer.weight.shape[2:] == (1, 1)
            and layer.stride == (1, 1) and not any(layer.padding) and layer.groups == 1)


def _shape_issue(layer: QuantLayer) -> str | None:
    """Why the GEMM kernel of the layer's format cannot take its channels, or None."""
    multiple = CHANNEL_MULTIPLE[layer.precision]
    out_channels, in_channels = layer.weight.shape[:2]
    if in_channels % multiple or out_channels % multiple:
        return f"{in_channels} -> {out_channels} channels: {layer.precision} GEMMs take multiples of {multiple}"
    return None


def to_8bit_gemms(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """A copy of the fake-quant `model` (`lkcnn.deploy.quantize.quantize`, or `lkcnn.load_deployed` of an 8-bit
    export) whose GEMM layers run in 8 bits on the model's device; `model` is unchanged.

    `dtype` (e.g. torch.bfloat16) casts the float state outside the 8-bit layers (stem, BatchNorms, classifier):
    `model.to(dtype)` would also cast the FP8 weights and the float32 scales. The copy's `lkcnn_gemm8` records the
    precision, the converted layers and the GEMM layers left in fake-quant form (`fallback`, name: reason).
    """
    quantization = getattr(model, "lkcnn_quantization", None)
    if quantization is None or not any(isinstance(m, QuantLayer) for m in model.modules()):
        raise QuantizeError("the model is not a fake-quant model; make one with lkcnn.deploy.quantize.quantize(model, "
                            "batches, 'int8' or 'fp8') or lkcnn.load_deployed(an 8-bit export folder).")
    if hasattr(model, "lkcnn_gemm8"):
        raise QuantizeError("the model already runs its GEMMs in 8 bits; convert the fake-quant model it came from.")
    device = next(model.buffers()).device
    if quantization["precision"] == "fp8" and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_CAPABILITY:
            gpu = torch.cuda.get_device_name(device)
            raise QuantizeError(f"FP8 GEMMs need a GPU of compute capability 8.9 or newer; {gpu} is "
                                f"{capability[0]}.{capability[1]}: use an int8 model.")
    converted = copy.deepcopy(model)
    layers, fallback = [], {}
    for name in quantization["layers"]:
        layer = converted.get_submodule(name)
        if not _is_gemm(layer):
            continue
        issue = _shape_issue(layer)
        if issue:
            fallback[name] = issue
            continue
        parent, _, child = name.rpartition(".")
        setattr(converted.get_submodule(parent) if parent else converted, child, Gemm8(layer))
        layers.append(name)
    for layer in converted.modules():  # the rest stays fake-quant, with its QDQ fusable under torch.compile
        if isinstance(layer, QuantLayer):
            layer.fusable = True
    if dtype is not None:
        _cast_float_state(converted, dtype)
    converted.lkcnn_gemm8 = {"precision": quantization["precision"], "layers": layers, "fallback": fallback}
    return converted


def _cast_float_state(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast the floating-point parameters and buffers of every module but the 8-bit layers to `dtype`."""
    for module in model.modules():
        if isinstance(module, QuantLayer | Gemm8):
            continue
        for param in module.parameters(recurse=False):
            if param.is_floating_point():
                param.data = param.data.to(dtype)
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and buffer.is_floating_point():
                setattr(module, name, buffer.to(dtype))
