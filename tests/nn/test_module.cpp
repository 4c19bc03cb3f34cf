#include <algorithm>

#include "nn/models.h"
#include "runtime/allocator.h"
#include "tests/helpers.h"

using namespace tessera;
using tessera::testing::allclose;
using tessera::testing::equal;

namespace {
nn::TransformerConfig tiny(bool tie = true) {
  nn::TransformerConfig c;
  c.vocab_size = 11;
  c.block_size = 9;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 6;
  c.tie_embeddings = tie;
  return c;
}

class Net : public nn::Module {
 public:
  Net() {
    fc1 = register_module("fc1", std::make_shared<nn::Linear>(3, 5));
    fc2 = register_module("fc2", std::make_shared<nn::Linear>(5, 2, false));
    scale = &register_buffer("scale", full({2}, 2.0));
  }
  Tensor forward(const Tensor& x) override { return (*fc2)(relu((*fc1)(x))) * *scale; }
  std::shared_ptr<nn::Linear> fc1, fc2;
  Tensor* scale;
};
}  // namespace

TEST_CASE("named parameters, buffers and modules use dotted FQNs", "[nn][module]") {
  Net net;
  std::vector<std::string> names;
  for (auto& [n, p] : net.named_parameters()) names.push_back(n);
  CHECK(names == std::vector<std::string>{"fc1.weight", "fc1.bias", "fc2.weight"});
  CHECK(net.named_buffers().at(0).first == "scale");
  std::vector<std::string> mods;
  for (auto& [n, m] : net.named_modules()) mods.push_back(n);
  CHECK(mods == std::vector<std::string>{"", "fc1", "fc2"});
  CHECK(&net.submodule("fc2") == net.fc2.get());
  CHECK_THROWS_WITH(net.submodule("fc3"), Catch::Contains("no submodule 'fc3'"));

  nn::GPT gpt(tiny());
  auto params = gpt.named_parameters();
  CHECK(params.front().first == "transformer.wte.weight");
  CHECK(params.at(2).first == "transformer.h.0.ln_1.weight");
  bool has_attn = false;
  for (auto& [n, p] : params) has_attn = has_attn || n == "transformer.h.1.attn.c_attn.weight";
  CHECK(has_attn);
  // Tied: listed once by named_parameters, twice in the state dict.
  int lm = 0;
  for (auto& [n, p] : params) lm += n == "lm_head.weight";
  CHECK(lm == 0);
  auto sd = gpt.state_dict();
  CHECK(nn::find_in(sd, "lm_head.weight") != nullptr);
  CHECK(nn::find_in(sd, "lm_head.weight")->is_same(*nn::find_in(sd, "transformer.wte.weight")));
  CHECK(gpt.lm_head->weight.shape() == Shape{11, 6});  // Linear weights are [out, in]

  auto lcfg = tiny(false);
  lcfg.n_embd = 8;
  nn::Llama llama(lcfg);
  auto lsd = llama.state_dict();
  for (const char* key : {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                          "model.layers.1.mlp.gate_proj.weight", "model.layers.0.input_layernorm.weight",
                          "model.layers.0.post_attention_layernorm.weight", "model.norm.weight",
                          "lm_head.weight"})
    CHECK(nn::find_in(lsd, key) != nullptr);
}

TEST_CASE("forward hooks run on module(x), not on module.forward(x)", "[nn][hooks]") {
  Net net;
  int pre = 0, post = 0;
  std::vector<std::string> order;
  net.register_forward_pre_hook([&](nn::Module&, TensorList& in) {
    ++pre;
    order.push_back("pre");
    in[0] = in[0] * 2.0;  // pre-hooks may replace inputs
  });
  auto id = net.register_forward_hook([&](nn::Module&, const TensorList&, TensorList& out) {
    ++post;
    order.push_back("post");
    out[0] = out[0] + 1.0;  // and forward hooks outputs
  });
  net.register_forward_pre_hook([&](nn::Module&, TensorList&) { order.push_back("first"); }, true);
  Tensor x = randn({4, 3}, 1);
  Tensor direct = net.forward(x);
  CHECK(pre == 0);
  CHECK(post == 0);
  Tensor called = net(x);
  CHECK(pre == 1);
  CHECK(post == 1);
  CHECK(order == std::vector<std::string>{"first", "pre", "post"});
  CHECK(allclose(called, ops::add(net.forward(ops::mul(x, 2.0)), 1.0)));
  net.remove_hook(id);
  net(x);
  CHECK(post == 1);
  // Children's hooks fire when the parent's forward calls them as module(x).
  int child_calls = 0;
  net.fc1->register_forward_pre_hook([&](nn::Module&, TensorList&) { ++child_calls; });
  net.forward(x);
  CHECK(child_calls == 1);
}

TEST_CASE("state_dict round trip and load errors", "[nn][state_dict]") {
  nn::GPT a(tiny()), b(tiny());
  a.init_weights(1);
  b.init_weights(2);
  CHECK_FALSE(equal(a.wpe->weight, b.wpe->weight));
  b.load_state_dict(a.state_dict());
  for (auto& [name, t] : a.state_dict()) CHECK(equal(t, *nn::find_in(b.state_dict(), name)));
  // The tie survives loading.
  CHECK(b.lm_head->weight.is_same(b.wte->weight));

  nn::StateDict sd = a.state_dict();
  sd.erase(sd.begin() + 1);
  CHECK_THROWS_WITH(b.load_state_dict(sd), Catch::Contains("missing keys ['transformer.wpe.weight']"));
  b.load_state_dict(sd, /*strict=*/false);
  sd = a.state_dict();
  sd.emplace_back("extra.weight", zeros({1}));
  CHECK_THROWS_WITH(b.load_state_dict(sd), Catch::Contains("unexpected keys ['extra.weight']"));
  auto big = tiny();
  big.n_embd = 8;
  nn::GPT c(big);
  CHECK_THROWS_WITH(b.load_state_dict(c.state_dict()),
                    Catch::Contains("size mismatch for transformer.wte.weight: checkpoint [11, 8] vs model [11, 6]"));
  // dtype is converted on load.
  nn::StateDict half;
  for (auto& [n, t] : a.state_dict()) half.emplace_back(n, ops::to(t, DType::BF16));
  b.load_state_dict(half);
  CHECK(b.wpe->weight.dtype() == DType::F32);
  CHECK(equal(b.wpe->weight, ops::to(ops::to(a.wpe->weight, DType::BF16), DType::F32)));
}

TEST_CASE("init_weights depends only on seed and FQN; meta models materialise", "[nn][init]") {
  auto cfg = tiny();
  nn::GPT a(cfg);
  a.init_weights(7);
  auto meta = nn::GPT::on_meta(cfg);
  CHECK(meta->wte->weight.is_meta());
  MemoryStats before = memory_stats();
  auto meta2 = nn::GPT::on_meta(cfg);
  CHECK(memory_stats().allocated_bytes == before.allocated_bytes);  // no bytes on meta
  meta->to_empty(Device::cpu());
  CHECK(meta->lm_head->weight.is_same(meta->wte->weight));  // tie kept through to_empty
  meta->init_weights(7);
  for (auto& [name, t] : a.state_dict()) CHECK(equal(t, *nn::find_in(meta->state_dict(), name)));
  // A tied weight is initialised under its first FQN.
  Tensor expect = empty({11, 6});
  nn::init_normal(expect, 0.0, 0.02, 7, "transformer.wte.weight");
  CHECK(equal(a.wte->weight, expect));
  // Residual projections use the scaled std.
  CHECK(a.state_dict().size() > 0);
  CHECK(ops::var(a.blocks[0]->submodule("attn.c_proj").parameter_slots()[0].value).item() <
        ops::var(a.blocks[0]->submodule("attn.c_attn").parameter_slots()[0].value).item());
}

TEST_CASE("to(dtype), train/eval and zero_grad", "[nn][module]") {
  Net net;
  net.to(DType::F64);
  CHECK(net.fc1->weight.dtype() == DType::F64);
  CHECK(net.fc1->weight.requires_grad());
  CHECK(net.scale->dtype() == DType::F64);
  net.eval();
  CHECK_FALSE(net.fc1->is_training());
  net.train();
  Tensor loss = sum(net(randn({2, 3}, 1, DType::F64)));
  autograd::backward(loss);
  CHECK(net.fc1->weight.grad().defined());
  net.zero_grad(false);
  CHECK(ops::sum_squares(net.fc1->weight.grad()) == 0.0);
  net.zero_grad();
  CHECK_FALSE(net.fc1->weight.grad().defined());
}

TEST_CASE("bad input gives clear exceptions", "[nn][errors]") {
  nn::Linear lin(4, 3);
  CHECK_THROWS_WITH(lin(randn({2, 5}, 1)),
                    Catch::Contains("linear: input [2, 5] has 5 features but weight [3, 4] expects 4"));
  CHECK_THROWS_WITH(lin(randn({2, 4}, 1, DType::F64)), Catch::Contains("dtype mismatch"));
  nn::Embedding emb(10, 4);
  CHECK_THROWS_WITH(emb(from_vector<int64_t>({1, 10}, {2})),
                    Catch::Contains("index 10 at position 1 is out of range for a table of 10 rows"));
  CHECK_THROWS_WITH(emb(randn({2}, 1)), Catch::Contains("indices must be i32 or i64, got f32"));
  // The backward kernel checks too (it wrote outside the table before), for
  // i64 and i32 indices, negative ones and a count that does not match.
  for (DType it : {DType::I64, DType::I32}) {
    INFO(dtype_name(it));
    CHECK_THROWS_WITH(ops::embedding_backward(randn({3, 4}, 2), ops::to(from_vector<int64_t>({1, 600, 2}, {3}), it), 501),
                      Catch::Contains("embedding_backward: index 600 at position 1 is out of range for a table of 501 rows"));
    CHECK_THROWS_WITH(ops::embedding_backward(randn({3, 4}, 2), ops::to(from_vector<int64_t>({0, 1, -1}, {3}), it), 5),
                      Catch::Contains("index -1 at position 2 is out of range for a table of 5 rows"));
  }
  CHECK_THROWS_WITH(ops::embedding_backward(randn({3, 4}, 2), from_vector<int64_t>({0, 1}, {2}), 5),
                    Catch::Contains("the gradient [3, 4] has 3 rows, but there are 2 indices [2]"));
  // cross_entropy's backward, called directly with other targets than the forward's.
  {
    Tensor logits = randn({3, 5}, 3);
    auto ce = ops::cross_entropy(logits, from_vector<int64_t>({0, 4, 2}, {3}));
    Tensor one = full({}, 1.0);
    CHECK_THROWS_WITH(ops::cross_entropy_backward(one, logits, from_vector<int64_t>({0, 5, 2}, {3}), ce.lse, -100, ce.count),
                      Catch::Contains("cross_entropy_backward: target 5 at position 1 is out of range for 5 classes"));
    CHECK_THROWS_WITH(ops::cross_entropy_backward(one, logits, from_vector<int64_t>({0, 1}, {2}), ce.lse, -100, ce.count),
                      Catch::Contains("targets must be i64 or i32 [3] for logits [3, 5], got i64 [2]"));
    CHECK_THROWS_WITH(ops::cross_entropy_backward(one, logits, from_vector<int64_t>({0, 1, 2}, {3}), randn({2}, 4), -100, ce.count),
                      Catch::Contains("expected lse of 3 rows"));
    CHECK_NOTHROW(ops::cross_entropy_backward(one, logits, from_vector<int64_t>({0, -100, 2}, {3}), ce.lse, -100, ce.count));
  }
  nn::GPT gpt(tiny());
  CHECK_THROWS_WITH(gpt(zeros({1, 10}, DType::I64)),
                    Catch::Contains("sequence length 10 exceeds the model's block_size 9"));
  CHECK_THROWS_WITH(nn::cross_entropy(randn({2, 3, 5}, 1), zeros({2, 4}, DType::I64)),
                    Catch::Contains("targets [2, 4] do not match logits [2, 3, 5]"));
  CHECK_THROWS_WITH(nn::cross_entropy(randn({2, 5}, 1), from_vector<int64_t>({1, 7}, {2})),
                    Catch::Contains("target 7 at position 1 is out of range for 5 classes"));
  auto cfg = tiny();
  cfg.n_head = 4;
  CHECK_THROWS_WITH(nn::GPT(cfg), Catch::Contains("n_embd (6) must be divisible by n_head (4)"));
}

TEST_CASE("apply visits every module once, children before their parent", "[nn][module]") {
  nn::GPT gpt(tiny());
  std::vector<nn::Module*> order;
  gpt.apply([&](nn::Module& m) { order.push_back(&m); });
  auto mods = gpt.named_modules();
  REQUIRE(order.size() == mods.size());
  CHECK(order.back() == &gpt);
  auto pos = [&](const nn::Module* m) {
    return std::find(order.begin(), order.end(), m) - order.begin();
  };
  for (auto& [name, m] : mods) {
    INFO(name);
    CHECK(std::count(order.begin(), order.end(), m) == 1);
    for (auto& [cname, c] : m->named_children()) CHECK(pos(c.get()) < pos(m));
  }
  Net net;
  std::vector<std::string> types;
  net.apply([&](nn::Module& m) { types.push_back(m.type_name()); });
  CHECK(types == std::vector<std::string>{"Linear", "Linear", "Module"});
  // A typical use: re-initialise every Linear.
  net.apply([](nn::Module& m) {
    if (auto* lin = dynamic_cast<nn::Linear*>(&m)) ops::fill_(lin->weight, 0.5);
  });
  CHECK(equal(net.fc1->weight, full({5, 3}, 0.5)));
  CHECK(equal(net.fc2->weight, full({2, 5}, 0.5)));
  CHECK_FALSE(equal(net.fc1->bias, full({5}, 0.5)));
}

TEST_CASE("non-persistent buffers are moved but left out of state dicts",
          "[nn][module][state_dict]") {
  auto make = [] {
    auto net = std::make_shared<Net>();
    net->fc1->register_buffer("cache", randn({3, 4}, 7), /*persistent=*/false);
    net->register_buffer("step", full({}, 3.0), /*persistent=*/true);
    return net;
  };
  auto a = make();
  std::vector<std::string> buffers, keys;
  for (auto& [n, t] : a->named_buffers()) buffers.push_back(n);
  for (auto& [n, t] : a->state_dict()) keys.push_back(n);
  CHECK(buffers == std::vector<std::string>{"scale", "step", "fc1.cache"});
  CHECK(keys == std::vector<std::string>{"scale", "step", "fc1.weight", "fc1.bias", "fc2.weight"});
  // Loading needs no value for it, refuses one (strict), and leaves it alone.
  auto b = make();
  Tensor cache_b = ops::clone(b->named_buffers().at(2).second);
  b->load_state_dict(a->state_dict());
  CHECK(equal(b->named_buffers().at(2).second, cache_b));
  nn::StateDict with = a->state_dict();
  with.emplace_back("fc1.cache", zeros({3, 4}));
  CHECK_THROWS_WITH(b->load_state_dict(with), Catch::Contains("unexpected keys ['fc1.cache']"));
  // Moves convert it like any buffer.
  a->to(DType::F64);
  CHECK(a->named_buffers().at(2).second.dtype() == DType::F64);
}
