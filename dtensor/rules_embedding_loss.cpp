// The embedding and the loss: a table split over the vocabulary or the
// features, and cross-entropy on logits split over the classes (loss
// parallelism).
#include <cmath>
#include <limits>

#include "dtensor/rules.h"
#include "runtime/ops.h"

namespace tessera::detail {

namespace {

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
EmbeddingLayout embedding_layout(const OpCall& call, const Tensor& weight, const Tensor& indices, bool check_range) {
  TS_CHECK(weight.is_subclass(), "{}: the indices are a DTensor but the table is a plain tensor; distribute the "
           "table, or pass the indices' local tensor", call.name);
  const DTensorSpec& sw = dtensor_spec(weight);
  TS_CHECK(sw.global_shape.size() == 2, "{}: the table must be [num, dim], got {}", call.name,
           shape_str(sw.global_shape));
  EmbeddingLayout l;
  l.mesh = sw.mesh;
  l.weight_shape = sw.global_shape;
  const size_t n = sw.placements.size();
  Placements ip(n, Replicate{});
  if (indices.is_subclass()) {
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
  Tensor ids = indices.is_subclass() ? local_at(indices, ip) : indices;
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

TensorList embedding_rule(OpCall& call) {
  const EmbeddingLayout l = embedding_layout(call, call.inputs[0], call.inputs[1], /*check_range=*/true);
  Tensor out = call.local({dtensor_spec(call.inputs[0]).local, l.ids})[0];
  return {make_dtensor(ops::contiguous(masked_rows(l, out)), l.mesh, l.out, l.out_shape)};
}

TensorList embedding_backward_rule(OpCall& call) {
  const EmbeddingLayout l = embedding_layout(call, call.inputs[2], call.inputs[1], /*check_range=*/false);
  const Tensor& grad = call.inputs[0];
  TS_CHECK(grad.is_subclass(), "{}: the table is {} but the output's gradient is a plain tensor", call.name,
           dtensor_spec(call.inputs[2]).str());
  Tensor g = masked_rows(l, local_at(grad, l.grad));
  Tensor d = call.local({g, l.ids, dtensor_spec(call.inputs[2]).local})[0];
  return {make_dtensor(d, l.mesh, l.dweight, l.weight_shape)};
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

CrossEntropyLayout cross_entropy_layout(const OpCall& call, const Tensor& logits, const Tensor& target) {
  TS_CHECK(logits.is_subclass(), "{}: the target is a DTensor but the logits are a plain tensor; distribute the "
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
  if (target.is_subclass()) {
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


TensorList cross_entropy_rule(OpCall& call) {
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
  Tensor counted = ops::binary(ops::BinaryOp::Ne, l.target, static_cast<double>(call.attrs.ignore_index));
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
             call.name, static_cast<int64_t>(bad.item()), l.global[1], l.global[1] - 1, call.attrs.ignore_index);
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
TensorList cross_entropy_backward_rule(OpCall& call) {
  const Tensor& grad = call.inputs[0];
  const Tensor& lse = call.inputs[3];
  CrossEntropyLayout l = cross_entropy_layout(call, call.inputs[1], call.inputs[2]);
  const DType logits_dtype = call.inputs[1].dtype(), sd = compute_dtype(logits_dtype);
  const Device dev = l.x.device();
  Tensor lse_local = lse.is_subclass() ? local_at(lse, l.row_placements) : ops::narrow(lse, 0, l.row0, l.x.size(0));
  Tensor scale = ops::div(ops::to(scalar_value(grad), DType::F64),
                          ops::binary(ops::BinaryOp::Maximum, ops::to(scalar_value(call.inputs[4]), DType::F64), 1.0));
  Tensor x = ops::to(l.x, sd);
  Tensor p = ops::exp(ops::sub(x, ops::unsqueeze(ops::to(lse_local, sd), 1)));
  Tensor d = ops::mul(ops::sub(p, ops::to(target_columns(l), sd)), ops::to(scale, sd));
  Tensor counted = ops::binary(ops::BinaryOp::Ne, l.target, static_cast<double>(call.attrs.ignore_index));
  d = ops::where(ops::unsqueeze(counted, 1), d, zeros({}, sd, dev));
  return {make_dtensor(ops::contiguous(ops::to(d, logits_dtype)), l.mesh, l.placements, l.global)};
}

}  // namespace

void register_embedding_loss_rules() {
  register_rule(OpId::embedding, embedding_rule);
  register_rule(OpId::embedding_backward, embedding_backward_rule);
  register_rule(OpId::cross_entropy, cross_entropy_rule);
  register_rule(OpId::cross_entropy_backward, cross_entropy_backward_rule);
}

}  // namespace tessera::detail
