#include "fsdp/state_dict.h"

#include "dtensor/dtensor.h"

namespace tessera::fsdp {

void for_each_full_tensor(const nn::StateDict& state, bool rank0_only,
                          const std::function<void(const std::string&, const Tensor&)>& fn) {
  autograd::NoGradGuard no_grad;
  bool mine = !rank0_only || dist::rank() == 0;
  for (const auto& [name, t] : state) {
    if (!t.is_distributed()) {
      fn(name, mine ? t : Tensor());
      continue;
    }
    Tensor whole = full_tensor(t);  // one parameter's all-gather; dropped after fn returns
    fn(name, mine ? whole : Tensor());
  }
}

nn::StateDict full_state_dict(nn::Module& model, bool rank0_only) {
  nn::StateDict out;
  for_each_full_tensor(model.state_dict(), rank0_only, [&](const std::string& name, const Tensor& t) {
    if (t.defined()) out.emplace_back(name, ops::clone(t));
  });
  return out;
}

void load_full_state_dict(nn::Module& model, const nn::StateDict& state, bool from_rank0, bool strict) {
  autograd::NoGradGuard no_grad;
  nn::StateDict own = model.state_dict();
  bool reader = !from_rank0 || dist::rank() == 0;
  // Keys and shapes are checked by the reading rank(s) before any data moves;
  // with from_rank0, rank 0's verdict is shared so that every rank throws together.
  std::string error;
  if (reader) {
    std::vector<std::string> missing, unexpected, mismatched;
    for (const auto& [name, t] : own) {
      const Tensor* src = nn::find_in(state, name);
      if (src == nullptr)
        missing.push_back(name);
      else if (src->shape() != t.shape())
        mismatched.push_back(fmt::format("{}: checkpoint {} vs model {}", name, shape_str(src->shape()),
                                         shape_str(t.shape())));
    }
    for (const auto& [name, t] : state)
      if (nn::find_in(own, name) == nullptr) unexpected.push_back(name);
    if (!mismatched.empty())
      error = fmt::format("load_full_state_dict: size mismatch for {}", fmt::join(mismatched, "; "));
    else if (strict && (!missing.empty() || !unexpected.empty()))
      error = fmt::format("load_full_state_dict: missing keys [{}]; unexpected keys [{}]", fmt::join(missing, ", "),
                          fmt::join(unexpected, ", "));
  }
  if (from_rank0) error = dist::all_gather_strings(dist::world(), error)[0];
  TS_CHECK(error.empty(), "{}", error);
  for (auto& [name, dst] : own) {
    const Tensor* src = reader ? nn::find_in(state, name) : nullptr;
    Tensor value;
    if (from_rank0) {
      // Rank 0 says whether it has the key, then sends the tensor.
      Tensor flag = full({1}, src != nullptr ? 1.0 : 0.0, DType::I64);
      dist::world()->broadcast(flag, 0)->wait();
      if (flag.item() == 0) continue;
      if (dist::rank() == 0) {
        value = ops::contiguous(ops::to(*src, dst.dtype()));
      } else {
        value = empty(dst.shape(), dst.dtype());
      }
      dist::world()->broadcast(value, 0)->wait();
    } else {
      if (src == nullptr) continue;
      value = ops::to(*src, dst.dtype());
    }
    if (dst.is_distributed()) {
      const DTensorSpec& spec = dtensor_spec(dst);
      Tensor local = spec.local;
      ops::copy_(local, local_tensor(distribute_tensor_local(value, spec.mesh, spec.placements)));
    } else {
      ops::copy_(dst, value);
    }
  }
  for (auto& [p, m] : model.named_modules())
    if (m->extension) m->extension->after_load_state_dict(*m);
}

}  // namespace tessera::fsdp
