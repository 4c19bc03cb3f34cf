#!/usr/bin/env bash
# tessera-train's configuration and the tools' inputs, end to end:
#   every bad value (from the command line or a TOML file) is an error that
#     names the key, before any data is read or any step runs;
#   a TOML file with sections sets what the run reports (under mpirun too);
#   --help prints the usage (tessera-train's lists the presets) on stdout and
#     exits 0 (tessera-train, tessera-data, tessera-generate, tessera-ckpt);
#   llm.c token shards written by an independent writer (write_llmc_shard.py)
#     are read by tessera-data and tessera-train, and bad ones (wrong magic,
#     wrong version, llm.c's Llama-3 format, truncated, trailing bytes) are
#     rejected naming the file and what was expected.
set -euo pipefail
bin=$1      # build/tools
work=$2
src=$(cd "$(dirname "$0")/../.." && pwd)  # the source tree (hardware/)
here=$(cd "$(dirname "$0")" && pwd)
python=${TESSERA_PYTHON:-python3}
rm -rf "$work"
mkdir -p "$work"
cd "$work"
mpi=(mpirun --oversubscribe --allow-run-as-root --bind-to none)
fail() { echo "FAIL: $*" >&2; exit 1; }
base=(--preset tiny --training.data_dir "$work/data" --metrics.progress off --sample.max_new_tokens 0)

# expect_error WANT CMD...: CMD fails and its output contains WANT.
expect_error() {
  local want=$1; shift
  local out
  if out=$("$@" 2>&1); then fail "expected an error for: $*"; fi
  [[ $out == *"$want"* ]] || fail "expected '$want' in the output of: $*
$out"
}
# bad WANT ARGS...: tessera-train rejects the configuration (exit 2, the
# configuration-error exit) quickly, naming the key, with no step run and no
# data prepared.
bad() {
  local want=$1; shift
  local out rc=0 start=$SECONDS
  out=$(timeout 60 "$bin/tessera-train" "${base[@]}" --job.dump_folder "$work/bad" "$@" 2>&1) || rc=$?
  [[ $rc == 2 ]] || fail "expected exit 2 (configuration error) for: $*; got $rc:
$out"
  [[ $out == *"$want"* ]] || fail "expected '$want' for: $*; got:
$out"
  ! grep -qE '^(step |preparing|model |data: )' <<< "$out" || fail "ran before failing: $*
$out"
  (( SECONDS - start < 20 )) || fail "took $((SECONDS - start)) s to reject: $*"
}

echo "== sizes that overflow or cannot fit: refused up front, naming the keys"
# Each value is valid alone; their products crashed (SIGSEGV, SIGFPE) or were
# killed by the kernel's OOM killer after minutes.
bad "training.batch_size x training.seq_len = 4611686018427387904 x 64 overflows a 64-bit integer" \
  --training.batch_size 4611686018427387904 --training.grad_accum 2
bad "model.vocab_size x model.n_embd = 4611686018427387904 x 64 overflows" \
  --model.vocab_size 4611686018427387904
bad "model.n_embd = 4294967296 x" --model.n_embd 4294967296 --model.n_head 1
bad "training.steps x training.batch_size = 9223372036854775807 x 8 overflows" \
  --training.steps 9223372036854775807
bad "training.eval_batches must be at most 1000000 (batches per validation run), got 4611686018427387904" \
  --training.eval_batches 4611686018427387904
bad "training.eval_batches must be at most 1000000" --training.eval_batches 1000001
bad "sample.max_new_tokens must be at most 1000000 (tokens a sample prints), got 1000001" \
  --sample.max_new_tokens 1000001
bad "model.n_layer x" --model.n_layer 4611686018427387904
bad "the planned peak does not fit: each rank needs" --model.n_embd 65536
bad "the model and batch cannot fit in memory: each rank needs at least" --model.n_embd 65536 \
  --job.check_memory false
bad "sharded over 1 rank(s)" --model.n_layer 1000000000
bad "of logits for 1000000 x 1000 tokens x model.vocab_size 256" --job.check_memory false \
  --training.batch_size 1000000 --training.seq_len 1000
# The suggested batch sizes stay positive at the top of the range (was a negative one).
expect_error "x ranks (2): e.g. --training.batch_size 9223372036854775806" \
  "${mpi[@]}" -np 2 "$bin/tessera-train" "${base[@]}" --training.batch_size 9223372036854775807 \
  --training.seq_len 1 --training.steps 1 --training.eval_batches 1
# The planner issue's example: every rank refuses at once, nothing is allocated.
start=$SECONDS
out=$("${mpi[@]}" -np 4 "$bin/tessera-train" "${base[@]}" --model.n_embd 65536 2>&1) && fail "4 ranks ran a model that cannot fit"
[[ $out == *"the planned peak does not fit"* && $out == *"predicted peak"* && $out == *"Settings nearby:"* ]] ||
  fail "4 ranks: expected the plan in the refusal, got:
$out"
(( SECONDS - start < 30 )) || fail "4 ranks took $((SECONDS - start)) s to refuse a model that cannot fit"
# Above the floor but not the plan (activations: 4096 x 1024 tokens, about 44 GiB):
# refused with the plan and the nearest settings, each planned.
bad "the planned peak does not fit: each rank needs" --training.batch_size 4096 --training.seq_len 1024
bad "--training.grad_accum 2 " --training.batch_size 4096 --training.seq_len 1024
expect_error "--activation_checkpoint.mode full" "$bin/tessera-train" "${base[@]}" \
  --training.batch_size 4096 --training.seq_len 1024 --job.dump_folder "$work/bad"
# --dry-run prints the same plan and exits 0 without allocating it.
out=$("$bin/tessera-train" "${base[@]}" --training.batch_size 4096 --training.seq_len 1024 --dry-run)
[[ $out == *"predicted peak"* && $out == *"micro-batch 4096 x 1024 tokens"* ]] || fail "--dry-run printed:
$out"
out=$("$bin/tessera-plan" "${base[@]}" --ranks 1,4 --rank 0)
[[ $(grep -c "predicted peak" <<< "$out") == 2 ]] || fail "tessera-plan --ranks 1,4 printed:
$out"
expect_error "--ranks: expected an integer from 1" "$bin/tessera-plan" --ranks 0
expect_error "training.batch_size (8) must be a multiple" "$bin/tessera-plan" "${base[@]}" --ranks 3
expect_error "reshard_after_forward_degree (3) must divide the shard degree (4 at 4 ranks)" \
  "$bin/tessera-plan" "${base[@]}" --ranks 4 --parallelism.reshard_after_forward_degree 3
# The step time: without this machine's collective fits, the command that makes them.
expect_error "bench_collectives 16 --save" env TESSERA_CACHE_DIR="$work/no-cache" "$bin/tessera-plan" \
  "${base[@]}" --ranks 2 --time
out=$(TESSERA_CACHE_DIR="$work/cache" "$bin/tessera-plan" "${base[@]}" --time 2>&1)
grep -q "^step time (this machine" <<< "$out" || fail "tessera-plan --time printed:
$out"
out=$("$bin/tessera-plan" "${base[@]}" --ranks 8 --hardware "$src/hardware/h100-sxm-node.toml")
grep -q "the planned peak fits" <<< "$out" || fail "tessera-plan --hardware printed:
$out"
expect_error "hardware file 'nothing.toml' does not exist" "$bin/tessera-plan" --hardware nothing.toml
# A bf16 plan names the dtype its products were planned in: this CPU's by
# default; another CPU's with --bf16-products, whose f32 copies raise the
# peak; TESSERA_CPU_ISA=baseline plans as a CPU without bf16 GEMM kernels or
# the own f32 kernel (which, with AVX2 alone, widens bf16 as it packs it).
bf16=("${base[@]}" --mixed_precision.param_dtype bfloat16)
peak_of() { awk '/predicted peak/ { print $3 }' <<< "$1"; }
native=$("$bin/tessera-plan" "${bf16[@]}" --bf16-products native)
amx=$("$bin/tessera-plan" "${bf16[@]}" --bf16-products amx)
own=$("$bin/tessera-plan" "${bf16[@]}" --bf16-products own)
copies=$("$bin/tessera-plan" "${bf16[@]}" --bf16-products f32)
capped=$(TESSERA_CPU_ISA=baseline "$bin/tessera-plan" "${bf16[@]}")
grep -q "^bf16 matrix products: in bf16 (as a CPU with oneDNN's AVX512-BF16 kernels" <<< "$native" || fail "native: $native"
grep -q "^bf16 matrix products: in bf16 (as a CPU with AMX tiles" <<< "$amx" || fail "amx: $amx"
grep -q "^bf16 matrix products: in bf16 widened as Tessera's f32 kernel packs them (as an AVX2 CPU" <<< "$own" ||
  fail "own: $own"
grep -q "^bf16 matrix products: in f32 copies (as a CPU without bf16 kernels or AVX2" <<< "$copies" || fail "f32: $copies"
grep -q "^bf16 matrix products: in f32 copies (oneDNN has no bf16 GEMM kernels under TESSERA_CPU_ISA=baseline)" \
  <<< "$capped" || fail "capped: $capped"
"$bin/tessera-plan" "${bf16[@]}" |
  grep -qE "^bf16 matrix products: in (bf16 \(this CPU's (AMX tiles|oneDNN (AMX|AVX512-BF16))|bf16 widened as Tessera's f32 kernel packs them \((this CPU has neither|oneDNN has no bf16 GEMM kernels under TESSERA_CPU_ISA=)|f32 copies \((this CPU has neither|oneDNN has no bf16 GEMM kernels under TESSERA_CPU_ISA=))" ||
  fail "the default bf16 plan does not name this CPU's products"
awk -v a="$(peak_of "$native")" -v b="$(peak_of "$copies")" 'BEGIN { exit !(b > a) }' ||
  fail "f32 copies should raise the bf16 peak: $(peak_of "$native") vs $(peak_of "$copies") MiB"
# The AMX kernel's packed operands add to the peak (nothing for this small
# model, whose products are one tile wide: docs/fsdp_numbers.sh shows the
# default model's 1.5 MiB), less than f32 copies do.
awk -v a="$(peak_of "$native")" -v m="$(peak_of "$amx")" -v b="$(peak_of "$copies")" 'BEGIN { exit !(a <= m && m < b) }' ||
  fail "AMX's packed operands: expected native <= amx < f32 copies, got $(peak_of "$native") $(peak_of "$amx") $(peak_of "$copies") MiB"
[[ $(peak_of "$capped") == $(peak_of "$copies") ]] || fail "capped $(peak_of "$capped") != f32 copies $(peak_of "$copies")"
"$bin/tessera-plan" "${base[@]}" | grep -q "^bf16 matrix products" && fail "an f32 plan names bf16 products"
expect_error "--bf16-products: expected cpu (as this CPU runs them), native, amx, own or f32, got 'avx'" \
  "$bin/tessera-plan" "${bf16[@]}" --bf16-products avx
expect_error "--bf16-products plans another CPU's memory; it does not go with --hardware" "$bin/tessera-plan" \
  "${bf16[@]}" --bf16-products f32 --hardware "$src/hardware/h100-sxm-node.toml"

# A configuration file is a regular file of a few KiB (toml++ read these as empty).
bad "config file '$work' is not a regular file but a directory" --config "$work"
bad "config file '/dev/zero' is not a regular file" --config /dev/zero
head -c 2000000 /dev/zero | tr '\0' '#' > big.toml
bad "config file 'big.toml' is 2000000 bytes" --config big.toml
# The other tools name the argument they could not use.
expect_error "list needs one PATH (a checkpoint directory, a folder of checkpoints or a .safetensors file), got 0" \
  "$bin/tessera-ckpt" list
expect_error "--step expects a step number in [0, 999999999999999999], got '-4'" \
  "$bin/tessera-ckpt" from-safetensors in.safetensors out --step -4
expect_error "text file '$work' is a directory" "$bin/tessera-data" prepare --out "$work/d" "$work"
expect_error "text file '/dev/zero' is not a regular file" "$bin/tessera-data" prepare --out "$work/d" /dev/zero
expect_error "token shard '/dev/zero' is not a regular file" "$bin/tessera-data" info /dev/zero
echo "overflowing and oversized configurations refused naming the keys"

echo "== bad values on the command line"
# Crashes before (SIGFPE, NaN) or silently accepted.
bad "model.n_head must be >= 1, got 0" --model.n_head 0
bad "model.gelu = tanh applies to model.arch = gpt2" --model.arch llama --model.gelu tanh
bad "config key 'model.gelu' has no choice 'fast' (valid: exact, tanh)" --model.gelu fast
bad "model.n_head must be >= 1, got -4" --model.n_head -4
bad "training.eval_interval must be >= 1" --training.eval_interval 0
bad "training.eval_batches must be >= 1, got 0" --training.eval_batches 0
bad "model.n_layer must be >= 1, got 0" --model.n_layer 0
bad "model.n_embd must be >= 1, got -64" --model.n_embd -64
bad "model.n_embd must be >= 1, got 0" --model.n_embd 0
bad "model.vocab_size must be >= 1, got 0" --model.vocab_size 0
bad "model.vocab_size (100) must be at least 256 for byte tokens" --model.vocab_size 100
bad "model.ffn_hidden must be >= 0" --model.ffn_hidden -1
bad "model.n_kv_head must be >= 0" --model.n_kv_head -1
bad "training.seq_len must be >= 1, got 0" --training.seq_len 0
bad "training.batch_size must be >= 1" --training.batch_size 0
bad "training.steps must be >= 1, got 0" --training.steps 0
bad "training.steps must be >= 1, got -5" --training.steps -5
bad "training.grad_accum must be >= 1, got 0" --training.grad_accum 0
bad "training.batch_size (6) must be a multiple of training.grad_accum (4)" \
  --training.batch_size 6 --training.grad_accum 4
bad "training.max_norm must be >= 0" --training.max_norm -1
# Consistency between keys.
bad "model.n_embd (100) must be divisible by model.n_head (3)" --model.n_embd 100 --model.n_head 3
bad "model.n_kv_head (3) must divide model.n_head (8)" --preset llama-small --model.n_kv_head 3
# Mixtures of experts: refused before any rank allocates, naming the key.
bad "model.moe_top_k must be in [1, model.moe_experts = 8], got 9" --preset moe-small --model.moe_top_k 9
bad "model.moe_experts (8) must be divisible by parallelism.expert_parallel_degree (3)" --preset moe-small \
  --parallelism.expert_parallel_degree 3
bad "parallelism.expert_parallel_degree 2 splits the experts of MoE layers, but the model is dense" \
  --parallelism.expert_parallel_degree 2
bad "model.moe_experts applies to model.arch = llama" --model.moe_experts 4
bad "model.moe_router" --preset moe-small --model.moe_router tanh
bad "trains under FSDP, HSDP, tensor and expert parallelism so far; with parallelism.pipeline_parallel_degree 2" \
  --preset moe-small --model.tie_embeddings false --parallelism.pipeline_parallel_degree 2
bad "model.n_kv_head (16) must divide model.n_head (8)" --preset llama-small --model.n_kv_head 16
bad "needs an even head size for rotary embeddings, but model.n_embd / model.n_head = 24 / 8 = 3" \
  --preset llama-small --model.n_embd 24
bad "model.n_kv_head (1) applies to model.arch = llama only" --model.n_kv_head 1
bad "model.rope needs an even head size, but model.n_embd / model.n_head = 12 / 4 = 3" \
  --model.rope true --model.n_embd 12 --model.n_head 4
bad "model.rope_theta must be > 0, got 0" --model.rope_theta 0
bad "checkpoint.allow_resume_change: 'model.n_layer' is not a key a resume insists on (valid: job.seed" \
  --checkpoint.allow_resume_change job.seed,model.n_layer
bad "model.dropout must be in [0, 1), got 1" --model.dropout 1
bad "model.dropout must be in [0, 1), got -0.1" --model.dropout -0.1
bad "training.dataset = text needs training.text" --training.dataset text
bad "training.dataset = shards needs training.train_shard and training.val_shard" \
  --training.dataset shards --training.train_shard a.bin
bad "training.text is 'book.txt' but training.dataset is 'fortunes'" --training.text book.txt
bad "training.train_shard is 'a.bin' but training.dataset is 'fortunes'" --training.train_shard a.bin
bad "training.data_dir must not be empty" --training.data_dir ""
# Sampling: rejected before training, not after it.
bad "sample.top_k must be >= 0" --sample.top_k -1
bad "sample.temperature must be in [0, 100] (0 = greedy; above 100 every token is about as likely), got -0.5" --sample.temperature -0.5
bad "sample.max_new_tokens must be >= 0" --sample.max_new_tokens -1
bad "sample.prompt must not be empty when sample.max_new_tokens is 5" \
  --sample.prompt "" --sample.max_new_tokens 5
# Optimizer and schedule.
bad "optimizer.lr must be > 0, got 0" --optimizer.lr 0
bad "optimizer.lr must be > 0, got -0.001" --optimizer.lr -1e-3
bad "config key 'optimizer.lr' expects a finite number, got 'nan'" --optimizer.lr nan
bad "config key 'optimizer.lr' expects a finite number, got 'inf'" --optimizer.lr inf
bad "optimizer.beta1 must be in [0, 1), got 1" --optimizer.beta1 1
bad "optimizer.beta2 must be in [0, 1), got 1.5" --optimizer.beta2 1.5
bad "optimizer.eps must be > 0, got 0" --optimizer.eps 0
bad "optimizer.weight_decay must be >= 0, got -0.1" --optimizer.weight_decay -0.1
bad "optimizer.lr x optimizer.weight_decay must be < 1" --optimizer.lr 0.5 --optimizer.weight_decay 2
bad "optimizer.momentum must be in [0, 1), got 1" --optimizer.name sgd --optimizer.momentum 1
bad "lr_scheduler.warmup_steps must be >= 0, got -1" --lr_scheduler.warmup_steps -1
bad "lr_scheduler.min_lr_ratio must be in [0, 1]" --lr_scheduler.min_lr_ratio 1.5
# Checkpoints, metrics, profiling, parallelism.
bad "checkpoint.interval must be >= 1, got 0" --checkpoint.interval 0
bad "checkpoint.keep must be >= 0" --checkpoint.keep -1
bad "checkpoint.folder must not be empty" --checkpoint.folder ""
bad "metrics.log_interval must be >= 1, got 0" --metrics.log_interval 0
bad "config key 'metrics.peak_tflops' expects a finite number, got 'inf'" --metrics.peak_tflops inf
bad "metrics.peak_tflops must be >= 0 (0 = this CPU's, measured), got -1" --metrics.peak_tflops -1
bad "profiling.trace_steps names step 200, but training.steps is 150" --profiling.trace_steps 200
bad "profiling.trace_steps expects step numbers >= 1" --profiling.trace_steps 0
bad "parallelism.data_parallel_replicate_degree must be >= 1, got 0" \
  --parallelism.data_parallel_replicate_degree 0
bad "parallelism.data_parallel_shard_degree must be -1 or >= 1, got 0" \
  --parallelism.data_parallel_shard_degree 0
# Types and names.
bad "config key 'training.steps' expects an integer, got '3.5'" --training.steps 3.5
bad "config key 'checkpoint.enable' expects true or false, got 'yes'" --checkpoint.enable yes
bad "unknown config key 'training.stepz' (did you mean 'training.steps'?)" --training.stepz 5
bad "unknown config key 'training.number_of_iterations' (the keys of [training] are: batch_size, batch_tokens, seq_len, steps," \
  --training.number_of_iterations 5
bad "unknown config key 'trainer.batch': there is no section 'trainer' (sections: job, model, training," \
  --trainer.batch 5
echo "bad values: all rejected before training, naming the key"

echo "== TOML files"
$python -c '
import random
random.seed(3)
words = "the quick brown fox jumps over a lazy dog while seven wise owls watch from old oak trees".split()
with open("book.txt", "w") as f:
    for _ in range(600):
        f.write(" ".join(random.choice(words) for _ in range(12)).capitalize() + ".\n")'
cat > run.toml <<EOF
# Sections as tessera-train --help lists them.
[job]
name = "toml-run"
dump_folder = "tomlrun"
seed = 7

[model]
arch = "llama"
n_layer = 3
n_head = 4
n_kv_head = 2
n_embd = 48

[training]
dataset = "text"
text = "book.txt"
data_dir = "$work/data"
batch_size = 4
seq_len = 32
steps = 3
eval_interval = 2
eval_batches = 1

[optimizer]
lr = 0.004
weight_decay = 0.0

[lr_scheduler]
warmup_steps = 0
min_lr_ratio = 1.0  # a constant learning rate

[metrics]
log_interval = 1
progress = "off"
plot = ""

[sample]
max_new_tokens = 0
EOF
# The file after a preset overrides it; a key after the file overrides the file.
"${mpi[@]}" -np 2 "$bin/tessera-train" --preset tiny --config run.toml --optimizer.lr 0.003 > toml.log
cat toml.log
grep -q "model llama: 3 layers, d=48" toml.log || fail "the TOML [model] section was not applied"
grep -q "128 tokens/step (4 sequences, 2 per rank" toml.log || fail "the TOML [training] batch was not applied"
grep -q "preparing book" toml.log || fail "the TOML training.text was not used"
grep -q "^done: 3 steps" toml.log || fail "the TOML training.steps was not applied"
$python -c '
import json
rows = [json.loads(l) for l in open("tomlrun/metrics.jsonl")]
logged = [r for r in rows if "loss" in r]
assert [r["step"] for r in logged] == [1, 2, 3], logged            # metrics.log_interval = 1
assert all(r["lr"] == 0.003 for r in logged), logged               # constant lr, the CLI value
assert all(r["ranks"] == 2 for r in logged), logged
assert [r["step"] for r in rows if "val_loss" in r] == [2, 3], rows  # training.eval_interval = 2
print("TOML run: steps", [r["step"] for r in logged], "lr", logged[0]["lr"])'

echo "== learning-rate schedules: warmup-stable-decay ending past the run, tanh GELU"
# 8 steps of a schedule whose decay ends at step 10: 2 warmup steps, stable
# for the first half of the 8 after them, then linear to 0.1 x lr at step 10.
"$bin/tessera-train" "${base[@]}" --training.steps 8 --metrics.log_interval 1 --metrics.plot "" \
  --optimizer.lr 0.01 --lr_scheduler.name wsd --lr_scheduler.warmup_steps 2 --lr_scheduler.decay_steps 10 \
  --lr_scheduler.decay_ratio 0.5 --lr_scheduler.min_lr_ratio 0.1 --model.gelu tanh \
  --job.dump_folder "$work/wsd" > wsd.log || fail "the wsd run failed: $(cat wsd.log)"
$python -c '
import json, sys
logged = [json.loads(l) for l in open(sys.argv[1]) if "\"loss\"" in l]
got = [r["lr"] for r in logged]
def lr(step):  # step from 0
    if step < 2: return 0.01 * (step + 1) / 2
    p = (step - 2) / 8
    return 0.01 if p < 0.5 else 0.01 + (0.001 - 0.01) * (p - 0.5) / 0.5
want = [lr(s) for s in range(8)]
assert want[7] < want[6] == 0.01 and len(got) == 8 and all(abs(a - b) <= 1e-12 * b for a, b in zip(got, want)), (got, want)
print("wsd schedule: lr", got)' "$work/wsd/metrics.jsonl"
# The resolved configuration: --print-config prints it as --config reads it,
# the run folder keeps it, and it is the metrics' first record.
wsd_args=(--training.steps 8 --metrics.log_interval 1 --metrics.plot "" --optimizer.lr 0.01 --lr_scheduler.name wsd
          --lr_scheduler.warmup_steps 2 --lr_scheduler.decay_steps 10 --lr_scheduler.decay_ratio 0.5
          --lr_scheduler.min_lr_ratio 0.1 --model.gelu tanh --job.dump_folder "$work/wsd")
"$bin/tessera-train" "${base[@]}" "${wsd_args[@]}" --print-config > printed.toml
cmp printed.toml "$work/wsd/config.toml" || fail "the run folder's config.toml is not what --print-config prints"
grep -q '^gelu = "tanh"' printed.toml && grep -q '^decay_steps = 10' printed.toml || fail "print-config: $(cat printed.toml)"
"$bin/tessera-train" --config printed.toml --print-config > again.toml
cmp printed.toml again.toml || fail "--print-config's output read back with --config prints differently"
[[ ! -e "$work/printed" ]] || fail "--print-config made a folder"
head -1 "$work/wsd/metrics.jsonl" | $python -c '
import json, sys
r = json.loads(sys.stdin.readline())
assert r["config"]["lr_scheduler.name"] == "wsd" and r["config"]["model.gelu"] == "tanh", r'
# The example configs in configs/ are valid as they are, and plan.
for f in "$src"/configs/*.toml; do
  "$bin/tessera-train" --config "$f" --print-config > example.toml || fail "$f: $(cat example.toml)"
  "$bin/tessera-train" --config example.toml --print-config | cmp - example.toml || fail "$f does not round-trip"
done
"$bin/tessera-plan" --config "$src/configs/llama-hsdp-bf16.toml" --ranks 4 | grep -q "(HSDP 2 x 2)" ||
  fail "configs/llama-hsdp-bf16.toml does not plan as HSDP 2 x 2 at 4 ranks"
"$bin/tessera-plan" --config "$src/configs/gpt2-124m.toml" --ranks 8 | grep -q "gpt2 124439808 parameters" ||
  fail "configs/gpt2-124m.toml is not GPT-2 124M"
# Each run's own folder: out/<model.arch>-<dataset> unless named; a run on
# other data leaves the first run's files alone.
mkdir -p folders && cd folders
"$bin/tessera-train" --print-config | grep -q '^dump_folder = "out/gpt2-fortunes"$' ||
  fail "the default run folder is not out/gpt2-fortunes"
"$bin/tessera-train" --preset tiny --print-config | grep -q '^dump_folder = "out/gpt2-fortunes-tiny"$' ||
  fail "the tiny preset's run folder is not its own (out/gpt2-fortunes-tiny)"
"$bin/tessera-train" --preset llama-small --training.dataset text --training.text my.book.txt --print-config |
  grep -q '^name = "llama-my.book"$' || fail "the run name does not follow the model and the text"
"$bin/tessera-train" --job.name exp1 --print-config | grep -q '^dump_folder = "out/exp1"$' ||
  fail "job.name does not name the folder"
"$bin/tessera-train" "${base[@]}" --training.steps 2 --metrics.log_interval 1 --checkpoint.enable true > first.log
run=out/gpt2-fortunes-tiny
cp $run/metrics.jsonl first.jsonl
"$bin/tessera-train" "${base[@]}" --training.steps 2 --training.dataset shards \
  --training.train_shard "$work/data/book_train.bin" --training.val_shard "$work/data/book_val.bin" > second.log
cmp $run/metrics.jsonl first.jsonl || fail "a run on other data overwrote the first run's metrics"
[[ -f out/gpt2-book-tiny/metrics.jsonl && -f out/gpt2-book-tiny/config.toml ]] || fail "no out/gpt2-book-tiny: $(ls -R out)"
# No later command rewrites a run's records: an evaluation (either way of naming
# the weights) and tessera-generate leave them byte for byte; an evaluation's
# go to <run>/eval-<k>/.
records=(status.json metrics.jsonl config.toml loss.png)
(cd $run && md5sum "${records[@]}") > records.md5
(cd $run && find checkpoint -type f | sort | xargs md5sum) > checkpoint.md5
"$bin/tessera-train" "${base[@]}" --eval-only --checkpoint.resume true > eval1.log
"$bin/tessera-train" "${base[@]}" --eval-only --checkpoint.initial_load_path $run/checkpoint > eval2.log
"$bin/tessera-generate" --checkpoint $run/checkpoint --sample.max_new_tokens 5 > /dev/null 2>&1
# The other commands that read a run: the checkpoint listed, planned,
# exported; the run's own config planned.
"$bin/tessera-ckpt" list $run/checkpoint > /dev/null
"$bin/tessera-ckpt" read-plan $run/checkpoint --ranks 3 > /dev/null
"$bin/tessera-ckpt" to-safetensors $run/checkpoint exported.safetensors > /dev/null
"$bin/tessera-ckpt" to-hf $run/checkpoint exported-hf > /dev/null
"$bin/tessera-plan" --config $run/config.toml --ranks 2 > /dev/null
(cd $run && md5sum -c --quiet "$OLDPWD/records.md5") || fail "an evaluation, a sample or a tool rewrote the run's records"
(cd $run && md5sum -c --quiet "$OLDPWD/checkpoint.md5") || fail "a command changed the run's checkpoint files"
[[ -f $run/eval-1/metrics.jsonl && -f $run/eval-2/status.json ]] || fail "the evaluations' records are not in eval-1, eval-2"
grep -q '"eval_only"' $run/eval-2/metrics.jsonl || fail "eval-2 holds no evaluation: $(cat $run/eval-2/metrics.jsonl)"
# A new run in the folder (not a resume; its checkpoints moved aside by hand)
# keeps the earlier run's records in earlier/1/; a refused launch moves
# nothing: its status says it failed and keeps the run's under "previous".
mv $run/checkpoint ck-aside
"$bin/tessera-train" "${base[@]}" --training.steps 1 > third.log
grep -q "records in $run .* moved to $run/earlier/1" third.log || fail "the third run did not say where the records went"
(cd $run/earlier/1 && md5sum -c --quiet "$OLDPWD/records.md5") || fail "earlier/1 does not hold the first run's records"
cp $run/metrics.jsonl third-metrics.jsonl
for steps in 0 -1; do  # twice: the second keeps the run's status, not the first refusal
  bad "training.steps must be >= 1" --job.dump_folder $run --training.steps $steps
done
[[ ! -e $run/earlier/2 ]] || fail "a refused launch moved the third run's records: $(ls -R $run)"
cmp -s $run/metrics.jsonl third-metrics.jsonl || fail "a refused launch changed the third run's metrics"
"$python" - $run/status.json <<'PY' || fail "the refused launch's status: $(cat $run/status.json)"
import json, sys
s = json.load(open(sys.argv[1]))
assert s["status"] == "failed" and s["exit_code"] == 2 and "got -1" in s["error"], s
assert s["previous"]["status"] == "completed" and "previous" not in s["previous"], s
PY
# Arguments that did not read name no folder: nothing is written anywhere.
"$bin/tessera-train" "${base[@]}" --job.dump_folder $run --optimizer.lr nan > /dev/null 2>&1 && fail "lr nan ran"
grep -q "got -1" $run/status.json || fail "a launch whose arguments did not read wrote a status"
# Flags win over presets and config files, wherever they stand.
for args in "--training.batch_size 7 --preset tiny" "--preset tiny --training.batch_size 7" \
            "--training.batch_size 7 --config $work/example.toml --preset tiny"; do
  "$bin/tessera-train" $args --print-config | grep -q '^batch_size = 7$' ||
    fail "--training.batch_size 7 lost to a preset or config file: $args"
done
cd "$work"
# A batch given in tokens (llm.c's -d) is whole sequences.
"$bin/tessera-train" "${base[@]}" --training.seq_len 32 --training.batch_tokens 384 --print-config > bt.toml
grep -q '^batch_size = 12$' bt.toml || fail "training.batch_tokens 384 at seq_len 32 did not give 12 sequences: $(grep batch bt.toml)"
bad "training.batch_tokens (500) must be a positive multiple of training.seq_len (64): the batch is whole sequences, e.g. --training.batch_tokens 448" \
  --training.batch_tokens 500
# overfit_batch: one batch again and again is learned (the loss falls far
# below the first step's), and the samples come at sample.interval too.
"$bin/tessera-train" "${base[@]}" --training.steps 150 --training.overfit_batch true --optimizer.lr 0.01 \
  --lr_scheduler.name constant --lr_scheduler.warmup_steps 5 --metrics.log_interval 10 --metrics.plot "" \
  --sample.interval 75 \
  --sample.max_new_tokens 8 --job.dump_folder "$work/overfit" > overfit.log || fail "overfit run: $(cat overfit.log)"
$python -c '
import json, sys
losses = [json.loads(l)["loss"] for l in open(sys.argv[1]) if "\"loss\"" in l]
assert len(losses) == 16 and losses[-1] < 0.1 * losses[0], (losses[0], losses[-1])  # 5.54 -> 0.12 measured
print("overfit_batch: loss %.3f -> %.3f" % (losses[0], losses[-1]))' "$work/overfit/metrics.jsonl"
grep -q -- "--- sample at step 75 (temperature" overfit.log || fail "no sample at step 75: $(cat overfit.log)"
[[ $(grep -c -- "^--- sample" overfit.log) == 2 ]] || fail "expected a sample at step 75 and one at the end"
bad "lr_scheduler.decay_steps (5) must be greater than lr_scheduler.warmup_steps (5)" \
  --lr_scheduler.decay_steps 5 --lr_scheduler.warmup_steps 5
bad "lr_scheduler.decay_ratio must be in (0, 1], got 0" --lr_scheduler.decay_ratio 0
bad "config key 'lr_scheduler.name' has no choice 'step' (valid: cosine, linear, constant, wsd)" --lr_scheduler.name step

toml_bad() {  # WANT TOML-TEXT: a file with TOML-TEXT is rejected with WANT.
  printf '%s\n' "$2" > bad.toml
  bad "$1" --config bad.toml
}
toml_bad "config file 'bad.toml': key 'training.steps' expects an integer, got a string (\"3\")" \
  $'[training]\nsteps = "3"'
toml_bad "key 'training.steps' expects an integer, got a floating-point number (3.5)" $'[training]\nsteps = 3.5'
toml_bad "key 'optimizer.lr' expects a number, got a string (\"0.1\")" $'[optimizer]\nlr = "0.1"'
toml_bad "key 'checkpoint.enable' expects true or false, got a string (\"true\")" $'[checkpoint]\nenable = "true"'
toml_bad "key 'checkpoint.enable' expects true or false, got an integer (1)" $'[checkpoint]\nenable = 1'
toml_bad "key 'model.arch' expects a string, got an integer (2)" $'[model]\narch = 2'
toml_bad "key 'training.steps' expects an integer, got an array" $'[training]\nsteps = [1, 2]'
toml_bad "model.n_head must be >= 1, got 0" $'[model]\nn_head = 0'
toml_bad "unknown config key 'training.bogus' (the keys of [training] are: " $'[training]\nbogus = 1'
toml_bad "unknown config key 'trainer.steps' (did you mean 'training.steps'?)" $'[trainer]\nsteps = 1'
toml_bad "unknown config key 'schedule.warmup': there is no section 'schedule' (sections: job, model," \
  $'[schedule]\nwarmup = 10'
toml_bad "config file 'bad.toml': 'steps' must be a [section]" 'steps = 3'
toml_bad "config file 'bad.toml': " $'[training]\nsteps = '
bad "config file 'missing.toml' does not exist" --config missing.toml
# An integer is a fine float.
printf '[optimizer]\nlr = 1\nweight_decay = 0\n' > int_float.toml
bad "optimizer.beta1 must be in [0, 1)" --config int_float.toml --optimizer.beta1 2
echo "TOML: sections applied, bad files rejected naming the key"

echo "== --help"
out=$("$bin/tessera-train" --help 2>/dev/null) || fail "tessera-train --help exited non-zero"
for p in default tiny llama-small gpt-medium; do
  grep -qE "^  $p +" <<< "$out" || fail "tessera-train --help does not list the preset $p"
done
grep -q -- "--training.steps" <<< "$out" || fail "tessera-train --help does not list the keys"
grep -q -- "--config FILE.toml" <<< "$out" || fail "tessera-train --help does not show --config"
out=$("$bin/tessera-data" --help 2>/dev/null) || fail "tessera-data --help exited non-zero"
[[ $out == *"usage: tessera-data prepare"* ]] || fail "tessera-data --help printed no usage on stdout"
"$bin/tessera-data" info --help | grep -q "usage: tessera-data" || fail "tessera-data info --help"
rc=0; "$bin/tessera-data" > /dev/null 2> usage.err || rc=$?
[[ $rc == 2 ]] && grep -q "usage: tessera-data" usage.err || fail "tessera-data without a command: want usage on stderr, exit 2"
"$bin/tessera-generate" --help | grep -q "usage: tessera-generate" || fail "tessera-generate --help"
"$bin/tessera-ckpt" --help | grep -q "usage: tessera-ckpt" || fail "tessera-ckpt --help: want usage on stdout, exit 0"
echo "--help: usage on stdout, exit 0"

echo "== llm.c shards from an independent writer"
shard() { $python "$here/write_llmc_shard.py" "$1" "$2" "$3"; }
head -n 540 book.txt > train.txt
tail -n 60 book.txt > val.txt
shard train.bin gpt2 train.txt
shard val.bin gpt2 val.txt
"$bin/tessera-data" info train.bin val.bin > info.txt
cat info.txt
n=$(wc -c < train.txt)
grep -q "train.bin: llm.c shard version 1, $n tokens" info.txt || fail "info: wrong token count for train.bin"
grep -q "(byte tokens)" info.txt || fail "info: byte tokens not recognised"
shard eot.bin gpt2-eot val.txt
"$bin/tessera-data" info eot.bin | grep -q "token ids 10..50256 (needs a vocabulary > 256)" \
  || fail "info: GPT-2 token ids not reported"
"$bin/tessera-train" "${base[@]}" --training.steps 2 --training.dataset shards \
  --training.train_shard train.bin --training.val_shard val.bin --job.dump_folder llmc > llmc.log
grep -q "^done: 2 steps" llmc.log || fail "training on the llm.c shards did not finish: $(cat llmc.log)"
grep -q "data: $n train tokens" llmc.log || fail "training read another token count: $(cat llmc.log)"
expect_error "outside model.vocab_size 256" "$bin/tessera-train" "${base[@]}" --training.dataset shards \
  --training.train_shard eot.bin --training.val_shard val.bin --job.dump_folder llmc-eot

shard magic.bin bad-magic val.txt
shard version.bin bad-version val.txt
shard llama3.bin llama3 val.txt
shard truncated.bin truncated val.txt
shard short.bin short val.txt
shard trailing.bin trailing val.txt
expect_error "token shard 'magic.bin' has magic 20240521, expected 20240520: not an llm.c token shard" \
  "$bin/tessera-data" info magic.bin
expect_error "token shard 'version.bin' has version 2, expected 1" "$bin/tessera-data" info version.bin
expect_error "token shard 'llama3.bin' is in llm.c's Llama-3 format (magic 20240801, version 7: uint32 tokens), which tessera does not read" \
  "$bin/tessera-data" info llama3.bin
expect_error "token shard 'truncated.bin' is truncated: header promises" "$bin/tessera-data" info truncated.bin
expect_error "token shard 'short.bin' is truncated: 600 bytes, the llm.c header alone needs 1024" \
  "$bin/tessera-data" info short.bin
expect_error "token shard 'trailing.bin' is longer than its header says" "$bin/tessera-data" info trailing.bin
# A header that claims 2^31 - 1 tokens is checked against the file's size before
# anything is allocated: refused within 64 MiB of the program's own peak, not 4 GiB.
shard huge.bin huge-claim val.txt
expect_error "token shard 'huge.bin' is truncated: header promises 2147483647 tokens" \
  "$bin/tessera-data" info huge.bin
/usr/bin/time -f "%M" -o base.rss "$bin/tessera-data" info val.bin > /dev/null
/usr/bin/time -f "%M" -o huge.rss "$bin/tessera-data" info huge.bin 2> /dev/null || true
(( $(tail -1 huge.rss) < $(tail -1 base.rss) + 65536 )) ||
  fail "a shard claiming 2^31 tokens took $(tail -1 huge.rss) KiB to reject ($(tail -1 base.rss) KiB to read a valid one)"
expect_error "token shard '$work' is a directory" "$bin/tessera-data" info "$work"
for f in llama3 magic version truncated; do
  expect_error "token shard '$f.bin'" "$bin/tessera-train" "${base[@]}" --training.dataset shards \
    --training.train_shard $f.bin --training.val_shard val.bin --job.dump_folder "llmc-$f"
done
expect_error "llm.c's Llama-3 format" "${mpi[@]}" -np 2 "$bin/tessera-train" "${base[@]}" \
  --training.dataset shards --training.train_shard train.bin --training.val_shard llama3.bin --job.dump_folder llmc-np2
echo "llm.c shards: read by tessera-data and tessera-train; bad ones rejected naming the file"

# Text files of the same name, or a file edited: the cached shards
# (data/<stem>_train.bin) are prepared again, never read as the other text's.
mkdir -p same1 same2
"$python" -c "
import random; random.seed(1)
open('same1/notes.txt','w').write(''.join(random.choice('abc \n') for _ in range(20000)))
open('same2/notes.txt','w').write(''.join(random.choice('xyz0123456789 \n') for _ in range(40000)))"
text=(--preset tiny --metrics.progress off --sample.max_new_tokens 0 --training.steps 1 --training.dataset text)
tokens_of() { sed -nE 's/^data: ([0-9]+) train tokens.*/\1/p' "$1"; }
"$bin/tessera-train" "${text[@]}" --training.text same1/notes.txt --job.dump_folder same-a > same-a.log
"$bin/tessera-train" "${text[@]}" --training.text same2/notes.txt --job.dump_folder same-b > same-b.log
grep -q "those held tokens of other text: prepared again" same-b.log || fail "other text reused the cache: $(cat same-b.log)"
[[ $(tokens_of same-a.log) == 18000 && $(tokens_of same-b.log) == 36000 ]] ||
  fail "train tokens $(tokens_of same-a.log) and $(tokens_of same-b.log), expected 18000 and 36000"
echo "more" >> same2/notes.txt
"$bin/tessera-train" "${text[@]}" --training.text same2/notes.txt --job.dump_folder same-c > same-c.log
grep -q "prepared again" same-c.log || fail "an edited text reused the cache"
"$bin/tessera-train" "${text[@]}" --training.text same2/notes.txt --job.dump_folder same-d > same-d.log
grep -q "preparing" same-d.log && fail "the same text was prepared again"

# A new run in a folder whose checkpoints were trained with another tokenizer
# may not replace the tokenizer.json they are read with; the earlier run's
# records keep a copy of it.
"$python" - "$src/tests/fixtures/bpe/tokenizer.json" <<'PY'
import json, sys
t = json.load(open(sys.argv[1])); v = t['model']['vocab']
letters = [c for c in 'abcdefghijklmnopqrstuvwxyz' if c in v]; ids = [v[c] for c in letters]
for c, i in zip(letters, ids[1:] + ids[:1]): v[c] = i
json.dump(t, open('rotated.json', 'w'))
PY
bpe_run=(--preset tiny --metrics.progress off --sample.max_new_tokens 0 --model.vocab_size 1024 --job.dump_folder tk)
"$bin/tessera-train" "${bpe_run[@]}" --training.steps 2 --training.tokenizer "$src/tests/fixtures/bpe/tokenizer.json" \
  --checkpoint.enable true --checkpoint.interval 2 > tk.log
expect_error "tk/checkpoint holds a checkpoint of another run (step-00000002), which was trained with the tokenizer in tk/tokenizer.json" \
  "$bin/tessera-train" "${bpe_run[@]}" --training.steps 1 --training.tokenizer rotated.json
[[ ! -d tk/earlier ]] || fail "a refused run moved the records"
cmp -s tk/tokenizer.json "$src/tests/fixtures/bpe/tokenizer.json" || fail "a refused run replaced tokenizer.json"
"$bin/tessera-train" "${bpe_run[@]}" --training.steps 1 > tk2.log
cmp -s tk/earlier/1/tokenizer.json "$src/tests/fixtures/bpe/tokenizer.json" || fail "no copy of the tokenizer in earlier/1"
cmp -s tk/tokenizer.json "$src/tests/fixtures/bpe/tokenizer.json" || fail "the checkpoints' tokenizer.json left the folder"
echo "text caches and tokenizers: another text prepares its own tokens; a checkpoint's tokenizer is never replaced"

echo "== the fourth probe: a tokenizer's ids never read as bytes, non-finite weights, a stop signal in evaluation"
# A run with a tokenizer records its fingerprint in each checkpoint and in the
# exported file: without a tokenizer.json beside them tessera-generate refuses
# (the ids are not bytes); another tokenizer file is named in a warning.
"$bin/tessera-generate" --checkpoint tk/checkpoint --sample.max_new_tokens 3 --sample.prompt "the" > tk-gen.out 2> tk-gen.err ||
  fail "tessera-generate on a BPE run's checkpoint: $(cat tk-gen.err)"
grep -q "tokenizer .*tk/tokenizer.json" tk-gen.err || fail "the run folder's tokenizer was not used: $(cat tk-gen.err)"
mkdir -p alone && cp -r tk/checkpoint alone/
"$bin/tessera-ckpt" to-safetensors tk/checkpoint alone/tk.safetensors > /dev/null
for weights in alone/checkpoint alone/tk.safetensors; do
  expect_error "was trained with a tokenizer (" "$bin/tessera-generate" --checkpoint $weights --sample.max_new_tokens 3
done
"$bin/tessera-ckpt" from-safetensors alone/tk.safetensors alone/from-st > /dev/null 2>&1
expect_error "was trained with a tokenizer (" "$bin/tessera-generate" --checkpoint alone/from-st --sample.max_new_tokens 3
"$bin/tessera-generate" --checkpoint alone/checkpoint --tokenizer rotated.json --sample.max_new_tokens 3 \
  > /dev/null 2> rotated.err || fail "tessera-generate --tokenizer rotated.json: $(cat rotated.err)"
grep -q "rotated.json is not the tokenizer file the model was trained with" rotated.err ||
  fail "another tokenizer was not named: $(cat rotated.err)"
"$bin/tessera-generate" --checkpoint alone/checkpoint --tokenizer tk/tokenizer.json --sample.max_new_tokens 3 \
  > /dev/null 2> same.err
! grep -q "warning" same.err || fail "the run's own tokenizer drew a warning: $(cat same.err)"

# NaN or infinite weights are refused by every tool that uses them, at 2
# ranks too (every rank learns the count: none waits alone in a collective).
"$bin/tessera-ckpt" to-safetensors folders/ck-aside finite.safetensors > /dev/null
"$python" - finite.safetensors nan.safetensors inf.safetensors <<'PY'
import json, struct, sys
data = open(sys.argv[1], 'rb').read()
n = struct.unpack('<Q', data[:8])[0]
header = json.loads(data[8:8 + n])
name = sorted(k for k in header if k != '__metadata__' and header[k]['dtype'] == 'F32')[0]
at = 8 + n + header[name]['data_offsets'][0] + 4 * 5  # the sixth element
for path, value in ((sys.argv[2], float('nan')), (sys.argv[3], float('-inf'))):
    open(path, 'wb').write(data[:at] + struct.pack('<f', value) + data[at + 4:])
print(name)
PY
for f in nan inf; do
  expect_error "weight tensor holds NaN or infinite values" "$bin/tessera-generate" --checkpoint $f.safetensors
  expect_error "$f.safetensors: 1 weight tensor holds NaN or infinite values" timeout 120 "$bin/tessera-train" \
    "${base[@]}" --training.steps 1 --checkpoint.initial_load_path $f.safetensors --job.dump_folder run-$f
done
expect_error "1 weight tensor holds NaN or infinite values" timeout 120 "${mpi[@]}" -np 2 "$bin/tessera-train" \
  "${base[@]}" --training.steps 1 --checkpoint.initial_load_path nan.safetensors --job.dump_folder run-nan2
"$bin/tessera-ckpt" from-safetensors nan.safetensors nan-ckpt > /dev/null 2>&1
expect_error "weight tensor holds NaN or infinite values" "$bin/tessera-generate" --checkpoint nan-ckpt
expect_error "weight tensor holds NaN or infinite values" "$bin/tessera-train" "${base[@]}" --eval-only \
  --checkpoint.initial_load_path nan-ckpt --job.dump_folder eval-nan

# The step to-safetensors records: a note when another is chosen, a warning for one that is no count.
"$bin/tessera-ckpt" from-safetensors finite.safetensors st-ckpt > st.log 2>&1
grep -q "was saved at step 2; the checkpoint is step 0 (--step 2 continues the count)" st.log ||
  fail "from-safetensors did not name the saved step: $(cat st.log)"
"$python" - finite.safetensors badstep.safetensors <<'PY'
import json, struct, sys
data = open(sys.argv[1], 'rb').read()
n = struct.unpack('<Q', data[:8])[0]
header = json.loads(data[8:8 + n])
header['__metadata__']['tessera_step'] = '2.5e3'
text = json.dumps(header).encode()
text += b' ' * ((8 - len(text) % 8) % 8)
open(sys.argv[2], 'wb').write(struct.pack('<Q', len(text)) + text + data[8 + n:])
PY
"$bin/tessera-ckpt" from-safetensors badstep.safetensors badstep-ckpt > badstep.log 2>&1 ||
  fail "from-safetensors refused a file for its tessera_step: $(cat badstep.log)"
grep -q "tessera_step '2.5e3' is not a step count; ignored" badstep.log || fail "tessera_step: $(cat badstep.log)"

# A pipe in place of a checkpoint's data file: refused, not waited on.
cp -r folders/ck-aside fifo-ck
data=$(ls fifo-ck/step-*/rank-00000.bin | head -1)
rm "$data" && mkfifo "$data"
expect_error "is not a regular file" timeout 30 "$bin/tessera-generate" --checkpoint fifo-ck
expect_error "is not a regular file" timeout 30 "$bin/tessera-ckpt" to-safetensors fifo-ck fifo.safetensors

# A stop signal during evaluation ends it at the next batch: --eval-only exits
# 130 with the status interrupted; a training run saves its checkpoint and
# records no validation loss for the cut evaluation. More batches than the
# validation split has windows are named.
wait_for() {  # wait_for PATTERN FILE: up to 60 s
  for _ in $(seq 600); do grep -q -- "$1" "$2" 2>/dev/null && return 0; sleep 0.1; done
  fail "no '$1' in $2: $(cat "$2")"
}
# signal_run PATTERN PAUSE SIGNAL LOG ARGS...: tessera-train ARGS in the
# background, sent SIGNAL PAUSE seconds after PATTERN appears in LOG; sets
# rc to its exit code and took to the seconds it took to stop.
signal_run() {
  local pattern=$1 pause=$2 sig=$3 log=$4; shift 4
  "$bin/tessera-train" "$@" > "$log" 2>&1 &
  local pid=$!
  wait_for "$pattern" "$log"
  sleep "$pause"
  local start=$SECONDS
  kill -"$sig" $pid
  rc=0; wait $pid || rc=$?
  took=$((SECONDS - start))
}
signal_run "^weights from" 1 INT evalstop.log "${base[@]}" --eval-only --checkpoint.initial_load_path folders/ck-aside \
  --training.eval_batches 1000000 --job.dump_folder evalstop
[[ $rc == 130 ]] || fail "eval-only + SIGINT: exit $rc: $(tail -3 evalstop.log)"
(( took < 20 )) || fail "eval-only took $took s to stop"
grep -q "status: evaluation interrupted by SIGINT (exit 130)" evalstop.log || fail "eval-only: $(tail -3 evalstop.log)"
grep -q '"status": "interrupted"' evalstop/status.json || fail "eval-only: status $(cat evalstop/status.json)"
grep -q "note: training.eval_batches 1000000 x [0-9]* sequences read [0-9]* windows, but the validation split has" \
  evalstop.log || fail "the wrap-around was not named: $(cat evalstop.log)"
signal_run "^model" 2 TERM evaltrain.log "${base[@]}" --training.steps 5 --training.eval_interval 1 \
  --training.eval_batches 1000000 --checkpoint.enable true --job.dump_folder evaltrain
[[ $rc == 143 ]] || fail "training + SIGTERM in evaluation: exit $rc: $(tail -3 evaltrain.log)"
grep -q "interrupted (SIGINT/SIGTERM) after step 1: checkpoint saved" evaltrain.log || fail "$(tail -3 evaltrain.log)"
[[ -f evaltrain/checkpoint/step-00000001/metadata.json ]] || fail "no checkpoint at step 1: $(ls -R evaltrain)"
! grep -q val_loss evaltrain/metrics.jsonl || fail "a cut evaluation was recorded: $(grep val_loss evaltrain/metrics.jsonl)"
# And a long sample at the end of a run: stopped at the next token; the run completed.
signal_run "^--- sample" 1 INT samplestop.log "${base[@]}" --training.steps 1 --sample.max_new_tokens 1000000 \
  --sample.prompt "a" --job.dump_folder samplestop
[[ $rc == 0 ]] || fail "SIGINT in the final sample: exit $rc: $(tail -3 samplestop.log)"
grep -q "^--- (stopped by a signal)" samplestop.log || fail "the sample did not stop: $(tail -c 300 samplestop.log)"
grep -q '"status": "completed"' samplestop/status.json || fail "sample stop: status $(cat samplestop/status.json)"
echo "tokenizer records, non-finite weights, tessera_step, a pipe as data file, stop signals in evaluation and samples"

echo "== the fifth probe: output files that collide or block, imports over a run's checkpoints, a resume's tokenizer"
# A symbolic-link loop as the run folder: refused (it aborted in the handler).
ln -s loop-b loop-a && ln -s loop-a loop-b
for flag in "" --eval-only; do
  rc=0; timeout 60 "$bin/tessera-train" "${base[@]}" --job.dump_folder loop-a $flag > loop.log 2>&1 || rc=$?
  [[ $rc == 2 ]] || fail "a link loop as job.dump_folder ($flag): exit $rc: $(cat loop.log)"
  grep -q "Too many levels of symbolic links" loop.log || fail "$(cat loop.log)"
done
# Pipes and devices where a run reads a text or a tokenizer, or writes its metrics: refused, never waited on.
mkfifo pipe
for text in pipe /dev/zero; do
  expect_error "'$text' is not a regular file" timeout 60 "$bin/tessera-train" "${base[@]}" --job.dump_folder text-run \
    --training.dataset text --training.text $text
done
bad "metrics.jsonl '$work/pipe' exists and is not a regular file" --metrics.jsonl "$work/pipe"
rc=0; timeout 60 "$bin/tessera-train" "${bpe_run[@]}" --training.steps 3 --training.tokenizer pipe > pipe.log 2>&1 || rc=$?
[[ $rc == 2 ]] && grep -q "'pipe' is not a regular file" pipe.log || fail "a pipe as tokenizer: exit $rc: $(cat pipe.log)"
# Output files that name each other, a record, or lie in the checkpoint folder.
bad "metrics.jsonl '$work/bad/config.toml' is the run's config.toml" --metrics.jsonl config.toml
bad "metrics.jsonl '$work/bad/status.json' is the run's status.json" --metrics.jsonl status.json
bad "metrics.plot '$work/bad/metrics.jsonl' is metrics.jsonl" --metrics.plot metrics.jsonl
bad "checkpoint.export_safetensors '$work/bad/metrics.jsonl' is metrics.jsonl" \
  --checkpoint.export_safetensors metrics.jsonl
bad "lies in the checkpoint folder" --checkpoint.export_safetensors checkpoint/model.safetensors
# An import into a folder that holds checkpoints (it replaced step-N, or
# pointed `latest` back); an export into the checkpoint it reads; a step no
# folder name can hold.
cp -r tk/checkpoint imported
"$bin/tessera-ckpt" to-safetensors tk/checkpoint tk2.safetensors > /dev/null
md5sum imported/*/* imported/latest > imported.md5
expect_error "imported already holds checkpoints (the newest is step-00000002)" \
  "$bin/tessera-ckpt" from-safetensors tk2.safetensors imported --step 2
expect_error "already holds checkpoints" "$bin/tessera-ckpt" from-safetensors tk2.safetensors imported --step 1
expect_error "already holds checkpoints" "$bin/tessera-ckpt" from-hf "$src/tests/fixtures/hf-gpt2" imported
for out in imported/step-00000002/rank-00000.bin imported/step-00000002/x.safetensors; do
  expect_error "lies inside the checkpoint" "$bin/tessera-ckpt" to-safetensors imported $out
done
expect_error "is the checkpoint folder's \`latest\`" "$bin/tessera-ckpt" to-safetensors imported imported/latest
expect_error "lies inside the checkpoint" "$bin/tessera-ckpt" to-hf imported imported/step-00000002/hf
md5sum -c --quiet imported.md5 || fail "a refused import or export changed the checkpoint"
expect_error "--step expects a step number in [0, 999999999999999999], got '9223372036854775807'" \
  "$bin/tessera-ckpt" from-safetensors tk2.safetensors big-step --step 9223372036854775807
[[ ! -e big-step ]] || fail "a refused import wrote big-step"
# A resume continues on the run's tokenizer: without one (byte ids) or with
# another it is refused before the copy beside the checkpoints is replaced.
expect_error "tk/checkpoint/step-00000002 was trained with a tokenizer (1024 tokens, fingerprint" \
  "$bin/tessera-train" "${bpe_run[@]}" --training.steps 3 --checkpoint.enable true --checkpoint.resume true
expect_error "this run's training.tokenizer rotated.json is another" "$bin/tessera-train" "${bpe_run[@]}" \
  --training.steps 3 --checkpoint.enable true --checkpoint.resume true --training.tokenizer rotated.json
cmp -s tk/tokenizer.json "$src/tests/fixtures/bpe/tokenizer.json" || fail "a refused resume replaced tokenizer.json"
# A control character in a string setting is escaped in config.toml, which
# reads back; a resume then checks its settings (the checks were skipped).
"$bin/tessera-train" "${base[@]}" --training.steps 2 --checkpoint.enable true --checkpoint.interval 2 \
  --job.dump_folder ctrl --sample.prompt $'Q:\r\x01' > /dev/null
"$bin/tessera-train" --config ctrl/config.toml --print-config | grep -qF 'prompt = "Q:\u000D\u0001"' ||
  fail "config.toml: $(grep prompt ctrl/config.toml | od -c | head -3)"
expect_error "training.batch_size 8 -> 4" "$bin/tessera-train" "${base[@]}" --training.steps 3 \
  --checkpoint.enable true --job.dump_folder ctrl --checkpoint.resume true --sample.prompt $'Q:\r\x01' \
  --training.batch_size 4
# The smaller findings: what the messages name.
expect_error "hardware file 'loop-a' cannot be read: Too many levels of symbolic links" \
  "$bin/tessera-plan" "${base[@]}" --hardware loop-a
expect_error "a validation fraction of 1e-300 of a corpus of" \
  "$bin/tessera-data" prepare --out "$work/tiny-split" --val-fraction 1e-300 "$src/README.md"
"$python" - tk2.safetensors null-tok.safetensors <<'PY'
import json, struct, sys
raw = open(sys.argv[1], 'rb').read(); n = struct.unpack('<Q', raw[:8])[0]
header = json.loads(raw[8:8 + n]); header['__metadata__']['tessera_tokenizer'] = 'null'
h = json.dumps(header).encode(); h += b' ' * (-len(h) % 8)
open(sys.argv[2], 'wb').write(struct.pack('<Q', len(h)) + h + raw[8 + n:])
PY
expect_error "tessera_tokenizer: the record of the tokenizer the weights were trained with must be" \
  "$bin/tessera-generate" --checkpoint null-tok.safetensors --sample.max_new_tokens 2
expect_error "tessera_tokenizer must be" "$bin/tessera-ckpt" from-safetensors null-tok.safetensors null-tok-ckpt
# A temperature no one samples with on purpose, and string settings that are
# not UTF-8 (config.toml, which is TOML, cannot hold them): refused by name.
bad "sample.temperature must be in [0, 100]" --sample.temperature 1e308
bad "sample.temperature must be in [0, 100]" --sample.temperature 100.5
expect_error "sample.temperature must be in [0, 100]" \
  "$bin/tessera-generate" --checkpoint tk2.safetensors --sample.max_new_tokens 2 --sample.temperature 1e308
for text in $'Q:\xff' $'\xc0\xaf' $'\xed\xa0\x80' $'ab\xe2\x82' $'\xf4\x90\x80\x80' $'\x80'; do
  bad "config key 'sample.prompt' must be UTF-8 text" --sample.max_new_tokens 2 --sample.prompt "$text"
done
bad "config key 'job.name' must be UTF-8 text (config.toml holds only UTF-8), but byte 3 (0xFE)" \
  --job.name $'run\xfe'
"$bin/tessera-train" "${base[@]}" --training.steps 1 --job.dump_folder utf8 --job.name $'r\xc3\xa9\xe2\x82\xac\xf0\x9d\x84\x9e' > /dev/null
"$bin/tessera-train" --config utf8/config.toml --print-config | grep -qF $'name = "r\xc3\xa9\xe2\x82\xac\xf0\x9d\x84\x9e"' ||
  fail "a UTF-8 job.name did not round-trip: $(grep name utf8/config.toml)"
echo "link loops, pipes, colliding outputs, imports over checkpoints, exports into them, a resume's tokenizer, temperatures, UTF-8"

echo "== the sixth probe: a refused resume, outputs over inputs, two launches, saved settings, shards, hosts"
# A resume that fails before it trains (a load_step it lacks, a batch it
# refuses, a model that does not load) leaves the finished run's records:
# config.toml and the metrics as they were, the status "failed" with the
# completed one under "previous".
"$bin/tessera-train" "${base[@]}" --training.steps 4 --checkpoint.enable true --checkpoint.interval 2 \
  --job.dump_folder done > /dev/null
cp done/config.toml done.config.toml && cp done/metrics.jsonl done.metrics.jsonl
for change in "--checkpoint.load_step 2 --optimizer.lr 0.01" "--training.batch_size 4" "--model.n_layer 3"; do
  rc=0
  "$bin/tessera-train" "${base[@]}" --training.steps 4 --checkpoint.enable true --job.dump_folder done \
    --checkpoint.resume true $change > refused.log 2>&1 || rc=$?
  [[ $rc != 0 ]] || fail "a resume with $change ran: $(tail -3 refused.log)"
  cmp -s done/config.toml done.config.toml || fail "a refused resume ($change) rewrote config.toml"
  cmp -s done/metrics.jsonl done.metrics.jsonl || fail "a refused resume ($change) added to metrics.jsonl"
  "$python" - done/status.json "$change" <<'PY' || fail "status after a refused resume ($change): $(cat done/status.json)"
import json, sys
s = json.load(open(sys.argv[1]))
assert s["status"] == "failed" and s["previous"]["status"] == "completed", s
PY
done
# Outputs may not be what a run reads, the data cache, a checkpoint's files
# or another run's records.
printf 'the cat sat on the mat\n%.0s' {1..200} > book.txt
cp book.txt book.before
expect_error "metrics.jsonl '$work/book.txt' is training.text 'book.txt', which the run reads" \
  "$bin/tessera-train" "${base[@]}" --training.steps 1 --job.dump_folder over --training.dataset text \
  --training.text book.txt --metrics.jsonl "$work/book.txt"
cmp -s book.txt book.before || fail "a refused run wrote over its training text"
ln -sf book.txt book-link.txt
expect_error "is training.text 'book-link.txt'" "$bin/tessera-train" "${base[@]}" --training.steps 1 \
  --job.dump_folder over --training.dataset text --training.text book-link.txt --metrics.jsonl "$work/book.txt"
expect_error "lies in training.data_dir $work/data" "$bin/tessera-train" "${base[@]}" --training.steps 1 \
  --job.dump_folder over --metrics.jsonl "$work/data/fortunes_val.bin"
expect_error "lies in the checkpoint $work/done/checkpoint/step-00000002 (it holds a metadata.json)" \
  "$bin/tessera-train" "${base[@]}" --training.steps 1 --job.dump_folder over \
  --metrics.jsonl "$work/done/checkpoint/step-00000002/metadata.json"
expect_error "lies in the checkpoint" "$bin/tessera-train" "${base[@]}" --training.steps 1 --job.dump_folder over \
  --checkpoint.export_safetensors "$work/done/checkpoint/step-00000004/rank-00000.bin"
expect_error "lies in $work/done, another run's folder" "$bin/tessera-train" "${base[@]}" --training.steps 1 \
  --job.dump_folder over --metrics.jsonl "$work/done/metrics.jsonl"
cmp -s done/metrics.jsonl done.metrics.jsonl || fail "a refused run wrote another run's metrics"
# Two launches into one folder: the second is refused while the first runs,
# and writes nothing there.
"$bin/tessera-train" "${base[@]}" --training.steps 400 --job.dump_folder busy > busy.log 2>&1 &
first=$!
for _ in $(seq 1 300); do grep -q '"running"' busy/status.json 2> /dev/null && break; sleep 0.1; done
rc=0; "$bin/tessera-train" "${base[@]}" --training.steps 2 --job.dump_folder busy --job.seed 9 > second.log 2>&1 || rc=$?
kill -INT $first 2> /dev/null; wait $first || true
[[ $rc == 2 ]] && grep -q "busy is in use by another tessera-train launch (pid $first)" second.log ||
  fail "a second launch into a busy folder: exit $rc: $(cat second.log)"
grep -q 'seed = 9' busy/config.toml && fail "the refused second launch wrote its config.toml"
[[ ! -e busy/earlier ]] || fail "the refused second launch moved the first run's records"
# A checkpoint whose saved settings are missing, empty or hold none cannot be checked: refused.
for edit in absent empty comment; do
  rm -rf "cfg-$edit" && cp -r done "cfg-$edit"
  "$python" - "cfg-$edit/checkpoint/step-00000004/metadata.json" $edit <<'PY'
import json, sys
p, edit = sys.argv[1], sys.argv[2]; m = json.load(open(p))
if edit == "absent": del m["extra"]["config"]
else: m["extra"]["config"] = "" if edit == "empty" else "# saved settings\n"
json.dump(m, open(p, "w"))
PY
  want="holds no saved configuration (its metadata's extra.config is $edit)"
  [[ $edit == comment ]] && want="the configuration saved with the checkpoint holds no settings"
  expect_error "$want" "$bin/tessera-train" "${base[@]}" --training.steps 6 --checkpoint.enable true \
    --job.dump_folder "cfg-$edit" --checkpoint.resume true --training.batch_size 2
done
# Validation on training data: one shard as both, or one text twice in a split.
"$bin/tessera-data" prepare --out shards --name once book.txt > /dev/null
ln -sf once_train.bin shards/also_train.bin
for val in shards/once_train.bin shards/also_train.bin; do
  bad "training.train_shard 'shards/once_train.bin' and training.val_shard '$val' are the same file" \
    --training.dataset shards --training.train_shard shards/once_train.bin --training.val_shard $val
done
expect_error "'book.txt' and 'book-link.txt' are the same file" \
  "$bin/tessera-data" prepare --out shards --name twice book.txt book-link.txt
for name in a/b .. .; do
  expect_error "must be a plain file name" "$bin/tessera-data" prepare --out shards --name "$name" book.txt
done
# A host name no host has (Open MPI's mpirun overran a buffer on one of 300 characters).
printf '%s slots=1\n' "$(printf 'a%.0s' {1..300})" > long-hosts
expect_error "long-hosts line 1: 'aaaa" "$bin/tessera-run" --hostfile long-hosts --launcher "${mpi[*]}" -- \
  "${base[@]}" --training.steps 1
printf 'node;rm slots=1\n' > odd-hosts
expect_error "is not a host name" "$bin/tessera-run" --hostfile odd-hosts --launcher "${mpi[*]}" -- "${base[@]}"
printf 'localhost slots=1\n' > one-host
expect_error "--launcher none runs one process: --hostfile one-host needs a launcher" \
  "$bin/tessera-run" --hostfile one-host --launcher none -- "${base[@]}"
# NUL characters, subnormal numbers, and what the messages name.
printf '[job]\nname = "a\\u0000b"\n' > nul.toml
bad "config key 'job.name' must not hold a NUL character (U+0000), found at byte 1" --config nul.toml
bad "expects a number of magnitude 0 or between 2.2e-308 and 1.8e308" --training.max_norm 1e-320
expect_error "bytes exceeds the limit of 104857600 (not a safetensors file? Its first 8 bytes give" \
  "$bin/tessera-generate" --checkpoint done/checkpoint/step-00000004/metadata.json --sample.max_new_tokens 1
rm -rf tok-rec && cp -r done tok-rec
"$python" - tok-rec/checkpoint/step-00000004/metadata.json <<'PY'
import json, sys
m = json.load(open(sys.argv[1])); m["extra"]["tokenizer"] = {"size": -1, "fingerprint": "zz"}
json.dump(m, open(sys.argv[1], "w"))
PY
expect_error "the checkpoint's tokenizer record {\"fingerprint\":\"zz\",\"size\":-1} is malformed" \
  "$bin/tessera-train" "${base[@]}" --training.steps 6 --checkpoint.enable true --job.dump_folder tok-rec \
  --checkpoint.resume true
echo "refused resumes keep records, outputs over inputs, busy folders, saved settings, shards, hosts, NUL, messages"

echo "config_test: all passed"
