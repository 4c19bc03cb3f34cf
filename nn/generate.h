// Autoregressive sampling from a language model.
#pragma once

#include <functional>
#include <vector>

#include "nn/models.h"

namespace tessera::nn {

struct SamplingOptions {
  int64_t max_new_tokens = 200;
  double temperature = 1.0;  // 0: greedy (argmax)
  int64_t top_k = 0;         // 0: the whole vocabulary
  uint64_t seed = 0;         // the same seed gives the same tokens
  // Asked before each token: true ends the sampling there (a stop signal).
  std::function<bool()> stop = {};
};

// Appends sampled tokens to `prompt` (at least one token) and returns only the
// new ones. The model runs in eval mode without gradients; the context is the
// last block_size tokens. With a callback, each token is reported as it comes.
std::vector<int64_t> generate(LanguageModel& model, const std::vector<int64_t>& prompt,
                              const SamplingOptions& options,
                              const std::function<void(int64_t)>& on_token = {});

}  // namespace tessera::nn
