"""The benchmark record (`lkcnn-benchmark/1`, benchmarks/README.md): one JSON object per run that says what was
measured, where (GPU, driver, library versions, commit), by which command and how. Every benchmark's `--json`
writes one, so any record can be read, compared and regenerated the same way.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lkcnn.bench import ROOT

SCHEMA = "lkcnn-benchmark/1"


def _run_quietly(args: Sequence[str]) -> str | None:
    """The stripped stdout of a helper command (git, nvidia-smi), or None when it is missing or fails."""
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=20, cwd=ROOT)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def git_state() -> dict[str, Any]:
    """The commit of the checkout the benchmark ran from, and whether tracked files differed from it."""
    commit = _run_quietly(["git", "rev-parse", "HEAD"])
    status = _run_quietly(["git", "status", "--porcelain", "--untracked-files=no"]) if commit else None
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def command_line(argv: Sequence[str]) -> str:
    """The command that reproduces a run: `python -m lkcnn.bench` with these arguments (subcommand first)."""
    return shlex.join(["python", "-m", "lkcnn.bench", *argv])


GPU_QUERY = ("driver_version", "uuid", "power.limit", "clocks.max.sm", "clocks.max.mem")


def gpu_state(device: torch.device) -> dict[str, Any]:
    """The GPU's driver and what tells one machine of a kind from another: its UUID (which physical GPU ran it), power
    limit and top clocks. Rates of the same code differ by several % across machines of one kind, so records keep these
    beside the numbers. Absent keys where nvidia-smi is missing."""
    if device.type != "cuda":
        return {}
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    select = ["-i", uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"]
    query = [f"--query-gpu={','.join(GPU_QUERY)}", "--format=csv,noheader,nounits"]
    out = _run_quietly(["nvidia-smi", *select, *query])
    if out is None and torch.cuda.device_count() == 1:  # the one GPU, whatever its UUID's spelling
        out = _run_quietly(["nvidia-smi", *query])
    values = [v.strip() for v in out.splitlines()[0].split(",")] if out else []
    if len(values) != len(GPU_QUERY):
        return {}
    driver, gpu_uuid, power, sm, mem = values

    def number(v: str) -> float | None:
        try:
            return float(v)
        except ValueError:  # "[N/A]"
            return None
    return {"driver": driver, "gpu_uuid": gpu_uuid, "gpu_power_limit_w": number(power),
            "gpu_max_sm_clock_mhz": number(sm), "gpu_max_mem_clock_mhz": number(mem)}


def environment(device: torch.device) -> dict[str, Any]:
    """Where the numbers were taken: GPU (`gpu_state`), library versions, commit and date (the record's environment)."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = device.type == "cuda"
    return {
        "gpu": torch.cuda.get_device_name(device) if cuda else str(device),
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "sm_count": torch.cuda.get_device_properties(device).multi_processor_count if cuda else None,
        "driver": None, **gpu_state(device),
        "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
        "triton": triton_version, "python": platform.python_version(), **git_state(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def make_record(kind: str, device: torch.device, command: str, method: dict[str, Any],
                rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A record of `kind` measured on `device` now: schema, kind, environment, command, method, rows."""
    return {"schema": SCHEMA, "kind": kind, "environment": environment(device), "command": command,
            "method": method, "rows": rows}


def write_record(path: str | Path, record: dict[str, Any]) -> None:
    """Write a record as indented JSON, creating its folder; all or nothing (a benchmark stopped at a time limit while
    rewriting its record keeps the last whole one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(partial, path)


def load_record(path: str | Path) -> dict[str, Any]:
    """A benchmark record as written by `--json`. A kernel record of the older {"meta", "results"} format is
    returned in the schema (its environment as far as it was recorded)."""
    path = Path(path)
    data = json.loads(path.read_text())
    if isinstance(data, dict) and {"environment", "command", "rows"} <= data.keys():
        return data
    if isinstance(data, dict) and {"meta", "results"} <= data.keys():
        meta = data["meta"]
        argv = [a for a in meta.get("argv", []) if not a.endswith("bench.py")]
        env = {"gpu": meta.get("device"), "sm_count": meta.get("sm_count"), "driver": None,
               "torch": meta.get("torch"), "cuda": meta.get("cuda"), "cudnn": meta.get("cudnn"),
               "triton": meta.get("triton"), "commit": None, "date": meta.get("date")}
        how = {k: v for k, v in meta.items() if k not in env and k not in ("device", "argv")}
        return {"schema": SCHEMA, "kind": "kernels", "environment": env, "command": command_line(argv),
                "method": how, "rows": data["results"]}
    raise ValueError(f"{path} is not an lkcnn benchmark record (needs environment, command and rows)")
