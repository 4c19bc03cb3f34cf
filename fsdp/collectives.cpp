#include "fsdp/collectives.h"

#include <atomic>
#include <chrono>
#include <thread>

#include "autograd/tape.h"
#include "dtensor/dtensor.h"
#include "runtime/trace.h"

namespace tessera::fsdp {

trace::Lane trace_lane() {
  static const trace::Lane lane = trace::register_lane("fsdp");
  return lane;
}

namespace {
std::atomic<bool> skip_copy_in_wait{false};
std::atomic<int> reduce_scatter_stall_us{0};
}  // namespace

void set_skip_copy_in_wait_for_testing(bool skip) { skip_copy_in_wait = skip; }
void set_reduce_scatter_stall_for_testing(int microseconds) { reduce_scatter_stall_us = microseconds; }

void FSDPStreams::init(Device device) {
  if (initialized()) return;
  all_gather_copy_in = new_stream(device);
  all_gather = new_stream(device);
  reduce_scatter = new_stream(device);
  all_reduce = new_stream(device);
}

AllGatherResult foreach_all_gather(const std::vector<FSDPParam*>& params, const dist::ProcessGroupPtr& group,
                                   DType dtype, const FSDPStreams& streams, std::optional<BufferState>& previous) {
  trace::Scope span(trace_lane(), "all-gather copy-in");
  AllGatherResult r;
  r.world = group ? group->size() : 1;
  int rank = group ? group->rank() : 0;
  Stream& copy_in = *streams.all_gather_copy_in;
  if (previous) {  // the last forward all-gather's buffer: reusable once its copy-out ran
    copy_in.wait_event(*previous->event);
    previous.reset();
  }
  {
    StreamGuard on_copy_in(copy_in);
    std::vector<Tensor> inputs;
    for (FSDPParam* p : params) {
      inputs.push_back(p->all_gather_input());
      r.offsets.push_back(r.row);
      r.row += inputs.back().numel();
    }
    // The all-gather input is this rank's row of the output: gathered in place.
    r.output = empty({r.world * r.row}, dtype, params.front()->compute_device);
    Tensor slot = ops::narrow(r.output, 0, rank * r.row, r.row);
    for (size_t i = 0; i < params.size(); ++i) {
      Tensor dst = ops::narrow(slot, 0, r.offsets[i], inputs[i].numel());
      ops::copy_(dst, inputs[i]);
    }
    if (!skip_copy_in_wait.load(std::memory_order_relaxed)) streams.all_gather->wait_stream(copy_in);
    StreamGuard on_all_gather(*streams.all_gather);
    if (r.world > 1) r.work = group->all_gather_into_tensor(r.output, slot);
    r.event = streams.all_gather->record_event();
  }
  return r;
}

BufferState foreach_all_gather_copy_out(AllGatherResult& r, const std::vector<FSDPParam*>& params) {
  Stream& compute = current_stream(r.output.device());
  compute.wait_event(*r.event);
  if (r.work) r.work->wait(compute);
  trace::Scope span(trace_lane(), "all-gather copy-out");
  autograd::NoGradGuard no_grad;
  Tensor rows = ops::view(r.output, {r.world, r.row});
  for (size_t i = 0; i < params.size(); ++i) {
    FSDPParam* p = params[i];
    int64_t n = (i + 1 < params.size() ? r.offsets[i + 1] : r.row) - r.offsets[i];
    p->alloc_unsharded();
    Tensor dst = ops::view(p->unsharded_buffer, {r.world, n});
    ops::copy_(dst, ops::narrow(rows, 1, r.offsets[i], n));
    if (p->shard_dim != 0) {
      // Shard(d > 0): rank q's padded chunk is columns [q*c, (q+1)*c) of dim d.
      int64_t w = p->unsharded_buffer.numel() / p->padded_numel;
      int64_t c = p->padded_sharded_size[static_cast<size_t>(p->shard_dim)];
      Tensor chunks = ops::view(p->unsharded_buffer, {w, p->padded_numel});
      for (int64_t q = 0; q < w; ++q) {
        Tensor piece = ops::view(ops::select(chunks, 0, q), p->padded_sharded_size);
        Tensor target = ops::narrow(p->unsharded_local, p->shard_dim, q * c, c);
        ops::copy_(target, piece);
      }
    }
  }
  BufferState done{std::move(r.output), compute.record_event()};
  r.output = Tensor();
  return done;
}

DivideOps divide_ops(const MeshInfo& m, std::optional<double> factor) {
  DivideOps o;
  if (!factor) {
    o.reduce_scatter.op = m.shard_size > 1 ? dist::ReduceOp::Avg : dist::ReduceOp::Sum;
    o.all_reduce.op = m.replicate_size > 1 ? dist::ReduceOp::Avg : dist::ReduceOp::Sum;
    return o;
  }
  double f = *factor;
  if (m.shard_size == 1) {
    o.post_scale = 1.0 / f;
  } else if (f == static_cast<double>(m.shard_size)) {
    o.reduce_scatter.op = dist::ReduceOp::Avg;
  } else {
    o.reduce_scatter = {dist::ReduceOp::PremulSum, 1.0 / f};
  }
  o.all_reduce.op = dist::ReduceOp::Sum;
  return o;
}

ReduceResult foreach_reduce(const std::vector<FSDPParam*>& params, const std::vector<Tensor>& grads,
                            const MeshInfo& m, DType reduce_dtype, const DivideOps& ops_in, bool all_reduce_grads,
                            Tensor* partial_output, const FSDPStreams& streams, std::optional<BufferState>& input_state) {
  trace::Scope span(trace_lane(), "reduce-scatter copy-in");
  Device device = params.front()->compute_device;
  Stream& compute = current_stream(device);
  if (input_state) {  // the previous copy-in buffer: reusable once the reduce-scatter stream used it
    compute.wait_event(*input_state->event);
    input_state.reset();
  }
  autograd::NoGradGuard no_grad;
  ReduceResult r;
  r.params = params;
  r.mesh_info = m;
  r.all_reduce_grads = all_reduce_grads;
  r.all_reduce_op = ops_in.all_reduce;
  r.partial_output = partial_output;
  int64_t w = m.shard_size, row = 0;
  for (FSDPParam* p : params) {
    r.offsets.push_back(row);
    row += p->padded_numel;
  }
  // Row q holds rank q's zero-padded chunk of every gradient, in the reduce dtype.
  Tensor input = zeros({w * row}, reduce_dtype, device);
  Tensor rows = ops::view(input, {w, row});
  for (size_t i = 0; i < params.size(); ++i) {
    FSDPParam* p = params[i];
    const Tensor& g = grads[i];
    int64_t n = p->orig_size[static_cast<size_t>(p->shard_dim)];
    for (int64_t q = 0; q < w; ++q) {
      auto [len, start] = shard_size_and_offset(n, w, q);
      if (len == 0) continue;
      Tensor piece = ops::contiguous(ops::narrow(g, p->shard_dim, start, len));
      Tensor dst = ops::narrow(ops::select(rows, 0, q), 0, r.offsets[i], piece.numel());
      ops::copy_(dst, ops::reshape(piece, {piece.numel()}));
    }
  }
  Stream& rs = *streams.reduce_scatter;
  rs.wait_stream(compute);
  StreamGuard on_reduce_scatter(rs);
  if (w > 1) {
    r.output = empty({row}, reduce_dtype, device);
    r.reduce_scatter = m.shard_group->reduce_scatter_tensor(r.output, input, ops_in.reduce_scatter);
  } else if (ops_in.post_scale != 1.0) {
    r.output = ops::mul(input, ops_in.post_scale);
  } else {
    // World size 1: the input is the output, but the view-out reads it on this
    // stream later, after input_state let it go back to the compute stream's
    // cache. An asynchronous stream copies it into an output of its own
    // (PyTorch reduce-scatters into one at world size 1 too).
    r.output = rs.synchronous() ? input : ops::clone(input);
  }
  // Kept until the compute stream waited for the reduce-scatter stream's use,
  // unless that use is already over (always, on synchronous streams); MPI
  // holds what it still sends.
  BufferState used{input, rs.record_event()};
  if (used.in_use()) input_state = std::move(used);
  return r;
}

namespace {

// HSDP: the reduce-scatter output (or, at shard size 1, the whole gradient)
// is added to the partial output of earlier no-all-reduce micro-batches and
// all-reduced across replicas, or accumulated for a later micro-batch.
void hsdp_all_reduce(ReduceResult& r, const FSDPStreams& streams) {
  StreamGuard on_reduce_scatter(*streams.reduce_scatter);
  if (!r.all_reduce_grads) {  // reduce-scatter only: all-reduce on a later micro-batch
    *r.partial_output = r.partial_output->defined() ? ops::add(*r.partial_output, r.output) : ops::clone(r.output);
    r.done = true;
    return;
  }
  if (r.partial_output && r.partial_output->defined()) {
    r.output = ops::add(r.output, *r.partial_output);
    *r.partial_output = Tensor();
  }
  streams.all_reduce->wait_stream(*streams.reduce_scatter);
  StreamGuard on_all_reduce(*streams.all_reduce);
  r.all_reduce = r.mesh_info.replicate_group->all_reduce(r.output, r.all_reduce_op);
}

}  // namespace

void advance_reduce(ReduceResult& r, const FSDPStreams& streams) {
  const bool replicas = r.mesh_info.hsdp() && r.mesh_info.replicate_size > 1;
  if (r.reduce_scatter) {
    r.reduce_scatter->wait(*streams.reduce_scatter);
    r.reduce_scatter = nullptr;
    if (replicas && !r.all_reduce) hsdp_all_reduce(r, streams);
  } else if (replicas && !r.all_reduce && !r.done) {
    hsdp_all_reduce(r, streams);  // shard size 1 with replicas: the all-reduce is the whole reduction
  }
}

std::shared_ptr<Event> finish_reduce(ReduceResult& r, const FSDPStreams& streams) {
  if (r.done) return nullptr;
  advance_reduce(r, streams);
  if (r.done) return nullptr;  // accumulated for a later all-reduce
  Stream& rs = *streams.reduce_scatter;
  if (r.all_reduce) r.all_reduce->wait(rs);
  trace::Scope span(trace_lane(), "gradient view-out");
  autograd::NoGradGuard no_grad;
  if (int us = reduce_scatter_stall_us.load(std::memory_order_relaxed); us > 0 && !rs.synchronous())
    rs.enqueue("test stall", [us] { std::this_thread::sleep_for(std::chrono::microseconds(us)); });
  StreamGuard on_reduce_scatter(rs);
  std::vector<Tensor> locals;
  bool to_host = false;
  for (FSDPParam* p : r.params) {
    Tensor local = ops::view(ops::narrow(r.output, 0, r.offsets[locals.size()], shape_numel(p->sharded_size)),
                             p->sharded_size);
    if (local.dtype() != p->orig_dtype) local = ops::to(local, p->orig_dtype);
    if (p->offloaded()) local = ops::to(local, Device::cpu()), to_host = true;  // queued on this stream
    locals.push_back(local);
  }
  // Offloaded gradients: the host owns them (and the optimizer steps on the
  // host) only after the copies ran.
  if (to_host) rs.synchronize();
  for (size_t i = 0; i < r.params.size(); ++i) {
    FSDPParam* p = r.params[i];
    Tensor local = locals[i];
    const DTensorSpec& spec = dtensor_spec(p->sharded_param);
    Tensor grad = p->sharded_param.grad();
    if (grad.defined()) {
      Tensor& existing = grad;
      ops::add_(existing, make_dtensor(local, spec.mesh, spec.placements, spec.global_shape));
    } else {
      p->sharded_param.set_grad(make_dtensor(local, spec.mesh, spec.placements, spec.global_shape));
    }
  }
  r.output = Tensor();
  r.done = true;
  return rs.record_event();
}

}  // namespace tessera::fsdp
