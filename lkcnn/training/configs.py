"""train.py's configuration outside train.py: conf/ composed with Hydra overrides, for the tools that build its
DataModule or run its training (the evaluator and calibration, the loader and app benchmarks)."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

# conf/ ships with the source tree (a checkout or an editable install), beside the lkcnn package
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def compose_train(overrides: Sequence[str]) -> Any:
    """conf/train.yaml composed with `overrides`, as `python train.py ...` would run it."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=list(overrides))
