// The CUDA device: which GPU this process uses, streams and events on
// cudaStream_t / cudaEvent_t, the caching allocator on cudaMalloc, pinned
// host buffers for copies, and the device-side error slot.
#include <fmt/format.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/allocator.h"
#include "runtime/cuda/common.h"
#include "runtime/cuda/diagnose.h"
#include "runtime/cuda/pinned.h"
#include "runtime/cuda_backend.h"

namespace tessera::cuda {

void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line) {
  throw Error(fmt::format("CUDA error {} ({}) in {} at {}:{}", cudaGetErrorName(err),
                          cudaGetErrorString(err), call, file, line));
}

void throw_cublas_error(cublasStatus_t status, const char* call, const char* file, int line) {
  throw Error(fmt::format("cuBLAS error {} in {} at {}:{}", static_cast<int>(status), call, file, line));
}

void check_launch(const char* kernel) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw Error(fmt::format("CUDA kernel '{}' failed to launch: {} ({})", kernel, cudaGetErrorName(err),
                            cudaGetErrorString(err)));
}

void check_queued(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw Error(fmt::format("CUDA: {} failed: {} ({})", what, cudaGetErrorName(err), cudaGetErrorString(err)));
}

namespace {

std::mutex device_mu;
int the_device = -1;

}  // namespace

bool built() { return true; }

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: not an error for the caller
    return 0;
  }
  return n;
}

bool is_available() { return device_count() > 0; }

namespace {
CountResult count_result(int& count, std::string& error) {
  count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  cudaGetLastError();
  error = err == cudaSuccess ? "" : fmt::format("{} ({})", cudaGetErrorName(err), cudaGetErrorString(err));
  switch (err) {
    case cudaSuccess: return CountResult::Ok;
    case cudaErrorInsufficientDriver: {
      int driver = 0;
      cudaDriverGetVersion(&driver);
      return driver == 0 ? CountResult::NoDriver : CountResult::InsufficientDriver;
    }
    case cudaErrorNoDevice: return CountResult::NoDevice;
    default: return CountResult::Other;
  }
}
}  // namespace

std::string unavailable_reason() {
  int count = 0, driver = 0, runtime = 0;
  std::string error;
  CountResult r = count_result(count, error);
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  cudaGetLastError();
  return cuda::unavailable_reason(r, count, driver, runtime, std::getenv("CUDA_VISIBLE_DEVICES"), error);
}

bool install_is_broken() {
  int count = 0;
  std::string error;
  return is_broken_install(count_result(count, error));
}

std::string device_name(int index) {
  cudaDeviceProp prop{};
  TS_CUDA_CHECK(cudaGetDeviceProperties(&prop, index));
  return prop.name;
}

double free_memory(int index) {
  use_device(index);
  size_t free = 0, total = 0;
  TS_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return static_cast<double>(free);
}

int process_device() {
  std::lock_guard<std::mutex> lk(device_mu);
  return the_device;
}

void use_device(int index) {
  thread_local int current = -1;
  if (current == index) return;
  {
    std::lock_guard<std::mutex> lk(device_mu);
    if (the_device < 0) {
      int n = device_count();
      TS_CHECK(n > 0, "cuda:{}: {}", index, unavailable_reason());
      TS_CHECK(index >= 0 && index < n, "cuda:{}: this machine has {} CUDA device(s)", index, n);
      the_device = index;
    }
    TS_CHECK(index == the_device,
             "cuda:{}: this process already uses cuda:{}; Tessera runs one GPU per process "
             "(one rank per GPU)", index, the_device);
  }
  TS_CUDA_CHECK(cudaSetDevice(index));
  current = index;
}

// ---- streams and events --------------------------------------------------------

namespace {

class CudaStream final : public Stream {
 public:
  explicit CudaStream(int index) : index_(index) {
    use_device(index);
    TS_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  ~CudaStream() override {
    // Its queued work finishes first: the caching allocator hands the blocks
    // freed on a stream that is gone to any stream at once (runtime/allocator.h),
    // which is only safe once no kernel of this one can still touch them.
    use_device(index_);
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }

  Device device() const override { return Device::cuda(index_); }
  bool synchronous() const override { return false; }
  cudaStream_t raw() const { return stream_; }

  // Host work in stream order (cudaLaunchHostFunc). Neither the work nor the
  // destruction of what it captures may call CUDA (so it must not hold the last
  // reference to a CUDA tensor or stream); an exception it throws is raised at
  // the next synchronize.
  void enqueue(const char* what, std::function<void()> fn) override {
    use_device(index_);
    auto* task = new HostTask{what, std::move(fn), errors_, id()};
    cudaError_t err = cudaLaunchHostFunc(stream_, &CudaStream::run_host_task, task);
    if (err != cudaSuccess) {
      delete task;
      throw_cuda_error(err, "cudaLaunchHostFunc", __FILE__, __LINE__);
    }
  }

  void synchronize() override {
    use_device(index_);
    detail::count_host_sync();
    TS_CUDA_CHECK(cudaStreamSynchronize(stream_));
    raise_host_error();
    raise_device_error();
  }

  bool query() override {
    cudaError_t err = cudaStreamQuery(stream_);
    if (err == cudaErrorNotReady) {
      cudaGetLastError();
      return false;
    }
    TS_CUDA_CHECK(err);
    return true;
  }

 private:
  // The first error host work raised since the last synchronize.
  struct Errors {
    std::mutex mu;
    std::string first;
  };
  struct HostTask {
    const char* what;
    std::function<void()> fn;
    std::shared_ptr<Errors> errors;
    uint64_t stream_id;
  };

  static void CUDART_CB run_host_task(void* p) {
    auto* task = static_cast<HostTask*>(p);
    try {
      task->fn();
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lk(task->errors->mu);
      if (task->errors->first.empty())
        task->errors->first = fmt::format("{} (raised by host work '{}' on CUDA stream {})", e.what(),
                                          task->what, task->stream_id);
    }
    delete task;
  }

  void raise_host_error() {
    std::string e;
    {
      std::lock_guard<std::mutex> lk(errors_->mu);
      e.swap(errors_->first);
    }
    if (!e.empty()) detail::throw_error(e);
  }

  int index_;
  cudaStream_t stream_ = nullptr;
  std::shared_ptr<Errors> errors_ = std::make_shared<Errors>();
};

class CudaEvent final : public Event {
 public:
  explicit CudaEvent(int index) : index_(index) {
    use_device(index);
    TS_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
  }
  ~CudaEvent() override { cudaEventDestroy(event_); }

  void record(Stream& stream) override {
    TS_CHECK(stream.device().is_cuda(), "a CUDA event cannot be recorded on a {} stream",
             stream.device().str());
    TS_CUDA_CHECK(cudaEventRecord(event_, raw_stream(stream)));
    recorded_ = true;
  }
  bool query() const override {
    if (!recorded_) return true;
    cudaError_t err = cudaEventQuery(event_);
    if (err == cudaErrorNotReady) {
      cudaGetLastError();
      return false;
    }
    TS_CUDA_CHECK(err);
    return true;
  }
  void synchronize() override {
    detail::count_host_sync();
    if (recorded_) TS_CUDA_CHECK(cudaEventSynchronize(event_));
  }
  void wait(Stream& stream) override {
    TS_CHECK(stream.device().is_cuda(), "a {} stream cannot wait on a CUDA event", stream.device().str());
    if (recorded_) TS_CUDA_CHECK(cudaStreamWaitEvent(raw_stream(stream), event_, 0));
  }

 private:
  int index_;
  cudaEvent_t event_ = nullptr;
  bool recorded_ = false;
};

}  // namespace

cudaStream_t raw_stream(Stream& stream) {
  auto* s = dynamic_cast<CudaStream*>(&stream);
  TS_CHECK(s != nullptr, "expected a CUDA stream, got one of {}", stream.device().str());
  return s->raw();
}

cudaStream_t current_raw_stream() {
  int index = process_device();
  TS_CHECK(index >= 0, "no CUDA device is in use in this process yet");
  return raw_stream(current_stream(Device::cuda(index)));
}

Stream& default_stream(int index) {
  use_device(index);
  static auto* stream = new std::shared_ptr<Stream>(std::make_shared<CudaStream>(index));  // never destroyed
  return **stream;
}

StreamPtr new_stream(int index) { return std::make_shared<CudaStream>(index); }

std::shared_ptr<Event> make_event(int index) { return std::make_shared<CudaEvent>(index); }

void synchronize(int index) {
  use_device(index);
  detail::count_host_sync();
  TS_CUDA_CHECK(cudaDeviceSynchronize());
  raise_device_error();
}

// ---- device errors -----------------------------------------------------------

namespace {
// Mapped pinned memory: kernels write through its device address, the host
// reads it after a sync without a copy.
DeviceError* host_error_slot() {
  static DeviceError* slot = [] {
    void* p = nullptr;
    TS_CUDA_CHECK(cudaHostAlloc(&p, sizeof(DeviceError), cudaHostAllocMapped));
    *static_cast<DeviceError*>(p) = {};
    return static_cast<DeviceError*>(p);
  }();
  return slot;
}

const char* kernel_name(int id) {
  switch (static_cast<KernelId>(id)) {
    case KernelId::Embedding: return "embedding";
    case KernelId::EmbeddingBackward: return "embedding_backward";
    case KernelId::CrossEntropy: return "cross_entropy";
    case KernelId::CrossEntropyBackward: return "cross_entropy_backward";
    case KernelId::None: break;
  }
  return "a kernel";
}
}  // namespace

DeviceError* device_error_slot() {
  void* d = nullptr;
  TS_CUDA_CHECK(cudaHostGetDevicePointer(&d, host_error_slot(), 0));
  return static_cast<DeviceError*>(d);
}

void raise_device_error() {
  DeviceError* e = host_error_slot();
  if (e->code == 0) return;
  DeviceError seen = *e;
  *e = {};
  const char* what = seen.kernel == static_cast<int>(KernelId::CrossEntropy) ? "target" : "index";
  detail::throw_error(fmt::format("{}: {} {} is out of range for {} {} (found on the GPU)",
                                  kernel_name(seen.kernel), what, seen.value, seen.limit,
                                  seen.kernel == static_cast<int>(KernelId::CrossEntropy) ? "classes" : "rows"));
}

// ---- memory --------------------------------------------------------------------

namespace {

class CudaAllocator final : public CachingAllocator {
 public:
  explicit CudaAllocator(int index) : CachingAllocator(Device::cuda(index)), index_(index) {}

 protected:
  void* system_allocate(size_t nbytes) override {
    use_device(index_);
    void* p = nullptr;
    cudaError_t err = cudaMalloc(&p, nbytes);
    if (err == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      return nullptr;  // the caching allocator frees its cache and retries, then raises
    }
    TS_CUDA_CHECK(err);
    return p;
  }
  void system_free(void* ptr) override {
    use_device(index_);
    TS_CUDA_CHECK(cudaFree(ptr));
  }

 private:
  int index_;
};

}  // namespace

Allocator& allocator(int index) {
  use_device(index);
  static auto* alloc = new CudaAllocator(index);  // never destroyed (see allocator_for)
  return *alloc;
}

PinnedBuffer pinned_buffer(size_t nbytes) {
  static std::mutex mu;
  static auto* free_blocks = new std::multimap<size_t, void*>;
  size_t size = (nbytes + 4095) / 4096 * 4096;
  void* p = nullptr;
  {
    std::lock_guard<std::mutex> lk(mu);
    auto it = free_blocks->lower_bound(size);
    if (it != free_blocks->end() && it->first <= size + size / 8) {
      size = it->first;
      p = it->second;
      free_blocks->erase(it);
    }
  }
  if (p == nullptr && size > 0) TS_CUDA_CHECK(cudaHostAlloc(&p, size, cudaHostAllocDefault));
  return PinnedBuffer(p, [size](void* q) {
    if (q == nullptr) return;
    std::lock_guard<std::mutex> lk(mu);
    free_blocks->emplace(size, q);  // reused by the next copy of about this size
  });
}

cublasLtHandle_t cublaslt_handle() {
  static cublasLtHandle_t handle = [] {
    cublasLtHandle_t h = nullptr;
    TS_CUBLAS_CHECK(cublasLtCreate(&h));
    return h;
  }();
  return handle;
}

}  // namespace tessera::cuda
