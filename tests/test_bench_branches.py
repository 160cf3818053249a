"""lkcnn.bench.branches on the CPU: the three ways it times compute the same passes (so the benchmark compares equal
work), and its table reads the record's rows. The timings themselves need a GPU."""
from __future__ import annotations

import pytest
import torch

from lkcnn.bench import branches


@pytest.mark.parametrize("case", ["replknet31b s4 5x5", "unireplknet_b s4 k13"])
def test_every_way_computes_the_same_passes(case):
    _, pairs = branches.CASES[case]
    s = branches._inputs((2, 8, 9, 7), pairs, torch.float64, torch.device("cpu"))
    results = {way: {name: fn(s) for name, fn in branches.passes(way, pairs).items()} for way in branches.WAYS}
    ours = results["lkcnn_branches"]
    for way in branches.WAYS[1:]:
        for name, value in results[way].items():
            got = value if isinstance(value, list) else [value]
            want = ours[name] if isinstance(ours[name], list) else [ours[name]]
            if way == "lkcnn_dense" and name == "bwd_weight":  # the dense kernels' gradients: the taps are every r-th
                got = [g[..., ::r, ::r] for g, (_, r) in zip(got, pairs)]
            assert len(got) == len(want), (way, name)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, msg=f"{way} {name}")


def test_table_rows_and_ratios():
    ms = {"fwd": 0.1, "bwd_input": 0.1, "bwd_weight": 0.2, "total": 0.4}
    row = {"case": "replknet31b s3 5x5", "dtype": "bf16", "lkcnn_branches": ms,
           "cudnn": {**ms, "total": 0.8}, "lkcnn_dense": {"error": "RuntimeError: x"}, "x_cudnn": 2.0}
    table = branches.format_table([row])
    assert "0.100 / 0.100 / 0.200 = 0.400" in table and "2.00x" in table and "nanx" in table
    alone = branches.format_table([{k: v for k, v in row.items() if k in ("case", "dtype", "lkcnn_branches")}])
    assert "0.100 / 0.100 / 0.200 = 0.400" in alone  # a run of --ways lkcnn_branches alone


def test_main_without_a_gpu_is_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        branches.main([])


@pytest.mark.parametrize("argv,message", [
    (["--cases", "s9"], "unknown case(s) s9: choose from replknet31b s1 5x5"),
    (["--dtypes", "bf16,int8"], "unknown dtype(s) int8: choose from fp32, fp16, bf16"),
    (["--ways", "lkcnn_branches,triton"], "unknown way(s) triton: choose from lkcnn_branches, cudnn, lkcnn_dense")])
def test_bad_arguments_are_one_line(monkeypatch, argv, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the checks come before any GPU work
    with pytest.raises(SystemExit) as exit_info:
        branches.main(argv)
    assert str(exit_info.value).startswith(message) and "\n" not in str(exit_info.value)
