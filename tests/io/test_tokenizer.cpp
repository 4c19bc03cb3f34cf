// Byte-level BPE from a Hugging Face tokenizer.json (io/tokenizer.h) against
// the `tokenizers` library: tests/fixtures/make_bpe_tokenizer.py trained two
// tokenizers on the default corpus and wrote, for hostile texts and corpus
// excerpts, the ids and decoded text that library gives.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include <nlohmann/json.hpp>

#include "io/tokenizer.h"
#include "runtime/check.h"

using namespace tessera;
using io::BpeTokenizer;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

fs::path fixture(const std::string& name) {
  const char* d = std::getenv("TESSERA_FIXTURES");
  return fs::path(d != nullptr ? d : "tests/fixtures") / "bpe" / name;
}

std::string read(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

json tokenizer_json(const std::string& name = "tokenizer.json") {
  return json::parse(read(fixture(name)));
}

// Every fixture case under `name`: our ids equal theirs and decode as theirs do,
// to the text itself where no prefix space was added.
void check_cases(const BpeTokenizer& tok, const std::string& name, bool prefix_space = false) {
  json fx = json::parse(read(fixture("encodings.json")));
  REQUIRE(fx["cases"].size() > 20);
  for (const json& c : fx["cases"]) {
    std::string text = c["text"].get<std::string>();
    INFO(name << " on \"" << text.substr(0, 80) << "\"");
    std::vector<int64_t> want = c[name]["ids"].get<std::vector<int64_t>>();
    std::vector<int64_t> got = tok.encode(text);
    CHECK(got == want);
    CHECK(tok.decode(got) == c[name]["decoded"].get<std::string>());
    if (!prefix_space) CHECK(tok.decode(got) == text);
  }
}

std::string error_of(const json& j) {
  try {
    BpeTokenizer::from_json(j.dump(), "t.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST_CASE("bpe matches tokenizers", "[bpe]") {
  BpeTokenizer tok = BpeTokenizer::load(fixture("tokenizer.json").string());
  CHECK(tok.vocab_size() == 1024);
  CHECK(tok.added_token("<|endoftext|>") == 0);
  CHECK_FALSE(tok.added_token("<|end|>").has_value());
  check_cases(tok, "tokenizer");
  // What tessera-train's samples and tessera-generate print, with and without a tokenizer.
  CHECK(io::prompt_tokens(&tok, "Hello world") == tok.encode("Hello world"));
  CHECK(io::prompt_tokens(nullptr, "ab\xff") == std::vector<int64_t>{97, 98, 255});
  CHECK(io::token_text(&tok, 0) == "<|endoftext|>");
  CHECK(io::token_text(&tok, 1100) == "[1100]");  // a padded model vocabulary's id
  CHECK(io::token_text(nullptr, 65) == "A");
  CHECK(io::token_text(nullptr, 300) == "[300]");
}

TEST_CASE("bpe add_prefix_space", "[bpe]") {
  BpeTokenizer tok = BpeTokenizer::load(fixture("prefix_tokenizer.json").string());
  CHECK(tok.vocab_size() == 320);
  check_cases(tok, "prefix_tokenizer", /*prefix_space=*/true);
}

TEST_CASE("bpe merges as strings", "[bpe]") {
  // GPT-2's own file (and older tokenizers) write each merge as "a b".
  json j = tokenizer_json();
  for (json& m : j["model"]["merges"]) m = m[0].get<std::string>() + " " + m[1].get<std::string>();
  check_cases(BpeTokenizer::from_json(j.dump(), "strings.json"), "tokenizer");
}

TEST_CASE("bpe round trips any bytes", "[bpe]") {
  // Invalid UTF-8, lone surrogates, overlong forms, truncated sequences, NULs:
  // every byte string decodes back to itself, tokens never straddle a split.
  BpeTokenizer tok = BpeTokenizer::load(fixture("tokenizer.json").string());
  std::mt19937 rng(7);
  std::vector<std::string> texts = {"\xff\xfe", "\xc0\xaf", "\xed\xa0\x80x", "ab\xe2\x82", "\xf4\x90\x80\x80",
                                    std::string("a\0b", 3), "<|endoftext|><|endoftext|"};
  for (int n : {1, 2, 3, 17, 64, 255, 1000}) {
    std::string s;
    for (int i = 0; i < n; ++i) s.push_back(static_cast<char>(rng() % 256));
    texts.push_back(s);
    std::string ascii;  // mostly words and spaces
    for (int i = 0; i < n; ++i) ascii.push_back(" \n'etaoinshrdlu0123.,"[rng() % 21]);
    texts.push_back(ascii);
  }
  for (const std::string& s : texts) {
    INFO("bytes " << s.size());
    std::vector<int64_t> ids = tok.encode(s);
    CHECK(tok.decode(ids) == s);
    for (int64_t id : ids) CHECK((id >= 0 && id < tok.vocab_size()));
  }
  // Words split where GPT-2's pattern splits them.
  std::string s = "I'll  see\t\tyou's 42x";
  std::vector<std::string> words;
  for (size_t i = 0; i < s.size();) {
    size_t e = io::gpt2_word_end(s, i);
    REQUIRE(e > i);
    words.push_back(s.substr(i, e - i));
    i = e;
  }
  CHECK(words == std::vector<std::string>{"I", "'ll", " ", " see", "\t", "\t", "you", "'s", " 42", "x"});
}

TEST_CASE("bpe refuses what it cannot reproduce", "[bpe]") {
  json base = tokenizer_json();
  auto with = [&](auto change) {
    json j = base;
    change(j);
    return error_of(j);
  };
  CHECK(error_of(base) == "no error");
  CHECK(with([](json& j) { j["model"]["type"] = "WordPiece"; }).find("model.type is 'WordPiece'") !=
        std::string::npos);
  CHECK(with([](json& j) { j["normalizer"] = {{"type", "NFC"}}; }).find("normalizer NFC") !=
        std::string::npos);
  CHECK(with([](json& j) { j["pre_tokenizer"] = {{"type", "Metaspace"}}; })
            .find("pre_tokenizer is 'Metaspace'") != std::string::npos);
  CHECK(with([](json& j) { j["post_processor"] = {{"type", "TemplateProcessing"}}; })
            .find("BOS/EOS") != std::string::npos);
  CHECK(with([](json& j) { j["model"]["dropout"] = 0.1; }).find("model.dropout") != std::string::npos);
  CHECK(with([](json& j) { j["model"]["byte_fallback"] = true; }).find("byte_fallback") !=
        std::string::npos);
  CHECK(with([](json& j) { j["model"]["vocab"].erase("!"); }).find("no token for byte 0x21") !=
        std::string::npos);
  CHECK(with([](json& j) { j["model"]["vocab"]["\n"] = 5000; }).find("GPT-2's byte characters") !=
        std::string::npos);
  CHECK(with([](json& j) { j["model"]["vocab"]["!"] = "x"; }).find("expected an integer id") !=
        std::string::npos);
  CHECK(with([](json& j) { j["model"]["merges"][3] = json::array({"Ġt", "zzz"}); })
            .find("merge 3") != std::string::npos);
  CHECK(with([](json& j) { j["model"]["merges"][0] = "Ġt"; }).find("one space") != std::string::npos);
  CHECK(with([](json& j) { j["added_tokens"][0]["lstrip"] = true; }).find("lstrip") !=
        std::string::npos);
  CHECK(error_of(json::array()).find("expected a Hugging Face tokenizer.json") != std::string::npos);
  try {
    BpeTokenizer::from_json("{\"model\": ", "broken.json");
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("broken.json: not valid JSON") != std::string::npos);
  }
  CHECK_THROWS_AS(BpeTokenizer::load("/nonexistent/tokenizer.json"), Error);
  BpeTokenizer tok = BpeTokenizer::from_json(base.dump(), "t.json");
  std::vector<int64_t> bad = {5, 1024};
  CHECK_THROWS_AS(tok.decode(bad), Error);
  bad = {-1};
  CHECK_THROWS_AS(tok.decode(bad), Error);
}
