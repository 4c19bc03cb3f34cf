// Matrix products on the CPU go to OpenBLAS (row-major cblas).
#include <cblas.h>

#include "runtime/kernels.h"

namespace tessera::cpu {

void gemm(DType dtype, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha,
          const void* a, int64_t lda, const void* b, int64_t ldb, double beta, void* c,
          int64_t ldc) {
  if (m == 0 || n == 0) return;
  auto ta = trans_a ? CblasTrans : CblasNoTrans;
  auto tb = trans_b ? CblasTrans : CblasNoTrans;
  // BLAS rejects leading dimensions below 1 even when k == 0.
  lda = std::max<int64_t>(lda, 1);
  ldb = std::max<int64_t>(ldb, 1);
  if (dtype == DType::F32) {
    cblas_sgemm(CblasRowMajor, ta, tb, static_cast<blasint>(m), static_cast<blasint>(n),
                static_cast<blasint>(k), static_cast<float>(alpha), static_cast<const float*>(a),
                static_cast<blasint>(lda), static_cast<const float*>(b), static_cast<blasint>(ldb),
                static_cast<float>(beta), static_cast<float*>(c), static_cast<blasint>(ldc));
  } else if (dtype == DType::F64) {
    cblas_dgemm(CblasRowMajor, ta, tb, static_cast<blasint>(m), static_cast<blasint>(n),
                static_cast<blasint>(k), alpha, static_cast<const double*>(a),
                static_cast<blasint>(lda), static_cast<const double*>(b), static_cast<blasint>(ldb),
                beta, static_cast<double*>(c), static_cast<blasint>(ldc));
  } else {
    TS_CHECK(false, "gemm: expected f32 or f64, got {}", dtype_name(dtype));
  }
}

}  // namespace tessera::cpu
