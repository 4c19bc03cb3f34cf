// tessera-train: trains a language model on the embedded default (the
// fortunes corpus, byte tokens) or on given data, then prints a sample.
//
//   tessera-train                         # the embedded default (make train)
//   tessera-train --preset tiny --training.steps 20
//   tessera-train --config run.toml --optimizer.lr 1e-3
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>

#include "nn/generate.h"
#include "nn/models.h"
#include "nn/optim.h"
#include "runtime/allocator.h"
#include "runtime/parallel.h"
#include "tools/config.h"
#include "tools/data.h"

using namespace tessera;
namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;

std::string format_duration(double seconds) {
  int s = static_cast<int>(std::lround(std::max(0.0, seconds)));
  return s >= 60 ? fmt::format("{}m{:02}s", s / 60, s % 60) : fmt::format("{}s", s);
}

nn::TransformerConfig model_config(const tools::TrainConfig& c) {
  nn::TransformerConfig m;
  m.vocab_size = c.model.vocab_size;
  m.block_size = c.training.seq_len;
  m.n_layer = c.model.n_layer;
  m.n_head = c.model.n_head;
  m.n_kv_head = c.model.n_kv_head;
  m.n_embd = c.model.n_embd;
  m.ffn_hidden = c.model.ffn_hidden;
  m.dropout = c.model.dropout;
  m.bias = c.model.bias;
  m.tie_embeddings = c.model.tie_embeddings;
  m.activation_checkpoint = c.activation_checkpoint.mode == "full";
  return m;
}

// Train and validation tokens for the configured dataset (prepared once, then cached).
std::pair<std::vector<uint16_t>, std::vector<uint16_t>> load_data(const tools::TrainConfig& c) {
  std::string train_path, val_path;
  if (c.training.dataset == "shards") {
    train_path = c.training.train_shard;
    val_path = c.training.val_shard;
  } else {
    bool text = c.training.dataset == "text";
    std::string name = text ? fs::path(c.training.text).stem().string() : "fortunes";
    train_path = (fs::path(c.training.data_dir) / (name + "_train.bin")).string();
    val_path = (fs::path(c.training.data_dir) / (name + "_val.bin")).string();
    if (!fs::exists(train_path) || !fs::exists(val_path)) {
      auto files = text ? std::vector<std::string>{c.training.text} : data::default_corpus_files();
      std::printf("preparing %s: %zu text file(s) -> %s, %s\n", name.c_str(), files.size(),
                  train_path.c_str(), val_path.c_str());
      data::prepare_text_dataset(files, c.training.data_dir, name);
    }
  }
  return {data::read_shard(train_path), data::read_shard(val_path)};
}

double evaluate(nn::LanguageModel& model, const data::Loader& val, int64_t batches, int64_t batch) {
  autograd::NoGradGuard no_grad;
  model.eval();
  double total = 0;
  for (int64_t i = 0; i < batches; ++i) {
    auto [x, y] = val.eval_batch(i, batch);
    total += nn::cross_entropy(model(x), y).item();
  }
  model.train();
  return total / static_cast<double>(batches);
}

int run(int argc, char** argv) {
  tools::TrainConfig cfg;
  if (!tools::parse_args(cfg, argc, argv, "tessera-train")) return 0;
  tools::validate(cfg);
  const auto& T = cfg.training;

  auto [train_tokens, val_tokens] = load_data(cfg);
  for (const auto* toks : {&train_tokens, &val_tokens})
    for (uint16_t t : *toks)
      TS_CHECK(t < cfg.model.vocab_size, "token {} in the data is outside model.vocab_size {}", t,
               cfg.model.vocab_size);
  double baseline = data::unigram_baseline(train_tokens, val_tokens, cfg.model.vocab_size);
  data::Loader train(std::move(train_tokens), T.seq_len, static_cast<uint64_t>(cfg.job.seed));
  data::Loader val(std::move(val_tokens), T.seq_len, static_cast<uint64_t>(cfg.job.seed));

  nn::TransformerConfig mcfg = model_config(cfg);
  std::shared_ptr<nn::LanguageModel> model;
  if (cfg.model.arch == "llama") model = std::make_shared<nn::Llama>(mcfg, Device::meta());
  else model = std::make_shared<nn::GPT>(mcfg, Device::meta());
  model->to_empty(Device::cpu());
  model->init_weights(static_cast<uint64_t>(cfg.job.seed));

  // Weight decay on matrices only (nanoGPT's grouping).
  TensorList decay, no_decay;
  for (auto& [name, p] : model->named_parameters()) (p.dim() >= 2 ? decay : no_decay).push_back(p);
  std::unique_ptr<optim::Optimizer> opt;
  if (cfg.optimizer.name == "sgd") {
    opt = std::make_unique<optim::SGD>(model->parameters(),
                                       optim::SGDOptions{.lr = cfg.optimizer.lr, .momentum = cfg.optimizer.momentum,
                                                         .weight_decay = cfg.optimizer.weight_decay});
  } else {
    opt = std::make_unique<optim::AdamW>(
        std::vector<optim::ParamGroup>{{decay, cfg.optimizer.lr, cfg.optimizer.weight_decay},
                                       {no_decay, cfg.optimizer.lr, 0.0}},
        optim::AdamWOptions{.lr = cfg.optimizer.lr, .beta1 = cfg.optimizer.beta1, .beta2 = cfg.optimizer.beta2,
                            .eps = cfg.optimizer.eps});
  }
  optim::WarmupCosine schedule{cfg.optimizer.lr, cfg.optimizer.lr * cfg.lr_scheduler.min_lr_ratio,
                               cfg.lr_scheduler.warmup_steps, T.steps};

  int64_t micro = T.batch_size / T.grad_accum;
  int64_t tokens_per_step = T.batch_size * T.seq_len;
  std::printf("model %s: %d layers, d=%lld, %lld parameters | %d threads\n", cfg.model.arch.c_str(),
              static_cast<int>(mcfg.n_layer), static_cast<long long>(mcfg.n_embd),
              static_cast<long long>(model->num_parameters()), num_threads());
  std::printf("data: %lld train tokens, %lld validation tokens | %lld tokens/step | unigram baseline %.4f\n",
              static_cast<long long>(train.num_tokens()), static_cast<long long>(val.num_tokens()),
              static_cast<long long>(tokens_per_step), baseline);

  auto start = Clock::now();
  auto window_start = start;
  int64_t window_tokens = 0;
  double last_val = NAN;
  for (int64_t step = 0; step < T.steps; ++step) {
    double lr = schedule.lr_at(step);
    opt->set_lr(lr);
    double loss_sum = 0;
    for (int64_t m = 0; m < T.grad_accum; ++m) {
      auto [x, y] = train.batch(step * T.grad_accum + m, micro, 0, 1);
      Tensor loss = nn::cross_entropy((*model)(x), y);
      loss_sum += loss.item();
      autograd::backward(loss * (1.0 / static_cast<double>(T.grad_accum)));
    }
    double gnorm = T.max_norm > 0 ? nn::clip_grad_norm_(model->parameters(), T.max_norm)
                                  : nn::grad_norm(model->parameters());
    opt->step();
    opt->zero_grad();
    window_tokens += tokens_per_step;
    double loss = loss_sum / static_cast<double>(T.grad_accum);
    TS_CHECK(std::isfinite(loss), "training diverged at step {}: loss is {}", step + 1, loss);
    bool last = step + 1 == T.steps;
    if ((step + 1) % T.eval_interval == 0 || last)
      last_val = evaluate(*model, val, T.eval_batches, micro);
    if ((step + 1) % cfg.metrics.log_interval == 0 || last || step == 0) {
      auto now = Clock::now();
      double window = std::chrono::duration<double>(now - window_start).count();
      double elapsed = std::chrono::duration<double>(now - start).count();
      double eta = elapsed / static_cast<double>(step + 1) * static_cast<double>(T.steps - step - 1);
      std::printf("step %5lld/%lld | loss %.4f | val %.4f | lr %.2e | grad norm %.3f | %6.0f tok/s | "
                  "peak mem %.0f MiB | eta %s\n",
                  static_cast<long long>(step + 1), static_cast<long long>(T.steps), loss, last_val, lr,
                  gnorm, static_cast<double>(window_tokens) / window,
                  static_cast<double>(memory_stats().peak_bytes) / 1048576.0, format_duration(eta).c_str());
      std::fflush(stdout);
      window_start = now;
      window_tokens = 0;
    }
  }
  double total = std::chrono::duration<double>(Clock::now() - start).count();
  std::printf("done: %lld steps in %s | validation loss %.4f vs unigram baseline %.4f (%.1f%% lower)\n",
              static_cast<long long>(T.steps), format_duration(total).c_str(), last_val, baseline,
              100.0 * (baseline - last_val) / baseline);

  if (cfg.sample.max_new_tokens > 0) {
    std::vector<int64_t> prompt;
    for (unsigned char ch : cfg.sample.prompt) prompt.push_back(ch);
    std::printf("\n--- sample (temperature %.2f, top-k %lld) ---\n%s", cfg.sample.temperature,
                static_cast<long long>(cfg.sample.top_k), cfg.sample.prompt.c_str());
    nn::generate(*model, prompt,
                 {cfg.sample.max_new_tokens, cfg.sample.temperature, cfg.sample.top_k,
                  static_cast<uint64_t>(cfg.job.seed)},
                 [](int64_t t) {
                   std::putchar(static_cast<int>(t));
                   std::fflush(stdout);
                 });
    std::printf("\n---\n");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tessera-train: error: %s\n", e.what());
    return 2;
  }
}
