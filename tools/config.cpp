#include "tools/config.h"

#include <toml++/toml.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <map>

#include "runtime/check.h"

namespace tessera::tools {

namespace {

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
            try {
              x = std::stod(s, &used);
            } catch (const std::exception&) {
              used = 0;
            }
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
      int_key("training.batch_size", c.training.batch_size, "global batch in sequences"),
      int_key("training.batch_tokens", c.training.batch_tokens,
              "global batch in tokens (> 0: sets training.batch_size to it / training.seq_len; llm.c's -d)"),
      int_key("training.seq_len", c.training.seq_len, "sequence length (the model's block size)"),
      int_key("training.steps", c.training.steps, "optimizer steps"),
      int_key("training.grad_accum", c.training.grad_accum, "micro-batches per step"),
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
      int_key("parallelism.reshard_after_forward_degree", c.parallelism.reshard_after_forward_degree,
              "after forward, keep parameters sharded over groups of N ranks, N dividing the shard "
              "degree (hpZ; 0 = as reshard_after_forward says)"),
      string_key("mixed_precision.param_dtype", c.mixed_precision.param_dtype,
                 "dtype parameters are gathered and computed in", {"float32", "bfloat16"}),
      string_key("mixed_precision.reduce_dtype", c.mixed_precision.reduce_dtype,
                 "dtype gradients are reduced in", {"float32", "bfloat16"}),
      string_key("activation_checkpoint.mode", c.activation_checkpoint.mode,
                 "recompute blocks in backward", {"none", "full"}),
      bool_key("checkpoint.enable", c.checkpoint.enable, "save distributed checkpoints"),
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
      float_key("sample.temperature", c.sample.temperature, "sampling temperature (0 = greedy)"),
      int_key("sample.top_k", c.sample.top_k, "sample from the k most likely tokens (0 = all)"),
      string_key("sample.prompt", c.sample.prompt, "prompt for the sample"),
      int_key("sample.interval", c.sample.interval, "also sample every this many steps while training (0 = at the end only)"),
  };
}

const std::vector<Preset>& presets() {
  static const std::vector<Preset> p = {
      {"default", "GPT, 4 layers, d=256, byte tokens, on the fortunes corpus (as `make train`)",
       [](TrainConfig&) {}},
      {"tiny", "GPT, 2 layers, d=64: seconds, for tests and smoke runs",
       [](TrainConfig& c) {
         c.model.n_layer = 2;
         c.model.n_head = 2;
         c.model.n_embd = 64;
         c.training.batch_size = 8;
         c.training.seq_len = 64;
         c.training.steps = 150;  // a second or two, and the validation loss ~17% under the unigram baseline
         c.training.eval_interval = 50;
         c.training.eval_batches = 4;
         c.lr_scheduler.warmup_steps = 5;
         c.metrics.log_interval = 10;
         c.sample.max_new_tokens = 50;
       }},
      {"llama-small", "Llama (RoPE, RMSNorm, SwiGLU, GQA), 4 layers, d=256, 8 heads, 2 KV heads",
       [](TrainConfig& c) {
         c.model.arch = "llama";
         c.model.n_head = 8;
         c.model.n_kv_head = 2;
         c.model.bias = false;
       }},
      {"gpt-medium", "GPT, 8 layers, d=384, 6 heads: a larger run",
       [](TrainConfig& c) {
         c.model.n_layer = 8;
         c.model.n_head = 6;
         c.model.n_embd = 384;
         c.training.steps = 2000;
       }},
  };
  return p;
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
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      if (!print) return false;
      std::printf("usage: %s [--preset NAME] [--config FILE.toml] [--section.key VALUE ...]\n\n",
                  program.c_str());
      std::printf("presets:\n");
      for (const auto& p : presets())
        std::printf("  %-14s %s\n", p.name.c_str(), p.description.c_str());
      std::printf("\nkeys (default value):\n");
      for (const auto& k : keys) {
        std::string choices;
        if (!k.choices.empty() && k.type == "string")
          choices = fmt::format(" [{}]", fmt::join(k.choices, "|"));
        std::printf("  --%-30s %-7s %s%s (%s)\n", k.name.c_str(), k.type.c_str(), k.help.c_str(),
                    choices.c_str(), k.get().c_str());
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
    if (name == "config") {
      load_toml(cfg, value);
    } else if (name == "preset") {
      auto it = std::find_if(presets().begin(), presets().end(),
                             [&](const Preset& p) { return p.name == value; });
      if (it == presets().end()) {
        std::vector<std::string> names;
        for (const auto& p : presets()) names.push_back(p.name);
        TS_CHECK(false, "unknown preset '{}' (valid: {})", value, fmt::join(names, ", "));
      }
      it->apply(cfg);
    } else {
      find_key(keys, name).set(value);
    }
  }
  resolve_config(cfg);
  return true;
}

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

// A size built from configuration values, carrying the expression it came
// from: every product and sum is checked, and an overflow names the keys.
struct Size {
  int64_t value;
  std::string expr;
};
Size key(const char* name, int64_t value) {
  return {value, name};
}
Size operator*(const Size& a, const Size& b) {
  int64_t r = 0;
  TS_CHECK(!__builtin_mul_overflow(a.value, b.value, &r),
           "{} x {} = {} x {} overflows a 64-bit integer: make one of them smaller", a.expr,
           b.expr, a.value, b.value);
  return {r, a.expr + " x " + b.expr};
}
Size operator*(int64_t k, const Size& a) {
  return Size{k, std::to_string(k)} * a;
}
Size operator+(const Size& a, const Size& b) {
  int64_t r = 0;
  TS_CHECK(!__builtin_add_overflow(a.value, b.value, &r),
           "{} + {} = {} + {} overflows a 64-bit integer: make one of them smaller", a.expr,
           b.expr, a.value, b.value);
  return {r, "(" + a.expr + " + " + b.expr + ")"};
}

}  // namespace

void validate(const TrainConfig& c) {
  const auto& m = c.model;
  const auto& t = c.training;
  const auto& o = c.optimizer;

  at_least("model.n_layer", m.n_layer, 1);
  at_least("model.n_head", m.n_head, 1);
  at_least("model.n_embd", m.n_embd, 1);
  at_least("model.vocab_size", m.vocab_size, 1);
  at_least("model.n_kv_head", m.n_kv_head, 0, " (0 = model.n_head)");
  at_least("model.ffn_hidden", m.ffn_hidden, 0, " (0 = the default of model.arch)");
  TS_CHECK(
      m.n_embd % m.n_head == 0,
      "model.n_embd ({}) must be divisible by model.n_head ({}): each head has n_embd / n_head "
      "channels",
      m.n_embd, m.n_head);
  if (m.arch == "llama") {
    int64_t kv = m.n_kv_head > 0 ? m.n_kv_head : m.n_head;
    TS_CHECK(m.n_head % kv == 0,
             "model.n_kv_head ({}) must divide model.n_head ({}): each key/value head serves "
             "n_head / n_kv_head query heads",
             m.n_kv_head, m.n_head);
    TS_CHECK(m.n_embd / m.n_head % 2 == 0,
             "model.arch = llama needs an even head size for rotary embeddings, but model.n_embd / "
             "model.n_head = {} / {} = {}",
             m.n_embd, m.n_head, m.n_embd / m.n_head);
  } else {
    TS_CHECK(!m.rope || m.n_embd / m.n_head % 2 == 0,
             "model.rope needs an even head size, but model.n_embd / model.n_head = {} / {} = {}",
             m.n_embd, m.n_head, m.n_embd / m.n_head);
    TS_CHECK(m.n_kv_head == 0 || m.n_kv_head == m.n_head,
             "model.n_kv_head ({}) applies to model.arch = llama only ({} has model.n_head = {} "
             "key/value heads): leave it 0",
             m.n_kv_head, m.arch, m.n_head);
  }
  TS_CHECK(m.arch != "llama" || m.gelu == "exact",
           "model.gelu = {} applies to model.arch = gpt2 (Llama's MLP is SwiGLU, without GELU)", m.gelu);
  in_range("model.dropout", m.dropout, 0, 1, true);
  TS_CHECK(m.rope_theta > 0, "model.rope_theta must be > 0, got {}", m.rope_theta);
  TS_CHECK(m.norm_eps > 0 && m.norm_eps < 1, "model.norm_eps must be in (0, 1), got {}", m.norm_eps);
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
  not_empty("training.data_dir", t.data_dir);
  at_least("training.eval_interval", t.eval_interval, 1, " (steps between validation runs)");
  at_least("training.eval_batches", t.eval_batches, 1);
  // What the run computes from these (token and sample counts, data positions) must fit in 64 bits.
  (void)(key("training.batch_size", t.batch_size) * key("training.seq_len", t.seq_len));
  (void)(key("training.steps", t.steps) * key("training.batch_size", t.batch_size));
  (void)(key("training.eval_batches", t.eval_batches) * key("training.batch_size", t.batch_size));
  parameter_count(c);

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

  not_empty("checkpoint.folder", c.checkpoint.folder);
  at_least("checkpoint.interval", c.checkpoint.interval, 1);
  at_least("checkpoint.keep", c.checkpoint.keep, 0, " (0 = keep all)");
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
  TS_CHECK(c.sample.temperature >= 0, "sample.temperature must be >= 0 (0 = greedy), got {}",
           c.sample.temperature);
  at_least("sample.top_k", c.sample.top_k, 0, " (0 = all tokens)");
  at_least("sample.interval", c.sample.interval, 0, " (0 = at the end only)");
  TS_CHECK(c.sample.max_new_tokens == 0 || !c.sample.prompt.empty(),
           "sample.prompt must not be empty when sample.max_new_tokens is {} (set it to 0 for no "
           "sample)",
           c.sample.max_new_tokens);
}

void validate_for_world(const TrainConfig& c, int world_size) {
  const int64_t shard = mesh_shape(c, world_size).second, dp = data_parallel_ranks(c, world_size);
  const int64_t n = c.parallelism.reshard_after_forward_degree;
  TS_CHECK(n == 0 || (n >= 1 && shard % n == 0),
           "parallelism.reshard_after_forward_degree ({}) must divide the shard degree ({} at {} ranks), or be 0",
           n, shard, world_size);
  int64_t unit = (key("training.grad_accum", c.training.grad_accum) * key("ranks", dp)).value;
  int64_t below = c.training.batch_size / unit * unit, above = 0;
  if (__builtin_add_overflow(below, unit, &above)) above = below;  // no larger multiple fits
  TS_CHECK(c.training.batch_size % unit == 0,
           "training.batch_size ({}) must be a multiple of training.grad_accum ({}) x {} ({}): "
           "e.g. --training.batch_size {}",
           c.training.batch_size, c.training.grad_accum, dp == world_size ? "ranks" : "data-parallel ranks", dp,
           below > 0 && above != below ? fmt::format("{} or {}", below, above)
                                       : fmt::format("{}", below > 0 ? below : above));
  TS_CHECK(!c.checkpoint.enable || c.optimizer.name == "adamw",
           "checkpoint.enable needs optimizer.name = adamw (SGD momentum is not checkpointed)");
}

std::vector<int64_t> trace_steps(const TrainConfig& c) {
  std::vector<int64_t> out;
  std::string s = c.profiling.trace_steps;
  size_t at = 0;
  while (at < s.size()) {
    size_t end = s.find(',', at);
    std::string item = s.substr(at, end == std::string::npos ? std::string::npos : end - at);
    size_t used = 0;
    long long v = -1;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    TS_CHECK(used == item.size() && !item.empty() && v >= 1,
             "profiling.trace_steps expects step numbers >= 1 separated by commas (e.g. "
             "\"10,11\"), got '{}'",
             s);
    out.push_back(v);
    if (end == std::string::npos) break;
    at = end + 1;
  }
  return out;
}

std::pair<int64_t, int64_t> mesh_shape(const TrainConfig& c, int world_size) {
  int64_t rep = c.parallelism.data_parallel_replicate_degree;
  int64_t shard = c.parallelism.data_parallel_shard_degree;
  const int64_t tp = std::max<int64_t>(c.parallelism.tensor_parallel_degree, 1);
  if (shard == -1) {
    TS_CHECK(world_size % (rep * tp) == 0,
             "parallelism.data_parallel_replicate_degree ({}){} must divide the number of ranks ({})", rep,
             tp > 1 ? fmt::format(" x tensor_parallel_degree ({})", tp) : "", world_size);
    shard = world_size / (rep * tp);
  }
  TS_CHECK((key("parallelism.data_parallel_replicate_degree", rep) *
            key("parallelism.data_parallel_shard_degree", shard) * key("parallelism.tensor_parallel_degree", tp))
                   .value == world_size,
           "parallelism: replicate degree {} x shard degree {}{} = {} ranks, but the job has {}", rep, shard,
           tp > 1 ? fmt::format(" x tensor-parallel degree {}", tp) : "", rep * shard * tp, world_size);
  return {rep, shard};
}

int64_t data_parallel_ranks(const TrainConfig& c, int world_size) {
  auto [rep, shard] = mesh_shape(c, world_size);
  return rep * shard;
}

MeshDims mesh_dims(const TrainConfig& c, int world_size) {
  auto [rep, shard] = mesh_shape(c, world_size);
  const int64_t tp = c.parallelism.tensor_parallel_degree;
  MeshDims d;
  auto dim = [&](int64_t size, const char* name) { d.shape.push_back(size), d.names.emplace_back(name); };
  if (rep > 1) dim(rep, "dp_replicate");
  dim(shard, "dp_shard");
  if (tp > 1) dim(tp, "tp");
  return d;
}

int64_t parameter_count(const TrainConfig& c) {
  const auto& m = c.model;
  Size C = key("model.n_embd", m.n_embd), V = key("model.vocab_size", m.vocab_size);
  Size L = key("model.n_layer", m.n_layer), zero{0, "0"};
  Size embeddings = V * C;
  Size head = m.tie_embeddings ? zero : C * V;
  Size block = zero;
  Size norm = m.arch == "llama" || !m.bias ? C : 2 * C;  // weight (and bias)
  if (m.arch == "llama") {
    Size kv = m.n_kv_head > 0 ? key("model.n_kv_head", m.n_kv_head) : key("model.n_head", m.n_head);
    Size hidden = m.ffn_hidden > 0 ? key("model.ffn_hidden", m.ffn_hidden)
                                   : Size{((8 * C).value / 3 + 63) / 64 * 64, "model.n_embd x 8/3"};
    // q and o: C x C; k and v: C x (n_kv_head x head size) = C x C / (n_head / n_kv_head).
    Size kv_width{m.n_embd / m.n_head * kv.value, "model.n_embd / model.n_head x " + kv.expr};
    block = 2 * (C * C) + 2 * (C * kv_width) + 3 * (C * hidden) + 2 * C;
  } else {
    Size hidden = m.ffn_hidden > 0 ? key("model.ffn_hidden", m.ffn_hidden) : 4 * C;
    Size biases = m.bias ? 3 * C + C + hidden + C : zero;  // c_attn, attn c_proj, c_fc, mlp c_proj
    block = 4 * (C * C) + 2 * (C * hidden) + biases + 2 * norm;
    if (!m.rope) embeddings = embeddings + key("training.seq_len", c.training.seq_len) * C;
  }
  return (embeddings + L * block + norm + head).value;
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
  m.activation_checkpoint = c.activation_checkpoint.mode == "full";
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

std::shared_ptr<nn::LanguageModel> make_model(const TrainConfig& c, Device device) {
  if (c.model.arch == "llama") return std::make_shared<nn::Llama>(transformer_config(c), device);
  return std::make_shared<nn::GPT>(transformer_config(c), device);
}

std::string model_to_json(TrainConfig& cfg) {
  nlohmann::ordered_json j;
  for (const auto& k : config_keys(cfg))
    if (k.name.rfind("model.", 0) == 0 || k.name == "training.seq_len") j[k.name] = k.get();
  return j.dump();
}

void model_from_json(TrainConfig& cfg, const std::string& text, const std::string& source) {
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
             it.key(), it.value().dump());
    try {
      find_key(keys, it.key()).set(it.value().get<std::string>());
    } catch (const Error& e) {
      TS_CHECK(false, "{}: the stored model configuration: {}", source, e.what());
    }
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
      for (char ch : v) {
        if (ch == '"' || ch == '\\') esc += '\\';
        if (ch == '\n') {
          esc += "\\n";
          continue;
        }
        esc += ch;
      }
      v = "\"" + esc + "\"";
    }
    out += fmt::format("{} = {}\n", k.name.substr(sec.size() + 1), v);
  }
  return out;
}

}  // namespace tessera::tools
