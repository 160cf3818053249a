// The forward and input gradient of one small depthwise branch (k x k taps, k = 3, 5 or 7, dilation 1: RepLKNet's
// 5x5) on a channels_last 16-bit input more than 8 rows tall, on the tensor cores. The SIMT kernels of
// dwconv_branches.cu issue two instructions that unpack 16-bit operands for every FMA; here the products run as
// mma.sync.m16n8k16 with fp32 accumulation, and a lane spends one byte permute per operand register.
//
// The product: for one channel, output rows h0 .. h0 + 15 of a sample (the mma's M) and output columns n0 .. n0 + 7
// (N), kernel row i contributes A[m][k] = x[h0 + m - p + i][n0 - p + k] (16 input columns, K) times the Toeplitz
// block B[k][n] = w[i][k - n] (zero outside the kernel). A channel is a batch dimension of a depthwise product, so
// every channel has its own mma; a warp owns 8 channels (one 16-byte word of a pixel), and since the fragments of
// its 8 mmas sit at the same (row, column) positions for every channel, each lane takes a pixel's 8 channels with
// one 16-byte shared-memory load and splits them into the 8 channels' operand registers with one byte permute per
// pair of pixels. The outputs leave the same way: a lane packs its 8 channels of a pixel into one 16-byte word.
//
// A block is 8 warps, 64 channels (one 128-byte line per pixel), 16 rows of a sample, and walks the row's 8-column
// output blocks. Output block b reads the input columns of 8-column chunks b and b + 1, so the block keeps a ring of
// three chunks in shared memory (cp.async, chunk b + 2 copied while block b is multiplied): each input pixel is
// copied once, where copying each output block's 16 columns copied it twice and made the kernel wait on L2. The
// results go out through shared memory too, one 128-byte line per pixel: a warp's own 16-byte stores would fill
// half of each 32-byte sector. Every layout is free of bank conflicts.
#include "band_mma.cuh"
#include "dwconv.h"
#include "tile.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

namespace lkcnn {
namespace {

constexpr int kWarps = 8;        // one 8-channel group each: 64 channels per block
constexpr int kTileRows = 16;    // output rows per block (the mma's M)
constexpr int kMaxK = 7;         // the branch op's undilated shapes; 8 + k - 1 input columns fit two 8-column chunks

// The 16-bit element e of the 16-byte word v (e = 0 .. 7) paired with that of u: (v[e], u[e]) as one mma operand
// register, v's element in the low half.
__device__ __forceinline__ uint32_t pair(const uint4& v, const uint4& u, int e) {
  const uint32_t a = e < 2 ? v.x : e < 4 ? v.y : e < 6 ? v.z : v.w;
  const uint32_t b = e < 2 ? u.x : e < 4 ? u.y : e < 6 ? u.z : u.w;
  return __byte_perm(a, b, (e & 1) ? 0x7632 : 0x5410);
}

// Shared-memory layouts in 16-byte units. A staged pixel is 9 units (its 8 channel groups and one of padding) and
// a chunk row 8 pixels and one unit, so unit (row, col, cg) = row * kRowUnits + col * 9 + cg falls in bank group
// (row + col + cg) mod 8: the 8 lanes of a quarter-warp (two adjacent rows, four column pairs, one channel group)
// read 8 different bank groups, and every address is linear in the row (a kernel row is a constant step). The tap
// table (unit (tap, cg) = tap * 9 + cg) and the output tile (16 rows of a chunk's shape) are laid out the same way.
constexpr int kPixelUnits = kWarps + 1;
constexpr int kChunkCols = 8;
constexpr int kRowUnits = kChunkCols * kPixelUnits + 1;
constexpr int kRing = 3;  // chunks b and b + 1 being multiplied, b + 2 being copied

// 16 bytes from global to shared memory, asynchronously; zeros where !valid (src is then not read).
__device__ __forceinline__ void copy16(uint4* dst, const void* src, bool valid) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int Pending> __device__ __forceinline__ void copy_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending));
}

template <typename T> __device__ __forceinline__ uint32_t pack_out(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack_out<c10::BFloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <> __device__ __forceinline__ uint32_t pack_out<c10::Half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

constexpr int chunk_units(int k) { return (kTileRows + k - 1) * kRowUnits; }
constexpr int tap_units(int k) { return k * k * kPixelUnits; }
constexpr int out_units() { return kTileRows * kRowUnits; }
constexpr int smem_bytes(int k) { return (tap_units(k) + kRing * chunk_units(k) + out_units()) * 16; }

// dst = src correlated with w (FLIP: with w flipped in both axes, the input gradient), 'same' padding. w: the
// (k * k, C) tap table in the tensors' dtype. Block: (channel block, row tile, sample), channel block fastest.
// Shared memory: the block's taps, the ring of input chunks, the output tile.
template <typename T, int K, bool FLIP>
__global__ void __launch_bounds__(kWarps * 32, 2) branch_tc_kernel(const T* __restrict__ src, const T* __restrict__ w,
                                                                T* __restrict__ dst, int H, int W, int C,
                                                                int channel_blocks, int row_tiles) {
  constexpr int P = K / 2, ROWS = kTileRows + K - 1;
  extern __shared__ uint4 smem[];
  uint4* taps = smem;
  uint4* ring = smem + tap_units(K);
  uint4* out_tile = ring + kRing * chunk_units(K);
  const int cb = blockIdx.x % channel_blocks, rt = blockIdx.x / channel_blocks % row_tiles;
  const int n = blockIdx.x / channel_blocks / row_tiles;
  const int h0 = rt * kTileRows, rows = min(kTileRows, H - h0);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int c = cb * 64 + warp * 8;
  const int64_t sample = int64_t(n) * H * W * C;

  // Copying and writing out: this thread moves channel group m_cg of column m_col, rows m_row0 + 4 * it, of every
  // chunk and of the output tile (eight threads a pixel's 128-byte line).
  const int m_cg = threadIdx.x % kWarps, m_col = threadIdx.x / kWarps % kChunkCols, m_row0 = threadIdx.x / 64;
  const int m_ci = cb * 64 + m_cg * 8;
  const int m_unit = m_row0 * kRowUnits + m_col * kPixelUnits + m_cg;
  const auto stage = [&](int chunk) {
    const int wi = chunk * kChunkCols - P + m_col;
    const bool col_ok = wi >= 0 && wi < W && m_ci < C;
    uint4* slot = ring + chunk % kRing * chunk_units(K) + m_unit;
#pragma unroll 1
    for (int it = 0; it < (ROWS + 3) / 4; ++it) {
      if (m_row0 + 4 * it < ROWS) {
        const int hi = h0 - P + m_row0 + 4 * it;
        const bool valid = col_ok && hi >= 0 && hi < H;
        copy16(slot + 4 * it * kRowUnits, valid ? src + sample + (int64_t(hi) * W + wi) * C + m_ci : src, valid);
      }
    }
  };
  for (int s = threadIdx.x; s < K * K * kWarps; s += kWarps * 32) {
    const int tap = s / kWarps, cg = s % kWarps, ci = cb * 64 + cg * 8;
    copy16(taps + tap * kPixelUnits + cg, ci < C ? w + int64_t(tap) * C + ci : w, ci < C);
  }
  const int blocks = (W + 7) / 8;  // output blocks; they read chunks 0 .. blocks
  stage(0);
  stage(1);
  copy_commit();

  // B: this lane's Toeplitz taps j = k - g for its k = 2t, 2t + 1, 2t + 8, 2t + 9 (B's rows) and column g, as units
  // of kernel row 0 (a kernel row is a step of K taps, down for the flipped kernel). A: the units of its pixels, rows
  // g and g + 8 and columns 2t, 2t + 1 of the block's two chunks, at kernel row 0 (kernel row i is i rows down).
  int b_unit[4];
  bool b_ok[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int j = 2 * t + (q & 1) + (q >> 1) * 8 - g;
    b_ok[q] = j >= 0 && j < K;
    b_unit[q] = (FLIP ? (K - 1) * K + (K - 1 - j) : j) * kPixelUnits + warp;
  }
  const int a_unit = g * kRowUnits + 2 * t * kPixelUnits + warp;

  for (int nb = 0; nb < blocks; ++nb) {
    const int n0 = nb * 8;
    if (nb + 2 <= blocks) {  // chunk nb + 2, which block nb + 1 reads, into the slot chunk nb - 1 held
      stage(nb + 2);
      copy_commit();
      copy_wait<1>();
    } else {
      copy_wait<0>();
    }
    __syncthreads();  // chunks nb and nb + 1 (and the taps) are in; the last block's output tile is written out
    if (c < C) {
      const uint4* a_lo = ring + nb % kRing * chunk_units(K) + a_unit;
      const uint4* a_hi = ring + (nb + 1) % kRing * chunk_units(K) + a_unit;
      float acc[8][4];
#pragma unroll
      for (int e = 0; e < 8; ++e)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[e][q] = 0.f;
#pragma unroll 1  // one kernel row's operands live at a time (unrolled, the loads of all rows spill)
      for (int i = 0; i < K; ++i) {
        const int b_step = (FLIP ? -i : i) * K * kPixelUnits;
        uint4 wv[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) wv[q] = b_ok[q] ? taps[b_unit[q] + b_step] : make_uint4(0, 0, 0, 0);
        uint4 px[8];
#pragma unroll
        for (int q = 0; q < 8; ++q)  // (row g or g + 8, column 2t or 2t + 1, of chunk nb or nb + 1)
          px[q] = ((q >> 2) ? a_hi : a_lo)[i * kRowUnits + ((q >> 1) & 1) * 8 * kRowUnits + (q & 1) * kPixelUnits];
#pragma unroll
        for (int e = 0; e < 8; ++e)
          mma16816<T>(acc[e], pair(px[0], px[1], e), pair(px[2], px[3], e), pair(px[4], px[5], e),
                      pair(px[6], px[7], e), pair(wv[0], wv[1], e), pair(wv[2], wv[3], e));
      }
      // acc[e] = (row g, columns 2t, 2t + 1), (row g + 8, the same columns) of channel c + e.
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        uint4 v;
        v.x = pack_out<T>(acc[0][q], acc[1][q]);
        v.y = pack_out<T>(acc[2][q], acc[3][q]);
        v.z = pack_out<T>(acc[4][q], acc[5][q]);
        v.w = pack_out<T>(acc[6][q], acc[7][q]);
        out_tile[(g + (q >> 1) * 8) * kRowUnits + (2 * t + (q & 1)) * kPixelUnits + warp] = v;
      }
    }
    __syncthreads();  // the output tile is complete, and every warp is done with chunk nb, whose slot is refilled next
    const int col = n0 + m_col;
    if (m_ci < C && col < W) {
      T* out = dst + sample + int64_t(h0) * W * C + int64_t(col) * C + m_ci;
#pragma unroll
      for (int it = 0; it < kTileRows / 4; ++it) {
        const int row = m_row0 + 4 * it;
        if (row < rows) *reinterpret_cast<uint4*>(out + int64_t(row) * W * C) = out_tile[m_unit + 4 * it * kRowUnits];
      }
    }
  }
}

template <typename T, int K, bool FLIP>
void launch_k(const at::Tensor& src, const at::Tensor& w, const at::Tensor& dst) {
  const int N = int(src.size(0)), C = int(src.size(1)), H = int(src.size(2)), W = int(src.size(3));
  const int channel_blocks = ceil_div(C, 64), row_tiles = ceil_div(H, kTileRows);
  const int64_t blocks = int64_t(channel_blocks) * row_tiles * N;
  TORCH_CHECK(blocks < INT32_MAX, "lkcnn dwconv2d_branches: the tensor is too large for one launch");
  if (blocks == 0 || W == 0) return;
  constexpr auto kernel = branch_tc_kernel<T, K, FLIP>;
  allow_dynamic_smem<kernel>(smem_bytes(K));
  kernel<<<unsigned(blocks), kWarps * 32, smem_bytes(K), at::cuda::getCurrentCUDAStream()>>>(
      src.const_data_ptr<T>(), w.const_data_ptr<T>(), dst.mutable_data_ptr<T>(), H, W, C, channel_blocks, row_tiles);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, bool FLIP>
void launch(const at::Tensor& src, const at::Tensor& w, const at::Tensor& dst, int k) {
  switch (k) {
    case 3: return launch_k<T, 3, FLIP>(src, w, dst);
    case 5: return launch_k<T, 5, FLIP>(src, w, dst);
    default: return launch_k<T, 7, FLIP>(src, w, dst);
  }
}

}  // namespace

bool branch_tc_fits(const at::Tensor& x, int64_t k, int64_t r) {
  const auto t = x.scalar_type();
  if ((t != at::kHalf && t != at::kBFloat16) || r != 1 || k % 2 == 0 || k < 3 || k > kMaxK) return false;
  // Maps of 8 rows or fewer fill at most half of a 16-row tile: the SIMT kernels are faster there.
  if (x.size(2) <= kTileRows / 2) return false;
  const auto* prop = at::cuda::getDeviceProperties(x.device().index());
  return prop->major >= 8 && size_t(smem_bytes(int(k))) <= prop->sharedMemPerBlockOptin;
}

void launch_branch_tc(const at::Tensor& src, const at::Tensor& w, const at::Tensor& dst, int64_t k, bool flip) {
  if (src.scalar_type() == at::kHalf) {
    flip ? launch<c10::Half, true>(src, w, dst, int(k)) : launch<c10::Half, false>(src, w, dst, int(k));
  } else {
    flip ? launch<c10::BFloat16, true>(src, w, dst, int(k)) : launch<c10::BFloat16, false>(src, w, dst, int(k));
  }
}

}  // namespace lkcnn
