// Device pieces shared by the 8-bit depthwise kernels: the strip kernel of wide maps (dwconv8_fwd.cu) and the
// whole-map kernel of maps up to 32 columns wide (dwconv8_small.cu).
#pragma once

#include <cstdint>

#include <ATen/ATen.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

namespace lkcnn {
namespace dwconv8 {

constexpr int kThreads = 256;
constexpr int kChunks = 3;  // Toeplitz chunks of a kernel row (kernels up to 33 taps), the first left of the block

struct Args {
  const uint8_t* x;
  const uint4* table;
  const float* alpha;
  const float* beta;
  const float* out_scale;
  void* y;
  int N, C, H, W, pad;
  int pairs;       // kernel row pairs
  int samples;     // per block
  int row_stride;  // bytes of a staged row: an odd number of 16-byte units
  int act;         // 0 none, 1 ReLU, 2 GELU
};

enum class Out { k8, kBf16, kF16, kF32 };

// Bytes of a staged element: the INT8 value, or FP8's value as f16.
template <bool Fp8>
constexpr int kElem = Fp8 ? 2 : 1;

__device__ __forceinline__ void mma_s8(int (&acc)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+r"(acc[0]), "+r"(acc[1]), "+r"(acc[2]), "+r"(acc[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();  // the host launches these kernels on compute capability 8.0 or newer only
#endif
}

// out_scale's grid, read once per thread: the scale and its correctly rounded reciprocal.
struct OutGrid {
  float scale = 1.f, inv = 1.f;
};
__device__ __forceinline__ OutGrid out_grid(const float* out_scale) {
  const float scale = *out_scale;
  return {scale, __frcp_rn(scale)};
}

// v / scale correctly rounded, without __fdiv_rn's branch to its slow path (which kept the compiler from
// interleaving an epilogue's values, one branch region each): q = v * inv and two corrections by the exact remainder
// (Markstein's; the second starts within half an ulp, so it rounds correctly). |v| is first clamped to 1024 scale,
// where every 8-bit grid has saturated, so nothing overflows; a zero keeps its sign.
__device__ __forceinline__ float quotient(float v, const OutGrid& g) {
  const float c = fminf(fmaxf(v, -1024.f * g.scale), 1024.f * g.scale);
  float q = __fmul_rn(c, g.inv);
  q = __fmaf_rn(__fmaf_rn(-q, g.scale, c), g.inv, q);
  q = __fmaf_rn(__fmaf_rn(-q, g.scale, c), g.inv, q);
  return copysignf(q, v);
}

// An output's float value: alpha * sum + beta (two roundings, as the reference computes), then the activation.
template <int Act>
__device__ __forceinline__ float out_value(float sum, float alpha, float beta) {
  float v = __fadd_rn(__fmul_rn(sum, alpha), beta);
  if constexpr (Act == 1) v = fmaxf(v, 0.f);
  else if constexpr (Act == 2) v = v * 0.5f * (1.f + erff(v * 0.70710678118654752f));
  return v;
}

// QuantizeLinear onto the grid, as a byte: int8 rounds half to even and saturates; e4m3 rounds to nearest even and
// saturates at +-448.
template <bool Fp8>
__device__ __forceinline__ uint8_t quantize8(float v, const OutGrid& grid) {
  const float q = fminf(fmaxf(quotient(v, grid), Fp8 ? -448.f : -128.f), Fp8 ? 448.f : 127.f);
  if constexpr (Fp8) return __nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3);
  else return uint8_t(int8_t(__float2int_rn(q)));
}

// One output value into y[i]: its value, then the quantized byte or the float in y's dtype.
template <bool Fp8, Out O, int Act>
__device__ __forceinline__ void store(void* y, int64_t i, float sum, float alpha, float beta, const OutGrid& grid) {
  const float v = out_value<Act>(sum, alpha, beta);
  if constexpr (O == Out::k8) static_cast<uint8_t*>(y)[i] = quantize8<Fp8>(v, grid);
  else if constexpr (O == Out::kBf16) static_cast<__nv_bfloat16*>(y)[i] = __float2bfloat16_rn(v);
  else if constexpr (O == Out::kF16) static_cast<__half*>(y)[i] = __float2half_rn(v);
  else static_cast<float*>(y)[i] = v;
}

// Four staged bytes of one row as the staged elements: copied for INT8, e4m3 -> f16 (exact) for FP8.
template <bool Fp8>
__device__ __forceinline__ void stage4(uint8_t* dst, uint32_t bytes) {
  if constexpr (Fp8) {
    const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(bytes & 0xffff), __NV_E4M3);
    const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(bytes >> 16), __NV_E4M3);
    *reinterpret_cast<uint2*>(dst) =
        make_uint2(uint32_t(lo.x) | uint32_t(lo.y) << 16, uint32_t(hi.x) | uint32_t(hi.y) << 16);
  } else {
    *reinterpret_cast<uint32_t*>(dst) = bytes;
  }
}

// An asynchronous copy of 16 or 4 bytes from global to shared memory (16: bypassing L1), waited for by
// cp_async_wait_all.
template <int Bytes>
__device__ __forceinline__ void cp_async(void* dst, const void* src) {
  static_assert(Bytes == 16 || Bytes == 4, "cp.async copies 4, 8 or 16 bytes; these kernels use 16 and 4");
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  if constexpr (Bytes == 16) asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src));
  else asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(d), "l"(src));
}

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::); }

// The aligned 4-byte word of x at byte `word` whose end lies past the tensor's `total` bytes: its bytes inside the
// tensor, zeros after (no read past the end).
__device__ __forceinline__ uint32_t tail_word(const uint8_t* x, int64_t word, int64_t total) {
  uint32_t v = 0;
  for (int e = 0; word + e < total; ++e) v |= uint32_t(__ldg(x + word + e)) << (8 * e);
  return v;
}

// One staged element: the INT8 byte, or FP8's value as f16.
template <bool Fp8>
__device__ __forceinline__ void stage1(uint8_t* dst, uint8_t byte) {
  if constexpr (Fp8) reinterpret_cast<__half_raw*>(dst)[0] = __nv_cvt_fp8_to_halfraw(byte, __NV_E4M3);
  else dst[0] = byte;
}

// The whole-map kernel (dwconv8_small.cu) where the map is at most 32 columns wide and a block's shared memory
// holds its table rows and one 32-sample group; false (nothing launched) elsewhere.
bool launch_small(Args args, bool fp8, int smem_limit, at::ScalarType out, cudaStream_t stream);

}  // namespace dwconv8
}  // namespace lkcnn
