// Type dispatch and the vectorisable math the CPU kernels share.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "runtime/check.h"
#include "runtime/dtype.h"

// Force-inlined so that loops calling these vectorise.
#define TS_INLINE __attribute__((always_inline)) inline

namespace tessera::cpu {

// Calls f(T{}) with T the C++ type of a compute dtype (f32 or f64).
template <class F>
void dispatch_float(DType dt, const char* what, F&& f) {
  if (dt == DType::F32) return f(float{});
  if (dt == DType::F64) return f(double{});
  TS_CHECK(false, "{}: expected an f32 or f64 tensor here, got {}", what, dtype_name(dt));
}

// Calls f(T{}) for every dtype (bf16/f16 as their storage structs).
template <class F>
void dispatch_all(DType dt, F&& f) {
  switch (dt) {
    case DType::F32: return f(float{});
    case DType::F64: return f(double{});
    case DType::BF16: return f(BFloat16{});
    case DType::F16: return f(Half{});
    case DType::I32: return f(int32_t{});
    case DType::I64: return f(int64_t{});
    case DType::Bool: return f(bool{});
  }
}

// Element conversions through the widest useful type.
template <class T>
inline double to_double(T v) {
  if constexpr (std::is_same_v<T, BFloat16>) return bf16_to_float(v);
  else if constexpr (std::is_same_v<T, Half>) return f16_to_float(v);
  else return static_cast<double>(v);
}
template <class T>
inline T from_double(double v) {
  if constexpr (std::is_same_v<T, BFloat16>) return float_to_bf16(static_cast<float>(v));
  else if constexpr (std::is_same_v<T, Half>) return float_to_f16(static_cast<float>(v));
  else if constexpr (std::is_same_v<T, bool>) return v != 0.0;
  else return static_cast<T>(v);
}

TS_INLINE float bits_to_float(int32_t i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}

// exp for f32 without branches, so loops of it vectorise: range reduction to
// r in [-ln2/2, ln2/2], a degree-6 polynomial (Cephes coefficients, ~1 ulp),
// and 2^n applied as two normal powers of two (so results near FLT_MAX and
// denormal results are right). Underflows to 0 below -104; overflows to inf
// above ln(FLT_MAX); NaN propagates.
TS_INLINE float fast_exp(float x) {
  // Ternaries, not fmin/fmax: those are library calls that block vectorisation.
  float xc = x < -104.0f ? -104.0f : (x > 88.72283905f ? 88.72283905f : x);
  float n = std::nearbyint(xc * 1.44269504088896341f);
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t ni = static_cast<int32_t>(n);
  int32_t n1 = ni >> 1, n2 = ni - n1;
  float y = p * bits_to_float((n1 + 127) << 23) * bits_to_float((n2 + 127) << 23);
  y = x < -104.0f ? 0.0f : y;
  y = x > 88.72283905f ? INFINITY : y;
  return x != x ? x : y;
}
TS_INLINE double fast_exp(double x) { return std::exp(x); }

// tanh: an odd polynomial near 0 (Cephes tanhf), 1 - 2/(e^{2|x|}+1) elsewhere.
TS_INLINE float fast_tanh(float x) {
  float ax = std::fabs(x);
  float z = x * x;
  float small = ((((-5.70498872745e-3f * z + 2.06390887954e-2f) * z - 5.37397155531e-2f) * z +
                  1.33314422036e-1f) * z - 3.33332819422e-1f) * z * x + x;
  float e = fast_exp(2.0f * (ax < 9.0f ? ax : 9.0f));
  float big = 1.0f - 2.0f / (e + 1.0f);
  big = std::copysign(big, x);
  return ax < 0.625f ? small : big;
}
TS_INLINE double fast_tanh(double x) { return std::tanh(x); }

TS_INLINE float fast_sigmoid(float x) { return 1.0f / (1.0f + fast_exp(-x)); }
TS_INLINE double fast_sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// erfc with fractional error < 1.2e-7 everywhere (Numerical Recipes' erfcc).
TS_INLINE float fast_erfc(float x) {
  float z = std::fabs(x);
  float t = 1.0f / (1.0f + 0.5f * z);
  float p = -0.82215223f + t * 0.17087277f;
  p = 1.48851587f + t * p;
  p = -1.13520398f + t * p;
  p = 0.27886807f + t * p;
  p = -0.18628806f + t * p;
  p = 0.09678418f + t * p;
  p = 0.37409196f + t * p;
  p = 1.00002368f + t * p;
  float ans = t * fast_exp(-z * z - 1.26551223f + t * p);
  return x >= 0.0f ? ans : 2.0f - ans;
}
TS_INLINE double fast_erfc(double x) { return std::erfc(x); }

// Standard normal CDF and density.
template <class T>
TS_INLINE T normal_cdf(T x) {
  return T(0.5) * fast_erfc(-x * T(0.70710678118654752440));
}
template <class T>
TS_INLINE T normal_pdf(T x) {
  return T(0.39894228040143267794) * fast_exp(T(-0.5) * x * x);
}

}  // namespace tessera::cpu
