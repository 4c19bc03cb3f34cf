// The readers of files a user may be handed (tokenizer.json, a Hugging Face
// folder's config.json and index, llm.c model files, checkpoint metadata,
// safetensors headers, a checkpoint's stored model, hardware descriptions)
// against hostile inputs, class by class (docs/hardening.md): each is refused
// with an error naming the file and what it claims, never a crash, a hang or
// an allocation sized by the claim. Every case runs under a counting global
// allocator: the heap it takes before refusing (and the tensors, counted by
// Tessera's allocator) must stay within 64 MiB, whatever the file claims.
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <malloc.h>
#include <new>
#include <string>

#include "fsdp/checkpoint.h"
#include "io/hf.h"
#include "io/llmc.h"
#include "io/tokenizer.h"
#include "nn/safetensors.h"
#include "runtime/allocator.h"
#include "runtime/json_scan.h"
#include "runtime/random.h"
#include "tests/helpers.h"
#include "tools/config.h"
#include "tools/hardware.h"

// ---- the counting allocator: every operator new of this process -------------------

namespace {
std::atomic<int64_t> g_heap{0}, g_heap_peak{0};
void* counted(size_t n) {
  void* p = std::malloc(n == 0 ? 1 : n);
  if (p == nullptr) throw std::bad_alloc();
  const int64_t now = g_heap.fetch_add(static_cast<int64_t>(malloc_usable_size(p))) +
                      static_cast<int64_t>(malloc_usable_size(p));
  int64_t peak = g_heap_peak.load();
  while (now > peak && !g_heap_peak.compare_exchange_weak(peak, now)) {
  }
  return p;
}
void uncounted(void* p) {
  if (p == nullptr) return;
  g_heap.fetch_sub(static_cast<int64_t>(malloc_usable_size(p)));
  std::free(p);
}
}  // namespace

void* operator new(size_t n) { return counted(n); }
void* operator new[](size_t n) { return counted(n); }
void* operator new(size_t n, const std::nothrow_t&) noexcept {
  try {
    return counted(n);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](size_t n, const std::nothrow_t& t) noexcept { return operator new(n, t); }
void operator delete(void* p) noexcept { uncounted(p); }
void operator delete[](void* p) noexcept { uncounted(p); }
void operator delete(void* p, size_t) noexcept { uncounted(p); }
void operator delete[](void* p, size_t) noexcept { uncounted(p); }

using namespace tessera;
namespace fs = std::filesystem;

namespace {

constexpr int64_t kLimit = int64_t{64} << 20;

// Runs fn, which must throw a tessera::Error whose message contains every one
// of `wants`; the heap and tensor memory it took above what was held before
// stays under kLimit (and, for a file of its size, under `file_multiple` x
// `file_bytes` where that is larger).
template <class Fn>
void refused(Fn&& fn, std::initializer_list<std::string> wants, int64_t file_bytes = 0) {
  const int64_t heap0 = g_heap.load();
  g_heap_peak.store(heap0);
  const int64_t tensors0 = memory_stats().allocated_bytes;
  reset_peak_memory_stats();
  std::string message = "no error";
  try {
    fn();
  } catch (const Error& e) {
    message = e.what();
  }
  INFO(message.substr(0, 600));
  for (const auto& w : wants) CHECK(message.find(w) != std::string::npos);
  const int64_t heap = g_heap_peak.load() - heap0, tensors = memory_stats().peak_allocated_bytes - tensors0;
  const int64_t bound = std::max(kLimit, 4 * file_bytes);
  CHECK(heap <= bound);
  CHECK(tensors <= bound);
}

struct TempDir {
  fs::path path = fs::temp_directory_path() / ("tessera-hostile-" + std::to_string(::getpid()));
  TempDir() { fs::create_directories(path); }
  ~TempDir() { fs::remove_all(path); }
  std::string write(const std::string& name, const std::string& text) const {
    fs::create_directories((path / name).parent_path());
    std::ofstream(path / name, std::ios::binary) << text;
    return (path / name).string();
  }
};

std::string nested(int depth, const std::string& open = "[", const std::string& close = "]",
                   const std::string& inner = "1") {
  std::string s;
  for (int i = 0; i < depth; ++i) s += open;
  s += inner;
  for (int i = 0; i < depth; ++i) s += close;
  return s;
}

// A valid byte-level BPE tokenizer.json: the 256 byte tokens, `extra` vocab
// entries after them, `merges` and `added` tokens, as text.
std::string tokenizer_json(const std::string& extra_vocab = "", const std::string& merges = "",
                           const std::string& added = "") {
  std::string vocab;
  // GPT-2's byte characters: printable bytes stand for themselves, the rest from U+0100.
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    const uint32_t cp = printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(next++);
    std::string entry;
    if (cp < 0x80) entry = std::string(1, static_cast<char>(cp));
    else {
      entry.push_back(static_cast<char>(0xC0 | cp >> 6));
      entry.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
    if (entry == "\"" || entry == "\\") entry = "\\" + entry;
    vocab += fmt::format("{}\"{}\": {}", b ? ", " : "", entry, b);
  }
  if (!extra_vocab.empty()) vocab += ", " + extra_vocab;
  return fmt::format(R"({{"model": {{"type": "BPE", "vocab": {{{}}}, "merges": [{}]}},
    "pre_tokenizer": {{"type": "ByteLevel", "add_prefix_space": false}}, "added_tokens": [{}]}})",
                     vocab, merges, added);
}

}  // namespace

TEST_CASE("the nesting of a JSON text, found without recursion", "[hostile][json]") {
  CHECK(json_nesting("1").depth == 0);
  CHECK(json_nesting(R"({"a": [1, {"b": 2}]})").depth == 3);
  CHECK(json_nesting(R"({"a": "[[[[{{{{"})").depth == 1);  // brackets in strings do not count
  CHECK(json_nesting(R"({"a": "\"[[["})").depth == 1);     // nor after an escaped quote
  const JsonNesting n = json_nesting(R"({"model": {"vocab": [0, 1, [[[[1]]]]]}})");
  CHECK(n.depth == 7);
  CHECK(n.path.find("model.vocab[2]") == 0);
  // A million levels: one pass, no recursion.
  CHECK(json_nesting(nested(1'000'000)).depth == 1'000'000);
  CHECK_THROWS_WITH(check_json_nesting(nested(100), "f.json"),
                    Catch::Contains("f.json: JSON nested 100 levels deep") && Catch::Contains("at most 64"));
  CHECK_NOTHROW(check_json_nesting(nested(64), "f.json"));
}

TEST_CASE("class 1: deep nesting in every JSON reader is refused before anything recurses", "[hostile][json]") {
  TempDir dir;
  for (int depth : {65, 1000, 100'000}) {
    INFO("depth " << depth);
    // tokenizer.json: a merge, a vocab id, the pre-tokenizer, the decoder, an added token.
    for (auto [text, key] : std::vector<std::pair<std::string, std::string>>{
             {tokenizer_json("", nested(depth)), "at model.merges[0][0]"},
             {tokenizer_json("\"zz\": " + nested(depth)), "at model.vocab.zz[0]"},
             {R"({"model": {"type": "BPE"}, "pre_tokenizer": )" + nested(depth, "{\"a\": ", "}") + "}",
              "at pre_tokenizer.a.a"},
             {R"({"decoder": )" + nested(depth) + "}", "at decoder[0]"},
             {tokenizer_json("", "", R"({"id": )" + nested(depth) + "}"), "at added_tokens[0].id[0]"}}) {
      const std::string path = dir.write("tokenizer.json", text);
      refused([&] { io::BpeTokenizer::load(path); }, {path, "JSON nested", "levels deep", key, "at most 64 levels"},
              static_cast<int64_t>(text.size()));
    }
    // A Hugging Face folder: a config.json field, the index's weight_map.
    dir.write("hf/config.json", R"({"model_type": "gpt2", "n_layer": )" + nested(depth) + "}");
    refused([&] { io::read_hf_config((dir.path / "hf").string()); }, {"config.json", "JSON nested", "n_layer"});
    dir.write("hf/config.json",
              R"({"model_type": "gpt2", "n_layer": 1, "n_head": 1, "n_embd": 4, "vocab_size": 4, "n_positions": 4})");
    dir.write("hf/model.safetensors.index.json", R"({"weight_map": )" + nested(depth, "{\"w\": ", "}") + "}");
    refused([&] { io::read_hf_weights((dir.path / "hf").string(), io::read_hf_config((dir.path / "hf").string())); },
            {"model.safetensors.index.json", "JSON nested", "weight_map"});
    // A checkpoint's metadata.json, deep in its "extra" (what tessera-ckpt list, read-plan and resume read).
    const std::string md = R"({"magic": "tessera-checkpoint", "version": 1, "extra": )" +
                           nested(depth, "{\"x\": ", "}") + R"(, "tensors": []})";
    refused([&] { fsdp::parse_metadata(md, "ckpt/metadata.json"); },
            {"ckpt/metadata.json", "JSON nested", "extra.x"});
    // A safetensors header.
    const std::string header = R"({"__metadata__": )" + nested(depth, "{\"m\": ", "}") + "}";
    std::string file(8, '\0');
    const uint64_t n = header.size();
    std::memcpy(file.data(), &n, 8);
    const std::string st = dir.write("deep.safetensors", file + header);
    refused([&] { nn::SafetensorsFile f(st); }, {st, "JSON nested"});
    // A checkpoint's stored model (tessera-train's extra["model"]).
    tools::TrainConfig cfg;
    refused([&] { tools::model_from_json(cfg, R"({"model.n_layer": )" + nested(depth) + "}", "ckpt"); },
            {"ckpt: the stored model configuration", "JSON nested"});
  }
}

TEST_CASE("class 2: sizes a file claims are checked before they size anything", "[hostile][sizes]") {
  TempDir dir;
  // An id of 10^8 or 2^31 - 1 in a file of a few KiB: refused against the file's own entry count.
  for (int64_t id : {int64_t{256}, int64_t{100'000'000}, int64_t{2147483647}, int64_t{-1}, int64_t{1} << 40}) {
    INFO("id " << id);
    const std::string text = tokenizer_json(fmt::format("\"zz\": {}", id));
    const std::string path = dir.write("tokenizer.json", text);
    if (id == 256) {
      CHECK(io::BpeTokenizer::load(path).vocab_size() == 257);
      continue;
    }
    refused([&] { io::BpeTokenizer::load(path); },
            {path, fmt::format("model.vocab entry \"zz\" has id {}", id), "take ids 0..256"},
            static_cast<int64_t>(text.size()));
    const std::string added = tokenizer_json("", "", fmt::format(R"({{"id": {}, "content": "<x>"}})", id));
    refused([&] { io::BpeTokenizer::from_json(added, "t.json"); }, {"added token \"<x>\" has id", "take ids 0..256"});
  }
  // Not a regular file, or far larger than a tokenizer: refused before reading.
  refused([] { io::BpeTokenizer::load("/dev/zero"); }, {"'/dev/zero' is not a regular file"});
  refused([&] { io::BpeTokenizer::load(dir.path.string()); }, {"is not a regular file"});
  const fs::path big = dir.path / "big.json";
  { std::ofstream(big) << "{"; }
  fs::resize_file(big, (size_t{300} << 20));  // sparse: 300 MB claimed, nothing written
  refused([&] { io::BpeTokenizer::load(big.string()); }, {"is 314572800 bytes", "read up to 256 MiB"});
  dir.write("hf/config.json", "{}");
  fs::resize_file(dir.path / "hf" / "config.json", size_t{100} << 20);
  refused([&] { io::read_hf_config((dir.path / "hf").string()); }, {"config.json is 104857600 bytes", "64 MiB"});
  refused([&] { tools::load_hardware("/dev/zero"); }, {"'/dev/zero' is not a regular file"});
}

TEST_CASE("class 3: a tokenizer whose ids name two tokens is refused; duplicate merges take the later rank",
          "[hostile][tokenizer]") {
  // Two vocabulary entries, a vocabulary entry and an added token of other bytes, two added tokens.
  CHECK_THROWS_WITH(io::BpeTokenizer::from_json(tokenizer_json("\"zz\": 10"), "t.json"),
                    Catch::Contains("t.json: model.vocab entry") && Catch::Contains("model.vocab entry \"zz\"") &&
                        Catch::Contains("both have id 10"));
  CHECK_THROWS_WITH(io::BpeTokenizer::from_json(tokenizer_json("", "", R"({"id": 65, "content": "<x>"})"), "t.json"),
                    Catch::Contains("and added token \"<x>\" both have id 65"));
  CHECK_THROWS_WITH(io::BpeTokenizer::from_json(
                        tokenizer_json("", "", R"({"id": 256, "content": "<x>"}, {"id": 256, "content": "<y>"})"),
                        "t.json"),
                    Catch::Contains("added token \"<x>\" and added token \"<y>\" both have id 256"));
  // GPT-2's <|endoftext|>: a vocabulary entry and an added token with the same bytes is one token.
  auto t = io::BpeTokenizer::from_json(
      tokenizer_json("\"<|e|>\": 256", "", R"({"id": 256, "content": "<|e|>"})"), "t.json");
  CHECK(t.encode("a<|e|>b") == std::vector<int64_t>{97, 256, 98});
  // "a b" at ranks 0 and 2, "b c" at 1: with the later rank, "abc" merges b c first (the tokenizers
  // library and GPT-2's encoder.py keep the last entry of a pair listed twice).
  auto dup = io::BpeTokenizer::from_json(
      tokenizer_json(R"("ab": 256, "bc": 257)", R"("a b", "b c", "a b")"), "t.json");
  CHECK(dup.encode("abc") == std::vector<int64_t>{97, 257});
  CHECK(dup.encode("ab") == std::vector<int64_t>{256});
}

TEST_CASE("class 4: work that grew quadratically is near-linear, and what a file may claim is bounded",
          "[hostile][linear]") {
  // A megabyte-long word with merges that apply all the way up: the heap-ordered merge
  // loop is O(n log n) (rescanning after each merge took minutes).
  auto t = io::BpeTokenizer::from_json(
      tokenizer_json(R"("aa": 256, "aaaa": 257, "aaaaaaaa": 258)", R"("a a", "aa aa", "aaaa aaaa")"), "t.json");
  const std::string word(1 << 20, 'a');
  auto t0 = std::chrono::steady_clock::now();
  std::vector<int64_t> ids = t.encode(word);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(ids.size() == (1 << 17));  // 8 a's per token
  CHECK(s < 20.0);                  // about a second here; minutes before
  // An added token longer than 256 bytes is refused by name (each position of a
  // text is matched against the added tokens: the work per byte is bounded by them).
  const std::string long_token(4096, 'x');
  refused([&] {
    io::BpeTokenizer::from_json(tokenizer_json("", "", fmt::format(R"({{"id": 256, "content": "{}"}})", long_token)),
                                "t.json");
  }, {"t.json: added token 256 is 4096 bytes", "read up to 256"});
  // A config claiming 10^5 layers is refused before any model is built.
  TempDir dir;
  dir.write("hf/config.json",
            R"({"model_type": "gpt2", "n_layer": 100000, "n_head": 1, "n_embd": 8, "vocab_size": 4, "n_positions": 4})");
  t0 = std::chrono::steady_clock::now();
  refused([&] { io::read_hf_config((dir.path / "hf").string()); },
          {"\"n_layer\" is 100000", "at most 10000 layers"});
  CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < 5.0);
  // Building the deepest model a file may describe is bounded work (linear in the layers).
  nn::TransformerConfig deep{.n_layer = nn::TransformerConfig::kMaxLayers, .n_head = 1, .n_embd = 8};
  deep.vocab_size = 4;
  deep.block_size = 4;
  t0 = std::chrono::steady_clock::now();
  auto model = nn::make_model(deep, Device::meta());
  model->to_empty(Device::meta());
  model->load_state_dict(model->state_dict());
  CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < 60.0);
}

TEST_CASE("class 5: an imported model is checked as any model, before anything is written", "[hostile][hf]") {
  TempDir dir;
  const std::string llama = R"({"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 2,
    "hidden_size": 8, "intermediate_size": 16, "vocab_size": 5, "max_position_embeddings": 8)";
  auto config = [&](const std::string& more) { dir.write("hf/config.json", llama + more + "}"); };
  const std::string hf = (dir.path / "hf").string();
  config(R"(, "rms_norm_eps": 0)");
  refused([&] { io::read_hf_config(hf); }, {"\"rms_norm_eps\" must be in (0, 1), got 0"});
  config(R"(, "rms_norm_eps": -1e-6)");
  refused([&] { io::read_hf_config(hf); }, {"\"rms_norm_eps\" must be in (0, 1)"});
  config(R"(, "rope_theta": 0)");
  refused([&] { io::read_hf_config(hf); }, {"\"rope_theta\" must be > 0, got 0"});
  config(R"(, "rope_theta": -5)");
  refused([&] { io::read_hf_config(hf); }, {"\"rope_theta\" must be > 0"});
  config(R"(, "head_dim": 2.5)");
  refused([&] { io::read_hf_config(hf); }, {"\"head_dim\" must be an integer, got 2.5"});
  config(R"(, "head_dim": 3)");
  refused([&] { io::read_hf_config(hf); }, {"head_dim 3 but hidden_size / num_attention_heads = 8 / 2"});
  config(R"(, "num_key_value_heads": 3)");
  refused([&] { io::read_hf_config(hf); }, {"\"num_key_value_heads\" (3) must divide"});
}

TEST_CASE("class 6: products of sizes from a file or a flag are checked", "[hostile][sizes]") {
  // Parallel degrees whose product wraps to 0 (it crashed mesh_shape with SIGFPE).
  tools::TrainConfig cfg;
  cfg.parallelism.data_parallel_replicate_degree = int64_t{1} << 32;
  cfg.parallelism.tensor_parallel_degree = int64_t{1} << 32;
  refused([&] { tools::mesh_dims(cfg, 4); }, {"parallelism.data_parallel_replicate_degree x ",
                                               "x parallelism.tensor_parallel_degree", "overflows"});
  // An llm.c header whose sizes overflow int64: refused before any read, not 9.2e18 bytes asked.
  TempDir dir;
  for (auto [layers, channels] : {std::pair{2147483647, 2147483640}, {1, 2147483640}, {2147483647, 64}}) {
    INFO(layers << " layers of " << channels);
    std::vector<int32_t> h(256, 0);
    h[0] = 20240326;
    h[1] = 3;
    h[2] = 1024, h[3] = 50257, h[4] = layers, h[5] = 8, h[6] = channels, h[7] = 50304;
    std::string bytes(reinterpret_cast<const char*>(h.data()), 1024);
    const std::string path = dir.write("model.bin", bytes + std::string(64, '\0'));
    nn::TransformerConfig m;
    refused([&] { io::read_llmc_model(m, path); }, {"llm.c model '" + path + "'"});
  }
}

TEST_CASE("class 7: a value of the wrong JSON type is refused naming the key and the file", "[hostile][hf]") {
  TempDir dir;
  const std::string gpt2 = R"({"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 8, "vocab_size": 5,
    "n_positions": 4)";
  const std::string hf = (dir.path / "hf").string();
  const std::string file = (dir.path / "hf" / "config.json").string();
  for (auto [more, want] : std::vector<std::pair<std::string, std::string>>{
           {R"(, "tie_word_embeddings": "yes")", "\"tie_word_embeddings\" must be true or false, got \"yes\""},
           {R"(, "activation_function": 7)", "\"activation_function\" must be a string, got 7"},
           {R"(, "layer_norm_epsilon": "1e-5")", "\"layer_norm_epsilon\" must be a number, got \"1e-5\""},
           {R"(, "n_inner": "32")", "\"n_inner\" must be an integer, got \"32\""},
           {R"(, "scale_attn_weights": 1)", "\"scale_attn_weights\" must be true or false, got 1"},
           {R"(, "n_head": [2])", "\"n_head\" must be an integer, got [2]"}}) {
    dir.write("hf/config.json", gpt2 + more + "}");
    refused([&] { io::read_hf_config(hf); }, {file, want});
  }
  dir.write("hf/config.json", R"({"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 2,
    "hidden_size": 8, "intermediate_size": 16, "vocab_size": 5, "max_position_embeddings": 8, "rope_theta": "1e4"})");
  refused([&] { io::read_hf_config(hf); }, {file, "\"rope_theta\" must be a number, got \"1e4\""});
  dir.write("hf/config.json", R"({"model_type": null})");
  refused([&] { io::read_hf_config(hf); }, {"has model_type ''"});
  dir.write("hf/config.json", R"({"model_type": 5})");
  refused([&] { io::read_hf_config(hf); }, {"\"model_type\" must be a string, got 5"});
}

TEST_CASE("class 8: hardware descriptions are checked field by field", "[hostile][hardware]") {
  const std::string good = R"(name = "n"
[node]
devices = 8
[device]
memory_gib = 80
memory_bandwidth_gbs = 3350
peak_tflops_bf16 = 989
peak_tflops_f32 = 67
[intra_node]
bandwidth_gbs = 450
latency_us = 3
[inter_node]
bandwidth_gbs = 50
latency_us = 5
)";
  CHECK(tools::parse_hardware(good, "h.toml").devices_per_node == 8);
  auto with = [&](const std::string& from, const std::string& to) {
    std::string t = good;
    t.replace(t.find(from), from.size(), to);
    return t;
  };
  for (auto [text, want] : std::vector<std::pair<std::string, std::string>>{
           {with("peak_tflops_f32 = 67", "peak_tflops_f32 = 0"), "[device] peak_tflops_f32 must be > 0, got 0"},
           {with("devices = 8", "devices = 1.5"), "[node] devices must be a whole number, got 1.5"},
           {with("devices = 8", "devices = 1e300"), "[node] devices = 1e+300 must be at most 65536"},
           {with("devices = 8", "devices = -3"), "[node] devices = -3 must be a finite number >= 1"},
           {with("devices = 8", "devices = nan"), "[node] devices = nan must be a finite number"},
           {with("devices = 8", "devices = \"8\""), "[node] devices must be a number, got a string"},
           {with("latency_us = 3", "latency_us = inf"), "[intra_node] latency_us = inf must be a finite number"},
           {with("memory_gib = 80", "memory_gib = -1"), "[device] memory_gib = -1 must be a finite number >= 0"},
           {with("[node]", "[nodes]"), "unknown section [nodes]"},
           {with("devices = 8", "devices = 8\ngpus = 8"), "unknown key [node] gpus"},
           {with("name = \"n\"", "name = 3"), "name must be a string"}}) {
    INFO(want);
    refused([&] { tools::parse_hardware(text, "h.toml"); }, {"hardware file 'h.toml'", want});
  }
}

TEST_CASE("class 9: a key or a tensor named twice is refused, naming it and where", "[hostile][json]") {
  // json_duplicate_key decodes the keys (an escape spells the same key) and
  // compares them object by object, at any depth.
  CHECK(json_duplicate_key(R"({"a": 1, "b": {"a": 2}, "c": [{"a": 3}, {"a": 4}]})").empty());
  CHECK(json_duplicate_key(R"({"a": 1, "b": 2, "a": 3})") == "'a' at the top level");
  CHECK(json_duplicate_key(R"({"a": 1, "\u0061": 3})") == "'a' at the top level");
  CHECK(json_duplicate_key(R"({"m": {"x": {"k": 1, "k": 2}}})") == "'k' in m.x");
  CHECK(json_duplicate_key(R"({"t": [{"n": 1}, [0, {"n": 1, "n": 2}]]})") == "'n' in t[1][1]");
  CHECK(json_duplicate_key(R"([1, 2, {"x": [], "x": {}}])") == "'x' in [2]");
  CHECK(json_duplicate_key("not json").empty());  // the parser refuses it next

  // A safetensors header naming a tensor twice: two spans for one name.
  const std::string header = R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
    "w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})";
  refused([&] { nn::SafetensorsFile::parse_header(header, 8, "x.safetensors", nullptr); },
          {"x.safetensors: the safetensors header: the key 'w' at the top level appears twice"});

  // Checkpoint metadata: a key twice, or one tensor described twice.
  const auto tensor = [](const std::string& name, const std::string& placements = "\"plain\"") {
    return fmt::format(R"({{"name": "{}", "dtype": "f32", "shape": [2, 3], "placements": {},
      "chunks": [{{"file": "rank-00000.bin", "offset": 16, "bytes": 24, "crc32c": 0, "offsets": [0, 0],
                   "shape": [2, 3]}}]}})",
                       name, placements);
  };
  const auto metadata = [](const std::string& tensors, const std::string& more = "") {
    return fmt::format(R"({{"magic": "tessera-checkpoint", "version": 1, "step": 3, "world_size": 2,
      "tensors": [{}]{}}})",
                       tensors, more);
  };
  CHECK(fsdp::parse_metadata(metadata(tensor("w")), "m.json").tensors.size() == 1);
  refused([&] { fsdp::parse_metadata(metadata(tensor("w"), R"(, "step": 9)"), "m.json"); },
          {"m.json: the key 'step' at the top level appears twice"});
  refused([&] { fsdp::parse_metadata(metadata(tensor("w") + ", " + tensor("v") + ", " + tensor("w")), "m.json"); },
          {"m.json: tensor 'w' is described twice (entries 0 and 2 of tensors)"});

  // rank_state holds one random stream per rank that saved.
  const std::string stream = R"({"seed": 1, "offset": 0})";
  CHECK(fsdp::parse_metadata(metadata(tensor("w"), fmt::format(R"(, "rank_state": [{0}, {0}])", stream)), "m.json")
            .rank_state.size() == 2);
  for (const std::string& streams : {fmt::format("[{}]", stream), fmt::format("[{0}, {0}, {0}]", stream)})
    refused([&] { fsdp::parse_metadata(metadata(tensor("w"), R"(, "rank_state": )" + streams), "m.json"); },
            {"m.json: rank_state holds", "ranks' random streams but the checkpoint was saved by world_size 2"});
}

TEST_CASE("class 10: placements are ones save_checkpoint writes; a data file that is no file is refused",
          "[hostile][checkpoint]") {
  const auto with = [](const std::string& placements) {
    return fmt::format(R"({{"magic": "tessera-checkpoint", "version": 1, "step": 0, "world_size": 1,
      "tensors": [{{"name": "w", "dtype": "f32", "shape": [2, 3], "placements": {},
      "chunks": [{{"file": "rank-00000.bin", "offset": 16, "bytes": 24, "crc32c": 0, "offsets": [0, 0],
                   "shape": [2, 3]}}]}}]}})",
                       placements);
  };
  for (const char* good : {"plain", "(R)", "(S(0))", "(S(1))", "(R, S(0))", "(S(1), R, S(0)x4)", "(S(0)x1)"}) {
    INFO(good);
    CHECK(fsdp::parse_metadata(with(fmt::format("\"{}\"", good)), "m.json").tensors[0].placements == good);
  }
  for (auto [bad, why] : std::vector<std::pair<std::string, std::string>>{
           {"\"(S(2))\"", "dimension 2 of a tensor of rank 2"},
           {"\"(R, P(sum))\"", "a Partial tensor"},
           {"\"(Q)\"", "unknown placement at character 1"},
           {"\"S(0)\"", "not a parenthesised list"},
           {"\"()\"", "not a parenthesised list"},
           {"\"(R,S(0))\"", "expected ', ' at character 2"},
           {"\"(R, )\"", "an empty placement"},
           {"\"(S(0)\"", "the list is not closed"},
           {"\"(S(-1))\"", "not a small integer"},
           {"\"(S(12345678901))\"", "not a small integer"},
           {"\"(S(0)x0)\"", "a blocked shard of no blocks"},
           {"\"(S(0)x)\"", "not a small integer"},
           {"\"(S(0\"", "not a parenthesised list"},
           {"\"(S(0]\"", "not a parenthesised list"},
           {"\"(S(0x)\"", "a shard placement is not closed"},
           {"\"plain \"", "not a parenthesised list"},
           {"\"\"", "not a parenthesised list"},
           {"\"(R, R, R, R, R, R, R, R, R, R, R, R, R, R, R, R, R)\"", "more than 16 mesh dimensions"},
           {"[\"R\"]", "placements of JSON type array (expected a string)"},
           {"0", "placements of JSON type number"}}) {
    INFO(bad);
    refused([&] { fsdp::parse_metadata(with(bad), "m.json"); }, {"m.json: tensor 'w'", why});
  }

  // A pipe in place of a data file blocks whoever opens it to read: refused
  // before the open (this test would hang otherwise).
  TempDir dir;
  const std::string folder = (dir.path / "ck").string();
  Tensor w = randn({5, 3}, 7);
  const std::string saved = fsdp::save_checkpoint(folder, 4, nn::StateDict{{"w", w}}, "{}");
  const fsdp::CheckpointMetadata md = fsdp::read_metadata(saved);
  CHECK(testing::equal(fsdp::read_full_tensor(saved, md.tensors[0]), w));
  const fs::path data = fs::path(saved) / md.tensors[0].chunks[0].file;
  fs::remove(data);
  REQUIRE(::mkfifo(data.c_str(), 0644) == 0);
  refused([&] { fsdp::read_full_tensor(saved, md.tensors[0]); },
          {data.string(), "the data file of tensor 'w' is not a regular file"});
  refused([&] { fsdp::read_chunk(saved, md.tensors[0], md.tensors[0].chunks[0]); }, {"is not a regular file"});
  fs::remove(data);
  refused([&] { fsdp::read_full_tensor(saved, md.tensors[0]); }, {data.string(), "missing data file (tensor 'w')"});
}
