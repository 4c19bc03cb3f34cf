// tessera-train's presets (--preset NAME; tools/config.h): a whole run's
// settings under one name, applied before config files and keys.
#include "tools/config.h"

namespace tessera::tools {

const std::vector<Preset>& presets() {
  static const std::vector<Preset> p = {
      {"default", "GPT, 4 layers, d=256, byte tokens, on the fortunes corpus (as `make train`)",
       [](TrainConfig&) {}},
      {"tiny", "GPT, 2 layers, d=64: seconds, for tests and smoke runs",
       [](TrainConfig& c) {
         c.model.n_layer = 2;
         c.model.n_head = 2;
         c.model.n_embd = 64;
         c.training.batch_size = 8;
         c.training.seq_len = 64;
         c.training.steps = 150;  // a second or two, and the validation loss ~17% under the unigram baseline
         c.training.eval_interval = 50;
         c.training.eval_batches = 4;
         c.lr_scheduler.warmup_steps = 5;
         c.metrics.log_interval = 10;
         c.sample.max_new_tokens = 50;
       },
       "tiny"},
      {"llama-small", "Llama (RoPE, RMSNorm, SwiGLU, GQA), 4 layers, d=256, 8 heads, 2 KV heads",
       [](TrainConfig& c) {
         c.model.arch = "llama";
         c.model.n_head = 8;
         c.model.n_kv_head = 2;
         c.model.bias = false;
       }},
      {"moe-small", "Llama with a mixture of experts: 4 layers, d=128, 8 experts of width 128, top-2, "
                    "DeepSeek-V3's loss-free bias balancing (step 0.01)",
       [](TrainConfig& c) {
         c.model.arch = "llama";
         c.model.n_head = 4;
         c.model.n_kv_head = 2;
         c.model.n_embd = 128;
         c.model.bias = false;
         c.model.moe_experts = 8;
         c.model.moe_top_k = 2;
         c.model.moe_hidden = 128;
         c.model.moe_router = "sigmoid";
         c.model.moe_balance = "bias";
         c.model.moe_balance_coeff = 0.01;  // balanced (max/mean < 1.3) within 200 steps: docs/moe.md
       },
       "moe"},
      {"gpt-medium", "GPT, 8 layers, d=384, 6 heads: a larger run",
       [](TrainConfig& c) {
         c.model.n_layer = 8;
         c.model.n_head = 6;
         c.model.n_embd = 384;
         c.training.steps = 2000;
       },
       "medium"},
  };
  return p;
}

}  // namespace tessera::tools
