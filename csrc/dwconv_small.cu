// Small maps (up to 16 x 16) whose kernel reaches most of the map, as in RepLKNet's last stages (14x14 with 27x27,
// 7x7 with 13x13): all three passes on the FMA pipes, without the padded rows, every dtype.
//
// On such a map the banded kernels spend most of their work on padding (a 27x27 kernel over a 14x14 map is 27%
// in-bounds taps). Here one block takes one channel of 32 samples, one sample per lane, and works on whole map rows
// held in registers: every (input column, output column) pair of an MW-wide row (MW = 7, 8, 14 or 16: the map's
// width rounded up to one of these, exact for the 7 and 14 of 224-px inputs) meets the kernel row through E, the
// channel's kernel re-indexed by offset (E[a][b] = w[a - (H-1) + ph][b - (MW-1) + pw], zero outside the kernel).
// Rows are visited only where the kernel reaches; columns are not skipped, so callers send a map here only where most
// column pairs are taps (small_map_fits). All lanes of a warp run the same loop (lanes differ only in the sample),
// and E is read with broadcast loads.
//
// Forward and input gradient (flipped kernel, as for the other forward kernels): warp w owns output rows 2w, 2w+1
// in 2 x MW fp32 accumulators. Weight gradient: warp w accumulates kernel rows w, w + warps, ... (in E's offsets)
// over its lanes' samples, reduces them across lanes and adds them to dw (one atomic per tap and block).
#include "dwconv.h"
#include "tile.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

namespace lkcnn {
namespace {

constexpr int kLanes = 32;    // samples per block
constexpr int kRows = 2;      // output rows per forward thread
constexpr int kMaxSide = 16;

// Columns of a kernel computing MW of them: staged rows of LD floats (16-byte loads), rows of E read as ER floats
// (offsets 0 .. 2MW-2) and EW apart, EW a power of two for the weight gradient's reduce-scatter.
template <int MW>
struct Cols {
  static constexpr int LD = (MW + 3) / 4 * 4;
  static constexpr int ER = (2 * MW - 1 + 3) / 4 * 4;
  static constexpr int EW = ER <= 16 ? 16 : 32;
};

// The MW that maps W wide run with.
int map_cols(int64_t W) { return W <= 7 ? 7 : W <= 8 ? 8 : W <= 14 ? 14 : 16; }

// Staged samples are H x LD floats apart plus 4: an odd number of 16-byte groups, so the 8 lanes of a quarter-warp
// reading 16 bytes each at the same offset of their samples hit distinct bank groups.
__host__ __device__ constexpr int sample_stride(int H, int LD) { return H * LD + 4; }

// f(r, col) for every map position (r < H, col < LD), shared among the block's threads. Staging and storing take a
// position per thread and walk the block's samples there, so a position's index arithmetic is done once, not once
// per element: the generic box loop (tile.cuh) spent ~58 instructions per element, 40% of the forward's
// instructions at 14x14 (Nsight Compute, docs/performance.md v15).
template <int LD, typename F>
__device__ __forceinline__ void for_positions(int H, F f) {
  for (int i = threadIdx.x; i < H * LD; i += blockDim.x) f(i / LD, i % LD);
}

// Stage kLanes samples (from n0) of channel c as fp32 [sample][row][LD columns], zeros past the map and the batch.
// Loads go out in groups of 8 before their stores, so that 8 are in flight per thread.
template <int LD, typename T>
__device__ __forceinline__ void stage_samples(float* __restrict__ dst, const T* __restrict__ src, int64_t n0, int64_t c,
                                              const ConvGeom& g, int64_t s_n, int64_t s_c, int64_t s_h, int64_t s_w) {
  const int ss = sample_stride(g.H, LD);
  const int nn = int(min(int64_t(kLanes), g.N - n0));
  for_positions<LD>(g.H, [&](int r, int col) {
    const T* p = src + n0 * s_n + c * s_c + r * s_h + col * s_w;
    float* d = dst + r * LD + col;
    const int zn = col < g.W ? nn : 0;
#pragma unroll 1
    for (int z0 = 0; z0 < kLanes; z0 += 8, p += 8 * s_n, d += 8 * ss) {
      float v[8];
#pragma unroll
      for (int z = 0; z < 8; ++z) v[z] = z0 + z < zn ? static_cast<float>(p[z * s_n]) : 0.f;
#pragma unroll
      for (int z = 0; z < 8; ++z) d[z * ss] = v[z];
    }
  });
}

template <typename T, int MW>
__global__ void __launch_bounds__(256) dwconv_fwd_small_kernel(const T* __restrict__ x, const float* __restrict__ w,
                                                              const float* __restrict__ bias, T* __restrict__ y,
                                                              const ConvGeom g) {
  extern __shared__ __align__(16) float smem[];
  constexpr int LD = Cols<MW>::LD, ER = Cols<MW>::ER, EW = Cols<MW>::EW;
  const int H = g.H, ss = sample_stride(H, LD);
  float* sx = smem;                // kLanes samples; later the outputs
  float* se = smem + kLanes * ss;  // E: 2H - 1 rows
  const int64_t c = blockIdx.x % g.C, n0 = int64_t(blockIdx.x / g.C) * kLanes;
  const int tid = threadIdx.x, lane = tid % 32, p0 = tid / 32 * kRows;

  stage_samples<LD>(sx, x, n0, c, g, g.xs_n, g.xs_c, g.xs_h, g.xs_w);
  for (int i = tid; i < (2 * H - 1) * EW; i += blockDim.x) {
    const int kr = i / EW - (H - 1) + g.ph, kc = i % EW - (MW - 1) + g.pw;
    se[i] = i % EW < 2 * MW - 1 && kr >= 0 && kr < g.kh && kc >= 0 && kc < g.kw ? w[(c * g.kh + kr) * g.kw + kc] : 0.f;
  }
  __syncthreads();

  float acc[kRows][LD];  // columns MW .. LD-1 stay zero
#pragma unroll
  for (int u = 0; u < kRows; ++u)
#pragma unroll
    for (int q = 0; q < LD; ++q) acc[u][q] = 0.f;
  const float* xs = sx + lane * ss;
  // input rows within the kernel's reach of output rows p0 .. p0 + kRows - 1
  const int ir_end = min(H, p0 + kRows + g.ph);
  for (int ir = max(0, p0 - g.ph); ir < ir_end; ++ir) {
    float xr[LD];
#pragma unroll
    for (int j = 0; j < LD; j += 4) load4(xr + j, xs + ir * LD + j);
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      const int d = ir - (p0 + u);  // the same for the whole warp
      if (p0 + u >= H || d < -g.ph || d > g.ph) continue;
      float e[ER];
#pragma unroll
      for (int j = 0; j < ER; j += 4) load4(e + j, se + (d + H - 1) * EW + j);
#pragma unroll
      for (int ic = 0; ic < MW; ++ic)
#pragma unroll
        for (int q = 0; q < MW; ++q) acc[u][q] = fmaf(xr[ic], e[ic - q + MW - 1], acc[u][q]);
    }
  }

  __syncthreads();  // every warp is done reading the samples: their space takes the outputs
  float* ys = sx + lane * ss;
#pragma unroll
  for (int u = 0; u < kRows; ++u)
    if (p0 + u < H)
#pragma unroll
      for (int q = 0; q < LD; q += 4)
        *reinterpret_cast<float4*>(ys + (p0 + u) * LD + q) = make_float4(acc[u][q], acc[u][q + 1], acc[u][q + 2],
                                                                          acc[u][q + 3]);
  __syncthreads();
  const float bv = bias != nullptr ? bias[c] : 0.f;
  T* out = y + n0 * g.ys_n + c * g.ys_c;
  const int nn = int(min(int64_t(kLanes), g.N - n0));
  for_positions<LD>(H, [&](int r, int col) {
    if (col >= g.W) return;
    T* p = out + r * g.ys_h + col * g.ys_w;
    const float* s = sx + r * LD + col;
    for (int z = 0; z < nn; ++z, p += g.ys_n, s += ss) *p = T(*s + bv);
  });
}

// One step of reduce_scatter: lanes with bit h set keep (and receive) the upper h of the first 2h values, the
// others the lower h. Recursive on h so that every index is a compile-time constant (v stays in registers).
template <int h, int N>
__device__ __forceinline__ void reduce_scatter_step(float (&v)[N], int lane) {
  if constexpr (h >= 1) {
    const bool upper = lane & h;
#pragma unroll
    for (int i = 0; i < h; ++i) {
      const float send = upper ? v[i] : v[i + h];
      v[i] = (upper ? v[i + h] : v[i]) + __shfl_xor_sync(0xffffffffu, send, h);
    }
    reduce_scatter_step<h / 2>(v, lane);
  }
}

// v[i] summed over the warp's lanes, lane l ending with the sum of v[l % N] (N a power of two up to 32): N - 1
// shuffles for N values, not N * log2(32).
template <int N>
__device__ __forceinline__ float reduce_scatter(float (&v)[N], int lane) {
  reduce_scatter_step<N / 2>(v, lane);
  float s = v[0];
#pragma unroll
  for (int h = N; h < 32; h *= 2) s += __shfl_xor_sync(0xffffffffu, s, h);
  return s;
}

// g: grad_out read through xs_*, x through ys_* (make_geom(grad_out, x, ...)).
template <typename T, int MW>
__global__ void __launch_bounds__(256) dwconv_wgrad_small_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                                                float* __restrict__ dw, const ConvGeom g) {
  extern __shared__ __align__(16) float smem[];
  constexpr int LD = Cols<MW>::LD, EW = Cols<MW>::EW;
  const int H = g.H, ss = sample_stride(H, LD);
  float* sdy = smem;
  float* sx = smem + kLanes * ss;
  const int64_t c = blockIdx.x % g.C, n0 = int64_t(blockIdx.x / g.C) * kLanes;
  const int tid = threadIdx.x, lane = tid % 32, warps = blockDim.x / 32;

  stage_samples<LD>(sdy, dy, n0, c, g, g.xs_n, g.xs_c, g.xs_h, g.xs_w);
  stage_samples<LD>(sx, x, n0, c, g, g.ys_n, g.ys_c, g.ys_h, g.ys_w);
  __syncthreads();

  const float* dys = sdy + lane * ss;
  const float* xs = sx + lane * ss;
  // row offsets d = (input row) - (output row) that are kernel rows: |d| <= ph, and |d| <= H - 1
  const int d_lo = -min(g.ph, H - 1), d_hi = min(g.ph, H - 1);
  for (int d = d_lo + tid / 32; d <= d_hi; d += warps) {
    float acc[EW];  // acc[b]: the tap at column offset b - (MW - 1); those from 2MW - 1 on stay zero
#pragma unroll
    for (int b = 0; b < EW; ++b) acc[b] = 0.f;
    const int pr_end = min(H, H - d);
    for (int pr = max(0, -d); pr < pr_end; ++pr) {
      float gr[LD], xr[LD];
#pragma unroll
      for (int j = 0; j < LD; j += 4) {
        load4(gr + j, dys + pr * LD + j);
        load4(xr + j, xs + (pr + d) * LD + j);
      }
#pragma unroll
      for (int ic = 0; ic < MW; ++ic)
#pragma unroll
        for (int q = 0; q < MW; ++q) acc[ic - q + MW - 1] = fmaf(gr[q], xr[ic], acc[ic - q + MW - 1]);
    }
    const float s = reduce_scatter(acc, lane);
    const int kc = lane % EW - (MW - 1) + g.pw;
    if (lane < 2 * MW - 1 && kc >= 0 && kc < g.kw) atomicAdd(dw + (c * g.kh + d + g.ph) * g.kw + kc, s);
  }
}

template <int MW>
int fwd_smem(int H) {
  return int(sizeof(float)) * (kLanes * sample_stride(H, Cols<MW>::LD) + (2 * H - 1) * Cols<MW>::EW);
}
template <int MW>
int wgrad_smem(int H) { return int(sizeof(float)) * 2 * kLanes * sample_stride(H, Cols<MW>::LD); }

int64_t blocks_for(const ConvGeom& g) {
  const int64_t blocks = (g.N + kLanes - 1) / kLanes * g.C;
  TORCH_CHECK(blocks < INT32_MAX, "lkcnn dwconv2d: too many (n, c) planes for one launch");
  return blocks;
}

template <typename T, int MW>
void run_fwd_small(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, at::Tensor& y,
                   const ConvGeom& g) {
  const int smem = fwd_smem<MW>(g.H);
  constexpr auto kernel = dwconv_fwd_small_kernel<T, MW>;
  allow_dynamic_smem<kernel>(smem);
  kernel<<<unsigned(blocks_for(g)), 32 * ceil_div(g.H, kRows), smem, at::cuda::getCurrentCUDAStream()>>>(
      x.const_data_ptr<T>(), w.const_data_ptr<float>(), bias.defined() ? bias.const_data_ptr<float>() : nullptr,
      y.mutable_data_ptr<T>(), g);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int MW>
void run_wgrad_small(const at::Tensor& dy, const at::Tensor& x, at::Tensor& dw, const ConvGeom& g) {
  const int smem = wgrad_smem<MW>(g.H);
  constexpr auto kernel = dwconv_wgrad_small_kernel<T, MW>;
  allow_dynamic_smem<kernel>(smem);
  const int rows = 2 * std::min(g.ph, g.H - 1) + 1;  // kernel rows that meet the map
  kernel<<<unsigned(blocks_for(g)), 32 * std::min(rows, 8), smem, at::cuda::getCurrentCUDAStream()>>>(
      dy.const_data_ptr<T>(), x.const_data_ptr<T>(), dw.mutable_data_ptr<float>(), g);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// f.template run<T, MW>() for MW = map_cols(W).
template <typename T, typename F>
void dispatch_cols(int W, const F& f) {
  switch (map_cols(W)) {
    case 7: return f.template run<T, 7>();
    case 8: return f.template run<T, 8>();
    case 14: return f.template run<T, 14>();
    default: return f.template run<T, 16>();
  }
}

// ... and T the tensor's dtype.
template <typename F>
void dispatch(const at::Tensor& t, int W, const F& f) {
  const auto dtype = t.scalar_type();
  if (dtype == at::kFloat) return dispatch_cols<float>(W, f);
  if (dtype == at::kHalf) return dispatch_cols<c10::Half>(W, f);
  return dispatch_cols<c10::BFloat16>(W, f);
}

struct FwdCall {
  const at::Tensor &x, &w, &bias;
  at::Tensor& y;
  const ConvGeom& g;
  template <typename T, int MW>
  void run() const { run_fwd_small<T, MW>(x, w, bias, y, g); }
};

struct WgradCall {
  const at::Tensor &dy, &x;
  at::Tensor& dw;
  const ConvGeom& g;
  template <typename T, int MW>
  void run() const { run_wgrad_small<T, MW>(dy, x, dw, g); }
};

}  // namespace

bool small_map_fits(const at::Tensor& t, int64_t kw) {
  const int64_t N = t.size(0), H = t.size(2), W = t.size(3);
  // At least half the lanes busy, and at least half of the MW x MW column pairs taps of the kernel. Every dtype: at
  // 14x14 fp16/bf16 measured 0.26-0.28 ms here against 0.44 on the tensor-core kernels (s3, docs/performance.md v16).
  if (N < kLanes / 2 || H > kMaxSide || W > kMaxSide || H < 1 || W < 1) return false;
  const int64_t mw = map_cols(W), pw = kw / 2;
  int64_t taps = 0;
  for (int64_t q = 0; q < W; ++q) taps += std::min(W - 1, q + pw) - std::max<int64_t>(0, q - pw) + 1;
  return 2 * taps >= mw * mw;
}

void launch_dwconv_fwd_small(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, at::Tensor& y,
                             int64_t ph, int64_t pw) {
  const c10::cuda::CUDAGuard guard(x.device());
  const ConvGeom g = make_geom(x, y, w.size(1), w.size(2), ph, pw);
  if (g.N * g.C == 0) return;
  dispatch(x, g.W, FwdCall{x, w, bias, y, g});
}

void launch_dwconv_wgrad_small(const at::Tensor& grad_out, const at::Tensor& x, at::Tensor& dw, int64_t ph,
                               int64_t pw) {
  const c10::cuda::CUDAGuard guard(x.device());
  const ConvGeom g = make_geom(grad_out, x, dw.size(1), dw.size(2), ph, pw);
  if (g.N * g.C == 0) return;
  dispatch(x, g.W, WgradCall{grad_out, x, dw, g});
}

}  // namespace lkcnn
