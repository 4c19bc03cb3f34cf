// The MPI ProcessGroup (internal to runtime/; users see dist::ProcessGroup).
#pragma once

#include "runtime/mpi/engine.h"

namespace tessera::dist::detail {

class MpiGroup final : public ProcessGroup {
 public:
  explicit MpiGroup(std::shared_ptr<GroupState> state);
  int rank() const override { return state_->rank; }
  int size() const override { return state_->size; }
  const std::vector<int>& global_ranks() const override { return state_->global_ranks; }
  const std::string& name() const override { return state_->name; }

  WorkPtr all_gather_into_tensor(const Tensor& output, const Tensor& input) override;
  WorkPtr reduce_scatter_tensor(const Tensor& output, const Tensor& input, ReduceOptions options) override;
  WorkPtr all_reduce(const Tensor& tensor, ReduceOptions options) override;
  WorkPtr broadcast(const Tensor& tensor, int src) override;
  WorkPtr all_to_all(const Tensor& output, const Tensor& input) override;
  WorkPtr all_to_all_single(const Tensor& output, const Tensor& input, const std::vector<int64_t>& output_splits,
                            const std::vector<int64_t>& input_splits) override;
  WorkPtr barrier() override;
  WorkPtr send(const Tensor& tensor, int dst, int tag) override;
  WorkPtr recv(const Tensor& tensor, int src, int tag) override;
  std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks, const std::string& name) override;
  std::shared_ptr<ProcessGroup> split(int color, int key, const std::string& name) override;
  CollectiveStats stats() const override;
  void reset_stats() override;
  int64_t sequence() const override { return state_->next_seq; }
  void set_trace_lane(const std::string& lane) override {
    std::lock_guard<std::mutex> lock(state_->stats_mu);
    state_->trace_lane = lane;
  }

  // Wraps a communicator this rank belongs to (called where MPI may be called).
  static std::shared_ptr<ProcessGroup> make_child(MPI_Comm comm, const std::string& name);

 private:
  std::shared_ptr<Collective> make(int64_t kind, const char* name, DType dt, int64_t in, int64_t out,
                                   ReduceOp op, int root, int64_t bytes);
  void count(int64_t kind);
  WorkPtr point_to_point(const char* kind, const Tensor& tensor, int peer, int tag);
  WorkPtr submit(std::shared_ptr<Collective> c);
  // full_bytes: the whole buffer (gathered, before scattering, reduced), for the kernel log.
  WorkPtr simulate(std::shared_ptr<Collective> c, double full_bytes);
  bool simulated() const override { return state_->simulated; }
  std::shared_ptr<GroupState> state_;
};

// A group of just this process, with no communicator (world size 1, or size-1 subgroups).
std::shared_ptr<ProcessGroup> local_group(const std::string& name);

}  // namespace tessera::dist::detail
