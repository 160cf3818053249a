"""8-bit execution of a fake-quant model: its 1x1 convolutions and linear layers run as 8-bit GEMMs with what follows
them fused into the GEMM's epilogue, on a GPU as on the CPU: FP8 e4m3 on cuBLASLt's kernels with their own epilogue
(`torch.ops.lkcnn.gemm8_lt`; its GELU is the tanh form, and the quantization of its output for the next layer is a
torch op that inductor fuses into the next pass), INT8 and the channel counts cuBLASLt cannot take on lkcnn's
Triton kernel (`torch.ops.lkcnn.gemm8`, whose epilogue also writes 8-bit outputs).

A layer runs as a GEMM when it is a QuantLinear or a 1x1, stride-1, unpadded, ungrouped QuantConv2d: a conv over the
channels-last view of its input, (N*H*W, C_in) @ (C_in, C_out), a view, not a copy, of a channels_last tensor.
Its input is quantized with the layer's calibrated scale in plain torch ops (divide, round, saturate, cast), which
torch.compile fuses into the kernel that produces it, unless the GEMM before it already wrote it in 8 bits. What the
epilogue takes in (`to_8bit_gemms`):
  - always the operands' scales and the layer's bias;
  - the BatchNorm and activation of a conv-BN(-act) `nn.Sequential` (lkcnn's `conv_bn`), folded exactly: in eval
    mode both are per-channel arithmetic on the GEMM's output;
  - in lkcnn's RepLKNet blocks (`RepLKBlock`, `ConvFFN`) the block's activation after its first 1x1 conv and the
    residual addition after its last, and the quantization of the next layer's input: the FFN's hidden activation
    goes from one GEMM to the next in 8 bits, the large kernel's input is written on its 8-bit grid;
  - before a conv-BN `nn.Sequential` with a fake-quant conv (a stage transition's stride-2 depthwise conv), that
    conv's input grid;
  - between two blocks of a stage, on the Triton kernel (INT8; FP8 where cuBLASLt does not run the GEMM), the next
    block's first BatchNorm and its first GEMM's quantization as a second, 8-bit output of the block's last GEMM
    (`torch.ops.lkcnn.gemm8_next`): the blocks pass (residual stream, 8-bit input) pairs.
A RepLKBlock's large depthwise convolution (odd square kernels up to 33 taps) runs in 8 bits too, as one
`torch.ops.lkcnn.dwconv8` call (`DWConv8`): it reads the 8-bit output of the GEMM before it (on the Triton kernel,
written as the channel planes the convolution reads, `planes`), and its epilogue applies
the scale, bias and the block's activation and writes the next GEMM's 8-bit input (`large_kernels=False` keeps it on
the 16-bit kernels, its input on its 8-bit grid). Every other layer (the stride-2 depthwise convolutions, the float
stem and classifier) runs as in the fake-quant model, its QDQ in plain torch ops (`fusable`) so that inductor fuses
it too. The 8-bit blocks are inference modules: stochastic depth, an identity in eval mode, is not applied.
"""
from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from lkcnn.deploy.quantize import QuantConv2d, QuantizeError, QuantLinear
from lkcnn.layers import ConvFFN, RepLKBlock, fuse_bn
from lkcnn.ops.dwconv8 import MAX_KERNEL, dwconv8, pack_weight
from lkcnn.ops.gemm8 import LT_BIAS_DTYPES, gemm8, gemm8_lt, gemm8_next
from lkcnn.ops.qdq import DTYPE_NAMES, dequantize_values, quantize_values

FP8_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada, Hopper and later
ACTIVATIONS = {nn.ReLU: "relu", nn.GELU: "gelu"}  # nn.GELU() computes the erf form, as the Triton kernel does
LT_ACTS = {"none": "none", "relu": "relu", "gelu": "gelu_tanh"}  # cuBLASLt's GELU is the tanh form
QuantLayer = QuantConv2d | QuantLinear


class Gemm8(nn.Module):
    """A QuantLinear, or a 1x1 QuantConv2d on the channels-last view, as one lkcnn.gemm8_lt call (FP8, `lt`) or
    one lkcnn.gemm8 call (Triton); the weight as an (out, in) matrix, `alpha` / `beta` the epilogue's per-channel
    scale and shift."""

    def __init__(self, layer: QuantLayer, activation_dtype: torch.dtype) -> None:
        super().__init__()
        self.precision, self.grid = layer.precision, layer.qdtype  # "int8" / "float8_e4m3fn"
        self.qdtype = DTYPE_NAMES[layer.qdtype]
        self.conv = isinstance(layer, QuantConv2d)
        self.activation_dtype = activation_dtype  # of the float outputs, whatever the input's dtype
        self.register_buffer("weight", layer.weight.reshape(layer.weight.shape[0], -1).contiguous())
        self.register_buffer("input_scale", layer.input_scale.clone())
        self.register_buffer("alpha", layer.input_scale * layer.weight_scale)
        self.register_buffer("beta", torch.zeros_like(self.alpha) if layer.bias is None else layer.bias.float().clone())
        self.register_buffer("out_scale", None)
        self.act = "none"
        self.input_8bit = False  # True: the GEMM before this one writes its 8-bit input
        self.out_8bit = False  # True: write the next GEMM's 8-bit input; with out_scale alone, values on its grid
        self.out_planes = False  # True (Triton, a conv): write the output as channel planes, NCHW-contiguous
        out_channels, in_channels = self.weight.shape
        self.lt = self.precision == "fp8" and not (in_channels % 16 or out_channels % 16)  # cuBLASLt's FP8 GEMM
        self.register_buffer("bias", None)  # beta in cuBLASLt's bias dtype (`finalize`)
        # `write_next_input`: the next block's first BatchNorm (scale, shift) and its first GEMM's input scale
        self.register_buffer("next_alpha", None)
        self.register_buffer("next_beta", None)
        self.register_buffer("next_scale", None)

    @torch.no_grad()
    def fold_batchnorm(self, bn: nn.BatchNorm2d) -> None:
        """Take an eval-mode BatchNorm on this layer's output into the epilogue's scale and shift."""
        self.alpha, self.beta = fuse_bn(self.alpha, bn.float(), self.beta)

    @torch.no_grad()
    def finalize(self) -> None:
        """Derive the cuBLASLt path's bias from the folded shift, once the epilogue is complete."""
        if self.lt:
            self.bias = self.beta.to(LT_BIAS_DTYPES[self.activation_dtype])

    @torch.no_grad()
    def write_next_input(self, bn: nn.BatchNorm2d, consumer: Gemm8) -> None:
        """Also write `consumer`'s 8-bit input from this float output: `bn` (eval mode, the BatchNorm before it)
        and its quantization in this GEMM's epilogue (Triton only: cuBLASLt writes one output)."""
        self.next_alpha, self.next_beta = fuse_bn(torch.ones_like(bn.running_mean, dtype=torch.float32), bn.float())
        self.next_scale = consumer.input_scale.clone()

    def quantize_output_for(self, consumer: QuantConv2d | Gemm8 | DWConv8) -> None:
        """Write `consumer`'s input: 8-bit values for a Gemm8 or DWConv8, float values on its 8-bit grid for a
        fake-quant layer (which then skips its own QDQ)."""
        self.out_scale = consumer.input_scale.clone()
        self.out_8bit = isinstance(consumer, Gemm8 | DWConv8)
        # the 8-bit large kernel reads channel planes: the Triton kernel writes them (no layout copy between)
        self.out_planes = isinstance(consumer, DWConv8) and self.conv and not self.lt
        if self.out_8bit:
            consumer.input_8bit = True
        else:
            consumer.input_on_grid = True

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """The layer's output; with `write_next_input`, (output, the next block's 8-bit input). An 8-bit `x` is the
        input on this layer's grid (written by the GEMM before it)."""
        rows, shape = self._rows(x)
        if x.dtype != self.qdtype:
            if self.input_8bit:
                raise TypeError(f"this 8-bit GEMM reads the {self.qdtype} output of the GEMM before it, got {x.dtype}")
            rows = quantize_values(rows, self.input_scale, self.qdtype)
        res_rows = None if residual is None else self._rows(residual)[0]
        if self.next_scale is not None:
            out, nxt = gemm8_next(rows, self.weight, self.alpha, self.beta, res_rows, self.act, self.activation_dtype,
                                  self.next_alpha, self.next_beta, self.grid, self.next_scale)
            return self._shaped(out, shape), self._shaped(nxt, shape)
        if self.lt and (residual is None or self.act == "none"):
            if res_rows is not None:
                res_rows = res_rows.to(self.activation_dtype)
            out = gemm8_lt(rows, self.weight, self.alpha, self.bias, res_rows, LT_ACTS[self.act], self.activation_dtype)
            if self.out_scale is not None:  # plain torch ops, which inductor fuses into one pass after the GEMM
                q = quantize_values(out, self.out_scale, self.qdtype)
                out = q if self.out_8bit else dequantize_values(q, self.out_scale).to(self.activation_dtype)
        else:
            quant = self.grid if self.out_scale is not None else ""
            planes = shape[2] * shape[3] if self.out_planes else 0
            out = gemm8(rows, self.weight, self.alpha, self.beta, res_rows, self.act, quant, self.out_scale,
                        self.qdtype if self.out_8bit else self.activation_dtype, planes)
        return self._shaped(out, shape)

    def _shaped(self, out: Tensor, shape: torch.Size) -> Tensor:
        """(rows, out channels) back to the input's shape: for a conv the NCHW view of channels_last rows, or of
        channel planes (`out_planes`)."""
        if self.conv and out.dim() == 3:
            return out.view(shape[0], -1, shape[2], shape[3])
        if self.conv:
            b, _, h, w = shape
            return out.view(b, h, w, -1).permute(0, 3, 1, 2)
        return out.view(*shape[:-1], -1)

    def _rows(self, x: Tensor) -> tuple[Tensor, torch.Size]:
        if self.conv:  # (B, C, H, W) -> (B*H*W, C)
            return x.permute(0, 2, 3, 1).reshape(-1, x.shape[1]), x.shape
        return x.reshape(-1, x.shape[-1]), x.shape

    def extra_repr(self) -> str:
        out = "" if self.out_scale is None else f", out={'8-bit' if self.out_8bit else 'on the next grid'}"
        out += ", as channel planes" if self.out_planes else ""
        out += "" if self.next_scale is None else ", writes the next block's input"
        return (f"{self.precision}, weight={tuple(self.weight.shape)}, conv={self.conv}, act={self.act}, "
                f"input_8bit={self.input_8bit}{out}, kernel={'cuBLASLt' if self.lt else 'Triton'}")


class DWConv8(nn.Module):
    """A RepLKBlock's large depthwise QuantConv2d as one lkcnn.dwconv8 call: the input in 8 bits as NCHW planes (the
    Triton GEMM before it writes them so; a cuBLASLt one's output is copied), the scales, bias and the block's
    activation in the epilogue, which writes the next GEMM's 8-bit input (channels_last, as the GEMM reads it)."""

    def __init__(self, conv: QuantConv2d, act: str, activation_dtype: torch.dtype) -> None:
        super().__init__()
        self.kernel_size = conv.weight.shape[-1]
        self.qdtype = DTYPE_NAMES[conv.qdtype]
        self.act, self.activation_dtype = act, activation_dtype
        self.register_buffer("table", pack_weight(conv.weight))
        self.register_buffer("input_scale", conv.input_scale.clone())
        self.register_buffer("alpha", (conv.input_scale * conv.weight_scale).float())
        self.register_buffer("beta", torch.zeros_like(self.alpha) if conv.bias is None else conv.bias.float().clone())
        self.register_buffer("out_scale", None)
        self.input_8bit = False  # True: the GEMM before this layer writes its 8-bit input

    @staticmethod
    def takes(layer: nn.Module) -> bool:
        """Whether `layer` is a large depthwise QuantConv2d the kernel runs: odd square kernel up to MAX_KERNEL,
        'same' padding, stride and dilation 1."""
        if not isinstance(layer, QuantConv2d) or not layer.large_kernel:
            return False
        channels, one, kh, kw = layer.weight.shape
        return (one == 1 and layer.groups == channels and kh == kw and kh % 2 == 1 and 3 <= kh <= MAX_KERNEL
                and tuple(layer.padding) == (kh // 2, kw // 2) and tuple(layer.stride) == (1, 1)
                and tuple(layer.dilation) == (1, 1))

    def quantize_output_for(self, consumer: Gemm8) -> None:
        """Write `consumer`'s 8-bit input."""
        self.out_scale = consumer.input_scale.clone()
        consumer.input_8bit = True

    def forward(self, x: Tensor) -> Tensor:
        if self.input_8bit:
            if x.dtype != self.qdtype:
                raise TypeError(f"this 8-bit convolution reads the {self.qdtype} output of the GEMM before it, "
                                f"got {x.dtype}")
        else:
            x = quantize_values(x, self.input_scale, self.qdtype)
        out_dtype = self.activation_dtype if self.out_scale is None else self.qdtype
        out = dwconv8(x.contiguous(), self.table, self.kernel_size, self.alpha, self.beta, self.act, self.out_scale,
                      out_dtype)
        return out.contiguous(memory_format=torch.channels_last)

    def extra_repr(self) -> str:
        return (f"{str(self.qdtype).split('.')[-1]}, kernel={self.kernel_size}, act={self.act}, "
                f"input_8bit={self.input_8bit}, out={'8-bit' if self.out_scale is not None else self.activation_dtype}")


class ConvFFN8(nn.Module):
    """ConvFFN with fused 8-bit GEMMs: pw1's epilogue applies BatchNorm and GELU and writes pw2's 8-bit input;
    pw2's applies BatchNorm and adds the residual. Takes x, or (x, pw1's 8-bit input) from the block before, and
    returns its output, or (output, the next block's 8-bit input) when pw2 writes that too (`_pair_blocks`)."""

    def __init__(self, block: ConvFFN) -> None:
        super().__init__()
        self.preffn_bn, self.pw1, self.pw2 = block.preffn_bn, block.pw1, block.pw2
        self.pw1.conv.act = ACTIVATIONS[type(block.nonlinear)]
        self.pw1.conv.quantize_output_for(self.pw2.conv)

    @property
    def pre_bn(self) -> nn.Module:
        return self.preffn_bn

    def forward(self, x: Tensor | tuple[Tensor, Tensor]) -> Tensor | tuple[Tensor, Tensor]:
        x, x8 = x if isinstance(x, tuple) else (x, None)
        return self.pw2.conv(self.pw1.conv(self.preffn_bn(x) if x8 is None else x8), residual=x)


class RepLKBlock8(nn.Module):
    """RepLKBlock with fused 8-bit GEMMs: pw1's epilogue applies BatchNorm and ReLU and writes the large kernel's
    input on its 8-bit grid (with `large_kernel_8bit`, where DWConv8 takes the kernel: its 8-bit input, and the
    DWConv8's epilogue applies the block's activation and writes pw2's 8-bit input); pw2's applies BatchNorm and adds
    the residual. Takes and returns pairs as ConvFFN8 does."""

    def __init__(self, block: RepLKBlock, large_kernel_8bit: bool = True) -> None:
        super().__init__()
        self.prelkb_bn, self.pw1, self.large_kernel = block.prelkb_bn, block.pw1, block.large_kernel
        self.lk_nonlinear, self.pw2 = block.lk_nonlinear, block.pw2
        large = getattr(self.large_kernel, "lkb_reparam", None)
        if large_kernel_8bit and DWConv8.takes(large) and type(self.lk_nonlinear) in ACTIVATIONS:
            self.large_kernel = DWConv8(large, ACTIVATIONS[type(self.lk_nonlinear)], self.pw2.conv.activation_dtype)
            self.lk_nonlinear = nn.Identity()
            self.pw1.conv.quantize_output_for(self.large_kernel)
            self.large_kernel.quantize_output_for(self.pw2.conv)
        elif isinstance(large, QuantConv2d):
            self.pw1.conv.quantize_output_for(large)

    @property
    def pre_bn(self) -> nn.Module:
        return self.prelkb_bn

    def forward(self, x: Tensor | tuple[Tensor, Tensor]) -> Tensor | tuple[Tensor, Tensor]:
        x, x8 = x if isinstance(x, tuple) else (x, None)
        h = self.pw1(self.prelkb_bn(x) if x8 is None else x8)
        return self.pw2.conv(self.lk_nonlinear(self.large_kernel(h)), residual=x)


def _is_gemm(layer: nn.Module) -> bool:
    if isinstance(layer, QuantLinear):
        return True
    return (isinstance(layer, QuantConv2d) and not layer.large_kernel and layer.weight.shape[2:] == (1, 1)
            and layer.stride == (1, 1) and not any(layer.padding) and layer.groups == 1)


def _fold_conv_bn(model: nn.Module) -> None:
    """In every conv-BN(-act) Sequential whose conv is a Gemm8, move the BatchNorm and activation into its epilogue
    (identities left in their place keep the module paths); then give each such GEMM that precedes a conv-BN
    Sequential with a fake-quant conv (a stage transition) that conv's input grid."""
    sequentials = [m for m in model.modules() if isinstance(m, nn.Sequential)]
    for seq in sequentials:
        gemm, bn = getattr(seq, "conv", None), getattr(seq, "bn", None)
        if isinstance(gemm, Gemm8) and isinstance(bn, nn.BatchNorm2d):
            gemm.fold_batchnorm(bn)
            seq.bn = nn.Identity()
            act = getattr(seq, "nonlinear", None)
            if type(act) in ACTIVATIONS:
                gemm.act = ACTIVATIONS[type(act)]
                seq.nonlinear = nn.Identity()
    for seq in sequentials:
        children = list(seq.children())
        for before, after in zip(children, children[1:]):
            gemm, nxt = getattr(before, "conv", None), getattr(after, "conv", None)
            whole = all(isinstance(m, nn.Identity) for n, m in before.named_children() if n != "conv")
            if isinstance(gemm, Gemm8) and whole and gemm.out_scale is None and isinstance(nxt, QuantConv2d):
                gemm.quantize_output_for(nxt)


def _fuse_blocks(model: nn.Module, large_kernels: bool) -> list[str]:
    """Swap every RepLKBlock / ConvFFN whose 1x1 convs are fused Gemm8s for its 8-bit form (with `large_kernels`, a
    RepLKBlock's large kernel as a DWConv8); their names."""
    swapped = []
    for name, block in list(model.named_modules()):
        fused = {RepLKBlock: lambda b: RepLKBlock8(b, large_kernels), ConvFFN: ConvFFN8}.get(type(block))
        if fused is None or not all(isinstance(getattr(block, pw).conv, Gemm8) for pw in ("pw1", "pw2")):
            continue
        if not all(isinstance(getattr(block, pw).bn, nn.Identity) for pw in ("pw1", "pw2")):
            continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, fused(block))
        swapped.append(name)
    return swapped


def _pair_blocks(model: nn.Module) -> list[str]:
    """In every nn.Sequential of 8-bit blocks (a RepLKNet stage), let each block's last GEMM also write the next
    block's first GEMM input (that block's BatchNorm and quantization, a pass over the residual stream otherwise)
    where it runs on the Triton kernel; the names of those GEMMs."""
    paired = []
    for name, seq in model.named_modules():
        if not isinstance(seq, nn.Sequential):
            continue
        children = list(seq.named_children())
        for (child, block), (_, after) in zip(children, children[1:]):
            if not (isinstance(block, RepLKBlock8 | ConvFFN8) and isinstance(after, RepLKBlock8 | ConvFFN8)):
                continue
            gemm, first = block.pw2.conv, after.pw1.conv
            if gemm.lt or not isinstance(after.pre_bn, nn.BatchNorm2d) or first.qdtype != gemm.qdtype:
                continue
            gemm.write_next_input(after.pre_bn, first)
            paired.append(f"{name}.{child}.pw2.conv" if name else f"{child}.pw2.conv")
    return paired


def to_8bit_gemms(model: nn.Module, dtype: torch.dtype | None = None, large_kernels: bool = True) -> nn.Module:
    """A copy of the fake-quant `model` (`lkcnn.deploy.quantize.quantize`, or `lkcnn.load_deployed` of an 8-bit
    export) whose GEMM layers run in 8 bits with fused epilogues on the model's device; `model` is unchanged.

    `dtype` (e.g. torch.bfloat16) casts the float state outside the 8-bit layers (stem, BatchNorms, classifier) and
    is the dtype of the GEMMs' float outputs (default float32): `model.to(dtype)` would also cast the FP8 weights and
    the float32 scales. RepLKBlocks' large kernels run in 8 bits too (DWConv8), faster than the 16-bit kernels at
    every RepLKNet-31B stage at batch 128 (docs/export.md, "8-bit execution"); `large_kernels=False` keeps them on the
    16-bit kernels, on inputs on their 8-bit grid. The copy's `lkcnn_gemm8` records the precision, the converted
    layers, the fused blocks, the large kernels that run in 8 bits and the GEMMs that also write the next block's
    8-bit input.
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
    layers = [name for name in quantization["layers"] if _is_gemm(converted.get_submodule(name))]
    for name in layers:
        parent, _, child = name.rpartition(".")
        setattr(converted.get_submodule(parent) if parent else converted, child,
                Gemm8(converted.get_submodule(name), dtype or torch.float32))
    for layer in converted.modules():  # the rest stays fake-quant, with its QDQ fusable under torch.compile
        if isinstance(layer, QuantLayer):
            layer.fusable = True
    _fold_conv_bn(converted)
    blocks = _fuse_blocks(converted, large_kernels)
    paired = _pair_blocks(converted)
    for gemm in converted.modules():
        if isinstance(gemm, Gemm8):
            gemm.finalize()
    if dtype is not None:
        _cast_float_state(converted, dtype)
    large = [name for name, m in converted.named_modules() if isinstance(m, DWConv8)]
    converted.lkcnn_gemm8 = {"precision": quantization["precision"], "layers": layers, "fused_blocks": blocks,
                             "large_kernels": large, "next_inputs": paired}
    return converted


def _cast_float_state(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast the floating-point parameters and buffers of every module but the 8-bit layers to `dtype`."""
    for module in model.modules():
        if isinstance(module, QuantLayer | Gemm8 | DWConv8):
            continue
        for param in module.parameters(recurse=False):
            if param.is_floating_point():
                param.data = param.data.to(dtype)
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and buffer.is_floating_point():
                setattr(module, name, buffer.to(dtype))
