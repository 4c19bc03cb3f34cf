#include "runtime/allocator.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <iterator>
#include <new>
#include <string>

#include <sys/mman.h>

#include "runtime/check.h"
#include "runtime/cuda_backend.h"
#include "runtime/stream.h"
#include "runtime/trace.h"

namespace tessera {

namespace {

size_t round_up(size_t nbytes, size_t unit = CachingAllocator::kRound) {
  return (nbytes + unit - 1) / unit * unit;
}

void update_peaks(MemoryStats& s) {
  s.peak_allocated_bytes = std::max(s.peak_allocated_bytes, s.allocated_bytes);
  s.peak_reserved_bytes = std::max(s.peak_reserved_bytes, s.reserved_bytes);
}

}  // namespace

size_t CachingAllocator::block_size(size_t nbytes) const {
  return round_up(nbytes);
}

void* CachingAllocator::take_cached(size_t size, const std::shared_ptr<Stream>& stream) {
  // Best fit among the blocks of this stream (and of synchronous streams,
  // whose work is always done): stream order makes them safe at once, and
  // pools that never trade blocks stay the same size step after step. Among
  // equal sizes the most recently freed first: its bytes are likely still in cache.
  auto usable = [&](const Block& b) { return b.stream == stream->id() || b.freed == nullptr; };
  for (auto size_it = cached_.lower_bound(size); size_it != cached_.end() && size_it->first - size <= size / 8;
       size_it = cached_.upper_bound(size_it->first)) {
    auto [first, last] = cached_.equal_range(size_it->first);  // newest last
    auto it = std::find_if(std::make_reverse_iterator(last), std::make_reverse_iterator(first),
                           [&](const auto& entry) { return usable(entry.second); });
    if (it == std::make_reverse_iterator(first)) continue;
    auto found = std::prev(it.base());
    Block taken = std::move(found->second);
    cached_.erase(found);
    void* p = taken.ptr;
    taken.stream = stream->id();
    taken.owner = stream;
    if (taken.freed) spare_events_.push_back(std::move(taken.freed));  // the same stream: stream order suffices
    live_.emplace(p, std::move(taken));
    return p;
  }
  return nullptr;
}

void* CachingAllocator::allocate(size_t nbytes) {
  if (nbytes == 0) return nullptr;
  const size_t size = block_size(nbytes);
  std::shared_ptr<Stream> stream = current_stream(device_).shared_from_this();
  std::lock_guard<std::mutex> lock(mu_);
  void* p = take_cached(size, stream);
  if (p == nullptr) {
    p = system_allocate(size);
    if (p == nullptr) {  // give the whole cache back (waiting for its streams) and try once more
      release_cached(/*wait=*/true);
      p = system_allocate(size);
    }
    TS_CHECK(p != nullptr,
             "out of memory on {} allocating {} bytes ({} bytes allocated in tensors, {} reserved "
             "by the allocator)",
             device_.str(), nbytes, stats_.allocated_bytes, stats_.reserved_bytes);
    live_.emplace(p, Block{p, size, 0, stream->id(), stream, nullptr});
    stats_.reserved_bytes += static_cast<int64_t>(size);
    stats_.num_system_allocs++;
  }
  live_.at(p).requested = nbytes;
  stats_.allocated_bytes += static_cast<int64_t>(nbytes);
  stats_.num_allocs++;
  update_peaks(stats_);
  if (trace::detail::g_enabled.load(std::memory_order_relaxed))
    trace::memory_sample(device_.str(), static_cast<double>(stats_.allocated_bytes));
  return p;
}

void CachingAllocator::deallocate(void* ptr) {
  if (ptr == nullptr) return;
  Block b;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.find(ptr);
    TS_ASSERT(it != live_.end());
    b = std::move(it->second);
    live_.erase(it);
    stats_.allocated_bytes -= static_cast<int64_t>(b.requested);
    stats_.num_frees++;
    if (trace::detail::g_enabled.load(std::memory_order_relaxed))
      trace::memory_sample(device_.str(), static_cast<double>(stats_.allocated_bytes));
  }
  // Other streams may take the block once the work queued on its stream so far
  // is done; on a synchronous stream that is now. The event comes from the
  // pool when it has one (recorded again: the previous use is over).
  if (auto owner = b.owner.lock(); owner && !owner->synchronous()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!spare_events_.empty()) {
        b.freed = std::move(spare_events_.back());
        spare_events_.pop_back();
      } else {
        stats_.num_events++;
      }
    }
    if (!b.freed) b.freed = make_event(device_);
    b.freed->record(*owner);
  }
  std::lock_guard<std::mutex> lock(mu_);
  cached_.emplace(b.size, std::move(b));
}

MemoryStats CachingAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void CachingAllocator::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.peak_allocated_bytes = stats_.allocated_bytes;
  stats_.peak_reserved_bytes = stats_.reserved_bytes;
}

void CachingAllocator::release_cached(bool wait) {
  for (auto it = cached_.begin(); it != cached_.end();) {
    Block& b = it->second;
    if (b.freed && !b.freed->query()) {
      if (!wait) {
        ++it;
        continue;
      }
      b.freed->synchronize();
    }
    system_free(b.ptr);
    if (b.freed) spare_events_.push_back(std::move(b.freed));
    stats_.reserved_bytes -= static_cast<int64_t>(b.size);
    stats_.num_system_frees++;
    it = cached_.erase(it);
  }
}

void CachingAllocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mu_);
  release_cached(/*wait=*/false);
}

namespace {

// 64-byte aligned host memory (one cache line, one AVX-512 vector), large
// blocks in whole huge pages (host_huge_pages); also the memory of the
// asynchronous CPU test device.
class HostAllocator final : public CachingAllocator {
 public:
  using CachingAllocator::CachingAllocator;

 protected:
  static bool huge(size_t nbytes) { return nbytes >= kHugePage && host_huge_pages(); }
  size_t block_size(size_t nbytes) const override {
    return huge(nbytes) ? round_up(nbytes, kHugePage) : CachingAllocator::block_size(nbytes);
  }
  void* system_allocate(size_t nbytes) override {  // nbytes: a block_size
    if (!huge(nbytes)) return std::aligned_alloc(64, nbytes);
    void* p = nullptr;
    if (posix_memalign(&p, kHugePage, nbytes) != 0) return nullptr;
    madvise(p, nbytes, MADV_HUGEPAGE);  // advice: where Linux declines it, 4 KiB pages as before
    return p;
  }
  void system_free(void* ptr) override { std::free(ptr); }
};

}  // namespace

bool host_huge_pages() {
  static const bool on = [] {
    const char* v = std::getenv("TESSERA_HUGE_PAGES");
    if (v == nullptr || *v == '\0') return true;
    const std::string s(v);
    TS_CHECK(s == "0" || s == "1", "TESSERA_HUGE_PAGES: expected 0 or 1, got '{}'", s);
    return s == "1";
  }();
  return on;
}

Allocator& allocator_for(Device device) {
  // Never destroyed: tensors in static objects are freed after main returns.
  static auto* cpu = new HostAllocator(Device::cpu());
  static auto* async_cpu = new HostAllocator(Device::async_cpu());
  if (device.is_cpu()) return *cpu;
  if (device.type == DeviceType::AsyncCPU) return *async_cpu;
  if (device.is_cuda()) return cuda::allocator(device.index);
  TS_CHECK(false, "no allocator for device {}", device.str());
}

namespace {
std::mutex meta_mu;
MemoryStats meta_stats;
std::atomic<bool> meta_active{false};  // read for every meta storage: no lock
}  // namespace

MetaAccounting::MetaAccounting() {
  std::lock_guard<std::mutex> lock(meta_mu);
  TS_CHECK(!meta_active, "MetaAccounting: an accounting is already active");
  meta_active = true;
  meta_stats = {};
}

MetaAccounting::~MetaAccounting() {
  std::lock_guard<std::mutex> lock(meta_mu);
  meta_active = false;
}

bool meta_accounting_active() { return meta_active.load(std::memory_order_relaxed); }

namespace detail {
void meta_account(int64_t delta_bytes) {
  {
    std::lock_guard<std::mutex> lock(meta_mu);
    meta_stats.allocated_bytes += delta_bytes;
    (delta_bytes >= 0 ? meta_stats.num_allocs : meta_stats.num_frees)++;
    meta_stats.reserved_bytes = meta_stats.allocated_bytes;
    update_peaks(meta_stats);
  }
}
}  // namespace detail

MemoryStats memory_stats(Device device) {
  if (device.is_meta()) {
    std::lock_guard<std::mutex> lock(meta_mu);
    return meta_stats;
  }
  return allocator_for(device).stats();
}

void reset_peak_memory_stats(Device device) {
  if (device.is_meta()) {
    std::lock_guard<std::mutex> lock(meta_mu);
    meta_stats.peak_allocated_bytes = meta_stats.allocated_bytes;
    meta_stats.peak_reserved_bytes = meta_stats.reserved_bytes;
    return;
  }
  allocator_for(device).reset_peak();
}

void empty_cache(Device device) {
  if (!device.is_meta()) allocator_for(device).empty_cache();
}

std::string Device::str() const {
  switch (type) {
    case DeviceType::CPU: return "cpu";
    case DeviceType::Meta: return "meta";
    case DeviceType::CUDA: return "cuda:" + std::to_string(index);
    case DeviceType::AsyncCPU: return "async_cpu";
  }
  return "?";
}

Device Device::parse(const std::string& name) {
  if (name == "cpu") return cpu();
  if (name == "meta") return meta();
  if (name == "async_cpu") return async_cpu();
  if (name == "cuda") return cuda(0);
  if (name.rfind("cuda:", 0) == 0) {
    try {
      return cuda(std::stoi(name.substr(5)));
    } catch (const std::exception&) {
    }
  }
  TS_CHECK(false, "unknown device '{}' (expected cpu, meta, cuda, cuda:N or async_cpu)", name);
}

}  // namespace tessera
