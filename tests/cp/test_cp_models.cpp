// GPT-2 and Llama under context parallelism (train::parallelize with
// ParallelismOptions::cp) against one process, under mpirun with 1-4 ranks:
// the loss, every gradient, the clipped norm and the parameters after 3 AdamW
// steps equal the same model trained on one process on the same global batch
// (f64 to 1e-12, f32 to 1e-5), for both rotate methods, head-tail and
// contiguous splits (lengths that split evenly and not), learned and rotary
// positions; at 4 ranks composed with FSDP, HSDP and TP (+SP). The K/V
// exchanges per layer are the design's and CP 1 issues none.

#include <cmath>
#include <map>

#include "cp/context_parallel.h"
#include "dtensor/dtensor.h"
#include "nn/models.h"
#include "tests/helpers.h"
#include "train/optimizer.h"
#include "train/parallelize.h"
#include "train/step.h"

using namespace tessera;

namespace {

int world() {
  dist::init();
  return dist::world_size();
}

nn::TransformerConfig config(const std::string& arch, bool rope = false) {
  nn::TransformerConfig c;
  c.arch = arch;
  c.vocab_size = 29;
  c.block_size = 16;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_kv_head = arch == "llama" ? 2 : 0;  // grouped-query
  c.n_embd = 16;
  c.bias = arch == "gpt2";
  c.rope = rope;
  c.tie_embeddings = arch == "gpt2";
  return c;
}

struct Run {
  std::vector<double> losses, norms;
  std::map<std::string, Tensor> grads;   // after the first backward, whole
  std::map<std::string, Tensor> params;  // after the last step, whole
};

using Batches = std::vector<std::pair<Tensor, Tensor>>;

Batches data(int64_t rows, int64_t seq, int64_t vocab, int steps) {
  Batches out;
  for (int k = 0; k < steps; ++k)
    out.push_back({randint({rows, seq}, 0, vocab, 300 + 2 * static_cast<uint64_t>(k)),
                   randint({rows, seq}, 0, vocab, 301 + 2 * static_cast<uint64_t>(k))});
  return out;
}

Tensor whole(const Tensor& t) {
  return is_dtensor(t) ? full_tensor(t) : t;
}

// Steps of forward_backward, clipping and AdamW; `rows` picks this rank's
// rows of each global batch; the loss is averaged over `loss_group`.
Run train(nn::LanguageModel& model, const Batches& batches,
          const std::function<Tensor(const Tensor&)>& rows,
          const dist::ProcessGroupPtr& loss_group) {
  auto opt = train::make_optimizer(model, {.lr = 3e-2});
  Run r;
  for (size_t k = 0; k < batches.size(); ++k) {
    Tensor loss = train::forward_backward(model, 1, [&](int64_t) {
      return std::pair{rows(batches[k].first), rows(batches[k].second)};
    });
    loss = ops::reshape(ops::clone(loss), {1});
    if (loss_group && loss_group->size() > 1)
      loss_group->all_reduce(loss, {dist::ReduceOp::Avg})->wait();
    r.losses.push_back(loss.item());
    if (k == 0)
      for (auto& [name, p] : model.named_parameters()) r.grads[name] = ops::clone(whole(p.grad()));
    r.norms.push_back(nn::clip_grad_norm_(model.parameters(), 0.5).item());
    opt->step();
    opt->zero_grad();
  }
  for (auto& [name, p] : model.named_parameters()) r.params[name] = ops::clone(whole(p));
  return r;
}

Run reference(const nn::TransformerConfig& cfg, DType dt, const Batches& batches) {
  auto model = nn::make_model(cfg, Device::meta());
  model->to_empty(Device::cpu());
  model->init_weights(7);
  model->to(dt);
  return train(
      *model, batches, [](const Tensor& t) { return t; }, nullptr);
}

double relative(const Tensor& got, const Tensor& want) {
  const double scale =
      std::max(1.0, ops::to(ops::max(ops::unary(ops::UnaryOp::Abs, want)), DType::F64).item());
  return testing::max_abs_diff(got, want) / scale;
}

// Parameters after the steps to param_tol: AdamW's m / (sqrt(v) + eps)
// turns a gradient's rounding near zero into a relative change of the
// update, by up to lr / eps times that rounding (3e-2 / 1e-8 here). In f64
// the gradients' rounding of about 1e-16 of their largest element bounds
// the parameters' difference near 3e-10, the default param_tol at f64's tol
// of 1e-12 (measured: 1.04e-12 at 4 ranks on an AMX Xeon, 2026-12-04).
void compare(const Run& want, const Run& got, double tol, double param_tol = 0) {
  if (param_tol == 0) param_tol = 300 * tol;
  REQUIRE(got.losses.size() == want.losses.size());
  for (size_t k = 0; k < want.losses.size(); ++k) {
    INFO("step " << k);
    CHECK(std::abs(got.losses[k] - want.losses[k]) <= tol * std::abs(want.losses[k]));
    CHECK(std::abs(got.norms[k] - want.norms[k]) <= tol * std::abs(want.norms[k]));
  }
  REQUIRE(got.grads.size() == want.grads.size());
  for (const auto& [name, g] : got.grads) {
    INFO("gradient of " << name);
    REQUIRE(want.grads.count(name) == 1);
    CHECK(relative(g, want.grads.at(name)) <= tol);
  }
  for (const auto& [name, p] : got.params) {
    INFO("parameter " << name);
    CHECK(relative(p, want.params.at(name)) <= param_tol);
  }
}

// The model over make_mesh(o): this rank's data-parallel rows of each batch.
Run parallel(const nn::TransformerConfig& cfg, DType dt, train::ParallelismOptions o,
             const Batches& batches, MeshPtr* mesh_out = nullptr) {
  o.param_dtype = o.reduce_dtype = dt;  // FSDP computes and reduces in the model's dtype
  MeshPtr mesh = train::make_mesh(o);
  auto model = nn::make_model(cfg, Device::meta());
  train::parallelize(*model, mesh, o);
  model->to_empty(Device::cpu());
  model->init_weights(7);
  model->to(dt);
  const auto& names = mesh->dim_names();
  int64_t dp = 1, dp_rank = 0;
  for (const std::string& n : names)
    if (n == "dp_replicate" || n == "dp_shard")
      dp_rank = dp_rank * mesh->size(mesh->dim_index(n)) + mesh->get_local_rank(n),
      dp *= mesh->size(mesh->dim_index(n));
  const int64_t rows = batches[0].first.size(0) / dp;
  if (mesh_out) *mesh_out = mesh;
  return train(
      *model, batches,
      [&](const Tensor& t) { return ops::contiguous(ops::narrow(t, 0, dp_rank * rows, rows)); },
      dist::world());
}

}  // namespace

TEST_CASE("GPT-2 and Llama under context parallelism equal one process", "[cp][models][exact]") {
  const int c = world();
  struct Model {
    std::string arch;
    bool rope;
  };
  for (const auto& [arch, rope] :
       std::vector<Model>{{"gpt2", false}, {"gpt2", true}, {"llama", false}})
    for (bool lb : {true, false})
      for (const std::string method : {"allgather", "ring"}) {
        // Head-tail: 2 tokens a chunk; contiguous: a length that splits unevenly.
        const int64_t t = lb ? 4 * c : 3 * c + 1;
        INFO(arch << (rope ? " rope" : "") << " cp=" << c << " T=" << t << " load_balance=" << lb
                  << " " << method);
        const auto cfg = config(arch, rope);
        const Batches batches = data(2, t, cfg.vocab_size, 3);
        const train::ParallelismOptions o{
            .cp = c, .cp_rotate_method = method, .cp_load_balance = lb};
        compare(reference(cfg, DType::F64, batches), parallel(cfg, DType::F64, o, batches), 1e-12);
        if (arch == "llama" && method == "ring")
          compare(reference(cfg, DType::F32, batches), parallel(cfg, DType::F32, o, batches), 1e-5,
                  1e-3);
      }
}

TEST_CASE("ignored targets, an all-ignored batch and recomputed blocks under context parallelism",
          "[cp][models][exact]") {
  const int c = world();
  for (const std::string method : {"allgather", "ring"}) {
    INFO("llama cp=" << c << " " << method);
    auto cfg = config("llama");
    // An uneven contiguous split: the slices' counted targets differ.
    const int64_t t = 3 * c + 1;
    Batches batches = data(2, t, cfg.vocab_size, 3);
    // Step 0: a quarter of the targets ignored; step 1: all of them.
    Tensor mask = ops::binary(ops::BinaryOp::Lt, rand({2, t}, 77, DType::F64), 0.25);
    batches[0].second = where(mask, full({}, -100.0, DType::I64), batches[0].second);
    batches[1].second = full({2, t}, -100.0, DType::I64);
    const train::ParallelismOptions o{.cp = c, .cp_rotate_method = method, .cp_load_balance = false};
    compare(reference(cfg, DType::F64, batches), parallel(cfg, DType::F64, o, batches), 1e-12);
    // Each block recomputed in backward: the K/V exchange runs again there.
    cfg.activation_checkpoint = true;
    const Batches plain = data(2, t, cfg.vocab_size, 3);
    compare(reference(cfg, DType::F64, plain), parallel(cfg, DType::F64, o, plain), 1e-12);
  }
}

TEST_CASE("context parallelism composes with FSDP, HSDP and tensor parallelism at 4 ranks",
          "[cp][models][compose]") {
  if (world() != 4) return;
  for (const std::string arch : {"gpt2", "llama"})
    for (const std::string method : {"allgather", "ring"}) {
      const auto cfg = config(arch);
      const Batches batches = data(4, 8, cfg.vocab_size, 3);
      const Run want = reference(cfg, DType::F64, batches);
      {
        INFO(arch << " FSDP 2 x CP 2, " << method);
        compare(want,
                parallel(cfg, DType::F64, {.dp_shard = 2, .cp = 2, .cp_rotate_method = method},
                         batches),
                1e-12);
      }
      {
        INFO(arch << " HSDP 2 x CP 2, " << method);
        compare(want,
                parallel(cfg, DType::F64,
                         {.dp_replicate = 2, .dp_shard = 1, .cp = 2, .cp_rotate_method = method},
                         batches),
                1e-12);
      }
      for (bool sp : {false, true}) {
        INFO(arch << " TP 2 x CP 2, " << method << (sp ? " + SP" : ""));
        compare(want,
                parallel(cfg, DType::F64,
                         {.tp = 2, .sequence_parallel = sp, .cp = 2, .cp_rotate_method = method},
                         batches),
                1e-12);
      }
    }
}

TEST_CASE("the K/V exchanges per layer are the rotate method's; one rank issues none",
          "[cp][counts]") {
  const int c = world();
  const auto cfg = config("llama");
  for (const std::string method : {"allgather", "ring"}) {
    INFO(method << " cp=" << c);
    MeshPtr mesh = train::make_mesh({.cp = c, .cp_rotate_method = method});
    auto model = nn::make_model(cfg, Device::meta());
    train::parallelize(*model, mesh, {.cp = c, .cp_rotate_method = method});
    model->to_empty(Device::cpu());
    model->init_weights(7);
    const Batches batches = data(2, 4 * c, cfg.vocab_size, 1);
    dist::ProcessGroupPtr group = c > 1 ? mesh->get_group("cp") : nullptr;
    if (group) group->reset_stats();
    train::forward_backward(*model, 1, [&](int64_t) { return batches[0]; });
    if (!group) {
      CHECK(model->sequence_shard() == nullptr);  // CP 1: no slice, plain attention
      continue;
    }
    const auto st = group->stats();
    // A sequence longer than the model's positions is refused before any exchange.
    const Batches too_long = data(2, 24, cfg.vocab_size, 1);
    CHECK_THROWS_WITH(train::forward_backward(*model, 1, [&](int64_t) { return too_long[0]; }),
                      Catch::Contains("a sequence of 24 tokens exceeds the model's block_size 16"));
    const int64_t L = cfg.n_layer;
    if (method == "allgather") {
      CHECK(st.all_gather == 2 * L);  // forward and backward
      CHECK(st.reduce_scatter == L);  // dK/dV to their owners
      CHECK(st.send + st.recv == 0);
    } else {
      CHECK(st.send == L * (3 * c - 2));  // c - 1 K/V forward; c - 1 K/V and c dK/dV backward
      CHECK(st.recv == L * (3 * c - 2));
      CHECK(st.total() == 0);
    }
  }
}
