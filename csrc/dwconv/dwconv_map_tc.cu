// fp16/bf16 maps up to 16 x 16 (RepLKNet's 14x14 stage with 27x27 kernels, the 7x7 stage with 13x13): all three
// passes as dense products of whole map rows on the tensor cores (mma.sync.m16n8k16, fp32 accumulation); maps up to
// 32 x 32 (the 28x28 stage, the seed's 32x32): the forward and input gradient.
//
// With the map's rows padded to 16 columns, one output row py of 16 samples is a sum over the input rows qy in the
// kernel's reach of X[16 samples][qy][16 columns] (A) times the 16 x 8 Toeplitz block of kernel row qy - py + ph
// (B[q][p] = w[i][q - p + pw], zero outside the kernel), one mma per 8 output columns. No band steps and no padded
// rows: on a 14x14 map with a 27x27 kernel 77% of the multiplied pairs are taps, where the banded kernels
// (band_mma.cuh) reach a third. Rows of 32 columns are two 16-column k-blocks and four 8-column n-blocks.
//
// A block stages a chunk of samples of one channel in shared memory (16-byte row accesses where the rows allow) and
// builds a table of each kernel row's B fragments per lane. Forward and input gradient (flipped kernel, as for the
// other forward kernels): up to 16 columns, a warp holds the A fragments of its 16 samples for every row in
// registers (16 x 4) and walks its output rows, its outputs leaving through shared memory; at 32 columns it takes A
// by ldmatrix per row pair and writes its outputs from the fragments.
// Weight gradient (up to 16 columns): for rows qy, py = qy - d, S = X[.][qy]^T (16 columns x 16 samples) times
// grad_out[.][py] (16 samples x 16 columns) holds in S[q][p] the products that tap (d + ph, q - p + pw) sums, so a
// warp accumulates S over the row pairs of each offset d in the mma accumulators, then adds its diagonals to its own
// taps in shared memory (summed over the warps at the end); x^T's fragments of every row stay in registers,
// grad_out's come by ldmatrix per row pair.
#include "band_mma.cuh"
#include "dwconv.h"
#include "tile.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

namespace lkcnn {
namespace {

constexpr int kWarps = 8;  // per block, every kernel
// Maps up to 16 wide: rows padded to 16 columns (the mma's K), 64 samples (four 16-sample mma tiles) per block.
// Maps 17 to 32 wide (forward only): rows of 32 columns, 32 samples per block.
constexpr int kCols = 16, kChunk = 64, kWideCols = 32, kWideChunk = 32;

// Elements between staged samples: H rows of MW columns (MW / 8 16-byte units each) and one unit more, so that the 8
// rows of an ldmatrix matrix (8 samples at one row and column block) fall in 8 different bank groups.
__host__ __device__ constexpr int sample_elems(int H, int MW) { return (H * MW / 8 + 1) * 8; }

// Rows [0, H) of samples n0 .. n0 + CH of one channel (src: the channel's sample 0, NCHW-contiguous rows) to
// dst as [sample][row][MW columns], zeros past the batch and the row, in accesses of V elements (the host's
// row_vector: rows and strides multiples of V, so every access is aligned on both sides). Warp w takes samples w,
// w + kWarps, ..., its lanes the row vectors: each lane keeps one load per sample (8) in flight before storing
// them (one at a time made v28b's staging a chain of DRAM round trips, 40% of its stalls), and positions come
// from shifts, not divisions.
template <int V, int MW, int CH, typename T>
__device__ __forceinline__ void stage_chunk(T* __restrict__ dst, const T* __restrict__ src, int64_t n0,
                                            const ConvGeom& g, int64_t s_n, int64_t s_h) {
  constexpr int G = MW / V, kPer = CH / kWarps;  // V-element groups of a staged row; samples per warp
  static_assert(CH % kWarps == 0, "every warp stages the same number of samples");
  const int warp = threadIdx.x / 32, ss = sample_elems(g.H, MW);
  for (int u = threadIdx.x % 32; u < g.H * G; u += 32) {
    const int r = u / G, j = u % G * V;
    T v[kPer][V] __attribute__((aligned(16)));
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int64_t n = n0 + warp + k * kWarps;
      if (n < g.N && j < g.W) {
        copy_vec<V>(v[k], src + n * s_n + r * s_h + j);
      } else {
#pragma unroll
        for (int e = 0; e < V; ++e) v[k][e] = T(0.f);
      }
    }
#pragma unroll
    for (int k = 0; k < kPer; ++k) copy_vec<V>(dst + (warp + k * kWarps) * ss + r * MW + j, v[k]);
  }
}

// The inverse for the narrow forward's outputs: the staged rows' first W columns to the samples that exist.
template <int V, typename T>
__device__ __forceinline__ void store_chunk(T* __restrict__ dst, const T* __restrict__ src, int64_t n0,
                                            const ConvGeom& g) {
  constexpr int G = kCols / V, kPer = kChunk / kWarps;
  const int warp = threadIdx.x / 32, ss = sample_elems(g.H, kCols);
  for (int u = threadIdx.x % 32; u < g.H * G; u += 32) {
    const int r = u / G, j = u % G * V;
    if (j >= g.W) continue;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int64_t n = n0 + warp + k * kWarps;
      if (n < g.N) copy_vec<V>(dst + n * g.ys_n + r * g.ys_h + j, src + (warp + k * kWarps) * ss + r * kCols + j);
    }
  }
}

// The channel's kernel (n taps in T) to shared memory as fp32, reversed where flip (a kernel flipped in both axes is
// its row-major taps in reverse order); eight loads in flight per thread.
template <typename T>
__device__ __forceinline__ void stage_kernel(float* __restrict__ dst, const T* __restrict__ src, int n, bool flip) {
  constexpr int kBatch = 8;
  for (int base = threadIdx.x; base < n; base += kBatch * blockDim.x) {
    float v[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int u = base + k * blockDim.x;
      v[k] = u < n ? static_cast<float>(src[flip ? n - 1 - u : u]) : 0.f;
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k)
      if (base + k * blockDim.x < n) dst[base + k * blockDim.x] = v[k];
  }
}

// B fragments of a kernel row depend only on the offset 16 kb - 8 nb between the k-block (16 input columns) and the
// n-block (8 output columns) they join: with KB k-blocks and NB n-blocks, offsets 8 s - 8 (NB - 1) for the slots
// s < kSlots. toe[(i * kSlots + s) * 32 + lane] holds the lane's (b0, b1) for kernel row i and slot s: b0 B[k][p]
// for k = 2t, 2t + 1 and p = g, i.e. taps j, j + 1 of the row (j = 2t - g + offset + pw), b1 those 8 on.
template <int KB, int NB>
struct Slots {
  static constexpr int kSlots = 2 * KB + NB - 2;
  __device__ static constexpr int of(int kb, int nb) { return 2 * kb - nb + NB - 1; }
};

template <typename T, int KB, int NB>
__device__ __forceinline__ void build_table(uint2* __restrict__ toe, const float* __restrict__ sw, const ConvGeom& g) {
  constexpr int S = Slots<KB, NB>::kSlots;
  for (int u = threadIdx.x; u < g.kh * S * 32; u += blockDim.x) {
    const int i = u / (S * 32), slot = u / 32 % S, l = u % 32;
    const int j = 2 * (l % 4) - l / 4 + 8 * slot - 8 * (NB - 1) + g.pw;
    auto tap = [&](int jj) { return jj >= 0 && jj < g.kw ? T(sw[i * g.kw + jj]) : T(0.f); };
    toe[u] = make_uint2(pack2(tap(j), tap(j + 1)), pack2(tap(j + 8), tap(j + 9)));
  }
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
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
// A block takes kChunk samples of one channel; warp w takes tile w % tiles and the output rows w / tiles,
// w / tiles + groups, ... (groups = kWarps / tiles of the chunk, so each warp has one item).
template <typename T, int HM, int NB>
__global__ void __launch_bounds__(32 * kWarps) dwconv_fwd_map_tc_kernel(
    const T* __restrict__ x, const T* __restrict__ w, const float* __restrict__ bias, T* __restrict__ y,
    const ConvGeom g, int V, bool flip) {
  extern __shared__ __align__(16) uint8_t smem[];
  using Slot = Slots<1, NB>;
  const int H = g.H, ss = sample_elems(H, kCols);
  T* sx = reinterpret_cast<T*>(smem);                                    // the chunk's samples, later its outputs
  uint2* toe = reinterpret_cast<uint2*>(sx + kChunk * ss);                // B fragments (build_table)
  float* sw = reinterpret_cast<float*>(toe + g.kh * Slot::kSlots * 32);  // the channel's kernel
  const int64_t chunks = (g.N + kChunk - 1) / kChunk, c = blockIdx.x / chunks, n0 = blockIdx.x % chunks * kChunk;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, gq = lane / 4, tq = lane % 4;

  with_vector(V, [&](auto v) {
    stage_chunk<decltype(v)::value, kCols, kChunk>(sx, x + c * g.xs_c, n0, g, g.xs_n, g.xs_h);
  });
  stage_kernel(sw, w + c * g.kh * g.kw, g.kh * g.kw, flip);
  __syncthreads();
  build_table<T, 1, NB>(toe, sw, g);
  const int tiles = int(min(int64_t(4), (g.N - n0 + 15) / 16)), groups = kWarps / tiles;
  const bool busy = warp < tiles * groups;
  const int tile = warp % tiles, rg = warp / tiles;
  // a[r]: the A fragment of input row r: samples g, g + 8 of the tile (matrices 0, 1), columns 2t.. and 2t + 8..
  uint32_t a[HM][4];
  const uint32_t a_addr =
      smem_addr(sx + (16 * tile + (lane & 8) + (lane & 7)) * ss + (lane & 16 ? 8 : 0));
#pragma unroll
  for (int r = 0; r < HM; ++r)
    if (busy && r < H) ldsm_x4(a[r][0], a[r][1], a[r][2], a[r][3], a_addr + r * kCols * sizeof(T));
  __syncthreads();  // the table is built and every warp holds its A: the samples' space takes the outputs

  const float bv = bias != nullptr ? bias[c] : 0.f;
  T* so = sx + (16 * tile + gq) * ss + 2 * tq;  // this lane's outputs: sample g (and g + 8), columns 2t, 2t + 1
  for (int py = rg; busy && py < H; py += groups) {
    float acc[NB][4] = {};
#pragma unroll
    for (int qy = 0; qy < HM; ++qy) {
      const int i = qy - py + g.ph;  // the kernel row that meets input row qy here (the same for the whole warp)
      if (qy >= H || i < 0 || i >= g.kh) continue;
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        const uint2 b = toe[(i * Slot::kSlots + Slot::of(0, nb)) * 32 + lane];
        mma16816<T>(acc[nb], a[qy][0], a[qy][1], a[qy][2], a[qy][3], b.x, b.y);
      }
    }
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {  // acc[nb]: (sample g, columns 8 nb + 2t, + 1), then the same of g + 8
      T* o = so + py * kCols + 8 * nb;
      *reinterpret_cast<uint32_t*>(o) = pack2(T(acc[nb][0] + bv), T(acc[nb][1] + bv));
      *reinterpret_cast<uint32_t*>(o + 8 * ss) = pack2(T(acc[nb][2] + bv), T(acc[nb][3] + bv));
    }
  }
  __syncthreads();
  with_vector(V, [&](auto v) { store_chunk<decltype(v)::value>(y + c * g.ys_c, sx, n0, g); });
}

// Forward of maps 17 to 32 wide (up to 32 rows): a row is two k-blocks of 16 input columns and four n-blocks of 8
// output columns, eight mma per (output row, input row) pair. Its A fragments for all rows would not fit in
// registers, so a warp takes them by ldmatrix per pair from the staged chunk (32 samples: two tiles, warps take a
// tile and every 4th output row) and writes its outputs from the fragments.
template <typename T>
__global__ void __launch_bounds__(32 * kWarps) dwconv_fwd_map_tc_wide_kernel(
    const T* __restrict__ x, const T* __restrict__ w, const float* __restrict__ bias, T* __restrict__ y,
    const ConvGeom g, int V, bool flip) {
  constexpr int KB = kWideCols / 16, NB = kWideCols / 8;
  using Slot = Slots<KB, NB>;
  extern __shared__ __align__(16) uint8_t smem[];
  const int H = g.H, ss = sample_elems(H, kWideCols);
  T* sx = reinterpret_cast<T*>(smem);
  uint2* toe = reinterpret_cast<uint2*>(sx + kWideChunk * ss);
  float* sw = reinterpret_cast<float*>(toe + g.kh * Slot::kSlots * 32);
  const int64_t chunks = (g.N + kWideChunk - 1) / kWideChunk, c = blockIdx.x / chunks;
  const int64_t n0 = blockIdx.x % chunks * kWideChunk;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, gq = lane / 4, tq = lane % 4;

  with_vector(V, [&](auto v) {
    stage_chunk<decltype(v)::value, kWideCols, kWideChunk>(sx, x + c * g.xs_c, n0, g, g.xs_n, g.xs_h);
  });
  stage_kernel(sw, w + c * g.kh * g.kw, g.kh * g.kw, flip);
  __syncthreads();
  build_table<T, KB, NB>(toe, sw, g);
  __syncthreads();

  const int tiles = int(min(int64_t(kWideChunk / 16), (g.N - n0 + 15) / 16)), groups = kWarps / tiles;
  const int tile = warp % tiles;
  const uint32_t a_addr = smem_addr(sx + (16 * tile + (lane & 8) + (lane & 7)) * ss + (lane & 16 ? 8 : 0));
  const float bv = bias != nullptr ? bias[c] : 0.f;
  const bool vec = V >= 2;  // (col, col + 1) pairs aligned: one 4-byte store
  for (int py = warp / tiles; py < H; py += groups) {
    float acc[NB][4] = {};
    const int q_end = min(H, py + g.ph + 1);
#pragma unroll 2
    for (int qy = max(0, py - g.ph); qy < q_end; ++qy) {  // two rows' loads in flight together
      const int i = qy - py + g.ph;
      uint32_t a[KB][4];
#pragma unroll
      for (int kb = 0; kb < KB; ++kb)
        ldsm_x4(a[kb][0], a[kb][1], a[kb][2], a[kb][3], a_addr + (qy * kWideCols + 16 * kb) * sizeof(T));
      uint2 b[Slot::kSlots];
#pragma unroll
      for (int sl = 0; sl < Slot::kSlots; ++sl) b[sl] = toe[(i * Slot::kSlots + sl) * 32 + lane];
#pragma unroll
      for (int kb = 0; kb < KB; ++kb)
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
          mma16816<T>(acc[nb], a[kb][0], a[kb][1], a[kb][2], a[kb][3], b[Slot::of(kb, nb)].x,
                      b[Slot::of(kb, nb)].y);
    }
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)  // acc[nb]: (sample g, columns 8 nb + 2t, + 1), then the same of g + 8
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t n = n0 + 16 * tile + gq + 8 * h;
        const int col = 8 * nb + 2 * tq;
        if (n >= g.N || col >= g.W) continue;
        T* out = y + n * g.ys_n + c * g.ys_c + py * g.ys_h + col;
        const T v0 = T(acc[nb][2 * h] + bv), v1 = T(acc[nb][2 * h + 1] + bv);
        if (vec) {
          *reinterpret_cast<uint32_t*>(out) = pack2(v0, v1);
        } else {
          out[0] = v0;
          if (col + 1 < g.W) out[1] = v1;
        }
      }
  }
}

// g: grad_out read through xs_*, x through ys_* (make_geom(grad_out, x, ...)). A block takes kChunk samples of one
// channel; warp w < 2 tiles takes tile w % tiles and half w / tiles of the row offsets (d < 0, d >= 0), holding the
// tile's A (x^T) for every row in registers (chunks of fewer than 4 tiles leave warps idle).
template <typename T, int HM, int NB>
__global__ void __launch_bounds__(32 * kWarps) dwconv_wgrad_map_tc_kernel(
    const T* __restrict__ dy, const T* __restrict__ x, float* __restrict__ dw_sum, T* __restrict__ dw_out,
    const ConvGeom g, int V) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int H = g.H, ss = sample_elems(H, kCols);
  T* sx = reinterpret_cast<T*>(smem);
  T* sd = sx + kChunk * ss;
  float* taps = reinterpret_cast<float*>(sd + kChunk * ss);  // [warp][kernel row][q - p + 16]
  const int64_t chunks = (g.N + kChunk - 1) / kChunk, c = blockIdx.x / chunks, n0 = blockIdx.x % chunks * kChunk;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, gq = lane / 4, tq = lane % 4;

  with_vector(V, [&](auto v) {
    stage_chunk<decltype(v)::value, kCols, kChunk>(sx, x + c * g.ys_c, n0, g, g.ys_n, g.ys_h);
    stage_chunk<decltype(v)::value, kCols, kChunk>(sd, dy + c * g.xs_c, n0, g, g.xs_n, g.xs_h);
  });
  for (int u = tid; u < kWarps * g.kh * 32; u += blockDim.x) taps[u] = 0.f;
  __syncthreads();

  const int tiles = int(min(int64_t(4), (g.N - n0 + 15) / 16)), tile = warp % tiles, half = warp / tiles;
  if (half < 2) {
    // xa[r]: A = x[.][r]^T: rows q = g, g + 8 (matrices 0 / 2 and 1 / 3: column halves), samples 2t.. and 2t + 8..
    uint32_t xa[HM][4];
    const uint32_t x_addr = smem_addr(sx + (16 * tile + (lane & 16 ? 8 : 0) + (lane & 7)) * ss + (lane & 8));
#pragma unroll
    for (int r = 0; r < HM; ++r)
      if (r < H) ldsm_x4<true>(xa[r][0], xa[r][1], xa[r][2], xa[r][3], x_addr + r * kCols * sizeof(T));
    // B = grad_out[.][py]: samples 2t.. and 2t + 8.. (matrices 0, 1), column 8 nb + g (matrices 2, 3 for nb = 1)
    const uint32_t d_addr = smem_addr(sd + (16 * tile + (lane & 8) + (lane & 7)) * ss + (lane & 16 ? 8 : 0));
    float* mine = taps + warp * g.kh * 32;
#pragma unroll
    for (int d = 1 - HM; d < HM; ++d) {
      const int i = d + g.ph;  // kernel row
      if (i < 0 || i >= g.kh || d <= -H || d >= H || (half == 0) != (d < 0)) continue;
      float acc[NB][4] = {};
#pragma unroll
      for (int qy = d > 0 ? d : 0; qy < (d < 0 ? HM + d : HM); ++qy) {
        if (qy >= H || qy - d >= H) continue;
        uint32_t b[NB][2];
        if constexpr (NB == 2) ldsm_x4<true>(b[0][0], b[0][1], b[1][0], b[1][1], d_addr + (qy - d) * kCols * sizeof(T));
        else ldsm_x2<true>(b[0][0], b[0][1], d_addr + (qy - d) * kCols * sizeof(T));
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
          mma16816<T>(acc[nb], xa[qy][0], xa[qy][1], xa[qy][2], xa[qy][3], b[nb][0], b[nb][1]);
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
  // Taps over 15 columns off reach no column pair of a 16-wide row (zero). Where the block is its channel's only one
  // (dw_out), it writes every tap; else it adds its sums to dw_sum, one atomic per tap.
  for (int u = tid; u < g.kh * g.kw; u += blockDim.x) {
    const int off = u % g.kw - g.pw;
    float sum = 0.f;
    if (off >= -15 && off <= 15)
#pragma unroll
      for (int k = 0; k < kWarps; ++k) sum += taps[(k * g.kh + u / g.kw) * 32 + 16 + off];
    if (dw_out != nullptr) dw_out[c * g.kh * g.kw + u] = T(sum);
    else if (off >= -15 && off <= 15) atomicAdd(dw_sum + c * g.kh * g.kw + u, sum);
  }
}

// f.template run<HM, NB>() for the map's rows and columns.
template <typename F>
void dispatch_rows_cols(const ConvGeom& g, const F& f) {
  if (g.H <= 8) return g.W <= 8 ? f.template run<8, 1>() : f.template run<8, 2>();
  return g.W <= 8 ? f.template run<16, 1>() : f.template run<16, 2>();
}

// Blocks: one per chunk of `chunk` samples of one channel.
unsigned blocks(const ConvGeom& g, int chunk = kChunk) {
  const int64_t n = (g.N + chunk - 1) / chunk * g.C;
  TORCH_CHECK(n < INT32_MAX, "lkcnn dwconv2d: too many (sample, channel) planes for one launch");
  return unsigned(n);
}

template <typename T>
struct FwdCall {
  const at::Tensor &x, &w, &bias;
  at::Tensor& y;
  bool flip;
  const ConvGeom& g;
  template <int HM, int NB>
  void run() const {
    constexpr auto kernel = dwconv_fwd_map_tc_kernel<T, HM, NB>;
    const int smem = int(kChunk * sample_elems(g.H, kCols) * sizeof(T) +
                         g.kh * Slots<1, NB>::kSlots * 32 * sizeof(uint2) + g.kh * g.kw * sizeof(float));
    allow_dynamic_smem<kernel>(smem);
    kernel<<<blocks(g), 32 * kWarps, smem, at::cuda::getCurrentCUDAStream()>>>(
        x.const_data_ptr<T>(), w.const_data_ptr<T>(), bias.defined() ? bias.const_data_ptr<float>() : nullptr,
        y.mutable_data_ptr<T>(), g, std::min(row_vector(x), row_vector(y)), flip);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

// The dynamic shared memory of the weight gradient's and the wide forward's launches (16-bit elements): up to 179 KB.
int wgrad_smem(int H, int kh) { return int(2 * kChunk * sample_elems(H, kCols) * 2 + kWarps * kh * 32 * sizeof(float)); }
int wide_fwd_smem(int H, int kh, int kw) {
  return int(kWideChunk * sample_elems(H, kWideCols) * 2 +
             kh * Slots<kWideCols / 16, kWideCols / 8>::kSlots * 32 * sizeof(uint2) + kh * kw * sizeof(float));
}

template <typename T>
struct WgradCall {
  const at::Tensor &dy, &x;
  at::Tensor& dw;
  const ConvGeom& g;
  template <int HM, int NB>
  void run() const {
    constexpr auto kernel = dwconv_wgrad_map_tc_kernel<T, HM, NB>;
    static_assert(sizeof(T) == 2, "wgrad_smem counts 16-bit elements");
    const int smem = wgrad_smem(g.H, g.kh);
    allow_dynamic_smem<kernel>(smem);
    const bool sums = dw.scalar_type() == at::kFloat;  // else the gradient itself, in T
    kernel<<<blocks(g), 32 * kWarps, smem, at::cuda::getCurrentCUDAStream()>>>(
        dy.const_data_ptr<T>(), x.const_data_ptr<T>(), sums ? dw.mutable_data_ptr<float>() : nullptr,
        sums ? nullptr : dw.mutable_data_ptr<T>(), g, std::min(row_vector(dy), row_vector(x)));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

template <typename T>
void run_fwd_wide(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, at::Tensor& y, const ConvGeom& g,
                  bool flip) {
  constexpr auto kernel = dwconv_fwd_map_tc_wide_kernel<T>;
  static_assert(sizeof(T) == 2, "wide_fwd_smem counts 16-bit elements");
  const int smem = wide_fwd_smem(g.H, g.kh, g.kw);  // at most 179 KB (32 rows, 63 x 63)
  allow_dynamic_smem<kernel>(smem);
  kernel<<<blocks(g, kWideChunk), 32 * kWarps, smem, at::cuda::getCurrentCUDAStream()>>>(
      x.const_data_ptr<T>(), w.const_data_ptr<T>(), bias.defined() ? bias.const_data_ptr<float>() : nullptr,
      y.mutable_data_ptr<T>(), g, std::min(row_vector(x), row_vector(y)), flip);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <template <typename> class Call, typename... Args>
void dispatch(const at::Tensor& t, const ConvGeom& g, Args&... args) {
  check_tensor_cores();
  if (t.scalar_type() == at::kHalf) return dispatch_rows_cols(g, Call<c10::Half>{args..., g});
  return dispatch_rows_cols(g, Call<c10::BFloat16>{args..., g});
}

}  // namespace

bool map_tc_fits(const at::Tensor& t) {
  return t.scalar_type() != at::kFloat && t.size(2) <= 16 && t.size(3) <= kCols;
}

bool map_tc_wgrad_fits(const at::Tensor& t, int64_t kh) {
  return map_tc_fits(t) && wgrad_smem(int(t.size(2)), int(kh)) <= smem_limit(t.get_device());
}

bool map_tc_wide_fits(const at::Tensor& t, int64_t kh, int64_t kw) {
  return t.scalar_type() != at::kFloat && t.size(2) <= 32 && t.size(3) <= kWideCols &&
         wide_fwd_smem(int(t.size(2)), int(kh), int(kw)) <= smem_limit(t.get_device());
}

bool map_tc_single_block(const at::Tensor& t) { return t.size(0) <= kChunk; }

void launch_dwconv_fwd_map_tc(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, at::Tensor& y,
                              int64_t ph, int64_t pw, bool flip) {
  const c10::cuda::CUDAGuard guard(x.device());
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.is_contiguous(), "launch_dwconv_fwd_map_tc: w in x's dtype");
  const ConvGeom g = make_geom(x, y, w.size(-2), w.size(-1), ph, pw);
  if (g.N * g.C * g.H * g.W == 0) return;
  if (map_tc_fits(x)) return dispatch<FwdCall>(x, g, x, w, bias, y, flip);
  TORCH_CHECK(map_tc_wide_fits(x, g.kh, g.kw), "launch_dwconv_fwd_map_tc: maps up to 32 x 32 whose staging fits");
  check_tensor_cores();
  if (x.scalar_type() == at::kHalf) return run_fwd_wide<c10::Half>(x, w, bias, y, g, flip);
  run_fwd_wide<c10::BFloat16>(x, w, bias, y, g, flip);
}

void launch_dwconv_wgrad_map_tc(const at::Tensor& grad_out, const at::Tensor& x, at::Tensor& dw, int64_t ph,
                                int64_t pw) {
  const c10::cuda::CUDAGuard guard(x.device());
  const ConvGeom g = make_geom(grad_out, x, dw.size(-2), dw.size(-1), ph, pw);
  if (g.N * g.C * g.H * g.W == 0) return;
  dispatch<WgradCall>(x, g, grad_out, x, dw);
}

}  // namespace lkcnn
