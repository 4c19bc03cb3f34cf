// Kernel threads. Kernels split work over an OpenMP thread pool; BLAS keeps its
// own pool. set_num_threads sets both, so one knob avoids oversubscription
// (e.g. 4 ranks on 2 cores want 1 thread each).
#pragma once

#include <cstdint>
#include <exception>

namespace tessera {

int num_threads();
void set_num_threads(int n);

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
  std::exception_ptr error;
#pragma omp parallel num_threads(nt)
  {
    int64_t b = begin + detail::omp_thread_num() * chunk;
    int64_t e = b + chunk < end ? b + chunk : end;
    try {
      if (b < e) f(b, e);
    } catch (...) {
#pragma omp critical(tessera_parallel_for_error)
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace tessera
