// Where threads run (runtime/parallel.h): pinning a process keeps the threads
// it already has and those it starts later to the CPUs given, and a CPU it may
// not use is refused by name. Each case puts the mask back.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "runtime/check.h"
#include "runtime/parallel.h"

using namespace tessera;

namespace {

// Puts the process's mask back at the end of a case.
struct MaskGuard {
  std::vector<int> saved = allowed_cpus();
  ~MaskGuard() { pin_process_to(saved); }
};

}  // namespace

TEST_CASE("pinning a process keeps its running threads and its later threads to the CPUs given", "[threads]") {
  const std::vector<int> all = allowed_cpus();
#ifndef __linux__
  CHECK(all.empty());
  return;
#endif
  REQUIRE(!all.empty());
  REQUIRE(std::is_sorted(all.begin(), all.end()));
  MaskGuard guard;
  const std::vector<int> last{all.back()};

  // A thread that is already running when the process is pinned.
  std::mutex mu;
  std::condition_variable cv;
  bool pinned = false, looked = false;
  std::vector<int> seen_by_running;
  std::thread running([&] {
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [&] { return pinned; });
    seen_by_running = allowed_cpus();
    looked = true;
    cv.notify_all();
  });
  pin_process_to(last);
  {
    std::lock_guard<std::mutex> lk(mu);
    pinned = true;
  }
  cv.notify_all();
  running.join();
  CHECK(looked);
  CHECK(seen_by_running == last);
  CHECK(allowed_cpus() == last);

  // A thread started afterwards inherits the mask.
  std::vector<int> seen_by_later;
  std::thread([&] { seen_by_later = allowed_cpus(); }).join();
  CHECK(seen_by_later == last);

  // Back to every CPU: allowed again, since the launcher allowed them.
  pin_process_to(all);
  CHECK(allowed_cpus() == all);
}

TEST_CASE("pinning one thread leaves the others where they were", "[threads]") {
  const std::vector<int> all = allowed_cpus();
  if (all.size() < 2) return;  // one CPU: nothing to tell apart
  MaskGuard guard;
  std::vector<int> inside, after_in_child;
  std::thread([&] {
    pin_thread_to({all.front()});
    inside = allowed_cpus();
    std::thread([&] { after_in_child = allowed_cpus(); }).join();
  }).join();
  CHECK(inside == std::vector<int>{all.front()});
  CHECK(after_in_child == std::vector<int>{all.front()});
  CHECK(allowed_cpus() == all);
}

TEST_CASE("pinning refuses a CPU the process may not use, and an empty set", "[threads]") {
#ifdef __linux__
  const std::vector<int> all = allowed_cpus();
  REQUIRE(!all.empty());
  MaskGuard guard;
  const int outside = all.back() + 1;
  try {
    pin_process_to({all.front(), outside});
    FAIL("a CPU outside the mask was accepted");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("CPU " + std::to_string(outside) + " is not one this process may run on") !=
          std::string::npos);
  }
  CHECK(allowed_cpus() == all);  // nothing changed
  CHECK_THROWS_AS(pin_thread_to({-1}), Error);
  try {
    pin_thread_to({});
    FAIL("an empty set was accepted");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("expected at least one CPU") != std::string::npos);
  }
  CHECK(allowed_cpus() == all);
#endif
}
