// fp32 maps up to 32 x 32 whose kernel reaches most of the map, as in RepLKNet's stages 2-4 (28x28 with 29x29,
// 14x14 with 27x27, 7x7 with 13x13) and the seed article's 32x32 with 31x31: all three passes on the FMA pipes,
// without the padded rows. (fp16/bf16 maps up to 16 x 16 run on dwconv_map_tc.cu's tensor-core kernels, wider
// ones on the banded tensor-core kernels.)
//
// On such a map the banded kernels spend much of their work on padding (a 27x27 kernel over a 14x14 map is 27%
// in-bounds taps) and their lanes diverge at the map's edges. Here one block takes one channel of 32 samples, one
// sample per lane, and works on whole map rows held in registers: every (input column, output column) pair of an
// MW-wide row within R columns of each other (MW = 7, 8, 14, 16, 28 or 32: the map's width rounded up to one of
// these, exact for the 7, 14 and 28 of 224-px inputs) meets the kernel row through E, the channel's kernel
// re-indexed by offset (E[a][b] = w[a - (H-1) + ph][b - R + pw], zero outside the kernel). Rows are visited only
// where the kernel reaches; columns within R are all visited (R is a compile-time constant, so the pairs past it
// cost nothing). Callers send a small map here where most computed column pairs are taps, a wide one from kernels
// 9 columns wide on (small_map_fits). All lanes of a warp run the same loop (lanes differ only in the sample), and
// E is read with broadcast loads.
//
// Up to 16 columns ("small"): R = MW - 1 (every pair); forward warps own two output rows, all in one pass.
// 28 and 32 columns ("wide"): R = 15 (kernels up to 31 wide),
// one output row per warp at a time (32 accumulators, 32 staged columns and 31 taps fill the registers), written
// straight from registers; the weight gradient stages grad_out in chunks of rows where both whole maps do not fit.
//
// Forward and input gradient (flipped kernel, as for the other forward kernels): warps own output rows. Weight
// gradient: warp w accumulates kernel rows w, w + warps, ... (in E's offsets) over its lanes' samples, reduces them
// across lanes and adds them to dw (one atomic per tap, block and chunk of rows).
#include "dwconv.h"
#include "tile.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

namespace lkcnn {
namespace {

constexpr int kLanes = 32;  // samples per block

// How a kernel computing MW columns is laid out: staged rows of LD floats (16-byte loads); column offsets up to R
// computed; rows of E read as ER floats and EW apart (EW a power of two for the weight gradient's reduce-scatter);
// forward output rows per warp and pass; warps per block at most.
struct Cols {
  int LD, R, ER, EW, rows, warps;
};
__host__ __device__ constexpr Cols cols_for(int MW) {
  const bool wide = MW > 16;
  const int R = wide ? 15 : MW - 1, ER = (2 * R + 4) / 4 * 4;
  return {(MW + 3) / 4 * 4, R, ER, ER <= 16 ? 16 : 32, wide ? 1 : 2, wide ? 16 : 8};
}

// The MW that maps W wide run with.
int map_cols(int64_t W) { return W <= 7 ? 7 : W <= 8 ? 8 : W <= 14 ? 14 : W <= 16 ? 16 : W <= 28 ? 28 : 32; }

// Staged samples of `rows` rows are an odd number of 16-byte groups apart, so the 8 lanes of a quarter-warp reading
// 16 bytes each at the same offset of their samples hit distinct bank groups.
__host__ __device__ constexpr int sample_stride(int rows, int LD) { return 4 * ((rows * LD / 4) | 1); }

// f(r, col) for every map position (r < rows, col < LD), shared among the block's threads. Staging and storing take
// a position per thread and walk the block's samples there, so a position's index arithmetic is done once, not once
// per element: the generic box loop (tile.cuh) spent ~58 instructions per element, 40% of the forward's
// instructions at 14x14 (Nsight Compute; docs/kernels.md).
template <int LD, typename F>
__device__ __forceinline__ void for_positions(int rows, F f) {
  for (int i = threadIdx.x; i < rows * LD; i += blockDim.x) f(i / LD, i % LD);
}

// Stage `rows` rows (from src, which points at row 0 of them) of kLanes samples (from n0) of channel c as fp32
// [sample, ss apart][row][LD columns], zeros past the map and the batch. Loads go out in groups of 8 before their
// stores, so that 8 are in flight per thread.
template <int LD, typename T>
__device__ __forceinline__ void stage_samples(float* __restrict__ dst, int ss, const T* __restrict__ src, int rows,
                                              int64_t n0, int64_t c, const ConvGeom& g, int64_t s_n, int64_t s_c,
                                              int64_t s_h, int64_t s_w) {
  const int nn = int(min(int64_t(kLanes), g.N - n0));
  for_positions<LD>(rows, [&](int r, int col) {
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

// acc[u][q] += the taps of output rows p0 + u (u < ROWS) from every input row in the kernel's reach, for the lane's
// staged sample xs. The row loop is the same for the whole warp; the column pairs are compile-time constants.
template <int MW, int ROWS>
__device__ __forceinline__ void accumulate_rows(float (&acc)[ROWS][cols_for(MW).LD], const float* __restrict__ xs,
                                                const float* __restrict__ se, int p0, int H, int ph) {
  constexpr Cols L = cols_for(MW);
  const int ir_end = min(H, p0 + ROWS + ph);
  for (int ir = max(0, p0 - ph); ir < ir_end; ++ir) {
    float xr[L.LD];
#pragma unroll
    for (int j = 0; j < L.LD; j += 4) load4(xr + j, xs + ir * L.LD + j);
#pragma unroll
    for (int u = 0; u < ROWS; ++u) {
      const int d = ir - (p0 + u);
      if (p0 + u >= H || d < -ph || d > ph) continue;
      float e[L.ER];
#pragma unroll
      for (int j = 0; j < L.ER; j += 4) load4(e + j, se + (d + H - 1) * L.EW + j);
#pragma unroll
      for (int ic = 0; ic < MW; ++ic)
#pragma unroll
        for (int q = 0; q < MW; ++q)
          if (ic - q <= L.R && q - ic <= L.R) acc[u][q] = fmaf(xr[ic], e[ic - q + L.R], acc[u][q]);
    }
  }
}

// One output row of the lane's sample (acc + bias) straight from registers: 16-byte stores where the host found rows
// of fp32 16-byte aligned (vec), else one element at a time.
template <int LD, typename T>
__device__ __forceinline__ void store_row(T* __restrict__ out, const float (&acc)[LD], float bv, const ConvGeom& g,
                                          bool vec) {
  if (vec) {
#pragma unroll
    for (int q = 0; q < LD; q += 4)
      if (q < g.W)
        *reinterpret_cast<float4*>(out + q) = make_float4(acc[q] + bv, acc[q + 1] + bv, acc[q + 2] + bv,
                                                          acc[q + 3] + bv);
    return;
  }
#pragma unroll
  for (int q = 0; q < LD; ++q)
    if (q < g.W) out[q * g.ys_w] = T(acc[q] + bv);
}

template <typename T, int MW>
__global__ void __launch_bounds__(32 * cols_for(MW).warps) dwconv_fwd_small_kernel(
    const T* __restrict__ x, const float* __restrict__ w, const float* __restrict__ bias, T* __restrict__ y,
    const ConvGeom g, bool vec_out) {
  extern __shared__ __align__(16) float smem[];
  constexpr Cols L = cols_for(MW);
  constexpr int LD = L.LD, EW = L.EW, ROWS = L.rows;
  const int H = g.H, ss = sample_stride(H, LD);
  float* sx = smem;                // kLanes samples; later the outputs (small maps)
  float* se = smem + kLanes * ss;  // E: 2H - 1 rows
  const int64_t c = blockIdx.x % g.C, n0 = int64_t(blockIdx.x / g.C) * kLanes;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, warps = blockDim.x / 32;

  stage_samples<LD>(sx, ss, x, H, n0, c, g, g.xs_n, g.xs_c, g.xs_h, g.xs_w);
  for (int i = tid; i < (2 * H - 1) * EW; i += blockDim.x) {
    const int kr = i / EW - (H - 1) + g.ph, kc = i % EW - L.R + g.pw;
    se[i] = i % EW < 2 * L.R + 1 && kr >= 0 && kr < g.kh && kc >= 0 && kc < g.kw ? w[(c * g.kh + kr) * g.kw + kc]
                                                                                   : 0.f;
  }
  __syncthreads();
  const float* xs = sx + lane * ss;
  const float bv = bias != nullptr ? bias[c] : 0.f;

  if constexpr (ROWS == 1) {  // wide: warps loop over rows w, w + warps, ... (balanced: edge rows reach fewer rows)
    const int64_t n = n0 + lane;
    for (int p = warp; p < H; p += warps) {
      float acc[1][LD];
#pragma unroll
      for (int q = 0; q < LD; ++q) acc[0][q] = 0.f;
      accumulate_rows<MW>(acc, xs, se, p, H, g.ph);
      if (n < g.N) store_row(y + n * g.ys_n + c * g.ys_c + p * g.ys_h, acc[0], bv, g, vec_out);
    }
  } else {  // small: one pass, the launch gives every pair of rows a warp
    const int p0 = warp * ROWS;
    float acc[ROWS][LD];  // columns MW .. LD-1 stay zero
#pragma unroll
    for (int u = 0; u < ROWS; ++u)
#pragma unroll
      for (int q = 0; q < LD; ++q) acc[u][q] = 0.f;
    accumulate_rows<MW>(acc, xs, se, p0, H, g.ph);

    __syncthreads();  // every warp is done reading the samples: their space takes the outputs
    float* ys = sx + lane * ss;
#pragma unroll
    for (int u = 0; u < ROWS; ++u)
      if (p0 + u < H)
#pragma unroll
        for (int q = 0; q < LD; q += 4)
          *reinterpret_cast<float4*>(ys + (p0 + u) * LD + q) = make_float4(acc[u][q], acc[u][q + 1], acc[u][q + 2],
                                                                            acc[u][q + 3]);
    __syncthreads();
    T* out = y + n0 * g.ys_n + c * g.ys_c;
    const int nn = int(min(int64_t(kLanes), g.N - n0));
    for_positions<LD>(H, [&](int r, int col) {
      if (col >= g.W) return;
      T* p = out + r * g.ys_h + col * g.ys_w;
      const float* s = sx + r * LD + col;
      for (int z = 0; z < nn; ++z, p += g.ys_n, s += ss) *p = T(*s + bv);
    });
  }
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

// g: grad_out read through xs_*, x through ys_* (make_geom(grad_out, x, ...)). grad_out is staged rc rows at a time
// (rc = H where both whole maps fit in shared memory).
template <typename T, int MW>
__global__ void __launch_bounds__(32 * cols_for(MW).warps) dwconv_wgrad_small_kernel(
    const T* __restrict__ dy, const T* __restrict__ x, float* __restrict__ dw, const ConvGeom g, int rc) {
  extern __shared__ __align__(16) float smem[];
  constexpr Cols L = cols_for(MW);
  constexpr int LD = L.LD, EW = L.EW;
  const int H = g.H, ssx = sample_stride(H, LD), ssd = sample_stride(rc, LD);
  float* sx = smem;
  float* sdy = smem + kLanes * ssx;
  const int64_t c = blockIdx.x % g.C, n0 = int64_t(blockIdx.x / g.C) * kLanes;
  const int tid = threadIdx.x, lane = tid % 32, warps = blockDim.x / 32;

  stage_samples<LD>(sx, ssx, x, H, n0, c, g, g.ys_n, g.ys_c, g.ys_h, g.ys_w);
  const float* dys = sdy + lane * ssd;
  const float* xs = sx + lane * ssx;
  // row offsets d = (input row) - (output row) that are kernel rows: |d| <= ph, and |d| <= H - 1
  const int d_lo = -min(g.ph, H - 1), d_hi = min(g.ph, H - 1);
  for (int r0 = 0; r0 < H; r0 += rc) {
    const int rows = min(rc, H - r0);
    if (r0 > 0) __syncthreads();  // every warp is done with the previous rows of grad_out
    stage_samples<LD>(sdy, ssd, dy + r0 * g.xs_h, rows, n0, c, g, g.xs_n, g.xs_c, g.xs_h, g.xs_w);
    __syncthreads();
    for (int d = d_lo + tid / 32; d <= d_hi; d += warps) {
      const int pr_begin = max(r0, -d), pr_end = min(r0 + rows, H - d);
      if (pr_begin >= pr_end) continue;  // the same for the whole warp
      float acc[EW];  // acc[b]: the tap at column offset b - R; those from 2R + 1 on stay zero
#pragma unroll
      for (int b = 0; b < EW; ++b) acc[b] = 0.f;
      for (int pr = pr_begin; pr < pr_end; ++pr) {
        float gr[LD], xr[LD];
#pragma unroll
        for (int j = 0; j < LD; j += 4) {
          load4(gr + j, dys + (pr - r0) * LD + j);
          load4(xr + j, xs + (pr + d) * LD + j);
        }
#pragma unroll
        for (int ic = 0; ic < MW; ++ic)
#pragma unroll
          for (int q = 0; q < MW; ++q)
            if (ic - q <= L.R && q - ic <= L.R) acc[ic - q + L.R] = fmaf(gr[q], xr[ic], acc[ic - q + L.R]);
      }
      const float s = reduce_scatter(acc, lane);
      const int kc = lane % EW - L.R + g.pw;
      if (lane < 2 * L.R + 1 && kc >= 0 && kc < g.kw) atomicAdd(dw + (c * g.kh + d + g.ph) * g.kw + kc, s);
    }
  }
}

int fwd_smem(int H, const Cols& L) { return int(sizeof(float)) * (kLanes * sample_stride(H, L.LD) + (2 * H - 1) * L.EW); }
int wgrad_smem(int H, int rc, const Cols& L) {
  return int(sizeof(float)) * kLanes * (sample_stride(H, L.LD) + sample_stride(rc, L.LD));
}

// Rows of grad_out the weight gradient stages at a time: all where they fit beside x, else halves, quarters, ...
int wgrad_rows(int H, const Cols& L) {
  int rc = H;
  while (rc > 1 && wgrad_smem(H, rc, L) > smem_limit()) rc = (rc + 1) / 2;
  return rc;
}

int64_t blocks_for(const ConvGeom& g) {
  const int64_t blocks = (g.N + kLanes - 1) / kLanes * g.C;
  TORCH_CHECK(blocks < INT32_MAX, "lkcnn dwconv2d: too many (n, c) planes for one launch");
  return blocks;
}

// Forward warps for `units` groups of output rows: at most L.warps, the groups spread evenly over them.
int warps_for(int units, const Cols& L) { return ceil_div(units, ceil_div(units, L.warps)); }

template <typename T, int MW>
void run_fwd_small(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, at::Tensor& y,
                   const ConvGeom& g) {
  constexpr Cols L = cols_for(MW);
  const int smem = fwd_smem(g.H, L);
  constexpr auto kernel = dwconv_fwd_small_kernel<T, MW>;
  allow_dynamic_smem<kernel>(smem);
  const bool vec = rows_allow(y, 4);
  kernel<<<unsigned(blocks_for(g)), 32 * warps_for(ceil_div(g.H, L.rows), L), smem,
           at::cuda::getCurrentCUDAStream()>>>(x.const_data_ptr<T>(), w.const_data_ptr<float>(),
                                               bias.defined() ? bias.const_data_ptr<float>() : nullptr,
                                               y.mutable_data_ptr<T>(), g, vec);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int MW>
void run_wgrad_small(const at::Tensor& dy, const at::Tensor& x, at::Tensor& dw, const ConvGeom& g) {
  constexpr Cols L = cols_for(MW);
  const int rc = wgrad_rows(g.H, L), smem = wgrad_smem(g.H, rc, L);
  constexpr auto kernel = dwconv_wgrad_small_kernel<T, MW>;
  allow_dynamic_smem<kernel>(smem);
  const int rows = 2 * std::min(g.ph, g.H - 1) + 1;  // kernel rows that meet the map
  kernel<<<unsigned(blocks_for(g)), 32 * std::min(rows, L.warps), smem, at::cuda::getCurrentCUDAStream()>>>(
      dy.const_data_ptr<T>(), x.const_data_ptr<T>(), dw.mutable_data_ptr<float>(), g, rc);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// f.template run<T, MW>() for MW = map_cols(W); the wide kernels (MW 28, 32) exist for fp32 only.
template <typename T, typename F>
void dispatch_cols(int W, const F& f) {
  switch (map_cols(W)) {
    case 7: return f.template run<T, 7>();
    case 8: return f.template run<T, 8>();
    case 14: return f.template run<T, 14>();
    case 16: return f.template run<T, 16>();
    default: break;
  }
  if (map_cols(W) == 28) return f.template run<T, 28>();
  return f.template run<T, 32>();
}

// ... for fp32 tensors, the only ones small_map_fits admits.
template <typename F>
void dispatch(const at::Tensor& t, int W, const F& f) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, "lkcnn dwconv2d: the whole-map FMA kernels take float32 only");
  dispatch_cols<float>(W, f);
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

int smem_limit(int device) {
  return int(at::cuda::getDeviceProperties(device < 0 ? c10::cuda::current_device() : device)->sharedMemPerBlockOptin);
}

bool small_map_fits(const at::Tensor& t, int64_t kw) {
  const int64_t N = t.size(0), H = t.size(2), W = t.size(3);
  if (t.scalar_type() != at::kFloat || N < kLanes / 2 || H < 1 || W < 1 || H > 32 || W > 32) return false;  // at least half the lanes busy
  const int mw = map_cols(W);
  const Cols L = cols_for(mw);
  const int64_t pw = kw / 2;
  if (mw <= 16 && H > 16) return false;  // the small forward's one pass of 8 warps x 2 rows
  if (mw > 16 && pw > L.R) return false;
  if (fwd_smem(int(H), L) > smem_limit() || wgrad_smem(int(H), 1, L) > smem_limit()) return false;
  // Wide maps: kernels 9 or more columns wide. The whole-map kernels' time grows with the kernel's rows alone,
  // the tiled SIMT kernels' with its area, so from 9 columns on the whole-map kernels are 0.4-0.8x the tiled ones
  // on every 17-32-wide map even where a fifth of the column pairs they compute are taps (a 17-wide map with 9x9);
  // at 7 columns the two trade places by map width (docs/kernels.md, "Whole-map FMA kernels").
  if (mw > 16) return pw >= 4;
  // Small maps: at least half the computed column pairs are taps.
  int64_t taps = 0, computed = 0;
  for (int64_t q = 0; q < W; ++q) taps += std::min(W - 1, q + pw) - std::max<int64_t>(0, q - pw) + 1;
  for (int q = 0; q < mw; ++q) computed += std::min(mw - 1, q + L.R) - std::max(0, q - L.R) + 1;
  return 2 * taps >= computed;
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
