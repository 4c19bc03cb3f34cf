// Every allocation goes through one caching allocator per device, so memory
// claims are measured, not guessed, and per-layer gathers and frees of
// sharded parameters reuse blocks instead of reaching malloc (or cudaMalloc)
// every layer.
//
// Blocks know the stream they were allocated on (the device's current stream
// at the time). A freed block goes back to that stream's cache, as in
// PyTorch's CUDA caching allocator:
//   - the same stream takes it again at once: its later work is queued after
//     every use of the old tensor, so stream order protects the bytes;
//   - other streams never take it (no record_stream); empty_cache() returns it
//     to the system once an event recorded on its stream at the free has
//     completed, and an allocation that finds no memory does so after waiting.
// Blocks of synchronous streams (the CPU's) are shared by all: their work is
// done when they are freed. Freeing is deterministic and never syncs the host.
// A tensor that a second stream reads must be kept alive by its user (a
// reference held until the allocating stream has waited for the reader's
// event), as the layers above keep their collectives' buffers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "runtime/device.h"

namespace tessera {

class Event;
class Stream;

struct MemoryStats {
  int64_t allocated_bytes = 0;       // in live storage now (what a tensor asked for)
  int64_t peak_allocated_bytes = 0;  // max since start or reset_peak_memory_stats
  int64_t reserved_bytes = 0;        // held from the system: allocated + cached
  int64_t peak_reserved_bytes = 0;
  int64_t num_allocs = 0;  // storage allocations served (from the cache or not)
  int64_t num_frees = 0;
  int64_t num_system_allocs = 0;  // malloc / cudaMalloc calls: flat after warm-up
  int64_t num_system_frees = 0;
  int64_t num_events = 0;  // events made to mark frees on asynchronous streams: flat after warm-up (pooled)
};

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual void* allocate(size_t nbytes) = 0;  // on the device's current stream
  virtual void deallocate(void* ptr) = 0;
  virtual MemoryStats stats() const = 0;
  virtual void reset_peak() = 0;
  // Returns every cached block whose last use is complete to the system.
  virtual void empty_cache() = 0;
};

// The caching logic shared by every device; a backend supplies the system calls.
class CachingAllocator : public Allocator {
 public:
  explicit CachingAllocator(Device device) : device_(device) {}
  void* allocate(size_t nbytes) override;
  void deallocate(void* ptr) override;
  MemoryStats stats() const override;
  void reset_peak() override;
  void empty_cache() override;

  // Sizes are rounded up to this, and a cached block is taken for a request up
  // to 1/8 smaller than itself (no splitting: a training step asks for the same sizes every step).
  static constexpr size_t kRound = 512;

 protected:
  // The bytes of the block that serves a request of nbytes (at least
  // nbytes): kRound multiples here; a backend may round further.
  virtual size_t block_size(size_t nbytes) const;
  virtual void* system_allocate(size_t nbytes) = 0;  // nullptr when out of memory
  virtual void system_free(void* ptr) = 0;

 private:
  struct Block {
    void* ptr = nullptr;
    size_t size = 0;       // rounded, as reserved
    size_t requested = 0;  // as asked for (allocated_bytes)
    uint64_t stream = 0;   // id of the stream it was allocated on
    std::weak_ptr<Stream> owner;  // that stream (gone: its work is done; a CUDA stream waits for it as it goes)
    std::shared_ptr<Event> freed;  // recorded on that stream at the free (null: synchronous stream)
  };
  void* take_cached(size_t size, const std::shared_ptr<Stream>& stream);  // with mu_ held
  void release_cached(bool wait);                   // with mu_ held
  // The events of blocks taken back or released, for the next frees: an event
  // per free would be created and destroyed thousands of times a step.
  std::vector<std::shared_ptr<Event>> spare_events_;  // under mu_

  Device device_;
  mutable std::mutex mu_;
  std::unordered_map<void*, Block> live_;
  std::multimap<size_t, Block> cached_;  // by size
  MemoryStats stats_;
};

// The allocator for a device; throws for devices this build has no allocator for.
Allocator& allocator_for(Device device);

// memory_stats(Device::meta()) is the meta accounting below; zero without it.
MemoryStats memory_stats(Device device = Device::cpu());
void reset_peak_memory_stats(Device device = Device::cpu());
// Gives cached, unused blocks back to the system (PyTorch: torch.cuda.empty_cache).
void empty_cache(Device device = Device::cpu());

// Host blocks of kHugePage or more are whole 2 MiB pages, aligned to one,
// and advised to Linux as transparent huge pages (madvise MADV_HUGEPAGE:
// Linux backs them with huge pages where its setting is `madvise` or
// `always`, and ignores the advice under `never`). A tensor's pass then walks
// one page table entry per 2 MiB instead of per 4 KiB: in a virtual machine
// (two levels of page tables) the f32 steps ran 1.02-1.08x faster with it
// (benchmarks/README.md). PyTorch offers the same behind
// THP_MEM_ALLOC_ENABLE=1. On by default; TESSERA_HUGE_PAGES=0 turns it off
// for the process (read at the first large host allocation). The rounding is
// counted in reserved_bytes, not in allocated_bytes.
inline constexpr size_t kHugePage = size_t{2} << 20;
bool host_huge_pages();

// Meta accounting, for planning a run without running it. While a
// MetaAccounting is alive, meta storages created or re-allocated count as
// allocations in memory_stats(Device::meta()), and releasing or destroying
// them frees the bytes, as the caching allocator counts a real device's
// (allocated_bytes: the bytes tensors asked for). A training step run on meta
// then shows the allocated bytes and peak that the same step would reach on
// the device, from the code's own allocations. One accounting at a time.
class MetaAccounting {
 public:
  MetaAccounting();  // starts with nothing counted as allocated
  ~MetaAccounting();
  MetaAccounting(const MetaAccounting&) = delete;
  MetaAccounting& operator=(const MetaAccounting&) = delete;
};
bool meta_accounting_active();

namespace detail {
// Storage's side of the accounting (runtime/storage.cpp).
void meta_account(int64_t delta_bytes);
}  // namespace detail

}  // namespace tessera
