// Token data for the command-line tools: a byte-level tokenizer, llm.c token
// shards (header of 256 int32: magic 20240520, version 1, token count; then
// uint16 tokens), and a loader that gives each data-parallel rank disjoint
// samples and can be checkpointed by its position.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/tensor.h"

namespace tessera::io {

class BpeTokenizer;

constexpr int32_t kShardMagic = 20240520;
constexpr int32_t kShardVersion = 1;
// llm.c's Llama-3 shards (magic 20240801, version 7, uint32 tokens): recognised, not read.
constexpr int32_t kLlama3ShardMagic = 20240801;

// Byte-level tokenizer: token = byte value (vocabulary 256).
std::vector<uint16_t> encode_bytes(const std::string& text);
std::string decode_bytes(const std::vector<int64_t>& tokens);

// Reads the plain-text files (fortune databases, or any text); throws if none can be read.
std::string read_text_files(const std::vector<std::string>& paths);
// The default English corpus: the plain-text fortune files of Debian's `fortunes` packages.
std::vector<std::string> default_corpus_files();

void write_shard(const std::string& path, const std::vector<uint16_t>& tokens);
// Throws naming the file on a missing file, wrong magic/version (llm.c's Llama-3
// format is named as such), truncation or trailing bytes.
std::vector<uint16_t> read_shard(const std::string& path);

// Prepares <dir>/<name>_train.bin and <dir>/<name>_val.bin from text files
// (the last val_fraction of the tokens is validation), as byte tokens or, given
// a tokenizer, its tokens (its vocabulary must fit the shards' uint16). Returns
// the two paths.
std::pair<std::string, std::string> prepare_text_dataset(const std::vector<std::string>& files,
                                                         const std::string& dir,
                                                         const std::string& name,
                                                         double val_fraction = 0.1,
                                                         const BpeTokenizer* tokenizer = nullptr);

// The training and validation tokens of text files, as every rank of the job
// needs them: <dir>/<name>_train.bin and _val.bin, prepared by rank 0 where
// they are not there yet, or were prepared from other text (the files'
// fingerprints, recorded in <dir>/<name>.source, differ: another file of the
// same name, or the file edited), then read by each (the others wait; an
// error there is raised on every rank). What tessera-train's text datasets use.
std::pair<std::vector<uint16_t>, std::vector<uint16_t>> text_dataset(const std::vector<std::string>& files,
                                                                     const std::string& dir, const std::string& name,
                                                                     const BpeTokenizer* tokenizer = nullptr);

// A short fingerprint of a file's bytes (16 hex digits, FNV-1a): names the
// shards a tokenizer made, so that a changed tokenizer never reuses them.
std::string file_fingerprint(const std::string& path);

// Samples (x, y) windows of seq_len + 1 tokens. Sample k of the whole run
// starts at a position drawn from (seed, k); rank r of W takes samples
// k = step * global_batch + r * local_batch + i, so ranks read disjoint samples
// and the data is the same for any W at a fixed global batch.
class Loader {
 public:
  Loader(std::vector<uint16_t> tokens, int64_t seq_len, uint64_t seed);
  // The local batch of `step` for rank/world: x, y [local_batch, seq_len] i64.
  std::pair<Tensor, Tensor> batch(int64_t step, int64_t local_batch, int rank, int world) const;
  // Sequential, non-overlapping windows for evaluation (the same on every rank).
  std::pair<Tensor, Tensor> eval_batch(int64_t index, int64_t batch) const;
  int64_t num_tokens() const { return static_cast<int64_t>(tokens_.size()); }
  const std::vector<uint16_t>& tokens() const { return tokens_; }
  int64_t seq_len() const { return seq_len_; }

 private:
  std::vector<uint16_t> tokens_;
  int64_t seq_len_;
  uint64_t seed_;
};

// Cross-entropy (nats/token) of `eval` under the unigram distribution of
// `train` (add-one smoothed): the loss of a model that ignores context.
double unigram_baseline(const std::vector<uint16_t>& train, const std::vector<uint16_t>& eval,
                        int64_t vocab);

}  // namespace tessera::io
