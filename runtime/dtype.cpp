#include "runtime/dtype.h"

#include "runtime/check.h"

namespace tessera {

namespace detail {
void throw_error(const std::string& message) { throw Error(message); }
void throw_call_error(const char* file, int line, const char* call, const std::string& detail) {
  throw Error(fmt::format("{}:{}: {} failed ({})", file, line, call, detail));
}
}  // namespace detail

size_t dtype_size(DType dt) {
  switch (dt) {
    case DType::F32: return 4;
    case DType::F64: return 8;
    case DType::BF16: return 2;
    case DType::F16: return 2;
    case DType::I32: return 4;
    case DType::I64: return 8;
    case DType::Bool: return 1;
  }
  return 0;
}

const char* dtype_name(DType dt) {
  switch (dt) {
    case DType::F32: return "f32";
    case DType::F64: return "f64";
    case DType::BF16: return "bf16";
    case DType::F16: return "f16";
    case DType::I32: return "i32";
    case DType::I64: return "i64";
    case DType::Bool: return "bool";
  }
  return "?";
}

DType dtype_from_name(const std::string& name) {
  for (DType dt : {DType::F32, DType::F64, DType::BF16, DType::F16, DType::I32, DType::I64,
                   DType::Bool})
    if (name == dtype_name(dt)) return dt;
  if (name == "float32") return DType::F32;
  if (name == "float64") return DType::F64;
  if (name == "bfloat16") return DType::BF16;
  if (name == "float16") return DType::F16;
  TS_CHECK(false, "unknown dtype '{}' (expected one of f32, f64, bf16, f16, i32, i64, bool)", name);
}

bool is_floating(DType dt) {
  return dt == DType::F32 || dt == DType::F64 || dt == DType::BF16 || dt == DType::F16;
}
bool is_integral(DType dt) { return !is_floating(dt); }

Half float_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t abs = x & 0x7fffffffu;
  if (abs > 0x7f800000u) return {static_cast<uint16_t>(sign | 0x7e00u)};  // NaN
  if (abs >= 0x477ff000u) return {static_cast<uint16_t>(sign | 0x7c00u)};  // rounds to inf
  if (abs < 0x38800000u) {
    // Result is subnormal (or zero): value = mantissa * 2^-24. Round the shifted mantissa.
    if (abs < 0x33000000u) return {static_cast<uint16_t>(sign)};  // below half the smallest
    uint32_t exp = abs >> 23;
    uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - exp;  // 14 + (113 - exp) ... brings mant into 2^-24 units
    uint32_t half_units = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1);
    uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (half_units & 1u))) half_units++;
    return {static_cast<uint16_t>(sign | half_units)};
  }
  // Normal: rebias exponent (127 -> 15) and round mantissa from 23 to 10 bits.
  uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
  uint32_t h = (rounded - 0x38000000u) >> 13;
  return {static_cast<uint16_t>(sign | h)};
}

float f16_to_float(Half h) {
  uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  uint32_t exp = (h.bits >> 10) & 0x1fu;
  uint32_t mant = h.bits & 0x3ffu;
  uint32_t out;
  if (exp == 0) {
    if (mant == 0) {
      out = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        mant <<= 1;
        e++;
      } while ((mant & 0x400u) == 0);
      out = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 0x1f) {
    out = sign | 0x7f800000u | (mant << 13);
  } else {
    out = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &out, 4);
  return f;
}

}  // namespace tessera
