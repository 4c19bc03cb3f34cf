// The host-side logic of the CUDA backend's GEMM plans (runtime/cuda/gemm_plan.h),
// on the CPU: the alignment a pointer promises, and plan keys that tell apart
// what a cuBLASLt algorithm depends on.
#include <random>

#include "runtime/cuda/gemm_plan.h"
#include "tests/helpers.h"

using namespace tessera;
using namespace tessera::cuda;

TEST_CASE("pointer_alignment: the largest power of two dividing the address, capped at 256", "[cuda][gemm]") {
  alignas(512) static unsigned char buf[4096];
  CHECK(pointer_alignment(buf) == 256);
  CHECK(pointer_alignment(nullptr) == 256);
  std::mt19937 rng(5);
  for (int i = 0; i < 2000; ++i) {
    const size_t off = rng() % 4000;
    const int got = pointer_alignment(buf + off);
    int want = 256;
    while (want > 1 && off % static_cast<size_t>(want) != 0) want /= 2;
    INFO("offset " << off);
    REQUIRE(got == want);
    // It divides the address, and twice it does not (below the cap).
    CHECK(reinterpret_cast<std::uintptr_t>(buf + off) % static_cast<std::uintptr_t>(got) == 0);
    if (got < 256) CHECK(reinterpret_cast<std::uintptr_t>(buf + off) % static_cast<std::uintptr_t>(2 * got) != 0);
  }
}

TEST_CASE("gemm plan keys: the slices of a batched product get the plan their alignment allows", "[cuda][gemm]") {
  alignas(256) static uint16_t a[64 * 1024], b[64 * 1024], c[64 * 1024];
  // bf16 [batch, 17, 24] x [batch, 24, 9]: the slices start at 408- and 216-element strides.
  const int64_t m = 17, k = 24, n = 9;
  auto key_of = [&](int64_t batch, bool tf32) {
    return gemm_key(DType::BF16, false, false, m, n, k, a + batch * m * k, k, b + batch * k * n, n,
                    c + batch * m * n, n, tf32);
  };
  const GemmKey first = key_of(0, false);
  CHECK(first.align_a == 256);
  CHECK(first.align_b == 256);
  CHECK(first.align_c == 256);
  const GemmKey second = key_of(1, false);  // 816, 432 and 306 bytes in
  CHECK(second.align_a == 16);
  CHECK(second.align_b == 16);
  CHECK(second.align_c == 2);
  CHECK(first != second);
  CHECK(key_of(1, false) == second);  // the same slice, the same plan
  CHECK(key_of(0, true) != first);    // TF32 is its own plan
  // Slices that promise the same alignment share a plan; the shape and
  // leading dimensions still tell products apart.
  const GemmKey shifted = gemm_key(DType::BF16, false, false, m, n, k, a + 128, k, b + 128, n, c + 128, n, false);
  CHECK(shifted == first);
  CHECK(gemm_key(DType::BF16, false, false, m, n, k, a, k + 1, b, n, c, n, false) != first);
  CHECK(gemm_key(DType::BF16, true, false, m, n, k, a, m, b, n, c, n, false) != first);
  CHECK(gemm_key(DType::F16, false, false, m, n, k, a, k, b, n, c, n, false) != first);
}
