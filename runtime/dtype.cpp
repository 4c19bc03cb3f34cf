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

}  // namespace tessera
