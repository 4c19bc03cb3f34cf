#include "nn/generate.h"

#include <algorithm>
#include <cmath>

#include "dtensor/dtensor.h"

namespace tessera::nn {

std::vector<int64_t> generate(LanguageModel& model, const std::vector<int64_t>& prompt,
                              const SamplingOptions& opt, const std::function<void(int64_t)>& on_token) {
  TS_CHECK(!prompt.empty(), "generate: the prompt needs at least one token");
  TS_CHECK(opt.temperature >= 0 && std::isfinite(opt.temperature),
           "generate: temperature must be a finite number >= 0, got {}", opt.temperature);
  TS_CHECK(opt.top_k >= 0, "generate: top_k must be >= 0, got {}", opt.top_k);
  autograd::NoGradGuard no_grad;
  bool was_training = model.is_training();
  model.eval();
  std::vector<int64_t> ctx = prompt, out;
  // The tokens go where the weights are (a DTensor parameter: its local tensor's device).
  Tensor first = model.parameters().front();
  Device device = is_dtensor(first) ? local_tensor(first).device() : first.device();
  int64_t vocab = model.config.vocab_size;
  for (int64_t i = 0; i < opt.max_new_tokens; ++i) {
    if (opt.stop && opt.stop()) break;
    int64_t t = std::min<int64_t>(static_cast<int64_t>(ctx.size()), model.config.block_size);
    std::vector<int64_t> window(ctx.end() - t, ctx.end());
    Tensor logits = model(from_vector(window, {1, t}, device));
    if (is_dtensor(logits)) logits = full_tensor(logits);  // a loss-parallel output layer's
    std::vector<double> last = ops::select(ops::select(logits, 0, 0), 0, t - 1).to_vector<double>();
    int64_t next = 0;
    if (opt.temperature == 0.0) {
      next = std::max_element(last.begin(), last.end()) - last.begin();
    } else {
      double cutoff = -INFINITY;
      if (opt.top_k > 0 && opt.top_k < vocab) {
        std::vector<double> sorted = last;
        std::nth_element(sorted.begin(), sorted.begin() + (opt.top_k - 1), sorted.end(), std::greater<>());
        cutoff = sorted[static_cast<size_t>(opt.top_k - 1)];
      }
      double mx = *std::max_element(last.begin(), last.end());
      std::vector<double> p(last.size(), 0.0);
      double total = 0;
      for (size_t j = 0; j < last.size(); ++j) {
        if (last[j] < cutoff) continue;
        p[j] = std::exp((last[j] - mx) / opt.temperature);
        total += p[j];
      }
      // One uniform per generated token from (seed, position): reproducible.
      auto r = philox4x32({static_cast<uint32_t>(i), 0, 0x67656e00u, 0},
                          {static_cast<uint32_t>(opt.seed), static_cast<uint32_t>(opt.seed >> 32)});
      double u = (static_cast<double>(r[0]) + 0.5) / 4294967296.0 * total;
      next = static_cast<int64_t>(p.size()) - 1;
      for (size_t j = 0; j < p.size(); ++j) {
        if (p[j] == 0.0) continue;
        u -= p[j];
        if (u <= 0) {
          next = static_cast<int64_t>(j);
          break;
        }
      }
    }
    ctx.push_back(next);
    out.push_back(next);
    if (on_token) on_token(next);
  }
  model.train(was_training);
  return out;
}

}  // namespace tessera::nn
