// bf16 products on AMX's tiles, Tessera's own kernel (blas.cpp's bf16gemm
// runs it where the CPU has AMX, Linux grants the tile state and C is wider
// than one tile of its grid: cpu::bf16_on_amx).
//
// Why not oneDNN's: oneDNN 2.6 (Debian 12) runs its AMX kernel (brgemm) only
// on dense destinations, so the tiles of a wider C, which keep results
// thread-count-independent, fell to its older kernel (0.14-0.24 of AMX's
// measured peak; this one 1.24-1.72x that, benchmarks/README.md). Where a
// tile spans C's whole width brgemm runs, and measured faster than this.
//
// The operands are packed once per product, each element copied once, into
// the tiles' layouts (the packing costs one pass over A and B, against
// 2 m n k FLOPs):
//   A: panels of 32 rows (two tiles), each a run of k blocks of 32:
//      [m panels][k blocks][2 tiles][16 rows][32 k], 1024 elements a block;
//   B: panels of 32 columns (two tiles), each a run of k blocks, each tile
//      16 rows of 16 column pairs (tdpbf16ps's pairs along k):
//      [n panels][k blocks][2 tiles][16 k pairs][16 columns][2], 1024 a block.
// Past m, n or k the panels hold zeros, which add nothing.
// A block of 32 x 32 results is four accumulator tiles fed by two A tiles and
// two B tiles per k block, k in chunks of 8 blocks (an A panel's chunk, 16 KB,
// stays in L1 across the piece's B panels; the sums wait in f32 between
// chunks); its sums run over k in block order, each block's 32 products as
// tdpbf16ps adds them, so a result depends on the shape alone.
#pragma once

#include <cstdint>

#include "runtime/dtype.h"

namespace tessera::cpu::amx {

constexpr int64_t kPanel = 32;  // rows of an A panel, columns of a B panel
constexpr int64_t kBlock = 32;  // k per block
constexpr int64_t kBlockElements = kPanel * kBlock;

// Whether the kernel runs here: the CPU has AMX-BF16 and the kernel grants
// this process the tile state.
bool usable();

int64_t panels(int64_t size);  // ceil(size / kPanel)
int64_t blocks(int64_t k);     // ceil(k / kBlock)
// Elements of a packed operand: op(A) is m x k, op(B) is k x n.
int64_t packed_a_elements(int64_t m, int64_t k);
int64_t packed_b_elements(int64_t k, int64_t n);

// Packs panels [p0, p1) of op(A) (m x k; stored k x m when transposed) and of
// op(B) to `packed`, where panel p0 starts.
void pack_a(bool trans, int64_t m, int64_t k, const BFloat16* a, int64_t lda, int64_t p0,
            int64_t p1, BFloat16* packed);
void pack_b(bool trans, int64_t k, int64_t n, const BFloat16* b, int64_t ldb, int64_t p0,
            int64_t p1, BFloat16* packed);

// Where results go: element (i, j) of the product at c[i * ldc + j], in f32
// or bf16 (rounded once, to nearest even).
struct Out {
  void* c;
  int64_t ldc;
  bool f32;
};

// C[rows, cols] = alpha * sum over k blocks [kb0, kb1) of A B + beta * C for
// A panels [ip0, ip1) and B panels [jp0, jp1) of packed operands (whole) of
// a product of m x n x k; `out` points at the piece's first result, row ip0 * kPanel and
// column jp0 * kPanel of the product. Runs on the calling thread.
void multiply(int64_t m, int64_t n, int64_t k, const BFloat16* packed_a, const BFloat16* packed_b,
              int64_t ip0, int64_t ip1, int64_t jp0, int64_t jp1, int64_t kb0, int64_t kb1,
              float alpha, float beta, Out out);

}  // namespace tessera::cpu::amx
