// The cuda suite, second part: what a training step needs beyond one kernel
// per family (test_cuda.cpp). Attention where the online softmax rescales
// (T > 256), at head sizes 64 and 128 and T != S; the backward kernels of
// softmax, RMSNorm and LayerNorm (with its bias); Linear with a bias,
// transposed and batched products and slices at odd offsets (their own
// cuBLASLt plans); non-contiguous destinations; dropout's mask; the embedding
// gradient of a skewed batch, bit for bit; many tensors scaled and squared in
// one pass; AdamW fused and clipping end to end; a bf16 GPT-2 against f32;
// FSDP at world 1 (a group of one) against the CPU; a checkpoint saved on the GPU read
// on the CPU and back; a step of FSDP and AdamW after warm-up without
// cudaMalloc or host sync. Skips with the rest of the binary without a GPU.
#include <cstdlib>
#include <filesystem>
#include <string>

#include "autograd/functions.h"
#include "autograd/tape.h"
#include "dtensor/device_mesh.h"
#include "dtensor/dtensor.h"
#include "fsdp/checkpoint.h"
#include "fsdp/fully_shard.h"
#include "nn/models.h"
#include "nn/optim.h"
#include "runtime/allocator.h"
#include "runtime/cuda_backend.h"
#include "runtime/random.h"
#include "runtime/stream.h"
#include "tests/cuda/cuda_helpers.h"

using namespace tessera;
using namespace tessera::cuda_testing;

namespace {

// Equal bits after a copy to the host.
bool same_bits(const Tensor& gpu, const Tensor& cpu) {
  Tensor a = ops::to(gpu.to(Device::cpu()), DType::F64), b = ops::to(cpu, DType::F64);
  if (a.shape() != b.shape()) return false;
  auto va = a.to_vector<double>(), vb = b.to_vector<double>();
  for (size_t i = 0; i < va.size(); ++i)
    if (va[i] != vb[i] && !(std::isnan(va[i]) && std::isnan(vb[i]))) return false;
  return true;
}

}  // namespace

TEST_CASE("cuda: attention where the online softmax rescales, head sizes 64 and 128, T != S", "[cuda][attention]") {
  struct Shape4 {
    int64_t b, h, hkv, t, s, d;
    bool causal;
  };
  const Shape4 shapes[] = {
      {1, 2, 2, 300, 300, 64, true},   // T > 256: several key chunks, the running max moves
      {2, 4, 2, 129, 129, 128, true},  // head size 128, GQA
      {1, 3, 1, 17, 411, 64, false},   // T != S: a few queries over many keys
      {1, 2, 2, 520, 33, 32, false},   // many queries over few keys
  };
  for (DType dt : {DType::F32, DType::BF16, DType::F64}) {
    for (const auto& sh : shapes) {
      INFO(dtype_name(dt) << " B " << sh.b << " H " << sh.h << "/" << sh.hkv << " T " << sh.t << " S " << sh.s
                          << " D " << sh.d << (sh.causal ? " causal" : ""));
      // Logits of a few units: the softmax is peaked, so a wrong rescale shows.
      Tensor q = ops::mul(rand_on({sh.b, sh.h, sh.t, sh.d}, 1, dt, Device::cpu()), 2.0);
      Tensor k = rand_on({sh.b, sh.hkv, sh.s, sh.d}, 2, dt, Device::cpu());
      Tensor v = rand_on({sh.b, sh.hkv, sh.s, sh.d}, 3, dt, Device::cpu());
      Tensor dout = rand_on({sh.b, sh.h, sh.t, sh.d}, 4, dt, Device::cpu());
      const double scale = 1.0 / std::sqrt(static_cast<double>(sh.d));
      auto r = ops::attention(q, k, v, sh.causal, scale);
      auto gr = ops::attention(q.to(kGpu), k.to(kGpu), v.to(kGpu), sh.causal, scale);
      CHECK_MATCHES_CPU(gr.out, r.out, dt);
      CHECK(rel_error(gr.lse, r.lse) <= tolerance(dt));
      auto g = ops::attention_backward(dout, q, k, v, r.out, r.lse, sh.causal, scale);
      auto gg = ops::attention_backward(dout.to(kGpu), q.to(kGpu), k.to(kGpu), v.to(kGpu), gr.out, gr.lse, sh.causal,
                                        scale);
      CHECK_ATTENTION_GRAD_MATCHES_CPU(gg.dq, g.dq, dt);
      CHECK_ATTENTION_GRAD_MATCHES_CPU(gg.dk, g.dk, dt);
      CHECK_ATTENTION_GRAD_MATCHES_CPU(gg.dv, g.dv, dt);
    }
  }
}

TEST_CASE("cuda: softmax, RMSNorm and LayerNorm backward (with the bias gradient) against the CPU", "[cuda]") {
  for (DType dt : kFloats) {
    for (int64_t rows : {1, 33, 4097}) {
      INFO(dtype_name(dt) << " rows " << rows);
      const int64_t n = 768 + 5;
      Tensor x = rand_on({rows, n}, 5, dt, Device::cpu()), dy = rand_on({rows, n}, 6, dt, Device::cpu());
      Tensor w = rand_on({n}, 7, dt, Device::cpu()), b = rand_on({n}, 8, dt, Device::cpu());
      Tensor y = ops::softmax(x, -1);
      CHECK_MATCHES_CPU(ops::softmax_backward(dy.to(kGpu), y.to(kGpu), -1), ops::softmax_backward(dy, y, -1), dt);
      Tensor ly = ops::log_softmax(x, -1);
      CHECK_MATCHES_CPU(ops::log_softmax_backward(dy.to(kGpu), ly.to(kGpu), -1), ops::log_softmax_backward(dy, ly, -1),
                        dt);
      auto rms = ops::rms_norm(x, w, 1e-6);
      auto grms = ops::rms_norm(x.to(kGpu), w.to(kGpu), 1e-6);
      auto rb = ops::rms_norm_backward(dy, x, w, rms.rstd, true);
      auto grb = ops::rms_norm_backward(dy.to(kGpu), x.to(kGpu), w.to(kGpu), grms.rstd, true);
      CHECK_MATCHES_CPU(grb.dx, rb.dx, dt);
      CHECK_MATCHES_CPU(grb.dweight, rb.dweight, dt);
      // LayerNorm with a bias: its gradient is the column sum of dy (two passes on CUDA).
      auto ln = ops::layer_norm(x, w, b, 1e-5);
      auto gln = ops::layer_norm(x.to(kGpu), w.to(kGpu), b.to(kGpu), 1e-5);
      auto lb = ops::layer_norm_backward(dy, x, w, ln.mean, ln.rstd, true);
      auto glb = ops::layer_norm_backward(dy.to(kGpu), x.to(kGpu), w.to(kGpu), gln.mean, gln.rstd, true);
      CHECK_MATCHES_CPU(glb.dx, lb.dx, dt);
      CHECK_MATCHES_CPU(glb.dweight, lb.dweight, dt);
      REQUIRE(glb.dbias.defined());
      CHECK_MATCHES_CPU(glb.dbias, lb.dbias, dt);
    }
  }
}

TEST_CASE("cuda: Linear with a bias, transposed and batched products, slices at odd offsets", "[cuda][gemm]") {
  for (DType dt : kFloats) {
    INFO(dtype_name(dt));
    Tensor x = rand_on({3, 37, 65}, 9, dt, Device::cpu()), w = rand_on({47, 65}, 10, dt, Device::cpu());
    Tensor b = rand_on({47}, 11, dt, Device::cpu()), gy = rand_on({3, 37, 47}, 12, dt, Device::cpu());
    CHECK_MATCHES_CPU(ops::linear(x.to(kGpu), w.to(kGpu), b.to(kGpu)), ops::linear(x, w, b), dt);
    auto lg = ops::linear_backward(gy, x, w, {true, true, true});
    auto glg = ops::linear_backward(gy.to(kGpu), x.to(kGpu), w.to(kGpu), {true, true, true});
    for (size_t i = 0; i < 3; ++i) CHECK_MATCHES_CPU(glg[i], lg[i], dt);
    // Batched, and with each operand transposed (strided views).
    Tensor a = rand_on({5, 19, 23}, 13, dt, Device::cpu()), c = rand_on({5, 23, 29}, 14, dt, Device::cpu());
    CHECK_MATCHES_CPU(ops::matmul(a.to(kGpu), c.to(kGpu)), ops::matmul(a, c), dt);
    Tensor at = ops::transpose(rand_on({5, 23, 19}, 15, dt, Device::cpu()), 1, 2);
    Tensor ct = ops::transpose(rand_on({5, 29, 23}, 16, dt, Device::cpu()), 1, 2);
    // [5, 29, 23] x [5, 23, 19], both strided views.
    CHECK_MATCHES_CPU(ops::matmul(ops::transpose(ct.to(kGpu), 1, 2), ops::transpose(at.to(kGpu), 1, 2)),
                      ops::matmul(ops::transpose(ct, 1, 2), ops::transpose(at, 1, 2)), dt);
    CHECK_MATCHES_CPU(ops::matmul(at.to(kGpu), ct.to(kGpu)), ops::matmul(at, ct), dt);
    // Operands that start 1, 3 and 7 elements into a buffer: only 2-byte
    // alignment for bf16, so the plan must not assume 16.
    for (int64_t off : {1, 3, 7}) {
      Tensor flat = rand_on({off + 19 * 23 + 23 * 29}, 17 + off, dt, Device::cpu());
      Tensor a1 = ops::view(ops::narrow(flat, 0, off, 19 * 23), {19, 23});
      Tensor c1 = ops::view(ops::narrow(flat, 0, off + 19 * 23, 23 * 29), {23, 29});
      Tensor gflat = flat.to(kGpu);
      Tensor ga1 = ops::view(ops::narrow(gflat, 0, off, 19 * 23), {19, 23});
      Tensor gc1 = ops::view(ops::narrow(gflat, 0, off + 19 * 23, 23 * 29), {23, 29});
      CHECK_MATCHES_CPU(ops::matmul(ga1, gc1), ops::matmul(a1, c1), dt);
    }
  }
}

TEST_CASE("cuda: copies and in-place updates into non-contiguous device destinations", "[cuda]") {
  for (DType dt : kFloats) {
    INFO(dtype_name(dt));
    Tensor src = rand_on({13, 7}, 20, dt, Device::cpu());
    Tensor host = zeros({7, 13}, dt), dev = zeros({7, 13}, dt, kGpu);
    Tensor host_t = ops::transpose(host, 0, 1), dev_t = ops::transpose(dev, 0, 1);
    ops::copy_(host_t, src);
    ops::copy_(dev_t, src.to(kGpu));  // host to a strided device view
    CHECK(same_bits(dev, host));
    // A stepped slice, updated in place from another device tensor.
    Tensor hs = ops::slice(host, 1, 1, 13, 3), ds = ops::slice(dev, 1, 1, 13, 3);
    Tensor add = rand_on(hs.shape(), 21, dt, Device::cpu());
    ops::add_(hs, add);
    ops::add_(ds, add.to(kGpu));
    CHECK(rel_error(dev, host) <= tolerance(dt));
    ops::mul_(ds, 0.5);
    ops::mul_(hs, 0.5);
    CHECK(rel_error(dev, host) <= tolerance(dt));
  }
}

TEST_CASE("cuda: dropout draws the CPU's mask for the same seed", "[cuda]") {
  for (DType dt : {DType::F32, DType::BF16}) {
    Tensor x = rand_on({37, 129}, 22, dt, Device::cpu());
    manual_seed(1234);
    Tensor y = dropout(x, 0.3, true);
    manual_seed(1234);
    Tensor gy = dropout(x.to(kGpu), 0.3, true);
    CHECK(same_bits(gy, y));
    // About 30% dropped, the rest scaled by 1 / 0.7.
    auto v = ops::to(gy.to(Device::cpu()), DType::F64).to_vector<double>();
    int64_t zeros_seen = 0;
    for (double e : v) zeros_seen += e == 0;
    CHECK(std::abs(static_cast<double>(zeros_seen) / static_cast<double>(v.size()) - 0.3) < 0.03);
  }
}

TEST_CASE("cuda: the embedding gradient of a skewed batch equals the CPU's bit for bit", "[cuda]") {
  // Zipf-like ids: one token thousands of times, many a few times, most never.
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < 8192; ++i) ids.push_back(i % 3 == 0 ? 7 : (i * i * 2654435761LL) % 501);
  Tensor idx = from_vector(ids, {8, 1024});
  for (DType dt : {DType::F32, DType::BF16, DType::F64}) {
    INFO(dtype_name(dt));
    Tensor grad = rand_on({8, 1024, 96}, 23, dt, Device::cpu());
    Tensor want = ops::embedding_backward(grad, idx, 501);
    Tensor got = ops::embedding_backward(grad.to(kGpu), idx.to(kGpu), 501);
    CHECK(same_bits(got, want));
    // i32 indices too.
    CHECK(same_bits(ops::embedding_backward(grad.to(kGpu), ops::to(idx, DType::I32).to(kGpu), 501), want));
  }
  // An index out of range is raised at the next sync, naming the kernel.
  Tensor bad = from_vector(std::vector<int64_t>{1, 600, 2}, {3});
  Tensor g = ops::embedding_backward(rand_on({3, 4}, 24, DType::F32, kGpu), bad.to(kGpu), 501);
  CHECK_THROWS_WITH(g.to(Device::cpu()), Catch::Contains("embedding") && Catch::Contains("600"));
}

TEST_CASE("cuda: many tensors scaled and squared in one pass, the CPU's bits", "[cuda][optim]") {
  std::vector<std::pair<Shape, DType>> specs;
  for (int i = 0; i < 150; ++i)  // more than one launch's worth of tensors
    specs.push_back({{1 + (i * 37) % 301}, i % 3 == 0 ? DType::BF16 : (i % 3 == 1 ? DType::F32 : DType::F64)});
  std::vector<Tensor> host, dev;
  for (size_t i = 0; i < specs.size(); ++i) {
    host.push_back(rand_on(specs[i].first, 100 + i, specs[i].second, Device::cpu()));
    dev.push_back(host.back().to(kGpu));
  }
  Tensor sq = ops::sum_squares(host, Device::cpu()), gsq = ops::sum_squares(dev, kGpu);
  CHECK(rel_error(gsq, sq) <= 1e-14);
  ops::scale_(host, full({}, 0.987654321, DType::F64));
  ops::scale_(dev, full({}, 0.987654321, DType::F64, kGpu));
  for (size_t i = 0; i < host.size(); ++i) {
    INFO("tensor " << i << " " << dtype_name(host[i].dtype()));
    CHECK(same_bits(dev[i], host[i]));
  }
}

TEST_CASE("cuda: fused AdamW with clipping, three steps of a GPT, against the CPU", "[cuda][optim][model]") {
  auto cfg = tiny_config();
  auto run = [&](Device device) {
    auto model = std::make_shared<nn::GPT>(cfg, device);
    optim::AdamW opt(model->parameters(), {.lr = 3e-3, .weight_decay = 0.1});
    for (int step = 0; step < 3; ++step) {
      Tensor idx = randint({2, 17}, 0, cfg.vocab_size, 30 + step, device);
      Tensor target = randint({2 * 17}, 0, cfg.vocab_size, 40 + step, device);
      Tensor loss = cross_entropy(tessera::reshape(model->forward(idx), {2 * 17, cfg.vocab_size}), target);
      autograd::backward(loss);
      nn::clip_grad_norm_(model->parameters(), 0.1);  // clips: the norm is well above 0.1
      opt.step();
      opt.zero_grad();
    }
    std::vector<Tensor> out;
    for (auto& [name, p] : model->named_parameters()) out.push_back(p);
    const size_t params = out.size();
    for (size_t j = 0; j < params; ++j) out.push_back(opt.state(0, j).exp_avg_sq);
    return out;
  };
  auto cpu = run(Device::cpu()), gpu = run(kGpu);
  REQUIRE(cpu.size() == gpu.size());
  for (size_t i = 0; i < cpu.size(); ++i) {
    INFO("tensor " << i);
    CHECK(rel_error(gpu[i], cpu[i]) <= 1e-4);
  }
}

TEST_CASE("cuda: a bf16 GPT-2 follows the f32 one within bf16's bounds", "[cuda][model]") {
  // Bound: the loss within 2% and every gradient within 6% of its largest
  // element (bf16 keeps 8 bits; 2 layers of matmuls and norms in bf16 with
  // f32 accumulation).
  auto cfg = tiny_config();
  auto step = [&](DType dt) {
    auto model = std::make_shared<nn::GPT>(cfg, kGpu);
    model->to(dt);
    Tensor idx = randint({2, 17}, 0, cfg.vocab_size, 3, kGpu);
    Tensor target = randint({2 * 17}, 0, cfg.vocab_size, 4, kGpu);
    Tensor loss = cross_entropy(tessera::reshape(model->forward(idx), {2 * 17, cfg.vocab_size}), target);
    autograd::backward(loss);
    std::vector<Tensor> out{ops::to(loss, DType::F32).to(Device::cpu())};
    for (auto& [name, p] : model->named_parameters()) out.push_back(ops::to(p.grad(), DType::F32).to(Device::cpu()));
    return out;
  };
  auto f32 = step(DType::F32), bf16 = step(DType::BF16);
  REQUIRE(f32.size() == bf16.size());
  CHECK(std::abs(bf16[0].item() - f32[0].item()) <= 0.02 * std::abs(f32[0].item()));
  for (size_t i = 1; i < f32.size(); ++i) {
    INFO("gradient " << i);
    CHECK(rel_error(bf16[i].to(kGpu), f32[i]) <= 0.06);
  }
}

namespace {
// A GPT sharded by FSDP at world 1 on `device` ("cpu" or "cuda"), AdamW on it.
struct Sharded {
  std::shared_ptr<nn::GPT> model;
  std::unique_ptr<optim::AdamW> opt;
};
Sharded sharded_gpt(const std::string& device) {
  auto cfg = tiny_config();
  MeshPtr mesh = init_device_mesh(device, {1}, {"dp"});
  Sharded s;
  s.model = nn::GPT::on_meta(cfg);
  for (auto& b : s.model->blocks) fsdp::fully_shard(*b, {.mesh = mesh});
  fsdp::fully_shard(*s.model, {.mesh = mesh});
  s.model->to_empty(mesh->device());
  s.model->init_weights(11);
  s.opt = std::make_unique<optim::AdamW>(s.model->parameters(), optim::AdamWOptions{.lr = 1e-2});
  return s;
}
void train_steps(Sharded& s, Device device, int steps, int first = 0) {
  auto cfg = tiny_config();
  for (int step = first; step < first + steps; ++step) {
    Tensor x = randint({4, 9}, 0, cfg.vocab_size, 50 + step, device);
    Tensor y = randint({4, 9}, 0, cfg.vocab_size, 60 + step, device);
    autograd::backward(nn::cross_entropy((*s.model)(x), y));
    nn::clip_grad_norm_(s.model->parameters(), 0.5);
    s.opt->step();
    s.opt->zero_grad();
  }
}
}  // namespace

TEST_CASE("cuda: FSDP at world 1 (a group of one: no collective) trains as on the CPU", "[cuda][fsdp]") {
  Sharded cpu = sharded_gpt("cpu"), gpu = sharded_gpt(kGpuMesh);
  CHECK(local_tensor(gpu.model->parameters().front()).device() == kGpu);
  // The first step's gradients, before any update: within f32's reordering
  // (cuBLAS and the CPU sum the products' terms in different orders).
  auto cfg = tiny_config();
  for (Sharded* s : {&cpu, &gpu}) {
    const Device device = s == &cpu ? Device::cpu() : kGpu;
    Tensor x = randint({4, 9}, 0, cfg.vocab_size, 50, device), y = randint({4, 9}, 0, cfg.vocab_size, 60, device);
    autograd::backward(nn::cross_entropy((*s->model)(x), y));
  }
  auto pc = cpu.model->parameters(), pg = gpu.model->parameters();
  REQUIRE(pc.size() == pg.size());
  for (size_t i = 0; i < pc.size(); ++i) {
    INFO("gradient " << i);
    REQUIRE(pg[i].grad().defined());
    CHECK(local_tensor(pg[i].grad()).device() == kGpu);
    CHECK(rel_error(local_tensor(pg[i].grad()), local_tensor(pc[i].grad())) <= 1e-4);
  }
  cpu.opt->zero_grad();
  gpu.opt->zero_grad();
  // Three AdamW steps (lr 1e-2): Adam divides each gradient by its running
  // size, so a relative difference d in an entry much smaller than its
  // tensor's largest moves that entry's update by up to lr * d * (largest /
  // entry). Measured on an H200: 1.4e-4 to 3.3e-4 of the largest parameter;
  // bound 1e-3, a tenth of one update of lr.
  train_steps(cpu, Device::cpu(), 3);
  train_steps(gpu, kGpu, 3);
  for (size_t i = 0; i < pc.size(); ++i) {
    INFO("parameter " << i);
    CHECK(rel_error(local_tensor(pg[i]), local_tensor(pc[i])) <= 1e-3);
  }
}

TEST_CASE("cuda: a checkpoint saved on the GPU loads on the CPU and back, bit for bit", "[cuda][fsdp][checkpoint]") {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "tessera-cuda-ckpt";
  std::filesystem::remove_all(dir);
  Sharded gpu = sharded_gpt(kGpuMesh);
  train_steps(gpu, kGpu, 2);
  const std::string saved = fsdp::save_checkpoint(dir.string(), 2, *gpu.model, gpu.opt.get());
  Sharded cpu = sharded_gpt("cpu");
  fsdp::load_checkpoint(saved, *cpu.model, cpu.opt.get());
  auto pg = gpu.model->parameters(), pc = cpu.model->parameters();
  for (size_t i = 0; i < pg.size(); ++i) CHECK(same_bits(local_tensor(pg[i]), local_tensor(pc[i])));
  // And back: the CPU's next step saved, loaded into a fresh GPU model.
  train_steps(cpu, Device::cpu(), 1, 2);
  const std::string again = fsdp::save_checkpoint((dir / "again").string(), 3, *cpu.model, cpu.opt.get());
  Sharded back = sharded_gpt(kGpuMesh);
  fsdp::load_checkpoint(again, *back.model, back.opt.get());
  auto pb = back.model->parameters();
  pc = cpu.model->parameters();
  for (size_t i = 0; i < pb.size(); ++i) CHECK(same_bits(local_tensor(pb[i]), local_tensor(pc[i])));
  for (size_t j = 0; j < pb.size(); ++j)
    CHECK(same_bits(local_tensor(back.opt->state(0, j).exp_avg), local_tensor(cpu.opt->state(0, j).exp_avg)));
  std::filesystem::remove_all(dir);
}

TEST_CASE("cuda: after warm-up an FSDP + AdamW + clipping step reaches no cudaMalloc and no host sync", "[cuda][memory][fsdp]") {
  Sharded gpu = sharded_gpt(kGpuMesh);
  train_steps(gpu, kGpu, 2);  // warm-up: the allocator's caches and the streams' events fill
  synchronize(kGpu);
  const int64_t mallocs = memory_stats(kGpu).num_system_allocs, syncs = host_sync_count();
  const int64_t events = memory_stats(kGpu).num_events;
  train_steps(gpu, kGpu, 3, 2);
  CHECK(host_sync_count() == syncs);
  synchronize(kGpu);
  CHECK(memory_stats(kGpu).num_system_allocs == mallocs);
  CHECK(memory_stats(kGpu).num_events <= events + 8);  // the event pool does not grow per step
}

TEST_CASE("cuda: attention on cuDNN (where the build has it) against the CPU, and the fallback", "[cuda][attention][cudnn]") {
  if (kStandIn || !cuda::cudnn_attention_built()) {
    const char* why = kStandIn ? "async_cpu in the GPU's place: no cuDNN"
                               : "this build has no cuDNN frontend (make cudnn-frontend): the own kernels only";
    WARN(why);
    return;
  }
  for (DType dt : {DType::BF16, DType::F16}) {
    for (bool causal : {true, false}) {
      INFO(dtype_name(dt) << (causal ? " causal" : ""));
      Tensor q = rand_on({2, 8, 300, 64}, 31, dt, Device::cpu()), k = rand_on({2, 2, 300, 64}, 32, dt, Device::cpu());
      Tensor v = rand_on({2, 2, 300, 64}, 33, dt, Device::cpu()), dout = rand_on({2, 8, 300, 64}, 34, dt, Device::cpu());
      const int64_t before = cuda::cudnn_attention_calls();
      auto r = ops::attention(q, k, v, causal, 0.125);
      auto gr = ops::attention(q.to(kGpu), k.to(kGpu), v.to(kGpu), causal, 0.125);
      CHECK_MATCHES_CPU(gr.out, r.out, dt);
      CHECK(rel_error(gr.lse, r.lse) <= 1e-3);
      auto g = ops::attention_backward(dout, q, k, v, r.out, r.lse, causal, 0.125);
      auto gg = ops::attention_backward(dout.to(kGpu), q.to(kGpu), k.to(kGpu), v.to(kGpu), gr.out, gr.lse, causal, 0.125);
      CHECK_ATTENTION_GRAD_MATCHES_CPU(gg.dq, g.dq, dt);
      CHECK_ATTENTION_GRAD_MATCHES_CPU(gg.dk, g.dk, dt);
      CHECK_ATTENTION_GRAD_MATCHES_CPU(gg.dv, g.dv, dt);
      INFO("cuDNN's last refusal: " << cuda::cudnn_attention_refusal());
      // Forward and backward on cuDNN, unless TESSERA_CUDNN_ATTENTION=0 (racecheck's run) turned it off.
      const char* env = std::getenv("TESSERA_CUDNN_ATTENTION");
      const bool off = env != nullptr && std::string(env) == "0";
      CHECK(cuda::cudnn_attention_calls() == before + (off ? 0 : 2));
    }
  }
  // f32 is not cuDNN's: the own kernels run it.
  const int64_t before = cuda::cudnn_attention_calls();
  Tensor q = rand_on({1, 2, 40, 64}, 35, DType::F32, kGpu);
  ops::attention(q, q, q, true, 0.125).out.to(Device::cpu());
  CHECK(cuda::cudnn_attention_calls() == before);
}
