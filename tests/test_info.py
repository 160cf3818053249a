"""`lkcnn-info` with a model name it does not know: one line on stderr that names what to type instead, exit 2."""
from __future__ import annotations

import difflib
import subprocess
import sys

import pytest
import timm

from lkcnn.info import main
from lkcnn.models import list_models


def test_a_name_close_to_lkcnn_models_suggests_them(capsys):
    assert main(["replknet31x"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1
    suggested = captured.err.split("did you mean ", 1)[1].rstrip("?\n").split(", ")
    assert "replknet31b" in suggested and set(suggested) <= set(list_models())  # lkcnn's names before timm's


def test_a_name_close_only_to_timm_models_suggests_those(capsys):
    assert main(["resnet5"]) == 2
    suggested = capsys.readouterr().err.split("did you mean ", 1)[1].rstrip("?\n").split(", ")
    assert suggested and all(name in timm.list_models() for name in suggested) and "resnet50" in suggested


def test_a_name_close_to_nothing_lists_lkcnn_models_in_one_line():
    name = "foo"
    assert not difflib.get_close_matches(name, timm.list_models())  # the case under test: no suggestion possible
    # the command as a user runs it: its exit status and everything it prints
    proc = subprocess.run([sys.executable, "-m", "lkcnn.info", name], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr and "did you mean" not in line and "[]" not in line
    assert f"unknown model {name!r}" in line and all(model in line for model in list_models())


@pytest.mark.parametrize("argv, message", [(["replknet_tiny", "--set", "kernel_sizes"], "--set expects key=value"),
                                           (["replknet_tiny", "--set", "no_such_kwarg=1"], "does not accept"),
                                           (["replknet_tiny_32px"], "is a train.py model config (conf/model/")])
def test_bad_settings_end_in_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and message in err


@pytest.mark.parametrize("size", ["0", "-3", "big"])
def test_an_image_size_that_is_not_a_positive_int_is_a_usage_error(size, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["replknet_tiny", "--img-size", size])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "--img-size: must be a positive number of pixels" in err.splitlines()[-1]
