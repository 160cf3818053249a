"""`python -m lkcnn.bench deploy8` on the CPU: the dry run times the bf16, INT8 and FP8 models, prints the table and
writes the record; bad arguments end in one line."""
from __future__ import annotations

import pytest
import torch

from lkcnn.bench import deploy8
from lkcnn.bench.record import SCHEMA, load_record


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU dry run; on a GPU the command compiles RepLKNet")
def test_cpu_dry_run_prints_the_table_and_writes_the_record(tmp_path, capsys):
    path = tmp_path / "deploy8.json"
    deploy8.main(["--model", "replknet_tiny", "--size", "32", "--batch", "4", "2", "--steps", "2", "--warmup", "1",
                  "--calib-batches", "1", "--json", str(path)])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("replknet_tiny deploy form, 32 px, bf16 activations, channels_last, eager on the CPU")
    assert [line.split()[:2] for line in out[2:8]] == [[v, b] for b in ("4", "2") for v in ("bf16", "int8", "fp8")]
    record = load_record(path)
    assert record["schema"] == SCHEMA and record["kind"] == "deploy8"
    assert record["command"].startswith("python -m lkcnn.bench deploy8 --model replknet_tiny")
    rows = {(r["variant"], r["batch"]): r for r in record["rows"]}
    assert len(rows) == 6 and all(rows[("bf16", b)]["ratio_to_bf16"] == 1.0 for b in (4, 2))
    for precision in ("int8", "fp8"):
        row = rows[(precision, 4)]
        assert row["gemm8_layers"] == 23 and row["fused_blocks"] == 10
        assert row["ratio_to_bf16"] == pytest.approx(row["images_per_s"] / rows[("bf16", 4)]["images_per_s"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU dry run; on a GPU the command compiles RepLKNet")
def test_variants_select_the_rows_and_bf16_stays(capsys):
    deploy8.main(["--model", "replknet_tiny", "--size", "32", "--batch", "2", "--steps", "1", "--warmup", "1",
                  "--calib-batches", "1", "--variants", "fp8"])
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in out[2:]] == [["bf16", "2"], ["fp8", "2"]]


@pytest.mark.parametrize("argv,message", [
    (["--model", "nosuchnet"], "--model: 'nosuchnet' is not a timm model name"),
    (["--batch", "0"], "--batch, --steps, --calib-batches and --calib-batch must be positive"),
    (["--variants", "bf16,int4"], "--variants: int4 not among bf16,int8,fp8,int8-lk16,fp8-lk16"),
])
def test_bad_arguments_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        deploy8.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err == f"lkcnn-bench deploy8: error: {message}\n"
