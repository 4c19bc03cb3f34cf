#include "runtime/parallel_for.h"

#include <cblas.h>
#include <omp.h>

#ifdef __linux__
#include <dirent.h>
#include <sched.h>
#endif

#include <algorithm>
#include <cstdlib>
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

#ifdef __linux__
namespace {
// The CPUs the process was started with (the launcher's binding, else all):
// pinning may narrow the mask and widen it again up to these.
const std::vector<int>& launch_cpus() {
  static const std::vector<int> cpus = allowed_cpus();
  return cpus;
}
[[maybe_unused]] const bool launch_cpus_read = !launch_cpus().empty();  // at load, before anything pins

cpu_set_t cpu_set_of(const std::vector<int>& cpus) {
  TS_CHECK(!cpus.empty(), "pinning threads: expected at least one CPU, got none");
  const std::vector<int>& allowed = launch_cpus();
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) {
    TS_CHECK(c >= 0 && c < CPU_SETSIZE && std::find(allowed.begin(), allowed.end(), c) != allowed.end(),
             "pinning threads: CPU {} is not one this process may run on ({} CPU(s) from {} to {})", c,
             allowed.size(), allowed.empty() ? -1 : allowed.front(), allowed.empty() ? -1 : allowed.back());
    CPU_SET(c, &set);
  }
  return set;
}
}  // namespace

std::vector<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  return cpus;
}

void pin_thread_to(const std::vector<int>& cpus) {
  const cpu_set_t set = cpu_set_of(cpus);
  TS_CHECK(sched_setaffinity(0, sizeof(set), &set) == 0, "pinning this thread to {} CPU(s) failed", cpus.size());
}

void pin_process_to(const std::vector<int>& cpus) {
  const cpu_set_t set = cpu_set_of(cpus);
  // Threads already running (MPI's, a signal watcher) each by their id; a
  // thread started later inherits the mask of the thread that starts it.
  if (DIR* dir = opendir("/proc/self/task"); dir != nullptr) {
    while (const dirent* entry = readdir(dir)) {
      const int tid = std::atoi(entry->d_name);
      if (tid > 0) sched_setaffinity(tid, sizeof(set), &set);  // a thread that just ended: nothing to pin
    }
    closedir(dir);
  }
  pin_thread_to(cpus);
}
#else
std::vector<int> allowed_cpus() { return {}; }
void pin_thread_to(const std::vector<int>&) {}
void pin_process_to(const std::vector<int>&) {}
#endif

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
