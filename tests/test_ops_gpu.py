"""GPU correctness of lkcnn's CUDA kernels against a float64 reference (run on the GPU machine; skipped elsewhere).

Inputs are fresh random tensors each run (the seed is printed on failure), outputs are poisoned with NaN before
every kernel launch (LKCNN_DEBUG_POISON) so an unwritten element fails, and errors are relative norms.
"""
from __future__ import annotations

import random
import warnings

import pytest
import torch
import torch.nn.functional as F

from lkcnn.layers import LargeKernelConv
from lkcnn.ops import build, dwconv2d, use_conv_impl

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
DTYPES = list(TOL)
LAYOUTS = ["nchw", "channels_last", "strided"]
# Square and rectangular (SLaK 51x5 / 5x51) kernels, from pointwise to the largest supported.
KERNELS = [(1, 1), (3, 3), (5, 5), (7, 7), (9, 3), (13, 13), (27, 27), (29, 29), (31, 31), (51, 5), (5, 51), (63, 63)]


@pytest.fixture(autouse=True)
def _cuda_only(monkeypatch):
    monkeypatch.setenv("LKCNN_DEBUG_POISON", "1")
    with use_conv_impl("cuda"):
        yield


def _layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "channels_last":
        return t.contiguous(memory_format=torch.channels_last)
    if layout == "strided":  # a non-contiguous view: every other column of a wider tensor
        wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device).normal_()
        wide[..., ::2] = t
        return wide[..., ::2]
    if layout == "column_stride":  # a map one column wide whose column stride is not 1, contiguous to PyTorch
        t = t.contiguous()
        return t.as_strided(t.shape, (*t.stride()[:3], 7))
    if layout == "offset":  # contiguous, but its storage starts one element in: pointers not 16-byte aligned
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        buf[1:].copy_(t.flatten())
        return buf[1:].view(t.shape)
    return t.contiguous()


def rel_err(out: torch.Tensor, ref: torch.Tensor, scale: float = 1e-30) -> float:
    """||out - ref|| / max(||ref||, scale)."""
    assert not torch.isnan(out).any(), "output has NaNs: some element was never written"
    return ((out.double() - ref).norm() / max(ref.norm().item(), scale)).item()


def check_case(n, c, h, w, kh, kw, dtype, layout, bias=True, seed=None):
    seed = random.randrange(2**31) if seed is None else seed
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    x = _layout(torch.randn(n, c, h, w, device=dev, generator=gen).to(dtype), layout)
    wt = (torch.randn(c, 1, kh, kw, device=dev, generator=gen) / (kh * kw) ** 0.5).to(dtype)
    b = torch.randn(c, device=dev, generator=gen).to(dtype) if bias else None
    dy = _layout(torch.randn(n, c, h, w, device=dev, generator=gen).to(dtype), layout)

    what = f"seed={seed} shape={(n, c, h, w)} k={kh}x{kw} {dtype} {layout} bias={bias}"
    xs, ws = x.detach().requires_grad_(), wt.detach().requires_grad_()
    bs = b.detach().requires_grad_() if bias else None
    try:
        y = dwconv2d(xs, ws, bs)
        y.backward(dy)
        torch.cuda.synchronize()
    except RuntimeError as err:  # a failed launch must name the case (random draws are not repeated)
        raise AssertionError(f"lkcnn failed on {what}: {err}") from err

    def reference(xd, wd, bd, dyd):
        xd, wd = xd.requires_grad_(), wd.requires_grad_()
        bd = bd.requires_grad_() if bias else None
        yd = F.conv2d(xd, wd, bd, 1, (kh // 2, kw // 2), 1, c)
        yd.backward(dyd)
        return yd, xd, wd, bd

    y64, x64, w64, b64 = reference(x.double(), wt.double(), b.double() if bias else None, dy.double())
    # Each output element is a sum of products; with random signs its expected square is the sum of the products'
    # squares, which the same reference on squared inputs gives. The error is relative to the larger of ||ref|| and
    # that norm, so a draw whose sums cancel (a 1x1 kernel's weight gradient over one channel is a single sum of
    # n*h*w products) is judged by the rounding its terms allow, not by the small total they happened to reach.
    sq = reference(x.double() ** 2, wt.double() ** 2, b.double() ** 2 if bias else None, dy.double() ** 2)
    y_sq, x_sq, w_sq, b_sq = sq[0], sq[1].grad, sq[2].grad, sq[3].grad if bias else None

    assert y.shape == y64.shape and y.dtype == dtype, what
    if layout == "channels_last" and c > 1:
        assert y.is_contiguous(memory_format=torch.channels_last), what
    tol = TOL[dtype]
    pairs = [("out", y, y64, y_sq), ("grad_x", xs.grad, x64.grad, x_sq), ("grad_w", ws.grad, w64.grad, w_sq)]
    if bias:
        pairs.append(("grad_b", bs.grad, b64.grad, b_sq))
    for name, got, ref, ref_sq in pairs:
        assert not torch.isnan(got).any(), f"{name} has NaNs: some element was never written ({what})"
        err = rel_err(got, ref, ref_sq.sum().sqrt().item())
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e} ({what})"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: f"{k[0]}x{k[1]}")
def test_kernel_sizes(kernel, layout, dtype):
    kh, kw = kernel
    n, c = random.randint(1, 3), random.choice([1, 3, 5, 8])
    h, w = random.randint(5, 40), random.randint(5, 40)
    check_case(n, c, h, w, kh, kw, dtype, layout)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,k", [((2, 7, 7, 7), 13), ((2, 5, 7, 7), 31), ((1, 3, 14, 14), 27), ((1, 2, 1, 1), 31),
                                     ((3, 4, 2, 9), 7), ((2, 3, 56, 56), 31), ((1, 2, 100, 37), 29),
                                     ((1, 2, 112, 112), 31), ((2, 3, 37, 150), 13)])
def test_map_sizes(shape, k, dtype):
    """Maps smaller than the kernel (7x7 with 13x13 and 31x31), single pixels, thin and large maps (several tiles
    per map; weight-gradient items of a part of a map's rows at 112x112), batch 1."""
    check_case(*shape, k, k, dtype, random.choice(LAYOUTS))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_unaligned_storage(dtype):
    """Contiguous tensors whose data starts one element past an aligned address: kernels that move 8-16 bytes per
    access (the 16-bit weight gradient's staging, the whole-map forward's stores, the transposes) must fall back to
    narrower accesses instead of faulting or misreading."""
    for shape, k in [((4, 3, 32, 32), 31), ((2, 2, 28, 28), 29), ((32, 2, 14, 14), 27), ((40, 2, 32, 32), 31)]:
        check_case(*shape, k, k, dtype, "offset")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_column_maps_with_any_column_stride(dtype):
    """A (N, C, H, 1) map is contiguous whatever its column stride: every kernel path takes it as it is."""
    for shape, k in [((2, 4, 9, 1), 13), ((8, 2, 20, 1), 7)]:
        x = _layout(torch.zeros(shape, device="cuda"), "column_stride")
        assert x.is_contiguous() and x.stride(3) != 1
        check_case(*shape, k, k, dtype, "column_stride")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_launch_just_under_the_default_shared_memory_limit(dtype):
    """The 16-bit weight gradient of a 51x45 kernel over 4 x 40 x 16 maps asks for 49,056 bytes of dynamic shared
    memory, under the 48 KB that needs no opt-in, but its kernel also has 160 bytes of static shared memory: the
    launch failed ("invalid argument") until the opt-in counted both (found by test_random_configurations)."""
    check_case(4, 3, 40, 16, 51, 45, dtype, "nchw")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_random_configurations(dtype):
    """A fresh draw of shape, odd kernel (1..63, square or not), layout and bias on every run."""
    for _ in range(12):
        kh, kw = random.randrange(1, 64, 2), random.randrange(1, 64, 2)
        shape = (random.randint(1, 4), random.randint(1, 9), random.randint(1, 70), random.randint(1, 70))
        check_case(*shape, kh, kw, dtype, random.choice(LAYOUTS), bias=random.random() < 0.5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_benchmark_shapes(dtype):
    """The RepLKNet-31B stage shapes at a reduced batch, where the tiling takes its production choices."""
    for shape, k in [((4, 128, 56, 56), 31), ((4, 256, 28, 28), 29), ((4, 512, 14, 14), 27), ((4, 1024, 7, 7), 13),
                     ((4, 384, 32, 32), 31)]:
        check_case(*shape, k, k, dtype, "nchw")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_slak_stage_shapes(dtype, layout):
    """SLaK-T's decomposed kernels at its stage shapes (batch 2): K x 5 with a bias (the deployed `LoRA1_reparam`) and
    5 x K without (`LoRA2_reparam`), K = 51, 49, 47, 13 on 56, 28, 14 and 7 px maps."""
    for (c, hw), k in zip([(96, 56), (192, 28), (384, 14), (768, 7)], [51, 49, 47, 13]):
        check_case(2, c, hw, hw, k, 5, dtype, layout, bias=True)
        check_case(2, c, hw, hw, 5, k, dtype, layout, bias=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_small_maps(dtype, layout):
    """Maps up to 16x16 (fp32: the whole-map FMA kernels, where the kernel mostly covers the map and the batch is 16
    or more; fp16/bf16: the whole-map tensor-core kernels): RepLKNet's s3/s4 stages, batches that leave the last
    32-sample block part empty, maps up to 8 and 12..16 wide, one row, kernels taller than the map's reach and
    shorter than the map; channels_last and strided inputs through their NCHW copies."""
    ext = build.load()
    cases = [((64, 8, 14, 14), (27, 27)), ((64, 8, 7, 7), (13, 13)), ((17, 3, 7, 7), (13, 13)),
             ((45, 5, 16, 16), (31, 31)), ((33, 2, 9, 13), (11, 21)), ((16, 3, 1, 7), (3, 13)),
             ((40, 2, 16, 8), (63, 15)), ((20, 4, 12, 12), (7, 23)), ((17, 16, 16, 16), (31, 31))]
    expected = "small" if dtype == torch.float32 else "map_tc"
    for (n, c, h, w), (kh, kw) in cases:
        assert ext.path(torch.empty(n, c, h, w, device="cuda", dtype=dtype), kh, kw) == expected, \
            f"{(n, c, h, w)} with {kh}x{kw} skips the {expected} kernels"
        check_case(n, c, h, w, kh, kw, dtype, layout, bias=random.random() < 0.5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_map_tc_edges(dtype):
    """The whole-map tensor-core kernels where the fp32 whole-map kernels do not go: batches under 16 (a part-empty
    16-sample tile, fewer tiles than warps) and over 8 tiles (warps loop over items), 1 to 16 rows and columns of
    both parities (4-byte pair accesses or single elements), kernels much smaller than the map, kernels wider than
    the 31 columns a 16-wide row can reach, 1x1."""
    ext = build.load()
    cases = [((1, 3, 16, 16), (31, 31)), ((5, 2, 9, 9), (3, 5)), ((200, 2, 14, 14), (27, 27)),
             ((130, 3, 13, 15), (13, 9)), ((3, 2, 16, 1), (63, 63)), ((20, 2, 1, 16), (1, 31)),
             ((18, 2, 11, 6), (21, 61)), ((7, 2, 16, 8), (7, 7)), ((9, 4, 8, 16), (1, 1))]
    for (n, c, h, w), (kh, kw) in cases:
        assert ext.path(torch.empty(n, c, h, w, device="cuda", dtype=dtype), kh, kw) == "map_tc"
        check_case(n, c, h, w, kh, kw, dtype, random.choice(LAYOUTS), bias=random.random() < 0.5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_map_tc_wide_forward(dtype):
    """The fp16/bf16 forward (and input gradient) of maps 17-32 wide on the whole-map tensor-core kernel: RepLKNet's
    28x28 with 29x29 and the seed's 32x32 with 31x31, maps up to 16 wide but over 16 rows, odd widths (element
    stores), one row, batches that leave a 16-sample tile part empty, kernels much smaller than the map and 63 wide;
    the weight gradient runs on the banded kernels."""
    ext = build.load()
    cases = [((64, 3, 28, 28), (29, 29)), ((33, 2, 32, 32), (31, 31)), ((5, 2, 17, 17), (63, 63)),
             ((20, 3, 30, 9), (7, 5)), ((1, 2, 1, 32), (1, 31)), ((40, 2, 25, 31), (13, 27)), ((3, 2, 32, 20), (3, 3))]
    for (n, c, h, w), (kh, kw) in cases:
        x = torch.empty(n, c, h, w, device="cuda", dtype=dtype)
        assert ext.path(x, kh, kw) == "map_tc" and ext.path(x, kh, kw, forward=False) == "tiled"
        check_case(n, c, h, w, kh, kw, dtype, random.choice(LAYOUTS), bias=random.random() < 0.5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_wide_maps(layout):
    """The fp32 whole-map kernels for maps 17-32 wide (seed 32x32 with 31x31, RepLKNet's s2 28x28 with 29x29): rows
    of 28 and 32 columns, maps narrower than that, a map taller than wide whose weight gradient stages grad_out in
    chunks of rows (32 rows), rectangular kernels, kernels from 9 columns wide (most computed column pairs then
    padding: 9x9 on a 17-wide map), batches that leave the last 32-sample block part empty; the fp16/bf16 weight
    gradient stays on the banded tensor-core kernels at these sizes."""
    ext = build.load()
    cases = [((40, 3, 32, 32), (31, 31)), ((33, 4, 28, 28), (29, 29)), ((16, 2, 30, 29), (31, 27)),
             ((20, 3, 32, 24), (5, 31)), ((17, 2, 21, 27), (27, 25)), ((64, 2, 32, 32), (31, 31)),
             ((40, 3, 32, 32), (9, 9)), ((33, 2, 17, 17), (9, 9)), ((20, 3, 24, 24), (17, 17)),
             ((16, 2, 28, 20), (13, 15)), ((18, 2, 32, 19), (31, 9))]
    for (n, c, h, w), (kh, kw) in cases:
        x = torch.empty(n, c, h, w, device="cuda")
        assert ext.path(x, kh, kw) == "small", f"{(n, c, h, w)} with {kh}x{kw} skips the whole-map kernels"
        assert ext.path(x.bfloat16(), kh, kw, forward=False) == ext.path(x.half(), kh, kw, forward=False) == "tiled"
        check_case(n, c, h, w, kh, kw, torch.float32, layout, bias=random.random() < 0.5)
    # kernels wider than 31 or narrower than 9 go to the tiled kernels
    assert ext.path(torch.empty(32, 1, 32, 32, device="cuda"), 33, 33) == "tiled"
    assert ext.path(torch.empty(32, 1, 32, 32, device="cuda"), 9, 7) == "tiled"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_strip_forward(layout):
    """The fp32 forward (and input gradient) of maps 33-56 wide with kernels 25-31 wide on the strip kernel:
    RepLKNet's 56x56 with 31x31 at a reduced batch, narrower maps (the last strip part past the map), odd widths
    (element accesses), rows fewer and more than a block's 8, batches that leave the last 8-sample block part empty,
    a rectangular kernel, a kernel shorter than the map's rows; the weight gradient stays on the tiled kernels."""
    ext = build.load()
    cases = [((9, 2, 56, 56), (31, 31)), ((8, 3, 40, 44), (25, 29)), ((11, 2, 13, 33), (31, 25)),
             ((16, 2, 61, 53), (27, 27)), ((8, 2, 3, 56), (1, 31))]
    for (n, c, h, w), (kh, kw) in cases:
        x = torch.empty(n, c, h, w, device="cuda")
        assert ext.path(x, kh, kw) == "strip" and ext.path(x, kh, kw, forward=False) == "tiled"
        check_case(n, c, h, w, kh, kw, torch.float32, layout, bias=random.random() < 0.5)
    assert ext.path(torch.empty(8, 1, 56, 56, device="cuda"), 33, 31) == "tiled"  # rows past the staged reach
    assert ext.path(torch.empty(8, 1, 56, 56, device="cuda"), 31, 23) == "tiled"  # mostly zero kernel columns


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_gradient_at_a_time(dtype):
    """Autograd asks for both gradients through one op (dwconv2d_bwd, which shares the layout copy); with only one
    of them needed it runs that pass's own op: both routes give the same gradients as the float64 reference."""
    layout = random.choice(["channels_last", "strided"])
    n, c, h, w, k = 3, 8, random.choice([14, 28, 56]), random.choice([14, 28, 56]), random.choice([13, 27, 31])
    x = _layout(torch.randn(n, c, h, w, device="cuda").to(dtype), layout)
    wt = (torch.randn(c, 1, k, k, device="cuda") / k).to(dtype)
    dy = _layout(torch.randn(n, c, h, w, device="cuda").to(dtype), layout)
    x64, w64 = x.double().requires_grad_(), wt.double().requires_grad_()
    F.conv2d(x64, w64, None, 1, k // 2, 1, c).backward(dy.double())
    for needs_x, needs_w in ((True, False), (False, True)):
        xs, ws = x.detach().requires_grad_(needs_x), wt.detach().requires_grad_(needs_w)
        dwconv2d(xs, ws).backward(dy)
        got, ref = (xs.grad, x64.grad) if needs_x else (ws.grad, w64.grad)
        assert (xs.grad is None) != needs_x and (ws.grad is None) != needs_w
        assert rel_err(got, ref) <= TOL[dtype], f"{(n, c, h, w)} k={k} {layout} grad of {'x' if needs_x else 'w'}"


def test_channels_last_training_ops():
    """16-bit channels_last with gradients runs the forward that keeps its NCHW copy of x (for the weight gradient)
    and both gradients in one op; fp32 and inference run the plain forward."""
    from torch.utils.flop_counter import FlopCounterMode

    def ops_of(dtype, grad):
        x = torch.randn(4, 8, 14, 14, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
        w = (torch.randn(8, 1, 13, 13, device="cuda") / 13).to(dtype).requires_grad_(grad)
        with FlopCounterMode(display=False) as counter:
            y = dwconv2d(x.requires_grad_(grad), w)
            if grad:
                y.backward(torch.randn_like(y))
        return set(counter.get_flop_counts()["Global"])

    lk = torch.ops.lkcnn
    assert ops_of(torch.bfloat16, True) == {lk.dwconv2d_fwd_keep_flat, lk.dwconv2d_bwd}
    assert ops_of(torch.float32, True) == {lk.dwconv2d_fwd, lk.dwconv2d_bwd}
    assert ops_of(torch.bfloat16, False) == {lk.dwconv2d_fwd}
    with use_conv_impl("torch"):  # PyTorch's convolution keeps no copy
        assert ops_of(torch.bfloat16, True) == {lk.dwconv2d_fwd, lk.dwconv2d_bwd}


def test_compiling_under_another_implementation_in_one_process():
    """The same network compiled with lkcnn's kernels, then (a new instance, same graph) with PyTorch's convolution:
    the second compile must not reuse the first's graph, whose forward keeps an NCHW copy of x that PyTorch's path
    does not make (torch's compile caches key on the graph, not on lkcnn's implementation choice)."""
    def step(impl):
        torch.manual_seed(0)
        conv = torch.nn.Sequential(LargeKernelConv(16, 13), torch.nn.ReLU()).cuda()
        x = torch.randn(2, 16, 14, 14, device="cuda").contiguous(memory_format=torch.channels_last)
        with use_conv_impl(impl):
            model = torch.compile(conv)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = model(x.requires_grad_())
            y.float().sum().backward()
        return y.float(), x.grad, conv[0].weight.grad

    for got, want in zip(step("auto"), step("torch")):
        assert rel_err(got, want.double()) <= TOL[torch.bfloat16]


def test_the_choice_of_forward_compiles_without_graph_breaks():
    """dwconv2d decides at trace time whether its forward keeps an NCHW copy; dynamo must trace that decision (the
    built extension's checks would break the graph at every large-kernel layer)."""
    conv = LargeKernelConv(16, 13).cuda().bfloat16()
    x = torch.randn(2, 16, 14, 14, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    explained = torch._dynamo.explain(conv)(x.requires_grad_())
    assert explained.graph_break_count == 0, explained.break_reasons


def test_64bit_indexing():
    """A bf16 tensor of more than 2^31 elements: the last planes must be computed like the first."""
    n, c, h, w, k = 2100, 1024, 32, 32, 31  # 2.2e9 elements
    x = torch.randn(n, c, h, w, device="cuda", dtype=torch.bfloat16)
    wt = (torch.randn(c, 1, k, k, device="cuda") / k).to(torch.bfloat16)
    y = dwconv2d(x, wt)
    tail = F.conv2d(x[-1:, -4:].double(), wt[-4:].double(), None, 1, k // 2, 1, 4)
    assert rel_err(y[-1:, -4:], tail) <= TOL[torch.bfloat16]
    del y
    grad_w = torch.ops.lkcnn.dwconv2d_bwd_weight(x, x, [k, k], [k // 2, k // 2])
    ref = torch.nn.grad.conv2d_weight(x[:, -1:].double(), (1, 1, k, k), x[:, -1:].double(), 1, k // 2, 1, 1)
    assert rel_err(grad_w[-1:], ref) <= TOL[torch.bfloat16]


def test_opcheck():
    x = torch.randn(2, 6, 20, 17, device="cuda")
    w = torch.randn(6, 1, 9, 7, device="cuda")
    b = torch.randn(6, device="cuda")
    torch.library.opcheck(torch.ops.lkcnn.dwconv2d_fwd, (x, w, b, [4, 3]))
    dy = torch.randn_like(x)
    torch.library.opcheck(torch.ops.lkcnn.dwconv2d_bwd_input, (dy, w, [4, 3]))
    torch.library.opcheck(torch.ops.lkcnn.dwconv2d_bwd_weight, (dy, x, [9, 7], [4, 3]))
    for layout in LAYOUTS:  # the shared NCHW copy of a channels_last or strided gradient; the forward's kept copy
        torch.library.opcheck(torch.ops.lkcnn.dwconv2d_bwd, (_layout(dy, layout), _layout(x, layout), w, [4, 3]))
        xb = _layout(x.bfloat16(), layout)
        torch.library.opcheck(torch.ops.lkcnn.dwconv2d_fwd_keep_flat,
                              (xb, w.bfloat16(), b.bfloat16(), [4, 3]))
    # the backward ops on the forward's kept copy, flat, as training saves it
    dyb, xb_flat = _layout(dy.bfloat16(), "channels_last"), x.bfloat16().flatten(2)
    torch.library.opcheck(torch.ops.lkcnn.dwconv2d_bwd, (dyb, xb_flat, w.bfloat16(), [4, 3]))
    torch.library.opcheck(torch.ops.lkcnn.dwconv2d_bwd_weight, (dyb, xb_flat, [9, 7], [4, 3]))


def test_compile_fullgraph_and_autocast():
    conv = torch.nn.Conv2d(16, 16, 31, padding=15, groups=16, device="cuda")
    x = torch.randn(2, 16, 24, 24, device="cuda", requires_grad=True)

    def f(t):
        return dwconv2d(t, conv.weight, conv.bias).relu().sum()

    compiled = torch.compile(f, fullgraph=True)
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cuda", dtype=dtype):
            loss = compiled(x)
            eager = f(x)
        grad = torch.autograd.grad(loss, x)[0]
        ref = F.conv2d(x.double(), conv.weight.double(), conv.bias.double(), 1, 15, 1, 16).relu().sum()
        assert abs(loss.item() - ref.item()) <= 2e-2 * abs(ref.item())
        assert abs(loss.item() - eager.item()) <= 2e-2 * abs(ref.item())
        assert grad.shape == x.shape and torch.isfinite(grad).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("shape,k", [((32, 4, 14, 14), 13), ((32, 2, 32, 32), 31), ((2, 4, 24, 40), 9)],
                         ids=["whole-map", "whole-map-wide", "tiled"])
def test_cuda_graph_capture(shape, k, layout, dtype):
    """All three passes can be captured in a CUDA graph (as whole-step capture and torch.compile's reduce-overhead
    mode do): replaying the graph on new inputs, written in place, gives the eager results on those inputs."""
    n, c, h, w = shape
    x = _layout(torch.randn(n, c, h, w, device="cuda", dtype=dtype), layout).requires_grad_()
    wt = (torch.randn(c, 1, k, k, device="cuda") / k).to(dtype).requires_grad_()
    dy = _layout(torch.randn(n, c, h, w, device="cuda", dtype=dtype), layout)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (extension load, first-call work)
        dwconv2d(x, wt).backward(dy)
    torch.cuda.current_stream().wait_stream(side)
    x.grad = wt.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = dwconv2d(x, wt)
        y.backward(dy)
    with torch.no_grad():
        for t in (x, wt, dy):
            t.copy_(torch.randn_like(t, dtype=torch.float32).to(dtype) / (k if t is wt else 1))
    graph.replay()
    xe, we = x.detach().clone().requires_grad_(), wt.detach().clone().requires_grad_()
    ye = dwconv2d(xe, we)
    ye.backward(dy)
    tol = 1e-4 if dtype == torch.float32 else 1e-2  # the same kernels; the weight gradient's atomics sum in any order
    for got, ref in ((y, ye), (x.grad, xe.grad), (wt.grad, we.grad)):
        assert torch.allclose(got.float(), ref.float(), rtol=tol, atol=tol)


@use_conv_impl("auto")
def test_fallback_is_identical_for_unsupported_configurations():
    """Non-'same' padding and float64 go to PyTorch under 'auto' with a warning, small kernels without one, all with
    PyTorch's exact results."""
    x = torch.randn(2, 4, 16, 16, device="cuda")
    w = torch.randn(4, 1, 7, 7, device="cuda")
    with pytest.warns(UserWarning, match="falls back"):
        y = dwconv2d(x, w, padding=(1, 3))
    assert torch.equal(y, F.conv2d(x, w, None, 1, (1, 3), 1, 4))
    xd, wd = x.double(), w.double()
    assert torch.equal(dwconv2d(xd, wd), F.conv2d(xd, wd, None, 1, 3, 1, 4))
    small = torch.randn(4, 1, 5, 5, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(dwconv2d(x, small), F.conv2d(x, small, None, 1, 2, 1, 4))


def test_cuda_impl_refuses_loudly():
    x = torch.randn(1, 2, 8, 8, device="cuda", dtype=torch.float64)
    with pytest.raises(RuntimeError, match="LKCNN_CONV_IMPL=cuda"):
        dwconv2d(x, torch.randn(2, 1, 3, 3, device="cuda", dtype=torch.float64))
