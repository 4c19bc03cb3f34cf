// GEMM on CUDA through cuBLASLt: f32 (TF32 only when asked), f64, and bf16/f16
// with f32 accumulation. A plan (descriptors, layouts and the heuristic's
// algorithm) is made once per shape and operand alignment (gemm_plan.h) and
// cached, so a training step creates none. Each stream has its own workspace:
// two streams never share scratch memory while both run.
#include <atomic>
#include <map>
#include <mutex>

#include "runtime/cuda/common.h"
#include "runtime/cuda/gemm_plan.h"
#include "runtime/cuda_backend.h"

namespace tessera::cuda {

namespace {

std::atomic<bool> allow_tf32{false};

constexpr size_t kWorkspace = size_t{32} << 20;

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

cudaDataType_t data_type(DType dt) {
  switch (dt) {
    case DType::F32: return CUDA_R_32F;
    case DType::F64: return CUDA_R_64F;
    case DType::BF16: return CUDA_R_16BF;
    case DType::F16: return CUDA_R_16F;
    default: TS_CHECK(false, "gemm: no CUDA GEMM for {}", dtype_name(dt));
  }
}

// Column-major C'[M, N] = op(A')[M, K] op(B')[K, N]: the row-major product
// with A and B swapped (C^T = op(B)^T op(A)^T).
Plan make_plan(const GemmKey& key) {
  const DType dt = key.dtype;
  const bool ta = key.trans_a, tb = key.trans_b, tf32 = key.tf32;
  const int64_t m = key.m, n = key.n, k = key.k, lda = key.lda, ldb = key.ldb, ldc = key.ldc;
  Plan p;
  cudaDataType_t type = data_type(dt);
  cublasComputeType_t compute = dt == DType::F64 ? CUBLAS_COMPUTE_64F
                                : (dt == DType::F32 && tf32) ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                             : CUBLAS_COMPUTE_32F;
  cudaDataType_t scale = dt == DType::F64 ? CUDA_R_64F : CUDA_R_32F;
  TS_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, compute, scale));
  cublasOperation_t op_a = tb ? CUBLAS_OP_T : CUBLAS_OP_N;  // A' is B
  cublasOperation_t op_b = ta ? CUBLAS_OP_T : CUBLAS_OP_N;  // B' is A
  TS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  TS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  const int64_t M = n, N = m, K = k;
  TS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, type, tb ? K : M, tb ? M : K, ldb));
  TS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, type, ta ? N : K, ta ? K : N, lda));
  TS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, type, M, N, ldc));
  cublasLtMatmulPreference_t pref = nullptr;
  TS_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  size_t ws = kWorkspace;
  TS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  // A' is B and B' is A (the swap above); C and D are one buffer.
  const uint32_t align_a = static_cast<uint32_t>(key.align_b), align_b = static_cast<uint32_t>(key.align_a),
                 align_c = static_cast<uint32_t>(key.align_c);
  TS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, sizeof(align_a)));
  TS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, sizeof(align_b)));
  TS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c, sizeof(align_c)));
  TS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c, sizeof(align_c)));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(cublaslt_handle(), p.desc, p.a, p.b, p.c, p.c, pref, 1,
                                                     &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  TS_CUBLAS_CHECK(st);
  TS_CHECK(found > 0, "gemm: cuBLASLt has no algorithm for {} [{}x{}] x [{}x{}] with operands aligned to {}, {} and {} bytes",
           dtype_name(dt), m, k, k, n, key.align_a, key.align_b, key.align_c);
  p.algo = result.algo;
  return p;
}

// The workspace of `stream` (made on its first GEMM, kept for the process:
// a destroyed stream's handle may come back for a new stream, which then
// inherits it, after ~CudaStream waited for the old stream's work).
void* workspace(cudaStream_t stream) {
  static std::mutex mu;
  static auto* spaces = new std::map<cudaStream_t, void*>;
  std::lock_guard<std::mutex> lk(mu);
  void*& ws = (*spaces)[stream];
  if (ws == nullptr) TS_CUDA_CHECK(cudaMalloc(&ws, kWorkspace));
  return ws;
}

}  // namespace

void set_allow_tf32(bool allow) { allow_tf32.store(allow); }
bool tf32_allowed() { return allow_tf32.load(); }

void gemm(DType dtype, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha,
          const void* a, int64_t lda, const void* b, int64_t ldb, double beta, void* c, int64_t ldc) {
  static std::mutex mu;
  static auto* plans = new std::map<GemmKey, Plan>;
  const GemmKey key = gemm_key(dtype, trans_a, trans_b, m, n, k, a, lda, b, ldb, c, ldc, allow_tf32.load());
  const Plan* plan;
  {
    std::lock_guard<std::mutex> lk(mu);
    auto it = plans->find(key);
    if (it == plans->end()) it = plans->emplace(key, make_plan(key)).first;
    plan = &it->second;
  }
  cudaStream_t stream = current_raw_stream();
  float fa = static_cast<float>(alpha), fb = static_cast<float>(beta);
  const void* pa = dtype == DType::F64 ? static_cast<const void*>(&alpha) : &fa;
  const void* pb = dtype == DType::F64 ? static_cast<const void*>(&beta) : &fb;
  TS_CUBLAS_CHECK(cublasLtMatmul(cublaslt_handle(), plan->desc, pa, b, plan->a, a, plan->b, pb, c, plan->c, c,
                                 plan->c, &plan->algo, workspace(stream), kWorkspace, stream));
}

}  // namespace tessera::cuda
