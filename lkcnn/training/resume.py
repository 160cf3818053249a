"""`ckpt_path=...` for train.py: a checkpoint file, or `latest` for the newest last.ckpt of this model.

The file is read (weights only) and checked against the configured network before Lightning restores it, so a
truncated file, a file that is not a checkpoint or one written for other kernel sizes ends in one line instead of a
traceback from deep inside torch.load or load_state_dict.
"""
from __future__ import annotations

from pathlib import Path

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
    """Why the checkpoint cannot resume `model` (None when it can); CheckpointError when it cannot be read."""
    checkpoint = read_checkpoint(path)
    if checkpoint.kind != "lightning":
        return "not a checkpoint written by train.py (to start from other weights, export or load them instead)"
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
