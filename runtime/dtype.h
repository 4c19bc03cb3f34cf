// Element types. bf16 and f16 are storage types on the CPU: kernels load them
// into f32, compute, and round back to nearest-even.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

namespace tessera {

enum class DType : uint8_t { F32, F64, BF16, F16, I32, I64, Bool };

size_t dtype_size(DType dt);
const char* dtype_name(DType dt);  // "f32", "bf16", ...
DType dtype_from_name(const std::string& name);  // throws on an unknown name
bool is_floating(DType dt);
bool is_integral(DType dt);  // i32, i64, bool

// The type a float kernel computes in: f64 for f64, f32 for every other float.
inline DType compute_dtype(DType dt) { return dt == DType::F64 ? DType::F64 : DType::F32; }

struct BFloat16 {
  uint16_t bits;
};
struct Half {
  uint16_t bits;
};

// f32 -> bf16 with round-to-nearest-even; NaN stays NaN (quiet).
inline BFloat16 float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {static_cast<uint16_t>((u >> 16) | 0x0040u)};
  uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
  return {static_cast<uint16_t>((u + rounding_bias) >> 16)};
}
inline float bf16_to_float(BFloat16 h) {
  uint32_t u = static_cast<uint32_t>(h.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

Half float_to_f16(float f);  // round-to-nearest-even, subnormals, overflow to inf
float f16_to_float(Half h);

// Maps a C++ element type to its DType (for typed data access).
template <class T>
struct DTypeOf;
template <>
struct DTypeOf<float> {
  static constexpr DType value = DType::F32;
};
template <>
struct DTypeOf<double> {
  static constexpr DType value = DType::F64;
};
template <>
struct DTypeOf<BFloat16> {
  static constexpr DType value = DType::BF16;
};
template <>
struct DTypeOf<Half> {
  static constexpr DType value = DType::F16;
};
template <>
struct DTypeOf<int32_t> {
  static constexpr DType value = DType::I32;
};
template <>
struct DTypeOf<int64_t> {
  static constexpr DType value = DType::I64;
};
template <>
struct DTypeOf<bool> {
  static constexpr DType value = DType::Bool;
};

}  // namespace tessera
