// Pipeline parallelism against one process (pp/pipeline.h), under mpirun
// with 1-4 ranks: GPT-2 and Llama cut into uneven stages, every schedule
// (zb_h1's split backward included), 4 and 8 micro-batches. The loss, the clipped gradient norm and every
// parameter after 3 AdamW steps equal the same model trained on one process
// with gradient accumulation over the same micro-batches (f64 to 1e-12, f32
// to 1e-5); the messages per rank are the schedule's; activations in flight
// are what the schedule promises; a tied embedding is refused.

#include <cmath>
#include <map>

#include "dtensor/device_mesh.h"
#include "dtensor/dtensor.h"
#include "fsdp/fully_shard.h"
#include "nn/models.h"
#include "nn/optim.h"
#include "pp/pipeline.h"
#include "tp/parallelize.h"
#include "train/parallelize.h"
#include "runtime/trace.h"
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
    for (const std::string schedule : {"gpipe", "1f1b", "interleaved_1f1b", "zb_h1"})
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
  for (const std::string schedule : {"gpipe", "1f1b", "zb_h1"}) {
    INFO(schedule);
    pp::Pipeline* pipe = nullptr;
    group->reset_stats();
    pipelined(group, cfg, DType::F32, {.schedule = schedule, .microbatches = 6}, data(12, 6, cfg.vocab_size, 1), &pipe);
    const auto st = group->stats();
    const pp::Schedule& s = pipe->schedule();
    CHECK(st.send == s.count(r, pp::ActionType::SendF) + s.count(r, pp::ActionType::SendB));
    CHECK(st.recv == s.count(r, pp::ActionType::RecvF) + s.count(r, pp::ActionType::RecvB));
    if (p == 1) CHECK(st.send + st.recv + st.total() == 0);  // one stage: no message, no collective
    // Activations held: GPipe every micro-batch, 1F1B min(m, p - r), ZB-H1 until each W: min(m, p).
    CHECK(pipe->max_in_flight() == (schedule == "gpipe" ? 6 : schedule == "1f1b" ? std::min(6, p - r) : std::min(6, p)));
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

TEST_CASE("stages given by module names train as the same cut by counts", "[pp][split][exact]") {
  auto group = world();
  const int p = group->size();
  if (p < 2) return;
  const auto cfg = config("llama", p + 1);
  // The first stage takes two blocks, the others one each.
  std::vector<std::vector<std::string>> names(static_cast<size_t>(p));
  std::vector<int64_t> counts(static_cast<size_t>(p), 1);
  counts[0] = 2;
  names[0] = {"model.embed_tokens", "model.layers.0", "model.layers.1"};
  for (int s = 1; s < p; ++s) names[static_cast<size_t>(s)] = {"model.layers." + std::to_string(s + 1)};
  names.back().push_back("model.norm");
  names.back().push_back("lm_head");
  const auto batches = data(8, 6, cfg.vocab_size, 2);
  pp::Pipeline* by_names = nullptr;
  const Result got = pipelined(group, cfg, DType::F64, {.microbatches = 4, .module_names_per_stage = names}, batches,
                               &by_names);
  CHECK(by_names->split()[0].end == 2);
  compare(pipelined(group, cfg, DType::F64, {.microbatches = 4, .layers_per_stage = counts}, batches), got, 0);
  CHECK_THROWS_WITH(pp::Pipeline(group, cfg, {.microbatches = 4, .layers_per_stage = counts,
                                              .module_names_per_stage = names}),
                    Catch::Contains("by module names and by layer counts; give one"));
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

TEST_CASE("a traced step shows every F and B on the pipeline lane, the waits on the bubble lane", "[pp][trace]") {
  auto group = world();
  const int p = group->size();
  const auto cfg = config("gpt2", 2 * p);
  pp::Pipeline pipe(group, cfg, {.schedule = "1f1b", .microbatches = 4});
  pipe.materialize(Device::cpu(), 3);
  const auto batch = data(8, 6, cfg.vocab_size, 1)[0];
  trace::take();
  trace::enable(true);
  pipe.step(batch.first, batch.second);
  trace::enable(false);
  const auto spans = trace::take();
  const trace::Lane lane = trace::register_lane("pipeline"), bubble = trace::register_lane("pipeline bubble");
  std::vector<std::string> names;
  double idle = 0;
  for (const auto& s : spans) {
    if (s.lane == lane) names.push_back(s.name);
    if (s.lane == bubble) idle += s.end_us - s.start_us;
  }
  std::vector<std::string> want;
  for (const auto& a : pipe.schedule().actions[static_cast<size_t>(group->rank())])
    if (a.type == pp::ActionType::Forward || a.type == pp::ActionType::Backward ||
        a.type == pp::ActionType::BackwardInput || a.type == pp::ActionType::BackwardWeight)
      want.push_back(pp::action_str(a));
  CHECK(names == want);  // in the schedule's order
  const auto& t = pipe.last_step_time();
  CHECK(t.busy_us > 0);
  CHECK(t.busy_us <= t.span_us);
  CHECK(std::abs((t.span_us - t.busy_us) - idle) <= 1e-6 * t.span_us + 1.0);  // the bubble lane is the idle time
}

TEST_CASE("PP x FSDP equals one process with gradient accumulation, with and without recomputation",
          "[pp][fsdp][checkpointing]") {
  auto world_group = world();
  const int W = world_group->size();
  if (W % 2 != 0) return;  // 2 x 1 at two ranks, 2 x 2 at four
  const int pp_degree = 2, dp = W / 2;
  // pp outermost (TorchTitan's order): rank = pp index * dp + dp index.
  MeshPtr mesh = init_device_mesh("cpu", {pp_degree, dp}, {"pp", "dp"});
  struct Case {
    std::string schedule;
    bool recompute;  // activation checkpointing: each block's forward again in its backward
  };
  for (const std::string arch : {"gpt2", "llama"})
    for (const Case& c : {Case{"gpipe", false}, Case{"1f1b", false}, Case{"zb_h1", false}, Case{"1f1b", true},
                          Case{"zb_h1", true}}) {
      const std::string& schedule = c.schedule;
      const int m = 4;
      auto cfg = config(arch, 5);
      INFO(arch << " " << schedule << " pp 2 x dp " << dp << (c.recompute ? ", blocks recomputed" : ""));
      // The global batch: dp ranks x m micro-batches x 2 sequences; dp rank d
      // takes rows [d B/dp, (d+1) B/dp).
      const auto batches = data(2 * m * dp, 6, cfg.vocab_size, 3);
      // One process: the same rows, dp x m micro-batches of 2 sequences,
      // each loss weighted 1 / (dp m); never recomputed.
      const Result want = reference(cfg, DType::F64, m * dp, batches);
      cfg.activation_checkpoint = c.recompute;
      const int d = mesh->get_group("dp")->rank();
      pp::Pipeline pipe(mesh->get_group("pp"), cfg, {.schedule = schedule, .microbatches = m});
      pipe.materialize(Device::cpu(), 7);
      for (auto& [s, part] : pipe.parts()) {
        part->to(DType::F64);
        for (auto& block : part->blocks) fsdp::fully_shard(*block, {.mesh = (*mesh)["dp"], .reshard_after_forward = false});
        fsdp::fully_shard(*part, {.mesh = (*mesh)["dp"], .reshard_after_forward = false});
      }
      optim::AdamW opt(pipe.parameters(), {.lr = 3e-2, .weight_decay = 0.1});
      Result got;
      auto dp_group = mesh->get_group("dp");
      int64_t groups = 0;  // FSDP groups on this rank: each part's blocks and its root
      for (auto& [s, part] : pipe.parts()) groups += static_cast<int64_t>(part->blocks.size()) + 1;
      for (const auto& [idx, targets] : batches) {
        const int64_t rows = idx.size(0) / dp;
        dp_group->reset_stats();
        Tensor loss = pipe.step(ops::contiguous(ops::narrow(idx, 0, d * rows, rows)),
                                ops::contiguous(ops::narrow(targets, 0, d * rows, rows)));
        // Parameters stay gathered across the micro-batches and gradients
        // are reduced once, after the last: one all-gather and one
        // reduce-scatter per group and step, not one per micro-batch.
        // (FSDP over one rank issues none.)
        CHECK(dp_group->stats().all_gather == (dp > 1 ? groups : 0));
        CHECK(dp_group->stats().reduce_scatter == (dp > 1 ? groups : 0));
        mesh->get_group("dp")->all_reduce(loss, {.op = dist::ReduceOp::Avg})->wait();
        got.losses.push_back(loss.item());
        got.norms.push_back(pipe.clip_grad_norm_(0.5).item());
        opt.step();
        opt.zero_grad();
      }
      for (auto& [s, part] : pipe.parts())
        for (auto& [name, t] : part->named_parameters()) got.params[name] = full_tensor(t);
      compare(want, got, 1e-12);
    }
}

TEST_CASE("PP x CP equals one process with gradient accumulation", "[pp][cp]") {
  auto world_group = world();
  if (world_group->size() != 4) return;  // 2 stages x context parallel 2
  for (const std::string arch : {"gpt2", "llama"})
    for (const std::string method : {"allgather", "ring"})
      for (const std::string schedule : {"1f1b", "zb_h1"}) {
        INFO(arch << " pp 2 x cp 2, " << method << ", " << schedule);
        const int m = 4;
        const auto cfg = config(arch, 5);
        // Sequences of 4 tokens: head-tail chunks of 1; every rank gets the whole batch.
        const auto batches = data(2 * m, 4, cfg.vocab_size, 3);
        const Result want = reference(cfg, DType::F64, m, batches);
        train::ParallelismOptions o{.param_dtype = DType::F64, .reduce_dtype = DType::F64, .pp = 2,
                                    .pp_schedule = schedule, .pp_microbatches = m, .cp = 2,
                                    .cp_rotate_method = method};
        MeshPtr mesh = train::make_mesh(o);
        auto pipe = train::make_pipeline(cfg, mesh, o, 7);
        for (auto& [s, part] : pipe->parts()) part->to(DType::F64);
        optim::AdamW opt(pipe->parameters(), {.lr = 3e-2, .weight_decay = 0.1});
        mesh->get_group("cp")->reset_stats();
        Result got;
        for (const auto& [idx, targets] : batches) {
          Tensor loss = ops::reshape(pipe->step(idx, targets), {1});
          // Each cp rank's loss is its slice's, weighed: their mean is the batch's.
          world_group->all_reduce(loss, {.op = dist::ReduceOp::Avg})->wait();
          got.losses.push_back(loss.item());
          got.norms.push_back(pipe->clip_grad_norm_(0.5).item());
          opt.step();
          opt.zero_grad();
        }
        for (auto& [s, part] : pipe->parts())
          for (auto& [name, t] : part->named_parameters()) got.params[name] = full_tensor(t);
        compare(want, got, 1e-12);
        // K/V exchanged per block of this rank's stage and micro-batch (forward and backward).
        int64_t blocks = 0;
        for (auto& [s, part] : pipe->parts()) blocks += static_cast<int64_t>(part->blocks.size());
        const auto st = mesh->get_group("cp")->stats();
        if (method == "ring") CHECK(st.send == 3 * m * blocks * 4);  // (3 x 2 - 2) messages each, 3 steps
        else CHECK(st.all_gather == 3 * m * blocks * 2);
      }
}

TEST_CASE("PP x TP equals one process with gradient accumulation", "[pp][tp]") {
  auto world_group = world();
  const int W = world_group->size();
  if (W != 4) return;  // 2 stages x tensor parallel 2
  MeshPtr mesh = init_device_mesh("cpu", {2, 2}, {"pp", "tp"});
  struct Case {
    bool loss_parallel, sequence_parallel;
    std::string schedule;
  };
  // Sequence parallelism: the stages pass their pieces of sequence-split activations.
  for (const std::string arch : {"gpt2", "llama"})
    for (const Case& c : {Case{false, false, "1f1b"}, Case{true, false, "zb_h1"}, Case{true, true, "1f1b"},
                          Case{false, true, "zb_h1"}}) {
      const int m = 4;
      auto cfg = config(arch, 5);
      cfg.n_kv_head = arch == "llama" ? 2 : 0;  // whole key/value heads per tensor-parallel rank
      INFO(arch << " pp 2 x tp 2 " << c.schedule << ", loss parallel " << c.loss_parallel << ", sequence parallel "
                << c.sequence_parallel);
      const auto batches = data(2 * m, 6, cfg.vocab_size, 3);
      pp::PipelineOptions o{.schedule = c.schedule, .microbatches = m};
      if (c.sequence_parallel) o.activation_mesh = (*mesh)["tp"], o.activation_placements = {Shard{1}};
      pp::Pipeline pipe(mesh->get_group("pp"), cfg, o);
      pipe.materialize(Device::cpu(), 7);
      for (auto& [s, part] : pipe.parts()) {
        part->to(DType::F64);
        // The part's plan: its blocks, and the embedding or output layer where it has them.
        tp::parallelize_module(*part, (*mesh)["tp"],
                               tp::tensor_parallel_plan(*part, 2, c.loss_parallel, c.sequence_parallel));
      }
      optim::AdamW opt(pipe.parameters(), {.lr = 3e-2, .weight_decay = 0.1});
      Result got;
      for (const auto& [idx, targets] : batches) {
        got.losses.push_back(pipe.step(idx, targets).item());
        got.norms.push_back(pipe.clip_grad_norm_(0.5).item());
        opt.step();
        opt.zero_grad();
      }
      for (auto& [s, part] : pipe.parts())
        for (auto& [name, t] : part->named_parameters()) got.params[name] = is_dtensor(t) ? full_tensor(t) : t;
      compare(reference(cfg, DType::F64, m, batches), got, 1e-12);
    }
}

