"""lkcnn.bench rates: each Triton kernel's bytes in the step's output code over its profiled time in the step."""
import math
from types import SimpleNamespace

import pytest
import torch

from lkcnn.bench import rates
from lkcnn.bench.__main__ import main as bench_main
from test_bench_codegen import SNIPPET

COPY_GBPS = 4000.0  # GB/s


def _event(name: str, us_total: float, count: int) -> SimpleNamespace:
    return SimpleNamespace(key=name, self_device_time_total=us_total, count=count)


def test_a_kernel_in_two_graphs_counts_in_both():
    one = sum(b for _, b in rates.kernel_bytes(SNIPPET))
    assert rates.step_bytes([SNIPPET]) == {"triton_poi_fused_add_0": one}
    assert rates.step_bytes([SNIPPET, SNIPPET]) == {"triton_poi_fused_add_0": 2 * one}


def test_rows_join_the_code_and_the_profile_most_time_lost_first():
    nbytes = {"triton_red_fused_bn_3": 8_000_000_000, "triton_poi_fused_relu_1": 4_000_000_000,
              "triton_poi_fused_relu_7": 2_000_000_000}
    steps = 2
    kernels = [_event("triton_red_fused_bn_3", 2 * 4000.0, 4),  # 4 ms a step for 8 GB: 2 TB/s, 2 ms lost
               _event("triton_poi_fused_relu_1", 2 * 1100.0, 2),  # 1.1 ms for 4 GB: 0.1 ms lost
               _event("triton_poi_fused_relu_7", 2 * 1000.0, 2),  # 1.0 ms for 2 GB: 0.5 ms lost
               _event("nvjet_sm90_tst_128x128", 2 * 9000.0, 6)]  # not inductor's: left out
    rows = rates.rate_rows(nbytes, kernels, steps, COPY_GBPS)
    assert [r["kernel"] for r in rows] == ["triton_red_fused_bn_3", "triton_poi_fused_relu_7",
                                          "triton_poi_fused_relu_1"]
    bn = rows[0]
    assert bn["ms"] == pytest.approx(4.0) and bn["gb"] == pytest.approx(8.0) and bn["launches"] == 2
    assert bn["tb_per_s"] == pytest.approx(2.0) and bn["lost_ms"] == pytest.approx(2.0)
    families = rates.by_family(rows, COPY_GBPS)
    assert [f["family"] for f in families] == ["triton_red_fused_bn", "triton_poi_fused_relu"]
    relu = families[1]
    assert relu["kernels"] == 2 and relu["ms"] == pytest.approx(2.1) and relu["gb"] == pytest.approx(6.0)
    assert relu["lost_ms"] == pytest.approx(0.6) and relu["tb_per_s"] == pytest.approx(6.0 / 2.1)
    table = rates.table(families, 1, "family")
    assert len(table) == 2 and table[1].split()[-1] == "triton_red_fused_bn"


def test_each_kernel_names_the_launch_configuration_it_ran():
    def kernel(**kwargs):  # a compiled kernel after its first run: one launcher
        return SimpleNamespace(launchers=[SimpleNamespace(config=SimpleNamespace(kwargs=kwargs, num_warps=4))])
    module = SimpleNamespace(triton_red_fused_bn_3=kernel(XBLOCK=64, R0_BLOCK=8), buf0=None,
                             triton_poi_fused_relu_1=SimpleNamespace(launchers=[]))  # not run yet: no pick
    configs = rates.launch_configs([module])
    assert configs == {"triton_red_fused_bn_3": "XBLOCK=64 R0_BLOCK=8 warps=4"}
    rows = rates.rate_rows({"triton_red_fused_bn_3": 10**9, "triton_poi_fused_relu_1": 10**9},
                           [_event("triton_red_fused_bn_3", 500.0, 1), _event("triton_poi_fused_relu_1", 400.0, 1)],
                           1, COPY_GBPS, configs)
    assert [r["config"] for r in rows] == ["XBLOCK=64 R0_BLOCK=8 warps=4", ""]
    assert rates.table(rows, 2, "kernel")[1].endswith("triton_red_fused_bn_3  [XBLOCK=64 R0_BLOCK=8 warps=4]")


@pytest.mark.parametrize("argv, message", [
    (["--models", "no_such_net"], "not timm model names"),
    (["--models", "unireplknet_a", "--runs", "cuda3"], "no such variant"),
    (["--inductor", "combo_kernel=True"], "no inductor setting 'combo_kernel'"),
])
def test_mistakes_end_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_main(["rates", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU message")
def test_without_a_gpu_it_says_so():
    with pytest.raises(SystemExit, match="no CUDA device is visible"):
        bench_main(["rates", "--models", "replknet_tiny"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_every_profiled_triton_kernel_has_its_bytes_on_the_gpu():
    """The step's own output code names every Triton kernel the profile sees, and each moves bytes in a finite time."""
    nbytes, kernels, configs = rates.measure("replknet_tiny", "auto", batch=8, steps=2, warmup=2)
    triton = [e for e in kernels if e.key.startswith("triton_")]
    assert triton and all(e.key in nbytes for e in triton)
    rows = rates.rate_rows(nbytes, kernels, 2, rates.copy_bandwidth_gbps(), configs)
    assert len(rows) == len(triton) and all(r["gb"] > 0 and 0 < r["tb_per_s"] < math.inf for r in rows)
    assert all("warps=" in r["config"] for r in rows)  # each ran with one launch configuration
