// The device contract on the asynchronous CPU test device: every op queued on
// worker-thread streams equals the synchronous CPU bit for bit (with random
// delays on), copies between devices, host-visibility, streams, events,
// deferred kernel errors, host-sync counts and the stream-aware caching
// allocator.
#include <fmt/format.h>

#include <cstdlib>
#include <string>
#include <thread>

#include "../helpers.h"
#include "autograd/functions.h"
#include "autograd/tape.h"
#include "runtime/allocator.h"
#include "runtime/cpu/blas.h"
#include "runtime/kernels.h"
#include "runtime/stream.h"

using namespace tessera;

namespace {

const Device kAsync = Device::async_cpu();

// Turns random kernel delays on for a scope.
struct Delays {
  int saved = async_delays();
  explicit Delays(int us) { set_async_delays(us); }
  ~Delays() { set_async_delays(saved); }
};

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  auto va = a.to_vector<double>(), vb = b.to_vector<double>();
  for (size_t i = 0; i < va.size(); ++i)
    if (!(va[i] == vb[i] || (std::isnan(va[i]) && std::isnan(vb[i])))) return false;
  return true;
}

// One forward and backward of a small attention + MLP block with every kind of
// kernel, on `device`; returns the loss and every gradient.
std::vector<Tensor> block_step(Device device, DType dtype) {
  const int64_t B = 2, T = 17, H = 3, D = 8, C = H * D, V = 29;
  auto param = [&](Shape shape, uint64_t seed) {
    Tensor p = ops::to(ops::mul(randn(shape, seed, DType::F32, device), 0.2), dtype);
    p.set_requires_grad(true);
    return p;
  };
  Tensor wte = param({V, C}, 1), wq = param({C, C}, 2), wk = param({C, C}, 3), wv = param({C, C}, 4);
  Tensor ln_w = param({C}, 5), ln_b = param({C}, 6), w1 = param({2 * C + 3, C}, 7), w2 = param({V, 2 * C + 3}, 8);
  Tensor idx = randint({B, T}, 0, V, 9, device);
  Tensor target = randint({B * T}, 0, V, 10, device);
  Tensor x = embedding(wte, idx);
  Tensor h = layer_norm(x, ln_w, ln_b, 1e-5);
  auto heads = [&](const Tensor& w) { return transpose(reshape(linear(h, w), {B, T, H, D}), 1, 2); };
  Tensor a = scaled_dot_product_attention(heads(wq), heads(wk), heads(wv), /*causal=*/true);
  x = add(x, reshape(transpose(a, 1, 2), {B, T, C}));
  Tensor y = linear(gelu(linear(x, w1)), w2);
  Tensor loss = add(cross_entropy(reshape(y, {B * T, V}), target), mul(sum(square(softmax(y, -1))), 1e-3));
  autograd::backward(loss);
  std::vector<Tensor> out{loss};
  for (const Tensor& p : {wte, wq, wk, wv, ln_w, ln_b, w1, w2}) out.push_back(p.grad());
  return out;
}

}  // namespace

TEST_CASE("async_cpu: a forward and backward equals the synchronous CPU bit for bit", "[stream][async]") {
  Delays delays(30);
  for (DType dtype : {DType::F32, DType::BF16}) {
    auto cpu = block_step(Device::cpu(), dtype);
    auto dev = block_step(kAsync, dtype);
    REQUIRE(cpu.size() == dev.size());
    for (size_t i = 0; i < cpu.size(); ++i) {
      INFO("output " << i << " in " << dtype_name(dtype));
      CHECK(dev[i].device() == kAsync);
      CHECK(bitwise_equal(dev[i].to(Device::cpu()), cpu[i]));
    }
  }
}

TEST_CASE("async_cpu: the host cannot read its bytes without a copy", "[stream][async]") {
  Tensor x = randn({3, 5}, 4, DType::F32, kAsync);
  CHECK_FALSE(kAsync.is_host_visible());
  CHECK_THROWS_WITH(x.data<float>(), Catch::Contains("on async_cpu, whose memory the host cannot read") &&
                                         Catch::Contains("to(Device::cpu())"));
  Tensor h = x.to(Device::cpu());
  CHECK(h.device().is_cpu());
  CHECK(testing::equal(h, randn({3, 5}, 4)));
  CHECK(ops::select(ops::select(x, 0, 2), 0, 4).item() == h.to_vector<float>()[14]);
  CHECK(Device::parse("async_cpu") == kAsync);
}

TEST_CASE("copies between devices keep strides, dtypes and broadcasting", "[stream][async]") {
  Delays delays(20);
  Tensor src = randn({7, 9}, 11);
  Tensor t = ops::transpose(src, 0, 1);  // strided source
  Tensor on_dev = empty({9, 7}, DType::BF16, kAsync);
  ops::copy_(on_dev, t);  // host -> device, converting
  Tensor back = empty({9, 7}, DType::F64);
  ops::copy_(back, on_dev);  // device -> host, converting, waits
  CHECK(testing::equal(back, ops::to(ops::to(t, DType::BF16), DType::F64)));
  Tensor row = from_vector(std::vector<float>{1, 2, 3}, {3});
  Tensor dst = empty({4, 3}, DType::F32, kAsync);
  ops::copy_(dst, row);  // broadcast across devices
  CHECK(dst.to(Device::cpu()).to_vector<float>() == std::vector<float>{1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3});
  CHECK_THROWS_WITH(ops::add(dst, zeros({4, 3})), Catch::Contains("different devices (async_cpu and cpu)"));
}

TEST_CASE("a stream that reads another's output without waiting reads the wrong bytes", "[stream][async]") {
  if (testing::kThreadSanitizer) {
    WARN("races on purpose: not run under ThreadSanitizer");
    return;
  }
  Delays delays(200);
  StreamPtr producer = new_stream(kAsync), consumer = new_stream(kAsync);
  auto run = [&](bool wait) {
    Tensor x = zeros({1 << 12}, DType::F32, kAsync);
    Tensor y;
    {
      StreamGuard g(*producer);
      producer->wait_stream(default_stream(kAsync));  // x was zeroed there
      for (int i = 0; i < 8; ++i) ops::add_(x, 1.0);
    }
    {
      StreamGuard g(*consumer);
      if (wait) consumer->wait_stream(*producer);
      y = ops::mul(x, 2.0);
    }
    synchronize(kAsync);
    return y.to(Device::cpu()).to_vector<float>()[0];
  };
  for (int i = 0; i < 5; ++i) CHECK(run(true) == 16.0f);
  int wrong = 0;
  for (int i = 0; i < 5; ++i) wrong += run(false) != 16.0f;
  CHECK(wrong > 0);  // the race is real: the async device catches a missing wait
}

TEST_CASE("events order streams without blocking the host", "[stream][async]") {
  Delays delays(500);
  StreamPtr s = new_stream(kAsync);
  Tensor x = zeros({64}, DType::F32, kAsync);
  std::shared_ptr<Event> e;
  {
    StreamGuard g(*s);
    CHECK(&current_stream(kAsync) == s.get());
    s->wait_stream(default_stream(kAsync));  // x was zeroed there (without this wait: 19.5, seen)
    for (int i = 0; i < 20; ++i) ops::add_(x, 1.0);
    e = s->record_event();
  }
  CHECK(&current_stream(kAsync) == &default_stream(kAsync));  // the guard restored it
  CHECK_FALSE(e->query());  // 20 kernels of up to 0.5 ms each cannot be done yet
  current_stream(kAsync).wait_event(*e);
  Tensor y = ops::add(x, 0.5);
  CHECK(y.to(Device::cpu()).to_vector<float>()[63] == 20.5f);
  CHECK(e->query());
  auto cpu_event = make_event(Device::cpu());
  CHECK_THROWS_WITH(cpu_event->record(*s), Catch::Contains("cannot be recorded on a async_cpu stream"));
}

TEST_CASE("kernel errors on a stream are raised at the next sync, naming the kernel", "[stream][async]") {
  Tensor weight = randn({5, 3}, 1, DType::F32, kAsync);
  Tensor bad = from_vector(std::vector<int64_t>{0, 7, 2}, {3}, kAsync);
  Tensor out;
  REQUIRE_NOTHROW(out = ops::embedding(weight, bad));  // queued: nothing has run yet
  CHECK_THROWS_WITH(out.to(Device::cpu()), Catch::Contains("embedding") && Catch::Contains("7"));
  // The error is reported once; the stream keeps working.
  CHECK(ops::add(weight, 1.0).to(Device::cpu()).numel() == 15);
}

TEST_CASE("host syncs are counted: none while queuing, one per read", "[stream][async]") {
  Tensor a = randn({33, 17}, 1, DType::F32, kAsync), b = randn({17, 5}, 2, DType::F32, kAsync);
  int64_t before = host_sync_count();
  Tensor c = ops::matmul(a, b);
  Tensor l = ops::cross_entropy(c, from_vector(std::vector<int64_t>(33, 3), {33}, kAsync)).loss;
  for (int i = 0; i < 10; ++i) c = ops::add(ops::mul(c, 0.5), l);
  CHECK(host_sync_count() == before);
  double v = l.item();
  CHECK(std::isfinite(v));
  CHECK(host_sync_count() == before + 1);
  // The same on the CPU: a host read there needs no sync.
  int64_t cpu_before = host_sync_count();
  (void)randn({4}, 1).to_vector<float>();
  CHECK(host_sync_count() == cpu_before);
}

TEST_CASE("caching allocator: reuse without the system, stats, empty_cache", "[memory][stream]") {
  for (Device device : {Device::cpu(), kAsync}) {
    INFO(device.str());
    synchronize(device);
    empty_cache(device);
    MemoryStats s0 = memory_stats(device);
    { Tensor a = empty({1000}, DType::F32, device), b = empty({333}, DType::F64, device); }
    MemoryStats s1 = memory_stats(device);
    CHECK(s1.allocated_bytes == s0.allocated_bytes);
    CHECK(s1.reserved_bytes >= s0.reserved_bytes + 4000 + 2664);
    CHECK(s1.num_system_allocs == s0.num_system_allocs + 2);
    for (int i = 0; i < 50; ++i) {  // the same sizes again: served from the cache
      Tensor a = empty({1000}, DType::F32, device), b = empty({333}, DType::F64, device);
      CHECK(memory_stats(device).allocated_bytes == s0.allocated_bytes + 4000 + 2664);
    }
    MemoryStats s2 = memory_stats(device);
    CHECK(s2.num_system_allocs == s1.num_system_allocs);
    CHECK(s2.num_allocs == s1.num_allocs + 100);
    CHECK(s2.peak_allocated_bytes >= s0.allocated_bytes + 6664);
    CHECK(s2.peak_reserved_bytes >= s2.reserved_bytes);
    synchronize(device);
    empty_cache(device);
    CHECK(memory_stats(device).reserved_bytes <= s0.reserved_bytes);
    CHECK(memory_stats(device).num_system_frees >= s2.num_system_frees + 2);
  }
  CHECK_THROWS_WITH(empty({int64_t(1) << 58}, DType::F32),
                    Catch::Contains("out of memory on cpu") && Catch::Contains("reserved"));
}

TEST_CASE("large host blocks are whole huge pages, counted as reserved", "[memory][hugepages]") {
  // TESSERA_HUGE_PAGES decides for the process (the suite runs this case
  // with it unset and with 0): at 2 MiB or more a block is whole 2 MiB pages
  // on a 2 MiB boundary, the rounding reserved and not allocated; below, or
  // turned off, blocks are as before (kRound multiples on 64 bytes).
  const bool huge = host_huge_pages();
  const char* env = std::getenv("TESSERA_HUGE_PAGES");
  CHECK(huge == (env == nullptr || std::string(env) != "0"));
  empty_cache();
  const MemoryStats s0 = memory_stats();
  const int64_t big = (3 << 20) / 4 + 5;  // 3 MiB and 20 bytes of f32: 4 MiB of pages
  const int64_t big_bytes = 4 * big, big_block = huge ? 4 << 20 : (big_bytes + 511) / 512 * 512;
  {
    Tensor a = randn({big}, 41);
    auto at = reinterpret_cast<uintptr_t>(a.data<float>());
    CHECK(at % 64 == 0);
    CHECK((at % kHugePage == 0) == huge);  // malloc's large blocks start just past a header, never on 2 MiB
    const MemoryStats s1 = memory_stats();
    CHECK(s1.allocated_bytes == s0.allocated_bytes + big_bytes);
    CHECK(s1.reserved_bytes == s0.reserved_bytes + big_block);
    CHECK(s1.num_system_allocs == s0.num_system_allocs + 1);
    Tensor b = ops::mul(a, 3.0);  // the bytes are the tensor's: an op over all of them, checked against its input
    const float *pa = a.data<float>(), *pb = b.data<float>();
    int64_t wrong = 0;
    for (int64_t i = 0; i < big; ++i) wrong += pb[i] != pa[i] * 3.0f;
    CHECK(wrong == 0);
  }
  const MemoryStats s2 = memory_stats();
  {
    // 3.6 MiB: within the cached 4 MiB block's 1/8 when blocks are whole pages (the same block
    // again, no system call); a new block of its own otherwise.
    Tensor c = empty({(36 << 20) / 40}, DType::F32);
    CHECK(memory_stats().num_system_allocs == s2.num_system_allocs + (huge ? 0 : 1));
    // Below 2 MiB: a kRound multiple, as always.
    const MemoryStats s3 = memory_stats();
    Tensor d = empty({(1 << 20) / 4 + 3}, DType::F32);
    CHECK(memory_stats().reserved_bytes == s3.reserved_bytes + ((1 << 20) + 12 + 511) / 512 * 512);
  }
  empty_cache();
  CHECK(memory_stats().reserved_bytes == s0.reserved_bytes);
}

TEST_CASE("frees on an asynchronous stream reuse the allocator's events", "[memory][stream][async]") {
  // Each free on an asynchronous stream records an event (when may another
  // stream take the block?); the allocator keeps them for the next frees
  // instead of making and destroying one per free.
  StreamPtr s = new_stream(kAsync);
  StreamGuard g(*s);
  auto cycle = [&](int i) {
    Tensor x = empty({1024 + (i % 3) * 256}, DType::F32, kAsync);
    ops::fill_(x, 1.0);
  };
  for (int i = 0; i < 3; ++i) cycle(i);  // a block of each size, cached with its event
  const int64_t events = memory_stats(kAsync).num_events;
  CHECK(events > 0);
  for (int i = 0; i < 300; ++i) cycle(i);
  CHECK(memory_stats(kAsync).num_events == events);
  s->synchronize();
  empty_cache(kAsync);  // the released blocks' events go back to the pool too
  for (int i = 0; i < 3; ++i) cycle(i);
  CHECK(memory_stats(kAsync).num_events == events);
}

TEST_CASE("a block freed on one stream is reused by that stream only", "[memory][stream][async]") {
  Delays delays(2000);
  StreamPtr s1 = new_stream(kAsync), s2 = new_stream(kAsync);
  synchronize(kAsync);
  empty_cache(kAsync);
  void* freed_ptr;
  {
    StreamGuard g(*s1);
    Tensor x = empty({2048}, DType::F32, kAsync);
    for (int i = 0; i < 10; ++i) ops::fill_(x, 1.0);  // ~10 ms of queued work on s1
    freed_ptr = x.data_ptr();
  }  // freed on the host while s1 still uses it
  {
    StreamGuard g(*s1);  // the same stream takes it back at once: stream order protects it
    Tensor again = empty({2048}, DType::F32, kAsync);
    CHECK(again.data_ptr() == freed_ptr);
    for (int i = 0; i < 10; ++i) ops::fill_(again, 2.0);
  }
  {
    StreamGuard g(*s2);  // another stream does not
    Tensor other = empty({2048}, DType::F32, kAsync);
    CHECK(other.data_ptr() != freed_ptr);
  }
  // empty_cache keeps a block whose stream still uses it, and frees it once done.
  int64_t reserved = memory_stats(kAsync).reserved_bytes;
  empty_cache(kAsync);
  CHECK(memory_stats(kAsync).reserved_bytes >= reserved - 8192);  // s2's block went, s1's stayed
  s1->synchronize();
  empty_cache(kAsync);
  CHECK(memory_stats(kAsync).reserved_bytes <= reserved - 16384);
}

namespace {

// A backend whose elementwise and softmax kernels take bf16 natively (the
// async_cpu kernels, fed through f32 copies made inside the "kernel"), every
// other family computing in f32. Records the dtype each kernel received.
std::vector<std::string> received;

const KernelTable& base() { return async_cpu::kTable; }

DType native_bf16_compute_dtype(KernelFamily family, DType dtype) {
  if (dtype == DType::BF16 && (family == KernelFamily::Elementwise || family == KernelFamily::Softmax))
    return DType::BF16;
  return base().compute_dtype(family, dtype);
}

void note(const char* kernel, DType dtype) {
  received.push_back(fmt::format("{}:{}", kernel, dtype_name(dtype)));
}

Tensor f32(const Tensor& x) { return x.defined() ? ops::to(x, DType::F32) : x; }

void native_unary(ops::UnaryOp op, const Tensor& out, const Tensor& x) {
  note("unary", x.dtype());
  Tensor o = empty(out.shape(), DType::F32, out.device());
  base().unary(op, o, f32(x));
  base().copy(out, o);
}

void native_binary(ops::BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b) {
  note("binary", a.dtype());
  Tensor o = out.dtype() == DType::Bool ? out : empty(out.shape(), DType::F32, out.device());
  base().binary(op, o, f32(a), f32(b));
  if (o.dtype() != DType::Bool) base().copy(out, o);
}

void native_pointwise(PointwiseOp op, const Tensor& x, const Tensor& a, const Tensor& b, double s) {
  note("pointwise", x.dtype());
  Tensor xf = f32(x);
  base().pointwise(op, xf, f32(a), f32(b), s);
  base().copy(x, xf);
}

void native_softmax(const Tensor& out, const Tensor& x, bool log) {
  note("softmax", x.dtype());
  Tensor o = empty(out.shape(), DType::F32, out.device());
  base().softmax(o, f32(x), log);
  base().copy(out, o);
}

void recorded_gemm(DType dtype, bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha,
                   const void* a, int64_t lda, const void* b, int64_t ldb, double beta, void* c,
                   int64_t ldc) {
  note("gemm", dtype);
  base().gemm(dtype, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void recorded_layer_norm(const ops::NormResult& r, const Tensor& x, const Tensor& w,
                         const Tensor& b, double eps, bool rms) {
  note("layer_norm", x.dtype());
  base().layer_norm(r, x, w, b, eps, rms);
}

// Installs the table above for async_cpu for a scope.
struct NativeBf16Backend {
  KernelTable table = base();
  const KernelTable* saved;
  NativeBf16Backend() {
    table.compute_dtype = native_bf16_compute_dtype;
    table.unary = native_unary;
    table.binary = native_binary;
    table.pointwise = native_pointwise;
    table.softmax = native_softmax;
    table.gemm = recorded_gemm;
    table.layer_norm = recorded_layer_norm;
    saved = replace_kernels_for_testing(DeviceType::AsyncCPU, &table);
    received.clear();
  }
  ~NativeBf16Backend() { replace_kernels_for_testing(DeviceType::AsyncCPU, saved); }
};

}  // namespace

TEST_CASE("the ops layer hands each kernel family the dtype its table declares", "[stream][dtype]") {
  // bf16 products are native where oneDNN has bf16 kernels for this CPU
  // (AVX512-BF16, AMX) or the own f32 kernel runs (AVX2: it widens them as it packs them).
  const DType bf16_gemm = cpu::bf16_gemm_native() || cpu::bf16_on_own_kernel() ? DType::BF16 : DType::F32;
  CHECK(ops::compute_dtype(Device::cpu(), KernelFamily::Matmul, DType::BF16) == bf16_gemm);
  CHECK(ops::compute_dtype(Device::cpu(), KernelFamily::Matmul, DType::F16) == DType::F32);
  CHECK(ops::compute_dtype(Device::cpu(), KernelFamily::Elementwise, DType::F16) == DType::F16);
  CHECK(ops::compute_dtype(Device::cpu(), KernelFamily::Norm, DType::BF16) == DType::BF16);
  CHECK(ops::compute_dtype(Device::cpu(), KernelFamily::Rope, DType::BF16) == DType::BF16);
  CHECK(ops::compute_dtype(Device::cpu(), KernelFamily::Attention, DType::F16) == DType::F16);
  CHECK(ops::compute_dtype(Device::cpu(), KernelFamily::Reduction, DType::BF16) == DType::F32);
  CHECK(ops::compute_dtype(Device::cpu(), KernelFamily::Embedding, DType::F16) == DType::F32);
  CHECK(ops::compute_dtype(Device::cpu(), KernelFamily::Norm, DType::F64) == DType::F64);
  CHECK(ops::compute_dtype(Device::cpu(), KernelFamily::Attention, DType::I64) == DType::I64);

  // Odd sizes; bf16 inputs on the CPU (which takes bf16 natively in the
  // elementwise, softmax, norm, cross-entropy, attention and RoPE kernels, and in matmul where
  // it has a bf16 GEMM) and on a backend that takes bf16 natively for
  // elementwise and softmax kernels.
  auto inputs = [](Device d) {
    return std::pair{ops::to(randn({7, 13}, 21, DType::F32, d), DType::BF16),
                     ops::to(randn({13, 5}, 22, DType::F32, d), DType::BF16)};
  };
  auto [ca, cb] = inputs(Device::cpu());
  Tensor c_exp = exp(ca), c_sum = add(ca, ca), c_mm = matmul(ca, cb), c_sm = softmax(ca, -1);
  Tensor c_ln = layer_norm(ca, Tensor(), Tensor(), 1e-5), c_acc = ops::clone(ca);
  ops::add_(c_acc, ca, 0.5);

  NativeBf16Backend backend;
  auto [a, b] = inputs(kAsync);
  received.clear();
  Tensor d_exp = exp(a);
  CHECK(received == std::vector<std::string>{"unary:bf16"});  // no f32 copy around the kernel
  received.clear();
  Tensor d_sum = add(a, a);
  CHECK(received == std::vector<std::string>{"binary:bf16"});
  received.clear();
  Tensor d_mm = matmul(a, b);
  CHECK(received == std::vector<std::string>{fmt::format("gemm:{}", dtype_name(bf16_gemm))});  // as the CPU's
  received.clear();
  Tensor d_sm = softmax(a, -1);
  CHECK(received == std::vector<std::string>{"softmax:bf16"});
  received.clear();
  Tensor d_ln = layer_norm(a, Tensor(), Tensor(), 1e-5);
  CHECK(received == std::vector<std::string>{"layer_norm:bf16"});  // as the CPU's
  received.clear();
  Tensor d_acc = ops::clone(a);
  ops::add_(d_acc, a, 0.5);  // in place on the bf16 tensor itself
  CHECK(received == std::vector<std::string>{"pointwise:bf16"});

  // Results keep the input dtype, and (as these kernels compute in f32
  // registers and round once) equal the CPU's bit for bit.
  for (auto [dev, cpu] : std::vector<std::pair<Tensor, Tensor>>{
           {d_exp, c_exp}, {d_sum, c_sum}, {d_mm, c_mm}, {d_sm, c_sm}, {d_ln, c_ln}, {d_acc, c_acc}}) {
    CHECK(dev.dtype() == DType::BF16);
    CHECK(bitwise_equal(dev.to(Device::cpu()), cpu));
  }
}

TEST_CASE("a stream whose own queued work drops its last reference finishes its queue", "[stream][async]") {
  Delays delays(200);
  std::atomic<int> ran{0};
  {
    StreamPtr s = new_stream(kAsync);
    Stream& raw = *s;
    raw.enqueue("hold the stream", [keep = s, &ran] { ran += 1; });
    for (int i = 0; i < 5; ++i) raw.enqueue("after", [&ran] { ran += 1; });
  }  // the first task now holds the last reference: the stream dies on its own worker
  for (int i = 0; i < 1000 && ran.load() < 6; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  CHECK(ran.load() == 6);
}
