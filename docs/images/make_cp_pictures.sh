#!/usr/bin/env bash
# Makes the pictures of docs/context-parallel.md from real runs: one traced
# step of bench_context_parallel (a Llama of 2 blocks, d=128, one sequence of
# 2048 tokens, CP 2 with the all-gather, one core per rank), head-tail and
# contiguous:
#   cp-head-tail.png    the sequence in 4 chunks, rank r holding r and 3 - r
#   cp-contiguous.png   rank r holding the r-th half
#
#   docs/images/make_cp_pictures.sh [BUILD]     (BUILD: build)
# Timing depends on the machine and its load; run it on an idle one with 2 cores.
set -euo pipefail
build=${1:-build}
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
root_flag=$([[ $(id -u) == 0 ]] && echo --allow-run-as-root || true)
mpirun -np 2 --bind-to core $root_flag -x OMP_NUM_THREADS=1 "$build/benchmarks/bench_context_parallel" 2048 128 1 \
  "$work" > "$work/bench.txt"
cat "$work/bench.txt"
for layout in head-tail contiguous; do
  python3 "$here/../../tools/trace_png.py" "$work/allgather-$layout.json" "$here/cp-$layout.png" --width 1600 \
    --title "CP 2, all-gather, $layout: one step of a Llama (2 blocks, d=128) on a sequence of 2048 tokens"
done
