// tessera-run's decisions (tools/restart.h): hostfiles, hostile ones
// included; how a launch ended, from its exit code and a status.json that may
// be stale, torn or lying; and when the loop restarts or stops.
#include <catch2/catch.hpp>

#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "runtime/check.h"
#include "tools/restart.h"

using namespace tessera;
namespace fs = std::filesystem;

namespace {

std::string write_file(const std::string& name, const std::string& text) {
  const fs::path dir = fs::temp_directory_path() / fmt::format("tessera-restart-test-{}", ::getpid());
  fs::create_directories(dir);
  const fs::path path = dir / name;
  std::ofstream(path, std::ios::binary) << text;
  return path.string();
}

std::string refusal(const std::string& text) {
  try {
    tools::hostfile_slots(write_file("hosts", text));
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("hostfile_slots sums slots= and counts a bare host as one", "[restart]") {
  CHECK(tools::hostfile_slots(write_file("h1", "node1 slots=4\nnode2 slots=3 max_slots=8\n")) == 7);
  CHECK(tools::hostfile_slots(write_file("h2", "# the job's nodes\n\nnode1\nnode2   # two\n  node3 slots=17\n")) == 19);
  CHECK(tools::hostfile_slots(write_file("h3", "localhost slots=3 # a node gone at step 13")) == 3);
}

TEST_CASE("hostfile_slots refuses what offers no ranks or does not parse, naming the line", "[restart]") {
  CHECK_THAT(refusal(""), Catch::Contains("no host in it"));
  CHECK_THAT(refusal("# every node gone\n\n"), Catch::Contains("no host in it"));
  CHECK_THAT(refusal("node1 slots=4\nnode2 slots=0\n"), Catch::Contains("line 2"));
  CHECK_THAT(refusal("node1 slots=-2\n"), Catch::Contains("'-2'"));
  CHECK_THAT(refusal("node1 slots=\n"), Catch::Contains("slots must be a count"));
  CHECK_THAT(refusal("node1 slots=4x\n"), Catch::Contains("'4x'"));
  CHECK_THAT(refusal("node1 slots=99999999999999999999\n"), Catch::Contains("slots must be a count"));
  std::string many;
  for (int i = 0; i < 3; ++i) many += "node slots=999999\n";
  CHECK_THAT(refusal(many), Catch::Contains("more than 1000000"));
  CHECK_THAT(refusal(std::string("node1 slots=2\0garbage\n", 22)), Catch::Contains("slots must be a count"));
  CHECK_THROWS_WITH(tools::hostfile_slots("/nonexistent/hosts"), Catch::Contains("cannot be read"));
}

TEST_CASE("read_outcome: a killed rank, a failing rank, a completion, and statuses not to trust", "[restart]") {
  const std::time_t now = std::time(nullptr);
  auto status = [&](const std::string& body) { return write_file("status.json", body); };

  // Killed outright: the status still says running, at the last step rank 0 finished.
  auto killed = tools::read_outcome(
      status(fmt::format(R"({{"status": "running", "step": 13, "steps": 20, "time": {}}})", now)), 137, now);
  CHECK(killed.step == 13);
  CHECK(killed.status == "running");
  CHECK_THAT(killed.error, Catch::Contains("killed by signal 9"));

  // A rank that failed says why, and at which step.
  auto failed = tools::read_outcome(
      status(fmt::format(R"({{"status": "failed", "exit_code": 1, "step": 7, "error": "all_gather timed out", "time": {}}})",
                         now)),
      1, now);
  CHECK(failed.step == 7);
  CHECK(failed.error == "all_gather timed out");
  CHECK(failed.status_exit == 1);

  auto done = tools::read_outcome(
      status(fmt::format(R"({{"status": "completed", "exit_code": 0, "step": 20, "time": {}}})", now)), 0, now);
  CHECK(done.error.empty());

  // An earlier launch's file (older than this launch), a torn file, a file of
  // the wrong types, a missing one: no status, the exit code speaks.
  for (const std::string& body :
       {fmt::format(R"({{"status": "failed", "step": 3, "error": "old", "time": {}}})", now - 100),
        std::string(R"({"status": "run)"), std::string(R"({"status": 7, "step": "x", "error": [1], "time": 1e99})"),
        std::string("[1, 2]"), std::string("\xff\xfe garbage")}) {
    auto o = tools::read_outcome(status(body), 1, now);
    CHECK(o.step == -1);
    CHECK(o.status.empty());
    CHECK_THAT(o.error, Catch::Contains("before tessera-train wrote its status"));
  }
  auto missing = tools::read_outcome("/nonexistent/status.json", 139, now);
  CHECK_THAT(missing.error, Catch::Contains("signal 11"));
  // A negative step is not a step.
  auto negative = tools::read_outcome(
      status(fmt::format(R"({{"status": "running", "step": -5, "time": {}}})", now)), 137, now);
  CHECK(negative.step == -1);
}

TEST_CASE("decide: restart, and stop on a refusal, an interrupt, the restarts spent or a repeat", "[restart]") {
  tools::LaunchOutcome killed{.exit_code = 137, .status = "running", .step = 13,
                              .error = "a rank was killed by signal 9 (the launcher exited 137)"};
  auto d = tools::decide(killed, std::nullopt, 0, 2);
  CHECK(d.next == tools::Next::restart);
  CHECK_THAT(d.why, Catch::Contains("step 13"));

  // The same failure at the same step again: stop, naming both.
  d = tools::decide(killed, killed, 1, 2);
  CHECK(d.next == tools::Next::stop);
  CHECK_THAT(d.why, Catch::Contains("same failure at step 13 twice"));
  CHECK_THAT(d.why, Catch::Contains("killed by signal 9"));

  // The same error at another step is progress: restart.
  auto later = killed;
  later.step = 17;
  CHECK(tools::decide(later, killed, 1, 2).next == tools::Next::restart);
  // Numbers aside (a pid, a time), the same error is the same failure.
  tools::LaunchOutcome a{.exit_code = 1, .status = "failed", .step = 7, .error = "rank 2 (pid 4411) timed out after 4.0 s"};
  auto b = a;
  b.error = "rank 2 (pid 9123) timed out after 4.0 s";
  CHECK(tools::same_failure(a, b));
  b.error = "rank 2 (pid 9123) ran out of memory";
  CHECK_FALSE(tools::same_failure(a, b));

  // Restarts spent.
  d = tools::decide(later, killed, 2, 2);
  CHECK(d.next == tools::Next::stop);
  CHECK_THAT(d.why, Catch::Contains("2 restarts allowed"));
  CHECK(tools::decide(killed, std::nullopt, 0, 0).next == tools::Next::stop);

  // A refused configuration (exit 2) and an interrupt are never restarted.
  tools::LaunchOutcome refused{.exit_code = 2, .status = "failed", .status_exit = 2, .error = "batch_size"};
  CHECK(tools::decide(refused, std::nullopt, 0, 5).next == tools::Next::stop);
  tools::LaunchOutcome interrupted{.exit_code = 1, .status = "interrupted", .step = 4};
  CHECK_THAT(tools::decide(interrupted, std::nullopt, 0, 5).why, Catch::Contains("interrupted at step 4"));

  tools::LaunchOutcome completed{.exit_code = 0, .status = "completed", .step = 20};
  CHECK(tools::decide(completed, killed, 1, 2).next == tools::Next::done);
}
