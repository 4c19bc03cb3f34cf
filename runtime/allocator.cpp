#include "runtime/allocator.h"

#include <cstdlib>
#include <new>

#include "runtime/check.h"

namespace tessera {

MemoryStats Allocator::stats() const {
  return {current_.load(), peak_.load(), allocs_.load(), frees_.load()};
}

void Allocator::reset_peak() { peak_.store(current_.load()); }

void Allocator::record_alloc(size_t nbytes) {
  int64_t now = current_.fetch_add(static_cast<int64_t>(nbytes)) + static_cast<int64_t>(nbytes);
  int64_t peak = peak_.load();
  while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
  }
  allocs_.fetch_add(1);
}

void Allocator::record_free(size_t nbytes) {
  current_.fetch_sub(static_cast<int64_t>(nbytes));
  frees_.fetch_add(1);
}

namespace {

// 64-byte aligned host memory (one cache line, one AVX-512 vector).
class CpuAllocator final : public Allocator {
 public:
  void* allocate(size_t nbytes) override {
    if (nbytes == 0) return nullptr;
    size_t rounded = (nbytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded);
    TS_CHECK(p != nullptr, "out of host memory allocating {} bytes ({} bytes live)", nbytes,
             stats().current_bytes);
    record_alloc(nbytes);
    return p;
  }
  void deallocate(void* ptr, size_t nbytes) override {
    if (ptr == nullptr) return;
    std::free(ptr);
    record_free(nbytes);
  }
};

}  // namespace

Allocator& allocator_for(Device device) {
  static CpuAllocator cpu;
  TS_CHECK(device.is_cpu(), "no allocator for device {} in this build (CPU-only)", device.str());
  return cpu;
}

MemoryStats memory_stats(Device device) {
  if (device.is_meta()) return {};
  return allocator_for(device).stats();
}

void reset_peak_memory_stats(Device device) {
  if (!device.is_meta()) allocator_for(device).reset_peak();
}

std::string Device::str() const {
  switch (type) {
    case DeviceType::CPU: return "cpu";
    case DeviceType::Meta: return "meta";
    case DeviceType::CUDA: return "cuda:" + std::to_string(index);
  }
  return "?";
}

Device Device::parse(const std::string& name) {
  if (name == "cpu") return cpu();
  if (name == "meta") return meta();
  if (name == "cuda") return cuda(0);
  if (name.rfind("cuda:", 0) == 0) {
    try {
      return cuda(std::stoi(name.substr(5)));
    } catch (const std::exception&) {
    }
  }
  TS_CHECK(false, "unknown device '{}' (expected cpu, meta, cuda or cuda:N)", name);
}

}  // namespace tessera
