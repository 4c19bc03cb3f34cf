// An MoE Llama under expert parallelism (train::parallelize with
// ParallelismOptions::ep) against one process, under mpirun with 1-4 ranks:
// the loss, every gradient, the clipped norm and the parameters after 3 AdamW
// steps equal the same model trained on one process on the whole batch, in
// f64 to 1e-12, with both routers and both balancing methods (the biases
// move between steps, from loads summed over the ranks), at EP 1, 2, 3 and 4
// (each rank's share of the experts), EP x FSDP, EP x HSDP and EP x TP (with
// and without sequence parallelism) at 4 ranks, TP 2 alone at 2 and 4; a
// step where experts receive no token; the all-to-alls per step are 5 per MoE
// layer (none at EP 1); the variable all-to-all's backward; bad degrees
// refused by name.

#include <cmath>
#include <map>

#include "dtensor/dtensor.h"
#include "fsdp/checkpoint.h"
#include "ep/expert_parallel.h"
#include "nn/models.h"
#include "tests/fsdp/fsdp_helpers.h"
#include "tests/helpers.h"
#include "train/optimizer.h"
#include "train/parallelize.h"
#include "train/step.h"

using namespace tessera;
using testing::equal;
using testing::world;

namespace {

nn::TransformerConfig config(int64_t experts, int64_t top_k, const std::string& router, const std::string& balance) {
  nn::TransformerConfig c;
  c.arch = "llama";
  c.vocab_size = 29;
  c.block_size = 16;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_kv_head = 2;
  c.n_embd = 16;
  c.ffn_hidden = 24;
  c.tie_embeddings = false;
  c.moe_experts = experts;
  c.moe_top_k = top_k;
  c.moe_hidden = 12;
  c.moe_router = router;
  c.moe_balance = balance;
  c.moe_balance_coeff = balance == "bias" ? 0.05 : 0.02;
  return c;
}

struct Run {
  std::vector<double> losses, norms;
  std::map<std::string, Tensor> grads;   // after the first backward, whole
  std::map<std::string, Tensor> params;  // after the last step, whole
  std::vector<std::vector<nn::RoutingStats>> routing;  // per step, per MoE layer
  std::vector<int64_t> all_to_alls;  // per step, on the expert-parallel group
};

using Batches = std::vector<std::pair<Tensor, Tensor>>;

Batches data(int64_t rows, int64_t seq, int64_t vocab, int steps) {
  Batches out;
  for (int k = 0; k < steps; ++k)
    out.push_back({randint({rows, seq}, 0, vocab, 500 + 2 * static_cast<uint64_t>(k)),
                   randint({rows, seq}, 0, vocab, 501 + 2 * static_cast<uint64_t>(k))});
  return out;
}

Tensor whole(const Tensor& t) { return is_dtensor(t) ? full_tensor(t) : t; }

dist::ProcessGroupPtr ep_group(nn::Module& model) {
  for (nn::MoE* m : nn::moe_layers(model))
    if (auto* e = dynamic_cast<ep::ExpertParallel*>(m->placement.get())) return e->group();
  return nullptr;
}

Run train(nn::LanguageModel& model, const Batches& batches, const std::function<Tensor(const Tensor&)>& rows,
          const dist::ProcessGroupPtr& loss_group) {
  // AdamW's eps at 1e-6: an update g / (|g| + eps) turns a last-bit
  // difference of a gradient element near eps (the ranks sum in another
  // order at 3 ranks) into one up to 1 / (4 eps) times larger; at 1e-8 that
  // reaches 3e-12 of the parameters after 3 steps, at 1e-6 it stays below 1e-12.
  auto opt = train::make_optimizer(model, {.lr = 3e-2, .eps = 1e-6});
  Run r;
  const dist::ProcessGroupPtr group = ep_group(model);
  for (size_t k = 0; k < batches.size(); ++k) {
    const int64_t a2a_before = (group ? group : dist::world())->stats().all_to_all;
    Tensor loss = train::forward_backward(model, 1, [&](int64_t) {
      return std::pair{rows(batches[k].first), rows(batches[k].second)};
    });
    r.all_to_alls.push_back((group ? group : dist::world())->stats().all_to_all - a2a_before);
    loss = ops::reshape(ops::clone(loss), {1});
    if (loss_group && loss_group->size() > 1) loss_group->all_reduce(loss, {dist::ReduceOp::Avg})->wait();
    r.losses.push_back(loss.item());
    if (k == 0)
      for (auto& [name, p] : model.named_parameters()) r.grads[name] = ops::clone(whole(p.grad()));
    r.norms.push_back(nn::clip_grad_norm_(model.parameters(), 0.5).item());
    opt->step();
    opt->zero_grad();
    r.routing.push_back(nn::update_expert_biases(model));
  }
  for (auto& [name, p] : model.named_parameters()) r.params[name] = ops::clone(whole(p));
  return r;
}

Run reference(const nn::TransformerConfig& cfg, const Batches& batches) {
  auto model = nn::make_model(cfg, Device::meta());
  model->to_empty(Device::cpu());
  model->init_weights(7);
  model->to(DType::F64);
  return train(*model, batches, [](const Tensor& t) { return t; }, nullptr);
}

// A model under the layout `o` in f64 and this rank's rows of a batch.
struct Parallel {
  std::shared_ptr<nn::LanguageModel> model;
  std::function<Tensor(const Tensor&)> rows;
};

Parallel build(const nn::TransformerConfig& cfg, train::ParallelismOptions o, uint64_t seed = 7) {
  o.param_dtype = o.reduce_dtype = DType::F64;
  MeshPtr mesh = train::make_mesh(o);
  auto model = nn::make_model(cfg, Device::meta());
  train::parallelize(*model, mesh, o);
  model->to_empty(Device::cpu());
  model->init_weights(seed);
  model->to(DType::F64);
  int64_t dp = 1, dp_rank = 0;
  for (const std::string& n : mesh->dim_names())
    if (n == "dp_replicate" || n == "dp_shard")
      dp_rank = dp_rank * mesh->size(mesh->dim_index(n)) + mesh->get_local_rank(n), dp *= mesh->size(mesh->dim_index(n));
  return {model, [dp, dp_rank](const Tensor& t) {
            const int64_t rows = t.size(0) / dp;
            return ops::contiguous(ops::narrow(t, 0, dp_rank * rows, rows));
          }};
}

Run parallel(const nn::TransformerConfig& cfg, train::ParallelismOptions o, const Batches& batches) {
  Parallel p = build(cfg, o);
  return train(*p.model, batches, p.rows, dist::world());
}

double relative(const Tensor& got, const Tensor& want) {
  const double scale = std::max(1.0, ops::to(ops::max(ops::unary(ops::UnaryOp::Abs, want)), DType::F64).item());
  return testing::max_abs_diff(got, want) / scale;
}

void compare(const Run& want, const Run& got, double tol = 1e-12) {
  REQUIRE(got.losses.size() == want.losses.size());
  for (size_t k = 0; k < want.losses.size(); ++k) {
    INFO("step " << k);
    CHECK(std::abs(got.losses[k] - want.losses[k]) <= tol * std::abs(want.losses[k]));
    CHECK(std::abs(got.norms[k] - want.norms[k]) <= tol * std::abs(want.norms[k]));
    REQUIRE(got.routing[k].size() == want.routing[k].size());
    for (size_t l = 0; l < want.routing[k].size(); ++l)
      CHECK(got.routing[k][l].tokens_per_expert == want.routing[k][l].tokens_per_expert);
  }
  REQUIRE(got.grads.size() == want.grads.size());
  for (const auto& [name, g] : got.grads) {
    REQUIRE(want.grads.count(name) == 1);
    const double r = relative(g, want.grads.at(name));
    INFO("gradient of " << name << ": relative difference " << r);
    CHECK(r <= tol);
  }
  for (const auto& [name, p] : got.params) {
    const double r = relative(p, want.params.at(name));
    INFO("parameter " << name << ": relative difference " << r);
    CHECK(r <= tol);
  }
}

}  // namespace

TEST_CASE("an MoE Llama under expert parallelism equals one process", "[ep][exact]") {
  const int w = world();
  const int64_t experts = w == 3 ? 6 : 4;
  const Batches batches = data(2 * w, 5, 29, 3);
  for (const std::string router : {"softmax", "sigmoid"})
    for (const std::string balance : {"aux_loss", "bias"}) {
      auto cfg = config(experts, 2, router, balance);
      cfg.moe_shared_experts = router == "sigmoid" ? 1 : 0;  // DeepSeek's shape
      const Run want = reference(cfg, batches);
      for (int64_t ep : {int64_t{1}, int64_t{w}}) {
        INFO(router << " " << balance << " ep " << ep << " of " << w << " ranks, " << experts << " experts");
        const Run got = parallel(cfg, {.ep = ep}, batches);
        compare(want, got);
        // Per step and MoE layer: counts, dispatch, combine; their backwards.
        for (int64_t n : got.all_to_alls) CHECK(n == (ep > 1 ? 5 * 2 : 0));
      }
      if (w > 1 && w % 2 == 0 && w != 2) {
        INFO(router << " " << balance << " EP 2 x FSDP 2");
        compare(want, parallel(cfg, {.ep = 2}, batches));
      }
    }
}

TEST_CASE("experts that receive no token, HSDP around expert parallelism", "[ep][exact]") {
  const int w = world();
  // 8 experts, one per token, 2 tokens per rank: most experts idle in a step.
  auto cfg = config(8, 1, "softmax", "bias");
  const Batches batches = data(w, 2, 29, 3);
  const Run want = reference(cfg, batches);
  bool idle = false;
  for (const auto& step : want.routing)
    for (const auto& layer : step)
      for (int64_t n : layer.tokens_per_expert) idle = idle || n == 0;
  REQUIRE(idle);
  if (8 % w == 0) {
    INFO("ep " << w);
    compare(want, parallel(cfg, {.ep = w}, batches));
  }
  if (w == 4) {
    INFO("HSDP 2 x (FSDP 2 = EP 2)");
    compare(want, parallel(cfg, {.dp_replicate = 2, .dp_shard = 2, .ep = 2}, batches));
  }
}

TEST_CASE("all_to_all_rows sends gradients back the way the rows came", "[ep]") {
  const int w = world();
  auto group = dist::world();
  const int me = group->rank();
  std::vector<int64_t> send, recv;
  for (int p = 0; p < w; ++p) send.push_back((me + 2 * p) % 3), recv.push_back((p + 2 * me) % 3);
  int64_t n = 0, m = 0;
  for (int p = 0; p < w; ++p) n += send[static_cast<size_t>(p)], m += recv[static_cast<size_t>(p)];
  Tensor x = randn({n, 3}, 40 + static_cast<uint64_t>(me), DType::F64);
  x.set_requires_grad(true);
  Tensor y = ep::all_to_all_rows(x, group, send, recv);
  REQUIRE(y.size(0) == m);
  // d sum(y * y) / dx = 2x: each row's gradient came back to its sender.
  autograd::backward(sum(y * y));
  CHECK(testing::max_abs_diff(x.grad(), ops::mul(x, 2.0)) == 0.0);
}

TEST_CASE("expert-parallel degrees that do not fit are refused by name", "[ep]") {
  const int w = world();
  if (w < 2) return;
  auto refused = [](const std::function<void()>& f, const std::string& needle) {
    try {
      f();
      FAIL("accepted");
    } catch (const std::exception& e) {
      INFO(e.what());
      CHECK(std::string(e.what()).find(needle) != std::string::npos);
    }
  };
  // ep must divide the shard degree.
  refused([&] { train::mesh_dims({.ep = w + 1}, w); }, "ep (");
  // Experts must divide over the ranks: refused in parallelize, before any allocation.
  refused(
      [&] {
        auto cfg = config(w + 1, 1, "softmax", "none");
        train::ParallelismOptions o{.ep = w};
        MeshPtr mesh = train::make_mesh(o);
        auto model = nn::make_model(cfg, Device::meta());
        train::parallelize(*model, mesh, o);
      },
      "moe_experts (");
}

TEST_CASE("an MoE Llama under tensor parallelism, and EP x TP, equals one process", "[ep][tp][exact]") {
  // The MoE runs whole on every tensor-parallel rank (tp/parallelize.h); the
  // dense block beside it is split Megatron's way; expert parallelism moves
  // tokens between the data-parallel ranks of one tensor-parallel index.
  const int w = world();
  if (w % 2 != 0) return;  // tensor parallelism 2 needs an even world
  const Batches batches = data(w, 6, 29, 3);  // w / 2 data ranks, 2 sequences each
  for (const std::string router : {"softmax", "sigmoid"}) {
    const std::string balance = router == "softmax" ? "aux_loss" : "bias";
    auto cfg = config(4, 2, router, balance);
    cfg.moe_every = 2;  // block 0 dense (split over TP), block 1 MoE
    cfg.moe_shared_experts = router == "sigmoid" ? 1 : 0;
    const Run want = reference(cfg, batches);
    for (bool sp : {false, true}) {
      INFO(router << " " << balance << (sp ? ", sequence parallel" : ""));
      {
        INFO("TP 2 x FSDP " << w / 2);
        compare(want, parallel(cfg, {.tp = 2, .loss_parallel = true, .sequence_parallel = sp}, batches));
      }
      if (w == 4) {
        INFO("EP 2 x TP 2");
        const Run got = parallel(cfg, {.tp = 2, .loss_parallel = true, .sequence_parallel = sp, .ep = 2}, batches);
        compare(want, got);
        for (int64_t n : got.all_to_alls) CHECK(n == 5);  // one MoE layer
      }
    }
  }
}

TEST_CASE("an MoE checkpoint saved under one expert layout reloads under every other", "[ep][checkpoint]") {
  const int w = world();
  // Bias balancing, so that the saved expert_bias buffers are not zero.
  auto cfg = config(w == 3 ? 6 : 4, 2, "sigmoid", "bias");
  cfg.moe_shared_experts = 1;
  const Batches batches = data(2 * w, 5, 29, 3);
  std::vector<std::pair<std::string, train::ParallelismOptions>> layouts = {{"FSDP", {.ep = 1}}};
  if (w > 1) layouts.push_back({fmt::format("EP {}", w), {.ep = w}});
  if (w == 4) {
    layouts.push_back({"EP 2 x FSDP 2", {.ep = 2}});
    layouts.push_back({"EP 2 x TP 2 + SP", {.tp = 2, .sequence_parallel = true, .ep = 2}});
    layouts.push_back({"HSDP 2 x (FSDP 2 = EP 2)", {.dp_replicate = 2, .dp_shard = 2, .ep = 2}});
  }
  auto step = [&](Parallel& p, optim::Optimizer& opt, size_t k) {
    train::forward_backward(*p.model, 1, [&](int64_t) {
      return std::pair{p.rows(batches[k].first), p.rows(batches[k].second)};
    });
    nn::clip_grad_norm_(p.model->parameters(), 0.5);
    opt.step();
    opt.zero_grad();
    nn::update_expert_biases(*p.model);
  };
  auto state = [](nn::Module& model) {
    std::map<std::string, Tensor> out;
    for (auto& [name, t] : model.state_dict()) out[name] = ops::clone(whole(t));
    return out;
  };
  // Saved from the last layout after two steps; the third step taken there is the reference.
  testing::SharedDir dir;
  Parallel saved = build(cfg, layouts.back().second);
  optim::AdamW* saved_adamw = nullptr;
  auto saved_opt = train::make_optimizer(*saved.model, {.lr = 3e-2, .eps = 1e-6}, &saved_adamw);
  step(saved, *saved_opt, 0);
  step(saved, *saved_opt, 1);
  const std::string ckpt = fsdp::save_checkpoint(dir.path.string(), 2, *saved.model, saved_adamw);
  const std::map<std::string, Tensor> at_save = state(*saved.model);
  bool moved = false;
  for (const auto& [name, t] : at_save)
    if (name.find("expert_bias") != std::string::npos) moved = moved || !equal(t, zeros_like(t));
  REQUIRE(moved);
  step(saved, *saved_opt, 2);
  const std::map<std::string, Tensor> want = state(*saved.model);
  for (const auto& [what, o] : layouts) {
    INFO("saved under " << layouts.back().first << ", loaded under " << what << " at " << w << " ranks");
    Parallel p = build(cfg, o, /*seed=*/99);
    optim::AdamW* adamw = nullptr;
    auto opt = train::make_optimizer(*p.model, {.lr = 3e-2, .eps = 1e-6}, &adamw);
    fsdp::load_checkpoint(ckpt, *p.model, adamw);
    for (const auto& [name, t] : state(*p.model)) {
      INFO(name);
      REQUIRE(at_save.count(name) == 1);
      CHECK(equal(t, at_save.at(name)));
    }
    step(p, *opt, 2);  // the moments came back too: the next step matches
    for (const auto& [name, t] : state(*p.model)) {
      const double r = relative(t, want.at(name));
      INFO(name << ": relative difference " << r);
      CHECK(r <= 1e-12);
    }
  }
  // And into one process's model, unsharded, as tessera-generate loads it.
  auto plain = nn::make_model(cfg, Device::meta());
  plain->to_empty(Device::cpu());
  plain->to(DType::F64);
  fsdp::load_checkpoint(ckpt, *plain, nullptr);
  for (const auto& [name, t] : plain->state_dict()) {
    INFO(name);
    CHECK(equal(t, at_save.at(name)));
  }
}
