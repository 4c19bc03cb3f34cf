// The CUDA kernels' operand indexing (runtime/cuda/iter.h, make_iter.h), on
// the CPU: for random shapes and views (transposed, sliced with steps,
// broadcast, size-1 dims), the coalesced Iter must reach the same element of
// every operand as the tensor's own strides do, at every index.
#include <random>

#include "runtime/cuda/make_iter.h"
#include "runtime/ops.h"
#include "tests/helpers.h"

using namespace tessera;

namespace {

// Offset (elements, from data_ptr) of the element at row-major index i of `shape` in t.
int64_t expected_offset(const Tensor& t, const Shape& shape, int64_t i) {
  int64_t off = 0;
  for (size_t d = shape.size(); d-- > 0;) {
    off += (i % shape[d]) * t.strides()[d];
    i /= shape[d];
  }
  return off;
}

// A view of a fresh tensor with `shape`: dense, transposed, stepped or broadcast.
Tensor random_view(const Shape& shape, std::mt19937& rng) {
  const int kind = static_cast<int>(rng() % 4);
  const int64_t nd = static_cast<int64_t>(shape.size());
  if (kind == 1 && nd >= 2) {  // a transposed base
    Shape s = shape;
    std::swap(s[0], s[nd - 1]);
    return ops::transpose(randn(s, rng()), 0, nd - 1);
  }
  if (kind == 2 && nd >= 1) {  // every other element of a longer last dim
    Shape s = shape;
    s[nd - 1] = 2 * s[nd - 1];
    return ops::slice(randn(s, rng()), nd - 1, 0, s[nd - 1], 2);
  }
  if (kind == 3 && nd >= 1) {  // broadcast along a random dim
    Shape s = shape;
    int64_t d = static_cast<int64_t>(rng() % nd);
    s[d] = 1;
    return ops::expand(randn(s, rng()), shape);
  }
  return randn(shape, rng());
}

}  // namespace

TEST_CASE("CUDA operand indexing: coalesced iterators reach every operand's elements", "[cuda][iter]") {
  std::mt19937 rng(7);
  int contiguous_cases = 0;
  for (int trial = 0; trial < 400; ++trial) {
    Shape shape;
    const int nd = static_cast<int>(rng() % 6);
    for (int d = 0; d < nd; ++d) shape.push_back(1 + static_cast<int64_t>(rng() % 5));
    Tensor a = random_view(shape, rng), b = random_view(shape, rng), c = random_view(shape, rng);
    auto it = cuda::make_iter<3>(shape, {&a, &b, &c});
    REQUIRE(it.numel == shape_numel(shape));
    REQUIRE(it.ndim <= static_cast<int>(shape.size()));
    contiguous_cases += it.contiguous;
    const Tensor* ops[3] = {&a, &b, &c};
    for (int k = 0; k < 3; ++k) {
      CHECK(it.data[k] == ops[k]->data_ptr());
      for (int64_t i = 0; i < it.numel; ++i) {
        INFO("shape " << shape_str(shape) << ", operand " << k << " strides " << shape_str(ops[k]->strides())
                      << ", index " << i);
        REQUIRE(cuda::offset_of(it, k, i) == expected_offset(*ops[k], shape, i));
      }
    }
  }
  CHECK(contiguous_cases > 5);  // the dense fast path was taken, and checked
  // Merging stops where a dim is not dense across its neighbour.
  Tensor t = ops::transpose(randn({4, 6}, 1), 0, 1);
  Tensor d = randn({6, 4}, 2);
  auto it = cuda::make_iter<2>({6, 4}, {&d, &t});
  CHECK(it.ndim == 2);
  CHECK_FALSE(it.contiguous);
  auto dense = cuda::make_iter<2>({6, 4}, {&d, &d});
  CHECK(dense.ndim == 1);
  CHECK(dense.contiguous);
}
