// Tessera's own attention kernels on CUDA: the reference and fallback for the
// fused library path.
//
// Forward, tiled (attention_tile_kernel, head_dim <= 256): one block per tile
// of kTileRows query rows of one (batch, head); the tile's queries stay in
// shared memory while key tiles of the same size stream through it (each
// loaded once per query tile, not once per query row), V reusing K's buffer.
// Each row keeps the online softmax's running maximum and sum (flash
// attention's rescale: when a tile raises the maximum, the sum and the output
// so far are multiplied by exp(old - new)); the kTileRows x kTileRows
// probabilities go through shared memory into the output accumulators, which
// stay in registers. Causal key tiles wholly after the tile's last query are
// skipped. Wider heads take the row kernel (attention_forward_kernel: one
// block per query row, keys in chunks, the same online softmax).
//
// Backward: one block per query row for dq and one per key row for dk and dv,
// recomputing the probabilities from the saved log-sum-exp. Causal masks are
// top-left aligned (row i sees keys 0..i), as on the CPU; GQA maps query head
// h to key head h / (heads / kv_heads). Products, the softmax and the sums run
// in the tensor's accumulation type: f32 for f32, bf16 and f16, f64 for f64
// (the CPU's, so an f64 model's attention agrees with it to f64 rounding).
#include <type_traits>

#include "runtime/cuda/device_util.cuh"

namespace tessera::cuda {

namespace {

constexpr int kChunk = 256;  // keys (or queries) per shared-memory chunk
constexpr int kMaxPerThread = 4;  // head_dim <= kMaxPerThread * kThreads

__device__ __forceinline__ int64_t visible_keys(int64_t i, int64_t s, bool causal) {
  return causal ? (i + 1 < s ? i + 1 : s) : s;
}

template <class A>
__device__ __forceinline__ A dot_row(const A* a_shared, const void* b, DType dt, int64_t b0, int64_t d) {
  A acc = 0;
  for (int64_t k = 0; k < d; ++k) acc += a_shared[k] * load<A>(b, dt, b0 + k);
  return acc;
}

template <class A>
__device__ __forceinline__ A log_of(A x) {
  if constexpr (std::is_same_v<A, double>) return ::log(x);
  else return ::logf(x);
}

// The dynamic shared memory as an array of A (one declaration for every A:
// an extern __shared__ array of a template's type would be declared twice).
template <class A>
__device__ __forceinline__ A* shared_as() {
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  return reinterpret_cast<A*>(smem_bytes);
}

template <class A>
__global__ void attention_forward_kernel(void* out, void* lse, const void* q, const void* k,
                                         const void* v, DType dt, DType lt, AttentionShape sh) {
  A* smem = shared_as<A>();
  A* qi = smem;          // d
  A* p = smem + sh.d;    // kChunk
  __shared__ A red[kThreads / 32];
  const int64_t row = blockIdx.x;  // (b * heads + h) * t + i
  const int64_t i = row % sh.t, bh = row / sh.t, h = bh % sh.heads, b = bh / sh.heads;
  const int64_t hk = h / (sh.heads / sh.kv_heads);
  const int64_t kv0 = (b * sh.kv_heads + hk) * sh.s * sh.d;
  const A scale = static_cast<A>(sh.scale);
  for (int64_t x = threadIdx.x; x < sh.d; x += blockDim.x) qi[x] = load<A>(q, dt, row * sh.d + x);
  __syncthreads();
  const int64_t keys = visible_keys(i, sh.s, sh.causal);
  A m = -INFINITY, l = 0, acc[kMaxPerThread] = {};
  for (int64_t c0 = 0; c0 < keys; c0 += kChunk) {
    const int64_t n = keys - c0 < kChunk ? keys - c0 : kChunk;
    A cmax = -INFINITY;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      p[j] = scale * dot_row(qi, k, dt, kv0 + (c0 + j) * sh.d, sh.d);
      cmax = p[j] > cmax ? p[j] : cmax;
    }
    cmax = block_max(cmax, red);
    const A mnew = cmax > m ? cmax : m;
    const A corr = m == -INFINITY ? A(0) : math::fast_exp(m - mnew);
    A csum = 0;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      p[j] = math::fast_exp(p[j] - mnew);
      csum += p[j];
    }
    csum = block_sum(csum, red);  // also orders the p[] writes before the reads below
    l = l * corr + csum;
    for (int e = 0; e < kMaxPerThread; ++e) {
      int64_t x = threadIdx.x + static_cast<int64_t>(e) * blockDim.x;
      if (x >= sh.d) break;
      A a = acc[e] * corr;
      for (int64_t j = 0; j < n; ++j) a += p[j] * load<A>(v, dt, kv0 + (c0 + j) * sh.d + x);
      acc[e] = a;
    }
    m = mnew;
    __syncthreads();
  }
  for (int e = 0; e < kMaxPerThread; ++e) {
    int64_t x = threadIdx.x + static_cast<int64_t>(e) * blockDim.x;
    if (x >= sh.d) break;
    store<A>(out, dt, row * sh.d + x, l > 0 ? acc[e] / l : A(0));
  }
  if (threadIdx.x == 0) store<A>(lse, lt, row, l > 0 ? m + log_of(l) : A(-INFINITY));
}

// delta[row] = dot(dout[row], out[row]).
template <class A>
__global__ void attention_delta_kernel(A* delta, const void* dout, const void* out, DType dt, int64_t d) {
  __shared__ A red[kThreads / 32];
  const int64_t row = blockIdx.x;
  A acc = 0;
  for (int64_t x = threadIdx.x; x < d; x += blockDim.x)
    acc += load<A>(dout, dt, row * d + x) * load<A>(out, dt, row * d + x);
  acc = block_sum(acc, red);
  if (threadIdx.x == 0) delta[row] = acc;
}

// dq for one query row.
template <class A>
__global__ void attention_dq_kernel(void* dq, const void* dout, const void* q, const void* k,
                                    const void* v, const void* lse, const A* delta, DType dt,
                                    DType lt, AttentionShape sh) {
  A* smem = shared_as<A>();
  A* qi = smem;               // d
  A* gi = smem + sh.d;        // d (dout row)
  A* ds = smem + 2 * sh.d;    // kChunk
  const int64_t row = blockIdx.x;
  const int64_t i = row % sh.t, bh = row / sh.t, h = bh % sh.heads, b = bh / sh.heads;
  const int64_t hk = h / (sh.heads / sh.kv_heads);
  const int64_t kv0 = (b * sh.kv_heads + hk) * sh.s * sh.d;
  const A scale = static_cast<A>(sh.scale), li = load<A>(lse, lt, row), di = delta[row];
  for (int64_t x = threadIdx.x; x < sh.d; x += blockDim.x) {
    qi[x] = load<A>(q, dt, row * sh.d + x);
    gi[x] = load<A>(dout, dt, row * sh.d + x);
  }
  __syncthreads();
  const int64_t keys = visible_keys(i, sh.s, sh.causal);
  A acc[kMaxPerThread] = {};
  for (int64_t c0 = 0; c0 < keys; c0 += kChunk) {
    const int64_t n = keys - c0 < kChunk ? keys - c0 : kChunk;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      int64_t r = kv0 + (c0 + j) * sh.d;
      A pij = math::fast_exp(scale * dot_row(qi, k, dt, r, sh.d) - li);
      ds[j] = pij * (dot_row(gi, v, dt, r, sh.d) - di);
    }
    __syncthreads();
    for (int e = 0; e < kMaxPerThread; ++e) {
      int64_t x = threadIdx.x + static_cast<int64_t>(e) * blockDim.x;
      if (x >= sh.d) break;
      for (int64_t j = 0; j < n; ++j) acc[e] += ds[j] * load<A>(k, dt, kv0 + (c0 + j) * sh.d + x);
    }
    __syncthreads();
  }
  for (int e = 0; e < kMaxPerThread; ++e) {
    int64_t x = threadIdx.x + static_cast<int64_t>(e) * blockDim.x;
    if (x >= sh.d) break;
    store<A>(dq, dt, row * sh.d + x, scale * acc[e]);
  }
}

// dk and dv for one key row, summed over the query heads that share it.
template <class A>
__global__ void attention_dkdv_kernel(void* dk, void* dv, const void* dout, const void* q,
                                      const void* k, const void* v, const void* lse,
                                      const A* delta, DType dt, DType lt, AttentionShape sh) {
  A* smem = shared_as<A>();
  A* kj = smem;               // d
  A* vj = smem + sh.d;        // d
  A* pc = smem + 2 * sh.d;    // kChunk: probabilities
  A* dsc = pc + kChunk;       // kChunk: score gradients
  const int64_t krow = blockIdx.x;  // (b * kv_heads + hk) * s + j
  const int64_t j = krow % sh.s, bk = krow / sh.s, hk = bk % sh.kv_heads, b = bk / sh.kv_heads;
  const int64_t group = sh.heads / sh.kv_heads;
  const A scale = static_cast<A>(sh.scale);
  for (int64_t x = threadIdx.x; x < sh.d; x += blockDim.x) {
    kj[x] = load<A>(k, dt, krow * sh.d + x);
    vj[x] = load<A>(v, dt, krow * sh.d + x);
  }
  __syncthreads();
  const int64_t first = sh.causal ? j : 0;  // queries that see key j
  A ak[kMaxPerThread] = {}, av[kMaxPerThread] = {};
  for (int64_t g = 0; g < group; ++g) {
    const int64_t h = hk * group + g, q0 = (b * sh.heads + h) * sh.t;
    for (int64_t c0 = first; c0 < sh.t; c0 += kChunk) {
      const int64_t n = sh.t - c0 < kChunk ? sh.t - c0 : kChunk;
      for (int64_t ii = threadIdx.x; ii < n; ii += blockDim.x) {
        int64_t row = q0 + c0 + ii;
        A pij = math::fast_exp(scale * dot_row(kj, q, dt, row * sh.d, sh.d) - load<A>(lse, lt, row));
        pc[ii] = pij;
        dsc[ii] = pij * (dot_row(vj, dout, dt, row * sh.d, sh.d) - delta[row]);
      }
      __syncthreads();
      for (int e = 0; e < kMaxPerThread; ++e) {
        int64_t x = threadIdx.x + static_cast<int64_t>(e) * blockDim.x;
        if (x >= sh.d) break;
        for (int64_t ii = 0; ii < n; ++ii) {
          int64_t row = q0 + c0 + ii;
          av[e] += pc[ii] * load<A>(dout, dt, row * sh.d + x);
          ak[e] += dsc[ii] * load<A>(q, dt, row * sh.d + x);
        }
      }
      __syncthreads();
    }
  }
  for (int e = 0; e < kMaxPerThread; ++e) {
    int64_t x = threadIdx.x + static_cast<int64_t>(e) * blockDim.x;
    if (x >= sh.d) break;
    store<A>(dk, dt, krow * sh.d + x, scale * ak[e]);
    store<A>(dv, dt, krow * sh.d + x, av[e]);
  }
}

// ---- the tiled forward -----------------------------------------------------------
constexpr int kTiledMaxHeadDim = 256;

// Rows (and keys) per tile: 32 while a tile of f32 heads of up to 128 fits the
// default 48 KiB of shared memory, else 16.
template <class A>
__host__ __device__ constexpr int tile_rows(int64_t d) {
  return sizeof(A) == 4 && d <= 128 ? 32 : 16;
}
// f32 heads up to 256 and f64 heads up to 128 fit 48 KiB; wider ones take the row kernel.
template <class A>
bool tiled(int64_t d) { return d <= (sizeof(A) == 4 ? kTiledMaxHeadDim : 128); }
template <class A>
size_t tile_shared_bytes(int64_t d) {
  const int64_t br = tile_rows<A>(d);
  return static_cast<size_t>(2 * br * d + br * br) * sizeof(A);
}

// Sum / max over the `width` consecutive lanes that share a row (width divides 32).
template <class A>
__device__ __forceinline__ A group_max(A v, int width) {
  for (int o = width / 2; o > 0; o /= 2) {
    A other = __shfl_xor_sync(0xffffffffu, v, o);
    v = other > v || other != other ? other : v;
  }
  return v;
}
template <class A>
__device__ __forceinline__ A group_sum(A v, int width) {
  for (int o = width / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <class A, int BR>
__global__ void attention_tile_kernel(void* out, void* lse, const void* q, const void* k, const void* v, DType dt,
                                      DType lt, AttentionShape sh) {
  constexpr int kPerRow = kThreads / BR;   // threads sharing a row: 8 (BR 32) or 16 (BR 16)
  constexpr int kCols = BR / kPerRow;      // scores per thread per key tile: 4 or 1
  constexpr int kAcc = (BR == 32 ? 128 : kTiledMaxHeadDim) / kPerRow;  // output elements per thread: 16
  A* smem = shared_as<A>();
  A* qt = smem;                // BR x d: the tile's queries
  A* kv = qt + BR * sh.d;      // BR x d: a key tile, then its value tile
  A* pt = kv + BR * sh.d;      // BR x BR: probabilities
  const int64_t tiles = (sh.t + BR - 1) / BR;
  const int64_t tile = blockIdx.x % tiles, bh = blockIdx.x / tiles;
  const int64_t h = bh % sh.heads, b = bh / sh.heads;
  const int64_t hk = h / (sh.heads / sh.kv_heads);
  const int64_t q0 = tile * BR, row0 = bh * sh.t;  // first query of the tile; first row of this head
  const int64_t kv0 = (b * sh.kv_heads + hk) * sh.s * sh.d;
  const int r = threadIdx.x / kPerRow, lane = threadIdx.x % kPerRow;
  const int64_t i = q0 + r;  // this thread's query
  const A scale = static_cast<A>(sh.scale);
  for (int64_t e = threadIdx.x; e < BR * sh.d; e += blockDim.x) {
    const int64_t rr = e / sh.d, x = e % sh.d;
    qt[e] = q0 + rr < sh.t ? load<A>(q, dt, (row0 + q0 + rr) * sh.d + x) : A(0);
  }
  // Keys the tile's last query sees.
  const int64_t last = q0 + BR - 1 < sh.t - 1 ? q0 + BR - 1 : sh.t - 1;
  const int64_t keys = sh.causal ? (last + 1 < sh.s ? last + 1 : sh.s) : sh.s;
  A m = -INFINITY, l = 0, acc[kAcc] = {};
  for (int64_t c0 = 0; c0 < keys; c0 += BR) {
    __syncthreads();  // qt written (first tile); kv and pt read by the previous tile
    for (int64_t e = threadIdx.x; e < BR * sh.d; e += blockDim.x) {
      const int64_t c = e / sh.d, x = e % sh.d;
      kv[e] = c0 + c < sh.s ? load<A>(k, dt, kv0 + (c0 + c) * sh.d + x) : A(0);
    }
    __syncthreads();
    A sc[kCols];
    A tmax = -INFINITY;
    for (int j = 0; j < kCols; ++j) {
      const int c = lane + j * kPerRow;
      const int64_t key = c0 + c;
      const bool seen = i < sh.t && key < sh.s && (!sh.causal || key <= i);
      A acc_s = 0;
      if (seen)
        for (int64_t x = 0; x < sh.d; ++x) acc_s += qt[r * sh.d + x] * kv[c * sh.d + x];
      sc[j] = seen ? scale * acc_s : A(-INFINITY);
      tmax = sc[j] > tmax ? sc[j] : tmax;
    }
    tmax = group_max(tmax, kPerRow);
    const A mnew = tmax > m ? tmax : m;
    const A corr = m == -INFINITY ? A(0) : math::fast_exp(m - mnew);
    A tsum = 0;
    for (int j = 0; j < kCols; ++j) {
      const A pj = sc[j] == -INFINITY ? A(0) : math::fast_exp(sc[j] - mnew);
      pt[r * BR + lane + j * kPerRow] = pj;
      tsum += pj;
    }
    tsum = group_sum(tsum, kPerRow);
    l = l * corr + tsum;
    m = mnew;
    __syncthreads();  // every score read kv (keys) and wrote pt
    for (int64_t e = threadIdx.x; e < BR * sh.d; e += blockDim.x) {
      const int64_t c = e / sh.d, x = e % sh.d;
      kv[e] = c0 + c < sh.s ? load<A>(v, dt, kv0 + (c0 + c) * sh.d + x) : A(0);
    }
    __syncthreads();
    for (int e = 0; e < kAcc; ++e) {
      const int64_t x = lane + static_cast<int64_t>(e) * kPerRow;
      if (x >= sh.d) break;
      A a = acc[e] * corr;
      for (int c = 0; c < BR; ++c) a += pt[r * BR + c] * kv[c * sh.d + x];
      acc[e] = a;
    }
  }
  if (i >= sh.t) return;
  for (int e = 0; e < kAcc; ++e) {
    const int64_t x = lane + static_cast<int64_t>(e) * kPerRow;
    if (x >= sh.d) break;
    store<A>(out, dt, (row0 + i) * sh.d + x, l > 0 ? acc[e] / l : A(0));
  }
  if (lane == 0) store<A>(lse, lt, row0 + i, l > 0 ? m + log_of(l) : A(-INFINITY));
}

template <class A>
size_t shared_bytes(int64_t count) { return static_cast<size_t>(count) * sizeof(A); }

}  // namespace

void launch_attention(void* out, void* lse, const void* q, const void* k, const void* v,
                      DType dtype, DType lse_dtype, const AttentionShape& sh, cudaStream_t stream) {
  const int64_t rows = sh.batch * sh.heads * sh.t;
  if (rows == 0 || sh.d == 0) return;
  auto run = [&](auto a) {
    using A = decltype(a);
    if (tiled<A>(sh.d)) {
      const int br = tile_rows<A>(sh.d);
      const auto blocks = static_cast<unsigned>(sh.batch * sh.heads * ((sh.t + br - 1) / br));
      if (br == 32)
        attention_tile_kernel<A, 32><<<blocks, kThreads, tile_shared_bytes<A>(sh.d), stream>>>(
            out, lse, q, k, v, dtype, lse_dtype, sh);
      else
        attention_tile_kernel<A, 16><<<blocks, kThreads, tile_shared_bytes<A>(sh.d), stream>>>(
            out, lse, q, k, v, dtype, lse_dtype, sh);
      return;
    }
    attention_forward_kernel<A><<<static_cast<unsigned>(rows), kThreads, shared_bytes<A>(sh.d + kChunk), stream>>>(
        out, lse, q, k, v, dtype, lse_dtype, sh);
  };
  if (dtype == DType::F64) run(double{});
  else run(float{});
  check_launch("attention");
}

void launch_attention_backward(void* dq, void* dk, void* dv, const void* dout, const void* q,
                               const void* k, const void* v, const void* out, const void* lse,
                               DType dtype, DType lse_dtype, const AttentionShape& sh,
                               void* scratch, cudaStream_t stream) {
  const int64_t rows = sh.batch * sh.heads * sh.t, krows = sh.batch * sh.kv_heads * sh.s;
  if (sh.d == 0) return;
  auto run = [&](auto a) {
    using A = decltype(a);
    A* delta = static_cast<A*>(scratch);
    if (rows > 0) {
      attention_delta_kernel<A><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(delta, dout, out, dtype, sh.d);
      attention_dq_kernel<A><<<static_cast<unsigned>(rows), kThreads, shared_bytes<A>(2 * sh.d + kChunk), stream>>>(
          dq, dout, q, k, v, lse, delta, dtype, lse_dtype, sh);
    }
    if (krows > 0)
      attention_dkdv_kernel<A><<<static_cast<unsigned>(krows), kThreads, shared_bytes<A>(2 * sh.d + 2 * kChunk),
                                 stream>>>(dk, dv, dout, q, k, v, lse, delta, dtype, lse_dtype, sh);
  };
  if (dtype == DType::F64) run(double{});
  else run(float{});
  check_launch("attention_backward");
}

int max_attention_head_dim() { return kMaxPerThread * kThreads; }

}  // namespace tessera::cuda
