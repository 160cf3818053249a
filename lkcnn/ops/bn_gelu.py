"""`batch_norm_gelu(x, ...)`: GELU(BatchNorm(x)) of a channels_last activation in training mode (batch statistics,
running statistics updated), as RepLKNet's ConvFFN applies them after its first 1x1 conv.

On a GPU, a channels_last x runs four Triton kernels (lkcnn/ops/bn_gelu_triton.py), two passes each way: the
per-channel moments of x, then the output; the per-channel sums of dz = g * GELU'(z) and of dz * x_hat, then the input
gradient; GELU recomputed from x in each. What lies between them is per channel and stays in torch ops (inductor
fuses it); each pass is one registered op, so the compiled step keeps one graph, and the output pass's registered
backward runs the other two, so the graph holds no autograd.Function (AOT autograd's cache would skip it). Why our
own kernels: inductor's for this pattern recompute GELU with libdevice's erf in the forward, the gradient sums and
the gradient apply, and are bound by that arithmetic (1.4-2.2 TB/s on an H200, docs/performance.md, Open 5), and its
one-dimensional pointwise kernels load the per-channel terms at every element; these take GELU from one reciprocal
and one exponential (lkcnn/ops/triton_math.py) and load the terms once a tile: RepLKNet-31B +0.6-2.7% images/s
(docs/performance.md). Elsewhere (the CPU, other layouts, `set_conv_impl('torch')`,
`set_bn_gelu_kernels(False)`, ONNX export) F.batch_norm and F.gelu run.

The kernel path returns x's dtype, as F.batch_norm does for a 16-bit input under autocast.
"""
from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch import Tensor

from .dwconv import _new_like, _poisoned, conv_impl
from .sync_batchnorm import update_running_stats

TRITON = importlib.util.find_spec("triton") is not None  # imported only where a GPU runs the kernels
_kernels_enabled = True


def set_bn_gelu_kernels(enabled: bool) -> None:
    """Whether BatchNorm + GELU may run on lkcnn's kernels on a GPU (the default) or always as torch ops, whatever the
    conv policy: their A/B alone (`python -m lkcnn.bench e2e --runs auto,auto_torch_bn_gelu`). Read at every call."""
    global _kernels_enabled
    _kernels_enabled = bool(enabled)


def uses_kernels(x: Tensor) -> bool:
    """Whether batch_norm_gelu runs lkcnn's kernels on x (else torch ops)."""
    return (_kernels_enabled and conv_impl() != "torch" and x.is_cuda and x.dim() == 4
            and x.is_contiguous(memory_format=torch.channels_last)
            and x.dtype in (torch.float32, torch.float16, torch.bfloat16) and x.numel() > 0
            and x.shape[0] * x.shape[2] * x.shape[3] > 1 and not torch.onnx.is_in_onnx_export() and TRITON)


def batch_norm_gelu(x: Tensor, weight: Tensor, bias: Tensor, running_mean: Tensor, running_var: Tensor,
                    momentum: float, eps: float) -> Tensor:
    """F.gelu(F.batch_norm(x, running_mean, running_var, weight, bias, training=True, momentum, eps)): the output
    from the batch's statistics, the running statistics moved towards them in place (unbiased variance)."""
    if not uses_kernels(x):
        return F.gelu(F.batch_norm(x, running_mean, running_var, weight, bias, True, momentum, eps))
    n, c, h, w = x.shape
    rows = x.permute(0, 2, 3, 1).reshape(-1, c)  # a view: x is channels_last
    with torch.no_grad():  # the statistics' gradient is bn_gelu_apply's backward's
        mean, var = merge_moments(bn_gelu_stats(rows.detach()), rows.shape[0])
        rstd = torch.rsqrt(var + eps)
        update_running_stats(running_mean, running_var, mean, var, rows.shape[0], momentum)
        a = weight.detach().float() * rstd
        b = bias.detach().float() - mean * a
    return bn_gelu_apply(rows, weight, bias, mean, rstd, a, b).view(n, h, w, c).permute(0, 3, 1, 2)


def merge_moments(part: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """(mean, biased variance) of each channel's n values from bn_gelu_stats's per-split count, mean and sum of
    squared deviations (Chan et al.'s merge)."""
    count, means, m2 = part
    mean = (count * means).sum(0) / n
    return mean, (m2 + count * (means - mean).square()).sum(0) / n


# ------------------------------------------------------------------------------------------- the four passes
def _splits(x: Tensor) -> int:
    """How many parts the kernels split x's rows into for the per-channel reductions (one off the GPU)."""
    if not x.is_cuda:
        return 1
    from . import bn_gelu_triton  # Triton is imported only where a GPU runs the kernels
    return bn_gelu_triton.reduction_splits(*x.shape, device=x.device)[0]


@torch.library.custom_op("lkcnn::bn_gelu_stats", mutates_args=())
def bn_gelu_stats(x: Tensor) -> Tensor:
    """(3, splits, C) float32: the count, mean and sum of squared deviations of x's columns over parts of its rows
    (x: (R, C))."""
    xf = x.float()
    mean = xf.mean(0)
    return torch.stack([torch.full_like(mean, x.shape[0]), mean, (xf - mean).square().sum(0)])[:, None]


@bn_gelu_stats.register_fake
def _(x: Tensor) -> Tensor:
    return x.new_empty(3, _splits(x), x.shape[1], dtype=torch.float32)


@bn_gelu_stats.register_kernel("cuda")
def _(x: Tensor) -> Tensor:
    from . import bn_gelu_triton
    part = _poisoned(x.new_empty(3, _splits(x), x.shape[1], dtype=torch.float32))
    bn_gelu_triton.stats(x.contiguous(), part)
    return part


@torch.library.custom_op("lkcnn::bn_gelu_apply", mutates_args=())
def bn_gelu_apply(x: Tensor, weight: Tensor, bias: Tensor, mean: Tensor, rstd: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """GELU(x * a[c] + b[c]) in x's dtype, a = weight * rstd and b = bias - mean * a (float32, (C,)), where mean and
    rstd are x's batch statistics: the backward differentiates through them (the BatchNorm's whole input gradient),
    so x, weight and bias are the differentiable inputs. One op with its own backward, not an autograd.Function:
    AOT autograd's cache skips graphs that hold one (then every run compiles anew)."""
    return F.gelu(x.float() * a + b).to(x.dtype)


@bn_gelu_apply.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor, mean: Tensor, rstd: Tensor, a: Tensor, b: Tensor) -> Tensor:
    return torch.empty_like(x)


@bn_gelu_apply.register_kernel("cuda")
def _(x: Tensor, weight: Tensor, bias: Tensor, mean: Tensor, rstd: Tensor, a: Tensor, b: Tensor) -> Tensor:
    from . import bn_gelu_triton
    out = _new_like(x)
    bn_gelu_triton.apply(x.contiguous(), a.contiguous(), b.contiguous(), out)
    return out


def _dz(g: Tensor, x: Tensor, a: Tensor, b: Tensor, mean: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    """(dz, x_hat) in float32 torch ops: dz = g * GELU'(z), z = x * a + b, GELU'(z) = Phi(z) + z phi(z)."""
    xf = x.float()
    return torch.ops.aten.gelu_backward(g.float(), xf * a + b), (xf - mean) * rstd


@torch.library.custom_op("lkcnn::bn_gelu_grad_sums", mutates_args=())
def bn_gelu_grad_sums(g: Tensor, x: Tensor, a: Tensor, b: Tensor, mean: Tensor, rstd: Tensor) -> Tensor:
    """(2, splits, C) float32: sums of dz and of dz * x_hat over parts of the rows."""
    dz, x_hat = _dz(g, x, a, b, mean, rstd)
    return torch.stack([dz.sum(0), (dz * x_hat).sum(0)])[:, None]


@bn_gelu_grad_sums.register_fake
def _(g: Tensor, x: Tensor, a: Tensor, b: Tensor, mean: Tensor, rstd: Tensor) -> Tensor:
    return x.new_empty(2, _splits(x), x.shape[1], dtype=torch.float32)


@bn_gelu_grad_sums.register_kernel("cuda")
def _(g: Tensor, x: Tensor, a: Tensor, b: Tensor, mean: Tensor, rstd: Tensor) -> Tensor:
    from . import bn_gelu_triton
    part = _poisoned(x.new_empty(2, _splits(x), x.shape[1], dtype=torch.float32))
    bn_gelu_triton.grad_sums(g.contiguous(), x.contiguous(), [t.contiguous() for t in (a, b, mean, rstd)], part)
    return part


@torch.library.custom_op("lkcnn::bn_gelu_grad_apply", mutates_args=())
def bn_gelu_grad_apply(g: Tensor, x: Tensor, a: Tensor, b: Tensor, mean: Tensor, rstd: Tensor, c0: Tensor,
                       c1: Tensor) -> Tensor:
    """a[c] * (dz - c0[c] - x_hat * c1[c]) in x's dtype: the input gradient, c0 and c1 the means of dz and of
    dz * x_hat over the rows."""
    dz, x_hat = _dz(g, x, a, b, mean, rstd)
    return (a * (dz - c0 - x_hat * c1)).to(x.dtype)


@bn_gelu_grad_apply.register_fake
def _(g: Tensor, x: Tensor, a: Tensor, b: Tensor, mean: Tensor, rstd: Tensor, c0: Tensor, c1: Tensor) -> Tensor:
    return torch.empty_like(x)


@bn_gelu_grad_apply.register_kernel("cuda")
def _(g: Tensor, x: Tensor, a: Tensor, b: Tensor, mean: Tensor, rstd: Tensor, c0: Tensor, c1: Tensor) -> Tensor:
    from . import bn_gelu_triton
    dx = _new_like(x)
    bn_gelu_triton.grad_apply(g.contiguous(), x.contiguous(), [t.contiguous() for t in (a, b, mean, rstd, c0, c1)],
                              dx)
    return dx


# ------------------------------------------------------------------------------------ bn_gelu_apply's backward
def _setup_context(ctx, inputs: tuple, output: Tensor) -> None:
    x, weight, bias, mean, rstd, a, b = inputs
    ctx.save_for_backward(x, mean, rstd, a, b)
    ctx.dtypes = weight.dtype, bias.dtype


def _backward(ctx, g: Tensor) -> tuple[Tensor | None, ...]:
    x, mean, rstd, a, b = ctx.saved_tensors
    terms = [a, b, mean, rstd]
    g = g.contiguous()
    sum_dz, sum_dzx = bn_gelu_grad_sums(g, x, *terms).sum(1)
    dx = bn_gelu_grad_apply(g, x, *terms, sum_dz / x.shape[0], sum_dzx / x.shape[0])
    return dx, sum_dzx.to(ctx.dtypes[0]), sum_dz.to(ctx.dtypes[1]), None, None, None, None


bn_gelu_apply.register_autograd(_backward, setup_context=_setup_context)
