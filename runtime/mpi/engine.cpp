#include "runtime/mpi/engine.h"

#include <atomic>
#include <cstdio>
#include <future>
#include <optional>

#include "runtime/check.h"
#include "runtime/trace.h"

namespace tessera::dist::detail {

namespace {
using Clock = std::chrono::steady_clock;
// Background progress: how often the progress thread tests in-flight collectives.
constexpr auto kPollInterval = std::chrono::microseconds(50);
// A waiter pumps without pause this long, then backs off (a slow peer should
// not cost a whole core).
constexpr auto kSpinBeforeBackoff = std::chrono::milliseconds(1);
constexpr auto kBackoff = std::chrono::microseconds(20);
// An idle progress thread looks for work this often even if nobody nudges it
// (a collective submitted just before one long kernel). Each wake-up costs:
// on 2 busy cores waking every 1 ms made a stream of 1 MiB all-gathers 30% slower.
constexpr auto kIdleWake = std::chrono::milliseconds(10);

const char* kind_name(int64_t id) {
  static const char* names[] = {"all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all", "barrier"};
  return id >= 0 && id < 6 ? names[id] : "?";
}

// "all_reduce(f32, 1000 -> 1000 elements, op sum, root -1)" from a descriptor
// [seq, kind, dtype, in, out, op, root].
std::string describe_descriptor(const int64_t* d) {
  return fmt::format("{}({}, {} -> {} elements, op {}, root {})", kind_name(d[1]),
                     dtype_name(static_cast<DType>(d[2])), d[3], d[4],
                     reduce_op_name(static_cast<ReduceOp>(d[5])), d[6]);
}

trace::Lane lane_of(const std::string& kind) {
  if (kind == "all_gather") return trace::Lane::AllGather;
  if (kind == "reduce_scatter") return trace::Lane::ReduceScatter;
  if (kind == "all_reduce") return trace::Lane::AllReduce;
  if (kind == "send" || kind == "recv") {  // point to point: a pipeline's activations and gradients
    static const trace::Lane p2p = trace::register_lane("send_recv");
    return p2p;
  }
  return trace::Lane::OtherCollective;
}

void complete(Collective& op, Collective::Stage stage, std::string error = "") {
  if (op.issued_us >= 0) {
    std::string own;
    {
      std::lock_guard<std::mutex> lock(op.group->stats_mu);
      own = op.group->trace_lane;
    }
    trace::record(own.empty() ? lane_of(op.kind) : trace::register_lane(own),
                  fmt::format("{} #{} ({})", op.kind, op.seq, op.group->name), op.issued_us, trace::now_us());
  }
  op.stage = stage;
  op.error = std::move(error);
  // The lambdas' references go now; keep_alive's stay until the collective is
  // waited for (release_buffers), so that memory is released at the same
  // point of the program on every run, however early the transfer finished
  // (PyTorch holds a reduce-scatter's input until the next group's
  // post-backward for the same reason). A collective nobody waits for
  // releases them when the last reference to it goes.
  op.start = nullptr;
  op.finish = nullptr;
  op.ready = nullptr;
  op.done.store(true, std::memory_order_release);
}
}  // namespace

void check_mpi(int code, const char* call, const char* file, int line) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  throw Error(fmt::format("{}:{}: {} failed: {} (is every rank still running?)", file, line, call,
                          std::string(text, static_cast<size_t>(len))));
}

MPI_Datatype transfer_type(DType dt) {
  switch (dt) {
    case DType::F32: return MPI_FLOAT;
    case DType::F64: return MPI_DOUBLE;
    case DType::BF16:
    case DType::F16: return MPI_UINT16_T;
    case DType::I32: return MPI_INT32_T;
    case DType::I64: return MPI_INT64_T;
    case DType::Bool: return MPI_C_BOOL;
  }
  return MPI_BYTE;
}

// ---- Collective ----------------------------------------------------------------

std::string Collective::describe() const {
  if (point_to_point)
    return fmt::format("{} {} rank {} (tag {}, message {} of this rank) on group '{}' [ranks {}]", kind,
                       kind == "send" ? "to" : "from", group->global_ranks[static_cast<size_t>(peer)], tag, seq,
                       group->name, fmt::join(group->global_ranks, ", "));
  return fmt::format("{} (seq {}) on group '{}' [ranks {}]", kind, seq, group->name,
                     fmt::join(group->global_ranks, ", "));
}

std::atomic<int64_t> g_wait_ns{0};
thread_local bool t_background_waits = false;  // dist::BackgroundWaits

void Collective::release_buffers() {
  if (!released.exchange(true, std::memory_order_acq_rel)) keep_alive.clear();
}

void Collective::wait() {
  if (!done.load(std::memory_order_acquire)) {
    std::optional<trace::Scope> waiting;
    if (!t_background_waits) waiting.emplace(trace::Lane::Wait, "wait");
    auto start = Clock::now();
    auto deadline = start + timeout();
    bool completed = Engine::get().wait_for(*this, deadline);
    if (!t_background_waits)
      g_wait_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count(),
                          std::memory_order_relaxed);
    if (!completed) {
      group->broken_reason = fmt::format("{} timed out", describe());
      group->broken = true;
      if (point_to_point)
        throw Error(fmt::format(
            "{} did not complete within {:.1f} s: the peer never posted the matching {} with tag {} (dead, "
            "stuck, or running a schedule that does not pair with this one). The group cannot be used any "
            "more. (TESSERA_COLLECTIVE_TIMEOUT sets the limit)",
            describe(), std::chrono::duration<double>(timeout()).count(), kind == "send" ? "recv" : "send", tag));
      throw Error(fmt::format(
          "{} did not complete within {:.1f} s: at least one rank never arrived (dead, stuck, or "
          "running a different collective). The group cannot be used any more. "
          "(TESSERA_COLLECTIVE_TIMEOUT sets the limit; TESSERA_DEBUG_COLLECTIVES=1 checks that "
          "ranks agree on every collective)",
          describe(), std::chrono::duration<double>(timeout()).count()));
    }
  }
  release_buffers();
  if (!error.empty()) throw Error(error);
}

void Collective::wait(Stream& stream) {
  if (stream.synchronous()) return wait();
  // The stream's thread waits (and pumps MPI, as a host waiter would); the
  // host goes on. An error surfaces at the stream's next synchronize.
  auto self = std::static_pointer_cast<Collective>(shared_from_this());
  stream.enqueue(kind.c_str(), [self] {
    if (!Engine::get().wait_for_on_stream(*self, Clock::now() + timeout()))
      throw Error(fmt::format("{} did not complete within {:.1f} s", self->describe(),
                              std::chrono::duration<double>(timeout()).count()));
    self->release_buffers();
    if (!self->error.empty()) throw Error(self->error);
  });
}

bool Collective::is_completed() {
  if (!done.load(std::memory_order_acquire)) Engine::get().progress_once();
  return done.load(std::memory_order_acquire);
}

// ---- Engine ------------------------------------------------------------------

Engine& Engine::get() {
  static Engine engine;
  return engine;
}

void Engine::start(bool thread_mode) {
  thread_mode_ = thread_mode;
  auto init = [] {
    int provided = 0;
    TS_MPI(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided));
    TS_CHECK(provided >= MPI_THREAD_SERIALIZED,
             "MPI provides thread level {}, Tessera needs MPI_THREAD_SERIALIZED", provided);
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  };
  if (thread_mode) {
    // MPI is initialised (and finalised) on the progress thread.
    std::promise<void> ready;
    auto ready_future = ready.get_future();
    thread_ = std::thread([this, &ready, init] {
      try {
        init();
      } catch (...) {
        ready.set_exception(std::current_exception());
        return;
      }
      ready.set_value();
      loop();
    });
    ready_future.get();  // rethrows an MPI_Init failure
  } else {
    init();
    poll_active = true;
  }
  started_ = true;
}

void Engine::stop() {
  if (!started_) return;
  if (thread_mode_) {
    {
      std::lock_guard<std::mutex> lk(queue_mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    thread_.join();
  } else {
    std::lock_guard<std::recursive_mutex> lk(mpi_mu_);
    stopping_ = true;
    auto deadline = Clock::now() + timeout();
    while (inflight_count_.load() > 0 || !queue_.empty()) {
      pump();
      if (Clock::now() > deadline) abort_if_stuck_at_exit();
      std::this_thread::sleep_for(kBackoff);
    }
    poll_active = false;
    MPI_Finalize();
  }
  started_ = false;
}

void Engine::abort_if_stuck_at_exit() {
  // Collectives that cannot complete (a rank is gone or diverged) must not hang
  // the exit: report the first one and abort the job.
  std::fprintf(stderr, "tessera: %s never completed; aborting the job\n",
               inflight_.empty() ? "a collective" : inflight_.front()->describe().c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 1);
}

void Engine::submit(std::shared_ptr<Collective> op) {
  if (trace::enabled()) op->issued_us = trace::now_us();
  last_caller_activity_ = Clock::now().time_since_epoch().count();
  {
    std::lock_guard<std::mutex> lk(queue_mu_);
    queue_.push_back(std::move(op));
  }
  {
    // Post it now if MPI is free: the transfer starts without a thread hand-off.
    std::unique_lock<std::recursive_mutex> lk(mpi_mu_, std::try_to_lock);
    if (lk.owns_lock()) pump();
  }
  // The progress thread is not woken here: the caller usually waits (and
  // pumps) soon after, and waking a thread on 2 busy cores costs more than the
  // collective (a 1 MiB all-gather took 2x as long). It is nudged at the first
  // op boundary kPollInterval later (progress_once), or finds the work itself
  // within kIdleWake.
  if (thread_mode_) {
    unnudged_ = true;
    if (!submitted_any_.load()) {  // once: from now on the idle thread keeps its 10 ms timer
      std::lock_guard<std::mutex> lk(queue_mu_);
      submitted_any_ = true;
      cv_.notify_one();
    }
  }
}

void Engine::run_sync(const std::function<void()>& fn) {
  std::lock_guard<std::recursive_mutex> lk(mpi_mu_);
  pump();
  drain_starts();
  fn();
}

void Engine::loop() {
  Clock::time_point stop_deadline{};
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(queue_mu_);
      if (queue_.empty() && inflight_count_.load() == 0) {
        if (stopping_) break;
        auto work = [&] { return stopping_ || !queue_.empty() || inflight_count_.load() > 0; };
        if (submitted_any_.load()) {
          cv_.wait_for(lk, kIdleWake, work);
        } else {  // nothing ever submitted (a world of one rank): sleep until the first
          cv_.wait(lk, [&] { return work() || submitted_any_.load(); });
        }
        continue;
      }
      if (waiters_.load() > 0 && !stopping_) {
        // A caller is pumping in wait(): stand back until it leaves (it wakes
        // this thread if work remains) instead of contending for MPI and a core.
        cv_.wait_for(lk, kIdleWake, [&] { return stopping_ || waiters_.load() == 0; });
        continue;
      }
      // The caller submitted or finished waiting a moment ago and is likely
      // about to wait (and pump) itself: contending now for MPI and a core
      // would only slow it down (on 2 cores, 2x for a 1 MiB all-gather).
      auto quiet_since = Clock::time_point(Clock::duration(last_caller_activity_.load()));
      auto resume_at = quiet_since + kPollInterval;
      if (!stopping_ && Clock::now() < resume_at) {
        cv_.wait_until(lk, resume_at, [&] { return stopping_; });
        continue;
      }
    }
    bool progressed;
    {
      std::lock_guard<std::recursive_mutex> lk(mpi_mu_);
      progressed = pump();
      if (stopping_ && inflight_count_.load() > 0) {
        bool all_broken = true;
        for (auto& op : inflight_) all_broken = all_broken && op->group->broken.load();
        if (stop_deadline == Clock::time_point{}) stop_deadline = Clock::now() + timeout();
        if (all_broken || Clock::now() > stop_deadline) abort_if_stuck_at_exit();
      }
    }
    if (progressed) continue;
    std::unique_lock<std::mutex> lk(queue_mu_);
    cv_.wait_for(lk, kPollInterval, [&] { return stopping_ || !queue_.empty(); });
  }
  MPI_Finalize();
}

void Engine::progress_once() {
  if (unnudged_.load(std::memory_order_relaxed)) {
    // Thread mode: the caller is computing while a collective it submitted
    // kPollInterval ago is in flight; hand the progress to the thread.
    auto since = Clock::now() - Clock::time_point(Clock::duration(last_caller_activity_.load()));
    if (since >= kPollInterval && unnudged_.exchange(false)) cv_.notify_one();
    return;
  }
  if (!poll_active.load(std::memory_order_relaxed) || inflight_count_.load(std::memory_order_relaxed) == 0) {
    if (!poll_active.load(std::memory_order_relaxed)) return;
    std::lock_guard<std::mutex> lk(queue_mu_);
    if (queue_.empty()) return;
  }
  std::unique_lock<std::recursive_mutex> lk(mpi_mu_, std::try_to_lock);
  if (lk.owns_lock()) pump();
}

bool Engine::wait_for(Collective& op, Clock::time_point deadline) {
  waiters_++;
  auto spin_until = Clock::now() + kSpinBeforeBackoff;
  bool ok = true;
  while (!op.done.load(std::memory_order_acquire)) {
    {
      std::lock_guard<std::recursive_mutex> lk(mpi_mu_);
      pump();
    }
    if (op.done.load(std::memory_order_acquire)) break;
    auto now = Clock::now();
    if (now >= deadline) {
      ok = false;
      break;
    }
    if (now < spin_until) std::this_thread::yield();
    else std::this_thread::sleep_for(kBackoff);
  }
  last_caller_activity_ = Clock::now().time_since_epoch().count();
  // Under queue_mu_, so the wake-up is not lost: the thread checks waiters_ under it.
  std::lock_guard<std::mutex> lk(queue_mu_);
  bool work_left = inflight_count_.load() > 0 || !queue_.empty();
  if (!work_left) unnudged_ = false;
  if (--waiters_ == 0 && thread_mode_ && work_left) cv_.notify_one();
  return ok;
}

bool Engine::wait_for_on_stream(Collective& op, Clock::time_point deadline) {
  // Never blocks on mpi_mu_: its holder may be the host in run_sync, waiting
  // for a collective that this stream's later work makes ready.
  while (!op.done.load(std::memory_order_acquire)) {
    {
      std::unique_lock<std::recursive_mutex> lk(mpi_mu_, std::try_to_lock);
      if (lk.owns_lock()) pump();
    }
    if (op.done.load(std::memory_order_acquire)) break;
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(kBackoff);
  }
  return true;
}

bool Engine::pump() {
  std::deque<std::shared_ptr<Collective>> fresh;
  {
    std::lock_guard<std::mutex> lk(queue_mu_);
    fresh.swap(queue_);
  }
  for (auto& op : fresh) begin(op);
  bool any = false;
  for (size_t i = 0; i < inflight_.size();) {
    if (test(inflight_[i])) {
      inflight_.erase(inflight_.begin() + static_cast<long>(i));
      inflight_count_--;
      any = true;
    } else {
      ++i;
    }
  }
  return any;
}

void Engine::drain_starts() {
  auto unstarted = [&] {
    for (auto& op : inflight_)
      if (op->stage == Collective::Stage::Checking || op->stage == Collective::Stage::Queued) return true;
    return false;
  };
  while (unstarted()) {
    if (!pump()) std::this_thread::sleep_for(kBackoff);
  }
}

void Engine::begin(const std::shared_ptr<Collective>& op) {
  GroupState& g = *op->group;
  if (g.broken.load()) {
    complete(*op, Collective::Stage::Failed,
             fmt::format("{} not started: the group is unusable ({})", op->describe(), g.broken_reason));
    return;
  }
  op->stage = Collective::Stage::Queued;
  if (debug_collectives() && !op->point_to_point) {
    size_t n = op->descriptor.size();
    op->gathered.resize(n * static_cast<size_t>(g.size));
    int rc = MPI_Iallgather(op->descriptor.data(), static_cast<int>(n), MPI_INT64_T, op->gathered.data(),
                            static_cast<int>(n), MPI_INT64_T, g.check_comm, &op->check_request);
    if (rc != MPI_SUCCESS) {
      complete(*op, Collective::Stage::Failed, fmt::format("{}: descriptor exchange failed", op->describe()));
      return;
    }
    op->stage = Collective::Stage::Checking;
  }
  inflight_.push_back(op);
  inflight_count_++;
}

bool Engine::test(const std::shared_ptr<Collective>& op) {
  GroupState& g = *op->group;
  try {
    if (op->stage == Collective::Stage::Checking) {
      int flag = 0;
      TS_MPI(MPI_Test(&op->check_request, &flag, MPI_STATUS_IGNORE));
      if (!flag) return false;
      size_t n = op->descriptor.size();
      for (int r = 0; r < g.size; ++r) {
        const int64_t* theirs = op->gathered.data() + static_cast<size_t>(r) * n;
        if (std::equal(theirs, theirs + n, op->descriptor.data())) continue;
        g.broken_reason = fmt::format("collective mismatch at seq {}", op->seq);
        g.broken = true;
        complete(*op, Collective::Stage::Failed,
                 fmt::format("collective mismatch on group '{}' at seq {}: rank {} calls {} but rank {} "
                             "calls {} (seq {})",
                             g.name, op->seq, g.global_ranks[static_cast<size_t>(g.rank)],
                             describe_descriptor(op->descriptor.data()), g.global_ranks[static_cast<size_t>(r)],
                             describe_descriptor(theirs), theirs[0]));
        return true;
      }
      op->stage = Collective::Stage::Queued;
    }
    if (op->stage == Collective::Stage::Queued) {
      // An earlier collective of this group goes first (messages match by tag instead).
      if (!op->point_to_point && op->seq != g.started_seq) return false;
      if (op->ready && !op->ready->query()) return false;  // its inputs are still being produced
      op->start(op->requests);
      if (!op->point_to_point) g.started_seq++;
      op->stage = Collective::Stage::Running;
    }
    int flag = 0;
    TS_MPI(MPI_Testall(static_cast<int>(op->requests.size()), op->requests.data(), &flag, MPI_STATUSES_IGNORE));
    if (!flag) return false;
    if (op->finish) op->finish();
    complete(*op, Collective::Stage::Done);
  } catch (const std::exception& e) {
    g.broken_reason = e.what();
    g.broken = true;
    complete(*op, Collective::Stage::Failed, fmt::format("{}: {}", op->describe(), e.what()));
  }
  return true;
}

}  // namespace tessera::dist::detail

namespace tessera::dist {
double total_wait_seconds() { return static_cast<double>(detail::g_wait_ns.load()) * 1e-9; }

BackgroundWaits::BackgroundWaits() : saved_(detail::t_background_waits) { detail::t_background_waits = true; }
BackgroundWaits::~BackgroundWaits() { detail::t_background_waits = saved_; }
}  // namespace tessera::dist
