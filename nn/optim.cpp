#include "nn/optim.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <map>

#include "dtensor/redistribute.h"
#include "runtime/math.h"
#include "runtime/profiler.h"

namespace tessera::optim {

Optimizer::Optimizer(std::vector<ParamGroup> groups) : groups_(std::move(groups)) {
  std::vector<const Tensor*> seen;
  for (size_t gi = 0; gi < groups_.size(); ++gi)
    for (auto& p : groups_[gi].params) {
      TS_CHECK(p.defined(), "optimizer: undefined parameter");
      TS_CHECK(p.requires_grad() && p.is_leaf(),
               "optimizer: parameters must be leaf tensors that require grad (got {})",
               shape_str(p.shape()));
      // As torch.optim: a parameter listed twice would be updated twice per step.
      for (const Tensor* q : seen)
        TS_CHECK(!q->is_same(p), "optimizer: a parameter ({}) appears more than once (group {})",
                 shape_str(p.shape()), gi);
      seen.push_back(&p);
    }
}

void Optimizer::zero_grad(bool set_to_none) {
  TS_PROFILE("zero_grad");
  for (auto& g : groups_)
    for (auto& p : g.params) {
      if (!p.grad().defined()) continue;
      if (set_to_none) {
        p.set_grad(Tensor());
      } else {
        Tensor grad = p.grad();
        ops::zero_(grad);
      }
    }
}

void Optimizer::check_params() const {
  for (const auto& g : groups_)
    for (const auto& p : g.params)
      TS_CHECK(is_dtensor(p) || !p.storage() || p.storage()->is_allocated() || p.is_meta(),
               "optimizer: a parameter's storage has been released ({}): this optimizer holds parameters "
               "that no longer train",
               p.storage()->release_note.empty() ? "freed" : p.storage()->release_note);
}

void Optimizer::set_lr(double lr) {
  for (auto& g : groups_) g.lr = lr;
}

namespace {
std::vector<ParamGroup> one_group(const TensorList& params, double lr, double wd) {
  return {ParamGroup{params, lr, wd}};
}

// The tensor a kernel updates: a DTensor's local shard, a plain tensor itself.
Tensor local_of(const Tensor& t) { return is_dtensor(t) ? local_tensor(t) : t; }

// Whether `others` are laid out as p: plain tensors, or DTensors on p's mesh
// with p's placements (so that updating the local tensors updates the whole).
bool same_layout(const Tensor& p, std::initializer_list<Tensor> others) {
  for (const Tensor& o : others) {
    if (is_dtensor(o) != is_dtensor(p)) return false;
    if (!is_dtensor(p)) continue;
    const DTensorSpec &a = dtensor_spec(p), &b = dtensor_spec(o);
    if (!(*a.mesh == *b.mesh) || a.placements != b.placements || a.global_shape != b.global_shape) return false;
  }
  return true;
}
}  // namespace

AdamW::AdamW(const TensorList& params, AdamWOptions options)
    : AdamW(one_group(params, options.lr, options.weight_decay), options) {}

AdamW::AdamW(std::vector<ParamGroup> groups, AdamWOptions options)
    : Optimizer(std::move(groups)), options_(options) {
  TS_CHECK(options.lr >= 0 && options.eps >= 0 && options.beta1 >= 0 && options.beta1 < 1 &&
               options.beta2 >= 0 && options.beta2 < 1,
           "AdamW: invalid options (lr {}, betas ({}, {}), eps {})", options.lr, options.beta1,
           options.beta2, options.eps);
  for (auto& g : groups_) state_.emplace_back(g.params.size());
}

void AdamW::step() {
  TS_PROFILE("AdamW.step");
  check_params();
  autograd::NoGradGuard no_grad;
  auto hyper = [&](const ParamGroup& group, int64_t step) {
    return ops::AdamWStep{.lr = group.lr, .beta1 = options_.beta1, .beta2 = options_.beta2,
                          .eps = options_.eps, .weight_decay = group.weight_decay, .step = step};
  };
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    ParamGroup& group = groups_[gi];
    // The fused update, per device and step count: the local tensors of each.
    std::map<std::pair<std::string, int64_t>, std::array<std::vector<Tensor>, 4>> fused;
    for (size_t j = 0; j < group.params.size(); ++j) {
      Tensor& p = group.params[j];
      Tensor grad = p.grad();
      if (!grad.defined()) continue;
      State& s = state_[gi][j];
      if (s.step == 0) {
        s.exp_avg = zeros_like(p);
        s.exp_avg_sq = zeros_like(p);
      }
      s.step += 1;
      std::array<Tensor, 4> local = {local_of(p), local_of(grad), local_of(s.exp_avg), local_of(s.exp_avg_sq)};
      if (options_.fused && same_layout(p, {grad, s.exp_avg, s.exp_avg_sq}) &&
          ops::adamw_fusable(local[0], local[1], local[2], local[3])) {
        auto& lists = fused[{local[0].device().str(), s.step}];
        for (int k = 0; k < 4; ++k) lists[k].push_back(local[k]);
        continue;
      }
      // Unfused: the same steps as math::adamw_update, one op each.
      auto k = math::adamw_constants<double>(hyper(group, s.step));
      if (group.weight_decay != 0.0) ops::mul_(p, k.decay);
      ops::lerp_(s.exp_avg, grad, k.one_minus_beta1);
      ops::mul_(s.exp_avg_sq, k.beta2);
      ops::addcmul_(s.exp_avg_sq, grad, grad, k.one_minus_beta2);
      Tensor denom = ops::sqrt(s.exp_avg_sq);
      ops::mul_(denom, k.inv_sqrt_bias2);
      ops::add_(denom, k.eps);
      ops::addcdiv_(p, s.exp_avg, denom, k.neg_step_size);
    }
    for (auto& [key, lists] : fused) ops::adamw_(lists[0], lists[1], lists[2], lists[3], hyper(group, key.second));
  }
}

namespace {
std::string name_of(const Tensor& p, const std::vector<std::pair<std::string, Tensor>>& named) {
  for (const auto& [n, t] : named)
    if (t.is_same(p)) return n;
  TS_CHECK(false, "optimizer state_dict: a parameter of the optimizer is not among the named parameters given");
}
}  // namespace

StateDict AdamW::state_dict(const std::vector<std::pair<std::string, Tensor>>& named) const {
  StateDict out;
  for (size_t g = 0; g < groups_.size(); ++g)
    for (size_t j = 0; j < groups_[g].params.size(); ++j) {
      const State& s = state_[g][j];
      if (!s.exp_avg.defined()) continue;
      std::string n = name_of(groups_[g].params[j], named);
      out.emplace_back(n + ".exp_avg", s.exp_avg);
      out.emplace_back(n + ".exp_avg_sq", s.exp_avg_sq);
      out.emplace_back(n + ".step", full({}, static_cast<double>(s.step), DType::I64));
    }
  return out;
}

void AdamW::init_state() {
  autograd::NoGradGuard no_grad;
  for (size_t g = 0; g < groups_.size(); ++g)
    for (size_t j = 0; j < groups_[g].params.size(); ++j) {
      State& s = state_[g][j];
      if (s.exp_avg.defined()) continue;
      s.exp_avg = zeros_like(groups_[g].params[j]);
      s.exp_avg_sq = zeros_like(groups_[g].params[j]);
    }
}

void AdamW::load_state_dict(const StateDict& sd, const std::vector<std::pair<std::string, Tensor>>& named) {
  autograd::NoGradGuard no_grad;
  for (size_t g = 0; g < groups_.size(); ++g)
    for (size_t j = 0; j < groups_[g].params.size(); ++j) {
      std::string n = name_of(groups_[g].params[j], named);
      const Tensor* step = nn::find_in(sd, n + ".step");
      if (step == nullptr) continue;
      const Tensor* m = nn::find_in(sd, n + ".exp_avg");
      const Tensor* v = nn::find_in(sd, n + ".exp_avg_sq");
      TS_CHECK(m && v, "optimizer load_state_dict: '{}' has a step but no exp_avg/exp_avg_sq", n);
      State& s = state_[g][j];
      if (!s.exp_avg.defined()) {
        s.exp_avg = zeros_like(groups_[g].params[j]);
        s.exp_avg_sq = zeros_like(groups_[g].params[j]);
      }
      TS_CHECK(m->shape() == s.exp_avg.shape() && v->shape() == s.exp_avg.shape(),
               "optimizer load_state_dict: '{}' moments are {} but the parameter is {}", n, shape_str(m->shape()),
               shape_str(s.exp_avg.shape()));
      if (!m->is_same(s.exp_avg)) ops::copy_(s.exp_avg, *m);
      if (!v->is_same(s.exp_avg_sq)) ops::copy_(s.exp_avg_sq, *v);
      s.step = static_cast<int64_t>(step->item());
    }
}

SGD::SGD(const TensorList& params, SGDOptions options)
    : Optimizer(one_group(params, options.lr, options.weight_decay)), options_(options) {
  TS_CHECK(!options.nesterov || (options.momentum > 0 && options.dampening == 0),
           "SGD: nesterov needs momentum > 0 and dampening 0");
  momentum_.resize(groups_[0].params.size());
}

void SGD::step() {
  TS_PROFILE("SGD.step");
  check_params();
  autograd::NoGradGuard no_grad;
  ParamGroup& group = groups_[0];
  for (size_t j = 0; j < group.params.size(); ++j) {
    Tensor& p = group.params[j];
    Tensor grad = p.grad();
    if (!grad.defined()) continue;
    Tensor d = grad;
    if (group.weight_decay != 0.0) {
      d = ops::clone(grad);
      ops::add_(d, p, group.weight_decay);
    }
    if (options_.momentum != 0.0) {
      Tensor& buf = momentum_[j];
      if (!buf.defined()) {
        buf = ops::clone(d);
      } else {
        ops::mul_(buf, options_.momentum);
        ops::add_(buf, d, 1.0 - options_.dampening);
      }
      if (options_.nesterov) {
        d = ops::clone(d);
        ops::add_(d, buf, options_.momentum);
      } else {
        d = buf;
      }
    }
    ops::add_(p, d, -group.lr);
  }
}

double LRSchedule::lr_at(int64_t step) const {
  if (step < warmup) return max_lr * static_cast<double>(step + 1) / static_cast<double>(warmup);
  if (kind == Kind::Constant) return max_lr;
  if (step >= total) return min_lr;
  const double span = static_cast<double>(std::max<int64_t>(1, total - warmup));
  double progress = static_cast<double>(step - warmup) / span;  // 0 .. 1 over the decay
  switch (kind) {
    case Kind::Cosine: return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + std::cos(M_PI * progress));
    case Kind::Linear: return max_lr + (min_lr - max_lr) * progress;
    case Kind::WSD: {
      // Stable for the first 1 - decay_ratio of the steps after warmup, then
      // a line that reaches min_lr at `total`.
      const double stable = 1.0 - decay_ratio;
      if (progress < stable) return max_lr;
      return max_lr + (min_lr - max_lr) * (progress - stable) / decay_ratio;
    }
    case Kind::Constant: break;
  }
  return max_lr;
}

std::string LRSchedule::describe() const {
  std::string w = warmup > 0 ? fmt::format("warmup {} steps, then ", warmup) : "";
  switch (kind) {
    case Kind::Cosine: return fmt::format("{}cosine to {:.2e} at step {}", w, min_lr, total);
    case Kind::Linear: return fmt::format("{}linear to {:.2e} at step {}", w, min_lr, total);
    case Kind::Constant: return fmt::format("{}constant {:.2e}", w, max_lr);
    case Kind::WSD:
      return fmt::format("{}stable {:.2e}, then linear to {:.2e} over the last {:g}% to step {}", w, max_lr, min_lr,
                         100 * decay_ratio, total);
  }
  return "";
}

LRSchedule::Kind schedule_kind(const std::string& name) {
  if (name == "cosine") return LRSchedule::Kind::Cosine;
  if (name == "linear") return LRSchedule::Kind::Linear;
  if (name == "constant") return LRSchedule::Kind::Constant;
  if (name == "wsd") return LRSchedule::Kind::WSD;
  TS_CHECK(false, "learning-rate schedule '{}': expected cosine, linear, constant or wsd", name);
  return LRSchedule::Kind::Cosine;
}

}  // namespace tessera::optim

namespace tessera::nn {

Tensor grad_norm(const TensorList& params, const dist::ProcessGroupPtr& sum_over) {
  TS_PROFILE("grad_norm");
  // Plain gradients are summed here. Sharded ones: each rank sums the squares
  // of its shards (divided by how many ranks hold a replica of them), then one
  // all-reduce per mesh adds the ranks up. Everything stays on the device:
  // one sum-of-squares kernel per group of tensors, no host sync.
  struct MeshPart {
    MeshPtr mesh;
    std::vector<std::pair<double, TensorList>> by_replicas;  // divisor -> local shards
  };
  TensorList plain;
  std::vector<MeshPart> meshes;
  std::optional<Device> device;
  for (const Tensor& p : params) {
    Tensor g = p.grad();
    if (!g.defined()) continue;
    if (!is_dtensor(g)) {
      plain.push_back(g);
      device = g.device();
      continue;
    }
    const DTensorSpec* spec = &dtensor_spec(g);
    Tensor reduced;
    for (const auto& pl : spec->placements)
      if (is_partial(pl)) {  // a pending reduction has to happen before squaring
        Placements ps = spec->placements;
        for (auto& q : ps)
          if (is_partial(q)) q = Replicate{};
        reduced = redistribute_local(g, ps);
        spec = &dtensor_spec(reduced);
        break;
      }
    double replicas = 1;
    for (size_t i = 0; i < spec->placements.size(); ++i)
      if (is_replicate(spec->placements[i])) replicas *= static_cast<double>(spec->mesh->size(static_cast<int64_t>(i)));
    device = spec->local.device();
    auto m = std::find_if(meshes.begin(), meshes.end(), [&](const MeshPart& e) { return *e.mesh == *spec->mesh; });
    if (m == meshes.end()) m = meshes.insert(meshes.end(), MeshPart{spec->mesh, {}});
    auto r = std::find_if(m->by_replicas.begin(), m->by_replicas.end(), [&](const auto& e) { return e.first == replicas; });
    if (r == m->by_replicas.end()) r = m->by_replicas.insert(m->by_replicas.end(), {replicas, {}});
    r->second.push_back(spec->local);
  }
  // A rank with no gradients still takes part in sum_over's all-reduce.
  if (!device && !sum_over) return zeros({}, DType::F64);
  if (!device) device = Device::cpu();
  Tensor total = ops::sum_squares(plain, *device);
  for (auto& [mesh, groups] : meshes) {
    Tensor part = zeros({}, DType::F64, *device);
    for (auto& [replicas, locals] : groups) {
      Tensor s = ops::sum_squares(locals, *device);
      part = ops::add(part, replicas == 1 ? s : ops::binary(ops::BinaryOp::Div, s, replicas));
    }
    Tensor flat = ops::reshape(part, {1});
    mesh->flat_group()->all_reduce(flat)->wait(current_stream(*device));
    total = ops::add(total, ops::reshape(flat, {}));
  }
  if (sum_over && sum_over->size() > 1) {  // other ranks' parameters: a pipeline's stages
    Tensor flat = ops::reshape(total, {1});
    sum_over->all_reduce(flat)->wait(current_stream(*device));
    total = ops::reshape(flat, {});
  }
  return ops::sqrt(total);
}

Tensor clip_grad_norm_(const TensorList& params, double max_norm, const dist::ProcessGroupPtr& sum_over) {
  TS_PROFILE("clip_grad_norm_");
  Tensor norm = grad_norm(params, sum_over);
  // coef = min(1, max_norm / (norm + 1e-6)), computed where the norm is.
  Tensor coef = ops::binary(ops::BinaryOp::Minimum,
                            ops::binary(ops::BinaryOp::Div, max_norm, ops::add(norm, 1e-6)), 1.0);
  autograd::NoGradGuard no_grad;
  // On the host the value is free to read, and a coefficient of 1 skips a pass
  // over the gradients; elsewhere reading it would sync, so every gradient is
  // scaled (by exactly 1 when under the limit: the same bits).
  if (norm.device().is_host_visible() && coef.item() >= 1.0) return norm;
  // One pass over all gradients per device (a few launches on CUDA, not one
  // per tensor), the coefficient in f32 (f64 for f64 gradients), never
  // rounded to a bf16 gradient's dtype, and read where it lies.
  std::vector<std::pair<Device, std::vector<Tensor>>> by_device;
  std::vector<std::pair<Tensor, Tensor>> strided;  // (gradient, its contiguous copy)
  for (const Tensor& p : params) {
    Tensor g = p.grad();
    if (!g.defined()) continue;
    Tensor local = optim::local_of(g);
    if (local.numel() == 0) continue;
    if (!local.is_contiguous()) {
      strided.emplace_back(local, ops::contiguous(local));
      local = strided.back().second;
    }
    auto d = std::find_if(by_device.begin(), by_device.end(), [&](const auto& e) { return e.first == local.device(); });
    if (d == by_device.end()) d = by_device.insert(by_device.end(), {local.device(), {}});
    d->second.push_back(local);
  }
  for (auto& [device, grads] : by_device)
    ops::scale_(grads, device == coef.device() ? coef : ops::to(coef, device));
  for (auto& [g, copy] : strided) ops::copy_(g, copy);
  return norm;
}

}  // namespace tessera::nn
