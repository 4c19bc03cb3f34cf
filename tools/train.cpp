// tessera-train: trains a language model with FSDP2 across the ranks of an
// MPI job (or as one plain process), on the embedded default (the fortunes
// corpus, byte tokens) or on given data; checkpoints, metrics, traces, and a
// generated sample at the end.
//
//   mpirun -np 4 tessera-train                   # the embedded default (make train)
//   tessera-train --preset tiny --training.steps 20
//   mpirun -np 4 tessera-train --config run.toml --parallelism.data_parallel_replicate_degree 2
//   mpirun -np 2 tessera-train --checkpoint.enable true --checkpoint.resume true
//   mpirun -np 2 tessera-train --checkpoint.initial_load_path gpt.safetensors   # fine-tune
//
// Every rank runs this program; rank 0 alone prints and writes metrics.
#include <signal.h>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <thread>

#include "dtensor/dtensor.h"
#include "fsdp/checkpoint.h"
#include "fsdp/fully_shard.h"
#include "fsdp/state_dict.h"
#include "io/data.h"
#include "io/tokenizer.h"
#include "nn/generate.h"
#include "nn/models.h"
#include "nn/optim.h"
#include "runtime/allocator.h"
#include "runtime/cuda_backend.h"
#include "runtime/parallel.h"
#include "runtime/random.h"
#include "runtime/trace.h"
#include "tools/config.h"
#include "tools/plan.h"
#include "tools/report.h"
#include "tools/run_folder.h"
#include "tools/trainer.h"
#include "train/optimizer.h"
#include "train/parallelize.h"
#include "train/step.h"

using namespace tessera;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace tessera::tools {

namespace {

// Train and validation tokens: rank 0 prepares the shards once (cached in
// data_dir), then every rank reads them.
// With a tokenizer, the shards' names carry its fingerprint: another
// tokenizer (or a changed file) prepares its own.
std::pair<std::vector<uint16_t>, std::vector<uint16_t>> load_data(const tools::TrainConfig& c,
                                                                 const io::BpeTokenizer* tokenizer) {
  if (c.training.dataset == "shards") return {io::read_shard(c.training.train_shard), io::read_shard(c.training.val_shard)};
  const bool text = c.training.dataset == "text";
  std::string name = text ? fs::path(c.training.text).stem().string() : "fortunes";
  if (tokenizer != nullptr) name += "_bpe-" + io::file_fingerprint(c.training.tokenizer);
  return io::text_dataset(text ? std::vector<std::string>{c.training.text} : io::default_corpus_files(),
                          c.training.data_dir, name, tokenizer);
}

// Test hooks: TESSERA_TEST_KILL="rank:step" kills that rank (SIGKILL) when
// it reaches that step, to check that the other ranks end with an error;
// TESSERA_TEST_HANG="rank:step" stops it there for good instead (the others'
// collectives time out). "rank:step:launch" acts only in that launch of
// tessera-run (TESSERA_RESTART_COUNT, 0 the first), so that a restarted job
// runs on. Read once; the training loop only calls the hook when one is set.
std::function<void(int64_t)> fault_hook() {
  const char* count = std::getenv("TESSERA_RESTART_COUNT");
  for (const char* name : {"TESSERA_TEST_KILL", "TESSERA_TEST_HANG"}) {
    const char* spec = std::getenv(name);
    int rank = -1, launch = -1;
    long long at = -1;
    const int fields = spec == nullptr ? 0 : std::sscanf(spec, "%d:%lld:%d", &rank, &at, &launch);
    if (fields < 2 || rank != dist::rank()) continue;
    if (fields == 3 && launch != (count == nullptr ? 0 : std::atoi(count))) continue;
    const bool kill = std::strcmp(name, "TESSERA_TEST_KILL") == 0;
    return [rank, at, kill, name](int64_t step) {
      if (step != at) return;
      std::fprintf(stderr, "rank %d: %s at step %lld (%s)\n", rank, kill ? "killing itself" : "hanging", at, name);
      std::fflush(stderr);
      if (kill) ::raise(SIGKILL);
      for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
    };
  }
  return {};
}

// The steps this process has completed, for the status a failing rank writes
// (-1 before training starts).
std::atomic<int64_t> g_steps_done{-1};
// Whether the launch has restored its checkpoint (or started afresh) and trains on.
std::atomic<bool> g_resumed{false};

// SIGINT (Ctrl-C) and SIGTERM (a scheduler's preemption notice) ask for a
// clean stop once training runs: the ranks agree at the end of the step, save
// a checkpoint when enabled, and exit with 128 + the signal. A second signal,
// or one before training starts, ends the process at once (the default action).
//
// Neither is ever delivered to a computing thread: they are blocked before
// any thread starts (MPI's, OpenMP's inherit the mask), and one thread waits
// for them with sigwait. Delivered asynchronously (a handler that only set a
// flag), a Ctrl-C landing in the middle of the AVX-512 kernels ended about one
// run in five on AVX-512 machines in heap corruption inside the next GEMM
// (tools-e2e's Ctrl-C case, at 761351b and before; not seen with AVX2 kernels).
std::atomic<int> g_stop_signal{0};
std::atomic<bool> g_training{false};
int stop_signal() {
  return g_stop_signal.load();
}
void watch_stop_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::thread([set] {
    int sig = 0;
    while (sigwait(&set, &sig) == 0) {
      if (g_training.load() && g_stop_signal.load() == 0) {
        g_stop_signal = sig;
        continue;
      }
      std::signal(sig, SIG_DFL);
      pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
      raise(sig);  // delivered to this thread: the default action ends the process
    }
  }).detach();
}

}  // namespace

double all_reduce(double v, dist::ReduceOp op, dist::ProcessGroupPtr group) {
  if (dist::world_size() == 1) return v;
  Tensor t = full({1}, v, DType::F64);
  (group ? group : dist::world())->all_reduce(t, {op})->wait();
  return t.item();
}

void Trainer::build_model() {
  const std::string device_type =
      cfg_.job.device != "auto" ? cfg_.job.device : (cuda::is_available() ? "cuda" : "cpu");
  if (cfg_.job.device == "auto" && device_type == "cpu" && cuda::install_is_broken())
    say(fmt::format("warning: job.device auto runs on the CPU: {}", cuda::unavailable_reason()));
  tools::mesh_dims(cfg_, world_);  // the degrees against the ranks, the errors naming the keys
  mesh_ = train::make_mesh(tools::parallelism_options(cfg_), device_type);  // tensor-parallel groups: consecutive ranks
  device_ = mesh_->device();
  const int64_t predicted = tools::parameter_count(cfg_);
  // nanoGPT's count, which the log and MFU use, leaves GPT-2's position table out.
  const bool positions = cfg_.model.arch == "gpt2" && !cfg_.model.rope;
  parameters_ = predicted - (positions ? T_.seq_len * cfg_.model.n_embd : 0);
  if (cfg_.parallelism.pipeline_parallel_degree > 1) {
    // This rank's stages (pp/pipeline.h), each sharded as a whole model is;
    // evaluation and samples run through the pipeline (pp::PipelinedModel).
    pipe_ = train::make_pipeline(tools::transformer_config(cfg_), mesh_, tools::parallelism_options(cfg_),
                                 static_cast<uint64_t>(cfg_.job.seed));
    model_ = std::make_shared<pp::PipelinedModel>(pipe_);
  } else {
    model_ = tools::make_model(cfg_, Device::meta());
    const int64_t built = model_->num_parameters(false);
    TS_CHECK(built == predicted, "internal: the model has {} parameters, tools::parameter_count predicted {}", built,
             predicted);
    train::parallelize(*model_, mesh_, tools::parallelism_options(cfg_));  // as the planner does (tools/plan.h)
    model_->to_empty(device_);
    model_->init_weights(static_cast<uint64_t>(cfg_.job.seed));
  }
  // PaLM's estimate (appendix B): 6N per token for the matmuls of forward and
  // backward, plus 12 * layers * width * seq_len for attention scores; N the
  // parameters a token passes through (a mixture of experts: its top-k experts).
  const int64_t active = parameters_ - (tools::parameter_count(cfg_) -
                                        tools::transformer_config(cfg_).active_parameter_count());
  flops_per_token_ = 6.0 * static_cast<double>(active) +
                     12.0 * static_cast<double>(cfg_.model.n_layer) *
                         static_cast<double>(cfg_.model.n_embd) * static_cast<double>(T_.seq_len);
}

void Trainer::build_optimizer() {
  opt_ = train::make_optimizer(*model_, tools::optimizer_options(cfg_), &adamw_);  // as the planner does
  schedule_ = train::make_schedule(tools::schedule_options(cfg_), cfg_.optimizer.lr, T_.steps);
}

// One optimizer step (train::train_step): the loss, averaged over
// micro-batches and ranks, and the gradient norm stay on the device (read at
// log steps); whether any rank was asked to stop travels in a host all-reduce
// of its own, so a step makes no host sync.
std::pair<Tensor, Tensor> Trainer::train_step(int64_t step) {
  if (pipe_) return pipeline_step(step);
  train::StepResult r = train::train_step(
      *model_, *opt_, schedule_.lr_at(step), tools::step_options(cfg_),
      [&](int64_t m) {
        // overfit_batch: the first step's micro-batches, every step.
        auto [x, y] = train_->batch((T_.overfit_batch ? 0 : step) * T_.grad_accum + m, micro_local_, dp_rank_, dp_);
        return std::pair{x.to(device_), y.to(device_)};
      },
      // Over NCCL on CUDA (the mesh's group), MPI otherwise.
      world_ == 1 ? nullptr : device_.is_cuda() ? mesh_->flat_group() : dist::world());
  if (!r.routing.empty()) {
    double worst = 1;
    for (const nn::RoutingStats& layer : r.routing) worst = std::max(worst, layer.max_over_mean());
    window_imbalance_ += worst;
    ++window_routed_steps_;
    last_routing_ = std::move(r.routing);
  }
  stop_requested_ = agree_to_stop();
  return {r.loss, r.grad_norm};
}

// On a group of its own: on the world group it would queue behind the loss
// all-reduce, which starts only when the device has computed the loss.
bool Trainer::agree_to_stop() {
  if (world_ > 1 && !control_group_) control_group_ = dist::world()->split(0, rank_, "control");
  return all_reduce(stop_signal() != 0 ? 1.0 : 0.0, dist::ReduceOp::Max, control_group_) > 0;
}

// A pipelined step (pp/pipeline.h): this data-parallel rank's rows through
// the schedule's micro-batches, the loss averaged over the data-parallel
// ranks (every stage's rank holds it), the norm clipped over every stage.
std::pair<Tensor, Tensor> Trainer::pipeline_step(int64_t step) {
  opt_->set_lr(schedule_.lr_at(step));
  auto [x, y] = train_->batch(T_.overfit_batch ? 0 : step, micro_local_, dp_rank_, dp_);
  Tensor loss = ops::reshape(pipe_->step(x.to(device_), y.to(device_)), {1});
  if (world_ > 1) dist::world()->all_reduce(loss, {dist::ReduceOp::Avg})->wait();
  Tensor norm = pipe_->clip_grad_norm_(T_.max_norm);
  opt_->step();
  opt_->zero_grad();
  stop_requested_ = agree_to_stop();
  return {loss, norm};
}

double Trainer::read_losses() {
  if (pending_losses_.empty()) return last_loss_;
  TensorList values;
  for (auto& [step, loss] : pending_losses_) values.push_back(loss);
  std::vector<double> host = ops::cat(values).to_vector<double>();  // the one host sync
  for (size_t i = 0; i < host.size(); ++i) {
    int64_t step = pending_losses_[i].first;
    TS_CHECK(std::isfinite(host[i]), "training diverged at step {}: loss is {}", step, host[i]);
    curve_.train.emplace_back(step, host[i]);
  }
  pending_losses_.clear();
  last_loss_ = host.back();
  return last_loss_;
}

double Trainer::evaluate() {
  autograd::NoGradGuard no_grad;
  model_->eval();
  double total = 0;
  for (int64_t i = 0; i < T_.eval_batches; ++i) {
    if (agree_to_stop()) {  // a long evaluation ends at a stop signal, not after it
      stop_requested_ = true;
      model_->train();
      return NAN;
    }
    auto [x, y] = val_->eval_batch(i, micro_global_);  // the same windows at any world size
    Tensor lx = ops::contiguous(ops::narrow(x, 0, dp_rank_ * micro_local_, micro_local_)).to(device_);
    Tensor ly = ops::contiguous(ops::narrow(y, 0, dp_rank_ * micro_local_, micro_local_)).to(device_);
    total += train::loss(*model_, lx, ly).item();  // under context parallelism this rank's slice, weighed
  }
  model_->train();
  return all_reduce(total / static_cast<double>(T_.eval_batches), dist::ReduceOp::Avg);
}

void Trainer::open_outputs() {
  const auto& M = cfg_.metrics;
  progress_ = std::make_unique<tools::Progress>(T_.steps, rank_ == 0 ? M.progress : "off",
                                                dist::launched());
  if (rank_ == 0) fs::create_directories(cfg_.job.dump_folder);
  jsonl_ = std::make_unique<tools::JsonlWriter>(
      rank_ == 0 && !M.jsonl.empty() ? out_path(cfg_, M.jsonl) : "", cfg_.checkpoint.resume);
  if (rank_ == 0) {
    // The resolved configuration: the run folder's config.toml (what
    // --config reads back) and the metrics' first record (on resume, the
    // record where the continuation starts).
    std::ofstream(fs::path(cfg_.job.dump_folder) / "config.toml") << tools::to_toml(cfg_);
    json settings = json::object();
    for (const auto& k : tools::config_keys(cfg_)) settings[k.name] = k.get();
    jsonl_->write(json{{"config", settings}}.dump());
  }
}

void Trainer::prepare_data() {
  micro_global_ = T_.batch_size / T_.grad_accum;
  micro_local_ = micro_global_ / dp_;
  if (!T_.tokenizer.empty()) {
    tokenizer_ = io::BpeTokenizer::load(T_.tokenizer);
    TS_CHECK(cfg_.model.vocab_size >= tokenizer_->vocab_size(),
             "model.vocab_size ({}) is smaller than the vocabulary of training.tokenizer {} ({} "
             "tokens): set --model.vocab_size {} (or more, e.g. a multiple of 64)",
             cfg_.model.vocab_size, T_.tokenizer, tokenizer_->vocab_size(), tokenizer_->vocab_size());
    tokenizer_record_ = {{"fingerprint", io::file_fingerprint(T_.tokenizer)},
                         {"vocab_size", tokenizer_->vocab_size()}};
    // A copy in the run folder, where tessera-generate looks for it.
    fs::path copy = fs::path(cfg_.job.dump_folder) / "tokenizer.json";
    if (rank_ == 0 && (!fs::exists(copy) || !fs::equivalent(copy, T_.tokenizer)))
      fs::copy_file(T_.tokenizer, copy, fs::copy_options::overwrite_existing);
  }
  auto [train_tokens, val_tokens] = load_data(cfg_, tokenizer_ ? &*tokenizer_ : nullptr);
  for (auto [split, toks] : {std::pair{"training", &train_tokens}, {"validation", &val_tokens}}) {
    TS_CHECK(static_cast<int64_t>(toks->size()) > T_.seq_len + 1,
             "training.seq_len ({}) needs more than {} tokens (windows of {}), but the {} data ({}) has only {}",
             T_.seq_len, T_.seq_len + 1, T_.seq_len + 1, split, T_.dataset, toks->size());
    for (uint16_t t : *toks)
      TS_CHECK(t < cfg_.model.vocab_size,
               "token {} in the {} data ({}) is outside model.vocab_size {}", t, split, T_.dataset,
               cfg_.model.vocab_size);
  }
  baseline_ = io::unigram_baseline(train_tokens, val_tokens, cfg_.model.vocab_size);
  train_ = std::make_unique<io::Loader>(std::move(train_tokens), T_.seq_len,
                                          static_cast<uint64_t>(cfg_.job.seed));
  val_ = std::make_unique<io::Loader>(std::move(val_tokens), T_.seq_len,
                                        static_cast<uint64_t>(cfg_.job.seed));
  curve_.baseline = baseline_;
  // Evaluation reads the validation split's windows in order and wraps
  // around past the last: more batches than windows read windows again.
  const int64_t windows = (val_->num_tokens() - 1) / T_.seq_len;
  if (T_.eval_batches * micro_global_ > windows)
    say(fmt::format("note: training.eval_batches {} x {} sequences read {} windows, but the validation split has "
                    "{} of training.seq_len {}: evaluation reads some more than once ({} batch{} read{} each once)",
                    T_.eval_batches, micro_global_, T_.eval_batches * micro_global_, windows, T_.seq_len,
                    std::max<int64_t>(1, windows / micro_global_), windows / micro_global_ > 1 ? "es" : "",
                    windows / micro_global_ > 1 ? "" : "s"));
}

namespace {
// job.bind_cores: this rank's threads (MPI's included) on cores of its own
// when the node's ranks fit them (tools::rank_cpus).
void bind_rank_to_cores() {
  const std::vector<int> cpus = tools::rank_cpus(dist::local_rank(), dist::local_size(), num_threads());
  if (!cpus.empty()) pin_process_to(cpus);
}

}  // namespace

void Trainer::run_step(int64_t step, int64_t start, Clock::time_point run_start) {
  const auto& M = cfg_.metrics;
  bool tracing = std::find(trace_steps_.begin(), trace_steps_.end(), step + 1) != trace_steps_.end();
  if (tracing) trace::enable(true);
  int64_t syncs_before = host_sync_count();
  auto [step_loss, gnorm] = train_step(step);
  pending_losses_.emplace_back(step + 1, step_loss);
  bool last = step + 1 == T_.steps;
  bool log_step = (step + 1) % M.log_interval == 0 || last || step == start;
  // Off the host the losses are read at log steps only (one sync); on the
  // CPU reading is free, so the progress bar and the divergence check see every step.
  double loss = log_step || device_.is_host_visible() ? read_losses() : last_loss_;
  if (!log_step) window_syncs_ += host_sync_count() - syncs_before;
  if (tracing) write_trace(step);
  window_tokens_ += T_.batch_size * T_.seq_len;
  if (((step + 1) % T_.eval_interval == 0 || last) && !stop_requested_) {
    double val = NAN;
    outside_window([&] { val = evaluate(); });
    if (!stop_requested_) {  // else the evaluation was cut short: nothing to record
      last_val_ = val;
      curve_.val.emplace_back(step + 1, last_val_);
      if (rank_ == 0) jsonl_->write(json{{"step", step + 1}, {"val_loss", last_val_}}.dump());
    }
  }
  if (log_step) {
    log_line(step + 1, loss, schedule_.lr_at(step), gnorm.item());  // read at log steps only
  } else if (rank_ == 0) {
    double elapsed = seconds_since(run_start);
    double done = static_cast<double>(step + 1 - start);
    progress_->update(step + 1, loss, done * static_cast<double>(T_.batch_size * T_.seq_len) / elapsed,
                      elapsed / done * static_cast<double>(T_.steps - step - 1));
  }
  if (cfg_.sample.interval > 0 && (step + 1) % cfg_.sample.interval == 0 && !last && !stop_requested_)
    outside_window([&] { sample(fmt::format("step {}", step + 1)); });
  bool checkpoint_due = (step + 1) % cfg_.checkpoint.interval == 0 || last;
  if (cfg_.checkpoint.enable && (checkpoint_due || stop_requested_)) outside_window([&] { save(step + 1); });
  else poll_checkpoint();  // an asynchronous save commits once every rank has written it
}

int Trainer::stop_early(int64_t step) {
  read_losses();
  wait_checkpoint();
  progress_->finish();
  say(fmt::format("interrupted (SIGINT/SIGTERM) after step {}: {}", step + 1,
                  cfg_.checkpoint.enable ? "checkpoint saved; continue with --checkpoint.resume true"
                                         : "nothing saved (checkpoint.enable is false)"));
  int sig = stop_signal() != 0 ? stop_signal() : SIGTERM;
  const char* name = sig == SIGINT ? "SIGINT" : "SIGTERM";
  say(fmt::format("status: interrupted by {} after step {} (exit {}{})", name, step + 1, 128 + sig,
                  cfg_.checkpoint.enable ? "; checkpoint saved" : ""));
  if (rank_ == 0)
    write_status(cfg_, {{"status", "interrupted"},
                        {"signal", name},
                        {"exit_code", 128 + sig},
                        {"step", step + 1},
                        {"steps", T_.steps},
                        {"checkpoint_saved", cfg_.checkpoint.enable}});
  return 128 + sig;
}

int Trainer::run() {
  if (rank_ == 0) write_status(cfg_, {{"status", "running"}, {"steps", T_.steps}});
  open_outputs();
  prepare_data();
  build_model();
  build_optimizer();
  find_peak();  // on every core the node's ranks use, before they keep to their own
  if (cfg_.job.bind_cores) bind_rank_to_cores();
  report_setup();
  trace_steps_ = tools::trace_steps(cfg_);
  int64_t start = restore_or_start();
  g_resumed = true;  // the run continues: its records are this launch's from here on
  g_steps_done = start;
  if (cfg_.checkpoint.enable && cfg_.checkpoint.async_mode == "async") prepare_async_checkpoints();
  if (cfg_.job.max_restarts > 0 && std::getenv("TESSERA_RESTART_COUNT") == nullptr)
    say(fmt::format("job.max_restarts {}: restarts are tessera-run's (tessera-run --np N -- <these options>); "
                    "launched without it, this run makes none",
                    cfg_.job.max_restarts));
  auto run_start = Clock::now();
  window_start_ = run_start;
  window_wait_start_ = dist::total_wait_seconds();
  std::function<void(int64_t)> test_hook = fault_hook();  // unset outside tests
  for (int64_t step = start; step < T_.steps; ++step) {
    if (test_hook) test_hook(step);
    run_step(step, start, run_start);
    g_steps_done = step + 1;
    // The status says how far the run got, for tessera-run to name the step
    // a failure cost (a rename, microseconds).
    if (rank_ == 0) write_status(cfg_, {{"status", "running"}, {"step", step + 1}, {"steps", T_.steps}});
    if (stop_requested_) return stop_early(step);
  }
  wait_checkpoint();  // the run's last save complete before the run is
  finish(seconds_since(run_start), start);
  say("status: completed (exit 0)");
  if (rank_ == 0)
    write_status(cfg_,
                 {{"status", "completed"}, {"exit_code", 0}, {"step", T_.steps}, {"steps", T_.steps}});
  return 0;
}

int Trainer::evaluate_only() {
  if (rank_ == 0) write_status(cfg_, {{"status", "running"}, {"eval_only", true}});
  cfg_.checkpoint.enable = false;  // nothing of this run is saved
  open_outputs();
  prepare_data();
  build_model();
  std::string weights = cfg_.checkpoint.initial_load_path;
  if (cfg_.checkpoint.resume) {
    const std::string folder = out_path(cfg_, cfg_.checkpoint.folder);
    weights = checkpoint_to_resume(folder);
    TS_CHECK(!weights.empty(), "--eval-only --checkpoint.resume true: {} has no complete checkpoint", folder);
  }
  TS_CHECK(!weights.empty(), "--eval-only evaluates given weights: pass --checkpoint.initial_load_path (a checkpoint "
           "folder, one step's directory or a .safetensors file) or --checkpoint.resume true (the run folder's "
           "latest checkpoint, or checkpoint.load_step's)");
  load_initial_weights(weights);
  const auto t0 = Clock::now();
  const double loss = evaluate();
  if (stop_requested_) {  // cut short by SIGINT/SIGTERM: no loss to report
    const int sig = stop_signal() != 0 ? stop_signal() : SIGTERM;
    const char* name = sig == SIGINT ? "SIGINT" : "SIGTERM";
    progress_->finish();
    say(fmt::format("status: evaluation interrupted by {} (exit {})", name, 128 + sig));
    if (rank_ == 0)
      write_status(cfg_, {{"status", "interrupted"}, {"signal", name}, {"exit_code", 128 + sig}, {"eval_only", true}});
    return 128 + sig;
  }
  const int64_t tokens = T_.eval_batches * micro_global_ * T_.seq_len;
  const double gain = 100.0 * (baseline_ - loss) / baseline_;
  say(fmt::format("evaluation of {}: validation loss {:.4f} over {} tokens ({} batches of {} x {}) in {} | unigram "
                  "baseline {:.4f} ({:.1f}% {})",
                  weights, loss, tokens, T_.eval_batches, micro_global_, T_.seq_len,
                  tools::format_duration(seconds_since(t0)), baseline_, std::abs(gain), gain >= 0 ? "lower" : "higher"));
  if (rank_ == 0) {
    jsonl_->write(json{{"eval_only",
                        {{"weights", weights},
                         {"val_loss", loss},
                         {"tokens", tokens},
                         {"unigram_baseline", baseline_},
                         {"ranks", world_}}}}
                      .dump());
    write_status(cfg_, {{"status", "completed"}, {"exit_code", 0}, {"eval_only", true}, {"val_loss", loss}});
  }
  progress_->finish();
  return 0;
}

void Trainer::finish(double total_s, int64_t start) {
  if (T_.steps > 0 && !curve_.train.empty()) {
    double gain = 100.0 * (baseline_ - last_val_) / baseline_;
    // A resumed run says how many of the steps were its own (the time is its own).
    say(fmt::format(
        "done: {} steps{} in {} | validation loss {:.4f} vs unigram baseline {:.4f} ({:.1f}% {})", T_.steps,
        start > 0 ? fmt::format(" ({} in this run, resumed at step {})", T_.steps - start, start) : "",
        tools::format_duration(total_s), last_val_, baseline_, std::abs(gain),
        gain >= 0 ? "lower" : "higher: not learning yet"));
  }
  if (!cfg_.checkpoint.export_safetensors.empty()) {
    std::string path = out_path(cfg_, cfg_.checkpoint.export_safetensors);
    if (rank_ == 0 && fs::path(path).has_parent_path())
      fs::create_directories(fs::path(path).parent_path());
    std::map<std::string, std::string> meta{{"format", "pt"}, {"tessera_model", tools::model_to_json(cfg_)}};
    if (!tokenizer_record_.is_null()) meta["tessera_tokenizer"] = tokenizer_record_.dump();
    fsdp::save_safetensors(*model_, path, meta, tools::dtype_of(cfg_.checkpoint.export_dtype));
    say(fmt::format("exported the model to {} ({})", path, cfg_.checkpoint.export_dtype));
  }
  if (rank_ == 0) {
    if (!cfg_.metrics.plot.empty() && !curve_.train.empty()) {
      std::string png = out_path(cfg_, cfg_.metrics.plot);
      std::string title = cfg_.job.name;
      std::replace(title.begin(), title.end(), '\'', ' ');
      std::string why = tools::plot_loss_png(curve_, png, title + ": loss");
      say(why.empty() ? fmt::format("loss curve -> {}", png) : fmt::format("note: {}", why));
    }
    jsonl_->write(json{{"summary",
                        {{"steps", T_.steps},
                         {"seconds", total_s},
                         {"final_loss", curve_.train.empty() ? NAN : curve_.train.back().second},
                         {"val_loss", last_val_},
                         {"unigram_baseline", baseline_},
                         {"ranks", world_}}}}
                      .dump());
  }
  if (cfg_.sample.max_new_tokens > 0) sample("");
  progress_->finish();
}

// Every rank runs the same forward passes (FSDP gathers collectively) and
// draws the same tokens from the same seed; rank 0 prints them.
void Trainer::sample(const std::string& when) {
  if (cfg_.sample.max_new_tokens <= 0) return;
  const io::BpeTokenizer* tokenizer = tokenizer_ ? &*tokenizer_ : nullptr;
  std::vector<int64_t> prompt = io::prompt_tokens(tokenizer, cfg_.sample.prompt);
  if (rank_ == 0) {
    progress_->finish();
    std::printf("\n--- sample%s (temperature %.2f, top-k %lld) ---\n%s", when.empty() ? "" : (" at " + when).c_str(),
                cfg_.sample.temperature, static_cast<long long>(cfg_.sample.top_k), cfg_.sample.prompt.c_str());
  }
  // Context parallelism: every rank generates the whole sequence (attention
  // over it alone, no K/V exchanged); the slices come back after.
  nn::WholeSequences whole({model_.get()});
  // A stop signal ends a long sample at the next token (every rank asks, together).
  bool stopped = false;
  auto stop = [&] { return stopped = stopped || agree_to_stop(); };
  nn::generate(*model_, prompt,
               {cfg_.sample.max_new_tokens, cfg_.sample.temperature, cfg_.sample.top_k,
                static_cast<uint64_t>(cfg_.job.seed), stop},
               [&](int64_t t) {
                 if (rank_ != 0) return;
                 const std::string text = io::token_text(tokenizer, t);
                 std::fwrite(text.data(), 1, text.size(), stdout);
                 std::fflush(stdout);
               });
  if (stopped) stop_requested_ = true;
  if (rank_ == 0) std::printf("\n---%s\n", stopped ? " (stopped by a signal)" : "");
}

namespace {

// OpenMP/BLAS threads per rank: the cores of this node shared by its ranks,
// unless OMP_NUM_THREADS says otherwise.
void set_threads_per_rank() {
  if (std::getenv("OMP_NUM_THREADS") != nullptr) return;  // OpenMP already took it
  set_num_threads(tools::threads_per_rank(dist::local_size()));
}

}  // namespace

}  // namespace tessera::tools

using namespace tessera::tools;

int main(int argc, char** argv) {
  tools::TrainConfig cfg;
  bool args_read = false, parsed = false, eval_only_launch = false, folder_taken = false;
  std::optional<tools::RecordsBefore> records_before;
  watch_stop_signals();  // before any other thread starts
  try {
    dist::init(argc, argv);
    set_threads_per_rank();
    // --dry-run: print the plan of this rank (tools/plan.h) and exit;
    // --print-config: print the resolved configuration (TOML) and exit.
    bool dry_run = false, print_config = false, eval_only = false;
    std::vector<char*> args;
    for (int i = 0; i < argc; ++i) {
      if (i > 0 && std::strcmp(argv[i], "--dry-run") == 0) dry_run = true;
      else if (i > 0 && std::strcmp(argv[i], "--print-config") == 0) print_config = true;
      else if (i > 0 && std::strcmp(argv[i], "--eval-only") == 0) eval_only = eval_only_launch = true;
      else args.push_back(argv[i]);
    }
    int nargs = static_cast<int>(args.size());
    // Every rank parses the same arguments; only rank 0 reports a mistake.
    if (!tools::parse_args(cfg, nargs, args.data(), "tessera-train", dist::rank() == 0)) {
      if (dist::rank() == 0)
        std::printf("\n  --dry-run        print the plan (tessera-plan) for this launch and exit\n"
                    "  --print-config   print the resolved configuration (TOML, as --config reads it) and exit\n"
                    "  --eval-only      the validation loss of checkpoint.initial_load_path's weights (or, with\n"
                    "                   checkpoint.resume, the run's checkpoint); no training\n");
      return 0;
    }
    args_read = true;
    tools::validate(cfg);
    if (print_config) {  // the settings alone (any launch may run them)
      if (dist::rank() == 0) std::fputs(tools::to_toml(cfg).c_str(), stdout);
      return 0;
    }
    tools::validate_for_world(cfg, dist::world_size());
    if (dry_run) {
      if (dist::rank() == 0) {
        std::fputs(tools::format_plan(tools::plan_run(cfg, dist::world_size(), 0), cfg).c_str(), stdout);
        if (cfg.parallelism.pipeline_parallel_degree > 1)
          std::fputs(tools::format_stage_plans(tools::plan_stage_positions(cfg, dist::world_size())).c_str(), stdout);
      }
      return 0;
    }
    const bool on_cuda = cfg.job.device == "cuda" || (cfg.job.device == "auto" && cuda::is_available());
    if (on_cuda) {
      // Each rank has a GPU of its own: planned as a GPU computes (native
      // bf16) and NCCL reduces (no staging buffers), against its free memory.
      // (Without a GPU, building the mesh says why, below.)
      tools::PlanAsGpu as_gpu;
      const int gpu = dist::local_rank() % std::max(1, cuda::device_count());
      if (cuda::is_available()) tools::check_planned_memory(cfg, dist::world_size(), 1, cuda::free_memory(gpu));
    } else {
      // The plan (with its table) first; a model so deep that even planning it
      // takes long (milliseconds a block) is refused on the lower bound alone.
      const double available = tools::available_host_memory();
      const bool deep = cfg.model.n_layer > 128;
      if (deep) tools::check_memory(cfg, dist::world_size(), dist::local_size(), available);
      tools::check_planned_memory(cfg, dist::world_size(), dist::local_size(), available);
      if (!deep) tools::check_memory(cfg, dist::world_size(), dist::local_size(), available);
    }
    if (eval_only) {
      // An evaluation writes records of its own: in its folder, or where that
      // holds a run's (a status.json), in <folder>/eval-<k>/, the run's files
      // left as they were; it finds a resumed run's checkpoint where the run left it.
      cfg.checkpoint.folder = fs::absolute(out_path(cfg, cfg.checkpoint.folder)).string();
      const fs::path folder = cfg.job.dump_folder;
      const int64_t k = rank0s(fs::exists(folder / "status.json") ? first_free(folder, "eval-") : 0);
      if (k > 0) cfg.job.dump_folder = (folder / fmt::format("eval-{}", k)).string();
      check_output_paths(cfg);
    } else {
      check_output_paths(cfg);
      folder_taken = true;
      refuse_other_runs_checkpoints(cfg);
      lock_run_folder(cfg);
      folder_taken = false;
      keep_earlier_records(cfg);
    }
    // A resume that fails before it trains leaves the run's records as they were.
    if (!eval_only && cfg.checkpoint.resume) records_before.emplace(cfg);
    parsed = true;
    g_training = true;
    Trainer trainer(cfg);
    return eval_only ? trainer.evaluate_only() : trainer.run();
  } catch (const std::exception& caught) {
    // Out of memory anyway (the up-front floor is only a lower bound): say so,
    // rather than "std::bad_alloc".
    Error oom(fmt::format("out of host memory (std::bad_alloc): this run needs more than the node "
                          "has ({:.1f} GiB available now); use fewer or smaller "
                          "settings (model.n_layer, model.n_embd, training.batch_size / "
                          "training.grad_accum) or more nodes",
                          tools::available_host_memory() / 1073741824.0));
    const std::exception& e = dynamic_cast<const std::bad_alloc*>(&caught) ? oom : caught;
    if (!parsed) {
      if (dist::rank() == 0) {
        std::fprintf(stderr, "tessera-train: error: %s\n", e.what());
        // A launch refused before it ran anything moves and rewrites nothing:
        // no folder is created, and in an existing one (named by arguments
        // that were all read) the status says this launch failed and keeps
        // the one it replaces under "previous" (a run's "completed", say).
        std::error_code ec;
        if (args_read && !eval_only_launch && !folder_taken && fs::is_directory(cfg.job.dump_folder, ec))
          write_status(cfg, refused_status(cfg, e.what()));
      }
      return 2;
    }
    std::string msg = fmt::format("error: {}", e.what());
    // Any rank that fails says so in the status file (rank 0 may be the one aborted).
    json failed = {{"status", "failed"}, {"exit_code", 1}, {"rank", dist::rank()}, {"error", e.what()}};
    if (g_steps_done >= 0) failed["step"] = g_steps_done.load();
    if (records_before && !g_resumed) records_before->restore(e.what());
    else write_status(cfg, failed);
    if (dist::world_size() > 1) dist::abort("tessera-train: " + msg, 1);  // ends every rank
    std::fprintf(stderr, "tessera-train: %s\n", msg.c_str());
    return 1;
  }
}
