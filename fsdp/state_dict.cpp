#include "fsdp/state_dict.h"

#include "dtensor/dtensor.h"
#include "nn/safetensors.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <map>
#include <optional>

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
                          nn::quoted_keys(missing), nn::quoted_keys(unexpected));
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

namespace {

// The state dict's tensors of every rank, each once, in the order rank 0,
// then rank 1, ... holds them (under a pipeline each rank holds its stages'
// tensors), with the lowest rank holding each: what a file written by rank 0
// lists, and who sends rank 0 what it lacks.
struct Entry {
  std::string name;
  DType dtype;
  Shape shape;
  int holder = 0;
};

std::vector<Entry> entries_of_every_rank(const nn::StateDict& state) {
  nlohmann::json mine = nlohmann::json::array();
  for (const auto& [name, t] : state)
    mine.push_back({name, dtype_name(t.dtype()), std::vector<int64_t>(t.shape().begin(), t.shape().end())});
  std::vector<Entry> out;
  std::map<std::string, size_t> seen;
  const auto all = dist::world_size() > 1 ? dist::all_gather_strings(dist::world(), mine.dump())
                                          : std::vector<std::string>{mine.dump()};
  for (size_t r = 0; r < all.size(); ++r)
    for (const auto& e : nlohmann::json::parse(all[r]))
      if (seen.try_emplace(e[0].get<std::string>(), out.size()).second)
        out.push_back({e[0].get<std::string>(), dtype_from_name(e[1].get<std::string>()), e[2].get<Shape>(),
                       static_cast<int>(r)});
  return out;
}

}  // namespace

void save_safetensors(nn::Module& model, const std::string& path,
                      const std::map<std::string, std::string>& metadata,
                      std::optional<DType> dtype) {
  autograd::NoGradGuard no_grad;
  nn::StateDict state = model.state_dict();
  const std::vector<Entry> all = entries_of_every_rank(state);
  auto out_dtype = [&](DType d) { return dtype && is_floating(d) ? *dtype : d; };
  std::vector<nn::SafetensorsEntry> entries;
  uint64_t offset = 0;
  for (const Entry& e : all) {
    uint64_t bytes = static_cast<uint64_t>(shape_numel(e.shape)) * dtype_size(out_dtype(e.dtype));
    entries.push_back({e.name, out_dtype(e.dtype), e.shape, offset, offset + bytes});
    offset += bytes;
  }
  // One tensor gathered at a time, in header order, by the ranks holding it;
  // only rank 0 writes, and a tensor it does not hold (another pipeline
  // stage's) comes from the lowest rank holding it.
  const int me = dist::rank();
  const Device device = state.empty() ? Device::cpu() : state.front().second.device();
  auto tag = [](size_t i) { return static_cast<int>(i % (1u << 29)); };
  auto whole = [&](size_t i) -> Tensor {  // collective over the ranks holding it
    const Tensor* t = nn::find_in(state, all[i].name);
    if (t == nullptr) return Tensor();
    return is_dtensor(*t) ? full_tensor(*t) : *t;
  };
  size_t next = 0;  // rank 0: the next tensor to gather
  auto gather = [&](size_t i) {
    next = i + 1;
    Tensor t = whole(i);
    if (!t.defined()) {
      t = empty(all[i].shape, all[i].dtype, device);
      dist::world()->recv(t, all[i].holder, tag(i))->wait();
    }
    return ops::to(t, out_dtype(all[i].dtype));
  };
  std::string error;
  if (me == 0) {
    try {
      nn::write_safetensors(path, entries, gather, metadata);
    } catch (const std::exception& e) {
      error = e.what();
      // The other ranks still gather and send the rest: take part to the end.
      for (size_t i = next; i < all.size(); ++i) gather(i);
    }
  } else {
    for (size_t i = 0; i < all.size(); ++i) {
      Tensor t = whole(i);
      if (t.defined() && all[i].holder == me) dist::world()->send(ops::contiguous(t), 0, tag(i))->wait();
    }
  }
  dist::throw_if_any_failed(dist::world(), error, "save_safetensors");
}

std::vector<std::string> lacked_by_every_rank(const std::vector<std::string>& lacked_here) {
  std::vector<std::string> out = lacked_here;
  if (dist::world_size() == 1) return out;
  for (const auto& text : dist::all_gather_strings(dist::world(), nlohmann::json(lacked_here).dump())) {
    const auto theirs = nlohmann::json::parse(text).get<std::vector<std::string>>();
    std::erase_if(out, [&](const std::string& n) { return std::find(theirs.begin(), theirs.end(), n) == theirs.end(); });
  }
  return out;
}

void load_safetensors(nn::Module& model, const std::string& path, bool strict) {
  autograd::NoGradGuard no_grad;
  nn::StateDict own = model.state_dict();
  std::string error;
  std::optional<nn::SafetensorsFile> file;
  std::vector<std::string> lacked;  // the file's tensors this rank's model lacks
  try {
    file.emplace(path);
    for (const auto& e : file->entries())
      if (nn::find_in(own, e.name) == nullptr) lacked.push_back(e.name);
  } catch (const std::exception& e) {
    error = e.what();
  }
  // Under a pipeline each rank's model holds its stages' tensors: a tensor of
  // the file is unexpected only when no rank's model holds it.
  const std::vector<std::string> unexpected = lacked_by_every_rank(lacked);
  if (error.empty()) {
    try {
      std::vector<std::string> missing;
      for (const auto& [name, dst] : own) {
        if (file->find(name) != nullptr) continue;
        bool tied_elsewhere = false;  // e.g. lm_head.weight tied to the embedding and stored once
        for (const auto& [other, t] : own)
          if (other != name && t.is_same(dst) && file->find(other) != nullptr) tied_elsewhere = true;
        if (!tied_elsewhere) missing.push_back(name);
      }
      TS_CHECK(!strict || (missing.empty() && unexpected.empty()),
               "{}: the file does not match the model: missing keys [{}]; unexpected keys [{}]", path,
               nn::quoted_keys(missing), nn::quoted_keys(unexpected));
      for (auto& [name, dst] : own) {
        const nn::SafetensorsEntry* e = file->find(name);
        if (e == nullptr) continue;
        TS_CHECK(e->shape == dst.shape(), "{}: tensor '{}' is {} in the file but {} in the model",
                 path, name, shape_str(e->shape), shape_str(dst.shape()));
        for (auto& [local, start, extent] : local_boxes(dst)) {
          if (shape_numel(extent) == 0) continue;
          // Read this rank's rows only; narrow any other sharded dims in memory.
          Tensor src = start.empty() ? file->read(name, dst.dtype())
                                     : file->read_rows(name, start[0], extent[0], dst.dtype());
          for (size_t d = 1; d < start.size(); ++d)
            src = ops::narrow(src, static_cast<int64_t>(d), start[d], extent[d]);
          ops::copy_(local, src);
        }
      }
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  dist::throw_if_any_failed(dist::world(), error, "load_safetensors");
  for (auto& [p, m] : model.named_modules())
    if (m->extension) m->extension->after_load_state_dict(*m);
}

}  // namespace tessera::fsdp
