// Reduction kernels. Sums of f32 accumulate in f64, so a sum over a million
// elements is as accurate as the f32 result can hold, and in an order fixed by
// the shape (runtime/cpu/sums.h), so they do not depend on the thread count.
// bf16 and f16 are read where they lie, each element widened as it is read,
// and reduced into f32: the bits of reducing a widened f32 copy, without the
// copy (a bf16 bias gradient's sum measured 2x its f32 twin with one).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "runtime/cpu/isa_copy.h"
#include "runtime/cpu/dispatch.h"
#include "runtime/cpu/sums.h"
#include "runtime/kernels.h"
#include "runtime/parallel_for.h"

namespace tessera::cpu::TS_CPU_ISA {

namespace {

// The accumulator of a storage type: f64 for every float (bf16/f16 widened
// on the way), the type itself for integers.
template <class T>
using Acc = std::conditional_t<std::is_integral_v<T>, T, double>;

// Reads x as T and writes out as O: T itself, or f32 for bf16/f16 x.
template <class T, class O = T>
void reduce_typed(ReduceOp op, O* out, const T* x, int64_t outer, int64_t n, int64_t inner) {
  using A = Acc<T>;
  auto read = [](T v) { return static_cast<A>(load(v)); };
  auto init = [op]() -> A {
    if (op == ReduceOp::Sum) return A(0);
    if (op == ReduceOp::Max) return std::numeric_limits<A>::lowest();
    return std::numeric_limits<A>::max();
  };
  auto combine = [op](A acc, A v) -> A {
    if (op == ReduceOp::Sum) return acc + v;
    if (v != v) return v;  // NaN wins max/min
    if (op == ReduceOp::Max) return acc != acc || acc >= v ? acc : v;
    return acc != acc || acc <= v ? acc : v;
  };
  if (inner == 1) {
    // Sums in the fixed order of runtime/cpu/sums.h: a row is split over the
    // threads only in chunks fixed by its length, so the bits do not depend
    // on the thread count. Max and min do not depend on the order.
    int64_t row_grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1));
    parallel_for(0, outer, row_grain, [&](int64_t o0, int64_t o1) {
      for (int64_t o = o0; o < o1; ++o) {
        const T* row = x + o * n;
        if (op == ReduceOp::Sum) {
          auto element = [row, read](int64_t k) { return read(row[k]); };
          out[o] = static_cast<O>(chunked_sum<A>(n, element));
          continue;
        }
        A acc = init();
        for (int64_t k = 0; k < n; ++k) acc = combine(acc, read(row[k]));
        out[o] = static_cast<O>(acc);
      }
    });
    return;
  }
  // Reduce the middle dim of [outer, n, inner]: rows accumulate into column
  // blocks, in the order of runtime/cpu/sums.h's column_sums.
  const bool sum = op == ReduceOp::Sum;
  auto rows = [&](A* acc, int64_t o, int64_t k0, int64_t k1, int64_t j0, int64_t len) {
    for (int64_t k = k0; k < k1; ++k) {
      const T* row = x + (o * n + k) * inner + j0;
      if (sum) {
        for (int64_t j = 0; j < len; ++j) acc[j] += read(row[j]);
      } else {
        for (int64_t j = 0; j < len; ++j) acc[j] = combine(acc[j], read(row[j]));
      }
    }
  };
  column_sums<A>(outer, n, inner, sum, init(), rows, [&](int64_t o, int64_t j0, int64_t len, const A* acc) {
    for (int64_t j = 0; j < len; ++j) out[o * inner + j0 + j] = static_cast<O>(acc[j]);
  });
}

}  // namespace

void reduce(ReduceOp op, const Tensor& out, const Tensor& x, int64_t outer, int64_t n,
            int64_t inner) {
  const bool widened = x.dtype() == DType::BF16 || x.dtype() == DType::F16;
  TS_CHECK(out.dtype() == (widened ? DType::F32 : x.dtype()), "reduction: {} values reduce into {}, got an output of {}",
           dtype_name(x.dtype()), dtype_name(widened ? DType::F32 : x.dtype()), dtype_name(out.dtype()));
  switch (x.dtype()) {
    case DType::F32: return reduce_typed(op, out.data<float>(), x.data<float>(), outer, n, inner);
    case DType::BF16: return reduce_typed(op, out.data<float>(), x.data<BFloat16>(), outer, n, inner);
    case DType::F16: return reduce_typed(op, out.data<float>(), x.data<Half>(), outer, n, inner);
    case DType::F64: return reduce_typed(op, out.data<double>(), x.data<double>(), outer, n, inner);
    case DType::I32: return reduce_typed(op, out.data<int32_t>(), x.data<int32_t>(), outer, n, inner);
    case DType::I64: return reduce_typed(op, out.data<int64_t>(), x.data<int64_t>(), outer, n, inner);
    default: TS_CHECK(false, "reduction: unsupported dtype {}", dtype_name(x.dtype()));
  }
}

void argmax_rows(const Tensor& values, const Tensor& indices, const Tensor& x) {
  int64_t rows = values.numel();
  int64_t n = rows > 0 ? x.numel() / rows : 0;
  TS_CHECK(n > 0, "argmax: cannot take the maximum over an empty dim");
  int64_t* idx = indices.data<int64_t>();
  // bf16 and f16 compared as their values (exact in f32), the maximum's own
  // bits kept: a NaN keeps its payload, as PyTorch's.
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    T* pv = values.data<T>();
    parallel_for(0, rows, std::max<int64_t>(1, 16384 / n), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const T* row = px + r * n;
        int64_t best = 0;
        auto top = load(row[0]);
        for (int64_t k = 1; k < n; ++k) {
          if (top != top) break;  // NaN is the maximum
          const auto v = load(row[k]);
          if (v > top || v != v) best = k, top = v;
        }
        pv[r] = row[best];
        idx[r] = best;
      }
    });
  };
  switch (x.dtype()) {
    case DType::F32: return run(float{});
    case DType::F64: return run(double{});
    case DType::BF16: return run(BFloat16{});
    case DType::F16: return run(Half{});
    case DType::I32: return run(int32_t{});
    case DType::I64: return run(int64_t{});
    default: TS_CHECK(false, "argmax: unsupported dtype {}", dtype_name(x.dtype()));
  }
}

namespace {
double sum_squares_one(const Tensor& x) {
  double total = 0;
  dispatch_floating(x.dtype(), "sum_squares", [&](auto tag) {
    using S = decltype(tag);  // bf16/f16 read as they are: no f32 copy of the gradients
    const S* p = x.numel() > 0 ? x.data<S>() : nullptr;
    total = chunked_sum<double>(x.numel(), [p](int64_t i) {
      double v = static_cast<double>(load(p[i]));  // exact: a float's square fits a double
      return v * v;
    });
  });
  return total;
}
}  // namespace

void sum_squares(const Tensor& out, const std::vector<Tensor>& xs) {
  double total = 0;
  for (const Tensor& x : xs) total += sum_squares_one(x);
  out.data<double>()[0] = total;
}

}  // namespace tessera::cpu::TS_CPU_ISA
