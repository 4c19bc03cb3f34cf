// The CPU's typed GEMMs (blas.cpp), for kernels that multiply blocks of their
// own (attention) as well as for the table's gemm entry. Row-major
// C = alpha * op(A) op(B) + beta * C. sgemm's and bf16gemm's results depend on
// the shape and the CPU, never on the number of threads; inside an OpenMP
// parallel region each call runs on the calling thread alone.
#pragma once

#include <cstdint>

#include "runtime/dtype.h"

namespace tessera::cpu {

// Which kernel runs f32 products (blas.cpp says why): Auto is the measured
// choice for this CPU and the product's class (Tessera's own kernel,
// runtime/cpu/sgemm_kernel.h, for weight gradients with AVX-512 and large
// products of any kind with AVX2 alone; else a library); the others force one, for tests and benchmarks (Own throws where
// the active copy has no kernel: baseline).
enum class SgemmPath { Auto, OneDnn, OpenBlas, Own };
SgemmPath set_sgemm_path(SgemmPath path);  // returns the previous one
// Whether sgemm runs a product of this shape on the own kernel now, and
// whether the kernel can run here (the active copy is AVX2 or AVX-512).
bool sgemm_on_own_kernel(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k);
bool sgemm_own_kernel_here();

void sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
           int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
// bf16 operands and result, products accumulated in f32 and rounded once.
// Where bf16_gemm_native(): oneDNN has bf16 kernels for this CPU
// (AVX512-BF16 or AMX, and TESSERA_CPU_ISA allows AVX-512). Where the AVX2
// copy runs instead (bf16_on_own_kernel(); or forced: Bf16Path::Own), on the
// own f32 kernel, the operands widened as they are packed and
// each result rounded as it is stored: bit for bit the f32 product of the
// widened operands on the own kernel, rounded once, with no f32 copy of an
// operand or of C. It throws elsewhere (the baseline copy, and AVX-512
// without AVX512-BF16: products there run on f32 copies, cpu::compute_dtype).
void bf16gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const BFloat16* a,
              int64_t lda, const BFloat16* b, int64_t ldb, float beta, BFloat16* c, int64_t ldc);
bool bf16_gemm_native();
// Whether bf16 products run on the own f32 kernel now: where oneDNN has no
// bf16 kernels and the active copy is AVX2, or Bf16Path::Own forced (AVX2 or
// AVX-512 copy).
bool bf16_on_own_kernel();
// Which kernel runs a bf16 product: oneDNN's pieces, Tessera's AMX kernel,
// or the own f32 kernel on widened operands; bf16_kernel is this CPU's
// choice for a shape (by the shape and the CPU alone).
enum class Bf16Kernel { Library, Amx, Own };
Bf16Kernel bf16_kernel(int64_t m, int64_t n, int64_t k);
// Whether those kernels are oneDNN's AMX tile kernels (else AVX512-BF16's dot products).
bool bf16_gemm_amx();
// Which kernel runs bf16 products where oneDNN has bf16 kernels: Auto is
// Tessera's own AMX kernel (runtime/cpu/amx.h) where oneDNN's kernels would
// use AMX, Linux grants the tiles and the product is wider than one of the
// grid's tiles of C (where it is not, oneDNN's own AMX kernel runs and
// measured faster), else oneDNN's; the others force one, for tests and
// benchmarks (Amx throws where the tiles cannot run, Own where the own f32
// kernel cannot: baseline). Where oneDNN has none, the AVX2 copy runs the own
// f32 kernel whatever the path (bf16_on_own_kernel). The choice depends on
// the shape and the CPU alone.
enum class Bf16Path { Auto, OneDnn, Amx, Own };
Bf16Path set_bf16_path(Bf16Path path);  // returns the previous one
// Whether bf16gemm runs a product of this shape on the AMX kernel now.
bool bf16_on_amx(int64_t m, int64_t n, int64_t k);
// Whether Auto gives a product of this shape the AMX kernel on a CPU where
// it can run (C wider than a tile of the grid); and whether it can run here.
bool amx_kernel_takes(int64_t m, int64_t n, int64_t k);
bool amx_kernel_here();
// What sgemm or bf16gemm takes from the allocator for a product of this
// shape, held together for the product's length: f32 partial products when it
// cuts k into chunks, bf16 packed operands when it runs on the AMX kernel,
// and f32 packed operands with their waiting sums on the own kernel (0 when
// none); `bf16` says which kernel a bf16 product runs on (bf16_kernel here,
// or as a planned CPU would). A planned step (runtime/kernel_log.h) counts
// them as a run does.
struct GemmScratch {
  int64_t f32_parts = 0, bf16_packed = 0, f32_packed = 0;
};
GemmScratch gemm_scratch(DType dtype, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, Bf16Kernel bf16);
void dgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha,
           const double* a, int64_t lda, const double* b, int64_t ldb, double beta, double* c,
           int64_t ldc);

}  // namespace tessera::cpu
