// parallel_for, the kernels' loop over the OpenMP pool (runtime/parallel.h
// sets its size). Internal: the template's OpenMP pragmas stay out of the
// installed headers, whose users need not compile with -fopenmp.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>

#include "runtime/parallel.h"

namespace tessera {

// Runs f(begin, end) on disjoint sub-ranges of [begin, end) in parallel, each at
// least `grain` long; inline when small or already inside a parallel region.
// An exception thrown by f (the first, if several threads throw) is rethrown
// on the calling thread once every thread is done.
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, F&& f);

namespace detail {
int omp_threads_for(int64_t n, int64_t grain);
int omp_thread_num();
}  // namespace detail

// ThreadSanitizer cannot see the barriers of Debian's libgomp, which is not
// built with it, and would report every kernel's writes as races. Under TSan
// the same pieces therefore run on std::threads, whose start and join it does
// see: it still checks that a kernel's pieces are disjoint, which is the part
// that is Tessera's code.
#if defined(__SANITIZE_THREAD__)
#define TESSERA_THREAD_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define TESSERA_THREAD_SANITIZER 1
#endif
#endif

#ifdef TESSERA_THREAD_SANITIZER
namespace detail {
// Runs piece(0) ... piece(nt - 1) on nt threads (piece 0 on the caller) and
// returns the first exception by piece number.
std::exception_ptr run_on_threads(int nt, const std::function<std::exception_ptr(int)>& piece);
}  // namespace detail
#endif

template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, F&& f) {
  int64_t n = end - begin;
  if (n <= 0) return;
  int nt = detail::omp_threads_for(n, grain);
  if (nt <= 1) {
    f(begin, end);
    return;
  }
  int64_t chunk = (n + nt - 1) / nt;
  auto piece = [&](int t) -> std::exception_ptr {
    int64_t b = begin + t * chunk;
    int64_t e = b + chunk < end ? b + chunk : end;
    try {
      if (b < e) f(b, e);
    } catch (...) {
      return std::current_exception();
    }
    return nullptr;
  };
#ifdef TESSERA_THREAD_SANITIZER
  std::exception_ptr error = detail::run_on_threads(nt, piece);
#else
  std::exception_ptr error;
#pragma omp parallel num_threads(nt)
  {
    std::exception_ptr mine = piece(detail::omp_thread_num());
    if (mine) {
#pragma omp critical(tessera_parallel_for_error)
      if (!error) error = mine;
    }
  }
#endif
  if (error) std::rethrow_exception(error);
}

}  // namespace tessera
