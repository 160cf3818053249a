// FP8 GEMMs through cuBLASLt with its fused epilogue: see gemm8_lt.cu.
#pragma once

#include <optional>

#include <ATen/ATen.h>

namespace lkcnn {

// out[p, n] = act(alpha[n] * sum_k a[p, k] w[n, k] + bias[n]) + residual[p, n], written into `out`; see gemm8_lt.cu
void gemm_fp8_lt(const at::Tensor& a, const at::Tensor& w, const at::Tensor& alpha, const at::Tensor& ones,
                 const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual, int64_t act,
                 at::Tensor& out);

// whether cuBLASLt has a kernel for this problem (its heuristic's answer, cached with the kernel it picks)
bool gemm_fp8_lt_supported(int64_t m, int64_t n, int64_t k, int64_t act, std::optional<at::ScalarType> bias_dtype,
                           bool residual, at::ScalarType out_dtype);

}  // namespace lkcnn
