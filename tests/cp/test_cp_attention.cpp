// Context-parallel attention (cp/context_parallel.h) against one process,
// under mpirun with 1-4 ranks: every rank computes the whole sequence's
// attention and its gradients as the reference, then its slice by the
// rotate method, and the two agree (f64 to 1e-12, f32 to 1e-5) for both
// rotate methods, head-tail and contiguous splits, sequences that do and do
// not split evenly, grouped-query heads, causal and not. The collectives per
// call are the design's; one rank issues none.

#include <algorithm>
#include <cmath>
#include <tuple>

#include "autograd/functions.h"
#include "autograd/tape.h"
#include "cp/context_parallel.h"
#include "runtime/distributed.h"
#include "tests/helpers.h"

using namespace tessera;

namespace {

dist::ProcessGroupPtr world() {
  dist::init();
  return dist::world();
}

struct Grads {
  Tensor out, dq, dk, dv;
};

// out = attention(q, k, v) and the gradients of sum(out * dout).
template <class F>
Grads run(const Tensor& q0, const Tensor& k0, const Tensor& v0, const Tensor& dout, F&& attend) {
  Tensor q = ops::clone(q0), k = ops::clone(k0), v = ops::clone(v0);
  q.set_requires_grad(true), k.set_requires_grad(true), v.set_requires_grad(true);
  Tensor out = attend(q, k, v);
  autograd::backward(sum(out * dout));
  return {autograd::detach(out), q.grad(), k.grad(), v.grad()};
}

// tessera-train's names for the options.
std::string train_key(const char* field) {
  const std::string f = field;
  if (f == "load_balance") return "parallelism.context_parallel_load_balance";
  if (f == "seq_len") return "training.seq_len";
  return f;
}

double relative(const Tensor& got, const Tensor& want) {
  const double scale =
      std::max(1.0, ops::to(ops::max(ops::unary(ops::UnaryOp::Abs, want)), DType::F64).item());
  return testing::max_abs_diff(got, want) / scale;
}

}  // namespace

TEST_CASE("the sequence layout: head-tail chunks r and 2cp-1-r, or contiguous runs",
          "[cp][layout]") {
  using cp::Chunk;
  auto ht = cp::sequence_layout(16, 4, true);
  REQUIRE(ht.size() == 4);
  CHECK(ht[0] == std::vector<Chunk>{{0, 2}, {14, 2}});
  CHECK(ht[1] == std::vector<Chunk>{{2, 2}, {12, 2}});
  CHECK(ht[3] == std::vector<Chunk>{{6, 2}, {8, 2}});
  auto plain = cp::sequence_layout(11, 3, false);  // 4, 4, 3
  CHECK(plain[0] == std::vector<Chunk>{{0, 4}});
  CHECK(plain[1] == std::vector<Chunk>{{4, 4}});
  CHECK(plain[2] == std::vector<Chunk>{{8, 3}});
  CHECK(cp::sequence_layout(7, 1, true)[0] ==
        std::vector<Chunk>{{0, 7}});  // one rank: the whole sequence
  CHECK_THROWS_WITH(cp::sequence_layout(18, 4, true, train_key),
                    Catch::Contains("parallelism.context_parallel_load_balance = true") &&
                        Catch::Contains("training.seq_len = 18 is not a multiple of 8"));
  CHECK_THROWS_WITH(cp::sequence_layout(2, 3, false, train_key),
                    Catch::Contains("training.seq_len = 2"));
  CHECK_THROWS_WITH(
      cp::parse_rotate_method("alltoall", "parallelism.context_parallel_rotate_method"),
      Catch::Contains("parallelism.context_parallel_rotate_method: expected allgather") &&
          Catch::Contains("'alltoall'"));
}

TEST_CASE("context-parallel attention equals one process's, forward and backward",
          "[cp][attention][exact]") {
  auto group = world();
  const int c = group->size();
  struct Case {
    int64_t t;
    bool load_balance, causal;
  };
  // Head-tail lengths are multiples of 2c; contiguous ones split evenly and not.
  const std::vector<Case> cases{{6 * c, true, true},
                                {2 * c, true, true},
                                {5 * c, false, true},
                                {3 * c + 1, false, true},
                                {2 * c + c / 2 + 1, false, false}};
  uint64_t seed = 10;
  for (DType dt : {DType::F64, DType::F32})
    for (const auto& [t, lb, causal] : cases)
      for (auto method : {cp::RotateMethod::AllGather, cp::RotateMethod::Ring}) {
        INFO("cp=" << c << " T=" << t << " load_balance=" << lb << " causal=" << causal << " "
                   << cp::rotate_method_name(method) << " " << dtype_name(dt));
        // Grouped-query: 4 query heads over 2 key/value heads; head size 6.
        Tensor q = randn({2, 4, t, 6}, ++seed, dt), k = randn({2, 2, t, 6}, ++seed, dt);
        Tensor v = randn({2, 2, t, 6}, ++seed, dt), dout = randn({2, 4, t, 6}, ++seed, dt);
        const double scale = 1 / std::sqrt(6.0);
        Grads want = run(q, k, v, dout, [&](auto& a, auto& b, auto& d) {
          return scaled_dot_product_attention(a, b, d, causal, scale);
        });
        cp::ContextParallel ctx(group, {.rotate_method = method, .load_balance = lb});
        ctx.set_sequence_length(t);
        group->reset_stats();
        Grads got =
            run(ctx.shard(q, 2), ctx.shard(k, 2), ctx.shard(v, 2), ctx.shard(dout, 2),
                [&](auto& a, auto& b, auto& d) { return ctx.attention(a, b, d, causal, scale); });
        const auto st = group->stats();  // the attention's exchanges alone
        // The ranks' blocks cover the mask's score entries once forward and
        // once backward; head-tail gives every rank the same share.
        if (c > 1) {
          Tensor scores = full({c}, 0.0, DType::F64);
          group->all_gather_into_tensor(scores, full({1}, ctx.work().scores, DType::F64))->wait();
          const auto each = scores.to_vector<double>();
          double total = 0;
          for (double x : each) total += x;
          const double td = static_cast<double>(t);
          CHECK(total == 2 * (causal ? td * (td + 1) / 2 : td * td));
          if (lb)
            CHECK(*std::max_element(each.begin(), each.end()) ==
                  *std::min_element(each.begin(), each.end()));
        }
        const double tol = dt == DType::F64 ? 1e-12 : 1e-5;
        CHECK(relative(got.out, ctx.shard(want.out, 2)) <= tol);
        CHECK(relative(got.dq, ctx.shard(want.dq, 2)) <= tol);
        // dK/dV of every rank's queries reach the keys' owner.
        CHECK(relative(got.dk, ctx.shard(want.dk, 2)) <= tol);
        CHECK(relative(got.dv, ctx.shard(want.dv, 2)) <= tol);
        // The gathered slices are the whole tensor again.
        CHECK(testing::equal(ctx.unshard(ctx.shard(q, 2), 2), q));
        // Exchanges per call: allgather one all-gather forward, one all-gather
        // and one reduce-scatter backward; the ring c - 1 K/V messages
        // forward, c - 1 K/V and c gradient messages backward. One rank: none.
        if (c == 1) {
          CHECK(st.total() + st.send + st.recv == 0);
        } else if (method == cp::RotateMethod::AllGather) {
          CHECK(st.all_gather == 2);
          CHECK(st.reduce_scatter == 1);
          CHECK(st.send + st.recv == 0);
        } else {
          CHECK(st.send == 3 * (c - 1) + 1);
          CHECK(st.recv == 3 * (c - 1) + 1);
          CHECK(st.all_gather == 0);
        }
      }
}

TEST_CASE("bf16 blocks merge unrounded: context parallelism is as close to f64 as one process", "[cp][attention]") {
  auto group = world();
  const int c = group->size();
  const int64_t t = 8 * c;
  // bf16 inputs, and the f64 attention of the same (rounded) values as the reference.
  Tensor q = randn({1, 4, t, 16}, 41, DType::BF16), k = randn({1, 2, t, 16}, 42, DType::BF16);
  Tensor v = randn({1, 2, t, 16}, 43, DType::BF16), dout = randn({1, 4, t, 16}, 44, DType::BF16);
  const double scale = 0.25;
  auto f64 = [](const Tensor& x) { return ops::to(x, DType::F64); };
  Grads want = run(f64(q), f64(k), f64(v), f64(dout),
                   [&](auto& a, auto& b, auto& d) { return scaled_dot_product_attention(a, b, d, true, scale); });
  Grads one = run(q, k, v, dout,
                  [&](auto& a, auto& b, auto& d) { return scaled_dot_product_attention(a, b, d, true, scale); });
  for (auto method : {cp::RotateMethod::AllGather, cp::RotateMethod::Ring}) {
    INFO(cp::rotate_method_name(method) << " cp=" << c);
    cp::ContextParallel ctx(group, {.rotate_method = method});
    ctx.set_sequence_length(t);
    Grads got = run(ctx.shard(q, 2), ctx.shard(k, 2), ctx.shard(v, 2), ctx.shard(dout, 2),
                    [&](auto& a, auto& b, auto& d) { return ctx.attention(a, b, d, true, scale); });
    CHECK(got.out.dtype() == DType::BF16);
    // Rounded once, at the end: within bf16's half-ulp (2^-9) of the f64 result,
    // as one process's kernel is.
    for (auto [g, o, w] : {std::tuple{got.out, one.out, want.out}, {got.dq, one.dq, want.dq},
                           {got.dk, one.dk, want.dk}, {got.dv, one.dv, want.dv}}) {
      const double mine = relative(f64(g), ctx.shard(w, 2)), single = relative(f64(ctx.shard(o, 2)), ctx.shard(w, 2));
      INFO("cp " << mine << ", one process " << single);
      CHECK(mine <= std::max(2 * single, 1.0 / 256));
    }
  }
}

TEST_CASE("bad context-parallel inputs are refused by name", "[cp][errors]") {
  auto group = world();
  const int c = group->size();
  cp::ContextParallel ctx(group, {.load_balance = true, .names = train_key});
  if (c > 1) {
    CHECK_THROWS_WITH(ctx.set_sequence_length(2 * c + 1),
                      Catch::Contains("parallelism.context_parallel_load_balance = true") &&
                          Catch::Contains("multiple of"));
  }
  ctx.set_sequence_length(8 * c);  // 8 tokens a rank
  Tensor q = randn({1, 2, 5, 4}, 1, DType::F64);
  CHECK_THROWS_WITH(ctx.attention(q, q, q, true, 0.5),
                    Catch::Contains("this rank holds 8 of the sequence's"));
  Tensor ql = randn({1, 2, 8, 4}, 1, DType::F64);
  if (c > 1)
    CHECK_THROWS_WITH(
        ctx.attention(ql, ql, ql, /*causal=*/false, 0.5),
        Catch::Contains(
            "attention without the mask needs parallelism.context_parallel_load_balance = false"));
  CHECK_THROWS_WITH(ctx.shard(randn({2, 3}, 1), 1),
                    Catch::Contains("expected a whole sequence of"));
}
