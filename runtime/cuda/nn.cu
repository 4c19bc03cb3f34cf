// The fused neural-network kernels on CUDA: softmax, layer/RMS norm, embedding,
// cross-entropy and RoPE. One block per row; the same formulas (and f64 row
// accumulators where the CPU uses them) as runtime/cpu/nn.cpp.
#include <cub/device/device_radix_sort.cuh>

#include "runtime/cuda/device_util.cuh"

namespace tessera::cuda {

namespace {

template <class C>
using Shared = C[kThreads / 32];

template <class C>
__global__ void softmax_kernel(void* out, const void* x, DType dt, int64_t n, bool log) {
  __shared__ Shared<C> sm;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * n;
  C m = -INFINITY;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    C v = load<C>(x, dt, base + j);
    m = v > m || v != v ? v : m;
  }
  m = block_max(m, sm);
  if (m == -INFINITY) m = 0;  // all -inf: avoid inf - inf
  C sum = 0;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) sum += math::fast_exp(load<C>(x, dt, base + j) - m);
  sum = block_sum(sum, sm);
  C lse = m + math::m_log(sum), inv = C(1) / sum;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    C v = load<C>(x, dt, base + j);
    store<C>(out, dt, base + j, log ? v - lse : math::fast_exp(v - m) * inv);
  }
}

template <class C>
__global__ void softmax_backward_kernel(void* gx, const void* gy, const void* y, DType dt, int64_t n,
                                        bool log) {
  __shared__ Shared<double> sm;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * n;
  double dot = 0;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    double g = load<double>(gy, dt, base + j);
    dot += log ? g : g * load<double>(y, dt, base + j);
  }
  C d = static_cast<C>(block_sum(dot, sm));
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    C g = load<C>(gy, dt, base + j), yv = load<C>(y, dt, base + j);
    store<C>(gx, dt, base + j, log ? g - math::fast_exp(yv) * d : yv * (g - d));
  }
}

template <class C>
__global__ void layer_norm_kernel(void* y, void* mean_out, void* rstd_out, const void* x,
                                  const void* w, const void* b, DType dt, DType st, int64_t n,
                                  double eps, bool rms) {
  __shared__ Shared<double> sm;
  const int64_t row = blockIdx.x, base = row * n;
  double mean = 0;
  if (!rms) {
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) mean += load<double>(x, dt, base + j);
    mean = block_sum(mean, sm) / static_cast<double>(n);
  }
  double var = 0;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    double d = load<double>(x, dt, base + j) - mean;
    var += d * d;
  }
  var = block_sum(var, sm) / static_cast<double>(n);
  C rstd = static_cast<C>(1.0 / ::sqrt(var + eps)), m = static_cast<C>(mean);
  if (threadIdx.x == 0) {
    if (mean_out != nullptr) store<C>(mean_out, st, row, m);
    store<C>(rstd_out, st, row, rstd);
  }
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    C v = (load<C>(x, dt, base + j) - m) * rstd;
    if (w != nullptr) v *= load<C>(w, dt, j);
    if (b != nullptr) v += load<C>(b, dt, j);
    store<C>(y, dt, base + j, v);
  }
}

template <class C>
__global__ void layer_norm_dx_kernel(void* dx, const void* dy, const void* x, const void* w,
                                     const void* mean, const void* rstd, DType dt, DType st,
                                     int64_t n, bool rms) {
  __shared__ Shared<double> sm;
  const int64_t row = blockIdx.x, base = row * n;
  C m = rms ? C(0) : load<C>(mean, st, row), rs = load<C>(rstd, st, row);
  double sum_g = 0, sum_gx = 0;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    C xhat = (load<C>(x, dt, base + j) - m) * rs;
    C g = load<C>(dy, dt, base + j);
    C gh = w != nullptr ? g * load<C>(w, dt, j) : g;
    sum_g += gh;
    sum_gx += static_cast<double>(gh) * xhat;
  }
  sum_g = block_sum(sum_g, sm);
  sum_gx = block_sum(sum_gx, sm);
  C mg = rms ? C(0) : static_cast<C>(sum_g / static_cast<double>(n));
  C mgx = static_cast<C>(sum_gx / static_cast<double>(n));
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    C xhat = (load<C>(x, dt, base + j) - m) * rs;
    C g = load<C>(dy, dt, base + j);
    C gh = w != nullptr ? g * load<C>(w, dt, j) : g;
    store<C>(dx, dt, base + j, rs * (gh - mg - xhat * mgx));
  }
}

// Weight and bias gradients: partial sums over row chunks (blockIdx.y), in f64,
// then a fixed-order sum of the partials: deterministic, no atomics.
template <class C>
__global__ void layer_norm_dwdb_partial_kernel(double* pw, double* pb, const void* dy, const void* x,
                                               const void* mean, const void* rstd, DType dt,
                                               DType st, int64_t rows, int64_t n, bool rms) {
  const int64_t chunk = (rows + gridDim.y - 1) / gridDim.y;
  const int64_t r0 = blockIdx.y * chunk, r1 = r0 + chunk < rows ? r0 + chunk : rows;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n;
       j += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    double aw = 0, ab = 0;
    for (int64_t r = r0; r < r1; ++r) {
      C m = rms ? C(0) : load<C>(mean, st, r), rs = load<C>(rstd, st, r);
      C xhat = (load<C>(x, dt, r * n + j) - m) * rs;
      C g = load<C>(dy, dt, r * n + j);
      aw += static_cast<double>(g) * xhat;
      ab += g;
    }
    if (pw != nullptr) pw[blockIdx.y * n + j] = aw;
    if (pb != nullptr) pb[blockIdx.y * n + j] = ab;
  }
}

__global__ void sum_row_blocks_kernel(void* out, DType dt, const double* partials, int parts, int64_t n) {
  TS_CUDA_LOOP(j, n) {
    double s = 0;
    for (int p = 0; p < parts; ++p) s += partials[p * n + j];
    store<double>(out, dt, j, s);
  }
}

__device__ void record_index_error(DeviceError* err, KernelId kernel, int64_t value, int64_t limit) {
  if (err != nullptr && atomicCAS(&err->code, 0, 1) == 0) {
    err->kernel = static_cast<int>(kernel);
    err->value = value;
    err->limit = limit;
  }
}

__device__ __forceinline__ int64_t load_index(const void* p, DType dt, int64_t i) {
  return dt == DType::I32 ? static_cast<const int32_t*>(p)[i] : static_cast<const int64_t*>(p)[i];
}

__global__ void embedding_kernel(void* out, const void* weight, DType dt, const void* idx, DType it,
                                 int64_t num, int64_t d, DeviceError* err) {
  const int64_t i = blockIdx.x;
  int64_t row = load_index(idx, it, i);
  if (row < 0 || row >= num) {
    if (threadIdx.x == 0) record_index_error(err, KernelId::Embedding, row, num);
    return;
  }
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x)
    store<double>(out, dt, i * d + j, load<double>(weight, dt, row * d + j));
}

// The embedding's gradient in three steps, parallel over tokens and columns
// and deterministic: (1) each position's row as a sort key (an invalid index
// is recorded and keyed `num`, after every row), (2) a stable radix sort of
// (row, position) pairs, so the positions of one row stay in order, (3) one
// block per distinct row adding its positions' gradients in that order, the
// CPU's order, into the row.
__global__ void embedding_keys_kernel(int64_t* keys, int64_t* positions, const void* idx, DType it,
                                      int64_t count, int64_t num, DeviceError* err) {
  TS_CUDA_LOOP(i, count) {
    int64_t row = load_index(idx, it, i);
    if (row < 0 || row >= num) {
      record_index_error(err, KernelId::EmbeddingBackward, row, num);
      row = num;
    }
    keys[i] = row;
    positions[i] = i;
  }
}

template <class C>
__global__ void embedding_segments_kernel(void* gw, const void* grad, DType dt, const int64_t* keys,
                                          const int64_t* positions, int64_t count, int64_t num, int64_t d) {
  for (int64_t s = blockIdx.x; s < count; s += gridDim.x) {
    const int64_t row = keys[s];
    if (row >= num || (s > 0 && keys[s - 1] == row)) continue;  // not the first of its row's run
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
      C acc = load<C>(gw, dt, row * d + j);
      for (int64_t p = s; p < count && keys[p] == row; ++p) acc = acc + load<C>(grad, dt, positions[p] * d + j);
      store<C>(gw, dt, row * d + j, acc);
    }
  }
}

// The radix sort's own scratch for `count` pairs.
size_t embedding_sort_bytes(int64_t count) {
  size_t bytes = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const int64_t*>(nullptr), static_cast<int64_t*>(nullptr),
                                  static_cast<const int64_t*>(nullptr), static_cast<int64_t*>(nullptr), count);
  return bytes;
}

template <class C>
__global__ void cross_entropy_kernel(void* losses, void* lse_out, const void* logits, DType dt,
                                     DType lt, const int64_t* target, int64_t c,
                                     int64_t ignore_index, DeviceError* err) {
  __shared__ Shared<C> sm;
  const int64_t row = blockIdx.x, base = row * c;
  const int64_t t = target[row];
  bool valid = t == ignore_index || (t >= 0 && t < c);
  if (!valid && threadIdx.x == 0) record_index_error(err, KernelId::CrossEntropy, t, c);
  C m = -INFINITY;
  for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
    C v = load<C>(logits, dt, base + j);
    m = v > m || v != v ? v : m;
  }
  m = block_max(m, sm);
  C sum = 0;
  for (int64_t j = threadIdx.x; j < c; j += blockDim.x) sum += math::fast_exp(load<C>(logits, dt, base + j) - m);
  sum = block_sum(sum, sm);
  if (threadIdx.x == 0) {
    C l = m + math::m_log(sum);
    store<C>(lse_out, lt, row, l);
    store<C>(losses, lt, row, (t == ignore_index || !valid) ? C(0) : l - load<C>(logits, dt, base + t));
  }
}

template <class C>
__global__ void cross_entropy_backward_kernel(void* g, const double* scale, const void* logits, DType dt,
                                              const void* lse, DType lt, const int64_t* target,
                                              int64_t c, int64_t ignore_index) {
  const int64_t row = blockIdx.x, base = row * c;
  const int64_t t = target[row];
  const bool skip = t == ignore_index || t < 0 || t >= c;
  const C s = static_cast<C>(scale[0]), l = load<C>(lse, lt, row);
  for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
    C v = skip ? C(0) : s * math::fast_exp(load<C>(logits, dt, base + j) - l);
    if (!skip && j == t) v -= s;
    store<C>(g, dt, base + j, v);
  }
}

template <class C>
__global__ void rope_kernel(void* out, const void* x, const void* cs, const void* sn, DType dt,
                            int64_t total, int64_t t, int64_t half, C sign) {
  TS_CUDA_LOOP(w, total) {  // w = (plane * t + pos) * half + j
    int64_t j = w % half, r = w / half, pos = r % t;
    int64_t base = r * 2 * half;
    C x1 = load<C>(x, dt, base + j), x2 = load<C>(x, dt, base + j + half);
    // cos and sin are in C (f32 for bf16/f16 inputs: the ops layer's statistics dtype).
    C c = static_cast<const C*>(cs)[pos * half + j], s = sign * static_cast<const C*>(sn)[pos * half + j];
    store<C>(out, dt, base + j, x1 * c - x2 * s);
    store<C>(out, dt, base + j + half, x2 * c + x1 * s);
  }
}


unsigned rows_grid(int64_t rows) { return static_cast<unsigned>(rows); }

}  // namespace

void launch_softmax(void* out, const void* x, DType dtype, int64_t rows, int64_t n, bool log,
                    cudaStream_t stream) {
  if (rows == 0 || n == 0) return;
  with_float(dtype, [&](auto c) {
    softmax_kernel<decltype(c)><<<rows_grid(rows), kThreads, 0, stream>>>(out, x, dtype, n, log);
  });
  check_launch(log ? "log_softmax" : "softmax");
}

void launch_softmax_backward(void* gx, const void* gy, const void* y, DType dtype, int64_t rows,
                             int64_t n, bool log, cudaStream_t stream) {
  if (rows == 0 || n == 0) return;
  with_float(dtype, [&](auto c) {
    softmax_backward_kernel<decltype(c)><<<rows_grid(rows), kThreads, 0, stream>>>(gx, gy, y, dtype, n, log);
  });
  check_launch("softmax_backward");
}

void launch_layer_norm(void* y, void* mean, void* rstd, const void* x, const void* w,
                       const void* b, DType dtype, DType stats, int64_t rows, int64_t n,
                       double eps, bool rms, cudaStream_t stream) {
  if (rows == 0) return;
  with_float(dtype, [&](auto c) {
    layer_norm_kernel<decltype(c)><<<rows_grid(rows), kThreads, 0, stream>>>(y, mean, rstd, x, w, b, dtype,
                                                                             stats, n, eps, rms);
  });
  check_launch(rms ? "rms_norm" : "layer_norm");
}

void launch_layer_norm_backward(void* dx, void* dw, void* db, const void* dy, const void* x,
                                const void* w, const void* mean, const void* rstd, DType dtype,
                                DType stats, int64_t rows, int64_t n, bool rms, double* scratch,
                                cudaStream_t stream) {
  if (rows == 0 || n == 0) return;
  with_float(dtype, [&](auto c) {
    using C = decltype(c);
    layer_norm_dx_kernel<C><<<rows_grid(rows), kThreads, 0, stream>>>(dx, dy, x, w, mean, rstd, dtype,
                                                                      stats, n, rms);
    if (dw != nullptr || db != nullptr) {
      double* pw = dw != nullptr ? scratch : nullptr;
      double* pb = db != nullptr ? scratch + kNormRowBlocks * n : nullptr;
      dim3 grid(grid_for(n), kNormRowBlocks);
      layer_norm_dwdb_partial_kernel<C><<<grid, kThreads, 0, stream>>>(pw, pb, dy, x, mean, rstd, dtype,
                                                                       stats, rows, n, rms);
      if (dw != nullptr) sum_row_blocks_kernel<<<grid_for(n), kThreads, 0, stream>>>(dw, dtype, pw, kNormRowBlocks, n);
      if (db != nullptr) sum_row_blocks_kernel<<<grid_for(n), kThreads, 0, stream>>>(db, dtype, pb, kNormRowBlocks, n);
    }
  });
  check_launch(rms ? "rms_norm_backward" : "layer_norm_backward");
}

void launch_embedding(void* out, const void* weight, DType dtype, const void* indices,
                      DType index_dtype, int64_t count, int64_t num, int64_t d, DeviceError* err,
                      cudaStream_t stream) {
  if (count == 0 || d == 0) return;
  embedding_kernel<<<static_cast<unsigned>(count), kThreads, 0, stream>>>(out, weight, dtype, indices,
                                                                          index_dtype, num, d, err);
  check_launch("embedding");
}

size_t embedding_backward_scratch_bytes(int64_t count) {
  return 4 * static_cast<size_t>(count) * sizeof(int64_t) + embedding_sort_bytes(count) + 256;
}

void launch_embedding_backward(void* gw, const void* grad, DType dtype, const void* indices,
                               DType index_dtype, int64_t count, int64_t num, int64_t d,
                               DeviceError* err, void* scratch, cudaStream_t stream) {
  if (count == 0 || d == 0) return;
  auto* keys = static_cast<int64_t*>(scratch);
  int64_t* positions = keys + count;
  int64_t* sorted_keys = positions + count;
  int64_t* sorted_positions = sorted_keys + count;
  char* sort_scratch = reinterpret_cast<char*>(sorted_positions + count);
  sort_scratch += (256 - reinterpret_cast<uintptr_t>(sort_scratch) % 256) % 256;
  size_t sort_bytes = embedding_sort_bytes(count);
  embedding_keys_kernel<<<grid_for(count), kThreads, 0, stream>>>(keys, positions, indices, index_dtype, count,
                                                                  num, err);
  check_launch("embedding_backward");
  // Only the bits that can be set: rows 0..num (num marks an invalid index).
  int bits = 1;
  while (bits < 63 && (int64_t{1} << bits) <= num) ++bits;
  cudaError_t sorted = cub::DeviceRadixSort::SortPairs(sort_scratch, sort_bytes, keys, sorted_keys, positions,
                                                       sorted_positions, count, 0, bits, stream);
  check_queued(sorted, "embedding_backward's radix sort");
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(count, 65535));
  const unsigned threads = d >= 256 ? 256 : (d >= 128 ? 128 : 64);
  with_float(dtype, [&](auto c) {
    embedding_segments_kernel<decltype(c)><<<blocks, threads, 0, stream>>>(gw, grad, dtype, sorted_keys,
                                                                              sorted_positions, count, num, d);
  });
  check_launch("embedding_backward");
}

void launch_cross_entropy(void* losses, void* lse, const void* logits, DType dtype, DType lse_dtype,
                          const int64_t* target, int64_t rows, int64_t c, int64_t ignore_index,
                          DeviceError* err, cudaStream_t stream) {
  if (rows == 0) return;
  with_float(dtype, [&](auto cc) {
    cross_entropy_kernel<decltype(cc)><<<rows_grid(rows), kThreads, 0, stream>>>(
        losses, lse, logits, dtype, lse_dtype, target, c, ignore_index, err);
  });
  check_launch("cross_entropy");
}

void launch_cross_entropy_backward(void* g, const double* scale, const void* logits, DType dtype,
                                   const void* lse, DType lse_dtype, const int64_t* target,
                                   int64_t rows, int64_t c, int64_t ignore_index,
                                   cudaStream_t stream) {
  if (rows == 0) return;
  with_float(dtype, [&](auto cc) {
    cross_entropy_backward_kernel<decltype(cc)><<<rows_grid(rows), kThreads, 0, stream>>>(
        g, scale, logits, dtype, lse, lse_dtype, target, c, ignore_index);
  });
  check_launch("cross_entropy_backward");
}

void launch_rope(void* out, const void* x, const void* cos, const void* sin, DType dtype,
                 int64_t planes, int64_t t, int64_t half, bool inverse, cudaStream_t stream) {
  int64_t total = planes * t * half;
  if (total == 0) return;
  with_float(dtype, [&](auto c) {
    using C = decltype(c);
    rope_kernel<C><<<grid_for(total), kThreads, 0, stream>>>(out, x, cos, sin, dtype, total, t, half,
                                                            inverse ? C(-1) : C(1));
  });
  check_launch("rope");
}

}  // namespace tessera::cuda
