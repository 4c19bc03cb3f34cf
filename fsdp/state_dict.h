// State dicts of an FSDP model.
//
// Sharded (the default): model.state_dict() returns the sharded DTensors
// themselves (FSDP reshards first), so saving costs no communication and no
// copy; load_state_dict of DTensors with the same placements copies into the
// shards in place.
//
// Full: every DTensor gathered to a whole tensor, one parameter at a time, so
// peak memory stays near one full parameter on top of the shards; and the
// reverse, full tensors cut down to each rank's shard.
#pragma once

#include <functional>
#include <map>
#include <optional>

#include "nn/module.h"

namespace tessera::fsdp {

// Calls fn(name, full) for each entry in order, gathering one tensor at a time
// (a collective for DTensors: every rank must call it). With rank0_only, ranks
// other than 0 get an undefined tensor.
void for_each_full_tensor(const nn::StateDict& state, bool rank0_only,
                          const std::function<void(const std::string&, const Tensor&)>& fn);
// The whole model's full state dict (held at once: use for_each_full_tensor to stream).
nn::StateDict full_state_dict(nn::Module& model, bool rank0_only = true);
// Copies full tensors into the model's shards (plain parameters get the whole
// tensor). With from_rank0 only rank 0's `full` is read and each tensor is
// broadcast in turn. strict: missing and unexpected keys are errors. dtypes are
// converted; shapes must match.
void load_full_state_dict(nn::Module& model, const nn::StateDict& state, bool from_rank0 = false,
                          bool strict = true);

// Exports the model (FSDP or plain) to one .safetensors file written by rank 0,
// gathering one parameter at a time (collective). Every state-dict key is
// written under the model's names (GPT: nanoGPT's, Llama: Hugging Face's);
// with `dtype` floating tensors are converted (e.g. bf16 for release).
void save_safetensors(nn::Module& model, const std::string& path,
                      const std::map<std::string, std::string>& metadata = {},
                      std::optional<DType> dtype = std::nullopt);
// Imports a .safetensors file into the model (FSDP or plain): every rank reads
// only the rows of its own shards; values are converted to each parameter's
// dtype. strict: missing keys (other than a tied weight present under another
// name) and unexpected keys are errors. Collective; a failure on any rank
// throws on all.
void load_safetensors(nn::Module& model, const std::string& path, bool strict = true);

// Of the names this rank's model lacks, those every rank's lacks (collective):
// under a pipeline each rank holds its stages' tensors, and a file's tensor
// is unexpected only when no rank holds it.
std::vector<std::string> lacked_by_every_rank(const std::vector<std::string>& lacked_here);

}  // namespace tessera::fsdp
