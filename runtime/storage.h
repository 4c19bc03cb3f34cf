// A block of bytes on one device, shared by every view of it. Storage can be
// released and re-allocated in place: a sharded-parameter scheme frees a
// gathered parameter's bytes after forward while the tensor object (which
// autograd may have saved) lives on, and re-allocates them before backward.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "runtime/device.h"

namespace tessera {

class Allocator;

class Storage {
 public:
  // Allocates nbytes on device (no bytes for meta).
  Storage(size_t nbytes, Device device);
  // Views bytes owned by someone else, without freeing them (the asynchronous
  // CPU device hands its kernels such host views of its memory).
  static std::shared_ptr<Storage> borrow(void* data, size_t nbytes, Device device);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }
  bool is_allocated() const { return data_ != nullptr || nbytes_ == 0; }

  // Frees the bytes; the Storage object, its size and every view of it survive.
  void release();
  // Re-allocates nbytes() bytes (contents undefined) if released; no-op otherwise.
  void allocate();

  // Why the bytes were released, for the error of whoever touches them next
  // (the layer that released them says which parameter, and why).
  std::string release_note;

 private:
  void* data_ = nullptr;
  size_t nbytes_ = 0;
  Device device_;
  Allocator* allocator_ = nullptr;  // null for meta and borrowed bytes
  bool counted_ = false;  // meta: held in the meta accounting (runtime/allocator.h)
};

}  // namespace tessera
