"""The registered op `torch.ops.lkcnn.dwconv2d_branches_fwd` (+ its backward ops) and the public `dwconv2d_branches`:
several small depthwise convolutions of one input (branch b: a k_b x k_b kernel at dilation r_b, 'same' padding),
the parallel small branches of a re-parameterizable block (RepLKNet's 5x5, UniRepLKNet's dilated branches).

On a GPU, a channels_last input runs on lkcnn's NHWC kernels (csrc/dwconv/dwconv_branches.cu): one launch reads x
once and writes every branch's output, one writes the input gradient summed over the branches, one computes the
weight gradients (an undilated branch's comes from cuDNN, which is faster there). Where those kernels do
not apply (the CPU, an NCHW input, channels not a multiple of 16 bytes, a (k, r) without a kernel, more than 7
branches) each branch runs PyTorch's convolution, as `nn.Conv2d` would; so does every call under
`set_conv_impl('torch')` or `set_branch_kernels(False)`. Either way each pass is one registered op, so torch.compile
keeps one graph.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from . import build, reference
from .dwconv import _laid_out_as, _memory_format, _new_like, conv_impl

MAX_BRANCHES = 8
_kernels_enabled = True


def set_branch_kernels(enabled: bool) -> None:
    """Whether the small branches may run on lkcnn's branch kernels (the default) or always take PyTorch's
    convolution per branch, whatever the conv policy: an A/B of the branch kernels alone (`python -m lkcnn.bench e2e
    --runs auto,auto_cudnn_small`). Read at every call, in a compiled graph too."""
    global _kernels_enabled
    _kernels_enabled = bool(enabled)


def _kernel_sizes(weights: list[Tensor]) -> list[int]:
    return [int(w.shape[-1]) for w in weights]


def uses_kernels(x: Tensor, kernel_sizes: list[int], dilations: list[int]) -> bool:
    """Whether a call with these arguments runs lkcnn's branch kernels (else PyTorch's convolution per branch)."""
    if not _kernels_enabled or conv_impl() == "torch" or not x.is_cuda:
        return False
    try:
        module = build.load()
    except build.BuildError:
        return False  # dwconv2d's large kernels report the build failure; the small branches run cuDNN meanwhile
    return module.branches_supported(x, kernel_sizes, dilations)


def _table(weights: list[Tensor]) -> Tensor:
    """The kernels as one (taps, C) table, branch after branch, each kernel's taps row-major (in their dtype, which
    dwconv2d_branches makes x's)."""
    return torch.cat([w.reshape(w.shape[0], -1).t() for w in weights]).contiguous()


def _channels_last(t: Tensor) -> Tensor:
    return t.contiguous(memory_format=torch.channels_last)


@torch.library.custom_op("lkcnn::dwconv2d_branches_fwd", mutates_args=())
def dwconv2d_branches_fwd(x: Tensor, weights: list[Tensor], dilations: list[int]) -> list[Tensor]:
    ks = _kernel_sizes(weights)
    if uses_kernels(x, ks, dilations):
        ys = [_new_like(x) for _ in weights]
        build.load().branches_fwd(x, _table(weights), ks, dilations, ys)
        return ys
    fmt = _memory_format(x)
    return [reference.forward(x, w, None, [r * (k // 2)] * 2, r).contiguous(memory_format=fmt)
            for w, k, r in zip(weights, ks, dilations)]


@dwconv2d_branches_fwd.register_fake
def _(x: Tensor, weights: list[Tensor], dilations: list[int]) -> list[Tensor]:
    return [torch.empty_like(x, memory_format=_memory_format(x)) for _ in weights]


@torch.library.custom_op("lkcnn::dwconv2d_branches_bwd_input", mutates_args=())
def dwconv2d_branches_bwd_input(grad_outs: list[Tensor], weights: list[Tensor], dilations: list[int]) -> Tensor:
    ks, x = _kernel_sizes(weights), grad_outs[0]
    if uses_kernels(x, ks, dilations):
        dx = _new_like(x)
        build.load().branches_bwd_input([_channels_last(g) for g in grad_outs], _table(weights), ks, dilations, dx)
        return dx
    dx = sum(reference.grad_input(g, w, [r * (k // 2)] * 2, r) for g, w, k, r in zip(grad_outs, weights, ks, dilations))
    return dx.contiguous(memory_format=_memory_format(x))


@dwconv2d_branches_bwd_input.register_fake
def _(grad_outs: list[Tensor], weights: list[Tensor], dilations: list[int]) -> Tensor:
    return torch.empty_like(grad_outs[0], memory_format=_memory_format(grad_outs[0]))


@torch.library.custom_op("lkcnn::dwconv2d_branches_bwd_weight", mutates_args=())
def dwconv2d_branches_bwd_weight(grad_outs: list[Tensor], x: Tensor, kernel_sizes: list[int],
                                 dilations: list[int]) -> list[Tensor]:
    # cuDNN's weight gradient of an undilated depthwise kernel is faster than lkcnn's branch kernel at RepLKNet's 5x5
    # shapes (1.4-2.6x in 16 bits, 1.4-2.0x in fp32 at 14-56 rows, slower only at 7 rows; docs/kernels.md), so those
    # branches take it; the dilated ones, where cuDNN is slow, take the branch kernel
    ours = [b for b, r in enumerate(dilations) if r != 1] if uses_kernels(x, kernel_sizes, dilations) else []
    grads = [reference.grad_weight(g, x, [k, k], [r * (k // 2)] * 2, r).contiguous() if b not in ours else None
             for b, (g, k, r) in enumerate(zip(grad_outs, kernel_sizes, dilations))]
    if ours:
        ks = [kernel_sizes[b] for b in ours]
        table = build.load().branches_wgrad([_channels_last(grad_outs[b]) for b in ours], x, ks,
                                            [dilations[b] for b in ours])
        tap = 0
        for b, k in zip(ours, ks):
            # a copy each: views of one table would alias each other, which a custom op's outputs must not
            grads[b] = (table[tap:tap + k * k].t().reshape(x.shape[1], 1, k, k)
                        .to(x.dtype, memory_format=torch.contiguous_format, copy=True))
            tap += k * k
    return grads


@dwconv2d_branches_bwd_weight.register_fake
def _(grad_outs: list[Tensor], x: Tensor, kernel_sizes: list[int], dilations: list[int]) -> list[Tensor]:
    return [x.new_empty((x.shape[1], 1, k, k)) for k in kernel_sizes]


def _setup_context(ctx, inputs, output) -> None:
    x, weights, dilations = inputs
    ctx.save_for_backward(x, *weights)
    ctx.dilations = dilations


def _backward(ctx, grads: list[Tensor | None]):
    x, *weights = ctx.saved_tensors
    # a branch whose output the loss does not use has no gradient: it contributes zeros
    grads = [torch.zeros_like(x) if g is None else g for g in grads]
    grad_x, grad_ws = None, [None] * len(weights)
    if ctx.needs_input_grad[0]:
        grad_x = dwconv2d_branches_bwd_input(grads, weights, ctx.dilations)
    if any(ctx.needs_input_grad[1]):  # one flag per weight
        grad_ws = [_laid_out_as(g, w) if needed else None for g, w, needed in
                   zip(dwconv2d_branches_bwd_weight(grads, x, _kernel_sizes(weights), ctx.dilations), weights,
                       ctx.needs_input_grad[1])]
    return grad_x, grad_ws, None


dwconv2d_branches_fwd.register_autograd(_backward, setup_context=_setup_context)


def _flops(shape, kernel_sizes) -> int:
    n, c, h, w = shape
    return 2 * n * c * h * w * sum(k * k for k in kernel_sizes)


@register_flop_formula(torch.ops.lkcnn.dwconv2d_branches_fwd)
def _fwd_flops(x_shape, w_shapes, dilations, *args, **kwargs) -> int:
    return _flops(x_shape, [s[-1] for s in w_shapes])


@register_flop_formula(torch.ops.lkcnn.dwconv2d_branches_bwd_input)
def _bwd_input_flops(grad_shapes, w_shapes, dilations, *args, **kwargs) -> int:
    return _flops(grad_shapes[0], [s[-1] for s in w_shapes])


@register_flop_formula(torch.ops.lkcnn.dwconv2d_branches_bwd_weight)
def _bwd_weight_flops(grad_shapes, x_shape, kernel_sizes, dilations, *args, **kwargs) -> int:
    return _flops(x_shape, kernel_sizes)


def dwconv2d_branches(x: Tensor, weights: list[Tensor], dilations: list[int]) -> list[Tensor]:
    """The outputs of depthwise 'same' convolutions of x (N, C, H, W) with each weights[b] (C, 1, k, k), k odd, at
    dilation dilations[b]: [F.conv2d(x, w, padding=r * (k // 2), dilation=r, groups=C) for each branch], computed in
    one pass per direction where lkcnn's kernels apply. Under autocast x and the weights are cast to the autocast
    dtype (custom ops are not cast by autocast itself), as nn.Conv2d's would be."""
    if x.dim() != 4:
        raise ValueError(f"dwconv2d_branches expects x of shape (N, C, H, W), got {tuple(x.shape)}")
    if not 1 <= len(weights) <= MAX_BRANCHES or len(weights) != len(dilations):
        raise ValueError(f"dwconv2d_branches takes 1 to {MAX_BRANCHES} weights and one dilation each, got "
                         f"{len(weights)} weights and {len(dilations)} dilations")
    c = x.shape[1]
    for w, r in zip(weights, dilations):
        if w.dim() != 4 or tuple(w.shape[:2]) != (c, 1) or w.shape[-1] != w.shape[-2] or w.shape[-1] % 2 == 0:
            raise ValueError(f"dwconv2d_branches expects square odd depthwise kernels ({c}, 1, k, k), got "
                             f"{tuple(w.shape)}")
        if int(r) < 1:
            raise ValueError(f"dwconv2d_branches: dilations must be >= 1, got {r}")
    device_type = x.device.type
    if device_type != "meta" and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x, weights = x.to(dtype), [w.to(dtype) for w in weights]
    elif any(w.dtype != x.dtype for w in weights):
        raise ValueError(f"dwconv2d_branches: x is {x.dtype} but the weights are {[w.dtype for w in weights]}; cast "
                         "them to one dtype or use autocast")
    return torch.ops.lkcnn.dwconv2d_branches_fwd(x, list(weights), [int(r) for r in dilations])
