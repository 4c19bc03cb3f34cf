#include "io/tokenizer.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "runtime/check.h"
#include "io/unicode_classes.h"

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
  std::ifstream in(path, std::ios::binary);
  TS_CHECK(in.good(), "cannot read tokenizer '{}' (expected a Hugging Face tokenizer.json)", path);
  std::stringstream ss;
  ss << in.rdbuf();
  return from_json(ss.str(), path);
}

BpeTokenizer BpeTokenizer::from_json(const std::string& json_text, const std::string& source) {
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

  // The vocabulary: every entry's bytes, every byte's token.
  TS_CHECK(model.contains("vocab") && model["vocab"].is_object() && !model["vocab"].empty(),
           "{}: model.vocab is missing or empty", source);
  const std::vector<uint32_t> chars = byte_characters();
  std::unordered_map<std::string, int32_t> entry_ids;
  auto set_id = [&](int64_t id, std::string bytes, const std::string& what) {
    TS_CHECK(id >= 0 && id < (int64_t{1} << 31), "{}: {} has id {}, outside [0, 2^31)", source,
             what, id);
    if (static_cast<size_t>(id) >= t.bytes_.size()) {
      t.bytes_.resize(static_cast<size_t>(id) + 1);
      t.known_.resize(static_cast<size_t>(id) + 1, false);
    }
    t.bytes_[static_cast<size_t>(id)] = std::move(bytes);
    t.known_[static_cast<size_t>(id)] = true;
  };
  for (const auto& [entry, id] : model["vocab"].items()) {
    TS_CHECK(id.is_number_integer(), "{}: model.vocab[\"{}\"] is {}, expected an integer id",
             source, entry, id.dump());
    std::optional<std::string> bytes = entry_bytes(entry, chars);
    TS_CHECK(bytes.has_value(),
             "{}: model.vocab entry \"{}\" is not written in GPT-2's byte characters (not a "
             "byte-level BPE vocabulary)",
             source, entry);
    set_id(id.get<int64_t>(), *bytes, fmt::format("model.vocab entry \"{}\"", entry));
    entry_ids[entry] = id.get<int32_t>();
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
    t.merges_.try_emplace(key, Merge{rank, lr->second});  // the first (lowest) rank wins
    ++rank;
  }

  // Added tokens: matched in the text as they are.
  if (root.contains("added_tokens") && !root["added_tokens"].is_null()) {
    TS_CHECK(root["added_tokens"].is_array(), "{}: added_tokens is not a list", source);
    for (const json& a : root["added_tokens"]) {
      TS_CHECK(a.is_object() && a.contains("id") && a["id"].is_number_integer() &&
                   a.contains("content") && a["content"].is_string() &&
                   !a["content"].get<std::string>().empty(),
               "{}: added token {} lacks an integer id or a non-empty content", source, a.dump());
      std::string content = a["content"].get<std::string>();
      for (const char* flag : {"single_word", "lstrip", "rstrip"})
        TS_CHECK(!a.value(flag, false), "{}: added token \"{}\" sets {}, which is not supported",
                 source, content, flag);
      set_id(a["id"].get<int64_t>(), content, fmt::format("added token \"{}\"", content));
      t.added_.push_back({content, a["id"].get<int32_t>()});
      t.added_first_[static_cast<unsigned char>(content[0])] = true;
    }
    std::stable_sort(t.added_.begin(), t.added_.end(), [](const Added& x, const Added& y) {
      return x.content.size() > y.content.size();
    });
  }
  return t;
}

std::optional<int64_t> BpeTokenizer::added_token(std::string_view content) const {
  for (const Added& a : added_)
    if (a.content == content) return a.id;
  return std::nullopt;
}

void BpeTokenizer::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  out.clear();
  if (ignore_merges_)
    if (auto it = words_.find(std::string(word)); it != words_.end()) {
      out.push_back(it->second);
      return;
    }
  for (char ch : word) out.push_back(byte_ids_[static_cast<unsigned char>(ch)]);
  // The lowest-ranked adjacent pair, merged everywhere left to right, until none is left.
  while (out.size() > 1) {
    int32_t best = INT32_MAX, merged = -1;
    uint64_t best_key = 0;
    for (size_t i = 0; i + 1 < out.size(); ++i) {
      uint64_t key = static_cast<uint64_t>(out[i]) << 32 | static_cast<uint32_t>(out[i + 1]);
      auto it = merges_.find(key);
      if (it != merges_.end() && it->second.rank < best) {
        best = it->second.rank;
        merged = it->second.merged;
        best_key = key;
      }
    }
    if (merged < 0) break;
    size_t w = 0;
    for (size_t i = 0; i < out.size(); ++w) {
      if (i + 1 < out.size() &&
          (static_cast<uint64_t>(out[i]) << 32 | static_cast<uint32_t>(out[i + 1])) == best_key) {
        out[w] = merged;
        i += 2;
      } else {
        out[w] = out[i++];
      }
    }
    out.resize(w);
  }
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
    if (!added_first_[static_cast<unsigned char>(text[i])]) {
      ++i;
      continue;
    }
    const Added* hit = nullptr;
    for (const Added& a : added_)  // longest first
      if (text.compare(i, a.content.size(), a.content) == 0) {
        hit = &a;
        break;
      }
    if (!hit) {
      ++i;
      continue;
    }
    if (i > start) encode_piece(text.substr(start, i - start), out, cache);
    out.push_back(hit->id);
    i += hit->content.size();
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
