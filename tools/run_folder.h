// A run's folder (job.dump_folder) as tessera-train keeps it: the records a
// run leaves there (status.json, metrics.jsonl, config.toml, loss.png,
// traces, tokenizer.json), the status a scheduler reads, and what a launch
// may write there. tools/train.cpp calls these before a run starts (every
// check refuses before anything is written) and as it ends.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

#include "tools/config.h"

namespace tessera::tools {

// A path inside job.dump_folder unless absolute.
std::string out_path(const TrainConfig& c, const std::string& p);
// Whether `p` is `dir` or lies inside it (compared as written: resolve links first).
bool path_inside(const std::filesystem::path& p, const std::filesystem::path& dir);

// How the run ended, for a scheduler: mpirun folds every rank's exit code
// into its own (1 when a rank stopped on SIGTERM), so tessera-train writes
// <dump_folder>/status.json: "running" at the start, then "completed",
// "interrupted" (with the signal and whether a checkpoint was saved) or
// "failed" (with the error). A file still saying "running" after the job
// ended means a rank was killed outright (SIGKILL, the OOM killer).
void write_status(const TrainConfig& c, nlohmann::json status);
// The status of a launch whose configuration was refused: the folder's
// status before it kept under "previous" (an earlier refusal's own
// "previous", so that refusals in a row keep the run's status, not each other).
nlohmann::json refused_status(const TrainConfig& c, const std::string& error);

// Rank 0's answer, on every rank (a collective: all ranks call it, and the
// others' answers are ignored, so what rank 0 saw before any rank wrote
// anything decides).
int64_t rank0s(int64_t mine);
// The first k >= 1 for which `folder`/<prefix><k> does not exist.
int64_t first_free(const std::filesystem::path& folder, const std::string& prefix);

// A new run may not write checkpoints where another run's are (the newer
// would shadow or prune the other), nor replace the tokenizer.json they are
// read with; a resume continues on the tokenizer its checkpoint records.
// Refused before anything is written to the folder, which then stays as it was.
// A resumed launch's picture of the run's records (status, config.toml, the
// metrics' length) before it writes any, on rank 0. Should the launch fail
// before it has trained a step (a checkpoint that does not load, settings it
// refuses, a model that does not match), restore() puts them back: the
// status says this launch failed and keeps the one it replaced under
// "previous", and config.toml and the metrics are the finished run's again.
class RecordsBefore {
 public:
  explicit RecordsBefore(const TrainConfig& c);
  void restore(const std::string& error) const;

 private:
  TrainConfig c_;
  std::string metrics_;               // the metrics file's path ("" without one)
  bool had_config_ = false, had_metrics_ = false;
  std::string config_text_;
  uintmax_t metrics_bytes_ = 0;
  nlohmann::json status_;             // null where there was none (or it did not read)
};

void refuse_other_runs_checkpoints(const TrainConfig& c);
// The files a run writes may not be one another, the records every run
// keeps beside them (config.toml, status.json, tokenizer.json) or lie in its
// checkpoint folder; one that exists must be a regular file (opening a pipe
// would block the run before its first step). Refused before anything is
// written.
void check_output_paths(const TrainConfig& c);
// A new run (not a resume) into a folder that holds an earlier run's records
// moves them into <folder>/earlier/<k>/ first, so that nothing of it is lost.
// Rank 0 decides and moves; every rank calls it (a collective).
// Claims the run's folder for this launch (an flock on its
// .tessera-train.lock, held until the process ends; rank 0's, agreed by every
// rank), creating the folder: a second launch into it is refused while the
// first runs, instead of both writing one folder's checkpoints and records.
void lock_run_folder(const TrainConfig& c);
void keep_earlier_records(const TrainConfig& c);

}  // namespace tessera::tools
