#include "runtime/distributed.h"

#include "runtime/kernels.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "runtime/mpi/group.h"
#include "runtime/random.h"

namespace tessera::dist {

namespace {

struct World {
  bool initialized = false;
  bool mpi = false;
  int rank = 0;
  int size = 1;
  int local_rank = 0;
  ProcessGroupPtr group;
  std::chrono::milliseconds timeout{300000};
  bool debug = false;
};

World& world_state() {
  static World w;
  return w;
}

std::mutex init_mu;

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}


void read_settings(World& w) {
  if (const char* t = env("TESSERA_COLLECTIVE_TIMEOUT")) {
    char* end = nullptr;
    double s = std::strtod(t, &end);
    TS_CHECK(end != t && *end == '\0' && s > 0,
             "TESSERA_COLLECTIVE_TIMEOUT must be a positive number of seconds, got '{}'", t);
    w.timeout = std::chrono::milliseconds(static_cast<int64_t>(s * 1000));
  }
  if (const char* d = env("TESSERA_DEBUG_COLLECTIVES")) w.debug = std::string(d) != "0";
}

}  // namespace

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Avg: return "avg";
    case ReduceOp::Max: return "max";
    case ReduceOp::Min: return "min";
    case ReduceOp::PremulSum: return "premul_sum";
  }
  return "?";
}

void init(int& /*argc*/, char**& /*argv*/) { init(); }

void init() {
  std::lock_guard<std::mutex> lk(init_mu);
  World& w = world_state();
  if (w.initialized) return;
  read_settings(w);
  if (launched()) {
    const char* mode = env("TESSERA_PROGRESS");
    std::string m = mode ? mode : "thread";
    TS_CHECK(m == "thread" || m == "poll", "TESSERA_PROGRESS must be 'thread' or 'poll', got '{}'", m);
    auto& engine = detail::Engine::get();
    engine.start(m == "thread");
    // Op boundaries: poll mode drives in-flight collectives there; thread mode
    // nudges the progress thread there (runtime/mpi/engine.h).
    set_op_boundary_hook([] { detail::Engine::get().progress_once(); });
    engine.run_sync([&] {
      TS_MPI(MPI_Comm_rank(MPI_COMM_WORLD, &w.rank));
      TS_MPI(MPI_Comm_size(MPI_COMM_WORLD, &w.size));
    });
    w.mpi = true;
    w.initialized = true;  // make_child below asks for rank()
    // The launcher's word for it: Open MPI's, MPICH's (Hydra) or Slurm's.
    if (const char* lr = env("OMPI_COMM_WORLD_LOCAL_RANK")) w.local_rank = std::atoi(lr);
    else if (const char* hl = env("MPI_LOCALRANKID")) w.local_rank = std::atoi(hl);
    else if (const char* sl = env("SLURM_LOCALID")) w.local_rank = std::atoi(sl);
    if (w.size == 1) {
      // A job of one rank talks to nobody: not even a communicator is made,
      // so it issues no MPI collective at all (tests count them).
      w.group = detail::local_group("world");
    } else {
      engine.run_sync([&] {
        MPI_Comm dup = MPI_COMM_NULL;
        TS_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &dup));
        w.group = detail::MpiGroup::make_child(dup, "world");
      });
    }
    std::atexit([] { finalize(); });
  } else {
    w.group = detail::local_group("world");
    w.initialized = true;
  }
}

bool is_initialized() { return world_state().initialized; }
int rank() { return world_state().rank; }
int world_size() { return world_state().size; }
int local_rank() { return world_state().local_rank; }

int local_size() {
  // Slurm's SLURM_TASKS_PER_NODE reads "4(x2)" or "3,2": the first node's
  // count, which is this node's when they are equal.
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE",
                           "SLURM_TASKS_PER_NODE"})
    if (const char* v = env(name); v != nullptr && std::atoi(v) > 0) return std::atoi(v);
  return 1;
}

WorkPtr ProcessGroup::send(const Tensor&, int dst, int) {
  throw Error(fmt::format("send to rank {} on group '{}': this process group has no point-to-point messages", dst,
                          name()));
}

WorkPtr ProcessGroup::recv(const Tensor&, int src, int) {
  throw Error(fmt::format("recv from rank {} on group '{}': this process group has no point-to-point messages",
                          src, name()));
}

WorkPtr ProcessGroup::all_to_all_single(const Tensor&, const Tensor&, const std::vector<int64_t>&,
                                        const std::vector<int64_t>&) {
  throw Error(fmt::format("all_to_all_single on group '{}': this process group has no variable all-to-all", name()));
}

ProcessGroupPtr world() {
  if (!world_state().initialized) init();
  return world_state().group;
}

void finalize() {
  std::lock_guard<std::mutex> lk(init_mu);
  World& w = world_state();
  if (!w.initialized || !w.mpi) return;
  w.group.reset();
  detail::Engine::get().stop();
  w.mpi = false;
}

void set_timeout(std::chrono::milliseconds t) {
  TS_CHECK(t.count() > 0, "set_timeout: the timeout must be positive");
  world_state().timeout = t;
}
std::chrono::milliseconds timeout() { return world_state().timeout; }
void set_debug_collectives(bool on) { world_state().debug = on; }
bool debug_collectives() { return world_state().debug; }

std::string progress_mode() {
  auto& e = detail::Engine::get();
  if (!e.started()) return "none";
  return e.thread_mode() ? "thread" : "poll";
}

void progress() { detail::Engine::get().progress_once(); }

bool launched() {
  return env("OMPI_COMM_WORLD_SIZE") || env("PMI_SIZE") || env("PMIX_RANK") || env("SLURM_STEP_ID") ||
         env("MPI_LOCALNRANKS");
}

std::vector<std::string> all_gather_strings(const ProcessGroupPtr& group, const std::string& mine) {
  if (group->size() == 1) return {mine};
  // Sizes first, then the bytes padded to i32 words (an element type every path moves as is).
  Tensor size = full({1}, static_cast<double>(mine.size()), DType::I64);
  Tensor sizes = empty({group->size()}, DType::I64);
  group->all_gather_into_tensor(sizes, size)->wait();
  auto sv = sizes.to_vector<int64_t>();
  int64_t words = 0;
  for (int64_t n : sv) words = std::max(words, (n + 3) / 4);
  Tensor buf = zeros({words}, DType::I32);
  if (!mine.empty()) std::memcpy(buf.data_ptr(), mine.data(), mine.size());
  Tensor gathered = empty({words * group->size()}, DType::I32);
  group->all_gather_into_tensor(gathered, buf)->wait();
  std::vector<std::string> out;
  const char* bytes = words ? static_cast<const char*>(gathered.data_ptr()) : "";
  for (int r = 0; r < group->size(); ++r)
    out.emplace_back(bytes + static_cast<int64_t>(r) * words * 4, static_cast<size_t>(sv[static_cast<size_t>(r)]));
  return out;
}

void throw_if_any_failed(const ProcessGroupPtr& group, const std::string& error, const std::string& what) {
  auto errors = all_gather_strings(group, error);
  for (size_t r = 0; r < errors.size(); ++r)
    TS_CHECK(errors[r].empty(), "{} failed on rank {}: {}", what, r, errors[r]);
}

void abort(const std::string& message, int code) {
  std::fprintf(stderr, "tessera: rank %d: %s\n", rank(), message.c_str());
  std::fflush(stderr);
  if (world_state().mpi) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

}  // namespace tessera::dist
