// Shared pieces of the tensor-parallel tests: the mesh, whole values of
// DTensors, parity of every parameter (and gradient) against a
// single-process reference, and a clipped AdamW step of both.
#pragma once

#include "fsdp/checkpoint.h"
#include "tests/fsdp/fsdp_helpers.h"
#include "tp/parallelize.h"

namespace tessera::testing {

inline MeshPtr tp_mesh() { return init_device_mesh("cpu", {world()}, {"tp"}); }

// A parameter's whole value on every rank (a DTensor gathered, a plain tensor as is).
inline Tensor whole(const Tensor& t) {
  autograd::NoGradGuard no_grad;
  return is_dtensor(t) ? full_tensor(t) : t;
}

// Every parameter (and, with grads, its gradient) of the split model against
// the reference's, by name.
inline void check_parity(nn::Module& split, nn::Module& ref, double rtol, bool grads) {
  auto want = ref.named_parameters();
  auto got = split.named_parameters();
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO(got[i].first);
    REQUIRE(got[i].first == want[i].first);
    CHECK_CLOSE(whole(got[i].second), whole(want[i].second), rtol, 1e-13);
    if (!grads) continue;
    REQUIRE(got[i].second.grad().defined() == want[i].second.grad().defined());
    if (want[i].second.grad().defined())
      CHECK_CLOSE(whole(got[i].second.grad()), whole(want[i].second.grad()), rtol, 1e-13);
  }
}

inline dist::CollectiveStats stats(const MeshPtr& mesh) { return mesh->get_group(0)->stats(); }

// After both backwards: the clipped norms, every gradient, then a step of each.
inline void clip_compare_and_step(nn::Module& split, nn::Module& ref, optim::AdamW& split_opt,
                                  optim::AdamW& ref_opt) {
  double rn = nn::clip_grad_norm_(ref.parameters(), 0.5).item();
  double tn = nn::clip_grad_norm_(split.parameters(), 0.5).item();
  CHECK(tn == Approx(rn).epsilon(1e-12));
  check_parity(split, ref, 1e-10, true);
  ref_opt.step();
  split_opt.step();
  ref_opt.zero_grad();
  split_opt.zero_grad();
}

// Every element of every tensor of a saved checkpoint written by exactly one
// chunk (a shard the tensor-parallel ranks share by one of them; a blocked
// shard's pieces each once).
inline void check_chunks_tile(const std::string& dir) {
  for (const auto& t : fsdp::read_metadata(dir).tensors) {
    INFO(t.name);
    Tensor count = zeros(t.shape, DType::F64);
    for (const auto& ch : t.chunks) {
      Tensor box = count;
      for (size_t d = 0; d < ch.offsets.size(); ++d)
        box = ops::narrow(box, static_cast<int64_t>(d), ch.offsets[d], ch.shape[d]);
      ops::add_(box, 1.0);
    }
    CHECK(equal(count, ones(t.shape, DType::F64)));
  }
}

// The models of the tensor-parallel tests: 12 heads of 2 features, an FFN
// of 50 (25 per rank at 2, 17+17+16 at 3, 13+13+13+11 at 4), 19 tokens, 7 positions.
inline nn::TransformerConfig tp_test_config() {
  nn::TransformerConfig c;
  c.vocab_size = 19;
  c.block_size = 7;
  c.n_layer = 2;
  c.n_head = 12;
  c.n_embd = 24;
  c.ffn_hidden = 50;
  c.tie_embeddings = false;
  return c;
}

// A model built on meta, split by its Megatron plan over `mesh`, then given
// bytes and the init of `seed` (each shard its own elements), in f64.
template <class Model>
std::shared_ptr<Model> tp_model(const nn::TransformerConfig& c, const MeshPtr& mesh, uint64_t seed,
                                bool loss_parallel = false, bool sequence_parallel = false) {
  auto model = Model::on_meta(c);
  tp::parallelize_module(*model, mesh,
                         tp::tensor_parallel_plan(*model, mesh->size(), loss_parallel, sequence_parallel));
  model->to_empty(Device::cpu());
  model->init_weights(seed);
  model->to(DType::F64);
  return model;
}

// The same: tensor parallelism over the mesh's "tp" dim, then FSDP over the
// dims named in dp_names (every block, then the root): PyTorch's 2-D (3-D with HSDP).
template <class Model>
std::shared_ptr<Model> fsdp_tp_model(const nn::TransformerConfig& c, const MeshPtr& mesh,
                                     const std::vector<std::string>& dp_names, uint64_t seed,
                                     bool sequence_parallel = false) {
  auto model = Model::on_meta(c);
  tp::parallelize_module(*model, (*mesh)["tp"],
                         tp::tensor_parallel_plan(*model, (*mesh)["tp"]->size(), false, sequence_parallel));
  MeshPtr dp = mesh->slice(dp_names);
  for (auto& b : model->blocks) fsdp::fully_shard(*b, {.mesh = dp});
  fsdp::fully_shard(*model, {.mesh = dp});
  model->to_empty(Device::cpu());
  model->init_weights(seed);
  model->to(DType::F64);
  return model;
}

// This rank's data-parallel rank on a mesh whose last dim is "tp" (the
// ranks of one tensor-parallel group take the same rows).
inline int64_t dp_rank_of(const MeshPtr& mesh) {
  int64_t r = 0;
  for (int64_t d = 0; d + 1 < mesh->ndim(); ++d) r = r * mesh->size(d) + mesh->get_local_rank(d);
  return r;
}

// One AdamW step on this data-parallel rank's rows of a global batch of 12.
inline void train_rows(nn::Module& model, optim::AdamW& opt, uint64_t seed, int64_t dp_rank, int64_t dp,
                       int64_t vocab) {
  const int64_t rows = 12 / dp;
  Tensor x = randint({12, 7}, 0, vocab, seed), y = randint({12, 7}, 0, vocab, seed + 1);
  autograd::backward(
      nn::cross_entropy(model(ops::narrow(x, 0, dp_rank * rows, rows)), ops::narrow(y, 0, dp_rank * rows, rows)));
  opt.step();
  opt.zero_grad();
}

// Every parameter of a equal to b's, bit for bit (gathered).
inline void check_equal_params(nn::Module& a, nn::Module& b) {
  auto pa = a.named_parameters(), pb = b.named_parameters();
  REQUIRE(pa.size() == pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    INFO(pa[i].first);
    CHECK(equal(whole(pa[i].second), whole(pb[i].second)));
  }
}

}  // namespace tessera::testing
