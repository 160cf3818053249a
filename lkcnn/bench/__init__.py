"""lkcnn's benchmarks, `python -m lkcnn.bench [kernels|e2e|loader|app] ...` (see __main__.py): each module is one
benchmark, timed through `timing` and written in `record`'s format (benchmarks/README.md).

They run from a checkout: the training-app benchmarks compose train.py's configs from conf/, and the kernel
benchmark reads its anchors from benchmarks/.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def compose_train(overrides: Sequence[str]) -> Any:
    """train.py's config (conf/train.yaml) composed with Hydra overrides, as `python train.py ...` would run it."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=list(overrides))
