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

// A one-word int64 CPU tensor in mapped host memory, 0, into which the exchanges record their first failure (see
// sync_exchange.cu for its bits): the host reads it without synchronizing with the GPU.
at::Tensor exchange_status_word();

// out = the sum over the ranks of every rank's `input` (float32, contiguous, same shape on every rank). `peers` are
// the workspaces of the ranks in rank order, as addresses in this process; `rank` is this rank's index among them.
// `status` is the address of an exchange_status_word(); each wait for a peer gives up after `timeout_s` seconds,
// and then (or once an earlier call failed) the outputs are NaN and the failure is in *status.
void exchange_sum(const at::Tensor& input, at::Tensor& out, const std::vector<int64_t>& peers, int64_t rank,
                  int64_t status, double timeout_s);

// From every rank's per-channel batch mean and (biased) variance over the same number of samples: the global mean
// and 1 / sqrt(var + eps) written into mean_out and invstd_out, and the running statistics moved by `momentum`
// towards the global mean and unbiased variance (`count` samples per channel over all ranks), all float32. Failures as
// exchange_sum's (the running statistics are then left as they were).
void exchange_batch_norm_stats(const at::Tensor& mean, const at::Tensor& var, at::Tensor& running_mean,
                               at::Tensor& running_var, at::Tensor& mean_out, at::Tensor& invstd_out, double momentum,
                               double eps, int64_t count, const std::vector<int64_t>& peers, int64_t rank,
                               int64_t status, double timeout_s);

}  // namespace lkcnn
