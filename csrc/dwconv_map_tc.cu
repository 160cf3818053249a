// fp16/bf16 maps up to 16 x 16 (RepLKNet's 14x14 stage with 27x27 kernels, the 7x7 stage with 13x13): all three
// passes as dense products of whole map rows on the tensor cores (mma.sync.m16n8k16, fp32 accumulation).
//
// With the map's rows padded to 16 columns, one output row py of 16 samples is a sum over the input rows qy in the
// kernel's reach of X[16 samples][qy][16 columns] (A) times the 16 x 8 Toeplitz block of kernel row qy - py + ph
// (B[q][p] = w[i][q - p + pw], zero outside the kernel), one mma per 8 output columns. No band steps and no padded
// rows: on a 14x14 map with a 27x27 kernel 77% of the multiplied pairs are taps, where the banded kernels
// (band_mma.cuh) reach a third and the fp32-math whole-map kernels (dwconv_small.cu) run on the FMA pipes.
//
// Forward and input gradient (flipped kernel, as for the other forward kernels): a warp holds the A fragments of
// its 16 samples for every row in registers (16 x 4) and walks its output rows; B comes from a table of each
// kernel row's fragments per lane, built in shared memory once per block (one channel).
// Weight gradient: for rows qy, py = qy - d, S = X[.][qy]^T (16 columns x 16 samples) times grad_out[.][py] (16
// samples x 16 columns) holds in S[q][p] the products that tap (d + ph, q - p + pw) sums, so a warp accumulates S
// over the row pairs of each offset d in the mma accumulators, then adds its diagonals to its own taps in shared
// memory (summed over the warps at the end); both operands of all rows of its 16 samples stay in registers.
#include "band_mma.cuh"
#include "dwconv.h"
#include "tile.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

namespace lkcnn {
namespace {

constexpr int kWarps = 8;  // per block, both kernels
constexpr int kCols = 16;  // columns a row is padded to (the mma's K)

// x[n][c][r][col] of a tensor read through strides (s_n, s_h, s_w) from the channel's base, or 0 past the batch or
// the row.
template <typename T>
__device__ __forceinline__ T at_or_zero(const T* base, int64_t n, int r, int col, const ConvGeom& g, int64_t s_n,
                                        int64_t s_h, int64_t s_w) {
  return n < g.N && col < g.W ? base[n * s_n + r * s_h + col * s_w] : T(0.f);
}

// (x[col], x[col + 1]) of sample n's row r as an mma register, zeros past the batch and the row; one 4-byte load
// where the host found pairs aligned (vec: unit column stride, even width and strides, aligned data).
template <typename T>
__device__ __forceinline__ uint32_t row_pair(const T* base, int64_t n, int r, int col, const ConvGeom& g, bool vec) {
  if (vec) return n < g.N && col < g.W ? *reinterpret_cast<const uint32_t*>(base + n * g.xs_n + r * g.xs_h + col) : 0u;
  return pack2(at_or_zero(base, n, r, col, g, g.xs_n, g.xs_h, g.xs_w),
               at_or_zero(base, n, r, col + 1, g, g.xs_n, g.xs_h, g.xs_w));
}

// *p += the sum of v over the warp's lanes with this lane's g - 2t (so the same p), added by one of them. Lanes l and
// l + 9 share g - 2t, so two shuffles gather the up to four lanes into the first; those add to distinct addresses.
// (Shared-memory fp32 atomics are compare-and-swap loops on sm_90.)
__device__ __forceinline__ void add_diagonal(float* p, float v, int gq, int tq) {
  float s = v, o = __shfl_down_sync(0xffffffffu, s, 9);
  if (tq <= 2 && gq <= 5) s += o;
  o = __shfl_down_sync(0xffffffffu, s, 18);
  if (tq <= 1 && gq <= 3) s += o;
  if (tq == 0 || gq < 2) *p += s;
  __syncwarp();  // the next call's lanes may add to this address
}

// HM: rows the kernel is compiled for (8 or 16, >= H); NB: 8-column output blocks (1 for maps up to 8 wide, else 2).
// Warps take (16-sample tile, row group) items; a row group is the output rows rg, rg + row_groups, ...
template <typename T, int HM, int NB>
__global__ void __launch_bounds__(32 * kWarps) dwconv_fwd_map_tc_kernel(
    const T* __restrict__ x, const float* __restrict__ w, const float* __restrict__ bias, T* __restrict__ y,
    const ConvGeom g, int tiles, int row_groups, bool vec_in, bool vec_out) {
  extern __shared__ __align__(16) uint2 toe[];  // [kernel row][NB][lane]: the lane's (b0, b1) of that B block
  float* sw = reinterpret_cast<float*>(toe + g.kh * NB * 32);  // the channel's kernel, staged in one coalesced pass
  const int64_t c = blockIdx.x;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, gq = lane / 4, tq = lane % 4;
  for (int u = tid; u < g.kh * g.kw; u += blockDim.x) sw[u] = w[c * g.kh * g.kw + u];
  __syncthreads();
  for (int u = tid; u < g.kh * NB * 32; u += blockDim.x) {
    // b0 holds B[k][p] for k = 2t, 2t + 1 and p = 8 nb + g, i.e. taps j, j + 1 of kernel row i; b1 those 8 on
    const int i = u / (NB * 32), nb = u / 32 % NB, l = u % 32, j = 2 * (l % 4) - 8 * nb - l / 4 + g.pw;
    auto tap = [&](int jj) { return jj >= 0 && jj < g.kw ? T(sw[i * g.kw + jj]) : T(0.f); };
    toe[u] = make_uint2(pack2(tap(j), tap(j + 1)), pack2(tap(j + 8), tap(j + 9)));
  }
  __syncthreads();
  const T* xc = x + c * g.xs_c;
  T* yc = y + c * g.ys_c;
  const float bv = bias != nullptr ? bias[c] : 0.f;
  const int H = g.H, items = tiles * row_groups;
  for (int item = warp; item < items; item += kWarps) {
    const int64_t n_lo = int64_t(item / row_groups) * 16 + gq, n_hi = n_lo + 8;  // the lane's two samples
    uint32_t a[HM][4];  // a[r]: the A fragment of input row r (rows past H stay unused)
#pragma unroll
    for (int r = 0; r < HM; ++r)
      if (r < H) {
        a[r][0] = row_pair(xc, n_lo, r, 2 * tq, g, vec_in);
        a[r][1] = row_pair(xc, n_hi, r, 2 * tq, g, vec_in);
        a[r][2] = row_pair(xc, n_lo, r, 2 * tq + 8, g, vec_in);
        a[r][3] = row_pair(xc, n_hi, r, 2 * tq + 8, g, vec_in);
      }
    for (int py = item % row_groups; py < H; py += row_groups) {
      float acc[NB][4] = {};
#pragma unroll
      for (int qy = 0; qy < HM; ++qy) {
        const int i = qy - py + g.ph;  // the kernel row that meets input row qy here (the same for the whole warp)
        if (qy >= H || i < 0 || i >= g.kh) continue;
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
          const uint2 b = toe[(i * NB + nb) * 32 + lane];
          mma16816<T>(acc[nb], a[qy][0], a[qy][1], a[qy][2], a[qy][3], b.x, b.y);
        }
      }
      // acc[nb]: (sample n_lo, columns 8 nb + 2t, + 1), then the same of n_hi
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int64_t n = h == 0 ? n_lo : n_hi;
          const int col = 8 * nb + 2 * tq;
          if (n >= g.N || col >= g.W) continue;
          T* out = yc + n * g.ys_n + py * g.ys_h;
          const T v0 = T(acc[nb][2 * h] + bv), v1 = T(acc[nb][2 * h + 1] + bv);
          if (vec_out) {
            *reinterpret_cast<uint32_t*>(out + col) = pack2(v0, v1);
          } else {
            out[col * g.ys_w] = v0;
            if (col + 1 < g.W) out[(col + 1) * g.ys_w] = v1;
          }
        }
    }
  }
}

// g: grad_out read through xs_*, x through ys_* (make_geom(grad_out, x, ...)). Warps take (16-sample tile, half of
// the row offsets) items: the halves d < 0 and d >= 0 where there are fewer tiles than warps.
template <typename T, int HM, int NB>
__global__ void __launch_bounds__(32 * kWarps) dwconv_wgrad_map_tc_kernel(
    const T* __restrict__ dy, const T* __restrict__ x, float* __restrict__ dw, const ConvGeom g, int tiles,
    int splits) {
  extern __shared__ __align__(16) float taps[];  // [warp][kernel row][q - p + 16]
  const int64_t c = blockIdx.x;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, gq = lane / 4, tq = lane % 4;
  for (int u = tid; u < kWarps * g.kh * 32; u += blockDim.x) taps[u] = 0.f;
  __syncthreads();
  float* mine = taps + warp * g.kh * 32;
  const T* xc = x + c * g.ys_c;
  const T* dyc = dy + c * g.xs_c;
  const int H = g.H, items = tiles * splits;
  for (int item = warp; item < items; item += kWarps) {
    const int64_t n0 = int64_t(item / splits) * 16 + 2 * tq;  // the lane's samples: n0, n0 + 1, n0 + 8, n0 + 9
    const int half = splits == 1 ? -1 : item % splits;        // -1: every offset
    // xa[r]: A = x[.][r]^T (rows q = g, g + 8; samples 2t, 2t + 1, 2t + 8, 2t + 9); db[r][nb]: B = grad_out[.][r]
    // (samples 2t, 2t + 1, then + 8; column 8 nb + g)
    uint32_t xa[HM][4], db[HM][NB][2];
#pragma unroll
    for (int r = 0; r < HM; ++r) {
      if (r >= H) continue;
      auto xv = [&](int64_t n, int col) { return at_or_zero(xc, n, r, col, g, g.ys_n, g.ys_h, g.ys_w); };
      auto dv = [&](int64_t n, int col) { return at_or_zero(dyc, n, r, col, g, g.xs_n, g.xs_h, g.xs_w); };
      xa[r][0] = pack2(xv(n0, gq), xv(n0 + 1, gq));
      xa[r][1] = pack2(xv(n0, gq + 8), xv(n0 + 1, gq + 8));
      xa[r][2] = pack2(xv(n0 + 8, gq), xv(n0 + 9, gq));
      xa[r][3] = pack2(xv(n0 + 8, gq + 8), xv(n0 + 9, gq + 8));
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        db[r][nb][0] = pack2(dv(n0, 8 * nb + gq), dv(n0 + 1, 8 * nb + gq));
        db[r][nb][1] = pack2(dv(n0 + 8, 8 * nb + gq), dv(n0 + 9, 8 * nb + gq));
      }
    }
#pragma unroll
    for (int d = 1 - HM; d < HM; ++d) {
      const int i = d + g.ph;  // kernel row
      if (i < 0 || i >= g.kh || d <= -H || d >= H || (half == 0 && d >= 0) || (half == 1 && d < 0)) continue;
      float acc[NB][4] = {};
#pragma unroll
      for (int qy = d > 0 ? d : 0; qy < (d < 0 ? HM + d : HM); ++qy) {
        if (qy >= H || qy - d >= H) continue;
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
          mma16816<T>(acc[nb], xa[qy][0], xa[qy][1], xa[qy][2], xa[qy][3], db[qy - d][nb][0], db[qy - d][nb][1]);
      }
      // acc[nb]: S[q][p] at q = g (+ 8 for the last two), p = 8 nb + 2t (+ 1 for the odd ones), on the diagonals
      // q - p = g - 2t + (0, -1, 8, 7) - 8 nb; block 1's last pair lies on block 0's first pair's diagonals.
      if constexpr (NB == 2) {
        acc[0][0] += acc[1][2];
        acc[0][1] += acc[1][3];
      }
      float* row = mine + i * 32 + 16 + gq - 2 * tq;
      add_diagonal(row, acc[0][0], gq, tq);
      add_diagonal(row - 1, acc[0][1], gq, tq);
      add_diagonal(row + 8, acc[0][2], gq, tq);
      add_diagonal(row + 7, acc[0][3], gq, tq);
      if constexpr (NB == 2) {
        add_diagonal(row - 8, acc[1][0], gq, tq);
        add_diagonal(row - 9, acc[1][1], gq, tq);
      }
    }
  }
  __syncthreads();
  // One block per channel covers every sample: dw += its taps without atomics. Taps over 15 columns off reach no
  // column pair of a 16-wide row.
  float* dwc = dw + c * g.kh * g.kw;
  for (int u = tid; u < g.kh * g.kw; u += blockDim.x) {
    const int off = u % g.kw - g.pw;
    if (off < -15 || off > 15) continue;
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < kWarps; ++k) sum += taps[(k * g.kh + u / g.kw) * 32 + 16 + off];
    dwc[u] += sum;
  }
}

// f.template run<HM, NB>() for the map's rows and columns.
template <typename F>
void dispatch_rows_cols(const ConvGeom& g, const F& f) {
  if (g.H <= 8) return g.W <= 8 ? f.template run<8, 1>() : f.template run<8, 2>();
  return g.W <= 8 ? f.template run<16, 1>() : f.template run<16, 2>();
}

bool pairs_aligned(const at::Tensor& t) {  // 4-byte accesses to (col, col + 1) for even col
  return t.stride(3) == 1 && t.size(3) % 2 == 0 && t.stride(2) % 2 == 0 && t.stride(1) % 2 == 0 &&
         t.stride(0) % 2 == 0 && reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 4 == 0;
}

// 16-sample tiles of the batch (the launch checks that warps can count items in int)
int tiles(const ConvGeom& g) { return int((g.N + 15) / 16); }

template <typename T>
struct FwdCall {
  const at::Tensor &x, &w, &bias;
  at::Tensor& y;
  const ConvGeom& g;
  template <int HM, int NB>
  void run() const {
    constexpr auto kernel = dwconv_fwd_map_tc_kernel<T, HM, NB>;
    const int smem = int(g.kh * NB * 32 * sizeof(uint2) + g.kh * g.kw * sizeof(float));
    allow_dynamic_smem<kernel>(smem);
    // every warp busy where the batch has fewer 16-sample tiles than the block has warps
    const int row_groups = std::min(g.H, std::max(1, kWarps / tiles(g)));
    kernel<<<unsigned(g.C), 32 * kWarps, smem, at::cuda::getCurrentCUDAStream()>>>(
        x.const_data_ptr<T>(), w.const_data_ptr<float>(), bias.defined() ? bias.const_data_ptr<float>() : nullptr,
        y.mutable_data_ptr<T>(), g, tiles(g), row_groups, pairs_aligned(x), pairs_aligned(y));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

template <typename T>
struct WgradCall {
  const at::Tensor &dy, &x;
  at::Tensor& dw;
  const ConvGeom& g;
  template <int HM, int NB>
  void run() const {
    constexpr auto kernel = dwconv_wgrad_map_tc_kernel<T, HM, NB>;
    const int smem = int(kWarps * g.kh * 32 * sizeof(float));
    allow_dynamic_smem<kernel>(smem);
    const int splits = tiles(g) < kWarps ? 2 : 1;
    kernel<<<unsigned(g.C), 32 * kWarps, smem, at::cuda::getCurrentCUDAStream()>>>(
        dy.const_data_ptr<T>(), x.const_data_ptr<T>(), dw.mutable_data_ptr<float>(), g, tiles(g), splits);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

template <template <typename> class Call, typename... Args>
void dispatch(const at::Tensor& t, const ConvGeom& g, Args&... args) {
  check_tensor_cores();
  TORCH_CHECK(g.C < INT32_MAX && g.N / 16 < INT32_MAX / (2 * kWarps), "lkcnn dwconv2d: too many samples or channels "
              "for one launch");
  if (t.scalar_type() == at::kHalf) return dispatch_rows_cols(g, Call<c10::Half>{args..., g});
  return dispatch_rows_cols(g, Call<c10::BFloat16>{args..., g});
}

}  // namespace

bool map_tc_fits(const at::Tensor& t) {
  return t.scalar_type() != at::kFloat && t.size(2) <= 16 && t.size(3) <= kCols;
}

void launch_dwconv_fwd_map_tc(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, at::Tensor& y,
                              int64_t ph, int64_t pw) {
  const c10::cuda::CUDAGuard guard(x.device());
  const ConvGeom g = make_geom(x, y, w.size(1), w.size(2), ph, pw);
  if (g.N * g.C * g.H * g.W == 0) return;
  dispatch<FwdCall>(x, g, x, w, bias, y);
}

void launch_dwconv_wgrad_map_tc(const at::Tensor& grad_out, const at::Tensor& x, at::Tensor& dw, int64_t ph,
                                int64_t pw) {
  const c10::cuda::CUDAGuard guard(x.device());
  const ConvGeom g = make_geom(grad_out, x, dw.size(1), dw.size(2), ph, pw);
  if (g.N * g.C * g.H * g.W == 0) return;
  dispatch<WgradCall>(x, g, grad_out, x, dw);
}

}  // namespace lkcnn
