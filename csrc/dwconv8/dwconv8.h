// 8-bit large-kernel depthwise convolution for inference (deploy form): see dwconv8_fwd.cu.
#pragma once

#include <optional>

#include <ATen/ATen.h>

namespace lkcnn {

// y = quant(act(alpha[c] * correlate(x, w)[n, c] + beta[c])): x (N, C, H, W) int8 or float8_e4m3fn,
// NCHW-contiguous, "same" zero padding, odd k up to 33; table: the kernel as Toeplitz blocks, lkcnn/ops/dwconv8.py's
// `pack_weight` (bytes for INT8, float16 for FP8); act 0 none, 1 ReLU, 2 GELU (erf form); with out_scale (one float32
// on the device) y is x's 8-bit dtype, quantized onto out_scale's grid, else bfloat16, float16 or float32.
void dwconv8_fwd(const at::Tensor& x, const at::Tensor& table, int64_t k, const at::Tensor& alpha,
                 const at::Tensor& beta, int64_t act, const std::optional<at::Tensor>& out_scale, at::Tensor& y);

}  // namespace lkcnn
