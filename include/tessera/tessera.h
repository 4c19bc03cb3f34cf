// Tessera's umbrella header: everything a training program uses.
//   #include <tessera/tessera.h>
//   using namespace tessera;
#pragma once

#include "runtime/allocator.h"
#include "runtime/check.h"
#include "runtime/device.h"
#include "runtime/distributed.h"
#include "runtime/dtype.h"
#include "runtime/ops.h"
#include "runtime/parallel.h"
#include "runtime/profiler.h"
#include "runtime/random.h"
#include "runtime/stream.h"
#include "runtime/tensor.h"

#include "autograd/functions.h"
#include "autograd/gradcheck.h"
#include "autograd/tape.h"

#include "dtensor/device_mesh.h"
#include "dtensor/dtensor.h"
#include "dtensor/placement.h"
#include "dtensor/redistribute.h"

#include "nn/generate.h"
#include "nn/layers.h"
#include "nn/models.h"
#include "nn/module.h"
#include "nn/moe.h"
#include "nn/optim.h"
#include "nn/safetensors.h"
#include "nn/transformer.h"
#include "tp/parallelize.h"

#include "fsdp/fully_shard.h"
#include "fsdp/checkpoint.h"
#include "fsdp/policies.h"
#include "fsdp/state_dict.h"

#include "pp/pipeline.h"
#include "pp/schedule.h"
#include "cp/context_parallel.h"
#include "ep/expert_parallel.h"

#include "io/data.h"
#include "io/hf.h"
#include "io/llmc.h"
#include "io/tokenizer.h"

#include "train/optimizer.h"
#include "train/parallelize.h"
#include "train/step.h"
