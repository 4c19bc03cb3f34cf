// tessera-train's checkpoints: what a checkpoint carries besides tensors
// (the loss curve, the data position, the run's configuration), saving it,
// resuming a saved run (its configuration checked key by key against this
// run's: what breaks the exact continuation is refused unless allowed), and
// a fresh run from given weights (tools/trainer.h).
#include <cmath>
#include <filesystem>

#include "fsdp/checkpoint.h"
#include "fsdp/state_dict.h"
#include "nn/safetensors.h"
#include "runtime/random.h"
#include "tools/trainer.h"

namespace tessera::tools {

namespace fs = std::filesystem;

namespace {

// The dropout stream of one rank: different on every rank (each draws its own
// masks), the same on every run with the same job.seed. `step` > 0 when a
// resumed run cannot take the saved stream (another world size).
uint64_t dropout_seed(int64_t seed, int rank, int64_t step) {
  return hash_name(fmt::format("dropout/{}/{}/{}", seed, rank, step));
}

// Keys whose change on resume breaks the data order or the batch, so the run
// is no longer the saved one continued: an error unless
// checkpoint.allow_resume_change lists them.
const std::vector<std::string>& kExactKeys = tools::resume_exact_keys();
// Keys that change the training but not what was saved: a warning. (Shape keys
// of [model] are also caught by the load, this names them first.)
bool affects_training(const std::string& key) {
  for (const char* k : {"training.eval_interval", "training.eval_batches", "training.data_dir"})
    if (key == k) return false;
  for (const char* sec : {"model.", "training.", "optimizer.", "lr_scheduler.", "mixed_precision."})
    if (key.rfind(sec, 0) == 0) return true;
  return false;
}

// The [model] keys (and training.seq_len) where a stored model configuration
// differs from this run's, e.g. "model.n_embd 64 (this run: 128)".
std::vector<std::string> model_differences(tools::TrainConfig& cfg, const json& stored) {
  std::vector<std::string> out;
  if (!stored.is_object()) return out;
  json mine = json::parse(tools::model_to_json(cfg));
  for (auto it = stored.begin(); it != stored.end(); ++it)
    if (it.key() != "model.dropout" && mine.contains(it.key()) && it.value() != mine[it.key()])
      out.push_back(fmt::format("{} {} (this run: {})", it.key(),
                                it.value().is_string() ? it.value().get<std::string>()
                                                       : it.value().dump(),
                                mine[it.key()].get<std::string>()));
  return out;
}

// The training state a checkpoint's metadata carries besides tensors, checked
// field by field against its type and against what else is known (the step,
// the saved batch layout), so that a file that parses but lies is refused
// naming the field instead of training on (a negative step meant a negative
// learning rate).
json checked_training_state(const std::string& dir, const fsdp::CheckpointMetadata& head,
                            int64_t grad_accum) {
  std::string file = (fs::path(dir) / "metadata.json").string();
  json extra = json::parse(head.extra_json);
  auto field = [&](const char* section, const char* key) -> const json& {
    static const json missing;
    if (!extra.contains(section) || !extra[section].is_object() || !extra[section].contains(key))
      return missing;
    return extra[section][key];
  };
  const json& next = field("data", "next_micro_batch");
  TS_CHECK(!next.is_null(), "{}: not a tessera-train checkpoint (no data.next_micro_batch)", file);
  TS_CHECK(next.is_number_unsigned(), "{}: data.next_micro_batch must be a count (>= 0), got {}",
           file, next.dump());
  const json& seed = field("data", "seed");
  TS_CHECK(seed.is_null() || seed.is_number_integer(), "{}: data.seed must be an integer, got {}",
           file, seed.dump());
  const json& next_step = field("lr_scheduler", "next_step");
  TS_CHECK(next_step.is_null() || (next_step.is_number_unsigned() &&
                                   next_step.get<uint64_t>() == static_cast<uint64_t>(head.step)),
           "{}: lr_scheduler.next_step is {} but the checkpoint is at step {}", file,
           next_step.dump(), head.step);
  const json& lr = field("lr_scheduler", "lr");
  TS_CHECK(lr.is_null() || (lr.is_number() && std::isfinite(lr.get<double>()) &&
                            lr.get<double>() >= 0),
           "{}: lr_scheduler.lr must be a finite rate >= 0, got {}", file, lr.dump());
  TS_CHECK(!extra.contains("config") || extra["config"].is_string(),
           "{}: config must be the run's TOML text, got {}", file,
           extra.contains("config") ? extra["config"].type_name() : "");
  TS_CHECK(!extra.contains("model") || extra["model"].is_object(),
           "{}: model must be an object of the model's settings", file);
  // The saved loss curve: [step, loss] pairs at steps 1..step.
  for (const char* key : {"losses", "val_losses"}) {
    if (!extra.contains(key)) continue;
    TS_CHECK(extra[key].is_array(), "{}: {} must be an array of [step, loss] pairs", file, key);
    for (const auto& p : extra[key])
      TS_CHECK(p.is_array() && p.size() == 2 && p[0].is_number_unsigned() &&
                   p[0].get<uint64_t>() <= static_cast<uint64_t>(head.step) && p[1].is_number(),
               "{}: {} holds {}, not a [step, loss] pair of a step up to {}", file, key, p.dump(),
               head.step);
  }
  // The data position is step x the saved run's micro-batches per step.
  auto saved = tools::toml_values(extra.value("config", std::string()));
  if (auto it = saved.find("training.grad_accum"); it != saved.end()) {
    try {
      grad_accum = std::stoll(it->second);
    } catch (const std::exception&) {
      TS_CHECK(false, "{}: config has training.grad_accum = '{}', not an integer", file,
               it->second);
    }
    int64_t position = 0;
    TS_CHECK(!__builtin_mul_overflow(head.step, grad_accum, &position) &&
                 next.get<uint64_t>() == static_cast<uint64_t>(position),
             "{}: data.next_micro_batch is {} but step {} x the saved training.grad_accum {} is {}",
             file, next.get<uint64_t>(), head.step, grad_accum, position);
  }
  return extra;
}

}  // namespace

json Trainer::extra_state(int64_t step) {
  json losses = json::array(), vals = json::array();
  for (const auto& [s, l] : curve_.train) losses.push_back({s, l});
  for (const auto& [s, l] : curve_.val) vals.push_back({s, l});
  json extra = {{"step", step},
                {"data", {{"next_micro_batch", step * T_.grad_accum}, {"seed", cfg_.job.seed}}},
                {"lr_scheduler", {{"next_step", step}, {"lr", schedule_.lr_at(step)}}},
                {"model", json::parse(tools::model_to_json(cfg_))},
                {"config", tools::to_toml(cfg_)},
                {"losses", losses},
                {"val_losses", vals}};
  if (!tokenizer_record_.is_null()) extra["tokenizer"] = tokenizer_record_;
  return extra;
}

// The stall a save costs the training loop, either way: from the call to the
// return (the training state's JSON, and asynchronously the wait for the
// previous save and the staging copies; synchronously the whole save).
void Trainer::save(int64_t step) {
  auto t0 = Clock::now();
  const std::string folder = out_path(cfg_, cfg_.checkpoint.folder);
  if (cfg_.checkpoint.async_mode == "async") {
    prepare_async_checkpoints();
    const int64_t previous = async_ckpt_->pending_step();
    if (previous >= 0) {  // the previous save must be complete first
      std::string dir = async_ckpt_->wait();
      say(fmt::format("checkpoint: step {} -> {} (written in the background; the next save waited for it)",
                      previous, dir));
    }
    async_ckpt_->save(folder, step, *model_, adamw_, extra_state(step).dump(), static_cast<int>(cfg_.checkpoint.keep));
    const double stall = seconds_since(t0);
    say(fmt::format("checkpoint: step {} staged in {:.3f} s; writing in the background", step, stall));
    if (rank_ == 0) jsonl_->write(json{{"step", step}, {"checkpoint_stall_s", stall}}.dump());
    return;
  }
  std::string dir = fsdp::save_checkpoint(folder, step, *model_, adamw_, extra_state(step).dump(),
                                          static_cast<int>(cfg_.checkpoint.keep));
  const double took = seconds_since(t0);
  say(fmt::format("checkpoint: step {} -> {} ({:.2f} s)", step, dir, took));
  if (rank_ == 0) jsonl_->write(json{{"step", step}, {"checkpoint_stall_s", took}}.dump());
}

// Asynchronous saves' group, plan and staging buffers, made once before
// training (a collective), so that no save pays for them in the loop.
void Trainer::prepare_async_checkpoints() {
  if (async_ckpt_) return;
  auto t0 = Clock::now();
  async_ckpt_ = std::make_unique<fsdp::AsyncCheckpointer>();
  const int64_t bytes = async_ckpt_->prepare(*model_, adamw_);
  say(fmt::format("checkpoint: asynchronous saves stage {:.1f} MiB per rank in host buffers (prepared in {:.3f} s)",
                  static_cast<double>(bytes) / 1048576.0, seconds_since(t0)));
}

void Trainer::poll_checkpoint() {
  if (!async_ckpt_ || !async_ckpt_->pending()) return;
  const int64_t step = async_ckpt_->pending_step();
  std::string dir = async_ckpt_->poll();
  if (!dir.empty())
    say(fmt::format("checkpoint: step {} -> {} (written in the background in {:.2f} s)", step, dir,
                    async_ckpt_->last_write_seconds()));
}

void Trainer::wait_checkpoint() {
  if (!async_ckpt_ || !async_ckpt_->pending()) return;
  const int64_t step = async_ckpt_->pending_step();
  std::string dir = async_ckpt_->wait();
  say(fmt::format("checkpoint: step {} -> {} (written in the background in {:.2f} s)", step, dir,
                  async_ckpt_->last_write_seconds()));
}

// Resuming continues the saved run: keys that break its data order or batch
// (kExactKeys) must match unless allowed; other changes to the training are
// allowed with a warning. A changed training.steps (extending a finished run)
// keeps the warmup + cosine schedule defined over the new total.
void Trainer::check_resume_config(const std::string& dir, const json& extra, int64_t step) {
  const std::string saved_text = extra.value("config", std::string());
  auto saved = tools::toml_values(saved_text);
  // A saved configuration that is missing or does not read would skip every
  // check below. Only tessera-ckpt's checkpoints (extra.source: imported
  // weights, no run behind them) hold none.
  const bool imported = extra.contains("source");
  TS_CHECK(imported || !saved_text.empty(),
           "{}: the checkpoint holds no saved configuration (its metadata's extra.config is {}), so this run's "
           "settings cannot be checked against the saved run's; start from its weights with "
           "--checkpoint.initial_load_path {} instead (a fresh optimizer and data order)",
           dir, extra.contains("config") ? "empty" : "absent", dir);
  TS_CHECK(saved_text.empty() || !saved.empty(),
           "{}: the configuration saved with the checkpoint {}, so this run's settings cannot be checked against "
           "it; start from its weights with --checkpoint.initial_load_path {} instead (a fresh optimizer and data "
           "order)",
           dir, tools::toml_reads(saved_text) ? "holds no settings"
                                              : "does not read as TOML (written before control characters in "
                                                "strings were escaped?)",
           dir);
  if (saved.empty() && extra.contains("data") && extra["data"].contains("seed"))
    saved["job.seed"] = std::to_string(extra["data"]["seed"].get<int64_t>());
  auto allowed = [&](const std::string& key) {
    return std::find(allowed_.begin(), allowed_.end(), key) != allowed_.end();
  };
  std::vector<std::string> errors, error_keys, changes;
  for (const auto& k : tools::config_keys(cfg_)) {
    auto it = saved.find(k.name);
    if (it == saved.end() || it->second == k.get()) continue;
    std::string change = fmt::format("{} {} -> {}", k.name, it->second, k.get());
    bool exact = std::find(kExactKeys.begin(), kExactKeys.end(), k.name) != kExactKeys.end();
    if (exact && !allowed(k.name)) {
      errors.push_back(change);
      error_keys.push_back(k.name);
    } else if (exact || affects_training(k.name)) {
      changes.push_back(change);
    }
  }
  // Without a saved configuration (tessera-ckpt's checkpoints) the data
  // position still has to map onto this run's micro-batches.
  if (saved.count("training.grad_accum") == 0 && !allowed("training.grad_accum") &&
      extra["data"]["next_micro_batch"].get<int64_t>() != step * T_.grad_accum) {
    errors.push_back(fmt::format("training.grad_accum (data position {} is not step {} x {})",
                                 extra["data"]["next_micro_batch"].get<int64_t>(), step,
                                 T_.grad_accum));
    error_keys.push_back("training.grad_accum");
  }
  TS_CHECK(errors.empty(),
           "{}: the checkpoint was saved with other settings, so resuming would not continue "
           "that run: {}. Use the saved values, or pass --checkpoint.allow_resume_change {} to continue "
           "anyway (the data order and batches then differ from the saved run's), or start a new "
           "run from its weights with --checkpoint.initial_load_path",
           dir, fmt::join(errors, "; "), fmt::join(error_keys, ","));
  if (changes.empty()) return;
  say(
      fmt::format("warning: resuming with settings changed since the checkpoint (the run "
                  "continues, not as the saved run would have): {}",
                  fmt::join(changes, "; ")));
  // (value<double>: with a NAN default, value() would read the rate as a float.)
  double saved_lr = extra.contains("lr_scheduler") ? extra["lr_scheduler"].value<double>("lr", NAN) : NAN;
  double lr = schedule_.lr_at(step);
  // A schedule that follows training.steps (decay_steps 0) stretches with it.
  if (cfg_.lr_scheduler.decay_steps == 0 && saved.count("training.steps") &&
      saved["training.steps"] != std::to_string(T_.steps))
    say(fmt::format("warning: the learning-rate schedule ({}) now spans {} steps instead of {}",
                    schedule_.describe(), T_.steps, saved["training.steps"]));
  if (!std::isnan(saved_lr) && std::abs(lr - saved_lr) > 1e-12 * std::abs(saved_lr))
    say(fmt::format("warning: step {} runs at lr {:.3e}; the saved schedule had {:.3e}", step + 1,
                    lr, saved_lr));
}

int64_t Trainer::resume(const std::string& dir) {
  auto head = fsdp::read_metadata(dir);
  json extra = checked_training_state(dir, head, T_.grad_accum);
  TS_CHECK(head.step <= T_.steps,
           "{}: the checkpoint is at step {}, beyond training.steps {}: nothing is left to train "
           "(raise training.steps to continue the run)",
           dir, head.step, T_.steps);
  check_resume_config(dir, extra, head.step);
  fsdp::CheckpointMetadata md;
  try {
    md = fsdp::load_checkpoint(dir, *model_, adamw_);
  } catch (const std::exception& e) {
    std::string what = e.what();
    bool mismatch = what.find("does not match the model") != std::string::npos ||
                    what.find("in the checkpoint but") != std::string::npos;
    std::vector<std::string> diff = model_differences(cfg_, extra.value("model", json()));
    TS_CHECK(
        !mismatch, "{}{}{}", what,
        diff.empty() ? "" : fmt::format(" (the checkpoint's model: {})", fmt::join(diff, ", ")),
        " -- to start a new run from these weights in another dtype or layout, use "
        "--checkpoint.initial_load_path (a .safetensors file or checkpoint) instead of "
        "--checkpoint.resume");
    throw;
  }
  check_weights_finite(dir);
  for (const auto& p : extra.value("losses", json::array())) curve_.train.emplace_back(p[0], p[1]);
  for (const auto& p : extra.value("val_losses", json::array()))
    curve_.val.emplace_back(p[0], p[1]);
  if (!curve_.val.empty()) last_val_ = curve_.val.back().second;
  // load_checkpoint restored each rank's dropout stream when the world size matches; a
  // checkpoint tessera-ckpt made holds none of this run's.
  rng_restored_ = md.world_size == world_ && extra.contains("config");
  say(fmt::format("resumed from {} (step {}, saved on {} rank(s), now {}{})", dir, md.step,
                  md.world_size, world_, md.world_size == world_ ? "" : ": resharded"));
  return md.step;
}

// A fresh run from given weights (TorchTitan's initial_load_path): the model
// only, converted to the model's dtype; the optimizer and the step start anew.
void Trainer::load_initial_weights(const std::string& path) {
  TS_CHECK(fs::exists(path), "checkpoint.initial_load_path '{}' does not exist", path);
  bool file = fs::is_regular_file(path);
  std::string dir, source = path;
  json stored;  // the model configuration saved with the weights, if any
  try {
    if (file) {
      nn::SafetensorsFile f(path);
      if (auto it = f.metadata().find("tessera_model"); it != f.metadata().end())
        stored = json::parse(it->second, nullptr, false);
    } else {
      dir = fs::exists(fs::path(path) / "metadata.json") ? path : fsdp::latest_checkpoint(path);
      TS_CHECK(!dir.empty(), "'{}' is neither a .safetensors file nor a checkpoint directory",
               path);
      source = dir;
      stored = json::parse(fsdp::read_metadata(dir).extra_json).value("model", json());
    }
    if (file)
      fsdp::load_safetensors(*model_, path);
    else
      fsdp::load_checkpoint(dir, *model_, nullptr, /*convert_dtypes=*/true);  // the weights only
  } catch (const std::exception& e) {
    std::vector<std::string> diff = model_differences(cfg_, stored);
    TS_CHECK(false, "checkpoint.initial_load_path: {}{}", e.what(),
             diff.empty() ? ""
                          : fmt::format(" (the weights were saved from another model: {})",
                                        fmt::join(diff, ", ")));
  }
  check_weights_finite(source);
  say(opt_ ? fmt::format("initial weights from {}: step 0, a fresh optimizer and learning-rate schedule", source)
           : fmt::format("weights from {}", source));
}

void Trainer::check_weights_finite(const std::string& source) {
  autograd::NoGradGuard no_grad;
  std::vector<std::string> bad;
  for (const auto& [name, p] : model_->named_parameters()) {
    const Tensor local = is_dtensor(p) ? local_tensor(p) : p;
    if (local.numel() > 0 && std::isnan(ops::sum(ops::mul(local, 0.0)).item()))  // x * 0 is NaN for NaN and inf
      bad.push_back(name);
  }
  // Every rank refuses if any found one (a replicated tensor is found on each of its ranks).
  const bool any = all_reduce(static_cast<double>(bad.size()), dist::ReduceOp::Max) > 0;
  TS_CHECK(!any,
           "{}: {}: a run from them diverges at its first step (a checkpoint saved after the loss diverged? resume "
           "from an earlier one with --checkpoint.load_step)",
           source,
           bad.empty() ? "weight tensors on other ranks hold NaN or infinite values"
                       : fmt::format("{} weight tensor{} NaN or infinite values, {}{}", bad.size(),
                                     bad.size() == 1 ? " holds" : "s hold",
                                     fmt::join(bad.begin(), bad.begin() + std::min<size_t>(bad.size(), 3), ", "),
                                     bad.size() > 3 ? ", ..." : ""));
}

// The checkpoint a resume continues from: the latest, or checkpoint.load_step's,
// refused while later ones exist (the continued run would overwrite them).
std::string Trainer::checkpoint_to_resume(const std::string& folder) {
  const int64_t want = cfg_.checkpoint.load_step;
  auto all = fsdp::complete_checkpoints(folder);
  if (want == 0) return all.empty() ? "" : all.back().second;
  TS_CHECK(!all.empty(), "checkpoint.load_step {}: {} holds no complete checkpoint to resume from", want, folder);
  std::vector<int64_t> steps, later;
  std::string found;
  for (const auto& [step, dir] : all) {
    steps.push_back(step);
    if (step == want) found = dir;
    if (step > want) later.push_back(step);
  }
  TS_CHECK(!found.empty(), "checkpoint.load_step {}: {} has no complete checkpoint of that step (it has steps {})",
           want, folder, fmt::join(steps, ", "));
  TS_CHECK(later.empty(),
           "checkpoint.load_step {}: {} also holds later checkpoints (steps {}), which the continued run would "
           "overwrite; move them elsewhere first, or start a new run from step {}'s weights with "
           "--checkpoint.initial_load_path {} --job.dump_folder <another folder>",
           want, folder, fmt::join(later, ", "), want, found);
  return found;
}

int64_t Trainer::restore_or_start() {
  int64_t start = 0;
  std::string folder = out_path(cfg_, cfg_.checkpoint.folder);
  std::string resume_dir = cfg_.checkpoint.resume ? checkpoint_to_resume(folder) : "";
  const std::string& initial = cfg_.checkpoint.initial_load_path;
  if (!resume_dir.empty()) {
    start = resume(resume_dir);
    if (!initial.empty())
      say(fmt::format("checkpoint.initial_load_path {} not used: resuming from {} wins", initial,
                      resume_dir));
  } else {
    if (cfg_.checkpoint.resume)
      say(fmt::format("resume: no complete checkpoint in {}; starting from step 0{}", folder,
                      initial.empty() ? "" : " with the initial weights"));
    if (!initial.empty()) load_initial_weights(initial);
  }
  if (!rng_restored_) default_generator().manual_seed(dropout_seed(cfg_.job.seed, rank_, start));
  return start;
}

}  // namespace tessera::tools
