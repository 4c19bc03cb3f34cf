#!/usr/bin/env bash
# Prints the figures of docs/tensor-parallel.md's sequence-parallel section
# (between its numbers markers): tessera-train's default model as a Llama at
# TP 2 on 2 ranks, with and without sequence parallelism, from tessera-plan
# (whose counts and peaks the plan tests check against real runs, to the
# byte). The test docs-numbers reruns it and compares.
#   docs/tp_numbers.sh [BUILD]
set -euo pipefail
# Planned on the baseline copy's libraries, the same on every CPU (docs/cpu.md).
export TESSERA_CPU_ISA=baseline
build=${1:-build}
args=(--ranks 2 --model.arch llama --model.bias false --model.tie_embeddings false
      --parallelism.tensor_parallel_degree 2)
plan() { "$build/tools/tessera-plan" "${args[@]}" "$@"; }
sp=$(plan --parallelism.enable_sequence_parallel true)
plain=$(plan)
layers=$("$build/tools/tessera-train" --model.arch llama --print-config | sed -n 's/^n_layer = //p')
peak() { awk '/predicted peak/ { print $3 }' <<< "$1"; }
read -r ag rs ar < <(awk '/^  tp / { print $3, $5, $7 }' <<< "$sp")
echo "At tessera-train's default model as a Llama ($layers layers, TP 2:"
echo "\`tessera-plan ${args[*]} --parallelism.enable_sequence_parallel true\`)"
echo "the planner counts $ag all-gathers, $rs"
echo "reduce-scatters and $ar all-reduces per step on the \`tp\` group ($((2 * layers + 1)) of them the norms',"
echo "$((ar - 2 * layers - 1)) the vocabulary-parallel loss's), and predicts the peak of the run exactly:"
echo "$(peak "$sp") MiB per rank against $(peak "$plain") without sequence parallelism (the plan tests"
echo "check such plans against real runs, to the byte; the same tessera-train run measures the same)."
