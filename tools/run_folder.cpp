// A run's folder: its records, its status and what a launch may write
// there (tools/run_folder.h).
#include "tools/run_folder.h"

#include <fmt/format.h>

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <iterator>
#include <utility>
#include <vector>

#include "fsdp/checkpoint.h"
#include "io/data.h"
#include "runtime/check.h"
#include "runtime/distributed.h"
#include "runtime/tensor.h"

namespace tessera::tools {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {
// A run's records in its folder: what a later command must not overwrite.
const std::vector<std::string>& record_files() {
  static const std::vector<std::string> files = {"status.json", "metrics.jsonl", "config.toml", "loss.png",
                                                 "traces"};
  return files;
}
}  // namespace

std::string out_path(const TrainConfig& c, const std::string& p) {
  return fs::path(p).is_absolute() ? p : (fs::path(c.job.dump_folder) / p).string();
}

bool path_inside(const fs::path& p, const fs::path& dir) {
  const fs::path rel = p.lexically_relative(dir);
  return !rel.empty() && *rel.begin() != "..";
}

void write_status(const TrainConfig& c, json status) {
  status["time"] = static_cast<int64_t>(std::time(nullptr));
  status["ranks"] = dist::world_size();
  fs::path path = fs::path(c.job.dump_folder) / "status.json";
  fs::path tmp = path.string() + fmt::format(".tmp{}", dist::rank());
  std::error_code ec;
  fs::create_directories(c.job.dump_folder, ec);
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << status.dump(1) << "\n";
    if (!out.good()) return;  // a status is best effort: never the reason a run fails
  }
  fs::rename(tmp, path, ec);
}

int64_t rank0s(int64_t mine) {
  if (dist::world_size() == 1) return mine;
  Tensor t = full({1}, dist::rank() == 0 ? static_cast<double>(mine) : 0.0, DType::F64);
  dist::world()->all_reduce(t, {dist::ReduceOp::Sum})->wait();
  return static_cast<int64_t>(t.item());
}

int64_t first_free(const fs::path& folder, const std::string& prefix) {
  int64_t k = 1;
  while (fs::exists(folder / fmt::format("{}{}", prefix, k))) ++k;
  return k;
}

void refuse_other_runs_checkpoints(const TrainConfig& c) {
  const std::string folder = out_path(c, c.checkpoint.folder), existing = fsdp::latest_checkpoint(folder);
  TS_CHECK(!c.checkpoint.enable || c.checkpoint.resume || existing.empty(),
           "{} already holds a checkpoint of another run ({}): pass --checkpoint.resume true to continue it, "
           "or choose another --checkpoint.folder or --job.dump_folder",
           folder, fs::path(existing).filename().string());
  // A resume continues on the tokens the run was trained on: the tokenizer
  // its checkpoint records (before the copy beside it is replaced).
  if (c.checkpoint.resume && !existing.empty()) {
    const json extra = json::parse(fsdp::read_metadata(existing).extra_json, nullptr, false);
    const json recorded = extra.is_object() ? extra.value("tokenizer", json()) : json();
    // A record that is there but does not read would skip the check: refused, as tessera-generate refuses it.
    TS_CHECK(recorded.is_null() ||
                 (recorded.is_object() && recorded.contains("fingerprint") && recorded["fingerprint"].is_string() &&
                  recorded.contains("vocab_size") && recorded["vocab_size"].is_number_unsigned()),
             "{}: the checkpoint's tokenizer record {} is malformed (expected an object with vocab_size, a count, "
             "and fingerprint, a string), so this run's tokenizer cannot be checked against it",
             existing, recorded.dump().substr(0, 200));
    if (recorded.is_object()) {
      const std::string theirs = recorded["fingerprint"].get<std::string>();
      const std::string mine = c.training.tokenizer.empty() ? "" : io::file_fingerprint(c.training.tokenizer);
      TS_CHECK(mine == theirs,
               "{} was trained with a tokenizer ({} tokens, fingerprint {}), but this run's training.tokenizer {}: "
               "resume with the same tokenizer (the copy in {} is it)",
               existing, recorded.value("vocab_size", json()).dump(), theirs,
               mine.empty() ? "is empty (byte tokens)" : fmt::format("{} is another (fingerprint {})",
                                                                      c.training.tokenizer, mine),
               (fs::path(c.job.dump_folder) / "tokenizer.json").string());
    }
  }
  // A new run may not replace the tokenizer.json beside another run's
  // checkpoints, which tessera-generate reads them with.
  const fs::path tokenizer = fs::path(c.job.dump_folder) / "tokenizer.json";
  if (c.checkpoint.resume || c.training.tokenizer.empty() || !fs::exists(tokenizer)) return;
  TS_CHECK(existing.empty() || io::file_fingerprint(tokenizer.string()) == io::file_fingerprint(c.training.tokenizer),
           "{} holds a checkpoint of another run ({}), which was trained with the tokenizer in {}; this run's "
           "training.tokenizer {} is another: choose another --job.dump_folder",
           folder, fs::path(existing).filename().string(), tokenizer.string(), c.training.tokenizer);
}

void lock_run_folder(const TrainConfig& c) {
  int64_t holder = 0;  // the pid of a launch that holds the folder (rank 0's view), or -1 where it is unknown
  if (dist::rank() == 0) {
    std::error_code ec;
    fs::create_directories(c.job.dump_folder, ec);
    const std::string path = (fs::path(c.job.dump_folder) / ".tessera-train.lock").string();
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    TS_CHECK(fd >= 0, "cannot open {} to claim the run's folder: {}", path, std::strerror(errno));
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      char text[32] = {};
      const ssize_t n = ::pread(fd, text, sizeof(text) - 1, 0);
      holder = n > 0 ? std::strtoll(text, nullptr, 10) : -1;
      if (holder == 0) holder = -1;
      ::close(fd);
    } else {  // held until this process ends (the descriptor stays open)
      const std::string pid = std::to_string(::getpid()) + "\n";
      if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, pid.data(), pid.size(), 0) < 0) {
        // the pid is for the message only
      }
    }
  }
  holder = rank0s(holder);
  TS_CHECK(holder == 0, "{} is in use by another tessera-train launch{}: two runs in one folder overwrite each "
           "other's checkpoints and records; wait for it to end, or choose another --job.dump_folder",
           c.job.dump_folder, holder > 0 ? fmt::format(" (pid {})", holder) : "");
}

void keep_earlier_records(const TrainConfig& c) {
  const fs::path folder = c.job.dump_folder;
  const int64_t k =
      rank0s(c.checkpoint.resume || !fs::exists(folder / "status.json") ? 0 : first_free(folder / "earlier", ""));
  if (k == 0 || dist::rank() != 0) return;
  const fs::path to = folder / "earlier" / std::to_string(k);
  fs::create_directories(to);
  for (const auto& f : record_files())
    if (fs::exists(folder / f)) fs::rename(folder / f, to / f);
  // Copied, not moved: the folder's checkpoints are read with it until another replaces it.
  if (fs::is_regular_file(folder / "tokenizer.json")) fs::copy_file(folder / "tokenizer.json", to / "tokenizer.json");
  std::printf("the earlier run's records in %s (status, metrics, config, plot, traces, tokenizer) moved to %s\n",
              folder.c_str(), to.c_str());
}

namespace {

// A path with its links and dots resolved as far as it exists.
fs::path resolved(const fs::path& p) {
  std::error_code ec;
  fs::path r = fs::weakly_canonical(p, ec);
  return ec ? fs::absolute(p).lexically_normal() : r;
}

// An output file (`key`, at `path`, resolved `pi`; `folder`: the run's,
// resolved) may not be what the run reads (its text, tokenizer or token
// shards, by name or as the same file through a link), a file of the data
// cache, a file inside a checkpoint (a folder holding a metadata.json: this
// run's, another's, any step's), or another run's records (a folder holding
// a status.json that is not this run's): writing it would destroy data a run
// needs, silently.
void check_not_an_input(const TrainConfig& c, const std::string& key, const fs::path& path, const fs::path& pi,
                        const fs::path& folder) {
  std::error_code ec;
  const bool exists = fs::exists(path, ec);
  for (auto [name, input] : {std::pair{"training.text", c.training.text},
                             std::pair{"training.tokenizer", c.training.tokenizer},
                             std::pair{"training.train_shard", c.training.train_shard},
                             std::pair{"training.val_shard", c.training.val_shard}}) {
    if (input.empty()) continue;
    const bool same = resolved(input) == pi || (exists && fs::exists(input, ec) && fs::equivalent(input, path, ec));
    TS_CHECK(!same, "{} '{}' is {} '{}', which the run reads: name another file", key, path.string(), name, input);
  }
  if (!c.training.data_dir.empty()) {
    const fs::path cache = resolved(c.training.data_dir);
    TS_CHECK(!path_inside(pi, cache) || path_inside(folder, cache),
             "{} '{}' lies in training.data_dir {} (the token shards runs read): name a file outside it", key,
             path.string(), c.training.data_dir);
  }
  for (fs::path dir = pi.parent_path(); !dir.empty(); dir = dir.parent_path()) {
    TS_CHECK(!fs::is_regular_file(dir / "metadata.json", ec),
             "{} '{}' lies in the checkpoint {} (it holds a metadata.json): name a file outside every checkpoint",
             key, path.string(), dir.string());
    if (dir == dir.root_path()) break;
  }
  const fs::path parent = pi.parent_path();
  TS_CHECK(!fs::is_regular_file(parent / "status.json", ec) || folder == parent,
           "{} '{}' lies in {}, another run's folder (it holds that run's status.json): name a file in this "
           "run's folder {} or outside any run's", key, path.string(), parent.string(), c.job.dump_folder);
}

}  // namespace

void check_output_paths(const TrainConfig& c) {
  const fs::path folder = c.job.dump_folder;
  std::vector<std::pair<std::string, fs::path>> files = {{"the run's config.toml", folder / "config.toml"},
                                                         {"the run's status.json", folder / "status.json"},
                                                         {"the run's tokenizer.json", folder / "tokenizer.json"}};
  const size_t records = files.size();
  for (auto [key, path] : {std::pair{"metrics.jsonl", c.metrics.jsonl}, std::pair{"metrics.plot", c.metrics.plot},
                           std::pair{"checkpoint.export_safetensors", c.checkpoint.export_safetensors}})
    if (!path.empty()) files.emplace_back(key, out_path(c, path));
  const fs::path checkpoints = resolved(out_path(c, c.checkpoint.folder));
  // (A checkpoint folder that holds the run's own folder holds its records too, by choice.)
  const fs::path run_folder = resolved(folder);
  const bool apart = !path_inside(run_folder, checkpoints);
  for (size_t i = 0; i < files.size(); ++i) {
    const fs::path pi = resolved(files[i].second);
    for (size_t j = 0; j < i; ++j)
      TS_CHECK(pi != resolved(files[j].second), "{} '{}' is {} ('{}'): the run would overwrite one with the other; "
               "name another file", files[i].first, files[i].second.string(), files[j].first,
               files[j].second.string());
    if (i < records) continue;
    TS_CHECK(!apart || !path_inside(pi, checkpoints), "{} '{}' lies in the checkpoint folder {}: name a file outside it",
             files[i].first, files[i].second.string(), checkpoints.string());
    std::error_code ec;
    const fs::file_status st = fs::status(files[i].second, ec);
    TS_CHECK(!fs::exists(st) || fs::is_regular_file(st),
             "{} '{}' exists and is not a regular file (a directory, a pipe or a device): name a file", files[i].first,
             files[i].second.string());
    check_not_an_input(c, files[i].first, files[i].second, pi, run_folder);
  }
}

namespace {

// The run's status.json as it reads now (null where it is absent, too large or not an object).
json status_now(const TrainConfig& c) {
  const fs::path path = fs::path(c.job.dump_folder) / "status.json";
  std::error_code ec;
  if (!fs::is_regular_file(path, ec) || fs::file_size(path, ec) > (1 << 20)) return json();
  std::ifstream in(path);
  json before = json::parse(in, nullptr, /*allow_exceptions=*/false);
  return before.is_object() ? before : json();
}

// A failed launch's status over `before`: the status it replaces kept under
// "previous" (a refusal's own "previous" where `before` was a refusal: a
// launch refused with exit 2, or one that failed before it trained and kept
// the run's status so).
json failed_over(json status, const json& before) {
  if (!before.is_object()) return status;
  const bool refusal = before.value("status", "") == "failed" &&
                       (before.value("exit_code", json()) == json(2) || before.contains("previous"));
  if (!refusal) status["previous"] = before;
  else if (before.contains("previous")) status["previous"] = before["previous"];
  return status;
}

}  // namespace

json refused_status(const TrainConfig& c, const std::string& error) {
  return failed_over({{"status", "failed"}, {"exit_code", 2}, {"error", error}}, status_now(c));
}

RecordsBefore::RecordsBefore(const TrainConfig& c) : c_(c) {
  if (dist::rank() != 0) return;
  status_ = status_now(c);
  std::error_code ec;
  const fs::path config = fs::path(c.job.dump_folder) / "config.toml";
  if (fs::is_regular_file(config, ec) && fs::file_size(config, ec) <= (1 << 20)) {
    std::ifstream in(config, std::ios::binary);
    config_text_.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    had_config_ = true;
  }
  if (!c.metrics.jsonl.empty()) {
    metrics_ = out_path(c, c.metrics.jsonl);
    had_metrics_ = fs::is_regular_file(metrics_, ec);
    if (had_metrics_) metrics_bytes_ = fs::file_size(metrics_, ec);
  }
}

void RecordsBefore::restore(const std::string& error) const {
  if (dist::rank() != 0) return;
  std::error_code ec;
  const fs::path config = fs::path(c_.job.dump_folder) / "config.toml";
  if (had_config_) std::ofstream(config, std::ios::binary | std::ios::trunc) << config_text_;
  else fs::remove(config, ec);
  if (!metrics_.empty()) {
    if (had_metrics_) fs::resize_file(metrics_, metrics_bytes_, ec);
    else fs::remove(metrics_, ec);
  }
  write_status(c_, failed_over({{"status", "failed"}, {"exit_code", 1}, {"error", error}}, status_));
}

}  // namespace tessera::tools
