// Python binding of the 8-bit depthwise convolution (registered by csrc/extension.cpp).
#include <torch/extension.h>

#include "dwconv8.h"

void bind_dwconv8(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("dwconv8_fwd", &lkcnn::dwconv8_fwd,
        "y = quant(act(alpha[c] * correlate(x, w) + beta[c])) of an 8-bit NCHW x on the tensor cores", py::arg("x"),
        py::arg("table"), py::arg("k"), py::arg("alpha"), py::arg("beta"), py::arg("act"), py::arg("out_scale"),
        py::arg("y"));
}
