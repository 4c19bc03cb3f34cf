// Built only under ThreadSanitizer (make tsan): two pieces of a parallel_for
// write the same element, which TSan must report. The test is expected to
// fail; it passing would mean the TSan build cannot see parallel_for's threads
// (and every clean run proved nothing).
#include <cstdio>
#include <vector>

#include "runtime/parallel_for.h"

int main() {
  tessera::set_num_threads(2);
  std::vector<int> v(4096, 0);
  tessera::parallel_for(0, static_cast<int64_t>(v.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) v[static_cast<size_t>(i)] = 1;
    v[0] += 1;  // every piece: the race
  });
  std::printf("v[0] = %d\n", v[0]);
  return 0;
}
