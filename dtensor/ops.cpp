// Sharding rules for the ops DTensors support: what an optimizer, a norm, an
// initialiser and tensor-parallel Linear layers need. Registered with the
// runtime at load time (runtime/dtensor_hook.h).
//
//   elementwise        same placements in, same out (others are redistributed to
//                      the first DTensor's); a Partial input is reduced first,
//                      except for ops linear in it (add/sub of Partials, scaling)
//   in-place           every DTensor operand must share the target's spec; runs
//                      on the local shards with no communication
//   sum / mean         a reduced sharded dim becomes Partial(sum)
//   linear / matmul    Replicate x Shard(0) weight [out, in] -> Shard(-1) (column-wise),
//                      Shard(-1) x Shard(1) weight -> Partial (row-wise), batch-sharded
//                      input x Replicate weight -> same batch shard; linear's backward
//                      follows the forward's split (linear_backward_rule)
//   normal_/uniform_   each local element draws the counter of its global position
//   layer/rms_norm     input split on any dim but the last (sequence parallelism's
//                      Shard(1)) with Replicate weight/bias -> the input's split;
//                      weight/bias gradients Partial over the splitting dims
//   embedding          a table split on the vocabulary (Shard(0): Partial output,
//                      out-of-range tokens give zero rows) or the features
//                      (Shard(1): Shard(-1) output); embedding_rule
//   gradient layout    a parameter's gradient takes the parameter's placements
//                      as it accumulates (Partial -> Replicate: one all-reduce)
//   softmax, attention per shard (dtensor/shard_rules.cpp): split on the dims the op treats independently
//   and RoPE           (all but softmax's dim; attention's batch and heads, query and
//                      key/value heads split evenly; RoPE's dims before [T, D]); other
//                      splits and Partial sums are gathered first
//   reshape, view,     the splits follow the dims; a reshaped split dim must lead the
//   permute, transpose dims it becomes and split into whole rows of them (shard_rules.cpp)
//   cross_entropy      logits [N, C] Shard(1) on one mesh dim (loss parallelism:
//                      three all-reduces of N values, the logits never gathered),
//                      Shard(0) (rows) or Replicate on the others; its backward
//                      needs no communication (cross_entropy_rule)
#include <cmath>
#include <limits>

#include "dtensor/redistribute.h"
#include "dtensor/shard_rules.h"
#include "runtime/dtensor_hook.h"
#include "runtime/ops.h"

namespace tessera {

namespace {

bool is_scalar_plain(const Tensor& t) { return t.defined() && !t.is_distributed() && t.dim() == 0; }

const Tensor* first_dtensor(const std::vector<Tensor>& inputs) {
  for (const auto& t : inputs)
    if (t.defined() && t.is_distributed()) return &t;
  return nullptr;
}

Placements without_partial(const Placements& ps) {
  Placements out = ps;
  for (auto& p : out)
    if (is_partial(p)) p = Replicate{};
  return out;
}

bool has_partial(const Placements& ps) {
  for (const auto& p : ps)
    if (is_partial(p)) return true;
  return false;
}

// The local tensors of the inputs, each DTensor first moved to `placements`.
std::vector<Tensor> locals_at(const DistCall& call, const DTensorSpec& ref, const Placements& placements) {
  std::vector<Tensor> locals;
  for (const Tensor& t : call.inputs) {
    if (!t.defined() || !t.is_distributed()) {
      TS_CHECK(!t.defined() || t.dim() == 0,
               "{}: mixes a DTensor with a plain tensor of shape {}; make it a DTensor (distribute_tensor / "
               "from_local) or use a scalar",
               call.name, shape_str(t.shape()));
      locals.push_back(t);
      continue;
    }
    const DTensorSpec& s = dtensor_spec(t);
    TS_CHECK(*s.mesh == *ref.mesh, "{}: DTensors on different meshes ({} and {})", call.name, s.mesh->str(),
             ref.mesh->str());
    TS_CHECK(s.global_shape == ref.global_shape || t.dim() == 0,
             "{}: DTensor shapes {} and {} differ (broadcasting between DTensors is not supported)", call.name,
             shape_str(s.global_shape), shape_str(ref.global_shape));
    locals.push_back(local_at(t, placements));
  }
  return locals;
}

// Ops that stay exact on Partial inputs: add/sub (of Partials), negation,
// and scaling by a plain scalar.
bool linear_in_partials(const DistCall& call) {
  if (call.cls == OpClass::LinearElementwise) return true;
  std::string name = call.name;
  return (name == "mul" || name == "div") && call.inputs.size() == 2 && is_scalar_plain(call.inputs[1]);
}

std::vector<Tensor> elementwise(DistCall& call) {
  const DTensorSpec& ref = dtensor_spec(*first_dtensor(call.inputs));
  Placements target = ref.placements;
  if (has_partial(target) && !linear_in_partials(call)) target = without_partial(target);
  std::vector<Tensor> out = call.local(locals_at(call, ref, target));
  for (auto& t : out)
    if (t.defined()) t = make_dtensor(t, ref.mesh, target, ref.global_shape);
  return out;
}

std::vector<Tensor> inplace(DistCall& call) {
  const Tensor& target = call.inputs[0];
  TS_CHECK(target.is_distributed(), "{}: updating a plain tensor from a DTensor; use to_local() or full_tensor()",
           call.name);
  const DTensorSpec& ref = dtensor_spec(target);
  for (size_t i = 1; i < call.inputs.size(); ++i) {
    const Tensor& t = call.inputs[i];
    if (!t.defined() || is_scalar_plain(t)) continue;
    TS_CHECK(t.is_distributed(), "{}: operand {} is a plain tensor of shape {}; in-place updates of a DTensor take "
             "DTensors with the same placements (or scalars)", call.name, i, shape_str(t.shape()));
    const DTensorSpec& s = dtensor_spec(t);
    TS_CHECK(*s.mesh == *ref.mesh && s.placements == ref.placements && s.global_shape == ref.global_shape,
             "{}: operand {} is {} but the target is {}: in-place updates run on local shards and need equal "
             "specs",
             call.name, i, s.str(), ref.str());
  }
  call.local(locals_at(call, ref, ref.placements));
  return {target};
}

std::vector<Tensor> reduction(DistCall& call) {
  const Tensor& x = call.inputs[0];
  const DTensorSpec& ref = dtensor_spec(x);
  int64_t nd = static_cast<int64_t>(ref.global_shape.size());
  std::vector<bool> reduced(static_cast<size_t>(nd), call.dims.empty());
  for (int64_t d : call.dims) reduced[static_cast<size_t>(wrap_dim(d, nd, call.name))] = true;
  Placements out_p = ref.placements;
  for (auto& p : out_p) {
    if (!is_shard(p)) continue;
    int64_t d = shard_dim(p);
    if (reduced[static_cast<size_t>(d)]) {
      p = Partial{dist::ReduceOp::Sum};
    } else if (!call.keepdim) {
      int64_t removed = 0;
      for (int64_t k = 0; k < d; ++k) removed += reduced[static_cast<size_t>(k)];
      p = moved_to(p, d - removed);
    }
  }
  Shape out_shape;
  for (int64_t d = 0; d < nd; ++d) {
    if (!reduced[static_cast<size_t>(d)]) out_shape.push_back(ref.global_shape[static_cast<size_t>(d)]);
    else if (call.keepdim) out_shape.push_back(1);
  }
  Tensor local = call.local({ref.local})[0];
  return {make_dtensor(local, ref.mesh, out_p, out_shape)};
}

// Placement of one operand on mesh dim i ("plain" operands count as Replicate).
Placement at(const Tensor& t, size_t i) {
  if (!t.defined() || !t.is_distributed()) return Replicate{};
  return dtensor_spec(t).placements[i];
}

// How a linear / matmul is split along one mesh dim, from its operands' placements.
enum class Split {
  Replicated,  // R x R -> R
  Colwise,     // R x S(out) -> S(-1): each rank computes some output features
  Rowwise,     // S(-1) x S(in) -> P: each rank sums over some input features
  Rows,        // S(batch) x R -> S(batch): each rank computes some rows
};

// The split of mesh dim i; a_dims/w_dims are the operands' ranks, w_out/w_in
// the weight's output- and input-feature dims.
Split split_of(const DistCall& call, const Placement& pa, const Placement& pw, size_t i, int64_t a_dims, int64_t w_dims,
               int64_t w_out, int64_t w_in) {
  if (is_replicate(pa) && is_replicate(pw)) return Split::Replicated;
  if (is_replicate(pa) && w_dims == 2 && is_shard(pw, w_out)) return Split::Colwise;
  if (is_shard(pa, a_dims - 1) && w_dims == 2 && is_shard(pw, w_in) && shard_blocks(pa) == shard_blocks(pw))
    return Split::Rowwise;  // (equal blocks: both hold the same input features, in the same order)
  if (is_shard(pa) && shard_dim(pa) < a_dims - 1 && is_replicate(pw)) return Split::Rows;
  TS_CHECK(false,
           "{}: no sharding rule for input {} and weight {} on mesh dim {} (supported: R x S(out) -> S(-1), "
           "S(-1) x S(in) -> P, S(batch) x R -> S(batch), R x R -> R)",
           call.name, placement_str(pa), placement_str(pw), i);
  return Split::Replicated;
}

std::vector<Tensor> linear_rule(DistCall& call) {
  const Tensor& a = call.inputs[0];
  const Tensor& w = call.inputs[1];
  const Tensor* bias = call.is_linear && call.inputs.size() > 2 && call.inputs[2].defined() ? &call.inputs[2] : nullptr;
  for (const Tensor* t : {&a, &w})
    TS_CHECK(t->is_distributed(), "{}: mixes DTensors and plain tensors; distribute every operand", call.name);
  const DTensorSpec& sa = dtensor_spec(a);
  const DTensorSpec& sw = dtensor_spec(w);
  TS_CHECK(*sa.mesh == *sw.mesh, "{}: operands on different meshes", call.name);
  int64_t ad = static_cast<int64_t>(sa.global_shape.size());
  int64_t wd = static_cast<int64_t>(sw.global_shape.size());
  // The output's global shape, from the op's own shape rule (not by running
  // it on meta: a planned step logs every meta kernel it runs).
  const Shape out_shape = call.is_linear ? ops::linear_shape(sa.global_shape, sw.global_shape)
                                         : ops::matmul_shape(sa.global_shape, sw.global_shape);
  int64_t od = static_cast<int64_t>(out_shape.size());
  // In linear, w is [out, in]: its "output features" dim is 0 and "input" dim is 1;
  // in matmul(a [.., k], b [k, n]) they are 1 and 0.
  int64_t w_out = call.is_linear ? 0 : wd - 1, w_in = call.is_linear ? 1 : wd - 2;
  Placements out_p;
  for (size_t i = 0; i < sa.placements.size(); ++i) {
    const Placement& pa = sa.placements[i];
    switch (split_of(call, pa, sw.placements[i], i, ad, wd, w_out, w_in)) {
      case Split::Replicated: out_p.push_back(Replicate{}); break;
      case Split::Colwise: out_p.push_back(moved_to(sw.placements[i], od - 1)); break;
      case Split::Rowwise: out_p.push_back(Partial{dist::ReduceOp::Sum}); break;
      case Split::Rows: out_p.push_back(moved_to(pa, shard_dim(pa) + (od - ad))); break;
    }
    if (bias) {
      Placement pb = at(*bias, i);
      bool ok = is_shard(out_p.back(), od - 1) ? pb == moved_to(out_p.back(), 0) : is_replicate(pb);
      TS_CHECK(ok, "{}: bias placement {} does not fit output placement {} on mesh dim {}", call.name,
               placement_str(pb), placement_str(out_p.back()), i);
    }
  }
  std::vector<Tensor> locals{sa.local, sw.local};
  if (bias) {
    // With a Partial output the bias is added by one rank per partial group, so the sum has it once.
    bool mine = true;
    for (size_t i = 0; i < out_p.size(); ++i)
      if (is_partial(out_p[i]) && sa.mesh->get_local_rank(static_cast<int64_t>(i)) != 0) mine = false;
    locals.push_back(mine ? (bias->is_distributed() ? dtensor_spec(*bias).local : *bias) : Tensor());
  } else if (call.is_linear) {
    locals.push_back(Tensor());
  }
  Tensor local = call.local(locals)[0];
  return {make_dtensor(local, sa.mesh, out_p, out_shape)};
}

// linear's backward, mesh dim by mesh dim from the forward's split: the
// output gradient is first laid out as the forward output was (a Partial
// output's gradient as Replicate), then each rank's local products give
//              dx          dw      db
//   Replicated R           R       R
//   Colwise    P(sum)      S(0)    S(0)    (each rank's features feed all of x)
//   Rowwise    S(-1)       S(1)    R
//   Rows       S(batch)    P(sum)  P(sum)  (each rank saw some rows)
std::vector<Tensor> linear_backward_rule(DistCall& call) {
  const Tensor& g = call.inputs[0];
  const Tensor& x = call.inputs[1];
  const Tensor& w = call.inputs[2];
  for (const Tensor* t : {&g, &x, &w})
    TS_CHECK(t->is_distributed(), "{}: mixes DTensors and plain tensors; distribute every operand", call.name);
  const DTensorSpec& sx = dtensor_spec(x);
  const DTensorSpec& sw = dtensor_spec(w);
  TS_CHECK(*sx.mesh == *sw.mesh && *dtensor_spec(g).mesh == *sx.mesh, "{}: operands on different meshes", call.name);
  const int64_t xd = static_cast<int64_t>(sx.global_shape.size());
  Placements gp, dx_p, dw_p, db_p;
  for (size_t i = 0; i < sx.placements.size(); ++i) {
    const Placement& px = sx.placements[i];
    switch (split_of(call, px, sw.placements[i], i, xd, 2, 0, 1)) {
      case Split::Replicated:
        gp.push_back(Replicate{}), dx_p.push_back(Replicate{}), dw_p.push_back(Replicate{}), db_p.push_back(Replicate{});
        break;
      case Split::Colwise: {
        const Placement& pw = sw.placements[i];  // S(0), or S(0)xb for a fused projection
        gp.push_back(moved_to(pw, xd - 1)), dx_p.push_back(Partial{}), dw_p.push_back(pw), db_p.push_back(pw);
        break;
      }
      case Split::Rowwise:
        gp.push_back(Replicate{}), dx_p.push_back(px), dw_p.push_back(sw.placements[i]), db_p.push_back(Replicate{});
        break;
      case Split::Rows:
        gp.push_back(px), dx_p.push_back(px), dw_p.push_back(Partial{}), db_p.push_back(Partial{});
        break;
    }
  }
  const Tensor g_local = local_at(g, gp);
  TensorList local = call.local({g_local, sx.local, sw.local});
  const int64_t out_features = sw.global_shape[0];
  std::vector<Tensor> d(3);
  if (local[0].defined()) d[0] = make_dtensor(local[0], sx.mesh, dx_p, sx.global_shape);
  if (local[1].defined()) d[1] = make_dtensor(local[1], sx.mesh, dw_p, sw.global_shape);
  if (local[2].defined()) d[2] = make_dtensor(local[2], sx.mesh, db_p, Shape{out_features});
  return d;
}

std::vector<Tensor> random(DistCall& call) {
  const DTensorSpec& ref = dtensor_spec(call.inputs[0]);
  for (const auto& p : ref.placements)
    TS_CHECK(!is_partial(p), "{}: cannot fill a Partial DTensor with random values", call.name);
  // Element i of each box of the shard is element offset + i of the full tensor.
  const Shape strides = call.spec.index_strides.empty() ? contiguous_strides(ref.global_shape) : call.spec.index_strides;
  for (LocalBox& box : local_boxes(call.inputs[0])) {
    RandomSpec s = call.spec;
    for (size_t d = 0; d < box.offset.size(); ++d) s.base += box.offset[d] * strides[d];
    s.index_strides = strides;
    call.random_fill(box.local, s);
  }
  return {call.inputs[0]};
}

std::vector<Tensor> like(DistCall& call) {
  const DTensorSpec& ref = dtensor_spec(call.inputs[0]);
  Tensor local = call.local({ref.local})[0];
  return {make_dtensor(local, ref.mesh, ref.placements, ref.global_shape)};
}

// ---- cross-entropy on sharded logits --------------------------------------------
//
// Megatron's vocabulary-parallel cross-entropy (PyTorch's loss_parallel): with
// the classes of logits [N, C] split over a mesh dim, each rank holds some
// columns of every row, and
//   lse_r  = m_r + log sum_j exp(x_rj - m_r),  m_r = max_j x_rj
//   loss_r = lse_r - x_r,target(r)
// need, over that dim, the all-reduced row maximum, the all-reduced sum of
// exponentials and the all-reduced target logit (held by one rank, 0 on the
// others): three all-reduces of N values, against an all-gather of N x C to
// gather the logits. Rows split over other mesh dims (Shard(0)) each give the
// loss terms of their rows, summed (with the count of counted targets) over
// those dims. The gradient, softmax - one-hot on the rank's own columns, needs
// the all-reduced lse only: no communication.

struct CrossEntropyLayout {
  MeshPtr mesh;
  Shape global;                   // [N, C]
  Placements placements;          // the logits', any Partial reduced
  Placements row_placements;      // Shard(0) where the logits split rows, Replicate elsewhere
  int64_t class_dim = -1;         // the mesh dim that splits the classes (-1: none)
  std::vector<int64_t> row_dims;  // the mesh dims that split the rows
  Tensor x;                       // the local logits [n, c]
  Tensor target;                  // the local targets [n], i64
  int64_t row0 = 0, class0 = 0;   // where the local block starts
};

CrossEntropyLayout cross_entropy_layout(const DistCall& call, const Tensor& logits, const Tensor& target) {
  TS_CHECK(logits.is_distributed(), "{}: the target is a DTensor but the logits are a plain tensor; distribute the "
           "logits (or gather the target)", call.name);
  const DTensorSpec& s = dtensor_spec(logits);
  TS_CHECK(s.global_shape.size() == 2, "{}: logits must be [N, C], got {}", call.name, shape_str(s.global_shape));
  CrossEntropyLayout l;
  l.mesh = s.mesh;
  l.global = s.global_shape;
  l.placements = without_partial(s.placements);
  for (size_t i = 0; i < l.placements.size(); ++i) {
    const Placement& p = l.placements[i];
    const int64_t dim = static_cast<int64_t>(i);
    if (is_shard(p, 1)) {
      TS_CHECK(l.class_dim < 0, "{}: logits {} split the classes over mesh dims {} and {}; loss parallelism takes "
               "one (redistribute the others to Replicate or Shard(0))", call.name, s.str(), l.class_dim, dim);
      l.class_dim = dim;
      l.row_placements.push_back(Replicate{});
    } else if (is_shard(p, 0)) {
      l.row_dims.push_back(dim);
      l.row_placements.push_back(Shard{0});
    } else {
      l.row_placements.push_back(Replicate{});
    }
  }
  l.x = local_at(logits, l.placements);
  auto [shape, offset] = local_shape_and_offset(l.global, *l.mesh, l.placements, l.mesh->get_coordinate());
  l.row0 = offset[0];
  l.class0 = offset[1];
  if (target.is_distributed()) {
    const DTensorSpec& t = dtensor_spec(target);
    TS_CHECK(*t.mesh == *l.mesh && t.global_shape == Shape{l.global[0]},
             "{}: target {} does not match logits {} (expected [{}] on the same mesh)", call.name, t.str(), s.str(),
             l.global[0]);
    l.target = local_at(target, l.row_placements);
  } else {
    TS_CHECK(target.dim() == 1 && target.size(0) == l.global[0],
             "{}: targets {} do not match logits {} (expected [{}])", call.name, shape_str(target.shape()),
             shape_str(l.global), l.global[0]);
    l.target = ops::narrow(target, 0, l.row0, shape[0]);
  }
  TS_CHECK(l.target.dtype() == DType::I64 || l.target.dtype() == DType::I32,
           "{}: targets must be i64 (class indices), got {}", call.name, dtype_name(l.target.dtype()));
  TS_CHECK(l.target.device() == l.x.device(), "{}: targets on {} but logits on {}", call.name,
           l.target.device().str(), l.x.device().str());
  l.target = ops::contiguous(ops::to(l.target, DType::I64));
  return l;
}

// Sums (or maximises) t over mesh dim `dim` in place; nothing on a dim of one rank.
Tensor all_reduce_over(const CrossEntropyLayout& l, Tensor t, int64_t dim, dist::ReduceOp op) {
  if (l.mesh->size(dim) == 1) return t;
  t = ops::contiguous(t);
  l.mesh->get_group(dim)->all_reduce(t, {op})->wait();
  return t;
}

// [n, c] bool: column j of row r is row r's target (none where the target lies
// in another rank's columns or is ignored).
Tensor target_columns(const CrossEntropyLayout& l) {
  Tensor classes = arange(l.class0, l.class0 + l.x.size(1), 1, DType::I64, l.x.device());
  return ops::binary(ops::BinaryOp::Eq, ops::unsqueeze(l.target, 1), ops::unsqueeze(classes, 0));
}

// A 0-dim operand's value on this rank (a Replicate or Partial DTensor reduced first).
Tensor scalar_value(const Tensor& t) {
  return t.is_distributed() ? local_at(t, Placements(dtensor_spec(t).placements.size(), Replicate{})) : t;
}

std::vector<Tensor> cross_entropy_rule(DistCall& call) {
  CrossEntropyLayout l = cross_entropy_layout(call, call.inputs[0], call.inputs[1]);
  const DType logits_dtype = call.inputs[0].dtype(), sd = compute_dtype(logits_dtype);
  const int64_t n = l.x.size(0), c = l.x.size(1);
  const Device dev = l.x.device();
  Tensor x = ops::to(l.x, sd);
  // A rank may hold no columns (fewer classes than ranks): it adds -inf to the maximum and 0 to the sums.
  Tensor m = c > 0 ? ops::max(x, 1, false).first : full({n}, -std::numeric_limits<double>::infinity(), sd, dev);
  if (l.class_dim >= 0) m = all_reduce_over(l, m, l.class_dim, dist::ReduceOp::Max);
  Tensor z = c > 0 ? ops::sum(ops::exp(ops::sub(x, ops::unsqueeze(m, 1))), {1}) : zeros({n}, sd, dev);
  Tensor picked = c > 0 ? ops::sum(ops::where(target_columns(l), x, zeros({}, sd, dev)), {1}) : zeros({n}, sd, dev);
  if (l.class_dim >= 0) {
    z = all_reduce_over(l, z, l.class_dim, dist::ReduceOp::Sum);
    picked = all_reduce_over(l, picked, l.class_dim, dist::ReduceOp::Sum);
  }
  Tensor lse = ops::add(m, ops::unary(ops::UnaryOp::Log, z));
  Tensor counted = ops::binary(ops::BinaryOp::Ne, l.target, static_cast<double>(call.ignore_index));
  Tensor losses = ops::where(counted, ops::sub(lse, picked), zeros({}, sd, dev));
  // A target outside [0, C) would match no column and pass as a loss of lse:
  // counted with the loss terms, so that every rank (whichever rows it
  // holds) refuses together rather than leave the others in a collective.
  auto f64 = [](const Tensor& b) { return ops::to(b, DType::F64); };
  Tensor invalid = ops::mul(f64(counted), ops::add(f64(ops::binary(ops::BinaryOp::Lt, l.target, 0.0)),
                                                   f64(ops::binary(ops::BinaryOp::Ge, l.target,
                                                                   static_cast<double>(l.global[1])))));
  Tensor sums = ops::cat({ops::reshape(ops::sum(losses, {}, false, DType::F64), {1}),
                             ops::reshape(ops::sum(counted, {}, false, DType::F64), {1}),
                             ops::reshape(ops::sum(invalid, {}, false, DType::F64), {1})}, 0);
  for (int64_t d : l.row_dims) sums = all_reduce_over(l, sums, d, dist::ReduceOp::Sum);
  Tensor total = ops::select(sums, 0, 0), count = ops::select(sums, 0, 1), bad = ops::select(sums, 0, 2);
  if (dev.is_host_visible()) {  // as the CPU's kernel checks its targets
    TS_CHECK(bad.item() == 0, "{}: {} target(s) out of range for {} classes (expected 0..{} or ignore_index {})",
             call.name, static_cast<int64_t>(bad.item()), l.global[1], l.global[1] - 1, call.ignore_index);
  } else {  // reading it on the host would sync the device: the loss becomes NaN instead
    total = ops::where(ops::binary(ops::BinaryOp::Gt, bad, 0.0), full({}, std::nan(""), DType::F64, dev), total);
  }
  Tensor loss = ops::to(ops::div(total, ops::binary(ops::BinaryOp::Maximum, count, 1.0)), logits_dtype);
  count = ops::contiguous(count);
  const Placements replicated(l.placements.size(), Replicate{});
  return {make_dtensor(loss, l.mesh, replicated, {}), make_dtensor(lse, l.mesh, l.row_placements, {l.global[0]}),
          make_dtensor(count, l.mesh, replicated, {})};
}

// d loss / d logits = (softmax - one-hot) x grad / count on the rank's own
// block, 0 on ignored rows: from the all-reduced lse, without communication.
std::vector<Tensor> cross_entropy_backward_rule(DistCall& call) {
  const Tensor& grad = call.inputs[0];
  const Tensor& lse = call.inputs[3];
  CrossEntropyLayout l = cross_entropy_layout(call, call.inputs[1], call.inputs[2]);
  const DType logits_dtype = call.inputs[1].dtype(), sd = compute_dtype(logits_dtype);
  const Device dev = l.x.device();
  Tensor lse_local = lse.is_distributed() ? local_at(lse, l.row_placements) : ops::narrow(lse, 0, l.row0, l.x.size(0));
  Tensor scale = ops::div(ops::to(scalar_value(grad), DType::F64),
                          ops::binary(ops::BinaryOp::Maximum, ops::to(scalar_value(call.inputs[4]), DType::F64), 1.0));
  Tensor x = ops::to(l.x, sd);
  Tensor p = ops::exp(ops::sub(x, ops::unsqueeze(ops::to(lse_local, sd), 1)));
  Tensor d = ops::mul(ops::sub(p, ops::to(target_columns(l), sd)), ops::to(scale, sd));
  Tensor counted = ops::binary(ops::BinaryOp::Ne, l.target, static_cast<double>(call.ignore_index));
  d = ops::where(ops::unsqueeze(counted, 1), d, zeros({}, sd, dev));
  return {make_dtensor(ops::contiguous(ops::to(d, logits_dtype)), l.mesh, l.placements, l.global)};
}

// ---- layer_norm / rms_norm on split rows ----------------------------------------
//
// A norm normalises each row (token) over the last dim alone, so an input
// split on any other dim (sequence parallelism's Shard(1) activations, a
// batch's Shard(0)) is normalised on each rank's rows without communication.
// The weight and bias are whole on every rank (Replicate DTensors); their
// gradients sum over the rows, so each rank's is the sum over its own rows:
// Partial over the mesh dims that split the input, reduced once when it
// accumulates into the parameter (autograd's relayout, below).

// The input's layout for a norm (any Partial reduced first), refused when the
// normalised dim is split; the weight and bias checked to be Replicate.
Placements norm_layout(const DistCall& call) {
  const bool backward = call.cls == OpClass::NormBackward;  // {dy, x, w, mean, rstd}, else {x, w, b}
  const Tensor& x = call.inputs[backward ? 1 : 0];
  TS_CHECK(x.is_distributed(), "{}: the weight is a DTensor but the input is a plain tensor of shape {}; make the "
           "input a DTensor (from_local) or the weight a plain tensor", call.name, shape_str(x.shape()));
  const DTensorSpec& s = dtensor_spec(x);
  const int64_t last = static_cast<int64_t>(s.global_shape.size()) - 1;
  Placements ps = without_partial(s.placements);
  for (size_t i = 0; i < ps.size(); ++i)
    TS_CHECK(!is_shard(ps[i], last), "{}: input {} is split on the normalised (last) dim over mesh dim {}; a norm "
             "needs whole rows (redistribute to Replicate or a Shard of another dim)", call.name, s.str(), i);
  const std::vector<std::pair<size_t, const char*>> params =
      backward ? std::vector<std::pair<size_t, const char*>>{{2, "weight"}}
               : std::vector<std::pair<size_t, const char*>>{{1, "weight"}, {2, "bias"}};
  for (const auto& [j, what] : params) {
    const Tensor& p = call.inputs[j];
    if (!p.defined()) continue;
    TS_CHECK(p.is_distributed(), "{}: the input is {} but the {} is a plain tensor; make it a Replicate DTensor on "
             "the same mesh (tp::SequenceParallel does), so that its gradient is summed over the ranks' rows",
             call.name, s.str(), what);
    const DTensorSpec& sp = dtensor_spec(p);
    TS_CHECK(*sp.mesh == *s.mesh, "{}: the input and the {} are on different meshes ({} and {})", call.name, what,
             s.mesh->str(), sp.mesh->str());
    for (const auto& pl : sp.placements)
      TS_CHECK(is_replicate(pl), "{}: the {} is {}; a norm's weight and bias must be Replicate (whole on every rank)",
               call.name, what, sp.str());
  }
  return ps;
}

Tensor local_or_none(const Tensor& t) { return t.defined() ? dtensor_spec(t).local : Tensor(); }

// Stats (mean, rstd) [rows] are laid out as the input's rows: the same Shards.
Shape rows_of(const Shape& global) { return Shape(global.begin(), global.end() - 1); }

std::vector<Tensor> norm_rule(DistCall& call) {
  const Placements ps = norm_layout(call);
  const DTensorSpec& s = dtensor_spec(call.inputs[0]);
  TensorList out = call.local({local_at(call.inputs[0], ps), local_or_none(call.inputs[1]),
                               local_or_none(call.inputs[2])});
  auto wrap = [&](const Tensor& t, const Shape& shape) {
    return t.defined() ? make_dtensor(t, s.mesh, ps, shape) : Tensor();
  };
  return {wrap(out[0], s.global_shape), wrap(out[1], rows_of(s.global_shape)), wrap(out[2], rows_of(s.global_shape))};
}

std::vector<Tensor> norm_backward_rule(DistCall& call) {
  const Placements ps = norm_layout(call);
  const DTensorSpec& s = dtensor_spec(call.inputs[1]);
  const Tensor& dy = call.inputs[0];
  TS_CHECK(dy.is_distributed(), "{}: the input is {} but its gradient is a plain tensor", call.name, s.str());
  auto stats = [&](const Tensor& t) { return t.defined() ? local_at(t, ps) : Tensor(); };
  TensorList local = call.local({local_at(dy, ps), local_at(call.inputs[1], ps), local_or_none(call.inputs[2]),
                                 stats(call.inputs[3]), stats(call.inputs[4])});
  Placements summed = ps;  // over the rows each rank holds: Partial where they are split
  for (auto& p : summed)
    if (is_shard(p)) p = Partial{dist::ReduceOp::Sum};
  const Shape features{s.global_shape.back()};
  std::vector<Tensor> d(3);
  if (local[0].defined()) d[0] = make_dtensor(local[0], s.mesh, ps, s.global_shape);
  for (size_t i = 1; i < 3; ++i)
    if (local[i].defined()) d[i] = make_dtensor(local[i], s.mesh, summed, features);
  return d;
}

// ---- embedding: a table split over the vocabulary or the features ----------------
//
// Per mesh dim, by the table's [V, D] placement (Megatron's
// VocabParallelEmbedding is the first):
//   Shard(0)   each rank holds some tokens' rows and looks up only those; the
//              other tokens give zero rows, so the output is Partial(sum) (an
//              all-reduce, or a reduce-scatter to a sequence split, completes it);
//              the gradient, taken whole, scatters into this rank's rows: Shard(0)
//   Shard(1)   each rank holds some features of every row: output Shard(-1),
//              gradient Shard(-1) -> Shard(1)
//   Replicate  the output is laid out as the indices (whole, or split on one of
//              their dims); the gradient of split indices is Partial
struct EmbeddingLayout {
  MeshPtr mesh;
  Placements out, grad, dweight;  // the output's, its gradient's as used, the table gradient's
  Shape out_shape, weight_shape;
  Tensor ids;   // this rank's indices (i64), as rows of its part of the table
  Tensor mask;  // where this rank's rows hold the token (undefined: the vocabulary is not split)
};

// check_range: the forward refuses out-of-range tokens; the backward gets the indices it already checked.
EmbeddingLayout embedding_layout(const DistCall& call, const Tensor& weight, const Tensor& indices, bool check_range) {
  TS_CHECK(weight.is_distributed(), "{}: the indices are a DTensor but the table is a plain tensor; distribute the "
           "table, or pass the indices' local tensor", call.name);
  const DTensorSpec& sw = dtensor_spec(weight);
  TS_CHECK(sw.global_shape.size() == 2, "{}: the table must be [num, dim], got {}", call.name,
           shape_str(sw.global_shape));
  EmbeddingLayout l;
  l.mesh = sw.mesh;
  l.weight_shape = sw.global_shape;
  const size_t n = sw.placements.size();
  Placements ip(n, Replicate{});
  if (indices.is_distributed()) {
    const DTensorSpec& si = dtensor_spec(indices);
    TS_CHECK(*si.mesh == *sw.mesh, "{}: the table and the indices are on different meshes ({} and {})", call.name,
             sw.mesh->str(), si.mesh->str());
    ip = si.placements;
  }
  const int64_t index_dims = indices.dim();
  for (size_t i = 0; i < n; ++i) {
    const Placement &pw = sw.placements[i], &pi = ip[i];
    TS_CHECK(!is_partial(pw) && !is_partial(pi), "{}: table {} and indices {} on mesh dim {}: a Partial table or "
             "indices has no meaning", call.name, placement_str(pw), placement_str(pi), i);
    if (is_replicate(pw)) {
      l.out.push_back(pi), l.grad.push_back(pi);
      l.dweight.push_back(is_shard(pi) ? Placement{Partial{}} : Placement{Replicate{}});
      continue;
    }
    TS_CHECK(is_replicate(pi), "{}: the table is split ({}) on mesh dim {}, so every rank there needs every index, "
             "but the indices are {}", call.name, placement_str(pw), i, placement_str(pi));
    if (is_shard(pw, 0)) l.out.push_back(Partial{}), l.grad.push_back(Replicate{}), l.dweight.push_back(Shard{0});
    else l.out.push_back(Shard{index_dims}), l.grad.push_back(Shard{index_dims}), l.dweight.push_back(Shard{1});
  }
  l.out_shape = indices.shape();
  l.out_shape.push_back(sw.global_shape[1]);
  Tensor ids = indices.is_distributed() ? local_at(indices, ip) : indices;
  TS_CHECK(ids.dtype() == DType::I64 || ids.dtype() == DType::I32, "{}: indices must be i32 or i64, got {}",
           call.name, dtype_name(ids.dtype()));
  TS_CHECK(ids.device() == sw.local.device(), "{}: the table on {} but the indices on {}", call.name,
           sw.local.device().str(), ids.device().str());
  auto [rows, offset] = local_shape_and_offset(sw.global_shape, *sw.mesh, sw.placements, sw.mesh->get_coordinate());
  const int64_t vocab = sw.global_shape[0];
  if (rows[0] == vocab) {  // the vocabulary is whole here: the kernel checks the range
    l.ids = ids;
    return l;
  }
  ids = ops::to(ids, DType::I64);
  if (check_range && ids.device().is_host_visible()) {  // no rank would hold an out-of-range token: refuse it, as the kernel does
    const double bad = ops::sum(ops::add(ops::to(ops::binary(ops::BinaryOp::Lt, ids, 0.0), DType::F64),
                                         ops::to(ops::binary(ops::BinaryOp::Ge, ids, static_cast<double>(vocab)),
                                                 DType::F64)),
                                {}, false, DType::F64)
                           .item();
    TS_CHECK(bad == 0, "{}: {} index(es) out of range for a table of {} rows (expected 0..{})", call.name,
             static_cast<int64_t>(bad), vocab, vocab - 1);
  }
  const double lo = static_cast<double>(offset[0]), hi = lo + static_cast<double>(rows[0]);
  l.mask = ops::where(ops::binary(ops::BinaryOp::Ge, ids, lo), ops::binary(ops::BinaryOp::Lt, ids, hi),
                      zeros({}, DType::Bool, ids.device()));
  l.ids = ops::where(l.mask, ops::sub(ids, full({}, lo, DType::I64, ids.device())),
                     zeros({}, DType::I64, ids.device()));
  return l;
}

// Zero where this rank's rows do not hold the token.
Tensor masked_rows(const EmbeddingLayout& l, const Tensor& t) {
  return l.mask.defined() ? ops::where(ops::unsqueeze(l.mask, -1), t, zeros({}, t.dtype(), t.device())) : t;
}

std::vector<Tensor> embedding_rule(DistCall& call) {
  const EmbeddingLayout l = embedding_layout(call, call.inputs[0], call.inputs[1], /*check_range=*/true);
  Tensor out = call.local({dtensor_spec(call.inputs[0]).local, l.ids})[0];
  return {make_dtensor(ops::contiguous(masked_rows(l, out)), l.mesh, l.out, l.out_shape)};
}

std::vector<Tensor> embedding_backward_rule(DistCall& call) {
  const EmbeddingLayout l = embedding_layout(call, call.inputs[2], call.inputs[1], /*check_range=*/false);
  const Tensor& grad = call.inputs[0];
  TS_CHECK(grad.is_distributed(), "{}: the table is {} but the output's gradient is a plain tensor", call.name,
           dtensor_spec(call.inputs[2]).str());
  Tensor g = masked_rows(l, local_at(grad, l.grad));
  Tensor d = call.local({g, l.ids, dtensor_spec(call.inputs[2]).local})[0];
  return {make_dtensor(d, l.mesh, l.dweight, l.weight_shape)};
}

// A gradient laid out as its parameter: Partial -> Replicate is the all-reduce
// sequence parallelism needs for its norms' weights (Megatron's
// allreduce_layernorm_grads, here once per parameter as it accumulates).
std::vector<Tensor> relayout(DistCall& call) {
  const Tensor& g = call.inputs[0];
  const Tensor& like = call.inputs[1];
  TS_CHECK(g.is_distributed() && like.is_distributed(), "{}: expected two DTensors", call.name);
  const DTensorSpec& sg = dtensor_spec(g);
  const DTensorSpec& sl = dtensor_spec(like);
  TS_CHECK(*sg.mesh == *sl.mesh && sg.global_shape == sl.global_shape,
           "{}: gradient {} does not match parameter {} (mesh and global shape)", call.name, sg.str(), sl.str());
  return {sg.placements == sl.placements ? g : redistribute_local(g, sl.placements)};
}

// The op classes whose rules carry a blocked Shard (S(d)xb) through: it
// stays on its dim, keeps its blocks, and meets only operands blocked alike.
bool takes_blocked(OpClass cls) {
  switch (cls) {
    case OpClass::Elementwise:
    case OpClass::LinearElementwise:
    case OpClass::InPlace:
    case OpClass::Reduction:
    case OpClass::Linear:
    case OpClass::LinearBackward:
    case OpClass::Random:
    case OpClass::Like:
    case OpClass::Relayout: return true;
    default: return false;
  }
}

std::vector<Tensor> handle(DistCall& call) {
  if (!takes_blocked(call.cls))
    for (const Tensor& t : call.inputs)
      if (t.defined() && t.is_distributed())
        for (const Placement& p : dtensor_spec(t).placements)
          TS_CHECK(!is_blocked(p), "{}: no sharding rule for a blocked shard ({} in {}); redistribute it to "
                   "Replicate or an unblocked Shard first", call.name, placement_str(p), dtensor_spec(t).str());
  switch (call.cls) {
    case OpClass::Elementwise:
    case OpClass::LinearElementwise: return elementwise(call);
    case OpClass::InPlace: return inplace(call);
    case OpClass::Reduction: return reduction(call);
    case OpClass::Linear: return linear_rule(call);
    case OpClass::LinearBackward: return linear_backward_rule(call);
    case OpClass::Random: return random(call);
    case OpClass::Like: return like(call);
    case OpClass::CrossEntropy: return cross_entropy_rule(call);
    case OpClass::CrossEntropyBackward: return cross_entropy_backward_rule(call);
    case OpClass::Norm: return norm_rule(call);
    case OpClass::NormBackward: return norm_backward_rule(call);
    case OpClass::Embedding: return embedding_rule(call);
    case OpClass::EmbeddingBackward: return embedding_backward_rule(call);
    case OpClass::Relayout: return relayout(call);
    case OpClass::PerShard: return detail::per_shard_rule(call);
    case OpClass::View: return detail::view_rule(call);
  }
  TS_CHECK(false, "{}: unsupported on DTensors", call.name);
}

// Registers the handler when the library loads.
const bool registered = [] {
  set_dist_handler(handle);
  return true;
}();

}  // namespace

}  // namespace tessera
