// The mixture-of-experts layer (nn/moe.h) on one process, against a
// reference written token by token in f64 from plain ops (its own scores,
// its own top-k on the host, one SwiGLU per chosen expert per token): the
// output and every gradient to 1e-12, with both routers, with and without
// renormalised weights and shared experts, an expert that receives no token,
// the auxiliary loss's value and gradient, the bias that changes the choice
// only, DeepSeek's bias update, an MoE Llama's parameter count and finite
// differences, and configurations refused by name.

#include <algorithm>
#include <cmath>
#include <numeric>

#include "autograd/gradcheck.h"
#include "nn/models.h"
#include "nn/moe.h"
#include "tests/helpers.h"
#include "train/step.h"

using namespace tessera;

namespace {

nn::TransformerConfig moe_config(int64_t experts, int64_t top_k, const std::string& router = "softmax") {
  nn::TransformerConfig c;
  c.arch = "llama";
  c.vocab_size = 23;
  c.block_size = 16;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 8;
  c.ffn_hidden = 10;
  c.moe_experts = experts;
  c.moe_top_k = top_k;
  c.moe_hidden = 7;
  c.moe_router = router;
  c.tie_embeddings = false;
  return c;
}

Tensor leaf(const Tensor& t) {
  Tensor l = ops::clone(t);
  l.set_requires_grad(true);
  return l;
}

std::shared_ptr<nn::MoE> make_moe(const nn::TransformerConfig& cfg, uint64_t seed) {
  auto moe = std::make_shared<nn::MoE>(cfg, Device::cpu());
  moe->init_weights(seed);
  moe->to(DType::F64);
  return moe;
}

// The reference: the layer's weights copied into leaves, every token routed
// and computed on its own.
struct Reference {
  Tensor gate, w1, w2, w3, sg, su, sd;  // sg/su/sd: the shared experts' (if any)
  Tensor out, aux;
  std::vector<int64_t> counts;
};

Reference reference(const nn::MoE& moe, const Tensor& x, const std::vector<double>& bias, double aux_coeff) {
  Reference r;
  r.gate = leaf(moe.gate->weight);
  r.w1 = leaf(moe.experts->w1), r.w2 = leaf(moe.experts->w2), r.w3 = leaf(moe.experts->w3);
  if (moe.shared_experts) {
    r.sg = leaf(moe.shared_experts->gate_proj->weight);
    r.su = leaf(moe.shared_experts->up_proj->weight);
    r.sd = leaf(moe.shared_experts->down_proj->weight);
  }
  const int64_t E = moe.num_experts, k = moe.top_k, C = x.size(-1);
  Tensor flat = reshape(x, {-1, C});
  const int64_t N = flat.size(0);
  r.counts.assign(static_cast<size_t>(E), 0);
  std::vector<Tensor> rows, probs;
  for (int64_t n = 0; n < N; ++n) {
    Tensor xn = reshape(select(flat, 0, n), {1, C});
    Tensor logits = matmul(xn, transpose(r.gate, 0, 1));  // [1, E]
    Tensor s = moe.sigmoid ? sigmoid(logits) : softmax(logits, -1);
    std::vector<double> sv = s.to_vector<double>();
    std::vector<int64_t> order(static_cast<size_t>(E));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return sv[static_cast<size_t>(a)] + bias[static_cast<size_t>(a)] >
             sv[static_cast<size_t>(b)] + bias[static_cast<size_t>(b)];
    });
    std::vector<Tensor> chosen;
    for (int64_t j = 0; j < k; ++j) chosen.push_back(select(s, 1, order[static_cast<size_t>(j)]));
    Tensor denom = chosen[0];
    for (int64_t j = 1; j < k; ++j) denom = denom + chosen[static_cast<size_t>(j)];
    Tensor y;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = order[static_cast<size_t>(j)];
      ++r.counts[static_cast<size_t>(e)];
      Tensor g = matmul(xn, transpose(select(r.w1, 0, e), 0, 1));
      Tensor u = matmul(xn, transpose(select(r.w3, 0, e), 0, 1));
      Tensor h = silu(g) * u;
      Tensor out = matmul(h, transpose(select(r.w2, 0, e), 0, 1));
      Tensor w = moe.norm_topk ? chosen[static_cast<size_t>(j)] / denom : chosen[static_cast<size_t>(j)];
      Tensor term = out * reshape(w, {1, 1});
      y = y.defined() ? y + term : term;
    }
    if (moe.shared_experts) {
      Tensor h = silu(matmul(xn, transpose(r.sg, 0, 1))) * matmul(xn, transpose(r.su, 0, 1));
      y = y + matmul(h, transpose(r.sd, 0, 1));
    }
    rows.push_back(y);
    probs.push_back(moe.sigmoid ? s / sum(s) : s);
  }
  r.out = reshape(cat(rows, 0), x.shape());
  // aux = coeff x sum_e (E / (k N) x count_e) x mean_n p_ne
  Tensor P = mean(cat(probs, 0), {0});
  std::vector<double> f;
  for (int64_t c : r.counts) f.push_back(static_cast<double>(E * c) / static_cast<double>(k * N));
  r.aux = sum(P * from_vector(f, {E})) * aux_coeff;
  return r;
}

double rel(const Tensor& got, const Tensor& want) {
  const double scale = std::max(1e-30, ops::max(ops::unary(ops::UnaryOp::Abs, want)).item());
  return testing::max_abs_diff(got, want) / scale;
}

// The layer and the reference on the same x; the loss sum(out * R) (+ aux).
void check_against_reference(nn::MoE& moe, const Tensor& x_in, const std::vector<double>& bias = {}) {
  const int64_t E = moe.num_experts;
  std::vector<double> b = bias.empty() ? std::vector<double>(static_cast<size_t>(E), 0.0) : bias;
  Tensor x = leaf(x_in);
  Tensor R = randn(x.shape(), 99, DType::F64);
  Tensor out = moe(x);
  Tensor loss = sum(out * R);
  Tensor aux = moe.take_aux_loss();
  if (aux.defined()) loss = loss + aux;
  autograd::backward(loss);

  Tensor xr = leaf(x_in);
  Reference ref = reference(moe, xr, b, moe.balance_coeff);
  Tensor ref_loss = sum(ref.out * R);
  if (moe.balance == "aux_loss") ref_loss = ref_loss + ref.aux;
  autograd::backward(ref_loss);

  CHECK(rel(out, ref.out) <= 1e-12);
  if (aux.defined()) CHECK(std::abs(aux.item() - ref.aux.item()) <= 1e-12 * std::abs(ref.aux.item()));
  CHECK(moe.routed() == ref.counts);
  CHECK(rel(x.grad(), xr.grad()) <= 1e-12);
  CHECK(rel(moe.gate->weight.grad(), ref.gate.grad()) <= 1e-12);
  CHECK(rel(moe.experts->w1.grad(), ref.w1.grad()) <= 1e-12);
  CHECK(rel(moe.experts->w2.grad(), ref.w2.grad()) <= 1e-12);
  CHECK(rel(moe.experts->w3.grad(), ref.w3.grad()) <= 1e-12);
  if (moe.shared_experts) {
    CHECK(rel(moe.shared_experts->gate_proj->weight.grad(), ref.sg.grad()) <= 1e-12);
    CHECK(rel(moe.shared_experts->down_proj->weight.grad(), ref.sd.grad()) <= 1e-12);
  }
}

}  // namespace

TEST_CASE("moe: routed experts equal a token-by-token f64 reference, output and gradients", "[moe]") {
  for (const char* router : {"softmax", "sigmoid"})
    for (bool norm : {true, false})
      for (int64_t shared : {0, 1}) {
        if (std::string(router) == "sigmoid" && !norm) continue;  // sigmoid always renormalises
        INFO(router << " norm_topk " << norm << " shared " << shared);
        auto cfg = moe_config(5, 2, router);
        cfg.moe_norm_topk = norm;
        cfg.moe_shared_experts = shared;
        cfg.moe_balance = "aux_loss";
        auto moe = make_moe(cfg, 11);
        check_against_reference(*moe, randn({3, 5, 8}, 21, DType::F64));
      }
}

TEST_CASE("moe: an expert that receives no token gets a zero gradient, defined", "[moe]") {
  auto cfg = moe_config(8, 1);
  cfg.moe_balance = "none";
  auto moe = make_moe(cfg, 5);
  Tensor x = randn({1, 3, 8}, 8, DType::F64);
  check_against_reference(*moe, x);
  const auto& routed = moe->routed();
  const auto idle = std::find(routed.begin(), routed.end(), 0);
  REQUIRE(idle != routed.end());  // 3 tokens, 8 experts: 5 at least are idle
  const int64_t e = idle - routed.begin();
  REQUIRE(moe->experts->w1.grad().defined());
  CHECK(ops::max(ops::unary(ops::UnaryOp::Abs, select(moe->experts->w1.grad(), 0, e))).item() == 0.0);
  CHECK(ops::max(ops::unary(ops::UnaryOp::Abs, select(moe->experts->w2.grad(), 0, e))).item() == 0.0);
}

TEST_CASE("moe: the expert bias changes the choice, never the weights", "[moe]") {
  auto cfg = moe_config(4, 2, "sigmoid");
  cfg.moe_balance = "bias";
  auto moe = make_moe(cfg, 3);
  // A large bias on expert 3 puts it first for every token, whatever its score.
  std::vector<double> bias = {0.0, -0.25, 0.1, 5.0};
  ops::copy_(moe->expert_bias, ops::to(from_vector(bias, {4}), DType::F32));
  std::vector<double> as_stored = moe->expert_bias.to_vector<double>();  // f32-rounded
  check_against_reference(*moe, randn({2, 7, 8}, 4, DType::F64), as_stored);
  CHECK(moe->routed()[3] == 14);
}

TEST_CASE("moe: bias balancing moves each bias by coeff * sign(mean - load), mean removed", "[moe]") {
  auto cfg = moe_config(5, 2, "sigmoid");
  cfg.moe_balance = "bias";
  cfg.moe_balance_coeff = 0.125;  // exact in f32
  auto moe = make_moe(cfg, 9);
  Tensor x = leaf(randn({4, 3, 8}, 10, DType::F64));
  moe->train();
  sum((*moe)(x)).item();
  const std::vector<int64_t> loads = moe->routed();
  REQUIRE(std::accumulate(loads.begin(), loads.end(), int64_t{0}) == 24);
  nn::RoutingStats stats = moe->update_bias();
  CHECK(stats.tokens_per_expert == loads);
  CHECK(moe->routed() == std::vector<int64_t>(5, 0));
  std::vector<double> want(5);
  const double mean_load = 24.0 / 5;
  for (int e = 0; e < 5; ++e) {
    const double d = mean_load - static_cast<double>(loads[static_cast<size_t>(e)]);
    want[static_cast<size_t>(e)] = 0.125 * ((d > 0) - (d < 0));
  }
  const double m = std::accumulate(want.begin(), want.end(), 0.0) / 5;
  const std::vector<double> got = moe->expert_bias.to_vector<double>();
  for (int e = 0; e < 5; ++e) CHECK(got[static_cast<size_t>(e)] == Approx(want[static_cast<size_t>(e)] - m).margin(1e-7));
  CHECK(stats.max_over_mean() == Approx(static_cast<double>(*std::max_element(loads.begin(), loads.end())) / mean_load));
}

TEST_CASE("moe: an MoE Llama counts its parameters and matches finite differences", "[moe]") {
  auto cfg = moe_config(3, 2);
  cfg.n_layer = 3;
  cfg.moe_every = 2;  // layer 1 only
  cfg.moe_shared_experts = 1;
  auto model = nn::make_model(cfg);
  int64_t numel = 0;
  for (auto& [name, p] : model->named_parameters()) numel += p.numel();
  CHECK(numel == cfg.parameter_count());
  auto names = model->named_parameters();
  auto has = [&](const std::string& n) {
    return std::any_of(names.begin(), names.end(), [&](const auto& kv) { return kv.first == n; });
  };
  CHECK(has("model.layers.0.mlp.gate_proj.weight"));
  CHECK(has("model.layers.1.block_sparse_moe.gate.weight"));
  CHECK(has("model.layers.1.block_sparse_moe.experts.w1"));
  CHECK(has("model.layers.1.block_sparse_moe.shared_experts.down_proj.weight"));
  CHECK(!has("model.layers.1.mlp.gate_proj.weight"));
  CHECK(nn::moe_layers(*model).size() == 1);

  // The loss by backward against central differences on a few weights (the
  // balance loss is a training forward's: its gradient is checked above).
  for (nn::MoE* m : nn::moe_layers(*model)) m->balance = "none";
  model->to(DType::F64);
  Tensor idx = randint({2, 5}, 0, cfg.vocab_size, 17), tgt = randint({2, 5}, 0, cfg.vocab_size, 18);
  auto loss_of = [&]() {
    Tensor l = nn::cross_entropy((*model)(idx), tgt);
    Tensor aux = nn::take_aux_losses(*model);
    return aux.defined() ? l + aux : l;
  };
  model->zero_grad();
  autograd::backward(loss_of());
  for (const char* name : {"model.layers.1.block_sparse_moe.gate.weight", "model.layers.1.block_sparse_moe.experts.w2",
                           "model.layers.1.block_sparse_moe.experts.w1"}) {
    INFO(name);
    Tensor p;
    for (auto& [n, t] : model->named_parameters())
      if (n == name) p = t;
    REQUIRE(p.defined());
    const std::vector<double> g = p.grad().to_vector<double>();
    for (int64_t i : {int64_t{0}, p.numel() / 2, p.numel() - 1}) {
      auto* v = static_cast<double*>(p.data_ptr()) + i;
      const double keep = *v, eps = 1e-6;
      double up, down;
      {
        autograd::NoGradGuard ng;
        *v = keep + eps;
        up = loss_of().item();
        *v = keep - eps;
        down = loss_of().item();
        *v = keep;
      }
      CHECK(std::abs((up - down) / (2 * eps) - g[static_cast<size_t>(i)]) <= 1e-7);
    }
  }
}

TEST_CASE("moe: bad configurations are refused naming the field", "[moe]") {
  auto refused = [](nn::TransformerConfig c, const std::string& needle) {
    INFO(needle);
    try {
      c.validate();
      FAIL("accepted");
    } catch (const std::exception& e) {
      CHECK(std::string(e.what()).find(needle) != std::string::npos);
    }
  };
  auto c = moe_config(4, 5);
  refused(c, "moe_top_k");
  c = moe_config(4, 2, "tanh");
  refused(c, "moe_router");
  c = moe_config(4, 2);
  c.moe_balance = "loss";
  refused(c, "moe_balance");
  c = moe_config(4, 2);
  c.arch = "gpt2";
  c.n_kv_head = 0;
  refused(c, "moe_experts");
  c = moe_config(4, 2);
  c.moe_every = 3;  // 2 layers
  refused(c, "moe_every");
  c = moe_config(4, 2);
  c.activation_checkpoint = true;
  refused(c, "activation_checkpoint");
  c = moe_config(-1, 2);
  refused(c, "moe_experts");
}
