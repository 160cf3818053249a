// fp32 forward (and, with a flipped kernel, input-gradient) kernel of the large-kernel depthwise convolution on
// the FMA pipes (fp16/bf16 run on tensor cores: dwconv_fwd_tc.cu).
//
// One block computes a TH x TW output tile of PB (n, c) planes. The input strip the tile needs is staged in shared
// memory as fp32 (zeros where the "same" padding is), with the plane's kernel, which carries U-1 zero rows above
// and below so that every thread can read it without bounds checks. A thread owns U output rows x V output
// columns. For each input row it slides a 2V-wide register window over the row in steps of V columns: per step
// it loads 2 float4 of input and U*V/4 float4 of weights (the weights are the same for every thread in the block,
// so those loads are broadcasts) and issues U*V*V FMAs, about 25 FMAs per shared-memory load for U=4, V=8.
// Input rows and column steps that fall entirely in the padding are skipped per thread, which is what keeps maps
// smaller than the kernel (14x14 with 27x27, 7x7 with 13x13) from paying for the zeros.
#include "dwconv.h"
#include "tile.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

namespace lkcnn {
namespace {

constexpr int kMaxSmem = 96 * 1024;  // two blocks per SM still fit in Hopper's 228 KB

struct FwdTile {
  int TX, TY, PB;        // threads along the width, along the height; planes per block (blockDim.z)
  int TW, TH;            // output tile
  int IR, IS, XLD;       // staged input rows, columns and row stride (floats, incl. the bank-group shift)
  int KWp, WR;           // kernel width padded to V, kernel rows incl. the U-1 zero rows on each side
  int tiles_w, tiles_h;
  bool mirror;           // deal row groups mirrored (only when one tile spans the map's height)
};

template <typename T, int U, int V>
__global__ void __launch_bounds__(256) dwconv_fwd_kernel(const T* __restrict__ x, const float* __restrict__ w,
                                                         const float* __restrict__ bias, T* __restrict__ y,
                                                         const ConvGeom g, const FwdTile t) {
  extern __shared__ __align__(16) float smem[];
  const int tx = threadIdx.x, tz = threadIdx.z;
  // When one tile spans the map's height, row groups are dealt to threadIdx.y mirrored (0, TY-1, 1, TY-2, ...): a
  // warp spans 32/TX row groups, and rows the same distance from the top and bottom edges skip the same number of
  // padded input rows, so the lanes of a warp run loops of similar length (a warp runs as long as its longest lane).
  const int ty = !t.mirror ? int(threadIdx.y)
                 : (threadIdx.y & 1) ? t.TY - 1 - int(threadIdx.y >> 1) : int(threadIdx.y >> 1);
  float* sx = smem + tz * (t.IR * t.XLD + t.WR * t.KWp);
  float* sw = sx + t.IR * t.XLD;

  const unsigned tiles = unsigned(t.tiles_w) * unsigned(t.tiles_h);
  const unsigned tile = blockIdx.x % tiles;
  const int64_t plane = int64_t(blockIdx.x / tiles) * t.PB + tz;
  const int q0 = int(tile % unsigned(t.tiles_w)) * t.TW;
  const int p0 = int(tile / unsigned(t.tiles_w)) * t.TH;
  const bool active = plane < g.N * g.C;
  const int64_t n = plane / g.C, c = plane % g.C;

  if (active) {
    const int nthr = blockDim.x * blockDim.y, tid = threadIdx.y * blockDim.x + tx;
    // Columns past TW+kw-1 only ever meet zero weights; they are stored as zeros so that a non-finite input
    // outside an output's receptive field cannot reach it through 0*inf.
    stage_tile<U>(sx, x + n * g.xs_n + c * g.xs_c, t.IR, t.IS, p0 - g.ph, q0 - g.pw, t.TW + g.kw - 1, g.H, g.W, g.xs_h,
               g.xs_w, tid, nthr);
    // The kernel, with U-1 zero rows above and below and zero columns up to KWp.
    stage_tile<0>(sw, w + c * g.kh * g.kw, t.WR, t.KWp, -(U - 1), 0, t.KWp, g.kh, g.kw, int64_t(g.kw), int64_t(1), tid,
               nthr);
  }
  __syncthreads();
  const int pr = p0 + ty * U, qc = q0 + tx * V;  // this thread's first output row and column
  if (!active || pr >= g.H || qc >= g.W) return;

  // Input rows tt (relative to pr - ph) that lie inside the map.
  const int tlo = max(0, g.ph - pr);
  const int thi = min(U + g.kh - 1, g.H + g.ph - pr);
  // Column steps s0 whose window [s0, s0 + 2V - 1) meets the map's columns [a, b) (relative to qc - pw).
  const int a = g.pw - qc, b = a + g.W;
  const int slo = round_up_nonneg(a - 2 * V + 2, V);
  const int shi = min(t.KWp, b);

  float acc[U][V];
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int v = 0; v < V; ++v) acc[u][v] = 0.f;

  for (int tt = tlo; tt < thi; ++tt) {
    const float* xr = sx + row_offset<U>(ty * U + tt, t.XLD) + tx * V;
    const float* wr = sw + (tt + U - 1) * t.KWp;  // kernel row tt - u lives at wr - u * KWp
    float buf[2 * V];
#pragma unroll
    for (int i = 0; i < V; i += 4) load4(buf + i, xr + slo + i);
    for (int s0 = slo; s0 < shi; s0 += V) {
#pragma unroll
      for (int i = 0; i < V; i += 4) load4(buf + V + i, xr + s0 + V + i);
      float wv[U][V];
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int i = 0; i < V; i += 4) load4(wv[u] + i, wr - u * t.KWp + s0 + i);
#pragma unroll
      for (int j = 0; j < V; ++j)
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int v = 0; v < V; ++v) acc[u][v] = fmaf(buf[j + v], wv[u][j], acc[u][v]);
#pragma unroll
      for (int i = 0; i < V; ++i) buf[i] = buf[i + V];
    }
  }

  T* yp = y + n * g.ys_n + c * g.ys_c;
  const float bv = bias != nullptr ? bias[c] : 0.f;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int p = pr + u;
    if (p >= g.H) break;
#pragma unroll
    for (int v = 0; v < V; ++v) {
      const int q = qc + v;
      if (q < g.W) yp[p * g.ys_h + q * g.ys_w] = static_cast<T>(acc[u][v] + bv);
    }
  }
}

template <int U, int V>
FwdTile plan_fwd(const ConvGeom& g) {
  FwdTile t;
  t.TX = std::min(ceil_div(int(g.W), V), 8);
  t.TY = std::min({ceil_div(int(g.H), U), std::max(1, 128 / t.TX), 16});
  t.TW = t.TX * V;
  t.TH = t.TY * U;
  t.KWp = ceil_div(g.kw, V) * V;
  t.IR = t.TH + g.kh - 1;
  t.IS = t.TW + t.KWp;
  t.XLD = staged_ld<U>(t.IS);
  t.WR = g.kh + 2 * (U - 1);
  t.tiles_w = ceil_div(int(g.W), t.TW);
  t.tiles_h = ceil_div(int(g.H), t.TH);
  t.mirror = t.tiles_h == 1;
  const int plane_bytes = int(sizeof(float)) * (t.IR * t.XLD + t.WR * t.KWp);
  const int64_t planes = g.N * g.C;
  t.PB = int(std::min<int64_t>({std::max(1, 128 / (t.TX * t.TY)), int64_t(64), std::max(1, kMaxSmem / plane_bytes),
                                planes}));
  TORCH_CHECK(plane_bytes <= kMaxSmem, "lkcnn dwconv2d: the tile does not fit in shared memory (", plane_bytes,
              " bytes); this kernel size is not supported by the CUDA kernel");
  return t;
}

template <typename T, int U, int V>
void run_fwd(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, at::Tensor& y, const ConvGeom& g) {
  const FwdTile t = plan_fwd<U, V>(g);
  const int64_t blocks = (g.N * g.C + t.PB - 1) / t.PB * t.tiles_w * t.tiles_h;
  TORCH_CHECK(blocks < INT32_MAX, "lkcnn dwconv2d: too many (n, c) planes for one launch");
  const int smem = int(sizeof(float)) * t.PB * (t.IR * t.XLD + t.WR * t.KWp);
  constexpr auto kernel = dwconv_fwd_kernel<T, U, V>;
  allow_dynamic_smem<kernel>(smem);
  const dim3 block(t.TX, t.TY, t.PB);
  kernel<<<unsigned(blocks), block, smem, at::cuda::getCurrentCUDAStream()>>>(
      x.const_data_ptr<T>(), w.const_data_ptr<float>(), bias.defined() ? bias.const_data_ptr<float>() : nullptr,
      y.mutable_data_ptr<T>(), g, t);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void launch_dwconv_fwd(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, at::Tensor& y,
                       int64_t ph, int64_t pw) {
  const c10::cuda::CUDAGuard guard(x.device());
  const ConvGeom g = make_geom(x, y, w.size(1), w.size(2), ph, pw);
  if (g.N * g.C == 0 || g.H == 0 || g.W == 0) return;
  // U = 2 rows per thread: U = 4 needed twice the shared memory per thread and held occupancy to 8 warps per SM
  // (docs/kernels.md, tiled SIMT kernels). V = 4 for maps narrower than 8.
  TORCH_CHECK(x.scalar_type() == at::kFloat, "lkcnn dwconv2d: the SIMT forward kernel takes fp32 (fp16/bf16 run on "
              "tensor cores)");
  if (g.W >= 8) run_fwd<float, 2, 8>(x, w, bias, y, g);
  else run_fwd<float, 2, 4>(x, w, bias, y, g);
}

}  // namespace lkcnn
