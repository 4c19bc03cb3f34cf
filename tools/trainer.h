// tessera-train's Trainer, shared by the program's two files: tools/train.cpp
// (the run: model, data, steps, logs, samples, main) and
// tools/train_checkpoint.cpp (saving, resuming a saved run, initial weights).
// Internal to tessera-train; not installed.
#pragma once

#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dtensor/dtensor.h"
#include "fsdp/checkpoint.h"
#include "io/data.h"
#include "io/tokenizer.h"
#include "nn/models.h"
#include "nn/optim.h"
#include "pp/pipeline.h"
#include "tools/config.h"
#include "tools/report.h"
#include "tools/run_folder.h"

namespace tessera::tools {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// `v` reduced over `group`'s ranks (the world's by default), on the host.
double all_reduce(double v, dist::ReduceOp op, dist::ProcessGroupPtr group = nullptr);

class Trainer {
 public:
  explicit Trainer(tools::TrainConfig cfg)
      : cfg_(std::move(cfg)),
        T_(cfg_.training),
        tp_(cfg_.parallelism.tensor_parallel_degree),
        dp_(tools::data_parallel_ranks(cfg_, world_)),
        // The mesh: pp outermost, then the data dims, cp, tp innermost; the
        // ranks of a cp x tp group train on the same rows.
        dp_rank_((rank_ / (tp_ * cfg_.parallelism.context_parallel_degree)) % dp_),
        allowed_(tools::split_list(cfg_.checkpoint.allow_resume_change)) {}
  int run();
  // --eval-only: the validation loss of given weights (no training, nothing saved).
  int evaluate_only();

 private:
  void build_model();
  void build_optimizer();
  int64_t resume(const std::string& dir);
  void check_resume_config(const std::string& dir, const json& extra, int64_t step);
  void load_initial_weights(const std::string& path);
  // Refuses weights with NaN or infinite values (every rank learns the total,
  // so none goes on to a collective alone): a run from them diverges at its
  // first step, and a sample is noise.
  void check_weights_finite(const std::string& source);
  void save(int64_t step);
  void open_outputs();
  void prepare_data();
  void find_peak();
  void report_setup();
  std::string layout() const;
  std::pair<Tensor, Tensor> pipeline_step(int64_t step);
  int64_t restore_or_start();  // resume, initial weights or step 0; returns the first step
  void run_step(int64_t step, int64_t start, Clock::time_point run_start);
  void write_trace(int64_t step);
  int stop_early(int64_t step);  // after a SIGINT/SIGTERM: the exit code
  std::pair<Tensor, Tensor> train_step(int64_t step);  // (loss, gradient norm), on the device
  // Reads the losses of the steps since the last read (one host sync) into
  // the curve; throws if any is not finite. Returns the newest.
  double read_losses();
  // The mean validation loss over training.eval_batches, or NaN when a stop
  // signal came first (stop_requested_ is then set): every rank checks before
  // each batch, together.
  double evaluate();
  // Whether any rank was asked to stop (SIGINT/SIGTERM): a host all-reduce on
  // the control group, which every rank makes at the same point.
  bool agree_to_stop();
  void log_line(int64_t step, double loss, double lr, double gnorm);
  void finish(double total_s, int64_t start);  // start: the first step this run trained
  void sample(const std::string& when);
  std::string checkpoint_to_resume(const std::string& folder);  // "" at the end, else e.g. "step 100"
  json extra_state(int64_t step);
  void say(const std::string& text) {
    if (rank_ == 0) progress_->line(text);
  }

  tools::TrainConfig cfg_;
  const tools::TrainConfig::Training& T_;
  int rank_ = dist::rank(), world_ = dist::world_size();
  // Tensor parallelism: groups of tp_ consecutive ranks train on the same rows
  // (data-parallel rank dp_rank_ of dp_).
  int64_t tp_ = 1, dp_ = 1, dp_rank_ = 0;
  MeshPtr mesh_;
  Device device_ = Device::cpu();  // job.device
  dist::ProcessGroupPtr control_group_;  // host-only agreements (stop requests) beside the device's collectives
  std::shared_ptr<nn::LanguageModel> model_;  // pipelined: a pp::PipelinedModel over pipe_
  std::shared_ptr<pp::Pipeline> pipe_;        // parallelism.pipeline_parallel_degree > 1
  int64_t parameters_ = 0;                    // the whole model's, as nanoGPT counts (no position table)
  std::unique_ptr<optim::Optimizer> opt_;
  optim::AdamW* adamw_ = nullptr;
  std::unique_ptr<fsdp::AsyncCheckpointer> async_ckpt_;  // checkpoint.async_mode async
  // The asynchronous save's commit, once every rank's writer is done (collective; every step).
  void poll_checkpoint();
  void prepare_async_checkpoints();
  void wait_checkpoint();  // the end of the run: the pending save committed
  optim::LRSchedule schedule_;
  std::unique_ptr<io::Loader> train_, val_;
  std::optional<io::BpeTokenizer> tokenizer_;  // training.tokenizer, if set
  // What the checkpoints and the exported file record of it (tessera-generate
  // refuses to read their ids as byte tokens): {"fingerprint", "vocab_size"}.
  json tokenizer_record_;
  double baseline_ = 0;
  int64_t micro_global_ = 0, micro_local_ = 0;
  std::unique_ptr<tools::Progress> progress_;
  std::unique_ptr<tools::JsonlWriter> jsonl_;
  tools::LossCurve curve_;
  double flops_per_token_ = 0;
  double peak_flops_ = 0;  // MFU's denominator (0: none known, MFU not reported)
  std::string peak_how_;
  bool peak_raised_ = false;  // the rate reached exceeded the peak (log_line)
  // The current log window.
  Clock::time_point window_start_;
  int64_t window_tokens_ = 0;
  double window_wait_start_ = 0;
  double excluded_s_ = 0, excluded_wait_s_ = 0;  // evaluation, checkpoints, traces in this window
  double last_val_ = NAN;
  bool stop_requested_ = false;       // SIGINT/SIGTERM on any rank: save and stop after this step
  std::vector<std::pair<int64_t, Tensor>> pending_losses_;  // (step, loss on the device), not read yet
  double last_loss_ = NAN;
  int64_t window_syncs_ = 0;  // host syncs made by the steps between two log steps (0 expected)
  // Mixtures of experts: each step's tokens per expert (per MoE layer, summed
  // over the data ranks), the last step's kept, and the window's mean of the
  // step's worst layer's max / mean load.
  std::vector<nn::RoutingStats> last_routing_;
  double window_imbalance_ = 0;
  int64_t window_routed_steps_ = 0;
  std::vector<int64_t> trace_steps_;  // profiling.trace_steps
  std::vector<std::string> allowed_;  // checkpoint.allow_resume_change: exactness keys that may differ
  bool rng_restored_ = false;         // resume took every rank's saved dropout stream

  // Runs fn outside the throughput window: its time and its waits on
  // collectives count in neither tokens/s nor exposed communication.
  template <class Fn>
  void outside_window(Fn&& fn) {
    auto t0 = Clock::now();
    double w0 = dist::total_wait_seconds();
    fn();
    excluded_s_ += seconds_since(t0);
    excluded_wait_s_ += dist::total_wait_seconds() - w0;
  }
};

}  // namespace tessera::tools
