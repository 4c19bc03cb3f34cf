// Process-group collectives, run under mpirun with 1-4 ranks (and as a plain
// process). Every rank builds every rank's input from (seed, rank), so each
// can compute the expected result itself, in f64.
#include <chrono>
#include <cstdlib>
#include <cmath>
#include <functional>
#include <map>
#include <thread>
#include <tuple>

#include "runtime/distributed.h"
#include "tests/helpers.h"
#include "tests/mpi_calls.h"

using namespace tessera;
using dist::ReduceOp;
using ops::BinaryOp;

namespace {

dist::ProcessGroupPtr world() {
  dist::init();
  return dist::world();
}

// Rank r's input: values that are exact in every dtype tested (small integers
// and halves for floats), so reductions in any order agree bit for bit.
Tensor input_for(int r, int64_t n, DType dt, uint64_t seed) {
  // Memoised: every rank builds every rank's inputs for its references.
  static std::map<std::tuple<int, int64_t, DType, uint64_t>, Tensor> cache;
  auto key = std::make_tuple(r, n, dt, seed);
  auto it = cache.find(key);
  if (it == cache.end()) {
    Tensor u = randint({n}, -8, 9, seed * 131 + static_cast<uint64_t>(r));
    Tensor f = ops::to(u, DType::F64);
    if (is_floating(dt)) f = ops::mul(f, 0.5);
    it = cache.emplace(key, ops::to(f, dt)).first;
  }
  return ops::clone(it->second);  // callers may reduce into it
}

// The f64 reference reduction over all ranks' inputs.
std::vector<double> reference(ReduceOp op, int world_size, int64_t n, DType dt, uint64_t seed,
                              double factor) {
  std::vector<double> acc;
  for (int r = 0; r < world_size; ++r) {
    auto v = input_for(r, n, dt, seed).to_vector<double>();
    if (op == ReduceOp::PremulSum)
      for (auto& x : v) x *= factor;
    if (acc.empty()) {
      acc = v;
      continue;
    }
    for (size_t i = 0; i < v.size(); ++i) {
      if (op == ReduceOp::Max)
        acc[i] = std::max(acc[i], v[i]);
      else if (op == ReduceOp::Min)
        acc[i] = std::min(acc[i], v[i]);
      else
        acc[i] += v[i];
    }
  }
  if (op == ReduceOp::Avg)
    for (auto& x : acc) x /= world_size;
  if (acc.empty()) acc.assign(static_cast<size_t>(n), 0.0);
  return acc;
}

// Rounds a reference to what dtype can hold (the collective returns dtype).
Tensor as_dtype(const std::vector<double>& v, DType dt) {
  return ops::to(from_vector(v, {static_cast<int64_t>(v.size())}), dt);
}

const std::vector<int64_t> kSizes = {0, 1, 17, 1000003};
const std::vector<int64_t> kSubgroupSizes = {0, 1, 17, 4099};

// The world, then this rank's half of it (ranks of one parity; group ranks
// follow world order), with the sizes to sweep on each.
std::vector<std::pair<dist::ProcessGroupPtr, std::vector<int64_t>>> groups_to_test() {
  auto w = world();
  return {{w, kSizes}, {w->split(w->rank() % 2, w->rank()), kSubgroupSizes}};
}
const std::vector<DType> kTypes = {DType::F32, DType::BF16, DType::F16, DType::F64, DType::I64};

}  // namespace

TEST_CASE("all_reduce: every op, dtype and size", "[dist][all_reduce]") {
  for (auto& [pg, sizes] : groups_to_test()) {
    int W = pg->size(), r = pg->rank();
    for (DType dt : kTypes) {
      for (int64_t n : sizes) {
        for (ReduceOp op :
             {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min, ReduceOp::PremulSum}) {
          if (!is_floating(dt) && (op == ReduceOp::Avg || op == ReduceOp::PremulSum)) continue;
          INFO(dist::reduce_op_name(op) << " " << dtype_name(dt) << " n=" << n << " world " << W);
          Tensor t = input_for(r, n, dt, 1);
          pg->all_reduce(t, {op, 0.25})->wait();
          CHECK(testing::equal(t, as_dtype(reference(op, W, n, dt, 1, 0.25), dt)));
        }
      }
    }
    // avg divides by the group size exactly once.
    Tensor ones_t = ones({5});
    pg->all_reduce(ones_t, {ReduceOp::Avg})->wait();
    CHECK(testing::equal(ones_t, ones({5})));
    CHECK_THROWS_WITH(pg->all_reduce(zeros({3}, DType::I64), {ReduceOp::Avg}),
                      Catch::Contains("avg needs a floating-point tensor"));
  }
}

TEST_CASE("all_gather_into_tensor and reduce_scatter_tensor",
          "[dist][all_gather][reduce_scatter]") {
  for (auto& [pg, sizes] : groups_to_test()) {
    int W = pg->size(), r = pg->rank();
    for (DType dt : kTypes) {
      for (int64_t n : sizes) {
        INFO(dtype_name(dt) << " n=" << n << " world " << W);
        // all_gather: output = [input_0, ..., input_{W-1}].
        Tensor out = empty({W * n}, dt);
        pg->all_gather_into_tensor(out, input_for(r, n, dt, 2))->wait();
        std::vector<Tensor> parts;
        for (int k = 0; k < W; ++k) parts.push_back(input_for(k, n, dt, 2));
        CHECK(testing::equal(out, ops::cat(parts, 0)));
        // In place: the input is this rank's slot of the output.
        Tensor out2 = zeros({W * n}, dt);
        Tensor slot = ops::narrow(out2, 0, r * n, n);
        ops::copy_(slot, input_for(r, n, dt, 2));
        pg->all_gather_into_tensor(out2, slot)->wait();
        CHECK(testing::equal(out2, out));
        // reduce_scatter: rank r gets chunk r of the sum.
        for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::PremulSum}) {
          if (!is_floating(dt) && (op == ReduceOp::Avg || op == ReduceOp::PremulSum)) continue;
          INFO(dist::reduce_op_name(op));
          Tensor in = input_for(r, W * n, dt, 3);
          Tensor res = empty({n}, dt);
          pg->reduce_scatter_tensor(res, in, {op, 0.5})->wait();
          auto full = reference(op, W, W * n, dt, 3, 0.5);
          std::vector<double> mine(full.begin() + r * n, full.begin() + (r + 1) * n);
          CHECK(testing::equal(res, as_dtype(mine, dt)));
        }
      }
    }
    CHECK_THROWS_WITH(pg->all_gather_into_tensor(empty({3}), empty({2})),
                      Catch::Contains("output has 3 elements, expected"));
    CHECK_THROWS_WITH(pg->all_gather_into_tensor(empty({2 * W}), empty({2}, DType::F64)),
                      Catch::Contains("input is f64 but output is f32"));
    CHECK_THROWS_WITH(pg->all_reduce(ops::transpose(empty({2, 3}), 0, 1)),
                      Catch::Contains("must be contiguous"));
  }
}

TEST_CASE("reduce_scatter_tensor sums in rank order in the compute type, rounding once, in place or not",
          "[dist][reduce_scatter]") {
  // Values that round (randn, a factor of 1/3): every rank must get the sum
  // over ranks 0..W-1 in order in f32 (f64 for f64), scaled per term for
  // PremulSum and divided at the end for Avg, rounded to the dtype once.
  for (auto& [pg, unused] : groups_to_test()) {
    int W = pg->size(), r = pg->rank();
    for (DType dt : {DType::F32, DType::BF16, DType::F16, DType::F64}) {
      DType acc_dt = dt == DType::F64 ? DType::F64 : DType::F32;
      for (int64_t n : {int64_t{1}, int64_t{255}, int64_t{4099}}) {
        for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::PremulSum, ReduceOp::Max}) {
          INFO(dist::reduce_op_name(op) << " " << dtype_name(dt) << " n=" << n << " world " << W);
          const double factor = 1.0 / 3.0;
          auto input_of = [&](int k) { return randn({W * n}, 1000 + static_cast<uint64_t>(k), dt); };
          Tensor want;
          for (int k = 0; k < W; ++k) {
            Tensor term = ops::to(ops::narrow(input_of(k), 0, r * n, n), acc_dt);
            if (op == ReduceOp::PremulSum) term = ops::mul(term, factor);
            want = !want.defined() ? term : ops::binary(op == ReduceOp::Max ? BinaryOp::Maximum : BinaryOp::Add, want, term);
          }
          if (op == ReduceOp::Avg) want = ops::binary(BinaryOp::Div, want, static_cast<double>(W));
          want = ops::to(want, dt);
          Tensor res = empty({n}, dt);
          pg->reduce_scatter_tensor(res, input_of(r), {op, factor})->wait();
          CHECK(testing::equal(res, want));
          // In place: the output is this rank's chunk of the input.
          Tensor in = input_of(r);
          Tensor mine = ops::narrow(in, 0, r * n, n);
          pg->reduce_scatter_tensor(mine, in, {op, factor})->wait();
          CHECK(testing::equal(mine, want));
        }
      }
    }
  }
}

TEST_CASE("broadcast, all_to_all and barrier", "[dist]") {
  for (auto& [pg, sizes] : groups_to_test()) {
    int W = pg->size(), r = pg->rank();
    for (DType dt : kTypes) {
      for (int64_t n : sizes) {
        INFO(dtype_name(dt) << " n=" << n);
        for (int src = 0; src < W; ++src) {
          Tensor t = input_for(r, n, dt, 4);
          pg->broadcast(t, src)->wait();
          CHECK(testing::equal(t, input_for(src, n, dt, 4)));
        }
        // all_to_all: chunk j of rank i's input lands as chunk i of rank j's output.
        Tensor in = input_for(r, W * n, dt, 5);
        Tensor out = empty({W * n}, dt);
        pg->all_to_all(out, in)->wait();
        std::vector<Tensor> expect;
        for (int i = 0; i < W; ++i)
          expect.push_back(ops::narrow(input_for(i, W * n, dt, 5), 0, r * n, n));
        CHECK(testing::equal(out, ops::cat(expect, 0)));
      }
    }
    pg->barrier()->wait();
    CHECK_THROWS_WITH(pg->broadcast(zeros({1}), W), Catch::Contains("source rank"));
  }
}

TEST_CASE("all_to_all_single moves runs of rows of each rank's own sizes, empty runs included", "[dist]") {
  auto pg = world();
  const int W = pg->size(), me = pg->rank();
  // Rank i sends rank j rows(i, j) rows of width 3: some runs empty, sizes awkward.
  auto rows = [](int i, int j) { return static_cast<int64_t>((i * 7 + j * 3 + 1) % 5 == 0 ? 0 : (i * 5 + j * 2) % 4 + 1); };
  for (DType dt : {DType::F64, DType::BF16, DType::I64}) {
    INFO(dtype_name(dt));
    auto input_of = [&](int r) {
      int64_t n = 0;
      for (int j = 0; j < W; ++j) n += rows(r, j);
      return ops::reshape(input_for(r, n * 3, dt, 17), {n, 3});
    };
    std::vector<int64_t> send, recv;
    for (int j = 0; j < W; ++j) send.push_back(rows(me, j)), recv.push_back(rows(j, me));
    Tensor in = input_of(me);
    int64_t n_out = 0;
    for (int64_t n : recv) n_out += n;
    Tensor out = full({n_out, 3}, -99.0, dt);
    const int64_t before = pg->stats().all_to_all;
    pg->all_to_all_single(out, in, recv, send)->wait();
    CHECK(pg->stats().all_to_all == before + 1);
    // Run i of the output: rank i's rows for me, which start after its runs for ranks < me.
    std::vector<Tensor> want;
    for (int i = 0; i < W; ++i) {
      int64_t at = 0;
      for (int j = 0; j < me; ++j) at += rows(i, j);
      if (rows(i, me) > 0) want.push_back(ops::narrow(input_of(i), 0, at, rows(i, me)));
    }
    if (!want.empty()) CHECK(testing::equal(out, ops::cat(want, 0)));
  }
  // Sizes that do not add up are refused by name before anything moves.
  std::vector<int64_t> zeros_w(static_cast<size_t>(W), 0), one(static_cast<size_t>(W), 0);
  one[0] = 1;
  Tensor two = zeros({2, 3});
  CHECK_THROWS_WITH(pg->all_to_all_single(two, two, zeros_w, zeros_w),
                    Catch::Contains("input_splits sum to 0 rows, but the tensor has 2"));
  CHECK_THROWS_WITH(pg->all_to_all_single(two, two, std::vector<int64_t>{2}, std::vector<int64_t>(W + 1, 0)),
                    Catch::Contains("sizes for a group of"));
}

TEST_CASE("collectives return at once and complete on wait; several in flight", "[dist][async]") {
  auto pg = world();
  int W = pg->size(), r = pg->rank();
  if (W == 1) {
    CHECK(pg->all_reduce(ones({3}))->is_completed());
    return;
  }
  // The last rank joins late: everyone else's call must return immediately.
  if (r == W - 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  auto t0 = std::chrono::steady_clock::now();
  Tensor t = ones({1000});
  auto work = pg->all_reduce(t);
  double issue_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (r != W - 1) {
    CHECK(issue_ms < 100);
    CHECK_FALSE(work->is_completed());
  }
  work->wait();
  CHECK(work->is_completed());
  CHECK(t.to_vector<float>()[999] == static_cast<float>(W));
  // Several outstanding collectives (two groups), waited in reverse order.
  auto pair = pg->split(r % 2, r);
  std::vector<Tensor> ts;
  std::vector<dist::WorkPtr> works;
  for (int i = 0; i < 6; ++i) {
    ts.push_back(full({17}, static_cast<double>(i + 1)));
    works.push_back(i % 2 ? pair->all_reduce(ts.back()) : pg->all_reduce(ts.back()));
  }
  for (int i = 5; i >= 0; --i) works[static_cast<size_t>(i)]->wait();
  for (int i = 0; i < 6; ++i)
    CHECK(ts[static_cast<size_t>(i)].to_vector<float>()[0] == (i + 1) * (i % 2 ? pair->size() : W));
}

TEST_CASE("a collective completes in the background while the caller computes or sleeps",
          "[dist][async]") {
  auto pg = world();
  int W = pg->size();
  if (W == 1) return;
  // Nobody calls wait(): the progress thread (nudged at op boundaries, or on
  // its own timer while the caller sleeps) must finish the work.
  Tensor part = randn({262144 + 3}, 7 + static_cast<uint64_t>(pg->rank()));
  Tensor full = empty({(262144 + 3) * static_cast<int64_t>(W)});
  auto gather = pg->all_gather_into_tensor(full, part);
  Tensor x = randn({64, 64}, 1);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!gather->is_completed() && std::chrono::steady_clock::now() < deadline)
    x = ops::unary(ops::UnaryOp::Tanh, ops::matmul(x, x));
  CHECK(gather->is_completed());
  Tensor sum = ones({1000});
  auto reduce = pg->all_reduce(sum);
  deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!reduce->is_completed() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  if (dist::progress_mode() == "thread") CHECK(reduce->is_completed());
  reduce->wait();
  gather->wait();
  CHECK(sum.to_vector<float>()[999] == static_cast<float>(W));
  auto mine = ops::narrow(full, 0, (262144 + 3) * static_cast<int64_t>(pg->rank()), 262144 + 3);
  CHECK(testing::equal(mine, part));
}

TEST_CASE("subgroups: new_group and split", "[dist][groups]") {
  auto pg = world();
  int W = pg->size(), r = pg->rank();
  std::vector<int> evens;
  for (int k = 0; k < W; k += 2) evens.push_back(k);
  auto even = pg->new_group(evens);
  if (r % 2 == 0) {
    REQUIRE(even != nullptr);
    CHECK(even->size() == static_cast<int>(evens.size()));
    CHECK(even->rank() == r / 2);
    Tensor t = full({3}, static_cast<double>(r));
    even->all_reduce(t)->wait();
    double expect = 0;
    for (int k : evens) expect += k;
    CHECK(t.to_vector<float>()[0] == expect);
    CHECK(even->global_ranks() == evens);
  } else {
    CHECK(even == nullptr);
  }
  // Split by color, keyed in reverse: group rank order follows the key.
  auto half = pg->split(r % 2, W - r);
  Tensor mine = full({1}, static_cast<double>(r));
  Tensor gathered = empty({half->size()});
  half->all_gather_into_tensor(gathered, mine)->wait();
  auto g = gathered.to_vector<float>();
  for (size_t i = 1; i < g.size(); ++i) CHECK(g[i] < g[i - 1]);
  CHECK_THROWS_WITH(pg->new_group({0, 0}), Catch::Contains("listed twice"));
}

TEST_CASE("sequence numbers count collectives per group; world size 1 calls no MPI",
          "[dist][stats]") {
  auto pg = world();
  CHECK(dist::rank() == pg->rank());
  CHECK(dist::world_size() == pg->size());
  CHECK(dist::local_rank() == dist::rank());  // one node: local ranks are the world ranks
  const char* mode = std::getenv("TESSERA_PROGRESS");
  CHECK(dist::progress_mode() == (!dist::launched() ? "none" : mode ? mode : "thread"));
  pg->barrier()->wait();
  pg->reset_stats();
  int64_t seq = pg->sequence();
  pg->all_reduce(ones({4}))->wait();
  Tensor out = empty({4 * pg->size()});
  pg->all_gather_into_tensor(out, ones({4}))->wait();
  auto s = pg->stats();
  CHECK(s.all_reduce == 1);
  CHECK(s.all_gather == 1);
  if (pg->size() == 1) {
    CHECK(s.mpi_calls == 0);
    CHECK(pg->sequence() == seq);  // nothing was numbered: nothing went to MPI
  } else {
    CHECK(s.mpi_calls == 2);
    CHECK(pg->sequence() == seq + 2);
  }
  // Bytes handed to MPI and sent by a ring: an all-reduce of 20 floats
  // 2 (W-1)/W x 80, an all-gather of 4 floats per rank (W-1) x 16, a
  // reduce-scatter of 12 floats per rank (W-1)/W x its input.
  pg->reset_stats();
  const int64_t w = pg->size();
  pg->all_reduce(ones({20}))->wait();
  pg->all_gather_into_tensor(out, ones({4}))->wait();
  Tensor rs_out = empty({12});
  pg->reduce_scatter_tensor(rs_out, ones({12 * w}))->wait();
  s = pg->stats();
  CHECK(s.bytes == (w == 1 ? 0 : 80 + 16 + 48 * w));
  CHECK(s.ring_bytes == 2 * (w - 1) * 80 / w + (w - 1) * 16 + (w - 1) * 48);
}

TEST_CASE("world size 1 makes no MPI call at all (counted through PMPI)", "[dist][stats]") {
  auto pg = world();
  int64_t before = testing::mpi_calls_made();
  // Every collective at sizes 0, 1 and 17, subgroups, splits and a barrier.
  for (int64_t n : {0, 1, 17}) {
    Tensor t = randn({n}, 3);
    pg->all_reduce(t, {ReduceOp::Max})->wait();
    Tensor out = empty({n * pg->size()});
    pg->all_gather_into_tensor(out, t)->wait();
    Tensor part = empty({n});
    pg->reduce_scatter_tensor(part, out, {ReduceOp::Avg})->wait();
    pg->broadcast(t, 0)->wait();
    Tensor a2a = empty({n * pg->size()});
    pg->all_to_all(a2a, out)->wait();
  }
  auto sub = pg->split(pg->rank() % 2, pg->rank());
  auto ranks = std::vector<int>{0};
  auto first = pg->new_group(ranks);
  if (first) first->all_reduce(ones({5}))->wait();
  sub->barrier()->wait();
  int64_t made = testing::mpi_calls_made() - before;
  if (pg->size() == 1) {
    CHECK(made == 0);
    CHECK(testing::mpi_calls_made() == 0);  // not even at start-up
  } else {
    CHECK(made > 0);  // the counter sees Tessera's calls
  }
}

TEST_CASE("the debug mode names an op or dtype mismatch", "[dist][debug]") {
  auto pg = world();
  int W = pg->size(), r = pg->rank();
  if (W == 1) return;
  dist::set_debug_collectives(true);
  auto check = [&](const char* label, const std::function<void(const dist::ProcessGroupPtr&)>& call,
                   const std::vector<std::string>& expected) {
    auto victim = pg->split(0, r, label);
    std::string message;
    try {
      call(victim);
    } catch (const Error& e) {
      message = e.what();
    }
    INFO(message);
    CHECK_THAT(message, Catch::Contains(fmt::format("collective mismatch on group '{}'", label)));
    for (auto& e : expected) CHECK_THAT(message, Catch::Contains(e));
  };
  // Rank 0 sums where the others take the max.
  check("op-mismatch",
        [&](const dist::ProcessGroupPtr& g) {
          Tensor t = ones({9});
          g->all_reduce(t, {r == 0 ? ReduceOp::Sum : ReduceOp::Max})->wait();
        },
        {"op sum", "op max"});
  // Rank 0 reduces bf16, the others f32.
  check("dtype-mismatch",
        [&](const dist::ProcessGroupPtr& g) {
          Tensor t = ones({9}, r == 0 ? DType::BF16 : DType::F32);
          g->all_reduce(t)->wait();
        },
        {"all_reduce(bf16", "all_reduce(f32"});
  // Rank 0 all-gathers where the others all-reduce.
  check("kind-mismatch",
        [&](const dist::ProcessGroupPtr& g) {
          Tensor t = ones({4});
          if (r == 0) {
            Tensor out = empty({4 * g->size()});
            g->all_gather_into_tensor(out, t)->wait();
          } else {
            g->all_reduce(t)->wait();
          }
        },
        {"all_gather(", "all_reduce("});
  dist::set_debug_collectives(false);
  pg->barrier()->wait();
}

TEST_CASE("the debug mode catches a mismatched collective on every rank", "[dist][debug]") {
  auto pg = world();
  int W = pg->size(), r = pg->rank();
  if (W == 1) return;
  dist::set_debug_collectives(true);
  auto victim = pg->split(0, r, "desync-test");  // a throwaway group: it is unusable afterwards
  // Rank 0 reduces 17 elements, the others 18.
  Tensor t = ones({r == 0 ? 17 : 18});
  std::string message;
  try {
    victim->all_reduce(t)->wait();
  } catch (const Error& e) {
    message = e.what();
  }
  dist::set_debug_collectives(false);
  INFO(message);
  CHECK_THAT(message, Catch::Contains("collective mismatch on group 'desync-test' at seq 0"));
  CHECK_THAT(message, Catch::Contains("all_reduce(f32, 17 -> 17 elements"));
  CHECK_THAT(message, Catch::Contains("all_reduce(f32, 18 -> 18 elements"));
  CHECK_THROWS_WITH(victim->barrier(), Catch::Contains("unusable"));
  pg->barrier()->wait();  // the world group is unaffected
}

TEST_CASE("a rank that never arrives becomes a timeout exception, not a hang", "[dist][timeout]") {
  auto pg = world();
  int W = pg->size(), r = pg->rank();
  if (W == 1) return;
  auto victim = pg->split(0, r, "timeout-test");
  auto saved = dist::timeout();
  dist::set_timeout(std::chrono::milliseconds(800));
  Tensor t = ones({8});
  dist::WorkPtr late;
  auto t0 = std::chrono::steady_clock::now();
  if (r == 0) {
    std::string message;
    try {
      victim->all_reduce(t)->wait();
    } catch (const Error& e) {
      message = e.what();
    }
    double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    INFO(message);
    CHECK_THAT(message, Catch::Contains("all_reduce (seq 0) on group 'timeout-test'"));
    CHECK_THAT(message, Catch::Contains("did not complete within 0.8 s"));
    CHECK(waited < 5.0);
  }
  dist::set_timeout(saved);
  pg->barrier()->wait();
  // The others arrive late, so rank 0's pending collective completes in the background.
  if (r != 0) victim->all_reduce(t)->wait();
  pg->barrier()->wait();
}

TEST_CASE("a collective keeps its tensors alive until it is waited for", "[dist][async]") {
  auto pg = world();
  int W = pg->size(), r = pg->rank();
  if (W == 1) return;
  // The caller drops every tensor right after issuing; the work holds them.
  std::vector<std::weak_ptr<Storage>> held;
  std::vector<dist::WorkPtr> works;
  // The last rank issues late, so everyone else's collectives stay in flight.
  if (r == W - 1) std::this_thread::sleep_for(std::chrono::milliseconds(200));
  {
    Tensor in = input_for(r, 4099, DType::BF16, 6), out = empty({W * 4099}, DType::BF16);
    works.push_back(pg->all_gather_into_tensor(out, in));
    held.push_back(in.storage());
    held.push_back(out.storage());
    Tensor big = input_for(r, W * 4099, DType::BF16, 7), part = empty({4099}, DType::BF16);
    works.push_back(pg->reduce_scatter_tensor(part, big, {ReduceOp::Avg}));
    held.push_back(big.storage());
    held.push_back(part.storage());
    Tensor sum = input_for(r, 17, DType::F16, 8);
    works.push_back(pg->all_reduce(sum));
    held.push_back(sum.storage());
  }
  for (size_t i = 0; i < held.size() && r != W - 1; ++i) {
    INFO("tensor " << i);
    CHECK_FALSE(held[i].expired());
  }
  // Complete (in the background), not yet waited for: still held, so that
  // memory goes at the same point of the program whenever the peers arrive.
  for (auto& w : works)
    while (!w->is_completed()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  for (size_t i = 0; i < held.size(); ++i) {
    INFO("tensor " << i << " after completion");
    CHECK_FALSE(held[i].expired());
  }
  for (auto& w : works) w->wait();
  for (auto& h : held) CHECK(h.expired());  // released by the wait, while the works live on
}

TEST_CASE("send and recv: matched by tag in any order, counted, checked", "[dist][p2p]") {
  auto pg = world();
  const int W = pg->size(), r = pg->rank();
  // Peers must be other ranks of the group; tags non-negative.
  CHECK_THROWS_WITH(pg->send(ones({3}), r, 0), Catch::Contains("is not another rank of the group"));
  CHECK_THROWS_WITH(pg->recv(ones({3}), W, 0), Catch::Contains("is not another rank of the group"));
  if (W == 1) {
    CHECK(pg->stats().send == 0);
    return;
  }
  CHECK_THROWS_WITH(pg->send(ones({3}), (r + 1) % W, -1), Catch::Contains("tag -1 is outside"));
  pg->reset_stats();
  // A ring of awkward sizes: rank r sends 37 + r values to r + 1. Odd ranks
  // post their receive first, even ranks their send: neither order blocks.
  const int next = (r + 1) % W, prev = (r + W - 1) % W;
  Tensor mine = randn({37 + r}, 100 + static_cast<uint64_t>(r));
  Tensor got = empty({37 + prev});
  dist::WorkPtr s, q;
  if (r % 2) {
    q = pg->recv(got, prev, 5);
    s = pg->send(mine, next, 5);
  } else {
    s = pg->send(mine, next, 5);
    q = pg->recv(got, prev, 5);
  }
  q->wait();
  s->wait();
  CHECK(testing::max_abs_diff(got, randn({37 + prev}, 100 + static_cast<uint64_t>(prev))) == 0);
  // Three messages to the next rank with tags 1, 2, 3, received as 3, 2, 1:
  // each lands where its tag says, whatever the order of the calls.
  std::vector<dist::WorkPtr> sends, recvs;
  std::vector<Tensor> in(3);
  for (int k = 1; k <= 3; ++k) sends.push_back(pg->send(full({k * 5}, 10.0 * r + k), next, k));
  for (int k = 3; k >= 1; --k) {
    in[static_cast<size_t>(k - 1)] = empty({k * 5});
    recvs.push_back(pg->recv(in[static_cast<size_t>(k - 1)], prev, k));
  }
  for (auto& w : recvs) w->wait();
  for (auto& w : sends) w->wait();
  for (int k = 1; k <= 3; ++k) CHECK(testing::max_abs_diff(in[static_cast<size_t>(k - 1)], full({k * 5}, 10.0 * prev + k)) == 0);
  auto st = pg->stats();
  CHECK(st.send == 4);
  CHECK(st.recv == 4);
  CHECK(st.total() == 0);  // no collective among them
  // Point-to-point messages leave the group's collective sequence alone: a
  // collective after them still matches on every rank.
  Tensor sum = full({4}, 1.0);
  pg->all_reduce(sum)->wait();
  CHECK(testing::max_abs_diff(sum, full({4}, W)) == 0);
}

TEST_CASE("a receive whose send never comes times out naming the message", "[dist][p2p][timeout]") {
  auto pg = world();
  const int W = pg->size(), r = pg->rank();
  if (W == 1) return;
  auto pair = pg->split(0, r, "p2p-timeout-test");
  auto saved = dist::timeout();
  dist::set_timeout(std::chrono::milliseconds(800));
  if (r == 0) {
    std::string message;
    try {
      pair->recv(empty({4}), 1, 99)->wait();
    } catch (const Error& e) {
      message = e.what();
    }
    INFO(message);
    CHECK_THAT(message, Catch::Contains("recv from rank 1 (tag 99, message 0 of this rank) on group 'p2p-timeout-test'"));
    CHECK_THAT(message, Catch::Contains("the peer never posted the matching send with tag 99"));
  }
  dist::set_timeout(saved);
  pg->barrier()->wait();
  if (r == 1) pair->send(ones({4}), 0, 99)->wait();  // late: rank 0's receive completes in the background
  pg->barrier()->wait();
}
