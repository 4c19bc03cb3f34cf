// ProcessGroup over an MPI communicator. Each collective checks its tensors,
// prepares buffers on the calling thread and hands nonblocking MPI calls to
// the engine. bf16/f16 reductions sum in f32 and round once at the end (more
// exact than once per hop): reduce-scatter moves the chunks as they are and
// sums them on the engine; all-reduce goes through an f32 copy (MPI has no
// such types). Groups of size 1 never call MPI.
#include <atomic>
#include <climits>
#include <cstring>
#include <numeric>
#include <utility>

#include "runtime/mpi/engine.h"
#include "runtime/mpi/group.h"

#include "runtime/cpu/dispatch.h"
#include "runtime/kernel_log.h"
#include "runtime/ops.h"
#include "runtime/stream.h"

namespace tessera::dist::detail {

namespace {

enum Kind : int64_t { kAllGather = 0, kReduceScatter, kAllReduce, kBroadcast, kAllToAll, kBarrier };

// A Work that is complete when created (groups of size 1).
class DoneWork final : public Work {
 public:
  void wait() override {}
  bool is_completed() override { return true; }
};

// `alone`: a group of one, which moves no bytes over MPI (its collectives
// are the devices' own copies, or nothing), so a tensor on any device will do.
void check_tensor(const Tensor& t, const char* op, const char* what, bool simulated = false, bool alone = false) {
  TS_CHECK(t.defined(), "{}: {} is undefined", op, what);
  TS_CHECK(!t.is_subclass(), "{}: {} is a {}; pass a plain tensor (its local piece)", op, what, t.str());
  TS_CHECK(alone || t.device().is_cpu() || t.device().type == DeviceType::AsyncCPU || (simulated && t.is_meta()),
           "{}: {} is on {}; MPI process groups move host-memory tensors (cpu, async_cpu)", op, what,
           t.device().str());
  TS_CHECK(t.is_contiguous(), "{}: {} must be contiguous (shape {}, strides {})", op, what,
           shape_str(t.shape()), shape_str(t.strides()));
}

int count_of(int64_t n, const char* op) {
  TS_CHECK(n <= INT_MAX, "{}: {} elements exceed MPI's int count; split the tensor", op, n);
  return static_cast<int>(n);
}

bool needs_upcast(DType dt) { return dt == DType::BF16 || dt == DType::F16; }

MPI_Op mpi_op(ReduceOp op, DType dt) {
  if (dt == DType::Bool) {
    TS_CHECK(op == ReduceOp::Max || op == ReduceOp::Min, "{} is not defined on bool tensors (use max or min)",
             reduce_op_name(op));
    return op == ReduceOp::Max ? MPI_LOR : MPI_LAND;
  }
  switch (op) {
    case ReduceOp::Max: return MPI_MAX;
    case ReduceOp::Min: return MPI_MIN;
    default: return MPI_SUM;
  }
}

// Serial loops for the engine side (no OpenMP team from the communication
// thread). They run once the collective's inputs are ready, so they may touch
// async_cpu memory directly: MPI moves host memory, whatever the device says.
void divide_serial(const Tensor& t, double d) {
  int64_t n = t.numel();
  if (t.dtype() == DType::F32) {
    auto* p = static_cast<float*>(t.data_ptr());
    float inv = static_cast<float>(d);
    for (int64_t i = 0; i < n; ++i) p[i] /= inv;
  } else if (t.dtype() == DType::F64) {
    auto* p = static_cast<double*>(t.data_ptr());
    for (int64_t i = 0; i < n; ++i) p[i] /= d;
  }
}

void narrow_serial(const Tensor& dst, const Tensor& src_f32) {
  const auto* s = static_cast<const float*>(src_f32.data_ptr());
  int64_t n = dst.numel();
  if (dst.dtype() == DType::BF16) {
    auto* d = static_cast<BFloat16*>(dst.data_ptr());
    for (int64_t i = 0; i < n; ++i) d[i] = float_to_bf16(s[i]);
  } else {
    auto* d = static_cast<Half*>(dst.data_ptr());
    for (int64_t i = 0; i < n; ++i) d[i] = float_to_f16(s[i]);
  }
}

// The buffer a reduction sends: the input, or an f32 copy (bf16/f16), scaled for PremulSum.
Tensor reduction_input(const Tensor& input, const ReduceOptions& o, bool copy_always) {
  bool premul = o.op == ReduceOp::PremulSum && o.factor != 1.0;
  if (!needs_upcast(input.dtype()) && !premul && !copy_always) return input;
  Tensor t = needs_upcast(input.dtype()) ? ops::to(input, DType::F32) : ops::clone(input);
  if (premul) ops::mul_(t, o.factor);
  return t;
}

void check_reduce_dtype(DType dt, const ReduceOptions& o, const char* op) {
  TS_CHECK(is_floating(dt) || (o.op != ReduceOp::Avg && o.op != ReduceOp::PremulSum),
           "{}: {} needs a floating-point tensor, got {}", op, reduce_op_name(o.op), dtype_name(dt));
}

// Direct exchange with every peer: one Irecv and one Isend per peer, tagged by
// the collective's sequence number. OpenMPI's nonblocking collectives (libnbc)
// move large buffers 4-5x slower than its blocking ones here, while
// point-to-point messages over shared memory match or beat them
// (benchmarks/README.md), so all-gather, reduce-scatter and all-to-all are
// built from these.
struct Exchange {
  MPI_Comm comm;
  int rank, size, tag, count;
  MPI_Datatype type;
  size_t bytes;                 // per message
  const char* send;             // send buffer of peer p: send + p * send_stride
  size_t send_stride;           // 0: the same buffer to every peer
  std::vector<char*> recv;      // where peer p's message lands (recv[rank] is not received)
  void post(std::vector<MPI_Request>& reqs) const {
    if (count == 0) return;
    for (int p = 0; p < size; ++p) {
      if (p == rank) continue;
      TS_MPI(MPI_Irecv(recv[static_cast<size_t>(p)], count, type, p, tag, comm,
                       &reqs.emplace_back(MPI_REQUEST_NULL)));
    }
    for (int k = 1; k < size; ++k) {  // staggered: rank r sends to r+1 first, spreading the load
      int p = (rank + k) % size;
      TS_MPI(MPI_Isend(send + static_cast<size_t>(p) * send_stride, count, type, p, tag, comm,
                       &reqs.emplace_back(MPI_REQUEST_NULL)));
    }
  }
};

// Consecutive slots of `bytes` from base, one per rank (nullptr for an empty buffer).
std::vector<char*> slots(void* base, size_t bytes, int size) {
  std::vector<char*> at(static_cast<size_t>(size), nullptr);
  if (base)
    for (int p = 0; p < size; ++p) at[static_cast<size_t>(p)] = static_cast<char*>(base) + bytes * static_cast<size_t>(p);
  return at;
}

int tag_of(int64_t seq) { return static_cast<int>(seq % 32768); }

// out[i] = the reduction over ranks p, in rank order, of chunk[p][i], in the
// kernels' compute type (cpu::Compute: f32 for bf16/f16, rounding once at
// the end), each term scaled by `scale` (PremulSum) and the result divided by
// the rank count (Avg), as ops::mul_ and ops::div_ would. Serial (engine
// side). `out` may be one of the chunks: a block is read whole before it is
// written.
template <class T>
void reduce_chunks(T* out, int64_t n, ReduceOp op, double scale, const std::vector<const T*>& chunk) {
  using Acc = cpu::Compute<T>;
  constexpr int64_t kBlock = 256;
  Acc acc[kBlock];
  const bool premul = op == ReduceOp::PremulSum;
  auto term = [&](const T* c, int64_t i) {
    Acc v = cpu::load(c[i]);
    if constexpr (std::is_floating_point_v<Acc>)
      if (premul) v *= static_cast<Acc>(scale);
    return v;
  };
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t m = std::min(kBlock, n - b);
    for (int64_t i = 0; i < m; ++i) acc[i] = term(chunk[0], b + i);
    for (size_t p = 1; p < chunk.size(); ++p) {
      const T* c = chunk[p];
      if (op == ReduceOp::Max) {
        for (int64_t i = 0; i < m; ++i) acc[i] = std::max(acc[i], term(c, b + i));
      } else if (op == ReduceOp::Min) {
        for (int64_t i = 0; i < m; ++i) acc[i] = std::min(acc[i], term(c, b + i));
      } else if constexpr (!std::is_same_v<Acc, bool>) {  // bool sums are refused before
        for (int64_t i = 0; i < m; ++i) acc[i] += term(c, b + i);
      }
    }
    if constexpr (std::is_floating_point_v<Acc>)
      if (op == ReduceOp::Avg)
        for (int64_t i = 0; i < m; ++i) acc[i] /= static_cast<Acc>(chunk.size());
    for (int64_t i = 0; i < m; ++i) out[b + i] = cpu::store<T>(acc[i]);
  }
}

// Whether two contiguous tensors share bytes (meta tensors too: by storage and offset).
bool overlaps(const Tensor& a, const Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0 || a.storage() != b.storage()) return false;
  const size_t es = dtype_size(a.dtype());
  const size_t a0 = static_cast<size_t>(a.storage_offset()) * es, b0 = static_cast<size_t>(b.storage_offset()) * es;
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

}  // namespace

MpiGroup::MpiGroup(std::shared_ptr<GroupState> state) : state_(std::move(state)) {}

std::shared_ptr<Collective> MpiGroup::make(int64_t kind, const char* name, DType dt, int64_t in, int64_t out,
                                           ReduceOp op, int root, int64_t bytes) {
  TS_CHECK(!state_->broken.load(), "{} on group '{}': the group is unusable ({})", name, state_->name,
           state_->broken_reason);
  auto c = std::make_shared<Collective>();
  c->kind = name;
  c->group = state_;
  c->seq = state_->next_seq++;
  c->descriptor = {c->seq, kind, static_cast<int64_t>(dt), in, out, static_cast<int64_t>(op), root};
  std::lock_guard<std::mutex> lk(state_->stats_mu);
  state_->stats.mpi_calls++;
  state_->stats.bytes += bytes;
  const int64_t w = size();
  switch (kind) {
    case kAllGather: state_->stats.ring_bytes += (w - 1) * bytes; break;
    case kReduceScatter:
    case kAllToAll: state_->stats.ring_bytes += (w - 1) * bytes / w; break;
    case kAllReduce: state_->stats.ring_bytes += 2 * (w - 1) * bytes / w; break;
    case kBroadcast: state_->stats.ring_bytes += bytes; break;
    default: break;
  }
  return c;
}

void MpiGroup::count(int64_t kind) {
  std::lock_guard<std::mutex> lk(state_->stats_mu);
  CollectiveStats& s = state_->stats;
  int64_t* fields[] = {&s.all_gather, &s.reduce_scatter, &s.all_reduce, &s.broadcast, &s.all_to_all, &s.barrier};
  (*fields[kind])++;
}

namespace {
// A simulated collective: complete at once; the buffers the real one would
// hold are released when it is waited for, as the real one releases them. A
// recorded step (runtime/kernel_log.h) logs the issue and the first wait.
class SimulatedWork final : public Work {
 public:
  SimulatedWork(std::vector<Tensor> held, int64_t logged) : held_(std::move(held)), logged_(logged) {}
  void wait() override { done(); }
  void wait(Stream&) override { done(); }
  bool is_completed() override { return true; }

 private:
  void done() {
    kernel_log::collective_waited(logged_);
    held_.clear();
    logged_ = -1;
  }
  std::vector<Tensor> held_;
  int64_t logged_;
};
}  // namespace

WorkPtr MpiGroup::simulate(std::shared_ptr<Collective> c, double full_bytes) {
  // Counted (make) and checked like a real collective; nothing moves.
  int64_t logged = kernel_log::collective_issued(c->kind, state_->name, size(), full_bytes);
  return std::make_shared<SimulatedWork>(std::move(c->keep_alive), logged);
}

WorkPtr MpiGroup::submit(std::shared_ptr<Collective> c) {
  // Tensors of an asynchronous device: MPI may touch them only once the work
  // queued on the current stream so far (their producers) has run.
  for (const Tensor& t : c->keep_alive)
    if (!t.device().is_host_visible()) {
      c->ready = current_stream(t.device()).record_event();
      break;
    }
  Engine::get().submit(c);
  return c;
}

WorkPtr MpiGroup::all_gather_into_tensor(const Tensor& output, const Tensor& input) {
  const char* op = "all_gather_into_tensor";
  check_tensor(output, op, "output", simulated(), size() == 1);
  check_tensor(input, op, "input", simulated(), size() == 1);
  TS_CHECK(input.dtype() == output.dtype(), "{}: input is {} but output is {}", op, dtype_name(input.dtype()),
           dtype_name(output.dtype()));
  int64_t n = input.numel();
  TS_CHECK(output.numel() == n * size(), "{}: output has {} elements, expected {} ({} ranks x {})", op,
           output.numel(), n * size(), size(), n);
  count(kAllGather);
  size_t bytes = static_cast<size_t>(n) * dtype_size(input.dtype());
  if (simulated()) {
    if (size() == 1) return std::make_shared<DoneWork>();
    auto c = make(kAllGather, "all_gather", input.dtype(), n, output.numel(), ReduceOp::Sum, -1,
                  static_cast<int64_t>(bytes));
    c->keep_alive = {input, output};
    return simulate(c, static_cast<double>(output.nbytes()));
  }
  char* slot = output.numel() ? static_cast<char*>(output.data_ptr()) + bytes * static_cast<size_t>(rank()) : nullptr;
  bool in_place = n > 0 && input.data_ptr() == slot;
  if (size() == 1) {
    if (!in_place && n > 0) {  // queued like any copy (the device may be asynchronous)
      Tensor dst = ops::view(output, {n});
      ops::copy_(dst, ops::reshape(input, {n}));
    }
    return std::make_shared<DoneWork>();
  }
  auto c = make(kAllGather, "all_gather", input.dtype(), n, output.numel(), ReduceOp::Sum, -1,
                static_cast<int64_t>(bytes));
  c->keep_alive = {input, output};
  const char* src = n ? static_cast<const char*>(input.data_ptr()) : nullptr;
  Exchange ex{state_->comm, rank(), size(), tag_of(c->seq), count_of(n, op), transfer_type(input.dtype()), bytes,
              src, 0, slots(output.numel() ? output.data_ptr() : nullptr, bytes, size())};
  c->start = [ex, in_place, slot, src, bytes](std::vector<MPI_Request>& reqs) {
    ex.post(reqs);
    if (!in_place && bytes > 0) std::memcpy(slot, src, bytes);  // own chunk, while the messages move
  };
  return submit(c);
}

WorkPtr MpiGroup::reduce_scatter_tensor(const Tensor& output, const Tensor& input, ReduceOptions o) {
  const char* op = "reduce_scatter_tensor";
  check_tensor(output, op, "output", simulated(), size() == 1);
  check_tensor(input, op, "input", simulated(), size() == 1);
  TS_CHECK(input.dtype() == output.dtype(), "{}: input is {} but output is {}", op, dtype_name(input.dtype()),
           dtype_name(output.dtype()));
  check_reduce_dtype(input.dtype(), o, op);
  int64_t n = output.numel();
  TS_CHECK(input.numel() == n * size(), "{}: input has {} elements, expected {} ({} ranks x {})", op,
           input.numel(), n * size(), size(), n);
  count(kReduceScatter);
  if (size() == 1) {
    Tensor src = reduction_input(input, o, false);
    Tensor dst = output;
    if (!src.is_same(output)) ops::copy_(dst, ops::reshape(src, output.shape()));
    return std::make_shared<DoneWork>();
  }
  DType dt = input.dtype();
  TS_CHECK(dt != DType::Bool || o.op == ReduceOp::Max || o.op == ReduceOp::Min,
           "{}: {} is not defined on bool tensors (use max or min)", op, reduce_op_name(o.op));
  // Chunks move in the tensors' dtype (bf16 moves half of what f32 would) and
  // are reduced on the engine, over ranks in order in the compute type (f32
  // for bf16/f16, rounding once; scaled there for PremulSum), so every rank
  // rounds alike and no copy of the input is made. The first peer's chunk
  // lands in the output itself (unless the output lies inside the input, whose
  // chunks are still being sent); the others in `staged`: no buffer at all at
  // 2 ranks, W - 2 chunks beyond.
  Device host = simulated() ? Device::meta() : Device::cpu();
  const bool nccl = simulated() && simulated_like_nccl();  // reduces on the device, into output
  const bool land_in_output = !overlaps(output, input);
  const int staged_slots = nccl ? 0 : size() - 1 - (land_in_output ? 1 : 0);
  Tensor staged = staged_slots > 0 ? empty({staged_slots * n}, dt, host) : Tensor();
  auto c = make(kReduceScatter, "reduce_scatter", dt, input.numel(), n, o.op, -1,
                static_cast<int64_t>(input.nbytes()));
  c->keep_alive = {input, output};
  if (staged.defined()) c->keep_alive.push_back(staged);
  if (simulated()) return simulate(c, static_cast<double>(input.nbytes()));
  const int world = size(), me = rank();
  const size_t chunk = static_cast<size_t>(n) * dtype_size(dt);
  std::vector<char*> recv(static_cast<size_t>(world), nullptr);
  if (n > 0) {
    const int first_peer = me == 0 ? 1 : 0;
    int slot = 0;
    for (int p = 0; p < world; ++p) {
      if (p == me) continue;
      recv[static_cast<size_t>(p)] = land_in_output && p == first_peer
                                         ? static_cast<char*>(output.data_ptr())
                                         : static_cast<char*>(staged.data_ptr()) + chunk * static_cast<size_t>(slot++);
    }
  }
  Exchange ex{state_->comm, me, world, tag_of(c->seq), count_of(n, op), transfer_type(dt), chunk,
              n ? static_cast<const char*>(input.data_ptr()) : nullptr, chunk, recv};
  c->start = [ex](std::vector<MPI_Request>& reqs) { ex.post(reqs); };
  const double factor = o.factor;
  const ReduceOp rop = o.op;
  c->finish = [=] {
    if (n == 0) return;
    cpu::dispatch_all(dt, [&](auto tag) {
      using T = decltype(tag);
      std::vector<const T*> chunks(static_cast<size_t>(world));
      for (int p = 0; p < world; ++p)
        chunks[static_cast<size_t>(p)] = p == me ? static_cast<const T*>(input.data_ptr()) + static_cast<int64_t>(me) * n
                                                 : reinterpret_cast<const T*>(recv[static_cast<size_t>(p)]);
      reduce_chunks<T>(static_cast<T*>(output.data_ptr()), n, rop, factor, chunks);
    });
  };
  return submit(c);
}

WorkPtr MpiGroup::all_reduce(const Tensor& tensor, ReduceOptions o) {
  const char* op = "all_reduce";
  check_tensor(tensor, op, "tensor", simulated(), size() == 1);
  check_reduce_dtype(tensor.dtype(), o, op);
  count(kAllReduce);
  bool upcast = needs_upcast(tensor.dtype());
  if (size() == 1) {
    if (o.op == ReduceOp::PremulSum && o.factor != 1.0) {
      Tensor t = tensor;
      Tensor scaled = reduction_input(tensor, o, false);
      ops::copy_(t, scaled);
    }
    return std::make_shared<DoneWork>();
  }
  // Reduced in place: the tensor itself, or its f32 copy (scaled first for PremulSum).
  Tensor buf = tensor;
  if (upcast) buf = reduction_input(tensor, o, true);
  else if (o.op == ReduceOp::PremulSum && o.factor != 1.0) ops::mul_(buf, o.factor);
  auto c = make(kAllReduce, "all_reduce", tensor.dtype(), tensor.numel(), tensor.numel(), o.op, -1,
                static_cast<int64_t>(buf.nbytes()));
  c->keep_alive = {tensor, buf};
  if (simulated()) return simulate(c, static_cast<double>(buf.nbytes()));
  MPI_Comm comm = state_->comm;
  int cnt = count_of(tensor.numel(), op);
  MPI_Datatype type = transfer_type(buf.dtype());
  MPI_Op mop = mpi_op(o.op, buf.dtype());
  void* p = tensor.numel() ? buf.data_ptr() : nullptr;
  int world = size();
  c->start = [=](std::vector<MPI_Request>& reqs) {
    MPI_Request* req = &reqs.emplace_back(MPI_REQUEST_NULL); TS_MPI(MPI_Iallreduce(MPI_IN_PLACE, p, cnt, type, mop, comm, req)); };
  c->finish = [=] {
    if (o.op == ReduceOp::Avg) divide_serial(buf, world);
    if (upcast) narrow_serial(tensor, buf);
  };
  return submit(c);
}

WorkPtr MpiGroup::broadcast(const Tensor& tensor, int src) {
  const char* op = "broadcast";
  check_tensor(tensor, op, "tensor", simulated(), size() == 1);
  TS_CHECK(src >= 0 && src < size(), "{}: source rank {} is not in a group of {}", op, src, size());
  count(kBroadcast);
  if (size() == 1) return std::make_shared<DoneWork>();
  auto c = make(kBroadcast, "broadcast", tensor.dtype(), tensor.numel(), tensor.numel(), ReduceOp::Sum, src,
                static_cast<int64_t>(tensor.nbytes()));
  c->keep_alive = {tensor};
  if (simulated()) return simulate(c, static_cast<double>(tensor.nbytes()));
  MPI_Comm comm = state_->comm;
  int cnt = count_of(tensor.numel(), op);
  MPI_Datatype type = transfer_type(tensor.dtype());
  void* p = tensor.numel() ? tensor.data_ptr() : nullptr;
  c->start = [=](std::vector<MPI_Request>& reqs) {
    MPI_Request* req = &reqs.emplace_back(MPI_REQUEST_NULL); TS_MPI(MPI_Ibcast(p, cnt, type, src, comm, req)); };
  return submit(c);
}

WorkPtr MpiGroup::all_to_all(const Tensor& output, const Tensor& input) {
  const char* op = "all_to_all";
  check_tensor(output, op, "output", simulated(), size() == 1);
  check_tensor(input, op, "input", simulated(), size() == 1);
  TS_CHECK(input.dtype() == output.dtype() && input.numel() == output.numel(),
           "{}: input ({}, {} elements) and output ({}, {} elements) must match", op, dtype_name(input.dtype()),
           input.numel(), dtype_name(output.dtype()), output.numel());
  TS_CHECK(input.numel() % size() == 0, "{}: {} elements do not split into {} equal chunks", op, input.numel(),
           size());
  count(kAllToAll);
  if (simulated() && size() == 1) return std::make_shared<DoneWork>();
  if (size() == 1) {
    if (!input.is_same(output) && input.numel() > 0 && input.data_ptr() != output.data_ptr()) {
      Tensor dst = output;
      ops::copy_(dst, ops::reshape(input, output.shape()));
    }
    return std::make_shared<DoneWork>();
  }
  auto c = make(kAllToAll, "all_to_all", input.dtype(), input.numel(), output.numel(), ReduceOp::Sum, -1,
                static_cast<int64_t>(input.nbytes()));
  c->keep_alive = {input, output};
  if (simulated()) return simulate(c, static_cast<double>(input.nbytes()));
  int64_t n = input.numel() / size();
  size_t chunk = static_cast<size_t>(n) * dtype_size(input.dtype());
  Exchange ex{state_->comm, rank(), size(), tag_of(c->seq), count_of(n, op), transfer_type(input.dtype()), chunk,
              n ? static_cast<const char*>(input.data_ptr()) : nullptr, chunk,
              slots(n ? output.data_ptr() : nullptr, chunk, size())};
  c->start = [ex](std::vector<MPI_Request>& reqs) {
    ex.post(reqs);
    if (ex.count > 0)  // this rank's own chunk stays local
      std::memcpy(ex.recv[static_cast<size_t>(ex.rank)],
                  ex.send + ex.send_stride * static_cast<size_t>(ex.rank), ex.bytes);
  };
  return submit(c);
}

WorkPtr MpiGroup::all_to_all_single(const Tensor& output, const Tensor& input,
                                    const std::vector<int64_t>& output_splits,
                                    const std::vector<int64_t>& input_splits) {
  const char* op = "all_to_all_single";
  check_tensor(output, op, "output", simulated(), size() == 1);
  check_tensor(input, op, "input", simulated(), size() == 1);
  TS_CHECK(input.dtype() == output.dtype(), "{}: input is {} but output is {}", op, dtype_name(input.dtype()),
           dtype_name(output.dtype()));
  TS_CHECK(input.dim() >= 1 && output.dim() >= 1, "{}: input {} and output {} need a dim 0 to split", op,
           shape_str(input.shape()), shape_str(output.shape()));
  auto row_width = [](const Tensor& t) {
    int64_t w = 1;
    for (int64_t d = 1; d < t.dim(); ++d) w *= t.size(d);
    return w;
  };
  const int64_t row = row_width(input);
  TS_CHECK(row_width(output) == row, "{}: input rows {} and output rows {} differ in width", op,
           shape_str(input.shape()), shape_str(output.shape()));
  auto check_splits = [&](const std::vector<int64_t>& splits, const Tensor& t, const char* what) {
    TS_CHECK(static_cast<int>(splits.size()) == size(), "{}: {} has {} sizes for a group of {} ranks", op, what,
             splits.size(), size());
    int64_t total = 0;
    for (int64_t n : splits) {
      TS_CHECK(n >= 0, "{}: {} has a negative size {}", op, what, n);
      total += n;
    }
    TS_CHECK(total == t.size(0), "{}: {} sum to {} rows, but the tensor has {} ({})", op, what, total, t.size(0),
             shape_str(t.shape()));
  };
  check_splits(input_splits, input, "input_splits");
  check_splits(output_splits, output, "output_splits");
  count(kAllToAll);
  const int me = rank();
  TS_CHECK(input_splits[static_cast<size_t>(me)] == output_splits[static_cast<size_t>(me)],
           "{}: this rank (group rank {}) sends itself {} rows but expects {}", op, me,
           input_splits[static_cast<size_t>(me)], output_splits[static_cast<size_t>(me)]);
  if (simulated() && size() == 1) return std::make_shared<DoneWork>();
  if (size() == 1) {
    if (input.numel() > 0 && input.data_ptr() != output.data_ptr()) {
      Tensor dst = output;
      ops::copy_(dst, ops::reshape(input, output.shape()));
    }
    return std::make_shared<DoneWork>();
  }
  // Every rank agrees on the kind, dtype and row width (debug mode); the sizes differ by design.
  auto c = make(kAllToAll, "all_to_all_single", input.dtype(), row, -1, ReduceOp::Sum, -2,
                static_cast<int64_t>(input.nbytes()));
  c->keep_alive = {input, output};
  if (simulated()) return simulate(c, static_cast<double>(input.nbytes()));
  const size_t row_bytes = static_cast<size_t>(row) * dtype_size(input.dtype());
  std::vector<int64_t> send_at(static_cast<size_t>(size()), 0), recv_at(static_cast<size_t>(size()), 0);
  std::exclusive_scan(input_splits.begin(), input_splits.end(), send_at.begin(), int64_t{0});
  std::exclusive_scan(output_splits.begin(), output_splits.end(), recv_at.begin(), int64_t{0});
  std::vector<int> send_count(static_cast<size_t>(size())), recv_count(static_cast<size_t>(size()));
  for (int p = 0; p < size(); ++p) {
    send_count[static_cast<size_t>(p)] = count_of(input_splits[static_cast<size_t>(p)] * row, op);
    recv_count[static_cast<size_t>(p)] = count_of(output_splits[static_cast<size_t>(p)] * row, op);
  }
  char* out = output.numel() ? static_cast<char*>(output.data_ptr()) : nullptr;
  const char* in = input.numel() ? static_cast<const char*>(input.data_ptr()) : nullptr;
  MPI_Comm comm = state_->comm;
  MPI_Datatype type = transfer_type(input.dtype());
  const int world = size(), tag = tag_of(c->seq);
  c->start = [=](std::vector<MPI_Request>& reqs) {
    // Every pair exchanges a message, empty ones too, so that splits which
    // disagree fail in MPI (truncation) or by the timeout, never match late.
    for (int p = 0; p < world; ++p) {
      if (p == me) continue;
      char* at = out ? out + static_cast<size_t>(recv_at[static_cast<size_t>(p)]) * row_bytes : nullptr;
      TS_MPI(MPI_Irecv(at, recv_count[static_cast<size_t>(p)], type, p, tag, comm, &reqs.emplace_back(MPI_REQUEST_NULL)));
    }
    for (int k = 1; k < world; ++k) {  // staggered, as Exchange
      const int p = (me + k) % world;
      const char* at = in ? in + static_cast<size_t>(send_at[static_cast<size_t>(p)]) * row_bytes : nullptr;
      TS_MPI(MPI_Isend(at, send_count[static_cast<size_t>(p)], type, p, tag, comm,
                       &reqs.emplace_back(MPI_REQUEST_NULL)));
    }
    const size_t own = static_cast<size_t>(input_splits[static_cast<size_t>(me)]) * row_bytes;
    if (own > 0)
      std::memcpy(out + static_cast<size_t>(recv_at[static_cast<size_t>(me)]) * row_bytes,
                  in + static_cast<size_t>(send_at[static_cast<size_t>(me)]) * row_bytes, own);
  };
  return submit(c);
}

WorkPtr MpiGroup::barrier() {
  count(kBarrier);
  if (size() == 1) return std::make_shared<DoneWork>();
  auto c = make(kBarrier, "barrier", DType::Bool, 0, 0, ReduceOp::Sum, -1, 0);
  if (simulated()) return simulate(c, 0);
  MPI_Comm comm = state_->comm;
  c->start = [=](std::vector<MPI_Request>& reqs) {
    MPI_Request* req = &reqs.emplace_back(MPI_REQUEST_NULL); TS_MPI(MPI_Ibarrier(comm, req)); };
  return submit(c);
}

WorkPtr MpiGroup::send(const Tensor& tensor, int dst, int tag) { return point_to_point("send", tensor, dst, tag); }

WorkPtr MpiGroup::recv(const Tensor& tensor, int src, int tag) { return point_to_point("recv", tensor, src, tag); }

// Tags of point-to-point messages: 0 .. 2^30 - 1 (MPI promises at least
// 2^15 - 1; Open MPI and MPICH give 2^31 - 1: checked on the first message).
constexpr int kMaxTag = (1 << 30) - 1;

WorkPtr MpiGroup::point_to_point(const char* kind, const Tensor& tensor, int peer, int tag) {
  const bool sending = std::strcmp(kind, "send") == 0;
  check_tensor(tensor, kind, "tensor", simulated());
  TS_CHECK(peer >= 0 && peer < size() && peer != rank(),
           "{} on group '{}': peer {} is not another rank of the group (this rank is {} of {})", kind,
           state_->name, peer, rank(), size());
  TS_CHECK(tag >= 0 && tag <= kMaxTag, "{} on group '{}': tag {} is outside 0 .. {}", kind, state_->name, tag,
           kMaxTag);
  TS_CHECK(!state_->broken.load(), "{} on group '{}': the group is unusable ({})", kind, state_->name,
           state_->broken_reason);
  const int64_t bytes = static_cast<int64_t>(tensor.nbytes());
  {
    std::lock_guard<std::mutex> lk(state_->stats_mu);
    (sending ? state_->stats.send : state_->stats.recv)++;
    state_->stats.mpi_calls++;
    if (sending) state_->stats.bytes += bytes, state_->stats.ring_bytes += bytes;
  }
  auto c = std::make_shared<Collective>();
  c->kind = kind;
  c->group = state_;
  c->point_to_point = true;
  c->peer = peer;
  c->tag = tag;
  c->seq = state_->next_p2p++;
  c->keep_alive = {tensor};
  if (simulated()) {
    int64_t logged = kernel_log::collective_issued(c->kind, state_->name, 2, static_cast<double>(bytes));
    return std::make_shared<SimulatedWork>(std::move(c->keep_alive), logged);
  }
  const MPI_Comm comm = state_->p2p_comm;
  const int count = count_of(tensor.numel(), kind);
  const MPI_Datatype type = transfer_type(tensor.dtype());
  void* p = tensor.numel() ? tensor.data_ptr() : nullptr;
  c->start = [=](std::vector<MPI_Request>& reqs) {
    static const bool tags_fit = [&] {
      int* ub = nullptr;
      int flag = 0;
      MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &flag);
      return flag != 0 && ub != nullptr && *ub >= kMaxTag;
    }();
    TS_CHECK(tags_fit, "this MPI's largest tag (MPI_TAG_UB) is below {}: pipeline messages need larger tags",
             kMaxTag);
    MPI_Request* req = &reqs.emplace_back(MPI_REQUEST_NULL);
    if (sending)
      TS_MPI(MPI_Isend(p, count, type, peer, tag, comm, req));
    else
      TS_MPI(MPI_Irecv(p, count, type, peer, tag, comm, req));
  };
  return submit(c);
}

std::shared_ptr<ProcessGroup> MpiGroup::make_child(MPI_Comm comm, const std::string& name) {
  if (comm == MPI_COMM_NULL) return nullptr;
  auto st = std::make_shared<GroupState>();
  st->comm = comm;
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  TS_MPI(MPI_Comm_rank(comm, &st->rank));
  TS_MPI(MPI_Comm_size(comm, &st->size));
  if (st->size == 1) {  // a group of one needs no communicator: its collectives are local
    TS_MPI(MPI_Comm_free(&comm));
    return local_group(name);
  }
  TS_MPI(MPI_Comm_dup(comm, &st->check_comm));
  TS_MPI(MPI_Comm_dup(comm, &st->p2p_comm));
  int world_rank = dist::rank();
  st->global_ranks.resize(static_cast<size_t>(st->size));
  TS_MPI(MPI_Allgather(&world_rank, 1, MPI_INT, st->global_ranks.data(), 1, MPI_INT, comm));
  st->name = name;
  return std::make_shared<MpiGroup>(st);
}

std::shared_ptr<ProcessGroup> MpiGroup::new_group(const std::vector<int>& ranks, const std::string& name) {
  std::vector<bool> seen(static_cast<size_t>(size()), false);
  int my_index = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    int r = ranks[i];
    TS_CHECK(r >= 0 && r < size(), "new_group: rank {} is not in group '{}' of size {}", r, state_->name, size());
    TS_CHECK(!seen[static_cast<size_t>(r)], "new_group: rank {} listed twice", r);
    seen[static_cast<size_t>(r)] = true;
    if (r == rank()) my_index = static_cast<int>(i);
  }
  std::string label = name;
  if (label.empty()) {
    std::vector<int> members;
    for (int r : ranks) members.push_back(global_ranks()[static_cast<size_t>(r)]);
    label = fmt::format("group[{}]", fmt::join(members, ","));
  }
  if (simulated()) {
    if (my_index < 0) return nullptr;
    std::vector<int> members;
    for (int r : ranks) members.push_back(global_ranks()[static_cast<size_t>(r)]);
    return simulated_group(my_index, members, label);
  }
  if (size() == 1 || state_->comm == MPI_COMM_NULL) return my_index >= 0 ? local_group(label) : nullptr;
  return split(my_index >= 0 ? 0 : -1, my_index, label);
}

std::shared_ptr<ProcessGroup> MpiGroup::split(int color, int key, const std::string& name) {
  TS_CHECK(!simulated(), "split on simulated group '{}': a simulated rank cannot know the other ranks' "
           "colors (build simulated groups with new_group or dist::simulated_group)", state_->name);
  if (size() == 1 || state_->comm == MPI_COMM_NULL)
    return color >= 0 ? local_group(name.empty() ? fmt::format("{}/split{}", state_->name, color) : name) : nullptr;
  std::string label = name.empty() ? fmt::format("{}/split{}", state_->name, color) : name;
  std::shared_ptr<ProcessGroup> out;
  MPI_Comm parent = state_->comm;
  Engine::get().run_sync([&] {
    MPI_Comm child = MPI_COMM_NULL;
    TS_MPI(MPI_Comm_split(parent, color >= 0 ? color : MPI_UNDEFINED, key, &child));
    out = make_child(child, label);
  });
  return out;
}

CollectiveStats MpiGroup::stats() const {
  std::lock_guard<std::mutex> lk(state_->stats_mu);
  return state_->stats;
}

void MpiGroup::reset_stats() {
  std::lock_guard<std::mutex> lk(state_->stats_mu);
  state_->stats = {};
}

std::shared_ptr<ProcessGroup> local_group(const std::string& name) {
  auto st = std::make_shared<GroupState>();
  st->name = name;
  st->global_ranks = {dist::rank()};
  return std::make_shared<MpiGroup>(st);
}

}  // namespace tessera::dist::detail

namespace tessera::dist {

namespace {
std::atomic<bool> g_like_nccl{false};
}

void set_simulated_like_nccl(bool like_nccl) { g_like_nccl = like_nccl; }
bool simulated_like_nccl() { return g_like_nccl; }

ProcessGroupPtr simulated_group(int rank, const std::vector<int>& global_ranks, const std::string& name) {
  TS_CHECK(!global_ranks.empty() && rank >= 0 && rank < static_cast<int>(global_ranks.size()),
           "simulated_group '{}': rank {} is not in a group of {}", name, rank, global_ranks.size());
  auto st = std::make_shared<detail::GroupState>();
  st->name = name;
  st->rank = rank;
  st->size = static_cast<int>(global_ranks.size());
  st->global_ranks = global_ranks;
  st->simulated = true;
  return std::make_shared<detail::MpiGroup>(st);
}

}  // namespace tessera::dist
