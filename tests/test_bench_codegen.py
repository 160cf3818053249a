"""lkcnn.bench codegen: inductor's CUDA output code for a fake H200 on a machine without a GPU, and its bytes."""
import importlib.util
import re

import pytest
import torch

from lkcnn.bench import codegen
from lkcnn.bench.__main__ import main as bench_main
from lkcnn.compile import compile_options
from lkcnn.layers.blocks import ConvFFN

SNIPPET = """
triton_poi_fused_add_0 = async_compile.triton('triton_poi_fused_add_0', '''
    triton_meta={'signature': {'in_ptr0': '*bf16', 'in_ptr1': '*fp32', 'out_ptr0': '*fp32', 'xnumel': 'i32'}},
''')
        buf0 = empty_strided_cuda((4, 8), (8, 1), torch.float32)
        buf1 = buf0; del buf0  # reuse
        triton_poi_fused_add_0.run(primals_1, buf1, buf1, 32, stream=stream0)
# lkcnn.bench.codegen input numels: {'primals_1': 32}
"""


def test_bytes_count_each_pointer_buffer_once():
    assert codegen.kernel_bytes(SNIPPET) == [("triton_poi_fused_add_0", 32 * 2 + 32 * 4 + 32 * 4)]
    assert codegen.family("triton_poi_fused_add_12") == "triton_poi_fused_add"


def _ffn_backward(settings: dict) -> str:
    import torch._inductor.config as inductor_config

    torch.manual_seed(0)
    graphs = codegen.trace_step(ConvFFN(16, 64), (4, 16, 8, 8))
    with codegen.fake_h200(), inductor_config.patch({**compile_options("default"), **settings}):
        return codegen.lower(*graphs["backward"], backward=True)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="inductor's CUDA code generation needs triton")
def test_recomputing_the_ffn_gelu_gradient_is_visible_without_a_gpu():
    """Under lkcnn's settings inductor stores the FFN's GELU gradient (one kernel computes it; the BatchNorm-gradient
    reduction and apply read it); with realize_opcount_threshold=40 and realize_reads_threshold=6 (RepLKNet's own)
    both of those recompute it, and the backward's Triton kernels move fewer bytes (docs/performance.md, Open 5)."""
    def gelu_gradient_kernels(code: str) -> int:
        return sum("gelu_backward" in k for k, _ in codegen.kernel_bytes(code))

    stored = _ffn_backward({})
    recomputed = _ffn_backward({"realize_reads_threshold": 6, "realize_opcount_threshold": 40})
    assert "empty_strided_cuda" in stored and not torch.cuda.is_initialized()
    assert gelu_gradient_kernels(stored) == 1 and gelu_gradient_kernels(recomputed) == 2
    total = lambda code: sum(b for _, b in codegen.kernel_bytes(code))  # noqa: E731
    assert total(recomputed) < total(stored)


def _pure_copies(code: str) -> list[str]:
    """Triton kernels of an output code that only load and store (layout copies)."""
    found = []
    for m in re.finditer(r"^def (triton_\w+)\(.*?(?=^''')", code, re.S | re.M):
        loads = set(re.findall(r"(tmp\d+) = tl\.load\(", m.group(0)))
        stores = re.findall(r"tl\.store\([^,]+, (tmp\d+)", m.group(0))
        if stores and set(stores) <= loads and not re.search(r"tmp\d+ = (?!tl\.load)", m.group(0)):
            found.append(m.group(1))
    return found


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="inductor's CUDA code generation needs triton")
def test_saved_activations_keep_their_layout():
    """The backward's inputs reach inductor channels_last, as on the GPU, and ATen's convolution backward takes them
    as they are: the GPU's output code copies none of them (before, inductor copied each to the traced layout)."""
    code = _ffn_backward({})
    assert "convolution_backward" in code
    assert _pure_copies(code) == []


@pytest.mark.parametrize("argv,message", [
    (["--models", "resnet_nope"], "Error: no model 'resnet_nope'"),
    (["--inductor", "realize_reads=6"], "Error: torch .* has no inductor setting 'realize_reads'"),
])
def test_mistakes_end_in_one_line(argv, message):
    with pytest.raises(SystemExit, match=message):
        bench_main(["codegen", *argv])
