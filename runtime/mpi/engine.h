// The communication engine: every MPI call goes through it. Collectives are
// queued by the calling thread and started, tested and finished by whoever
// "pumps" the engine, one thread at a time (MPI_THREAD_SERIALIZED):
//   - the submitting caller, which posts a collective's messages at once if
//     MPI is free;
//   - the progress thread (thread mode), in the background while the caller
//     computes, testing in-flight collectives every ~50 us. It is not woken
//     per submission (on 2 busy cores a wake-up costs more than a 1 MiB
//     gather): the first op boundary 50 us after a submission nudges it, a
//     waiter leaving with work in flight wakes it, and it looks by itself
//     every 10 ms (once anything was ever submitted: a world of one rank
//     never wakes it);
//   - a caller blocked in Work::wait(), which pumps until its collective is
//     done (as MPI_Wait would) instead of paying a thread hand-off; the
//     thread stands back meanwhile;
//   - the compute thread at op boundaries (poll mode, no progress thread).
// Internal to runtime/.
#pragma once

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "runtime/distributed.h"
#include "runtime/stream.h"

namespace tessera::dist::detail {

// Reports an MPI error with file:line, the call and MPI's own explanation.
void check_mpi(int code, const char* call, const char* file, int line);
#define TS_MPI(call) ::tessera::dist::detail::check_mpi((call), #call, __FILE__, __LINE__)

class GroupState;

// One collective in flight. Its Tensors stay referenced until it is waited
// for (or, if nobody waits, until the last reference to it goes).
struct Collective : public Work {
  enum class Stage { Queued, Checking, Running, Done, Failed };

  std::string kind;  // "all_gather", "reduce_scatter", ..., "send", "recv"
  // A message to or from one peer: posted in this rank's order, matched by
  // its tag (not the group's sequence), never checked against the others.
  bool point_to_point = false;
  int peer = -1, tag = -1;  // point_to_point: the peer's group rank, the tag
  std::shared_ptr<GroupState> group;
  int64_t seq = 0;
  std::vector<int64_t> descriptor;  // what every rank must agree on (debug mode)
  std::vector<Tensor> keep_alive;
  std::shared_ptr<Event> ready;  // asynchronous devices: MPI starts once this completed
  std::function<void(std::vector<MPI_Request>&)> start;  // posts the nonblocking MPI calls
  std::function<void()> finish;                          // after completion (sums, casts)

  // Engine-side state (touched only while pumping).
  Stage stage = Stage::Queued;
  std::vector<MPI_Request> requests;
  MPI_Request check_request = MPI_REQUEST_NULL;
  std::vector<int64_t> gathered;  // everyone's descriptors (debug mode)
  std::string error;
  std::atomic<bool> done{false};
  double issued_us = -1;  // for the trace: issue to completion on the collective's lane

  std::atomic<bool> released{false};  // keep_alive cleared (once, by the first waiter)

  void wait() override;
  void wait(Stream& stream) override;
  void release_buffers();  // after done: drops keep_alive
  bool is_completed() override;
  std::string describe() const;  // "all_reduce (seq 17) on group 'world' [ranks 0, 1, 2, 3]"
};

// Per-communicator state shared by a ProcessGroup and its in-flight collectives.
class GroupState {
 public:
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Comm check_comm = MPI_COMM_NULL;  // descriptor exchanges (debug mode)
  MPI_Comm p2p_comm = MPI_COMM_NULL;    // point-to-point messages (their own tags)
  int64_t next_p2p = 0;                 // point-to-point messages issued (numbers them in errors)
  std::string name;
  std::vector<int> global_ranks;
  int rank = 0;
  int size = 1;
  bool simulated = false;   // dist::simulated_group: counted and checked, never sent
  int64_t next_seq = 0;     // assigned at enqueue (caller thread)
  int64_t started_seq = 0;  // collectives posted to MPI so far (engine)
  std::atomic<bool> broken{false};
  std::string broken_reason;
  std::mutex stats_mu;
  CollectiveStats stats;
  std::string trace_lane;  // set_trace_lane's (under stats_mu); empty: each kind's lane
};

class Engine {
 public:
  static Engine& get();
  // Initialises MPI; thread mode also starts the progress thread.
  void start(bool thread_mode);
  void stop();  // completes queued work (or aborts after the timeout), finalises MPI
  bool started() const { return started_; }
  bool thread_mode() const { return thread_mode_; }

  void submit(std::shared_ptr<Collective> op);
  // Runs fn with MPI available to the calling thread, after every collective
  // submitted before it has been posted (blocking MPI calls such as
  // MPI_Comm_split must keep program order on every rank).
  void run_sync(const std::function<void()>& fn);
  // One pump if nobody else is pumping (poll mode's op-boundary hook).
  void progress_once();
  // Pumps until op completes or the deadline passes (false then).
  bool wait_for(Collective& op, std::chrono::steady_clock::time_point deadline);
  // The same from a stream's worker thread (Work::wait(Stream&)): pumps only
  // when MPI is free, so it never blocks behind a host in run_sync.
  bool wait_for_on_stream(Collective& op, std::chrono::steady_clock::time_point deadline);

  std::atomic<bool> poll_active{false};

 private:
  void loop();
  bool pump();  // with mpi_mu_ held: begin queued collectives, test in-flight ones
  void begin(const std::shared_ptr<Collective>& op);
  bool test(const std::shared_ptr<Collective>& op);  // true when it left the in-flight set
  void drain_starts();
  void abort_if_stuck_at_exit();

  std::mutex queue_mu_;
  std::condition_variable cv_;  // the progress thread sleeps here
  std::deque<std::shared_ptr<Collective>> queue_;
  std::recursive_mutex mpi_mu_;  // held by whoever calls MPI; guards inflight_
  std::vector<std::shared_ptr<Collective>> inflight_;
  std::atomic<int> inflight_count_{0};
  std::atomic<int> waiters_{0};  // callers pumping in wait(): the thread stands back
  // steady_clock ticks of the caller's last submit or wait() exit: the thread
  // starts pumping only kPollInterval after it.
  std::atomic<int64_t> last_caller_activity_{0};
  std::atomic<bool> unnudged_{false};  // submitted work the thread has not been told about
  std::atomic<bool> submitted_any_{false};  // until then an idle thread sleeps without a timer
  std::thread thread_;
  bool thread_mode_ = true;
  bool started_ = false;
  bool stopping_ = false;
};

// The MPI type for a dtype as moved by collectives that do no arithmetic.
MPI_Datatype transfer_type(DType dt);

}  // namespace tessera::dist::detail
