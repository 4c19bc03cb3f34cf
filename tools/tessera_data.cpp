// tessera-data: turns text into llm.c token shards and inspects shards.
//
//   tessera-data prepare [--out DIR] [--name NAME] [--val-fraction F] [--tokenizer JSON] FILE...
//       the files' tokens, concatenated (byte tokens, or those of a Hugging
//       Face tokenizer.json with byte-level BPE); the last F (default 0.1) is
//       validation: DIR/NAME_train.bin and DIR/NAME_val.bin
//   tessera-data info [--tokenizer JSON] SHARD...
//       header, token count, token range and the first tokens as text
//
// Shards follow llm.c: a header of 256 int32 (magic 20240520, version 1,
// token count) and then uint16 tokens, so shards made by llm.c's own scripts
// (GPT-2 tokens: train with --model.vocab_size 50304) load as they are.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "io/data.h"
#include "io/tokenizer.h"
#include "runtime/check.h"

using namespace tessera;
namespace fs = std::filesystem;

namespace {

const char* const kUsage =
    "usage: tessera-data prepare [--out DIR] [--name NAME] [--val-fraction F] [--tokenizer JSON] FILE...\n"
    "       tessera-data info [--tokenizer JSON] SHARD...\n"
    "\n"
    "  prepare  the tokens of the text FILEs, concatenated; the last F (default 0.1) is\n"
    "           validation: DIR/NAME_train.bin and DIR/NAME_val.bin (DIR: data, NAME: the\n"
    "           first file's stem). Byte tokens, or with --tokenizer those of a Hugging Face\n"
    "           tokenizer.json (GPT-2's byte-level BPE)\n"
    "  info     header, token count, token range and the first tokens as text\n"
    "\n"
    "Shards are llm.c's GPT-2 format: 256 int32 (magic 20240520, version 1, token count),\n"
    "then uint16 tokens. Train on them with tessera-train --training.dataset shards\n"
    "--training.train_shard DIR/NAME_train.bin --training.val_shard DIR/NAME_val.bin.\n";

// --help: the usage on stdout, success. A mistake: the usage on stderr, exit 2.
int usage(bool asked) {
  std::fputs(kUsage, asked ? stdout : stderr);
  return asked ? 0 : 2;
}

bool is_help(const std::string& a) {
  return a == "--help" || a == "-h";
}

int prepare(const std::vector<std::string>& args) {
  std::string out = "data", name, tokenizer_path;
  double val_fraction = 0.1;
  std::vector<std::string> files;
  for (size_t i = 0; i < args.size(); ++i) {
    auto value = [&](const char* opt) {
      TS_CHECK(i + 1 < args.size(), "{} needs a value", opt);
      return args[++i];
    };
    if (args[i] == "--out")
      out = value("--out");
    else if (args[i] == "--name")
      name = value("--name");
    else if (args[i] == "--tokenizer")
      tokenizer_path = value("--tokenizer");
    else if (args[i] == "--val-fraction") {
      std::string v = value("--val-fraction");
      size_t used = 0;
      try {
        val_fraction = std::stod(v, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      TS_CHECK(used == v.size() && val_fraction > 0 && val_fraction < 1,
               "--val-fraction expects a number in (0, 1), got '{}'", v);
    } else if (args[i].rfind("--", 0) == 0) {
      TS_CHECK(false, "unknown option '{}' (valid: --out, --name, --val-fraction, --tokenizer)",
               args[i]);
    } else {
      files.push_back(args[i]);
    }
  }
  TS_CHECK(!files.empty(), "prepare needs at least one text file");
  // A file given twice would put its text in both splits: validation on training data.
  for (size_t i = 0; i < files.size(); ++i)
    for (size_t j = 0; j < i; ++j) {
      std::error_code ec;
      TS_CHECK(files[i] != files[j] && !fs::equivalent(files[i], files[j], ec),
               "'{}' and '{}' are the same file: each text is read once (given twice, its text would be in "
               "both the training and the validation split)", files[j], files[i]);
    }
  if (name.empty()) name = fs::path(files[0]).stem().string();
  TS_CHECK(!name.empty() && name.find('/') == std::string::npos && name != "." && name != "..",
           "--name '{}' must be a plain file name (no '/', not '.' or '..'): the shards are written as "
           "{}/NAME_train.bin and NAME_val.bin", name, out);
  std::optional<io::BpeTokenizer> tokenizer;
  if (!tokenizer_path.empty()) tokenizer = io::BpeTokenizer::load(tokenizer_path);
  auto [train, val] =
      io::prepare_text_dataset(files, out, name, val_fraction, tokenizer ? &*tokenizer : nullptr);
  std::printf("%s: %lld tokens\n%s: %lld tokens\n", train.c_str(),
              static_cast<long long>(io::read_shard(train).size()), val.c_str(),
              static_cast<long long>(io::read_shard(val).size()));
  if (tokenizer)
    std::printf("train on them with: tessera-train --training.dataset shards --training.train_shard %s "
                "--training.val_shard %s --training.tokenizer %s --model.vocab_size %lld\n",
                train.c_str(), val.c_str(), tokenizer_path.c_str(),
                static_cast<long long>(tokenizer->vocab_size()));
  return 0;
}

int info(const std::vector<std::string>& args) {
  std::vector<std::string> shards;
  std::optional<io::BpeTokenizer> tokenizer;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--tokenizer") {
      TS_CHECK(i + 1 < args.size(), "--tokenizer needs a value");
      tokenizer = io::BpeTokenizer::load(args[++i]);
    } else {
      TS_CHECK(args[i].rfind("--", 0) != 0, "unknown option '{}' (valid: --tokenizer)", args[i]);
      shards.push_back(args[i]);
    }
  }
  TS_CHECK(!shards.empty(), "info needs at least one shard");
  for (const auto& path : shards) {
    auto tokens = io::read_shard(path);
    auto [lo, hi] = std::minmax_element(tokens.begin(), tokens.end());
    std::printf("%s: llm.c shard version %d, %zu tokens (%.1f MB)", path.c_str(),
                io::kShardVersion, tokens.size(), static_cast<double>(fs::file_size(path)) / 1e6);
    if (tokens.empty()) {
      std::printf("\n");
      continue;
    }
    std::printf(", token ids %d..%d%s\n", *lo, *hi,
                tokenizer ? "" : *hi < 256 ? " (byte tokens)" : " (needs a vocabulary > 256)");
    TS_CHECK(!tokenizer || *hi < tokenizer->vocab_size(),
             "{}: token {} is outside the tokenizer's vocabulary ({} tokens): another tokenizer's "
             "shard?",
             path, *hi, tokenizer ? tokenizer->vocab_size() : 0);
    if (tokenizer || *hi < 256) {
      std::vector<int64_t> head(
          tokens.begin(), tokens.begin() + static_cast<long>(std::min<size_t>(80, tokens.size())));
      std::string text = tokenizer ? tokenizer->decode(head) : io::decode_bytes(head);
      for (char& c : text)
        if (c == '\n' || c == '\t') c = ' ';
      std::printf("  begins: \"%s\"\n", text.c_str());
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) return usage(false);
  if (std::any_of(args.begin(), args.end(), is_help)) return usage(true);
  try {
    std::string cmd = args[0];
    args.erase(args.begin());
    if (cmd == "prepare") return prepare(args);
    if (cmd == "info") return info(args);
    std::fprintf(stderr, "tessera-data: unknown command '%s' (valid: prepare, info)\n",
                 cmd.c_str());
    return usage(false);
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "tessera-data: error: out of host memory (std::bad_alloc)\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tessera-data: error: %s\n", e.what());
    return 1;
  }
}
