"""`python -m lkcnn.ablation RUN_DIR [--out DIR]`: one table and one plot from a kernel-size multirun.

RUN_DIR is a Hydra multirun folder (`python train.py -m experiment=kernel_ablation` writes
outputs/multirun/<date>/<time>/<job>/), or a single run folder. Per job it reads what the run left behind:
- top-1: the best `val/acc1` (and `val_ema/acc1`) in `csv/metrics.csv` (the csv logger);
- parameters (training form) and MACs (deployed form, one image at data.img_size): `lkcnn.info` on the job's model
  config from `.hydra/config.yaml`, computed on the meta device;
- training images/s: `throughput.json` (callbacks/throughput);
- large-kernel conv time per training step, forward and backward summed over layers, median over the timed
  steps: `kernel_timing.json` (callbacks/kernel_timing).
Missing pieces stay empty. Writes ablation.md, ablation.csv and ablation.png to --out (default RUN_DIR).
"""
from __future__ import annotations

import argparse
import csv
import json
import logging
import re
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from lkcnn.info import info

log = logging.getLogger(__name__)

COLUMNS = ("job", "kernel_sizes", "val_acc1", "val_ema_acc1", "params_M", "GMACs", "images_per_s",
           "kernel_fwd_ms", "kernel_bwd_ms", "overrides")


def find_jobs(run_dir: Path) -> list[Path]:
    """Job folders (those with .hydra/config.yaml) under run_dir, in job-number order; run_dir itself if it is one."""
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} is not a folder: pass a multirun folder, e.g. "
                                "outputs/multirun/<date>/<time>")
    if (run_dir / ".hydra" / "config.yaml").is_file():
        return [run_dir]
    jobs = [config.parent.parent for config in run_dir.glob("**/.hydra/config.yaml")]
    if not jobs:
        raise FileNotFoundError(f"no Hydra job folder (one with .hydra/config.yaml) under {run_dir}: pass the folder "
                                "a multirun wrote, e.g. outputs/multirun/<date>/<time>")
    return sorted(jobs, key=lambda job: [int(part) if part.isdigit() else part  # job 10 after job 9
                                         for part in re.split(r"(\d+)", str(job.relative_to(run_dir)))])


def best_metric(job: Path, key: str) -> float | None:
    """The largest value of `key` in the job's Lightning CSVLogger metrics.csv, or None."""
    values = []
    for path in job.glob("**/metrics.csv"):
        with open(path, newline="") as f:
            values += [float(row[key]) for row in csv.DictReader(f) if row.get(key)]
    return max(values) if values else None


def kernel_ms(job: Path) -> tuple[float | None, float | None]:
    """(forward, backward) ms of all large-kernel convs in one training step: median over the timed steps."""
    path = job / "kernel_timing.json"
    if not path.is_file():
        return None, None
    fwd: dict[int, float] = defaultdict(float)
    bwd: dict[int, float] = defaultdict(float)
    for row in json.loads(path.read_text())["rows"]:
        fwd[row["step"]] += row["fwd_ms"]
        bwd[row["step"]] += row["bwd_ms"] or 0.0
    if not fwd:
        return None, None
    return statistics.median(fwd.values()), statistics.median(bwd.values())


def model_cost(config: Any) -> tuple[float | None, float | None]:
    """(parameters in millions, GMACs of the deployed model) for the job's model config, or Nones with a warning."""
    model = OmegaConf.to_container(config.model, resolve=True)
    name = model.pop("name")
    try:
        result = info(name, int(config.data.img_size), model)
    except ValueError as err:
        log.warning("no parameter/MAC count for %s: %s", name, err)
        return None, None
    return result["params_train"] / 1e6, result["macs_deploy"] / 1e9


def collect_job(job: Path) -> dict[str, Any]:
    """One table row for one job folder."""
    config = OmegaConf.load(job / ".hydra" / "config.yaml")
    sizes = config.model.get("kernel_sizes")
    throughput = job / "throughput.json"
    params, macs = model_cost(config)
    fwd, bwd = kernel_ms(job)
    return {"job": job.name, "kernel_sizes": "-".join(map(str, sizes)) if sizes else str(config.model.name),
            "val_acc1": best_metric(job, "val/acc1"), "val_ema_acc1": best_metric(job, "val_ema/acc1"),
            "params_M": params, "GMACs": macs,
            "images_per_s": json.loads(throughput.read_text())["images_per_s"] if throughput.is_file() else None,
            "kernel_fwd_ms": fwd, "kernel_bwd_ms": bwd,
            "overrides": list(OmegaConf.load(job / ".hydra" / "overrides.yaml"))}


def collect(run_dir: str | Path) -> list[dict[str, Any]]:
    """Rows for every job of run_dir; `overrides` keeps only the overrides that differ between jobs."""
    rows = [collect_job(job) for job in find_jobs(Path(run_dir))]
    common = set.intersection(*(set(row["overrides"]) for row in rows))
    for row in rows:
        row["overrides"] = " ".join(o for o in row["overrides"] if o not in common)
    for row in rows:
        if row["val_acc1"] is None:
            log.warning("job %s: no val/acc1 in a csv/metrics.csv: train with the csv logger "
                        "(logger=csv, or e.g. logger=[csv,wandb])", row["job"])
    return rows


def _fmt(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key in ("val_acc1", "val_ema_acc1"):
        return f"{100 * value:.2f}%"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def to_markdown(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_fmt(key, row[key]) for key in COLUMNS) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_csv(rows: Sequence[dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Left: top-1 against training images/s, one labelled point per job. Right: large-kernel conv ms per step,
    forward and backward stacked. Drawn with matplotlib's Agg canvas (no display needed)."""
    from matplotlib.figure import Figure  # Figure.savefig renders through Agg for .png; no pyplot state

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    speed, kernels = fig.subplots(1, 2)
    points = [r for r in rows if r["val_acc1"] is not None and r["images_per_s"] is not None]
    for row in points:
        speed.scatter(row["images_per_s"], 100 * row["val_acc1"], color="C0")
        speed.annotate(row["kernel_sizes"], (row["images_per_s"], 100 * row["val_acc1"]),
                       textcoords="offset points", xytext=(4, 4), fontsize=8)
    speed.set(xlabel="training images/s", ylabel="best val top-1 (%)", title="accuracy vs throughput")
    timed = [r for r in rows if r["kernel_fwd_ms"] is not None]
    labels = [r["kernel_sizes"] for r in timed]
    fwd = [r["kernel_fwd_ms"] for r in timed]
    kernels.bar(labels, fwd, label="forward")
    kernels.bar(labels, [r["kernel_bwd_ms"] for r in timed], bottom=fwd, label="backward")
    kernels.set(xlabel="large kernels per stage", ylabel="ms per training step",
                title="large-kernel conv time (all layers)")
    kernels.tick_params(axis="x", labelrotation=20)
    kernels.legend()
    for ax, shown in ((speed, points), (kernels, timed)):
        if not shown:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    fig.savefig(path, dpi=120)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lkcnn.ablation", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a multirun folder, e.g. outputs/multirun/<date>/<time>")
    parser.add_argument("--out", help="folder for ablation.md/.csv/.png (default: RUN_DIR)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    try:
        rows = collect(args.run_dir)
    except (FileNotFoundError, ValueError) as err:
        parser.error(str(err))
    out = Path(args.out or args.run_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = to_markdown(rows)
    (out / "ablation.md").write_text(table)
    write_csv(rows, out / "ablation.csv")
    plot(rows, out / "ablation.png")
    print(table, end="")
    print(f"wrote {out / 'ablation.md'}, {out / 'ablation.csv'}, {out / 'ablation.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
