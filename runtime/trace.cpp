#include "runtime/trace.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <mutex>

#include "runtime/check.h"
#include "runtime/distributed.h"

namespace tessera::trace {

namespace detail {
std::atomic<bool> g_enabled{false};
}

namespace {
std::mutex& buffer_mu() {
  static std::mutex mu;
  return mu;
}
std::vector<Span>& buffer() {
  static std::vector<Span> spans;
  return spans;
}

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (static_cast<unsigned char>(c) < 0x20) {  // control characters: JSON allows them only escaped
      out += fmt::format("\\u{:04x}", static_cast<int>(c));
      continue;
    }
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}
}  // namespace

namespace {
// Every lane's name, by lane number: the built-in ones, then the registered.
std::mutex& lanes_mu() {
  static std::mutex mu;
  return mu;
}
std::vector<std::string>& lane_names() {
  static std::vector<std::string> names = {"compute",  "all_gather", "reduce_scatter", "all_reduce",
                                           "other collectives", "waiting for communication (exposed)", "memory"};
  return names;
}
}  // namespace

const char* lane_name(Lane lane) {
  std::lock_guard<std::mutex> lk(lanes_mu());
  const auto& names = lane_names();
  const auto i = static_cast<size_t>(lane);
  return i < names.size() ? names[i].c_str() : "?";
}

Lane register_lane(const std::string& name) {
  std::lock_guard<std::mutex> lk(lanes_mu());
  auto& names = lane_names();
  for (size_t i = 0; i < names.size(); ++i)
    if (names[i] == name) return static_cast<Lane>(i);
  names.push_back(name);
  return static_cast<Lane>(names.size() - 1);
}

void enable(bool on) { detail::g_enabled.store(on); }
bool enabled() { return detail::g_enabled.load(); }

double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void record(Lane lane, std::string name, double start_us, double end_us) {
  if (!enabled()) return;
  std::lock_guard<std::mutex> lk(buffer_mu());
  buffer().push_back({lane, std::move(name), start_us, end_us});
}

void memory_sample(const std::string& device, double allocated_bytes) {
  if (!enabled()) return;
  const double t = now_us();
  std::lock_guard<std::mutex> lk(buffer_mu());
  buffer().push_back({Lane::Memory, device, t, t, allocated_bytes});
}

std::vector<Span> take() {
  std::vector<Span> out;
  {
    std::lock_guard<std::mutex> lk(buffer_mu());
    out.swap(buffer());
  }
  std::sort(out.begin(), out.end(), [](const Span& a, const Span& b) { return a.start_us < b.start_us; });
  return out;
}

std::string chrome_trace_events(const std::vector<Span>& spans, int rank) {
  std::vector<std::string> events;
  events.push_back(fmt::format(R"({{"name":"process_name","ph":"M","pid":{},"args":{{"name":"rank {}"}}}})", rank,
                               rank));
  std::vector<std::string> names;
  {
    std::lock_guard<std::mutex> lk(lanes_mu());
    names = lane_names();
  }
  for (size_t lane = 0; lane < names.size(); ++lane)
    if (static_cast<Lane>(lane) != Lane::Memory)  // a counter, not a thread
      events.push_back(fmt::format(R"({{"name":"thread_name","ph":"M","pid":{},"tid":{},"args":{{"name":"{}"}}}})",
                                   rank, lane, escape(names[lane])));
  for (const auto& s : spans) {
    if (s.lane == Lane::Memory) {  // a counter: Perfetto draws it as a track of the rank's process
      events.push_back(fmt::format(R"J({{"name":"memory allocated ({})","ph":"C","pid":{},"ts":{:.3f},"args":{{"MiB":{:.4f}}}}})J",
                                   escape(s.name), rank, s.start_us, s.value / 1048576.0));
      continue;
    }
    events.push_back(fmt::format(R"({{"name":"{}","ph":"X","pid":{},"tid":{},"ts":{:.3f},"dur":{:.3f}}})",
                                 escape(s.name), rank, static_cast<int>(s.lane), s.start_us,
                                 std::max(0.0, s.end_us - s.start_us)));
  }
  return fmt::format("{}", fmt::join(events, ",\n"));
}

std::string chrome_trace_file(const std::vector<std::string>& per_rank_events, const std::string& title) {
  std::vector<std::string> nonempty;
  for (const auto& e : per_rank_events)
    if (!e.empty()) nonempty.push_back(e);
  const std::string other = title.empty() ? "" : fmt::format("\"otherData\":{{\"title\":\"{}\"}},", escape(title));
  return fmt::format("{{\"displayTimeUnit\":\"ms\",{}\"traceEvents\":[\n{}\n]}}\n", other,
                     fmt::join(nonempty, ",\n"));
}

double covered_us(const std::vector<Span>& spans, Lane lane) {
  std::vector<std::pair<double, double>> iv;
  for (const auto& s : spans)
    if (s.lane == lane) iv.emplace_back(s.start_us, s.end_us);
  std::sort(iv.begin(), iv.end());
  double total = 0, cur_start = 0, cur_end = -1;
  for (auto [a, b] : iv) {
    if (a > cur_end) {
      if (cur_end > cur_start) total += cur_end - cur_start;
      cur_start = a;
      cur_end = b;
    } else {
      cur_end = std::max(cur_end, b);
    }
  }
  if (cur_end > cur_start) total += cur_end - cur_start;
  return total;
}

Summary summarize(const std::vector<Span>& spans) {
  return {covered_us(spans, Lane::Compute), covered_us(spans, Lane::AllGather), covered_us(spans, Lane::ReduceScatter),
          covered_us(spans, Lane::AllReduce), covered_us(spans, Lane::Wait)};
}

void write_chrome_trace(const std::string& path, const std::vector<Span>& spans, const std::string& title) {
  std::vector<std::string> all = dist::all_gather_strings(dist::world(), chrome_trace_events(spans, dist::rank()));
  if (dist::rank() != 0) return;
  std::ofstream out(path);
  TS_CHECK(out.good(), "cannot write trace file '{}'", path);
  out << chrome_trace_file(all, title);
  TS_CHECK(out.good(), "writing trace file '{}' failed", path);
}

}  // namespace tessera::trace
