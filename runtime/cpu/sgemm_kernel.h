// f32 products on Tessera's own kernel (blas.cpp's sgemm runs it where the
// kernels' AVX2 or AVX-512 copy runs and it measured faster than the
// libraries: cpu::sgemm_on_own_kernel).
//
// Why not the libraries': oneDNN and OpenBLAS each run on one thread, on the
// tiles of a grid fixed by the shape (so that threads never change a result),
// and each tile packs its operands again: a weight gradient of 3072 x 768
// over 2048 rows packs its A panels 3 times and its B panels 12 times, and
// measured 0.72-0.79 of OpenBLAS called on the whole product
// (benchmarks/README.md). Here B is packed once per product and A a row
// block at a time by the thread whose tiles read it (blas.cpp's
// gemm_on_own), and every tile reads the packed panels.
//
// The layouts (MR x NR results per call of the micro-kernel: 14 x 32 with
// AVX-512, 6 x 16 with AVX2), in blocks of KC = 256 steps of k:
//   A: panels of MR rows: [k blocks][m panels][KC][MR];
//   B: panels of NR columns: [k blocks][n panels][KC][NR];
// zeros past m and n (the last block is as deep as what is left of k). A
// tile's panels of one block are one run of memory, which the micro-kernel
// reads in order: its B panel (KC x NR, 32 KB) stays in L1 while the tile's
// A panels stream past it. Each result is one chain of fused multiply-adds over
// k in order from 0, then alpha * sum (+ beta * C, one more fused
// multiply-add): the same operations in both copies, in any tile, at any
// thread count, so a result depends on its row of A, its column of B and
// alpha and beta alone (not on m, n, the grid, the threads or the copy).
//
// bf16 operands (where oneDNN has no bf16 kernels for the CPU: blas.cpp's
// bf16gemm) are widened to f32 as they are packed, and a bf16 C is rounded
// as each tile is stored: the f32 product of the widened operands, rounded
// once, with no f32 copy of an operand or of C.
#pragma once

#include <cstdint>

#include "runtime/dtype.h"

namespace tessera::cpu {

#define TS_SGEMM_KERNEL_DECLARATIONS                                                                       \
  int64_t sgemm_mr();                                                                                     \
  int64_t sgemm_nr();                                                                                     \
  int64_t sgemm_kc(); /* k per block: a piece starts on one */                                             \
  /* Packs steps [s0, s1) of k of every panel of op(A) (m x k; stored k x m when transposed) into the */ \
  /* whole packed operand; so for op(B) (k x n). */                                                         \
  void sgemm_pack_a(bool trans, int64_t m, int64_t k, const float* a, int64_t lda, int64_t s0, int64_t s1,  \
                    float* packed);                                                                       \
  void sgemm_pack_b(bool trans, int64_t k, int64_t n, const float* b, int64_t ldb, int64_t s0, int64_t s1,  \
                    float* packed);                                                                       \
  /* The same from bf16 operands, widened as they are packed. */                                          \
  void sgemm_pack_a(bool trans, int64_t m, int64_t k, const BFloat16* a, int64_t lda, int64_t s0,          \
                    int64_t s1, float* packed);                                                           \
  void sgemm_pack_b(bool trans, int64_t k, int64_t n, const BFloat16* b, int64_t ldb, int64_t s0,          \
                    int64_t s1, float* packed);                                                           \
  /* C[rows, cols] = alpha * (sum over k0 .. k0 + depth) + beta * C for the tile whose first result is */  \
  /* row i0, column j0 of an m x n x k product (i0 a multiple of MR, j0 of NR, k0 of KC; c points at */     \
  /* the tile's first result). `partials`: sgemm_partials floats where the sums wait between blocks */    \
  /* of k (none for a tile one block deep). One thread. */                                                 \
  void sgemm_multiply(int64_t m, int64_t n, int64_t k, const float* packed_a, const float* packed_b,        \
                      int64_t i0, int64_t rows, int64_t j0, int64_t cols, int64_t k0, int64_t depth, float alpha, \
                      float beta, float* c, int64_t ldc, float* partials);                                \
  /* The same into a bf16 C: each result rounded once as it is stored (beta's C widened). */              \
  void sgemm_multiply(int64_t m, int64_t n, int64_t k, const float* packed_a, const float* packed_b,        \
                      int64_t i0, int64_t rows, int64_t j0, int64_t cols, int64_t k0, int64_t depth, float alpha, \
                      float beta, BFloat16* c, int64_t ldc, float* partials);                             \
  int64_t sgemm_partials(int64_t rows, int64_t cols, int64_t depth);

#if defined(TESSERA_CPU_ISA_VARIANTS)
namespace avx2 {
TS_SGEMM_KERNEL_DECLARATIONS
}
namespace avx512 {
TS_SGEMM_KERNEL_DECLARATIONS
}
#endif
#undef TS_SGEMM_KERNEL_DECLARATIONS

}  // namespace tessera::cpu
