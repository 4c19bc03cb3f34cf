// Training-step throughput and peak memory of the GPT benchmark model
// (4 layers, d=256, 4 heads, seq 128, batch 8, vocab 256, AdamW; or another
// depth and width, one head per 64 channels; or the Llama of the same sizes),
// with a per-op time breakdown of one step and the step against its GEMM
// floor: the FLOPs of the step's matrix products (the Linear layers' and the
// output layer's, forward and backward: every call of the kernel table's
// gemm) at the peak this CPU measures in the same run (runtime/cpu/peak.h:
// the f32 FMA loop, or for bf16 the unit its products run on), a time no
// implementation of the step can beat, and its products by shape and kernel
// with the rate of each. Attention's block products are counted with
// attention, a non-GEMM kernel here.
//   bench_step [steps] [layers] [width] [f32|bf16] [gpt2|llama] [auto|onednn|amx]
//   (bf16: parameters, activations and AdamW state all in bf16, to profile
//   the 16-bit kernels; the last: which kernel runs the bf16 products,
//   cpu::set_bf16_path, to compare Tessera's AMX kernel with oneDNN's)
#include <sys/resource.h>

#include <chrono>
#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "nn/models.h"
#include "nn/optim.h"
#include "runtime/allocator.h"
#include "runtime/cpu/blas.h"
#include "runtime/cpu/peak.h"
#include "runtime/parallel.h"
#include "runtime/profiler.h"

using namespace tessera;

int main(int argc, char** argv) {
  int steps = argc > 1 ? std::atoi(argv[1]) : 20;
  nn::TransformerConfig cfg;
  cfg.vocab_size = 256;
  cfg.block_size = 128;
  cfg.n_layer = argc > 2 ? std::atoi(argv[2]) : 4;
  cfg.n_embd = argc > 3 ? std::atoi(argv[3]) : 256;
  cfg.n_head = cfg.n_embd / 64;
  std::string dtype = argc > 4 ? argv[4] : "f32";
  cfg.arch = argc > 5 ? argv[5] : "gpt2";
  std::string bf16_path = argc > 6 ? argv[6] : "auto";
  if (steps < 1 || cfg.n_layer < 1 || cfg.n_embd < 64 || cfg.n_embd % 64 != 0 ||
      (dtype != "f32" && dtype != "bf16") || (cfg.arch != "gpt2" && cfg.arch != "llama") ||
      (bf16_path != "auto" && bf16_path != "onednn" && bf16_path != "amx")) {
    std::fprintf(stderr,
                 "usage: bench_step [steps >= 1] [layers >= 1] [width, a multiple of 64] [f32|bf16] [gpt2|llama] "
                 "[auto|onednn|amx]\n");
    return 2;
  }
  if (bf16_path != "auto") {
    if (bf16_path == "amx" && !cpu::amx_kernel_here()) {
      std::fprintf(stderr, "bench_step: Tessera's AMX kernel needs AMX tiles with oneDNN's bf16 kernels; not here\n");
      return 2;
    }
    cpu::set_bf16_path(bf16_path == "amx" ? cpu::Bf16Path::Amx : cpu::Bf16Path::OneDnn);
  }
  cfg.tie_embeddings = true;
  cfg.bias = cfg.arch == "gpt2";
  int64_t batch = 8, seq = 128;
  auto made = nn::make_model(cfg);
  nn::LanguageModel& model = *made;
  model.init_weights(1);
  if (dtype == "bf16") model.to(DType::BF16);
  optim::AdamW opt(model.parameters(), {.lr = 3e-4, .weight_decay = 0.1});
  Tensor x = randint({batch, seq}, 0, 256, 1), y = randint({batch, seq}, 0, 256, 2);
  reset_peak_memory_stats();
  int64_t base = memory_stats().allocated_bytes;
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  double rss_setup = usage.ru_maxrss / 1024.0;  // high-water mark after building the model
  double total = 0;
  for (int s = 0; s < steps + 3; ++s) {
    auto t0 = std::chrono::steady_clock::now();
    Tensor loss = nn::cross_entropy(model(x), y);
    autograd::backward(loss);
    nn::clip_grad_norm_(model.parameters(), 1.0);
    opt.step();
    opt.zero_grad();
    double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (s >= 3) total += ms;
  }
  double per = total / steps;
  // One more step under the profiler for the per-op breakdown.
  profiler::enable(true);
  auto t0 = std::chrono::steady_clock::now();
  Tensor loss = nn::cross_entropy(model(x), y);
  autograd::backward(loss);
  nn::clip_grad_norm_(model.parameters(), 1.0);
  opt.step();
  opt.zero_grad();
  double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  profiler::enable(false);
  std::printf("%s", profiler::format_summary(ms).c_str());
  profiler::Entry gemm = profiler::kernel_time("gemm");
  std::printf("GEMM %.1f ms (%.1f%% of the step, %lld products), everything else %.1f ms (%.1f%%)\n",
              gemm.total_ms, 100.0 * gemm.total_ms / ms, static_cast<long long>(gemm.calls),
              ms - gemm.total_ms, 100.0 * (ms - gemm.total_ms) / ms);
  // The floor: the products' FLOPs at the peak measured now, on these threads.
  const cpu::Peak peak = cpu::measure_dtype_peak(dtype == "bf16" ? DType::BF16 : DType::F32, num_threads());
  const double floor_ms = peak.flops > 0 ? gemm.flops / peak.flops * 1e3 : 0;
  std::printf("floor: %.2f GFLOP of products a step at the measured peak of %.1f GFLOP/s (%s, %d thread%s) = "
              "%.1f ms\n",
              gemm.flops / 1e9, peak.flops / 1e9, peak.unit, num_threads(), num_threads() == 1 ? "" : "s", floor_ms);
  std::printf("step %.1f ms (the mean above) = %.2f x the floor; the products ran at %.1f GFLOP/s (%.2f of the "
              "peak) in the profiled step\n",
              per, floor_ms > 0 ? per / floor_ms : 0.0, gemm.total_ms > 0 ? gemm.flops / gemm.total_ms / 1e6 : 0.0,
              gemm.total_ms > 0 && peak.flops > 0 ? gemm.flops / (gemm.total_ms * 1e-3) / peak.flops : 0.0);
  // The products by shape and kernel, most time first: which of them keep the
  // step from its floor.
  const std::string by_shape = "gemm ";  // the profiler's kinds "gemm OP m x n x k KERNEL"
  const std::vector<profiler::Entry> shapes = profiler::kernel_summary(by_shape);
  std::printf("products by shape, most time first (op m x n x k, kernel: calls, ms, GFLOP/s, of the peak):\n");
  for (size_t i = 0; i < std::min<size_t>(8, shapes.size()); ++i) {
    const profiler::Entry& e = shapes[i];
    const double rate = e.total_ms > 0 ? e.flops / (e.total_ms * 1e-3) : 0;
    std::printf("  %-36s %3lld  %7.1f  %6.1f  %.2f\n", e.name.substr(by_shape.size()).c_str(), static_cast<long long>(e.calls),
                e.total_ms, rate / 1e9, peak.flops > 0 ? rate / peak.flops : 0.0);
  }
  if (shapes.size() > 8) std::printf("  (%zu more shapes)\n", shapes.size() - 8);
  // The biggest work besides the products: every op but the layers whose
  // time is their products, and those layers' own remainder (bias sums, views).
  std::vector<std::pair<double, std::string>> others;
  double linear_ms = 0;
  for (const auto& e : profiler::summary()) {
    if (e.name == "linear" || e.name == "linear.backward" || e.name == "matmul" || e.name == "matmul.backward")
      linear_ms += e.total_ms;
    else
      others.push_back({e.total_ms, e.name});
  }
  others.push_back({std::max(0.0, linear_ms - gemm.total_ms), "(linear and matmul outside their products)"});
  std::sort(others.rbegin(), others.rend());
  std::printf("biggest non-GEMM work:");
  for (size_t i = 0; i < std::min<size_t>(5, others.size()); ++i)
    std::printf("%s %s %.1f ms", i ? "," : "", others[i].second.c_str(), others[i].first);
  std::printf("\n");
  getrusage(RUSAGE_SELF, &usage);
  std::printf(
      "%lldx%lld threads %d  step %.1f ms  tokens/s %.0f  peak tensors %.1f MiB (params %.1f MiB)  "
      "peak RSS %.1f MiB (+%.1f MiB over setup)\n",
      static_cast<long long>(cfg.n_layer), static_cast<long long>(cfg.n_embd), num_threads(), per,
      batch * seq / per * 1000.0, memory_stats().peak_allocated_bytes / 1048576.0, base / 1048576.0,
      usage.ru_maxrss / 1024.0, usage.ru_maxrss / 1024.0 - rss_setup);
}
