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

}  // namespace tessera::cpu::TS_CPU_ISA
