// Python binding of the depthwise-convolution kernels (registered by csrc/extension.cpp). The kernels write into
// tensors the caller allocates (lkcnn/ops/dwconv.py), which keeps memory formats and the tests' output poisoning in
// one place on the Python side.
#include <torch/extension.h>

#include "dwconv.h"

namespace lkcnn {

ConvGeom make_geom(const at::Tensor& a, const at::Tensor& b, int64_t kh, int64_t kw, int64_t ph, int64_t pw) {
  ConvGeom g;
  g.N = a.size(0); g.C = a.size(1); g.H = int(a.size(2)); g.W = int(a.size(3));
  g.xs_n = a.stride(0); g.xs_c = a.stride(1); g.xs_h = a.stride(2); g.xs_w = a.stride(3);
  g.ys_n = b.stride(0); g.ys_c = b.stride(1); g.ys_h = b.stride(2); g.ys_w = b.stride(3);
  g.kh = int(kh); g.kw = int(kw); g.ph = int(ph); g.pw = int(pw);
  return g;
}

namespace {

void check_pair(const at::Tensor& a, const at::Tensor& b, const char* what) {
  TORCH_CHECK(a.is_cuda() && b.is_cuda() && a.device() == b.device(), what, ": tensors must be on the same CUDA device");
  TORCH_CHECK(a.dim() == 4 && a.sizes() == b.sizes(), what, ": expected two (N, C, H, W) tensors of one shape, got ",
              a.sizes(), " and ", b.sizes());
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), what, ": dtypes differ (", a.scalar_type(), " vs ", b.scalar_type(), ")");
  const auto dtype = a.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, what,
              ": the CUDA kernels take float32, float16 or bfloat16, got ", dtype);
}

void check_kernel_size(int64_t kh, int64_t kw, int64_t ph, int64_t pw, const char* what) {
  TORCH_CHECK(kh % 2 == 1 && kw % 2 == 1 && kh <= 63 && kw <= 63 && ph == kh / 2 && pw == kw / 2, what,
              ": the CUDA kernel supports odd kernels up to 63 with 'same' padding, got ", kh, "x", kw, " padding ",
              ph, ",", pw);
}

// kh, kw of a (C, 1, kh, kw) depthwise kernel, checked for what the CUDA kernels support.
std::pair<int64_t, int64_t> check_kernel(const at::Tensor& w, int64_t C, int64_t ph, int64_t pw, const char* what) {
  TORCH_CHECK(w.is_cuda() && w.dim() == 4 && w.size(0) == C && w.size(1) == 1 && w.is_floating_point(), what,
              ": kernel must be a floating-point (C, 1, kh, kw) CUDA tensor");
  check_kernel_size(w.size(2), w.size(3), ph, pw, what);
  return {w.size(2), w.size(3)};
}

// Which kernels run a pass (the forward and input gradient, or the weight gradient) of x (N, C, H, W) with a kh x kw
// kernel: the whole-map tensor-core kernels (fp16/bf16 maps up to 16 x 16; the forward up to 32 x 32), the
// whole-map FMA kernels (fp32 maps up to 32 x 32 that the kernel mostly covers), the strip kernel (the fp32 forward
// of maps 33-56 wide with kernels 25-31 wide), or the tiled kernels (SIMT for fp32, banded tensor-core for
// fp16/bf16).
enum class Path { map_tc, small, strip, tiled };
Path path_for(const at::Tensor& x, int64_t kh, int64_t kw, bool forward) {
  if (forward ? map_tc_fits(x) || map_tc_wide_fits(x, kh, kw) : map_tc_wgrad_fits(x, kh)) return Path::map_tc;
  if (small_map_fits(x, kw)) return Path::small;
  if (forward && strip_fits(x, kh, kw)) return Path::strip;
  return Path::tiled;
}

// Whether x's pass runs on kernels that stage one channel of several samples per block (all but the fp32 tiled
// ones): those get NCHW copies of channels_last and strided tensors, whose every element would otherwise be a
// 32-byte sector of its own (1.6-2.2x slower passes, docs/kernels.md). The fp32 SIMT kernels stage tiles of
// one sample's map and measured the same in both layouts, so they read any strides directly.
bool stages_by_channel(const at::Tensor& x, Path path) { return path != Path::tiled || x.scalar_type() != at::kFloat; }

// y = correlate(x, w) + bias, or with w flipped (the input gradient). The whole-map tensor-core kernels read w in
// x's dtype and flip it themselves; the others get the (C, kh, kw) fp32 copy they read. Doing this here rather than
// in Python saves the training step two to four small kernels and their dispatch per layer and pass.
void fwd(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, at::Tensor y, int64_t ph,
         int64_t pw, bool flip) {
  check_pair(x, y, "lkcnn dwconv2d forward");
  const auto [kh, kw] = check_kernel(w, x.size(1), ph, pw, "lkcnn dwconv2d forward");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == x.size(1) && bias->device() == x.device(),
                "lkcnn dwconv2d forward: bias must be a (C,) tensor on the input's device");
    b = bias->to(at::kFloat).contiguous();
  }
  const Path path = path_for(x, kh, kw, true);
  at::Tensor wk;
  if (path == Path::map_tc) {
    wk = w.to(x.scalar_type()).contiguous();
  } else {
    wk = w.reshape({w.size(0), kh, kw}).to(at::kFloat);
    wk = (flip ? wk.flip({1, 2}) : wk).contiguous();
  }
  auto launch = [&](const at::Tensor& xi, at::Tensor& yo) {
    if (path == Path::map_tc) launch_dwconv_fwd_map_tc(xi, wk, b, yo, ph, pw, flip);
    else if (path == Path::small) launch_dwconv_fwd_small(xi, wk, b, yo, ph, pw);
    else if (path == Path::strip) launch_dwconv_fwd_strip(xi, wk, b, yo, ph, pw);
    else if (xi.scalar_type() == at::kFloat) launch_dwconv_fwd(xi, wk, b, yo, ph, pw);
    else launch_dwconv_fwd_tc(xi, wk, b, yo, ph, pw);
  };
  if (!stages_by_channel(x, path) || (x.is_contiguous() && y.is_contiguous())) return launch(x, y);
  at::Tensor yc = at::empty(y.sizes(), y.options().memory_format(at::MemoryFormat::Contiguous));
  launch(to_nchw(x), yc);
  copy_from_nchw(y, yc);
}

// The weight gradient (C, 1, kh, kw) in x's dtype. The kernels accumulate in fp32 with atomics into a zeroed
// buffer, except the whole-map tensor-core ones where one block covers a channel's whole batch: those write the
// gradient in x's dtype directly.
at::Tensor wgrad(const at::Tensor& grad_out, const at::Tensor& x, int64_t kh, int64_t kw, int64_t ph, int64_t pw) {
  check_pair(grad_out, x, "lkcnn dwconv2d weight gradient");
  check_kernel_size(kh, kw, ph, pw, "lkcnn dwconv2d weight gradient");
  const int64_t C = x.size(1);
  if (x.numel() == 0) return at::zeros({C, 1, kh, kw}, x.options());
  const Path path = path_for(x, kh, kw, false);
  TORCH_CHECK(path != Path::tiled || wgrad_supported(x.size(3), kh, kw),
              "lkcnn dwconv2d weight gradient: maps this wide are not supported by the CUDA kernel");
  if (path == Path::map_tc && map_tc_single_block(x)) {
    at::Tensor dw = at::empty({C, 1, kh, kw}, x.options().memory_format(at::MemoryFormat::Contiguous));
    launch_dwconv_wgrad_map_tc(to_nchw(grad_out), to_nchw(x), dw, ph, pw);
    return dw;
  }
  at::Tensor dw = at::zeros({C, kh, kw}, x.options().dtype(at::kFloat));
  const bool copies = stages_by_channel(x, path);
  const at::Tensor dy_c = copies ? to_nchw(grad_out) : grad_out, x_c = copies ? to_nchw(x) : x;
  if (path == Path::map_tc) launch_dwconv_wgrad_map_tc(dy_c, x_c, dw, ph, pw);
  else if (path == Path::small) launch_dwconv_wgrad_small(dy_c, x_c, dw, ph, pw);
  else if (x.scalar_type() == at::kFloat) launch_dwconv_wgrad(dy_c, x_c, dw, ph, pw);
  else launch_dwconv_wgrad_tc(dy_c, x_c, dw, ph, pw);
  return dw.to(x.scalar_type()).view({C, 1, kh, kw});
}

// Both gradients in one call, writing the input gradient into dx (in its own layout) and returning the weight
// gradient as wgrad does. Where either pass stages by channel, a channels_last or strided grad_out is copied to NCHW
// once for both passes instead of once per pass (one layout copy fewer per layer and training step).
at::Tensor bwd(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& w, at::Tensor dx, int64_t ph,
               int64_t pw) {
  check_pair(grad_out, x, "lkcnn dwconv2d backward");
  const auto [kh, kw] = check_kernel(w, x.size(1), ph, pw, "lkcnn dwconv2d backward");
  const bool copy = stages_by_channel(grad_out, path_for(grad_out, kh, kw, true)) ||
                    stages_by_channel(x, path_for(x, kh, kw, false));
  const at::Tensor g = copy ? to_nchw(grad_out) : grad_out;
  fwd(g, w, c10::nullopt, dx, ph, pw, true);
  return wgrad(g, x, kh, kw, ph, pw);
}

// The path's name, for the tests that must know which kernels a case exercises.
std::string path_name(const at::Tensor& x, int64_t kh, int64_t kw, bool forward) {
  switch (path_for(x, kh, kw, forward)) {
    case Path::map_tc: return "map_tc";
    case Path::small: return "small";
    case Path::strip: return "strip";
    default: return "tiled";
  }
}

}  // namespace
}  // namespace lkcnn

void bind_dwconv(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("fwd", &lkcnn::fwd, "y = dwconv(x, w) + bias, written into y; with flip, the correlation with the flipped "
        "kernel (the input gradient)", py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("y"), py::arg("ph"),
        py::arg("pw"), py::arg("flip"));
  m.def("wgrad", &lkcnn::wgrad, "the weight gradient (C, 1, kh, kw) in x's dtype", py::arg("grad_out"),
        py::arg("x"), py::arg("kh"), py::arg("kw"), py::arg("ph"), py::arg("pw"));
  m.def("bwd", &lkcnn::bwd, "both gradients: the input gradient written into dx, the weight gradient returned; "
        "grad_out's NCHW copy is shared by the two passes", py::arg("grad_out"), py::arg("x"), py::arg("w"),
        py::arg("dx"), py::arg("ph"), py::arg("pw"));
  m.def("to_nchw", &lkcnn::to_nchw, "an NCHW copy of a channels_last tensor through the tiled transpose (the tensor "
        "itself when it is NCHW already)", py::arg("t"));
  m.def("supported", &lkcnn::wgrad_supported, "whether maps of width W with a kh x kw kernel fit the kernels' tiles",
        py::arg("W"), py::arg("kh"), py::arg("kw"));
  m.def("branches_supported", &lkcnn::branches_supported, "whether dwconv_branches.cu's kernels take x "
        "(channels_last, C a multiple of 16 bytes) with branches of ks x ks taps at dilations rs", py::arg("x"),
        py::arg("ks"), py::arg("rs"));
  m.def("branches_fwd", &lkcnn::branches_fwd, "every branch's output of x, written into ys", py::arg("x"),
        py::arg("w"), py::arg("ks"), py::arg("rs"), py::arg("ys"));
  m.def("branches_bwd_input", &lkcnn::branches_bwd_input, "the input gradient summed over the branches, written "
        "into dx", py::arg("grad_outs"), py::arg("w"), py::arg("ks"), py::arg("rs"), py::arg("dx"));
  m.def("branches_wgrad", &lkcnn::branches_wgrad, "every (dilated) branch's weight gradient as one fp32 (taps, C) "
        "table", py::arg("grad_outs"), py::arg("x"), py::arg("ks"), py::arg("rs"));
  m.def("path", &lkcnn::path_name, "which kernels run the forward (or the weight gradient) of x (N, C, H, W) with a "
        "kh x kw kernel: 'map_tc' (whole-map tensor-core), 'small' (whole-map FMA), 'strip' or 'tiled'", py::arg("x"),
        py::arg("kh"), py::arg("kw"), py::arg("forward") = true);
}
