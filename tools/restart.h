// tessera-run's decisions (tools/tessera_run.cpp): how many ranks a hostfile
// offers, how a launch of tessera-train ended (its exit code and the run
// folder's status.json), and whether the job starts again from its newest
// complete checkpoint.
//
// The loop is TorchElastic's (torchrun --max-restarts) over an MPI launcher:
// a rank that dies or a collective that times out ends the whole job (mpirun
// kills the other ranks; a timeout aborts them), the launcher starts it again
// with --checkpoint.resume true, on the ranks still there, and a checkpoint
// written at another world size reshards on load. It stops when the restarts
// are spent, and at once when the same failure comes back at the same step,
// which a restart would only repeat.
#pragma once

#include <cstdint>
#include <ctime>
#include <optional>
#include <string>

namespace tessera::tools {

// The ranks an OpenMPI hostfile offers: the sum over its lines of slots=N
// (a host without slots= gives 1; '#' starts a comment). Throws naming the
// file and line of anything else, or a file that offers no slot at all.
int hostfile_slots(const std::string& path);

// How one launch ended.
struct LaunchOutcome {
  int exit_code = 0;   // the launcher's (mpirun gives 128 + the signal of a killed rank)
  std::string status;  // status.json's "status" as this launch left it ("" when it wrote none)
  int status_exit = -1;  // status.json's "exit_code" (-1 when absent)
  int64_t step = -1;   // the steps completed when it ended (-1: unknown)
  std::string error;   // what failed, in words ("" when it completed)
};

// Reads `status_path` (the run's status.json, written by tessera-train's rank
// 0 at the start, after every step and at the end, and by a failing rank) as
// the launch that started at `launched_at` left it: a file from before then
// (or one that does not parse: a hostile or torn file is not trusted) counts
// as no status.
LaunchOutcome read_outcome(const std::string& status_path, int exit_code, std::time_t launched_at);

// Whether two failures are the same one: the same step, and the same error
// once the numbers in it (process ids, times, addresses) are set aside.
bool same_failure(const LaunchOutcome& a, const LaunchOutcome& b);

enum class Next { done, stop, restart };
struct Decision {
  Next next = Next::done;
  std::string why;  // for the log: why the job stops, or what the restart follows
};

// What follows a launch that ended with `now`: done (it completed), stop (a
// configuration refused, an interrupt asked for, the restarts spent, or the
// same failure as the last one), or restart. `previous` is the failure that
// caused the last restart, if any.
Decision decide(const LaunchOutcome& now, const std::optional<LaunchOutcome>& previous,
                int restarts_done, int max_restarts);

}  // namespace tessera::tools
