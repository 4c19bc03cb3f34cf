#include "runtime/parallel_for.h"

#include <cblas.h>
#include <omp.h>

#include <thread>
#include <vector>

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
#ifdef TESSERA_THREAD_SANITIZER
namespace {
thread_local int piece_number = -1;  // >= 0 inside run_on_threads
bool in_parallel() { return piece_number >= 0 || omp_in_parallel(); }
}  // namespace

std::exception_ptr run_on_threads(int nt, const std::function<std::exception_ptr(int)>& piece) {
  std::vector<std::exception_ptr> errors(static_cast<size_t>(nt));
  auto run = [&](int t) {
    piece_number = t;
    errors[static_cast<size_t>(t)] = piece(t);
    piece_number = -1;
  };
  std::vector<std::thread> threads;
  for (int t = 1; t < nt; ++t) threads.emplace_back(run, t);
  run(0);
  for (auto& thread : threads) thread.join();
  for (auto& error : errors)
    if (error) return error;
  return nullptr;
}

int omp_thread_num() { return piece_number < 0 ? 0 : piece_number; }
#else
namespace {
bool in_parallel() { return omp_in_parallel(); }
}  // namespace
int omp_thread_num() { return omp_get_thread_num(); }
#endif

int omp_threads_for(int64_t n, int64_t grain) {
  if (in_parallel()) return 1;
  int64_t max_by_work = grain > 0 ? n / grain : n;
  int nt = omp_get_max_threads();
  if (max_by_work < nt) nt = static_cast<int>(max_by_work);
  return nt < 1 ? 1 : nt;
}
}  // namespace detail

}  // namespace tessera
