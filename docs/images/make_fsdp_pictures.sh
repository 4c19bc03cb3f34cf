#!/usr/bin/env bash
# Makes the pictures of docs/fsdp-pictures.md from real runs: the default
# model (4 blocks, d=256) on 2 ranks, one traced step each of
#   fsdp-prefetch-on.png    the default: each group's all-gather issued ahead
#   fsdp-prefetch-off.png   --parallelism.prefetch false
#   fsdp-reshard-off.png    --parallelism.reshard_after_forward false (ZeRO-2)
#   fsdp-hsdp.png           4 ranks, --parallelism.data_parallel_replicate_degree 2
#
#   docs/images/make_fsdp_pictures.sh [BUILD]     (BUILD: build)
# Timing depends on the machine and its load; run it on an idle one.
set -euo pipefail
build=${1:-build}
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
root_flag=$([[ $(id -u) == 0 ]] && echo --allow-run-as-root || true)
run() {  # NAME RANKS ARGS...: trains 4 steps, traces the 3rd
  local name=$1 np=$2; shift 2
  mpirun -np "$np" --oversubscribe --bind-to none $root_flag "$build/tools/tessera-train" --training.steps 4 \
    --profiling.trace_steps 3 --metrics.progress off --sample.max_new_tokens 0 --job.dump_folder "$work/$name" \
    --training.data_dir "$work/data" "$@" > "$work/$name.log"
  python3 "$here/../../tools/trace_png.py" "$work/$name/traces/step-3.json" "$here/fsdp-$name.png" \
    --title "$TITLE" --width 1600
}
TITLE="FSDP, 2 ranks, default: forward and backward prefetch" run prefetch-on 2
TITLE="FSDP, 2 ranks, prefetch off: each all-gather issued when its block runs" run prefetch-off 2 --parallelism.prefetch false
TITLE="FSDP, 2 ranks, reshard_after_forward false (ZeRO-2): no all-gather in backward" run reshard-off 2 \
  --parallelism.reshard_after_forward false
TITLE="HSDP, 4 ranks as 2 replicas x 2 shards: reduce-scatter in the pair, all-reduce across" run hsdp 4 \
  --parallelism.data_parallel_replicate_degree 2
ls -l "$here"/fsdp-*.png
