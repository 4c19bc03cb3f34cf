// The op list (runtime/op_list.h) against the backends: every kernel it
// declares is in every backend's table, and a kernel a backend lacks is an
// error naming the op and the device, never a call through a null pointer.
#include <catch2/catch.hpp>

#include <set>
#include <string>

#include "runtime/kernels.h"
#include "runtime/ops.h"

using namespace tessera;

TEST_CASE("every backend has every kernel of the op list", "[ops]") {
  const auto tables = all_kernel_tables();
  std::set<std::string> names;
  for (const auto& [name, table] : tables) names.insert(name);
  CHECK(names.count("cpu:baseline") == 1);
  CHECK(names.count("meta") == 1);
  CHECK(names.count("async_cpu") == 1);
  int kernels = 0;
  for (int i = 0; i < kNumOps; ++i) kernels += op_has_kernel(static_cast<OpId>(i));
  CHECK(kernels >= 29);
  for (const auto& [backend, table] : tables) {
    REQUIRE(table->compute_dtype != nullptr);
    for (int i = 0; i < kNumOps; ++i) {
      const OpId op = static_cast<OpId>(i);
      INFO(backend << ": " << op_name(op));
      const bool lacks = table->lacks[static_cast<size_t>(op)];
      if (!op_has_kernel(op)) CHECK_FALSE(table->supports(op));
      // A kernel the backend lacks is one it says it lacks, never a forgotten entry.
      else CHECK(table->supports(op) != lacks);
      // Only CUDA lacks any, and exactly the list's CPU-only kernels.
      CHECK(lacks == (backend == "cuda" && op_cpu_only(op)));
    }
  }
}

TEST_CASE("the op list: unique names, and ops of every family", "[ops]") {
  std::set<std::string> seen;
  for (int i = 0; i < kNumOps; ++i) {
    const std::string name = op_name(static_cast<OpId>(i));
    CHECK(seen.insert(name).second);
  }
  CHECK(std::string(op_name(OpId::rope)) == "rope");
  CHECK(op_family(OpId::rope) == OpFamily::Attention);
  CHECK(op_family(OpId::gemm) == OpFamily::Kernel);
  CHECK(op_has_kernel(OpId::gemm));
  CHECK_FALSE(op_has_kernel(OpId::linear));
}

TEST_CASE("a kernel the backend lacks fails naming the op and the device", "[ops]") {
  KernelTable lacking = cpu::table();
  lacking.rope = nullptr;
  lacking.backend = "test";
  CHECK_FALSE(lacking.supports(OpId::rope));
  const KernelTable* saved = replace_kernels_for_testing(DeviceType::CPU, &lacking);
  Tensor x = randn({1, 2, 3, 4}, 1), c = randn({3, 2}, 2), s = randn({3, 2}, 3);
  CHECK_THROWS_WITH(ops::rope(x, c, s), Catch::Contains("rope: the test backend has no kernel for it") &&
                                             Catch::Contains("cannot run on cpu"));
  // The others still run.
  CHECK(ops::add(x, x).shape() == x.shape());
  replace_kernels_for_testing(DeviceType::CPU, saved);
  CHECK(ops::rope(x, c, s).shape() == x.shape());
}
