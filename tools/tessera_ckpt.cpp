// tessera-ckpt: inspects and converts checkpoints (one process, any size of
// the run that saved them).
//
//   tessera-ckpt list PATH
//       PATH: a checkpoint directory (step-N), a checkpoint folder (its newest
//       complete checkpoint) or a .safetensors file. Every tensor with dtype,
//       shape, placements, chunks and size; the step, world size and stored
//       model configuration.
//   tessera-ckpt to-safetensors CHECKPOINT OUT.safetensors [--dtype bfloat16] [--with-optimizer]
//       The model (and optionally the AdamW state) as one safetensors file,
//       assembled tensor by tensor (memory: one tensor at a time).
//   tessera-ckpt from-safetensors IN.safetensors OUT_FOLDER [--step N] [model keys]
//       A checkpoint (one rank's file) that tessera-train resumes from or
//       loads onto any number of ranks. The model is rebuilt from the
//       configuration stored in the file (tessera-train's exports) or from the
//       given keys (--preset NAME, --model.n_layer N, ...), so the tensors get
//       the model's dtype (float32) and a tied weight stored once is filled in;
//       without either, the tensors are copied with floats as float32.
//       (To start a run from a file, tessera-train's
//       --checkpoint.initial_load_path does the same without a checkpoint.)
//   tessera-ckpt from-hf HF_FOLDER OUT_FOLDER
//       A Hugging Face GPT-2, Llama or Mixtral (config.json + model.safetensors, as
//       save_pretrained writes it) as a step-0 checkpoint with its model
//       configuration, which tessera-train continues. Its tokenizer.json goes
//       along when it is byte-level BPE (io/tokenizer.h).
//   tessera-ckpt to-hf CHECKPOINT OUT_HF_FOLDER
//       A gpt2 or llama checkpoint (an MoE llama as Mixtral) as a folder that transformers'
//       from_pretrained loads (io/hf.h), with the tokenizer.json found
//       beside the checkpoint (in it or the two folders above), if any.
//   tessera-ckpt from-llmc MODEL.bin OUT_FOLDER
//   tessera-ckpt to-llmc CHECKPOINT OUT.bin [--dtype bfloat16]
//       llm.c's GPT-2 model file (gpt2_124M.bin; io/llmc.h) to a
//       step-0 checkpoint, and a gpt2 checkpoint to one llm.c continues.
#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <set>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "dtensor/placement.h"
#include "fsdp/checkpoint.h"
#include "fsdp/state_dict.h"
#include "io/hf.h"
#include "io/llmc.h"
#include "io/tokenizer.h"
#include "nn/models.h"
#include "nn/safetensors.h"
#include "tools/config.h"
#include "tools/run_folder.h"

using namespace tessera;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// --help prints to stdout and succeeds; a missing command is an error.
int usage(FILE* out, int code) {
  std::fprintf(
      out,
      "usage: tessera-ckpt list PATH\n"
      "       tessera-ckpt to-safetensors CHECKPOINT OUT.safetensors [--dtype float32|bfloat16] "
      "[--with-optimizer]\n"
      "       tessera-ckpt from-safetensors IN.safetensors OUT_FOLDER [--step N] [--preset NAME]\n"
      "                    [--model.KEY VALUE ...]   (model keys for a file without a stored "
      "model)\n"
      "       tessera-ckpt from-hf HF_FOLDER OUT_FOLDER        (a Hugging Face GPT-2, Llama or Mixtral -> a checkpoint)\n"
      "       tessera-ckpt to-hf CHECKPOINT OUT_HF_FOLDER      (a gpt2, llama or MoE llama checkpoint -> Hugging Face)\n"
      "       tessera-ckpt from-llmc MODEL.bin OUT_FOLDER      (llm.c's GPT-2 model file -> a checkpoint)\n"
      "       tessera-ckpt to-llmc CHECKPOINT OUT.bin [--dtype float32|bfloat16]   (-> llm.c)\n"
      "       tessera-ckpt read-plan CHECKPOINT --ranks N [--tensor NAME]   (what each of N FSDP ranks reads to load it)\n"
      "PATH and CHECKPOINT: a checkpoint directory, a folder of checkpoints (the newest) or,\n"
      "for list, a .safetensors file.\n");
  return code;
}


// A checkpoint directory from a directory or a folder of checkpoints.
std::string checkpoint_dir(const std::string& path) {
  TS_CHECK(fs::is_directory(path), "'{}' is neither a checkpoint directory nor a .safetensors file",
           path);
  if (fs::exists(fs::path(path) / "metadata.json")) return path;
  std::string latest = fsdp::latest_checkpoint(path);
  TS_CHECK(!latest.empty(), "'{}' holds no complete checkpoint (no step-N/metadata.json)", path);
  return latest;
}

// An import writes a checkpoint folder of its own: one that already holds
// checkpoints (a run's, whose step-N it would replace or whose `latest` it
// would point back) is refused before anything is read.
void refuse_existing_checkpoints(const std::string& out) {
  const std::string latest = fsdp::latest_checkpoint(out);
  TS_CHECK(latest.empty(),
           "{} already holds checkpoints (the newest is {}): an import would replace or shadow them; name a new "
           "or empty OUT_FOLDER",
           out, fs::path(latest).filename().string());
}

// An export may not write into the checkpoint it reads (its data files,
// metadata or `latest`).
void refuse_output_inside(const std::string& checkpoint, const std::string& out) {
  std::error_code ec;
  const fs::path dir = fs::weakly_canonical(checkpoint_dir(checkpoint), ec);
  fs::path target = fs::weakly_canonical(out, ec);
  if (ec) target = fs::absolute(out).lexically_normal();
  TS_CHECK(!tools::path_inside(target, dir), "'{}' lies inside the checkpoint {} it is made from: name a path "
           "outside it", out, dir.string());
  TS_CHECK(target != dir.parent_path() / "latest", "'{}' is the checkpoint folder's `latest`: name another path",
           out);
}

std::string human_bytes(double b) {
  if (b >= 1e9) return fmt::format("{:.2f} GB", b / 1e9);
  if (b >= 1e6) return fmt::format("{:.2f} MB", b / 1e6);
  if (b >= 1e3) return fmt::format("{:.1f} kB", b / 1e3);
  return fmt::format("{} B", b);
}

bool is_safetensors(const std::string& path) {
  return fs::path(path).extension() == ".safetensors" && fs::is_regular_file(path);
}

int list(const std::string& path) {
  if (is_safetensors(path)) {
    nn::SafetensorsFile f(path);
    double total = 0;
    std::printf("%s: safetensors, %zu tensors\n", path.c_str(), f.entries().size());
    for (const auto& [k, v] : f.metadata())
      std::printf("  metadata %s = %s\n", k.c_str(), v.c_str());
    for (const auto& e : f.entries()) {
      double bytes = static_cast<double>(e.end - e.begin);
      total += bytes;
      std::printf("  %-52s %-5s %-16s %10s\n", e.name.c_str(), nn::safetensors_dtype(e.dtype),
                  shape_str(e.shape).c_str(), human_bytes(bytes).c_str());
    }
    std::printf("total %s\n", human_bytes(total).c_str());
    return 0;
  }
  std::string dir = checkpoint_dir(path);
  auto md = fsdp::read_metadata(dir);
  std::printf("%s: step %lld, saved by %d rank(s), %zu tensors\n", dir.c_str(),
              static_cast<long long>(md.step), md.world_size, md.tensors.size());
  json extra = json::parse(md.extra_json);
  if (extra.contains("model")) std::printf("  model %s\n", extra["model"].dump().c_str());
  double model_bytes = 0, optim_bytes = 0;
  for (const auto& t : md.tensors) {
    double bytes =
        static_cast<double>(shape_numel(t.shape)) * static_cast<double>(dtype_size(t.dtype));
    (t.name.rfind("optim.", 0) == 0 ? optim_bytes : model_bytes) += bytes;
    std::printf("  %-52s %-5s %-16s %-12s %3zu chunk(s) %10s\n", t.name.c_str(),
                dtype_name(t.dtype), shape_str(t.shape).c_str(), t.placements.c_str(),
                t.chunks.size(), human_bytes(bytes).c_str());
  }
  std::printf("model %s, optimizer %s\n", human_bytes(model_bytes).c_str(),
              human_bytes(optim_bytes).c_str());
  return 0;
}

// What each rank of FSDP over `ranks` (Shard(0), torch.chunk rows) reads of a
// checkpoint when it loads: the chunks whose rows overlap its own (each read
// whole, its checksum verified) and the rows it copies out of them. This is
// load_checkpoint's plan (PyTorch DCP's LoadPlan), printed.
int read_plan(const std::vector<std::string>& args) {
  std::string path, only;
  int64_t ranks = 0;
  for (size_t i = 0; i < args.size(); ++i) {
    auto value = [&](const char* opt) {
      TS_CHECK(i + 1 < args.size(), "{} needs a value", opt);
      return args[++i];
    };
    if (args[i] == "--ranks") {
      std::string v = value("--ranks");
      size_t used = 0;
      try {
        ranks = std::stoll(v, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      TS_CHECK(used == v.size() && ranks >= 1 && ranks <= 65536, "--ranks expects a rank count (1-65536), got '{}'",
               v);
    } else if (args[i] == "--tensor") {
      only = value("--tensor");
    } else {
      TS_CHECK(args[i].rfind("--", 0) != 0, "read-plan: unknown option '{}' (valid: --ranks, --tensor)", args[i]);
      TS_CHECK(path.empty(), "read-plan takes one CHECKPOINT, got '{}' and '{}'", path, args[i]);
      path = args[i];
    }
  }
  TS_CHECK(!path.empty() && ranks > 0, "read-plan needs CHECKPOINT and --ranks N");
  std::string dir = checkpoint_dir(path);
  auto md = fsdp::read_metadata(dir);
  TS_CHECK(only.empty() || md.find(only) != nullptr, "{} has no tensor '{}' (tessera-ckpt list shows its tensors)", dir,
           only);
  std::printf("%s: saved by %d rank(s); loaded by FSDP over %lld rank(s) (each tensor's rows split as torch.chunk)\n",
              dir.c_str(), md.world_size, static_cast<long long>(ranks));
  std::vector<int64_t> chunks_read(static_cast<size_t>(ranks)), bytes_read(chunks_read.size()),
      bytes_kept(chunks_read.size());
  std::vector<std::set<std::string>> files(chunks_read.size());
  for (const auto& t : md.tensors) {
    const bool show = t.name == only;
    const int64_t rows = t.shape.empty() ? 1 : t.shape[0];
    if (show)
      std::printf("%s %s %s, %zu chunk(s) as saved %s\n", t.name.c_str(), dtype_name(t.dtype),
                  shape_str(t.shape).c_str(), t.chunks.size(), t.placements.c_str());
    for (int64_t r = 0; r < ranks; ++r) {
      // A 0-dim tensor (an optimizer step count) is read whole by every rank.
      auto [len, begin] = t.shape.empty() ? std::pair<int64_t, int64_t>{1, 0} : shard_size_and_offset(rows, ranks, r);
      if (show) std::printf("  rank %lld needs rows %lld..%lld%s\n", static_cast<long long>(r),
                            static_cast<long long>(begin), static_cast<long long>(begin + len - 1),
                            len == 0 ? " (none: an empty shard)" : "");
      // This rank's box: its rows, every column (what load_checkpoint reads for it).
      Shape start(t.shape.size(), 0), extent = t.shape;
      if (!t.shape.empty()) start[0] = begin, extent[0] = len;
      for (const auto& c : t.chunks) {
        const auto common = fsdp::chunk_overlap(c, start, extent);
        if (!common) continue;
        const int64_t c0 = c.offsets.empty() ? 0 : c.offsets[0], c1 = c0 + (c.shape.empty() ? 1 : c.shape[0]);
        const int64_t a = t.shape.empty() ? 0 : common->first[0], b = t.shape.empty() ? 1 : a + common->second[0];
        const int64_t kept =
            static_cast<int64_t>(c.bytes) / std::max<int64_t>(shape_numel(c.shape), 1) * shape_numel(common->second);
        chunks_read[static_cast<size_t>(r)]++;
        bytes_read[static_cast<size_t>(r)] += static_cast<int64_t>(c.bytes);
        bytes_kept[static_cast<size_t>(r)] += kept;
        files[static_cast<size_t>(r)].insert(c.file);
        if (show)
          std::printf("    %-16s rows %lld..%lld: reads %s, copies rows %lld..%lld (%s)\n", c.file.c_str(),
                      static_cast<long long>(c0), static_cast<long long>(c1 - 1),
                      human_bytes(static_cast<double>(c.bytes)).c_str(), static_cast<long long>(a),
                      static_cast<long long>(b - 1), a == c0 && b == c1 ? "all of it" : "part of it");
      }
    }
  }
  std::printf("all %zu tensors:\n", md.tensors.size());
  for (int64_t r = 0; r < ranks; ++r)
    std::printf("  rank %lld reads %lld chunk(s) from %zu file(s), %s, and keeps %s of it\n", static_cast<long long>(r),
                static_cast<long long>(chunks_read[static_cast<size_t>(r)]), files[static_cast<size_t>(r)].size(),
                human_bytes(static_cast<double>(bytes_read[static_cast<size_t>(r)])).c_str(),
                human_bytes(static_cast<double>(bytes_kept[static_cast<size_t>(r)])).c_str());
  return 0;
}

int to_safetensors(const std::vector<std::string>& args) {
  TS_CHECK(args.size() >= 2, "to-safetensors needs CHECKPOINT and OUT.safetensors");
  std::string dir = checkpoint_dir(args[0]), out = args[1];
  refuse_output_inside(args[0], out);
  std::optional<DType> dtype;
  bool with_optimizer = false;
  for (size_t i = 2; i < args.size(); ++i) {
    if (args[i] == "--with-optimizer") {
      with_optimizer = true;
    } else if (args[i] == "--dtype" && i + 1 < args.size()) {
      std::string d = args[++i];
      TS_CHECK(d == "float32" || d == "bfloat16", "--dtype expects float32 or bfloat16, got '{}'",
               d);
      dtype = d == "bfloat16" ? DType::BF16 : DType::F32;
    } else {
      TS_CHECK(false, "unknown option '{}' (valid: --dtype, --with-optimizer)", args[i]);
    }
  }
  auto md = fsdp::read_metadata(dir);
  std::vector<const fsdp::TensorInfo*> chosen;
  std::vector<nn::SafetensorsEntry> entries;
  uint64_t offset = 0;
  auto out_dtype = [&](DType dt) { return dtype && is_floating(dt) ? *dtype : dt; };
  for (const auto& t : md.tensors) {
    if (!with_optimizer && t.name.rfind("optim.", 0) == 0) continue;
    uint64_t bytes = static_cast<uint64_t>(shape_numel(t.shape)) * dtype_size(out_dtype(t.dtype));
    entries.push_back({t.name, out_dtype(t.dtype), t.shape, offset, offset + bytes});
    offset += bytes;
    chosen.push_back(&t);
  }
  std::map<std::string, std::string> meta{{"format", "pt"},
                                          {"tessera_step", std::to_string(md.step)}};
  json extra = json::parse(md.extra_json);
  if (extra.contains("model")) meta["tessera_model"] = extra["model"].dump();
  if (extra.contains("tokenizer")) meta["tessera_tokenizer"] = extra["tokenizer"].dump();  // tessera-generate's check
  nn::write_safetensors(
      out, entries,
      [&](size_t i) { return ops::to(fsdp::read_full_tensor(dir, *chosen[i]), entries[i].dtype); },
      meta);
  std::printf("%s -> %s: %zu tensors, %s\n", dir.c_str(), out.c_str(), entries.size(),
              human_bytes(static_cast<double>(offset)).c_str());
  return 0;
}

int from_safetensors(const std::vector<std::string>& args) {
  TS_CHECK(args.size() >= 2, "from-safetensors needs IN.safetensors and OUT_FOLDER");
  refuse_existing_checkpoints(args[1]);
  int64_t step = 0;
  std::vector<std::string> model_args{"tessera-ckpt from-safetensors"};
  for (size_t i = 2; i < args.size(); ++i) {
    if (args[i] == "--step" && i + 1 < args.size()) {
      try {
        size_t used = 0;
        step = std::stoll(args[++i], &used);
        if (used != args[i].size()) step = -1;
      } catch (const std::exception&) {
        step = -1;
      }
      TS_CHECK(step >= 0 && step <= fsdp::kMaxCheckpointStep, "--step expects a step number in [0, {}], got '{}'",
               fsdp::kMaxCheckpointStep, args[i]);
    } else {
      model_args.push_back(args[i]);  // --preset, --model.* (checked by the config parser)
    }
  }
  nn::SafetensorsFile f(args[0]);
  auto stored = f.metadata().find("tessera_model");
  json extra = {{"step", step}, {"source", args[0]}};
  // What to-safetensors recorded: the step the weights were saved at (the
  // checkpoint is --step's; a count that says otherwise is named) and the
  // tokenizer they were trained with (kept for tessera-generate).
  if (auto it = f.metadata().find("tessera_step"); it != f.metadata().end()) {
    const std::string& saved = it->second;
    const bool count = !saved.empty() && saved.size() <= 18 && saved.find_first_not_of("0123456789") == std::string::npos;
    if (!count)
      std::fprintf(stderr, "tessera-ckpt: warning: %s: tessera_step '%s' is not a step count; ignored\n",
                   args[0].c_str(), saved.substr(0, 40).c_str());
    else if (std::stoll(saved) != step)
      std::fprintf(stderr,
                   "tessera-ckpt: note: %s was saved at step %s; the checkpoint is step %lld (--step %s continues "
                   "the count)\n",
                   args[0].c_str(), saved.c_str(), static_cast<long long>(step), saved.c_str());
  }
  if (auto it = f.metadata().find("tessera_tokenizer"); it != f.metadata().end()) {
    json record = json::parse(it->second, nullptr, false);
    TS_CHECK(record.is_object() && record.contains("fingerprint") && record["fingerprint"].is_string() &&
                 record.contains("vocab_size") && record["vocab_size"].is_number_unsigned(),
             "{}: tessera_tokenizer must be {{\"fingerprint\": string, \"vocab_size\": integer >= 0}}, got '{}'", args[0],
             it->second.substr(0, 80));
    extra["tokenizer"] = record;
  }
  // At step 0 tessera-train can start from it (--checkpoint.resume true: fresh optimizer, data from
  // the start).
  if (step == 0) extra["data"] = {{"next_micro_batch", 0}};
  std::string dir;
  size_t count = 0;
  if (stored != f.metadata().end() || model_args.size() > 1) {
    // The model's own state dict: float32 weights, tied weights under both names.
    tools::TrainConfig cfg;
    if (stored != f.metadata().end()) tools::model_from_json(cfg, stored->second, args[0]);
    std::vector<char*> argv;
    for (auto& a : model_args) argv.push_back(a.data());
    if (!tools::parse_args(cfg, static_cast<int>(argv.size()), argv.data(), "tessera-ckpt"))
      return 0;
    tools::validate(cfg);
    tools::check_memory(cfg, 1, 1, tools::available_host_memory(), /*training=*/false);
    std::shared_ptr<nn::LanguageModel> model = tools::make_model(cfg, Device::meta());
    model->to_empty(Device::cpu());
    fsdp::load_safetensors(*model, args[0]);  // checks keys and shapes, converts dtypes
    extra["model"] = json::parse(tools::model_to_json(cfg));
    dir = fsdp::save_checkpoint(args[1], step, *model, nullptr, extra.dump());
    count = model->state_dict().size();
  } else {
    // No model to match: the file's tensors as they are, floats as float32
    // (the dtype tessera-train keeps its weights in).
    nn::StateDict tensors;
    for (const auto& e : f.entries())
      tensors.emplace_back(e.name,
                           is_floating(e.dtype) ? f.read(e.name, DType::F32) : f.read(e.name));
    std::fprintf(stderr,
                 "tessera-ckpt: note: %s stores no model configuration: tensors copied by name, "
                 "floats as float32 (give --preset/--model.* keys to match a model and fill in "
                 "tied weights)\n",
                 args[0].c_str());
    dir = fsdp::save_checkpoint(args[1], step, tensors, extra.dump());
    count = tensors.size();
  }
  std::printf("%s -> %s: %zu tensors\n", args[0].c_str(), dir.c_str(), count);
  return 0;
}

}  // namespace

// A step-0 checkpoint of `file`'s tensors (by Tessera's names) in the model
// `cfg` describes: every weight the model needs, with its shape, and nothing
// left over (a tied output layer is its embedding table).
int save_as_checkpoint(tools::TrainConfig& cfg, const nn::StateDict& file, const std::string& source,
                       const std::string& out) {
  tools::resolve_config(cfg);
  tools::transformer_config(cfg).validate();  // the model alone: its tokens come from elsewhere
  tools::check_memory(cfg, 1, 1, tools::available_host_memory(), /*training=*/false);
  std::shared_ptr<nn::LanguageModel> model = tools::make_model(cfg, Device::meta());
  // The file's names and shapes against the model its settings describe, on
  // meta (nothing allocated), before the model takes memory.
  io::load_weights(*model, file, cfg.model.tie_embeddings, source);
  model->to_empty(Device::cpu());
  io::load_weights(*model, file, cfg.model.tie_embeddings, source);
  json extra = {{"step", 0}, {"source", source}, {"data", {{"next_micro_batch", 0}}},
                {"model", json::parse(tools::model_to_json(cfg))}};
  std::string dir = fsdp::save_checkpoint(out, 0, *model, nullptr, extra.dump());
  const auto& m = cfg.model;
  std::printf("%s -> %s: %s %lld layers, d=%lld, %lld heads (%lld key/value), vocabulary %lld, %lld positions, %s\n",
              source.c_str(), dir.c_str(), m.arch.c_str(), static_cast<long long>(m.n_layer),
              static_cast<long long>(m.n_embd), static_cast<long long>(m.n_head),
              static_cast<long long>(m.n_kv_head > 0 ? m.n_kv_head : m.n_head), static_cast<long long>(m.vocab_size),
              static_cast<long long>(cfg.training.seq_len),
              m.arch == "gpt2"
                  ? ("GELU " + m.gelu).c_str()
                  : fmt::format("RoPE base {:g}, RMSNorm eps {:g}{}", m.rope_theta, m.norm_eps,
                                m.moe_experts > 0 ? fmt::format(", {} experts (top {})", m.moe_experts, m.moe_top_k)
                                                  : "")
                        .c_str());
  return 0;
}

int from_hf(const std::vector<std::string>& args) {
  TS_CHECK(args.size() == 2, "from-hf needs HF_FOLDER and OUT_FOLDER, got {} argument(s)", args.size());
  refuse_existing_checkpoints(args[1]);
  // Everything is read and checked before anything is written: the model's
  // settings (as any model's, nn/transformer.h), its weights against them, and
  // its tokenizer, which goes with it where tessera-generate looks if this
  // runtime can read it (GPT-2's byte-level BPE).
  tools::TrainConfig cfg;
  const nn::TransformerConfig model = io::read_hf_config(args[0]);
  tools::set_model(cfg, model);
  const nn::StateDict weights = io::read_hf_weights(args[0], model);
  const fs::path tokenizer = fs::path(args[0]) / "tokenizer.json";
  std::optional<io::BpeTokenizer> bpe;
  if (fs::exists(tokenizer)) {
    try {
      bpe = io::BpeTokenizer::load(tokenizer.string());
    } catch (const Error& e) {
      std::printf("note: %s not copied: %s\n", tokenizer.c_str(), e.what());
    }
  }
  int rc = save_as_checkpoint(cfg, weights, args[0], args[1]);
  if (bpe) {
    fs::copy_file(tokenizer, fs::path(args[1]) / "tokenizer.json", fs::copy_options::overwrite_existing);
    std::printf("%s -> %s (%lld tokens)\n", tokenizer.c_str(), (fs::path(args[1]) / "tokenizer.json").c_str(),
                static_cast<long long>(bpe->vocab_size()));
  }
  return rc;
}

int from_llmc(const std::vector<std::string>& args) {
  TS_CHECK(args.size() == 2, "from-llmc needs MODEL.bin and OUT_FOLDER, got {} argument(s)", args.size());
  refuse_existing_checkpoints(args[1]);
  tools::TrainConfig cfg;
  nn::TransformerConfig model;
  nn::StateDict file = io::read_llmc_model(model, args[0]);
  tools::set_model(cfg, model);
  return save_as_checkpoint(cfg, file, args[0], args[1]);
}

// The model settings and whole weights of a checkpoint that stores its model.
std::pair<tools::TrainConfig, nn::StateDict> checkpoint_model(const std::string& path, const char* command) {
  std::string dir = checkpoint_dir(path);
  auto md = fsdp::read_metadata(dir);
  json extra = json::parse(md.extra_json);
  TS_CHECK(extra.contains("model"), "{}: {} stores no model configuration (tessera-train's checkpoints do)", command,
           dir);
  tools::TrainConfig cfg;
  tools::model_from_json(cfg, extra["model"].dump(), dir);
  nn::StateDict weights;
  for (const auto& t : md.tensors)
    if (t.name.rfind("optim.", 0) != 0) weights.emplace_back(t.name, fsdp::read_full_tensor(dir, t));
  return {cfg, weights};
}

int to_hf(const std::vector<std::string>& args) {
  TS_CHECK(args.size() == 2, "to-hf needs CHECKPOINT and OUT_HF_FOLDER, got {} argument(s)", args.size());
  refuse_output_inside(args[0], args[1]);
  auto [cfg, weights] = checkpoint_model(args[0], "to-hf");
  // The tokenizer beside the checkpoint goes with it only once it reads as
  // one (a tokenizer.json that is a link to some other file is not copied).
  const std::string tokenizer = io::tokenizer_beside(checkpoint_dir(args[0]));
  std::optional<io::BpeTokenizer> bpe;
  if (!tokenizer.empty()) {
    try {
      bpe = io::BpeTokenizer::load(tokenizer);
    } catch (const Error& e) {
      std::printf("note: %s not copied: %s\n", tokenizer.c_str(), e.what());
    }
  }
  io::write_hf(args[1], tools::transformer_config(cfg), weights);
  if (bpe) {
    fs::copy_file(tokenizer, fs::path(args[1]) / "tokenizer.json", fs::copy_options::overwrite_existing);
    std::printf("%s -> %s\n", tokenizer.c_str(), (fs::path(args[1]) / "tokenizer.json").c_str());
  }
  std::printf("%s -> %s: config.json and model.safetensors (%s)\n", args[0].c_str(), args[1].c_str(),
              cfg.model.arch == "gpt2"           ? "GPT2LMHeadModel"
              : cfg.model.moe_experts > 0 ? "MixtralForCausalLM"
                                          : "LlamaForCausalLM");
  return 0;
}

int to_llmc(const std::vector<std::string>& args) {
  TS_CHECK(args.size() == 2 || (args.size() == 4 && args[2] == "--dtype"),
           "to-llmc needs CHECKPOINT and OUT.bin [--dtype float32|bfloat16]");
  DType dtype = DType::F32;
  if (args.size() == 4) {
    TS_CHECK(args[3] == "float32" || args[3] == "bfloat16", "--dtype expects float32 or bfloat16, got '{}'", args[3]);
    dtype = args[3] == "bfloat16" ? DType::BF16 : DType::F32;
  }
  refuse_output_inside(args[0], args[1]);
  auto [cfg, weights] = checkpoint_model(args[0], "to-llmc");
  io::write_llmc_model(args[1], tools::transformer_config(cfg), weights, dtype);
  std::printf("%s -> %s: llm.c GPT-2 model file, version %d (%s)\n", args[0].c_str(), args[1].c_str(),
              dtype == DType::BF16 ? 5 : 3, dtype_name(dtype));
  return 0;
}

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) return usage(stderr, 2);
  if (args[0] == "--help" || args[0] == "-h") return usage(stdout, 0);
  try {
    std::string cmd = args[0];
    args.erase(args.begin());
    if (cmd == "list") {
      TS_CHECK(args.size() == 1,
               "list needs one PATH (a checkpoint directory, a folder of checkpoints or a "
               ".safetensors file), got {} argument(s)",
               args.size());
      return list(args[0]);
    }
    if (cmd == "to-safetensors") return to_safetensors(args);
    if (cmd == "from-safetensors") return from_safetensors(args);
    if (cmd == "from-hf") return from_hf(args);
    if (cmd == "to-hf") return to_hf(args);
    if (cmd == "from-llmc") return from_llmc(args);
    if (cmd == "to-llmc") return to_llmc(args);
    if (cmd == "read-plan") return read_plan(args);
    std::fprintf(stderr,
                 "tessera-ckpt: unknown command or arguments '%s' (valid: list, to-safetensors, "
                 "from-safetensors, from-hf, to-hf, from-llmc, to-llmc, read-plan)\n",
                 cmd.c_str());
    return 2;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "tessera-ckpt: error: out of host memory (std::bad_alloc)\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tessera-ckpt: error: %s\n", e.what());
    return 1;
  }
}
