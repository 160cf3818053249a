"""lkcnn.bench.e2e's comparison on the CPU: kernel names land in the right cost category, and the comparison's
ratios and table come from the variants' reports (the GPU timings themselves are faked here)."""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import pytest
import timm
import torch
from timm.layers.grn import GlobalResponseNorm

from lkcnn.bench import e2e
from lkcnn.layers import ReparamLargeKernelConv
from lkcnn.bench.profile import OTHER, category

# kernel names as torch.profiler reports them in a compiled RepLKNet-31B step on an H100
NAMES = {
    "void lkcnn::(anonymous namespace)::dwconv_fwd_tc_kernel<__nv_bfloat16, 31, 4>(Params)": "lkcnn large-kernel conv",
    # the 8-bit one of lkcnn.ops.dwconv8, as demangled from csrc/dwconv8/dwconv8_fwd.cu
    "void lkcnn::(anonymous namespace)::dwconv8_fwd_kernel<true, 4, (lkcnn::(anonymous namespace)::Out)0>(Args)":
        "lkcnn large-kernel conv, 8-bit",
    # the small-branch kernels as demangled from csrc/dwconv/dwconv_branches.cu's anonymous namespace
    "void lkcnn::(anonymous namespace)::branches_conv_kernel<c10::BFloat16, false>(...)": "lkcnn small-branch conv",
    "_grn_grad_sums_kernel": "lkcnn GELU + GRN",
    "_bn_stats_kernel": "lkcnn BatchNorm + GELU",
    "_bn_gelu_grad_apply_kernel": "lkcnn BatchNorm + GELU",
    "void lkcnn::(anonymous namespace)::branches_wgrad_kernel<c10::BFloat16>(...)": "lkcnn small-branch conv",
    # and the tensor-core one of csrc/dwconv/dwconv_branches_tc.cu
    "void lkcnn::(anonymous namespace)::branch_tc_kernel<c10::BFloat16, 5, false>(...)": "lkcnn small-branch conv",
    "void lkcnn::(anonymous namespace)::transpose_kernel<__nv_bfloat16, 8>(...)": "lkcnn layout copies",
    "void conv2d_c1_k1_nhwc_kernel<__nv_bfloat16, 5, 5>(...)": "cuDNN depthwise conv",
    "void wgrad2d_c1_k1_nhwc_kernel<float, 5>(...)": "cuDNN depthwise conv",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>(...)": "optimizer",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1": "GEMM (1x1 convs, head)",
    "nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NTT": "GEMM (1x1 convs, head)",
    # the 8-bit GEMMs: the first two as a profiled H100 run named them (torch._int_mm, torch._scaled_mm row-wise),
    # the others as cuBLASLt, CUTLASS and inductor form such names
    "void cutlass::Kernel2<cutlass_80_tensorop_i16832gemm_s8_128x64_128x3_tn_align16>(...)": "8-bit GEMM (INT8 / FP8)",
    "nvjet_sm90_qqtst_128x128_128x6_1x1_h_bz_coopA_algo2_ovscale_TNT": "8-bit GEMM (INT8 / FP8)",
    "sm80_xmma_gemm_i8i32_i8i32_i32_tn_n_tilesize128x128x64_stage3_warpsize2x2x1": "8-bit GEMM (INT8 / FP8)",
    "void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cute::tuple<int, int, int>, "
    "cutlass::gemm::collective::CollectiveMma<..., cutlass::float_e4m3_t, ...>>>(...)": "8-bit GEMM (INT8 / FP8)",
    "triton_tem_fused__int_mm_mul_3": "8-bit GEMM (INT8 / FP8)",
    "_gemm8_kernel": "8-bit GEMM (INT8 / FP8)",  # lkcnn's own (lkcnn.ops.gemm8), named as Triton names a kernel
    "_gemm8_tma_kernel": "8-bit GEMM (INT8 / FP8)",
    "nvjet_sm90_qqtst_128x128_128x6_1x1_h_bz_coopA_algo2_ovscale_gelubias_TNT": "8-bit GEMM (INT8 / FP8)",  # gemm8_lt
    # inductor's pass that quantizes lkcnn.gemm8_lt's output is named after the op, and stays elementwise
    "triton_poi_fused__native_batch_norm_legit_no_training__to_copy_clamp_div_gemm8_lt_permute_view_25":
        "inductor fused (norms, activations, adds)",
    "triton_tem_fused__scaled_mm_add_gelu_1": "8-bit GEMM (INT8 / FP8)",
    "triton_tem_fused__native_batch_norm_legit_no_training__scaled_mm_gelu_4": "8-bit GEMM (INT8 / FP8)",
    # an elementwise kernel that quantizes a _scaled_mm's input is named after it too, and stays elementwise
    "triton_poi_fused__native_batch_norm_legit_no_training__scaled_mm__to_copy_clamp_gelu_30":
        "inductor fused (norms, activations, adds)",
    "triton_tem_fused_convolution_mm_relu_2": "GEMM (1x1 convs, head)",
    "triton_per_fused__native_batch_norm_legit_functional_relu_3": "inductor fused (norms, activations, adds)",
    "void at::native::elementwise_kernel<128, 2>(...)": OTHER,
}


@pytest.mark.parametrize("name,expected", NAMES.items())
def test_kernel_names_fall_in_their_category(name, expected):
    assert category(name) == expected


def test_compare_rows_carry_ratios_to_the_peer_and_the_3x3_twin(monkeypatch, capsys):
    speeds = {("replknet31b", False): 1200.0, ("replknet31b", True): 1500.0, ("convnext_base", False): 1600.0}
    calls = []

    def fake_report(name, impl, *, channels_last, on_timed, **kwargs):
        twin = kwargs.get("kernel_sizes") == 3
        calls.append((name, impl, twin, channels_last, kwargs.get("compile")))
        timed = {"images_per_s": speeds[(name, twin)], "step_ms": 64e3 / speeds[(name, twin)], "first_step_s": 90.0}
        on_timed(timed)  # before the profile: a run stopped while profiling has printed its images/s
        print(f"profiled {name}", file=sys.stderr)
        return {**timed, "gpu_busy_ms": 30.0,
                "gpu_ms_by_category": {"GEMM (1x1 convs, head)": 10.0, **({} if twin else {"optimizer": 1.0})}}

    monkeypatch.setattr(e2e, "step_report", fake_report)
    saved = []  # --json's record, rewritten after each network: a run stopped at a time limit keeps its rows
    rows = e2e.compare(["replknet31b"], "convnext_base", batch=64, steps=2, warmup=1, compile="reduce-overhead",
                       on_rows=lambda rows: saved.append([(r["network"], r["ratio_to_convnext_base"],
                                                           r.get("ratio_to_3x3")) for r in rows]))
    assert [r["network"] for r in rows] == ["replknet31b", "replknet31b 3x3", "convnext_base"]
    assert saved == [[("convnext_base", 1.0, None)],
                     [("replknet31b", 0.75, None), ("convnext_base", 1.0, None)],
                     [("replknet31b", 0.75, pytest.approx(0.8)), ("replknet31b 3x3", 0.9375, None),
                      ("convnext_base", 1.0, None)]]
    # the peer first: every later progress line has its ratio, also where a time limit stops the run
    # the twin under the default dispatch too: its FFN's BatchNorm + GELU on lkcnn's kernels like the network's
    assert calls == [("convnext_base", "torch", False, True, "reduce-overhead"),
                     ("replknet31b", "auto", False, True, "reduce-overhead"),
                     ("replknet31b", "auto", True, True, "reduce-overhead")]
    err = capsys.readouterr().err
    line = "replknet31b: 1200.0 images/s (0.75x convnext_base), first step 90.0 s"
    assert line in err and err.index(line) < err.index("profiled replknet31b")
    # each network's start and the end of its profile, with the seconds since the start: where a stopped run's time went
    lines = [text.split("]: ", 1)[1] for text in err.splitlines() if text.startswith("lkcnn-bench e2e [")]
    assert lines[:3] == ["convnext_base: building and compiling",
                         "convnext_base: 1600.0 images/s, first step 90.0 s", "convnext_base: profiled"]
    assert lines[3:6] == ["replknet31b: building and compiling", line, "replknet31b: profiled"]
    assert rows[0]["ratio_to_convnext_base"] == pytest.approx(0.75) and rows[0]["ratio_to_3x3"] == pytest.approx(0.8)
    assert "ratio_to_3x3" not in rows[1] and rows[2]["ratio_to_convnext_base"] == 1.0
    args = argparse.Namespace(compare="convnext_base", batch=64, compile="reduce-overhead", channels_last=True,
                              cuda_graph=False)
    monkeypatch.setattr(e2e.torch.cuda, "get_device_name", lambda: "NVIDIA H100")
    text = e2e.compare_table(rows, args)
    assert "0.75x" in text and "0.80x" in text and "compiled (reduce-overhead), channels_last, NVIDIA H100" in text
    optimizer = next(line for line in text.splitlines() if line.startswith("optimizer"))
    assert optimizer.split()[1:] == ["1.00", "-", "1.00"]  # the 3x3 twin's report has no optimizer kernel


def test_the_kernel_switch_variants_turn_only_their_kernels_off(monkeypatch):
    """`--runs auto,auto_cudnn_small,auto_torch_grn,auto_torch_bn_gelu` are the branch kernels', the GELU + GRN
    kernels' and the BatchNorm + GELU kernels' A/Bs: the same conv policy, one kind of kernel off."""
    calls = []

    class Built(Exception):
        pass

    monkeypatch.setattr(e2e, "set_conv_impl", lambda impl: calls.append(("conv", impl)))
    monkeypatch.setattr(e2e, "set_branch_kernels", lambda on: calls.append(("branches", on)))
    monkeypatch.setattr(e2e, "set_grn_kernels", lambda on: calls.append(("grn", on)))
    monkeypatch.setattr(e2e, "set_bn_gelu_kernels", lambda on: calls.append(("bn_gelu", on)))
    monkeypatch.setattr(e2e.timm, "create_model", lambda *a, **k: (_ for _ in ()).throw(Built()))
    jobs = e2e.jobs(["unireplknet_b"], ["auto", "auto_cudnn_small", "auto_torch_grn", "auto_torch_bn_gelu"])
    for model, impl, kwargs in jobs.values():
        with pytest.raises(Built):
            e2e.setup(model, impl, batch=2, channels_last=True, compile=None, **kwargs)
    on = [("branches", True), ("grn", True), ("bn_gelu", True)]
    assert calls == [("conv", "auto"), *on, ("conv", "auto"), ("branches", False), *on[1:],
                     ("conv", "auto"), on[0], ("grn", False), on[2], ("conv", "auto"), *on[:2], ("bn_gelu", False)]


def test_inductor_settings_reach_the_compile_and_the_record(monkeypatch, capsys):
    """`--inductor` (an A/B of an inductor setting on whole networks): parsed, handed to lkcnn.compile over lkcnn's
    settings, named in the step's regime; a setting inductor lacks ends in one line."""
    seen = []

    class Compiled(Exception):
        pass

    def fake_compile(model, mode, settings=None, regional=False):
        seen.append((mode, settings, regional))
        raise Compiled
    monkeypatch.setattr(e2e.timm, "create_model", lambda *a, **k: torch.nn.Linear(2, 2))
    monkeypatch.setattr(torch.nn.Module, "cuda", lambda self, *a, **k: self)
    monkeypatch.setattr(e2e, "compile_model", fake_compile)
    with pytest.raises(Compiled):
        e2e.setup("replknet31b", "auto", batch=2, channels_last=True, compile="reduce-overhead",
                  inductor={"combo_kernels": True})
    with pytest.raises(Compiled):
        e2e.setup("replknet31b", "auto", batch=2, channels_last=True, compile="reduce-overhead", regional=True)
    assert seen == [("reduce-overhead", {"combo_kernels": True}, False), ("reduce-overhead", None, True)]
    args = argparse.Namespace(compile="reduce-overhead", channels_last=True, cuda_graph=False,
                              inductor={"combo_kernels": True})
    assert e2e.regime(args) == "compiled (reduce-overhead, combo_kernels=True), channels_last"
    args.regional = True
    assert e2e.regime(args) == "compiled (reduce-overhead, block by block, combo_kernels=True), channels_last"
    with pytest.raises(SystemExit):
        e2e.main(["--compile", "--inductor", "combo_kernel=True"])
    err = capsys.readouterr().err
    assert "--inductor: torch" in err and "no inductor setting 'combo_kernel'" in err and "Traceback" not in err
    with pytest.raises(SystemExit):
        e2e.main(["--regional"])
    err = capsys.readouterr().err
    assert "--regional is a way to compile: give it with --compile or --compare" in err and "Traceback" not in err


def test_each_variant_reports_as_it_finishes(monkeypatch, capsys):
    """A compiled variant takes minutes: its images/s is printed when it finishes, so a later variant that fails (or
    a GPU call's time limit) does not take the earlier results with it."""
    speeds = iter([(1200.0, 95.0), (300.0, 4.25)])

    def fake_run_variant(model, impl, **kwargs):
        if impl == "cuda3":
            raise RuntimeError("the third variant fails")
        return next(speeds)

    monkeypatch.setattr(e2e, "run_variant", fake_run_variant)
    variants = {"net: a": ("net", "auto", {}), "net: b": ("net", "torch", {}), "net: c": ("net", "cuda3", {})}
    saved = []  # main's --json record, rewritten after each variant from what has been measured so far
    monkeypatch.setattr(e2e, "make_record", lambda kind, device, command, method, rows: rows)
    monkeypatch.setattr(e2e.timm, "create_model", lambda *a, **k: torch.nn.Linear(2, 2))
    args = argparse.Namespace(batch=2, compile="reduce-overhead", channels_last=True, cuda_graph=False, inductor={})
    with pytest.raises(RuntimeError, match="third variant"):
        e2e.measure(variants, 1, batch=2, steps=1, warmup=1,
                    on_variant=lambda s, f: saved.append(e2e.record(s, f, variants, args, [])))
    err = [line.split("]: ", 1)[1] for line in capsys.readouterr().err.splitlines()]
    assert err == ["net: a: 1200.0 images/s, first step 95.0 s", "net: b: 300.0 images/s, first step 4.2 s"]
    assert [[(row["variant"], row["images_per_s"], row["ratio_to_first"]) for row in rows] for rows in saved] == \
        [[("a", 1200.0, 1.0)], [("a", 1200.0, 1.0), ("b", 300.0, 0.25)]]
    speeds = iter([(1200.0, 95.0), (300.0, 4.25)])
    samples, first_steps = e2e.measure({"net: a": ("net", "auto", {}), "net: b": ("net", "torch", {})}, 1,
                                       batch=2, steps=1, warmup=1)
    assert samples == {"net: a": [1200.0], "net: b": [300.0]} and first_steps == {"net: a": [95.0], "net: b": [4.25]}


def test_the_first_step_is_timed_apart_and_counts_as_warm_up():
    """A compiled variant compiles in its first step: that step's seconds are reported on their own (what a setting
    costs at compile time) and it is one of the `warmup` steps, so the timed steps are the same as before."""
    calls = []

    def step():
        calls.append(None)
        if len(calls) == 1:
            time.sleep(0.05)
    timed = e2e.time_steps(step, batch=8, steps=3, warmup=2)
    assert len(calls) == 2 + 3
    assert timed["first_step_s"] >= 0.05
    assert timed["images_per_s"] == pytest.approx(8 / timed["step_ms"] * 1e3)


class _Stem(torch.nn.Module):
    """An image (1, 3, 8, 8) -> 4 channels, then `body`."""

    def __init__(self, *body: torch.nn.Module) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 4, 1)
        self.body = torch.nn.Sequential(*body)

    def forward(self, x):
        return self.body(self.stem(x))


def test_norm_floor_counts_each_kind_and_fuses_activations_beside_a_norm():
    s = 4 * 8 * 8 * 2 * 10 / 1e9  # one layer's output: 4 channels of 8x8, 2 bytes, batch 10
    floor = e2e.norm_floor_gb(_Stem(torch.nn.BatchNorm2d(4), torch.nn.ReLU()), batch=10, image=8)
    assert floor == pytest.approx({"BatchNorm": 8 * s})  # the ReLU after the BatchNorm is part of its apply
    gemm_gelu = _Stem(torch.nn.Conv2d(4, 4, 1), torch.nn.GELU(), torch.nn.Conv2d(4, 4, 1), torch.nn.GELU(),
                      timm.layers.LayerNorm2d(4))
    # the first GELU sits between two convolutions; the second feeds a norm, whose passes take it
    assert e2e.norm_floor_gb(gemm_gelu, batch=10, image=8) == pytest.approx({"activation": 5 * s, "LayerNorm": 5 * s})


def test_norm_floor_counts_a_last_activation_and_norm_modules_with_children():
    s = 4 * 8 * 8 * 2 * 10 / 1e9
    assert e2e.norm_floor_gb(_Stem(torch.nn.GELU()), batch=10, image=8) == pytest.approx({"activation": 5 * s})
    # timm's BatchNorm with its activation as a child: one BatchNorm; a Dropout between a norm and its activation
    # moves nothing; timm's GRN (after a GELU, which its passes take in) counts as a BatchNorm does
    bn_act = _Stem(timm.layers.BatchNormAct2d(4), torch.nn.Dropout(0.0), torch.nn.ReLU())
    assert e2e.norm_floor_gb(bn_act, batch=10, image=8) == pytest.approx({"BatchNorm": 8 * s})
    grn = _Stem(torch.nn.GELU(), GlobalResponseNorm(4, channels_last=False))
    assert e2e.norm_floor_gb(grn, batch=10, image=8) == pytest.approx({"GRN": 8 * s})


def test_norm_floor_leaves_the_model_as_it_was_under_any_conv_policy(monkeypatch):
    monkeypatch.setenv("LKCNN_CONV_IMPL", "cuda")  # the floor's forward runs on the CPU, on PyTorch's convolutions
    model = _Stem(ReparamLargeKernelConv(4, 7, small_kernel=3), torch.nn.BatchNorm2d(4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert e2e.norm_floor_gb(model, batch=2, image=8)
    assert model.training and all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_norm_floor_lets_a_blocks_summed_branch_norms_share_their_apply():
    s = 8 * 16 * 16 * 2 * 3 / 1e9
    block = ReparamLargeKernelConv(8, 7, small_kernel=3)  # large and small branch, two BatchNorms summed
    model = _Stem()
    model.stem, model.body = torch.nn.Conv2d(3, 8, 1), torch.nn.Sequential(block, torch.nn.ReLU())
    assert e2e.norm_floor_gb(model, batch=3, image=16) == pytest.approx({"BatchNorm": (5 * 2 + 3) * s})


def test_compare_table_prints_the_norm_floor_at_the_measured_bandwidth(monkeypatch):
    monkeypatch.setattr(e2e.torch.cuda, "get_device_name", lambda: "NVIDIA H100")
    row = {"network": "replknet31b", "images_per_s": 1000.0, "ratio_to_convnext_base": 1.0, "step_ms": 64.0,
           "gpu_busy_ms": 50.0, "gpu_ms_by_category": {"optimizer": 1.0}, "norm_floor_gb": {"BatchNorm": 30.0}}
    args = argparse.Namespace(compare="convnext_base", batch=64, compile="reduce-overhead", channels_last=True,
                              cuda_graph=False, copy_gbps=3000.0)
    line = next(ln for ln in e2e.compare_table([row], args).splitlines() if ln.startswith("norm/activation floor"))
    assert "(3.0 TB/s)" in line and line.split()[-1] == "10.00"  # 30 GB at 3000 GB/s


MODELS, RUNS = ["convnext_base", "replknet31b", "unireplknet_b"], ["auto", "torch", "auto3"]


def test_each_variant_has_selectors_that_pick_it_alone():
    """--warm-cache and --isolate start one process per variant with `--models M --runs K`: each label's selectors
    must pick exactly that variant (a peer once, whatever the key; RepLKNet's 3x3 twin only for RepLKNet)."""
    everything = e2e.jobs(MODELS, RUNS)
    selectors = e2e.variant_selectors(MODELS, RUNS)
    assert list(selectors) == list(everything)
    for label, (model, key) in selectors.items():
        assert e2e.jobs([model], [key]) == {label: everything[label]}


def test_a_variant_process_runs_in_this_runs_regime():
    """The child's command line parses back to the parent's batch, compile mode, layout, graph and inductor settings."""
    for regional in (False, True):
        args = argparse.Namespace(batch=48, compile="default", channels_last=True, cuda_graph=False, regional=regional)
        argv = e2e.variant_argv(args, "combo_kernels=False", "unireplknet_b", "torch", steps=7, warmup=3)
        assert argv[:4] == [sys.executable, "-m", "lkcnn.bench", "e2e"]
        child = e2e._parser().parse_args(argv[4:])
        assert (child.models, child.runs, child.batch, child.steps, child.warmup) == \
            (["unireplknet_b"], ["torch"], 48, 7, 3)
        assert (child.compile, child.channels_last, child.cuda_graph, child.inductor, child.regional) == \
            ("default", True, False, "combo_kernels=False", regional)


class FakeProcess:
    """subprocess.run / Popen for lkcnn.bench e2e children: writes the record a child would (its --json) with the
    images/s that `speeds` gives its --models/--runs, and exits with `codes`' status for them (0 by default)."""
    speeds: dict[tuple[str, str], float] = {}
    codes: dict[tuple[str, str], int] = {}
    started: list[list[str]] = []

    def __init__(self, argv, **kwargs):
        FakeProcess.started.append(argv)
        child = e2e._parser().parse_args(argv[4:])
        selector = (child.models[0], child.runs[0])
        self.returncode, self.stdout = self.codes.get(selector, 0), f"child {selector} output\n"
        if child.json and not self.returncode:
            rows = [{"images_per_s": self.speeds[selector], "first_step_s": [float(len(self.started))]}]
            with open(child.json, "w") as f:
                json.dump({"rows": rows}, f)

    def wait(self):
        return self.returncode


def test_isolate_times_each_variant_in_a_process_of_its_own(monkeypatch, capsys):
    """--isolate: every variant's images/s comes from its own child process, in order; a child that fails ends the
    run in one line naming the variant, after its output."""
    monkeypatch.setattr(FakeProcess, "started", [])
    monkeypatch.setattr(FakeProcess, "speeds", {("convnext_base", "torch"): 1880.0, ("unireplknet_b", "auto"): 1496.0,
                                                ("unireplknet_b", "torch"): 335.0})
    monkeypatch.setattr(e2e.subprocess, "run", FakeProcess)
    args = argparse.Namespace(models=["convnext_base", "unireplknet_b"], runs=["auto", "torch"], batch=64, steps=30,
                              warmup=6, compile="reduce-overhead", channels_last=True, cuda_graph=False,
                              regional=False)
    variants, selectors = e2e.jobs(args.models, args.runs), e2e.variant_selectors(args.models, args.runs)
    samples, first_steps = e2e.measure(variants, 1, isolated=functools.partial(e2e.run_isolated, args, "", selectors))
    assert list(samples.values()) == [[1880.0], [1496.0], [335.0]]
    assert list(first_steps.values()) == [[1.0], [2.0], [3.0]]
    assert [argv[argv.index("--models") + 1:argv.index("--runs") + 2] for argv in FakeProcess.started] == [
        ["convnext_base", "--runs", "torch"], ["unireplknet_b", "--runs", "auto"], ["unireplknet_b", "--runs", "torch"]]
    monkeypatch.setattr(FakeProcess, "codes", {("unireplknet_b", "torch"): 1})
    with pytest.raises(SystemExit) as exc:
        e2e.measure(variants, 1, isolated=functools.partial(e2e.run_isolated, args, "", selectors))
    assert str(exc.value) == ("lkcnn-bench e2e --isolate: unireplknet_b: PyTorch conv failed (exit 1; its output ends "
                              "above)")
    assert "child ('unireplknet_b', 'torch') output" in capsys.readouterr().err


def test_warm_cache_compiles_every_variant_at_once_and_names_the_ones_that_fail(monkeypatch, capsys, tmp_path):
    """--warm-cache starts one two-step child per variant before waiting on any, and a failed compile ends the run in
    one line after that child's output."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(FakeProcess, "started", [])
    monkeypatch.setattr(e2e.subprocess, "Popen", FakeProcess)
    args = argparse.Namespace(models=MODELS, runs=["auto", "torch"], batch=64, compile="reduce-overhead",
                              channels_last=True, cuda_graph=False, regional=False)
    e2e.warm_cache(args, "", e2e.variant_selectors(args.models, args.runs))
    assert len(FakeProcess.started) == 5 and all(argv[argv.index("--steps") + 1] == "1" for argv in FakeProcess.started)
    monkeypatch.setattr(FakeProcess, "codes", {("replknet31b", "torch"): 1})
    with pytest.raises(SystemExit) as exc:
        e2e.warm_cache(args, "", e2e.variant_selectors(args.models, args.runs))
    assert str(exc.value) == "lkcnn-bench e2e --warm-cache: 1 of 5 variants failed to compile (above)"
    assert "compiling replknet31b: PyTorch conv failed" in capsys.readouterr().err


def test_warm_cache_drops_only_the_launch_picks_it_made(monkeypatch, tmp_path):
    """The launch configurations that inductor picked while the variants compiled side by side are deleted, so each
    timed run picks its own alone; picks from before the warm-up and the compiled code stay."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    (tmp_path / "ab").mkdir()
    old, new, code = tmp_path / "ab" / "old.best_config", tmp_path / "ab" / "new.best_config", tmp_path / "ab" / "k.py"
    for path in (old, new, code):
        path.write_text("{}")
    started = time.time()
    os.utime(old, (started - 60, started - 60))
    os.utime(new, (started + 1, started + 1))
    assert e2e.drop_launch_picks(since=started) == 1
    assert old.exists() and code.exists() and not new.exists()
