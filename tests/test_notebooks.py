"""The notebooks: committed without outputs, and each runs from the first cell to the last in fast mode.

Fast mode (LKCNN_NB_FAST=1) is what CI runs: the notebooks shrink their work (a few training batches, 2 calibration
batches, a small ERF input, a 2-job sweep, the committed benchmark JSON). The same run by hand: LKCNN_NB_FAST=1
pytest --nbmake notebooks/
"""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
EXPECTED = {"01_kernel_speed", "02_reparameterize_and_export", "03_effective_receptive_field", "04_ablation",
            "05_quantization"}
CELL_TIMEOUT_S = 600  # a guard against a hung cell; fast mode needs well under a minute per notebook


def _code_cells(nb: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    return [cell for cell in nb.cells if cell.cell_type == "code"]


def test_every_notebook_is_there():
    assert EXPECTED <= {path.stem for path in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_committed_valid_and_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    cells = _code_cells(nb)
    assert cells, f"{path.name} has no code"
    stale = [i for i, cell in enumerate(cells) if cell.outputs or cell.execution_count is not None]
    assert not stale, f"{path.name}: code cells {stale} carry outputs; strip them before committing"
    assert nb.metadata.kernelspec.name == "python3"


def _run_fast(path: Path, out: Path, monkeypatch, **env: str) -> nbformat.NotebookNode:
    """Run a notebook in fast mode, writing into `out`, with `env` (LKCNN_NB_BENCH_JSON=...) and none of a user's."""
    monkeypatch.setenv("LKCNN_NB_FAST", "1")
    monkeypatch.setenv("LKCNN_NB_OUT", str(out))  # runs, exports and plots go here, not into the checkout
    for name in ("LKCNN_NB_BENCH_JSON", "LKCNN_NB_CHECKPOINT", "LKCNN_NB_ABLATION_DIR"):
        monkeypatch.delenv(name, raising=False)  # the notebooks' own fast-mode paths, not a user's files
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    nb = nbformat.read(path, as_version=4)
    # raises CellExecutionError, with the failing cell and its traceback, at the first error
    NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK_DIR)}}).execute()
    return nb


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_runs_in_fast_mode(path, tmp_path, monkeypatch):
    nb = _run_fast(path, tmp_path, monkeypatch)
    assert all(cell.execution_count for cell in _code_cells(nb))


@pytest.mark.slow
def test_kernel_speed_draws_a_record_with_shapes_written_out(tmp_path, monkeypatch):
    """A record of `lkcnn.bench --shapes 64x384x24x24,... --ks ...` (shapes outside the set) draws like the set's."""
    record = NOTEBOOK_DIR.parent / "benchmarks" / "h200_kernels_fp32_wide_maps.json"
    _run_fast(NOTEBOOK_DIR / "01_kernel_speed.ipynb", tmp_path, monkeypatch, LKCNN_NB_BENCH_JSON=str(record))
    assert (tmp_path / "kernel_speedup.png").stat().st_size > 0
