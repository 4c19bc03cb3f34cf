#include "runtime/stream.h"

#include <atomic>
#include <cstdlib>

#include "runtime/async_cpu.h"
#include "runtime/check.h"
#include "runtime/cuda_backend.h"

namespace tessera {

namespace {

std::atomic<uint64_t> next_stream_id{1};
std::atomic<int64_t> host_syncs{0};

// The host is the stream: work runs when it is enqueued. The meta device's
// streams are the same (a step planned on meta takes the CPU's paths).
class CpuStream final : public Stream {
 public:
  explicit CpuStream(Device device = Device::cpu()) : device_(device) {}
  Device device() const override { return device_; }
  bool synchronous() const override { return true; }
  void enqueue(const char*, std::function<void()> fn) override { fn(); }
  void synchronize() override {}
  bool query() override { return true; }

 private:
  Device device_;
};

class CpuEvent final : public Event {
 public:
  explicit CpuEvent(Device device = Device::cpu()) : device_(device) {}
  void record(Stream& stream) override {
    TS_CHECK(stream.device() == device_, "a {} event cannot be recorded on a {} stream", device_.str(),
             stream.device().str());
  }
  bool query() const override { return true; }  // never pending: the host is the stream
  void synchronize() override {}
  void wait(Stream& stream) override {
    TS_CHECK(stream.device() == device_, "a {} stream cannot wait on a {} event", stream.device().str(),
             device_.str());
  }

 private:
  Device device_;
};

}  // namespace

Stream::Stream() : id_(next_stream_id.fetch_add(1)) {}

std::shared_ptr<Event> Stream::record_event() {
  auto e = make_event(device());
  e->record(*this);
  return e;
}

void Stream::wait_event(Event& event) { event.wait(*this); }

void Stream::wait_stream(Stream& other) {
  if (&other == this || other.synchronous()) return;
  other.record_event()->wait(*this);
}

namespace detail {

Stream*& current_stream_slot(Device device) {
  thread_local Stream* slots[4] = {nullptr, nullptr, nullptr, nullptr};
  return slots[static_cast<int>(device.type)];
}

void count_host_sync() { host_syncs.fetch_add(1, std::memory_order_relaxed); }

}  // namespace detail

Stream& default_stream(Device device) {
  if (device.is_cpu()) {
    static auto* cpu = new std::shared_ptr<Stream>(std::make_shared<CpuStream>());  // never destroyed
    return **cpu;
  }
  if (device.is_meta()) {
    static auto* meta = new std::shared_ptr<Stream>(std::make_shared<CpuStream>(Device::meta()));
    return **meta;
  }
  if (device.is_cuda()) return cuda::default_stream(device.index);
  return async_cpu::default_stream();
}

Stream& current_stream(Device device) {
  Stream* s = detail::current_stream_slot(device);
  return s != nullptr ? *s : default_stream(device);
}

StreamPtr new_stream(Device device) {
  if (device.is_cpu() || device.is_meta()) return std::make_shared<CpuStream>(device);
  if (device.is_cuda()) return cuda::new_stream(device.index);
  return async_cpu::new_stream();
}

std::shared_ptr<Event> make_event(Device device) {
  if (device.is_cpu() || device.is_meta()) return std::make_shared<CpuEvent>(device);
  if (device.is_cuda()) return cuda::make_event(device.index);
  return async_cpu::make_event();
}

StreamGuard::StreamGuard(Stream& stream)
    : device_(stream.device()), previous_(detail::current_stream_slot(device_)) {
  detail::current_stream_slot(device_) = &stream;
}

StreamGuard::~StreamGuard() { detail::current_stream_slot(device_) = previous_; }

void synchronize(Device device) {
  if (device.type == DeviceType::AsyncCPU) async_cpu::synchronize_all();
  if (device.is_cuda()) cuda::synchronize(device.index);
}

int64_t host_sync_count() { return host_syncs.load(std::memory_order_relaxed); }

void set_async_delays(int max_us) {
  TS_CHECK(max_us >= 0, "set_async_delays: expected a delay >= 0 microseconds, got {}", max_us);
  async_cpu::set_delays(max_us);
}

int async_delays() { return async_cpu::delays(); }

}  // namespace tessera
