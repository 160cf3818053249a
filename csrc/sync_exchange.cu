// SyncBatchNorm's exchanges between the GPUs of one machine, each one kernel that pushes this rank's values into
// every rank's symmetric-memory workspace over NVLink, waits until every rank's values have arrived in its own, and
// combines them.
//
// Why not symmetric memory's one-shot all-reduce (session 11's path): it copies the input into the workspace, meets
// the other ranks at a barrier, reads their buffers across NVLink and meets them at a second barrier before the
// buffer may be reused, 6.4 us per call in a CUDA graph on 2x H200; and the combination of the ranks' batch
// statistics and the running-statistics update were more kernels per layer after it (docs/performance.md,
// session 12). Here a rank writes only remote memory and reads only its own, and the batch statistics are combined
// in the same kernel.
//
// No flags, no fences: every value travels as one 64-bit word with the call number in its upper half (NCCL's "LL"
// protocol), a single store that the receiver sees whole or not at all, so it polls its own memory until every word
// it needs carries this call's number.
//
// Reuse without a barrier: block b owns region b of the workspace, and its k-th call uses the half of the workspace
// of parity k. A rank reaches call k + 2 of block b only after its call k + 1 received every peer's call k + 1
// words, which each peer sent from a kernel that began after its call k (an earlier kernel on its stream) had read
// that half. Every rank must make the same calls in the same order on one stream, as with any collective; per-block
// call counters live in the workspace, so CUDA graphs replay the kernels unchanged.
#include "sync_exchange.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

namespace lkcnn {
namespace {

constexpr int kThreads = 256;          // one pair of values per thread
constexpr int kRegion = 2 * kThreads;  // values (64-bit words) a block sends per call
constexpr int kMaxBlocks = 64;
constexpr int kMaxWorld = 8;           // the GPUs of one NVLink machine
// Workspace layout: counters[block] (calls so far), then the words data[parity][from rank][block][kRegion].
constexpr int64_t kDataOffset = kMaxBlocks * sizeof(uint64_t);
constexpr int64_t kSlotWords = int64_t(kMaxBlocks) * kRegion;

struct Peers {
  char* base[kMaxWorld];  // every rank's workspace, mapped into this process
  char* own;              // base[rank] (a dynamic index into a kernel parameter array would copy it to the stack)
  int world, rank;
};

__device__ uint64_t* region_at(char* base, int parity, int from, int world, int block) {
  return reinterpret_cast<uint64_t*>(base + kDataOffset) + (int64_t(parity) * world + from) * kSlotWords +
         int64_t(block) * kRegion;
}

__device__ void store_word(uint64_t* p, float value, uint32_t call) {
  const uint64_t word = (uint64_t(call) << 32) | __float_as_uint(value);
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(word) : "memory");
}
// The value at p once it carries this call's number (a peer writes it across NVLink).
__device__ float await_word(const uint64_t* p, uint32_t call) {
  uint64_t word;
  do {
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(word) : "l"(p) : "memory");
  } while (uint32_t(word >> 32) != call);
  return __uint_as_float(uint32_t(word));
}

// The ranks' values combined by Op: load(block, thread) gives this rank's pair, finish(block, thread, pairs, world)
// gets every rank's pair for the same position, in rank order (so every rank computes the same result).
template <class Op>
__global__ void __launch_bounds__(kThreads) exchange_kernel(Peers p, Op op) {
  const int b = blockIdx.x, t = threadIdx.x;
  uint64_t* counter = reinterpret_cast<uint64_t*>(p.own) + b;
  const uint64_t call = *counter + 1;
  const int parity = int(call & 1);
  const uint32_t tag = uint32_t(call);  // the word written two calls ago in this half carries call - 2
  const float2 mine = op.load(b, t);
#pragma unroll  // constant indices keep p.base in registers
  for (int r = 0; r < kMaxWorld; ++r) {
    if (r < p.world) {
      uint64_t* dst = region_at(p.base[r], parity, p.rank, p.world, b);
      store_word(dst + t, mine.x, tag);
      store_word(dst + kThreads + t, mine.y, tag);
    }
  }
  float2 pairs[kMaxWorld];
#pragma unroll
  for (int r = 0; r < kMaxWorld; ++r) {
    if (r < p.world) {
      const uint64_t* src = region_at(p.own, parity, r, p.world, b);
      pairs[r] = make_float2(await_word(src + t, tag), await_word(src + kThreads + t, tag));
    }
  }
  op.finish(b, t, pairs, p.world);
  __syncthreads();  // every thread has read the counter
  if (t == 0) *counter = call;
}

// Sum of a flat vector: block b carries elements [b * kRegion, (b + 1) * kRegion).
struct SumOp {
  const float* in;
  float* out;
  int64_t n;

  __device__ float2 load(int b, int t) const {
    const int64_t i = int64_t(b) * kRegion + t;
    return make_float2(i < n ? in[i] : 0.f, i + kThreads < n ? in[i + kThreads] : 0.f);
  }
  __device__ void finish(int b, int t, const float2* pairs, int world) const {
    float x = 0.f, y = 0.f;
#pragma unroll
    for (int r = 0; r < kMaxWorld; ++r) {
      if (r < world) {
        x += pairs[r].x;
        y += pairs[r].y;
      }
    }
    const int64_t i = int64_t(b) * kRegion + t;
    if (i < n) out[i] = x;
    if (i + kThreads < n) out[i + kThreads] = y;
  }
};

// Batch statistics: block b carries channels [b * kThreads, (b + 1) * kThreads), (mean, variance) per channel.
struct StatsOp {
  const float *mean, *var;
  float *running_mean, *running_var, *mean_out, *invstd_out;
  float momentum, eps, unbias;  // unbias: count / (count - 1), the unbiased variance's factor
  int64_t C;

  __device__ float2 load(int b, int t) const {
    const int64_t c = int64_t(b) * kThreads + t;
    return c < C ? make_float2(mean[c], var[c]) : make_float2(0.f, 0.f);
  }
  __device__ void finish(int b, int t, const float2* pairs, int world) const {
    const int64_t c = int64_t(b) * kThreads + t;
    if (c >= C) return;
    float m = 0.f;
#pragma unroll
    for (int r = 0; r < kMaxWorld; ++r) m += r < world ? pairs[r].x : 0.f;
    m /= world;
    // equal counts per rank: the ranks' mean variance plus the spread of their means, exact (no E[x^2] - E[x]^2)
    float v = 0.f;
#pragma unroll
    for (int r = 0; r < kMaxWorld; ++r) {
      if (r < world) {
        const float d = pairs[r].x - m;
        v += pairs[r].y + d * d;
      }
    }
    v /= world;
    running_mean[c] += momentum * (m - running_mean[c]);
    running_var[c] += momentum * (v * unbias - running_var[c]);
    mean_out[c] = m;
    invstd_out[c] = rsqrtf(v + eps);
  }
};

Peers make_peers(const std::vector<int64_t>& peers, int64_t rank) {
  TORCH_CHECK(!peers.empty() && peers.size() <= size_t(kMaxWorld), "lkcnn exchange: ", peers.size(),
              " ranks; it takes 1 to ", kMaxWorld, " (the GPUs of one machine)");
  TORCH_CHECK(rank >= 0 && rank < int64_t(peers.size()), "lkcnn exchange: rank ", rank, " of ", peers.size());
  Peers p{};
  for (size_t r = 0; r < peers.size(); ++r) p.base[r] = reinterpret_cast<char*>(peers[r]);
  p.own = p.base[rank];
  p.world = int(peers.size());
  p.rank = int(rank);
  return p;
}

void check_vector(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.device() == like.device() &&
                  t.numel() == like.numel(),
              "lkcnn exchange: ", name, " must be a contiguous float32 CUDA tensor of ", like.numel(),
              " elements on ", like.device(), ", got ", t.scalar_type(), " ", t.sizes(), " on ", t.device());
}

template <class Op>
void launch(int64_t blocks, const Peers& p, const Op& op) {
  exchange_kernel<Op><<<unsigned(blocks), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(p, op);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

int64_t exchange_workspace_bytes(int64_t world) {
  TORCH_CHECK(world >= 1 && world <= kMaxWorld, "lkcnn exchange: ", world, " ranks; it takes 1 to ", kMaxWorld);
  return kDataOffset + 2 * world * kSlotWords * int64_t(sizeof(uint64_t));
}
int64_t exchange_max_values() { return kSlotWords; }
int64_t exchange_max_channels() { return int64_t(kMaxBlocks) * kThreads; }

void exchange_sum(const at::Tensor& input, at::Tensor& out, const std::vector<int64_t>& peers, int64_t rank) {
  check_vector(input, input, "input");
  check_vector(out, input, "out");
  const int64_t n = input.numel();
  TORCH_CHECK(n <= exchange_max_values(), "lkcnn exchange_sum: ", n, " values; it takes at most ",
              exchange_max_values());
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(input.device());
  launch((n + kRegion - 1) / kRegion, make_peers(peers, rank), SumOp{input.data_ptr<float>(), out.data_ptr<float>(), n});
}

void exchange_batch_norm_stats(const at::Tensor& mean, const at::Tensor& var, at::Tensor& running_mean,
                               at::Tensor& running_var, at::Tensor& mean_out, at::Tensor& invstd_out, double momentum,
                               double eps, int64_t count, const std::vector<int64_t>& peers, int64_t rank) {
  check_vector(mean, mean, "mean");
  for (auto [t, name] : {std::pair{&var, "var"}, {&running_mean, "running_mean"}, {&running_var, "running_var"},
                         {&mean_out, "mean_out"}, {&invstd_out, "invstd_out"}})
    check_vector(*t, mean, name);
  const int64_t C = mean.numel();
  TORCH_CHECK(C <= exchange_max_channels(), "lkcnn exchange_batch_norm_stats: ", C, " channels; it takes at most ",
              exchange_max_channels());
  TORCH_CHECK(count > 1, "lkcnn exchange_batch_norm_stats: expected more than 1 value per channel when training, got ",
              count);
  if (C == 0) return;
  const c10::cuda::CUDAGuard guard(mean.device());
  const StatsOp op{mean.data_ptr<float>(), var.data_ptr<float>(), running_mean.data_ptr<float>(),
                   running_var.data_ptr<float>(), mean_out.data_ptr<float>(), invstd_out.data_ptr<float>(),
                   float(momentum), float(eps), float(double(count) / double(count - 1)), C};
  launch((C + kThreads - 1) / kThreads, make_peers(peers, rank), op);
}

}  // namespace lkcnn
