// Device helpers shared by the kernels: 16-byte shared-memory loads and staging of a padded tile as fp32.
#pragma once

#include <cstdint>

namespace lkcnn {

__device__ __forceinline__ void load4(float* dst, const float* src) {
  const float4 v = *reinterpret_cast<const float4*>(src);
  dst[0] = v.x; dst[1] = v.y; dst[2] = v.z; dst[3] = v.w;
}

// dst[r * cols + c] = src[(r + r_off) * sh + (c + c_off) * sw] as fp32 where that lies inside the H x W plane and
// c < col_end, else 0; for r < rows, c < cols, shared among nthr threads. Each thread keeps kBatch global loads in
// flight before it stores them: one load at a time leaves the staging latency-bound (the first version of these
// kernels spent more time staging than computing). Row and column advance by increments, with no division per
// element.
template <typename T>
__device__ __forceinline__ void stage_tile(float* __restrict__ dst, const T* __restrict__ src, int rows, int cols,
                                           int r_off, int c_off, int col_end, int H, int W, int64_t sh, int64_t sw,
                                           int tid, int nthr) {
  constexpr int kBatch = 8;
  const int total = rows * cols;
  const int dr = nthr / cols, dc = nthr - dr * cols;
  int r = tid / cols, c = tid - r * cols;
  for (int base = tid; base < total; base += kBatch * nthr) {
    float v[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int gr = r + r_off, gc = c + c_off;
      const bool inside = base + k * nthr < total && c < col_end && gr >= 0 && gr < H && gc >= 0 && gc < W;
      v[k] = inside ? static_cast<float>(src[gr * sh + gc * sw]) : 0.f;
      c += dc;
      r += dr;
      if (c >= cols) { c -= cols; ++r; }
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k)
      if (base + k * nthr < total) dst[base + k * nthr] = v[k];
  }
}

}  // namespace lkcnn
