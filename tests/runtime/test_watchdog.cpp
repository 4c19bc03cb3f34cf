// The collective watchdog (runtime/watchdog.h) that gives NCCL groups the
// MPI groups' promise, tested here with fake collectives: a flag another
// thread sets, one that never completes, and a "kernel" stuck on an
// asynchronous stream until the abort releases it (as ncclCommAbort makes
// NCCL's kernels return).
#include <atomic>
#include <thread>

#include "../helpers.h"
#include "runtime/stream.h"
#include "runtime/watchdog.h"

using namespace tessera;
using namespace std::chrono_literals;
using dist::Watchdog;

namespace {

struct Aborts {
  std::atomic<int> count{0};
  std::string message;
  std::mutex mu;
  std::function<void(const std::string&)> fn() {
    return [this](const std::string& m) {
      std::lock_guard<std::mutex> lk(mu);
      message = m;
      ++count;
    };
  }
};

}  // namespace

TEST_CASE("watchdog: collectives that complete are forgotten, never aborted", "[watchdog]") {
  Aborts aborts;
  Watchdog dog(aborts.fn(), 5ms);
  std::atomic<bool> done{false};
  dog.watch("all_reduce #1 on group 'dp'", [&] { return done.load(); }, 10s);
  dog.watch("all_gather #2 on group 'dp'", [] { return true; }, 10s);
  CHECK(dog.in_flight() >= 1);
  std::thread finisher([&] {
    std::this_thread::sleep_for(30ms);
    done = true;
  });
  auto start = Watchdog::Clock::now();
  dog.wait_until("all_reduce #1 on group 'dp'", [&] { return done.load(); }, start + 10s, 10s);
  finisher.join();
  CHECK(Watchdog::Clock::now() - start >= 25ms);
  for (int i = 0; i < 200 && dog.in_flight() > 0; ++i) std::this_thread::sleep_for(5ms);
  CHECK(dog.in_flight() == 0);
  CHECK_FALSE(dog.aborted());
  CHECK(aborts.count == 0);
  CHECK_NOTHROW(dog.check());
}

TEST_CASE("watchdog: a collective that never completes aborts the group once, naming it", "[watchdog]") {
  Aborts aborts;
  Watchdog dog(aborts.fn(), 5ms);
  const std::string what = "reduce_scatter_tensor #17 on group 'dp_shard' [ranks 0, 1, 2]";
  dog.watch(what, [] { return false; }, 60ms);
  dog.watch("all_gather #18 on group 'dp_shard' [ranks 0, 1, 2]", [] { return false; }, 10s);
  for (int i = 0; i < 400 && !dog.aborted(); ++i) std::this_thread::sleep_for(5ms);
  REQUIRE(dog.aborted());
  CHECK(aborts.count == 1);
  CHECK(aborts.message == dog.failure());
  CHECK_THAT(aborts.message, Catch::Contains(what) && Catch::Contains("did not complete within 0.1 s") &&
                                 Catch::Contains("TESSERA_COLLECTIVE_TIMEOUT"));
  CHECK(dog.in_flight() == 0);
  // Every later wait and collective fails with the same message, at once.
  auto start = Watchdog::Clock::now();
  CHECK_THROWS_WITH(dog.wait_until("all_gather #18", [] { return false; }, start + 10s, 10s),
                    Catch::Contains(what));
  CHECK(Watchdog::Clock::now() - start < 1s);
  CHECK_THROWS_WITH(dog.watch("all_reduce #19", [] { return true; }, 10s), Catch::Contains(what));
  CHECK_THROWS_WITH(dog.check(), Catch::Contains(what));
  std::this_thread::sleep_for(30ms);
  CHECK(aborts.count == 1);
}

TEST_CASE("watchdog: a host wait past its deadline aborts and throws, even if the thread is slow", "[watchdog]") {
  Aborts aborts;
  Watchdog dog(aborts.fn(), 10s);  // the thread would look much later: the wait itself must end it
  const std::string what = "broadcast #3 on group 'world' [ranks 0, 1]";
  dog.watch(what, [] { return false; }, 50ms);
  auto start = Watchdog::Clock::now();
  CHECK_THROWS_WITH(dog.wait_until(what, [] { return false; }, start + 50ms, 50ms),
                    Catch::Contains(what) && Catch::Contains("within 0.1 s") && Catch::Contains("aborted"));
  auto took = Watchdog::Clock::now() - start;
  CHECK(took >= 50ms);
  CHECK(took < 5s);
  CHECK(aborts.count == 1);
}

TEST_CASE("watchdog: the abort releases work stuck on a stream, whose host sync then returns", "[watchdog][async]") {
  // A "collective" queued on an asynchronous stream that spins until the
  // communicator is aborted, as NCCL's kernels do when a peer never comes.
  std::atomic<bool> aborted_flag{false};
  Aborts aborts;
  auto abort = [&](const std::string& m) {
    aborts.fn()(m);
    aborted_flag = true;
  };
  Watchdog dog(abort, 5ms);
  StreamPtr comm = new_stream(Device::async_cpu());
  comm->enqueue("all_to_all", [&] {
    while (!aborted_flag) std::this_thread::sleep_for(1ms);
  });
  auto event = comm->record_event();
  dog.watch("all_to_all #4 on group 'ep' [ranks 0, 1, 2, 3]", [event] { return event->query(); }, 80ms);
  // A host sync that no timeout interrupts (the analogue of cudaStreamSynchronize): it returns
  // because the watchdog aborted, not because the collective completed.
  auto start = Watchdog::Clock::now();
  comm->synchronize();
  CHECK(Watchdog::Clock::now() - start < 10s);
  CHECK(aborts.count == 1);
  CHECK_THAT(dog.failure(), Catch::Contains("all_to_all #4 on group 'ep'"));
}

TEST_CASE("watchdog: destroyed with work in flight, it stops without aborting", "[watchdog]") {
  Aborts aborts;
  auto start = Watchdog::Clock::now();
  {
    Watchdog dog(aborts.fn(), 50ms);
    dog.watch("all_reduce #1", [] { return false; }, 10s);
  }
  CHECK(Watchdog::Clock::now() - start < 2s);
  CHECK(aborts.count == 0);
}
