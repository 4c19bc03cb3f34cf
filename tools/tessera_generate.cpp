// tessera-generate: samples text from a trained model.
//
//   tessera-generate --checkpoint out/gpt2-fortunes/checkpoint [--sample.prompt "Q: "]
//                    [--sample.max_new_tokens 200] [--sample.temperature 0.8]
//                    [--sample.top_k 40] [--job.seed 1]
//
// --checkpoint is a checkpoint directory, a folder of checkpoints (the newest
// complete one) or a .safetensors file. The model's shape comes from the
// file (tessera-train stores it); for a file without it give the model keys
// (--preset NAME, --model.n_layer ...), as for tessera-train. Runs as one
// process whatever number of ranks saved the checkpoint. The same seed gives
// the same text; the output is the prompt and the generated text.
//
// Tokens: byte tokens, or a Hugging Face tokenizer.json (byte-level BPE) given
// with --tokenizer or found beside the weights: in the checkpoint's folder or
// the two above it (tessera-train copies training.tokenizer into the run
// folder, tessera-ckpt from-hf copies the model's). Ids no token has (a
// padded vocabulary, or no tokenizer for a model of more than 256) print as [id].
// Weights tessera-train saved from a run with a tokenizer record its
// fingerprint: without a tokenizer they are refused (their ids are not
// bytes), and another tokenizer file is named in a warning.
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <optional>

#include "fsdp/checkpoint.h"
#include "fsdp/state_dict.h"
#include "io/data.h"
#include "io/tokenizer.h"
#include "nn/generate.h"
#include "nn/models.h"
#include "nn/safetensors.h"
#include "tools/config.h"

using namespace tessera;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// The tokenizer a run trained with, as its checkpoint's extra.tokenizer or its
// exported file's tessera_tokenizer records it (tessera-train).
struct TokenizerRecord {
  std::string fingerprint;
  int64_t vocab_size = 0;
};

std::optional<TokenizerRecord> tokenizer_record(const json& j, const std::string& source) {
  TS_CHECK(j.is_object() && j.contains("fingerprint") && j["fingerprint"].is_string() && j.contains("vocab_size") &&
               j["vocab_size"].is_number_unsigned(),
           "{}: the record of the tokenizer the weights were trained with must be {{\"fingerprint\": string, "
           "\"vocab_size\": integer >= 0}}, got {}",
           source, j.dump().substr(0, 200));
  return TokenizerRecord{j["fingerprint"].get<std::string>(), j["vocab_size"].get<int64_t>()};
}

// NaN or infinite weights sample noise: refused, naming the tensors.
void check_weights_finite(nn::Module& model, const std::string& source) {
  autograd::NoGradGuard no_grad;
  std::vector<std::string> bad;
  for (const auto& [name, p] : model.named_parameters())
    if (p.numel() > 0 && std::isnan(ops::sum(ops::mul(p, 0.0)).item())) bad.push_back(name);  // x * 0: NaN for NaN, inf
  TS_CHECK(bad.empty(), "{}: {} weight tensor{} NaN or infinite values ({}{}): a model that diverged?", source,
           bad.size(), bad.size() == 1 ? " holds" : "s hold",
           fmt::join(bad.begin(), bad.begin() + std::min<size_t>(bad.size(), 3), ", "), bad.size() > 3 ? ", ..." : "");
}


int run(int argc, char** argv) {
  // --checkpoint is ours; everything else is a tessera-train config key.
  std::string path, tokenizer_path;
  std::vector<char*> rest{argv[0]};
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--checkpoint" && i + 1 < argc)
      path = argv[++i];
    else if (a.rfind("--checkpoint=", 0) == 0)
      path = a.substr(13);
    else if (a == "--tokenizer" && i + 1 < argc)
      tokenizer_path = argv[++i];
    else if (a.rfind("--tokenizer=", 0) == 0)
      tokenizer_path = a.substr(12);
    else
      rest.push_back(argv[i]);
  }
  bool help = std::any_of(rest.begin(), rest.end(), [](char* a) {
    return std::string(a) == "--help" || std::string(a) == "-h";
  });
  if (help || path.empty()) {
    std::printf(
        "usage: tessera-generate --checkpoint PATH [--tokenizer tokenizer.json] [--sample.prompt TEXT]\n"
        "       [--sample.max_new_tokens N]\n"
        "       [--sample.temperature T] [--sample.top_k K] [--job.seed S] [model keys for files\n"
        "       without a stored model: --preset NAME, --model.n_layer N, ...]\n");
    if (!help) std::fprintf(stderr, "tessera-generate: --checkpoint is required\n");
    return help ? 0 : 2;
  }
  TS_CHECK(fs::exists(path), "'{}' does not exist", path);

  // Where the weights are and the model configuration stored with them.
  tools::TrainConfig cfg;
  std::string stored, dir, source = path;
  std::optional<TokenizerRecord> trained_with;
  bool safetensors = fs::is_regular_file(path);
  if (safetensors) {
    nn::SafetensorsFile f(path);
    if (auto it = f.metadata().find("tessera_model"); it != f.metadata().end()) stored = it->second;
    if (auto it = f.metadata().find("tessera_tokenizer"); it != f.metadata().end())
      trained_with = tokenizer_record(json::parse(it->second, nullptr, false), path + ": tessera_tokenizer");
  } else {
    TS_CHECK(fs::is_directory(path), "'{}' is neither a .safetensors file nor a checkpoint folder", path);
    dir = fs::exists(fs::path(path) / "metadata.json") ? path : fsdp::latest_checkpoint(path);
    TS_CHECK(!dir.empty(), "'{}' holds no complete checkpoint", path);
    json extra = json::parse(fsdp::read_metadata(dir).extra_json);
    if (extra.contains("model")) stored = extra["model"].dump();
    source = (fs::path(dir) / "metadata.json").string();
    if (extra.contains("tokenizer")) trained_with = tokenizer_record(extra["tokenizer"], source + ": extra.tokenizer");
  }
  if (!stored.empty()) tools::model_from_json(cfg, stored, source);
  int nrest = static_cast<int>(rest.size());
  if (!tools::parse_args(cfg, nrest, rest.data(), "tessera-generate")) return 0;
  tools::validate(cfg);
  tools::check_memory(cfg, 1, 1, tools::available_host_memory(), /*training=*/false);

  std::shared_ptr<nn::LanguageModel> model = tools::make_model(cfg, Device::meta());
  model->to_empty(Device::cpu());
  if (safetensors)
    fsdp::load_safetensors(*model, path);
  else
    fsdp::load_checkpoint(dir, *model, nullptr, /*convert_dtypes=*/true);
  check_weights_finite(*model, safetensors ? path : dir);

  // The tokenizer: given, or beside the weights.
  const std::string beside = safetensors ? fs::path(path).parent_path().string() : dir;
  if (tokenizer_path.empty()) tokenizer_path = io::tokenizer_beside(beside);
  std::optional<io::BpeTokenizer> tokenizer;
  if (!tokenizer_path.empty()) {
    tokenizer = io::BpeTokenizer::load(tokenizer_path);
    TS_CHECK(tokenizer->vocab_size() <= cfg.model.vocab_size,
             "tokenizer {} has {} tokens but the model's vocabulary is {}: not this model's tokenizer",
             tokenizer_path, tokenizer->vocab_size(), cfg.model.vocab_size);
    if (trained_with && io::file_fingerprint(tokenizer_path) != trained_with->fingerprint)
      std::fprintf(stderr,
                   "tessera-generate: warning: %s is not the tokenizer file the model was trained with "
                   "(fingerprint %s, %lld tokens; this one %s, %lld): its ids may name other tokens\n",
                   tokenizer_path.c_str(), trained_with->fingerprint.c_str(),
                   static_cast<long long>(trained_with->vocab_size), io::file_fingerprint(tokenizer_path).c_str(),
                   static_cast<long long>(tokenizer->vocab_size()));
  } else {
    // Byte tokens are ids 0-255 of a byte-level vocabulary; a BPE model's
    // ids are not bytes, and reading them as bytes is silently wrong.
    TS_CHECK(!trained_with,
             "{} was trained with a tokenizer ({} tokens, fingerprint {}), but no tokenizer.json lies in {} or the "
             "two folders above it: give --tokenizer PATH (the run folder keeps a copy)",
             safetensors ? path : dir, trained_with ? trained_with->vocab_size : 0,
             trained_with ? trained_with->fingerprint : "", fs::absolute(beside).string());
    if (cfg.model.vocab_size > 256)
      std::fprintf(stderr,
                   "tessera-generate: warning: no tokenizer.json beside %s and none given (--tokenizer): the prompt "
                   "is read as byte tokens 0-255 and ids above 255 print as [id]; a model of %lld tokens was most "
                   "likely trained with a tokenizer\n",
                   safetensors ? path.c_str() : dir.c_str(), static_cast<long long>(cfg.model.vocab_size));
  }
  std::vector<int64_t> prompt = io::prompt_tokens(tokenizer ? &*tokenizer : nullptr, cfg.sample.prompt);
  TS_CHECK(!prompt.empty(), "--sample.prompt must not be empty");
  std::string tokens = tokenizer ? fmt::format("tokenizer {} ({} tokens)", tokenizer_path,
                                               tokenizer->vocab_size())
                                 : "byte tokens";
  std::fprintf(stderr, "%s: %s, %lld parameters; %s; temperature %.2f, top-k %lld, seed %lld\n",
               safetensors ? path.c_str() : dir.c_str(), cfg.model.arch.c_str(),
               static_cast<long long>(model->num_parameters()), tokens.c_str(),
               cfg.sample.temperature, static_cast<long long>(cfg.sample.top_k),
               static_cast<long long>(cfg.job.seed));
  std::fwrite(cfg.sample.prompt.data(), 1, cfg.sample.prompt.size(), stdout);
  nn::generate(*model, prompt,
               {cfg.sample.max_new_tokens, cfg.sample.temperature, cfg.sample.top_k,
                static_cast<uint64_t>(cfg.job.seed)},
               [&](int64_t t) {
                 const std::string text = io::token_text(tokenizer ? &*tokenizer : nullptr, t);
                 std::fwrite(text.data(), 1, text.size(), stdout);
                 std::fflush(stdout);
               });
  std::printf("\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "tessera-generate: error: out of host memory (std::bad_alloc)\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tessera-generate: error: %s\n", e.what());
    return 1;
  }
}
