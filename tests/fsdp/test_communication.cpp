// FSDP communication: collective counts per iteration (PyTorch's formulas),
// event orders with implicit and explicit prefetch, gradient accumulation,
// HSDP, traces, groups unreached in backward or frozen, and a world of one
// rank making no MPI call.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "fsdp/checkpoint.h"
#include "fsdp/state_dict.h"
#include "runtime/trace.h"
#include "tests/fsdp/fsdp_helpers.h"
#include "tests/mpi_calls.h"

using namespace tessera;
using namespace tessera::testing;

TEST_CASE("collective counts per iteration (B blocks + root)", "[fsdp][comm]") {
  int w = world();
  auto mesh = init_device_mesh("cpu", {w}, {"dp"});
  auto g = std::vector<dist::ProcessGroupPtr>{mesh->get_group(0)};
  const int64_t B = 3, expect = w > 1 ? 1 : 0;  // world size 1: no collective at all
  struct Case {
    fsdp::ReshardAfterForward raf;
    bool root_too;
    int64_t backward_ag;
    const char* name;
  };
  std::vector<Case> cases = {{{}, false, B, "default (root keeps its parameters)"},
                             {true, true, B + 1, "reshard after forward everywhere"},
                             {false, true, 0, "no reshard after forward"}};
  for (auto& c : cases) {
    INFO(c.name);
    auto model = sharded_gpt(mesh, c.raf, c.root_too);
    for (int it = 0; it < 2; ++it) {
      reset(g);
      Tensor loss = nn::cross_entropy((*model)(tokens(it)), tokens(it + 10));
      Counts f = counts(g);
      CHECK(f.ag == (B + 1) * expect);
      CHECK(f.rs == 0);
      reset(g);
      autograd::backward(loss);
      Counts b = counts(g);
      CHECK(b.ag == c.backward_ag * expect);
      CHECK(b.rs == (B + 1) * expect);
      CHECK(b.ar == 0);
      model->zero_grad();
    }
    // The optimizer steps on shards without any collective; clipping costs one all-reduce.
    optim::AdamW opt(model->parameters(), {.lr = 1e-3});
    autograd::backward(nn::cross_entropy((*model)(tokens(3)), tokens(4)));
    reset(g);
    opt.step();
    CHECK(counts(g).ag + counts(g).rs + counts(g).ar == 0);
    nn::clip_grad_norm_(model->parameters(), 1.0);
    CHECK(counts(g).ar == 1);
  }
  if (w == 1) CHECK(mesh->get_group(0)->stats().mpi_calls == 0);
  // Int reshard_after_forward: the backward gathers run over the size-k groups.
  if (w == 4) {
    auto model = sharded_gpt(mesh, 2, true);
    (void)nn::cross_entropy((*model)(tokens(1)), tokens(2));
    autograd::clear_tape();
    fsdp::reset_iter_state(*model);
    reset(g);
    Tensor loss = nn::cross_entropy((*model)(tokens(1)), tokens(2));
    CHECK(counts(g).ag == B + 1);
    std::vector<dist::ProcessGroupPtr> post;
    std::vector<nn::Module*> managed = {model.get()};
    for (auto& b : model->blocks) managed.push_back(b.get());
    for (nn::Module* m : managed) {
      auto& info = fsdp::fsdp_state(*m).param_group->post_forward_mesh_info;
      REQUIRE(info.has_value());
      CHECK(info->shard_group->size() == 2);
      post.push_back(info->shard_group);
    }
    reset(g);
    reset(post);
    autograd::backward(loss);
    CHECK(counts(g).ag == 0);         // not on the world group...
    CHECK(counts(post).ag == B + 1);  // ...but over each group's 2-rank subgroup
    CHECK(counts(g).rs == B + 1);
  }
  // Int edge cases as PyTorch: k = W is true, k = 1 is false, a non-divisor is an error.
  if (w > 1) {
    for (int k : {w, 1}) {
      INFO("reshard_after_forward=" << k);
      auto model = sharded_gpt(mesh, k, true);
      Tensor loss = nn::cross_entropy((*model)(tokens(1)), tokens(2));
      reset(g);
      autograd::backward(loss);
      CHECK(counts(g).ag == (k == w ? B + 1 : 0));
      CHECK(counts(g).rs == B + 1);
    }
    CHECK_THROWS_WITH(sharded_gpt(mesh, w + 1, true), Catch::Contains("must be a positive divisor of the shard size"));
    CHECK_THROWS_WITH(sharded_gpt(mesh, 0, true), Catch::Contains("must be a positive divisor of the shard size"));
  }
}

TEST_CASE("world size 1: FSDP and HSDP training, clipping and a checkpoint make no MPI call", "[fsdp][comm]") {
  if (world() != 1) return;
  int64_t before = testing::mpi_calls_made();
  auto mesh = init_device_mesh("cpu", {1}, {"dp"});
  auto hsdp = init_device_mesh("cpu", {1, 1}, {"replicate", "shard"});
  for (const auto& m : {mesh, hsdp}) {
    auto model = sharded_gpt(m, true, true, {.param_dtype = DType::BF16, .reduce_dtype = DType::F32});
    optim::AdamW opt(model->parameters(), {.lr = 1e-3});
    for (uint64_t it = 0; it < 2; ++it) {
      autograd::backward(nn::cross_entropy((*model)(tokens(it)), tokens(it + 7)));
      nn::clip_grad_norm_(model->parameters(), 1.0);
      opt.step();
      opt.zero_grad();
    }
    auto dir = std::filesystem::temp_directory_path() / fmt::format("tessera-np1-ckpt-{}", ::getpid());
    std::string saved = fsdp::save_checkpoint(dir.string(), 2, *model, &opt);
    fsdp::load_checkpoint(saved, *model, &opt);
    (void)fsdp::full_state_dict(*model);
    std::filesystem::remove_all(dir);
  }
  CHECK(testing::mpi_calls_made() - before == 0);
}

TEST_CASE("event order: implicit forward prefetch and reverse post-forward backward prefetch", "[fsdp][order]") {
  auto mesh = init_device_mesh("cpu", {world()}, {"dp"});
  auto model = sharded_gpt(mesh, true, true);
  autograd::backward(nn::cross_entropy((*model)(tokens(1)), tokens(2)));  // records the forward order
  std::vector<std::string> events;
  fsdp::fsdp_state(*model).comm_ctx->on_event = [&](const std::string& e, const std::string& fqn,
                                                   fsdp::TrainingState s) {
    events.push_back(e + " " + (fqn.empty() ? "root" : fqn) + " " + fsdp::training_state_name(s));
  };
  Tensor loss = nn::cross_entropy((*model)(tokens(3)), tokens(4));
  std::vector<std::string> forward = {
      "unshard root FORWARD",           "unshard transformer.h.0 FORWARD", "unshard transformer.h.1 FORWARD",
      "reshard transformer.h.0 FORWARD", "unshard transformer.h.2 FORWARD", "reshard transformer.h.1 FORWARD",
      "reshard transformer.h.2 FORWARD", "reshard root FORWARD"};
  CHECK(events == forward);
  events.clear();
  autograd::backward(loss);
  std::vector<std::string> unshard_and_post;
  for (auto& e : events)
    if (e.rfind("unshard", 0) == 0 || e.rfind("post_backward", 0) == 0) unshard_and_post.push_back(e);
  std::vector<std::string> backward = {
      "unshard root PRE_BACKWARD",           "unshard transformer.h.2 PRE_BACKWARD",
      "unshard transformer.h.1 PRE_BACKWARD", "post_backward transformer.h.2 POST_BACKWARD",
      "unshard transformer.h.0 PRE_BACKWARD", "post_backward transformer.h.1 POST_BACKWARD",
      "post_backward transformer.h.0 POST_BACKWARD", "post_backward root POST_BACKWARD"};
  CHECK(unshard_and_post == backward);
  // Explicit forward prefetch of two blocks at once.
  events.clear();
  fsdp::set_modules_to_forward_prefetch(*model, {model->blocks[0].get(), model->blocks[1].get()});
  for (auto& b : model->blocks) fsdp::set_modules_to_forward_prefetch(*b, {});
  (void)nn::cross_entropy((*model)(tokens(5)), tokens(6));
  std::vector<std::string> explicit_forward = {
      "unshard root FORWARD",           "unshard transformer.h.0 FORWARD", "unshard transformer.h.1 FORWARD",
      "reshard transformer.h.0 FORWARD", "reshard transformer.h.1 FORWARD", "unshard transformer.h.2 FORWARD",
      "reshard transformer.h.2 FORWARD", "reshard root FORWARD"};
  CHECK(events == explicit_forward);
  autograd::clear_tape();
  fsdp::reset_iter_state(*model);
  // The whole backward, reshards included, then explicit backward prefetch
  // of two blocks at once from the root.
  for (int pass = 0; pass < 2; ++pass) {
    if (pass == 1) {
      fsdp::set_modules_to_backward_prefetch(*model, {model->blocks[2].get(), model->blocks[1].get()});
      for (auto& b : model->blocks) fsdp::set_modules_to_backward_prefetch(*b, {});
    }
    Tensor l = nn::cross_entropy((*model)(tokens(7)), tokens(8));
    events.clear();
    autograd::backward(l);
    std::vector<std::string> expected =
        pass == 0 ? std::vector<std::string>{"unshard root PRE_BACKWARD",
                                             "unshard transformer.h.2 PRE_BACKWARD",
                                             "unshard transformer.h.1 PRE_BACKWARD",  // implicit prefetch by h.2
                                             "post_backward transformer.h.2 POST_BACKWARD",
                                             "reshard transformer.h.2 POST_BACKWARD",
                                             "unshard transformer.h.0 PRE_BACKWARD",  // prefetched by h.1
                                             "post_backward transformer.h.1 POST_BACKWARD",
                                             "reshard transformer.h.1 POST_BACKWARD",
                                             "post_backward transformer.h.0 POST_BACKWARD",
                                             "reshard transformer.h.0 POST_BACKWARD",
                                             "post_backward root POST_BACKWARD",
                                             "reshard root POST_BACKWARD"}
                  : std::vector<std::string>{"unshard root PRE_BACKWARD",
                                             "unshard transformer.h.2 PRE_BACKWARD",  // both prefetched by the root,
                                             "unshard transformer.h.1 PRE_BACKWARD",  // in the order given
                                             "post_backward transformer.h.2 POST_BACKWARD",
                                             "reshard transformer.h.2 POST_BACKWARD",
                                             "unshard transformer.h.0 PRE_BACKWARD",  // by h.1: an empty list keeps the default
                                             "post_backward transformer.h.1 POST_BACKWARD",
                                             "reshard transformer.h.1 POST_BACKWARD",
                                             "post_backward transformer.h.0 POST_BACKWARD",
                                             "reshard transformer.h.0 POST_BACKWARD",
                                             "post_backward root POST_BACKWARD",
                                             "reshard root POST_BACKWARD"};
    CHECK(events == expected);
  }
}

TEST_CASE("gradient accumulation without sync, then one reduction", "[fsdp][accumulation]") {
  // PyTorch's test_gradient_accumulation matrix: 3 MLPs + root, 3 micro-batches;
  // FSDP and HSDP (2x2); reshard_after_forward true/false/2; which modules skip
  // the sync (all, the root only, the middle MLPs); with or without resharding
  // after the no-sync backwards. Counts per iteration as section 4.2 of the
  // reference, and gradients equal the reference's accumulated ones.
  int w = world();
  std::vector<MeshPtr> meshes = {init_device_mesh("cpu", {w}, {"dp"})};
  if (w == 4) meshes.push_back(init_device_mesh("cpu", {2, 2}, {"replicate", "shard"}));
  const int64_t M = 3, micro = 3, e = w > 1 ? 1 : 0;
  for (const auto& mesh : meshes) {
    bool hsdp = mesh->ndim() == 2;
    std::vector<fsdp::ReshardAfterForward> rafs = {true, false};
    if (mesh->size(mesh->ndim() - 1) == 4) rafs.push_back(2);
    for (const auto& raf : rafs) {
      for (std::string mode : {"all", "root_only", "some_mlps"}) {
        for (bool rab : {true, false}) {
          bool raf_false = std::holds_alternative<bool>(raf) && !std::get<bool>(raf);
          // As PyTorch's test: keeping parameters after the no-sync backwards only
          // with reshard_after_forward false and mode all or root_only.
          if (!rab && (!raf_false || mode == "some_mlps")) continue;
          INFO(mesh->str() << " reshard_after_forward "
                           << (std::holds_alternative<int>(raf) ? 2 : std::get<bool>(raf))
                           << " mode " << mode << " reshard_after_backward " << rab);
          MLPStack ref;
          ref.init_weights(9);
          ref.to(DType::F64);
          MLPStack model(Device::meta());
          shard_and_init(model, {.mesh = mesh, .reshard_after_forward = raf}, 9, DType::F64);
          // The shard groups (all-gathers, reduce-scatters) and, for HSDP, the replicate group.
          auto shard = std::vector<dist::ProcessGroupPtr>{mesh->get_group(mesh->ndim() - 1)};
          auto rep = hsdp ? std::vector<dist::ProcessGroupPtr>{mesh->get_group(0)} : shard;
          // reshard_after_forward=2: the backward gathers run over each group's 2-rank subgroup.
          std::vector<dist::ProcessGroupPtr> post;
          std::vector<nn::Module*> managed = model.blocks();
          managed.push_back(&model);
          for (nn::Module* m : managed)
            if (auto& info = fsdp::fsdp_state(*m).param_group->post_forward_mesh_info) post.push_back(info->shard_group);
          reset(shard);
          reset(rep);
          reset(post);
          for (int64_t mb = 0; mb < micro; ++mb) {
            bool last = mb == micro - 1;
            auto flags = [&](nn::Module& m, bool recurse) {
              fsdp::set_requires_gradient_sync(m, last, recurse);
              if (!rab) fsdp::set_reshard_after_backward(m, last, recurse);
            };
            if (mode == "all") flags(model, true);
            else if (mode == "root_only") flags(model, false);
            else for (size_t i = 1; i < model.blocks().size(); ++i) flags(*model.blocks()[i], false);
            Tensor x = randn({12, 15}, 50 + static_cast<uint64_t>(mb), DType::F64);
            Tensor y = randn({12, 5}, 60 + static_cast<uint64_t>(mb), DType::F64);
            autograd::backward(mean(square(ref(x) - y)));
            autograd::backward(mean(square(model(local_rows(x)) - local_rows(y))));
          }
          int64_t rs = M + 1;  // the last micro-batch reduces every group
          if (mode == "root_only") rs += M * (micro - 1);           // the MLPs reduce every time
          if (mode == "some_mlps") rs += (M - 2 + 1) * (micro - 1);  // MLP 0 and the root do
          int64_t ag = M + 1;
          if (!raf_false) ag *= 2 * micro;
          else if (rab) ag *= micro;
          else if (mode == "root_only") ag += M * (micro - 1);  // the MLPs reshard after backward
          Counts cs = counts(shard), cr = counts(rep), cp = counts(post);
          CHECK(cs.rs == rs * e);
          CHECK(cs.ag + cp.ag == ag * e);
          if (!post.empty()) CHECK(cp.ag == (M + 1) * micro);  // every backward gather is on a subgroup
          CHECK((hsdp ? cr.ar : cs.ar) == (hsdp ? rs : 0));
          check_sharded_parity(model, ref, 1e-9, 1e-12);
        }
      }
    }
  }
}

TEST_CASE("HSDP: reduce-scatter every micro-batch, all-reduce only on the last", "[fsdp][hsdp]") {
  int w = world();
  if (w != 4) return;
  auto mesh = init_device_mesh("cpu", {2, 2}, {"replicate", "shard"});
  MLPStack ref;
  ref.init_weights(11);
  ref.to(DType::F64);
  MLPStack model(Device::meta());
  shard_and_init(model, {.mesh = mesh}, 11, DType::F64);
  auto shard = std::vector<dist::ProcessGroupPtr>{mesh->get_group("shard")};
  auto rep = std::vector<dist::ProcessGroupPtr>{mesh->get_group("replicate")};
  reset(shard);
  reset(rep);
  const int64_t M = 3, micro = 3;
  for (int64_t mb = 0; mb < micro; ++mb) {
    fsdp::set_requires_all_reduce(model, mb == micro - 1);
    Tensor x = randn({12, 15}, 90 + static_cast<uint64_t>(mb), DType::F64);
    Tensor y = randn({12, 5}, 95 + static_cast<uint64_t>(mb), DType::F64);
    autograd::backward(mean(square(ref(x) - y)));
    autograd::backward(mean(square(model(local_rows(x)) - local_rows(y))));
  }
  CHECK(counts(shard).rs == (M + 1) * micro);
  CHECK(counts(rep).ar == M + 1);
  check_sharded_parity(model, ref, 1e-9, 1e-12);
}

TEST_CASE("traces: lanes for compute and each collective, exposed time, one file for all ranks", "[fsdp][trace]") {
  int w = world();
  auto mesh = init_device_mesh("cpu", {w}, {"dp"});
  auto model = sharded_gpt(mesh, true, true);
  autograd::backward(nn::cross_entropy((*model)(tokens(1)), tokens(2)));
  model->zero_grad();
  trace::take();
  trace::enable(true);
  double t0 = trace::now_us();
  autograd::backward(nn::cross_entropy((*model)(tokens(3)), tokens(4)));
  double t1 = trace::now_us();
  trace::enable(false);
  auto spans = trace::take();
  auto s = trace::summarize(spans);
  CHECK(s.compute_us > 0);
  CHECK(s.exposed_us <= t1 - t0);
  bool has_fsdp = false, has_ag = false, has_rs = false;
  for (auto& sp : spans) {
    has_fsdp = has_fsdp || sp.lane == fsdp::trace_lane();
    has_ag = has_ag || sp.lane == trace::Lane::AllGather;
    has_rs = has_rs || sp.lane == trace::Lane::ReduceScatter;
    CHECK(sp.end_us >= sp.start_us);
  }
  CHECK(has_fsdp);
  CHECK(has_ag == (w > 1));
  CHECK(has_rs == (w > 1));
  if (w > 1) {
    // Prefetch: some all-gather is in flight while compute runs (issued
    // before a block's backward, completed during it).
    bool overlapped = false;
    for (auto& ag : spans) {
      if (ag.lane != trace::Lane::AllGather) continue;
      for (auto& c : spans)
        overlapped = overlapped || (c.lane == trace::Lane::Compute && c.start_us >= ag.start_us &&
                                    c.end_us <= ag.end_us);
    }
    CHECK(overlapped);
    double waited = 0;
    for (auto& sp : spans)
      if (sp.lane == trace::Lane::Wait) waited += sp.end_us - sp.start_us;
    CHECK(std::abs(s.exposed_us - waited) < 1.0);  // exposed = time blocked in wait()
  }
  // A path every rank agrees on (rank 0 writes the file), outside the source tree.
  std::string path = (std::filesystem::temp_directory_path() /
                      fmt::format("tessera-trace-test-{}.json",
                                  dist::all_gather_strings(dist::world(), std::to_string(::getpid()))[0]))
                         .string();
  trace::write_chrome_trace(path, spans);
  if (dist::rank() == 0) {
    std::ifstream in(path);
    auto j = nlohmann::json::parse(in);
    std::set<int> pids;
    std::set<std::string> lanes;
    for (auto& e : j["traceEvents"]) {
      pids.insert(e["pid"].get<int>());
      if (e["name"] == "thread_name") lanes.insert(e["args"]["name"].get<std::string>());
    }
    CHECK(static_cast<int>(pids.size()) == w);
    CHECK(lanes.count("compute") == 1);
    CHECK(lanes.count("all_gather") == 1);
    CHECK(lanes.count("reduce_scatter") == 1);
    CHECK(lanes.count("waiting for communication (exposed)") == 1);
    std::filesystem::remove(path);
  }
}

namespace {
// Two branches under one root; the loss may leave branch b out.
class TwoBranch : public nn::Module {
 public:
  explicit TwoBranch(Device d = Device::cpu()) {
    a = register_module("a", std::make_shared<MLP>(15, 7, 15, d));
    b = register_module("b", std::make_shared<MLP>(15, 6, 15, d));
    head = register_module("head", std::make_shared<nn::Linear>(15, 5, true, d));
  }
  Tensor forward(const Tensor& x) override {
    Tensor ya = (*a)(x), yb = (*b)(x);  // b always runs forward
    return (*head)(use_b ? ya + yb : ya);
  }
  bool use_b = true;
  std::shared_ptr<MLP> a, b;
  std::shared_ptr<nn::Linear> head;
};
}  // namespace

TEST_CASE("a group that ran forward but not backward is resharded and not reduced", "[fsdp][unreached]") {
  int w = world();
  auto mesh = init_device_mesh("cpu", {w}, {"dp"});
  TwoBranch ref;
  ref.init_weights(4);
  ref.to(DType::F64);
  TwoBranch model(Device::meta());
  fsdp::fully_shard(*model.a, {.mesh = mesh});
  fsdp::fully_shard(*model.b, {.mesh = mesh, .reshard_after_forward = false});  // stays unsharded until the end
  fsdp::fully_shard(model, {.mesh = mesh});
  model.to_empty(Device::cpu());
  model.init_weights(4);
  model.to(DType::F64);
  auto g = std::vector<dist::ProcessGroupPtr>{mesh->get_group(0)};
  for (bool use_b : {false, true, false}) {
    INFO("branch b in the loss: " << use_b);
    ref.use_b = model.use_b = use_b;
    Tensor x = randn({12, 15}, 40 + use_b, DType::F64), y = randn({12, 5}, 50, DType::F64);
    autograd::backward(mean(square(ref(x) - y)));
    reset(g);
    autograd::backward(mean(square(model(local_rows(x)) - local_rows(y))));
    CHECK(counts(g).rs == (use_b ? 3 : 2) * (w > 1));  // b's group reduces nothing when unreached
    check_sharded_parity(model, ref, 1e-9, 1e-12);    // everything resharded; b's grads undefined
    ref.zero_grad();
    model.zero_grad();
  }
  // unshard(async) and then a forward that does not wait on the handle itself.
  auto handle = fsdp::unshard(*model.a, true);
  Tensor x = randn({12, 15}, 60, DType::F64);
  CHECK_CLOSE(model(local_rows(x)), local_rows(ref(x)), 1e-12, 1e-12);
  (void)handle;
  autograd::clear_tape();
  fsdp::reset_iter_state(model);
}

TEST_CASE("a group whose parameters are all frozen is gathered but never reduced", "[fsdp][frozen]") {
  int w = world();
  auto mesh = init_device_mesh("cpu", {w}, {"dp"});
  MLPStack ref;
  ref.init_weights(6);
  ref.to(DType::F64);
  MLPStack model(Device::meta());
  for (auto& p : model.blocks()[1]->parameters()) p.set_requires_grad(false);
  for (auto& p : ref.blocks()[1]->parameters()) p.set_requires_grad(false);
  shard_and_init(model, {.mesh = mesh}, 6, DType::F64);
  auto g = std::vector<dist::ProcessGroupPtr>{mesh->get_group(0)};
  Tensor x = randn({12, 15}, 61, DType::F64), y = randn({12, 5}, 62, DType::F64);
  autograd::backward(mean(square(ref(x) - y)));
  reset(g);
  autograd::backward(mean(square(model(local_rows(x)) - local_rows(y))));
  Counts c = counts(g);
  CHECK(c.ag == 7 * (w > 1));  // forward: 3 blocks + root; backward: the blocks again (the root keeps its own)
  CHECK(c.rs == 3 * (w > 1));  // blocks 0 and 2 and the root: the frozen block reduces nothing
  for (auto& p : model.blocks()[1]->parameters()) CHECK_FALSE(p.grad().defined());
  check_sharded_parity(model, ref, 1e-9, 1e-12);
}
