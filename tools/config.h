// tessera-train's configuration: sections in the spirit of TorchTitan's,
// loaded from TOML and overridable key by key from the command line
// (`--training.steps 200`). Every key is registered once with its type, help
// and (for strings) its valid choices; an unknown key or a bad value is an
// error that names it and what would be valid.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "nn/models.h"
#include "train/optimizer.h"
#include "train/parallelize.h"
#include "train/step.h"

namespace tessera::tools {

struct TrainConfig {
  struct Job {
    std::string name = "";         // "" = <model.arch>-<dataset>[-<preset>], e.g. gpt2-fortunes, gpt2-fortunes-tiny
    std::string dump_folder = "";  // metrics, plots, traces, checkpoints; "" = out/<job.name>
    int64_t seed = 1234;
    // Where tensors live: cpu, cuda (this rank's GPU), auto (cuda when a GPU is
    // visible, else cpu), or async_cpu (the CPU's kernels on worker-thread
    // streams: the run then syncs with the host only at log steps).
    std::string device = "cpu";
    // Refuse a run whose planned peak (tools/plan.h) exceeds the memory available.
    bool check_memory = true;
    // Keep each rank's threads to cores of its own when the node's ranks fit
    // them (tools::rank_cpus); false leaves placement to the OS.
    bool bind_cores = true;
    // Restarts tessera-run makes after a failure, each from the newest
    // complete checkpoint (tools/restart.h); tessera-train alone ignores it.
    int64_t max_restarts = 0;
    // The last --preset's run suffix (not a config key): a run of another
    // preset keeps its own folder (an empty job.name ends with it).
    std::string preset_suffix = "";
  } job;
  struct Model {
    std::string arch = "gpt2";  // gpt2 | llama
    int64_t n_layer = 4;
    int64_t n_head = 4;
    int64_t n_kv_head = 0;  // llama: 0 = n_head
    int64_t n_embd = 256;
    int64_t vocab_size = 256;
    int64_t ffn_hidden = 0;
    double dropout = 0.0;
    bool bias = true;
    bool tie_embeddings = true;
    bool rope = false;          // gpt2: rotary q/k instead of learned positions (llama: always)
    double rope_theta = 10000.0;
    double norm_eps = 1e-5;      // LayerNorm / RMSNorm epsilon (Hugging Face Llama: 1e-6 or 1e-5)
    std::string gelu = "exact";  // gpt2 MLP: exact (nanoGPT) | tanh (GPT-2, Hugging Face's gelu_new)
    // Mixture of experts (llama; nn/moe.h, docs/moe.md): 0 experts = dense MLPs.
    int64_t moe_experts = 0;
    int64_t moe_top_k = 2;
    int64_t moe_shared_experts = 0;
    int64_t moe_every = 1;
    int64_t moe_hidden = 0;              // each expert's width (0 = ffn_hidden's default)
    std::string moe_router = "softmax";  // softmax | sigmoid
    bool moe_norm_topk = true;           // softmax: the chosen weights rescaled to sum to 1 (Mixtral)
    std::string moe_balance = "aux_loss";  // none | aux_loss | bias
    double moe_balance_coeff = 0;        // 0 = the method's default (aux_loss 0.01, bias 0.001)
  } model;
  struct Training {
    int64_t batch_size = 16;  // global batch, in sequences
    int64_t batch_tokens = 0;  // > 0: the global batch in tokens (llm.c's -d), setting batch_size
    int64_t seq_len = 128;
    int64_t steps = 600;
    int64_t grad_accum = 1;            // micro-batches per step
    double max_norm = 1.0;             // gradient clipping (0: off)
    // The output layer and loss in chunks of rows (nn::LanguageModel::loss):
    // 0 as many rows as keep one chunk's logits within 256 MiB, where the
    // logits are larger than that; -1 off (the [tokens, vocabulary] logits whole)
    int64_t loss_chunk_rows = 0;
    std::string dataset = "fortunes";  // fortunes | text | shards
    std::string text = "";             // dataset = text: a text file to train on
    std::string train_shard = "";      // dataset = shards: llm.c token shards
    std::string val_shard = "";
    // A Hugging Face tokenizer.json (GPT-2's byte-level BPE): the tokens of the
    // text datasets and of the samples ("" = byte tokens, vocabulary 256).
    std::string tokenizer = "";
    std::string data_dir = "data";
    int64_t eval_interval = 200;
    int64_t eval_batches = 16;
    bool overfit_batch = false;  // every step trains on the first step's batch (a model that can learn drives its loss down)
  } training;
  struct Optimizer {
    std::string name = "adamw";  // adamw | sgd
    double lr = 2e-3;
    double beta1 = 0.9;
    double beta2 = 0.95;
    double eps = 1e-8;
    double weight_decay = 0.1;
    double momentum = 0.9;  // sgd
  } optimizer;
  struct LRScheduler {
    std::string name = "cosine";  // cosine | linear | constant | wsd (warmup-stable-decay)
    int64_t warmup_steps = 60;
    double min_lr_ratio = 0.1;  // the decay ends at lr * min_lr_ratio
    int64_t decay_steps = 0;    // the step the decay ends at (nanoGPT's lr_decay_iters); 0 = training.steps
    double decay_ratio = 0.2;   // wsd: the share of the steps after warmup spent decaying
  } lr_scheduler;
  struct Parallelism {
    int64_t data_parallel_shard_degree = -1;     // ranks a parameter is sharded over (-1: the rest)
    int64_t data_parallel_replicate_degree = 1;  // > 1: HSDP, a 2-D (replicate, shard) mesh
    bool reshard_after_forward = true;           // false: ZeRO-2 style, no all-gather in backward
    // false: no implicit forward prefetch and no default backward prefetch, each
    // group's all-gather issued only when the group runs (to see what prefetch buys)
    bool prefetch = true;
    // > 0: after forward, keep each parameter sharded over groups of this many
    // ranks (PyTorch's reshard_after_forward=N, ZeRO++'s hpZ): backward's
    // all-gather stays within them. Divides the shard degree; overrides the above.
    int64_t reshard_after_forward_degree = 0;
    // FSDP's CPUOffloadPolicy: sharded parameters, gradients and optimizer
    // states in host memory, the optimizer on the host (no effect on the CPU)
    bool cpu_offload = false;
    // > 1: Megatron tensor parallelism (tp/parallelize.h, Llama) over groups of
    // this many consecutive ranks, the mesh's innermost dim; the data-parallel
    // degrees share the rest. The ranks of one group train on the same rows.
    int64_t tensor_parallel_degree = 1;
    // With tensor parallelism, the output layer is split over the vocabulary
    // and the loss computed on the sharded logits (TorchTitan's default; a
    // tied output layer is split as its embedding table is, on the vocabulary).
    bool disable_loss_parallel = false;
    // With tensor parallelism, the activations between the split layers (the
    // residual stream, the norms) are split on the sequence too (Megatron's
    // sequence parallelism): all-gathers and reduce-scatters in place of the
    // all-reduces, and those activations' memory divided by the degree.
    bool enable_sequence_parallel = false;
    // > 1: pipeline parallelism (pp/pipeline.h) over this many stages, the
    // mesh's outermost dim; the data-parallel and tensor-parallel degrees
    // share the rest. Each stage's rank holds its blocks only.
    int64_t pipeline_parallel_degree = 1;
    std::string pipeline_parallel_schedule = "1f1b";  // gpipe | 1f1b | interleaved_1f1b | zb_h1
    int64_t pipeline_parallel_microbatches = 0;       // per step and data-parallel rank (0: 2 x the degree)
    int64_t pipeline_parallel_stages_per_rank = 0;    // 0: 1, or 2 for interleaved_1f1b
    std::string pipeline_parallel_layers_per_stage;   // "2,3,3": blocks per stage ('' = as even as they go)
    // Or the stages by module names (TorchTitan's module_fqns_per_model_part):
    // stages separated by ';', names by ',' ("transformer.wte,transformer.h.0;transformer.h.1,lm_head").
    std::string pipeline_parallel_module_names_per_stage;
    // > 1: context parallelism (cp/context_parallel.h): every sequence split
    // over this many ranks, a mesh dim between the data-parallel and the
    // tensor-parallel ones; attention exchanges K/V between them, FSDP shards
    // over data x context. The ranks of one group train on the same rows.
    int64_t context_parallel_degree = 1;
    std::string context_parallel_rotate_method = "allgather";  // allgather | ring
    bool context_parallel_load_balance = true;  // head-tail chunks (false: contiguous runs)
    // > 1: expert parallelism (ep/expert_parallel.h): every MoE layer's experts
    // split over groups of this many data-parallel ranks (it divides the shard
    // degree), tokens moved to them and back by all-to-all.
    int64_t expert_parallel_degree = 1;
  } parallelism;
  struct MixedPrecision {
    std::string param_dtype = "float32";   // float32 | bfloat16: compute dtype of gathered params
    std::string reduce_dtype = "float32";  // float32 | bfloat16: gradient reduce-scatter dtype
  } mixed_precision;
  struct ActivationCheckpoint {
    std::string mode = "none";  // none | full | selective
    // mode selective (TorchTitan's option): "op" keeps every block's matrix
    // products' and attention's outputs and recomputes the rest; an integer
    // k checkpoints every k-th block whole (blocks 0, k, 2k, ...)
    std::string selective_ac_option = "op";
  } activation_checkpoint;
  struct Checkpoint {
    bool enable = false;
    // off: every rank waits while the checkpoint is written; async: the ranks
    // stage their shards in host memory and train on while a thread writes
    // them (fsdp::AsyncCheckpointer), the same files
    std::string async_mode = "off";
    std::string folder = "checkpoint";  // inside job.dump_folder unless absolute
    int64_t interval = 200;             // steps between checkpoints (and one at the end)
    int64_t keep = 2;                   // newest complete checkpoints kept (0: all)
    bool resume = false;
    int64_t load_step = 0;  // with resume: the step to continue from (0 = the latest)                // continue from the newest complete checkpoint
    // A fresh run (step 0, new optimizer) starts from these model weights: a
    // .safetensors file or a checkpoint directory; a checkpoint to resume wins.
    std::string initial_load_path = "";
    // Comma-separated resume_exact_keys() a resume may find changed (the run
    // then no longer continues the saved one exactly).
    std::string allow_resume_change = "";
    std::string export_safetensors =
        "";  // at the end: write the model here (inside dump_folder unless absolute)
    std::string export_dtype = "float32";
  } checkpoint;
  struct Metrics {
    int64_t log_interval = 25;
    std::string jsonl = "metrics.jsonl";  // inside dump_folder ("" = off)
    std::string plot = "loss.png";        // loss curve at the end ("" = off; needs gnuplot)
    double peak_tflops = 0;               // the job's peak for MFU, all ranks together (0 = measured)
    std::string progress =
        "auto";  // auto | on | off: the progress bar (auto: a terminal, no launcher)
  } metrics;
  struct Profiling {
    std::string trace_steps = "";         // e.g. "10,11": Chrome/Perfetto traces of those steps
    std::string trace_folder = "traces";  // inside dump_folder
  } profiling;
  struct Sample {
    int64_t max_new_tokens = 300;
    double temperature = 0.8;
    int64_t top_k = 40;
    std::string prompt = "Q: ";
    int64_t interval = 0;  // > 0: also sample every this many steps while training
  } sample;
};

// One registered key.
struct ConfigKey {
  std::string name;  // "training.steps"
  std::string type;  // int | float | bool | string
  std::string help;
  std::vector<std::string> choices;             // strings: the valid values (empty: any)
  std::function<void(const std::string&)> set;  // parses and assigns, throws naming the key
  std::function<std::string()> get;
};

std::vector<ConfigKey> config_keys(TrainConfig& cfg);

// Built-in presets: name, one-line description, what they override, and the
// suffix an unnamed run of theirs takes, so that it keeps a folder of its own
// (gpt2-fortunes-tiny beside the default run's gpt2-fortunes).
struct Preset {
  std::string name, description;
  std::function<void(TrainConfig&)> apply;
  std::string run_suffix = "";
};
const std::vector<Preset>& presets();

// Applies a TOML file (sections and keys as above).
void load_toml(TrainConfig& cfg, const std::string& path);
// The "section.key" -> value pairs of a config TOML text (as to_toml writes it
// into checkpoints), values as the command line would give them; empty if the
// text does not parse.
std::map<std::string, std::string> toml_values(const std::string& text);
// Whether `text` parses as TOML (toml_values is empty both where it does not
// and where it holds no settings).
bool toml_reads(const std::string& text);
// Parses argv: `--config file.toml`, `--preset name`, `--section.key value` or
// `--section.key=value`. Presets and config files apply first, in the order
// given; then every --section.key, wherever it stands (a flag always wins).
// Returns false when --help was asked (after printing it when `print`: under
// mpirun only rank 0 prints).
bool parse_args(TrainConfig& cfg, int argc, char** argv, const std::string& program,
                bool print = true);
// Checks every key's range and the keys' consistency (e.g. n_embd divisible
// by n_head) before any work; throws naming the key, the value and what is allowed.
void validate(const TrainConfig& cfg);
// What other settings decide, once they are all read (parse_args does it
// after the last argument): training.batch_tokens > 0 sets
// training.batch_size (tokens / seq_len, which must divide); an empty
// job.name becomes <model.arch>-<dataset> (the text or shard file's name;
// -bpe added where training.tokenizer tokenizes the text),
// an empty job.dump_folder out/<job.name>, so that runs on other models or
// data keep their own metrics, plots and checkpoints.
void resolve_config(TrainConfig& cfg);
// Checks what depends on the number of ranks (mesh degrees, batch split).
void validate_for_world(const TrainConfig& cfg, int world_size);
// "10,11" -> {10, 11}: numbers >= 1 separated by commas; throws with `what`
// ("profiling.trace_steps expects step numbers >= 1") and the text.
std::vector<int64_t> positive_list(const std::string& text, const std::string& what);
// The steps named by profiling.trace_steps (1-based), validated.
std::vector<int64_t> trace_steps(const TrainConfig& cfg);
// The model's parameter count from the configuration alone (nothing built:
// nn::TransformerConfig::parameter_count under the keys' names).
int64_t parameter_count(const TrainConfig& cfg);
// A lower bound of the host memory one rank needs: its shard of the f32
// weights, gradients and optimizer state, and one micro-batch's logits.
// (Activations, gathered groups and the allocator's slack come on top: the
// planner's job; this bound only refuses what cannot fit at all.)
struct MemoryFloor {
  int64_t parameters = 0, shard_degree = 1, micro_batch = 0;
  double state_bytes = 0, logits_bytes = 0;
  double per_rank() const { return state_bytes + logits_bytes; }
};
// training = false: one process running the model (the f32 weights and one
// sequence's logits), as tessera-generate and tessera-ckpt do.
MemoryFloor memory_floor(const TrainConfig& cfg, int world_size, bool training = true);
// Refuses, before anything is allocated, a run whose floor for the ranks on
// this node exceeds the memory available to them, naming the figures.
void check_memory(const TrainConfig& cfg, int world_size, int ranks_here, double available_bytes,
                  bool training = true);
// The host memory this process may still take: the kernel's MemAvailable,
// capped by the cgroup's limit (a container) where one is set; infinity when
// neither can be read.
double available_host_memory();
// The data-parallel mesh {replicate, shard} for world_size ranks (-1 resolved).
std::pair<int64_t, int64_t> mesh_shape(const TrainConfig& cfg, int world_size);
// The data-parallel ranks (replicate x shard): the world over the tensor-parallel degree.
int64_t data_parallel_ranks(const TrainConfig& cfg, int world_size);
// Whether the run computes its loss on vocabulary-sharded logits: tensor
// parallelism with parallelism.disable_loss_parallel off.
bool loss_parallel(const TrainConfig& cfg);
// Whether the run splits activations on the sequence: tensor parallelism with
// parallelism.enable_sequence_parallel.
bool sequence_parallel(const TrainConfig& cfg);
// tessera-train's mesh, outermost dim first: dp_replicate (when > 1), dp_shard,
// tp (when > 1), as sizes and names (train::mesh_dims, its errors naming the keys).
using MeshDims = train::MeshDims;
MeshDims mesh_dims(const TrainConfig& cfg, int world_size);

// The library's options (train/) the configuration's sections map to.
train::ParallelismOptions parallelism_options(const TrainConfig& cfg);
train::OptimizerOptions optimizer_options(const TrainConfig& cfg);
train::ScheduleOptions schedule_options(const TrainConfig& cfg);
train::StepOptions step_options(const TrainConfig& cfg);
// The [model] section (and training.seq_len, the block size) as a JSON object
// of strings, stored in checkpoints and exported files so tools can rebuild
// the model; and back (unknown keys are errors).
// Keys whose change makes a resumed run another run (data order, batches):
// job.seed, training.batch_size, training.seq_len, training.grad_accum.
const std::vector<std::string>& resume_exact_keys();
// "a,b,,c" -> {"a", "b", "c"} (empty items dropped).
std::vector<std::string> split_list(const std::string& list);

// The dtype a config value names ("bfloat16" or "float32").
DType dtype_of(const std::string& name);

// The model's configuration for nn::make_model (block size = seq_len), and
// back: [model] and training.seq_len from a model's configuration (an import).
nn::TransformerConfig transformer_config(const TrainConfig& c);
void set_model(TrainConfig& c, const nn::TransformerConfig& m);
// nn's names of the model's fields as the config keys that set them
// ("n_embd" -> "model.n_embd", "block_size" -> "training.seq_len"), for its
// validation messages.
nn::TransformerConfig::FieldNames model_key_names();
// The model of c.model.arch, built on `device` (meta: no bytes until to_empty).
std::shared_ptr<nn::LanguageModel> make_model(const TrainConfig& c, Device device);
std::string model_to_json(TrainConfig& cfg);
// source (the file it came from) names the file in errors.
void model_from_json(TrainConfig& cfg, const std::string& json, const std::string& source);
// The whole configuration as TOML (what a run used).
std::string to_toml(TrainConfig& cfg);

}  // namespace tessera::tools
