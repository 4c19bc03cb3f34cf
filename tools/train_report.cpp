// What a training run reports: the setup lines (the model, the mesh, the
// data, MFU's peak, a pipeline's stages), each log line and its JSONL
// record, and the traces of the profiled steps (tools/trainer.h).
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <thread>

#include "runtime/allocator.h"
#include "runtime/distributed.h"
#include "runtime/parallel.h"
#include "runtime/trace.h"
#include "tools/plan.h"
#include "tools/trainer.h"

namespace tessera::tools {

namespace fs = std::filesystem;

namespace {
// " (rank 0 on CPU 0)" when this rank is kept to some of the machine's CPUs.
std::string cpus_note() {
  const std::vector<int> cpus = allowed_cpus();
  if (cpus.empty() || cpus.size() >= std::max(1u, std::thread::hardware_concurrency())) return "";
  return fmt::format(" (rank {} on CPU {})", dist::rank(), fmt::join(cpus, ","));
}
}  // namespace

void Trainer::log_line(int64_t step, double loss, double lr, double gnorm) {
  double window = seconds_since(window_start_) - excluded_s_;
  double waited = dist::total_wait_seconds() - window_wait_start_ - excluded_wait_s_;
  // Every rank takes part: peak memory and exposed communication are maxima over ranks.
  double peak_mib =
      all_reduce(static_cast<double>(memory_stats(device_).peak_allocated_bytes) / 1048576.0, dist::ReduceOp::Max);
  double exposed = all_reduce(100.0 * waited / window, dist::ReduceOp::Max);
  double syncs = all_reduce(static_cast<double>(window_syncs_), dist::ReduceOp::Max);
  window_syncs_ = 0;
  double tok_s = static_cast<double>(window_tokens_) / window;
  // A peak below the rate the step reached is wrong (measured while the
  // machine was busy, or given too low): MFU is never shown above 100%; the
  // peak is raised to that rate, and the log says so once.
  const double achieved = tok_s * flops_per_token_;
  bool raised = false;
  if (peak_flops_ > 0 && achieved > peak_flops_) {
    if (rank_ == 0 && !peak_raised_)
      say(fmt::format("note: this run reached {:.4g} TFLOP/s, above the peak MFU was taken against ({:.4g} TFLOP/s, "
                      "{}): that peak is wrong, and MFU is now against the rate reached",
                      achieved / 1e12, peak_flops_ / 1e12, peak_how_));
    peak_flops_ = achieved;
    peak_raised_ = raised = true;
  }
  // (At most 100: the peak was raised to the rate reached where it was below; the min only drops rounding.)
  double mfu = peak_flops_ > 0 ? std::min(100.0, 100.0 * achieved / peak_flops_) : std::nan("");
  // Mixtures of experts: the steps' worst layer's max / mean tokens per expert, averaged over the window.
  const double imbalance = window_routed_steps_ > 0 ? window_imbalance_ / static_cast<double>(window_routed_steps_) : NAN;
  window_imbalance_ = 0;
  window_routed_steps_ = 0;
  if (rank_ == 0) {
    say(fmt::format(
        "step {:>5}/{} | loss {:.4f} | val {} | lr {:.2e} | grad norm {:.3f} | {:.0f} tok/s "
        "({:.0f}/rank) | MFU {} | peak mem {:.1f} MiB/rank | exposed comm {:.1f}%{}",
        step, T_.steps, loss, std::isnan(last_val_) ? "-     " : fmt::format("{:.4f}", last_val_),
        lr, gnorm, tok_s, tok_s / world_, std::isnan(mfu) ? "-" : fmt::format("{:.1f}%", mfu), peak_mib, exposed,
        std::isnan(imbalance) ? "" : fmt::format(" | experts max/mean {:.2f}", imbalance)));
    json moe = json::object();
    if (!std::isnan(imbalance)) {
      json loads = json::array();
      for (const nn::RoutingStats& layer : last_routing_) loads.push_back(layer.tokens_per_expert);
      moe = {{"moe_max_over_mean", imbalance}, {"moe_tokens_per_expert", loads}};
    }
    json record{
        {"step", step},
        {"loss", loss},
        {"lr", lr},
        {"grad_norm", gnorm},
        {"tokens_per_s", tok_s},
        {"tokens_per_s_per_rank", tok_s / world_},
        {"mfu_pct", mfu},
        {"mfu_peak_raised", raised},
        {"peak_mem_mib_max_rank", peak_mib},
        {"exposed_comm_pct_max_rank", exposed},
        {"host_syncs_between_logs_max_rank", syncs},
        {"ranks", world_}};
    record.update(moe);
    jsonl_->write(record.dump());
  }
  window_start_ = Clock::now();
  window_tokens_ = 0;
  window_wait_start_ = dist::total_wait_seconds();
  excluded_s_ = excluded_wait_s_ = 0;
}

// MFU's denominator: metrics.peak_tflops, or where it is 0 (the default) on
// CPU ranks, this CPU's peak for the run's products, measured by each node's
// first rank on as many threads as the node's ranks use while the other
// ranks sleep (their own work would take the cores), summed over nodes.
// On a GPU nothing is measured: MFU is reported only with metrics.peak_tflops.
void Trainer::find_peak() {
  if (cfg_.metrics.peak_tflops > 0) {
    peak_flops_ = cfg_.metrics.peak_tflops * 1e12;
    peak_how_ = "metrics.peak_tflops";
    return;
  }
  if (device_.is_cuda()) {
    peak_how_ = "no peak for a GPU: set metrics.peak_tflops";
    return;
  }
  double mine = 0;
  std::string unit;
  if (dist::local_rank() == 0)
    mine = tools::node_peak_flops(cfg_.mixed_precision.param_dtype, dist::local_size(), num_threads(), &unit);
  else
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  peak_flops_ = all_reduce(mine, dist::ReduceOp::Sum);
  peak_how_ = unit;
}

// The mesh in words: "FSDP over 4", "HSDP 2x2 (replicate x shard) x tensor parallel 2 ...".
std::string Trainer::layout() const {
  auto [rep, shard] = tools::mesh_shape(cfg_, world_);
  const std::string pipeline =
      pipe_ ? fmt::format("PP {} ({}, {} micro-batches, {} stages) x ", pipe_->group()->size(),
                          pipe_->schedule().name, pipe_->schedule().microbatches, pipe_->schedule().stages)
            : "";
  const auto& p = cfg_.parallelism;
  const int64_t cp = p.context_parallel_degree;
  // FSDP shards over data x context: its degree is shard x cp.
  const std::string context =
      cp > 1 ? fmt::format(" x context parallel {} ({}, {})", cp, p.context_parallel_rotate_method,
                           p.context_parallel_load_balance ? "head-tail" : "contiguous")
             : "";
  return pipeline +
         (rep > 1 ? fmt::format("HSDP {}x{} (replicate x shard{})", rep, shard * cp, cp > 1 ? " x cp" : "")
                  : fmt::format("FSDP over {}{}", shard * cp, cp > 1 ? fmt::format(" (data {} x context {})", shard, cp) : "")) +
         context +
         (p.expert_parallel_degree > 1
              ? fmt::format(" x expert parallel {} ({} experts a layer per rank)", p.expert_parallel_degree,
                            cfg_.model.moe_experts / p.expert_parallel_degree)
              : "") +
         (tp_ > 1 ? fmt::format(" x tensor parallel {}{}{}", tp_, tools::loss_parallel(cfg_) ? " (loss parallel)" : "",
                                tools::sequence_parallel(cfg_) ? " + sequence parallel" : "")
                  : "") +
         (!p.cpu_offload ? ""
          : cfg_.job.device == "cpu"
              ? " (CPU offload: the shards already live in host memory)"
              : ", shards and AdamW offloaded to the host");
}

void Trainer::report_setup() {
  say(fmt::format(
      "model {}: {} layers, d={}, {} parameters{} | {} rank(s): {} | {} thread(s)/rank{} | "
      "param {} reduce {}",
      cfg_.model.arch, cfg_.model.n_layer, cfg_.model.n_embd, parameters_,
      parameters_ != tools::parameter_count(cfg_)
          ? fmt::format(" ({} with the position table)", tools::parameter_count(cfg_))
          : "",
      world_, layout(), num_threads(), cpus_note(), cfg_.mixed_precision.param_dtype, cfg_.mixed_precision.reduce_dtype));
  say(fmt::format(
      "data: {} train tokens, {} validation tokens | {} tokens/step ({} sequences, {} per rank "
      "per micro-batch) | unigram baseline {:.4f}",
      train_->num_tokens(), val_->num_tokens(), T_.batch_size * T_.seq_len, T_.batch_size,
      micro_local_, baseline_));
  say(peak_flops_ > 0 ? fmt::format("MFU against {:.3g} TFLOP/s ({})", peak_flops_ / 1e12, peak_how_)
                      : fmt::format("MFU not reported ({})", peak_how_));
  if (pipe_) {  // each rank's stages, gathered to rank 0's log
    const auto all = dist::all_gather_strings(dist::world(), pipe_->describe_stages());
    std::string line = "pipeline stages:";
    for (size_t r = 0; r < all.size(); ++r) line += fmt::format("{} rank {}: {}", r ? ";" : "", r, all[r]);
    say(line);
  }
}

void Trainer::write_trace(int64_t step) {
  trace::enable(false);
  auto spans = trace::take();
  std::string path =
      out_path(cfg_, fs::path(cfg_.profiling.trace_folder) / fmt::format("step-{}.json", step + 1));
  if (rank_ == 0) fs::create_directories(fs::path(path).parent_path());
  const std::string title = fmt::format("{}: step {}, {} rank(s), {}, param {} reduce {}", cfg_.job.name, step + 1,
                                        world_, layout(), cfg_.mixed_precision.param_dtype,
                                        cfg_.mixed_precision.reduce_dtype);
  outside_window([&] { trace::write_chrome_trace(path, spans, title); });
  auto s = trace::summarize(spans);
  say(fmt::format(
      "trace of step {} -> {} (open in https://ui.perfetto.dev): rank 0 computed {:.1f} ms, "
      "all-gather {:.1f} ms, reduce-scatter {:.1f} ms, exposed {:.1f} ms",
      step + 1, path, s.compute_us / 1e3, s.all_gather_us / 1e3, s.reduce_scatter_us / 1e3,
      s.exposed_us / 1e3));
}

}  // namespace tessera::tools
