#include "fsdp/checkpoint.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "dtensor/dtensor.h"
#include "runtime/random.h"

namespace tessera::fsdp {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr char kMagic[8] = {'T', 'S', 'R', 'C', 'K', 'P', 'T', '\0'};
constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderBytes = 16;  // magic, version, rank
const char* kMetadataMagic = "tessera-checkpoint";

std::string step_dir_name(int64_t step) {
  return fmt::format("step-{:08d}", step);
}

// Writes a whole buffer, retrying short writes; fsyncs; closes.
class DataFile {
 public:
  DataFile(const std::string& path, int rank) : path_(path) {
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    TS_CHECK(fd_ >= 0, "checkpoint: cannot create '{}': {}", path, std::strerror(errno));
    char header[kHeaderBytes];
    std::memcpy(header, kMagic, 8);
    uint32_t v = kVersion, r = static_cast<uint32_t>(rank);
    std::memcpy(header + 8, &v, 4);
    std::memcpy(header + 12, &r, 4);
    write(header, kHeaderBytes);
    // Test hook: a rank that kills itself mid-save (see tests/fsdp/checkpoint_test.sh).
    if (const char* kr = std::getenv("TESSERA_CHECKPOINT_KILL_RANK"); kr && std::atoi(kr) == rank)
      if (const char* after = std::getenv("TESSERA_CHECKPOINT_KILL_AFTER"))
        kill_after_ = std::atoll(after);
  }
  ~DataFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  uint64_t size() const { return size_; }
  void write(const void* data, size_t n) {
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
  void finish() {
    TS_CHECK(::fsync(fd_) == 0, "checkpoint: fsync of '{}' failed: {}", path_,
             std::strerror(errno));
    ::close(fd_);
    fd_ = -1;
  }

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
  int64_t kill_after_ = -1;
};

void fsync_path(const fs::path& p) {
  int fd = ::open(p.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

void write_file_atomically(const fs::path& path, const std::string& text) {
  fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    TS_CHECK(out.good(), "checkpoint: cannot write '{}'", tmp.string());
    out << text;
    out.flush();
    TS_CHECK(out.good(), "checkpoint: writing '{}' failed (disk full?)", tmp.string());
  }
  fsync_path(tmp);
  fs::rename(tmp, path);
}

// Every tensor a checkpoint holds: the model's state dict and the optimizer's (prefixed).
nn::StateDict tensors_of(nn::Module& model, optim::AdamW* opt, bool create_optimizer_state) {
  nn::StateDict all = model.state_dict();
  if (opt) {
    if (create_optimizer_state) opt->init_state();
    auto named = model.named_parameters();
    for (auto& [k, v] : opt->state_dict(named)) all.emplace_back("optim." + k, v);
  }
  return all;
}

std::string placements_of(const Tensor& t) {
  return t.is_distributed() ? placements_str(dtensor_spec(t).placements) : "plain";
}

json shape_json(const Shape& s) {
  return json(std::vector<int64_t>(s.begin(), s.end()));
}

void prune(const fs::path& folder, int keep) {
  std::vector<std::pair<int64_t, fs::path>> complete;
  for (const auto& e : fs::directory_iterator(folder)) {
    std::string n = e.path().filename().string();
    if (!e.is_directory() || n.rfind("step-", 0) != 0 || n.size() < 6) continue;
    if (n.find(".tmp") != std::string::npos) continue;
    if (!fs::exists(e.path() / "metadata.json")) continue;
    try {
      complete.emplace_back(std::stoll(n.substr(5)), e.path());
    } catch (const std::exception&) {
    }
  }
  std::sort(complete.begin(), complete.end());
  while (keep > 0 && static_cast<int>(complete.size()) > keep) {
    fs::remove_all(complete.front().second);
    complete.erase(complete.begin());
  }
}

}  // namespace

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

namespace {

// Writes the chunks this rank owns into tmp_dir/file_name (fsynced) and
// returns their descriptions. A DTensor's shard is owned by the rank at
// coordinate 0 of every replicate dim; a plain tensor by rank 0.
json write_own_chunks(const fs::path& tmp_dir, const std::string& file_name, int rank,
                      const nn::StateDict& tensors) {
  json chunks = json::array();
  DataFile file((tmp_dir / file_name).string(), rank);
  for (const auto& [name, t] : tensors) {
    Tensor local = t;
    Shape offsets(static_cast<size_t>(t.dim()), 0);
    bool owner = rank == 0;
    if (t.is_distributed()) {
      const DTensorSpec& spec = dtensor_spec(t);
      owner = true;
      for (size_t i = 0; i < spec.placements.size(); ++i) {
        TS_CHECK(!is_partial(spec.placements[i]),
                 "save_checkpoint: '{}' is a Partial DTensor; reduce it first", name);
        if (is_replicate(spec.placements[i]) &&
            spec.mesh->get_local_rank(static_cast<int64_t>(i)) != 0)
          owner = false;
      }
      local = spec.local;
      auto box = local_shape_and_offset(spec.global_shape, *spec.mesh, spec.placements,
                                        spec.mesh->get_coordinate());
      offsets = box.second;
    }
    if (!owner) continue;
    Tensor c = ops::contiguous(local);
    uint64_t bytes = c.nbytes();
    uint64_t at = file.size();
    if (bytes) file.write(c.data_ptr(), bytes);
    chunks.push_back({{"tensor", name},
                      {"file", file_name},
                      {"offset", at},
                      {"bytes", bytes},
                      {"offsets", shape_json(offsets)},
                      {"shape", shape_json(c.shape())},
                      {"crc32c", bytes ? crc32c(c.data_ptr(), bytes) : 0u}});
  }
  file.finish();
  return chunks;
}

// Rank 0: merges every rank's chunk lists into metadata.json, then commits
// the checkpoint with one atomic rename, updates `latest` and prunes.
void commit(const fs::path& folder, const fs::path& tmp_dir, const fs::path& final_dir,
            int64_t step, int world_size, const nn::StateDict& tensors,
            const std::vector<json>& per_rank, const std::string& extra_json, int keep) {
  std::map<std::string, json> chunks_of;
  for (const auto& r : per_rank)
    for (const auto& c : r["chunks"]) {
      json chunk = c;
      chunk.erase("tensor");
      auto [it, fresh] = chunks_of.try_emplace(c["tensor"].get<std::string>(), json::array());
      it->second.push_back(std::move(chunk));
    }
  json tensors_json = json::array();
  for (const auto& [name, t] : tensors) {
    json chunks = chunks_of.count(name) ? chunks_of[name] : json::array();
    int64_t covered = 0;
    for (const auto& c : chunks) {
      int64_t n = 1;
      for (const auto& d : c["shape"]) n *= d.get<int64_t>();
      covered += n;
    }
    TS_CHECK(covered == t.numel(), "save_checkpoint: the chunks of '{}' cover {} of {} elements",
             name, covered, t.numel());
    tensors_json.push_back({{"name", name},
                            {"dtype", dtype_name(t.dtype())},
                            {"shape", shape_json(t.shape())},
                            {"placements", placements_of(t)},
                            {"chunks", std::move(chunks)}});
  }
  json rank_state = json::array();
  for (const auto& r : per_rank) rank_state.push_back(r["rng"]);
  json md = {
      {"magic", kMetadataMagic},  {"version", kVersion},     {"step", step},
      {"world_size", world_size}, {"tensors", tensors_json}, {"extra", json::parse(extra_json)},
      {"rank_state", rank_state}};
  write_file_atomically(tmp_dir / "metadata.json", md.dump(1));
  fsync_path(tmp_dir);
  if (fs::exists(final_dir)) fs::remove_all(final_dir);
  fs::rename(tmp_dir, final_dir);  // the commit point
  fsync_path(folder);
  write_file_atomically(folder / "latest", step_dir_name(step) + "\n");
  prune(folder, keep);
}

}  // namespace

std::string save_checkpoint(const std::string& folder, int64_t step, nn::Module& model,
                            optim::AdamW* opt, const std::string& extra_json, int keep) {
  autograd::NoGradGuard no_grad;
  return save_checkpoint(folder, step, tensors_of(model, opt, false), extra_json, keep);
}

std::string save_checkpoint(const std::string& folder_in, int64_t step, const nn::StateDict& tensors,
                            const std::string& extra_json, int keep) {
  autograd::NoGradGuard no_grad;
  auto world = dist::world();
  int rank = dist::rank();
  fs::path folder(folder_in);
  fs::path final_dir = folder / step_dir_name(step);
  fs::path tmp_dir = folder / (step_dir_name(step) + ".tmp");
  TS_CHECK(json::accept(extra_json), "save_checkpoint: extra state is not valid JSON");

  // 1. Rank 0 clears leftovers of interrupted saves and creates step-N.tmp/.
  std::string error;
  if (rank == 0) {
    try {
      fs::create_directories(folder);
      for (const auto& e : fs::directory_iterator(folder))
        if (e.is_directory() && e.path().filename().string().find(".tmp") != std::string::npos)
          fs::remove_all(e.path());
      fs::create_directories(tmp_dir);
    } catch (const std::exception& e) {
      error = fmt::format("cannot prepare '{}': {}", tmp_dir.string(), e.what());
    }
  }
  dist::throw_if_any_failed(world, error, "save_checkpoint");

  // 2. Every rank writes its own file in parallel.
  json chunks = json::array();
  try {
    chunks = write_own_chunks(tmp_dir, fmt::format("rank-{:05d}.bin", rank), rank, tensors);
  } catch (const std::exception& e) {
    error = e.what();
  }

  // 3. Chunk lists, RNG states and errors to every rank; any error fails all.
  Generator& gen = default_generator();
  json mine = {{"chunks", chunks},
               {"rng", {{"seed", gen.seed()}, {"offset", gen.offset()}}},
               {"error", error}};
  std::vector<json> per_rank;
  for (const auto& text : dist::all_gather_strings(world, mine.dump()))
    per_rank.push_back(json::parse(text));
  for (size_t r = 0; r < per_rank.size(); ++r) {
    std::string e = per_rank[r]["error"].get<std::string>();
    TS_CHECK(e.empty(),
             "save_checkpoint failed on rank {}: {} (the previous checkpoint is untouched)", r, e);
  }

  // 4. Rank 0 writes the metadata and commits.
  if (rank == 0) {
    try {
      commit(folder, tmp_dir, final_dir, step, world->size(), tensors, per_rank, extra_json, keep);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  dist::throw_if_any_failed(world, error, "save_checkpoint");
  return final_dir.string();
}

std::string latest_checkpoint(const std::string& folder) {
  if (!fs::is_directory(folder)) return "";
  std::vector<std::pair<int64_t, std::string>> complete;
  for (const auto& e : fs::directory_iterator(folder)) {
    std::string n = e.path().filename().string();
    if (!e.is_directory() || n.rfind("step-", 0) != 0 || n.find(".tmp") != std::string::npos)
      continue;
    if (!fs::exists(e.path() / "metadata.json")) continue;
    try {
      complete.emplace_back(std::stoll(n.substr(5)), e.path().string());
    } catch (const std::exception&) {
    }
  }
  if (complete.empty()) return "";
  return std::max_element(complete.begin(), complete.end())->second;
}

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

CheckpointMetadata parse_metadata(const std::string& text, const std::string& file) {
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
  TS_CHECK(md["version"].get<int64_t>() == kVersion,
           "{}: checkpoint version {} (this build reads version {})", file,
           md["version"].get<int64_t>(), kVersion);
  CheckpointMetadata out;
  TS_CHECK(md.contains("step") && md["step"].is_number_integer(), "{}: step missing", file);
  out.step = md["step"].get<int64_t>();
  TS_CHECK(md.contains("world_size") && md["world_size"].is_number_unsigned() &&
               md["world_size"].get<uint64_t>() - 1 < (1u << 24),
           "{}: world_size missing or invalid", file);
  out.world_size = md["world_size"].get<int>();
  TS_CHECK(md.contains("tensors") && md["tensors"].is_array(), "{}: tensors missing", file);
  for (const auto& t : md["tensors"]) {
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
    if (t.contains("placements") && t["placements"].is_string())
      info.placements = t["placements"].get<std::string>();
    TS_CHECK(t.contains("chunks") && t["chunks"].is_array(), "{}: tensor '{}' has no chunks", file,
             info.name);
    uint64_t covered = 0;
    for (const auto& c : t["chunks"]) {
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
      TS_CHECK(ch.offset >= kHeaderBytes, "{}: a chunk of '{}' overlaps the data file header", file,
               info.name);
      covered += n;
      info.chunks.push_back(ch);
    }
    TS_CHECK(covered == static_cast<uint64_t>(shape_numel(info.shape)),
             "{}: the chunks of '{}' cover {} of its {} elements", file, info.name, covered,
             shape_numel(info.shape));
    out.tensors.push_back(std::move(info));
  }
  if (md.contains("extra")) out.extra_json = md["extra"].dump();
  if (md.contains("rank_state") && md["rank_state"].is_array())
    for (const auto& r : md["rank_state"]) out.rank_state.push_back(r.dump());
  return out;
}

CheckpointMetadata read_metadata(const std::string& dir) {
  fs::path p = fs::path(dir) / "metadata.json";
  std::ifstream in(p);
  TS_CHECK(in.good(), "{}: no checkpoint metadata (an incomplete or missing checkpoint)",
           p.string());
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_metadata(ss.str(), p.string());
}

Tensor read_chunk(const std::string& dir, const TensorInfo& tensor, const ChunkInfo& chunk) {
  fs::path p = fs::path(dir) / chunk.file;
  std::ifstream in(p, std::ios::binary);
  TS_CHECK(in.good(), "{}: missing data file (tensor '{}')", p.string(), tensor.name);
  char header[kHeaderBytes];
  in.read(header, kHeaderBytes);
  TS_CHECK(in.gcount() == static_cast<std::streamsize>(kHeaderBytes) &&
               std::memcmp(header, kMagic, 8) == 0,
           "{}: not a Tessera checkpoint data file (bad magic)", p.string());
  uint32_t version;
  std::memcpy(&version, header + 8, 4);
  TS_CHECK(version == kVersion, "{}: data file version {} (this build reads {})", p.string(),
           version, kVersion);
  std::error_code ec;
  uint64_t size = fs::file_size(p, ec);
  TS_CHECK(!ec && chunk.bytes <= size && chunk.offset <= size - chunk.bytes,
           "{}: truncated: tensor '{}' needs bytes [{}, {}) but the file has {}", p.string(),
           tensor.name, chunk.offset, chunk.offset + chunk.bytes, size);
  Tensor t = empty(chunk.shape, tensor.dtype);
  if (chunk.bytes) {
    in.seekg(static_cast<std::streamoff>(chunk.offset));
    in.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(chunk.bytes));
    TS_CHECK(in.gcount() == static_cast<std::streamsize>(chunk.bytes),
             "{}: short read of tensor '{}'", p.string(), tensor.name);
  }
  uint32_t crc = chunk.bytes ? crc32c(t.data_ptr(), chunk.bytes) : 0;
  TS_CHECK(crc == chunk.crc32c,
           "{}: checksum mismatch in tensor '{}' (chunk at offset {}): the file is corrupt",
           p.string(), tensor.name, chunk.offset);
  return t;
}

namespace {
CheckpointMetadata load_checkpoint_on_this_rank(const std::string& dir, nn::Module& model,
                                                optim::AdamW* opt, nn::StateDict& dest);
}

Tensor read_full_tensor(const std::string& dir, const TensorInfo& tensor) {
  Tensor out = zeros(tensor.shape, tensor.dtype);
  for (const auto& ch : tensor.chunks) {
    Tensor data = read_chunk(dir, tensor, ch);
    Tensor dst = out;
    for (size_t d = 0; d < ch.offsets.size(); ++d)
      dst = ops::narrow(dst, static_cast<int64_t>(d), ch.offsets[d], ch.shape[d]);
    ops::copy_(dst, data);
  }
  return out;
}

CheckpointMetadata load_checkpoint(const std::string& dir, nn::Module& model, optim::AdamW* opt) {
  autograd::NoGradGuard no_grad;
  // The destinations (optimizer moments created) before anything can fail, so
  // that every rank takes part in the same collectives.
  nn::StateDict dest = tensors_of(model, opt, true);
  CheckpointMetadata md;
  std::string error;
  try {
    md = load_checkpoint_on_this_rank(dir, model, opt, dest);
  } catch (const std::exception& e) {
    error = e.what();
  }
  dist::throw_if_any_failed(dist::world(), error, "load_checkpoint");
  for (auto& [p, m] : model.named_modules())
    if (m->extension) m->extension->after_load_state_dict(*m);
  return md;
}

namespace {
CheckpointMetadata load_checkpoint_on_this_rank(const std::string& dir, nn::Module& model,
                                                optim::AdamW* opt, nn::StateDict& dest) {
  CheckpointMetadata md = read_metadata(dir);
  std::string md_file = (fs::path(dir) / "metadata.json").string();
  // Every model tensor must be in the checkpoint; optimizer state may be absent
  // (a parameter that had not stepped yet) and then starts fresh.
  std::vector<std::string> missing, unexpected;
  for (const auto& [name, t] : dest)
    if (name.rfind("optim.", 0) != 0 && md.find(name) == nullptr) missing.push_back(name);
  for (const auto& t : md.tensors)  // optimizer state is skipped when loading weights only
    if (nn::find_in(dest, t.name) == nullptr && (opt || t.name.rfind("optim.", 0) != 0))
      unexpected.push_back(t.name);
  TS_CHECK(missing.empty() && unexpected.empty(),
           "{}: the checkpoint does not match the model{}: missing keys [{}]; unexpected keys [{}]",
           md_file, opt ? " and optimizer" : "", nn::key_list(missing), nn::key_list(unexpected));
  for (auto& [name, t] : dest) {
    const TensorInfo* info = md.find(name);
    if (info == nullptr) continue;  // optimizer moments of a parameter that had not stepped
    TS_CHECK(info->shape == t.shape(),
             "{}: tensor '{}' is {} in the checkpoint but {} in the model", md_file, name,
             shape_str(info->shape), shape_str(t.shape()));
    TS_CHECK(info->dtype == t.dtype(),
             "{}: tensor '{}' is {} in the checkpoint but {} in the model", md_file, name,
             dtype_name(info->dtype), dtype_name(t.dtype()));
    // This rank's box of the tensor, and the saved chunks overlapping it.
    Tensor local = t;
    Shape start(t.shape().size(), 0), extent = t.shape();
    if (t.is_distributed()) {
      const DTensorSpec& spec = dtensor_spec(t);
      local = spec.local;
      auto [ls, off] = local_shape_and_offset(spec.global_shape, *spec.mesh, spec.placements,
                                              spec.mesh->get_coordinate());
      start = off;
      extent = ls;
    }
    for (const auto& ch : info->chunks) {
      Shape lo(start.size()), len(start.size());
      bool overlap = true;
      for (size_t d = 0; d < start.size(); ++d) {
        lo[d] = std::max(start[d], ch.offsets[d]);
        int64_t hi = std::min(start[d] + extent[d], ch.offsets[d] + ch.shape[d]);
        len[d] = hi - lo[d];
        if (len[d] <= 0) overlap = false;
      }
      if (!overlap && shape_numel(extent) > 0) continue;
      if (shape_numel(extent) == 0) break;
      Tensor data = read_chunk(dir, *info, ch);
      Tensor src = data, dst = local;
      for (size_t d = 0; d < start.size(); ++d) {
        src = ops::narrow(src, static_cast<int64_t>(d), lo[d] - ch.offsets[d], len[d]);
        dst = ops::narrow(dst, static_cast<int64_t>(d), lo[d] - start[d], len[d]);
      }
      ops::copy_(dst, src);
    }
  }
  if (opt) {
    // Moments were filled in place; the step scalars were read into their copies.
    nn::StateDict state;
    for (auto& [k, v] : dest)
      if (k.rfind("optim.", 0) == 0) state.emplace_back(k.substr(6), v);
    opt->load_state_dict(state, model.named_parameters());
  }
  if (md.world_size == dist::world_size() &&
      static_cast<int>(md.rank_state.size()) > dist::rank()) {
    json rng = json::parse(md.rank_state[static_cast<size_t>(dist::rank())]);
    if (rng.contains("seed") && rng.contains("offset")) {
      default_generator().manual_seed(rng["seed"].get<uint64_t>());
      default_generator().set_offset(rng["offset"].get<int64_t>());
    }
  }
  return md;
}

}  // namespace

}  // namespace tessera::fsdp
