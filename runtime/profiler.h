// A per-op time profile: top-level op scopes (an op called inside another op
// is not counted separately) accumulate wall time by name. Off by default;
// when off a scope costs one relaxed atomic load.
#pragma once

#include <atomic>
#include <chrono>
#include <string>
#include <vector>

#include "runtime/trace.h"

namespace tessera::profiler {

struct Entry {
  std::string name;
  double total_ms = 0;
  int64_t calls = 0;
  double flops = 0;  // kernels that say (record_kernel): their arithmetic, e.g. 2 m n k a product
};

void enable(bool on);
bool enabled();
void reset();
// Entries of the calling thread, largest total first.
std::vector<Entry> summary();
// A table of the summary with percentages of `total_ms` (or of the sum).
std::string format_summary(double total_ms = 0);

// Kernel time by kind, whichever op ran the kernel (e.g. "gemm": every matrix
// product the CPU backend ran, from linear, matmul or their backward), for
// splitting a step into GEMM and everything else. Calling thread; reset clears it.
void record_kernel(const char* kind, double ms, double flops = 0);
Entry kernel_time(const char* kind);
// The kinds that begin with `prefix` (e.g. "gemm " for the CPU's products by
// shape and kernel), most time first.
std::vector<Entry> kernel_summary(const std::string& prefix);

// A function every top-level scope calls before it reads its clock (nullptr:
// none). On a device that queues work, such as a GPU, a scope's time is then
// its kernels' time and not only their launch: bench_gpu's profile sets it to
// the device's synchronize. It slows the run; for profiles, not for timings.
void set_scope_barrier(void (*barrier)());

namespace detail {
extern std::atomic<bool> g_enabled;
extern void (*g_barrier)();
void record(const char* name, double ms);
int& depth();
}  // namespace detail

// Times its lifetime under `name` (a string literal or a string that outlives it).
class Scope {
 public:
  explicit Scope(const char* name) : name_(name) {
    bool profile = detail::g_enabled.load(std::memory_order_relaxed);
    bool trace = trace::detail::g_enabled.load(std::memory_order_relaxed);
    if (!profile && !trace) return;
    active_ = detail::depth()++ == 0;
    counted_ = true;
    if (active_) {
      start_ = std::chrono::steady_clock::now();
      if (trace) trace_start_ = trace::now_us();
    }
  }
  ~Scope() {
    if (!counted_) return;
    detail::depth()--;
    if (!active_) return;
    if (detail::g_barrier != nullptr) detail::g_barrier();
    if (detail::g_enabled.load(std::memory_order_relaxed))
      detail::record(name_, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start_)
                                .count());
    if (trace_start_ >= 0) trace::record(trace::Lane::Compute, name_, trace_start_, trace::now_us());
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  const char* name_;
  bool active_ = false, counted_ = false;
  std::chrono::steady_clock::time_point start_;
  double trace_start_ = -1;
};

}  // namespace tessera::profiler

#define TS_PROFILE_CONCAT2(a, b) a##b
#define TS_PROFILE_CONCAT(a, b) TS_PROFILE_CONCAT2(a, b)
#define TS_PROFILE(name) ::tessera::profiler::Scope TS_PROFILE_CONCAT(ts_profile_, __LINE__)(name)
