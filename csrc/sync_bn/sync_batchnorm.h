// Synchronized BatchNorm (training mode): see sync_batchnorm.cpp.
#pragma once

#include <optional>
#include <string>

#include <ATen/ATen.h>

namespace lkcnn {

// BatchNorm of `input` with batch statistics over every rank of the process group registered as `group_name`;
// updates the running statistics in place, like torch.nn.SyncBatchNorm's training forward. Autograd-aware.
at::Tensor sync_batch_norm(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                           const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& running_mean,
                           const std::optional<at::Tensor>& running_var, double eps, double momentum,
                           const std::string& group_name);

}  // namespace lkcnn
