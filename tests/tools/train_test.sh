#!/usr/bin/env bash
# End-to-end tests of the command-line tools on the tiny preset:
#   tessera-train under mpirun at 1, 2 and 4 ranks (and a 2x2 HSDP mesh): the
#     loss falls, and every rank count gives the same losses (f32 tolerance),
#     every thread count bitwise the same; Llama with tensor parallelism 2
#     (alone, and under FSDP 2 x TP 2) the same losses as on one rank;
#   resume from a checkpoint equals the straight run (bitwise at the same
#     rank count, with dropout: the RNG is restored; f32 tolerance on another);
#     a changed batch or seed is refused, a changed schedule warned about;
#   a fresh run from a bf16 .safetensors export (--checkpoint.initial_load_path,
#     tied weight stored once) on another rank count starts at the exported
#     loss and ends below the unigram baseline; mismatched files are named;
#   traces (events on the all-gather and reduce-scatter lanes of every rank),
#     JSONL metrics, the loss curve, the safetensors export;
#   config errors name the key; a killed rank ends the job with an error from
#     mpirun or the surviving rank, not a hang;
#   tessera-generate is deterministic and produces the asked number of tokens;
#   tessera-ckpt lists and converts (from-safetensors: to the model's dtype,
#     tied weights filled in); tessera-data prepares and checks shards;
#   a tokenizer.json (byte-level BPE) through tessera-data, tessera-train's
#     text dataset and samples, tessera-generate and tessera-ckpt's HF folders.
set -euo pipefail
bin=$1      # build/tools
work=$2
src=$(cd "$(dirname "$0")/../.." && pwd)
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$work"
mkdir -p "$work"
cd "$work"
mpi=(mpirun --oversubscribe --allow-run-as-root --bind-to none)
fail() { echo "FAIL: $*" >&2; exit 1; }
tiny=(--preset tiny --training.steps 40 --metrics.log_interval 10 --training.data_dir "$work/data"
      --sample.max_new_tokens 0 --metrics.progress off)
train() { local np=$1; shift; "${mpi[@]}" -np "$np" "$bin/tessera-train" "${tiny[@]}" "$@"; }
# The logged losses of a run, one per line (full precision, from the JSONL file).
losses() { python3 -c '
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "loss" in r: print(r["step"], repr(r["loss"]))' "$1/metrics.jsonl"; }
# Same steps, losses equal within a relative tolerance.
close() { python3 -c '
import sys
a = [l.split() for l in open(sys.argv[1])]; b = [l.split() for l in open(sys.argv[2])]
assert [x[0] for x in a] == [x[0] for x in b], (a, b)
bad = [(x, y) for x, y in zip(a, b) if abs(float(x[1]) - float(y[1])) > float(sys.argv[3]) * abs(float(x[1]))]
sys.exit("differ: %s" % bad if bad else 0)' "$1" "$2" "$3"; }
# Two .safetensors files hold the same tensors (names, dtypes, shapes, bytes).
same_tensors() { python3 -c '
import json, struct, sys
def tensors(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8:8 + n])
    return {k: (v["dtype"], v["shape"], raw[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]])
            for k, v in head.items() if k != "__metadata__"}
a, b = tensors(sys.argv[1]), tensors(sys.argv[2])
assert a.keys() == b.keys(), set(a) ^ set(b)
assert all(a[k] == b[k] for k in a), [k for k in a if a[k] != b[k]]' "$1" "$2"; }
# Rewrites a .safetensors file without tensor NAME (drop) or with its first dim
# halved (shrink), keeping the metadata: Python's standard library only.
edit_safetensors() { python3 -c '
import json, struct, sys
src, dst, op, name = sys.argv[1:5]
raw = open(src, "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
out, blobs, at = {}, [], 0
for k, v in header.items():
    if k == "__metadata__":
        out[k] = v
        continue
    b = data[v["data_offsets"][0]:v["data_offsets"][1]]
    if k == name and op == "drop":
        continue
    if k == name and op == "shrink":
        v["shape"][0] //= 2
        b = b[:len(b) // 2]
    v["data_offsets"] = [at, at + len(b)]
    out[k], at = v, at + len(b)
    blobs.append(b)
assert name not in out or op != "drop"
h = json.dumps(out).encode()
h += b" " * (-len(h) % 8)
open(dst, "wb").write(struct.pack("<Q", len(h)) + h + b"".join(blobs))' "$@"; }
expect_error() {
  local want=$1; shift
  if out=$("$@" 2>&1); then fail "expected an error for: $*"; fi
  [[ $out == *"$want"* ]] || fail "expected '$want' in: $out"
}

echo "== training at 1, 2, 4 ranks and on a 2x2 HSDP mesh"
train 1 --job.dump_folder w1 --profiling.trace_steps 3 > w1.log
# The same run on 2 threads: kernels and GEMMs never change a result with the thread count.
OMP_NUM_THREADS=2 "${mpi[@]}" -np 1 -x OMP_NUM_THREADS "$bin/tessera-train" "${tiny[@]}" --job.dump_folder w1t2 > w1t2.log
# w2 also keeps checkpoints (resharded resume below) and exports bf16 (initial_load_path below).
train 2 --job.dump_folder w2 --checkpoint.enable true --checkpoint.interval 20 --checkpoint.keep 0 \
  --checkpoint.export_safetensors model-bf16.safetensors --checkpoint.export_dtype bfloat16 > w2.log
train 4 --job.dump_folder w4 --profiling.trace_steps 3,4 --checkpoint.export_safetensors model.safetensors > w4.log
train 4 --job.dump_folder hsdp --parallelism.data_parallel_replicate_degree 2 > hsdp.log
for d in w1 w1t2 w2 w4 hsdp; do losses $d > $d.losses; done
cat w1.losses
python3 -c '
import sys
l = [float(x.split()[1]) for x in open("w1.losses")]
sys.exit(0 if l[-1] < l[0] - 1.5 else "loss did not fall: %s" % l)'
grep -q "2 thread(s)/rank" w1t2.log || fail "the 2-thread run did not get 2 threads"
cmp w1.losses w1t2.losses || fail "1 and 2 threads should give bitwise equal losses"
# Across rank counts the weight gradients sum their rows in other groups (one
# GEMM over all rows, or a GEMM per rank and then the reduce-scatter): f32 tolerance.
close w1.losses w2.losses 1e-5 || fail "2 ranks drifted from 1 rank"
close w1.losses w4.losses 1e-5 || fail "4 ranks drifted from 1 rank"
close w1.losses hsdp.losses 1e-5 || fail "HSDP drifted from 1 rank"
grep -q "FSDP over 4" w4.log || fail "w4 run did not report its mesh"
# job.bind_cores: ranks that fit the cores get cores of their own; a single
# rank, or more ranks than cores, are left to the OS (tp2r below: off).
cores=$(nproc)
grep -q "thread(s)/rank (rank 0 on CPU" w1.log && fail "a single rank was pinned"
if (( cores >= 2 )); then grep -q "1 thread(s)/rank (rank 0 on CPU" w2.log || fail "2 ranks on $cores cores: not pinned"; fi
if (( cores < 4 )); then grep -q "(rank 0 on CPU" w4.log && fail "4 ranks on $cores cores were pinned"; fi
echo "== Llama with tensor parallelism 2, alone and under FSDP"
llama=(--model.arch llama --model.bias false --model.tie_embeddings false --training.steps 20)
train 1 "${llama[@]}" --job.dump_folder l1 > l1.log
train 2 "${llama[@]}" --job.dump_folder tp2 --parallelism.tensor_parallel_degree 2 > tp2.log
train 4 "${llama[@]}" --job.dump_folder tp2x2 --parallelism.tensor_parallel_degree 2 > tp2x2.log
train 2 "${llama[@]}" --job.dump_folder tp2r --parallelism.tensor_parallel_degree 2 \
  --parallelism.disable_loss_parallel true --job.bind_cores false > tp2r.log
grep -q "(rank 0 on CPU" tp2r.log && fail "job.bind_cores false still pinned the ranks"
train 4 "${llama[@]}" --job.dump_folder tp2x2sp --parallelism.tensor_parallel_degree 2 \
  --parallelism.enable_sequence_parallel true > tp2x2sp.log
for d in l1 tp2 tp2x2 tp2r tp2x2sp; do losses $d > $d.losses; done
close l1.losses tp2x2sp.losses 1e-5 || fail "FSDP 2 x TP 2 with sequence parallelism drifted from 1 rank"
grep -q "FSDP over 2 x tensor parallel 2 (loss parallel) + sequence parallel" tp2x2sp.log ||
  fail "tp2x2sp run did not report sequence parallelism"
expect_error "enable_sequence_parallel splits activations over the tensor-parallel ranks" \
  train 2 --parallelism.enable_sequence_parallel true
close l1.losses tp2.losses 1e-5 || fail "tensor parallelism 2 drifted from 1 rank"
close l1.losses tp2r.losses 1e-5 || fail "tensor parallelism 2 without loss parallelism drifted from 1 rank"
grep -q "tensor parallel 2 (loss parallel)" tp2.log || fail "tp2 run did not split its loss over the vocabulary"
grep -q "tensor parallel 2 |" tp2r.log || fail "tp2r run still reports loss parallelism"
close l1.losses tp2x2.losses 1e-5 || fail "FSDP 2 x TP 2 drifted from 1 rank"
grep -q "FSDP over 1 x tensor parallel 2" tp2.log || fail "tp2 run did not report its mesh"
grep -q "FSDP over 2 x tensor parallel 2" tp2x2.log || fail "tp2x2 run did not report its mesh"
echo "== GPT-2 with tensor parallelism 2 (c_attn split per block of q, k, v), alone and under FSDP + SP"
gpt=(--training.steps 12)
train 1 "${gpt[@]}" --job.dump_folder g1 > g1.log
train 2 "${gpt[@]}" --job.dump_folder gtp2 --parallelism.tensor_parallel_degree 2 > gtp2.log
train 4 "${gpt[@]}" --job.dump_folder gtp2x2sp --parallelism.tensor_parallel_degree 2 \
  --parallelism.enable_sequence_parallel true > gtp2x2sp.log
for d in g1 gtp2 gtp2x2sp; do losses $d > $d.losses; done
close g1.losses gtp2.losses 1e-5 || fail "GPT-2 with tensor parallelism 2 drifted from 1 rank"
close g1.losses gtp2x2sp.losses 1e-5 || fail "GPT-2 with FSDP 2 x TP 2 + SP drifted from 1 rank"
grep -q "model gpt2.*FSDP over 2 x tensor parallel 2 (loss parallel) + sequence parallel" gtp2x2sp.log ||
  fail "gtp2x2sp run did not report its mesh"
expect_error "model.n_head (6) must be divisible by parallelism.tensor_parallel_degree (4)" \
  train 4 --model.n_head 6 --model.n_embd 96 --parallelism.tensor_parallel_degree 4
expect_error "parallelism: replicate degree 1 x shard degree 3 x tensor-parallel degree 2 = 6 ranks, but the job has 4" \
  train 4 "${llama[@]}" --parallelism.tensor_parallel_degree 2 --parallelism.data_parallel_shard_degree 3
echo "== pipeline parallelism: PP 2, PP 2 x FSDP 2, interleaved, zero bubble (+ activation checkpointing), Llama PP 2 x TP 2 (+ SP): the one-rank losses"
pipe=(--training.steps 12 --model.tie_embeddings false --model.n_layer 4 --job.dump_folder)
train 1 "${pipe[@]}" p1 > p1.log
train 2 "${pipe[@]}" pp2 --parallelism.pipeline_parallel_degree 2 > pp2.log
train 4 "${pipe[@]}" pp2x2 --parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule gpipe \
  --parallelism.pipeline_parallel_microbatches 2 > pp2x2.log
train 2 "${pipe[@]}" ppi --parallelism.pipeline_parallel_degree 2 \
  --parallelism.pipeline_parallel_schedule interleaved_1f1b > ppi.log
train 4 "${pipe[@]}" zb2x2 --parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule zb_h1 \
  > zb2x2.log
train 2 "${pipe[@]}" zb2 --parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule zb_h1 > zb2.log
names="transformer.wte,transformer.wpe,transformer.h.0; transformer.h.1,transformer.h.2,transformer.h.3,transformer.ln_f,lm_head"
train 2 "${pipe[@]}" ppn --parallelism.pipeline_parallel_degree 2 \
  --parallelism.pipeline_parallel_module_names_per_stage "$names" > ppn.log
train 4 "${pipe[@]}" pphsdp --parallelism.pipeline_parallel_degree 2 --parallelism.data_parallel_replicate_degree 2 \
  > pphsdp.log
train 4 "${llama[@]}" --training.steps 12 --job.dump_folder lpp2tp2 --parallelism.pipeline_parallel_degree 2 \
  --parallelism.tensor_parallel_degree 2 > lpp2tp2.log
train 1 "${llama[@]}" --training.steps 12 --job.dump_folder lpp1 > lpp1.log
train 4 "${llama[@]}" --training.steps 12 --job.dump_folder lpp2tp2sp --parallelism.pipeline_parallel_degree 2 \
  --parallelism.tensor_parallel_degree 2 --parallelism.enable_sequence_parallel true > lpp2tp2sp.log
train 2 "${pipe[@]}" ppac --parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule zb_h1 \
  --activation_checkpoint.mode full > ppac.log
for d in p1 pp2 pp2x2 ppi zb2 zb2x2 ppn pphsdp ppac lpp1 lpp2tp2 lpp2tp2sp; do losses $d > $d.losses; done
close p1.losses pp2.losses 1e-5 || fail "PP 2 drifted from 1 rank"
close p1.losses pp2x2.losses 1e-5 || fail "PP 2 x FSDP 2 drifted from 1 rank"
close p1.losses ppi.losses 1e-5 || fail "interleaved PP 2 drifted from 1 rank"
close p1.losses zb2x2.losses 1e-5 || fail "zero-bubble PP 2 x FSDP 2 drifted from 1 rank"
cmp pp2.losses zb2.losses || fail "zb_h1's losses differ from 1F1B's (its I and W are B's operations): $(paste pp2.losses zb2.losses)"
close p1.losses pphsdp.losses 1e-5 || fail "PP 2 x HSDP 2x1 drifted from 1 rank"
close p1.losses ppn.losses 1e-5 || fail "PP 2 cut by module names drifted from 1 rank"
grep -q "rank 0: stage 0 (blocks 0-0, embeddings); rank 1: stage 1 (blocks 1-3, output layer and loss)" ppn.log ||
  fail "the stages by module names: $(grep stages ppn.log)"
grep -q "PP 2 (zb_h1, 4 micro-batches, 2 stages) x FSDP over 2" zb2x2.log || fail "zb2x2 did not report its mesh"
close lpp1.losses lpp2tp2.losses 1e-5 || fail "Llama PP 2 x TP 2 drifted from 1 rank"
close lpp1.losses lpp2tp2sp.losses 1e-5 || fail "Llama PP 2 x TP 2 + SP drifted from 1 rank"
close p1.losses ppac.losses 1e-5 || fail "zero-bubble PP 2 with activation checkpointing drifted from 1 rank"
grep -q "PP 2 (1f1b, 4 micro-batches, 2 stages) x FSDP over 1" pp2.log || fail "pp2 did not report its mesh: $(head -3 pp2.log)"
grep -q "PP 2 (gpipe, 2 micro-batches, 2 stages) x FSDP over 2" pp2x2.log || fail "pp2x2 did not report its mesh"
grep -q "PP 2 (interleaved_1f1b, 4 micro-batches, 4 stages)" ppi.log || fail "ppi did not report its mesh"
grep -q "pipeline stages: rank 0: stage 0 (blocks 0-1, embeddings); rank 1: stage 1 (blocks 2-3, output layer and loss)" \
  pp2.log || fail "pp2 did not name each rank's stage: $(grep stages pp2.log)"
grep -q "rank 0: stage 0 (blocks 0-0, embeddings), stage 2 (blocks 2-2)" ppi.log || fail "ppi's stages: $(grep stages ppi.log)"
# Refused before anything is allocated, naming the key.
tie=(--model.n_layer 4 --parallelism.pipeline_parallel_degree 2)
expect_error "set --model.tie_embeddings false with parallelism.pipeline_parallel_degree 2" train 2 "${tie[@]}"
expect_error "parallelism.pipeline_parallel_degree (2) x parallelism.data_parallel_replicate_degree (1) must divide the number of ranks (3)" \
  train 3 "${pipe[@]}" x --parallelism.pipeline_parallel_degree 2
expect_error "parallelism.pipeline_parallel_degree (2) x 2 stage(s) per rank = 4 stages, but model.n_layer is 3" \
  train 2 "${pipe[@]}" x --model.n_layer 3 --parallelism.pipeline_parallel_degree 2 \
  --parallelism.pipeline_parallel_schedule interleaved_1f1b
expect_error "parallelism.pipeline_parallel_module_names_per_stage: pipeline: stage 1 names 'transformer.h.3' where it needs transformer.h.1" \
  train 2 "${pipe[@]}" x --parallelism.pipeline_parallel_degree 2 \
  --parallelism.pipeline_parallel_module_names_per_stage "transformer.wte,transformer.wpe,transformer.h.0;transformer.h.3,lm_head"
expect_error "training.batch_size (8) must be a multiple of parallelism.pipeline_parallel_microbatches (3)" \
  train 2 "${pipe[@]}" x --parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_microbatches 3
expect_error "config key 'parallelism.pipeline_parallel_schedule' has no choice 'zb' (valid: gpipe, 1f1b, interleaved_1f1b, zb_h1)" \
  train 2 "${pipe[@]}" x --parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule zb
echo "== a pipelined run's checkpoints: resumed bitwise on PP 2 x FSDP 2, resharded to one rank, exported"
ppck=(--parallelism.pipeline_parallel_degree 2 --checkpoint.enable true --checkpoint.interval 6 --checkpoint.keep 0)
train 4 "${pipe[@]}" ppck "${ppck[@]}" --checkpoint.export_safetensors pp.safetensors > ppck.log
losses ppck > ppck.losses
close p1.losses ppck.losses 1e-5 || fail "PP 2 x FSDP 2 with checkpoints drifted from 1 rank"
rm -rf ppr pp1r && mkdir -p ppr/checkpoint pp1r/checkpoint
cp -r ppck/checkpoint/step-00000006 ppr/checkpoint/
cp -r ppck/checkpoint/step-00000006 pp1r/checkpoint/
train 4 "${pipe[@]}" ppr "${ppck[@]}" --checkpoint.resume true > ppr.log
train 1 "${pipe[@]}" pp1r --checkpoint.enable true --checkpoint.interval 6 --checkpoint.resume true > pp1r.log
for r in ppr pp1r; do grep -q "resumed from" $r.log || fail "$r did not resume: $(cat $r.log)"; done
grep -q "resharded" pp1r.log || fail "pp1r did not say it resharded"
losses ppck | grep -E '^(10|12) ' > ppck.tail
losses ppr | grep -E '^(10|12) ' > ppr.tail
losses pp1r | grep -E '^(10|12) ' > pp1r.tail
[[ -s ppck.tail ]] || fail "no losses after step 6 in ppck"
cmp ppck.tail ppr.tail || fail "a PP 2 x FSDP 2 resume is not bitwise equal: $(cat ppck.tail ppr.tail)"
close ppck.tail pp1r.tail 1e-5 || fail "a PP 2 checkpoint resumed on one rank drifted beyond f32 rounding"
"$bin/tessera-ckpt" to-safetensors ppck/checkpoint ppck.safetensors > /dev/null
same_tensors ppck/pp.safetensors ppck.safetensors || fail "the pipelined export differs from its final checkpoint"
echo "pipelined checkpoints: resumed bitwise at PP 2 x FSDP 2, within 1e-5 on one rank; export = checkpoint"
# The planner: each stage position's memory, micro-batches in flight and messages; PP x FSDP x TP at 8 ranks.
"$bin/tessera-plan" --ranks 8 "${pipe[@]}" x --parallelism.pipeline_parallel_degree 2 \
  --parallelism.tensor_parallel_degree 2 > pp-plan.txt
grep -q "^pipeline: 1f1b, 4 micro-batches per step; this rank: stage 0 (blocks 0-1, embeddings); at most 2 micro-batch(es) in flight" \
  pp-plan.txt || fail "tessera-plan's pipeline line: $(cat pp-plan.txt)"
grep -Eq "^  rank 4 +stage 1 \(blocks 2-3, output layer and loss\) +in flight +1  send +4  recv +4  peak" pp-plan.txt ||
  fail "tessera-plan's stage positions: $(cat pp-plan.txt)"
grep -q "^  tp " pp-plan.txt && grep -q "^  dp_shard " pp-plan.txt || fail "the 3-D plan lacks a dim: $(cat pp-plan.txt)"
echo "== context parallelism: CP 2, CP 2 x FSDP 2 (ring, contiguous), HSDP x CP, Llama CP 2 x TP 2 + SP, PP 2 x CP 2: the one-rank losses"
ctx=(--training.steps 12 --job.dump_folder)
train 1 "${ctx[@]}" c1 > c1.log
train 2 "${ctx[@]}" cp2 --parallelism.context_parallel_degree 2 > cp2.log
train 4 "${ctx[@]}" cp2x2 --parallelism.context_parallel_degree 2 --parallelism.context_parallel_rotate_method ring \
  --parallelism.context_parallel_load_balance false --training.seq_len 63 > cp2x2.log
train 1 "${ctx[@]}" c1s63 --training.seq_len 63 > c1s63.log
train 4 "${ctx[@]}" cphsdp --parallelism.context_parallel_degree 2 --parallelism.data_parallel_replicate_degree 2 \
  > cphsdp.log
train 4 "${llama[@]}" --training.steps 12 --job.dump_folder lcp2tp2 --parallelism.context_parallel_degree 2 \
  --parallelism.tensor_parallel_degree 2 --parallelism.enable_sequence_parallel true > lcp2tp2.log
train 4 "${pipe[@]}" ppcp --parallelism.pipeline_parallel_degree 2 --parallelism.context_parallel_degree 2 \
  --parallelism.context_parallel_rotate_method ring > ppcp.log
losses ppcp > ppcp.losses
close p1.losses ppcp.losses 1e-5 || fail "PP 2 x CP 2 drifted from 1 rank"
grep -q "PP 2 (1f1b, 4 micro-batches, 2 stages) x FSDP over 2 (data 1 x context 2) x context parallel 2 (ring, head-tail)" \
  ppcp.log || fail "ppcp did not report its mesh: $(head -3 ppcp.log)"
for d in c1 cp2 cp2x2 c1s63 cphsdp lcp2tp2; do losses $d > $d.losses; done
close c1.losses cp2.losses 1e-5 || fail "CP 2 drifted from 1 rank"
close c1s63.losses cp2x2.losses 1e-5 || fail "CP 2 x FSDP 2 (ring, an uneven contiguous split) drifted from 1 rank"
close c1.losses cphsdp.losses 1e-5 || fail "HSDP 2 x CP 2 drifted from 1 rank"
close lpp1.losses lcp2tp2.losses 1e-5 || fail "Llama CP 2 x TP 2 + SP drifted from 1 rank"
grep -q "FSDP over 2 (data 1 x context 2) x context parallel 2 (allgather, head-tail)" cp2.log ||
  fail "cp2 did not report its mesh: $(head -3 cp2.log)"
grep -q "FSDP over 4 (data 2 x context 2) x context parallel 2 (ring, contiguous)" cp2x2.log ||
  fail "cp2x2 did not report its mesh: $(head -3 cp2x2.log)"
grep -q "HSDP 2x2 (replicate x shard x cp) x context parallel 2" cphsdp.log || fail "cphsdp did not report its mesh"
grep -q "x context parallel 2 (allgather, head-tail) x tensor parallel 2 (loss parallel) + sequence parallel" lcp2tp2.log ||
  fail "lcp2tp2 did not report its mesh: $(head -3 lcp2tp2.log)"
# A CP 2 x FSDP 2 checkpoint resumes on one rank (resharded), and a sample is generated on the whole sequence.
train 4 "${ctx[@]}" cpck --parallelism.context_parallel_degree 2 --checkpoint.enable true --checkpoint.interval 6 \
  --sample.max_new_tokens 8 > cpck.log
grep -q -- "--- sample" cpck.log || fail "no sample from a context-parallel run: $(tail -5 cpck.log)"
rm -rf cp1r && mkdir -p cp1r/checkpoint && cp -r cpck/checkpoint/step-00000006 cp1r/checkpoint/
train 1 "${ctx[@]}" cp1r --checkpoint.enable true --checkpoint.interval 6 --checkpoint.resume true > cp1r.log
grep -q "resharded" cp1r.log || fail "cp1r did not say it resharded: $(head -5 cp1r.log)"
losses cpck | grep -E '^(10|12) ' > cpck.tail
losses cp1r | grep -E '^(10|12) ' > cp1r.tail
[[ -s cpck.tail ]] || fail "no losses after step 6 in cpck"
close cpck.tail cp1r.tail 1e-5 || fail "a CP 2 checkpoint resumed on one rank drifted beyond f32 rounding"
# Refused before any rank allocates, naming the key.
expect_error "parallelism.context_parallel_load_balance = true cuts the sequence into 2 x 2 = 4 equal chunks (head-tail), but training.seq_len = 63 is not a multiple of 4" \
  train 2 "${ctx[@]}" x --parallelism.context_parallel_degree 2 --training.seq_len 63
expect_error "parallelism.context_parallel_degree (3) must divide the number of ranks (4)" \
  train 4 "${ctx[@]}" x --parallelism.context_parallel_degree 3 --training.seq_len 60
expect_error "config key 'parallelism.context_parallel_rotate_method' has no choice 'alltoall' (valid: allgather, ring)" \
  train 2 "${ctx[@]}" x --parallelism.context_parallel_degree 2 --parallelism.context_parallel_rotate_method alltoall
# The planner's context dimension: the K/V bytes, the ring's messages on the cp group.
"$bin/tessera-plan" --ranks 4 --preset tiny "${ctx[@]}" x --parallelism.context_parallel_degree 4 \
  --parallelism.context_parallel_rotate_method ring > cp-plan.txt
grep -q "^context parallel: 4 ranks, ring, head-tail chunks; this rank holds 16 of 64 tokens a sequence" cp-plan.txt ||
  fail "tessera-plan's context line: $(cat cp-plan.txt)"
grep -Eq "^ +send +20  recv +20  \(K/V blocks and their gradients around the ring\)" cp-plan.txt ||
  fail "tessera-plan's ring messages (2 layers x (3 x 4 - 2)): $(cat cp-plan.txt)"
grep -q "^  dp_shard_cp " cp-plan.txt || fail "the plan lacks FSDP's dp_shard_cp group: $(cat cp-plan.txt)"
grep -q "HSDP 2x2" hsdp.log || fail "hsdp run did not report its mesh"
grep -q "exposed comm" w4.log || fail "log lines lack exposed communication"
# MFU against this CPU's measured peak (FMA loop, for f32) unless one is given.
grep -Eq "MFU against [0-9.e+-]+ TFLOP/s \(.*FMA loop, measured[^)]*\)" w4.log || fail "no measured peak in:
$(head -5 w4.log)"
python3 -c '
import json
mfu = [json.loads(l)["mfu_pct"] for l in open("w4/metrics.jsonl") if "mfu_pct" in l]
assert mfu and all(0 < m < 100 for m in mfu), mfu'
train 1 --training.steps 10 --metrics.peak_tflops 1e-6 --job.dump_folder given > given.log
grep -q "MFU against 1e-06 TFLOP/s (metrics.peak_tflops)" given.log || fail "peak_tflops not used: $(head -5 given.log)"
# A peak below the rate the step reached (1e-6 TFLOP/s is) is wrong: the log
# says so once, MFU is taken against the rate reached and never exceeds 100%.
[[ $(grep -c "above the peak MFU was taken against (1e-06 TFLOP/s, metrics.peak_tflops): that peak is wrong" given.log) == 1 ]] ||
  fail "a peak below the achieved rate was not flagged once: $(cat given.log)"
python3 -c '
import json
rows = [json.loads(l) for l in open("given/metrics.jsonl") if "mfu_pct" in l]
assert rows and all(0 < r["mfu_pct"] <= 100 for r in rows), [r["mfu_pct"] for r in rows]
assert all(r["mfu_peak_raised"] for r in rows), rows[0]'
python3 -c '
import json
rows = [json.loads(l) for l in open("w4/metrics.jsonl")]
keys = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "tokens_per_s_per_rank", "mfu_pct",
        "peak_mem_mib_max_rank", "exposed_comm_pct_max_rank", "host_syncs_between_logs_max_rank"}
logged = [r for r in rows if "loss" in r]
assert logged and all(keys <= set(r) for r in logged), logged[0]
assert any("val_loss" in r for r in rows) and "summary" in rows[-1], rows[-1]
trace = json.load(open("w4/traces/step-4.json"))
events = trace["traceEvents"] if isinstance(trace, dict) else trace
# Lanes are named by thread_name metadata; count the spans ("X") on each.
lane = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"}
spans = {}
for e in events:
    if e.get("ph") == "X":
        key = (e["pid"], lane.get((e["pid"], e["tid"]), "?"))
        spans[key] = spans.get(key, 0) + 1
ranks = sorted({p for p, _ in spans})
assert ranks == [0, 1, 2, 3], ranks
for r in ranks:
    for want in ("all_gather", "reduce_scatter", "compute"):
        assert spans.get((r, want), 0) > 0, "rank %d: no %s spans: %s" % (r, want, spans)
# The memory counter: every rank samples the bytes it holds in tensors, never
# above the peak the run logged.
peak = max(r["peak_mem_mib_max_rank"] for r in rows if "peak_mem_mib_max_rank" in r)
for r in ranks:
    mib = [e["args"]["MiB"] for e in events if e.get("ph") == "C" and e["pid"] == r]
    assert len(mib) > 10 and 0 < max(mib) <= peak + 1e-3 and min(mib) < max(mib), (r, len(mib), peak)
print("metrics and trace OK: rank 0 has %d all-gather and %d reduce-scatter spans" %
      (spans[(0, "all_gather")], spans[(0, "reduce_scatter")]))'
[[ -f w1/traces/step-3.json ]] || fail "no trace from the 1-rank run"
if command -v gnuplot >/dev/null; then
  [[ $(head -c 4 w4/loss.png | od -An -c | tr -d ' ') == '211PNG' ]] || fail "loss.png is not a PNG"
  # The trace drawn as a timeline: a band per rank, and a zoomed window.
  python3 "$src/tools/trace_png.py" w4/traces/step-4.json w4/step-4.png --title "4 ranks, step 4" > tp.log ||
    fail "trace_png: $(cat tp.log)"
  grep -q "w4/step-4.png: 4 rank(s)" tp.log || fail "trace_png drew: $(cat tp.log)"
  python3 "$src/tools/trace_png.py" w4/traces/step-4.json w4/zoom.png --window 1 5 --ranks 0,3 --width 900 > tp.log
  python3 -c '
import struct, sys
for path, width, min_height in (("w4/step-4.png", 1600, 500), ("w4/zoom.png", 900, 320)):
    raw = open(path, "rb").read(24)
    assert raw[:8] == b"\x89PNG\r\n\x1a\n", path
    w, h = struct.unpack(">II", raw[16:24])
    assert w == width and h >= min_height, (path, w, h)' || fail "trace PNGs of the wrong size"
  if python3 "$src/tools/trace_png.py" w4/traces/step-4.json bad.png --ranks 9 2> tp.err; then
    fail "trace_png drew a rank the trace does not have"
  fi
  grep -q "the trace has ranks \[0, 1, 2, 3\], not \[9\]" tp.err || fail "trace_png's error: $(cat tp.err)"
  # --gathers: from rank 0's 2nd all-gather to its 4th, whatever the machine's timing.
  python3 "$src/tools/trace_png.py" w4/traces/step-4.json w4/gathers.png --gathers 2 4 > tp.log || fail "trace_png --gathers: $(cat tp.log)"
  python3 -c '
import json, re, sys
events = json.load(open("w4/traces/step-4.json"))["traceEvents"]
lane = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
spans = [e for e in events if e.get("ph") == "X"]
t0 = min(e["ts"] for e in spans)
starts = sorted((e["ts"] - t0) / 1e3 for e in spans if e["pid"] == 0 and lane[(0, e["tid"])] == "all_gather")
lo, hi = map(float, re.search(r"([0-9.]+)-([0-9.]+) ms", open("tp.log").read()).groups())
assert abs(lo - starts[1]) < 0.06 and abs(hi - starts[3]) < 0.06, (lo, hi, starts[:4])' || fail "--gathers 2 4 drew $(cat tp.log)"
  if python3 "$src/tools/trace_png.py" w4/traces/step-4.json bad.png --gathers 2 999 2> tp.err; then
    fail "trace_png drew past the trace's all-gathers"
  fi
  grep -q "rank 0 has [0-9]* all-gather(s) in the trace" tp.err || fail "trace_png --gathers' error: $(cat tp.err)"
fi
# The trace names its run, step, ranks and settings (trace_png's default title).
python3 -c '
import json
title = json.load(open("w4/traces/step-4.json"))["otherData"]["title"]
assert title == "gpt2-fortunes-tiny: step 4, 4 rank(s), FSDP over 4, param float32 reduce float32", title' ||
  fail "the trace's title: $(head -c 300 w4/traces/step-4.json)"

echo "== job.device async_cpu: the CPU's losses bit for bit, no host sync between log steps"
# Kernels on worker-thread streams with random delays; FSDP's collectives wait on streams.
TESSERA_ASYNC_DELAYS=20 train 2 --job.dump_folder a2 --job.device async_cpu > a2.log
losses a2 > a2.losses
cmp w2.losses a2.losses || fail "async_cpu and cpu should give bitwise equal losses"
python3 -c '
import json
rows = [json.loads(l) for l in open("a2/metrics.jsonl")]
logged = [r for r in rows if "loss" in r]
assert len(logged) >= 4, logged
syncs = [r["host_syncs_between_logs_max_rank"] for r in logged]
assert all(s == 0 for s in syncs), syncs
print("async_cpu: %d log lines, host syncs between log steps: %s" % (len(logged), syncs))'
echo "== checkpoint.async_mode async: the synchronous saves' data files; a kill mid-write keeps the last"
train 2 --job.dump_folder ac2 --checkpoint.enable true --checkpoint.interval 20 --checkpoint.keep 0 \
  --checkpoint.async_mode async > ac2.log
losses ac2 > ac2.losses
cmp w2.losses ac2.losses || fail "asynchronous checkpoints changed the losses"
for s in 00000020 00000040; do
  for r in 00000 00001; do
    cmp "w2/checkpoint/step-$s/rank-$r.bin" "ac2/checkpoint/step-$s/rank-$r.bin" ||
      fail "the asynchronous save of step $s (rank $r) differs from the synchronous one"
  done
done
grep -q "checkpoint: step 20 staged in" ac2.log || fail "no staging line: $(grep checkpoint: ac2.log)"
grep -q "checkpoint: step 20 -> .*written in the background" ac2.log || fail "step 20 never committed: $(grep checkpoint: ac2.log)"
[[ $(cat ac2/checkpoint/latest) == step-00000040 ]] || fail "the run's last save was not committed before it ended"
# Rank 1 killed while its writer writes step 40's file (the process's second):
# step 20 stays the latest, and the resume from it gives the same losses.
set +e
TESSERA_CHECKPOINT_KILL_RANK=1 TESSERA_CHECKPOINT_KILL_AFTER=200 TESSERA_CHECKPOINT_KILL_FILE=2 timeout 120 \
  "${mpi[@]}" -np 2 "$bin/tessera-train" "${tiny[@]}" --job.dump_folder ack --checkpoint.enable true \
  --checkpoint.interval 20 --checkpoint.async_mode async > ack.log 2>&1
rc=$?
set -e
(( rc != 0 )) || fail "the run killed mid-write exited 0"
[[ -d ack/checkpoint/step-00000040.tmp && ! -e ack/checkpoint/step-00000040 ]] ||
  fail "expected only an incomplete step 40: $(ls ack/checkpoint)"
[[ $(cat ack/checkpoint/latest) == step-00000020 ]] || fail "latest moved to an incomplete checkpoint"
train 2 --job.dump_folder ack --checkpoint.enable true --checkpoint.interval 20 --checkpoint.async_mode async \
  --checkpoint.resume true > ack2.log
# The resumed run's rows come last (metrics.jsonl is appended to on resume).
losses ack | awk '$1 == 30 || $1 == 40' | tail -2 > ack.losses
awk '$1 == 30 || $1 == 40' ac2.losses | cmp - ack.losses || fail "the resume after a kill mid-write drifted"
echo "async checkpoints: the same files, and a kill mid-write resumes exactly from the last"

echo "== parallelism.cpu_offload on async_cpu: shards, gradients and AdamW on the host, the same losses"
TESSERA_ASYNC_DELAYS=20 train 2 --job.dump_folder o2 --job.device async_cpu --parallelism.cpu_offload true > o2.log
losses o2 > o2.losses
cmp w2.losses o2.losses || fail "CPU offload on async_cpu should give the CPU's losses bit for bit"
expect_error "has no choice 'cuda7'" "$bin/tessera-train" "${tiny[@]}" --job.device cuda7
if ! command -v nvidia-smi > /dev/null; then  # no GPU here: cuda is refused, naming why
  expect_error "device type 'cuda', but" "$bin/tessera-train" "${tiny[@]}" --job.device cuda
fi

train 2 --job.dump_folder llama --preset llama-small --training.steps 6 --mixed_precision.param_dtype bfloat16 \
  --activation_checkpoint.mode full --parallelism.reshard_after_forward false > llama.log
grep -q "model llama: .*param bfloat16" llama.log || fail "the Llama bf16 run did not report its setup"
grep -q "^done: 6 steps" llama.log || fail "the Llama bf16 run did not finish"

echo "== resume equals straight-through"
# With dropout, so that bitwise equality needs every rank's RNG stream restored.
train 2 --job.dump_folder straight --model.dropout 0.1 --checkpoint.enable true --checkpoint.interval 20 \
  --checkpoint.keep 0 > straight.log
losses straight > straight.losses
cmp -s straight.losses w2.losses && fail "dropout 0.1 did not change the losses"
rm -rf r2 r4 && mkdir -p r2/checkpoint r4/checkpoint
cp -r straight/checkpoint/step-00000020 r2/checkpoint/
train 2 --job.dump_folder r2 --model.dropout 0.1 --checkpoint.enable true --checkpoint.interval 20 \
  --checkpoint.resume true > r2.log
# On another rank count the dropout masks differ by design: reshard w2's (no dropout) instead.
cp -r w2/checkpoint/step-00000020 r4/checkpoint/
train 4 --job.dump_folder r4 --checkpoint.enable true --checkpoint.interval 20 --checkpoint.resume true > r4.log
for r in r2 r4; do grep -q "resumed from" $r.log || fail "$r did not resume"; done
losses r2 | grep -E '^(30|40) ' > r2.tail
losses r4 | grep -E '^(30|40) ' > r4.tail
grep -E '^(30|40) ' straight.losses > straight.tail
grep -E '^(30|40) ' w2.losses > w2.tail
cmp straight.tail r2.tail || fail "resume at the same rank count (dropout 0.1) is not bitwise equal"
close w2.tail r4.tail 1e-5 || fail "resume on 4 ranks drifted beyond f32 rounding"
grep -q "resharded" r4.log || fail "resume on 4 ranks did not say it resharded"
echo "resume: bitwise at 2 ranks with dropout, within 1e-5 at 4"
# checkpoint.load_step picks the step; one that is not there, or one with later
# checkpoints the continued run would overwrite, is refused naming them.
rm -rf ls && mkdir -p ls/checkpoint && cp -r straight/checkpoint/step-000000{2,4}0 ls/checkpoint/
ls_run=(--job.dump_folder ls --model.dropout 0.1 --checkpoint.enable true --checkpoint.resume true)
expect_error "checkpoint.load_step 30: ls/checkpoint has no complete checkpoint of that step (it has steps 20, 40)" \
  train 2 "${ls_run[@]}" --checkpoint.load_step 30
expect_error "checkpoint.load_step 20: ls/checkpoint also holds later checkpoints (steps 40), which the continued run would overwrite" \
  train 2 "${ls_run[@]}" --checkpoint.load_step 20
expect_error "checkpoint.load_step 20: empty/checkpoint holds no complete checkpoint to resume from" \
  train 2 --job.dump_folder empty --checkpoint.enable true --checkpoint.resume true --checkpoint.load_step 20
expect_error "checkpoint.load_step 20 applies to a resume: add --checkpoint.resume true" \
  train 2 --job.dump_folder ls --checkpoint.load_step 20
train 2 "${ls_run[@]}" --checkpoint.load_step 40 --training.steps 44 > ls.log
grep -q "resumed from ls/checkpoint/step-00000040" ls.log || fail "load_step 40 did not resume from step 40: $(cat ls.log)"
echo "load_step: resumed from the step named, refused a missing one and one with later checkpoints"
# --eval-only: the validation loss the run logged for those weights, at another rank count too.
want=$(python3 -c 'import json; print([r["val_loss"] for r in map(json.loads, open("straight/metrics.jsonl")) if "val_loss" in r][-1])')
for np in 1 2; do
  train $np --eval-only --checkpoint.initial_load_path straight/checkpoint --job.dump_folder ev$np > ev$np.log
  python3 -c '
import json, sys
r = [json.loads(l) for l in open(sys.argv[1])][-1]["eval_only"]
assert abs(r["val_loss"] - float(sys.argv[2])) <= 1e-5 * float(sys.argv[2]), (r, sys.argv[2])
assert r["weights"] == "straight/checkpoint" and r["tokens"] > 0, r' ev$np/metrics.jsonl "$want" ||
    fail "--eval-only at $np rank(s) gave $(tail -1 ev$np/metrics.jsonl), the run logged $want"
done
grep -q "^weights from straight/checkpoint/step-00000040" ev1.log || fail "eval-only: $(cat ev1.log)"
[[ ! -d ev1/checkpoint ]] || fail "--eval-only saved a checkpoint"
expect_error "--eval-only evaluates given weights: pass --checkpoint.initial_load_path" train 1 --eval-only
echo "eval-only: the logged validation loss of the final checkpoint, at 1 and 2 ranks"

echo "== resume checks the saved settings"
rm -rf rb && mkdir -p rb/checkpoint && cp -r straight/checkpoint/step-00000040 rb/checkpoint/
rb=("$bin/tessera-train" "${tiny[@]}" --model.dropout 0.1 --job.dump_folder rb --checkpoint.enable true
    --checkpoint.resume true)
expect_error "saved with other settings, so resuming would not continue that run: job.seed 1234 -> 5; training.batch_size 8 -> 16. Use the saved values, or pass --checkpoint.allow_resume_change job.seed,training.batch_size" \
  "${rb[@]}" --training.batch_size 16 --job.seed 5
# A mismatched model is named, with the way to start from the weights instead.
expect_error "use --checkpoint.initial_load_path" "${rb[@]}" --model.n_embd 128
# Extending a finished run is allowed: a warning, the schedule spans the new total; an
# allowed batch change goes through; a checkpoint to resume wins over initial_load_path.
"${rb[@]}" --training.steps 44 --training.batch_size 16 --checkpoint.allow_resume_change training.batch_size \
  --checkpoint.initial_load_path w2/model-bf16.safetensors > rb.log
grep -q "^warning: resuming with settings changed .*training.batch_size 8 -> 16; training.steps 40 -> 44" rb.log ||
  fail "no warning for the changed settings: $(cat rb.log)"
grep -q "^warning: the learning-rate schedule .* now spans 44 steps instead of 40" rb.log || fail "no schedule warning"
grep -q "initial_load_path w2/model-bf16.safetensors not used: resuming from" rb.log || fail "resume did not win"
grep -q "^done: 44 steps (4 in this run, resumed at step 40) in " rb.log || fail "the extended run did not finish: $(cat rb.log)"
# Extended with the decay fixed at the saved run's length: the rate at the step
# it continues from is the saved one, so no rate warning (it once compared the
# saved rate read as a float with the double).
rm -rf rc && mkdir -p rc/checkpoint && cp -r straight/checkpoint/step-00000040 rc/checkpoint/
"$bin/tessera-train" "${tiny[@]}" --model.dropout 0.1 --job.dump_folder rc --checkpoint.enable true \
  --checkpoint.resume true --training.steps 44 --lr_scheduler.decay_steps 40 > rc.log
grep -q "^warning: resuming with settings changed .*training.steps 40 -> 44" rc.log || fail "rc: $(cat rc.log)"
! grep -q "runs at lr" rc.log || fail "an unchanged learning rate was warned about: $(grep 'runs at lr' rc.log)"
echo "resume: refused a changed batch and seed, warned about a changed schedule"

echo "== a fresh run from a bf16 .safetensors export (checkpoint.initial_load_path)"
# w2's export with the tied lm_head.weight stored once (as Hugging Face files do), at 4 ranks.
edit_safetensors w2/model-bf16.safetensors tied-once.safetensors drop lm_head.weight
train 4 --job.dump_folder ft --checkpoint.initial_load_path tied-once.safetensors > ft.log
grep -q "initial weights from tied-once.safetensors: step 0" ft.log || fail "no initial weights: $(cat ft.log)"
losses ft > ft.losses
python3 -c '
import sys
last = float(open("w2.losses").read().split()[-1]); first = float(open("ft.losses").read().split()[1])
print("exporting run ended at %.4f; the run from its weights starts at %.4f" % (last, first))
sys.exit(0 if abs(first - last) < 0.05 * last else "the first loss %.4f is not near %.4f" % (first, last))'
grep -q "^done: .*% lower)" ft.log || fail "validation loss not below the unigram baseline: $(grep done: ft.log)"
# tessera-ckpt from-safetensors converts to the model's dtype and fills in the tied weight:
# resuming that checkpoint (one plain process) starts exactly where the 4-rank run did.
"$bin/tessera-ckpt" from-safetensors tied-once.safetensors ftc/checkpoint > /dev/null
"$bin/tessera-ckpt" list ftc/checkpoint | grep -q "lm_head.weight  *f32" || fail "from-safetensors: no f32 lm_head.weight"
"$bin/tessera-train" "${tiny[@]}" --training.steps 1 --job.dump_folder ftc --checkpoint.enable true \
  --checkpoint.resume true > ftc.log
head -1 ft.losses > ft.first; losses ftc > ftc.losses
close ft.first ftc.losses 1e-5 || fail "from-safetensors + resume differs from initial_load_path"
edit_safetensors w2/model-bf16.safetensors wrong.safetensors shrink transformer.wpe.weight
expect_error "checkpoint.initial_load_path: load_safetensors failed on rank 0: wrong.safetensors: tensor 'transformer.wpe.weight' is [32, 64] in the file but [64, 64] in the model" \
  "$bin/tessera-train" "${tiny[@]}" --checkpoint.initial_load_path wrong.safetensors
expect_error "(the weights were saved from another model: model.n_embd 64 (this run: 128))" \
  "$bin/tessera-train" "${tiny[@]}" --checkpoint.initial_load_path tied-once.safetensors --model.n_embd 128
expect_error "tensor 'transformer.wpe.weight' is [32, 64] in the file but [64, 64] in the model" \
  "$bin/tessera-ckpt" from-safetensors wrong.safetensors wrong-ckpt
echo "initial_load_path: starts at the exported loss on another rank count; mismatches named"

echo "== config errors"
expect_error "unknown config key 'training.stepz' (did you mean 'training.steps'?)" "$bin/tessera-train" --training.stepz 5
expect_error "config key 'training.steps' expects an integer, got 'many'" "$bin/tessera-train" --training.steps many
expect_error "config key 'model.arch' has no choice 'gpt5' (valid: gpt2, llama)" "$bin/tessera-train" --model.arch gpt5
expect_error "unknown preset 'huge'" "$bin/tessera-train" --preset huge
expect_error "must be a multiple of training.grad_accum (1) x ranks (3)" "${mpi[@]}" -np 3 "$bin/tessera-train" "${tiny[@]}"
expect_error "replicate degree 3 x shard degree 1 = 3 ranks, but the job has 2" \
  "${mpi[@]}" -np 2 "$bin/tessera-train" "${tiny[@]}" --parallelism.data_parallel_replicate_degree 3 \
  --parallelism.data_parallel_shard_degree 1
cp straight/metrics.jsonl straight-metrics.before
expect_error "already holds a checkpoint of another run (step-00000040): pass --checkpoint.resume true" \
  "$bin/tessera-train" "${tiny[@]}" --job.dump_folder straight --checkpoint.enable true
cmp straight/metrics.jsonl straight-metrics.before || fail "a refused run truncated the other run's metrics"
echo "config errors named"

echo "== a killed rank ends the job"
start=$(date +%s)
if TESSERA_TEST_KILL=1:5 TESSERA_COLLECTIVE_TIMEOUT=20 timeout 120 "${mpi[@]}" -np 2 "$bin/tessera-train" "${tiny[@]}" \
    --job.dump_folder killed > killed.log 2>&1; then
  fail "the job with a killed rank exited 0"
fi
elapsed=$(( $(date +%s) - start ))
[[ $elapsed -lt 100 ]] || fail "the job took ${elapsed}s to end (a hang?)"
# The dying rank announces itself; the error must come from mpirun or the surviving rank.
grep -v "killing itself" killed.log | grep -qiE "exited on signal|noticed|did not complete|timed out|abort|error" ||
  fail "no error from mpirun or the surviving rank: $(cat killed.log)"
echo "killed rank: the job ended with an error in ${elapsed}s"
# The surviving rank (or, if the launcher was faster, nobody) records the failure;
# the file never claims the run completed.
grep -qE '"status": "(failed|running)"' killed/status.json || fail "killed rank: status $(cat killed/status.json)"

echo "== Ctrl-C / SIGTERM: a checkpoint at the end of the step, nothing partial, resumable"
# One process, SIGINT: the step finishes, a checkpoint is saved, exit 130.
"$bin/tessera-train" "${tiny[@]}" --training.steps 100000 --checkpoint.enable true --checkpoint.interval 100000 \
  --job.dump_folder sigint > sigint.log 2>&1 &
pid=$!
for _ in $(seq 200); do grep -q "^step" sigint.log 2>/dev/null && break; sleep 0.1; done
kill -INT $pid
rc=0; wait $pid || rc=$?
[[ $rc == 130 ]] || fail "SIGINT: expected exit 130, got $rc: $(tail -3 sigint.log)"
grep -q "interrupted (SIGINT/SIGTERM) after step .*checkpoint saved" sigint.log || fail "SIGINT: no checkpoint message"
# What a scheduler reads: the last line, and the status file in the run folder.
tail -1 sigint.log | grep -qE "^status: interrupted by SIGINT after step [0-9]+ \(exit 130; checkpoint saved\)" ||
  fail "SIGINT: no final status line: $(tail -1 sigint.log)"
python3 -c 'import json, sys; s = json.load(open(sys.argv[1]))
assert (s["status"], s["signal"], s["exit_code"], s["checkpoint_saved"]) == ("interrupted", "SIGINT", 130, True), s' \
  sigint/status.json || fail "SIGINT: status.json $(cat sigint/status.json)"
[[ -f sigint/checkpoint/$(cat sigint/checkpoint/latest)/metadata.json ]] || fail "SIGINT: no complete checkpoint"

# mpirun, checkpointing every step, Ctrl-C to the launcher: every directory is
# complete or .tmp, latest is complete, and the run resumes from it.
"${mpi[@]}" -np 2 "$bin/tessera-train" "${tiny[@]}" --training.steps 100000 --checkpoint.enable true \
  --checkpoint.interval 1 --checkpoint.keep 3 --job.dump_folder interrupted > interrupted.log 2>&1 &
pid=$!
for _ in $(seq 100); do [[ -e interrupted/checkpoint/latest ]] && break; sleep 0.1; done
sleep 1
kill -TERM $pid
wait $pid && fail "the interrupted run exited 0" || true
# mpirun folds the ranks' 143 into its own code; the status file keeps it.
grep -q '"status": "interrupted"' interrupted/status.json && grep -q '"exit_code": 143' interrupted/status.json ||
  fail "mpirun + SIGTERM: status.json $(cat interrupted/status.json)"
latest=$(cat interrupted/checkpoint/latest)
for d in interrupted/checkpoint/step-*; do
  [[ $d == *.tmp || -f $d/metadata.json ]] || fail "$d is incomplete but not marked .tmp"
done
[[ -f interrupted/checkpoint/$latest/metadata.json ]] || fail "latest names an incomplete checkpoint"
step=$((10#${latest#step-}))
"${mpi[@]}" -np 2 "$bin/tessera-train" "${tiny[@]}" --training.steps $((step + 3)) --checkpoint.enable true \
  --checkpoint.resume true --job.dump_folder interrupted > resumed.log
grep -q "resumed from .*$latest" resumed.log || fail "did not resume from $latest"
grep -q '"status": "completed"' interrupted/status.json || fail "resumed run: status $(cat interrupted/status.json)"
tail -1 resumed.log | grep -q "^status: completed (exit 0)" || fail "resumed run: last line $(tail -1 resumed.log)"
echo "interrupted at $latest (status.json: interrupted, exit 143); every directory complete or .tmp; resumed"

echo "== tessera-generate"
g1=$("$bin/tessera-generate" --checkpoint w4/model.safetensors --sample.max_new_tokens 37 --job.seed 7 2>/dev/null | od -An -tx1)
g2=$("$bin/tessera-generate" --checkpoint w4/model.safetensors --sample.max_new_tokens 37 --job.seed 7 2>/dev/null | od -An -tx1)
g3=$("$bin/tessera-generate" --checkpoint w4/model.safetensors --sample.max_new_tokens 37 --job.seed 8 2>/dev/null | od -An -tx1)
[[ "$g1" == "$g2" ]] || fail "the same seed gave different text"
[[ "$g1" != "$g3" ]] || fail "another seed gave the same text"
n=$("$bin/tessera-generate" --checkpoint w4/model.safetensors --sample.max_new_tokens 37 --sample.prompt "Q: " 2>/dev/null | wc -c)
[[ $n == $((3 + 37 + 1)) ]] || fail "expected 3 + 37 + 1 bytes, got $n"
from_ckpt=$("$bin/tessera-generate" --checkpoint straight/checkpoint --sample.max_new_tokens 20 2>/dev/null | od -An -tx1)
[[ -n "$from_ckpt" ]] || fail "generate from a sharded checkpoint printed nothing"
# A model that cannot fit is refused with the figures before anything is allocated.
expect_error "the model cannot fit in memory: it needs at least" \
  "$bin/tessera-generate" --checkpoint straight/checkpoint --model.n_embd 65536 --model.n_head 1
echo "generate: deterministic, 37 tokens"

echo "== a GPT with rotary positions (model.rope): no wpe, trains at 2 ranks, generates from both formats"
"${mpi[@]}" -np 2 "$bin/tessera-train" "${tiny[@]}" --training.steps 10 --model.rope true \
  --checkpoint.enable true --checkpoint.export_safetensors model.safetensors --job.dump_folder rope > rope.log
"$bin/tessera-ckpt" list rope/checkpoint > rope-list.txt
grep -q "transformer.wpe" rope-list.txt && fail "a rope GPT saved learned positions"
grep -q "transformer.h.0.attn.c_attn.weight" rope-list.txt || fail "rope checkpoint lacks the attention"
r1=$("$bin/tessera-generate" --checkpoint rope/checkpoint --sample.max_new_tokens 12 2>/dev/null | od -An -tx1)
r2=$("$bin/tessera-generate" --checkpoint rope/model.safetensors --sample.max_new_tokens 12 2>/dev/null | od -An -tx1)
[[ -n "$r1" && "$r1" == "$r2" ]] || fail "rope: the checkpoint and the export generate differently"
echo "rope: trained, saved without wpe, generates the same text from both formats"

echo "== tessera-ckpt"
"$bin/tessera-ckpt" --help > ckpt-help.txt || fail "tessera-ckpt --help exited non-zero"
grep -q "^usage: tessera-ckpt list" ckpt-help.txt || fail "tessera-ckpt --help printed no usage on stdout"
"$bin/tessera-ckpt" list straight/checkpoint > ckpt-list.txt
head -3 ckpt-list.txt
grep -q "saved by 2 rank(s)" ckpt-list.txt || fail "list does not show the saving world size"
grep -q "transformer.h.1.mlp.c_fc.weight" ckpt-list.txt || fail "list lacks a tensor"
"$bin/tessera-ckpt" to-safetensors straight/checkpoint conv.safetensors
"$bin/tessera-ckpt" from-safetensors conv.safetensors conv-ckpt
a=$("$bin/tessera-generate" --checkpoint straight/checkpoint --sample.max_new_tokens 30 2>/dev/null | od -An -tx1)
b=$("$bin/tessera-generate" --checkpoint conv.safetensors --sample.max_new_tokens 30 2>/dev/null | od -An -tx1)
c=$("$bin/tessera-generate" --checkpoint conv-ckpt --sample.max_new_tokens 30 2>/dev/null | od -An -tx1)
[[ "$a" == "$b" && "$a" == "$c" ]] || fail "converted checkpoints generate different text"
expect_error "holds no complete checkpoint" "$bin/tessera-ckpt" list w1
echo "ckpt: list and both conversions agree"
# Hugging Face folders in (a checkpoint with its model settings) and out
# again with transformers' tensors, bit for bit: GPT-2 and Llama.
for model in gpt2 llama; do
  rm -rf hfck hfout
  "$bin/tessera-ckpt" from-hf "$src/tests/fixtures/hf-$model" hfck > hf.log || fail "from-hf $model: $(cat hf.log)"
  "$bin/tessera-ckpt" to-hf hfck hfout > /dev/null
  same_tensors "$src/tests/fixtures/hf-$model/model.safetensors" hfout/model.safetensors ||
    fail "to-hf did not give back the Hugging Face $model tensors"
done
grep -q "llama 2 layers, d=24, 4 heads (2 key/value), vocabulary 61, 16 positions, RoPE base 500, RMSNorm eps 1e-06" hf.log ||
  fail "from-hf llama: $(cat hf.log)"
"$bin/tessera-ckpt" list hfck | grep -q '"model.norm_eps":"1e-06"' || fail "the imported checkpoint lacks its model settings"
expect_error "config.json and model.safetensors" "$bin/tessera-ckpt" from-hf "$src/tests" hfbad
echo "hf: transformers' GPT-2 and Llama imported and exported bit for bit"
# The load plan of a 2-rank checkpoint at 3 ranks: each rank reads the chunks
# whose rows overlap its own (torch.chunk: 86, 86, 84 of 256) and keeps part of them.
"$bin/tessera-ckpt" read-plan w2/checkpoint --ranks 3 --tensor transformer.wte.weight > plan.log
grep -q "rank 1 needs rows 86..171" plan.log && grep -q "rank-00000.bin *rows 0..127: reads .*, copies rows 86..127 (part of it)" plan.log &&
  grep -q "rank-00001.bin *rows 128..255: reads .*, copies rows 128..171 (part of it)" plan.log || fail "read-plan: $(cat plan.log)"
"$bin/tessera-ckpt" read-plan w2/checkpoint --ranks 2 > plan2.log
[[ $(grep -c "keeps" plan2.log) == 2 ]] || fail "read-plan totals: $(cat plan2.log)"
expect_error "read-plan needs CHECKPOINT and --ranks N" "$bin/tessera-ckpt" read-plan w2/checkpoint
expect_error "has no tensor 'nope'" "$bin/tessera-ckpt" read-plan w2/checkpoint --ranks 2 --tensor nope
# llm.c's GPT-2 model file: one written by an independent writer (from the
# Hugging Face fixture) imports as the same model, and exports byte for byte.
rm -rf llmck llmhf
python3 "$here/write_llmc_model.py" "$src/tests/fixtures/hf-gpt2" gpt2.bin > /dev/null
"$bin/tessera-ckpt" from-llmc gpt2.bin llmck > llmc.log || fail "from-llmc: $(cat llmc.log)"
grep -q "gpt2 2 layers, d=24, 3 heads (3 key/value), vocabulary 67, 13 positions, GELU tanh" llmc.log ||
  fail "from-llmc: $(cat llmc.log)"
"$bin/tessera-ckpt" to-hf llmck llmhf > /dev/null
same_tensors "$src/tests/fixtures/hf-gpt2/model.safetensors" llmhf/model.safetensors ||
  fail "the llm.c file did not import as the Hugging Face model it was written from"
"$bin/tessera-ckpt" to-llmc llmck back.bin > /dev/null
cmp gpt2.bin back.bin || fail "to-llmc did not write the llm.c file back byte for byte"
"$bin/tessera-ckpt" to-llmc llmck back16.bin --dtype bfloat16 > /dev/null
python3 -c '
import os, struct
h = struct.unpack("<8i", open("back16.bin", "rb").read(32))
assert h[:2] == (20240326, 5) and os.path.getsize("back16.bin") == 1024 + (os.path.getsize("gpt2.bin") - 1024) // 2, h'
"$bin/tessera-ckpt" from-llmc back16.bin llmck16 > /dev/null || fail "a bf16 llm.c file did not import"
python3 "$here/write_llmc_shard.py" tokens.bin gpt2 "$src/README.md" > /dev/null
expect_error "has magic 20240520, expected 20240326" "$bin/tessera-ckpt" from-llmc tokens.bin bad
head -c 3000 gpt2.bin > short.bin
expect_error "is 3000 bytes, but its header" "$bin/tessera-ckpt" from-llmc short.bin bad
expect_error "llm.c computes GELU's tanh approximation" "$bin/tessera-ckpt" to-llmc w2/checkpoint bad.bin
echo "llmc: an llm.c GPT-2 model file imported as the model it holds, exported byte for byte (f32) and in bf16"

echo "== tessera-data"
printf 'The quick brown fox jumps over the lazy dog.\n%.0s' {1..200} > book.txt
"$bin/tessera-data" prepare --out shards --name book book.txt
"$bin/tessera-data" info shards/book_train.bin | grep -q "byte tokens" || fail "info"
"$bin/tessera-train" "${tiny[@]}" --training.steps 5 --training.dataset shards \
  --training.train_shard shards/book_train.bin --training.val_shard shards/book_val.bin --job.dump_folder book > book.log
head -c 600 shards/book_train.bin > short.bin
expect_error "is truncated" "$bin/tessera-data" info short.bin
expect_error "is truncated" "$bin/tessera-train" "${tiny[@]}" --training.dataset shards \
  --training.train_shard short.bin --training.val_shard shards/book_val.bin
expect_error "does not exist" "$bin/tessera-data" info missing.bin

echo "== a byte-level BPE tokenizer (tokenizer.json)"
bpe=$src/tests/fixtures/bpe/tokenizer.json
"$bin/tessera-data" prepare --tokenizer "$bpe" --out shards --name bookbpe book.txt > bpe.log
grep -q -- "--training.tokenizer $bpe --model.vocab_size 1024" bpe.log || fail "prepare --tokenizer: $(cat bpe.log)"
"$bin/tessera-data" info --tokenizer "$bpe" shards/bookbpe_train.bin | grep -q 'begins: "The quick brown fox' ||
  fail "info --tokenizer does not show the text"
expect_error "model.vocab_size (256) is smaller than the vocabulary of training.tokenizer" \
  "$bin/tessera-train" "${tiny[@]}" --training.tokenizer "$bpe" --training.dataset text --training.text book.txt
# The text dataset through the tokenizer: shards named by its fingerprint, the
# tokenizer copied into the run folder, the sample and tessera-generate in text.
"$bin/tessera-train" "${tiny[@]}" --training.tokenizer "$bpe" --model.vocab_size 1088 --training.dataset text \
  --training.text book.txt --job.dump_folder bpe --checkpoint.enable true --sample.max_new_tokens 30 \
  --sample.prompt "The quick" > bpe-train.log
ls "$work"/data/book_bpe-*_train.bin > /dev/null || fail "no BPE shards in the data folder"
cmp -s "$bpe" bpe/tokenizer.json || fail "the tokenizer was not copied into the run folder"
grep -q "^The quick" bpe-train.log || fail "the sample does not start with its prompt: $(tail -5 bpe-train.log)"
"$bin/tessera-generate" --checkpoint bpe/checkpoint --sample.prompt "The quick" --sample.max_new_tokens 30 \
  > gen.out 2> gen.err
grep -q "tokenizer .*bpe/tokenizer.json (1024 tokens)" gen.err || fail "generate did not find the tokenizer: $(cat gen.err)"
grep -q "^The quick" gen.out && ! grep -q '\[[0-9]*\]' gen.out || fail "generate did not print text: $(cat gen.out)"
"$bin/tessera-ckpt" to-hf bpe/checkpoint bpehf > /dev/null
cmp -s "$bpe" bpehf/tokenizer.json || fail "to-hf did not take the tokenizer along"
"$bin/tessera-ckpt" from-hf bpehf bpeck > /dev/null
cmp -s "$bpe" bpeck/tokenizer.json || fail "from-hf did not take the tokenizer along"
echo '{"model": {"type": "Unigram"}}' > bad-tokenizer.json
expect_error "bad-tokenizer.json: model.type is 'Unigram'" "$bin/tessera-data" prepare --tokenizer bad-tokenizer.json book.txt
# A tokenizer.json beside a checkpoint that is a link to some other file is
# not carried into an export; an import refused for its config writes nothing.
cp -r bpe/checkpoint linked-ck
ln -sf /etc/hostname linked-ck/tokenizer.json
out=$("$bin/tessera-ckpt" to-hf linked-ck linkedhf 2>&1) || fail "to-hf with a bad tokenizer beside it: $out"
grep -q "note: .*tokenizer.json not copied" <<< "$out" || fail "to-hf did not say the tokenizer was left: $out"
[[ ! -e linkedhf/tokenizer.json ]] || fail "to-hf copied a link to /etc/hostname as the tokenizer"
cp -r bpehf badhf
sed -i 's/"n_head": 2/"n_head": 3/' badhf/config.json
expect_error "badhf/config.json's \"n_embd\" (64) must be divisible by" "$bin/tessera-ckpt" from-hf badhf badck
[[ ! -e badck ]] || fail "from-hf wrote a checkpoint for a config it refused"
echo "bpe: prepared, trained, sampled, generated and converted with a tokenizer.json"
echo "== a mixture of experts: EP 2 and EP 2 x TP 2 against one rank, traced, resumed on one rank, exported as Mixtral and back"
# moe-small made tiny; softmax router and the balance loss, so that the model is a Mixtral.
moe=(--preset moe-small --model.n_layer 2 --model.n_embd 64 --model.moe_hidden 48 --model.moe_experts 4
     --model.moe_router softmax --model.moe_balance aux_loss --training.batch_size 8 --training.seq_len 32
     --training.steps 8 --training.data_dir "$work/data" --sample.max_new_tokens 0 --metrics.progress off
     --metrics.log_interval 1)
"${mpi[@]}" -np 1 "$bin/tessera-train" "${moe[@]}" --job.dump_folder moe1 > moe1.log
"${mpi[@]}" -np 2 "$bin/tessera-train" "${moe[@]}" --job.dump_folder moe2 --parallelism.expert_parallel_degree 2 \
  --profiling.trace_steps 6 --checkpoint.enable true --checkpoint.interval 4 > moe2.log
"${mpi[@]}" -np 4 "$bin/tessera-train" "${moe[@]}" --job.dump_folder moetp --parallelism.expert_parallel_degree 2 \
  --parallelism.tensor_parallel_degree 2 --parallelism.enable_sequence_parallel true > moetp.log
grep -q "FSDP over 2 x expert parallel 2 (2 experts a layer per rank)" moe2.log || fail "moe2's mesh: $(head -5 moe2.log)"
grep -q "FSDP over 2 x expert parallel 2 (2 experts a layer per rank) x tensor parallel 2 (loss parallel) + sequence parallel" \
  moetp.log || fail "moetp's mesh: $(head -5 moetp.log)"
grep -q "experts max/mean" moe2.log || fail "moe2 did not log the experts' balance"
losses moe1 > moe1.losses
losses moe2 > moe2.losses
losses moetp > moetp.losses
close moe1.losses moe2.losses 1e-5 || fail "EP 2 drifted from one rank: $(paste moe1.losses moe2.losses)"
close moe1.losses moetp.losses 1e-5 || fail "EP 2 x TP 2 + SP drifted from one rank: $(paste moe1.losses moetp.losses)"
python3 -c '
import json, sys
rows = [json.loads(l) for l in open("moe2/metrics.jsonl")]
loads = [r["moe_tokens_per_expert"] for r in rows if "moe_tokens_per_expert" in r]
# 2 ranks x 4 sequences x 32 tokens, 2 experts each, per layer and step: 512 pairs over 4 experts.
assert loads and all(len(layer) == 4 and sum(layer) == 512 for step in loads for layer in step), loads[:2]
assert all(r["moe_max_over_mean"] >= 1 for r in rows if "moe_max_over_mean" in r)
events = json.load(open("moe2/traces/step-6.json"))["traceEvents"]
lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
spans = {}
for e in events:
    if e.get("ph") == "X":
        key = (e["pid"], lanes.get((e["pid"], e["tid"])), e["name"].split(" #")[0])
        spans[key] = spans.get(key, 0) + 1
for r in (0, 1):
    # 5 all-to-alls per MoE layer: the counts, then the rows (dispatch, combine, and both backwards).
    assert spans.get((r, "expert parallel all-to-all", "all_to_all"), 0) == 2, spans
    assert spans.get((r, "expert parallel all-to-all", "all_to_all_single"), 0) == 8, spans
    for phase in ("dispatch", "experts", "combine", "combine backward", "dispatch backward"):
        assert spans.get((r, "expert parallel", phase), 0) == 2, (phase, spans)
print("moe: tokens per expert in the metrics, dispatch and combine on the trace lanes")' || fail "the MoE run's metrics or trace"
if command -v gnuplot >/dev/null; then
  python3 "$src/tools/trace_png.py" moe2/traces/step-6.json moe2/step-6.png > tp.log || fail "trace_png: $(cat tp.log)"
  grep -q "moe2/step-6.png: 2 rank(s)" tp.log || fail "trace_png drew: $(cat tp.log)"
fi
# The EP 2 checkpoint of step 4 resumed on one rank (the experts resharded): steps 5-8 as the EP 2 run's.
cp -r moe2 moe1r
rm -rf moe1r/metrics.jsonl moe1r/checkpoint/step-00000008
"${mpi[@]}" -np 1 "$bin/tessera-train" "${moe[@]}" --job.dump_folder moe1r --checkpoint.enable true \
  --checkpoint.resume true > moe1r.log
grep -q "resumed from .*step-00000004" moe1r.log || fail "moe1r did not resume from step 4: $(head -5 moe1r.log)"
losses moe1r > moe1r.losses
tail -4 moe2.losses > moe2.tail
close moe2.tail moe1r.losses 1e-5 || fail "an EP 2 checkpoint resumed on one rank drifted: $(paste moe2.tail moe1r.losses)"
# Exported as Mixtral and imported again: the same tensors.
"$bin/tessera-ckpt" to-hf moe2/checkpoint moehf > to-hf.log
grep -q "MixtralForCausalLM" to-hf.log && grep -q '"model_type": "mixtral"' moehf/config.json || fail "to-hf: $(cat to-hf.log)"
"$bin/tessera-ckpt" from-hf moehf moeck > /dev/null
"$bin/tessera-ckpt" to-hf moeck moehf2 > /dev/null
same_tensors moehf/model.safetensors moehf2/model.safetensors || fail "Mixtral to-hf / from-hf / to-hf changed a tensor"
python3 -c '
import json, struct, sys
raw = open("moehf/model.safetensors", "rb").read()
head = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
experts = [k for k in head if ".block_sparse_moe.experts." in k]
assert len(experts) == 2 * 4 * 3 and "model.layers.1.block_sparse_moe.experts.3.w2.weight" in head, sorted(head)[:8]
assert head["model.layers.0.block_sparse_moe.gate.weight"]["shape"] == [4, 64]
assert not any("expert_bias" in k for k in head)' || fail "the Mixtral export's tensors"
echo "moe: EP 2 and EP 2 x TP 2 + SP = one rank, traced; resumed on one rank; Mixtral export round trip"

echo "train_test: all passed"
