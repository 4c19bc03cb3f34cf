#include "pp/schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <deque>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <tuple>

#include "runtime/check.h"

namespace tessera::pp {

namespace {

bool is_compute(ActionType t) {
  return t == ActionType::Forward || t == ActionType::Backward || t == ActionType::BackwardInput ||
         t == ActionType::BackwardWeight;
}

bool is_fsdp(ActionType t) {
  return t == ActionType::Unshard || t == ActionType::Reshard || t == ActionType::ReduceGrad;
}

// The action that computes a stage's input gradient: B, or I of a split backward.
bool computes_input_grad(ActionType t) { return t == ActionType::Backward || t == ActionType::BackwardInput; }

// One stage per rank (gpipe, 1f1b): stage r on rank r.
Schedule skeleton(const std::string& name, int ranks, int stages, int microbatches) {
  Schedule s;
  s.name = name;
  s.ranks = ranks;
  s.stages = stages;
  s.microbatches = microbatches;
  s.actions.resize(static_cast<size_t>(ranks));
  for (int st = 0; st < stages; ++st) s.stage_rank.push_back(st % ranks);  // looped placement
  return s;
}

Schedule gpipe(int p, int m) {
  Schedule s = skeleton("gpipe", p, p, m);
  for (int r = 0; r < p; ++r) {
    auto& a = s.actions[static_cast<size_t>(r)];
    for (int i = 0; i < m; ++i) a.push_back({ActionType::Forward, r, i});
    for (int i = 0; i < m; ++i) a.push_back({ActionType::Backward, r, i});
  }
  return s;
}

Schedule one_f_one_b(int p, int m) {
  Schedule s = skeleton("1f1b", p, p, m);
  for (int r = 0; r < p; ++r) {
    auto& a = s.actions[static_cast<size_t>(r)];
    const int warmup = std::min(m, p - 1 - r);
    for (int i = 0; i < warmup; ++i) a.push_back({ActionType::Forward, r, i});
    for (int i = 0; i < m - warmup; ++i) {
      a.push_back({ActionType::Forward, r, warmup + i});
      a.push_back({ActionType::Backward, r, i});
    }
    for (int i = m - warmup; i < m; ++i) a.push_back({ActionType::Backward, r, i});
  }
  return s;
}

// Megatron's interleaved schedule: rank r holds stages r, r + p, ..., its
// chunks c = 0 .. v-1. Micro-batches go through in groups of p: the k-th
// forward of a rank is chunk (k / p) % v of micro-batch (k / (p v)) p + k % p;
// backwards run the chunks in reverse. Warm-up: (p - 1 - r) 2 + (v - 1) p.
Schedule interleaved(int p, int v, int m) {
  Schedule s = skeleton("interleaved_1f1b", p, p * v, m);
  const int n = m * v;
  auto unit = [&](int k, bool backward) {
    const int within = k % (p * v), chunk = within / p, mb = (k / (p * v)) * p + within % p;
    return std::pair{backward ? v - 1 - chunk : chunk, mb};
  };
  for (int r = 0; r < p; ++r) {
    auto& a = s.actions[static_cast<size_t>(r)];
    auto f = [&](int k) {
      auto [c, mb] = unit(k, false);
      a.push_back({ActionType::Forward, c * p + r, mb});
    };
    auto b = [&](int k) {
      auto [c, mb] = unit(k, true);
      a.push_back({ActionType::Backward, c * p + r, mb});
    };
    const int warmup = std::min(n, (p - 1 - r) * 2 + (v - 1) * p);
    for (int k = 0; k < warmup; ++k) f(k);
    for (int k = 0; k < n - warmup; ++k) {
      f(warmup + k);
      b(k);
    }
    for (int k = n - warmup; k < n; ++k) b(k);
  }
  return s;
}

// ZB-H1 (Qi et al. 2023): each rank runs 1F1B's order of F and I (p - 1 - r
// warm-up forwards on rank r), and its W's (oldest first) where the next of
// those would wait, or once rank r has r + 1 of them pending. Placed by
// running the ranks in lockstep with F = I = W = one unit (the paper's
// assumption): the W's fill what 1F1B leaves idle, which leaves (p - 1) F
// per rank (1F1B: (p - 1)(F + B), three times that) once m >= p, and every
// rank holds at most min(m, p) micro-batches (forwarded, W not yet run).
Schedule zb_h1(int p, int m) {
  Schedule s = skeleton("zb_h1", p, p, m);
  std::vector<std::vector<Action>> order(static_cast<size_t>(p));
  for (int r = 0; r < p; ++r) {
    auto& a = order[static_cast<size_t>(r)];
    const int warmup = std::min(m, p - 1 - r);
    for (int i = 0; i < warmup; ++i) a.push_back({ActionType::Forward, r, i});
    for (int i = 0; i < m - warmup; ++i) {
      a.push_back({ActionType::Forward, r, warmup + i});
      a.push_back({ActionType::BackwardInput, r, i});
    }
    for (int i = m - warmup; i < m; ++i) a.push_back({ActionType::BackwardInput, r, i});
  }
  constexpr int never = std::numeric_limits<int>::max();
  // When each stage's F and I of each micro-batch finish.
  std::vector<std::vector<int>> f_done(static_cast<size_t>(p), std::vector<int>(static_cast<size_t>(m), never));
  std::vector<std::vector<int>> i_done = f_done;
  std::vector<size_t> next(static_cast<size_t>(p), 0);
  std::vector<std::deque<int>> pending(static_cast<size_t>(p));  // micro-batches whose I ran, not their W
  int left = 3 * p * m;
  for (int t = 0; left > 0; ++t)
    for (int r = 0; r < p; ++r) {
      const auto ur = static_cast<size_t>(r);
      auto& list = s.actions[ur];
      if (next[ur] < order[ur].size() && static_cast<int>(pending[ur].size()) <= r) {
        const Action a = order[ur][next[ur]];
        const auto mb = static_cast<size_t>(a.microbatch);
        const bool ready = a.type == ActionType::Forward
                               ? r == 0 || f_done[ur - 1][mb] <= t
                               : f_done[ur][mb] <= t && (r + 1 == p || i_done[ur + 1][mb] <= t);
        if (ready) {
          list.push_back(a);
          (a.type == ActionType::Forward ? f_done : i_done)[ur][mb] = t + 1;
          if (a.type == ActionType::BackwardInput) pending[ur].push_back(a.microbatch);
          ++next[ur], --left;
          continue;
        }
      }
      if (!pending[ur].empty()) {
        list.push_back({ActionType::BackwardWeight, r, pending[ur].front()});
        pending[ur].pop_front();
        --left;
      }
    }
  return s;
}

// The message a communication action sends or receives: (backward?, the stage
// it goes into, micro-batch).
std::tuple<bool, int, int> message_of(const Action& a) {
  switch (a.type) {
    case ActionType::SendF: return {false, a.stage + 1, a.microbatch};
    case ActionType::RecvF: return {false, a.stage, a.microbatch};
    case ActionType::SendB: return {true, a.stage - 1, a.microbatch};
    case ActionType::RecvB: return {true, a.stage, a.microbatch};
    default: throw Error(fmt::format("{} is not a message", action_str(a)));
  }
}

}  // namespace

std::string action_str(const Action& a) {
  static const char* names[] = {"F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "I", "W",
                                "UNSHARD", "RESHARD", "REDUCE_GRAD"};
  if (is_fsdp(a.type)) return fmt::format("{}{}", names[static_cast<int>(a.type)], a.stage);
  return fmt::format("{}{}.{}", names[static_cast<int>(a.type)], a.stage, a.microbatch);
}

std::vector<int> Schedule::stages_of(int rank) const {
  std::vector<int> out;
  for (int st = 0; st < stages; ++st)
    if (stage_rank[static_cast<size_t>(st)] == rank) out.push_back(st);
  return out;
}

int Schedule::count(int rank, ActionType type) const {
  const auto& a = actions.at(static_cast<size_t>(rank));
  return static_cast<int>(std::count_if(a.begin(), a.end(), [&](const Action& x) { return x.type == type; }));
}

const std::vector<std::string>& schedule_names() {
  static const std::vector<std::string> names = {"gpipe", "1f1b", "interleaved_1f1b", "zb_h1"};
  return names;
}

Schedule make_schedule(const std::string& name, int ranks, int microbatches, int stages_per_rank) {
  TS_CHECK(ranks >= 1, "pipeline schedule: {} ranks (expected at least 1)", ranks);
  TS_CHECK(microbatches >= 1, "pipeline schedule: {} micro-batches (expected at least 1)", microbatches);
  TS_CHECK(stages_per_rank >= 1, "pipeline schedule: {} stages per rank (expected at least 1)", stages_per_rank);
  if (name == "gpipe" || name == "1f1b" || name == "zb_h1") {
    TS_CHECK(stages_per_rank == 1, "pipeline schedule {} runs one stage per rank, not {} (interleaved_1f1b runs "
             "several)", name, stages_per_rank);
    return name == "gpipe" ? gpipe(ranks, microbatches)
           : name == "1f1b" ? one_f_one_b(ranks, microbatches)
                            : zb_h1(ranks, microbatches);
  }
  if (name == "interleaved_1f1b") {
    TS_CHECK(microbatches % ranks == 0,
             "pipeline schedule interleaved_1f1b runs micro-batches in groups of the pipeline's ranks: {} "
             "micro-batches is not a multiple of {} ranks", microbatches, ranks);
    return interleaved(ranks, stages_per_rank, microbatches);
  }
  throw Error(fmt::format("unknown pipeline schedule '{}' (expected one of: {})", name,
                          fmt::join(schedule_names(), ", ")));
}

int message_tag(const Action& a, const Schedule& s) {
  auto [backward, stage, mb] = message_of(a);
  return ((backward ? 1 : 0) * s.stages + stage) * s.microbatches + mb;
}

void add_communication(Schedule& s) {
  auto rank_of = [&](int st) { return s.stage_rank[static_cast<size_t>(st)]; };
  // First the sends, right after what they send.
  std::vector<std::vector<Action>> with_sends(s.actions.size());
  for (size_t r = 0; r < s.actions.size(); ++r)
    for (const Action& a : s.actions[r]) {
      TS_CHECK(is_compute(a.type), "add_communication: rank {} already has {}", r, action_str(a));
      with_sends[r].push_back(a);
      if (a.type == ActionType::Forward && a.stage + 1 < s.stages && rank_of(a.stage + 1) != rank_of(a.stage))
        with_sends[r].push_back({ActionType::SendF, a.stage, a.microbatch});
      if (computes_input_grad(a.type) && a.stage > 0 && rank_of(a.stage - 1) != rank_of(a.stage))
        with_sends[r].push_back({ActionType::SendB, a.stage, a.microbatch});
    }
  // Then each receive one compute action before the one that needs it.
  for (size_t r = 0; r < with_sends.size(); ++r) {
    std::vector<Action> out;
    const auto& list = with_sends[r];
    std::vector<size_t> compute_at;  // positions in `out` where each compute action starts
    for (const Action& a : list) {
      if (is_compute(a.type)) {
        std::optional<Action> recv;
        if (a.type == ActionType::Forward && a.stage > 0 && rank_of(a.stage - 1) != rank_of(a.stage))
          recv = Action{ActionType::RecvF, a.stage, a.microbatch};
        if (computes_input_grad(a.type) && a.stage + 1 < s.stages && rank_of(a.stage + 1) != rank_of(a.stage))
          recv = Action{ActionType::RecvB, a.stage, a.microbatch};
        if (recv) {
          const size_t at = compute_at.empty() ? 0 : compute_at.back();
          out.insert(out.begin() + static_cast<std::ptrdiff_t>(at), *recv);
          for (size_t& c : compute_at) c += c >= at ? 1 : 0;
        }
        compute_at.push_back(out.size());
      }
      out.push_back(a);
    }
    s.actions[r] = std::move(out);
  }
}

void add_fsdp_actions(Schedule& s) {
  for (auto& list : s.actions) {
    std::map<int, size_t> first_f, last_backward;  // by stage: positions in `list`
    for (size_t i = 0; i < list.size(); ++i) {
      const Action& a = list[i];
      TS_CHECK(!is_fsdp(a.type), "add_fsdp_actions: the schedule already has {}", action_str(a));
      if (a.type == ActionType::Forward && first_f.count(a.stage) == 0) first_f[a.stage] = i;
      if (a.type == ActionType::Backward || a.type == ActionType::BackwardWeight) last_backward[a.stage] = i;
    }
    std::vector<Action> out;
    for (size_t i = 0; i < list.size(); ++i) {
      const Action& a = list[i];
      if (a.type == ActionType::Forward && first_f.at(a.stage) == i) out.push_back({ActionType::Unshard, a.stage, 0});
      out.push_back(a);
      if (last_backward.count(a.stage) != 0 && last_backward.at(a.stage) == i) {
        out.push_back({ActionType::ReduceGrad, a.stage, 0});
        out.push_back({ActionType::Reshard, a.stage, 0});
      }
    }
    list = std::move(out);
  }
}

void validate(const Schedule& s) {
  TS_CHECK(s.ranks >= 1 && s.stages >= s.ranks && s.microbatches >= 1 &&
               s.stage_rank.size() == static_cast<size_t>(s.stages) && s.actions.size() == static_cast<size_t>(s.ranks),
           "schedule {}: {} ranks, {} stages, {} micro-batches, {} stage placements, {} action lists do not agree",
           s.name, s.ranks, s.stages, s.microbatches, s.stage_rank.size(), s.actions.size());
  auto rank_of = [&](int st) { return s.stage_rank[static_cast<size_t>(st)]; };
  // Each (type, stage, micro-batch) once, on the right rank; where it stands.
  std::map<std::tuple<int, int, int>, std::pair<int, size_t>> where;
  for (int r = 0; r < s.ranks; ++r) {
    const auto& list = s.actions[static_cast<size_t>(r)];
    for (size_t i = 0; i < list.size(); ++i) {
      const Action& a = list[i];
      TS_CHECK(a.stage >= 0 && a.stage < s.stages && a.microbatch >= 0 && a.microbatch < s.microbatches,
               "schedule {}: rank {} has {}, outside {} stages and {} micro-batches", s.name, r, action_str(a),
               s.stages, s.microbatches);
      TS_CHECK(rank_of(a.stage) == r, "schedule {}: rank {} has {}, but stage {} lives on rank {}", s.name, r,
               action_str(a), a.stage, rank_of(a.stage));
      auto [it, fresh] = where.emplace(std::tuple{static_cast<int>(a.type), a.stage, a.microbatch}, std::pair{r, i});
      TS_CHECK(fresh, "schedule {}: rank {} has {} twice", s.name, r, action_str(a));
    }
  }
  auto find = [&](ActionType t, int st, int mb) -> const std::pair<int, size_t>* {
    auto it = where.find({static_cast<int>(t), st, mb});
    return it == where.end() ? nullptr : &it->second;
  };
  for (int st = 0; st < s.stages; ++st)
    for (int mb = 0; mb < s.microbatches; ++mb) {
      const auto* f = find(ActionType::Forward, st, mb);
      const auto* whole = find(ActionType::Backward, st, mb);
      const auto* in = find(ActionType::BackwardInput, st, mb);
      const auto* w = find(ActionType::BackwardWeight, st, mb);
      TS_CHECK(f != nullptr, "schedule {}: no F{}.{} (the forward of micro-batch {} through stage {})", s.name, st,
               mb, mb, st);
      TS_CHECK(whole != nullptr || in != nullptr, "schedule {}: no B{}.{} (the backward of micro-batch {} through "
               "stage {}) nor its I and W", s.name, st, mb, mb, st);
      TS_CHECK(whole == nullptr || (in == nullptr && w == nullptr), "schedule {}: rank {} has B{}.{} and also its "
               "I or W (a backward is B, or I and W)", s.name, whole->first, st, mb);
      TS_CHECK((in == nullptr) == (w == nullptr), "schedule {}: rank {} has {}{}.{} without its {} (a split backward "
               "is I and W)", s.name, rank_of(st), in ? "I" : "W", st, mb, in ? "W" : "I");
      const auto* b = whole ? whole : in;  // computes the input gradient
      const std::string b_name = action_str({whole ? ActionType::Backward : ActionType::BackwardInput, st, mb});
      TS_CHECK(f->second < b->second, "schedule {}: rank {} runs {} before F{}.{}", s.name, b->first, b_name, st, mb);
      if (w != nullptr)
        TS_CHECK(in->second < w->second, "schedule {}: rank {} runs W{}.{} before I{}.{}", s.name, w->first, st, mb,
                 st, mb);
      // The messages this stage needs and sends, where the neighbour is elsewhere.
      const bool prev_away = st > 0 && rank_of(st - 1) != rank_of(st);
      const bool next_away = st + 1 < s.stages && rank_of(st + 1) != rank_of(st);
      auto need = [&](ActionType t, const std::pair<int, size_t>* before, const char* what) {
        const auto* m = find(t, st, mb);
        TS_CHECK(m != nullptr, "schedule {}: rank {} has no {} ({})", s.name, rank_of(st),
                 action_str({t, st, mb}), what);
        if (before != nullptr)
          TS_CHECK(m->second < before->second, "schedule {}: rank {} runs {} after {}", s.name, rank_of(st),
                   action_str({t, st, mb}), what);
        else
          TS_CHECK(m->second > (t == ActionType::SendF ? f : b)->second, "schedule {}: rank {} sends {} before "
                   "computing it", s.name, rank_of(st), action_str({t, st, mb}));
      };
      if (prev_away) need(ActionType::RecvF, f, fmt::format("F{}.{} needs it", st, mb).c_str());
      if (next_away) need(ActionType::RecvB, b, fmt::format("{} needs it", b_name).c_str());
      if (next_away) need(ActionType::SendF, nullptr, "stage's output");
      if (prev_away) need(ActionType::SendB, nullptr, "stage's input gradient");
      for (ActionType t : {ActionType::RecvF, ActionType::SendB})
        TS_CHECK(prev_away || find(t, st, mb) == nullptr, "schedule {}: {} has no peer: stage {} is on the same "
                 "rank or the first", s.name, action_str({t, st, mb}), st - 1);
      for (ActionType t : {ActionType::RecvB, ActionType::SendF})
        TS_CHECK(next_away || find(t, st, mb) == nullptr, "schedule {}: {} has no peer: stage {} is on the same "
                 "rank or past the last", s.name, action_str({t, st, mb}), st + 1);
    }
  // A stage's FSDP actions: none, or each once, around everything it computes.
  for (int st = 0; st < s.stages; ++st) {
    const auto* un = find(ActionType::Unshard, st, 0);
    const auto* reduce = find(ActionType::ReduceGrad, st, 0);
    const auto* re = find(ActionType::Reshard, st, 0);
    if (un == nullptr && reduce == nullptr && re == nullptr) continue;
    TS_CHECK(un != nullptr && reduce != nullptr && re != nullptr, "schedule {}: stage {} has {} of its FSDP actions "
             "(UNSHARD, REDUCE_GRAD and RESHARD go together)", s.name, st,
             (un != nullptr) + (reduce != nullptr) + (re != nullptr));
    for (int mb = 0; mb < s.microbatches; ++mb)
      for (ActionType t : {ActionType::Forward, ActionType::Backward, ActionType::BackwardInput,
                           ActionType::BackwardWeight}) {
        const auto* c = find(t, st, mb);
        if (c == nullptr) continue;
        TS_CHECK(un->second < c->second, "schedule {}: rank {} runs {} before UNSHARD{}", s.name, c->first,
                 action_str({t, st, mb}), st);
        TS_CHECK(c->second < reduce->second, "schedule {}: rank {} runs {} after "
                 "REDUCE_GRAD{} (the gradients are reduced after the stage's last backward)", s.name, c->first,
                 action_str({t, st, mb}), st);
      }
    TS_CHECK(reduce->second < re->second, "schedule {}: rank {} runs RESHARD{} before REDUCE_GRAD{}", s.name,
             re->first, st, st);
  }
  // Each stage's backwards in micro-batch order (B or I, and W): gradients
  // then sum in the order of gradient accumulation on one process, and FSDP
  // reduces after the last micro-batch's.
  auto input_grad = [&](int st, int mb) {  // its B or I: (position, name)
    const auto* b = find(ActionType::Backward, st, mb);
    const ActionType t = b ? ActionType::Backward : ActionType::BackwardInput;
    return std::pair{(b ? b : find(t, st, mb))->second, action_str({t, st, mb})};
  };
  for (int st = 0; st < s.stages; ++st)
    for (int mb = 1; mb < s.microbatches; ++mb) {
      const auto [before, before_name] = input_grad(st, mb - 1);
      const auto [after, after_name] = input_grad(st, mb);
      TS_CHECK(before < after, "schedule {}: rank {} runs {} before {} (backwards of a stage run in micro-batch "
               "order)", s.name, rank_of(st), after_name, before_name);
      const auto* w0 = find(ActionType::BackwardWeight, st, mb - 1);
      const auto* w1 = find(ActionType::BackwardWeight, st, mb);
      if (w0 && w1)
        TS_CHECK(w0->second < w1->second, "schedule {}: rank {} runs W{}.{} before W{}.{} (weight gradients of a "
                 "stage run in micro-batch order)", s.name, rank_of(st), st, mb, st, mb - 1);
    }
  // No deadlock: run the lists in order.
  std::vector<size_t> next(static_cast<size_t>(s.ranks), 0);
  std::set<std::tuple<bool, int, int>> sent;
  std::set<std::tuple<int, int, int>> done;  // (type, stage, mb) computed
  auto grad_done = [&](int st, int mb) {  // the stage's input gradient: its B or I ran
    return done.count({static_cast<int>(ActionType::Backward), st, mb}) > 0 ||
           done.count({static_cast<int>(ActionType::BackwardInput), st, mb}) > 0;
  };
  size_t left = 0;
  for (const auto& l : s.actions) left += l.size();
  while (left > 0) {
    bool moved = false;
    for (int r = 0; r < s.ranks; ++r) {
      auto& i = next[static_cast<size_t>(r)];
      const auto& list = s.actions[static_cast<size_t>(r)];
      while (i < list.size()) {
        const Action& a = list[i];
        bool ready = true;
        if (a.type == ActionType::Forward && a.stage > 0)
          ready = rank_of(a.stage - 1) != r ? sent.count({false, a.stage, a.microbatch}) > 0
                                            : done.count({0, a.stage - 1, a.microbatch}) > 0;
        if (computes_input_grad(a.type))
          ready = done.count({0, a.stage, a.microbatch}) > 0 &&
                  (a.stage + 1 == s.stages ||
                   (rank_of(a.stage + 1) != r ? sent.count({true, a.stage, a.microbatch}) > 0
                                              : grad_done(a.stage + 1, a.microbatch)));
        if (a.type == ActionType::BackwardWeight)
          ready = done.count({static_cast<int>(ActionType::BackwardInput), a.stage, a.microbatch}) > 0;
        if (!ready) break;
        if (a.type == ActionType::SendF || a.type == ActionType::SendB) sent.insert(message_of(a));
        if (is_compute(a.type)) done.insert({static_cast<int>(a.type), a.stage, a.microbatch});
        ++i, --left, moved = true;
      }
    }
    if (!moved) {
      std::string blocked;
      for (int r = 0; r < s.ranks; ++r)
        if (next[static_cast<size_t>(r)] < s.actions[static_cast<size_t>(r)].size())
          blocked += fmt::format("{}rank {} at {}", blocked.empty() ? "" : ", ", r,
                                 action_str(s.actions[static_cast<size_t>(r)][next[static_cast<size_t>(r)]]));
      throw Error(fmt::format("schedule {} deadlocks: every rank waits ({})", s.name, blocked));
    }
  }
}

std::string format(const Schedule& s) {
  std::string out = fmt::format("schedule {}: {} stage(s) on {} rank(s), {} micro-batch(es)\n", s.name, s.stages,
                                s.ranks, s.microbatches);
  for (int r = 0; r < s.ranks; ++r) {
    std::vector<std::string> words;
    for (const Action& a : s.actions[static_cast<size_t>(r)]) words.push_back(action_str(a));
    out += fmt::format("rank {}: {}\n", r, fmt::join(words, " "));
  }
  return out;
}

double Timing::bubble() const {
  if (busy.empty() || span <= 0) return 0;
  double idle = 0;
  for (double b : busy) idle += (span - b) / span;
  return idle / static_cast<double>(busy.size());
}

Timing simulate(const Schedule& s, double forward, double backward) {
  validate(s);
  Timing t;
  t.busy.assign(static_cast<size_t>(s.ranks), 0.0);
  t.max_in_flight.assign(static_cast<size_t>(s.ranks), 0);
  std::vector<double> clock(static_cast<size_t>(s.ranks), 0.0);
  std::vector<int> in_flight(static_cast<size_t>(s.ranks), 0);
  std::map<std::tuple<int, int, int>, double> finished;  // (type, stage, mb) -> finish time
  std::vector<size_t> next(static_cast<size_t>(s.ranks), 0);
  double first = -1, last = 0;
  size_t left = 0;
  for (const auto& l : s.actions) left += l.size();
  while (left > 0) {
    for (int r = 0; r < s.ranks; ++r) {
      auto& i = next[static_cast<size_t>(r)];
      const auto& list = s.actions[static_cast<size_t>(r)];
      for (; i < list.size(); ++i, --left) {
        const Action& a = list[i];
        if (!is_compute(a.type)) continue;  // messages cost nothing here
        // (type, stage, mb) this action waits for; an input gradient is keyed as B.
        std::vector<std::tuple<int, int, int>> deps;
        constexpr int F = static_cast<int>(ActionType::Forward), B = static_cast<int>(ActionType::Backward);
        if (a.type == ActionType::Forward && a.stage > 0) deps.push_back({F, a.stage - 1, a.microbatch});
        if (computes_input_grad(a.type)) {
          deps.push_back({F, a.stage, a.microbatch});
          if (a.stage + 1 < s.stages) deps.push_back({B, a.stage + 1, a.microbatch});
        }
        if (a.type == ActionType::BackwardWeight)
          deps.push_back({static_cast<int>(ActionType::BackwardInput), a.stage, a.microbatch});
        double ready = clock[static_cast<size_t>(r)];
        bool all = true;
        for (const auto& d : deps) {
          auto it = finished.find(d);
          if (it == finished.end()) {
            all = false;
            break;
          }
          ready = std::max(ready, it->second);
        }
        if (!all) break;
        // A split backward's halves: the input's gradient and the weights' are
        // the same products (dX = dY W, dW = dY^T X).
        const double cost = a.type == ActionType::Forward ? forward
                            : a.type == ActionType::Backward ? backward
                                                             : backward / 2;
        if (first < 0 || ready < first) first = ready;
        clock[static_cast<size_t>(r)] = ready + cost;
        last = std::max(last, ready + cost);
        t.busy[static_cast<size_t>(r)] += cost;
        finished[{computes_input_grad(a.type) ? B : static_cast<int>(a.type), a.stage, a.microbatch}] = ready + cost;
        if (a.type == ActionType::BackwardInput) finished[{static_cast<int>(a.type), a.stage, a.microbatch}] = ready + cost;
        // Activations are held from F until the backward that frees them (B, or W).
        int& f = in_flight[static_cast<size_t>(r)];
        if (a.type == ActionType::Forward) ++f;
        if (a.type == ActionType::Backward || a.type == ActionType::BackwardWeight) --f;
        t.max_in_flight[static_cast<size_t>(r)] = std::max(t.max_in_flight[static_cast<size_t>(r)], f);
      }
    }
  }
  t.span = last - std::max(0.0, first);
  return t;
}

}  // namespace tessera::pp
