"""8-bit GEMM execution (lkcnn.deploy.gemm8) against the fake-quant model it is converted from, on the CPU (where
torch._int_mm and torch._scaled_mm run too), and on a GPU when there is one."""
from __future__ import annotations

import pytest
import timm
import torch
from torch import nn

from conftest import randomize_bn, rel_err
from lkcnn.deploy.gemm8 import Gemm8, to_8bit_gemms
from lkcnn.deploy.quantize import QuantConv2d, QuantizeError, QuantLinear, quantize
from lkcnn.deploy.reparam import reparameterize_model
from lkcnn.ops.qdq import dequantize_linear, fake_quantize

U32, U16 = 2.0 ** -24, 2.0 ** -8  # unit roundoff of float32 and bfloat16


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def deployed() -> nn.Module:
    model = timm.create_model("replknet_tiny", num_classes=5, kernel_sizes=[7, 5, 3, 3], small_kernel=3)
    return reparameterize_model(randomize_bn(model).eval())


def gemm_shaped(model: nn.Module) -> list[str]:
    """The float model's 1x1 stride-1 ungrouped convs and its linear layers, by name."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear) or (
        type(m) is nn.Conv2d and m.kernel_size == (1, 1) and m.stride == (1, 1) and m.groups == 1)]


def layer_inputs(model: nn.Module, names: list[str], x: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(input, output) of each named layer in one forward pass of `model`."""
    seen = {}
    hooks = [model.get_submodule(n).register_forward_hook(
        lambda _, args, out, n=n: seen.__setitem__(n, (args[0], out))) for n in names]
    with torch.no_grad():
        model(x)
    for hook in hooks:
        hook.remove()
    return seen


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_every_gemm_layer_converts_and_computes_what_the_fake_quant_layer_does(deployed, precision):
    batches = [torch.randn(4, 3, 32, 32) for _ in range(2)]
    fake = quantize(deployed, batches, precision, "minmax")
    model = to_8bit_gemms(fake)
    expected = [n for n in gemm_shaped(deployed) if n in fake.lkcnn_quantization["layers"]]
    assert len(expected) == 23 and model.lkcnn_gemm8 == {"precision": precision, "layers": expected, "fallback": {}}
    for name, module in model.named_modules():
        if name in expected:
            assert isinstance(module, Gemm8) and module.weight.dtype == fake.get_submodule(name).weight.dtype
        else:
            assert not isinstance(module, Gemm8)
    assert isinstance(model.get_submodule("stages.0.blocks.0.large_kernel.lkb_reparam"), QuantConv2d)
    assert type(model.head) is nn.Linear and not hasattr(fake, "lkcnn_gemm8")  # the float classifier; fake unchanged
    # the layers left fake-quant run its QDQ in plain torch ops: the very same values as the registered ops
    rest = [n for n in fake.lkcnn_quantization["layers"] if n not in expected]
    assert rest and all(model.get_submodule(n).fusable and not fake.get_submodule(n).fusable for n in rest)
    for name, (inputs, reference) in layer_inputs(fake, rest, torch.randn(4, 3, 32, 32)).items():
        with torch.no_grad():
            assert torch.equal(model.get_submodule(name)(inputs), reference), name

    # Layer by layer, on the fake-quant model's own inputs. Both sides multiply the same 8-bit values. INT8: the
    # int32 sums are exact, the fake-quant float32 convolution's are not; a K-term float32 sum is within
    # (K + 2) * u32 * sum|x_k w_k| of the exact one (u32 = 2^-24), and the scaling adds 2 roundings more. FP8 adds
    # the bfloat16 output's rounding (u16 = 2^-8 of the value) and the bias's, which _scaled_mm takes in bfloat16.
    x = torch.randn(4, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    for name, (inputs, reference) in layer_inputs(fake, expected, x).items():
        layer = fake.get_submodule(name)
        with torch.no_grad():
            out = model.get_submodule(name)(inputs)
        assert out.shape == reference.shape and out.dtype == reference.dtype
        xq = fake_quantize(inputs, layer.input_scale, layer.qdtype).double()
        w = dequantize_linear(layer.weight, layer.weight_scale, 0).double().flatten(1)
        bound = (w.shape[1] + 4) * U32 * torch.einsum("bchw,oc->bohw", xq.abs(), w.abs())
        if precision == "fp8":
            bias = 0 if layer.bias is None else layer.bias.abs().view(-1, 1, 1)
            bound = 2 * bound + U16 * (reference.abs() + bias)
        assert ((out - reference).abs() <= bound).all(), name

    # The whole network: a difference within rounding can move a value across a rounding boundary of a later
    # layer's 8-bit input, one step of one value, which the network carries to the logits. On this model INT8 stays
    # at ~1e-7 for most batches and reaches 5e-3 where a value crossed; FP8's bfloat16 outputs (2^-8 relative) cross
    # e4m3's boundaries (2^-4 apart) for a few percent of the values: 0.7-2% of the logits, as far as the fake-quant
    # model itself is from float. The per-layer bounds above are the exact check; this one catches wiring errors.
    with torch.no_grad():
        error = rel_err(model(x), fake(x))
    assert error < (2e-2 if precision == "int8" else 5e-2)


def test_layers_the_gemm_kernels_cannot_take_stay_fake_quant_and_are_recorded(deployed):
    fake = quantize(deployed, [torch.randn(4, 3, 32, 32)], "int8", "minmax", keep_float=[])
    model = to_8bit_gemms(fake)
    assert "stem.2.conv" in model.lkcnn_gemm8["layers"]  # the stem's 1x1 conv, 8-bit with keep_float=[]
    assert model.lkcnn_gemm8["fallback"] == {"head": "256 -> 5 channels: int8 GEMMs take multiples of 8"}
    assert isinstance(model.head, QuantLinear)
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        assert rel_err(model(x), fake(x)) < 2e-2  # see the whole-network check above

    # 24 -> 48 channels: multiples of 8 (INT8) but not of 16 (FP8); 3 rows, fewer than cuBLASLt's INT8 GEMM takes
    linear = nn.Sequential(nn.Linear(24, 48), nn.ReLU(), nn.Linear(48, 32))
    calibration = [torch.randn(8, 24)]
    int8 = to_8bit_gemms(quantize(linear, calibration, "int8", "minmax"))
    fp8 = to_8bit_gemms(quantize(linear, calibration, "fp8", "minmax"))
    assert int8.lkcnn_gemm8["layers"] == ["0", "2"] and int8.lkcnn_gemm8["fallback"] == {}
    assert fp8.lkcnn_gemm8["layers"] == ["2"]
    assert fp8.lkcnn_gemm8["fallback"] == {"0": "24 -> 48 channels: fp8 GEMMs take multiples of 16"}
    assert isinstance(fp8[0], QuantLinear) and isinstance(fp8[2], Gemm8)
    x = torch.randn(3, 24)
    with torch.no_grad():
        assert rel_err(int8(x), quantize(linear, calibration, "int8", "minmax")(x)) < 2e-2


def test_bfloat16_casts_the_float_layers_and_keeps_the_8bit_state(deployed):
    fake = quantize(deployed, [torch.randn(4, 3, 32, 32)], "fp8", "minmax")
    model = to_8bit_gemms(fake, torch.bfloat16)
    assert model.stem[0].conv.weight.dtype == torch.bfloat16 and model.head.weight.dtype == torch.bfloat16
    assert model.stages[0].blocks[0].pw1.bn.running_var.dtype == torch.bfloat16
    gemm, large = model.stages[0].blocks[0].pw1.conv, model.stages[0].blocks[0].large_kernel.lkb_reparam
    assert gemm.weight.dtype == large.weight.dtype == torch.float8_e4m3fn
    assert gemm.input_scale.dtype == gemm.weight_scale.dtype == large.input_scale.dtype == torch.float32
    x = torch.randn(4, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        out = model(x.bfloat16())
        assert out.dtype == torch.bfloat16 and rel_err(out.float(), fake(x)) < 0.1


def test_what_cannot_be_converted_is_one_line(deployed):
    with pytest.raises(QuantizeError, match=r"^the model is not a fake-quant model; make one with ") as error:
        to_8bit_gemms(deployed)
    assert "\n" not in str(error.value)
    converted = to_8bit_gemms(quantize(deployed, [torch.randn(2, 3, 32, 32)], "int8", "minmax"))
    with pytest.raises(QuantizeError, match=r"^the model already runs its GEMMs in 8 bits"):
        to_8bit_gemms(converted)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_compiled_bfloat16_8bit_gemms_on_the_gpu(deployed, precision):
    """cuBLASLt's / CUTLASS's kernels under torch.compile, bf16 activations, channels_last, against the float32
    fake-quant model on the same GPU (bf16 activations round every layer: a tolerance, as for bf16 inference)."""
    if precision == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
    model = deployed.cuda()
    fake = quantize(model, [torch.randn(32, 3, 64, 64, device="cuda")], precision, "minmax")
    gemm = to_8bit_gemms(fake, torch.bfloat16).to(memory_format=torch.channels_last)
    x = torch.randn(32, 3, 64, 64, device="cuda")
    with torch.no_grad():
        reference = fake(x)
        eager = gemm(x.bfloat16().contiguous(memory_format=torch.channels_last)).float()
        compiled = torch.compile(gemm)(x.bfloat16().contiguous(memory_format=torch.channels_last)).float()
    assert rel_err(eager, reference) < 0.1 and rel_err(compiled, reference) < 0.1
    model.cpu()
