// The meta device's kernel table and the kernel log (runtime/kernel_log.h).
// A kernel's arguments are logged as specs (shape, strides, dtype, the bytes
// of the storage behind them), never as the meta tensors themselves: holding
// those would keep their storages, and so their bytes in a plan, alive.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>

#include "runtime/allocator.h"
#include "runtime/check.h"
#include "runtime/cpu/blas.h"
#include "runtime/cpu/kernels_cpu.h"
#include "runtime/kernel_log.h"
#include "runtime/parallel.h"
#include "runtime/storage.h"

namespace tessera::kernel_log {

namespace {

thread_local Log* active = nullptr;
thread_local double recording_started = 0, logging_seconds = 0;

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Counts the time the enclosing logging function takes as logging.
struct LoggingTime {
  double t0 = now_s();
  ~LoggingTime() { logging_seconds += now_s() - t0; }
};

// A tensor argument as the kernel saw it.
struct TensorSpec {
  bool defined = false;
  Shape shape, strides;
  int64_t offset = 0;
  DType dtype = DType::F32;
  size_t storage_bytes = 0;
};

// Each kind of kernel argument has a spec (spec_of), is rebuilt from it on
// the CPU (rebuild), and has bytes (bytes_in) and a part of the signature
// (text_of). A tensor's spec is a TensorSpec; a list of tensors' or a result
// struct's, a SpecList; a scalar or an option struct is its own spec.
TensorSpec spec_of(const Tensor& t) {
  if (!t.defined()) return {};
  return {true, t.shape(), t.strides(), t.storage_offset(), t.dtype(), t.storage() ? t.storage()->nbytes() : 0};
}

// CPU bytes laid out as the spec: floats 0.25 (no denormals, NaNs or zero
// divisions on any kernel's path), everything else 0 (valid indices).
Tensor make(const TensorSpec& s) {
  if (!s.defined) return Tensor();
  auto storage = std::make_shared<Storage>(s.storage_bytes, Device::cpu());
  const int64_t elements = static_cast<int64_t>(s.storage_bytes / dtype_size(s.dtype));
  if (is_floating(s.dtype) && elements > 0)
    cpu::table().fill(make_tensor(storage, {elements}, {1}, 0, s.dtype), 0.25);
  else if (s.storage_bytes > 0)
    std::memset(storage->data(), 0, s.storage_bytes);
  return make_tensor(std::move(storage), s.shape, s.strides, s.offset, s.dtype);
}

double bytes_in(const TensorSpec& s) {
  return s.defined ? static_cast<double>(shape_numel(s.shape)) * static_cast<double>(dtype_size(s.dtype)) : 0;
}
std::string text_of(const TensorSpec& s) {
  if (!s.defined) return "-";
  return fmt::format("{}{}/{}", dtype_name(s.dtype), shape_str(s.shape), shape_str(s.strides));
}

using SpecList = std::vector<TensorSpec>;
SpecList spec_of(const std::vector<Tensor>& ts) {
  SpecList out;
  for (const Tensor& t : ts) out.push_back(spec_of(t));
  return out;
}
SpecList spec_of(const ops::NormResult& r) { return {spec_of(r.y), spec_of(r.mean), spec_of(r.rstd)}; }
SpecList spec_of(const ops::NormGrads& g) { return {spec_of(g.dx), spec_of(g.dweight), spec_of(g.dbias)}; }
SpecList spec_of(const ops::AttentionResult& r) { return {spec_of(r.out), spec_of(r.lse)}; }
SpecList spec_of(const ops::AttentionGrads& g) { return {spec_of(g.dq), spec_of(g.dk), spec_of(g.dv)}; }
double bytes_in(const SpecList& ss) {
  double b = 0;
  for (const TensorSpec& s : ss) b += bytes_in(s);
  return b;
}
std::string text_of(const SpecList& ss) {
  std::string out = "{";
  for (const TensorSpec& s : ss) out += text_of(s) + " ";
  return out + "}";
}

template <class T>
T spec_of(const T& value) {
  return value;
}
template <class T>
double bytes_in(const T&) {
  return 0;
}
template <class T>
std::string text_of(const T& value) {
  if constexpr (std::is_enum_v<T>) return fmt::format("{}", static_cast<int>(value));
  else if constexpr (std::is_arithmetic_v<T>) return fmt::format("{}", value);
  else return "*";  // AdamWStep, RandomSpec: the time does not depend on them
}

// Rebuilds an argument of type A from its spec.
template <class A, class S>
std::decay_t<A> rebuild(const S& s) {
  using T = std::decay_t<A>;
  if constexpr (std::is_same_v<T, Tensor>) {
    return make(s);
  } else if constexpr (std::is_same_v<T, std::vector<Tensor>>) {
    std::vector<Tensor> out;
    for (const TensorSpec& one : s) out.push_back(make(one));
    return out;
  } else if constexpr (std::is_same_v<T, ops::AttentionResult>) {
    return {make(s[0]), make(s[1])};
  } else if constexpr (std::is_same_v<S, SpecList>) {  // NormResult, NormGrads, AttentionGrads: three tensors
    return {make(s[0]), make(s[1]), make(s[2])};
  } else {
    return s;
  }
}

void add(Kernel k) {
  active->events.push_back({Event::Type::Kernel, static_cast<int64_t>(active->kernels.size())});
  active->kernels.push_back(std::move(k));
}

// Attention's products: QK^T and PV, 2 FLOPs per multiply-add, half of them
// under a causal mask; the backward recomputes the scores and makes three
// more products (2.5 times the forward, as FlashAttention counts).
double attention_flops(const TensorSpec& q, const TensorSpec& k, bool causal) {
  const double b = static_cast<double>(q.shape[0]), h = static_cast<double>(q.shape[1]);
  const double t = static_cast<double>(q.shape[2]), d = static_cast<double>(q.shape[3]);
  const double s = static_cast<double>(k.shape[2]);
  return 4 * b * h * t * s * d * (causal ? 0.5 : 1.0);
}

// Logged<&KernelTable::f, op>::run has f's signature: it logs the call
// (while recording) and runs nothing.
template <auto Entry, OpId Op>
struct Logged;
template <class... A, void (*KernelTable::*Entry)(A...), OpId Op>
struct Logged<Entry, Op> {
  static void run(A... a) {
    if (active == nullptr) return;
    LoggingTime timed;
    auto specs = std::make_tuple(spec_of(a)...);
    Kernel k;
    k.name = op_name(Op);
    k.signature = op_name(Op);
    std::apply([&](const auto&... s) { ((k.signature += " " + text_of(s)), ...); }, specs);
    k.bytes = std::apply([](const auto&... s) { return (0.0 + ... + bytes_in(s)); }, specs);
    k.prepare = [specs] {
      auto args = std::apply([](const auto&... s) { return std::make_tuple(rebuild<A>(s)...); }, specs);
      return std::function<void()>([args] { std::apply(cpu::table().*Entry, args); });
    };
    add(std::move(k));
  }
};

bool native_dtypes = false;  // meta_kernels::set_native_dtypes

// Which kernel a bf16 product of this shape runs on the CPU planned for.
cpu::Bf16Kernel bf16_kernel(int64_t m, int64_t n, int64_t k) {
  switch (meta_kernels::bf16_products()) {
    case meta_kernels::Bf16Products::ThisCpu: return cpu::bf16_kernel(m, n, k);
    case meta_kernels::Bf16Products::Amx:
      return cpu::amx_kernel_takes(m, n, k) ? cpu::Bf16Kernel::Amx : cpu::Bf16Kernel::Library;
    case meta_kernels::Bf16Products::Own: return cpu::Bf16Kernel::Own;
    case meta_kernels::Bf16Products::Native:
    case meta_kernels::Bf16Products::F32Copies: break;
  }
  return cpu::Bf16Kernel::Library;
}

void gemm(DType dtype, bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const void*, int64_t lda,
          const void*, int64_t ldb, double beta, void*, int64_t ldc) {
  // The CPU's split-k partial products and the packed operands come from
  // the allocator: a planned step holds them for the product's length, as a run does.
  if (!native_dtypes && (dtype == DType::F32 || dtype == DType::BF16)) {
    cpu::GemmScratch scratch =
        cpu::gemm_scratch(dtype, ta, tb, m, n, k,
                          dtype == DType::BF16 ? bf16_kernel(m, n, k) : cpu::Bf16Kernel::Library);
    Tensor packed, parts;
    if (scratch.bf16_packed > 0) packed = empty({scratch.bf16_packed}, DType::BF16, Device::meta());
    if (scratch.f32_packed > 0) packed = empty({scratch.f32_packed}, DType::F32, Device::meta());
    if (scratch.f32_parts > 0) parts = empty({scratch.f32_parts}, DType::F32, Device::meta());
  }
  if (active == nullptr) return;
  LoggingTime timed;
  const double es = static_cast<double>(dtype_size(dtype));
  Kernel kernel;
  kernel.name = "gemm";
  kernel.signature = fmt::format("gemm {} {}{} {}x{}x{} ld {} {} {} beta {}", dtype_name(dtype), ta ? "T" : "N",
                                 tb ? "T" : "N", m, n, k, lda, ldb, ldc, beta == 0 ? 0 : 1);
  kernel.bytes = static_cast<double>(m * k + k * n + m * n) * es;
  kernel.flops = 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  kernel.prepare = [=] {
    // Row-major: A is m x k (k x m transposed) with leading dimension lda; so B and C.
    auto buffer = [&](int64_t rows, int64_t ld) {
      return make({true, {rows * ld}, {1}, 0, dtype, static_cast<size_t>(rows * ld) * dtype_size(dtype)});
    };
    Tensor a = buffer(ta ? k : m, lda), b = buffer(tb ? n : k, ldb), c = buffer(m, ldc);
    return std::function<void()>([=] {
      cpu::gemm(dtype, ta, tb, m, n, k, alpha, a.data_ptr(), lda, b.data_ptr(), ldb, beta, c.data_ptr(), ldc);
    });
  };
  add(std::move(kernel));
}

// Copies with the host do not occur in a step on meta (a meta tensor has no
// bytes to copy); they log nothing.
void copy_from_host(const Tensor&, const Tensor&) {}
void copy_to_host(const Tensor&, const Tensor&) {}


// Attention logs its FLOPs too (from q's and k's shapes). The CPU's attention
// takes per-thread scratch from the allocator, for as many threads as this
// process runs (tessera-train and tessera-plan set them per rank alike); a
// GPU's kernel takes none.
bool widened(const Tensor& q) { return tessera::compute_dtype(q.dtype()) != q.dtype(); }

void attention(const ops::AttentionResult& r, const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
               double scale) {
  if (!native_dtypes)
    (void)empty({cpu::attention_scratch_rows(q.size(0) * q.size(1) * ((q.size(2) + cpu::kAttentionBq - 1) / cpu::kAttentionBq)),
                 cpu::attention_scratch_per_thread(q.size(3), widened(q))},
                tessera::compute_dtype(q.dtype()), Device::meta());
  if (active == nullptr) return;
  Logged<&KernelTable::attention, OpId::attention>::run(r, q, k, v, causal, scale);
  active->kernels.back().flops = attention_flops(spec_of(q), spec_of(k), causal);
}

void attention_backward(const ops::AttentionGrads& g, const Tensor& dout, const Tensor& q, const Tensor& k,
                        const Tensor& v, const Tensor& out, const Tensor& lse, bool causal, double scale) {
  if (!native_dtypes)
    (void)empty({cpu::attention_scratch_rows(q.size(0) * k.size(1)),
                 cpu::attention_backward_scratch_per_thread(q.size(2), k.size(2), q.size(3), widened(q))},
                tessera::compute_dtype(q.dtype()), Device::meta());
  if (active == nullptr) return;
  Logged<&KernelTable::attention_backward, OpId::attention_backward>::run(g, dout, q, k, v, out, lse, causal, scale);
  active->kernels.back().flops = 2.5 * attention_flops(spec_of(q), spec_of(k), causal);
}

}  // namespace

Recording::Recording(Log& log) {
  TS_CHECK(active == nullptr, "kernel_log::Recording: a recording is already active on this thread");
  active = &log;
  logging_seconds = 0;
  recording_started = now_s();
}
Recording::~Recording() {
  active->host_seconds = std::max(0.0, now_s() - recording_started - logging_seconds);
  active = nullptr;
}

int64_t collective_issued(const std::string& kind, const std::string& group, int group_size, double bytes) {
  if (active == nullptr) return -1;
  LoggingTime timed;
  const auto index = static_cast<int64_t>(active->collectives.size());
  active->collectives.push_back({kind, group, group_size, bytes});
  active->events.push_back({Event::Type::Issue, index});
  return index;
}

void collective_waited(int64_t index) {
  if (active == nullptr || index < 0) return;
  active->events.push_back({Event::Type::Wait, index});
}


}  // namespace tessera::kernel_log

namespace tessera::meta_kernels {

namespace kl = kernel_log;

namespace {
Bf16Products bf16_products_ = Bf16Products::ThisCpu;  // set_bf16_products

DType compute_dtype(KernelFamily family, DType dtype) {
  if (kl::native_dtypes) return dtype;
  if (family == KernelFamily::Matmul && dtype == DType::BF16 && bf16_products_ != Bf16Products::ThisCpu)
    return bf16_products_ == Bf16Products::F32Copies ? DType::F32 : DType::BF16;
  return cpu::compute_dtype(family, dtype);
}
}  // namespace

void set_native_dtypes(bool native) { kl::native_dtypes = native; }
bool native_dtypes() { return kl::native_dtypes; }
void set_bf16_products(Bf16Products products) { bf16_products_ = products; }
Bf16Products bf16_products() { return bf16_products_; }

namespace {
// Every kernel of runtime/op_list.h logged, the products (gemm, attention)
// with their FLOPs and the CPU's scratch.
constexpr KernelTable make_table() {
  KernelTable t;
  t.backend = "meta";
  t.compute_dtype = compute_dtype;  // the CPU's, or native (a GPU's)
  t.strided_attention = true;       // the CPU's layouts (a GPU's copies are not planned)
  t.sums_widen = true;              // and its sums
#define TS_LOGGED(name, family, compute, params) t.name = &kl::Logged<&KernelTable::name, OpId::name>::run;
#define TS_NONE(name, family)
  TESSERA_OPS(TS_LOGGED, TS_LOGGED, TS_NONE)
#undef TS_LOGGED
#undef TS_NONE
  t.copy_from_host = kl::copy_from_host;
  t.copy_to_host = kl::copy_to_host;
  t.gemm = kl::gemm;
  t.attention = kl::attention;
  t.attention_backward = kl::attention_backward;
  return t;
}
}  // namespace

constinit const KernelTable kTable = make_table();

}  // namespace tessera::meta_kernels
