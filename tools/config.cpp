#include "tools/config.h"

#include <toml++/toml.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <cstdio>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>

#include "runtime/check.h"
#include "runtime/json_scan.h"

namespace tessera::tools {

namespace {

// Where `s` stops being well-formed UTF-8 (RFC 3629: no overlong forms, no
// surrogates, nothing above U+10FFFF), or npos. config.toml is TOML, which
// holds only UTF-8: a setting that is not would make the run's record unreadable.
size_t invalid_utf8_at(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto b = static_cast<unsigned char>(s[i]);
    size_t len = b < 0x80 ? 1 : (b >> 5) == 0x6 ? 2 : (b >> 4) == 0xE ? 3 : (b >> 3) == 0x1E ? 4 : 0;
    if (len == 0 || i + len > s.size()) return i;
    uint32_t cp = len == 1 ? b : b & (0x7F >> len);
    for (size_t j = 1; j < len; ++j) {
      const auto c = static_cast<unsigned char>(s[i + j]);
      if ((c & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (c & 0x3F);
    }
    static constexpr uint32_t kLeast[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kLeast[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
    i += len;
  }
  return std::string::npos;
}

ConfigKey int_key(const std::string& name, int64_t& v, const std::string& help) {
  return {name,
          "int",
          help,
          {},
          [&v, name](const std::string& s) {
            size_t used = 0;
            long long x = 0;
            try {
              x = std::stoll(s, &used);
            } catch (const std::exception&) {
              used = 0;
            }
            TS_CHECK(used == s.size() && !s.empty(), "config key '{}' expects an integer, got '{}'",
                     name, s);
            v = x;
          },
          [&v] { return std::to_string(v); }};
}

ConfigKey float_key(const std::string& name, double& v, const std::string& help) {
  return {name,
          "float",
          help,
          {},
          [&v, name](const std::string& s) {
            size_t used = 0;
            double x = 0;
            bool range = false;  // a number beyond a double's normal range (std::stod's underflow or overflow)
            try {
              x = std::stod(s, &used);
            } catch (const std::out_of_range&) {
              range = true;
            } catch (const std::exception&) {
              used = 0;
            }
            TS_CHECK(!range,
                     "config key '{}' expects a number of magnitude 0 or between 2.2e-308 and 1.8e308 (a double's "
                     "normal range), got '{}'", name, s);
            TS_CHECK(used == s.size() && !s.empty(), "config key '{}' expects a number, got '{}'",
                     name, s);
            TS_CHECK(std::isfinite(x), "config key '{}' expects a finite number, got '{}'", name,
                     s);
            v = x;
          },
          [&v] { return fmt::format("{}", v); }};
}

ConfigKey bool_key(const std::string& name, bool& v, const std::string& help) {
  return {name,
          "bool",
          help,
          {"true", "false"},
          [&v, name](const std::string& s) {
            if (s == "true" || s == "1")
              v = true;
            else if (s == "false" || s == "0")
              v = false;
            else
              TS_CHECK(false, "config key '{}' expects true or false, got '{}'", name, s);
          },
          [&v] { return std::string(v ? "true" : "false"); }};
}

ConfigKey string_key(const std::string& name, std::string& v, const std::string& help,
                     std::vector<std::string> choices = {}) {
  return {name,
          "string",
          help,
          choices,
          [&v, name, choices](const std::string& s) {
            if (!choices.empty() && std::find(choices.begin(), choices.end(), s) == choices.end()) {
              TS_CHECK(false, "config key '{}' has no choice '{}' (valid: {})", name, s,
                       fmt::join(choices, ", "));
            }
            // A NUL would end the string where the C library reads it (a path cut short).
            const size_t nul = s.find('\0');
            TS_CHECK(nul == std::string::npos,
                     "config key '{}' must not hold a NUL character (U+0000), found at byte {}", name, nul);
            const size_t bad = invalid_utf8_at(s);
            TS_CHECK(bad == std::string::npos,
                     "config key '{}' must be UTF-8 text (config.toml holds only UTF-8), but byte {} "
                     "(0x{:02X}) starts no valid UTF-8 character",
                     name, bad, static_cast<unsigned char>(s[bad]));  // read only on failure
            v = s;
          },
          [&v] { return v; }};
}

// Edit distance, for "did you mean" suggestions.
size_t distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t prev = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t cur = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, prev + (a[i - 1] == b[j - 1] ? 0 : 1)});
      prev = cur;
    }
  }
  return row[b.size()];
}

ConfigKey& find_key(std::vector<ConfigKey>& keys, const std::string& name) {
  for (auto& k : keys)
    if (k.name == name) return k;
  const ConfigKey* best = nullptr;
  size_t best_d = 1000;
  for (auto& k : keys) {
    size_t d = distance(k.name, name);
    if (d < best_d) best_d = d, best = &k;
  }
  // Close: a typo or two, more in long names ("trainer.steps" -> "training.steps").
  if (best && best_d <= std::max<size_t>(2, name.size() / 4))
    TS_CHECK(false, "unknown config key '{}' (did you mean '{}'?)", name, best->name);
  // No close match: list the keys of the section, or the sections.
  std::string section = name.substr(0, name.find('.'));
  std::vector<std::string> in_section, sections;
  for (auto& k : keys) {
    std::string sec = k.name.substr(0, k.name.find('.'));
    if (sec == section) in_section.push_back(k.name.substr(sec.size() + 1));
    if (std::find(sections.begin(), sections.end(), sec) == sections.end()) sections.push_back(sec);
  }
  if (!in_section.empty())
    TS_CHECK(false, "unknown config key '{}' (the keys of [{}] are: {})", name, section,
             fmt::join(in_section, ", "));
  TS_CHECK(false,
           "unknown config key '{}': there is no section '{}' (sections: {}; keys are "
           "section.key, e.g. training.steps)",
           name, section, fmt::join(sections, ", "));
}

}  // namespace

std::vector<ConfigKey> config_keys(TrainConfig& c) {
  return {
      string_key("job.name", c.job.name, "run name, the plot's title (empty: <model.arch>-<dataset>)"),
      string_key("job.dump_folder", c.job.dump_folder,
                 "the run's folder: metrics, plot, traces, checkpoints (empty: out/<job.name>)"),
      int_key("job.seed", c.job.seed, "seed of initialisation and data order"),
      string_key("job.device", c.job.device,
                 "device of the model and batches (cuda: this rank's GPU; auto: cuda when a GPU is "
                 "there, else cpu; async_cpu: CPU kernels on streams, a test device)",
                 {"cpu", "cuda", "auto", "async_cpu"}),
      bool_key("job.check_memory", c.job.check_memory,
               "refuse a run whose planned peak per rank (tessera-plan) does not fit in the memory "
               "available (false: start anyway)"),
      bool_key("job.bind_cores", c.job.bind_cores,
               "keep each rank's threads to cores of its own when the node's ranks fit its cores and "
               "the launcher did not bind them (false: leave placement to the OS)"),
      int_key("job.max_restarts", c.job.max_restarts,
              "restarts from the newest complete checkpoint after a rank fails, under tessera-run "
              "(0 = none; tessera-train alone makes none)"),
      string_key("model.arch", c.model.arch, "model family", {"gpt2", "llama"}),
      int_key("model.n_layer", c.model.n_layer, "transformer blocks"),
      int_key("model.n_head", c.model.n_head, "attention heads"),
      int_key("model.n_kv_head", c.model.n_kv_head, "key/value heads (llama; 0 = n_head)"),
      int_key("model.n_embd", c.model.n_embd, "model width"),
      int_key("model.vocab_size", c.model.vocab_size, "vocabulary (256 for byte tokens)"),
      int_key("model.ffn_hidden", c.model.ffn_hidden, "MLP hidden size (0 = default for arch)"),
      float_key("model.dropout", c.model.dropout, "dropout probability"),
      bool_key("model.bias", c.model.bias, "biases in Linear and LayerNorm (gpt2)"),
      bool_key("model.tie_embeddings", c.model.tie_embeddings,
               "lm_head shares the token embedding"),
      bool_key("model.rope", c.model.rope,
               "rotary q/k instead of learned positions (gpt2; llama always uses rotary)"),
      float_key("model.rope_theta", c.model.rope_theta, "rotary base"),
      float_key("model.norm_eps", c.model.norm_eps, "the norms' epsilon (LayerNorm, RMSNorm)"),
      string_key("model.gelu", c.model.gelu,
                 "the gpt2 MLP's GELU: exact (nanoGPT) or tanh (the approximation GPT-2 and Hugging Face use)",
                 {"exact", "tanh"}),
      int_key("model.moe_experts", c.model.moe_experts,
              "routed experts per MoE layer (llama; 0 = dense MLPs): docs/moe.md"),
      int_key("model.moe_top_k", c.model.moe_top_k, "experts each token is routed to"),
      int_key("model.moe_shared_experts", c.model.moe_shared_experts,
              "experts every token passes through besides its routed ones (DeepSeek, Qwen-MoE)"),
      int_key("model.moe_every", c.model.moe_every,
              "every this many layers is MoE (layer i when (i + 1) % moe_every == 0; 1 = all, Mixtral)"),
      int_key("model.moe_hidden", c.model.moe_hidden, "each expert's hidden width (0 = the dense MLP's)"),
      string_key("model.moe_router", c.model.moe_router,
                 "router scores: softmax (Mixtral, Qwen) or sigmoid with the top-k renormalised (DeepSeek-V3)",
                 {"softmax", "sigmoid"}),
      bool_key("model.moe_norm_topk", c.model.moe_norm_topk,
               "softmax router: the chosen experts' weights rescaled to sum to 1 (Mixtral; sigmoid always is)"),
      string_key("model.moe_balance", c.model.moe_balance,
                 "load balancing: an auxiliary loss (Switch), DeepSeek-V3's loss-free expert bias, or none",
                 {"none", "aux_loss", "bias"}),
      float_key("model.moe_balance_coeff", c.model.moe_balance_coeff,
                "the auxiliary loss's weight, or the bias's step per update (0 = 0.01 for aux_loss, 0.001 for bias)"),
      int_key("training.batch_size", c.training.batch_size, "global batch in sequences"),
      int_key("training.batch_tokens", c.training.batch_tokens,
              "global batch in tokens (> 0: sets training.batch_size to it / training.seq_len; llm.c's -d)"),
      int_key("training.seq_len", c.training.seq_len, "sequence length (the model's block size)"),
      int_key("training.steps", c.training.steps, "optimizer steps"),
      int_key("training.grad_accum", c.training.grad_accum, "micro-batches per step"),
      int_key("training.loss_chunk_rows", c.training.loss_chunk_rows,
              "rows per chunk of the output layer and loss, which then never hold the [tokens, vocabulary] "
              "logits whole (0 = as many as keep a chunk's logits within 256 MiB, where the logits are larger; "
              "-1 = off)"),
      float_key("training.max_norm", c.training.max_norm, "gradient clipping norm (0 = off)"),
      string_key("training.dataset", c.training.dataset, "data source",
                 {"fortunes", "text", "shards"}),
      string_key("training.text", c.training.text, "text file (dataset = text)"),
      string_key("training.train_shard", c.training.train_shard,
                 "llm.c train shard (dataset = shards)"),
      string_key("training.val_shard", c.training.val_shard,
                 "llm.c validation shard (dataset = shards)"),
      string_key("training.tokenizer", c.training.tokenizer,
                 "a Hugging Face tokenizer.json (byte-level BPE) for the text and the samples; '' = byte tokens"),
      string_key("training.data_dir", c.training.data_dir,
                 "where prepared token shards are cached"),
      int_key("training.eval_interval", c.training.eval_interval, "steps between validation runs"),
      int_key("training.eval_batches", c.training.eval_batches, "batches per validation run"),
      bool_key("training.overfit_batch", c.training.overfit_batch,
               "train every step on the first step's batch (debugging: a model that can learn drives its "
               "loss towards 0)"),
      string_key("optimizer.name", c.optimizer.name, "optimizer", {"adamw", "sgd"}),
      float_key("optimizer.lr", c.optimizer.lr, "peak learning rate"),
      float_key("optimizer.beta1", c.optimizer.beta1, "AdamW beta1"),
      float_key("optimizer.beta2", c.optimizer.beta2, "AdamW beta2"),
      float_key("optimizer.eps", c.optimizer.eps, "AdamW epsilon"),
      float_key("optimizer.weight_decay", c.optimizer.weight_decay,
                "weight decay (2-D weights only)"),
      float_key("optimizer.momentum", c.optimizer.momentum, "SGD momentum"),
      string_key("lr_scheduler.name", c.lr_scheduler.name,
                 "the decay after warmup: cosine, linear, constant, or wsd (warmup-stable-decay)",
                 {"cosine", "linear", "constant", "wsd"}),
      int_key("lr_scheduler.warmup_steps", c.lr_scheduler.warmup_steps, "linear warmup steps"),
      float_key("lr_scheduler.min_lr_ratio", c.lr_scheduler.min_lr_ratio,
                "final lr / peak lr (where the decay ends)"),
      int_key("lr_scheduler.decay_steps", c.lr_scheduler.decay_steps,
              "the step the decay ends at, lr staying at the final lr after it (nanoGPT's lr_decay_iters; "
              "0 = training.steps)"),
      float_key("lr_scheduler.decay_ratio", c.lr_scheduler.decay_ratio,
                "wsd: the share of the steps after warmup spent decaying (the rest stays at the peak lr)"),
      int_key("parallelism.data_parallel_shard_degree", c.parallelism.data_parallel_shard_degree,
              "ranks each parameter is sharded over (-1 = world / replicate degree)"),
      int_key("parallelism.data_parallel_replicate_degree",
              c.parallelism.data_parallel_replicate_degree,
              "replica groups (> 1: HSDP on a 2-D mesh)"),
      bool_key("parallelism.reshard_after_forward", c.parallelism.reshard_after_forward,
               "free gathered parameters after forward (false: keep them for backward)"),
      bool_key("parallelism.cpu_offload", c.parallelism.cpu_offload,
               "keep sharded parameters, gradients and optimizer states in host memory and step the optimizer "
               "there (FSDP's CPUOffloadPolicy; no effect with job.device cpu)"),
      bool_key("parallelism.prefetch", c.parallelism.prefetch,
               "issue the next group's all-gather while this one computes (false: only when it runs, "
               "to see what prefetch buys)"),
      int_key("parallelism.tensor_parallel_degree", c.parallelism.tensor_parallel_degree,
              "ranks each layer is split over (Megatron tensor parallelism; 1 = none)"),
      bool_key("parallelism.disable_loss_parallel", c.parallelism.disable_loss_parallel,
               "with tensor parallelism, gather the logits instead of splitting the output layer and the "
               "loss over the vocabulary"),
      bool_key("parallelism.enable_sequence_parallel", c.parallelism.enable_sequence_parallel,
               "with tensor parallelism, split the norms and the residual stream on the sequence too "
               "(all-gather + reduce-scatter in place of each all-reduce)"),
      int_key("parallelism.pipeline_parallel_degree", c.parallelism.pipeline_parallel_degree,
              "pipeline stages, one per rank of the mesh's outermost dim (1 = none): docs/pipeline-parallel.md"),
      string_key("parallelism.pipeline_parallel_schedule", c.parallelism.pipeline_parallel_schedule,
                 "the pipeline's schedule", {"gpipe", "1f1b", "interleaved_1f1b", "zb_h1"}),
      int_key("parallelism.pipeline_parallel_microbatches", c.parallelism.pipeline_parallel_microbatches,
              "micro-batches per step and data-parallel rank (0 = 2 x pipeline_parallel_degree)"),
      int_key("parallelism.pipeline_parallel_stages_per_rank", c.parallelism.pipeline_parallel_stages_per_rank,
              "stages per rank, looped (0 = 1, or 2 for interleaved_1f1b)"),
      string_key("parallelism.pipeline_parallel_layers_per_stage", c.parallelism.pipeline_parallel_layers_per_stage,
                 "blocks per stage, comma-separated, e.g. \"1,3\" ('' = as even as they go, the extra ones "
                 "in the middle)"),
      string_key("parallelism.pipeline_parallel_module_names_per_stage",
                 c.parallelism.pipeline_parallel_module_names_per_stage,
                 "or the stages by the model's module names: stages separated by ';', names by ',' (the "
                 "embeddings on the first, the final norm and lm_head on the last): docs/pipeline-parallel.md"),
      int_key("parallelism.context_parallel_degree", c.parallelism.context_parallel_degree,
              "ranks each sequence is split over (context parallelism; 1 = none): docs/context-parallel.md"),
      string_key("parallelism.context_parallel_rotate_method", c.parallelism.context_parallel_rotate_method,
                 "how attention's K/V reach the other slices: one all-gather per layer, or passed rank to rank",
                 {"allgather", "ring"}),
      bool_key("parallelism.context_parallel_load_balance", c.parallelism.context_parallel_load_balance,
               "cut the sequence into 2 x degree chunks, rank r holding chunks r and 2 x degree - 1 - r, so every "
               "rank does the same causal attention work (false: contiguous runs)"),
      int_key("parallelism.expert_parallel_degree", c.parallelism.expert_parallel_degree,
              "ranks each MoE layer's experts are split over, tokens moved to them by all-to-all (1 = none; it "
              "divides the shard degree): docs/moe.md"),
      int_key("parallelism.reshard_after_forward_degree", c.parallelism.reshard_after_forward_degree,
              "after forward, keep parameters sharded over groups of N ranks, N dividing the shard "
              "degree (hpZ; 0 = as reshard_after_forward says)"),
      string_key("mixed_precision.param_dtype", c.mixed_precision.param_dtype,
                 "dtype parameters are gathered and computed in", {"float32", "bfloat16"}),
      string_key("mixed_precision.reduce_dtype", c.mixed_precision.reduce_dtype,
                 "dtype gradients are reduced in", {"float32", "bfloat16"}),
      string_key("activation_checkpoint.mode", c.activation_checkpoint.mode,
                 "recompute blocks in backward: every block whole (full), or as selective_ac_option says",
                 {"none", "full", "selective"}),
      string_key("activation_checkpoint.selective_ac_option", c.activation_checkpoint.selective_ac_option,
                 "with mode selective: op (keep the matrix products' and attention's outputs, recompute the "
                 "pointwise ops and norms) or an integer k (checkpoint every k-th block whole)"),
      bool_key("checkpoint.enable", c.checkpoint.enable, "save distributed checkpoints"),
      string_key("checkpoint.async_mode", c.checkpoint.async_mode,
                 "off: the ranks wait while a checkpoint is written; async: they stage their shards in host "
                 "memory and train on while a thread writes them (the same files; committed once all are "
                 "written, and before the next save and the end of the run)",
                 {"off", "async"}),
      string_key("checkpoint.folder", c.checkpoint.folder,
                 "checkpoint folder (inside job.dump_folder)"),
      int_key("checkpoint.interval", c.checkpoint.interval,
              "steps between checkpoints (and one at the end)"),
      int_key("checkpoint.keep", c.checkpoint.keep, "newest checkpoints kept (0 = all)"),
      bool_key("checkpoint.resume", c.checkpoint.resume,
               "continue from the newest complete checkpoint"),
      int_key("checkpoint.load_step", c.checkpoint.load_step,
              "with checkpoint.resume: the step to continue from (0 = the latest)"),
      string_key("checkpoint.initial_load_path", c.checkpoint.initial_load_path,
                 "start a fresh run from these weights (.safetensors or checkpoint directory; "
                 "resume wins)"),
      string_key("checkpoint.allow_resume_change", c.checkpoint.allow_resume_change,
                 "keys a resume may find changed, comma-separated (job.seed, training.batch_size, "
                 "training.seq_len, training.grad_accum; refused by default)"),
      string_key("checkpoint.export_safetensors", c.checkpoint.export_safetensors,
                 "at the end, export the model to this .safetensors file (inside job.dump_folder)"),
      string_key("checkpoint.export_dtype", c.checkpoint.export_dtype, "dtype of the export",
                 {"float32", "bfloat16"}),
      int_key("metrics.log_interval", c.metrics.log_interval, "steps between log lines"),
      string_key("metrics.jsonl", c.metrics.jsonl,
                 "JSONL metrics file (inside job.dump_folder; empty = off)"),
      string_key("metrics.plot", c.metrics.plot,
                 "loss-curve PNG at the end (needs gnuplot; empty = off)"),
      float_key("metrics.peak_tflops", c.metrics.peak_tflops,
                "peak TFLOP/s of all the job's hardware, for MFU (0 = this CPU's, measured at start)"),
      string_key("metrics.progress", c.metrics.progress,
                 "progress bar (auto: when stdout is a terminal and no MPI launcher forwards it)",
                 {"auto", "on", "off"}),
      string_key("profiling.trace_steps", c.profiling.trace_steps,
                 "steps to trace, e.g. \"10,11\" (Chrome/Perfetto JSON, all ranks in one file)"),
      string_key("profiling.trace_folder", c.profiling.trace_folder,
                 "trace folder (inside job.dump_folder)"),
      int_key("sample.max_new_tokens", c.sample.max_new_tokens,
              "tokens generated after training (0 = none)"),
      float_key("sample.temperature", c.sample.temperature, "sampling temperature, 0 to 100 (0 = greedy)"),
      int_key("sample.top_k", c.sample.top_k, "sample from the k most likely tokens (0 = all)"),
      string_key("sample.prompt", c.sample.prompt, "prompt for the sample"),
      int_key("sample.interval", c.sample.interval, "also sample every this many steps while training (0 = at the end only)"),
  };
}

namespace {
// A TOML value as the command line would give it ("3", "0.5", "true", the
// string itself); empty for arrays, tables and dates.
std::string toml_text(const toml::node& value) {
  if (value.is_string()) return *value.value<std::string>();
  if (value.is_integer()) return std::to_string(*value.value<int64_t>());
  if (value.is_floating_point()) return fmt::format("{}", *value.value<double>());
  if (value.is_boolean()) return *value.value<bool>() ? "true" : "false";
  return "";
}
}  // namespace

bool toml_reads(const std::string& text) {
  try {
    (void)toml::parse(text);
    return true;
  } catch (const toml::parse_error&) {
    return false;
  }
}

std::map<std::string, std::string> toml_values(const std::string& text) {
  std::map<std::string, std::string> out;
  toml::table table;
  try {
    table = toml::parse(text);
  } catch (const toml::parse_error&) {
    return out;
  }
  for (auto& [section, node] : table) {
    const toml::table* sec = node.as_table();
    if (sec == nullptr) continue;
    for (auto& [key, value] : *sec) {
      if (!value.is_value() || value.is_date() || value.is_time() || value.is_date_time()) continue;
      out[std::string(section.str()) + "." + std::string(key.str())] = toml_text(value);
    }
  }
  return out;
}

void load_toml(TrainConfig& cfg, const std::string& path) {
  // A configuration is a few KiB: anything but a regular file of sane size is a mistake
  // (toml++ reads a directory or /dev/zero as an empty file).
  constexpr uintmax_t kMaxBytes = 1 << 20;
  std::error_code ec;
  auto status = std::filesystem::status(path, ec);
  TS_CHECK(std::filesystem::exists(status), "config file '{}' does not exist", path);
  TS_CHECK(std::filesystem::is_regular_file(status), "config file '{}' is not a regular file{}",
           path, std::filesystem::is_directory(status) ? " but a directory" : "");
  uintmax_t bytes = std::filesystem::file_size(path, ec);
  TS_CHECK(!ec && bytes <= kMaxBytes,
           "config file '{}' is {} bytes: a training configuration is a few KiB (at most {})", path,
           bytes, kMaxBytes);
  toml::table table;
  try {
    table = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    const auto& at = e.source().begin;  // line 0: the file could not be read at all
    TS_CHECK(false, "config file '{}': {}{}", path, std::string(e.description()),
             at.line == 0 ? "" : fmt::format(" (line {}, column {})", at.line, at.column));
  }
  auto keys = config_keys(cfg);
  for (auto& [section, node] : table) {
    const toml::table* sec = node.as_table();
    TS_CHECK(sec != nullptr, "config file '{}': '{}' must be a [section]", path,
             std::string(section.str()));
    for (auto& [key, value] : *sec) {
      std::string name = std::string(section.str()) + "." + std::string(key.str());
      ConfigKey& k = find_key(keys, name);
      // TOML values carry their type: it must be the key's (an integer is a fine float).
      bool type_ok = k.type == "string"  ? value.is_string()
                     : k.type == "int"   ? value.is_integer()
                     : k.type == "float" ? value.is_integer() || value.is_floating_point()
                                         : value.is_boolean();
      std::string text = toml_text(value);
      if (!type_ok) {
        const char* expected = k.type == "string"  ? "a string"
                               : k.type == "int"   ? "an integer"
                               : k.type == "float" ? "a number"
                                                   : "true or false";
        const char* found = value.is_string()           ? "a string"
                            : value.is_integer()        ? "an integer"
                            : value.is_floating_point() ? "a floating-point number"
                            : value.is_boolean()        ? "a boolean"
                            : value.is_array()          ? "an array"
                            : value.is_table()          ? "a table"
                                                        : "a date or time";
        std::string shown = value.is_string() ? " (\"" + text + "\")"
                            : text.empty()    ? std::string()
                                              : " (" + text + ")";
        TS_CHECK(false, "config file '{}': key '{}' expects {}, got {}{}", path, name, expected,
                 found, shown);
      }
      k.set(text);
    }
  }
}

void resolve_config(TrainConfig& cfg) {
  if (cfg.job.name.empty()) {
    // The data's name: the corpus, or the text or shard file's stem (book_train.bin: book).
    std::string data = cfg.training.dataset;
    const std::string& file = data == "text" ? cfg.training.text : data == "shards" ? cfg.training.train_shard : "";
    if (!file.empty()) {
      data = std::filesystem::path(file).stem().string();
      if (data.size() > 6 && data.compare(data.size() - 6, 6, "_train") == 0) data.resize(data.size() - 6);
    }
    cfg.job.name = cfg.model.arch + "-" + data;
    // The same text in a tokenizer's tokens is another run (shards carry their own name).
    if (!cfg.training.tokenizer.empty() && cfg.training.dataset != "shards") cfg.job.name += "-bpe";
    // So is another preset's model (the tiny preset's run beside the default one).
    if (!cfg.job.preset_suffix.empty()) cfg.job.name += "-" + cfg.job.preset_suffix;
    for (char& ch : cfg.job.name)
      if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '-' && ch != '_' && ch != '.') ch = '-';
  }
  if (cfg.job.dump_folder.empty()) cfg.job.dump_folder = (std::filesystem::path("out") / cfg.job.name).string();
  auto& t = cfg.training;
  if (t.batch_tokens == 0) return;
  TS_CHECK(t.batch_tokens > 0 && t.seq_len > 0 && t.batch_tokens % t.seq_len == 0,
           "training.batch_tokens ({}) must be a positive multiple of training.seq_len ({}): the batch is whole "
           "sequences, e.g. --training.batch_tokens {}",
           t.batch_tokens, t.seq_len, t.seq_len > 0 ? std::max<int64_t>(1, t.batch_tokens / t.seq_len) * t.seq_len : 0);
  t.batch_size = t.batch_tokens / t.seq_len;
}

bool parse_args(TrainConfig& cfg, int argc, char** argv, const std::string& program, bool print) {
  auto keys = config_keys(cfg);
  std::vector<std::pair<std::string, std::string>> bases, overrides;  // (name, value) in the order given
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      if (!print) return false;
      std::printf("usage: %s [--preset NAME] [--config FILE.toml] [--section.key VALUE ...]\n\n",
                  program.c_str());
      std::printf("presets:\n");
      for (const auto& p : presets())
        std::printf("  %-14s %s\n", p.name.c_str(), p.description.c_str());
      std::printf("\nkeys, by section: --KEY TYPE = DEFAULT, then what it does\n");
      size_t width = 0;
      for (const auto& k : keys) width = std::max(width, k.name.size());
      std::string section;
      for (const auto& k : keys) {
        const std::string here = k.name.substr(0, k.name.find('.'));
        if (here != section) std::printf("\n[%s]\n", (section = here).c_str());
        std::string text = k.help;
        if (!k.choices.empty() && k.type == "string") text += fmt::format(" [{}]", fmt::join(k.choices, "|"));
        std::printf("  --%-*s %-6s = %s\n", static_cast<int>(width), k.name.c_str(), k.type.c_str(),
                    k.get().empty() ? "''" : k.get().c_str());
        // The help under it, wrapped at 80 columns.
        std::string line;
        std::istringstream words(text);
        for (std::string w; words >> w;) {
          if (!line.empty() && 6 + line.size() + 1 + w.size() > 80) {
            std::printf("      %s\n", line.c_str());
            line.clear();
          }
          line += (line.empty() ? "" : " ") + w;
        }
        if (!line.empty()) std::printf("      %s\n", line.c_str());
      }
      return false;
    }
    TS_CHECK(arg.rfind("--", 0) == 0,
             "unexpected argument '{}' (options look like --section.key value)", arg);
    std::string name = arg.substr(2), value;
    size_t eq = name.find('=');
    if (eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    } else {
      TS_CHECK(i + 1 < argc, "option '{}' needs a value", arg);
      value = argv[++i];
    }
    (name == "config" || name == "preset" ? bases : overrides).emplace_back(name, value);
  }
  // Presets and --config files first (in the order given), then every
  // --section.key, whatever its place on the line: a key given before
  // --preset still wins over the preset (TorchTitan's rule).
  for (const auto& [kind, value] : bases) {
    if (kind == "config") {
      load_toml(cfg, value);
      continue;
    }
    const std::string& wanted = value;  // a structured binding cannot be captured before C++20 in clang
    auto it = std::find_if(presets().begin(), presets().end(), [&](const Preset& p) { return p.name == wanted; });
    if (it == presets().end()) {
      std::vector<std::string> names;
      for (const auto& p : presets()) names.push_back(p.name);
      TS_CHECK(false, "unknown preset '{}' (valid: {})", value, fmt::join(names, ", "));
    }
    it->apply(cfg);
    cfg.job.preset_suffix = it->run_suffix;
  }
  for (const auto& [name, value] : overrides) find_key(keys, name).set(value);
  resolve_config(cfg);
  return true;
}


std::string model_to_json(TrainConfig& cfg) {
  nlohmann::ordered_json j;
  for (const auto& k : config_keys(cfg))
    if (k.name.rfind("model.", 0) == 0 || k.name == "training.seq_len") j[k.name] = k.get();
  return j.dump();
}

void model_from_json(TrainConfig& cfg, const std::string& text, const std::string& source) {
  check_json_nesting(text, source + ": the stored model configuration");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    TS_CHECK(false, "{}: the stored model configuration is not valid JSON: {}", source, e.what());
  }
  TS_CHECK(j.is_object(), "{}: the stored model configuration must be a JSON object, got {}",
           source, j.type_name());
  auto keys = config_keys(cfg);
  for (auto it = j.begin(); it != j.end(); ++it) {
    TS_CHECK(it.value().is_string(),
             "{}: the stored model configuration's '{}' must be a string, got {}", source,
             it.key(), it.value().dump().substr(0, 100));
    try {
      find_key(keys, it.key()).set(it.value().get<std::string>());
    } catch (const Error& e) {
      TS_CHECK(false, "{}: the stored model configuration: {}", source, e.what());
    }
  }
  try {
    transformer_config(cfg).check_file_claims(model_key_names());
  } catch (const Error& e) {
    TS_CHECK(false, "{}: the stored model configuration: {}", source, e.what());
  }
}

std::string to_toml(TrainConfig& cfg) {
  std::string out, section;
  for (const auto& k : config_keys(cfg)) {
    std::string sec = k.name.substr(0, k.name.find('.'));
    if (sec != section) {
      if (!section.empty()) out += "\n";
      out += fmt::format("[{}]\n", sec);
      section = sec;
    }
    std::string v = k.get();
    if (k.type == "string") {
      std::string esc;
      // TOML's basic string: the quote, the backslash and every control
      // character escaped (a raw one makes the file unreadable).
      for (char ch : v) {
        const auto u = static_cast<unsigned char>(ch);
        if (ch == '"' || ch == '\\') esc += '\\';
        if (ch == '\n') esc += "\\n";
        else if (u < 0x20 || u == 0x7f) esc += fmt::format("\\u{:04X}", u);
        else esc += ch;
      }
      v = "\"" + esc + "\"";
    }
    out += fmt::format("{} = {}\n", k.name.substr(sec.size() + 1), v);
  }
  return out;
}

}  // namespace tessera::tools
