// The checkpoint's on-disk format, shared by saving and loading (internal to
// fsdp/checkpoint.cpp and fsdp/checkpoint_format.cpp; the public API is
// fsdp/checkpoint.h). Data files: the magic "TSRCKPT\0", the format version
// and the writing rank (u32 each, little-endian), then the chunks back to back.
#pragma once

#include <cstdint>
#include <string>

#include "fsdp/checkpoint.h"

namespace tessera::fsdp {

constexpr char kDataMagic[8] = {'T', 'S', 'R', 'C', 'K', 'P', 'T', '\0'};
constexpr uint32_t kFormatVersion = 1;
constexpr size_t kDataHeaderBytes = 16;  // magic, version, rank
constexpr const char* kMetadataMagic = "tessera-checkpoint";

// One rank's data file being written: whole writes (short writes retried),
// fsync at finish. The test hook TESSERA_CHECKPOINT_KILL_RANK / _AFTER makes
// that rank SIGKILL itself after that many bytes.
class DataFile {
 public:
  DataFile(const std::string& path, int rank);  // writes the header
  ~DataFile();
  DataFile(const DataFile&) = delete;
  DataFile& operator=(const DataFile&) = delete;
  uint64_t size() const { return size_; }
  void write(const void* data, size_t n);
  void finish();  // fsync and close

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
  int64_t kill_after_ = -1;
};

}  // namespace tessera::fsdp
