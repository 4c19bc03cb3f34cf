// The watchdog of a process group whose collectives the host can only poll
// (NCCL's: an event recorded after each collective on a CUDA stream), and the
// group's promise that follows from it: no collective hangs a rank forever.
//
// Every collective the group queues is watched with a deadline (dist::timeout()).
// A thread polls the in-flight ones; the first found past its deadline aborts
// the group once (for NCCL, ncclCommAbort, which makes the kernels stuck in
// the communicator return) with a message naming the collective, the group
// and the sequence number. From then on wait() and every new collective throw
// that message, so a rank blocked in any host sync wakes with the error
// instead of hanging (PyTorch's ProcessGroupNCCL watchdog plays the same role).
//
// The host waits by polling too (wait_until), never by a blocking sync that no
// timeout can interrupt.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace tessera::dist {

class Watchdog {
 public:
  using Clock = std::chrono::steady_clock;
  // `abort` is called at most once, from the watchdog's thread or from a
  // timed-out wait, with the message the group fails with.
  explicit Watchdog(std::function<void(const std::string&)> abort,
                    std::chrono::milliseconds poll = std::chrono::milliseconds(100));
  ~Watchdog();  // stops the thread; never aborts
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Watches a queued collective: `done` polls it without blocking; `what`
  // names it ("all_reduce #17 on group 'dp' [ranks 0, 1]").
  void watch(std::string what, std::function<bool()> done, std::chrono::milliseconds timeout);
  // Blocks the host until done() (polling: yields, then short sleeps), the
  // deadline, or an abort. Throws the abort's message after an abort; at its
  // own deadline aborts the group first, naming `what` and `timeout` (the
  // limit the deadline stands for).
  void wait_until(const std::string& what, const std::function<bool()>& done, Clock::time_point deadline,
                  std::chrono::milliseconds timeout);
  // Aborts the group with `message` now (once; a later call changes nothing),
  // as a late collective would: an error the caller found itself.
  void fail(const std::string& message) { abort_once(message); }
  // Throws the abort's message if the group was aborted.
  void check() const;
  bool aborted() const;
  std::string failure() const;  // "" while healthy
  size_t in_flight() const;     // collectives watched and not yet seen complete

  // The message for a collective that missed its deadline.
  static std::string timeout_message(const std::string& what, std::chrono::milliseconds timeout);

 private:
  struct Entry {
    std::string what;
    std::function<bool()> done;
    Clock::time_point deadline;
    std::chrono::milliseconds timeout;
  };
  void run();
  void abort_once(const std::string& message);

  std::function<void(const std::string&)> abort_;
  std::chrono::milliseconds poll_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Entry> entries_;
  std::string failure_;
  bool stop_ = false;
  std::once_flag aborted_;
  std::thread thread_;
};

}  // namespace tessera::dist
