"""lkcnn.bench.blocks on the CPU: each stage's unit and count cover the stage's blocks, the step's block time sums
the units' reports times their counts, and the command's mistakes end in one line. The timings need a GPU."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import timm
import torch

from lkcnn.bench import blocks
from lkcnn.compile import stage_blocks
from lkcnn.errors import UserError
from lkcnn.models.replknet import RepLKNet


def test_period_is_the_shortest_repeating_run():
    assert blocks.period(["RepLKBlock", "ConvFFN"] * 3) == 2
    assert blocks.period(["Block"] * 5) == 1
    assert blocks.period(["A", "B", "A"]) == 2
    assert blocks.period(["A", "B", "C"]) == 3


@pytest.mark.parametrize("name,kinds", [
    ("replknet31b", [["RepLKBlock", "ConvFFN"]] * 4),
    # its third stage repeats a 13x13 block and two 3x3 ones: one block of it is not the stage's unit
    ("unireplknet_b", [["UniRepLKNetBlock"], ["UniRepLKNetBlock"], ["UniRepLKNetBlock"] * 3, ["UniRepLKNetBlock"]]),
    ("convnext_atto", [["ConvNeXtBlock"]] * 4)])
def test_units_cover_every_stage(name, kinds):
    model = timm.create_model(name)
    units = blocks.stage_units(model)
    assert [unit["kinds"] for unit in units] == kinds
    for unit, stage in zip(units, model.stages):
        own = stage_blocks(stage)
        assert unit["count"] * len(unit["kinds"]) == len(own)
        assert all(a is b for a, b in zip(unit["unit"], own))  # the model's own modules
        x = torch.zeros(2, *unit["shape"])
        assert unit["unit"].eval()(x).shape == x.shape  # the shape its first block is handed


def test_a_network_without_stages_is_named():
    with pytest.raises(UserError, match="ResNet keeps no blocks in timm's `stages`"):
        blocks.stage_units(timm.create_model("resnet18"))


def test_step_time_is_the_units_times_their_counts(monkeypatch):
    busy = {128: 1.0, 256: 2.0, 512: 0.5, 1024: 4.0}  # per unit, by the stage's channels
    seen = []

    def fake_report(unit, shape, dtype, batch, steps, settings, top):
        seen.append(settings)
        ms = busy[shape[0]] * (2 if "combo_kernels" in settings else 1)
        categories = {blocks.INDUCTOR: ms / 2, "GEMM (1x1 convs, head)": ms / 2, "optimizer": 0.25, blocks.OTHER: 0.5}
        return {"gpu_ms_by_category": categories, "gpu_busy_ms": ms + 0.75, "kernels": []}
    monkeypatch.setattr(blocks, "unit_report", fake_report)
    monkeypatch.setattr(torch.nn.Module, "cuda", lambda self, *a, **k: self)
    variants = {blocks.DEFAULT: {}, "combo_kernels=True": {"combo_kernels": True}}
    rows = blocks.network_rows("replknet31b", 64, 3, variants)
    want = 1.0 * 2 + 2.0 * 2 + 0.5 * 18 + 4.0 * 2  # RepLKNet-31B's depths 2, 2, 18, 2
    assert blocks.blocks_ms(rows[0]["gpu_ms_by_category"]) == pytest.approx(want)
    assert rows[0]["gpu_busy_ms"] == pytest.approx(want + 0.75 * 24)  # the harness's kernels too
    assert rows[0]["gpu_ms_by_category"][blocks.INDUCTOR] == pytest.approx(want / 2)
    assert blocks.blocks_ms(rows[1]["gpu_ms_by_category"]) == pytest.approx(2 * want)
    assert [s["units"] for s in rows[0]["stages"]] == [2, 2, 18, 2]
    # each unit compiles with the network's own settings (lkcnn.compile.network_settings), the variant's over them
    assert seen[0] == RepLKNet.inductor_settings and seen[-1] == {**RepLKNet.inductor_settings, "combo_kernels": True}
    lines = blocks.table(rows, 64, "H200").splitlines()
    assert "H200" in lines[0]
    assert lines[2].split()[1:8] == ["lkcnn's", "compile", "settings", f"{want:.2f}", f"{want / 2:.2f}", "1.000",
                                     f"{want + 18:.2f}"]
    assert lines[3].split()[1:5] == ["combo_kernels=True", f"{2 * want:.2f}", f"{want:.2f}", "2.000"]


def test_longest_kernels_are_listed_per_unit_step():
    events = [SimpleNamespace(key=name, self_device_time_total=us, count=n) for name, us, n in [
        ("triton_red_fused__native_batch_norm_legit_functional_0", 651.0, 70),
        ("nvjet_sm90_tst_128x192_64x5_2x1_v_bz_coopB_NNN", 619.0, 30),
        ("void lkcnn::(anonymous namespace)::transpose_kernel<c10::BFloat16, 2>", 444.0, 40)]]
    top = blocks.top_kernels(events, steps=10, n=2)
    assert [(k["us"], k["launches"], k["category"]) for k in top] == [
        (65.1, 7, blocks.INDUCTOR), (61.9, 3, "GEMM (1x1 convs, head)")]
    rows = [{"network": "replknet31b", "variant": blocks.DEFAULT, "stages": [
        {"stage": 2, "kinds": ["RepLKBlock", "ConvFFN"], "shape": [512, 14, 14], "kernels": top},
        {"stage": 3, "kinds": ["RepLKBlock", "ConvFFN"], "shape": [1024, 7, 7], "kernels": []}]}]
    lines = blocks.kernel_lines(rows).splitlines()
    assert len(lines) == 3 and "stage 2 (RepLKBlock+ConvFFN, [512, 14, 14])" in lines[0]
    assert lines[1].split()[:2] == ["65.1", "7x"] and lines[1].endswith("_native_batch_norm_legit_functional_0")


@pytest.mark.parametrize("argv,message", [(["--inductor", "nonsense=1"], "no inductor setting 'nonsense'"),
                                          (["--models", "replknet99"], "not timm model names"),
                                          ([], "no CUDA device is visible")])
def test_mistakes_end_in_one_line(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        blocks.main(argv)
    said = str(exit_info.value.code) if isinstance(exit_info.value.code, str) else capsys.readouterr().err
    assert message in said and "Traceback" not in said
