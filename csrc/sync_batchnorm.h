// Synchronized BatchNorm (training mode): see sync_batchnorm.cpp.
#pragma once

#include <optional>
#include <string>
#include <tuple>

#include <ATen/ATen.h>

namespace lkcnn {

// BatchNorm of `input` with batch statistics over every rank of the process group registered as `group_name`;
// updates the running statistics in place, like torch.nn.SyncBatchNorm's training forward. Autograd-aware.
at::Tensor sync_batch_norm(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                           const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& running_mean,
                           const std::optional<at::Tensor>& running_var, double eps, double momentum,
                           const std::string& group_name);

// The forward pass alone: (output, mean, 1/std), the last two being the synchronized batch statistics.
std::tuple<at::Tensor, at::Tensor, at::Tensor> sync_batch_norm_forward(
    const at::Tensor& input, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var, double eps,
    double momentum, const std::string& group_name);

// The backward pass alone: (grad_input, grad_weight, grad_bias), each undefined where not asked for (or, for the
// last two, where there is no weight).
std::tuple<at::Tensor, at::Tensor, at::Tensor> sync_batch_norm_backward(
    const at::Tensor& grad_out, const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const at::Tensor& mean, const at::Tensor& invstd, const std::string& group_name, bool need_input,
    bool need_weight, bool need_bias);

}  // namespace lkcnn
