// Attention through cuDNN 9's fused flash attention (scaled dot-product
// attention, forward and backward), built with cuDNN's frontend graph API
// where the build found its headers (meson option cudnn_frontend; `make
// cudnn-frontend` fetches them): bf16 and f16, causal (top-left, as the CPU
// and the own kernels) or not, GQA. One graph per shape, built once and
// cached, so a step builds none; cuDNN's own workspace comes from the caching
// allocator on the current stream. What cuDNN refuses (f32, f64, a head size
// it does not take, a shape its check_support turns down) returns false and
// the caller runs Tessera's own kernels (attention.cu), which are also the
// reference the cuda suite compares both against.
//
// The forward's Stats output is the log-sum-exp of each row's scaled scores
// in natural log, the lse the own backward takes, so the two paths mix.
// TESSERA_CUDNN_ATTENTION=0 turns this path off (the own kernels only).
#include "runtime/cuda/cudnn_attention.h"

#include "runtime/cuda_backend.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

#if defined(TESSERA_CUDNN_FRONTEND)

// cuDNN (and NVRTC, which the frontend names) are opened at run time, where
// the process finds them (a GPU machine's toolkit, or PyTorch's nvidia/*/lib
// folders): no link dependency, and a machine without cuDNN runs the own kernels.
#define CUDNN_FRONTEND_SKIP_JSON_LIB
#define NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING
#include <cudnn_frontend.h>

#include <dlfcn.h>

#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include <fmt/format.h>

#include "runtime/cuda/common.h"
#include "runtime/ops.h"

// The frontend's handle on libcudnn under dynamic loading (its Python
// package sets it; here the first handle() opens the library).
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}

namespace tessera::cuda {

namespace {

namespace fe = cudnn_frontend;

std::atomic<int64_t> calls{0};

bool enabled() {
  static const bool on = [] {
    const char* env = std::getenv("TESSERA_CUDNN_ATTENTION");
    return env == nullptr || std::strcmp(env, "0") != 0;
  }();
  return on;
}

// The variant pack's tensor ids.
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

using Key = std::tuple<bool, int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool, double>;

struct Entry {
  std::shared_ptr<fe::graph::Graph> graph;  // null: cuDNN refused the shape
  int64_t workspace = 0;
};

// Why cuDNN last refused a shape ("" while it has taken every one):
// cudnn_attention_refusal(), for the suite and the benchmarks to print.
std::mutex refusal_mu;
std::string refusal;
void refused(std::string why) {
  std::lock_guard<std::mutex> lk(refusal_mu);
  refusal = std::move(why);
}

// One cuDNN handle per thread (set_stream each call points it at the
// current stream); null where cuDNN cannot be loaded or started.
cudnnHandle_t handle() {
  static const std::string load_error = [] {
    std::string err;
    for (const char* name : {"libcudnn.so.9", "libcudnn.so"}) {
      if ((fe::cudnn_dlhandle = dlopen(name, RTLD_NOW | RTLD_GLOBAL)) != nullptr) return std::string();
      const char* e = dlerror();
      err += std::string(err.empty() ? "" : "; ") + (e ? e : name);
    }
    return "libcudnn could not be loaded (" + err + ")";
  }();
  if (!load_error.empty()) {
    refused(load_error);
    return nullptr;
  }
  thread_local cudnnHandle_t h = [] {
    cudnnHandle_t made = nullptr;
    try {
      const cudnnStatus_t st = fe::detail::create_handle(&made);
      if (st != CUDNN_STATUS_SUCCESS) {
        refused(std::string("cudnnCreate failed: ") + fe::detail::get_error_string(st));
        made = nullptr;
      }
    } catch (const std::exception& e) {
      refused(std::string("cudnnCreate failed: ") + e.what());
      made = nullptr;
    }
    return made;
  }();
  return h;
}

std::shared_ptr<fe::graph::Tensor_attributes> tensor(fe::graph::Graph& g, const char* name, Uid uid,
                                                     std::vector<int64_t> dims, fe::DataType_t type) {
  std::vector<int64_t> strides(dims.size(), 1);
  for (size_t i = dims.size() - 1; i-- > 0;) strides[i] = strides[i + 1] * dims[i + 1];
  return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(dims).set_stride(strides).set_data_type(type));
}

// Builds (or refuses, with a null graph) the forward or backward graph of one shape.
Entry build(bool backward, DType dt, const AttentionShape& sh) {
  // The library first: the frontend asks it for its version while the graph is made.
  cudnnHandle_t h = handle();
  if (h == nullptr) return {};
  const fe::DataType_t io = dt == DType::BF16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF;
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(io).set_intermediate_data_type(fe::DataType_t::FLOAT).set_compute_data_type(fe::DataType_t::FLOAT);
  auto q = tensor(*g, "Q", kQ, {sh.batch, sh.heads, sh.t, sh.d}, io);
  auto k = tensor(*g, "K", kK, {sh.batch, sh.kv_heads, sh.s, sh.d}, io);
  auto v = tensor(*g, "V", kV, {sh.batch, sh.kv_heads, sh.s, sh.d}, io);
  const float scale = static_cast<float>(sh.scale);
  if (!backward) {
    auto attrs = fe::graph::SDPA_attributes().set_name("attention").set_generate_stats(true).set_attn_scale(scale);
    if (sh.causal) attrs.set_causal_mask(true);  // top-left: query i sees keys 0..i
    auto [o, stats] = g->sdpa(q, k, v, attrs);
    o->set_output(true).set_uid(kO).set_dim({sh.batch, sh.heads, sh.t, sh.d})
        .set_stride({sh.heads * sh.t * sh.d, sh.t * sh.d, sh.d, 1});
    stats->set_output(true).set_uid(kStats).set_data_type(fe::DataType_t::FLOAT);
  } else {
    auto o = tensor(*g, "O", kO, {sh.batch, sh.heads, sh.t, sh.d}, io);
    auto d_o = tensor(*g, "dO", kDO, {sh.batch, sh.heads, sh.t, sh.d}, io);
    auto stats = tensor(*g, "Stats", kStats, {sh.batch, sh.heads, sh.t, 1}, fe::DataType_t::FLOAT);
    auto attrs = fe::graph::SDPA_backward_attributes().set_name("attention_backward").set_attn_scale(scale)
                     .set_deterministic_algorithm(true);
    if (sh.causal) attrs.set_causal_mask(true);
    auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, d_o, stats, attrs);
    dq->set_output(true).set_uid(kDQ).set_dim({sh.batch, sh.heads, sh.t, sh.d})
        .set_stride({sh.heads * sh.t * sh.d, sh.t * sh.d, sh.d, 1});
    dk->set_output(true).set_uid(kDK).set_dim({sh.batch, sh.kv_heads, sh.s, sh.d})
        .set_stride({sh.kv_heads * sh.s * sh.d, sh.s * sh.d, sh.d, 1});
    dv->set_output(true).set_uid(kDV).set_dim({sh.batch, sh.kv_heads, sh.s, sh.d})
        .set_stride({sh.kv_heads * sh.s * sh.d, sh.s * sh.d, sh.d, 1});
  }
  Entry e;
  // Each stage in turn; the first that fails names why the own kernels run this shape.
  const char* where = (backward ? "backward" : "forward");
  auto good = [&](const char* stage, fe::error_object st) {
    if (!st.is_good())
      refused(fmt::format("{} {} [B {}, H {}/{}, T {}, S {}, D {}{}]: {}: {}", dtype_name(dt), where, sh.batch,
                          sh.heads, sh.kv_heads, sh.t, sh.s, sh.d, sh.causal ? ", causal" : "", stage,
                          st.get_message()));
    return st.is_good();
  };
  int64_t ws = 0;
  if (!good("validate", g->validate()) || !good("build_operation_graph", g->build_operation_graph(h)) ||
      !good("create_execution_plans", g->create_execution_plans({fe::HeurMode_t::A})) ||
      !good("check_support", g->check_support(h)) || !good("build_plans", g->build_plans(h)) ||
      !good("get_workspace_size", g->get_workspace_size(ws)))
    return e;
  e.graph = std::move(g);
  e.workspace = ws;
  return e;
}

const Entry& entry(bool backward, DType dt, const AttentionShape& sh) {
  static std::mutex mu;
  static auto* cache = new std::map<Key, Entry>;
  Key key{backward, static_cast<int>(dt), sh.batch, sh.heads, sh.kv_heads, sh.t, sh.s, sh.d, sh.causal, sh.scale};
  std::lock_guard<std::mutex> lk(mu);
  auto it = cache->find(key);
  if (it == cache->end()) {
    Entry e;
    try {
      e = build(backward, dt, sh);
    } catch (const std::exception& ex) {  // the frontend throws where the backend is missing: refused
      refused(std::string("cuDNN frontend: ") + ex.what());
      e = Entry{};
    }
    it = cache->emplace(key, std::move(e)).first;
  }
  return it->second;
}

bool eligible(DType dt, DType lse_dtype, const AttentionShape& sh) {
  return enabled() && (dt == DType::BF16 || dt == DType::F16) && lse_dtype == DType::F32 && sh.d % 8 == 0 &&
         sh.d <= 256 && sh.kv_heads > 0 && sh.heads % sh.kv_heads == 0 && sh.t > 0 && sh.s > 0;
}

bool run(const Entry& e, std::unordered_map<int64_t, void*>& pack) {
  cudnnHandle_t h = handle();
  if (fe::detail::set_stream(h, current_raw_stream()) != CUDNN_STATUS_SUCCESS) return false;
  Tensor workspace = e.workspace > 0 ? empty({e.workspace}, DType::Bool, Device::cuda(process_device())) : Tensor();
  auto status = e.graph->execute(h, pack, workspace.defined() ? workspace.data_ptr() : nullptr);
  TS_CHECK(status.is_good(), "cuDNN attention failed to run a plan it had built: {}", status.get_message());
  ++calls;
  return true;
}

}  // namespace

bool cudnn_attention(void* out, void* lse, const void* q, const void* k, const void* v, DType dtype,
                     DType lse_dtype, const AttentionShape& sh) {
  if (!eligible(dtype, lse_dtype, sh)) return false;
  const Entry& e = entry(false, dtype, sh);
  if (!e.graph) return false;
  std::unordered_map<int64_t, void*> pack{{kQ, const_cast<void*>(q)}, {kK, const_cast<void*>(k)},
                                          {kV, const_cast<void*>(v)}, {kO, out}, {kStats, lse}};
  return run(e, pack);
}

bool cudnn_attention_backward(void* dq, void* dk, void* dv, const void* dout, const void* q, const void* k,
                              const void* v, const void* out, const void* lse, DType dtype, DType lse_dtype,
                              const AttentionShape& sh) {
  if (!eligible(dtype, lse_dtype, sh)) return false;
  const Entry& e = entry(true, dtype, sh);
  if (!e.graph) return false;
  std::unordered_map<int64_t, void*> pack{
      {kQ, const_cast<void*>(q)},    {kK, const_cast<void*>(k)},   {kV, const_cast<void*>(v)},
      {kO, const_cast<void*>(out)},  {kDO, const_cast<void*>(dout)}, {kStats, const_cast<void*>(lse)},
      {kDQ, dq},                     {kDK, dk},                      {kDV, dv}};
  return run(e, pack);
}

bool cudnn_attention_built() { return true; }
int64_t cudnn_attention_calls() { return calls.load(); }
std::string cudnn_attention_refusal() {
  std::lock_guard<std::mutex> lk(refusal_mu);
  return refusal;
}

}  // namespace tessera::cuda

#else  // no cuDNN frontend headers at build time: the own kernels only

namespace tessera::cuda {

bool cudnn_attention(void*, void*, const void*, const void*, const void*, DType, DType, const AttentionShape&) {
  return false;
}
bool cudnn_attention_backward(void*, void*, void*, const void*, const void*, const void*, const void*, const void*,
                              const void*, DType, DType, const AttentionShape&) {
  return false;
}
bool cudnn_attention_built() { return false; }
int64_t cudnn_attention_calls() { return 0; }
std::string cudnn_attention_refusal() { return "this build has no cuDNN frontend (make cudnn-frontend)"; }

}  // namespace tessera::cuda

#endif
