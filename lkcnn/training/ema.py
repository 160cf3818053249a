"""The weights' exponential moving average: timm's ModelEmaV3 with the tensors it updates gathered once.

Why not ModelEmaV3 as is: its update walks both networks' state_dict() at every step and copies each integer buffer
with a kernel of its own; on RepLKNet-31B that is host time a GPU step waits for (docs/performance.md, "The
training app's step"). Here the (EMA, network) tensor pairs are gathered on the first update and again whenever
either network's tensors were replaced (a device or dtype move replaces buffers); the arithmetic stays timm's
(its `_foreach_lerp_` where the installed timm has it, with its dtype handling and stochastic rounding).
"""
from __future__ import annotations

import torch
from timm.utils import ModelEmaV3
from torch import Tensor, nn


class ModelEma(ModelEmaV3):
    _pairs: tuple | None = None  # (network, layout key, EMA floats, network floats, EMA rest, network rest)

    def _gather(self, model: nn.Module) -> tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor]]:
        ema_f, model_f, ema_rest, model_rest = [], [], [], []
        # keep_vars: the parameters themselves, whose data .to() swaps in place, so a stale list never holds on to
        # a moved network's old storage (only its buffers', which are small)
        for ema_v, model_v in zip(self.module.state_dict(keep_vars=True).values(),
                                  model.state_dict(keep_vars=True).values()):
            if ema_v.is_floating_point():
                ema_f.append(ema_v)
                model_f.append(model_v)
            else:
                ema_rest.append(ema_v)
                model_rest.append(model_v)
        return ema_f, model_f, ema_rest, model_rest

    @staticmethod
    def _layout_key(module: nn.Module) -> tuple:
        """Changes when .to() (device or dtype) replaced the tensors: a parameter's storage, a buffer's identity."""
        param, buffer = next(module.parameters(), None), next(module.buffers(), None)
        return (None if param is None else param.data_ptr()), (None if buffer is None else id(buffer))

    @torch.no_grad()
    def apply_update_(self, model: nn.Module, decay: float) -> None:
        if not self.foreach:
            return super().apply_update_(model, decay)
        key = (self._layout_key(self.module), self._layout_key(model))
        if self._pairs is None or self._pairs[0] is not model or self._pairs[1] != key:
            self._pairs = (model, key, *self._gather(model))
        _, _, ema_f, model_f, ema_rest, model_rest = self._pairs
        lerp = getattr(self, "_foreach_lerp_", None)  # newer timm: mixed dtypes, stochastic rounding
        (lerp or torch._foreach_lerp_)(ema_f, model_f, weight=1.0 - decay)
        if ema_rest:
            torch._foreach_copy_(ema_rest, model_rest)
