// The collectives of one parameter group (PyTorch: _fsdp_collectives.py):
// one all-gather per group in forward/backward, one reduce-scatter (and, for
// HSDP, one all-reduce) per group in backward.
//
// Streams (PyTorch FSDP2's, docs/streams.md): the all-gather copy-in runs on
// its own stream, the collective is issued from the all-gather stream, the
// copy-out on the compute (current) stream; gradients are copied in on the
// compute stream, reduced from the reduce-scatter stream (HSDP: all-reduced
// from the all-reduce stream) and viewed out on the reduce-scatter stream.
// Events order them; buffers that one stream allocated and another reads are
// held by a reference until the allocating stream has waited for the reader's
// event, so the caching allocator never hands them out early. Nothing here
// blocks the host except Work::wait on the CPU, whose streams are the host.
#pragma once

#include "fsdp/fsdp_param.h"
#include "runtime/stream.h"
#include "runtime/trace.h"

namespace tessera::fsdp {

// The streams one FSDP root uses (PyTorch: FSDPCommContext's four streams).
struct FSDPStreams {
  StreamPtr all_gather_copy_in, all_gather, reduce_scatter, all_reduce;
  void init(Device device);  // new streams of the device (once)
  bool initialized() const { return all_gather != nullptr; }
};

// A buffer another stream still reads, kept until the event is waited for.
struct BufferState {
  Tensor buffer;
  std::shared_ptr<Event> event;
  // False once the reader's work has run: then nothing needs to hold the buffer.
  bool in_use() const { return event && !event->query(); }
};

// Test-only: the all-gather stream skips its wait for the copy-in stream, so
// the collective (and, at world size 1, the copy-out) may read the flat
// buffer before the copy-in wrote it. On the asynchronous CPU device training
// must then go wrong (tests/fsdp/test_streams.cpp shows it does).
void set_skip_copy_in_wait_for_testing(bool skip);
// Test-only: the reduce-scatter stream of an asynchronous device sleeps this
// long before each gradient view-out, so that the compute stream runs ahead
// (a buffer the view-out still reads must not go back to the compute stream's
// cache before it; tests/fsdp/test_streams.cpp).
void set_reduce_scatter_stall_for_testing(int microseconds);

// An all-gather in flight: the flat output [W, per-rank total] (rank r's row
// is the concatenation of every parameter's padded shard of rank r).
struct AllGatherResult {
  Tensor output;
  dist::WorkPtr work;  // null when no collective was needed (world size 1)
  std::shared_ptr<Event> event;  // on the all-gather stream once the collective was issued
  std::vector<int64_t> offsets;  // per parameter, within a rank's row
  int64_t row = 0;               // per-rank total
  int world = 1;
};

// Copy-in (each parameter's all-gather input into this rank's row of the
// output, cast to param_dtype) on the copy-in stream and one in-place
// all-gather over `group` from the all-gather stream. `previous` (the last
// forward all-gather's buffer, if any) is released once the copy-in stream
// has waited for its copy-out.
AllGatherResult foreach_all_gather(const std::vector<FSDPParam*>& params, const dist::ProcessGroupPtr& group,
                                   DType dtype, const FSDPStreams& streams, std::optional<BufferState>& previous);
// On the compute stream, after waiting for the all-gather: copy each
// parameter's rows out into its unsharded buffer (allocating its bytes) and
// build the unsharded view. Returns the flat buffer and the copy-out's event:
// the all-gather streams must wait for it before the buffer is dropped.
BufferState foreach_all_gather_copy_out(AllGatherResult& result, const std::vector<FSDPParam*>& params);

// A gradient reduction in flight. Stages: reduce-scatter running -> (HSDP)
// all-reduce running -> done (gradients written into the sharded .grad).
struct ReduceResult {
  std::vector<FSDPParam*> params;
  std::vector<int64_t> offsets;  // per parameter, within the output
  Tensor output;                 // [row] in the reduce dtype (on the reduce-scatter stream)
  dist::WorkPtr reduce_scatter;
  dist::WorkPtr all_reduce;
  MeshInfo mesh_info;
  bool all_reduce_grads = true;
  dist::ReduceOptions all_reduce_op;
  Tensor* partial_output = nullptr;  // HSDP without all-reduce: accumulate here instead
  bool done = false;
};

// How gradients are averaged: the reduce-scatter op, and the all-reduce op for
// HSDP (PyTorch's _get_gradient_divide_factors; one f32/bf16 rule here because
// bf16/f16 reductions run in f32 on the CPU).
struct DivideOps {
  dist::ReduceOptions reduce_scatter;
  dist::ReduceOptions all_reduce;
  double post_scale = 1.0;  // world size 1 with a custom factor
};
DivideOps divide_ops(const MeshInfo& mesh_info, std::optional<double> factor);

// Copy-in of the unsharded gradients (zero-padded per rank, cast to the reduce
// dtype) on the compute stream and an asynchronous reduce-scatter over the
// shard group from the reduce-scatter stream. The copy-in buffer goes to
// `input_state` (the compute stream waits for its event before the next
// copy-in drops it; PyTorch: ReduceScatterState).
ReduceResult foreach_reduce(const std::vector<FSDPParam*>& params, const std::vector<Tensor>& grads,
                            const MeshInfo& mesh_info, DType reduce_dtype, const DivideOps& ops,
                            bool all_reduce_grads, Tensor* partial_output, const FSDPStreams& streams,
                            std::optional<BufferState>& input_state);
// Makes the reduce-scatter stream wait for the reduce-scatter (on the CPU:
// the host waits); for HSDP issues the all-reduce (or accumulates into the
// partial output). Call once the reduce-scatter should be done.
void advance_reduce(ReduceResult& r, const FSDPStreams& streams);
// Waits for everything and writes the sharded gradients (adding to existing
// ones) on the reduce-scatter stream; returns that stream's event after it.
std::shared_ptr<Event> finish_reduce(ReduceResult& r, const FSDPStreams& streams);

// FSDP's own lane in traces ("fsdp"): its copies into and out of the
// collectives' buffers, unshard and reshard.
trace::Lane trace_lane();

}  // namespace tessera::fsdp
