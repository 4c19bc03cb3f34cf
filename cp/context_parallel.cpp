#include "cp/context_parallel.h"

#include <time.h>

#include <algorithm>
#include <map>
#include <tuple>

#include "autograd/functions.h"
#include "autograd/tape.h"
#include "runtime/profiler.h"
#include "runtime/stream.h"
#include "runtime/trace.h"

namespace tessera::cp {

const char* rotate_method_name(RotateMethod m) {
  return m == RotateMethod::Ring ? "ring" : "allgather";
}

RotateMethod parse_rotate_method(const std::string& name, const std::string& key) {
  if (name == "allgather") return RotateMethod::AllGather;
  if (name == "ring") return RotateMethod::Ring;
  detail::throw_error(
      fmt::format("{}: expected allgather (one all-gather of K/V per layer) or ring (K/V passed "
                  "rank to rank), got '{}'",
                  key, name));
}

std::vector<std::vector<Chunk>> sequence_layout(int64_t seq_len, int cp, bool load_balance,
                                                const FieldNames& names) {
  TS_CHECK(cp >= 1, "context parallelism: expected a degree >= 1, got {}", cp);
  const std::string len = field_name(names, "seq_len");
  std::vector<std::vector<Chunk>> layout(static_cast<size_t>(cp));
  if (load_balance && cp > 1) {
    TS_CHECK(seq_len > 0 && seq_len % (2 * cp) == 0,
             "{} = true cuts the sequence into 2 x {} = {} equal chunks (head-tail), but {} = {} "
             "is not a multiple "
             "of {}: use a multiple, or {} = false (a contiguous split)",
             field_name(names, "load_balance"), cp, 2 * cp, len, seq_len, 2 * cp,
             field_name(names, "load_balance"));
    const int64_t c = seq_len / (2 * cp);
    for (int r = 0; r < cp; ++r)
      layout[static_cast<size_t>(r)] = {{r * c, c}, {(2 * cp - 1 - r) * c, c}};
    return layout;
  }
  TS_CHECK(seq_len >= cp,
           "context parallelism over {} ranks needs at least one token each, but {} = {}", cp, len,
           seq_len);
  const int64_t base = seq_len / cp, extra = seq_len % cp;
  for (int r = 0; r < cp; ++r)
    layout[static_cast<size_t>(r)] = {
        {r * base + std::min<int64_t>(r, extra), base + (r < extra ? 1 : 0)}};
  return layout;
}

namespace {

constexpr int kTagKV = 1, kTagGrad = 2;

// Trace lanes: the attention blocks this rank computes (their spans, summed,
// are its share of the work: the load balance), and the group's K/V
// exchanges (ProcessGroup::set_trace_lane).
trace::Lane attention_lane() {
  static const trace::Lane lane = trace::register_lane("context parallel attention");
  return lane;
}
constexpr const char* kExchangeLane = "context parallel K/V";

// Partial results merge, and gradients accumulate, in f32 (f64 for f64).
DType accumulate_dtype(DType dt) {
  return dt == DType::F64 ? DType::F64 : DType::F32;
}

int64_t length_of(const std::vector<Chunk>& chunks) {
  int64_t n = 0;
  for (const Chunk& c : chunks) n += c.length;
  return n;
}

// What the causal mask keeps of the pair (queries of chunk q, keys of chunk k).
// The layout's chunks are disjoint runs of one partition: keys wholly before
// the queries, the same chunk (the triangle), or wholly after.
enum class Pair { Whole, Triangle, Skipped };
Pair pair_kind(const Chunk& q, const Chunk& k, bool causal) {
  if (!causal || k.start + k.length <= q.start) return Pair::Whole;
  if (k.start == q.start) return Pair::Triangle;
  return Pair::Skipped;
}

// The online-softmax state of one query chunk: out normalised over the keys
// seen so far, and their log-sum-exp.
struct Partial {
  Tensor out, lse;
};
void merge(Partial& acc, const ops::AttentionResult& r, DType dt) {
  Tensor out = ops::to(r.out, dt), lse = ops::to(r.lse, dt);
  if (!acc.out.defined()) {
    acc = {out, lse};
    return;
  }
  // lse = m + log(e1 + e2) with e_i = exp(lse_i - m), m the larger: out = (e1 out_1 + e2 out_2) /
  // (e1 + e2).
  Tensor m = ops::binary(ops::BinaryOp::Maximum, acc.lse, lse);
  Tensor e1 = ops::unary(ops::UnaryOp::Exp, ops::sub(acc.lse, m));
  Tensor e2 = ops::unary(ops::UnaryOp::Exp, ops::sub(lse, m));
  Tensor sum = ops::add(e1, e2);
  acc.out = ops::add(ops::mul(acc.out, ops::unsqueeze(ops::div(e1, sum), -1)),
                     ops::mul(out, ops::unsqueeze(ops::div(e2, sum), -1)));
  acc.lse = ops::add(m, ops::unary(ops::UnaryOp::Log, sum));
}

double thread_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// Times one attention block (forward or backward) into the rank's work
// stats and onto the attention trace lane.
class BlockTimer {
 public:
  BlockTimer(ContextParallel::WorkStats& work, Pair kind, int64_t q_len, int64_t k_len,
             const char* name)
      : work_(work), span_(attention_lane(), name), cpu0_(thread_cpu_seconds()) {
    work_.blocks++;
    const double all = static_cast<double>(q_len) * static_cast<double>(k_len);
    work_.scores += kind == Pair::Triangle ? (all + static_cast<double>(q_len)) / 2 : all;
  }
  ~BlockTimer() { work_.cpu_seconds += thread_cpu_seconds() - cpu0_; }

 private:
  ContextParallel::WorkStats& work_;
  trace::Scope span_;
  double cpu0_;
};

// Every rank's x, padded along dim to `longest` (the longest slice): one
// all-gather into [ranks, ...x's shape with dim = longest].
Tensor gather_padded(dist::ProcessGroup& group, const Tensor& x, int64_t dim, int64_t longest) {
  Tensor padded = x;
  if (x.size(dim) < longest) {
    Shape pad = x.shape();
    pad[static_cast<size_t>(dim)] = longest - x.size(dim);
    padded = ops::cat({x, zeros(pad, x.dtype(), x.device())}, dim);
  }
  padded = ops::contiguous(padded);
  Shape all = padded.shape();
  all.insert(all.begin(), group.size());
  Tensor gathered = empty(all, x.dtype(), x.device());
  group
      .all_gather_into_tensor(ops::reshape(gathered, {gathered.numel()}),
                              ops::reshape(padded, {padded.numel()}))
      ->wait(current_stream(x.device()));
  return gathered;
}

// One layer's attention over the group: the layout and group captured by
// value, so that the backward sees what the forward saw.
struct RingAttention {
  dist::ProcessGroupPtr group;
  std::vector<std::vector<Chunk>> layout;
  RotateMethod method;
  bool causal;
  double scale;
  std::shared_ptr<ContextParallel::WorkStats> work;

  int me() const { return group->rank(); }
  int cp() const { return group->size(); }
  int next() const { return (me() + 1) % cp(); }
  int prev() const { return (me() + cp() - 1) % cp(); }
  int64_t length(int r) const { return length_of(layout[static_cast<size_t>(r)]); }
  int64_t max_length() const {
    int64_t m = 0;
    for (int r = 0; r < cp(); ++r) m = std::max(m, length(r));
    return m;
  }
  // [2, B, Hkv, L, D]: k and v of rank r's slice in one buffer (one message).
  static Shape kv_shape(const Tensor& k, int64_t len) {
    return {2, k.size(0), k.size(1), len, k.size(3)};
  }
  static Tensor part(const Tensor& kv, int64_t i) {
    return ops::select(kv, 0, i);
  }  // k (0) or v (1): a view
  // The chunk pieces of a slice along the sequence (dim 2 of [B, H, L, D]).
  std::vector<Tensor> chunks_of(const Tensor& x, int r, DType dt) const {
    std::vector<Tensor> out;
    int64_t at = 0;
    for (const Chunk& c : layout[static_cast<size_t>(r)]) {
      out.push_back(ops::contiguous(ops::to(ops::narrow(x, 2, at, c.length), dt)));
      at += c.length;
    }
    return out;
  }
  // Chunk b's keys and values of a packed block, in dtype dt.
  static std::pair<Tensor, Tensor> keys_of(const Tensor& kv, int64_t at, int64_t length, DType dt) {
    return {ops::contiguous(ops::to(ops::narrow(part(kv, 0), 2, at, length), dt)),
            ops::contiguous(ops::to(ops::narrow(part(kv, 1), 2, at, length), dt))};
  }

  // Every rank's packed K/V, padded to the longest slice: [cp, 2, B, Hkv, Lmax, D].
  Tensor all_gather_kv(const Tensor& own) const {
    return gather_padded(*group, own, 3, max_length());
  }
  // Rank r's packed buffer in a gathered [cp, 2, B, Hkv, Lmax, D].
  Tensor slice_of(const Tensor& gathered, int r) const {
    return ops::narrow(ops::select(gathered, 0, r), 3, 0, length(r));
  }

  // Calls f(kv of rank src, src) for every rank's K/V, this rank's first,
  // then the ring's order (or the gathered order). With the ring, the next
  // block is already travelling while f computes with the current one.
  template <class F>
  void for_each_kv(const Tensor& own, F&& f) const {
    if (method == RotateMethod::AllGather) {
      Tensor gathered;
      {
        TS_PROFILE("cp_all_gather_kv");
        gathered = all_gather_kv(own);
      }
      f(own, me());
      for (int s = 1; s < cp(); ++s) {
        const int src = (me() + cp() - s) % cp();
        f(slice_of(gathered, src), src);
      }
      return;
    }
    Tensor cur = own;
    for (int s = 0; s < cp(); ++s) {
      const int src = (me() + cp() - s) % cp(), nsrc = (src + cp() - 1) % cp();
      dist::WorkPtr sent, got;
      Tensor incoming;
      if (s + 1 < cp()) {
        incoming = empty(kv_shape(part(own, 0), length(nsrc)), own.dtype(), own.device());
        got = group->recv(incoming, prev(), kTagKV);
        sent = group->send(cur, next(), kTagKV);
      }
      f(cur, src);
      if (got) {
        sent->wait(current_stream(own.device()));
        got->wait(current_stream(own.device()));
        cur = incoming;
      }
    }
  }

  // Calls f(a, kind, kb, vb, at, length) for every pair of this rank's query
  // chunk a and a key chunk of rank src's packed block kv that the mask
  // keeps: kb, vb the chunk's keys and values in dtype dt (taken once per
  // key chunk), at and length where they lie in src's slice.
  template <class F>
  void for_each_pair(const Tensor& kv, int src, DType dt, F&& f) const {
    const auto& mine = layout[static_cast<size_t>(me())];
    int64_t at = 0;
    for (const Chunk& b : layout[static_cast<size_t>(src)]) {
      Tensor kb, vb;
      for (size_t a = 0; a < mine.size(); ++a) {
        const Pair kind = pair_kind(mine[a], b, causal);
        if (kind == Pair::Skipped) continue;
        if (!kb.defined()) std::tie(kb, vb) = keys_of(kv, at, b.length, dt);
        f(a, kind, kb, vb, at, b.length);
      }
      at += b.length;
    }
  }

  ops::AttentionResult forward(const Tensor& q, const Tensor& k, const Tensor& v) const {
    const auto& mine = layout[static_cast<size_t>(me())];
    const DType acc_dt = accumulate_dtype(q.dtype());
    // Blocks computed in f32 (f64) from 16-bit inputs: each partial result is
    // merged unrounded, and only the merged output is rounded, once.
    std::vector<Tensor> qs = chunks_of(q, me(), acc_dt);
    std::vector<Partial> acc(mine.size());
    for_each_kv(ops::contiguous(ops::stack({k, v}, 0)), [&](const Tensor& kv, int src) {
      for_each_pair(
          kv, src, acc_dt,
          [&](size_t a, Pair kind, const Tensor& kb, const Tensor& vb, int64_t, int64_t length) {
            BlockTimer timer(*work, kind, mine[a].length, length,
                             kind == Pair::Triangle ? "attention (diagonal)" : "attention");
            merge(acc[a], ops::attention(qs[a], kb, vb, kind == Pair::Triangle, scale), acc_dt);
          });
    });
    std::vector<Tensor> outs, lses;
    for (Partial& p : acc) outs.push_back(p.out), lses.push_back(p.lse);
    return {ops::to(ops::cat(outs, 2), q.dtype()), ops::cat(lses, 2)};
  }

  // dq, dk, dv from dout and the forward's merged out and lse: every pair's
  // gradients by the one-process backward kernel against the final lse (the
  // softmax over the whole sequence), dK/dV summed at the keys' owner.
  TensorList backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                      const Tensor& out, const Tensor& lse) const {
    const auto& mine = layout[static_cast<size_t>(me())];
    const DType acc_dt = accumulate_dtype(q.dtype());
    // In f32 (f64) from 16-bit inputs, as the forward's blocks.
    std::vector<Tensor> qs = chunks_of(q, me(), acc_dt), dos = chunks_of(dout, me(), acc_dt),
                        os = chunks_of(out, me(), acc_dt), ls = chunks_of(lse, me(), acc_dt);
    std::vector<Tensor> dq(mine.size());
    // Adds this rank's queries' gradients against rank src's keys into dkv
    // [2, B, Hkv, L_src, D] (acc dtype).
    auto contribute = [&](const Tensor& kv, const Tensor& dkv, int src) {
      Tensor dks = part(dkv, 0), dvs = part(dkv, 1);
      for_each_pair(
          kv, src, acc_dt,
          [&](size_t a, Pair kind, const Tensor& kb, const Tensor& vb, int64_t at, int64_t length) {
            BlockTimer timer(
                *work, kind, mine[a].length, length,
                kind == Pair::Triangle ? "attention backward (diagonal)" : "attention backward");
            ops::AttentionGrads g = ops::attention_backward(dos[a], qs[a], kb, vb, os[a], ls[a],
                                                            kind == Pair::Triangle, scale);
            Tensor gq = ops::to(g.dq, acc_dt);
            dq[a] = dq[a].defined() ? ops::add(dq[a], gq) : gq;
            ops::add_(ops::narrow(dks, 2, at, length), ops::to(g.dk, acc_dt));
            ops::add_(ops::narrow(dvs, 2, at, length), ops::to(g.dv, acc_dt));
          });
    };
    const Tensor own = ops::contiguous(ops::stack({k, v}, 0));
    Tensor dkv;  // this rank's keys' gradients, [2, B, Hkv, L, D]
    if (method == RotateMethod::AllGather) {
      // Gather K/V again (not kept from the forward: a slice's memory stays
      // 1/cp of the sequence), then send each rank the gradients of its keys.
      Tensor gathered;
      {
        TS_PROFILE("cp_all_gather_kv");
        gathered = all_gather_kv(own);
      }
      Shape all = gathered.shape();
      Tensor grads = zeros(all, acc_dt, q.device());
      for (int s = 0; s < cp(); ++s) {
        const int src = (me() + cp() - s) % cp();
        contribute(src == me() ? own : slice_of(gathered, src), slice_of(grads, src), src);
      }
      TS_PROFILE("cp_reduce_scatter_dkv");
      Shape one(all.begin() + 1, all.end());
      Tensor mine_padded = empty(one, acc_dt, q.device());
      group
          ->reduce_scatter_tensor(ops::reshape(mine_padded, {mine_padded.numel()}),
                                  ops::reshape(grads, {grads.numel()}), {dist::ReduceOp::Sum})
          ->wait(current_stream(q.device()));
      dkv = ops::narrow(mine_padded, 3, 0, length(me()));
    } else {
      // K/V go round the ring again, each with its gradient accumulator: at
      // step s this rank holds rank src's block and the gradients the ranks
      // before it added; it adds its own and passes both on. After cp steps
      // every accumulator is back at its owner.
      Tensor cur = own, dcur = zeros(own.shape(), acc_dt, q.device());
      for (int s = 0; s < cp(); ++s) {
        const int src = (me() + cp() - s) % cp(), nsrc = (src + cp() - 1) % cp();
        dist::WorkPtr sent, got;
        Tensor incoming;
        if (s + 1 < cp()) {
          incoming = empty(kv_shape(k, length(nsrc)), own.dtype(), own.device());
          got = group->recv(incoming, prev(), kTagKV);
          sent = group->send(cur, next(), kTagKV);
        }
        contribute(cur, dcur, src);
        // The gradients of src's keys go to the next rank (their owner after the
        // last step); the previous rank's come in: those of nsrc's keys, or at
        // the last step this rank's own.
        Tensor dnext = empty(kv_shape(k, length(s + 1 < cp() ? nsrc : me())), acc_dt, q.device());
        dist::WorkPtr dgot = group->recv(dnext, prev(), kTagGrad);
        dist::WorkPtr dsent = group->send(dcur, next(), kTagGrad);
        dsent->wait(current_stream(q.device()));
        dgot->wait(current_stream(q.device()));
        if (got) {
          sent->wait(current_stream(q.device()));
          got->wait(current_stream(q.device()));
          cur = incoming;
        }
        dcur = dnext;
      }
      dkv = dcur;
    }
    return {ops::to(ops::cat(dq, 2), q.dtype()), ops::to(part(dkv, 0), k.dtype()),
            ops::to(part(dkv, 1), v.dtype())};
  }
};

}  // namespace

ContextParallel::ContextParallel(dist::ProcessGroupPtr group, ContextParallelOptions options)
    : group_(std::move(group)), options_(std::move(options)) {
  TS_CHECK(group_ != nullptr, "ContextParallel: expected a process group, got null");
}

void ContextParallel::set_sequence_length(int64_t seq_len) {
  if (seq_len == seq_len_) return;
  TS_CHECK(options_.max_seq_len == 0 || seq_len <= options_.max_seq_len,
           "context parallelism: a sequence of {} tokens exceeds the model's block_size {}",
           seq_len, options_.max_seq_len);
  layout_ = sequence_layout(seq_len, size(), options_.load_balance, options_.names);
  seq_len_ = seq_len;
  positions_.clear();
  for (const Chunk& c : layout_[static_cast<size_t>(rank())])
    for (int64_t p = c.start; p < c.start + c.length; ++p) positions_.push_back(p);
}

int64_t ContextParallel::local_length(int r) const {
  TS_CHECK(r >= 0 && r < size(), "ContextParallel::local_length: rank {} is not in 0 .. {}", r,
           size() - 1);
  TS_CHECK(!layout_.empty(),
           "ContextParallel: no sequence length set (call shard_batch or set_sequence_length)");
  return length_of(layout_[static_cast<size_t>(r)]);
}

Tensor ContextParallel::shard(const Tensor& x, int64_t dim) const {
  TS_CHECK(!layout_.empty(),
           "ContextParallel::shard: no sequence length set (call set_sequence_length)");
  const int64_t d = dim < 0 ? dim + x.dim() : dim;
  TS_CHECK(d >= 0 && d < x.dim() && x.size(d) == seq_len_,
           "ContextParallel::shard: expected a whole sequence of {} along dim {}, got {}", seq_len_,
           dim, shape_str(x.shape()));
  std::vector<Tensor> pieces;
  for (const Chunk& c : layout_[static_cast<size_t>(rank())])
    pieces.push_back(ops::narrow(x, d, c.start, c.length));
  return pieces.size() == 1 ? ops::contiguous(pieces[0]) : ops::cat(pieces, d);
}

Tensor ContextParallel::unshard(const Tensor& local, int64_t dim) const {
  const int64_t d = dim < 0 ? dim + local.dim() : dim;
  TS_CHECK(d >= 0 && d < local.dim() && local.size(d) == local_length(rank()),
           "ContextParallel::unshard: expected this rank's {} tokens along dim {}, got {}",
           local_length(rank()), dim, shape_str(local.shape()));
  if (size() == 1) return local;
  int64_t lmax = 0;
  for (int r = 0; r < size(); ++r) lmax = std::max(lmax, local_length(r));
  const Tensor all = gather_padded(*group_, local, d, lmax);
  std::map<int64_t, Tensor> by_start;
  for (int r = 0; r < size(); ++r) {
    Tensor slice = ops::select(all, 0, r);
    int64_t at = 0;
    for (const Chunk& c : layout_[static_cast<size_t>(r)])
      by_start[c.start] = ops::narrow(slice, d, at, c.length), at += c.length;
  }
  std::vector<Tensor> pieces;
  for (auto& [start, t] : by_start) pieces.push_back(t);
  return ops::cat(pieces, d);
}

std::pair<Tensor, Tensor> ContextParallel::shard_batch(const Tensor& tokens, const Tensor& targets,
                                                       int64_t ignore_index) {
  TS_CHECK(tokens.dim() == 2 && targets.shape() == tokens.shape(),
           "ContextParallel::shard_batch: expected tokens and targets [batch, seq] of one shape, "
           "got {} and {}",
           shape_str(tokens.shape()), shape_str(targets.shape()));
  set_sequence_length(tokens.size(1));
  Tensor x = shard(tokens, 1), y = shard(targets, 1);
  auto counted = [&](const Tensor& t) {
    return ops::sum(
        ops::to(ops::binary(ops::BinaryOp::Ne, t, static_cast<double>(ignore_index)), DType::F64));
  };
  // (A batch whose targets are all ignored has a loss of 0, as on one process: not 0/0.)
  loss_weight_ = ops::div(ops::mul(counted(y), static_cast<double>(size())),
                          ops::binary(ops::BinaryOp::Maximum, counted(targets), 1.0));
  return {x, y};
}

Tensor ContextParallel::weigh_loss(const Tensor& mean_loss) const {
  if (size() == 1 || !loss_weight_.defined()) return mean_loss;
  // Weighed in f32 at least: a 16-bit weight would round cp x 5/12 to 8 bits.
  const DType dt = mean_loss.dtype() == DType::F64 ? DType::F64 : DType::F32;
  return to(mean_loss, dt) * ops::to(ops::to(loss_weight_, dt), mean_loss.device());
}

Tensor ContextParallel::attention(const Tensor& q, const Tensor& k, const Tensor& v, double scale) {
  return attention(q, k, v, /*causal=*/true, scale);
}

Tensor ContextParallel::attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                                  double scale) {
  TS_CHECK(!q.is_subclass() && !k.is_subclass() && !v.is_subclass(),
           "context-parallel attention: expected plain tensors (a rank's heads under tensor "
           "parallelism), got a "
           "DTensor");
  TS_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
           "context-parallel attention: q, k, v must be 4-D [batch, heads, seq, head_dim]; got {}, "
           "{}, {}",
           shape_str(q.shape()), shape_str(k.shape()), shape_str(v.shape()));
  TS_CHECK(causal || !options_.load_balance || size() == 1,
           "{} = true (head-tail chunks) balances the causal mask's work; attention without the "
           "mask needs {} = false",
           field_name(options_.names, "load_balance"), field_name(options_.names, "load_balance"));
  const int64_t len = local_length(rank());
  TS_CHECK(q.size(2) == len && k.size(2) == len && v.size(2) == len,
           "context-parallel attention: this rank holds {} of the sequence's {} tokens, but q, k, "
           "v are {}, {}, {}",
           len, seq_len_, shape_str(q.shape()), shape_str(k.shape()), shape_str(v.shape()));
  if (size() == 1) return scaled_dot_product_attention(q, k, v, causal, scale);
  TS_PROFILE("cp_attention");
  RingAttention ring{group_, layout_, options_.rotate_method, causal, scale, work_};
  Tensor qc = ops::contiguous(q), kc = ops::contiguous(k), vc = ops::contiguous(v);
  ops::AttentionResult r = ring.forward(qc, kc, vc);
  if (autograd::should_record({q, k, v})) {
    Tensor out = autograd::detach(r.out), lse = r.lse;
    autograd::record("cp_attention", {q, k, v}, {r.out},
                     [ring, qc, kc, vc, out, lse](const TensorList& g) {
                       TS_PROFILE("cp_attention_backward");
                       return ring.backward(g[0], qc, kc, vc, out, lse);
                     });
  }
  return r.out;
}

std::shared_ptr<ContextParallel> apply_context_parallel(nn::LanguageModel& model,
                                                        const dist::ProcessGroupPtr& group,
                                                        ContextParallelOptions options) {
  if (options.max_seq_len == 0) options.max_seq_len = model.config.block_size;
  // The group's exchanges on a trace lane of their own (a mesh's cp group
  // carries nothing else).
  group->set_trace_lane(kExchangeLane);
  auto shard = std::make_shared<ContextParallel>(group, std::move(options));
  model.set_sequence_shard(shard);
  return shard;
}

}  // namespace tessera::cp
