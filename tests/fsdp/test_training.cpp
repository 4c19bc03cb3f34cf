// Training parity: FSDP on 1-4 ranks (and a 2x2 HSDP mesh) against a
// single-process reference on the same global batch, 10 AdamW steps, every
// loss and every local shard (and gradient) compared with the matching slice.
#include "tests/fsdp/fsdp_helpers.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

constexpr int64_t kGlobalBatch = 12;  // divisible by 1, 2, 3 and 4 ranks

struct Config {
  fsdp::ReshardAfterForward raf;
  bool explicit_prefetch = false;
  bool checkpoint = false;
  bool tie = true;
  bool freeze_some = false;
  MeshPtr mesh;
  DType dtype = DType::F64;
  // f32 runs use SGD: Adam normalises gradients that are zero up to rounding
  // (the key bias's, for one) into full-size steps, so f32 rounding noise
  // would be amplified into differences no reduction order can avoid.
  bool sgd = false;
  std::string name;
};

nn::TransformerConfig gpt_config(const Config& c) {
  nn::TransformerConfig t;
  t.vocab_size = world() * 4 + 1;  // uneven rows: trailing ranks hold fewer
  t.block_size = 9;
  t.n_layer = 3;
  t.n_head = 3;
  t.n_embd = 12;
  t.tie_embeddings = c.tie;
  t.activation_checkpoint = c.checkpoint;
  return t;
}

void freeze(nn::Module& m) {
  // Train biases and norms only in block 1 (BitFit-style mixed requires_grad in one group).
  for (auto& [name, p] : m.named_parameters())
    if (name.find("h.1.") != std::string::npos && name.find(".weight") != std::string::npos &&
        name.find("ln_") == std::string::npos)
      p.set_requires_grad(false);
}

void run_gpt_parity(const Config& c) {
  INFO(c.name << " on " << c.mesh->str());
  auto tcfg = gpt_config(c);
  nn::GPT ref(tcfg);
  ref.init_weights(7);
  ref.to(c.dtype);
  auto model = nn::GPT::on_meta(tcfg);
  fsdp::FullyShardOptions opt{.mesh = c.mesh, .reshard_after_forward = c.raf};
  for (auto& b : model->blocks) fsdp::fully_shard(*b, opt);
  fsdp::fully_shard(*model, opt);
  model->to_empty(Device::cpu());
  model->init_weights(7);
  model->to(c.dtype);
  if (c.freeze_some) {
    freeze(ref);
    freeze(*model);
  }
  if (c.explicit_prefetch) {
    for (size_t i = 0; i + 1 < model->blocks.size(); ++i)
      fsdp::set_modules_to_forward_prefetch(*model->blocks[i], {model->blocks[i + 1].get()});
    for (size_t i = model->blocks.size() - 1; i > 0; --i)
      fsdp::set_modules_to_backward_prefetch(*model->blocks[i], {model->blocks[i - 1].get()});
  }
  check_sharded_parity(*model, ref, 0, 0, false);  // identical init, bit for bit
  auto trainable = [](nn::Module& m) {
    TensorList out;
    for (auto& p : m.parameters())
      if (p.requires_grad()) out.push_back(p);
    return out;
  };
  std::unique_ptr<optim::Optimizer> ropt, fopt;
  if (c.sgd) {
    ropt = std::make_unique<optim::SGD>(trainable(ref), optim::SGDOptions{.lr = 0.1, .momentum = 0.9});
    fopt = std::make_unique<optim::SGD>(trainable(*model), optim::SGDOptions{.lr = 0.1, .momentum = 0.9});
  } else {
    ropt = std::make_unique<optim::AdamW>(trainable(ref), optim::AdamWOptions{.lr = 1e-2, .weight_decay = 0.1});
    fopt = std::make_unique<optim::AdamW>(trainable(*model), optim::AdamWOptions{.lr = 1e-2, .weight_decay = 0.1});
  }
  double tol = c.dtype == DType::F64 ? 1e-9 : 1e-4;
  for (int step = 0; step < 10; ++step) {
    INFO("step " << step);
    Tensor x = randint({kGlobalBatch, 9}, 0, tcfg.vocab_size, 100 + step);
    Tensor y = randint({kGlobalBatch, 9}, 0, tcfg.vocab_size, 200 + step);
    manual_seed(step);
    Tensor rloss = nn::cross_entropy(ref(x), y);
    autograd::backward(rloss);
    manual_seed(step);
    Tensor floss = nn::cross_entropy((*model)(local_rows(x)), local_rows(y));
    autograd::backward(floss);
    CHECK(global_mean(floss) == Approx(rloss.item()).epsilon(tol));
    double rn = nn::clip_grad_norm_(trainable(ref), 1.0).item();
    double fn = nn::clip_grad_norm_(trainable(*model), 1.0).item();
    CHECK(fn == Approx(rn).epsilon(tol));
    check_sharded_parity(*model, ref, tol, c.dtype == DType::F64 ? 1e-11 : 1e-6);
    ropt->step();
    fopt->step();
    bool to_none = step % 2 == 0;  // also accumulate into existing .grad
    ropt->zero_grad(to_none);
    fopt->zero_grad(to_none);
  }
  check_sharded_parity(*model, ref, tol, c.dtype == DType::F64 ? 1e-11 : 1e-6, false);
}

std::vector<MeshPtr> test_meshes() {
  int w = world();
  std::vector<MeshPtr> out{init_device_mesh("cpu", {w}, {"dp"})};
  if (w == 4) out.push_back(init_device_mesh("cpu", {2, 2}, {"replicate", "shard"}));
  return out;
}

}  // namespace

TEST_CASE("GPT parity across reshard_after_forward settings", "[fsdp][parity]") {
  for (auto& mesh : test_meshes()) {
    run_gpt_parity({.raf = {}, .mesh = mesh, .name = "default"});
    run_gpt_parity({.raf = true, .mesh = mesh, .name = "raf true"});
    run_gpt_parity({.raf = false, .mesh = mesh, .name = "raf false"});
    if (mesh->size(-1) % 2 == 0 && mesh->size(-1) > 2) run_gpt_parity({.raf = 2, .mesh = mesh, .name = "raf 2"});
  }
}

TEST_CASE("GPT parity with prefetch, checkpointing, untied and frozen parameters", "[fsdp][parity]") {
  for (auto& mesh : test_meshes()) {
    run_gpt_parity({.raf = true, .explicit_prefetch = true, .mesh = mesh, .name = "explicit prefetch"});
    run_gpt_parity({.raf = true, .checkpoint = true, .mesh = mesh, .name = "activation checkpointing"});
    run_gpt_parity({.raf = {}, .tie = false, .mesh = mesh, .name = "untied embeddings"});
    run_gpt_parity({.raf = true, .freeze_some = true, .mesh = mesh, .name = "frozen parameters"});
  }
}

TEST_CASE("f32 GPT parity", "[fsdp][parity]") {
  for (auto& mesh : test_meshes())
    run_gpt_parity({.raf = true, .mesh = mesh, .dtype = DType::F32, .sgd = true, .name = "f32"});
}

TEST_CASE("MLP stack parity with awkward sizes", "[fsdp][parity]") {
  for (auto& mesh : test_meshes()) {
    MLPStack ref;
    ref.init_weights(3);
    ref.to(DType::F64);
    MLPStack model(Device::meta());
    shard_and_init(model, {.mesh = mesh}, 3, DType::F64);
    optim::AdamW ropt(ref.parameters(), {.lr = 1e-2}), fopt(model.parameters(), {.lr = 1e-2});
    for (int step = 0; step < 10; ++step) {
      Tensor x = randn({kGlobalBatch, 15}, 300 + step, DType::F64), y = randn({kGlobalBatch, 5}, 400 + step, DType::F64);
      Tensor rl = mean(square(ref(x) - y));
      autograd::backward(rl);
      Tensor fl = mean(square(model(local_rows(x)) - local_rows(y)));
      autograd::backward(fl);
      CHECK(global_mean(fl) == Approx(rl.item()).epsilon(1e-10));
      check_sharded_parity(model, ref, 1e-9, 1e-12);
      ropt.step();
      fopt.step();
      ropt.zero_grad();
      fopt.zero_grad();
    }
  }
}
