// Differentiable matrix products and neural-network ops.
#include <cmath>

#include "autograd/functions.h"
#include "runtime/kernels.h"
#include "runtime/op_call.h"
#include "runtime/profiler.h"

namespace tessera {

using autograd::record;
using autograd::should_record;

Tensor matmul(const Tensor& a, const Tensor& b) {
  TS_PROFILE("matmul");
  Tensor y = ops::matmul(a, b);
  if (should_record({a, b})) {
    bool ga = a.requires_grad(), gb = b.requires_grad();
    // The gradients of the operands asked for (a split backward asks for them apart).
    auto grads = [a, b](const TensorList& g, bool want_a, bool want_b) {
      // Work on the >= 2-D forms (1-D operands were unsqueezed in the forward).
      Tensor a2 = a.dim() == 1 ? ops::unsqueeze(a, 0) : a;
      Tensor b2 = b.dim() == 1 ? ops::unsqueeze(b, 1) : b;
      Tensor g2 = g[0];
      if (a.dim() == 1) g2 = ops::unsqueeze(g2, g2.dim() - (b.dim() == 1 ? 0 : 1));
      if (b.dim() == 1) g2 = ops::unsqueeze(g2, -1);
      Tensor da, db;
      if (want_a) da = ops::reshape(ops::sum_to(ops::matmul(g2, ops::transpose(b2, -1, -2)), a2.shape()), a.shape());
      if (want_b) db = ops::reshape(ops::sum_to(ops::matmul(ops::transpose(a2, -1, -2), g2), b2.shape()), b.shape());
      return TensorList{da, db};
    };
    record(
        "matmul", {a, b}, {y}, [grads, ga, gb](const TensorList& g) { return grads(g, ga, gb); },
        [grads](const TensorList& g, const std::vector<bool>& want) { return grads(g, want[0], want[1]); });
  }
  return y;
}

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  TS_PROFILE("linear");
  // Selective checkpointing: a kept product is taken back, not recomputed.
  autograd::SavedOutputs* saved = autograd::saved_outputs();
  Tensor y = saved && saved->replaying() ? saved->take("linear")[0] : ops::linear(x, weight, bias);
  if (saved && !saved->replaying()) saved->stash({y});
  if (should_record({x, weight, bias})) {
    bool gx = x.requires_grad(), gw = weight.requires_grad();
    bool gb = bias.defined() && bias.requires_grad();
    record(
        "linear", {x, weight, bias}, {y},
        [x, weight, gx, gw, gb](const TensorList& g) { return ops::linear_backward(g[0], x, weight, {gx, gw, gb}); },
        [x, weight](const TensorList& g, const std::vector<bool>& want) {
          return ops::linear_backward(g[0], x, weight, {want[0], want[1], want[2]});
        });
  }
  return y;
}

Tensor linear_gelu(const Tensor& x, const Tensor& weight, const Tensor& bias, bool tanh_approximation) {
  // In bf16 and f16 the fused backward's rounding of x + bias to 16 bits costs
  // more than the bias-gradient pass it saves (a sum that reads 16-bit values
  // where they lie): c_fc and GELU ran 0.94-0.98x unfused on the AVX-512 Xeon
  // (benchmarks/bench_kernels), so there the product takes the bias.
  const bool fused = bias.defined() && (x.dtype() == DType::F32 || x.dtype() == DType::F64);
  if (!fused) return gelu(linear(x, weight, bias), tanh_approximation);
  TS_PROFILE("linear_gelu");
  // Two nodes, as linear then gelu: the product without its bias (linear's,
  // which selective checkpointing keeps; GELU is recomputed), then bias and
  // GELU. So the backward lets go of GELU's input and incoming gradient
  // before the product's backward runs, as the unfused ops do (one node
  // holding both through the product's backward planned 7.2 MiB more for
  // the default model at 2 ranks).
  Tensor h = linear(x, weight, Tensor());
  Tensor y = ops::bias_gelu(h, bias, tanh_approximation);
  if (should_record({h, bias})) {
    auto grads = [h, bias, tanh_approximation](const TensorList& g, bool want_h, bool want_b) {
      TensorList d = ops::bias_gelu_backward(g[0], h, bias, tanh_approximation);
      return TensorList{want_h ? d[0] : Tensor(), want_b ? d[1] : Tensor()};
    };
    bool gh = h.requires_grad(), gb = bias.requires_grad();
    record(
        "bias_gelu", {h, bias}, {y}, [grads, gh, gb](const TensorList& g) { return grads(g, gh, gb); },
        [grads](const TensorList& g, const std::vector<bool>& want) { return grads(g, want[0], want[1]); });
  }
  return y;
}

namespace {

// The fused kernels on plain tensors (through the op's rule on DTensors, the
// same two ops where the device has no fused kernel).
Tensor swiglu_forward(const Tensor& gate, const Tensor& up) {
  if (intercepts({&gate, &up}))
    return intercept_one({OpId::swiglu, "swiglu", {gate, up}, {},
                          [](const TensorList& l) { return TensorList{swiglu_forward(l[0], l[1])}; }});
  TS_CHECK(gate.shape() == up.shape() && gate.dtype() == up.dtype() && gate.device() == up.device(),
           "swiglu: gate {} and up {} differ (expected one shape, dtype and device)", gate.str(), up.str());
  TS_CHECK(is_floating(gate.dtype()), "swiglu: expected floating-point tensors, got {}", dtype_name(gate.dtype()));
  Kernels k = dispatch(gate.device());
  if (!k.supports(OpId::swiglu) || k.compute_dtype(KernelFamily::Elementwise, gate.dtype()) != gate.dtype())
    return ops::mul(ops::unary(ops::UnaryOp::Silu, gate), up);
  Tensor out = empty(gate.shape(), gate.dtype(), gate.device());
  k.swiglu(out, ops::contiguous(gate), ops::contiguous(up));
  return out;
}

TensorList swiglu_backward(const Tensor& grad, const Tensor& gate, const Tensor& up) {
  if (intercepts({&grad, &gate, &up}))
    return intercept({OpId::swiglu_backward, "swiglu_backward", {grad, gate, up}, {},
                      [](const TensorList& l) { return swiglu_backward(l[0], l[1], l[2]); }});
  Kernels k = dispatch(gate.device());
  if (!k.supports(OpId::swiglu_backward) || k.compute_dtype(KernelFamily::Elementwise, gate.dtype()) != gate.dtype()) {
    Tensor a = ops::unary(ops::UnaryOp::Silu, gate);
    return {ops::unary_backward(ops::UnaryOp::Silu, ops::mul(grad, up), gate, Tensor()), ops::mul(grad, a)};
  }
  TensorList d = {empty(gate.shape(), gate.dtype(), gate.device()), empty(up.shape(), up.dtype(), up.device())};
  k.swiglu_backward(d[0], d[1], ops::contiguous(grad), ops::contiguous(gate), ops::contiguous(up));
  return d;
}

}  // namespace

Tensor swiglu(const Tensor& gate, const Tensor& up) {
  TS_PROFILE("swiglu");
  Tensor y = swiglu_forward(gate, up);
  if (should_record({gate, up}))
    record("swiglu", {gate, up}, {y}, [gate, up](const TensorList& g) { return swiglu_backward(g[0], gate, up); });
  return y;
}

Tensor softmax(const Tensor& x, int64_t dim) {
  TS_PROFILE("softmax");
  Tensor y = ops::softmax(x, dim);
  if (should_record({x})) {
    Tensor saved = autograd::detach(y);
    record("softmax", {x}, {y}, [saved, dim](const TensorList& g) {
      return TensorList{ops::softmax_backward(g[0], saved, dim)};
    });
  }
  return y;
}

Tensor log_softmax(const Tensor& x, int64_t dim) {
  TS_PROFILE("log_softmax");
  Tensor y = ops::log_softmax(x, dim);
  if (should_record({x})) {
    Tensor saved = autograd::detach(y);
    record("log_softmax", {x}, {y}, [saved, dim](const TensorList& g) {
      return TensorList{ops::log_softmax_backward(g[0], saved, dim)};
    });
  }
  return y;
}

Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  TS_PROFILE("layer_norm");
  ops::NormResult r = ops::layer_norm(x, weight, bias, eps);
  if (should_record({x, weight, bias})) {
    bool want_wb = weight.requires_grad() || (bias.defined() && bias.requires_grad());
    Tensor mean = r.mean, rstd = r.rstd;
    record("layer_norm", {x, weight, bias}, {r.y},
           [x, weight, mean, rstd, want_wb](const TensorList& g) {
             ops::NormGrads d = ops::layer_norm_backward(g[0], x, weight, mean, rstd, want_wb);
             return TensorList{d.dx, d.dweight, d.dbias};
           });
  }
  return r.y;
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  TS_PROFILE("rms_norm");
  ops::NormResult r = ops::rms_norm(x, weight, eps);
  if (should_record({x, weight})) {
    bool want_w = weight.defined() && weight.requires_grad();
    Tensor rstd = r.rstd;
    record("rms_norm", {x, weight}, {r.y}, [x, weight, rstd, want_w](const TensorList& g) {
      ops::NormGrads d = ops::rms_norm_backward(g[0], x, weight, rstd, want_w);
      return TensorList{d.dx, d.dweight};
    });
  }
  return r.y;
}

namespace {

// The sum is saved detached (a node's closure holding its own output would
// keep both alive) and is what the norm's backward reads, as it would read
// the unfused norm's input. The sum's gradient is the one that reaches it
// from later ops plus the norm's: the tape adds the two the same way.
std::pair<Tensor, Tensor> add_norm(const Tensor& x, const Tensor& residual, const Tensor& weight,
                                   const Tensor& bias, double eps, bool rms) {
  ops::AddNormResult r =
      rms ? ops::add_rms_norm(x, residual, weight, eps) : ops::add_layer_norm(x, residual, weight, bias, eps);
  if (should_record({x, residual, weight, bias})) {
    bool want_w = weight.defined() && weight.requires_grad();
    bool want_wb = want_w || (bias.defined() && bias.requires_grad());
    Tensor sum = autograd::detach(r.sum), mean = r.norm.mean, rstd = r.norm.rstd;
    record(rms ? "add_rms_norm" : "add_layer_norm", {x, residual, weight, bias}, {r.sum, r.norm.y},
           [sum, weight, mean, rstd, rms, want_w, want_wb](const TensorList& g) {
             ops::NormGrads d = rms ? ops::rms_norm_backward(g[1], sum, weight, rstd, want_w)
                                    : ops::layer_norm_backward(g[1], sum, weight, mean, rstd, want_wb);
             ops::add_(d.dx, g[0]);
             return TensorList{d.dx, d.dx, d.dweight, d.dbias};
           });
  }
  return {r.sum, r.norm.y};
}

}  // namespace

std::pair<Tensor, Tensor> add_layer_norm(const Tensor& x, const Tensor& residual, const Tensor& weight,
                                         const Tensor& bias, double eps) {
  TS_PROFILE("add_layer_norm");
  return add_norm(x, residual, weight, bias, eps, false);
}

std::pair<Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& residual, const Tensor& weight, double eps) {
  TS_PROFILE("add_rms_norm");
  return add_norm(x, residual, weight, Tensor(), eps, true);
}

Tensor embedding(const Tensor& weight, const Tensor& indices) {
  TS_PROFILE("embedding");
  Tensor y = ops::embedding(weight, indices);
  if (should_record({weight}) && weight.is_subclass()) {
    // A DTensor table's gradient takes its layout; the closure keeps the
    // handle, not the bytes (FSDP releases a gathered table's storage).
    record("embedding", {weight}, {y}, [indices, weight](const TensorList& g) {
      return TensorList{ops::embedding_backward(g[0], indices, weight)};
    });
  } else if (should_record({weight})) {
    int64_t rows = weight.size(0);
    record("embedding", {weight}, {y}, [indices, rows](const TensorList& g) {
      return TensorList{ops::embedding_backward(g[0], indices, rows)};
    });
  }
  return y;
}

Tensor cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index) {
  TS_PROFILE("cross_entropy");
  ops::CrossEntropyResult r = ops::cross_entropy(logits, target, ignore_index);
  if (should_record({logits})) {
    Tensor lse = r.lse;
    Tensor count = r.count;
    record("cross_entropy", {logits}, {r.loss},
           [logits, target, lse, ignore_index, count](const TensorList& g) {
             return TensorList{
                 ops::cross_entropy_backward(g[0], logits, target, lse, ignore_index, count)};
           });
  }
  return r.loss;
}

Tensor linear_cross_entropy(const Tensor& x, const Tensor& weight, const Tensor& target, int64_t chunk_rows,
                            int64_t ignore_index) {
  TS_PROFILE("linear_cross_entropy");
  TS_CHECK(x.defined() && weight.defined() && target.defined() && !x.is_subclass() && !weight.is_subclass() &&
               !target.is_subclass(),
           "linear_cross_entropy: expected plain (local) tensors");
  TS_CHECK(x.dim() >= 1 && weight.dim() == 2 && x.size(-1) == weight.size(1),
           "linear_cross_entropy: x {} and weight {} do not chain (expected x [..., C], weight [V, C])",
           shape_str(x.shape()), shape_str(weight.shape()));
  TS_CHECK(x.dtype() == weight.dtype() && x.device() == weight.device(),
           "linear_cross_entropy: x is {} on {} but weight {} on {}", dtype_name(x.dtype()), x.device().str(),
           dtype_name(weight.dtype()), weight.device().str());
  const int64_t c = x.size(-1), n = leading_numel(x.shape()), v = weight.size(0);
  TS_CHECK(target.numel() == n, "linear_cross_entropy: {} targets for {} rows of x {}", target.numel(), n,
           shape_str(x.shape()));
  const int64_t chunk = chunk_rows <= 0 || chunk_rows > n ? std::max<int64_t>(n, 1) : chunk_rows;
  Tensor h = ops::contiguous(ops::reshape(x, {n, c}));
  Tensor t = ops::contiguous(ops::to(ops::reshape(target, {n}), DType::I64));
  const bool grads = should_record({x, weight});
  const bool gx = grads && x.requires_grad(), gw = grads && weight.requires_grad();
  // Counted before any chunk: each chunk's gradient divides by the batch's count.
  Tensor count = ops::sum(ops::binary(ops::BinaryOp::Ne, t, static_cast<double>(ignore_index)), {}, false, DType::F64);
  Tensor one = full({}, 1.0, x.dtype(), x.device());
  Tensor total = zeros({}, DType::F64, x.device());
  Tensor dx = gx ? empty({n, c}, x.dtype(), x.device()) : Tensor();
  const bool wide_dw = is_floating(weight.dtype()) && dtype_size(weight.dtype()) < 4;  // bf16/f16: summed in f32
  // bf16/f16: an f32 sum of the chunks (zeroed); otherwise the first chunk's product writes it.
  Tensor dw = !gw                   ? Tensor()
              : wide_dw              ? zeros({v, c}, DType::F32, weight.device())
              : n == 0               ? zeros({v, c}, weight.dtype(), weight.device())
                                     : empty({v, c}, weight.dtype(), weight.device());
  {
    autograd::NoGradGuard no_grad;
    for (int64_t r0 = 0; r0 < n; r0 += chunk) {
      const int64_t rows = std::min(chunk, n - r0);
      Tensor hc = ops::narrow(h, 0, r0, rows), tc = ops::narrow(t, 0, r0, rows);
      Tensor logits = ops::linear(hc, weight);
      ops::CrossEntropyResult ce = ops::cross_entropy(logits, tc, ignore_index);
      // The chunk's summed loss: its mean times its count, in f64.
      total = ops::add(total, ops::mul(ops::to(ce.loss, DType::F64), ce.count));
      if (!grads) continue;
      Tensor g = ops::cross_entropy_backward(one, logits, tc, ce.lse, ignore_index, count);
      logits = Tensor();  // the chunk's logits go before its gradient's products
      if (gx) {
        Tensor dxc = ops::narrow(dx, 0, r0, rows);
        ops::gemm_into(dxc, g, weight);
      }
      if (gw) {
        if (wide_dw) ops::add_(dw, ops::to(ops::matmul(ops::transpose(g, 0, 1), hc), DType::F32));
        else ops::gemm_into(dw, ops::transpose(g, 0, 1), hc, 1.0, /*accumulate=*/r0 > 0);
      }
    }
  }
  Tensor loss = ops::to(ops::div(total, ops::binary(ops::BinaryOp::Maximum, count, 1.0)), x.dtype());
  if (grads) {
    if (wide_dw) dw = ops::to(dw, weight.dtype());
    const Shape x_shape = x.shape();
    record("linear_cross_entropy", {x, weight}, {loss}, [dx, dw, x_shape](const TensorList& g) {
      return TensorList{dx.defined() ? ops::reshape(ops::mul(dx, g[0]), x_shape) : Tensor(),
                        dw.defined() ? ops::mul(dw, g[0]) : Tensor()};
    });
  }
  return loss;
}

Tensor dropout(const Tensor& x, double p, bool training) {
  TS_PROFILE("dropout");
  TS_CHECK(p >= 0.0 && p < 1.0, "dropout: probability must be in [0, 1), got {}", p);
  if (!training || p == 0.0) return x;
  Tensor mask = ops::dropout_mask(x, p, default_generator().next(x.numel()));
  Tensor y = ops::mul(x, mask);
  if (should_record({x}))
    record("dropout", {x}, {y}, [mask](const TensorList& g) { return TensorList{ops::mul(g[0], mask)}; });
  return y;
}

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                                    std::optional<double> scale_opt) {
  TS_PROFILE("scaled_dot_product_attention");
  TS_CHECK(q.dim() == 4, "scaled_dot_product_attention: q must be [B, H, T, D], got {}",
           shape_str(q.shape()));
  double scale = scale_opt.value_or(1.0 / std::sqrt(static_cast<double>(q.size(-1))));
  autograd::SavedOutputs* saved = autograd::saved_outputs();
  ops::AttentionResult r;
  if (saved && saved->replaying()) {  // selective checkpointing: the kept output and log-sum-exp
    TensorList kept = saved->take("attention");
    r.out = kept[0], r.lse = kept[1];
  } else {
    r = ops::attention(q, k, v, causal, scale);
    if (saved) saved->stash({r.out, r.lse});
  }
  if (should_record({q, k, v})) {
    Tensor out = autograd::detach(r.out), lse = r.lse;
    record("attention", {q, k, v}, {r.out}, [q, k, v, out, lse, causal, scale](const TensorList& g) {
      ops::AttentionGrads d = ops::attention_backward(g[0], q, k, v, out, lse, causal, scale);
      return TensorList{d.dq, d.dk, d.dv};
    });
  }
  return r.out;
}

Tensor rope(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  TS_PROFILE("rope");
  Tensor y = ops::rope(x, cos, sin, false);
  if (should_record({x})) {
    record("rope", {x}, {y}, [cos, sin](const TensorList& g) {
      return TensorList{ops::rope(g[0], cos, sin, true)};
    });
  }
  return y;
}

}  // namespace tessera
