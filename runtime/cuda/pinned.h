// Page-locked host buffers for copies between host and GPU (internal): taken
// from a cache by size, returned to it when the last reference goes (a copy
// keeps its buffer until the copy ran).
#pragma once

#include <cstddef>
#include <memory>

namespace tessera::cuda {

using PinnedBuffer = std::shared_ptr<void>;
PinnedBuffer pinned_buffer(size_t nbytes);

}  // namespace tessera::cuda
