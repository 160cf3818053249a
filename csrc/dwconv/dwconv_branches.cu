// Several small depthwise convolutions (k x k taps, dilation r, "same" padding) of one channels_last input, each pass
// in one launch: the forward writes every branch's output from one read of x, the input gradient sums every
// branch's contribution from their output gradients in one write of dx, the weight gradient computes every dilated
// branch's kernel gradient (an undilated branch's is cuDNN's, which is faster there). These are the
// re-parameterizable blocks' small branches: RepLKNet's 5x5 next to the large kernel, UniRepLKNet's dilated branches
// (5x5 r1, 7x7 r2, 3x3 r3-5 next to its 13x13).
//
// Such a pass is bound by memory (a 5x5 pass over a bf16 map moves 4 bytes per 25 FMAs per channel), so the kernels
// read NHWC directly, where one pixel's channels are contiguous: a thread owns VEC channels (16 bytes) of V = 4
// consecutive output columns of one row. For each kernel row it streams the V + r(k-1) input columns that row's
// taps meet through one 16-byte load each and multiplies each into every output it reaches (k and r are compile-time
// constants, so the register window is unrolled and no padded tap is visited at the map's sides; rows outside the
// map are skipped). Consecutive threads take consecutive channel groups of one pixel, so a warp's loads and stores
// are whole 128-byte lines. Accumulation is fp32; the weights are a (taps, C) table in x's dtype (16-bit kernels are
// trained in that dtype under autocast anyway), a thread's VEC channels of one tap being one 16-byte load.
//
// The input gradient is the forward's correlation with each kernel flipped (rows and columns), summed over the
// branches before the one store. The weight gradient gives each block one kernel row of one branch and a range of
// (sample, row) output rows: a thread accumulates k x VEC taps over its strips, the block sums its threads' partials
// through shared memory and adds them to the fp32 table with one atomic per tap and channel.
//
// The forward and input gradient of a single 16-bit dilation-1 branch on maps taller than 8 rows (RepLKNet's 5x5)
// run on the tensor cores instead (dwconv_branches_tc.cu).
#include "dwconv.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace lkcnn {
namespace {

constexpr int kV = 4;          // output columns per thread
constexpr int kThreads = 256;  // threads per block, every kernel here

// The (k, r) branch shapes with kernels: RepLKNet's and ConvNeXt-LK's small kernels (3, 5, 7) and UniRepLKNet's
// dilated branches for every large kernel it defines (its table: 5x5 r1, 3-9 taps at r 2-7).
#define LKCNN_BRANCH_SHAPES(X) \
  X(3, 1) X(5, 1) X(7, 1) X(3, 2) X(5, 2) X(7, 2) X(9, 2) X(3, 3) X(3, 4) X(3, 5) X(3, 7)

int shape_code(int k, int r) {
  int code = 0;
#define LKCNN_CODE(K, R) \
  if (k == K && r == R) return code; \
  ++code;
  LKCNN_BRANCH_SHAPES(LKCNN_CODE)
#undef LKCNN_CODE
  return -1;
}

template <typename T> struct Vec;  // VEC channels of T as one 16-byte word, and their conversion to/from float
template <> struct Vec<float> {
  static constexpr int n = 4;
  __device__ static void load(const float* p, float (&v)[4]) {
    const float4 q = __ldg(reinterpret_cast<const float4*>(p));
    v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
  }
  __device__ static void store(float* p, const float (&v)[4]) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  }
};
template <typename H2, typename T> struct Vec16 {  // half and bfloat16: 8 channels as 4 packed pairs
  static constexpr int n = 8;
  __device__ static float2 to2(const H2& h);
  __device__ static void load(const T* p, float (&v)[8]) {
    const uint4 q = __ldg(reinterpret_cast<const uint4*>(p));
    const H2* h = reinterpret_cast<const H2*>(&q);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = to2(h[i]);
      v[2 * i] = f.x; v[2 * i + 1] = f.y;
    }
  }
  __device__ static H2 from2(float a, float b);
  __device__ static void store(T* p, const float (&v)[8]) {
    uint4 q;
    H2* h = reinterpret_cast<H2*>(&q);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = from2(v[2 * i], v[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = q;
  }
};
template <> __device__ float2 Vec16<__half2, at::Half>::to2(const __half2& h) { return __half22float2(h); }
template <> __device__ __half2 Vec16<__half2, at::Half>::from2(float a, float b) { return __floats2half2_rn(a, b); }
template <> __device__ float2 Vec16<__nv_bfloat162, at::BFloat16>::to2(const __nv_bfloat162& h) {
  return __bfloat1622float2(h);
}
template <> __device__ __nv_bfloat162 Vec16<__nv_bfloat162, at::BFloat16>::from2(float a, float b) {
  return __floats2bfloat162_rn(a, b);
}
template <> struct Vec<at::Half> : Vec16<__half2, at::Half> {};
template <> struct Vec<at::BFloat16> : Vec16<__nv_bfloat162, at::BFloat16> {};

constexpr int kMaxBranches = 8;  // pointer slots; the weight gradient passes x in the last, so 7 branches at most
struct Branches {
  int count;
  int code[kMaxBranches];  // shape_code(k, r)
  int tap0[kMaxBranches];  // the branch's first row in the (taps, C) weight table
};

template <typename T> struct Ptrs {
  const T* src[kMaxBranches];  // forward: x for every branch; input gradient: each branch's grad_out
  T* dst[kMaxBranches];        // forward: each branch's output; input gradient: dx (dst[0])
};

struct Geom {
  int N, H, W, C, strips;  // strips = ceil(W / kV)
};

// acc[o][e] (+)= the K x K taps (dilation R) of w (rows flipped with FLIP) applied to src around output (n, h,
// w0 + o), channels c .. c + VEC.
template <int K, int R, bool FLIP, typename T, int VEC>
__device__ __forceinline__ void accumulate(const T* __restrict__ src, const T* __restrict__ w, const Geom& g,
                                           int n, int h, int w0, int c, float (&acc)[kV][VEC]) {
  constexpr int P = R * (K - 1) / 2, WIN = kV + R * (K - 1);
#pragma unroll 1  // one kernel row's taps and input window live at a time (registers: occupancy for a memory-bound pass)
  for (int i = 0; i < K; ++i) {
    const int hi = h - P + R * i;
    if (hi < 0 || hi >= g.H) continue;
    float wr[K][VEC];
#pragma unroll
    for (int j = 0; j < K; ++j) {
      const int tap = FLIP ? (K - 1 - i) * K + (K - 1 - j) : i * K + j;
      Vec<T>::load(w + int64_t(tap) * g.C + c, wr[j]);
    }
    const T* row = src + (int64_t(n) * g.H + hi) * g.W * g.C + c;
#pragma unroll
    for (int q = 0; q < WIN; ++q) {
      const int col = w0 - P + q;
      float xv[VEC];
      if (col >= 0 && col < g.W) {
        Vec<T>::load(row + int64_t(col) * g.C, xv);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) xv[e] = 0.f;
      }
#pragma unroll
      for (int j = 0; j < K; ++j) {
        const int o = q - R * j;  // the output this (input column, tap) pair reaches
        if (o < 0 || o >= kV) continue;
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[o][e] = fmaf(wr[j][e], xv[e], acc[o][e]);
      }
    }
  }
}

template <bool FLIP, typename T, int VEC>
__device__ __forceinline__ void accumulate_shape(int code, const T* src, const T* w, const Geom& g, int n, int h,
                                                 int w0, int c, float (&acc)[kV][VEC]) {
  int next = 0;
#define LKCNN_CASE(K, R) \
  if (code == next++) return accumulate<K, R, FLIP>(src, w, g, n, h, w0, c, acc);
  LKCNN_BRANCH_SHAPES(LKCNN_CASE)
#undef LKCNN_CASE
}

template <typename T, int VEC>
__device__ __forceinline__ void store_strip(T* dst, const Geom& g, int n, int h, int w0, int c,
                                            const float (&acc)[kV][VEC]) {
  T* row = dst + (int64_t(n) * g.H + h) * g.W * g.C + c;
#pragma unroll
  for (int o = 0; o < kV; ++o)
    if (w0 + o < g.W) Vec<T>::store(row + int64_t(w0 + o) * g.C, acc[o]);
}

// Forward (BWD false): dst[b] = branch b of src[0]. Input gradient (BWD true): dst[0] = sum over b of branch b's
// flipped kernel applied to src[b]. One thread per (n, h, strip, channel group), channel groups fastest.
template <typename T, bool BWD>
__global__ void __launch_bounds__(kThreads, 2) branches_conv_kernel(const __grid_constant__ Ptrs<T> p,
                                                                 const T* __restrict__ w,
                                                                 const __grid_constant__ Branches br, Geom g) {
  constexpr int VEC = Vec<T>::n;
  const int groups = g.C / VEC;
  const int64_t item = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (item >= int64_t(g.N) * g.H * g.strips * groups) return;
  const int c = int(item % groups) * VEC;
  int64_t rest = item / groups;
  const int w0 = int(rest % g.strips) * kV;
  rest /= g.strips;
  const int h = int(rest % g.H), n = int(rest / g.H);
  float acc[kV][VEC];
  for (int b = 0; b < br.count; ++b) {
    if (!BWD || b == 0) {
#pragma unroll
      for (int o = 0; o < kV; ++o)
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[o][e] = 0.f;
    }
    accumulate_shape<BWD>(br.code[b], BWD ? p.src[b] : p.src[0], w + int64_t(br.tap0[b]) * g.C, g, n, h, w0, c,
                          acc);
    if (!BWD) store_strip(p.dst[b], g, n, h, w0, c, acc);
  }
  if (BWD) store_strip(p.dst[0], g, n, h, w0, c, acc);
}

// The weight gradient of one kernel row i of a K x K, dilation-R branch: acc[j][e] += dy[n, h, w] * x[n, h - P + R i,
// w - P + R j] over the thread's strips, then summed over the block's threads of one channel group and added to dw
// (the branch's rows of the table). A strip is kV output columns R apart (w = q + R (c kV + o), o < kV, for residue q
// and chunk c), so tap j of output o meets input column t = o + j of the strip's R-spaced window: kV + K - 1 loads
// of x per strip, each used by up to min(K, kV) taps, at any dilation (kV + R (K - 1) loads of contiguous columns).
template <int K, int R, typename T>
__device__ __forceinline__ void wgrad_row(const T* __restrict__ dy, const T* __restrict__ x, float* __restrict__ dw,
                                          const Geom& g, int i, int64_t row_begin, int64_t row_end, int c, int gi,
                                          int groups_in_block, int slot, int slots, bool active, float* red) {
  constexpr int P = R * (K - 1) / 2, WIN = kV + K - 1, VEC = Vec<T>::n;
  float acc[K][VEC];
#pragma unroll
  for (int j = 0; j < K; ++j)
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[j][e] = 0.f;
  const int strips = R * ((g.W + R * kV - 1) / (R * kV));  // R residue classes, each in chunks of kV columns
  const int64_t units = (row_end - row_begin) * strips;
  for (int64_t u = slot; active && u < units; u += slots) {
    const int64_t r = row_begin + u / strips;
    const int s = int(u % strips);
    const int w0 = s % R + R * (s / R) * kV;  // the strip's first output column; the others R apart
    const int h = int(r % g.H), n = int(r / g.H);
    const int hi = h - P + R * i;
    if (hi < 0 || hi >= g.H) continue;
    float d[kV][VEC];
    const T* drow = dy + (int64_t(n) * g.H + h) * g.W * g.C + c;
#pragma unroll
    for (int o = 0; o < kV; ++o) {
      if (w0 + R * o < g.W) {
        Vec<T>::load(drow + int64_t(w0 + R * o) * g.C, d[o]);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) d[o][e] = 0.f;
      }
    }
    const T* xrow = x + (int64_t(n) * g.H + hi) * g.W * g.C + c;
#pragma unroll
    for (int t = 0; t < WIN; ++t) {
      const int col = w0 - P + R * t;
      if (col < 0 || col >= g.W) continue;
      float xv[VEC];
      Vec<T>::load(xrow + int64_t(col) * g.C, xv);
#pragma unroll
      for (int j = 0; j < K; ++j) {
        const int o = t - j;
        if (o < 0 || o >= kV) continue;
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[j][e] = fmaf(d[o][e], xv[e], acc[j][e]);
      }
    }
  }
  // Block sum per (tap, channel): the threads of channel group gi are gi + t * groups_in_block, t < slots (the kernel's
  // split, which kThreads / slots does not give back where groups_in_block does not divide kThreads). red holds
  // channel e of thread t at e * kThreads + t, so a warp's stores and loads fall in 32 different banks.
#pragma unroll
  for (int j = 0; j < K; ++j) {
    __syncthreads();
#pragma unroll
    for (int e = 0; e < VEC; ++e) red[e * kThreads + threadIdx.x] = acc[j][e];
    __syncthreads();
    if (slot == 0 && active) {
      for (int e = 0; e < VEC; ++e) {
        float s = 0.f;
        for (int t = 0; t < slots; ++t) s += red[e * kThreads + gi + t * groups_in_block];
        atomicAdd(dw + int64_t(i * K + j) * g.C + c + e, s);
      }
    }
  }
}

// A block: one kernel row of one branch (the RowTable lists them) over a range of `rows_per_block` (sample, row)
// output rows and a block of channel groups. A block's threads: `groups_in_block` channel groups
// (fastest) x `slots` strip slots.
struct RowTable {
  int branch[64];
  int row[64];
};

template <typename T>
__global__ void __launch_bounds__(kThreads, 2) branches_wgrad_kernel(const __grid_constant__ Ptrs<T> p,
                                                                  float* __restrict__ dw,
                                                                  const __grid_constant__ Branches br,
                                                                  const __grid_constant__ RowTable rt, int krows, Geom g,
                                                                  int rows_per_block, int channel_blocks) {
  constexpr int VEC = Vec<T>::n;
  __shared__ float red[kThreads * VEC];
  const int groups = g.C / VEC;
  const int groups_in_block = min(groups, kThreads);
  const int slots = kThreads / groups_in_block;
  // blockIdx.x: kernel row fastest, so the blocks that read one range of dy and x run together and all but the
  // first find it in L2 (with the row as a grid dimension of its own, each row's blocks would stream both tensors
  // from memory again)
  const int krow = blockIdx.x % krows, range = blockIdx.x / krows;
  const int cb = range % channel_blocks;
  const int64_t row_begin = int64_t(range / channel_blocks) * rows_per_block;
  const int64_t row_end = min(row_begin + rows_per_block, int64_t(g.N) * g.H);
  const int gi = threadIdx.x % groups_in_block, slot = threadIdx.x / groups_in_block;
  const int group = cb * groups_in_block + gi;
  const bool active = group < groups && slot < slots;
  const int c = (active ? group : 0) * VEC;
  const int b = rt.branch[krow], i = rt.row[krow];
  float* dwb = dw + int64_t(br.tap0[b]) * g.C;
  int next = 0;
  // Dilated branches only: an undilated one's weight gradient is cuDNN's (branches_wgrad checks).
#define LKCNN_CASE(K, R)                                                                                     \
  if (br.code[b] == next++) {                                                                                \
    if constexpr (R > 1)                                                                                     \
      wgrad_row<K, R>(p.src[b], p.src[kMaxBranches - 1], dwb, g, i, row_begin, row_end, c, gi,               \
                      groups_in_block, slot, slots, active, red);                                            \
    return;                                                                                                  \
  }
  LKCNN_BRANCH_SHAPES(LKCNN_CASE)
#undef LKCNN_CASE
}

int vec_for(at::ScalarType t) { return t == at::kFloat ? 4 : 8; }

void check_input(const at::Tensor& t, const at::Tensor& ref, const char* what) {
  TORCH_CHECK(t.is_cuda() && t.device() == ref.device() && t.scalar_type() == ref.scalar_type() &&
                  t.sizes() == ref.sizes() && t.is_contiguous(at::MemoryFormat::ChannelsLast) &&
                  reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0,
              what, ": every tensor must be a channels_last CUDA tensor of x's shape, dtype and device, 16-byte aligned");
}

Branches make_branches(const std::vector<int64_t>& ks, const std::vector<int64_t>& rs) {
  TORCH_CHECK(!ks.empty() && ks.size() == rs.size() && int(ks.size()) < kMaxBranches,
              "lkcnn dwconv2d_branches: 1 to ", kMaxBranches - 1, " branches, one dilation each");
  Branches br{};
  br.count = int(ks.size());
  int tap = 0;
  for (int b = 0; b < br.count; ++b) {
    br.code[b] = shape_code(int(ks[b]), int(rs[b]));
    TORCH_CHECK(br.code[b] >= 0, "lkcnn dwconv2d_branches: no kernel for a ", ks[b], "x", ks[b], " branch with dilation ",
                rs[b]);
    br.tap0[b] = tap;
    tap += int(ks[b] * ks[b]);
  }
  return br;
}

Geom make_geom_nhwc(const at::Tensor& x) {
  return Geom{int(x.size(0)), int(x.size(2)), int(x.size(3)), int(x.size(1)), ceil_div(int(x.size(3)), kV)};
}

template <typename T, bool BWD>
void launch_conv(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst, const at::Tensor& w,
                 const Branches& br, const Geom& g) {
  Ptrs<T> p{};
  for (size_t b = 0; b < src.size(); ++b) p.src[b] = src[b].const_data_ptr<T>();
  for (size_t b = 0; b < dst.size(); ++b) p.dst[b] = dst[b].mutable_data_ptr<T>();
  const int64_t items = int64_t(g.N) * g.H * g.strips * (g.C / Vec<T>::n);
  const int64_t blocks = (items + kThreads - 1) / kThreads;
  TORCH_CHECK(blocks < INT32_MAX, "lkcnn dwconv2d_branches: the tensor is too large for one launch");
  if (blocks == 0) return;
  branches_conv_kernel<T, BWD><<<unsigned(blocks), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      p, w.const_data_ptr<T>(), br, g);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void launch_wgrad(const std::vector<at::Tensor>& dys, const at::Tensor& x, at::Tensor& dw, const Branches& br,
                  const std::vector<int64_t>& ks, const Geom& g) {
  Ptrs<T> p{};
  for (size_t b = 0; b < dys.size(); ++b) p.src[b] = dys[b].const_data_ptr<T>();
  p.src[kMaxBranches - 1] = x.const_data_ptr<T>();  // the last slot: at most kMaxBranches - 1 branches
  RowTable rt{};
  int rows = 0;
  for (int b = 0; b < br.count; ++b)
    for (int i = 0; i < int(ks[b]); ++i, ++rows) {
      TORCH_CHECK(rows < 64, "lkcnn dwconv2d_branches: at most 64 kernel rows over all branches");
      rt.branch[rows] = b;
      rt.row[rows] = i;
    }
  const int groups = g.C / Vec<T>::n;
  const int groups_in_block = std::min(groups, kThreads), slots = kThreads / groups_in_block;
  const int channel_blocks = ceil_div(groups, groups_in_block);
  // About 8 strips per thread: enough work to amortize the block's reduction, enough blocks to fill the GPU.
  const int64_t out_rows = int64_t(g.N) * g.H;
  const int rows_per_block = int(std::max<int64_t>(1, std::min<int64_t>(out_rows, int64_t(8) * slots / g.strips)));
  const int64_t row_blocks = (out_rows + rows_per_block - 1) / rows_per_block;
  TORCH_CHECK(row_blocks * channel_blocks * rows < INT32_MAX, "lkcnn dwconv2d_branches: the tensor is too large");
  if (out_rows == 0) return;
  branches_wgrad_kernel<T><<<unsigned(row_blocks * channel_blocks * rows), kThreads, 0,
                             at::cuda::getCurrentCUDAStream()>>>(p, dw.mutable_data_ptr<float>(), br, rt, rows, g,
                                                                 rows_per_block, channel_blocks);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename F> void dispatch(at::ScalarType t, F&& f) {
  if (t == at::kFloat) f(float{});
  else if (t == at::kHalf) f(at::Half{});
  else f(at::BFloat16{});
}

}  // namespace

bool branches_supported(const at::Tensor& x, const std::vector<int64_t>& ks, const std::vector<int64_t>& rs) {
  const auto t = x.scalar_type();
  if (!x.is_cuda() || x.dim() != 4 || (t != at::kFloat && t != at::kHalf && t != at::kBFloat16)) return false;
  if (!x.is_contiguous(at::MemoryFormat::ChannelsLast) || x.size(1) % vec_for(t) != 0) return false;
  if (reinterpret_cast<uintptr_t>(x.const_data_ptr()) % 16 != 0) return false;
  if (ks.empty() || ks.size() != rs.size() || ks.size() >= size_t(kMaxBranches)) return false;
  int64_t rows = 0;
  for (size_t b = 0; b < ks.size(); ++b) {
    if (shape_code(int(ks[b]), int(rs[b])) < 0) return false;
    rows += ks[b];
  }
  return rows <= 64;
}

namespace {

// Every entry point's checks: ref (x, or dx) is supported, one tensor per branch of its shape, dtype and layout, and
// the weight table where one is given (nullptr for the weight gradient). Returns the branch table.
Branches checked(const at::Tensor& ref, const std::vector<at::Tensor>& per_branch, const at::Tensor* w,
                 const std::vector<int64_t>& ks, const std::vector<int64_t>& rs, const char* what) {
  TORCH_CHECK(per_branch.size() == ks.size(), what, ": one tensor per branch");
  TORCH_CHECK(branches_supported(ref, ks, rs), what, ": unsupported input or branches");
  for (const auto& t : per_branch) check_input(t, ref, what);
  int64_t taps = 0;
  for (auto k : ks) taps += k * k;
  TORCH_CHECK(w == nullptr || (w->is_cuda() && w->scalar_type() == ref.scalar_type() && w->is_contiguous() &&
                               w->dim() == 2 && w->size(0) == taps && w->size(1) == ref.size(1) &&
                               reinterpret_cast<uintptr_t>(w->const_data_ptr()) % 16 == 0),
              what, ": the weights must be a (taps, C) table in x's dtype");
  return make_branches(ks, rs);
}

}  // namespace

void branches_fwd(const at::Tensor& x, const at::Tensor& w, const std::vector<int64_t>& ks,
                  const std::vector<int64_t>& rs, const std::vector<at::Tensor>& ys) {
  const Branches br = checked(x, ys, &w, ks, rs, "lkcnn dwconv2d_branches forward");
  const c10::cuda::CUDAGuard guard(x.device());
  if (ks.size() == 1 && branch_tc_fits(x, ks[0], rs[0])) return launch_branch_tc(x, w, ys[0], ks[0], false);
  dispatch(x.scalar_type(), [&](auto tag) { launch_conv<decltype(tag), false>({x}, ys, w, br, make_geom_nhwc(x)); });
}

void branches_bwd_input(const std::vector<at::Tensor>& dys, const at::Tensor& w, const std::vector<int64_t>& ks,
                        const std::vector<int64_t>& rs, const at::Tensor& dx) {
  const Branches br = checked(dx, dys, &w, ks, rs, "lkcnn dwconv2d_branches input gradient");
  const c10::cuda::CUDAGuard guard(dx.device());
  if (ks.size() == 1 && branch_tc_fits(dx, ks[0], rs[0])) return launch_branch_tc(dys[0], w, dx, ks[0], true);
  dispatch(dx.scalar_type(), [&](auto tag) { launch_conv<decltype(tag), true>(dys, {dx}, w, br, make_geom_nhwc(dx)); });
}

at::Tensor branches_wgrad(const std::vector<at::Tensor>& dys, const at::Tensor& x, const std::vector<int64_t>& ks,
                          const std::vector<int64_t>& rs) {
  const Branches br = checked(x, dys, nullptr, ks, rs, "lkcnn dwconv2d_branches weight gradient");
  for (auto r : rs)
    TORCH_CHECK(r > 1, "lkcnn dwconv2d_branches weight gradient: dilated branches only (cuDNN's is faster undilated)");
  const c10::cuda::CUDAGuard guard(x.device());
  int64_t taps = 0;
  for (auto k : ks) taps += k * k;
  at::Tensor dw = at::zeros({taps, x.size(1)}, x.options().dtype(at::kFloat));
  dispatch(x.scalar_type(), [&](auto tag) { launch_wgrad<decltype(tag)>(dys, x, dw, br, ks, make_geom_nhwc(x)); });
  return dw;
}

}  // namespace lkcnn
