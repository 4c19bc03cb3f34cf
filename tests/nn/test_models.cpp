// The models against references computed another way: a GPT written out with
// primitive ops (materialised attention, unfused norms and loss), and central
// differences in f64.
#include <cmath>

#include "nn/models.h"
#include "nn/optim.h"
#include "runtime/profiler.h"
#include "tests/helpers.h"

using namespace tessera;
using tessera::testing::allclose;

namespace {
nn::TransformerConfig tiny_cfg() {
  nn::TransformerConfig c;
  c.vocab_size = 13;
  c.block_size = 16;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 8;
  return c;
}

Tensor naive_layer_norm(const Tensor& x, const Tensor& w, const Tensor& b, double eps) {
  Tensor mu = mean(x, {-1}, true);
  Tensor var0 = mean(square(x - mu), {-1}, true);
  return (x - mu) * rsqrt(var0 + eps) * w + b;
}

Tensor naive_attention(const Tensor& q, const Tensor& k, const Tensor& v) {
  int64_t t = q.size(2);
  Tensor scores = matmul(q, transpose(k, -2, -1)) * (1.0 / std::sqrt(static_cast<double>(q.size(3))));
  Tensor above = ops::binary(ops::BinaryOp::Gt, ops::reshape(arange(0, t), {1, t}),
                             ops::reshape(arange(0, t), {t, 1}));
  scores = where(above, full({}, -1e30, scores.dtype()), scores);
  return matmul(softmax(scores, -1), v);
}

// Mean negative log-likelihood of logits [B, T, V] against targets [B, T], via one-hot.
Tensor naive_nll(const Tensor& logits, const Tensor& targets) {
  int64_t n = targets.numel(), vocab = logits.size(-1);
  Tensor logp = log_softmax(reshape(logits, {n, vocab}), -1);
  Tensor onehot = ops::to(ops::binary(ops::BinaryOp::Eq, ops::reshape(arange(0, vocab), {1, vocab}),
                                      ops::reshape(targets, {n, 1})),
                          logp.dtype());
  return neg(sum(logp * onehot)) * (1.0 / static_cast<double>(n));
}

Tensor naive_rope(const Tensor& x, double theta);

// The GPT forward + loss from primitives, reading the model's parameters
// (rotary q/k instead of learned positions when the config says rope).
Tensor naive_gpt_loss(nn::GPT& m, const Tensor& idx, const Tensor& targets) {
  const auto& c = m.config;
  int64_t b = idx.size(0), t = idx.size(1), h = c.n_head, d = c.n_embd / c.n_head;
  Tensor pos = arange(0, t);
  Tensor x = embedding(m.wte->weight, idx);
  if (!c.rope) x = x + embedding(m.wpe->weight, pos);
  for (auto& blk_ptr : m.blocks) {
    auto& blk = static_cast<nn::GPTBlock&>(*blk_ptr);
    Tensor a = naive_layer_norm(x, blk.ln_1->weight, blk.ln_1->bias, c.norm_eps);
    Tensor qkv = matmul(a, transpose(blk.attn->c_attn->weight, 0, 1)) + blk.attn->c_attn->bias;
    auto heads = [&](int64_t i) {
      return transpose(reshape(narrow(qkv, 2, i * c.n_embd, c.n_embd), {b, t, h, d}), 1, 2);
    };
    Tensor q = heads(0), k = heads(1);
    if (c.rope) {
      q = naive_rope(q, c.rope_theta);
      k = naive_rope(k, c.rope_theta);
    }
    Tensor y = naive_attention(q, k, heads(2));
    y = reshape(transpose(y, 1, 2), {b, t, c.n_embd});
    x = x + matmul(y, transpose(blk.attn->c_proj->weight, 0, 1)) + blk.attn->c_proj->bias;
    Tensor f = naive_layer_norm(x, blk.ln_2->weight, blk.ln_2->bias, c.norm_eps);
    Tensor pre = matmul(f, transpose(blk.mlp->c_fc->weight, 0, 1)) + blk.mlp->c_fc->bias;
    // GPT-2's tanh approximation: 0.5 v (1 + tanh(sqrt(2 / pi) (v + 0.044715 v^3))).
    Tensor hid = c.gelu_tanh ? pre * 0.5 * (tanh((pre + pow(pre, 3.0) * 0.044715) * std::sqrt(2.0 / M_PI)) + 1.0)
                             : gelu(pre);
    x = x + matmul(hid, transpose(blk.mlp->c_proj->weight, 0, 1)) + blk.mlp->c_proj->bias;
  }
  x = naive_layer_norm(x, m.ln_f->weight, m.ln_f->bias, c.norm_eps);
  return naive_nll(matmul(x, transpose(m.lm_head->weight, 0, 1)), targets);
}

Tensor naive_rms_norm(const Tensor& x, const Tensor& w, double eps) {
  return x * rsqrt(mean(square(x), {-1}, true) + eps) * w;
}

// Hugging Face Llama's rotary embedding on x [B, H, T, D]: inv_freq = 1 / theta^(2i/D),
// cos/sin of cat(freqs, freqs) [T, D], x * cos + rotate_half(x) * sin with
// rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2]).
Tensor naive_rope(const Tensor& x, double theta) {
  int64_t t = x.size(2), d = x.size(3), half = d / 2;
  std::vector<double> c(static_cast<size_t>(t * d)), s(c.size());
  for (int64_t p = 0; p < t; ++p)
    for (int64_t j = 0; j < d; ++j) {
      double inv_freq =
          1.0 / std::pow(theta, static_cast<double>(2 * (j % half)) / static_cast<double>(d));
      c[static_cast<size_t>(p * d + j)] = std::cos(static_cast<double>(p) * inv_freq);
      s[static_cast<size_t>(p * d + j)] = std::sin(static_cast<double>(p) * inv_freq);
    }
  Tensor rotated = cat({neg(narrow(x, 3, half, half)), narrow(x, 3, 0, half)}, 3);
  return x * from_vector(c, {t, d}) + rotated * from_vector(s, {t, d});
}

// Hugging Face's repeat_kv: [B, Hkv, T, D] -> [B, Hkv * rep, T, D], head h reading kv head h / rep.
Tensor repeat_kv(const Tensor& x, int64_t rep) {
  int64_t b = x.size(0), hkv = x.size(1), t = x.size(2), d = x.size(3);
  return reshape(expand(unsqueeze(x, 2), {b, hkv, rep, t, d}), {b, hkv * rep, t, d});
}

// The Llama forward + loss from primitives: RMSNorm, rotary q/k, grouped-query
// attention by repeating k/v heads, SwiGLU as silu(x) = x * sigmoid(x).
Tensor naive_llama_loss(nn::Llama& m, const Tensor& idx, const Tensor& targets) {
  const auto& c = m.config;
  int64_t b = idx.size(0), t = idx.size(1), h = c.n_head, hkv = c.kv_heads(), d = c.head_dim();
  auto lin = [](const Tensor& x, const Tensor& w) { return matmul(x, transpose(w, 0, 1)); };
  Tensor x = embedding(m.embed_tokens->weight, idx);
  for (auto& blk_ptr : m.blocks) {
    auto& blk = static_cast<nn::LlamaBlock&>(*blk_ptr);
    auto& at = *blk.self_attn;
    Tensor a = naive_rms_norm(x, blk.input_layernorm->weight, c.norm_eps);
    auto heads = [&](const Tensor& w, int64_t n) {
      return transpose(reshape(lin(a, w), {b, t, n, d}), 1, 2);
    };
    Tensor q = naive_rope(heads(at.q_proj->weight, h), c.rope_theta);
    Tensor k = naive_rope(heads(at.k_proj->weight, hkv), c.rope_theta);
    Tensor v = heads(at.v_proj->weight, hkv);
    Tensor y = naive_attention(q, repeat_kv(k, h / hkv), repeat_kv(v, h / hkv));
    x = x + lin(reshape(transpose(y, 1, 2), {b, t, h * d}), at.o_proj->weight);
    Tensor f = naive_rms_norm(x, blk.post_attention_layernorm->weight, c.norm_eps);
    Tensor gate = lin(f, blk.mlp->gate_proj->weight);
    x = x +
        lin(gate * sigmoid(gate) * lin(f, blk.mlp->up_proj->weight), blk.mlp->down_proj->weight);
  }
  x = naive_rms_norm(x, m.norm->weight, c.norm_eps);
  return naive_nll(lin(x, m.lm_head->weight), targets);
}

std::vector<std::pair<std::string, Tensor>> grads_of(nn::Module& m) {
  std::vector<std::pair<std::string, Tensor>> out;
  for (auto& [n, p] : m.named_parameters()) out.emplace_back(n, ops::clone(p.grad()));
  return out;
}
}  // namespace

TEST_CASE("GPT loss and gradients equal a primitive-op reference (f64)", "[nn][gpt]") {
  auto cfg = tiny_cfg();
  for (auto [tie, rope, tanh] : {std::tuple{true, false, false}, std::tuple{false, false, true},
                                 std::tuple{true, true, false}}) {
    INFO("tied " << tie << " rope " << rope << " tanh GELU " << tanh);
    cfg.tie_embeddings = tie;
    cfg.rope = rope;
    cfg.gelu_tanh = tanh;
    cfg.rope_theta = 37.0;  // small: every pair of dims rotates visibly over 7 positions
    nn::GPT m(cfg);
    m.to(DType::F64);
    m.init_weights(3);
    bool has_wpe = false;
    for (auto& [name, t] : m.state_dict()) has_wpe = has_wpe || name == "transformer.wpe.weight";
    CHECK(has_wpe != rope);  // rope: no learned positions
    Tensor idx = randint({3, 7}, 0, cfg.vocab_size, 1), tgt = randint({3, 7}, 0, cfg.vocab_size, 2);
    Tensor loss = nn::cross_entropy(m(idx), tgt);
    autograd::backward(loss);
    auto fused = grads_of(m);
    m.zero_grad();
    Tensor ref = naive_gpt_loss(m, idx, tgt);
    autograd::backward(ref);
    auto naive = grads_of(m);
    CHECK(loss.item() == Approx(ref.item()).epsilon(1e-12));
    CHECK(loss.item() == Approx(std::log(13.0)).epsilon(0.05));  // near-uniform at init
    for (size_t i = 0; i < fused.size(); ++i) {
      INFO(fused[i].first);
      CHECK(allclose(fused[i].second, naive[i].second, 1e-9, 1e-12));
    }
  }
}

TEST_CASE("Llama loss and gradients equal a primitive-op reference (f64)", "[nn][llama]") {
  nn::TransformerConfig cfg;
  cfg.vocab_size = 13;
  cfg.block_size = 24;
  cfg.n_layer = 2;
  cfg.n_head = 4;
  cfg.n_embd = 24;  // head_dim 6: three rotary frequencies
  cfg.ffn_hidden = 20;
  cfg.rope_theta = 50.0;       // angles that differ visibly between positions and frequencies
  for (int64_t kv : {2, 1}) {  // 2 of 4: query head h must read kv head h / 2, not h % 2
    cfg.n_kv_head = kv;
    cfg.tie_embeddings = kv == 2;
    INFO("kv heads " << kv << " tied " << cfg.tie_embeddings);
    nn::Llama m(cfg);
    m.to(DType::F64);
    {
      // Weights well away from the init (std 0.02, norms 1), so that attention is far
      // from uniform, rotations matter, and every norm weight is used.
      autograd::NoGradGuard ng;
      uint64_t seed = 100;
      for (auto& [name, p] : m.named_parameters()) {
        Tensor r = randn(p.shape(), seed++, DType::F64);
        ops::copy_(p, p.dim() == 1 ? ops::add(ops::mul(r, 0.3), 1.0) : ops::mul(r, 0.4));
      }
    }
    // T = 17, then 5: the second call reads the first rows of the cached rotary table.
    for (int64_t t : {17, 5}) {
      INFO("T=" << t);
      Tensor idx = randint({2, t}, 0, cfg.vocab_size, static_cast<uint64_t>(t)),
             tgt = randint({2, t}, 0, cfg.vocab_size, static_cast<uint64_t>(t + 1));
      m.zero_grad();
      Tensor loss = nn::cross_entropy(m(idx), tgt);
      autograd::backward(loss);
      auto fused = grads_of(m);
      m.zero_grad();
      Tensor ref = naive_llama_loss(m, idx, tgt);
      autograd::backward(ref);
      auto naive = grads_of(m);
      CHECK(loss.item() == Approx(ref.item()).epsilon(1e-12));
      CHECK(std::fabs(loss.item() - std::log(13.0)) > 0.1);  // far from the uniform prediction
      REQUIRE(fused.size() == naive.size());
      for (size_t i = 0; i < fused.size(); ++i) {
        INFO(fused[i].first);
        CHECK(allclose(fused[i].second, naive[i].second, 1e-9, 1e-12));
      }
    }
  }
}

TEST_CASE("GPT and Llama gradients match central differences (f64)", "[nn][gpt][llama]") {
  auto cfg = tiny_cfg(), gqa = cfg;
  gqa.n_kv_head = 1;  // Llama: grouped-query attention
  std::vector<std::shared_ptr<nn::LanguageModel>> models = {std::make_shared<nn::GPT>(cfg),
                                                            std::make_shared<nn::Llama>(gqa)};
  for (auto& m : models) {
    INFO(m->type_name());
    m->to(DType::F64);
    m->init_weights(5);
    Tensor idx = randint({2, 5}, 0, cfg.vocab_size, 3), tgt = randint({2, 5}, 0, cfg.vocab_size, 4);
    autograd::backward(nn::cross_entropy((*m)(idx), tgt));
    for (auto& [name, p] : m->named_parameters()) {
      INFO(name);
      Tensor g = p.grad();
      REQUIRE(g.defined());
      auto gv = g.to_vector<double>();
      double* data = p.data<double>();
      // A few elements of every parameter (first, middle, last).
      for (int64_t e : {int64_t{0}, p.numel() / 2, p.numel() - 1}) {
        double orig = data[e], eps = 1e-6;
        autograd::NoGradGuard ng;
        data[e] = orig + eps;
        double up = nn::cross_entropy((*m)(idx), tgt).item();
        data[e] = orig - eps;
        double down = nn::cross_entropy((*m)(idx), tgt).item();
        data[e] = orig;
        double numeric = (up - down) / (2 * eps);
        CHECK(gv[static_cast<size_t>(e)] == Approx(numeric).margin(1e-7).epsilon(1e-5));
      }
    }
  }
}

TEST_CASE("f32 model agrees with its f64 twin; activation checkpointing changes nothing",
          "[nn][gpt]") {
  auto cfg = tiny_cfg();
  cfg.dropout = 0.1;
  nn::GPT a(cfg);
  a.init_weights(9);
  Tensor idx = randint({2, 16}, 0, cfg.vocab_size, 5), tgt = randint({2, 16}, 0, cfg.vocab_size, 6);
  manual_seed(1);
  Tensor la = nn::cross_entropy(a(idx), tgt);
  autograd::backward(la);
  auto ga = grads_of(a);
  cfg.activation_checkpoint = true;
  nn::GPT b(cfg);
  b.load_state_dict(a.state_dict());
  manual_seed(1);
  Tensor lb = nn::cross_entropy(b(idx), tgt);
  autograd::backward(lb);
  auto gb = grads_of(b);
  CHECK(la.item() == lb.item());
  for (size_t i = 0; i < ga.size(); ++i) {
    INFO(ga[i].first);
    CHECK(allclose(ga[i].second, gb[i].second, 1e-6, 1e-7));
  }
  nn::GPT c(tiny_cfg());
  c.load_state_dict(a.state_dict());
  c.to(DType::F64);
  c.eval();
  a.eval();
  autograd::NoGradGuard ng;
  CHECK(nn::cross_entropy(a(idx), tgt).item() ==
        Approx(nn::cross_entropy(c(idx), tgt).item()).epsilon(1e-5));
}

TEST_CASE("the blocks' fused residual step gives the unfused ops' bits (GPT-2 and Llama, f32 and bf16)",
          "[nn][add_norm]") {
  // A hook on the second norm makes forward_add call the module on the sum:
  // add, then the norm, as the blocks did before the fusion.
  for (bool llama : {false, true})
    for (DType dtype : {DType::F32, DType::BF16}) {
      INFO((llama ? "Llama " : "GPT-2 ") << dtype_name(dtype));
      nn::TransformerConfig cfg = tiny_cfg();
      cfg.n_embd = 24;
      cfg.n_head = 4;
      cfg.n_layer = 3;
      if (llama) {
        cfg.n_kv_head = 2;
        cfg.ffn_hidden = 20;
      }
      auto make = [&]() -> std::unique_ptr<nn::LanguageModel> {
        if (llama) return std::make_unique<nn::Llama>(cfg);
        return std::make_unique<nn::GPT>(cfg);
      };
      auto fused = make(), unfused = make();
      fused->init_weights(21);
      unfused->load_state_dict(fused->state_dict());
      fused->to(dtype);
      unfused->to(dtype);
      int hooked = 0;
      for (auto& blk : unfused->blocks) {
        nn::Module& norm = *blk->child(llama ? "post_attention_layernorm" : "ln_2");
        norm.register_forward_hook([&](nn::Module&, const TensorList&, TensorList&) { ++hooked; });
      }
      Tensor idx = randint({2, 11}, 0, cfg.vocab_size, 22), tgt = randint({2, 11}, 0, cfg.vocab_size, 23);
      profiler::reset();
      profiler::enable(true);
      Tensor lf = nn::cross_entropy((*fused)(idx), tgt);
      autograd::backward(lf);
      bool fused_ran = false;
      for (const auto& e : profiler::summary()) fused_ran = fused_ran || e.name == (llama ? "add_rms_norm" : "add_layer_norm");
      profiler::enable(false);
      Tensor lu = nn::cross_entropy((*unfused)(idx), tgt);
      autograd::backward(lu);
      CHECK(fused_ran);
      CHECK(hooked == cfg.n_layer);
      CHECK(testing::equal(lf, lu));
      auto gf = grads_of(*fused), gu = grads_of(*unfused);
      REQUIRE(gf.size() == gu.size());
      for (size_t i = 0; i < gf.size(); ++i) {
        INFO(gf[i].first);
        CHECK(testing::equal(gf[i].second, gu[i].second));
      }
    }
}

TEST_CASE("a tiny GPT learns a repeating sequence", "[nn][gpt][train]") {
  auto cfg = tiny_cfg();
  cfg.n_embd = 16;
  nn::GPT m(cfg);
  m.init_weights(11);
  // Period-5 pattern: perfectly predictable after the first tokens.
  std::vector<int64_t> seq;
  for (int i = 0; i < 4 * 17; ++i) seq.push_back((i * 3) % 5);
  Tensor data = from_vector(seq, {4, 17});
  Tensor x = ops::contiguous(ops::narrow(data, 1, 0, 16)), y = ops::contiguous(ops::narrow(data, 1, 1, 16));
  optim::AdamW opt(m.parameters(), {.lr = 1e-2, .weight_decay = 0.0});
  double first = 0, last = 0;
  for (int step = 0; step < 60; ++step) {
    Tensor loss = nn::cross_entropy(m(x), y);
    if (step == 0) first = loss.item();
    last = loss.item();
    autograd::backward(loss);
    opt.step();
    opt.zero_grad();
  }
  CHECK(first > 2.0);
  CHECK(last < 0.1);
}

TEST_CASE("mse_loss: value and gradient against f64 references; shape and dtype errors", "[models][loss]") {
  for (int64_t n : {1, 3, 17, 257}) {
    INFO("n=" << n);
    Tensor a = randn({n, 3}, 5, DType::F64), b = randn({n, 3}, 6, DType::F64);
    a.set_requires_grad(true);
    Tensor loss = nn::mse_loss(a, b);
    auto va = a.to_vector<double>(), vb = b.to_vector<double>();
    double expect = 0;
    for (size_t i = 0; i < va.size(); ++i) expect += (va[i] - vb[i]) * (va[i] - vb[i]);
    expect /= static_cast<double>(va.size());
    CHECK(loss.item() == Approx(expect).epsilon(1e-14));
    autograd::backward(loss);
    auto g = a.grad().to_vector<double>();
    for (size_t i = 0; i < g.size(); ++i)
      CHECK(g[i] == Approx(2.0 * (va[i] - vb[i]) / static_cast<double>(va.size())).epsilon(1e-12));
  }
  CHECK_THROWS_WITH(nn::mse_loss(zeros({2, 3}), zeros({3, 2})), Catch::Contains("target [3, 2] does not match input [2, 3]"));
  CHECK_THROWS_WITH(nn::mse_loss(zeros({2}), zeros({2}, DType::F64)), Catch::Contains("target is f64 but input is f32"));
}
