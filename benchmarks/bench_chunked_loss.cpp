// The output layer and loss of a GPT-2-sized vocabulary, whole against in
// chunks (linear_cross_entropy): forward + backward time and the peak
// allocated bytes above the inputs, alternating the two paths so the
// machine's drift falls on both. Prints each run, then the medians and the
// ratio unchunked / chunked (>= 1: the chunked path is no slower).
//   build/benchmarks/bench_chunked_loss [tokens=8192] [d=768] [vocab=50257] [pairs=3] [chunk_rows=0]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "autograd/functions.h"
#include "autograd/tape.h"
#include "nn/models.h"
#include "runtime/allocator.h"
#include "runtime/parallel.h"

using namespace tessera;

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? std::atoll(argv[1]) : 8192, c = argc > 2 ? std::atoll(argv[2]) : 768;
  const int64_t v = argc > 3 ? std::atoll(argv[3]) : 50257;
  const int pairs = argc > 4 ? std::atoi(argv[4]) : 3;
  int64_t chunk = argc > 5 ? std::atoll(argv[5]) : 0;
  if (chunk <= 0) {  // what LanguageModel::loss picks by default
    nn::TransformerConfig cfg;
    cfg.vocab_size = v;
    cfg.n_embd = 64, cfg.n_head = 1, cfg.n_layer = 1, cfg.block_size = 8;
    chunk = nn::GPT::on_meta(cfg)->chunk_rows_for(n);
  }
  Tensor x = randn({n, c}, 1), w = ops::mul(randn({v, c}, 2), 0.02), t = randint({n}, 0, v, 3);
  std::printf("output layer + loss, f32: %lld tokens x d %lld x vocab %lld (logits %.2f GiB), %d thread(s); "
              "chunks of %lld rows\n",
              static_cast<long long>(n), static_cast<long long>(c), static_cast<long long>(v),
              static_cast<double>(n * v * 4) / (1 << 30), num_threads(), static_cast<long long>(chunk));
  auto run = [&](bool chunked, double& peak_gib) {
    Tensor xx = ops::clone(x), ww = ops::clone(w);
    xx.set_requires_grad(true);
    ww.set_requires_grad(true);
    reset_peak_memory_stats(Device::cpu());
    const int64_t base = memory_stats(Device::cpu()).allocated_bytes;
    const auto t0 = std::chrono::steady_clock::now();
    Tensor loss = chunked ? linear_cross_entropy(xx, ww, t, chunk) : cross_entropy(linear(xx, ww), t);
    autograd::backward(loss);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    peak_gib = static_cast<double>(memory_stats(Device::cpu()).peak_allocated_bytes - base) / (1 << 30);
    return ms;
  };
  double warm = 0;
  run(true, warm);  // first touches: page faults and the allocator's cache
  run(false, warm);
  std::vector<double> whole, chunked;
  double peak_whole = 0, peak_chunked = 0;
  for (int i = 0; i < pairs; ++i) {
    for (bool ch : {i % 2 == 1, i % 2 == 0}) {  // alternate which goes first
      double peak = 0;
      const double ms = run(ch, peak);
      (ch ? chunked : whole).push_back(ms);
      (ch ? peak_chunked : peak_whole) = peak;
      std::printf("  %-9s %9.1f ms  peak %.3f GiB\n", ch ? "chunked" : "whole", ms, peak);
    }
  }
  auto median = [](std::vector<double> a) {
    std::sort(a.begin(), a.end());
    return a[a.size() / 2];
  };
  const double mw = median(whole), mc = median(chunked);
  std::printf("median: whole %.1f ms, chunked %.1f ms, speed ratio whole/chunked %.3f; peak whole %.3f GiB, "
              "chunked %.3f GiB (%.3f GiB less)\n",
              mw, mc, mw / mc, peak_whole, peak_chunked, peak_whole - peak_chunked);
  return 0;
}
