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

// f32 -> f16 with round-to-nearest-even, subnormal results, overflow to inf;
// NaN becomes the quiet NaN 0x7e00 (with f's sign). Without branches, so the
// kernels' loops of it vectorise (an out-of-line version with branches ran
// 7x slower than bf16's conversion); the same bits as that version on every
// f32 bit pattern (tests/runtime/test_dtype.cpp keeps it as the reference).
__attribute__((always_inline)) inline Half float_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u, abs = x & 0x7fffffffu;
  // A subnormal result (|f| < 2^-14): adding 0.5 puts its 10 bits at the
  // bottom of the sum's mantissa, rounded to nearest even by the addition.
  float a, sum;
  std::memcpy(&a, &abs, 4);
  sum = a + 0.5f;
  uint32_t sum_bits;
  std::memcpy(&sum_bits, &sum, 4);
  const uint32_t subnormal = sum_bits - 0x3f000000u;
  // A normal one: exponent rebiased (127 -> 15), mantissa rounded from 23 bits to 10.
  const uint32_t normal = (abs - 0x38000000u + 0xfffu + ((abs >> 13) & 1u)) >> 13;
  uint32_t h = abs < 0x38800000u ? subnormal : normal;
  h = abs >= 0x477ff000u ? 0x7c00u : h;  // rounds to inf
  h = abs > 0x7f800000u ? 0x7e00u : h;   // NaN
  return {static_cast<uint16_t>(sign | h)};
}

// f16 -> f32, exact (NaN payloads kept); without branches, as above.
__attribute__((always_inline)) inline float f16_to_float(Half h) {
  uint32_t u = static_cast<uint32_t>(h.bits & 0x7fffu) << 13;
  const uint32_t exp = u & 0x0f800000u;
  u += 0x38000000u;  // exponent rebiased (15 -> 127)
  // A subnormal: its bits as a normal f32 one exponent step up, less 2^-14.
  uint32_t up = u + 0x00800000u, subnormal_bits;
  float up_f;
  std::memcpy(&up_f, &up, 4);
  const float subnormal = up_f - 6.103515625e-05f;
  std::memcpy(&subnormal_bits, &subnormal, 4);
  u = exp == 0x0f800000u ? u + 0x38000000u : u;  // inf and NaN: exponent 255
  u = exp == 0 ? subnormal_bits : u;             // zero and subnormals
  u |= static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

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
