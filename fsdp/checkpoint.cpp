#include "fsdp/checkpoint.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <tuple>

#include "dtensor/dtensor.h"
#include "fsdp/checkpoint_format.h"
#include "fsdp/state_dict.h"
#include "runtime/random.h"

namespace tessera::fsdp {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

std::string step_dir_name(int64_t step) {
  return fmt::format("step-{:08d}", step);
}

void fsync_path(const fs::path& p) {
  int fd = ::open(p.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

// Writes text to path and fsyncs it.
void write_synced(const fs::path& path, const std::string& text) {
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    TS_CHECK(out.good(), "checkpoint: cannot write '{}'", path.string());
    out << text;
    out.flush();
    TS_CHECK(out.good(), "checkpoint: writing '{}' failed (disk full?)", path.string());
  }
  fsync_path(path);
}

void write_file_atomically(const fs::path& path, const std::string& text) {
  fs::path tmp = path.string() + ".tmp";
  write_synced(tmp, text);
  fs::rename(tmp, path);
}

// Every tensor a checkpoint holds: the model's state dict and the optimizer's (prefixed).
nn::StateDict tensors_of(nn::Module& model, optim::AdamW* opt, bool create_optimizer_state) {
  nn::StateDict all = model.state_dict();
  if (opt) {
    if (create_optimizer_state) opt->init_state();
    auto named = model.named_parameters();
    for (auto& [k, v] : opt->state_dict(named)) all.emplace_back("optim." + k, v);
  }
  return all;
}

std::string placements_of(const Tensor& t) {
  return is_dtensor(t) ? placements_str(dtensor_spec(t).placements) : "plain";
}

json shape_json(const Shape& s) {
  return json(std::vector<int64_t>(s.begin(), s.end()));
}

void prune(const fs::path& folder, int keep) {
  std::vector<std::pair<int64_t, fs::path>> complete;
  for (const auto& e : fs::directory_iterator(folder)) {
    std::string n = e.path().filename().string();
    if (!e.is_directory() || n.rfind("step-", 0) != 0 || n.size() < 6) continue;
    if (n.find(".tmp") != std::string::npos) continue;
    if (!fs::exists(e.path() / "metadata.json")) continue;
    try {
      complete.emplace_back(std::stoll(n.substr(5)), e.path());
    } catch (const std::exception&) {
    }
  }
  std::sort(complete.begin(), complete.end());
  while (keep > 0 && static_cast<int>(complete.size()) > keep) {
    fs::remove_all(complete.front().second);
    complete.erase(complete.begin());
  }
}

}  // namespace

namespace {

// What one rank holds of one tensor: its global description and this rank's boxes.
struct HeldTensor {
  std::string name, placements;
  DType dtype = DType::F32;
  Shape shape;
  std::vector<std::pair<Shape, Shape>> boxes;  // (offset, shape) in the global tensor
  bool operator==(const HeldTensor&) const = default;
};

std::vector<HeldTensor> held_of(const nn::StateDict& tensors) {
  std::vector<HeldTensor> out;
  out.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    if (is_dtensor(t))
      for (const Placement& p : dtensor_spec(t).placements)
        TS_CHECK(!is_partial(p), "save_checkpoint: '{}' is a Partial DTensor; reduce it first", name);
    HeldTensor h{name, placements_of(t), t.dtype(), t.shape(), {}};
    for (const LocalBox& box : local_boxes(t)) h.boxes.emplace_back(box.offset, box.shape);
    out.push_back(std::move(h));
  }
  return out;
}

json describe(const std::vector<HeldTensor>& held) {
  json out = json::array();
  for (const HeldTensor& h : held) {
    json boxes = json::array();
    for (const auto& [offset, shape] : h.boxes) boxes.push_back({shape_json(offset), shape_json(shape)});
    out.push_back({{"name", h.name},
                   {"dtype", dtype_name(h.dtype)},
                   {"shape", shape_json(h.shape)},
                   {"placements", h.placements},
                   {"boxes", boxes}});
  }
  return out;
}

json describe(const nn::StateDict& tensors) { return describe(held_of(tensors)); }

// Which rank writes each piece of each tensor: the lowest that holds it. So a
// replicated piece (HSDP's replicas, FSDP's shards on every tensor-parallel
// rank, a plain tensor) is written once, and the pieces a pipeline spreads
// over its stages are each written by the rank that holds them. Returns every
// tensor once, in the order the ranks hold them (model tensors before
// optimizer state), and this rank's pieces to write as (name, offset).
std::pair<std::vector<HeldTensor>, std::set<std::pair<std::string, Shape>>> assign_owners(
    const std::vector<json>& per_rank, int rank) {
  std::vector<HeldTensor> all;
  std::map<std::string, size_t> index;
  std::set<std::pair<std::string, Shape>> taken, mine;
  for (size_t r = 0; r < per_rank.size(); ++r)
    for (const json& d : per_rank[r]["tensors"]) {
      const std::string name = d["name"].get<std::string>();
      HeldTensor held{name, d["placements"].get<std::string>(), dtype_from_name(d["dtype"].get<std::string>()),
                      d["shape"].get<Shape>(), {}};
      auto [it, fresh] = index.try_emplace(name, all.size());
      if (fresh) {
        all.push_back(held);
      } else {
        const HeldTensor& first = all[it->second];
        TS_CHECK(first.shape == held.shape && first.dtype == held.dtype,
                 "save_checkpoint: '{}' is {} {} on one rank but {} {} on rank {}", name,
                 shape_str(first.shape), dtype_name(first.dtype), shape_str(held.shape), dtype_name(held.dtype), r);
      }
      for (const json& b : d["boxes"]) {
        std::pair<std::string, Shape> key{name, b[0].get<Shape>()};
        if (taken.insert(key).second && static_cast<int>(r) == rank) mine.insert(key);
      }
    }
  std::stable_partition(all.begin(), all.end(), [](const HeldTensor& t) { return t.name.rfind("optim.", 0) != 0; });
  return {all, mine};
}

}  // namespace

// One piece of one tensor this rank writes: its box's offset in the global
// tensor and its bytes, contiguous on the host.
struct SavePiece {
  std::string name;
  Shape offset;
  Tensor data;
};

namespace {

// This rank's pieces (`mine`: tensor name and box offset), in the order the
// tensors and their boxes come. With `staging` (an asynchronous save) each is
// copied into a host buffer of its own, reused by the next save of the same
// layout, so that training may change the tensors while a thread writes them.
std::vector<SavePiece> pieces_of(const nn::StateDict& tensors, const std::set<std::pair<std::string, Shape>>& mine,
                                 std::map<std::pair<std::string, Shape>, Tensor>* staging) {
  std::vector<SavePiece> pieces;
  std::vector<Device> devices;
  for (const auto& [name, t] : tensors) {
    for (const LocalBox& box : local_boxes(t)) {  // one, or one per block of a blocked shard
      if (mine.count({name, box.offset}) == 0) continue;
      Tensor c;
      if (staging) {
        Tensor& buf = (*staging)[{name, box.offset}];
        if (!buf.defined() || buf.shape() != box.local.shape() || buf.dtype() != box.local.dtype())
          buf = empty(box.local.shape(), box.local.dtype(), Device::cpu());
        Tensor dst = buf;
        ops::copy_(dst, box.local);  // queued where the tensor lives; synchronized below
        if (std::find(devices.begin(), devices.end(), box.local.device()) == devices.end())
          devices.push_back(box.local.device());
        c = buf;
      } else {
        c = ops::contiguous(box.local.to(Device::cpu()));  // the bytes, on the host
      }
      pieces.push_back({name, box.offset, c});
    }
  }
  for (Device d : devices)
    if (!d.is_host_visible()) synchronize(d);
  return pieces;
}

// Writes the pieces into tmp_dir/file_name (fsynced) and returns their descriptions.
json write_pieces(const fs::path& tmp_dir, const std::string& file_name, int rank,
                  const std::vector<SavePiece>& pieces) {
  json chunks = json::array();
  DataFile file((tmp_dir / file_name).string(), rank);
  for (const SavePiece& piece : pieces) {
    const Tensor& c = piece.data;
    uint64_t bytes = c.nbytes();
    uint64_t at = file.size();
    if (bytes) file.write(c.host_data_ptr(), bytes);
    chunks.push_back({{"tensor", piece.name},
                      {"file", file_name},
                      {"offset", at},
                      {"bytes", bytes},
                      {"offsets", shape_json(piece.offset)},
                      {"shape", shape_json(c.shape())},
                      {"crc32c", bytes ? crc32c(c.host_data_ptr(), bytes) : 0u}});
  }
  file.finish();
  return chunks;
}

// Rank 0: merges every rank's chunk lists into metadata.json, then commits
// the checkpoint with one atomic rename, updates `latest` and prunes.
void commit(const fs::path& folder, const fs::path& tmp_dir, const fs::path& final_dir,
            int64_t step, int world_size, const std::vector<HeldTensor>& tensors,
            const std::vector<json>& per_rank, const std::string& extra_json, int keep) {
  std::map<std::string, json> chunks_of;
  for (const auto& r : per_rank)
    for (const auto& c : r["chunks"]) {
      json chunk = c;
      chunk.erase("tensor");
      auto [it, fresh] = chunks_of.try_emplace(c["tensor"].get<std::string>(), json::array());
      it->second.push_back(std::move(chunk));
    }
  json tensors_json = json::array();
  for (const HeldTensor& t : tensors) {
    const std::string& name = t.name;
    json chunks = chunks_of.count(name) ? chunks_of[name] : json::array();
    int64_t covered = 0;
    for (const auto& c : chunks) {
      int64_t n = 1;
      for (const auto& d : c["shape"]) n *= d.get<int64_t>();
      covered += n;
    }
    TS_CHECK(covered == shape_numel(t.shape), "save_checkpoint: the chunks of '{}' cover {} of {} elements",
             name, covered, shape_numel(t.shape));
    tensors_json.push_back({{"name", name},
                            {"dtype", dtype_name(t.dtype)},
                            {"shape", shape_json(t.shape)},
                            {"placements", t.placements},
                            {"chunks", std::move(chunks)}});
  }
  json rank_state = json::array();
  for (const auto& r : per_rank) rank_state.push_back(r["rng"]);
  json md = {
      {"magic", kMetadataMagic},  {"version", kFormatVersion}, {"step", step},
      {"world_size", world_size}, {"tensors", tensors_json},   {"extra", json::parse(extra_json)},
      {"rank_state", rank_state}};
  write_file_atomically(tmp_dir / "metadata.json", md.dump(1));
  // Everything that needs disk space is written before the commit point, the
  // pointer to the new checkpoint included; after it come renames and removals
  // only. So a full disk fails the save before it commits (and the report is
  // true: the previous checkpoint is the latest), never after.
  const char* fail_at = std::getenv("TESSERA_CHECKPOINT_FAIL_AT");  // test hook
  fs::path latest_tmp = folder / "latest.tmp";
  write_synced(latest_tmp, step_dir_name(step) + "\n");
  TS_CHECK(!fail_at || std::string(fail_at) != "latest",
           "checkpoint: writing '{}' failed: No space left on device (TESSERA_CHECKPOINT_FAIL_AT)",
           latest_tmp.string());
  fsync_path(tmp_dir);
  if (fs::exists(final_dir)) fs::remove_all(final_dir);
  fs::rename(tmp_dir, final_dir);  // the commit point
  // The checkpoint is saved and loads (latest_checkpoint() finds the newest
  // complete step directory; `latest` is for people and scripts). What
  // follows cannot undo that, so a failure here is a warning, not a failed save.
  try {
    fs::rename(latest_tmp, folder / "latest");
    fsync_path(folder);
    TS_CHECK(!fail_at || std::string(fail_at) != "prune",
             "cannot remove an old checkpoint (TESSERA_CHECKPOINT_FAIL_AT)");
    prune(folder, keep);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "checkpoint: warning: %s is saved, but tidying up after it failed: %s\n",
                 final_dir.string().c_str(), e.what());
  }
}

}  // namespace

std::string save_checkpoint(const std::string& folder, int64_t step, nn::Module& model,
                            optim::AdamW* opt, const std::string& extra_json, int keep) {
  autograd::NoGradGuard no_grad;
  return save_checkpoint(folder, step, tensors_of(model, opt, false), extra_json, keep);
}

// A save in three phases: begin (collective: the folder prepared, who
// writes what), write (this rank's data file alone: the part an asynchronous
// save runs on a thread), finish (collective: the chunk lists exchanged,
// rank 0 commits, an error anywhere fails every rank).
struct SavePlan {
  fs::path folder, tmp_dir, final_dir;
  int64_t step = 0;
  std::string extra_json;
  int keep = 0;
  std::vector<HeldTensor> all;
  std::set<std::pair<std::string, Shape>> mine;
  json rng;  // this rank's generator at the save
};

namespace {

// 1. Rank 0 clears leftovers of interrupted saves and creates step-N.tmp/;
// its error (if any) travels with its description in step 2, whose exchange
// also keeps every rank from writing before the directory exists.
std::string prepare_folder(const SavePlan& plan) {
  if (dist::rank() != 0) return "";
  try {
    fs::create_directories(plan.folder);
    // Leftovers of saves that never committed: step-N.tmp/ and latest.tmp.
    for (const auto& e : fs::directory_iterator(plan.folder)) {
      std::string name = e.path().filename().string();
      if (name == "latest.tmp" || (name.rfind("step-", 0) == 0 && name.ends_with(".tmp")))
        fs::remove_all(e.path());
    }
    fs::create_directories(plan.tmp_dir);
  } catch (const std::exception& e) {
    return fmt::format("cannot prepare '{}': {}", plan.tmp_dir.string(), e.what());
  }
  return "";
}

// 2. What each rank holds (`held`, describe()'s), to every rank of `group`:
// the lowest rank holding a piece writes it. Any rank's error fails every rank.
void plan_owners(SavePlan& plan, const dist::ProcessGroupPtr& group, const json& held, const std::string& error) {
  std::vector<json> per_rank;
  for (const auto& text : dist::all_gather_strings(group, json{{"tensors", held}, {"error", error}}.dump()))
    per_rank.push_back(json::parse(text));
  for (size_t r = 0; r < per_rank.size(); ++r) {
    std::string e = per_rank[r]["error"].get<std::string>();
    TS_CHECK(e.empty(), "save_checkpoint failed on rank {}: {} (the previous checkpoint is untouched)", r, e);
  }
  std::tie(plan.all, plan.mine) = assign_owners(per_rank, dist::rank());
}

SavePlan new_plan(const std::string& folder, int64_t step, const std::string& extra_json, int keep) {
  SavePlan plan;
  plan.folder = fs::path(folder);
  plan.final_dir = plan.folder / step_dir_name(step);
  plan.tmp_dir = plan.folder / (step_dir_name(step) + ".tmp");
  plan.step = step, plan.extra_json = extra_json, plan.keep = keep;
  TS_CHECK(step >= 0 && step <= kMaxCheckpointStep, "save_checkpoint: step must be in [0, {}], got {}",
           kMaxCheckpointStep, step);
  TS_CHECK(json::accept(extra_json) && json::parse(extra_json).is_object(),
           "save_checkpoint: extra state must be a JSON object, got '{}'", extra_json);
  Generator& gen = default_generator();
  plan.rng = {{"seed", gen.seed()}, {"offset", gen.offset()}};
  return plan;
}

SavePlan begin_save(const std::string& folder, int64_t step, const nn::StateDict& tensors,
                    const std::string& extra_json, int keep) {
  SavePlan plan = new_plan(folder, step, extra_json, keep);
  std::string error = prepare_folder(plan);
  json held = json::array();
  if (error.empty()) {
    try {
      held = describe(tensors);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  plan_owners(plan, dist::world(), held, error);
  return plan;
}

// Test hooks of the data file's writing (tests/fsdp/test_checkpoint.cpp): a
// slow disk and a full one. Read when the save starts, on the caller's
// thread: the environment is not the writer thread's to read.
struct WriteHooks {
  int64_t delay_ms = 0;
  bool disk_full = false;
};
WriteHooks write_hooks() {
  WriteHooks h;
  if (const char* ms = std::getenv("TESSERA_CHECKPOINT_WRITE_DELAY_MS")) h.delay_ms = std::atoll(ms);
  const char* fail_at = std::getenv("TESSERA_CHECKPOINT_FAIL_AT");
  h.disk_full = fail_at != nullptr && std::string(fail_at) == "data";
  return h;
}

// 3. This rank's file: its chunk list, or the error that stopped it.
std::pair<json, std::string> write_save(const SavePlan& plan, const std::vector<SavePiece>& pieces,
                                        const WriteHooks& hooks) {
  try {
    if (hooks.delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(hooks.delay_ms));
    TS_CHECK(!hooks.disk_full,
             "checkpoint: writing '{}' failed: No space left on device (TESSERA_CHECKPOINT_FAIL_AT)",
             (plan.tmp_dir / fmt::format("rank-{:05d}.bin", dist::rank())).string());
    return {write_pieces(plan.tmp_dir, fmt::format("rank-{:05d}.bin", dist::rank()), dist::rank(), pieces), ""};
  } catch (const std::exception& e) {
    return {json::array(), e.what()};
  }
}

// 4-5. Chunk lists, RNG states and errors to every rank (any error fails
// all, and nothing is committed), then rank 0 writes the metadata and commits.
std::string finish_save(const SavePlan& plan, const json& chunks, const std::string& write_error,
                        const dist::ProcessGroupPtr& world) {
  json written = {{"chunks", chunks}, {"rng", plan.rng}, {"error", write_error}};
  std::vector<json> per_rank;
  for (const auto& text : dist::all_gather_strings(world, written.dump()))
    per_rank.push_back(json::parse(text));
  for (size_t r = 0; r < per_rank.size(); ++r) {
    std::string e = per_rank[r]["error"].get<std::string>();
    TS_CHECK(e.empty(),
             "save_checkpoint failed on rank {}: {} (the previous checkpoint is untouched)", r, e);
  }
  std::string error;
  if (dist::rank() == 0) {
    try {
      commit(plan.folder, plan.tmp_dir, plan.final_dir, plan.step, world->size(), plan.all, per_rank,
             plan.extra_json, plan.keep);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  dist::throw_if_any_failed(world, error, "save_checkpoint");
  return plan.final_dir.string();
}

}  // namespace

std::string save_checkpoint(const std::string& folder_in, int64_t step,
                            const nn::StateDict& tensors, const std::string& extra_json, int keep) {
  autograd::NoGradGuard no_grad;
  SavePlan plan = begin_save(folder_in, step, tensors, extra_json, keep);
  auto [chunks, error] = write_save(plan, pieces_of(tensors, plan.mine, nullptr), write_hooks());
  return finish_save(plan, chunks, error, dist::world());
}

// ---- asynchronous saves ----------------------------------------------------------

struct AsyncCheckpointer::Pending {
  SavePlan plan;
  std::vector<HeldTensor> held;   // this rank's tensors at the save (the plan's input)
  std::vector<SavePiece> staged;  // the copies (the planned pieces, or all this rank holds)
  WriteHooks hooks;               // read on the caller's thread
  std::chrono::steady_clock::time_point started;
  // The outcome, the same on every rank; set once, under mu.
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::string dir, error;
  double seconds = 0;
};

// One thread for all saves, started by prepare() and lowered below the
// training's threads (Linux sets priorities per thread): a thread started
// per save, at full priority, took the core from the training loop it was
// meant to spare where ranks share cores.
struct AsyncCheckpointer::Layout {
  dist::ProcessGroupPtr group;  // the thread's collectives: never the training's groups
  std::vector<HeldTensor> held;  // this rank's tensors when the last plan was made
  std::set<std::pair<std::string, Shape>> mine;  // the pieces that plan has this rank write
  std::mutex mu;
  std::condition_variable cv;
  std::shared_ptr<Pending> next;  // handed to the thread
  bool stop = false;
  std::thread thread;
};

namespace {

// Every piece this rank holds, as (tensor, box offset).
std::set<std::pair<std::string, Shape>> held_pieces(const nn::StateDict& tensors) {
  std::set<std::pair<std::string, Shape>> out;
  for (const auto& [name, t] : tensors)
    for (const LocalBox& box : local_boxes(t)) out.insert({name, box.offset});
  return out;
}

// The thread's part of one save: steps 1-5 of save_checkpoint, on the
// checkpoint group. Every step that can fail on one rank shares its error
// with all of them, so every rank's thread ends with the same outcome.
void write_in_background(AsyncCheckpointer::Pending& p, const dist::ProcessGroupPtr& group) {
  std::string dir, error;
  try {
    SavePlan& plan = p.plan;
    plan_owners(plan, group, describe(p.held), prepare_folder(plan));
    std::vector<SavePiece> mine;
    for (const SavePiece& piece : p.staged)
      if (plan.mine.count({piece.name, piece.offset})) mine.push_back(piece);
    std::pair<json, std::string> written{json::array(), ""};
    if (mine.size() == plan.mine.size())
      written = write_save(plan, mine, p.hooks);
    else  // cannot happen while this rank's layout is the last plan's (compared at the save)
      written.second = fmt::format("this rank staged {} of the {} pieces the plan has it write", mine.size(),
                                   plan.mine.size());
    dir = finish_save(plan, written.first, written.second, group);
  } catch (const std::exception& e) {
    error = e.what();
  }
  std::lock_guard<std::mutex> lock(p.mu);
  p.dir = dir, p.error = error;
  p.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - p.started).count();
  p.done = true;
  p.cv.notify_all();
}

void writer_loop(std::shared_ptr<AsyncCheckpointer::Layout> layout);

}  // namespace

AsyncCheckpointer::AsyncCheckpointer() = default;

AsyncCheckpointer::~AsyncCheckpointer() {
  if (!layout_) return;
  {
    std::lock_guard<std::mutex> lock(layout_->mu);
    layout_->stop = true;
  }
  layout_->cv.notify_all();
  bool busy = false;
  if (pending_) {
    std::lock_guard<std::mutex> lock(pending_->mu);
    busy = !pending_->done;
  }
  // A save still in flight (this rank is failing, and its peers may never
  // answer) is left to end on its own, or with the process: the thread holds
  // what it uses.
  if (busy) layout_->thread.detach();
  else layout_->thread.join();
}

namespace {

void writer_loop(std::shared_ptr<AsyncCheckpointer::Layout> layout) {
  ::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), 10);
  dist::BackgroundWaits background;  // not the training loop's waiting
  for (;;) {
    std::shared_ptr<AsyncCheckpointer::Pending> job;
    {
      std::unique_lock<std::mutex> lock(layout->mu);
      layout->cv.wait(lock, [&] { return layout->next != nullptr || layout->stop; });
      if (!layout->next) return;  // stopped, nothing left to write
      job = std::move(layout->next);
    }
    write_in_background(*job, layout->group);
  }
}

}  // namespace

int64_t AsyncCheckpointer::prepare(nn::Module& model, optim::AdamW* opt) {
  autograd::NoGradGuard no_grad;
  if (!layout_) {
    auto layout = std::make_shared<Layout>();
    auto world = dist::world();
    layout->group = world->size() > 1 ? world->split(0, world->rank(), "checkpoint") : world;
    nn::StateDict tensors = tensors_of(model, opt, /*create_optimizer_state=*/true);
    layout->held = held_of(tensors);
    SavePlan plan;
    plan_owners(plan, layout->group, describe(layout->held), "");
    layout->mine = std::move(plan.mine);
    for (const auto& [name, t] : tensors)
      for (const LocalBox& box : local_boxes(t))
        if (layout->mine.count({name, box.offset})) {
          Tensor buf = empty(box.local.shape(), box.local.dtype(), Device::cpu());
          // Touched now: the first save's copies would otherwise fault in every page.
          if (buf.nbytes() > 0) std::memset(buf.host_data_ptr(), 0, buf.nbytes());
          staging_[{name, box.offset}] = buf;
        }
    layout->thread = std::thread(writer_loop, layout);
    layout_ = std::move(layout);
  }
  int64_t bytes = 0;
  for (const auto& [key, buf] : staging_) bytes += static_cast<int64_t>(buf.nbytes());
  return bytes;
}

double AsyncCheckpointer::save(const std::string& folder, int64_t step, nn::Module& model, optim::AdamW* opt,
                               const std::string& extra_json, int keep) {
  autograd::NoGradGuard no_grad;
  wait();
  const auto t0 = std::chrono::steady_clock::now();
  prepare(model, opt);
  nn::StateDict tensors = tensors_of(model, opt, false);
  auto p = std::make_shared<Pending>();
  p->plan = new_plan(folder, step, extra_json, keep);
  p->held = held_of(tensors);
  // The pieces the last plan had this rank write, if its tensors are laid out
  // as then; otherwise all it holds (the thread's plan picks from them).
  const bool same = p->held == layout_->held;
  p->staged = pieces_of(tensors, same ? layout_->mine : held_pieces(tensors), &staging_);
  p->hooks = write_hooks();
  p->started = std::chrono::steady_clock::now();
  {
    std::lock_guard<std::mutex> lock(layout_->mu);
    layout_->next = p;
  }
  layout_->cv.notify_one();
  pending_ = std::move(p);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string AsyncCheckpointer::complete() {
  std::shared_ptr<Pending> finished = std::move(pending_);
  {
    std::unique_lock<std::mutex> lock(finished->mu);
    finished->cv.wait(lock, [&] { return finished->done; });
  }
  last_write_seconds_ = finished->seconds;
  TS_CHECK(finished->error.empty(), "{}", finished->error);
  // The plan this save made is the next one's guess.
  layout_->held = std::move(finished->held);
  layout_->mine = finished->plan.mine;
  return finished->dir;
}

std::string AsyncCheckpointer::poll() {
  if (!pending_) return "";
  {
    std::lock_guard<std::mutex> lock(pending_->mu);
    if (!pending_->done) return "";
  }
  return complete();
}

std::string AsyncCheckpointer::wait() { return pending_ ? complete() : ""; }

bool AsyncCheckpointer::pending() const { return pending_ != nullptr; }

int64_t AsyncCheckpointer::pending_step() const { return pending_ ? pending_->plan.step : -1; }

std::string latest_checkpoint(const std::string& folder) {
  auto complete = complete_checkpoints(folder);
  return complete.empty() ? "" : complete.back().second;
}

std::vector<std::pair<int64_t, std::string>> complete_checkpoints(const std::string& folder) {
  std::vector<std::pair<int64_t, std::string>> complete;
  if (!fs::is_directory(folder)) return complete;
  for (const auto& e : fs::directory_iterator(folder)) {
    std::string n = e.path().filename().string();
    if (!e.is_directory() || n.rfind("step-", 0) != 0 || n.find(".tmp") != std::string::npos)
      continue;
    if (!fs::exists(e.path() / "metadata.json")) continue;
    try {
      complete.emplace_back(std::stoll(n.substr(5)), e.path().string());
    } catch (const std::exception&) {
    }
  }
  std::sort(complete.begin(), complete.end());
  return complete;
}

namespace {
void load_on_this_rank(const CheckpointMetadata& md, const std::string& dir, nn::Module& model,
                       optim::AdamW* opt, nn::StateDict& dest, const std::vector<std::string>& unexpected,
                       bool convert);
}

CheckpointMetadata load_checkpoint(const std::string& dir, nn::Module& model, optim::AdamW* opt,
                                   bool convert_dtypes) {
  autograd::NoGradGuard no_grad;
  // The destinations (optimizer moments created) before anything can fail, so
  // that every rank takes part in the same collectives.
  nn::StateDict dest = tensors_of(model, opt, true);
  CheckpointMetadata md;
  std::string error;
  std::vector<std::string> not_here;  // saved tensors this rank's model lacks
  try {
    md = read_metadata(dir);
    for (const auto& t : md.tensors)  // optimizer state is skipped when loading weights only
      if (nn::find_in(dest, t.name) == nullptr && (opt || t.name.rfind("optim.", 0) != 0))
        not_here.push_back(t.name);
  } catch (const std::exception& e) {
    error = e.what();
  }
  // A pipeline spreads the model over its ranks, each holding its stages'
  // tensors: a saved tensor is unexpected only when no rank's model holds it.
  const std::vector<std::string> unexpected = lacked_by_every_rank(not_here);
  if (error.empty()) {
    try {
      load_on_this_rank(md, dir, model, opt, dest, unexpected, convert_dtypes);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  dist::throw_if_any_failed(dist::world(), error, "load_checkpoint");
  for (auto& [p, m] : model.named_modules())
    if (m->extension) m->extension->after_load_state_dict(*m);
  return md;
}

namespace {
void load_on_this_rank(const CheckpointMetadata& md, const std::string& dir, nn::Module& model,
                       optim::AdamW* opt, nn::StateDict& dest, const std::vector<std::string>& unexpected,
                       bool convert) {
  std::string md_file = (fs::path(dir) / "metadata.json").string();
  // Every model tensor must be in the checkpoint; optimizer state may be absent
  // (a parameter that had not stepped yet) and then starts fresh.
  std::vector<std::string> missing;
  for (const auto& [name, t] : dest)
    if (name.rfind("optim.", 0) != 0 && md.find(name) == nullptr) missing.push_back(name);
  TS_CHECK(missing.empty() && unexpected.empty(),
           "{}: the checkpoint does not match the model{}: missing keys [{}]; unexpected keys [{}]",
           md_file, opt ? " and optimizer" : "", nn::quoted_keys(missing), nn::quoted_keys(unexpected));
  for (auto& [name, t] : dest) {
    const TensorInfo* info = md.find(name);
    if (info == nullptr) continue;  // optimizer moments of a parameter that had not stepped
    TS_CHECK(info->shape == t.shape(),
             "{}: tensor '{}' is {} in the checkpoint but {} in the model", md_file, name,
             shape_str(info->shape), shape_str(t.shape()));
    TS_CHECK(info->dtype == t.dtype() || (convert && is_floating(info->dtype) && is_floating(t.dtype())),
             "{}: tensor '{}' is {} in the checkpoint but {} in the model", md_file, name,
             dtype_name(info->dtype), dtype_name(t.dtype()));
    // The saved chunks, each read once, into the parts of this rank's boxes
    // of the tensor (one, or one per block of a blocked shard) they overlap.
    const std::vector<LocalBox> boxes = local_boxes(t);
    for (const auto& ch : info->chunks) {
      Tensor data;
      for (const auto& [local, start, extent] : boxes) {
        const auto common = chunk_overlap(ch, start, extent);
        if (!common) continue;
        const auto& [lo, len] = *common;
        if (!data.defined()) data = read_chunk(dir, *info, ch);
        Tensor src = data, dst = local;
        for (size_t d = 0; d < start.size(); ++d) {
          src = ops::narrow(src, static_cast<int64_t>(d), lo[d] - ch.offsets[d], len[d]);
          dst = ops::narrow(dst, static_cast<int64_t>(d), lo[d] - start[d], len[d]);
        }
        ops::copy_(dst, src);
      }
    }
  }
  if (opt) {
    // Moments were filled in place; the step scalars were read into their copies.
    nn::StateDict state;
    for (auto& [k, v] : dest)
      if (k.rfind("optim.", 0) == 0) state.emplace_back(k.substr(6), v);
    opt->load_state_dict(state, model.named_parameters());
  }
  if (md.world_size == dist::world_size() &&
      static_cast<int>(md.rank_state.size()) > dist::rank()) {
    json rng = json::parse(md.rank_state[static_cast<size_t>(dist::rank())]);
    if (rng.contains("seed") && rng.contains("offset")) {
      default_generator().manual_seed(rng["seed"].get<uint64_t>());
      default_generator().set_offset(rng["offset"].get<int64_t>());
    }
  }
}

}  // namespace

}  // namespace tessera::fsdp
