// Coverage-guided fuzzing (libFuzzer, clang) of every reader of untrusted
// input: llm.c token shards, checkpoint metadata, checkpoint data files,
// safetensors files, tessera-train's TOML configuration, tokenizer.json
// with the text it encodes, a Hugging Face folder's config.json and
// model.safetensors.index.json, and hardware descriptions. One program, the
// reader chosen by FUZZ_TARGET (shards | metadata | datafile | safetensors |
// toml | tokenizer | hf | hardware); the readers' sources are compiled into it with the fuzzer's coverage
// and AddressSanitizer + UBSan (tests/fuzz/libfuzzer.sh builds and runs it).
//
// Every input must be accepted or refused with a tessera::Error. Anything else
// (another exception, a crash, a sanitizer report, a leak, a refusal that
// allocated more than libFuzzer's -rss_limit_mb) is a finding: libFuzzer
// stops and writes the input as crash-*/oom-*/leak-*.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>

#include "fsdp/checkpoint.h"
#include "io/data.h"
#include "io/hf.h"
#include "io/tokenizer.h"
#include "nn/safetensors.h"
#include "runtime/distributed.h"
#include "tools/config.h"
#include "tools/hardware.h"

using namespace tessera;
namespace fs = std::filesystem;

namespace {

enum class Target { Shards, Metadata, DataFile, Safetensors, Toml, Tokenizer, Hf, Hardware };
Target g_target;
fs::path g_dir;  // this process's scratch folder (file readers read real files)
std::optional<io::BpeTokenizer> g_bpe;  // the test fixture's GPT-2 style tokenizer

void write_file(const fs::path& p, const uint8_t* data, size_t size) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
}

// A checkpoint directory whose metadata describes two tensors stored in
// rank-00000.bin: the data file's bytes are the fuzzer's input.
fsdp::CheckpointMetadata g_datafile_md;
const char* kDataFileMetadata = R"({
  "magic": "tessera-checkpoint", "version": 1, "step": 0, "world_size": 1,
  "tensors": [
    {"name": "w", "dtype": "f32", "shape": [3, 4], "placements": "plain",
     "chunks": [{"file": "rank-00000.bin", "offset": 16, "bytes": 48, "crc32c": 0,
                 "offsets": [0, 0], "shape": [3, 4]}]},
    {"name": "b", "dtype": "bf16", "shape": [6], "placements": "plain",
     "chunks": [{"file": "rank-00000.bin", "offset": 64, "bytes": 4, "crc32c": 0,
                 "offsets": [0], "shape": [2]},
                {"file": "rank-00000.bin", "offset": 68, "bytes": 8, "crc32c": 0,
                 "offsets": [2], "shape": [4]}]}
  ]})";

void run_one(const uint8_t* data, size_t size) {
  switch (g_target) {
    case Target::Shards: {
      fs::path p = g_dir / "shard.bin";
      write_file(p, data, size);
      (void)io::read_shard(p.string());
      break;
    }
    case Target::Metadata:
      (void)fsdp::parse_metadata(std::string(reinterpret_cast<const char*>(data), size),
                                 "fuzz/metadata.json");
      break;
    case Target::DataFile: {
      write_file(g_dir / "ckpt" / "rank-00000.bin", data, size);
      // The checksums of the input's own bytes (unless its last byte is odd),
      // so that the fuzzer gets past the CRC check to the copy behind it.
      fsdp::CheckpointMetadata md = g_datafile_md;
      for (auto& t : md.tensors)
        for (auto& c : t.chunks)
          if (size > 0 && data[size - 1] % 2 == 0 && c.offset + c.bytes <= size)
            c.crc32c = fsdp::crc32c(data + c.offset, c.bytes);
      for (const auto& t : md.tensors) {
        for (const auto& c : t.chunks) (void)fsdp::read_chunk((g_dir / "ckpt").string(), t, c);
        (void)fsdp::read_full_tensor((g_dir / "ckpt").string(), t);
      }
      break;
    }
    case Target::Safetensors: {
      fs::path p = g_dir / "fuzz.safetensors";
      write_file(p, data, size);
      nn::SafetensorsFile f(p.string(), 1 << 20);
      for (const auto& e : f.entries()) {
        (void)f.read(e.name);
        if (is_floating(e.dtype)) (void)f.read(e.name, DType::F32);
      }
      break;
    }
    case Target::Toml: {
      fs::path p = g_dir / "config.toml";
      write_file(p, data, size);
      tools::TrainConfig cfg;
      tools::load_toml(cfg, p.string());
      tools::validate(cfg);
      tools::validate_for_world(cfg, 3);
      tools::check_memory(cfg, 3, 3, 64.0 * (1ull << 30));
      break;
    }
    case Target::Tokenizer: {
      // An input that starts with '{' is a tokenizer.json (if it is one, it
      // encodes a fixed text); any other is text, which must decode back to
      // itself under the fixture's tokenizer.
      std::string_view bytes(reinterpret_cast<const char*>(data), size);
      if (size > 0 && data[0] == '{') {
        auto t = io::BpeTokenizer::from_json(std::string(bytes), "fuzz/tokenizer.json");
        std::vector<int64_t> ids = t.encode("Hello  world, it's 42\n<|endoftext|>\xff");
        (void)t.decode(ids);
      } else {
        std::vector<int64_t> ids = g_bpe->encode(bytes);
        if (g_bpe->decode(ids) != bytes) {
          std::fprintf(stderr, "FINDING: tokenizer: %zu bytes do not decode back to themselves\n", size);
          std::abort();
        }
      }
      break;
    }
    case Target::Hf: {
      // A Hugging Face folder: the input is its config.json; where it names a
      // model, the input again is its model.safetensors.index.json (whose
      // shards do not exist: the weight map is read and checked first).
      write_file(g_dir / "hf" / "config.json", data, size);
      write_file(g_dir / "hf" / "model.safetensors.index.json", data, size);
      const nn::TransformerConfig cfg = io::read_hf_config((g_dir / "hf").string());
      (void)io::read_hf_weights((g_dir / "hf").string(), cfg);
      break;
    }
    case Target::Hardware:
      (void)tools::parse_hardware(std::string(reinterpret_cast<const char*>(data), size), "fuzz/hardware.toml");
      break;
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  dist::init(*argc, *argv);  // world size 1: no launcher, no MPI
  const char* name = std::getenv("FUZZ_TARGET");
  std::string t = name ? name : "";
  if (t == "shards") g_target = Target::Shards;
  else if (t == "metadata") g_target = Target::Metadata;
  else if (t == "datafile") g_target = Target::DataFile;
  else if (t == "safetensors") g_target = Target::Safetensors;
  else if (t == "toml") g_target = Target::Toml;
  else if (t == "tokenizer") g_target = Target::Tokenizer;
  else if (t == "hf") g_target = Target::Hf;
  else if (t == "hardware") g_target = Target::Hardware;
  else {
    std::fprintf(stderr, "FUZZ_TARGET must be shards, metadata, datafile, safetensors, toml, tokenizer, hf or "
                 "hardware\n");
    std::exit(2);
  }
  char tmpl[] = "/tmp/tessera-libfuzzer-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) std::exit(2);
  g_dir = tmpl;
  fs::create_directories(g_dir / "ckpt");
  fs::create_directories(g_dir / "hf");
  g_datafile_md = fsdp::parse_metadata(kDataFileMetadata, "datafile seed");
  if (g_target == Target::Tokenizer) {
    const char* bpe = std::getenv("TESSERA_BPE");  // set by libfuzzer.sh
    g_bpe = io::BpeTokenizer::load(bpe != nullptr ? bpe : "tests/fixtures/bpe/tokenizer.json");
  }
  std::atexit([] { fs::remove_all(g_dir); });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    run_one(data, size);
  } catch (const Error&) {
    // refused with a message: the expected outcome for most inputs
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FINDING: %s threw %s: %s\n", std::getenv("FUZZ_TARGET"),
                 typeid(e).name(), e.what());
    std::abort();
  }
  // A reader that leaks a file descriptor on some path (LeakSanitizer sees
  // memory only): the open descriptors, every 256 inputs, against the first count.
  static size_t calls = 0, baseline = 0;
  if (calls++ % 256 == 0) {
    size_t open = 0;
    for ([[maybe_unused]] const auto& e : fs::directory_iterator("/proc/self/fd")) ++open;
    if (baseline == 0) baseline = open;
    if (open > baseline + 8) {
      std::fprintf(stderr, "FINDING: %s leaks file descriptors: %zu open, %zu at the start\n",
                   std::getenv("FUZZ_TARGET"), open, baseline);
      std::abort();
    }
  }
  return 0;
}
