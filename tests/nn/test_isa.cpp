// Every instruction-set copy of the CPU kernels (runtime/cpu/isa.h) that this
// CPU can run against the baseline copy: the ops one by one at awkward shapes
// and strides, and a GPT and a Llama forward and backward, in f32 and f64.
// Vector code may contract a * b + c into one FMA, so the copies agree to
// rounding, not bit for bit.
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "nn/models.h"
#include "runtime/cpu/blas.h"
#include "runtime/cpu/isa.h"
#include "runtime/cpu/peak.h"
#include "tests/helpers.h"

using namespace tessera;
using tessera::testing::close_ratio;

namespace {

using Results = std::vector<std::pair<std::string, Tensor>>;

std::vector<cpu::Isa> supported_isas() {
  std::vector<cpu::Isa> out;
  for (cpu::Isa isa : {cpu::Isa::Baseline, cpu::Isa::Avx2, cpu::Isa::Avx512})
    if (cpu::isa_supported(isa)) out.push_back(isa);
  return out;
}

// The ops one by one: every unary op and its backward, binary ops with
// broadcasting and a transposed operand, reductions, softmax, norms, loss.
Results op_results(DType dtype) {
  Results r;
  auto add = [&](std::string name, const Tensor& t) { r.emplace_back(std::move(name), ops::clone(t)); };
  Tensor x = ops::to(randn({5, 37, 13}, 11), dtype);
  Tensor pos = ops::add(ops::unary(ops::UnaryOp::Abs, x), 0.25);  // for log, sqrt, rsqrt, reciprocal, pow
  Tensor xt = ops::transpose(x, 0, 2);      // [13, 37, 5], not contiguous
  Tensor g = ops::to(randn({5, 37, 13}, 12), dtype);
  using U = ops::UnaryOp;
  for (U op : {U::Neg, U::Exp, U::Log, U::Sqrt, U::Rsqrt, U::Abs, U::Tanh, U::Sigmoid, U::Relu, U::Gelu,
               U::GeluTanh, U::Silu, U::Sin, U::Cos, U::Square, U::Reciprocal, U::Sign}) {
    bool positive = op == U::Log || op == U::Sqrt || op == U::Rsqrt || op == U::Reciprocal;
    const Tensor& in = positive ? pos : x;
    Tensor y = ops::unary(op, in);
    add(ops::unary_name(op), y);
    add(std::string(ops::unary_name(op)) + ".backward", ops::unary_backward(op, g, in, y));
    add(std::string(ops::unary_name(op)) + " strided", ops::unary(op, ops::transpose(in, 0, 2)));
  }
  Tensor b = ops::to(randn({37, 1}, 13), dtype);
  using B = ops::BinaryOp;
  for (B op : {B::Add, B::Sub, B::Mul, B::Div, B::Pow, B::Maximum, B::Minimum, B::Lt, B::Ge}) {
    const Tensor& lhs = op == B::Pow ? pos : x;
    add(ops::binary_name(op), ops::binary(op, lhs, b));
    add(std::string(ops::binary_name(op)) + " transposed",
        ops::binary(op, ops::transpose(lhs, 0, 2), ops::transpose(g, 0, 2)));
    add(std::string(ops::binary_name(op)) + " scalar", ops::binary(op, lhs, 0.7));
  }
  add("where", ops::where(ops::binary(B::Gt, x, g), x, g));
  add("sum", ops::sum(x, {1}));
  add("sum strided", ops::sum(xt, {0, 2}));
  add("mean", ops::mean(x, {2}, true));
  add("max", ops::max(x));
  add("argmax", ops::argmax(x, 1));
  add("softmax", ops::softmax(x, -1));
  add("log_softmax dim 1", ops::log_softmax(x, 1));
  add("softmax_backward", ops::softmax_backward(g, ops::softmax(x, -1), -1));
  add("sum_squares", ops::sum_squares({x, g, b}, Device::cpu()));
  Tensor w = ops::to(randn({13}, 14), dtype), bias = ops::to(randn({13}, 15), dtype);
  ops::NormResult ln = ops::layer_norm(x, w, bias, 1e-5);
  add("layer_norm", ln.y);
  ops::NormGrads lg = ops::layer_norm_backward(g, x, w, ln.mean, ln.rstd, true);
  add("layer_norm_backward dx", lg.dx);
  add("layer_norm_backward dweight", lg.dweight);
  ops::NormResult rn = ops::rms_norm(x, w, 1e-5);
  add("rms_norm", rn.y);
  add("rms_norm_backward dx", ops::rms_norm_backward(g, x, w, rn.rstd, true).dx);
  Tensor logits = ops::reshape(x, {5 * 37, 13});
  Tensor target = randint({5 * 37}, 0, 13, 16);
  ops::CrossEntropyResult ce = ops::cross_entropy(logits, target);
  add("cross_entropy", ce.loss);
  add("cross_entropy_backward",
      ops::cross_entropy_backward(full({}, 1.0, dtype), logits, target, ce.lse, -100, ce.count));
  Tensor q = ops::to(randn({2, 3, 70, 8}, 17), dtype), k = ops::to(randn({2, 1, 70, 8}, 18), dtype);
  Tensor v = ops::to(randn({2, 1, 70, 8}, 19), dtype), dout = ops::to(randn({2, 3, 70, 8}, 20), dtype);
  ops::AttentionResult at = ops::attention(q, k, v, true, 0.3);
  add("attention", at.out);
  ops::AttentionGrads ag = ops::attention_backward(dout, q, k, v, at.out, at.lse, true, 0.3);
  add("attention_backward dq", ag.dq);
  add("attention_backward dk", ag.dk);
  add("attention_backward dv", ag.dv);
  Tensor table = ops::to(randn({11, 6}, 21), dtype), ids = randint({4, 9}, 0, 11, 22);
  add("embedding", ops::embedding(table, ids));
  add("embedding_backward", ops::embedding_backward(ops::to(randn({4, 9, 6}, 23), dtype), ids, 11));
  return r;
}

// A model's loss and every parameter's gradient after one backward pass.
Results model_results(bool llama, DType dtype) {
  nn::TransformerConfig cfg;
  cfg.vocab_size = 37;
  cfg.block_size = 24;
  cfg.n_layer = 2;
  cfg.n_head = 3;
  cfg.n_kv_head = llama ? 1 : 0;
  cfg.n_embd = 24;
  std::unique_ptr<nn::LanguageModel> m;
  if (llama) m = std::make_unique<nn::Llama>(cfg);
  else m = std::make_unique<nn::GPT>(cfg);
  m->to(dtype);
  m->init_weights(5);
  Tensor idx = randint({3, 19}, 0, cfg.vocab_size, 1), tgt = randint({3, 19}, 0, cfg.vocab_size, 2);
  Tensor loss = nn::cross_entropy((*m)(idx), tgt);
  autograd::backward(loss);
  Results r{{"loss", ops::clone(loss)}};
  for (auto& [name, p] : m->named_parameters()) r.emplace_back(name + ".grad", ops::clone(p.grad()));
  return r;
}

// Restores the copy in use when a check fails and the test case ends.
struct IsaGuard {
  cpu::Isa saved = cpu::active_isa();
  ~IsaGuard() { cpu::set_isa(saved); }
};

void compare_copies(const std::function<Results()>& run, DType dtype) {
  double rtol = dtype == DType::F64 ? 1e-10 : 2e-4, atol = dtype == DType::F64 ? 1e-12 : 2e-5;
  IsaGuard guard;
  cpu::set_isa(cpu::Isa::Baseline);
  Results base = run();
  for (cpu::Isa isa : supported_isas()) {
    cpu::set_isa(isa);
    Results got = run();
    REQUIRE(got.size() == base.size());
    for (size_t i = 0; i < got.size(); ++i) {
      INFO(cpu::isa_name(isa) << " " << dtype_name(dtype) << " " << got[i].first);
      CHECK(close_ratio(ops::to(got[i].second, DType::F64), ops::to(base[i].second, DType::F64), rtol,
                        atol) <= 1.0);
    }
  }
}

}  // namespace

TEST_CASE("every instruction-set copy of the CPU kernels agrees with the baseline copy", "[isa]") {
  INFO("copies this CPU runs: " << supported_isas().size());
  for (DType dtype : {DType::F32, DType::F64}) {
    compare_copies([&] { return op_results(dtype); }, dtype);
    compare_copies([&] { return model_results(false, dtype); }, dtype);
    compare_copies([&] { return model_results(true, dtype); }, dtype);
  }
}

TEST_CASE("the instruction-set copy: names, refusals, and TESSERA_CPU_ISA as a cap", "[isa]") {
  CHECK(cpu::parse_isa("avx2") == cpu::Isa::Avx2);
  CHECK_THROWS_WITH(cpu::parse_isa("sse9"), Catch::Contains("expected baseline, avx2 or avx512, got 'sse9'"));
  CHECK(cpu::isa_supported(cpu::Isa::Baseline));
  if (!cpu::isa_supported(cpu::Isa::Avx512))
    CHECK_THROWS_WITH(cpu::set_isa(cpu::Isa::Avx512), Catch::Contains("cannot run the avx512 kernels"));
  // The default: the widest copy this CPU runs, capped by the environment.
  cpu::Isa widest = cpu::isa_supported(cpu::Isa::Avx512) ? cpu::Isa::Avx512
                    : cpu::isa_supported(cpu::Isa::Avx2) ? cpu::Isa::Avx2
                                                         : cpu::Isa::Baseline;
  cpu::Isa expected = widest;
  if (const char* cap = std::getenv("TESSERA_CPU_ISA"))
    expected = std::min(widest, cpu::parse_isa(cap));
  CHECK(cpu::isa_name(cpu::active_isa()) == std::string(cpu::isa_name(expected)));
  // MFU's peak follows the copy (and oneDNN, capped alike): no AVX-512 loop under a cap below it,
  // and bf16 products on f32 copies are measured as f32 FMAs.
  const std::string fma = cpu::measure_peak(cpu::PeakUnit::Fma, 1).unit;
  CHECK((fma == "AVX-512 FMA") == (expected == cpu::Isa::Avx512));
  // Below AVX-512 the large f32 products run on OpenBLAS's AVX2 kernels, cap or not: the peak is theirs.
  if (expected != cpu::Isa::Avx512 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    CHECK(fma == "AVX2 FMA");
  if (!cpu::bf16_gemm_native()) CHECK(cpu::measure_dtype_peak(DType::BF16, 1).unit == fma);
  // Switching works both ways and reaches the ops.
  Tensor x = randn({1000}, 3);
  cpu::Isa saved = cpu::set_isa(cpu::Isa::Baseline);
  CHECK(cpu::active_isa() == cpu::Isa::Baseline);
  Tensor y = ops::unary(ops::UnaryOp::Gelu, x);
  CHECK(cpu::set_isa(saved) == cpu::Isa::Baseline);
  CHECK(cpu::active_isa() == saved);
  CHECK(testing::allclose(ops::unary(ops::UnaryOp::Gelu, x), y, 1e-5, 1e-6));
}
