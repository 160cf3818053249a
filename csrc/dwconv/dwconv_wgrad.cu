// fp32 weight-gradient kernel of the large-kernel depthwise convolution on the FMA pipes (fp16/bf16 run on tensor
// cores: dwconv_wgrad_tc.cu):
//   dw[c, r, s] = sum over n, p, q of dy[n, c, p, q] * x[n, c, p + r - ph, q + s - pw].
//
// A group of TR x TS x PS threads owns the whole (kh x kw) gradient of one channel: a thread holds U kernel rows x V
// kernel columns in registers, and PS threads (a power of two; PS > 1 only for small kernels, which would
// otherwise leave too few threads per block) split the dy rows of an item and are summed by warp shuffles. The
// group walks work items (one sample, one band of PH rows of dy), staged in
// shared memory as fp32 with the padded strip of x it meets. For each dy row, a thread slides a 2V-wide register
// window along each of its U rows of x in steps of V columns: per step V/4 float4 loads of dy (the same for the
// whole group: broadcasts) and U*V/4 float4 loads of x feed U*V*V FMAs. Several groups (slots) share a block and
// walk different items of the same channel; at the end each thread adds its partial gradient with one atomic per
// tap, so the order of the fp32 sum (and its last bits) is not deterministic. Rows and column steps of x that lie
// entirely in the padding are skipped per thread.
#include "dwconv.h"
#include "tile.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

namespace lkcnn {
namespace {

constexpr int kU = 4, kV = 8;
// Shared memory per slot, before an item falls back to fewer dy rows; 16 KB (more blocks per SM) measured slower
// (docs/kernels.md, tiled SIMT kernels).
constexpr int kSlotBytes = 24 * 1024;
constexpr int kMaxSmem = 96 * 1024;

struct WgradTile {
  int TR, TS, PS;    // threads along kernel rows, along kernel columns, across dy rows (a power of two <= 32)
  int G, S;          // group size TR*TS*PS; groups (slots) per block
  int PH, chunks;    // dy rows per item; items per sample
  int QW;            // dy row stride: W rounded up to V
  int XR, XS, XLD;   // staged x rows, columns and row stride (incl. the bank-group shift)
  int KWp;
  int64_t items, items_per_block;
};

// g.xs_* are the strides of dy, g.ys_* those of x.
template <typename T, int U, int V>
__global__ void __launch_bounds__(256) dwconv_wgrad_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                                           float* __restrict__ dw, const ConvGeom g,
                                                           const WgradTile t) {
  extern __shared__ __align__(16) float smem[];
  const int slot = threadIdx.x / t.G, lt = threadIdx.x % t.G;
  const int tile = lt / t.PS, ps = lt % t.PS;  // the PS threads of one tile are adjacent lanes of one warp
  const int r0 = (tile / t.TS) * U, s0 = (tile % t.TS) * V;
  const int slot_floats = t.PH * t.QW + t.XR * t.XLD;
  float* sdy = smem + slot * slot_floats;  // this slot's region: dy band, then x strip
  float* sx = sdy + t.PH * t.QW;
  const int64_t c = blockIdx.x;
  const int64_t begin = int64_t(blockIdx.y) * t.items_per_block;
  const int64_t end = min(t.items, begin + t.items_per_block);

  float acc[U][V];
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int v = 0; v < V; ++v) acc[u][v] = 0.f;

  for (int64_t base = begin; base < end; base += t.S) {
    const int64_t item = base + slot;
    const bool valid = item < end;
    const int64_t n = item / t.chunks;
    const int pa = int(item % t.chunks) * t.PH;  // first dy row of this item
    __syncthreads();  // the previous items are consumed before their tiles are overwritten
    if (valid) {
      stage_tile<0>(sdy, dy + n * g.xs_n + c * g.xs_c, t.PH, t.QW, pa, 0, t.QW, g.H, g.W, g.xs_h, g.xs_w, lt, t.G);
      stage_tile<U>(sx, x + n * g.ys_n + c * g.ys_c, t.XR, t.XS, pa - g.ph, -g.pw, t.XS, g.H, g.W, g.ys_h, g.ys_w, lt, t.G);
    }
    __syncthreads();
    if (!valid) continue;

    // dy rows p whose x rows p + r0 + u (global pa + p + r0 + u - ph) meet the map for some u.
    const int plo = max(0, g.ph - pa - r0 - U + 1);
    const int phi = min(min(t.PH, int(g.H) - pa), int(g.H) + g.ph - pa - r0);
    // Column steps q0 whose x window [q0 + s0, q0 + s0 + 2V - 1) meets the map's columns [pw, pw + W).
    const int qlo = round_up_nonneg(g.pw - s0 - 2 * V + 2, V);
    const int qhi = min(t.QW, g.pw + int(g.W) - s0);
    for (int p = plo + ps; p < phi; p += t.PS) {
      const float* dyr = sdy + p * t.QW;
      const float* xr[U];
#pragma unroll
      for (int u = 0; u < U; ++u) xr[u] = sx + row_offset<U>(p + r0 + u, t.XLD) + s0;
      float buf[U][2 * V];
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int i = 0; i < V; i += 4) load4(buf[u] + i, xr[u] + qlo + i);
      for (int q0 = qlo; q0 < qhi; q0 += V) {
        float dv[V];
#pragma unroll
        for (int i = 0; i < V; i += 4) load4(dv + i, dyr + q0 + i);
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int i = 0; i < V; i += 4) load4(buf[u] + V + i, xr[u] + q0 + V + i);
#pragma unroll
        for (int j = 0; j < V; ++j)
#pragma unroll
          for (int u = 0; u < U; ++u)
#pragma unroll
            for (int v = 0; v < V; ++v) acc[u][v] = fmaf(dv[j], buf[u][j + v], acc[u][v]);
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int i = 0; i < V; ++i) buf[u][i] = buf[u][i + V];
      }
    }
  }

  const unsigned lanes = __activemask();  // every thread of the block arrives here (blocks need not fill a warp)
  for (int offset = t.PS / 2; offset > 0; offset /= 2)
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int v = 0; v < V; ++v) acc[u][v] += __shfl_xor_sync(lanes, acc[u][v], offset);
  // Sum the slots in shared memory (each slot's partial fits in its own region), then one atomic per tap and
  // block: atomics from every slot to the same few addresses serialise in L2 (seen on 7x7 maps, S = 32).
  const int taps = t.TR * t.TS * U * V;
  float* part = smem + slot * slot_floats;
  __syncthreads();
  if (ps == 0) {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int v = 0; v < V; ++v) part[(tile * U + u) * V + v] = acc[u][v];
  }
  __syncthreads();
  float* dwc = dw + c * g.kh * g.kw;
  for (int i = threadIdx.x; i < taps; i += blockDim.x) {
    const int tl = i / (U * V), u = (i / V) % U, v = i % V;
    const int r = (tl / t.TS) * U + u, s = (tl % t.TS) * V + v;
    if (r >= g.kh || s >= g.kw) continue;
    float sum = 0.f;
    for (int k = 0; k < t.S; ++k) sum += smem[k * slot_floats + i];
    atomicAdd(dwc + r * g.kw + s, sum);
  }
}

// Shared memory of one slot holding `rows` dy rows (and the x rows they meet).
int slot_bytes(int rows, int64_t W, int kh, int kw) {
  const int QW = ceil_div(int(W), kV) * kV, XS = QW + ceil_div(kw, kV) * kV;
  return int(sizeof(float)) * (rows * QW + (rows + ceil_div(kh, kU) * kU - 1) * staged_ld<kU>(XS));
}

WgradTile plan_wgrad(const ConvGeom& g, int num_sms) {
  WgradTile t;
  t.KWp = ceil_div(g.kw, kV) * kV;
  t.TS = t.KWp / kV;
  t.TR = ceil_div(g.kh, kU);
  t.QW = ceil_div(int(g.W), kV) * kV;
  t.XS = t.QW + t.KWp;
  t.XLD = staged_ld<kU>(t.XS);
  auto bytes = [&](int rows) { return slot_bytes(rows, g.W, g.kh, g.kw); };
  t.PH = int(g.H);
  while (t.PH > 1 && bytes(t.PH) > kSlotBytes) t.PH = (t.PH + 1) / 2;
  TORCH_CHECK(bytes(t.PH) <= kMaxSmem, "lkcnn dwconv2d: the weight-gradient tile does not fit in shared memory; "
              "this map width / kernel size is not supported by the CUDA kernel");
  t.PS = 1;
  while (t.PS * 2 * t.TR * t.TS <= 32 && t.PS * 2 <= t.PH) t.PS *= 2;
  t.G = t.TR * t.TS * t.PS;
  t.XR = t.PH + t.TR * kU - 1;
  t.chunks = ceil_div(int(g.H), t.PH);
  t.items = g.N * t.chunks;
  t.S = std::max(1, std::min(256 / t.G, kMaxSmem / bytes(t.PH)));
  t.S = int(std::min<int64_t>(t.S, t.items));
  // Enough blocks to fill the GPU about four times over, each with at least S items.
  int64_t splits = std::max<int64_t>(1, (4 * int64_t(num_sms) + g.C - 1) / g.C);
  splits = std::min<int64_t>({splits, (t.items + t.S - 1) / t.S, 65535});
  t.items_per_block = (t.items + splits - 1) / splits;
  return t;
}

template <typename T>
void run_wgrad(const at::Tensor& dy, const at::Tensor& x, at::Tensor& dw, const ConvGeom& g) {
  const int num_sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const WgradTile t = plan_wgrad(g, num_sms);
  const int64_t splits = (t.items + t.items_per_block - 1) / t.items_per_block;
  const int smem = t.S * slot_bytes(t.PH, g.W, g.kh, g.kw);
  constexpr auto kernel = dwconv_wgrad_kernel<T, kU, kV>;
  allow_dynamic_smem<kernel>(smem);
  TORCH_CHECK(g.C < INT32_MAX, "lkcnn dwconv2d: too many channels for one launch");
  const dim3 grid(unsigned(g.C), unsigned(splits));
  kernel<<<grid, t.G * t.S, smem, at::cuda::getCurrentCUDAStream()>>>(
      dy.const_data_ptr<T>(), x.const_data_ptr<T>(), dw.mutable_data_ptr<float>(), g, t);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

bool wgrad_supported(int64_t W, int64_t kh, int64_t kw) { return slot_bytes(1, W, int(kh), int(kw)) <= kMaxSmem; }

void launch_dwconv_wgrad(const at::Tensor& grad_out, const at::Tensor& x, at::Tensor& dw, int64_t ph, int64_t pw) {
  const c10::cuda::CUDAGuard guard(x.device());
  const ConvGeom g = make_geom(grad_out, x, dw.size(1), dw.size(2), ph, pw);
  if (g.N * g.C == 0 || g.H == 0 || g.W == 0) return;
  TORCH_CHECK(x.scalar_type() == at::kFloat, "lkcnn dwconv2d: the SIMT weight-gradient kernel takes fp32 (fp16/bf16 "
              "run on tensor cores)");
  run_wgrad<float>(grad_out, x, dw, g);
}

}  // namespace lkcnn
