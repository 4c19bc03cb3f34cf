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
  // Reduce the middle dim of [outer, n, inner]: accumulate rows into a column
  // block. With few column blocks (a bias gradient: one row of 256 to 1024
  // columns) a sum also splits the rows, into at most 16 parts fixed by the
  // shape, whose partial sums are added in part order.
  constexpr int64_t kBlock = 256;
  int64_t blocks = (inner + kBlock - 1) / kBlock;
  int64_t parts =
      op == ReduceOp::Sum && outer * blocks < 16 ? std::clamp<int64_t>(n / 256, 1, 16) : 1;
  int64_t per_part = (n + parts - 1) / parts;
  std::vector<A> partial(parts > 1 ? static_cast<size_t>(outer * blocks * parts * kBlock) : 0);
  parallel_for(0, outer * blocks * parts, 1, [&](int64_t w0, int64_t w1) {
    A acc[kBlock];
    for (int64_t w = w0; w < w1; ++w) {
      int64_t part = w % parts, o = w / parts / blocks, j0 = (w / parts % blocks) * kBlock;
      int64_t len = std::min(kBlock, inner - j0);
      for (int64_t j = 0; j < len; ++j) acc[j] = init();
      for (int64_t k = part * per_part; k < std::min(n, (part + 1) * per_part); ++k) {
        const T* row = x + (o * n + k) * inner + j0;
        if (op == ReduceOp::Sum) {
          for (int64_t j = 0; j < len; ++j) acc[j] += read(row[j]);
        } else {
          for (int64_t j = 0; j < len; ++j) acc[j] = combine(acc[j], read(row[j]));
        }
      }
      if (parts > 1) {
        std::copy(acc, acc + len, partial.begin() + w * kBlock);
        continue;
      }
      for (int64_t j = 0; j < len; ++j) out[o * inner + j0 + j] = static_cast<O>(acc[j]);
    }
  });
  for (int64_t ob = 0; parts > 1 && ob < outer * blocks; ++ob) {
    int64_t o = ob / blocks, j0 = ob % blocks * kBlock, len = std::min(kBlock, inner - j0);
    for (int64_t j = 0; j < len; ++j) {
      A total = 0;
      for (int64_t part = 0; part < parts; ++part)
        total += partial[static_cast<size_t>((ob * parts + part) * kBlock + j)];
      out[o * inner + j0 + j] = static_cast<O>(total);
    }
  }
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
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    T* pv = values.data<T>();
    parallel_for(0, rows, std::max<int64_t>(1, 16384 / n), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const T* row = px + r * n;
        int64_t best = 0;
        for (int64_t k = 1; k < n; ++k) {
          if (row[best] != row[best]) break;  // NaN is the maximum
          if (row[k] > row[best] || row[k] != row[k]) best = k;
        }
        pv[r] = row[best];
        idx[r] = best;
      }
    });
  };
  switch (x.dtype()) {
    case DType::F32: return run(float{});
    case DType::F64: return run(double{});
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
