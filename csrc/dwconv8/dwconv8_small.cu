// The 8-bit large depthwise convolution on maps up to 32 columns wide (RepLKNet-31B's 28x28, 14x14 and 7x7 stages):
// one channel's whole map as one GEMM on the tensor cores.
//
// For one channel, out[n][p] = sum_q x[n][q] T[q][p]: M the samples, N the output positions p = (oy, ox), K the
// input positions q = (iy, ix), T[q][p] = w[iy - oy + pad][ix - ox + pad] (zero outside the kernel). Positions are
// laid out with a row pitch of 16 or 32 columns, so 16 input columns (block b of row iy) against 16 output columns
// (block a of row oy) are one Toeplitz block of the strip kernel's table: kernel row iy - oy + pad, chunk b - a + 1.
// T is never built: each lane of an ldmatrix points at its output position's row of that block, in a copy of the
// table whose rows outside the kernel are zeros. A is the block's samples' maps, staged at the same pitch with zero
// columns. A warp item is 32 samples x 32 positions (2 x 4 mma tiles) over the input rows within the kernel's reach
// of its output rows, so a table fragment serves 32 samples and a map fragment 32 positions, and a block reads its
// channel's table once for up to 128 samples; the strip kernel reads it per sample group of a few samples, which is
// where its time on small maps went. INT8 multiplies in mma.sync.m16n8k32, FP8 as f16 in m16n8k16 (see
// dwconv8_fwd.cu); the output is NCHW, through the same epilogue.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>

#include "../dwconv/band_mma.cuh"
#include "dwconv8_device.cuh"

namespace lkcnn {
namespace dwconv8 {
namespace {

constexpr int kSampleTile = 32;  // samples of a warp item: two m16 tiles
constexpr int kNTiles = 4;       // n8 tiles (output positions) of a warp item
constexpr int kMaxSamples = 128;  // per block
constexpr int kSmemTarget = 110 * 1024;  // two blocks per SM where the table and the maps allow

// The shared-memory table's shape: a row e = iy - oy + H - 1 per input-row offset (2H rows; kernel row
// e - (H - 1) + pad, or zeros), each holding the chunks b - a + 1 that occur (chunk 1 alone at pitch 16).
template <bool Fp8, int Pitch>
struct Geometry {
  static constexpr int kE = kElem<Fp8>;
  static constexpr int kChunksUsed = Pitch == 16 ? 1 : 3;
  static constexpr int kChunkLo = Pitch == 16 ? 1 : 0;
  static constexpr int kHalves = Fp8 ? 2 : 1;  // f16 blocks hold their two 8-column halves apart
  static constexpr int kRowBytes = kChunksUsed * 256 * kE;
  static constexpr int kTilesPerRow = Pitch / 8;
};

// Bytes of a sample's plane in `raw`: its aligned words (the plane starts at byte plane_shift of the first), and
// the word after them, which phase 2 reads past the last row.
__host__ __device__ constexpr int raw_bytes(int hw) { return (hw + 3) / 4 * 4 + 16; }

// Where plane (n, c) starts in its first aligned word: ((n C + c) HW) mod 4, from the low bits alone.
__device__ __forceinline__ uint32_t plane_shift(int n, int c, int C, int hw) {
  return (uint32_t(n) * uint32_t(C) + uint32_t(c)) * uint32_t(hw) & 3u;
}

// Plane (n, c) of an (N, C, H, W) tensor as aligned 4-byte words: its first byte, the first word's, and how many.
struct PlaneWords {
  int64_t start, base;
  int words;
};
__device__ __forceinline__ PlaneWords plane_words(int n, int c, int C, int hw) {
  const int64_t start = (int64_t(n) * C + c) * hw, base = start & ~int64_t(3);
  return {start, base, int((start + hw - base + 3) / 4)};
}

template <bool Fp8, int Pitch, Out O>
__global__ void __launch_bounds__(kThreads, 2) dwconv8_small_kernel(const Args a) {
  using G = Geometry<Fp8, Pitch>;
  using Acc = std::conditional_t<Fp8, float, int>;
  constexpr int E = G::kE;
  extern __shared__ __align__(16) uint8_t smem[];
  const int c = blockIdx.x, n0 = blockIdx.y * a.samples;
  const int ns = min(a.samples, a.N - n0);
  const int H = a.H, W = a.W, HW = H * W, k = 2 * a.pad + 1;
  const int groups_m = (ns + kSampleTile - 1) / kSampleTile;
  uint8_t* table = smem;
  uint8_t* xs = smem + 2 * H * G::kRowBytes;
  uint8_t* raw = xs + groups_m * kSampleTile * a.row_stride;
  const int raw_stride = raw_bytes(HW);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  // Phase 1, all copies in flight at once: the table's rows (the used chunks of kernel row d, contiguous in the
  // global table, or zeros) and each sample's plane as the aligned 4-byte words that hold it (`raw`, a warp per
  // sample); the staged maps zeroed (the pitch's extra columns, the rows past the map, the samples past ns).
  constexpr int kUnits = G::kRowBytes / 16;
  const uint4* gt = a.table + int64_t(c) * (2 * a.pairs * kChunks * 16 * E);
  for (int i = threadIdx.x; i < 2 * H * kUnits; i += kThreads) {
    const int e = i / kUnits, d = e - (H - 1) + a.pad;
    if (d >= 0 && d < k)
      cp_async<16>(table + 16 * i, gt + (d * kChunks + G::kChunkLo) * 16 * E + (i - e * kUnits));
    else
      reinterpret_cast<uint4*>(table)[i] = make_uint4(0, 0, 0, 0);
  }
  const int64_t total = int64_t(a.N) * a.C * HW;
  for (int s = warp; s < ns; s += kThreads / 32) {
    const PlaneWords p = plane_words(n0 + s, c, a.C, HW);
    for (int w = lane; w < p.words; w += 32) {
      uint8_t* dst = raw + s * raw_stride + 4 * w;
      const int64_t word = p.base + 4 * w;
      if (word + 4 <= total) cp_async<4>(dst, a.x + word);
      else *reinterpret_cast<uint32_t*>(dst) = tail_word(a.x, word, total);
    }
  }
  for (int i = threadIdx.x; i < groups_m * kSampleTile * a.row_stride / 16; i += kThreads)
    reinterpret_cast<uint4*>(xs)[i] = make_uint4(0, 0, 0, 0);
  cp_async_wait_all();
  __syncthreads();

  // Phase 2: each plane from `raw` to the staged map at the pitch, four columns per lane (two aligned words of
  // `raw` funnelled to the four bytes, the columns past the map masked), FP8 converted to f16.
  constexpr int kQuads = Pitch / 4;  // 4-column groups of a staged row
  for (int s = warp; s < ns; s += kThreads / 32) {
    const uint32_t shift = plane_shift(n0 + s, c, a.C, HW);
    const uint32_t* src = reinterpret_cast<const uint32_t*>(raw + s * raw_stride);
    const int u = lane % kQuads;
    if (4 * u >= W) continue;
    const uint32_t keep = 4 * u + 4 <= W ? 0xffffffffu : 0xffffffffu >> (8 * (4 * u + 4 - W));
    for (int iy = lane / kQuads; iy < H; iy += 32 / kQuads) {
      const uint32_t o = shift + iy * W + 4 * u;
      const uint32_t v = __funnelshift_r(src[o / 4], src[o / 4 + 1], 8 * (o % 4)) & keep;
      stage4<Fp8>(xs + s * a.row_stride + (iy * Pitch + 4 * u) * E, v);
    }
  }
  __syncthreads();

  // Phase 3: the items.
  const int g = lane / 4, t = lane % 4;
  const int ntiles = H * G::kTilesPerRow, groups_n = (ntiles + kNTiles - 1) / kNTiles;
  const int k_bytes = a.row_stride - 16;
  const uint32_t table_s = static_cast<uint32_t>(__cvta_generic_to_shared(table));
  // ldmatrix rows. A: (samples 0-7, K bytes 0-15), (8-15, 0-15), (0-7, 16-31), (8-15, 16-31) of an m16 tile and a
  // 32-byte K step. B, two n8 tiles per x4: (tile 0, K bytes 0-15), (tile 0, 16-31), (tile 1, 0-15), (tile 1, 16-31),
  // each row an output position's row of the Toeplitz block its 16 K bytes meet.
  const uint32_t a_lane =
      static_cast<uint32_t>(__cvta_generic_to_shared(xs)) + (lane % 16) * a.row_stride + (lane / 16) * 16;
  const int k_half = lane / 8 % 2;
  const float alpha = a.alpha[c], beta = a.beta[c];
  const OutGrid grid = O == Out::k8 ? out_grid(a.out_scale) : OutGrid{};

  for (int item = warp; item < groups_m * groups_n; item += kThreads / 32) {
    const int mg = item / groups_n, nt0 = (item - mg * groups_n) * kNTiles;
    // the input rows that reach the item's output rows, as whole 32-byte K steps
    const int oy_lo = nt0 / G::kTilesPerRow, oy_hi = min(H - 1, (nt0 + kNTiles - 1) / G::kTilesPerRow);
    const int iy_lo = max(0, oy_lo - a.pad), iy_hi = min(H - 1, oy_hi + a.pad);
    const int kb_lo = (iy_lo * Pitch * E) & ~31, kb_hi = min(k_bytes, ((iy_hi + 1) * Pitch * E + 31) & ~31);
    // B: this lane's position in tile pair pr, as its table address at input row 0, block 0, half 0 (a tile past
    // the map's last row reads that row's blocks; its outputs are not stored)
    uint32_t b_lane[kNTiles / 2];
#pragma unroll
    for (int pr = 0; pr < kNTiles / 2; ++pr) {
      const int tile = nt0 + 2 * pr + lane / 16;
      const int oy = min(tile / G::kTilesPerRow, H - 1), ox = tile % G::kTilesPerRow * 8 + lane % 8;
      const int unit = ((H - 1 - oy) * G::kChunksUsed + 1 - ox / 16 - G::kChunkLo) * G::kHalves * 16 + ox % 16;
      b_lane[pr] = table_s + unit * 16;
    }
    const uint32_t a_item = a_lane + mg * kSampleTile * a.row_stride;
    Acc acc[2][kNTiles][4] = {};
    for (int kb = kb_lo; kb < kb_hi; kb += 32) {
      // this lane's 16 K bytes: input row iy, column block b, half h (f16)
      const int q = (kb + 16 * k_half) / E;
      const uint32_t off = (((q / Pitch) * G::kChunksUsed + q % Pitch / 16) * G::kHalves + q % 16 / 8) * 256;
      uint32_t A[2][4], B[kNTiles][2];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
        ldsm_x4(A[mt][0], A[mt][1], A[mt][2], A[mt][3], a_item + mt * 16 * a.row_stride + kb);
#pragma unroll
      for (int pr = 0; pr < kNTiles / 2; ++pr)
        ldsm_x4(B[2 * pr][0], B[2 * pr][1], B[2 * pr + 1][0], B[2 * pr + 1][1], b_lane[pr] + off);
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
          if constexpr (Fp8)
            mma16816<c10::Half>(acc[mt][nt], A[mt][0], A[mt][1], A[mt][2], A[mt][3], B[nt][0], B[nt][1]);
          else
            mma_s8(acc[mt][nt], A[mt], B[nt][0], B[nt][1]);
        }
    }
    // acc[mt][nt]: (sample g, positions 2t, 2t + 1), (sample g + 8, the same) of the 16 x 8 tile. 8-bit outputs:
    // every value quantized and stored without a branch, so that the values interleave (a position off the map
    // stores to a padding byte of its sample's row in `raw`, which phase 4 does not write), into `raw` at the plane's
    // place in its words. Float outputs straight to y.
    auto epilogue = [&](auto act) {
      constexpr int Act = decltype(act)::value;
      if constexpr (O == Out::k8) {
        uint8_t q[2][kNTiles][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
              q[mt][nt][e] = quantize8<Fp8>(out_value<Act>(float(acc[mt][nt][e]), alpha, beta), grid);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int s = mg * kSampleTile + mt * 16 + g + 8 * h;
            uint8_t* row = raw + s * raw_stride;
            uint8_t* plane = row + plane_shift(n0 + s, c, a.C, HW);
#pragma unroll
            for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const int tile = nt0 + nt;
                const int oy = tile / G::kTilesPerRow, ox = tile % G::kTilesPerRow * 8 + 2 * t + e;
                *(s < ns && oy < H && ox < W ? plane + oy * W + ox : row + raw_stride - 1) = q[mt][nt][2 * h + e];
              }
          }
      } else {
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int s = mg * kSampleTile + mt * 16 + g + e / 2 * 8, tile = nt0 + nt;
              const int oy = tile / G::kTilesPerRow, ox = tile % G::kTilesPerRow * 8 + 2 * t + e % 2;
              if (s < ns && oy < H && ox < W)
                store<Fp8, O, Act>(a.y, (int64_t(n0 + s) * a.C + c) * HW + oy * W + ox, float(acc[mt][nt][e]), alpha,
                                   beta, grid);
            }
      }
    };
    if (a.act == 1) epilogue(std::integral_constant<int, 1>{});
    else if (a.act == 2) epilogue(std::integral_constant<int, 2>{});
    else epilogue(std::integral_constant<int, 0>{});
  }
  if constexpr (O != Out::k8) return;

  // Phase 4 (8-bit outputs): each plane's words to y, a word at the plane's ends byte by byte (its other bytes
  // belong to the neighbouring planes).
  __syncthreads();
  for (int s = warp; s < ns; s += kThreads / 32) {
    const PlaneWords p = plane_words(n0 + s, c, a.C, HW);
    const uint32_t* src = reinterpret_cast<const uint32_t*>(raw + s * raw_stride);
    for (int w = lane; w < p.words; w += 32) {
      const int64_t word = p.base + 4 * w, start = p.start;
      const uint32_t v = src[w];
      if (word >= start && word + 4 <= start + HW) {
        *reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(a.y) + word) = v;
      } else {
        for (int e = 0; e < 4; ++e)
          if (word + e >= start && word + e < start + HW) static_cast<uint8_t*>(a.y)[word + e] = uint8_t(v >> (8 * e));
      }
    }
  }
}

template <bool Fp8, int Pitch, Out O>
void launch(const Args& args, dim3 grid, int smem, cudaStream_t stream) {
  auto kernel = dwconv8_small_kernel<Fp8, Pitch, O>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<grid, kThreads, smem, stream>>>(args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <bool Fp8, int Pitch>
void launch_out(const Args& args, dim3 grid, int smem, cudaStream_t stream, at::ScalarType out) {
  switch (out) {
    case at::kBFloat16: return launch<Fp8, Pitch, Out::kBf16>(args, grid, smem, stream);
    case at::kHalf: return launch<Fp8, Pitch, Out::kF16>(args, grid, smem, stream);
    case at::kFloat: return launch<Fp8, Pitch, Out::kF32>(args, grid, smem, stream);
    default: return launch<Fp8, Pitch, Out::k8>(args, grid, smem, stream);
  }
}

}  // namespace

bool launch_small(Args args, bool fp8, int smem_limit, at::ScalarType out, cudaStream_t stream) {
  if (args.W > 32) return false;
  const int pitch = args.W <= 16 ? 16 : 32, elem = fp8 ? 2 : 1;
  const int table_bytes = 2 * args.H * (pitch == 16 ? 1 : kChunks) * 256 * elem;
  args.row_stride = (args.H * pitch * elem + 31) / 32 * 32 + 16;  // whole K steps, an odd number of 16-byte units
  const int group_bytes = kSampleTile * (args.row_stride + raw_bytes(args.H * args.W));
  if (table_bytes + group_bytes > smem_limit) return false;
  const int fit = std::max(1, (kSmemTarget - table_bytes) / group_bytes);
  const int groups = (args.N + kSampleTile - 1) / kSampleTile;
  const int per_block = kSampleTile * std::min({fit, kMaxSamples / kSampleTile, groups});
  const int blocks = (args.N + per_block - 1) / per_block;
  args.samples = (args.N + blocks - 1) / blocks;  // the same number of blocks, evenly filled
  const int smem = table_bytes + (args.samples + kSampleTile - 1) / kSampleTile * group_bytes;
  TORCH_CHECK(blocks < 65536, "lkcnn dwconv8: too many sample groups");
  const dim3 grid(unsigned(args.C), unsigned(blocks));
  if (fp8) {
    if (pitch == 16) launch_out<true, 16>(args, grid, smem, stream, out);
    else launch_out<true, 32>(args, grid, smem, stream, out);
  } else {
    if (pitch == 16) launch_out<false, 16>(args, grid, smem, stream, out);
    else launch_out<false, 32>(args, grid, smem, stream, out);
  }
  return true;
}

}  // namespace dwconv8
}  // namespace lkcnn
