"""Kernel-size ablation: the experiment config sweeps the published sizes with timing and throughput on; a real
two-job multirun of it (tiny model, CPU) is collected by `python -m lkcnn.ablation` into one table and one plot
whose numbers match what each job wrote."""
from __future__ import annotations

import csv
import json
import os
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import timm
from hydra import compose, initialize_config_dir

import lkcnn.models  # noqa: F401  (registers lkcnn's models with timm)
from lkcnn.ablation import COLUMNS, collect, main

ROOT = Path(__file__).resolve().parents[1]
BATCH, STEPS, WARMUP = 4, 4, 1
SWEEP = ([3, 3, 3, 3], [5, 5, 3, 3])
TINY = ["data=synthetic", "data.img_size=16", "data.num_classes=4", f"data.num_train={STEPS * BATCH}",
        f"data.num_val={BATCH}", f"data.batch_size={BATCH}", "data.num_workers=0", "trainer.max_epochs=1",
        "trainer.accelerator=cpu", "trainer.num_sanity_val_steps=0", "callbacks.progress_bar.refresh_rate=0",
        "callbacks.kernel_timing.every_n_steps=2", "callbacks.kernel_timing.warmup_steps=1",
        f"callbacks.throughput.warmup_batches={WARMUP}"]


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_experiment_sweeps_the_kernel_sizes_with_timing_and_throughput_on():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=["experiment=kernel_ablation"], return_hydra_config=True)
        default = compose("train")
    assert cfg.hydra.mode.name == "MULTIRUN"
    assert cfg.hydra.sweeper.params["model.kernel_sizes"] == "[3,3,3,3],[7,7,7,7],[13,13,13,13],[31,29,27,13]"
    assert set(cfg.callbacks) == set(default.callbacks) | {"kernel_timing", "throughput"}
    assert cfg.model.small_kernel <= 3  # the small branch must fit inside the all-3 kernels


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ablation")
    sizes = ",".join("[" + ",".join(map(str, s)) + "]" for s in SWEEP)
    proc = subprocess.run([sys.executable, "train.py", "experiment=kernel_ablation", f"model.kernel_sizes={sizes}",
                           *TINY, f"hydra.sweep.dir={out}"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HYDRA_FULL_ERROR": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_each_job_measured_throughput_after_the_warm_up(sweep):
    for job in ("0", "1"):
        result = json.loads((sweep / job / "throughput.json").read_text())
        # the clock starts at the end of the last warm-up batch: the batches after it are counted
        assert result["images"] == (STEPS - WARMUP) * BATCH and result["world_size"] == 1
        assert result["images_per_s"] == pytest.approx(result["images"] / result["seconds"])


def test_collector_table_matches_what_each_job_wrote(sweep):
    rows = collect(sweep)
    assert [r["job"] for r in rows] == ["0", "1"]
    assert [r["kernel_sizes"] for r in rows] == ["-".join(map(str, s)) for s in SWEEP]
    assert [r["overrides"] for r in rows] == ["model.kernel_sizes=[" + ",".join(map(str, s)) + "]" for s in SWEEP]
    for row, sizes in zip(rows, SWEEP):
        job = sweep / row["job"]
        accs = [float(r["val/acc1"]) for r in read_csv(job / "csv" / "metrics.csv") if r.get("val/acc1")]
        assert row["val_acc1"] == max(accs) and row["val_ema_acc1"] is not None
        net = timm.create_model("replknet_tiny", num_classes=4, kernel_sizes=sizes, small_kernel=3)
        assert row["params_M"] == pytest.approx(sum(p.numel() for p in net.parameters()) / 1e6)
        assert row["images_per_s"] == json.loads((job / "throughput.json").read_text())["images_per_s"]
        per_step = defaultdict(lambda: [0.0, 0.0])
        for r in read_csv(job / "kernel_timing.csv"):
            per_step[r["step"]][0] += float(r["fwd_ms"])
            per_step[r["step"]][1] += float(r["bwd_ms"])
        assert set(per_step) == {"1", "3"}
        assert row["kernel_fwd_ms"] == pytest.approx(statistics.median(v[0] for v in per_step.values()))
        assert row["kernel_bwd_ms"] == pytest.approx(statistics.median(v[1] for v in per_step.values()))
    assert rows[1]["GMACs"] > rows[0]["GMACs"] > 0  # 5x5 kernels in two stages cost more than 3x3


def test_cli_writes_markdown_csv_and_plot(sweep, tmp_path, capsys):
    assert main([str(sweep), "--out", str(tmp_path)]) == 0
    table = (tmp_path / "ablation.md").read_text()
    assert capsys.readouterr().out.startswith(table)
    lines = table.splitlines()
    assert lines[0] == "| " + " | ".join(COLUMNS) + " |" and len(lines) == 2 + len(SWEEP)
    rows = read_csv(tmp_path / "ablation.csv")
    assert [r["kernel_sizes"] for r in rows] == ["3-3-3-3", "5-5-3-3"]
    assert all(float(r["images_per_s"]) > 0 and float(r["kernel_fwd_ms"]) > 0 for r in rows)
    assert (tmp_path / "ablation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_job_without_metrics_keeps_empty_cells(sweep, tmp_path):
    job = tmp_path / "7"
    (job / ".hydra").mkdir(parents=True)
    for name in ("config.yaml", "overrides.yaml"):
        (job / ".hydra" / name).write_text((sweep / "0" / ".hydra" / name).read_text())
    (row,) = collect(tmp_path)
    assert row["job"] == "7" and row["params_M"] > 0
    assert row["val_acc1"] is None and row["images_per_s"] is None and row["kernel_fwd_ms"] is None


def test_bad_run_dirs_end_in_one_message(tmp_path, capsys):
    for run_dir, message in ((tmp_path / "missing", "is not a folder"), (tmp_path, "no Hydra job folder")):
        with pytest.raises(SystemExit) as exit_info:
            main([str(run_dir)])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
