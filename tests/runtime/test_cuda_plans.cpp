// The host-side logic of the CUDA backend, on the CPU: the alignment a
// pointer promises and GEMM plan keys that tell apart what a cuBLASLt
// algorithm depends on (runtime/cuda/gemm_plan.h); why no GPU can be used
// (runtime/cuda/diagnose.h).
#include <random>

#include "runtime/cuda/diagnose.h"
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

TEST_CASE("why no GPU can be used: a driver too old for the toolkit is named, not called no device", "[cuda]") {
  using R = CountResult;
  CHECK(unavailable_reason(R::Ok, 1, 13000, 13000, nullptr).empty());
  CHECK(unavailable_reason(R::Ok, 0, 13000, 13000, "") == "no CUDA device is visible (CUDA_VISIBLE_DEVICES='')");
  CHECK(unavailable_reason(R::NoDevice, 0, 13000, 13000, nullptr) == "no CUDA device is visible");
  CHECK_THAT(unavailable_reason(R::NoDriver, 0, 0, 13000, nullptr), Catch::Contains("no NVIDIA driver"));
  const std::string old = unavailable_reason(R::InsufficientDriver, 0, 12040, 13000, nullptr);
  CHECK_THAT(old, Catch::Contains("supports CUDA 12.4 but this build needs CUDA 13.0") &&
                      Catch::Contains("install a newer driver"));
  CHECK_THAT(unavailable_reason(R::Other, 0, 13000, 13000, nullptr, "cudaErrorUnknown (unknown error)"),
             Catch::Contains("cudaErrorUnknown"));
  CHECK(cuda_version_str(12080) == "12.8");
  CHECK(is_broken_install(R::InsufficientDriver));
  CHECK(is_broken_install(R::Other));
  CHECK_FALSE(is_broken_install(R::NoDriver));
  CHECK_FALSE(is_broken_install(R::NoDevice));
}
