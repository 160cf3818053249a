// cuBLASLt's FP8 GEMM with its fused epilogue: the FP8 path of lkcnn.gemm8 (lkcnn/ops/gemm8.py).
//
// Why our own call: torch._scaled_mm reaches the same cuBLASLt kernels but passes a bias at most, so a folded
// BatchNorm's scale, the activation and the residual addition after a 1x1 convolution were passes of their own over
// the GEMM's output. Here
//   - the output channel's scale (operand scales times BatchNorm scale) is the A operand's outer-vector scale
//     (per-channel FP8 scaling; cuBLASLt wants A and B both in that mode, so B's vector is all ones),
//   - the channel's shift is the epilogue's bias, the activation its RELU or GELU (cuBLASLt's GELU is the tanh form),
//   - the residual is cuBLASLt's C operand with beta = 1 (added before the activation, so with act = none only).
// Row-major operands map onto cuBLASLt's column-major ones as D^T (n x m) = W (n x k, A transposed) . a^T (k x m),
// the TN layout FP8 kernels take. Under outer-vector scaling cuBLASLt writes 16- or 32-bit outputs, never FP8.
#include "gemm8_lt.h"

#include <cstdint>
#include <mutex>
#include <unordered_map>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>

namespace lkcnn {
namespace {

#define LT_CHECK(expr)                                                                                            \
  do {                                                                                                            \
    cublasStatus_t status_ = (expr);                                                                              \
    TORCH_CHECK(status_ == CUBLAS_STATUS_SUCCESS, "lkcnn.gemm8 (cuBLASLt): ", #expr, " failed: ",                 \
                cublasLtGetStatusString(status_));                                                                \
  } while (0)

constexpr int64_t kActs = 3;  // none, relu, gelu: lkcnn.ops.gemm8's order

cudaDataType_t cuda_type(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return CUDA_R_16BF;
    case at::kHalf: return CUDA_R_16F;
    case at::kFloat: return CUDA_R_32F;
    case at::kFloat8_e4m3fn: return CUDA_R_8F_E4M3;
    default: TORCH_CHECK(false, "lkcnn.gemm8 (cuBLASLt): no cuBLASLt type for ", t);
  }
}

cublasLtEpilogue_t epilogue(int64_t act, bool bias) {
  static const cublasLtEpilogue_t table[kActs][2] = {{CUBLASLT_EPILOGUE_DEFAULT, CUBLASLT_EPILOGUE_BIAS},
                                                     {CUBLASLT_EPILOGUE_RELU, CUBLASLT_EPILOGUE_RELU_BIAS},
                                                     {CUBLASLT_EPILOGUE_GELU, CUBLASLT_EPILOGUE_GELU_BIAS}};
  TORCH_CHECK(act >= 0 && act < kActs, "lkcnn.gemm8 (cuBLASLt): act must be 0 (none), 1 (relu) or 2 (gelu)");
  return table[act][bias ? 1 : 0];
}

uint32_t alignment(const void* ptr) {  // the largest power of two up to 256 that divides the address
  uint32_t align = 256;
  while (align > 1 && reinterpret_cast<uintptr_t>(ptr) % align) align /= 2;
  return align;
}

// Everything cuBLASLt's choice of kernel depends on.
struct Problem {
  int64_t m, n, k, act;
  int bias_type;  // cudaDataType_t, or -1 without a bias
  bool residual;
  int out_type;
  int device;
  uint32_t align_a, align_b, align_cd;

  bool operator==(const Problem& o) const {
    return m == o.m && n == o.n && k == o.k && act == o.act && bias_type == o.bias_type && residual == o.residual &&
           out_type == o.out_type && device == o.device && align_a == o.align_a && align_b == o.align_b &&
           align_cd == o.align_cd;
  }
};

struct ProblemHash {
  size_t operator()(const Problem& p) const {
    size_t h = 0;
    for (int64_t v : {p.m, p.n, p.k, p.act, int64_t(p.bias_type), int64_t(p.residual), int64_t(p.out_type),
                      int64_t(p.device), int64_t(p.align_a), int64_t(p.align_b), int64_t(p.align_cd)}) {
      h = h * 1000003u ^ std::hash<int64_t>()(v);
    }
    return h;
  }
};

// The descriptors of one call. cuBLASLt's heuristic offers no kernel for vector scales until their pointers are set.
class Descriptors {
 public:
  Descriptors(const Problem& p, const void* alpha, const void* ones, const void* bias) {
    LT_CHECK(cublasLtMatmulDescCreate(&op_, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    set(CUBLASLT_MATMUL_DESC_TRANSA, int32_t(CUBLAS_OP_T));
    set(CUBLASLT_MATMUL_DESC_TRANSB, int32_t(CUBLAS_OP_N));
    set(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, int32_t(CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F));
    set(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, int32_t(CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F));
    set(CUBLASLT_MATMUL_DESC_FAST_ACCUM, int8_t(0));  // Hopper's fast FP8 accumulation keeps ~14 mantissa bits
    set(CUBLASLT_MATMUL_DESC_EPILOGUE, uint32_t(epilogue(p.act, p.bias_type >= 0)));
    set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, alpha);
    set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, ones);
    if (p.bias_type >= 0) {
      set(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, int32_t(p.bias_type));
      set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias);
    }
    const auto out = static_cast<cudaDataType_t>(p.out_type);
    LT_CHECK(cublasLtMatrixLayoutCreate(&a_, CUDA_R_8F_E4M3, p.k, p.n, p.k));  // w: (n, k) row-major
    LT_CHECK(cublasLtMatrixLayoutCreate(&b_, CUDA_R_8F_E4M3, p.k, p.m, p.k));  // a: (m, k) row-major
    LT_CHECK(cublasLtMatrixLayoutCreate(&cd_, out, p.n, p.m, p.n));            // out, residual: (m, n) row-major
  }
  ~Descriptors() {
    if (cd_) cublasLtMatrixLayoutDestroy(cd_);
    if (b_) cublasLtMatrixLayoutDestroy(b_);
    if (a_) cublasLtMatrixLayoutDestroy(a_);
    if (op_) cublasLtMatmulDescDestroy(op_);
  }
  Descriptors(const Descriptors&) = delete;
  Descriptors& operator=(const Descriptors&) = delete;

  template <typename T>
  void set(cublasLtMatmulDescAttributes_t attribute, const T& value) {
    LT_CHECK(cublasLtMatmulDescSetAttribute(op_, attribute, &value, sizeof(value)));
  }

  cublasLtMatmulDesc_t op_ = nullptr;
  cublasLtMatrixLayout_t a_ = nullptr, b_ = nullptr, cd_ = nullptr;
};

// cuBLASLt's heuristic's first kernel for `p` (described by `d`), or none; asked once per problem.
std::optional<cublasLtMatmulAlgo_t> choose(const Problem& p, const Descriptors& d) {
  static std::mutex mutex;
  static std::unordered_map<Problem, std::optional<cublasLtMatmulAlgo_t>, ProblemHash> chosen;
  std::lock_guard<std::mutex> lock(mutex);
  auto found = chosen.find(p);
  if (found != chosen.end()) return found->second;
  cublasLtMatmulPreference_t pref = nullptr;
  LT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t workspace = at::cuda::getCUDABlasLtWorkspaceSize();
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof(workspace));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &p.align_a, sizeof(uint32_t));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &p.align_b, sizeof(uint32_t));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &p.align_cd, sizeof(uint32_t));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &p.align_cd, sizeof(uint32_t));
  cublasLtMatmulHeuristicResult_t result{};
  int count = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(at::cuda::getCurrentCUDABlasLtHandle(), d.op_, d.a_,
                                                               d.b_, d.cd_, d.cd_, pref, 1, &result, &count);
  cublasLtMatmulPreferenceDestroy(pref);
  std::optional<cublasLtMatmulAlgo_t> algo;
  if (status == CUBLAS_STATUS_SUCCESS && count > 0) algo = result.algo;
  chosen.emplace(p, algo);
  return algo;
}

}  // namespace

bool gemm_fp8_lt_supported(int64_t m, int64_t n, int64_t k, int64_t act, std::optional<at::ScalarType> bias_dtype,
                           bool residual, at::ScalarType out_dtype) {
  const Problem p{m, n, k, act, bias_dtype ? int(cuda_type(*bias_dtype)) : -1, residual, int(cuda_type(out_dtype)),
                  c10::cuda::current_device(), 256, 256, 256};
  const auto floats = at::TensorOptions().device(at::kCUDA).dtype(at::kFloat);
  const at::Tensor alpha = at::empty({n}, floats), ones = at::empty({m}, floats);
  const at::Tensor bias = at::empty({n}, floats.dtype(bias_dtype.value_or(at::kFloat)));
  const Descriptors d(p, alpha.data_ptr(), ones.data_ptr(), bias_dtype ? bias.data_ptr() : nullptr);
  return choose(p, d).has_value();
}

void gemm_fp8_lt(const at::Tensor& a, const at::Tensor& w, const at::Tensor& alpha, const at::Tensor& ones,
                 const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual, int64_t act,
                 at::Tensor& out) {
  const int64_t m = a.size(0), k = a.size(1), n = w.size(0);
  TORCH_CHECK(a.is_cuda() && a.dim() == 2 && a.is_contiguous() && a.scalar_type() == at::kFloat8_e4m3fn,
              "lkcnn.gemm8 (cuBLASLt): a must be a contiguous (m, k) float8_e4m3fn CUDA tensor");
  TORCH_CHECK(w.dim() == 2 && w.size(1) == k && w.is_contiguous() && w.scalar_type() == at::kFloat8_e4m3fn,
              "lkcnn.gemm8 (cuBLASLt): w must be a contiguous (n, k) float8_e4m3fn tensor");
  TORCH_CHECK(alpha.numel() == n && alpha.is_contiguous() && alpha.scalar_type() == at::kFloat,
              "lkcnn.gemm8 (cuBLASLt): alpha must be n contiguous float32 values");
  TORCH_CHECK(ones.numel() >= m && ones.is_contiguous() && ones.scalar_type() == at::kFloat,
              "lkcnn.gemm8 (cuBLASLt): ones must hold at least m float32 ones");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m && out.size(1) == n && out.is_contiguous(),
              "lkcnn.gemm8 (cuBLASLt): out must be a contiguous (m, n) tensor");
  TORCH_CHECK(!(residual && act != 0), "lkcnn.gemm8 (cuBLASLt): a residual is added before the activation");
  if (bias) TORCH_CHECK(bias->numel() == n && bias->is_contiguous(), "lkcnn.gemm8 (cuBLASLt): bias must be n values");
  if (residual) {
    TORCH_CHECK(residual->sizes() == out.sizes() && residual->is_contiguous() &&
                    residual->scalar_type() == out.scalar_type(),
                "lkcnn.gemm8 (cuBLASLt): residual must be a contiguous (m, n) tensor of out's dtype");
  }
  const c10::cuda::CUDAGuard guard(a.device());
  const void* c = residual ? residual->data_ptr() : out.data_ptr();
  const Problem p{m, n, k, act, bias ? int(cuda_type(bias->scalar_type())) : -1, residual.has_value(),
                  int(cuda_type(out.scalar_type())), a.get_device(), alignment(w.data_ptr()), alignment(a.data_ptr()),
                  std::min(alignment(c), alignment(out.data_ptr()))};
  const Descriptors d(p, alpha.data_ptr(), ones.data_ptr(), bias ? bias->data_ptr() : nullptr);
  const std::optional<cublasLtMatmulAlgo_t> algo = choose(p, d);
  TORCH_CHECK(algo, "lkcnn.gemm8 (cuBLASLt): no FP8 kernel for (", m, ", ", k, ") x (", k, ", ", n, ") with act ", act,
              residual ? " and a residual" : "", " into ", out.scalar_type());
  const float one = 1.0f, beta = residual ? 1.0f : 0.0f;
  LT_CHECK(cublasLtMatmul(at::cuda::getCurrentCUDABlasLtHandle(), d.op_, &one, w.data_ptr(), d.a_, a.data_ptr(), d.b_,
                          &beta, c, d.cd_, out.data_ptr(), d.cd_, &*algo, at::cuda::getCUDABlasLtWorkspace(),
                          at::cuda::getCUDABlasLtWorkspaceSize(), at::cuda::getCurrentCUDAStream()));
}

}  // namespace lkcnn
