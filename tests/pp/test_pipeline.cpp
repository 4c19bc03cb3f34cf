// Pipeline parallelism against one process (pp/pipeline.h), under mpirun
// with 1-4 ranks: GPT-2 and Llama cut into uneven stages, every schedule, 4
// and 8 micro-batches. The loss, the clipped gradient norm and every
// parameter after 3 AdamW steps equal the same model trained on one process
// with gradient accumulation over the same micro-batches (f64 to 1e-12, f32
// to 1e-5); the messages per rank are the schedule's; activations in flight
// are what the schedule promises; a tied embedding is refused.

#include <cmath>
#include <map>

#include "nn/models.h"
#include "nn/optim.h"
#include "pp/pipeline.h"
#include "tests/helpers.h"

using namespace tessera;


namespace {

dist::ProcessGroupPtr world() {
  dist::init();
  return dist::world();
}

nn::TransformerConfig config(const std::string& arch, int64_t layers) {
  nn::TransformerConfig c;
  c.arch = arch;
  c.vocab_size = 29;
  c.block_size = 6;
  c.n_layer = layers;
  c.n_head = 2;
  c.n_kv_head = arch == "llama" ? 1 : 0;
  c.n_embd = 12;
  c.bias = arch == "gpt2";
  c.tie_embeddings = false;
  c.dropout = 0;
  return c;
}

struct Result {
  std::vector<double> losses, norms;
  std::map<std::string, Tensor> params;  // after the last step, by name
};

// One process, the whole model: each step accumulates the micro-batches'
// gradients (each loss weighted 1/m), clips, steps AdamW.
Result reference(const nn::TransformerConfig& cfg, DType dt, int m, const std::vector<std::pair<Tensor, Tensor>>& batches) {
  auto model = nn::make_model(cfg, Device::meta());
  model->to_empty(Device::cpu());
  model->init_weights(7);
  model->to(dt);
  optim::AdamW opt(model->parameters(), {.lr = 3e-2, .weight_decay = 0.1});
  Result r;
  for (const auto& [idx, targets] : batches) {
    const int64_t bm = idx.size(0) / m;
    double loss = 0;
    for (int i = 0; i < m; ++i) {
      Tensor x = ops::contiguous(ops::narrow(idx, 0, i * bm, bm));
      Tensor y = ops::contiguous(ops::narrow(targets, 0, i * bm, bm));
      Tensor l = mul(nn::cross_entropy((*model)(x), y), 1.0 / m);
      loss += ops::to(l, DType::F64).item();
      autograd::backward(l);
    }
    r.losses.push_back(loss);
    r.norms.push_back(nn::clip_grad_norm_(model->parameters(), 0.5).item());
    opt.step();
    opt.zero_grad();
  }
  for (auto& [name, t] : model->named_parameters()) r.params[name] = t;
  return r;
}

Result pipelined(dist::ProcessGroupPtr group, const nn::TransformerConfig& cfg, DType dt, pp::PipelineOptions o,
                 const std::vector<std::pair<Tensor, Tensor>>& batches, pp::Pipeline** keep = nullptr) {
  static std::unique_ptr<pp::Pipeline> holder;
  holder = std::make_unique<pp::Pipeline>(group, cfg, o);
  pp::Pipeline& pipe = *holder;
  pipe.materialize(Device::cpu(), 7);
  for (auto& [s, part] : pipe.parts()) part->to(dt);
  optim::AdamW opt(pipe.parameters(), {.lr = 3e-2, .weight_decay = 0.1});
  Result r;
  for (const auto& [idx, targets] : batches) {
    r.losses.push_back(pipe.step(idx, targets).item());
    r.norms.push_back(pipe.clip_grad_norm_(0.5).item());
    opt.step();
    opt.zero_grad();
  }
  for (auto& [s, part] : pipe.parts())
    for (auto& [name, t] : part->named_parameters()) r.params[name] = t;
  if (keep) *keep = &pipe;
  return r;
}

std::vector<std::pair<Tensor, Tensor>> data(int64_t batch, int64_t seq, int64_t vocab, int steps) {
  std::vector<std::pair<Tensor, Tensor>> out;
  for (int k = 0; k < steps; ++k)
    out.push_back({randint({batch, seq}, 0, vocab, 100 + 2 * static_cast<uint64_t>(k)),
                   randint({batch, seq}, 0, vocab, 101 + 2 * static_cast<uint64_t>(k))});
  return out;
}

void compare(const Result& want, const Result& got, double tol) {
  REQUIRE(got.losses.size() == want.losses.size());
  for (size_t k = 0; k < want.losses.size(); ++k) {
    INFO("step " << k);
    CHECK(std::abs(got.losses[k] - want.losses[k]) <= tol * std::abs(want.losses[k]));
    CHECK(std::abs(got.norms[k] - want.norms[k]) <= tol * std::abs(want.norms[k]));
  }
  REQUIRE(!got.params.empty());
  for (const auto& [name, t] : got.params) {
    INFO(name);
    REQUIRE(want.params.count(name) == 1);
    const Tensor& w = want.params.at(name);
    const double scale = std::max(1.0, ops::to(ops::max(ops::unary(ops::UnaryOp::Abs, w)), DType::F64).item());
    CHECK(testing::max_abs_diff(t, w) <= tol * scale);
  }
}

}  // namespace

TEST_CASE("a pipelined step equals gradient accumulation on one process", "[pp][exact]") {
  auto group = world();
  const int p = group->size();
  for (const std::string arch : {"gpt2", "llama"})
    for (const std::string schedule : {"gpipe", "1f1b", "interleaved_1f1b"})
      for (int k : {1, 2}) {
        // 4 and 8 micro-batches; interleaved runs them in groups of p: 2p and 4p.
        const int v = schedule == "interleaved_1f1b" ? 2 : 1;
        const int m = v == 1 ? 4 * k : 2 * p * k;
        // Uneven stages: one block more than the stages, plus one.
        const auto cfg = config(arch, p * v + 1);
        INFO(arch << " " << schedule << " p=" << p << " v=" << v << " m=" << m);
        const auto batches = data(m * 2, 6, cfg.vocab_size, 3);
        pp::PipelineOptions o{.schedule = schedule, .microbatches = m, .stages_per_rank = v};
        compare(reference(cfg, DType::F64, m, batches), pipelined(group, cfg, DType::F64, o, batches), 1e-12);
        if (k == 1) compare(reference(cfg, DType::F32, m, batches), pipelined(group, cfg, DType::F32, o, batches), 1e-5);
      }
}

TEST_CASE("messages and activations in flight are the schedule's", "[pp][counts]") {
  auto group = world();
  const int p = group->size(), r = group->rank();
  const auto cfg = config("gpt2", 2 * p);
  for (const std::string schedule : {"gpipe", "1f1b"}) {
    INFO(schedule);
    pp::Pipeline* pipe = nullptr;
    group->reset_stats();
    pipelined(group, cfg, DType::F32, {.schedule = schedule, .microbatches = 6}, data(12, 6, cfg.vocab_size, 1), &pipe);
    const auto st = group->stats();
    const pp::Schedule& s = pipe->schedule();
    CHECK(st.send == s.count(r, pp::ActionType::SendF) + s.count(r, pp::ActionType::SendB));
    CHECK(st.recv == s.count(r, pp::ActionType::RecvF) + s.count(r, pp::ActionType::RecvB));
    if (p == 1) CHECK(st.send + st.recv + st.total() == 0);  // one stage: no message, no collective
    CHECK(pipe->max_in_flight() == (schedule == "gpipe" ? 6 : std::min(6, p - r)));
  }
}

TEST_CASE("a tied embedding across stages is refused before anything is allocated", "[pp][errors]") {
  auto group = world();
  auto cfg = config("gpt2", 4);
  cfg.tie_embeddings = true;
  if (group->size() == 1) {
    CHECK_NOTHROW(pp::Pipeline(group, cfg, {.microbatches = 2}));
    return;
  }
  CHECK_THROWS_WITH(pp::Pipeline(group, cfg, {.microbatches = 2}), Catch::Contains("set model.tie_embeddings false"));
  cfg.tie_embeddings = false;
  cfg.n_layer = group->size() - 1;
  CHECK_THROWS_WITH(pp::Pipeline(group, cfg, {.microbatches = 2}), Catch::Contains("for " + std::to_string(cfg.n_layer) +
                                                                                     " blocks (model.n_layer)"));
}

TEST_CASE("stage parts keep the full model's names", "[pp][split]") {
  auto group = world();
  const int p = group->size();
  const auto cfg = config("llama", p + 2);
  pp::Pipeline pipe(group, cfg, {.microbatches = 2});
  std::vector<std::string> names;
  for (auto& [s, part] : pipe.parts())
    for (auto& [name, t] : part->named_parameters()) names.push_back(name);
  const auto all = dist::all_gather_strings(group, fmt::format("{}", fmt::join(names, ",")));
  std::vector<std::string> together;
  for (const auto& a : all)
    for (size_t at = 0; at < a.size();) {
      size_t comma = a.find(',', at);
      together.push_back(a.substr(at, comma == std::string::npos ? std::string::npos : comma - at));
      at = comma == std::string::npos ? a.size() : comma + 1;
    }
  std::vector<std::string> full;
  for (auto& [name, t] : nn::make_model(cfg, Device::meta())->named_parameters()) full.push_back(name);
  std::sort(together.begin(), together.end());
  std::sort(full.begin(), full.end());
  CHECK(together == full);  // every parameter on exactly one stage, under its own name
}
