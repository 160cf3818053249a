"""lkcnn's ModelEma against timm's ModelEmaV3: the same averages, also after .to() replaced the tensors."""
from __future__ import annotations

import copy

import torch
from timm.utils import ModelEmaV3
from torch import nn

from lkcnn.training.ema import ModelEma


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2))


def _train_step(net: nn.Module, opt: torch.optim.Optimizer, dtype: torch.dtype) -> None:
    x = torch.randn(4, 3, 6, 6, dtype=dtype)
    opt.zero_grad()
    net(x).square().mean().backward()
    opt.step()


def test_matches_timm_including_buffers_and_after_a_dtype_move():
    net = _net()
    net(torch.randn(2, 3, 6, 6))  # materialise the lazy layer
    other = copy.deepcopy(net)
    ours, theirs = ModelEma(net, decay=0.9), ModelEmaV3(other, decay=0.9)
    opt_a, opt_b = torch.optim.SGD(net.parameters(), lr=0.1), torch.optim.SGD(other.parameters(), lr=0.1)
    dtype = torch.float32
    for step in range(6):
        if step == 3:  # replaces every buffer and every parameter's storage, in both networks and their copies
            dtype = torch.float64
            for m in (net, other, ours, theirs):
                m.to(dtype)
            opt_a, opt_b = torch.optim.SGD(net.parameters(), lr=0.1), torch.optim.SGD(other.parameters(), lr=0.1)
        torch.manual_seed(step)
        _train_step(net, opt_a, dtype)
        torch.manual_seed(step)
        _train_step(other, opt_b, dtype)
        ours.update(net, step=step)
        theirs.update(other, step=step)
        for (name, a), b in zip(ours.module.state_dict().items(), theirs.module.state_dict().values()):
            assert torch.equal(a, b), f"step {step}: {name} differs"
    # the averages moved away from the network (a stale cache would leave them at the pre-move values)
    assert not torch.equal(ours.module[0].weight, net[0].weight)
    assert ours.module[1].num_batches_tracked.item() == net[1].num_batches_tracked.item() == 7  # 1 + 6 steps
