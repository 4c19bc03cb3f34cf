#include "nn/moe.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "dtensor/dtensor.h"
#include "nn/layers.h"

namespace tessera::nn {

namespace {
Tensor local_of(const Tensor& t) { return is_dtensor(t) ? to_local(t) : t; }

// The dtype routing runs in: f32 at least, f64 for f64 models.
DType route_dtype(DType dt) { return dt == DType::F64 ? DType::F64 : DType::F32; }

Tensor indices(const std::vector<int64_t>& v, Device device) {
  return from_vector(v, {static_cast<int64_t>(v.size())}, device);
}
}  // namespace

double RoutingStats::max_over_mean() const {
  if (tokens_per_expert.empty()) return 1.0;
  const double total = std::accumulate(tokens_per_expert.begin(), tokens_per_expert.end(), 0.0);
  if (total == 0) return 1.0;
  const double most = static_cast<double>(*std::max_element(tokens_per_expert.begin(), tokens_per_expert.end()));
  return most / (total / static_cast<double>(tokens_per_expert.size()));
}

// ---- GroupedExperts -------------------------------------------------------------------

GroupedExperts::GroupedExperts(int64_t e, int64_t c, int64_t h, double down, Device device)
    : num_experts(e),
      dim(c),
      hidden(h),
      down_std(down),
      w1(register_parameter("w1", empty({e, h, c}, DType::F32, device))),
      w2(register_parameter("w2", empty({e, c, h}, DType::F32, device))),
      w3(register_parameter("w3", empty({e, h, c}, DType::F32, device))) {
  if (!device.is_meta()) {
    autograd::NoGradGuard no_grad;
    reset_parameters(0, "");
  }
}

void GroupedExperts::reset_parameters(uint64_t seed, const std::string& prefix) {
  // Each expert as Linear layers would be: N(0, 0.02), the down projection
  // at the residual std. A sharded tensor draws its elements of the whole.
  init_normal(w1, 0.0, 0.02, seed, prefix + "w1");
  init_normal(w2, 0.0, down_std, seed, prefix + "w2");
  init_normal(w3, 0.0, 0.02, seed, prefix + "w3");
}

Tensor GroupedExperts::run(const Tensor& x, const std::vector<int64_t>& counts) {
  const Tensor W1 = local_of(w1), W2 = local_of(w2), W3 = local_of(w3);
  const int64_t held = W1.size(0);
  TS_CHECK(static_cast<int64_t>(counts.size()) == held, "GroupedExperts: {} runs for the {} experts held here",
           counts.size(), held);
  const int64_t rows = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  TS_CHECK(x.dim() == 2 && x.size(0) == rows && x.size(1) == dim,
           "GroupedExperts: expected rows [{}, {}] (the runs' sum x the model width), got {}", rows, dim,
           shape_str(x.shape()));
  // One view per expert (one op: its backward is one cat, not E full-size gradients).
  auto g = split(W1, 1, 0), d = split(W2, 1, 0), u = split(W3, 1, 0);
  std::vector<Tensor> outs;
  int64_t at = 0;
  for (int64_t e = 0; e < held; ++e) {
    const int64_t n = counts[static_cast<size_t>(e)];
    // An expert with no rows still runs on its empty run when no expert has
    // any, so that every expert weight gets a (zero) gradient on every rank.
    if (n == 0 && !(rows == 0 && e == 0)) continue;
    Tensor xe = narrow(x, 0, at, n);
    auto w = [](const Tensor& s) { return squeeze(s, 0); };
    Tensor h = swiglu(linear(xe, w(g[static_cast<size_t>(e)])), linear(xe, w(u[static_cast<size_t>(e)])));
    outs.push_back(linear(h, w(d[static_cast<size_t>(e)])));
    at += n;
  }
  return outs.size() == 1 ? outs[0] : cat(outs, 0);
}

// ---- MoE ------------------------------------------------------------------------------------

MoE::MoE(const TransformerConfig& cfg, Device device)
    : num_experts(cfg.moe_experts),
      top_k(cfg.moe_top_k),
      sigmoid(cfg.moe_router == "sigmoid"),
      norm_topk(cfg.moe_norm_topk || cfg.moe_router == "sigmoid"),
      balance(cfg.moe_balance),
      balance_coeff(cfg.moe_balance_coefficient()),
      expert_bias(register_buffer("expert_bias", zeros({cfg.moe_experts}, DType::F32, device))) {
  TS_CHECK(cfg.moe_experts >= 1, "MoE: moe_experts must be >= 1, got {}", cfg.moe_experts);
  const int64_t width = cfg.moe_width();
  gate = register_module("gate", std::make_shared<Linear>(cfg.n_embd, num_experts, false, device));
  experts = register_module("experts",
                            std::make_shared<GroupedExperts>(num_experts, cfg.n_embd, width, cfg.residual_std(), device));
  if (cfg.moe_shared_experts > 0) {
    TransformerConfig shared = cfg;
    shared.ffn_hidden = width * cfg.moe_shared_experts;
    shared_experts = register_module("shared_experts", std::make_shared<SwiGLUMLP>(shared, device));
  }
  routed_.assign(static_cast<size_t>(num_experts), 0);
}

Tensor MoE::forward(const Tensor& x) {
  const Shape shape = x.shape();
  const int64_t C = x.size(-1), E = num_experts, k = top_k;
  Tensor flat = reshape(x, {-1, C});
  const int64_t N = flat.size(0);
  const DType rdt = route_dtype(x.dtype());
  const Device device = x.device();

  // Route: scores in f32 at least, the choice on the host.
  Tensor logits = linear(tessera::to(flat, rdt), tessera::to(gate->weight, rdt));
  Tensor scores = sigmoid ? tessera::sigmoid(logits) : softmax(logits, -1);  // [N, E]
  std::vector<int64_t> choice(static_cast<size_t>(N * k)), order(static_cast<size_t>(E));
  if (device.is_meta()) {
    // A plan (tools/plan.h) has no scores to read: the tokens go round the
    // experts, every one receiving its even share (the balanced load).
    for (int64_t p = 0; p < N * k; ++p) choice[static_cast<size_t>(p)] = p % E;
  }
  const std::vector<double> s = device.is_meta() ? std::vector<double>() : scores.to_vector<double>();
  std::vector<double> bias(static_cast<size_t>(E), 0.0);
  if (balance == "bias" && !device.is_meta()) bias = expert_bias.to_vector<double>();
  for (int64_t n = 0; n < N && !device.is_meta(); ++n) {
    std::iota(order.begin(), order.end(), int64_t{0});
    auto key = [&](int64_t e) { return s[static_cast<size_t>(n * E + e)] + bias[static_cast<size_t>(e)]; };
    // The k largest; a tie goes to the lower expert index.
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int64_t a, int64_t b) { return key(a) > key(b) || (key(a) == key(b) && a < b); });
    std::copy(order.begin(), order.begin() + k, choice.begin() + n * k);
  }

  // Dispatch: the (token, choice) pairs sorted by expert, pair order kept
  // within an expert; slot[p] is pair p's row among the sorted ones.
  std::vector<int64_t> counts(static_cast<size_t>(E), 0), start(static_cast<size_t>(E), 0);
  for (int64_t e : choice) ++counts[static_cast<size_t>(e)];
  std::exclusive_scan(counts.begin(), counts.end(), start.begin(), int64_t{0});
  std::vector<int64_t> token_of_row(choice.size()), slot(choice.size()), picked(choice.size());
  for (int64_t p = 0; p < N * k; ++p) {
    const int64_t e = choice[static_cast<size_t>(p)];
    const int64_t row = start[static_cast<size_t>(e)]++;
    token_of_row[static_cast<size_t>(row)] = p / k;
    slot[static_cast<size_t>(p)] = row;
    picked[static_cast<size_t>(p)] = (p / k) * E + e;
  }

  // The chosen scores (differentiable), renormalised to sum to 1 per token.
  Tensor w = reshape(embedding(reshape(scores, {N * E, 1}), indices(picked, device)), {N, k});
  if (norm_topk) w = w / sum(w, {1}, true);

  Tensor rows = embedding(flat, indices(token_of_row, device));  // [N k, C], by expert
  // Through the experts module's hooks (FSDP gathers their weights there).
  auto local = [this](const Tensor& xs, const std::vector<int64_t>& c) {
    return experts->call_with_hooks({xs}, [&](const TensorList& in) { return TensorList{experts->run(in[0], c)}; })[0];
  };
  Tensor outs = placement ? placement->run(rows, counts, local) : local(rows, counts);
  // Combine: each pair's output weighed by its router weight, in the routing dtype.
  Tensor per_pair = reshape(tessera::to(embedding(outs, indices(slot, device)), rdt), {N, k, C});
  Tensor y = tessera::to(sum(per_pair * unsqueeze(w, 2), {1}), x.dtype());
  if (shared_experts) y = y + (*shared_experts)(flat);

  if (is_training() && autograd::is_grad_enabled()) {
    for (int64_t e = 0; e < E; ++e) routed_[static_cast<size_t>(e)] += counts[static_cast<size_t>(e)];
    if (balance == "aux_loss") {
      // Switch/DeepSeek: coeff x sum_e f_e P_e, f_e = E / (k N) x pairs routed
      // to e and P_e the mean probability of e, over the whole batch: the
      // counts are summed over batch_group (the mean of the ranks' losses is
      // then the batch's loss); P_e is this rank's, averaged by that mean.
      std::vector<double> load(counts.begin(), counts.end());
      load.push_back(static_cast<double>(N));
      if (batch_group && batch_group->size() > 1) {
        Tensor t = from_vector(load, {E + 1}, Device::cpu());
        batch_group->all_reduce(t)->wait();
        load = t.to_vector<double>();
      }
      const double total = load[static_cast<size_t>(E)];
      std::vector<double> f(static_cast<size_t>(E));
      for (int64_t e = 0; e < E; ++e)
        f[static_cast<size_t>(e)] = total > 0 ? static_cast<double>(E) * load[static_cast<size_t>(e)] / (k * total) : 0;
      Tensor probs = sigmoid ? scores / sum(scores, {1}, true) : scores;
      Tensor P = mean(probs, {0});
      aux_loss_ = sum(P * ops::to(from_vector(f, {E}, device), rdt)) * balance_coeff;
    }
  }
  return reshape(y, shape);
}

void MoE::reset_parameters(uint64_t, const std::string&) {
  // The children initialise their weights; the selection offsets start at 0.
  ops::zero_(expert_bias);
}

Tensor MoE::take_aux_loss() {
  Tensor a = aux_loss_;
  aux_loss_ = Tensor();
  return a;
}

void MoE::reset_routing_stats() { std::fill(routed_.begin(), routed_.end(), 0); }

RoutingStats MoE::update_bias() {
  const int64_t E = num_experts;
  std::vector<double> load(routed_.begin(), routed_.end());
  if (batch_group && batch_group->size() > 1) {
    Tensor t = from_vector(load, {E}, Device::cpu());
    batch_group->all_reduce(t)->wait();
    load = t.to_vector<double>();
  }
  reset_routing_stats();
  RoutingStats stats;
  for (double l : load) stats.tokens_per_expert.push_back(static_cast<int64_t>(std::llround(l)));
  if (balance != "bias") return stats;
  // DeepSeek-V3's auxiliary-loss-free balancing: experts above the mean load
  // lose coeff of bias, those below gain it; the update's mean is removed.
  const double mean_load = std::accumulate(load.begin(), load.end(), 0.0) / static_cast<double>(E);
  std::vector<double> delta(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    const double d = mean_load - load[static_cast<size_t>(e)];
    delta[static_cast<size_t>(e)] = balance_coeff * static_cast<double>((d > 0) - (d < 0));
  }
  const double mean_delta = std::accumulate(delta.begin(), delta.end(), 0.0) / static_cast<double>(E);
  if (expert_bias.is_meta()) return stats;
  std::vector<double> b = expert_bias.to_vector<double>();
  for (int64_t e = 0; e < E; ++e) b[static_cast<size_t>(e)] += delta[static_cast<size_t>(e)] - mean_delta;
  autograd::NoGradGuard no_grad;
  ops::copy_(expert_bias, ops::to(from_vector(b, {E}, expert_bias.device()), expert_bias.dtype()));
  return stats;
}

std::vector<MoE*> moe_layers(Module& model) {
  std::vector<MoE*> out;
  for (auto& [name, m] : model.named_modules())
    if (auto* moe = dynamic_cast<MoE*>(m)) out.push_back(moe);
  return out;
}

Tensor take_aux_losses(Module& model) {
  Tensor total;
  for (MoE* m : moe_layers(model)) {
    Tensor a = m->take_aux_loss();
    if (a.defined()) total = total.defined() ? total + a : a;
  }
  return total;
}

std::vector<RoutingStats> update_expert_biases(Module& model) {
  std::vector<RoutingStats> out;
  for (MoE* m : moe_layers(model)) out.push_back(m->update_bias());
  return out;
}

}  // namespace tessera::nn
