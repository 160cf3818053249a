"""`gelu_grn(h, gamma, beta)`: GELU, then GRN (Global Response Normalization, Woo et al., "ConvNeXt V2"), on an
NHWC tensor, as UniRepLKNet's blocks apply them after their first linear layer:

    x = GELU(h)   gx[n, c] = ||x[n, :, :, c]||_2   nx = gx / (mean_c gx + 1e-6)   out = (gamma * nx + 1) * x + beta

On a GPU, a contiguous NHWC input runs four Triton kernels (lkcnn/ops/grn_triton.py), two passes each way: the
per-image sums of x^2, then out; the per-image sums of g * x and of g, then the input gradient; GELU recomputed from h
in each. What lies between them is per image and channel (N x C values) and stays in torch ops, so that
torch.compile fuses it, and each pass is one registered op, so the compiled step keeps one graph; the output pass's
registered backward runs the other two, so the graph holds no autograd.Function (AOT autograd's cache would skip it,
and a second run would compile anew). Why our own kernels: inductor's for this pattern, column reductions over an
image's rows that recompute GELU with libdevice's erf, are bound by that arithmetic (1.0-1.5 TB/s on an H200); these
take GELU from one reciprocal and one exponential (lkcnn/ops/triton_math.py): UniRepLKNet-B +9.7% images/s
(docs/performance.md). Elsewhere (the CPU, other layouts, `set_conv_impl('torch')`, `set_grn_kernels(False)`, ONNX
export) the same arithmetic runs as torch ops, as the official code writes it.

The kernel path returns h's dtype (under autocast, the 16-bit activation the next linear layer casts to anyway).
"""
from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch import Tensor

from .dwconv import _new_like, _poisoned, conv_impl

EPS = 1e-6
TRITON = importlib.util.find_spec("triton") is not None  # imported only where a GPU runs the kernels
_kernels_enabled = True


def set_grn_kernels(enabled: bool) -> None:
    """Whether GELU + GRN may run on lkcnn's kernels on a GPU (the default) or always as torch ops, whatever the conv
    policy: their A/B alone (`python -m lkcnn.bench e2e --runs auto,auto_torch_grn`). Read at every call."""
    global _kernels_enabled
    _kernels_enabled = bool(enabled)


def grn(x: Tensor, gamma: Tensor, beta: Tensor | None) -> Tensor:
    """GRN of an NHWC tensor in torch ops, as the official code computes it (gamma, beta of shape (1, 1, 1, C))."""
    gx = torch.norm(x, p=2, dim=(1, 2), keepdim=True)
    nx = gx / (gx.mean(dim=-1, keepdim=True) + EPS)
    out = (gamma * nx + 1) * x
    return out + beta if beta is not None else out


def uses_kernels(h: Tensor) -> bool:
    """Whether gelu_grn runs lkcnn's kernels on h (else torch ops)."""
    return (_kernels_enabled and conv_impl() != "torch" and h.is_cuda and h.dim() == 4 and h.is_contiguous()
            and h.dtype in (torch.float32, torch.float16, torch.bfloat16) and h.numel() > 0
            and not torch.onnx.is_in_onnx_export() and TRITON)


def gelu_grn(h: Tensor, gamma: Tensor, beta: Tensor | None) -> Tensor:
    """GRN(GELU(h)) of an NHWC tensor h (N, H, W, C); gamma and beta hold C values (beta may be None)."""
    if not uses_kernels(h):
        return grn(F.gelu(h), gamma, beta)
    rows = _rows(h)
    with torch.no_grad():  # the norms' gradient is gelu_grn_apply's backward's
        gx = gelu_grn_sumsq(rows.detach()).sum(1).sqrt()
        scale = _terms(gx, gamma.detach())[2]
    return gelu_grn_apply(rows, gamma, beta, gx, scale).view(h.shape)


def _rows(t: Tensor) -> Tensor:
    return t.reshape(t.shape[0], -1, t.shape[-1])


# ------------------------------------------------------------------------------------------- the four passes
@torch.library.custom_op("lkcnn::gelu_grn_sumsq", mutates_args=())
def gelu_grn_sumsq(h: Tensor) -> Tensor:
    """(N, splits, C) float32: sums of GELU(h)^2 over parts of each image's rows (h: (N, R, C)); their sum over
    the splits is the squared norm."""
    return F.gelu(h.float()).square().sum(1, keepdim=True)


def _partial_sums(h: Tensor, *lead: int) -> Tensor:
    """An empty (*lead, N, splits, C) float32 tensor for partial sums over each image's rows: splits as the kernels
    cut the rows on a GPU, one elsewhere."""
    splits = 1
    if h.is_cuda:
        from . import grn_triton  # Triton is imported only where a GPU runs the kernels
        splits = grn_triton.reduction_splits(*h.shape, device=h.device)[0]
    return h.new_empty(*lead, h.shape[0], splits, h.shape[2], dtype=torch.float32)


@gelu_grn_sumsq.register_fake
def _(h: Tensor) -> Tensor:
    return _partial_sums(h)


@gelu_grn_sumsq.register_kernel("cuda")
def _(h: Tensor) -> Tensor:
    from . import grn_triton
    part = _poisoned(_partial_sums(h))
    grn_triton.sumsq(h.contiguous(), part)
    return part


@torch.library.custom_op("lkcnn::gelu_grn_apply", mutates_args=())
def gelu_grn_apply(h: Tensor, gamma: Tensor, beta: Tensor | None, gx: Tensor, scale: Tensor) -> Tensor:
    """GELU(h) * scale[n, c] (+ beta[c]) in h's dtype, where gx (N, C) float32 holds the norms of GELU(h) and
    scale = gamma * nx + 1 (`_terms`): the backward differentiates through them (GRN's whole input gradient), so h,
    gamma and beta (C values each) are the differentiable inputs. One op with its own backward, not an
    autograd.Function: AOT autograd's cache skips graphs that hold one (then every run compiles anew)."""
    out = F.gelu(h.float()) * scale[:, None, :]
    return (out if beta is None else out + beta.float().reshape(-1)).to(h.dtype)


@gelu_grn_apply.register_fake
def _(h: Tensor, gamma: Tensor, beta: Tensor | None, gx: Tensor, scale: Tensor) -> Tensor:
    return torch.empty_like(h)


@gelu_grn_apply.register_kernel("cuda")
def _(h: Tensor, gamma: Tensor, beta: Tensor | None, gx: Tensor, scale: Tensor) -> Tensor:
    from . import grn_triton
    out = _new_like(h)
    grn_triton.apply(h.contiguous(), scale.contiguous(), None if beta is None else beta.reshape(-1).contiguous(), out)
    return out


@torch.library.custom_op("lkcnn::gelu_grn_grad_sums", mutates_args=())
def gelu_grn_grad_sums(g: Tensor, h: Tensor) -> Tensor:
    """(2, N, splits, C) float32: sums of g * GELU(h) and of g over parts of each image's rows."""
    g = g.float()
    return torch.stack([(g * F.gelu(h.float())).sum(1, keepdim=True), g.sum(1, keepdim=True)])


@gelu_grn_grad_sums.register_fake
def _(g: Tensor, h: Tensor) -> Tensor:
    return _partial_sums(h, 2)


@gelu_grn_grad_sums.register_kernel("cuda")
def _(g: Tensor, h: Tensor) -> Tensor:
    from . import grn_triton
    part = _poisoned(_partial_sums(h, 2))
    grn_triton.grad_sums(g.contiguous(), h.contiguous(), part)
    return part


@torch.library.custom_op("lkcnn::gelu_grn_grad_apply", mutates_args=())
def gelu_grn_grad_apply(g: Tensor, h: Tensor, scale: Tensor, t: Tensor) -> Tensor:
    """(g * scale[n, c] + GELU(h) * t[n, c]) * GELU'(h) in h's dtype, GELU'(h) = Phi(h) + h * phi(h): the input
    gradient."""
    hf = h.float()
    return torch.ops.aten.gelu_backward(g.float() * scale[:, None, :] + F.gelu(hf) * t[:, None, :], hf).to(h.dtype)


@gelu_grn_grad_apply.register_fake
def _(g: Tensor, h: Tensor, scale: Tensor, t: Tensor) -> Tensor:
    return torch.empty_like(h)


@gelu_grn_grad_apply.register_kernel("cuda")
def _(g: Tensor, h: Tensor, scale: Tensor, t: Tensor) -> Tensor:
    from . import grn_triton
    dh = _new_like(h)
    grn_triton.grad_apply(g.contiguous(), h.contiguous(), scale.contiguous(), t.contiguous(), dh)
    return dh


# ------------------------------------------------------------------------------------ gelu_grn_apply's backward
def _terms(gx: Tensor, gamma: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(m, nx, scale) from the norms gx (N, C): m = mean_c gx + eps, nx = gx / m, the output's scale gamma * nx + 1."""
    m = gx.mean(-1, keepdim=True) + EPS
    nx = gx / m
    return m, nx, gamma.reshape(1, -1).float() * nx + 1


def _setup_context(ctx, inputs: tuple, output: Tensor) -> None:
    h, gamma, beta, gx, scale = inputs
    ctx.save_for_backward(h, gamma, gx)
    ctx.beta_meta = None if beta is None else (beta.shape, beta.dtype)


def _backward(ctx, g: Tensor) -> tuple[Tensor | None, ...]:
    h, gamma, gx = ctx.saved_tensors
    m, nx, scale = _terms(gx, gamma)
    g = g.contiguous()
    sums = gelu_grn_grad_sums(g, h).sum(2)
    gxs, gs = sums[0], sums[1]  # per image and channel: sum of g * x, sum of g
    dgamma = (gxs * nx).sum(0)
    dnx = gxs * gamma.reshape(1, -1).float()
    # nx = gx / m with m = mean_c(gx) + eps; then gx = ||x||, whose gradient is x / gx (0 where gx is 0, as
    # torch.norm's backward has it)
    dgx = dnx / m - (dnx * gx).sum(-1, keepdim=True) / (m * m * gx.shape[-1])
    t = torch.where(gx > 0, dgx / gx.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    dh = gelu_grn_grad_apply(g, h, scale, t)
    dbeta = None if ctx.beta_meta is None else gs.sum(0).reshape(ctx.beta_meta[0]).to(ctx.beta_meta[1])
    return dh, dgamma.reshape(gamma.shape).to(gamma.dtype), dbeta, None, None


gelu_grn_apply.register_autograd(_backward, setup_context=_setup_context)
