"""The registered op `torch.ops.lkcnn.dwconv2d_fwd` (+ its backward ops) and the public `dwconv2d`.

Each pass is its own custom op with a fake (meta) implementation, so autograd, torch.compile (no graph break) and
FlopCounterMode see one op per pass. Two variants serve channels_last training, where lkcnn's kernels read NCHW
copies: `dwconv2d_fwd_keep_flat` also returns the forward's copy of x, which autograd saves for the weight gradient, and
`dwconv2d_bwd` runs both backward passes on one copy of the gradient. Each op runs lkcnn's CUDA kernels when the
tensors are on a GPU and the configuration is supported, and PyTorch's convolution otherwise.
The implementation is a choice, `auto|cuda|torch`: `set_conv_impl` / `use_conv_impl` make it, LKCNN_CONV_IMPL is the
user's default. `cuda` raises when the kernels cannot run, `auto` falls back with one warning naming the reason (and
sends kernels under AUTO_MIN_KERNEL to PyTorch without one).
"""
from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Iterator

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from lkcnn.errors import UserError

from . import build, reference

IMPLS = ("auto", "cuda", "torch")
CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_KERNEL = 63
# Under 'auto', kernels smaller than this go to PyTorch (cuDNN's channels_last kernels beat lkcnn's at 3x3, and at
# 5x5 in fp32 and fp16: benchmarks/h200_kernels_*.json, docs/performance.md); 'cuda' still runs lkcnn's kernels.
AUTO_MIN_KERNEL = 7
ENV_VAR = "LKCNN_CONV_IMPL"
_warned: set[str] = set()


def read_env() -> str:
    """LKCNN_CONV_IMPL now, lower-cased ("" when unset)."""
    return os.environ.get(ENV_VAR, "").strip().lower()


# LKCNN_CONV_IMPL, read once when lkcnn is imported: the op's hot path reads no environment, a run's choice cannot
# change under it, and a compiled network's trace changes no state (read lazily, the first trace stored it, and the
# guard on the unread value recompiled the whole network at its second call)
_env_impl: str = read_env()
_chosen: str | None = None  # set_conv_impl's choice; None: the user's default


def conv_impl_from_env() -> str | None:
    """LKCNN_CONV_IMPL as lkcnn's import found it, lower-cased (None when unset or empty): the user's default,
    unchecked."""
    return _env_impl or None


def conv_impl() -> str:
    """The implementation in force: set_conv_impl's choice, else LKCNN_CONV_IMPL, else 'auto'."""
    if _chosen is not None:
        return _chosen
    impl = conv_impl_from_env() or "auto"
    if impl not in IMPLS:
        raise ValueError(f"{ENV_VAR}={impl!r} is not one of {', '.join(IMPLS)}")
    return impl


def set_conv_impl(impl: str | None) -> None:
    """Choose the implementation for the whole process ('auto', 'cuda' or 'torch'); None returns to the user's
    default (LKCNN_CONV_IMPL, else 'auto'). Every op call reads it when it runs; choose before torch.compile, whose
    trace fixes whether `dwconv2d` calls dwconv2d_fwd_keep_flat (which keeps an NCHW copy of x for the backward)."""
    global _chosen
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"conv_impl={impl!r} is not one of {', '.join(IMPLS)}")
    _chosen = impl


@contextlib.contextmanager
def use_conv_impl(impl: str | None) -> Iterator[None]:
    """`with use_conv_impl("torch"): ...`: set_conv_impl for the block, then the previous choice again."""
    previous = _chosen
    set_conv_impl(impl)
    try:
        yield
    finally:
        set_conv_impl(previous)


def cuda_unsupported_reason(x: Tensor, kernel_size: list[int], padding: list[int]) -> str | None:
    """Why lkcnn's CUDA kernels cannot run this call, or None when they can."""
    if not x.is_cuda:
        return f"the input is on {x.device.type}, not a CUDA device"
    # int(): under a dynamic-shape trace sizes are SymInts, which the cache cannot hash; the answer depends on the
    # kernel size and the map's width, so a trace specializes on those
    return _cuda_reason(x.device, x.dtype, *map(int, kernel_size), *map(int, padding), int(x.shape[-1]))


# Memoised: the answer depends only on these arguments, and every call of the op asks (a training step asks about
# 100 times; the uncached checks cost tens of microseconds of Python each).
@functools.lru_cache(maxsize=4096)
def _cuda_reason(device: torch.device, dtype: torch.dtype, kh: int, kw: int, ph: int, pw: int,
                 width: int) -> str | None:
    if dtype not in CUDA_DTYPES:
        return f"dtype {dtype} has no CUDA kernel (float32, float16 and bfloat16 do)"
    if dtype != torch.float32 and torch.cuda.get_device_capability(device) < (8, 0):
        return f"{dtype} runs on tensor cores, which need compute capability 8.0 or newer"
    if kh % 2 == 0 or kw % 2 == 0 or max(kh, kw) > MAX_KERNEL:
        return f"kernel {kh}x{kw}: the CUDA kernels take odd sizes up to {MAX_KERNEL}"
    if (ph, pw) != (kh // 2, kw // 2):
        return f"padding {(ph, pw)} is not the 'same' padding ({kh // 2}, {kw // 2})"
    try:
        module = build.load()
    except build.BuildError as err:
        return f"the CUDA extension is unavailable ({err})"
    if not module.supported(width, kh, kw):
        return f"maps {width} wide with a {kh}x{kw} kernel do not fit the weight-gradient tile"
    return None


def _policy_allows_kernels(kernel_size: list[int]) -> bool:
    """Whether the implementation in force sends this kernel size to lkcnn's kernels: the part of the choice that
    torch.compile can trace (the rest asks the built extension, which dynamo cannot trace without graph breaks)."""
    impl = conv_impl()
    return impl != "torch" and not (impl == "auto" and max(kernel_size) < AUTO_MIN_KERNEL)


def _choose(x: Tensor, kernel_size: list[int], padding: list[int]) -> tuple[str, str | None]:
    """(implementation, why lkcnn's kernels cannot run); the reason is None for a deliberate choice."""
    if not _policy_allows_kernels(kernel_size):
        return "torch", None
    reason = cuda_unsupported_reason(x, kernel_size, padding)
    return ("cuda", None) if reason is None else ("torch", reason)


def implementation(x: Tensor, kernel_size: list[int], padding: list[int]) -> str:
    """'cuda' or 'torch': which implementation a call with these arguments runs (no warning, no error)."""
    return _choose(x, kernel_size, padding)[0]


class ConvImplError(UserError, RuntimeError):
    """The `cuda` policy forced on a call lkcnn's kernels cannot run (no GPU, an unsupported shape or dtype)."""


def _use_cuda(x: Tensor, kernel_size: list[int], padding: list[int]) -> bool:
    """Whether to run lkcnn's kernels; a forced 'cuda' that cannot run raises, an 'auto' fallback warns once."""
    impl, reason = _choose(x, kernel_size, padding)
    if reason is not None:
        if conv_impl() == "cuda":
            raise ConvImplError(f"the conv implementation is forced to cuda (LKCNN_CONV_IMPL=cuda, conv_impl=cuda or "
                                f"lkcnn.ops.set_conv_impl), but lkcnn's CUDA kernel cannot run: {reason}. Choose "
                                "'auto' to fall back to PyTorch.")
        if x.is_cuda and reason not in _warned:
            _warned.add(reason)
            warnings.warn(f"lkcnn dwconv2d falls back to PyTorch's convolution: {reason}", stacklevel=3)
    return impl == "cuda"


def _memory_format(t: Tensor) -> torch.memory_format:
    """The layout outputs of t take: channels_last for channels_last t, contiguous otherwise (PyTorch's
    suggest_memory_format for 4-d tensors; the ops here return it, so fake and real agree)."""
    if not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


def _poisoned(out: Tensor) -> Tensor:
    """out, filled with NaN under LKCNN_DEBUG_POISON=1 (tests: every element a kernel fails to write stays NaN)."""
    if os.environ.get("LKCNN_DEBUG_POISON") == "1":
        out.fill_(float("nan"))
    return out


def _new_like(t: Tensor) -> Tensor:
    return _poisoned(torch.empty_like(t, memory_format=_memory_format(t)))


@torch.library.custom_op("lkcnn::dwconv2d_fwd", mutates_args=())
def dwconv2d_fwd(x: Tensor, weight: Tensor, bias: Tensor | None, padding: list[int]) -> Tensor:
    if _use_cuda(x, list(weight.shape[-2:]), padding):
        y = _new_like(x)
        build.load().fwd(x, weight, bias, y, padding[0], padding[1], False)
        return y
    return reference.forward(x, weight, bias, padding).contiguous(memory_format=_memory_format(x))


@dwconv2d_fwd.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None, padding: list[int]) -> Tensor:
    return torch.empty_like(x, memory_format=_memory_format(x))


# The name says the kept copy's shape: torch's compile caches find a compiled graph by the ops it calls, not by their
# fake implementations, so an op whose outputs change shape takes a new name, or a cached graph expecting the old
# shapes would be reused.
@torch.library.custom_op("lkcnn::dwconv2d_fwd_keep_flat", mutates_args=())
def dwconv2d_fwd_keep_flat(x: Tensor, weight: Tensor, bias: Tensor | None, padding: list[int]) -> tuple[Tensor, Tensor]:
    """(dwconv2d_fwd's y, x as NCHW flattened to (N, C, H*W)): the forward that also returns the NCHW copy of x
    lkcnn's kernels read, which autograd then saves for the weight gradient instead of x, so that pass does not make
    the copy again. The copy is 3-D because inductor's layout optimization gives every 4-D activation that a compiled
    forward saves downstream of a convolution channels_last strides: a 4-D copy was transposed to channels_last after
    the forward and back to NCHW before the backward, two copies of x per layer and step.

    `dwconv2d` calls it only where the implementation in force sends the kernel size to lkcnn's kernels, so a
    compiled graph holds that choice in its ops (a graph compiled under another implementation, e.g. from torch's
    compile caches, is never reused for this one). Where PyTorch's convolution runs after all (a shape the kernels do
    not take), the copy is made all the same: the outputs always have the fake's shapes."""
    if _use_cuda(x, list(weight.shape[-2:]), padding):
        ext = build.load()
        x_nchw = x.clone() if x.is_contiguous() else ext.to_nchw(x)  # an output must not alias an input
        y = _new_like(x)
        ext.fwd(x_nchw, weight, bias, y, padding[0], padding[1], False)
        return y, x_nchw.flatten(2)
    return dwconv2d_fwd(x, weight, bias, padding), x.clone(memory_format=torch.contiguous_format).flatten(2)


@dwconv2d_fwd_keep_flat.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None, padding: list[int]) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x, memory_format=_memory_format(x)), x.new_empty((*x.shape[:2], x.shape[2] * x.shape[3]))


@torch.library.custom_op("lkcnn::dwconv2d_bwd_input", mutates_args=())
def dwconv2d_bwd_input(grad_out: Tensor, weight: Tensor, padding: list[int]) -> Tensor:
    if _use_cuda(grad_out, list(weight.shape[-2:]), padding):
        dx = _new_like(grad_out)
        # For odd kernels with 'same' padding the input gradient is the same correlation with the flipped kernel.
        build.load().fwd(grad_out, weight, None, dx, padding[0], padding[1], True)
        return dx
    return reference.grad_input(grad_out, weight, padding).contiguous(memory_format=_memory_format(grad_out))


@dwconv2d_bwd_input.register_fake
def _(grad_out: Tensor, weight: Tensor, padding: list[int]) -> Tensor:
    return torch.empty_like(grad_out, memory_format=_memory_format(grad_out))


def _as_map(x: Tensor, grad_out: Tensor) -> Tensor:
    """A backward op's x as (N, C, H, W): x itself, or dwconv2d_fwd_keep_flat's (N, C, H*W) copy of it viewed with the
    output's shape (the same as x's). The view happens inside the ops, where the compiler cannot hoist it into the
    forward graph and save a 4-D tensor after all."""
    return x.view(grad_out.shape) if x.dim() == 3 else x


@torch.library.custom_op("lkcnn::dwconv2d_bwd_weight", mutates_args=())
def dwconv2d_bwd_weight(grad_out: Tensor, x: Tensor, kernel_size: list[int], padding: list[int]) -> Tensor:
    x = _as_map(x, grad_out)
    if _use_cuda(x, kernel_size, padding):
        return build.load().wgrad(grad_out, x, *kernel_size, *padding)
    return reference.grad_weight(grad_out, x, kernel_size, padding).contiguous()


@dwconv2d_bwd_weight.register_fake
def _(grad_out: Tensor, x: Tensor, kernel_size: list[int], padding: list[int]) -> Tensor:
    return x.new_empty((x.shape[1], 1, *kernel_size))


@torch.library.custom_op("lkcnn::dwconv2d_bwd", mutates_args=())
def dwconv2d_bwd(grad_out: Tensor, x: Tensor, weight: Tensor, padding: list[int]) -> tuple[Tensor, Tensor]:
    """(grad_input, grad_weight) in one call: what autograd runs when both are needed, so that lkcnn's kernels make
    one NCHW copy of a channels_last grad_out for both passes instead of one each."""
    x = _as_map(x, grad_out)
    if _use_cuda(x, list(weight.shape[-2:]), padding):
        dx = _new_like(grad_out)
        return dx, build.load().bwd(grad_out, x, weight, dx, padding[0], padding[1])
    return dwconv2d_bwd_input(grad_out, weight, padding), dwconv2d_bwd_weight(grad_out, x, list(weight.shape[-2:]),
                                                                               padding)


@dwconv2d_bwd.register_fake
def _(grad_out: Tensor, x: Tensor, weight: Tensor, padding: list[int]) -> tuple[Tensor, Tensor]:
    return (torch.empty_like(grad_out, memory_format=_memory_format(grad_out)),
            x.new_empty((x.shape[1], 1, *weight.shape[-2:])))


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, padding = inputs
    ctx.save_for_backward(x, weight)
    ctx.padding = padding
    ctx.has_bias = bias is not None


def _laid_out_as(grad_w: Tensor, weight: Tensor) -> Tensor:
    """grad_w with the weight's strides: the gradient layout contract that AccumulateGrad and DDP's gradient buckets
    expect (a channels_last weight, whose (C, 1, kh, kw) strides differ from a contiguous one's in the size-1 dim,
    otherwise makes DDP warn and copy at every step)."""
    if grad_w.stride() == weight.stride():
        return grad_w
    if all(n == 1 or a == b for n, a, b in zip(weight.shape, grad_w.stride(), weight.stride())):
        return grad_w.as_strided(weight.shape, weight.stride())  # the same elements: only size-1 dims differ
    return torch.empty_like(weight, dtype=grad_w.dtype).copy_(grad_w)


def _backward(ctx, grad: Tensor):
    x, weight = ctx.saved_tensors
    grad_x = grad_w = grad_b = None
    if ctx.needs_input_grad[0] and ctx.needs_input_grad[1]:
        grad_x, grad_w = dwconv2d_bwd(grad, x, weight, ctx.padding)
        grad_w = _laid_out_as(grad_w, weight)
    elif ctx.needs_input_grad[0]:
        grad_x = dwconv2d_bwd_input(grad, weight, ctx.padding)
    elif ctx.needs_input_grad[1]:
        grad_w = _laid_out_as(dwconv2d_bwd_weight(grad, x, list(weight.shape[-2:]), ctx.padding), weight)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        # fp16/bf16 sum in fp32, fp32/fp64 in their own precision
        grad_b = grad.sum((0, 2, 3), dtype=torch.promote_types(grad.dtype, torch.float32)).to(grad.dtype)
    return grad_x, grad_w, grad_b, None


dwconv2d_fwd.register_autograd(_backward, setup_context=_setup_context)


def _setup_context_keep(ctx, inputs, output) -> None:
    x, weight, bias, padding = inputs
    x_nchw = output[1]
    ctx.mark_non_differentiable(x_nchw)
    ctx.save_for_backward(x_nchw, weight)  # the NCHW copy rather than x: the weight gradient reads it as it is
    ctx.padding = padding
    ctx.has_bias = bias is not None


def _backward_keep(ctx, grad: Tensor, _grad_x_nchw: Tensor | None):
    return _backward(ctx, grad)  # x is the (N, C, H*W) copy, which the backward ops take as it is (_as_map)


dwconv2d_fwd_keep_flat.register_autograd(_backward_keep, setup_context=_setup_context_keep)


def _conv_flops(shape: torch.Size, kernel_size) -> int:
    n, c, h, w = shape
    return 2 * n * c * h * w * kernel_size[0] * kernel_size[1]


@register_flop_formula(torch.ops.lkcnn.dwconv2d_fwd)
def _fwd_flops(x_shape, w_shape, bias_shape, padding, *args, **kwargs) -> int:
    return _conv_flops(x_shape, w_shape[-2:])


@register_flop_formula(torch.ops.lkcnn.dwconv2d_fwd_keep_flat)
def _fwd_keep_flops(x_shape, w_shape, bias_shape, padding, *args, **kwargs) -> int:
    return _conv_flops(x_shape, w_shape[-2:])


@register_flop_formula(torch.ops.lkcnn.dwconv2d_bwd_input)
def _bwd_input_flops(grad_shape, w_shape, padding, *args, **kwargs) -> int:
    return _conv_flops(grad_shape, w_shape[-2:])


@register_flop_formula(torch.ops.lkcnn.dwconv2d_bwd)
def _bwd_flops(grad_shape, x_shape, w_shape, padding, *args, **kwargs) -> int:
    return 2 * _conv_flops(grad_shape, w_shape[-2:])  # grad_out has x's shape, which may come flattened


@register_flop_formula(torch.ops.lkcnn.dwconv2d_bwd_weight)
def _bwd_weight_flops(grad_shape, x_shape, kernel_size, padding, *args, **kwargs) -> int:
    return _conv_flops(grad_shape, kernel_size)


def _check_args(x: Tensor, weight: Tensor, bias: Tensor | None, padding) -> list[int]:
    """Validate a user call; returns the padding as a list. Errors say what was expected."""
    if not isinstance(x, Tensor) or x.dim() != 4:
        raise ValueError(f"dwconv2d expects x of shape (N, C, H, W), got {getattr(x, 'shape', type(x))}")
    c = x.shape[1]
    if weight.dim() != 4 or weight.shape[0] != c or weight.shape[1] != 1:
        raise ValueError(f"dwconv2d expects a depthwise weight of shape ({c}, 1, kh, kw) for {c} input channels, "
                         f"got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (c,):
        raise ValueError(f"dwconv2d expects bias of shape ({c},), got {tuple(bias.shape)}")
    kh, kw = weight.shape[-2:]
    if padding is None:
        padding = [kh // 2, kw // 2]
    elif isinstance(padding, int):
        padding = [padding, padding]
    padding = [int(p) for p in padding]
    if len(padding) != 2 or min(padding) < 0:
        raise ValueError(f"dwconv2d padding must be two non-negative ints, got {padding}")
    if x.device != weight.device or (bias is not None and bias.device != x.device):
        raise ValueError(f"dwconv2d: x is on {x.device} but weight/bias are on {weight.device}; move them together")
    return padding


def dwconv2d(x: Tensor, weight: Tensor, bias: Tensor | None = None, padding=None) -> Tensor:
    """Depthwise stride-1 convolution of x (N, C, H, W) with weight (C, 1, kh, kw) and optional bias (C,).

    padding defaults to 'same' (kh // 2, kw // 2). Under autocast the inputs are cast to the autocast dtype (custom
    ops are not cast by autocast itself); otherwise x, weight and bias must share a dtype.
    """
    padding = _check_args(x, weight, bias, padding)
    device_type = x.device.type
    # meta tensors have no autocast (is_autocast_enabled raises for them); torch.amp.is_autocast_available would say
    # so too, but torch.compile cannot trace it (torch 2.11: a graph break)
    if device_type != "meta" and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    elif weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"dwconv2d: x is {x.dtype} but weight/bias are {weight.dtype}"
                         f"{'' if bias is None else '/' + str(bias.dtype)}; cast them to one dtype or use autocast")
    if (x.dtype in (torch.float16, torch.bfloat16) and torch.is_grad_enabled() and x.is_cuda
            and (x.requires_grad or weight.requires_grad) and _memory_format(x) == torch.channels_last
            and _policy_allows_kernels(list(weight.shape[-2:]))):
        # lkcnn's 16-bit passes all read NCHW copies of channels_last tensors: the weight gradient reuses the
        # forward's
        return torch.ops.lkcnn.dwconv2d_fwd_keep_flat(x, weight, bias, padding)[0]
    return torch.ops.lkcnn.dwconv2d_fwd(x, weight, bias, padding)
