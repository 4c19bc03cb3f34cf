// The one point where an op meets a tensor subclass (runtime/tensor.h's
// TensorSubclass, made by a layer above). An op whose operands include
// one does not run its kernels: it describes itself as an OpCall (its id from
// runtime/op_list.h, its operands, its own attributes, and how to run it on
// plain tensors) and hands it to the handler the subclass's layer registered,
// which finds its rule for the op by id and returns the results. runtime/
// knows nothing of what the subclass does with it.
#pragma once

#include <array>
#include <functional>
#include <initializer_list>
#include <vector>

#include "runtime/op_kinds.h"
#include "runtime/random.h"
#include "runtime/tensor.h"

namespace tessera {

// An op's arguments beyond its tensors, as its rule needs them; each op sets
// the fields that apply to it.
struct OpAttrs {
  // sum: the dims reduced (empty: all). softmax, attention, RoPE: the dims each
  // slice of the op is independent along (every input's, counted alike).
  // permute, transpose: the permutation.
  std::vector<int64_t> dims;
  bool keepdim = false;  // sum
  // unary, binary: the op is linear in every tensor operand (neg; add and sub;
  // mul and div by a scalar), so it may take unreduced partial sums as they are.
  bool linear = false;
  Shape shape;  // view, reshape: the new shape
  // linear_backward, the norms' backward: which of their three gradients to compute.
  std::array<bool, 3> need{};
  int64_t ignore_index = -100;  // cross_entropy and its backward
  // softmax, attention, RoPE: output i has the sizes of input out_like[i] on
  // the independent dims.
  std::vector<int> out_like;
  // uniform_, normal_: the full tensor's counters, and a fill of a piece of it
  // given the counters of its elements (runtime/random.h).
  RandomSpec random;
  std::function<void(Tensor& piece, const RandomSpec& spec)> fill;
};

struct OpCall {
  OpId op;
  const char* name = "";  // as the user called it, for errors: "exp", "add_", "transpose"
  TensorList inputs;
  OpAttrs attrs;
  // The op on plain tensors: what a rule runs on each rank's local pieces.
  std::function<TensorList(const TensorList& locals)> local;
};

using OpCallHandler = TensorList (*)(OpCall& call);

// The subclass's layer registers its handler once, before its first tensor exists.
void set_op_call_handler(OpCallHandler handler);
// Whether any of the tensors is a subclass tensor, whose ops go to the handler.
bool intercepts(std::initializer_list<const Tensor*> tensors);
// Hands the op to the handler; throws when none is registered.
TensorList intercept(OpCall call);
// The same for an op with one result (most of them).
inline Tensor intercept_one(OpCall call) { return intercept(std::move(call))[0]; }

}  // namespace tessera
