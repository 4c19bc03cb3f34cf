#include "fsdp/checkpoint_format.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "runtime/json_scan.h"

namespace tessera::fsdp {

namespace fs = std::filesystem;
using json = nlohmann::json;

// ---- data files -----------------------------------------------------------------

DataFile::DataFile(const std::string& path, int rank) : path_(path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  TS_CHECK(fd_ >= 0, "checkpoint: cannot create '{}': {}", path, std::strerror(errno));
  char header[kDataHeaderBytes];
  std::memcpy(header, kDataMagic, 8);
  uint32_t v = kFormatVersion, r = static_cast<uint32_t>(rank);
  std::memcpy(header + 8, &v, 4);
  std::memcpy(header + 12, &r, 4);
  try {
    write(header, kDataHeaderBytes);
  } catch (...) {  // the destructor does not run for a constructor that throws
    ::close(fd_);
    throw;
  }
  // Test hook: a rank that kills itself mid-save (see tests/fsdp/checkpoint_test.sh);
  // with TESSERA_CHECKPOINT_KILL_FILE=n only in the n-th data file this
  // process writes (a later save's, after earlier ones completed).
  static std::atomic<int> files_opened{0};
  const int this_file = ++files_opened;
  const char* kill_file = std::getenv("TESSERA_CHECKPOINT_KILL_FILE");
  if (const char* kr = std::getenv("TESSERA_CHECKPOINT_KILL_RANK"); kr && std::atoi(kr) == rank)
    if (const char* after = std::getenv("TESSERA_CHECKPOINT_KILL_AFTER"))
      if (kill_file == nullptr || std::atoi(kill_file) == this_file) kill_after_ = std::atoll(after);
}

DataFile::~DataFile() {
  if (fd_ >= 0) ::close(fd_);
}

void DataFile::write(const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    size_t piece = n;
    if (kill_after_ >= 0) {
      if (static_cast<int64_t>(size_) >= kill_after_) ::kill(::getpid(), SIGKILL);
      piece =
          std::min<size_t>(n, static_cast<size_t>(kill_after_ - static_cast<int64_t>(size_)) + 1);
    }
    ssize_t w = ::write(fd_, p, piece);
    TS_CHECK(w > 0, "checkpoint: writing '{}' failed: {} (disk full?)", path_,
             std::strerror(errno));
    p += w;
    n -= static_cast<size_t>(w);
    size_ += static_cast<uint64_t>(w);
  }
}

void DataFile::finish() {
  TS_CHECK(::fsync(fd_) == 0, "checkpoint: fsync of '{}' failed: {}", path_, std::strerror(errno));
  ::close(fd_);
  fd_ = -1;
}

// ---- checksums ------------------------------------------------------------------

namespace detail {
// Slicing-by-8 over the reflected Castagnoli polynomial (portable; tested against the instruction).
uint32_t crc32c_software(const void* data, size_t n, uint32_t crc) {
  static const auto tables = [] {
    std::array<std::array<uint32_t, 256>, 8> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0x82F63B78u ^ (c >> 1) : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (size_t k = 1; k < 8; ++k) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xffu];
    return t;
  }();
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    word ^= crc;
    crc = tables[7][word & 0xff] ^ tables[6][(word >> 8) & 0xff] ^ tables[5][(word >> 16) & 0xff] ^
          tables[4][(word >> 24) & 0xff] ^ tables[3][(word >> 32) & 0xff] ^
          tables[2][(word >> 40) & 0xff] ^ tables[1][(word >> 48) & 0xff] ^ tables[0][word >> 56];
  }
  for (; n > 0; --n, ++p) crc = tables[0][(crc ^ *p) & 0xffu] ^ (crc >> 8);
  return ~crc;
}
}  // namespace detail

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
#if defined(__SSE4_2__)
  // The SSE4.2 crc32 instruction computes exactly CRC-32C, 8 bytes at a time.
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    crc = static_cast<uint32_t>(__builtin_ia32_crc32di(crc, word));
  }
  for (; n > 0; --n, ++p) crc = __builtin_ia32_crc32qi(crc, *p);
  return ~crc;
#else
  return detail::crc32c_software(data, n, crc);
#endif
}

const TensorInfo* CheckpointMetadata::find(const std::string& name) const {
  for (const auto& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

// ---- reading: metadata and chunks as untrusted input ------------------------------

namespace {
// A shape from untrusted JSON: at most 16 dims, each and the product at most 2^48.
Shape read_shape(const json& j, const std::string& file, const std::string& what) {
  TS_CHECK(j.is_array() && j.size() <= 16, "{}: {} must be an array of at most 16 dims", file,
           what);
  Shape s;
  uint64_t numel = 1;
  for (const auto& d : j) {
    TS_CHECK(d.is_number_unsigned() && d.get<uint64_t>() <= (1ull << 48),
             "{}: {} has an invalid dim", file, what);
    uint64_t dim = d.get<uint64_t>();
    TS_CHECK(dim == 0 || numel <= (1ull << 48) / dim, "{}: {} has more than 2^48 elements", file,
             what);
    numel = dim == 0 ? 0 : numel * dim;
    s.push_back(static_cast<int64_t>(dim));
  }
  return s;
}
}  // namespace

namespace {

// One entry of a tensor's "chunks": a plain file name, a byte range after the
// data file's header, a CRC, and a box inside the tensor that the bytes fill.
ChunkInfo parse_chunk(const json& c, const TensorInfo& info, const std::string& file) {
  TS_CHECK(c.is_object() && c.contains("file") && c["file"].is_string(),
           "{}: a chunk of '{}' names no file", file, info.name);
  ChunkInfo ch;
  ch.file = c["file"].get<std::string>();
  TS_CHECK(!ch.file.empty() && ch.file.find('/') == std::string::npos &&
               ch.file.find("..") == std::string::npos,
           "{}: chunk file '{}' of '{}' must be a plain file name in the checkpoint directory",
           file, ch.file, info.name);
  TS_CHECK(c.contains("offset") && c["offset"].is_number_unsigned() && c.contains("bytes") &&
               c["bytes"].is_number_unsigned() && c.contains("crc32c") &&
               c["crc32c"].is_number_unsigned(),
           "{}: a chunk of '{}' lacks offset, bytes or crc32c", file, info.name);
  ch.offset = c["offset"].get<uint64_t>();
  ch.bytes = c["bytes"].get<uint64_t>();
  TS_CHECK(c["crc32c"].get<uint64_t>() <= 0xffffffffull, "{}: bad crc32c for '{}'", file,
           info.name);
  ch.crc32c = c["crc32c"].get<uint32_t>();
  TS_CHECK(c.contains("offsets") && c.contains("shape"), "{}: a chunk of '{}' has no box", file,
           info.name);
  ch.offsets = read_shape(c["offsets"], file, "chunk offsets of '" + info.name + "'");
  ch.shape = read_shape(c["shape"], file, "chunk shape of '" + info.name + "'");
  TS_CHECK(ch.offsets.size() == info.shape.size() && ch.shape.size() == info.shape.size(),
           "{}: a chunk of '{}' has rank {} but the tensor has rank {}", file, info.name,
           ch.shape.size(), info.shape.size());
  uint64_t n = 1;
  for (size_t d = 0; d < info.shape.size(); ++d) {
    TS_CHECK(ch.offsets[d] + ch.shape[d] <= info.shape[d],
             "{}: a chunk of '{}' lies outside the tensor {}", file, info.name,
             shape_str(info.shape));
    n *= static_cast<uint64_t>(ch.shape[d]);
  }
  TS_CHECK(n * dtype_size(info.dtype) == ch.bytes,
           "{}: a chunk of '{}' holds {} bytes but its shape needs {}", file, info.name,
           ch.bytes, n * dtype_size(info.dtype));
  TS_CHECK(ch.offset >= kDataHeaderBytes, "{}: a chunk of '{}' overlaps the data file header",
           file, info.name);
  return ch;
}

// Disjoint boxes: with the element count checked by the caller, every element
// is stored exactly once (overlapping boxes would leave a hole that loads as
// stale memory). A sweep along dim 0 compares only chunks whose dim-0 ranges
// meet: O(C log C) for row-sharded layouts, however many ranks wrote it.
void check_disjoint(const TensorInfo& info, const std::string& file) {
  if (!info.shape.empty()) {
    std::vector<size_t> order;
    for (size_t i = 0; i < info.chunks.size(); ++i)
      if (shape_numel(info.chunks[i].shape) > 0) order.push_back(i);
    std::sort(order.begin(), order.end(),
              [&](size_t a, size_t b) { return info.chunks[a].offsets[0] < info.chunks[b].offsets[0]; });
    for (size_t x = 0; x < order.size(); ++x) {
      const ChunkInfo& a = info.chunks[order[x]];
      for (size_t y = x + 1; y < order.size(); ++y) {
        const ChunkInfo& b = info.chunks[order[y]];
        if (b.offsets[0] >= a.offsets[0] + a.shape[0]) break;  // sorted: no later chunk meets a
        bool overlap = true;
        for (size_t d = 1; d < info.shape.size() && overlap; ++d)
          overlap = std::max(a.offsets[d], b.offsets[d]) <
                    std::min(a.offsets[d] + a.shape[d], b.offsets[d] + b.shape[d]);
        size_t i = std::min(order[x], order[y]), j = std::max(order[x], order[y]);
        TS_CHECK(!overlap, "{}: chunks {} and {} of '{}' overlap (at offsets {} and {})", file, i,
                 j, info.name, shape_str(info.chunks[i].offsets), shape_str(info.chunks[j].offsets));
      }
    }
  }
}

// A tensor's placements as save_checkpoint writes them: "plain", or one
// placement per mesh dimension, "(R, S(0))", a shard dimension inside the
// tensor's rank ("S(0)x4": a blocked shard of 4 blocks). Partial tensors are
// never saved. Informational (a reader follows the chunks), but a checkpoint
// that cannot say how it was laid out is not one save_checkpoint wrote.
void check_placements(const std::string& text, const TensorInfo& info, const std::string& file) {
  if (text == "plain") return;
  const std::string expected = "'plain' or '(' placements ')' such as '(R, S(0))'";
  auto refuse = [&](const std::string& why) {
    TS_CHECK(false, "{}: tensor '{}' has placements '{}': {} (expected {})", file, info.name,
             text.substr(0, 80), why, expected);
  };
  if (text.size() < 3 || text.size() > 256 || text.front() != '(' || text.back() != ')')
    refuse("not a parenthesised list");
  // A non-negative integer at `at` of at most 9 digits; advances `at`.
  auto number = [&](size_t& at) {
    size_t start = at;
    while (at < text.size() && at - start < 10 && std::isdigit(static_cast<unsigned char>(text[at]))) ++at;
    if (at == start || at - start > 9) refuse("a shard dimension or block count is not a small integer");
    return std::stoll(text.substr(start, at - start));
  };
  size_t at = 1, count = 0;
  while (true) {
    if (++count > 16) refuse("more than 16 mesh dimensions");
    if (text[at] == 'R') {
      ++at;
    } else if (text.compare(at, 2, "S(") == 0) {
      at += 2;
      const int64_t dim = number(at);
      if (text[at] != ')') refuse("a shard placement is not closed");
      ++at;
      if (dim >= static_cast<int64_t>(info.shape.size()))
        refuse(fmt::format("dimension {} of a tensor of rank {}", dim, info.shape.size()));
      if (text[at] == 'x' && number(++at) < 1) refuse("a blocked shard of no blocks");
    } else if (text[at] == 'P') {
      refuse("a Partial tensor (save_checkpoint reduces it first)");
    } else {
      refuse(fmt::format("unknown placement at character {}", at));
    }
    if (at >= text.size()) refuse("the list is not closed");
    if (at == text.size() - 1) return;
    if (text.compare(at, 2, ", ") != 0) refuse(fmt::format("expected ', ' at character {}", at));
    at += 2;
    if (at >= text.size() - 1) refuse("an empty placement");
  }
}

// One entry of "tensors": name, dtype, shape, placements and chunks that
// cover every element exactly once.
TensorInfo parse_tensor(const json& t, const std::string& file) {
  TS_CHECK(t.is_object() && t.contains("name") && t["name"].is_string(),
           "{}: a tensor entry has no name", file);
  TensorInfo info;
  info.name = t["name"].get<std::string>();
  TS_CHECK(t.contains("dtype") && t["dtype"].is_string(), "{}: tensor '{}' has no dtype", file,
           info.name);
  try {
    info.dtype = dtype_from_name(t["dtype"].get<std::string>());
  } catch (const Error& e) {
    TS_CHECK(false, "{}: tensor '{}': {}", file, info.name, e.what());
  }
  TS_CHECK(t.contains("shape"), "{}: tensor '{}' has no shape", file, info.name);
  info.shape = read_shape(t["shape"], file, "shape of '" + info.name + "'");
  if (t.contains("placements")) {
    TS_CHECK(t["placements"].is_string(), "{}: tensor '{}' has placements of JSON type {} (expected a string)",
             file, info.name, t["placements"].type_name());
    info.placements = t["placements"].get<std::string>();
    check_placements(info.placements, info, file);
  }
  TS_CHECK(t.contains("chunks") && t["chunks"].is_array(), "{}: tensor '{}' has no chunks", file,
           info.name);
  uint64_t covered = 0;
  for (const auto& c : t["chunks"]) {
    ChunkInfo ch = parse_chunk(c, info, file);
    uint64_t n = ch.bytes / dtype_size(info.dtype);  // elements (parse_chunk checked bytes against the box)
    covered += n;
    info.chunks.push_back(ch);
  }
  TS_CHECK(covered == static_cast<uint64_t>(shape_numel(info.shape)),
           "{}: the chunks of '{}' cover {} of its {} elements", file, info.name, covered,
           shape_numel(info.shape));
  check_disjoint(info, file);
  return info;
}

}  // namespace

CheckpointMetadata parse_metadata(const std::string& text, const std::string& file) {
  check_json_nesting(text, file);  // before anything copies or prints a value (its "extra" above all)
  check_json_unique_keys(text, file);
  json md;
  try {
    md = json::parse(text);
  } catch (const json::exception& e) {
    TS_CHECK(false, "{}: checkpoint metadata is not valid JSON ({})", file, e.what());
  }
  TS_CHECK(md.is_object() && md.contains("magic") && md["magic"] == kMetadataMagic,
           "{}: not a Tessera checkpoint (missing or wrong magic)", file);
  TS_CHECK(md.contains("version") && md["version"].is_number_integer(),
           "{}: checkpoint version missing", file);
  TS_CHECK(md["version"].get<int64_t>() == kFormatVersion,
           "{}: checkpoint version {} (this build reads version {})", file,
           md["version"].get<int64_t>(), kFormatVersion);
  CheckpointMetadata out;
  TS_CHECK(md.contains("step") && md["step"].is_number_integer(), "{}: step missing", file);
  TS_CHECK(md["step"].is_number_unsigned() && md["step"].get<uint64_t>() <= INT64_MAX,
           "{}: step must be a count of steps (>= 0), got {}", file, md["step"].dump());
  out.step = md["step"].get<int64_t>();
  TS_CHECK(md.contains("world_size") && md["world_size"].is_number_unsigned() &&
               md["world_size"].get<uint64_t>() - 1 < (1u << 24),
           "{}: world_size missing or invalid", file);
  out.world_size = md["world_size"].get<int>();
  TS_CHECK(md.contains("tensors") && md["tensors"].is_array(), "{}: tensors missing", file);
  std::set<std::string> names;
  for (const auto& t : md["tensors"]) {
    out.tensors.push_back(parse_tensor(t, file));
    TS_CHECK(names.insert(out.tensors.back().name).second,
             "{}: tensor '{}' is described twice (entries {} and {} of tensors)", file, out.tensors.back().name,
             std::find_if(out.tensors.begin(), out.tensors.end(),
                          [&](const TensorInfo& i) { return i.name == out.tensors.back().name; }) -
                 out.tensors.begin(),
             out.tensors.size() - 1);
  }
  if (md.contains("extra")) {
    TS_CHECK(md["extra"].is_object(), "{}: extra must be an object, got {}", file,
             md["extra"].type_name());
    out.extra_json = md["extra"].dump();
  }
  if (md.contains("rank_state")) {
    TS_CHECK(md["rank_state"].is_array(), "{}: rank_state must be an array", file);
    for (const auto& r : md["rank_state"]) {
      // Each rank's random stream: {"seed": unsigned, "offset": integer >= 0}.
      TS_CHECK(r.is_object() && r.contains("seed") && r["seed"].is_number_unsigned() &&
                   r.contains("offset") && r["offset"].is_number_unsigned() &&
                   r["offset"].get<uint64_t>() <= INT64_MAX,
               "{}: rank_state entry {} must be {{\"seed\": unsigned, \"offset\": unsigned}}, "
               "got {}",
               file, out.rank_state.size(), r.dump());
      out.rank_state.push_back(r.dump());
    }
    // save_checkpoint records one stream per rank that saved.
    TS_CHECK(out.rank_state.size() == static_cast<size_t>(out.world_size),
             "{}: rank_state holds {} ranks' random streams but the checkpoint was saved by world_size {}", file,
             out.rank_state.size(), out.world_size);
  }
  return out;
}

CheckpointMetadata read_metadata(const std::string& dir) {
  fs::path p = fs::path(dir) / "metadata.json";
  std::error_code ec;
  TS_CHECK(fs::is_regular_file(p, ec),
           "{}: no checkpoint metadata (an incomplete or missing checkpoint)", p.string());
  // Metadata grows with tensors x ranks (about 200 bytes a chunk): 1 GiB is
  // millions of chunks. Checked before the text is read.
  constexpr uint64_t kMaxMetadataBytes = 1ull << 30;
  uint64_t bytes = fs::file_size(p, ec);
  TS_CHECK(!ec && bytes <= kMaxMetadataBytes,
           "{}: checkpoint metadata of {} bytes exceeds the limit of {}", p.string(), bytes,
           kMaxMetadataBytes);
  std::ifstream in(p);
  TS_CHECK(in.good(), "{}: cannot read the checkpoint metadata", p.string());
  std::stringstream ss;
  ss << in.rdbuf();
  CheckpointMetadata md = parse_metadata(ss.str(), p.string());
  // A checkpoint's folder is named after its step (step-00000123): the two must agree.
  std::string folder = fs::path(dir).lexically_normal().filename().string();
  if (folder.empty()) folder = fs::path(dir).lexically_normal().parent_path().filename().string();
  if (folder.size() > 5 && folder.rfind("step-", 0) == 0 &&
      folder.find_first_not_of("0123456789", 5) == std::string::npos) {
    uint64_t named = 0;
    bool fits = folder.size() - 5 <= 18;
    if (fits) named = std::stoull(folder.substr(5));
    TS_CHECK(fits, "{}: the folder name '{}' holds a step of more than 18 digits, which no checkpoint has",
             p.string(), folder);
    TS_CHECK(named == static_cast<uint64_t>(md.step),
             "{}: step {} does not match the checkpoint's folder name '{}'", p.string(), md.step,
             folder);
  }
  return md;
}

namespace {
std::atomic<uint64_t> g_bytes_read{0};

// A chunk's bytes must lie inside its data file; checked before anything the
// chunk's size claims is allocated.
void check_chunk_in_file(const fs::path& p, const TensorInfo& tensor, const ChunkInfo& chunk) {
  std::error_code ec;
  TS_CHECK(fs::exists(p, ec), "{}: missing data file (tensor '{}')", p.string(), tensor.name);
  // A pipe or a device in its place would block the reader or never end.
  TS_CHECK(fs::is_regular_file(p, ec), "{}: the data file of tensor '{}' is not a regular file", p.string(),
           tensor.name);
  uint64_t size = fs::file_size(p, ec);
  TS_CHECK(!ec, "{}: cannot read the data file of tensor '{}' ({})", p.string(), tensor.name, ec.message());
  TS_CHECK(chunk.bytes <= size && chunk.offset <= size - chunk.bytes,
           "{}: truncated: tensor '{}' needs bytes [{}, {}) but the file has {}", p.string(),
           tensor.name, chunk.offset, chunk.offset + chunk.bytes, size);
}
}  // namespace

uint64_t checkpoint_bytes_read() { return g_bytes_read.load(); }

Tensor read_chunk(const std::string& dir, const TensorInfo& tensor, const ChunkInfo& chunk) {
  fs::path p = fs::path(dir) / chunk.file;
  check_chunk_in_file(p, tensor, chunk);  // before opening: a pipe blocks the open
  std::ifstream in(p, std::ios::binary);
  TS_CHECK(in.good(), "{}: missing data file (tensor '{}')", p.string(), tensor.name);
  char header[kDataHeaderBytes];
  in.read(header, kDataHeaderBytes);
  TS_CHECK(in.gcount() == static_cast<std::streamsize>(kDataHeaderBytes) &&
               std::memcmp(header, kDataMagic, 8) == 0,
           "{}: not a Tessera checkpoint data file (bad magic)", p.string());
  uint32_t version;
  std::memcpy(&version, header + 8, 4);
  TS_CHECK(version == kFormatVersion, "{}: data file version {} (this build reads {})", p.string(),
           version, kFormatVersion);
  Tensor t = empty(chunk.shape, tensor.dtype);
  if (chunk.bytes) {
    in.seekg(static_cast<std::streamoff>(chunk.offset));
    in.read(static_cast<char*>(t.host_data_ptr()), static_cast<std::streamsize>(chunk.bytes));
    TS_CHECK(in.gcount() == static_cast<std::streamsize>(chunk.bytes),
             "{}: short read of tensor '{}'", p.string(), tensor.name);
  }
  g_bytes_read.fetch_add(chunk.bytes, std::memory_order_relaxed);
  uint32_t crc = chunk.bytes ? crc32c(t.host_data_ptr(), chunk.bytes) : 0;
  TS_CHECK(crc == chunk.crc32c,
           "{}: checksum mismatch in tensor '{}' (chunk at offset {}): the file is corrupt",
           p.string(), tensor.name, chunk.offset);
  return t;
}

std::optional<std::pair<Shape, Shape>> chunk_overlap(const ChunkInfo& chunk, const Shape& start, const Shape& extent) {
  if (shape_numel(extent) == 0) return std::nullopt;
  Shape lo(start.size()), len(start.size());
  for (size_t d = 0; d < start.size(); ++d) {
    lo[d] = std::max(start[d], chunk.offsets[d]);
    len[d] = std::min(start[d] + extent[d], chunk.offsets[d] + chunk.shape[d]) - lo[d];
    if (len[d] <= 0) return std::nullopt;
  }
  return std::make_pair(lo, len);
}

Tensor read_full_tensor(const std::string& dir, const TensorInfo& tensor) {
  // Every chunk's bytes must be in its data file before the whole tensor is
  // allocated: metadata that claims a huge shape is refused, not zero-filled.
  for (const auto& ch : tensor.chunks) check_chunk_in_file(fs::path(dir) / ch.file, tensor, ch);
  // The chunks cover every element exactly once (parse_metadata checked the
  // count and that no two boxes overlap), so nothing is left unwritten.
  Tensor out = empty(tensor.shape, tensor.dtype);
  for (const auto& ch : tensor.chunks) {
    Tensor data = read_chunk(dir, tensor, ch);
    Tensor dst = out;
    for (size_t d = 0; d < ch.offsets.size(); ++d)
      dst = ops::narrow(dst, static_cast<int64_t>(d), ch.offsets[d], ch.shape[d]);
    ops::copy_(dst, data);
  }
  return out;
}

}  // namespace tessera::fsdp
