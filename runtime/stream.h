// Streams and events: the ordering contract every device implements (CUDA:
// cudaStream_t / cudaEvent_t). Work queued on one stream runs in order; an
// event recorded on a stream completes when the work queued before it has;
// another stream can be made to wait for an event without blocking the host.
//
// Each device has a current stream per host thread (its default stream unless
// a StreamGuard says otherwise); every op enqueues its kernel there.
//   - cpu: synchronous. A stream is the calling thread itself: work runs when
//     it is enqueued and events are complete once recorded.
//   - async_cpu: the asynchronous CPU test device. Each stream is a worker
//     thread; work runs there later, events and waits are real, and
//     set_async_delays adds random delays, so a missing wait shows up as a
//     wrong number on a machine without a GPU.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "runtime/device.h"

namespace tessera {

class Event;

class Stream : public std::enable_shared_from_this<Stream> {
 public:
  virtual ~Stream() = default;
  virtual Device device() const = 0;
  // Unique in the process (the allocator tags blocks with it).
  uint64_t id() const { return id_; }
  // True when work runs as it is enqueued (the host is the stream).
  virtual bool synchronous() const = 0;
  // Runs fn in stream order: at once on a synchronous stream, later on the
  // stream's own thread otherwise. `what` names the work in a deferred error.
  virtual void enqueue(const char* what, std::function<void()> fn) = 0;
  // Blocks the host until everything queued so far has run, then raises the
  // first error a queued kernel threw since the last synchronize (naming it).
  virtual void synchronize() = 0;
  // True when everything queued so far has run.
  virtual bool query() = 0;

  // PyTorch's Stream.record_event / wait_event / wait_stream.
  std::shared_ptr<Event> record_event();
  void wait_event(Event& event);
  void wait_stream(Stream& other);  // waits for the work queued on `other` so far

 protected:
  Stream();

 private:
  uint64_t id_;
};
using StreamPtr = std::shared_ptr<Stream>;

class Event {
 public:
  virtual ~Event() = default;
  // Marks the point in `stream` that the event stands for (re-recording moves it).
  virtual void record(Stream& stream) = 0;
  // True when the work before the recorded point has completed (or nothing was recorded).
  virtual bool query() const = 0;
  // Blocks the host until then.
  virtual void synchronize() = 0;
  // Makes `stream` wait for the event before running work queued after this call.
  virtual void wait(Stream& stream) = 0;
};

// The stream ops on `device` are enqueued on from this thread.
Stream& current_stream(Device device);
// The stream a device starts with (current until a guard changes it).
Stream& default_stream(Device device);
// A new stream on `device` (on async_cpu: a new worker thread; it drains and
// stops when the last reference goes).
StreamPtr new_stream(Device device);
std::shared_ptr<Event> make_event(Device device);

// Makes `stream` the current stream of its device on this thread for a scope.
class StreamGuard {
 public:
  explicit StreamGuard(Stream& stream);
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  Device device_;
  Stream* previous_;
};

// Waits for every stream of `device` (PyTorch: torch.cuda.synchronize).
void synchronize(Device device);

// Host syncs so far: a host wait on a stream or event that was not already
// complete-by-construction, and every copy of a device's values to the host.
// A training step between two log steps makes none (tests count them).
int64_t host_sync_count();

// The asynchronous CPU test device: each kernel waits a random 0..max_us
// microseconds before it runs (0: off; TESSERA_ASYNC_DELAYS sets the start value).
void set_async_delays(int max_us);
int async_delays();

namespace detail {
void count_host_sync();
// Registers a device's streams with the per-thread current-stream table.
Stream*& current_stream_slot(Device device);
}  // namespace detail

}  // namespace tessera
