#include "io/data.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

#include "runtime/distributed.h"
#include "runtime/random.h"
#include "io/tokenizer.h"

namespace tessera::io {

namespace fs = std::filesystem;

std::vector<uint16_t> encode_bytes(const std::string& text) {
  std::vector<uint16_t> out(text.size());
  for (size_t i = 0; i < text.size(); ++i) out[i] = static_cast<unsigned char>(text[i]);
  return out;
}

std::string decode_bytes(const std::vector<int64_t>& tokens) {
  std::string s;
  for (int64_t t : tokens) s.push_back(static_cast<char>(t >= 0 && t < 256 ? t : '?'));
  return s;
}

std::string read_text_files(const std::vector<std::string>& paths) {
  std::string all;
  for (const auto& p : paths) {
    TS_CHECK(!fs::is_directory(p), "text file '{}' is a directory: name a text file", p);
    TS_CHECK(!fs::exists(p) || fs::is_regular_file(p),
             "text file '{}' is not a regular file (a device or a pipe has no end to read to)", p);
    std::ifstream in(p, std::ios::binary);
    TS_CHECK(in.good(), "cannot read text file '{}': {}", p,
             fs::exists(p) ? "permission denied?" : "no such file");
    std::stringstream ss;
    ss << in.rdbuf();
    all += ss.str();
  }
  TS_CHECK(!all.empty(), "the text files ({} of them) are empty", paths.size());
  return all;
}

std::vector<std::string> default_corpus_files() {
  const fs::path dir = "/usr/share/games/fortunes";
  std::vector<std::string> files;
  if (fs::is_directory(dir)) {
    for (const auto& e : fs::directory_iterator(dir)) {
      if (!e.is_regular_file()) continue;
      std::string ext = e.path().extension().string();
      if (ext == ".dat" || ext == ".u8") continue;  // index files and UTF-8 duplicates
      files.push_back(e.path().string());
    }
  }
  std::sort(files.begin(), files.end());
  TS_CHECK(!files.empty(),
           "the default corpus is missing: no fortune files in {} (install Debian's package "
           "'fortunes', or train on a text file with --training.dataset text --training.text FILE)",
           dir.string());
  return files;
}

void write_shard(const std::string& path, const std::vector<uint16_t>& tokens) {
  int32_t header[256] = {};
  header[0] = kShardMagic;
  header[1] = kShardVersion;
  TS_CHECK(tokens.size() <= static_cast<size_t>(INT32_MAX),
           "write_shard: {} tokens exceed the format's limit", tokens.size());
  header[2] = static_cast<int32_t>(tokens.size());
  std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary);
    TS_CHECK(out.good(), "cannot write token shard '{}'", tmp);
    out.write(reinterpret_cast<const char*>(header), sizeof(header));
    out.write(reinterpret_cast<const char*>(tokens.data()),
              static_cast<std::streamsize>(tokens.size() * sizeof(uint16_t)));
    TS_CHECK(out.good(), "writing token shard '{}' failed (disk full?)", tmp);
  }
  fs::rename(tmp, path);  // a shard appears only when complete
}

std::vector<uint16_t> read_shard(const std::string& path) {
  TS_CHECK(!fs::is_directory(path), "token shard '{}' is a directory, not an llm.c token shard",
           path);
  TS_CHECK(!fs::exists(path) || fs::is_regular_file(path),
           "token shard '{}' is not a regular file", path);
  std::ifstream in(path, std::ios::binary);
  TS_CHECK(in.good(), "token shard '{}' does not exist or cannot be read", path);
  int32_t header[256];
  in.read(reinterpret_cast<char*>(header), sizeof(header));
  TS_CHECK(in.gcount() == sizeof(header),
           "token shard '{}' is truncated: {} bytes, the llm.c header alone needs {}", path,
           in.gcount(), sizeof(header));
  // llm.c's Llama-3 shards (dev/data/*.py with --model llama-3) hold uint32 tokens from a
  // vocabulary of 128256; tokens here are uint16, so they are named rather than misread.
  TS_CHECK(header[0] != kLlama3ShardMagic,
           "token shard '{}' is in llm.c's Llama-3 format (magic {}, version {}: uint32 tokens), "
           "which tessera does not read; it reads llm.c's GPT-2 shards (magic {}, version {}: "
           "uint16 tokens)",
           path, header[0], header[1], kShardMagic, kShardVersion);
  TS_CHECK(header[0] == kShardMagic,
           "token shard '{}' has magic {}, expected {}: not an llm.c token shard (a header of 256 "
           "int32: magic, version, token count; then uint16 tokens)",
           path, header[0], kShardMagic);
  TS_CHECK(header[1] == kShardVersion,
           "token shard '{}' has version {}, expected {} (llm.c's GPT-2 shards: uint16 tokens)",
           path, header[1], kShardVersion);
  TS_CHECK(header[2] >= 0, "token shard '{}' has a negative token count {}", path, header[2]);
  // As llm.c's loader: the file is exactly the header and the tokens it
  // promises. Checked against the file's size before the tokens are allocated.
  uint64_t expected = sizeof(header) + static_cast<uint64_t>(header[2]) * 2;
  uint64_t size = fs::file_size(path);
  TS_CHECK(size >= expected, "token shard '{}' is truncated: header promises {} tokens, file holds {}",
           path, header[2], (size - sizeof(header)) / 2);
  TS_CHECK(size == expected,
           "token shard '{}' is longer than its header says: {} tokens ({} bytes with the header), "
           "file has {} bytes",
           path, header[2], expected, size);
  std::vector<uint16_t> tokens(static_cast<size_t>(header[2]));
  in.read(reinterpret_cast<char*>(tokens.data()), static_cast<std::streamsize>(tokens.size() * 2));
  TS_CHECK(static_cast<size_t>(in.gcount()) == tokens.size() * 2,
           "token shard '{}': short read ({} of {} tokens; did the file change while reading?)",
           path, in.gcount() / 2, header[2]);
  return tokens;
}

std::pair<std::string, std::string> prepare_text_dataset(const std::vector<std::string>& files,
                                                         const std::string& dir,
                                                         const std::string& name,
                                                         double val_fraction,
                                                         const BpeTokenizer* tokenizer) {
  std::vector<uint16_t> tokens;
  if (tokenizer == nullptr) {
    tokens = encode_bytes(read_text_files(files));
  } else {
    TS_CHECK(tokenizer->vocab_size() <= 65536,
             "the tokenizer's vocabulary ({} tokens) does not fit token shards (uint16 ids: at "
             "most 65536)",
             tokenizer->vocab_size());
    std::vector<int64_t> ids = tokenizer->encode(read_text_files(files));
    tokens.assign(ids.begin(), ids.end());
  }
  fs::create_directories(dir);
  std::string train = (fs::path(dir) / (name + "_train.bin")).string();
  std::string val = (fs::path(dir) / (name + "_val.bin")).string();
  size_t n_val = static_cast<size_t>(static_cast<double>(tokens.size()) * val_fraction);
  TS_CHECK(n_val > 0 && n_val < tokens.size(),
           "a validation fraction of {} of a corpus of {} tokens is {} tokens: the split needs at least one token "
           "on each side (a larger fraction, or more text)",
           val_fraction, tokens.size(), n_val);
  write_shard(val, std::vector<uint16_t>(tokens.end() - static_cast<long>(n_val), tokens.end()));
  write_shard(train,
              std::vector<uint16_t>(tokens.begin(), tokens.end() - static_cast<long>(n_val)));
  return {train, val};
}

std::string file_fingerprint(const std::string& path) {
  // Checked before it is opened: a pipe would block the open, a device never end.
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  TS_CHECK(!fs::exists(status) || fs::is_regular_file(status),
           "'{}' is not a regular file (a device or a pipe has no end to read to)", path);
  std::ifstream in(path, std::ios::binary);
  TS_CHECK(in.good(), "cannot read '{}'", path);
  uint64_t h = 0xcbf29ce484222325ull;
  char buf[1 << 16];
  while (in.read(buf, sizeof buf) || in.gcount() > 0) {
    for (std::streamsize i = 0; i < in.gcount(); ++i) {
      h ^= static_cast<unsigned char>(buf[i]);
      h *= 0x100000001b3ull;
    }
  }
  return fmt::format("{:016x}", h);
}

Loader::Loader(std::vector<uint16_t> tokens, int64_t seq_len, uint64_t seed)
    : tokens_(std::move(tokens)), seq_len_(seq_len), seed_(seed) {
  TS_CHECK(seq_len > 0, "loader: seq_len must be positive, got {}", seq_len);
  TS_CHECK(num_tokens() > seq_len + 1, "loader: {} tokens are too few for windows of {}",
           num_tokens(), seq_len + 1);
}

std::pair<Tensor, Tensor> Loader::batch(int64_t step, int64_t local_batch, int rank,
                                        int world) const {
  std::vector<int64_t> x(static_cast<size_t>(local_batch * seq_len_)), y(x.size());
  uint64_t span = static_cast<uint64_t>(num_tokens() - seq_len_ - 1);
  int64_t global = local_batch * world;
  for (int64_t i = 0; i < local_batch; ++i) {
    uint64_t sample = static_cast<uint64_t>(step * global + rank * local_batch + i);
    auto r = philox4x32(
        {static_cast<uint32_t>(sample), static_cast<uint32_t>(sample >> 32), 0x6c6f6164u, 0},
        {static_cast<uint32_t>(seed_), static_cast<uint32_t>(seed_ >> 32)});
    uint64_t start = ((static_cast<uint64_t>(r[0]) << 32) | r[1]) % (span + 1);
    for (int64_t t = 0; t < seq_len_; ++t) {
      x[static_cast<size_t>(i * seq_len_ + t)] = tokens_[start + static_cast<uint64_t>(t)];
      y[static_cast<size_t>(i * seq_len_ + t)] = tokens_[start + static_cast<uint64_t>(t) + 1];
    }
  }
  return {from_vector(x, {local_batch, seq_len_}), from_vector(y, {local_batch, seq_len_})};
}

std::pair<Tensor, Tensor> Loader::eval_batch(int64_t index, int64_t batch) const {
  std::vector<int64_t> x(static_cast<size_t>(batch * seq_len_)), y(x.size());
  int64_t windows = (num_tokens() - 1) / seq_len_;
  for (int64_t i = 0; i < batch; ++i) {
    int64_t start = ((index * batch + i) % windows) * seq_len_;
    for (int64_t t = 0; t < seq_len_; ++t) {
      x[static_cast<size_t>(i * seq_len_ + t)] = tokens_[static_cast<size_t>(start + t)];
      y[static_cast<size_t>(i * seq_len_ + t)] = tokens_[static_cast<size_t>(start + t + 1)];
    }
  }
  return {from_vector(x, {batch, seq_len_}), from_vector(y, {batch, seq_len_})};
}

double unigram_baseline(const std::vector<uint16_t>& train, const std::vector<uint16_t>& eval,
                        int64_t vocab) {
  std::vector<double> counts(static_cast<size_t>(vocab), 1.0);  // add-one smoothing
  for (uint16_t t : train) counts[t < vocab ? t : 0] += 1.0;
  double total = static_cast<double>(train.size() + static_cast<size_t>(vocab));
  double nll = 0;
  for (uint16_t t : eval) nll -= std::log(counts[t < vocab ? t : 0] / total);
  return eval.empty() ? 0.0 : nll / static_cast<double>(eval.size());
}

std::pair<std::vector<uint16_t>, std::vector<uint16_t>> text_dataset(const std::vector<std::string>& files,
                                                                     const std::string& dir, const std::string& name,
                                                                     const BpeTokenizer* tokenizer) {
  namespace fs = std::filesystem;
  const std::string train_path = (fs::path(dir) / (name + "_train.bin")).string();
  const std::string val_path = (fs::path(dir) / (name + "_val.bin")).string();
  const fs::path source_path = fs::path(dir) / (name + ".source");
  std::string error;
  if (dist::rank() == 0) {
    try {
      // What the shards were prepared from: each text file's path and fingerprint, a line each.
      std::string source;
      for (const auto& f : files) source += fmt::format("{} {}\n", file_fingerprint(f), f);
      const bool cached = fs::exists(train_path) && fs::exists(val_path);
      std::string recorded;
      if (cached && fs::is_regular_file(source_path)) {
        std::ifstream in(source_path, std::ios::binary);
        recorded.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
      }
      if (!cached || recorded != source) {
        std::printf("preparing %s: %zu text file(s) -> %s, %s%s\n", name.c_str(), files.size(), train_path.c_str(),
                    val_path.c_str(), cached ? " (those held tokens of other text: prepared again)" : "");
        prepare_text_dataset(files, dir, name, 0.1, tokenizer);
        std::ofstream(source_path, std::ios::binary | std::ios::trunc) << source;
      }
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  dist::throw_if_any_failed(dist::world(), error, "preparing the data");
  return {read_shard(train_path), read_shard(val_path)};
}

}  // namespace tessera::io
