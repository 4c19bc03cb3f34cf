// What the settings give the library (the other half of tools/config.h):
// the options of train::parallelize, the optimizer, the schedule and the
// step; the model's configuration and the model; the memory floor a run is
// checked against before anything is planned.

#include "tools/config.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "runtime/check.h"

namespace tessera::tools {

namespace {
// "a,b;c" -> {{"a", "b"}, {"c"}} (spaces around names dropped; '' -> none).
std::vector<std::vector<std::string>> name_lists(const std::string& text) {
  std::vector<std::vector<std::string>> out;
  if (text.find_first_not_of(" \t") == std::string::npos) return out;
  auto trim = [](std::string t) {
    t.erase(0, t.find_first_not_of(" \t"));
    t.erase(t.find_last_not_of(" \t") + 1);
    return t;
  };
  size_t at = 0;
  while (at <= text.size()) {
    const size_t semi = std::min(text.find(';', at), text.size());
    std::vector<std::string> stage;
    const std::string part = text.substr(at, semi - at);
    for (size_t p = 0; p <= part.size();) {
      const size_t comma = std::min(part.find(',', p), part.size());
      if (std::string name = trim(part.substr(p, comma - p)); !name.empty()) stage.push_back(name);
      p = comma + 1;
    }
    out.push_back(stage);
    at = semi + 1;
  }
  return out;
}
}  // namespace

train::ParallelismOptions parallelism_options(const TrainConfig& cfg) {
  const auto& p = cfg.parallelism;
  return {.dp_replicate = p.data_parallel_replicate_degree,
          .dp_shard = p.data_parallel_shard_degree,
          .tp = p.tensor_parallel_degree,
          .loss_parallel = !p.disable_loss_parallel,
          .sequence_parallel = p.enable_sequence_parallel,
          .reshard_after_forward = p.reshard_after_forward,
          .reshard_after_forward_degree = p.reshard_after_forward_degree,
          .prefetch = p.prefetch,
          .cpu_offload = p.cpu_offload,
          .param_dtype = dtype_of(cfg.mixed_precision.param_dtype),
          .reduce_dtype = dtype_of(cfg.mixed_precision.reduce_dtype),
          .pp = p.pipeline_parallel_degree,
          .pp_schedule = p.pipeline_parallel_schedule,
          .pp_microbatches = p.pipeline_parallel_microbatches,
          .pp_stages_per_rank = p.pipeline_parallel_stages_per_rank,
          .pp_layers_per_stage = positive_list(p.pipeline_parallel_layers_per_stage,
                                               "parallelism.pipeline_parallel_layers_per_stage expects block "
                                               "counts >= 1"),
          .pp_module_names_per_stage = name_lists(p.pipeline_parallel_module_names_per_stage),
          .cp = p.context_parallel_degree,
          .cp_rotate_method = p.context_parallel_rotate_method,
          .cp_load_balance = p.context_parallel_load_balance,
          .ep = p.expert_parallel_degree};
}

train::OptimizerOptions optimizer_options(const TrainConfig& cfg) {
  const auto& o = cfg.optimizer;
  return {.name = o.name, .lr = o.lr, .beta1 = o.beta1, .beta2 = o.beta2, .eps = o.eps,
          .weight_decay = o.weight_decay, .momentum = o.momentum};
}

train::ScheduleOptions schedule_options(const TrainConfig& cfg) {
  const auto& s = cfg.lr_scheduler;
  return {.name = s.name, .warmup_steps = s.warmup_steps, .min_lr_ratio = s.min_lr_ratio,
          .decay_steps = s.decay_steps, .decay_ratio = s.decay_ratio};
}

train::StepOptions step_options(const TrainConfig& cfg) {
  return {.grad_accum = cfg.training.grad_accum, .max_norm = cfg.training.max_norm};
}

bool loss_parallel(const TrainConfig& cfg) {
  return cfg.parallelism.tensor_parallel_degree > 1 && !cfg.parallelism.disable_loss_parallel;
}

bool sequence_parallel(const TrainConfig& cfg) {
  return cfg.parallelism.tensor_parallel_degree > 1 && cfg.parallelism.enable_sequence_parallel;
}

MemoryFloor memory_floor(const TrainConfig& c, int world_size, bool training) {
  MemoryFloor f;
  f.parameters = parameter_count(c);
  // Tensor parallelism splits most of the rest (a lower bound: not norms and embeddings).
  f.shard_degree = training ? mesh_shape(c, world_size).second * std::max<int64_t>(c.parallelism.tensor_parallel_degree, 1) : 1;
  // f32 shards of the weights and their gradients, and the optimizer's state
  // per weight; for inference (one process) the f32 weights alone.
  double state_bytes = c.optimizer.name == "adamw" ? 8.0 : (c.optimizer.momentum > 0 ? 4.0 : 0.0);
  f.state_bytes = static_cast<double>(f.parameters) * (training ? 8.0 + state_bytes : 4.0) /
                  static_cast<double>(f.shard_degree);
  f.micro_batch = training ? c.training.batch_size / c.training.grad_accum / data_parallel_ranks(c, world_size) : 1;
  double logit_bytes = c.mixed_precision.param_dtype == "float32" ? 4.0 : 2.0;
  f.logits_bytes = static_cast<double>(f.micro_batch) * static_cast<double>(c.training.seq_len) *
                   static_cast<double>(c.model.vocab_size) * logit_bytes;
  if (training && loss_parallel(c)) f.logits_bytes /= static_cast<double>(c.parallelism.tensor_parallel_degree);
  return f;
}

void check_memory(const TrainConfig& c, int world_size, int ranks_here, double available_bytes,
                  bool training) {
  MemoryFloor f = memory_floor(c, world_size, training);
  double need = f.per_rank() * ranks_here;
  auto gib = [](double b) { return fmt::format("{:.1f} GiB", b / 1073741824.0); };
  TS_CHECK(need <= available_bytes || !training,
           "the model and batch cannot fit in memory: each rank needs at least {} ({} parameters "
           "sharded over {} rank(s): {} of f32 weights, gradients and {} state; {} of logits for "
           "{} x {} tokens x model.vocab_size {}), {} for the {} rank(s) on this node, which has "
           "{} available. Use a smaller model (model.n_layer, model.n_embd, model.vocab_size), a "
           "smaller micro-batch (training.batch_size / training.grad_accum / ranks) or more nodes",
           gib(f.per_rank()), f.parameters, f.shard_degree, gib(f.state_bytes), c.optimizer.name,
           gib(f.logits_bytes), f.micro_batch, c.training.seq_len, c.model.vocab_size, gib(need),
           ranks_here, gib(available_bytes));
  TS_CHECK(need <= available_bytes,
           "the model cannot fit in memory: it needs at least {} ({} parameters: {} of f32 "
           "weights; {} of logits for a sequence of {} tokens x model.vocab_size {}), and this "
           "machine has {} available. Check the model keys (model.n_layer, model.n_embd, "
           "model.vocab_size)",
           gib(need), f.parameters, gib(f.state_bytes), gib(f.logits_bytes), c.training.seq_len,
           c.model.vocab_size, gib(available_bytes));
}

double available_host_memory() {
  double available = INFINITY;
  std::ifstream meminfo("/proc/meminfo");
  std::string name;
  double kib = 0;
  while (meminfo >> name >> kib) {
    if (name == "MemAvailable:") available = kib * 1024.0;
    meminfo.ignore(64, '\n');
  }
  std::ifstream max_file("/sys/fs/cgroup/memory.max");
  std::ifstream current_file("/sys/fs/cgroup/memory.current");
  double max = 0, current = 0;
  if (max_file >> max && current_file >> current)  // "max" (no limit) does not parse
    available = std::min(available, std::max(0.0, max - current));
  return available;
}

DType dtype_of(const std::string& name) { return name == "bfloat16" ? DType::BF16 : DType::F32; }

nn::TransformerConfig transformer_config(const TrainConfig& c) {
  nn::TransformerConfig m;
  m.arch = c.model.arch;
  m.vocab_size = c.model.vocab_size;
  m.block_size = c.training.seq_len;
  m.n_layer = c.model.n_layer;
  m.n_head = c.model.n_head;
  m.n_kv_head = c.model.n_kv_head;
  m.n_embd = c.model.n_embd;
  m.ffn_hidden = c.model.ffn_hidden;
  m.dropout = c.model.dropout;
  m.bias = c.model.bias;
  m.tie_embeddings = c.model.tie_embeddings;
  m.rope = c.model.rope;
  m.rope_theta = c.model.rope_theta;
  m.gelu_tanh = c.model.gelu == "tanh";
  m.norm_eps = c.model.norm_eps;
  const auto& ac = c.activation_checkpoint;
  m.activation_checkpoint = ac.mode == "full" || ac.mode == "selective";
  if (ac.mode == "selective") {
    if (ac.selective_ac_option == "op") m.ac_save_matmuls = true;
    else m.ac_layer_frequency = std::max<int64_t>(1, std::atoll(ac.selective_ac_option.c_str()));
  }
  m.moe_experts = c.model.moe_experts;
  m.moe_top_k = c.model.moe_top_k;
  m.moe_shared_experts = c.model.moe_shared_experts;
  m.moe_every = c.model.moe_every;
  m.moe_hidden = c.model.moe_hidden;
  m.moe_router = c.model.moe_router;
  m.moe_norm_topk = c.model.moe_norm_topk;
  m.moe_balance = c.model.moe_balance;
  m.moe_balance_coeff = c.model.moe_balance_coeff;
  return m;
}

const std::vector<std::string>& resume_exact_keys() {
  static const std::vector<std::string> keys = {"job.seed", "training.batch_size", "training.seq_len",
                                                "training.grad_accum"};
  return keys;
}

std::vector<std::string> split_list(const std::string& list) {
  std::vector<std::string> out;
  for (size_t at = 0; at <= list.size();) {
    size_t end = std::min(list.find(',', at), list.size());
    if (end > at) out.push_back(list.substr(at, end - at));
    at = end + 1;
  }
  return out;
}

void set_model(TrainConfig& c, const nn::TransformerConfig& m) {
  c.model.arch = m.arch;
  c.model.vocab_size = m.vocab_size;
  c.training.seq_len = m.block_size;
  c.model.n_layer = m.n_layer;
  c.model.n_head = m.n_head;
  c.model.n_kv_head = m.n_kv_head;
  c.model.n_embd = m.n_embd;
  c.model.ffn_hidden = m.ffn_hidden;
  c.model.dropout = m.dropout;
  c.model.bias = m.bias;
  c.model.tie_embeddings = m.tie_embeddings;
  c.model.rope = m.arch == "gpt2" && m.rope;
  c.model.rope_theta = m.rope_theta;
  c.model.gelu = m.gelu_tanh ? "tanh" : "exact";
  c.model.norm_eps = m.norm_eps;
  c.model.moe_experts = m.moe_experts;
  c.model.moe_top_k = m.moe_top_k;
  c.model.moe_shared_experts = m.moe_shared_experts;
  c.model.moe_every = m.moe_every;
  c.model.moe_hidden = m.moe_hidden;
  c.model.moe_router = m.moe_router;
  c.model.moe_norm_topk = m.moe_norm_topk;
  c.model.moe_balance = m.moe_balance;
  c.model.moe_balance_coeff = m.moe_balance_coeff;
}

std::shared_ptr<nn::LanguageModel> make_model(const TrainConfig& c, Device device) {
  auto model = nn::make_model(transformer_config(c), device);
  model->set_loss_chunk_rows(c.training.loss_chunk_rows);
  return model;
}

}  // namespace tessera::tools
