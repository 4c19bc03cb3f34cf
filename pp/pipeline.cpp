#include "pp/pipeline.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <numeric>

#include "autograd/functions.h"
#include "dtensor/dtensor.h"
#include "fsdp/fully_shard.h"
#include "nn/optim.h"
#include "runtime/ops.h"
#include "runtime/trace.h"

namespace tessera::pp {

std::vector<StageBlocks> split_layers(int64_t n_layer, int stages, const std::vector<int64_t>& layers_per_stage) {
  TS_CHECK(stages >= 1, "pipeline: {} stages (expected at least 1)", stages);
  std::vector<int64_t> count;
  if (!layers_per_stage.empty()) {
    TS_CHECK(static_cast<int>(layers_per_stage.size()) == stages,
             "pipeline: {} layer counts given for {} stages (one per stage)", layers_per_stage.size(), stages);
    int64_t sum = 0;
    for (int64_t c : layers_per_stage) {
      TS_CHECK(c >= 1, "pipeline: a stage of {} blocks (each stage needs at least one)", c);
      sum += c;
    }
    TS_CHECK(sum == n_layer, "pipeline: the layer counts per stage sum to {}, but the model has {} blocks "
             "(model.n_layer)", sum, n_layer);
    count = layers_per_stage;
  } else {
    TS_CHECK(stages <= n_layer, "pipeline: {} stages for {} blocks (model.n_layer): each stage needs at least one "
             "block", stages, n_layer);
    count.assign(static_cast<size_t>(stages), n_layer / stages);
    int64_t extra = n_layer % stages;
    // The middle stages first: the first also embeds, the last computes the
    // output layer and the loss.
    for (int s = 1; s + 1 < stages && extra > 0; ++s, --extra) count[static_cast<size_t>(s)]++;
    for (int s : {0, stages - 1})
      if (extra > 0) count[static_cast<size_t>(s)]++, --extra;
  }
  std::vector<StageBlocks> out;
  int64_t at = 0;
  for (int64_t c : count) {
    out.push_back({at, at + c});
    at += c;
  }
  return out;
}

std::vector<StageBlocks> split_by_names(const nn::TransformerConfig& cfg,
                                        const std::vector<std::vector<std::string>>& names_per_stage) {
  const int stages = static_cast<int>(names_per_stage.size());
  TS_CHECK(stages >= 1, "pipeline: no stages given by module names");
  // The model's own names, from a model on meta (nothing allocated).
  const auto model = nn::make_model(cfg, Device::meta());
  std::vector<std::string> first_only, last_only, blocks;
  const bool gpt = dynamic_cast<const nn::GPT*>(model.get()) != nullptr;
  const std::string block_prefix = gpt ? "transformer.h." : "model.layers.";
  for (const auto& [name, m] : model->named_modules()) {
    if (name == "transformer.wte" || name == "transformer.wpe" || name == "model.embed_tokens") first_only.push_back(name);
    if (name == "transformer.ln_f" || name == "model.norm" || name == "lm_head") last_only.push_back(name);
  }
  for (int64_t i = 0; i < cfg.n_layer; ++i) blocks.push_back(block_prefix + std::to_string(i));
  auto block_of = [&](const std::string& name) -> int64_t {
    const auto it = std::find(blocks.begin(), blocks.end(), name);
    return it == blocks.end() ? -1 : it - blocks.begin();
  };
  std::map<std::string, int> seen;
  std::vector<StageBlocks> out;
  int64_t next = 0;  // the first block the next stage must hold
  for (int s = 0; s < stages; ++s) {
    int64_t first = -1, end = -1;
    for (const std::string& name : names_per_stage[static_cast<size_t>(s)]) {
      auto [it, fresh] = seen.emplace(name, s);
      TS_CHECK(fresh, "pipeline: stage {} names '{}', which stage {} names too (each module on one stage)", s, name,
               it->second);
      if (std::find(first_only.begin(), first_only.end(), name) != first_only.end()) {
        TS_CHECK(s == 0, "pipeline: stage {} names '{}', an embedding: the first stage (0) embeds", s, name);
        continue;
      }
      if (std::find(last_only.begin(), last_only.end(), name) != last_only.end()) {
        TS_CHECK(s + 1 == stages, "pipeline: stage {} names '{}', which the last stage ({}) computes", s, name,
                 stages - 1);
        continue;
      }
      const int64_t b = block_of(name);
      TS_CHECK(b >= 0, "pipeline: stage {} names '{}', which is not a block ({}0 .. {}{}), an embedding ({}), the "
               "final norm or the output layer ({}) of this model", s, name, block_prefix, block_prefix,
               cfg.n_layer - 1, fmt::join(first_only, ", "), fmt::join(last_only, ", "));
      TS_CHECK(b == (end < 0 ? next : end), "pipeline: stage {} names '{}' where it needs {}{}: each stage holds "
               "consecutive blocks, in order after the previous stage's", s, name, block_prefix,
               end < 0 ? next : end);
      if (first < 0) first = b;
      end = b + 1;
    }
    TS_CHECK(first >= 0, "pipeline: stage {} names no block (each stage needs at least one)", s);
    out.push_back({first, end});
    next = end;
  }
  TS_CHECK(next == cfg.n_layer, "pipeline: the stages name blocks 0 .. {} of the model's {} (model.n_layer): {}{} "
           "and after are on no stage", next - 1, cfg.n_layer, block_prefix, next);
  for (const std::string& name : first_only)
    TS_CHECK(seen.count(name) != 0, "pipeline: no stage names '{}' (the first stage holds it)", name);
  for (const std::string& name : last_only)
    TS_CHECK(seen.count(name) != 0, "pipeline: no stage names '{}' (the last stage holds it)", name);
  return out;
}

void keep_stage(nn::LanguageModel& model, int stage, const std::vector<StageBlocks>& split) {
  const int stages = static_cast<int>(split.size());
  TS_CHECK(stage >= 0 && stage < stages, "keep_stage: stage {} of {}", stage, stages);
  const bool first = stage == 0, last = stage == stages - 1;
  TS_CHECK(!model.config.tie_embeddings || (first && last),
           "pipeline: model.tie_embeddings shares the token embedding (stage 0) with the output layer (stage {}), "
           "which a pipeline of {} stages puts on different ranks: set model.tie_embeddings false",
           stages - 1, stages);
  const StageBlocks& mine = split[static_cast<size_t>(stage)];
  // The blocks outside [first, end), by name; the rest keep theirs.
  std::shared_ptr<nn::ModuleList> list;
  if (auto* gpt = dynamic_cast<nn::GPT*>(&model)) {
    list = gpt->h;
    if (!first) {
      gpt->transformer->remove_child("wte");
      gpt->wte = nullptr;
      if (gpt->wpe) gpt->transformer->remove_child("wpe");
      gpt->wpe = nullptr;
    }
    if (!last) {
      gpt->transformer->remove_child("ln_f");
      gpt->remove_child("lm_head");
      gpt->ln_f = nullptr;
      gpt->lm_head = nullptr;
    }
  } else if (auto* llama = dynamic_cast<nn::Llama*>(&model)) {
    list = llama->layers;
    if (!first) {
      llama->model->remove_child("embed_tokens");
      llama->embed_tokens = nullptr;
    }
    if (!last) {
      llama->model->remove_child("norm");
      llama->remove_child("lm_head");
      llama->norm = nullptr;
      llama->lm_head = nullptr;
    }
  } else {
    throw Error(fmt::format("keep_stage: {} is not a GPT or Llama", model.type_name()));
  }
  std::vector<std::shared_ptr<nn::Module>> kept;
  for (int64_t i = 0; i < static_cast<int64_t>(model.blocks.size()); ++i) {
    if (i >= mine.first && i < mine.end)
      kept.push_back(model.blocks[static_cast<size_t>(i)]);
    else
      list->remove_child(std::to_string(i));
  }
  model.blocks = kept;
}

Pipeline::Pipeline(dist::ProcessGroupPtr group, const nn::TransformerConfig& cfg, PipelineOptions options)
    : group_(std::move(group)), cfg_(cfg), options_(std::move(options)) {
  TS_CHECK(group_ != nullptr, "Pipeline: no process group");
  const int p = group_->size(), v = options_.stages_per_rank;
  schedule_ = make_schedule(options_.schedule, p, options_.microbatches, v);
  add_communication(schedule_);
  validate(schedule_);
  if (!options_.module_names_per_stage.empty()) {
    TS_CHECK(options_.layers_per_stage.empty(), "pipeline: the stages are given by module names and by layer "
             "counts; give one");
    TS_CHECK(static_cast<int>(options_.module_names_per_stage.size()) == schedule_.stages,
             "pipeline: module names for {} stages, but the schedule has {} ({} rank(s) x {} stage(s) per rank)",
             options_.module_names_per_stage.size(), schedule_.stages, schedule_.ranks, schedule_.stages_per_rank());
    split_ = split_by_names(cfg_, options_.module_names_per_stage);
  } else {
    split_ = split_layers(cfg_.n_layer, schedule_.stages, options_.layers_per_stage);
  }
  for (int s : schedule_.stages_of(group_->rank())) {
    auto part = nn::make_model(cfg_, Device::meta());
    keep_stage(*part, s, split_);
    parts_[s] = part;
  }
}

void Pipeline::materialize(Device device, uint64_t seed) {
  for (auto& [s, part] : parts_) {
    part->to_empty(device);
    part->init_weights(seed);
  }
  materialized_ = true;  // on meta too: the planner runs steps there (tools/plan.h)
}

std::string Pipeline::describe_stages() const {
  std::vector<std::string> out;
  for (const auto& [s, part] : parts_) {
    const StageBlocks& b = split_[static_cast<size_t>(s)];
    out.push_back(fmt::format("stage {} (blocks {}-{}{}{})", s, b.first, b.end - 1, s == 0 ? ", embeddings" : "",
                              s + 1 == schedule_.stages ? ", output layer and loss" : ""));
  }
  return fmt::format("{}", fmt::join(out, ", "));
}

TensorList Pipeline::parameters() const {
  TensorList out;
  for (const auto& [s, part] : parts_)
    for (const Tensor& t : part->parameters()) out.push_back(t);
  return out;
}

Tensor Pipeline::activation_buffer(int64_t rows, int64_t seq, DType dtype, Device device) const {
  Shape whole{rows, seq, cfg_.n_embd};
  const MeshPtr& mesh = options_.activation_mesh;
  return empty(mesh ? local_shape(whole, *mesh, options_.activation_placements, mesh->get_coordinate()) : whole,
               dtype, device);
}

Tensor Pipeline::as_activation(const Tensor& piece, int64_t rows, int64_t seq) const {
  if (!options_.activation_mesh) return piece;
  return make_dtensor(piece, options_.activation_mesh, options_.activation_placements, {rows, seq, cfg_.n_embd});
}

Tensor Pipeline::piece_of(const Tensor& activation) const {
  Tensor t = autograd::detach(activation);
  if (!options_.activation_mesh) {
    TS_CHECK(!is_dtensor(t), "pipeline: a stage passes a DTensor ({}) but the pipeline expects plain activations "
             "(PipelineOptions::activation_mesh unset)", placements_str(dtensor_spec(t).placements));
    return ops::contiguous(t);
  }
  TS_CHECK(is_dtensor(t), "pipeline: a stage passes a plain tensor {} but the pipeline expects DTensors {} "
           "(PipelineOptions::activation_placements)", shape_str(t.shape()),
           placements_str(options_.activation_placements));
  if (dtensor_spec(t).placements != options_.activation_placements)
    t = redistribute(t, options_.activation_placements);
  return ops::contiguous(dtensor_spec(t).local);
}

Tensor Pipeline::forward_logits(const Tensor& idx) {
  autograd::NoGradGuard no_grad;
  // Context parallelism: every rank runs the whole sequences (attention over
  // them alone, no K/V exchanged); the slices come back after.
  std::vector<nn::LanguageModel*> parts;
  for (auto& [s, part] : parts_) parts.push_back(part.get());
  nn::WholeSequences whole(parts);
  TS_CHECK(idx.dim() == 2, "Pipeline::forward_logits: expected token ids [B, T], got {}", shape_str(idx.shape()));
  const int S = schedule_.stages, me = group_->rank();
  auto rank_of = [&](int st) { return schedule_.stage_rank[static_cast<size_t>(st)]; };
  const Tensor w = parts_.begin()->second->parameters()[0];
  const int64_t B = idx.size(0), T = idx.size(1);
  // Tags above any step's (2 x stages x micro-batches).
  constexpr int kTag = 1 << 29;
  Tensor h;
  for (int s = 0; s < S; ++s) {
    if (rank_of(s) != me) continue;
    Tensor input = idx;
    if (s > 0 && rank_of(s - 1) == me) {
      input = h;
    } else if (s > 0) {
      Tensor piece = activation_buffer(B, T, options_.activation_dtype.value_or(w.dtype()), w.device());
      group_->recv(piece, rank_of(s - 1), kTag + s)->wait();
      input = as_activation(piece, B, T);
    }
    h = (*parts_.at(s))(input);
    if (s + 1 < S && rank_of(s + 1) != me) group_->send(piece_of(h), rank_of(s + 1), kTag + s + 1)->wait();
  }
  Tensor logits;
  if (rank_of(S - 1) == me) logits = ops::contiguous(is_dtensor(h) ? full_tensor(h) : h);
  else logits = empty({B, T, cfg_.vocab_size}, options_.activation_dtype.value_or(w.dtype()), w.device());
  if (group_->size() > 1) group_->broadcast(logits, rank_of(S - 1))->wait();
  return logits;
}

Tensor Pipeline::clip_grad_norm_(double max_norm) {
  return max_norm > 0 ? nn::clip_grad_norm_(parameters(), max_norm, group_) : nn::grad_norm(parameters(), group_);
}

Tensor Pipeline::forward(int stage, int mb, const Tensor& input) {
  nn::LanguageModel& part = *parts_.at(stage);
  InFlight& f = flight_[{stage, mb}];
  f.tape = std::make_unique<autograd::Tape>();
  f.input = input;
  autograd::TapeScope scope(*f.tape);
  // part(x) with its hooks (a stage under FSDP gathers its parameters there).
  Tensor h = part(input);
  if (stage + 1 < schedule_.stages) return f.output = h;
  // The batch's mean token loss, this micro-batch's share of it.
  const Tensor& logits = h;
  Tensor loss = nn::cross_entropy(logits, micro_targets_[static_cast<size_t>(mb)]);
  if (!micro_weights_.empty()) {  // weighed in f32 at least, as nn::SequenceShard::weigh_loss does
    const DType dt = loss.dtype() == DType::F64 ? DType::F64 : DType::F32;
    loss = to(loss, dt) * ops::to(micro_weights_[static_cast<size_t>(mb)], dt);
  }
  f.output = mul(loss, token_share_);
  losses_[static_cast<size_t>(mb)] = autograd::detach(f.output);
  return f.output;
}

void Pipeline::set_fsdp_flags(int stage) {
  // Under FSDP (as PyTorch's stage does): every backward leaves the
  // gradients unsharded, accumulating over the micro-batches, and the
  // parameters gathered; the stage's REDUCE_GRAD reduces them once after its
  // last backward, and its RESHARD frees the parameters.
  nn::LanguageModel& part = *parts_.at(stage);
  if (!fsdp::is_fully_sharded(part)) return;
  fsdp::set_requires_gradient_sync(part, false);
  fsdp::set_reshard_after_backward(part, false);
  fsdp::set_is_last_backward(part, false);
}

// Every module of a stage's part that FSDP shards, in pre-order.
std::vector<nn::Module*> Pipeline::sharded_modules(int stage) {
  std::vector<nn::Module*> out;
  for (auto& [name, m] : parts_.at(stage)->named_modules())
    if (fsdp::is_fully_sharded(*m)) out.push_back(m);
  return out;
}

void Pipeline::backward(int stage, int mb) {
  InFlight& f = flight_.at({stage, mb});
  set_fsdp_flags(stage);
  autograd::TapeScope scope(*f.tape);
  if (stage + 1 == schedule_.stages)
    autograd::backward(f.output);
  else
    autograd::backward({f.output}, {f.grad_output});
  f.tape.reset();
}

void Pipeline::backward_input(int stage, int mb) {
  // FSDP's flags wait for the W: another micro-batch's W may run before it.
  InFlight& f = flight_.at({stage, mb});
  autograd::TapeScope scope(*f.tape);
  f.weights = autograd::backward_input({f.output}, {stage + 1 == schedule_.stages ? Tensor() : f.grad_output},
                                      {f.input});
  f.tape.reset();
}

void Pipeline::backward_weight(int stage, int mb) {
  InFlight& f = flight_.at({stage, mb});
  set_fsdp_flags(stage);
  autograd::backward_weight(*f.weights);
  f.weights.reset();
}

void Pipeline::done_with_input(const std::pair<int, int>& key) {
  auto it = flight_.find(key);
  if (it == flight_.end()) return;
  it->second.input = Tensor();
  if (!it->second.weights) flight_.erase(it);
}

Tensor Pipeline::step(const Tensor& idx, const Tensor& targets) {
  const int m = schedule_.microbatches, S = schedule_.stages, me = group_->rank();
  TS_CHECK(materialized_, "Pipeline::step: the stages are still on meta (call materialize first)");
  TS_CHECK(idx.dim() == 2 && targets.shape() == idx.shape(), "Pipeline::step: expected token ids and targets "
           "[B, T] of one shape, got {} and {}", shape_str(idx.shape()), shape_str(targets.shape()));
  const int64_t B = idx.size(0);
  TS_CHECK(B % m == 0, "Pipeline::step: a batch of {} sequences does not split into {} micro-batches "
           "(parallelism.pipeline_parallel_microbatches)", B, m);
  const int64_t bm = B / m;
  // Stages sharded by FSDP: their UNSHARD, REDUCE_GRAD and RESHARD join the schedule (once).
  if (!fsdp_actions_ && std::any_of(parts_.begin(), parts_.end(),
                                    [](const auto& part) { return fsdp::is_fully_sharded(*part.second); })) {
    add_fsdp_actions(schedule_);
    validate(schedule_);
    fsdp_actions_ = true;
  }
  micro_idx_.clear();
  micro_targets_.clear();
  micro_weights_.clear();
  // Context parallelism: every stage holds this rank's slice of the
  // sequences (one shard object for all its parts), and each micro-batch's
  // loss is weighed as train::loss weighs it.
  const std::shared_ptr<nn::SequenceShard>& slices = parts_.begin()->second->sequence_shard();
  for (int i = 0; i < m; ++i) {
    Tensor x = ops::contiguous(ops::narrow(idx, 0, i * bm, bm)), y = ops::contiguous(ops::narrow(targets, 0, i * bm, bm));
    if (slices) {
      std::tie(x, y) = slices->shard_batch(x, y);
      micro_weights_.push_back(slices->weigh_loss(ones({}, DType::F64, x.device())));
    }
    micro_idx_.push_back(x);
    micro_targets_.push_back(y);
  }
  const int64_t T = micro_idx_[0].size(1);  // this rank's tokens of a sequence
  token_share_ = 1.0 / m;  // equal micro-batches: each holds 1/m of the batch's tokens
  flight_.clear();
  losses_.assign(static_cast<size_t>(m), Tensor());
  const Tensor w = parts_.begin()->second->parameters()[0];
  const DType act = options_.activation_dtype.value_or(w.dtype());
  const Device device = w.device();
  auto rank_of = [&](int st) { return schedule_.stage_rank[static_cast<size_t>(st)]; };

  std::map<std::pair<int, int>, std::pair<Tensor, dist::WorkPtr>> recv_f, recv_b;
  std::vector<dist::WorkPtr> sends;
  std::map<int, int> in_flight;
  max_in_flight_ = 0;
  static const trace::Lane lane = trace::register_lane("pipeline"), bubble = trace::register_lane("pipeline bubble");
  const double start = trace::now_us();
  double idle_since = start, busy = 0;
  // Times one compute action: the wait before it (the bubble), then itself.
  auto timed = [&](const Action& a, const std::function<void()>& work) {
    const double t0 = trace::now_us();
    work();
    const double t1 = trace::now_us();
    busy += t1 - t0;
    if (trace::enabled()) {
      if (t0 > idle_since) trace::record(bubble, "idle", idle_since, t0);
      trace::record(lane, action_str(a), t0, t1);
    }
    idle_since = t1;
  };
  for (const Action& a : schedule_.actions[static_cast<size_t>(me)]) {
    const std::pair<int, int> key{a.stage, a.microbatch};
    switch (a.type) {
      case ActionType::RecvF: {
        Tensor buf = activation_buffer(bm, T, act, device);
        recv_f[key] = {buf, group_->recv(buf, rank_of(a.stage - 1), message_tag(a, schedule_))};
        break;
      }
      case ActionType::RecvB: {
        Tensor buf = activation_buffer(bm, T, act, device);
        recv_b[key] = {buf, group_->recv(buf, rank_of(a.stage + 1), message_tag(a, schedule_))};
        break;
      }
      case ActionType::Forward: {
        Tensor input;
        if (a.stage == 0) {
          input = micro_idx_[static_cast<size_t>(a.microbatch)];
        } else if (rank_of(a.stage - 1) == me) {  // the previous stage is here (interleaved on one rank)
          input = autograd::detach(flight_.at({a.stage - 1, a.microbatch}).output);
          input.set_requires_grad(true);
        } else {
          auto& [buf, work] = recv_f.at(key);
          work->wait();
          input = as_activation(buf, bm, T);
          input.set_requires_grad(true);
          recv_f.erase(key);
        }
        timed(a, [&] { forward(a.stage, a.microbatch, input); });
        max_in_flight_ = std::max(max_in_flight_, ++in_flight[a.stage]);
        break;
      }
      case ActionType::SendF:
        sends.push_back(group_->send(piece_of(flight_.at(key).output), rank_of(a.stage + 1), message_tag(a, schedule_)));
        break;
      case ActionType::Backward:
      case ActionType::BackwardInput: {
        InFlight& f = flight_.at(key);
        if (a.stage + 1 < S) {
          if (rank_of(a.stage + 1) == me) {
            f.grad_output = flight_.at({a.stage + 1, a.microbatch}).input.grad();
          } else {
            auto& [buf, work] = recv_b.at(key);
            work->wait();
            f.grad_output = as_activation(buf, bm, T);
            recv_b.erase(key);
          }
        }
        const bool whole = a.type == ActionType::Backward;
        timed(a, [&] { whole ? backward(a.stage, a.microbatch) : backward_input(a.stage, a.microbatch); });
        if (whole) --in_flight[a.stage];  // a split backward's activations go with its W
        // What the next stage needed is done with (its input gradient was taken above).
        if (a.stage + 1 < S && rank_of(a.stage + 1) == me) done_with_input({a.stage + 1, a.microbatch});
        f.output = Tensor();
        f.grad_output = Tensor();
        if (a.stage == 0) done_with_input(key);  // the first stage's input is token ids: nothing to send back
        break;
      }
      case ActionType::BackwardWeight: {
        timed(a, [&] { backward_weight(a.stage, a.microbatch); });
        --in_flight[a.stage];
        if (!flight_.at(key).input.defined()) flight_.erase(key);
        break;
      }
      case ActionType::Unshard:  // all-gathers issued now, each waited for by its group's first forward
        for (nn::Module* m : sharded_modules(a.stage)) fsdp::unshard(*m, /*async_op=*/true);
        break;
      case ActionType::ReduceGrad:
        if (fsdp::is_fully_sharded(*parts_.at(a.stage))) fsdp::reduce_gradients(*parts_.at(a.stage));
        break;
      case ActionType::Reshard:
        for (nn::Module* m : sharded_modules(a.stage)) fsdp::reshard(*m);
        break;
      case ActionType::SendB:
        // The message holds the input's gradient until it is sent; the input goes now.
        sends.push_back(group_->send(piece_of(flight_.at(key).input.grad()), rank_of(a.stage - 1),
                                     message_tag(a, schedule_)));
        done_with_input(key);
        break;
    }
  }
  for (auto& s : sends) s->wait();
  const double end = trace::now_us();
  if (trace::enabled() && end > idle_since) trace::record(bubble, "idle", idle_since, end);
  time_ = {end - start, busy};
  // The loss: the last stage's micro-batch losses summed in order, shared with every rank.
  Tensor loss = zeros({}, DType::F64, device);
  if (parts_.count(S - 1) != 0)
    for (const Tensor& l : losses_) loss = ops::add(loss, ops::to(ops::reshape(l, {}), DType::F64));
  losses_.clear();
  flight_.clear();
  if (group_->size() > 1) group_->broadcast(loss, rank_of(S - 1))->wait();
  return loss;
}

PipelinedModel::PipelinedModel(std::shared_ptr<Pipeline> pipeline)
    : nn::LanguageModel(pipeline->config()), pipeline_(std::move(pipeline)) {
  for (const auto& [s, part] : pipeline_->parts()) register_module(fmt::format("stage{}", s), part);
}

std::vector<std::pair<std::string, Tensor>> PipelinedModel::named_parameters(bool recurse) const {
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& [s, part] : pipeline_->parts())
    for (auto& named : part->named_parameters(recurse)) out.push_back(std::move(named));
  return out;
}

nn::StateDict PipelinedModel::state_dict() {
  nn::StateDict out;
  for (const auto& [s, part] : pipeline_->parts())
    for (auto& entry : part->state_dict()) out.push_back(std::move(entry));
  return out;
}

Tensor PipelinedModel::embed(const Tensor&) {
  throw Error("PipelinedModel::embed: a pipelined model's parts are on its stages (call forward)");
}

Tensor PipelinedModel::head(const Tensor&) {
  throw Error("PipelinedModel::head: a pipelined model's parts are on its stages (call forward)");
}

}  // namespace tessera::pp
