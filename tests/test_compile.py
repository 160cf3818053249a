"""lkcnn.compile: the options torch.compile gets, and what lkcnn's inductor settings change in a compiled backward
(inductor on the CPU; the measured speed-up is a GPU benchmark, docs/performance.md)."""
from __future__ import annotations

import re

import pytest
import timm
import torch
from torch._inductor.utils import run_and_get_code

from lkcnn.compile import (INDUCTOR_SETTINGS, compile_model, compile_options, network_settings, parse_settings,
                           regions, stage_blocks)
from lkcnn.layers.blocks import ConvFFN
from lkcnn.models.replknet import RepLKNet
from lkcnn.ops import use_conv_impl


def test_options_are_the_mode_and_lkcnn_settings():
    assert compile_options("reduce-overhead") == {"triton.cudagraphs": True, **INDUCTOR_SETTINGS}
    assert compile_options("default") == INDUCTOR_SETTINGS
    with pytest.raises(RuntimeError, match="reduce-overhead"):
        compile_options("fast")


def test_settings_this_torch_lacks_are_left_out(monkeypatch):
    """An older torch's inductor may not know a setting; torch.compile would reject the whole options dict."""
    monkeypatch.setattr("lkcnn.compile.INDUCTOR_SETTINGS", {**INDUCTOR_SETTINGS, "a_setting_from_the_future": 1})
    assert compile_options("default") == INDUCTOR_SETTINGS


def _on_meta(name: str) -> torch.nn.Module:
    with torch.device("meta"):
        return timm.create_model(name)


def test_a_network_compiles_with_its_own_settings_over_lkcnns(monkeypatch):
    """A network's own settings (RepLKNet's FFN's GELU gradient recomputed; docs/performance.md) go over lkcnn's for
    that network alone; UniRepLKNet's and timm's networks compile with lkcnn's."""
    replknet, unireplknet, convnext = _on_meta("replknet31b"), _on_meta("unireplknet_b"), _on_meta("convnext_base")
    assert network_settings(replknet) == {"realize_reads_threshold": 6, "realize_opcount_threshold": 40}
    assert compile_options("default", replknet) == {**INDUCTOR_SETTINGS, **network_settings(replknet)}
    assert network_settings(unireplknet) == {} and compile_options("default", unireplknet) == INDUCTOR_SETTINGS
    assert network_settings(convnext) == {} and compile_options("default", convnext) == INDUCTOR_SETTINGS
    seen = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kwargs: seen.append(kwargs["options"]))
    compile_model(replknet, "default", {"realize_reads_threshold": 8})
    assert seen == [{**compile_options("default", replknet), "realize_reads_threshold": 8}]  # the caller's last
    monkeypatch.setattr(RepLKNet, "inductor_settings", {"a_setting_from_the_future": 1})
    assert compile_options("default", replknet) == INDUCTOR_SETTINGS  # one this torch lacks is left out


def _hidden_buffers_in_backward(settings: dict) -> int:
    """Buffers of the FFN's hidden size that the compiled backward of a RepLKNet ConvFFN allocates."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    ffn = ConvFFN(8, 32).to(memory_format=torch.channels_last)
    compile_model(ffn, "default", settings)
    x = torch.randn(2, 8, 6, 6).contiguous(memory_format=torch.channels_last).requires_grad_()
    _, codes = run_and_get_code(lambda: ffn(x).square().mean().backward())
    torch._dynamo.reset()
    return len(re.findall(r"empty_strided_\w+\(\(2, 32, 6, 6\)", codes[-1]))


def test_backward_recomputes_the_batchnorm_output_instead_of_storing_it():
    """Inductor's default (realize_reads_threshold=4) writes the pw1 BatchNorm's output, read again by the GELU's
    and the BatchNorm's gradients; lkcnn's settings let those kernels recompute it from the convolution's output."""
    stored = _hidden_buffers_in_backward({"realize_reads_threshold": 4})
    assert stored >= 1
    assert _hidden_buffers_in_backward({}) < stored


def test_settings_are_inductors():
    assert parse_settings("combo_kernels=True, split_reductions=False") == {
        "combo_kernels": True, "split_reductions": False}
    with pytest.raises(ValueError, match="no inductor setting 'combo_kernel'"):
        parse_settings("combo_kernel=True")
    with pytest.raises(ValueError, match="not key=value"):
        parse_settings("combo_kernels")


@pytest.mark.parametrize("name, blocks", [("replknet31b", 48), ("unireplknet_b", 36), ("convnext_base", 36)])
def test_regions_hold_every_block_alone_and_every_parameter_once(name, blocks):
    """A regional compile covers the whole network: each stage's blocks one by one, every other part with state."""
    model = _on_meta(name)
    parts = regions(model)
    every_block = [b for stage in model.stages for b in stage_blocks(stage)]
    assert len(every_block) == blocks and all(any(b is p for p in parts) for b in every_block)
    ids = [id(p) for part in parts for p in part.parameters()]
    assert len(ids) == len(set(ids)) and set(ids) == {id(p) for p in model.parameters()}
    assert not any(part is model or part is model.stages for part in parts)


def test_regional_compile_compiles_each_region_for_fixed_shapes(monkeypatch):
    model = _on_meta("replknet31b")
    seen = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kwargs: seen.append((self, kwargs)))
    with torch._dynamo.config.patch(recompile_limit=2):
        compile_model(model, "reduce-overhead", {"combo_kernels": False}, regional=True)
        # RepLKNet-31B's RepLK blocks: 4 stages, trained and evaluated: 8 compiled versions of one class at the least
        assert torch._dynamo.config.recompile_limit >= 8
    assert [m for m, _ in seen] == regions(model)
    options = {**compile_options("reduce-overhead", model), "combo_kernels": False}
    assert all(kwargs == {"options": options, "dynamic": False} for _, kwargs in seen)


def test_blocks_of_one_structure_share_one_compiled_graph():
    """The point of a regional compile: three identical blocks compile once, and train as the eager network does."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stages = torch.nn.ModuleList([torch.nn.Sequential(*(ConvFFN(8, 16) for _ in range(3)))])

        def forward(self, x):
            return self.stages[0](x)
    net, eager = Net(), Net()
    eager.load_state_dict(net.state_dict())
    compile_model(net, "default", regional=True)
    x = torch.randn(2, 8, 5, 5, requires_grad=True)  # as behind a stem: every block's input needs a gradient
    net(x).square().mean().backward()
    eager(x).square().mean().backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()
    for p, q in zip(net.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)


def test_a_compiled_network_compiles_once():
    """Compiled as a timm user compiles it (no conv implementation chosen): the trace changes no lkcnn state, so the
    second and third steps reuse the first step's graph instead of compiling the network again."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with use_conv_impl(None):
        model = torch.compile(timm.create_model("replknet_tiny"), backend="eager")
        x = torch.randn(2, 3, 64, 64)
        for _ in range(3):
            model(x).sum().backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()
