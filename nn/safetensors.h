// The safetensors format (Hugging Face): an 8-byte little-endian header
// length, a JSON header {name: {"dtype", "shape", "data_offsets": [begin, end]},
// "__metadata__": {string: string}}, then the raw little-endian bytes.
//
// The reader treats the file as untrusted input: header size limited, every
// offset bounds-checked, spans must match dtype x shape and may not overlap;
// anything else is an exception naming the file and the tensor.
#pragma once

#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "nn/module.h"

namespace tessera::nn {

const char* safetensors_dtype(DType dt);  // "F32", "BF16", ...

struct SafetensorsEntry {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin = 0, end = 0;  // within the data section
};

class SafetensorsFile {
 public:
  // Opens and validates the header (max_header_bytes guards against absurd headers).
  explicit SafetensorsFile(const std::string& path, uint64_t max_header_bytes = 100ull << 20);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const SafetensorsEntry* find(const std::string& name) const;
  // Reads a tensor, converted to `dtype` when given.
  Tensor read(const std::string& name, std::optional<DType> dtype = std::nullopt) const;
  // Rows [begin, begin + count) of dim 0 only (a rank's Shard(0) slice).
  Tensor read_rows(const std::string& name, int64_t begin, int64_t count,
                   std::optional<DType> dtype = std::nullopt) const;

  // Parses a header (for tests and fuzzing): the JSON text and the data size it describes.
  static std::vector<SafetensorsEntry> parse_header(
      const std::string& json, uint64_t data_size, const std::string& file,
      std::map<std::string, std::string>* metadata = nullptr);

 private:
  struct FileCloser {
    void operator()(std::FILE* f) const { std::fclose(f); }
  };
  std::string path_;
  // Owned from the open on, so a header that is refused mid-constructor (the
  // destructor then never runs) still closes the file.
  std::unique_ptr<std::FILE, FileCloser> file_;
  uint64_t data_start_ = 0;
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

// Writes tensors in the given order (data_offsets back to back from 0). The
// header is computed from shapes and dtypes first; fill(i) then supplies the
// bytes of entry i one at a time, so a sharded model can be streamed out
// without holding it whole. fill is called for every entry even after a write
// error (it may be a collective); the error is thrown at the end. The file
// appears under its name only when complete.
void write_safetensors(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                       const std::function<Tensor(size_t)>& fill,
                       const std::map<std::string, std::string>& metadata = {});
// A whole state dict of plain tensors (every key, tied ones as separate copies).
void save_safetensors(const std::string& path, const StateDict& state,
                      const std::map<std::string, std::string>& metadata = {});

}  // namespace tessera::nn
