// Pipeline schedules as data (pp/schedule.h), in one process: every
// schedule at 1-4 ranks and awkward micro-batch counts validates, runs each
// stage's F and B of every micro-batch once and pairs every message; the
// simulated bubble equals the formula; activations in flight are what each
// schedule promises; broken lists (a missing receive, a cross wait) are
// refused naming the rank and action; splits and bad settings name the key.

#include <cmath>

#include "pp/pipeline.h"
#include "pp/schedule.h"
#include "tests/helpers.h"

using namespace tessera;
using pp::ActionType;


namespace {

pp::Schedule built(const std::string& name, int p, int m, int v = 1) {
  pp::Schedule s = pp::make_schedule(name, p, m, v);
  pp::add_communication(s);
  pp::validate(s);
  return s;
}

}  // namespace

TEST_CASE("every schedule validates and pairs its messages", "[pp][schedule]") {
  for (const std::string& name : pp::schedule_names())
    for (int p = 1; p <= 4; ++p)
      for (int v : (name == "interleaved_1f1b" ? std::vector<int>{1, 2, 3} : std::vector<int>{1}))
        for (int m = 1; m <= 9; ++m) {
          if (name == "interleaved_1f1b" && m % p != 0) continue;
          INFO(name << " p=" << p << " v=" << v << " m=" << m);
          pp::Schedule s = built(name, p, m, v);
          CHECK(s.stages == p * v);
          int sends = 0, recvs = 0;
          for (int r = 0; r < p; ++r) {
            CHECK(s.count(r, ActionType::Forward) == m * v);
            // A backward is B, or (zb_h1) I and W.
            CHECK(s.count(r, ActionType::Backward) + s.count(r, ActionType::BackwardInput) == m * v);
            CHECK(s.count(r, ActionType::BackwardWeight) == s.count(r, ActionType::BackwardInput));
            CHECK(s.count(r, ActionType::BackwardInput) == (name == "zb_h1" ? m : 0));
            sends += s.count(r, ActionType::SendF) + s.count(r, ActionType::SendB);
            recvs += s.count(r, ActionType::RecvF) + s.count(r, ActionType::RecvB);
          }
          // Each stage boundary moves every micro-batch forward and its gradient back.
          const int boundaries = p == 1 ? 0 : s.stages - 1;
          CHECK(sends == 2 * boundaries * m);
          CHECK(recvs == sends);
          // The first stage's rank never receives activations for stage 0; the
          // last stage sends none onward.
          for (const auto& a : s.actions[0]) CHECK(!(a.type == ActionType::RecvF && a.stage == 0));
        }
}

TEST_CASE("one stage on one rank issues no message", "[pp][schedule]") {
  for (const std::string name : {"gpipe", "1f1b"}) {
    pp::Schedule s = built(name, 1, 5);
    for (const auto& a : s.actions[0]) CHECK((a.type == ActionType::Forward || a.type == ActionType::Backward));
  }
}

TEST_CASE("the simulated bubble is the formula; activations in flight as promised", "[pp][schedule]") {
  for (int p = 2; p <= 4; ++p)
    for (int m : {1, 3, 4, 7, 8}) {
      INFO("p=" << p << " m=" << m);
      const double formula = static_cast<double>(p - 1) / (m + p - 1);
      pp::Timing g = pp::simulate(built("gpipe", p, m));
      pp::Timing o = pp::simulate(built("1f1b", p, m));
      CHECK(std::abs(g.bubble() - formula) < 1e-12);
      CHECK(std::abs(o.bubble() - formula) < 1e-12);
      for (int r = 0; r < p; ++r) {
        CHECK(g.max_in_flight[static_cast<size_t>(r)] == m);                 // GPipe holds every micro-batch
        CHECK(o.max_in_flight[static_cast<size_t>(r)] == std::min(m, p - r));  // 1F1B: min(m, p - r)
      }
    }
  // Interleaving v chunks per rank (each 1/v of the work): the bubble
  // shrinks about v times (Megatron: idle / compute = (p - 1) / (v m)).
  for (int p = 2; p <= 4; ++p)
    for (int v : {2, 3})
      for (int m : {p, 2 * p, 4 * p}) {
        INFO("p=" << p << " v=" << v << " m=" << m);
        pp::Timing i = pp::simulate(built("interleaved_1f1b", p, m, v), 1.0 / v, 2.0 / v);
        const double compute = 3.0 * m, idle = i.span - compute;
        CHECK(std::abs(idle / compute - static_cast<double>(p - 1) / (v * m)) < 1e-12);
        CHECK(i.bubble() < pp::simulate(built("1f1b", p, m)).bubble());
      }
}

TEST_CASE("zb_h1: the weights' gradients fill 1F1B's bubble; every rank holds at most p micro-batches", "[pp][schedule]") {
  for (int p = 2; p <= 4; ++p)
    for (int m : {1, 2, 3, 4, 7, 8}) {
      INFO("p=" << p << " m=" << m);
      pp::Schedule z = built("zb_h1", p, m);
      // With F = I = W (the paper's assumption) ...
      pp::Timing zt = pp::simulate(z, 1.0, 2.0), ot = pp::simulate(built("1f1b", p, m), 1.0, 2.0);
      // ... 1F1B idles (p - 1)(F + B) per rank; ZB-H1 (p - 1)(F + I - W) = (p - 1) F once the
      // micro-batches cover the pipeline: a third of 1F1B's.
      const double idle_1f1b = ot.span - 3.0 * m, idle_zb = zt.span - 3.0 * m;
      CHECK(std::abs(idle_1f1b - 3.0 * (p - 1)) < 1e-12);
      if (m >= p) CHECK(std::abs(idle_zb - (p - 1)) < 1e-12);
      CHECK(idle_zb < idle_1f1b);
      for (int r = 0; r < p; ++r) {
        // Activations stay until the W: p micro-batches on every rank (1F1B: p - r).
        CHECK(zt.max_in_flight[static_cast<size_t>(r)] == std::min(m, p));
        // Each rank's I's and W's in micro-batch order, every W after its I.
        int last_i = -1, last_w = -1;
        for (const auto& a : z.actions[static_cast<size_t>(r)]) {
          if (a.type == ActionType::BackwardInput) CHECK(a.microbatch == ++last_i);
          if (a.type == ActionType::BackwardWeight) CHECK(a.microbatch == ++last_w);
          if (a.type == ActionType::BackwardWeight) CHECK(last_w <= last_i);
        }
      }
    }
  // The printed lists: rank 0 keeps at most one W pending, rank 1 two, and
  // runs its last W's where 1F1B's rank 1 would idle at the end.
  CHECK(pp::format(pp::make_schedule("zb_h1", 2, 3)) ==
        "schedule zb_h1: 2 stage(s) on 2 rank(s), 3 micro-batch(es)\n"
        "rank 0: F0.0 F0.1 I0.0 W0.0 F0.2 I0.1 W0.1 I0.2 W0.2\n"
        "rank 1: F1.0 I1.0 F1.1 I1.1 W1.0 F1.2 I1.2 W1.1 W1.2\n");
}

TEST_CASE("a split backward's W before its I, or without it, is refused", "[pp][schedule]") {
  pp::Schedule z = built("zb_h1", 2, 2);
  auto& list = z.actions[1];
  auto i = std::find(list.begin(), list.end(), pp::Action{ActionType::BackwardInput, 1, 0});
  auto w = std::find(list.begin(), list.end(), pp::Action{ActionType::BackwardWeight, 1, 0});
  std::iter_swap(i, w);
  CHECK_THROWS_WITH(pp::validate(z), Catch::Contains("rank 1 runs W1.0 before I1.0"));
  pp::Schedule y = built("zb_h1", 2, 2);
  auto& l0 = y.actions[0];
  l0.erase(std::find(l0.begin(), l0.end(), pp::Action{ActionType::BackwardWeight, 0, 1}));
  CHECK_THROWS_WITH(pp::validate(y), Catch::Contains("rank 0 has I0.1 without its W"));
}

TEST_CASE("FSDP's actions: gathered before the first forward, reduced and freed after the last backward",
          "[pp][schedule][fsdp]") {
  for (const std::string& name : pp::schedule_names())
    for (int p = 1; p <= 3; ++p) {
      const int v = name == "interleaved_1f1b" ? 2 : 1;
      INFO(name << " p=" << p);
      pp::Schedule s = built(name, p, 2 * p, v);
      pp::add_fsdp_actions(s);
      pp::validate(s);
      for (int r = 0; r < p; ++r)
        for (ActionType t : {ActionType::Unshard, ActionType::ReduceGrad, ActionType::Reshard})
          CHECK(s.count(r, t) == v);  // once per stage
      CHECK(pp::simulate(s).bubble() == pp::simulate(built(name, p, 2 * p, v)).bubble());  // they cost no compute
    }
  pp::Schedule z = built("zb_h1", 2, 2);
  pp::add_fsdp_actions(z);
  CHECK(pp::format(z) ==
        "schedule zb_h1: 2 stage(s) on 2 rank(s), 2 micro-batch(es)\n"
        "rank 0: UNSHARD0 F0.0 SEND_F0.0 RECV_B0.0 F0.1 SEND_F0.1 I0.0 RECV_B0.1 W0.0 I0.1 W0.1 REDUCE_GRAD0 RESHARD0\n"
        "rank 1: RECV_F1.0 UNSHARD1 F1.0 RECV_F1.1 I1.0 SEND_B1.0 F1.1 I1.1 SEND_B1.1 W1.0 W1.1 REDUCE_GRAD1 RESHARD1\n");
  CHECK_THROWS_WITH(pp::add_fsdp_actions(z), Catch::Contains("already has UNSHARD0"));
  // A gradient reduced before a backward, an unshard after a forward, a lone action.
  pp::Schedule b = built("1f1b", 2, 2);
  pp::add_fsdp_actions(b);
  auto& l1 = b.actions[1];
  auto reduce = std::find(l1.begin(), l1.end(), pp::Action{ActionType::ReduceGrad, 1, 0});
  std::rotate(l1.begin() + 3, reduce, reduce + 1);
  CHECK_THROWS_WITH(pp::validate(b), Catch::Contains("after REDUCE_GRAD1 (the gradients are reduced after the "
                                                     "stage's last backward)"));
  pp::Schedule u = built("gpipe", 2, 2);
  pp::add_fsdp_actions(u);
  std::swap(u.actions[0][0], u.actions[0][1]);  // F0.0 before UNSHARD0
  CHECK_THROWS_WITH(pp::validate(u), Catch::Contains("rank 0 runs F0.0 before UNSHARD0"));
  pp::Schedule one = built("gpipe", 2, 2);
  one.actions[0].push_back({ActionType::Reshard, 0, 0});
  CHECK_THROWS_WITH(pp::validate(one), Catch::Contains("stage 0 has 1 of its FSDP actions"));
}

TEST_CASE("broken schedules are refused, naming the rank and the action", "[pp][schedule]") {
  // A receive taken out.
  pp::Schedule s = built("1f1b", 3, 4);
  auto& list = s.actions[1];
  list.erase(std::find(list.begin(), list.end(), pp::Action{ActionType::RecvF, 1, 2}));
  CHECK_THROWS_WITH(pp::validate(s), Catch::Contains("rank 1 has no RECV_F1.2 (F1.2 needs it)"));
  // A backward before its forward.
  pp::Schedule t = pp::make_schedule("gpipe", 2, 2);
  std::swap(t.actions[0][0], t.actions[0][2]);  // B0.0 first
  CHECK_THROWS_WITH(pp::validate(t), Catch::Contains("runs B0.0 before F0.0"));
  // A cross wait: rank 0 waits for micro-batch 0's gradient before sending
  // micro-batch 1 forward, while rank 1 computes micro-batch 1 first.
  pp::Schedule d = pp::make_schedule("1f1b", 2, 2);
  d.actions[0] = {{ActionType::Forward, 0, 0}, {ActionType::Backward, 0, 0}, {ActionType::Forward, 0, 1},
                  {ActionType::Backward, 0, 1}};
  d.actions[1] = {{ActionType::Forward, 1, 1}, {ActionType::Forward, 1, 0}, {ActionType::Backward, 1, 0},
                  {ActionType::Backward, 1, 1}};
  pp::add_communication(d);
  CHECK_THROWS_WITH(pp::validate(d), Catch::Contains("schedule 1f1b deadlocks: every rank waits (rank 0 at B0.0, "
                                                       "rank 1 at F1.1)"));
  // Backwards of a stage out of micro-batch order (the gradients would sum
  // in another order than on one process).
  pp::Schedule o = pp::make_schedule("gpipe", 2, 3);
  std::swap(o.actions[1][3], o.actions[1][4]);  // B1.1 before B1.0
  pp::add_communication(o);
  CHECK_THROWS_WITH(pp::validate(o), Catch::Contains("rank 1 runs B1.1 before B1.0 (backwards of a stage run in "
                                                     "micro-batch order)"));
  // Settings.
  CHECK_THROWS_WITH(pp::make_schedule("zigzag", 2, 4), Catch::Contains("unknown pipeline schedule 'zigzag' "
                                                                         "(expected one of: gpipe, 1f1b, interleaved_1f1b, zb_h1)"));
  CHECK_THROWS_WITH(pp::make_schedule("interleaved_1f1b", 3, 4, 2),
                    Catch::Contains("4 micro-batches is not a multiple of 3 ranks"));
  CHECK_THROWS_WITH(pp::make_schedule("1f1b", 2, 4, 2), Catch::Contains("runs one stage per rank, not 2"));
  CHECK_THROWS_WITH(pp::make_schedule("1f1b", 2, 0), Catch::Contains("0 micro-batches"));
}

TEST_CASE("printed, one rank per line", "[pp][schedule]") {
  pp::Schedule s = built("1f1b", 2, 2);
  CHECK(pp::format(s) ==
        "schedule 1f1b: 2 stage(s) on 2 rank(s), 2 micro-batch(es)\n"
        // Stage 0 sends no gradient back; each receive is posted one compute action early.
        "rank 0: F0.0 SEND_F0.0 RECV_B0.0 F0.1 SEND_F0.1 RECV_B0.1 B0.0 B0.1\n"
        "rank 1: RECV_F1.0 F1.0 RECV_F1.1 B1.0 SEND_B1.0 F1.1 B1.1 SEND_B1.1\n");
}

TEST_CASE("layers split over stages; bad splits name the key", "[pp][split]") {
  auto counts = [](const std::vector<pp::StageBlocks>& s) {
    std::vector<int64_t> c;
    for (const auto& b : s) c.push_back(b.end - b.first);
    return c;
  };
  CHECK(counts(pp::split_layers(4, 3)) == std::vector<int64_t>{1, 2, 1});  // the middle first
  CHECK(counts(pp::split_layers(7, 3)) == std::vector<int64_t>{2, 3, 2});
  CHECK(counts(pp::split_layers(5, 2)) == std::vector<int64_t>{3, 2});
  CHECK(counts(pp::split_layers(6, 4)) == std::vector<int64_t>{1, 2, 2, 1});
  CHECK(counts(pp::split_layers(5, 2, {1, 4})) == std::vector<int64_t>{1, 4});
  CHECK_THROWS_WITH(pp::split_layers(3, 4), Catch::Contains("4 stages for 3 blocks (model.n_layer)"));
  CHECK_THROWS_WITH(pp::split_layers(5, 2, {2, 2}), Catch::Contains("sum to 4, but the model has 5 blocks"));
  CHECK_THROWS_WITH(pp::split_layers(5, 2, {5, 0}), Catch::Contains("a stage of 0 blocks"));
}

TEST_CASE("stages by module names: the cut the names say; wrong names refused, naming them", "[pp][split]") {
  nn::TransformerConfig gpt;
  gpt.n_layer = 5;
  gpt.n_head = 2;
  gpt.n_embd = 8;
  gpt.vocab_size = 11;
  gpt.block_size = 4;
  gpt.tie_embeddings = false;
  auto cut = [](const std::vector<pp::StageBlocks>& s) {
    std::vector<std::pair<int64_t, int64_t>> c;
    for (const auto& b : s) c.push_back({b.first, b.end});
    return c;
  };
  using Cut = std::vector<std::pair<int64_t, int64_t>>;
  const std::vector<std::vector<std::string>> two = {
      {"transformer.wte", "transformer.wpe", "transformer.h.0"},
      {"transformer.h.1", "transformer.h.2", "transformer.h.3", "transformer.h.4", "transformer.ln_f", "lm_head"}};
  CHECK(cut(pp::split_by_names(gpt, two)) == Cut{{0, 1}, {1, 5}});
  nn::TransformerConfig llama = gpt;
  llama.arch = "llama";
  llama.n_layer = 4;
  llama.n_kv_head = 1;
  llama.bias = false;
  CHECK(cut(pp::split_by_names(llama, {{"model.embed_tokens", "model.layers.0"},
                                       {"model.layers.1", "model.layers.2"},
                                       {"model.layers.3", "model.norm", "lm_head"}})) == Cut{{0, 1}, {1, 3}, {3, 4}});
  auto refused = [&](std::vector<std::vector<std::string>> names, const std::string& why) {
    INFO(why);
    CHECK_THROWS_WITH(pp::split_by_names(gpt, names), Catch::Contains(why));
  };
  auto with = two;
  std::swap(with[1][0], with[1][1]);  // h.2 before h.1
  refused(with, "stage 1 names 'transformer.h.2' where it needs transformer.h.1");
  with = two;
  with[1].push_back("transformer.wpe");
  refused(with, "which stage 0 names too");
  with = two;
  std::swap(with[0][1], with[1][5]);  // lm_head on stage 0, the positions on stage 1
  refused(with, "stage 0 names 'lm_head', which the last stage (1) computes");
  with = two;
  with[1].pop_back();
  refused(with, "no stage names 'lm_head' (the last stage holds it)");
  with = two;
  with[1][0] = "transformer.h.9";
  refused(with, "stage 1 names 'transformer.h.9', which is not a block (transformer.h.0 .. transformer.h.4)");
  with = two;
  with[1].erase(with[1].begin() + 3);  // h.4 on no stage
  refused(with, "blocks 0 .. 3 of the model's 5 (model.n_layer): transformer.h.4 and after are on no stage");
  refused({{"transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1", "transformer.h.2",
            "transformer.h.3", "transformer.h.4"},
           {"transformer.ln_f", "lm_head"}},
          "stage 1 names no block");
}
