// Reductions on CUDA: sums accumulate in f64 (as on the CPU), max/min let NaN
// win, argmax takes the first maximum, and the sum of squares over many
// tensors goes through fixed per-block partials so its result is deterministic.
#include <algorithm>
#include <cfloat>

#include "runtime/cuda/device_util.cuh"

namespace tessera::cuda {

namespace {

template <class A>
__device__ __forceinline__ A reduce_init(ReduceOp op) {
  if (op == ReduceOp::Sum) return A(0);
  if constexpr (std::is_floating_point_v<A>) return op == ReduceOp::Max ? -INFINITY : INFINITY;
  else return op == ReduceOp::Max ? INT64_MIN : INT64_MAX;
}

template <class A>
__device__ __forceinline__ A combine(ReduceOp op, A acc, A v) {
  if (op == ReduceOp::Sum) return acc + v;
  if (v != v) return v;  // NaN wins max/min
  if (op == ReduceOp::Max) return acc != acc || acc >= v ? acc : v;
  return acc != acc || acc <= v ? acc : v;
}

// One block per row of [outer, n] (inner == 1).
template <class A>
__global__ void reduce_rows_kernel(ReduceOp op, void* out, const void* x, DType dt, int64_t n) {
  __shared__ A shared[kThreads / 32];
  const int64_t row = blockIdx.x;
  A acc = reduce_init<A>(op);
  for (int64_t k = threadIdx.x; k < n; k += blockDim.x) acc = combine(op, acc, load<A>(x, dt, row * n + k));
  // Combine the threads' values: a fixed tree, so the result is deterministic.
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int o = 16; o > 0; o >>= 1) acc = combine(op, acc, __shfl_down_sync(0xffffffffu, acc, o));
  if (lane == 0) shared[warp] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    A total = shared[0];
    for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) total = combine(op, total, shared[w]);
    store<A>(out, dt, row, total);
  }
}

// One thread per output of [outer, n, inner] (inner > 1): coalesced across
// inner; for few columns of many rows, the two kernels below instead.
template <class A>
__global__ void reduce_columns_kernel(ReduceOp op, void* out, const void* x, DType dt,
                                      int64_t outer, int64_t n, int64_t inner) {
  TS_CUDA_LOOP(w, outer * inner) {
    int64_t o = w / inner, j = w % inner;
    A acc = reduce_init<A>(op);
    for (int64_t k = 0; k < n; ++k) acc = combine(op, acc, load<A>(x, dt, (o * n + k) * inner + j));
    store<A>(out, dt, w, acc);
  }
}

// The first pass of a column reduction over many rows: thread w reduces
// rows [c chunk, (c + 1) chunk) of column `col` of [outer, n, inner], c =
// w / columns, into partials[c][col].
template <class A>
__global__ void reduce_column_chunks_kernel(ReduceOp op, A* partials, const void* x, DType dt, int64_t outer,
                                            int64_t n, int64_t inner, int64_t chunk, int64_t chunks) {
  const int64_t columns = outer * inner;
  TS_CUDA_LOOP(w, chunks * columns) {
    const int64_t c = w / columns, col = w % columns, o = col / inner, j = col % inner;
    const int64_t end = (c + 1) * chunk < n ? (c + 1) * chunk : n;
    A acc = reduce_init<A>(op);
    for (int64_t k = c * chunk; k < end; ++k) acc = combine(op, acc, load<A>(x, dt, (o * n + k) * inner + j));
    partials[w] = acc;
  }
}

// The second pass: each column's chunks, in chunk order.
template <class A>
__global__ void reduce_chunk_partials_kernel(ReduceOp op, void* out, DType dt, const A* partials, int64_t columns,
                                             int64_t chunks) {
  TS_CUDA_LOOP(col, columns) {
    A acc = reduce_init<A>(op);
    for (int64_t c = 0; c < chunks; ++c) acc = combine(op, acc, partials[c * columns + col]);
    store<A>(out, dt, col, acc);
  }
}

// Rows per chunk of a two-pass column reduction, and the chunks: enough
// threads to fill a large GPU (about 2^17) when the columns alone do not,
// at least 32 rows a chunk; 1 chunk (the one-pass kernel) otherwise.
constexpr int64_t kMinChunkRows = 32, kTargetThreads = int64_t{1} << 17;
int64_t chunk_rows(int64_t outer, int64_t n, int64_t inner) {
  const int64_t columns = outer * inner;
  if (inner <= 1 || columns >= kTargetThreads || n < 2 * kMinChunkRows) return n;
  const int64_t chunks = std::min((kTargetThreads + columns - 1) / columns, n / kMinChunkRows);
  return (n + chunks - 1) / chunks;
}

// Whether (v, i) comes before (cur, ci) as the row's maximum: NaN is the
// maximum, and among equals the first index wins. i < 0: no candidate.
template <class A>
__device__ __forceinline__ bool better(A v, int64_t i, A cur, int64_t ci) {
  if (i < 0) return false;
  if (ci < 0) return true;
  bool v_nan = v != v, c_nan = cur != cur;
  if (v_nan || c_nan) return v_nan && (!c_nan || i < ci);
  return v > cur || (v == cur && i < ci);
}

template <class A>
__global__ void argmax_kernel(void* values, int64_t* indices, const void* x, DType dt, int64_t n) {
  __shared__ A best_v[kThreads];
  __shared__ int64_t best_i[kThreads];
  const int64_t row = blockIdx.x;
  A bv = A(0);
  int64_t bi = -1;
  for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
    A v = load<A>(x, dt, row * n + k);
    if (better(v, k, bv, bi)) bv = v, bi = k;
  }
  best_v[threadIdx.x] = bv;
  best_i[threadIdx.x] = bi;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s && better(best_v[threadIdx.x + s], best_i[threadIdx.x + s],
                                  best_v[threadIdx.x], best_i[threadIdx.x])) {
      best_v[threadIdx.x] = best_v[threadIdx.x + s];
      best_i[threadIdx.x] = best_i[threadIdx.x + s];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    store<A>(values, dt, row, best_v[0]);
    indices[row] = best_i[0];
  }
}

// Up to kSquaresPerLaunch tensors per launch: each block walks them in order
// and adds its share of each to its slot, the sums of one tensor per launch
// before (the same bits), in one launch instead of one per tensor.
constexpr int kSquaresPerLaunch = 64;
struct SquaresBatch {
  SquaresTensor t[kSquaresPerLaunch];
  int count;
};

__global__ void sum_squares_kernel(double* partials, SquaresBatch batch) {
  __shared__ double shared[kThreads / 32];
  double slot = partials[blockIdx.x];
  for (int k = 0; k < batch.count; ++k) {
    const SquaresTensor& x = batch.t[k];
    double acc = 0;
    TS_CUDA_LOOP(i, x.n) {
      double v = load<double>(x.p, x.dtype, i);
      acc = __dadd_rn(acc, __dmul_rn(v, v));
    }
    slot += block_sum(acc, shared);
  }
  if (threadIdx.x == 0) partials[blockIdx.x] = slot;
}

__global__ void sum_doubles_kernel(double* out, const double* xs, int64_t n) {
  __shared__ double shared[kThreads / 32];
  double acc = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc += xs[i];
  double total = block_sum(acc, shared);
  if (threadIdx.x == 0) out[0] = total;
}


}  // namespace

int64_t reduce_scratch_elements(int64_t outer, int64_t n, int64_t inner) {
  const int64_t chunk = chunk_rows(outer, n, inner);
  return chunk >= n ? 0 : (n + chunk - 1) / chunk * outer * inner;
}

void launch_reduce(ReduceOp op, void* out, const void* x, DType dtype, int64_t outer, int64_t n,
                   int64_t inner, void* scratch, cudaStream_t stream) {
  if (outer == 0 || inner == 0) return;
  const int64_t chunk = chunk_rows(outer, n, inner);
  auto run = [&](auto a) {
    using A = decltype(a);
    if (inner == 1) {
      reduce_rows_kernel<A><<<static_cast<unsigned>(outer), kThreads, 0, stream>>>(op, out, x, dtype, n);
    } else if (chunk >= n) {
      reduce_columns_kernel<A><<<grid_for(outer * inner), kThreads, 0, stream>>>(op, out, x, dtype, outer, n, inner);
    } else {
      const int64_t chunks = (n + chunk - 1) / chunk, columns = outer * inner;
      auto* partials = static_cast<A*>(scratch);
      reduce_column_chunks_kernel<A><<<grid_for(chunks * columns), kThreads, 0, stream>>>(op, partials, x, dtype,
                                                                                          outer, n, inner, chunk, chunks);
      reduce_chunk_partials_kernel<A><<<grid_for(columns), kThreads, 0, stream>>>(op, out, dtype, partials, columns,
                                                                                  chunks);
    }
  };
  if (is_integral(dtype)) run(int64_t{});
  else run(double{});
  check_launch("reduce");
}

void launch_argmax_rows(void* values, int64_t* indices, const void* x, DType dtype, int64_t rows,
                        int64_t n, cudaStream_t stream) {
  if (rows == 0) return;
  if (is_integral(dtype)) argmax_kernel<int64_t><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(values, indices, x, dtype, n);
  else argmax_kernel<double><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(values, indices, x, dtype, n);
  check_launch("argmax");
}

void launch_sum_squares_partials(double* partials, const SquaresTensor* xs, int64_t count, cudaStream_t stream) {
  SquaresBatch batch{};
  auto flush = [&] {
    if (batch.count == 0) return;
    sum_squares_kernel<<<kSumSquaresBlocks, kThreads, 0, stream>>>(partials, batch);
    check_launch("sum_squares");
    batch.count = 0;
  };
  for (int64_t i = 0; i < count; ++i) {
    if (xs[i].n == 0) continue;
    batch.t[batch.count++] = xs[i];
    if (batch.count == kSquaresPerLaunch) flush();
  }
  flush();
}

void launch_sum_doubles(double* out, const double* xs, int64_t n, cudaStream_t stream) {
  sum_doubles_kernel<<<1, kThreads, 0, stream>>>(out, xs, n);
  check_launch("sum_squares");
}

}  // namespace tessera::cuda
