// Synchronized BatchNorm's training forward and backward as one C++ autograd function (eager mode; under
// torch.compile lkcnn/training/sync_batchnorm.py runs tensor ops that inductor fuses instead).
//
// Why C++: a DDP step of RepLKNet-31B runs ~200 BatchNorms, and a synchronized one costs host time in every forward
// and backward. Written in Python on PyTorch's kernels and collectives (as torch.nn.SyncBatchNorm is), that host time
// was ~0.7 ms per layer, ~140 ms per step: more than the GPU's whole step, so the GPUs waited for the host
// (docs/performance.md, "Multi-GPU"). Here the same kernels and collectives (batch_norm_stats, one all-gather of
// mean and 1/std; backward_reduce, one all-reduce of the two sums) are issued from C++. Nothing here waits for the
// GPU: the collectives' wait() orders the current stream after them and returns.
// Every rank must hold the same number of samples (Lightning's distributed sampler sees to it), so one count serves
// all ranks and no counts travel.
#include "sync_batchnorm.h"

#include <tuple>

#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace lkcnn {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::MemoryFormat layout_of(const at::Tensor& t) {
  return t.is_contiguous(at::MemoryFormat::ChannelsLast) ? at::MemoryFormat::ChannelsLast
                                                         : at::MemoryFormat::Contiguous;
}

std::optional<at::Tensor> if_defined(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// The forward pass: (output, mean, 1/std), the last two being the synchronized batch statistics.
std::tuple<at::Tensor, at::Tensor, at::Tensor> sync_batch_norm_forward(
    const at::Tensor& input, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var, double eps,
    double momentum, const std::string& group_name) {
  TORCH_CHECK(input.is_cuda() && input.dim() >= 2 && input.numel() > 0,
              "lkcnn sync_batch_norm: expected a non-empty CUDA tensor of shape (N, C, ...), got ", input.sizes());
  const at::Tensor x = input.contiguous(layout_of(input));
  const int64_t count = x.numel() / x.size(1);
  const auto group = c10d::resolve_process_group(group_name);
  const int64_t world = group->getSize();

  auto [local_mean, local_invstd] = at::batch_norm_stats(x, eps);
  at::Tensor local = at::stack({local_mean, local_invstd});  // (2, C)
  at::Tensor gathered = at::empty({world, 2, x.size(1)}, local.options());
  // _allgather_base: in every torch lkcnn supports (2.11 on the GPU machine); its successor is newer than that
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  group->_allgather_base(gathered, local)->wait();
#pragma GCC diagnostic pop
  const at::Tensor counts = at::full({world}, static_cast<double>(count), local.options());
  // Without running statistics batch_norm_gather_stats_with_counts wants the counts in x's dtype, and bfloat16
  // counts only up to 256 exactly: scratch statistics in the counts' dtype (written, never read) keep them exact.
  const at::Tensor scratch = running_mean.has_value() ? at::Tensor() : at::empty({2, x.size(1)}, local.options());
  auto [mean, invstd] = at::batch_norm_gather_stats_with_counts(
      x, gathered.select(1, 0), gathered.select(1, 1), running_mean.has_value() ? running_mean : scratch[0],
      running_var.has_value() ? running_var : scratch[1], momentum, eps, counts);
  return {at::batch_norm_elemt(x, weight, bias, mean, invstd, eps), mean, invstd};
}

// The backward pass: (grad_input, grad_weight, grad_bias), each undefined where not asked for (or, for the last
// two, where there is no weight).
std::tuple<at::Tensor, at::Tensor, at::Tensor> sync_batch_norm_backward(
    const at::Tensor& grad_out, const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const at::Tensor& mean, const at::Tensor& invstd, const std::string& group_name, bool need_input,
    bool need_weight, bool need_bias) {
  const auto layout = layout_of(input);
  const at::Tensor x = input.contiguous(layout), grad = grad_out.contiguous(layout);
  need_weight = need_weight && weight.has_value();
  need_bias = need_bias && weight.has_value();
  auto [sum_dy, sum_dy_xmu, grad_weight, grad_bias] =
      at::batch_norm_backward_reduce(grad, x, mean, invstd, weight, need_input, need_weight, need_bias);
  at::Tensor grad_x;
  if (need_input) {
    const auto group = c10d::resolve_process_group(group_name);
    std::vector<at::Tensor> sums{at::stack({sum_dy, sum_dy_xmu})};
    group->allreduce(sums)->wait();
    const at::Tensor counts = at::full({group->getSize()}, x.numel() / x.size(1), x.options().dtype(at::kInt));
    grad_x = at::batch_norm_backward_elemt(grad, x, mean, invstd, weight, sums[0].select(0, 0), sums[0].select(0, 1),
                                           counts);
  }
  return {grad_x, need_weight ? grad_weight : at::Tensor(), need_bias ? grad_bias : at::Tensor()};
}

class SyncBatchNormFunction : public torch::autograd::Function<SyncBatchNormFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const std::optional<at::Tensor>& weight,
                            const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& running_mean,
                            const std::optional<at::Tensor>& running_var, double eps, double momentum,
                            const std::string& group_name) {
    auto [y, mean, invstd] =
        sync_batch_norm_forward(input, weight, bias, running_mean, running_var, eps, momentum, group_name);
    ctx->save_for_backward({input, weight.value_or(at::Tensor()), mean, invstd});
    ctx->saved_data["group"] = group_name;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [grad_x, grad_w, grad_b] = sync_batch_norm_backward(
        grads[0], saved[0], if_defined(saved[1]), saved[2], saved[3], ctx->saved_data["group"].toStringRef(),
        ctx->needs_input_grad(0), ctx->needs_input_grad(1), ctx->needs_input_grad(2));
    // one entry per forward argument: input, weight, bias, running_mean, running_var, eps, momentum, group_name
    return {grad_x, grad_w, grad_b, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor sync_batch_norm(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                           const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& running_mean,
                           const std::optional<at::Tensor>& running_var, double eps, double momentum,
                           const std::string& group_name) {
  return SyncBatchNormFunction::apply(input, weight, bias, running_mean, running_var, eps, momentum, group_name);
}

}  // namespace lkcnn
