// Python binding of the cuBLASLt FP8 GEMM (registered by csrc/extension.cpp).
#include <torch/extension.h>

#include "gemm8_lt.h"

void bind_gemm8(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("gemm_fp8_lt", &lkcnn::gemm_fp8_lt,
        "out = act(alpha[n] * (a @ w^T) + bias[n]) + residual on cuBLASLt's FP8 kernels with its epilogue",
        py::arg("a"), py::arg("w"), py::arg("alpha"), py::arg("ones"), py::arg("bias"), py::arg("residual"),
        py::arg("act"), py::arg("out"));
  m.def("gemm_fp8_lt_supported", &lkcnn::gemm_fp8_lt_supported,
        "whether cuBLASLt has an FP8 kernel for (m, n, k) with this epilogue and output", py::arg("m"), py::arg("n"),
        py::arg("k"), py::arg("act"), py::arg("bias_dtype"), py::arg("residual"), py::arg("out_dtype"));
}
