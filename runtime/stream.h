// Streams and events: the ordering contract a device backend implements (CUDA:
// cudaStream_t / cudaEvent_t). Work queued on one stream runs in order; an
// event recorded on a stream completes when the work queued before it has;
// another stream can be made to wait for an event without blocking the host.
// On the CPU every op runs to completion on the calling thread, so the CPU
// stream is the host itself and its events are complete once recorded.
#pragma once

#include <memory>

#include "runtime/device.h"

namespace tessera {

class Stream {
 public:
  virtual ~Stream() = default;
  virtual Device device() const = 0;
  // Blocks the host until everything queued on this stream has run.
  virtual void synchronize() = 0;
};

class Event {
 public:
  virtual ~Event() = default;
  // Marks the point in `stream` that the event stands for.
  virtual void record(Stream& stream) = 0;
  // True when the work before the recorded point has completed.
  virtual bool query() const = 0;
  // Blocks the host until then.
  virtual void synchronize() = 0;
  // Makes `stream` wait for the event before running work queued after this call.
  virtual void wait(Stream& stream) = 0;
};

// The stream ops on `device` are issued to by default.
Stream& current_stream(Device device);
std::unique_ptr<Event> make_event(Device device);

}  // namespace tessera
