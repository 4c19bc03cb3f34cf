// Pipeline schedules as data (PyTorch's torch.distributed.pipelining
// schedules, TorchTitan's pipeline_parallel): per rank, the list of actions
// it runs in order for one step, which can be printed, checked and
// simulated before anything runs.
//
// A model cut into `stages` consecutive parts runs on `ranks` ranks; stage s
// lives on rank stage_rank[s] (one stage per rank, or v per rank in looped
// placement: stage s on rank s % ranks). A step feeds `microbatches`
// micro-batches through every stage forward (F), then backward (B), and the
// stages pass activations forward and their gradients back:
//
//   F  forward of one micro-batch through one stage
//   B  backward of it (after its F; for a stage before the last, once the
//      next stage's input gradient has arrived)
//   I  the backward's part for the stage's input gradient (what the previous
//      stage waits for), as B needs it
//   W  the rest: the parameters' gradients (after its I); I and W together
//      are a B (autograd::backward_input / backward_weight)
//   UNSHARD / RESHARD / REDUCE_GRAD   a stage's FSDP work, once a step
//      (add_fsdp_actions): its parameters all-gathered before its first
//      forward, its gradients reduce-scattered after its last backward (one
//      reduction for all the micro-batches), its parameters freed last
//   SEND_F / RECV_F   the stage's output to the next stage's rank
//   SEND_B / RECV_B   the stage's input gradient to the previous stage's rank
//
// Schedules (each generates the compute order; add_communication() inserts
// the messages):
//   gpipe             every forward, then every backward (GPipe): m in flight
//   1f1b              p - 1 - r warm-up forwards on rank r, then one forward
//                     and one backward in turn (PipeDream-flush, Megatron):
//                     at most min(m, p - r) micro-batches in flight
//   interleaved_1f1b  v stages per rank, looped (Megatron's interleaved
//                     schedule): the bubble shrinks by v; m a multiple of p
//   zb_h1             zero bubble (Qi et al. 2023, ZB-H1): 1F1B's order of
//                     F and I, the W's where the rank would otherwise wait
//                     (at most r + 1 pending on rank r): with F = I = W a
//                     third of 1F1B's bubble once m >= p, and at most
//                     min(m, p) micro-batches held on every rank
#pragma once

#include <string>
#include <vector>

namespace tessera::pp {

enum class ActionType {
  Forward, Backward, SendF, RecvF, SendB, RecvB, BackwardInput, BackwardWeight,
  Unshard, Reshard, ReduceGrad  // a stage's FSDP actions (add_fsdp_actions); micro-batch 0
};

struct Action {
  ActionType type;
  int stage = 0;
  int microbatch = 0;
  bool operator==(const Action& o) const = default;
};

// "F3.1": forward of micro-batch 1 through stage 3; "SEND_F3.1" sends its
// output; "REDUCE_GRAD3" reduces stage 3's gradients.
std::string action_str(const Action& a);

struct Schedule {
  std::string name;  // gpipe | 1f1b | interleaved_1f1b | zb_h1
  int ranks = 1;
  int stages = 1;
  int microbatches = 1;
  std::vector<int> stage_rank;               // the rank each stage lives on
  std::vector<std::vector<Action>> actions;  // per rank, in the order run

  int stages_per_rank() const { return stages / ranks; }
  // The stages on `rank`, in increasing order.
  std::vector<int> stages_of(int rank) const;
  // Counts of one action type on a rank.
  int count(int rank, ActionType type) const;
};

// The schedule names, for messages and --help.
const std::vector<std::string>& schedule_names();

// The compute actions (F and B) of a schedule, without messages: `name` one
// of schedule_names(), `stages_per_rank` v > 1 only for interleaved_1f1b.
// Refuses, naming what is wrong, a micro-batch count the schedule cannot run
// (interleaved_1f1b: a multiple of the ranks).
Schedule make_schedule(const std::string& name, int ranks, int microbatches, int stages_per_rank = 1);

// Inserts the messages between stages on different ranks: SEND_F right after
// each F whose next stage lives elsewhere, SEND_B right after each B (or I)
// whose previous stage does; the matching RECV_F / RECV_B on the receiving rank
// before the compute action that needs it, posted one compute action early
// so the message can land while the rank computes.
void add_communication(Schedule& schedule);

// For stages sharded by FSDP (PyTorch's _add_unshard_reshard and
// _add_reduce_grad): UNSHARD s before stage s's first F, REDUCE_GRAD s right
// after its last backward (B or W) and RESHARD s after that, on its rank.
// After add_communication.
void add_fsdp_actions(Schedule& schedule);

// Checks a schedule before it runs: every stage's F and B (or I and W) of
// every micro-batch exactly once, on the stage's rank, F before B (F before
// I before W), each stage's B or I and its W in micro-batch order; a
// stage's FSDP actions, when it has them, once each, UNSHARD before its
// first F and REDUCE_GRAD, then RESHARD, after its last backward; every message
// sent once and received once by the rank that needs it, before it needs
// it; and no deadlock: ranks run their lists in order, a receive completes
// once its send has run, a compute action waits for the messages it needs.
// Throws naming the first problem (the rank, the action and why).
void validate(const Schedule& schedule);

// The tag of a message: unique within a step per (direction, stage, micro-batch).
int message_tag(const Action& a, const Schedule& s);

// The schedule printed one rank per line: "rank 0: F0.0 SEND_F0.0 F0.1 ...".
std::string format(const Schedule& schedule);

// Timing of a schedule with a forward costing `forward` and a backward
// `backward` time units on every stage (a split backward's I and W half of
// it each), messages free: each rank's busy and idle time over the step's
// span (idle: the bubble). For one stage per rank and equal stage costs the
// bubble share is (p-1)/(m+p-1) for gpipe and 1f1b.
struct Timing {
  double span = 0;                // first start to last finish
  std::vector<double> busy;       // per rank
  std::vector<int> max_in_flight;  // per rank: micro-batches forwarded, not yet through B or W (activations held)
  double bubble() const;          // mean idle share over ranks
};
Timing simulate(const Schedule& schedule, double forward = 1.0, double backward = 2.0);

}  // namespace tessera::pp
