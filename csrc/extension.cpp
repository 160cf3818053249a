// The one Python extension of lkcnn: each op family registers its own functions (csrc/<family>/*_bindings.cpp).
#include <torch/extension.h>

void bind_dwconv(pybind11::module_& m);
void bind_sync_bn(pybind11::module_& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lkcnn's CUDA kernels: large-kernel depthwise convolution (dwconv) and synchronized BatchNorm (sync_bn)";
  bind_dwconv(m);
  bind_sync_bn(m);
}
