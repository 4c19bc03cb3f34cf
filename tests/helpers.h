// Shared test utilities: random inputs, comparisons with clear failure output.
#pragma once

#include <catch2/catch.hpp>

#include <cmath>
#include <string>
#include <vector>

#include "runtime/ops.h"
#include "runtime/random.h"

namespace tessera::testing {

// Built with ThreadSanitizer (make tsan)? Tests that race on purpose, to show
// that the asynchronous device catches a missing wait, step aside there.
constexpr bool kThreadSanitizer =
#if defined(__SANITIZE_THREAD__)
    true;
#else
    false;
#endif

// Largest |a - b| / (atol + rtol * |b|) over all elements; <= 1 means close.
inline double close_ratio(const Tensor& a, const Tensor& b, double rtol, double atol) {
  REQUIRE(a.shape() == b.shape());
  auto va = a.to_vector<double>(), vb = b.to_vector<double>();
  double worst = 0;
  for (size_t i = 0; i < va.size(); ++i) {
    if (std::isnan(va[i]) && std::isnan(vb[i])) continue;
    double diff = std::fabs(va[i] - vb[i]);
    double r = diff == 0 ? 0.0 : diff / (atol + rtol * std::fabs(vb[i]));
    if (!(r <= worst)) worst = r;  // NaN propagates
  }
  return worst;
}

inline bool allclose(const Tensor& a, const Tensor& b, double rtol = 1e-5, double atol = 1e-6) {
  return close_ratio(a, b, rtol, atol) <= 1.0;
}

inline double max_abs_diff(const Tensor& a, const Tensor& b) {
  auto va = a.to_vector<double>(), vb = b.to_vector<double>();
  REQUIRE(va.size() == vb.size());
  double m = 0;
  for (size_t i = 0; i < va.size(); ++i) m = std::max(m, std::fabs(va[i] - vb[i]));
  return m;
}

inline bool equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.to_vector<double>() == b.to_vector<double>();
}

}  // namespace tessera::testing

#define CHECK_CLOSE(a, b, rtol, atol)                                                    \
  do {                                                                                   \
    double ratio_ = ::tessera::testing::close_ratio((a), (b), (rtol), (atol));           \
    INFO("close ratio " << ratio_ << " (<= 1 passes); max |diff| "                        \
                        << ::tessera::testing::max_abs_diff((a), (b)));                  \
    CHECK(ratio_ <= 1.0);                                                                \
  } while (0)
