"""`torch.ops.lkcnn.dwconv8` (the 8-bit large depthwise convolution with a fused epilogue): the weight table's
layout, the torch arithmetic against float64, the argument checks, and on a GPU the CUDA kernel against float64 on
fresh random inputs for INT8 and FP8, every output kind and the stage shapes of RepLKNet, into outputs poisoned two
ways."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import grid_step
from lkcnn.ops.dwconv8 import (ACTS, CHUNK, MAX_KERNEL, chunks, chunks_left, dwconv8, launch, pack_weight,
                               reference, table_shape, unpack_weight)
from lkcnn.ops.gemm8 import activate
from lkcnn.ops.qdq import QRANGE

QDTYPES = (torch.int8, torch.float8_e4m3fn)
DTYPE_NAME = {torch.int8: "int8", torch.float8_e4m3fn: "float8_e4m3fn"}
# (N, C, H, W, k): RepLKNet-31B's four stages (fewer samples and channels), a map wider than one 64-column tile,
# a map narrower than the kernel, the largest kernel, odd sizes; for the whole-map kernel (maps up to 32 columns):
# several 32-sample groups, the last one partial, samples split over two blocks, 32 columns, one row
SHAPES = [(3, 4, 56, 56, 31), (4, 8, 28, 28, 29), (5, 16, 14, 14, 27), (3, 8, 7, 7, 13), (2, 3, 20, 70, 5),
          (3, 2, 9, 3, 3), (2, 2, 33, 40, MAX_KERNEL), (1, 5, 17, 19, 7), (37, 3, 14, 14, 27), (130, 2, 7, 7, 13),
          (2, 3, 12, 32, 9), (3, 2, 1, 17, 5)]


def operands(shape, qdtype, device="cpu", seed=0):
    n, c, h, w, k = shape
    g = torch.Generator(device).manual_seed(seed)
    if qdtype == torch.int8:
        x = torch.randint(-128, 128, (n, c, h, w), generator=g, device=device, dtype=torch.int8)
        weight = torch.randint(-127, 128, (c, 1, k, k), generator=g, device=device, dtype=torch.int8)
        alpha = torch.rand(c, generator=g, device=device) * 4 / (127 * 127 * k)
    else:
        x = (torch.randn(n, c, h, w, generator=g, device=device) * 64).clamp(-448, 448).to(qdtype)
        weight = (torch.randn(c, 1, k, k, generator=g, device=device) * 64).clamp(-448, 448).to(qdtype)
        alpha = torch.rand(c, generator=g, device=device) * 4 / (64 * 64 * k)
    beta = torch.randn(c, generator=g, device=device)
    return x, weight, alpha, beta


def test_the_table_holds_each_chunks_toeplitz_block():
    for k in range(3, MAX_KERNEL + 1, 2):
        for qdtype in QDTYPES:
            _, weight, _, _ = operands((1, 3, 4, 4, k), qdtype, seed=k)
            table = pack_weight(weight)
            shape, dtype, block = table_shape(3, k, qdtype)
            assert table.shape == shape and table.dtype == dtype
            table = table.view(3, k + k % 2, chunks(k), *block)
            unpacked = unpack_weight(table.reshape(shape), k, qdtype)
            assert torch.equal(unpacked.view(torch.uint8), weight.view(torch.uint8))
            assert not table[:, k:].any()  # the row completing the last pair is zero
            raw = weight.reshape(3, k, k).view(torch.uint8) if qdtype == torch.int8 else weight.reshape(3, k, k).half()
            for j in range(chunks(k)):  # [c, d, j, m, i] = w[c, d, 16 j + i - m + k // 2 - 16 chunks_left(k)]
                for m, i in ((0, 0), (15, 0), (0, 15), (7, 9), (15, 15)):
                    tap = CHUNK * j + i - m + k // 2 - CHUNK * chunks_left(k)
                    expected = raw[:, :, tap] if 0 <= tap < k else torch.zeros_like(raw[:, :, 0])
                    # FP8's f16 table keeps each block's two 8-column halves apart: [c, d, j, i // 8, m, i % 8]
                    got = table[:, :k, j, m, i] if qdtype == torch.int8 else table[:, :k, j, i // 8, m, i % 8]
                    assert torch.equal(got, expected), (k, j, m, i)
        # the chunks cover every tap of the 16 output columns' windows
        assert CHUNK * chunks(k) >= k + CHUNK - 1


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_reference_is_the_correlation_then_the_epilogue(qdtype):
    x, weight, alpha, beta = operands((2, 3, 9, 11, 7), qdtype)
    table = pack_weight(weight)
    sums = F.conv2d(x.double(), weight.double(), padding=3, groups=3)
    for act in ACTS:
        value = activate((sums * alpha.double().view(-1, 1, 1) + beta.double().view(-1, 1, 1)).float(), act)
        out = dwconv8(x, table, 7, alpha, beta, act, None, torch.float32)
        assert out.dtype == torch.float32 and torch.allclose(out, value, rtol=1e-6, atol=1e-6)
        scale = value.abs().max() / QRANGE[qdtype][1] * 0.7  # some values saturate
        q = dwconv8(x, table, 7, alpha, beta, act, scale, qdtype)
        assert q.dtype == qdtype
        low, high = QRANGE[qdtype]
        units = (value / scale).clamp(low, high)
        assert ((q.float() - units).abs() <= grid_step(units, DTYPE_NAME[qdtype]) / 2 + 1e-4).all()
        assert q.float().max() == high  # saturated, never NaN or wrapped
    # the fake (meta) implementation and the dispatch registrations agree with the op (the schema check would
    # compare float8 tensors, which the CPU cannot)
    torch.library.opcheck(dwconv8, (x, table, 7, alpha, beta, "relu", scale, qdtype),
                          test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))


def test_bad_arguments_are_one_line():
    x, weight, alpha, beta = operands((2, 4, 8, 8, 5), torch.int8)
    table = pack_weight(weight)
    scale = torch.tensor(0.1)
    cases = [
        ((x.float(), table, 5, alpha, beta, "relu", scale, torch.int8), "int8 or float8_e4m3fn x"),
        ((x, table, 6, alpha, beta, "relu", scale, torch.int8), "odd kernels of 3 to 33 taps"),
        ((x, table, 35, alpha, beta, "relu", scale, torch.int8), "odd kernels of 3 to 33 taps"),
        ((x, table[:3], 5, alpha, beta, "relu", scale, torch.int8), r"table must be pack_weight of a \(4, 1, 5, 5\)"),
        ((x, table.half(), 5, alpha, beta, "relu", scale, torch.int8), "table must be pack_weight"),
        ((x, table, 5, alpha.double(), beta, "relu", scale, torch.int8), "float32 vectors of 4 channels"),
        ((x, table, 5, alpha, beta, "silu", scale, torch.int8), "act must be one of"),
        ((x, table, 5, alpha, beta, "relu", scale, torch.float32), "a quantized output is one-element out_scale"),
        ((x, table, 5, alpha, beta, "relu", None, torch.int8), "without out_scale, out_dtype must be one of"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message) as error:
            dwconv8(*args)
        assert "\n" not in str(error.value)


def test_the_op_compiles_into_one_graph():
    x, weight, alpha, beta = operands((2, 4, 8, 8, 5), torch.int8)
    table = pack_weight(weight)
    compiled = torch.compile(lambda t: dwconv8(t, table, 5, alpha, beta, "relu", None, torch.float32) * 2,
                             fullgraph=True, backend="eager")
    assert torch.equal(compiled(x), dwconv8(x, table, 5, alpha, beta, "relu", None, torch.float32) * 2)


# ------------------------------------------------------------------------------------------------------------- GPU
def expected_bounds(x, weight, alpha, beta, act, out_scale, out_dtype):
    """[low, high] of each output the kernel may write: float64 sums (exact for 8-bit products) give the value;
    FP8's tensor-core accumulation may differ from the exact sum by 2^-10 of the sum of |products| (its fp32
    accumulators are not correctly rounded), the epilogue's float32 (a product and a sum, each rounded; GELU's erf)
    by 2^-21 of |alpha * sum| + |beta|; then the activation (Lipschitz 1.13 for GELU), the quantization or the
    rounding to out_dtype, both monotone."""
    k = weight.shape[-1]
    sums = F.conv2d(x.double(), weight.double(), padding=k // 2, groups=x.shape[1])
    magnitude = F.conv2d(x.double().abs(), weight.double().abs(), padding=k // 2, groups=x.shape[1])
    a, b = alpha.double().view(-1, 1, 1), beta.double().view(-1, 1, 1)
    value = sums * a + b
    accumulation = magnitude * 2.0 ** -10 if x.dtype == torch.float8_e4m3fn else 0
    slack = accumulation * a + ((sums * a).abs() + b.abs()) * 2.0 ** -21
    slack = slack * 1.13 + 1e-30
    centre = activate(value, act)
    ends = []
    for end in (centre - slack, centre + slack):
        if out_scale is None:
            ends.append(end.to(out_dtype).double())
        else:
            low, high = QRANGE[x.dtype]
            units = (end / out_scale.double()).clamp(low, high)
            ends.append((torch.round(units) if x.dtype == torch.int8 else units).to(x.dtype).double())
    return ends


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("qdtype", QDTYPES, ids=["int8", "fp8"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{c}x{h}x{w}k{k}" for n, c, h, w, k in SHAPES])
def test_kernel_against_float64(qdtype, shape):
    if qdtype == torch.float8_e4m3fn and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
    k = shape[-1]
    for seed, (act, out_dtype) in enumerate([("relu", qdtype), ("none", torch.bfloat16), ("gelu", torch.float32),
                                             ("none", qdtype), ("relu", torch.float16)]):
        x, weight, alpha, beta = operands(shape, qdtype, "cuda", seed)
        table = pack_weight(weight)
        out_scale = None
        if out_dtype == qdtype:
            out_scale = torch.tensor(float(beta.abs().max()) / QRANGE[qdtype][1] * 3, device="cuda")
        low, high = expected_bounds(x.cpu(), weight.cpu(), alpha.cpu(), beta.cpu(), act,
                                    None if out_scale is None else out_scale.cpu(), out_dtype)
        results = []
        for poison in (0x7F, 0x5A):  # NaN in e4m3 and every float dtype's top byte; a plain value
            out = torch.empty(x.shape, dtype=out_dtype, device="cuda")
            out.view(torch.uint8).fill_(poison)
            launch(x, table, k, alpha, beta, act, out_scale, out)
            results.append(out.cpu())
        assert torch.equal(results[0].view(torch.uint8), results[1].view(torch.uint8)), "unwritten outputs"
        got = results[0].double()
        assert torch.isfinite(got).all()
        assert ((got >= low) & (got <= high)).all(), (act, out_dtype, (got - low).min(), (high - got).min())
        # the registered op on the GPU is the kernel
        op = dwconv8(x, table, k, alpha, beta, act, out_scale, out_dtype)
        assert torch.equal(op.cpu().view(torch.uint8), results[0].view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_int8_kernel_equals_the_reference_exactly():
    """INT8 sums are exact and the epilogue is the reference's float32 arithmetic: the same bytes."""
    for seed, shape in enumerate(SHAPES[:4]):
        x, weight, alpha, beta = operands(shape, torch.int8, "cuda", seed)
        table, k = pack_weight(weight), shape[-1]
        out_scale = torch.tensor(float(beta.abs().max()) / 127 * 2, device="cuda")
        for act, scale, dtype in (("relu", out_scale, torch.int8), ("none", None, torch.float32)):
            got = dwconv8(x, table, k, alpha, beta, act, scale, dtype).cpu()
            expected = reference(x.cpu(), table.cpu(), k, alpha.cpu(), beta.cpu(), act,
                                 None if scale is None else scale.cpu(), dtype)
            assert torch.equal(got, expected), (shape, act)
