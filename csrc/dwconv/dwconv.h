// Large-kernel depthwise convolution (stride 1, odd kernels, "same" padding): shared declarations.
//
// fp32 runs on SIMT kernels (tiles staged in shared memory, FMA pipes); fp16 and bf16 run on tensor-core kernels
// (compute capability 8.0+, band_mma.cuh); fp32 maps up to 32 x 32 that the kernel mostly covers run on whole-map
// kernels on the FMA pipes (dwconv_small.cu), fp16/bf16 maps up to 16 x 16 on whole-map tensor-core kernels
// (dwconv_map_tc.cu). All accumulate in fp32. Tensors are addressed through explicit strides; the
// kernels that stage one channel per block get NCHW copies of other layouts (layout.cu, bindings.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/ATen.h>

namespace lkcnn {

// Geometry of one launch; strides in elements, 64-bit so tensors over 2^31 elements index correctly.
struct ConvGeom {
  int64_t N, C;
  int H, W;                        // one map side never needs 64 bits; keeping them int keeps tile math in int
  int64_t xs_n, xs_c, xs_h, xs_w;  // strides of the tensor that is read densely (x or grad_out)
  int64_t ys_n, ys_c, ys_h, ys_w;  // strides of the second tensor (output y, or x for the weight gradient)
  int kh, kw, ph, pw;
};

inline int ceil_div(int a, int b) { return (a + b - 1) / b; }

#ifdef __CUDACC__
#define LKCNN_HOST_DEVICE __host__ __device__
#else
#define LKCNN_HOST_DEVICE
#endif

// Smallest multiple of m that is >= x, and 0 for x <= 0 (loop bounds of the padded-tap skipping).
LKCNN_HOST_DEVICE inline int round_up_nonneg(int x, int m) { return x <= 0 ? 0 : (x + m - 1) / m * m; }

ConvGeom make_geom(const at::Tensor& a, const at::Tensor& b, int64_t kh, int64_t kw, int64_t ph, int64_t pw);

// Whether every row of t (N, C, H, W) splits into aligned accesses of v elements: unit column stride (any stride for
// maps one column wide, which PyTorch calls contiguous whatever it is), the width and the row, channel and sample
// strides multiples of v, the data aligned to v elements.
inline bool rows_allow(const at::Tensor& t, int64_t v) {
  return (t.stride(3) == 1 || t.size(3) == 1) && t.size(3) % v == 0 && t.stride(2) % v == 0 && t.stride(1) % v == 0 &&
         t.stride(0) % v == 0 && reinterpret_cast<uintptr_t>(t.const_data_ptr()) % (v * t.element_size()) == 0;
}

// y = correlate(x, w) + bias, w: (C, kh, kw) fp32 contiguous, bias: fp32 (C) or undefined.
// The input gradient is the same correlation of grad_out with the flipped kernel (the caller flips it).
// fp32 tensors (SIMT) and fp16/bf16 tensors (tensor cores).
void launch_dwconv_fwd(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, at::Tensor& y,
                       int64_t ph, int64_t pw);
void launch_dwconv_fwd_tc(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, at::Tensor& y,
                          int64_t ph, int64_t pw);

// dw += sum over batch and space of grad_out * shifted x; dw: (C, kh, kw) fp32, zero-initialised by the caller.
void launch_dwconv_wgrad(const at::Tensor& grad_out, const at::Tensor& x, at::Tensor& dw, int64_t ph, int64_t pw);
void launch_dwconv_wgrad_tc(const at::Tensor& grad_out, const at::Tensor& x, at::Tensor& dw, int64_t ph,
                            int64_t pw);

// The most shared memory one block may ask for on a device (-1: the current one): 227 KB on Hopper, 163 KB on A100,
// 99 KB on sm_86/89. The *_fits checks turn down a kernel whose launch would need more (the tiled kernels fit all).
int smem_limit(int device = -1);  // dwconv_small.cu

// fp16/bf16 maps up to 16 x 16: all three passes as dense products of whole rows on the tensor cores
// (map_tc_wgrad_fits: the weight gradient's kernel rows fit in shared memory); maps up to 32 x 32 (map_tc_wide_fits):
// the forward (dwconv_map_tc.cu).
// w: (C, 1, kh, kw) contiguous in x's dtype, flipped by the kernel where flip. dw: fp32 (C, kh, kw) that blocks add to
// (zero-initialised by the caller), or, where map_tc_single_block, (C, 1, kh, kw) in x's dtype that they write.
bool map_tc_fits(const at::Tensor& t);
bool map_tc_wgrad_fits(const at::Tensor& t, int64_t kh);
bool map_tc_wide_fits(const at::Tensor& t, int64_t kh, int64_t kw);
bool map_tc_single_block(const at::Tensor& t);
void launch_dwconv_fwd_map_tc(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, at::Tensor& y,
                              int64_t ph, int64_t pw, bool flip);
void launch_dwconv_wgrad_map_tc(const at::Tensor& grad_out, const at::Tensor& x, at::Tensor& dw, int64_t ph,
                                int64_t pw);

// fp32 maps up to 32 x 32 whose rows the kernel mostly covers, batches of at least 16 (kernels up to 31 wide past
// 16 columns): all three passes on dwconv_small.cu's whole-map kernels, which visit no padded rows and compute only
// the column pairs within a compile-time reach.
bool small_map_fits(const at::Tensor& t, int64_t kw);
void launch_dwconv_fwd_small(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, at::Tensor& y,
                             int64_t ph, int64_t pw);
void launch_dwconv_wgrad_small(const at::Tensor& grad_out, const at::Tensor& x, at::Tensor& dw, int64_t ph,
                               int64_t pw);

// The fp32 forward of maps 33-56 wide with kernels 25-31 wide (up to 31 tall), batches of 8 or more: each warp one
// 14-column strip of 4 output rows of 8 samples (dwconv_fwd_strip.cu). w: (C, kh, kw) fp32 contiguous.
bool strip_fits(const at::Tensor& t, int64_t kh, int64_t kw);
void launch_dwconv_fwd_strip(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, at::Tensor& y,
                             int64_t ph, int64_t pw);

// An NCHW-contiguous tensor with t's values: t itself, a transpose of a channels_last t (layout.cu), or PyTorch's
// copy of other strides; and dst = src (NCHW-contiguous) whatever dst's layout.
at::Tensor to_nchw(const at::Tensor& t);
void copy_from_nchw(at::Tensor& dst, const at::Tensor& src);

// Several small depthwise convolutions (branch b: ks[b] x ks[b] taps, dilation rs[b], 'same' padding) of one
// channels_last x (dwconv_branches.cu). w: the branches' kernels as one (taps, C) table in x's dtype, branch after branch,
// each row-major. The forward writes ys[b]; the input gradient writes dx, the sum over the branches; the weight
// gradient returns the fp32 (taps, C) table. Every tensor channels_last and of x's shape and dtype.
bool branches_supported(const at::Tensor& x, const std::vector<int64_t>& ks, const std::vector<int64_t>& rs);
void branches_fwd(const at::Tensor& x, const at::Tensor& w, const std::vector<int64_t>& ks,
                  const std::vector<int64_t>& rs, const std::vector<at::Tensor>& ys);
void branches_bwd_input(const std::vector<at::Tensor>& dys, const at::Tensor& w, const std::vector<int64_t>& ks,
                        const std::vector<int64_t>& rs, const at::Tensor& dx);
at::Tensor branches_wgrad(const std::vector<at::Tensor>& dys, const at::Tensor& x, const std::vector<int64_t>& ks,
                          const std::vector<int64_t>& rs);

// The forward (flip false) or input gradient (flip true) of one k x k, dilation-1 branch on the tensor cores
// (dwconv_branches_tc.cu): dst = src correlated with the (k * k, C) table w, flipped for the input gradient; 16-bit
// channels_last tensors of one shape, C a multiple of 8, k odd up to 9, maps more than 8 rows tall, compute
// capability 8.0 or newer and the shared memory its tiles need.
bool branch_tc_fits(const at::Tensor& x, int64_t k, int64_t r);
void launch_branch_tc(const at::Tensor& src, const at::Tensor& w, const at::Tensor& dst, int64_t k, bool flip);

// Whether the weight-gradient tile for maps of width W fits in shared memory (the forward always fits for k <= 63).
bool wgrad_supported(int64_t W, int64_t kh, int64_t kw);

}  // namespace lkcnn
