// A run's folder: its records, its status and what a launch may write
// there (tools/run_folder.h).
#include "tools/run_folder.h"

#include <fmt/format.h>

#include <cstdio>
#include <ctime>
#include <fstream>
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
    if (recorded.is_object() && recorded.contains("fingerprint") && recorded["fingerprint"].is_string()) {
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

void check_output_paths(const TrainConfig& c) {
  const fs::path folder = c.job.dump_folder;
  auto resolved = [](const fs::path& p) {
    std::error_code ec;
    fs::path r = fs::weakly_canonical(p, ec);
    return ec ? fs::absolute(p).lexically_normal() : r;
  };
  std::vector<std::pair<std::string, fs::path>> files = {{"the run's config.toml", folder / "config.toml"},
                                                         {"the run's status.json", folder / "status.json"},
                                                         {"the run's tokenizer.json", folder / "tokenizer.json"}};
  const size_t records = files.size();
  for (auto [key, path] : {std::pair{"metrics.jsonl", c.metrics.jsonl}, std::pair{"metrics.plot", c.metrics.plot},
                           std::pair{"checkpoint.export_safetensors", c.checkpoint.export_safetensors}})
    if (!path.empty()) files.emplace_back(key, out_path(c, path));
  const fs::path checkpoints = resolved(out_path(c, c.checkpoint.folder));
  // (A checkpoint folder that holds the run's own folder holds its records too, by choice.)
  const bool apart = !path_inside(resolved(folder), checkpoints);
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
  }
}

json refused_status(const TrainConfig& c, const std::string& error) {
  json status = {{"status", "failed"}, {"exit_code", 2}, {"error", error}};
  const fs::path path = fs::path(c.job.dump_folder) / "status.json";
  std::error_code ec;
  if (!fs::is_regular_file(path, ec) || fs::file_size(path, ec) > (1 << 20)) return status;
  std::ifstream in(path);
  json before = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!before.is_object()) return status;
  const bool refusal = before.value("exit_code", json()) == json(2) && before.value("status", "") == "failed";
  if (!refusal) status["previous"] = before;
  else if (before.contains("previous")) status["previous"] = before["previous"];
  return status;
}

}  // namespace tessera::tools
