// Weight-gradient kernel for fp16/bf16 on tensor cores (band_mma.cuh):
//   dw[c, r, s] = sum over n, p, q of dy[n, c, p, q] * x[n, c, p + r - ph, q + s - pw].
// For one row p of dy this is a banded GEMM whose 16 M rows are 16 kernel rows r (x rows p + r - ph), whose N
// columns are kernel columns s, and whose Toeplitz operand is dy's row p.
//
// A block owns one channel and walks work items (one sample, one band of PH rows of dy) of a range of samples.
// PB items at a time are staged in shared memory (x strip in the storage type, dy rows as Toeplitz pairs), one per
// slot; the MT x PS warps of a slot each own 16 kernel rows x 8*NB kernel columns in fp32 accumulators and loop over
// every PS-th of the item's dy rows whose x rows meet the map (PS > 1: more warps per SM for the same shared memory;
// the weight gradient is bound by latency, not by issue). At the end the slots are summed in shared memory and each
// tap gets one fp32 atomic per block (the last bits of the sum depend on the order, as with the SIMT kernel).
#include "band_mma.cuh"
#include "dwconv.h"
#include "tile.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

namespace lkcnn {
namespace {

constexpr int kSlotBytes = 32 * 1024;  // shared memory per slot before an item takes fewer dy rows
constexpr int kMaxSmem = 96 * 1024;
constexpr int kSmemFor3Blocks = 76 * 1024;  // per block, for three blocks per SM
constexpr int kMaxSteps = 4;           // band steps per band_mma call; wider maps take several calls

struct WgradTcTile {
  int MT, PS, PB;      // 16-kernel-row tiles, warps splitting an item's dy rows (warps per slot MT * PS); slots
  int steps, S;        // band steps (16 steps >= W + 7); steps rounded up to the kernel's steps per call SC
  int PH, chunks;      // dy rows per item, items per sample
  int XR, XLD;         // staged x rows, row stride (elements)
  int QL;              // Toeplitz pairs per dy row
  int slot_bytes, x_bytes, part_floats;
  int V;               // elements per staging access (row_vector; set by the launcher, which sees the tensors)
  int64_t items, items_per_block;
};

// Copy one round's tiles: slot k gets x rows pa - ph + r_a + r (r < rows) at columns j < cols (zeros for rows
// outside the map) and dy rows pa + p (p < PH) as Toeplitz pairs, word j + 7 = (dy[j - 1], dy[j]) for j <= W
// (zeros past the map); a dy access of V elements yields V pairs from registers and the element before it.
template <int V, typename T>
__device__ __forceinline__ void stage_round(unsigned char* smem, const T* __restrict__ x, const T* __restrict__ dy,
                                            const int64_t* x_off, const int64_t* dy_off, const int* pa_of, int items,
                                            int r_a, int rows, int cols, const ConvGeom& g, const WgradTcTile& t,
                                            int tid, int nthr) {
  copy_rows<V, T>(
      items, rows, cols, 0, tid, nthr,
      [&](int k, int r) -> const T* {
        const int row = pa_of[k] - g.ph + r_a + r;
        return row >= 0 && row < g.H ? x + x_off[k] + int64_t(row) * g.ys_h : nullptr;
      },
      [&](int k, int r) { return reinterpret_cast<T*>(smem + k * t.slot_bytes) + (r + r_a) * t.XLD + g.pw; });

  const int vd = g.W / V;
  for (int u = tid; u < items * t.PH * vd; u += nthr) {
    const int k = u / (t.PH * vd), rem = u - k * t.PH * vd, p = rem / vd, j0 = (rem - p * vd) * V;
    const T* d = dy + dy_off[k] + int64_t(p) * g.xs_h + j0;
    T v[V] __attribute__((aligned(16)));
    T prev = T(0.f);
    if (p < int(g.H) - pa_of[k]) {
      copy_vec<V>(v, d);
      if (j0 > 0) prev = d[-1];
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e) v[e] = T(0.f);
    }
    uint32_t* dst = reinterpret_cast<uint32_t*>(smem + k * t.slot_bytes + t.x_bytes) + p * t.QL + j0 + 7;
    dst[0] = pack2(prev, v[0]);
#pragma unroll
    for (int e = 1; e < V; ++e) dst[e] = pack2(v[e - 1], v[e]);
    if (j0 + V == g.W) dst[V] = pack2(v[V - 1], T(0.f));
  }
}

// g.xs_* are the strides of dy, g.ys_* those of x.
template <typename T, int NB, int SC>
__global__ void __launch_bounds__(256) dwconv_wgrad_tc_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                                              float* __restrict__ dw, const ConvGeom g,
                                                              const WgradTcTile t) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, nthr = blockDim.x, warp = tid / 32, lane = tid % 32;
  const int z = warp / (t.MT * t.PS), mt = warp % t.MT, ps = warp / t.MT % t.PS;
  const int64_t c = blockIdx.x;
  const int64_t begin = int64_t(blockIdx.y) * t.items_per_block;
  const int64_t end = min(t.items, begin + t.items_per_block);

  float acc[NB][4];
#pragma unroll
  for (int b = 0; b < NB; ++b)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[b][e] = 0.f;

  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(
      reinterpret_cast<const T*>(smem + z * t.slot_bytes) + (16 * mt + (lane & 15)) * t.XLD + 8 * (lane >> 4)));
  const uint32_t* q = reinterpret_cast<const uint32_t*>(smem + z * t.slot_bytes + t.x_bytes) + 8 + 2 * (lane % 4) -
                      lane / 4;
  const uint32_t row_bytes = uint32_t(t.XLD) * sizeof(T);

  // Slot k's tile: x rows pa - ph + r (r < XR) at columns j - pw, dy rows pa + p as pairs (word j + 8 holds dy[j],
  // dy[j + 1]). Columns outside the map are zeroed once; rows outside it are written as zeros by the copy (with one
  // chunk per sample they are outside the copied box and stay zero too). All slots are copied in one box, so that
  // their loads are in flight together.
  __shared__ int64_t x_off[8], dy_off[8];
  __shared__ int pa_of[8];
  const int j_b = min(band_cols(NB, SC) + 16 * (t.S - SC), int(g.W) + g.pw);
  const int r_a = t.chunks == 1 ? max(0, g.ph) : 0, r_b = t.chunks == 1 ? min(t.XR, int(g.H) + g.ph) : t.XR;
  zero_smem(smem, t.PB * t.slot_bytes, tid, nthr);

  for (int64_t base = begin; base < end; base += t.PB) {
    const int items = int(min(int64_t(t.PB), end - base));
    __syncthreads();  // the zeroing is done / the previous items are consumed before their tiles are overwritten
    if (tid < items) {
      const int64_t n = (base + tid) / t.chunks;
      pa_of[tid] = int((base + tid) % t.chunks) * t.PH;
      x_off[tid] = n * g.ys_n + c * g.ys_c;
      dy_off[tid] = n * g.xs_n + c * g.xs_c + int64_t(pa_of[tid]) * g.xs_h;
    }
    __syncthreads();
    with_vector(t.V, [&](auto v) {
      stage_round<decltype(v)::value>(smem, x, dy, x_off, dy_off, pa_of, items, r_a, r_b - r_a, j_b - g.pw, g, t, tid,
                                      nthr);
    });
    __syncthreads();
    if (z >= items) continue;
    const int pa = pa_of[z];
    // dy rows of the item whose 16 x rows (pa + p + 16 mt - ph + [0, 16)) meet the map.
    const int p_lo = max(0, g.ph - pa - 16 * mt - 15);
    const int p_hi = min(min(t.PH, int(g.H) - pa), int(g.H) + g.ph - pa - 16 * mt);
    for (int p = p_lo + ps; p < p_hi; p += t.PS)
      for (int s0 = 0; s0 < t.S; s0 += SC)
        band_mma<T, NB, SC>(acc, a + p * row_bytes + s0 * 16 * sizeof(T), q + p * t.QL + 16 * s0, 0, t.steps - s0);
  }

  // Sum the slots: accumulator e of block b is kernel row 16 mt + lane / 4 + 8 (e / 2), column 8b + 2 (lane % 4)
  // + e % 2.
  constexpr int kCols = 8 * NB;
  float* part = reinterpret_cast<float*>(smem);
  __syncthreads();
#pragma unroll
  for (int e = 0; e < 4; ++e)
#pragma unroll
    for (int b = 0; b < NB; ++b)
      part[(z * t.PS + ps) * t.part_floats + (16 * mt + lane / 4 + 8 * (e / 2)) * kCols + 8 * b + 2 * (lane % 4) +
           e % 2] = acc[b][e];
  __syncthreads();
  float* dwc = dw + c * g.kh * g.kw;
  for (int i = tid; i < t.part_floats; i += nthr) {
    const int r = i / kCols, s = i % kCols;
    if (r >= g.kh || s >= g.kw) continue;
    float sum = 0.f;
    for (int k = 0; k < t.PB * t.PS; ++k) sum += part[k * t.part_floats + i];
    atomicAdd(dwc + r * g.kw + s, sum);
  }
}

// 8-column blocks of kernel columns per warp (a power of two, so few instantiations).
int pick_nb(int kw) {
  const int blocks = ceil_div(kw, 8);
  return blocks <= 1 ? 1 : blocks <= 2 ? 2 : blocks <= 4 ? 4 : 8;
}

int steps(int64_t W) { return ceil_div(int(W) + 7, 16); }
int steps_per_call(int64_t W) { return std::min(steps(W), kMaxSteps); }

WgradTcTile plan_wgrad_tc(const ConvGeom& g, int NB, int num_sms) {
  WgradTcTile t;
  t.MT = ceil_div(g.kh, 16);
  const int SC = steps_per_call(g.W);
  t.steps = steps(g.W);
  t.S = ceil_div(t.steps, SC) * SC;
  t.XLD = tc_ld(band_cols(NB, SC) + 16 * (t.S - SC));
  t.QL = 16 * t.S + 8;
  auto bytes = [&](int rows) { return (rows + 16 * t.MT - 1) * t.XLD * 2 + rows * t.QL * 4; };
  t.PH = int(g.H);
  while (t.PH > 1 && bytes(t.PH) > kSlotBytes) t.PH = (t.PH + 1) / 2;
  t.XR = t.PH + 16 * t.MT - 1;
  t.x_bytes = t.XR * t.XLD * 2;
  t.part_floats = 16 * t.MT * 8 * NB;
  // Eight warps per block: up to 8 / MT slots of MT warps each (fewest rounds and barriers per item), unless those
  // slots would leave fewer than 3 blocks per SM; then two slots whose items are split among PS = 4 / MT warps each
  // (more warps per SM for the same shared memory). Measured both ways: docs/kernels.md.
  auto slot_of = [&](int ps) { return (std::max(bytes(t.PH), ps * t.part_floats * 4) + 15) / 16 * 16; };
  t.PS = 1;
  t.slot_bytes = slot_of(1);
  t.PB = std::max(1, std::min(8 / t.MT, kMaxSmem / t.slot_bytes));
  if (t.PB * t.slot_bytes > kSmemFor3Blocks) {
    t.PS = std::max(1, 4 / t.MT);
    t.slot_bytes = slot_of(t.PS);
    t.PB = std::max(1, std::min(2, kMaxSmem / t.slot_bytes));
  }
  TORCH_CHECK(t.slot_bytes <= kMaxSmem, "lkcnn dwconv2d: the weight-gradient tile does not fit in shared memory; "
              "this map width / kernel size is not supported by the CUDA kernel");
  t.chunks = ceil_div(int(g.H), t.PH);
  t.items = g.N * t.chunks;
  t.PB = int(std::min<int64_t>(t.PB, t.items));
  // About eight blocks per SM, each with a multiple of PB items.
  int64_t splits = std::max<int64_t>(1, (8 * int64_t(num_sms) + g.C - 1) / g.C);
  splits = std::min<int64_t>({splits, (t.items + t.PB - 1) / t.PB, 65535});
  t.items_per_block = ((t.items + splits - 1) / splits + t.PB - 1) / t.PB * t.PB;
  return t;
}

template <typename T, int NB, int SC>
void run_wgrad_tc(const at::Tensor& dy, const at::Tensor& x, at::Tensor& dw, const ConvGeom& g) {
  const int num_sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  WgradTcTile t = plan_wgrad_tc(g, NB, num_sms);
  t.V = std::min(row_vector(dy), row_vector(x));
  const int64_t splits = (t.items + t.items_per_block - 1) / t.items_per_block;
  const int smem = t.PB * t.slot_bytes;
  constexpr auto kernel = dwconv_wgrad_tc_kernel<T, NB, SC>;
  allow_dynamic_smem<kernel>(smem);
  TORCH_CHECK(g.C < INT32_MAX, "lkcnn dwconv2d: too many channels for one launch");
  kernel<<<dim3(unsigned(g.C), unsigned(splits)), 32 * t.MT * t.PS * t.PB, smem, at::cuda::getCurrentCUDAStream()>>>(
      dy.const_data_ptr<T>(), x.const_data_ptr<T>(), dw.mutable_data_ptr<float>(), g, t);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int NB>
void dispatch_sc(const at::Tensor& dy, const at::Tensor& x, at::Tensor& dw, const ConvGeom& g) {
  switch (steps_per_call(g.W)) {
    case 1: return run_wgrad_tc<T, NB, 1>(dy, x, dw, g);
    case 2: return run_wgrad_tc<T, NB, 2>(dy, x, dw, g);
    case 3: return run_wgrad_tc<T, NB, 3>(dy, x, dw, g);
    default: return run_wgrad_tc<T, NB, kMaxSteps>(dy, x, dw, g);
  }
}

template <typename T>
void dispatch_nb(const at::Tensor& dy, const at::Tensor& x, at::Tensor& dw, const ConvGeom& g) {
  switch (pick_nb(g.kw)) {
    case 8: return dispatch_sc<T, 8>(dy, x, dw, g);
    case 4: return dispatch_sc<T, 4>(dy, x, dw, g);
    case 2: return dispatch_sc<T, 2>(dy, x, dw, g);
    default: return dispatch_sc<T, 1>(dy, x, dw, g);
  }
}

}  // namespace

void launch_dwconv_wgrad_tc(const at::Tensor& grad_out, const at::Tensor& x, at::Tensor& dw, int64_t ph,
                            int64_t pw) {
  const c10::cuda::CUDAGuard guard(x.device());
  const ConvGeom g = make_geom(grad_out, x, dw.size(1), dw.size(2), ph, pw);
  if (g.N * g.C == 0 || g.H == 0 || g.W == 0) return;
  check_tensor_cores();
  if (x.scalar_type() == at::kBFloat16) dispatch_nb<c10::BFloat16>(grad_out, x, dw, g);
  else dispatch_nb<c10::Half>(grad_out, x, dw, g);
}

}  // namespace lkcnn
