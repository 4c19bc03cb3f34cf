#include "runtime/parallel.h"

#include <cblas.h>
#include <omp.h>

#include "runtime/check.h"

namespace tessera {

namespace {
// OpenBLAS's pthread build (where the OpenMP build is missing) keeps a pool of
// its own that omp_set_num_threads does not reach: it stays on one thread from
// the start, so that runtime/cpu/blas.cpp's pieces run on one thread each.
[[maybe_unused]] const bool pthread_openblas_held = [] {
  if (openblas_get_parallel() != 2) openblas_set_num_threads(1);
  return true;
}();
}  // namespace

int num_threads() { return omp_get_max_threads(); }

void set_num_threads(int n) {
  TS_CHECK(n >= 1, "set_num_threads: expected a positive thread count, got {}", n);
  omp_set_num_threads(n);
  if (openblas_get_parallel() == 2) openblas_set_num_threads(n);  // else: held at one
}

namespace detail {
int omp_threads_for(int64_t n, int64_t grain) {
  if (omp_in_parallel()) return 1;
  int64_t max_by_work = grain > 0 ? n / grain : n;
  int nt = omp_get_max_threads();
  if (max_by_work < nt) nt = static_cast<int>(max_by_work);
  return nt < 1 ? 1 : nt;
}
int omp_thread_num() { return omp_get_thread_num(); }
}  // namespace detail

}  // namespace tessera
