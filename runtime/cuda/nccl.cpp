// The NCCL process group: CUDA tensors move over NCCL on the current CUDA
// stream (a caller's communication stream sets it), host tensors and
// the group bookkeeping (ranks, subgroups, barriers, the unique id's exchange)
// go through the MPI group it wraps. A Work is a CUDA event recorded after the
// collective: wait(stream) is an event wait, wait() a host wait on it.
//
// No collective hangs a rank forever (the MPI groups' promise, runtime/watchdog.h):
// - the communicator is non-blocking (ncclConfig_t::blocking = 0), so its
//   creation and every call that queues work return at once and are polled
//   to completion with the timeout (dist::timeout(), TESSERA_COLLECTIVE_TIMEOUT);
// - every queued collective is watched; one past the timeout aborts the
//   communicator (ncclCommAbort: the kernels stuck in it return, and so does
//   any host sync waiting on them) and every later use throws a message that
//   names the collective, its sequence number and the group;
// - Work::wait() polls its event with the deadline instead of blocking in
//   cudaEventSynchronize, and every wait checks NCCL's asynchronous errors.
//
// Not yet (docs/gpu.md): the desync check of TESSERA_DEBUG_COLLECTIVES, and
// ranks that share a GPU (refused by NCCL; refused here first, naming the ranks).
#include <nccl.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstring>
#include <mutex>
#include <thread>

#include "runtime/cuda/common.h"
#include "runtime/cuda_backend.h"
#include "runtime/distributed.h"
#include "runtime/ops.h"
#include "runtime/random.h"
#include "runtime/watchdog.h"

namespace tessera::cuda {

namespace {

#define TS_NCCL_CHECK(call)                                                                   \
  do {                                                                                        \
    ncclResult_t ts_r_ = (call);                                                              \
    TS_CHECK(ts_r_ == ncclSuccess, "NCCL error in {}: {} ({})", #call, ncclGetErrorString(ts_r_), \
             ncclGetLastError(nullptr) ? ncclGetLastError(nullptr) : "");                    \
  } while (0)

ncclDataType_t nccl_type(DType dt) {
  switch (dt) {
    case DType::F32: return ncclFloat32;
    case DType::F64: return ncclFloat64;
    case DType::BF16: return ncclBfloat16;
    case DType::F16: return ncclFloat16;
    case DType::I32: return ncclInt32;
    case DType::I64: return ncclInt64;
    case DType::Bool: return ncclUint8;
  }
  return ncclFloat32;
}

using Clock = std::chrono::steady_clock;

// One non-blocking communicator, shared by its group and the group's Works
// (a Work may outlive the group). `mu` orders the calls on it against the
// abort; the watchdog is destroyed before the communicator.
class Comm {
 public:
  // Creates the communicator, polling its creation until the timeout;
  // `where` names the group in errors.
  Comm(int nranks, const ncclUniqueId& id, int rank, std::string where) : where_(std::move(where)) {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(&comm_, nranks, id, rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      if (comm_ != nullptr) ncclCommAbort(comm_);
      TS_CHECK(false, "NCCL: creating the communicator of {} failed on rank {}: {} ({})", where_, rank,
               ncclGetErrorString(r), last_error());
    }
    const std::string what = fmt::format("ncclCommInitRank of {} (rank {} of {})", where_, rank, nranks);
    std::string error = settle(what, Clock::now() + dist::timeout());
    if (!error.empty()) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
      throw Error(error + " (a rank that never creates its communicator keeps the others waiting here)");
    }
    watchdog_ = std::make_unique<dist::Watchdog>([this](const std::string&) { abort(); });
  }
  ~Comm() {
    watchdog_.reset();
    std::lock_guard<std::mutex> lk(mu_);
    if (comm_ == nullptr || aborted_) return;
    // Flush what was issued, with the timeout; a communicator that cannot finish is aborted.
    ncclResult_t r = ncclCommFinalize(comm_);
    if ((r == ncclSuccess || r == ncclInProgress) && settle_locked("ncclCommFinalize", Clock::now() + dist::timeout()).empty())
      ncclCommDestroy(comm_);
    else
      ncclCommAbort(comm_);
  }
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  dist::Watchdog& watchdog() { return *watchdog_; }

  // Queues NCCL calls (`call` returns the first failure) and polls them to
  // completion of the queuing; throws naming `what` on a failure or timeout.
  template <class F>
  void queue(const std::string& what, F&& call) {
    watchdog_->check();
    std::string error;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (aborted_) throw Error(watchdog_->failure());
      ncclResult_t r = call(comm_);
      if (r != ncclSuccess && r != ncclInProgress)
        error = fmt::format("NCCL: queuing {} failed: {} ({})", what, ncclGetErrorString(r), last_error());
      else
        error = settle_locked(what, Clock::now() + dist::timeout());
    }
    if (error.empty()) return;
    watchdog_->fail(error + ". The communicator was aborted and the group cannot be used any more.");
    watchdog_->check();
  }

  // Throws if the communicator was aborted or NCCL reports an asynchronous error (then aborts it).
  void check(const std::string& what) {
    watchdog_->check();
    std::string error;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (aborted_) throw Error(watchdog_->failure());
      ncclResult_t async = ncclSuccess;
      ncclResult_t r = ncclCommGetAsyncError(comm_, &async);
      if (r != ncclSuccess) async = r;
      if (async == ncclSuccess || async == ncclInProgress) return;
      error = fmt::format("NCCL: {} failed: {} ({}). The communicator was aborted and the group cannot be used "
                          "any more.", what, ncclGetErrorString(async), last_error());
    }
    watchdog_->fail(error);  // aborts once; every later use names this error
    watchdog_->check();
  }

 private:
  static const char* last_error() {
    const char* e = ncclGetLastError(nullptr);
    return e != nullptr ? e : "";
  }
  std::string settle(const std::string& what, Clock::time_point deadline) {
    std::lock_guard<std::mutex> lk(mu_);
    return settle_locked(what, deadline);
  }
  // Polls the communicator's state until it leaves ncclInProgress; "" on success, else the error.
  std::string settle_locked(const std::string& what, Clock::time_point deadline) {
    for (int spins = 0;; ++spins) {
      ncclResult_t state = ncclSuccess;
      ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
      if (r != ncclSuccess) state = r;
      if (state == ncclSuccess) return "";
      if (state != ncclInProgress)
        return fmt::format("NCCL: {} failed: {} ({})", what, ncclGetErrorString(state), last_error());
      if (Clock::now() >= deadline)
        return fmt::format("NCCL: {} did not finish within {:.1f} s (TESSERA_COLLECTIVE_TIMEOUT sets the limit)",
                           what, std::chrono::duration<double>(dist::timeout()).count());
      if (spins < 1000) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
  // The watchdog's abort (called once; the watchdog keeps the message and
  // throws it from every later use).
  void abort() {
    std::lock_guard<std::mutex> lk(mu_);
    if (aborted_ || comm_ == nullptr) return;
    ncclCommAbort(comm_);  // the kernels stuck in the communicator return
    aborted_ = true;
  }

  std::string where_;
  ncclComm_t comm_ = nullptr;
  std::mutex mu_;
  bool aborted_ = false;
  std::unique_ptr<dist::Watchdog> watchdog_;
};

class NcclWork final : public dist::Work {
 public:
  NcclWork(std::shared_ptr<Event> done, std::vector<Tensor> keep, std::shared_ptr<Comm> comm, std::string what)
      : done_(std::move(done)), keep_(std::move(keep)), comm_(std::move(comm)), what_(std::move(what)),
        deadline_(Clock::now() + dist::timeout()) {}
  void wait() override {
    if (comm_ == nullptr) {  // a group of one: local work, nothing to time out
      done_->synchronize();
    } else {
      auto done = done_;
      comm_->watchdog().wait_until(what_, [done] { return done->query(); }, deadline_, dist::timeout());
      comm_->check(what_);
    }
    keep_.clear();
  }
  void wait(Stream& stream) override {
    if (stream.synchronous()) return wait();
    if (comm_ != nullptr) comm_->check(what_);
    done_->wait(stream);  // the stream waits on the device; the host goes on (the watchdog watches)
  }
  bool is_completed() override {
    if (comm_ != nullptr) comm_->check(what_);
    return done_->query();
  }

 private:
  std::shared_ptr<Event> done_;
  std::vector<Tensor> keep_;  // the tensors, until a host wait saw the collective complete
  std::shared_ptr<Comm> comm_;
  std::string what_;
  Clock::time_point deadline_;
};

class NcclGroup final : public dist::ProcessGroup {
 public:
  explicit NcclGroup(dist::ProcessGroupPtr base) : base_(std::move(base)) {
    device_ = Device::cuda(dist::local_rank() % std::max(1, device_count()));
    use_device(device_.index);
    if (base_->size() == 1) return;  // a group of one needs no communicator
    check_distinct_gpus();
    ncclUniqueId id{};
    if (base_->rank() == 0) TS_NCCL_CHECK(ncclGetUniqueId(&id));
    constexpr int64_t kWords = (sizeof(ncclUniqueId) + 3) / 4;
    Tensor buf = zeros({kWords}, DType::I32);
    std::memcpy(buf.data_ptr(), &id, sizeof(id));
    base_->broadcast(buf, 0)->wait();
    std::memcpy(&id, buf.data_ptr(), sizeof(id));
    comm_ = std::make_shared<Comm>(base_->size(), id, base_->rank(), describe_group());
  }

  int rank() const override { return base_->rank(); }
  int size() const override { return base_->size(); }
  const std::vector<int>& global_ranks() const override { return base_->global_ranks(); }
  const std::string& name() const override { return base_->name(); }

  dist::WorkPtr all_gather_into_tensor(const Tensor& output, const Tensor& input) override {
    if (on_host(output, input)) return base_->all_gather_into_tensor(output, input);
    check(output, "all_gather_into_tensor", "output");
    check(input, "all_gather_into_tensor", "input");
    TS_CHECK(output.numel() == input.numel() * size() && output.dtype() == input.dtype(),
             "all_gather_into_tensor: output {} {} is not {} x input {} {}", shape_str(output.shape()),
             dtype_name(output.dtype()), size(), shape_str(input.shape()), dtype_name(input.dtype()));
    ++stats_.all_gather;
    if (size() == 1) {  // a group of one: a queued copy unless in place
      if (input.numel() > 0 && input.data_ptr() != output.data_ptr())
        ops::copy_(ops::reshape(output, {input.numel()}), ops::reshape(input, {input.numel()}));
      return local_work({output, input});
    }
    return launch("all_gather", {output, input}, [&](ncclComm_t comm, cudaStream_t s) {
      return ncclAllGather(input.data_ptr(), output.data_ptr(), static_cast<size_t>(input.numel()),
                           nccl_type(input.dtype()), comm, s);
    });
  }

  dist::WorkPtr reduce_scatter_tensor(const Tensor& output, const Tensor& input,
                                      dist::ReduceOptions options) override {
    if (on_host(output, input)) return base_->reduce_scatter_tensor(output, input, options);
    check(output, "reduce_scatter_tensor", "output");
    check(input, "reduce_scatter_tensor", "input");
    TS_CHECK(input.numel() == output.numel() * size() && output.dtype() == input.dtype(),
             "reduce_scatter_tensor: input {} {} is not {} x output {} {}", shape_str(input.shape()),
             dtype_name(input.dtype()), size(), shape_str(output.shape()), dtype_name(output.dtype()));
    ++stats_.reduce_scatter;
    if (size() == 1) {
      ops::copy_(output, ops::reshape(premultiplied(input, options), output.shape()));
      return local_work({output, input});
    }
    return reduce("reduce_scatter", options, input.dtype(), {output, input}, [&](ncclRedOp_t op, ncclComm_t comm, cudaStream_t s) {
      return ncclReduceScatter(input.data_ptr(), output.data_ptr(), static_cast<size_t>(output.numel()),
                               nccl_type(input.dtype()), op, comm, s);
    });
  }

  dist::WorkPtr all_reduce(const Tensor& tensor, dist::ReduceOptions options) override {
    if (on_host(tensor, tensor)) return base_->all_reduce(tensor, options);
    check(tensor, "all_reduce", "tensor");
    ++stats_.all_reduce;
    if (size() == 1) {
      if (options.op == dist::ReduceOp::PremulSum) ops::copy_(tensor, premultiplied(tensor, options));
      return local_work({tensor});
    }
    return reduce("all_reduce", options, tensor.dtype(), {tensor}, [&](ncclRedOp_t op, ncclComm_t comm, cudaStream_t s) {
      return ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), static_cast<size_t>(tensor.numel()),
                           nccl_type(tensor.dtype()), op, comm, s);
    });
  }

  dist::WorkPtr broadcast(const Tensor& tensor, int src) override {
    if (on_host(tensor, tensor)) return base_->broadcast(tensor, src);
    check(tensor, "broadcast", "tensor");
    TS_CHECK(src >= 0 && src < size(), "broadcast: source rank {} is not in a group of {}", src, size());
    ++stats_.broadcast;
    if (size() == 1) return local_work({tensor});
    return launch("broadcast", {tensor}, [&](ncclComm_t comm, cudaStream_t s) {
      return ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), static_cast<size_t>(tensor.numel()),
                           nccl_type(tensor.dtype()), src, comm, s);
    });
  }

  dist::WorkPtr all_to_all(const Tensor& output, const Tensor& input) override {
    if (on_host(output, input)) return base_->all_to_all(output, input);
    check(output, "all_to_all", "output");
    check(input, "all_to_all", "input");
    TS_CHECK(output.numel() == input.numel() && input.numel() % size() == 0 && output.dtype() == input.dtype(),
             "all_to_all: input {} and output {} must be equal and split into {} chunks",
             shape_str(input.shape()), shape_str(output.shape()), size());
    ++stats_.all_to_all;
    if (size() == 1) {
      if (input.numel() > 0 && input.data_ptr() != output.data_ptr())
        ops::copy_(output, ops::reshape(input, output.shape()));
      return local_work({output, input});
    }
    const size_t chunk = static_cast<size_t>(input.numel() / size());
    const size_t bytes = chunk * dtype_size(input.dtype());
    return launch("all_to_all", {output, input}, [&](ncclComm_t comm, cudaStream_t s) {
      ncclResult_t r = ncclGroupStart();
      for (int peer = 0; peer < size() && r == ncclSuccess; ++peer) {
        r = ncclSend(static_cast<const char*>(input.data_ptr()) + peer * bytes, chunk, nccl_type(input.dtype()),
                     peer, comm, s);
        if (r == ncclSuccess)
          r = ncclRecv(static_cast<char*>(output.data_ptr()) + peer * bytes, chunk, nccl_type(input.dtype()),
                       peer, comm, s);
      }
      ncclResult_t end = ncclGroupEnd();
      return r != ncclSuccess ? r : end;
    });
  }

  dist::WorkPtr all_to_all_single(const Tensor& output, const Tensor& input, const std::vector<int64_t>& output_splits,
                                  const std::vector<int64_t>& input_splits) override {
    if (on_host(output, input)) return base_->all_to_all_single(output, input, output_splits, input_splits);
    check(output, "all_to_all_single", "output");
    check(input, "all_to_all_single", "input");
    TS_CHECK(output.dtype() == input.dtype() && input.dim() >= 1 && output.dim() >= 1 &&
                 static_cast<int>(output_splits.size()) == size() && static_cast<int>(input_splits.size()) == size(),
             "all_to_all_single: input {} ({}) and output {} ({}) need one dtype, a dim 0, and {} split sizes each",
             shape_str(input.shape()), dtype_name(input.dtype()), shape_str(output.shape()),
             dtype_name(output.dtype()), size());
    int64_t row = 1;
    for (int64_t d = 1; d < input.dim(); ++d) row *= input.size(d);
    int64_t sent = 0, received = 0;
    for (int p = 0; p < size(); ++p) sent += input_splits[static_cast<size_t>(p)], received += output_splits[static_cast<size_t>(p)];
    TS_CHECK(sent == input.size(0) && received == output.size(0),
             "all_to_all_single: the splits sum to {} and {} rows, the tensors have {} and {}", sent, received,
             input.size(0), output.size(0));
    ++stats_.all_to_all;
    if (size() == 1) {
      if (input.numel() > 0 && input.data_ptr() != output.data_ptr())
        ops::copy_(output, ops::reshape(input, output.shape()));
      return local_work({output, input});
    }
    const size_t row_bytes = static_cast<size_t>(row) * dtype_size(input.dtype());
    return launch("all_to_all_single", {output, input}, [&](ncclComm_t comm, cudaStream_t s) {
      ncclResult_t r = ncclGroupStart();
      size_t send_at = 0, recv_at = 0;
      for (int peer = 0; peer < size() && r == ncclSuccess; ++peer) {
        const size_t n_send = static_cast<size_t>(input_splits[static_cast<size_t>(peer)]);
        const size_t n_recv = static_cast<size_t>(output_splits[static_cast<size_t>(peer)]);
        r = ncclSend(static_cast<const char*>(input.data_ptr()) + send_at * row_bytes, n_send * row,
                     nccl_type(input.dtype()), peer, comm, s);
        if (r == ncclSuccess)
          r = ncclRecv(static_cast<char*>(output.data_ptr()) + recv_at * row_bytes, n_recv * row,
                       nccl_type(input.dtype()), peer, comm, s);
        send_at += n_send, recv_at += n_recv;
      }
      ncclResult_t end = ncclGroupEnd();
      return r != ncclSuccess ? r : end;
    });
  }

  dist::WorkPtr barrier() override {
    ++stats_.barrier;
    return base_->barrier();
  }

  std::shared_ptr<dist::ProcessGroup> new_group(const std::vector<int>& ranks, const std::string& name) override {
    auto g = base_->new_group(ranks, name);
    return g ? std::make_shared<NcclGroup>(g) : nullptr;
  }
  std::shared_ptr<dist::ProcessGroup> split(int color, int key, const std::string& name) override {
    auto g = base_->split(color, key, name);
    return g ? std::make_shared<NcclGroup>(g) : nullptr;
  }

  dist::CollectiveStats stats() const override {
    dist::CollectiveStats s = stats_;
    s.mpi_calls = base_->stats().mpi_calls;
    return s;
  }
  void reset_stats() override { stats_ = {}; }
  int64_t sequence() const override { return stats_.total(); }

 private:
  static bool on_host(const Tensor& a, const Tensor& b) { return !a.device().is_cuda() && !b.device().is_cuda(); }

  void check(const Tensor& t, const char* op, const char* what) const {
    TS_CHECK(t.defined() && !t.is_subclass(), "{}: {} must be a plain (local) tensor", op, what);
    TS_CHECK(t.device() == device_, "{}: {} is on {}, but this group's GPU is {}", op, what, t.device().str(),
             device_.str());
    TS_CHECK(t.is_contiguous(), "{}: {} must be contiguous (shape {}, strides {})", op, what,
             shape_str(t.shape()), shape_str(t.strides()));
  }

  // "all_reduce #17 on NCCL group 'dp' [ranks 0, 1]": the sequence number counts this group's collectives.
  std::string describe(const char* op) const {
    return fmt::format("{} #{} on {}", op, stats_.total(), describe_group());
  }
  std::string describe_group() const {
    return fmt::format("NCCL group '{}' [ranks {}]", name(), fmt::join(global_ranks(), ", "));
  }

  // Queues `call(comm, stream)` on the current CUDA stream and returns a Work
  // on an event after it, watched until it completes.
  template <class F>
  dist::WorkPtr launch(const char* op, std::vector<Tensor> keep, F&& call) {
    use_device(device_.index);
    Stream& stream = current_stream(device_);
    const std::string what = describe(op);
    comm_->queue(what, [&](ncclComm_t comm) { return call(comm, raw_stream(stream)); });
    stats_.bytes += static_cast<int64_t>(keep[0].numel() * dtype_size(keep[0].dtype()));
    std::shared_ptr<Event> done = stream.record_event();
    // Polled from the watchdog's thread: on this group's GPU there too.
    comm_->watchdog().watch(what, [done, index = device_.index] {
      use_device(index);
      return done->query();
    }, dist::timeout());
    return std::make_shared<NcclWork>(std::move(done), std::move(keep), comm_, what);
  }

  // A group of one issues no collective: its result is local work, queued on the current stream.
  dist::WorkPtr local_work(std::vector<Tensor> keep) {
    return std::make_shared<NcclWork>(current_stream(device_).record_event(), std::move(keep), nullptr, "");
  }

  static Tensor premultiplied(const Tensor& x, const dist::ReduceOptions& options) {
    return options.op == dist::ReduceOp::PremulSum ? ops::mul(x, options.factor) : x;
  }

  // A reduction: Sum, Avg, Max, Min, or PremulSum (a scalar op NCCL creates and we destroy after queuing).
  template <class F>
  dist::WorkPtr reduce(const char* name, const dist::ReduceOptions& options, DType dt, std::vector<Tensor> keep,
                       F&& call) {
    ncclRedOp_t op = ncclSum;
    bool custom = false;
    switch (options.op) {
      case dist::ReduceOp::Sum: op = ncclSum; break;
      case dist::ReduceOp::Avg: op = ncclAvg; break;
      case dist::ReduceOp::Max: op = ncclMax; break;
      case dist::ReduceOp::Min: op = ncclMin; break;
      case dist::ReduceOp::PremulSum: {
        TS_CHECK(is_floating(dt), "PremulSum needs a float tensor, got {}", dtype_name(dt));
        alignas(8) unsigned char scalar[8] = {};
        if (dt == DType::F64) std::memcpy(scalar, &options.factor, 8);
        else if (dt == DType::F32) {
          float f = static_cast<float>(options.factor);
          std::memcpy(scalar, &f, 4);
        } else {
          uint16_t bits = dt == DType::BF16 ? float_to_bf16(static_cast<float>(options.factor)).bits
                                            : float_to_f16(static_cast<float>(options.factor)).bits;
          std::memcpy(scalar, &bits, 2);
        }
        comm_->queue(describe(name) + " (its PremulSum op)", [&](ncclComm_t comm) {
          return ncclRedOpCreatePreMulSum(&op, scalar, nccl_type(dt), ncclScalarHostImmediate, comm);
        });
        custom = true;
        break;
      }
    }
    dist::WorkPtr work = launch(name, std::move(keep), [&](ncclComm_t comm, cudaStream_t s) { return call(op, comm, s); });
    if (custom) comm_->queue(describe(name) + " (its PremulSum op)", [&](ncclComm_t comm) { return ncclRedOpDestroy(op, comm); });
    return work;
  }

  // NCCL refuses two ranks of a communicator on one GPU; say so first, naming them.
  void check_distinct_gpus() {
    cudaDeviceProp prop{};
    TS_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_.index));
    char uuid[33];
    for (int i = 0; i < 16; ++i) std::snprintf(uuid + 2 * i, 3, "%02x", static_cast<unsigned char>(prop.uuid.bytes[i]));
    auto all = dist::all_gather_strings(base_, uuid);
    for (size_t a = 0; a < all.size(); ++a)
      for (size_t b = a + 1; b < all.size(); ++b)
        TS_CHECK(all[a] != all[b],
                 "NCCL group '{}': ranks {} and {} share one GPU ({}), which NCCL refuses; run one rank per "
                 "GPU (the path through host memory for shared GPUs is not built yet)",
                 name(), a, b, device_name(device_.index));
  }

  dist::ProcessGroupPtr base_;
  Device device_;
  std::shared_ptr<Comm> comm_;  // null in a group of one
  dist::CollectiveStats stats_;
};

}  // namespace

dist::ProcessGroupPtr nccl_group(const dist::ProcessGroupPtr& base) { return std::make_shared<NcclGroup>(base); }

}  // namespace tessera::cuda
