#include "runtime/stream.h"

#include "runtime/check.h"

namespace tessera {

namespace {

class CpuStream final : public Stream {
 public:
  Device device() const override { return Device::cpu(); }
  void synchronize() override {}  // ops ran to completion when they returned
};

class CpuEvent final : public Event {
 public:
  void record(Stream& stream) override {
    TS_CHECK(stream.device().is_cpu(), "a CPU event cannot be recorded on a {} stream",
             stream.device().str());
    recorded_ = true;
  }
  bool query() const override { return true; }  // never pending: the host is the stream
  void synchronize() override {}
  void wait(Stream& stream) override {
    TS_CHECK(stream.device().is_cpu(), "a {} stream cannot wait on a CPU event", stream.device().str());
  }

 private:
  bool recorded_ = false;
};

}  // namespace

Stream& current_stream(Device device) {
  static CpuStream cpu;
  TS_CHECK(device.is_cpu(), "no streams for device {} in this build (CPU-only)", device.str());
  return cpu;
}

std::unique_ptr<Event> make_event(Device device) {
  TS_CHECK(device.is_cpu(), "no events for device {} in this build (CPU-only)", device.str());
  return std::make_unique<CpuEvent>();
}

}  // namespace tessera
