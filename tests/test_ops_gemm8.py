"""`torch.ops.lkcnn.gemm8` (8-bit GEMM with a fused epilogue) and `torch.ops.lkcnn.gemm8_lt` (cuBLASLt's FP8 GEMM
with its epilogue): their torch arithmetic against a float64 composition on the CPU, their argument checks and
registrations, and on a GPU the Triton kernel and the cuBLASLt call against float64 on fresh random inputs, into
outputs poisoned two ways."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import grid_step
from lkcnn.ops.gemm8 import (ACTS, LT_ACTS, LT_BIAS_DTYPES, LT_OUT_DTYPES, as_planes, gemm8, gemm8_lt, gemm8_next,
                             launch, reference)
from lkcnn.ops.qdq import QRANGE, quantize_values

QDTYPES = {"int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn}
SHAPES = [(1, 16, 16), (37, 24, 40), (300, 200, 136), (1031, 256, 512)]  # (M, N, K): ragged tiles, one row, deep K


def operands(m: int, n: int, k: int, quant: str, device: str = "cpu", seed: int = 0):
    g = torch.Generator(device).manual_seed(seed)
    if quant == "int8":
        a = torch.randint(-128, 128, (m, k), generator=g, device=device, dtype=torch.int8)
        w = torch.randint(-127, 128, (n, k), generator=g, device=device, dtype=torch.int8)
        alpha = torch.rand(n, generator=g, device=device) * 4 / (127 * 127 * k ** 0.5)
    else:
        a = (torch.randn(m, k, generator=g, device=device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        w = (torch.randn(n, k, generator=g, device=device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        alpha = torch.rand(n, generator=g, device=device) * 4 / (64 * 64 * k ** 0.5)
    beta = torch.randn(n, generator=g, device=device)
    residual = torch.randn(m, n, generator=g, device=device).bfloat16()
    return a, w, alpha, beta, residual


def fresh_cuda_operands(quant: str, shape: tuple[int, int, int]):
    """A fresh seed and its operands on the GPU (skips FP8 below compute capability 8.9); the magnitude
    sum |a w| * alpha of every output, which bounds the sums' rounding."""
    if quant == "float8_e4m3fn" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
    seed = torch.seed() % 2 ** 31
    a, w, alpha, beta, residual = operands(*shape, quant, "cuda", seed)
    return seed, (a, w, alpha, beta, residual), (a.double().abs() @ w.double().abs().t()) * alpha.double()


def float_bound(expected: torch.Tensor, magnitude: torch.Tensor, quant: str, out_dtype: torch.dtype) -> torch.Tensor:
    """How far a float output may be from the float64 sums: the output dtype's rounding; FP8 tensor cores add
    products at reduced precision inside each 32-deep step (about 2^-13 of the largest partial sum), INT8 sums are
    exact."""
    return (2 ** -7 if out_dtype == torch.bfloat16 else 2e-6) * expected.abs() + 1e-6 + magnitude * (
        2 ** -11 if quant == "float8_e4m3fn" else 2 ** -22)


def composition(a, w, alpha, beta, residual, act, quant, out_scale, out_dtype):
    """The epilogue written out in float64, then quantized as ONNX's QuantizeLinear does (in float32: bfloat16
    residuals over a scale such as 0.02 land on ties of the int8 grid, which float64 would round otherwise)."""
    y = (a.double() @ w.double().t()) * alpha.double() + beta.double()
    y = {"none": y, "relu": F.relu(y), "gelu": F.gelu(y)}[act]
    if residual is not None:
        y = y + residual.double()
    if not quant:
        return y
    low, high = QRANGE[QDTYPES[quant]]
    q = y.float() / out_scale
    q = (q.round() if quant == "int8" else q).clamp(low, high).float().to(QDTYPES[quant])
    return q if out_dtype == q.dtype else q.double() * out_scale.double()


@pytest.mark.parametrize("quant", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("act", ACTS)
def test_reference_is_the_float64_epilogue(quant, act):
    a, w, alpha, beta, residual = operands(57, 48, 96, quant)
    scale = torch.tensor(0.02)
    for res in (None, residual):
        out = gemm8(a, w, alpha, beta, res, act, "", None, torch.float32)
        expected = composition(a, w, alpha, beta, res, act, "", None, torch.float64)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), expected, rtol=2e-6, atol=2e-6)
        for out_dtype in (QDTYPES[quant], torch.float32):
            out = gemm8(a, w, alpha, beta, res, act, quant, scale, out_dtype)
            expected = composition(a, w, alpha, beta, res, act, quant, scale, out_dtype)
            assert out.dtype == out_dtype
            assert_on_grid(out, expected, quant, scale, 1e-3, str(out_dtype))
    # the fake (meta) implementation and the dispatch registrations agree with the op (the schema check would
    # compare float8 tensors, which the CPU cannot)
    torch.library.opcheck(gemm8, (a, w, alpha, beta, residual, act, quant, scale, torch.bfloat16),
                          test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))


def assert_on_grid(out: torch.Tensor, expected: torch.Tensor, quant: str, scale: torch.Tensor, rate: float,
                   where: str, slack: torch.Tensor | float = 0.0) -> None:
    """Both on `quant`'s grid (8-bit values, or dequantized ones in units of `scale`), equal but for at most `rate`
    of the values, which may lie one step apart: sums in another order or precision can put a value that sits on a
    rounding boundary on its other side. `slack` (in the output's units) is what the sums' own error may add: FP8
    tensor cores add products at reduced precision, which near zero, where the grid is finest, spans several steps."""
    unit = 1.0 if out.dtype == QDTYPES[quant] else scale.item()
    got, exp = out.double() / unit, expected.double() / unit
    diff, step = (got - exp).abs(), grid_step(exp, quant)
    # a dequantized output's own rounding: bfloat16's (of both values), else 1e-3 of a step
    rounding = 2 ** -7 * exp.abs() if out.dtype == torch.bfloat16 else 1e-3 * step
    over = (diff > rounding + slack).double().sum()
    assert over <= max(rate * diff.numel(), 1), where  # one value may cross in an output of a few values
    worst = (diff - step - rounding - slack).argmax()
    assert (diff <= step + rounding + slack).all(), (
        f"{where}: {got.flatten()[worst].item()} vs {exp.flatten()[worst].item()} at {worst.item()}")


def assert_one_line_errors(op, cases) -> None:
    """Each (args, message) case raises a one-line ValueError that matches message."""
    for args, message in cases:
        with pytest.raises(ValueError, match=message) as error:
            op(*args)
        assert "\n" not in str(error.value)


def test_bad_arguments_are_one_line():
    a, w, alpha, beta, residual = operands(8, 16, 32, "int8")
    cases = [
        ((a.float(), w, alpha, beta, None, "none", "", None, torch.float32), "int8 or float8_e4m3fn operands"),
        ((a, w[:, :16], alpha, beta, None, "none", "", None, torch.float32), r"multiplies \(M, K\)"),
        ((a, w, alpha.double(), beta, None, "none", "", None, torch.float32), "float32 vectors of 16"),
        ((a, w, alpha, beta, residual[:4], "none", "", None, torch.float32), "is not the output's"),
        ((a, w, alpha, beta, None, "silu", "", None, torch.float32), "act must be one of"),
        ((a, w, alpha, beta, None, "none", "int8", None, torch.float32), "one-element out_scale"),
        ((a, w, alpha, beta, None, "none", "", None, torch.int8), "needs quant='int8'"),
    ]
    assert_one_line_errors(gemm8, cases)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("quant", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_triton_kernel_against_the_reference(quant, shape):
    seed, (a, w, alpha, beta, residual), magnitude = fresh_cuda_operands(quant, shape)
    scale = torch.tensor([0.03], device="cuda")
    rate = 2e-2 if quant == "float8_e4m3fn" else 1e-3  # of values one grid step over (FP8 sums above)
    for act in ACTS:
        for res in (None, residual):
            for q, out_dtype in (("", torch.bfloat16), ("", torch.float32), (quant, QDTYPES[quant]),
                                 (quant, torch.bfloat16)):
                expected = reference(a, w, alpha, beta, res, act, q, scale if q else None, out_dtype)
                outs = []
                for poison in (-1, 1):  # an 8-bit output has no NaN: two poisons, and both runs must agree
                    out = torch.full_like(expected.float(), poison * 77.0).to(out_dtype)
                    # one tile configuration (the smallest: ragged edges on every shape), one compile per epilogue
                    launch(a, w, alpha, beta, res, act, q, scale if q else None, out, one_config=True)
                    outs.append(out)
                where = f"seed {seed}, act {act}, residual {res is not None}, quant {q!r}, {out_dtype}"
                assert torch.equal(outs[0].float(), outs[1].float()), where
                got, exp = outs[0].double(), expected.double()
                if not q:
                    err, bound = (got - exp).abs(), float_bound(exp, magnitude, quant, out_dtype)
                    worst = (err - bound).argmax()
                    assert (err <= bound).all(), (f"{where}: {got.flatten()[worst].item()} vs "
                                                  f"{exp.flatten()[worst].item()}")
                else:
                    # in units of the scale, as the grid's steps (the sums' error bound of the float outputs above)
                    slack = magnitude * 2 ** -11 / scale.item() if quant == "float8_e4m3fn" else 0.0
                    assert_on_grid(outs[0], expected, quant, scale, rate, where, slack)
    # the autotuned kernel through the registered op (what the 8-bit model calls), every config in the race
    for q, out_dtype in (("", torch.bfloat16), (quant, QDTYPES[quant])):
        out = gemm8(a, w, alpha, beta, residual, "gelu", q, scale if q else None, out_dtype)
        expected = reference(a, w, alpha, beta, residual, "gelu", q, scale if q else None, out_dtype)
        if q:
            slack = magnitude * 2 ** -11 / scale.item() if quant == "float8_e4m3fn" else 0.0
            assert_on_grid(out, expected, quant, scale, rate, f"seed {seed}, autotuned", slack)
        else:
            err, exp = (out.double() - expected.double()).abs(), expected.double()
            assert (err <= 2 ** -7 * exp.abs() + 1e-6 + magnitude * 2 ** -11).all(), f"seed {seed}, autotuned"


@pytest.mark.parametrize("quant", ["int8", "float8_e4m3fn"])
def test_planes_are_the_rows_of_each_image_transposed(quant):
    a, w, alpha, beta, _ = operands(2 * 49, 24, 40, quant)
    scale = torch.tensor(0.02)
    for out_dtype in (QDTYPES[quant], torch.bfloat16):
        rows = gemm8(a, w, alpha, beta, None, "relu", quant, scale, out_dtype)
        planes = gemm8(a, w, alpha, beta, None, "relu", quant, scale, out_dtype, 49)
        assert planes.shape == (2, 24, 49) and planes.is_contiguous()
        assert torch.equal(planes.float(), rows.view(2, 49, 24).transpose(1, 2).float())
    torch.library.opcheck(gemm8, (a, w, alpha, beta, None, "relu", quant, scale, torch.bfloat16, 49),
                          test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))
    assert_one_line_errors(gemm8, [((a, w, alpha, beta, None, "none", "", None, torch.float32, 45),
                                    "divide the 98 rows")])


# (M, N, K, planes): 7x7, 14x14 and 28x28 maps (stores of 1, 4 and 16 bytes); TMA and pointer operands (N = 200)
PLANE_SHAPES = [(98, 64, 64, 49), (392, 256, 128, 196), (1568, 200, 136, 784)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("quant", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("shape", PLANE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_triton_kernel_writes_planes(quant, shape):
    """The kernel's channel planes hold exactly its rows' values, each image transposed, and match the reference;
    into outputs poisoned two ways."""
    *mnk, planes = shape
    seed, (a, w, alpha, beta, _), magnitude = fresh_cuda_operands(quant, tuple(mnk))
    scale = torch.tensor([0.03], device="cuda")
    for q, out_dtype in ((quant, QDTYPES[quant]), ("", torch.bfloat16)):
        rows = torch.zeros(mnk[:2], device="cuda").to(out_dtype)
        launch(a, w, alpha, beta, None, "relu", q, scale if q else None, rows, one_config=True)
        outs = []
        for poison in (-1, 1):
            out = torch.full((mnk[0] // planes, mnk[1], planes), poison * 77.0, device="cuda").to(out_dtype)
            launch(a, w, alpha, beta, None, "relu", q, scale if q else None, out, one_config=True, planes=planes)
            outs.append(out)
        where = f"seed {seed}, {out_dtype}"
        assert torch.equal(outs[0].float(), outs[1].float()), where
        assert torch.equal(outs[0].float(), as_planes(rows, planes).float()), where
        expected = as_planes(reference(a, w, alpha, beta, None, "relu", q, scale if q else None, out_dtype), planes)
        if q:
            fp8 = quant == "float8_e4m3fn"
            slack = as_planes(magnitude, planes) * 2 ** -11 / scale.item() if fp8 else 0.0
            assert_on_grid(outs[0], expected, quant, scale, 2e-2 if fp8 else 1e-3, where, slack)
        else:
            err = (outs[0].double() - expected.double()).abs()
            bound = float_bound(expected.double(), as_planes(magnitude, planes), quant, out_dtype)
            assert (err <= bound).all(), where
    out = gemm8(a, w, alpha, beta, None, "relu", quant, scale, QDTYPES[quant], planes)  # autotuned, the op
    assert torch.equal(out.float(), as_planes(gemm8(a, w, alpha, beta, None, "relu", quant, scale, QDTYPES[quant]),
                                              planes).float())


def next_operands(n: int, device: str = "cpu", seed: int = 0):
    """A BatchNorm's folded scale and shift and the next layer's input scale."""
    g = torch.Generator(device).manual_seed(seed + 1)
    return (torch.rand(n, generator=g, device=device) + 0.5, torch.randn(n, generator=g, device=device) * 0.1,
            torch.tensor([0.02], device=device))


@pytest.mark.parametrize("quant", ["int8", "float8_e4m3fn"])
def test_next_input_is_the_output_through_the_affine_and_quantization(quant):
    a, w, alpha, beta, residual = operands(37, 24, 40, quant)
    next_alpha, next_beta, next_scale = next_operands(24)
    for res in (None, residual):
        out, nxt = gemm8_next(a, w, alpha, beta, res, "none", torch.bfloat16, next_alpha, next_beta, quant, next_scale)
        assert torch.equal(out, gemm8(a, w, alpha, beta, res, "none", "", None, torch.bfloat16))
        # the stored output through the folded BatchNorm in float64, then QuantizeLinear in float32
        y = (out.double() * next_alpha.double() + next_beta.double()).float() / next_scale
        low, high = QRANGE[QDTYPES[quant]]
        expected = (y.round() if quant == "int8" else y).clamp(low, high).to(QDTYPES[quant])
        assert nxt.dtype == QDTYPES[quant]
        assert_on_grid(nxt, expected, quant, next_scale, 1e-3, f"residual {res is not None}")
    torch.library.opcheck(gemm8_next, (a, w, alpha, beta, residual, "none", torch.bfloat16, next_alpha, next_beta,
                                       quant, next_scale),
                          test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))
    bad = [((a, w, alpha, beta, None, "none", torch.int8, next_alpha, next_beta, quant, next_scale),
            "writes a float output"),
           ((a, w, alpha, beta, None, "none", torch.bfloat16, next_alpha[:3], next_beta, quant, next_scale),
            "float32 vectors of 24 channels"),
           ((a, w, alpha, beta, None, "none", torch.bfloat16, next_alpha, next_beta, "int4", next_scale),
            "next_quant must be one of")]
    assert_one_line_errors(gemm8_next, bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("quant", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_triton_kernel_writes_the_next_input(quant, shape):
    """Both outputs of the Triton kernel (TMA where the channels allow, else pointers) against the op's torch
    arithmetic on the same inputs, each into outputs poisoned two ways."""
    seed, (a, w, alpha, beta, residual), magnitude = fresh_cuda_operands(quant, shape)
    next_alpha, next_beta, next_scale = next_operands(shape[1], "cuda", seed)
    for act in ACTS:
        for res in (None, residual):
            out_ref, next_ref = gemm8_next(a.cpu(), w.cpu(), alpha.cpu(), beta.cpu(),
                                           None if res is None else res.cpu(), act, torch.bfloat16, next_alpha.cpu(),
                                           next_beta.cpu(), quant, next_scale.cpu())
            outs = []
            for poison in (-1, 1):
                out = torch.full(out_ref.shape, poison * 77.0, device="cuda").bfloat16()
                nxt = torch.full(out_ref.shape, poison * 77.0, device="cuda").to(QDTYPES[quant])
                launch(a, w, alpha, beta, res, act, "", None, out, one_config=True,
                       next_input=(next_alpha, next_beta, quant, next_scale, nxt))
                outs.append((out, nxt))
            where = f"seed {seed}, act {act}, residual {res is not None}"
            assert all(torch.equal(x.float(), y.float()) for x, y in zip(*outs)), where
            out, nxt = outs[0]
            err = (out.double().cpu() - out_ref.double()).abs()
            assert (err <= float_bound(out_ref.double(), magnitude.cpu(), quant, torch.bfloat16)).all(), where
            # the next input from the kernel's own stored output: the same grid values but where the affine's
            # float32 rounding (a fused multiply-add here) puts one on the other side of a boundary
            y = out.float().cpu() * next_alpha.cpu() + next_beta.cpu()
            assert_on_grid(nxt.cpu(), quantize_values(y, next_scale.cpu().reshape(()), QDTYPES[quant]), quant,
                           next_scale.cpu(), 1e-3, where)
    out, nxt = gemm8_next(a, w, alpha, beta, residual, "none", torch.bfloat16, next_alpha, next_beta, quant,
                          next_scale)  # autotuned, through the registered op
    assert out.is_cuda and nxt.dtype == QDTYPES[quant]


LT_SHAPES = [(1, 16, 16), (37, 48, 32), (1031, 256, 512), (3136, 2048, 128)]  # (M, N, K): one row, ragged M, FFN


def lt_composition(a, w, alpha, bias, residual, act):
    y = (a.double() @ w.double().t()) * alpha.double()
    if bias is not None:
        y = y + bias.double()
    if residual is not None:
        y = y + residual.double()
    return {"none": y, "relu": F.relu(y), "gelu_tanh": F.gelu(y, approximate="tanh")}[act]


def lt_cases(m, n, k, out_dtype, device="cpu", seed=0):
    """(bias, residual, act) in every combination the op takes, on operands scaled like a BatchNorm-folded layer."""
    a, w, alpha, beta, residual = operands(m, n, k, "float8_e4m3fn", device, seed)
    bias, residual = beta.to(LT_BIAS_DTYPES[out_dtype]), residual.to(out_dtype)
    for act in LT_ACTS:
        for b in (None, bias):
            for res in (None, residual) if act == "none" else (None,):
                yield a, w, alpha, b, res, act


@pytest.mark.parametrize("out_dtype", LT_OUT_DTYPES)
def test_lt_reference_is_the_float64_epilogue(out_dtype):
    tolerance = 2e-6 if out_dtype == torch.float32 else 2 ** -8
    for a, w, alpha, bias, res, act in lt_cases(57, 48, 96, out_dtype):
        out = gemm8_lt(a, w, alpha, bias, res, act, out_dtype)
        assert out.dtype == out_dtype
        torch.testing.assert_close(out.double(), lt_composition(a, w, alpha, bias, res, act), rtol=tolerance,
                                   atol=1e-5)
    torch.library.opcheck(gemm8_lt, (a, w, alpha, bias, res, act, out_dtype),
                          test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))


def test_lt_bad_arguments_are_one_line():
    a, w, alpha, beta, residual = operands(8, 16, 32, "float8_e4m3fn")
    bias, residual = beta.bfloat16(), residual.bfloat16()
    bf16 = torch.bfloat16
    cases = [
        ((a.float(), w, alpha, None, None, "none", bf16), "takes float8_e4m3fn operands"),
        ((a[:, :24], w[:, :24], alpha, None, None, "none", bf16), "multiples of 16"),
        ((a, w, alpha.double(), None, None, "none", bf16), "float32 vector of 16"),
        ((a, w, alpha, None, None, "gelu", bf16), "act one of"),
        ((a, w, alpha, None, None, "none", torch.float8_e4m3fn), "out_dtype must be one of"),
        ((a, w, alpha, beta, None, "none", bf16), r"bias must be 16 values of torch.bfloat16 \(with torch.bfloat16"),
        ((a, w, alpha, bias, residual, "relu", bf16), "cuBLASLt adds it before the activation"),
    ]
    assert_one_line_errors(gemm8_lt, cases)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("out_dtype", LT_OUT_DTYPES)
@pytest.mark.parametrize("shape", LT_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_lt_kernel_against_float64(out_dtype, shape):
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("cuBLASLt's per-channel FP8 scaling needs Hopper")
    from lkcnn.ops import build

    seed = torch.seed() % 2 ** 31
    ext = build.load()
    for a, w, alpha, bias, res, act in lt_cases(*shape, out_dtype, "cuda", seed):
        where = f"seed {seed}, act {act}, bias {bias is not None}, residual {res is not None}"
        assert ext.gemm_fp8_lt_supported(*shape, LT_ACTS.index(act), None if bias is None else bias.dtype,
                                         res is not None, out_dtype), where
        expected = lt_composition(a, w, alpha, bias, res, act)
        outs = []
        for poison in (float("nan"), 77.0):
            out = torch.full(expected.shape, poison, device="cuda", dtype=out_dtype)
            ext.gemm_fp8_lt(a, w, alpha, torch.ones(len(a), device="cuda"), bias, res, LT_ACTS.index(act), out)
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), where
        # the output dtype's rounding; FP8 tensor cores add products at reduced precision between cuBLASLt's
        # promotions to float32 (measured ~2^-13 of the sum of magnitudes: the bound is the Triton kernel's above);
        # for the GELU, a hardware tanh (about 2^-11 relative)
        magnitude = (a.double().abs() @ w.double().abs().t()) * alpha.double()
        err = (outs[0].double() - expected).abs()
        rounding = 2 ** -8 if out_dtype == torch.bfloat16 else 2 ** -11 if out_dtype == torch.float16 else 2e-6
        bound = rounding * expected.abs() + magnitude * 2 ** -11 + 1e-5
        if act == "gelu_tanh":  # x (1 + tanh(.)) / 2 with tanh off by ~2^-11 of 1
            bound = bound + 2 ** -10 * lt_composition(a, w, alpha, bias, res, "none").abs()
        worst = (err - bound).argmax()
        assert (err <= bound).all(), f"{where}: {outs[0].flatten()[worst].item()} vs {expected.flatten()[worst]}"
    # through the registered op, as the 8-bit model calls it
    out = gemm8_lt(a, w, alpha, bias, res, act, out_dtype)
    assert torch.equal(out, outs[0])
