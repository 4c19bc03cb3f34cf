#include "runtime/storage.h"

#include "runtime/allocator.h"

namespace tessera {

Storage::Storage(size_t nbytes, Device device) : nbytes_(nbytes), device_(device) {
  if (!device.is_meta()) {
    allocator_ = &allocator_for(device);
    data_ = allocator_->allocate(nbytes);
  }
}

Storage::~Storage() { release(); }

void Storage::release() {
  if (allocator_ != nullptr && data_ != nullptr) allocator_->deallocate(data_, nbytes_);
  data_ = nullptr;
}

void Storage::allocate() {
  if (allocator_ != nullptr && data_ == nullptr) data_ = allocator_->allocate(nbytes_);
}

}  // namespace tessera
