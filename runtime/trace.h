// Timeline tracing: spans on lanes (compute, each collective kind, time spent
// waiting for collectives, and lanes the layers above register for their own
// work: a sharding scheme's copies, a pipeline's bubble) and a memory counter (the bytes
// the caching allocator holds in tensors, sampled at every allocation and
// free while tracing), written as Chrome trace /
// Perfetto JSON (open in https://ui.perfetto.dev or chrome://tracing). The
// "wait" lane is the communication a step did not hide: exposed communication
// is the time spent there. Off by default; when off a span costs one atomic load.
#pragma once

#include <atomic>
#include <string>
#include <vector>

namespace tessera::trace {

// The built-in lanes; register_lane adds more after them.
enum class Lane : int { Compute = 0, AllGather, ReduceScatter, AllReduce, OtherCollective, Wait, Memory };
const char* lane_name(Lane lane);
// A lane of its own for a layer's work, named `name` in traces (the same lane
// again for the same name). Thread-safe.
Lane register_lane(const std::string& name);

struct Span {
  Lane lane;
  std::string name;
  double start_us;
  double end_us;
  double value = 0;  // Lane::Memory: a sample at start_us (bytes allocated in tensors)
};

void enable(bool on);
bool enabled();
double now_us();  // monotonic, microseconds
void record(Lane lane, std::string name, double start_us, double end_us);
// A sample of the bytes allocated in tensors on `device` (a Chrome "C" counter event per device).
void memory_sample(const std::string& device, double allocated_bytes);
// Removes and returns the recorded spans (all threads), ordered by start.
std::vector<Span> take();
// The spans as Chrome trace events, one process per rank and one thread per lane.
std::string chrome_trace_events(const std::vector<Span>& spans, int rank);
// A complete trace file body from already-formatted events (joined with
// commas); a non-empty `title` (the run, step, ranks and settings) is kept as
// "otherData": {"title": ...}, which Perfetto shows and tools/trace_png.py
// draws as the picture's title.
std::string chrome_trace_file(const std::vector<std::string>& per_rank_events, const std::string& title = "");
// Total time covered by the spans of a lane (overlapping spans counted once).
double covered_us(const std::vector<Span>& spans, Lane lane);

// One step in numbers: time covered by each lane; `exposed` is the time the
// compute thread spent waiting for communication (the part overlap did not hide).
struct Summary {
  double compute_us = 0, all_gather_us = 0, reduce_scatter_us = 0, all_reduce_us = 0, exposed_us = 0;
};
Summary summarize(const std::vector<Span>& spans);

// Writes every rank's spans into one Chrome trace file at `path` (rank 0
// writes; every rank of the world must call it), titled as chrome_trace_file says.
void write_chrome_trace(const std::string& path, const std::vector<Span>& spans, const std::string& title = "");

namespace detail {
extern std::atomic<bool> g_enabled;
}

// Records its lifetime as a span.
class Scope {
 public:
  Scope(Lane lane, const char* name) : lane_(lane), name_(name) {
    if (detail::g_enabled.load(std::memory_order_relaxed)) start_ = now_us();
  }
  ~Scope() {
    if (start_ >= 0) record(lane_, name_, start_, now_us());
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  Lane lane_;
  const char* name_;
  double start_ = -1;
};

}  // namespace tessera::trace
