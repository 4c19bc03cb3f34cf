// Matrix products on the CPU, row-major throughout. f32 has two libraries:
// - oneDNN's dnnl_sgemm picks its kernel from the CPU's features at run time.
//   With AVX-512 it runs at twice OpenBLAS 0.3.21, which is held to its AVX2
//   kernel on these EPYCs; without AVX-512 it is no faster on large products
//   (0.5-1.1x, and slow with a transposed A), but faster on small blocks such
//   as attention's 64 x 64 (measured 80 vs 57 GFLOP/s): benchmarks/bench_gemm.
// - OpenBLAS's sgemm, otherwise.
// So: where the kernels' avx512 copy runs (runtime/cpu/isa.h, which
// TESSERA_CPU_ISA caps), oneDNN for everything but the large weight
// gradients, which run on Tessera's own kernel (runtime/cpu/sgemm_kernel.h:
// operands packed once per product, 1.25-1.40x oneDNN's pieces there); where
// the avx2 copy runs, the own kernel for large products of any kind
// (sgemm_on_own_kernel), oneDNN for products below kSerialFlops and OpenBLAS
// between. oneDNN has no f64 GEMM: f64 (the reference dtype) is OpenBLAS's
// cblas_dgemm, threaded as OpenBLAS likes.
//
// bf16 x bf16 with f32 accumulation is oneDNN's matmul primitive, on CPUs where
// oneDNN has bf16 kernels (AVX512-BF16; AMX tiles where the CPU has them).
// oneDNN 2.6 has no bf16 sgemm-style call, and a primitive costs 0.1-5 ms to
// create, so each piece's primitive is made once per shape and cached. Its
// AMX kernel (brgemm) runs only on dense destinations, so on tiles of a wider
// C it falls back to an older kernel; there Tessera's own AMX kernel
// (runtime/cpu/amx.h) runs instead, 1.1-1.7x faster (bf16_on_amx). Where
// oneDNN has no bf16 kernels and the avx2 copy runs, bf16 products run on
// the own f32 kernel, which widens the operands as it packs them and rounds
// each result as it stores it (bf16_on_own_kernel): the f32 product's bits,
// without the f32 copies of the operands and result the ops layer made
// before. Elsewhere (the baseline copy; AVX-512 without AVX512-BF16, not
// measured) they still run on those copies (the ops layer converts:
// cpu::compute_dtype).
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
#include <fmt/format.h>
#include <omp.h>
#include <oneapi/dnnl/dnnl.h>

#include <oneapi/dnnl/dnnl.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "runtime/cpu/amx.h"
#include "runtime/cpu/blas.h"
#include "runtime/cpu/dispatch.h"
#include "runtime/cpu/isa.h"
#include "runtime/cpu/sgemm_kernel.h"
#include "runtime/kernels.h"
#include "runtime/parallel_for.h"
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
std::atomic<Bf16Path> forced_bf16_path{Bf16Path::Auto};

// Both libraries size their teams by omp_get_max_threads(), and oneDNN plans
// a primitive for that many threads when it makes one, inside a parallel
// region too (where it then runs on the calling thread alone): this holds them
// to the calling thread, so a result never depends on the thread count.
class OneLibraryThread {
 public:
  OneLibraryThread() : saved_(omp_get_max_threads()) {
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

// Where a piece of a product writes: into C itself (in the operands' dtype)
// or into f32 partial products that are summed afterwards.
struct PieceOut {
  void* c;
  int64_t ldc;
  bool f32;
};

// One piece through OpenBLAS, on the calling thread alone.
void openblas_piece(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                    const float* a, int64_t lda, const float* b, int64_t ldb, float beta, PieceOut out) {
  OneLibraryThread one;
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, static_cast<blasint>(m), static_cast<blasint>(n),
              static_cast<blasint>(k), alpha, a, static_cast<blasint>(lda), b,
              static_cast<blasint>(ldb), beta, static_cast<float*>(out.c), static_cast<blasint>(out.ldc));
}

// One piece through oneDNN, on the calling thread alone.
void onednn_piece(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                  const float* a, int64_t lda, const float* b, int64_t ldb, float beta, PieceOut out) {
  OneLibraryThread one;
  dnnl_status_t status = dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', m, n, k, alpha, a,
                                    lda, b, ldb, beta, static_cast<float*>(out.c), out.ldc);
  TS_CHECK(status == dnnl_success, "gemm: oneDNN's sgemm failed ({}) on {}x{}x{}",
           static_cast<int>(status), m, n, k);
}

// ---- bf16: oneDNN's matmul primitives, one per piece shape ----------------------

// Everything a primitive is made for: alpha is an output scale and beta a sum
// post-op, fixed at creation (a scale given at run time moves oneDNN 2.6 off
// its AMX kernel onto a generic one: measured 370 vs 510 GFLOP/s).
struct MatmulKey {
  bool trans_a, trans_b, f32_out;
  int64_t m, n, k, lda, ldb, ldc;
  float alpha, beta;
  auto operator<=>(const MatmulKey&) const = default;
};

struct Matmul {
  dnnl::matmul primitive;
  dnnl::memory::desc a, b, c, scratchpad;
};

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

Matmul make_matmul(const MatmulKey& key) {
  using dims = dnnl::memory::dims;
  using dt = dnnl::memory::data_type;
  // Row-major operands: op(A) is m x k, stored k x m (strides swapped) when transposed.
  dnnl::memory::desc a({key.m, key.k}, dt::bf16, key.trans_a ? dims{1, key.lda} : dims{key.lda, 1});
  dnnl::memory::desc b({key.k, key.n}, dt::bf16, key.trans_b ? dims{1, key.ldb} : dims{key.ldb, 1});
  dnnl::memory::desc c({key.m, key.n}, key.f32_out ? dt::f32 : dt::bf16, dims{key.ldc, 1});
  dnnl::primitive_attr attr;
  if (key.alpha != 1.f) attr.set_output_scales(0, {key.alpha});
  if (key.beta != 0.f) {
    dnnl::post_ops sum;
    sum.append_sum(key.beta);
    attr.set_post_ops(sum);
  }
  // The caller hands each execution its own scratchpad, so pieces run concurrently.
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), attr, cpu_engine());
  return {dnnl::matmul(pd), a, b, c, pd.scratchpad_desc()};
}

// Primitives by shape, made on first use and kept for the process (a training
// run has a few dozen distinct pieces).
const Matmul& cached_matmul(const MatmulKey& key) {
  static std::mutex mutex;
  static std::map<MatmulKey, std::unique_ptr<Matmul>> cache;
  std::lock_guard lock(mutex);
  auto [it, fresh] = cache.try_emplace(key);
  if (fresh) {
    try {
      it->second = std::make_unique<Matmul>(make_matmul(key));
    } catch (const dnnl::error& e) {
      cache.erase(it);
      TS_CHECK(false, "gemm: oneDNN has no bf16 matmul for {}x{}x{} (transposed: {}, {}): {}", key.m, key.n,
               key.k, key.trans_a, key.trans_b, e.what());
    }
  }
  return *it->second;
}

// One piece through a cached bf16 primitive, on the calling thread alone.
void bf16_piece(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                const BFloat16* a, int64_t lda, const BFloat16* b, int64_t ldb, float beta, PieceOut out) {
  OneLibraryThread one;
  const Matmul& mm = cached_matmul({trans_a, trans_b, out.f32, m, n, k, lda, ldb, out.ldc, alpha, beta});
  thread_local std::vector<std::byte> scratchpad;
  scratchpad.resize(std::max(scratchpad.size(), mm.scratchpad.get_size()));
  thread_local dnnl::stream stream(cpu_engine());
  dnnl::engine& engine = cpu_engine();
  try {
    mm.primitive.execute(stream, {{DNNL_ARG_SRC, dnnl::memory(mm.a, engine, const_cast<BFloat16*>(a))},
                                  {DNNL_ARG_WEIGHTS, dnnl::memory(mm.b, engine, const_cast<BFloat16*>(b))},
                                  {DNNL_ARG_DST, dnnl::memory(mm.c, engine, out.c)},
                                  {DNNL_ARG_SCRATCHPAD, dnnl::memory(mm.scratchpad, engine, scratchpad.data())}});
    stream.wait();
  } catch (const dnnl::error& e) {
    TS_CHECK(false, "gemm: oneDNN's bf16 matmul failed on {}x{}x{}: {}", m, n, k, e.what());
  }
}

// How a product is cut: tiles of mb x nb over C, and `chunks` pieces of kc along k.
struct Grid {
  int64_t mb, nb, chunks, kc;
};

// The steps a grid's cuts fall on: the libraries take any k and tiles on
// multiples of 16; the AMX kernel cuts on its panels and k blocks, the own
// f32 kernel on its panels (MR rows, NR columns).
struct Granule {
  int64_t rows, cols, k;
};
constexpr Granule kLibraryGranule{16, 16, 1}, kAmxGranule{amx::kPanel, amx::kPanel, amx::kBlock};

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

// Equal parts of `size`, each at most `most` (and a multiple of `unit`).
int64_t balanced_part(int64_t size, int64_t most, int64_t unit) {
  return std::min(size, round_up(ceil_div(size, ceil_div(size, most)), unit));
}

// Depends on the shape alone, never on the thread count.
Grid grid_for(int64_t m, int64_t n, int64_t k, Granule granule) {
  double flops = 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  if (flops < kSerialFlops) return {m, n, 1, k};
  int64_t mb = balanced_part(m, kTile, granule.rows), nb = balanced_part(n, kTile, granule.cols);
  int64_t tiles = ceil_div(m, mb) * ceil_div(n, nb), chunks = 1;
  if (tiles < kFewTiles && k >= 2 * kMinChunk)
    chunks = std::min(ceil_div(kChunkedPieces, tiles), k / kMinChunk);
  int64_t kc = round_up(ceil_div(k, chunks), granule.k);
  return {mb, nb, ceil_div(k, kc), kc};
}

// C = alpha op(A) op(B) + beta C in the pieces of grid g, each through
// `piece(i0, j0, rows, cols, k0, depth, beta, out)` on one thread: rows x
// cols of C from row i0, column j0, over k0 .. k0 + depth, alpha applied,
// `beta` for what `out` holds. Split k: chunk p's partial
// product goes to f32 parts[p], then C = sum over p in order (+ beta C),
// rounded once.
template <class T, class Piece>
void gemm_on_grid(int64_t m, int64_t n, int64_t k, Grid g, float beta, T* c, int64_t ldc, Piece piece) {
  if (m == 0 || n == 0) return;
  if (k == 0) {  // C = beta * C, which oneDNN skips (it returns early on k == 0)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j)
        c[i * ldc + j] = store<T>(beta == 0.f ? 0.f : beta * load(c[i * ldc + j]));
    return;
  }
  int64_t tiles_m = ceil_div(m, g.mb), tiles_n = ceil_div(n, g.nb), tiles = tiles_m * tiles_n;
  if (g.chunks == 1) {
    parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        int64_t i0 = (t / tiles_n) * g.mb, j0 = (t % tiles_n) * g.nb;
        piece(i0, j0, std::min(g.mb, m - i0), std::min(g.nb, n - j0), 0, k, beta,
              PieceOut{c + i0 * ldc + j0, ldc, std::is_same_v<T, float>});
      }
    });
    return;
  }
  Tensor parts = empty({g.chunks, m, n}, DType::F32);
  float* pp = parts.data<float>();
  parallel_for(0, tiles * g.chunks, 1, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) {
      int64_t p = w / tiles, t = w % tiles;
      int64_t i0 = (t / tiles_n) * g.mb, j0 = (t % tiles_n) * g.nb, k0 = p * g.kc;
      piece(i0, j0, std::min(g.mb, m - i0), std::min(g.nb, n - j0), k0, std::min(g.kc, k - k0), 0.f,
            PieceOut{pp + (p * m + i0) * n + j0, n, true});
    }
  });
  parallel_for(0, m, std::max<int64_t>(1, 4096 / n), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      T* ci = c + i * ldc;
      for (int64_t j = 0; j < n; ++j) {
        float sum = pp[i * n + j];
        for (int64_t p = 1; p < g.chunks; ++p) sum += pp[(p * m + i) * n + j];
        ci[j] = store<T>(beta == 0.f ? sum : sum + beta * load(ci[j]));
      }
    }
  });
}

// The same through a library's `piece` function, on blocks of the operands in place.
template <class T, class LibraryPiece>
void gemm_in_library(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const T* a,
                     int64_t lda, const T* b, int64_t ldb, float beta, T* c, int64_t ldc, LibraryPiece piece) {
  // Where op(X)'s block (row r0, col c0) starts in X's storage.
  auto at = [](const T* x, int64_t ld, bool trans, int64_t r0, int64_t c0) {
    return trans ? x + c0 * ld + r0 : x + r0 * ld + c0;
  };
  gemm_on_grid(m, n, k, grid_for(m, n, k, kLibraryGranule), beta, c, ldc,
               [&](int64_t i0, int64_t j0, int64_t rows, int64_t cols, int64_t k0, int64_t depth, float piece_beta,
                   PieceOut out) {
                 piece(trans_a, trans_b, rows, cols, depth, alpha, at(a, lda, trans_a, i0, k0), lda,
                       at(b, ldb, trans_b, k0, j0), ldb, piece_beta, out);
               });
}

// The packed operands' elements, A's panels then B's. (Reading A's tiles in
// place, unpacked, measured 0.70-0.87 of the packed rate on this kernel:
// power-of-two strides conflict in L1.)
int64_t amx_packed_elements(int64_t m, int64_t n, int64_t k) {
  return amx::packed_a_elements(m, k) + amx::packed_b_elements(k, n);
}

// bf16 through the AMX kernel (amx.h): both operands packed once, in
// parallel over their panels, then the pieces multiply panels.
void gemm_on_amx(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const BFloat16* a,
                 int64_t lda, const BFloat16* b, int64_t ldb, float beta, BFloat16* c, int64_t ldc) {
  using amx::kBlock;
  using amx::kPanel;
  const int64_t pm = amx::panels(m), pn = amx::panels(n), panel = amx::blocks(k) * amx::kBlockElements;
  Tensor packed;
  BFloat16 *pa = nullptr, *pb = nullptr;
  if (m > 0 && n > 0 && k > 0) {
    packed = empty({amx_packed_elements(m, n, k)}, DType::BF16);
    pa = packed.data<BFloat16>();
    pb = pa + pm * panel;
    parallel_for(0, pm + pn, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        if (p < pm) amx::pack_a(trans_a, m, k, a, lda, p, p + 1, pa + p * panel);
        else amx::pack_b(trans_b, k, n, b, ldb, p - pm, p - pm + 1, pb + (p - pm) * panel);
      }
    });
  }
  gemm_on_grid(m, n, k, grid_for(m, n, k, kAmxGranule), beta, c, ldc,
               [&](int64_t i0, int64_t j0, int64_t rows, int64_t cols, int64_t k0, int64_t depth, float piece_beta,
                   PieceOut out) {
                 amx::multiply(m, n, k, pa, pb, i0 / kPanel, ceil_div(i0 + rows, kPanel), j0 / kPanel,
                               ceil_div(j0 + cols, kPanel), k0 / kBlock, ceil_div(k0 + depth, kBlock), alpha,
                               piece_beta, {out.c, out.ldc, out.f32});
               });
}

// ---- f32: Tessera's own kernel (sgemm_kernel.h) ---------------------------------

// The own kernel's entries for operands and results of type T (f32, or bf16 widened as packed).
template <class T>
struct OwnEntries {
  void (*pack_a)(bool, int64_t, int64_t, const T*, int64_t, int64_t, int64_t, float*);
  void (*pack_b)(bool, int64_t, int64_t, const T*, int64_t, int64_t, int64_t, float*);
  void (*multiply)(int64_t, int64_t, int64_t, const float*, const float*, int64_t, int64_t, int64_t, int64_t,
                   int64_t, int64_t, float, float, T*, int64_t, float*);
};

struct OwnKernel {
  int64_t mr, nr, kc;
  OwnEntries<float> f32;
  OwnEntries<BFloat16> bf16;
  int64_t (*partials)(int64_t, int64_t, int64_t);
  const OwnEntries<float>& entries(const float*) const { return f32; }
  const OwnEntries<BFloat16>& entries(const BFloat16*) const { return bf16; }
};

#define TS_OWN_KERNEL(isa)                                                                       \
  OwnKernel {                                                                                    \
    isa::sgemm_mr(), isa::sgemm_nr(), isa::sgemm_kc(),                                           \
        {isa::sgemm_pack_a, isa::sgemm_pack_b, isa::sgemm_multiply},                             \
        {isa::sgemm_pack_a, isa::sgemm_pack_b, isa::sgemm_multiply}, isa::sgemm_partials         \
  }

// An instruction-set copy's kernel, or null where it has none (baseline).
const OwnKernel* own_kernel(Isa isa) {
#if defined(TESSERA_CPU_ISA_VARIANTS)
  static const OwnKernel avx2_kernel = TS_OWN_KERNEL(avx2);
  static const OwnKernel avx512_kernel = TS_OWN_KERNEL(avx512);
  switch (isa) {
    case Isa::Avx512: return &avx512_kernel;
    case Isa::Avx2: return &avx2_kernel;
    case Isa::Baseline: break;
  }
#endif
  return nullptr;
}

// The active copy's.
const OwnKernel* own_kernel() { return own_kernel(active_isa()); }

// What the own kernel takes from the allocator for a product: B packed
// whole, and for each thread that can have a tile a row block of A packed
// (GotoBLAS's order: the block a thread's tiles read, packed by that thread
// just before, where A packed whole took the size of A again) and its
// partial sums.
struct OwnScratch {
  Grid grid;
  int64_t packed_b, packed_a_per_thread, partials_per_thread, threads;  // the grid never cuts k (own_grid)
  int64_t per_thread() const { return packed_a_per_thread + partials_per_thread; }
  int64_t elements() const { return packed_b + per_thread() * threads; }
};

// The micro-tiles the busiest of `threads` threads multiplies on a grid of
// mb x nb pieces, as gemm_on_grid's parallel_for deals the pieces out (runs
// of ceil(pieces / threads), in order).
int64_t busiest_thread(const OwnKernel& kernel, int64_t m, int64_t n, int64_t mb, int64_t nb, int64_t threads) {
  const int64_t tiles_n = ceil_div(n, nb), pieces = ceil_div(m, mb) * tiles_n;
  const int64_t run = ceil_div(pieces, threads);
  int64_t most = 0;
  for (int64_t p0 = 0; p0 < pieces; p0 += run) {
    int64_t load = 0;
    for (int64_t p = p0; p < std::min(pieces, p0 + run); ++p) {
      const int64_t rows = std::min(mb, m - p / tiles_n * mb), cols = std::min(nb, n - p % tiles_n * nb);
      load += ceil_div(rows, kernel.mr) * ceil_div(cols, kernel.nr);
    }
    most = std::max(most, load);
  }
  return most;
}

// The own kernel's grid: tiles of C as the libraries' (at most kTile x
// kTile), made smaller until there are kChunkedPieces of them where the
// panels allow, then balanced over the threads; never chunks of k, so each
// result stays one chain over k.
Grid own_grid(const OwnKernel& kernel, int64_t m, int64_t n, int64_t k, int64_t threads) {
  int64_t mb = balanced_part(m, kTile, kernel.mr), nb = balanced_part(n, kTile, kernel.nr);
  while (ceil_div(m, mb) * ceil_div(n, nb) < kChunkedPieces) {
    if (mb > kernel.mr && (mb >= nb || nb <= kernel.nr)) mb = round_up(ceil_div(mb, 2), kernel.mr);
    else if (nb > kernel.nr) nb = round_up(ceil_div(nb, 2), kernel.nr);
    else break;
  }
  if (threads <= 1) return {mb, nb, 1, k};
  // A result's bits do not depend on the grid (one chain over k each), so
  // the grid may follow the threads: among up to twice as many row and
  // column blocks (at most kBalanceSteps more of each), the one whose
  // busiest thread has the fewest micro-tiles, then the fewest pieces. 11
  // pieces on 2 threads would leave one idle for a twelfth of the product.
  constexpr int64_t kBalanceSteps = 8;
  const int64_t rows0 = ceil_div(m, mb), cols0 = ceil_div(n, nb);
  int64_t best_load = busiest_thread(kernel, m, n, mb, nb, threads), best_pieces = rows0 * cols0;
  for (int64_t rb = rows0; rb <= rows0 + std::min(rows0, kBalanceSteps); ++rb) {
    for (int64_t cb = cols0; cb <= cols0 + std::min(cols0, kBalanceSteps); ++cb) {
      const int64_t mb2 = round_up(ceil_div(m, rb), kernel.mr), nb2 = round_up(ceil_div(n, cb), kernel.nr);
      const int64_t load = busiest_thread(kernel, m, n, mb2, nb2, threads);
      const int64_t pieces = ceil_div(m, mb2) * ceil_div(n, nb2);
      if (load < best_load || (load == best_load && pieces < best_pieces))
        mb = mb2, nb = nb2, best_load = load, best_pieces = pieces;
    }
  }
  return {mb, nb, 1, k};
}

OwnScratch own_scratch(const OwnKernel& kernel, int64_t m, int64_t n, int64_t k) {
  OwnScratch s{own_grid(kernel, m, n, k, num_threads()), 0, 0, 0, 0};
  s.packed_b = ceil_div(n, kernel.nr) * kernel.nr * k;
  s.packed_a_per_thread = ceil_div(std::min(s.grid.mb, m), kernel.mr) * kernel.mr * k;
  s.partials_per_thread = kernel.partials(s.grid.mb, s.grid.nb, s.grid.kc);
  const int64_t pieces = ceil_div(m, s.grid.mb) * ceil_div(n, s.grid.nb);
  s.threads = std::max<int64_t>(1, std::min<int64_t>(num_threads(), pieces));
  return s;
}

// The steps of k each task packing B takes: a whole block of k on one
// thread (a panel's lines read in runs of a block: packing a 3072 x 1024
// operand whose steps are adjacent took 1.3 ms against 4.1 ms in runs of
// 32 steps on the AVX2 EPYC), else the largest power-of-two part of one that
// gives each thread two runs, down to kMinPackSteps.
constexpr int64_t kMinPackSteps = 32;
int64_t pack_run(const OwnKernel& kernel, int64_t k, int64_t threads) {
  int64_t run = kernel.kc;
  if (threads <= 1) return run;
  while (run > kMinPackSteps && ceil_div(k, run) < 2 * threads) run /= 2;
  return run;
}

// f32 (or bf16, widened as packed) through the own kernel: B packed once, in
// parallel over runs of steps of k; then each thread multiplies its pieces of
// the grid, packing the row block of A a piece reads unless it holds that
// block already (the grid's pieces go out in runs, row by row, so a block is
// packed about once).
template <class T>
void gemm_on_own(const OwnKernel& kernel, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                 const T* a, int64_t lda, const T* b, int64_t ldb, float beta, T* c, int64_t ldc) {
  const OwnEntries<T>& entries = kernel.entries(a);
  if (m == 0 || n == 0 || k == 0) {  // nothing to pack: the grid scales C
    gemm_on_grid(m, n, k, Grid{m, n, 1, k}, beta, c, ldc, [](auto...) {});
    return;
  }
  const OwnScratch s = own_scratch(kernel, m, n, k);
  Tensor scratch = empty({s.elements()}, DType::F32);
  float* pb = scratch.data<float>();
  float* per_thread = pb + s.packed_b;
  const int64_t run = pack_run(kernel, k, num_threads()), runs = ceil_div(k, run);
  parallel_for(0, runs, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) entries.pack_b(trans_b, k, n, b, ldb, r * run, std::min(k, (r + 1) * run), pb);
  });
  std::vector<int64_t> holds(static_cast<size_t>(s.threads), -1);  // the first row of the block a slot holds
  gemm_on_grid(m, n, k, s.grid, beta, c, ldc,
               [&](int64_t i0, int64_t j0, int64_t rows, int64_t cols, int64_t k0, int64_t depth, float piece_beta,
                   PieceOut out) {
                 const int64_t slot = detail::omp_thread_num() % s.threads;
                 float* pa = per_thread + slot * s.per_thread();
                 if (holds[static_cast<size_t>(slot)] != i0) {
                   entries.pack_a(trans_a, rows, k, trans_a ? a + i0 : a + i0 * lda, lda, 0, k, pa);
                   holds[static_cast<size_t>(slot)] = i0;
                 }
                 // The block is a product of `rows` rows of its own; C's pointer is the piece's.
                 entries.multiply(rows, n, k, pa, pb, 0, rows, j0, cols, k0, depth, alpha, piece_beta,
                                  static_cast<T*>(out.c), out.ldc, pa + s.packed_a_per_thread);
               });
}

// Whether an f32 product runs on the own kernel now. Auto, measured with
// benchmarks/bench_gemm (benchmarks/README.md, "f32 on the own kernel"): on
// the AVX-512 Xeon the large weight gradients (TN: dY^T X, C of at least
// kOwnMinSide on each side and kOwnMinResults in all) ran 1.0-1.34x
// oneDNN's pieces on it at 1 and 2 threads, and with the grid balanced over
// the threads those of the wide projections (C at least kOwnWideRatio times
// as tall as wide, kOwnWideMinN wide or more: a fused QKV or an MLP's first
// layer, 768-1536 x 256-512) over kOwnWideMinK rows or more 1.0-1.37x at 1
// thread and 0.94-1.19x at 2 (over 512 rows 0.98-1.19x and 0.87-1.05x);
// square and tall-B ones 0.75-1.0x at 2 threads, the other two products
// 0.82-0.98x: so these TN products alone.
// On the AVX2-only EPYC (2026-12-06) the AVX2 copy ran 0.96-1.04x OpenBLAS
// called on the whole product at 1 thread on all 16 of bench_gemm's shapes
// in one run (C of 256 or more on each side, 2^28 multiply-adds or more; NN,
// NT and TN alike; medians 0.99-1.00 in two more on a noisy machine), where
// OpenBLAS's pieces ran 0.91-1.00x. At 2 threads it ran 0.86-0.95x the
// pieces on those of 2^28 multiply-adds (1024 x 256 x 1024 and 1024 x 1024
// x 256) in two runs of three, and about level on the larger ones; below
// 2^28 it was 0.92-0.98x the pieces at 1 thread (1024 x 256 x
// 256, 1024 x 256 x 512, 512 x 256 x 256; oneDNN faster still). Measured
// again in the step (2026-12-07: the default model's products, 2^27.6 and
// 2^28 multiply-adds, on the own kernel against OpenBLAS's pieces, three
// runs of 10 alternating rounds of bench_step at 1 thread, five at 2), the
// step ran 1.016, 1.033 and 1.044x as fast at 1 thread (faster in 20 of 30
// rounds), and 1.041, 1.031, 0.936, 0.994 and 1.018x at 2 threads (26 of
// 50): a gain at one thread (as each rank of a multi-rank run on these 2
// cores runs), none to call at two. It packs B once and A once per row
// block where the pieces pack both for every tile. So there the products
// with C at least kOwnAvx2MinSide on each side and kOwnAvx2MinProduct
// multiply-adds or more.
constexpr int64_t kOwnMinSide = 512, kOwnMinResults = int64_t{1} << 20;
constexpr int64_t kOwnWideRatio = 3, kOwnWideMinN = 256, kOwnWideMinK = 1024;
constexpr int64_t kOwnAvx2MinSide = 256;
constexpr double kOwnAvx2MinProduct = 134217728.0;  // 2^27 multiply-adds: products of as many or more qualify
// The own kernel holds B packed whole for the product's length, and a row
// block of A (about kTile rows) per thread, where the libraries pack a
// tile's operands at a time: Auto gives it no product whose B and one block
// of A would pass 32 MiB (bench_gemm's largest take 12 MiB; a vocabulary's
// weight of 50257 x 768 would be 147 MiB).
constexpr double kOwnMaxPacked = 8388608.0;  // 2^23 floats
}  // namespace

bool sgemm_on_own_kernel(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k) {
  SgemmPath path = forced_path.load(std::memory_order_relaxed);
  if (own_kernel() == nullptr) return false;
  if (path != SgemmPath::Auto) return path == SgemmPath::Own;
  const double flops = 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  if ((static_cast<double>(n) + kTile) * static_cast<double>(k) > kOwnMaxPacked) return false;
  if (active_isa() == Isa::Avx2) return std::min(m, n) >= kOwnAvx2MinSide && flops >= 2.0 * kOwnAvx2MinProduct;
  const bool large = std::min(m, n) >= kOwnMinSide && m * n >= kOwnMinResults;
  const bool wide = m >= kOwnWideRatio * n && n >= kOwnWideMinN && k >= kOwnWideMinK;  // a projection's 3-4x wider output
  return active_isa() == Isa::Avx512 && trans_a && !trans_b && (large || wide) && flops >= kSerialFlops;
}

GemmScratch gemm_scratch(DType dtype, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, Bf16Kernel bf16) {
  if (m == 0 || n == 0 || k == 0) return {};
  const bool on_amx = dtype == DType::BF16 && bf16 == Bf16Kernel::Amx;
  const bool on_own = dtype == DType::F32 ? sgemm_on_own_kernel(trans_a, trans_b, m, n, k)
                                          : dtype == DType::BF16 && bf16 == Bf16Kernel::Own;
  if (on_own) {  // a CPU planned for may have the kernel where this one (baseline) has not: AVX2's then
    const OwnKernel* kernel = own_kernel() != nullptr ? own_kernel() : own_kernel(Isa::Avx2);
    TS_CHECK(kernel != nullptr, "gemm_scratch: this build has no copy of the own kernel");
    return {0, 0, own_scratch(*kernel, m, n, k).elements()};
  }
  Grid g = grid_for(m, n, k, on_amx ? kAmxGranule : kLibraryGranule);
  return {g.chunks > 1 ? g.chunks * m * n : 0, on_amx ? amx_packed_elements(m, n, k) : 0, 0};
}

SgemmPath set_sgemm_path(SgemmPath path) {
  TS_CHECK(path != SgemmPath::Own || own_kernel() != nullptr,
           "set_sgemm_path: the own f32 kernel needs the kernels' AVX2 or AVX-512 copy, and {} runs here",
           isa_name(active_isa()));
  return forced_path.exchange(path);
}

Bf16Path set_bf16_path(Bf16Path path) {
  TS_CHECK(path != Bf16Path::Amx || amx::usable(),
           "set_bf16_path: the AMX kernel needs AMX-BF16 tiles, which this CPU lacks or Linux did not grant");
  TS_CHECK(path != Bf16Path::Own || own_kernel() != nullptr,
           "set_bf16_path: the own f32 kernel needs the kernels' AVX2 or AVX-512 copy, and {} runs here",
           isa_name(active_isa()));
  return forced_bf16_path.exchange(path);
}

bool sgemm_own_kernel_here() {
  return own_kernel() != nullptr;
}

// Auto: the AVX2 copy only, where it was measured (1.11-1.21x the bf16 step
// on f32 copies, benchmarks/README.md). An AVX-512 CPU without AVX512-BF16
// keeps the f32 copies: there oneDNN's f32 kernels beat the own one on most
// shapes, and the trade against the copies was not measured.
bool bf16_on_own_kernel() {
  if (own_kernel() == nullptr) return false;
  if (forced_bf16_path.load(std::memory_order_relaxed) == Bf16Path::Own) return true;
  return !bf16_gemm_native() && active_isa() == Isa::Avx2;
}

Bf16Kernel bf16_kernel(int64_t m, int64_t n, int64_t k) {
  if (bf16_on_own_kernel()) return Bf16Kernel::Own;
  return bf16_on_amx(m, n, k) ? Bf16Kernel::Amx : Bf16Kernel::Library;
}

bool bf16_gemm_native() {
  static const bool native = [] {
    (void)active_isa();  // TESSERA_CPU_ISA caps oneDNN's kernels before their first use
    auto isa = static_cast<unsigned>(dnnl_get_effective_cpu_isa());
    return (isa & dnnl_cpu_isa_avx512_core_bf16) == dnnl_cpu_isa_avx512_core_bf16;
  }();
  return native;
}

bool bf16_gemm_amx() {
  static const bool amx = [] {
    if (!bf16_gemm_native()) return false;
    auto isa = static_cast<unsigned>(dnnl_get_effective_cpu_isa());
    return (isa & dnnl_cpu_isa_avx512_core_amx) == dnnl_cpu_isa_avx512_core_amx;
  }();
  return amx;
}

bool amx_kernel_takes(int64_t m, int64_t n, int64_t k) {
  // Where each of the library grid's tiles spans C's whole width, its
  // destination is dense and oneDNN runs its own AMX kernel (brgemm), which
  // measured 1.08-1.49x this one there (n = 256, benchmarks/README.md); on
  // narrower tiles it falls back to an older kernel that this one beats.
  return grid_for(m, n, k, kLibraryGranule).nb < n;
}

bool amx_kernel_here() {
  return bf16_gemm_amx() && amx::usable();
}

bool bf16_on_amx(int64_t m, int64_t n, int64_t k) {
  if (bf16_on_own_kernel()) return false;
  Bf16Path path = forced_bf16_path.load(std::memory_order_relaxed);
  if (path != Bf16Path::Auto) return path == Bf16Path::Amx;
  return amx_kernel_here() && amx_kernel_takes(m, n, k);
}

void sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
           int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  check_leading_dims("sgemm", trans_a, trans_b, m, n, k, lda, ldb, ldc);
  // The library for every piece of this product: by the CPU (its kernels'
  // instruction set, runtime/cpu/isa.h) and the shape alone.
  double flops = 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  bool avx512 = active_isa() == Isa::Avx512;
  SgemmPath path = forced_path.load(std::memory_order_relaxed);
  if (sgemm_on_own_kernel(trans_a, trans_b, m, n, k))
    return gemm_on_own(*own_kernel(), trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  bool onednn = path == SgemmPath::Auto ? avx512 || flops < kSerialFlops : path == SgemmPath::OneDnn;
  gemm_in_library(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc,
                  onednn ? onednn_piece : openblas_piece);
}

void bf16gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const BFloat16* a,
              int64_t lda, const BFloat16* b, int64_t ldb, float beta, BFloat16* c, int64_t ldc) {
  check_leading_dims("bf16gemm", trans_a, trans_b, m, n, k, lda, ldb, ldc);
  if (bf16_on_own_kernel())
    return gemm_on_own(*own_kernel(), trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  TS_CHECK(bf16_gemm_native(), "bf16gemm: this CPU has no bf16 matrix kernels in oneDNN (AVX512-BF16 or AMX), and "
           "its {} copy does not run bf16 products on the own f32 kernel; they run on f32 copies here "
           "(cpu::compute_dtype)", isa_name(active_isa()));
  if (bf16_on_amx(m, n, k))
    gemm_on_amx(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  else
    gemm_in_library(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, bf16_piece);
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
  // Profiled, each product also counts under its shape and kernel ("gemm NT
  // 1024 x 512 x 2048 own"): bench_step's products by shape.
  std::string shape;
  if (timed)
    shape = fmt::format("gemm {}{} {} x {} x {} {}", trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', m, n, k,
                        dtype == DType::BF16 && bf16_on_own_kernel()    ? "bf16 own"
                        : dtype != DType::F32                            ? dtype_name(dtype)
                        : sgemm_on_own_kernel(trans_a, trans_b, m, n, k) ? "own"
                                                                         : "library");
  auto t0 = timed ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  if (dtype == DType::F32) {
    sgemm(trans_a, trans_b, m, n, k, static_cast<float>(alpha), static_cast<const float*>(a), lda,
          static_cast<const float*>(b), ldb, static_cast<float>(beta), static_cast<float*>(c), ldc);
  } else if (dtype == DType::BF16) {
    bf16gemm(trans_a, trans_b, m, n, k, static_cast<float>(alpha), static_cast<const BFloat16*>(a), lda,
             static_cast<const BFloat16*>(b), ldb, static_cast<float>(beta), static_cast<BFloat16*>(c), ldc);
  } else if (dtype == DType::F64) {
    dgemm(trans_a, trans_b, m, n, k, alpha, static_cast<const double*>(a), lda,
          static_cast<const double*>(b), ldb, beta, static_cast<double*>(c), ldc);
  } else {
    TS_CHECK(false, "gemm: expected f32, bf16 or f64, got {}", dtype_name(dtype));
  }
  if (timed) {
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    const double flops = 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
    profiler::record_kernel("gemm", ms, flops);
    profiler::record_kernel(shape.c_str(), ms, flops);
  }
}

}  // namespace tessera::cpu
