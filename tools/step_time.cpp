#include "tools/step_time.h"

#include <fmt/format.h>
#include <toml++/toml.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <numeric>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "runtime/check.h"
#include "runtime/cpu/isa.h"
#include "runtime/parallel.h"
#include "tools/plan.h"

namespace tessera::tools {

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}


}  // namespace

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0 && line.find(':') != std::string::npos) {
      std::string name = line.substr(line.find(':') + 1);
      name.erase(0, name.find_first_not_of(' '));
      return name;
    }
  return "unknown CPU";
}

std::string cache_dir() {
  if (const char* d = std::getenv("TESSERA_CACHE_DIR"); d != nullptr && *d != 0) return d;
  if (const char* d = std::getenv("XDG_CACHE_HOME"); d != nullptr && *d != 0) return std::string(d) + "/tessera";
  if (const char* h = std::getenv("HOME"); h != nullptr && *h != 0) return std::string(h) + "/.cache/tessera";
  return ".tessera-cache";
}

// ---- communication ------------------------------------------------------------

CollectiveFit fit_alpha_beta(const std::vector<double>& bytes, const std::vector<double>& seconds) {
  TS_CHECK(bytes.size() == seconds.size() && bytes.size() >= 2,
           "fit_alpha_beta: expected at least two (bytes, seconds) points, got {} and {}", bytes.size(),
           seconds.size());
  // Minimise sum ((alpha + beta x - t) / t)^2: the normal equations of rows (1/t, x/t) -> 1.
  double s11 = 0, s12 = 0, s22 = 0, r1 = 0, r2 = 0;
  for (size_t i = 0; i < bytes.size(); ++i) {
    TS_CHECK(seconds[i] > 0 && bytes[i] >= 0, "fit_alpha_beta: point {} has {} bytes in {} s", i, bytes[i],
             seconds[i]);
    const double a = 1 / seconds[i], b = bytes[i] / seconds[i];
    s11 += a * a, s12 += a * b, s22 += b * b, r1 += a, r2 += b;
  }
  const double det = s11 * s22 - s12 * s12;
  TS_CHECK(det > 0, "fit_alpha_beta: the points do not determine a line (all of one size?)");
  CollectiveFit f{(r1 * s22 - r2 * s12) / det, (s11 * r2 - s12 * r1) / det};
  f.alpha_s = std::max(f.alpha_s, 0.0);
  f.beta_s_per_byte = std::max(f.beta_s_per_byte, 0.0);
  return f;
}

double CommModel::seconds(const std::string& kind, int group_size, double bytes, const std::string& group) const {
  if (group_size <= 1) return 0;
  if (auto g = group_fits.find(group); g != group_fits.end())
    if (auto k = g->second.find(kind); k != g->second.end())
      if (auto f = k->second.find(group_size); f != k->second.end())
        return f->second.alpha_s + f->second.beta_s_per_byte * bytes;
  // A barrier moves nothing; collectives without a fit of their own are
  // priced as the nearest kind that has one.
  std::string k = kind;
  if (!fits.count(k)) {
    if (k == "broadcast" && fits.count("all_gather")) k = "all_gather";
    else if (fits.count("all_reduce")) k = "all_reduce";
    else if (fits.count("reduce_scatter")) k = "reduce_scatter";
    else return 0;
  }
  const auto& by_size = fits.at(k);
  if (by_size.empty()) return 0;
  auto it = by_size.find(group_size);
  if (it != by_size.end()) return it->second.alpha_s + it->second.beta_s_per_byte * bytes;
  // The nearest fitted size, carried along the ring: alpha (W-1), beta (W-1)/W.
  auto nearest = std::min_element(by_size.begin(), by_size.end(), [&](const auto& a, const auto& b) {
    return std::abs(std::log(static_cast<double>(a.first) / group_size)) <
           std::abs(std::log(static_cast<double>(b.first) / group_size));
  });
  const double w0 = nearest->first, w = group_size;
  if (w0 <= 1) return 0;
  const double alpha = nearest->second.alpha_s / (w0 - 1), beta = nearest->second.beta_s_per_byte * w0 / (w0 - 1);
  return alpha * (w - 1) + beta * (w - 1) / w * bytes;
}

CommModel load_comm_fits(const std::string& dir) {
  CommModel m;
  std::error_code ec;
  if (std::filesystem::is_directory(dir, ec))
    for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
      const std::string name = entry.path().filename().string();
      if (name.rfind("collectives-", 0) != 0) continue;
      std::ifstream in(entry.path());
      std::string line;
      while (std::getline(in, line)) {
        if (line.empty() || line[0] == '#') continue;
        std::istringstream fields(line);
        std::string kind;
        int ranks = 0;
        CollectiveFit f;
        if (fields >> kind >> ranks >> f.alpha_s >> f.beta_s_per_byte) m.fits[kind][ranks] = f;
      }
    }
  TS_CHECK(!m.fits.empty(),
           "no collective fits in {}: measure this machine's collectives first, at the world sizes you plan, "
           "e.g. `mpirun -np 2 build/benchmarks/bench_collectives 16 --save` (and -np 4)",
           dir);
  return m;
}

// ---- described hardware ---------------------------------------------------------

CommModel comm_model(const Hardware& hw, const std::vector<kernel_log::Collective>& collectives) {
  // Ring collectives: an all-gather or reduce-scatter of B bytes moves
  // (W-1)/W x B over each device's link in W-1 steps; an all-reduce twice that.
  CommModel m;
  // Tensor-parallel groups are the innermost mesh dim: consecutive ranks,
  // and the shard groups' ranks lie tp apart.
  int tp = 1;
  for (const auto& c : collectives)
    if (c.group == "tp") tp = c.group_size;
  for (const auto& c : collectives) {
    const int w = c.group_size;
    if (w <= 1) continue;
    // A group whose ranks lie within a node uses NVLink: the tensor-parallel
    // group, the world, the shard group (hpZ's post-forward groups) when its
    // w x tp ranks fit; any other (HSDP's replicas, strided across nodes; a
    // larger group) crosses nodes.
    const int64_t span = c.group == "tp" || c.group == "world" ? w
                         : c.group.rfind("dp_shard", 0) == 0 ? int64_t{w} * tp
                                                              : std::numeric_limits<int64_t>::max();
    const bool intra = span <= hw.devices_per_node;
    const double bw = intra ? hw.intra_node_bandwidth : hw.inter_node_bandwidth;
    const double lat = intra ? hw.intra_node_latency_s : hw.inter_node_latency_s;
    const double factor = c.kind == "all_reduce" ? 2 : 1;
    // Expressed as the fit at this size: alpha = (W-1) lat, beta = (W-1)/W / bw.
    m.group_fits[c.group][c.kind][w] = {factor * (w - 1) * lat, factor * (w - 1.0) / w / bw};
  }
  return m;
}

std::vector<double> roofline_kernels(const kernel_log::Log& log, const Hardware& hw) {
  std::vector<double> out;
  out.reserve(log.kernels.size());
  for (const auto& k : log.kernels) {
    // 16-bit if its signature names a 16-bit tensor (tensors read "bf16[...]").
    std::string dtype = "float32";
    if (k.signature.find("bf16") != std::string::npos) dtype = "bfloat16";
    else if (k.signature.find("f16") != std::string::npos) dtype = "float16";
    const double flops = k.flops / (hw.peak_flops.at(dtype) * hw.gemm_efficiency);
    const double bytes = k.bytes / (hw.memory_bandwidth * hw.memory_efficiency);
    out.push_back(std::max(flops, bytes) + hw.kernel_overhead_s);
  }
  return out;
}

// ---- kernels on this machine ----------------------------------------------------------

std::string kernel_cache_path(const std::string& dir, int threads, int concurrent, bool pinned) {
  const std::string key = fmt::format("{} {} threads {} ranks {}{}", cpu_model(), cpu::isa_name(cpu::active_isa()),
                                      threads, concurrent, pinned ? " pinned" : "");
  return fmt::format("{}/kernel-times-{:016x}.tsv", dir, std::hash<std::string>{}(key));
}

// Buffers a kernel is timed on, in all: twice the last-level cache of a
// common server core complex (32 MiB).
constexpr double kColdBytes = 64.0 * 1048576.0;

namespace {

// Runs body(c) for every worker c = 0 .. concurrent-1 at once, each on a
// thread of its own with `threads` threads, kept to rank c's cores when
// `pinned` (tools::rank_cpus); one unpinned worker runs on the caller.
void on_workers(int concurrent, int threads, bool pinned, const std::function<void(int)>& body) {
  auto worker = [&](int c) {
    if (pinned)
      if (const std::vector<int> cpus = rank_cpus(c, concurrent, threads); !cpus.empty()) pin_thread_to(cpus);
    set_num_threads(threads);
    body(c);
  };
  if (concurrent == 1 && !pinned) return worker(0);
  std::vector<std::thread> pool;
  for (int c = 0; c < concurrent; ++c) pool.emplace_back(worker, c);
  for (auto& t : pool) t.join();
}

// Seconds of one call of `k` as a rank runs it: alongside the node's other
// ranks (`concurrent` workers, each running it too on buffers of its own,
// with `threads` threads). Once to warm caches and pages, then three batches
// of at least 2 ms, each started together on every worker and timed until the
// last worker finishes (the workers share the cores); the fastest batch (the
// others met interference).
double time_kernel(const kernel_log::Kernel& k, int threads, int concurrent, bool pinned) {
  // A memory-bound kernel (no FLOPs logged) seldom finds its operands in
  // cache in a step, as it would run again and again on the same buffers:
  // each worker rotates over copies of them that together exceed the
  // last-level cache. Products (GEMM, attention) are timed on one set: their
  // time is the arithmetic, and in a step their operands (the activations
  // just made, the parameters just gathered) are mostly in cache. (Both
  // choices measured: benchmarks/README.md, the planner.)
  const int copies =
      k.flops > 0 ? 1 : static_cast<int>(std::clamp(std::ceil(kColdBytes / std::max(k.bytes, 1.0)), 1.0, 16.0));
  std::vector<std::vector<std::function<void()>>> runs(static_cast<size_t>(concurrent));
  for (auto& mine : runs)
    for (int i = 0; i < copies; ++i) mine.push_back(k.prepare());
  double once = 0;
  {
    for (auto& run : runs[0]) run();
    const double t0 = now_s();
    for (auto& run : runs[0]) run();
    once = std::max((now_s() - t0) / copies, 1e-7);
  }
  const int reps = static_cast<int>(std::clamp(2e-3 / once, 1.0, 1000.0));
  constexpr int kBatches = 3;
  std::vector<double> starts(static_cast<size_t>(concurrent * kBatches)), ends(starts.size());
  std::barrier sync(concurrent);
  on_workers(concurrent, threads, pinned, [&](int c) {
    const auto& mine = runs[static_cast<size_t>(c)];
    for (const auto& run : mine) run();
    for (int batch = 0; batch < kBatches; ++batch) {
      sync.arrive_and_wait();
      const auto slot = static_cast<size_t>(batch * concurrent + c);
      starts[slot] = now_s();
      for (int i = 0; i < reps; ++i) mine[static_cast<size_t>(i % copies)]();
      ends[slot] = now_s();
    }
  });
  double best = std::numeric_limits<double>::infinity();
  for (int batch = 0; batch < kBatches; ++batch) {
    const auto first = starts.begin() + batch * concurrent, last = ends.begin() + batch * concurrent;
    const double wall = *std::max_element(last, last + concurrent) - *std::min_element(first, first + concurrent);
    best = std::min(best, wall / reps);
  }
  return best;
}

// The step's kernels replayed in program order, again and again for at
// least kReplaySeconds on every worker at once (each on buffers of its own,
// one set per distinct signature): seconds per step. A kernel timed alone
// for milliseconds meets neither what the kernels before it left in the
// caches nor the machine's speed over seconds (on a shared host it moves by
// 2x over seconds: benchmarks/README.md, the planner); the replay does, and
// averages over the swings. 0 when the buffers would take more than
// `budget_bytes`.
constexpr double kReplaySeconds = 2.0;

double replay_step(const kernel_log::Log& log, double summed_seconds, int threads, int concurrent, bool pinned,
                   double budget_bytes) {
  std::unordered_map<std::string, size_t> slot;
  std::vector<size_t> order;
  std::vector<const kernel_log::Kernel*> distinct;
  double bytes = 0;
  for (const auto& k : log.kernels) {
    auto [it, fresh] = slot.emplace(k.signature, distinct.size());
    if (fresh) distinct.push_back(&k), bytes += k.bytes;
    order.push_back(it->second);
  }
  if (order.empty() || bytes * concurrent > budget_bytes) return 0;
  std::vector<std::vector<std::function<void()>>> runs(static_cast<size_t>(concurrent));
  for (auto& mine : runs)
    for (const auto* k : distinct) mine.push_back(k->prepare());
  const int reps = static_cast<int>(std::clamp(std::ceil(kReplaySeconds / std::max(summed_seconds, 1e-6)), 1.0, 1e6));
  std::vector<double> starts(static_cast<size_t>(concurrent)), ends(starts.size());
  std::barrier sync(concurrent);
  on_workers(concurrent, threads, pinned, [&](int c) {
    const auto& mine = runs[static_cast<size_t>(c)];
    for (size_t i : order) mine[i]();  // warm: pages, caches, thread pools
    sync.arrive_and_wait();
    starts[static_cast<size_t>(c)] = now_s();
    for (int r = 0; r < reps; ++r)
      for (size_t i : order) mine[i]();
    ends[static_cast<size_t>(c)] = now_s();
  });
  return (*std::max_element(ends.begin(), ends.end()) - *std::min_element(starts.begin(), starts.end())) / reps;
}

// The replay's entry in the kernel cache: one per sequence of signatures.
std::string replay_key(const kernel_log::Log& log) {
  size_t h = 0;
  for (const auto& k : log.kernels) h = h * 1000003u ^ std::hash<std::string>{}(k.signature);
  return fmt::format("replay of {} kernels {:016x}", log.kernels.size(), h);
}

}  // namespace

Calibration measure_kernels(const kernel_log::Log& log, int threads, int concurrent, const std::string& cache_path,
                            bool pinned) {
  TS_CHECK(threads >= 1 && concurrent >= 1, "measure_kernels: expected positive thread and rank counts, got {} and {}",
           threads, concurrent);
  // The cache: one line per signature, "seconds<TAB>signature".
  std::unordered_map<std::string, double> known;
  if (!cache_path.empty()) {
    std::ifstream in(cache_path);
    std::string line;
    while (std::getline(in, line)) {
      const size_t tab = line.find('\t');
      if (line.empty() || line[0] == '#' || tab == std::string::npos) continue;
      try {
        known[line.substr(tab + 1)] = std::stod(line.substr(0, tab));
      } catch (const std::exception&) {
        // a damaged line is measured again
      }
    }
  }
  const int saved_threads = num_threads();
  set_num_threads(threads);
  struct Restore {
    int n;
    ~Restore() { set_num_threads(n); }
  } restore{saved_threads};

  Calibration cal;
  std::unordered_set<std::string> seen;
  for (const auto& k : log.kernels) {
    if (auto it = known.find(k.signature); it != known.end()) {
      if (seen.insert(k.signature).second) ++cal.cached;
      cal.seconds.push_back(it->second);
      continue;
    }
    seen.insert(k.signature);
    const double seconds = time_kernel(k, threads, concurrent, pinned);
    known[k.signature] = seconds;
    ++cal.measured;
    cal.seconds.push_back(seconds);
  }
  // Every kernel scaled alike so that the step takes what its replay took.
  const double summed = std::accumulate(cal.seconds.begin(), cal.seconds.end(), 0.0);
  const std::string key = replay_key(log);
  bool replayed = false;
  if (auto it = known.find(key); it != known.end() && it->second > 0) {
    cal.replay_scale = it->second;
  } else if (summed > 0) {
    const double step = replay_step(log, summed, threads, concurrent, pinned, 0.25 * available_host_memory());
    if (step > 0) cal.replay_scale = known[key] = step / summed, replayed = true;
  }
  for (double& x : cal.seconds) x *= cal.replay_scale;
  if (!cache_path.empty() && (cal.measured > 0 || replayed)) {
    std::error_code ec;
    std::filesystem::create_directories(std::filesystem::path(cache_path).parent_path(), ec);
    std::ofstream out(cache_path, std::ios::trunc);
    out << "# tessera kernel times (seconds, signature): " << cpu_model() << ", "
        << cpu::isa_name(cpu::active_isa()) << ", " << threads << " thread(s) in each of " << concurrent
        << " rank(s)" << (pinned ? ", each pinned to its cores" : "") << "\n";
    for (const auto& [sig, s] : known) out << fmt::format("{:.9g}\t{}\n", s, sig);
  }
  return cal;
}

// ---- the schedule ---------------------------------------------------------------------

StepTime simulate_step(const kernel_log::Log& log, const std::vector<double>& kernel_seconds, const CommModel& comm,
                       double compute_scale, bool overlap) {
  TS_CHECK(kernel_seconds.size() == log.kernels.size(), "simulate_step: {} kernel times for {} kernels",
           kernel_seconds.size(), log.kernels.size());
  StepTime t;
  double clock = 0, channel_free = 0;  // the compute stream's time; when the channel is next free
  std::vector<double> ends(log.collectives.size(), -1);
  std::deque<size_t> pending;  // without overlap: issued, not yet run
  // The host's time around the kernels, spread evenly over them.
  const double host_per_kernel =
      log.kernels.empty() ? 0 : log.host_seconds * compute_scale / static_cast<double>(log.kernels.size());
  auto duration = [&](size_t i) {
    const auto& c = log.collectives[i];
    return comm.seconds(c.kind, c.group_size, c.bytes, c.group);
  };
  for (const auto& e : log.events) {
    const auto i = static_cast<size_t>(e.index);
    switch (e.type) {
      case kernel_log::Event::Type::Kernel: {
        const double s = kernel_seconds[i] * compute_scale;
        clock += s + host_per_kernel;
        t.compute_s += s;
        t.host_s += host_per_kernel;
        t.compute_by_kernel[log.kernels[i].name] += s;
        break;
      }
      case kernel_log::Event::Type::Issue:
        t.communication_s += duration(i);
        if (overlap) {
          const double start = std::max(clock, channel_free);
          ends[i] = channel_free = start + duration(i);
        } else {
          pending.push_back(i);
        }
        break;
      case kernel_log::Event::Type::Wait:
        // Without overlap the channel runs only now, while the compute waits:
        // every collective issued up to this one, in order.
        while (ends[i] < 0 && !pending.empty()) {
          const size_t j = pending.front();
          pending.pop_front();
          ends[j] = channel_free = std::max(clock, channel_free) + duration(j);
          t.exposed_s += ends[j] - clock;
          clock = ends[j];
        }
        if (ends[i] > clock) {
          t.exposed_s += ends[i] - clock;
          clock = ends[i];
        }
        break;
    }
  }
  for (size_t j : pending) ends[j] = channel_free = std::max(clock, channel_free) + duration(j);
  t.step_s = std::max(clock, channel_free);
  return t;
}

std::string format_step_time(const StepTime& t, const std::string& how) {
  auto ms = [](double s) { return fmt::format("{:.1f} ms", s * 1e3); };
  std::string out = fmt::format("step time ({}): {}\n", how, ms(t.step_s));
  out += fmt::format("  kernels {}, host {}, communication {}, exposed {} ({:.1f}% of the step)\n",
                     ms(t.compute_s), ms(t.host_s), ms(t.communication_s), ms(t.exposed_s),
                     t.step_s > 0 ? 100 * t.exposed_s / t.step_s : 0.0);
  std::vector<std::pair<double, std::string>> kinds;
  for (const auto& [name, s] : t.compute_by_kernel) kinds.emplace_back(s, name);
  std::sort(kinds.rbegin(), kinds.rend());
  std::string parts;
  for (size_t i = 0; i < kinds.size() && i < 6; ++i)
    parts += fmt::format("{}{} {}", i ? ", " : "", kinds[i].second, ms(kinds[i].first));
  out += "  compute by kernel: " + parts + "\n";
  return out;
}

}  // namespace tessera::tools
