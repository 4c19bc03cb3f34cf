// Limits a reader checks on a JSON text before handing it to a parser whose
// copies and dumps recurse once per level of nesting (nlohmann::json): the
// depth, found by one pass without recursion, and where it is reached. A file
// nested some tens of thousands deep otherwise crashes its reader with a stack
// overflow on the first copy or message that prints it.
#pragma once

#include <string>
#include <string_view>

namespace tessera {

// The deepest nesting of objects and arrays in `text` (0 for a scalar) and the
// path down to where it is first reached: keys and array indices, e.g.
// `model.vocab` or `added_tokens[3].content`, its first levels only for a deep one.
struct JsonNesting {
  int depth = 0;
  std::string path;
};
JsonNesting json_nesting(std::string_view text);

// The depth a reader of Tessera's files accepts: the files it reads
// (tokenizer.json, config.json, checkpoint metadata, safetensors headers)
// are a handful of levels deep.
inline constexpr int kMaxJsonDepth = 64;

// Throws "<what>: JSON nested N levels deep at <path>; at most <limit> levels
// are read" when `text` is deeper than `limit`.
void check_json_nesting(std::string_view text, const std::string& what, int limit = kMaxJsonDepth);

// The first key that one object of `text` names twice, as a path (`tensors[2].name`,
// `model.vocab.a`), or "" when every object's keys are distinct (or the text
// is not JSON: the parser says so next). A parser keeps one of the two values
// without a word, so a reader of Tessera's files refuses the text.
std::string json_duplicate_key(std::string_view text);

// Throws "<what>: the key <path> appears twice" for such a text.
void check_json_unique_keys(std::string_view text, const std::string& what);

}  // namespace tessera
