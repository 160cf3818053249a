// fp32 forward (and, with a flipped kernel, input gradient) of maps 33 to 56 wide with kernels 25 to 31 on a side,
// as RepLKNet's first stage (56x56 with 31x31): on the FMA pipes, lanes that never diverge.
//
// The tiled SIMT kernel (dwconv_fwd.cu) reaches a third of the FMA floor there: its lanes skip different padded
// rows and column steps and its inner loop carries bookkeeping. The whole-map kernels (dwconv_small.cu) put one
// sample on each lane, but 32 samples of 56 x 86 padded columns do not fit in shared memory. Here the map's columns
// are four strips of 14, and a warp computes one strip of 4 output rows of 8 samples (lane = 4 x sample + row): each
// lane meets its strip's 44-column input window (14 + 2 x 15) through every kernel column and every kernel row that
// reaches the warp's rows, so all lanes run the same loop. As the strip is the same for the whole warp, the two edge
// strips leave out at compile time the taps on the zero columns past the map's sides (14% of the FMAs at 56x56
// when lanes were 8 samples x 4 strips of one row, v30). A block takes 8 samples of one channel and walks down the
// map in bands of 8 output rows (8 warps: 4 strips x 2 groups of 4 rows); the 38 input rows a band reads stay in a
// ring of row slots, so the next band stages only its 8 new rows (restaging all 38 per band was 4.75 staged rows per
// output row, v30b).
#include "dwconv.h"
#include "tile.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

namespace lkcnn {
namespace {

constexpr int kSamples = 8, kStrips = 4, kSW = 14;  // samples per block, strips per row, strip width
constexpr int kReach = 15, kWin = kSW + 2 * kReach;  // columns a strip's window spans
constexpr int kRowsWarp = 4, kWarps = 8;  // output rows per warp (lanes: 8 samples x 4 rows), warps per block
constexpr int kRowsOut = kWarps / kStrips * kRowsWarp, kRowsIn = kRowsOut + 2 * kReach;  // a band's rows, staged rows
constexpr int kLD = kStrips * kSW + 2 * kReach + 2;  // staged row: 15 zero columns, 56, 15 zero columns, 2 spare
// Staged samples are kSS floats apart, kSS = 2 mod 32, and rows kLD = 24 mod 32: a half-warp's 8-byte loads (4
// samples x 4 consecutive rows at one column) then fall in 16 distinct bank pairs.
constexpr int kSS = (kRowsIn * kLD + 31) / 32 * 32 + 2;
constexpr int kSmemFloats = kSamples * kSS;  // + the kernel rows, 32 floats each

// Row r's slot in the ring of staged rows (r >= -kReach).
__device__ __forceinline__ int slot(int r) { return (r + kReach) % kRowsIn; }

// Stage rows r0 .. r0 + rows of samples n0 .. n0 + 8 of channel c into their slots (column col at col + 15; zeros past
// the map and the batch). Warp w takes sample w, its lanes a row's float4 groups (or columns lane and lane + 32),
// eight rows in flight per lane. (One (sample, row) pair per warp at a time with its index arithmetic spent ~100
// instructions per staged row, 23% of the kernel's instructions: docs/kernels.md.)
__device__ __forceinline__ void stage_rows(float* __restrict__ sx, const float* __restrict__ x, int64_t n0, int64_t c,
                                           int r0, int rows, const ConvGeom& g, bool vec) {
  static_assert(kSamples == kWarps, "one warp per staged sample");
  constexpr int kBatch = 8;
  const int lane = threadIdx.x % 32, z = threadIdx.x / 32;
  const bool sample = n0 + z < g.N;
  const float* src = x + (sample ? (n0 + z) * g.xs_n + c * g.xs_c : 0);
  float* dst = sx + z * kSS;
  for (int rr0 = 0; rr0 < rows; rr0 += kBatch) {
    float4 v[kBatch];  // lane's columns 4 lane .. 4 lane + 3 (vec), or lane (.x) and lane + 32 (.y)
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int r = r0 + rr0 + b;
      const float* row = src + int64_t(r) * g.xs_h;
      v[b] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (rr0 + b >= rows || !sample || r < 0 || r >= g.H) continue;
      if (vec) {
        if (4 * lane < g.W) v[b] = *reinterpret_cast<const float4*>(row + 4 * lane);
      } else {
        if (lane < g.W) v[b].x = row[lane * g.xs_w];
        if (lane + 32 < g.W) v[b].y = row[(lane + 32) * g.xs_w];
      }
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (rr0 + b >= rows) break;
      float* d = dst + slot(r0 + rr0 + b) * kLD;
      if (lane < kReach) d[lane] = 0.f;  // zero columns 0 .. 14 and 15 + W .. kLD - 1
      for (int col = kReach + g.W + lane; col < kLD; col += 32) d[col] = 0.f;
      if (vec) {
        if (4 * lane < g.W) {
          d[kReach + 4 * lane] = v[b].x;
          d[kReach + 4 * lane + 1] = v[b].y;
          d[kReach + 4 * lane + 2] = v[b].z;
          d[kReach + 4 * lane + 3] = v[b].w;
        }
      } else {
        if (lane < g.W) d[kReach + lane] = v[b].x;
        if (lane + 32 < g.W) d[kReach + lane + 32] = v[b].y;
      }
    }
  }
}

// The window columns a strip of kind K reads and the taps it computes: column s * 14 + q + j - 15 of output column q
// with tap j lies in the map only from column 0 on (left strip, K = 0) and before column 56 (right strip, K = 2);
// the middle strips (K = 1) lose one FMA each to the map's sides, so they run every tap. Maps narrower than 56 keep
// zeros in the staged columns past W, so trimming at 56 stays correct for them.
template <int K>
__device__ __forceinline__ bool strip_tap(int q, int j) {
  const int col = q + j - kReach;  // relative to the strip's first column
  return K == 0 ? col >= 0 : K == 2 ? col < kSW : true;
}

// acc[q] += the taps of kernel rows i_lo .. i_hi - 1 on output column q of this lane's strip; the lane's input row
// for kernel row i is p - ph + i (the ring holds it, as zeros where it is past the map).
template <int K>
__device__ __forceinline__ void strip_rows(float (&acc)[kSW], const float* __restrict__ xs,
                                           const float* __restrict__ se, int p, int ph, int i_lo, int i_hi) {
  constexpr int k_lo = K == 0 ? kReach - 1 : 0;  // even, so that the window's pairs stay 8-byte aligned
  constexpr int k_hi = K == 2 ? kSW + kReach : kWin;
  for (int i = i_lo; i < i_hi; ++i) {
    float xw[kWin], e[32];
    const float* xr = xs + slot(p - ph + i) * kLD;
#pragma unroll
    for (int k = k_lo; k < k_hi; k += 2) {
      const float2 v = *reinterpret_cast<const float2*>(xr + k);
      xw[k] = v.x;
      xw[k + 1] = v.y;
    }
#pragma unroll
    for (int k = 0; k < 32; k += 4) load4(e + k, se + i * 32 + k);
#pragma unroll
    for (int j = 0; j < 2 * kReach + 1; ++j)
#pragma unroll
      for (int q = 0; q < kSW; ++q)
        if (strip_tap<K>(q, j)) acc[q] = fmaf(xw[q + j], e[j], acc[q]);
  }
}

__global__ void __launch_bounds__(32 * kWarps, 2) dwconv_fwd_strip_kernel(
    const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ bias, float* __restrict__ y,
    const ConvGeom g, bool vec_in, bool vec_out) {
  extern __shared__ __align__(16) float smem[];
  float* sx = smem;
  float* se = smem + kSmemFloats;  // kernel row i at se + 32 i: tap j at column j - 15 + pw (zero outside)
  const int64_t sample_blocks = (g.N + kSamples - 1) / kSamples;
  const int64_t c = blockIdx.x / sample_blocks, n0 = blockIdx.x % sample_blocks * kSamples;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, z = lane / kRowsWarp, dr = lane % kRowsWarp;
  // Warp w takes a strip of row group w / 4. A scheduler runs warps w and w + 4 (of each block), so the strips are
  // numbered such that each gets one short edge strip and one full middle strip: the Gray code of w % 4 (0, 1, 3,
  // 2) for group 0 and the same with the low bit flipped (1, 0, 2, 3) for group 1. (With strips (w + w / 4) % 4 one
  // scheduler ran two middle strips and set the pace while another idled: v31a.)
  static_assert(kWarps == 8 && kStrips == 4, "two row groups of the four strips");
  const int group = warp / kStrips, strip = (warp % 4) ^ (warp % 4 >> 1) ^ group;
  const int kind = strip == 0 ? 0 : strip == kStrips - 1 ? 2 : 1;
  const float* xs = sx + z * kSS + strip * kSW;
  const float bv = bias != nullptr ? bias[c] : 0.f;

  stage_rows(sx, x, n0, c, -kReach, kRowsIn, g, vec_in);
  for (int u = threadIdx.x; u < g.kh * 32; u += blockDim.x) {
    const int i = u / 32, j = u % 32 - kReach + g.pw;
    se[u] = u % 32 < 2 * kReach + 1 && j >= 0 && j < g.kw ? w[(c * g.kh + i) * g.kw + j] : 0.f;
  }
  for (int p0 = 0; p0 < g.H; p0 += kRowsOut) {
    if (p0 > 0) {
      __syncthreads();  // every warp is done with the rows the new ones replace
      stage_rows(sx, x, n0, c, p0 + kRowsIn - kReach - kRowsOut, kRowsOut, g, vec_in);
    }
    __syncthreads();
    const int pb = p0 + group * kRowsWarp, p = pb + dr;
    if (pb >= g.H || strip * kSW >= g.W) continue;
    // The kernel rows that reach the map for any of the warp's rows (uniform, so lanes never diverge; a lane whose
    // own range is narrower multiplies staged zero rows, at most 3 per edge).
    const int i_lo = max(0, g.ph - pb - (kRowsWarp - 1)), i_hi = min(g.kh, g.H + g.ph - pb);
    float acc[kSW];
#pragma unroll
    for (int q = 0; q < kSW; ++q) acc[q] = 0.f;
    if (kind == 0) strip_rows<0>(acc, xs, se, p, g.ph, i_lo, i_hi);
    else if (kind == 1) strip_rows<1>(acc, xs, se, p, g.ph, i_lo, i_hi);
    else strip_rows<2>(acc, xs, se, p, g.ph, i_lo, i_hi);
    const int64_t n = n0 + z;
    if (n >= g.N || p >= g.H) continue;
    float* out = y + n * g.ys_n + c * g.ys_c + int64_t(p) * g.ys_h;
    const int col0 = strip * kSW;
#pragma unroll
    for (int q = 0; q < kSW; q += 2) {
      if (col0 + q >= g.W) break;
      if (vec_out) {
        *reinterpret_cast<float2*>(out + col0 + q) = make_float2(acc[q] + bv, acc[q + 1] + bv);
      } else {
        out[(col0 + q) * g.ys_w] = acc[q] + bv;
        if (col0 + q + 1 < g.W) out[(col0 + q + 1) * g.ys_w] = acc[q + 1] + bv;
      }
    }
  }
}

}  // namespace

int strip_smem(int64_t kh) { return int(sizeof(float)) * (kSmemFloats + int(kh) * 32); }  // 111 KB at kh 31

bool strip_fits(const at::Tensor& t, int64_t kh, int64_t kw) {
  return t.scalar_type() == at::kFloat && t.size(3) > 32 && t.size(3) <= kStrips * kSW && kw >= 25 &&
         kw <= 2 * kReach + 1 && kh <= 2 * kReach + 1 && t.size(0) >= kSamples &&
         strip_smem(kh) <= smem_limit(t.get_device());
}

void launch_dwconv_fwd_strip(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, at::Tensor& y,
                             int64_t ph, int64_t pw) {
  const c10::cuda::CUDAGuard guard(x.device());
  const ConvGeom g = make_geom(x, y, w.size(1), w.size(2), ph, pw);
  if (g.N * g.C == 0 || g.H == 0) return;
  TORCH_CHECK(strip_fits(x, g.kh, g.kw), "launch_dwconv_fwd_strip: fp32 maps 33-56 wide, kernels 25-31 wide");
  const int64_t blocks = g.C * ((g.N + kSamples - 1) / kSamples);
  TORCH_CHECK(blocks < INT32_MAX, "lkcnn dwconv2d: too many (n, c) planes for one launch");
  const int smem = strip_smem(g.kh);
  constexpr auto kernel = dwconv_fwd_strip_kernel;
  allow_dynamic_smem<kernel>(smem);
  kernel<<<unsigned(blocks), 32 * kWarps, smem, at::cuda::getCurrentCUDAStream()>>>(
      x.const_data_ptr<float>(), w.const_data_ptr<float>(), bias.defined() ? bias.const_data_ptr<float>() : nullptr,
      y.mutable_data_ptr<float>(), g, rows_allow(x, 4), rows_allow(y, 2));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace lkcnn
