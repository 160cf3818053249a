"""The convolution that reads the image: 3 input channels, padded to 16 on the GPU so that cuDNN runs a fast kernel."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PAD_CHANNELS = 16


class ImageConv2d(nn.Conv2d):
    """nn.Conv2d (same arguments, same state_dict) for a network's first layer. On channels_last CUDA inputs with
    fewer than 16 channels it convolves the input and the weight padded with zero channels to 16: the same sums, but
    cuDNN then runs a tensor-core implicit GEMM instead of its generic NHWC kernel, which it picks for 3 channels with
    or without `cudnn.benchmark`. RepLKNet-31B's stem conv at batch 128, 224 px, bf16 on one H200: 0.95 ms on 3
    channels, 0.27 ms on 16 plus 0.24 ms for the padding alone; the compiled stem 2.54 -> 1.95 ms (docs/export.md)."""

    def pads(self, x: Tensor) -> bool:
        return (x.is_cuda and self.groups == 1 and self.in_channels < PAD_CHANNELS
                and x.is_contiguous(memory_format=torch.channels_last) and not torch.onnx.is_in_onnx_export())

    def forward_padded(self, x: Tensor) -> Tensor:
        extra = (0, 0, 0, 0, 0, PAD_CHANNELS - self.in_channels)
        return self._conv_forward(F.pad(x, extra), F.pad(self.weight, extra), self.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_padded(x) if self.pads(x) else super().forward(x)
