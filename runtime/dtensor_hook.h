// How ops reach DTensors without runtime/ knowing dtensor/. A DTensor is a
// Tensor whose impl carries a DistSpec; a raw op that meets one describes
// itself as a DistCall (its class, its inputs, and how to run it on local
// tensors) and hands it to the handler the dtensor layer registered. The
// handler applies its sharding rules (which placements are valid, which
// collective or local computation gives the result) and returns DTensors.
#pragma once

#include <array>
#include <functional>
#include <initializer_list>
#include <vector>

#include "runtime/random.h"
#include "runtime/tensor.h"

namespace tessera {

enum class OpClass {
  Elementwise,       // out-of-place, shape-preserving up to broadcasting (unary, binary, where)
  LinearElementwise, // elementwise and linear in every DTensor input (neg, add, sub, scale)
  InPlace,           // mutates inputs[0]; every DTensor operand must share its spec
  Reduction,         // sum/mean over `dims` (empty: all) with `keepdim`
  Linear,            // linear(x, w, b) or matmul(a, b)
  LinearBackward,    // linear_backward(grad, x, w) -> {dx, dw, db} where `need`
  Random,            // fills inputs[0] (random_fill with the shard's RandomSpec)
  Like,              // a new tensor shaped like inputs[0] (zeros_like, to(dtype), clone)
  CrossEntropy,      // cross_entropy(logits [N, C], target) -> {loss, lse, count}
  CrossEntropyBackward,  // cross_entropy_backward(grad, logits, target, lse, count) -> {dlogits}
  Norm,              // layer_norm / rms_norm(x, weight, bias) over the last dim -> {y, mean, rstd}
  NormBackward,      // norm backward(dy, x, weight, mean, rstd) -> {dx, dweight, dbias} where `need`
  Embedding,         // embedding(weight [V, D], indices) -> {out}
  EmbeddingBackward, // embedding's weight gradient (grad, indices, weight) -> {dweight}, laid out as weight
  Relayout,          // inputs[0] laid out as inputs[1] is (a gradient as its parameter)
  PerShard,          // independent along `free_dims` (softmax away from its dim; attention and
                     // RoPE over batch and heads): each shard alone, outputs split as the inputs
  View,              // reshape / permute of inputs[0] to `shape` (`perm`: a permutation)
};

struct DistCall {
  const char* name = "";
  OpClass cls = OpClass::Elementwise;
  std::vector<Tensor> inputs;
  // Runs the op on local tensors (the DTensors' local tensors, plain tensors as given).
  std::function<std::vector<Tensor>(const std::vector<Tensor>& locals)> local;
  // Reduction: the dims reduced (empty: all) and keepdim.
  std::vector<int64_t> dims;
  bool keepdim = false;
  // Linear: true for linear(x, w[, b]) (w is [out, in]); false for matmul(a, b).
  bool is_linear = false;
  // LinearBackward: which of dx, dw, db to compute; NormBackward: dx, dweight, dbias.
  std::array<bool, 3> need{};
  // CrossEntropy(Backward): the target value that counts for nothing.
  int64_t ignore_index = -100;
  // Random: fills a local tensor given the counters of its elements.
  std::function<void(Tensor& local, const RandomSpec& spec)> random_fill;
  RandomSpec spec;  // the spec the full tensor would use
  // PerShard: the dims (of every DTensor input, counted alike) the op treats
  // independently; output i's global sizes on split dims are input out_like[i]'s.
  std::vector<int64_t> free_dims;
  std::vector<int> out_like;
  // View: the new global shape (reshape) or the permutation (permute, transpose).
  Shape shape;
  std::vector<int64_t> perm;
};

using DistHandler = std::function<std::vector<Tensor>(DistCall& call)>;

// The dtensor layer registers itself here (once, at static initialisation).
void set_dist_handler(DistHandler handler);
// True when any of the tensors is a DTensor.
bool any_distributed(std::initializer_list<const Tensor*> tensors);
// Hands the call to the handler; throws when no DTensor support is linked in.
std::vector<Tensor> dispatch_distributed(DistCall& call);
// A DTensor like x (same mesh and placements) from a per-local-tensor op
// (OpClass::Like: zeros_like, contiguous, clone, ...).
Tensor dispatch_like(const char* name, const Tensor& x, std::function<Tensor(const Tensor&)> fn);
// An op that is independent along `free_dims` of its inputs (OpClass::PerShard).
std::vector<Tensor> dispatch_per_shard(const char* name, std::vector<Tensor> inputs, std::vector<int64_t> free_dims,
                                       std::vector<int> out_like,
                                       std::function<std::vector<Tensor>(const std::vector<Tensor>&)> local);
// reshape (perm empty; `shape` the new global shape) or permute of a DTensor.
Tensor dispatch_view(const char* name, const Tensor& x, Shape shape, std::vector<int64_t> perm);
// Throws, naming the op and the first DTensor among `tensors`, for an op with
// no sharding rule (cat, max, var, ...); nothing when none is a DTensor.
void refuse_distributed(const char* op, std::initializer_list<const Tensor*> tensors);
// g (a DTensor) laid out as `like` (a DTensor of the same global shape) is:
// a parameter's gradient before it accumulates, so that a Partial gradient of
// a Replicate parameter (a sequence-parallel norm's weight) is reduced once.
Tensor dispatch_relayout(const Tensor& g, const Tensor& like);

}  // namespace tessera
