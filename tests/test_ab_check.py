"""scripts/ab_check.sh on the CPU (its builds left out): each side runs in its own tree and imports that tree's lkcnn,
the sides alternate round by round, each run's output lands under its AB_OUT, and a missing base tree or a command
given as several words ends in one line."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ab_check.sh"


def _tree(root: Path, name: str) -> Path:
    (root / name / "lkcnn").mkdir(parents=True)
    (root / name / "lkcnn" / "__init__.py").write_text(f"TREE = {name!r}\n")
    return root / name


def _run(cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "BUILD": "0", **env})


def test_the_sides_alternate_each_in_its_own_tree(tmp_path):
    base, change, out = _tree(tmp_path, "A"), _tree(tmp_path, "B"), tmp_path / "out"
    out.mkdir()
    command = f'{sys.executable} -c "import lkcnn; print(lkcnn.TREE)"; echo "$AB_OUT" > "$AB_OUT.where"'
    proc = _run(change, command, A=str(base), ROUNDS="2", OUT=str(out))
    assert proc.returncode == 0, proc.stderr
    assert [line for line in proc.stdout.splitlines() if line.startswith("==")] == [
        "== A1 (rc=0):", "== B1 (rc=0):", "== A2 (rc=0):", "== B2 (rc=0):"]
    for run in ("A1", "B1", "A2", "B2"):
        assert (out / f"{run}.log").read_text().strip() == run[0]
        assert (out / f"{run}.where").read_text().strip() == str(out / run)


def test_a_missing_base_or_a_split_command_is_one_line(tmp_path):
    change = _tree(tmp_path, "B")
    missing = _run(change, "true", A=str(tmp_path / "nowhere"), OUT=str(tmp_path))
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "git archive" in missing.stderr
    split = _run(change, "python3", "-V", A=str(change), OUT=str(tmp_path))
    assert split.returncode == 2 and split.stderr.count("\n") == 1 and "one quoted argument" in split.stderr
