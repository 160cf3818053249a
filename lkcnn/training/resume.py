"""`ckpt_path=...` for train.py: a checkpoint file, or `latest` for the newest last.ckpt of this model; and the run
folder a run writes into.

The file is read (weights only) and checked against the configured network before Lightning restores it, so a
truncated file, a file that is not a checkpoint or one written for other kernel sizes ends in one line instead of a
traceback from deep inside torch.load or load_state_dict. A run folder that holds another run's checkpoints or logs is
refused unless the run resumes from it, since Lightning would overwrite them.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

from torch import nn

from lkcnn.deploy.checkpoint import CheckpointError, read_checkpoint

from .errors import ConfigError, PathNotFoundError


def resolve_ckpt_path(ckpt_path: str | None, runs_dir: str, model: nn.Module) -> str | None:
    """The checkpoint to resume `model` from: None (fresh run), the given file, or for "latest" the most recently
    written `<runs_dir>/**/checkpoints/last.ckpt` whose network matches `model` (Lightning's own "last" only looks
    in the new run's folder)."""
    if ckpt_path is None:
        return None
    if ckpt_path == "latest":
        candidates = sorted(Path(runs_dir).glob("**/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime,
                            reverse=True)
        if not candidates:
            raise PathNotFoundError(f"ckpt_path=latest found no checkpoints/last.ckpt under {runs_dir}/: "
                                    "start a fresh run, or pass ckpt_path=/path/to/file.ckpt")
        rejected = []
        for path in candidates:
            try:
                problem = mismatch(path, model)
            except CheckpointError as err:
                problem = str(err)
            if problem is None:
                return str(path)
            rejected.append(f"{path.parents[1]} ({problem})")
        shown = "; ".join(rejected[:3]) + (f"; and {len(rejected) - 3} more" if len(rejected) > 3 else "")
        raise ConfigError(f"ckpt_path=latest found {len(candidates)} run(s) under {runs_dir}/ but none of this "
                          f"model: {shown}. Pass the model overrides of the run to resume, or its "
                          "ckpt_path=<run>/checkpoints/last.ckpt")
    if not Path(ckpt_path).is_file():
        raise PathNotFoundError(f"ckpt_path={ckpt_path} is not a file: pass a .ckpt written by a run "
                                f"(e.g. {runs_dir}/<date>/<time>/checkpoints/last.ckpt) or ckpt_path=latest")
    problem = mismatch(ckpt_path, model)
    if problem is not None:
        raise ConfigError(f"ckpt_path={ckpt_path}: {problem}. Resume with the model overrides of the run that "
                          "wrote it, or start a fresh run")
    return ckpt_path


def mismatch(path: str | Path, model: nn.Module) -> str | None:
    """Why the checkpoint cannot resume `model` (None when it can); CheckpointError when it cannot be read or was not
    written by train.py."""
    checkpoint = read_checkpoint(path)
    if checkpoint.kind != "lightning":
        raise CheckpointError(f"ckpt_path={path} is not a checkpoint written by train.py: ckpt_path resumes a run of "
                              f"train.py; to start a new run from a state_dict of this network, pass "
                              f"+model.checkpoint_path={path} instead (timm loads it into the model)")
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    given = {k: tuple(v.shape) for k, v in checkpoint.state_dict.items()}
    if given == expected:
        return None
    spec, ours = checkpoint.spec, getattr(model, "lkcnn_spec", None)
    if spec and ours:
        if spec["name"] != ours["name"]:
            return f"written for model {spec['name']}, this run builds {ours['name']}"
        keys = sorted(set(spec["kwargs"]) | set(ours["kwargs"]))
        differ = [f"{k}={spec['kwargs'].get(k, 'default')} (this run: {ours['kwargs'].get(k, 'default')})"
                  for k in keys if spec["kwargs"].get(k) != ours["kwargs"].get(k)]
        if differ:
            return f"written for {spec['name']} with {', '.join(differ)}"
    bad = sorted(k for k in set(given) | set(expected) if given.get(k) != expected.get(k))
    return f"its weights do not fit this model ({len(bad)} keys differ, e.g. {bad[0]})"


def resume_note(ckpt_path: str | None, output_dir: str) -> str | None:
    """The run summary's `resume` line: what a resumed run takes from its checkpoint, and, when the run writes into
    another folder than the checkpoint's (Hydra's default: a new folder per run), that best-checkpoint tracking
    starts over there while the earlier best stays where it was. None for a fresh run."""
    if ckpt_path is None:
        return None
    taken, source = f"{ckpt_path} (weights, optimizer, schedule, epoch and step)", Path(ckpt_path).resolve().parent
    if source == (Path(output_dir) / "checkpoints").resolve():
        return f"{taken}, in its own run folder"
    run = source.parent if source.name == "checkpoints" else source
    return (f"{taken}; the best checkpoint is tracked afresh in this run's folder, the earlier best stays in {source} "
            f"(hydra.run.dir={run} resumes in that folder)")


# optimizer settings whose change alters the optimizer's state or parameter groups: that state cannot be restored
_OPTIMIZER_STRUCTURE = ("opt", "layer_decay")


def check_resume_config(ckpt_path: str | None, config: dict[str, Any]) -> list[str]:
    """Refuse (ConfigError) a resume whose config changed what the checkpoint's training state needs: EMA turned on
    or off, another optimizer, weight decay turned on or off, layer decay. Returns warnings for the other optimizer
    settings that changed (lr, weight_decay, ...): the restored optimizer and schedule keep the checkpoint's.
    `config` is this run's resolved config; a checkpoint without the training app's config is not checked."""
    stored = read_checkpoint(ckpt_path).hydra_config if ckpt_path else None
    if not stored or "module" not in stored or "optim" not in stored:
        return []
    was, now = (stored["module"].get("ema") is not None), (config["module"].get("ema") is not None)
    if was != now:
        raise ConfigError(f"ckpt_path={ckpt_path} was trained with EMA {'on' if was else 'off (module.ema=null)'} and "
                          f"this run has it {'on' if now else 'off'}: its training state resumes only with the same "
                          "module.ema; pass it as that run did, or start a fresh run")
    old, new = stored["optim"].get("optimizer", {}), config["optim"].get("optimizer", {})
    changed = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    structural = [k for k in changed
                  if k in _OPTIMIZER_STRUCTURE or (k == "weight_decay" and bool(old.get(k)) != bool(new.get(k)))]
    if structural:
        settings = ", ".join(f"optim.optimizer.{k}={old.get(k)} (this run: {new.get(k)})" for k in structural)
        raise ConfigError(f"ckpt_path={ckpt_path}: its optimizer state resumes only into the same optimizer, and this "
                          f"run changed {settings}: resume with that run's optim settings, or start a fresh run")
    if not changed:
        return []
    kept = ", ".join(f"optim.optimizer.{k}={old.get(k)} (this run: {new.get(k)})" for k in changed)
    return [f"ckpt_path={ckpt_path} restores its optimizer and schedule, so {kept} stay as they were; start a fresh "
            "run to change them"]


RUN_MARKER = ".lkcnn-run"  # created (exclusively) by each run in its folder: two runs never share one
HYDRA_FILES = {".hydra", "train.log"}  # what Hydra writes into a run folder before the run starts
# unused_run_dir's folders by the path asked for (Hydra and Lightning resolve the run folder more than once), absolute
# for remove_unused_run_dirs (hydra.job.chdir moves the working directory)
_unused: dict[str, Path] = {}


def unused_run_dir(path: str) -> str:
    """The default run or sweep folder (conf/train.yaml's `hydra.run.dir`, `<runs_dir>/<date>/<time>`, and
    `hydra.sweep.dir`, whose jobs all resolve it in one process) made this run's own:
    `path`, or `path_1`, `path_2`, ... where a run that started in the same second (a shell loop of background runs,
    a job array) has it. Without this both would share one folder and the second would write its .hydra/ files over
    the first's. The folder is created here, exclusively, so runs started at once never get the same one. Where a
    launcher (torchrun, srun) starts every rank with the same command, the ranks share `path` as it is (pin
    hydra.run.dir there: docs/training_multigpu.md); Lightning's own DDP launcher passes rank 0's folder on."""
    if int(os.environ.get("WORLD_SIZE", 1)) > 1 or int(os.environ.get("SLURM_NTASKS", 1)) > 1:
        return path
    n = 0
    while path not in _unused:
        folder = Path(path if n == 0 else f"{path}_{n}")
        try:
            folder.mkdir(parents=True)
        except FileExistsError:
            n += 1
            continue
        except FileNotFoundError:  # its <date> folder was removed meanwhile (remove_unused_run_dirs): again
            continue
        _unused[path] = folder.absolute()
    return str(_unused[path])


def remove_unused_run_dirs() -> None:
    """Remove the folders unused_run_dir made in this process that hold nothing but Hydra's files and this run's
    marker: a run stopped by a config mistake leaves no folder behind (a folder a user named is never removed)."""
    for folder in _unused.values():
        if folder.is_dir() and {p.name for p in folder.iterdir()} <= HYDRA_FILES | {RUN_MARKER}:
            shutil.rmtree(folder)
            try:  # and its <date> folder, where this was the day's only run
                folder.parent.rmdir()
            except OSError:  # not empty
                pass


def _resumes_in(folder: Path, ckpt_path: str | None) -> bool:
    return ckpt_path is not None and Path(ckpt_path).resolve().parent == (folder / "checkpoints").resolve()


def other_run(output_dir: str, ckpt_path: str | None) -> str | None:
    """Why a run resuming from `ckpt_path` (None: a fresh run) may not write into `output_dir`: the folder holds
    another run's marker, checkpoints or metrics, and the run does not resume from its checkpoints; None if it may."""
    folder = Path(output_dir)
    found = [name for name in (RUN_MARKER, "checkpoints", "csv") if (folder / name).exists()]
    if not found or _resumes_in(folder, ckpt_path):
        return None
    return (f"{folder} already holds another run ({', '.join(found)}): Lightning would overwrite its files. Resume "
            f"it with ckpt_path={folder / 'checkpoints' / 'last.ckpt'}, or start this run in a new folder (leave "
            "hydra.run.dir unset, or pass another)")


def claim_run_dir(output_dir: str, ckpt_path: str | None) -> None:
    """Make `output_dir` this run's folder, or raise ConfigError where it belongs to another run (`other_run`). Two
    runs started at once with the same hydra.run.dir: the marker, created exclusively, lets only one in."""
    if message := other_run(output_dir, ckpt_path):
        raise ConfigError(message)
    folder = Path(output_dir)
    resuming_here = _resumes_in(folder, ckpt_path)
    folder.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | (0 if resuming_here else os.O_EXCL)
    try:
        fd = os.open(folder / RUN_MARKER, flags | os.O_TRUNC, 0o644)
    except FileExistsError:  # a run that started at the same moment took the folder first
        raise ConfigError(f"{folder} was taken by another run that started at the same moment: pass another "
                          "hydra.run.dir (or leave it unset: each run then gets a folder of its own)") from None
    with os.fdopen(fd, "w") as marker:
        marker.write(" ".join(sys.argv) + "\n")
