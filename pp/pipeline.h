// Pipeline parallelism: a language model cut into stages of consecutive
// blocks, the stages on the ranks of a process group, a step run as a
// schedule's action lists (pp/schedule.h). As TorchTitan's
// pipeline_parallel: the full model is built on meta for each stage and
// pruned to its part, so every parameter keeps its full model name (a stage's
// state dict holds the full model's keys for its part).
//
//   auto pipe = pp::Pipeline(group, cfg, {.schedule = "1f1b", .microbatches = 8});
//   pipe.materialize(Device::cpu(), seed);          // this rank's stages, initialised as the full model's
//   optim::AdamW opt(pipe.parameters(), {...});
//   Tensor loss = pipe.step(idx, targets);          // forward and backward of every micro-batch
//   opt.step();
//
// Stages sharded by FSDP (fsdp::fully_shard on each part, as
// train::make_pipeline does) get their UNSHARD, REDUCE_GRAD and RESHARD in
// the schedule at the first step: parameters gathered once, kept across the
// micro-batches, gradients reduced once after the stage's last backward.
//
// The loss of a step is the batch's mean token loss: each micro-batch's
// cross-entropy weighted by its share of the batch's tokens, so the step
// equals gradient accumulation over the same micro-batches on one process,
// whatever their number (TorchTitan divides the summed loss by the global
// token count). Backwards run in micro-batch order on every stage, so the
// gradients are summed in the same order as there: bit for bit equal.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <memory>
#include <string>
#include <vector>

#include "autograd/tape.h"
#include "dtensor/device_mesh.h"
#include "dtensor/placement.h"
#include "nn/models.h"
#include "pp/schedule.h"
#include "runtime/distributed.h"

namespace tessera::pp {

// The blocks stage s holds: [first, end).
struct StageBlocks {
  int64_t first = 0, end = 0;
};

// Cuts n_layer blocks into `stages` consecutive ranges: `layers_per_stage`
// when given (one count per stage, at least one each, summing to n_layer),
// else as even as they go, the extra blocks on the middle stages first (the
// first stage also runs the embeddings, the last the output layer and loss).
// Refuses more stages than blocks, naming both.
std::vector<StageBlocks> split_layers(int64_t n_layer, int stages, const std::vector<int64_t>& layers_per_stage = {});

// The same cut given by module names, per stage (TorchTitan's
// module_fqns_per_model_part): the model's own names of its blocks
// ("transformer.h.3", "model.layers.3"), embeddings ("transformer.wte",
// "transformer.wpe", "model.embed_tokens"), final norm ("transformer.ln_f",
// "model.norm") and output layer ("lm_head"). Every one of them once; each
// stage's blocks consecutive and after the previous stage's, at least one
// per stage; the embeddings on the first stage and the final norm and output
// layer on the last. Refuses anything else naming the stage and the name.
std::vector<StageBlocks> split_by_names(const nn::TransformerConfig& cfg,
                                        const std::vector<std::vector<std::string>>& names_per_stage);

// Prunes a full model to stage `stage`'s part: the blocks outside its range,
// the embeddings unless it is the first stage, the final norm and output
// layer unless it is the last. Names are unchanged. A model whose output
// layer shares the token embedding (model.tie_embeddings) is refused when
// the first and last stage differ.
void keep_stage(nn::LanguageModel& model, int stage, const std::vector<StageBlocks>& split);

struct PipelineOptions {
  std::string schedule = "1f1b";  // gpipe | 1f1b | interleaved_1f1b | zb_h1
  int microbatches = 4;
  int stages_per_rank = 1;               // > 1: interleaved_1f1b's chunks per rank
  std::vector<int64_t> layers_per_stage;  // empty: split_layers' even split
  std::vector<std::vector<std::string>> module_names_per_stage;  // instead: split_by_names
  // The dtype of the activations (and logits) the stages pass: the
  // computation's (FSDP's param_dtype under mixed precision). Unset: the
  // parameters' own.
  std::optional<DType> activation_dtype;
  // The layout of the activations the stages pass when they are DTensors
  // (tensor parallelism's sequence parallelism: Shard(1) over the "tp"
  // mesh): each rank sends and receives its own piece to and from the rank
  // of the same tensor-parallel position. Null: plain tensors.
  MeshPtr activation_mesh;
  Placements activation_placements;
};

class Pipeline {
 public:
  // This rank's stages of the model `cfg` describes, over `group` (one rank
  // per pipeline position, in group order), on meta until materialize().
  // Validates the schedule before anything is allocated.
  Pipeline(dist::ProcessGroupPtr group, const nn::TransformerConfig& cfg, PipelineOptions options);

  // Allocates this rank's parts on `device` and initialises them as the
  // full model's init_weights(seed) would (values depend on names only).
  void materialize(Device device, uint64_t seed);
  // This rank's stage parts, by stage index.
  const std::map<int, std::shared_ptr<nn::LanguageModel>>& parts() const { return parts_; }
  TensorList parameters() const;
  const Schedule& schedule() const { return schedule_; }
  const std::vector<StageBlocks>& split() const { return split_; }
  const nn::TransformerConfig& config() const { return cfg_; }
  const dist::ProcessGroupPtr& group() const { return group_; }
  // This rank's stages for a person: "stage 0 (blocks 0-3, embeddings), ...".
  std::string describe_stages() const;

  // One step's forward and backward over every micro-batch of `idx` and
  // `targets` ([B, T] token ids, the same on every rank of the group; B a
  // multiple of the micro-batch count): gradients accumulate into the
  // parameters' .grad. Returns the step's loss (the batch's mean token
  // loss, a 0-dim f64 tensor) on every rank.
  Tensor step(const Tensor& idx, const Tensor& targets);

  // The whole model's forward on `idx` ([B, T] token ids, the same on every
  // rank of the group), without gradients: each stage in turn, and the
  // logits (gathered where a tensor-parallel output layer splits them) on
  // every rank. For evaluation and sampling; every rank of the group calls it.
  Tensor forward_logits(const Tensor& idx);

  // nn::clip_grad_norm_ over every stage's gradients: this rank's squared
  // norm all-reduced over the group (max_norm <= 0: no clipping). Returns
  // the norm before clipping (a 0-dim f64 tensor) on every rank.
  Tensor clip_grad_norm_(double max_norm);

  // The most micro-batches any of this rank's stages held activations for
  // at once in the last step (forwarded, not yet backwarded).
  int max_in_flight() const { return max_in_flight_; }

  // This rank's time in the last step: from its start to the last send's
  // completion (span), of which computing its F and B actions (busy); the
  // rest is its bubble. While tracing, each F and B is a span on the lane
  // "pipeline" ("F<stage>.<micro-batch>") and each wait between them one on
  // "pipeline bubble".
  struct StepTime {
    double span_us = 0, busy_us = 0;
    double bubble() const { return span_us > 0 ? 1.0 - busy_us / span_us : 0.0; }
  };
  const StepTime& last_step_time() const { return time_; }

 private:
  Tensor forward(int stage, int mb, const Tensor& input);
  void backward(int stage, int mb);
  void backward_input(int stage, int mb);   // zb_h1's I: the input's gradient, the rest deferred
  void backward_weight(int stage, int mb);  // its W: what backward_input deferred
  void set_fsdp_flags(int stage);            // before a backward that ends with the weights' gradients
  std::vector<nn::Module*> sharded_modules(int stage);
  void done_with_input(const std::pair<int, int>& key);  // the entry goes once its weights are done too
  // An activation (or its gradient) of `rows` sequences as it travels: a
  // buffer for this rank's piece, the piece as the stage's tensor, the piece
  // of the stage's tensor to send.
  Tensor activation_buffer(int64_t rows, int64_t seq, DType dtype, Device device) const;
  Tensor as_activation(const Tensor& piece, int64_t rows, int64_t seq) const;
  Tensor piece_of(const Tensor& activation) const;

  dist::ProcessGroupPtr group_;
  nn::TransformerConfig cfg_;
  PipelineOptions options_;
  Schedule schedule_;
  std::vector<StageBlocks> split_;
  std::map<int, std::shared_ptr<nn::LanguageModel>> parts_;
  bool materialized_ = false;
  bool fsdp_actions_ = false;  // the schedule has its FSDP actions (add_fsdp_actions)
  int max_in_flight_ = 0;
  StepTime time_;

  // One step's state, keyed by (stage, micro-batch).
  struct InFlight {
    std::unique_ptr<autograd::Tape> tape;  // the micro-batch's graph through the stage
    Tensor input;   // the stage's input (received activations: a leaf whose .grad is sent back)
    Tensor output;  // its output (the next stage's input) or, on the last stage, the loss
    Tensor grad_output;  // received from the next stage
    std::shared_ptr<autograd::WeightGradients> weights;  // after an I, until its W
  };
  std::map<std::pair<int, int>, InFlight> flight_;
  std::vector<Tensor> micro_idx_, micro_targets_;
  // Context parallelism (the parts share one sequence shard): each
  // micro-batch's loss weight (nn::SequenceShard::weigh_loss of 1).
  std::vector<Tensor> micro_weights_;
  std::vector<Tensor> losses_;  // the last stage's, per micro-batch
  double token_share_ = 1;  // each micro-batch's share of the batch's tokens
};

// A language model whose forward is a pipeline's forward_logits, so
// evaluation and nn::generate run on a pipelined model as on any other (every
// rank of the pipeline calling together). This rank's stage parts are its
// children ("stage0", ...), so train()/eval() and extensions reach them; its
// named_parameters() and state_dict() are the parts', under their full model
// names, so a pipelined run's checkpoint and optimizer state use the same keys
// as an unpipelined one's (fsdp::save_checkpoint, load_checkpoint).
class PipelinedModel : public nn::LanguageModel {
 public:
  explicit PipelinedModel(std::shared_ptr<Pipeline> pipeline);
  Tensor forward(const Tensor& idx) override { return pipeline_->forward_logits(idx); }
  Tensor embed(const Tensor& idx) override;
  Tensor head(const Tensor& x) override;
  std::vector<std::pair<std::string, Tensor>> named_parameters(bool recurse = true) const override;
  nn::StateDict state_dict() override;
  std::string type_name() const override { return "PipelinedModel"; }
  Pipeline& pipeline() { return *pipeline_; }

 private:
  std::shared_ptr<Pipeline> pipeline_;
};

}  // namespace tessera::pp
