// tessera-train's configuration checked before anything runs (validate: each
// key against its range and the others; validate_for_world: against the
// number of ranks), profiling.trace_steps parsed, and the device mesh a
// configuration implies at a world size, and its parameter count, every
// product checked for overflow (tools/config.h).
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "cp/context_parallel.h"
#include "pp/pipeline.h"
#include "pp/schedule.h"
#include "runtime/check.h"
#include "runtime/checked.h"
#include "tools/config.h"

namespace tessera::tools {

namespace {

// The checks of validate(): each names the key, the value found and what is allowed.
void at_least(const char* key, int64_t v, int64_t min, const char* note = "") {
  TS_CHECK(v >= min, "{} must be >= {}{}, got {}", key, min, note, v);
}
void in_range(const char* key, double v, double lo, double hi, bool hi_open,
              const char* note = "") {
  TS_CHECK(v >= lo && (hi_open ? v < hi : v <= hi), "{} must be in [{}, {}{}{}, got {}", key, lo,
           hi, hi_open ? ")" : "]", note, v);
}
void not_empty(const char* key, const std::string& v) {
  TS_CHECK(!v.empty(), "{} must not be empty", key);
}

CheckedInt key(const char* name, int64_t value) { return named(name, value); }

// Bounds on work a number asks for, far above any use: a million batches
// evaluate 16 billion tokens at the default sizes, and a sample is read by a
// person. (A stop signal ends either early, too.)
constexpr int64_t kMaxEvalBatches = 1'000'000;
constexpr int64_t kMaxNewTokens = 1'000'000;
// Logits a trained model gives differ by tens; divided by more than 100 they
// sample every token almost uniformly, which no one asks for on purpose.
constexpr double kMaxTemperature = 100;

}  // namespace

void validate(const TrainConfig& c) {
  const auto& m = c.model;
  const auto& t = c.training;
  const auto& o = c.optimizer;

  // The model is nn's to check (nn/transformer.h), under the keys' names.
  transformer_config(c).validate(model_key_names());
  for (const auto& key : split_list(c.checkpoint.allow_resume_change)) {
    const auto& exact = resume_exact_keys();
    TS_CHECK(std::find(exact.begin(), exact.end(), key) != exact.end(),
             "checkpoint.allow_resume_change: '{}' is not a key a resume insists on (valid: {}; other "
             "changes only warn)",
             key, fmt::join(exact, ", "));
  }
  TS_CHECK(m.vocab_size >= 256 || !t.tokenizer.empty() || (t.dataset != "fortunes" && t.dataset != "text"),
           "model.vocab_size ({}) must be at least 256 for byte tokens (training.dataset = {})",
           m.vocab_size, t.dataset);

  at_least("training.batch_size", t.batch_size, 1, " (sequences per step)");
  at_least("training.seq_len", t.seq_len, 1);
  at_least("training.steps", t.steps, 1);
  at_least("training.grad_accum", t.grad_accum, 1);
  at_least("training.loss_chunk_rows", t.loss_chunk_rows, -1);
  {
    const std::string& o = c.activation_checkpoint.selective_ac_option;
    const bool digits = !o.empty() && o.size() < 10 && std::all_of(o.begin(), o.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
    TS_CHECK(o == "op" || (digits && std::atoll(o.c_str()) >= 1),
             "activation_checkpoint.selective_ac_option: expected op or a block frequency >= 1, got '{}'", o);
  }
  TS_CHECK(t.batch_size % t.grad_accum == 0,
           "training.batch_size ({}) must be a multiple of training.grad_accum ({})", t.batch_size,
           t.grad_accum);
  TS_CHECK(t.max_norm >= 0, "training.max_norm must be >= 0 (0 = no clipping), got {}", t.max_norm);
  TS_CHECK(t.dataset != "text" || !t.text.empty(),
           "training.dataset = text needs training.text (a text file)");
  TS_CHECK(t.dataset != "shards" || (!t.train_shard.empty() && !t.val_shard.empty()),
           "training.dataset = shards needs training.train_shard and training.val_shard");
  // A data key the chosen dataset ignores is a mistake, not something to drop silently.
  TS_CHECK(t.dataset == "text" || t.text.empty(),
           "training.text is '{}' but training.dataset is '{}': add --training.dataset text to "
           "train on it",
           t.text, t.dataset);
  for (const auto& [key, value] :
       {std::pair{"training.train_shard", &t.train_shard}, {"training.val_shard", &t.val_shard}})
    TS_CHECK(t.dataset == "shards" || value->empty(),
             "{} is '{}' but training.dataset is '{}': add --training.dataset shards to train on "
             "token shards",
             key, *value, t.dataset);
  // Validation on the training tokens would report a loss that measures nothing held out.
  std::error_code ec;
  TS_CHECK(t.dataset != "shards" || t.train_shard.empty() ||
               (t.train_shard != t.val_shard && !std::filesystem::equivalent(t.train_shard, t.val_shard, ec)),
           "training.train_shard '{}' and training.val_shard '{}' are the same file: validation would run on "
           "training data; give the validation shard tessera-data wrote beside it (NAME_val.bin)",
           t.train_shard, t.val_shard);
  not_empty("training.data_dir", t.data_dir);
  at_least("training.eval_interval", t.eval_interval, 1, " (steps between validation runs)");
  at_least("training.eval_batches", t.eval_batches, 1);
  TS_CHECK(t.eval_batches <= kMaxEvalBatches,
           "training.eval_batches must be at most {} (batches per validation run), got {}", kMaxEvalBatches,
           t.eval_batches);
  // What the run computes from these (token and sample counts, data positions) must fit in 64 bits.
  (void)(key("training.batch_size", t.batch_size) * key("training.seq_len", t.seq_len));
  (void)(key("training.steps", t.steps) * key("training.batch_size", t.batch_size));
  (void)(key("training.eval_batches", t.eval_batches) * key("training.batch_size", t.batch_size));

  TS_CHECK(o.lr > 0, "optimizer.lr must be > 0, got {}", o.lr);
  in_range("optimizer.beta1", o.beta1, 0, 1, true);
  in_range("optimizer.beta2", o.beta2, 0, 1, true);
  TS_CHECK(o.eps > 0, "optimizer.eps must be > 0, got {}", o.eps);
  TS_CHECK(o.weight_decay >= 0, "optimizer.weight_decay must be >= 0, got {}", o.weight_decay);
  // Each step scales the weights by 1 - lr * weight_decay: at 1 or more they vanish or flip sign.
  TS_CHECK(o.lr * o.weight_decay < 1,
           "optimizer.lr x optimizer.weight_decay must be < 1 (each step scales the weights by "
           "1 - lr x weight_decay), got {} x {} = {}",
           o.lr, o.weight_decay, o.lr * o.weight_decay);
  in_range("optimizer.momentum", o.momentum, 0, 1, true);
  at_least("lr_scheduler.warmup_steps", c.lr_scheduler.warmup_steps, 0);
  at_least("lr_scheduler.decay_steps", c.lr_scheduler.decay_steps, 0, " (0 = training.steps)");
  TS_CHECK(c.lr_scheduler.decay_steps == 0 || c.lr_scheduler.decay_steps > c.lr_scheduler.warmup_steps,
           "lr_scheduler.decay_steps ({}) must be greater than lr_scheduler.warmup_steps ({}): the decay ends "
           "after the warmup (0 = at training.steps)",
           c.lr_scheduler.decay_steps, c.lr_scheduler.warmup_steps);
  TS_CHECK(c.lr_scheduler.decay_ratio > 0 && c.lr_scheduler.decay_ratio <= 1,
           "lr_scheduler.decay_ratio must be in (0, 1], got {}", c.lr_scheduler.decay_ratio);
  in_range("lr_scheduler.min_lr_ratio", c.lr_scheduler.min_lr_ratio, 0, 1, false,
           " (final lr / peak lr)");

  TS_CHECK(c.parallelism.data_parallel_replicate_degree >= 1,
           "parallelism.data_parallel_replicate_degree must be >= 1, got {}",
           c.parallelism.data_parallel_replicate_degree);
  TS_CHECK(c.parallelism.data_parallel_shard_degree == -1 ||
               c.parallelism.data_parallel_shard_degree >= 1,
           "parallelism.data_parallel_shard_degree must be -1 or >= 1, got {}",
           c.parallelism.data_parallel_shard_degree);
  TS_CHECK(!c.parallelism.enable_sequence_parallel || c.parallelism.tensor_parallel_degree > 1,
           "parallelism.enable_sequence_parallel splits activations over the tensor-parallel ranks: it needs "
           "parallelism.tensor_parallel_degree > 1, got {}", c.parallelism.tensor_parallel_degree);
  if (const int64_t tp = c.parallelism.tensor_parallel_degree; tp != 1) {
    TS_CHECK(tp >= 1, "parallelism.tensor_parallel_degree must be >= 1, got {}", tp);
    TS_CHECK(c.model.n_head % tp == 0, "model.n_head ({}) must be divisible by parallelism.tensor_parallel_degree "
             "({}): each rank computes whole heads", c.model.n_head, tp);
    const int64_t kv = c.model.n_kv_head > 0 ? c.model.n_kv_head : c.model.n_head;
    TS_CHECK(kv % tp == 0, "model.n_kv_head ({}) must be divisible by parallelism.tensor_parallel_degree ({}): "
             "each rank needs whole key/value heads", kv, tp);
  }

  if (const int64_t pp = c.parallelism.pipeline_parallel_degree; pp != 1) {
    const auto& p = c.parallelism;
    TS_CHECK(pp >= 1, "parallelism.pipeline_parallel_degree must be >= 1, got {}", pp);
    const std::vector<std::string>& names = pp::schedule_names();
    TS_CHECK(std::find(names.begin(), names.end(), p.pipeline_parallel_schedule) != names.end(),
             "parallelism.pipeline_parallel_schedule: expected one of {}, got '{}'", fmt::join(names, ", "),
             p.pipeline_parallel_schedule);
    at_least("parallelism.pipeline_parallel_microbatches", p.pipeline_parallel_microbatches, 0,
             " (0 = 2 x pipeline_parallel_degree)");
    at_least("parallelism.pipeline_parallel_stages_per_rank", p.pipeline_parallel_stages_per_rank, 0,
             " (0 = 1, or 2 for interleaved_1f1b)");
    const train::ParallelismOptions o = parallelism_options(c);  // checks the layer counts' text
    const int64_t v = o.pp_stages_per_rank > 0 ? o.pp_stages_per_rank : o.pp_schedule == "interleaved_1f1b" ? 2 : 1;
    const int64_t m = o.pp_microbatches > 0 ? o.pp_microbatches : 2 * pp;
    TS_CHECK(pp * v <= c.model.n_layer,
             "parallelism.pipeline_parallel_degree ({}) x {} stage(s) per rank = {} stages, but model.n_layer is {}: "
             "each stage needs at least one block", pp, v, pp * v, c.model.n_layer);
    if (!o.pp_module_names_per_stage.empty()) {
      const auto key = "parallelism.pipeline_parallel_module_names_per_stage";
      TS_CHECK(o.pp_layers_per_stage.empty(), "{} and parallelism.pipeline_parallel_layers_per_stage both cut the "
               "stages: give one", key);
      TS_CHECK(static_cast<int64_t>(o.pp_module_names_per_stage.size()) == pp * v, "{} gives {} stage(s), but "
               "parallelism.pipeline_parallel_degree ({}) x {} stage(s) per rank = {}", key,
               o.pp_module_names_per_stage.size(), pp, v, pp * v);
      try {
        pp::split_by_names(transformer_config(c), o.pp_module_names_per_stage);
      } catch (const std::exception& e) {
        throw Error(fmt::format("{}: {}", key, e.what()));
      }
    } else {
      pp::split_layers(c.model.n_layer, static_cast<int>(pp * v), o.pp_layers_per_stage);  // names the problem
    }
    pp::make_schedule(o.pp_schedule, static_cast<int>(pp), static_cast<int>(m), static_cast<int>(v));
    TS_CHECK(!c.model.tie_embeddings,
             "model.tie_embeddings shares the token embedding (the first pipeline stage's) with the output layer "
             "(the last's): set --model.tie_embeddings false with parallelism.pipeline_parallel_degree {}", pp);
    TS_CHECK(c.training.grad_accum == 1,
             "training.grad_accum ({}) with parallelism.pipeline_parallel_degree {}: the pipeline's micro-batches "
             "are its gradient accumulation (parallelism.pipeline_parallel_microbatches)", c.training.grad_accum, pp);
  }

  if (const int64_t cp = c.parallelism.context_parallel_degree; cp != 1) {
    const auto& p = c.parallelism;
    TS_CHECK(cp >= 1, "parallelism.context_parallel_degree must be >= 1, got {}", cp);
    cp::parse_rotate_method(p.context_parallel_rotate_method, "parallelism.context_parallel_rotate_method");
    // Every sequence is training.seq_len tokens: its split is checked here,
    // before any rank allocates.
    cp::sequence_layout(t.seq_len, static_cast<int>(cp), p.context_parallel_load_balance, [](const char* field) {
      const std::string f = field;
      return f == "load_balance" ? std::string("parallelism.context_parallel_load_balance")
             : f == "seq_len"    ? std::string("training.seq_len")
                                 : f;
    });
  }

  if (const int64_t ep = c.parallelism.expert_parallel_degree; ep != 1 || c.model.moe_experts > 0) {
    // Before any rank allocates: the experts split whole over the expert-parallel ranks.
    TS_CHECK(ep >= 1, "parallelism.expert_parallel_degree must be >= 1, got {}", ep);
    TS_CHECK(ep == 1 || c.model.moe_experts > 0,
             "parallelism.expert_parallel_degree {} splits the experts of MoE layers, but the model is dense: set "
             "model.moe_experts (a multiple of {})", ep, ep);
    TS_CHECK(c.model.moe_experts % ep == 0,
             "model.moe_experts ({}) must be divisible by parallelism.expert_parallel_degree ({}): each "
             "expert-parallel rank holds moe_experts / degree whole experts", c.model.moe_experts, ep);
    TS_CHECK(c.parallelism.pipeline_parallel_degree == 1 && c.parallelism.context_parallel_degree == 1,
             "model.moe_experts {} (a mixture of experts) trains under FSDP, HSDP, tensor and expert parallelism "
             "so far; with parallelism.pipeline_parallel_degree {} or context_parallel_degree {} it is not written "
             "yet", c.model.moe_experts, c.parallelism.pipeline_parallel_degree,
             c.parallelism.context_parallel_degree);
  }

  not_empty("checkpoint.folder", c.checkpoint.folder);
  at_least("checkpoint.interval", c.checkpoint.interval, 1);
  at_least("checkpoint.keep", c.checkpoint.keep, 0, " (0 = keep all)");
  at_least("job.max_restarts", c.job.max_restarts, 0, " (0 = none)");
  at_least("checkpoint.load_step", c.checkpoint.load_step, 0, " (0 = the latest)");
  TS_CHECK(c.checkpoint.load_step == 0 || c.checkpoint.resume,
           "checkpoint.load_step {} applies to a resume: add --checkpoint.resume true (or, for a new run from a "
           "step's weights, --checkpoint.initial_load_path <folder>/step-NNNNNNNN)",
           c.checkpoint.load_step);

  at_least("metrics.log_interval", c.metrics.log_interval, 1);
  TS_CHECK(c.metrics.peak_tflops >= 0,
           "metrics.peak_tflops must be >= 0 (0 = this CPU's, measured), got {}", c.metrics.peak_tflops);

  for (int64_t s : trace_steps(c))
    TS_CHECK(s <= t.steps, "profiling.trace_steps names step {}, but training.steps is {}", s,
             t.steps);
  TS_CHECK(c.profiling.trace_steps.empty() || !c.profiling.trace_folder.empty(),
           "profiling.trace_folder must not be empty when profiling.trace_steps is set");

  at_least("sample.max_new_tokens", c.sample.max_new_tokens, 0, " (0 = no sample)");
  TS_CHECK(c.sample.max_new_tokens <= kMaxNewTokens,
           "sample.max_new_tokens must be at most {} (tokens a sample prints), got {}", kMaxNewTokens,
           c.sample.max_new_tokens);
  TS_CHECK(c.sample.temperature >= 0 && c.sample.temperature <= kMaxTemperature,
           "sample.temperature must be in [0, {}] (0 = greedy; above {} every token is about as "
           "likely), got {}",
           kMaxTemperature, kMaxTemperature, c.sample.temperature);
  at_least("sample.top_k", c.sample.top_k, 0, " (0 = all tokens)");
  at_least("sample.interval", c.sample.interval, 0, " (0 = at the end only)");
  TS_CHECK(c.sample.max_new_tokens == 0 || !c.sample.prompt.empty(),
           "sample.prompt must not be empty when sample.max_new_tokens is {} (set it to 0 for no "
           "sample)",
           c.sample.max_new_tokens);
}

void validate_for_world(const TrainConfig& c, int world_size) {
  const int64_t dp = mesh_dims(c, world_size).data_parallel();  // the degrees against the ranks
  const int64_t pp = c.parallelism.pipeline_parallel_degree;
  // A pipeline's micro-batches split each data-parallel rank's rows.
  const int64_t micro = pp > 1 ? (c.parallelism.pipeline_parallel_microbatches > 0
                                      ? c.parallelism.pipeline_parallel_microbatches : 2 * pp)
                               : c.training.grad_accum;
  int64_t unit = (key(pp > 1 ? "parallelism.pipeline_parallel_microbatches" : "training.grad_accum", micro) *
                  key("ranks", dp)).value;
  int64_t below = c.training.batch_size / unit * unit, above = 0;
  if (__builtin_add_overflow(below, unit, &above)) above = below;  // no larger multiple fits
  TS_CHECK(c.training.batch_size % unit == 0,
           "training.batch_size ({}) must be a multiple of {} ({}) x {} ({}): "
           "e.g. --training.batch_size {}",
           c.training.batch_size, pp > 1 ? "parallelism.pipeline_parallel_microbatches" : "training.grad_accum", micro,
           dp == world_size ? "ranks" : "data-parallel ranks", dp,
           below > 0 && above != below ? fmt::format("{} or {}", below, above)
                                       : fmt::format("{}", below > 0 ? below : above));
  TS_CHECK(!c.checkpoint.enable || c.optimizer.name == "adamw",
           "checkpoint.enable needs optimizer.name = adamw (SGD momentum is not checkpointed)");
}

std::vector<int64_t> positive_list(const std::string& text, const std::string& what) {
  std::vector<int64_t> out;
  size_t at = 0;
  while (at < text.size()) {
    size_t end = text.find(',', at);
    std::string item = text.substr(at, end == std::string::npos ? std::string::npos : end - at);
    size_t used = 0;
    long long v = -1;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    TS_CHECK(used == item.size() && !item.empty() && v >= 1, "{} separated by commas (e.g. \"10,11\"), got '{}'",
             what, text);
    out.push_back(v);
    if (end == std::string::npos) break;
    at = end + 1;
  }
  return out;
}

std::vector<int64_t> trace_steps(const TrainConfig& c) {
  return positive_list(c.profiling.trace_steps, "profiling.trace_steps expects step numbers >= 1");
}

namespace {
// train's names of the parallelism options as the keys that set them.
FieldNames parallelism_key_names() {
  return [](const char* field) -> std::string {
    const std::string f = field;
    if (f == "dp_replicate") return "parallelism.data_parallel_replicate_degree";
    if (f == "dp_shard") return "parallelism.data_parallel_shard_degree";
    if (f == "tp") return "parallelism.tensor_parallel_degree";
    if (f == "sequence_parallel") return "parallelism.enable_sequence_parallel";
    if (f == "pp") return "parallelism.pipeline_parallel_degree";
    if (f == "cp") return "parallelism.context_parallel_degree";
    if (f == "cp_rotate_method") return "parallelism.context_parallel_rotate_method";
    return "parallelism." + f;
  };
}
}  // namespace

MeshDims mesh_dims(const TrainConfig& c, int world_size) {
  return train::mesh_dims(parallelism_options(c), world_size, parallelism_key_names());
}

std::pair<int64_t, int64_t> mesh_shape(const TrainConfig& c, int world_size) {
  const MeshDims d = mesh_dims(c, world_size);
  return {d.replicate, d.shard};
}

int64_t data_parallel_ranks(const TrainConfig& c, int world_size) { return mesh_dims(c, world_size).data_parallel(); }

nn::TransformerConfig::FieldNames model_key_names() {
  return [](const char* field) -> std::string {
    const std::string f = field;
    if (f == "block_size") return "training.seq_len";
    if (f == "gelu_tanh") return "model.gelu = tanh";
    return "model." + f;
  };
}

int64_t parameter_count(const TrainConfig& c) { return transformer_config(c).parameter_count(model_key_names()); }

}  // namespace tessera::tools
