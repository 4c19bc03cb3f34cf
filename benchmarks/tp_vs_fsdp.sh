#!/usr/bin/env bash
# Tensor parallelism against pure FSDP on this machine: tessera-train's Llama
# (4 layers, d=256, 8 heads, 4 key/value heads, no bias) for 40 steps at 2 and
# 4 ranks, FSDP over all ranks beside TP 2 (alone at 2 ranks, under FSDP 2 at
# 4) and TP 4, and TP 2 and 4 with sequence parallelism (SP): the median
# step time of the last five log windows (steps
# 16-40), the exposed-communication share, the peak memory per rank, and the
# step time as a ratio to FSDP's at the same rank count (> 1: slower).
# With `gpt2` as the second argument the same for tessera-train's GPT-2 (4
# layers, d=256, 8 heads, biases; its fused c_attn split per block).
# Not a test: a table for benchmarks/README.md.
#   benchmarks/tp_vs_fsdp.sh [build] [llama|gpt2]       (default build/, llama)
set -euo pipefail
build=${1:-build}
arch=${2:-llama}
bin=$(cd "$build/tools" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
root=(); [[ $(id -u) == 0 ]] && root=(--allow-run-as-root)
case $arch in
  llama) model=(--model.arch llama --model.n_head 8 --model.n_kv_head 4 --model.bias false) ;;
  gpt2) model=(--model.arch gpt2 --model.n_head 8) ;;
  *) echo "tp_vs_fsdp.sh: expected llama or gpt2, got '$arch'" >&2; exit 2 ;;
esac
median() { sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
fsdp_ms=0
measure() {
  local np=$1 tp=$2 sp=${3:-false}
  rm -rf "$work/out"
  OMP_NUM_THREADS=1 mpirun -np "$np" --oversubscribe --bind-to none "${root[@]}" "$bin/tessera-train" "${model[@]}" \
    --parallelism.tensor_parallel_degree "$tp" --parallelism.enable_sequence_parallel "$sp" \
    --training.steps 40 --metrics.log_interval 5 \
    --training.eval_interval 1000 --metrics.plot "" --metrics.progress off --sample.max_new_tokens 0 \
    --training.data_dir "$PWD/data" --job.dump_folder "$work/out" >"$work/log" 2>&1 || { cat "$work/log"; exit 1; }
  local tokens ms exposed peak mesh
  tokens=$(awk '/tokens\/step/ { for (i = 1; i <= NF; ++i) if ($i == "tokens/step") print $(i - 1) }' "$work/log")
  ms=$(grep -o '"tokens_per_s":[0-9.]*' "$work/out/metrics.jsonl" | tail -5 | cut -d: -f2 |
    awk -v t="$tokens" '{ printf "%.1f\n", 1000 * t / $1 }' | median)
  exposed=$(grep -o '"exposed_comm_pct_max_rank":[0-9.]*' "$work/out/metrics.jsonl" | tail -5 | cut -d: -f2 | median)
  peak=$(grep -o '"peak_mem_mib_max_rank":[0-9.]*' "$work/out/metrics.jsonl" | tail -1 | cut -d: -f2)
  mesh=$(grep -o 'rank(s): [^|]*' "$work/log" | head -1 | cut -d' ' -f2- | sed 's/ *$//')
  [[ $tp == 1 ]] && fsdp_ms=$ms
  awk -v np="$np" -v mesh="$mesh" -v ms="$ms" -v e="$exposed" -v p="$peak" -v f="$fsdp_ms" \
    'BEGIN { printf "| %d | %s | %.1f | %.1f%% | %.1f | %.2f |\n", np, mesh, ms, e, p, ms / f }'
}
echo "| ranks | mesh | ms/step | exposed | peak MiB/rank | vs FSDP |"
echo "|---|---|---|---|---|---|"
measure 2 1
measure 2 2
measure 2 2 true
measure 4 1
measure 4 2
measure 4 2 true
measure 4 4
measure 4 4 true
