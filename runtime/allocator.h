// Every allocation goes through a per-device allocator that counts current and
// peak bytes, so memory claims are measured, not guessed.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "runtime/device.h"

namespace tessera {

struct MemoryStats {
  int64_t current_bytes = 0;  // live bytes now
  int64_t peak_bytes = 0;     // max of current_bytes since start or reset_peak_memory_stats
  int64_t num_allocs = 0;
  int64_t num_frees = 0;
};

// The backend contract: CUDA will add a caching allocator with the same interface.
class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual void* allocate(size_t nbytes) = 0;
  virtual void deallocate(void* ptr, size_t nbytes) = 0;

  MemoryStats stats() const;
  void reset_peak();

 protected:
  void record_alloc(size_t nbytes);
  void record_free(size_t nbytes);

 private:
  std::atomic<int64_t> current_{0}, peak_{0}, allocs_{0}, frees_{0};
};

// The allocator for a device; throws for devices this build has no allocator for.
Allocator& allocator_for(Device device);

MemoryStats memory_stats(Device device = Device::cpu());
void reset_peak_memory_stats(Device device = Device::cpu());

}  // namespace tessera
