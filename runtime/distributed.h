// Process groups. Ranks are processes launched by mpirun/srun (a plain
// process is world size 1); CPU tensors travel over MPI.
//
// The contract is small: a handful of collectives, each returning a Work at
// once (a collective never blocks its caller until wait()), plus subgroups.
// Tensors passed to a collective stay referenced by its Work until it
// completes. World size 1 never calls MPI.
//
// MPI has no asynchronous progress in OpenMPI 4.1: a nonblocking collective
// only advances while some thread is inside MPI. Tessera drives progress from
// one communication thread per process, the only thread that calls MPI (the
// CPU analogue of a CUDA communication stream); TESSERA_PROGRESS=poll instead
// tests in-flight collectives from the compute thread at op boundaries
// (measured against each other in benchmarks/README.md).
//
// Every collective carries a per-group sequence number. With
// TESSERA_DEBUG_COLLECTIVES=1 the ranks first compare what they are about to
// run (op, dtype, sizes) and every rank throws on a mismatch, naming both
// sides. A collective that does not complete within the timeout
// (TESSERA_COLLECTIVE_TIMEOUT, seconds, default 300; set_timeout) throws
// from wait(), naming the collective, the group and the sequence number.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "runtime/stream.h"
#include "runtime/tensor.h"

namespace tessera::dist {

enum class ReduceOp { Sum, Avg, Max, Min, PremulSum };
const char* reduce_op_name(ReduceOp op);

struct ReduceOptions {
  ReduceOp op = ReduceOp::Sum;
  double factor = 1.0;  // PremulSum: every rank's input is multiplied by it before the sum
};

// Collective counts of one group, for tests and traces.
struct CollectiveStats {
  int64_t all_gather = 0, reduce_scatter = 0, all_reduce = 0, broadcast = 0, all_to_all = 0,
          barrier = 0;
  int64_t send = 0, recv = 0;  // point-to-point messages (pipeline stages), not in total()
  int64_t mpi_calls = 0;  // collectives handed to MPI (0 at world size 1)
  int64_t bytes = 0;      // payload bytes handed to MPI (an all-gather's: this rank's shard)
  // The bytes this rank sends over the wire by the bandwidth-optimal ring
  // algorithms: an all-gather (W-1) x its shard, a reduce-scatter or
  // all-to-all (W-1)/W of its input, an all-reduce 2 (W-1)/W of the tensor, a
  // broadcast the tensor once (a chain). Counted by MPI groups, real or simulated.
  int64_t ring_bytes = 0;
  int64_t total() const { return all_gather + reduce_scatter + all_reduce + broadcast + all_to_all + barrier; }
  CollectiveStats& operator+=(const CollectiveStats& o) {
    all_gather += o.all_gather, reduce_scatter += o.reduce_scatter, all_reduce += o.all_reduce;
    broadcast += o.broadcast, all_to_all += o.all_to_all, barrier += o.barrier;
    send += o.send, recv += o.recv;
    mpi_calls += o.mpi_calls, bytes += o.bytes, ring_bytes += o.ring_bytes;
    return *this;
  }
};

class Work : public std::enable_shared_from_this<Work> {
 public:
  virtual ~Work() = default;
  // Blocks the host until the collective completes; throws on timeout, desync or MPI error.
  virtual void wait() = 0;
  // Makes `stream` wait for the collective without blocking the host (on a
  // synchronous stream, the CPU's, that is wait()). Work queued on `stream`
  // after this call sees the collective's output.
  virtual void wait(Stream& stream) { if (stream.synchronous()) wait(); }
  virtual bool is_completed() = 0;
};
using WorkPtr = std::shared_ptr<Work>;

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  virtual int rank() const = 0;  // rank within this group
  virtual int size() const = 0;
  virtual const std::vector<int>& global_ranks() const = 0;  // world rank of each group rank
  virtual const std::string& name() const = 0;

  // output [size * n] (dim 0 of the concatenation) = every rank's input [n], in rank order.
  // input may be the slice of output at this rank (in-place gather).
  virtual WorkPtr all_gather_into_tensor(const Tensor& output, const Tensor& input) = 0;
  // output [n] = reduction over ranks of input chunk `rank` (input [size * n]).
  virtual WorkPtr reduce_scatter_tensor(const Tensor& output, const Tensor& input,
                                        ReduceOptions options = {}) = 0;
  virtual WorkPtr all_reduce(const Tensor& tensor, ReduceOptions options = {}) = 0;
  // Copies `tensor` of group rank src into every rank's `tensor`.
  virtual WorkPtr broadcast(const Tensor& tensor, int src) = 0;
  // Splits input along dim 0 into size equal chunks; chunk j goes to rank j, and
  // output chunk i comes from rank i.
  virtual WorkPtr all_to_all(const Tensor& output, const Tensor& input) = 0;
  // The same with sizes of its own per rank (PyTorch's all_to_all_single with
  // split sizes, MPI's alltoallv): input's first input_splits[0] rows (dim 0)
  // go to rank 0, the next input_splits[1] to rank 1, ...; output receives
  // output_splits[i] rows from rank i, in rank order. The splits must agree
  // (rank i's output_splits[j] == rank j's input_splits[i]): exchange the
  // counts first with all_to_all when only the sender knows them (as expert
  // parallelism's dispatch does, ep/). Counted as an all_to_all.
  virtual WorkPtr all_to_all_single(const Tensor& output, const Tensor& input,
                                    const std::vector<int64_t>& output_splits,
                                    const std::vector<int64_t>& input_splits);
  virtual WorkPtr barrier() = 0;

  // Point to point, between two ranks of the group (pipeline stages): send
  // `tensor` to group rank `dst`; receive into `tensor` (its shape and dtype
  // agreed beforehand) from group rank `src`. A send matches the receive of
  // the same tag on its peer whatever order the two ranks issue their
  // messages in, so a schedule's sends and receives cannot deadlock on each
  // other; messages of one (peer, tag) arrive in the order sent. Async as
  // collectives: wait() has the same timeout and names the message. Counted
  // in stats() (send, recv, bytes). Tags are 0 .. 2^30 - 1.
  virtual WorkPtr send(const Tensor& tensor, int dst, int tag);
  virtual WorkPtr recv(const Tensor& tensor, int src, int tag);

  // A group of the given ranks of this group (in this group's numbering; every
  // rank of this group must call it; ranks outside get nullptr).
  virtual std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks,
                                                  const std::string& name = "") = 0;
  // Like MPI_Comm_split: ranks with the same color form a group, ordered by key.
  virtual std::shared_ptr<ProcessGroup> split(int color, int key, const std::string& name = "") = 0;

  virtual CollectiveStats stats() const = 0;
  virtual void reset_stats() = 0;
  // Traces (runtime/trace.h): this group's collectives and messages on a
  // lane of their own named `lane` (a layer's exchanges, e.g. context
  // parallelism's K/V), instead of each kind's lane. Set before the first.
  virtual void set_trace_lane(const std::string& lane) { (void)lane; }
  // Collectives issued so far on this group (the next one gets this number).
  virtual int64_t sequence() const = 0;
  // A group of dist::simulated_group: counts, never communicates.
  virtual bool simulated() const { return false; }
};
using ProcessGroupPtr = std::shared_ptr<ProcessGroup>;

// A process group that plays rank `rank` of a group of the given world ranks
// without any communication, for planning a run (tools/plan.h): collectives
// check their tensors (meta tensors allowed), count in stats() as the real
// group counts them (mpi_calls and bytes where the real one would call MPI),
// allocate the buffers the real one allocates (on meta) and hold them until
// waited for, as the real one does, complete at once and leave their outputs
// untouched.
ProcessGroupPtr simulated_group(int rank, const std::vector<int>& global_ranks, const std::string& name);
// Simulated collectives allocate NCCL's buffers instead of MPI's (true: for
// the plan of a GPU run): a reduce-scatter reduces on the device into its
// output, with no staging buffer for the peers' chunks and no f32 result
// for a 16-bit one. False by default.
void set_simulated_like_nccl(bool like_nccl);
bool simulated_like_nccl();

// Initialises MPI when launched by mpirun/srun (else world size 1, no MPI).
// Safe to call more than once; finalize() runs at exit.
void init(int& argc, char**& argv);
void init();
bool is_initialized();
int rank();        // world rank
int world_size();
int local_rank();  // rank among the processes on this node
// The processes the launcher started on this node, from its environment
// (Open MPI, MPICH/Hydra, Slurm; 1 without a launcher); callable before init.
int local_size();
// The group of all ranks (available after init; world size 1 without it).
ProcessGroupPtr world();
// Waits for in-flight collectives, stops the communication thread and finalises MPI.
void finalize();

// How long wait() waits before throwing (default TESSERA_COLLECTIVE_TIMEOUT or 300 s).
void set_timeout(std::chrono::milliseconds timeout);
std::chrono::milliseconds timeout();
// TESSERA_DEBUG_COLLECTIVES=1 or set_debug_collectives(true): check every collective.
void set_debug_collectives(bool on);
bool debug_collectives();
// Progress mode: "thread" (a communication thread) or "poll" (op boundaries).
std::string progress_mode();
// Drives in-flight collectives from the calling thread (poll mode; no-op otherwise).
void progress();
// Seconds this process has spent blocked in Work::wait() since it started:
// the communication that overlap did not hide (exposed). Always counted.
double total_wait_seconds();
// While one lives, the calling thread's waits are background work (an
// asynchronous checkpoint's writer): neither counted in total_wait_seconds()
// nor traced on the wait lane, both of which are the training loop's.
class BackgroundWaits {
 public:
  BackgroundWaits();
  ~BackgroundWaits();
  BackgroundWaits(const BackgroundWaits&) = delete;
  BackgroundWaits& operator=(const BackgroundWaits&) = delete;

 private:
  bool saved_;
};

// Started by a launcher (mpirun/mpiexec of OpenMPI or MPICH, srun)?
bool launched();

// Every rank's string, in rank order, on every rank of `group` (for metadata:
// checkpoint chunk lists, trace events).
std::vector<std::string> all_gather_strings(const ProcessGroupPtr& group, const std::string& mine);
// Shares each rank's error ("" for none) and throws on every rank if any rank
// failed, naming the first that did: one rank's bad file or full disk then
// never leaves the others waiting in the next collective.
void throw_if_any_failed(const ProcessGroupPtr& group, const std::string& error, const std::string& what);

// Aborts every rank with `message` (a fatal error the program cannot recover from).
[[noreturn]] void abort(const std::string& message, int code = 1);

}  // namespace tessera::dist
