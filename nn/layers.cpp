#include "nn/layers.h"

namespace tessera::nn {

void init_normal(Tensor& t, double mean, double std, uint64_t seed, const std::string& name) {
  ops::normal_(t, mean, std, RandomSpec{seed, hash_name(name), 0, {}});
}

namespace {
// Builds the layer's parameters on `device`; initialises them unless on meta.
void init_if_real(Module& m, Device device) {
  if (!device.is_meta()) {
    autograd::NoGradGuard no_grad;
    m.reset_parameters(0, "");
  }
}
}  // namespace

Linear::Linear(int64_t in, int64_t out, bool has_bias, Device device, DType dtype)
    : in_features(in),
      out_features(out),
      weight(register_parameter("weight", empty({out, in}, dtype, device))),
      bias(register_parameter("bias", has_bias ? empty({out}, dtype, device) : Tensor())) {
  init_if_real(*this, device);
}

Tensor Linear::forward(const Tensor& x) {
  if (activation == Activation::None) return linear(x, weight, bias);
  return linear_gelu(x, weight, bias, activation == Activation::GeluTanh);
}

void Linear::reset_parameters(uint64_t seed, const std::string& prefix) {
  init_normal(weight, 0.0, init_std, seed, prefix + "weight");
  if (bias.defined()) ops::zero_(bias);
}

Embedding::Embedding(int64_t num, int64_t d, Device device, DType dtype)
    : num_embeddings(num), dim(d), weight(register_parameter("weight", empty({num, d}, dtype, device))) {
  init_if_real(*this, device);
}

Tensor Embedding::forward(const Tensor& indices) { return embedding(weight, indices); }

void Embedding::reset_parameters(uint64_t seed, const std::string& prefix) {
  init_normal(weight, 0.0, init_std, seed, prefix + "weight");
}

LayerNorm::LayerNorm(int64_t dim, double eps_, bool has_bias, Device device, DType dtype)
    : eps(eps_),
      weight(register_parameter("weight", empty({dim}, dtype, device))),
      bias(register_parameter("bias", has_bias ? empty({dim}, dtype, device) : Tensor())) {
  init_if_real(*this, device);
}

Tensor LayerNorm::forward(const Tensor& x) { return layer_norm(x, weight, bias, eps); }

std::pair<Tensor, Tensor> LayerNorm::forward_add(const Tensor& x, const Tensor& residual) {
  if (!has_forward_hooks()) return add_layer_norm(x, residual, weight, bias, eps);
  Tensor sum = x + residual;
  return {sum, (*this)(sum)};
}

void LayerNorm::reset_parameters(uint64_t, const std::string&) {
  ops::fill_(weight, 1.0);
  if (bias.defined()) ops::zero_(bias);
}

RMSNorm::RMSNorm(int64_t dim, double eps_, Device device, DType dtype)
    : eps(eps_), weight(register_parameter("weight", empty({dim}, dtype, device))) {
  init_if_real(*this, device);
}

Tensor RMSNorm::forward(const Tensor& x) { return rms_norm(x, weight, eps); }

std::pair<Tensor, Tensor> RMSNorm::forward_add(const Tensor& x, const Tensor& residual) {
  if (!has_forward_hooks()) return add_rms_norm(x, residual, weight, eps);
  Tensor sum = x + residual;
  return {sum, (*this)(sum)};
}

void RMSNorm::reset_parameters(uint64_t, const std::string&) { ops::fill_(weight, 1.0); }

}  // namespace tessera::nn
