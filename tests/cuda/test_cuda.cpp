// The CUDA backend against the CPU (suite `cuda`), in the manner of ggml's
// test-backend-ops: every kernel family in every float dtype at odd sizes,
// through non-contiguous views, broadcasting and in-place updates; a GPT and a
// Llama forward/backward against the CPU; the caching allocator after warm-up;
// device-side index errors. Without a GPU (or in a build without CUDA) the
// whole binary reports SKIP: exit code 77, never a pass.
#include <cstdio>
#include <cstdlib>

#include "../helpers.h"
#include "autograd/functions.h"
#include "autograd/tape.h"
#include "nn/models.h"
#include "runtime/allocator.h"
#include "runtime/cuda_backend.h"
#include "runtime/stream.h"
#include "tests/cuda/cuda_helpers.h"

using namespace tessera;
using namespace tessera::cuda_testing;

namespace {

// Runs before Catch2's main: no device, no tests (SKIP, 77). A GPU machine
// whose driver is older than the build's toolkit fails instead (exit 1): it
// is an installation to fix, not a machine without GPUs.
const int skip_without_gpu = [] {
  if (!kStandIn && !cuda::is_available()) {
    const std::string why = cuda::unavailable_reason();
    if (cuda::install_is_broken()) {
      std::printf("FAIL: %s\n", why.c_str());
      std::exit(1);
    }
    std::printf("SKIP: %s\n", why.c_str());
    std::exit(77);
  }
  return 0;
}();

}  // namespace

TEST_CASE("cuda: copies between host and device keep values, strides and dtypes", "[cuda]") {
  for (int64_t n : {1, 7, 129, 4097}) {
    Tensor h = randn({n, 3}, 1);
    Tensor d = h.to(kGpu);
    CHECK(testing::equal(d.to(Device::cpu()), h));
    Tensor t = ops::transpose(d, 0, 1);  // strided on the device
    CHECK(testing::equal(t.to(Device::cpu()), ops::contiguous(ops::transpose(h, 0, 1))));
    Tensor b = empty({n, 3}, DType::BF16, kGpu);
    ops::copy_(b, h);  // converting host -> device
    CHECK(testing::equal(b.to(Device::cpu()), ops::to(h, DType::BF16)));
  }
  Tensor x = randn({5}, 2, DType::F32, kGpu);
  CHECK_THROWS_WITH(x.data<float>(), Catch::Contains("to(Device::cpu())"));
}

TEST_CASE("cuda: elementwise, reductions and views against the CPU", "[cuda]") {
  using ops::BinaryOp;
  using ops::UnaryOp;
  for (DType dt : kFloats) {
    for (int64_t n : {1, 7, 129, 4097}) {
      Tensor a = rand_on({3, n}, 10 + n, dt, Device::cpu()), b = rand_on({1, n}, 20 + n, dt, Device::cpu());
      Tensor ga = a.to(kGpu), gb = b.to(kGpu);
      for (UnaryOp op : {UnaryOp::Exp, UnaryOp::Tanh, UnaryOp::Gelu, UnaryOp::GeluTanh, UnaryOp::Silu,
                         UnaryOp::Relu, UnaryOp::Abs, UnaryOp::Square, UnaryOp::Sigmoid, UnaryOp::Neg}) {
        CHECK_MATCHES_CPU(ops::unary(op, ga), ops::unary(op, a), dt);
        CHECK_MATCHES_CPU(ops::unary_backward(op, ops::expand(gb, {3, n}), ga, ops::unary(op, ga)),
                    ops::unary_backward(op, ops::expand(b, {3, n}), a, ops::unary(op, a)), dt);
      }
      for (BinaryOp op : {BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div, BinaryOp::Maximum})
        CHECK_MATCHES_CPU(ops::binary(op, ga, gb), ops::binary(op, a, b), dt);  // broadcast
      CHECK(testing::equal(ops::binary(BinaryOp::Gt, ga, gb).to(Device::cpu()), ops::binary(BinaryOp::Gt, a, b)));
      CHECK_MATCHES_CPU(ops::mul(ops::transpose(ga, 0, 1), 2.0), ops::mul(ops::transpose(a, 0, 1), 2.0), dt);  // strided input
      CHECK_MATCHES_CPU(ops::sum(ga, {1}), ops::sum(a, {1}), dt);
      CHECK_MATCHES_CPU(ops::sum(ga, {0}), ops::sum(a, {0}), dt);
      CHECK_MATCHES_CPU(ops::sum(ga), ops::sum(a), dt);
      CHECK_MATCHES_CPU(ops::max(ga, 1).first, ops::max(a, 1).first, dt);
      CHECK(testing::equal(ops::argmax(ga, 1).to(Device::cpu()), ops::argmax(a, 1)));
      Tensor x = ops::clone(a), gx = ops::clone(ga);  // in place, optimizer-style
      ops::add_(x, ops::expand(b, {3, n}), 0.25);
      ops::add_(gx, ops::expand(gb, {3, n}), 0.25);
      CHECK_MATCHES_CPU(gx, x, dt);
      ops::clamp_(x, -0.5, 0.5);
      ops::clamp_(gx, -0.5, 0.5);
      CHECK_MATCHES_CPU(gx, x, dt);
      CHECK_MATCHES_CPU(ops::where(ops::binary(BinaryOp::Gt, ga, gb), ga, gb),
                  ops::where(ops::binary(BinaryOp::Gt, a, b), a, b), dt);
    }
  }
  Tensor i = arange(0, 4097);
  CHECK(testing::equal(ops::sum(i.to(kGpu)).to(Device::cpu()), ops::sum(i)));
  std::vector<Tensor> xs{randn({129}, 3), randn({7, 9}, 4)};
  std::vector<Tensor> gxs{xs[0].to(kGpu), xs[1].to(kGpu)};
  CHECK(ops::sum_squares(gxs, kGpu).item() == Approx(ops::sum_squares(xs, Device::cpu()).item()).epsilon(1e-12));
}

TEST_CASE("cuda: matmul, softmax, norms, embedding, cross-entropy, RoPE and attention against the CPU", "[cuda]") {
  for (DType dt : kFloats) {
    for (int64_t n : {1, 7, 129}) {
      Tensor a = rand_on({n, 33}, 1, dt, Device::cpu()), w = rand_on({65, 33}, 2, dt, Device::cpu());
      Tensor ga = a.to(kGpu), gw = w.to(kGpu);
      CHECK_MATCHES_CPU(ops::matmul(ga, ops::transpose(gw, 0, 1)), ops::matmul(a, ops::transpose(w, 0, 1)), dt);
      CHECK_MATCHES_CPU(ops::linear(ga, gw, Tensor()), ops::linear(a, w, Tensor()), dt);
      CHECK_MATCHES_CPU(ops::softmax(ga, -1), ops::softmax(a, -1), dt);
      CHECK_MATCHES_CPU(ops::log_softmax(ga, 0), ops::log_softmax(a, 0), dt);
      Tensor lw = rand_on({33}, 3, dt, Device::cpu()), lb = rand_on({33}, 4, dt, Device::cpu());
      auto r = ops::layer_norm(a, lw, lb, 1e-5);
      auto gr = ops::layer_norm(ga, lw.to(kGpu), lb.to(kGpu), 1e-5);
      CHECK_MATCHES_CPU(gr.y, r.y, dt);
      CHECK(gr.rstd.dtype() == r.rstd.dtype());
      auto gg = ops::layer_norm_backward(ga, ga, lw.to(kGpu), gr.mean, gr.rstd, true);
      auto g = ops::layer_norm_backward(a, a, lw, r.mean, r.rstd, true);
      CHECK_MATCHES_CPU(gg.dx, g.dx, dt);
      CHECK_MATCHES_CPU(gg.dweight, g.dweight, dt);
      CHECK_MATCHES_CPU(ops::rms_norm(ga, lw.to(kGpu), 1e-6).y, ops::rms_norm(a, lw, 1e-6).y, dt);
      Tensor idx = randint({n}, 0, 65, 5);
      CHECK_MATCHES_CPU(ops::embedding(gw, idx.to(kGpu)), ops::embedding(w, idx), dt);
      CHECK_MATCHES_CPU(ops::embedding_backward(ga, idx.to(kGpu), 65), ops::embedding_backward(a, idx, 65), dt);
      Tensor logits = rand_on({n, 65}, 6, dt, Device::cpu());
      Tensor target = randint({n}, 0, 65, 7);
      auto ce = ops::cross_entropy(logits, target, 3);
      auto gce = ops::cross_entropy(logits.to(kGpu), target.to(kGpu), 3);
      CHECK_MATCHES_CPU(gce.loss, ce.loss, dt);
      Tensor one = ones({}, dt);
      CHECK_MATCHES_CPU(ops::cross_entropy_backward(one.to(kGpu), logits.to(kGpu), target.to(kGpu), gce.lse, 3, gce.count),
                  ops::cross_entropy_backward(one, logits, target, ce.lse, 3, ce.count), dt);
    }
    // Attention: GQA (4 query heads over 2 key/value heads), causal and not, odd lengths.
    Tensor q = rand_on({2, 4, 13, 8}, 8, dt, Device::cpu()), k = rand_on({2, 2, 13, 8}, 9, dt, Device::cpu());
    Tensor v = rand_on({2, 2, 13, 8}, 10, dt, Device::cpu()), dout = rand_on({2, 4, 13, 8}, 11, dt, Device::cpu());
    for (bool causal : {true, false}) {
      auto r = ops::attention(q, k, v, causal, 0.35);
      auto gr = ops::attention(q.to(kGpu), k.to(kGpu), v.to(kGpu), causal, 0.35);
      CHECK_MATCHES_CPU(gr.out, r.out, dt);
      auto g = ops::attention_backward(dout, q, k, v, r.out, r.lse, causal, 0.35);
      auto gg = ops::attention_backward(dout.to(kGpu), q.to(kGpu), k.to(kGpu), v.to(kGpu), gr.out, gr.lse, causal, 0.35);
      CHECK_ATTENTION_GRAD_MATCHES_CPU(gg.dq, g.dq, dt);
      CHECK_ATTENTION_GRAD_MATCHES_CPU(gg.dk, g.dk, dt);
      CHECK_ATTENTION_GRAD_MATCHES_CPU(gg.dv, g.dv, dt);
    }
    Tensor x = rand_on({2, 3, 11, 16}, 12, dt, Device::cpu());
    Tensor cs = randn({11, 8}, 13), sn = randn({11, 8}, 14);
    CHECK_MATCHES_CPU(ops::rope(x.to(kGpu), ops::to(cs, dt).to(kGpu), ops::to(sn, dt).to(kGpu), false),
                ops::rope(x, ops::to(cs, dt), ops::to(sn, dt), false), dt);
  }
}

TEST_CASE("cuda: a bf16 embedding's gradient is summed in f32, as the CPU's", "[cuda]") {
  // 4096 rows onto one token: summed in bf16 the row would stop at 256.
  std::vector<int64_t> ids(4099, 5);
  ids[7] = 0, ids[2000] = 2, ids[4098] = 0;
  Tensor idx = from_vector(ids, {4099});
  Tensor grad = ops::to(full({4099, 3}, 1.0), DType::BF16);
  Tensor want = ops::embedding_backward(grad, idx, 6);
  Tensor got = ops::embedding_backward(grad.to(kGpu), idx.to(kGpu), 6).to(Device::cpu());
  CHECK(testing::equal(got, want));
  CHECK(ops::to(got, DType::F64).to_vector<double>()[15] == 4096);
}

TEST_CASE("cuda: random fills equal the CPU's for the same seed and counters", "[cuda]") {
  for (DType dt : {DType::F32, DType::BF16, DType::F64}) {
    Tensor cpu = empty({129, 7}, dt), gpu = empty({129, 7}, dt, kGpu);
    RandomSpec spec{42, hash_name("layer.weight"), 1000, {}};
    ops::uniform_(cpu, -0.1, 0.1, spec);
    ops::uniform_(gpu, -0.1, 0.1, spec);
    CHECK(testing::equal(gpu.to(Device::cpu()), cpu));  // bit for bit
    ops::normal_(cpu, 0.0, 0.02, spec);
    ops::normal_(gpu, 0.0, 0.02, spec);
    CHECK(rel_error(gpu, cpu) <= 1e-6);
  }
}

TEST_CASE("cuda: an out-of-range index is raised at the next sync, naming the kernel", "[cuda]") {
  Tensor w = randn({10, 4}, 1, DType::F32, kGpu);
  Tensor idx = from_vector(std::vector<int64_t>{1, 12}, {2}).to(kGpu);
  Tensor out = ops::embedding(w, idx);  // queued: no host sync, no throw yet
  CHECK_THROWS_WITH(out.to(Device::cpu()), Catch::Contains("embedding") && Catch::Contains("12"));
  CHECK_NOTHROW(ops::embedding(w, from_vector(std::vector<int64_t>{3}, {1}).to(kGpu)).to(Device::cpu()));
}

namespace {
// Loss and every gradient of one forward/backward of `model` on `device`.
template <class Model>
std::vector<Tensor> model_step(const nn::TransformerConfig& cfg, Device device) {
  auto model = std::make_shared<Model>(cfg, device);
  Tensor idx = randint({2, 17}, 0, cfg.vocab_size, 3, device);
  Tensor target = randint({2 * 17}, 0, cfg.vocab_size, 4, device);
  Tensor logits = model->forward(idx);
  Tensor loss = cross_entropy(tessera::reshape(logits, {2 * 17, cfg.vocab_size}), target);
  autograd::backward(loss);
  std::vector<Tensor> out{loss};
  for (auto& [name, p] : model->named_parameters()) out.push_back(p.grad());
  return out;
}
}  // namespace

TEST_CASE("cuda: GPT-2 and Llama loss and gradients equal the CPU's in f32", "[cuda][model]") {
  nn::TransformerConfig cfg = tiny_config();
  auto cpu = model_step<nn::GPT>(cfg, Device::cpu());
  auto gpu = model_step<nn::GPT>(cfg, kGpu);
  REQUIRE(cpu.size() == gpu.size());
  for (size_t i = 0; i < cpu.size(); ++i) CHECK(rel_error(gpu[i], cpu[i]) <= 1e-4);
  cfg.n_kv_head = 2;
  auto lcpu = model_step<nn::Llama>(cfg, Device::cpu());
  auto lgpu = model_step<nn::Llama>(cfg, kGpu);
  for (size_t i = 0; i < lcpu.size(); ++i) CHECK(rel_error(lgpu[i], lcpu[i]) <= 1e-4);
}

TEST_CASE("cuda: after warm-up a training step reaches no cudaMalloc and no host sync", "[cuda][memory]") {
  nn::TransformerConfig cfg = tiny_config();
  auto model = std::make_shared<nn::GPT>(cfg, kGpu);
  Tensor idx = randint({2, 17}, 0, cfg.vocab_size, 3, kGpu);
  Tensor target = randint({2 * 17}, 0, cfg.vocab_size, 4, kGpu);
  auto step = [&] {
    Tensor loss = cross_entropy(tessera::reshape(model->forward(idx), {2 * 17, cfg.vocab_size}), target);
    autograd::backward(loss);
    for (auto& [name, p] : model->named_parameters()) p.set_grad(Tensor());
  };
  step();
  step();
  synchronize(kGpu);
  int64_t mallocs = memory_stats(kGpu).num_system_allocs, syncs = host_sync_count();
  for (int i = 0; i < 3; ++i) step();
  CHECK(host_sync_count() == syncs);
  synchronize(kGpu);
  CHECK(memory_stats(kGpu).num_system_allocs == mallocs);
}
