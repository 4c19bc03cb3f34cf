// Matrix products on the CPU, row-major throughout. f32 has two libraries:
// - oneDNN's dnnl_sgemm picks its kernel from the CPU's features at run time.
//   With AVX-512 it runs at twice OpenBLAS 0.3.21, which is held to its AVX2
//   kernel on these EPYCs; without AVX-512 it is no faster on large products
//   (0.5-1.1x, and slow with a transposed A), but faster on small blocks such
//   as attention's 64 x 64 (measured 80 vs 57 GFLOP/s): benchmarks/bench_gemm.
// - OpenBLAS's sgemm, otherwise.
// So: where the kernels' avx512 copy runs (runtime/cpu/isa.h, which
// TESSERA_CPU_ISA caps), oneDNN for everything; otherwise oneDNN for products
// below kSerialFlops and OpenBLAS above. oneDNN has no f64 GEMM: f64 (the reference
// dtype) is OpenBLAS's cblas_dgemm, threaded as OpenBLAS likes.
//
// Threads never change a result. oneDNN's own threading splits the k
// dimension when it likes, so its results change with the number of threads
// (measured: 32x32x8192 differs in 923 of 1024 elements between 1 and 2
// threads), and so do OpenBLAS's on some shapes (32x32x8192 again). So
// either library only ever runs on one thread, on pieces of a grid that
// depends on the shape alone: tiles of C, and for products with few tiles and
// a deep k (weight gradients of small layers) fixed chunks of k whose partial
// products are summed in chunk order; the threads only decide who computes
// which piece. 1 thread and 4 give bitwise equal f32 steps (at another
// number of ranks the weight gradients sum their rows in other groups).
#include <cblas.h>
#include <omp.h>
#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <utility>

#include "runtime/cpu/blas.h"
#include "runtime/cpu/isa.h"
#include "runtime/kernels.h"
#include "runtime/parallel.h"
#include "runtime/profiler.h"

namespace tessera::cpu {

namespace {

// Row-major operands: op(A) is m x k, stored k x m when transposed.
void check_leading_dims(const char* name, bool trans_a, bool trans_b, int64_t m, int64_t n,
                        int64_t k, int64_t lda, int64_t ldb, int64_t ldc) {
  int64_t a_cols = trans_a ? m : k, b_cols = trans_b ? k : n;
  TS_CHECK(m >= 0 && n >= 0 && k >= 0 && lda >= a_cols && ldb >= b_cols && ldc >= n,
           "{}: expected leading dimensions lda >= {}, ldb >= {}, ldc >= {} for a {}x{}x{} product "
           "(transposed: {}, {}), got {}, {}, {}",
           name, a_cols, b_cols, n, m, n, k, trans_a, trans_b, lda, ldb, ldc);
}

std::atomic<SgemmPath> forced_path{SgemmPath::Auto};

// Both libraries size their teams by omp_get_max_threads() outside a parallel
// region (one thread inside one): this holds them to the calling thread.
class OneLibraryThread {
 public:
  OneLibraryThread() : saved_(omp_in_parallel() ? 1 : omp_get_max_threads()) {
    if (saved_ != 1) omp_set_num_threads(1);
  }
  ~OneLibraryThread() {
    if (saved_ != 1) omp_set_num_threads(saved_);
  }
  OneLibraryThread(const OneLibraryThread&) = delete;
  OneLibraryThread& operator=(const OneLibraryThread&) = delete;

 private:
  int saved_;
};

// One piece through OpenBLAS, on the calling thread alone.
void openblas_piece(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                    const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                    int64_t ldc) {
  OneLibraryThread one;
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, static_cast<blasint>(m), static_cast<blasint>(n),
              static_cast<blasint>(k), alpha, a, static_cast<blasint>(lda), b,
              static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
}

// One piece through oneDNN, on the calling thread alone.
void onednn_piece(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                  const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                  int64_t ldc) {
  OneLibraryThread one;
  dnnl_status_t status = dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', m, n, k, alpha, a,
                                    lda, b, ldb, beta, c, ldc);
  TS_CHECK(status == dnnl_success, "gemm: oneDNN's sgemm failed ({}) on {}x{}x{}",
           static_cast<int>(status), m, n, k);
}

// How a product is cut: tiles of mb x nb over C, and `chunks` pieces of k.
struct Grid {
  int64_t mb, nb, chunks;
};

constexpr double kSerialFlops = 4e6;  // below: one piece
// Tiles of C at most kTile x kTile (big enough that re-packing an operand per
// tile costs little, small enough that a large product has a piece for every
// core); a product with fewer than kFewTiles tiles and a deep k is cut into
// chunks of k as well, of at least kMinChunk, up to kChunkedPieces pieces.
constexpr int64_t kTile = 256, kFewTiles = 4, kChunkedPieces = 8, kMinChunk = 256;

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}
int64_t round_up(int64_t a, int64_t b) {
  return ceil_div(a, b) * b;
}

// Equal parts of `size`, each at most `most` (and a multiple of 16).
int64_t balanced_part(int64_t size, int64_t most) {
  return std::min(size, round_up(ceil_div(size, ceil_div(size, most)), 16));
}

// Depends on the shape alone, never on the thread count.
Grid grid_for(int64_t m, int64_t n, int64_t k, double flops) {
  if (flops < kSerialFlops) return {m, n, 1};
  int64_t mb = balanced_part(m, kTile), nb = balanced_part(n, kTile);
  int64_t tiles = ceil_div(m, mb) * ceil_div(n, nb), chunks = 1;
  if (tiles < kFewTiles && k >= 2 * kMinChunk)
    chunks = std::min(ceil_div(kChunkedPieces, tiles), k / kMinChunk);
  return {mb, nb, chunks};
}

}  // namespace

int64_t sgemm_scratch_elements(int64_t m, int64_t n, int64_t k) {
  if (m == 0 || n == 0 || k == 0) return 0;
  Grid g = grid_for(m, n, k, 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k));
  return g.chunks > 1 ? g.chunks * m * n : 0;
}

SgemmPath set_sgemm_path(SgemmPath path) {
  return forced_path.exchange(path);
}

void sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
           int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  check_leading_dims("sgemm", trans_a, trans_b, m, n, k, lda, ldb, ldc);
  if (m == 0 || n == 0) return;
  if (k == 0) {  // C = beta * C, which oneDNN skips (it returns early on k == 0)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0.f ? 0.f : beta * c[i * ldc + j];
    return;
  }
  // Where op(X)'s block (row r0, col c0) starts in X's storage.
  auto at = [](const float* x, int64_t ld, bool trans, int64_t r0, int64_t c0) {
    return trans ? x + c0 * ld + r0 : x + r0 * ld + c0;
  };
  double flops = 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  Grid g = grid_for(m, n, k, flops);
  // The library for every piece of this product: by the CPU (its kernels'
  // instruction set, runtime/cpu/isa.h) and the shape alone.
  bool avx512 = active_isa() == Isa::Avx512;
  SgemmPath path = forced_path.load(std::memory_order_relaxed);
  bool onednn = path == SgemmPath::Auto ? avx512 || flops < kSerialFlops : path == SgemmPath::OneDnn;
  auto piece = onednn ? onednn_piece : openblas_piece;
  int64_t tiles_m = ceil_div(m, g.mb), tiles_n = ceil_div(n, g.nb), tiles = tiles_m * tiles_n;
  if (g.chunks == 1) {
    parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        int64_t i0 = (t / tiles_n) * g.mb, j0 = (t % tiles_n) * g.nb;
        piece(trans_a, trans_b, std::min(g.mb, m - i0), std::min(g.nb, n - j0), k, alpha,
              at(a, lda, trans_a, i0, 0), lda, at(b, ldb, trans_b, 0, j0), ldb, beta,
              c + i0 * ldc + j0, ldc);
      }
    });
    return;
  }
  // Split k: chunk p's partial product into parts[p], then C = sum over p in order (+ beta C).
  int64_t kc = ceil_div(k, g.chunks);
  Tensor parts = empty({g.chunks, m, n}, DType::F32);
  float* pp = parts.data<float>();
  parallel_for(0, tiles * g.chunks, 1, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) {
      int64_t p = w / tiles, t = w % tiles;
      int64_t i0 = (t / tiles_n) * g.mb, j0 = (t % tiles_n) * g.nb, k0 = p * kc;
      piece(trans_a, trans_b, std::min(g.mb, m - i0), std::min(g.nb, n - j0), std::min(kc, k - k0),
            alpha, at(a, lda, trans_a, i0, k0), lda, at(b, ldb, trans_b, k0, j0), ldb, 0.f,
            pp + (p * m + i0) * n + j0, n);
    }
  });
  parallel_for(0, m, std::max<int64_t>(1, 4096 / n), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      float* ci = c + i * ldc;
      for (int64_t j = 0; j < n; ++j) {
        float sum = pp[i * n + j];
        for (int64_t p = 1; p < g.chunks; ++p) sum += pp[(p * m + i) * n + j];
        ci[j] = beta == 0.f ? sum : sum + beta * ci[j];
      }
    }
  });
}

void dgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha,
           const double* a, int64_t lda, const double* b, int64_t ldb, double beta, double* c,
           int64_t ldc) {
  check_leading_dims("dgemm", trans_a, trans_b, m, n, k, lda, ldb, ldc);
  if (m == 0 || n == 0) return;
  // BLAS rejects leading dimensions below 1 even when k == 0.
  cblas_dgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, static_cast<blasint>(m), static_cast<blasint>(n),
              static_cast<blasint>(k), alpha, a, static_cast<blasint>(std::max<int64_t>(lda, 1)), b,
              static_cast<blasint>(std::max<int64_t>(ldb, 1)), beta, c, static_cast<blasint>(ldc));
}

void gemm(DType dtype, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha,
          const void* a, int64_t lda, const void* b, int64_t ldb, double beta, void* c,
          int64_t ldc) {
  bool timed = profiler::enabled();
  auto t0 = timed ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  if (dtype == DType::F32) {
    sgemm(trans_a, trans_b, m, n, k, static_cast<float>(alpha), static_cast<const float*>(a), lda,
          static_cast<const float*>(b), ldb, static_cast<float>(beta), static_cast<float*>(c), ldc);
  } else if (dtype == DType::F64) {
    dgemm(trans_a, trans_b, m, n, k, alpha, static_cast<const double*>(a), lda,
          static_cast<const double*>(b), ldb, beta, static_cast<double*>(c), ldc);
  } else {
    TS_CHECK(false, "gemm: expected f32 or f64, got {}", dtype_name(dtype));
  }
  if (timed)
    profiler::record_kernel(
        "gemm", std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
}

}  // namespace tessera::cpu
