// Shared pieces of the FSDP tests: models with awkward sizes, a single-process
// reference trained on the same global batch, and parity checks of every
// local shard against the matching slice of the reference.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <optional>

#include "dtensor/dtensor.h"
#include "fsdp/fully_shard.h"
#include "nn/models.h"
#include "nn/optim.h"
#include "tests/helpers.h"

namespace tessera::testing {

// A directory every rank agrees on (rank 0 creates it), removed at scope exit.
struct SharedDir {
  std::filesystem::path path;
  SharedDir() {
    std::string mine;
    if (dist::rank() == 0) {
      char tmpl[] = "/tmp/tessera-ckpt-XXXXXX";
      REQUIRE(mkdtemp(tmpl) != nullptr);
      mine = tmpl;
    }
    path = dist::all_gather_strings(dist::world(), mine)[0];
  }
  ~SharedDir() {
    dist::world()->barrier()->wait();
    if (dist::rank() == 0) std::filesystem::remove_all(path);
  }
};

inline int world() {
  dist::init();
  return dist::world_size();
}

// Linear(in, hidden) -> ReLU -> Linear(hidden, out).
class MLP : public nn::Module {
 public:
  MLP(int64_t in, int64_t hidden, int64_t out, Device device = Device::cpu()) {
    fc1 = register_module("fc1", std::make_shared<nn::Linear>(in, hidden, true, device));
    fc2 = register_module("fc2", std::make_shared<nn::Linear>(hidden, out, true, device));
  }
  Tensor forward(const Tensor& x) override { return (*fc2)(relu((*fc1)(x))); }
  std::string type_name() const override { return "MLP"; }
  std::shared_ptr<nn::Linear> fc1, fc2;
};

// Three MLPs and a root Linear: the FSDP tests' "3 MLPs + root" model.
class MLPStack : public nn::Module {
 public:
  explicit MLPStack(Device device = Device::cpu()) {
    mlps = register_module("mlps", std::make_shared<nn::ModuleList>());
    mlps->push_back(std::make_shared<MLP>(15, 7, 17, device));
    mlps->push_back(std::make_shared<MLP>(17, 8, 15, device));
    mlps->push_back(std::make_shared<MLP>(15, 7, 15, device));
    head = register_module("head", std::make_shared<nn::Linear>(15, 5, true, device));
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = x;
    for (size_t i = 0; i < mlps->size(); ++i) h = (*mlps)[i](h);
    return (*head)(h);
  }
  std::vector<nn::Module*> blocks() {
    std::vector<nn::Module*> out;
    for (size_t i = 0; i < mlps->size(); ++i) out.push_back(&(*mlps)[i]);
    return out;
  }
  std::string type_name() const override { return "MLPStack"; }
  std::shared_ptr<nn::ModuleList> mlps;
  std::shared_ptr<nn::Linear> head;
};

// A 3-block GPT with awkward sizes (vocab 13, width 8), fully_shard on every
// block and the root; its token batches; and counts of the collectives that
// process groups issued (CollectiveStats) since the last reset.
inline nn::TransformerConfig tiny_gpt() {
  nn::TransformerConfig t;
  t.vocab_size = 13;
  t.block_size = 8;
  t.n_layer = 3;
  t.n_head = 2;
  t.n_embd = 8;
  return t;
}

inline std::shared_ptr<nn::GPT> sharded_gpt(const MeshPtr& mesh, fsdp::ReshardAfterForward raf, bool root_raf_too = false,
                                            fsdp::MixedPrecisionPolicy mp = {}) {
  auto model = nn::GPT::on_meta(tiny_gpt());
  for (auto& b : model->blocks) fsdp::fully_shard(*b, {.mesh = mesh, .reshard_after_forward = raf, .mp_policy = mp});
  fsdp::fully_shard(*model, {.mesh = mesh, .reshard_after_forward = root_raf_too ? raf : fsdp::ReshardAfterForward{},
                             .mp_policy = mp});
  model->to_empty(Device::cpu());
  model->init_weights(5);
  return model;
}

struct Counts {
  int64_t ag = 0, rs = 0, ar = 0;
};

inline Counts counts(const std::vector<dist::ProcessGroupPtr>& groups) {
  Counts c;
  for (auto& g : groups) {
    auto s = g->stats();
    c.ag += s.all_gather;
    c.rs += s.reduce_scatter;
    c.ar += s.all_reduce;
  }
  return c;
}

inline void reset(const std::vector<dist::ProcessGroupPtr>& groups) {
  for (auto& g : groups) g->reset_stats();
}

inline Tensor tokens(uint64_t seed) { return randint({2, 8}, 0, 13, seed); }

// fully_shard on every block of a meta-device MLPStack and then on the root,
// with the same options; then materialised and initialised as a plain
// MLPStack with init_weights(seed) would be (and cast to dtype if given).
inline void shard_and_init(MLPStack& model, const fsdp::FullyShardOptions& options, uint64_t seed,
                           std::optional<DType> dtype = std::nullopt) {
  for (auto* b : model.blocks()) fsdp::fully_shard(*b, options);
  fsdp::fully_shard(model, options);
  model.to_empty(Device::cpu());
  model.init_weights(seed);
  if (dtype) model.to(*dtype);
}

// Every sharded parameter (and gradient, when both exist) equals the slice of the reference's.
inline void check_sharded_parity(nn::Module& fsdp_model, nn::Module& reference, double rtol, double atol,
                                 bool grads = true) {
  auto ref = reference.named_parameters();
  auto got = fsdp_model.named_parameters();
  REQUIRE(ref.size() == got.size());
  for (size_t i = 0; i < ref.size(); ++i) {
    INFO(got[i].first);
    REQUIRE(got[i].first == ref[i].first);
    const Tensor& p = got[i].second;
    REQUIRE(is_dtensor(p));
    const DTensorSpec& spec = dtensor_spec(p);
    Tensor expect = local_tensor(distribute_tensor_local(ref[i].second, spec.mesh, spec.placements));
    CHECK_CLOSE(local_tensor(p), expect, rtol, atol);
    if (!grads) continue;
    Tensor g = p.grad(), rg = ref[i].second.grad();
    CHECK(g.defined() == rg.defined());
    if (g.defined() && rg.defined())
      CHECK_CLOSE(local_tensor(g), local_tensor(distribute_tensor_local(rg, spec.mesh, spec.placements)), rtol,
                  atol);
  }
}

// The mean over ranks of a per-rank scalar.
inline double global_mean(const Tensor& local) {
  Tensor t = ops::reshape(ops::to(detach(local), DType::F64), {1});
  dist::world()->all_reduce(t, {dist::ReduceOp::Avg})->wait();
  return t.item();
}

// Rows [r * n / W, (r + 1) * n / W) of a global batch.
inline Tensor local_rows(const Tensor& global) {
  int w = dist::world_size(), r = dist::rank();
  int64_t n = global.size(0) / w;
  return ops::contiguous(ops::narrow(global, 0, r * n, n));
}

}  // namespace tessera::testing
