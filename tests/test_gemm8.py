"""8-bit GEMM execution with fused epilogues (lkcnn.deploy.gemm8) against the fake-quant model it is converted from,
on the CPU (the op's torch arithmetic), and on a GPU when there is one (its Triton kernel)."""
from __future__ import annotations

import pytest
import timm
import torch
from torch import nn

from conftest import randomize_bn, rel_err
from lkcnn.deploy.gemm8 import ConvFFN8, DWConv8, Gemm8, RepLKBlock8, to_8bit_gemms
from lkcnn.deploy.quantize import QuantConv2d, QuantizeError, QuantLinear, quantize
from lkcnn.deploy.reparam import reparameterize_model
from lkcnn.ops.qdq import quantize_values

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def deployed() -> nn.Module:
    torch.manual_seed(0)
    model = timm.create_model("replknet_tiny", num_classes=5, kernel_sizes=[7, 5, 3, 3], small_kernel=3)
    return reparameterize_model(randomize_bn(model).eval())


def gemm_shaped(model: nn.Module) -> list[str]:
    """The float model's 1x1 stride-1 ungrouped convs and its linear layers, by name."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear) or (
        type(m) is nn.Conv2d and m.kernel_size == (1, 1) and m.stride == (1, 1) and m.groups == 1)]


def layer_inputs(model: nn.Module, names: list[str], x: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(input, output) of each named module in one forward pass of `model`."""
    seen = {}
    hooks = [model.get_submodule(n).register_forward_hook(
        lambda _, args, out, n=n: seen.__setitem__(n, (args[0], out))) for n in names]
    with torch.no_grad():
        model(x)
    for hook in hooks:
        hook.remove()
    return seen


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_every_gemm_layer_converts_with_what_follows_it_in_its_epilogue(deployed, precision):
    torch.manual_seed(1)
    batches = [torch.randn(4, 3, 32, 32) for _ in range(2)]
    fake = quantize(deployed, batches, precision, "minmax")
    model = to_8bit_gemms(fake)
    expected = [n for n in gemm_shaped(deployed) if n in fake.lkcnn_quantization["layers"]]
    blocks = [f"stages.{s}.blocks.{b}" for s, stage in enumerate(deployed.stages) for b in range(len(stage.blocks))]
    large_kernels = [f"{name}.large_kernel" for name in blocks if name.endswith(("blocks.0", "blocks.2"))]
    # every block but a stage's last writes the next block's input, where its last GEMM runs on the Triton kernel
    next_inputs = [f"stages.{s}.blocks.{b}.pw2.conv" for s, stage in enumerate(deployed.stages)
                   for b in range(len(stage.blocks) - 1)] if precision == "int8" else []
    assert len(expected) == 23 and model.lkcnn_gemm8 == {"precision": precision, "layers": expected,
                                                         "fused_blocks": blocks, "large_kernels": large_kernels,
                                                         "next_inputs": next_inputs}
    for name, module in model.named_modules():
        assert isinstance(module, Gemm8) == (name in expected), name
        if name in expected:
            assert module.weight.dtype == fake.get_submodule(name).weight.dtype
    assert type(model.head) is nn.Linear and not hasattr(fake, "lkcnn_gemm8")  # the float classifier; fake unchanged

    # what each epilogue took in
    for stage in model.stages:
        lk, ffn = stage.blocks[-2:]
        assert isinstance(lk, RepLKBlock8) and isinstance(ffn, ConvFFN8)
        large = lk.large_kernel  # in 8 bits, the block's ReLU and pw2's quantization in its epilogue
        assert isinstance(large, DWConv8) and large.act == "relu" and type(lk.lk_nonlinear) is nn.Identity
        assert lk.pw1.conv.act == "relu" and lk.pw1.conv.out_8bit and large.input_8bit
        assert torch.equal(lk.pw1.conv.out_scale, large.input_scale)
        assert torch.equal(large.out_scale, lk.pw2.conv.input_scale) and lk.pw2.conv.input_8bit
        assert ffn.pw1.conv.act == "gelu" and ffn.pw1.conv.out_8bit and ffn.pw2.conv.input_8bit
        assert lk.pw2.conv.act == ffn.pw2.conv.act == "none"
        assert all(type(seq.bn) is nn.Identity for seq in (lk.pw1, lk.pw2, ffn.pw1, ffn.pw2))
    for transition in model.transitions:  # the 1x1 conv's output on the stride-2 depthwise conv's grid
        assert transition[0].conv.act == "relu" and transition[1].conv.input_on_grid
    assert model.stem[2].conv.__class__ is nn.Conv2d  # the float stem is left alone

    # the layers left fake-quant run its QDQ in plain torch ops: the very same values as the registered ops
    rest = [n for n in fake.lkcnn_quantization["layers"]
            if n not in expected and not n.startswith(tuple(large_kernels))]
    assert len(rest) == len(fake.lkcnn_quantization["layers"]) - len(expected) - len(large_kernels)
    assert rest and all(model.get_submodule(n).fusable and not fake.get_submodule(n).fusable for n in rest)
    x = torch.randn(4, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    for name, (inputs, reference) in layer_inputs(fake, rest, x).items():
        if not model.get_submodule(name).input_on_grid:
            with torch.no_grad():
                assert torch.equal(model.get_submodule(name)(inputs), reference), name

    # Block by block on the fake-quant model's own inputs, then the whole network. The fused epilogue computes in
    # float32 what the fake-quant model computes op by op (conv, then BatchNorm, activation, addition), so a value
    # at a rounding boundary of an 8-bit grid may land one step over. Measured on this model over 12 seeds: INT8
    # ~1e-7 relative per block and at the logits, up to 2e-4 and 1.5e-3 where a value crossed; FP8, whose GEMMs
    # apply GELU in cuBLASLt's tanh form and whose steps are 1/16-1/8 of a value, up to 1.1e-2 per block and 2.7e-2
    # at the logits.
    block_tol, logits_tol = (1e-2, 2e-2) if precision == "int8" else (2e-2, 5e-2)
    names = blocks + [f"transitions.{t}" for t in range(3)]
    for name, (inputs, reference) in layer_inputs(fake, names, x).items():
        with torch.no_grad():
            out = model.get_submodule(name)(inputs)
            if isinstance(out, tuple):  # (output, the next block's 8-bit input): its BatchNorm and quantization
                out, nxt = out
                stage, _, index = name.rpartition(".")
                after = f"{stage}.{int(index) + 1}"
                bn = model.get_submodule(after).pre_bn  # the fake-quant block's prelkb_bn / preffn_bn
                first = model.get_submodule(f"{after}.pw1.conv")
                assert f"{name}.pw2.conv" in next_inputs and nxt.dtype == first.qdtype
                expected_next = quantize_values(bn(reference), first.input_scale, first.qdtype)
                assert rel_err(nxt.float(), expected_next.float()) < block_tol, name
            assert rel_err(out, reference) < block_tol, name
    with torch.no_grad():
        assert rel_err(model(x), fake(x)) < logits_tol


def test_any_channel_count_converts(deployed):
    fake = quantize(deployed, [torch.randn(4, 3, 32, 32)], "int8", "minmax", keep_float=[])
    model = to_8bit_gemms(fake)
    assert {"stem.2.conv", "head"} <= set(model.lkcnn_gemm8["layers"])  # the stem's 1x1 conv; 256 -> 5 channels
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        assert rel_err(model(x), fake(x)) < 2e-2  # see the whole-network check above

    # 24 -> 48 -> 32 channels, 3 rows; an activation between two Linear layers stays a module of its own
    linear = nn.Sequential(nn.Linear(24, 48), nn.ReLU(), nn.Linear(48, 32))
    calibration = [torch.randn(8, 24)]
    x = torch.randn(3, 24)
    for precision in ("int8", "fp8"):
        fake = quantize(linear, calibration, precision, "minmax")
        model = to_8bit_gemms(fake)
        assert model.lkcnn_gemm8["layers"] == ["0", "2"] and isinstance(model[0], Gemm8) and model[0].act == "none"
        with torch.no_grad():
            assert rel_err(model(x), fake(x)) < 2e-2


def test_bfloat16_casts_the_float_layers_and_keeps_the_8bit_state(deployed):
    fake = quantize(deployed, [torch.randn(4, 3, 32, 32)], "fp8", "minmax")
    model = to_8bit_gemms(fake, torch.bfloat16)
    assert model.stem[0].conv.weight.dtype == torch.bfloat16 and model.head.weight.dtype == torch.bfloat16
    assert model.stages[0].blocks[0].prelkb_bn.running_var.dtype == torch.bfloat16
    gemm, large = model.stages[0].blocks[0].pw1.conv, model.stages[0].blocks[0].large_kernel
    assert gemm.weight.dtype == torch.float8_e4m3fn and large.table.dtype == torch.float16  # FP8 multiplies in f16
    assert gemm.input_scale.dtype == gemm.alpha.dtype == large.alpha.dtype == large.beta.dtype == torch.float32
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
@pytest.mark.parametrize("large_kernels", [False, True], ids=["lk16", "lk8"])
@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_compiled_bfloat16_8bit_gemms_on_the_gpu(deployed, precision, large_kernels):
    """The 8-bit GEMMs (and the large kernels in 8 bits or not) under torch.compile, bf16 activations, channels_last,
    against the float32 fake-quant model on the same GPU (bf16 activations round every layer: a tolerance, as for
    bf16 inference)."""
    if precision == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
    model = deployed.cuda()
    fake = quantize(model, [torch.randn(32, 3, 64, 64, device="cuda")], precision, "minmax")
    gemm = to_8bit_gemms(fake, torch.bfloat16, large_kernels).to(memory_format=torch.channels_last)
    x = torch.randn(32, 3, 64, 64, device="cuda")
    with torch.no_grad():
        reference = fake(x)
        eager = gemm(x.bfloat16().contiguous(memory_format=torch.channels_last)).float()
        compiled = torch.compile(gemm)(x.bfloat16().contiguous(memory_format=torch.channels_last)).float()
    assert rel_err(eager, reference) < 0.1 and rel_err(compiled, reference) < 0.1
    model.cpu()


def test_the_large_kernels_can_stay_on_the_float_kernels(deployed):
    fake = quantize(deployed, [torch.randn(4, 3, 32, 32)], "int8", "minmax")
    model = to_8bit_gemms(fake, large_kernels=False)
    assert model.lkcnn_gemm8["large_kernels"] == [] and not any(isinstance(m, DWConv8) for m in model.modules())
    lk = model.stages[0].blocks[0]
    large = lk.large_kernel.lkb_reparam  # fake-quant, its input written on its grid by pw1's epilogue
    assert isinstance(large, QuantConv2d) and large.input_on_grid and not lk.pw1.conv.out_8bit
    assert type(lk.lk_nonlinear) is nn.ReLU and not lk.pw2.conv.input_8bit
    x = torch.randn(4, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        assert rel_err(model(x), fake(x)) < 2e-2  # see the whole-network check above
