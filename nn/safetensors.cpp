#include "nn/safetensors.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>

#include "dtensor/dtensor.h"
#include "runtime/json_scan.h"

namespace tessera::nn {

static_assert(std::endian::native == std::endian::little,
              "safetensors I/O assumes a little-endian host");

namespace {

DType dtype_from_safetensors(const std::string& s, const std::string& file,
                             const std::string& name) {
  if (s == "F32") return DType::F32;
  if (s == "F64") return DType::F64;
  if (s == "BF16") return DType::BF16;
  if (s == "F16") return DType::F16;
  if (s == "I32") return DType::I32;
  if (s == "I64") return DType::I64;
  if (s == "BOOL") return DType::Bool;
  TS_CHECK(
      false,
      "{}: tensor '{}' has unsupported dtype '{}' (supported: F32, F64, BF16, F16, I32, I64, BOOL)",
      file, name, s);
}

// a * b, or an error when it does not fit in 64 bits.
uint64_t checked_mul(uint64_t a, uint64_t b, const std::string& file, const std::string& name) {
  TS_CHECK(b == 0 || a <= std::numeric_limits<uint64_t>::max() / b,
           "{}: tensor '{}' is too large (size overflow)", file, name);
  return a * b;
}

}  // namespace

const char* safetensors_dtype(DType dt) {
  switch (dt) {
    case DType::F32:
      return "F32";
    case DType::F64:
      return "F64";
    case DType::BF16:
      return "BF16";
    case DType::F16:
      return "F16";
    case DType::I32:
      return "I32";
    case DType::I64:
      return "I64";
    case DType::Bool:
      return "BOOL";
  }
  return "?";
}

std::vector<SafetensorsEntry> SafetensorsFile::parse_header(
    const std::string& text, uint64_t data_size, const std::string& file,
    std::map<std::string, std::string>* metadata) {
  check_json_nesting(text, file + ": the safetensors header");
  check_json_unique_keys(text, file + ": the safetensors header");  // a tensor named twice
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    TS_CHECK(false, "{}: the safetensors header is not valid JSON ({})", file, e.what());
  }
  TS_CHECK(header.is_object(), "{}: the safetensors header must be a JSON object", file);
  std::vector<SafetensorsEntry> entries;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const auto& v = it.value();
    if (name == "__metadata__") {
      TS_CHECK(v.is_object(), "{}: __metadata__ must be an object of strings", file);
      for (auto m = v.begin(); m != v.end(); ++m) {
        TS_CHECK(m.value().is_string(), "{}: __metadata__ value '{}' is not a string", file,
                 m.key());
        if (metadata) (*metadata)[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    TS_CHECK(
        v.is_object() && v.contains("dtype") && v.contains("shape") && v.contains("data_offsets"),
        "{}: tensor '{}' needs dtype, shape and data_offsets", file, name);
    TS_CHECK(v["dtype"].is_string(), "{}: tensor '{}' has a non-string dtype", file, name);
    SafetensorsEntry e;
    e.name = name;
    e.dtype = dtype_from_safetensors(v["dtype"].get<std::string>(), file, name);
    TS_CHECK(v["shape"].is_array() && v["shape"].size() <= 16,
             "{}: tensor '{}' has an invalid shape", file, name);
    uint64_t numel = 1;
    for (const auto& d : v["shape"]) {
      TS_CHECK(d.is_number_unsigned(),
               "{}: tensor '{}' has a negative or non-integer dim in its shape", file, name);
      uint64_t dim = d.get<uint64_t>();
      TS_CHECK(dim <= (1ull << 48), "{}: tensor '{}' has an absurd dim {}", file, name, dim);
      e.shape.push_back(static_cast<int64_t>(dim));
      numel = checked_mul(numel, dim, file, name);
    }
    const auto& off = v["data_offsets"];
    TS_CHECK(off.is_array() && off.size() == 2 && off[0].is_number_unsigned() &&
                 off[1].is_number_unsigned(),
             "{}: tensor '{}' needs data_offsets [begin, end] of non-negative integers", file,
             name);
    e.begin = off[0].get<uint64_t>();
    e.end = off[1].get<uint64_t>();
    TS_CHECK(e.begin <= e.end && e.end <= data_size,
             "{}: tensor '{}' has data_offsets [{}, {}] outside the data section of {} bytes", file,
             name, e.begin, e.end, data_size);
    uint64_t bytes = checked_mul(numel, dtype_size(e.dtype), file, name);
    TS_CHECK(e.end - e.begin == bytes, "{}: tensor '{}' spans {} bytes but {} {} needs {}", file,
             name, e.end - e.begin, safetensors_dtype(e.dtype), shape_str(e.shape), bytes);
    entries.push_back(std::move(e));
  }
  // Spans may not overlap (empty tensors may sit anywhere).
  std::vector<const SafetensorsEntry*> sorted;
  for (const auto& e : entries)
    if (e.end > e.begin) sorted.push_back(&e);
  std::sort(sorted.begin(), sorted.end(), [](auto* a, auto* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < sorted.size(); ++i)
    TS_CHECK(sorted[i]->begin >= sorted[i - 1]->end,
             "{}: tensors '{}' and '{}' overlap in the data section", file, sorted[i - 1]->name,
             sorted[i]->name);
  return entries;
}

SafetensorsFile::SafetensorsFile(const std::string& path, uint64_t max_header_bytes) : path_(path) {
  std::error_code ec;
  auto size = std::filesystem::file_size(path, ec);
  TS_CHECK(!ec, "{}: cannot read safetensors file ({})", path, ec.message());
  TS_CHECK(size >= 8, "{}: truncated safetensors file ({} bytes, the header length alone needs 8)",
           path, size);
  file_.reset(std::fopen(path.c_str(), "rb"));
  TS_CHECK(file_ != nullptr, "{}: cannot open safetensors file", path);
  unsigned char len_bytes[8];
  TS_CHECK(std::fread(len_bytes, 1, 8, file_.get()) == 8, "{}: cannot read the header length",
           path);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];  // little-endian
  TS_CHECK(header_len <= max_header_bytes,
           "{}: header of {} bytes exceeds the limit of {} (not a safetensors file? Its first 8 bytes give the "
           "header's length; a checkpoint is given as its directory, not its metadata.json)",
           path, header_len, max_header_bytes);
  TS_CHECK(header_len <= size - 8,
           "{}: header of {} bytes runs past the end of the {}-byte file (truncated?)", path,
           header_len, size);
  std::string text(header_len, '\0');
  TS_CHECK(std::fread(text.data(), 1, header_len, file_.get()) == header_len,
           "{}: cannot read the header", path);
  data_start_ = 8 + header_len;
  entries_ = parse_header(text, size - data_start_, path, &metadata_);
}

SafetensorsFile::~SafetensorsFile() = default;

const SafetensorsEntry* SafetensorsFile::find(const std::string& name) const {
  for (const auto& e : entries_)
    if (e.name == name) return &e;
  return nullptr;
}

Tensor SafetensorsFile::read(const std::string& name, std::optional<DType> dtype) const {
  const SafetensorsEntry* e = find(name);
  TS_CHECK(e != nullptr, "{}: no tensor named '{}'", path_, name);
  return read_rows(name, 0, e->shape.empty() ? 1 : e->shape[0], dtype);
}

Tensor SafetensorsFile::read_rows(const std::string& name, int64_t begin, int64_t count,
                                  std::optional<DType> dtype) const {
  const SafetensorsEntry* e = find(name);
  TS_CHECK(e != nullptr, "{}: no tensor named '{}'", path_, name);
  int64_t rows = e->shape.empty() ? 1 : e->shape[0];
  TS_CHECK(begin >= 0 && count >= 0 && begin + count <= rows,
           "{}: rows [{}, {}) of tensor '{}' (shape {})", path_, begin, begin + count, name,
           shape_str(e->shape));
  // Conversion is between floating-point dtypes only: integers stored where
  // weights are expected (a dtype field edited, the same bytes) are refused.
  TS_CHECK(!dtype || *dtype == e->dtype || (is_floating(*dtype) && is_floating(e->dtype)),
           "{}: tensor '{}' is {} in the file but {} is expected (only floating-point dtypes "
           "convert into each other)",
           path_, name, safetensors_dtype(e->dtype), safetensors_dtype(*dtype));
  Shape shape = e->shape;
  if (!shape.empty()) shape[0] = count;
  Tensor t = empty(shape, e->dtype);
  uint64_t row_bytes = rows ? (e->end - e->begin) / static_cast<uint64_t>(rows) : 0;
  uint64_t n = row_bytes * static_cast<uint64_t>(count);
  if (n > 0) {
    TS_CHECK(fseeko(file_.get(),
                    static_cast<off_t>(data_start_ + e->begin +
                                       row_bytes * static_cast<uint64_t>(begin)),
                    SEEK_SET) == 0 &&
                 std::fread(t.host_data_ptr(), 1, n, file_.get()) == n,
             "{}: cannot read tensor '{}' ({} bytes; truncated file?)", path_, name, n);
  }
  return dtype && *dtype != t.dtype() ? ops::to(t, *dtype) : t;
}

void write_safetensors(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                       const std::function<Tensor(size_t)>& fill,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header;
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t expected = 0;
  for (const auto& e : entries) {
    TS_CHECK(e.begin == expected && e.end >= e.begin,
             "write_safetensors: '{}' has data_offsets [{}, {}]; entries are written back to back "
             "from {}",
             e.name, e.begin, e.end, expected);
    expected = e.end;
    header[e.name] = {{"dtype", safetensors_dtype(e.dtype)},
                      {"shape", e.shape},
                      {"data_offsets", {e.begin, e.end}}};
  }
  std::string text = header.dump();
  while ((8 + text.size()) % 8 != 0) text += ' ';  // the data section starts 8-byte aligned
  std::string tmp = path + ".tmp";
  // fill(i) is called for every entry even after an error (it may run a
  // collective that other ranks take part in); the first error is thrown at the end.
  std::string error;
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr)
    error = fmt::format("cannot write safetensors file '{}': {}", tmp, std::strerror(errno));
  unsigned char len[8];
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
  if (f && (std::fwrite(len, 1, 8, f) != 8 ||
            std::fwrite(text.data(), 1, text.size(), f) != text.size()))
    error = fmt::format("writing safetensors file '{}' failed (disk full?)", tmp);
  for (size_t i = 0; i < entries.size(); ++i) {
    Tensor t = ops::contiguous(fill(i).to(Device::cpu()));
    if (!error.empty()) continue;
    if (t.dtype() != entries[i].dtype || t.shape() != entries[i].shape)
      error = fmt::format("write_safetensors: tensor '{}' is {} {}, the header says {} {}",
                          entries[i].name, dtype_name(t.dtype()), shape_str(t.shape()),
                          dtype_name(entries[i].dtype), shape_str(entries[i].shape));
    else if (t.numel() > 0 && std::fwrite(t.host_data_ptr(), 1, t.nbytes(), f) != t.nbytes())
      error = fmt::format("writing safetensors file '{}' failed (disk full?)", tmp);
  }
  if (f && std::fclose(f) != 0 && error.empty())
    error = fmt::format("closing safetensors file '{}' failed", tmp);
  if (!error.empty()) {
    std::error_code ec;
    std::filesystem::remove(tmp, ec);
  }
  TS_CHECK(error.empty(), "{}", error);
  std::filesystem::rename(tmp, path);
}

void save_safetensors(const std::string& path, const StateDict& state,
                      const std::map<std::string, std::string>& md) {
  std::vector<SafetensorsEntry> entries;
  uint64_t offset = 0;
  for (const auto& [name, t] : state) {
    TS_CHECK(!is_dtensor(t),
             "save_safetensors: '{}' is a DTensor; gather it first (fsdp::full_state_dict)", name);
    SafetensorsEntry e{name, t.dtype(), t.shape(), offset, offset + t.nbytes()};
    offset = e.end;
    entries.push_back(e);
  }
  write_safetensors(
      path, entries, [&](size_t i) { return state[i].second; }, md);
}

}  // namespace tessera::nn
