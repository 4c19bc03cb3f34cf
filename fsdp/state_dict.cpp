#include "fsdp/state_dict.h"

#include "dtensor/dtensor.h"
#include "nn/safetensors.h"

namespace tessera::fsdp {

void for_each_full_tensor(const nn::StateDict& state, bool rank0_only,
                          const std::function<void(const std::string&, const Tensor&)>& fn) {
  autograd::NoGradGuard no_grad;
  bool mine = !rank0_only || dist::rank() == 0;
  for (const auto& [name, t] : state) {
    if (!is_dtensor(t)) {
      fn(name, mine ? t : Tensor());
      continue;
    }
    Tensor whole = full_tensor(t);  // one parameter's all-gather; dropped after fn returns
    fn(name, mine ? whole : Tensor());
  }
}

nn::StateDict full_state_dict(nn::Module& model, bool rank0_only) {
  nn::StateDict out;
  for_each_full_tensor(model.state_dict(), rank0_only,
                       [&](const std::string& name, const Tensor& t) {
                         if (t.defined()) out.emplace_back(name, ops::clone(t));
                       });
  return out;
}

void load_full_state_dict(nn::Module& model, const nn::StateDict& state, bool from_rank0,
                          bool strict) {
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
        mismatched.push_back(fmt::format("{}: checkpoint {} vs model {}", name,
                                         shape_str(src->shape()), shape_str(t.shape())));
    }
    for (const auto& [name, t] : state)
      if (nn::find_in(own, name) == nullptr) unexpected.push_back(name);
    if (!mismatched.empty())
      error =
          fmt::format("load_full_state_dict: size mismatch for {}", fmt::join(mismatched, "; "));
    else if (strict && (!missing.empty() || !unexpected.empty()))
      error = fmt::format("load_full_state_dict: missing keys [{}]; unexpected keys [{}]",
                          nn::key_list(missing), nn::key_list(unexpected));
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
    if (is_dtensor(dst)) {
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

void save_safetensors(nn::Module& model, const std::string& path,
                      const std::map<std::string, std::string>& metadata,
                      std::optional<DType> dtype) {
  autograd::NoGradGuard no_grad;
  nn::StateDict state = model.state_dict();
  auto out_dtype = [&](const Tensor& t) {
    return dtype && is_floating(t.dtype()) ? *dtype : t.dtype();
  };
  std::vector<nn::SafetensorsEntry> entries;
  uint64_t offset = 0;
  for (const auto& [name, t] : state) {
    uint64_t bytes = static_cast<uint64_t>(t.numel()) * dtype_size(out_dtype(t));
    entries.push_back({name, out_dtype(t), t.shape(), offset, offset + bytes});
    offset += bytes;
  }
  // One tensor gathered at a time, in header order; only rank 0 writes.
  auto gather = [&](size_t i) {
    const Tensor& t = state[i].second;
    Tensor whole = is_dtensor(t) ? full_tensor(t) : t;
    return ops::to(whole, out_dtype(t));
  };
  std::string error;
  if (dist::rank() == 0) {
    try {
      nn::write_safetensors(path, entries, gather, metadata);
    } catch (const std::exception& e) {
      error = e.what();
    }
  } else {
    for (size_t i = 0; i < entries.size(); ++i)
      if (is_dtensor(state[i].second)) full_tensor(state[i].second);
  }
  dist::throw_if_any_failed(dist::world(), error, "save_safetensors");
}

void load_safetensors(nn::Module& model, const std::string& path, bool strict) {
  autograd::NoGradGuard no_grad;
  nn::StateDict own = model.state_dict();
  std::string error;
  try {
    nn::SafetensorsFile file(path);
    std::vector<std::string> missing, unexpected;
    for (const auto& e : file.entries())
      if (nn::find_in(own, e.name) == nullptr) unexpected.push_back(e.name);
    for (const auto& [name, dst] : own) {
      if (file.find(name) != nullptr) continue;
      bool tied_elsewhere = false;  // e.g. lm_head.weight tied to the embedding and stored once
      for (const auto& [other, t] : own)
        if (other != name && t.is_same(dst) && file.find(other) != nullptr) tied_elsewhere = true;
      if (!tied_elsewhere) missing.push_back(name);
    }
    TS_CHECK(!strict || (missing.empty() && unexpected.empty()),
             "{}: the file does not match the model: missing keys [{}]; unexpected keys [{}]", path,
             nn::key_list(missing), nn::key_list(unexpected));
    for (auto& [name, dst] : own) {
      const nn::SafetensorsEntry* e = file.find(name);
      if (e == nullptr) continue;
      TS_CHECK(e->shape == dst.shape(), "{}: tensor '{}' is {} in the file but {} in the model",
               path, name, shape_str(e->shape), shape_str(dst.shape()));
      for (auto& [local, start, extent] : local_boxes(dst)) {
        if (shape_numel(extent) == 0) continue;
        // Read this rank's rows only; narrow any other sharded dims in memory.
        Tensor src = start.empty() ? file.read(name, dst.dtype())
                                   : file.read_rows(name, start[0], extent[0], dst.dtype());
        for (size_t d = 1; d < start.size(); ++d)
          src = ops::narrow(src, static_cast<int64_t>(d), start[d], extent[d]);
        ops::copy_(local, src);
      }
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  dist::throw_if_any_failed(dist::world(), error, "load_safetensors");
  for (auto& [p, m] : model.named_modules())
    if (m->extension) m->extension->after_load_state_dict(*m);
}

}  // namespace tessera::fsdp
