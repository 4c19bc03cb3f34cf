// The CUDA backend's kernel table: turns tensors into the launchers' plain
// arguments (runtime/cuda/launch.h) on the current CUDA stream. Every float
// family takes f32, f64, bf16 and f16 natively (the kernels compute in f32
// registers, accumulate row statistics in f32 or f64, and round once), so the
// ops layer converts nothing around them.
#include <array>
#include <cstring>

#include "runtime/cuda/common.h"
#include "runtime/cuda/cudnn_attention.h"
#include "runtime/cuda/launch.h"
#include "runtime/cuda/make_iter.h"
#include "runtime/cuda/pinned.h"
#include "runtime/cuda_backend.h"
#include "runtime/kernels.h"

namespace tessera::cuda {

void gemm(DType dtype, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha,
          const void* a, int64_t lda, const void* b, int64_t ldb, double beta, void* c, int64_t ldc);

namespace {

Device here() { return Device::cuda(process_device()); }
cudaStream_t stream() { return current_raw_stream(); }

int64_t rows_of(const Tensor& x) {
  int64_t n = x.dim() == 0 ? 1 : x.size(-1);
  return n == 0 ? 0 : x.numel() / n;
}

const void* ptr_or_null(const Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }
void* mut_ptr_or_null(const Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

// A host tensor over a pinned buffer.
Tensor pinned_view(const PinnedBuffer& buf, const Shape& shape, DType dtype) {
  size_t nbytes = static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype);
  auto storage = Storage::borrow(buf.get(), nbytes, Device::cpu());
  return make_tensor(std::move(storage), shape, contiguous_strides(shape), 0, dtype);
}

// ---- table entries ----------------------------------------------------------------

DType compute_dtype(KernelFamily, DType dtype) { return dtype; }

void copy(const Tensor& dst, const Tensor& src) { launch_copy(make_iter<2>(dst.shape(), {&dst, &src}), stream()); }

// Host -> device: the host values, converted to dst's dtype, go through a
// pinned buffer (kept until the copy ran) into dst (or a dense temporary that a
// kernel scatters into a strided dst).
void copy_from_host(const Tensor& dst, const Tensor& src) {
  const size_t nbytes = static_cast<size_t>(dst.numel()) * dtype_size(dst.dtype());
  if (nbytes == 0) return;
  PinnedBuffer buf = pinned_buffer(nbytes);
  kernels(Device::cpu()).copy(pinned_view(buf, dst.shape(), dst.dtype()), src);
  Tensor target = dst.is_contiguous() ? dst : empty(dst.shape(), dst.dtype(), here());
  TS_CUDA_CHECK(cudaMemcpyAsync(target.data_ptr(), buf.get(), nbytes, cudaMemcpyHostToDevice, stream()));
  if (!dst.is_contiguous()) copy(dst, target);
  current_stream(here()).enqueue("release a pinned copy buffer", [buf] {});
}

// Device -> host: into a pinned buffer, then (in stream order, on the host)
// into dst. The caller synchronizes before reading dst.
void copy_to_host(const Tensor& dst, const Tensor& src) {
  const size_t nbytes = static_cast<size_t>(dst.numel()) * dtype_size(dst.dtype());
  if (nbytes == 0) return;
  Tensor dense = src;
  if (!src.is_contiguous() || src.dtype() != dst.dtype()) {
    dense = empty(dst.shape(), dst.dtype(), here());
    copy(dense, src);
  }
  PinnedBuffer buf = pinned_buffer(nbytes);
  TS_CUDA_CHECK(cudaMemcpyAsync(buf.get(), dense.data_ptr(), nbytes, cudaMemcpyDeviceToHost, stream()));
  // `dense` is freed on the host now: stream order keeps its bytes until the
  // copy ran (the host work must not free device memory: no CUDA calls there).
  Tensor out = dst;
  current_stream(here()).enqueue("copy to host", [buf, out, nbytes] {
    if (out.is_contiguous()) std::memcpy(out.data_ptr(), buf.get(), nbytes);
    else kernels(Device::cpu()).copy(out, pinned_view(buf, out.shape(), out.dtype()));
  });
}

void fill(const Tensor& dst, double value) { launch_fill(make_iter<1>(dst.shape(), {&dst}), value, stream()); }

void unary(ops::UnaryOp op, const Tensor& out, const Tensor& x) {
  launch_unary(op, make_iter<2>(out.shape(), {&out, &x}), stream());
}

void unary_backward(ops::UnaryOp op, const Tensor& gx, const Tensor& gy, const Tensor& x, const Tensor& y) {
  const Tensor& yy = y.defined() ? y : x;
  launch_unary_backward(op, make_iter<4>(gx.shape(), {&gx, &gy, &x, &yy}), stream());
}

void binary(ops::BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b) {
  launch_binary(op, make_iter<3>(out.shape(), {&out, &a, &b}), stream());
}

void binary_scalar(ops::BinaryOp op, const Tensor& out, const Tensor& a, double s, bool scalar_first) {
  launch_binary_scalar(op, make_iter<2>(out.shape(), {&out, &a}), s, scalar_first, stream());
}

void where(const Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b) {
  launch_where(make_iter<4>(out.shape(), {&out, &cond, &a, &b}), stream());
}

void pointwise(PointwiseOp op, const Tensor& x, const Tensor& a, const Tensor& b, double s) {
  const Tensor& bb = b.defined() ? b : a;
  launch_pointwise(op, make_iter<3>(x.shape(), {&x, &a, &bb}), s, stream());
}

void clamp(const Tensor& x, double lo, double hi) { launch_clamp(make_iter<1>(x.shape(), {&x}), lo, hi, stream()); }

void scale(const std::vector<Tensor>& xs, const Tensor& coef) {
  std::vector<ScaleTensor> tensors;
  for (const Tensor& x : xs) tensors.push_back({x.data_ptr(), x.numel(), x.dtype()});
  launch_scale(tensors.data(), static_cast<int64_t>(tensors.size()), static_cast<const double*>(coef.data_ptr()),
               stream());
}

void adamw(const std::vector<Tensor>& ps, const std::vector<Tensor>& gs, const std::vector<Tensor>& ms,
           const std::vector<Tensor>& vs, const ops::AdamWStep& step) {
  std::vector<AdamWTensor> tensors;
  for (size_t i = 0; i < ps.size(); ++i)
    tensors.push_back({ps[i].data_ptr(), gs[i].data_ptr(), ms[i].data_ptr(), vs[i].data_ptr(), ps[i].numel(),
                       ps[i].dtype()});
  launch_adamw(tensors.data(), static_cast<int64_t>(tensors.size()), step, stream());
}

void reduce(ReduceOp op, const Tensor& out, const Tensor& x, int64_t outer, int64_t n, int64_t inner) {
  const int64_t scratch = reduce_scratch_elements(outer, n, inner);
  Tensor partials = scratch > 0 ? empty({scratch}, is_integral(x.dtype()) ? DType::I64 : DType::F64, here()) : Tensor();
  launch_reduce(op, out.data_ptr(), x.data_ptr(), x.dtype(), outer, n, inner,
                partials.defined() ? partials.data_ptr() : nullptr, stream());
}

void argmax_rows(const Tensor& values, const Tensor& indices, const Tensor& x) {
  int64_t rows = values.numel();
  int64_t n = rows > 0 ? x.numel() / rows : 0;
  TS_CHECK(n > 0 || rows == 0, "argmax: cannot take the maximum over an empty dim");
  launch_argmax_rows(values.data_ptr(), static_cast<int64_t*>(indices.data_ptr()), x.data_ptr(), x.dtype(),
                     rows, n, stream());
}

void sum_squares(const Tensor& out, const std::vector<Tensor>& xs) {
  Tensor partials = zeros({kSumSquaresBlocks}, DType::F64, here());
  auto* p = static_cast<double*>(partials.data_ptr());
  std::vector<SquaresTensor> batch;
  for (const Tensor& x : xs) batch.push_back({x.data_ptr(), x.numel(), x.dtype()});
  launch_sum_squares_partials(p, batch.data(), static_cast<int64_t>(batch.size()), stream());
  launch_sum_doubles(static_cast<double*>(out.data_ptr()), p, kSumSquaresBlocks, stream());
}

void softmax(const Tensor& out, const Tensor& x, bool log) {
  launch_softmax(out.data_ptr(), x.data_ptr(), x.dtype(), rows_of(x), x.dim() == 0 ? 1 : x.size(-1), log,
                 stream());
}

void softmax_backward(const Tensor& gx, const Tensor& gy, const Tensor& y, bool log) {
  launch_softmax_backward(gx.data_ptr(), gy.data_ptr(), y.data_ptr(), y.dtype(), rows_of(y),
                          y.dim() == 0 ? 1 : y.size(-1), log, stream());
}

void layer_norm(const ops::NormResult& r, const Tensor& x, const Tensor& w, const Tensor& b, double eps,
                bool rms) {
  launch_layer_norm(r.y.data_ptr(), mut_ptr_or_null(r.mean), r.rstd.data_ptr(), x.data_ptr(), ptr_or_null(w),
                    ptr_or_null(b), x.dtype(), r.rstd.dtype(), rows_of(x), x.size(-1), eps, rms, stream());
}

void layer_norm_backward(const ops::NormGrads& g, const Tensor& dy, const Tensor& x, const Tensor& w,
                         const Tensor& mean, const Tensor& rstd, bool rms) {
  const int64_t n = x.size(-1);
  Tensor scratch = empty({2 * kNormRowBlocks * n}, DType::F64, here());
  launch_layer_norm_backward(g.dx.data_ptr(), mut_ptr_or_null(g.dweight), mut_ptr_or_null(g.dbias),
                             dy.data_ptr(), x.data_ptr(), ptr_or_null(w), ptr_or_null(mean), rstd.data_ptr(),
                             x.dtype(), rstd.dtype(), rows_of(x), n, rms,
                             static_cast<double*>(scratch.data_ptr()), stream());
}

void embedding(const Tensor& out, const Tensor& weight, const Tensor& indices) {
  launch_embedding(out.data_ptr(), weight.data_ptr(), weight.dtype(), indices.data_ptr(), indices.dtype(),
                   indices.numel(), weight.size(0), weight.size(1), device_error_slot(), stream());
}

void embedding_backward(const Tensor& gw, const Tensor& grad, const Tensor& indices) {
  const int64_t count = indices.numel();
  Tensor scratch = empty({static_cast<int64_t>(embedding_backward_scratch_bytes(count))}, DType::Bool, here());
  launch_embedding_backward(gw.data_ptr(), grad.data_ptr(), gw.dtype(), indices.data_ptr(), indices.dtype(), count,
                            gw.size(0), gw.size(1), device_error_slot(), scratch.data_ptr(), stream());
}

void cross_entropy(const Tensor& losses, const Tensor& lse, const Tensor& logits, const Tensor& target,
                   int64_t ignore_index) {
  launch_cross_entropy(losses.data_ptr(), lse.data_ptr(), logits.data_ptr(), logits.dtype(), lse.dtype(),
                       static_cast<const int64_t*>(target.data_ptr()), logits.size(0), logits.size(1),
                       ignore_index, device_error_slot(), stream());
}

void cross_entropy_backward(const Tensor& g, const Tensor& scale, const Tensor& logits, const Tensor& target,
                            const Tensor& lse, int64_t ignore_index) {
  launch_cross_entropy_backward(g.data_ptr(), static_cast<const double*>(scale.data_ptr()), logits.data_ptr(),
                                logits.dtype(), lse.data_ptr(), lse.dtype(),
                                static_cast<const int64_t*>(target.data_ptr()), logits.size(0),
                                logits.size(1), ignore_index, stream());
}

AttentionShape attention_shape(const Tensor& q, const Tensor& k, bool causal, double scale) {
  TS_CHECK(q.size(3) <= max_attention_head_dim(), "attention on CUDA: head_dim {} is above the {} it takes",
           q.size(3), max_attention_head_dim());
  return {q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), causal, scale};
}

void attention(const ops::AttentionResult& r, const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
               double scale) {
  const AttentionShape shape = attention_shape(q, k, causal, scale);
  if (cudnn_attention(r.out.data_ptr(), r.lse.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), q.dtype(),
                      r.lse.dtype(), shape))
    return;
  launch_attention(r.out.data_ptr(), r.lse.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), q.dtype(),
                   r.lse.dtype(), attention_shape(q, k, causal, scale), stream());
}

void attention_backward(const ops::AttentionGrads& g, const Tensor& dout, const Tensor& q, const Tensor& k,
                        const Tensor& v, const Tensor& out, const Tensor& lse, bool causal, double scale) {
  if (cudnn_attention_backward(g.dq.data_ptr(), g.dk.data_ptr(), g.dv.data_ptr(), dout.data_ptr(), q.data_ptr(),
                               k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), q.dtype(), lse.dtype(),
                               attention_shape(q, k, causal, scale)))
    return;
  // Each query row's dot(dout, out), in the kernels' accumulation type.
  Tensor scratch = empty({q.size(0) * q.size(1) * q.size(2)}, q.dtype() == DType::F64 ? DType::F64 : DType::F32, here());
  launch_attention_backward(g.dq.data_ptr(), g.dk.data_ptr(), g.dv.data_ptr(), dout.data_ptr(), q.data_ptr(),
                            k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), q.dtype(), lse.dtype(),
                            attention_shape(q, k, causal, scale), scratch.data_ptr(), stream());
}

void rope(const Tensor& out, const Tensor& x, const Tensor& cos, const Tensor& sin, bool inverse) {
  int64_t t = x.size(-2), d = x.size(-1);
  int64_t planes = t == 0 || d == 0 ? 0 : x.numel() / (t * d);
  launch_rope(out.data_ptr(), x.data_ptr(), cos.data_ptr(), sin.data_ptr(), x.dtype(), planes, t, d / 2,
              inverse, stream());
}

RandomArg random_arg(const Tensor& x, const RandomSpec& spec) {
  const Shape& shape = x.shape();
  RandomArg r{};
  r.seed = spec.seed;
  r.stream = spec.stream;
  r.base = spec.base;
  r.linear = spec.index_strides.empty() || spec.index_strides == contiguous_strides(shape);
  TS_CHECK(r.linear || spec.index_strides.size() == shape.size(),
           "random fill: index_strides {} do not match tensor shape {}", shape_str(spec.index_strides),
           shape_str(shape));
  if (!r.linear) {
    TS_CHECK(static_cast<int>(shape.size()) <= kMaxDims, "random fill on CUDA: at most {} dims, got {}",
             kMaxDims, shape.size());
    r.ndim = static_cast<int>(shape.size());
    for (int d = 0; d < r.ndim; ++d) {
      r.sizes[d] = shape[d];
      r.index_strides[d] = spec.index_strides[d];
    }
  }
  return r;
}

void uniform(const Tensor& x, double low, double high, const RandomSpec& spec) {
  launch_uniform(x.data_ptr(), x.dtype(), x.numel(), low, high, random_arg(x, spec), stream());
}

void normal(const Tensor& x, double mean, double std, const RandomSpec& spec) {
  launch_normal(x.data_ptr(), x.dtype(), x.numel(), mean, std, random_arg(x, spec), stream());
}

// The kernels this backend has, by name; an op whose kernel is missing here
// fails naming the op and the device, and tests/runtime/test_ops.cpp fails on
// any kernel of runtime/op_list.h this table neither has nor says it lacks.
constexpr KernelTable make_table() {
  KernelTable t;
  t.backend = "cuda";
  t.compute_dtype = compute_dtype;
  t.copy = copy;
  t.copy_from_host = copy_from_host;
  t.copy_to_host = copy_to_host;
  t.fill = fill;
  t.unary = unary;
  t.unary_backward = unary_backward;
  t.binary = binary;
  t.binary_scalar = binary_scalar;
  t.where = where;
  t.pointwise = pointwise;
  t.clamp = clamp;
  t.reduce = reduce;
  t.argmax_rows = argmax_rows;
  t.sum_squares = sum_squares;
  t.gemm = gemm;
  t.adamw = adamw;
  t.scale = scale;
  t.softmax = softmax;
  t.softmax_backward = softmax_backward;
  t.layer_norm = layer_norm;
  t.layer_norm_backward = layer_norm_backward;
  t.embedding = embedding;
  t.embedding_backward = embedding_backward;
  t.cross_entropy = cross_entropy;
  t.cross_entropy_backward = cross_entropy_backward;
  t.attention = attention;
  t.attention_backward = attention_backward;
  t.rope = rope;
  t.uniform = uniform;
  t.normal = normal;
  // The list's CPU_KERNEL rows: kernels this backend says it does not have.
#define TS_CUDA_HAS(...)
#define TS_CUDA_LACKS(name, ...) t.lacks[static_cast<size_t>(OpId::name)] = true;
  TESSERA_OPS(TS_CUDA_HAS, TS_CUDA_LACKS, TS_CUDA_HAS)
#undef TS_CUDA_HAS
#undef TS_CUDA_LACKS
  return t;
}

constinit const KernelTable kTable = make_table();

}  // namespace

const KernelTable& kernel_table() { return kTable; }

}  // namespace tessera::cuda
