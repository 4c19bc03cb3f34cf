#include "runtime/storage.h"

#include "runtime/allocator.h"

namespace tessera {

Storage::Storage(size_t nbytes, Device device) : nbytes_(nbytes), device_(device) {
  if (!device.is_meta()) {
    allocator_ = &allocator_for(device);
    data_ = allocator_->allocate(nbytes);
  } else {
    allocate();  // counted while a MetaAccounting is active
  }
}

std::shared_ptr<Storage> Storage::borrow(void* data, size_t nbytes, Device device) {
  auto s = std::make_shared<Storage>(0, Device::meta());
  s->data_ = data;
  s->nbytes_ = nbytes;
  s->device_ = device;
  return s;
}

Storage::~Storage() { release(); }

void Storage::release() {
  if (allocator_ != nullptr && data_ != nullptr) allocator_->deallocate(data_);
  data_ = nullptr;
  if (counted_) detail::meta_account(-static_cast<int64_t>(nbytes_));
  counted_ = false;
}

void Storage::allocate() {
  if (allocator_ != nullptr && data_ == nullptr) data_ = allocator_->allocate(nbytes_);
  if (device_.is_meta() && allocator_ == nullptr && data_ == nullptr && !counted_ && nbytes_ > 0 &&
      meta_accounting_active()) {
    detail::meta_account(static_cast<int64_t>(nbytes_));
    counted_ = true;
  }
}

}  // namespace tessera
