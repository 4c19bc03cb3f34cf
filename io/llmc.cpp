#include "io/llmc.h"

#include <fmt/format.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>

#include "runtime/check.h"
#include "runtime/checked.h"
#include "runtime/ops.h"

namespace tessera::io {

namespace {

constexpr int32_t kMagic = 20240326;
constexpr int32_t kVersionF32 = 3, kVersionBF16 = 5;

struct Sizes {
  int64_t maxT, V, L, NH, C, Vp;
};

// llm.c's 16 tensors in file order: a name and shape, and the Tessera tensor
// of layer l (-1: not per layer) it holds.
struct Block {
  const char* what;
  Shape shape;  // of the whole block (per-layer blocks lead with L)
  std::function<std::string(int64_t l)> name;
};

std::vector<Block> layout(const Sizes& s) {
  auto layer = [](const char* suffix) {
    return [suffix](int64_t l) { return fmt::format("transformer.h.{}.{}", l, suffix); };
  };
  auto whole = [](const char* n) { return [n](int64_t) { return std::string(n); }; };
  const int64_t L = s.L, C = s.C;
  return {{"wte", {s.Vp, C}, whole("transformer.wte.weight")},
          {"wpe", {s.maxT, C}, whole("transformer.wpe.weight")},
          {"ln1w", {L, C}, layer("ln_1.weight")},
          {"ln1b", {L, C}, layer("ln_1.bias")},
          {"qkvw", {L, 3 * C, C}, layer("attn.c_attn.weight")},
          {"qkvb", {L, 3 * C}, layer("attn.c_attn.bias")},
          {"attprojw", {L, C, C}, layer("attn.c_proj.weight")},
          {"attprojb", {L, C}, layer("attn.c_proj.bias")},
          {"ln2w", {L, C}, layer("ln_2.weight")},
          {"ln2b", {L, C}, layer("ln_2.bias")},
          {"fcw", {L, 4 * C, C}, layer("mlp.c_fc.weight")},
          {"fcb", {L, 4 * C}, layer("mlp.c_fc.bias")},
          {"fcprojw", {L, C, 4 * C}, layer("mlp.c_proj.weight")},
          {"fcprojb", {L, C}, layer("mlp.c_proj.bias")},
          {"lnfw", {C}, whole("transformer.ln_f.weight")},
          {"lnfb", {C}, whole("transformer.ln_f.bias")}};
}

bool per_layer(const Block& b) { return std::string(b.what) != "wte" && std::string(b.what) != "wpe" &&
                                        std::string(b.what) != "lnfw" && std::string(b.what) != "lnfb"; }

struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};
using File = std::unique_ptr<std::FILE, FileCloser>;

}  // namespace

nn::StateDict read_llmc_model(nn::TransformerConfig& cfg, const std::string& path) {
  std::error_code ec;
  TS_CHECK(std::filesystem::is_regular_file(path, ec), "llm.c model '{}' does not exist or is not a file", path);
  File f(std::fopen(path.c_str(), "rb"));
  TS_CHECK(f != nullptr, "llm.c model '{}': cannot open it", path);
  std::array<int32_t, 256> h{};
  TS_CHECK(std::fread(h.data(), sizeof(int32_t), h.size(), f.get()) == h.size(),
           "llm.c model '{}' is shorter than its 1024-byte header", path);
  TS_CHECK(h[0] == kMagic, "llm.c model '{}' has magic {}, expected {} (train_gpt2's model file; token shards "
           "are read with training.dataset shards)", path, h[0], kMagic);
  TS_CHECK(h[1] == kVersionF32 || h[1] == kVersionBF16,
           "llm.c model '{}' has version {}; Tessera reads 3 (float32) and 5 (bfloat16)", path, h[1]);
  Sizes s{h[2], h[3], h[4], h[5], h[6], h[7]};
  for (auto [name, v] : {std::pair{"max_seq_len", s.maxT}, {"vocab_size", s.V}, {"num_layers", s.L},
                         {"num_heads", s.NH}, {"channels", s.C}, {"padded_vocab_size", s.Vp}})
    TS_CHECK(v > 0, "llm.c model '{}': header {} is {}, expected a positive size", path, name, v);
  TS_CHECK(s.Vp >= s.V && s.C % s.NH == 0, "llm.c model '{}': padded_vocab_size {} < vocab_size {}, or channels {} "
           "not divisible by num_heads {}", path, s.Vp, s.V, s.C, s.NH);
  nn::TransformerConfig m;
  m.arch = "gpt2";
  m.n_layer = s.L;
  m.n_head = s.NH;
  m.n_kv_head = 0;
  m.n_embd = s.C;
  m.vocab_size = s.V;
  m.ffn_hidden = 0;  // 4C
  m.bias = true;
  m.tie_embeddings = true;
  m.rope = false;
  m.gelu_tanh = true;
  m.dropout = 0.0;
  m.norm_eps = 1e-5;
  m.block_size = s.maxT;
  const auto names = [&](const char* field) { return fmt::format("llm.c model '{}': {}", path, field); };
  m.check_file_claims(names);
  m.validate(names);
  // Every size the header claims checked (products included) before any is used.
  const DType stored = h[1] == kVersionBF16 ? DType::BF16 : DType::F32;
  const auto blocks = layout(s);
  CheckedInt numel{0, "0"};
  for (const auto& b : blocks) {
    CheckedInt n{1, b.what};
    for (int64_t d : b.shape) n = n * d;
    numel = numel + n;
  }
  const auto want = static_cast<uintmax_t>((numel * static_cast<int64_t>(dtype_size(stored)) + 1024).value);
  const auto size = std::filesystem::file_size(path, ec);
  TS_CHECK(!ec && size == want, "llm.c model '{}' is {} bytes, but its header ({} layers, {} channels, {} x {} "
           "tokens, version {}) needs exactly {}", path, size, s.L, s.C, s.Vp, s.maxT, h[1], want);
  cfg = m;
  nn::StateDict out;
  for (const auto& b : blocks) {
    Tensor block = empty(b.shape, stored);
    const size_t bytes = static_cast<size_t>(block.numel()) * dtype_size(stored);
    TS_CHECK(std::fread(block.host_data_ptr(), 1, bytes, f.get()) == bytes, "llm.c model '{}': short read in {}", path,
             b.what);
    block = ops::to(block, DType::F32);
    if (std::string(b.what) == "wte") block = ops::contiguous(ops::narrow(block, 0, 0, s.V));  // padding dropped
    if (!per_layer(b)) {
      out.emplace_back(b.name(-1), block);
      continue;
    }
    for (int64_t l = 0; l < s.L; ++l) out.emplace_back(b.name(l), ops::contiguous(ops::select(block, 0, l)));
  }
  return out;
}

void write_llmc_model(const std::string& path, const nn::TransformerConfig& m, const nn::StateDict& weights,
                      DType dtype) {
  TS_CHECK(dtype == DType::F32 || dtype == DType::BF16, "llm.c model: float32 or bfloat16, not {}",
           dtype_name(dtype));
  TS_CHECK(m.arch == "gpt2" && m.bias && m.tie_embeddings && !m.rope && (m.ffn_hidden == 0 || m.ffn_hidden == 4 * m.n_embd),
           "llm.c model: llm.c's GPT-2 has biases, a tied output layer, learned positions and a 4 x n_embd MLP "
           "(arch {}, bias {}, tie_embeddings {}, rope {}, ffn_hidden {})",
           m.arch, m.bias, m.tie_embeddings, m.rope, m.ffn_hidden);
  TS_CHECK(m.gelu_tanh, "llm.c model: llm.c computes GELU's tanh approximation, but this model uses the exact "
           "GELU (gelu_tanh false: tessera-train's model.gelu exact); it would compute another function there");
  std::map<std::string, Tensor> by_name(weights.begin(), weights.end());
  Sizes s{m.block_size, m.vocab_size, m.n_layer, m.n_head, m.n_embd, (m.vocab_size + 127) / 128 * 128};
  std::array<int32_t, 256> h{};
  h[0] = kMagic;
  h[1] = dtype == DType::BF16 ? kVersionBF16 : kVersionF32;
  for (auto [i, v] : {std::pair{2, s.maxT}, {3, s.V}, {4, s.L}, {5, s.NH}, {6, s.C}, {7, s.Vp}}) {
    TS_CHECK(v <= INT32_MAX, "llm.c model: a size of {} does not fit the header's int32", v);
    h[static_cast<size_t>(i)] = static_cast<int32_t>(v);
  }
  const std::string tmp = path + ".tmp";
  {
    File f(std::fopen(tmp.c_str(), "wb"));
    TS_CHECK(f != nullptr, "llm.c model: cannot write {}", tmp);
    bool ok = std::fwrite(h.data(), sizeof(int32_t), h.size(), f.get()) == h.size();
    auto get = [&](const std::string& name, const Shape& shape) {
      auto it = by_name.find(name);
      TS_CHECK(it != by_name.end(), "llm.c model: the model has no {}", name);
      TS_CHECK(it->second.shape() == shape, "llm.c model: {} is {}, llm.c's layout needs {}", name,
               shape_str(it->second.shape()), shape_str(shape));
      return it->second;
    };
    for (const auto& b : layout(s)) {
      Tensor block;
      const std::string what = b.what;
      if (what == "wte") {
        Tensor wte = get(b.name(-1), {s.V, s.C});
        block = s.Vp > s.V ? ops::cat({wte, zeros({s.Vp - s.V, s.C}, wte.dtype())}, 0) : wte;
      } else if (!per_layer(b)) {
        block = get(b.name(-1), b.shape);
      } else {
        Shape one(b.shape.begin() + 1, b.shape.end());
        TensorList layers;
        for (int64_t l = 0; l < s.L; ++l) layers.push_back(ops::unsqueeze(get(b.name(l), one), 0));
        block = ops::cat(layers, 0);
      }
      block = ops::contiguous(ops::to(block, dtype));
      const size_t bytes = static_cast<size_t>(block.numel()) * dtype_size(dtype);
      ok = ok && std::fwrite(block.host_data_ptr(), 1, bytes, f.get()) == bytes;
    }
    TS_CHECK(ok && std::fflush(f.get()) == 0, "llm.c model: writing {} failed (disk full?)", tmp);
  }
  std::filesystem::rename(tmp, path);
}

}  // namespace tessera::io
