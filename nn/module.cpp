#include "nn/module.h"

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

#include "dtensor/dtensor.h"

namespace tessera::nn {

std::string key_list(const std::vector<std::string>& keys, size_t max) {
  if (keys.size() <= max) return fmt::format("{}", fmt::join(keys, ", "));
  return fmt::format("{}, ... ({} more)", fmt::join(keys.begin(), keys.begin() + static_cast<ptrdiff_t>(max), ", "),
                     keys.size() - max);
}

std::string quoted_keys(const std::vector<std::string>& keys, size_t max) {
  std::vector<std::string> quoted;
  quoted.reserve(keys.size());
  for (const auto& k : keys) quoted.push_back("'" + k + "'");
  return key_list(quoted, max);
}

const Tensor* find_in(const StateDict& sd, const std::string& name) {
  for (const auto& [k, v] : sd)
    if (k == name) return &v;
  return nullptr;
}

Tensor Module::operator()(const Tensor& x) {
  TensorList out = (*this)(TensorList{x});
  TS_CHECK(out.size() == 1, "{}: called with one tensor but forward returned {}", type_name(),
           out.size());
  return out[0];
}

TensorList Module::operator()(TensorList inputs) {
  return call_with_hooks(std::move(inputs), [this](const TensorList& in) { return forward_list(in); });
}

TensorList Module::call_with_hooks(TensorList inputs,
                                   const std::function<TensorList(const TensorList&)>& body) {
  // Copies: a hook may remove itself (or others) while running.
  auto pre = pre_hooks_;
  for (auto& [id, hook] : pre) hook(*this, inputs);
  TensorList outputs = body(inputs);
  auto post = post_hooks_;
  for (auto& [id, hook] : post) hook(*this, inputs, outputs);
  return outputs;
}

Tensor Module::forward(const Tensor&) {
  TS_CHECK(false, "{} has no single-input forward", type_name());
}

TensorList Module::forward_list(const TensorList& inputs) {
  TS_CHECK(inputs.size() == 1, "{}: forward takes one tensor, got {}", type_name(), inputs.size());
  return {forward(inputs[0])};
}

Tensor& Module::register_parameter(const std::string& name, Tensor value, bool requires_grad) {
  TS_CHECK(find_parameter_slot(name) == nullptr, "{}: parameter '{}' already registered",
           type_name(), name);
  if (value.defined() && is_floating(value.dtype())) value.set_requires_grad(requires_grad);
  params_.push_back({name, std::move(value), true});
  return params_.back().value;
}

Tensor& Module::register_buffer(const std::string& name, Tensor value, bool persistent) {
  buffers_.push_back({name, std::move(value), persistent});
  return buffers_.back().value;
}

void Module::add_child(const std::string& name, ModulePtr module) {
  TS_CHECK(module != nullptr, "{}: child '{}' is null", type_name(), name);
  TS_CHECK(child(name) == nullptr, "{}: child '{}' already registered", type_name(), name);
  TS_CHECK(name.find('.') == std::string::npos, "{}: child name '{}' may not contain '.'",
           type_name(), name);
  child_index_.emplace(name, children_.size());
  children_.emplace_back(name, std::move(module));
}

ModulePtr Module::remove_child(const std::string& name) {
  auto it = child_index_.find(name);
  TS_CHECK(it != child_index_.end(), "{}: no child '{}' to remove", type_name(), name);
  const size_t at = it->second;
  ModulePtr removed = children_[at].second;
  children_.erase(children_.begin() + static_cast<std::ptrdiff_t>(at));
  child_index_.clear();
  for (size_t i = 0; i < children_.size(); ++i) child_index_.emplace(children_[i].first, i);
  return removed;
}

Module* Module::child(const std::string& name) const {
  auto it = child_index_.find(name);
  return it == child_index_.end() ? nullptr : children_[it->second].second.get();
}

Module& Module::submodule(const std::string& path) {
  Module* m = this;
  size_t start = 0;
  while (start <= path.size() && !path.empty()) {
    size_t dot = path.find('.', start);
    std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    Module* next = m->child(part);
    TS_CHECK(next != nullptr, "{} has no submodule '{}' (looking up '{}')", m->type_name(), part, path);
    m = next;
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return *m;
}

Module::Slot* Module::find_parameter_slot(const std::string& name) {
  for (auto& s : params_)
    if (s.name == name) return &s;
  return nullptr;
}

std::vector<std::pair<std::string, Module*>> Module::named_modules(const std::string& prefix) {
  std::vector<std::pair<std::string, Module*>> out;
  std::unordered_set<Module*> seen;
  std::function<void(Module&, const std::string&)> walk = [&](Module& m, const std::string& p) {
    if (!seen.insert(&m).second) return;
    out.emplace_back(p, &m);
    for (auto& [name, c] : m.children_) walk(*c, p.empty() ? name : p + "." + name);
  };
  walk(*this, prefix);
  return out;
}

std::vector<std::pair<std::string, Tensor>> Module::named_parameters(bool recurse) const {
  std::vector<std::pair<std::string, Tensor>> out;
  std::unordered_set<TensorImpl*> seen;
  auto* self = const_cast<Module*>(this);
  auto mods = recurse ? self->named_modules() : std::vector<std::pair<std::string, Module*>>{{"", self}};
  for (auto& [prefix, m] : mods)
    for (auto& s : m->params_)
      if (s.value.defined() && seen.insert(s.value.impl()).second)
        out.emplace_back(prefix.empty() ? s.name : prefix + "." + s.name, s.value);
  return out;
}

TensorList Module::parameters(bool recurse) const {
  TensorList out;
  for (auto& [n, t] : named_parameters(recurse)) out.push_back(t);
  return out;
}

std::vector<std::pair<std::string, Tensor>> Module::named_buffers(bool recurse) const {
  std::vector<std::pair<std::string, Tensor>> out;
  auto* self = const_cast<Module*>(this);
  auto mods = recurse ? self->named_modules() : std::vector<std::pair<std::string, Module*>>{{"", self}};
  for (auto& [prefix, m] : mods)
    for (auto& s : m->buffers_)
      if (s.value.defined()) out.emplace_back(prefix.empty() ? s.name : prefix + "." + s.name, s.value);
  return out;
}

void Module::train(bool on) {
  for (auto& [p, m] : named_modules()) m->training_ = on;
}

void Module::apply(const std::function<void(Module&)>& fn) {
  for (auto& [name, c] : children_) c->apply(fn);
  fn(*this);
}

namespace {
// Runs `convert` on every slot of every module, with extension hooks around it.
// Tied parameters (one tensor in several slots) are converted once and stay tied.
void convert_slots(Module& root, const std::function<Tensor(const Tensor&)>& convert) {
  auto mods = root.named_modules();
  for (auto& [p, m] : mods)
    if (m->extension) m->extension->before_move(*m);
  // old impl -> (the old tensor, kept alive so its address is not reused; its conversion)
  std::unordered_map<TensorImpl*, std::pair<Tensor, Tensor>> done;
  auto once = [&](Tensor& slot) {
    if (!slot.defined()) return;
    if (auto it = done.find(slot.impl()); it != done.end()) {
      slot = it->second.second;
      return;
    }
    Tensor keep = slot;
    Tensor fresh = convert(slot);
    if (!fresh.is_same(slot) && keep.requires_grad() && is_floating(fresh.dtype()))
      fresh.set_requires_grad(true);
    done.emplace(keep.impl(), std::pair{keep, fresh});
    slot = fresh;
  };
  for (auto& [p, m] : mods) {
    for (auto& s : m->parameter_slots()) once(s.value);
    for (auto& s : m->buffer_slots()) once(s.value);
  }
  for (auto& [p, m] : mods)
    if (m->extension) m->extension->after_move(*m);
}
}  // namespace

void Module::to(DType dtype) {
  autograd::NoGradGuard no_grad;
  convert_slots(*this, [dtype](const Tensor& t) {
    return is_floating(t.dtype()) ? ops::to(t, dtype) : t;
  });
}

void Module::to_empty(Device device) {
  autograd::NoGradGuard no_grad;
  convert_slots(*this, [device](const Tensor& t) {
    if (!is_dtensor(t)) return empty(t.shape(), t.dtype(), device);
    // A sharded parameter gets bytes for its local shard only.
    const DTensorSpec& spec = dtensor_spec(t);
    return make_dtensor(empty(spec.local.shape(), t.dtype(), device), spec.mesh, spec.placements, spec.global_shape);
  });
}

void Module::init_weights(uint64_t seed) {
  autograd::NoGradGuard no_grad;
  // Reverse pre-order: a tied parameter ends up initialised by the module that
  // owns its first FQN (transformer.wte.weight, not lm_head.weight).
  auto mods = named_modules();
  for (auto it = mods.rbegin(); it != mods.rend(); ++it)
    it->second->reset_parameters(seed, it->first.empty() ? "" : it->first + ".");
}

void Module::reset_parameters(uint64_t, const std::string&) {}

void Module::zero_grad(bool set_to_none) {
  for (Tensor& p : parameters()) {
    if (!p.grad().defined()) continue;
    if (set_to_none) {
      p.set_grad(Tensor());
    } else {
      Tensor g = p.grad();
      ops::zero_(g);
    }
  }
}

StateDict Module::state_dict() {
  auto mods = named_modules();
  for (auto& [p, m] : mods)
    if (m->extension) m->extension->before_state_dict(*m);
  StateDict out;
  for (auto& [prefix, m] : mods) {
    std::string pre = prefix.empty() ? "" : prefix + ".";
    for (auto& s : m->params_)
      if (s.value.defined()) out.emplace_back(pre + s.name, s.value);
    for (auto& s : m->buffers_)
      if (s.value.defined() && s.persistent) out.emplace_back(pre + s.name, s.value);
  }
  return out;
}

void Module::load_state_dict(const StateDict& state, bool strict) {
  autograd::NoGradGuard no_grad;
  StateDict own = state_dict();
  std::unordered_map<std::string, const Tensor*> given, mine;  // by name: no search per key
  for (const auto& [k, v] : state) given.emplace(k, &v);
  for (const auto& [k, v] : own) mine.emplace(k, &v);
  auto lookup = [](const std::unordered_map<std::string, const Tensor*>& m, const std::string& name) {
    auto it = m.find(name);
    return it == m.end() ? nullptr : it->second;
  };
  std::vector<std::string> missing, unexpected, mismatched;
  for (auto& [name, dst] : own) {
    const Tensor* src = lookup(given, name);
    if (src == nullptr) {
      missing.push_back(name);
      continue;
    }
    if (src->shape() != dst.shape()) {
      mismatched.push_back(fmt::format("{}: checkpoint {} vs model {}", name,
                                       shape_str(src->shape()), shape_str(dst.shape())));
    }
  }
  for (auto& [name, t] : state)
    if (lookup(mine, name) == nullptr) unexpected.push_back(name);
  TS_CHECK(mismatched.empty(), "load_state_dict: size mismatch for {}", key_list(mismatched));
  TS_CHECK(!strict || (missing.empty() && unexpected.empty()),
           "load_state_dict: missing keys [{}]; unexpected keys [{}]", quoted_keys(missing),
           quoted_keys(unexpected));
  for (auto& [name, dst] : own) {
    const Tensor* src = lookup(given, name);
    if (src == nullptr || src->is_same(dst)) continue;
    ops::copy_(dst, *src);
  }
  for (auto& [p, m] : named_modules())
    if (m->extension) m->extension->after_load_state_dict(*m);
}

Module::HookId Module::register_forward_pre_hook(ForwardPreHook hook, bool prepend) {
  HookId id = next_hook_++;
  if (prepend) pre_hooks_.insert(pre_hooks_.begin(), {id, std::move(hook)});
  else pre_hooks_.emplace_back(id, std::move(hook));
  return id;
}

Module::HookId Module::register_forward_hook(ForwardHook hook, bool prepend) {
  HookId id = next_hook_++;
  if (prepend) post_hooks_.insert(post_hooks_.begin(), {id, std::move(hook)});
  else post_hooks_.emplace_back(id, std::move(hook));
  return id;
}

void Module::remove_hook(HookId id) {
  auto drop = [id](auto& v) {
    v.erase(std::remove_if(v.begin(), v.end(), [id](const auto& e) { return e.first == id; }), v.end());
  };
  drop(pre_hooks_);
  drop(post_hooks_);
}

void ModuleList::push_back(ModulePtr m) { add_child(std::to_string(size()), std::move(m)); }

}  // namespace tessera::nn
