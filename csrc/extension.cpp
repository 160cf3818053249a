// The one Python extension of lkcnn: each op family registers its own functions (csrc/<family>/*_bindings.cpp).
#include <torch/extension.h>

void bind_dwconv(pybind11::module_& m);
void bind_sync_bn(pybind11::module_& m);
void bind_gemm8(pybind11::module_& m);
void bind_dwconv8(pybind11::module_& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lkcnn's CUDA kernels: large-kernel depthwise convolution (dwconv) synchronized BatchNorm (sync_bn) and cuBLASLt FP8 GEMMs with fused epilogues (gemm8), 8-bit depthwise convolution for inference (dwconv8)";
  bind_dwconv(m);
  bind_sync_bn(m);
  bind_gemm8(m);
  bind_dwconv8(m);
}
