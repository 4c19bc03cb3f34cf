// Sums for the CPU kernels in an order fixed by the length alone. Element i
// goes to lane i % kLanes and the lanes are added pairwise at the end: the
// lanes are independent, so the loop vectorises (a plain running sum cannot,
// without reassociating), and the order never depends on the number of
// threads. Long sums are cut into chunks of kChunk elements whose partial sums
// are added in chunk order, so they can run on many threads and still give
// the same bits on one.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "runtime/cpu/isa_copy.h"
#include "runtime/parallel_for.h"

namespace tessera::cpu::TS_CPU_ISA {

inline constexpr int kLanes = 8;
inline constexpr int64_t kChunk = 16384;

// sum over i in [0, n) of term(i), accumulated in A.
template <class A, class F>
__attribute__((always_inline)) inline A lane_sum(int64_t n, F&& term) {
  A acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += term(i + l);
  for (int l = 0; i + l < n; ++l) acc[l] += term(i + l);
  return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

// Two sums in one pass: term(i) returns {a_i, b_i}; {sum a, sum b} in the
// order of lane_sum.
template <class A>
struct SumPair {
  A a = 0, b = 0;
};
template <class A, class F>
__attribute__((always_inline)) inline SumPair<A> lane_sum2(int64_t n, F&& term) {
  A a[kLanes] = {}, b[kLanes] = {};
  auto add = [&](int l, int64_t i) {
    SumPair<A> t = term(i);
    a[l] += t.a;
    b[l] += t.b;
  };
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) add(l, i + l);
  for (int l = 0; i + l < n; ++l) add(l, i + l);
  return {((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])),
          ((b[0] + b[4]) + (b[2] + b[6])) + ((b[1] + b[5]) + (b[3] + b[7]))};
}

// max over i in [0, n) of term(i), from `lowest` (std::max per lane: a NaN
// term is skipped, as in a plain loop of std::max).
template <class T, class F>
__attribute__((always_inline)) inline T lane_max(int64_t n, T lowest, F&& term) {
  T acc[kLanes];
  for (int l = 0; l < kLanes; ++l) acc[l] = lowest;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] = std::max(acc[l], term(i + l));
  for (int l = 0; i + l < n; ++l) acc[l] = std::max(acc[l], term(i + l));
  for (int l = 1; l < kLanes; ++l) acc[0] = std::max(acc[0], acc[l]);
  return acc[0];
}

// The same sum for long n: chunks of kChunk on the kernel threads, partial
// sums added in chunk order.
template <class A, class F>
A chunked_sum(int64_t n, F&& term) {
  int64_t chunks = (n + kChunk - 1) / kChunk;
  if (chunks <= 1) return lane_sum<A>(n, term);
  std::vector<A> partial(static_cast<size_t>(chunks));
  parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t begin = c * kChunk;
      partial[static_cast<size_t>(c)] =
          lane_sum<A>(std::min(kChunk, n - begin), [&](int64_t i) { return term(begin + i); });
    }
  });
  A total = 0;
  for (A p : partial) total += p;
  return total;
}

// Column sums of [outer, n, inner] over the middle dim (a bias gradient's
// sum over rows) in an order fixed by the shape: each column accumulates its
// rows in order, and where there are few blocks of kColumnBlock columns (one
// row of 256 to 1024 columns) a sum (`split`) cuts the rows into at most 16
// parts fixed by n, whose partial sums are added in part order. Which columns
// go together does not change a column's order, so every kernel that sums
// columns this way gives the same bits, on any number of threads, whatever
// the width of its pieces. The pieces are as wide as keep every thread busy,
// up to kWideColumns, so each reads its rows as long runs (out of cache,
// pieces of kColumnBlock columns ran up to 2x slower: benchmarks/README.md,
// 2026-12-07); bias_gelu_backward sums what it computes in the same pass.
//   rows(acc, o, k0, k1, j0, len)  adds rows [k0, k1) of columns
//                                  [j0, j0 + len) of slice o into acc
//   store(o, j0, len, acc)         takes a finished piece
inline constexpr int64_t kColumnBlock = 256;
// The widest piece: its f64 accumulators (8 KiB) and a row of it stay in L1.
inline constexpr int64_t kWideColumns = 1024;

template <class A, class Rows, class Store>
void column_sums(int64_t outer, int64_t n, int64_t inner, bool split, A init, Rows&& rows, Store&& store) {
  const int64_t blocks = (inner + kColumnBlock - 1) / kColumnBlock;
  const int64_t parts = split && outer * blocks < 16 ? std::clamp<int64_t>(n / 256, 1, 16) : 1;
  const int64_t per_part = (n + parts - 1) / parts;
  // As few pieces as keep every thread busy (two pieces each).
  const int64_t wanted = std::max<int64_t>(1, (2 * tessera::detail::omp_threads_for(outer * blocks * parts, 1) + parts - 1) / parts);
  const int64_t ways = std::clamp<int64_t>(wanted, 1, std::max<int64_t>(blocks, 1));
  const int64_t width = std::min(kWideColumns, (inner + ways - 1) / ways);
  const int64_t pieces = width > 0 ? (inner + width - 1) / width : 0;
  // Plain arrays, not vectors: a vector's constructor compiled here would be
  // an instruction-set copy outside this namespace (tests/isa_copies).
  std::unique_ptr<A[]> partial(new A[parts > 1 ? static_cast<size_t>(outer * pieces * parts * width) : 0]);
  parallel_for(0, outer * pieces * parts, 1, [&](int64_t w0, int64_t w1) {
    std::unique_ptr<A[]> acc(new A[static_cast<size_t>(width)]);
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t part = w % parts, o = w / parts / pieces, j0 = (w / parts % pieces) * width;
      const int64_t len = std::min(width, inner - j0);
      std::fill(acc.get(), acc.get() + len, init);
      rows(acc.get(), o, std::min(n, part * per_part), std::min(n, (part + 1) * per_part), j0, len);
      if (parts > 1) std::copy(acc.get(), acc.get() + len, partial.get() + w * width);
      else store(o, j0, len, static_cast<const A*>(acc.get()));
    }
  });
  std::unique_ptr<A[]> total(new A[parts > 1 ? static_cast<size_t>(width) : 0]);
  for (int64_t op = 0; parts > 1 && op < outer * pieces; ++op) {
    const int64_t o = op / pieces, j0 = op % pieces * width, len = std::min(width, inner - j0);
    for (int64_t j = 0; j < len; ++j) {
      total[static_cast<size_t>(j)] = 0;
      for (int64_t part = 0; part < parts; ++part)
        total[static_cast<size_t>(j)] += partial[static_cast<size_t>((op * parts + part) * width + j)];
    }
    store(o, j0, len, static_cast<const A*>(total.get()));
  }
}

}  // namespace tessera::cpu::TS_CPU_ISA
