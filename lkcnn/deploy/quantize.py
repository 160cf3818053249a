"""8-bit quantization of a deployed (re-parameterized) model: calibrate, then run it in fake-quant form.

What is quantized: every `nn.Conv2d` (lkcnn's `LargeKernelConv` included) and `nn.Linear`. Its weights are
quantized per output channel, symmetrically (scale = max |w| of the channel / qmax); its input activation per
tensor, symmetrically, with a scale from calibration batches. Biases, BatchNorms, activations functions, pooling
and residual additions stay in float32, as an 8-bit inference engine keeps them in its fused epilogues. Formats:
INT8 (qmax 127, QuantizeLinear saturates to [-128, 127]) and FP8 e4m3fn (qmax 448).

The quantized model is the float reference of the 8-bit graph: each quantized layer dequantizes its stored 8-bit
weights and quantize-dequantizes its input through the registered ops `lkcnn.ops.qdq` (ONNX QuantizeLinear /
DequantizeLinear semantics), then runs the float convolution. It runs on any device and is the test oracle of the
ONNX export (one Q/DQ pair per input and one DQ per weight).

Activation observers (the calibration method, `observer=`):
  minmax      torch.ao's MinMaxObserver: amax = the largest |x| seen.
  percentile  amax = the `percentile`-th percentile of |x|, from a histogram (torch.ao has no percentile observer).
  mse         amax minimizing the mean squared quantization error of |x|'s histogram, in the target format.
              torch.ao's HistogramObserver also searches by L2 error, but over an asymmetric integer range, so it
              fits neither a symmetric scale nor FP8's non-uniform grid.
Weights always use torch.ao's PerChannelMinMaxObserver (max |w| per output channel).
"""
from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.ao.quantization.observer import MinMaxObserver, PerChannelMinMaxObserver

from lkcnn.layers import LargeKernelConv
from lkcnn.ops import dwconv2d
from lkcnn.ops.qdq import dequantize_linear, fake_quantize, quantize_linear

OBSERVERS = ("minmax", "percentile", "mse")
DEFAULT_PERCENTILE = 99.99
HISTOGRAM_BINS = 2048
MSE_CANDIDATES = 128  # amax candidates from max/128 to max
MSE_SUBSAMPLES = 4  # points per histogram bin in the error estimate (a bin spans one INT8 step at amax = max/16)
MIN_SCALE = torch.finfo(torch.float32).eps  # torch.ao's floor for a scale: an all-zero tensor still gets one


class QuantizeError(ValueError):
    """A model or setting that cannot be quantized; the message says what to do."""


@dataclass(frozen=True)
class Format:
    """An 8-bit number format: its name on the command line, the quantized dtype, the magnitude amax maps to."""

    name: str
    dtype: str  # lkcnn.ops.qdq dtype name
    qmax: float

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn}[self.dtype]

    def scale(self, amax: Tensor) -> Tensor:
        """Symmetric scale that maps `amax` to the format's largest magnitude."""
        return (amax.float() / self.qmax).clamp_min(MIN_SCALE)

    def fake_quantize(self, x: Tensor, scale: Tensor) -> Tensor:
        return fake_quantize(x, scale, self.dtype)


FORMATS = {"int8": Format("int8", "int8", 127.0), "fp8": Format("fp8", "float8_e4m3fn", 448.0)}


def get_format(precision: str) -> Format:
    if precision not in FORMATS:
        raise QuantizeError(f"unknown precision {precision!r}; choose one of {', '.join(FORMATS)}.")
    return FORMATS[precision]


# ---------------------------------------------------------------------------------------------------------- observers
class MinMaxAmax:
    """Largest |x| seen, tracked by torch.ao's MinMaxObserver (symmetric, per tensor)."""

    def __init__(self) -> None:
        self.observer = MinMaxObserver(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric,
                                       quant_min=-127, quant_max=127)

    def update(self, x: Tensor) -> None:
        self.observer(x.detach().float())

    def amax(self, fmt: Format) -> Tensor:
        return torch.maximum(-self.observer.min_val, self.observer.max_val).cpu()


class HistogramAmax:
    """Histogram of |x| over [0, largest |x| seen] (re-binned when a batch reaches further), read as a percentile
    or searched for the amax of least squared quantization error (the approach of TensorRT's and NVIDIA ModelOpt's
    histogram calibrators)."""

    def __init__(self, method: str, percentile: float = DEFAULT_PERCENTILE, bins: int = HISTOGRAM_BINS) -> None:
        if method not in ("percentile", "mse"):
            raise QuantizeError(f"unknown histogram method {method!r}")
        self.method, self.percentile, self.bins = method, percentile, bins
        self.counts = torch.zeros(bins, dtype=torch.float64)
        self.top = 0.0  # the histogram spans [0, top]

    def update(self, x: Tensor) -> None:
        a = x.detach().abs().float().flatten()
        top = a.max().item() if a.numel() else 0.0
        if top > self.top:
            if self.counts.sum() > 0:  # move each old bin's count to the new bin holding its centre
                centres = (torch.arange(self.bins, dtype=torch.float64) + 0.5) * (self.top / self.bins)
                index = (centres / (top / self.bins)).long().clamp_max(self.bins - 1)
                self.counts = torch.zeros_like(self.counts).index_add_(0, index, self.counts)
            self.top = top
        if self.top == 0.0:  # all zeros so far: they sit in the first bin of any later range
            self.counts[0] += a.numel()
            return
        self.counts += torch.histc(a, self.bins, 0.0, self.top).double().cpu()

    def amax(self, fmt: Format) -> Tensor:
        total = self.counts.sum()
        if total == 0 or self.top == 0.0:
            return torch.tensor(0.0)
        width = self.top / self.bins
        if self.method == "percentile":
            cdf = self.counts.cumsum(0) / total
            k = int(torch.searchsorted(cdf, torch.tensor(self.percentile / 100, dtype=torch.float64)).clamp_max(
                self.bins - 1))
            return torch.tensor((k + 1) * width, dtype=torch.float32)
        # mse: each bin stands for MSE_SUBSAMPLES evenly spread values, each carrying its share of the count
        offsets = (torch.arange(MSE_SUBSAMPLES, dtype=torch.float64) + 0.5) / MSE_SUBSAMPLES
        values = ((torch.arange(self.bins, dtype=torch.float64)[:, None] + offsets) * width).flatten().float()
        weights = (self.counts[:, None] / MSE_SUBSAMPLES).expand(-1, MSE_SUBSAMPLES).flatten()
        keep = weights > 0
        values, weights = values[keep], weights[keep]
        candidates = torch.linspace(1 / MSE_CANDIDATES, 1, MSE_CANDIDATES) * self.top
        errors = torch.cat([  # one row per candidate: its scale quantizes the row as one channel (axis 0)
            ((fake_quantize(values.expand(len(chunk), -1), fmt.scale(chunk), fmt.dtype, 0) - values).square()
             .double() @ weights) for chunk in candidates.split(32)])
        return candidates[int(errors.argmin())]


def activation_observer(observer: str, percentile: float = DEFAULT_PERCENTILE) -> MinMaxAmax | HistogramAmax:
    if observer == "minmax":
        return MinMaxAmax()
    if observer in ("percentile", "mse"):
        return HistogramAmax(observer, percentile)
    raise QuantizeError(f"unknown observer {observer!r}; choose one of {', '.join(OBSERVERS)}.")


def weight_amax(weight: Tensor) -> Tensor:
    """max |w| per output channel (axis 0), by torch.ao's PerChannelMinMaxObserver."""
    observer = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric,
                                        quant_min=-127, quant_max=127)
    observer(weight.detach().float().cpu())
    return torch.maximum(-observer.min_val, observer.max_val)


# ----------------------------------------------------------------------------------------------- quantized modules
class _QuantLayer(nn.Module):
    """Shared state of a quantized layer: 8-bit `weight` (per-output-channel `weight_scale`), float `bias`, and the
    per-tensor `input_scale` of the activation it reads."""

    def __init__(self, weight: Tensor, bias: Tensor | None, fmt: Format) -> None:
        super().__init__()
        self.precision = fmt.name
        self.qdtype = fmt.dtype
        self.register_buffer("weight", torch.zeros(weight.shape, dtype=fmt.torch_dtype, device=weight.device))
        self.register_buffer("weight_scale", torch.ones(weight.shape[0], device=weight.device))
        self.register_buffer("input_scale", torch.ones((), device=weight.device))
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @torch.no_grad()
    def set_scales(self, float_weight: Tensor, input_amax: Tensor) -> None:
        """Quantize `float_weight` per output channel and set the input scale from the calibrated amax."""
        fmt = FORMATS[self.precision]
        self.weight_scale.copy_(fmt.scale(weight_amax(float_weight)))
        self.weight.copy_(quantize_linear(float_weight.float(), self.weight_scale, self.qdtype, 0))
        self.input_scale.copy_(fmt.scale(input_amax))

    def _inputs(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        xq = fake_quantize(x, self.input_scale, self.qdtype).to(x.dtype)
        w = dequantize_linear(self.weight, self.weight_scale, 0).to(x.dtype)
        return xq, w, None if self.bias is None else self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.precision}, weight={tuple(self.weight.shape)}, bias={self.bias is not None}"


class QuantConv2d(_QuantLayer):
    """A Conv2d (or LargeKernelConv, still run through lkcnn's dwconv2d op) with 8-bit weights and input."""

    def __init__(self, conv: nn.Conv2d, fmt: Format) -> None:
        if conv.padding_mode != "zeros" or isinstance(conv.padding, str):
            raise QuantizeError(f"conv {conv} uses padding {conv.padding!r} / padding_mode {conv.padding_mode!r}; "
                                "8-bit export supports explicit zero padding only.")
        super().__init__(conv.weight, conv.bias, fmt)
        self.stride, self.padding, self.dilation, self.groups = conv.stride, conv.padding, conv.dilation, conv.groups
        self.large_kernel = isinstance(conv, LargeKernelConv)

    def forward(self, x: Tensor) -> Tensor:
        x, w, b = self._inputs(x)
        if self.large_kernel:
            return dwconv2d(x, w, b, self.padding)
        return F.conv2d(x, w, b, self.stride, self.padding, self.dilation, self.groups)


class QuantLinear(_QuantLayer):
    """A Linear with 8-bit weights and input."""

    def __init__(self, linear: nn.Linear, fmt: Format) -> None:
        super().__init__(linear.weight, linear.bias, fmt)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(*self._inputs(x))


# ------------------------------------------------------------------------------------------------------ the workflow
def check_deploy_form(model: nn.Module) -> None:
    """Quantizing a training-form model would quantize each branch and lose the merge; refuse it."""
    for name, module in model.named_modules():
        if hasattr(module, "reparameterize") and not getattr(module, "deploy", False):
            raise QuantizeError(f"the model is not in deploy form ({name or 'the model'} still has its training "
                                "branches); re-parameterize it first: lkcnn.deploy.reparam.reparameterize_model("
                                "model.eval()), or export from the checkpoint with --precision.")


def quantizable_layers(model: nn.Module) -> list[str]:
    """Names of the modules `quantize` replaces: every Conv2d (LargeKernelConv included) and Linear."""
    return [name for name, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))
            and not isinstance(m, _QuantLayer)]


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _quant_layer(module: nn.Module, fmt: Format) -> _QuantLayer:
    return QuantConv2d(module, fmt) if isinstance(module, nn.Conv2d) else QuantLinear(module, fmt)


def prepare_quantized(model: nn.Module, precision: str, layers: list[str]) -> nn.Module:
    """Replace `layers` of a deploy-form model in place with empty quantized layers, ready for
    `load_state_dict` of a quantized state_dict (how `load_deployed` rebuilds an 8-bit export)."""
    fmt = get_format(precision)
    for name in layers:
        _replace(model, name, _quant_layer(model.get_submodule(name), fmt))
    return model


@torch.no_grad()
def quantize(model: nn.Module, batches: Iterable[Tensor], precision: str = "int8", observer: str = "mse",
             percentile: float = DEFAULT_PERCENTILE) -> nn.Module:
    """A fake-quant copy of the deploy-form `model`, calibrated on `batches` (input tensors); `model` is unchanged.

    The copy's `lkcnn_quantization` records what was done (precision, observer, the quantized layer names), which
    `prepare_quantized` needs to rebuild it.
    """
    fmt = get_format(precision)
    check_deploy_form(model)
    if observer == "percentile" and not 0 < percentile <= 100:
        raise QuantizeError(f"percentile {percentile} must be in (0, 100], e.g. 99.99.")
    quantized = copy.deepcopy(model).eval()
    layers = quantizable_layers(quantized)
    if not layers:
        raise QuantizeError("the model has no Conv2d or Linear layer to quantize.")
    observers = {name: activation_observer(observer, percentile) for name in layers}
    hooks = [quantized.get_submodule(name).register_forward_pre_hook(
        lambda _, args, name=name: observers[name].update(args[0])) for name in layers]
    device = next(quantized.parameters()).device
    images = 0
    try:
        for x in batches:
            quantized(x.to(device))
            images += len(x)
    finally:
        for hook in hooks:
            hook.remove()
    if images == 0:
        raise QuantizeError("no calibration images: pass a data config with images (--calibrate data=...).")
    for name in layers:
        float_layer = quantized.get_submodule(name)
        layer = _quant_layer(float_layer, fmt)
        layer.set_scales(float_layer.weight, observers[name].amax(fmt).to(device))
        _replace(quantized, name, layer)
    quantized.lkcnn_quantization = {"precision": fmt.name, "observer": observer, "layers": layers,
                                    "calibration_images": images,
                                    **({"percentile": percentile} if observer == "percentile" else {})}
    return quantized


@torch.no_grad()
def top1_agreement(reference: nn.Module, candidate: nn.Module, batches: Iterable[Tensor]) -> tuple[float, int]:
    """(share of images on which both models predict the same class, number of images)."""
    same = total = 0
    device = next(reference.parameters(), next(reference.buffers())).device
    for x in batches:
        x = x.to(device)
        same += int((reference(x).argmax(-1) == candidate(x).argmax(-1)).sum())
        total += len(x)
    return (same / total if total else 0.0), total
