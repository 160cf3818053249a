// NCHW <-> channels_last copies for the kernels that stage one channel per block (tensor-core and whole-map kernels).
// In channels_last every element such a kernel reads or writes is a 32-byte sector of its own, which made those
// passes 1.6-2.2x slower than in NCHW (docs/kernels.md, layout copies). PyTorch's copy for this permutation ran at ~1 TB/s
// on the H100 (two copies of an s3 fp32 tensor took ~100 us, v16), so lkcnn transposes through shared memory tiles.
#include "dwconv.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

namespace lkcnn {
namespace {

constexpr int kTile = 32;  // threadIdx.x; a tile is kTile * V elements square
constexpr int kRows = 8;   // threadIdx.y: rows of the tile per pass

// V consecutive elements moved as one access (4 or 8 bytes for V = 2).
template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

// dst[b][s][r] = src[b][r][s] for B matrices of R x S elements; blockIdx.x picks the tile, blockIdx.y the matrix
// (striding by gridDim.y past 65535 matrices). Each thread moves V consecutive elements per access: V = 2 (R and S
// even) halves the memory instructions and doubles the tile, whose 2,048-byte tiles of 16-bit elements ran at ~1.5
// TB/s with V = 1 (docs/kernels.md, layout copies).
template <typename T, int V>
__global__ void __launch_bounds__(kTile * kRows) transpose_kernel(const T* __restrict__ src, T* __restrict__ dst,
                                                                  int64_t B, int64_t R, int64_t S) {
  constexpr int TT = kTile * V, passes = TT / kRows;
  __shared__ __align__(16) T tile[TT][TT + V];  // +V: the column reads of the second phase spread over the banks
  const int64_t tiles_s = (S + TT - 1) / TT;
  const int64_t r0 = blockIdx.x / tiles_s * TT, s0 = blockIdx.x % tiles_s * TT;
  const int col = threadIdx.x * V;
  for (int64_t b = blockIdx.y; b < B; b += gridDim.y) {
    const T* in = src + b * R * S;
    T* out = dst + b * R * S;
    Vec<T, V> v[passes] = {};  // all loads of a pass in flight before the first store (one at a time ran at ~1 TB/s)
    const T* p = in + (r0 + threadIdx.y) * S + s0 + col;
#pragma unroll
    for (int k = 0; k < passes; ++k, p += kRows * S)
      if (r0 + threadIdx.y + k * kRows < R && s0 + col < S) v[k] = *reinterpret_cast<const Vec<T, V>*>(p);
#pragma unroll
    for (int k = 0; k < passes; ++k)
#pragma unroll
      for (int j = 0; j < V; ++j) tile[threadIdx.y + k * kRows][col + j] = v[k].v[j];
    __syncthreads();
    T* q = out + (s0 + threadIdx.y) * R + r0 + col;
#pragma unroll
    for (int k = 0; k < passes; ++k, q += kRows * R) {
      const int i = threadIdx.y + k * kRows;
      if (s0 + i < S && r0 + col < R) {
        Vec<T, V> o;
#pragma unroll
        for (int j = 0; j < V; ++j) o.v[j] = tile[col + j][i];
        *reinterpret_cast<Vec<T, V>*>(q) = o;
      }
    }
    __syncthreads();
  }
}

template <typename T, int V>
void run_transpose(const at::Tensor& src, at::Tensor& dst, int64_t B, int64_t R, int64_t S) {
  constexpr int TT = kTile * V;
  const int64_t tiles = (R + TT - 1) / TT * ((S + TT - 1) / TT);
  TORCH_CHECK(tiles < INT32_MAX, "lkcnn: map too large for one transpose launch");
  const dim3 grid(unsigned(tiles), unsigned(std::min<int64_t>(B, 65535)));
  transpose_kernel<T, V><<<grid, dim3(kTile, kRows), 0, at::cuda::getCurrentCUDAStream()>>>(
      src.const_data_ptr<T>(), dst.mutable_data_ptr<T>(), B, R, S);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void run_transpose(const at::Tensor& src, at::Tensor& dst, int64_t B, int64_t R, int64_t S) {
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % (2 * sizeof(T)) == 0; };
  if (R % 2 == 0 && S % 2 == 0 && aligned(src.const_data_ptr()) && aligned(dst.const_data_ptr()))
    return run_transpose<T, 2>(src, dst, B, R, S);
  run_transpose<T, 1>(src, dst, B, R, S);
}

// dst = src as B matrices of R x S elements transposed; both dense in memory (any logical layout).
void transpose(const at::Tensor& src, at::Tensor& dst, int64_t B, int64_t R, int64_t S) {
  const c10::cuda::CUDAGuard guard(src.device());
  if (src.numel() == 0) return;
  switch (src.scalar_type()) {
    case at::kFloat: return run_transpose<float>(src, dst, B, R, S);
    case at::kHalf: return run_transpose<c10::Half>(src, dst, B, R, S);
    default: return run_transpose<c10::BFloat16>(src, dst, B, R, S);
  }
}

}  // namespace

at::Tensor to_nchw(const at::Tensor& t) {
  if (t.is_contiguous()) return t;
  if (!t.is_contiguous(at::MemoryFormat::ChannelsLast)) return t.contiguous();
  at::Tensor out = at::empty(t.sizes(), t.options().memory_format(at::MemoryFormat::Contiguous));
  transpose(t, out, t.size(0), t.size(2) * t.size(3), t.size(1));  // [N][HW][C] -> [N][C][HW]
  return out;
}

void copy_from_nchw(at::Tensor& dst, const at::Tensor& src) {
  if (!dst.is_contiguous() && dst.is_contiguous(at::MemoryFormat::ChannelsLast))
    transpose(src, dst, src.size(0), src.size(1), src.size(2) * src.size(3));  // [N][C][HW] -> [N][HW][C]
  else dst.copy_(src);
}

}  // namespace lkcnn
