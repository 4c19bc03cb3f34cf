#include "runtime/json_scan.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <set>
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

namespace {

// A SAX reader that builds nothing: the keys of each open object, and where
// it is, until a key comes twice.
struct DuplicateKeys : nlohmann::json_sax<nlohmann::json> {
  struct Open {
    bool object = false;
    std::set<std::string> keys;
    std::string key;  // an object's current member
    int64_t index = -1;  // an array's current element
  };
  std::vector<Open> open;
  std::string found;

  // Each value of an array is its next element.
  void value() {
    if (!open.empty() && !open.back().object) ++open.back().index;
  }
  // Where the innermost object (the one holding `last`) lies.
  std::string path(const std::string& last) const {
    std::string p;
    for (size_t i = 0; i + 1 < open.size(); ++i)
      p += open[i].object ? (p.empty() ? "" : ".") + open[i].key : fmt::format("[{}]", open[i].index);
    return p.empty() ? fmt::format("'{}' at the top level", last) : fmt::format("'{}' in {}", last, p);
  }
  bool null() override { return value(), true; }
  bool boolean(bool) override { return value(), true; }
  bool number_integer(number_integer_t) override { return value(), true; }
  bool number_unsigned(number_unsigned_t) override { return value(), true; }
  bool number_float(number_float_t, const string_t&) override { return value(), true; }
  bool string(string_t&) override { return value(), true; }
  bool binary(binary_t&) override { return value(), true; }
  bool start_object(std::size_t) override {
    value();
    open.push_back({true, {}, "", -1});
    return true;
  }
  bool key(string_t& k) override {
    if (!open.back().keys.insert(k).second) {
      found = path(k);
      return false;  // stops the parse
    }
    open.back().key = k;
    return true;
  }
  bool end_object() override {
    open.pop_back();
    return true;
  }
  bool start_array(std::size_t) override {
    value();
    open.push_back({false, {}, "", -1});
    return true;
  }
  bool end_array() override {
    open.pop_back();
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override {
    return false;
  }
};

}  // namespace

std::string json_duplicate_key(std::string_view text) {
  DuplicateKeys sax;
  nlohmann::json::sax_parse(text, &sax, nlohmann::json::input_format_t::json, /*strict=*/true);
  return sax.found;
}

void check_json_unique_keys(std::string_view text, const std::string& what) {
  const std::string dup = json_duplicate_key(text);
  TS_CHECK(dup.empty(), "{}: the key {} appears twice (a reader would keep one of the two values)", what, dup);
}

}  // namespace tessera
