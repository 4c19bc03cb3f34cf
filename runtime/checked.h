// Sizes computed from what a user or a file says, every product and sum
// checked: an overflow throws naming the expression it came from
// ("model.vocab_size x model.n_embd = 4611686018427387904 x 4 overflows ..."),
// never wraps around into a small or negative size.
//
//   CheckedInt bytes = named("rows", rows) * named("cols", cols) * 4;
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>

#include "runtime/check.h"

namespace tessera {

// What a caller calls an options struct's fields in its messages: tessera-train
// maps nn's "n_embd" to "model.n_embd", train's "tp" to
// "parallelism.tensor_parallel_degree". Empty: the fields' own names.
using FieldNames = std::function<std::string(const char* field)>;
inline std::string field_name(const FieldNames& names, const char* field) {
  return names ? names(field) : std::string(field);
}

struct CheckedInt {
  int64_t value = 0;
  std::string expr;  // what the value was computed from, for errors
};

inline CheckedInt named(std::string name, int64_t value) { return {value, std::move(name)}; }

inline CheckedInt operator*(const CheckedInt& a, const CheckedInt& b) {
  int64_t r = 0;
  TS_CHECK(!__builtin_mul_overflow(a.value, b.value, &r),
           "{} x {} = {} x {} overflows a 64-bit integer: make one of them smaller", a.expr, b.expr, a.value,
           b.value);
  return {r, a.expr + " x " + b.expr};
}
inline CheckedInt operator*(int64_t k, const CheckedInt& a) { return CheckedInt{k, std::to_string(k)} * a; }
inline CheckedInt operator*(const CheckedInt& a, int64_t k) { return a * CheckedInt{k, std::to_string(k)}; }

inline CheckedInt operator+(const CheckedInt& a, const CheckedInt& b);
inline CheckedInt operator+(const CheckedInt& a, int64_t k) { return a + CheckedInt{k, std::to_string(k)}; }
inline CheckedInt operator+(const CheckedInt& a, const CheckedInt& b) {
  int64_t r = 0;
  TS_CHECK(!__builtin_add_overflow(a.value, b.value, &r),
           "{} + {} = {} + {} overflows a 64-bit integer: make one of them smaller", a.expr, b.expr, a.value,
           b.value);
  return {r, "(" + a.expr + " + " + b.expr + ")"};
}

}  // namespace tessera
