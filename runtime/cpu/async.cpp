// The asynchronous CPU test device: the CPU's kernels, queued on streams that
// each run on a worker thread. Its memory is host memory, but nothing outside
// the kernels may touch it (Device::is_host_visible is false), so it behaves as
// a GPU would: work runs after the call returns, streams overlap, and only
// events and waits order them. Random delays (set_async_delays) widen every
// race, so a missing wait shows up as a wrong number.
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <tuple>
#include <vector>

#include "runtime/async_cpu.h"
#include "runtime/cpu/kernels_cpu.h"

namespace tessera::async_cpu {

namespace {

std::atomic<int> delay_us{[] {
  const char* v = std::getenv("TESSERA_ASYNC_DELAYS");
  return v ? std::max(0, std::atoi(v)) : 0;
}()};

// What a stream and its worker thread share. The thread owns a reference, so
// a stream whose own queued work drops its last reference (its destructor then
// runs on the worker) is torn down without the worker touching freed memory.
struct WorkQueue {
  struct Task {
    const char* what;
    std::function<void()> fn;
  };
  std::mutex mu;
  std::condition_variable work_cv, done_cv;
  std::deque<Task> tasks;
  uint64_t enqueued = 0, completed = 0;
  bool stop = false;
  std::string error;  // the first deferred error since the last synchronize
};

// Runs `q`'s tasks in order until the stream is gone and the queue is empty.
void run_worker(const std::shared_ptr<WorkQueue>& q, uint64_t stream_id) {
  std::minstd_rand rng(static_cast<uint32_t>(stream_id));
  for (;;) {
    WorkQueue::Task task;
    {
      std::unique_lock<std::mutex> lk(q->mu);
      q->work_cv.wait(lk, [&] { return q->stop || !q->tasks.empty(); });
      if (q->tasks.empty()) return;
      task = std::move(q->tasks.front());
      q->tasks.pop_front();
    }
    if (int d = delay_us.load(std::memory_order_relaxed); d > 0)
      std::this_thread::sleep_for(std::chrono::microseconds(std::uniform_int_distribution<int>(0, d)(rng)));
    std::string error;
    try {
      task.fn();
    } catch (const std::exception& e) {
      error = fmt::format("{} (raised by the asynchronous kernel '{}' on async_cpu stream {})", e.what(),
                          task.what, stream_id);
    }
    task.fn = nullptr;  // release what the work held (perhaps this stream) before it counts as done
    {
      std::lock_guard<std::mutex> lk(q->mu);
      if (!error.empty() && q->error.empty()) q->error = std::move(error);
      ++q->completed;
    }
    q->done_cv.notify_all();
  }
}

class AsyncStream final : public Stream {
 public:
  AsyncStream() : thread_([q = q_, id = id()] { run_worker(q, id); }) {}

  // Lets the queued work finish: joins the worker, or (when the last reference
  // went inside this stream's own work) leaves it to finish the queue alone.
  ~AsyncStream() override {
    {
      std::lock_guard<std::mutex> lk(q_->mu);
      q_->stop = true;
    }
    q_->work_cv.notify_one();
    if (thread_.get_id() == std::this_thread::get_id()) thread_.detach();
    else thread_.join();
  }

  Device device() const override { return Device::async_cpu(); }
  bool synchronous() const override { return false; }

  // As a GPU's launch queue, a stream holds a bounded number of kernels: the
  // host blocks when it runs that far ahead (and memory held by queued work stays bounded).
  static constexpr size_t kMaxQueued = 1024;

  void enqueue(const char* what, std::function<void()> fn) override {
    {
      std::unique_lock<std::mutex> lk(q_->mu);
      if (q_->tasks.size() >= kMaxQueued && std::this_thread::get_id() != thread_.get_id())
        q_->done_cv.wait(lk, [&] { return q_->tasks.size() < kMaxQueued; });
      q_->tasks.push_back({what, std::move(fn)});
      ++q_->enqueued;
    }
    q_->work_cv.notify_one();
  }

  void synchronize() override {
    std::unique_lock<std::mutex> lk(q_->mu);
    uint64_t target = q_->enqueued;
    detail::count_host_sync();  // counted whether or not it had to wait: counts stay deterministic
    q_->done_cv.wait(lk, [&] { return q_->completed >= target; });
    if (!q_->error.empty()) {
      std::string e = std::move(q_->error);
      q_->error.clear();
      lk.unlock();
      detail::throw_error(e);
    }
  }

  bool query() override {
    std::lock_guard<std::mutex> lk(q_->mu);
    return q_->completed == q_->enqueued;
  }

  // The position an event recorded now stands for, and waiting for one.
  uint64_t position() {
    std::lock_guard<std::mutex> lk(q_->mu);
    return q_->enqueued;
  }
  bool reached(uint64_t position) {
    std::lock_guard<std::mutex> lk(q_->mu);
    return q_->completed >= position;
  }
  void wait_until(uint64_t position) {
    std::unique_lock<std::mutex> lk(q_->mu);
    q_->done_cv.wait(lk, [&] { return q_->completed >= position; });
  }

 private:
  std::shared_ptr<WorkQueue> q_ = std::make_shared<WorkQueue>();
  std::thread thread_;
};

class AsyncEvent final : public Event {
 public:
  void record(Stream& stream) override {
    auto* s = dynamic_cast<AsyncStream*>(&stream);
    TS_CHECK(s != nullptr, "an async_cpu event cannot be recorded on a {} stream", stream.device().str());
    std::lock_guard<std::mutex> lk(mu_);
    stream_ = std::static_pointer_cast<AsyncStream>(s->shared_from_this());
    position_ = s->position();
  }
  bool query() const override {
    auto [s, pos] = point();
    return s == nullptr || s->reached(pos);
  }
  void synchronize() override {
    auto [s, pos] = point();
    detail::count_host_sync();
    if (s != nullptr) s->wait_until(pos);
  }
  void wait(Stream& stream) override {
    TS_CHECK(!stream.synchronous() && stream.device().type == DeviceType::AsyncCPU,
             "a {} stream cannot wait on an async_cpu event", stream.device().str());
    auto [s, pos] = point();
    if (s == nullptr || s.get() == &stream) return;  // stream order already implies it
    std::weak_ptr<AsyncStream> weak = s;
    stream.enqueue("wait_event", [weak, pos] {
      if (auto src = weak.lock()) src->wait_until(pos);  // a stream that is gone has drained
    });
  }

 private:
  std::pair<std::shared_ptr<AsyncStream>, uint64_t> point() const {
    std::lock_guard<std::mutex> lk(mu_);
    return {stream_.lock(), position_};
  }
  mutable std::mutex mu_;
  std::weak_ptr<AsyncStream> stream_;  // unset: never recorded (complete)
  uint64_t position_ = 0;
};

std::mutex& registry_mu() {
  static auto* mu = new std::mutex;
  return *mu;
}
std::vector<std::weak_ptr<AsyncStream>>& registry() {
  static auto* streams = new std::vector<std::weak_ptr<AsyncStream>>;
  return *streams;
}

std::shared_ptr<AsyncStream> make_stream() {
  auto s = std::make_shared<AsyncStream>();
  std::lock_guard<std::mutex> lk(registry_mu());
  auto& r = registry();
  std::erase_if(r, [](const auto& w) { return w.expired(); });
  r.push_back(s);
  return s;
}

// A host (Device::cpu) view of an async_cpu tensor's bytes that does not own
// them: queued work does not keep memory alive, exactly as on a GPU.
Tensor borrow(const Tensor& t) {
  if (!t.defined()) return t;
  t.data_ptr();  // the same errors as any access: meta, subclass, released storage
  auto bytes = Storage::borrow(t.storage()->data(), t.storage()->nbytes(), Device::cpu());
  return make_tensor(std::move(bytes), t.shape(), t.strides(), t.storage_offset(), t.dtype());
}
ops::NormResult borrow(const ops::NormResult& r) { return {borrow(r.y), borrow(r.mean), borrow(r.rstd)}; }
ops::NormGrads borrow(const ops::NormGrads& g) { return {borrow(g.dx), borrow(g.dweight), borrow(g.dbias)}; }
ops::AttentionResult borrow(const ops::AttentionResult& r) { return {borrow(r.out), borrow(r.lse)}; }
ops::AttentionGrads borrow(const ops::AttentionGrads& g) { return {borrow(g.dq), borrow(g.dk), borrow(g.dv)}; }
std::vector<Tensor> borrow(const std::vector<Tensor>& ts) {
  std::vector<Tensor> out;
  out.reserve(ts.size());
  for (const Tensor& t : ts) out.push_back(borrow(t));
  return out;
}
template <class T>
T borrow(const T& value) {
  return value;
}

// Queued<&KernelTable::f, op>::run has f's signature and queues the CPU's f
// (of the instruction set in use when it runs) on the current stream.
template <auto Entry, OpId Op>
struct Queued;
template <class... A, void (*KernelTable::*Entry)(A...), OpId Op>
struct Queued<Entry, Op> {
  static void run(A... a) {
    current_stream(Device::async_cpu())
        .enqueue(op_name(Op), [args = std::make_tuple(borrow(a)...)] { std::apply(cpu::table().*Entry, args); });
  }
};

// Copies with the host: the host tensor is owned by the work (kept alive).
void copy_from_host(const Tensor& dst, const Tensor& src) {
  current_stream(Device::async_cpu()).enqueue("copy_from_host", [d = borrow(dst), src] { cpu::table().copy(d, src); });
}
void copy_to_host(const Tensor& dst, const Tensor& src) {
  current_stream(Device::async_cpu()).enqueue("copy_to_host", [dst, s = borrow(src)] { cpu::table().copy(dst, s); });
}

// Every kernel of runtime/op_list.h queued, the copies with the host as above.
constexpr KernelTable make_table() {
  KernelTable t;
  t.backend = "async_cpu";
  t.compute_dtype = cpu::compute_dtype;  // as the CPU
  t.strided_attention = true;            // the CPU's kernels run them
  t.sums_widen = true;
#define TS_QUEUED(name, family, compute, params) t.name = &Queued<&KernelTable::name, OpId::name>::run;
#define TS_NONE(name, family)
  TESSERA_OPS(TS_QUEUED, TS_QUEUED, TS_NONE)
#undef TS_QUEUED
#undef TS_NONE
  t.copy_from_host = copy_from_host;
  t.copy_to_host = copy_to_host;
  return t;
}

}  // namespace

constinit const KernelTable kTable = make_table();

Stream& default_stream() {
  // Never destroyed: tensors in static objects may queue work after main returns.
  static auto* stream = new std::shared_ptr<AsyncStream>(make_stream());
  return **stream;
}

StreamPtr new_stream() { return make_stream(); }

std::shared_ptr<Event> make_event() { return std::make_shared<AsyncEvent>(); }

void synchronize_all() {
  std::vector<std::shared_ptr<AsyncStream>> live;
  {
    std::lock_guard<std::mutex> lk(registry_mu());
    for (auto& w : registry())
      if (auto s = w.lock()) live.push_back(std::move(s));
  }
  for (auto& s : live) s->synchronize();
}

void set_delays(int max_us) { delay_us.store(max_us); }
int delays() { return delay_us.load(); }

}  // namespace tessera::async_cpu
