// GPT-2 124M (12 layers, d 768, 12 heads, seq 1024, vocab 50304) training
// steps on one GPU: bf16 parameters, AdamW, gradient clipping; tokens/s and
// MFU (6N FLOPs per token plus attention's 12 L T d, against the device's
// peak bf16 rate, TESSERA_PEAK_TFLOPS to override). benchmarks/torch_gpu.py is
// the same model in PyTorch eager; tools/gpu-check.sh runs both side by side.
// Without a GPU it says so and exits 77. With `profile` as the third argument
// it then runs one more step under the per-op profiler, the GPU synchronized
// after each top-level op (so each op's time is its kernels', launches
// included), and prints the table.
//
//   build/benchmarks/bench_gpu [steps] [batch] [profile]
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "nn/models.h"
#include "nn/optim.h"
#include "runtime/allocator.h"
#include "runtime/cuda_backend.h"
#include "runtime/profiler.h"
#include "runtime/stream.h"

using namespace tessera;

int main(int argc, char** argv) {
  if (!cuda::is_available()) {
    std::printf("SKIP: %s\n", cuda::built() ? "no CUDA device is visible" : "this build has no CUDA backend");
    return 77;
  }
  const int steps = argc > 1 ? std::atoi(argv[1]) : 10;
  const int64_t batch = argc > 2 ? std::atoll(argv[2]) : 8, seq = 1024;
  const Device gpu = Device::cuda(0);
  nn::TransformerConfig cfg;
  cfg.vocab_size = 50304;
  cfg.block_size = seq;
  cfg.n_layer = 12;
  cfg.n_head = 12;
  cfg.n_embd = 768;
  nn::GPT model(cfg, gpu);
  model.to(DType::BF16);
  optim::AdamW opt(model.parameters(), {.lr = 3e-4, .weight_decay = 0.1});
  Tensor x = randint({batch, seq}, 0, cfg.vocab_size, 1, gpu);
  Tensor y = randint({batch, seq}, 0, cfg.vocab_size, 2, gpu);
  auto step = [&] {
    Tensor loss = nn::cross_entropy(model(x), y);
    autograd::backward(loss);
    nn::clip_grad_norm_(model.parameters(), 1.0);
    opt.step();
    opt.zero_grad();
    return loss;
  };
  for (int s = 0; s < 3; ++s) step();  // warm-up: caches, cuBLASLt plans
  synchronize(gpu);
  auto t0 = std::chrono::steady_clock::now();
  Tensor loss;
  for (int s = 0; s < steps; ++s) loss = step();
  synchronize(gpu);
  const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / steps;
  const double tokens = static_cast<double>(batch * seq) / sec;
  const double n = static_cast<double>(model.num_parameters());
  const double flops_per_token = 6 * n + 12.0 * cfg.n_layer * seq * cfg.n_embd;
  const char* peak_env = std::getenv("TESSERA_PEAK_TFLOPS");
  const double peak = (peak_env ? std::atof(peak_env) : 989.0) * 1e12;  // H100/H200 SXM dense bf16
  std::printf("tessera  %s  batch %lld x %lld  step %.1f ms  tokens/s %.0f  MFU %.1f%% (of %.0f TFLOP/s)  "
              "loss %.4f  peak %.2f GiB\n",
              cuda::device_name(0).c_str(), static_cast<long long>(batch), static_cast<long long>(seq),
              sec * 1e3, tokens, 100.0 * tokens * flops_per_token / peak, peak / 1e12, loss.item(),
              memory_stats(gpu).peak_allocated_bytes / 1073741824.0);
  const std::string refusal = cuda::cudnn_attention_refusal();
  std::printf("attention: %lld calls on cuDNN%s%s\n", static_cast<long long>(cuda::cudnn_attention_calls()),
              refusal.empty() ? "" : "; cuDNN refused: ", refusal.c_str());
  if (argc > 3 && std::string(argv[3]) == "profile") {
    profiler::set_scope_barrier([] { synchronize(Device::cuda(0)); });
    profiler::enable(true);
    const auto p0 = std::chrono::steady_clock::now();
    step();
    synchronize(gpu);
    profiler::enable(false);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - p0).count();
    std::printf("one step, synchronized after each op: %.1f ms\n%s", ms, profiler::format_summary(ms).c_str());
  }
}
