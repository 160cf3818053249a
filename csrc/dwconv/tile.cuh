// Helpers shared by the kernels: 16-byte shared-memory loads, staging of a padded tile as fp32 (SIMT kernels),
// zeroing shared memory, and the launch-side opt-in to large shared memory.
#pragma once

#include <cstdint>

#include <c10/cuda/CUDAException.h>

namespace lkcnn {

__device__ __forceinline__ void load4(float* dst, const float* src) {
  const float4 v = *reinterpret_cast<const float4*>(src);
  dst[0] = v.x; dst[1] = v.y; dst[2] = v.z; dst[3] = v.w;
}

// Offset of column 0 of staged row r: rows of P consecutive rows alternate between a shift of 0 and 4 floats, so
// that lanes reading rows P apart at the same column (the usual pattern, each thread owning P rows) fall in
// different 16-byte bank groups instead of conflicting. P = 0: no shift.
template <int P>
__device__ __forceinline__ int row_offset(int r, int ld) {
  if constexpr (P == 0) return r * ld;
  else return r * ld + (((r / P) & 1) << 2);
}

// Row stride of a staged tile of `cols` columns (room for the shift of row_offset).
template <int P>
constexpr int staged_ld(int cols) { return P == 0 ? cols : cols + 4; }

// dst[row_offset<P>(r, ld) + c] = src[(r + r_off) * sh + (c + c_off) * sw] as fp32 where that lies inside the
// H x W plane and c < col_end, else 0; for r < rows, c < cols, shared among nthr threads. Each thread keeps kBatch
// global loads in flight before it stores them: one load at a time leaves the staging latency-bound. Row and column
// advance by increments, with no division per element.
template <int P, typename T>
__device__ __forceinline__ void stage_tile(float* __restrict__ dst, const T* __restrict__ src, int rows, int cols,
                                           int r_off, int c_off, int col_end, int H, int W, int64_t sh, int64_t sw,
                                           int tid, int nthr) {
  constexpr int kBatch = 8;
  const int total = rows * cols, ld = staged_ld<P>(cols);
  const int dr = nthr / cols, dc = nthr - dr * cols;
  int r = tid / cols, c = tid - r * cols;
  for (int base = tid; base < total; base += kBatch * nthr) {
    float v[kBatch];
    int at[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int gr = r + r_off, gc = c + c_off;
      const bool inside = base + k * nthr < total && c < col_end && gr >= 0 && gr < H && gc >= 0 && gc < W;
      v[k] = inside ? static_cast<float>(src[gr * sh + gc * sw]) : 0.f;
      at[k] = row_offset<P>(r, ld) + c;
      c += dc;
      r += dr;
      if (c >= cols) { c -= cols; ++r; }
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k)
      if (base + k * nthr < total) dst[at[k]] = v[k];
  }
}

// Zero `bytes` (a multiple of 16) of shared memory at dst (16-byte aligned).
__device__ __forceinline__ void zero_smem(void* dst, int bytes, int tid, int nthr) {
  uint4* p = reinterpret_cast<uint4*>(dst);
  for (int i = tid; i < bytes / 16; i += nthr) p[i] = make_uint4(0, 0, 0, 0);
}

// Before launching Kernel with `bytes` of dynamic shared memory: a kernel must opt in where its dynamic and static
// shared memory together exceed 48 KB (counting only the dynamic part failed a launch with 160 static bytes). The
// static size is asked once per kernel, not at every launch (the training step is bound by host time).
template <auto Kernel>
void allow_dynamic_smem(int bytes) {
  static const int static_bytes = [] {
    cudaFuncAttributes attr;
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, Kernel));
    return int(attr.sharedSizeBytes);
  }();
  if (bytes + static_bytes > 48 * 1024)
    C10_CUDA_CHECK(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

}  // namespace lkcnn
