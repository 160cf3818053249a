// The large depthwise convolution of a deploy-form network on 8-bit inputs (INT8 or FP8 e4m3), with the
// per-channel scale, bias, activation and the quantization for the next layer in its epilogue.
//
// Formulation. For one channel, 16 output columns of one output row take, from kernel row d, the product of a
// Toeplitz block A[m][i] = w[d][16 j + i - m + pw - 16] (m: output column, i: one of 16 input columns of chunk j)
// with those 16 input columns. The 8 columns of N are 8 output rows of one sample (each reading its own input row),
// so one k32 INT8 mma (mma.sync.m16n8k32: kernel rows d and d + 1 in its two halves of K) or two f16 mmas
// (m16n8k16, one per kernel row) compute 16 columns x 8 rows for a pair of kernel rows and one 16-column chunk.
// FP8 runs as f16: Hopper has no mma.sync for e4m3 (ptxas lowers it to two f16 mmas that unpack both operands at
// every call), and e4m3 values are exact in f16, so the map is converted once when it is staged and the weight
// table is packed in f16. A is a table in shared memory (packed once per model by lkcnn/ops/dwconv8.py), B comes
// from the staged map; both by ldmatrix. Input chunks start at multiples of 16 columns, so rows stage without
// shifts; which chunks can meet the map is known at compile time per map width (NB, Tiled), so the mma loop has no
// predicates, and pairs of kernel rows whose input rows all lie in the zero padding are not visited.
//
// A block owns one channel of several samples (whole maps, 8 zero rows above and below, zero columns around) and,
// past 64 columns, one 64-column tile. Each warp takes items of two 8-row groups x (16 * NB) columns of one sample.
// Sums are exact for INT8 (int32) and accumulate in fp32 for FP8. The output is NCHW.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "../dwconv/band_mma.cuh"
#include "dwconv8.h"
#include "dwconv8_device.cuh"

namespace lkcnn {
namespace {

using namespace dwconv8;

constexpr int kRowGroups = 2;  // 8-row groups per warp item
constexpr int kPadRows = 8;    // zero rows staged above and below a map
constexpr int kSmemTarget = 100 * 1024;  // two blocks per SM

// The staged chunks q (input columns col0 + 16 q ..) that can meet the map, inclusive: with the block's first
// chunk 16 columns left of its first output column, a map of up to 16 (NB = 1) or 32 (NB = 2) columns is chunks
// 1 .. NB; one of up to 64 columns, chunks 1 .. 4; a 64-column tile of a wider map, any of its 6.
template <int NB, bool Tiled>
constexpr int kQLo = Tiled ? 0 : 1;
template <int NB, bool Tiled>
constexpr int kQHi = Tiled ? NB + kChunks - 1 : NB;
// Whether some output block uses chunk j's Toeplitz block.
template <int NB, bool Tiled>
constexpr bool chunk_used(int j) { return j + NB - 1 >= kQLo<NB, Tiled> && j <= kQHi<NB, Tiled>; }

// The mmas of kernel-row pair p for the item's live row groups: acc[r][nb] += chunk j's Toeplitz block x the
// input rows of group r at chunk nb + j, for the chunks that can meet the map. top: the input row of the item's
// output row 0 at kernel row 2p; b_item: this lane's ldmatrix address in the item's staged map at row 0.
template <bool Fp8, int NB, bool Tiled, bool Live0, bool Live1, typename Acc>
__device__ __forceinline__ void pair_step(Acc (&acc)[kRowGroups][NB][4], int p, uint32_t a_lane, uint32_t b_item,
                                          int top, int row_stride) {
  constexpr int qlo = kQLo<NB, Tiled>, qhi = kQHi<NB, Tiled>;
  constexpr bool live[kRowGroups] = {Live0, Live1};
  constexpr int E = kElem<Fp8>;
  // A: for INT8, one x4 holds kernel rows 2p and 2p + 1 of a chunk; for f16, one x4 per kernel row and chunk.
  uint32_t A[kChunks][Fp8 ? 2 : 1][4];
#pragma unroll
  for (int j = 0; j < kChunks; ++j)
#pragma unroll
    for (int h = 0; h < (Fp8 ? 2 : 1); ++h)
      if (chunk_used<NB, Tiled>(j))
        ldsm_x4(A[j][h][0], A[j][h][1], A[j][h][2], A[j][h][3], a_lane + ((2 * p + h) * kChunks + j) * 256 * E);
  // B: for INT8, (rows, chunk q), (rows + 1, q) [, the same for q + 1]; for f16, the two halves of chunk q for
  // rows and rows + 1.
  uint32_t B[kRowGroups][qhi + 2][4];
#pragma unroll
  for (int r = 0; r < kRowGroups; ++r) {
    if (!live[r]) continue;
    const uint32_t b_row = b_item + (top + 8 * r) * row_stride;
    if constexpr (Fp8) {
#pragma unroll
      for (int q = qlo; q <= qhi; ++q) ldsm_x4(B[r][q][0], B[r][q][1], B[r][q][2], B[r][q][3], b_row + 32 * q);
    } else {
#pragma unroll
      for (int q = qlo; q <= qhi; q += 2) {
        if (q + 1 <= qhi) ldsm_x4(B[r][q][0], B[r][q][1], B[r][q + 1][0], B[r][q + 1][1], b_row + 16 * q);
        else ldsm_x2(B[r][q][0], B[r][q][1], b_row + 16 * q);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kChunks; ++j)
#pragma unroll
    for (int r = 0; r < kRowGroups; ++r)
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        const int q = nb + j;
        if (!live[r] || q < qlo || q > qhi) continue;
        if constexpr (Fp8) {
          mma16816<c10::Half>(acc[r][nb], A[j][0][0], A[j][0][1], A[j][0][2], A[j][0][3], B[r][q][0], B[r][q][1]);
          mma16816<c10::Half>(acc[r][nb], A[j][1][0], A[j][1][1], A[j][1][2], A[j][1][3], B[r][q][2], B[r][q][3]);
        } else {
          mma_s8(acc[r][nb], A[j][0], B[r][q][0], B[r][q][1]);
        }
      }
}

template <bool Fp8, int NB, bool Tiled, Out O>
__global__ void __launch_bounds__(kThreads, 2) dwconv8_fwd_kernel(const Args a) {
  using Acc = std::conditional_t<Fp8, float, int>;
  constexpr int E = kElem<Fp8>, Q = NB + kChunks - 1;
  extern __shared__ __align__(16) uint8_t smem[];
  const int c = blockIdx.x, n0 = blockIdx.y * a.samples, x0 = blockIdx.z * 16 * NB;
  const int ns = min(a.samples, a.N - n0);
  const int col0 = x0 - 16;  // input column of a staged row's first element
  const int plane = (a.H + 2 * kPadRows) * a.row_stride;
  const int table_bytes = 2 * a.pairs * kChunks * 256 * E;
  uint8_t* table = smem;
  uint8_t* xs = smem + table_bytes;

  // The table, and the staging area zeroed (padding rows and columns stay zero).
  const uint4* gt = a.table + int64_t(c) * (table_bytes / 16);
  for (int i = threadIdx.x; i < table_bytes / 16; i += kThreads) cp_async<16>(table + 16 * i, gt + i);
  for (int i = threadIdx.x; i < ns * plane / 16; i += kThreads)
    reinterpret_cast<uint4*>(xs)[i] = make_uint4(0, 0, 0, 0);
  __syncthreads();

  // The map's columns this tile reads: each row's span as aligned 4-byte words (a row's ends masked), FP8 converted
  // to f16 on the way. Thread t takes word t % kWords of rows t / kWords, t / kWords + kThreads / kWords, ... (the
  // sample and row advanced by subtraction, no division per word), four loads in flight before their stores.
  constexpr int kWords = NB == 1 ? 8 : NB == 2 ? 16 : 32;  // >= the words of a span of 16 * Q columns, plus one
  const int lo = max(col0, 0), hi = min(col0 + 16 * Q, a.W);
  const int64_t total = int64_t(a.N) * a.C * a.H * a.W;
  const int64_t sample_stride = int64_t(a.C) * a.H * a.W;
  const uint8_t* plane0 = a.x + (int64_t(n0) * a.C + c) * a.H * a.W;
  const int w = threadIdx.x % kWords;
  int s = 0, row = threadIdx.x / kWords;
  while (s < ns && row >= a.H) row -= a.H, ++s;
  while (s < ns) {
    uint32_t v[4];
    int s_of[4], row_of[4], col_of[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      s_of[u] = s, row_of[u] = row, col_of[u] = INT32_MIN;
      if (s < ns) {
        const int64_t start = (plane0 - a.x) + s * sample_stride + int64_t(row) * a.W;  // the row's first byte
        const int64_t word = ((start + lo) & ~int64_t(3)) + 4 * w;
        if (word < start + hi) {
          v[u] = word + 4 <= total ? __ldg(reinterpret_cast<const uint32_t*>(a.x + word)) : tail_word(a.x, word, total);
          col_of[u] = int(word - start);
        }
        row += kThreads / kWords;
        while (s < ns && row >= a.H) row -= a.H, ++s;
      }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int col = col_of[u];
      if (col == INT32_MIN) continue;
      uint8_t* dst = xs + s_of[u] * plane + (row_of[u] + kPadRows) * a.row_stride;
      if (col >= lo && col + 3 < hi && (col & 3) == 0) {
        stage4<Fp8>(dst + (col - col0) * E, v[u]);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (col + e >= lo && col + e < hi) stage1<Fp8>(dst + (col + e - col0) * E, uint8_t(v[u] >> (8 * e)));
      }
    }
  }
  cp_async_wait_all();
  __syncthreads();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int row_groups = (a.H + 7) / 8, per_sample = (row_groups + kRowGroups - 1) / kRowGroups;
  const uint32_t table_s = static_cast<uint32_t>(__cvta_generic_to_shared(table));
  const uint32_t xs_s = static_cast<uint32_t>(__cvta_generic_to_shared(xs));
  // ldmatrix rows. A (INT8): (kernel row 2p, m 0-7), (2p, m 8-15), (2p + 1, m 0-7), (2p + 1, m 8-15) from the table's
  // [d][j][m][16 bytes]; A (f16): (half 0, m 0-7), (0, 8-15), (1, 0-7), (1, 8-15) of [d][j][half][m][8 values].
  // B (INT8): (input row of output row i, chunk q), (the next input row, q), then chunk q + 1; B (f16): (row i, half
  // 0), (row i, half 1), (row i + 1, half 0), (row i + 1, half 1) of chunk q.
  const uint32_t a_lane = table_s + (Fp8 ? lane * 16 : (lane / 16 * kChunks) * 256 + (lane % 16) * 16);
  const uint32_t b_lane =
      Fp8 ? (lane % 8 + lane / 16 + kPadRows) * a.row_stride + lane / 8 % 2 * 16
          : (lane % 8 + lane / 8 % 2 + kPadRows) * a.row_stride + lane / 16 * 16;
  const float alpha = a.alpha[c], beta = a.beta[c];
  const OutGrid grid = O == Out::k8 ? out_grid(a.out_scale) : OutGrid{};

  for (int item = warp; item < ns * per_sample; item += kThreads / 32) {
    const int s = item / per_sample, rg0 = (item - s * per_sample) * kRowGroups;
    Acc acc[kRowGroups][NB][4] = {};
    // Pairs whose 9 input rows (an 8-row group's, kernel rows 2p and 2p + 1) meet the map, per group; the second
    // group's rows lie 8 lower, so its pairs start and end 4 earlier: its own, both groups', the first's.
    const int top0 = rg0 * 8 - a.pad;  // input row of the item's output row 0 at kernel row 0
    const int lo0 = max(0, (-top0 - 8 + 1) / 2), hi0 = min(a.pairs, (a.H - 1 - top0) / 2 + 1);
    const bool second = rg0 * 8 + 8 < a.H;
    const int lo1 = second ? max(0, (-top0 - 16 + 1) / 2) : 0;
    const int hi1 = second ? min(a.pairs, (a.H - 9 - top0) / 2 + 1) : 0;
    const uint32_t b_item = xs_s + s * plane + b_lane;
    for (int p = lo1; p < min(lo0, hi1); ++p)
      pair_step<Fp8, NB, Tiled, false, true>(acc, p, a_lane, b_item, top0 + 2 * p, a.row_stride);
    for (int p = max(lo0, lo1); p < min(hi0, hi1); ++p)
      pair_step<Fp8, NB, Tiled, true, true>(acc, p, a_lane, b_item, top0 + 2 * p, a.row_stride);
    for (int p = max(lo0, hi1); p < hi0; ++p)
      pair_step<Fp8, NB, Tiled, true, false>(acc, p, a_lane, b_item, top0 + 2 * p, a.row_stride);
    // acc[r][nb]: (column g, row 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1) of the 16 x 8 block
    const int64_t out_plane = (int64_t(n0 + s) * a.C + c) * a.H * a.W;
    auto epilogue = [&](auto act) {
#pragma unroll
      for (int r = 0; r < kRowGroups; ++r)
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int x = x0 + 16 * nb + g + e / 2 * 8, row = (rg0 + r) * 8 + 2 * t + e % 2;
            if (x < a.W && row < a.H)
              store<Fp8, O, decltype(act)::value>(a.y, out_plane + row * a.W + x, float(acc[r][nb][e]), alpha, beta,
                                                  grid);
          }
    };
    if (a.act == 1) epilogue(std::integral_constant<int, 1>{});
    else if (a.act == 2) epilogue(std::integral_constant<int, 2>{});
    else epilogue(std::integral_constant<int, 0>{});
  }
}

template <bool Fp8, int NB, bool Tiled, Out O>
void launch(const Args& args, dim3 grid, int smem, cudaStream_t stream) {
  auto kernel = dwconv8_fwd_kernel<Fp8, NB, Tiled, O>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<grid, kThreads, smem, stream>>>(args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <bool Fp8, int NB, bool Tiled>
void launch_out(const Args& args, dim3 grid, int smem, cudaStream_t stream, at::ScalarType out) {
  switch (out) {
    case at::kBFloat16: return launch<Fp8, NB, Tiled, Out::kBf16>(args, grid, smem, stream);
    case at::kHalf: return launch<Fp8, NB, Tiled, Out::kF16>(args, grid, smem, stream);
    case at::kFloat: return launch<Fp8, NB, Tiled, Out::kF32>(args, grid, smem, stream);
    default: return launch<Fp8, NB, Tiled, Out::k8>(args, grid, smem, stream);
  }
}

// The map width's instance: up to 16, 32 or 64 columns in one tile, or 64-column tiles.
template <bool Fp8>
void launch_width(const Args& args, dim3 grid, int smem, cudaStream_t stream, at::ScalarType out) {
  if (args.W <= 16) return launch_out<Fp8, 1, false>(args, grid, smem, stream, out);
  if (args.W <= 32) return launch_out<Fp8, 2, false>(args, grid, smem, stream, out);
  if (args.W <= 64) return launch_out<Fp8, 4, false>(args, grid, smem, stream, out);
  return launch_out<Fp8, 4, true>(args, grid, smem, stream, out);
}

}  // namespace

void dwconv8_fwd(const at::Tensor& x, const at::Tensor& table, int64_t k, const at::Tensor& alpha,
                 const at::Tensor& beta, int64_t act, const std::optional<at::Tensor>& out_scale, at::Tensor& y) {
  const bool fp8 = x.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(fp8 || x.scalar_type() == at::kChar, "lkcnn dwconv8: x must be int8 or float8_e4m3fn");
  TORCH_CHECK(x.is_cuda() && x.dim() == 4 && x.is_contiguous() &&
                  reinterpret_cast<uintptr_t>(x.const_data_ptr()) % 4 == 0,
              "lkcnn dwconv8: x must be an NCHW-contiguous CUDA tensor aligned to 4 bytes");
  TORCH_CHECK(k % 2 == 1 && k >= 3 && k <= 2 * 16 + 1, "lkcnn dwconv8: odd kernels of 3 to 33 taps");
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  const int pairs = int(k + 1) / 2;
  TORCH_CHECK(table.scalar_type() == (fp8 ? at::kHalf : at::kByte) && table.is_contiguous() && table.dim() == 2 &&
                  table.size(0) == C && table.size(1) == 2 * pairs * kChunks * 256 && table.device() == x.device(),
              "lkcnn dwconv8: table must be lkcnn.ops.dwconv8.pack_weight of the kernel, on x's device");
  TORCH_CHECK(alpha.scalar_type() == at::kFloat && beta.scalar_type() == at::kFloat && alpha.numel() == C &&
                  beta.numel() == C && alpha.is_contiguous() && beta.is_contiguous(),
              "lkcnn dwconv8: alpha and beta must be contiguous float32 vectors of C");
  TORCH_CHECK(y.sizes() == x.sizes() && y.is_contiguous(), "lkcnn dwconv8: y must be NCHW-contiguous of x's shape");
  const bool quantized = out_scale.has_value();
  TORCH_CHECK(quantized ? y.scalar_type() == x.scalar_type()
                        : (y.scalar_type() == at::kBFloat16 || y.scalar_type() == at::kHalf ||
                           y.scalar_type() == at::kFloat),
              "lkcnn dwconv8: y is x's dtype with out_scale, else bfloat16, float16 or float32");
  TORCH_CHECK(!quantized || (out_scale->scalar_type() == at::kFloat && out_scale->numel() == 1 && out_scale->is_cuda()),
              "lkcnn dwconv8: out_scale must be one float32 on the GPU");
  TORCH_CHECK(N * C < (int64_t(1) << 31) && H * W < (1 << 24), "lkcnn dwconv8: tensor too large for one launch");
  if (x.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const auto* props = at::cuda::getCurrentDeviceProperties();
  TORCH_CHECK(props->major >= 8, "lkcnn dwconv8: needs compute capability 8.0 or newer");

  Args args{};
  args.x = reinterpret_cast<const uint8_t*>(x.const_data_ptr());
  args.table = reinterpret_cast<const uint4*>(table.const_data_ptr());
  args.alpha = alpha.const_data_ptr<float>();
  args.beta = beta.const_data_ptr<float>();
  args.out_scale = quantized ? out_scale->const_data_ptr<float>() : nullptr;
  args.y = y.data_ptr();
  args.N = int(N), args.C = int(C), args.H = int(H), args.W = int(W), args.pad = int(k / 2);
  args.pairs = pairs, args.act = int(act);
  const int limit = int(props->sharedMemPerBlockOptin);
  const auto stream = at::cuda::getCurrentCUDAStream();
  if (launch_small(args, fp8, limit, y.scalar_type(), stream)) return;

  const int nb = W <= 16 ? 1 : W <= 32 ? 2 : 4, elem = fp8 ? 2 : 1;
  const int units = elem * (nb + kChunks - 1);  // 16-byte units of a staged row
  args.row_stride = 16 * (units % 2 ? units : units + 1);
  const int table_bytes = 2 * pairs * kChunks * 256 * elem;
  const int plane = (int(H) + 2 * kPadRows) * args.row_stride;
  TORCH_CHECK(table_bytes + plane <= limit, "lkcnn dwconv8: a ", H, "-row map does not fit a block's shared memory; "
              "run such large kernels on the 16-bit kernels: to_8bit_gemms(..., large_kernels=False)");
  int samples = std::max(1, std::min<int>(int(N), (std::max(kSmemTarget, table_bytes + plane) - table_bytes) / plane));
  const int groups = (int(N) + samples - 1) / samples;
  samples = (int(N) + groups - 1) / groups;  // the same number of blocks, evenly filled
  args.samples = samples;
  const int smem = table_bytes + samples * plane;
  const dim3 grid(unsigned(C), unsigned(groups), unsigned((W + 16 * nb - 1) / (16 * nb)));
  TORCH_CHECK(grid.z < 65536 && grid.y < 65536, "lkcnn dwconv8: too many sample groups or column tiles");
  if (fp8) launch_width<true>(args, grid, smem, stream, y.scalar_type());
  else launch_width<false>(args, grid, smem, stream, y.scalar_type());
}

}  // namespace lkcnn
