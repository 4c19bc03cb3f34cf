// The planner against the run it plans: on every rank of 1-4, tessera-train's
// model, FSDP and optimizer (tools::shard_model, make_optimizer,
// forward_backward) train two steps on the CPU, and tools::plan_run's
// prediction for that rank is checked against what the allocator and the
// process groups counted. Awkward sizes: 3 heads, a vocabulary of 259, shards
// that are uneven at 3 ranks.
#include "tests/helpers.h"

#include "runtime/allocator.h"
#include "runtime/distributed.h"
#include "runtime/random.h"
#include "tools/plan.h"

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

struct Measured {
  int64_t peak = 0;
  std::map<std::string, dist::CollectiveStats> collectives;  // of the second step
};

// Two steps as tessera-train runs them, on the CPU over the world.
Measured run_two_steps(const tools::TrainConfig& cfg) {
  const int world = dist::world_size(), rank = dist::rank();
  auto [rep, shard] = tools::mesh_shape(cfg, world);
  MeshPtr mesh = rep > 1 ? init_device_mesh("cpu", {rep, shard}, {"dp_replicate", "dp_shard"})
                         : init_device_mesh("cpu", {shard}, {"dp_shard"});
  Measured m;
  const int64_t base = memory_stats().allocated_bytes;
  reset_peak_memory_stats();
  {
    auto model = tools::make_model(cfg, Device::meta());
    tools::shard_model(*model, cfg, mesh);
    model->to_empty(Device::cpu());
    model->init_weights(7);
    auto opt = tools::make_optimizer(*model, cfg);
    const int64_t micro = cfg.training.batch_size / cfg.training.grad_accum / world;
    for (int step = 0; step < 2; ++step) {
      if (step == 1)
        for (int64_t d = 0; d < mesh->ndim(); ++d) mesh->get_group(d)->reset_stats();
      auto batch = [&](int64_t i) {
        uint64_t seed = static_cast<uint64_t>(1000 * step + 10 * i + rank);
        return std::pair{randint({micro, cfg.training.seq_len}, 0, cfg.model.vocab_size, seed),
                         randint({micro, cfg.training.seq_len}, 0, cfg.model.vocab_size, seed + 500)};
      };
      Tensor loss = tools::forward_backward(*model, cfg.training.grad_accum, batch);
      nn::clip_grad_norm_(model->parameters(), cfg.training.max_norm);
      opt->step();
      opt->zero_grad();
    }
    for (int64_t d = 0; d < mesh->ndim(); ++d)
      m.collectives[mesh->dim_names()[static_cast<size_t>(d)]] = mesh->get_group(d)->stats();
  }
  m.peak = memory_stats().peak_allocated_bytes - base;
  return m;
}

void check_plan(const tools::TrainConfig& cfg, const std::string& what) {
  INFO(what << " at " << dist::world_size() << " ranks, rank " << dist::rank());
  tools::Plan plan = tools::plan_run(cfg, dist::world_size(), dist::rank());
  Measured m = run_two_steps(cfg);
  INFO("predicted peak " << plan.peak << " bytes (" << plan.peak_if_collectives_complete_at_once
                          << " if collectives completed at once), measured " << m.peak);
  // The measured peak lies between the two bounds, within 10%; where they are
  // equal (no collective buffer is live at the peak), within 10% of both.
  CHECK(plan.peak_if_collectives_complete_at_once <= plan.peak);
  CHECK(static_cast<double>(plan.peak) >= 0.90 * static_cast<double>(m.peak));
  CHECK(static_cast<double>(plan.peak_if_collectives_complete_at_once) <= 1.10 * static_cast<double>(m.peak));
  if (plan.peak_if_collectives_complete_at_once == plan.peak)
    CHECK(static_cast<double>(plan.peak) <= 1.10 * static_cast<double>(m.peak));
  for (const auto& [group, got] : m.collectives) {
    INFO("group " << group);
    REQUIRE(plan.collectives.count(group) == 1);
    const dist::CollectiveStats& want = plan.collectives.at(group);
    CHECK(want.all_gather == got.all_gather);
    CHECK(want.reduce_scatter == got.reduce_scatter);
    CHECK(want.all_reduce == got.all_reduce);
    CHECK(want.mpi_calls == got.mpi_calls);
    CHECK(want.bytes == got.bytes);
  }
}

}  // namespace

TEST_CASE("the plan predicts a step's peak memory and its collectives", "[plan]") {
  dist::init();
  tools::TrainConfig c = small_config();
  check_plan(c, "gpt2 f32");
  c.parallelism.reshard_after_forward = false;
  check_plan(c, "reshard_after_forward false");
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
  c = small_config();
  c.model.arch = "llama";
  c.model.n_head = 4;
  c.model.n_kv_head = 2;
  c.model.bias = false;
  c.model.tie_embeddings = false;
  c.model.ffn_hidden = 100;
  check_plan(c, "llama, GQA");
  if (dist::world_size() == 4) {
    c = small_config();
    c.parallelism.data_parallel_replicate_degree = 2;
    check_plan(c, "HSDP 2 x 2");
  }
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
}
