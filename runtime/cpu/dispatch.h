// Type dispatch for the CPU kernels, and the shared per-element math they use.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "runtime/check.h"
#include "runtime/dtype.h"
#include "runtime/math.h"


namespace tessera::cpu {

// Calls f(T{}) with T the C++ type of a compute dtype (f32 or f64).
template <class F>
void dispatch_float(DType dt, const char* what, F&& f) {
  if (dt == DType::F32) return f(float{});
  if (dt == DType::F64) return f(double{});
  TS_CHECK(false, "{}: expected an f32 or f64 tensor here, got {}", what, dtype_name(dt));
}

// Calls f(S{}) with S the storage type of a floating dtype: f32, f64, and
// bf16/f16 as their storage structs, which kernels read and write as such and
// compute on in f32 (Compute<S>, load, store below).
template <class F>
void dispatch_floating(DType dt, const char* what, F&& f) {
  switch (dt) {
    case DType::F32: return f(float{});
    case DType::F64: return f(double{});
    case DType::BF16: return f(BFloat16{});
    case DType::F16: return f(Half{});
    default:
      TS_CHECK(false, "{}: expected a floating-point tensor here, got {}", what, dtype_name(dt));
  }
}

// The type a kernel computes in for storage type S: f32 for bf16 and f16, S
// itself otherwise. A 16-bit result is rounded once, from the f32 value.
template <class S>
using Compute =
    std::conditional_t<std::is_same_v<S, BFloat16> || std::is_same_v<S, Half>, float, S>;
template <class S>
TS_INLINE Compute<S> load(S v) {
  if constexpr (std::is_same_v<S, BFloat16>) return bf16_to_float(v);
  else if constexpr (std::is_same_v<S, Half>) return f16_to_float(v);
  else return v;
}
template <class S>
TS_INLINE S store(Compute<S> v) {
  if constexpr (std::is_same_v<S, BFloat16>) return float_to_bf16(v);
  else if constexpr (std::is_same_v<S, Half>) return float_to_f16(v);
  else return v;
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

// The per-element math shared with the other backends (runtime/math.h).
using math::bits_to_float;
using math::fast_erfc;
using math::fast_exp;
using math::fast_sigmoid;
using math::fast_tanh;
using math::normal_cdf;
using math::normal_pdf;

}  // namespace tessera::cpu
