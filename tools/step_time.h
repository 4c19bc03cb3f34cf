// The planner's step-time model: how long one training step takes on a rank,
// and how much of its communication the compute does not hide, predicted from
// the step's own kernels and collectives (runtime/kernel_log.h) in program order.
//
//   compute: each kernel's time. On this machine it is measured: every
//     distinct kernel of the step (by signature: dtypes, shapes, strides) runs
//     on CPU tensors of its shapes with the rank's thread count, once, the
//     times are scaled so that they sum to the step replayed in program
//     order for about two seconds, and both are cached per CPU and thread
//     count. On described hardware (a TOML
//     file, below) it is a roofline: the larger of FLOPs at the peak rate and
//     bytes at the memory bandwidth, each at a stated efficiency.
//   communication: an alpha-beta model of each collective, t = alpha + beta x
//     bytes, fitted on this machine by bench_collectives --save at the group
//     size (or carried to another size with the ring algorithm's terms), or
//     from a described node's link latency and bandwidth.
//   schedule: kernels run one after another on the compute stream; each
//     collective starts when issued, once the one before it on the rank's
//     communication channel has finished (one channel: the engine's thread,
//     NCCL's stream); a wait holds the compute stream until its collective
//     ends. On a CPU whose cores the ranks' compute threads fill, a
//     collective runs only while its rank waits (no overlap).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "runtime/kernel_log.h"
#include "tools/hardware.h"

namespace tessera::tools {

// Where the planner caches kernel times and collective fits:
// $TESSERA_CACHE_DIR, else $XDG_CACHE_HOME/tessera, else ~/.cache/tessera.
std::string cache_dir();
// This CPU's model name, as /proc/cpuinfo gives it ("unknown CPU" without one).
std::string cpu_model();

// t = alpha + beta x bytes per collective kind, per group size.
struct CollectiveFit {
  double alpha_s = 0, beta_s_per_byte = 0;
};
struct CommModel {
  // This machine's (bench_collectives --save): kind -> group size -> fit, for any group.
  std::map<std::string, std::map<int, CollectiveFit>> fits;
  // Described hardware: each group's own links (HSDP's replicas across nodes,
  // a tensor-parallel group within one, at the same size): group -> kind -> size -> fit.
  std::map<std::string, std::map<std::string, std::map<int, CollectiveFit>>> group_fits;
  // Seconds for `kind` over `group_size` ranks moving a buffer of `bytes`
  // (nccl-tests' size): the group's own fit when there is one, else the
  // kind's. A size without a fit uses the nearest fitted one, carried along
  // the ring algorithm: alpha grows as W-1, beta as (W-1)/W.
  double seconds(const std::string& kind, int group_size, double bytes, const std::string& group = "") const;
};
// Fits written by bench_collectives --save: one file per group size in
// cache_dir(). Throws, naming the command to run, when none is there.
CommModel load_comm_fits(const std::string& dir);
// Weighted least squares of t = alpha + beta x bytes, relative errors
// weighted alike (small and large messages count the same).
CollectiveFit fit_alpha_beta(const std::vector<double>& bytes, const std::vector<double>& seconds);

// Collectives on described hardware: a ring over the node's links when the
// group is of consecutive ranks (dp_shard, its hpZ groups, the world) that
// fit in a node, else over the slower inter-node links (HSDP's replicas).
CommModel comm_model(const Hardware& hw, const std::vector<kernel_log::Collective>& collectives);

// Seconds of each kernel in `log` (by index), measured on this CPU as a rank
// runs it: with `threads` threads, while `concurrent` ranks (this node's) run
// it at once, so that they share the cores, caches and memory bandwidth as
// the ranks of a run do (`pinned`: each worker kept to the cores
// tools::rank_cpus gives its rank, as tessera-train keeps its ranks).
// Memory-bound kernels (no FLOPs logged) rotate over
// copies of their buffers larger than the last-level cache; products run on
// one set. Each distinct signature is measured once and cached in
// `cache_path` ("" for no cache).
// Then the step's kernels are replayed in program order for about two
// seconds on every worker at once, and every kernel's time is scaled by the
// replay's step over their sum (replay_scale; 1 where the buffers of all the
// kernels at once would take over a quarter of the memory available), also
// cached.
struct Calibration {
  std::vector<double> seconds;       // replay_scale included
  int64_t measured = 0, cached = 0;  // distinct signatures
  double replay_scale = 1;
};
Calibration measure_kernels(const kernel_log::Log& log, int threads, int concurrent, const std::string& cache_path,
                            bool pinned = false);
// The cache file of this CPU, thread count, ranks per node and pinning in `dir`.
std::string kernel_cache_path(const std::string& dir, int threads, int concurrent, bool pinned = false);
// Roofline seconds of each kernel on `hw`, in the dtype each kernel computes in.
std::vector<double> roofline_kernels(const kernel_log::Log& log, const Hardware& hw);

struct StepTime {
  double step_s = 0;
  double compute_s = 0;        // kernels
  double host_s = 0;           // the framework around them (kernel_log::Log::host_seconds)
  double communication_s = 0;  // collectives, overlapped or not
  double exposed_s = 0;        // compute waiting for communication
  std::map<std::string, double> compute_by_kernel;  // kernel name -> seconds
};
// Plays the log's events on one compute stream and one communication channel;
// the host's time is spread evenly over the kernels. compute_scale multiplies
// every kernel and host time. overlap false: the channel runs only while the
// compute stream waits (a CPU whose cores the ranks' compute threads fill:
// the thread that moves a collective gets a core only when its rank waits).
StepTime simulate_step(const kernel_log::Log& log, const std::vector<double>& kernel_seconds,
                       const CommModel& comm, double compute_scale = 1.0, bool overlap = true);

std::string format_step_time(const StepTime& t, const std::string& how);

}  // namespace tessera::tools
