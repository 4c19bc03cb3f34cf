// FSDP behaviour beyond parity: communication counts, event orders, gradient
// accumulation, mixed precision, controls, and the error paths.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "fsdp/checkpoint.h"
#include "fsdp/state_dict.h"
#include "runtime/trace.h"
#include "tests/fsdp/fsdp_helpers.h"
#include "tests/mpi_calls.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

nn::TransformerConfig tiny_gpt() {
  nn::TransformerConfig t;
  t.vocab_size = 13;
  t.block_size = 8;
  t.n_layer = 3;
  t.n_head = 2;
  t.n_embd = 8;
  return t;
}

std::shared_ptr<nn::GPT> sharded_gpt(const MeshPtr& mesh, fsdp::ReshardAfterForward raf, bool root_raf_too = false,
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

Counts counts(const std::vector<dist::ProcessGroupPtr>& groups) {
  Counts c;
  for (auto& g : groups) {
    auto s = g->stats();
    c.ag += s.all_gather;
    c.rs += s.reduce_scatter;
    c.ar += s.all_reduce;
  }
  return c;
}

void reset(const std::vector<dist::ProcessGroupPtr>& groups) {
  for (auto& g : groups) g->reset_stats();
}

Tensor tokens(uint64_t seed) { return randint({2, 8}, 0, 13, seed); }

}  // namespace

TEST_CASE("collective counts per iteration (B blocks + root)", "[fsdp][comm]") {
  int w = world();
  auto mesh = init_device_mesh("cpu", {w}, {"dp"});
  auto g = std::vector<dist::ProcessGroupPtr>{mesh->get_group(0)};
  const int64_t B = 3, expect = w > 1 ? 1 : 0;  // world size 1: no collective at all
  struct Case {
    fsdp::ReshardAfterForward raf;
    bool root_too;
    int64_t backward_ag;
    const char* name;
  };
  std::vector<Case> cases = {{{}, false, B, "default (root keeps its parameters)"},
                             {true, true, B + 1, "reshard after forward everywhere"},
                             {false, true, 0, "no reshard after forward"}};
  for (auto& c : cases) {
    INFO(c.name);
    auto model = sharded_gpt(mesh, c.raf, c.root_too);
    for (int it = 0; it < 2; ++it) {
      reset(g);
      Tensor loss = nn::cross_entropy((*model)(tokens(it)), tokens(it + 10));
      Counts f = counts(g);
      CHECK(f.ag == (B + 1) * expect);
      CHECK(f.rs == 0);
      reset(g);
      autograd::backward(loss);
      Counts b = counts(g);
      CHECK(b.ag == c.backward_ag * expect);
      CHECK(b.rs == (B + 1) * expect);
      CHECK(b.ar == 0);
      model->zero_grad();
    }
    // The optimizer steps on shards without any collective; clipping costs one all-reduce.
    optim::AdamW opt(model->parameters(), {.lr = 1e-3});
    autograd::backward(nn::cross_entropy((*model)(tokens(3)), tokens(4)));
    reset(g);
    opt.step();
    CHECK(counts(g).ag + counts(g).rs + counts(g).ar == 0);
    nn::clip_grad_norm_(model->parameters(), 1.0);
    CHECK(counts(g).ar == 1);
  }
  if (w == 1) CHECK(mesh->get_group(0)->stats().mpi_calls == 0);
  // Int reshard_after_forward: the backward gathers run over the size-k groups.
  if (w == 4) {
    auto model = sharded_gpt(mesh, 2, true);
    (void)nn::cross_entropy((*model)(tokens(1)), tokens(2));
    autograd::clear_tape();
    fsdp::reset_iter_state(*model);
    reset(g);
    Tensor loss = nn::cross_entropy((*model)(tokens(1)), tokens(2));
    CHECK(counts(g).ag == B + 1);
    std::vector<dist::ProcessGroupPtr> post;
    std::vector<nn::Module*> managed = {model.get()};
    for (auto& b : model->blocks) managed.push_back(b.get());
    for (nn::Module* m : managed) {
      auto& info = fsdp::fsdp_state(*m).param_group->post_forward_mesh_info;
      REQUIRE(info.has_value());
      CHECK(info->shard_group->size() == 2);
      post.push_back(info->shard_group);
    }
    reset(g);
    reset(post);
    autograd::backward(loss);
    CHECK(counts(g).ag == 0);         // not on the world group...
    CHECK(counts(post).ag == B + 1);  // ...but over each group's 2-rank subgroup
    CHECK(counts(g).rs == B + 1);
  }
  // Int edge cases as PyTorch: k = W is true, k = 1 is false, a non-divisor is an error.
  if (w > 1) {
    for (int k : {w, 1}) {
      INFO("reshard_after_forward=" << k);
      auto model = sharded_gpt(mesh, k, true);
      Tensor loss = nn::cross_entropy((*model)(tokens(1)), tokens(2));
      reset(g);
      autograd::backward(loss);
      CHECK(counts(g).ag == (k == w ? B + 1 : 0));
      CHECK(counts(g).rs == B + 1);
    }
    CHECK_THROWS_WITH(sharded_gpt(mesh, w + 1, true), Catch::Contains("must be a positive divisor of the shard size"));
    CHECK_THROWS_WITH(sharded_gpt(mesh, 0, true), Catch::Contains("must be a positive divisor of the shard size"));
  }
}

TEST_CASE("world size 1: FSDP and HSDP training, clipping and a checkpoint make no MPI call", "[fsdp][comm]") {
  if (world() != 1) return;
  int64_t before = testing::mpi_calls_made();
  auto mesh = init_device_mesh("cpu", {1}, {"dp"});
  auto hsdp = init_device_mesh("cpu", {1, 1}, {"replicate", "shard"});
  for (const auto& m : {mesh, hsdp}) {
    auto model = sharded_gpt(m, true, true, {.param_dtype = DType::BF16, .reduce_dtype = DType::F32});
    optim::AdamW opt(model->parameters(), {.lr = 1e-3});
    for (uint64_t it = 0; it < 2; ++it) {
      autograd::backward(nn::cross_entropy((*model)(tokens(it)), tokens(it + 7)));
      nn::clip_grad_norm_(model->parameters(), 1.0);
      opt.step();
      opt.zero_grad();
    }
    auto dir = std::filesystem::temp_directory_path() / fmt::format("tessera-np1-ckpt-{}", ::getpid());
    std::string saved = fsdp::save_checkpoint(dir.string(), 2, *model, &opt);
    fsdp::load_checkpoint(saved, *model, &opt);
    (void)fsdp::full_state_dict(*model);
    std::filesystem::remove_all(dir);
  }
  CHECK(testing::mpi_calls_made() - before == 0);
}

TEST_CASE("event order: implicit forward prefetch and reverse post-forward backward prefetch", "[fsdp][order]") {
  auto mesh = init_device_mesh("cpu", {world()}, {"dp"});
  auto model = sharded_gpt(mesh, true, true);
  autograd::backward(nn::cross_entropy((*model)(tokens(1)), tokens(2)));  // records the forward order
  std::vector<std::string> events;
  fsdp::fsdp_state(*model).comm_ctx->on_event = [&](const std::string& e, const std::string& fqn,
                                                   fsdp::TrainingState s) {
    events.push_back(e + " " + (fqn.empty() ? "root" : fqn) + " " + fsdp::training_state_name(s));
  };
  Tensor loss = nn::cross_entropy((*model)(tokens(3)), tokens(4));
  std::vector<std::string> forward = {
      "unshard root FORWARD",           "unshard transformer.h.0 FORWARD", "unshard transformer.h.1 FORWARD",
      "reshard transformer.h.0 FORWARD", "unshard transformer.h.2 FORWARD", "reshard transformer.h.1 FORWARD",
      "reshard transformer.h.2 FORWARD", "reshard root FORWARD"};
  CHECK(events == forward);
  events.clear();
  autograd::backward(loss);
  std::vector<std::string> unshard_and_post;
  for (auto& e : events)
    if (e.rfind("unshard", 0) == 0 || e.rfind("post_backward", 0) == 0) unshard_and_post.push_back(e);
  std::vector<std::string> backward = {
      "unshard root PRE_BACKWARD",           "unshard transformer.h.2 PRE_BACKWARD",
      "unshard transformer.h.1 PRE_BACKWARD", "post_backward transformer.h.2 POST_BACKWARD",
      "unshard transformer.h.0 PRE_BACKWARD", "post_backward transformer.h.1 POST_BACKWARD",
      "post_backward transformer.h.0 POST_BACKWARD", "post_backward root POST_BACKWARD"};
  CHECK(unshard_and_post == backward);
  // Explicit forward prefetch of two blocks at once.
  events.clear();
  fsdp::set_modules_to_forward_prefetch(*model, {model->blocks[0].get(), model->blocks[1].get()});
  for (auto& b : model->blocks) fsdp::set_modules_to_forward_prefetch(*b, {});
  (void)nn::cross_entropy((*model)(tokens(5)), tokens(6));
  std::vector<std::string> explicit_forward = {
      "unshard root FORWARD",           "unshard transformer.h.0 FORWARD", "unshard transformer.h.1 FORWARD",
      "reshard transformer.h.0 FORWARD", "reshard transformer.h.1 FORWARD", "unshard transformer.h.2 FORWARD",
      "reshard transformer.h.2 FORWARD", "reshard root FORWARD"};
  CHECK(events == explicit_forward);
  autograd::clear_tape();
  fsdp::reset_iter_state(*model);
  // The whole backward, reshards included, then explicit backward prefetch
  // of two blocks at once from the root.
  for (int pass = 0; pass < 2; ++pass) {
    if (pass == 1) {
      fsdp::set_modules_to_backward_prefetch(*model, {model->blocks[2].get(), model->blocks[1].get()});
      for (auto& b : model->blocks) fsdp::set_modules_to_backward_prefetch(*b, {});
    }
    Tensor l = nn::cross_entropy((*model)(tokens(7)), tokens(8));
    events.clear();
    autograd::backward(l);
    std::vector<std::string> expected =
        pass == 0 ? std::vector<std::string>{"unshard root PRE_BACKWARD",
                                             "unshard transformer.h.2 PRE_BACKWARD",
                                             "unshard transformer.h.1 PRE_BACKWARD",  // implicit prefetch by h.2
                                             "post_backward transformer.h.2 POST_BACKWARD",
                                             "reshard transformer.h.2 POST_BACKWARD",
                                             "unshard transformer.h.0 PRE_BACKWARD",  // prefetched by h.1
                                             "post_backward transformer.h.1 POST_BACKWARD",
                                             "reshard transformer.h.1 POST_BACKWARD",
                                             "post_backward transformer.h.0 POST_BACKWARD",
                                             "reshard transformer.h.0 POST_BACKWARD",
                                             "post_backward root POST_BACKWARD",
                                             "reshard root POST_BACKWARD"}
                  : std::vector<std::string>{"unshard root PRE_BACKWARD",
                                             "unshard transformer.h.2 PRE_BACKWARD",  // both prefetched by the root,
                                             "unshard transformer.h.1 PRE_BACKWARD",  // in the order given
                                             "post_backward transformer.h.2 POST_BACKWARD",
                                             "reshard transformer.h.2 POST_BACKWARD",
                                             "unshard transformer.h.0 PRE_BACKWARD",  // by h.1: an empty list keeps the default
                                             "post_backward transformer.h.1 POST_BACKWARD",
                                             "reshard transformer.h.1 POST_BACKWARD",
                                             "post_backward transformer.h.0 POST_BACKWARD",
                                             "reshard transformer.h.0 POST_BACKWARD",
                                             "post_backward root POST_BACKWARD",
                                             "reshard root POST_BACKWARD"};
    CHECK(events == expected);
  }
}

TEST_CASE("gradient accumulation without sync, then one reduction", "[fsdp][accumulation]") {
  // PyTorch's test_gradient_accumulation matrix: 3 MLPs + root, 3 micro-batches;
  // FSDP and HSDP (2x2); reshard_after_forward true/false/2; which modules skip
  // the sync (all, the root only, the middle MLPs); with or without resharding
  // after the no-sync backwards. Counts per iteration as section 4.2 of the
  // reference, and gradients equal the reference's accumulated ones.
  int w = world();
  std::vector<MeshPtr> meshes = {init_device_mesh("cpu", {w}, {"dp"})};
  if (w == 4) meshes.push_back(init_device_mesh("cpu", {2, 2}, {"replicate", "shard"}));
  const int64_t M = 3, micro = 3, e = w > 1 ? 1 : 0;
  for (const auto& mesh : meshes) {
    bool hsdp = mesh->ndim() == 2;
    std::vector<fsdp::ReshardAfterForward> rafs = {true, false};
    if (mesh->size(mesh->ndim() - 1) == 4) rafs.push_back(2);
    for (const auto& raf : rafs) {
      for (std::string mode : {"all", "root_only", "some_mlps"}) {
        for (bool rab : {true, false}) {
          bool raf_false = std::holds_alternative<bool>(raf) && !std::get<bool>(raf);
          // As PyTorch's test: keeping parameters after the no-sync backwards only
          // with reshard_after_forward false and mode all or root_only.
          if (!rab && (!raf_false || mode == "some_mlps")) continue;
          INFO(mesh->str() << " reshard_after_forward "
                           << (std::holds_alternative<int>(raf) ? 2 : std::get<bool>(raf))
                           << " mode " << mode << " reshard_after_backward " << rab);
          MLPStack ref;
          ref.init_weights(9);
          ref.to(DType::F64);
          MLPStack model(Device::meta());
          for (auto* b : model.blocks()) fsdp::fully_shard(*b, {.mesh = mesh, .reshard_after_forward = raf});
          fsdp::fully_shard(model, {.mesh = mesh, .reshard_after_forward = raf});
          model.to_empty(Device::cpu());
          model.init_weights(9);
          model.to(DType::F64);
          // The shard groups (all-gathers, reduce-scatters) and, for HSDP, the replicate group.
          auto shard = std::vector<dist::ProcessGroupPtr>{mesh->get_group(mesh->ndim() - 1)};
          auto rep = hsdp ? std::vector<dist::ProcessGroupPtr>{mesh->get_group(0)} : shard;
          // reshard_after_forward=2: the backward gathers run over each group's 2-rank subgroup.
          std::vector<dist::ProcessGroupPtr> post;
          std::vector<nn::Module*> managed = model.blocks();
          managed.push_back(&model);
          for (nn::Module* m : managed)
            if (auto& info = fsdp::fsdp_state(*m).param_group->post_forward_mesh_info) post.push_back(info->shard_group);
          reset(shard);
          reset(rep);
          reset(post);
          for (int64_t mb = 0; mb < micro; ++mb) {
            bool last = mb == micro - 1;
            auto flags = [&](nn::Module& m, bool recurse) {
              fsdp::set_requires_gradient_sync(m, last, recurse);
              if (!rab) fsdp::set_reshard_after_backward(m, last, recurse);
            };
            if (mode == "all") flags(model, true);
            else if (mode == "root_only") flags(model, false);
            else for (size_t i = 1; i < model.blocks().size(); ++i) flags(*model.blocks()[i], false);
            Tensor x = randn({12, 15}, 50 + static_cast<uint64_t>(mb), DType::F64);
            Tensor y = randn({12, 5}, 60 + static_cast<uint64_t>(mb), DType::F64);
            autograd::backward(mean(square(ref(x) - y)));
            autograd::backward(mean(square(model(local_rows(x)) - local_rows(y))));
          }
          int64_t rs = M + 1;  // the last micro-batch reduces every group
          if (mode == "root_only") rs += M * (micro - 1);           // the MLPs reduce every time
          if (mode == "some_mlps") rs += (M - 2 + 1) * (micro - 1);  // MLP 0 and the root do
          int64_t ag = M + 1;
          if (!raf_false) ag *= 2 * micro;
          else if (rab) ag *= micro;
          else if (mode == "root_only") ag += M * (micro - 1);  // the MLPs reshard after backward
          Counts cs = counts(shard), cr = counts(rep), cp = counts(post);
          CHECK(cs.rs == rs * e);
          CHECK(cs.ag + cp.ag == ag * e);
          if (!post.empty()) CHECK(cp.ag == (M + 1) * micro);  // every backward gather is on a subgroup
          CHECK((hsdp ? cr.ar : cs.ar) == (hsdp ? rs : 0));
          check_sharded_parity(model, ref, 1e-9, 1e-12);
        }
      }
    }
  }
}

TEST_CASE("bf16 parameters with f32 reduction match a same-rounding reference", "[fsdp][mixed_precision]") {
  std::vector<MeshPtr> meshes = {init_device_mesh("cpu", {world()}, {"dp"})};
  if (world() % 2 == 0)  // HSDP: 2 replicas of world/2 shards (2x2 at 4 ranks)
    meshes.push_back(init_device_mesh("cpu", {2, world() / 2}, {"replicate", "shard"}));
  for (const auto& mesh : meshes) {
    INFO("mesh " << mesh->str());
    fsdp::MixedPrecisionPolicy mp{.param_dtype = DType::BF16, .reduce_dtype = DType::F32};
    MLPStack model(Device::meta());
    for (auto* b : model.blocks()) fsdp::fully_shard(*b, {.mesh = mesh, .mp_policy = mp});
    fsdp::fully_shard(model, {.mesh = mesh, .mp_policy = mp});
    model.to_empty(Device::cpu());
    model.init_weights(4);
    // Reference: f32 master weights; each step computes with a bf16 copy, and the
    // bf16 gradients are averaged in f32 (what FSDP's f32 reduce-scatter does).
    MLPStack master;
    master.init_weights(4);
    MLPStack compute;
    compute.to(DType::BF16);
    optim::SGD fopt(model.parameters(), {.lr = 0.05}), ropt(master.parameters(), {.lr = 0.05});
    for (int step = 0; step < 3; ++step) {
      Tensor x = randn({12, 15}, 70 + step), y = randn({12, 5}, 80 + step);
      // FSDP: inputs are cast to bf16 by cast_forward_inputs; outputs come back in bf16.
      Tensor out = model(local_rows(x));
      CHECK(out.dtype() == DType::BF16);
      autograd::backward(mean(square(to(out, DType::F32) - local_rows(y))));
      // Reference, rank by rank on the same rows, then the f32 average.
      {
        autograd::NoGradGuard ng;
        compute.load_state_dict(master.state_dict());
      }
      std::vector<Tensor> sum_grads;
      int w = world();
      for (int r = 0; r < w; ++r) {
        Tensor xr = ops::narrow(x, 0, r * 12 / w, 12 / w), yr = ops::narrow(y, 0, r * 12 / w, 12 / w);
        Tensor o = compute(to(xr, DType::BF16));
        autograd::backward(mean(square(to(o, DType::F32) - yr)));
        auto params = compute.parameters();
        for (size_t i = 0; i < params.size(); ++i) {
          Tensor gf = ops::to(params[i].grad(), DType::F32);
          if (r == 0) sum_grads.push_back(gf);
          else sum_grads[i] = ops::add(sum_grads[i], gf);
        }
        compute.zero_grad();
      }
      auto mparams = master.parameters();
      for (size_t i = 0; i < mparams.size(); ++i) mparams[i].set_grad(ops::mul(sum_grads[i], 1.0 / w));
      check_sharded_parity(model, master, 1e-5, 1e-6);
      CHECK(local_tensor(model.parameters()[0].grad()).dtype() == DType::F32);  // the optimizer steps in f32
      fopt.step();
      ropt.step();
      fopt.zero_grad();
      ropt.zero_grad();
    }
  }
}

TEST_CASE("unshard/reshard by hand, divide factor, forward methods, reset after an exception", "[fsdp][controls]") {
  int w = world();
  auto mesh = init_device_mesh("cpu", {w}, {"dp"});
  MLPStack ref;
  ref.init_weights(2);
  ref.to(DType::F64);
  MLPStack model(Device::meta());
  for (auto* b : model.blocks()) fsdp::fully_shard(*b, {.mesh = mesh});
  fsdp::fully_shard(model, {.mesh = mesh});
  model.to_empty(Device::cpu());
  model.init_weights(2);
  model.to(DType::F64);
  // unshard(async) before the first forward gives the full parameters.
  auto handle = fsdp::unshard(*model.blocks()[0], true);
  handle.wait();
  CHECK(!model.mlps->operator[](0).parameters()[0].is_distributed());
  CHECK(testing::equal(model.mlps->operator[](0).parameters()[0], ref.mlps->operator[](0).parameters()[0]));
  fsdp::reshard(*model.blocks()[0]);
  CHECK(model.mlps->operator[](0).parameters()[0].is_distributed());
  // A custom divide factor: the sum of gradients over ranks divided by the factor.
  fsdp::set_gradient_divide_factor(model, 2.0 * w);
  Tensor x = randn({12, 15}, 1, DType::F64), y = randn({12, 5}, 2, DType::F64);
  autograd::backward(mean(square(ref(x) - y)));
  for (auto& p : ref.parameters()) p.set_grad(ops::mul(p.grad(), 0.5));  // mean over ranks / 2
  autograd::backward(mean(square(model(local_rows(x)) - local_rows(y))));
  check_sharded_parity(model, ref, 1e-9, 1e-12);
  ref.zero_grad();
  model.zero_grad();
  fsdp::set_gradient_divide_factor(model, static_cast<double>(w));
  // An exception in the middle of forward; reset_iter_state recovers.
  Tensor bad = randn({12, 14}, 3, DType::F64);
  CHECK_THROWS_WITH(model(local_rows(bad)), Catch::Contains("has 14 features but weight"));
  fsdp::reset_iter_state(model);
  autograd::backward(mean(square(ref(x) - y)));
  autograd::backward(mean(square(model(local_rows(x)) - local_rows(y))));
  check_sharded_parity(model, ref, 1e-9, 1e-12);
  ref.zero_grad();
  model.zero_grad();
  // An exception in the middle of backward: a gradient hook on block 0's
  // output throws after the head and blocks 2 and 1 ran their backward (and
  // issued their reduce-scatters). reset_iter_state recovers.
  auto hook = model.blocks()[0]->register_forward_hook([](nn::Module&, const TensorList&, TensorList& outs) {
    autograd::register_hook(outs[0], [](const Tensor&) -> Tensor { throw Error("injected failure in backward"); });
  });
  CHECK_THROWS_WITH(autograd::backward(mean(square(model(local_rows(x)) - local_rows(y)))),
                    Catch::Contains("injected failure in backward"));
  model.blocks()[0]->remove_hook(hook);
  fsdp::reset_iter_state(model);
  model.zero_grad();
  autograd::backward(mean(square(ref(x) - y)));
  autograd::backward(mean(square(model(local_rows(x)) - local_rows(y))));
  check_sharded_parity(model, ref, 1e-9, 1e-12);
  ref.zero_grad();
  model.zero_grad();
  // Another method with the module's hooks (register_fsdp_forward_method):
  // unsharded inside, resharded after, gradients reduce-scattered as usual.
  auto& block = *model.blocks()[1];
  auto fc1_only = fsdp::register_fsdp_forward_method(block, [&](const TensorList& in) {
    CHECK_FALSE(block.parameters()[0].is_distributed());  // unsharded inside
    return TensorList{static_cast<MLP&>(block).fc1->forward(in[0])};
  });
  Tensor z = randn({12, 17}, 4, DType::F64);  // 12 rows: whole rows on 1-4 ranks
  TensorList out = fc1_only({local_rows(z)});
  CHECK(out[0].shape() == Shape{local_rows(z).size(0), 8});
  CHECK(block.parameters()[0].is_distributed());  // resharded after (reshard_after_forward)
  autograd::backward(sum(out[0]));
  autograd::backward(sum(static_cast<MLP&>(ref.mlps->operator[](1)).fc1->forward(z)));
  for (auto& p : ref.parameters()) p.set_grad(p.grad().defined() ? ops::mul(p.grad(), 1.0 / w) : p.grad());
  check_sharded_parity(model, ref, 1e-9, 1e-12);
  autograd::clear_tape();
  fsdp::reset_iter_state(model);
}

TEST_CASE("error paths name what is wrong", "[fsdp][errors]") {
  int w = world();
  auto mesh = init_device_mesh("cpu", {w}, {"dp"});
  {  // An optimizer built before fully_shard holds parameters that no longer train.
    MLPStack model;
    optim::AdamW stale(model.parameters(), {});
    for (auto* b : model.blocks()) fsdp::fully_shard(*b, {.mesh = mesh});
    fsdp::fully_shard(model, {.mesh = mesh});
    CHECK_THROWS_WITH(stale.step(), Catch::Contains("was sharded by fully_shard"));
    // forward() skips the hooks: parameters are still sharded DTensors.
    CHECK_THROWS_WITH(model.forward(randn({4, 15}, 1)), Catch::Contains("DTensor"));
  }
  {  // Tied parameters split across groups.
    auto model = nn::GPT::on_meta(tiny_gpt());
    model->to_empty(Device::cpu());
    fsdp::fully_shard(*model->wte, {.mesh = mesh});
    CHECK_THROWS_WITH(fsdp::fully_shard(*model, {.mesh = mesh}), Catch::Contains("already managed by another FSDP group"));
  }
  {  // Scalars, uneven dim > 0, applied twice, 3-D meshes.
    nn::Module m;
    m.register_parameter("scale", full({}, 1.0));
    CHECK_THROWS_WITH(fsdp::fully_shard(m, {.mesh = mesh}),
                      Catch::Contains("Change scale to a 1D tensor with numel equal to 1"));
    nn::Linear lin(w + 1, 4);
    if (w > 1)
      CHECK_THROWS_WITH(fsdp::fully_shard(lin, {.mesh = mesh, .shard_placement_fn = [](const Tensor&) {
                                                  return std::optional<Shard>(Shard{1});
                                                }}),
                        Catch::Contains("does not support uneven sharding on dim 1"));
    nn::Linear ok(4, 3);
    fsdp::fully_shard(ok, {.mesh = mesh});
    CHECK_THROWS_WITH(fsdp::fully_shard(ok, {.mesh = mesh}), Catch::Contains("applied twice"));
    auto mesh3 = init_device_mesh("cpu", {w, 1, 1}, {"a", "b", "c"});
    nn::Linear l3(4, 3);
    CHECK_THROWS_WITH(fsdp::fully_shard(l3, {.mesh = mesh3}), Catch::Contains("expects a 1D or 2D DeviceMesh"));
  }
  {  // Different meshes under one root.
    auto other = init_device_mesh("cpu", {w, 1}, {"x", "y"});
    MLPStack model;
    fsdp::fully_shard(*model.blocks()[0], {.mesh = other});
    fsdp::fully_shard(model, {.mesh = mesh});
    CHECK_THROWS_WITH(model(randn({2, 15}, 1)), Catch::Contains("one root needs one mesh"));
  }
  {  // A meta model not materialised.
    MLPStack model(Device::meta());
    fsdp::fully_shard(model, {.mesh = mesh});
    CHECK_THROWS_WITH(model(randn({2, 15}, 1)), Catch::Contains("still on meta"));
  }
  autograd::clear_tape();  // the failed forwards left markers behind
}

TEST_CASE("Shard(1) placement via shard_placement_fn trains like Shard(0)", "[fsdp][placement]") {
  int w = world();
  auto mesh = init_device_mesh("cpu", {w}, {"dp"});
  nn::Linear ref(4 * w, 3);
  ref.init_weights(6);
  ref.to(DType::F64);
  nn::Linear model(4 * w, 3, true, Device::meta());
  fsdp::fully_shard(model, {.mesh = mesh, .shard_placement_fn = [](const Tensor& p) {
                              return p.dim() == 2 ? std::optional<Shard>(Shard{1}) : std::nullopt;
                            }});
  model.to_empty(Device::cpu());
  model.init_weights(6);
  model.to(DType::F64);
  CHECK(is_shard(dtensor_spec(model.weight).placements[0], 1));
  // Three AdamW steps: the optimizer works on the Shard(1) columns as on rows.
  optim::AdamW ropt(ref.parameters(), {.lr = 1e-2, .weight_decay = 0.1}),
      fopt(model.parameters(), {.lr = 1e-2, .weight_decay = 0.1});
  for (uint64_t step = 0; step < 3; ++step) {
    Tensor x = randn({12, 4 * w}, 7 + step, DType::F64);
    autograd::backward(sum(square(ref(x))) * (1.0 / w));
    autograd::backward(sum(square(model(local_rows(x)))));
    check_sharded_parity(model, ref, 1e-9, 1e-12);
    ropt.step();
    fopt.step();
    ropt.zero_grad();
    fopt.zero_grad();
  }
  check_sharded_parity(model, ref, 1e-9, 1e-12, false);
  // A dim that does not divide evenly is refused.
  nn::Linear odd(4 * w + 1, 3, true, Device::meta());
  if (w > 1)
    CHECK_THROWS_WITH(fsdp::fully_shard(odd, {.mesh = mesh, .shard_placement_fn = [](const Tensor& p) {
                                                return p.dim() == 2 ? std::optional<Shard>(Shard{1}) : std::nullopt;
                                              }}),
                      Catch::Contains("does not support uneven sharding on dim 1"));
}

TEST_CASE("HSDP: reduce-scatter every micro-batch, all-reduce only on the last", "[fsdp][hsdp]") {
  int w = world();
  if (w != 4) return;
  auto mesh = init_device_mesh("cpu", {2, 2}, {"replicate", "shard"});
  MLPStack ref;
  ref.init_weights(11);
  ref.to(DType::F64);
  MLPStack model(Device::meta());
  for (auto* b : model.blocks()) fsdp::fully_shard(*b, {.mesh = mesh});
  fsdp::fully_shard(model, {.mesh = mesh});
  model.to_empty(Device::cpu());
  model.init_weights(11);
  model.to(DType::F64);
  auto shard = std::vector<dist::ProcessGroupPtr>{mesh->get_group("shard")};
  auto rep = std::vector<dist::ProcessGroupPtr>{mesh->get_group("replicate")};
  reset(shard);
  reset(rep);
  const int64_t M = 3, micro = 3;
  for (int64_t mb = 0; mb < micro; ++mb) {
    fsdp::set_requires_all_reduce(model, mb == micro - 1);
    Tensor x = randn({12, 15}, 90 + static_cast<uint64_t>(mb), DType::F64);
    Tensor y = randn({12, 5}, 95 + static_cast<uint64_t>(mb), DType::F64);
    autograd::backward(mean(square(ref(x) - y)));
    autograd::backward(mean(square(model(local_rows(x)) - local_rows(y))));
  }
  CHECK(counts(shard).rs == (M + 1) * micro);
  CHECK(counts(rep).ar == M + 1);
  check_sharded_parity(model, ref, 1e-9, 1e-12);
}

TEST_CASE("no-sync micro-batches accumulate bf16 gradients in the f32 reduce dtype", "[fsdp][mixed_precision]") {
  auto mesh = init_device_mesh("cpu", {world()}, {"dp"});
  fsdp::MixedPrecisionPolicy mp{.param_dtype = DType::BF16, .reduce_dtype = DType::F32};
  MLPStack model(Device::meta());
  for (auto* b : model.blocks()) fsdp::fully_shard(*b, {.mesh = mesh, .mp_policy = mp});
  fsdp::fully_shard(model, {.mesh = mesh, .mp_policy = mp});
  model.to_empty(Device::cpu());
  model.init_weights(4);
  fsdp::set_requires_gradient_sync(model, false);
  autograd::backward(mean(to(model(randn({4, 15}, 1)), DType::F32)));
  auto& group = *fsdp::fsdp_state(*model.blocks()[0]).param_group;
  REQUIRE(group.fsdp_params[0]->unsharded_accumulated_grad.defined());
  CHECK(group.fsdp_params[0]->unsharded_accumulated_grad.dtype() == DType::F32);
  CHECK_FALSE(model.parameters()[0].grad().defined());  // nothing reduced yet
  fsdp::set_requires_gradient_sync(model, true);
  autograd::backward(mean(to(model(randn({4, 15}, 2)), DType::F32)));
  CHECK_FALSE(group.fsdp_params[0]->unsharded_accumulated_grad.defined());
  CHECK(local_tensor(model.parameters()[0].grad()).dtype() == DType::F32);
  // output_dtype casts what the module returns.
  MLP head(15, 4, 3, Device::meta());
  fsdp::fully_shard(head, {.mesh = mesh, .mp_policy = {.param_dtype = DType::BF16, .output_dtype = DType::F32}});
  head.to_empty(Device::cpu());
  head.init_weights(1);
  CHECK(head(randn({2, 15}, 3)).dtype() == DType::F32);
  autograd::clear_tape();
}


TEST_CASE("traces: lanes for compute and each collective, exposed time, one file for all ranks", "[fsdp][trace]") {
  int w = world();
  auto mesh = init_device_mesh("cpu", {w}, {"dp"});
  auto model = sharded_gpt(mesh, true, true);
  autograd::backward(nn::cross_entropy((*model)(tokens(1)), tokens(2)));
  model->zero_grad();
  trace::take();
  trace::enable(true);
  double t0 = trace::now_us();
  autograd::backward(nn::cross_entropy((*model)(tokens(3)), tokens(4)));
  double t1 = trace::now_us();
  trace::enable(false);
  auto spans = trace::take();
  auto s = trace::summarize(spans);
  CHECK(s.compute_us > 0);
  CHECK(s.exposed_us <= t1 - t0);
  bool has_fsdp = false, has_ag = false, has_rs = false;
  for (auto& sp : spans) {
    has_fsdp = has_fsdp || sp.lane == trace::Lane::FSDP;
    has_ag = has_ag || sp.lane == trace::Lane::AllGather;
    has_rs = has_rs || sp.lane == trace::Lane::ReduceScatter;
    CHECK(sp.end_us >= sp.start_us);
  }
  CHECK(has_fsdp);
  CHECK(has_ag == (w > 1));
  CHECK(has_rs == (w > 1));
  if (w > 1) {
    // Prefetch: some all-gather is in flight while compute runs (issued
    // before a block's backward, completed during it).
    bool overlapped = false;
    for (auto& ag : spans) {
      if (ag.lane != trace::Lane::AllGather) continue;
      for (auto& c : spans)
        overlapped = overlapped || (c.lane == trace::Lane::Compute && c.start_us >= ag.start_us &&
                                    c.end_us <= ag.end_us);
    }
    CHECK(overlapped);
    double waited = 0;
    for (auto& sp : spans)
      if (sp.lane == trace::Lane::Wait) waited += sp.end_us - sp.start_us;
    CHECK(std::abs(s.exposed_us - waited) < 1.0);  // exposed = time blocked in wait()
  }
  // A path every rank agrees on (rank 0 writes the file), outside the source tree.
  std::string path = (std::filesystem::temp_directory_path() /
                      fmt::format("tessera-trace-test-{}.json",
                                  dist::all_gather_strings(dist::world(), std::to_string(::getpid()))[0]))
                         .string();
  trace::write_chrome_trace(path, spans);
  if (dist::rank() == 0) {
    std::ifstream in(path);
    auto j = nlohmann::json::parse(in);
    std::set<int> pids;
    std::set<std::string> lanes;
    for (auto& e : j["traceEvents"]) {
      pids.insert(e["pid"].get<int>());
      if (e["name"] == "thread_name") lanes.insert(e["args"]["name"].get<std::string>());
    }
    CHECK(static_cast<int>(pids.size()) == w);
    CHECK(lanes.count("compute") == 1);
    CHECK(lanes.count("all_gather") == 1);
    CHECK(lanes.count("reduce_scatter") == 1);
    CHECK(lanes.count("waiting for communication (exposed)") == 1);
    std::filesystem::remove(path);
  }
}

namespace {
// Embedding -> Linear, each its own FSDP group.
class EmbedHead : public nn::Module {
 public:
  explicit EmbedHead(Device d = Device::cpu()) {
    emb = register_module("emb", std::make_shared<nn::Embedding>(11, 6, d));
    out = register_module("out", std::make_shared<nn::Linear>(6, 3, true, d));
  }
  Tensor forward(const Tensor& idx) override { return (*out)((*emb)(idx)); }
  std::shared_ptr<nn::Embedding> emb;
  std::shared_ptr<nn::Linear> out;
};
}  // namespace

TEST_CASE("runtime controls: reshard after forward/backward, unshard in backward, last backward, ignored",
          "[fsdp][controls]") {
  int w = world();
  const int64_t e = w > 1 ? 1 : 0;
  auto mesh = init_device_mesh("cpu", {w}, {"dp"});
  auto g = std::vector<dist::ProcessGroupPtr>{mesh->get_group(0)};
  EmbedHead ref;
  ref.init_weights(3);
  ref.to(DType::F64);
  EmbedHead model(Device::meta());
  fsdp::fully_shard(*model.emb, {.mesh = mesh});
  fsdp::fully_shard(model, {.mesh = mesh});
  model.to_empty(Device::cpu());
  model.init_weights(3);
  model.to(DType::F64);
  Tensor idx = randint({12, 5}, 0, 11, 1);  // divisible by 1-4 ranks
  auto step = [&](nn::Module& m, const Tensor& i) { autograd::backward(sum(square(m(i)))); };
  // The embedding's weight is not needed to compute its gradient: skip its backward all-gather.
  fsdp::set_unshard_in_backward(*model.emb, false);
  fsdp::set_reshard_after_forward(model, true);  // root included: both groups gather again in backward
  reset(g);
  step(model, local_rows(idx));
  CHECK(counts(g).ag == (2 + 1) * e);  // forward 2, backward 1 (the root's, not the embedding's)
  step(ref, idx);
  for (auto& p : ref.parameters()) p.set_grad(ops::mul(p.grad(), 1.0 / w));
  check_sharded_parity(model, ref, 1e-9, 1e-12);
  // Keep parameters unsharded after backward (with no sync): nothing re-gathered next time.
  fsdp::set_requires_gradient_sync(model, false);
  fsdp::set_reshard_after_backward(model, false);
  fsdp::set_reshard_after_forward(model, false);
  step(model, local_rows(idx));
  CHECK_FALSE(model.out->weight.is_distributed());  // still the unsharded parameter
  reset(g);
  fsdp::set_requires_gradient_sync(model, true);
  fsdp::set_reshard_after_backward(model, true);
  step(model, local_rows(idx));
  CHECK(counts(g).ag == 0);
  CHECK(model.out->weight.is_distributed());
  // Not the last backward: reductions may stay in flight; the next last backward completes them.
  ref.zero_grad();
  model.zero_grad();
  fsdp::set_is_last_backward(model, false);
  step(model, local_rows(idx));
  fsdp::set_is_last_backward(model, true);
  step(model, local_rows(idx));
  step(ref, idx);
  step(ref, idx);
  for (auto& p : ref.parameters()) p.set_grad(ops::mul(p.grad(), 1.0 / w));
  check_sharded_parity(model, ref, 1e-9, 1e-12);
  // Ignored parameters stay whole and unmanaged.
  EmbedHead partial;
  fsdp::fully_shard(partial, {.mesh = mesh, .ignored_params = {partial.out->bias}});
  CHECK(partial.out->weight.is_distributed());
  CHECK_FALSE(partial.out->bias.is_distributed());
  CHECK(partial.out->bias.storage()->is_allocated());
  autograd::clear_tape();
}

TEST_CASE("CPUOffloadPolicy is accepted and, on CPU, changes nothing", "[fsdp][offload]") {
  auto mesh = init_device_mesh("cpu", {world()}, {"dp"});
  auto build = [&](std::shared_ptr<fsdp::OffloadPolicy> policy) {
    auto model = std::make_shared<MLPStack>(Device::meta());
    for (auto* b : model->blocks()) fsdp::fully_shard(*b, {.mesh = mesh, .offload_policy = policy});
    fsdp::fully_shard(*model, {.mesh = mesh, .offload_policy = policy});
    model->to_empty(Device::cpu());
    model->init_weights(9);
    return model;
  };
  auto plain = build(nullptr);
  auto offloaded = build(std::make_shared<fsdp::CPUOffloadPolicy>(/*pin=*/true));
  optim::AdamW a(plain->parameters(), {.lr = 1e-2}), b(offloaded->parameters(), {.lr = 1e-2});
  for (uint64_t step = 0; step < 2; ++step) {
    Tensor x = randn({12, 15}, 20 + step), y = randn({12, 5}, 30 + step);
    autograd::backward(mean(square((*plain)(local_rows(x)) - local_rows(y))));
    autograd::backward(mean(square((*offloaded)(local_rows(x)) - local_rows(y))));
    a.step();
    b.step();
    a.zero_grad();
    b.zero_grad();
  }
  auto pa = plain->parameters(), pb = offloaded->parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    CHECK(local_tensor(pb[i]).device().is_cpu());
    CHECK(testing::equal(local_tensor(pa[i]), local_tensor(pb[i])));
  }
}

namespace {
// Two branches under one root; the loss may leave branch b out.
class TwoBranch : public nn::Module {
 public:
  explicit TwoBranch(Device d = Device::cpu()) {
    a = register_module("a", std::make_shared<MLP>(15, 7, 15, d));
    b = register_module("b", std::make_shared<MLP>(15, 6, 15, d));
    head = register_module("head", std::make_shared<nn::Linear>(15, 5, true, d));
  }
  Tensor forward(const Tensor& x) override {
    Tensor ya = (*a)(x), yb = (*b)(x);  // b always runs forward
    return (*head)(use_b ? ya + yb : ya);
  }
  bool use_b = true;
  std::shared_ptr<MLP> a, b;
  std::shared_ptr<nn::Linear> head;
};
}  // namespace

TEST_CASE("a group that ran forward but not backward is resharded and not reduced", "[fsdp][unreached]") {
  int w = world();
  auto mesh = init_device_mesh("cpu", {w}, {"dp"});
  TwoBranch ref;
  ref.init_weights(4);
  ref.to(DType::F64);
  TwoBranch model(Device::meta());
  fsdp::fully_shard(*model.a, {.mesh = mesh});
  fsdp::fully_shard(*model.b, {.mesh = mesh, .reshard_after_forward = false});  // stays unsharded until the end
  fsdp::fully_shard(model, {.mesh = mesh});
  model.to_empty(Device::cpu());
  model.init_weights(4);
  model.to(DType::F64);
  auto g = std::vector<dist::ProcessGroupPtr>{mesh->get_group(0)};
  for (bool use_b : {false, true, false}) {
    INFO("branch b in the loss: " << use_b);
    ref.use_b = model.use_b = use_b;
    Tensor x = randn({12, 15}, 40 + use_b, DType::F64), y = randn({12, 5}, 50, DType::F64);
    autograd::backward(mean(square(ref(x) - y)));
    reset(g);
    autograd::backward(mean(square(model(local_rows(x)) - local_rows(y))));
    CHECK(counts(g).rs == (use_b ? 3 : 2) * (w > 1));  // b's group reduces nothing when unreached
    check_sharded_parity(model, ref, 1e-9, 1e-12);    // everything resharded; b's grads undefined
    ref.zero_grad();
    model.zero_grad();
  }
  // unshard(async) and then a forward that does not wait on the handle itself.
  auto handle = fsdp::unshard(*model.a, true);
  Tensor x = randn({12, 15}, 60, DType::F64);
  CHECK_CLOSE(model(local_rows(x)), local_rows(ref(x)), 1e-12, 1e-12);
  (void)handle;
  autograd::clear_tape();
  fsdp::reset_iter_state(model);
}

TEST_CASE("a group whose parameters are all frozen is gathered but never reduced", "[fsdp][frozen]") {
  int w = world();
  auto mesh = init_device_mesh("cpu", {w}, {"dp"});
  MLPStack ref;
  ref.init_weights(6);
  ref.to(DType::F64);
  MLPStack model(Device::meta());
  for (auto& p : model.blocks()[1]->parameters()) p.set_requires_grad(false);
  for (auto& p : ref.blocks()[1]->parameters()) p.set_requires_grad(false);
  for (auto* b : model.blocks()) fsdp::fully_shard(*b, {.mesh = mesh});
  fsdp::fully_shard(model, {.mesh = mesh});
  model.to_empty(Device::cpu());
  model.init_weights(6);
  model.to(DType::F64);
  auto g = std::vector<dist::ProcessGroupPtr>{mesh->get_group(0)};
  Tensor x = randn({12, 15}, 61, DType::F64), y = randn({12, 5}, 62, DType::F64);
  autograd::backward(mean(square(ref(x) - y)));
  reset(g);
  autograd::backward(mean(square(model(local_rows(x)) - local_rows(y))));
  Counts c = counts(g);
  CHECK(c.ag == 7 * (w > 1));  // forward: 3 blocks + root; backward: the blocks again (the root keeps its own)
  CHECK(c.rs == 3 * (w > 1));  // blocks 0 and 2 and the root: the frozen block reduces nothing
  for (auto& p : model.blocks()[1]->parameters()) CHECK_FALSE(p.grad().defined());
  check_sharded_parity(model, ref, 1e-9, 1e-12);
}
