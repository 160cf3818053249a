"""lkcnn's benchmarks, `python -m lkcnn.bench <benchmark> ...` (the list: __main__.py's COMMANDS): each module is one
benchmark, timed through `timing` and written in `record`'s format (benchmarks/README.md).

They run from a checkout: the training-app benchmarks compose train.py's configs from conf/, and the kernel
benchmark reads its anchors from benchmarks/.
"""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
