"""lkcnn.bench.kernels on the CPU: in-bounds FLOPs vs brute force and the published floors, config selection,
anchors, the record (lkcnn.bench.record, benchmarks/README.md's schema) and table with a fake timing function,
failures recorded per config, the plot, the no-GPU exit, and the subcommands of `python -m lkcnn.bench`."""
import json
from dataclasses import replace
import os
import random
import re
import shlex
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from lkcnn.bench import kernels as bench
from lkcnn.bench.record import SCHEMA, command_line, load_record
from lkcnn.ops import use_conv_impl

# docs/performance.md's floors table: useful GFLOP per pass, % of dense, fp32 FMA floor of the 3 passes (ms), as printed.
PUBLISHED_FLOPS = {
    ("seed", 31): ("27.8", "57", "1.25"), ("s1", 31): ("36.7", "74", "1.64"), ("s2", 29): ("11.9", "55", "0.53"),
    ("s3", 27): ("2.5", "27", "0.11"), ("s4", 13): ("0.3", "29", "0.014"),
}


def _half_digit(printed: str) -> float:
    """Half a unit of the last printed digit: what rounding to that digit allows."""
    decimals = len(printed.partition(".")[2])
    return 0.5 * 10 ** -decimals


def fake_timer(calls: list | None = None):
    """Runs fn once (so the closures really execute on the CPU) and returns a random time in ms."""
    def timer(fn):
        out = fn()
        if calls is not None:
            calls.append(tuple(out.shape))
        return random.uniform(0.05, 20.0)
    return timer


def tiny_configs(dtypes=("fp32", "bf16")):
    nchw = (random.randint(1, 3), random.randint(2, 5), random.randint(3, 12), random.randint(3, 12))
    return [bench.Config("seed", nchw, k, d) for k in (3, 5, 9) for d in dtypes]  # c > 1: (c,1,k,k) is not a map


def test_in_bounds_taps_match_brute_force_count():
    for _ in range(20):
        h, w = random.randint(1, 20), random.randint(1, 20)
        k = random.choice(range(1, 2 * max(h, w) + 2, 2))  # odd, also larger than the map
        least = max(0, -(-(k - min(h, w)) // 2))  # padding that keeps at least one output position
        pad = random.choice([None, random.randint(least, k - 1)])
        p = k // 2 if pad is None else pad
        # every output sums its in-bounds taps: ones in, ones kernel, padded zeros
        brute = F.conv2d(torch.ones(1, 1, h, w, dtype=torch.float64), torch.ones(1, 1, k, k, dtype=torch.float64),
                         padding=p).sum().item()
        assert bench.in_bounds_taps(h, k, pad) * bench.in_bounds_taps(w, k, pad) == brute, (h, w, k, pad)


def test_useful_flops_count_nonzero_products():
    n, c, h, w = random.randint(1, 3), random.randint(1, 4), random.randint(2, 15), random.randint(2, 15)
    k = random.choice([3, 5, 7, 13, 31])
    # multiply-adds whose input is in bounds = taps where a ones input meets a ones kernel
    taps = F.conv2d(torch.ones(n, c, h, w, dtype=torch.float64), torch.ones(c, 1, k, k, dtype=torch.float64),
                    padding=k // 2, groups=c).sum().item()
    assert bench.useful_flops((n, c, h, w), k) == 2 * taps
    assert bench.useful_flops((n, c, h, w), k) <= 2 * n * c * h * w * k * k


@pytest.mark.parametrize("shape,k", list(PUBLISHED_FLOPS))
def test_flops_and_floors_reproduce_published_table(shape, k):
    gflop, dense_pct, floor_ms = PUBLISHED_FLOPS[(shape, k)]
    cfg = bench.Config(shape, bench.SHAPES[shape], k, "fp32")
    info = bench.describe(cfg)
    assert abs(info["useful_flop_per_pass"] / 1e9 - float(gflop)) <= _half_digit(gflop)
    assert abs(100 * info["dense_fraction"] - float(dense_pct)) <= _half_digit(dense_pct)
    fma = info["floor_ms"]["fma"]
    assert fma["total"] == pytest.approx(float(floor_ms), rel=0.01, abs=_half_digit(floor_ms))
    assert fma["total"] == pytest.approx(sum(fma[p] for p in bench.PASSES))
    half = bench.floors_ms(cfg.nchw, k, random.choice(["fp16", "bf16"]))
    assert half["fma"]["total"] == pytest.approx(fma["total"] / 2)  # packed HFMA2: twice the fp32 FMA rate
    assert half["memory"]["total"] < info["floor_ms"]["memory"]["total"]


def test_memory_floor_reproduces_published_s4():
    # docs/performance.md: s4 k13 fp32 memory floor for the three passes 0.026 ms
    assert bench.floors_ms(bench.SHAPES["s4"], 13, "fp32")["memory"]["total"] == pytest.approx(0.026, abs=5e-4)


def test_benchmark_set_is_the_anchor_files_set():
    data = json.loads(bench.DEFAULT_ANCHORS.read_text())
    assert data["schema"] == SCHEMA and data["kind"] == "anchors"
    anchored = {(e["shape"], tuple(e["nchw"]), e["k"], e["dtype"]) for e in data["rows"] if e["source"] == "pytorch"}
    ours = {(c.shape, c.nchw, c.k, c.dtype) for c in bench.select_configs()}
    assert ours == anchored
    device, anchors = bench.load_anchors(bench.DEFAULT_ANCHORS)
    assert "H100" in device
    mge = anchors[(bench.SHAPES["seed"], 31, "fp32")]["megengine"]
    assert set(mge) == set(bench.TOTAL_KEYS)
    assert mge["total"] == pytest.approx(sum(mge[p] for p in bench.PASSES), abs=0.01)
    assert all("megengine" not in a for (_, _, dtype), a in anchors.items() if dtype == "bf16")  # no bf16 path


def test_select_configs_quick_and_filters():
    quick = bench.select_configs(quick=True)
    assert {(c.shape, c.k) for c in quick} == {("seed", 9), ("seed", 31), ("s1", 31), ("s2", 29), ("s3", 27),
                                               ("s4", 13)}
    assert {c.dtype for c in quick} == set(bench.DTYPES)
    picked = bench.select_configs(["seed", "s1"], [31], ["bf16"])
    assert [(c.shape, c.k, c.dtype) for c in picked] == [("seed", 31, "bf16"), ("s1", 31, "bf16")]
    with pytest.raises(ValueError, match="unknown shape s9; choose from seed"):
        bench.select_configs(["s9"])
    with pytest.raises(ValueError, match="unknown dtype fp64"):
        bench.select_configs(dtypes=["fp64"])
    with pytest.raises(ValueError, match="no kernel size in \\[29\\].*seed: 3,5"):
        bench.select_configs(["seed"], [29])


def test_select_configs_takes_shapes_written_out():
    """A shape outside the set, NxCxHxW, is timed at the kernel sizes --ks names (the set's shapes at theirs)."""
    picked = bench.select_configs(["64x384x24x24", "seed"], [13, 9], ["fp32"])
    seed = bench.SHAPES["seed"]
    assert [(c.shape, c.nchw, c.k) for c in picked] == [
        ("64x384x24x24", (64, 384, 24, 24), 9), ("64x384x24x24", (64, 384, 24, 24), 13), ("seed", seed, 9),
        ("seed", seed, 13)]
    with pytest.raises(ValueError, match="needs --ks"):
        bench.select_configs(["8x4x17x17"])
    with pytest.raises(ValueError, match="must be odd"):
        bench.select_configs(["8x4x17x17"], [8])
    for bad in ("8x4x17", "8x0x17x17", "8x4x17xW"):
        with pytest.raises(ValueError, match=f"unknown shape {bad}; .* or NxCxHxW"):
            bench.select_configs([bad], [9])


def test_input_sets_rotate_past_l2():
    for _ in range(20):
        size = random.uniform(1e3, 2 * bench.L2_BYTES)
        n = bench.n_input_sets(size)
        if size >= bench.L2_BYTES:
            assert n == 1
        else:
            assert n == bench.MAX_INPUT_SETS or (n - 1) * size >= bench.L2_BYTES
    cfg = tiny_configs()[0]
    sets = bench.make_inputs(cfg, torch.device("cpu"))
    assert len(sets) == bench.n_input_sets(bench.pass_bytes(cfg.nchw, cfg.k, 4)) > 1
    assert not torch.equal(sets[0].x, sets[1].x)
    assert all(s.x.count_nonzero() > 0 and s.dy.count_nonzero() > 0 and s.w.count_nonzero() > 0 for s in sets)


def test_benchmark_json_schema_with_fake_timer():
    configs = tiny_configs()
    total = {p: random.uniform(1, 9) for p in bench.PASSES}
    anchors = {(configs[0].nchw, configs[0].k, "fp32"): {"megengine": {**total, "total": sum(total.values())}}}
    calls = []
    command = command_line(["--quick", "--dtypes", "fp32,bf16", "--json", "out dir/b.json"])
    report = bench.benchmark(configs, fake_timer(calls), "fake", torch.device("cpu"), anchors=anchors, command=command)
    report = json.loads(json.dumps(report))  # JSON-serializable as written

    assert (report["schema"], report["kind"]) == (SCHEMA, "kernels")
    env = report["environment"]
    assert {"gpu", "gpu_count", "driver", "torch", "cuda", "cudnn", "commit", "dirty", "date"} <= set(env)
    assert (env["gpu"], env["torch"]) == ("cpu", torch.__version__)
    git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=bench.ROOT)
    assert env["commit"] == (git.stdout.strip() if git.returncode == 0 else None)
    assert shlex.split(report["command"]) == ["python", "-m", "lkcnn.bench", "--quick", "--dtypes", "fp32,bf16",
                                              "--json", "out dir/b.json"]
    assert {"timer", "floors", "wall_s"} <= set(report["method"]) and report["method"]["timer"] == "fake"
    assert len(report["rows"]) == len(configs)
    assert len(calls) == len(configs) * 3 * (1 + len(bench.TORCH_VARIANTS))  # every pass of lkcnn and 4 variants
    for cfg in configs:  # 3 outputs per timed set of passes: two maps and one weight gradient
        weight_grads = calls.count((cfg.nchw[1], 1, cfg.k, cfg.k))
        assert weight_grads == sum(o.k == cfg.k for o in configs) * (1 + len(bench.TORCH_VARIANTS))
    assert calls.count(configs[0].nchw) == 2 * len(calls) // 3
    for cfg, r in zip(configs, report["rows"]):
        assert (r["shape"], tuple(r["nchw"]), r["k"], r["dtype"]) == (cfg.shape, cfg.nchw, cfg.k, cfg.dtype)
        lk = r["lkcnn"]
        assert set(lk) == set(bench.TOTAL_KEYS)
        assert lk["total"] == pytest.approx(sum(lk[p] for p in bench.PASSES))
        variants = r["torch"]["variants"]
        assert set(variants) == set(bench.TORCH_VARIANTS)
        best = min(variants, key=lambda v: variants[v]["total"])
        assert r["torch"]["best"] == best
        assert r["speedup_vs_torch"]["total"] == pytest.approx(variants[best]["total"] / lk["total"])
        assert r["speedup_vs_torch"]["bwd_weight"] == pytest.approx(variants[best]["bwd_weight"] / lk["bwd_weight"])
        fma = r["floor_ms"]["fma"]["total"]
        assert r["fraction_of_fma_floor"]["total"] == pytest.approx(fma / lk["total"])
        assert r["fraction_of_memory_floor"]["total"] == pytest.approx(r["floor_ms"]["memory"]["total"] / lk["total"])
        has_anchor = (cfg.nchw, cfg.k, cfg.dtype) in anchors
        assert (r["anchors"]["megengine"] is not None) == has_anchor
        if has_anchor:
            assert r["speedup_vs_megengine"]["total"] == pytest.approx(sum(total.values()) / lk["total"])
        else:
            assert r["speedup_vs_megengine"] is None


def test_channels_last_times_lkcnn_in_that_layout_and_pytorch_in_both():
    cl = torch.channels_last
    configs = bench.select_configs(["s4"], dtypes=["fp32"], quick=True, channels_last=True)
    assert [c.channels_last for c in configs] == [True]
    cfg = replace(configs[0], nchw=(2, 3, 7, 7))
    sets = bench.make_inputs(cfg, torch.device("cpu"))
    assert all(s.x.is_contiguous(memory_format=cl) and s.dy.is_contiguous(memory_format=cl) for s in sets)
    assert all(s.x.is_contiguous() for s in bench.in_layout(sets, channels_last=False))

    layouts = []

    def timer(fn):  # records the layout each timed pass saw
        out = fn()
        layouts.append(out.dim() == 4 and out.shape[2] > 1 and out.is_contiguous(memory_format=cl)
                       and not out.is_contiguous())
        return 1.0
    result = bench.bench_config(cfg, timer, torch.device("cpu"), True, {})
    assert result["lkcnn_layout"] == "channels_last"
    assert layouts[:2] == [True, True]  # lkcnn's forward and input gradient kept channels_last
    torch_forwards = layouts[3::3]  # PyTorch's forward keeps its input's layout
    assert torch_forwards == [cl_variant for _, cl_variant in bench.TORCH_VARIANTS.values()]
    assert bench.table_row(result)[0] == "s4 CL"


def test_failures_are_recorded_and_the_run_goes_on():
    configs = tiny_configs(dtypes=("fp32",))
    with use_conv_impl("cuda"):  # lkcnn's kernels cannot run on the CPU: each config must say so
        results = bench.run(configs, fake_timer(), torch.device("cpu"), log=lambda line: None)
    assert len(results) == len(configs)
    for r in results:
        assert "LKCNN_CONV_IMPL=cuda" in r["lkcnn"]["error"]
        assert r["torch"]["best"] in bench.TORCH_VARIANTS  # PyTorch still measured
        assert r["speedup_vs_torch"] is None and r["fraction_of_fma_floor"] is None
    table = bench.format_table(results).splitlines()
    assert all("lkcnn: ConvImplError" in line for line in table[3:])
    json.dumps(results)

    def broken(fn):
        raise RuntimeError("CUDA out of memory")
    with use_conv_impl("auto"):
        r = bench.run(configs[:1], broken, torch.device("cpu"), log=lambda line: None)[0]
    assert r["torch"]["best"] is None and r["lkcnn"]["error"] == "RuntimeError: CUDA out of memory"
    assert "torch: RuntimeError: CUDA out of memory" in bench.format_table([r])


def test_format_table_rows():
    configs = tiny_configs(dtypes=("fp16",))
    anchors = {(configs[1].nchw, configs[1].k, "fp16"): {"megengine": {"total": random.uniform(1, 9)}}}
    results = bench.run(configs, fake_timer(), torch.device("cpu"), anchors=anchors, log=lambda line: None)
    lines = bench.format_table(results).splitlines()
    assert lines[1].split() == list(bench.TABLE_HEADER) and set(lines[2]) == {"-"}
    assert len(lines) == 3 + len(results)
    for r, line in zip(results, lines[3:]):
        cells = line.split()
        lk, best = r["lkcnn"], r["torch"]["variants"][r["torch"]["best"]]
        assert cells[:3] == [r["shape"], str(r["k"]), r["dtype"]]
        assert [float(x) for x in cells[3:8]] == pytest.approx(  # 3 decimals below 10 ms, 1 above
            [lk[p] for p in bench.TOTAL_KEYS] + [best["total"]], rel=5.1e-3, abs=1e-3)
        assert cells[8] == f"{best['total'] / lk['total']:.2f}x"
        assert cells[-1] == f"{100 * r['floor_ms']['fma']['total'] / lk['total']:.1f}%"
        mge = r["anchors"]["megengine"]
        assert cells[9:11] == (["-", "-"] if mge is None else [bench._ms(mge["total"]),
                                                              f"{mge['total'] / lk['total']:.2f}x"])


def test_plot_writes_png(tmp_path):
    results = bench.run(tiny_configs(), fake_timer(), torch.device("cpu"), log=lambda line: None)
    path = tmp_path / "plots" / "seed.png"
    bench.plot(results, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="--shapes seed"):
        bench.plot([{**r, "shape": "s1"} for r in results], path)


def test_main_rejects_bad_flags_and_anchors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--shapes", "seed,s9"])
    assert exc.value.code == 2 and "unknown shape s9; choose from" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="anchors file .* not found; pass --anchors PATH"):
        bench.main(["--anchors", str(tmp_path / "missing.json")])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"pytorch": [{"shape": "seed"}]}))
    with pytest.raises(SystemExit, match="is not an lkcnn anchors record"):
        bench.main(["--anchors", str(bad)])


def test_module_without_gpu_exits_with_clear_message(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "lkcnn.bench", "--json", str(tmp_path / "b.json")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode != 0
    assert "no CUDA device is visible" in proc.stderr and "never times on the CPU" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "b.json").exists()


def test_pytorch_backend_switches_and_restores_cudnn():
    before = (torch.backends.cudnn.enabled, torch.backends.cudnn.benchmark)
    with bench.pytorch_backend(True):
        assert torch.backends.cudnn.enabled and torch.backends.cudnn.benchmark
        if bench.cudnn_depthwise_mode():  # torch >= 2.14: cuDNN must really run the depthwise conv
            assert torch.backends.cudnn.depthwise_kernel == "cudnn"
    with bench.pytorch_backend(False):
        assert not torch.backends.cudnn.enabled
    assert (torch.backends.cudnn.enabled, torch.backends.cudnn.benchmark) == before


def test_anchors_read_both_formats_alike(tmp_path):
    """The record's rows and the pre-schema lists (<source>_<pass>_ms names) give the same anchors."""
    device, anchors = bench.load_anchors(bench.DEFAULT_ANCHORS)
    rows = json.loads(bench.DEFAULT_ANCHORS.read_text())["rows"]
    legacy = {"device": "H100", "pytorch": [], "megengine": []}
    for row in rows:
        entry = {k: v for k, v in row.items() if k != "source" and not k.endswith("_ms")}
        entry.update({f"{row['source']}_{k}": v for k, v in row.items() if k.endswith("_ms")})
        legacy[row["source"]].append(entry)
    path = tmp_path / "legacy.json"
    path.write_text(json.dumps(legacy))
    assert bench.load_anchors(path) == ("H100", anchors)
    assert "2.11" in device and len(anchors) == len({(tuple(r["nchw"]), r["k"], r["dtype"]) for r in rows})


def test_record_round_trip_and_legacy_format(tmp_path):
    configs = tiny_configs()
    report = bench.benchmark(configs, fake_timer(), "fake", torch.device("cpu"), command=command_line([]))
    path = tmp_path / "record.json"
    path.write_text(json.dumps(report))
    assert load_record(path) == json.loads(json.dumps(report))
    legacy = {"meta": {"device": "NVIDIA H100", "torch": "2.11", "cuda": "13.0", "date": "2026-01-01",
                       "timer": "fake", "argv": ["/x/lkcnn/bench.py", "--quick"]}, "results": report["rows"]}
    path.write_text(json.dumps(legacy))
    record = load_record(path)
    assert record["environment"]["gpu"] == "NVIDIA H100" and record["command"] == "python -m lkcnn.bench --quick"
    assert record["method"] == {"timer": "fake"} and record["rows"] == legacy["results"]
    path.write_text(json.dumps({"images_per_s": 1.0}))
    with pytest.raises(ValueError, match="not an lkcnn benchmark record"):
        load_record(path)


def test_gpu_state_names_the_physical_gpu_and_its_limits(monkeypatch):
    """A record tells machines of one kind apart: the GPU's UUID, power limit and top clocks, asked of nvidia-smi for
    the device that ran (by its UUID); nothing is invented where nvidia-smi is missing or answers N/A."""
    from types import SimpleNamespace

    from lkcnn.bench import record as rec
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(uuid="1234-abcd"))
    asked = []

    def smi(args):
        asked.append(list(args))
        return "580.159.04, GPU-1234-abcd, 700.00, 1980, [N/A]" if args[0] == "nvidia-smi" else None
    monkeypatch.setattr(rec, "_run_quietly", smi)
    state = rec.gpu_state(torch.device("cuda", 0))
    assert asked[0][:3] == ["nvidia-smi", "-i", "GPU-1234-abcd"]
    assert state == {"driver": "580.159.04", "gpu_uuid": "GPU-1234-abcd", "gpu_power_limit_w": 700.0,
                     "gpu_max_sm_clock_mhz": 1980.0, "gpu_max_mem_clock_mhz": None}
    monkeypatch.setattr(rec, "_run_quietly", lambda args: None)
    assert rec.gpu_state(torch.device("cuda", 0)) == {}
    assert rec.gpu_state(torch.device("cpu")) == {}
    assert rec.environment(torch.device("cpu"))["driver"] is None


def test_committed_kernel_record_is_current_schema():
    """benchmarks/h100_kernels.json (what the README and the notebook read) loads and holds the quick set's rows."""
    record = load_record(bench.ROOT / "benchmarks" / "h100_kernels.json")
    assert record["schema"] == SCHEMA and "H100" in record["environment"]["gpu"]
    assert len(record["environment"]["commit"]) == 40 and record["command"].startswith("python -m lkcnn.bench")
    for row in record["rows"]:
        assert row["lkcnn"]["total"] == pytest.approx(sum(row["lkcnn"][p] for p in bench.PASSES), rel=1e-6)
        assert row["speedup_vs_torch"]["total"] > 1


def test_every_committed_record_follows_the_documented_schema():
    """Each benchmarks/*.json has every key benchmarks/README.md's schema table gives, a kind that table lists, and
    is listed in that README: what the docs cite can be read the documented way."""
    readme = (bench.ROOT / "benchmarks" / "README.md").read_text()
    kinds_line = next(line for line in readme.splitlines() if line.startswith("| `kind` |"))
    kinds = set(re.findall(r"`(\w+)`", kinds_line.split("|")[2]))
    records = sorted((bench.ROOT / "benchmarks").glob("*.json"))
    assert records
    for path in records:
        data = json.loads(path.read_text())
        assert data.keys() >= {"schema", "kind", "environment", "command", "method", "rows"}, path.name
        assert data["schema"] == SCHEMA and data["kind"] in kinds, path.name
        assert f"`{path.name}`" in readme, path.name


def test_the_default_benchmarks_help_names_every_other_benchmark():
    from lkcnn.bench.__main__ import COMMANDS
    epilog = bench._parser().epilog
    assert [c for c in COMMANDS if c != "kernels" and f" {c} (" not in epilog] == []


@pytest.mark.parametrize("command", ["branches", "blocks", "e2e", "rates", "loader", "app", "deploy8", "codegen"])
def test_subcommands_answer_help(command):
    proc = subprocess.run([sys.executable, "-m", "lkcnn.bench", command, "--help"], capture_output=True, text=True,
                          timeout=120, cwd=bench.ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"usage: lkcnn-bench {command} ")
    assert f"python -m lkcnn.bench {command}" in proc.stdout  # the usage examples of its docstring
