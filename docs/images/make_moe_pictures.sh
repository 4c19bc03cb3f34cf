#!/usr/bin/env bash
# Makes the picture of docs/moe.md from a real run: one traced step (step 5)
# of the moe-small preset at expert parallel 2 on 2 ranks, one core each:
#   moe-ep2.png   each rank's compute, EP dispatch / combine phases, the
#                 expert-parallel all-to-alls, FSDP's collectives and waits
#
#   docs/images/make_moe_pictures.sh [BUILD]     (BUILD: build)
# Timing depends on the machine and its load; run it on an idle one with 2 cores.
set -euo pipefail
build=$(cd "${1:-build}" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
root_flag=$([[ $(id -u) == 0 ]] && echo --allow-run-as-root || true)
(cd "$work" && mpirun -np 2 --bind-to core $root_flag -x OMP_NUM_THREADS=1 "$build/tools/tessera-train" \
  --preset moe-small --parallelism.expert_parallel_degree 2 --training.steps 6 --profiling.trace_steps 5 \
  --sample.max_new_tokens 0 --metrics.progress off --job.dump_folder run > train.log)
tail -2 "$work/train.log"
python3 "$here/../../tools/trace_png.py" "$work/run/traces/step-5.json" "$here/moe-ep2.png" --width 1600 \
  --title "EP 2: moe-small (4 MoE blocks of 8 experts, top 2, d=128), one step on 2 ranks"
