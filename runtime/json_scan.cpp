#include "runtime/json_scan.h"

#include <fmt/format.h>

#include <vector>

#include "runtime/check.h"

namespace tessera {

namespace {

// One open object or array while scanning: the key of the member being read
// (an object), or the index of the element (an array).
struct Frame {
  bool object = false;
  bool expect_key = false;  // an object's next string is a key
  std::string key;
  int64_t index = 0;
};

// The path to the innermost frame, its first `shown` levels only.
std::string path_of(const std::vector<Frame>& frames, size_t shown = 12) {
  std::string path;
  for (size_t i = 0; i + 1 < frames.size() && i < shown; ++i) {
    const Frame& f = frames[i];
    if (f.object) path += (path.empty() ? "" : ".") + f.key;
    else path += fmt::format("[{}]", f.index);
  }
  if (frames.size() > shown + 1) path += "...";
  return path.empty() ? "the top level" : path;
}

}  // namespace

JsonNesting json_nesting(std::string_view text) {
  JsonNesting deepest;
  std::vector<Frame> frames;
  const size_t n = text.size();
  for (size_t i = 0; i < n; ++i) {
    const char c = text[i];
    if (c == '"') {  // a string: skipped, kept only as a key
      const size_t start = ++i;
      while (i < n && text[i] != '"') i += text[i] == '\\' ? 2 : 1;
      if (!frames.empty() && frames.back().object && frames.back().expect_key) {
        const size_t end = std::min(i, n);
        frames.back().key.assign(text.substr(start, std::min<size_t>(end - start, 64)));
        frames.back().expect_key = false;
      }
    } else if (c == '{' || c == '[') {
      frames.push_back({c == '{', c == '{', "", 0});
      if (static_cast<int>(frames.size()) > deepest.depth) {
        deepest.depth = static_cast<int>(frames.size());
        if (deepest.depth <= kMaxJsonDepth + 1) deepest.path = path_of(frames);
      }
    } else if (c == '}' || c == ']') {
      if (!frames.empty()) frames.pop_back();
    } else if (c == ',' && !frames.empty()) {
      if (frames.back().object) frames.back().expect_key = true;
      else ++frames.back().index;
    }
  }
  return deepest;
}

void check_json_nesting(std::string_view text, const std::string& what, int limit) {
  const JsonNesting n = json_nesting(text);
  TS_CHECK(n.depth <= limit, "{}: JSON nested {} levels deep (at {}); at most {} levels are read", what, n.depth,
           n.path, limit);
}

}  // namespace tessera
