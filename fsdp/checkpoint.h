// Distributed checkpoints.
//
//   <folder>/step-00000100/rank-00000.bin ... rank-0000N.bin   each rank's shards
//   <folder>/step-00000100/metadata.json                        what is where
//   <folder>/latest                                             the newest step
//
// Every rank writes its own shards in parallel (a piece several ranks hold,
// as HSDP's replicas do, is written once, by the lowest of them; a pipeline's
// ranks each write their stages' tensors). metadata.json
// records, per tensor, its global shape, dtype and placements, and per chunk
// the file, byte offset, byte size, the chunk's box in the global tensor and
// its CRC-32C. Loading on any mesh (another world size, 1-D <-> 2-D, a single
// process) reads only the chunks that overlap each rank's shard.
//
// A checkpoint appears only when complete: ranks write into step-N.tmp/,
// fsync, meet at a barrier, rank 0 writes metadata.json and renames the
// directory (one atomic rename). An interrupted save leaves at most a .tmp
// directory, which loading ignores and the next save removes; older complete
// checkpoints stay loadable; the newest `keep` are kept.
//
// Data files start with the magic "TSRCKPT" and a version; every read is
// bounds-checked and checksummed, and metadata is validated as untrusted
// input: a truncated file, a flipped byte, a wrong magic or version, or
// metadata that disagrees with the model is an exception naming the file and
// the tensor.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "nn/module.h"
#include "nn/optim.h"

namespace tessera::fsdp {

struct ChunkInfo {
  std::string file;     // a file name inside the checkpoint directory
  uint64_t offset = 0;  // byte offset in that file
  uint64_t bytes = 0;
  Shape offsets;        // where the chunk starts in the global tensor
  Shape shape;          // the chunk's shape
  uint32_t crc32c = 0;  // CRC-32C (Castagnoli) of the bytes
};

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  Shape shape;             // global
  std::string placements;  // as saved ("(S(0))", "(R, S(0))", "plain"); informational
  std::vector<ChunkInfo> chunks;
};

struct CheckpointMetadata {
  int64_t step = 0;
  int world_size = 1;
  std::vector<TensorInfo> tensors;
  std::string extra_json = "{}";  // the training state besides tensors (scheduler, data, config)
  std::vector<std::string> rank_state;  // per saving rank: its RNG state (JSON)
  const TensorInfo* find(const std::string& name) const;
};

// Saves the model's state dict and (if given) the optimizer's as
// "optim.<name>.exp_avg" etc. Collective: every rank calls it. Returns the
// checkpoint directory.
// The largest step a checkpoint folder can be named after and read back
// (step-N with at most 18 digits).
inline constexpr int64_t kMaxCheckpointStep = 999'999'999'999'999'999;
std::string save_checkpoint(const std::string& folder, int64_t step, nn::Module& model,
                            optim::AdamW* optimizer, const std::string& extra_json = "{}",
                            int keep = 0);
// The same for any state dict (DTensors and plain tensors; tessera-ckpt
// converts files with it).
std::string save_checkpoint(const std::string& folder, int64_t step, const nn::StateDict& tensors,
                            const std::string& extra_json = "{}", int keep = 0);
// Asynchronous saves (TorchTitan's checkpoint.async_mode "async"): save()
// copies this rank's pieces into host staging buffers (kept and reused by the
// next save), starts a thread, and returns: training goes on while the
// thread does the rest of save_checkpoint's work, collectives included, on
// a process group of its own ("checkpoint"): the plan (who writes what), the
// data file, the chunk lists, and rank 0's commit (metadata.json, the atomic
// rename, `latest`) once every rank's file is written. The files, checksums
// and crash-safety are save_checkpoint's to the byte. The training loop
// takes part in no collective of a save after the first (prepare(): the
// group, the plan, the buffers): which pieces a rank stages comes from the
// plan of the previous save of the same layout, and the thread checks it
// against the new one (a rank whose tensors changed stages all it holds).
// A failure anywhere (a full disk on one rank) is shared by the threads and
// thrown by poll() or wait() on every rank, and nothing is marked complete;
// a process killed mid-write leaves the previous checkpoint the latest.
struct SavePiece;
struct SavePlan;
class AsyncCheckpointer {
 public:
  AsyncCheckpointer();
  // Joins a finished writer. One still running (this rank is failing, and
  // its peers may never answer) is left to end on its own, or with the process.
  ~AsyncCheckpointer();
  AsyncCheckpointer(const AsyncCheckpointer&) = delete;
  AsyncCheckpointer& operator=(const AsyncCheckpointer&) = delete;
  // Collective, once (the first save() calls it if nobody did): the
  // checkpoint group, the plan of who writes what, and the staging buffers,
  // so that no save pays for them inside the training loop. Returns the
  // bytes of this rank's staging buffers.
  int64_t prepare(nn::Module& model, optim::AdamW* optimizer);
  // Every rank calls it, in the same order; it communicates with no rank
  // (after prepare). Waits for the previous save first; returns the seconds
  // the caller was held (staging: the training loop's stall).
  double save(const std::string& folder, int64_t step, nn::Module& model, optim::AdamW* optimizer,
              const std::string& extra_json = "{}", int keep = 0);
  // This rank's view, no collective: the pending save's directory once it is
  // committed (every rank's thread knows then), else "" (none pending, or
  // still writing). Throws the save's failure, as every rank does.
  std::string poll();
  // Blocks until the pending save is committed (or failed: throws) and
  // returns its directory ("" when none was pending).
  std::string wait();
  bool pending() const;
  int64_t pending_step() const;                            // -1 when none
  double last_write_seconds() const { return last_write_seconds_; }  // the last committed save's writing

  // Internal (fsdp/checkpoint.cpp): a save in flight, shared with the
  // thread; the group, the last plan and the thread.
  struct Pending;
  struct Layout;

 private:
  std::string complete();
  std::shared_ptr<Pending> pending_;  // shared with its thread
  std::shared_ptr<Layout> layout_;    // the checkpoint group and the last plan
  std::map<std::pair<std::string, Shape>, Tensor> staging_;  // host buffers, by (tensor, box offset)
  double last_write_seconds_ = 0;
};

// The newest complete checkpoint directory in folder ("" if there is none).
std::string latest_checkpoint(const std::string& folder);
// Every complete checkpoint in folder as (step, directory), by step.
std::vector<std::pair<int64_t, std::string>> complete_checkpoints(const std::string& folder);
// Loads into the model (any mesh; under a pipeline each rank's model holds
// its stages' tensors, and a saved tensor no rank's model holds is
// unexpected) and optimizer; restores this rank's RNG
// when the world size matches. Returns the metadata (step, extra state).
// Saved and model dtypes must agree unless convert_dtypes (weights for a new
// run or for inference: a bf16 checkpoint into an f32 model, and back).
CheckpointMetadata load_checkpoint(const std::string& dir, nn::Module& model,
                                   optim::AdamW* optimizer, bool convert_dtypes = false);

// Reads and validates <dir>/metadata.json.
CheckpointMetadata read_metadata(const std::string& dir);
// Validates metadata text as untrusted input (`file` names it in errors).
CheckpointMetadata parse_metadata(const std::string& text, const std::string& file);
// Reads one chunk (header, bounds and checksum checked) as a tensor of its shape.
Tensor read_chunk(const std::string& dir, const TensorInfo& tensor, const ChunkInfo& chunk);
// Tensor bytes this process has read from checkpoint data files so far (a
// resharding load reads only the chunks that overlap its shards).
uint64_t checkpoint_bytes_read();

// Where a saved chunk meets the box [start, start + extent) of its tensor:
// the common part's global start and length per dim (none when they do not
// meet, or the box is empty). What a load reads (load_checkpoint, and
// tessera-ckpt read-plan, which prints it).
std::optional<std::pair<Shape, Shape>> chunk_overlap(const ChunkInfo& chunk, const Shape& start, const Shape& extent);

// One whole tensor assembled from all its chunks (each checked).
Tensor read_full_tensor(const std::string& dir, const TensorInfo& tensor);

// CRC-32C (Castagnoli; the SSE4.2 instruction where the build has it).
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);
namespace detail {
uint32_t crc32c_software(const void* data, size_t n, uint32_t crc = 0);  // the portable path
}

}  // namespace tessera::fsdp
