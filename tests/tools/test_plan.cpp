// The planner against the run it plans: on every rank of 1-4, tessera-train's
// model, FSDP and optimizer (train::parallelize, make_optimizer,
// forward_backward) train two steps on the CPU, and tools::plan_run's
// prediction for that rank is checked against what the allocator and the
// process groups counted. Awkward sizes: 3 heads, a vocabulary of 259, shards
// that are uneven at 3 ranks.
#include "tests/helpers.h"

#include "dtensor/dtensor.h"
#include "runtime/allocator.h"
#include "runtime/distributed.h"
#include "runtime/parallel.h"
#include "runtime/profiler.h"
#include "runtime/random.h"
#include "pp/pipeline.h"
#include "tools/plan.h"
#include "tools/step_time.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

using namespace tessera;

namespace {

tools::TrainConfig small_config() {
  tools::TrainConfig c;
  c.model.n_layer = 2;
  c.model.n_head = 3;
  c.model.n_embd = 48;
  c.model.vocab_size = 259;
  c.training.batch_size = 12;
  c.training.seq_len = 24;
  c.training.steps = 10;
  c.lr_scheduler.warmup_steps = 2;
  return c;
}

// The same as Llama with grouped-query attention (4 heads, 2 key/value heads).
tools::TrainConfig small_llama() {
  tools::TrainConfig c = small_config();
  c.model.arch = "llama";
  c.model.n_head = 4;
  c.model.n_kv_head = 2;
  c.model.bias = false;
  c.model.ffn_hidden = 100;
  return c;
}

struct Measured {
  int64_t peak = 0;
  std::map<std::string, dist::CollectiveStats> collectives;  // of the second step
  std::map<std::string, int> sizes;  // of those groups
  int64_t products = 0;  // matrix products the CPU ran in the second step
  int64_t optimizer_state = 0;  // bytes of AdamW's moments after the first step
  int in_flight = 0;  // a pipeline's: micro-batches one of this rank's stages held at once
};

// Bytes of AdamW's moments (this rank's pieces).
int64_t moment_bytes(optim::AdamW& adamw) {
  int64_t bytes = 0;
  for (size_t g = 0; g < adamw.param_groups().size(); ++g)
    for (size_t j = 0; j < adamw.param_groups()[g].params.size(); ++j)
      for (const Tensor* t : {&adamw.state(g, j).exp_avg, &adamw.state(g, j).exp_avg_sq}) {
        const Tensor local = is_dtensor(*t) ? local_tensor(*t) : *t;
        bytes += static_cast<int64_t>(local.storage()->nbytes());
      }
  return bytes;
}

// Two pipelined steps as tessera-train runs them (Trainer::pipeline_step).
Measured run_two_pipelined_steps(const tools::TrainConfig& cfg) {
  const int world = dist::world_size(), rank = dist::rank();
  const tools::MeshDims dims = tools::mesh_dims(cfg, world);
  MeshPtr mesh = init_device_mesh("cpu", dims.shape, dims.names);
  Measured m;
  const int64_t base = memory_stats().allocated_bytes;
  reset_peak_memory_stats();
  {
    auto pipe = train::make_pipeline(tools::transformer_config(cfg), mesh, tools::parallelism_options(cfg), 7);
    pp::PipelinedModel model(pipe);
    optim::AdamW* adamw = nullptr;
    auto opt = train::make_optimizer(model, tools::optimizer_options(cfg), &adamw);
    const int64_t rows = cfg.training.batch_size / tools::data_parallel_ranks(cfg, world);
    for (int step = 0; step < 2; ++step) {
      if (step == 1) {
        for (int64_t d = 0; d < mesh->ndim(); ++d) mesh->get_group(d)->reset_stats();
        for (const auto& [name, g] : tools::flattened_groups(mesh)) g->reset_stats();
        profiler::reset();
        profiler::enable(true);
      }
      const auto seed = static_cast<uint64_t>(1000 * step + rank);
      Tensor idx = randint({rows, cfg.training.seq_len}, 0, cfg.model.vocab_size, seed);
      Tensor loss = ops::reshape(pipe->step(idx, randint(idx.shape(), 0, cfg.model.vocab_size, seed + 500)), {1});
      if (world > 1) dist::world()->all_reduce(loss, {.op = dist::ReduceOp::Avg})->wait();
      pipe->clip_grad_norm_(cfg.training.max_norm);
      opt->step();
      opt->zero_grad();
      if (step == 0) m.optimizer_state = moment_bytes(*adamw);
    }
    profiler::enable(false);
    m.products = profiler::kernel_time("gemm").calls;
    m.in_flight = pipe->max_in_flight();
    for (int64_t d = 0; d < mesh->ndim(); ++d) {
      m.collectives[mesh->dim_names()[static_cast<size_t>(d)]] = mesh->get_group(d)->stats();
      m.sizes[mesh->dim_names()[static_cast<size_t>(d)]] = mesh->get_group(d)->size();
    }
    for (const auto& [name, g] : tools::flattened_groups(mesh)) {
      m.collectives[name] = g->stats();
      m.sizes[name] = g->size();
    }
  }
  m.peak = memory_stats().peak_allocated_bytes - base;
  return m;
}

// Two steps as tessera-train runs them, on the CPU over the world.
Measured run_two_steps(const tools::TrainConfig& cfg) {
  if (cfg.parallelism.pipeline_parallel_degree > 1) return run_two_pipelined_steps(cfg);
  const int world = dist::world_size(), rank = dist::rank();
  const tools::MeshDims dims = tools::mesh_dims(cfg, world);
  const int64_t tp = cfg.parallelism.tensor_parallel_degree, cp = cfg.parallelism.context_parallel_degree;
  MeshPtr mesh = init_device_mesh("cpu", dims.shape, dims.names);
  Measured m;
  const int64_t base = memory_stats().allocated_bytes;
  reset_peak_memory_stats();
  {
    auto model = tools::make_model(cfg, Device::meta());
    train::parallelize(*model, mesh, tools::parallelism_options(cfg));
    model->to_empty(Device::cpu());
    model->init_weights(7);
    optim::AdamW* adamw = nullptr;
    auto opt = train::make_optimizer(*model, tools::optimizer_options(cfg), &adamw);
    const int64_t dp = tools::data_parallel_ranks(cfg, world);
  const int64_t micro = cfg.training.batch_size / cfg.training.grad_accum / dp;
    for (int step = 0; step < 2; ++step) {
      if (step == 1) {
        for (int64_t d = 0; d < mesh->ndim(); ++d) mesh->get_group(d)->reset_stats();
        for (const auto& [name, g] : tools::flattened_groups(mesh)) g->reset_stats();
        for (const auto& g : tools::post_forward_groups(*model)) g->reset_stats();
        for (const auto& [name, g] : tools::expert_groups(*model)) g->reset_stats();
        profiler::reset();
        profiler::enable(true);
      }
      auto batch = [&](int64_t i) {
        // A tensor-parallel (and context-parallel) group shares rows.
        uint64_t seed = static_cast<uint64_t>(1000 * step + 10 * i + rank / std::max<int64_t>(tp * cp, 1));
        return std::pair{randint({micro, cfg.training.seq_len}, 0, cfg.model.vocab_size, seed),
                         randint({micro, cfg.training.seq_len}, 0, cfg.model.vocab_size, seed + 500)};
      };
      Tensor loss = train::forward_backward(*model, cfg.training.grad_accum, batch);
      nn::clip_grad_norm_(model->parameters(), cfg.training.max_norm);
      opt->step();
      opt->zero_grad();
      if (step == 0 && adamw != nullptr) m.optimizer_state = moment_bytes(*adamw);
    }
    profiler::enable(false);
    m.products = profiler::kernel_time("gemm").calls;
    for (int64_t d = 0; d < mesh->ndim(); ++d) {
      m.collectives[mesh->dim_names()[static_cast<size_t>(d)]] = mesh->get_group(d)->stats();
      m.sizes[mesh->dim_names()[static_cast<size_t>(d)]] = mesh->get_group(d)->size();
    }
    for (const auto& [name, g] : tools::flattened_groups(mesh)) {
      m.collectives[name] = g->stats();
      m.sizes[name] = g->size();
    }
    for (const auto& g : tools::post_forward_groups(*model))
      m.collectives[fmt::format("dp_shard/post-forward{}", g->size())] += g->stats();
    for (const auto& [name, g] : tools::expert_groups(*model)) {
      m.collectives[name] += g->stats();
      m.sizes[name] = g->size();
    }
  }
  m.peak = memory_stats().peak_allocated_bytes - base;
  return m;
}

void check_plan(const tools::TrainConfig& cfg, const std::string& what) {
  INFO(what << " at " << dist::world_size() << " ranks, rank " << dist::rank());
  tools::Plan plan = tools::plan_run(cfg, dist::world_size(), dist::rank(), /*log_step=*/true);
  Measured m = run_two_steps(cfg);
  // A mixture of experts routes real tokens where the plan routes them evenly
  // (round-robin on meta): the experts' products (an expert without tokens
  // runs none), the rows the all-to-alls return and the activations follow
  // the routing. The collectives' counts do not, and the "ep" group's bytes
  // stay within the plan's imbalance bound.
  const bool routed = cfg.model.moe_experts > 0;
  // The step's log holds the products the CPU ran and the collectives the
  // groups issued, each waited for once.
  const kernel_log::Log& log = *plan.step_log;
  int64_t products = 0;
  for (const auto& k : log.kernels) products += k.name == "gemm";
  if (!routed) CHECK(products == m.products);
  std::map<std::string, int64_t> issued, waited;
  for (const auto& e : log.events)
    if (e.type == kernel_log::Event::Type::Issue || e.type == kernel_log::Event::Type::Wait) {
      const auto& c = log.collectives[static_cast<size_t>(e.index)];
      (e.type == kernel_log::Event::Type::Issue ? issued : waited)[c.group]++;
    }
  CHECK(issued == waited);
  // Exact to the byte: collectives release their buffers when waited for,
  // in the plan and in the run, so the peak does not depend on when the
  // other ranks arrive.
  if (!routed) CHECK(plan.peak == m.peak);
  CHECK(plan.optimizer_state == m.optimizer_state);  // the moments alone, not the shards beside them
  for (const auto& [group, got] : m.collectives) {
    INFO("group " << group);
    REQUIRE(plan.collectives.count(group) == 1);
    const dist::CollectiveStats& want = plan.collectives.at(group);
    CHECK(want.all_gather == got.all_gather);
    CHECK(want.reduce_scatter == got.reduce_scatter);
    CHECK(want.all_reduce == got.all_reduce);
    CHECK(want.broadcast == got.broadcast);
    CHECK(want.all_to_all == got.all_to_all);
    CHECK(want.send == got.send);
    CHECK(want.recv == got.recv);
    CHECK(want.mpi_calls == got.mpi_calls);
    if (routed && group == "ep") {
      CHECK(got.bytes <= static_cast<int64_t>(static_cast<double>(want.bytes) * plan.moe_imbalance_bound));
      CHECK(got.bytes > 0);
    } else {
      CHECK(want.bytes == got.bytes);
      CHECK(want.ring_bytes == got.ring_bytes);
    }
    // A group of one rank completes its collectives at once, unlogged.
    const bool logged = m.sizes.count(group) == 0 || m.sizes.at(group) > 1;
    CHECK(issued[group] == (got.all_gather + got.reduce_scatter + got.all_reduce + got.broadcast + got.all_to_all +
                            got.send + got.recv) *
                               (dist::world_size() > 1 && logged));
  }
  if (cfg.parallelism.pipeline_parallel_degree > 1) CHECK(plan.pp_in_flight == m.in_flight);
}

}  // namespace

TEST_CASE("the plan predicts a step's peak memory and its collectives", "[plan]") {
  dist::init();
  tools::TrainConfig c = small_config();
  check_plan(c, "gpt2 f32");
  c.parallelism.reshard_after_forward = false;
  check_plan(c, "reshard_after_forward false");
  c = small_config();
  c.parallelism.prefetch = false;
  check_plan(c, "prefetch off");
  c = small_config();
  c.mixed_precision.param_dtype = "bfloat16";
  check_plan(c, "bf16 params");
  c = small_config();
  c.activation_checkpoint.mode = "full";
  check_plan(c, "activation checkpointing");
  c = small_config();
  c.training.grad_accum = 2;
  c.training.batch_size = 24;
  check_plan(c, "grad_accum 2");
  c = small_llama();
  c.model.tie_embeddings = false;
  check_plan(c, "llama, GQA");
  if (dist::world_size() % 2 == 0) {  // tensor parallelism 2 alone, and under FSDP at 4 ranks
    c.parallelism.tensor_parallel_degree = 2;
    check_plan(c, "llama, tensor parallel 2 (loss parallel)");
    c.parallelism.disable_loss_parallel = true;
    check_plan(c, "llama, tensor parallel 2, replicated output layer");
    c.parallelism.enable_sequence_parallel = true;
    check_plan(c, "llama, tensor parallel 2 + sequence parallel, replicated output layer");
    c.parallelism.disable_loss_parallel = false;
    check_plan(c, "llama, tensor parallel 2 + sequence parallel (loss parallel)");
    c = small_config();  // GPT-2: c_attn split per block of q, k and v
    c.model.n_head = 4;
    c.parallelism.tensor_parallel_degree = 2;
    check_plan(c, "gpt2, tensor parallel 2 (loss parallel)");
    c.parallelism.enable_sequence_parallel = true;
    check_plan(c, "gpt2, tensor parallel 2 + sequence parallel (loss parallel)");
  }
  if (dist::world_size() > 1) {  // context parallelism over every rank, or 2 x FSDP 2 at 4
    const int cp = dist::world_size() == 4 ? 2 : dist::world_size();
    for (const std::string method : {"allgather", "ring"})
      for (bool lb : {true, false}) {
        c = small_llama();
        c.model.tie_embeddings = false;
        c.training.seq_len = lb ? 4 * cp : 3 * cp + 1;
        c.parallelism.context_parallel_degree = cp;
        c.parallelism.context_parallel_rotate_method = method;
        c.parallelism.context_parallel_load_balance = lb;
        check_plan(c, fmt::format("llama, context parallel {} ({}, {})", cp, method, lb ? "head-tail" : "contiguous"));
      }
    if (dist::world_size() == 4) {
      c.parallelism.tensor_parallel_degree = 2;
      c.parallelism.context_parallel_degree = 2;
      c.parallelism.enable_sequence_parallel = true;
      c.training.seq_len = 8;
      c.parallelism.context_parallel_load_balance = true;
      check_plan(c, "llama, context parallel 2 x tensor parallel 2 + sequence parallel");
    }
  }
  if (dist::world_size() == 4) {
    c = small_config();
    c.parallelism.data_parallel_replicate_degree = 2;
    check_plan(c, "HSDP 2 x 2");
    c = small_config();
    c.parallelism.reshard_after_forward_degree = 2;
    check_plan(c, "reshard_after_forward 2 (hpZ)");
  }
}

TEST_CASE("the plan counts a mixture of experts' all-to-alls as the run issues them", "[plan][moe]") {
  dist::init();
  const int world = dist::world_size();
  tools::TrainConfig c = small_llama();
  c.model.moe_experts = world == 3 ? 6 : 4;  // divides over every expert-parallel degree below
  c.model.moe_top_k = 2;
  c.model.moe_hidden = 36;
  c.model.moe_every = 2;  // block 1 of 2 is MoE
  c.model.moe_balance = "bias";
  check_plan(c, "MoE llama, all experts on every rank (FSDP)");
  if (world > 1) {
    c.parallelism.expert_parallel_degree = world == 4 ? 2 : world;
    check_plan(c, fmt::format("MoE llama, expert parallel {}", c.parallelism.expert_parallel_degree));
    const tools::Plan plan = tools::plan_run(c, world, dist::rank());
    // 5 all-to-alls per MoE layer and micro-batch; the bound ep x min(k, E/ep) / k.
    CHECK(plan.collectives.at("ep").all_to_all == 5);
    const int64_t ep = c.parallelism.expert_parallel_degree, local = c.model.moe_experts / ep;
    CHECK(plan.moe_imbalance_bound == static_cast<double>(ep * std::min<int64_t>(2, local)) / 2.0);
    CHECK(plan.expert_parameters == 4 * 3 * 48 * 36 + (world == 3 ? 2 * 3 * 48 * 36 : 0));
    CHECK(plan.expert_bytes > 0);
    CHECK(tools::format_plan(plan, c).find("all-to-all over ep per step: 5") != std::string::npos);
  }
  if (world == 4) {
    c.parallelism.expert_parallel_degree = 2;
    c.training.grad_accum = 2;
    c.training.batch_size = 24;
    check_plan(c, "MoE llama, expert parallel 2 x FSDP 2, grad_accum 2");
    c.training.grad_accum = 1;
    c.training.batch_size = 12;
    c.parallelism.data_parallel_replicate_degree = 2;
    check_plan(c, "MoE llama, HSDP 2 x (FSDP 2 = expert parallel 2)");
    c.parallelism.data_parallel_replicate_degree = 1;
    c.parallelism.tensor_parallel_degree = 2;
    c.parallelism.enable_sequence_parallel = true;
    check_plan(c, "MoE llama, expert parallel 2 x tensor parallel 2 + sequence parallel");
  }
  if (world % 2 == 0) {
    tools::TrainConfig t = small_llama();
    t.model.moe_experts = 4;
    t.model.moe_hidden = 36;
    t.model.moe_every = 2;
    t.parallelism.tensor_parallel_degree = 2;
    check_plan(t, "MoE llama, tensor parallel 2");
  }
  // EP 1 issues no all-to-all; nor does one rank.
  c = small_llama();
  c.model.moe_experts = 4;
  const tools::Plan plain = tools::plan_run(c, world, dist::rank());
  CHECK(plain.collectives.count("ep") == 0);
  CHECK(plain.moe_imbalance_bound == 1);
}

// A GPT of 7 blocks, untied, 24 sequences a step, over a pipeline of p stages.
tools::TrainConfig pipelined(int64_t p) {
  tools::TrainConfig c = small_config();
  c.model.n_layer = 7;  // uneven stages, two per rank when interleaved
  c.model.tie_embeddings = false;
  c.training.batch_size = 24;
  c.parallelism.pipeline_parallel_degree = p;
  return c;
}

TEST_CASE("the plan predicts a pipeline stage's memory, messages and micro-batches in flight", "[plan][pp]") {
  dist::init();
  const int W = dist::world_size();
  if (W == 1) return;  // a pipeline needs two ranks
  const int64_t p = W == 3 ? 3 : 2;  // PP 3; PP 2 (x FSDP 2 at four ranks)
  const int64_t s = dist::rank() / (W / p);  // this rank's stage (pp is the outermost dim)
  tools::TrainConfig c = pipelined(p);
  for (const std::string schedule : {"gpipe", "1f1b", "interleaved_1f1b", "zb_h1"}) {
    c.parallelism.pipeline_parallel_schedule = schedule;
    check_plan(c, "PP " + std::to_string(p) + " " + schedule);
    const tools::Plan plan = tools::plan_run(c, W, dist::rank());
    const int64_t m = 2 * p;  // the default micro-batches
    if (schedule == "gpipe") CHECK(plan.pp_in_flight == m);
    if (schedule == "1f1b") CHECK(plan.pp_in_flight == std::min(m, p - s));
    if (schedule == "zb_h1") CHECK(plan.pp_in_flight == std::min(m, p));  // held until each W
    CHECK(plan.collectives.at("pp").send == plan.collectives.at("pp").recv);
    CHECK(plan.pp_bubble > 0);
  }
  c.parallelism.pipeline_parallel_schedule = "1f1b";
  c.mixed_precision.param_dtype = "bfloat16";
  check_plan(c, "PP, bf16 activations");
  if (W == 4) {
    c = small_llama();
    c.model.n_layer = 5;
    c.model.tie_embeddings = false;
    c.training.batch_size = 24;
    c.parallelism.pipeline_parallel_degree = 2;
    c.parallelism.tensor_parallel_degree = 2;
    check_plan(c, "Llama PP 2 x TP 2");
    c = pipelined(2);
    c.parallelism.data_parallel_replicate_degree = 2;
    check_plan(c, "PP 2 x HSDP 2 x 1");
    c = pipelined(2);
    c.parallelism.context_parallel_degree = 2;
    c.parallelism.context_parallel_rotate_method = "ring";
    check_plan(c, "PP 2 x CP 2 (ring)");
  }
  // Every position planned; the first stage holds the most in flight under 1F1B.
  c = pipelined(p);
  const auto positions = tools::plan_stage_positions(c, W);
  REQUIRE(static_cast<int64_t>(positions.size()) == p);
  for (int64_t i = 0; i < p; ++i) {
    CHECK(positions[static_cast<size_t>(i)].rank == i * W / p);
    CHECK(positions[static_cast<size_t>(i)].pp_in_flight == p - i);
  }
  CHECK(tools::format_stage_plans(positions).find("stage 0 (blocks 0-") != std::string::npos);
}

TEST_CASE("context parallelism divides a long sequence's activations by about the degree", "[plan][cp]") {
  dist::init();
  tools::TrainConfig c;  // the default model (4 blocks, d=256) at 2 sequences of 2048 tokens
  c.training.seq_len = 2048;
  c.training.batch_size = 2;
  const double one = static_cast<double>(tools::plan_run(c, 1, 0).forward_peak);
  c.parallelism.context_parallel_degree = 4;
  for (const std::string method : {"allgather", "ring"}) {
    c.parallelism.context_parallel_rotate_method = method;
    for (int r = 0; r < 4; ++r) {
      const tools::Plan four = tools::plan_run(c, 4, r);
      INFO(method << ", rank " << r << ": " << four.forward_peak << " bytes against " << one << " at CP 1");
      // A quarter of the tokens' activations, plus one layer's K/V of the whole sequence at most.
      CHECK(static_cast<double>(four.forward_peak) <= 0.35 * one);
      CHECK(static_cast<double>(four.forward_peak) >= 0.25 * one);
      CHECK(tools::format_plan(four, c).find("context parallel: 4 ranks, " + method) != std::string::npos);
    }
  }
}

TEST_CASE("sequence parallelism divides the residual stream's activations by the degree", "[plan][tp]") {
  dist::init();
  const bool gpt = GENERATE(false, true);
  INFO((gpt ? "gpt2" : "llama"));
  tools::TrainConfig c = gpt ? small_config() : small_llama();  // 24 tokens of 48 features per sequence
  c.model.n_layer = 3;
  c.model.n_head = 4;
  if (!gpt) c.model.n_kv_head = 4;
  c.model.tie_embeddings = false;
  c.training.batch_size = 4;
  for (int64_t tp : {2, 4}) {
    INFO("tensor parallel " << tp);
    c.parallelism.tensor_parallel_degree = tp;
    c.parallelism.enable_sequence_parallel = false;
    const tools::Plan whole = tools::plan_run(c, static_cast<int>(tp), 0);
    c.parallelism.enable_sequence_parallel = true;
    const tools::Plan split = tools::plan_run(c, static_cast<int>(tp), 0);
    REQUIRE(whole.after_block.size() == 3);
    REQUIRE(split.after_block.size() == 3);
    // What a block adds to the memory held until backward: at least its two
    // norms' saved inputs (x and x + attention) shrink from T to T / tp tokens.
    const double residual = 4.0 * static_cast<double>(c.training.batch_size * c.training.seq_len * c.model.n_embd);
    for (size_t b = 1; b < 3; ++b) {
      INFO("block " << b);
      const double grows = static_cast<double>(whole.after_block[b] - whole.after_block[b - 1]);
      const double grows_split = static_cast<double>(split.after_block[b] - split.after_block[b - 1]);
      CHECK(grows - grows_split >= 2 * residual * (1.0 - 1.0 / static_cast<double>(tp)));
    }
    CHECK(split.peak < whole.peak);
  }
}

TEST_CASE("a plan's FLOPs count the model once: a tensor-parallel rank gets its share", "[plan]") {
  dist::init();
  tools::TrainConfig c = small_llama();
  c.training.batch_size = 8;
  const tools::Plan fsdp = tools::plan_run(c, 4, 0);
  c.parallelism.tensor_parallel_degree = 2;
  const tools::Plan two_d = tools::plan_run(c, 4, 0);
  CHECK(two_d.micro_batch == 2 * fsdp.micro_batch);  // 2 data-parallel ranks share the batch
  CHECK(two_d.flops_forward == Approx(fsdp.flops_forward));
  CHECK(two_d.flops_backward == Approx(fsdp.flops_backward));
}

TEST_CASE("a plan counts nothing on the device and needs no memory", "[plan]") {
  dist::init();
  tools::TrainConfig c = small_config();
  c.model.n_embd = 65536;  // about 200 GB of weights: planned, not allocated
  c.model.n_head = 4;
  const int64_t before = memory_stats().allocated_bytes;
  tools::Plan plan = tools::plan_run(c, 4, 0);
  CHECK(memory_stats().allocated_bytes == before);
  CHECK(plan.sharded_parameters >= plan.parameters);  // f32: 4 bytes for a quarter of them, padded
  CHECK(plan.peak > 4 * plan.sharded_parameters);     // weights, grads, two Adam moments at least
  CHECK(memory_stats(Device::meta()).allocated_bytes == 0);
  CHECK_THROWS_WITH(tools::plan_run(c, 5, 0), Catch::Contains("training.batch_size"));
  // The full-size model exists on meta only until it is sharded, and is not
  // in the plan: at 64 ranks a step holds far less than one f32 copy of it.
  c = small_config();
  c.model.n_layer = 32;
  c.model.n_embd = 96;
  c.training.batch_size = 64;
  c.activation_checkpoint.mode = "full";
  tools::Plan many = tools::plan_run(c, 64, 0);
  CHECK(many.peak < many.parameters * 4 / 2);  // 3.8 MiB of 13.8
  CHECK(many.peak > 0);
}

TEST_CASE("every kernel of a step's log runs on the CPU as logged, and its time is cached", "[plan][time]") {
  dist::init();
  tools::Plan plan = tools::plan_run(small_llama(), 1, 0, /*log_step=*/true);
  const kernel_log::Log& log = *plan.step_log;
  REQUIRE(log.kernels.size() > 50);
  std::set<std::string> names;
  for (const auto& k : log.kernels) names.insert(k.name);
  for (const char* want : {"gemm", "attention", "attention_backward", "layer_norm", "cross_entropy", "rope", "adamw",
                           "embedding_backward", "sum_squares"})
    CHECK(names.count(want) == 1);
  const std::string dir = fmt::format("{}/tessera-step-time-{}", std::filesystem::temp_directory_path().string(),
                                      dist::rank());
  std::filesystem::remove_all(dir);
  const std::string cache = tools::kernel_cache_path(dir, 1, 1);
  tools::Calibration first = tools::measure_kernels(log, 1, 1, cache);
  REQUIRE(first.seconds.size() == log.kernels.size());
  for (double s : first.seconds) CHECK(s > 0);
  CHECK(first.measured > 10);
  CHECK(first.cached == 0);
  tools::Calibration again = tools::measure_kernels(log, 1, 1, cache);
  CHECK(again.measured == 0);
  CHECK(again.cached == first.measured);
  REQUIRE(again.seconds.size() == first.seconds.size());
  for (size_t i = 0; i < first.seconds.size(); ++i) CHECK(again.seconds[i] == Approx(first.seconds[i]).epsilon(1e-8));
  // The step replayed sets the scale of every kernel (cached with them): a
  // replay of the same kernels is not a tenth or ten times their sum.
  CHECK(first.replay_scale > 0.1);
  CHECK(first.replay_scale < 10);
  CHECK(again.replay_scale == Approx(first.replay_scale).epsilon(1e-8));
  {
    std::ifstream in(cache);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    CHECK(text.find(fmt::format("replay of {} kernels", log.kernels.size())) != std::string::npos);
  }
  // Two ranks' workers at once: each kernel measured again (another cache file).
  tools::Calibration shared = tools::measure_kernels(log, 1, 2, tools::kernel_cache_path(dir, 1, 2));
  CHECK(shared.measured == first.measured);
  // A larger product takes longer than a smaller one of the same kind.
  double small_gemm = 0, large_gemm = 0, small_flops = 1e30, large_flops = 0;
  for (size_t i = 0; i < log.kernels.size(); ++i)
    if (log.kernels[i].name == "gemm") {
      if (log.kernels[i].flops < small_flops) small_flops = log.kernels[i].flops, small_gemm = first.seconds[i];
      if (log.kernels[i].flops > large_flops) large_flops = log.kernels[i].flops, large_gemm = first.seconds[i];
    }
  if (large_flops > 20 * small_flops) CHECK(large_gemm > small_gemm);
  std::filesystem::remove_all(dir);
}

TEST_CASE("a rank's own cores: a block of the CPUs when the node's ranks fit them, else none", "[plan][time]") {
  const std::vector<int> all = allowed_cpus();
  const int n = static_cast<int>(all.size());
  if (n < 2 || static_cast<unsigned>(n) < std::thread::hardware_concurrency()) return;  // bound by the launcher
  // One thread per rank, as many ranks as CPUs: each rank one CPU, in order.
  for (int r = 0; r < n; ++r) CHECK(tools::rank_cpus(r, n, 1) == std::vector<int>{all[static_cast<size_t>(r)]});
  // Threads of a rank side by side, ranks after each other; a rank left over gets nothing.
  if (n >= 4) {
    CHECK(tools::rank_cpus(1, 2, 2) == std::vector<int>{all[2], all[3]});
    CHECK(tools::rank_cpus(0, n / 2, 2) == std::vector<int>{all[0], all[1]});
  }
  // More ranks than CPUs (the scheduler balances them), or a node of one rank: no pinning.
  CHECK(tools::rank_cpus(0, n + 1, 1).empty());
  CHECK(tools::rank_cpus(n, n + 1, 1).empty());
  CHECK(tools::rank_cpus(0, 2, n).empty());
  CHECK(tools::rank_cpus(0, 1, n).empty());
  CHECK(tools::rank_cpus(0, 1, 1).empty());  // one rank alone: nothing to keep apart
  // A rank the launcher already bound (its mask narrower than the machine) stays as it is.
  {
    const std::vector<int> before = allowed_cpus();
    pin_process_to({all.front()});
    CHECK(tools::rank_cpus(0, 1, 1).empty());
    CHECK(tools::rank_cpus(1, 2, 1).empty());
    pin_process_to(before);
  }
  CHECK_THROWS_WITH(tools::rank_cpus(2, 2, 1), Catch::Contains("expected local rank 0..1"));
  CHECK_THROWS_WITH(tools::rank_cpus(0, 2, 0), Catch::Contains("a positive thread count"));
  // The calibration pinned as the ranks are: its own cache file, every kernel timed.
  dist::init();
  tools::Plan plan = tools::plan_run(small_llama(), 1, 0, /*log_step=*/true);
  const std::string dir = fmt::format("{}/tessera-pinned-{}", std::filesystem::temp_directory_path().string(),
                                      dist::rank());
  std::filesystem::remove_all(dir);
  CHECK(tools::kernel_cache_path(dir, 1, 2, true) != tools::kernel_cache_path(dir, 1, 2, false));
  tools::Calibration pinned = tools::measure_kernels(*plan.step_log, 1, 2, tools::kernel_cache_path(dir, 1, 2, true),
                                                     /*pinned=*/true);
  REQUIRE(pinned.seconds.size() == plan.step_log->kernels.size());
  for (double s : pinned.seconds) CHECK(s > 0);
  CHECK(allowed_cpus() == all);  // the caller is left where it was
  std::filesystem::remove_all(dir);
}

TEST_CASE("the step-time schedule: compute stream, one communication channel, waits", "[plan][time]") {
  kernel_log::Log log;
  auto kernel = [&](const char* name) {
    log.events.push_back({kernel_log::Event::Type::Kernel, static_cast<int64_t>(log.kernels.size())});
    log.kernels.push_back({name, name, 0, 0, {}});
  };
  auto issue = [&](double bytes) {
    log.events.push_back({kernel_log::Event::Type::Issue, static_cast<int64_t>(log.collectives.size())});
    log.collectives.push_back({"all_gather", "dp_shard", 2, bytes});
    return static_cast<int64_t>(log.collectives.size() - 1);
  };
  auto wait = [&](int64_t c) { log.events.push_back({kernel_log::Event::Type::Wait, c}); };
  // all-gather 0 (3 s) issued first and waited for after a 1 s kernel: 2 s
  // exposed. all-gather 1 (3 s) issued next queues behind it on the channel
  // (starts at 3 s, ends at 6 s) while a 2 s kernel runs (3..5 s): 1 s exposed.
  // all-gather 2 (7 s) is issued and never waited for: the step ends with it.
  const int64_t c0 = issue(3);
  kernel("a");
  wait(c0);
  const int64_t c1 = issue(3);
  kernel("b");
  wait(c1);
  kernel("c");
  issue(7);
  tools::CommModel comm;
  comm.fits["all_gather"][2] = {0, 1};  // one second per byte
  const tools::StepTime t = tools::simulate_step(log, {1, 2, 0.5}, comm);
  CHECK(t.compute_s == Approx(3.5));
  CHECK(t.communication_s == Approx(13));
  CHECK(t.exposed_s == Approx(3));
  CHECK(t.step_s == Approx(6.5 + 7));
  CHECK(t.compute_by_kernel.at("b") == Approx(2));
  // Twice the kernel time (ranks sharing cores): the second all-gather hides.
  const tools::StepTime slow = tools::simulate_step(log, {1, 2, 0.5}, comm, 2.0);
  CHECK(slow.exposed_s == Approx(1));
  // No overlap: each all-gather runs when waited for (1 + 3, + 2 + 3, + 0.5),
  // the last after the compute; all of the waited ones exposed.
  const tools::StepTime serial = tools::simulate_step(log, {1, 2, 0.5}, comm, 1.0, /*overlap=*/false);
  CHECK(serial.exposed_s == Approx(6));
  CHECK(serial.step_s == Approx(9.5 + 7));
  CHECK(serial.communication_s == Approx(13));
  CHECK_THROWS_WITH(tools::simulate_step(log, {1, 2}, comm), Catch::Contains("2 kernel times for 3 kernels"));
}

TEST_CASE("collective fits: alpha-beta from points, carried to other group sizes", "[plan][time]") {
  // Exact points on t = 20 us + 1 ns/byte.
  std::vector<double> bytes = {4096, 65536, 1048576, 16777216}, seconds;
  for (double b : bytes) seconds.push_back(20e-6 + 1e-9 * b);
  tools::CollectiveFit f = tools::fit_alpha_beta(bytes, seconds);
  CHECK(f.alpha_s == Approx(20e-6).epsilon(1e-9));
  CHECK(f.beta_s_per_byte == Approx(1e-9).epsilon(1e-9));
  CHECK_THROWS_WITH(tools::fit_alpha_beta({4096}, {1e-5}), Catch::Contains("at least two"));
  CHECK_THROWS_WITH(tools::fit_alpha_beta({4096, 4096}, {1e-5, 1e-5}), Catch::Contains("do not determine"));
  tools::CommModel m;
  m.fits["all_gather"][2] = f;
  CHECK(m.seconds("all_gather", 2, 1e6) == Approx(20e-6 + 1e-3));
  CHECK(m.seconds("all_gather", 1, 1e6) == 0);
  // At 4 ranks along the ring: alpha x 3, beta x (3/4) / (1/2).
  CHECK(m.seconds("all_gather", 4, 1e6) == Approx(3 * 20e-6 + 1.5 * 1e-3));
  // A kind without a fit is priced as one with.
  CHECK(m.seconds("broadcast", 2, 1e6) == Approx(20e-6 + 1e-3));
  CHECK_THROWS_WITH(tools::load_comm_fits("/nonexistent/tessera"), Catch::Contains("bench_collectives"));
}

TEST_CASE("hardware files: the figures, the ring over a node's links and across nodes", "[plan][time]") {
  const std::string path = fmt::format("{}/tessera-hw-{}.toml", std::filesystem::temp_directory_path().string(),
                                       dist::rank());
  auto write = [&](const std::string& text) { std::ofstream(path, std::ios::trunc) << text; };
  write(R"(name = "test node"
source = "made up"
[node]
devices = 4
[device]
memory_gib = 10
memory_bandwidth_gbs = 1000
peak_tflops_bf16 = 100
peak_tflops_f32 = 10
gemm_efficiency = 0.5
[intra_node]
bandwidth_gbs = 100
latency_us = 2
[inter_node]
bandwidth_gbs = 10
latency_us = 5
)");
  tools::Hardware hw = tools::load_hardware(path);
  CHECK(hw.name == "test node");
  CHECK(hw.devices_per_node == 4);
  CHECK(hw.memory_bytes == 10.0 * 1073741824.0);
  kernel_log::Log log;
  log.kernels.push_back({"gemm", "gemm bf16 NN 1x1x1", 1e6, 1e12, {}});  // 1e12 FLOPs at 50 TFLOP/s: 20 ms
  log.kernels.push_back({"copy", "copy f32[10]/[1]", 1e9, 0, {}});         // 1 GB at 1 TB/s: 1 ms
  std::vector<double> s = tools::roofline_kernels(log, hw);
  CHECK(s[0] == Approx(0.02));
  CHECK(s[1] == Approx(0.001));
  std::vector<kernel_log::Collective> cs = {{"all_gather", "dp_shard", 4, 4e9}, {"all_gather", "dp_shard", 8, 8e9}};
  tools::CommModel m = tools::comm_model(hw, cs);
  CHECK(m.seconds("all_gather", 4, 4e9, "dp_shard") == Approx(3 * 2e-6 + 0.75 * 4e9 / 100e9));  // in the node
  CHECK(m.seconds("all_gather", 8, 8e9, "dp_shard") == Approx(7 * 5e-6 + 0.875 * 8e9 / 10e9));  // across nodes
  // hpZ's groups and the world are consecutive ranks too; HSDP's replicas are strided.
  tools::CommModel groups = tools::comm_model(
      hw, {{"all_gather", "dp_shard/post-forward2", 2, 1e9}, {"all_reduce", "dp_replicate", 2, 1e9},
           {"all_reduce", "world", 4, 1e9}});
  CHECK(groups.seconds("all_gather", 2, 1e9, "dp_shard/post-forward2") == Approx(2e-6 + 0.5 * 1e9 / 100e9));
  CHECK(groups.group_fits.at("dp_replicate").at("all_reduce").at(2).beta_s_per_byte == Approx(2 * 0.5 / 10e9));
  CHECK(groups.seconds("all_reduce", 4, 1e9, "world") == Approx(2 * (3 * 2e-6 + 0.75 * 1e9 / 100e9)));
  // HSDP x TP: the tensor-parallel pairs within a node, the replicas of the
  // same size across nodes; shard groups strided by tp fit in a node only
  // while shard x tp does.
  tools::CommModel tp = tools::comm_model(hw, {{"all_reduce", "tp", 2, 1e9}, {"all_reduce", "dp_replicate", 2, 1e9},
                                                {"all_gather", "dp_shard", 2, 1e9}});
  CHECK(tp.seconds("all_reduce", 2, 1e9, "tp") == Approx(2 * (2e-6 + 0.5 * 1e9 / 100e9)));
  CHECK(tp.seconds("all_reduce", 2, 1e9, "dp_replicate") == Approx(2 * (5e-6 + 0.5 * 1e9 / 10e9)));
  CHECK(tp.seconds("all_gather", 2, 1e9, "dp_shard") == Approx(2e-6 + 0.5 * 1e9 / 100e9));
  tools::CommModel wide = tools::comm_model(hw, {{"all_reduce", "tp", 4, 1e9}, {"all_gather", "dp_shard", 2, 1e9}});
  CHECK(wide.seconds("all_gather", 2, 1e9, "dp_shard") == Approx(5e-6 + 0.5 * 1e9 / 10e9));
  write("name = \"x\"\n[node]\ndevices = 4\n");
  CHECK_THROWS_WITH(tools::load_hardware(path), Catch::Contains("[device] memory_gib is missing"));
  write("[node]\ndevices = 4\n[device]\nmemory_gib = -1\n");
  CHECK_THROWS_WITH(tools::load_hardware(path), Catch::Contains("must be a finite number >= 0"));
  CHECK_THROWS_WITH(tools::load_hardware(path + ".missing"), Catch::Contains("does not exist"));
  std::filesystem::remove(path);
}
