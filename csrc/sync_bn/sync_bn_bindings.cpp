// Python binding of the synchronized BatchNorm and its NVLink exchanges (registered by csrc/extension.cpp).
#include <torch/extension.h>

#include "sync_batchnorm.h"
#include "sync_exchange.h"

void bind_sync_bn(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("sync_batch_norm", &lkcnn::sync_batch_norm,
        "training-mode BatchNorm with batch statistics over a process group (autograd-aware)", py::arg("input"),
        py::arg("weight"), py::arg("bias"), py::arg("running_mean"), py::arg("running_var"), py::arg("eps"),
        py::arg("momentum"), py::arg("group_name"));
  m.def("exchange_workspace_bytes", &lkcnn::exchange_workspace_bytes,
        "bytes of the symmetric-memory workspace each of `world` ranks allocates for the exchanges", py::arg("world"));
  m.def("exchange_max_values", &lkcnn::exchange_max_values, "the most values exchange_sum takes");
  m.def("exchange_max_channels", &lkcnn::exchange_max_channels, "the most channels exchange_batch_norm_stats takes");
  m.def("exchange_status_word", &lkcnn::exchange_status_word,
        "a one-word int64 CPU tensor in mapped host memory, 0, where the exchanges record their first failure");
  // without the GIL: a launch can block on a full queue behind a waiting exchange, and the host's watchdog thread
  // (lkcnn/training/sync_batchnorm.py) must still run
  m.def("exchange_sum", &lkcnn::exchange_sum, "out = the sum over the ranks of input, through the workspaces `peers`; "
        "each wait gives up after timeout_s, recording the failure in the word at `status`", py::arg("input"),
        py::arg("out"), py::arg("peers"), py::arg("rank"), py::arg("status"), py::arg("timeout_s"),
        py::call_guard<py::gil_scoped_release>());
  m.def("exchange_batch_norm_stats", &lkcnn::exchange_batch_norm_stats,
        "the ranks' batch statistics combined (mean_out, invstd_out) and the running statistics updated; failures "
        "as exchange_sum's", py::arg("mean"), py::arg("var"), py::arg("running_mean"), py::arg("running_var"),
        py::arg("mean_out"), py::arg("invstd_out"), py::arg("momentum"), py::arg("eps"), py::arg("count"),
        py::arg("peers"), py::arg("rank"), py::arg("status"), py::arg("timeout_s"),
        py::call_guard<py::gil_scoped_release>());
}
