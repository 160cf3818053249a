"""Kernel-size ablation: the experiment config sweeps the published sizes with timing and throughput on, timing
enough steps of a short digits job for a mean; a real two-job multirun of it (tiny model, CPU) is collected by
`python -m lkcnn.ablation` into one table (sample count and spread beside each mean, notes on the EMA columns) and
one plot (accuracy and step time against kernel size) whose numbers match what each job wrote."""
from __future__ import annotations

import csv
import json
import os
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import timm
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

import lkcnn.models  # noqa: F401  (registers lkcnn's models with timm)
from lkcnn.ablation import COLUMNS, MIN_TIMED_STEPS, collect, ema_warmth, kernel_order, main, notes, plot

ROOT = Path(__file__).resolve().parents[1]
BATCH, STEPS, WARMUP = 4, 8, 1
TIMING_EVERY, TIMING_WARMUP = 2, 1
TIMED_STEPS = list(range(TIMING_WARMUP, STEPS, TIMING_EVERY))  # the steps the callback's settings select
SWEEP = ([3, 3, 3, 3], [5, 5, 3, 3])
TINY = ["data=synthetic", "data.img_size=16", "data.num_classes=4", f"data.num_train={STEPS * BATCH}",
        f"data.num_val={BATCH}", f"data.batch_size={BATCH}", "data.num_workers=0", "trainer.max_epochs=1",
        "trainer.accelerator=cpu", "trainer.num_sanity_val_steps=0", "callbacks.progress_bar.refresh_rate=0",
        f"callbacks.kernel_timing.every_n_steps={TIMING_EVERY}",
        f"callbacks.kernel_timing.warmup_steps={TIMING_WARMUP}",
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


def test_experiment_times_a_short_digits_job_often_enough_for_a_mean():
    """Two epochs of the digits (the short sweep) must give every job several timed steps per layer."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=["experiment=kernel_ablation", "trainer.max_epochs=2"])
    data = instantiate(cfg.data)
    data.setup("fit")
    steps = len(data.train_dataloader()) * cfg.trainer.max_epochs
    timing = cfg.callbacks.kernel_timing
    timed = len(range(timing.warmup_steps, steps, timing.every_n_steps))
    assert timed >= 2 * MIN_TIMED_STEPS, f"{steps} steps give only {timed} timed steps"
    assert timing.warmup_steps >= 1  # the first step pays for one-off work (extension build, autotuning)


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


def per_step_ms(job: Path) -> dict[int, tuple[float, float]]:
    """(forward, backward) ms per timed step, summed over layers, from the job's kernel_timing.csv."""
    per_step: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for r in read_csv(job / "kernel_timing.csv"):
        per_step[int(r["step"])][0] += float(r["fwd_ms"])
        per_step[int(r["step"])][1] += float(r["bwd_ms"])
    return {step: tuple(v) for step, v in per_step.items()}


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
        throughput = json.loads((job / "throughput.json").read_text())
        assert row["images_per_s"] == throughput["images_per_s"]
        assert row["step_ms"] == pytest.approx(1e3 * BATCH / throughput["images_per_s_per_device"])
        per_step = per_step_ms(job)
        assert sorted(per_step) == TIMED_STEPS and row["kernel_ms_n"] == len(TIMED_STEPS)  # what the config implies
        totals = np.array([fwd + bwd for fwd, bwd in per_step.values()])
        assert row["kernel_ms"] == pytest.approx(totals.mean())
        assert row["kernel_ms_median"] == pytest.approx(np.median(totals))
        q1, q3 = np.percentile(totals, [25, 75])
        assert row["kernel_ms_iqr"] == pytest.approx(q3 - q1)
        assert 0 <= row["kernel_ms_iqr"] <= totals.max() - totals.min()
        assert row["kernel_fwd_ms"] == pytest.approx(statistics.fmean(v[0] for v in per_step.values()))
        assert row["kernel_bwd_ms"] == pytest.approx(statistics.fmean(v[1] for v in per_step.values()))
        assert row["kernel_fwd_ms"] + row["kernel_bwd_ms"] == pytest.approx(row["kernel_ms"])
        # EMA decay 0.999 over a few steps: its warm-up has barely begun
        assert row["ema"]["steps"] == STEPS and row["ema"]["reached"] < row["ema"]["decay"] == 0.999
        assert not row["ema"]["warm"]
    assert rows[1]["GMACs"] > rows[0]["GMACs"] > 0  # 5x5 kernels in two stages cost more than 3x3


def test_cli_writes_markdown_csv_and_plot(sweep, tmp_path, capsys):
    assert main([str(sweep), "--out", str(tmp_path)]) == 0
    table = (tmp_path / "ablation.md").read_text()
    assert capsys.readouterr().out.startswith(table)
    lines = table.splitlines()
    assert lines[0] == "| " + " | ".join(COLUMNS) + " |"
    assert all(line.startswith("|") for line in lines[:2 + len(SWEEP)]) and lines[2 + len(SWEEP)] == ""
    footnotes = lines[3 + len(SWEEP):]
    assert footnotes and all(line.startswith("- ") for line in footnotes)
    assert any(line.startswith("- kernel_ms:") for line in footnotes)
    (ema,) = [line for line in footnotes if line.startswith("- val_ema_acc1:")]
    assert "EMA not warmed up in jobs 0, 1" in ema and f"after {STEPS} steps" in ema
    assert not any("fewer than" in line for line in footnotes)  # every job timed enough steps
    rows = read_csv(tmp_path / "ablation.csv")
    assert [r["kernel_sizes"] for r in rows] == ["3-3-3-3", "5-5-3-3"]
    assert all(float(r["images_per_s"]) > 0 and float(r["kernel_fwd_ms"]) > 0 for r in rows)
    assert all(int(r["kernel_ms_n"]) == len(TIMED_STEPS) and float(r["kernel_ms_iqr"]) >= 0 for r in rows)
    assert (tmp_path / "ablation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_shows_accuracy_and_step_time_against_kernel_size(sweep, tmp_path):
    rows = collect(sweep)
    fig = plot(list(reversed(rows)), tmp_path / "ablation.png")  # the plot orders jobs by kernel size itself
    by_title = {ax.get_title(): ax for ax in fig.axes}
    acc, step = by_title["accuracy vs kernel size"], by_title["step time vs kernel size"]
    for ax in (acc, step):
        assert ax.get_xlabel().startswith("large kernels per stage")
        assert [t.get_text().split("\n")[0] for t in ax.get_xticklabels()] == ["3-3-3-3", "5-5-3-3"]
    assert "top-1" in acc.get_ylabel()
    val, ema = acc.get_lines()
    assert list(val.get_ydata()) == pytest.approx([100 * r["val_acc1"] for r in rows])
    assert list(ema.get_ydata()) == pytest.approx([100 * r["val_ema_acc1"] for r in rows])
    assert "not warmed up" in ema.get_label()
    assert [t.get_text().split("\n")[1] for t in step.get_xticklabels()] == [f"n={len(TIMED_STEPS)}"] * 2
    heights = [patch.get_height() for patch in step.patches]  # forward bars, then backward bars on top
    assert heights == pytest.approx([r["kernel_fwd_ms"] for r in rows] + [r["kernel_bwd_ms"] for r in rows])
    whole = next(ax for ax in fig.axes if ax.get_ylabel().startswith("whole training step"))
    assert list(whole.get_lines()[0].get_ydata()) == pytest.approx([r["step_ms"] for r in rows])
    assert "not warmed up" in fig.get_supxlabel()  # the notes under the panels


def test_ema_warmth_follows_the_configured_schedule():
    def config(**ema):
        return OmegaConf.create({"module": {"ema": ema}})

    # with warm-up the decay ramps 1 - (1 + step) ** -2/3 (timm ModelEmaV3) until it reaches 0.9: after ~30 steps
    assert not ema_warmth(config(decay=0.9, use_warmup=True), 10)["warm"]
    assert ema_warmth(config(decay=0.9, use_warmup=True), 100)["warm"]
    # without warm-up the starting weights fade as 0.9 ** steps
    assert not ema_warmth(config(decay=0.9), 10)["warm"] and ema_warmth(config(decay=0.9), 100)["warm"]
    assert ema_warmth(OmegaConf.create({"module": {"ema": None}}), 100) is None


def test_notes_say_when_timing_rests_on_too_few_steps_and_only_cold_ema_trails():
    base = dict(kernel_ms_n=MIN_TIMED_STEPS, timer="cpu, wall clock", val_ema_acc1=0.5,
                ema=dict(decay=0.9, use_warmup=True, reached=0.9, warm=True, steps=100))
    warm = notes([{**base, "job": "0"}])
    assert len(warm) == 2 and "cpu, wall clock" in warm[0] and "not warmed up" not in warm[1]
    cold = notes([{**base, "job": "0", "kernel_ms_n": MIN_TIMED_STEPS - 1},
                  {**base, "job": "1", "ema": {**base["ema"], "warm": False, "reached": 0.5, "steps": 3}}])
    assert any(line.startswith(f"job 0: fewer than {MIN_TIMED_STEPS} timed steps") for line in cold)
    assert "EMA not warmed up in job 1 (decay reached 0.5 after 3 steps)" in cold[-1]
    assert notes([{**base, "job": "0", "kernel_ms_n": None, "ema": None}]) == []


def test_a_job_without_metrics_keeps_empty_cells(sweep, tmp_path):
    job = tmp_path / "7"
    (job / ".hydra").mkdir(parents=True)
    for name in ("config.yaml", "overrides.yaml"):
        (job / ".hydra" / name).write_text((sweep / "0" / ".hydra" / name).read_text())
    (row,) = collect(tmp_path)
    assert row["job"] == "7" and row["params_M"] > 0
    assert row["val_acc1"] is None and row["images_per_s"] is None and row["kernel_fwd_ms"] is None
    assert row["kernel_ms_n"] is None and row["kernel_ms_iqr"] is None and row["ema"] is None
    assert notes([row]) == []  # nothing measured: no notes about measurements


def test_a_sweep_of_one_kernel_size_for_every_stage_is_collected(sweep, tmp_path):
    """`python train.py -m model.kernel_sizes=7,13,31`: each job's kernel_sizes is one int."""
    for size in (13, 7):
        job = tmp_path / str(size)
        (job / ".hydra").mkdir(parents=True)
        config = OmegaConf.load(sweep / "0" / ".hydra" / "config.yaml")
        config.model.kernel_sizes = size
        OmegaConf.save(config, job / ".hydra" / "config.yaml")
        (job / ".hydra" / "overrides.yaml").write_text(f"- model.kernel_sizes={size}\n")
    rows = collect(tmp_path)
    assert sorted(row["kernel_sizes"] for row in rows) == ["13", "7"]
    assert [row["kernel_sizes"] for row in sorted(rows, key=kernel_order)] == ["7", "13"]


def test_bad_run_dirs_end_in_one_message(tmp_path, capsys):
    for run_dir, message in ((tmp_path / "missing", "is not a folder"), (tmp_path, "no Hydra job folder")):
        with pytest.raises(SystemExit) as exit_info:
            main([str(run_dir)])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_an_out_path_that_is_a_file_ends_in_one_message(sweep, tmp_path, capsys):
    report = tmp_path / "report.txt"
    report.write_text("mine")
    with pytest.raises(SystemExit) as exit_info:
        main([str(sweep), "--out", str(report)])
    assert exit_info.value.code == 2 and f"cannot write the report into {report}" in capsys.readouterr().err
    assert report.read_text() == "mine"
