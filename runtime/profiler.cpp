#include "runtime/profiler.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

namespace tessera::profiler {

namespace detail {
std::atomic<bool> g_enabled{false};
void (*g_barrier)() = nullptr;

namespace {
std::map<std::string, Entry>& table() {
  thread_local std::map<std::string, Entry> t;
  return t;
}
std::map<std::string, Entry>& kernel_table() {
  thread_local std::map<std::string, Entry> t;
  return t;
}
}  // namespace

void record(const char* name, double ms) {
  Entry& e = table()[name];
  e.total_ms += ms;
  e.calls += 1;
}

int& depth() {
  thread_local int d = 0;
  return d;
}
}  // namespace detail

void enable(bool on) { detail::g_enabled.store(on); }
void set_scope_barrier(void (*barrier)()) { detail::g_barrier = barrier; }
bool enabled() { return detail::g_enabled.load(); }
void reset() {
  detail::table().clear();
  detail::kernel_table().clear();
}

void record_kernel(const char* kind, double ms, double flops) {
  Entry& e = detail::kernel_table()[kind];
  e.total_ms += ms;
  e.calls += 1;
  e.flops += flops;
}

Entry kernel_time(const char* kind) {
  auto it = detail::kernel_table().find(kind);
  Entry e = it == detail::kernel_table().end() ? Entry{} : it->second;
  e.name = kind;
  return e;
}

namespace {
// The entries of `table` whose names begin with `prefix`, named, most time first.
std::vector<Entry> largest_first(const std::map<std::string, Entry>& table, const std::string& prefix) {
  std::vector<Entry> out;
  for (const auto& [name, e] : table) {
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    out.push_back(e);
    out.back().name = name;
  }
  std::sort(out.begin(), out.end(), [](const Entry& a, const Entry& b) { return a.total_ms > b.total_ms; });
  return out;
}
}  // namespace

std::vector<Entry> kernel_summary(const std::string& prefix) { return largest_first(detail::kernel_table(), prefix); }

std::vector<Entry> summary() { return largest_first(detail::table(), ""); }

std::string format_summary(double total_ms) {
  auto entries = summary();
  double sum = 0;
  for (auto& e : entries) sum += e.total_ms;
  if (total_ms <= 0) total_ms = sum;
  std::string s = fmt::format("{:<28} {:>10} {:>7} {:>8}\n", "op", "total ms", "%", "calls");
  for (auto& e : entries)
    s += fmt::format("{:<28} {:>10.2f} {:>6.1f}% {:>8}\n", e.name, e.total_ms,
                     100.0 * e.total_ms / total_ms, e.calls);
  s += fmt::format("{:<28} {:>10.2f} {:>6.1f}%\n", "(sum of ops)", sum, 100.0 * sum / total_ms);
  return s;
}

}  // namespace tessera::profiler
