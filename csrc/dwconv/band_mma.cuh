// Tensor-core building block of the fp16/bf16 kernels: one row of a depthwise correlation as a banded Toeplitz
// GEMM on mma.sync.m16n8k16 (fp32 accumulation), for compute capability 8.0 and newer.
//
// A 1-D correlation out[w] = sum_j a[w + j] * k[j] of 8 outputs with a K-tap kernel is the product of the 16S-wide
// band a[0 .. 16S) with the Toeplitz matrix B[kk, w] = k[kk - w] (zero outside 0 <= kk - w < K), 16S >= K + 7.
// With the 16 rows of the M dimension being 16 rows of a staged tile, one mma computes 16 rows x 8 outputs of one
// band step. Both users fit this form: the forward (rows = output rows, k = one kernel row, the sum over kernel
// rows outside) and the weight gradient (rows = kernel rows, k = one row of grad_out, the sum over grad_out rows
// outside). B depends only on the band step, not on which 8 outputs, so a warp computes NB adjacent 8-column
// blocks with one B fragment per step; block b at step s reads the tile's columns 8b + 16s .. 8b + 16s + 15, so the
// blocks share 8-column "halves" of A, kept in a register window that slides two halves per step.
#pragma once

#include <cstdint>
#include <type_traits>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "dwconv.h"

namespace lkcnn {

// Four (two) 8x8 b16 matrices from shared memory; lane l gives the row address of matrix l / 8. Trans: each matrix
// transposed (lane 4g + t gets elements (2t, g) and (2t + 1, g) of the stored matrix instead of (g, 2t), (g, 2t + 1)).
template <bool Trans = false>
__device__ __forceinline__ void ldsm_x4(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3, uint32_t addr) {
  if constexpr (Trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

template <bool Trans = false>
__device__ __forceinline__ void ldsm_x2(uint32_t& r0, uint32_t& r1, uint32_t addr) {
  if constexpr (Trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(addr));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(addr));
}

// acc += A (16x16, four registers) x B (16x8, two registers), fp32 accumulators.
template <typename T>
__device__ __forceinline__ void mma16816(float (&acc)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    static_assert(std::is_same_v<T, c10::Half>, "mma16816: fp16 or bf16 only");
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
#else
  __trap();  // the host never launches the tensor-core kernels below compute capability 8.0
#endif
}

// Two T packed in 32 bits, the first in the low half (the order of an mma operand register).
template <typename T>
__device__ __forceinline__ uint32_t pack2(T lo, T hi) { return uint32_t(lo.x) | (uint32_t(hi.x) << 16); }

// acc[b] += A(rows, columns 8b + 16s + [0, 16)) x Toeplitz(q) for the band steps s < S with s_lo <= s < s_hi
// (steps outside are skipped: their columns lie in the padding). All NB + 2S - 1 halves are loaded first, so the
// loads of one call overlap and the mmas run back to back.
//   a: shared-memory address of this lane's ldmatrix row at column 0 of the band: row (lane & 15) of the 16, and
//      8 columns further for lanes 16-31 (the second matrix pair of an x4 load).
//   q: this lane's B pairs for step 0, i.e. pairs + (8 + 2 * (lane % 4) - lane / 4) of a row of 16S + 8 pairs whose
//      word t + 8 holds (k[t], k[t + 1]); step s adds 16 words, the second register 8 more.
template <typename T, int NB, int S>
__device__ __forceinline__ void band_mma(float (&acc)[NB][4], uint32_t a, const uint32_t* q, int s_lo, int s_hi) {
  constexpr uint32_t kHalf = 8 * sizeof(T);  // bytes of an 8-column half
  constexpr int kHalves = NB + 2 * S - 1;
  uint32_t h[kHalves + 1][2];
#pragma unroll
  for (int k = 0; k + 1 < kHalves; k += 2) ldsm_x4(h[k][0], h[k][1], h[k + 1][0], h[k + 1][1], a + kHalf * k);
  if constexpr (kHalves % 2 == 1) ldsm_x2(h[kHalves - 1][0], h[kHalves - 1][1], a + kHalf * (kHalves - 1));
  uint32_t bq[S][2];
#pragma unroll
  for (int s = 0; s < S; ++s) {
    bq[s][0] = q[16 * s];
    bq[s][1] = q[16 * s + 8];
  }
#pragma unroll
  for (int s = 0; s < S; ++s) {
    if (s < s_lo || s >= s_hi) continue;
#pragma unroll
    for (int b = 0; b < NB; ++b)
      mma16816<T>(acc[b], h[b + 2 * s][0], h[b + 2 * s][1], h[b + 2 * s + 1][0], h[b + 2 * s + 1][1], bq[s][0],
                  bq[s][1]);
  }
}

// Columns of the staged tile that band_mma<T, NB, S> reads.
constexpr int band_cols(int NB, int S) { return 8 * (NB + 2 * S - 1); }

// The host side of the tensor-core kernels refuses GPUs without mma.sync for fp16/bf16 (the Python dispatcher
// sends those to PyTorch before this is reached).
inline void check_tensor_cores() {
  TORCH_CHECK(at::cuda::getCurrentDeviceProperties()->major >= 8,
              "lkcnn dwconv2d: float16/bfloat16 run on tensor cores, which need compute capability 8.0 or newer");
}

// Row stride (elements) of a staged b16 tile with `cols` columns: a multiple of 8 (16-byte ldmatrix rows) and an
// odd number of 16-byte units, so the 8 rows of one ldmatrix matrix fall in 8 different bank groups.
inline int tc_ld(int cols) {
  const int units = (cols + 7) / 8;
  return 8 * (units % 2 == 0 ? units + 1 : units);
}

// Staging of the tiles: the kernels get NCHW-contiguous tensors (bindings.cpp copies other layouts), so a staging
// access moves V elements of a row (16 bytes for V = 8), with its index arithmetic once per access. Copying element
// by element spent most of the weight gradient's instructions on index arithmetic (docs/kernels.md).

// d[0 .. V) = s[0 .. V) in one access of 2V bytes (both aligned to it).
template <int V, typename T>
__device__ __forceinline__ void copy_vec(T* d, const T* s) {
  static_assert(sizeof(T) == 2, "16-bit storage types");
  if constexpr (V == 8) *reinterpret_cast<uint4*>(d) = *reinterpret_cast<const uint4*>(s);
  else if constexpr (V == 4) *reinterpret_cast<uint2*>(d) = *reinterpret_cast<const uint2*>(s);
  else if constexpr (V == 2) *reinterpret_cast<uint32_t*>(d) = *reinterpret_cast<const uint32_t*>(s);
  else d[0] = s[0];
}

// dst(z, r)[j] = src(z, r)[j] for j < cols, every row r < rows of planes z < planes, or zeros where src(z, r) is
// null; shared among nthr threads. src(z, r) - lead is aligned to V elements (lead < V: a box starting inside a
// vector), and rows are readable from there up to the next multiple of V past cols; destinations need no alignment
// (staged columns are offset by the padding), so stores go element by element. One access per thread at a time:
// batching several took the weight gradient from 63 to 100-190 registers.
template <int V, typename T, typename Src, typename Dst>
__device__ __forceinline__ void copy_rows(int planes, int rows, int cols, int lead, int tid, int nthr, Src src,
                                          Dst dst) {
  const int vc = (lead + cols + V - 1) / V, per_plane = rows * vc;
  for (int u = tid; u < planes * per_plane; u += nthr) {
    const int z = u / per_plane, rem = u - z * per_plane, r = rem / vc, j0 = (rem - r * vc) * V - lead;
    const T* s = src(z, r);
    T v[V] __attribute__((aligned(16)));
    if (s != nullptr) copy_vec<V>(v, s + j0);
    else
#pragma unroll
      for (int e = 0; e < V; ++e) v[e] = T(0.f);
    T* d = dst(z, r) + j0;
#pragma unroll
    for (int e = 0; e < V; ++e)
      if (j0 + e >= 0 && j0 + e < cols) d[e] = v[e];
  }
}

// The widest access (8, 4 or 2 elements, else 1) that t's rows allow (rows_allow; t has contiguous rows, checked).
inline int row_vector(const at::Tensor& t) {
  TORCH_CHECK(t.stride(3) == 1 || t.size(3) == 1,
              "lkcnn dwconv2d: the tensor-core kernels take tensors with contiguous rows");
  for (const int v : {8, 4, 2})
    if (rows_allow(t, v)) return v;
  return 1;
}

// f(std::integral_constant<int, V>{}) for the runtime V (8, 4, 2 or 1).
template <typename F>
__device__ __forceinline__ void with_vector(int v, F f) {
  switch (v) {
    case 8: return f(std::integral_constant<int, 8>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 2: return f(std::integral_constant<int, 2>{});
    default: return f(std::integral_constant<int, 1>{});
  }
}

}  // namespace lkcnn
