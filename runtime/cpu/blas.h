// The CPU's typed GEMMs (blas.cpp), for kernels that multiply blocks of their
// own (attention) as well as for the table's gemm entry. Row-major
// C = alpha * op(A) op(B) + beta * C. sgemm's and bf16gemm's results depend on
// the shape and the CPU, never on the number of threads; inside an OpenMP
// parallel region each call runs on the calling thread alone.
#pragma once

#include <cstdint>

#include "runtime/dtype.h"

namespace tessera::cpu {

// Which library runs f32 products (blas.cpp says why): Auto is the measured
// choice for this CPU; the others force one, for tests and benchmarks.
enum class SgemmPath { Auto, OneDnn, OpenBlas };
SgemmPath set_sgemm_path(SgemmPath path);  // returns the previous one

void sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
           int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
// bf16 operands and result, products accumulated in f32 and rounded once.
// Only where bf16_gemm_native(): oneDNN has bf16 kernels for this CPU
// (AVX512-BF16 or AMX, and TESSERA_CPU_ISA allows AVX-512); it throws elsewhere.
void bf16gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const BFloat16* a,
              int64_t lda, const BFloat16* b, int64_t ldb, float beta, BFloat16* c, int64_t ldc);
bool bf16_gemm_native();
// Whether those kernels are oneDNN's AMX tile kernels (else AVX512-BF16's dot products).
bool bf16_gemm_amx();
// The f32 elements sgemm or bf16gemm takes from the allocator for a product
// of this shape (partial products when it cuts k into chunks; 0 when it does
// not): a planned step (runtime/kernel_log.h) counts them as a run does.
int64_t gemm_scratch_elements(int64_t m, int64_t n, int64_t k);
void dgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha,
           const double* a, int64_t lda, const double* b, int64_t ldb, double beta, double* c,
           int64_t ldc);

}  // namespace tessera::cpu
