// SyncBatchNorm's exchanges between the GPUs of one machine, each one kernel that pushes this rank's values into
// every rank's symmetric-memory workspace over NVLink, waits until every rank's values have arrived in its own, and
// combines them.
//
// Why not symmetric memory's one-shot all-reduce: it copies the input into the workspace, meets the other ranks at a
// barrier, reads their buffers across NVLink and meets them at a second barrier before the buffer may be reused,
// 6.4 us per call in a CUDA graph on 2x H200; and the combination of the ranks' batch statistics and the
// running-statistics update were more kernels per layer after it (docs/performance.md). Here a rank writes only
// remote memory and reads only its own, and the batch statistics are combined in the same kernel.
//
// No flags, no fences: every value travels as one 64-bit word with a tag in its upper half (NCCL's "LL" protocol), a
// single store that the receiver sees whole or not at all, so it polls its own memory until every word it needs
// carries this call's tag. The tag is the call number (24 bits), a signature of the exchange (its kind and size, 7
// bits) and a poison bit: a word of an earlier call, or of this call number for another exchange, is never taken.
//
// Reuse without a barrier: block b owns region b of the workspace, and its k-th call uses the half of the workspace
// of parity k. A rank reaches call k + 2 of block b only after its call k + 1 received every peer's call k + 1
// words, which each peer sent from a kernel that began after its call k (an earlier kernel on its stream) had read
// that half. Every rank must make the same calls in the same order on one stream, as with any collective; per-block
// call counters live in the workspace, so CUDA graphs replay the kernels unchanged.
//
// Bounded waits: a peer that died, ran out of memory or skipped an exchange never sends its words. Each wait gives
// up after the caller's time limit (on the GPU's %globaltimer), or at once on a poisoned word or a word of another
// exchange. The first failure is recorded in the workspace, where every later call sees it and fails at once, and in
// a word of mapped host memory, which the host reads without synchronizing (lkcnn/training/sync_batchnorm.py); the
// failed call's outputs are NaN, and its block poisons every word this rank sends to its peers so that theirs fail
// at once too. No trap: __trap() would destroy the CUDA context, and with it the process's chance to say why.
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
// Workspace layout: counters[block] (calls so far), the failure record (0: none), padding, then the words
// data[parity][from rank][block][kRegion].
constexpr int kStatusWord = kMaxBlocks;
constexpr int64_t kDataOffset = (kMaxBlocks + 8) * sizeof(uint64_t);
constexpr int64_t kSlotWords = int64_t(kMaxBlocks) * kRegion;

// A word's tag: the call number's low 24 bits, the exchange's signature in bits 24-30, the poison bit 31.
constexpr uint32_t kCallMask = (1u << 24) - 1;
constexpr uint32_t kPoison = 1u << 31;

// A failure record (lkcnn/training/sync_batchnorm.py decodes it): reason in bits 60-63, the exchange's kind in 56-59,
// the rank that did not answer in 52-55, the exchange's size in 32-51, the block's call number in 0-31.
enum Reason : uint64_t { kTimedOut = 1, kPeerFailed = 2, kDiverged = 3 };
enum Kind : uint64_t { kSum = 1, kStats = 2 };

struct Peers {
  char* base[kMaxWorld];  // every rank's workspace, mapped into this process
  char* own;              // base[rank] (a dynamic index into a kernel parameter array would copy it to the stack)
  uint64_t* host_status;  // mapped host memory, where the host reads the failure record
  uint64_t timeout_ns;    // how long a wait may take
  uint64_t what;          // the exchange's kind and size, in the failure record's bits
  uint32_t sig;           // the exchange's signature, in tags' bits 24-30
  int world, rank;
};

__device__ uint64_t* region_at(char* base, int parity, int from, int world, int block) {
  return reinterpret_cast<uint64_t*>(base + kDataOffset) + (int64_t(parity) * world + from) * kSlotWords +
         int64_t(block) * kRegion;
}
__device__ unsigned long long* status_of(const Peers& p) {
  return reinterpret_cast<unsigned long long*>(p.own) + kStatusWord;
}

__device__ void store_word(uint64_t* p, uint64_t word) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(word) : "memory");
}
__device__ void store_word(uint64_t* p, float value, uint32_t tag) {
  store_word(p, (uint64_t(tag) << 32) | __float_as_uint(value));
}
__device__ uint64_t load_word(const uint64_t* p) {
  uint64_t word;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(word) : "l"(p) : "memory");
  return word;
}
__device__ uint64_t load_status(const Peers& p) {
  uint64_t word;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(word) : "l"(status_of(p)) : "memory");
  return word;
}
__device__ uint64_t global_time_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// This rank's first failure, recorded in the workspace (later calls read it there) and in the host's word; whether
// this thread's record was the first (then its block poisons the peers' words).
__device__ bool record_failure(const Peers& p, uint64_t reason, int peer, uint32_t call) {
  const uint64_t record = (reason << 60) | p.what | (uint64_t(peer) << 52) | call;
  if (atomicCAS(status_of(p), 0ull, (unsigned long long)record) != 0ull) return false;
  store_word(p.host_status, record);
  __threadfence_system();
  return true;
}

// One thread's waits in one call: when they end (set at the first wait that finds nothing), whether one failed, and
// whether this thread recorded the failure.
struct Wait {
  uint64_t deadline = 0;
  bool failed = false, recorded = false;
};

// The value at p (sent by rank `from` across NVLink) once it carries `tag`; NaN once this call has failed: a
// poisoned word (the peer failed), a word of this call number for another exchange (the ranks' calls diverged),
// nothing new by the deadline, or a failure that another thread of this rank recorded.
__device__ float await_word(const uint64_t* p, uint32_t tag, int from, uint32_t call, const Peers& peers, Wait& w) {
  if (w.failed) return __int_as_float(0x7fffffff);
  uint64_t word = load_word(p);
  while (uint32_t(word >> 32) != tag) {
    const uint32_t got = uint32_t(word >> 32);
    uint64_t reason = 0;
    if (got & kPoison) {
      reason = kPeerFailed;
    } else if ((got & kCallMask) == (tag & kCallMask)) {  // stale words carry call - 2
      reason = kDiverged;
    } else {
      const uint64_t now = global_time_ns();
      if (w.deadline == 0) {
        w.deadline = now + peers.timeout_ns;
      } else if (now >= w.deadline) {
        reason = kTimedOut;
      } else if (load_status(peers) != 0) {
        w.failed = true;
        return __int_as_float(0x7fffffff);
      }
    }
    if (reason != 0) {
      w.failed = true;
      w.recorded = record_failure(peers, reason, from, call);
      return __int_as_float(0x7fffffff);
    }
    word = load_word(p);
  }
  return __uint_as_float(uint32_t(word));
}

// Every word this rank sends to its peers, in both halves and every block's region, poisoned: their waits on this
// rank fail at once instead of at their deadline.
__device__ void poison_peers(const Peers& p, int t) {
  const uint64_t poison = uint64_t(kPoison) << 32;
#pragma unroll
  for (int r = 0; r < kMaxWorld; ++r) {
    if (r < p.world && r != p.rank) {
      for (int parity = 0; parity < 2; ++parity) {
        uint64_t* slot = region_at(p.base[r], parity, p.rank, p.world, 0);
        for (int64_t i = t; i < kSlotWords; i += kThreads) store_word(slot + i, poison);
      }
    }
  }
}

// The ranks' values combined by Op: load(block, thread) gives this rank's pair, finish(block, thread, pairs, world)
// gets every rank's pair for the same position, in rank order (so every rank computes the same result); fail(block,
// thread) writes NaN outputs where the exchange failed.
template <class Op>
__global__ void __launch_bounds__(kThreads) exchange_kernel(Peers p, Op op) {
  const int b = blockIdx.x, t = threadIdx.x;
  uint64_t* counter = reinterpret_cast<uint64_t*>(p.own) + b;
  const uint64_t call = *counter + 1;
  const int parity = int(call & 1);
  const uint32_t tag = p.sig << 24 | (uint32_t(call) & kCallMask);  // the word written two calls ago carries call - 2
  Wait w;
  w.failed = load_status(p) != 0;  // an earlier call failed: this one fails at once (no stale statistics)
  if (!w.failed) {
    const float2 mine = op.load(b, t);
#pragma unroll  // constant indices keep p.base in registers
    for (int r = 0; r < kMaxWorld; ++r) {
      if (r < p.world) {
        uint64_t* dst = region_at(p.base[r], parity, p.rank, p.world, b);
        store_word(dst + t, mine.x, tag);
        store_word(dst + kThreads + t, mine.y, tag);
      }
    }
  }
  float2 pairs[kMaxWorld];
#pragma unroll
  for (int r = 0; r < kMaxWorld; ++r) {
    if (r < p.world) {
      const uint64_t* src = region_at(p.own, parity, r, p.world, b);
      const float x = await_word(src + t, tag, r, uint32_t(call), p, w);
      pairs[r] = make_float2(x, await_word(src + kThreads + t, tag, r, uint32_t(call), p, w));
    }
  }
  if (!__syncthreads_or(w.failed)) {  // (also: every thread has read the counter)
    op.finish(b, t, pairs, p.world);
    if (t == 0) *counter = call;
    return;
  }
  op.fail(b, t);
  if (__syncthreads_or(w.recorded)) poison_peers(p, t);
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
  __device__ void fail(int b, int t) const {
    const int64_t i = int64_t(b) * kRegion + t;
    if (i < n) out[i] = __int_as_float(0x7fffffff);
    if (i + kThreads < n) out[i + kThreads] = __int_as_float(0x7fffffff);
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
  __device__ void fail(int b, int t) const {  // the running statistics keep their last good values
    const int64_t c = int64_t(b) * kThreads + t;
    if (c < C) mean_out[c] = invstd_out[c] = __int_as_float(0x7fffffff);
  }
};

Peers make_peers(const std::vector<int64_t>& peers, int64_t rank, int64_t status, double timeout_s, Kind kind,
                 int64_t size) {
  TORCH_CHECK(!peers.empty() && peers.size() <= size_t(kMaxWorld), "lkcnn exchange: ", peers.size(),
              " ranks; it takes 1 to ", kMaxWorld, " (the GPUs of one machine)");
  TORCH_CHECK(rank >= 0 && rank < int64_t(peers.size()), "lkcnn exchange: rank ", rank, " of ", peers.size());
  TORCH_CHECK(status != 0, "lkcnn exchange: status must be the address of an exchange_status_word()");
  TORCH_CHECK(timeout_s > 0 && timeout_s < 1e9, "lkcnn exchange: timeout_s must be a positive number of seconds, got ",
              timeout_s);
  Peers p{};
  for (size_t r = 0; r < peers.size(); ++r) p.base[r] = reinterpret_cast<char*>(peers[r]);
  p.own = p.base[rank];
  p.host_status = reinterpret_cast<uint64_t*>(status);
  p.timeout_ns = uint64_t(timeout_s * 1e9);
  p.what = uint64_t(kind) << 56 | uint64_t(size & 0xfffff) << 32;
  // Fibonacci hashing of (kind, size): exchanges of other kinds or sizes differ in their tags (but 1 in 128 pairs)
  p.sig = uint32_t(((uint64_t(kind) << 32 | uint64_t(size)) * 0x9E3779B97F4A7C15ull) >> 57);
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

at::Tensor exchange_status_word() {
  // cudaHostAllocMapped: the kernels store into it over PCIe while the host reads it, no copy, no synchronization
  void* word = nullptr;
  C10_CUDA_CHECK(cudaHostAlloc(&word, sizeof(int64_t), cudaHostAllocMapped | cudaHostAllocPortable));
  *static_cast<volatile int64_t*>(word) = 0;
  void* device = nullptr;
  C10_CUDA_CHECK(cudaHostGetDevicePointer(&device, word, 0));
  TORCH_CHECK(device == word, "lkcnn exchange: mapped host memory has another address on the GPU (no unified "
              "addressing): set module.sync_bn_exchange=torch");
  return at::from_blob(word, {1}, [](void* p) { (void)cudaFreeHost(p); }, at::TensorOptions().dtype(at::kLong));
}

void exchange_sum(const at::Tensor& input, at::Tensor& out, const std::vector<int64_t>& peers, int64_t rank,
                  int64_t status, double timeout_s) {
  check_vector(input, input, "input");
  check_vector(out, input, "out");
  const int64_t n = input.numel();
  TORCH_CHECK(n <= exchange_max_values(), "lkcnn exchange_sum: ", n, " values; it takes at most ",
              exchange_max_values());
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(input.device());
  launch((n + kRegion - 1) / kRegion, make_peers(peers, rank, status, timeout_s, kSum, n),
         SumOp{input.data_ptr<float>(), out.data_ptr<float>(), n});
}

void exchange_batch_norm_stats(const at::Tensor& mean, const at::Tensor& var, at::Tensor& running_mean,
                               at::Tensor& running_var, at::Tensor& mean_out, at::Tensor& invstd_out, double momentum,
                               double eps, int64_t count, const std::vector<int64_t>& peers, int64_t rank,
                               int64_t status, double timeout_s) {
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
  launch((C + kThreads - 1) / kThreads, make_peers(peers, rank, status, timeout_s, kStats, C), op);
}

}  // namespace lkcnn
