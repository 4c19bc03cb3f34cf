// GPT-2's tokenizer: byte-level BPE, read from a Hugging Face tokenizer.json.
//
// Encoding, as the `tokenizers` library does it for such a file:
//   1. the added tokens (e.g. <|endoftext|>) are cut out of the text where
//      they occur, longest first, and become their ids;
//   2. each piece between them is split by GPT-2's pattern
//        's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//      (after a leading space is added where add_prefix_space asks for one);
//   3. each word's UTF-8 bytes start as one token per byte, and the merges are
//      applied, the lowest-ranked adjacent pair first, until none applies.
// Decoding joins the tokens' bytes. Any byte string encodes and decodes back to
// itself: bytes that are not valid UTF-8 split like punctuation.
//
// What the file may say is checked when it is read; anything this encoder would
// not reproduce exactly (normalizers, other pre-tokenizers or models, added
// BOS/EOS, stripping added tokens) is refused, naming the field.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace tessera::io {

class BpeTokenizer {
 public:
  // Throws naming the file on a missing file, malformed JSON or an unsupported setting.
  static BpeTokenizer load(const std::string& path);
  // `source` names the text in error messages.
  static BpeTokenizer from_json(const std::string& json_text, const std::string& source);

  std::vector<int64_t> encode(std::string_view text) const;
  // Throws on an id outside [0, vocab_size()) or one that names no token.
  std::string decode(std::span<const int64_t> ids) const;
  // The bytes of one token (a partial UTF-8 character for some): streaming output.
  const std::string& token_bytes(int64_t id) const;
  // Whether a token has this id (a model's vocabulary may be padded beyond it).
  bool contains(int64_t id) const {
    return id >= 0 && id < vocab_size() && known_[static_cast<size_t>(id)];
  }

  // One more than the largest id: the smallest model.vocab_size that fits.
  int64_t vocab_size() const { return static_cast<int64_t>(bytes_.size()); }
  // The id of an added token such as "<|endoftext|>", if the file has it.
  std::optional<int64_t> added_token(std::string_view content) const;

  // What a file may claim: its size, and an added token's length (each
  // position of a text is matched against them, so the work per byte is
  // bounded by it). Larger ones are refused by name.
  static constexpr size_t kMaxFileBytes = size_t{256} << 20;
  static constexpr size_t kMaxAddedBytes = 256;

 private:
  struct Merge {
    int32_t rank, merged;
  };
  struct Added {
    std::string content;
    int32_t id;
  };
  BpeTokenizer() = default;
  void encode_piece(std::string_view piece, std::vector<int64_t>& out,
                    std::unordered_map<std::string, std::vector<int32_t>>& cache) const;
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;
  void build_added_trie();
  std::pair<size_t, int32_t> added_at(std::string_view text, size_t i) const;

  std::vector<std::string> bytes_;  // by id; empty where no token has the id
  std::vector<bool> known_;         // by id: some token has it
  int32_t byte_ids_[256] = {};      // the one-byte tokens
  std::unordered_map<uint64_t, Merge> merges_;       // (left id << 32 | right id)
  std::unordered_map<std::string, int32_t> words_;   // ignore_merges: whole words in the vocabulary
  std::vector<Added> added_;                          // as the file lists them
  // The added tokens' bytes as a trie: node 0 the root, (node << 8 | byte)
  // -> child, and the token that ends at a node (-1 where none does).
  std::unordered_map<uint64_t, int32_t> trie_next_;
  std::vector<int32_t> trie_token_;                   // empty: no added tokens
  bool added_first_[256] = {};                        // bytes an added token starts with
  bool add_prefix_space_ = false;
  bool use_regex_ = true;
  bool ignore_merges_ = false;
};

// A prompt's tokens and a sampled token's text, with a tokenizer or, where
// there is none (nullptr), byte tokens; an id no token has (a padded
// vocabulary, or over 255 without a tokenizer) prints as "[id]".
std::vector<int64_t> prompt_tokens(const BpeTokenizer* tokenizer, std::string_view text);
std::string token_text(const BpeTokenizer* tokenizer, int64_t id);

// The tokenizer.json that goes with the weights in `dir`: in it or in one of the
// two folders above (a checkpoint step -> its folder -> the run folder where
// tessera-train copies training.tokenizer). "" if there is none.
std::string tokenizer_beside(const std::string& dir);

// GPT-2's pre-tokenizer pattern (step 2 above): the end of the word that starts
// at byte `begin` of `text`. Exposed for tests.
size_t gpt2_word_end(std::string_view text, size_t begin);

}  // namespace tessera::io
