"""8-bit quantization of a deployed (re-parameterized) model: calibrate, then run it in fake-quant form.

What is quantized: every `nn.Conv2d` (lkcnn's `LargeKernelConv` included) and `nn.Linear` except the stem and
the classifier (`default_float_layers`; `keep_float=[]` quantizes them too). Its weights are quantized per output
channel, symmetrically (scale = max |w| of the channel / qmax); its input activation per tensor, symmetrically, with
a scale from calibration batches. Biases, BatchNorms, activations functions, pooling and residual additions stay in
float32, as an 8-bit inference engine keeps them in its fused epilogues. Formats: INT8 (qmax 127, QuantizeLinear
saturates to [-128, 127]) and FP8 e4m3fn (qmax 448).

Why the stem stays in float: it runs at the highest resolution, and the network amplifies noise added there (on the
digits model, noise at the first conv's output reaches the logits 7-10 dB stronger, noise at the last stage's output
13 dB weaker), so its 8-bit rounding costs more than that of all later layers together in FP8 (whose 3 mantissa
bits give every layer about 31 dB) and about half of the error in INT8. It is little of the work: 4 of RepLKNet-31B's
131 conv and linear layers, with the classifier 1.7% of its multiply-adds at 224 px (12% of the digits model's at
32 px); the classifier stays in float as is usual for 8-bit inference.
Per-tensor weight scales are the naive setting: a re-parameterized large kernel, the sum of branches with their
BatchNorms folded in, has channels of very different magnitude (max/median of the channels' max |w| up to 12 in the
digits model), which a single scale resolves up to 13 dB worse in INT8.

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
Weights use torch.ao's PerChannelMinMaxObserver (max |w| per output channel), or with `per_channel=False` its
MinMaxObserver (one max |w| for the tensor).

`layer_snr` and `layer_sensitivity` measure where the error arises (signal-to-noise ratios against the float model).
"""
from __future__ import annotations

import copy
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.ao.quantization.observer import MinMaxObserver, PerChannelMinMaxObserver

from lkcnn.errors import UserError
from lkcnn.layers import LargeKernelConv
from lkcnn.ops import dwconv2d
from lkcnn.ops.qdq import (DTYPE_NAMES, QRANGE, dequantize_linear, dequantize_values, fake_quantize,
                           quantize_linear, quantize_values)

OBSERVERS = ("minmax", "percentile", "mse")
DEFAULT_PERCENTILE = 99.99
HISTOGRAM_BINS = 2048
MSE_CANDIDATES = 128  # amax candidates from max/128 to max
MSE_SUBSAMPLES = 4  # points per histogram bin in the error estimate (a bin spans one INT8 step at amax = max/16)
MIN_SCALE = torch.finfo(torch.float32).eps  # torch.ao's floor for a scale: an all-zero tensor still gets one


class QuantizeError(UserError, ValueError):
    """A model or setting that cannot be quantized; the message says what to do."""


@dataclass(frozen=True)
class Format:
    """An 8-bit number format: its name on the command line and the quantized dtype (lkcnn.ops.qdq's name)."""

    name: str
    dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPE_NAMES[self.dtype]

    @property
    def qmax(self) -> float:
        """The magnitude amax maps to: the largest value QuantizeLinear saturates to."""
        return QRANGE[self.torch_dtype][1]

    def scale(self, amax: Tensor) -> Tensor:
        """Symmetric scale that maps `amax` to the format's largest magnitude."""
        return (amax.float() / self.qmax).clamp_min(MIN_SCALE)

    def fake_quantize(self, x: Tensor, scale: Tensor) -> Tensor:
        return fake_quantize(x, scale, self.dtype)


FORMATS = {"int8": Format("int8", "int8"), "fp8": Format("fp8", "float8_e4m3fn")}


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


def weight_amax(weight: Tensor, per_channel: bool = True) -> Tensor:
    """max |w| per output channel (axis 0), by torch.ao's PerChannelMinMaxObserver; with `per_channel=False` the
    tensor's max |w| (its MinMaxObserver) for every channel."""
    if not per_channel:
        observer = MinMaxAmax()
        observer.update(weight)
        return observer.amax(FORMATS["int8"]).expand(weight.shape[0]).clone()
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
        # True: QDQ in plain torch ops (`_inputs`); lkcnn.deploy.gemm8 sets it on the layers it leaves in this form
        self.fusable = False
        # True: the input arrives on this layer's 8-bit grid (an 8-bit GEMM's epilogue put it there), no QDQ needed
        self.input_on_grid = False

    @torch.no_grad()
    def set_scales(self, float_weight: Tensor, input_amax: Tensor, per_channel: bool = True) -> None:
        """Quantize `float_weight` (a scale per output channel, or one for the tensor) and set the input scale from
        the calibrated amax."""
        fmt = FORMATS[self.precision]
        self.weight_scale.copy_(fmt.scale(weight_amax(float_weight, per_channel)))
        self.weight.copy_(quantize_linear(float_weight.float(), self.weight_scale, self.qdtype, 0))
        self.input_scale.copy_(fmt.scale(input_amax))

    def _inputs(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        if self.input_on_grid or self.fusable:  # the registered ops' arithmetic, which torch.compile fuses into the
            # neighbouring kernels, where each registered op (opaque to it, but what ONNX export needs) is a pass of
            # its own over the tensor
            xq = x if self.input_on_grid else dequantize_values(
                quantize_values(x, self.input_scale, DTYPE_NAMES[self.qdtype]), self.input_scale)
            w = dequantize_values(self.weight, self.weight_scale, 0)
        else:
            xq = fake_quantize(x, self.input_scale, self.qdtype)
            w = dequantize_linear(self.weight, self.weight_scale, 0)
        return xq.to(x.dtype), w.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype)

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


def default_float_layers(model: nn.Module) -> list[str]:
    """The layers `quantize` keeps in float unless told otherwise: the stem (the `stem` pattern of timm's
    `group_matcher()`) and the classifier (`pretrained_cfg["classifier"]`); none for a model that names neither."""
    stem = model.group_matcher().get("stem") if hasattr(model, "group_matcher") else None
    classifier = (getattr(model, "pretrained_cfg", None) or {}).get("classifier")
    return [name for name in quantizable_layers(model)
            if (isinstance(stem, str) and re.match(stem, name)) or (classifier and _under(name, classifier))]


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _float_layers(model: nn.Module, keep_float: Sequence[str] | None) -> list[str]:
    """`keep_float` (module names, each standing for the layers under it; None: `default_float_layers`) resolved to
    the names of the Conv2d / Linear layers it covers."""
    if keep_float is None:
        return default_float_layers(model)
    keep_float = [keep_float] if isinstance(keep_float, str) else keep_float
    layers = quantizable_layers(model)
    for prefix in keep_float:
        if not any(_under(name, prefix) for name in layers):
            raise QuantizeError(f"keep-float {prefix!r} names no Conv2d or Linear layer of the model; pass module "
                                f"names such as {', '.join(dict.fromkeys(n.split('.')[0] for n in layers))}.")
    return [name for name in layers if any(_under(name, prefix) for prefix in keep_float)]


@torch.no_grad()
def quantize(model: nn.Module, batches: Iterable[Tensor], precision: str = "int8", observer: str = "mse",
             percentile: float = DEFAULT_PERCENTILE, keep_float: Sequence[str] | None = None,
             per_channel: bool = True) -> nn.Module:
    """A fake-quant copy of the deploy-form `model`, calibrated on `batches` (input tensors); `model` is unchanged.

    `keep_float`: module names whose Conv2d / Linear layers stay in float (None: the stem and the classifier, see
    `default_float_layers`; [] quantizes every layer). `per_channel=False` gives each weight tensor one scale.
    The copy's `lkcnn_quantization` records what was done (precision, observer, the quantized and the float layer
    names); `prepare_quantized` needs the quantized names to rebuild it.
    """
    fmt = get_format(precision)
    check_deploy_form(model)
    if observer == "percentile" and not 0 < percentile <= 100:
        raise QuantizeError(f"percentile {percentile} must be in (0, 100], e.g. 99.99.")
    quantized = copy.deepcopy(model).eval()
    float_layers = _float_layers(quantized, keep_float)
    layers = [name for name in quantizable_layers(quantized) if name not in float_layers]
    if not layers:
        raise QuantizeError("the model has no Conv2d or Linear layer to quantize" +
                            (" outside the float layers (keep-float)." if float_layers else "."))
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
        layer.set_scales(float_layer.weight, observers[name].amax(fmt).to(device), per_channel)
        _replace(quantized, name, layer)
    quantized.lkcnn_quantization = {"precision": fmt.name, "observer": observer, "layers": layers,
                                    "float_layers": float_layers, "per_channel": per_channel,
                                    "calibration_images": images,
                                    **({"percentile": percentile} if observer == "percentile" else {})}
    return quantized


# -------------------------------------------------------------------------------------------------------- analysis
def _snr_db(signal: float, noise: float) -> float:
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf


def _power(x: Tensor) -> float:
    return float(x.double().square().sum())


@torch.no_grad()
def output_snr(reference: nn.Module, candidate: nn.Module, batches: Iterable[Tensor]) -> float:
    """SNR in dB of `candidate`'s outputs (logits) against `reference`'s on `batches`."""
    signal = noise = 0.0
    device = next(reference.parameters()).device
    for x in batches:
        expected = reference(x.to(device))
        signal += _power(expected)
        noise += _power(candidate(x.to(device)) - expected)
    return _snr_db(signal, noise)


@torch.no_grad()
def layer_snr(reference: nn.Module, quantized: nn.Module, batches: Iterable[Tensor]) -> dict[str, float]:
    """SNR in dB of every Conv2d / Linear layer's output in the quantized model against the same layer's output in
    the float `reference`, both fed the same images: how the error builds up along the network (the float layers'
    outputs carry the error of the 8-bit layers before them)."""
    names = quantizable_layers(reference)
    expected: dict[str, Tensor] = {}
    power = {name: [0.0, 0.0] for name in names}  # signal, noise

    def compare(name: str, out: Tensor) -> None:
        power[name][0] += _power(expected[name])
        power[name][1] += _power(out - expected[name])

    hooks = [reference.get_submodule(name).register_forward_hook(
        lambda _, __, out, name=name: expected.__setitem__(name, out)) for name in names]
    hooks += [quantized.get_submodule(name).register_forward_hook(
        lambda _, __, out, name=name: compare(name, out)) for name in names]
    device = next(reference.parameters()).device
    try:
        for x in batches:
            reference(x.to(device))
            quantized(x.to(device))
    finally:
        for hook in hooks:
            hook.remove()
    return {name: _snr_db(*power[name]) for name in names}


@torch.no_grad()
def layer_sensitivity(reference: nn.Module, quantized: nn.Module, batches: Iterable[Tensor]) -> dict[str, float]:
    """For each 8-bit layer of `quantized`: the SNR in dB of the float `reference`'s outputs when that layer alone is
    8-bit. A layer's own rounding error times how much the rest of the network amplifies it; the lowest values are
    the layers worth keeping in float. `reference` gets each layer swapped in and back."""
    device = next(reference.parameters()).device
    inputs = [x.to(device) for x in batches]
    expected = [reference(x) for x in inputs]
    signal = sum(_power(e) for e in expected)
    result = {}
    for name in quantized.lkcnn_quantization["layers"]:
        original = reference.get_submodule(name)
        _replace(reference, name, quantized.get_submodule(name))
        try:
            result[name] = _snr_db(signal, sum(_power(reference(x) - e) for x, e in zip(inputs, expected)))
        finally:
            _replace(reference, name, original)
    return result


@torch.no_grad()
def top1_agreement(reference: nn.Module, candidate: nn.Module, batches: Iterable[Tensor]) -> tuple[float, int]:
    """(share of images on which both models predict the same class, number of images)."""
    same = total = 0
    device = next(reference.parameters()).device
    for x in batches:
        x = x.to(device)
        same += int((reference(x).argmax(-1) == candidate(x).argmax(-1)).sum())
        total += len(x)
    return (same / total if total else 0.0), total
