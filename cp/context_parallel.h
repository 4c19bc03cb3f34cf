// Context parallelism: every sequence split over the ranks of a "cp" group,
// each rank holding a slice of the tokens, with attention the only layer that
// needs the others' slices (PyTorch's context_parallel, Llama 3's all-gather
// of K/V, ring attention). Every other layer of a transformer works token by
// token, so it runs on the slice alone; its parameters are replicated over
// the group and their gradients summed over it (FSDP's shard group spans data
// x context, as TorchTitan's does).
//
// Attention of this rank's queries against the whole sequence is computed in
// blocks, (query chunk, key chunk) pairs, each by the one-process attention
// kernel, and the partial results are merged through their log-sum-exp (the
// online softmax, in f32, or f64 for f64 tensors):
//
//   lse = log(exp(lse_1) + exp(lse_2)),  out = exp(lse_1 - lse) out_1 + exp(lse_2 - lse) out_2
//
// Under the causal mask a pair is whole (the keys come before every query), a
// triangle (the same chunk) or skipped. K/V reach the queries by one of two
// rotate methods:
//   allgather  one all-gather of every slice's K/V per layer (Llama 3); the
//              backward gathers them again and reduce-scatters dK/dV to
//              their owners.
//   ring       cp - 1 rounds, each passing the K/V block held to the next
//              rank while computing with it; the backward passes K/V round
//              again with their dK/dV accumulators, which end at their owner.
// Either way dK/dV of every rank's queries reach the rank holding those keys:
// a gradient computed against another rank's keys is never dropped.
//
// Layout: with load_balance (head-tail, for causal attention) the sequence
// is cut into 2 x cp chunks and rank r holds chunks r and 2cp-1-r, so every
// rank has the same share of the causal triangle; without, rank r holds the
// r-th contiguous run (the first T % cp ranks one token more).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "nn/models.h"
#include "runtime/checked.h"
#include "runtime/distributed.h"

namespace tessera::cp {

enum class RotateMethod { AllGather, Ring };
const char* rotate_method_name(RotateMethod m);  // "allgather" | "ring"
// "allgather" or "ring"; throws naming `key` and what was found.
RotateMethod parse_rotate_method(const std::string& name, const std::string& key = "rotate_method");

struct ContextParallelOptions {
  RotateMethod rotate_method = RotateMethod::AllGather;
  bool load_balance = true;  // head-tail chunks (causal attention only)
  int64_t max_seq_len = 0;   // the longest sequence allowed (a model's block_size; 0: any)
  // What a caller calls the options in its messages (tessera-train:
  // "load_balance" -> "parallelism.context_parallel_load_balance",
  // "seq_len" -> "training.seq_len").
  FieldNames names;
};

// A run of consecutive positions [start, start + length) of the sequence.
struct Chunk {
  int64_t start = 0, length = 0;
  friend bool operator==(const Chunk&, const Chunk&) = default;
};

// Each rank's chunks of a sequence of seq_len tokens, in the order the rank
// holds them. Throws naming the option when seq_len cannot be split: head-tail
// needs a multiple of 2 x cp tokens, the contiguous split at least cp.
std::vector<std::vector<Chunk>> sequence_layout(int64_t seq_len, int cp, bool load_balance,
                                                const FieldNames& names = {});

// This rank's slice of the sequence, and its attention over the whole of it.
class ContextParallel final : public nn::SequenceShard {
 public:
  // group: the context-parallel ranks (a mesh's "cp" dim), in sequence order.
  ContextParallel(dist::ProcessGroupPtr group, ContextParallelOptions options);

  int size() const { return group_->size(); }
  int rank() const { return group_->rank(); }
  const dist::ProcessGroupPtr& group() const { return group_; }
  const ContextParallelOptions& options() const { return options_; }

  // The layout of sequences of seq_len tokens (every rank of the group sets the same).
  void set_sequence_length(int64_t seq_len);
  int64_t sequence_length() const { return seq_len_; }
  const std::vector<std::vector<Chunk>>& layout() const { return layout_; }
  int64_t local_length(int rank) const;

  // This rank's slice of x, which holds whole sequences along dim (the
  // layout's length): its chunks concatenated in order. Local, no communication.
  Tensor shard(const Tensor& x, int64_t dim) const;
  // The whole sequence along dim from every rank's slice (one all-gather;
  // not recorded for autograd: for tests, generation and logging).
  Tensor unshard(const Tensor& local, int64_t dim) const;

  // A batch's (tokens, targets) [B, T], the same on every rank of the group:
  // sets the layout for T and returns this rank's slices. The loss of the
  // slice is then weighed by weigh_loss so that the mean over the group's
  // ranks is the mean over the whole sequence's tokens, whatever the split.
  std::pair<Tensor, Tensor> shard_batch(const Tensor& tokens, const Tensor& targets,
                                        int64_t ignore_index = -100) override;
  // mean_loss (this slice's mean cross-entropy) x cp x this slice's counted
  // targets / the whole sequence's.
  Tensor weigh_loss(const Tensor& mean_loss) const override;

  // This rank's attention work since the last reset (forward and backward):
  // the blocks computed, the score entries they cover (query x key pairs
  // the causal mask keeps: the load balance, exactly) and the calling
  // thread's CPU time in their kernels (the work's time without the time
  // this rank was descheduled or waited; with an OpenMP team, its main thread's).
  struct WorkStats {
    int64_t blocks = 0;
    double scores = 0;
    double cpu_seconds = 0;
  };
  WorkStats work() const { return *work_; }
  void reset_work() { *work_ = {}; }

  // nn::SequenceShard
  const std::vector<int64_t>& positions() const override { return positions_; }
  Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, double scale) override;
  // Attention over the whole sequence (causal or not: without the mask every
  // pair is whole; head-tail is refused, it balances only the causal triangle).
  Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale);

 private:
  dist::ProcessGroupPtr group_;
  ContextParallelOptions options_;
  int64_t seq_len_ = 0;
  std::vector<std::vector<Chunk>> layout_;
  std::vector<int64_t> positions_;
  Tensor loss_weight_;  // shard_batch's: cp x local count / whole count (f64, 0-dim)
  std::shared_ptr<WorkStats> work_ =
      std::make_shared<WorkStats>();  // shared with the backward closures
};

// Context parallelism over `group` for `model` (built on meta or materialised):
// every block's attention and the learned or rotary positions see this
// rank's slice through the returned object. A group of one rank changes
// nothing and issues no collective.
std::shared_ptr<ContextParallel> apply_context_parallel(nn::LanguageModel& model,
                                                        const dist::ProcessGroupPtr& group,
                                                        ContextParallelOptions options = {});

}  // namespace tessera::cp
