#include "runtime/watchdog.h"

#include <fmt/format.h>

#include <algorithm>

#include "runtime/check.h"

namespace tessera::dist {

Watchdog::Watchdog(std::function<void(const std::string&)> abort, std::chrono::milliseconds poll)
    : abort_(std::move(abort)), poll_(poll), thread_([this] { run(); }) {}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

std::string Watchdog::timeout_message(const std::string& what, std::chrono::milliseconds timeout) {
  return fmt::format(
      "{} did not complete within {:.1f} s: at least one rank never arrived (dead, stuck, or running a "
      "different collective). The communicator was aborted and the group cannot be used any more. "
      "(TESSERA_COLLECTIVE_TIMEOUT sets the limit; TESSERA_DEBUG_COLLECTIVES=1 checks that ranks agree on "
      "every collective)",
      what, std::chrono::duration<double>(timeout).count());
}

void Watchdog::watch(std::string what, std::function<bool()> done, std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!failure_.empty()) throw Error(failure_);
  entries_.push_back({std::move(what), std::move(done), Clock::now() + timeout, timeout});
}

void Watchdog::abort_once(const std::string& message) {
  std::call_once(aborted_, [&] {
    {
      std::lock_guard<std::mutex> lk(mu_);
      failure_ = message;
      entries_.clear();
    }
    abort_(message);
  });
}

void Watchdog::run() {
  std::unique_lock<std::mutex> lk(mu_);
  while (!stop_) {
    cv_.wait_for(lk, poll_, [&] { return stop_; });
    if (stop_ || !failure_.empty()) continue;
    // Drop the completed ones; the oldest late one, if any, aborts the group.
    std::vector<Entry> pending;
    pending.swap(entries_);
    lk.unlock();
    const auto now = Clock::now();
    std::string late;
    std::vector<Entry> still;
    for (auto& e : pending) {
      if (e.done()) continue;
      if (late.empty() && now >= e.deadline) late = timeout_message(e.what, e.timeout);
      still.push_back(std::move(e));
    }
    if (!late.empty()) {
      abort_once(late);
      lk.lock();
      continue;
    }
    lk.lock();
    // New entries arrived while unlocked: keep the order of queuing.
    still.insert(still.end(), std::make_move_iterator(entries_.begin()), std::make_move_iterator(entries_.end()));
    entries_.swap(still);
  }
}

void Watchdog::wait_until(const std::string& what, const std::function<bool()>& done, Clock::time_point deadline,
                          std::chrono::milliseconds timeout) {
  for (int spins = 0;; ++spins) {
    check();
    if (done()) return;
    const auto now = Clock::now();
    if (now >= deadline) {
      abort_once(timeout_message(what, timeout));
      check();
    }
    if (spins < 1000) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(spins < 10000 ? 20 : 200));
  }
}

void Watchdog::check() const {
  std::lock_guard<std::mutex> lk(mu_);
  if (!failure_.empty()) throw Error(failure_);
}

bool Watchdog::aborted() const {
  std::lock_guard<std::mutex> lk(mu_);
  return !failure_.empty();
}

std::string Watchdog::failure() const {
  std::lock_guard<std::mutex> lk(mu_);
  return failure_;
}

size_t Watchdog::in_flight() const {
  std::lock_guard<std::mutex> lk(mu_);
  return entries_.size();
}

}  // namespace tessera::dist
