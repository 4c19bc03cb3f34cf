// FSDP behaviour beyond parity: mixed precision, hand-driven controls,
// placements, offload policies and the error paths. (Communication counts,
// event orders, accumulation and traces: test_communication.cpp.)
#include "tests/fsdp/fsdp_helpers.h"

using namespace tessera;
using namespace tessera::testing;

TEST_CASE("bf16 parameters with f32 reduction match a same-rounding reference", "[fsdp][mixed_precision]") {
  std::vector<MeshPtr> meshes = {init_device_mesh("cpu", {world()}, {"dp"})};
  if (world() % 2 == 0)  // HSDP: 2 replicas of world/2 shards (2x2 at 4 ranks)
    meshes.push_back(init_device_mesh("cpu", {2, world() / 2}, {"replicate", "shard"}));
  for (const auto& mesh : meshes) {
    INFO("mesh " << mesh->str());
    fsdp::MixedPrecisionPolicy mp{.param_dtype = DType::BF16, .reduce_dtype = DType::F32};
    MLPStack model(Device::meta());
    shard_and_init(model, {.mesh = mesh, .mp_policy = mp}, 4);
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
  shard_and_init(model, {.mesh = mesh}, 2, DType::F64);
  // unshard(async) before the first forward gives the full parameters.
  auto handle = fsdp::unshard(*model.blocks()[0], true);
  handle.wait();
  CHECK(!is_dtensor(model.mlps->operator[](0).parameters()[0]));
  CHECK(testing::equal(model.mlps->operator[](0).parameters()[0], ref.mlps->operator[](0).parameters()[0]));
  fsdp::reshard(*model.blocks()[0]);
  CHECK(is_dtensor(model.mlps->operator[](0).parameters()[0]));
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
    CHECK_FALSE(is_dtensor(block.parameters()[0]));  // unsharded inside
    return TensorList{static_cast<MLP&>(block).fc1->forward(in[0])};
  });
  Tensor z = randn({12, 17}, 4, DType::F64);  // 12 rows: whole rows on 1-4 ranks
  TensorList out = fc1_only({local_rows(z)});
  CHECK(out[0].shape() == Shape{local_rows(z).size(0), 8});
  CHECK(is_dtensor(block.parameters()[0]));  // resharded after (reshard_after_forward)
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
  {  // Different meshes under one root (experts' FSDP under expert parallelism): the same numbers.
    auto other = init_device_mesh("cpu", {w, 1}, {"x", "y"});  // HSDP, replicated over w
    MLPStack one, two;
    for (auto* b : one.blocks()) fsdp::fully_shard(*b, {.mesh = mesh});
    fsdp::fully_shard(one, {.mesh = mesh});
    fsdp::fully_shard(*two.blocks()[0], {.mesh = other});
    for (size_t i = 1; i < two.blocks().size(); ++i) fsdp::fully_shard(*two.blocks()[i], {.mesh = mesh});
    fsdp::fully_shard(two, {.mesh = mesh});
    Tensor x = randn({2, 15}, 1 + static_cast<uint64_t>(mesh->get_local_rank(0)));
    Tensor la = sum(one(x));
    autograd::backward(la);
    Tensor lb = sum(two(x));
    autograd::backward(lb);
    CHECK(la.item() == lb.item());
    CHECK(std::abs(nn::grad_norm(one.parameters()).item() - nn::grad_norm(two.parameters()).item()) <=
          1e-6 * nn::grad_norm(one.parameters()).item());
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

TEST_CASE("no-sync micro-batches accumulate bf16 gradients in the f32 reduce dtype", "[fsdp][mixed_precision]") {
  auto mesh = init_device_mesh("cpu", {world()}, {"dp"});
  fsdp::MixedPrecisionPolicy mp{.param_dtype = DType::BF16, .reduce_dtype = DType::F32};
  MLPStack model(Device::meta());
  shard_and_init(model, {.mesh = mesh, .mp_policy = mp}, 4);
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
  CHECK_FALSE(is_dtensor(model.out->weight));  // still the unsharded parameter
  reset(g);
  fsdp::set_requires_gradient_sync(model, true);
  fsdp::set_reshard_after_backward(model, true);
  step(model, local_rows(idx));
  CHECK(counts(g).ag == 0);
  CHECK(is_dtensor(model.out->weight));
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
  CHECK(is_dtensor(partial.out->weight));
  CHECK_FALSE(is_dtensor(partial.out->bias));
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
