// Basic layers. Weights are stored [out, in] as in PyTorch. A layer built on
// the meta device has shapes and no bytes until to_empty(); on a real device
// it is initialised at construction (seed 0), and init_weights(seed) on the
// enclosing model re-initialises every parameter from its FQN.
#pragma once

#include "nn/module.h"

namespace tessera::nn {

// What a Linear applies to its output. GELU (exact, or its tanh form) is
// fused with the bias: added in GELU's pass forward, its gradient summed in
// GELU's backward pass (linear_gelu), the module call and its parameters
// unchanged (GPT-2's c_fc, so FSDP's and TP's per-module plans still apply).
enum class Activation { None, Gelu, GeluTanh };

class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias = true,
         Device device = Device::cpu(), DType dtype = DType::F32);
  Tensor forward(const Tensor& x) override;
  void reset_parameters(uint64_t seed, const std::string& prefix) override;
  std::string type_name() const override { return "Linear"; }

  int64_t in_features, out_features;
  double init_std = 0.02;  // weight ~ N(0, init_std); bias = 0
  Activation activation = Activation::None;
  Tensor& weight;
  Tensor& bias;  // undefined without bias
};

class Embedding : public Module {
 public:
  Embedding(int64_t num_embeddings, int64_t dim, Device device = Device::cpu(),
            DType dtype = DType::F32);
  Tensor forward(const Tensor& indices) override;
  void reset_parameters(uint64_t seed, const std::string& prefix) override;
  std::string type_name() const override { return "Embedding"; }

  int64_t num_embeddings, dim;
  double init_std = 0.02;
  Tensor& weight;
};

class LayerNorm : public Module {
 public:
  LayerNorm(int64_t dim, double eps = 1e-5, bool bias = true, Device device = Device::cpu(),
            DType dtype = DType::F32);
  Tensor forward(const Tensor& x) override;
  // A pre-norm block's residual step: {x + residual, this norm of it}, made
  // in one pass (add_layer_norm). A module with hooks is called on the sum
  // instead, so that its hooks see their one input as always.
  std::pair<Tensor, Tensor> forward_add(const Tensor& x, const Tensor& residual);
  void reset_parameters(uint64_t seed, const std::string& prefix) override;
  std::string type_name() const override { return "LayerNorm"; }

  double eps;
  Tensor& weight;
  Tensor& bias;
};

class RMSNorm : public Module {
 public:
  RMSNorm(int64_t dim, double eps = 1e-6, Device device = Device::cpu(), DType dtype = DType::F32);
  Tensor forward(const Tensor& x) override;
  // {x + residual, this norm of it}, as LayerNorm's.
  std::pair<Tensor, Tensor> forward_add(const Tensor& x, const Tensor& residual);
  void reset_parameters(uint64_t seed, const std::string& prefix) override;
  std::string type_name() const override { return "RMSNorm"; }

  double eps;
  Tensor& weight;
};

class Dropout : public Module {
 public:
  explicit Dropout(double p) : p(p) {}
  Tensor forward(const Tensor& x) override { return dropout(x, p, is_training()); }
  std::string type_name() const override { return "Dropout"; }
  double p;
};

// Fills t ~ N(mean, std) from (seed, name): the values depend on nothing else.
void init_normal(Tensor& t, double mean, double std, uint64_t seed, const std::string& name);

}  // namespace tessera::nn
