"""`python -m lkcnn.ablation RUN_DIR [--out DIR]`: one table and one plot from a kernel-size multirun.

RUN_DIR is a Hydra multirun folder (`python train.py -m experiment=kernel_ablation` writes
outputs/multirun/<date>/<time>/<job>/), or a single run folder. Per job it reads what the run left behind:
- top-1: the best `val/acc1` (and `val_ema/acc1`) in `csv/metrics.csv` (the csv logger);
- parameters (training form) and MACs (deployed form, one image at data.img_size): `lkcnn.info` on the job's model
  config from `.hydra/config.yaml`, computed on the meta device;
- training images/s and the whole step's time at data.batch_size: `throughput.json` (callbacks/throughput);
- large-kernel conv time per training step (forward + backward, summed over the large kernels and their blocks'
  small / dilated branches): mean, median, IQR and number of the timed steps in `kernel_timing.json`
  (callbacks/kernel_timing), so a noisy timing shows as noisy.
Missing pieces stay empty. Writes ablation.md (the table and notes on what the timing and EMA columns mean),
ablation.csv and ablation.png (accuracy and step time against kernel size, accuracy against throughput) to --out
(default RUN_DIR).
"""
from __future__ import annotations

import argparse
import csv
import json
import logging
import re
import statistics
import sys
import textwrap
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.nn as nn
from omegaconf import OmegaConf
from timm.utils import ModelEmaV3

from lkcnn.info import info
from lkcnn.training.callbacks.kernel_timing import MIN_SAMPLES as MIN_TIMED_STEPS  # the callback warns below it too

log = logging.getLogger(__name__)

COLUMNS = ("job", "kernel_sizes", "val_acc1", "val_ema_acc1", "params_M", "GMACs", "images_per_s", "step_ms",
           "kernel_ms", "kernel_ms_median", "kernel_ms_iqr", "kernel_ms_n", "kernel_fwd_ms", "kernel_bwd_ms",
           "overrides")
EMA_START_SHARE = 0.05  # without warm-up, an EMA whose starting weights still weigh more than this is "not warm"


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


def trained_steps(job: Path) -> int | None:
    """Optimizer steps the job ran: the largest `step` in its metrics.csv (validation logs at each epoch's end)."""
    steps = []
    for path in job.glob("**/metrics.csv"):
        with open(path, newline="") as f:
            steps += [int(row["step"]) for row in csv.DictReader(f) if row.get("step")]
    return max(steps) if steps else None


def kernel_timing(job: Path) -> dict[str, Any]:
    """Large-kernel conv ms per training step (forward + backward summed over layers) over the job's timed steps:
    mean, median, IQR (None below two steps), count; the forward and backward means; the samples; device and timer."""
    path = job / "kernel_timing.json"
    empty = dict.fromkeys(("kernel_ms", "kernel_ms_median", "kernel_ms_iqr", "kernel_ms_n", "kernel_fwd_ms",
                           "kernel_bwd_ms", "timer"))
    if not path.is_file():
        return {**empty, "kernel_ms_samples": []}
    record = json.loads(path.read_text())
    fwd: dict[int, float] = defaultdict(float)
    bwd: dict[int, float] = defaultdict(float)
    for row in record["rows"]:
        fwd[row["step"]] += row["fwd_ms"]
        bwd[row["step"]] += row["bwd_ms"] or 0.0
    if not fwd:
        return {**empty, "kernel_ms_samples": []}
    samples = [fwd[step] + bwd[step] for step in sorted(fwd)]
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive") if len(samples) > 1 else (None, None, None)
    return {"kernel_ms": statistics.fmean(samples), "kernel_ms_median": statistics.median(samples),
            "kernel_ms_iqr": None if q1 is None else q3 - q1, "kernel_ms_n": len(samples),
            "kernel_fwd_ms": statistics.fmean(fwd.values()), "kernel_bwd_ms": statistics.fmean(bwd.values()),
            "kernel_ms_samples": samples, "timer": f"{record.get('device', '?')}, {record.get('timer', '?')}"}


def ema_warmth(config: Any, steps: int | None) -> dict[str, Any] | None:
    """How far the job's EMA got: the configured decay, the decay of its last update (timm ModelEmaV3's own warm-up
    schedule) and whether it counts as warmed up; None without EMA or without a step count."""
    ema = config.module.get("ema") if "module" in config else None
    if not ema or not steps:
        return None
    kwargs = {k: v for k, v in OmegaConf.to_container(ema, resolve=True).items() if k not in ("device", "dtype")}
    schedule = ModelEmaV3(nn.Linear(1, 1), **kwargs)  # a one-weight network: only the decay schedule is used
    reached = schedule.get_decay(steps - 1)  # the module updates with step=global_step, 0 to steps-1
    # with warm-up the decay ramps up to its configured value; without, the starting weights fade as decay**steps
    warm = reached >= schedule.decay if schedule.use_warmup else schedule.decay ** steps < EMA_START_SHARE
    return {"decay": schedule.decay, "reached": reached, "warm": warm, "steps": steps,
            "use_warmup": schedule.use_warmup}


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
    sizes = config.model.get("kernel_sizes")  # one size for every stage (model.kernel_sizes=7,13,31) or one per stage
    sizes = [sizes] if isinstance(sizes, int) else sizes
    path = job / "throughput.json"
    throughput = json.loads(path.read_text()) if path.is_file() else {}
    per_device = throughput.get("images_per_s_per_device")
    params, macs = model_cost(config)
    ema_acc1 = best_metric(job, "val_ema/acc1")
    return {"job": job.name, "kernel_sizes": "-".join(map(str, sizes)) if sizes else str(config.model.name),
            "val_acc1": best_metric(job, "val/acc1"), "val_ema_acc1": ema_acc1, "params_M": params, "GMACs": macs,
            "images_per_s": throughput.get("images_per_s"),
            "step_ms": 1e3 * int(config.data.batch_size) / per_device if per_device else None,
            **kernel_timing(job),
            "ema": ema_warmth(config, trained_steps(job)) if ema_acc1 is not None else None,
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


def _jobs(rows: Sequence[dict[str, Any]]) -> str:
    return ("job " if len(rows) == 1 else "jobs ") + ", ".join(row["job"] for row in rows)


def ema_note(rows: Sequence[dict[str, Any]]) -> str | None:
    """What val_ema_acc1 means and, where the EMA had not warmed up, that it trails; None without EMA columns."""
    known = [row for row in rows if row.get("ema")]
    if not known:
        return None
    first = known[0]["ema"]
    note = (f"val_ema_acc1: best top-1 of the weights' exponential moving average (timm ModelEmaV3, decay "
            f"{first['decay']:g}{', ramped up by its warm-up' if first['use_warmup'] else ''}), an average over "
            "roughly the last 1/(1-decay) steps, so it trails the trained weights while they still improve.")
    cold = [row for row in known if not row["ema"]["warm"]]
    if cold:
        reached = ", ".join(dict.fromkeys(f"{row['ema']['reached']:.3g} after {row['ema']['steps']} steps"
                                          for row in cold))  # once per distinct value: a sweep's jobs often agree
        note += (f" EMA not warmed up in {_jobs(cold)} (decay reached {reached}): a short run; read val_acc1, or "
                 "train longer for the EMA to count.")
    return note


def notes(rows: Sequence[dict[str, Any]]) -> list[str]:
    """One line per caveat: what the timing columns are (and where they rest on too few steps), the EMA columns."""
    lines = []
    timed = [row for row in rows if row["kernel_ms_n"]]
    if timed:
        timers = sorted({row["timer"] for row in timed})
        lines.append("kernel_ms: forward + backward of all large-kernel convs and their small / dilated branches in "
                     "one training step "
                     f"({'; '.join(timers)}), mean over kernel_ms_n timed steps; kernel_ms_median and kernel_ms_iqr "
                     "(75th - 25th percentile) give their spread; kernel_fwd_ms / kernel_bwd_ms are the mean of each "
                     "direction. step_ms: the whole training step at data.batch_size, from images_per_s.")
        few = [row for row in timed if row["kernel_ms_n"] < MIN_TIMED_STEPS]
        if few:
            lines.append(f"{_jobs(few)}: fewer than {MIN_TIMED_STEPS} timed steps, too few for a mean: train "
                         "longer or lower callbacks.kernel_timing.every_n_steps / .warmup_steps.")
    ema = ema_note(rows)
    return lines + ([ema] if ema else [])


def to_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The table, then the notes (a blank line between) as a list."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_fmt(key, row[key]) for key in COLUMNS) + " |" for row in rows]
    footnotes = notes(rows)
    if footnotes:
        lines += ["", *("- " + line for line in footnotes)]
    return "\n".join(lines) + "\n"


def write_csv(rows: Sequence[dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")  # samples, EMA state: not columns
        writer.writeheader()
        writer.writerows(rows)


def kernel_order(row: dict[str, Any]) -> tuple:
    """Sort key: the per-stage kernel sizes as numbers ('31-29-27-13'); runs without sizes come last."""
    parts = str(row["kernel_sizes"]).split("-")
    return (0, *map(int, parts)) if all(p.isdigit() for p in parts) else (1, str(row["kernel_sizes"]))


def plot(rows: Sequence[dict[str, Any]], path: Path) -> Any:
    """Three panels, jobs in order of kernel size: best top-1 against kernel size; time per training step against
    kernel size (large-kernel convs: mean forward and backward stacked, median and IQR whisker, n timed steps; the
    whole step on the right axis); top-1 against training images/s. The notes go under the panels. Drawn with
    matplotlib's Agg canvas (no display needed); returns the Figure."""
    from matplotlib.figure import Figure  # Figure.savefig renders through Agg for .png; no pyplot state

    rows = sorted(rows, key=kernel_order)
    fig = Figure(figsize=(15, 4.8), layout="constrained")
    acc, time_ax, speed = fig.subplots(1, 3)
    labels = [row["kernel_sizes"] for row in rows]
    x = range(len(rows))

    def pct(key: str) -> list[float]:
        return [float("nan") if row[key] is None else 100 * row[key] for row in rows]  # NaN: a gap in the line

    acc.plot(x, pct("val_acc1"), "o-", label="val top-1")
    if any(row["val_ema_acc1"] is not None for row in rows):
        cold = any(row.get("ema") and not row["ema"]["warm"] for row in rows)
        acc.plot(x, pct("val_ema_acc1"), "s--", label="EMA weights" + (" (not warmed up)" if cold else ""))
    acc.set(ylabel="best val top-1 (%)", title="accuracy vs kernel size")
    acc.legend()

    fwd = [row["kernel_fwd_ms"] or 0.0 for row in rows]
    time_ax.bar(x, fwd, label="large-kernel forward (mean)")
    time_ax.bar(x, [row["kernel_bwd_ms"] or 0.0 for row in rows], bottom=fwd, label="large-kernel backward (mean)")
    top = max([(row["kernel_fwd_ms"] or 0.0) + (row["kernel_bwd_ms"] or 0.0) for row in rows], default=0.0)
    for i, row in enumerate(rows):
        if row["kernel_ms_iqr"] is not None:
            q1, _, q3 = statistics.quantiles(row["kernel_ms_samples"], n=4, method="inclusive")
            top = max(top, q3)
            time_ax.errorbar(i, row["kernel_ms_median"], yerr=[[row["kernel_ms_median"] - q1],
                                                                [q3 - row["kernel_ms_median"]]],
                             fmt="_", color="black", capsize=4, label="median, IQR" if i == 0 else None)
    time_ax.set(ylabel="large-kernel convs, ms per step", title="step time vs kernel size")
    time_ax.set_ylim(0, 1.45 * top or 1.0)  # headroom: the legend sits above the bars
    handles = time_ax.get_legend_handles_labels()
    step_ms = [row["step_ms"] for row in rows if row["step_ms"] is not None]
    if step_ms:
        whole = time_ax.twinx()
        whole.plot(x, [float("nan") if row["step_ms"] is None else row["step_ms"] for row in rows], "D:",
                   color="C3", label="whole training step (right axis)")
        whole.set_ylabel("whole training step, ms", color="C3")
        whole.set_ylim(0, 1.45 * max(step_ms))
        handles = tuple(a + b for a, b in zip(handles, whole.get_legend_handles_labels()))
    time_ax.legend(*handles, loc="upper left", fontsize=7, ncols=2)
    acc.set_xticks(x, labels, rotation=20)
    time_ax.set_xticks(x, [f"{label}\nn={row['kernel_ms_n'] or 0}" for label, row in zip(labels, rows)], rotation=20)
    for ax in (acc, time_ax):
        ax.set_xlabel("large kernels per stage" + (" (n: timed steps)" if ax is time_ax else ""))
        ax.grid(alpha=0.3, axis="y")

    points = [r for r in rows if r["val_acc1"] is not None and r["images_per_s"] is not None]
    for row in points:
        speed.scatter(row["images_per_s"], 100 * row["val_acc1"], color="C0")
        speed.annotate(row["kernel_sizes"], (row["images_per_s"], 100 * row["val_acc1"]),
                       textcoords="offset points", xytext=(4, 4), fontsize=8)
    speed.set(xlabel="training images/s", ylabel="best val top-1 (%)", title="accuracy vs throughput")
    for ax, shown in ((acc, [r for r in rows if r["val_acc1"] is not None]),
                      (time_ax, [r for r in rows if r["kernel_ms_n"]]), (speed, points)):
        if not shown:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    footnotes = notes(rows)
    if footnotes:  # wrapped to the figure's width; supxlabel takes part in the constrained layout
        fig.supxlabel("\n".join(textwrap.fill(line, 190) for line in footnotes), x=0.01, ha="left", fontsize=7)
    fig.savefig(path, dpi=120)
    return fig


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
    table = to_markdown(rows)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "ablation.md").write_text(table)
        write_csv(rows, out / "ablation.csv")
        plot(rows, out / "ablation.png")
    except OSError as err:  # --out is a file, or not writable
        parser.error(f"cannot write the report into {out}: {err.strerror or err}; pass --out FOLDER")
    print(table, end="")
    print(f"wrote {out / 'ablation.md'}, {out / 'ablation.csv'}, {out / 'ablation.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
