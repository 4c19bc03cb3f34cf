// Matrix products and the fused neural-network ops.
#include <algorithm>
#include <cmath>

#include "runtime/op_call.h"
#include "runtime/kernels.h"
#include "runtime/ops.h"
#include "runtime/random.h"

namespace tessera::ops {

namespace {

// x converted to the dtype `family`'s kernels compute in (bf16/f16 -> f32 on the CPU).
Tensor upcast(const Tensor& x, KernelFamily family) {
  return to(x, compute_dtype(x.device(), family, x.dtype()));
}
// Row statistics (norm mean/rstd, log-sum-exp, per-row losses) are kept in f32
// (f64 for f64) even where a backend computes bf16/f16 natively: the widening
// of tessera::compute_dtype(DType).
DType stats_dtype(DType compute) { return tessera::compute_dtype(compute); }

// x contiguous, in the dtype `family`'s kernels compute in.
Tensor kernel_input(const Tensor& x, KernelFamily family) { return contiguous(upcast(x, family)); }
constexpr KernelFamily kMatmul = KernelFamily::Matmul;
constexpr KernelFamily kSoftmax = KernelFamily::Softmax;
constexpr KernelFamily kNorm = KernelFamily::Norm;
constexpr KernelFamily kEmbedding = KernelFamily::Embedding;
constexpr KernelFamily kCrossEntropy = KernelFamily::CrossEntropy;
constexpr KernelFamily kAttention = KernelFamily::Attention;
constexpr KernelFamily kRope = KernelFamily::Rope;

void check_float(const Tensor& x, const char* op, const char* what) {
  TS_CHECK(is_floating(x.dtype()), "{}: {} must be floating-point, got {}", op, what,
           dtype_name(x.dtype()));
}

void check_pair(const Tensor& a, const Tensor& b, const char* op) {
  TS_CHECK(a.dtype() == b.dtype(), "{}: dtype mismatch ({} and {})", op, dtype_name(a.dtype()),
           dtype_name(b.dtype()));
  TS_CHECK(a.device() == b.device(), "{}: tensors on different devices ({} and {})", op,
           a.device().str(), b.device().str());
}

// How a 2-D matrix can be handed to BLAS without copying.
struct BlasOperand {
  Tensor t;  // the tensor whose storage is read
  bool trans;
  int64_t ld;
};

BlasOperand blas_operand(const Tensor& m) {
  int64_t rows = m.size(0), cols = m.size(1);
  const Shape& st = m.strides();
  if (st[1] == 1 && (st[0] >= std::max<int64_t>(cols, 1) || rows <= 1))
    return {m, false, std::max<int64_t>(st[0], cols)};
  if (st[0] == 1 && (st[1] >= std::max<int64_t>(rows, 1) || cols <= 1))
    return {m, true, std::max<int64_t>(st[1], rows)};
  return {contiguous(m), false, cols};
}

// out[M, N] = alpha * a[M, K] @ b[K, N] + beta * out; a/b in out's (compute) dtype.
void gemm2d(const Tensor& out, const Tensor& a, const Tensor& b, double alpha, double beta) {
  int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  TS_ASSERT(out.is_contiguous());
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (beta == 0.0) dispatch(out.device()).fill(out, 0.0);
    else if (beta != 1.0) dispatch(out.device()).binary_scalar(BinaryOp::Mul, out, out, beta, false);
    return;
  }
  BlasOperand pa = blas_operand(a), pb = blas_operand(b);  // copies as the device would make them
  // A meta tensor has no bytes; the meta table logs the product's shape.
  auto data = [](const Tensor& t) { return t.is_meta() ? nullptr : t.data_ptr(); };
  dispatch(out.device()).gemm(out.dtype(), pa.trans, pb.trans, m, n, k, alpha, data(pa.t), pa.ld, data(pb.t), pb.ld,
                             beta, data(out), n);
}

}  // namespace

Shape matmul_shape(const Shape& a_in, const Shape& b_in) {
  TS_CHECK(!a_in.empty() && !b_in.empty(), "matmul: both operands need at least 1 dim, got {} and {}",
           shape_str(a_in), shape_str(b_in));
  Shape a = a_in.size() == 1 ? Shape{1, a_in[0]} : a_in;
  Shape b = b_in.size() == 1 ? Shape{b_in[0], 1} : b_in;
  const int64_t m = a[a.size() - 2], k = a.back(), k2 = b[b.size() - 2], n = b.back();
  TS_CHECK(k == k2, "matmul: shapes {} and {} do not align ({} != {})", shape_str(a_in), shape_str(b_in), k, k2);
  Shape out = broadcast_shapes(Shape(a.begin(), a.end() - 2), Shape(b.begin(), b.end() - 2), "matmul");
  if (a_in.size() > 1) out.push_back(m);
  if (b_in.size() > 1) out.push_back(n);
  return out;
}

Shape linear_shape(const Shape& x, const Shape& w) {
  TS_CHECK(w.size() == 2, "linear: weight must be 2-D [out, in], got {}", shape_str(w));
  TS_CHECK(!x.empty() && x.back() == w[1], "linear: input {} has {} features but weight {} expects {}", shape_str(x),
           x.empty() ? 0 : x.back(), shape_str(w), w[1]);
  Shape out = x;
  out.back() = w[0];
  return out;
}

Tensor matmul(const Tensor& a_in, const Tensor& b_in) {
  if (intercepts({&a_in, &b_in}))
    return intercept_one({OpId::matmul, "matmul", {a_in, b_in}, {},
                          [](const TensorList& l) { return TensorList{matmul(l[0], l[1])}; }});
  check_pair(a_in, b_in, "matmul");
  check_float(a_in, "matmul", "inputs");
  const Shape final_shape = matmul_shape(a_in.shape(), b_in.shape());
  // 1-D operands become matrices and lose that dim again at the end (torch.matmul rules).
  Tensor a = a_in.dim() == 1 ? unsqueeze(a_in, 0) : a_in;
  Tensor b = b_in.dim() == 1 ? unsqueeze(b_in, 1) : b_in;
  int64_t m = a.size(-2), k = a.size(-1), n = b.size(-1);
  Shape batch(final_shape.begin(), final_shape.end() - (a_in.dim() > 1) - (b_in.dim() > 1));
  Shape out_shape = batch;
  out_shape.push_back(m);
  out_shape.push_back(n);
  // On meta the same tensors are made (a planned step counts them) and no kernel runs.
  Tensor ac = upcast(a, kMatmul), bc = upcast(b, kMatmul);
  Tensor out = empty(out_shape, ac.dtype(), a.device());
  int64_t nb = shape_numel(batch);
  Shape ea = batch, eb = batch;
  ea.insert(ea.end(), {m, k});
  eb.insert(eb.end(), {k, n});
  Tensor ax = reshape(expand(ac, ea), {nb, m, k});  // views when the batch layout allows
  Tensor bx = reshape(expand(bc, eb), {nb, k, n});
  Tensor ox = reshape(out, {nb, m, n});
  for (int64_t i = 0; i < nb; ++i) gemm2d(select(ox, 0, i), select(ax, 0, i), select(bx, 0, i), 1.0, 0.0);
  return to(reshape(out, final_shape), a_in.dtype());
}

Tensor linear(const Tensor& x, const Tensor& w, const Tensor& b) {
  if (intercepts({&x, &w, &b}))
    return intercept_one({OpId::linear, "linear", {x, w, b}, {},
                          [](const TensorList& l) { return TensorList{linear(l[0], l[1], l[2])}; }});
  check_pair(x, w, "linear");
  check_float(x, "linear", "input");
  const Shape out_shape = linear_shape(x.shape(), w.shape());
  if (b.defined()) {
    check_pair(x, b, "linear (bias)");
    TS_CHECK(b.dim() == 1 && b.size(0) == w.size(0), "linear: bias {} does not match weight {}",
             shape_str(b.shape()), shape_str(w.shape()));
  }
  Tensor x2 = reshape(upcast(x, kMatmul), {leading_numel(x.shape()), w.size(1)});
  Tensor out = empty({x2.size(0), w.size(0)}, x2.dtype(), x.device());
  if (b.defined()) {
    Tensor bias = expand(upcast(b, kMatmul), out.shape());
    dispatch(x.device()).copy(out, bias);
  }
  gemm2d(out, x2, transpose(upcast(w, kMatmul), 0, 1), 1.0, b.defined() ? 1.0 : 0.0);
  return to(reshape(out, out_shape), x.dtype());
}

TensorList linear_backward(const Tensor& grad, const Tensor& x, const Tensor& w, std::array<bool, 3> need) {
  if (intercepts({&grad, &x, &w}))
    return intercept({OpId::linear_backward, "linear_backward", {grad, x, w}, {.need = need},
                      [need](const TensorList& l) { return linear_backward(l[0], l[1], l[2], need); }});
  TS_CHECK(linear_shape(x.shape(), w.shape()) == grad.shape(),
           "linear_backward: gradient {} is not the output of input {} and weight {}", shape_str(grad.shape()),
           shape_str(x.shape()), shape_str(w.shape()));
  const int64_t in = w.size(1), out = w.size(0), rows = leading_numel(grad.shape());
  Tensor g2 = reshape(grad, {rows, out});
  TensorList d(3);
  if (need[0]) {
    d[0] = empty({rows, in}, x.dtype(), x.device());
    gemm_into(d[0], g2, w);  // [N, out] @ [out, in]
    d[0] = reshape(d[0], x.shape());
  }
  if (need[1]) {
    d[1] = empty(w.shape(), w.dtype(), w.device());
    gemm_into(d[1], transpose(g2, 0, 1), reshape(x, {rows, in}));  // [out, N] @ [N, in]
  }
  if (need[2]) d[2] = sum(g2, {0});
  return d;
}

// ---- GELU after a bias ---------------------------------------------------------

namespace {

void check_bias_gelu(const Tensor& x, const Tensor& bias, const char* name) {
  TS_CHECK(is_floating(x.dtype()), "{}: expected a floating-point input, got {}", name, dtype_name(x.dtype()));
  TS_CHECK(bias.defined() && bias.dim() == 1 && x.dim() >= 1 && bias.size(0) == x.size(-1),
           "{}: bias {} does not match the last dim of input {} (expected [{}])", name,
           bias.defined() ? shape_str(bias.shape()) : "(none)", shape_str(x.shape()), x.dim() >= 1 ? x.size(-1) : 0);
  check_pair(x, bias, name);
}

// The fused kernels run where the device has them and computes in x's dtype.
bool fused_bias_gelu(const Tensor& x, OpId op) {
  Kernels k = dispatch(x.device());
  return k.supports(op) && k.compute_dtype(KernelFamily::Elementwise, x.dtype()) == x.dtype();
}

UnaryOp gelu_op(bool tanh_approx) { return tanh_approx ? UnaryOp::GeluTanh : UnaryOp::Gelu; }

}  // namespace

Tensor bias_gelu(const Tensor& x, const Tensor& bias, bool tanh_approx) {
  if (intercepts({&x, &bias}))
    return intercept_one({OpId::bias_gelu, "bias_gelu", {x, bias}, {}, [tanh_approx](const TensorList& l) {
                            return TensorList{bias_gelu(l[0], l[1], tanh_approx)};
                          }});
  check_bias_gelu(x, bias, "bias_gelu");
  if (!fused_bias_gelu(x, OpId::bias_gelu)) return unary(gelu_op(tanh_approx), add(x, bias));
  Tensor out = empty(x.shape(), x.dtype(), x.device());
  dispatch(x.device()).bias_gelu(out, contiguous(x), contiguous(bias), tanh_approx);
  return out;
}

TensorList bias_gelu_backward(const Tensor& grad, const Tensor& x, const Tensor& bias, bool tanh_approx) {
  if (intercepts({&grad, &x, &bias}))
    return intercept({OpId::bias_gelu_backward, "bias_gelu_backward", {grad, x, bias}, {},
                      [tanh_approx](const TensorList& l) { return bias_gelu_backward(l[0], l[1], l[2], tanh_approx); }});
  check_bias_gelu(x, bias, "bias_gelu_backward");
  TS_CHECK(grad.shape() == x.shape() && grad.dtype() == x.dtype(),
           "bias_gelu_backward: gradient {} is not laid out as input {}", grad.str(), x.str());
  if (!fused_bias_gelu(x, OpId::bias_gelu_backward)) {
    Tensor gx = unary_backward(gelu_op(tanh_approx), grad, add(x, bias), Tensor());
    return {gx, sum_to(gx, bias.shape())};
  }
  const bool widened = x.dtype() == DType::BF16 || x.dtype() == DType::F16;
  Tensor gx = empty(x.shape(), x.dtype(), x.device());
  Tensor gbias = empty(bias.shape(), widened ? DType::F32 : x.dtype(), x.device());
  dispatch(x.device()).bias_gelu_backward(gx, gbias, contiguous(grad), contiguous(x), contiguous(bias), tanh_approx);
  return {gx, to(gbias, x.dtype())};
}

void gemm_into(Tensor& out, const Tensor& a, const Tensor& b, double alpha, bool accumulate) {
  if (intercepts({&out, &a, &b})) {
    intercept({OpId::gemm_into, "gemm_into", {out, a, b}});
    return;
  }
  TS_CHECK(a.dim() == 2 && b.dim() == 2 && out.dim() == 2 && a.size(1) == b.size(0) &&
               out.size(0) == a.size(0) && out.size(1) == b.size(1),
           "gemm_into: shapes {} @ {} -> {} do not align", shape_str(a.shape()),
           shape_str(b.shape()), shape_str(out.shape()));
  check_pair(a, b, "gemm_into");
  check_pair(out, a, "gemm_into");
  bool direct =
      out.is_contiguous() && compute_dtype(out.device(), kMatmul, out.dtype()) == out.dtype();
  Tensor target = direct ? out : kernel_input(out, kMatmul);
  gemm2d(target, upcast(a, kMatmul), upcast(b, kMatmul), alpha, accumulate ? 1.0 : 0.0);
  if (!direct) dispatch(out.device()).copy(out, target);
}

// ---- softmax ----------------------------------------------------------------

namespace {
// Runs a last-dim row kernel on x with `dim` moved last; returns the result in x's layout.
template <class F>
Tensor along_last(const Tensor& x, int64_t dim, F&& f) {
  dim = wrap_dim(dim, x.dim(), "softmax");
  Tensor moved = x.dim() == 0 ? reshape(x, {1}) : kernel_input(transpose(x, dim, -1), kSoftmax);
  Tensor out = empty(moved.shape(), moved.dtype(), x.device());
  f(out, moved);
  if (x.dim() == 0) return to(reshape(out, {}), x.dtype());
  return to(contiguous(transpose(out, dim, -1)), x.dtype());
}
}  // namespace

namespace {
// The dims a softmax over `dim` treats independently: all the others.
std::vector<int64_t> all_but(int64_t dim, int64_t nd, const char* op) {
  dim = wrap_dim(dim, nd, op);
  std::vector<int64_t> free;
  for (int64_t d = 0; d < nd; ++d)
    if (d != dim) free.push_back(d);
  return free;
}
}  // namespace

Tensor softmax(const Tensor& x, int64_t dim) {
  if (x.is_subclass())
    return intercept_one({OpId::softmax, "softmax", {x}, {.dims = all_but(dim, x.dim(), "softmax"), .out_like = {0}},
                          [dim](const TensorList& l) { return TensorList{softmax(l[0], dim)}; }});
  check_float(x, "softmax", "input");
  return along_last(x, dim, [&](const Tensor& o, const Tensor& m) { dispatch(x.device()).softmax(o, m, false); });
}

Tensor log_softmax(const Tensor& x, int64_t dim) {
  if (x.is_subclass())
    return intercept_one({OpId::log_softmax, "log_softmax", {x},
                          {.dims = all_but(dim, x.dim(), "log_softmax"), .out_like = {0}},
                          [dim](const TensorList& l) { return TensorList{log_softmax(l[0], dim)}; }});
  check_float(x, "log_softmax", "input");
  return along_last(x, dim, [&](const Tensor& o, const Tensor& m) { dispatch(x.device()).softmax(o, m, true); });
}

namespace {
Tensor softmax_backward_impl(const Tensor& grad, const Tensor& y, int64_t dim, bool log) {
  dim = wrap_dim(dim, y.dim(), "softmax_backward");
  Tensor g = y.dim() == 0 ? reshape(grad, {1}) : kernel_input(transpose(grad, dim, -1), kSoftmax);
  return along_last(y, dim, [&](const Tensor& o, const Tensor& ym) {
    dispatch(y.device()).softmax_backward(o, g, ym, log);
  });
}
}  // namespace

Tensor softmax_backward(const Tensor& grad, const Tensor& y, int64_t dim) {
  if (intercepts({&grad, &y}))
    return intercept_one({OpId::softmax_backward, "softmax_backward", {grad, y},
                          {.dims = all_but(dim, y.dim(), "softmax_backward"), .out_like = {1}},
                          [dim](const TensorList& l) { return TensorList{softmax_backward(l[0], l[1], dim)}; }});
  return softmax_backward_impl(grad, y, dim, false);
}
Tensor log_softmax_backward(const Tensor& grad, const Tensor& y, int64_t dim) {
  if (intercepts({&grad, &y}))
    return intercept_one({OpId::log_softmax_backward, "log_softmax_backward", {grad, y},
                          {.dims = all_but(dim, y.dim(), "log_softmax_backward"), .out_like = {1}},
                          [dim](const TensorList& l) { return TensorList{log_softmax_backward(l[0], l[1], dim)}; }});
  return softmax_backward_impl(grad, y, dim, true);
}

// ---- normalisation -------------------------------------------------------------

namespace {
void check_norm_args(const Tensor& x, const Tensor& w, const Tensor& b, const char* op) {
  check_float(x, op, "input");
  TS_CHECK(x.dim() >= 1, "{}: input must have at least 1 dim", op);
  int64_t c = x.size(-1);
  for (const Tensor* p : {&w, &b}) {
    if (!p->defined()) continue;
    check_pair(x, *p, op);
    TS_CHECK(p->dim() == 1 && p->size(0) == c,
             "{}: weight/bias shape {} does not match normalised size {}", op,
             shape_str(p->shape()), c);
  }
}

NormResult norm_forward(const Tensor& x, const Tensor& w, const Tensor& b, double eps, bool rms) {
  const char* op = rms ? "rms_norm" : "layer_norm";
  if (intercepts({&x, &w, &b})) {
    TensorList r = intercept({rms ? OpId::rms_norm : OpId::layer_norm, op, {x, w, b}, {},
                              [eps, rms](const TensorList& l) {
                                NormResult n = norm_forward(l[0], l[1], l[2], eps, rms);
                                return TensorList{n.y, n.mean, n.rstd};
                              }});
    return {r[0], r[1], r[2]};
  }
  check_norm_args(x, w, b, op);
  Shape rows(x.shape().begin(), x.shape().end() - 1);
  DType cd = compute_dtype(x.device(), kNorm, x.dtype()), sd = stats_dtype(cd);
  Tensor xc = kernel_input(x, kNorm);
  NormResult r{empty(x.shape(), cd, x.device()), rms ? Tensor() : empty(rows, sd, x.device()),
               empty(rows, sd, x.device())};
  Tensor wc = w.defined() ? kernel_input(w, kNorm) : Tensor();
  Tensor bc = b.defined() ? kernel_input(b, kNorm) : Tensor();
  dispatch(x.device()).layer_norm(r, xc, wc, bc, eps, rms);
  r.y = to(r.y, x.dtype());
  return r;
}

NormGrads norm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& mean,
                        const Tensor& rstd, bool need_wb, bool has_bias, bool rms) {
  if (intercepts({&dy, &x, &w})) {
    const OpId id = rms ? OpId::rms_norm_backward : OpId::layer_norm_backward;
    TensorList g = intercept({id, op_name(id), {dy, x, w, mean, rstd},
                              {.need = {true, need_wb && w.defined(), need_wb && has_bias}},
                              [need_wb, has_bias, rms](const TensorList& l) {
                                NormGrads n = norm_backward(l[0], l[1], l[2], l[3], l[4], need_wb, has_bias, rms);
                                return TensorList{n.dx, n.dweight, n.dbias};
                              }});
    return {g[0], g[1], g[2]};
  }
  TS_CHECK(dy.shape() == x.shape(), "{}_backward: grad shape {} vs input {}",
           rms ? "rms_norm" : "layer_norm", shape_str(dy.shape()), shape_str(x.shape()));
  DType cd = compute_dtype(x.device(), kNorm, x.dtype());
  int64_t c = x.size(-1);
  NormGrads g{empty(x.shape(), cd, x.device()),
              need_wb && w.defined() ? empty({c}, cd, x.device()) : Tensor(),
              need_wb && has_bias ? empty({c}, cd, x.device()) : Tensor()};
  {
    Tensor dyc = kernel_input(dy, kNorm), xc = kernel_input(x, kNorm);
    Tensor wc = w.defined() ? kernel_input(w, kNorm) : Tensor();
    dispatch(x.device()).layer_norm_backward(g, dyc, xc, wc, mean, rstd, rms);
  }
  g.dx = to(g.dx, x.dtype());
  if (g.dweight.defined()) g.dweight = to(g.dweight, w.dtype());
  if (g.dbias.defined()) g.dbias = to(g.dbias, w.dtype());
  return g;
}
}  // namespace

NormResult layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  return norm_forward(x, weight, bias, eps, false);
}

NormGrads layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                              const Tensor& mean, const Tensor& rstd, bool need_weight_grads) {
  return norm_backward(dy, x, weight, mean, rstd, need_weight_grads, need_weight_grads, false);
}

NormResult rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  return norm_forward(x, weight, Tensor(), eps, true);
}

NormGrads rms_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                            const Tensor& rstd, bool need_weight_grad) {
  return norm_backward(dy, x, weight, Tensor(), rstd, need_weight_grad, false, true);
}

namespace {
AddNormResult add_norm_forward(const Tensor& x, const Tensor& residual, const Tensor& w, const Tensor& b,
                               double eps, bool rms) {
  const char* op = rms ? "add_rms_norm" : "add_layer_norm";
  auto unfused = [&] {
    Tensor sum = add(x, residual);
    return AddNormResult{sum, norm_forward(sum, w, b, eps, rms)};
  };
  if (intercepts({&x, &residual, &w, &b})) return unfused();  // a DTensor: the two ops' rules
  check_norm_args(x, w, b, op);
  check_pair(x, residual, op);
  TS_CHECK(residual.shape() == x.shape(), "{}: residual {} is not shaped as input {}", op,
           shape_str(residual.shape()), shape_str(x.shape()));
  // A device without the fused kernel, or computing x's dtype in another, runs the two ops.
  Kernels k = dispatch(x.device());
  if (!k.supports(OpId::add_layer_norm) || k.compute_dtype(kNorm, x.dtype()) != x.dtype()) return unfused();
  Shape rows(x.shape().begin(), x.shape().end() - 1);
  const DType sd = stats_dtype(x.dtype());
  AddNormResult r{empty(x.shape(), x.dtype(), x.device()),
                  {empty(x.shape(), x.dtype(), x.device()), rms ? Tensor() : empty(rows, sd, x.device()),
                   empty(rows, sd, x.device())}};
  k.add_layer_norm(r.norm, r.sum, contiguous(x), contiguous(residual), w.defined() ? contiguous(w) : Tensor(),
                   b.defined() ? contiguous(b) : Tensor(), eps, rms);
  return r;
}
}  // namespace

AddNormResult add_layer_norm(const Tensor& x, const Tensor& residual, const Tensor& weight, const Tensor& bias,
                             double eps) {
  return add_norm_forward(x, residual, weight, bias, eps, false);
}

AddNormResult add_rms_norm(const Tensor& x, const Tensor& residual, const Tensor& weight, double eps) {
  return add_norm_forward(x, residual, weight, Tensor(), eps, true);
}

// ---- embedding, cross-entropy -------------------------------------------------

Tensor embedding(const Tensor& weight, const Tensor& indices) {
  if (intercepts({&weight, &indices}))  // e.g. a vocabulary-parallel table
    return intercept_one({OpId::embedding, "embedding", {weight, indices}, {},
                          [](const TensorList& l) { return TensorList{embedding(l[0], l[1])}; }});
  TS_CHECK(weight.dim() == 2, "embedding: weight must be 2-D [num, dim], got {}",
           shape_str(weight.shape()));
  TS_CHECK(indices.dtype() == DType::I64 || indices.dtype() == DType::I32,
           "embedding: indices must be i32 or i64, got {}", dtype_name(indices.dtype()));
  TS_CHECK(weight.device() == indices.device(), "embedding: weight on {} but indices on {}",
           weight.device().str(), indices.device().str());
  Shape shape = indices.shape();
  shape.push_back(weight.size(1));
  Tensor out = empty(shape, weight.dtype(), weight.device());
  dispatch(weight.device()).embedding(out, contiguous(weight), contiguous(indices));
  return out;
}

Tensor embedding_backward(const Tensor& grad, const Tensor& indices, int64_t num_weights) {
  if (intercepts({&grad, &indices}))  // without the table, no layout for its gradient
    return intercept_one({OpId::embedding_backward, "embedding_backward", {grad, indices}});
  TS_CHECK(grad.dim() >= 1 && indices.numel() == leading_numel(grad.shape()),
           "embedding_backward: the gradient {} has {} rows, but there are {} indices {}", shape_str(grad.shape()),
           grad.dim() >= 1 ? leading_numel(grad.shape()) : 0, indices.numel(), shape_str(indices.shape()));
  TS_CHECK(num_weights >= 0, "embedding_backward: a table of {} rows", num_weights);
  TS_CHECK(grad.device() == indices.device(), "embedding_backward: gradient on {} but indices on {}",
           grad.device().str(), indices.device().str());
  int64_t d = grad.size(-1);
  // Summed in f32 (f64 for f64) even where a backend computes bf16 natively,
  // as PyTorch does: a frequent token's row, added to in bf16 thousands of
  // times, would stop growing (256 + 1 is 256 in bf16).
  // bf16/f16 read where they lie where the kernel widens them.
  const DType acc = stats_dtype(compute_dtype(grad.device(), kEmbedding, grad.dtype()));
  const bool widens = acc == DType::F32 && grad.dtype() != acc && dispatch(grad.device()).table().sums_widen;
  Tensor gw = zeros({num_weights, d}, acc, grad.device());
  {
    Tensor rows = reshape(widens ? contiguous(grad) : to(kernel_input(grad, kEmbedding), acc),
                          {leading_numel(grad.shape()), d});
    Tensor ids = contiguous(indices);
    dispatch(grad.device()).embedding_backward(gw, rows, ids);
  }
  return to(gw, grad.dtype());
}

Tensor embedding_backward(const Tensor& grad, const Tensor& indices, const Tensor& weight) {
  if (intercepts({&grad, &indices, &weight}))
    return intercept_one({OpId::embedding_backward, "embedding_backward", {grad, indices, weight}, {},
                          [](const TensorList& l) { return TensorList{embedding_backward(l[0], l[1], l[2].size(0))}; }});
  return embedding_backward(grad, indices, weight.size(0));
}

CrossEntropyResult cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index) {
  if (intercepts({&logits, &target})) {  // e.g. loss parallelism: logits split on the classes
    TensorList r = intercept({OpId::cross_entropy, "cross_entropy", {logits, target}, {.ignore_index = ignore_index},
                              [ignore_index](const TensorList& l) {
                                CrossEntropyResult c = cross_entropy(l[0], l[1], ignore_index);
                                return TensorList{c.loss, c.lse, c.count};
                              }});
    return {r[0], r[1], r[2]};
  }
  check_float(logits, "cross_entropy", "logits");
  TS_CHECK(logits.dim() == 2, "cross_entropy: logits must be [N, C], got {}",
           shape_str(logits.shape()));
  TS_CHECK(target.dtype() == DType::I64 || target.dtype() == DType::I32,
           "cross_entropy: targets must be i64 (class indices), got {}", dtype_name(target.dtype()));
  TS_CHECK(target.dim() == 1 && target.size(0) == logits.size(0),
           "cross_entropy: targets {} do not match logits {} (expected [{}])",
           shape_str(target.shape()), shape_str(logits.shape()), logits.size(0));
  DType cd = compute_dtype(logits.device(), kCrossEntropy, logits.dtype());
  int64_t n = logits.size(0);
  Tensor t = contiguous(to(target, DType::I64));
  Tensor losses = empty({n}, stats_dtype(cd), logits.device());
  Tensor lse = empty({n}, stats_dtype(cd), logits.device());
  {
    Tensor input = kernel_input(logits, kCrossEntropy);
    dispatch(logits.device()).cross_entropy(losses, lse, input, t, ignore_index);
  }
  // The mean over counted targets stays on the device: no host sync per step.
  Tensor count = sum(binary(BinaryOp::Ne, t, static_cast<double>(ignore_index)), {}, false, DType::F64);
  Tensor total = sum(losses, {}, false, DType::F64);
  Tensor loss = div(total, binary(BinaryOp::Maximum, count, 1.0));  // 0 when every target is ignored
  return {to(loss, logits.dtype()), lse, count};
}

Tensor cross_entropy_backward(const Tensor& grad_loss, const Tensor& logits, const Tensor& target,
                              const Tensor& lse, int64_t ignore_index, const Tensor& count) {
  if (intercepts({&grad_loss, &logits, &target, &lse, &count}))
    return intercept_one({OpId::cross_entropy_backward, "cross_entropy_backward", {grad_loss, logits, target, lse, count},
                          {.ignore_index = ignore_index}, [ignore_index](const TensorList& l) {
                            return TensorList{cross_entropy_backward(l[0], l[1], l[2], l[3], ignore_index, l[4])};
                          }});
  check_float(logits, "cross_entropy_backward", "logits");
  TS_CHECK(logits.dim() == 2, "cross_entropy_backward: logits must be [N, C], got {}", shape_str(logits.shape()));
  const int64_t n = logits.size(0);
  TS_CHECK((target.dtype() == DType::I64 || target.dtype() == DType::I32) && target.dim() == 1 &&
               target.size(0) == n,
           "cross_entropy_backward: targets must be i64 or i32 [{}] for logits {}, got {} {}", n,
           shape_str(logits.shape()), dtype_name(target.dtype()), shape_str(target.shape()));
  TS_CHECK(lse.numel() == n && grad_loss.numel() == 1 && count.numel() == 1,
           "cross_entropy_backward: expected lse of {} rows and a scalar gradient and count, got lse {}, "
           "gradient {}, count {}",
           n, shape_str(lse.shape()), shape_str(grad_loss.shape()), shape_str(count.shape()));
  DType cd = compute_dtype(logits.device(), kCrossEntropy, logits.dtype());
  Tensor g = empty(logits.shape(), cd, logits.device());
  {
    Tensor scale = contiguous(div(to(grad_loss, DType::F64), binary(BinaryOp::Maximum, count, 1.0)));
    Tensor input = kernel_input(logits, kCrossEntropy), t = contiguous(to(target, DType::I64));
    dispatch(logits.device()).cross_entropy_backward(g, scale, input, t, lse, ignore_index);
  }
  return to(g, logits.dtype());
}

// ---- attention ----------------------------------------------------------------

namespace {
void check_attention(const Tensor& q, const Tensor& k, const Tensor& v) {
  check_float(q, "attention", "q");
  check_pair(q, k, "attention");
  check_pair(q, v, "attention");
  TS_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
           "attention: q, k, v must be 4-D [batch, heads, seq, head_dim]; got {}, {}, {}",
           shape_str(q.shape()), shape_str(k.shape()), shape_str(v.shape()));
  TS_CHECK(k.shape() == v.shape(), "attention: k {} and v {} differ", shape_str(k.shape()),
           shape_str(v.shape()));
  TS_CHECK(q.size(0) == k.size(0) && q.size(3) == k.size(3),
           "attention: q {} and k {} differ in batch or head_dim", shape_str(q.shape()),
           shape_str(k.shape()));
  TS_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0,
           "attention: {} query heads are not a multiple of {} key/value heads", q.size(1),
           k.size(1));
}

// An attention kernel's operand in its compute dtype: as it lies where the
// backend reads strided operands, head_dim has unit stride and a head's
// tokens are rows at least head_dim apart (q, k and v split from one
// [B, T, 3C] projection are read in place), else contiguous.
Tensor attention_input(const Tensor& x, const Kernels& k) {
  Tensor u = upcast(x, kAttention);
  bool readable = (u.stride(3) == 1 || u.size(3) <= 1) && u.stride(2) >= std::max<int64_t>(1, u.size(3)) &&
                  u.stride(1) >= 0 && u.stride(0) >= 0;
  return k.table().strided_attention && readable ? u : contiguous(u);
}

// Whether x [B, H, T, D] keeps a token's heads closer together than a head's
// tokens (a view of a [B, T, H * D] projection): its gradient is laid out so.
bool token_major(const Tensor& x) { return x.size(1) > 1 && x.size(2) > 1 && x.stride(1) < x.stride(2); }

// A new [B, H, T, D] output of the attention kernels. Where they write
// strided outputs and `by_token`, it lies in memory as [B, T, H, D] (the
// heads of a token side by side, as PyTorch's CPU flash attention lays its
// output: merge_heads of out, and the gradients of q, k, v split from one
// projection, are then views); else contiguous.
Tensor attention_output(const Shape& s, DType dtype, Device device, const Kernels& k, bool by_token) {
  if (!k.table().strided_attention || !by_token) return empty(s, dtype, device);
  return transpose(empty({s[0], s[2], s[1], s[3]}, dtype, device), 1, 2);
}
}  // namespace

AttentionResult attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                          double scale) {
  if (intercepts({&q, &k, &v})) {  // independent over batch and heads
    TensorList r = intercept({OpId::attention, "attention", {q, k, v}, {.dims = {0, 1}, .out_like = {0, 0}},
                              [=](const TensorList& l) {
                                AttentionResult a = attention(l[0], l[1], l[2], causal, scale);
                                return TensorList{a.out, a.lse};
                              }});
    return {r[0], r[1]};
  }
  check_attention(q, k, v);
  DType cd = compute_dtype(q.device(), kAttention, q.dtype());
  Shape lse_shape(q.shape().begin(), q.shape().end() - 1);
  DType sd = stats_dtype(cd);
  Kernels kt = dispatch(q.device());
  AttentionResult r{attention_output(q.shape(), cd, q.device(), kt, /*by_token=*/true), empty(lse_shape, sd, q.device())};
  {
    Tensor qc = attention_input(q, kt), kc = attention_input(k, kt), vc = attention_input(v, kt);
    kt.attention(r, qc, kc, vc, causal, scale);
  }
  r.out = to(r.out, q.dtype());
  return r;
}

AttentionGrads attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k,
                                  const Tensor& v, const Tensor& out, const Tensor& lse,
                                  bool causal, double scale) {
  if (intercepts({&dout, &q, &k, &v, &out, &lse})) {
    TensorList r = intercept({OpId::attention_backward, "attention_backward", {dout, q, k, v, out, lse},
                              {.dims = {0, 1}, .out_like = {1, 2, 3}}, [=](const TensorList& l) {
                                AttentionGrads a = attention_backward(l[0], l[1], l[2], l[3], l[4], l[5], causal, scale);
                                return TensorList{a.dq, a.dk, a.dv};
                              }});
    return {r[0], r[1], r[2]};
  }
  check_attention(q, k, v);
  DType cd = compute_dtype(q.device(), kAttention, q.dtype());
  Kernels kt = dispatch(q.device());
  AttentionGrads g{attention_output(q.shape(), cd, q.device(), kt, token_major(q)),
                   attention_output(k.shape(), cd, q.device(), kt, token_major(k)),
                   attention_output(v.shape(), cd, q.device(), kt, token_major(v))};
  {
    // dout and out in q's dtype (a native kernel reads all five as one storage type).
    Tensor dc = attention_input(to(dout, q.dtype()), kt), qc = attention_input(q, kt);
    Tensor kc = attention_input(k, kt), vc = attention_input(v, kt);
    Tensor oc = attention_input(to(out, q.dtype()), kt), lc = contiguous(to(lse, stats_dtype(cd)));
    kt.attention_backward(g, dc, qc, kc, vc, oc, lc, causal, scale);
  }
  return {to(g.dq, q.dtype()), to(g.dk, k.dtype()), to(g.dv, v.dtype())};
}

Tensor attention_reference(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                           double scale) {
  check_attention(q, k, v);
  int64_t group = q.size(1) / k.size(1);
  Tensor kk = k, vv = v;
  if (group > 1) {  // repeat each key/value head for its group of query heads
    Shape s{k.size(0), k.size(1), group, k.size(2), k.size(3)};
    kk = reshape(expand(unsqueeze(k, 2), s), {k.size(0), q.size(1), k.size(2), k.size(3)});
    vv = reshape(expand(unsqueeze(v, 2), s), {k.size(0), q.size(1), k.size(2), k.size(3)});
  }
  Tensor scores = mul(matmul(q, transpose(kk, -2, -1)), scale);
  if (causal) {
    int64_t t = q.size(2), s = k.size(2);
    Tensor qi = reshape(arange(0, t), {t, 1}), kj = reshape(arange(0, s), {1, s});
    Tensor masked = binary(BinaryOp::Gt, kj, qi);
    scores = where(masked, full({}, -INFINITY, scores.dtype()), scores);
  }
  return matmul(softmax(scores, -1), vv);
}

Tensor rope(const Tensor& x, const Tensor& cos, const Tensor& sin, bool inverse) {
  if (x.is_subclass()) {  // independent over the dims before the positions [.., T, D]
    std::vector<int64_t> free;
    for (int64_t d = 0; d + 2 < x.dim(); ++d) free.push_back(d);
    return intercept_one({OpId::rope, "rope", {x, cos, sin}, {.dims = free, .out_like = {0}},
                          [inverse](const TensorList& l) { return TensorList{rope(l[0], l[1], l[2], inverse)}; }});
  }
  check_float(x, "rope", "input");
  TS_CHECK(x.dim() >= 2 && x.size(-1) % 2 == 0, "rope: input {} needs an even last dim",
           shape_str(x.shape()));
  int64_t t = x.size(-2), half = x.size(-1) / 2;
  TS_CHECK(cos.dim() == 2 && cos.size(0) >= t && cos.size(1) == half && sin.shape() == cos.shape(),
           "rope: cos/sin {} must be [>= {}, {}]", shape_str(cos.shape()), t, half);
  DType cd = compute_dtype(x.device(), kRope, x.dtype());
  Tensor out = empty(x.shape(), cd, x.device());
  {
    Tensor xc = kernel_input(x, kRope);
    // The angles in the compute dtype's statistics dtype (f32 for bf16/f16).
    DType ad = stats_dtype(cd);
    Tensor c = contiguous(to(narrow(cos, 0, 0, t), ad)), s = contiguous(to(narrow(sin, 0, 0, t), ad));
    dispatch(x.device()).rope(out, xc, c, s, inverse);
  }
  return to(out, x.dtype());
}

}  // namespace tessera::ops
