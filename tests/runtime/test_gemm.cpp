// The CPU GEMMs (runtime/cpu/blas.h: oneDNN or OpenBLAS for f32, oneDNN's
// matmul for bf16, OpenBLAS for f64) against an f64 loop, at awkward sizes,
// every transpose, padded leading dimensions, alpha/beta, and from inside a
// parallel region (one thread per call).
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <type_traits>
#include <utility>
#include <vector>

#include "runtime/profiler.h"
#include "helpers.h"
#include "runtime/allocator.h"
#include "runtime/cpu/amx.h"
#include "runtime/cpu/blas.h"
#include "runtime/cpu/peak.h"
#include "runtime/cpu/dispatch.h"
#include "runtime/cpu/isa.h"
#include "runtime/parallel_for.h"

using namespace tessera;

namespace {

struct Case {
  bool ta, tb;
  int64_t m, n, k;
  int64_t pad_a, pad_b, pad_c;  // extra columns of each stored matrix
  double alpha, beta;
};

template <class T>
struct Operands {
  std::vector<T> a, b, c;
  int64_t lda, ldb, ldc;
};

template <class T>
Operands<T> make_operands(const Case& cs, std::mt19937& gen) {
  std::normal_distribution<double> dist;
  Operands<T> o;
  int64_t a_rows = cs.ta ? cs.k : cs.m, a_cols = cs.ta ? cs.m : cs.k;
  int64_t b_rows = cs.tb ? cs.n : cs.k, b_cols = cs.tb ? cs.k : cs.n;
  o.lda = a_cols + cs.pad_a;
  o.ldb = b_cols + cs.pad_b;
  o.ldc = cs.n + cs.pad_c;
  o.a.resize(static_cast<size_t>(std::max<int64_t>(a_rows * o.lda, 1)));
  o.b.resize(static_cast<size_t>(std::max<int64_t>(b_rows * o.ldb, 1)));
  o.c.resize(static_cast<size_t>(cs.m * o.ldc));
  for (auto& x : o.a) x = cpu::from_double<T>(dist(gen));
  for (auto& x : o.b) x = cpu::from_double<T>(dist(gen));
  for (auto& x : o.c) x = cpu::from_double<T>(dist(gen));
  return o;
}

// Checks c against the f64 product of o's operands, element by element, with
// the bound of a k-term dot product in T: |error| <= gamma * (|alpha| sum |a||b| + |beta c0|).
// bf16 accumulates in f32 and rounds the result once: gamma of f32, plus half
// a bf16 ulp of the result (2^-8 relative).
// beta == 0 ignores c0 entirely (BLAS: C need not be set), NaN included.
template <class T>
void check_product(const Case& cs, const Operands<T>& o, const std::vector<T>& c) {
  constexpr bool bf16 = std::is_same_v<T, BFloat16>;
  double eps = std::numeric_limits<std::conditional_t<bf16, float, T>>::epsilon();
  double gamma = 2.0 * static_cast<double>(cs.k + 2) * eps, rounding = bf16 ? std::ldexp(1.0, -8) : 0.0;
  int bad = 0;
  for (int64_t i = 0; i < cs.m; ++i) {
    for (int64_t j = 0; j < o.ldc; ++j) {
      double got = cpu::to_double(c[i * o.ldc + j]), c0 = cpu::to_double(o.c[i * o.ldc + j]);
      if (j >= cs.n) {  // padding of C is never written
        if (!(got == c0 || (std::isnan(got) && std::isnan(c0))) && bad++ < 5)
          FAIL_CHECK("C padding written at (" << i << "," << j << ")");
        continue;
      }
      double sum = 0, mag = 0;
      for (int64_t p = 0; p < cs.k; ++p) {
        double av = cpu::to_double(cs.ta ? o.a[p * o.lda + i] : o.a[i * o.lda + p]);
        double bv = cpu::to_double(cs.tb ? o.b[j * o.ldb + p] : o.b[p * o.ldb + j]);
        sum += av * bv;
        mag += std::fabs(av * bv);
      }
      double beta_c0 = cs.beta == 0 ? 0.0 : cs.beta * c0;
      double want = cs.alpha * sum + beta_c0;
      double bound = gamma * (std::fabs(cs.alpha) * mag + std::fabs(beta_c0)) + rounding * std::fabs(want) + 1e-300;
      if (!(std::fabs(got - want) <= bound) && bad++ < 5)
        FAIL_CHECK("C(" << i << "," << j << ") = " << got << ", want " << want << " +- " << bound
                        << " (ta " << cs.ta << " tb " << cs.tb << " m " << cs.m << " n " << cs.n
                        << " k " << cs.k << ")");
    }
  }
  CHECK(bad == 0);
}

// c = alpha op(A) op(B) + beta c through the CPU GEMM of T.
template <class T>
void gemm(const Case& cs, const Operands<T>& o, std::vector<T>& c) {
  if constexpr (std::is_same_v<T, BFloat16>)
    cpu::bf16gemm(cs.ta, cs.tb, cs.m, cs.n, cs.k, static_cast<float>(cs.alpha), o.a.data(), o.lda,
                  o.b.data(), o.ldb, static_cast<float>(cs.beta), c.data(), o.ldc);
  else if constexpr (std::is_same_v<T, float>)
    cpu::sgemm(cs.ta, cs.tb, cs.m, cs.n, cs.k, static_cast<float>(cs.alpha), o.a.data(), o.lda,
               o.b.data(), o.ldb, static_cast<float>(cs.beta), c.data(), o.ldc);
  else
    cpu::dgemm(cs.ta, cs.tb, cs.m, cs.n, cs.k, cs.alpha, o.a.data(), o.lda, o.b.data(), o.ldb,
               cs.beta, c.data(), o.ldc);
}

template <class T>
void run_case(const Case& cs, std::mt19937& gen, bool nan_c = false) {
  Operands<T> o = make_operands<T>(cs, gen);
  if (nan_c)
    for (int64_t i = 0; i < cs.m; ++i)
      for (int64_t j = 0; j < cs.n; ++j) o.c[i * o.ldc + j] = cpu::from_double<T>(std::numeric_limits<double>::quiet_NaN());
  std::vector<T> c = o.c;
  gemm(cs, o, c);
  check_product(cs, o, c);
}

std::vector<Case> random_cases(std::mt19937& gen, int count) {
  const int64_t sizes[] = {1, 2, 3, 7, 16, 17, 63, 64, 65, 130, 257};
  const double alphas[] = {1.0, -0.7, 2.5};
  const double betas[] = {0.0, 1.0, 0.3};
  std::uniform_int_distribution<int> pick(0, 10), pad(0, 5), two(0, 1), three(0, 2);
  std::vector<Case> cases;
  for (int i = 0; i < count; ++i)
    cases.push_back({two(gen) == 1, two(gen) == 1, sizes[pick(gen)], sizes[pick(gen)],
                     sizes[pick(gen)], pad(gen), pad(gen), pad(gen), alphas[three(gen)],
                     betas[three(gen)]});
  return cases;
}

// Every transpose pair at one odd shape, so none is left to chance; and shapes
// large enough for tiles and for chunks of k.
template <class T>
void run_every_transpose(std::mt19937& gen) {
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      run_case<T>({ta, tb, 37, 29, 101, 3, 0, 2, 1.0, 0.5}, gen);
      run_case<T>({ta, tb, 300, 270, 190, 1, 2, 3, -1.5, 0.5}, gen);
      run_case<T>({ta, tb, 40, 150, 2600, 0, 1, 0, 1.0, 1.0}, gen);
    }
}

// Forces a GEMM path (set_sgemm_path, set_bf16_path) for its lifetime.
template <class Path, Path (*Set)(Path)>
struct ForcedPath {
  explicit ForcedPath(Path path) : saved(Set(path)) {}
  ~ForcedPath() { Set(saved); }
  Path saved;
};

// Runs body once per f32 path (each library runs on any x86-64 CPU, the own
// kernel where the kernels' AVX2 or AVX-512 copy runs; Auto is what this CPU
// gets by default).
template <class F>
void for_each_path(F&& body) {
  for (auto [path, name] :
       {std::pair{cpu::SgemmPath::Auto, "auto"}, std::pair{cpu::SgemmPath::OneDnn, "oneDNN"},
        std::pair{cpu::SgemmPath::OpenBlas, "OpenBLAS"}, std::pair{cpu::SgemmPath::Own, "own kernel"}}) {
    if (path == cpu::SgemmPath::Own && !cpu::sgemm_own_kernel_here()) {
      CHECK_THROWS_WITH(cpu::set_sgemm_path(path), Catch::Contains("the own f32 kernel needs"));
      WARN("the kernels' baseline copy runs here: the own f32 kernel was not run");
      continue;
    }
    INFO("sgemm path " << name);
    ForcedPath<cpu::SgemmPath, cpu::set_sgemm_path> forced(path);
    body();
  }
}

// body() on each bf16 kernel: the automatic choice, oneDNN's forced, and
// Tessera's AMX kernel and the own f32 kernel forced where they can run.
template <class F>
void for_each_bf16_path(F&& body) {
  for (auto [path, name] : {std::pair{cpu::Bf16Path::Auto, "auto"}, std::pair{cpu::Bf16Path::OneDnn, "oneDNN"},
                            std::pair{cpu::Bf16Path::Amx, "AMX kernel"}, std::pair{cpu::Bf16Path::Own, "own kernel"}}) {
    if (path == cpu::Bf16Path::Amx && !cpu::amx::usable()) {
      CHECK_THROWS_WITH(cpu::set_bf16_path(path), Catch::Contains("the AMX kernel needs AMX-BF16 tiles"));
      WARN("no AMX tiles on this CPU: Tessera's AMX kernel was not run");
      continue;
    }
    if (path == cpu::Bf16Path::Own && !cpu::sgemm_own_kernel_here()) {
      CHECK_THROWS_WITH(cpu::set_bf16_path(path), Catch::Contains("the own f32 kernel needs"));
      continue;
    }
    INFO("bf16 path " << name);
    ForcedPath<cpu::Bf16Path, cpu::set_bf16_path> forced(path);
    body();
  }
}

// The same bits at 1, 2 and 3 threads (oneDNN's own threading changes them
// with the thread count), and the right product.
// Checks `result` against the same product on the kernels' other
// instruction-set copy (AVX2 <-> AVX-512), bit for bit; false where the CPU
// lacks one of them.
template <class T>
bool check_other_copy(const Case& cs, const Operands<T>& o, const std::vector<T>& result) {
  if (!cpu::isa_supported(cpu::Isa::Avx2) || !cpu::isa_supported(cpu::Isa::Avx512)) return false;
  const cpu::Isa saved = cpu::set_isa(cpu::active_isa() == cpu::Isa::Avx512 ? cpu::Isa::Avx2 : cpu::Isa::Avx512);
  std::vector<T> other = o.c;
  gemm(cs, o, other);
  cpu::set_isa(saved);
  CHECK(std::memcmp(other.data(), result.data(), result.size() * sizeof(T)) == 0);
  return true;
}

template <class T>
void check_same_bits_at_any_thread_count(const std::vector<Case>& cases, std::mt19937& gen) {
  int saved = num_threads();
  for (const Case& cs : cases) {
    Operands<T> o = make_operands<T>(cs, gen);
    std::vector<std::vector<T>> results;
    for (int threads : {1, 2, 3}) {
      set_num_threads(threads);
      std::vector<T> c = o.c;
      gemm(cs, o, c);
      results.push_back(std::move(c));
    }
    set_num_threads(saved);
    check_product(cs, o, results[0]);
    INFO("m " << cs.m << " n " << cs.n << " k " << cs.k);
    CHECK(std::memcmp(results[0].data(), results[1].data(), results[0].size() * sizeof(T)) == 0);
    CHECK(std::memcmp(results[0].data(), results[2].data(), results[0].size() * sizeof(T)) == 0);
  }
}

// Products called from every thread of a parallel loop, each on its own thread.
template <class T>
void check_from_parallel_loop(std::mt19937& gen, int count) {
  std::vector<Case> cases = random_cases(gen, count);
  std::vector<Operands<T>> ops;
  for (const Case& cs : cases) ops.push_back(make_operands<T>(cs, gen));
  std::vector<std::vector<T>> out(cases.size());
  for (size_t i = 0; i < cases.size(); ++i) out[i] = ops[i].c;
  parallel_for(0, static_cast<int64_t>(cases.size()), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) gemm(cases[i], ops[i], out[i]);
  });
  for (size_t i = 0; i < cases.size(); ++i) check_product(cases[i], ops[i], out[i]);
}

}  // namespace

TEMPLATE_TEST_CASE("CPU gemm matches an f64 loop at awkward sizes and every transpose", "[gemm]",
                   float, double) {
  for_each_path([] {
    std::mt19937 gen(20261130);
    for (const Case& cs : random_cases(gen, 120)) run_case<TestType>(cs, gen);
    run_every_transpose<TestType>(gen);
  });
}

TEMPLATE_TEST_CASE("CPU gemm with beta 0 ignores C, and k 0 scales C", "[gemm]", float, double) {
  for_each_path([] {
    std::mt19937 gen(7);
    run_case<TestType>({false, true, 33, 65, 17, 0, 1, 2, 1.0, 0.0}, gen, /*nan_c=*/true);
    run_case<TestType>({true, false, 64, 48, 3000, 0, 1, 2, 1.0, 0.0}, gen, /*nan_c=*/true);
    run_case<TestType>({false, true, 400, 300, 100, 0, 1, 2, 1.0, 0.0}, gen, /*nan_c=*/true);
    run_case<TestType>({true, false, 5, 9, 0, 0, 0, 1, 1.0, 0.5}, gen);
    run_case<TestType>({false, false, 5, 9, 0, 0, 0, 0, 1.0, 0.0}, gen, /*nan_c=*/true);
  });
}

TEST_CASE("CPU gemm called from every thread of a parallel loop", "[gemm]") {
  for_each_path([] {
    std::mt19937 gen(11);
    check_from_parallel_loop<float>(gen, 24);
  });
}

TEST_CASE("CPU gemm refuses a leading dimension narrower than its matrix", "[gemm]") {
  std::vector<float> a(64), b(64), c(64);
  CHECK_THROWS_WITH(
      cpu::sgemm(false, false, 4, 4, 4, 1.f, a.data(), 3, b.data(), 4, 0.f, c.data(), 4),
      Catch::Contains("sgemm: expected leading dimensions lda >= 4"));
  CHECK_THROWS_WITH(
      cpu::sgemm(false, true, 4, 5, 3, 1.f, a.data(), 3, b.data(), 2, 0.f, c.data(), 5),
      Catch::Contains("ldb >= 3"));
  std::vector<double> ad(64), bd(64), cd(64);
  CHECK_THROWS_WITH(
      cpu::dgemm(true, false, 6, 4, 2, 1.0, ad.data(), 6, bd.data(), 4, 0.0, cd.data(), 3),
      Catch::Contains("dgemm: expected leading dimensions lda >= 6, ldb >= 4, ldc >= 4"));
}

TEST_CASE("CPU sgemm gives the same bits at 1, 2 and 3 threads", "[gemm][determinism]") {
  // Shapes on every path: one piece, tiles of C, and chunks of a deep k.
  std::mt19937 gen(3);
  std::vector<Case> cases = {
      {true, false, 32, 32, 8192, 0, 0, 0, 1.0, 0.0},
      {true, false, 64, 64, 4099, 1, 2, 3, 1.0, 1.0},
      {false, true, 512, 64, 64, 0, 0, 0, 1.0, 0.0},
      {false, true, 1000, 260, 130, 0, 0, 0, -1.0, 0.5},
      {true, false, 260, 130, 1500, 0, 0, 0, 1.0, 0.0},
      {false, false, 17, 300, 700, 0, 0, 0, 1.0, 0.0},
      {true, true, 129, 257, 2049, 0, 0, 0, 0.5, 0.0},
  };
  for_each_path([&] { check_same_bits_at_any_thread_count<float>(cases, gen); });
}

// The own f32 kernel's promise (runtime/cpu/sgemm_kernel.h): a result is one
// chain of fused multiply-adds over k in order, so it depends on its row of A
// and column of B alone: any block of C computed as a product of its own
// gives the same bits as inside the whole product, and the AVX2 and AVX-512
// copies give the same bits.
TEST_CASE("the own f32 kernel: a result's bits depend on its row and column alone, in either copy",
          "[gemm][determinism]") {
  if (!cpu::sgemm_own_kernel_here()) {
    WARN("the kernels' baseline copy runs here: the own f32 kernel was not run");
    return;
  }
  ForcedPath<cpu::SgemmPath, cpu::set_sgemm_path> forced(cpu::SgemmPath::Own);
  std::mt19937 gen(29);
  // Tiles of C, edges in both dimensions, several blocks of k (none cut into chunks: 4+ tiles).
  for (Case cs : {Case{false, true, 301, 287, 700, 0, 0, 0, 1.0, 0.0}, Case{true, false, 533, 271, 517, 3, 1, 0, 1.0, 0.0},
                  Case{false, false, 290, 555, 259, 0, 0, 0, 1.0, 0.0}, Case{true, true, 513, 300, 300, 0, 2, 0, 1.0, 0.0}}) {
    INFO("ta " << cs.ta << " tb " << cs.tb << " m " << cs.m << " n " << cs.n << " k " << cs.k);
    Operands<float> o = make_operands<float>(cs, gen);
    std::vector<float> whole = o.c;
    gemm(cs, o, whole);
    check_product(cs, o, whole);
    // Rows [r0, r0 + rows) and columns [c0, c0 + cols), as a product of their own (a block
    // not on the whole product's tiles or panels).
    const int64_t r0 = 37, rows = cs.m - 60, c0 = 19, cols = cs.n - 40;
    const float* a0 = cs.ta ? o.a.data() + r0 : o.a.data() + r0 * o.lda;
    const float* b0 = cs.tb ? o.b.data() + c0 * o.ldb : o.b.data() + c0;
    std::vector<float> block(static_cast<size_t>(rows * cols));
    cpu::sgemm(cs.ta, cs.tb, rows, cols, cs.k, 1.f, a0, o.lda, b0, o.ldb, 0.f, block.data(), cols);
    int differ = 0;
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) differ += block[i * cols + j] != whole[(r0 + i) * o.ldc + c0 + j];
    CHECK(differ == 0);
    if (!check_other_copy(cs, o, whole)) WARN("one of AVX2 and AVX-512 is missing here: the copies were not compared");
  }
}

TEST_CASE("f32 products choose their kernel by the shape and the CPU alone", "[gemm]") {
  // Auto: the own kernel for the large weight gradients (TN, C at least 512
  // on a side and 2^20 results) and those of the wide projections (TN, C at
  // least 3x as tall as wide, 256 wide or more, over 1024 rows) with AVX-512
  // (benchmarks/README.md); the libraries elsewhere, and wherever B packed
  // and a block of 256 rows of A would pass 32 MiB. With AVX2 (no
  // AVX-512): the own kernel for every product with C at least 256 on each
  // side and 2^27 multiply-adds or more.
  const bool avx512_own = cpu::sgemm_own_kernel_here() && cpu::active_isa() == cpu::Isa::Avx512;
  if (cpu::active_isa() == cpu::Isa::Avx2) {
    CHECK(cpu::sgemm_on_own_kernel(false, true, 2048, 1024, 256));
    CHECK(cpu::sgemm_on_own_kernel(false, false, 1024, 256, 1025));
    CHECK(cpu::sgemm_on_own_kernel(true, false, 3072, 768, 1024));
    CHECK(cpu::sgemm_on_own_kernel(true, true, 512, 512, 2048));
    CHECK(cpu::sgemm_on_own_kernel(false, true, 1024, 1024, 256));    // 2^28: the default model's MLP
    CHECK(cpu::sgemm_on_own_kernel(false, true, 1024, 768, 256));     // its fused QKV, 2^27.6
    CHECK(cpu::sgemm_on_own_kernel(false, false, 1024, 256, 512));    // 2^27 exactly
    CHECK_FALSE(cpu::sgemm_on_own_kernel(false, false, 1024, 256, 511));
    CHECK_FALSE(cpu::sgemm_on_own_kernel(true, false, 256, 256, 1024));  // its attention projection's weight gradient
    CHECK_FALSE(cpu::sgemm_on_own_kernel(false, true, 4096, 255, 2048));
    CHECK_FALSE(cpu::sgemm_on_own_kernel(true, false, 64, 64, 64));
    CHECK(cpu::sgemm_on_own_kernel(true, false, 50257, 768, 2048));  // a vocabulary's weight gradient: B is 6 MiB
    CHECK_FALSE(cpu::sgemm_on_own_kernel(false, true, 2048, 50257, 768));  // its logits: B, the weight, 147 MiB
    CHECK_FALSE(cpu::sgemm_on_own_kernel(false, false, 2048, 768, 50257));  // their input gradient: 147 MiB
    ForcedPath<cpu::SgemmPath, cpu::set_sgemm_path> forced(cpu::SgemmPath::OpenBlas);
    CHECK_FALSE(cpu::sgemm_on_own_kernel(false, true, 2048, 1024, 256));
  } else {
    CHECK(cpu::sgemm_on_own_kernel(true, false, 768, 3072, 1024) == avx512_own);
    CHECK_FALSE(cpu::sgemm_on_own_kernel(false, true, 1024, 3072, 768));
    CHECK_FALSE(cpu::sgemm_on_own_kernel(false, false, 1024, 768, 3072));
    CHECK_FALSE(cpu::sgemm_on_own_kernel(true, false, 64, 64, 64));
    CHECK(cpu::sgemm_on_own_kernel(true, false, 1024, 256, 2048) == avx512_own);
    CHECK(cpu::sgemm_on_own_kernel(true, false, 768, 256, 1024) == avx512_own);
    CHECK_FALSE(cpu::sgemm_on_own_kernel(true, false, 767, 256, 1024));
    CHECK_FALSE(cpu::sgemm_on_own_kernel(true, false, 768, 256, 1023));
    CHECK_FALSE(cpu::sgemm_on_own_kernel(true, false, 255 * 3, 255, 1024));
    CHECK_FALSE(cpu::sgemm_on_own_kernel(true, false, 256, 1024, 1024));
    CHECK_FALSE(cpu::sgemm_on_own_kernel(true, false, 256, 256, 1024));
    CHECK_FALSE(cpu::sgemm_on_own_kernel(false, true, 768, 256, 1024));
    CHECK_FALSE(cpu::sgemm_on_own_kernel(true, false, 512, 512, 2048));
    CHECK(cpu::sgemm_on_own_kernel(true, false, 2048, 512, 1024) == avx512_own);
    CHECK(cpu::sgemm_on_own_kernel(true, false, 3072, 768, 2048) == avx512_own);
    CHECK(cpu::sgemm_on_own_kernel(true, false, 50257, 768, 2048) == avx512_own);  // B is 6 MiB
    CHECK_FALSE(cpu::sgemm_on_own_kernel(true, false, 4096, 16384, 1024));  // B would be 64 MiB
  }
  if (cpu::sgemm_own_kernel_here()) {
    ForcedPath<cpu::SgemmPath, cpu::set_sgemm_path> forced(cpu::SgemmPath::Own);
    CHECK(cpu::sgemm_on_own_kernel(false, false, 3, 5, 7));
    // What the own kernel takes from the allocator: B packed whole, and per
    // thread a row block of A packed (at most 256 rows) with its waiting sums.
    const int saved = num_threads();
    for (int threads : {1, 2, 3}) {
      set_num_threads(threads);
      const int64_t f32 = cpu::gemm_scratch(DType::F32, true, false, 1000, 600, 700, cpu::Bf16Kernel::Library).f32_packed;
      CHECK(f32 >= 608 * 700 + threads * 6 * 700);
      CHECK(f32 <= 608 * 700 + threads * (258 * 700 + 258 * 608));
    }
    set_num_threads(saved);
  }
  ForcedPath<cpu::SgemmPath, cpu::set_sgemm_path> forced(cpu::SgemmPath::OneDnn);
  CHECK_FALSE(cpu::sgemm_on_own_kernel(true, false, 768, 3072, 1024));
  CHECK(cpu::gemm_scratch(DType::F32, true, false, 1000, 600, 700, cpu::Bf16Kernel::Library).f32_packed == 0);
}

TEST_CASE("CPU bf16 gemm: f32 accumulation rounded once, every transpose, the same bits at any thread count",
          "[gemm][bf16]") {
  std::vector<BFloat16> a(64), b(64), c(64);
  if (!cpu::bf16_gemm_native() && !cpu::bf16_on_own_kernel()) {  // the baseline copy on a CPU without them
    CHECK(ops::compute_dtype(Device::cpu(), KernelFamily::Matmul, DType::BF16) == DType::F32);
    CHECK_THROWS_WITH(cpu::bf16gemm(false, false, 4, 4, 4, 1.f, a.data(), 4, b.data(), 4, 0.f, c.data(), 4),
                      Catch::Contains("no bf16 matrix kernels"));
    WARN("neither oneDNN's bf16 kernels nor the own f32 kernel run here: the bf16 GEMM was not run");
    return;
  }
  CHECK(ops::compute_dtype(Device::cpu(), KernelFamily::Matmul, DType::BF16) == DType::BF16);
  CHECK_THROWS_WITH(cpu::bf16gemm(false, false, 4, 4, 4, 1.f, a.data(), 3, b.data(), 4, 0.f, c.data(), 4),
                    Catch::Contains("bf16gemm: expected leading dimensions lda >= 4"));
  for_each_bf16_path([] {
    std::mt19937 gen(20261201);
    for (const Case& cs : random_cases(gen, 80)) run_case<BFloat16>(cs, gen);
    run_every_transpose<BFloat16>(gen);
    run_case<BFloat16>({true, false, 64, 48, 3000, 0, 1, 2, 1.0, 0.0}, gen, /*nan_c=*/true);
    run_case<BFloat16>({true, false, 5, 9, 0, 0, 0, 1, 1.0, 0.5}, gen);
    run_case<BFloat16>({false, false, 5, 9, 0, 0, 0, 0, 1.0, 0.0}, gen, /*nan_c=*/true);
    // The AMX kernel's edges: panels of 32 rows and columns, blocks of 32
    // along k, chunks of 8 blocks, tiles of C and chunks of k across pieces.
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        run_case<BFloat16>({ta, tb, 97, 545, 291, 1, 0, 3, 1.0, 0.0}, gen);
        run_case<BFloat16>({ta, tb, 288, 320, 512, 0, 2, 0, -0.5, 1.0}, gen);
        run_case<BFloat16>({ta, tb, 33, 31, 1025, 3, 0, 1, 1.0, 0.3}, gen);
      }
    check_same_bits_at_any_thread_count<BFloat16>({{true, false, 32, 32, 8192, 0, 0, 0, 1.0, 0.0},
                                                   {false, true, 1000, 260, 130, 0, 0, 0, -1.0, 0.5},
                                                   {true, true, 129, 257, 2049, 0, 0, 0, 0.5, 0.0},
                                                   {false, false, 300, 600, 777, 1, 1, 1, 1.0, 0.0}},
                                                  gen);
    check_from_parallel_loop<BFloat16>(gen, 24);
  });
}

// Where oneDNN has no bf16 kernels (AVX2; forced elsewhere), bf16 products
// run on the own f32 kernel, which widens the operands as it packs them and
// rounds each result as it stores it (runtime/cpu/sgemm_kernel.h): bit for
// bit the own kernel's f32 product of the widened operands (beta's C
// widened too), rounded once as float_to_bf16 rounds. Small integers make
// results that tie halfway between two bf16 values; NaN, infinities and
// results past bf16's largest go through the vector rounding's special cases.
TEST_CASE("bf16 on the own kernel: the f32 kernel's bits on the widened operands, rounded once",
          "[gemm][bf16][determinism]") {
  // Auto: the AVX2 copy alone, where oneDNN has no bf16 kernels.
  CHECK(cpu::bf16_on_own_kernel() == (!cpu::bf16_gemm_native() && cpu::active_isa() == cpu::Isa::Avx2));
  if (!cpu::sgemm_own_kernel_here()) {
    CHECK_FALSE(cpu::bf16_on_own_kernel());
    WARN("the kernels' baseline copy runs here: the own kernel's bf16 products were not run");
    return;
  }
  ForcedPath<cpu::Bf16Path, cpu::set_bf16_path> forced(cpu::Bf16Path::Own);
  CHECK(cpu::bf16_on_own_kernel());
  CHECK(cpu::bf16_kernel(1024, 1024, 256) == cpu::Bf16Kernel::Own);
  CHECK(ops::compute_dtype(Device::cpu(), KernelFamily::Matmul, DType::BF16) == DType::BF16);
  std::mt19937 gen(20261207);
  auto widen = [](const std::vector<BFloat16>& x) {
    std::vector<float> w(x.size());
    for (size_t i = 0; i < x.size(); ++i) w[i] = bf16_to_float(x[i]);
    return w;
  };
  auto check = [&](const Case& cs, const Operands<BFloat16>& o) {
    INFO("ta " << cs.ta << " tb " << cs.tb << " m " << cs.m << " n " << cs.n << " k " << cs.k << " alpha "
               << cs.alpha << " beta " << cs.beta);
    std::vector<BFloat16> c = o.c;
    gemm(cs, o, c);
    std::vector<float> a32 = widen(o.a), b32 = widen(o.b), c32 = widen(o.c);
    {
      ForcedPath<cpu::SgemmPath, cpu::set_sgemm_path> own(cpu::SgemmPath::Own);
      cpu::sgemm(cs.ta, cs.tb, cs.m, cs.n, cs.k, static_cast<float>(cs.alpha), a32.data(), o.lda, b32.data(), o.ldb,
                 static_cast<float>(cs.beta), c32.data(), o.ldc);
    }
    int differ = 0;
    for (int64_t i = 0; i < cs.m; ++i)
      for (int64_t j = 0; j < o.ldc; ++j) {  // the padding past n untouched
        const size_t at = static_cast<size_t>(i * o.ldc + j);
        const uint16_t want = j < cs.n ? float_to_bf16(c32[at]).bits : o.c[at].bits;
        differ += c[at].bits != want;
      }
    CHECK(differ == 0);
    check_other_copy(cs, o, c);
  };
  for (const Case& cs : random_cases(gen, 40)) check(cs, make_operands<BFloat16>(cs, gen));
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (Case cs : {Case{ta, tb, 97, 545, 291, 1, 0, 3, 1.0, 0.0}, Case{ta, tb, 301, 66, 700, 0, 2, 0, -0.5, 1.0},
                      Case{ta, tb, 13, 7, 1, 3, 0, 1, 1.0, 0.3}, Case{ta, tb, 6, 16, 256, 0, 0, 0, 2.0, 0.0}}) {
        check(cs, make_operands<BFloat16>(cs, gen));
        // Small integers: sums exact in f32 and often halfway between two bf16 values.
        Operands<BFloat16> o = make_operands<BFloat16>(cs, gen);
        std::uniform_int_distribution<int> small(-9, 9);
        for (auto& x : o.a) x = float_to_bf16(static_cast<float>(small(gen)));
        for (auto& x : o.b) x = float_to_bf16(static_cast<float>(small(gen)));
        check(cs, o);
      }
  // NaN, infinities and overflow past bf16's largest value in some rows.
  Case special{false, true, 40, 37, 300, 0, 0, 0, 1.0, 0.0};
  Operands<BFloat16> o = make_operands<BFloat16>(special, gen);
  o.a[3 * o.lda + 5] = float_to_bf16(std::numeric_limits<float>::quiet_NaN());
  o.a[7 * o.lda + 2] = float_to_bf16(std::numeric_limits<float>::infinity());
  o.a[9 * o.lda + 4] = float_to_bf16(-std::numeric_limits<float>::infinity());
  for (int64_t kk = 0; kk < special.k; ++kk) o.a[11 * o.lda + kk] = float_to_bf16(3.0e38f);
  check(special, o);
  // Chosen sums (k = 2, B's columns (1, 0), (1, 1) and (1.5, 0)): f32 results
  // that round up to infinity (1.9921875 + 0.005859375 times 2^127: f32
  // 0x7f7fc000, past bf16's largest finite value and the halfway point),
  // ties to even in both directions ((1 + 2^-7) * 1.5 and (1 + 3 * 2^-7) *
  // 1.5) and a sum just below a halfway point (1 + 2^-8 - 2^-15).
  {
    const Case chosen{false, false, 4, 3, 2, 0, 0, 0, 1.0, 0.0};
    Operands<BFloat16> q = make_operands<BFloat16>(chosen, gen);
    const float a_rows[4][2] = {{0x1.fep127f, 0x1.8p119f},  // bf16's largest (0x7f7f) and 0.005859375 * 2^127
                                {0x1.02p0f, 0.0f},
                                {0x1.06p0f, 0.0f},
                                {1.0f, 0x1.fcp-9f}};  // 2^-8 - 2^-15
    const float b_rows[2][3] = {{1.0f, 1.0f, 1.5f}, {0.0f, 1.0f, 0.0f}};
    for (int64_t i = 0; i < 4; ++i)
      for (int64_t kk = 0; kk < 2; ++kk) q.a[i * q.lda + kk] = float_to_bf16(a_rows[i][kk]);
    for (int64_t kk = 0; kk < 2; ++kk)
      for (int64_t j = 0; j < 3; ++j) q.b[kk * q.ldb + j] = float_to_bf16(b_rows[kk][j]);
    check(chosen, q);
    std::vector<BFloat16> c(q.c.size());
    cpu::bf16gemm(false, false, 4, 3, 2, 1.f, q.a.data(), q.lda, q.b.data(), q.ldb, 0.f, c.data(), q.ldc);
    CHECK(c[0 * q.ldc + 1].bits == 0x7f80);  // +inf
    CHECK(c[1 * q.ldc + 2].bits == float_to_bf16(0x1.84p0f).bits);  // 0x1.83p0, a tie: up to even
    CHECK(c[2 * q.ldc + 2].bits == float_to_bf16(0x1.88p0f).bits);  // 0x1.89p0, a tie: down to even
    CHECK(c[3 * q.ldc + 1].bits == float_to_bf16(1.0f).bits);  // below halfway: down
  }
  // The same bits at any thread count, and called from a parallel loop.
  check_same_bits_at_any_thread_count<BFloat16>({{true, false, 513, 300, 700, 0, 0, 0, 1.0, 0.0},
                                                 {false, true, 1000, 260, 130, 0, 0, 0, -1.0, 0.5}},
                                                gen);
  check_from_parallel_loop<BFloat16>(gen, 12);
}

TEST_CASE("bf16 linear on the own kernel reads its operands where they lie: no f32 copy of them",
          "[gemm][bf16]") {
  if (!cpu::sgemm_own_kernel_here()) {
    WARN("the kernels' baseline copy runs here: the own kernel's bf16 products were not run");
    return;
  }
  ForcedPath<cpu::Bf16Path, cpu::set_bf16_path> forced(cpu::Bf16Path::Own);
  // The kernel's scratch grows with the threads (a row block of A each): two here.
  const int saved_threads = num_threads();
  set_num_threads(2);
  // 600 x 1000 @ 1000 x 700: f32 copies of x and w alone would take 5.2 MB.
  Tensor x = ops::to(randn({600, 1000}, 11), DType::BF16), w = ops::to(randn({700, 1000}, 12), DType::BF16);
  Tensor bias = ops::to(randn({700}, 13), DType::BF16);
  Tensor y = ops::linear(x, w, bias);  // warm the allocator's cache
  reset_peak_memory_stats();
  const int64_t before = memory_stats().allocated_bytes;
  y = Tensor();
  y = ops::linear(x, w, bias);
  const int64_t rise = memory_stats().peak_allocated_bytes - before;
  // The new result takes the place of the old one: the rise is the kernel's
  // packed f32 operands (B whole, a block of A per thread) alone, less than
  // f32 copies of the operands would take.
  const cpu::GemmScratch scratch =
      cpu::gemm_scratch(DType::BF16, false, true, 600, 700, 1000, cpu::Bf16Kernel::Own);
  set_num_threads(saved_threads);
  CHECK(rise == scratch.f32_packed * 4);
  CHECK(rise < (600 + 700) * 1000 * 4);
  // And the numbers: the f32 product of the same values, rounded once.
  auto f = [](const Tensor& t) { return ops::to(t, DType::F32); };
  ForcedPath<cpu::SgemmPath, cpu::set_sgemm_path> own(cpu::SgemmPath::Own);
  CHECK(testing::equal(y, ops::to(ops::linear(f(x), f(w), f(bias)), DType::BF16)));
}

TEST_CASE("bf16 products choose their kernel by the shape and the CPU alone", "[gemm][bf16]") {
  // Auto: Tessera's AMX kernel where oneDNN would use AMX and C is wider than
  // a tile of the grid (256 columns); oneDNN (its own AMX kernel, on dense
  // destinations) on full-width tiles; oneDNN wherever there are no tiles.
  const bool own = cpu::bf16_gemm_amx() && cpu::amx::usable();
  CHECK(cpu::bf16_on_amx(1024, 1024, 256) == own);
  CHECK(cpu::bf16_on_amx(2048, 3072, 768) == own);
  CHECK_FALSE(cpu::bf16_on_amx(1024, 256, 1024));
  CHECK_FALSE(cpu::bf16_on_amx(3, 5, 7));
  {
    ForcedPath<cpu::Bf16Path, cpu::set_bf16_path> forced(cpu::Bf16Path::OneDnn);
    CHECK_FALSE(cpu::bf16_on_amx(1024, 1024, 256));
  }
  if (cpu::amx::usable()) {
    ForcedPath<cpu::Bf16Path, cpu::set_bf16_path> forced(cpu::Bf16Path::Amx);
    CHECK(cpu::bf16_on_amx(1024, 256, 1024));
    CHECK(cpu::bf16_on_amx(3, 5, 7));
  }
}

TEST_CASE("bf16 matmul and linear compute natively where oneDNN can: the f32 result rounded once, within the "
          "accumulation bound",
          "[gemm][bf16]") {
  // The ops on bf16 tensors against the same ops on f32 copies of the same
  // (already rounded) values: forward, the linear's two backward products and
  // a batched matmul with a broadcast operand, at awkward sizes.
  Tensor x = ops::to(randn({3, 37, 70}, 1), DType::BF16), w = ops::to(randn({45, 70}, 2), DType::BF16);
  Tensor bias = ops::to(randn({45}, 3), DType::BF16), g = ops::to(randn({3, 37, 45}, 4), DType::BF16);
  Tensor y = ops::to(randn({70, 19}, 5), DType::BF16);
  auto f = [](const Tensor& t) { return ops::to(t, DType::F32); };
  auto close = [](const std::string& what, const Tensor& low, const Tensor& ref32, double k) {
    INFO(what);
    CHECK(low.dtype() == DType::BF16);
    // One bf16 rounding of the result, plus f32 accumulation over k terms of N(0,1) products.
    CHECK(testing::allclose(ops::to(low, DType::F32), ref32, std::ldexp(1.0, -8), 4 * k * 6e-8 * std::sqrt(k)));
  };
  close("linear", ops::linear(x, w, bias), ops::linear(f(x), f(w), f(bias)), 70);
  TensorList d = ops::linear_backward(g, x, w, {true, true, false});
  TensorList d32 = ops::linear_backward(f(g), f(x), f(w), {true, true, false});
  close("linear dx", d[0], d32[0], 45);
  close("linear dW", d[1], d32[1], 111);
  close("batched matmul", ops::matmul(x, y), ops::matmul(f(x), f(y)), 70);
}

TEST_CASE("this CPU's measured peaks", "[gemm][peak]") {
  using cpu::PeakUnit;
  cpu::Peak fma = cpu::measure_peak(PeakUnit::Fma, 1);
  INFO(fma.unit << " " << fma.flops / 1e9 << " GFLOP/s");
  // Any x86-64 core of the last decade issues more than 4 and fewer than 1000 GFLOP/s of f32 FMAs.
  CHECK(fma.flops > 4e9);
  CHECK(fma.flops < 1e12);
  for (PeakUnit unit : {PeakUnit::Bf16Dot, PeakUnit::Amx}) {
    cpu::Peak p = cpu::measure_peak(unit, 1);
    INFO(p.unit << " " << p.flops / 1e9 << " GFLOP/s");
    CHECK((p.flops > 0) == cpu::has_peak_unit(unit));
  }
  // bf16's unit is the one its products run on: oneDNN's AMX or AVX512-BF16 kernels, else f32 FMAs.
  const std::string bf16 = cpu::measure_dtype_peak(DType::BF16, 1).unit;
  if (cpu::bf16_gemm_amx()) CHECK(bf16 == "AMX");
  else if (cpu::bf16_gemm_native()) CHECK(bf16 == "AVX512-BF16");
  else CHECK(bf16 == fma.unit);
  CHECK(std::string(cpu::measure_dtype_peak(DType::F32, 1).unit) == fma.unit);
}

TEST_CASE("the profiler counts each product's time and FLOPs (bench_step's GEMM floor)", "[gemm][profiler]") {
  // 2 m n k each: a [13, 5] x [5, 7] product, and its transposed-operand twin.
  Tensor a = randn({13, 5}, 3), b = randn({5, 7}, 4);
  profiler::reset();
  profiler::enable(true);
  Tensor c = ops::matmul(a, b);
  Tensor d = ops::matmul(ops::transpose(b, 0, 1), ops::transpose(a, 0, 1));
  profiler::enable(false);
  const profiler::Entry e = profiler::kernel_time("gemm");
  CHECK(e.calls == 2);
  CHECK(e.flops == 2.0 * (2 * 13 * 7 * 5));
  CHECK(e.total_ms >= 0);
  // By shape and kernel too: the twin multiplies the transposed views as they lie.
  const std::vector<profiler::Entry> shapes = profiler::kernel_summary("gemm ");
  REQUIRE(shapes.size() == 2);
  double ms = 0;
  for (const profiler::Entry& s : shapes) {
    INFO(s.name);
    CHECK((s.name == "gemm NN 13 x 7 x 5 library" || s.name == "gemm TT 7 x 13 x 5 library"));
    CHECK(s.calls == 1);
    CHECK(s.flops == 2.0 * 13 * 7 * 5);
    ms += s.total_ms;
  }
  CHECK(ms == Approx(e.total_ms));
  CHECK(shapes[0].total_ms >= shapes[1].total_ms);  // most time first
  profiler::reset();
  CHECK(profiler::kernel_time("gemm").flops == 0);
  CHECK(profiler::kernel_summary("gemm ").empty());
}
