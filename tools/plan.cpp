#include "tools/plan.h"

#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <thread>

#include "autograd/tape.h"
#include "dtensor/dtensor.h"
#include "ep/expert_parallel.h"
#include "fsdp/fsdp_param_group.h"
#include "fsdp/fsdp_state.h"
#include "nn/layers.h"
#include "nn/moe.h"
#include "runtime/allocator.h"
#include "runtime/check.h"
#include "runtime/cpu/blas.h"
#include "runtime/cpu/peak.h"
#include "runtime/parallel.h"
#include "tools/step_time.h"
#include "pp/pipeline.h"
#include "train/optimizer.h"
#include "train/parallelize.h"
#include "train/step.h"

namespace tessera::tools {

namespace fs = std::filesystem;

namespace {

int64_t held() { return memory_stats(Device::meta()).allocated_bytes; }
int64_t peak() { return memory_stats(Device::meta()).peak_allocated_bytes; }

// tessera-train's mesh (mesh_dims) as rank `rank` of world_size sees it, over simulated groups.
MeshPtr simulated_mesh(const TrainConfig& cfg, int world_size, int rank) {
  const MeshDims dims = mesh_dims(cfg, world_size);
  std::vector<int> all(static_cast<size_t>(world_size));
  std::iota(all.begin(), all.end(), 0);
  const Shape strides = contiguous_strides(dims.shape);
  std::vector<int64_t> coord(dims.shape.size());
  for (size_t d = 0; d < dims.shape.size(); ++d) coord[d] = rank / strides[d] % dims.shape[d];
  std::vector<dist::ProcessGroupPtr> groups;
  for (size_t d = 0; d < dims.shape.size(); ++d) {  // the ranks that differ from this one along d only
    std::vector<int> members;
    for (int64_t i = 0; i < dims.shape[d]; ++i) members.push_back(static_cast<int>(rank + (i - coord[d]) * strides[d]));
    groups.push_back(dist::simulated_group(static_cast<int>(coord[d]), members, dims.names[d]));
  }
  return std::make_shared<DeviceMesh>("meta", dims.shape, all, dims.names, groups, coord);
}

// Bytes of the storages behind tensors (local shards of DTensors), each once.
int64_t storage_bytes(const TensorList& tensors) {
  std::set<const Storage*> seen;
  int64_t bytes = 0;
  for (const Tensor& t : tensors) {
    if (!t.defined()) continue;
    const Tensor& local = is_dtensor(t) ? dtensor_spec(t).local : t;
    if (local.storage() && seen.insert(local.storage().get()).second)
      bytes += static_cast<int64_t>(local.storage()->nbytes());
  }
  return bytes;
}

std::string mib(double bytes) { return fmt::format("{:.1f} MiB", bytes / 1048576.0); }

// Plan::bf16_products: what the meta device assumes now, and why.
std::string bf16_products_assumed() {
  if (meta_kernels::native_dtypes()) return "bf16 (planned as a GPU)";
  switch (meta_kernels::bf16_products()) {
    case meta_kernels::Bf16Products::Native:
      return "bf16 (as a CPU with oneDNN's AVX512-BF16 kernels: --bf16-products native)";
    case meta_kernels::Bf16Products::Amx: return "bf16 (as a CPU with AMX tiles: --bf16-products amx)";
    case meta_kernels::Bf16Products::Own:
      return "bf16 widened as Tessera's f32 kernel packs them (as an AVX2 CPU: --bf16-products own)";
    case meta_kernels::Bf16Products::F32Copies:
      return "f32 copies (as a CPU without bf16 kernels or AVX2: --bf16-products f32)";
    case meta_kernels::Bf16Products::ThisCpu: break;
  }
  const char* cap = std::getenv("TESSERA_CPU_ISA");
  const bool capped = cap != nullptr && *cap != '\0';
  if (cpu::bf16_gemm_native())
    return cpu::amx_kernel_here() ? "bf16 (this CPU's AMX tiles: Tessera's kernel and oneDNN's)"
           : cpu::bf16_gemm_amx() ? "bf16 (this CPU's oneDNN AMX kernels)"
                                  : "bf16 (this CPU's oneDNN AVX512-BF16 kernels)";
  const std::string why = capped ? fmt::format("oneDNN has no bf16 GEMM kernels under TESSERA_CPU_ISA={}", cap)
                                  : "this CPU has neither AVX512-BF16 nor AMX for oneDNN's bf16 GEMM";
  if (cpu::bf16_on_own_kernel()) return fmt::format("bf16 widened as Tessera's f32 kernel packs them ({})", why);
  return fmt::format("f32 copies ({}{})", why, capped ? "" : ", and its kernels run their AVX-512 or baseline copy");
}

}  // namespace

PlanAsGpu::PlanAsGpu() {
  meta_kernels::set_native_dtypes(true);
  dist::set_simulated_like_nccl(true);
}
PlanAsGpu::~PlanAsGpu() {
  meta_kernels::set_native_dtypes(false);
  dist::set_simulated_like_nccl(false);
}

int threads_per_rank(int ranks_here) {
  if (const char* omp = std::getenv("OMP_NUM_THREADS"); omp != nullptr && std::atoi(omp) > 0) return std::atoi(omp);
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, cores / std::max(1, ranks_here));
}

std::vector<int> rank_cpus(int local_rank, int local_size, int threads) {
  TS_CHECK(local_size >= 1 && local_rank >= 0 && local_rank < local_size && threads >= 1,
           "rank_cpus: expected local rank 0..{} and a positive thread count, got rank {} and {} thread(s)",
           local_size - 1, local_rank, threads);
  const std::vector<int> allowed = allowed_cpus();
  const auto online = static_cast<size_t>(std::max(1u, std::thread::hardware_concurrency()));
  const auto need = static_cast<size_t>(local_size) * static_cast<size_t>(threads);
  if (local_size == 1 || allowed.size() < online || need > allowed.size()) return {};
  const auto first = allowed.begin() + static_cast<std::ptrdiff_t>(local_rank) * threads;
  return {first, first + threads};
}


double node_peak_flops(const std::string& param_dtype, int ranks_here, int threads, std::string* how) {
  // All the threads the ranks use at once: two hardware threads of one core
  // (SMT) share its units, so a one-thread rate times the CPUs would double it.
  const int cpus = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int used = std::min(cpus, std::max(1, ranks_here) * std::max(1, threads));
  const cpu::Peak peak = cpu::measure_dtype_peak(param_dtype == "float32" ? DType::F32 : DType::BF16, used);
  // Load on the machine can only lower a measurement: the best one ever made
  // for this CPU, unit and thread count is kept in the cache and used.
  const std::string key = fmt::format("{} | {} | {} threads", cpu_model(), peak.unit, used);
  const fs::path cache = fs::path(cache_dir()) / "peaks.txt";
  std::map<std::string, double> best;
  {
    std::ifstream in(cache);
    std::string line;
    while (std::getline(in, line)) {
      const size_t tab = line.rfind('\t');
      if (tab == std::string::npos) continue;
      try {
        best[line.substr(0, tab)] = std::stod(line.substr(tab + 1));
      } catch (const std::exception&) {
        // a damaged line: measured again
      }
    }
  }
  const double earlier = best.count(key) != 0 && std::isfinite(best[key]) ? best[key] : 0;
  const double flops = std::max(peak.flops, earlier);
  if (peak.flops > earlier) {
    best[key] = peak.flops;
    std::error_code ec;
    fs::create_directories(cache.parent_path(), ec);
    const fs::path tmp = cache.string() + fmt::format(".tmp{}", ::getpid());
    {
      std::ofstream out(tmp);
      for (const auto& [k, v] : best) out << k << '\t' << fmt::format("{:.6g}", v) << '\n';
    }
    fs::rename(tmp, cache, ec);  // best effort: a cache that cannot be written is measured again next time
  }
  if (how != nullptr)
    *how = earlier > peak.flops ? fmt::format("{} loop, measured: the best on this CPU, kept in {}; {:.4g} now",
                                              peak.unit, cache.string(), peak.flops / 1e12)
                                : fmt::format("{} loop, measured", peak.unit);
  return flops;
}

std::vector<std::pair<std::string, dist::ProcessGroupPtr>> flattened_groups(const MeshPtr& mesh) {
  const auto& names = mesh->dim_names();
  if (std::find(names.begin(), names.end(), "cp") == names.end()) return {};
  return {{"dp_shard_cp", mesh->root()->slice({"dp_shard_cp"})->get_group(0)}};
}

std::vector<std::pair<std::string, dist::ProcessGroupPtr>> expert_groups(nn::Module& model) {
  std::vector<std::pair<std::string, dist::ProcessGroupPtr>> out;
  std::set<const dist::ProcessGroup*> seen;
  for (nn::MoE* m : nn::moe_layers(model)) {
    if (auto* ep = dynamic_cast<ep::ExpertParallel*>(m->placement.get());
        ep != nullptr && seen.insert(ep->group().get()).second)
      out.emplace_back("ep", ep->group());
    if (fsdp::FSDPState* st = fsdp::state_of(*m->experts); st != nullptr && st->param_group) {
      const dist::ProcessGroupPtr& g = st->param_group->mesh_info.shard_group;
      if (g && seen.insert(g.get()).second) out.emplace_back("dp_shard_mod_ep", g);
    }
  }
  return out;
}

std::vector<dist::ProcessGroupPtr> post_forward_groups(nn::Module& model) {
  std::vector<dist::ProcessGroupPtr> out;
  for (auto& [name, module] : model.named_modules())
    if (fsdp::FSDPState* st = fsdp::state_of(*module);
        st != nullptr && st->param_group && st->param_group->post_forward_mesh_info)
      out.push_back(st->param_group->post_forward_mesh_info->shard_group);
  return out;
}

namespace {

// Bytes of the optimizer's state (AdamW's two moments, SGD's momentum).
int64_t optimizer_state_bytes(optim::Optimizer& opt) {
  TensorList state;
  if (auto* adamw = dynamic_cast<optim::AdamW*>(&opt)) {
    for (size_t g = 0; g < adamw->param_groups().size(); ++g)
      for (size_t j = 0; j < adamw->param_groups()[g].params.size(); ++j) {
        state.push_back(adamw->state(g, j).exp_avg);
        state.push_back(adamw->state(g, j).exp_avg_sq);
      }
  } else if (auto* sgd = dynamic_cast<optim::SGD*>(&opt)) {
    for (size_t j = 0; j < sgd->param_groups()[0].params.size(); ++j) state.push_back(sgd->momentum_buffer(j));
  }
  return storage_bytes(state);
}

// Bytes of the parameters' gradients (after a backward).
int64_t gradient_bytes(const TensorList& params) {
  TensorList grads;
  for (const Tensor& p : params) grads.push_back(p.grad());
  return storage_bytes(grads);
}

// The end of a planned step: the optimizer's step, the step's kernel log
// when it was recorded and, after the first step, the shards and the
// moments it left (what the step left behind also holds what FSDP's lazy
// init allocated at the first forward: the moments are counted as such).
void end_step(Plan& plan, optim::Optimizer& opt, const TensorList& params, int step,
              std::optional<kernel_log::Recording>& recording, std::shared_ptr<kernel_log::Log>& log) {
  opt.step();
  opt.zero_grad();
  if (recording) {
    recording.reset();
    plan.step_log = std::move(log);
  }
  if (step == 0) {
    plan.sharded_parameters = storage_bytes(params);
    plan.optimizer_state = optimizer_state_bytes(opt);
  }
}

// A pipeline's rank: its stages built, sharded and materialised as
// tessera-train's train::make_pipeline does, and two steps of the schedule on
// meta tensors (the messages counted by the simulated "pp" group, never
// sent), so the activations of the micro-batches each stage holds in flight
// are in the peak as they are in a run.
void plan_pipeline(const TrainConfig& cfg, Plan& plan, const MeshPtr& mesh, const dist::ProcessGroupPtr& world,
                   bool log_step) {
  const auto& T = cfg.training;
  const train::ParallelismOptions options = parallelism_options(cfg);
  std::shared_ptr<pp::Pipeline> pipe =
      train::make_pipeline(transformer_config(cfg), mesh, options, static_cast<uint64_t>(cfg.job.seed));
  reset_peak_memory_stats(Device::meta());  // the stages' full-size meta copies are gone
  pp::PipelinedModel model(pipe);
  std::unique_ptr<optim::Optimizer> opt = train::make_optimizer(model, optimizer_options(cfg));
  const int m = pipe->schedule().microbatches;
  plan.micro_batch = T.batch_size / data_parallel_ranks(cfg, plan.world_size) / m;
  plan.pp_microbatches = m;
  plan.pp_stages = pipe->describe_stages();
  plan.pp_bubble = pp::simulate(pipe->schedule()).bubble();
  for (int step = 0; step < 2; ++step) {
    // This data-parallel rank's rows of the batch: token ids and targets.
    const Tensor x = empty({plan.micro_batch * m, T.seq_len}, DType::I64, Device::meta());
    const Tensor y = empty({plan.micro_batch * m, T.seq_len}, DType::I64, Device::meta());
    if (step == 1) {
      for (int64_t d = 0; d < mesh->ndim(); ++d) mesh->get_group(d)->reset_stats();
      for (const auto& [name, g] : flattened_groups(mesh)) g->reset_stats();
      world->reset_stats();
    }
    const int64_t steady = held();
    std::shared_ptr<kernel_log::Log> log;
    std::optional<kernel_log::Recording> recording_kernels;
    if (step == 1 && log_step) recording_kernels.emplace(*(log = std::make_shared<kernel_log::Log>()));
    Tensor loss = ops::reshape(pipe->step(x, y), {1});
    if (plan.world_size > 1) world->all_reduce(loss, {dist::ReduceOp::Avg})->wait();
    if (step == 1) plan.forward_peak = peak() - steady;
    plan.gradients = gradient_bytes(model.parameters());
    pipe->clip_grad_norm_(T.max_norm);
    end_step(plan, *opt, model.parameters(), step, recording_kernels, log);
  }
  plan.pp_in_flight = pipe->max_in_flight();
  for (int64_t d = 0; d < mesh->ndim(); ++d)
    plan.collectives[mesh->dim_names()[static_cast<size_t>(d)]] = mesh->get_group(d)->stats();
  for (const auto& [name, g] : flattened_groups(mesh)) plan.collectives[name] = g->stats();
  if (plan.world_size > 1) plan.collectives["world"] = world->stats();
  plan.peak = peak();
  // This rank's FLOPs: its stages' parameters and blocks, every micro-batch.
  int64_t params = 0, blocks = 0;
  for (const auto& [s, part] : pipe->parts()) {
    for (const Tensor& p : part->parameters()) params += p.numel();
    blocks += static_cast<int64_t>(part->blocks.size());
  }
  const double tokens = static_cast<double>(plan.micro_batch * m * T.seq_len) /
                        static_cast<double>(cfg.parallelism.tensor_parallel_degree);
  plan.flops_forward = (2.0 * static_cast<double>(params) +
                        4.0 * static_cast<double>(blocks * cfg.model.n_embd * T.seq_len)) * tokens;
  plan.flops_backward = 2 * plan.flops_forward;
}

Plan plan_once(const TrainConfig& cfg, int world_size, int rank, bool log_step) {
  const auto& T = cfg.training;
  Plan plan;
  plan.world_size = world_size;
  plan.rank = rank;
  std::tie(plan.replicate, plan.shard) = mesh_shape(cfg, world_size);
  plan.parameters = parameter_count(cfg);
  plan.micro_batch = T.batch_size / T.grad_accum / data_parallel_ranks(cfg, world_size);
  plan.bf16_products = bf16_products_assumed();

  MetaAccounting accounting;
  MeshPtr mesh = simulated_mesh(cfg, world_size, rank);
  std::vector<int> all(static_cast<size_t>(world_size));
  std::iota(all.begin(), all.end(), 0);
  dist::ProcessGroupPtr world = dist::simulated_group(rank, all, "world");
  if (cfg.parallelism.pipeline_parallel_degree > 1) {
    plan_pipeline(cfg, plan, mesh, world, log_step);
    return plan;
  }
  {
    // The model is built on meta, full-size, before it is sharded: on a
    // device as in tessera-train, those tensors have no bytes, and only
    // to_empty gives the shards theirs. Here they are counted, so the peak
    // starts again once they are gone (at many ranks a full f32 copy of the
    // model can be larger than a step's peak).
    std::shared_ptr<nn::LanguageModel> model = make_model(cfg, Device::meta());
    train::parallelize(*model, mesh, parallelism_options(cfg));
    model->to_empty(Device::meta());
    reset_peak_memory_stats(Device::meta());
    model->init_weights(static_cast<uint64_t>(cfg.job.seed));
    std::unique_ptr<optim::Optimizer> opt = train::make_optimizer(*model, optimizer_options(cfg));

    std::vector<nn::Module::HookId> hooks;
    int64_t forward_base = 0;
    bool recording = false;
    for (auto& block : model->blocks)
      hooks.push_back(block->register_forward_hook([&](nn::Module&, const TensorList&, TensorList&) {
        if (recording) plan.after_block.push_back(held() - forward_base);
      }));
    auto batch = [&](int64_t) {
      Tensor x = empty({plan.micro_batch, T.seq_len}, DType::I64, Device::meta());
      Tensor y = empty({plan.micro_batch, T.seq_len}, DType::I64, Device::meta());
      return std::pair{x, y};
    };
    // The first step allocates the optimizer's state; the second is the
    // steady state, whose collectives are the plan's.
    for (int step = 0; step < 2; ++step) {
      if (step == 1) {
        for (int64_t d = 0; d < mesh->ndim(); ++d) mesh->get_group(d)->reset_stats();
        for (const auto& [name, g] : flattened_groups(mesh)) g->reset_stats();
        for (const auto& g : post_forward_groups(*model)) g->reset_stats();
        for (const auto& [name, g] : expert_groups(*model)) g->reset_stats();
        world->reset_stats();
        forward_base = held();
        recording = true;
      }
      int64_t steady = held();
      std::shared_ptr<kernel_log::Log> log;
      std::optional<kernel_log::Recording> recording_kernels;
      if (step == 1 && log_step) recording_kernels.emplace(*(log = std::make_shared<kernel_log::Log>()));
      Tensor loss_sum = train::forward_backward(*model, T.grad_accum, batch);
      Tensor mean = ops::reshape(ops::binary(ops::BinaryOp::Div, loss_sum, static_cast<double>(T.grad_accum)), {1});
      if (world_size > 1) world->all_reduce(mean, {dist::ReduceOp::Sum})->wait();
      if (step == 1) plan.forward_peak = peak() - steady;
      plan.gradients = gradient_bytes(model->parameters());
      Tensor gnorm = T.max_norm > 0 ? nn::clip_grad_norm_(model->parameters(), T.max_norm)
                                    : nn::grad_norm(model->parameters());
      end_step(plan, *opt, model->parameters(), step, recording_kernels, log);
      recording = false;
      if (step == 1 && plan.after_block.size() > model->blocks.size())  // grad_accum > 1: the last micro-batch's
        plan.after_block.erase(plan.after_block.begin(),
                               plan.after_block.end() - static_cast<std::ptrdiff_t>(model->blocks.size()));
    }
    for (int64_t d = 0; d < mesh->ndim(); ++d)
      plan.collectives[mesh->dim_names()[static_cast<size_t>(d)]] = mesh->get_group(d)->stats();
    for (const auto& [name, g] : flattened_groups(mesh)) plan.collectives[name] = g->stats();
    if (world_size > 1) plan.collectives["world"] = world->stats();
    for (const auto& g : post_forward_groups(*model))
      plan.collectives[fmt::format("dp_shard/post-forward{}", g->size())] += g->stats();
    for (const auto& [name, g] : expert_groups(*model)) plan.collectives[name] += g->stats();
    for (nn::MoE* m : nn::moe_layers(*model)) {
      plan.expert_parameters += m->experts->w1.numel() + m->experts->w2.numel() + m->experts->w3.numel();
      plan.expert_bytes += storage_bytes(m->experts->parameters());
    }
    if (cfg.model.moe_experts > 0) {
      const int64_t ep = cfg.parallelism.expert_parallel_degree, k = cfg.model.moe_top_k;
      plan.moe_imbalance_bound =
          static_cast<double>(ep * std::min(k, cfg.model.moe_experts / ep)) / static_cast<double>(k);
    }
    plan.peak = peak();
    for (size_t i = 0; i < hooks.size(); ++i) model->blocks[i]->remove_hook(hooks[i]);
  }
  // PaLM's estimate (appendix B): 2N per token forward for the matmuls, plus
  // 4 x layers x width x seq_len for the attention scores and values; N the
  // parameters a token passes through (a mixture of experts: its top-k experts).
  // This rank's share: its data-parallel group's tokens, split among its
  // tensor-parallel ranks (the model's FLOPs counted once, as MFU does).
  const double tokens = static_cast<double>(plan.micro_batch * T.grad_accum * T.seq_len) /
                        static_cast<double>(cfg.parallelism.tensor_parallel_degree);  // validated >= 1
  const double per_token = 2.0 * static_cast<double>(transformer_config(cfg).active_parameter_count()) +
                           4.0 * static_cast<double>(cfg.model.n_layer * cfg.model.n_embd * T.seq_len);
  plan.flops_forward = per_token * tokens;
  plan.flops_backward = 2 * plan.flops_forward;
  // Recomputed: every block (full), every k-th (selective k), or only the
  // pointwise ops and norms, no product (selective op: no FLOPs counted).
  const nn::TransformerConfig model = transformer_config(cfg);
  int64_t recomputed = 0;
  for (int64_t l = 0; l < model.n_layer; ++l) recomputed += model.checkpoints_layer(l) && !model.ac_save_matmuls;
  plan.flops_recompute = model.n_layer > 0 ? plan.flops_forward * static_cast<double>(recomputed) /
                                                 static_cast<double>(model.n_layer)
                                           : 0;
  return plan;
}

}  // namespace

Plan plan_run(const TrainConfig& cfg, int world_size, int rank, bool log_step) {
  validate(cfg);
  validate_for_world(cfg, world_size);
  TS_CHECK(rank >= 0 && rank < world_size, "plan: rank {} is not one of {} ranks", rank, world_size);
  return plan_once(cfg, world_size, rank, log_step);
}

std::vector<Plan> plan_stage_positions(const TrainConfig& cfg, int world_size) {
  const int64_t pp = cfg.parallelism.pipeline_parallel_degree;
  std::vector<Plan> out;
  for (int64_t i = 0; i < std::max<int64_t>(pp, 1); ++i)
    out.push_back(plan_run(cfg, world_size, static_cast<int>(i * world_size / std::max<int64_t>(pp, 1))));
  return out;
}

std::string format_stage_plans(const std::vector<Plan>& plans) {
  std::string out = "per pipeline position (its first rank; the data-parallel ranks beside it hold the same stages):\n";
  for (const Plan& p : plans) {
    const dist::CollectiveStats pp = p.collectives.count("pp") ? p.collectives.at("pp") : dist::CollectiveStats{};
    out += fmt::format("  rank {:<4} {:<52} in flight {:>3}  send {:>4}  recv {:>4}  peak {:>12}\n", p.rank,
                       p.pp_stages, p.pp_in_flight, pp.send, pp.recv, mib(static_cast<double>(p.peak)));
  }
  return out;
}

void check_planned_memory(const TrainConfig& cfg, int world_size, int ranks_here, double available_bytes) {
  if (!cfg.job.check_memory) return;
  // The position with the largest peak (a pipeline's stages differ: the
  // first holds the most micro-batches in flight, the last the logits).
  Plan plan;
  for (Plan& p : plan_stage_positions(cfg, world_size))
    if (p.peak >= plan.peak) plan = std::move(p);
  const double need = static_cast<double>(plan.peak) * ranks_here;
  if (need <= available_bytes) return;
  auto gib = [](double b) { return fmt::format("{:.2f} GiB", b / 1073741824.0); };
  // The nearest settings, each planned.
  std::string options;
  auto option = [&](const std::string& flags, TrainConfig c, int world) {
    try {
      validate(c);
      validate_for_world(c, world);
      double peak = 0;
      for (const Plan& p : plan_stage_positions(c, world)) peak = std::max(peak, static_cast<double>(p.peak));
      options += fmt::format("\n  {:<48} {} per rank{}", flags, gib(peak),
                             peak * ranks_here <= available_bytes ? "  (fits)" : "");
    } catch (const std::exception&) {
      // not a valid setting here: not offered
    }
  };
  if (cfg.activation_checkpoint.mode == "none") {
    TrainConfig c = cfg;
    c.activation_checkpoint.mode = "full";
    option("--activation_checkpoint.mode full", c, world_size);
  }
  if (const int64_t pp = cfg.parallelism.pipeline_parallel_degree; pp > 1) {
    // Smaller micro-batches: 1F1B holds at most p of them in flight whatever their number.
    TrainConfig c = cfg;
    const int64_t m = cfg.parallelism.pipeline_parallel_microbatches > 0 ? cfg.parallelism.pipeline_parallel_microbatches
                                                                       : 2 * pp;
    c.parallelism.pipeline_parallel_microbatches = 2 * m;
    option(fmt::format("--parallelism.pipeline_parallel_microbatches {}", 2 * m), c, world_size);
  } else {
    TrainConfig c = cfg;
    c.training.grad_accum *= 2;
    option(fmt::format("--training.grad_accum {}", c.training.grad_accum), c, world_size);
  }
  if (cfg.mixed_precision.param_dtype == "float32") {
    TrainConfig c = cfg;
    c.mixed_precision.param_dtype = "bfloat16";
    option("--mixed_precision.param_dtype bfloat16", c, world_size);
  }
  option(fmt::format("{} ranks (more nodes)", 2 * world_size), cfg, 2 * world_size);
  throw Error(fmt::format(
      "the planned peak does not fit: each rank needs {} ({} for the {} rank(s) on this node), and "
      "{} is available. The plan of rank {}:\n{}Settings nearby:{}\n(--job.check_memory false starts anyway)",
      gib(static_cast<double>(plan.peak)), gib(need), ranks_here, gib(available_bytes), plan.rank,
      format_plan(plan, cfg), options.empty() ? " none valid" : options));
}

std::string format_plan(const Plan& p, const TrainConfig& cfg) {
  std::string out;
  auto line = [&](const std::string& text) { out += text + "\n"; };
  // GPT-2's position table is left out of tessera-train's count, as nanoGPT does.
  const int64_t positions = cfg.model.arch == "gpt2" ? cfg.training.seq_len * cfg.model.n_embd : 0;
  line(fmt::format("plan: {} {} parameters{}, {} rank(s){}, rank {}: micro-batch {} x {} tokens, grad_accum {}",
                   cfg.model.arch, p.parameters,
                   positions > 0 ? fmt::format(" ({} without the position table, as tessera-train counts)",
                                               p.parameters - positions)
                                 : "",
                   p.world_size,
                   p.replicate > 1 ? fmt::format(" (HSDP {} x {})", p.replicate, p.shard) : "", p.rank,
                   p.micro_batch, cfg.training.seq_len, cfg.training.grad_accum));
  if (!p.pp_stages.empty())
    line(fmt::format("pipeline: {}, {} micro-batches per step; this rank: {}; at most {} micro-batch(es) in flight "
                     "on a stage; bubble {:.1f}% (the schedule simulated, a backward twice a forward)",
                     cfg.parallelism.pipeline_parallel_schedule, p.pp_microbatches, p.pp_stages, p.pp_in_flight,
                     100 * p.pp_bubble));
  if (const auto& par = cfg.parallelism; par.context_parallel_degree > 1) {
    // Each layer's K/V exchange: every rank's K and V slices, [2, B, Hkv, T/cp, D]
    // in the compute dtype, reach every other rank once forward and once backward.
    const int64_t cp = par.context_parallel_degree, kv_heads = cfg.model.n_kv_head > 0 ? cfg.model.n_kv_head
                                                                                       : cfg.model.n_head;
    const double elem = cfg.mixed_precision.param_dtype == "bfloat16" ? 2 : 4;
    const double slice = 2.0 * static_cast<double>(p.micro_batch * kv_heads / cfg.parallelism.tensor_parallel_degree *
                                                   cfg.training.seq_len / cp * (cfg.model.n_embd / cfg.model.n_head)) *
                         elem;
    line(fmt::format("context parallel: {} ranks, {}, {}; this rank holds {} of {} tokens a sequence; per layer and "
                     "micro-batch it sends {} of K/V forward ({} x its slice of {}){}",
                     cp, par.context_parallel_rotate_method,
                     par.context_parallel_load_balance ? "head-tail chunks" : "contiguous runs",
                     cfg.training.seq_len / cp, cfg.training.seq_len,
                     mib(static_cast<double>(cp - 1) * slice), cp - 1, mib(slice),
                     par.context_parallel_rotate_method == "ring"
                         ? ", and K/V again with their gradients (f32) backward"
                         : ", gathers them again backward and reduce-scatters their gradients (f32)"));
  }
  if (const auto& m = cfg.model; m.moe_experts > 0) {
    const int64_t ep = cfg.parallelism.expert_parallel_degree;
    const auto layers = transformer_config(cfg).moe_layer_count();
    line(fmt::format("mixture of experts: {} MoE layer(s) of {} experts, top {}{}; the routed experts are {} "
                     "parameters ({:.0f}% of the model), {} of them active per token; this rank holds {} of their "
                     "weights{}",
                     layers, m.moe_experts, m.moe_top_k,
                     m.moe_shared_experts > 0 ? fmt::format(", {} shared", m.moe_shared_experts) : "",
                     p.expert_parameters,
                     100.0 * static_cast<double>(p.expert_parameters) / static_cast<double>(p.parameters),
                     p.expert_parameters / m.moe_experts * m.moe_top_k, mib(static_cast<double>(p.expert_bytes)),
                     ep > 1 ? fmt::format(" (expert parallel {}: {} experts a layer per rank, sharded over the {} "
                                          "rank(s) of dp_shard_mod_ep{})", ep, m.moe_experts / ep, p.shard / ep,
                                          p.replicate > 1 ? fmt::format(", replicated over {}", p.replicate) : "")
                            : ""));
    if (ep > 1) {
      const dist::CollectiveStats a2a = p.collectives.count("ep") ? p.collectives.at("ep") : dist::CollectiveStats{};
      line(fmt::format("  all-to-all over ep per step: {} (5 per MoE layer and micro-batch: counts, dispatch and "
                       "combine forward, combine and dispatch backward), {} handed at balanced routing; at the worst "
                       "routing a rank's experts receive up to {:.3g}x the balanced rows (ep x min(top_k, experts "
                       "per rank) / top_k), and their dispatch buffers and activations grow as much",
                       a2a.all_to_all, mib(static_cast<double>(a2a.bytes)), p.moe_imbalance_bound));
    }
  }
  if (cfg.mixed_precision.param_dtype != "float32") line(fmt::format("bf16 matrix products: in {}", p.bf16_products));
  line("memory per rank (bytes held in tensors, as the allocator counts them):");
  line(fmt::format("  sharded parameters          {:>12}", mib(static_cast<double>(p.sharded_parameters))));
  line(fmt::format("  optimizer state             {:>12}", mib(static_cast<double>(p.optimizer_state))));
  line(fmt::format("  sharded gradients           {:>12}", mib(static_cast<double>(p.gradients))));
  line(fmt::format("  forward + backward, above   {:>12}  (gathered groups, activations, logits, buffers)",
                   mib(static_cast<double>(p.forward_peak))));
  if (!p.after_block.empty()) {
    std::string blocks;
    for (size_t i = 0; i < p.after_block.size(); ++i)
      blocks += fmt::format("{}{}", i ? ", " : "", mib(static_cast<double>(p.after_block[i])));
    line(fmt::format("    held after each block's forward: {}", blocks));
  }
  line(fmt::format("  predicted peak              {:>12}", mib(static_cast<double>(p.peak))));
  line("communication per step (this rank; handed to MPI, and sent over the wire by ring algorithms):");
  for (const auto& [group, s] : p.collectives) {
    line(fmt::format("  {:<22} all-gather {:>4}  reduce-scatter {:>4}  all-reduce {:>4}{}  {:>12} handed {:>12} on a ring",
                     group, s.all_gather, s.reduce_scatter, s.all_reduce,
                     s.all_to_all > 0 ? fmt::format("  all-to-all {:>4}", s.all_to_all) : "",
                     mib(static_cast<double>(s.bytes)), mib(static_cast<double>(s.ring_bytes))));
    if (s.send + s.recv > 0)  // a pipeline's messages, stage to stage, or the ring's K/V (in the bytes above)
      line(fmt::format("  {:<22} send {:>4}  recv {:>4}  ({})", "", s.send, s.recv,
                       group == "cp" ? "K/V blocks and their gradients around the ring"
                                     : "activations and their gradients between stages"));
  }
  // ZeRO-3's figure assumes every parameter gathered twice; a group kept
  // gathered after its forward (the last one, or reshard_after_forward
  // false) is gathered once, so the run can send less than this.
  const double w = static_cast<double>(p.shard);
  const double param_bytes = cfg.mixed_precision.param_dtype == "bfloat16" ? 2 : 4;
  const double grad_bytes = cfg.mixed_precision.reduce_dtype == "bfloat16" ? 2 : 4;
  line(fmt::format("  ZeRO-3's estimate over dp_shard, every parameter gathered twice and reduced once: "
                   "(W-1)/W x params x (2 x {} + {}) bytes = {} on a ring",
                   param_bytes, grad_bytes,
                   mib((w - 1) / w * static_cast<double>(p.parameters) * (2 * param_bytes + grad_bytes))));
  line(fmt::format("compute per step (this rank): forward {:.3g}, backward {:.3g}, recompute {:.3g} FLOPs",
                   p.flops_forward, p.flops_backward, p.flops_recompute));
  return out;
}

}  // namespace tessera::tools
