#include "io/tokenizer.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <queue>
#include <fstream>
#include <sstream>

#include "io/unicode_classes.h"
#include "runtime/check.h"
#include "runtime/json_scan.h"

namespace tessera::io {

using json = nlohmann::json;

namespace {

// ---- Code points and their classes ------------------------------------------

constexpr uint32_t kInvalid = 0xFFFFFFFF;  // a byte that starts no valid UTF-8 sequence

struct CodePoint {
  uint32_t value;
  size_t length;  // bytes
};

// The code point at byte i; an invalid or truncated sequence, an overlong form or
// a surrogate is one kInvalid byte.
CodePoint code_point_at(std::string_view s, size_t i) {
  auto byte = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  unsigned char b0 = byte(i);
  if (b0 < 0x80) return {b0, 1};
  size_t n = b0 >= 0xF0 && b0 <= 0xF4 ? 4 : b0 >= 0xE0 ? 3 : b0 >= 0xC2 && b0 < 0xE0 ? 2 : 0;
  if (n == 0 || i + n > s.size()) return {kInvalid, 1};
  uint32_t cp = b0 & (0x7F >> n);
  for (size_t k = 1; k < n; ++k) {
    if ((byte(i + k) & 0xC0) != 0x80) return {kInvalid, 1};
    cp = cp << 6 | (byte(i + k) & 0x3F);
  }
  bool overlong = (n == 3 && cp < 0x800) || (n == 4 && cp < 0x10000);
  if (overlong || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return {kInvalid, 1};
  return {cp, n};
}

template <size_t N>
bool in_ranges(const unicode::CodeRange (&ranges)[N], uint32_t cp) {
  auto it = std::upper_bound(std::begin(ranges), std::end(ranges), cp,
                             [](uint32_t v, const unicode::CodeRange& r) { return v < r.first; });
  return it != std::begin(ranges) && cp <= std::prev(it)->last;
}

bool is_letter(uint32_t cp) { return cp != kInvalid && in_ranges(unicode::kLetters, cp); }
bool is_number(uint32_t cp) { return cp != kInvalid && in_ranges(unicode::kNumbers, cp); }

// \s of the regular expression: Unicode's White_Space property.
bool is_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

bool is_other(uint32_t cp) { return !is_space(cp) && !is_letter(cp) && !is_number(cp); }

// ---- GPT-2's byte <-> character table ---------------------------------------

// Printable bytes stand for themselves; the other 68 (controls, space, 0x7F-0xA0,
// 0xAD) for the characters from U+0100 on, in byte order.
std::vector<uint32_t> byte_characters() {
  std::vector<uint32_t> table(256);
  uint32_t next = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    table[b] = printable ? b : next++;
  }
  return table;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | cp >> 6));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {  // the table's characters are all below U+0800
    out.push_back(static_cast<char>(0xE0 | cp >> 12));
    out.push_back(static_cast<char>(0x80 | (cp >> 6 & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// A vocabulary entry (bytes written as the table's characters) back to its bytes;
// nullopt if a character is not in the table.
std::optional<std::string> entry_bytes(std::string_view entry, const std::vector<uint32_t>& chars) {
  std::string out;
  for (size_t i = 0; i < entry.size();) {
    CodePoint cp = code_point_at(entry, i);
    auto it = std::find(chars.begin(), chars.end(), cp.value);
    if (cp.value == kInvalid || it == chars.end()) return std::nullopt;
    out.push_back(static_cast<char>(it - chars.begin()));
    i += cp.length;
  }
  return out;
}

// ---- Reading the file --------------------------------------------------------

// `field` of `obj` must be absent, null or one of `allowed` (compared as JSON).
void expect_field(const json& obj, const char* where, const char* field,
                  std::initializer_list<json> allowed, const std::string& source,
                  const char* why) {
  if (!obj.contains(field) || obj[field].is_null()) return;
  for (const json& a : allowed)
    if (obj[field] == a) return;
  TS_CHECK(false, "{}: {}.{} is {}, which this tokenizer does not support ({})", source, where,
           field, obj[field].dump(), why);
}

std::string type_of(const json& obj) {
  return obj.is_object() && obj.contains("type") && obj["type"].is_string()
             ? obj["type"].get<std::string>()
             : "";
}

}  // namespace

// ---- The pattern ---------------------------------------------------------------

size_t gpt2_word_end(std::string_view text, size_t begin) {
  const size_t n = text.size();
  auto at = [&](size_t i) { return code_point_at(text, i); };
  CodePoint c = at(begin);
  // 's 't 're 've 'm 'll 'd (lower case only, as GPT-2's pattern has them)
  if (c.value == '\'' && begin + 1 < n) {
    char c1 = text[begin + 1];
    if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return begin + 2;
    if (begin + 2 < n) {
      char c2 = text[begin + 2];
      if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l'))
        return begin + 3;
    }
  }
  // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: one optional space, then a run of the class.
  for (bool (*cls)(uint32_t) : {is_letter, is_number, is_other}) {
    size_t i = begin;
    if (c.value == ' ' && begin + 1 < n) ++i;
    if (i == begin && !cls(c.value)) continue;
    if (i > begin && !cls(at(i).value)) continue;
    while (i < n) {
      CodePoint d = at(i);
      if (!cls(d.value)) break;
      i += d.length;
    }
    return i;
  }
  // `\s+(?!\S)|\s+`: a run of white space, less its last character when a
  // non-space follows and the run has more than one.
  size_t i = begin, last = begin;
  while (i < n) {
    CodePoint d = at(i);
    if (!is_space(d.value)) break;
    last = i;
    i += d.length;
  }
  if (i == n || last == begin) return i;
  return last;
}

// ---- The tokenizer ---------------------------------------------------------------

BpeTokenizer BpeTokenizer::load(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  TS_CHECK(fs::exists(path, ec), "cannot read tokenizer '{}' (expected a Hugging Face tokenizer.json)", path);
  TS_CHECK(fs::is_regular_file(path, ec), "tokenizer '{}' is not a regular file (a Hugging Face tokenizer.json)",
           path);
  const uintmax_t size = fs::file_size(path, ec);
  TS_CHECK(!ec && size <= kMaxFileBytes, "tokenizer '{}' is {} bytes; a tokenizer.json is read up to {} MiB "
           "(GPT-2's is 1.4 MB, the largest common ones 30 MB)", path, size, kMaxFileBytes >> 20);
  std::ifstream in(path, std::ios::binary);
  TS_CHECK(in.good(), "cannot read tokenizer '{}' (expected a Hugging Face tokenizer.json)", path);
  std::string text(static_cast<size_t>(size), '\0');
  in.read(text.data(), static_cast<std::streamsize>(size));
  TS_CHECK(in.gcount() == static_cast<std::streamsize>(size), "tokenizer '{}': short read", path);
  return from_json(text, path);
}

BpeTokenizer BpeTokenizer::from_json(const std::string& json_text, const std::string& source) {
  TS_CHECK(json_text.size() <= kMaxFileBytes, "{}: {} bytes; a tokenizer.json is read up to {} MiB", source,
           json_text.size(), kMaxFileBytes >> 20);
  check_json_nesting(json_text, source);  // before anything copies or prints a value
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& e) {
    TS_CHECK(false, "{}: not valid JSON ({})", source, e.what());
  }
  TS_CHECK(root.is_object() && root.contains("model") && root["model"].is_object(),
           "{}: expected a Hugging Face tokenizer.json (an object with a \"model\")", source);
  const json& model = root["model"];
  TS_CHECK(type_of(model) == "BPE", "{}: model.type is '{}'; this tokenizer reads byte-level BPE only",
           source, type_of(model));
  expect_field(model, "model", "dropout", {0, 0.0}, source, "dropout makes encoding random");
  expect_field(model, "model", "continuing_subword_prefix", {""}, source, "not byte-level BPE");
  expect_field(model, "model", "end_of_word_suffix", {""}, source, "not byte-level BPE");
  expect_field(model, "model", "byte_fallback", {false}, source, "not byte-level BPE");
  TS_CHECK(!root.contains("normalizer") || root["normalizer"].is_null(),
           "{}: normalizer {} is not supported (byte-level BPE files have none)", source,
           root.contains("normalizer") ? type_of(root["normalizer"]) : "");

  BpeTokenizer t;
  // Pre-tokenizer: GPT-2's ByteLevel (with or without its pattern), nothing else.
  const json pre = root.value("pre_tokenizer", json());
  TS_CHECK(type_of(pre) == "ByteLevel",
           "{}: pre_tokenizer is '{}'; this tokenizer supports GPT-2's ByteLevel pre-tokenizer only",
           source, pre.is_null() ? "null" : type_of(pre));
  t.add_prefix_space_ = pre.value("add_prefix_space", false);
  t.use_regex_ = pre.value("use_regex", true);
  const json dec = root.value("decoder", json());
  TS_CHECK(dec.is_null() || type_of(dec) == "ByteLevel",
           "{}: decoder is '{}'; expected ByteLevel (or none)", source, type_of(dec));
  const json post = root.value("post_processor", json());
  TS_CHECK(post.is_null() || type_of(post) == "ByteLevel",
           "{}: post_processor is '{}'; only ByteLevel (or none) is supported: a template that "
           "adds BOS/EOS tokens would not be reproduced",
           source, type_of(post));
  t.ignore_merges_ = model.value("ignore_merges", false);

  // The vocabulary: every entry's bytes, every byte's token. Ids are checked
  // against the number of entries before anything is sized by them (a file
  // of a few bytes may claim id 2^31 - 1), and no two tokens share one.
  TS_CHECK(model.contains("vocab") && model["vocab"].is_object() && !model["vocab"].empty(),
           "{}: model.vocab is missing or empty", source);
  const json& added_tokens = root.contains("added_tokens") ? root["added_tokens"] : json();
  TS_CHECK(added_tokens.is_null() || added_tokens.is_array(), "{}: added_tokens is not a list", source);
  const int64_t entries = static_cast<int64_t>(model["vocab"].size() + (added_tokens.is_array() ? added_tokens.size() : 0));
  const std::vector<uint32_t> chars = byte_characters();
  std::unordered_map<std::string, int32_t> entry_ids;
  std::vector<std::string> owner;  // by id: what gave it (for the error that names both)
  auto set_id = [&](int64_t id, std::string bytes, const std::string& what, bool added) {
    TS_CHECK(id >= 0 && id < entries, "{}: {} has id {}; the file's {} tokens take ids 0..{}", source, what, id,
             entries, entries - 1);
    const auto i = static_cast<size_t>(id);
    if (i >= t.bytes_.size()) {
      t.bytes_.resize(i + 1);
      t.known_.resize(i + 1, false);
      owner.resize(i + 1);
    }
    if (t.known_[i]) {  // GPT-2's <|endoftext|> is both a vocabulary entry and an added token: the same bytes
      TS_CHECK(added && t.bytes_[i] == bytes, "{}: {} and {} both have id {}: each id names one token", source,
               owner[i], what, id);
      return;
    }
    t.bytes_[i] = std::move(bytes);
    t.known_[i] = true;
    owner[i] = what;
  };
  for (const auto& [entry, id] : model["vocab"].items()) {
    TS_CHECK(id.is_number_integer(), "{}: model.vocab[\"{}\"] is {}, expected an integer id",
             source, entry, id.dump());
    std::optional<std::string> bytes = entry_bytes(entry, chars);
    TS_CHECK(bytes.has_value(),
             "{}: model.vocab entry \"{}\" is not written in GPT-2's byte characters (not a "
             "byte-level BPE vocabulary)",
             source, entry);
    set_id(id.get<int64_t>(), *bytes, fmt::format("model.vocab entry \"{}\"", entry), false);
    entry_ids[entry] = static_cast<int32_t>(id.get<int64_t>());
  }
  for (int b = 0; b < 256; ++b) {
    std::string entry;
    append_utf8(entry, chars[static_cast<size_t>(b)]);
    auto it = entry_ids.find(entry);
    TS_CHECK(it != entry_ids.end(),
             "{}: model.vocab has no token for byte 0x{:02X} (\"{}\"), so some text could not be "
             "encoded",
             source, b, entry);
    t.byte_ids_[b] = it->second;
  }
  if (t.ignore_merges_)
    for (const auto& [entry, id] : entry_ids) t.words_[*entry_bytes(entry, chars)] = id;

  // The merges, in rank order: "a b" (older files) or ["a", "b"].
  TS_CHECK(model.contains("merges") && model["merges"].is_array(), "{}: model.merges is missing",
           source);
  int32_t rank = 0;
  for (const json& m : model["merges"]) {
    std::string left, right;
    if (m.is_string()) {
      std::string s = m.get<std::string>();
      size_t space = s.find(' ');
      TS_CHECK(space != std::string::npos && s.find(' ', space + 1) == std::string::npos,
               "{}: merge {} \"{}\" is not two tokens separated by one space", source, rank, s);
      left = s.substr(0, space);
      right = s.substr(space + 1);
    } else {
      TS_CHECK(m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string(),
               "{}: merge {} is {}, expected \"a b\" or [\"a\", \"b\"]", source, rank, m.dump());
      left = m[0].get<std::string>();
      right = m[1].get<std::string>();
    }
    auto l = entry_ids.find(left), r = entry_ids.find(right), lr = entry_ids.find(left + right);
    TS_CHECK(l != entry_ids.end() && r != entry_ids.end() && lr != entry_ids.end(),
             "{}: merge {} (\"{}\" \"{}\") names a token the vocabulary lacks", source, rank, left,
             right);
    uint64_t key = static_cast<uint64_t>(l->second) << 32 | static_cast<uint32_t>(r->second);
    // A pair listed twice takes its later rank, as the tokenizers library's map
    // of merges (and GPT-2's encoder.py dict) keep the last entry.
    t.merges_.insert_or_assign(key, Merge{rank, lr->second});
    ++rank;
  }

  // Added tokens: matched in the text as they are, the longest at each position.
  if (added_tokens.is_array()) {
    for (const json& a : added_tokens) {
      TS_CHECK(a.is_object() && a.contains("id") && a["id"].is_number_integer() &&
                   a.contains("content") && a["content"].is_string() &&
                   !a["content"].get<std::string>().empty(),
               "{}: added token {} lacks an integer id or a non-empty content", source, a.dump().substr(0, 200));
      std::string content = a["content"].get<std::string>();
      TS_CHECK(content.size() <= kMaxAddedBytes, "{}: added token {} is {} bytes; added tokens are read up to {} "
               "(special tokens are words, not texts)", source, a["id"].dump(), content.size(), kMaxAddedBytes);
      for (const char* flag : {"single_word", "lstrip", "rstrip"}) {
        const json& f = a.contains(flag) ? a[flag] : json(false);
        TS_CHECK(f.is_boolean() || f.is_null(), "{}: added token \"{}\": {} must be true or false, got {}", source,
                 content, flag, f.dump().substr(0, 100));
        TS_CHECK(!f.is_boolean() || !f.get<bool>(), "{}: added token \"{}\" sets {}, which is not supported",
                 source, content, flag);
      }
      set_id(a["id"].get<int64_t>(), content, fmt::format("added token \"{}\"", content), true);
      t.added_.push_back({content, static_cast<int32_t>(a["id"].get<int64_t>())});
    }
    t.build_added_trie();
  }
  return t;
}

void BpeTokenizer::build_added_trie() {
  trie_token_.assign(1, -1);
  trie_next_.clear();
  for (const Added& a : added_) {
    added_first_[static_cast<unsigned char>(a.content[0])] = true;
    int32_t node = 0;
    for (unsigned char ch : a.content) {
      auto [it, fresh] = trie_next_.try_emplace(static_cast<uint64_t>(node) << 8 | ch,
                                                static_cast<int32_t>(trie_token_.size()));
      if (fresh) trie_token_.push_back(-1);
      node = it->second;
    }
    if (trie_token_[static_cast<size_t>(node)] < 0) trie_token_[static_cast<size_t>(node)] = a.id;
  }
}

// The longest added token that starts at byte i of text: its length and id
// (0, -1 if none). A walk down the trie of added tokens, so at most the
// longest token's length of bytes is read (kMaxAddedBytes).
std::pair<size_t, int32_t> BpeTokenizer::added_at(std::string_view text, size_t i) const {
  std::pair<size_t, int32_t> best{0, -1};
  if (i >= text.size() || !added_first_[static_cast<unsigned char>(text[i])]) return best;
  int32_t node = 0;
  for (size_t k = i; k < text.size(); ++k) {
    auto it = trie_next_.find(static_cast<uint64_t>(node) << 8 | static_cast<unsigned char>(text[k]));
    if (it == trie_next_.end()) break;
    node = it->second;
    if (trie_token_[static_cast<size_t>(node)] >= 0) best = {k + 1 - i, trie_token_[static_cast<size_t>(node)]};
  }
  return best;
}

std::optional<int64_t> BpeTokenizer::added_token(std::string_view content) const {
  if (content.empty()) return std::nullopt;
  auto [length, id] = added_at(content, 0);
  if (id >= 0 && length == content.size()) return id;
  return std::nullopt;
}

void BpeTokenizer::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  out.clear();
  if (ignore_merges_)
    if (auto it = words_.find(std::string(word)); it != words_.end()) {
      out.push_back(it->second);
      return;
    }
  // The tokenizers library's merge loop (models/bpe/word.rs): the symbols in a
  // linked list, every mergeable adjacent pair in a min-heap by (rank,
  // position); the lowest is merged if it is still there, and the pairs it
  // makes with its neighbours are pushed. O(n log n) in the word's length
  // (rescanning the word for its best pair after each merge is O(n^2): a
  // megabyte-long word took minutes).
  const size_t n = word.size();
  std::vector<int32_t> id(n), prev(n), next(n);
  for (size_t i = 0; i < n; ++i) {
    id[i] = byte_ids_[static_cast<unsigned char>(word[i])];
    prev[i] = static_cast<int32_t>(i) - 1;
    next[i] = i + 1 < n ? static_cast<int32_t>(i + 1) : -1;
  }
  struct Candidate {
    int32_t rank, pos, merged;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  auto push = [&](int32_t pos) {  // the pair that starts at symbol pos, if it merges
    if (pos < 0 || next[static_cast<size_t>(pos)] < 0) return;
    const uint64_t key = static_cast<uint64_t>(id[static_cast<size_t>(pos)]) << 32 |
                         static_cast<uint32_t>(id[static_cast<size_t>(next[static_cast<size_t>(pos)])]);
    if (auto it = merges_.find(key); it != merges_.end()) heap.push({it->second.rank, pos, it->second.merged});
  };
  for (size_t i = 0; i + 1 < n; ++i) push(static_cast<int32_t>(i));
  std::vector<bool> gone(n, false);
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    const auto p = static_cast<size_t>(c.pos);
    if (gone[p] || next[p] < 0) continue;
    const auto q = static_cast<size_t>(next[p]);
    const uint64_t key = static_cast<uint64_t>(id[p]) << 32 | static_cast<uint32_t>(id[q]);
    auto it = merges_.find(key);
    if (it == merges_.end() || it->second.merged != c.merged) continue;  // the pair changed since it was pushed
    id[p] = c.merged;
    gone[q] = true;
    next[p] = next[q];
    if (next[q] >= 0) prev[static_cast<size_t>(next[q])] = c.pos;
    push(prev[p]);
    push(c.pos);
  }
  for (int32_t i = n > 0 ? 0 : -1; i >= 0; i = next[static_cast<size_t>(i)]) out.push_back(id[static_cast<size_t>(i)]);
}

void BpeTokenizer::encode_piece(std::string_view piece, std::vector<int64_t>& out,
                                std::unordered_map<std::string, std::vector<int32_t>>& cache) const {
  std::string prefixed;
  if (add_prefix_space_ && piece.front() != ' ') {
    prefixed.reserve(piece.size() + 1);
    prefixed.push_back(' ');
    prefixed.append(piece);
    piece = prefixed;
  }
  auto emit = [&](std::string_view word) {
    auto [it, fresh] = cache.try_emplace(std::string(word));
    if (fresh) encode_word(word, it->second);
    out.insert(out.end(), it->second.begin(), it->second.end());
  };
  if (!use_regex_) {
    emit(piece);
    return;
  }
  for (size_t i = 0; i < piece.size();) {
    size_t end = gpt2_word_end(piece, i);
    emit(piece.substr(i, end - i));
    i = end;
  }
}

std::vector<int64_t> BpeTokenizer::encode(std::string_view text) const {
  std::vector<int64_t> out;
  out.reserve(text.size() / 3);
  std::unordered_map<std::string, std::vector<int32_t>> cache;
  size_t start = 0;  // of the text not yet encoded
  for (size_t i = 0; i < text.size();) {
    auto [length, id] = added_at(text, i);
    if (id < 0) {
      ++i;
      continue;
    }
    if (i > start) encode_piece(text.substr(start, i - start), out, cache);
    out.push_back(id);
    i += length;
    start = i;
  }
  if (start < text.size()) encode_piece(text.substr(start), out, cache);
  return out;
}

const std::string& BpeTokenizer::token_bytes(int64_t id) const {
  TS_CHECK(contains(id), "token id {} is not in the tokenizer's vocabulary (ids 0..{})", id, vocab_size() - 1);
  return bytes_[static_cast<size_t>(id)];
}

std::string BpeTokenizer::decode(std::span<const int64_t> ids) const {
  std::string out;
  for (int64_t id : ids) out += token_bytes(id);
  return out;
}

std::vector<int64_t> prompt_tokens(const BpeTokenizer* tokenizer, std::string_view text) {
  if (tokenizer != nullptr) return tokenizer->encode(text);
  std::vector<int64_t> bytes;
  for (unsigned char ch : text) bytes.push_back(ch);
  return bytes;
}

std::string token_text(const BpeTokenizer* tokenizer, int64_t id) {
  if (tokenizer != nullptr ? tokenizer->contains(id) : (id >= 0 && id < 256))
    return tokenizer != nullptr ? tokenizer->token_bytes(id) : std::string(1, static_cast<char>(id));
  return fmt::format("[{}]", id);
}

std::string tokenizer_beside(const std::string& dir) {
  std::filesystem::path at = std::filesystem::absolute(dir.empty() ? "." : dir);
  for (int up = 0; up < 3; ++up, at = at.parent_path())
    if (std::filesystem::is_regular_file(at / "tokenizer.json")) return (at / "tokenizer.json").string();
  return "";
}

}  // namespace tessera::io
