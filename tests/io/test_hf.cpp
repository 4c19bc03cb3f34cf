// Hugging Face GPT-2 both ways (io/hf.h), against a fixture written by
// transformers (tests/fixtures/make_hf_gpt2.py): a small random GPT-2 with
// awkward sizes and the logits transformers computed for a batch of tokens.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>

#include <nlohmann/json.hpp>

#include "io/hf.h"
#include "nn/models.h"
#include "nn/moe.h"
#include "nn/safetensors.h"
#include "tests/helpers.h"

using namespace tessera;
using namespace tessera::testing;
namespace fs = std::filesystem;

namespace {

std::string fixture(const std::string& name = "hf-gpt2") {
  const char* d = std::getenv("TESSERA_FIXTURES");
  return (fs::path(d != nullptr ? d : "tests/fixtures") / name).string();
}

// The model of an HF folder's config.json, with its weights.
std::shared_ptr<nn::LanguageModel> load(const std::string& dir, nn::TransformerConfig& cfg) {
  cfg = io::read_hf_config(dir);
  auto model = io::load_hf_model(dir);
  CHECK(model->config.n_embd == cfg.n_embd);
  return model;
}

// Our file holds the tensors of theirs, bit for bit, and no others.
void check_same_tensors(const fs::path& ours_path, const fs::path& theirs_path) {
  nn::SafetensorsFile theirs(theirs_path.string()), ours(ours_path.string());
  CHECK(ours.entries().size() == theirs.entries().size());
  for (const auto& e : theirs.entries()) {
    INFO(e.name);
    REQUIRE(ours.find(e.name) != nullptr);
    CHECK(equal(ours.read(e.name), theirs.read(e.name)));
  }
}

// The fields an HF folder carries, equal.
bool same_config(const nn::TransformerConfig& a, const nn::TransformerConfig& b) {
  return a.arch == b.arch && a.vocab_size == b.vocab_size && a.block_size == b.block_size && a.n_layer == b.n_layer &&
         a.n_head == b.n_head && a.kv_heads() == b.kv_heads() && a.n_embd == b.n_embd &&
         a.mlp_hidden() == b.mlp_hidden() && a.bias == b.bias && a.tie_embeddings == b.tie_embeddings &&
         a.rope_theta == b.rope_theta && a.norm_eps == b.norm_eps && a.gelu_tanh == b.gelu_tanh;
}

// The logits of `model`'s weights in a model built from `cfg` (one setting
// changed) in `dtype`: a setting read from the file and used moves them.
Tensor logits_with(const nn::TransformerConfig& cfg, nn::Module& model, const Tensor& ids, DType dtype) {
  auto other = nn::make_model(cfg);
  other->load_state_dict(model.state_dict());
  other->to(dtype);
  other->eval();
  return (*other)(ids);
}

struct TempDir {
  fs::path path = fs::temp_directory_path() / ("tessera-hf-" + std::to_string(::getpid()));
  TempDir() { fs::create_directories(path); }
  ~TempDir() { fs::remove_all(path); }
};

}  // namespace

TEST_CASE("a Hugging Face GPT-2 loads and gives transformers' logits", "[hf]") {
  nn::TransformerConfig cfg;
  auto model = load(fixture(), cfg);
  CHECK(cfg.arch == "gpt2");
  CHECK(cfg.n_layer == 2);
  CHECK(cfg.n_head == 3);
  CHECK(cfg.n_embd == 24);
  CHECK(cfg.vocab_size == 67);
  CHECK(cfg.block_size == 13);
  CHECK(cfg.gelu_tanh);  // "gelu_new"
  nn::SafetensorsFile expected((fs::path(fixture()) / "expected.safetensors").string());
  Tensor ids = expected.read("input_ids"), want = expected.read("logits");
  model->eval();
  autograd::NoGradGuard no_grad;
  Tensor got = (*model)(ids);
  REQUIRE(got.shape() == want.shape());
  // f32 both sides, different kernels: within 1e-5 of logits of size ~10.
  CHECK_CLOSE(got, want, 1e-5, 1e-5);
  // In f64 the difference is transformers' own f32 rounding only.
  model->to(DType::F64);
  CHECK_CLOSE((*model)(ids), ops::to(want, DType::F64), 1e-5, 1e-5);
  // With the exact GELU instead (not what the file says), the logits move: the activation matters.
  nn::TransformerConfig exact = cfg;
  exact.gelu_tanh = false;
  CHECK_FALSE(allclose(logits_with(exact, *model, ids, DType::F32), want, 1e-5, 1e-5));
}

TEST_CASE("a GPT-2 written for Hugging Face reads back bit for bit, in transformers' layout", "[hf]") {
  nn::TransformerConfig cfg;
  auto model = load(fixture(), cfg);
  TempDir out;
  io::write_hf(out.path.string(), cfg, model->state_dict());
  // The same tensors as the file transformers wrote, under the same names and
  // layout (Conv1D [in, out]); the tied output layer not stored.
  check_same_tensors(out.path / "model.safetensors", fs::path(fixture()) / "model.safetensors");
  // config.json: the fields transformers builds the model from.
  auto read = [](const fs::path& p) { return nlohmann::json::parse(std::ifstream(p)); };
  auto a = read(out.path / "config.json"), b = read(fs::path(fixture()) / "config.json");
  for (const char* key : {"model_type", "n_layer", "n_head", "n_embd", "n_positions", "vocab_size",
                          "activation_function", "tie_word_embeddings", "layer_norm_epsilon"}) {
    INFO(key);
    CHECK(a[key] == b[key]);
  }
  // And it loads back as the same model.
  nn::TransformerConfig again;
  auto reloaded = load(out.path.string(), again);
  CHECK(same_config(again, cfg));
}

TEST_CASE("a tied output layer is the embedding table, and a file contradicting its config is refused", "[hf]") {
  const nn::TransformerConfig cfg = io::read_hf_config(fixture());
  REQUIRE(cfg.tie_embeddings);
  nn::StateDict w = io::read_hf_weights(fixture(), cfg);
  std::map<std::string, Tensor> by_name(w.begin(), w.end());
  REQUIRE(by_name.count("lm_head.weight") == 1);  // under the model's name too, as its state dict has it
  CHECK(equal(by_name["lm_head.weight"], by_name["transformer.wte.weight"]));
  // The same file with an lm_head.weight of its own: equal to wte is fine, another matrix is refused.
  TempDir dir;
  fs::copy_file(fs::path(fixture()) / "config.json", dir.path / "config.json");
  nn::SafetensorsFile f((fs::path(fixture()) / "model.safetensors").string());
  for (bool same : {true, false}) {
    nn::StateDict state;
    for (const auto& e : f.entries()) state.emplace_back(e.name, f.read(e.name));
    Tensor wte = f.read("transformer.wte.weight");
    state.emplace_back("lm_head.weight", same ? wte : ops::add(wte, 1e-3));
    nn::save_safetensors((dir.path / "model.safetensors").string(), state);
    if (same) {
      CHECK(io::read_hf_weights(dir.path.string(), cfg).size() == w.size());
    } else {
      CHECK_THROWS_WITH(io::read_hf_weights(dir.path.string(), cfg),
                        Catch::Contains("ties the output layer to the embedding") &&
                            Catch::Contains("lm_head.weight that differs from transformer.wte.weight"));
    }
  }
}

TEST_CASE("Hugging Face GPT-2 folders Tessera cannot take are refused, naming why", "[hf][errors]") {
  TempDir dir;
  auto write = [&](const std::string& text) { std::ofstream(dir.path / "config.json") << text; };
  CHECK_THROWS_WITH(io::read_hf_config((dir.path / "none").string()), Catch::Contains("cannot read"));
  write("{\"model_type\": \"bert\"}");
  CHECK_THROWS_WITH(io::read_hf_config(dir.path.string()),
                    Catch::Contains("has model_type 'bert'; Tessera reads gpt2 (GPT2LMHeadModel), llama"));
  write(R"({"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 8,
            "intermediate_size": 16, "vocab_size": 5, "max_position_embeddings": 8,
            "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0}})");
  CHECK_THROWS_WITH(io::read_hf_config(dir.path.string()), Catch::Contains("scales RoPE (rope_type 'llama3')"));
  write(R"({"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 8,
            "intermediate_size": 16, "vocab_size": 5, "max_position_embeddings": 8, "hidden_act": "gelu"})");
  CHECK_THROWS_WITH(io::read_hf_config(dir.path.string()), Catch::Contains("hidden_act 'gelu'"));
  write(R"({"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 8, "vocab_size": 5, "n_positions": 4,
            "activation_function": "relu"})");
  CHECK_THROWS_WITH(io::read_hf_config(dir.path.string()),
                    Catch::Contains("activation_function 'relu'"));
  write(R"({"model_type": "gpt2", "n_layer": 0})");
  CHECK_THROWS_WITH(io::read_hf_config(dir.path.string()),
                    Catch::Contains("needs \"n_layer\" as a positive integer, got 0"));
  write("{not json");
  CHECK_THROWS_WITH(io::read_hf_config(dir.path.string()), Catch::Contains("is not valid JSON"));
  nn::TransformerConfig cfg;
  CHECK_THROWS_WITH(io::read_hf_weights(dir.path.string(), cfg), Catch::Contains("has neither model.safetensors nor model.safetensors.index.json"));
  cfg.arch = "gpt2";
  cfg.rope = true;
  CHECK_THROWS_WITH(io::write_hf(dir.path.string(), cfg, {}), Catch::Contains("learned positions"));
  // What any model must satisfy is checked on import too, under the file's names.
  write(R"({"model_type": "gpt2", "n_layer": 2, "n_head": 3, "n_embd": 8, "vocab_size": 5, "n_positions": 4})");
  CHECK_THROWS_WITH(io::read_hf_config(dir.path.string()),
                    Catch::Contains("config.json's \"n_embd\" (8) must be divisible by") &&
                        Catch::Contains("config.json's \"n_head\" (3)"));
}

TEST_CASE("a Hugging Face Llama loads and gives transformers' logits, and writes back bit for bit", "[hf][llama]") {
  nn::TransformerConfig cfg;
  auto model = load(fixture("hf-llama"), cfg);
  CHECK(cfg.arch == "llama");
  CHECK(model->config.arch == "llama");
  CHECK(cfg.n_kv_head == 2);  // grouped-query attention
  CHECK(cfg.ffn_hidden == 40);
  CHECK(cfg.rope_theta == 500.0);
  CHECK(cfg.norm_eps == 1e-6);
  CHECK_FALSE(cfg.tie_embeddings);
  CHECK(cfg.block_size == 16);
  nn::SafetensorsFile expected((fs::path(fixture("hf-llama")) / "expected.safetensors").string());
  Tensor ids = expected.read("input_ids"), want = expected.read("logits");
  autograd::NoGradGuard no_grad;
  model->eval();
  CHECK_CLOSE((*model)(ids), want, 1e-5, 1e-5);
  model->to(DType::F64);
  CHECK_CLOSE((*model)(ids), ops::to(want, DType::F64), 1e-5, 1e-5);
  // RoPE's base and RMSNorm's epsilon are read, not defaulted: Tessera's defaults give other logits.
  for (auto change : {+[](nn::TransformerConfig& c) { c.rope_theta = 10000.0; },
                      +[](nn::TransformerConfig& c) { c.norm_eps = 1e-5; }}) {
    nn::TransformerConfig other_cfg = cfg;
    change(other_cfg);
    CHECK_FALSE(allclose(logits_with(other_cfg, *model, ids, DType::F64), ops::to(want, DType::F64), 1e-5, 1e-5));
  }
  TempDir out;
  io::write_hf(out.path.string(), cfg, model->state_dict());
  check_same_tensors(out.path / "model.safetensors", fs::path(fixture("hf-llama")) / "model.safetensors");
  nn::TransformerConfig again;
  load(out.path.string(), again);
  CHECK(same_config(again, cfg));
}

TEST_CASE("a sharded Hugging Face Llama reads as the one file", "[hf][llama]") {
  // save_pretrained's layout above max_shard_size: model-0000N-of-0000M.safetensors
  // and model.safetensors.index.json mapping each tensor to its file.
  const fs::path src = fixture("hf-llama");
  const nn::TransformerConfig cfg = io::read_hf_config(src.string());
  nn::StateDict whole = io::read_hf_weights(src.string(), cfg);
  nn::SafetensorsFile f((src / "model.safetensors").string());
  const auto& entries = f.entries();
  REQUIRE(entries.size() > 3);
  TempDir dir;
  fs::copy_file(src / "config.json", dir.path / "config.json");
  const std::string names[] = {"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                               "model-00003-of-00003.safetensors"};
  nlohmann::json map = nlohmann::json::object();
  for (size_t s = 0; s < 3; ++s) {  // every third tensor to shard s: not contiguous, uneven
    nn::StateDict part;
    for (size_t i = s; i < entries.size(); i += 3) {
      part.emplace_back(entries[i].name, f.read(entries[i].name));
      map[entries[i].name] = names[s];
    }
    nn::save_safetensors((dir.path / names[s]).string(), part);
  }
  auto write_index = [&](const nlohmann::json& m) {
    std::ofstream(dir.path / "model.safetensors.index.json") << nlohmann::json{{"metadata", {{"total_size", 0}}}, {"weight_map", m}}.dump();
  };
  write_index(map);
  nn::StateDict sharded = io::read_hf_weights(dir.path.string(), cfg);
  REQUIRE(sharded.size() == whole.size());
  std::map<std::string, Tensor> by_name(sharded.begin(), sharded.end());
  for (const auto& [name, t] : whole) {
    INFO(name);
    REQUIRE(by_name.count(name) == 1);
    CHECK(equal(by_name[name], t));
  }
  // An index and shards that disagree are refused, naming the tensor.
  auto error = [&] {
    try {
      io::read_hf_weights(dir.path.string(), cfg);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  nlohmann::json moved = map;
  moved[entries[0].name] = names[1];
  write_index(moved);
  CHECK(error().find("Hugging Face model: " + (dir.path / names[0]).string() + " holds " + entries[0].name) !=
        std::string::npos);
  nlohmann::json extra = map;
  extra["model.extra.weight"] = names[2];
  write_index(extra);
  CHECK(error().find("the index puts model.extra.weight in " + (dir.path / names[2]).string() + ", which lacks it") !=
        std::string::npos);
  nlohmann::json dropped = map;
  dropped.erase(entries[1].name);
  write_index(dropped);
  CHECK(error().find("holds " + entries[1].name + ", which the index puts elsewhere or not at all") != std::string::npos);
  nlohmann::json escape = map;
  escape[entries[0].name] = "../model.safetensors";
  write_index(escape);
  CHECK(error().find("expected a file in the same folder") != std::string::npos);
  nlohmann::json missing = map;
  missing[entries[0].name] = "model-00009-of-00009.safetensors";
  write_index(missing);
  CHECK(error().find("which does not exist") != std::string::npos);
  fs::remove(dir.path / "model.safetensors.index.json");
  CHECK(error().find("has neither model.safetensors nor model.safetensors.index.json") != std::string::npos);
}

TEST_CASE("a Hugging Face Mixtral loads, gives transformers' logits and loss, and writes back bit for bit",
          "[hf][mixtral]") {
  // tests/fixtures/make_hf_mixtral.py: 5 experts, 2 per token, GQA, RoPE base 1e6.
  const fs::path src = fixture("hf-mixtral");
  nn::TransformerConfig cfg;
  auto model = load(src.string(), cfg);
  CHECK(cfg.arch == "llama");
  CHECK(cfg.moe_experts == 5);
  CHECK(cfg.moe_top_k == 2);
  CHECK(cfg.moe_every == 1);
  CHECK(cfg.moe_width() == 20);
  CHECK(cfg.moe_router == "softmax");
  CHECK(cfg.moe_norm_topk);
  CHECK(cfg.moe_balance == "aux_loss");
  CHECK(cfg.moe_balance_coefficient() == 0.02);  // router_aux_loss_coef
  CHECK(cfg.n_kv_head == 2);
  CHECK(cfg.rope_theta == 1e6);  // Mixtral's default, from rope_parameters
  CHECK(cfg.norm_eps == 1e-6);
  CHECK_FALSE(cfg.tie_embeddings);
  REQUIRE(nn::moe_layers(*model).size() == 2);
  nn::SafetensorsFile expected((src / "expected.safetensors").string());
  Tensor ids = expected.read("input_ids"), want = expected.read("logits");
  const double want_loss = expected.read("loss").item();
  const int64_t B = ids.size(0), T = ids.size(1);
  auto loss_of = [&](const Tensor& logits) {  // transformers' loss: ids[:, 1:] predicted from ids[:, :-1]
    return nn::cross_entropy(ops::narrow(logits, 1, 0, T - 1), ops::narrow(ids, 1, 1, T - 1)).item();
  };
  {  // A training forward counts the routing: every expert of every layer takes tokens (the
     // fixture exercises the router, not one expert), 2 per token.
    model->train();
    (*model)(ids);
    for (nn::MoE* layer : nn::moe_layers(*model)) {
      REQUIRE(layer->routed().size() == 5);
      int64_t pairs = 0;
      for (int64_t n : layer->routed()) {
        CHECK(n > 0);
        pairs += n;
      }
      CHECK(pairs == B * T * 2);
    }
  }
  autograd::NoGradGuard no_grad;
  model->eval();
  Tensor logits = (*model)(ids);
  CHECK_CLOSE(logits, want, 1e-5, 1e-5);
  CHECK(std::abs(loss_of(logits) - want_loss) <= 1e-5 * std::abs(want_loss));
  model->to(DType::F64);
  CHECK_CLOSE((*model)(ids), ops::to(want, DType::F64), 1e-5, 1e-5);
  // The router's weights are rescaled over the chosen two, as Mixtral's: without it the logits differ.
  nn::TransformerConfig unscaled = cfg;
  unscaled.moe_norm_topk = false;
  CHECK_FALSE(allclose(logits_with(unscaled, *model, ids, DType::F64), ops::to(want, DType::F64), 1e-5, 1e-5));
  // Written back: the experts apart again, bit for bit, and the same settings.
  TempDir out;
  io::write_hf(out.path.string(), cfg, model->state_dict());
  check_same_tensors(out.path / "model.safetensors", src / "model.safetensors");
  nn::TransformerConfig again;
  load(out.path.string(), again);
  CHECK(same_config(again, cfg));
  CHECK(again.moe_experts == 5);
  CHECK(again.moe_top_k == 2);
  CHECK(again.moe_width() == 20);
  CHECK(again.moe_balance_coefficient() == 0.02);
}

TEST_CASE("Mixtral's fused expert layout (transformers 5) reads as the per-expert one", "[hf][mixtral]") {
  const fs::path src = fixture("hf-mixtral");
  const nn::TransformerConfig cfg = io::read_hf_config(src.string());
  const nn::StateDict per_expert = io::read_hf_weights(src.string(), cfg);
  // mlp.gate, mlp.experts.gate_up_proj [E, 2H, C] (w1 over w3), mlp.experts.down_proj [E, C, H].
  nn::SafetensorsFile f((src / "model.safetensors").string());
  nn::StateDict fused;
  for (const auto& e : f.entries())
    if (e.name.find(".block_sparse_moe.experts.") == std::string::npos) {
      std::string name = e.name;
      const auto at = name.find(".block_sparse_moe.gate.");
      if (at != std::string::npos) name = name.substr(0, at) + ".mlp.gate." + name.substr(at + 23);
      fused.emplace_back(name, f.read(e.name));
    }
  for (int layer = 0; layer < 2; ++layer) {
    std::vector<Tensor> gate_up, down;
    for (int e = 0; e < 5; ++e) {
      const std::string p = "model.layers." + std::to_string(layer) + ".block_sparse_moe.experts." + std::to_string(e);
      gate_up.push_back(ops::cat({f.read(p + ".w1.weight"), f.read(p + ".w3.weight")}, 0));
      down.push_back(f.read(p + ".w2.weight"));
    }
    const std::string p = "model.layers." + std::to_string(layer) + ".mlp.experts.";
    fused.emplace_back(p + "gate_up_proj", ops::stack(gate_up, 0));
    fused.emplace_back(p + "down_proj", ops::stack(down, 0));
  }
  TempDir dir;
  fs::copy_file(src / "config.json", dir.path / "config.json");
  nn::save_safetensors((dir.path / "model.safetensors").string(), fused);
  const nn::StateDict read = io::read_hf_weights(dir.path.string(), cfg);
  std::map<std::string, Tensor> by_name(read.begin(), read.end());
  REQUIRE(read.size() == per_expert.size());
  for (const auto& [name, t] : per_expert) {
    INFO(name);
    REQUIRE(by_name.count(name) == 1);
    CHECK(equal(by_name[name], t));
  }
}

TEST_CASE("Mixtral folders and MoE models Tessera cannot take are refused, naming why", "[hf][mixtral][errors]") {
  const fs::path src = fixture("hf-mixtral");
  TempDir dir;
  nlohmann::json base;
  std::ifstream(src / "config.json") >> base;
  auto read_with = [&](const std::function<void(nlohmann::json&)>& change) {
    nlohmann::json c = base;
    change(c);
    std::ofstream(dir.path / "config.json") << c.dump();
    io::read_hf_config(dir.path.string());
  };
  CHECK_THROWS_WITH(read_with([](auto& c) { c["sliding_window"] = 8; }),
                    Catch::Contains("sliding_window 8 below max_position_embeddings 16"));
  CHECK_THROWS_WITH(read_with([](auto& c) { c["router_jitter_noise"] = 0.1; }),
                    Catch::Contains("router_jitter_noise 0.1"));
  CHECK_THROWS_WITH(read_with([](auto& c) { c["num_experts_per_tok"] = 6; }),
                    Catch::Contains("\"num_experts_per_tok\"") && Catch::Contains("must be in [1,"));
  CHECK_THROWS_WITH(read_with([](auto& c) { c.erase("num_local_experts"); }),
                    Catch::Contains("needs \"num_local_experts\" as a positive integer"));
  read_with([](auto& c) { c["sliding_window"] = 16; });  // a window over every position is full attention
  read_with([](auto& c) { c["router_aux_loss_coef"] = 0; });
  CHECK(io::read_hf_config(dir.path.string()).moe_balance == "none");
  // Weights: an expert missing, or one beyond num_local_experts.
  const nn::TransformerConfig cfg = io::read_hf_config(src.string());
  nn::SafetensorsFile f((src / "model.safetensors").string());
  auto weights_without = [&](const std::string& drop, const std::string& add) {
    nn::StateDict w;
    for (const auto& e : f.entries())
      if (e.name != drop) w.emplace_back(e.name, f.read(e.name));
    if (!add.empty()) w.emplace_back(add, f.read("model.layers.0.block_sparse_moe.experts.0.w1.weight"));
    nn::save_safetensors((dir.path / "model.safetensors").string(), w);
    io::read_hf_weights(dir.path.string(), cfg);
  };
  CHECK_THROWS_WITH(weights_without("model.layers.1.block_sparse_moe.experts.3.w2.weight", ""),
                    Catch::Contains("has no model.layers.1.block_sparse_moe.experts.3.w2.weight"));
  CHECK_THROWS_WITH(weights_without("", "model.layers.0.block_sparse_moe.experts.5.w1.weight"),
                    Catch::Contains("holds model.layers.0.block_sparse_moe.experts.5.w1.weight, but its config.json "
                                    "has 2 layers of 5 experts"));
  // Export: only what Mixtral's router computes.
  auto model = io::load_hf_model(src.string());
  for (auto change : {+[](nn::TransformerConfig& c) { c.moe_router = "sigmoid"; },
                      +[](nn::TransformerConfig& c) { c.moe_shared_experts = 1; },
                      +[](nn::TransformerConfig& c) { c.moe_every = 2; },
                      +[](nn::TransformerConfig& c) { c.moe_norm_topk = false; }}) {
    nn::TransformerConfig other = cfg;
    change(other);
    CHECK_THROWS_WITH(io::write_hf((dir.path / "out").string(), other, model->state_dict()),
                      Catch::Contains("is written as Mixtral (MixtralForCausalLM)"));
  }
  nn::StateDict moved = model->state_dict();
  for (auto& [name, t] : moved)
    if (name == "model.layers.1.block_sparse_moe.expert_bias") t = ops::add(t, from_vector<float>({0, 0, 0.25f, 0, 0}, {5}));
  CHECK_THROWS_WITH(io::write_hf((dir.path / "out").string(), cfg, moved),
                    Catch::Contains("model.layers.1.block_sparse_moe.expert_bias is not zero"));
}
