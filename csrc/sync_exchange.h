// SyncBatchNorm's exchanges between the GPUs of one machine over NVLink: see sync_exchange.cu.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/ATen.h>

namespace lkcnn {

// Bytes of the symmetric-memory workspace every rank allocates for a group of `world` ranks.
int64_t exchange_workspace_bytes(int64_t world);
// The most float32 values exchange_sum sums per call, and the most channels exchange_batch_norm_stats takes.
int64_t exchange_max_values();
int64_t exchange_max_channels();

// out = the sum over the ranks of every rank's `input` (float32, contiguous, same shape on every rank). `peers` are
// the workspaces of the ranks in rank order, as addresses in this process; `rank` is this rank's index among them.
void exchange_sum(const at::Tensor& input, at::Tensor& out, const std::vector<int64_t>& peers, int64_t rank);

// From every rank's per-channel batch mean and (biased) variance over the same number of samples: the global mean
// and 1 / sqrt(var + eps) written into mean_out and invstd_out, and the running statistics moved by `momentum`
// towards the global mean and unbiased variance (`count` samples per channel over all ranks), all float32.
void exchange_batch_norm_stats(const at::Tensor& mean, const at::Tensor& var, at::Tensor& running_mean,
                               at::Tensor& running_var, at::Tensor& mean_out, at::Tensor& invstd_out, double momentum,
                               double eps, int64_t count, const std::vector<int64_t>& peers, int64_t rank);

}  // namespace lkcnn
