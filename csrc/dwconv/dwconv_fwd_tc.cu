// Forward (and, with a flipped kernel, input-gradient) kernel for fp16/bf16 on tensor cores (band_mma.cuh).
//
// One block computes an output tile of 16*MT rows x 8*NB columns of one channel for a range of samples, PB planes
// per round. The input strip of each plane is staged in shared memory in the storage type (the padding zeroed once
// per block, the in-map box copied by row vectors), the channel's kernel as Toeplitz pairs. Warp (plane z, row tile
// mt) owns 16 output rows x 8*NB columns in fp32 accumulators and, for every kernel row i whose input rows meet the
// map, runs band_mma (S band steps of 16 columns, 16S >= kw + 7) over the steps whose columns meet the map: kernel
// rows and band steps entirely in the padding are skipped per warp.
//
// A non-finite input inside an output's band (at most 16S - K + 7 columns beyond its receptive field) reaches that
// output through 0 * inf; finite inputs give the exact correlation with fp32 accumulation.
#include "band_mma.cuh"
#include "dwconv.h"
#include "tile.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

namespace lkcnn {
namespace {

constexpr int kMaxSmem = 96 * 1024;
constexpr int kRounds = 4;  // groups of PB planes per block: amortises the zeroed padding and the staged kernel

struct FwdTcTile {
  int MT, PB;        // 16-row tiles per block, planes per round (warps = MT * PB)
  int TW, TH, tiles_w, tiles_h;
  int IR, XLD;       // staged input rows, row stride (elements)
  int QL;            // Toeplitz pairs per kernel row
  int V;             // elements per staging access at most (row_vector; set by the launcher)
  int64_t n_per_block;
};

template <typename T, int NB, int S>
__global__ void __launch_bounds__(256, 3) dwconv_fwd_tc_kernel(const T* __restrict__ x, const float* __restrict__ w,
                                                            const float* __restrict__ bias, T* __restrict__ y,
                                                            const ConvGeom g, const FwdTcTile t) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int plane_elems = t.IR * t.XLD;
  T* sx = reinterpret_cast<T*>(smem);
  uint32_t* sq = reinterpret_cast<uint32_t*>(sx + t.PB * plane_elems);

  const unsigned tiles = unsigned(t.tiles_w) * unsigned(t.tiles_h);
  const unsigned tile = blockIdx.x % tiles;
  const int64_t c = blockIdx.x / tiles % g.C;
  const int64_t n_begin = blockIdx.x / tiles / g.C * t.n_per_block;
  const int64_t n_end = min(g.N, n_begin + t.n_per_block);
  const int q0 = int(tile % unsigned(t.tiles_w)) * t.TW, p0 = int(tile / unsigned(t.tiles_w)) * t.TH;
  const int tid = threadIdx.x, nthr = blockDim.x;

  // The padding of the tile is the same for every plane: zero it once, then copy only the in-map box per round.
  // Staged row r, column j hold input row p0 - ph + r, column q0 - pw + j.
  zero_smem(sx, t.PB * plane_elems * int(sizeof(T)), tid, nthr);
  for (int i = tid; i < g.kh * t.QL; i += nthr) {
    const int r = i / t.QL, j = i % t.QL - 8;  // word j + 8 holds (k[j], k[j + 1])
    const float* wr = w + (c * g.kh + r) * g.kw;
    sq[i] = pack2(T(j >= 0 && j < g.kw ? wr[j] : 0.f), T(j + 1 >= 0 && j + 1 < g.kw ? wr[j + 1] : 0.f));
  }
  const int r_a = max(0, g.ph - p0), r_b = min(t.IR, int(g.H) + g.ph - p0);
  const int j_a = max(0, g.pw - q0), j_b = min(band_cols(NB, S), int(g.W) + g.pw - q0);
  const int col0 = q0 - g.pw + j_a;  // the box's first input column
  const T* xc = x + c * g.xs_c + int64_t(p0 - g.ph + r_a) * g.xs_h + col0;
  T* sbox = sx + r_a * t.XLD + j_a;

  const int warp = tid / 32, lane = tid % 32;
  const int z = warp / t.MT, mt = warp % t.MT;
  const int pm = p0 + 16 * mt;  // this warp's first output row
  // Kernel rows whose 16 input rows meet the map; band steps whose columns (over all NB blocks) meet it.
  const int i_lo = max(0, g.ph - pm - 15), i_hi = min(g.kh, int(g.H) + g.ph - pm);
  const int cb = q0 - g.pw;  // input column of band column 0
  int s_lo = 0, s_hi = S;
  while (s_lo < s_hi && cb + 16 * s_lo + 8 * NB + 8 <= 0) ++s_lo;
  while (s_hi > s_lo && cb + 16 * (s_hi - 1) >= g.W) --s_hi;
  const uint32_t a = static_cast<uint32_t>(
      __cvta_generic_to_shared(sx + z * plane_elems + (16 * mt + (lane & 15)) * t.XLD + 8 * (lane >> 4)));
  const uint32_t* q = sq + 8 + 2 * (lane % 4) - lane / 4;
  const uint32_t row_bytes = uint32_t(t.XLD) * sizeof(T);
  const float bv = bias != nullptr ? bias[c] : 0.f;

  for (int64_t n0 = n_begin; n0 < n_end; n0 += t.PB) {
    const int planes = int(min(int64_t(t.PB), n_end - n0));
    __syncthreads();  // the zeroing is done / the previous round's planes are consumed
    with_vector(t.V, [&](auto v) {  // accesses from the aligned column at or before col0
      copy_rows<decltype(v)::value, T>(
          planes, r_b - r_a, j_b - j_a, col0 % decltype(v)::value, tid, nthr,
          [&](int zz, int r) { return xc + (n0 + zz) * g.xs_n + r * g.xs_h; },
          [&](int zz, int r) { return sbox + zz * plane_elems + r * t.XLD; });
    });
    __syncthreads();
    if (z >= planes || pm >= g.H) continue;

    float acc[NB][4];
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[b][e] = 0.f;
    for (int i = i_lo; i < i_hi; ++i) band_mma<T, NB, S>(acc, a + i * row_bytes, q + i * t.QL, s_lo, s_hi);

    // Accumulator e of block b: row lane / 4 + 8 * (e / 2), column 8b + 2 * (lane % 4) + e % 2.
    T* yp = y + (n0 + z) * g.ys_n + c * g.ys_c;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int p = pm + lane / 4 + 8 * (e / 2);
      if (p >= g.H) continue;
#pragma unroll
      for (int b = 0; b < NB; ++b) {
        const int col = q0 + 8 * b + 2 * (lane % 4) + e % 2;
        if (col < g.W) yp[p * g.ys_h + col * g.ys_w] = static_cast<T>(acc[b][e] + bv);
      }
    }
  }
}

// 8-column blocks per warp: four where the map is wide enough to fill them.
int pick_nb(int W) { return W > 16 ? 4 : W > 8 ? 2 : 1; }

FwdTcTile plan_fwd_tc(const ConvGeom& g, int NB, int S, int num_sms) {
  FwdTcTile t;
  t.TW = 8 * NB;
  t.tiles_w = ceil_div(g.W, t.TW);
  t.MT = std::min(ceil_div(g.H, 16), 4);
  t.TH = 16 * t.MT;
  t.tiles_h = ceil_div(g.H, t.TH);
  t.IR = t.TH + g.kh - 1;
  t.XLD = tc_ld(band_cols(NB, S));
  t.QL = 16 * S + 8;
  const int plane_bytes = t.IR * t.XLD * 2, kernel_bytes = g.kh * t.QL * 4;
  TORCH_CHECK(plane_bytes + kernel_bytes <= kMaxSmem, "lkcnn dwconv2d: the tensor-core tile does not fit in shared "
              "memory; this kernel size is not supported by the CUDA kernel");
  t.PB = int(std::min<int64_t>({std::max(1, 8 / t.MT), g.N, (kMaxSmem - kernel_bytes) / plane_bytes}));
  // Up to kRounds rounds per block, fewer where that would leave fewer than ~8 blocks per SM.
  const int64_t tiles_c = int64_t(t.tiles_w) * t.tiles_h * g.C;
  const int64_t groups = (g.N + t.PB - 1) / t.PB;
  int64_t rounds = std::min<int64_t>(kRounds, groups);
  while (rounds > 1 && tiles_c * ((groups + rounds - 1) / rounds) < 8 * int64_t(num_sms)) --rounds;
  t.n_per_block = rounds * t.PB;
  return t;
}

template <typename T, int NB, int S>
void run_fwd_tc(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, at::Tensor& y, const ConvGeom& g) {
  const int num_sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  FwdTcTile t = plan_fwd_tc(g, NB, S, num_sms);
  t.V = row_vector(x);
  const int64_t blocks = (g.N + t.n_per_block - 1) / t.n_per_block * g.C * t.tiles_w * t.tiles_h;
  TORCH_CHECK(blocks < INT32_MAX, "lkcnn dwconv2d: too many (n, c) planes for one launch");
  const int smem = t.PB * t.IR * t.XLD * 2 + g.kh * t.QL * 4;
  constexpr auto kernel = dwconv_fwd_tc_kernel<T, NB, S>;
  allow_dynamic_smem<kernel>(smem);
  kernel<<<unsigned(blocks), 32 * t.MT * t.PB, smem, at::cuda::getCurrentCUDAStream()>>>(
      x.const_data_ptr<T>(), w.const_data_ptr<float>(), bias.defined() ? bias.const_data_ptr<float>() : nullptr,
      y.mutable_data_ptr<T>(), g, t);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int NB>
void dispatch_s(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, at::Tensor& y, const ConvGeom& g) {
  switch (ceil_div(g.kw + 7, 16)) {  // 16S >= kw + 7: kernels up to 9, 25, 41, 57, 63 wide
    case 1: return run_fwd_tc<T, NB, 1>(x, w, bias, y, g);
    case 2: return run_fwd_tc<T, NB, 2>(x, w, bias, y, g);
    case 3: return run_fwd_tc<T, NB, 3>(x, w, bias, y, g);
    case 4: return run_fwd_tc<T, NB, 4>(x, w, bias, y, g);
    default: return run_fwd_tc<T, NB, 5>(x, w, bias, y, g);
  }
}

template <typename T>
void dispatch_nb(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, at::Tensor& y, const ConvGeom& g) {
  switch (pick_nb(g.W)) {
    case 4: return dispatch_s<T, 4>(x, w, bias, y, g);
    case 2: return dispatch_s<T, 2>(x, w, bias, y, g);
    default: return dispatch_s<T, 1>(x, w, bias, y, g);
  }
}

}  // namespace

void launch_dwconv_fwd_tc(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, at::Tensor& y,
                          int64_t ph, int64_t pw) {
  const c10::cuda::CUDAGuard guard(x.device());
  const ConvGeom g = make_geom(x, y, w.size(1), w.size(2), ph, pw);
  if (g.N * g.C == 0 || g.H == 0 || g.W == 0) return;
  check_tensor_cores();
  if (x.scalar_type() == at::kBFloat16) dispatch_nb<c10::BFloat16>(x, w, bias, y, g);
  else dispatch_nb<c10::Half>(x, w, bias, y, g);
}

}  // namespace lkcnn
