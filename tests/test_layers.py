"""lkcnn.layers: LargeKernelConv, BN folding helpers, ReparamLargeKernelConv and DecomposedLargeKernelConv structure
and errors, RepLKNet blocks, the image conv."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import randomize_bn, rel_err

from lkcnn.layers import (
    ConvFFN, DecomposedLargeKernelConv, ImageConv2d, LargeKernelConv, RepLKBlock, ReparamLargeKernelConv,
    UNIREPLKNET_DILATED_BRANCHES, conv_bn, dilate_kernel, fuse_bn, pad_to,
)


@pytest.mark.parametrize("kernel_size,bias", [(31, False), ((51, 5), True), ((5, 51), False), (1, True)])
def test_large_kernel_conv_matches_conv2d(kernel_size, bias):
    conv = LargeKernelConv(6, kernel_size, bias=bias)
    kh, kw = (kernel_size, kernel_size) if isinstance(kernel_size, int) else kernel_size
    ref = nn.Conv2d(6, 6, (kh, kw), padding=(kh // 2, kw // 2), groups=6, bias=bias)
    assert conv.weight.shape == (6, 1, kh, kw) and conv.padding == (kh // 2, kw // 2)
    ref.load_state_dict(conv.state_dict())  # strict: same keys and shapes as nn.Conv2d
    x = torch.randn(2, 6, 17, 23)
    assert conv(x).shape == x.shape
    assert rel_err(conv(x), ref(x)) < 1e-5


def test_large_kernel_conv_explicit_padding():
    conv = LargeKernelConv(3, 5, padding=(0, 0))
    x = torch.randn(1, 3, 9, 9)
    assert conv.padding == (0, 0)
    assert conv(x).shape == (1, 3, 5, 5)


@pytest.mark.parametrize("kernel_size", [8, 0, -3, (31, 4), (3, 3, 3)])
def test_large_kernel_conv_rejects_bad_sizes(kernel_size):
    with pytest.raises(ValueError, match="odd"):
        LargeKernelConv(4, kernel_size)


def test_fuse_bn_folds_conv_bn_pair():
    pair = randomize_bn(conv_bn(5, 7, 3, stride=2)).eval()
    x = torch.randn(2, 5, 12, 12)
    weight, bias = fuse_bn(pair.conv.weight, pair.bn)
    assert rel_err(F.conv2d(x, weight, bias, stride=2, padding=1), pair(x)) < 1e-5


def test_fuse_bn_keeps_conv_bias():
    conv, bn = nn.Conv2d(4, 4, 3, padding=1, bias=True), randomize_bn(nn.BatchNorm2d(4)).eval()
    x = torch.randn(1, 4, 8, 8)
    weight, bias = fuse_bn(conv.weight, bn, conv.bias)
    assert rel_err(F.conv2d(x, weight, bias, padding=1), bn(conv(x))) < 1e-5


@pytest.mark.parametrize("k,r", [(3, 2), (5, 3), (3, 5)])
def test_dilated_kernel_equals_sparse_dense_kernel(k, r):
    weight = torch.randn(4, 1, k, k)
    dense = dilate_kernel(weight, r)
    assert dense.shape[-1] == (k - 1) * r + 1
    x = torch.randn(1, 4, 20, 20)
    expected = F.conv2d(x, weight, padding=r * (k // 2), dilation=r, groups=4)
    assert rel_err(F.conv2d(x, dense, padding=dense.shape[-1] // 2, groups=4), expected) < 1e-5


def test_pad_to_centres_and_rejects_misfits():
    small = torch.randn(2, 1, 3, 5)
    padded = pad_to(small, (7, 9))
    assert torch.equal(padded[..., 2:5, 2:7], small)
    padded[..., 2:5, 2:7] = 0
    assert not padded.any()  # zeros everywhere else
    with pytest.raises(ValueError, match="centre"):
        pad_to(small, (2, 9))


def test_replknet_training_form_keys_are_official():
    keys = set(ReparamLargeKernelConv(8, 31, small_kernel=5).state_dict())
    bn = {"weight", "bias", "running_mean", "running_var", "num_batches_tracked"}
    assert keys == ({"lkb_origin.conv.weight", "small_conv.conv.weight"} | {f"lkb_origin.bn.{k}" for k in bn}
                    | {f"small_conv.bn.{k}" for k in bn})
    assert set(ReparamLargeKernelConv(8, 31, deploy=True).state_dict()) == {"lkb_reparam.weight", "lkb_reparam.bias"}
    assert isinstance(ReparamLargeKernelConv(8, 31, deploy=True).lkb_reparam, LargeKernelConv)


def test_dilated_branches_follow_unireplknet_table():
    module = ReparamLargeKernelConv(4, 13, small_kernel=None, dilated_branches=True)
    assert module.dilated_branches == UNIREPLKNET_DILATED_BRANCHES[13]
    assert sorted(module.dilated) == sorted(f"k{k}_r{r}" for k, r in UNIREPLKNET_DILATED_BRANCHES[13])
    assert module.dilated["k7_r2"].conv.dilation == (2, 2)
    explicit = ReparamLargeKernelConv(4, 9, small_kernel=None, dilated_branches=[(3, 4)])
    assert list(explicit.dilated) == ["k3_r4"]


@pytest.mark.parametrize("kwargs,match", [
    (dict(kernel_size=5, small_kernel=7), "fit inside"),
    (dict(kernel_size=(51, 5), small_kernel=7), "fit inside"),
    (dict(kernel_size=31, small_kernel=4), "odd"),
    (dict(kernel_size=31, dilated_branches=True), "table"),
    (dict(kernel_size=9, dilated_branches=[(5, 3)]), "fit inside"),
])
def test_reparam_conv_rejects_bad_configs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ReparamLargeKernelConv(4, **kwargs)


def test_blocks_keep_shape_and_official_keys():
    x = torch.randn(2, 8, 10, 10)
    block, ffn = RepLKBlock(8, 12, 7, 3, drop_path=0.1), ConvFFN(8, 32)
    assert block(x).shape == x.shape and ffn(x).shape == x.shape
    keys = set(block.state_dict())
    assert {"prelkb_bn.weight", "pw1.conv.weight", "pw1.bn.weight", "large_kernel.lkb_origin.conv.weight",
            "large_kernel.small_conv.conv.weight", "pw2.conv.weight"} <= keys
    assert block.large_kernel.lkb_origin.conv.weight.shape == (12, 1, 7, 7)
    assert {"preffn_bn.weight", "pw1.conv.weight", "pw2.bn.running_var"} <= set(ffn.state_dict())


def test_decomposed_keys_are_slaks():
    module = DecomposedLargeKernelConv(8, 51, 5, small_kernel=5)
    bn = {"weight", "bias", "running_mean", "running_var", "num_batches_tracked"}
    shapes = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    assert set(shapes) == {f"{b}.conv.weight" for b in ("LoRA1", "LoRA2", "small_conv")} | {
        f"{b}.bn.{k}" for b in ("LoRA1", "LoRA2", "small_conv") for k in bn}
    assert shapes["LoRA1.conv.weight"] == (8, 1, 51, 5) and shapes["LoRA2.conv.weight"] == (8, 1, 5, 51)
    assert shapes["small_conv.conv.weight"] == (8, 1, 5, 5)
    assert all(isinstance(b.conv, LargeKernelConv) for b in (module.LoRA1, module.LoRA2, module.small_conv))
    deployed = DecomposedLargeKernelConv(8, 51, 5, small_kernel=5, deploy=True)
    assert {k: tuple(v.shape) for k, v in deployed.state_dict().items()} == {
        "LoRA1_reparam.weight": (8, 1, 51, 5), "LoRA1_reparam.bias": (8,), "LoRA2_reparam.weight": (8, 1, 5, 51)}
    assert set(DecomposedLargeKernelConv(8, 13, 3, small_kernel=0).state_dict()) == {
        f"{b}.{k}" for b in ("LoRA1.bn", "LoRA2.bn") for k in bn} | {"LoRA1.conv.weight", "LoRA2.conv.weight"}


def test_decomposed_is_the_sum_of_its_branches():
    module = randomize_bn(DecomposedLargeKernelConv(4, 9, 3, small_kernel=3)).eval()
    x = torch.randn(2, 4, 11, 13)
    expected = sum(F.batch_norm(F.conv2d(x, b.conv.weight, padding=b.conv.padding, groups=4), b.bn.running_mean,
                                b.bn.running_var, b.bn.weight, b.bn.bias, eps=b.bn.eps)
                   for b in (module.LoRA1, module.LoRA2, module.small_conv))
    assert module(x).shape == x.shape
    assert rel_err(module(x), expected) < 1e-5


@pytest.mark.parametrize("args,match", [
    ((51, 3, 5), r"small_kernel \(5, 5\) must fit inside the 51x3 kernel"),  # the 5x5 cannot merge into 51x3
    ((3, 5, 5), "must fit inside the 3x5 kernel"),
    ((51, 4, 3), "odd"),
    ((51, 5, 4), "odd"),
    (((51, 5), 5, 5), "one int K"),
])
def test_decomposed_rejects_bad_configs(args, match):
    with pytest.raises(ValueError, match=match):
        DecomposedLargeKernelConv(4, *args)


def test_image_conv_pads_channels_without_changing_the_sums():
    conv = ImageConv2d(3, 8, 3, stride=2, padding=1).double()
    plain = nn.Conv2d(3, 8, 3, stride=2, padding=1).double()
    plain.load_state_dict(conv.state_dict())  # strict: nn.Conv2d's keys and shapes
    x = torch.randn(2, 3, 13, 11, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    assert not conv.pads(x)  # on the CPU it is nn.Conv2d
    padded, ref = conv.forward_padded(x), plain(x)
    assert padded.shape == ref.shape and rel_err(padded, ref) < 1e-12
    g = torch.randn_like(ref)
    (grad,) = torch.autograd.grad(padded, conv.weight, g)
    assert grad.shape == conv.weight.shape and rel_err(grad, torch.autograd.grad(ref, plain.weight, g)[0]) < 1e-12
    assert type(conv_bn(3, 8, 3, stride=2, act=True).conv) is ImageConv2d
    assert type(conv_bn(8, 8, 3, groups=8).conv) is nn.Conv2d and type(conv_bn(16, 8, 1).conv) is nn.Conv2d


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_image_conv_on_the_gpu_against_float64(dtype):
    conv = ImageConv2d(3, 32, 3, stride=2, padding=1, bias=False).cuda().to(dtype)
    x = torch.randn(4, 3, 64, 48, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
    assert conv.pads(x) and not conv.pads(x.contiguous())
    ref = F.conv2d(x.double(), conv.weight.double(), stride=2, padding=1)
    y = conv(x)
    assert y.dtype == dtype and rel_err(y.double(), ref) < (1e-2 if dtype == torch.bfloat16 else 2e-3)
