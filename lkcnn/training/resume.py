"""`ckpt_path=...` for train.py: a checkpoint file, or `latest` for the newest last.ckpt under the runs folder."""
from __future__ import annotations

from pathlib import Path

from .errors import PathNotFoundError


def resolve_ckpt_path(ckpt_path: str | None, runs_dir: str) -> str | None:
    """The checkpoint to resume from: None (fresh run), the given file, or for "latest" the most recently
    written `<runs_dir>/**/checkpoints/last.ckpt` (Lightning's own "last" only looks in the new run's folder)."""
    if ckpt_path is None:
        return None
    if ckpt_path == "latest":
        candidates = list(Path(runs_dir).glob("**/checkpoints/last.ckpt"))
        if not candidates:
            raise PathNotFoundError(f"ckpt_path=latest found no checkpoints/last.ckpt under {runs_dir}/: "
                                    "start a fresh run, or pass ckpt_path=/path/to/file.ckpt")
        return str(max(candidates, key=lambda p: p.stat().st_mtime))
    if not Path(ckpt_path).is_file():
        raise PathNotFoundError(f"ckpt_path={ckpt_path} is not a file: pass a .ckpt written by a run "
                                f"(e.g. {runs_dir}/<date>/<time>/checkpoints/last.ckpt) or ckpt_path=latest")
    return ckpt_path
