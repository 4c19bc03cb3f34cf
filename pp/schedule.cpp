#include "pp/schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <tuple>

#include "runtime/check.h"

namespace tessera::pp {

namespace {

bool is_compute(ActionType t) { return t == ActionType::Forward || t == ActionType::Backward; }

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
  static const char* names[] = {"F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B"};
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
  static const std::vector<std::string> names = {"gpipe", "1f1b", "interleaved_1f1b"};
  return names;
}

Schedule make_schedule(const std::string& name, int ranks, int microbatches, int stages_per_rank) {
  TS_CHECK(ranks >= 1, "pipeline schedule: {} ranks (expected at least 1)", ranks);
  TS_CHECK(microbatches >= 1, "pipeline schedule: {} micro-batches (expected at least 1)", microbatches);
  TS_CHECK(stages_per_rank >= 1, "pipeline schedule: {} stages per rank (expected at least 1)", stages_per_rank);
  if (name == "gpipe" || name == "1f1b") {
    TS_CHECK(stages_per_rank == 1, "pipeline schedule {} runs one stage per rank, not {} (interleaved_1f1b runs "
             "several)", name, stages_per_rank);
    return name == "gpipe" ? gpipe(ranks, microbatches) : one_f_one_b(ranks, microbatches);
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
      if (a.type == ActionType::Backward && a.stage > 0 && rank_of(a.stage - 1) != rank_of(a.stage))
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
        if (a.type == ActionType::Backward && a.stage + 1 < s.stages && rank_of(a.stage + 1) != rank_of(a.stage))
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
      const auto* b = find(ActionType::Backward, st, mb);
      TS_CHECK(f != nullptr, "schedule {}: no F{}.{} (the forward of micro-batch {} through stage {})", s.name, st,
               mb, mb, st);
      TS_CHECK(b != nullptr, "schedule {}: no B{}.{} (the backward of micro-batch {} through stage {})", s.name, st,
               mb, mb, st);
      TS_CHECK(f->second < b->second, "schedule {}: rank {} runs B{}.{} before F{}.{}", s.name, b->first, st, mb,
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
      if (next_away) need(ActionType::RecvB, b, fmt::format("B{}.{} needs it", st, mb).c_str());
      if (next_away) need(ActionType::SendF, nullptr, "stage's output");
      if (prev_away) need(ActionType::SendB, nullptr, "stage's input gradient");
      for (ActionType t : {ActionType::RecvF, ActionType::SendB})
        TS_CHECK(prev_away || find(t, st, mb) == nullptr, "schedule {}: {} has no peer: stage {} is on the same "
                 "rank or the first", s.name, action_str({t, st, mb}), st - 1);
      for (ActionType t : {ActionType::RecvB, ActionType::SendF})
        TS_CHECK(next_away || find(t, st, mb) == nullptr, "schedule {}: {} has no peer: stage {} is on the same "
                 "rank or past the last", s.name, action_str({t, st, mb}), st + 1);
    }
  // Each stage's backwards in micro-batch order: gradients then sum in the
  // order of gradient accumulation on one process, and FSDP reduces after
  // the last micro-batch's.
  for (int st = 0; st < s.stages; ++st)
    for (int mb = 1; mb < s.microbatches; ++mb)
      TS_CHECK(find(ActionType::Backward, st, mb - 1)->second < find(ActionType::Backward, st, mb)->second,
               "schedule {}: rank {} runs B{}.{} before B{}.{} (backwards of a stage run in micro-batch order)",
               s.name, rank_of(st), st, mb, st, mb - 1);
  // No deadlock: run the lists in order.
  std::vector<size_t> next(static_cast<size_t>(s.ranks), 0);
  std::set<std::tuple<bool, int, int>> sent;
  std::set<std::tuple<int, int, int>> done;  // (type, stage, mb) computed
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
        if (a.type == ActionType::Backward)
          ready = done.count({0, a.stage, a.microbatch}) > 0 &&
                  (a.stage + 1 == s.stages ||
                   (rank_of(a.stage + 1) != r ? sent.count({true, a.stage, a.microbatch}) > 0
                                              : done.count({1, a.stage + 1, a.microbatch}) > 0));
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
        std::vector<std::tuple<int, int, int>> deps;
        if (a.type == ActionType::Forward && a.stage > 0) deps.push_back({0, a.stage - 1, a.microbatch});
        if (a.type == ActionType::Backward) {
          deps.push_back({0, a.stage, a.microbatch});
          if (a.stage + 1 < s.stages) deps.push_back({1, a.stage + 1, a.microbatch});
        }
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
        const double cost = a.type == ActionType::Forward ? forward : backward;
        if (first < 0 || ready < first) first = ready;
        clock[static_cast<size_t>(r)] = ready + cost;
        last = std::max(last, ready + cost);
        t.busy[static_cast<size_t>(r)] += cost;
        finished[{static_cast<int>(a.type), a.stage, a.microbatch}] = ready + cost;
        int& f = in_flight[static_cast<size_t>(r)];
        f += a.type == ActionType::Forward ? 1 : -1;
        t.max_in_flight[static_cast<size_t>(r)] = std::max(t.max_in_flight[static_cast<size_t>(r)], f);
      }
    }
  }
  t.span = last - std::max(0.0, first);
  return t;
}

}  // namespace tessera::pp
