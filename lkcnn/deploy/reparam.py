"""Structural re-parameterization of a whole lkcnn model into its deploy form."""
from __future__ import annotations

import torch.nn as nn
from timm.utils import reparameterize_model as timm_reparameterize_model

from lkcnn.models import LkcnnModel


def reparameterize_model(model: nn.Module) -> nn.Module:
    """Merge every re-parameterizable module in place and return the model (now equal to one built with deploy=True).

    timm's walker does the work: it calls `reparameterize()` on each child (and `fuse()` / `switch_to_deploy()` on
    foreign timm blocks). lkcnn adds the in-place default, also merges a root module that is itself
    re-parameterizable (timm's walker skips the root), and marks the spec deployed even for a model with nothing to
    merge, so `model.lkcnn_spec["kwargs"]["deploy"]` is True afterwards.
    """
    if hasattr(model, "reparameterize"):
        model.reparameterize()
    timm_reparameterize_model(model, inplace=True)
    if isinstance(model, LkcnnModel):
        model.mark_deployed()
    return model
