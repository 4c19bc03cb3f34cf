#include "ep/expert_parallel.h"

#include <numeric>
#include <optional>
#include <string>

#include "dtensor/dtensor.h"
#include "runtime/trace.h"

namespace tessera::ep {

namespace {

// Trace lanes: the phases of each MoE layer's exchange on this rank (counts
// and dispatch, the local experts, combine; the row exchanges' backwards),
// and the expert-parallel group's all-to-alls (ProcessGroup::set_trace_lane;
// the group carries nothing else).
trace::Lane phase_lane() {
  static const trace::Lane lane = trace::register_lane("expert parallel");
  return lane;
}
constexpr const char* kExchangeLane = "expert parallel all-to-all";

Tensor exchange(const Tensor& x, const dist::ProcessGroupPtr& group, const std::vector<int64_t>& send_rows,
                const std::vector<int64_t>& recv_rows) {
  Shape shape = x.shape();
  shape[0] = std::accumulate(recv_rows.begin(), recv_rows.end(), int64_t{0});
  Tensor out = empty(shape, x.dtype(), x.device());
  group->all_to_all_single(out, ops::contiguous(x), recv_rows, send_rows)->wait(current_stream(x.device()));
  return out;
}

Tensor indices(const std::vector<int64_t>& v, Device device) {
  return from_vector(v, {static_cast<int64_t>(v.size())}, device);
}

}  // namespace

Tensor all_to_all_rows(const Tensor& x, const dist::ProcessGroupPtr& group, const std::vector<int64_t>& send_rows,
                       const std::vector<int64_t>& recv_rows, const char* name) {
  Tensor y = exchange(x, group, send_rows, recv_rows);
  if (autograd::should_record({x}))
    autograd::record("all_to_all_rows", {x}, {y}, [group, send_rows, recv_rows, name](const TensorList& g) {
      const double start = trace::enabled() && name != nullptr ? trace::now_us() : -1;
      Tensor back = exchange(g[0], group, recv_rows, send_rows);
      if (start >= 0) trace::record(phase_lane(), std::string(name) + " backward", start, trace::now_us());
      return TensorList{back};
    });
  return y;
}

ExpertParallel::ExpertParallel(dist::ProcessGroupPtr group, int64_t num_experts)
    : group_(std::move(group)), experts_(num_experts), local_(num_experts / group_->size()) {
  TS_CHECK(num_experts % group_->size() == 0, "expert parallelism: {} experts do not divide over {} ranks",
           num_experts, group_->size());
}

Tensor ExpertParallel::run(const Tensor& x, const std::vector<int64_t>& counts, const LocalExperts& local) {
  const int ep = group_->size();
  const int64_t L = local_;
  TS_CHECK(static_cast<int64_t>(counts.size()) == experts_, "ExpertParallel: {} counts for {} experts",
           counts.size(), experts_);
  // Counts first: rank i learns how many of its experts' rows each rank sends.
  std::optional<trace::Scope> phase(std::in_place, phase_lane(), "dispatch");
  Tensor mine = from_vector(counts, {experts_}, Device::cpu());
  Tensor theirs = empty({experts_}, DType::I64, Device::cpu());
  group_->all_to_all(theirs, mine)->wait();
  std::vector<int64_t> got;  // [source rank][local expert]
  if (group_->simulated()) {
    // A plan: every rank sends this rank's experts what this rank sends them.
    for (int p = 0; p < ep; ++p)
      for (int64_t l = 0; l < L; ++l) got.push_back(counts[static_cast<size_t>(group_->rank() * L + l)]);
  } else {
    got = theirs.to_vector<int64_t>();
  }
  std::vector<int64_t> send(static_cast<size_t>(ep), 0), recv(static_cast<size_t>(ep), 0);
  std::vector<int64_t> local_counts(static_cast<size_t>(L), 0);
  for (int p = 0; p < ep; ++p)
    for (int64_t l = 0; l < L; ++l) {
      send[static_cast<size_t>(p)] += counts[static_cast<size_t>(p * L + l)];
      recv[static_cast<size_t>(p)] += got[static_cast<size_t>(p * L + l)];
      local_counts[static_cast<size_t>(l)] += got[static_cast<size_t>(p * L + l)];
    }

  Tensor arrived = all_to_all_rows(x, group_, send, recv, "dispatch");  // by source rank, then local expert
  // Regroup by local expert (source order kept within one): row r of the
  // regrouped rows is row order[r] of the arrived ones.
  std::vector<int64_t> start(static_cast<size_t>(ep * L));
  std::exclusive_scan(got.begin(), got.end(), start.begin(), int64_t{0});
  std::vector<int64_t> order, back(static_cast<size_t>(arrived.size(0)));
  order.reserve(back.size());
  for (int64_t l = 0; l < L; ++l)
    for (int p = 0; p < ep; ++p) {
      const size_t at = static_cast<size_t>(p * L + l);
      for (int64_t i = 0; i < got[at]; ++i) {
        back[static_cast<size_t>(start[at] + i)] = static_cast<int64_t>(order.size());
        order.push_back(start[at] + i);
      }
    }
  const Device device = x.device();
  Tensor grouped = order.empty() ? arrived : embedding(arrived, indices(order, device));
  phase.emplace(phase_lane(), "experts");
  Tensor out = local(grouped, local_counts);
  phase.emplace(phase_lane(), "combine");
  Tensor by_source = back.empty() ? out : embedding(out, indices(back, device));
  Tensor y = all_to_all_rows(by_source, group_, recv, send, "combine");
  phase.reset();

  const int me = group_->rank();
  ++stats_.exchanges;
  stats_.rows_kept += send[static_cast<size_t>(me)];
  stats_.rows_sent += x.size(0) - send[static_cast<size_t>(me)];
  stats_.max_rows = std::max(stats_.max_rows, arrived.size(0));
  return y;
}

void apply_expert_parallel(nn::Module& model, const MeshPtr& ep_mesh, const dist::ProcessGroupPtr& batch_group,
                           const std::string& experts_key, const std::string& ep_key) {
  TS_CHECK(ep_mesh->ndim() == 1, "apply_expert_parallel: expected a 1-D mesh of the expert-parallel ranks, got {} dims",
           ep_mesh->ndim());
  const dist::ProcessGroupPtr group = ep_mesh->get_group(0);
  const int ep = group->size();
  for (nn::MoE* moe : nn::moe_layers(model)) {
    TS_CHECK(moe->num_experts % ep == 0,
             "{} ({}) must be divisible by {} ({}): each expert-parallel rank holds {} / {} whole experts",
             experts_key, moe->num_experts, ep_key, ep, experts_key, ep_key);
    moe->batch_group = batch_group ? batch_group : group;
    if (ep == 1) continue;  // every expert here: no exchange at all
    for (const char* w : {"w1", "w2", "w3"}) {
      nn::Module::Slot* slot = moe->experts->find_parameter_slot(w);
      slot->value = distribute_parameter(slot->value, ep_mesh, {Shard{0}}, "apply_expert_parallel");
    }
    moe->placement = std::make_shared<ExpertParallel>(group, moe->num_experts);
  }
  if (ep > 1) group->set_trace_lane(kExchangeLane);
}

}  // namespace tessera::ep
